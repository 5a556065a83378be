//! Intake: the matching rule under a per-fingerprint intent lock decides whether a call is a
//! new execution or attaches to an earlier one.

use std::sync::Arc;

use waymark_core::{AttachAction, ExecState, Fingerprint, IncomingCall};
use waymark_ledger::{Durability, ExecutionRecord, Intake};

use crate::host::HostExecutor;
use crate::tools::ResolvedCall;

use super::drive::Start;
use super::events::Told;
use super::policy::Admit;
use super::{now, CallEvent, CallEvents, CallOutcome, Gateway, GatewayError};

impl<E: HostExecutor> Gateway<E> {
    /// Runs a resolved call to an outcome: a new execution, or an attach to an earlier one.
    /// `events` learns, for this call only: its execution id as soon as it is decided (before
    /// anything is sent), that it waits on an approval, and its output while it runs.
    pub async fn call(
        &self,
        call: ResolvedCall,
        run: Option<String>,
        events: &dyn CallEvents,
    ) -> Result<CallOutcome, GatewayError> {
        let events = Told::new(events);
        let key = self.ledger.fingerprint_key();
        let action = call.canonicalize(&key);
        let fingerprint = action.fingerprint(&key);
        // A channel this process cannot drive is refused before anything is recorded.
        self.driver_for(action.channel())?;
        // Two racing calls of one intent must not both decide "new".
        let lock = {
            let mut m = self.intents.lock().expect("intents");
            m.entry(fingerprint).or_default().clone()
        };
        let guard = lock.lock().await;
        let t = now();
        if let Some(r) = &run {
            let _ = self.ledger.count_call(r).await;
        }
        let incoming = IncomingCall {
            actor: call.actor().clone(),
            scope: call.scope().clone(),
            policy: call.policy,
            now: t,
        };
        let new = waymark_ledger::NewExecution {
            id: self.ledger.mint_id(t),
            fingerprint,
            action,
            actor: call.actor().clone(),
            scope: call.scope().clone(),
            tool: call.tool.clone(),
            host: call.target().to_string(),
            contract: call.policy.contract,
            run: run.clone(),
            mask: crate::mask::hints(&key, self.values_to_mask(&call)),
        };
        // The ledger decides with core's matching rule: for a ledger shared by several
        // daemons, the database serializes the decisions of one intent, not this process.
        // Accepted, the policy's answer and (when the policy lets it go) dispatched reach the
        // disk in one flush, before anyone learns the id and before the first byte leaves: a
        // crash in between leaves none of them, and nothing was sent.
        match self
            .ledger
            .accept_or_attach(new, &incoming, Durability::Buffered)
            .await?
        {
            Intake::New(rec) => {
                let rec = self
                    .admit(rec, &call, run.as_deref(), Admit::AuthorizeAndDispatch)
                    .await?;
                drop(guard);
                self.release_intent(&fingerprint, lock);
                events.event(CallEvent::Decided {
                    id: rec.id,
                    attached: None,
                });
                self.crash_point("accepted");
                let start = match rec.state() {
                    ExecState::Dispatched => Start::JustDispatched,
                    _ => Start::AsRecorded,
                };
                self.drive(rec.id, None, &call, run.as_deref(), &events, start)
                    .await
            }
            Intake::Attach {
                record: rec,
                action,
            } => {
                drop(guard);
                self.release_intent(&fingerprint, lock);
                self.metrics.attached_retry(&rec.tool, action);
                events.event(CallEvent::Decided {
                    id: rec.id,
                    attached: Some(action),
                });
                self.attach(rec, action, &call, run.as_deref(), &events)
                    .await
            }
        }
    }

    /// Forgets the per-fingerprint lock once no other call holds or waits on it, so the map
    /// does not keep one entry per intent ever seen. Clones are taken under the map's mutex,
    /// so a count of two (the map's and ours) there means nobody else can reach it.
    fn release_intent(&self, fingerprint: &Fingerprint, lock: Arc<tokio::sync::Mutex<()>>) {
        let mut m = self.intents.lock().expect("intents");
        if Arc::strong_count(&lock) == 2 {
            m.remove(fingerprint);
        }
    }

    /// How many per-fingerprint locks the gateway holds (calls deciding right now).
    #[doc(hidden)]
    pub fn intent_locks(&self) -> usize {
        self.intents.lock().expect("intents").len()
    }

    async fn attach(
        &self,
        rec: ExecutionRecord,
        action: AttachAction,
        call: &ResolvedCall,
        run: Option<&str>,
        events: &dyn CallEvents,
    ) -> Result<CallOutcome, GatewayError> {
        if action == AttachAction::PendingApproval {
            events.event(CallEvent::AwaitingApproval { record: &rec });
        }
        match action {
            AttachAction::ReturnDenial
            | AttachAction::ReturnStoredResult
            | AttachAction::NeedsReview => self.outcome(rec, Some(action)).await,
            // Waiting on approval, continuing, or asking the marker: join whoever drives it,
            // or drive it on from where it stands.
            AttachAction::PendingApproval
            | AttachAction::Continue
            | AttachAction::AskHostMarker => {
                self.drive(rec.id, Some(action), call, run, events, Start::AsRecorded)
                    .await
            }
        }
    }
}
