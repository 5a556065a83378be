//! The flow every action takes: matching rule → accepted → policy → authorized → dispatched
//! (durable before the first byte leaves) → observed → result stored → delivered.
//!
//! The gateway never calls a host for an execution whose ledger entry it could not write:
//! every host call is preceded by a flushed transition, and an error from the ledger stops the
//! flow before the host is touched.

use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::Poll;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tokio::sync::watch;
use waymark_core::{
    decide, AttachAction, ExecState, ExecutionId, Fingerprint, IncomingCall, MatchDecision,
    PriorExecution, ReviewVerdict, Timestamp, Transition,
};
use waymark_ledger::{
    CapturedOutput, Durability, ExecutionRecord, Ledger, LedgerError, ListQuery, StoredResult,
};

use crate::config::{Approval, Config, HostEntry};
use crate::host::{
    DispatchError, DispatchOutcome, EnvVar, FetchedOutput, HostExecutor, MarkerView,
};
use crate::tools::ResolvedCall;

const D: Durability = Durability::Flushed;

/// Errors of the flow itself (not outcomes of an execution).
#[derive(Debug, thiserror::Error)]
pub enum GatewayError {
    #[error(transparent)]
    Ledger(#[from] LedgerError),
    #[error("execution {0} is not in the ledger")]
    NotFound(ExecutionId),
    #[error("execution {id}: {why}")]
    Refused { id: ExecutionId, why: String },
    #[error("execution {id} names host {host:?}, which is no longer configured")]
    UnknownHost { id: ExecutionId, host: String },
}

/// What a call, status or attach ended with. `record.lifecycle.state` says which outcome.
#[derive(Clone, Debug)]
pub struct CallOutcome {
    pub record: ExecutionRecord,
    /// Set when this call attached to an earlier execution instead of starting one.
    pub attached: Option<AttachAction>,
    pub result: Option<StoredResult>,
    /// What to tell the caller, in words.
    pub message: String,
}

/// The current time, in milliseconds since the epoch.
pub fn now() -> Timestamp {
    Timestamp::from_millis(
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64),
    )
}

type Inflight = watch::Receiver<Option<CallOutcome>>;

/// Receives a command's output while it runs: `(is_stdout, offset, bytes)`.
pub type OutputSink<'a> = dyn Fn(bool, u64, &[u8]) + Send + Sync + 'a;

/// How often a streaming call reads new output from the host's marker.
const OUTPUT_POLL: Duration = Duration::from_millis(300);
/// Largest read of one poll; a poll keeps reading while reads come back full.
const OUTPUT_CHUNK: u64 = 256 * 1024;

/// The gateway: one per daemon (or per CLI process when no daemon runs).
pub struct Gateway<E: HostExecutor> {
    config: Arc<Config>,
    ledger: Ledger,
    exec: Arc<E>,
    inflight: Mutex<HashMap<ExecutionId, Inflight>>,
    intents: Mutex<HashMap<Fingerprint, Arc<tokio::sync::Mutex<()>>>>,
    approvals: Mutex<HashMap<ExecutionId, watch::Sender<Option<bool>>>>,
    /// Secret argument values of the executions this process dispatched, to mask in output.
    secrets: crate::mask::Secrets,
    /// Bytes of each stream fetched from the host and stored in the ledger.
    pub result_cap: u64,
    /// How long a call waits for an operator's approval before returning "pending".
    pub approval_wait: Duration,
    /// Crash-test hook: the process kills itself with SIGKILL right after this point of the
    /// flow (`accepted`, `dispatched` or `completed`). Set from `WAYMARK_CRASH_AT` by the
    /// daemon; tests use it to prove recovery from a crash at each point.
    pub crash_at: Option<String>,
    /// MCP-approval hook (additive): the id of every execution a call starts waiting on an
    /// approval for, so that a front end (the MCP server) can ask its user. Nothing reads it
    /// unless a caller subscribes ([`Gateway::approval_requests`]); sending never blocks.
    approval_requests: tokio::sync::broadcast::Sender<ExecutionId>,
}

fn crash_point(at: &Option<String>, point: &str) {
    if at.as_deref() == Some(point) {
        tracing::error!(point, "WAYMARK_CRASH_AT: killing this process with SIGKILL");
        // SAFETY: kill(2) on our own pid has no memory-safety preconditions.
        unsafe {
            libc::kill(libc::getpid(), libc::SIGKILL);
        }
    }
}

impl<E: HostExecutor> Gateway<E> {
    pub fn new(config: Arc<Config>, ledger: Ledger, exec: Arc<E>) -> Self {
        Gateway {
            config,
            ledger,
            exec,
            inflight: Mutex::new(HashMap::new()),
            intents: Mutex::new(HashMap::new()),
            approvals: Mutex::new(HashMap::new()),
            secrets: crate::mask::Secrets::default(),
            result_cap: 64 * 1024,
            approval_wait: Duration::from_secs(600),
            crash_at: None,
            approval_requests: tokio::sync::broadcast::channel(256).0,
        }
    }

    /// MCP-approval hook (additive): announces the id of each execution a call begins to wait
    /// on an approval for (the record is then `awaiting_approval`). A lagging receiver loses
    /// the oldest ids; the gateway itself never waits on a receiver.
    pub fn approval_requests(&self) -> tokio::sync::broadcast::Receiver<ExecutionId> {
        self.approval_requests.subscribe()
    }

    pub fn ledger(&self) -> &Ledger {
        &self.ledger
    }

    pub fn config(&self) -> &Config {
        &self.config
    }

    /// Whether new actions are refused.
    pub fn locked(&self) -> Result<bool, GatewayError> {
        Ok(self
            .ledger
            .setting("locked")?
            .and_then(|v| v.as_bool())
            .unwrap_or(false))
    }

    /// Locks or unlocks new actions; recorded in the audit chain.
    pub fn set_locked(&self, locked: bool, by: &str) -> Result<(), GatewayError> {
        self.ledger
            .set_setting("locked", serde_json::json!(locked), by, now(), D)?;
        Ok(())
    }

    fn outcome(
        &self,
        record: ExecutionRecord,
        attached: Option<AttachAction>,
    ) -> Result<CallOutcome, GatewayError> {
        let result = if record.lifecycle.result_observed {
            self.ledger.result(record.id)?
        } else {
            None
        };
        let message = describe_answer(&record, attached);
        Ok(CallOutcome {
            record,
            attached,
            result,
            message,
        })
    }

    fn host_of(&self, rec: &ExecutionRecord) -> Result<HostEntry, GatewayError> {
        self.config
            .hosts
            .get(&rec.host)
            .cloned()
            .ok_or_else(|| GatewayError::UnknownHost {
                id: rec.id,
                host: rec.host.clone(),
            })
    }

    fn get(&self, id: ExecutionId) -> Result<ExecutionRecord, GatewayError> {
        self.ledger.get(id)?.ok_or(GatewayError::NotFound(id))
    }

    /// Runs a resolved call to an outcome: a new execution, or an attach to an earlier one.
    pub async fn call(
        &self,
        call: ResolvedCall,
        run: Option<String>,
    ) -> Result<CallOutcome, GatewayError> {
        self.call_notify(call, run, &|_, _| {}).await
    }

    /// Like [`Gateway::call`]; `on_id` learns the execution id (and whether the call attached)
    /// as soon as it is decided, before anything is sent to the host.
    pub async fn call_notify(
        &self,
        call: ResolvedCall,
        run: Option<String>,
        on_id: &(dyn Fn(ExecutionId, Option<AttachAction>) + Send + Sync),
    ) -> Result<CallOutcome, GatewayError> {
        self.call_stream(call, run, on_id, None).await
    }

    /// Like [`Gateway::call_notify`]; `sink` also receives the command's output while it runs
    /// (read from the host's marker every few hundred milliseconds), when this call sends it.
    pub async fn call_stream(
        &self,
        call: ResolvedCall,
        run: Option<String>,
        on_id: &(dyn Fn(ExecutionId, Option<AttachAction>) + Send + Sync),
        sink: Option<&OutputSink<'_>>,
    ) -> Result<CallOutcome, GatewayError> {
        let key = self.ledger.fingerprint_key();
        let action = call.request.canonicalize(&key);
        let fingerprint = action.fingerprint(&key);
        // Two racing calls of one intent must not both decide "new".
        let lock = {
            let mut m = self.intents.lock().expect("intents");
            m.entry(fingerprint).or_default().clone()
        };
        let guard = lock.lock().await;
        let t = now();
        if let Some(r) = &run {
            let _ = self.ledger.count_call(r);
        }
        let priors: Vec<PriorExecution> = self
            .ledger
            .by_fingerprint(&fingerprint)?
            .into_iter()
            .map(|r| PriorExecution {
                id: r.id,
                lifecycle: r.lifecycle,
                actor: r.actor,
                scope: r.scope,
                accepted_at: r.accepted_at,
                finished_at: r.finished_at,
            })
            .collect();
        let incoming = IncomingCall {
            actor: call.request.actor.clone(),
            scope: call.request.scope.clone(),
            policy: call.policy,
            now: t,
        };
        match decide(&priors, &incoming) {
            MatchDecision::New => {
                let id = self.ledger.mint_id(t);
                let new = waymark_ledger::NewExecution {
                    id,
                    fingerprint,
                    action,
                    actor: call.request.actor.clone(),
                    scope: call.request.scope.clone(),
                    tool: call.tool.clone(),
                    host: call.host.name.clone(),
                    contract: call.policy.contract,
                    run: run.clone(),
                };
                // Accepted, the policy's answer and (when the policy lets it go) dispatched reach
                // the disk in one flush, before anyone learns the id and before the first byte
                // leaves: a crash in between leaves none of them, and nothing was sent.
                let rec = self.ledger.accept(new, t, Durability::Buffered)?;
                let rec = self.admit(rec, &call, run.as_deref(), true)?;
                drop(guard);
                self.release_intent(&fingerprint, lock);
                on_id(rec.id, None);
                crash_point(&self.crash_at, "accepted");
                let fresh = rec.state() == ExecState::Dispatched;
                self.drive(rec.id, None, &call, run.as_deref(), sink, fresh)
                    .await
            }
            MatchDecision::Attach { execution, action } => {
                let rec = self.ledger.record_attach(
                    execution,
                    call.request.actor.clone(),
                    action,
                    run.clone(),
                    t,
                    D,
                )?;
                drop(guard);
                self.release_intent(&fingerprint, lock);
                on_id(rec.id, Some(action));
                self.attach(rec, action, &call, run.as_deref(), sink).await
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

    /// Applies policy to an accepted execution: locked → denied; approval → awaiting approval;
    /// otherwise authorized. Returns the record after it, its last write flushed (and with it
    /// every buffered write before, the acceptance included); the wait for an operator, if
    /// any, is [`Gateway::settle_approval`]'s.
    ///
    /// With `dispatch`, an authorized execution is also recorded as dispatched (its first
    /// attempt), both in one flush: the caller then sends it with [`Gateway::send`].
    fn admit(
        &self,
        rec: ExecutionRecord,
        call: &ResolvedCall,
        run: Option<&str>,
        dispatch: bool,
    ) -> Result<ExecutionRecord, GatewayError> {
        let id = rec.id;
        if self.locked()? {
            let deny = Transition::Deny {
                by: "policy".into(),
                reason:
                    "locked: Waymark refuses new actions until an operator runs `waymark unlock`"
                        .into(),
            };
            return Ok(self.ledger.transition(id, deny, now(), D)?);
        }
        let approved_session = match (&call.approval, session_key(run, call)) {
            (Approval::Session, Some(k)) => self.ledger.setting(&k)?.is_some(),
            _ => false,
        };
        let by = match call.approval {
            Approval::None => "policy",
            Approval::Session if approved_session => "session approval",
            Approval::Session | Approval::PerCall => {
                return Ok(self
                    .ledger
                    .transition(id, Transition::RequestApproval, now(), D)?);
            }
        };
        // With `dispatch`, the dispatch's flush makes the authorization durable too.
        let durability = if dispatch { Durability::Buffered } else { D };
        let authorized = self.ledger.transition(
            id,
            Transition::Authorize { by: by.into() },
            now(),
            durability,
        )?;
        if !dispatch {
            return Ok(authorized);
        }
        let attempt = authorized.dispatch_attempts + 1;
        Ok(self
            .ledger
            .transition(id, Transition::Dispatch { attempt }, now(), D)?)
    }

    /// Waits for the operator's answer to an execution awaiting approval; an approval of a
    /// session-approved tool is remembered for the rest of the agent run.
    async fn settle_approval(
        &self,
        rec: ExecutionRecord,
        call: &ResolvedCall,
        run: Option<&str>,
    ) -> Result<ExecutionRecord, GatewayError> {
        let rec = self.wait_for_approval(rec).await?;
        if rec.state() == ExecState::Authorized {
            if let (Approval::Session, Some(k)) = (call.approval, session_key(run, call)) {
                self.ledger
                    .set_setting(&k, serde_json::json!(true), "operator", now(), D)?;
            }
        }
        Ok(rec)
    }

    async fn wait_for_approval(
        &self,
        rec: ExecutionRecord,
    ) -> Result<ExecutionRecord, GatewayError> {
        let mut rx = {
            let mut m = self.approvals.lock().expect("approvals");
            m.entry(rec.id)
                .or_insert_with(|| watch::channel(None).0)
                .subscribe()
        };
        // MCP-approval hook: no receiver is not an error.
        let _ = self.approval_requests.send(rec.id);
        let _ = tokio::time::timeout(self.approval_wait, rx.wait_for(|v| v.is_some())).await;
        self.get(rec.id)
    }

    /// An operator approves a call that awaits approval.
    pub fn approve(&self, id: ExecutionId, by: &str) -> Result<ExecutionRecord, GatewayError> {
        let rec = self.get(id)?;
        if rec.state() != ExecState::AwaitingApproval {
            return Err(GatewayError::Refused {
                id,
                why: format!("it is {}, not awaiting approval", rec.state()),
            });
        }
        let rec = self
            .ledger
            .transition(id, Transition::Authorize { by: by.into() }, now(), D)?;
        if let Some(tx) = self.approvals.lock().expect("approvals").get(&id) {
            let _ = tx.send(Some(true));
        }
        Ok(rec)
    }

    /// An operator denies a call that awaits approval.
    pub fn deny(
        &self,
        id: ExecutionId,
        by: &str,
        reason: &str,
    ) -> Result<ExecutionRecord, GatewayError> {
        let rec = self.get(id)?;
        if rec.state() != ExecState::AwaitingApproval {
            return Err(GatewayError::Refused {
                id,
                why: format!("it is {}, not awaiting approval", rec.state()),
            });
        }
        let rec = self.ledger.transition(
            id,
            Transition::Deny {
                by: by.into(),
                reason: reason.into(),
            },
            now(),
            D,
        )?;
        if let Some(tx) = self.approvals.lock().expect("approvals").get(&id) {
            let _ = tx.send(Some(false));
        }
        Ok(rec)
    }

    /// Executions awaiting approval, oldest first.
    pub fn pending_approvals(&self) -> Result<Vec<ExecutionRecord>, GatewayError> {
        let q = ListQuery {
            state: Some(ExecState::AwaitingApproval),
            oldest_first: true,
            limit: 1000,
            ..Default::default()
        };
        Ok(self.ledger.list(&q)?.items)
    }

    /// Drives an execution to an outcome, unless another task of this process already drives
    /// it: then waits for that task's outcome. One driver per execution at a time, so two
    /// racing calls can never both authorize or both send it.
    async fn drive(
        &self,
        id: ExecutionId,
        attached: Option<AttachAction>,
        call: &ResolvedCall,
        run: Option<&str>,
        sink: Option<&OutputSink<'_>>,
        fresh: bool,
    ) -> Result<CallOutcome, GatewayError> {
        let (tx, rx) = watch::channel(None);
        let existing = {
            let mut m = self.inflight.lock().expect("inflight");
            match m.get(&id) {
                Some(other) => Some(other.clone()),
                None => {
                    m.insert(id, rx);
                    None
                }
            }
        };
        if let Some(other) = existing {
            return self.wait_inflight(other, attached).await;
        }
        let result = self.advance(id, call, run, sink, fresh).await;
        self.inflight.lock().expect("inflight").remove(&id);
        if let Ok(o) = &result {
            let _ = tx.send(Some(o.clone()));
        }
        result.map(|mut o| {
            o.attached = attached;
            o.message = describe_answer(&o.record, attached);
            o
        })
    }

    /// Moves an execution on from wherever it stands now (read fresh from the ledger): policy,
    /// approval, dispatch, or a marker check and a wait. `fresh`: this call has just recorded
    /// the execution's first dispatch itself, and nothing was sent since.
    async fn advance(
        &self,
        id: ExecutionId,
        call: &ResolvedCall,
        run: Option<&str>,
        sink: Option<&OutputSink<'_>>,
        fresh: bool,
    ) -> Result<CallOutcome, GatewayError> {
        let mut rec = self.get(id)?;
        if rec.state() == ExecState::Accepted {
            rec = self.admit(rec, call, run, false)?;
        }
        if rec.state() == ExecState::AwaitingApproval {
            rec = self.settle_approval(rec, call, run).await?;
        }
        match rec.state() {
            ExecState::Authorized => self.dispatch_inner(rec, call, sink).await,
            ExecState::Dispatched if fresh && rec.dispatch_attempts == 1 => {
                self.send(rec, call, sink).await
            }
            ExecState::Dispatched | ExecState::Unknown | ExecState::Running => {
                let host = self.host_of(&rec)?;
                let view = match self.exec.status(&host, rec.id).await {
                    Ok(v) => v,
                    Err(e) => {
                        let mut o = self.outcome(rec, None)?;
                        o.message = format!(
                            "{} The host could not be asked ({e}); run `waymark exec status {}` later.",
                            o.message, o.record.id
                        );
                        return Ok(o);
                    }
                };
                if view == MarkerView::Absent && rec.state() != ExecState::Running {
                    // Never started: send it again under the same id; the marker makes that safe.
                    return self.dispatch_inner(rec, call, sink).await;
                }
                let rec = self.apply_marker(rec, view, &host).await?;
                let bound = call.timeout + Duration::from_secs(5);
                let rec = self.wait_on_host(rec, &host, bound).await?;
                self.outcome(rec, None)
            }
            _ => self.outcome(rec, None),
        }
    }

    async fn dispatch_inner(
        &self,
        rec: ExecutionRecord,
        call: &ResolvedCall,
        sink: Option<&OutputSink<'_>>,
    ) -> Result<CallOutcome, GatewayError> {
        let attempt = rec.dispatch_attempts + 1;
        // Durable BEFORE the first byte leaves.
        let rec = self
            .ledger
            .transition(rec.id, Transition::Dispatch { attempt }, now(), D)?;
        self.send(rec, call, sink).await
    }

    /// Sends an execution whose dispatch is already recorded (and flushed), and records what
    /// came back.
    async fn send(
        &self,
        rec: ExecutionRecord,
        call: &ResolvedCall,
        sink: Option<&OutputSink<'_>>,
    ) -> Result<CallOutcome, GatewayError> {
        let id = rec.id;
        self.secrets.remember(id, &call.request);
        crash_point(&self.crash_at, "dispatched");
        let send = self.exec.dispatch(
            &call.host,
            id,
            call.request.exposed_argv(id),
            call.request.cwd.clone(),
            call.request
                .env
                .iter()
                .map(|(name, word)| EnvVar {
                    name: name.clone(),
                    value: word.expose(id),
                    secret: word.has_secret(),
                })
                .collect(),
            call.timeout,
        );
        let sent = match sink {
            None => send.await,
            Some(sink) => {
                // Both futures are polled together: the poller must never keep the dispatch
                // from making progress (it may hold the connection's install lock).
                let poller = async {
                    let mut offsets = [0u64; 2];
                    loop {
                        tokio::time::sleep(OUTPUT_POLL).await;
                        for (i, is_stdout) in [(0, true), (1, false)] {
                            // Errors are fine here: the marker may not exist yet.
                            while let Ok((mut bytes, _)) = self
                                .exec
                                .read_output(&call.host, id, is_stdout, offsets[i], OUTPUT_CHUNK)
                                .await
                            {
                                if bytes.is_empty() {
                                    break;
                                }
                                // Same length masked: offsets stay the host's.
                                self.secrets.mask(id, &mut bytes);
                                sink(is_stdout, offsets[i], &bytes);
                                offsets[i] += bytes.len() as u64;
                                if (bytes.len() as u64) < OUTPUT_CHUNK {
                                    break;
                                }
                            }
                        }
                    }
                };
                tokio::select! {
                    r = send => r,
                    never = poller => never,
                }
            }
        };
        let rec = match sent {
            Ok(DispatchOutcome::Finished {
                outcome,
                stdout,
                stderr,
            }) => {
                let result = StoredResult {
                    stdout: captured(stdout, self.result_cap),
                    stderr: captured(stderr, self.result_cap),
                };
                self.observe_with_result(id, Transition::Finished { outcome }, result, now(), D)?
            }
            Ok(DispatchOutcome::Observed(view)) => {
                let rec = self.apply_marker(rec, view, &call.host).await?;
                let bound = call.timeout + Duration::from_secs(5);
                self.wait_on_host(rec, &call.host, bound).await?
            }
            Err(DispatchError::NotSent(reason)) => self.observe(
                id,
                Transition::NotStarted {
                    reason: format!("not sent: {reason}"),
                },
                now(),
                D,
            )?,
            Err(DispatchError::Lost(reason)) => {
                self.observe(id, Transition::Lost { reason }, now(), D)?
            }
        };
        if rec.lifecycle.result_observed {
            crash_point(&self.crash_at, "completed");
        }
        self.outcome(rec, None)
    }

    async fn wait_inflight(
        &self,
        mut rx: Inflight,
        attached: Option<AttachAction>,
    ) -> Result<CallOutcome, GatewayError> {
        let done = rx
            .wait_for(|v| v.is_some())
            .await
            .ok()
            .and_then(|v| v.clone());
        match done {
            Some(mut o) => {
                o.attached = attached;
                o.message = describe_answer(&o.record, attached);
                Ok(o)
            }
            None => Err(GatewayError::Refused {
                id: ExecutionId::from_bytes([0; 16]),
                why: "the dispatching task ended without an outcome".into(),
            }),
        }
    }

    async fn attach(
        &self,
        rec: ExecutionRecord,
        action: AttachAction,
        call: &ResolvedCall,
        run: Option<&str>,
        sink: Option<&OutputSink<'_>>,
    ) -> Result<CallOutcome, GatewayError> {
        match action {
            AttachAction::ReturnDenial
            | AttachAction::ReturnStoredResult
            | AttachAction::NeedsReview => self.outcome(rec, Some(action)),
            // Waiting on approval, continuing, or asking the marker: join whoever drives it,
            // or drive it on from where it stands.
            AttachAction::PendingApproval
            | AttachAction::Continue
            | AttachAction::AskHostMarker => {
                self.drive(rec.id, Some(action), call, run, sink, false)
                    .await
            }
        }
    }

    /// Polls the marker of a running execution until it ends or `bound` passes.
    async fn wait_on_host(
        &self,
        mut rec: ExecutionRecord,
        host: &HostEntry,
        bound: Duration,
    ) -> Result<ExecutionRecord, GatewayError> {
        let deadline = tokio::time::Instant::now() + bound;
        let mut pause = Duration::from_millis(50);
        while matches!(rec.state(), ExecState::Running | ExecState::Dispatched)
            && tokio::time::Instant::now() < deadline
        {
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(Duration::from_millis(500));
            match self.exec.status(host, rec.id).await {
                Ok(view) => rec = self.apply_marker(rec, view, host).await?,
                Err(_) => break,
            }
        }
        Ok(rec)
    }

    /// Moves the ledger to what the host's marker proves.
    async fn apply_marker(
        &self,
        rec: ExecutionRecord,
        view: MarkerView,
        host: &HostEntry,
    ) -> Result<ExecutionRecord, GatewayError> {
        let id = rec.id;
        let state = rec.state();
        if !state.may_be_on_host() {
            return Ok(rec);
        }
        let rec = match view {
            // No marker: it has not started. It stays as it is, never "failed": a request
            // delayed in the network could still arrive, and only the same id is safe to send
            // again (a retry or `exec resume` does that; the marker refuses a second start).
            MarkerView::Absent => rec,
            MarkerView::Starting | MarkerView::Running { .. } => {
                let pid = if let MarkerView::Running { pid } = view {
                    pid
                } else {
                    None
                };
                if state == ExecState::Running {
                    rec
                } else {
                    self.observe(id, Transition::Started { pid }, now(), D)?
                }
            }
            MarkerView::Finished(outcome) => {
                match self.exec.fetch_output(host, id, self.result_cap).await {
                    Ok((stdout, stderr)) => {
                        let result = StoredResult {
                            stdout: captured(stdout, self.result_cap),
                            stderr: captured(stderr, self.result_cap),
                        };
                        self.observe_with_result(
                            id,
                            Transition::Finished { outcome },
                            result,
                            now(),
                            D,
                        )?
                    }
                    // Never an empty result for a failed fetch: the outcome stays open (the
                    // marker keeps the output) and the next status, retry or reconcile
                    // fetches it again.
                    Err(e) if state == ExecState::Unknown => {
                        tracing::info!(%id, error = %e, "output fetch failed; still unknown");
                        rec
                    }
                    Err(e) => {
                        let reason = format!("{OUTPUT_NOT_FETCHED} ({e})");
                        self.observe(id, Transition::Lost { reason }, now(), D)?
                    }
                }
            }
            MarkerView::Interrupted => self.observe(id, Transition::Interrupted, now(), D)?,
            MarkerView::NotLaunched { reason } => {
                let reason = format!("the host never launched it: {reason}");
                self.observe(id, Transition::NotStarted { reason }, now(), D)?
            }
        };
        Ok(rec)
    }

    /// Records what the host showed. Two tasks can observe the same end (the driver's reply and
    /// a status or cancel request); the marker is one truth, so the first record wins and a
    /// later, now illegal, observation returns the record as it stands.
    fn observe(
        &self,
        id: ExecutionId,
        t: Transition,
        at: Timestamp,
        d: Durability,
    ) -> Result<ExecutionRecord, GatewayError> {
        self.settle(id, self.ledger.transition(id, t, at, d))
    }

    fn observe_with_result(
        &self,
        id: ExecutionId,
        t: Transition,
        mut result: StoredResult,
        at: Timestamp,
        d: Durability,
    ) -> Result<ExecutionRecord, GatewayError> {
        // The stored heads are masked; sizes and hashes stay those of the streams on the host.
        self.secrets.mask(id, &mut result.stdout.head);
        self.secrets.mask(id, &mut result.stderr.head);
        self.settle(id, self.ledger.transition_with_result(id, t, result, at, d))
    }

    fn settle(
        &self,
        id: ExecutionId,
        r: Result<ExecutionRecord, LedgerError>,
    ) -> Result<ExecutionRecord, GatewayError> {
        match r {
            Err(LedgerError::Illegal { .. }) => {
                let rec = self.get(id)?;
                if rec.lifecycle.result_observed || rec.state() == ExecState::Running {
                    Ok(rec)
                } else {
                    Err(GatewayError::Refused {
                        id,
                        why: format!(
                            "cannot record the host's observation in state {}",
                            rec.state()
                        ),
                    })
                }
            }
            other => Ok(other?),
        }
    }

    fn retry_window(&self, rec: &ExecutionRecord) -> Duration {
        self.config
            .tools
            .get(&rec.tool)
            .map_or(Duration::from_secs(600), |t| t.retry_window)
    }

    /// The ledger's view of an execution, reconciled with a live check of its host marker when
    /// it may be on the host.
    pub async fn status(
        &self,
        id: ExecutionId,
    ) -> Result<(CallOutcome, Option<String>), GatewayError> {
        let rec = self.get(id)?;
        if !rec.state().may_be_on_host() {
            return Ok((self.outcome(rec, None)?, None));
        }
        let host = self.host_of(&rec)?;
        if self.inflight.lock().expect("inflight").contains_key(&id) {
            // Its driver records how it ends; a status check records only that it started, so
            // a command already running reads as running, not "not yet seen to start".
            if rec.state() == ExecState::Dispatched {
                if let Ok(MarkerView::Starting | MarkerView::Running { .. }) =
                    self.exec.status(&host, id).await
                {
                    let rec = self.observe(id, Transition::Started { pid: None }, now(), D)?;
                    return Ok((self.outcome(rec, None)?, None));
                }
            }
            return Ok((self.outcome(rec, None)?, None));
        }
        match self.exec.status(&host, id).await {
            Ok(view) => {
                let rec = self.apply_marker(rec, view, &host).await?;
                Ok((self.outcome(rec, None)?, None))
            }
            Err(e) => Ok((self.outcome(rec, None)?, Some(e))),
        }
    }

    /// Output of an execution by offset, read from the host's marker (the ledger keeps only
    /// the first `result_cap` bytes of each stream).
    pub async fn read_output(
        &self,
        id: ExecutionId,
        stdout: bool,
        offset: u64,
        max: u64,
    ) -> Result<(Vec<u8>, u64), GatewayError> {
        let rec = self.get(id)?;
        let host = self.host_of(&rec)?;
        let (mut bytes, size) = self
            .exec
            .read_output(&host, id, stdout, offset, max)
            .await
            .map_err(|why| GatewayError::Refused {
                id,
                why: format!("cannot read its output from host {}: {why}", host.name),
            })?;
        self.secrets.mask(id, &mut bytes);
        Ok((bytes, size))
    }

    /// Records that the caller has the result (the transport accepted the write).
    pub fn delivered(&self, id: ExecutionId) -> Result<ExecutionRecord, GatewayError> {
        let rec = self.get(id)?;
        if rec.state().has_result() && !rec.lifecycle.result_delivered {
            return Ok(self
                .ledger
                .transition(id, Transition::Delivered, now(), D)?);
        }
        Ok(rec)
    }

    /// Cancels an execution: before dispatch in the ledger, after dispatch on the host.
    pub async fn cancel(&self, id: ExecutionId, by: &str) -> Result<CallOutcome, GatewayError> {
        let rec = self.get(id)?;
        match rec.state() {
            ExecState::Accepted | ExecState::AwaitingApproval | ExecState::Authorized => {
                let rec = self.ledger.transition(
                    id,
                    Transition::CancelBeforeDispatch { by: by.into() },
                    now(),
                    D,
                )?;
                if let Some(tx) = self.approvals.lock().expect("approvals").get(&id) {
                    let _ = tx.send(Some(false));
                }
                self.outcome(rec, None)
            }
            s if s.may_be_on_host() => {
                let host = self.host_of(&rec)?;
                let view = self
                    .exec
                    .cancel(&host, id)
                    .await
                    .map_err(|why| GatewayError::Refused { id, why })?;
                let rec = self.apply_marker(rec, view, &host).await?;
                let rec = self
                    .wait_on_host(rec, &host, Duration::from_secs(15))
                    .await?;
                self.outcome(rec, None)
            }
            s => Err(GatewayError::Refused {
                id,
                why: format!("it is already {s}"),
            }),
        }
    }

    /// A human resolves an unknown or interrupted execution.
    pub fn review(
        &self,
        id: ExecutionId,
        ran: bool,
        by: &str,
        note: &str,
    ) -> Result<ExecutionRecord, GatewayError> {
        let verdict = if ran {
            ReviewVerdict::Ran
        } else {
            ReviewVerdict::DidNotRun
        };
        Ok(self.ledger.transition(
            id,
            Transition::Review {
                verdict,
                by: by.into(),
                note: note.into(),
            },
            now(),
            D,
        )?)
    }

    /// Re-sends an execution under its own id (safe: the marker refuses a second start).
    /// Needs the call, since secret arguments are not in the ledger.
    pub async fn resume(
        &self,
        id: ExecutionId,
        call: &ResolvedCall,
    ) -> Result<CallOutcome, GatewayError> {
        let rec = self.get(id)?;
        let key = self.ledger.fingerprint_key();
        if call.request.fingerprint(&key) != rec.fingerprint {
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
                self.drive(id, Some(AttachAction::Continue), call, None, None, false)
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

    /// On daemon start: every execution left dispatched, running or unknown is checked
    /// against its host marker; accepted or authorized ones past their window expire.
    ///
    /// Markers are read in batches ([`RECONCILE_BATCH`] ids per wrapper call, one round trip
    /// each), a few batches at once over the pooled connections, every host at the same time;
    /// what they show is then recorded a few executions at a time (a finished one also fetches
    /// its output).
    pub async fn reconcile(&self) -> Result<ReconcileReport, GatewayError> {
        let mut report = ReconcileReport::default();
        let mut by_host: BTreeMap<String, Vec<ExecutionRecord>> = BTreeMap::new();
        for state in [
            ExecState::Dispatched,
            ExecState::Running,
            ExecState::Unknown,
        ] {
            let q = ListQuery {
                state: Some(state),
                limit: 100_000,
                oldest_first: true,
                ..Default::default()
            };
            for rec in self.ledger.list(&q)?.items {
                report.checked += 1;
                by_host.entry(rec.host.clone()).or_default().push(rec);
            }
        }
        let mut batches = Vec::new();
        for (name, recs) in by_host {
            let Some(host) = self.config.hosts.get(&name) else {
                report.unreachable += recs.len() as u64;
                continue;
            };
            for chunk in recs.chunks(RECONCILE_BATCH) {
                batches.push((host.clone(), chunk.to_vec()));
            }
        }
        let looked = join_bounded(batches, RECONCILE_PARALLEL, |(host, recs)| async move {
            let ids: Vec<ExecutionId> = recs.iter().map(|r| r.id).collect();
            let views = self.exec.status_many(&host, &ids).await;
            (host, recs, views)
        })
        .await;
        let mut seen = Vec::new();
        for (host, recs, views) in looked {
            match views {
                Ok(views) if views.len() == recs.len() => {
                    seen.extend(
                        recs.into_iter()
                            .zip(views)
                            .map(|(r, v)| (host.clone(), r, v)),
                    );
                }
                Ok(views) => {
                    tracing::warn!(host = %host.name, asked = recs.len(), got = views.len(), "reconcile: the host answered for a different number of executions");
                    report.unreachable += recs.len() as u64;
                }
                Err(e) => {
                    tracing::warn!(host = %host.name, error = %e, "reconcile: cannot read markers");
                    report.unreachable += recs.len() as u64;
                }
            }
        }
        let applied = join_bounded(seen, RECONCILE_PARALLEL, |(host, rec, view)| async move {
            let before = rec.state();
            self.apply_marker(rec, view, &host)
                .await
                .map(|after| after.state() != before)
        })
        .await;
        for moved in applied {
            if moved? {
                report.moved += 1;
            }
        }
        for state in [
            ExecState::Accepted,
            ExecState::Authorized,
            ExecState::AwaitingApproval,
        ] {
            let q = ListQuery {
                state: Some(state),
                limit: 100_000,
                oldest_first: true,
                ..Default::default()
            };
            for rec in self.ledger.list(&q)?.items {
                if now().since(rec.accepted_at) > self.retry_window(&rec) {
                    self.ledger
                        .transition(rec.id, Transition::Expire, now(), D)?;
                    report.expired += 1;
                }
            }
        }
        Ok(report)
    }
}

/// Executions whose markers one wrapper call reads during [`Gateway::reconcile`].
pub const RECONCILE_BATCH: usize = 100;
/// Wrapper calls (and recordings) in flight at once during [`Gateway::reconcile`].
const RECONCILE_PARALLEL: usize = 8;

/// Runs `f` on every item with at most `limit` futures in flight at once, all on the calling
/// task (so they may borrow), and returns the outputs in the items' order.
async fn join_bounded<T, F, Fut>(items: Vec<T>, limit: usize, f: F) -> Vec<Fut::Output>
where
    F: Fn(T) -> Fut,
    Fut: Future,
{
    let total = items.len();
    let mut pending = items.into_iter().enumerate();
    let mut running: Vec<(usize, Pin<Box<Fut>>)> = Vec::new();
    let mut out: Vec<Option<Fut::Output>> = (0..total).map(|_| None).collect();
    std::future::poll_fn(|cx| loop {
        while running.len() < limit.max(1) {
            match pending.next() {
                Some((i, item)) => running.push((i, Box::pin(f(item)))),
                None => break,
            }
        }
        if running.is_empty() {
            return Poll::Ready(());
        }
        let mut finished = false;
        let mut k = 0;
        while k < running.len() {
            if let Poll::Ready(v) = running[k].1.as_mut().poll(cx) {
                out[running[k].0] = Some(v);
                running.swap_remove(k);
                finished = true;
            } else {
                k += 1;
            }
        }
        if !finished {
            return Poll::Pending;
        }
    })
    .await;
    out.into_iter()
        .map(|o| o.expect("every future finished"))
        .collect()
}

/// What [`Gateway::reconcile`] did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ReconcileReport {
    pub checked: u64,
    pub moved: u64,
    pub unreachable: u64,
    pub expired: u64,
}

fn captured(f: FetchedOutput, cap: u64) -> CapturedOutput {
    let mut c = CapturedOutput::capture(&f.bytes, cap as usize);
    if f.total > f.bytes.len() as u64 {
        c.total_bytes = f.total;
        c.sha256 = f.sha256.unwrap_or_default();
    }
    c
}

/// The reason recorded when an execution ended on the host but its output did not arrive.
const OUTPUT_NOT_FETCHED: &str = "it ended on the host, but its output could not be fetched";

/// A plain summary of an execution: what is known, and what to do next.
pub fn describe(rec: &ExecutionRecord, attached: Option<AttachAction>) -> String {
    let delivery = if rec.state().has_result() && !rec.lifecycle.result_delivered {
        " Result not yet delivered to the caller."
    } else {
        ""
    };
    format!("{}{delivery}", describe_answer(rec, attached))
}

/// The summary that travels with a call's answer. The answer carrying it is the delivery, so
/// it never says the result was not delivered (the ledger records delivery once the answer was
/// written, after this text was made).
pub fn describe_answer(rec: &ExecutionRecord, attached: Option<AttachAction>) -> String {
    let id = rec.id;
    let prefix = match attached {
        Some(_) => format!("Attached to earlier execution {id} (same intent; not run again). "),
        None => String::new(),
    };
    let body = match rec.state() {
        ExecState::Completed => match &rec.outcome {
            Some(waymark_core::Outcome::Exited { exit_code: Some(c), .. }) => format!("Completed on the host with exit code {c}."),
            Some(waymark_core::Outcome::Exited { signal: Some(s), .. }) => format!("Completed on the host: killed by signal {s}."),
            _ => "Completed on the host.".into(),
        },
        ExecState::TimedOut => "Timed out: the host killed it when its timeout ran out.".into(),
        ExecState::Cancelled => "Cancelled.".into(),
        ExecState::Failed => format!(
            "Did not start ({}). Nothing ran; it is safe to call again.",
            rec.reason.as_deref().unwrap_or("no reason recorded")
        ),
        ExecState::Unknown => match rec.reason.as_deref() {
            Some(r) if r.starts_with(OUTPUT_NOT_FETCHED) => format!(
                "Its output has not reached Waymark yet: {r}. The host keeps it: `waymark exec status {id}` (or the same call again) fetches it; it will not run again."
            ),
            r => format!(
                "Outcome UNKNOWN: the connection was lost after the command may have been sent ({}). It may still be running. Do not retry blindly: run `waymark exec status {id}`.",
                r.unwrap_or("no reason recorded")
            ),
        },
        ExecState::Dispatched => format!("Dispatched; Waymark has not yet seen it start. Run `waymark exec status {id}`."),
        ExecState::Running => format!("Running on the host. Run `waymark exec status {id}` or `waymark exec result {id}` later."),
        ExecState::AwaitingApproval => format!("Awaiting approval: an operator runs `waymark approve {id}` or `waymark deny {id} --reason ...`."),
        ExecState::Authorized | ExecState::Accepted => "Accepted; not yet sent to the host.".into(),
        ExecState::Denied => format!("Denied: {}.", rec.reason.as_deref().unwrap_or("no reason recorded")),
        ExecState::Expired => "Expired: it was never authorized or sent within its window.".into(),
        ExecState::Interrupted => format!(
            "Interrupted: it started on the host, then its process vanished with no exit record (a reboot?). A human must review it: `waymark exec review {id} --ran|--did-not-run --note ...`."
        ),
        ExecState::Reviewed => format!("Reviewed by a human: {}.", rec.reason.as_deref().unwrap_or("")),
    };
    format!("{prefix}{body}")
}

/// The ledger setting that remembers an operator's approval of a session-approved tool for one
/// agent run.
fn session_key(run: Option<&str>, call: &ResolvedCall) -> Option<String> {
    run.map(|r| format!("approved_session:{r}:{}", call.tool))
}
