//! The gateway flow against a real OpenSSH sshd: streaming output while a command runs, and
//! reading output beyond what the ledger keeps.

use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{Map, Value};
use waymark_core::{
    Actor, AttachAction, Delivery, ExecState, ExecutionId, Fingerprint, FingerprintKey,
    IncomingCall, IntentScope, Timestamp, Transition,
};
use waymark_gateway::config::{Config, DefaultPaths};
use waymark_gateway::flow::{Audience, CallEvent, Gateway, GatewayError, NoEvents};
use waymark_gateway::host::Stream;
use waymark_gateway::ssh_hosts::SshHosts;
use waymark_gateway::tools::{resolve, CallContext};
use waymark_ledger::{
    ChainHead, Durability, ExecutionRecord, GcReport, Intake, Ledger, LedgerApi, LedgerError,
    LedgerEvent, LedgerFuture, ListQuery, NewExecution, Page, Progress, RunRecord, StoredResult,
    VerifyReport,
};
use waymark_testkit::TestSshd;

fn setup(sshd: &TestSshd, dir: &Path) -> (Arc<Config>, Gateway<SshHosts>) {
    setup_at(sshd, dir, sshd.port())
}

/// Like [`setup`], with host `h1` reached on `port` (a fault proxy in front of sshd).
fn setup_at(sshd: &TestSshd, dir: &Path, port: u16) -> (Arc<Config>, Gateway<SshHosts>) {
    let (config, gateway, _) = setup_sled(sshd, dir, port);
    (config, gateway)
}

/// Like [`setup_at`], also handing back the sled ledger itself, for what only it can tell
/// (its flushes) or do (accept without the matching rule).
fn setup_sled(sshd: &TestSshd, dir: &Path, port: u16) -> (Arc<Config>, Gateway<SshHosts>, Ledger) {
    setup_with(sshd, dir, port, "")
}

/// Like [`setup_sled`], with `host_extra` added to host `h1`'s table.
fn setup_with(
    sshd: &TestSshd,
    dir: &Path,
    port: u16,
    host_extra: &str,
) -> (Arc<Config>, Gateway<SshHosts>, Ledger) {
    let kh = sshd.known_hosts_for(port, dir);
    let text = format!(
        r#"
[ledger]
path = "{ledger}"

[credentials.k]
key_file = "{key}"
{host}
[tools.slow_print]
description = "Prints, waits, prints."
hosts = ["h1"]
argv = ["sh", "-c", "echo first; sleep 2; echo second"]
contract = "idempotent"

[tools.quick]
description = "Does nothing."
hosts = ["h1"]
argv = ["true"]
contract = "idempotent"

[tools.gated_a]
description = "Does nothing, once an operator approves."
hosts = ["h1"]
argv = ["true"]
contract = "idempotent"
approval = "per_call"

[tools.gated_b]
description = "Does nothing, once an operator approves."
hosts = ["h1"]
argv = ["true"]
contract = "idempotent"
approval = "per_call"

[tools.short]
description = "Does nothing (each n its own action)."
hosts = ["h1"]
argv = ["sh", "-c", "true", "x", "{{n}}"]
contract = "idempotent"

[tools.short.args.n]
type = "integer"

[tools.quiet]
description = "Waits 3 s, printing nothing."
hosts = ["h1"]
argv = ["sh", "-c", "sleep 3", "x", "{{n}}"]
contract = "idempotent"

[tools.quiet.args.n]
type = "integer"

[tools.big]
description = "Prints 200000 bytes."
hosts = ["h1"]
argv = ["sh", "-c", "head -c 200000 /dev/zero | tr '\\0' x"]
contract = "read_only"

[tools.big_then_wait]
description = "Prints 228894 bytes of numbers, then waits 2 s."
hosts = ["h1"]
argv = ["sh", "-c", "seq 1 40000; sleep 2"]
contract = "idempotent"

[tools.cut_secret]
description = "Prints its secret in two halves, 1.5 s apart, then waits 3 s."
hosts = ["h1"]
argv = ["sh", "-c", "printf 'pw='; printf '%s' \"$1\" | head -c 4; sleep 1.5; printf '%s' \"$1\" | tail -c +5; echo; sleep 3", "x", "{{token}}"]
contract = "idempotent"

[tools.cut_secret.args.token]
type = "string"
secret = true
"#,
        ledger = dir.join("ledger").display(),
        key = sshd.user_key_path().display(),
        host = sshd.waymark_host_toml("h1", "k", port, &kh) + host_extra,
    );
    let defaults = DefaultPaths::from_env(|_| None, 0);
    let config = Arc::new(Config::parse(Path::new("test.toml"), &text, &defaults).unwrap());
    let ledger = Ledger::init(&config.ledger_path).unwrap();
    let gateway = Gateway::new(
        config.clone(),
        Arc::new(ledger.clone()),
        Arc::new(SshHosts::new(config.clone())),
    );
    (config, gateway, ledger)
}

/// What the sink saw: stdout?, offset, bytes, seconds since the call began.
type Seen = Arc<Mutex<Vec<(bool, u64, Vec<u8>, f64)>>>;

fn ctx() -> CallContext {
    CallContext {
        actor: Actor("uid:1:/test".into()),
        scope: IntentScope::ToolWindow,
        delivery: Delivery::default(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn output_streams_to_the_caller_while_the_command_runs() {
    let sshd = TestSshd::new();
    let dir = tempfile::tempdir().unwrap();
    let (config, gateway) = setup(&sshd, dir.path());
    let call = resolve(&config, "slow_print", &Map::new(), ctx()).unwrap();
    let start = Instant::now();
    let seen: Seen = Arc::default();
    let sink_seen = seen.clone();
    let sink = move |e: CallEvent<'_>| {
        if let CallEvent::Output {
            stream,
            offset,
            bytes,
        } = e
        {
            sink_seen.lock().unwrap().push((
                stream == Stream::Stdout,
                offset,
                bytes.to_vec(),
                start.elapsed().as_secs_f64(),
            ));
        }
    };
    let outcome = gateway.call(call, None, &sink).await.unwrap();
    let total = start.elapsed().as_secs_f64();
    assert_eq!(outcome.record.state(), ExecState::Completed);
    let seen = seen.lock().unwrap();
    let first = seen
        .iter()
        .find(|s| s.0 && s.2.starts_with(b"first"))
        .expect("streamed the first line");
    assert_eq!(first.1, 0, "from offset 0");
    assert!(
        first.3 < total - 1.0,
        "the first line arrived while the command still ran ({} s of {} s)",
        first.3,
        total
    );
    let streamed: Vec<u8> = seen
        .iter()
        .filter(|s| s.0)
        .flat_map(|s| s.2.clone())
        .collect();
    let stored = outcome.result.unwrap().stdout.head;
    assert!(
        stored.starts_with(&streamed),
        "what was streamed is a prefix of the stored output"
    );
    assert_eq!(stored, b"first\nsecond\n");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn output_beyond_the_ledger_cap_is_read_from_the_marker() {
    let sshd = TestSshd::new();
    let dir = tempfile::tempdir().unwrap();
    let (config, gateway) = setup(&sshd, dir.path());
    let call = resolve(&config, "big", &Map::<String, Value>::new(), ctx()).unwrap();
    let outcome = gateway.call(call, None, &NoEvents).await.unwrap();
    let result = outcome.result.unwrap();
    assert_eq!(result.stdout.total_bytes, 200_000);
    assert!(
        result.stdout.truncated(),
        "the ledger keeps only the first {} bytes",
        gateway.result_cap
    );
    let kept = result.stdout.head.len() as u64;
    let (rest, size) = gateway
        .read_output(outcome.record.id, Stream::Stdout, kept, 1 << 20)
        .await
        .unwrap();
    assert_eq!(size, 200_000);
    assert_eq!(kept + rest.len() as u64, 200_000);
    assert!(rest.iter().all(|b| *b == b'x'));
    assert_eq!(
        result.stdout.sha256,
        hex_sha256(&vec![b'x'; 200_000]),
        "the stored hash is the host's hash of the whole stream, not of the head"
    );
}

/// Every file under `dir` with its size (for a failure message).
fn walk(dir: &Path) -> Vec<(std::path::PathBuf, u64)> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let p = e.path();
        if p.is_dir() {
            out.extend(walk(&p));
        } else {
            let len = std::fs::metadata(&p).map(|m| m.len()).unwrap_or(0);
            out.push((p, len));
        }
    }
    out
}

fn hex_sha256(bytes: &[u8]) -> String {
    use sha2::Digest as _;
    sha2::Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_cut_during_the_output_fetch_never_stores_an_empty_result() {
    use waymark_testkit::{CutScope, Direction, FaultProxy};
    const TOTAL: u64 = 228_894; // `seq 1 40000`
    let sshd = TestSshd::new();
    let proxy = FaultProxy::start(sshd.addr());
    let dir = tempfile::tempdir().unwrap();
    let (config, gateway) = setup_at(&sshd, dir.path(), proxy.port());
    let gateway = Arc::new(gateway);
    let call = resolve(&config, "big_then_wait", &Map::new(), ctx()).unwrap();
    let running = tokio::spawn({
        let gateway = gateway.clone();
        async move { gateway.call(call, None, &NoEvents).await }
    });
    // Once the command printed everything and sleeps, the host's reply that it ended may pass,
    // but not the 64 KiB fetch of its output (nor on a new connection).
    let exec_dir = sshd.remote_dir().join("exec");
    let marker_stdout = tokio::time::timeout(std::time::Duration::from_secs(30), async {
        loop {
            let found = std::fs::read_dir(&exec_dir).ok().and_then(|mut d| {
                d.find_map(|e| {
                    let p = e.ok()?.path();
                    (p.extension()? == "stdout" && std::fs::metadata(&p).ok()?.len() == TOTAL)
                        .then_some(p)
                })
            });
            if let Some(p) = found {
                return p;
            }
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
    })
    .await
    .unwrap_or_else(|_| {
        panic!(
            "the command printed its output on the host: {:?}",
            walk(&sshd.remote_dir())
        )
    });
    proxy.cut_after(8192, Direction::ServerToClient, CutScope::LiveAndFuture);
    let outcome = running.await.unwrap().unwrap();
    let id = outcome.record.id;
    assert_eq!(
        outcome.record.state(),
        ExecState::Unknown,
        "ended, output not fetched: still open, not completed with nothing: {:?}",
        outcome.record
    );
    assert!(outcome.result.is_none(), "{:?}", outcome.result);
    assert!(
        outcome
            .message(Audience::Cli)
            .contains("has not reached Waymark yet"),
        "{}",
        outcome.message(Audience::Cli)
    );
    assert!(gateway.ledger().result(id).await.unwrap().is_none());

    // The connection heals: the next status fetches it, whole.
    proxy.heal();
    let (after, _) = gateway.status(id).await.unwrap();
    assert_eq!(
        after.record.state(),
        ExecState::Completed,
        "{:?}",
        after.record
    );
    let on_host = std::fs::read(&marker_stdout).unwrap();
    let stored = gateway
        .ledger()
        .result(id)
        .await
        .unwrap()
        .expect("a stored result");
    let cap = gateway.result_cap as usize;
    assert_eq!(stored.stdout.total_bytes, TOTAL);
    assert!(
        stored.stdout.head == on_host[..cap],
        "the stored stdout is the marker's, byte for byte"
    );
    assert_eq!(stored.stdout.sha256, hex_sha256(&on_host));
}

/// Sessions sshd has started so far (its VERBOSE log has one line per exec).
fn sessions(sshd: &TestSshd) -> usize {
    sshd.log().matches("Starting session: command").count()
}

/// Streaming calls on exec channels only (`serve = false`), so each run and each watch is
/// one sshd session and the sessions count the watches.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quiet_streaming_calls_on_one_host_look_at_their_output_together() {
    let sshd = TestSshd::new();
    let dir = tempfile::tempdir().unwrap();
    let (config, gateway, _) = setup_with(&sshd, dir.path(), sshd.port(), "serve = false\n");
    let gateway = Arc::new(gateway);
    // The connections twelve calls at once need, and their wrapper checks, before counting.
    let warm: Vec<_> = (100..112)
        .map(|n| {
            let args = Map::from_iter([("n".to_string(), Value::from(n))]);
            let (gateway, call) = (
                gateway.clone(),
                resolve(&config, "short", &args, ctx()).unwrap(),
            );
            tokio::spawn(async move { gateway.call(call, None, &NoEvents).await.unwrap() })
        })
        .collect();
    for w in warm {
        w.await.unwrap();
    }
    // Twelve calls at once: one session each, and none to watch, when the command is done
    // within the first pause.
    let streaming = |tool: &'static str, n: usize| {
        let args = Map::from_iter([("n".to_string(), Value::from(n))]);
        let call = resolve(&config, tool, &args, ctx()).unwrap();
        let gateway = gateway.clone();
        tokio::spawn(async move {
            let sink = |_: CallEvent<'_>| {};
            gateway.call(call, None, &sink).await.unwrap()
        })
    };
    const CALLS: usize = 12;
    let before = sessions(&sshd);
    let short: Vec<_> = (0..CALLS).map(|n| streaming("short", n)).collect();
    for c in short {
        assert_eq!(c.await.unwrap().record.state(), ExecState::Completed);
    }
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert_eq!(
        sessions(&sshd) - before,
        CALLS,
        "a call whose command was done within the first pause watched its output"
    );

    // Each call streams output (its sink wants it) from a command that prints nothing for 3 s:
    // the asks of all twelve go to the host together, as one watch that waits there until
    // the commands end. Each looking alone (the first streaming calls did, every 0.3-2.4 s)
    // took about six sessions a call.
    let before = sessions(&sshd);
    let calls: Vec<_> = (0..CALLS).map(|n| streaming("quiet", n)).collect();
    for c in calls {
        assert_eq!(c.await.unwrap().record.state(), ExecState::Completed);
    }
    let watches = sessions(&sshd) - before - CALLS;
    assert!(
        (1..=4).contains(&watches),
        "{watches} sessions watched the output of {CALLS} quiet calls: one or a few batches \
         when their asks are batched and the host waits, dozens when each call looks on its own"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reconcile_reads_markers_in_batches_and_records_each_outcome() {
    use waymark_core::Transition;
    use waymark_gateway::flow::{now, RECONCILE_BATCH};
    use waymark_ledger::{Durability, NewExecution};

    let sshd = TestSshd::new();
    let dir = tempfile::tempdir().unwrap();
    let (config, gateway, ledger) = setup_sled(&sshd, dir.path(), sshd.port());
    let call = resolve(&config, "slow_print", &Map::new(), ctx()).unwrap();
    let key = ledger.fingerprint_key();
    let action = call.ssh_request().unwrap().canonicalize(&key);
    let fingerprint = action.fingerprint(&key);
    // More than one batch, left `dispatched` as a daemon killed mid-flight leaves them.
    let total = RECONCILE_BATCH + 20;
    let t = now();
    let mut ids = Vec::new();
    for _ in 0..total {
        let id = ledger.mint_id(t);
        let new = NewExecution {
            id,
            fingerprint,
            action: action.clone(),
            actor: call.ssh_request().unwrap().actor.clone(),
            scope: call.ssh_request().unwrap().scope.clone(),
            tool: call.tool.clone(),
            host: "h1".into(),
            contract: call.policy.contract,
            run: None,
            mask: Vec::new(),
        };
        ledger.accept(new, t, Durability::Buffered).unwrap();
        let by = "test".to_string();
        ledger
            .transition(id, Transition::Authorize { by }, t, Durability::Buffered)
            .unwrap();
        ledger
            .transition(
                id,
                Transition::Dispatch { attempt: 1 },
                t,
                Durability::Flushed,
            )
            .unwrap();
        ids.push(id);
    }
    // Three of them reached the host and ran (one in each batch, one at the very end); the
    // others never arrived.
    let ran = [0, RECONCILE_BATCH + 1, total - 1];
    let hosts = SshHosts::new(config.clone());
    let exec = hosts.executor(&config.hosts["h1"]).unwrap();
    for &k in &ran {
        let request = waymark_ssh::DispatchRequest {
            execution_id: ids[k].to_string(),
            argv: vec!["sh".into(), "-c".into(), format!("echo ran-{k}")],
            ..Default::default()
        };
        exec.dispatch(&request, |_| {}).await.unwrap();
    }

    let before = sessions(&sshd);
    let report = gateway.reconcile().await.unwrap();
    let used = sessions(&sshd) - before;
    assert_eq!(report.checked, total as u64, "{report:?}");
    assert_eq!(report.moved, ran.len() as u64, "{report:?}");
    assert_eq!(report.unreachable, 0, "{report:?}");
    // One `status` per batch, a wrapper check on the new connection, and two output
    // fetches per finished execution: far fewer than one session per execution.
    assert!(
        used <= 2 + 2 + 2 * ran.len(),
        "{used} sessions for {total} executions"
    );
    for (k, id) in ids.iter().enumerate() {
        let rec = ledger.get(*id).unwrap().unwrap();
        if ran.contains(&k) {
            assert_eq!(rec.state(), ExecState::Completed, "{k}");
            let result = ledger.result(*id).unwrap().unwrap();
            assert_eq!(result.stdout.head, format!("ran-{k}\n").into_bytes());
        } else {
            assert_eq!(
                rec.state(),
                ExecState::Dispatched,
                "{k}: never reached the host"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn intent_locks_are_forgotten_once_calls_have_decided() {
    let sshd = TestSshd::new();
    let dir = tempfile::tempdir().unwrap();
    let (config, gateway) = setup(&sshd, dir.path());
    let gateway = Arc::new(gateway);
    // Racing calls of one intent (one runs, the others attach) and then another intent.
    let mut calls = Vec::new();
    for _ in 0..3 {
        let gateway = gateway.clone();
        let call = resolve(&config, "slow_print", &Map::new(), ctx()).unwrap();
        calls.push(tokio::spawn(async move {
            gateway.call(call, None, &NoEvents).await
        }));
    }
    let mut ids = Vec::new();
    for c in calls {
        let o = c.await.unwrap().unwrap();
        assert_eq!(o.record.state(), ExecState::Completed);
        ids.push(o.record.id);
    }
    ids.dedup();
    assert_eq!(ids.len(), 1, "one execution for one intent: {ids:?}");
    let call = resolve(&config, "big", &Map::new(), ctx()).unwrap();
    gateway.call(call, None, &NoEvents).await.unwrap();
    assert_eq!(gateway.intent_locks(), 0, "no lock kept per intent seen");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_costs_two_flushes_and_its_id_is_announced_once_durable() {
    let sshd = TestSshd::new();
    let dir = tempfile::tempdir().unwrap();
    let (config, gateway, ledger) = setup_sled(&sshd, dir.path(), sshd.port());
    let before = ledger.flush_count();
    // What the ledger held, and how many flushes it had made, when the id was announced.
    let announced = Mutex::new(None);
    let call = resolve(&config, "quick", &Map::new(), ctx()).unwrap();
    let o = gateway
        .call(call, None, &|e: CallEvent<'_>| {
            if let CallEvent::Decided { id, .. } = e {
                let state = ledger.get(id).unwrap().map(|r| r.state());
                *announced.lock().unwrap() = Some((state, ledger.flush_count() - before));
            }
        })
        .await
        .unwrap();
    assert_eq!(o.record.state(), ExecState::Completed);
    // Accepted, authorized and dispatched: written, and made durable by one flush, before the
    // caller learns the id and before anything is sent.
    assert_eq!(
        *announced.lock().unwrap(),
        Some((Some(ExecState::Dispatched), 1))
    );
    let steps: Vec<String> = ledger
        .events_of(o.record.id)
        .unwrap()
        .iter()
        .map(|e| {
            let k = serde_json::to_value(&e.kind).unwrap();
            match k["to"].as_str() {
                Some(to) => to.to_string(),
                None => k["type"].as_str().unwrap().to_string(),
            }
        })
        .collect();
    assert_eq!(
        steps,
        ["accepted", "authorized", "dispatched", "completed"],
        "every state of its life is in the audit chain"
    );
    // The outcome takes the second.
    assert_eq!(ledger.flush_count() - before, 2);
}

/// What a call's sink was told, output left out: `(event, execution, attached)`.
type Told = Arc<Mutex<Vec<(&'static str, ExecutionId, Option<AttachAction>)>>>;

fn telling(told: &Told) -> impl Fn(CallEvent<'_>) + Send + Sync + 'static {
    let told = told.clone();
    move |e| {
        let seen = match e {
            CallEvent::Decided { id, attached } => ("decided", id, attached),
            CallEvent::AwaitingApproval { record } => ("awaiting_approval", record.id, None),
            CallEvent::Output { .. } => return,
        };
        told.lock().unwrap().push(seen);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_is_told_of_its_own_approval_wait_once_and_of_no_other() {
    let sshd = TestSshd::new();
    let dir = tempfile::tempdir().unwrap();
    let (config, mut gateway) = setup(&sshd, dir.path());
    // A first call that gives up waiting leaves its execution awaiting approval, driverless.
    gateway.approval_wait = Duration::from_millis(200);
    let first: Told = Arc::default();
    let call = resolve(&config, "gated_a", &Map::new(), ctx()).unwrap();
    let o = gateway.call(call, None, &telling(&first)).await.unwrap();
    assert_eq!(o.record.state(), ExecState::AwaitingApproval);
    let a = o.record.id;
    assert_eq!(
        *first.lock().unwrap(),
        [("decided", a, None), ("awaiting_approval", a, None)]
    );
    gateway.approval_wait = Duration::from_secs(600);
    let gateway = Arc::new(gateway);
    // A retry attaches to it and waits on it itself; meanwhile another intent waits too.
    let (retry, other): (Told, Told) = Default::default();
    let spawn = |tool: &str, told: &Told| {
        let gateway = gateway.clone();
        let call = resolve(&config, tool, &Map::new(), ctx()).unwrap();
        let sink = telling(told);
        tokio::spawn(async move { gateway.call(call, None, &sink).await })
    };
    let retrying = spawn("gated_a", &retry);
    let calling = spawn("gated_b", &other);
    let waiting = |told: &Told| {
        told.lock()
            .unwrap()
            .iter()
            .any(|t| t.0 == "awaiting_approval")
    };
    let deadline = Instant::now() + Duration::from_secs(20);
    while !(waiting(&retry) && waiting(&other)) {
        assert!(Instant::now() < deadline, "both calls wait on an approval");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let b = other.lock().unwrap()[0].1;
    assert_ne!(a, b);
    // Each is approved only after both were told; a call told once stays told once.
    gateway.approve(a, "operator").await.unwrap();
    gateway.approve(b, "operator").await.unwrap();
    assert_eq!(
        retrying.await.unwrap().unwrap().record.state(),
        ExecState::Completed
    );
    assert_eq!(
        calling.await.unwrap().unwrap().record.state(),
        ExecState::Completed
    );
    assert_eq!(
        *retry.lock().unwrap(),
        [
            ("decided", a, Some(AttachAction::PendingApproval)),
            ("awaiting_approval", a, None)
        ],
        "told of its own execution's wait once, though it attached to it and then waited on it"
    );
    assert_eq!(
        *other.lock().unwrap(),
        [("decided", b, None), ("awaiting_approval", b, None)],
        "told only of its own execution"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_driver_that_vanished_is_named_to_its_joiner_and_never_joined_again() {
    let sshd = TestSshd::new();
    let dir = tempfile::tempdir().unwrap();
    let (config, gateway) = setup(&sshd, dir.path());
    let gateway = Arc::new(gateway);
    let (driving, joining): (Told, Told) = Default::default();
    let spawn = |told: &Told| {
        let gateway = gateway.clone();
        let call = resolve(&config, "slow_print", &Map::new(), ctx()).unwrap();
        let sink = telling(told);
        tokio::spawn(async move { gateway.call(call, None, &sink).await })
    };
    let deadline = Instant::now() + Duration::from_secs(20);
    let decided = |told: &Told| told.lock().unwrap().first().map(|t| t.1);
    let driver = spawn(&driving);
    while decided(&driving).is_none() {
        assert!(Instant::now() < deadline, "the first call decides");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let joiner = spawn(&joining);
    while decided(&joining).is_none() {
        assert!(Instant::now() < deadline, "the second call attaches");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // The joiner now waits on the driver; the driver goes away before its outcome.
    tokio::time::sleep(Duration::from_millis(200)).await;
    driver.abort();
    let id = decided(&driving).unwrap();
    assert_eq!(decided(&joining), Some(id), "one execution");
    match joiner.await.unwrap() {
        Err(GatewayError::DriverEnded { id: named }) => assert_eq!(named, id),
        other => panic!("expected DriverEnded for {id}, got {other:?}"),
    }
    // The driver that went away is not joined again: a retry drives the execution on.
    let retry = spawn(&Told::default()).await.unwrap().unwrap();
    assert_eq!(retry.record.id, id);
    assert_eq!(retry.record.state(), ExecState::Completed);
}

/// One live piece of stdout: its offset and bytes.
type Piece = (u64, Vec<u8>);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_secret_printed_in_two_pieces_is_masked_in_each_and_in_reads_that_cut_it() {
    let sshd = TestSshd::new();
    let dir = tempfile::tempdir().unwrap();
    let (config, gateway) = setup(&sshd, dir.path());
    let secret = "hunter2222";
    let args: Map<String, Value> = [("token".to_string(), Value::from(secret))]
        .into_iter()
        .collect();
    let call = resolve(&config, "cut_secret", &args, ctx()).unwrap();
    let pieces: Arc<Mutex<Vec<Piece>>> = Arc::default();
    let sink_pieces = pieces.clone();
    let sink = move |e: CallEvent<'_>| {
        if let CallEvent::Output {
            stream: Stream::Stdout,
            offset,
            bytes,
        } = e
        {
            sink_pieces.lock().unwrap().push((offset, bytes.to_vec()));
        }
    };
    let outcome = gateway.call(call, None, &sink).await.unwrap();
    let expected = format!("pw={}\n", "*".repeat(secret.len()));
    let pieces = pieces.lock().unwrap().clone();
    assert!(
        pieces.len() >= 2,
        "the halves came as separate pieces: {pieces:?}"
    );
    let mut live = Vec::new();
    for (offset, bytes) in &pieces {
        assert_eq!(*offset, live.len() as u64, "pieces follow each other");
        live.extend_from_slice(bytes);
    }
    assert_eq!(String::from_utf8_lossy(&live), expected, "live output");
    let stored = outcome.result.unwrap().stdout.head;
    assert_eq!(String::from_utf8_lossy(&stored), expected, "stored output");
    // Reads by offset that start or end inside the secret.
    let id = outcome.record.id;
    for (offset, max) in [(5, 100), (0, 6), (4, 3)] {
        let (bytes, _) = gateway
            .read_output(id, Stream::Stdout, offset, max)
            .await
            .unwrap();
        let want = &expected.as_bytes()
            [offset as usize..(offset + max).min(expected.len() as u64) as usize];
        assert_eq!(bytes, want, "read at {offset}+{max}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_secret_is_masked_by_a_gateway_that_never_held_its_value() {
    let sshd = TestSshd::new();
    let dir = tempfile::tempdir().unwrap();
    let (config, first) = setup(&sshd, dir.path());
    let first = Arc::new(first);
    let secret = "hunter2222";
    let args: Map<String, Value> = [("token".to_string(), Value::from(secret))]
        .into_iter()
        .collect();
    let call = resolve(&config, "cut_secret", &args, ctx()).unwrap();
    let told = Told::default();
    let sink = telling(&told);
    let driver = {
        let first = first.clone();
        tokio::spawn(async move { first.call(call, None, &sink).await })
    };
    let deadline = Instant::now() + Duration::from_secs(20);
    let id = loop {
        if let Some(t) = told.lock().unwrap().first() {
            break t.1;
        }
        assert!(Instant::now() < deadline, "the call decides");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    // The daemon that sent it goes away while the command runs; a new one, on the same
    // ledger and host, never held the value.
    tokio::time::sleep(Duration::from_millis(300)).await;
    driver.abort();
    let ledger = first.ledger().clone();
    drop(first);
    let second = Gateway::new(
        config.clone(),
        ledger.clone(),
        Arc::new(SshHosts::new(config.clone())),
    );
    let outcome = loop {
        let (outcome, _) = second.status(id).await.unwrap();
        if outcome.record.lifecycle.result_observed {
            break outcome;
        }
        assert!(Instant::now() < deadline, "the command ends");
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_eq!(outcome.record.state(), ExecState::Completed);
    let expected = format!("pw={}\n", "*".repeat(secret.len()));
    let stored = ledger.result(id).await.unwrap().unwrap().stdout.head;
    assert_eq!(String::from_utf8_lossy(&stored), expected, "stored output");
    // Reads by offset, by a gateway that never held the value, that start or end inside it.
    let fresh = Gateway::new(
        config.clone(),
        ledger,
        Arc::new(SshHosts::new(config.clone())),
    );
    for (offset, max) in [(0, 100), (5, 100), (0, 6), (4, 3)] {
        let (bytes, _) = fresh
            .read_output(id, Stream::Stdout, offset, max)
            .await
            .unwrap();
        let want = &expected.as_bytes()
            [offset as usize..(offset + max).min(expected.len() as u64) as usize];
        assert_eq!(
            String::from_utf8_lossy(&bytes),
            String::from_utf8_lossy(want),
            "read at {offset}+{max}"
        );
    }
}

/// The ledger as the gateway sees it, refusing every dispatch it is asked to record (a full
/// disk, a database gone): everything else is the real sled ledger's.
struct RefusesDispatch {
    inner: Arc<dyn LedgerApi>,
    refused: std::sync::atomic::AtomicUsize,
}

impl LedgerApi for RefusesDispatch {
    fn describe(&self) -> String {
        self.inner.describe()
    }
    fn fingerprint_key(&self) -> FingerprintKey {
        self.inner.fingerprint_key()
    }
    fn identity(&self) -> String {
        self.inner.identity()
    }
    fn mint_id(&self, now: Timestamp) -> ExecutionId {
        self.inner.mint_id(now)
    }
    fn drives(&self, record: &ExecutionRecord) -> bool {
        self.inner.drives(record)
    }
    fn accept_or_attach<'a>(
        &'a self,
        new: NewExecution,
        call: &'a IncomingCall,
        durability: Durability,
    ) -> LedgerFuture<'a, Intake> {
        self.inner.accept_or_attach(new, call, durability)
    }
    fn transition(
        &self,
        id: ExecutionId,
        transition: Transition,
        now: Timestamp,
        durability: Durability,
    ) -> LedgerFuture<'_, ExecutionRecord> {
        if matches!(transition, Transition::Dispatch { .. }) {
            self.refused
                .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            return Box::pin(async {
                Err(LedgerError::Storage {
                    path: "test-double".into(),
                    detail: "no space left on device".into(),
                })
            });
        }
        self.inner.transition(id, transition, now, durability)
    }
    fn transition_with_result(
        &self,
        id: ExecutionId,
        transition: Transition,
        result: StoredResult,
        now: Timestamp,
        durability: Durability,
    ) -> LedgerFuture<'_, ExecutionRecord> {
        self.inner
            .transition_with_result(id, transition, result, now, durability)
    }
    fn get(&self, id: ExecutionId) -> LedgerFuture<'_, Option<ExecutionRecord>> {
        self.inner.get(id)
    }
    fn by_fingerprint<'a>(&'a self, fp: &'a Fingerprint) -> LedgerFuture<'a, Vec<ExecutionRecord>> {
        self.inner.by_fingerprint(fp)
    }
    fn list<'a>(&'a self, q: &'a ListQuery) -> LedgerFuture<'a, Page> {
        self.inner.list(q)
    }
    fn result(&self, id: ExecutionId) -> LedgerFuture<'_, Option<StoredResult>> {
        self.inner.result(id)
    }
    fn setting<'a>(&'a self, name: &'a str) -> LedgerFuture<'a, Option<Value>> {
        self.inner.setting(name)
    }
    fn set_setting<'a>(
        &'a self,
        name: &'a str,
        value: Value,
        by: &'a str,
        now: Timestamp,
        durability: Durability,
    ) -> LedgerFuture<'a, u64> {
        self.inner.set_setting(name, value, by, now, durability)
    }
    fn record_note<'a>(
        &'a self,
        name: &'a str,
        data: Value,
        now: Timestamp,
        durability: Durability,
    ) -> LedgerFuture<'a, u64> {
        self.inner.record_note(name, data, now, durability)
    }
    fn start_run<'a>(
        &'a self,
        actor: Actor,
        transport: &'a str,
        now: Timestamp,
        durability: Durability,
    ) -> LedgerFuture<'a, RunRecord> {
        self.inner.start_run(actor, transport, now, durability)
    }
    fn count_call<'a>(&'a self, run_id: &'a str) -> LedgerFuture<'a, ()> {
        self.inner.count_call(run_id)
    }
    fn end_run<'a>(
        &'a self,
        run_id: &'a str,
        now: Timestamp,
        durability: Durability,
    ) -> LedgerFuture<'a, ()> {
        self.inner.end_run(run_id, now, durability)
    }
    fn runs(&self, limit: usize) -> LedgerFuture<'_, Vec<RunRecord>> {
        self.inner.runs(limit)
    }
    fn run<'a>(&'a self, id: &'a str) -> LedgerFuture<'a, Option<RunRecord>> {
        self.inner.run(id)
    }
    fn events_of(&self, id: ExecutionId) -> LedgerFuture<'_, Vec<LedgerEvent>> {
        self.inner.events_of(id)
    }
    fn events(&self, from: u64, limit: usize) -> LedgerFuture<'_, Vec<LedgerEvent>> {
        self.inner.events(from, limit)
    }
    fn head(&self) -> LedgerFuture<'_, ChainHead> {
        self.inner.head()
    }
    fn verify<'a>(&'a self, exported: Option<&'a ChainHead>) -> LedgerFuture<'a, VerifyReport> {
        self.inner.verify(exported)
    }
    fn verify_since<'a>(
        &'a self,
        since: Option<&'a ChainHead>,
        exported: Option<&'a ChainHead>,
        progress: Progress<'a>,
    ) -> LedgerFuture<'a, VerifyReport> {
        self.inner.verify_since(since, exported, progress)
    }
    fn backup<'a>(&'a self, dest: &'a Path) -> LedgerFuture<'a, ChainHead> {
        self.inner.backup(dest)
    }
    fn gc(&self, older_than: Timestamp, now: Timestamp) -> LedgerFuture<'_, GcReport> {
        self.inner.gc(older_than, now)
    }
    fn gc_plan(&self, older_than: Timestamp) -> LedgerFuture<'_, GcReport> {
        self.inner.gc_plan(older_than)
    }
    fn flush(&self) -> LedgerFuture<'_, ()> {
        self.inner.flush()
    }
}

/// A ledger error stops the flow before the host is touched: the ledger refuses to record a
/// dispatch, the call fails with that error, and the host holds no marker of the execution.
/// Once the ledger writes again, the same call runs it, once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dispatch_the_ledger_cannot_record_never_reaches_the_host() {
    let sshd = TestSshd::new();
    let dir = tempfile::tempdir().unwrap();
    let (config, gateway, ledger) = setup_sled(&sshd, dir.path(), sshd.port());
    let refusing = Arc::new(RefusesDispatch {
        inner: Arc::new(ledger.clone()),
        refused: Default::default(),
    });
    let broken = Gateway::new(
        config.clone(),
        refusing.clone(),
        Arc::new(SshHosts::new(config.clone())),
    );
    let call = || resolve(&config, "quick", &Map::new(), ctx()).unwrap();
    let err = broken.call(call(), None, &NoEvents).await.unwrap_err();
    assert!(
        matches!(&err, GatewayError::Ledger(LedgerError::Storage { .. })),
        "{err}"
    );
    assert_eq!(
        refusing.refused.load(std::sync::atomic::Ordering::SeqCst),
        1
    );
    let recorded = ledger.list(&ListQuery::default()).unwrap().items;
    assert_eq!(recorded.len(), 1, "{recorded:?}");
    let id = recorded[0].id;
    assert_eq!(
        recorded[0].state(),
        ExecState::Authorized,
        "{:?}",
        recorded[0]
    );
    assert_eq!(recorded[0].dispatch_attempts, 0);
    let marker = sshd.remote_dir().join("exec").join(id.to_string());
    assert!(!marker.exists(), "the host was asked: {}", marker.display());
    // The ledger writes again: the same call is that execution, sent once.
    let ran = gateway.call(call(), None, &NoEvents).await.unwrap();
    assert_eq!(ran.record.id, id);
    assert_eq!(ran.record.state(), ExecState::Completed, "{:?}", ran.record);
    assert_eq!(ran.record.dispatch_attempts, 1);
    assert!(marker.exists(), "no marker at {}", marker.display());
}
