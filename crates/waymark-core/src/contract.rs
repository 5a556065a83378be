//! Replay contracts: what a repeat of a tool's effect means, declared per tool.

use std::time::Duration;

use serde::{Deserialize, Serialize};

/// What repeating a tool's effect means.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ReplayContract {
    /// Reads only: repeat freely; every call is a new execution.
    ReadOnly,
    /// A repeat is harmless, but a retry still attaches while the first is unresolved.
    Idempotent,
    /// After a drop, recover by asking the host's marker.
    StatusCheck,
    /// After an unknown outcome, block and require a human review.
    Irreversible,
}

impl ReplayContract {
    /// The contract in words, for a tool description an agent reads.
    pub fn describe(self) -> &'static str {
        match self {
            ReplayContract::ReadOnly => {
                "Read-only: it changes nothing on the host and may be repeated freely."
            }
            ReplayContract::Idempotent => {
                "Idempotent: repeating it is harmless; a retry of an unfinished call attaches to \
                 the first execution instead of starting another."
            }
            ReplayContract::StatusCheck => {
                "Status-checked: after a dropped connection, retrying the same call attaches to \
                 the first execution and reports what the host recorded; it is not run twice."
            }
            ReplayContract::Irreversible => {
                "Irreversible: it is never run twice; if its outcome cannot be proven after a \
                 drop, it waits for a human review."
            }
        }
    }
}

/// A tool's replay settings: its contract and the windows that bound a retry.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReplayPolicy {
    pub contract: ReplayContract,
    /// A repeat of the same intent within this time after acceptance counts as a retry.
    pub retry_window: Duration,
    /// A completed and delivered execution answers repeats within this time after it
    /// finished, like an idempotency-key cache. `None`: a delivered result is not replayed.
    pub dedup_window: Option<Duration>,
}

impl ReplayPolicy {
    /// A policy with the given contract, a retry window and no dedup window.
    pub fn new(contract: ReplayContract, retry_window: Duration) -> Self {
        ReplayPolicy {
            contract,
            retry_window,
            dedup_window: None,
        }
    }
}
