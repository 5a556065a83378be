//! What a call tells its own caller while it runs: one sink per call, so a caller learns about
//! its own execution (its id, an approval it waits on, its output) and nothing else.

use std::sync::atomic::{AtomicBool, Ordering};

use waymark_core::{AttachAction, ExecutionId};
use waymark_ledger::ExecutionRecord;

use crate::host::Stream;

/// One thing a call tells its caller before its outcome.
#[derive(Debug)]
pub enum CallEvent<'a> {
    /// The execution is decided and durable, before anything is sent to the host. `attached`
    /// is set when this call joined an earlier execution of the same intent.
    Decided {
        id: ExecutionId,
        attached: Option<AttachAction>,
    },
    /// This call's execution waits on an operator's approval (told at most once per call).
    AwaitingApproval { record: &'a ExecutionRecord },
    /// Output the command printed so far, read from the host's marker while it runs, secret
    /// values masked (same length, so `offset` is the host's).
    Output {
        stream: Stream,
        offset: u64,
        bytes: &'a [u8],
    },
}

/// Receives a call's [`CallEvent`]s. Any `Fn(CallEvent)` is one, and wants live output.
pub trait CallEvents: Send + Sync {
    fn event(&self, event: CallEvent<'_>);

    /// Whether to read the command's output while it runs: one marker read per stream every
    /// few hundred milliseconds, so a caller that shows nothing live says no.
    fn wants_output(&self) -> bool {
        true
    }
}

impl<F: Fn(CallEvent<'_>) + Send + Sync> CallEvents for F {
    fn event(&self, event: CallEvent<'_>) {
        self(event)
    }
}

/// A caller that only wants the outcome.
pub struct NoEvents;

impl CallEvents for NoEvents {
    fn event(&self, _: CallEvent<'_>) {}

    fn wants_output(&self) -> bool {
        false
    }
}

/// The sink a call's flow talks to: the caller's, told of an approval wait only once (a call
/// that attached to an execution awaiting approval, then waits on it itself, is one wait).
pub(super) struct Told<'a> {
    caller: &'a dyn CallEvents,
    approval: AtomicBool,
}

impl<'a> Told<'a> {
    pub(super) fn new(caller: &'a dyn CallEvents) -> Self {
        Told {
            caller,
            approval: AtomicBool::new(false),
        }
    }
}

impl CallEvents for Told<'_> {
    fn event(&self, event: CallEvent<'_>) {
        if matches!(event, CallEvent::AwaitingApproval { .. })
            && self.approval.swap(true, Ordering::SeqCst)
        {
            return;
        }
        self.caller.event(event)
    }

    fn wants_output(&self) -> bool {
        self.caller.wants_output()
    }
}
