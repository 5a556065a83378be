//! HTTP tools end to end: the real daemon and CLI, the MCP shim with rmcp's client, and the
//! test kit's HTTP API (Idempotency-Key semantics, an effect counter). A daemon killed after
//! dispatch recovers each execution by its contract; an MCP client killed mid-call and retried
//! attaches; a 500 is an error result; a canary bearer token never leaves the request.

mod common;

use std::os::unix::fs::PermissionsExt;
use std::process::Stdio;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use waymark_testkit::{CutScope, Direction, FaultProxy, TestHttpApi};

use common::{bounded, call, files_containing, id_in, stderr, stdout, structured, Env};

const CANARY: &str = "canary-bearer-51c0ffee9d2b";

/// Tools `pay` (idempotent), `pay_checked` (status_check, asks `/operations/{id}`), `fail`
/// (answers 500) and `echo` (echoes the request, headers included), all with the canary token.
fn env(api: &TestHttpApi) -> Env {
    let dir = tempfile::tempdir().unwrap().keep();
    let token = dir.join("pay.token");
    std::fs::write(&token, format!("{CANARY}\n")).unwrap();
    std::fs::set_permissions(&token, std::fs::Permissions::from_mode(0o600)).unwrap();
    let base = api.url("");
    Env::builder()
        .tools(&format!(
            r#"
[credentials.pay]
kind = "bearer"
token_file = "{token}"

[tools.pay]
description = "Charges an amount."
channel = "http"
method = "POST"
url = "{base}/payments"
body = {{ amount = "{{amount}}" }}
credential = "pay"
contract = "idempotent"
timeout = "5s"

[tools.pay.args.amount]
type = "integer"

[tools.pay_checked]
description = "Charges an amount; the operations endpoint says how it ended."
channel = "http"
method = "POST"
url = "{base}/payments"
body = {{ amount = "{{amount}}", checked = true }}
credential = "pay"
contract = "status_check"
status = {{ url = "{base}/operations/{{execution_id}}" }}
timeout = "5s"

[tools.pay_checked.args.amount]
type = "integer"

[tools.fail]
description = "Answers 500."
channel = "http"
method = "POST"
url = "{base}/status/500"
credential = "pay"
contract = "idempotent"

[tools.pay_approved]
description = "Charges an amount once an operator approves."
channel = "http"
method = "POST"
url = "{base}/payments"
body = {{ amount = "{{amount}}", approved = true }}
credential = "pay"
contract = "idempotent"
approval = "per_call"

[tools.pay_approved.args.amount]
type = "integer"

[tools.echo]
description = "Echoes the request."
channel = "http"
method = "GET"
url = "{base}/echo"
credential = "pay"
contract = "read_only"
"#,
            token = token.display()
        ))
        .build()
}

fn only_http_key(api: &TestHttpApi) -> Vec<String> {
    api.requests()
        .iter()
        .filter(|r| r.path == "/payments")
        .map(|r| r.header("idempotency-key").unwrap_or("").to_string())
        .collect()
}

#[test]
fn a_daemon_killed_after_dispatch_recovers_each_http_execution_by_its_contract() {
    let api = TestHttpApi::start();
    let env = env(&api);
    let log = env.dir.path().join("daemon.log");
    for (tool, amount) in [("pay", "10"), ("pay_checked", "20")] {
        env.kill_daemons();
        let mut crashing =
            env.start_daemon_with(&[("WAYMARK_CRASH_AT", "dispatched")], Stdio::null());
        let first = env.run(&["exec", "run", tool, &format!("amount={amount}")]);
        assert_eq!(first.status.code(), Some(200), "unknown to the caller");
        assert!(
            crashing.0.wait().unwrap().code().is_none(),
            "killed by a signal"
        );

        // The restarted daemon reconciles: an idempotent one without the call cannot be
        // re-sent (its arguments are the caller's) and reads unknown; a status_check one asks
        // the status request, which says it never arrived, so it stays dispatched.
        let logfile = std::fs::File::options()
            .create(true)
            .append(true)
            .open(&log)
            .unwrap();
        let _daemon = env.start_daemon_with(&[("WAYMARK_LOG", "debug")], Stdio::from(logfile));
        let id = env
            .ledger_records()
            .into_iter()
            .find(|(_, r)| r["tool"] == tool)
            .map(|(id, _)| id)
            .expect("the execution was accepted");
        assert!(
            only_http_key(&api).iter().all(|k| k != &id),
            "nothing was sent"
        );
        let expected = if tool == "pay" {
            "unknown"
        } else {
            "dispatched"
        };
        // Read from the ledger (`exec list`), which asks nobody: what reconcile recorded.
        common::wait_for(
            || env.executions()[&id] == expected,
            &format!("{tool} reconciled to {expected}"),
            Duration::from_secs(20),
        );
        if tool == "pay_checked" {
            let asked = format!("/operations/{id}");
            assert!(
                api.requests().iter().any(|r| r.path == asked),
                "reconcile asked the status request"
            );
        }
        let retry = env.run(&["exec", "run", tool, &format!("amount={amount}")]);
        assert_eq!(retry.status.code(), Some(0), "{}", stderr(&retry));
        assert_eq!(id_in(&stderr(&retry)), id, "the retry attached");
        assert!(
            stdout(&retry).contains("\"charged\":true"),
            "{}",
            stdout(&retry)
        );
        // Sent once, under the execution ID.
        assert_eq!(only_http_key(&api).iter().filter(|k| **k == id).count(), 1);
    }
    assert_eq!(api.effects(), 2, "one charge per execution");

    // explain names method, target and status code; the token is nowhere but in the requests.
    let ids: Vec<String> = env.executions().into_keys().collect();
    let explain = env.run(&["exec", "explain", &ids[0]]);
    let text = stdout(&explain);
    assert!(
        text.contains(&format!(
            "HTTP: POST {}/payments; a re-send under the same idempotency key answered 201: succeeded.",
            api.url("")
        )),
        "{text}"
    );
    let echo = env.run(&["exec", "run", "echo"]);
    assert_eq!(echo.status.code(), Some(0), "{}", stderr(&echo));
    assert!(stdout(&echo).contains("Bearer ****"), "{}", stdout(&echo));
    assert_eq!(
        api.requests().last().unwrap().header("authorization"),
        Some(format!("Bearer {CANARY}").as_str())
    );
    let echo_id = id_in(&stderr(&echo));
    for out in [
        env.run(&["exec", "result", &echo_id]),
        env.run(&["exec", "explain", &echo_id]),
        env.run(&["--json", "exec", "status", &echo_id]),
        env.run(&["audit", "verify"]),
    ] {
        assert!(!stdout(&out).contains(CANARY) && !stderr(&out).contains(CANARY));
    }
    env.kill_daemons();
    assert_eq!(
        files_containing(&env.ledger_dir(), CANARY),
        Vec::<std::path::PathBuf>::new()
    );
    let logged = std::fs::read_to_string(&log).unwrap();
    assert!(!logged.is_empty(), "the daemon logged");
    assert!(!logged.contains(CANARY), "the daemon log holds the token");
}

#[test]
fn an_http_call_waits_for_its_approval_and_a_retry_attaches_to_the_one_request() {
    let api = TestHttpApi::start();
    let env = env(&api);
    let _daemon = env.start_daemon_with(&[("WAYMARK_APPROVAL_WAIT_SECS", "30")], Stdio::inherit());
    let spawn = || {
        env.cmd()
            .args(["exec", "run", "pay_approved", "amount=40"])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    };
    let first = spawn();
    common::wait_for(
        || stdout(&env.run(&["--json", "approvals"])).contains("act_"),
        "the approval request",
        Duration::from_secs(20),
    );
    let retry = spawn();
    std::thread::sleep(Duration::from_millis(500));
    let pending: Value = serde_json::from_slice(&env.run(&["--json", "approvals"]).stdout).unwrap();
    let items = pending["items"].as_array().unwrap();
    assert_eq!(items.len(), 1, "one approval request: {pending}");
    assert!(api.requests().is_empty(), "nothing is sent before approval");
    let id = items[0]["id"].as_str().unwrap().to_string();
    assert_eq!(env.run(&["approve", &id]).status.code(), Some(0));
    for o in [
        first.wait_with_output().unwrap(),
        retry.wait_with_output().unwrap(),
    ] {
        assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
        assert_eq!(id_in(&stderr(&o)), id);
    }
    assert_eq!(api.effects(), 1);
    assert_eq!(only_http_key(&api), vec![id]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_mcp_client_killed_mid_call_and_retried_attaches_and_a_500_is_an_error() {
    bounded(async {
        let api = TestHttpApi::start();
        api.set_processing_time(Duration::from_secs(2));
        let env = env(&api);
        let _daemon = env.start_daemon();
        let (first, pid) = env.client().await;
        let pending = tokio::spawn(async move {
            let r = first.call_tool(call("pay", json!({"amount": 30}))).await;
            (r.is_ok(), first)
        });
        let deadline = Instant::now() + Duration::from_secs(20);
        while api.requests().is_empty() {
            assert!(Instant::now() < deadline, "the request never arrived");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        unsafe { libc::kill(pid as i32, libc::SIGKILL) };
        let (answered, _first) = pending.await.unwrap();
        assert!(!answered, "the killed shim cannot have answered");

        let (second, _) = env.client().await;
        let r = second
            .call_tool(call("pay", json!({"amount": 30})))
            .await
            .unwrap();
        let s = structured(&r);
        assert_eq!(s["state"], "completed", "{s}");
        assert!(!s["attached"].is_null(), "the retry attached: {s}");
        assert_ne!(r.is_error, Some(true));
        assert_eq!(api.effects(), 1);

        let r = second.call_tool(call("fail", json!({}))).await.unwrap();
        let s: Value = structured(&r);
        assert_eq!(s["state"], "completed", "{s}");
        assert_eq!(
            r.is_error,
            Some(true),
            "a 500 answer is an error result: {s}"
        );
    })
    .await
}

/// The declined payout of issue 36, end to end: the API declines with 402, the fault proxy
/// drops the answer, and `exec status` settles it through the status request, which answers 200
/// with the declined operation in its body. Without a rule to read success from that answer the
/// CLI never exits 0 and says NOT PROVEN; with `code_pointer` it exits 1. `exec explain` says
/// the status request answered, never that the POST answered 200.
#[test]
fn a_declined_payout_whose_answer_was_lost_never_exits_0() {
    let api = TestHttpApi::start();
    api.set_decline(true);
    // A proxy per tool: the daemon keeps connections alive, and a cut applies to the next
    // connection only.
    let proxies = [FaultProxy::start(api.addr()), FaultProxy::start(api.addr())];
    let base = format!("http://127.0.0.1:{}", proxies[0].port());
    let base_read = format!("http://127.0.0.1:{}", proxies[1].port());
    let env = Env::builder()
        .tools(&format!(
            r#"
[tools.payout]
description = "Pays out; the operations endpoint says how it ended."
channel = "http"
method = "POST"
url = "{base}/payments"
body = {{ amount = "{{amount}}" }}
contract = "status_check"
status = {{ url = "{base}/operations/{{execution_id}}" }}
timeout = "5s"

[tools.payout.args.amount]
type = "integer"

[tools.payout_read]
description = "Pays out; the operations endpoint carries the payout's own status code."
channel = "http"
method = "POST"
url = "{base_read}/payments"
body = {{ amount = "{{amount}}", read = true }}
contract = "status_check"
status = {{ url = "{base_read}/operations/{{execution_id}}", code_pointer = "/status" }}
timeout = "5s"

[tools.payout_read.args.amount]
type = "integer"
"#
        ))
        .build();
    let _daemon = env.start_daemon();
    for (tool, exit, words, proxy, base) in [
        ("payout", 200, "NOT PROVEN", &proxies[0], &base),
        (
            "payout_read",
            1,
            "FAILED (field /status says the request answered 402)",
            &proxies[1],
            &base_read,
        ),
    ] {
        proxy.cut_after(1, Direction::ServerToClient, CutScope::Next);
        let first = env.run(&["exec", "run", tool, "amount=7"]);
        assert_eq!(first.status.code(), Some(200), "{tool}: {}", stderr(&first));
        let id = id_in(&stderr(&first));
        proxy.heal();
        let status = env.run(&["exec", "status", &id]);
        assert_eq!(
            status.status.code(),
            Some(exit),
            "{tool}: {}",
            stdout(&status)
        );
        let said = format!("{}{}", stdout(&status), stderr(&status));
        assert!(
            said.contains("The status request answered 200: "),
            "{tool}: {said}"
        );
        assert!(said.contains(words), "{tool}: {said}");
        let explain = stdout(&env.run(&["exec", "explain", &id]));
        assert!(
            explain.contains(&format!(
                "HTTP: POST {base}/payments; the status request answered 200"
            )),
            "{tool}: {explain}"
        );
        assert!(
            !explain.contains("the host"),
            "{tool}: HTTP terms only: {explain}"
        );
    }
    assert_eq!(api.effects(), 0, "nothing was paid");
}
