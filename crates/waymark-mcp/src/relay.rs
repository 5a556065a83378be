//! A `tools/call` relayed to the daemon as a plain call (not a task): progress notifications
//! from its events, the client's cancellation (which cancels the execution only where its
//! replay contract makes that harmless), and the approval question of an execution that
//! awaits approval, asked the way the client's protocol revision allows ([`ApprovalAsk`]).

use std::sync::Mutex;

use rmcp::model::{
    CallToolResponse, ElicitResult, InputRequiredResult, ProgressToken, ProtocolVersion,
};
use rmcp::service::RequestContext;
use rmcp::{ErrorData, RoleServer};
use waymark_core::{ExecState, ExecutionId, ReplayContract};
use waymark_protocol::answer::CallAnswer;
use waymark_protocol::client::ClientError;
use waymark_protocol::{ApprovalQuestion, Event, ExecutionView, Frame, Request};

use crate::approval;
use crate::progress::Progress;
use crate::server::{client_answers_forms, no_daemon, WaymarkMcp};
use crate::tasks;
use crate::tools::{execution_result, lost_call};

/// Whether this request runs under 2026-07-28 or later (no server-to-client requests).
fn is_modern(context: &RequestContext<RoleServer>) -> bool {
    context
        .protocol_version()
        .is_some_and(|v| v.as_str() >= ProtocolVersion::V_2026_07_28.as_str())
}

/// How a call asks its client about an execution that awaits approval.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum ApprovalAsk {
    /// Before 2026-07-28, to a client that answers form elicitations: `elicitation/create`,
    /// once per execution in the session.
    Elicitation,
    /// From 2026-07-28 on (no server-to-client requests), to a client that answers forms: an
    /// `input_required` result, answered by the client's retry.
    InputRequired,
    /// The client cannot answer: the execution waits for an operator.
    NotAsked,
}

impl ApprovalAsk {
    fn of(context: &RequestContext<RoleServer>) -> ApprovalAsk {
        match is_modern(context) {
            false if approval::supported(&context.peer) => ApprovalAsk::Elicitation,
            true if client_answers_forms(context) => ApprovalAsk::InputRequired,
            _ => ApprovalAsk::NotAsked,
        }
    }
}

impl WaymarkMcp {
    /// The replay contract of a call's tool (`None`: raw command, irreversible); `None` back
    /// when it cannot be told.
    async fn contract_of(&self, tool: Option<&str>) -> Option<ReplayContract> {
        let Some(name) = tool else {
            return Some(ReplayContract::Irreversible);
        };
        let catalog = self.catalog().await.ok()?;
        catalog
            .tools
            .iter()
            .find(|t| t.name == name)
            .map(|t| t.contract)
    }

    /// Relays a tool call to the daemon: as a task when the client takes tasks, else as a
    /// plain call with progress for a client that sent a `progressToken`.
    pub(crate) async fn relay_call(
        &self,
        call: Request,
        tool: Option<&str>,
        as_task: bool,
        token: Option<ProgressToken>,
        context: &RequestContext<RoleServer>,
        answer: Option<ElicitResult>,
    ) -> Result<CallToolResponse, ErrorData> {
        if as_task {
            return self.start_task(call, token, context).await;
        }
        let progress = token.map(Progress::new);
        self.call(call, tool, context, progress, answer).await
    }

    /// The client cancelled a call: cancel its execution when its contract makes that harmless
    /// (read_only, idempotent); otherwise leave it running (a later identical call attaches).
    async fn cancel_execution(&self, tool: Option<&str>, id: ExecutionId) {
        match self.contract_of(tool).await {
            Some(c) if tasks::cancellable(c) => {
                match self.backend.request(Request::Cancel { id }, &|_| {}).await {
                    Ok(Frame::Done { .. }) => {
                        tracing::info!(%id, "cancelled at the client's request")
                    }
                    other => tracing::info!(%id, answer = ?other.ok(), "could not cancel"),
                }
            }
            c => {
                tracing::info!(%id, contract = ?c, "client cancelled; the command runs to its end")
            }
        }
    }

    /// A call of a configured tool or a raw command; the response carries the result, so its
    /// delivery is marked once the response is written ([`crate::delivery`]). With a progress
    /// token, the daemon's events go to the client as progress notifications meanwhile.
    ///
    /// An approval the execution waits on is asked through `elicitation/create` in a session
    /// before 2026-07-28; from 2026-07-28 on, where the server may not send requests, the call
    /// answers `input_required` (SEP-2322) with the question, and the client's retry (the same
    /// call, which attaches to the same execution) carries the answer in `answer`, applied to
    /// the execution the daemon names for it, never to an id the client sends.
    pub(crate) async fn call(
        &self,
        req: Request,
        tool: Option<&str>,
        context: &RequestContext<RoleServer>,
        progress: Option<Progress>,
        answer: Option<ElicitResult>,
    ) -> Result<CallToolResponse, ErrorData> {
        let (seen_tx, mut seen_rx) = tokio::sync::watch::channel(None::<ExecutionId>);
        let progress = progress.map(Mutex::new);
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let modern = is_modern(context);
        let ask_approval = ApprovalAsk::of(context);
        let (ask_tx, mut ask_rx) = tokio::sync::mpsc::unbounded_channel::<ApprovalQuestion>();
        let (need_tx, mut need_rx) = tokio::sync::mpsc::unbounded_channel::<ApprovalQuestion>();
        let asking: Mutex<Vec<tokio::task::JoinHandle<()>>> = Mutex::new(Vec::new());
        let (cancel_tx, mut cancel_rx) = tokio::sync::oneshot::channel();
        // The client cancels: `notifications/cancelled` (on_cancelled); under 2026-07-28 also
        // the request's own token, which rmcp cancels when a stateless HTTP client closes the
        // stream (it ignores `notifications/cancelled` there).
        let ct = context.ct.clone();
        let cancel_signal = async move {
            let mut rx_open = true;
            loop {
                tokio::select! {
                    r = &mut cancel_rx, if rx_open => match r {
                        Ok(()) => return,
                        Err(_) => rx_open = false,
                    },
                    () = ct.cancelled(), if modern => return,
                    else => std::future::pending::<()>().await,
                }
            }
        };
        tokio::pin!(cancel_signal);
        self.cancels
            .lock()
            .expect("cancels")
            .insert(context.id.clone(), cancel_tx);
        let relay = async {
            let tx = tx;
            let ask_tx = ask_tx;
            let need_tx = need_tx;
            let on_event = |e: &Event| {
                match e {
                    Event::Execution { id, .. } => {
                        seen_tx.send_replace(Some(*id));
                    }
                    Event::AwaitingApproval(q) => match ask_approval {
                        ApprovalAsk::Elicitation if self.asked.first(q.id) => {
                            let _ = ask_tx.send(q.clone());
                        }
                        ApprovalAsk::InputRequired => {
                            let _ = need_tx.send(q.clone());
                        }
                        _ => {}
                    },
                    _ => {}
                }
                if let Some(p) = &progress {
                    for n in p.lock().expect("progress").on_event(e) {
                        let _ = tx.send(n);
                    }
                }
            };
            self.backend.request_events(req, &on_event).await
        };
        // Notifications go out while the call runs; a client that went away only loses them.
        let notify = async {
            while let Some(n) = rx.recv().await {
                if let Err(e) = context.peer.notify_progress(n).await {
                    tracing::debug!(error = %e, "a progress notification was not sent");
                }
            }
        };
        // Approval questions run on their own: the user's answer still counts after this call
        // returned "pending" (a retry then finds the decision).
        let ask = async {
            while let Some(q) = ask_rx.recv().await {
                let task = approval::ask(context.peer.clone(), self.backend.clone(), q);
                asking.lock().expect("asking").push(tokio::spawn(task));
            }
        };
        let work = async { tokio::join!(relay, notify, ask).0 };
        tokio::pin!(work);
        let mut cancelled = false;
        let mut decided = false;
        let mut question = None;
        let answer_frame = loop {
            tokio::select! {
                a = &mut work => break Some(a),
                Some(q) = need_rx.recv(), if !decided => {
                    // 2026-07-28: the retry's answer decides; without one, ask the client.
                    let id = q.id;
                    match &answer {
                        Some(a) => {
                            decided = true;
                            match approval::decision(id, &a.action, a.content.as_ref()) {
                                Some(d) => match self.backend.request(d, &|_| {}).await {
                                    Ok(Frame::Done { .. }) => {
                                        tracing::info!(%id, "decided through input_required")
                                    }
                                    other => tracing::info!(%id, answer = ?other.ok(), "the input_required answer was not applied"),
                                },
                                None => tracing::info!(%id, "approval question cancelled; left pending"),
                            }
                        }
                        None => {
                            question = Some(q);
                            break None;
                        }
                    }
                }
                () = &mut cancel_signal, if !cancelled => {
                    cancelled = true;
                    // The execution id may not be known yet: wait for it (or for the end).
                    let cancel = async {
                        let id = seen_rx
                            .wait_for(Option::is_some)
                            .await
                            .ok()
                            .and_then(|id| *id);
                        if let Some(id) = id {
                            self.cancel_execution(tool, id).await;
                        }
                    };
                    tokio::pin!(cancel);
                    tokio::select! {
                        a = &mut work => break Some(a),
                        () = &mut cancel => {}
                    }
                }
            }
        };
        self.cancels.lock().expect("cancels").remove(&context.id);
        let Some(answer) = answer_frame else {
            // The call goes on in the daemon, waiting for the decision; the client's retry
            // attaches to it.
            let q = question.expect("a question");
            tracing::info!(id = %q.id, "approval asked through input_required");
            return Ok(CallToolResponse::InputRequired(
                InputRequiredResult::from_input_requests(tasks::approval_request(&q)),
            ));
        };
        // A question about an execution that is no longer pending is moot.
        let answered = answer.as_ref().ok().and_then(|f| f.view::<ExecutionView>());
        let still_pending = answered
            .as_ref()
            .is_some_and(|e| e.state == ExecState::AwaitingApproval);
        if !still_pending {
            for t in asking.lock().expect("asking").drain(..) {
                t.abort();
            }
        }
        if cancelled {
            // rmcp drops the response of a cancelled request: nothing is delivered.
            tracing::info!(request = %context.id, "call cancelled by the client");
        }
        // Output the events did not show (the command ended before the daemon read it) is
        // announced before the result that carries it.
        let output = answer
            .as_ref()
            .ok()
            .and_then(|f| f.view::<CallAnswer>())
            .and_then(|a| a.output);
        if let (Some(p), Some(out), false) = (&progress, output, cancelled) {
            let notes = p
                .lock()
                .expect("progress")
                .on_result(&out, std::time::Instant::now());
            for n in notes {
                if let Err(e) = context.peer.notify_progress(n).await {
                    tracing::debug!(error = %e, "a progress notification was not sent");
                }
            }
        }
        match answer {
            Ok(frame) => {
                if let (Some(e), Some((pending, key)), false) =
                    (&answered, self.delivery(context), cancelled)
                {
                    pending.insert(key, e.id);
                }
                Ok(execution_result(frame).into())
            }
            Err(ClientError::NoDaemon) => Err(no_daemon()),
            Err(ClientError::Broken(why)) => {
                let seen = *seen_rx.borrow();
                Ok(lost_call(seen, &why).into())
            }
        }
    }
}
