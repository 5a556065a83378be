//! Issue 33: the daemon as a service operators can see, reload and stop. Real daemons on a
//! real sshd: `daemon status` says what runs; `daemon reload` (and SIGHUP) swaps the
//! configuration for new calls while an accepted execution keeps its own; a broken file changes
//! nothing; `daemon stop` with commands in flight, then a start, settles each command once.

mod common;

use std::time::Duration;

use common::{id_in, stderr, stdout, wait_for, Env, APPEND_TOOL};
use serde_json::Value;
use sha2::{Digest, Sha256};

fn status(env: &Env) -> Value {
    let out = env.run(&["--json", "daemon", "status"]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    serde_json::from_str(&stdout(&out)).unwrap()
}

fn edit_config(env: &Env, edit: impl FnOnce(String) -> String) {
    let text = std::fs::read_to_string(&env.config).unwrap();
    std::fs::write(&env.config, edit(text)).unwrap();
}

/// `daemon status` names the running daemon and its configuration; after the file changes,
/// every command warns that the daemon runs the old one; `daemon reload` makes a new tool
/// known (an audit event with both hashes); a broken file is refused with its line and the
/// daemon keeps what it runs; SIGHUP reloads instead of killing the daemon.
#[test]
fn status_shows_the_configuration_reload_swaps_it_and_a_broken_file_changes_nothing() {
    let env = Env::builder().tools(APPEND_TOOL).build();
    // No daemon yet: status says so, and starts none.
    let out = env.run(&["daemon", "status"]);
    assert_eq!(out.status.code(), Some(204), "{}", stdout(&out));
    assert!(stderr(&out).contains("no daemon runs"), "{}", stderr(&out));
    assert!(env.daemons().is_empty());

    let out = env.run(&["exec", "run", "append", "line=a", "secs=0"]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let s = status(&env);
    assert_eq!(env.daemons(), [s["pid"].as_u64().unwrap() as u32]);
    let text = std::fs::read_to_string(&env.config).unwrap();
    assert_eq!(s["config_file"], env.config.display().to_string());
    assert_eq!(
        s["config_hash"],
        hex::encode(Sha256::digest(text.as_bytes()))
    );
    assert_eq!(s["config_on_disk"], "same", "{s}");
    assert_eq!(s["listeners"]["socket"], env.socket().display().to_string());
    assert_eq!(s["hosts"][0]["host"], "h1", "{s}");

    // A tool added to the file is unknown until a reload, and every command says why.
    edit_config(&env, |t| {
        t + &APPEND_TOOL
            .replace("[tools.append", "[tools.append2")
            .replace("echo done", "echo second")
            .replace("{counter}", &env.counter.display().to_string())
    });
    let out = env.run(&["exec", "run", "append2", "line=b", "secs=0"]);
    assert_eq!(out.status.code(), Some(2), "{}", stdout(&out));
    assert!(
        stderr(&out).contains("still runs the old one: `waymark daemon reload`"),
        "{}",
        stderr(&out)
    );
    assert_eq!(status(&env)["config_on_disk"], "changed");

    let out = env.run(&["daemon", "reload"]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert!(
        stdout(&out).contains("new calls use it"),
        "{}",
        stdout(&out)
    );
    let out = env.run(&["exec", "run", "append2", "line=b", "secs=0"]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert_eq!(stdout(&out), "second b\n");
    assert!(!stderr(&out).contains("warning"), "{}", stderr(&out));
    let new_hash = hex::encode(Sha256::digest(
        std::fs::read_to_string(&env.config).unwrap().as_bytes(),
    ));
    let export = stdout(&env.run(&["audit", "export"]));
    let reload = export
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap())
        .find(|e| e["kind"]["name"] == "configuration reloaded")
        .expect("the reload is in the audit chain");
    assert_eq!(
        reload["kind"]["data"]["after"],
        new_hash.as_str(),
        "{reload}"
    );
    assert_eq!(
        reload["kind"]["data"]["before"], s["config_hash"],
        "{reload}"
    );

    // A broken file: refused with its line, nothing changes.
    let good = std::fs::read_to_string(&env.config).unwrap();
    edit_config(&env, |t| t + "\n[tools.broken\n");
    let out = env.run(&["daemon", "reload"]);
    assert_eq!(out.status.code(), Some(2), "{}", stdout(&out));
    let said = stderr(&out);
    let line = good.lines().count() + 2;
    assert!(
        said.contains(&format!("{}:{line}:", env.config.display())),
        "{said}"
    );
    assert!(said.contains("keeps the one it runs"), "{said}");
    // The same file sent by SIGHUP: the daemon logs the refusal and keeps what it runs.
    let pid = env.daemons()[0] as i32;
    unsafe { libc::kill(pid, libc::SIGHUP) };
    let log = env.socket().with_file_name("daemon.log");
    wait_for(
        || {
            std::fs::read_to_string(&log)
                .unwrap_or_default()
                .contains("reload refused")
        },
        "the daemon to refuse the broken file",
        Duration::from_secs(30),
    );
    std::fs::write(&env.config, &good).unwrap();
    let out = env.run(&["exec", "run", "append2", "line=c", "secs=0"]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let s = status(&env);
    assert_eq!(s["config_hash"], new_hash.as_str());
    assert_eq!(s["config_on_disk"], "same", "{s}");
    let refused = s["reload_errors"][0].as_str().unwrap_or_default();
    assert!(refused.contains(&format!(":{line}:")), "{s}");

    // SIGHUP reloads; the daemon lives on.
    std::fs::write(&env.config, good.replace("echo second", "echo third")).unwrap();
    let pid = s["pid"].as_u64().unwrap() as i32;
    unsafe { libc::kill(pid, libc::SIGHUP) };
    wait_for(
        || status(&env)["config_on_disk"] == "same",
        "SIGHUP to reload the configuration",
        Duration::from_secs(30),
    );
    assert_eq!(env.daemons(), [pid as u32]);
    let out = env.run(&["exec", "run", "append2", "line=d", "secs=0"]);
    assert_eq!(stdout(&out), "third d\n", "{}", stderr(&out));
    assert_eq!(env.counter_lines(), ["a", "b", "c", "d"]);
}

/// A reload changes the argv of new calls; an execution accepted before it, and the retry that
/// attaches to it, keep the argv it was accepted with.
#[test]
fn a_reload_changes_new_calls_and_an_accepted_execution_keeps_its_argv() {
    let env = Env::builder().tools(APPEND_TOOL).build();
    let first = env
        .cmd()
        .args(["exec", "run", "append", "line=old", "secs=3"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    wait_for(
        || env.counter_lines() == ["old"],
        "the first call to start",
        Duration::from_secs(60),
    );
    edit_config(&env, |t| t.replace("echo done", "echo reloaded"));
    let out = env.run(&["daemon", "reload"]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    // The retry of the first call attaches and tells its own output.
    let retry = env.run(&["exec", "run", "append", "line=old", "secs=3"]);
    assert_eq!(retry.status.code(), Some(0), "{}", stderr(&retry));
    assert_eq!(stdout(&retry), "done old\n");
    let first = first.wait_with_output().unwrap();
    assert_eq!(stdout(&first), "done old\n", "{}", stderr(&first));
    assert_eq!(id_in(&stderr(&first)), id_in(&stderr(&retry)));
    let new = env.run(&["exec", "run", "append", "line=new", "secs=0"]);
    assert_eq!(stdout(&new), "reloaded new\n", "{}", stderr(&new));
    assert_eq!(env.counter_lines(), ["old", "new"]);
}

/// `daemon stop --wait` with commands in flight longer than its grace: the daemon exits, the
/// commands go on on the host, and the next daemon (started by the next command) settles each
/// of them, once.
#[test]
fn stop_with_commands_in_flight_then_a_start_settles_each_once() {
    let env = Env::builder().tools(APPEND_TOOL).build();
    let out = env.run(&["exec", "run", "append", "line=warm", "secs=0"]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let calls: Vec<_> = (0..3)
        .map(|i| {
            env.cmd()
                .args(["exec", "run", "append", &format!("line=f{i}"), "secs=5"])
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    wait_for(
        || env.counter_lines().len() == 4,
        "three calls to start",
        Duration::from_secs(60),
    );
    let pid = env.daemons();
    let out = env.run(&["daemon", "stop", "--wait", "--grace", "500ms"]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert!(
        stdout(&out).contains("Stopping the daemon"),
        "{}",
        stdout(&out)
    );
    assert!(stderr(&out).contains("has exited"), "{}", stderr(&out));
    assert!(env.daemons().is_empty(), "{pid:?} still runs");
    assert!(!env.socket().with_file_name("daemon.json").exists());
    // A stopped daemon is not started again to be stopped.
    let out = env.run(&["daemon", "stop"]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert!(stdout(&out).contains("nothing to stop"), "{}", stdout(&out));
    assert!(env.daemons().is_empty());

    // Each call lost its daemon before its command ended: its outcome is unknown to it.
    let ids: Vec<String> = calls
        .into_iter()
        .map(|c| {
            let out = c.wait_with_output().unwrap();
            assert_eq!(out.status.code(), Some(200), "{}", stderr(&out));
            id_in(&stderr(&out))
        })
        .collect();
    for id in &ids {
        wait_for(
            || {
                let out = env.run(&["--json", "exec", "status", id]);
                serde_json::from_str::<Value>(&stdout(&out))
                    .is_ok_and(|s| s["state"] == "completed")
            },
            "each execution to settle as completed",
            Duration::from_secs(60),
        );
    }
    let mut lines = env.counter_lines();
    lines.sort();
    assert_eq!(lines, ["f0", "f1", "f2", "warm"]);
}

/// Runs `config check` and `waymark daemon` on `env`: both refuse with exit 2, the daemon
/// before it says it listens. Returns the daemon's last words, which `config check` says too.
fn refused_alike(env: &Env) -> String {
    let check = env.run(&["config", "check"]);
    assert_eq!(check.status.code(), Some(2), "{}", stdout(&check));
    let daemon = env.run(&["daemon"]);
    assert_eq!(daemon.status.code(), Some(2), "{}", stderr(&daemon));
    let said = stderr(&daemon);
    assert!(!said.contains("daemon listening"), "{said}");
    let why = said.lines().last().unwrap().trim_start_matches("waymark: ");
    assert!(stderr(&check).contains(why), "{} vs {said}", stderr(&check));
    why.to_string()
}

/// One validation path: a bearer token file others can read is refused by `config check` and
/// by the daemon with the same words, exit 2, before the daemon says it listens; the CLI that
/// auto-starts it says so at once instead of starting it again and again.
#[test]
fn a_token_file_the_daemon_refuses_is_refused_by_config_check_in_the_same_words() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let token = dir.path().join("agent.token");
    std::fs::write(&token, "a-long-enough-bearer-token-value\n").unwrap();
    std::fs::set_permissions(&token, std::fs::Permissions::from_mode(0o644)).unwrap();
    let env = Env::builder()
        .tools(APPEND_TOOL)
        .daemon_settings(&format!(
            "http_listen = \"127.0.0.1:0\"\nhttp_token_file = \"{}\"",
            token.display()
        ))
        .build();
    let why = refused_alike(&env);
    let why = why.as_str();
    let call = env.run(&["exec", "run", "append", "line=x", "secs=0"]);
    assert_eq!(call.status.code(), Some(2), "{}", stderr(&call));
    assert!(stderr(&call).contains(why), "{}", stderr(&call));
    assert!(env.counter_lines().is_empty());
}

/// `[daemon] env_file`: the daemon takes the variables its credentials name from it, whichever
/// shell starts it (the CLI that auto-starts it lacks them); `daemon status` and `config check`
/// say where each comes from; an env_file others can read is refused by both in the same words.
#[test]
fn an_env_file_gives_the_daemon_its_credentials_whichever_shell_starts_it() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let env_file = dir.path().join("daemon.env");
    std::fs::write(
        &env_file,
        "# the payments API\nWAYMARK_TEST_PAYMENTS=\"tok en\"\n\n",
    )
    .unwrap();
    std::fs::set_permissions(&env_file, std::fs::Permissions::from_mode(0o600)).unwrap();
    let env = Env::builder()
        .tools(APPEND_TOOL)
        .daemon_settings(&format!("env_file = \"{}\"", env_file.display()))
        .tools(
            "\n[credentials.payments]\nkind = \"bearer\"\ntoken_env = \"WAYMARK_TEST_PAYMENTS\"\n\n[credentials.other]\nkind = \"bearer\"\ntoken_env = \"WAYMARK_TEST_OTHER\"\n",
        )
        .build();
    // Neither variable is in the CLI's environment: the daemon it starts has one from the file.
    let out = env
        .cmd()
        .env_remove("WAYMARK_TEST_PAYMENTS")
        .env("WAYMARK_TEST_OTHER", "from-the-shell")
        .args(["exec", "run", "append", "line=x", "secs=0"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let s = status(&env);
    let from = |name: &str| {
        s["env"]
            .as_array()
            .unwrap()
            .iter()
            .find(|v| v["name"] == name)
            .map(|v| v["from"].as_str().unwrap().to_string())
    };
    assert_eq!(
        from("WAYMARK_TEST_PAYMENTS").as_deref(),
        Some("env_file"),
        "{s}"
    );
    assert_eq!(
        from("WAYMARK_TEST_OTHER").as_deref(),
        Some("environment"),
        "{s}"
    );
    let log = std::fs::read_to_string(env.socket().with_file_name("daemon.log")).unwrap();
    assert!(
        log.contains("WAYMARK_TEST_OTHER") && log.contains("env_file so it does not depend"),
        "{log}"
    );

    let check = env.run(&["--json", "config", "check"]);
    assert_eq!(check.status.code(), Some(0), "{}", stderr(&check));
    let c: Value = serde_json::from_str(&stdout(&check)).unwrap();
    let var = |name: &str| {
        c["variables"]
            .as_array()
            .unwrap()
            .iter()
            .find(|v| v["name"] == name)
            .cloned()
            .unwrap()
    };
    assert_eq!(var("WAYMARK_TEST_PAYMENTS")["env_file"], true, "{c}");
    assert_eq!(var("WAYMARK_TEST_PAYMENTS")["daemon"], "env_file", "{c}");
    assert_eq!(var("WAYMARK_TEST_OTHER")["env_file"], false, "{c}");
    assert_eq!(var("WAYMARK_TEST_OTHER")["daemon"], "environment", "{c}");

    // Readable by others: config check and the daemon refuse it in the same words.
    env.run(&["daemon", "stop", "--wait"]);
    std::fs::set_permissions(&env_file, std::fs::Permissions::from_mode(0o640)).unwrap();
    let why = refused_alike(&env);
    assert!(why.contains("chmod 600"), "{why}");
}

/// Counts `notifications/tools/list_changed`.
#[derive(Clone, Default)]
struct ListChanged(std::sync::Arc<std::sync::atomic::AtomicUsize>);

impl rmcp::ClientHandler for ListChanged {
    async fn on_tool_list_changed(
        &self,
        _context: rmcp::service::NotificationContext<rmcp::RoleClient>,
    ) {
        self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    }
}

/// A reload that adds a tool reaches MCP clients: over stdio (the shim watches the daemon's
/// `daemon.json`) and over Streamable HTTP (the daemon's own sessions) each gets
/// `notifications/tools/list_changed`, and `tools/list` then shows the tool.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_that_adds_a_tool_tells_subscribed_mcp_clients() {
    use rmcp::ServiceExt;
    use std::os::unix::fs::PermissionsExt;
    common::bounded(async {
        let token = "t0ken-for-the-list-changed-test";
        let scratch = tempfile::tempdir().unwrap();
        let token_file = scratch.path().join("agent.token");
        std::fs::write(&token_file, token).unwrap();
        std::fs::set_permissions(&token_file, std::fs::Permissions::from_mode(0o600)).unwrap();
        let env = Env::builder()
            .tools(APPEND_TOOL)
            .daemon_settings(&format!(
                "http_listen = \"127.0.0.1:0\"\nhttp_token_file = \"{}\"",
                token_file.display()
            ))
            .build();
        let _daemon = env.start_daemon();
        let stdio_heard = ListChanged::default();
        let stdio = common::shim_client(&env, stdio_heard.clone()).await;
        let http_heard = ListChanged::default();
        let port = env.listen_addr("http").port();
        let http = http_heard
            .clone()
            .serve(common::http_client(
                rmcp::transport::streamable_http_client::StreamableHttpClientTransportConfig::with_uri(
                    format!("http://127.0.0.1:{port}/mcp"),
                )
                .auth_header(token),
            ))
            .await
            .expect("MCP over HTTP initialize");
        let names = |tools: Vec<rmcp::model::Tool>| -> Vec<String> {
            tools.into_iter().map(|t| t.name.to_string()).collect()
        };
        assert!(!names(stdio.list_all_tools().await.unwrap()).contains(&"append2".to_string()));
        let caps = stdio.peer_info().unwrap().capabilities.tools.clone().unwrap();
        assert_eq!(caps.list_changed, Some(true));

        edit_config(&env, |t| {
            t + &APPEND_TOOL
                .replace("[tools.append", "[tools.append2")
                .replace("{counter}", &env.counter.display().to_string())
        });
        let out = env.run(&["daemon", "reload"]);
        assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
        for (what, heard) in [("stdio", &stdio_heard), ("HTTP", &http_heard)] {
            let deadline = std::time::Instant::now() + Duration::from_secs(30);
            while heard.0.load(std::sync::atomic::Ordering::SeqCst) == 0 {
                assert!(
                    std::time::Instant::now() < deadline,
                    "no tools/list_changed over {what}"
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
        assert!(names(stdio.list_all_tools().await.unwrap()).contains(&"append2".to_string()));
        assert!(names(http.list_all_tools().await.unwrap()).contains(&"append2".to_string()));
        // A reload that changes nothing tells nobody.
        let out = env.run(&["daemon", "reload"]);
        assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
        tokio::time::sleep(Duration::from_millis(1500)).await;
        assert_eq!(stdio_heard.0.load(std::sync::atomic::Ordering::SeqCst), 1);
        assert_eq!(http_heard.0.load(std::sync::atomic::Ordering::SeqCst), 1);
        stdio.cancel().await.unwrap();
        http.cancel().await.unwrap();
    })
    .await;
}

/// The TLS files of the HTTP endpoint are read before the daemon says it listens, and by
/// `config check` the same way: a certificate that is not PEM is refused by both, in the same
/// words, exit 2.
#[test]
fn a_tls_certificate_the_daemon_refuses_is_refused_by_config_check_in_the_same_words() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let token = dir.path().join("agent.token");
    std::fs::write(&token, "a-long-enough-bearer-token-value\n").unwrap();
    std::fs::set_permissions(&token, std::fs::Permissions::from_mode(0o600)).unwrap();
    let (cert, key) = (dir.path().join("cert.pem"), dir.path().join("key.pem"));
    std::fs::write(&cert, "not a certificate\n").unwrap();
    std::fs::write(&key, "not a key\n").unwrap();
    std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o600)).unwrap();
    let env = Env::builder()
        .tools(APPEND_TOOL)
        .daemon_settings(&format!(
            "http_listen = \"127.0.0.1:0\"\nhttp_token_file = \"{}\"\ntls_cert = \"{}\"\ntls_key = \"{}\"",
            token.display(),
            cert.display(),
            key.display()
        ))
        .build();
    let why = refused_alike(&env);
    assert!(why.contains("cert.pem"), "{why}");
}
