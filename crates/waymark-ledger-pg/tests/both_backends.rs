//! The ledger's behaviour through `LedgerApi`, the same tests on both backends: sled (a
//! temporary directory) and PostgreSQL (a database of the test kit's cluster). Each test is
//! `async fn NAME(kind)`; `both!` makes `NAME::sled` and `NAME::postgres` of it.

#[path = "../../waymark-ledger/tests/common/mod.rs"]
mod common;
#[path = "common/backends.rs"]
#[macro_use]
mod backends;

use std::sync::Arc;
use std::time::Duration;

use backends::{Kind, Place};
use common::{exited, new_execution, now, request};
use waymark_core::{
    Actor, AttachAction, ExecState, ExecutionId, IncomingCall, Outcome, ReplayContract,
    ReplayPolicy, Timestamp, Transition,
};
use waymark_ledger::{
    CapturedOutput, ChainHead, ChainProblem, Durability, EventKind, ExecutionRecord, Intake,
    LedgerApi, LedgerError, ListQuery, StoredResult,
};

both!(
    lifecycle_is_recorded_with_one_event_per_transition,
    a_second_observers_started_is_not_recorded_again,
    illegal_transition_is_rejected_and_changes_nothing,
    transitions_in_one_write_apply_in_order_and_stop_at_the_first_refused,
    a_retry_attaches_and_another_intent_is_new,
    queries_filter_by_state_actor_host_and_time_with_pagination,
    runs_record_actor_transport_start_end_and_calls,
    settings_persist_across_a_reopen_and_are_audited,
    gc_removes_only_resolved_executions_and_the_chain_still_verifies,
    gc_goes_a_page_at_a_time_and_removes_the_runs_no_kept_execution_names,
    an_anchored_verify_walks_only_what_follows_its_head,
    a_result_is_stored_whole_up_to_the_cap,
    racing_writers_leave_one_verifiable_chain,
);

fn call_at(req: &waymark_core::ActionRequest, at: Timestamp) -> IncomingCall {
    IncomingCall {
        actor: req.actor.clone(),
        scope: req.scope.clone(),
        policy: ReplayPolicy::new(ReplayContract::StatusCheck, Duration::from_secs(600)),
        now: at,
    }
}

/// Accepts `req` on `host` at `at`, which must be a new intent.
async fn accept_req(
    ledger: &dyn LedgerApi,
    req: &waymark_core::ActionRequest,
    host: &str,
    at: Timestamp,
) -> ExecutionRecord {
    let new = new_execution(ledger, req, host, at);
    match ledger
        .accept_or_attach(new, &call_at(req, at), Durability::Flushed)
        .await
        .unwrap()
    {
        Intake::New(rec) => rec,
        other => panic!("a new intent attached: {other:?}"),
    }
}

/// Accepts `deploy ARG` on web1 at `at`.
async fn accept(ledger: &dyn LedgerApi, arg: &str, at: Timestamp) -> ExecutionRecord {
    accept_req(ledger, &request("deploy", arg, "pw"), "web1", at).await
}

/// Authorized, dispatched, running, completed with `deployed\n`; not delivered.
async fn walk_to_completion(ledger: &dyn LedgerApi, id: ExecutionId, at: Timestamp) {
    let d = Durability::Buffered;
    for t in [
        Transition::Authorize {
            by: "policy".into(),
        },
        Transition::Dispatch { attempt: 1 },
        Transition::Started { pid: Some(7) },
    ] {
        ledger.transition(id, t, at, d).await.unwrap();
    }
    let result = StoredResult {
        stdout: CapturedOutput::capture(b"deployed\n", 1024),
        stderr: CapturedOutput::capture(b"", 1024),
    };
    ledger
        .transition_with_result(id, exited(0), result, at, Durability::Flushed)
        .await
        .unwrap();
}

async fn lifecycle_is_recorded_with_one_event_per_transition(kind: Kind) {
    let place = Place::new(kind, "lifecycle");
    let ledger = place.open("a").await;
    let t = now();
    let rec = accept(ledger.as_ref(), "v1", t).await;
    let id = rec.id;
    assert_eq!(rec.state(), ExecState::Accepted);
    walk_to_completion(ledger.as_ref(), id, t).await;
    let rec = ledger.get(id).await.unwrap().unwrap();
    assert_eq!(rec.state(), ExecState::Completed);
    assert!(rec.lifecycle.result_observed && !rec.lifecycle.result_delivered);
    assert_eq!(
        rec.outcome,
        Some(Outcome::Exited {
            exit_code: Some(0),
            signal: None
        })
    );
    let result = ledger.result(id).await.unwrap().unwrap();
    assert_eq!(result.stdout.head, b"deployed\n");
    assert_eq!(result.stdout.total_bytes, 9);
    let names: Vec<String> = ledger
        .events_of(id)
        .await
        .unwrap()
        .iter()
        .map(|e| match &e.kind {
            EventKind::Accepted { .. } => "accepted".to_string(),
            EventKind::Transition { to, .. } => to.to_string(),
            other => format!("{other:?}"),
        })
        .collect();
    assert_eq!(
        names,
        [
            "accepted",
            "authorized",
            "dispatched",
            "running",
            "completed"
        ]
    );
    let rec = ledger
        .transition(id, Transition::Delivered, t, Durability::Flushed)
        .await
        .unwrap();
    assert!(rec.lifecycle.result_delivered);
    assert!(ledger.verify(None).await.unwrap().is_ok());
}

/// Two observers (the driver and a reconcile, or two daemons' status reads) each see the
/// command start: one `started → running` event, and the record is unchanged by the second.
async fn a_second_observers_started_is_not_recorded_again(kind: Kind) {
    let place = Place::new(kind, "started_twice");
    let ledger = place.open("a").await;
    let t = now();
    let id = accept(ledger.as_ref(), "v1", t).await.id;
    let d = Durability::Flushed;
    for tr in [
        Transition::Authorize {
            by: "policy".into(),
        },
        Transition::Dispatch { attempt: 1 },
        Transition::Started { pid: Some(7) },
    ] {
        ledger.transition(id, tr, t, d).await.unwrap();
    }
    let before = ledger.get(id).await.unwrap().unwrap();
    let again = ledger
        .transition(id, Transition::Started { pid: None }, t, d)
        .await
        .unwrap();
    assert_eq!(again, before, "a duplicate observation changes nothing");
    let running = ledger
        .events_of(id)
        .await
        .unwrap()
        .iter()
        .filter(|e| {
            matches!(
                &e.kind,
                EventKind::Transition {
                    to: ExecState::Running,
                    ..
                }
            )
        })
        .count();
    assert_eq!(running, 1, "one started → running event");
    assert!(ledger.verify(None).await.unwrap().is_ok());
}

async fn illegal_transition_is_rejected_and_changes_nothing(kind: Kind) {
    let place = Place::new(kind, "illegal");
    let ledger = place.open("a").await;
    let t = now();
    let id = accept(ledger.as_ref(), "v1", t).await.id;
    let head = ledger.head().await.unwrap();
    let err = ledger
        .transition(
            id,
            Transition::Dispatch { attempt: 1 },
            t,
            Durability::Flushed,
        )
        .await
        .unwrap_err();
    assert!(matches!(err, LedgerError::Illegal { .. }), "{err}");
    assert!(
        err.to_string()
            .contains("illegal transition `dispatch` from state `accepted`"),
        "{err}"
    );
    assert_eq!(ledger.head().await.unwrap(), head, "no event was appended");
    let rec = ledger.get(id).await.unwrap().unwrap();
    assert_eq!(rec.state(), ExecState::Accepted);
}

async fn transitions_in_one_write_apply_in_order_and_stop_at_the_first_refused(kind: Kind) {
    let place = Place::new(kind, "several");
    let ledger = place.open("a").await;
    let t = now();
    let id = accept(ledger.as_ref(), "v1", t).await.id;
    let by = || "policy".to_string();
    let rec = ledger
        .transitions(
            id,
            vec![
                Transition::Authorize { by: by() },
                Transition::Dispatch { attempt: 1 },
            ],
            t,
            Durability::Flushed,
        )
        .await
        .unwrap();
    assert_eq!(rec.state(), ExecState::Dispatched);
    let names: Vec<String> = ledger
        .events_of(id)
        .await
        .unwrap()
        .iter()
        .filter_map(|e| match &e.kind {
            EventKind::Transition { transition, .. } => Some(transition.name().to_string()),
            _ => None,
        })
        .collect();
    assert_eq!(names, ["authorize", "dispatch"], "one event each, in order");

    // Started is legal, a second authorization is not: the write ends with its error, and the
    // start before it stays, as it would written alone.
    let head = ledger.head().await.unwrap();
    let err = ledger
        .transitions(
            id,
            vec![
                Transition::Started { pid: None },
                Transition::Authorize { by: by() },
                Transition::Lost { reason: "x".into() },
            ],
            t,
            Durability::Flushed,
        )
        .await
        .unwrap_err();
    assert!(matches!(err, LedgerError::Illegal { .. }), "{err}");
    assert_eq!(
        ledger.head().await.unwrap().seq,
        head.seq + 1,
        "the start only"
    );
    assert_eq!(
        ledger.get(id).await.unwrap().unwrap().state(),
        ExecState::Running
    );
    assert!(ledger.verify(None).await.unwrap().broken.is_none());
}

async fn a_retry_attaches_and_another_intent_is_new(kind: Kind) {
    let place = Place::new(kind, "attach");
    let ledger = place.open("a").await;
    let t = now();
    let req = request("deploy", "v1", "pw");
    let first = accept_req(ledger.as_ref(), &req, "web1", t).await;
    let retry = new_execution(ledger.as_ref(), &req, "web1", t);
    let intake = ledger
        .accept_or_attach(retry, &call_at(&req, t), Durability::Flushed)
        .await
        .unwrap();
    let Intake::Attach { record, action } = intake else {
        panic!("a retry of an accepted execution must attach: {intake:?}");
    };
    assert_eq!(record.id, first.id);
    assert_eq!(action, AttachAction::Continue);
    let other = accept(ledger.as_ref(), "v2", t).await;
    assert_ne!(other.id, first.id);
    let by_fp = ledger.by_fingerprint(&first.fingerprint).await.unwrap();
    assert_eq!(by_fp.iter().map(|r| r.id).collect::<Vec<_>>(), [first.id]);
    let events = ledger.events_of(first.id).await.unwrap();
    assert!(matches!(
        events.last().unwrap().kind,
        EventKind::Attached { .. }
    ));
}

/// The ids `q` lists, following `next` from page to page.
async fn every_page(ledger: &dyn LedgerApi, mut q: ListQuery) -> Vec<ExecutionId> {
    let mut seen = Vec::new();
    loop {
        let page = ledger.list(&q).await.unwrap();
        seen.extend(page.items.iter().map(|r| r.id));
        match page.next {
            Some(n) => q.after = Some(n),
            None => return seen,
        }
    }
}

async fn queries_filter_by_state_actor_host_and_time_with_pagination(kind: Kind) {
    let place = Place::new(kind, "queries");
    let ledger = place.open("a").await;
    let ledger = ledger.as_ref();
    let base = now().as_millis();
    let mut all = Vec::new();
    for i in 0..25u64 {
        let t = Timestamp::from_millis(base + i * 1000);
        let host = if i % 2 == 0 { "web1" } else { "db1" };
        let mut req = request("deploy", &format!("v{i}"), "pw");
        if i % 5 == 0 {
            req.actor = Actor("uid:0:/usr/bin/waymark".into());
        }
        let id = accept_req(ledger, &req, host, t).await.id;
        if i % 3 == 0 {
            walk_to_completion(ledger, id, t).await;
        }
        all.push((id, i));
    }
    let seen = every_page(
        ledger,
        ListQuery {
            limit: 7,
            ..Default::default()
        },
    )
    .await;
    let mut expected: Vec<_> = all.iter().map(|a| a.0).collect();
    expected.reverse();
    assert_eq!(seen, expected, "newest first, 7 a page");
    let completed = every_page(
        ledger,
        ListQuery {
            state: Some(ExecState::Completed),
            limit: 3,
            oldest_first: true,
            ..Default::default()
        },
    )
    .await;
    let want: Vec<_> = all.iter().filter(|a| a.1 % 3 == 0).map(|a| a.0).collect();
    assert_eq!(completed, want, "oldest first, by state, paged");
    let q = ListQuery {
        host: Some("db1".into()),
        ..Default::default()
    };
    assert_eq!(ledger.list(&q).await.unwrap().items.len(), 12);
    let q = ListQuery {
        actor: Some(Actor("uid:0:/usr/bin/waymark".into())),
        ..Default::default()
    };
    assert_eq!(ledger.list(&q).await.unwrap().items.len(), 5);
    let q = ListQuery {
        since: Some(Timestamp::from_millis(base + 10_000)),
        until: Some(Timestamp::from_millis(base + 15_000)),
        ..Default::default()
    };
    assert_eq!(ledger.list(&q).await.unwrap().items.len(), 5, "10s..14s");
}

async fn runs_record_actor_transport_start_end_and_calls(kind: Kind) {
    let place = Place::new(kind, "runs");
    let ledger = place.open("a").await;
    let actor = Actor("uid:1000:/usr/bin/claude".into());
    let run = ledger
        .start_run(actor.clone(), "stdio", now(), Durability::Flushed)
        .await
        .unwrap();
    assert!(run.id.starts_with("run_"));
    ledger.count_call(&run.id).await.unwrap();
    ledger.count_call(&run.id).await.unwrap();
    ledger
        .end_run(&run.id, now(), Durability::Flushed)
        .await
        .unwrap();
    let runs = ledger.runs(10).await.unwrap();
    assert_eq!(runs.len(), 1);
    assert_eq!(runs[0].actor, actor);
    assert_eq!(runs[0].transport, "stdio");
    assert_eq!(runs[0].calls, 2);
    assert!(runs[0].ended_at.is_some());
    assert!(ledger.verify(None).await.unwrap().is_ok());
}

async fn settings_persist_across_a_reopen_and_are_audited(kind: Kind) {
    let place = Place::new(kind, "settings");
    {
        let ledger = place.open("a").await;
        assert_eq!(ledger.setting("locked").await.unwrap(), None);
        ledger
            .set_setting(
                "locked",
                serde_json::json!(true),
                "uid:0",
                now(),
                Durability::Flushed,
            )
            .await
            .unwrap();
    }
    let ledger = place.open("a").await;
    assert_eq!(
        ledger.setting("locked").await.unwrap(),
        Some(serde_json::json!(true))
    );
    let events = ledger.events(1, 10).await.unwrap();
    assert!(matches!(&events[0].kind, EventKind::Note { name, .. } if name == "setting"));
    assert!(ledger.verify(None).await.unwrap().is_ok());
}

async fn gc_removes_only_resolved_executions_and_the_chain_still_verifies(kind: Kind) {
    let place = Place::new(kind, "gc");
    let ledger = place.open("a").await;
    let ledger = ledger.as_ref();
    let old = Timestamp::from_millis(now().as_millis() - 3_600_000);
    let done = accept(ledger, "done", old).await.id;
    walk_to_completion(ledger, done, old).await;
    ledger
        .transition(done, Transition::Delivered, old, Durability::Flushed)
        .await
        .unwrap();
    let undelivered = accept(ledger, "undelivered", old).await.id;
    walk_to_completion(ledger, undelivered, old).await;
    let unknown = accept(ledger, "unknown", old).await.id;
    for t in [
        Transition::Authorize { by: "p".into() },
        Transition::Dispatch { attempt: 1 },
        Transition::Lost {
            reason: "cut".into(),
        },
    ] {
        ledger
            .transition(unknown, t, old, Durability::Flushed)
            .await
            .unwrap();
    }
    // A plan removes nothing and counts what the run then removes.
    let plan = ledger.gc_plan(now()).await.unwrap();
    assert!(
        ledger.get(done).await.unwrap().is_some(),
        "a plan removes nothing"
    );
    let report = ledger.gc(now(), now()).await.unwrap();
    assert_eq!(report.removed_executions, 1, "{report:?}");
    assert_eq!(
        (plan.removed_executions, plan.kept_unresolved),
        (report.removed_executions, report.kept_unresolved),
        "{plan:?} against {report:?}"
    );
    assert!(ledger.get(done).await.unwrap().is_none());
    assert!(ledger.result(done).await.unwrap().is_none());
    for kept in [undelivered, unknown] {
        assert!(ledger.get(kept).await.unwrap().is_some(), "{kept} kept");
    }
    assert!(ledger.verify(None).await.unwrap().is_ok());
}

/// Issue 37: a gc removes a page of executions per transaction (never the whole ledger in
/// one), and the agent runs whose executions are all gone; a run a kept execution names (as
/// its own or an attached caller's), a run with no end and a recent run stay, and each is
/// still found by its id.
async fn gc_goes_a_page_at_a_time_and_removes_the_runs_no_kept_execution_names(kind: Kind) {
    let place = Place::new(kind, "gcpages");
    let ledger = place.open("a").await;
    let ledger = ledger.as_ref();
    let old = Timestamp::from_millis(now().as_millis() - 3_600_000);
    let actor = Actor("uid:1000:/usr/bin/agent".into());
    let d = Durability::Flushed;
    let run_at = |at: Timestamp, ended: bool| {
        let actor = actor.clone();
        async move {
            let run = ledger.start_run(actor, "stdio", at, d).await.unwrap();
            if ended {
                ledger.end_run(&run.id, at, d).await.unwrap();
            }
            run.id
        }
    };
    let gone = run_at(old, true).await;
    let own = run_at(old, true).await;
    let attached = run_at(old, true).await;
    let open = run_at(old, false).await;
    let n = waymark_ledger::GC_PAGE + 20;
    for i in 0..n {
        let req = request("deploy", &format!("old{i}"), "pw");
        let mut new = new_execution(ledger, &req, "web1", old);
        new.run = Some(gone.clone());
        let id = new.id;
        ledger
            .accept_or_attach(new, &call_at(&req, old), Durability::Buffered)
            .await
            .unwrap();
        walk_to_completion(ledger, id, old).await;
        ledger
            .transition(id, Transition::Delivered, old, Durability::Buffered)
            .await
            .unwrap();
    }
    // Kept (accepted, never sent): its own run and the run of a retry that attached to it.
    let req = request("deploy", "kept", "pw");
    let mut new = new_execution(ledger, &req, "web1", old);
    new.run = Some(own.clone());
    let kept = new.id;
    ledger
        .accept_or_attach(new, &call_at(&req, old), d)
        .await
        .unwrap();
    let mut retry = new_execution(ledger, &req, "web1", old);
    retry.run = Some(attached.clone());
    let intake = ledger
        .accept_or_attach(retry, &call_at(&req, old), d)
        .await
        .unwrap();
    assert!(matches!(intake, Intake::Attach { .. }), "{intake:?}");
    // Last: ids are minted in order, and this one's is now.
    let recent = run_at(now(), true).await;

    let cutoff = Timestamp::from_millis(now().as_millis() - 60_000);
    let plan = ledger.gc_plan(cutoff).await.unwrap();
    let report = ledger.gc(cutoff, now()).await.unwrap();
    assert_eq!(
        (
            plan.removed_executions,
            plan.removed_runs,
            plan.kept_unresolved
        ),
        (
            report.removed_executions,
            report.removed_runs,
            report.kept_unresolved
        ),
        "the plan says what the gc then did: {plan:?} against {report:?}"
    );
    assert_eq!(report.removed_executions, n as u64, "{report:?}");
    assert_eq!(report.removed_runs, 1, "{report:?}");
    assert_eq!(report.kept_unresolved, 1, "{report:?}");
    assert!(
        report.transactions >= 3,
        "{n} executions and a run in fewer than 3 transactions: {report:?}"
    );
    assert!(ledger.run(&gone).await.unwrap().is_none(), "{gone} stays");
    for run in [&own, &attached, &open, &recent] {
        assert!(
            ledger.run(run).await.unwrap().is_some(),
            "{run} was removed"
        );
    }
    assert!(ledger.get(kept).await.unwrap().is_some());
    assert!(ledger.verify(None).await.unwrap().is_ok());
    // Nothing left to remove: a second gc removes nothing, in no page.
    let again = ledger.gc(cutoff, now()).await.unwrap();
    assert_eq!((again.removed_executions, again.removed_runs), (0, 0));
    assert!(ledger.verify(None).await.unwrap().is_ok());
}

/// Issue 37: `audit verify --since SEQ:HASH` walks only the events after a head kept earlier;
/// a head that is not this chain's event at its position, or lies past its end, is refused,
/// never "verified".
async fn an_anchored_verify_walks_only_what_follows_its_head(kind: Kind) {
    let place = Place::new(kind, "since");
    let ledger = place.open("a").await;
    let ledger = ledger.as_ref();
    let t = now();
    for i in 0..3 {
        accept(ledger, &format!("a{i}"), t).await;
    }
    let anchor = ledger.head().await.unwrap();
    for i in 0..2 {
        accept(ledger, &format!("b{i}"), t).await;
    }
    let head = ledger.head().await.unwrap();
    let r = ledger
        .verify_since(Some(&anchor), None, &|_, _| {})
        .await
        .unwrap();
    assert!(r.is_ok(), "{:?}", r.broken);
    assert_eq!((r.events, &r.head), (head.seq - anchor.seq, &head));
    let r = ledger
        .verify_since(Some(&anchor), Some(&head), &|_, _| {})
        .await
        .unwrap();
    assert!(r.is_ok(), "{:?}", r.broken);
    let whole = ledger
        .verify_since(Some(&ChainHead::genesis()), None, &|_, _| {})
        .await
        .unwrap();
    assert_eq!((whole.events, whole.is_ok()), (head.seq, true));

    let forged = ChainHead {
        seq: anchor.seq,
        hash: "f".repeat(64),
    };
    let r = ledger
        .verify_since(Some(&forged), None, &|_, _| {})
        .await
        .unwrap();
    assert_eq!(
        r.broken.map(|b| (b.seq, b.problem)),
        Some((anchor.seq, ChainProblem::DivergedFromHead))
    );
    let ahead = ChainHead {
        seq: head.seq + 5,
        hash: head.hash.clone(),
    };
    let r = ledger
        .verify_since(Some(&ahead), None, &|_, _| {})
        .await
        .unwrap();
    assert_eq!(
        r.broken.map(|b| b.problem),
        Some(ChainProblem::Truncated {
            last: head.seq,
            head: head.seq + 5
        })
    );
}

async fn a_result_is_stored_whole_up_to_the_cap(kind: Kind) {
    let place = Place::new(kind, "result");
    let ledger = place.open("a").await;
    let t = now();
    let id = accept(ledger.as_ref(), "big", t).await.id;
    for s in [
        Transition::Authorize { by: "p".into() },
        Transition::Dispatch { attempt: 1 },
    ] {
        ledger
            .transition(id, s, t, Durability::Flushed)
            .await
            .unwrap();
    }
    let big = vec![b'x'; 200 * 1024];
    let result = StoredResult {
        stdout: CapturedOutput::capture(&big, big.len()),
        stderr: CapturedOutput::capture(b"\x00\xffbinary", 1024),
    };
    ledger
        .transition_with_result(id, exited(0), result, t, Durability::Flushed)
        .await
        .unwrap();
    let stored = ledger.result(id).await.unwrap().unwrap();
    assert_eq!(stored.stdout.head.len(), 64 * 1024, "capped at the default");
    assert_eq!(stored.stdout.total_bytes, big.len() as u64);
    assert!(stored.stdout.truncated());
    assert_eq!(stored.stderr.head, b"\x00\xffbinary");
}

async fn racing_writers_leave_one_verifiable_chain(kind: Kind) {
    let place = Place::new(kind, "race");
    let ledger = place.open("a").await;
    let tasks: Vec<_> = (0..8)
        .map(|n| {
            let ledger: Arc<dyn LedgerApi> = ledger.clone();
            tokio::spawn(async move {
                for i in 0..10 {
                    let id = accept(ledger.as_ref(), &format!("{n}-{i}"), now()).await.id;
                    walk_to_completion(ledger.as_ref(), id, now()).await;
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
    let head = ledger.head().await.unwrap();
    assert_eq!(head.seq, 8 * 10 * 5, "five events per execution");
    let q = ListQuery {
        state: Some(ExecState::Completed),
        limit: 1000,
        ..Default::default()
    };
    assert_eq!(ledger.list(&q).await.unwrap().items.len(), 80);
    let report = ledger.verify(None).await.unwrap();
    assert!(report.is_ok(), "{:?}", report.broken);
    assert_eq!(report.events, head.seq);
}
