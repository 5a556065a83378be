//! Operator operations: lock, status, output by offset, delivery, cancel, review, resume.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use waymark_core::{AttachAction, ExecState, ExecutionId, ReviewVerdict, Transition};
use waymark_ledger::{Durability, ExecutionRecord};

use crate::host::{HostError, HostExecutor, Stream};
use crate::tools::ResolvedCall;

use super::drive::Start;
use super::policy::Answer;
use super::{now, CallOutcome, Gateway, GatewayError, NoEvents, FLUSHED};

/// Why a status answer is what the ledger knows rather than what the host just said.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Unchecked {
    /// The host could not be asked (unreachable, or an answer the wrapper protocol does not
    /// allow).
    #[error(transparent)]
    Host(HostError),
    /// The host did not answer within the read's deadline. The check goes on and records what
    /// it finds; nothing was recorded because the host was slow.
    #[error("the host did not answer in time (within {})", fmt_deadline(.0))]
    Late(Duration),
    /// The check itself failed (a ledger write, say).
    #[error("the check failed: {0}")]
    Failed(String),
}

/// A deadline as a person gave it: `2s`, `1500ms`.
fn fmt_deadline(d: &Duration) -> String {
    if d.subsec_millis() == 0 {
        format!("{}s", d.as_secs())
    } else {
        format!("{}ms", d.as_millis())
    }
}

/// How a status check of the host ended: the host's error when it could not be asked and what
/// the target said that the record does not keep ([`CallOutcome::heard`]), or why the check
/// failed. `None` while it runs.
pub(super) type Probe =
    watch::Receiver<Option<Result<(Option<HostError>, Option<String>), String>>>;

impl<E: HostExecutor> Gateway<E> {
    /// [`Gateway::status`] that answers within `deadline`: past it, with the ledger's record
    /// and [`Unchecked::Late`]. A read is never the reason a host is given up on: the check
    /// runs on its own task and goes on past the deadline, recording what the host says when
    /// it answers, and a read that comes meanwhile waits on that check rather than starting
    /// another (issue 36: ten consecutive reads of a slow host each hung for up to 30 s).
    pub async fn status_within(
        self: &Arc<Self>,
        id: ExecutionId,
        deadline: Duration,
    ) -> Result<(CallOutcome, Option<Unchecked>), GatewayError> {
        let mut probe = {
            let mut probes = self.probes.lock().expect("probes");
            match probes.get(&id) {
                Some(probe) => probe.clone(),
                None => {
                    let (tx, rx) = watch::channel(None);
                    probes.insert(id, rx.clone());
                    let gateway = self.clone();
                    tokio::spawn(async move {
                        let end = match gateway.status(id).await {
                            Ok((o, unasked)) => Ok((unasked, o.heard)),
                            Err(e) => Err(e.to_string()),
                        };
                        gateway.probes.lock().expect("probes").remove(&id);
                        let _ = tx.send(Some(end));
                    });
                    rx
                }
            }
        };
        let mut heard = None;
        let unchecked = match tokio::time::timeout(deadline, probe.wait_for(Option::is_some)).await
        {
            Ok(Ok(end)) => match end.clone().expect("a finished check") {
                Ok((unasked, said)) => {
                    heard = said;
                    unasked.map(Unchecked::Host)
                }
                Err(why) => Some(Unchecked::Failed(why)),
            },
            Ok(Err(_)) => Some(Unchecked::Failed(
                "the check ended without an answer".into(),
            )),
            Err(_) => Some(Unchecked::Late(deadline)),
        };
        // What the check recorded (or, late, what the ledger knew before it) is the answer.
        let rec = self.get(id).await?;
        let o = self.outcome(rec, None).await?;
        Ok((CallOutcome { heard, ..o }, unchecked))
    }

    /// Whether new actions are refused.
    pub async fn locked(&self) -> Result<bool, GatewayError> {
        Ok(self
            .ledger
            .setting("locked")
            .await?
            .and_then(|v| v.as_bool())
            .unwrap_or(false))
    }

    /// Why new actions are locked, as the operator said when locking.
    pub async fn lock_reason(&self) -> Result<Option<String>, GatewayError> {
        Ok(self
            .ledger
            .setting("lock_reason")
            .await?
            .and_then(|v| v.as_str().map(str::to_string)))
    }

    /// Locks (with the operator's reason) or unlocks new actions; recorded in the audit chain.
    /// The reason is written first, so a lock never stands with an older lock's reason.
    pub async fn set_locked(
        &self,
        locked: bool,
        reason: Option<&str>,
        by: &str,
    ) -> Result<(), GatewayError> {
        if locked {
            let reason = serde_json::json!(reason);
            self.ledger
                .set_setting("lock_reason", reason, by, now(), Durability::Buffered)
                .await?;
        }
        self.ledger
            .set_setting("locked", serde_json::json!(locked), by, now(), FLUSHED)
            .await?;
        Ok(())
    }

    /// The ledger's view of an execution, reconciled with a live check of its host marker when
    /// it may be on the host.
    pub async fn status(
        &self,
        id: ExecutionId,
    ) -> Result<(CallOutcome, Option<HostError>), GatewayError> {
        // On a shared ledger, one nobody drives is adopted for the check, and let go after it.
        let rec = self.get_or_adopt(id).await?;
        // Another daemon sharing the ledger drives it: what it recorded is the answer.
        if !rec.state().may_be_on_host() || !self.ledger.drives(&rec) {
            return Ok((self.outcome(rec, None).await?, None));
        }
        let checked = self.status_here(rec).await;
        self.let_go_of_idle(&[id]).await;
        checked
    }

    /// [`Gateway::status`] of an execution this daemon drives: its channel's check.
    async fn status_here(
        &self,
        rec: ExecutionRecord,
    ) -> Result<(CallOutcome, Option<HostError>), GatewayError> {
        self.driver(&rec)?.check(self, rec).await
    }

    /// Output of an execution by offset, from where its channel keeps it (the ledger keeps
    /// only the first `result_cap` bytes of each stream).
    pub async fn read_output(
        &self,
        id: ExecutionId,
        stream: Stream,
        offset: u64,
        max: u64,
    ) -> Result<(Vec<u8>, u64), GatewayError> {
        let rec = self.get(id).await?;
        self.driver(&rec)?
            .read_output(self, rec, stream, offset, max)
            .await
    }

    /// Records that the caller has the result (the transport accepted the write).
    pub async fn delivered(&self, id: ExecutionId) -> Result<ExecutionRecord, GatewayError> {
        let rec = self.get(id).await?;
        if rec.state().has_result() && !rec.lifecycle.result_delivered {
            return Ok(self
                .ledger
                .transition(id, Transition::Delivered, now(), FLUSHED)
                .await?);
        }
        Ok(rec)
    }

    /// Cancels an execution: before dispatch in the ledger, after dispatch on the host.
    pub async fn cancel(&self, id: ExecutionId, by: &str) -> Result<CallOutcome, GatewayError> {
        let rec = self.get(id).await?;
        match rec.state() {
            ExecState::Accepted | ExecState::AwaitingApproval | ExecState::Authorized => {
                let rec = self
                    .ledger
                    .transition(
                        id,
                        Transition::CancelBeforeDispatch { by: by.into() },
                        now(),
                        FLUSHED,
                    )
                    .await?;
                if let Some(tx) = self.approvals.lock().expect("approvals").get(&id) {
                    let _ = tx.send(Some(Answer::Cancelled));
                }
                self.outcome(rec, None).await
            }
            s if s.may_be_on_host() => self.driver(&rec)?.cancel(self, rec).await,
            s => Err(GatewayError::Refused {
                id,
                why: format!("it is already {s}"),
            }),
        }
    }

    /// A human resolves an unknown or interrupted execution.
    pub async fn review(
        &self,
        id: ExecutionId,
        verdict: ReviewVerdict,
        by: &str,
        note: &str,
    ) -> Result<ExecutionRecord, GatewayError> {
        Ok(self
            .ledger
            .transition(
                id,
                Transition::Review {
                    verdict,
                    by: by.into(),
                    note: note.into(),
                },
                now(),
                FLUSHED,
            )
            .await?)
    }

    /// Re-sends an execution under its own id (safe: the marker refuses a second start).
    /// Needs the call, since secret arguments are not in the ledger.
    pub async fn resume(
        &self,
        id: ExecutionId,
        call: &ResolvedCall,
    ) -> Result<CallOutcome, GatewayError> {
        let rec = self.get(id).await?;
        let key = self.ledger.fingerprint_key();
        if call.fingerprint(&key) != rec.fingerprint {
            return Err(GatewayError::Refused {
                id,
                why: "the call given to resume it is not the same intent".into(),
            });
        }
        match rec.state() {
            ExecState::Authorized
            | ExecState::Dispatched
            | ExecState::Unknown
            | ExecState::Running => {
                self.drive(
                    id,
                    Some(AttachAction::Continue),
                    call,
                    None,
                    &NoEvents,
                    Start::AsRecorded,
                )
                    .await
            }
            s => Err(GatewayError::Refused {
                id,
                why: format!(
                    "it is {s}; only authorized, dispatched, running or unknown executions can be resumed"
                ),
            }),
        }
    }
}
