//! The `waymark` binary end to end: real OpenSSH sshd (testkit), real ledger, real daemon
//! process, killed with SIGKILL where the flow is most fragile.

mod common;

use std::process::{Command, Stdio};
use std::time::Duration;

use common::{
    bin, files_containing, id_in, read_until_id, stderr, stdout, wait_for, Daemon, Env,
    APPEND_TOOL, SECRET_ECHO_TOOL,
};

/// `guarded`: appends `line` to the counter file; irreversible, an approval per call.
const GUARDED_TOOL: &str = r#"
[tools.guarded]
description = "Needs an operator's approval for every call."
hosts = ["h1"]
argv = ["sh", "-c", "echo \"$1\" >> {counter}; echo approved \"$1\"", "guarded", "{line}"]
contract = "irreversible"
approval = "per_call"

[tools.guarded.args.line]
type = "string"
"#;

/// Host `h1` direct, raw commands allowed, tools `append`, `guarded` and `secret_echo`.
fn new_env() -> Env {
    Env::builder()
        .raw_commands()
        .tools(APPEND_TOOL)
        .tools(GUARDED_TOOL)
        .tools(SECRET_ECHO_TOOL)
        .build()
}

#[test]
fn exec_run_without_daemon_runs_once_and_reports() {
    let env = new_env();
    let out = env.run(&["exec", "run", "append", "line=one", "secs=0"]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert_eq!(
        env.daemons().len(),
        1,
        "the CLI started a daemon rather than open the ledger itself"
    );
    assert!(
        !stderr(&out).contains("not yet delivered"),
        "nothing contradicts the run that just printed: {}",
        stderr(&out)
    );
    assert_eq!(stdout(&out), "done one\n");
    let id = id_in(&stderr(&out));
    assert_eq!(env.counter_lines(), ["one"]);

    let st = env.run(&["exec", "status", &id]);
    assert_eq!(st.status.code(), Some(0));
    assert!(
        stdout(&st).contains("completed") && stdout(&st).contains("result delivered"),
        "{}",
        stdout(&st)
    );

    let res = env.run(&["exec", "result", &id]);
    assert_eq!(stdout(&res), "done one\n");

    let again = env.run(&["exec", "run", "append", "line=one", "secs=0"]);
    assert_eq!(again.status.code(), Some(0));
    assert_eq!(
        id_in(&stderr(&again)),
        id,
        "a repeat inside the dedup window attaches"
    );
    assert_eq!(stdout(&again), "done one\n", "and gets the stored result");
    assert_eq!(env.counter_lines(), ["one"], "without running again");

    let list = env.run(&["--json", "exec", "list"]);
    let v: serde_json::Value = serde_json::from_slice(&list.stdout).unwrap();
    assert_eq!(v["items"].as_array().unwrap().len(), 1);

    let ex = env.run(&["exec", "explain", &id]);
    let text = stdout(&ex);
    assert!(text.contains("2 call(s) (1 attached)"), "{text}");
    assert!(text.contains("The host reported completed"), "{text}");

    let audit = env.run(&["audit", "verify"]);
    assert_eq!(audit.status.code(), Some(0), "{}", stdout(&audit));
    // Offline verification opens the ledger itself: refused while the daemon owns it, and
    // the daemon keeps it.
    let refused = env
        .cmd()
        .args(["audit", "verify", "--ledger"])
        .arg(env.ledger_dir())
        .output()
        .unwrap();
    assert_eq!(refused.status.code(), Some(204), "{}", stderr(&refused));
    assert!(
        stderr(&refused).contains("a running daemon owns it"),
        "{}",
        stderr(&refused)
    );
    assert_eq!(env.run(&["exec", "status", &id]).status.code(), Some(0));
    env.kill_daemons();
    let audit2 = env
        .cmd()
        .args(["audit", "verify", "--ledger"])
        .arg(env.ledger_dir())
        .output()
        .unwrap();
    assert_eq!(audit2.status.code(), Some(0), "{}", stderr(&audit2));
    assert!(
        env.daemons().is_empty(),
        "offline verification starts no daemon"
    );
}

/// Fifty CLI processes at once and no daemon: one daemon is started for all of them, every
/// call succeeds, and each distinct action ran once (each is called twice).
#[test]
fn fifty_cli_calls_at_once_start_one_daemon_and_all_succeed() {
    let env = new_env();
    let calls: Vec<_> = (0..50)
        .map(|i| {
            let line = format!("line=l{}", i % 25);
            env.cmd()
                .args(["exec", "run", "append", &line, "secs=0"])
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    for (i, c) in calls.into_iter().enumerate() {
        let out = c.wait_with_output().unwrap();
        assert_eq!(
            out.status.code(),
            Some(0),
            "call {i}: {}{}",
            stdout(&out),
            stderr(&out)
        );
        assert_eq!(stdout(&out), format!("done l{}\n", i % 25), "call {i}");
    }
    assert_eq!(env.daemons().len(), 1, "exactly one daemon runs");
    let mut lines = env.counter_lines();
    lines.sort();
    let mut want: Vec<String> = (0..25).map(|i| format!("l{i}")).collect();
    want.sort();
    assert_eq!(lines, want, "each distinct action ran once on the host");
    let log = std::fs::read_to_string(env.socket().with_file_name("daemon.log")).unwrap();
    assert!(
        !log.contains("locked"),
        "no daemon start failed on the ledger lock:\n{log}"
    );
}

/// A daemon SIGKILLed while CLI calls are in flight: the calls say unknown with their ids,
/// the next CLI call starts a new daemon, and `exec status` answers for each of them.
#[test]
fn a_daemon_killed_under_cli_calls_is_restarted_by_the_next_call() {
    let env = new_env();
    assert_eq!(
        env.run(&["exec", "run", "append", "line=warm", "secs=0"])
            .status
            .code(),
        Some(0)
    );
    let first = env.daemon_pid();
    let calls: Vec<_> = (0..4)
        .map(|i| {
            env.cmd()
                .args(["exec", "run", "append", &format!("line=k{i}"), "secs=2"])
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    wait_for(
        || env.counter_lines().len() == 5,
        "the four commands to start on the host",
        Duration::from_secs(30),
    );
    unsafe { libc::kill(first as i32, libc::SIGKILL) };
    let mut ids = Vec::new();
    for c in calls {
        let out = c.wait_with_output().unwrap();
        assert_eq!(out.status.code(), Some(200), "unknown: {}", stderr(&out));
        ids.push(id_in(&stderr(&out)));
    }
    for id in &ids {
        wait_for(
            || {
                let st = env.run(&["exec", "status", id]);
                st.status.code() == Some(0) && stdout(&st).contains("completed")
            },
            "status to answer completed",
            Duration::from_secs(30),
        );
    }
    assert_ne!(env.daemon_pid(), first, "a new daemon answers");
    assert_eq!(env.daemons().len(), 1);
    let mut lines = env.counter_lines();
    lines.sort();
    assert_eq!(lines, ["k0", "k1", "k2", "k3", "warm"], "each ran once");
}

#[test]
fn raw_commands_follow_policy_and_exit_codes_pass_through() {
    let env = new_env();
    let out = env.run(&[
        "exec",
        "run",
        "--host",
        "h1",
        "--",
        "sh",
        "-c",
        "echo 'quoted; $(not run)'; exit 7",
    ]);
    assert_eq!(out.status.code(), Some(7));
    assert_eq!(stdout(&out), "quoted; $(not run)\n");
    let bad = env.run(&["exec", "run", "append", "line=x"]);
    assert_eq!(bad.status.code(), Some(2));
    assert!(
        stderr(&bad).contains("missing required argument secs"),
        "{}",
        stderr(&bad)
    );
}

/// `whoami`: prints its execution ID as the command's environment, an argv template and an env
/// template give it; idempotent, so a repeat within the dedup window gets the stored result.
const WHOAMI_TOOL: &str = r#"
[tools.whoami]
description = "Prints its own execution ID."
hosts = ["h1"]
argv = ["sh", "-c", "echo \"env=$WAYMARK_EXECUTION_ID arg=$1 run_id=$RUN_ID tag=$2\"", "whoami", "--id={execution_id}", "{tag}"]
contract = "idempotent"
dedup_window = "1h"
env = { RUN_ID = "{execution_id}" }

[tools.whoami.args.tag]
type = "string"
"#;

#[test]
fn a_tool_command_knows_its_execution_id_and_a_repeat_attaches_to_it() {
    let env = Env::builder().tools(WHOAMI_TOOL).build();
    let out = env.run(&["exec", "run", "whoami", "tag=a"]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let id = id_in(&stderr(&out));
    assert_eq!(
        stdout(&out),
        format!("env={id} arg=--id={id} run_id={id} tag=a\n")
    );

    let again = env.run(&["exec", "run", "whoami", "tag=a"]);
    assert_eq!(again.status.code(), Some(0), "{}", stderr(&again));
    assert_eq!(
        id_in(&stderr(&again)),
        id,
        "the id is not part of the intent: the same call attaches"
    );
    assert_eq!(stdout(&again), stdout(&out), "and gets the stored result");

    let other = env.run(&["exec", "run", "whoami", "tag=b"]);
    let other_id = id_in(&stderr(&other));
    assert_ne!(other_id, id);
    assert_eq!(
        stdout(&other),
        format!("env={other_id} arg=--id={other_id} run_id={other_id} tag=b\n")
    );
}

#[test]
fn a_raw_command_knows_its_execution_id() {
    let env = new_env();
    let out = env.run(&[
        "exec",
        "run",
        "--host",
        "h1",
        "--",
        "sh",
        "-c",
        "echo \"$WAYMARK_EXECUTION_ID\"",
    ]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert_eq!(stdout(&out), format!("{}\n", id_in(&stderr(&out))));
}

#[test]
fn config_errors_name_file_and_line() {
    let env = new_env();
    let text = std::fs::read_to_string(&env.config)
        .unwrap()
        .replace("credential = \"k\"", "credential = \"missing\"");
    std::fs::write(&env.config, text).unwrap();
    let out = env.run(&["exec", "list"]);
    assert_eq!(out.status.code(), Some(2));
    let err = stderr(&out);
    assert!(
        err.contains(&format!("{}:", env.config.display()))
            && err.contains("credential \"missing\" is not defined"),
        "{err}"
    );
}

#[test]
fn lock_denies_new_actions_and_is_recorded() {
    let env = new_env();
    let locked = env.run(&["lock", "--reason", "db migration until 14:00"]);
    assert_eq!(locked.status.code(), Some(0));
    assert!(
        stdout(&locked).contains("Locked (db migration until 14:00)"),
        "{}",
        stdout(&locked)
    );
    let again = env.run(&["lock"]);
    assert_eq!(again.status.code(), Some(0));
    assert!(
        stdout(&again).contains("Already locked (db migration until 14:00)"),
        "{}",
        stdout(&again)
    );
    let hosts = stdout(&env.run(&["hosts", "list"]));
    assert!(
        hosts.contains("strict") && !hosts.contains("Strict"),
        "policies print as configured: {hosts}"
    );
    let out = env.run(&["exec", "run", "append", "line=locked", "secs=0"]);
    assert_eq!(out.status.code(), Some(202));
    assert!(
        stderr(&out).contains("locked (db migration until 14:00)"),
        "the refused caller is told why: {}",
        stderr(&out)
    );
    assert!(env.counter_lines().is_empty());
    assert_eq!(env.run(&["unlock"]).status.code(), Some(0));
    let out = env.run(&["exec", "run", "append", "line=after", "secs=0"]);
    assert_eq!(out.status.code(), Some(0));
    assert_eq!(env.counter_lines(), ["after"]);
}

#[test]
fn daemon_killed_mid_command_then_retry_attaches_and_runs_once() {
    let env = new_env();
    let mut daemon = env.start_daemon();
    let call = env
        .cmd()
        .args(["exec", "run", "append", "line=survivor", "secs=3"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    wait_for(
        || env.counter_lines().len() == 1,
        "the command to start on the host",
        Duration::from_secs(20),
    );
    daemon.kill(); // SIGKILL mid-command
    let first = call.wait_with_output().unwrap();
    assert_eq!(
        first.status.code(),
        Some(200),
        "the CLI says unknown: {}",
        stderr(&first)
    );
    let first_id = id_in(&stderr(&first));
    assert!(
        stderr(&first).contains(&format!("Run `waymark exec status {first_id}`")),
        "the exact status command is printed: {}",
        stderr(&first)
    );

    let mut daemon = env.start_daemon();
    let retry = env.run(&["exec", "run", "append", "line=survivor", "secs=3"]);
    assert_eq!(retry.status.code(), Some(0), "{}", stderr(&retry));
    // Said in words, with the way to a new intent; never the matching rule's internal name.
    let said = stderr(&retry);
    assert!(
        said.contains("attached to an earlier call of the same intent, not run again")
            && said.contains("A new `--key` makes a new intent")
            && !said.contains("ask_host_marker")
            && !said.contains("return_stored_result"),
        "{said}"
    );
    assert_eq!(stdout(&retry), "done survivor\n");
    assert_eq!(
        env.counter_lines(),
        ["survivor"],
        "exactly one run on the host"
    );
    let id = id_in(&stderr(&retry));
    let st = env.run(&["exec", "status", &id]);
    assert!(stdout(&st).contains("completed"), "{}", stdout(&st));
    let ex = env.run(&["exec", "explain", &id]);
    assert!(
        stdout(&ex).contains("from 2 distinct agent session(s)"),
        "{}",
        stdout(&ex)
    );
    // The attach in the timeline is said in the same words, not by the rule's internal name.
    assert!(
        stdout(&ex).contains(
            "attached instead of starting a new execution: it may have reached its host or API"
        ) && !stdout(&ex).contains("AskHostMarker"),
        "{}",
        stdout(&ex)
    );
    daemon.kill();
    assert_eq!(env.run(&["audit", "verify"]).status.code(), Some(0));
}

#[test]
fn a_canary_secret_never_reaches_ledger_or_explain() {
    let env = new_env();
    let canary = "CANARY-9d8c7b6a";
    let out = env.run(&["exec", "run", "secret_echo", &format!("token={canary}")]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert!(!stderr(&out).contains(canary) && !stdout(&out).contains(canary));
    let id = id_in(&stderr(&out));
    let ex = env.run(&["--json", "exec", "explain", &id]);
    assert!(!stdout(&ex).contains(canary));
    let found = files_containing(&env.ledger_dir(), canary);
    assert!(found.is_empty(), "canary in {found:?}");
}

#[test]
fn garbage_on_the_control_socket_gets_an_error_and_the_daemon_keeps_serving() {
    use std::io::{BufRead, Write};
    let env = new_env();
    let mut daemon = env.start_daemon();
    let socket = env.dir.path().join("run/daemon.sock");
    let mut s = std::os::unix::net::UnixStream::connect(&socket).unwrap();
    s.write_all(b"\x00\xffthis is not json\n").unwrap();
    let mut line = String::new();
    std::io::BufReader::new(&s).read_line(&mut line).unwrap();
    assert!(line.contains("not a Waymark control request"), "{line}");
    let mut s = std::os::unix::net::UnixStream::connect(&socket).unwrap();
    s.write_all(b"{\"v\":99,\"op\":\"ping\"}\n").unwrap();
    let mut line = String::new();
    std::io::BufReader::new(&s).read_line(&mut line).unwrap();
    assert!(line.contains("protocol v99 is not spoken"), "{line}");
    let out = env.run(&["exec", "run", "append", "line=after-garbage", "secs=0"]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert!(
        !stderr(&out).contains("no daemon"),
        "went through the daemon"
    );
    daemon.kill();
    let _ = &env.sshd;
}

#[test]
fn the_demo_shows_one_run_after_a_drop_and_a_retry() {
    let out = Command::new(bin())
        .arg("demo")
        .env("WAYMARK_LOG", "warn")
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let text = stdout(&out);
    assert_eq!(out.status.code(), Some(0), "{text}{}", stderr(&out));
    assert!(
        text.contains("state unknown"),
        "the drop is reported as unknown: {text}"
    );
    assert!(text.contains("completed, result NOT delivered"), "{text}");
    assert!(text.contains("Attached to earlier execution"), "{text}");
    assert!(
        text.contains("host deployments.log has 1 line(s)"),
        "{text}"
    );
    assert!(text.contains("Audit chain OK"), "{text}");
    assert!(
        !text.contains('\u{1b}'),
        "no terminal codes into a pipe: {text:?}"
    );
}

#[test]
fn hosts_trust_pins_an_unknown_key_only_when_confirmed() {
    let env = new_env();
    let kh = env.dir.path().join("empty_known_hosts");
    std::fs::write(&kh, "").unwrap();
    let text = std::fs::read_to_string(&env.config).unwrap().replace(
        &env.sshd.known_hosts_path().display().to_string(),
        &kh.display().to_string(),
    );
    std::fs::write(&env.config, text).unwrap();

    let list = env.run(&["hosts", "list"]);
    assert!(stdout(&list).contains("h1"), "{}", stdout(&list));
    let check = env.run(&["hosts", "check", "h1"]);
    assert_eq!(
        check.status.code(),
        Some(201),
        "nothing reached the host: the code of a call that did not start"
    );
    assert!(
        stderr(&check).contains(env.sshd.host_key_fingerprint_sha256()),
        "the refusal names the fingerprint: {}",
        stderr(&check)
    );
    // Under --json the error is JSON on stdout, with the same code.
    let check = env.run(&["--json", "hosts", "check", "h1"]);
    assert_eq!(check.status.code(), Some(201));
    let error: serde_json::Value =
        serde_json::from_slice(&check.stdout).unwrap_or_else(|e| panic!("{e}: {}", stdout(&check)));
    assert_eq!(error["exit"], 201);
    assert!(error["error"]
        .as_str()
        .unwrap()
        .contains(env.sshd.host_key_fingerprint_sha256()));
    let refused = env.run(&["exec", "run", "append", "line=x", "secs=0"]);
    assert_eq!(
        refused.status.code(),
        Some(201),
        "unknown host key: did not start"
    );
    assert!(env.counter_lines().is_empty());

    // Asked and declined: nothing pinned.
    let mut child = env
        .cmd()
        .args(["hosts", "trust", "h1"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    use std::io::Write;
    child.stdin.take().unwrap().write_all(b"n\n").unwrap();
    let declined = child.wait_with_output().unwrap();
    assert_eq!(declined.status.code(), Some(1), "declined, not blocked");
    assert!(stdout(&declined).contains(env.sshd.host_key_fingerprint_sha256()));
    assert_eq!(std::fs::read_to_string(&kh).unwrap(), "");

    let trust = env.run(&["hosts", "trust", "h1", "--yes"]);
    assert_eq!(trust.status.code(), Some(0), "{}", stderr(&trust));
    assert!(std::fs::read_to_string(&kh).unwrap().contains(
        env.sshd
            .host_key_public_openssh()
            .split_whitespace()
            .nth(1)
            .unwrap()
    ));
    let check = env.run(&["--json", "hosts", "check", "h1"]);
    assert_eq!(check.status.code(), Some(0));
    let ok: serde_json::Value = serde_json::from_slice(&check.stdout).unwrap();
    assert_eq!(
        (&ok["host"], &ok["ok"]),
        (&"h1".into(), &true.into()),
        "{ok}"
    );
    let again = env.run(&["hosts", "trust", "h1", "--yes"]);
    assert!(stdout(&again).contains("already pinned"));
    let again = env.run(&["--json", "hosts", "trust", "h1", "--yes"]);
    let pinned: serde_json::Value = serde_json::from_slice(&again.stdout).unwrap();
    assert_eq!(
        (&pinned["pinned"], &pinned["newly_pinned"]),
        (&true.into(), &false.into()),
        "{pinned}"
    );

    // A first pin into a known_hosts whose directories do not exist yet: they are made 0700,
    // as OpenSSH wants `~/.ssh`, and the answer says the key was pinned now.
    let fresh = env.dir.path().join("home/.ssh/known_hosts");
    let text = std::fs::read_to_string(&env.config)
        .unwrap()
        .replace(&kh.display().to_string(), &fresh.display().to_string());
    std::fs::write(&env.config, text).unwrap();
    let first = env.run(&["--json", "hosts", "trust", "h1", "--yes"]);
    assert_eq!(first.status.code(), Some(0), "{}", stderr(&first));
    let pinned: serde_json::Value = serde_json::from_slice(&first.stdout).unwrap();
    assert_eq!(
        (&pinned["pinned"], &pinned["newly_pinned"]),
        (&true.into(), &true.into()),
        "{pinned}"
    );
    assert!(
        pinned.get("changed").is_none(),
        "no word that reads as a changed key: {pinned}"
    );
    for dir in [
        fresh.parent().unwrap(),
        fresh.parent().unwrap().parent().unwrap(),
    ] {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(dir).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o700, "{} is {mode:o}", dir.display());
    }

    // A changed host key: `hosts trust` refuses to pin over it with the code `hosts check`
    // and a call give it, 201 (nothing reached the host).
    let pinned_line = std::fs::read_to_string(&fresh).unwrap();
    let target = pinned_line.split_whitespace().next().unwrap();
    std::fs::write(
        &fresh,
        format!("{target} {}\n", env.sshd.user_key_public().trim()),
    )
    .unwrap();
    for args in [
        &["hosts", "check", "h1"][..],
        &["hosts", "trust", "h1", "--yes"],
    ] {
        let refused = env.run(args);
        assert_eq!(
            refused.status.code(),
            Some(201),
            "{args:?}: {}",
            stderr(&refused)
        );
    }
}

#[test]
fn json_is_the_answer_and_the_error_of_every_local_command() {
    let env = new_env();
    // A usage error that clap itself finds.
    let bad = env.run(&["--json", "exec", "status", "not-an-id"]);
    assert_eq!(bad.status.code(), Some(2));
    let error: serde_json::Value =
        serde_json::from_slice(&bad.stdout).unwrap_or_else(|e| panic!("{e}: {}", stdout(&bad)));
    assert_eq!(error["exit"], 2);
    assert!(
        error["error"].as_str().unwrap().contains("not-an-id"),
        "{error}"
    );
    // An unknown host.
    let unknown = env.run(&["--json", "hosts", "check", "nope"]);
    assert_eq!(unknown.status.code(), Some(2));
    let error: serde_json::Value = serde_json::from_slice(&unknown.stdout).unwrap();
    assert!(
        error["error"].as_str().unwrap().contains("unknown host"),
        "{error}"
    );
    // init, with nothing to create and with a ledger a running daemon owns.
    let _daemon = env.start_daemon();
    let init = env.run(&["--json", "init"]);
    assert_eq!(init.status.code(), Some(0), "{}", stderr(&init));
    let said: serde_json::Value =
        serde_json::from_slice(&init.stdout).unwrap_or_else(|e| panic!("{e}: {}", stdout(&init)));
    assert_eq!(said["configuration"]["action"], "kept", "{said}");
    assert_eq!(said["ledger"]["owned_by_daemon"], true, "{said}");
    assert!(said["runtime_dir"].is_string(), "{said}");
}

fn only_execution(env: &Env) -> (String, String) {
    let list = env.run(&["--json", "exec", "list"]);
    let v: serde_json::Value = serde_json::from_slice(&list.stdout).unwrap();
    let items = v["items"].as_array().unwrap();
    assert_eq!(items.len(), 1, "exactly one execution: {v}");
    (
        items[0]["id"].as_str().unwrap().to_string(),
        items[0]["state"].as_str().unwrap().to_string(),
    )
}

/// The daemon dies by SIGKILL right after `point`; a new daemon and a retry must end with
/// exactly one run on the host and a truthful status in between.
fn crash_then_recover(point: &str, state_after: &str, runs_before_retry: usize) {
    let env = new_env();
    let mut crashing = env.start_daemon_with(&[("WAYMARK_CRASH_AT", point)], Stdio::null());
    let first = env.run(&["exec", "run", "append", "line=L", "secs=1"]);
    assert_eq!(
        first.status.code(),
        Some(200),
        "the caller is told the outcome is unknown: {}",
        stderr(&first)
    );
    let status = crashing.0.wait().unwrap();
    assert!(
        status.code().is_none(),
        "the daemon died by a signal at {point}"
    );
    let _daemon = env.start_daemon();
    let (id, state) = only_execution(&env);
    assert_eq!(state, state_after, "after a crash at {point}");
    let st = env.run(&["exec", "status", &id]);
    assert!(
        stdout(&st).contains(state_after),
        "status tells the truth: {}",
        stdout(&st)
    );
    if state_after == "completed" {
        // This status answer delivers the result, so it shows the output it delivers.
        let text = stdout(&st);
        assert!(
            text.contains("Output delivered with this answer") && text.ends_with("\ndone L\n"),
            "{text}"
        );
    }
    assert_eq!(env.counter_lines().len(), runs_before_retry);
    let retry = env.run(&["exec", "run", "append", "line=L", "secs=1"]);
    assert_eq!(retry.status.code(), Some(0), "{}", stderr(&retry));
    assert_eq!(
        id_in(&stderr(&retry)),
        id,
        "the retry attached to the first execution"
    );
    assert_eq!(stdout(&retry), "done L\n");
    assert_eq!(env.counter_lines(), ["L"], "exactly one run on the host");
    assert_eq!(env.run(&["audit", "verify"]).status.code(), Some(0));
}

#[test]
fn daemon_killed_after_accepted_recovers_with_one_run() {
    // The id is announced once acceptance, the policy's answer and the dispatch (nothing sent
    // yet) are flushed together.
    crash_then_recover("accepted", "dispatched", 0);
}

#[test]
fn daemon_killed_after_dispatched_before_the_request_left_recovers_with_one_run() {
    crash_then_recover("dispatched", "dispatched", 0);
}

#[test]
fn daemon_killed_after_completed_before_delivery_recovers_with_one_run() {
    crash_then_recover("completed", "completed", 1);
}

#[test]
fn approval_flow_retry_while_pending_attaches_to_the_one_request() {
    let env = new_env();
    let _daemon = env.start_daemon_with(&[("WAYMARK_APPROVAL_WAIT_SECS", "30")], Stdio::inherit());
    let spawn = || {
        env.cmd()
            .args(["exec", "run", "guarded", "line=G"])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    };
    let first = spawn();
    wait_for(
        || stdout(&env.run(&["--json", "approvals"])).contains("act_"),
        "the approval request",
        Duration::from_secs(20),
    );
    let retry = spawn();
    std::thread::sleep(Duration::from_millis(500));
    let pending: serde_json::Value =
        serde_json::from_slice(&env.run(&["--json", "approvals"]).stdout).unwrap();
    let items = pending["items"].as_array().unwrap();
    assert_eq!(
        items.len(),
        1,
        "a retry never creates a second approval request: {pending}"
    );
    let id = items[0]["id"].as_str().unwrap().to_string();
    assert!(
        env.counter_lines().is_empty(),
        "nothing runs before approval"
    );
    assert_eq!(env.run(&["approve", &id]).status.code(), Some(0));
    let a = first.wait_with_output().unwrap();
    let b = retry.wait_with_output().unwrap();
    for o in [&a, &b] {
        assert_eq!(o.status.code(), Some(0), "{}", stderr(o));
        assert_eq!(stdout(o), "approved G\n");
        assert_eq!(id_in(&stderr(o)), id);
    }
    assert!(stderr(&b).contains("attached"), "{}", stderr(&b));
    assert!(
        stderr(&a).contains("awaits an operator's approval")
            && stderr(&a).contains(&format!("waymark approve {id}")),
        "the caller is told what it waits for, not left waiting silently: {}",
        stderr(&a)
    );
    assert_eq!(env.counter_lines(), ["G"]);

    // A denial is recorded and returned to a retry as the same denial.
    let denied_call = env
        .cmd()
        .args(["exec", "run", "guarded", "line=D"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    wait_for(
        || stdout(&env.run(&["--json", "approvals"])).contains("act_"),
        "the second approval request",
        Duration::from_secs(20),
    );
    let pending: serde_json::Value =
        serde_json::from_slice(&env.run(&["--json", "approvals"]).stdout).unwrap();
    let did = pending["items"][0]["id"].as_str().unwrap().to_string();
    assert_eq!(
        env.run(&["deny", &did, "--reason", "not during business hours"])
            .status
            .code(),
        Some(0)
    );
    let d = denied_call.wait_with_output().unwrap();
    assert_eq!(d.status.code(), Some(202));
    let again = env.run(&["exec", "run", "guarded", "line=D"]);
    assert_eq!(again.status.code(), Some(202));
    assert_eq!(
        id_in(&stderr(&again)),
        did,
        "the retry gets the stored denial"
    );
    assert!(
        stdout(&again).contains("not during business hours")
            || stderr(&again).contains("not during business hours")
    );
    assert_eq!(env.counter_lines(), ["G"]);
}

#[test]
fn two_clients_racing_the_same_call_attach_to_one_execution() {
    let env = new_env();
    let _daemon = env.start_daemon();
    let spawn = || {
        env.cmd()
            .args(["exec", "run", "append", "line=R", "secs=1"])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    };
    let (a, b) = (spawn(), spawn());
    let (a, b) = (a.wait_with_output().unwrap(), b.wait_with_output().unwrap());
    assert_eq!(
        (a.status.code(), b.status.code()),
        (Some(0), Some(0)),
        "{}{}",
        stderr(&a),
        stderr(&b)
    );
    assert_eq!(id_in(&stderr(&a)), id_in(&stderr(&b)));
    assert_eq!(stdout(&a), "done R\n");
    assert_eq!(stdout(&b), "done R\n");
    assert_eq!(env.counter_lines(), ["R"]);
}

#[test]
fn a_canary_secret_never_reaches_the_daemon_log() {
    let env = new_env();
    let log = env.dir.path().join("daemon.log");
    let file = std::fs::File::create(&log).unwrap();
    let canary = "CANARY-log-5e4d3c";
    let mut daemon = {
        let mut cmd = env.cmd();
        cmd.arg("daemon")
            .env("WAYMARK_LOG", "trace")
            .stdout(Stdio::null())
            .stderr(file);
        Daemon(cmd.spawn().unwrap())
    };
    wait_for(
        || env.dir.path().join("run/daemon.sock").exists(),
        "the daemon socket",
        Duration::from_secs(20),
    );
    std::thread::sleep(Duration::from_millis(200));
    let out = env.run(&["exec", "run", "secret_echo", &format!("token={canary}")]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    daemon.kill();
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(text.len() > 100, "trace logging produced output");
    assert!(!text.contains(canary), "canary in the daemon log");
}

#[test]
fn cancel_kills_a_running_command_and_runs_and_gc_report() {
    let env = new_env();
    let _daemon = env.start_daemon();
    let call = env
        .cmd()
        .args(["exec", "run", "append", "line=C", "secs=30"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    wait_for(
        || env.counter_lines().len() == 1,
        "the command to start",
        Duration::from_secs(20),
    );
    let (id, _) = only_execution(&env);
    let cancel = env.run(&["exec", "cancel", &id]);
    assert_eq!(cancel.status.code(), Some(0), "{}", stderr(&cancel));
    let out = call.wait_with_output().unwrap();
    assert_eq!(
        out.status.code(),
        Some(203),
        "the caller learns it was stopped: {}",
        stderr(&out)
    );
    let st = env.run(&["exec", "status", &id]);
    assert!(stdout(&st).contains("cancelled"), "{}", stdout(&st));
    let runs = env.run(&["--json", "runs"]);
    let v: serde_json::Value = serde_json::from_slice(&runs.stdout).unwrap();
    assert!(
        v["items"]
            .as_array()
            .unwrap()
            .iter()
            .any(|r| r["transport"].as_str().unwrap_or("").contains("pid=")),
        "{v}"
    );
    // A dry run says, in words, what would go, and removes nothing.
    let dry = env.run(&["gc", "--older-than", "0s", "--dry-run"]);
    assert_eq!(dry.status.code(), Some(0), "{}", stderr(&dry));
    assert!(
        stdout(&dry).contains("Would remove 1 resolved execution accepted more than 0s ago")
            && stdout(&dry).contains("Nothing was removed (--dry-run)"),
        "{}",
        stdout(&dry)
    );
    let json = env.run(&["--json", "gc", "--older-than", "0s", "--dry-run"]);
    let v: serde_json::Value = serde_json::from_slice(&json.stdout).unwrap();
    assert_eq!(
        (&v["removed"], &v["dry_run"]),
        (&1.into(), &true.into()),
        "{v}"
    );
    assert_eq!(env.run(&["exec", "status", &id]).status.code(), Some(203));
    let gc = env.run(&["gc", "--older-than", "0s"]);
    assert_eq!(gc.status.code(), Some(0), "{}", stderr(&gc));
    assert!(
        stdout(&gc).contains("Removed 1 resolved execution accepted more than 0s ago"),
        "{}",
        stdout(&gc)
    );
    let gone = env.run(&["exec", "status", &id]);
    assert_ne!(gone.status.code(), Some(203), "removed: {}", stdout(&gone));
    assert_eq!(env.run(&["audit", "verify"]).status.code(), Some(0));
}

#[test]
fn binary_output_streams_intact_and_result_fetches_past_the_ledger_cap() {
    let env = new_env();
    let _daemon = env.start_daemon();
    // 200 000 random bytes: more than the ledger keeps (64 KiB), and not UTF-8.
    let out = env.run(&[
        "exec",
        "run",
        "--host",
        "h1",
        "--",
        "sh",
        "-c",
        "head -c 200000 /dev/urandom; sleep 1; echo tail >&2",
    ]);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let id = id_in(&stderr(&out));
    let on_host =
        std::fs::read(env.sshd.marker_file(&id, "stdout")).expect("the marker keeps stdout");
    assert_eq!(on_host.len(), 200_000);
    assert_eq!(
        out.stdout, on_host,
        "exec run printed exactly the host's bytes, once"
    );
    assert!(stderr(&out).contains("tail"), "{}", stderr(&out));
    let res = env.cmd().args(["exec", "result", &id]).output().unwrap();
    assert_eq!(res.status.code(), Some(0), "{}", stderr(&res));
    assert_eq!(
        res.stdout, on_host,
        "exec result printed it all: the stored part, then the rest from the host"
    );
    let json = env.run(&["--json", "exec", "result", &id]);
    let v: serde_json::Value = serde_json::from_slice(&json.stdout).unwrap();
    let sum = Command::new("sha256sum")
        .arg(env.sshd.marker_file(&id, "stdout"))
        .output()
        .expect("sha256sum (coreutils)");
    let sum = String::from_utf8_lossy(&sum.stdout);
    assert_eq!(
        v["stdout_sha256"].as_str(),
        sum.split_whitespace().next(),
        "the stored hash is of the whole stream: {v}"
    );
    assert_eq!(v["stdout_bytes"], 200_000);
}

#[test]
fn resume_review_init_and_audit_head_do_what_they_say() {
    let env = new_env();
    // A raw command whose daemon dies right after recording "dispatched": nothing ran.
    let mut crashing = env.start_daemon_with(&[("WAYMARK_CRASH_AT", "dispatched")], Stdio::null());
    let counter = env.counter.display().to_string();
    let script = format!("echo resumed >> {counter}; echo ok");
    let first = env.run(&["exec", "run", "--host", "h1", "--", "sh", "-c", &script]);
    assert_eq!(first.status.code(), Some(200));
    let _ = crashing.0.wait();
    let (id, state) = only_execution(&env);
    assert_eq!(state, "dispatched");
    // The next CLI call starts a fresh daemon: resume sends it again under the same id; it
    // runs once.
    let resumed = env.run(&["exec", "resume", &id]);
    assert_eq!(resumed.status.code(), Some(0), "{}", stderr(&resumed));
    assert_eq!(stdout(&resumed), "ok\n");
    assert_eq!(env.counter_lines(), ["resumed"]);
    let again = env.run(&["exec", "resume", &id]);
    assert_eq!(
        again.status.code(),
        Some(2),
        "a completed execution is not resumed: {}",
        stderr(&again)
    );
    assert_eq!(env.counter_lines(), ["resumed"]);

    // Review: a second lost one, resolved by a human.
    env.kill_daemons();
    let mut crashing = env.start_daemon_with(&[("WAYMARK_CRASH_AT", "dispatched")], Stdio::null());
    let lost = env.run(&["exec", "run", "append", "line=never", "secs=0"]);
    assert_eq!(lost.status.code(), Some(200));
    let _ = crashing.0.wait();
    let list = env.run(&["--json", "exec", "list", "--state", "dispatched"]);
    let v: serde_json::Value = serde_json::from_slice(&list.stdout).unwrap();
    let lost_id = v["items"][0]["id"].as_str().unwrap().to_string();
    let review = env.run(&[
        "exec",
        "review",
        &lost_id,
        "--did-not-run",
        "--note",
        "checked the host: no trace",
    ]);
    assert_eq!(review.status.code(), Some(0), "{}", stderr(&review));
    let st = env.run(&["exec", "status", &lost_id]);
    assert!(
        stdout(&st).contains("reviewed") && stdout(&st).contains("no trace"),
        "{}",
        stdout(&st)
    );

    // Audit head exports SEQ:HASH; verify proves the chain still reaches it.
    let head = stdout(&env.run(&["audit", "head"])).trim().to_string();
    assert!(head.contains(':'), "{head}");
    let verify = env.run(&["audit", "verify", "--head", &head]);
    assert_eq!(verify.status.code(), Some(0), "{}", stdout(&verify));
    let bogus = format!("{}:{}", head.split(':').next().unwrap(), "0".repeat(64));
    assert_eq!(
        env.run(&["audit", "verify", "--head", &bogus])
            .status
            .code(),
        Some(204)
    );

    // init writes a configuration skeleton and creates the ledger and its key.
    let home = env.dir.path().join("fresh-home");
    std::fs::create_dir_all(&home).unwrap();
    let cfg = home.join("cfg/waymark.toml");
    let init = Command::new(bin())
        .args(["--config"])
        .arg(&cfg)
        .arg("init")
        .env("HOME", &home)
        .env("XDG_STATE_HOME", home.join("state"))
        .env("XDG_RUNTIME_DIR", home.join("run"))
        .output()
        .unwrap();
    assert_eq!(init.status.code(), Some(0), "{}", stderr(&init));
    assert!(cfg.exists());
    assert!(
        home.join("state/waymark/ledger/ledger.key").exists(),
        "{}",
        stdout(&init)
    );
}

#[test]
fn resume_of_a_tool_execution_takes_the_call_again_and_runs_it_once() {
    let env = new_env();
    // A tool call whose daemon dies right after recording "dispatched": nothing ran.
    let mut crashing = env.start_daemon_with(&[("WAYMARK_CRASH_AT", "dispatched")], Stdio::null());
    let first = env.run(&["exec", "run", "append", "line=later", "secs=0"]);
    assert_eq!(first.status.code(), Some(200), "{}", stderr(&first));
    let _ = crashing.0.wait();
    let (id, state) = only_execution(&env);
    assert_eq!(state, "dispatched");
    // Without the call, resume says how to give it (secret arguments are not stored)...
    let bare = env.run(&["exec", "resume", &id]);
    assert_eq!(bare.status.code(), Some(2));
    let hint = format!("waymark exec resume {id} append key=value");
    assert!(stderr(&bare).contains(&hint), "{}", stderr(&bare));
    // ...a different intent is refused...
    let other = env.run(&["exec", "resume", &id, "append", "line=other", "secs=0"]);
    assert_ne!(other.status.code(), Some(0), "{}", stderr(&other));
    assert!(
        stderr(&other).contains("not the same intent"),
        "{}",
        stderr(&other)
    );
    assert!(env.counter_lines().is_empty(), "nothing ran yet");
    // ...and the call given as the hint says resumes it under its own id, once.
    let resumed = env.run(&["exec", "resume", &id, "append", "line=later", "secs=0"]);
    assert_eq!(resumed.status.code(), Some(0), "{}", stderr(&resumed));
    assert_eq!(stdout(&resumed), "done later\n");
    assert_eq!(id_in(&stderr(&resumed)), id);
    assert_eq!(env.counter_lines(), ["later"]);
    assert_eq!(only_execution(&env), (id, "completed".to_string()));
}

#[test]
fn a_reader_that_goes_away_ends_the_cli_quietly_without_a_panic() {
    let env = new_env();
    for line in ["a", "b", "c"] {
        let out = env.run(&["exec", "run", "append", &format!("line={line}"), "secs=0"]);
        assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    }
    // `waymark ... | head -c0`: the read end is closed before the CLI writes a byte.
    for args in [
        &["exec", "list"][..],
        &["--json", "exec", "list"],
        &["runs"],
        &["--json", "runs"],
        &["exec", "run", "append", "line=a", "secs=0"],
    ] {
        let (reader, writer) = std::io::pipe().unwrap();
        drop(reader);
        let out = env
            .cmd()
            .args(args)
            .stdout(writer)
            .stderr(Stdio::piped())
            .output()
            .unwrap();
        let err = stderr(&out);
        assert!(
            !err.contains("panicked"),
            "waymark {args:?} panicked on a closed stdout: {err}"
        );
        assert_eq!(
            out.status.code(),
            Some(141),
            "waymark {args:?} ends as a shell pipeline expects (128+SIGPIPE): {err}"
        );
    }
    assert_eq!(
        env.counter_lines(),
        ["a", "b", "c"],
        "the repeat attached and ran nothing"
    );
}

#[test]
fn a_result_is_delivered_only_once_its_whole_answer_was_written() {
    let env = new_env();
    let _daemon = env.start_daemon();
    // A client that defers delivery and never confirms it: completed, not delivered.
    let call = env.control(serde_json::json!({"v": 1, "op": "call", "tool": "append",
        "args": {"line": "x", "secs": 0}, "defer_delivery": true}));
    assert_eq!(call["data"]["state"], "completed", "{call}");
    let id = call["data"]["id"].as_str().unwrap().to_string();
    let delivered = || {
        let v = env
            .control(serde_json::json!({"v": 1, "op": "status", "id": id, "defer_delivery": true}));
        v["data"]["result_delivered"].as_bool().unwrap()
    };
    assert!(!delivered(), "a deferring client marks delivery itself");

    // A reader that goes away before the answer is written: status and result are not delivered.
    for op in ["result", "status"] {
        let mut s = std::os::unix::net::UnixStream::connect(env.socket()).unwrap();
        // Gone before the answer, whatever the daemon's speed: a write to a unix socket whose
        // reader shut down fails (EPIPE), where one before a close could still land in the
        // socket's buffer.
        s.shutdown(std::net::Shutdown::Read).unwrap();
        let line = format!("{}\n", serde_json::json!({"v": 1, "op": op, "id": id}));
        std::io::Write::write_all(&mut s, line.as_bytes()).unwrap();
        drop(s);
    }
    std::thread::sleep(Duration::from_secs(1));
    assert!(
        !delivered(),
        "no reader got the answer, so nothing was delivered"
    );
    let explain = stdout(&env.run(&["exec", "explain", &id]));
    assert!(!explain.contains("was delivered"), "{explain}");

    // Asking with defer_delivery and reading the whole answer leaves the marking to the client.
    let r =
        env.control(serde_json::json!({"v": 1, "op": "result", "id": id, "defer_delivery": true}));
    assert_eq!(r["data"]["stdout"], "done x\n", "{r}");
    assert!(!delivered());

    // `exec result` reads the whole answer: now it is delivered.
    let res = env.run(&["exec", "result", &id]);
    assert_eq!(stdout(&res), "done x\n");
    // Recorded once the daemon's write of the answer completed, which the CLI may outrun.
    wait_for(
        delivered,
        "the delivery of the answer the CLI read whole",
        Duration::from_secs(10),
    );
    assert_eq!(env.counter_lines(), ["x"]);
}

#[test]
fn explain_tells_a_delivered_did_not_start_and_the_safe_new_execution_after_it() {
    let env = Env::builder().tools(APPEND_TOOL).fault_proxy().build();
    let log = env.dir.path().join("daemon.log");
    let _daemon = env.start_daemon_with(&[], std::fs::File::create(&log).unwrap().into());
    // The host refuses connections: nothing is sent, the call fails and says so.
    env.proxy().refuse_new(true);
    let failed = env.run(&["exec", "run", "append", "line=f", "secs=0"]);
    assert_ne!(failed.status.code(), Some(0), "{}", stderr(&failed));
    let first = id_in(&stderr(&failed));
    assert_eq!(env.state(&first), "failed");
    // ... and the daemon's log says it at warn, with its cause.
    wait_for(
        || {
            std::fs::read_to_string(&log)
                .unwrap_or_default()
                .lines()
                .any(|l| {
                    l.contains("WARN")
                        && l.contains("did not start")
                        && l.contains(&first)
                        && l.contains("cause=")
                })
        },
        "a warn line for the call that did not start",
        Duration::from_secs(10),
    );
    env.proxy().refuse_new(false);
    let ran = env.run(&["exec", "run", "append", "line=f", "secs=0"]);
    assert_eq!(ran.status.code(), Some(0), "{}", stderr(&ran));
    let second = id_in(&stderr(&ran));
    assert_ne!(
        first, second,
        "a proven 'did not start' lets the same call start afresh"
    );
    assert_eq!(env.counter_lines(), ["f"]);

    let explain = stdout(&env.run(&["exec", "explain", &first]));
    assert!(
        explain.contains("3. It did not start on the host"),
        "{explain}"
    );
    assert!(explain.contains("4. The result was delivered"), "{explain}");
    assert!(!explain.contains("Nothing to deliver yet"), "{explain}");
    assert!(
        explain.contains(&second) && explain.contains("provably never ran"),
        "{explain}"
    );
    assert!(!explain.contains("outside the retry window"), "{explain}");
}

#[test]
fn ctrl_c_while_waiting_names_the_execution_and_it_goes_on() {
    let env = new_env();
    let _daemon = env.start_daemon();
    let mut child = env
        .cmd()
        .args(["exec", "run", "append", "line=c", "secs=2"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut err = std::io::BufReader::new(child.stderr.take().unwrap());
    let (first, id) = read_until_id(&mut err);
    // SAFETY: kill has no memory preconditions; the pid is our own child.
    assert_eq!(unsafe { libc::kill(child.id() as i32, libc::SIGINT) }, 0);
    let status = child.wait().unwrap();
    let mut rest = String::new();
    std::io::Read::read_to_string(&mut err, &mut rest).unwrap();
    assert_eq!(status.code(), Some(130), "{first}{rest}");
    assert!(
        rest.contains(&format!("execution {id} goes on"))
            && rest.contains(&format!("waymark exec status {id}")),
        "{rest}"
    );
    wait_for(
        || env.state(&id) == "completed",
        "the interrupted call's execution completes in the daemon",
        Duration::from_secs(20),
    );
    assert_eq!(env.counter_lines(), ["c"]);
}

#[test]
fn a_command_already_running_reads_as_running_and_its_output_so_far_is_shown() {
    let env = Env::builder()
        .tools(APPEND_TOOL)
        .tools(
            r#"
[tools.half]
description = "Prints a line, waits, prints another."
hosts = ["h1"]
argv = ["sh", "-c", "echo before; sleep 3; echo after"]
contract = "idempotent"
"#,
        )
        .build();
    let _daemon = env.start_daemon();
    let mut child = env
        .cmd()
        .args(["exec", "run", "half"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut err = std::io::BufReader::new(child.stderr.take().unwrap());
    let (_, id) = read_until_id(&mut err);
    let marker = env.sshd.marker_file(&id, "stdout");
    wait_for(
        || std::fs::read(&marker).is_ok_and(|b| b == b"before\n"),
        "the command printed its first line",
        Duration::from_secs(20),
    );
    let st = env.run(&["exec", "status", &id]);
    assert!(
        stdout(&st).contains(&format!("{id}  running")),
        "the host shows it running, so status says so: {}",
        stdout(&st)
    );
    // Running has its own code: a script tells it from an unknown outcome (200).
    assert_eq!(st.status.code(), Some(205), "{}", stderr(&st));
    let res = env.run(&["exec", "result", &id]);
    assert_eq!(res.status.code(), Some(205), "{}", stderr(&res));
    assert_eq!(
        stdout(&res),
        "before\n",
        "the output so far: {}",
        stderr(&res)
    );
    assert!(stderr(&res).contains("still running"), "{}", stderr(&res));
    assert_eq!(child.wait().unwrap().code(), Some(0));
    let done = env.run(&["exec", "result", &id]);
    assert_eq!(stdout(&done), "before\nafter\n");
}

#[test]
fn a_secret_argument_can_come_from_stdin_or_the_environment_never_the_cli_argv() {
    use std::io::Write as _;
    let env = Env::builder()
        .tools(
            r#"
[tools.check_token]
description = "Says whether the token is the expected one."
hosts = ["h1"]
argv = ["sh", "-c", "if [ \"$1\" = \"$2\" ]; then echo match; else echo differs; fi", "x", "{token}", "{expected}"]
contract = "read_only"

[tools.check_token.args.token]
type = "string"
secret = true

[tools.check_token.args.expected]
type = "string"
"#,
        )
        .build();
    let _daemon = env.start_daemon();
    let out = env
        .cmd()
        .env("WM_TOKEN", "CANARY-env-41")
        .args([
            "exec",
            "run",
            "check_token",
            "token=@env:WM_TOKEN",
            "expected=CANARY-env-41",
        ])
        .output()
        .unwrap();
    assert_eq!(stdout(&out), "match\n", "{}", stderr(&out));

    let mut child = env
        .cmd()
        .args([
            "exec",
            "run",
            "check_token",
            "token=@-",
            "expected=CANARY-stdin-42",
        ])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(b"CANARY-stdin-42\n")
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert_eq!(stdout(&out), "match\n", "{}", stderr(&out));

    let literal = env.run(&["exec", "run", "check_token", "token=@@x", "expected=@x"]);
    assert_eq!(stdout(&literal), "match\n", "{}", stderr(&literal));

    let unset = env.run(&[
        "exec",
        "run",
        "check_token",
        "token=@env:WM_NOT_SET_ANYWHERE",
        "expected=x",
    ]);
    assert_eq!(unset.status.code(), Some(2));
    assert!(
        stderr(&unset).contains("WM_NOT_SET_ANYWHERE is not set"),
        "{}",
        stderr(&unset)
    );
    let help = env.run(&["exec", "run", "--help"]);
    assert!(stdout(&help).contains("key=@env:VAR"), "{}", stdout(&help));
}

/// Tool `name` on `h1` with `argv = ARGV` (and whatever TOML follows it) and a secret argument
/// `password`.
fn secret_tool(name: &str, argv: &str) -> String {
    format!(
        "[tools.{name}]\ndescription = \"Uses a secret.\"\nhosts = [\"h1\"]\nargv = {argv}\n\
         contract = \"idempotent\"\n\n[tools.{name}.args.password]\ntype = \"string\"\nsecret = true\n"
    )
}

/// Runs `tool` (declared in `toml`, taking the secret `password`) with the value `canary` from
/// the CLI's environment. While its command sleeps on the host, collects every process command
/// line and every file under the remote dir that holds the canary; then checks that the command
/// received the value (it prints the value's sha256sum). Returns the holders and the CLI's
/// stderr.
fn canary_holders_while_it_runs(
    toml: &str,
    tool: &str,
    canary: &str,
) -> (Vec<String>, Vec<std::path::PathBuf>, String) {
    let env = Env::builder().tools(toml).build();
    let _daemon = env.start_daemon();
    let child = env
        .cmd()
        .env("WM_PASSWORD", canary)
        .args(["exec", "run", tool, "password=@env:WM_PASSWORD"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let exec_dir = env.sshd.remote_dir().join("exec");
    wait_for(
        || {
            std::fs::read_dir(&exec_dir)
                .map(|d| {
                    d.flatten()
                        .any(|e| e.path().extension() == Some("cmd".as_ref()))
                })
                .unwrap_or(false)
        },
        "the command started on the host",
        Duration::from_secs(20),
    );
    // Every process line that holds the canary, sampled for a second while the command runs
    // (it sleeps 2 s): one sample can fall in the instant `setsid -- CMD` has not yet become
    // CMD, so the union over many samples is what the command line shows.
    let mut holders = Vec::new();
    let until = std::time::Instant::now() + Duration::from_secs(1);
    while std::time::Instant::now() < until {
        for p in std::fs::read_dir("/proc").unwrap().flatten() {
            if let Ok(cmdline) = std::fs::read(p.path().join("cmdline")) {
                if cmdline
                    .windows(canary.len())
                    .any(|w| w == canary.as_bytes())
                {
                    let line = String::from_utf8_lossy(&cmdline).replace('\0', " ");
                    if !holders.contains(&line) {
                        holders.push(line);
                    }
                }
            }
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let files = files_containing(&env.sshd.remote_dir(), canary);
    let out = child.wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let sum = Command::new("sha256sum")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .and_then(|mut c| {
            std::io::Write::write_all(c.stdin.as_mut().unwrap(), canary.as_bytes())?;
            c.wait_with_output()
        })
        .unwrap();
    assert_eq!(
        stdout(&out),
        String::from_utf8_lossy(&sum.stdout),
        "the command received the value"
    );
    (holders, files, stderr(&out))
}

#[test]
fn a_secret_in_env_never_reaches_a_process_list_or_a_marker_file() {
    let canary = "CANARY-proc-7f3e2d";
    let tool = secret_tool(
        "rotate",
        r#"["sh", "-c", "sleep 2; printf %s \"$NEW_PASSWORD\" | sha256sum"]
env = { NEW_PASSWORD = "{password}" }"#,
    );
    let (holders, files, said) = canary_holders_while_it_runs(&tool, "rotate", canary);
    // While it ran: no command line of any process, and no file under the remote dir.
    assert!(
        holders.is_empty(),
        "the secret is on a command line: {holders:?}"
    );
    assert!(files.is_empty(), "the secret is in {files:?}");
    assert!(
        !said.contains("warning"),
        "a secret in env is the safe way: no warning: {said}"
    );
}

#[test]
fn a_secret_in_argv_reaches_only_the_commands_own_argv_never_the_wrapper_or_a_marker_file() {
    let canary = "CANARY-argv-9c1d";
    // Config load warns about this tool: the command itself shows the secret.
    let tool = secret_tool(
        "rotate_argv",
        r#"["sh", "-c", "sleep 2; printf %s \"$1\" | sha256sum", "rotate", "{password}"]"#,
    );
    let (holders, files, _) = canary_holders_while_it_runs(&tool, "rotate_argv", canary);
    // Only the command's own process shows it (as any argv would), never a wrapper's command
    // line, and no file under the remote dir holds it.
    assert!(
        holders.iter().all(|c| !c.contains("wrap-")),
        "the secret is on a wrapper's command line: {holders:?}"
    );
    assert!(
        holders.iter().any(|c| c.starts_with("sh -c sleep 2")),
        "the command itself has it: {holders:?}"
    );
    assert!(files.is_empty(), "the secret is in {files:?}");
}

#[test]
fn a_secret_the_command_prints_is_masked_in_live_output_and_every_result() {
    let canary = "CANARY-leak-5a4b";
    let env = Env::builder()
        .tools(
            r#"
[tools.leaky]
description = "Prints its secret (badly written on purpose)."
hosts = ["h1"]
argv = ["sh", "-c", "echo \"got $T\"; sleep 1; echo \"again $T\" >&2; echo end"]
env = { T = "{token}" }
contract = "idempotent"

[tools.leaky.args.token]
type = "string"
secret = true
"#,
        )
        .build();
    let _daemon = env.start_daemon();
    let run = env
        .cmd()
        .env("WM_T", canary)
        .args(["exec", "run", "leaky", "token=@env:WM_T"])
        .output()
        .unwrap();
    assert_eq!(run.status.code(), Some(0), "{}", stderr(&run));
    let stars = "*".repeat(canary.len());
    assert_eq!(
        stdout(&run),
        format!("got {stars}\nend\n"),
        "live output and the rest"
    );
    assert!(
        stderr(&run).contains(&format!("again {stars}")),
        "{}",
        stderr(&run)
    );
    let id = id_in(&stderr(&run));
    for args in [
        &["exec", "result", &id][..],
        &["--json", "exec", "result", &id],
        &["--json", "exec", "status", &id],
    ] {
        let out = env.run(args);
        let all = format!("{}{}", stdout(&out), stderr(&out));
        assert!(!all.contains(canary), "waymark {args:?}: {all}");
    }
    let on_host = std::fs::read_to_string(env.sshd.marker_file(&id, "stdout")).unwrap();
    assert!(
        on_host.contains(canary),
        "the host's own file is the command's business"
    );
}

#[test]
fn config_check_validates_without_starting_anything() {
    let env = new_env();
    // The test tools keep a secret in argv on purpose: a warning with its line, still usable.
    let ok = env.run(&["config", "check"]);
    assert_eq!(ok.status.code(), Some(0), "{}", stderr(&ok));
    assert!(stdout(&ok).contains(": OK ("), "{}", stdout(&ok));
    assert!(
        stderr(&ok).contains("warning:")
            && stderr(&ok).contains("secret argument token is in argv"),
        "{}",
        stderr(&ok)
    );
    let json = env.run(&["--json", "config", "check"]);
    let v: serde_json::Value = serde_json::from_slice(&json.stdout).unwrap();
    assert_eq!(v["ok"], true, "{v}");
    assert!(!v["warnings"].as_array().unwrap().is_empty(), "{v}");
    // Other commands do not repeat them.
    let list = env.run(&["hosts", "list"]);
    assert_eq!(list.status.code(), Some(0));
    assert!(!stderr(&list).contains("warning"), "{}", stderr(&list));

    // A missing key file is an error that names it.
    let text = std::fs::read_to_string(&env.config).unwrap();
    let key = env.sshd.user_key_path().display().to_string();
    std::fs::write(&env.config, text.replace(&key, "/nonexistent/id_ed25519")).unwrap();
    let bad = env.run(&["config", "check"]);
    assert_eq!(bad.status.code(), Some(2));
    assert!(
        stderr(&bad).contains("/nonexistent/id_ed25519"),
        "{}",
        stderr(&bad)
    );
    // At the line and column of its credential, as every configuration error.
    let prefix = format!("waymark: {}:", env.config.display());
    let at = stderr(&bad)
        .lines()
        .find(|l| l.contains("/nonexistent/id_ed25519"))
        .and_then(|l| l.strip_prefix(&prefix))
        .map(|rest| {
            rest.splitn(3, ':')
                .take(2)
                .map(str::to_string)
                .collect::<Vec<_>>()
        })
        .unwrap_or_default();
    assert!(
        at.len() == 2 && at.iter().all(|n| n.parse::<usize>().is_ok_and(|n| n > 0)),
        "{}",
        stderr(&bad)
    );

    // A malformed file: file:line:column.
    std::fs::write(&env.config, format!("{text}\n[hosts.h2]\naddress = 5\n")).unwrap();
    let broken = env.run(&["config", "check"]);
    assert_eq!(broken.status.code(), Some(2));
    assert!(
        stderr(&broken).contains(&format!("{}:", env.config.display())),
        "{}",
        stderr(&broken)
    );
    assert!(env.daemons().is_empty(), "config check starts no daemon");
}

#[test]
fn the_daemon_log_has_no_terminal_colour_codes() {
    let env = new_env();
    let out = env
        .cmd()
        .env("WAYMARK_LOG", "info")
        .args(["exec", "run", "append", "line=log", "secs=0"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let log_path = env.socket().parent().unwrap().join("daemon.log");
    wait_for(
        || std::fs::read_to_string(&log_path).is_ok_and(|l| l.contains("INFO")),
        "the daemon logged at info",
        Duration::from_secs(10),
    );
    let log = std::fs::read_to_string(&log_path).unwrap();
    assert!(
        !log.contains('\u{1b}'),
        "ANSI escapes in {}: {log:?}",
        log_path.display()
    );
    // The configuration's warnings (a secret in argv) are the daemon's to say as it starts,
    // not every command's.
    assert!(log.contains("warning: "), "{log}");
    assert!(!stderr(&out).contains("warning"), "{}", stderr(&out));
}

#[test]
fn a_user_the_socket_refuses_is_told_so_and_no_daemon_is_started() {
    use std::os::unix::fs::PermissionsExt;
    let env = new_env();
    let _daemon = env.start_daemon();
    let socket_dir = env.dir.path().join("run");
    let stranger = tempfile::tempdir().unwrap();
    let mut cmd = if unsafe { libc::geteuid() } == 0 {
        // Root passes every permission check: ask as nobody, from a configuration nobody can
        // read (the suite's own lies in a 0700 directory).
        std::fs::set_permissions(stranger.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
        let config = stranger.path().join("waymark.toml");
        std::fs::copy(&env.config, &config).unwrap();
        std::fs::set_permissions(&config, std::fs::Permissions::from_mode(0o644)).unwrap();
        let setpriv = waymark_testkit::require_tool("setpriv", "apt-get install util-linux");
        let mut c = Command::new(setpriv);
        c.args(["--reuid=65534", "--regid=65534", "--clear-groups"])
            .arg(common::bin())
            .arg("--config")
            .arg(&config);
        c
    } else {
        // The owner itself is refused once the socket's directory may not be searched.
        std::fs::set_permissions(&socket_dir, std::fs::Permissions::from_mode(0o000)).unwrap();
        let mut c = Command::new(common::bin());
        c.arg("--config").arg(&env.config);
        c
    };
    let out = cmd
        .args(["exec", "list"])
        .env("HOME", stranger.path())
        .stdin(Stdio::null())
        .output()
        .unwrap();
    std::fs::set_permissions(&socket_dir, std::fs::Permissions::from_mode(0o700)).unwrap();
    let said = stderr(&out);
    assert_eq!(out.status.code(), Some(204), "{said}");
    assert!(
        said.contains("permission denied on the daemon's socket")
            && said.contains("belongs to another user")
            && !said.contains("no daemon"),
        "{said}"
    );
    // The daemon that owns the socket still answers its own user.
    assert_eq!(env.run(&["exec", "list"]).status.code(), Some(0));
}

#[test]
fn an_argument_given_twice_is_refused_and_an_empty_list_says_so() {
    let env = new_env();
    for (args, named) in [
        (
            &["exec", "run", "append", "line=a", "line=b", "secs=0"][..],
            "argument line",
        ),
        (
            &[
                "exec", "run", "append", "host=h1", "--host", "h1", "line=a", "secs=0",
            ],
            "argument host",
        ),
    ] {
        let out = env.run(args);
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        assert!(stderr(&out).contains(named), "{args:?}: {}", stderr(&out));
    }
    assert!(env.counter_lines().is_empty(), "nothing ran");
    assert!(env.daemons().is_empty(), "nothing was sent");
    // A review names both of its findings when given neither.
    let id = "act_01J9Z3K8Q4M7W2X5Y6Z8A9B0CD";
    let review = env.run(&["exec", "review", id, "--note", "checked"]);
    assert_eq!(review.status.code(), Some(2));
    assert!(
        stderr(&review).contains("--ran") && stderr(&review).contains("--did-not-run"),
        "{}",
        stderr(&review)
    );

    let list = env.run(&["exec", "list"]);
    assert_eq!(list.status.code(), Some(0), "{}", stderr(&list));
    assert_eq!(stdout(&list), "No execution matches.\n");
    // Every list answers `{"items": ...}` under --json.
    for args in [&["--json", "exec", "list"][..], &["--json", "runs"]] {
        let out = env.run(args);
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert!(v["items"].is_array(), "{args:?}: {v}");
    }
}
