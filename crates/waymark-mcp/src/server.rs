//! The MCP server handler: `tools/list` from the daemon's catalog, `tools/call` relayed to the
//! daemon as control requests.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use rmcp::handler::server::ServerHandler;
use rmcp::model::{
    CallToolRequestParams, CallToolResponse, CallToolResult, CancelTaskParams,
    CancelledNotificationParam, CustomRequest, CustomResult, ElicitResult, ErrorCode,
    GetTaskParams, GetTaskResult, Implementation, InitializeResult, JsonObject, ListToolsResult,
    PaginatedRequestParams, RequestId, ServerCapabilities, UpdateTaskParams,
};
use rmcp::service::{NotificationContext, RequestContext};
use rmcp::{ErrorData, RoleServer};
use serde_json::{json, Value};
use waymark_core::ExecutionId;
use waymark_protocol::answer::parse_state;
use waymark_protocol::client::ClientError;
use waymark_protocol::{
    ExecutionView, FanOutAnswer, Frame, OutputPage, Request, ResultView, StatusAnswer, Stream,
    ToolCatalog,
};

use crate::approval::Asked;
use crate::delivery::{self, Pending};
use crate::progress::Progress;
use crate::tasks;
use crate::tools::{self, build, execution_result};
use crate::{Backend, IDEMPOTENCY_KEY_META};

/// The MCP handler behind `waymark mcp` (stdio) and the daemon's Streamable HTTP endpoint.
#[derive(Clone)]
pub struct WaymarkMcp {
    pub(crate) backend: Arc<dyn Backend>,
    pub(crate) transport: &'static str,
    /// Where delivery is marked after the response was written ([`crate::delivery`]): the
    /// only place this front end marks a result delivered.
    pub(crate) pending: Pending,
    /// Executions this session already asked its user to approve ([`crate::approval`]).
    pub(crate) asked: Asked,
    /// In-flight `tools/call`s by JSON-RPC id, told when the client cancels one
    /// (`notifications/cancelled`).
    pub(crate) cancels: Arc<Mutex<HashMap<RequestId, tokio::sync::oneshot::Sender<()>>>>,
    /// The live output of this session's task calls still running, by execution ID: what
    /// `tasks/get` adds to a working task's status message.
    pub(crate) task_output: Arc<Mutex<HashMap<ExecutionId, Arc<Mutex<Progress>>>>>,
    /// The actor the daemon says this backend is, asked once.
    me: Arc<tokio::sync::OnceCell<Option<String>>>,
    /// The hash of the configuration the daemon runs: when it changes (a reload), the client
    /// is told `notifications/tools/list_changed`.
    tool_changes: Option<tokio::sync::watch::Receiver<String>>,
}

/// Whether the client of this request declared the tasks extension (at `initialize`, or in
/// the request's own `_meta` under 2026-07-28).
fn client_takes_tasks(context: &RequestContext<RoleServer>) -> bool {
    context
        .client_capabilities()
        .is_some_and(|c| c.supports_tasks())
}

/// Whether this call itself asks for a task: its own `_meta` declares the tasks extension in
/// its per-request client capabilities (SEP-2663: task creation is decided per request). A
/// 2025-11-25 session that declared the extension at `initialize` may use the task methods,
/// but its calls that do not ask get plain results, which every client can show.
fn call_asks_for_task(
    call_meta: Option<&rmcp::model::RequestMetaObject>,
    context: &RequestContext<RoleServer>,
) -> bool {
    call_meta
        .and_then(|m| m.client_capabilities())
        .or_else(|| context.meta.client_capabilities())
        .is_some_and(|c| c.supports_tasks())
}

/// Whether the client of this request can answer a form elicitation (the approval question
/// of a task that awaits approval).
pub(crate) fn client_answers_forms(context: &RequestContext<RoleServer>) -> bool {
    context
        .client_capabilities()
        .and_then(|c| c.elicitation)
        .is_some_and(|e| e.form.is_some() || e.url.is_none())
}

pub(crate) fn to_object(r: &CallToolResult) -> JsonObject {
    match serde_json::to_value(r) {
        Ok(Value::Object(m)) => m,
        _ => JsonObject::new(),
    }
}

pub(crate) fn no_daemon() -> ErrorData {
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

/// What the daemon answers a malformed id or state with, as the tool's error result.
fn refused(message: String) -> CallToolResult {
    execution_result(Frame::Error {
        message,
        exit: waymark_protocol::exit::USAGE,
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
    pub fn new(backend: Arc<dyn Backend>, transport: &'static str, pending: Pending) -> Self {
        WaymarkMcp {
            backend,
            transport,
            pending,
            asked: Asked::default(),
            cancels: Arc::default(),
            task_output: Arc::default(),
            me: Arc::default(),
            tool_changes: None,
        }
    }

    /// Tells the client `notifications/tools/list_changed` each time `changes` moves (the
    /// daemon reloaded another configuration).
    pub fn with_tool_changes(mut self, changes: tokio::sync::watch::Receiver<String>) -> Self {
        self.tool_changes = Some(changes);
        self
    }

    /// The actor the daemon proved this backend to be (`WhoAmI`), asked once.
    pub(crate) async fn me(&self) -> Option<String> {
        self.me
            .get_or_init(|| async { self.backend.actor().await })
            .await
            .clone()
    }

    pub(crate) async fn catalog(&self) -> Result<ToolCatalog, ErrorData> {
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
    pub(crate) async fn query(&self, req: Request) -> Result<Frame, ErrorData> {
        match self.backend.request(req, &|_| {}).await {
            Ok(f) => Ok(f),
            Err(ClientError::NoDaemon) => Err(no_daemon()),
            Err(ClientError::Broken(why)) => Err(broken(why)),
        }
    }

    /// Where this request's response is marked delivered once written: the stdio transport by
    /// JSON-RPC id, or the HTTP exchange that `http::relay` opened for the request. `None`:
    /// nothing tells when this response is written, so a result it carries stays "not
    /// delivered" (a retry or `exec_result` delivers it); never marked early.
    pub(crate) fn delivery(
        &self,
        context: &RequestContext<RoleServer>,
    ) -> Option<(&Pending, String)> {
        Some((&self.pending, delivery::request_key(context)?))
    }

    /// The response to this request carries execution `id`'s result: mark it delivered once
    /// the response was written (see [`Self::delivery`]), and never where nothing tells.
    pub(crate) async fn deliver_with_response(
        &self,
        context: &RequestContext<RoleServer>,
        id: ExecutionId,
    ) {
        match self.delivery(context) {
            Some((p, key)) => p.insert(key, id),
            None => tracing::warn!(
                %id,
                "a response carries this result but nothing tells when it is written: not marked delivered"
            ),
        }
    }

    /// A call with `all_hosts: true`: one execution per host (`FanOut`), answered with a
    /// section per host; the response carries every host's result, so each is marked
    /// delivered once it was written.
    async fn fan_out(
        &self,
        tool: &str,
        args: JsonObject,
        key: Option<String>,
        context: &RequestContext<RoleServer>,
    ) -> Result<CallToolResult, ErrorData> {
        let req = Request::FanOut {
            tool: tool.to_string(),
            args,
            hosts: None,
            key,
            transport: Some(self.transport.into()),
            defer_delivery: true,
        };
        let frame = self.query(req).await?;
        if let Some(answer) = frame.view::<FanOutAnswer>() {
            for id in answer.results_of() {
                self.deliver_with_response(context, id).await;
            }
        }
        Ok(tools::fan_out_result(frame))
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
                .enable_tool_list_changed()
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

    async fn on_initialized(&self, context: NotificationContext<RoleServer>) {
        let Some(mut changes) = self.tool_changes.clone() else {
            return;
        };
        changes.borrow_and_update();
        tokio::spawn(async move {
            while changes.changed().await.is_ok() {
                if context.peer.notify_tool_list_changed().await.is_err() {
                    break; // the client is gone
                }
            }
        });
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
        // A call that asks for a task gets one when it runs a command; its result is then
        // delivered with the `tasks/get` (or `tasks/result`) answer that carries it.
        let as_task = call_asks_for_task(request.meta.as_ref(), &context);
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
                    mine: false,
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
                let call = Request::Call {
                    tool: None,
                    args: Default::default(),
                    host: Some(host.into()),
                    raw: Some(argv),
                    key,
                    transport: Some(self.transport.into()),
                    defer_delivery: true,
                };
                return self
                    .relay_call(call, None, as_task, token, &context, answer)
                    .await;
            }
            name => {
                // A tool this client may not see is a protocol error (invalid params), not a
                // tool result: the daemon is asked (it refuses a tool outside the caller's
                // rights with the rule, and records the refusal), and its answer is the error.
                let catalog = self.catalog().await?;
                if !catalog.tools.iter().any(|t| t.name == name) {
                    let probe = Request::Call {
                        tool: Some(name.to_string()),
                        args: args.clone(),
                        host: None,
                        raw: None,
                        key: key.clone(),
                        transport: Some(self.transport.into()),
                        defer_delivery: true,
                    };
                    match self.query(probe).await? {
                        Frame::Error { message, .. } if message.starts_with("unknown tool") => {}
                        Frame::Error { message, .. } => {
                            return Err(ErrorData::invalid_params(message, None))
                        }
                        // The daemon took it after all: its answer is the result, delivered
                        // once written.
                        done => {
                            if let Some(e) = done.view::<ExecutionView>() {
                                self.deliver_with_response(&context, e.id).await;
                            }
                            return Ok(execution_result(done).into());
                        }
                    }
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
                let mut args = args.clone();
                match args.remove(tools::ALL_HOSTS) {
                    None | Some(Value::Bool(false)) => {}
                    Some(Value::Bool(true)) => {
                        return Ok(self.fan_out(name, args, key, &context).await?.into())
                    }
                    Some(other) => {
                        return Err(ErrorData::invalid_params(
                            format!(
                                "argument {} must be a boolean, got {other}",
                                tools::ALL_HOSTS
                            ),
                            None,
                        ))
                    }
                }
                let call = Request::Call {
                    tool: Some(name.to_string()),
                    args,
                    host: None,
                    raw: None,
                    key,
                    transport: Some(self.transport.into()),
                    defer_delivery: true,
                };
                return self
                    .relay_call(call, Some(name), as_task, token, &context, answer)
                    .await;
            }
        };
        Ok(result.into())
    }

    async fn get_task(
        &self,
        request: GetTaskParams,
        context: RequestContext<RoleServer>,
    ) -> Result<GetTaskResult, ErrorData> {
        WaymarkMcp::get_task(self, request, &context).await
    }

    async fn update_task(
        &self,
        request: UpdateTaskParams,
        _context: RequestContext<RoleServer>,
    ) -> Result<(), ErrorData> {
        WaymarkMcp::update_task(self, request).await
    }

    async fn cancel_task(
        &self,
        request: CancelTaskParams,
        _context: RequestContext<RoleServer>,
    ) -> Result<(), ErrorData> {
        WaymarkMcp::cancel_task(self, request).await
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
