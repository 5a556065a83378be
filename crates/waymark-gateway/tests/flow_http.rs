//! The gateway flow for HTTP tools against a real HTTP API on loopback (the test kit's, with the
//! IETF Idempotency-Key draft's semantics), through a real TCP fault proxy: what an answer lost
//! after the request left, a connection refused, 409, 422 and a 500 answer each become, and
//! that the execution ID is the idempotency key on every send.

use std::collections::BTreeMap;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use serde_json::{json, Map, Value};
use waymark_core::{
    Actor, AnsweredBy, AttachAction, Delivery, ExecState, HttpMethod, IntentScope, Outcome,
};
use waymark_gateway::config::{Config, DefaultPaths};
use waymark_gateway::flow::{status_code, Audience, Gateway, GatewayError, NoEvents};
use waymark_gateway::ssh_hosts::SshHosts;
use waymark_gateway::tools::{resolve, CallContext, ResolvedCall};
use waymark_http::{HttpChannel, OutgoingRequest};
use waymark_ledger::Ledger;
use waymark_testkit::{CutScope, Direction, FaultProxy, HttpFault, TestHttpApi};

const CANARY: &str = "canary-token-7f3a9c1e55d2";

/// A gateway whose HTTP tools reach `api` through `proxy`.
fn setup(proxy: &FaultProxy, dir: &Path) -> (Arc<Config>, Gateway<SshHosts>) {
    let token = dir.join("pay.token");
    std::fs::write(&token, format!("{CANARY}\n")).unwrap();
    std::fs::set_permissions(&token, std::fs::Permissions::from_mode(0o600)).unwrap();
    let base = format!("http://127.0.0.1:{}", proxy.port());
    let text = format!(
        r#"
[ledger]
path = "{ledger}"

[credentials.pay]
kind = "bearer"
token_file = "{token}"

[tools.pay]
description = "Charges an amount."
channel = "http"
method = "POST"
url = "{base}/payments"
body = {{ amount = "{{amount}}", currency = "EUR" }}
credential = "pay"
contract = "idempotent"
timeout = "2s"

[tools.pay.args.amount]
type = "integer"

[tools.pay_checked]
description = "Charges an amount; the operations endpoint says how it ended."
channel = "http"
method = "POST"
url = "{base}/payments"
body = {{ amount = "{{amount}}" }}
credential = "pay"
contract = "status_check"
status = {{ url = "{base}/operations/{{execution_id}}" }}
timeout = "2s"

[tools.pay_checked.args.amount]
type = "integer"

[tools.pay_by_code]
description = "Charges; the operations endpoint carries the payment's own status code."
channel = "http"
method = "POST"
url = "{base}/payments"
body = {{ amount = "{{amount}}" }}
contract = "status_check"
status = {{ url = "{base}/operations/{{execution_id}}", code_pointer = "/status" }}
timeout = "2s"

[tools.pay_by_code.args.amount]
type = "integer"

[tools.pay_by_field]
description = "Charges; the operations endpoint says charged or declined."
channel = "http"
method = "POST"
url = "{base}/payments"
body = {{ amount = "{{amount}}" }}
contract = "status_check"
status = {{ url = "{base}/operations/{{execution_id}}", outcome_pointer = "/outcome", succeeded = ["charged"], failed = ["declined"] }}
timeout = "2s"

[tools.pay_by_field.args.amount]
type = "integer"

[tools.pay_once]
description = "Charges an amount; never repeated without a human."
channel = "http"
method = "POST"
url = "{base}/payments"
body = {{ amount = "{{amount}}" }}
contract = "irreversible"
timeout = "2s"

[tools.pay_once.args.amount]
type = "integer"

[tools.fail]
description = "Answers 500."
channel = "http"
method = "POST"
url = "{base}/status/500"
contract = "idempotent"

[tools.echo_checked]
description = "Echoes the request; asked again, it echoes the status request."
channel = "http"
method = "POST"
url = "{base}/echo"
credential = "pay"
contract = "status_check"
status = {{ url = "{base}/echo/{{execution_id}}" }}
timeout = "2s"

[tools.echo_pending]
description = "Echoes; its status request's method is listed as pending."
channel = "http"
method = "POST"
url = "{base}/echo"
contract = "status_check"
status = {{ url = "{base}/echo/{{execution_id}}", outcome_pointer = "/method", succeeded = ["PUT"], failed = ["DELETE"], pending = ["GET"] }}
timeout = "2s"

[tools.echo_unlisted]
description = "Echoes; its status request's method is not listed."
channel = "http"
method = "POST"
url = "{base}/echo"
contract = "status_check"
status = {{ url = "{base}/echo/{{execution_id}}", outcome_pointer = "/method", succeeded = ["PUT"], failed = ["DELETE"] }}
timeout = "2s"

[tools.echo]
description = "Echoes the request."
channel = "http"
method = "POST"
url = "{base}/echo"
credential = "pay"
contract = "read_only"
"#,
        ledger = dir.join("ledger").display(),
        token = token.display(),
    );
    let config = Arc::new(
        Config::parse(
            Path::new("test.toml"),
            &text,
            &DefaultPaths::from_env(|_| None, 0),
        )
        .unwrap(),
    );
    let ledger = Ledger::init(&config.ledger_path).unwrap();
    let gateway = Gateway::new(
        config.clone(),
        Arc::new(ledger),
        Arc::new(SshHosts::new(config.clone())),
    )
    .with_http(HttpChannel::new().unwrap());
    (config, gateway)
}

fn ctx() -> CallContext {
    CallContext {
        actor: Actor("uid:1:/test".into()),
        scope: IntentScope::ToolWindow,
        delivery: Delivery::default(),
    }
}

fn call(config: &Config, tool: &str, amount: i64) -> ResolvedCall {
    let mut args = Map::new();
    if ![
        "fail",
        "echo",
        "echo_checked",
        "echo_pending",
        "echo_unlisted",
    ]
    .contains(&tool)
    {
        args.insert("amount".into(), json!(amount));
    }
    resolve(config, tool, &args, ctx()).unwrap()
}

fn start() -> (TestHttpApi, FaultProxy, tempfile::TempDir) {
    let api = TestHttpApi::start();
    let proxy = FaultProxy::start(api.addr());
    (api, proxy, tempfile::tempdir().unwrap())
}

fn keys(api: &TestHttpApi) -> Vec<Option<String>> {
    api.requests()
        .iter()
        .map(|r| r.header("idempotency-key").map(str::to_string))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_cut_after_the_request_left_is_unknown_and_a_retry_attaches_with_one_effect() {
    let (api, proxy, dir) = start();
    let (config, gw) = setup(&proxy, dir.path());
    // The request reaches the API (which charges), and the connection is cut after the first
    // byte of its answer.
    proxy.cut_after(1, Direction::ServerToClient, CutScope::Next);
    let first = gw
        .call(call(&config, "pay", 10), None, &NoEvents)
        .await
        .unwrap();
    assert_eq!(
        first.record.state(),
        ExecState::Unknown,
        "{:?}",
        first.record
    );
    assert!(!first.record.lifecycle.result_observed);
    assert_eq!(api.effects(), 1);
    proxy.heal();

    let retry = gw
        .call(call(&config, "pay", 10), None, &NoEvents)
        .await
        .unwrap();
    assert_eq!(retry.record.id, first.record.id);
    assert_eq!(retry.attached, Some(AttachAction::AskHostMarker));
    assert_eq!(retry.record.state(), ExecState::Completed);
    assert_eq!(retry.record.dispatch_attempts, 2);
    assert_eq!(api.effects(), 1, "the re-send took the stored answer");
    let result = retry.result.unwrap();
    assert_eq!(status_code(&result), Some(201));
    assert!(String::from_utf8_lossy(&result.stderr.head).contains("idempotent-replayed: true"));
    // The same key, the execution ID (never the fingerprint), on both sends.
    let id = first.record.id.to_string();
    assert_eq!(keys(&api), vec![Some(id.clone()), Some(id)]);
    assert_eq!(api.requests()[0].body, api.requests()[1].body);
    assert_eq!(api.requests()[0].body, br#"{"amount":10,"currency":"EUR"}"#);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_channel_this_process_has_no_driver_for_is_refused_before_anything_is_recorded() {
    let (api, proxy, dir) = start();
    let (config, gw) = setup(&proxy, dir.path());
    // The same configuration and ledger in a process that was given no HTTP channel.
    let bare = Gateway::new(
        config.clone(),
        gw.ledger().clone(),
        Arc::new(SshHosts::new(config.clone())),
    );
    let refused = bare
        .call(call(&config, "pay", 3), None, &NoEvents)
        .await
        .unwrap_err();
    let GatewayError::NoDriver { channel } = &refused else {
        panic!("{refused}");
    };
    let target = format!("HTTP POST http://127.0.0.1:{}/payments", proxy.port());
    assert_eq!(channel, &target);
    assert_eq!(
        refused.to_string(),
        format!("this process has no driver for {target}, so it sends nothing there")
    );
    assert!(api.requests().is_empty());
    let recorded = gw.ledger().list(&Default::default()).await.unwrap();
    assert!(recorded.items.is_empty(), "{:?}", recorded.items);
    // The process that has the channel sends it, once.
    let sent = gw
        .call(call(&config, "pay", 3), None, &NoEvents)
        .await
        .unwrap();
    assert_eq!(
        sent.record.state(),
        ExecState::Completed,
        "{:?}",
        sent.record
    );
    assert_eq!(sent.record.dispatch_attempts, 1);
    assert_eq!(api.effects(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resend_that_was_not_sent_proves_nothing_and_leaves_it_unknown() {
    let (api, proxy, dir) = start();
    let (config, gw) = setup(&proxy, dir.path());
    proxy.cut_after(1, Direction::ServerToClient, CutScope::Next);
    let first = gw
        .call(call(&config, "pay", 6), None, &NoEvents)
        .await
        .unwrap();
    assert_eq!(first.record.state(), ExecState::Unknown);
    proxy.heal();
    proxy.refuse_new(true);
    let retry = gw
        .call(call(&config, "pay", 6), None, &NoEvents)
        .await
        .unwrap();
    assert_eq!(retry.record.id, first.record.id);
    assert_eq!(retry.record.dispatch_attempts, 2, "re-sent, refused");
    assert_eq!(
        retry.record.state(),
        ExecState::Unknown,
        "the first send may have charged: {:?}",
        retry.record
    );
    assert_eq!(api.effects(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_connection_did_not_start_and_a_retry_runs_once() {
    let (api, proxy, dir) = start();
    let (config, gw) = setup(&proxy, dir.path());
    proxy.refuse_new(true);
    let first = gw
        .call(call(&config, "pay", 5), None, &NoEvents)
        .await
        .unwrap();
    assert_eq!(
        first.record.state(),
        ExecState::Failed,
        "{:?}",
        first.record
    );
    assert!(first
        .record
        .reason
        .as_deref()
        .unwrap()
        .starts_with("not sent"));
    assert!(api.requests().is_empty());
    // The caller has the failure; the same call again is a new execution.
    gw.delivered(first.record.id).await.unwrap();
    proxy.refuse_new(false);
    let retry = gw
        .call(call(&config, "pay", 5), None, &NoEvents)
        .await
        .unwrap();
    assert_ne!(
        retry.record.id, first.record.id,
        "it never started: a new execution"
    );
    assert_eq!(retry.record.state(), ExecState::Completed);
    assert_eq!(api.effects(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_409_keeps_it_in_flight_until_the_first_request_ends_then_one_effect() {
    let (api, proxy, dir) = start();
    let (config, gw) = setup(&proxy, dir.path());
    // The first request outlives the tool's 2 s timeout: unknown.
    api.set_processing_time(Duration::from_secs(5));
    let first = gw
        .call(call(&config, "pay", 7), None, &NoEvents)
        .await
        .unwrap();
    assert_eq!(
        first.record.state(),
        ExecState::Unknown,
        "{:?}",
        first.record
    );
    // A retry while the API still works on it re-sends the same key and hears 409: it stays
    // dispatched, never failed and never a second charge.
    let during = gw
        .call(call(&config, "pay", 7), None, &NoEvents)
        .await
        .unwrap();
    assert_eq!(during.record.id, first.record.id);
    assert_eq!(
        during.record.state(),
        ExecState::Dispatched,
        "{:?}",
        during.record
    );
    assert!(api.requests().len() >= 2);
    // Once the first request ended, a retry takes its answer.
    std::thread::sleep(Duration::from_secs(2));
    let after = gw
        .call(call(&config, "pay", 7), None, &NoEvents)
        .await
        .unwrap();
    assert_eq!(
        after.record.state(),
        ExecState::Completed,
        "{:?}",
        after.record
    );
    assert_eq!(api.effects(), 1);
    let id = first.record.id.to_string();
    assert!(keys(&api).iter().all(|k| k.as_deref() == Some(id.as_str())));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_422_for_a_key_reused_with_another_payload_fails_loudly() {
    let (api, proxy, dir) = start();
    let (config, gw) = setup(&proxy, dir.path());
    // The request reaches the API, which resets before charging: unknown, nothing charged.
    api.set_fault(HttpFault::ResetBeforeEffect);
    let first = gw
        .call(call(&config, "pay", 3), None, &NoEvents)
        .await
        .unwrap();
    assert_eq!(
        first.record.state(),
        ExecState::Unknown,
        "{:?}",
        first.record
    );
    api.set_fault(HttpFault::None);
    // Someone else uses the execution's key with another payload.
    let other = OutgoingRequest {
        method: HttpMethod::Post,
        url: api.url("/payments"),
        headers: vec![("Idempotency-Key".into(), first.record.id.to_string())],
        body: Some(br#"{"amount":999}"#.to_vec()),
        timeout: Duration::from_secs(5),
        body_cap: 1024,
        keep_headers: Vec::new(),
    };
    HttpChannel::new().unwrap().send(&other).await.unwrap();
    let retry = gw
        .call(call(&config, "pay", 3), None, &NoEvents)
        .await
        .unwrap();
    assert_eq!(retry.record.id, first.record.id);
    assert_eq!(
        retry.record.state(),
        ExecState::Failed,
        "{:?}",
        retry.record
    );
    let reason = retry.record.reason.unwrap();
    assert!(reason.contains("REFUSED BY THE TARGET (422)"), "{reason}");
    assert_eq!(
        api.effects(),
        1,
        "only the other client's payload was charged"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_500_answer_is_a_completed_execution_whose_result_is_an_error() {
    let (_api, proxy, dir) = start();
    let (config, gw) = setup(&proxy, dir.path());
    let o = gw
        .call(call(&config, "fail", 0), None, &NoEvents)
        .await
        .unwrap();
    assert_eq!(o.record.state(), ExecState::Completed);
    assert_eq!(
        o.record.outcome,
        Some(Outcome::Answered {
            by: AnsweredBy::Request,
            status: 500,
            succeeded: Some(false),
            reported: None,
        })
    );
    let said = o.message(Audience::Cli);
    assert!(said.contains("The request answered 500: FAILED"), "{said}");
    let result = o.result.unwrap();
    assert_eq!(status_code(&result), Some(500));
    assert_eq!(result.stdout.head, br#"{"status":500}"#);
    assert_eq!(result.stdout.total_bytes, 14);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_check_recovers_a_lost_answer_from_the_status_request() {
    let (api, proxy, dir) = start();
    let (config, gw) = setup(&proxy, dir.path());
    proxy.cut_after(1, Direction::ServerToClient, CutScope::Next);
    let first = gw
        .call(call(&config, "pay_checked", 4), None, &NoEvents)
        .await
        .unwrap();
    assert_eq!(first.record.state(), ExecState::Unknown);
    proxy.heal();
    let (o, unasked) = gw.status(first.record.id).await.unwrap();
    assert!(unasked.is_none());
    assert_eq!(o.record.state(), ExecState::Completed, "{:?}", o.record);
    assert_eq!(o.record.dispatch_attempts, 1, "asked, never re-sent");
    let body = String::from_utf8(o.result.unwrap().stdout.head).unwrap();
    assert!(body.contains(r#""state":"done""#), "{body}");
    assert_eq!(api.effects(), 1);
}

/// A payout the API declined (402) whose answer was lost, settled later by a status request that
/// answers 200 with the declined operation in its body: never a success. Read by the tool's
/// rule it is a failure; with no rule, finished but not proven.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_declined_request_settled_by_the_status_request_is_never_a_success() {
    let cases = [
        ("pay_checked", None, None),
        (
            "pay_by_code",
            Some(false),
            Some("field /status says the request answered 402"),
        ),
        (
            "pay_by_field",
            Some(false),
            Some("field /outcome is \"declined\""),
        ),
    ];
    for (tool, succeeded, reported) in cases {
        // A fresh API, proxy and gateway each: a pooled connection would dodge the next cut.
        let (api, proxy, dir) = start();
        let (config, gw) = setup(&proxy, dir.path());
        api.set_decline(true);
        proxy.cut_after(1, Direction::ServerToClient, CutScope::Next);
        let first = gw
            .call(call(&config, tool, 4), None, &NoEvents)
            .await
            .unwrap();
        assert_eq!(first.record.state(), ExecState::Unknown, "{tool}");
        proxy.heal();
        let (o, unasked) = gw.status(first.record.id).await.unwrap();
        assert!(unasked.is_none(), "{tool}: {unasked:?}");
        assert_eq!(
            o.record.state(),
            ExecState::Completed,
            "{tool}: {:?}",
            o.record
        );
        let Some(Outcome::Answered {
            by,
            status,
            succeeded: read,
            reported: said,
        }) = o.record.outcome.clone()
        else {
            panic!(
                "{tool}: a status answer is recorded as answered: {:?}",
                o.record.outcome
            );
        };
        assert_eq!(by, AnsweredBy::StatusRequest, "{tool}");
        assert_eq!(status, 200, "{tool}: the status request's own code");
        assert_eq!(read, succeeded, "{tool}: {said:?}");
        match reported {
            Some(r) => assert_eq!(said.as_deref(), Some(r), "{tool}"),
            None => assert!(
                said.unwrap()
                    .contains("to read success from its status answer"),
                "{tool}"
            ),
        }
        // The body is kept whatever the reading.
        let body = String::from_utf8(o.result.clone().unwrap().stdout.head).unwrap();
        assert!(body.contains(r#""status":402"#), "{tool}: {body}");
        let said = o.message(Audience::Cli);
        assert!(
            !said.contains("exit code 0") && !said.contains(": succeeded"),
            "{tool}: {said}"
        );
        assert!(
            said.contains("The status request answered 200: "),
            "{tool}: {said}"
        );
        assert_eq!(api.effects(), 0, "{tool}: nothing was charged");
    }
}

/// A successful operation read by its code is a success; a value the tool lists as pending
/// keeps the execution in flight; a value it does not list proves nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_status_answer_read_by_the_tools_rule_says_succeeded_pending_or_not_proven() {
    // The echo's status request answers 200 with `"method":"GET"` in its body.
    for (tool, state) in [
        ("echo_pending", ExecState::Running),
        ("echo_unlisted", ExecState::Completed),
    ] {
        let (_api, proxy, dir) = start();
        let (config, gw) = setup(&proxy, dir.path());
        proxy.cut_after(1, Direction::ServerToClient, CutScope::Next);
        let first = gw
            .call(call(&config, tool, 0), None, &NoEvents)
            .await
            .unwrap();
        assert_eq!(first.record.state(), ExecState::Unknown, "{tool}");
        proxy.heal();
        let (o, _) = gw.status(first.record.id).await.unwrap();
        assert_eq!(o.record.state(), state, "{tool}: {:?}", o.record);
        if state == ExecState::Completed {
            let Some(Outcome::Answered {
                succeeded,
                reported,
                ..
            }) = o.record.outcome
            else {
                panic!("{tool}: {:?}", o.record.outcome);
            };
            assert_eq!(succeeded, None, "{tool}");
            assert!(
                reported
                    .unwrap()
                    .contains(r#"field /method is "GET", which the tool lists neither"#),
                "{tool}"
            );
        }
    }
    let (api, proxy, dir) = start();
    let (config, gw) = setup(&proxy, dir.path());
    proxy.cut_after(1, Direction::ServerToClient, CutScope::Next);
    let first = gw
        .call(call(&config, "pay_by_code", 9), None, &NoEvents)
        .await
        .unwrap();
    assert_eq!(first.record.state(), ExecState::Unknown);
    proxy.heal();
    let (o, _) = gw.status(first.record.id).await.unwrap();
    assert!(
        matches!(
            o.record.outcome,
            Some(Outcome::Answered {
                by: AnsweredBy::StatusRequest,
                succeeded: Some(true),
                ..
            })
        ),
        "{:?}",
        o.record.outcome
    );
    assert_eq!(api.effects(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_irreversible_request_whose_answer_was_lost_is_never_resent() {
    let (api, proxy, dir) = start();
    let (config, gw) = setup(&proxy, dir.path());
    proxy.cut_after(1, Direction::ServerToClient, CutScope::Next);
    let first = gw
        .call(call(&config, "pay_once", 4), None, &NoEvents)
        .await
        .unwrap();
    assert_eq!(first.record.state(), ExecState::Unknown);
    proxy.heal();
    let retry = gw
        .call(call(&config, "pay_once", 4), None, &NoEvents)
        .await
        .unwrap();
    assert_eq!(retry.record.id, first.record.id);
    assert_eq!(retry.record.state(), ExecState::Unknown);
    assert_eq!(api.requests().len(), 1, "never re-sent");
    assert_eq!(api.effects(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_bearer_token_reaches_the_target_and_never_the_ledger_or_the_result() {
    let (api, proxy, dir) = start();
    let (config, gw) = setup(&proxy, dir.path());
    let o = gw
        .call(call(&config, "echo", 0), None, &NoEvents)
        .await
        .unwrap();
    assert_eq!(o.record.state(), ExecState::Completed);
    assert_eq!(
        api.requests()[0].header("authorization"),
        Some(format!("Bearer {CANARY}").as_str())
    );
    let result = o.result.unwrap();
    let body = String::from_utf8_lossy(&result.stdout.head).into_owned();
    assert!(!body.contains(CANARY), "the echoed token is masked: {body}");
    assert!(body.contains("Bearer ****"), "{body}");
    let action: Value = serde_json::from_str(o.record.action.as_str()).unwrap();
    assert_eq!(action["credential"], "pay");
    gw.ledger().flush().await.unwrap();
    drop(gw);
    assert_no_token_in(&dir.path().join("ledger"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_status_answer_echoing_the_token_is_masked_by_a_gateway_that_never_sent_the_call() {
    let (api, proxy, dir) = start();
    let (config, gw) = setup(&proxy, dir.path());
    proxy.cut_after(1, Direction::ServerToClient, CutScope::Next);
    let first = gw
        .call(call(&config, "echo_checked", 0), None, &NoEvents)
        .await
        .unwrap();
    assert_eq!(first.record.state(), ExecState::Unknown);
    gw.ledger().flush().await.unwrap();
    drop(gw);
    proxy.heal();
    // A restarted daemon: the same ledger and configuration, nothing of the call in memory.
    let (_, gw) = setup(&proxy, dir.path());
    let (o, unasked) = gw.status(first.record.id).await.unwrap();
    assert!(unasked.is_none());
    assert_eq!(o.record.state(), ExecState::Completed, "{:?}", o.record);
    assert_eq!(
        api.requests()[1].header("authorization"),
        Some(format!("Bearer {CANARY}").as_str()),
        "the status request carried the token"
    );
    let body = String::from_utf8_lossy(&o.result.unwrap().stdout.head).into_owned();
    assert!(
        body.contains("/echo/act_"),
        "the status request's echo: {body}"
    );
    assert!(!body.contains(CANARY), "the echoed token is masked: {body}");
    assert!(body.contains("Bearer ****"), "{body}");
    gw.ledger().flush().await.unwrap();
    drop(gw);
    assert_no_token_in(&dir.path().join("ledger"));
}

/// Fails when any file under `dir` holds the canary token.
fn assert_no_token_in(dir: &Path) {
    for entry in walk(dir) {
        let bytes = std::fs::read(&entry).unwrap();
        assert!(
            !bytes.windows(CANARY.len()).any(|w| w == CANARY.as_bytes()),
            "the token is in {}",
            entry.display()
        );
    }
}

fn walk(dir: &Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            out.extend(walk(&p));
        } else {
            out.push(p);
        }
    }
    out
}

/// Seeded faults over many HTTP actions (`WAYMARK_CHAOS_SEED` replays a run): each action is
/// hit by one fault drawn from the seed (the API resets before or after its effect or answers
/// garbage, the proxy cuts the answer or refuses the connection), then recovered as an agent
/// would, by retrying the same call. In the end every intent was charged exactly once and
/// reached the API under one idempotency key, its execution ID.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_actions_under_seeded_faults_are_charged_once_under_one_key_each() {
    let seed: u64 = std::env::var("WAYMARK_CHAOS_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos() as u64
        });
    eprintln!("WAYMARK_CHAOS_SEED={seed}");
    let mut state = seed | 1;
    let mut draw = |n: u64| {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state % n
    };
    let (api, proxy, dir) = start();
    let (config, gw) = setup(&proxy, dir.path());
    let actions = 24;
    let mut faults = BTreeMap::new();
    for amount in 0..actions {
        let fault = draw(6);
        *faults.entry(fault).or_insert(0) += 1;
        match fault {
            1 => api.set_fault(HttpFault::ResetBeforeEffect),
            2 => api.set_fault(HttpFault::ResetAfterEffect),
            3 => api.set_fault(HttpFault::Garbage),
            4 => proxy.cut_after(1, Direction::ServerToClient, CutScope::Next),
            5 => proxy.refuse_new(true),
            _ => {}
        }
        let first = gw
            .call(call(&config, "pay", amount), None, &NoEvents)
            .await
            .unwrap();
        api.set_fault(HttpFault::None);
        proxy.heal();
        let mut last = first.record;
        for _ in 0..3 {
            match last.state() {
                ExecState::Completed => break,
                // Proven never sent: the caller has that answer, and the same call again is a
                // new execution.
                ExecState::Failed => {
                    gw.delivered(last.id).await.unwrap();
                }
                _ => {}
            }
            last = gw
                .call(call(&config, "pay", amount), None, &NoEvents)
                .await
                .unwrap()
                .record;
        }
        assert_eq!(
            last.state(),
            ExecState::Completed,
            "seed {seed}, amount {amount}, fault {fault}: {last:?}"
        );
    }
    eprintln!("faults drawn (kind: count): {faults:?}");
    let mut keys: BTreeMap<Vec<u8>, std::collections::BTreeSet<String>> = BTreeMap::new();
    for r in api.requests() {
        keys.entry(r.body.clone())
            .or_default()
            .insert(r.header("idempotency-key").unwrap_or("").to_string());
    }
    assert_eq!(keys.len(), actions as usize, "seed {seed}");
    for (body, ids) in &keys {
        assert_eq!(
            ids.len(),
            1,
            "seed {seed}: {} reached the API under several keys: {ids:?}",
            String::from_utf8_lossy(body)
        );
    }
    assert_eq!(
        api.effects(),
        actions as u64,
        "seed {seed}: one charge per intent"
    );
}

/// After the API comes back, a status tells what the target says now, not only the old loss:
/// a status request that finds no such operation says so and that a retry re-sends it; a tool
/// with no status request says a retry settles it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_status_after_the_target_is_back_says_what_it_says_now() {
    for (tool, says) in [
        ("pay_checked", "Just now the status request said 127.0.0.1:"),
        (
            "pay",
            "has no status request to ask; a retry of the same call",
        ),
    ] {
        let (api, proxy, dir) = start();
        let (config, gw) = setup(&proxy, dir.path());
        // The request arrives and the connection is reset before anything is done.
        api.set_fault(HttpFault::ResetBeforeEffect);
        let first = gw
            .call(call(&config, tool, 3), None, &NoEvents)
            .await
            .unwrap();
        assert_eq!(first.record.state(), ExecState::Unknown, "{tool}");
        api.set_fault(HttpFault::None);
        let (o, unasked) = gw.status(first.record.id).await.unwrap();
        assert!(unasked.is_none(), "{tool}: {unasked:?}");
        assert_eq!(o.record.state(), ExecState::Unknown, "{tool}: never failed");
        let said = o.message(Audience::Cli);
        assert!(said.contains(says), "{tool}: {said}");
        // The same through the operator's read with a deadline (what `exec status` asks).
        let gw = Arc::new(gw);
        let (o, unchecked) = gw
            .status_within(first.record.id, Duration::from_secs(20))
            .await
            .unwrap();
        assert!(unchecked.is_none(), "{tool}: {unchecked:?}");
        let said = o.message(Audience::Cli);
        assert!(said.contains(says), "{tool}: within a deadline: {said}");
        assert_eq!(api.effects(), 0, "{tool}");
    }
}
