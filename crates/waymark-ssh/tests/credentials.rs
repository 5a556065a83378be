//! Credentials that come from the environment: an encrypted key's passphrase, and ssh-agent.
//!
//! One test function on purpose: it sets process environment variables, which must happen
//! before any other thread (the tokio runtime, another test) can read the environment.

mod common;

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{config, dispatch_once, key_file, ran, within};
use waymark_ssh::{ConnectError, Credential, Error};
use waymark_testkit::{output_within, require_tool, TestSshd};

const PASSPHRASE_VAR: &str = "WAYMARK_TEST_KEY_PASSPHRASE";
const UNSET_VAR: &str = "WAYMARK_TEST_PASSPHRASE_NOT_SET";
const WRONG_VAR: &str = "WAYMARK_TEST_PASSPHRASE_WRONG";

struct Agent {
    child: Child,
}

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start_agent(socket: &std::path::Path) -> Agent {
    let program = require_tool("ssh-agent", "install it (apt-get install openssh-client)");
    let child = Command::new(program)
        .arg("-D")
        .arg("-a")
        .arg(socket)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start ssh-agent");
    let deadline = Instant::now() + Duration::from_secs(5);
    while !socket.exists() {
        assert!(
            Instant::now() < deadline,
            "ssh-agent did not create its socket"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    Agent { child }
}

#[test]
fn credentials_from_the_environment() {
    let sshd = TestSshd::new();
    let dir = tempfile::tempdir().unwrap();
    let encrypted = sshd.add_encrypted_user_key("correct horse battery staple");
    let socket = dir.path().join("agent.sock");
    let _agent = start_agent(&socket);
    let ssh_add = require_tool("ssh-add", "install it (apt-get install openssh-client)");
    let added = output_within(
        Command::new(ssh_add)
            .arg(sshd.user_key_path())
            .env("SSH_AUTH_SOCK", &socket),
        Duration::from_secs(10),
    );
    assert!(added.status.success(), "ssh-add: {:?}", added);

    // All environment changes happen here, before any other thread exists.
    std::env::set_var(PASSPHRASE_VAR, "correct horse battery staple");
    std::env::remove_var(UNSET_VAR);
    std::env::set_var(WRONG_VAR, "wrong passphrase value");
    std::env::set_var("SSH_AUTH_SOCK", &socket);

    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(within(40, "credentials", async {
        // An encrypted key, passphrase from the named variable.
        let mut with_passphrase = config(&sshd);
        with_passphrase.credential = key_file(encrypted.path(), Some(PASSPHRASE_VAR));
        let report = ran(dispatch_once(with_passphrase.clone(), "echo decrypted").await.unwrap());
        assert_eq!(report.stdout.inline(), Some(&b"decrypted\n"[..]));

        // The variable is missing: a clear error naming it, classified NotSent.
        let mut missing = with_passphrase.clone();
        missing.credential = key_file(encrypted.path(), Some(UNSET_VAR));
        let err = dispatch_once(missing, "echo no").await.unwrap_err();
        assert!(
            matches!(&err, Error::NotSent(ConnectError::PassphraseMissing { var, .. }) if var == UNSET_VAR),
            "{err}"
        );
        assert!(err.to_string().contains(UNSET_VAR), "{err}");

        // An encrypted key without any passphrase variable configured.
        let mut unconfigured = with_passphrase.clone();
        unconfigured.credential = key_file(encrypted.path(), None);
        let err = dispatch_once(unconfigured, "echo no").await.unwrap_err();
        assert!(
            matches!(err, Error::NotSent(ConnectError::KeyFile { .. })),
            "{err}"
        );
        assert!(err.to_string().contains("passphrase_env"), "{err}");

        // A wrong passphrase never shows up in the message.
        let mut wrong = with_passphrase.clone();
        wrong.credential = key_file(encrypted.path(), Some(WRONG_VAR));
        let err = dispatch_once(wrong, "echo no").await.unwrap_err();
        assert!(err.is_not_sent(), "{err}");
        assert!(!err.to_string().contains("wrong passphrase value"), "{err}");

        // ssh-agent at SSH_AUTH_SOCK.
        let mut agent = config(&sshd);
        agent.credential = Credential::Agent;
        let report = ran(dispatch_once(agent, "echo via agent").await.unwrap());
        assert_eq!(report.stdout.inline(), Some(&b"via agent\n"[..]));
    }));
}
