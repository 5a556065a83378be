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
        let ledger = Ledger::open(&config.ledger_path).unwrap();
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
