//! Latency of one short command: Waymark's executor over a warm pool, side by side with
//! OpenSSH `ssh` (multiplexed over a ControlMaster, and fresh per call), against one local
//! OpenSSH sshd started by the test kit.
//!
//! ```text
//! cargo run --release -p waymark-ssh --example bench_latency [-- ITERATIONS]
//! ```
//!
//! Not a timed test: it prints medians and ratios and asserts nothing.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use waymark_ssh::wrapper::{RemoteDir, RemoteWrapper, StartOptions};
use waymark_ssh::{Credential, DispatchOutcome, DispatchRequest, Executor, HostConfig};
use waymark_testkit::{output_within, TestSshd};

const CROCKFORD: &[u8] = b"0123456789ABCDEFGHJKMNPQRSTVWXYZ";

fn new_id(n: u64) -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    let mut v: u128 = (nanos << 20) ^ u128::from(n);
    let mut chars = [b'0'; 26];
    for c in chars.iter_mut().rev() {
        *c = CROCKFORD[(v & 31) as usize];
        v >>= 5;
    }
    format!("act_{}", std::str::from_utf8(&chars).unwrap())
}

fn median(mut samples: Vec<Duration>) -> Duration {
    samples.sort();
    samples[samples.len() / 2]
}

fn ms(d: Duration) -> String {
    format!("{:8.2} ms", d.as_secs_f64() * 1000.0)
}

fn time_ssh(cmd: &mut Command) -> Duration {
    cmd.stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    let start = Instant::now();
    let status = cmd.status().expect("run ssh");
    let elapsed = start.elapsed();
    assert!(status.success(), "ssh failed: {status}");
    elapsed
}

fn mux_command(sshd: &TestSshd, control: &Path) -> Command {
    let mut cmd = sshd.ssh_command();
    cmd.args(["-o", "ControlMaster=auto", "-o"])
        .arg(format!("ControlPath={}", control.display()))
        .args(["-o", "ControlPersist=60"]);
    cmd
}

fn main() {
    let iterations: usize = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(200);
    let sshd = TestSshd::new();
    let dir = tempfile::tempdir().unwrap();
    let mut config = HostConfig::new(
        "bench",
        "127.0.0.1",
        sshd.user(),
        Credential::KeyFile {
            path: sshd.user_key_path().to_path_buf(),
            passphrase_env: None,
        },
        sshd.known_hosts_path(),
    );
    config.port = sshd.port();
    let exec = Executor::new(config.clone()).unwrap();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();

    // Waymark: dispatch `true` through the wrapper's `run`, warm pool.
    let mut counter = 0u64;
    let mut waymark = Vec::with_capacity(iterations);
    let mut status = Vec::with_capacity(iterations);
    runtime.block_on(async {
        exec.connect().await.unwrap();
        for i in 0..iterations + 10 {
            counter += 1;
            let request = DispatchRequest {
                execution_id: new_id(counter),
                argv: vec!["true".into()],
                ..Default::default()
            };
            let start = Instant::now();
            let outcome = exec.dispatch(&request, |_| {}).await.unwrap();
            let elapsed = start.elapsed();
            assert!(matches!(outcome, DispatchOutcome::Completed(_)));
            let start = Instant::now();
            exec.status(&request.execution_id).await.unwrap();
            let status_elapsed = start.elapsed();
            if i >= 10 {
                waymark.push(elapsed);
                status.push(status_elapsed);
            }
        }
    });

    // Waymark cold: a new executor per call (connect, authenticate, check the wrapper, run).
    let cold_n = iterations.min(20);
    let mut cold = Vec::with_capacity(cold_n);
    runtime.block_on(async {
        for _ in 0..cold_n {
            counter += 1;
            let request = DispatchRequest {
                execution_id: new_id(counter),
                argv: vec!["true".into()],
                ..Default::default()
            };
            let start = Instant::now();
            let fresh_exec = Executor::new(config.clone()).unwrap();
            fresh_exec.dispatch(&request, |_| {}).await.unwrap();
            cold.push(start.elapsed());
        }
    });

    // OpenSSH, multiplexed over one ControlMaster (warmed up first).
    let control = dir.path().join("cm");
    for _ in 0..5 {
        time_ssh(mux_command(&sshd, &control).arg("true"));
    }
    let mux: Vec<_> = (0..iterations)
        .map(|_| time_ssh(mux_command(&sshd, &control).arg("true")))
        .collect();

    // The same `run true` line through the multiplexed ssh: the wrapper's own cost.
    let wrapper = RemoteWrapper::new(RemoteDir::new(&config.remote_dir).unwrap());
    let mux_wrapped: Vec<_> = (0..iterations)
        .map(|_| {
            counter += 1;
            let line = wrapper
                .run(&new_id(counter), &StartOptions::default(), &["true"])
                .unwrap();
            time_ssh(mux_command(&sshd, &control).arg(line))
        })
        .collect();

    // OpenSSH, a fresh connection per call.
    let fresh_n = iterations.min(50);
    let fresh: Vec<_> = (0..fresh_n)
        .map(|_| time_ssh(sshd.ssh_command().arg("true")))
        .collect();
    output_within(
        mux_command(&sshd, &control).args(["-O", "exit"]),
        Duration::from_secs(10),
    );

    let waymark = median(waymark);
    let status = median(status);
    let mux = median(mux);
    let mux_wrapped = median(mux_wrapped);
    let fresh = median(fresh);
    let cold = median(cold);
    let ratio = |a: Duration, b: Duration| a.as_secs_f64() / b.as_secs_f64();
    println!(
        "median latency, {iterations} iterations (fresh ssh: {fresh_n}, cold waymark: {cold_n}):"
    );
    println!(
        "  waymark dispatch `true` via wrapper run, warm pool  {}",
        ms(waymark)
    );
    println!(
        "  waymark status (wrapper, no command), warm pool     {}",
        ms(status)
    );
    println!(
        "  ssh multiplexed (ControlMaster) `true`              {}",
        ms(mux)
    );
    println!(
        "  ssh multiplexed, same wrapper `run true` line       {}",
        ms(mux_wrapped)
    );
    println!(
        "  ssh fresh connection per call `true`                {}",
        ms(fresh)
    );
    println!(
        "  waymark cold: new connection + wrapper check + run  {}",
        ms(cold)
    );
    println!(
        "ratios: waymark/mux {:.2}x (target <= 1.5x), waymark/mux-wrapped {:.2}x, fresh/mux {:.2}x, waymark/fresh {:.2}x",
        ratio(waymark, mux),
        ratio(waymark, mux_wrapped),
        ratio(fresh, mux),
        ratio(waymark, fresh),
    );
}
