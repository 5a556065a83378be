//! The matching rule: does an incoming call start a new execution or attach to a prior one?
//!
//! A call with the same fingerprint, actor and scope as an execution that is still unresolved,
//! or denied, within the tool's retry window attaches to it. What attaching does depends on the
//! prior state; see [`AttachAction`].

use serde::{Deserialize, Serialize};

use crate::{
    Actor, ExecState, ExecutionId, IntentScope, Lifecycle, ReplayContract, ReplayPolicy, Timestamp,
};

/// What the ledger knows of an earlier execution with the same fingerprint.
#[derive(Clone, Debug, PartialEq)]
pub struct PriorExecution {
    pub id: ExecutionId,
    pub lifecycle: Lifecycle,
    pub actor: Actor,
    pub scope: IntentScope,
    pub accepted_at: Timestamp,
    /// When its outcome was observed, if it was.
    pub finished_at: Option<Timestamp>,
}

/// The call being decided.
#[derive(Clone, Debug, PartialEq)]
pub struct IncomingCall {
    pub actor: Actor,
    pub scope: IntentScope,
    pub policy: ReplayPolicy,
    pub now: Timestamp,
}

/// What to do with an incoming call.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum MatchDecision {
    /// A new intent: mint a new execution id.
    New,
    /// A retry: do `action` with the existing execution.
    Attach {
        execution: ExecutionId,
        action: AttachAction,
    },
}

/// What attaching to a prior execution does.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AttachAction {
    /// Return the pending approval with the original record; never a second approval request.
    PendingApproval,
    /// Return the stored denial.
    ReturnDenial,
    /// Accepted or authorized but not dispatched: carry on with the same id.
    Continue,
    /// It may be on the host: ask the marker, then report (or wait on) what it says.
    AskHostMarker,
    /// The outcome is stored: return it (and record the delivery).
    ReturnStoredResult,
    /// An irreversible action with an unprovable outcome: a human must review it.
    NeedsReview,
}

impl AttachAction {
    /// Every action, in declaration order.
    pub const ALL: [AttachAction; 6] = [
        AttachAction::PendingApproval,
        AttachAction::ReturnDenial,
        AttachAction::Continue,
        AttachAction::AskHostMarker,
        AttachAction::ReturnStoredResult,
        AttachAction::NeedsReview,
    ];
}

/// Decides an incoming call against prior executions with the same fingerprint, newest first.
///
/// Only the newest prior of the same actor and scope within the retry window counts: it is the
/// one a retry can be retrying.
pub fn decide(priors: &[PriorExecution], call: &IncomingCall) -> MatchDecision {
    let policy = call.policy;
    if policy.contract == ReplayContract::ReadOnly {
        return MatchDecision::New;
    }
    let newest = priors
        .iter()
        .filter(|p| p.actor == call.actor && p.scope == call.scope)
        .max_by_key(|p| p.id);
    let Some(prior) = newest else {
        return MatchDecision::New;
    };
    if call.now.since(prior.accepted_at) > policy.retry_window && !in_dedup_window(prior, call) {
        return MatchDecision::New;
    }
    let attach = |action| MatchDecision::Attach {
        execution: prior.id,
        action,
    };
    let l = prior.lifecycle;
    match l.state {
        ExecState::AwaitingApproval => attach(AttachAction::PendingApproval),
        ExecState::Denied => attach(AttachAction::ReturnDenial),
        ExecState::Accepted | ExecState::Authorized => attach(AttachAction::Continue),
        ExecState::Dispatched | ExecState::Running | ExecState::Unknown => {
            attach(AttachAction::AskHostMarker)
        }
        ExecState::Interrupted => match policy.contract {
            ReplayContract::Idempotent => MatchDecision::New,
            _ => attach(AttachAction::NeedsReview),
        },
        ExecState::Expired => MatchDecision::New,
        // Proven never started: a new attempt cannot be a second run.
        ExecState::Failed if l.result_delivered => MatchDecision::New,
        ExecState::Completed
        | ExecState::Failed
        | ExecState::TimedOut
        | ExecState::Cancelled
        | ExecState::Reviewed => {
            if !l.result_delivered || in_dedup_window(prior, call) {
                attach(AttachAction::ReturnStoredResult)
            } else {
                MatchDecision::New
            }
        }
    }
}

fn in_dedup_window(prior: &PriorExecution, call: &IncomingCall) -> bool {
    match (call.policy.dedup_window, prior.finished_at) {
        (Some(window), Some(finished)) => {
            prior.lifecycle.result_delivered && call.now.since(finished) <= window
        }
        _ => false,
    }
}
