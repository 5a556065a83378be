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

use rmcp::model::{
    ElicitRequest, ElicitRequestParams, InputRequest, InputRequests, JsonObject, Task, TaskPayload,
};
use waymark_core::{ExecState, ExecutionId, ReplayContract};
use waymark_protocol::{ApprovalQuestion, ExecutionView};

use crate::approval;

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
