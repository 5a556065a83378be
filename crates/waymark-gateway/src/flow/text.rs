//! What the flow tells a person about an execution.

use super::marker::OUTPUT_NOT_FETCHED;
use waymark_core::{AttachAction, ExecState};
use waymark_ledger::ExecutionRecord;

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
