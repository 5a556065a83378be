//! Shared helpers for the executor's tests against a real OpenSSH sshd.
#![allow(dead_code)]

use std::future::Future;
use std::path::{Path, PathBuf};
use std::time::Duration;

use waymark_ssh::wrapper::RunReport;
use waymark_ssh::{Credential, DispatchOutcome, DispatchRequest, Error, Executor, HostConfig};
use waymark_testkit::{FaultProxy, TestSshd};

pub use waymark_testkit::new_id;

/// The key file at `path`, its passphrase (if encrypted) from the variable `passphrase_env`.
pub fn key_file(path: &Path, passphrase_env: Option<&str>) -> Credential {
    Credential::KeyFile {
        path: path.to_path_buf(),
        passphrase_env: passphrase_env.map(str::to_owned),
    }
}

/// Runs `sh -c script` once on a fresh executor for `config`.
pub async fn dispatch_once(config: HostConfig, script: &str) -> Result<DispatchOutcome, Error> {
    Executor::new(config)
        .expect("valid host config")
        .dispatch(&sh(script), |_| {})
        .await
}

/// A host config that reaches `sshd` directly, with short keepalive and connect bounds.
pub fn config(sshd: &TestSshd) -> HostConfig {
    let mut c = HostConfig::new(
        "testhost",
        "127.0.0.1",
        sshd.user(),
        key_file(sshd.user_key_path(), None),
        sshd.known_hosts_path(),
    );
    c.port = sshd.port();
    c.keepalive_interval = Duration::from_secs(1);
    c.keepalive_max = 2;
    c.connect_timeout = Duration::from_secs(5);
    c
}

/// A host config that reaches `sshd` through `proxy`, with a known_hosts file (written in
/// `dir`) that pins sshd's key under the proxy's port.
pub fn config_via(sshd: &TestSshd, proxy: &FaultProxy, dir: &Path) -> HostConfig {
    let known_hosts = dir.join(format!("known_hosts.proxy.{}", proxy.port()));
    std::fs::write(
        &known_hosts,
        format!(
            "[127.0.0.1]:{} {}\n",
            proxy.port(),
            sshd.host_key_public_openssh()
        ),
    )
    .expect("write proxy known_hosts");
    let mut c = config(sshd);
    c.port = proxy.port();
    c.known_hosts = known_hosts;
    c
}

/// argv from string slices.
pub fn argv(words: &[&str]) -> Vec<String> {
    words.iter().map(|w| w.to_string()).collect()
}

/// A request with a fresh ID running `sh -c script`.
pub fn sh(script: &str) -> DispatchRequest {
    DispatchRequest {
        execution_id: new_id(),
        argv: argv(&["sh", "-c", script]),
        ..Default::default()
    }
}

/// Runs `fut`, failing the test if it takes longer than `secs`.
pub async fn within<F: Future>(secs: u64, what: &str, fut: F) -> F::Output {
    match tokio::time::timeout(Duration::from_secs(secs), fut).await {
        Ok(v) => v,
        Err(_) => panic!("{what}: did not finish within {secs} s"),
    }
}

/// The run report of a dispatch that must have run.
pub fn ran(outcome: DispatchOutcome) -> RunReport {
    match outcome {
        DispatchOutcome::Completed(report) => report,
        DispatchOutcome::AlreadyStarted(status) => {
            panic!("expected the command to run, but its ID was taken: {status:?}")
        }
    }
}

/// Polls `done` every 50 ms until it holds, failing after `secs`.
pub async fn eventually(secs: u64, what: &str, mut done: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(secs);
    while !done() {
        if tokio::time::Instant::now() > deadline {
            panic!("{what}: not true within {secs} s");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The lines of a file on the "host" (the sshd's remote HOME), empty if missing.
pub fn host_file_lines(sshd: &TestSshd, name: &str) -> Vec<String> {
    let path: PathBuf = sshd.remote_home().join(name);
    std::fs::read_to_string(path)
        .map(|s| s.lines().map(str::to_owned).collect())
        .unwrap_or_default()
}
