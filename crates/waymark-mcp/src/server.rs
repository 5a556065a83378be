//! The MCP server handler: `tools/list` from the daemon's catalog, `tools/call` relayed to the
//! daemon as control requests.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use rmcp::handler::server::ServerHandler;
use rmcp::model::{
    CallToolRequestParams, CallToolResponse, CallToolResult, CancelledNotificationParam,
    Implementation, InitializeResult, JsonObject, ListToolsResult, PaginatedRequestParams,
    ProgressToken, RequestId, ServerCapabilities,
};
use rmcp::service::{NotificationContext, RequestContext};
use rmcp::{ErrorData, RoleServer};
use serde_json::{json, Value};
use waymark_core::ReplayContract;
use waymark_protocol::client::ClientError;
use waymark_protocol::{Frame, Request, ToolCatalog};

use crate::approval::{self, Asked};
use crate::delivery::Pending;
use crate::progress::Progress;
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
}

/// Whether cancelling a running execution of this contract is harmless to replay; otherwise a
/// cancelled MCP request is only abandoned and the command runs to its end.
fn cancellable(contract: ReplayContract) -> bool {
    matches!(
        contract,
        ReplayContract::ReadOnly | ReplayContract::Idempotent
    )
}

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
    async fn cancel_execution(&self, tool: Option<&str>, id: &str) {
        match self.contract_of(tool).await {
            Some(c) if cancellable(c) => {
                match self
                    .backend
                    .request(Request::Cancel { id: id.into() }, &|_| {})
                    .await
                {
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
        match self.backend.request(Request::ListTools, &|_| {}).await {
            Ok(Frame::Done { data, .. }) => serde_json::from_value(data).map_err(|e| {
                ErrorData::internal_error(
                    format!("the daemon's tool catalog is garbled: {e}"),
                    None,
                )
            }),
            Ok(Frame::Error { message, .. }) => Err(ErrorData::internal_error(message, None)),
            Ok(Frame::Event { .. }) => Err(ErrorData::internal_error("unexpected answer", None)),
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
    async fn call(
        &self,
        req: Request,
        tool: Option<&str>,
        context: &RequestContext<RoleServer>,
        progress: Option<Progress>,
    ) -> Result<CallToolResult, ErrorData> {
        let (seen_tx, mut seen_rx) = tokio::sync::watch::channel(None::<String>);
        let progress = progress.map(Mutex::new);
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let can_elicit = approval::supported(&context.peer);
        let (ask_tx, mut ask_rx) = tokio::sync::mpsc::unbounded_channel::<Value>();
        let asking: Mutex<Vec<tokio::task::JoinHandle<()>>> = Mutex::new(Vec::new());
        let (cancel_tx, cancel_rx) = tokio::sync::oneshot::channel();
        self.cancels
            .lock()
            .expect("cancels")
            .insert(context.id.clone(), cancel_tx);
        let relay = async {
            let tx = tx;
            let ask_tx = ask_tx;
            let on_event = |f: &Frame| {
                if let Frame::Event { kind, data } = f {
                    if kind == "execution" {
                        if let Some(id) = data["id"].as_str() {
                            seen_tx.send_replace(Some(id.to_string()));
                        }
                    }
                    if kind == "awaiting_approval" && can_elicit {
                        if let Some(id) = data["id"].as_str() {
                            if self.asked.first(id) {
                                let _ = ask_tx.send(data.clone());
                            }
                        }
                    }
                }
                if let Some(p) = &progress {
                    if let Some(n) = p.lock().expect("progress").on_event(f) {
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
            while let Some(data) = ask_rx.recv().await {
                let task = approval::ask(context.peer.clone(), self.backend.clone(), data);
                asking.lock().expect("asking").push(tokio::spawn(task));
            }
        };
        let work = async { tokio::join!(relay, notify, ask).0 };
        tokio::pin!(work);
        let mut cancelled = false;
        let answer = tokio::select! {
            a = &mut work => a,
            Ok(()) = cancel_rx => {
                cancelled = true;
                // The execution id may not be known yet: wait for it (or for the end).
                let cancel = async {
                    let id = seen_rx
                        .wait_for(Option::is_some)
                        .await
                        .ok()
                        .and_then(|id| id.clone());
                    if let Some(id) = id {
                        self.cancel_execution(tool, &id).await;
                    }
                };
                tokio::pin!(cancel);
                tokio::select! {
                    a = &mut work => a,
                    () = &mut cancel => work.await,
                }
            }
        };
        self.cancels.lock().expect("cancels").remove(&context.id);
        // A question about an execution that is no longer pending is moot.
        let still_pending =
            matches!(&answer, Ok(Frame::Done { data, .. }) if data["state"] == "awaiting_approval");
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
                if let (Frame::Done { data, .. }, Some(pending), false) =
                    (&frame, &self.pending, cancelled)
                {
                    if let Some(id) = data["id"].as_str() {
                        pending.insert(context.id.clone(), id.to_string());
                    }
                }
                Ok(execution_result(frame))
            }
            Err(ClientError::NoDaemon) => Err(no_daemon()),
            Err(ClientError::Broken(why)) => {
                let seen = seen_rx.borrow().clone();
                Ok(lost_call(seen.as_deref(), &why))
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
        let mut secrets = Vec::new();
        if let Some(name) = tool {
            // Without a catalog the call itself fails the same way; no progress then.
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
        Some(Progress::new(token, secrets))
    }

    async fn result_page(&self, args: &JsonObject) -> Result<CallToolResult, ErrorData> {
        let id = required_str(args, "id")?;
        let stream = str_arg(args, "stream")?.unwrap_or("stdout");
        if stream != "stdout" && stream != "stderr" {
            return Err(ErrorData::invalid_params(
                "argument stream must be stdout or stderr",
                None,
            ));
        }
        let offset = uint_arg(args, "offset")?.unwrap_or(0);
        let limit = uint_arg(args, "limit")?
            .unwrap_or(tools::DEFAULT_PAGE)
            .max(1);
        match self.query(Request::Result { id: id.into() }).await? {
            Frame::Done { data, .. } => {
                // Byte offsets over the whole stream: the ledger keeps its first part, the rest
                // is read from the host's marker.
                let decode = |v: &Value| {
                    v.as_str()
                        .and_then(|s| data_encoding::BASE64.decode(s.as_bytes()).ok())
                        .unwrap_or_default()
                };
                let stored = decode(&data[format!("{stream}_b64")]);
                let total = data[format!("{stream}_bytes")]
                    .as_u64()
                    .unwrap_or(stored.len() as u64) as usize;
                let (bytes, source) = if offset < stored.len() {
                    let end = offset.saturating_add(limit).min(stored.len());
                    (stored[offset..end].to_vec(), "ledger")
                } else if offset < total {
                    let req = Request::Output {
                        id: id.into(),
                        stream: stream.into(),
                        offset: offset as u64,
                        max: limit as u64,
                    };
                    match self.query(req).await? {
                        Frame::Done { data: chunk, .. } => (decode(&chunk["data_b64"]), "host"),
                        other => return Ok(execution_result(other)),
                    }
                } else {
                    (Vec::new(), "ledger")
                };
                let end = offset + bytes.len();
                let chunk = String::from_utf8_lossy(&bytes);
                let out = json!({
                    "id": data["id"], "state": data["state"], "stream": stream,
                    "offset": offset, "next_offset": if end < total { json!(end) } else { Value::Null },
                    "stored_bytes": stored.len(), "total_bytes": total, "source": source,
                    "data": chunk, "data_b64": data_encoding::BASE64.encode(&bytes),
                });
                let text = format!(
                    "execution {}: {} — {stream} bytes {offset}..{end} of {total}\n{chunk}",
                    data["id"].as_str().unwrap_or("?"),
                    data["state"].as_str().unwrap_or("?"),
                );
                Ok(build(out, text, false))
            }
            other => Ok(execution_result(other)),
        }
    }
}

impl ServerHandler for WaymarkMcp {
    fn get_info(&self) -> InitializeResult {
        InitializeResult::new(ServerCapabilities::builder().enable_tools().build())
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
        let result = match request.name.as_ref() {
            tools::EXEC_STATUS => {
                let id = required_str(&args, "id")?;
                execution_result(self.query(Request::Status { id: id.into() }).await?)
            }
            tools::EXEC_CANCEL => {
                let id = required_str(&args, "id")?;
                execution_result(self.query(Request::Cancel { id: id.into() }).await?)
            }
            tools::EXEC_RESULT => self.result_page(&args).await?,
            tools::EXEC_LIST => {
                let limit = uint_arg(&args, "limit")?;
                let req = Request::List {
                    state: str_arg(&args, "state")?.map(str::to_string),
                    host: str_arg(&args, "host")?.map(str::to_string),
                    tool: str_arg(&args, "tool")?.map(str::to_string),
                    actor: None,
                    since_ms: None,
                    limit,
                    after: str_arg(&args, "after")?.map(str::to_string),
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
                    defer_delivery: self.pending.is_some(),
                };
                let progress = self.progress_for(token.clone(), None, &args).await;
                self.call(req, None, &context, progress).await?
            }
            name => {
                let progress = self.progress_for(token.clone(), Some(name), &args).await;
                let req = Request::Call {
                    tool: Some(name.to_string()),
                    args,
                    host: None,
                    raw: None,
                    key,
                    transport: Some(self.transport.into()),
                    defer_delivery: self.pending.is_some(),
                };
                self.call(req, Some(name), &context, progress).await?
            }
        };
        Ok(result.into())
    }
}
