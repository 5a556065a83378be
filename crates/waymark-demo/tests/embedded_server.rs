//! The embedded demo server against real peers: OpenSSH's `ssh` client, and Waymark's own
//! executor with the remote wrapper.

use std::future::Future;
use std::path::{Path, PathBuf};
use std::process::{Output, Stdio};
use std::sync::Arc;
use std::time::Duration;

use tempfile::TempDir;
use tokio::io::AsyncWriteExt;
use waymark_demo::{ClientKey, EmbeddedServer, EmbeddedServerOptions};
use waymark_ssh::wrapper::{InlineOutput, MarkerState, RunReport};
use waymark_ssh::{Credential, DispatchOutcome, DispatchRequest, Executor, HostConfig};
use waymark_testkit::{generate_user_key, new_id, require_tool};

/// argv from string slices.
fn argv(words: &[&str]) -> Vec<String> {
    words.iter().map(|w| w.to_string()).collect()
}

/// Runs `fut`, failing the test if it takes longer than `secs`.
async fn within<F: Future>(secs: u64, what: &str, fut: F) -> F::Output {
    match tokio::time::timeout(Duration::from_secs(secs), fut).await {
        Ok(v) => v,
        Err(_) => panic!("{what}: did not finish within {secs} s"),
    }
}

/// The run report of a dispatch that must have run.
fn ran(outcome: DispatchOutcome) -> RunReport {
    match outcome {
        DispatchOutcome::Completed(report) => report,
        DispatchOutcome::AlreadyStarted(status) => {
            panic!("expected the command to run, but its ID was taken: {status:?}")
        }
    }
}

/// A started server with a generated client key and a known_hosts file pinning it.
struct Demo {
    dir: TempDir,
    server: EmbeddedServer,
    home: PathBuf,
    key: PathBuf,
    known_hosts: PathBuf,
}

async fn demo() -> Demo {
    demo_with(|dir| ClientKey::Generate(dir.join("id_ed25519"))).await
}

async fn demo_with(client_key: impl FnOnce(&Path) -> ClientKey) -> Demo {
    require_tool(
        "ssh",
        "install the OpenSSH client (apt-get install openssh-client)",
    );
    let dir = tempfile::tempdir().expect("temp dir");
    let home = dir.path().join("home");
    std::fs::create_dir(&home).expect("create home");
    let client_key = client_key(dir.path());
    let key = match &client_key {
        ClientKey::Generate(path) => path.clone(),
        ClientKey::Authorized(_) => dir.path().join("no-key"),
    };
    let server = EmbeddedServer::start(EmbeddedServerOptions::new(&home, client_key))
        .await
        .expect("start the embedded server");
    let known_hosts = dir.path().join("known_hosts");
    std::fs::write(&known_hosts, format!("{}\n", server.known_hosts_line()))
        .expect("write known_hosts");
    Demo {
        dir,
        server,
        home,
        key,
        known_hosts,
    }
}

impl Demo {
    /// `ssh` to the server with `key`, strict host key checking, no agent and no config.
    fn ssh(&self, key: &Path, extra: &[&str], command: Option<&str>) -> tokio::process::Command {
        let mut cmd = tokio::process::Command::new("ssh");
        cmd.arg("-F")
            .arg("/dev/null")
            .arg("-i")
            .arg(key)
            .arg("-p")
            .arg(self.server.port().to_string())
            .arg("-o")
            .arg(format!("UserKnownHostsFile={}", self.known_hosts.display()))
            .args(["-o", "StrictHostKeyChecking=yes"])
            .args(["-o", "BatchMode=yes"])
            .args(["-o", "IdentitiesOnly=yes"])
            .args(["-o", "IdentityAgent=none"])
            .args(["-o", "ConnectTimeout=5"])
            .args(["-o", "LogLevel=ERROR"])
            .args(extra)
            .arg("demo@127.0.0.1");
        if let Some(command) = command {
            cmd.arg(command);
        }
        cmd.kill_on_drop(true);
        cmd
    }

    /// Runs `command` over ssh with the demo key, feeding `stdin`, within `secs` seconds.
    async fn run(&self, command: &str, stdin: &[u8], secs: u64) -> Output {
        run_bounded(self.ssh(&self.key, &[], Some(command)), stdin, secs).await
    }
}

async fn run_bounded(mut cmd: tokio::process::Command, stdin: &[u8], secs: u64) -> Output {
    cmd.stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = cmd.spawn().expect("start ssh");
    let mut pipe = child.stdin.take().expect("ssh stdin");
    let stdin = stdin.to_vec();
    let feed = tokio::spawn(async move {
        let _ = pipe.write_all(&stdin).await;
    });
    let output = within(secs, "ssh", child.wait_with_output())
        .await
        .expect("ssh output");
    let _ = feed.await;
    output
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

async fn eventually_exists(path: &Path, secs: u64) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(secs);
    while !path.exists() {
        if tokio::time::Instant::now() > deadline {
            panic!("{} did not appear within {secs} s", path.display());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exec_streams_stdout_and_stderr_then_the_exit_status() {
    let demo = demo().await;
    let out = demo.run("echo hi; echo err >&2; exit 3", b"", 20).await;
    assert_eq!(text(&out.stdout), "hi\n");
    assert_eq!(text(&out.stderr), "err\n");
    assert_eq!(out.status.code(), Some(3));
    assert_eq!(demo.server.exec_count(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn host_key_accessors_agree_with_ssh_keygen() {
    let demo = demo().await;
    let line = demo.server.known_hosts_line();
    let port = demo.server.port();
    assert_eq!(
        line,
        format!("[127.0.0.1]:{port} {}", demo.server.host_key_openssh())
    );
    assert!(
        demo.server
            .host_key_openssh()
            .starts_with("ssh-ed25519 AAAA"),
        "{line}"
    );
    assert_eq!(demo.server.addr().ip().to_string(), "127.0.0.1");
    let out = within(
        10,
        "ssh-keygen -l",
        tokio::process::Command::new("ssh-keygen")
            .arg("-l")
            .arg("-f")
            .arg(&demo.known_hosts)
            .output(),
    )
    .await
    .expect("run ssh-keygen");
    let listed = text(&out.stdout);
    let fingerprint = demo.server.host_key_fingerprint_sha256();
    assert!(fingerprint.starts_with("SHA256:"), "{fingerprint}");
    assert!(listed.contains(&fingerprint), "{listed} vs {fingerprint}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn commands_run_in_home_with_home_set_and_a_clean_environment() {
    // cargo sets it for the test process; the server must not pass it on.
    assert!(std::env::var_os("CARGO_MANIFEST_DIR").is_some());
    let demo = demo().await;
    let out = demo
        .run(
            "pwd; echo \"$HOME\"; echo \"${CARGO_MANIFEST_DIR:-unset}\"",
            b"",
            20,
        )
        .await;
    let home = std::fs::canonicalize(&demo.home).expect("home");
    let home = home.display();
    assert_eq!(text(&out.stdout), format!("{home}\n{home}\nunset\n"));
    assert_eq!(out.status.code(), Some(0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stdin_is_piped_through_until_eof() {
    let demo = demo().await;
    let input = b"line one\nline two\n\x00binary\xff\n";
    let out = demo.run("cat", input, 20).await;
    assert_eq!(out.stdout, input);
    assert_eq!(out.status.code(), Some(0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_other_than_the_authorized_one_is_refused() {
    let demo = demo().await;
    let stranger = generate_user_key(demo.dir.path(), "stranger", None);
    let out = run_bounded(
        demo.ssh(stranger.path(), &[], Some("echo should-not-run")),
        b"",
        20,
    )
    .await;
    assert_eq!(out.status.code(), Some(255), "{}", text(&out.stderr));
    assert!(
        text(&out.stderr).contains("Permission denied"),
        "{}",
        text(&out.stderr)
    );
    assert!(out.stdout.is_empty());
    assert_eq!(demo.server.exec_count(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_authorized_public_key_line_lets_that_key_in() {
    let keys = tempfile::tempdir().expect("temp dir");
    let user_key = generate_user_key(keys.path(), "operator", None);
    let line = user_key.public_openssh().to_string();
    let demo = demo_with(|_| ClientKey::Authorized(line)).await;
    assert_eq!(demo.server.client_key_path(), None);
    let out = run_bounded(demo.ssh(user_key.path(), &[], Some("echo in")), b"", 20).await;
    assert_eq!(text(&out.stdout), "in\n", "{}", text(&out.stderr));
    assert_eq!(out.status.code(), Some(0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_generated_client_key_is_private_to_its_owner() {
    use std::os::unix::fs::PermissionsExt;
    let demo = demo().await;
    assert_eq!(demo.server.client_key_path(), Some(demo.key.as_path()));
    let mode = std::fs::metadata(&demo.key)
        .expect("key file")
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o600);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_concurrent_ssh_sessions_each_get_their_own_output() {
    let demo = Arc::new(demo().await);
    let mut runs = tokio::task::JoinSet::new();
    for n in 0..10 {
        let demo = demo.clone();
        runs.spawn(async move {
            let out = demo
                .run(&format!("echo out{n}; echo err{n} >&2; exit {n}"), b"", 30)
                .await;
            (n, out)
        });
    }
    let mut seen = 0;
    while let Some(joined) = runs.join_next().await {
        let (n, out) = joined.expect("ssh task");
        assert_eq!(text(&out.stdout), format!("out{n}\n"));
        assert_eq!(text(&out.stderr), format!("err{n}\n"));
        assert_eq!(out.status.code(), Some(n));
        seen += 1;
    }
    assert_eq!(seen, 10);
    assert_eq!(demo.server.exec_count(), 10);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn five_mib_of_output_arrives_intact() {
    let demo = demo().await;
    let out = demo
        .run("head -c 5242880 /dev/zero | tr '\\0' x", b"", 60)
        .await;
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert_eq!(out.stdout.len(), 5 * 1024 * 1024);
    assert!(out.stdout.iter().all(|&b| b == b'x'));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn commands_survive_the_ssh_client_being_killed() {
    require_tool("setsid", "install util-linux");
    let demo = demo().await;
    let detached = demo.home.join("detached");
    let foreground = demo.home.join("foreground");
    let mut child = demo
        .ssh(
            &demo.key,
            &[],
            Some(
                "setsid sh -c 'sleep 1; echo done > detached' </dev/null >/dev/null 2>&1 & \
                 echo started; sleep 1; echo done > foreground",
            ),
        )
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("start ssh");
    // Wait until the command runs, then drop the connection from the client side.
    let mut stdout = child.stdout.take().expect("ssh stdout");
    let mut first = [0u8; 8];
    within(
        20,
        "the command starts",
        tokio::io::AsyncReadExt::read_exact(&mut stdout, &mut first),
    )
    .await
    .expect("read started");
    assert_eq!(&first, b"started\n");
    child.kill().await.expect("kill ssh");
    assert!(!detached.exists() && !foreground.exists());

    eventually_exists(&detached, 10).await;
    eventually_exists(&foreground, 10).await;
    assert_eq!(std::fs::read_to_string(&detached).unwrap(), "done\n");
    assert_eq!(std::fs::read_to_string(&foreground).unwrap(), "done\n");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shell_pty_and_subsystem_requests_are_refused() {
    let demo = demo().await;
    // No command: ssh asks for a shell.
    let shell = run_bounded(demo.ssh(&demo.key, &["-T"], None), b"", 20).await;
    assert_ne!(shell.status.code(), Some(0));
    assert!(
        text(&shell.stderr).contains("shell request failed"),
        "{}",
        text(&shell.stderr)
    );
    let subsystem = run_bounded(demo.ssh(&demo.key, &["-s"], Some("sftp")), b"", 20).await;
    assert_ne!(subsystem.status.code(), Some(0));
    assert!(
        text(&subsystem.stderr).contains("subsystem request failed"),
        "{}",
        text(&subsystem.stderr)
    );
    assert_eq!(demo.server.exec_count(), 0);
    // ssh sends its exec right behind the pty request, then gives up on the refusal (`-tt`).
    let pty = run_bounded(demo.ssh(&demo.key, &["-tt"], Some("echo ran")), b"", 20).await;
    assert!(
        text(&pty.stderr).contains("PTY allocation request failed"),
        "{}",
        text(&pty.stderr)
    );
    assert_ne!(pty.status.code(), Some(0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_stops_listening_and_drops_live_connections() {
    let demo = demo().await;
    let mut live = demo
        .ssh(&demo.key, &[], Some("sleep 5"))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start ssh");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while demo.server.exec_count() == 0 {
        assert!(tokio::time::Instant::now() < deadline, "exec never arrived");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(listening_in_this_process(demo.server.port()));
    within(5, "shutdown", demo.server.shutdown()).await;
    // Not a connect attempt: under a parallel suite another test may take the freed port at
    // once. The kernel's socket table says whether this process still listens on it.
    assert!(
        !listening_in_this_process(demo.server.port()),
        "still listening after shutdown"
    );
    let status = within(10, "live ssh ends", live.wait())
        .await
        .expect("wait ssh");
    assert_ne!(status.code(), Some(0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waymarks_executor_installs_the_wrapper_and_dispatches_through_it() {
    let demo = demo().await;
    let mut host = HostConfig::new(
        "demo",
        "127.0.0.1",
        "demo",
        Credential::KeyFile {
            path: demo.key.clone(),
            passphrase_env: None,
        },
        &demo.known_hosts,
    );
    host.port = demo.server.port();
    host.connect_timeout = Duration::from_secs(5);
    let executor = Executor::new(host).expect("executor");
    let request = DispatchRequest {
        execution_id: new_id(),
        argv: argv(&["echo", "hello"]),
        ..Default::default()
    };
    let report = within(60, "dispatch", executor.dispatch(&request, |_| {}))
        .await
        .expect("dispatch");
    let report = ran(report);
    assert_eq!(report.status.state, MarkerState::Completed);
    assert_eq!(report.status.exit_code, Some(0));
    assert_eq!(report.stdout, InlineOutput::Inline(b"hello\n".to_vec()));
    // The wrapper and its marker live under the server's home (the default `~/.waymark`).
    let marker = demo.home.join(".waymark/exec").join(&request.execution_id);
    assert!(marker.is_file(), "no marker at {}", marker.display());
    assert!(demo.server.exec_count() >= 2, "install, then run");
}

/// A russh client handler that accepts only the demo server's host key.
struct PinnedHost(russh::keys::PublicKey);

impl russh::client::Handler for PinnedHost {
    type Error = russh::Error;

    async fn check_server_key(
        &mut self,
        presented: &russh::keys::PublicKeyOrCertificate,
    ) -> Result<bool, Self::Error> {
        Ok(matches!(
            presented,
            russh::keys::PublicKeyOrCertificate::PublicKey { key, .. }
                if key.key_data() == self.0.key_data()
        ))
    }
}

/// What one exec channel saw, in order: `out:..`, `err:..`, `exit-status N`,
/// `exit-signal NAME`, `eof`, `close` (`success` is left out).
async fn exec_events(handle: &russh::client::Handle<PinnedHost>, command: &str) -> Vec<String> {
    use russh::ChannelMsg;
    let mut channel = handle.channel_open_session().await.expect("open channel");
    channel.exec(true, command).await.expect("send exec");
    let mut events = Vec::new();
    while let Some(msg) = channel.wait().await {
        match msg {
            ChannelMsg::Data { data } => events.push(format!("out:{}", text(&data))),
            ChannelMsg::ExtendedData { data, ext: 1 } => {
                events.push(format!("err:{}", text(&data)))
            }
            ChannelMsg::ExitStatus { exit_status } => {
                events.push(format!("exit-status {exit_status}"))
            }
            ChannelMsg::ExitSignal { signal_name, .. } => {
                events.push(format!("exit-signal {signal_name:?}"))
            }
            ChannelMsg::Eof => events.push("eof".into()),
            ChannelMsg::Close => {
                events.push("close".into());
                break;
            }
            ChannelMsg::Failure => events.push("failure".into()),
            _ => {}
        }
    }
    events
}

/// A russh client connection to the demo server, authenticated with the demo key.
async fn russh_client(demo: &Demo) -> russh::client::Handle<PinnedHost> {
    let host_key =
        russh::keys::PublicKey::from_openssh(&demo.server.host_key_openssh()).expect("host key");
    let mut handle = russh::client::connect(
        Arc::new(russh::client::Config::default()),
        demo.server.addr(),
        PinnedHost(host_key),
    )
    .await
    .expect("connect");
    let key = russh::keys::load_secret_key(&demo.key, None).expect("load client key");
    let auth = handle
        .authenticate_publickey(
            "demo",
            russh::keys::PrivateKeyWithHashAlg::new(Arc::new(key), None),
        )
        .await
        .expect("authenticate");
    assert!(auth.success());
    handle
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_command_whose_channel_is_closed_early_loses_its_output_not_its_life() {
    let demo = demo().await;
    let ended = demo.home.join("yes-ended");
    within(30, "early close", async {
        let handle = russh_client(&demo).await;
        let mut channel = handle.channel_open_session().await.expect("open channel");
        channel
            .exec(true, "yes; echo \"$?\" > yes-ended")
            .await
            .expect("send exec");
        loop {
            match channel.wait().await {
                Some(russh::ChannelMsg::Data { .. }) => break,
                Some(_) => continue,
                None => panic!("channel ended before any output"),
            }
        }
        channel.close().await.expect("close channel");
        // `yes` is not left blocked on a full pipe: it gets SIGPIPE (128 + 13), and the shell
        // that ran it goes on.
        eventually_exists(&ended, 10).await;
    })
    .await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    loop {
        let status = std::fs::read_to_string(&ended).unwrap_or_default();
        if status == "141\n" {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "yes ended with {status:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn channels_end_with_exit_status_or_signal_then_eof_then_close() {
    let demo = demo().await;
    within(30, "russh client", async {
        let handle = russh_client(&demo).await;
        // Several channels at once on this one connection.
        let handle = &handle;
        let (exited, signalled, quiet, big) = tokio::join!(
            exec_events(handle, "sleep 0.2; echo out; echo err >&2; exit 3"),
            exec_events(handle, "echo before; kill -TERM $$"),
            exec_events(handle, "true"),
            exec_events(handle, "head -c 300000 /dev/zero"),
        );
        let tail = |events: &[String]| events[events.len().saturating_sub(3)..].to_vec();
        assert_eq!(
            tail(&exited),
            ["exit-status 3", "eof", "close"],
            "{exited:?}"
        );
        assert!(exited.contains(&"out:out\n".to_string()), "{exited:?}");
        assert!(exited.contains(&"err:err\n".to_string()), "{exited:?}");
        assert_eq!(
            tail(&signalled),
            ["exit-signal TERM", "eof", "close"],
            "{signalled:?}"
        );
        assert_eq!(signalled[0], "out:before\n");
        assert_eq!(quiet, ["exit-status 0", "eof", "close"]);
        assert_eq!(tail(&big), ["exit-status 0", "eof", "close"]);
        let received: usize = big
            .iter()
            .filter_map(|e| e.strip_prefix("out:"))
            .map(str::len)
            .sum();
        assert_eq!(received, 300_000);
    })
    .await;
}

/// Whether a socket of this process listens on TCP `port` (from /proc/net/tcp{,6} and the
/// process's own descriptors).
fn listening_in_this_process(port: u16) -> bool {
    let mut inodes = Vec::new();
    for table in ["/proc/net/tcp", "/proc/net/tcp6"] {
        let Ok(text) = std::fs::read_to_string(table) else {
            continue;
        };
        for line in text.lines().skip(1) {
            let f: Vec<&str> = line.split_whitespace().collect();
            // local_address is ADDR:PORT in hex; state 0A is LISTEN; field 9 the inode.
            let local_port = f[1].rsplit(':').next().unwrap_or("");
            if f[3] == "0A" && u16::from_str_radix(local_port, 16) == Ok(port) {
                inodes.push(format!("socket:[{}]", f[9]));
            }
        }
    }
    std::fs::read_dir("/proc/self/fd")
        .expect("/proc/self/fd")
        .flatten()
        .filter_map(|e| std::fs::read_link(e.path()).ok())
        .any(|l| inodes.iter().any(|i| l.to_str() == Some(i)))
}
