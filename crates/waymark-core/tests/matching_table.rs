//! The matching rule, as a table: each row is a prior execution and an incoming call, and the
//! decision the rule must return.

use std::time::Duration;

use waymark_core::{
    decide, Actor, AttachAction, ExecState, ExecutionId, IncomingCall, IntentScope, Lifecycle,
    MatchDecision, PriorExecution, ReplayContract, ReplayPolicy, Timestamp,
};

const T0: u64 = 1_800_000_000_000;
const MIN: u64 = 60_000;

fn prior(state: ExecState, delivered: bool, age_min: u64) -> PriorExecution {
    let accepted_at = Timestamp::from_millis(T0 - age_min * MIN);
    PriorExecution {
        id: ExecutionId::from_parts(accepted_at, 1),
        lifecycle: Lifecycle {
            state,
            result_observed: state.has_result(),
            result_delivered: delivered,
        },
        actor: Actor("uid:1000:/usr/bin/agent".into()),
        scope: IntentScope::ToolWindow,
        accepted_at,
        finished_at: state.has_result().then_some(accepted_at),
    }
}

fn call(contract: ReplayContract) -> IncomingCall {
    IncomingCall {
        actor: Actor("uid:1000:/usr/bin/agent".into()),
        scope: IntentScope::ToolWindow,
        policy: ReplayPolicy::new(contract, Duration::from_secs(10 * 60)),
        now: Timestamp::from_millis(T0),
    }
}

fn attach(p: &PriorExecution, action: AttachAction) -> MatchDecision {
    MatchDecision::Attach {
        execution: p.id,
        action,
    }
}

use AttachAction::*;
use ExecState::*;
use ReplayContract::*;

#[test]
fn retry_while_awaiting_approval_returns_the_pending_approval() {
    let p = prior(AwaitingApproval, false, 1);
    assert_eq!(
        decide(std::slice::from_ref(&p), &call(Irreversible)),
        attach(&p, PendingApproval)
    );
}

#[test]
fn retry_after_denial_inside_the_window_returns_the_denial() {
    let p = prior(Denied, true, 2);
    assert_eq!(
        decide(std::slice::from_ref(&p), &call(StatusCheck)),
        attach(&p, ReturnDenial)
    );
}

#[test]
fn accepted_or_authorized_not_dispatched_continues() {
    for s in [Accepted, Authorized] {
        let p = prior(s, false, 1);
        assert_eq!(
            decide(std::slice::from_ref(&p), &call(Idempotent)),
            attach(&p, Continue),
            "{s}"
        );
    }
}

#[test]
fn possibly_on_host_asks_the_host_marker() {
    for s in [Dispatched, Running, Unknown] {
        for c in [Idempotent, StatusCheck, Irreversible] {
            let p = prior(s, false, 1);
            assert_eq!(
                decide(std::slice::from_ref(&p), &call(c)),
                attach(&p, AskHostMarker),
                "{s} {c:?}"
            );
        }
    }
}

#[test]
fn completed_not_delivered_returns_the_stored_result() {
    for s in [Completed, TimedOut, Cancelled, Failed, Reviewed] {
        let p = prior(s, false, 3);
        assert_eq!(
            decide(std::slice::from_ref(&p), &call(StatusCheck)),
            attach(&p, ReturnStoredResult),
            "{s}"
        );
    }
}

#[test]
fn irreversible_interrupted_needs_human_review() {
    let p = prior(Interrupted, false, 1);
    assert_eq!(
        decide(std::slice::from_ref(&p), &call(Irreversible)),
        attach(&p, NeedsReview)
    );
    assert_eq!(
        decide(std::slice::from_ref(&p), &call(StatusCheck)),
        attach(&p, NeedsReview)
    );
    assert_eq!(
        decide(&[p], &call(Idempotent)),
        MatchDecision::New,
        "a harmless repeat may run"
    );
}

#[test]
fn another_actor_starts_a_new_execution() {
    let mut p = prior(Running, false, 1);
    p.actor = Actor("uid:1001:/usr/bin/other".into());
    assert_eq!(decide(&[p], &call(Irreversible)), MatchDecision::New);
}

#[test]
fn another_scope_starts_a_new_execution() {
    let mut p = prior(Running, false, 1);
    p.scope = IntentScope::Key("deploy-42".into());
    assert_eq!(
        decide(std::slice::from_ref(&p), &call(Irreversible)),
        MatchDecision::New
    );
    let mut c = call(Irreversible);
    c.scope = IntentScope::Key("deploy-42".into());
    assert_eq!(
        decide(std::slice::from_ref(&p), &c),
        attach(&p, AskHostMarker),
        "same key attaches"
    );
}

#[test]
fn outside_the_retry_window_starts_a_new_execution() {
    for s in [AwaitingApproval, Denied, Running, Unknown, Completed] {
        let p = prior(s, false, 11);
        assert_eq!(decide(&[p], &call(StatusCheck)), MatchDecision::New, "{s}");
    }
}

#[test]
fn read_only_is_always_new() {
    for s in ExecState::ALL {
        let p = prior(s, false, 0);
        assert_eq!(decide(&[p], &call(ReadOnly)), MatchDecision::New, "{s}");
    }
}

#[test]
fn delivered_results_replay_only_inside_the_dedup_window() {
    let p = prior(Completed, true, 3);
    assert_eq!(
        decide(std::slice::from_ref(&p), &call(Idempotent)),
        MatchDecision::New
    );
    let mut c = call(Idempotent);
    c.policy.dedup_window = Some(Duration::from_secs(5 * 60));
    assert_eq!(
        decide(std::slice::from_ref(&p), &c),
        attach(&p, ReturnStoredResult)
    );
    // The dedup window outlives the retry window, like an idempotency-key cache.
    c.policy.dedup_window = Some(Duration::from_secs(60 * 60));
    let old = prior(Completed, true, 30);
    assert_eq!(
        decide(std::slice::from_ref(&old), &c),
        attach(&old, ReturnStoredResult)
    );
    c.policy.dedup_window = Some(Duration::from_secs(60));
    assert_eq!(decide(&[p], &c), MatchDecision::New);
}

#[test]
fn expired_and_delivered_failures_start_anew() {
    assert_eq!(
        decide(&[prior(Expired, false, 1)], &call(StatusCheck)),
        MatchDecision::New
    );
    assert_eq!(
        decide(&[prior(Failed, true, 1)], &call(StatusCheck)),
        MatchDecision::New
    );
}

#[test]
fn the_newest_matching_prior_decides() {
    let old = prior(Completed, true, 5);
    let newer = prior(Running, false, 1);
    let decision = decide(&[old, newer.clone()], &call(StatusCheck));
    assert_eq!(decision, attach(&newer, AskHostMarker));
}

#[test]
fn no_prior_is_new() {
    assert_eq!(decide(&[], &call(Irreversible)), MatchDecision::New);
}
