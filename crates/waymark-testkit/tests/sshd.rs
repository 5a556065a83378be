//! Behaviour of `TestSshd` against the real OpenSSH client.

mod common;

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, SystemTime};

use waymark_testkit::{generate_user_key, output_within, wait_within, SshdOptions, TestSshd};

use common::{text, wait_until, LIMIT};

fn assert_success(out: &Output, sshd: &TestSshd) {
    assert!(
        out.status.success(),
        "ssh failed ({}): {}\n--- sshd log ---\n{}",
        out.status,
        text(&out.stderr),
        sshd.log()
    );
}

/// `ssh_command()` with `first` placed before the kit's options; ssh keeps the first value it
/// sees for an option, so this is how a test overrides one.
fn ssh_with_first(sshd: &TestSshd, first: &[&str]) -> Command {
    let base = sshd.ssh_command();
    let mut cmd = Command::new(base.get_program());
    cmd.args(first).args(base.get_args());
    cmd
}

#[test]
fn openssh_client_runs_a_command() {
    let sshd = TestSshd::new();
    let out = output_within(sshd.ssh_command().arg("echo hi"), LIMIT);
    assert_success(&out, &sshd);
    assert_eq!(text(&out.stdout), "hi\n");
    assert!(
        sshd.log().contains("Accepted publickey for"),
        "{}",
        sshd.log()
    );
}

#[test]
fn tilde_and_home_resolve_to_the_temp_remote_home() {
    let sshd = TestSshd::new();
    assert!(
        !sshd.remote_dir().exists(),
        "remote_dir is left for the wrapper to create"
    );
    let out = output_within(
        sshd.ssh_command()
            .arg(r#"printf '%s\n' ~ "$HOME"; mkdir -p ~/.waymark && echo x > ~/.waymark/probe"#),
        LIMIT,
    );
    assert_success(&out, &sshd);
    let home = sshd.remote_home().display().to_string();
    assert_eq!(text(&out.stdout), format!("{home}\n{home}\n"));
    assert_eq!(
        fs::read_to_string(sshd.remote_dir().join("probe")).unwrap(),
        "x\n"
    );
}

#[test]
fn restart_keeps_the_port_and_a_detached_command_completes() {
    let sshd = TestSshd::new();
    let done = sshd.remote_home().join("done");
    let detached = format!(
        r#"setsid sh -c "sleep 3; echo done > {}" >/dev/null 2>&1 </dev/null &"#,
        done.display()
    );
    let out = output_within(sshd.ssh_command().arg(&detached), LIMIT);
    assert_success(&out, &sshd);

    let (port, pid) = (sshd.port(), sshd.listener_pid());
    let pid_file = || fs::read_to_string(sshd.dir().join("sshd.pid")).unwrap();
    assert_eq!(pid_file().trim(), pid.unwrap().to_string());
    sshd.restart();
    assert_eq!(pid_file().trim(), sshd.listener_pid().unwrap().to_string());
    let restarted_at = SystemTime::now();
    assert_eq!(sshd.port(), port);
    assert!(sshd.listener_pid().is_some());
    assert_ne!(
        sshd.listener_pid(),
        pid,
        "restart must start a new listener"
    );

    let out = output_within(sshd.ssh_command().arg("echo after-restart"), LIMIT);
    assert_success(&out, &sshd);
    assert_eq!(text(&out.stdout), "after-restart\n");

    assert!(
        wait_until(Duration::from_secs(8), || fs::read_to_string(&done)
            .is_ok_and(|s| s == "done\n")),
        "the detached command did not complete after the restart\n{}",
        sshd.log()
    );
    let written = fs::metadata(&done).unwrap().modified().unwrap();
    assert!(
        written >= restarted_at,
        "the command finished before the restart, so this run proved nothing"
    );
}

#[test]
fn restart_does_not_end_a_live_session() {
    let sshd = TestSshd::new();
    let started = sshd.remote_home().join("started");
    let mut session = sshd
        .ssh_command()
        .arg("touch ~/started; sleep 2; echo survived")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    assert!(wait_until(LIMIT, || started.exists()), "{}", sshd.log());
    sshd.restart();
    let status = wait_within(&mut session, LIMIT);
    let out = session.wait_with_output().unwrap();
    assert!(
        status.is_some_and(|s| s.success()),
        "session ended by restart ({status:?}): {}",
        text(&out.stderr)
    );
    assert_eq!(text(&out.stdout), "survived\n");
}

#[test]
fn stop_refuses_connections_and_start_serves_again() {
    let sshd = TestSshd::new();
    sshd.stop();
    assert!(!sshd.is_running());
    assert!(std::net::TcpStream::connect(sshd.addr()).is_err());
    sshd.start();
    assert!(sshd.is_running());
    let out = output_within(sshd.ssh_command().arg("echo back"), LIMIT);
    assert_success(&out, &sshd);
    assert_eq!(text(&out.stdout), "back\n");
}

#[test]
fn max_sessions_reaches_the_effective_config() {
    let default = TestSshd::new();
    assert!(
        default
            .effective_config()
            .lines()
            .any(|l| l == "maxsessions 10"),
        "{}",
        default.effective_config()
    );
    let limited = TestSshd::with_options(SshdOptions::default().max_sessions(3));
    assert!(
        limited
            .effective_config()
            .lines()
            .any(|l| l == "maxsessions 3"),
        "{}",
        limited.effective_config()
    );
}

#[test]
fn extra_config_overrides_defaults_and_match_blocks_go_last() {
    let sshd = TestSshd::with_options(
        SshdOptions::default()
            .extra_config("ClientAliveInterval 7")
            .extra_config("Match User no-such-user")
            .extra_config("    MaxSessions 1"),
    );
    let config = sshd.effective_config();
    assert!(
        config.lines().any(|l| l == "clientaliveinterval 7"),
        "{config}"
    );
    assert!(config.lines().any(|l| l == "maxsessions 10"), "{config}");
    let out = output_within(sshd.ssh_command().arg("true"), LIMIT);
    assert_success(&out, &sshd);
}

#[test]
fn fingerprint_is_the_one_the_client_sees() {
    let sshd = TestSshd::new();
    assert!(sshd.host_key_fingerprint_sha256().starts_with("SHA256:"));
    assert!(sshd
        .host_key_public_openssh()
        .starts_with("ssh-ed25519 AAAA"));
    let out = output_within(sshd.ssh_command().arg("-v").arg("true"), LIMIT);
    assert_success(&out, &sshd);
    let expected = format!(
        "Server host key: ssh-ed25519 {}",
        sshd.host_key_fingerprint_sha256()
    );
    assert!(
        text(&out.stderr).contains(&expected),
        "{}",
        text(&out.stderr)
    );
}

#[test]
fn known_hosts_plain_and_hashed_are_accepted_and_a_wrong_key_is_not() {
    let sshd = TestSshd::new();
    let plain = fs::read_to_string(sshd.known_hosts_path()).unwrap();
    assert_eq!(
        plain,
        format!(
            "[127.0.0.1]:{} {}\n",
            sshd.port(),
            sshd.host_key_public_openssh()
        )
    );

    let hashed = sshd.write_hashed_known_hosts();
    let hashed_text = fs::read_to_string(&hashed).unwrap();
    assert!(hashed_text.starts_with("|1|"), "{hashed_text}");
    assert!(!hashed_text.contains("127.0.0.1"), "{hashed_text}");
    let option = format!("UserKnownHostsFile={}", hashed.display());
    let out = output_within(ssh_with_first(&sshd, &["-o", &option]).arg("true"), LIMIT);
    assert_success(&out, &sshd);

    let other = TestSshd::new();
    let option = format!("UserKnownHostsFile={}", other.known_hosts_path().display());
    let out = output_within(ssh_with_first(&sshd, &["-o", &option]).arg("true"), LIMIT);
    assert!(!out.status.success());
    assert!(
        text(&out.stderr).contains("Host key verification failed"),
        "{}",
        text(&out.stderr)
    );
}

#[test]
fn rsa_host_key_is_optional_and_listed_in_known_hosts() {
    let sshd = TestSshd::with_options(SshdOptions::default().rsa_host_key(true));
    let rsa = sshd.rsa_host_key_public_openssh().unwrap().to_string();
    assert!(rsa.starts_with("ssh-rsa AAAA"));
    let known = fs::read_to_string(sshd.known_hosts_path()).unwrap();
    assert!(known.contains(&rsa), "{known}");
    let out = output_within(
        ssh_with_first(&sshd, &["-o", "HostKeyAlgorithms=rsa-sha2-256"]).arg("true"),
        LIMIT,
    );
    assert_success(&out, &sshd);
}

#[test]
fn encrypted_user_key_logs_in_with_its_passphrase() {
    let sshd = TestSshd::new();
    let key = sshd.add_encrypted_user_key("correct horse");
    assert_ne!(key.public_openssh(), sshd.user_key_public());

    let keygen = |passphrase: &str| {
        output_within(
            Command::new("ssh-keygen")
                .args(["-y", "-P", passphrase, "-f"])
                .arg(key.path()),
            LIMIT,
        )
    };
    assert!(!keygen("").status.success(), "key must be encrypted");
    let public = text(&keygen("correct horse").stdout);
    let type_and_key: Vec<&str> = public.split_whitespace().take(2).collect();
    assert_eq!(type_and_key.join(" "), key.public_openssh());

    // Log in with that key alone, answering the passphrase prompt through SSH_ASKPASS.
    let askpass = sshd.dir().join("askpass");
    fs::write(&askpass, "#!/bin/sh\necho 'correct horse'\n").unwrap();
    fs::set_permissions(&askpass, fs::Permissions::from_mode(0o700)).unwrap();
    let mut ssh = Command::new("ssh");
    ssh.args(["-F", "/dev/null", "-o", "IdentitiesOnly=yes", "-i"])
        .arg(key.path())
        .args(["-p", &sshd.port().to_string(), "-l", sshd.user()])
        .arg("-o")
        .arg(format!(
            "UserKnownHostsFile={}",
            sshd.known_hosts_path().display()
        ))
        .args([
            "-o",
            "StrictHostKeyChecking=yes",
            "-o",
            "IdentityAgent=none",
        ])
        .args(["127.0.0.1", "echo encrypted-ok"])
        .env("SSH_ASKPASS", &askpass)
        .env("SSH_ASKPASS_REQUIRE", "force");
    let out = output_within(&mut ssh, LIMIT);
    assert_success(&out, &sshd);
    assert_eq!(text(&out.stdout), "encrypted-ok\n");
}

#[test]
fn unauthorized_key_is_rejected() {
    let sshd = TestSshd::new();
    let stranger = generate_user_key(sshd.dir(), "stranger", None);
    let path = stranger.path().display().to_string();
    // Built by hand rather than from ssh_command(), which would also offer the kit's own key.
    let mut ssh = Command::new("ssh");
    ssh.args(["-F", "/dev/null", "-o", "IdentitiesOnly=yes", "-i", &path])
        .args(["-p", &sshd.port().to_string(), "-l", sshd.user()])
        .arg("-o")
        .arg(format!(
            "UserKnownHostsFile={}",
            sshd.known_hosts_path().display()
        ))
        .args(["-o", "BatchMode=yes", "-o", "IdentityAgent=none"])
        .args(["127.0.0.1", "true"]);
    let out = output_within(&mut ssh, LIMIT);
    assert!(!out.status.success());
    assert!(
        text(&out.stderr).contains("Permission denied"),
        "{}",
        text(&out.stderr)
    );
    sshd.authorize_key(stranger.public_openssh());
    let out = output_within(&mut ssh, LIMIT);
    assert_success(&out, &sshd);
}

#[test]
fn drop_stops_sshd_and_removes_its_dir() {
    let sshd = TestSshd::new();
    let (addr, dir) = (sshd.addr(), sshd.dir().to_path_buf());
    drop(sshd);
    assert!(std::net::TcpStream::connect(addr).is_err());
    assert!(!dir.exists());
}

/// Running and not a zombie (orphans may be reparented to a pid 1 that never reaps).
fn alive(pid: u32) -> bool {
    fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|stat| {
            let state = stat.rsplit_once(')').map(|(_, rest)| rest.trim_start());
            !state.is_some_and(|s| s.starts_with('Z'))
        })
        .unwrap_or(false)
}

/// Starts `sleep 30` detached from the session, returns its pid.
fn detached_sleep(sshd: &TestSshd) -> u32 {
    let out = output_within(
        sshd.ssh_command()
            .arg(r#"setsid sleep 30 >/dev/null 2>&1 </dev/null & echo $!"#),
        LIMIT,
    );
    assert_success(&out, sshd);
    let pid: u32 = text(&out.stdout).trim().parse().unwrap();
    assert!(alive(pid));
    pid
}

#[test]
fn sessions_see_the_marker_variable() {
    let sshd = TestSshd::new();
    let out = output_within(
        sshd.ssh_command()
            .arg(format!("printenv {}", waymark_testkit::SESSION_MARKER_VAR)),
        LIMIT,
    );
    assert_success(&out, &sshd);
    assert_eq!(text(&out.stdout), format!("{}\n", sshd.dir().display()));
}

#[test]
fn kill_session_processes_ends_detached_commands_and_sessions_from_before_a_restart() {
    let sshd = TestSshd::new();
    let detached = detached_sleep(&sshd);
    let started = sshd.remote_home().join("started");
    let mut session = sshd
        .ssh_command()
        // Without the marker the command escapes; only killing the session's own sshd
        // processes (orphaned by the restart) can end this session early.
        .arg("touch ~/started; exec env -i sleep 5")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    assert!(wait_until(LIMIT, || started.exists()), "{}", sshd.log());
    sshd.restart();

    assert!(sshd.kill_session_processes() >= 2);
    let status = wait_within(&mut session, Duration::from_secs(3))
        .expect("the session's sshd processes were killed");
    assert_eq!(status.code(), Some(255), "ssh lost its connection");
    assert!(wait_until(LIMIT, || !alive(detached)));
    assert!(sshd.is_running(), "the listener is not a session process");
    let out = output_within(sshd.ssh_command().arg("echo still-serving"), LIMIT);
    assert_success(&out, &sshd);
}

#[test]
fn drop_kills_what_sessions_left_running() {
    let sshd = TestSshd::new();
    let detached = detached_sleep(&sshd);
    drop(sshd);
    assert!(wait_until(LIMIT, || !alive(detached)));
}

#[test]
fn start_on_a_taken_port_panics_with_the_sshd_log_and_recovers_once_free() {
    let sshd = TestSshd::new();
    sshd.stop();
    let blocker = std::net::TcpListener::bind(sshd.addr()).unwrap();
    let failure = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| sshd.start()));
    let message = *failure
        .expect_err("sshd cannot bind a port that is in use")
        .downcast::<String>()
        .unwrap();
    assert!(message.contains("Address already in use"), "{message}");
    assert!(message.contains(&sshd.port().to_string()), "{message}");
    drop(blocker);
    sshd.start();
    let out = output_within(sshd.ssh_command().arg("echo recovered"), LIMIT);
    assert_success(&out, &sshd);
}
