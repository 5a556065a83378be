//! Policy and approval: lock, approval requirements, and the operator's answer.

use tokio::sync::watch;
use waymark_core::{ExecState, ExecutionId, Transition};
use waymark_ledger::{ExecutionRecord, ListQuery};

use crate::config::Approval;
use crate::host::HostExecutor;
use crate::tools::ResolvedCall;

use super::{now, CallEvent, CallEvents, Gateway, GatewayError, FLUSHED};

/// How far [`Gateway::admit`] takes an execution that policy lets through.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Admit {
    /// To authorized, flushed.
    Authorize,
    /// To authorized and its first dispatch, in one flush: the caller then sends it.
    AuthorizeAndDispatch,
}

/// What ended a wait on an approval (the waiter reads the ledger for the rest).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Answer {
    Approved,
    Denied,
    Cancelled,
}

impl<E: HostExecutor> Gateway<E> {
    /// Applies policy to an accepted execution: locked → denied; approval → awaiting approval;
    /// otherwise authorized. Returns the record after it, its last write flushed (and with it
    /// every buffered write before, the acceptance included); the wait for an operator, if
    /// any, is [`Gateway::settle_approval`]'s.
    ///
    /// With [`Admit::AuthorizeAndDispatch`], an authorized execution is also recorded as
    /// dispatched (its first attempt), both in one flush: the caller then sends it.
    pub(super) async fn admit(
        &self,
        rec: ExecutionRecord,
        call: &ResolvedCall,
        run: Option<&str>,
        admit: Admit,
    ) -> Result<ExecutionRecord, GatewayError> {
        let id = rec.id;
        if self.locked().await? {
            let why = match self.lock_reason().await? {
                Some(r) => format!(" ({r})"),
                None => String::new(),
            };
            let deny = Transition::Deny {
                by: "policy".into(),
                reason: format!(
                    "locked{why}: Waymark refuses new actions until an operator runs `waymark unlock`"
                ),
            };
            return Ok(self.ledger.transition(id, deny, now(), FLUSHED).await?);
        }
        let approved_session = match (&call.approval, session_key(run, call)) {
            (Approval::Session, Some(k)) => self.ledger.setting(&k).await?.is_some(),
            _ => false,
        };
        let by = match call.approval {
            Approval::None => "policy",
            Approval::Session if approved_session => "session approval",
            Approval::Session | Approval::PerCall => {
                return Ok(self
                    .ledger
                    .transition(id, Transition::RequestApproval, now(), FLUSHED)
                    .await?);
            }
        };
        let authorize = Transition::Authorize { by: by.into() };
        if admit == Admit::Authorize {
            return Ok(self
                .ledger
                .transition(id, authorize, now(), FLUSHED)
                .await?);
        }
        // Authorized and dispatched in one write, flushed once: on a shared ledger one round
        // of its group commit instead of two.
        let dispatch = Transition::Dispatch {
            attempt: rec.dispatch_attempts + 1,
        };
        Ok(self
            .ledger
            .transitions(id, vec![authorize, dispatch], now(), FLUSHED)
            .await?)
    }

    /// Waits for the operator's answer to an execution awaiting approval; an approval of a
    /// session-approved tool is remembered for the rest of the agent run.
    pub(super) async fn settle_approval(
        &self,
        rec: ExecutionRecord,
        call: &ResolvedCall,
        run: Option<&str>,
        events: &dyn CallEvents,
    ) -> Result<ExecutionRecord, GatewayError> {
        let rec = self.wait_for_approval(rec, events).await?;
        if rec.state() == ExecState::Authorized {
            if let (Approval::Session, Some(k)) = (call.approval, session_key(run, call)) {
                self.ledger
                    .set_setting(&k, serde_json::json!(true), "operator", now(), FLUSHED)
                    .await?;
            }
        }
        Ok(rec)
    }

    async fn wait_for_approval(
        &self,
        rec: ExecutionRecord,
        events: &dyn CallEvents,
    ) -> Result<ExecutionRecord, GatewayError> {
        let mut rx = {
            let mut m = self.approvals.lock().expect("approvals");
            m.entry(rec.id)
                .or_insert_with(|| watch::channel(None).0)
                .subscribe()
        };
        // Subscribed first: an answer given as soon as the caller knows cannot be missed.
        events.event(CallEvent::AwaitingApproval { record: &rec });
        let heard = rx.wait_for(|v| v.is_some());
        // On a shared ledger the operator may answer through another daemon: only the ledger
        // tells, read for every waiting call of this daemon at once (`approval_watch`).
        let read = async {
            if !self.ledger.shared() {
                return std::future::pending().await;
            }
            self.approval_watch.decided(&self.ledger, rec.id).await
        };
        let _ = tokio::time::timeout(self.approval_wait, async {
            tokio::select! {
                _ = heard => {}
                () = read => {}
            }
        })
        .await;
        self.get(rec.id).await
    }

    /// An operator approves a call that awaits approval.
    pub async fn approve(
        &self,
        id: ExecutionId,
        by: &str,
    ) -> Result<ExecutionRecord, GatewayError> {
        let rec = self.get(id).await?;
        if rec.state() != ExecState::AwaitingApproval {
            return Err(GatewayError::Refused {
                id,
                why: format!("it is {}, not awaiting approval", rec.state()),
            });
        }
        let rec = self
            .ledger
            .transition(id, Transition::Authorize { by: by.into() }, now(), FLUSHED)
            .await?;
        if let Some(tx) = self.approvals.lock().expect("approvals").get(&id) {
            let _ = tx.send(Some(Answer::Approved));
        }
        Ok(rec)
    }

    /// An operator denies a call that awaits approval.
    pub async fn deny(
        &self,
        id: ExecutionId,
        by: &str,
        reason: &str,
    ) -> Result<ExecutionRecord, GatewayError> {
        let rec = self.get(id).await?;
        if rec.state() != ExecState::AwaitingApproval {
            return Err(GatewayError::Refused {
                id,
                why: format!("it is {}, not awaiting approval", rec.state()),
            });
        }
        let rec = self
            .ledger
            .transition(
                id,
                Transition::Deny {
                    by: by.into(),
                    reason: reason.into(),
                },
                now(),
                FLUSHED,
            )
            .await?;
        if let Some(tx) = self.approvals.lock().expect("approvals").get(&id) {
            let _ = tx.send(Some(Answer::Denied));
        }
        Ok(rec)
    }

    /// Executions awaiting approval, oldest first.
    pub async fn pending_approvals(&self) -> Result<Vec<ExecutionRecord>, GatewayError> {
        let q = ListQuery {
            state: Some(ExecState::AwaitingApproval),
            oldest_first: true,
            limit: 1000,
            ..Default::default()
        };
        Ok(self.ledger.list(&q).await?.items)
    }
}

/// The ledger setting that remembers an operator's approval of a session-approved tool for one
/// agent run.
fn session_key(run: Option<&str>, call: &ResolvedCall) -> Option<String> {
    run.map(|r| format!("approved_session:{r}:{}", call.tool))
}
