//! What the flow tells a person about an execution, in the words of its [`Audience`]: a CLI
//! user is given commands to type, an MCP caller the tools to call. Commands only an operator
//! runs (`waymark approve`, `waymark exec review`, `waymark unlock`) are named as commands to
//! both. A recorded reason is quoted as recorded (it may come from the SSH layer).

use waymark_core::{AttachAction, ExecState, ExecutionId, Outcome};
use waymark_ledger::ExecutionRecord;

use super::marker::OUTPUT_NOT_FETCHED;

/// Whom a text speaks to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Audience {
    /// A person at the `waymark` command line.
    Cli,
    /// An agent over MCP, which has a tool for each step it may take itself.
    Mcp,
}

/// A step the caller can take about an execution itself.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Step {
    Status,
    Result,
    Cancel,
}

impl Step {
    fn verb(self) -> &'static str {
        match self {
            Step::Status => "status",
            Step::Result => "result",
            Step::Cancel => "cancel",
        }
    }
}

impl Audience {
    /// How this audience takes `step` for execution `id`: "`waymark exec status ID`", or "the
    /// `exec_status` tool with id ID" (the MCP server's tool names).
    pub fn step(self, step: Step, id: ExecutionId) -> String {
        match self {
            Audience::Cli => format!("`waymark exec {} {id}`", step.verb()),
            Audience::Mcp => format!("the `exec_{}` tool with id {id}", step.verb()),
        }
    }
}

/// A plain summary of an execution: what is known, and what to do next.
pub fn describe(rec: &ExecutionRecord, attached: Option<AttachAction>, to: Audience) -> String {
    let delivery = if rec.state().has_result() && !rec.lifecycle.result_delivered {
        " Result not yet delivered to the caller."
    } else {
        ""
    };
    format!("{}{delivery}", describe_answer(rec, attached, to))
}

/// The summary that travels with a call's answer. The answer carrying it is the delivery, so
/// it never says the result was not delivered (the ledger records delivery once the answer was
/// written, after this text was made).
pub fn describe_answer(
    rec: &ExecutionRecord,
    attached: Option<AttachAction>,
    to: Audience,
) -> String {
    let id = rec.id;
    let status = to.step(Step::Status, id);
    let prefix = match attached {
        Some(_) => format!("Attached to earlier execution {id} (same intent; not run again). "),
        None => String::new(),
    };
    let body = match rec.state() {
        ExecState::Completed => match &rec.outcome {
            Some(Outcome::Exited { exit_code: Some(c), .. }) => format!("Completed on the host with exit code {c}."),
            Some(Outcome::Exited { signal: Some(s), .. }) => format!("Completed on the host: killed by signal {s}."),
            Some(Outcome::Answered { by, status: code, succeeded, reported }) => {
                let read = reported.as_deref().map(|r| format!(" ({r})")).unwrap_or_default();
                let by = by.words();
                let by = format!("{}{}", by[..1].to_uppercase(), &by[1..]);
                match succeeded {
                    Some(true) => format!("{by} answered {code}: succeeded{read}."),
                    Some(false) => format!("{by} answered {code}: FAILED{read}."),
                    None => format!(
                        "{by} answered {code}: the operation finished at the target, but whether it succeeded is NOT PROVEN{read}. Its answer is kept: {} shows it; a human decides from it.",
                        to.step(Step::Result, id)
                    ),
                }
            }
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
                "Its output has not reached Waymark yet: {r}. The host keeps it: {status} (or the same call again) fetches it; it will not run again."
            ),
            r => format!(
                "Outcome UNKNOWN: the connection was lost after it may have been sent ({}). It may still be running. Do not retry blindly: run {status}.",
                r.unwrap_or("no reason recorded")
            ),
        },
        ExecState::Dispatched => format!("Dispatched; Waymark has not yet seen it start. Run {status}."),
        ExecState::Running => format!("Running on the host. Run {status} or {} later.", to.step(Step::Result, id)),
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

/// Said after a call's summary when its host (or HTTP target) could not be asked about it just
/// now.
pub(super) fn host_unasked(id: ExecutionId, why: &dyn std::fmt::Display, to: Audience) -> String {
    format!(
        " It could not be checked just now ({why}); run {} later.",
        to.step(Step::Status, id)
    )
}
