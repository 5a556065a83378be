//! The MCP server handler: `tools/list` from the daemon's catalog, `tools/call` relayed to the
//! daemon as control requests.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use rmcp::handler::server::ServerHandler;
use rmcp::model::{
    CallToolRequestParams, CallToolResponse, CallToolResult, CancelTaskParams,
    CancelledNotificationParam, CreateTaskResult, CustomRequest, CustomResult, DetailedTask,
    ElicitResult, ErrorCode, GetTaskParams, GetTaskResult, Implementation, InitializeResult,
    InputRequiredResult, JsonObject, ListToolsResult, PaginatedRequestParams, ProgressToken,
    ProtocolVersion, RequestId, ServerCapabilities, Task, TaskStatus, UpdateTaskParams,
};
use rmcp::service::{NotificationContext, RequestContext};
use rmcp::{ErrorData, RoleServer};
use serde_json::{json, Value};
use waymark_core::{ExecState, ExecutionId, ReplayContract};
use waymark_protocol::answer::parse_state;
use waymark_protocol::client::ClientError;
use waymark_protocol::{
    ApprovalQuestion, Event, ExecutionList, ExecutionView, Frame, OutputPage, Request, ResultView,
    StatusAnswer, Stream, ToolCatalog,
};

use crate::approval::{self, Asked};
use crate::delivery::Pending;
use crate::progress::Progress;
use crate::tasks::{self, Status};
use crate::tools::{self, build, execution_result, lost_call};
use crate::{Backend, IDEMPOTENCY_KEY_META};

/// The MCP handler behind `waymark mcp` (stdio) and the daemon's Streamable HTTP endpoint.
#[derive(Clone)]
pub struct WaymarkMcp {
    backend: Arc<dyn Backend>,
    transport: &'static str,
    /// Where delivery is marked after the response was written ([`crate::delivery`]); `None`:
    /// the backend marks it when the handler returns (no write hook on that transport).
    pending: Option<Pending>,
    /// Executions this session already asked its user to approve ([`crate::approval`]).
    asked: Asked,
    /// In-flight `tools/call`s by JSON-RPC id, told when the client cancels one
    /// (`notifications/cancelled`).
    cancels: Arc<Mutex<HashMap<RequestId, tokio::sync::oneshot::Sender<()>>>>,
    /// The live output of this session's task calls still running, by execution ID: what
    /// `tasks/get` adds to a working task's status message.
    task_output: Arc<Mutex<HashMap<ExecutionId, Arc<Mutex<Progress>>>>>,
}

/// Whether cancelling a running execution of this contract is harmless to replay; otherwise a
/// cancelled MCP request is only abandoned and the command runs to its end.
fn cancellable(contract: ReplayContract) -> bool {
    tasks::cancellable(contract)
}

/// Whether the client of this request declared the tasks extension (at `initialize`, or in
/// the request's own `_meta` under 2026-07-28).
fn client_takes_tasks(context: &RequestContext<RoleServer>) -> bool {
    context
        .client_capabilities()
        .is_some_and(|c| c.supports_tasks())
}

/// Whether this request runs under 2026-07-28 or later (no server-to-client requests).
fn is_modern(context: &RequestContext<RoleServer>) -> bool {
    context
        .protocol_version()
        .is_some_and(|v| v.as_str() >= ProtocolVersion::V_2026_07_28.as_str())
}

/// Whether the client of this request can answer a form elicitation (the approval question
/// of a task that awaits approval).
fn client_answers_forms(context: &RequestContext<RoleServer>) -> bool {
    context
        .client_capabilities()
        .and_then(|c| c.elicitation)
        .is_some_and(|e| e.form.is_some() || e.url.is_none())
}

fn to_object(r: &CallToolResult) -> JsonObject {
    match serde_json::to_value(r) {
        Ok(Value::Object(m)) => m,
        _ => JsonObject::new(),
    }
}

/// How long `tasks/result` waits for a task to end before it answers with what is known.
const RESULT_WAIT: std::time::Duration = std::time::Duration::from_secs(300);

fn no_daemon() -> ErrorData {
    ErrorData::internal_error(
        "the Waymark daemon is not running and could not be started (see the shim's stderr)",
        None,
    )
}

fn broken(why: String) -> ErrorData {
    ErrorData::internal_error(
        format!("lost the connection to the Waymark daemon: {why}"),
        None,
    )
}

fn str_arg<'a>(args: &'a JsonObject, name: &str) -> Result<Option<&'a str>, ErrorData> {
    match args.get(name) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s)),
        Some(other) => Err(ErrorData::invalid_params(
            format!("argument {name} must be a string, got {other}"),
            None,
        )),
    }
}

fn required_str<'a>(args: &'a JsonObject, name: &str) -> Result<&'a str, ErrorData> {
    str_arg(args, name)?
        .ok_or_else(|| ErrorData::invalid_params(format!("argument {name} is required"), None))
}

/// The exit code of a malformed argument (the `waymark` binary's `exit::USAGE`).
const USAGE_EXIT: i32 = 2;

/// What the daemon answers a malformed id or state with, as the tool's error result.
fn refused(message: String) -> CallToolResult {
    execution_result(Frame::Error {
        message,
        exit: USAGE_EXIT,
    })
}

/// The `id` argument: a string (else invalid params) that is an execution id (else the
/// tool's error result, as the daemon answers a malformed id).
fn id_arg(args: &JsonObject) -> Result<Result<ExecutionId, CallToolResult>, ErrorData> {
    let id = required_str(args, "id")?;
    Ok(id
        .parse()
        .map_err(|e: waymark_core::IdError| refused(e.to_string())))
}

fn uint_arg(args: &JsonObject, name: &str) -> Result<Option<usize>, ErrorData> {
    match args.get(name) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v.as_u64().map(|n| Some(n as usize)).ok_or_else(|| {
            ErrorData::invalid_params(
                format!("argument {name} must be a non-negative integer, got {v}"),
                None,
            )
        }),
    }
}

impl WaymarkMcp {
    /// `transport` is recorded with every call (`mcp-stdio`, `mcp-http`).
    pub fn new(
        backend: Arc<dyn Backend>,
        transport: &'static str,
        pending: Option<Pending>,
    ) -> Self {
        WaymarkMcp {
            backend,
            transport,
            pending,
            asked: Asked::default(),
            cancels: Arc::default(),
            task_output: Arc::default(),
        }
    }

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

    /// The client cancelled a call: cancel its execution when its contract makes that harmless
    /// (read_only, idempotent); otherwise leave it running (a later identical call attaches).
    async fn cancel_execution(&self, tool: Option<&str>, id: ExecutionId) {
        match self.contract_of(tool).await {
            Some(c) if cancellable(c) => {
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

    async fn catalog(&self) -> Result<ToolCatalog, ErrorData> {
        match self
            .backend
            .request(Request::ListTools, &|_| {})
            .await
            .map(Frame::answer::<ToolCatalog>)
        {
            Ok(Frame::Done { data, .. }) => Ok(data),
            Ok(Frame::Error { message, .. }) => Err(ErrorData::internal_error(
                format!("the daemon's tool catalog: {message}"),
                None,
            )),
            Ok(Frame::Event(_)) => Err(ErrorData::internal_error("unexpected answer", None)),
            Err(ClientError::NoDaemon) => Err(no_daemon()),
            Err(ClientError::Broken(why)) => Err(broken(why)),
        }
    }

    /// A request that changes nothing, answered as a plain tool result.
    async fn query(&self, req: Request) -> Result<Frame, ErrorData> {
        match self.backend.request(req, &|_| {}).await {
            Ok(f) => Ok(f),
            Err(ClientError::NoDaemon) => Err(no_daemon()),
            Err(ClientError::Broken(why)) => Err(broken(why)),
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
    async fn call(
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
        let can_elicit = !modern && approval::supported(&context.peer);
        let input_required = modern && client_answers_forms(context);
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
                    Event::AwaitingApproval(q) => {
                        if can_elicit && self.asked.first(q.id) {
                            let _ = ask_tx.send(q.clone());
                        } else if input_required {
                            let _ = need_tx.send(q.clone());
                        }
                    }
                    _ => {}
                }
                if let Some(p) = &progress {
                    if let Some(n) = p.lock().expect("progress").on_event(e) {
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

    /// Progress for a call whose client asked for it (`progressToken`); a configured tool's
    /// secret argument values are looked up so that the progress message can mask them.
    async fn progress_for(
        &self,
        token: Option<ProgressToken>,
        tool: Option<&str>,
        args: &JsonObject,
    ) -> Option<Progress> {
        let token = token?;
        // Without a catalog the call itself fails the same way; no progress then.
        let secrets = self.secret_values(tool, args).await?;
        Some(Progress::new(token, secrets))
    }

    /// The values of a configured tool's secret arguments in `args` (none for a raw command);
    /// `None` when the catalog cannot be read.
    async fn secret_values(&self, tool: Option<&str>, args: &JsonObject) -> Option<Vec<String>> {
        let mut secrets = Vec::new();
        if let Some(name) = tool {
            let catalog = self.catalog().await.ok()?;
            if let Some(spec) = catalog.tools.iter().find(|t| t.name == name) {
                for a in spec.args.iter().filter(|a| a.secret) {
                    match args.get(&a.name) {
                        Some(Value::String(v)) => secrets.push(v.clone()),
                        Some(Value::Null) | None => {}
                        Some(v) => secrets.push(v.to_string()),
                    }
                }
            }
        }
        Some(secrets)
    }

    /// A call made as a task: answered with the task (its id is the execution ID) as soon as
    /// the daemon accepted the execution, which is durable by then; the call runs on in the
    /// daemon, relayed by a background request that only waits for its end. A call refused
    /// before acceptance (bad arguments, unknown tool) is answered as a plain result.
    ///
    /// While the command runs, its output goes to the client as progress notifications (when
    /// the call carried a `progressToken`, which stays valid for the task's life) and into the
    /// status message `tasks/get` answers in this session.
    async fn start_task(
        &self,
        req: Request,
        tool: Option<&str>,
        args: &JsonObject,
        token: Option<ProgressToken>,
        peer: rmcp::Peer<RoleServer>,
    ) -> Result<CallToolResponse, ErrorData> {
        let (id_tx, id_rx) = tokio::sync::oneshot::channel::<ExecutionId>();
        let backend = self.backend.clone();
        let secrets = self.secret_values(tool, args).await.unwrap_or_default();
        let notify = token.is_some();
        // Without a token the tracker still feeds the status message; it never notifies.
        let token = token.unwrap_or(ProgressToken(rmcp::model::NumberOrString::Number(0)));
        let progress = Arc::new(Mutex::new(Progress::new(token, secrets)));
        let live = self.task_output.clone();
        let (note_tx, mut note_rx) = tokio::sync::mpsc::unbounded_channel();
        tokio::spawn(async move {
            while let Some(n) = note_rx.recv().await {
                if let Err(e) = peer.notify_progress(n).await {
                    tracing::debug!(error = %e, "a task's progress notification was not sent");
                }
            }
        });
        let driver = tokio::spawn(async move {
            let id_tx = Mutex::new(Some(id_tx));
            let on_event = |e: &Event| {
                let note = progress.lock().expect("task progress").on_event(e);
                if let Event::Execution { id, .. } = e {
                    if let Some(tx) = id_tx.lock().expect("task id").take() {
                        live.lock()
                            .expect("task output")
                            .insert(*id, progress.clone());
                        let _ = tx.send(*id);
                    }
                }
                if let (true, Some(n)) = (notify, note) {
                    let _ = note_tx.send(n);
                }
            };
            let answer = backend.request_events(req, &on_event).await;
            if let Some(e) = answer.as_ref().ok().and_then(|f| f.view::<ExecutionView>()) {
                tracing::debug!(id = %e.id, state = %e.state, "task's call ended");
            }
            // The ledger has the outcome now; tasks/get reads it from there.
            let id = progress.lock().expect("task progress").execution();
            if let Some(id) = id {
                live.lock().expect("task output").remove(&id);
            }
            answer
        });
        match id_rx.await {
            Ok(id) => {
                let now = tasks::iso8601(
                    std::time::SystemTime::now()
                        .duration_since(std::time::UNIX_EPOCH)
                        .map_or(0, |d| d.as_millis() as u64),
                );
                let task = Task::new(id.to_string(), TaskStatus::Working, now.clone(), now)
                    .with_poll_interval_ms(tasks::POLL_INTERVAL_MS)
                    .with_status_message(tasks::status_message(ExecState::Accepted, id));
                Ok(CallToolResponse::Task(CreateTaskResult::new(task)))
            }
            // No execution was named: the call ended before acceptance.
            Err(_) => match driver.await {
                Ok(Ok(frame)) => Ok(execution_result(frame).into()),
                Ok(Err(ClientError::NoDaemon)) => Err(no_daemon()),
                Ok(Err(ClientError::Broken(why))) => Ok(lost_call(None, &why).into()),
                Err(e) => Err(ErrorData::internal_error(
                    format!("the call's relay failed: {e}"),
                    None,
                )),
            },
        }
    }

    /// An execution's status from the daemon (which checks the host's marker when the
    /// execution may be on the host): the frame and its data; a task id the daemon does not
    /// know is an invalid parameter.
    ///
    /// A task belongs to the actor that made it (the bearer token over HTTP, uid and program
    /// over stdio): another actor's execution is no task of this client's ("no task").
    async fn task_status(&self, id: &str) -> Result<(Frame, StatusAnswer), ErrorData> {
        let no_task = |why: String| ErrorData::invalid_params(format!("no task {id}: {why}"), None);
        let id: ExecutionId = id
            .parse()
            .map_err(|e: waymark_core::IdError| no_task(e.to_string()))?;
        // A `tasks/get` or `tasks/result` answer that carries the result marks it delivered
        // once it was written (`deliver_with_response`).
        let req = Request::Status {
            id,
            defer_delivery: true,
        };
        let frame = self.query(req).await?;
        match frame.clone().answer::<StatusAnswer>() {
            Frame::Done { data, .. }
                if self
                    .backend
                    .actor()
                    .is_some_and(|me| data.call.execution.actor.0 != me) =>
            {
                Err(ErrorData::invalid_params(
                    format!("no task {id} for this client"),
                    None,
                ))
            }
            Frame::Done { data, .. } => Ok((frame, data)),
            Frame::Error { message, .. } => Err(no_task(message)),
            Frame::Event(_) => Err(ErrorData::internal_error("unexpected answer", None)),
        }
    }

    /// Where this request's response is marked delivered once written: the stdio transport by
    /// JSON-RPC id, or the HTTP exchange that [`crate::http`] opened for the request. `None`:
    /// no such hook, the backend marks a result delivered when the handler returns.
    fn delivery(&self, context: &RequestContext<RoleServer>) -> Option<(&Pending, String)> {
        let pending = self.pending.as_ref()?;
        match context.extensions.get::<hyper::http::request::Parts>() {
            Some(parts) => {
                let exchange = parts.headers.get(crate::http::EXCHANGE_HEADER)?;
                Some((pending, format!("http:{}", exchange.to_str().ok()?)))
            }
            None => Some((pending, crate::delivery::rpc_key(&context.id))),
        }
    }

    /// The response to this request carries execution `id`'s result: mark it delivered once
    /// the response was written (see [`Self::delivery`]), or now where nothing tells.
    async fn deliver_with_response(&self, context: &RequestContext<RoleServer>, id: ExecutionId) {
        match self.delivery(context) {
            Some((p, key)) => p.insert(key, id),
            None => {
                let _ = self
                    .backend
                    .request(Request::Delivered { id }, &|_| {})
                    .await;
            }
        }
    }

    /// `tasks/result` (2025-11-25): the task's `CallToolResult` once it is final, waiting for
    /// it; after [`RESULT_WAIT`] the current (not final) result, which says what to do next.
    async fn task_result(
        &self,
        params: Option<&Value>,
        context: &RequestContext<RoleServer>,
    ) -> Result<CustomResult, ErrorData> {
        let id = params
            .and_then(|p| p["taskId"].as_str())
            .ok_or_else(|| ErrorData::invalid_params("taskId is required", None))?
            .to_string();
        let deadline = tokio::time::Instant::now() + RESULT_WAIT;
        loop {
            let (frame, answer) = self.task_status(&id).await?;
            let e = &answer.call.execution;
            let status = tasks::status_of(e.state, false);
            let done = matches!(status, Status::Completed | Status::Cancelled);
            if done || tokio::time::Instant::now() >= deadline {
                if status == Status::Completed {
                    self.deliver_with_response(context, e.id).await;
                }
                let r = execution_result(frame);
                return Ok(CustomResult::new(Value::Object(to_object(&r))));
            }
            tokio::time::sleep(std::time::Duration::from_millis(tasks::POLL_INTERVAL_MS)).await;
        }
    }

    /// `tasks/list` (2025-11-25): this actor's executions as tasks, newest first.
    async fn task_list(
        &self,
        params: Option<&Value>,
        context: &RequestContext<RoleServer>,
    ) -> Result<CustomResult, ErrorData> {
        let Some(actor) = self.backend.actor() else {
            return Ok(CustomResult::new(json!({"tasks": []})));
        };
        let after = match params.and_then(|p| p["cursor"].as_str()).map(str::parse) {
            Some(Err(e)) => {
                let e: waymark_core::IdError = e;
                return Err(ErrorData::invalid_params(e.to_string(), None));
            }
            Some(Ok(id)) => Some(id),
            None => None,
        };
        let req = Request::List {
            state: None,
            host: None,
            tool: None,
            actor: Some(actor),
            since_ms: None,
            limit: Some(100),
            after,
        };
        let page = match self.query(req).await?.answer::<ExecutionList>() {
            Frame::Done { data, .. } => data,
            Frame::Error { message, .. } => return Err(ErrorData::invalid_params(message, None)),
            Frame::Event(_) => return Err(ErrorData::internal_error("unexpected answer", None)),
        };
        let can_elicit = client_answers_forms(context);
        let list: Vec<Value> = page
            .items
            .iter()
            .filter_map(|item| {
                let mut task = tasks::task_base(item);
                task.status = match tasks::status_of(item.state, can_elicit) {
                    Status::Working => TaskStatus::Working,
                    Status::InputRequired => TaskStatus::InputRequired,
                    Status::Completed => TaskStatus::Completed,
                    Status::Cancelled => TaskStatus::Cancelled,
                };
                serde_json::to_value(task).ok()
            })
            .collect();
        let mut out = json!({ "tasks": list });
        if let Some(next) = page.next {
            out["nextCursor"] = json!(next);
        }
        Ok(CustomResult::new(out))
    }

    /// `exec_result`: a page of an execution's output. The response carries the result, so it
    /// is marked delivered once written.
    async fn result_page(
        &self,
        args: &JsonObject,
        context: &RequestContext<RoleServer>,
    ) -> Result<CallToolResult, ErrorData> {
        let id = match id_arg(args)? {
            Ok(id) => id,
            Err(refused) => return Ok(refused),
        };
        let stream: Stream = str_arg(args, "stream")?
            .unwrap_or("stdout")
            .parse()
            .map_err(|_| {
                ErrorData::invalid_params("argument stream must be stdout or stderr", None)
            })?;
        let offset = uint_arg(args, "offset")?.unwrap_or(0);
        let limit = uint_arg(args, "limit")?
            .unwrap_or(tools::DEFAULT_PAGE)
            .max(1);
        let req = Request::Result {
            id,
            defer_delivery: true,
        };
        let frame = self.query(req).await?.answer::<ResultView>();
        if let Frame::Done { data, .. } = &frame {
            if let Some(id) = data.result_of() {
                self.deliver_with_response(context, id).await;
            }
        }
        match frame {
            Frame::Done { data, .. } => {
                // Byte offsets over the whole stream: the ledger keeps its first part, the rest
                // is read from the host's marker.
                let stored = data.heads.bytes(stream);
                let total = data.heads.total(stream) as usize;
                let (bytes, source) = if offset < stored.len() {
                    let end = offset.saturating_add(limit).min(stored.len());
                    (stored[offset..end].to_vec(), "ledger")
                } else if offset < total {
                    let req = Request::Output {
                        id,
                        stream,
                        offset: offset as u64,
                        max: limit as u64,
                    };
                    match self.query(req).await?.answer::<OutputPage>() {
                        Frame::Done { data: chunk, .. } => (chunk.bytes(), "host"),
                        Frame::Error { message, exit } => {
                            return Ok(execution_result(Frame::Error { message, exit }))
                        }
                        Frame::Event(e) => return Ok(execution_result(Frame::Event(e))),
                    }
                } else {
                    (Vec::new(), "ledger")
                };
                let end = offset + bytes.len();
                let chunk = String::from_utf8_lossy(&bytes);
                let out = json!({
                    "id": data.id, "state": data.state, "stream": stream,
                    "offset": offset, "next_offset": if end < total { json!(end) } else { Value::Null },
                    "stored_bytes": stored.len(), "total_bytes": total, "source": source,
                    "data": chunk, "data_b64": data_encoding::BASE64.encode(&bytes),
                });
                let text = format!(
                    "execution {}: {} — {stream} bytes {offset}..{end} of {total}\n{chunk}",
                    data.id, data.state,
                );
                Ok(build(out, text, false))
            }
            Frame::Error { message, exit } => Ok(execution_result(Frame::Error { message, exit })),
            Frame::Event(e) => Ok(execution_result(Frame::Event(e))),
        }
    }
}

impl ServerHandler for WaymarkMcp {
    fn get_info(&self) -> InitializeResult {
        InitializeResult::new(
            ServerCapabilities::builder()
                .enable_tools()
                .enable_tasks()
                .build(),
        )
        .with_server_info(Implementation::new("waymark", env!("CARGO_PKG_VERSION")))
        .with_instructions(
            "Waymark runs these tools as commands on SSH hosts, at most once per intent. \
                 Every result carries an execution ID. If an answer is lost or the outcome is \
                 unknown, call exec_status with the ID (or repeat the same call: it attaches to \
                 the first execution). An unknown outcome is not a failure.",
        )
    }

    async fn on_cancelled(
        &self,
        notification: CancelledNotificationParam,
        _context: NotificationContext<RoleServer>,
    ) {
        let Some(request) = notification.request_id else {
            return;
        };
        if let Some(tx) = self.cancels.lock().expect("cancels").remove(&request) {
            let _ = tx.send(());
        }
    }

    async fn list_tools(
        &self,
        _request: Option<PaginatedRequestParams>,
        _context: RequestContext<RoleServer>,
    ) -> Result<ListToolsResult, ErrorData> {
        let catalog = self.catalog().await?;
        Ok(ListToolsResult::with_all_items(tools::list(&catalog)))
    }

    async fn call_tool(
        &self,
        request: CallToolRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, ErrorData> {
        let args = request.arguments.clone().unwrap_or_default();
        let key = request
            .meta
            .as_ref()
            .and_then(|m| m.0 .0.get(IDEMPOTENCY_KEY_META))
            .or_else(|| context.meta.0 .0.get(IDEMPOTENCY_KEY_META))
            .and_then(Value::as_str)
            .map(str::to_string);
        let token = request
            .meta
            .as_ref()
            .and_then(|m| m.get_progress_token())
            .or_else(|| context.meta.get_progress_token());
        // A client that takes tasks gets one for every call that runs a command; its result
        // is then delivered with the `tasks/get` (or `tasks/result`) answer that carries it.
        let as_task = client_takes_tasks(&context);
        // 2026-07-28: the answer to an approval asked with `input_required` (SEP-2322).
        let answer = request
            .input_responses
            .as_ref()
            .and_then(|r| r.get(tasks::APPROVAL_KEY))
            .and_then(|a| serde_json::from_value::<ElicitResult>(a.clone()).ok());
        let result = match request.name.as_ref() {
            tools::EXEC_STATUS => {
                let id = match id_arg(&args)? {
                    Ok(id) => id,
                    Err(refused) => return Ok(refused.into()),
                };
                let req = Request::Status {
                    id,
                    defer_delivery: true,
                };
                let frame = self.query(req).await?;
                let carried = frame
                    .view::<StatusAnswer>()
                    .and_then(|s| s.call.result_of());
                if let Some(id) = carried {
                    self.deliver_with_response(&context, id).await;
                }
                execution_result(frame)
            }
            tools::EXEC_CANCEL => match id_arg(&args)? {
                Ok(id) => execution_result(self.query(Request::Cancel { id }).await?),
                Err(refused) => refused,
            },
            tools::EXEC_RESULT => self.result_page(&args, &context).await?,
            tools::EXEC_LIST => {
                let limit = uint_arg(&args, "limit")?;
                let state = match str_arg(&args, "state")?.map(parse_state) {
                    Some(Err(message)) => return Ok(refused(message).into()),
                    Some(Ok(s)) => Some(s),
                    None => None,
                };
                let after = match str_arg(&args, "after")?.map(str::parse) {
                    Some(Err(e)) => {
                        let e: waymark_core::IdError = e;
                        return Ok(refused(e.to_string()).into());
                    }
                    Some(Ok(id)) => Some(id),
                    None => None,
                };
                let req = Request::List {
                    state,
                    host: str_arg(&args, "host")?.map(str::to_string),
                    tool: str_arg(&args, "tool")?.map(str::to_string),
                    actor: None,
                    since_ms: None,
                    limit,
                    after,
                };
                match self.query(req).await? {
                    Frame::Done { data, text, .. } => build(data, text, false),
                    other => execution_result(other),
                }
            }
            tools::SSH_EXEC => {
                let host = required_str(&args, "host")?;
                let argv: Vec<String> = match args.get("argv") {
                    Some(Value::Array(words)) if !words.is_empty() => words
                        .iter()
                        .map(|w| w.as_str().map(str::to_string))
                        .collect::<Option<_>>()
                        .ok_or_else(|| {
                            ErrorData::invalid_params("argv must be an array of strings", None)
                        })?,
                    _ => {
                        return Err(ErrorData::invalid_params(
                            "argv must be a non-empty array of strings",
                            None,
                        ))
                    }
                };
                let req = Request::Call {
                    tool: None,
                    args: Default::default(),
                    host: Some(host.into()),
                    raw: Some(argv),
                    key,
                    transport: Some(self.transport.into()),
                    defer_delivery: self.delivery(&context).is_some() || as_task,
                };
                if as_task {
                    return self
                        .start_task(req, None, &args, token.clone(), context.peer.clone())
                        .await;
                }
                let progress = self.progress_for(token.clone(), None, &args).await;
                return self.call(req, None, &context, progress, answer).await;
            }
            name => {
                // An unknown tool is a protocol error (invalid params), not a tool result.
                let catalog = self.catalog().await?;
                if !catalog.tools.iter().any(|t| t.name == name) {
                    let mut all: Vec<&str> =
                        catalog.tools.iter().map(|t| t.name.as_str()).collect();
                    if !catalog.raw_hosts.is_empty() {
                        all.push(tools::SSH_EXEC);
                    }
                    all.extend([
                        tools::EXEC_STATUS,
                        tools::EXEC_RESULT,
                        tools::EXEC_LIST,
                        tools::EXEC_CANCEL,
                    ]);
                    return Err(ErrorData::invalid_params(
                        format!("unknown tool {name:?}; the tools are: {}", all.join(", ")),
                        None,
                    ));
                }
                let req = Request::Call {
                    tool: Some(name.to_string()),
                    args: args.clone(),
                    host: None,
                    raw: None,
                    key,
                    transport: Some(self.transport.into()),
                    defer_delivery: self.delivery(&context).is_some() || as_task,
                };
                if as_task {
                    return self
                        .start_task(req, Some(name), &args, token.clone(), context.peer.clone())
                        .await;
                }
                let progress = self.progress_for(token.clone(), Some(name), &args).await;
                return self.call(req, Some(name), &context, progress, answer).await;
            }
        };
        Ok(result.into())
    }

    async fn get_task(
        &self,
        request: GetTaskParams,
        context: RequestContext<RoleServer>,
    ) -> Result<GetTaskResult, ErrorData> {
        let (frame, answer) = self.task_status(&request.task_id).await?;
        let e = &answer.call.execution;
        let status = tasks::status_of(e.state, client_answers_forms(&context));
        let result = to_object(&execution_result(frame));
        let payload = tasks::payload(status, e, result);
        if status == Status::Completed {
            self.deliver_with_response(&context, e.id).await;
        }
        let mut task = tasks::task_base(e);
        if status == Status::Working
            && matches!(e.state, ExecState::Dispatched | ExecState::Running)
        {
            let live = self
                .task_output
                .lock()
                .expect("task output")
                .get(&e.id)
                .cloned();
            if let (Some(p), Some(message)) = (live, task.status_message.as_mut()) {
                let summary = p.lock().expect("task progress").summary();
                message.push_str("; ");
                message.push_str(&summary);
            }
        }
        Ok(GetTaskResult::new(DetailedTask::new(task, payload)))
    }

    async fn update_task(
        &self,
        request: UpdateTaskParams,
        _context: RequestContext<RoleServer>,
    ) -> Result<(), ErrorData> {
        let task = request.task_id;
        // Keys other than the approval question are not ours: ignored, as the spec says.
        let Some(answer) = request.input_responses.get(tasks::APPROVAL_KEY) else {
            return Ok(());
        };
        let answer: ElicitResult = serde_json::from_value(answer.clone()).map_err(|e| {
            ErrorData::invalid_params(
                format!("the approval answer is not an ElicitResult: {e}"),
                None,
            )
        })?;
        let Ok(id) = task.parse::<ExecutionId>() else {
            tracing::info!(%task, "an approval answer for no execution; not applied");
            return Ok(());
        };
        let Some(req) = approval::decision(id, &answer.action, answer.content.as_ref()) else {
            tracing::info!(%id, "approval question cancelled through tasks/update; left pending");
            return Ok(());
        };
        match self.query(req).await? {
            Frame::Done { .. } => tracing::info!(%id, "decided through tasks/update"),
            // Already decided (or no longer pending): an answered question is ignored.
            other => {
                tracing::info!(%id, answer = ?other, "the task's approval answer was not applied")
            }
        }
        Ok(())
    }

    async fn cancel_task(
        &self,
        request: CancelTaskParams,
        _context: RequestContext<RoleServer>,
    ) -> Result<(), ErrorData> {
        let (_, answer) = self.task_status(&request.task_id).await?;
        let ExecutionView {
            id,
            state,
            contract,
            ..
        } = answer.call.execution;
        if matches!(
            tasks::status_of(state, false),
            Status::Completed | Status::Cancelled
        ) {
            return Err(ErrorData::invalid_params(
                format!("task {id} is already {state}; there is nothing to cancel"),
                None,
            ));
        }
        if !cancellable(contract) {
            return Err(ErrorData::invalid_request(
                format!(
                    "{id} is {contract:?}: cancelling it midway could leave a partial effect that \
                     a retry cannot repair, so it is not cancelled through MCP and runs to its \
                     end (an operator can: `waymark exec cancel {id}`)"
                ),
                None,
            ));
        }
        match self.query(Request::Cancel { id }).await? {
            Frame::Done { .. } => {
                tracing::info!(%id, "task cancelled at the client's request");
                Ok(())
            }
            Frame::Error { message, .. } => Err(ErrorData::invalid_request(message, None)),
            Frame::Event(_) => Err(ErrorData::internal_error("unexpected answer", None)),
        }
    }

    async fn on_custom_request(
        &self,
        request: CustomRequest,
        context: RequestContext<RoleServer>,
    ) -> Result<CustomResult, ErrorData> {
        if !client_takes_tasks(&context) {
            return Err(ErrorData::new(
                ErrorCode::METHOD_NOT_FOUND,
                request.method,
                None,
            ));
        }
        match request.method.as_str() {
            tasks::TASKS_RESULT => self.task_result(request.params.as_ref(), &context).await,
            tasks::TASKS_LIST => self.task_list(request.params.as_ref(), &context).await,
            other => Err(ErrorData::new(
                ErrorCode::METHOD_NOT_FOUND,
                other.to_string(),
                None,
            )),
        }
    }
}
