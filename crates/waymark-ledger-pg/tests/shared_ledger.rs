//! The shared ledger against a real PostgreSQL (the test kit's cluster, a database per test):
//! schema versions, one execution for an intent raced by two daemons, fencing and takeover.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use waymark_core::{
    ActionRequest, Actor, Delivery, ExecState, ExecutionId, FingerprintKey, IncomingCall,
    IntentScope, ReplayContract, ReplayPolicy, Target, Timestamp, Transition, Word,
};
use waymark_ledger::NewExecution;
use waymark_ledger_pg::{Intake, PgLedger, PgLedgerError};
use waymark_testkit::TestPostgres;

const T0: u64 = 1_800_000_000_000;

/// The master key every daemon of a test shares.
const MASTER: [u8; 32] = *b"waymark-shared-ledger-test-key-!";

fn key() -> FingerprintKey {
    waymark_ledger::derive_keys(&MASTER).0
}

fn fresh_id(at: Timestamp) -> ExecutionId {
    static N: AtomicU64 = AtomicU64::new(1);
    ExecutionId::from_parts(at, N.fetch_add(1, Ordering::Relaxed) as u128)
}

fn intent(arg: &str, at: Timestamp) -> (NewExecution, IncomingCall) {
    let req = ActionRequest {
        actor: Actor("uid:1000:/usr/bin/agent".into()),
        tool: "deploy".into(),
        channel: "ssh-exec".into(),
        target: Target {
            user: "ops".into(),
            host: "web1".into(),
            port: 22,
        },
        credential_ref: "ops-key".into(),
        argv: vec![Word::literal("deploy"), Word::literal(arg)],
        cwd: None,
        env: BTreeMap::new(),
        scope: IntentScope::ToolWindow,
        delivery: Delivery::default(),
    };
    let action = req.canonicalize(&key());
    let new = NewExecution {
        id: fresh_id(at),
        fingerprint: action.fingerprint(&key()),
        action,
        actor: req.actor.clone(),
        scope: req.scope.clone(),
        tool: req.tool.clone(),
        host: "web1".into(),
        contract: ReplayContract::StatusCheck,
        run: None,
        mask: Vec::new(),
    };
    let call = IncomingCall {
        actor: req.actor,
        scope: req.scope,
        policy: ReplayPolicy::new(ReplayContract::StatusCheck, Duration::from_secs(600)),
        now: at,
    };
    (new, call)
}

async fn ledger(url: &str) -> PgLedger {
    PgLedger::connect(url, &MASTER).await.unwrap()
}

#[tokio::test]
async fn the_schema_is_created_once_and_a_newer_one_is_refused() {
    let pg = TestPostgres::shared();
    let url = pg.create_database("schema");
    // Two daemons starting at once both migrate; the lock makes one of them do it.
    let (a, b) = tokio::join!(
        PgLedger::connect(&url, &MASTER),
        PgLedger::connect(&url, &MASTER)
    );
    let (a, _b) = (a.unwrap(), b.unwrap());
    assert_eq!(
        a.schema_version().await.unwrap(),
        PgLedger::known_schema_version()
    );

    let db = url.rsplit('/').next().unwrap();
    let out = waymark_testkit::output_within(
        pg.psql(db)
            .args(["-c", "UPDATE waymark_schema SET version = version + 1"]),
        Duration::from_secs(30),
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    match PgLedger::connect(&url, &MASTER).await {
        Err(e @ PgLedgerError::SchemaTooNew { .. }) => {
            let text = e.to_string();
            assert!(text.contains("upgrade waymark"), "{text}");
        }
        Err(e) => panic!("expected SchemaTooNew, got {e}"),
        Ok(_) => panic!("a newer schema must be refused"),
    }
}

#[tokio::test]
async fn two_daemons_racing_one_intent_get_one_execution() {
    let url = TestPostgres::shared().create_database("race");
    let daemons = [ledger(&url).await, ledger(&url).await];
    let at = Timestamp::from_millis(T0);
    // Four intents, twenty calls each, spread over both daemons.
    let mut calls = Vec::new();
    for i in 0..80 {
        let d = daemons[i % 2].clone();
        let owner = format!("daemon-{}", i % 2);
        let arg = format!("v1.{}", i % 4);
        calls.push(tokio::spawn(async move {
            let (new, call) = intent(&arg, at);
            (arg, d.accept_or_attach(new, &call, &owner).await.unwrap())
        }));
    }
    let mut new_ids: BTreeMap<String, BTreeSet<ExecutionId>> = BTreeMap::new();
    let mut attached: BTreeMap<String, BTreeSet<ExecutionId>> = BTreeMap::new();
    for c in calls {
        match c.await.unwrap() {
            (arg, Intake::New { record, lease }) => {
                assert_eq!(lease.epoch, 1);
                new_ids.entry(arg).or_default().insert(record.id);
            }
            (arg, Intake::Attach { record, .. }) => {
                attached.entry(arg).or_default().insert(record.id);
            }
        }
    }
    assert_eq!(new_ids.len(), 4, "{new_ids:?}");
    for (arg, ids) in &new_ids {
        assert_eq!(ids.len(), 1, "one intent ({arg}), one execution: {ids:?}");
        assert!(
            attached.get(arg).is_none_or(|a| a == ids),
            "every retry of {arg} attached to it"
        );
    }
    assert_eq!(
        daemons[0]
            .count_in_state(ExecState::Accepted)
            .await
            .unwrap(),
        4
    );

    // Another intent is its own execution.
    let (new, call) = intent("v9.9.9", at);
    assert!(matches!(
        daemons[1]
            .accept_or_attach(new, &call, "daemon-1")
            .await
            .unwrap(),
        Intake::New { .. }
    ));
}

#[tokio::test]
async fn a_stale_daemon_is_fenced_and_survivors_take_over_each_execution_once() {
    let url = TestPostgres::shared().create_database("fencing");
    let a = ledger(&url).await;
    let at = Timestamp::from_millis(T0);
    a.heartbeat("a", at).await.unwrap();
    let mut leases = Vec::new();
    for i in 0..30 {
        let (new, call) = intent(&format!("job-{i}"), at);
        let Intake::New { record, lease } = a.accept_or_attach(new, &call, "a").await.unwrap()
        else {
            panic!("a new intent")
        };
        leases.push((record.id, lease));
    }
    let (first, first_lease) = leases[0].clone();
    let policy = Transition::Authorize {
        by: "policy".into(),
    };
    a.transition(first, &first_lease, policy, at).await.unwrap();
    a.transition(first, &first_lease, Transition::Dispatch { attempt: 1 }, at)
        .await
        .unwrap();

    // a stops beating; b and c are alive and both look for a's work at the same moment.
    let later = Timestamp::from_millis(T0 + 60_000);
    let (b, c) = (ledger(&url).await, ledger(&url).await);
    b.heartbeat("b", later).await.unwrap();
    c.heartbeat("c", later).await.unwrap();
    let (tb, tc) = tokio::join!(
        b.take_over("b", Duration::from_secs(10), later),
        c.take_over("c", Duration::from_secs(10), later)
    );
    let (tb, tc) = (tb.unwrap(), tc.unwrap());
    let ids_b: BTreeSet<_> = tb.iter().map(|(r, _)| r.id).collect();
    let ids_c: BTreeSet<_> = tc.iter().map(|(r, _)| r.id).collect();
    assert!(
        ids_b.is_disjoint(&ids_c),
        "no execution taken by two survivors"
    );
    assert_eq!(
        ids_b.len() + ids_c.len(),
        30,
        "every unresolved execution was taken"
    );
    assert!(tb.iter().chain(&tc).all(|(_, l)| l.epoch == 2));

    // The stale daemon cannot write any more; the new owner can.
    match a
        .transition(
            first,
            &first_lease,
            Transition::Lost { reason: "x".into() },
            later,
        )
        .await
    {
        Err(PgLedgerError::Fenced {
            epoch: 2, mine: 1, ..
        }) => {}
        other => panic!("a stale lease must be fenced, got {other:?}"),
    }
    let (owner, new_lease) = tb
        .iter()
        .chain(&tc)
        .find(|(r, _)| r.id == first)
        .map(|(r, l)| (r.clone(), l.clone()))
        .unwrap();
    assert_eq!(
        owner.state(),
        ExecState::Dispatched,
        "taken over as it was: the marker decides"
    );
    let moved = if ids_b.contains(&first) { &b } else { &c };
    let rec = moved
        .transition(
            first,
            &new_lease,
            Transition::Lost {
                reason: "owner died".into(),
            },
            later,
        )
        .await
        .unwrap();
    assert_eq!(rec.state(), ExecState::Unknown);

    // A daemon that is alive keeps its work.
    assert!(b
        .take_over("b", Duration::from_secs(10), later)
        .await
        .unwrap()
        .is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_attach_racing_the_drivers_transitions_never_writes_back_a_stale_record() {
    let url = TestPostgres::shared().create_database("stale_attach");
    let (a, b) = (ledger(&url).await, ledger(&url).await);
    let at = Timestamp::from_millis(T0);
    for round in 0..30 {
        let arg = format!("r{round}");
        let (new, call) = intent(&arg, at);
        let Intake::New { record, lease } = a.accept_or_attach(new, &call, "a").await.unwrap()
        else {
            panic!("round {round}: a new intent");
        };
        let id = record.id;
        // A moves it on while B's retry of the same intent attaches to it.
        let driver = {
            let a = a.clone();
            tokio::spawn(async move {
                for t in [
                    Transition::Authorize { by: "p".into() },
                    Transition::Dispatch { attempt: 1 },
                ] {
                    a.transition(id, &lease, t, at).await.unwrap();
                }
            })
        };
        let (retry, call) = intent(&arg, at);
        let attached = b.accept_or_attach(retry, &call, "b").await.unwrap();
        assert!(matches!(attached, Intake::Attach { .. }), "round {round}");
        driver.await.unwrap();
        let (rec, _) = a.get(id).await.unwrap().unwrap();
        assert_eq!(
            rec.state(),
            ExecState::Dispatched,
            "round {round}: the driver's transitions survive the attach"
        );
    }
    assert!(a.verify(None).await.unwrap().is_ok());
}

#[tokio::test]
async fn every_connection_commits_synchronously_whatever_the_database_default() {
    let pg = TestPostgres::shared();
    let url = pg.create_database("sync_commit");
    let db = url.rsplit('/').next().unwrap();
    let out = waymark_testkit::output_within(
        pg.psql(db).args([
            "-c",
            &format!("ALTER DATABASE {db} SET synchronous_commit = off"),
        ]),
        Duration::from_secs(30),
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let ledger = ledger(&url).await;
    assert_eq!(ledger.synchronous_commit().await.unwrap(), "on");
}

/// Runs `sql` on the database behind `url`.
fn psql(url: &str, sql: &str) {
    let db = url.rsplit('/').next().unwrap();
    let out = waymark_testkit::output_within(
        TestPostgres::shared().psql(db).args(["-c", sql]),
        Duration::from_secs(30),
    );
    assert!(
        out.status.success(),
        "{sql}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A shared chain of 20 events, written by two daemons in turn; returns its URL and head.
async fn two_daemons_chain(hint: &str) -> (String, waymark_ledger::ChainHead) {
    let url = TestPostgres::shared().create_database(hint);
    let daemons = [ledger(&url).await, ledger(&url).await];
    for i in 0..20 {
        let (new, call) = intent(&format!("t{i}"), Timestamp::from_millis(T0 + i as u64));
        let owner = format!("daemon-{}", i % 2);
        daemons[i % 2]
            .accept_or_attach(new, &call, &owner)
            .await
            .unwrap();
    }
    let report = daemons[0].verify(None).await.unwrap();
    assert!(report.is_ok(), "{:?}", report.broken);
    assert_eq!(report.events, 20, "one chain of both daemons' events");
    (url, daemons[0].head().await.unwrap())
}

#[tokio::test]
async fn an_edited_event_in_the_shared_chain_is_named_by_verify() {
    let (url, _) = two_daemons_chain("edited").await;
    psql(
        &url,
        "UPDATE events SET body = jsonb_set(body, '{at}', '1') WHERE seq = 7",
    );
    let broken = ledger(&url).await.verify(None).await.unwrap().broken;
    let broken = broken.expect("an edited event breaks the chain");
    assert_eq!(broken.seq, 7);
    assert!(
        matches!(broken.problem, waymark_ledger::ChainProblem::Edited),
        "{broken}"
    );
}

#[tokio::test]
async fn a_removed_or_truncated_event_in_the_shared_chain_is_named_by_verify() {
    let (url, _) = two_daemons_chain("removed").await;
    psql(&url, "DELETE FROM events WHERE seq = 12");
    let broken = ledger(&url).await.verify(None).await.unwrap().broken;
    let broken = broken.expect("a missing event breaks the chain");
    assert_eq!(broken.seq, 12, "{broken}");
    assert!(
        matches!(broken.problem, waymark_ledger::ChainProblem::Gap { .. }),
        "{broken}"
    );

    // The tail cut and the head row moved back with it: the exported head still tells.
    let (url, head) = two_daemons_chain("truncated").await;
    psql(&url, "DELETE FROM events WHERE seq > 15");
    let prior = ledger(&url).await;
    let at_15 = prior.events(15, 1).await.unwrap().remove(0);
    psql(
        &url,
        &format!("UPDATE chain_head SET seq = 15, hash = '{}'", at_15.hash),
    );
    assert!(
        prior.verify(None).await.unwrap().is_ok(),
        "a consistent prefix"
    );
    let broken = prior.verify(Some(&head)).await.unwrap().broken;
    assert!(
        broken.is_some(),
        "truncation before an exported head is detected"
    );
}
