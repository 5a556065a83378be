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
use waymark_ledger_pg::{Intake, Lease, PgLedger, PgLedgerError};
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

/// The daemon's metrics hear of each flushed write's wait for the WAL, and of no buffered one.
#[tokio::test]
async fn the_flush_observer_is_told_each_synchronous_commit_wait() {
    let url = TestPostgres::shared().create_database("flush_observer");
    let told = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let observer = waymark_ledger::FlushObserver({
        let told = told.clone();
        std::sync::Arc::new(move |d| told.lock().unwrap().push(d))
    });
    let d = ledger(&url).await.with_flush_observer(observer);
    let at = Timestamp::from_millis(T0);
    let (new, call) = intent("buffered", at);
    d.accept_or_attach_with(new, &call, "daemon-0", waymark_ledger::Durability::Buffered)
        .await
        .unwrap();
    assert_eq!(told.lock().unwrap().len(), 0);
    let (new, call) = intent("flushed", at);
    d.accept_or_attach(new, &call, "daemon-0").await.unwrap();
    d.flush().await.unwrap();
    assert_eq!(told.lock().unwrap().len(), 2);
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

    // Both daemons decide one intent while the chain head is held elsewhere: each batch
    // waits on the head after deciding, so only the intent's lock keeps the second daemon from
    // deciding "new" as well.
    let holder = hold_chain_head(&url).await;
    let racing: Vec<_> = (0..2)
        .map(|i| {
            let d = daemons[i].clone();
            tokio::spawn(async move {
                let (new, call) = intent("held", at);
                let owner = format!("daemon-{i}");
                d.accept_or_attach(new, &call, &owner).await.unwrap()
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(300)).await;
    holder.batch_execute("ROLLBACK").await.unwrap();
    let mut fresh = 0;
    for r in racing {
        fresh += matches!(r.await.unwrap(), Intake::New { .. }) as usize;
    }
    assert_eq!(
        fresh, 1,
        "one intent raced under a held head, one execution"
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

/// `n` new executions accepted by daemon `me` on `ledger`, with their leases.
async fn accept_new(
    ledger: &PgLedger,
    me: &str,
    n: usize,
    at: Timestamp,
) -> Vec<(ExecutionId, Lease)> {
    let mut leases = Vec::new();
    for i in 0..n {
        let (new, call) = intent(&format!("job-{i}"), at);
        let Intake::New { record, lease } = ledger.accept_or_attach(new, &call, me).await.unwrap()
        else {
            panic!("a new intent")
        };
        leases.push((record.id, lease));
    }
    leases
}

#[tokio::test]
async fn a_stale_daemon_is_fenced_and_survivors_take_over_each_execution_once() {
    let url = TestPostgres::shared().create_database("fencing");
    let a = ledger(&url).await;
    let at = Timestamp::from_millis(T0);
    a.heartbeat("a", at).await.unwrap();
    let leases = accept_new(&a, "a", 30, at).await;
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
async fn a_let_go_execution_is_adopted_once_and_its_old_lease_is_fenced() {
    let url = TestPostgres::shared().create_database("adopt");
    let a = ledger(&url).await;
    let at = Timestamp::from_millis(T0);
    a.heartbeat("a", at).await.unwrap();
    let leases = accept_new(&a, "a", 20, at).await;
    let (first, first_lease) = leases[0].clone();
    let (b, c) = (ledger(&url).await, ledger(&url).await);

    // Driven by a: nobody else adopts it.
    assert!(b.adopt(first, "b", at).await.unwrap().is_none());

    // a lets every one go; b and c adopt each at the same moment: one lease each, epoch 2.
    for (id, lease) in &leases {
        assert!(a.release(*id, lease).await.unwrap(), "a held {id}");
    }
    let mut adopted = Vec::new();
    for (id, _) in &leases {
        let (rb, rc) = tokio::join!(b.adopt(*id, "b", at), c.adopt(*id, "c", at));
        adopted.push((*id, rb.unwrap(), rc.unwrap()));
    }
    for (id, rb, rc) in &adopted {
        let (_, lease) = match (rb, rc) {
            (Some(x), None) | (None, Some(x)) => x,
            (x, y) => panic!("{id}: adopted by b: {}, by c: {}", x.is_some(), y.is_some()),
        };
        assert_eq!(lease.epoch, 2, "{id}");
    }

    // a's old lease can neither write nor let go of what another daemon adopted.
    match a
        .transition(
            first,
            &first_lease,
            Transition::Authorize {
                by: "policy".into(),
            },
            at,
        )
        .await
    {
        Err(PgLedgerError::Fenced {
            epoch: 2, mine: 1, ..
        }) => {}
        other => panic!("a let-go lease must be fenced, got {other:?}"),
    }
    assert!(!a.release(first, &first_lease).await.unwrap());
    let (_, rb, rc) = &adopted[0];
    let (_, lease) = rb.as_ref().or(rc.as_ref()).unwrap();
    let (rec, owner) = a.get(first).await.unwrap().unwrap();
    assert_eq!(owner.as_ref(), Some(lease), "{}", rec.id);

    // An execution nobody drives is adopted, never taken over: its owner did not die.
    let (second, rb, rc) = &adopted[1];
    let (_, lease) = rb.as_ref().or(rc.as_ref()).unwrap();
    let holder = if rb.is_some() { &b } else { &c };
    assert!(holder.release(*second, lease).await.unwrap());
    let later = Timestamp::from_millis(T0 + 60_000);
    let d = ledger(&url).await;
    d.heartbeat("d", later).await.unwrap();
    let taken = d
        .take_over("d", Duration::from_secs(10), later)
        .await
        .unwrap();
    assert!(
        taken.iter().all(|(r, _)| r.id != *second),
        "an unowned execution was taken over"
    );
    let (rec, lease) = d.adopt(*second, "d", later).await.unwrap().unwrap();
    assert_eq!((rec.id, lease.epoch), (*second, 3));
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

/// A session of its own holding the chain head's row lock until it sends `ROLLBACK`.
async fn hold_chain_head(url: &str) -> tokio_postgres::Client {
    let (holder, connection) = tokio_postgres::connect(url, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(connection);
    holder
        .batch_execute("BEGIN; SELECT 1 FROM chain_head WHERE id = 1 FOR UPDATE")
        .await
        .unwrap();
    holder
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_write_in_a_batch_loses_or_misattributes_none_of_the_others() {
    let url = TestPostgres::shared().create_database("batch");
    let a = ledger(&url).await;
    let at = Timestamp::from_millis(T0);
    let mut accepted = Vec::new();
    for i in 0..6 {
        let (new, call) = intent(&format!("b{i}"), at);
        let Intake::New { record, lease } = a.accept_or_attach(new, &call, "a").await.unwrap()
        else {
            panic!("b{i}: a new intent")
        };
        accepted.push((record.id, lease));
    }

    // Another session holds the chain head: the next write's batch waits on it, and every
    // write queued meanwhile goes into the one batch after it.
    let holder = hold_chain_head(&url).await;
    let before = a.batches_committed();
    let move_one = |id: ExecutionId, lease: waymark_ledger_pg::Lease, t: Transition| {
        let a = a.clone();
        tokio::spawn(async move { a.transition(id, &lease, t, at).await })
    };
    let authorize = || Transition::Authorize { by: "p".into() };
    let waiting = move_one(accepted[0].0, accepted[0].1.clone(), authorize());
    tokio::time::sleep(Duration::from_millis(300)).await;

    // The batch: three good transitions, a fenced one, an illegal one, one of an execution
    // that does not exist, a new intent and a retry of the first execution's intent.
    let good: Vec<_> = (1..4)
        .map(|i| move_one(accepted[i].0, accepted[i].1.clone(), authorize()))
        .collect();
    let stale = waymark_ledger_pg::Lease {
        owner: "a".into(),
        epoch: 2,
    };
    let fenced = move_one(accepted[4].0, stale, authorize());
    let illegal = move_one(
        accepted[5].0,
        accepted[5].1.clone(),
        Transition::Dispatch { attempt: 1 },
    );
    let missing_id = fresh_id(at);
    let missing = move_one(missing_id, accepted[0].1.clone(), authorize());
    let accept = |arg: &str| {
        let (a, (new, call)) = (a.clone(), intent(arg, at));
        tokio::spawn(async move { (new.id, a.accept_or_attach(new, &call, "a").await) })
    };
    let (fresh, retry) = (accept("b-new"), accept("b1"));
    tokio::time::sleep(Duration::from_millis(300)).await;
    holder.batch_execute("ROLLBACK").await.unwrap();

    let rec = waiting.await.unwrap().unwrap();
    assert_eq!(
        (rec.id, rec.state()),
        (accepted[0].0, ExecState::Authorized)
    );
    for (i, g) in (1..4).zip(good) {
        let rec = g.await.unwrap().unwrap();
        assert_eq!(
            (rec.id, rec.state()),
            (accepted[i].0, ExecState::Authorized),
            "each good write gets its own execution back"
        );
    }
    match fenced.await.unwrap() {
        Err(PgLedgerError::Fenced { id, mine: 2, .. }) if id == accepted[4].0 => {}
        other => panic!("the stale lease is fenced, naming its execution: {other:?}"),
    }
    match illegal.await.unwrap() {
        Err(PgLedgerError::Illegal { id, .. }) if id == accepted[5].0 => {}
        other => panic!("dispatch before authorization is illegal: {other:?}"),
    }
    match missing.await.unwrap() {
        Err(PgLedgerError::NotFound(id)) if id == missing_id => {}
        other => panic!("an unknown execution is not found: {other:?}"),
    }
    match fresh.await.unwrap() {
        (id, Ok(Intake::New { record, .. })) if record.id == id => {}
        other => panic!("a new intent is accepted under its own id: {other:?}"),
    }
    match retry.await.unwrap() {
        (_, Ok(Intake::Attach { record, .. })) if record.id == accepted[1].0 => {}
        other => panic!("the retry attaches to its first execution: {other:?}"),
    }
    assert_eq!(
        a.batches_committed() - before,
        2,
        "the writes queued behind the held head were committed as one batch"
    );

    // What was refused changed nothing; what was written is in the one chain.
    for i in [4, 5] {
        let (rec, _) = a.get(accepted[i].0).await.unwrap().unwrap();
        assert_eq!(rec.state(), ExecState::Accepted);
        assert_eq!(a.events_of(accepted[i].0).await.unwrap().len(), 1);
    }
    for (id, _) in &accepted[..4] {
        let (rec, _) = a.get(*id).await.unwrap().unwrap();
        assert_eq!(rec.state(), ExecState::Authorized);
    }
    assert_eq!(a.events_of(accepted[1].0).await.unwrap().len(), 3);
    let report = a.verify(None).await.unwrap();
    assert!(report.is_ok(), "{:?}", report.broken);
    assert_eq!(
        report.events,
        6 + 4 + 2,
        "refused writes take no sequence number"
    );
}

#[tokio::test]
async fn an_operators_decision_goes_through_any_daemon_and_nothing_else_does() {
    let url = TestPostgres::shared().create_database("operator");
    let (a, b) = (ledger(&url).await, ledger(&url).await);
    let at = Timestamp::from_millis(T0);
    a.heartbeat("a", at).await.unwrap();
    b.heartbeat("b", at).await.unwrap();
    let not_a = waymark_ledger_pg::Lease {
        owner: "b".into(),
        epoch: 0,
    };
    let mut accepted = Vec::new();
    for arg in ["approve", "deny", "cancel", "policy"] {
        let (new, call) = intent(arg, at);
        let Intake::New { record, lease } = a.accept_or_attach(new, &call, "a").await.unwrap()
        else {
            panic!("a new intent")
        };
        accepted.push((record.id, lease));
    }
    let [(approve, la), (deny, ld), (cancel, _), (policy, _)] = accepted.try_into().unwrap();
    for (id, lease) in [(approve, &la), (deny, &ld)] {
        a.transition(id, lease, Transition::RequestApproval, at)
            .await
            .unwrap();
    }
    let by = || "operator".to_string();

    // B, which drives none of them, records the operator's answers.
    let approved = b
        .transition(approve, &not_a, Transition::Authorize { by: by() }, at)
        .await
        .unwrap();
    assert_eq!(approved.state(), ExecState::Authorized);
    let denied = b
        .transition(
            deny,
            &not_a,
            Transition::Deny {
                by: by(),
                reason: "no".into(),
            },
            at,
        )
        .await
        .unwrap();
    assert_eq!(denied.state(), ExecState::Denied);
    b.transition(
        cancel,
        &not_a,
        Transition::CancelBeforeDispatch { by: by() },
        at,
    )
    .await
    .unwrap();

    // Nothing that drives an execution: not the policy's authorization of an execution that
    // awaits no operator, not a dispatch of the one B approved.
    for (id, t) in [
        (
            policy,
            Transition::Authorize {
                by: "policy".into(),
            },
        ),
        (approve, Transition::Dispatch { attempt: 1 }),
    ] {
        match b.transition(id, &not_a, t, at).await {
            Err(PgLedgerError::Fenced { owner, .. }) => assert_eq!(owner, "a"),
            other => panic!("B drives none of them, got {other:?}"),
        }
    }
    // A goes on with what B approved, and cannot dispatch what B cancelled.
    a.transition(approve, &la, Transition::Dispatch { attempt: 1 }, at)
        .await
        .unwrap();
    assert!(matches!(
        a.transition(cancel, &la, Transition::Dispatch { attempt: 1 }, at)
            .await,
        Err(PgLedgerError::Illegal { .. })
    ));
}
