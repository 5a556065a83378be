//! What the ledger stores, in core types.

use serde::{Deserialize, Serialize};
use serde_json::Value;
use sha2::{Digest, Sha256};
use waymark_core::{
    Actor, AttachAction, CanonicalAction, ExecState, ExecutionId, Fingerprint, IntentScope,
    Lifecycle, MaskHint, Outcome, ReplayContract, Timestamp, Transition,
};

/// A new execution as the gateway accepts it.
#[derive(Clone, Debug, PartialEq)]
pub struct NewExecution {
    pub id: ExecutionId,
    pub fingerprint: Fingerprint,
    /// The canonical, secret-free action record.
    pub action: CanonicalAction,
    pub actor: Actor,
    pub scope: IntentScope,
    pub tool: String,
    /// The configured host name the action targets.
    pub host: String,
    pub contract: ReplayContract,
    /// The agent run (session) it came in, if any.
    pub run: Option<String>,
    /// Its secret values as length and keyed MAC, so that output read after a restart is
    /// masked too (`waymark_core::MaskHint`).
    pub mask: Vec<MaskHint>,
}

/// One execution as the ledger holds it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ExecutionRecord {
    pub id: ExecutionId,
    pub fingerprint: Fingerprint,
    pub action: CanonicalAction,
    pub actor: Actor,
    pub scope: IntentScope,
    pub tool: String,
    pub host: String,
    pub contract: ReplayContract,
    pub run: Option<String>,
    /// See [`NewExecution::mask`].
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub mask: Vec<MaskHint>,
    pub lifecycle: Lifecycle,
    pub accepted_at: Timestamp,
    pub updated_at: Timestamp,
    /// When its outcome was observed.
    pub finished_at: Option<Timestamp>,
    pub outcome: Option<Outcome>,
    /// Why it was denied, did not start, was lost, or what a reviewer said.
    pub reason: Option<String>,
    /// How many times it was dispatched (a resume re-sends the same id).
    pub dispatch_attempts: u32,
    /// Sequence numbers of its first and latest audit events.
    pub first_seq: u64,
    pub last_seq: u64,
}

impl ExecutionRecord {
    pub fn state(&self) -> ExecState {
        self.lifecycle.state
    }

    /// The record of `new`, accepted at `now` with its audit event `seq`. The same for every
    /// backend, so a record means the same wherever it is stored.
    pub fn accepted(new: &NewExecution, now: Timestamp, seq: u64) -> ExecutionRecord {
        ExecutionRecord {
            id: new.id,
            fingerprint: new.fingerprint,
            action: new.action.clone(),
            actor: new.actor.clone(),
            scope: new.scope.clone(),
            tool: new.tool.clone(),
            host: new.host.clone(),
            contract: new.contract,
            run: new.run.clone(),
            mask: new.mask.clone(),
            lifecycle: Lifecycle::accepted(),
            accepted_at: now,
            updated_at: now,
            finished_at: None,
            outcome: None,
            reason: None,
            dispatch_attempts: 0,
            first_seq: seq,
            last_seq: seq,
        }
    }

    /// The audit event of accepting `new`.
    pub fn accepted_event(new: &NewExecution) -> EventKind {
        EventKind::Accepted {
            fingerprint: new.fingerprint,
            actor: new.actor.clone(),
            tool: new.tool.clone(),
            host: new.host.clone(),
            scope: new.scope.clone(),
            run: new.run.clone(),
        }
    }

    /// Whether `transition` repeats what the record already says, so that a ledger records
    /// nothing for it: a second observer's "started" of a running execution (the driver and a
    /// reconcile, or two daemons, each saw the command start). Both backends ask this under
    /// their write lock, before [`ExecutionRecord::apply`].
    pub fn repeats(&self, transition: &Transition) -> bool {
        self.state() == waymark_core::ExecState::Running
            && matches!(transition, Transition::Started { .. })
    }

    /// Applies `transition` at `now` (audit event `seq`): the lifecycle's one transition
    /// function, then what the record keeps of it. Returns the transition's audit event.
    pub fn apply(
        &mut self,
        transition: &Transition,
        now: Timestamp,
        seq: u64,
    ) -> Result<EventKind, waymark_core::IllegalTransition> {
        let from = self.lifecycle.state;
        self.lifecycle = self.lifecycle.apply(transition)?;
        // A loss's reason ("whether it started is unknown", "its output could not be fetched")
        // describes the unknown state only: what settles it (the host saw it start, end or die,
        // or it is sent again) supersedes it, so a completed execution never shows it.
        if from == waymark_core::ExecState::Unknown
            && matches!(
                transition,
                Transition::Started { .. }
                    | Transition::Finished { .. }
                    | Transition::Interrupted
                    | Transition::Dispatch { .. }
            )
        {
            self.reason = None;
        }
        match transition {
            Transition::Dispatch { .. } => self.dispatch_attempts += 1,
            Transition::Finished { outcome } => self.outcome = Some(outcome.clone()),
            Transition::Deny { reason, .. }
            | Transition::NotStarted { reason }
            | Transition::Lost { reason } => self.reason = Some(reason.clone()),
            Transition::Review { note, verdict, .. } => {
                self.reason = Some(format!("reviewed ({verdict:?}): {note}"))
            }
            _ => {}
        }
        if self.finished_at.is_none() && self.lifecycle.result_observed {
            self.finished_at = Some(now);
        }
        self.updated_at = now;
        self.last_seq = seq;
        Ok(EventKind::Transition {
            from,
            to: self.lifecycle.state,
            transition: transition.clone(),
        })
    }
}

/// How durable a write must be before the call returns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Durability {
    /// Flushed to the file (and fdatasync'ed when the ledger is so configured) before return:
    /// a process crash right after cannot lose it. Concurrent callers share flushes.
    Flushed,
    /// In sled's buffers; on disk within sled's flush interval or the next flushed write.
    Buffered,
}

/// One entry of the hash-chained audit log.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LedgerEvent {
    pub seq: u64,
    pub at: Timestamp,
    pub execution: Option<ExecutionId>,
    pub kind: EventKind,
    /// Hex HMAC of the previous event (64 zeros for the first).
    pub prev: String,
    /// Hex HMAC-SHA256(chain key, prev ‖ canonical body of this event).
    pub hash: String,
}

/// What an audit event says happened.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum EventKind {
    /// A new execution was accepted.
    Accepted {
        fingerprint: Fingerprint,
        actor: Actor,
        tool: String,
        host: String,
        scope: IntentScope,
        run: Option<String>,
    },
    /// A lifecycle transition.
    Transition {
        from: ExecState,
        to: ExecState,
        transition: Transition,
    },
    /// A later call attached to this execution instead of starting a new one.
    Attached {
        actor: Actor,
        action: AttachAction,
        run: Option<String>,
    },
    /// An agent run started, ended, or a fact of the gateway (a lock, say) was recorded.
    Note { name: String, data: Value },
    /// Events up to `pruned_through` were removed by retention; `pruned_head` is the hash of
    /// the last removed event, which the first kept event links to.
    Checkpoint {
        pruned_through: u64,
        pruned_head: String,
        removed_executions: u64,
    },
}

/// Captured output of one stream: the first `cap` bytes, plus the size and hash of all of it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CapturedOutput {
    /// Stored bytes (a prefix of the output when it was larger than the cap).
    #[serde(skip)]
    pub head: Vec<u8>,
    /// Byte count of the full output.
    pub total_bytes: u64,
    /// Hex SHA-256 of the full output.
    pub sha256: String,
}

impl CapturedOutput {
    /// Captures `full`, keeping at most `cap` bytes.
    pub fn capture(full: &[u8], cap: usize) -> Self {
        CapturedOutput {
            head: full[..full.len().min(cap)].to_vec(),
            total_bytes: full.len() as u64,
            sha256: hex::encode(Sha256::digest(full)),
        }
    }

    /// Whether bytes beyond the stored prefix exist (fetch them from the host's marker).
    pub fn truncated(&self) -> bool {
        (self.head.len() as u64) < self.total_bytes
    }
}

/// The result of an execution: its streams, by reference when large.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoredResult {
    pub stdout: CapturedOutput,
    pub stderr: CapturedOutput,
}

#[derive(Serialize, Deserialize)]
pub(crate) struct ResultHeader {
    pub stdout: CapturedOutput,
    pub stderr: CapturedOutput,
}

/// One agent run: a session of one actor over one transport.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RunRecord {
    pub id: String,
    pub actor: Actor,
    pub transport: String,
    pub started_at: Timestamp,
    pub ended_at: Option<Timestamp>,
    pub calls: u64,
}

/// The chain's head: the last event's sequence number and hash. An operator can keep it
/// elsewhere and later prove that nothing before it was truncated or edited.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChainHead {
    pub seq: u64,
    pub hash: String,
}

impl ChainHead {
    /// The head before the first event: sequence 0, 64 zeros.
    pub fn genesis() -> Self {
        ChainHead {
            seq: 0,
            hash: "0".repeat(64),
        }
    }
}

impl std::fmt::Display for ChainHead {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}:{}", self.seq, self.hash)
    }
}

impl std::str::FromStr for ChainHead {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let (seq, hash) = s
            .split_once(':')
            .ok_or("a chain head looks like SEQ:HASH")?;
        let seq = seq
            .parse()
            .map_err(|_| format!("{seq:?} is not a sequence number"))?;
        if hash.len() != 64 || !hash.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(format!("{hash:?} is not a 64-digit hex hash"));
        }
        Ok(ChainHead {
            seq,
            hash: hash.to_ascii_lowercase(),
        })
    }
}
