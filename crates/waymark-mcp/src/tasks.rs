//! Durable MCP tasks (the `io.modelcontextprotocol/tasks` extension, SEP-2663, as rmcp 3.11
//! implements it): a long `tools/call` from a client that declared the extension becomes a
//! task whose id is the execution ID.
//!
//! The ledger is the only task store. `tools/call` answers `CreateTaskResult` as soon as the
//! daemon accepted the execution (the accepted record is flushed before the daemon names the
//! id); the call itself keeps running in the daemon. `tasks/get` asks the daemon for the
//! execution's status (`Request::Status`, which checks the host's marker for an execution that
//! may be on the host), so a task outlives the shim, the MCP session and the daemon: after a
//! restart the same id answers from the ledger and the host. rmcp's own `TaskManager` (in
//! memory) is not used.
//!
//! How a Waymark state reads as a task status ([`status_of`]):
//!
//! | Waymark state | task status |
//! |---|---|
//! | accepted, authorized, dispatched, running | `working` |
//! | unknown, interrupted | `working`, with a status message saying what it means (never `completed`) |
//! | awaiting_approval | `input_required` with an approval elicitation when the client can answer a form elicitation, else `working` with a status message |
//! | completed (any exit code), failed (did not start), timed_out, denied, expired, reviewed | `completed`, with the same `CallToolResult` a normal call returns (`isError` as there) |
//! | cancelled | `cancelled` |
//!
//! `tasks/cancel` cancels the execution only where the tool's replay contract allows it
//! (read_only, idempotent), like MCP cancellation of a plain call; otherwise it is refused
//! with an error that says why, and the command runs to its end.

use std::sync::{Arc, Mutex};

use rmcp::model::{
    CallToolResponse, CancelTaskParams, CreateTaskResult, CustomResult, DetailedTask,
    ElicitRequest, ElicitRequestParams, ElicitResult, GetTaskParams, GetTaskResult, InputRequest,
    InputRequests, JsonObject, ProgressToken, Task, TaskPayload, TaskStatus, UpdateTaskParams,
};
use rmcp::service::RequestContext;
use rmcp::{ErrorData, RoleServer};
use serde_json::{json, Value};
use waymark_core::{ExecState, ExecutionId, ReplayContract};
use waymark_protocol::client::ClientError;
use waymark_protocol::{
    ApprovalQuestion, Event, ExecutionList, ExecutionView, Frame, Request, StatusAnswer,
};

use crate::approval;
use crate::progress::Progress;
use crate::server::{client_answers_forms, no_daemon, to_object, WaymarkMcp};
use crate::tools::{execution_result, lost_call};

/// The polling interval suggested to clients, in milliseconds.
pub const POLL_INTERVAL_MS: u64 = 500;

/// The key of the approval question in a task's `inputRequests` (one per task).
pub const APPROVAL_KEY: &str = "approval";

/// The 2025-11-25 (SEP-1686) methods that SEP-2663 dropped, served as custom methods for
/// clients of that revision: the result of a task (waiting for it), and this actor's tasks.
pub const TASKS_RESULT: &str = "tasks/result";
pub const TASKS_LIST: &str = "tasks/list";

/// A task status, before its payload is attached.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Status {
    Working,
    InputRequired,
    Completed,
    Cancelled,
}

/// How a Waymark state reads as a task status; `can_elicit`: the client can answer an
/// approval question (form elicitation) through `tasks/update`.
pub fn status_of(state: ExecState, can_elicit: bool) -> Status {
    use ExecState::*;
    match state {
        Completed | Failed | TimedOut | Denied | Expired | Reviewed => Status::Completed,
        Cancelled => Status::Cancelled,
        AwaitingApproval if can_elicit => Status::InputRequired,
        AwaitingApproval | Accepted | Authorized | Dispatched | Running | Unknown | Interrupted => {
            Status::Working
        }
    }
}

impl Status {
    /// The status as MCP says it.
    pub fn wire(self) -> TaskStatus {
        match self {
            Status::Working => TaskStatus::Working,
            Status::InputRequired => TaskStatus::InputRequired,
            Status::Completed => TaskStatus::Completed,
            Status::Cancelled => TaskStatus::Cancelled,
        }
    }
}

/// Whether tasks/cancel may cancel an execution of this contract.
pub fn cancellable(contract: ReplayContract) -> bool {
    matches!(
        contract,
        ReplayContract::ReadOnly | ReplayContract::Idempotent
    )
}

/// What a task's status message says for a Waymark state.
pub fn status_message(state: ExecState, id: ExecutionId) -> String {
    match state {
        ExecState::Accepted => format!("{id}: accepted; not yet sent to the host"),
        ExecState::Authorized => format!(
            "{id}: authorized; not yet sent to the host, so nothing ran. If it stays here, the \
             call that would send it ended (a daemon restart): make the same call again; it \
             attaches to {id} and sends it once"
        ),
        ExecState::Dispatched | ExecState::Running => format!("{id}: running on the host"),
        ExecState::Unknown => format!(
            "{id}: outcome unknown: it may have started and may still be running; every \
             tasks/get asks the host again. This is not a failure; do not call again with a \
             new intent."
        ),
        ExecState::Interrupted => format!(
            "{id}: started, then its process vanished without an exit record; an operator must \
             review it (`waymark exec review {id}`)"
        ),
        ExecState::AwaitingApproval => format!(
            "{id}: waits for approval (an operator: `waymark approve {id}`, or this client \
             through the task's input request)"
        ),
        ExecState::Cancelled => format!("{id}: cancelled"),
        other => format!("{id}: {other}"),
    }
}

/// The approval question for an execution that awaits approval, as a task input request.
pub fn approval_request(question: &ApprovalQuestion) -> InputRequests {
    let params = ElicitRequestParams::FormElicitationParams {
        meta: None,
        message: approval::message(question),
        requested_schema: approval::schema(),
    };
    let mut requests = InputRequests::new();
    requests.insert(
        APPROVAL_KEY.into(),
        InputRequest::Elicitation(ElicitRequest::new(params)),
    );
    requests
}

/// A task's base fields from an execution (accepted and last changed).
pub fn task_base(e: &ExecutionView) -> Task {
    Task::new(
        e.id.to_string(),
        rmcp::model::TaskStatus::Working,
        iso8601(e.accepted_at_ms.as_millis()),
        iso8601(e.updated_at_ms.as_millis()),
    )
    .with_poll_interval_ms(POLL_INTERVAL_MS)
    .with_status_message(status_message(e.state, e.id))
}

/// The approval question of a task that awaits approval, from what its status shows. (The
/// status carries no canonical action: the question shows `?` for it.)
pub fn task_question(e: &ExecutionView) -> ApprovalQuestion {
    ApprovalQuestion {
        id: e.id,
        tool: e.tool.clone(),
        host: e.host.clone(),
        actor: e.actor.clone(),
        contract: e.contract,
        action: "?".into(),
    }
}

/// The payload of a task with a status; `result` is the call's result (for `completed`).
pub fn payload(status: Status, e: &ExecutionView, result: JsonObject) -> TaskPayload {
    match status {
        Status::Working => TaskPayload::Working,
        Status::InputRequired => TaskPayload::InputRequired {
            input_requests: approval_request(&task_question(e)),
        },
        Status::Completed => TaskPayload::Completed { result },
        Status::Cancelled => TaskPayload::Cancelled,
    }
}

/// An instant in milliseconds since the Unix epoch as ISO 8601 (UTC, millisecond precision).
pub fn iso8601(ms: u64) -> String {
    let secs = ms / 1000;
    let days = (secs / 86_400) as i64;
    let rem = secs % 86_400;
    // Howard Hinnant's civil_from_days.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{:03}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60,
        ms % 1000
    )
}

/// How long `tasks/result` waits for a task to end before it answers with what is known.
const RESULT_WAIT: std::time::Duration = std::time::Duration::from_secs(300);

/// The task methods of the MCP handler (`tools/call` as a task, `tasks/get`, `tasks/update`,
/// `tasks/cancel`, and the 2025-11-25 `tasks/result` and `tasks/list`).
impl WaymarkMcp {
    /// A call made as a task: answered with the task (its id is the execution ID) as soon as
    /// the daemon accepted the execution, which is durable by then; the call runs on in the
    /// daemon, relayed by a background request that only waits for its end. A call refused
    /// before acceptance (bad arguments, unknown tool) is answered as a plain result.
    ///
    /// While the command runs, its output goes to the client as progress notifications (when
    /// the call carried a `progressToken`, which stays valid for the task's life) and into the
    /// status message `tasks/get` answers in this session.
    pub(crate) async fn start_task(
        &self,
        req: Request,
        token: Option<ProgressToken>,
        context: &RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, ErrorData> {
        let peer = context.peer.clone();
        // The execution, and whether the call attached to an earlier one.
        let (id_tx, id_rx) = tokio::sync::oneshot::channel::<(ExecutionId, bool)>();
        let backend = self.backend.clone();
        let notify = token.is_some();
        // Without a token the tracker still feeds the status message; it never notifies.
        let token = token.unwrap_or(ProgressToken(rmcp::model::NumberOrString::Number(0)));
        let progress = Arc::new(Mutex::new(Progress::new(token)));
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
                if let Event::Execution { id, attached } = e {
                    if let Some(tx) = id_tx.lock().expect("task id").take() {
                        live.lock()
                            .expect("task output")
                            .insert(*id, progress.clone());
                        let _ = tx.send((*id, attached.is_some()));
                    }
                }
                if notify {
                    for n in note {
                        let _ = note_tx.send(n);
                    }
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
            // An earlier execution of the same intent: its handle says what it really is
            // (its state, accepted and changed times), as `tasks/get` will.
            Ok((id, true)) => {
                let (_, answer) = self.task_status(&id.to_string()).await?;
                let e = &answer.call.execution;
                let mut task = task_base(e);
                task.status = status_of(e.state, client_answers_forms(context)).wire();
                Ok(CallToolResponse::Task(CreateTaskResult::new(task)))
            }
            Ok((id, false)) => {
                let now = iso8601(
                    std::time::SystemTime::now()
                        .duration_since(std::time::UNIX_EPOCH)
                        .map_or(0, |d| d.as_millis() as u64),
                );
                let task = Task::new(id.to_string(), TaskStatus::Working, now.clone(), now)
                    .with_poll_interval_ms(POLL_INTERVAL_MS)
                    .with_status_message(status_message(ExecState::Accepted, id));
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
    pub(crate) async fn task_status(&self, id: &str) -> Result<(Frame, StatusAnswer), ErrorData> {
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
        let me = self.me().await;
        match frame.clone().answer::<StatusAnswer>() {
            Frame::Done { data, .. } if me.is_some_and(|me| data.call.execution.actor.0 != me) => {
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

    /// `tasks/result` (2025-11-25): the task's `CallToolResult` once it is final, waiting for
    /// it; after [`RESULT_WAIT`] the current (not final) result, which says what to do next.
    pub(crate) async fn task_result(
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
            let status = status_of(e.state, false);
            let done = matches!(status, Status::Completed | Status::Cancelled);
            if done || tokio::time::Instant::now() >= deadline {
                if status == Status::Completed {
                    self.deliver_with_response(context, e.id).await;
                }
                let r = execution_result(frame);
                return Ok(CustomResult::new(Value::Object(to_object(&r))));
            }
            tokio::time::sleep(std::time::Duration::from_millis(POLL_INTERVAL_MS)).await;
        }
    }

    /// `tasks/list` (2025-11-25): this actor's executions as tasks, newest first.
    pub(crate) async fn task_list(
        &self,
        params: Option<&Value>,
        context: &RequestContext<RoleServer>,
    ) -> Result<CustomResult, ErrorData> {
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
            actor: None,
            since_ms: None,
            limit: Some(100),
            after,
            // The daemon lists the executions of the actor it proved this connection to be.
            mine: true,
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
                let mut task = task_base(item);
                task.status = status_of(item.state, can_elicit).wire();
                serde_json::to_value(task).ok()
            })
            .collect();
        let mut out = json!({ "tasks": list });
        if let Some(next) = page.next {
            out["nextCursor"] = json!(next);
        }
        Ok(CustomResult::new(out))
    }

    pub(crate) async fn get_task(
        &self,
        request: GetTaskParams,
        context: &RequestContext<RoleServer>,
    ) -> Result<GetTaskResult, ErrorData> {
        let (frame, answer) = self.task_status(&request.task_id).await?;
        let e = &answer.call.execution;
        let status = status_of(e.state, client_answers_forms(context));
        let result = to_object(&execution_result(frame));
        let payload = payload(status, e, result);
        if status == Status::Completed {
            self.deliver_with_response(context, e.id).await;
        }
        let mut task = task_base(e);
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

    pub(crate) async fn update_task(&self, request: UpdateTaskParams) -> Result<(), ErrorData> {
        let task = request.task_id;
        // Keys other than the approval question are not ours: ignored, as the spec says.
        let Some(answer) = request.input_responses.get(APPROVAL_KEY) else {
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

    pub(crate) async fn cancel_task(&self, request: CancelTaskParams) -> Result<(), ErrorData> {
        let (_, answer) = self.task_status(&request.task_id).await?;
        let ExecutionView {
            id,
            state,
            contract,
            ..
        } = answer.call.execution;
        if matches!(
            status_of(state, false),
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
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn iso8601_formats_utc() {
        assert_eq!(iso8601(0), "1970-01-01T00:00:00.000Z");
        assert_eq!(iso8601(951_782_400_123), "2000-02-29T00:00:00.123Z");
        assert_eq!(iso8601(1_798_761_599_000), "2026-12-31T23:59:59.000Z");
    }

    #[test]
    fn unknown_is_never_completed_and_approval_needs_a_client_that_can_answer() {
        use ExecState::*;
        assert_eq!(status_of(Unknown, true), Status::Working);
        assert_eq!(status_of(Interrupted, true), Status::Working);
        assert_eq!(status_of(Running, true), Status::Working);
        assert_eq!(status_of(AwaitingApproval, true), Status::InputRequired);
        assert_eq!(status_of(AwaitingApproval, false), Status::Working);
        for s in [Completed, Failed, TimedOut, Denied, Expired, Reviewed] {
            assert_eq!(status_of(s, false), Status::Completed, "{s}");
        }
        assert_eq!(status_of(Cancelled, false), Status::Cancelled);
        assert!(status_message(Unknown, id()).contains("not a failure"));
    }

    fn id() -> ExecutionId {
        "act_01J9Z3K8Q4M7W2X5Y6Z8A9B0CD".parse().unwrap()
    }

    #[test]
    fn the_approval_request_is_a_form_elicitation_under_one_key() {
        let r = approval_request(&ApprovalQuestion {
            id: id(),
            tool: "guarded".into(),
            host: "h1".into(),
            actor: waymark_core::Actor("a".into()),
            contract: ReplayContract::Irreversible,
            action: "?".into(),
        });
        let v = serde_json::to_value(&r).unwrap();
        assert_eq!(v[APPROVAL_KEY]["method"], "elicitation/create");
        assert_eq!(
            v[APPROVAL_KEY]["params"]["requestedSchema"]["required"],
            json!(["approve"])
        );
        assert!(v[APPROVAL_KEY]["params"]["message"]
            .as_str()
            .unwrap()
            .contains(&id().to_string()));
    }
}
