//! Host keys and user keys: what is refused, how it is explained, and that every refusal is
//! `NotSent`.

mod common;

use common::{config, dispatch_once, key_file, ran, sh, within};
use waymark_ssh::{ConnectError, Error, Executor, HostKeyPolicy, HostKeyProblem};
use waymark_testkit::{generate_user_key, TestSshd};

fn connect_error(err: Error) -> ConnectError {
    match err {
        Error::NotSent(e) => e,
        other => panic!("expected NotSent, got {other}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unknown_host_key_is_refused_with_its_fingerprint_and_how_to_pin_it() {
    let sshd = TestSshd::new();
    let dir = tempfile::tempdir().unwrap();
    let mut config = config(&sshd);
    config.known_hosts = dir.path().join("known_hosts");
    std::fs::write(&config.known_hosts, "# nothing pinned\n").unwrap();
    let exec = Executor::new(config.clone()).unwrap();
    within(20, "unknown key", async {
        let err = exec.dispatch(&sh("echo no"), |_| {}).await.unwrap_err();
        let message = err.to_string();
        eprintln!("{message}");
        let ConnectError::HostKey(rejection) = connect_error(err) else {
            panic!("expected a host key refusal: {message}");
        };
        assert_eq!(rejection.fingerprint, sshd.host_key_fingerprint_sha256());
        match rejection.problem {
            HostKeyProblem::Unknown { line_to_add, .. } => assert_eq!(
                line_to_add,
                format!(
                    "[127.0.0.1]:{} {}",
                    sshd.port(),
                    sshd.host_key_public_openssh()
                )
            ),
            other => panic!("expected an unknown key, got {other:?}"),
        }
        assert!(message.contains("host testhost"), "{message}");
        assert!(
            message.contains(sshd.host_key_fingerprint_sha256()),
            "{message}"
        );
        assert!(
            message.contains("waymark hosts trust testhost"),
            "{message}"
        );
        assert!(message.contains("nothing was sent"), "{message}");
        // Nothing was learned under the strict policy.
        assert_eq!(
            std::fs::read_to_string(&config.known_hosts).unwrap(),
            "# nothing pinned\n"
        );
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_changed_host_key_is_refused_loudly_naming_the_file_and_line() {
    let sshd = TestSshd::new();
    let dir = tempfile::tempdir().unwrap();
    let impostor = generate_user_key(dir.path(), "impostor", None);
    let mut config = config(&sshd);
    config.known_hosts = dir.path().join("known_hosts");
    std::fs::write(
        &config.known_hosts,
        format!(
            "# pinned long ago\nother.example ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIPEtGZvHz9p1Zhumx9HuP7wayxSyVYTGVU5pleTRdjNL\n[127.0.0.1]:{} {}\n",
            sshd.port(),
            impostor.public_openssh()
        ),
    )
    .unwrap();
    // Accept-new never overrides a changed key.
    config.host_key_policy = HostKeyPolicy::AcceptNew;
    let exec = Executor::new(config.clone()).unwrap();
    within(20, "changed key", async {
        let err = exec.dispatch(&sh("echo no"), |_| {}).await.unwrap_err();
        let message = err.to_string();
        eprintln!("{message}");
        let ConnectError::HostKey(rejection) = connect_error(err) else {
            panic!("expected a host key refusal: {message}");
        };
        assert_eq!(rejection.problem, HostKeyProblem::Changed { line: 3 });
        assert_eq!(rejection.known_hosts, config.known_hosts);
        assert!(message.contains("HOST KEY CHANGED"), "{message}");
        assert!(
            message.contains(&format!("{} line 3", config.known_hosts.display())),
            "{message}"
        );
        assert!(
            message.contains(sshd.host_key_fingerprint_sha256()),
            "{message}"
        );
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hashed_known_hosts_entry_is_accepted() {
    let sshd = TestSshd::new();
    let mut config = config(&sshd);
    config.known_hosts = sshd.write_hashed_known_hosts();
    let text = std::fs::read_to_string(&config.known_hosts).unwrap();
    assert!(text.starts_with("|1|"), "not hashed: {text}");
    let exec = Executor::new(config).unwrap();
    within(20, "hashed", async {
        let report = ran(exec.dispatch(&sh("echo hashed"), |_| {}).await.unwrap());
        assert_eq!(report.stdout.inline(), Some(&b"hashed\n"[..]));
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_user_key_is_refused_as_not_sent() {
    let sshd = TestSshd::new();
    let dir = tempfile::tempdir().unwrap();
    let stranger = generate_user_key(dir.path(), "stranger", None);
    let mut config = config(&sshd);
    config.credential = key_file(stranger.path(), None);
    let exec = Executor::new(config).unwrap();
    within(20, "wrong key", async {
        let err = exec.dispatch(&sh("echo no"), |_| {}).await.unwrap_err();
        let message = err.to_string();
        match connect_error(err) {
            ConnectError::AuthRejected { user, method, .. } => {
                assert_eq!(user, sshd.user());
                assert!(method.contains("stranger"), "{method}");
            }
            other => panic!("expected AuthRejected, got {other}"),
        }
        assert!(message.contains("authorized_keys"), "{message}");

        let mut missing = config_missing_key(&sshd, dir.path());
        missing.name = "web1".into();
        let err = dispatch_once(missing, "echo no").await.unwrap_err();
        assert!(
            matches!(err, Error::NotSent(ConnectError::KeyFile { .. })),
            "{err}"
        );
        assert!(err.to_string().contains("host web1"), "{err}");
    })
    .await;
}

fn config_missing_key(sshd: &TestSshd, dir: &std::path::Path) -> waymark_ssh::HostConfig {
    let mut c = config(sshd);
    c.credential = key_file(&dir.join("no-such-key"), None);
    c
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn accept_new_pins_a_key_only_after_authentication_succeeds() {
    let sshd = TestSshd::new();
    let dir = tempfile::tempdir().unwrap();
    let stranger = generate_user_key(dir.path(), "stranger", None);
    let known_hosts = dir.path().join("ssh").join("known_hosts");
    let mut refused = config(&sshd);
    refused.known_hosts = known_hosts.clone();
    refused.host_key_policy = HostKeyPolicy::AcceptNew;
    refused.credential = key_file(stranger.path(), None);
    within(30, "accept-new", async {
        let err = dispatch_once(refused.clone(), "echo no").await.unwrap_err();
        assert!(
            matches!(err, Error::NotSent(ConnectError::AuthRejected { .. })),
            "{err}"
        );
        assert!(
            !known_hosts.exists() || std::fs::read_to_string(&known_hosts).unwrap().is_empty(),
            "a key was pinned although authentication failed"
        );

        let mut accepted = refused.clone();
        accepted.credential = config(&sshd).credential;
        let report = ran(dispatch_once(accepted, "echo yes").await.unwrap());
        assert_eq!(report.stdout.inline(), Some(&b"yes\n"[..]));
        let pinned = std::fs::read_to_string(&known_hosts).unwrap();
        assert_eq!(
            pinned,
            format!(
                "[127.0.0.1]:{} {}\n",
                sshd.port(),
                sshd.host_key_public_openssh()
            )
        );

        // From now on the strict policy accepts it too, and nothing is appended twice.
        let mut strict = config(&sshd);
        strict.known_hosts = known_hosts.clone();
        ran(dispatch_once(strict, "true").await.unwrap());
        let mut again = refused.clone();
        again.credential = config(&sshd).credential;
        ran(dispatch_once(again, "true").await.unwrap());
        assert_eq!(std::fs::read_to_string(&known_hosts).unwrap(), pinned);
    })
    .await;
}
