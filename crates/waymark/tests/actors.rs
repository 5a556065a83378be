//! Who acts: the actor is what the OS proves at connect time (SO_PEERCRED's uid), stable across
//! a retry from another process or another copy of the binary, never a program path read from
//! `/proc` afterwards.

mod common;

use std::process::Stdio;
use std::time::Duration;

use common::{wait_for, Env, APPEND_TOOL};

/// The duplicate of issue 30: a CLI sends a call while the daemon is stopped (SIGSTOP) and is
/// SIGKILLed before the daemon reads it; the daemon, resumed, accepts the dead client's call.
/// The identical call then comes from a new process and from a copy of the binary at another
/// path while the first still runs. One execution, one line on the host.
#[test]
fn a_call_whose_client_died_unread_and_its_retries_from_other_processes_and_binaries_run_once() {
    let env = Env::builder().tools(APPEND_TOOL).build();
    let daemon = env.start_daemon();
    let daemon_pid = daemon.0.id() as i32;

    unsafe { libc::kill(daemon_pid, libc::SIGSTOP) };
    let mut first = env
        .cmd()
        .args(["exec", "run", "append", "line=x", "secs=4"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    // The request sits in the socket's buffer, unread: give the client time to connect and
    // write it, then kill it. It is gone before the daemon looks at its peer.
    std::thread::sleep(Duration::from_millis(800));
    first.kill().unwrap();
    first.wait().unwrap();
    unsafe { libc::kill(daemon_pid, libc::SIGCONT) };

    wait_for(
        || env.counter_lines().len() == 1,
        "the dead client's call to run on the host",
        Duration::from_secs(30),
    );

    // The same call from a new process of the same binary, and from a copy at another path.
    let copy_dir = tempfile::tempdir().unwrap();
    let copy = copy_dir.path().join("waymark");
    if std::fs::hard_link(common::bin(), &copy).is_err() {
        std::fs::copy(common::bin(), &copy).unwrap();
    }
    let retry = env.run(&["exec", "run", "append", "line=x", "secs=4"]);
    let from_copy = std::process::Command::new(&copy)
        .arg("--config")
        .arg(&env.config)
        .env("WAYMARK_LOG", "warn")
        .stdin(Stdio::null())
        .args(["exec", "run", "append", "line=x", "secs=4"])
        .output()
        .unwrap();
    eprintln!(
        "copy: [exit {:?}]\n{}{}",
        from_copy.status.code(),
        common::stdout(&from_copy),
        common::stderr(&from_copy)
    );

    assert_eq!(retry.status.code(), Some(0), "{}", common::stderr(&retry));
    assert_eq!(
        from_copy.status.code(),
        Some(0),
        "{}",
        common::stderr(&from_copy)
    );
    let ids = [common::ids_in(&retry), common::ids_in(&from_copy)];
    assert_eq!(
        ids[0], ids[1],
        "the retry from a copy of the binary attached to another execution"
    );
    let executions = env.executions();
    assert_eq!(
        executions.len(),
        1,
        "one intent, one execution: {executions:?}"
    );
    assert_eq!(
        env.counter_lines(),
        vec!["x".to_string()],
        "the line ran more than once on the host"
    );
    drop(daemon);
}

/// An execution recorded under the actor's old form (`uid:N:PROGRAM`, before the actor was
/// proven at connect time) still answers `exec status`, and the same call, now made under the
/// new form, attaches to it instead of running again.
#[test]
fn an_execution_recorded_under_the_old_actor_form_answers_and_its_retry_attaches() {
    use waymark_core::{Actor, Delivery, IncomingCall, IntentScope};
    use waymark_gateway::config::{Config, DefaultPaths};
    use waymark_gateway::tools::{resolve, CallContext};
    use waymark_ledger::{Durability, Intake, Ledger, NewExecution};

    let env = Env::builder().tools(APPEND_TOOL).build();
    // The daemon makes the ledger; then it is stopped and an older daemon's execution is
    // written into it.
    drop(env.start_daemon());
    env.kill_daemons();
    let uid = unsafe { libc::geteuid() };
    let config = Config::load(
        &env.config,
        &DefaultPaths::from_env(|k| std::env::var(k).ok(), uid),
    )
    .unwrap();
    let old = Actor(format!("uid:{uid}:/opt/old-install/bin/waymark"));
    let id = {
        let ledger = Ledger::init(&config.ledger_path).unwrap();
        let key = ledger.fingerprint_key();
        let ctx = CallContext {
            actor: old.clone(),
            scope: IntentScope::ToolWindow,
            delivery: Delivery::default(),
        };
        let args = serde_json::json!({"line": "x", "secs": 0});
        let call = resolve(&config, "append", args.as_object().unwrap(), ctx).unwrap();
        let action = call.canonicalize(&key);
        let now = waymark_gateway::flow::now();
        let new = NewExecution {
            id: ledger.mint_id(now),
            fingerprint: action.fingerprint(&key),
            action,
            actor: old.clone(),
            scope: IntentScope::ToolWindow,
            tool: "append".into(),
            host: "h1".into(),
            contract: call.policy.contract,
            run: None,
            mask: Vec::new(),
        };
        let incoming = IncomingCall {
            actor: old.clone(),
            scope: IntentScope::ToolWindow,
            policy: call.policy,
            now,
        };
        match ledger
            .accept_or_attach(new, &incoming, Durability::Flushed)
            .unwrap()
        {
            Intake::New(r) => r.id.to_string(),
            Intake::Attach { .. } => panic!("a fresh ledger attached"),
        }
    };

    let _daemon = env.start_daemon();
    let status = env.run(&["exec", "status", &id]);
    assert!(
        common::stdout(&status).contains(&id) || common::stderr(&status).contains(&id),
        "exec status does not answer for the old execution"
    );
    assert_ne!(status.status.code(), Some(2), "{}", common::stderr(&status));
    let retry = env.run(&["exec", "run", "append", "line=x", "secs=0"]);
    assert_eq!(retry.status.code(), Some(0), "{}", common::stderr(&retry));
    assert_eq!(
        common::ids_in(&retry),
        [id.clone()].into_iter().collect(),
        "the retry did not attach to the execution recorded under the old form"
    );
    assert_eq!(env.executions().len(), 1);
    assert_eq!(env.counter_lines(), ["x"]);
}

/// A run's transport is the listener the daemon received the call on; what the client says
/// it is stays a claim beside it.
#[test]
fn the_transport_of_a_run_is_the_listener_never_what_the_client_says() {
    let env = Env::builder().tools(APPEND_TOOL).build();
    let _daemon = env.start_daemon();
    let v = env.control(serde_json::json!({
        "v": 1, "op": "call", "tool": "append",
        "args": {"line": "t", "secs": 0}, "transport": "mcp-http"
    }));
    assert_eq!(v["frame"], "done", "{v}");
    let runs = env.run(&["--json", "runs"]);
    let runs: serde_json::Value = serde_json::from_slice(&runs.stdout).unwrap();
    let transports: Vec<&str> = runs["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["transport"].as_str().unwrap())
        .collect();
    let claimed = transports
        .iter()
        .find(|t| t.contains("mcp-http"))
        .unwrap_or_else(|| panic!("no run of the call: {transports:?}"));
    assert!(
        claimed.starts_with("socket (client says \"mcp-http\")"),
        "{claimed}"
    );
}

/// Over MCP's Streamable HTTP, each actor has its own token: the same call from two tokens is
/// two executions, from one token it attaches; each token's client sees its own tools, and a
/// tool outside its rights is a JSON-RPC error naming the actor and the rule.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_http_tokens_are_two_actors_with_their_own_tools() {
    use common::{bounded, call, structured};
    use rmcp::transport::streamable_http_client::StreamableHttpClientTransportConfig;
    use rmcp::ServiceExt;
    use std::os::unix::fs::PermissionsExt;

    bounded(async {
        const ONE: &str = "first-agent-token-0123456";
        const TWO: &str = "second-agent-token-012345";
        let scratch = tempfile::tempdir().unwrap();
        let one_file = scratch.path().join("one.token");
        std::fs::write(&one_file, ONE).unwrap();
        std::fs::set_permissions(&one_file, std::fs::Permissions::from_mode(0o600)).unwrap();
        let env = Env::builder()
            .daemon_settings("http_listen = \"127.0.0.1:0\"")
            .tools(APPEND_TOOL)
            .tools(common::PEEK_TOOL)
            .tools(&format!(
                r#"
[actors.one]
token_file = "{}"
tools = ["append", "peek"]

[actors.two]
token_sha256 = "{}"
tools = ["append"]
"#,
                one_file.display(),
                hex::encode(waymark_mcp::http::token_digest(TWO))
            ))
            .build();
        let _daemon = env.start_daemon();
        let port = env.listen_addr("http").port();
        let client = |token: &'static str| {
            ().serve(common::http_client(
                StreamableHttpClientTransportConfig::with_uri(format!(
                    "http://127.0.0.1:{port}/mcp"
                ))
                .auth_header(token),
            ))
        };
        let one = client(ONE).await.unwrap();
        let two = client(TWO).await.unwrap();
        let names = |tools: Vec<rmcp::model::Tool>| -> Vec<String> {
            tools.into_iter().map(|t| t.name.to_string()).collect()
        };
        let one_tools = names(one.list_all_tools().await.unwrap());
        let two_tools = names(two.list_all_tools().await.unwrap());
        assert!(one_tools.contains(&"peek".to_string()), "{one_tools:?}");
        assert!(!two_tools.contains(&"peek".to_string()), "{two_tools:?}");
        assert!(two_tools.contains(&"append".to_string()), "{two_tools:?}");

        let same = || call("append", serde_json::json!({"line": "same", "secs": 0}));
        let first = structured(&one.call_tool(same()).await.unwrap());
        let again = structured(&one.call_tool(same()).await.unwrap());
        let other = structured(&two.call_tool(same()).await.unwrap());
        assert_eq!(first["id"], again["id"], "one token's retry did not attach");
        assert_ne!(first["id"], other["id"], "two actors shared an execution");
        assert_eq!(env.counter_lines(), ["same", "same"]);

        let refused = two
            .call_tool(call("peek", serde_json::json!({})))
            .await
            .expect_err("a tool outside actor two's rights ran");
        let refused = refused.to_string();
        assert!(
            refused.contains("actor two") && refused.contains("not in actors.two.tools"),
            "{refused}"
        );
        let records = env.ledger_records();
        let actors: std::collections::BTreeSet<&str> = records
            .values()
            .map(|r| r["actor"].as_str().unwrap())
            .collect();
        assert_eq!(actors, ["one", "two"].into_iter().collect());
        one.cancel().await.unwrap();
        two.cancel().await.unwrap();
    })
    .await;
}

/// An actor's approval floor: with `approval = "per_call"`, its call of a tool that needs no
/// approval waits for an operator; a read-only call does not wait.
#[test]
fn an_actors_approval_floor_makes_its_calls_wait_but_never_a_read_only_one() {
    let env = Env::builder()
        .tools(APPEND_TOOL)
        .tools(common::PEEK_TOOL)
        .tools(&format!(
            "[actors.careful]\nunix_user = \"{}\"\ntools = [\"append\", \"peek\"]\napproval = \"per_call\"\n",
            unsafe { libc::geteuid() }
        ))
        .build();
    let _daemon = env.start_daemon();
    let mut waiting = env
        .cmd()
        .args(["exec", "run", "append", "line=w", "secs=0"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    wait_for(
        || env.pending().len() == 1,
        "the call to await approval under the actor's floor",
        Duration::from_secs(30),
    );
    assert!(env.counter_lines().is_empty(), "it ran before approval");
    // (The counter file does not exist yet: `cat` ends 1, which is the command's answer.)
    let peek = env.run(&["exec", "run", "peek"]);
    assert!(
        common::stderr(&peek).contains("Completed on the host"),
        "{}",
        common::stderr(&peek)
    );
    // Not an operator: it may not approve its own call, but may cancel it.
    let id = env.pending()[0].clone();
    let approve = env.run(&["approve", &id]);
    assert_eq!(approve.status.code(), Some(2));
    let cancel = env.run(&["exec", "cancel", &id]);
    assert_eq!(cancel.status.code(), Some(0), "{}", common::stderr(&cancel));
    let _ = waiting.wait();
    assert!(env.counter_lines().is_empty());
}
