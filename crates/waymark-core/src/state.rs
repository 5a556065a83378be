//! The lifecycle of an execution: one state type, one transition function.
//!
//! ```text
//! accepted ─▶ awaiting_approval ─▶ authorized ─▶ dispatched ─▶ running ─▶ completed
//!    │              │                  │             │  ▲          │      timed_out
//!    └──────────────┴─▶ denied         │             │  └─ unknown ┤      cancelled
//!    └──────────────┴──────────────────┴─▶ expired   ├─▶ failed    └─▶ interrupted ─▶ reviewed
//! ```
//!
//! "Result observed" (Waymark saw how it ended) and "result delivered" (the caller has it) are
//! separate facts on [`Lifecycle`], so `completed, result not delivered` can be read by a human.

use std::fmt;

use serde::{Deserialize, Serialize};

/// Where an execution stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ExecState {
    /// Recorded and given an id; nothing decided yet.
    Accepted,
    /// Waiting for an operator's approval.
    AwaitingApproval,
    /// Allowed to run; not yet sent.
    Authorized,
    /// Refused by policy or by an operator.
    Denied,
    /// Never authorized or dispatched within its window.
    Expired,
    /// Recorded as about to be sent to the host: from here on it may have started.
    Dispatched,
    /// The host reported it started.
    Running,
    /// The host recorded how it ended (an exit code or a signal).
    Completed,
    /// Proven not to have started (the request never left, or the host refused to launch it).
    Failed,
    /// Waymark cannot prove whether the host started it.
    Unknown,
    /// Started, then the process vanished with no exit record (a reboot, say).
    Interrupted,
    /// Killed on the host when its timeout ran out.
    TimedOut,
    /// Cancelled on request (before dispatch, or its process group killed on the host).
    Cancelled,
    /// A human resolved an unknown or interrupted execution.
    Reviewed,
}

impl ExecState {
    /// Every state, in lifecycle order.
    pub const ALL: [ExecState; 14] = [
        ExecState::Accepted,
        ExecState::AwaitingApproval,
        ExecState::Authorized,
        ExecState::Denied,
        ExecState::Expired,
        ExecState::Dispatched,
        ExecState::Running,
        ExecState::Completed,
        ExecState::Failed,
        ExecState::Unknown,
        ExecState::Interrupted,
        ExecState::TimedOut,
        ExecState::Cancelled,
        ExecState::Reviewed,
    ];

    /// The snake_case name used in the ledger, the CLI and MCP results.
    pub fn as_str(self) -> &'static str {
        match self {
            ExecState::Accepted => "accepted",
            ExecState::AwaitingApproval => "awaiting_approval",
            ExecState::Authorized => "authorized",
            ExecState::Denied => "denied",
            ExecState::Expired => "expired",
            ExecState::Dispatched => "dispatched",
            ExecState::Running => "running",
            ExecState::Completed => "completed",
            ExecState::Failed => "failed",
            ExecState::Unknown => "unknown",
            ExecState::Interrupted => "interrupted",
            ExecState::TimedOut => "timed_out",
            ExecState::Cancelled => "cancelled",
            ExecState::Reviewed => "reviewed",
        }
    }

    /// Parses a name produced by [`ExecState::as_str`].
    pub fn parse(s: &str) -> Option<ExecState> {
        ExecState::ALL.into_iter().find(|st| st.as_str() == s)
    }

    /// A final state: nothing more will happen on the host (a review may still follow
    /// `Interrupted`, which is why it is not final).
    pub fn is_final(self) -> bool {
        matches!(
            self,
            ExecState::Denied
                | ExecState::Expired
                | ExecState::Completed
                | ExecState::Failed
                | ExecState::TimedOut
                | ExecState::Cancelled
                | ExecState::Reviewed
        )
    }

    /// The host may have started it and Waymark has not seen how it ended.
    pub fn may_be_on_host(self) -> bool {
        matches!(
            self,
            ExecState::Dispatched | ExecState::Running | ExecState::Unknown
        )
    }

    /// A state whose outcome can be handed to the caller as a result.
    pub fn has_result(self) -> bool {
        matches!(
            self,
            ExecState::Completed
                | ExecState::Failed
                | ExecState::TimedOut
                | ExecState::Cancelled
                | ExecState::Denied
                | ExecState::Expired
                | ExecState::Interrupted
                | ExecState::Reviewed
        )
    }
}

impl fmt::Display for ExecState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// How an execution ended on the host, as its marker recorded it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Outcome {
    /// Exited by itself: an exit code, or the signal that killed it.
    Exited {
        exit_code: Option<i32>,
        signal: Option<i32>,
    },
    /// Killed by the host-side timeout.
    TimedOut,
    /// Killed by a cancel request.
    Cancelled,
    /// An HTTP target answered: which request answered, with what status code, and whether
    /// the operation succeeded as that answer tells it.
    Answered {
        by: AnsweredBy,
        /// The status code of the answer that settled it (a status request's own code when
        /// `by` is [`AnsweredBy::StatusRequest`]).
        status: u16,
        /// `None`: the answer does not say whether the operation succeeded (a status answer
        /// the tool says nothing about how to read): NOT PROVEN, never taken for a success.
        succeeded: Option<bool>,
        /// What the status answer reported, as read by the tool's rule (`status 402`,
        /// `outcome "declined"`), or why it could not be read.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        reported: Option<String>,
    },
}

/// Which request's answer settled an HTTP execution.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AnsweredBy {
    /// The request itself, on its first send.
    Request,
    /// A re-send of the same execution under the same idempotency key (the target answers
    /// with the first request's result; it did not run it again).
    Resend,
    /// The tool's status request, asked after the request's own answer was lost.
    StatusRequest,
}

impl AnsweredBy {
    /// In words: "the request", "a re-send under the same idempotency key", "the status request".
    pub fn words(self) -> &'static str {
        match self {
            AnsweredBy::Request => "the request",
            AnsweredBy::Resend => "a re-send under the same idempotency key",
            AnsweredBy::StatusRequest => "the status request",
        }
    }
}

/// A human's verdict on an execution whose outcome Waymark could not prove.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ReviewVerdict {
    Ran,
    DidNotRun,
}

/// Something that happened to an execution. Each is written to the ledger as an event.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum Transition {
    /// Policy asks an operator.
    RequestApproval,
    /// Policy or an operator allows it.
    Authorize { by: String },
    /// Policy or an operator refuses it.
    Deny { by: String, reason: String },
    /// Its window passed before it was authorized or dispatched.
    Expire,
    /// About to send the request to the host. Written durably before the first byte leaves.
    Dispatch { attempt: u32 },
    /// The host reported the process started.
    Started { pid: Option<u32> },
    /// The host recorded how it ended.
    Finished { outcome: Outcome },
    /// Proven not started: the request never left, or the host refused to launch it.
    NotStarted { reason: String },
    /// The connection was lost after the request may have left.
    Lost { reason: String },
    /// The host's marker says started, process gone, no exit record.
    Interrupted,
    /// Cancelled before it was dispatched.
    CancelBeforeDispatch { by: String },
    /// The caller has the result (the transport accepted the write).
    Delivered,
    /// A human resolved an unknown or interrupted execution.
    Review {
        verdict: ReviewVerdict,
        by: String,
        note: String,
    },
}

impl Transition {
    /// The snake_case name of this transition.
    pub fn name(&self) -> &'static str {
        match self {
            Transition::RequestApproval => "request_approval",
            Transition::Authorize { .. } => "authorize",
            Transition::Deny { .. } => "deny",
            Transition::Expire => "expire",
            Transition::Dispatch { .. } => "dispatch",
            Transition::Started { .. } => "started",
            Transition::Finished { .. } => "finished",
            Transition::NotStarted { .. } => "not_started",
            Transition::Lost { .. } => "lost",
            Transition::Interrupted => "interrupted",
            Transition::CancelBeforeDispatch { .. } => "cancel_before_dispatch",
            Transition::Delivered => "delivered",
            Transition::Review { .. } => "review",
        }
    }
}

/// The state of an execution plus the two facts about its result.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Lifecycle {
    pub state: ExecState,
    /// Waymark saw how it ended (or proved it never started).
    pub result_observed: bool,
    /// The caller has the result.
    pub result_delivered: bool,
}

/// A transition that the lifecycle does not allow from the current state.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("illegal transition `{transition}` from state `{from}`")]
pub struct IllegalTransition {
    pub from: ExecState,
    pub transition: &'static str,
}

impl Lifecycle {
    /// A newly accepted execution.
    pub const fn accepted() -> Self {
        Lifecycle {
            state: ExecState::Accepted,
            result_observed: false,
            result_delivered: false,
        }
    }

    /// Unresolved in the sense of the matching rule: a retry of the same intent attaches to it.
    pub fn is_unresolved(&self) -> bool {
        match self.state {
            ExecState::Accepted
            | ExecState::AwaitingApproval
            | ExecState::Authorized
            | ExecState::Dispatched
            | ExecState::Running
            | ExecState::Unknown => true,
            s => s.has_result() && !self.result_delivered,
        }
    }

    /// Something still needs a machine or a human to settle it: garbage collection keeps it.
    pub fn needs_attention(&self) -> bool {
        self.is_unresolved() || self.state == ExecState::Interrupted
    }

    /// The one transition function. Returns the new lifecycle or why the move is illegal.
    pub fn apply(&self, t: &Transition) -> Result<Lifecycle, IllegalTransition> {
        use ExecState::*;
        let illegal = || IllegalTransition {
            from: self.state,
            transition: t.name(),
        };
        let to = |state: ExecState, observed: bool| Lifecycle {
            state,
            result_observed: self.result_observed || observed,
            result_delivered: self.result_delivered,
        };
        let next = match (self.state, t) {
            (Accepted, Transition::RequestApproval) => to(AwaitingApproval, false),
            (Accepted | AwaitingApproval, Transition::Authorize { .. }) => to(Authorized, false),
            (Accepted | AwaitingApproval, Transition::Deny { .. }) => to(Denied, true),
            (Accepted | AwaitingApproval | Authorized, Transition::Expire) => to(Expired, true),
            (Accepted | AwaitingApproval | Authorized, Transition::CancelBeforeDispatch { .. }) => {
                to(Cancelled, true)
            }
            // Re-dispatching with the same id (a resume after a drop or a restart) is safe:
            // the host marker refuses a second start.
            (Authorized | Dispatched | Unknown, Transition::Dispatch { .. }) => {
                to(Dispatched, false)
            }
            (Dispatched | Unknown, Transition::Started { .. }) => to(Running, false),
            (Running, Transition::Started { .. }) => to(Running, false),
            (Dispatched | Running | Unknown, Transition::Finished { outcome }) => match outcome {
                Outcome::Exited { .. } | Outcome::Answered { .. } => to(Completed, true),
                Outcome::TimedOut => to(TimedOut, true),
                Outcome::Cancelled => to(Cancelled, true),
            },
            (Dispatched | Unknown, Transition::NotStarted { .. }) => to(Failed, true),
            (Dispatched | Running, Transition::Lost { .. }) => to(Unknown, false),
            (Unknown, Transition::Lost { .. }) => to(Unknown, false),
            (Dispatched | Running | Unknown, Transition::Interrupted) => to(Interrupted, true),
            (s, Transition::Delivered) if s.has_result() => Lifecycle {
                result_delivered: true,
                ..*self
            },
            (Dispatched | Unknown | Interrupted, Transition::Review { .. }) => to(Reviewed, true),
            _ => return Err(illegal()),
        };
        Ok(next)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn walk(steps: &[Transition]) -> Result<Lifecycle, IllegalTransition> {
        steps
            .iter()
            .try_fold(Lifecycle::accepted(), |l, t| l.apply(t))
    }

    fn exited(code: i32) -> Transition {
        Transition::Finished {
            outcome: Outcome::Exited {
                exit_code: Some(code),
                signal: None,
            },
        }
    }

    #[test]
    fn happy_path_separates_observed_from_delivered() {
        let steps = [
            Transition::Authorize {
                by: "policy".into(),
            },
            Transition::Dispatch { attempt: 1 },
            Transition::Started { pid: Some(42) },
            exited(0),
        ];
        let done = walk(&steps).unwrap();
        assert_eq!(done.state, ExecState::Completed);
        assert!(done.result_observed && !done.result_delivered);
        assert!(
            done.is_unresolved(),
            "completed, result not delivered is unresolved"
        );
        let delivered = done.apply(&Transition::Delivered).unwrap();
        assert!(delivered.result_delivered && !delivered.is_unresolved());
    }

    #[test]
    fn cannot_dispatch_without_authorization() {
        let err = Lifecycle::accepted()
            .apply(&Transition::Dispatch { attempt: 1 })
            .unwrap_err();
        assert_eq!(
            err.to_string(),
            "illegal transition `dispatch` from state `accepted`"
        );
        let waiting = Lifecycle::accepted()
            .apply(&Transition::RequestApproval)
            .unwrap();
        assert!(waiting.apply(&Transition::Dispatch { attempt: 1 }).is_err());
    }

    #[test]
    fn final_states_accept_only_delivery() {
        let all = [
            Transition::RequestApproval,
            Transition::Authorize { by: "x".into() },
            Transition::Deny {
                by: "x".into(),
                reason: "r".into(),
            },
            Transition::Expire,
            Transition::Dispatch { attempt: 2 },
            Transition::Started { pid: None },
            exited(1),
            Transition::NotStarted { reason: "r".into() },
            Transition::Lost { reason: "r".into() },
            Transition::Interrupted,
            Transition::CancelBeforeDispatch { by: "x".into() },
            Transition::Review {
                verdict: ReviewVerdict::Ran,
                by: "x".into(),
                note: "n".into(),
            },
        ];
        for state in ExecState::ALL.into_iter().filter(|s| s.is_final()) {
            let l = Lifecycle {
                state,
                result_observed: true,
                result_delivered: false,
            };
            for t in &all {
                assert!(l.apply(t).is_err(), "{state} must refuse {}", t.name());
            }
            assert!(l.apply(&Transition::Delivered).unwrap().result_delivered);
        }
    }

    #[test]
    fn unknown_resolves_by_marker_or_review() {
        let lost = walk(&[
            Transition::Authorize {
                by: "policy".into(),
            },
            Transition::Dispatch { attempt: 1 },
            Transition::Lost {
                reason: "connection reset".into(),
            },
        ])
        .unwrap();
        assert_eq!(lost.state, ExecState::Unknown);
        assert!(!lost.result_observed);
        assert!(
            lost.apply(&Transition::Delivered).is_err(),
            "an unknown has no result"
        );
        assert_eq!(lost.apply(&exited(3)).unwrap().state, ExecState::Completed);
        assert_eq!(
            lost.apply(&Transition::Started { pid: None })
                .unwrap()
                .state,
            ExecState::Running
        );
        assert_eq!(
            lost.apply(&Transition::NotStarted {
                reason: "marker absent".into()
            })
            .unwrap()
            .state,
            ExecState::Failed
        );
        let interrupted = lost.apply(&Transition::Interrupted).unwrap();
        let reviewed = interrupted
            .apply(&Transition::Review {
                verdict: ReviewVerdict::DidNotRun,
                by: "op".into(),
                note: "checked".into(),
            })
            .unwrap();
        assert_eq!(reviewed.state, ExecState::Reviewed);
    }

    #[test]
    fn names_round_trip() {
        for s in ExecState::ALL {
            assert_eq!(ExecState::parse(s.as_str()), Some(s));
            assert_eq!(serde_json::to_string(&s).unwrap(), format!("\"{s}\""));
        }
    }
}
