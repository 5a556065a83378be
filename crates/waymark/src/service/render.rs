//! How the daemon shows ledger records: the protocol's views of them, exit codes, times and
//! status text.

use waymark_core::{ExecState, Outcome, Timestamp};
use waymark_gateway::flow::{describe, describe_answer, Audience, CallOutcome};
use waymark_ledger::{ChainHead, ExecutionRecord};

use crate::exit;
use crate::protocol::{
    ApprovalQuestion, CallAnswer, CallOutput, ChainPosition, ExecutionView, OutputHeads, RunView,
};

/// The exit code an execution's state maps to.
pub fn exit_for(rec: &ExecutionRecord) -> i32 {
    match rec.state() {
        ExecState::Completed => match &rec.outcome {
            Some(Outcome::Exited {
                exit_code: Some(c), ..
            }) => *c,
            Some(Outcome::Exited {
                signal: Some(s), ..
            }) => 128 + s,
            Some(Outcome::Answered { succeeded, .. }) => match succeeded {
                Some(true) => 0,
                Some(false) => 1,
                // Finished at the target, success not proven: never 0.
                None => exit::UNKNOWN,
            },
            _ => 0,
        },
        ExecState::Failed => exit::NOT_STARTED,
        ExecState::Unknown | ExecState::Dispatched => exit::UNKNOWN,
        ExecState::Running => exit::RUNNING,
        ExecState::TimedOut | ExecState::Cancelled => exit::STOPPED,
        ExecState::Reviewed => 0,
        _ => exit::BLOCKED,
    }
}

/// An execution record as the protocol shows it.
pub fn execution_view(rec: &ExecutionRecord) -> ExecutionView {
    ExecutionView {
        id: rec.id,
        state: rec.state(),
        result_observed: rec.lifecycle.result_observed,
        result_delivered: rec.lifecycle.result_delivered,
        tool: rec.tool.clone(),
        host: rec.host.clone(),
        actor: rec.actor.clone(),
        contract: rec.contract,
        fingerprint: rec.fingerprint,
        accepted_at_ms: rec.accepted_at,
        updated_at_ms: rec.updated_at,
        finished_at_ms: rec.finished_at,
        outcome: rec.outcome.clone(),
        reason: rec.reason.clone(),
        dispatch_attempts: rec.dispatch_attempts,
        run: rec.run.clone(),
    }
}

/// The data of an `awaiting_approval` event: what a front end shows its user to decide on.
pub fn approval_question(rec: &ExecutionRecord) -> ApprovalQuestion {
    ApprovalQuestion {
        id: rec.id,
        tool: rec.tool.clone(),
        host: rec.host.clone(),
        actor: rec.actor.clone(),
        contract: rec.contract,
        action: rec.action.as_str().to_string(),
    }
}

pub fn call_answer(o: &CallOutcome) -> CallAnswer {
    CallAnswer {
        execution: execution_view(&o.record),
        attached: o.attached,
        message: o.message(Audience::Cli),
        output: o.result.as_ref().map(|r| CallOutput {
            heads: OutputHeads::new(
                &r.stdout.head,
                r.stdout.total_bytes,
                &r.stderr.head,
                r.stderr.total_bytes,
            ),
            stdout_truncated: r.stdout.truncated(),
            stderr_truncated: r.stderr.truncated(),
        }),
    }
}

pub fn fmt_time(t: Timestamp) -> String {
    let ms = t.as_millis();
    let secs = (ms / 1000) as i64;
    let days = secs.div_euclid(86_400);
    let rem = secs.rem_euclid(86_400);
    // Civil date from days since the epoch (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let y = yoe + era * 400;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = if m <= 2 { y + 1 } else { y };
    format!(
        "{y:04}-{m:02}-{d:02} {:02}:{:02}:{:02}.{:03}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60,
        ms % 1000
    )
}

/// A status summary: what is known, since when, what to do next. `delivers`: the answer that
/// carries this text also carries the result to its caller, so it is delivered with it.
pub fn status_text(rec: &ExecutionRecord, delivers: bool) -> String {
    let mut s = format!(
        "{}  {}{}\n  tool {} on host {}, accepted {}, last change {}\n  {}",
        rec.id,
        rec.state(),
        match (
            rec.state().has_result(),
            rec.lifecycle.result_delivered,
            delivers
        ) {
            (false, _, _) => "",
            (true, true, _) => ", result delivered",
            (true, false, true) => ", result delivered with this answer",
            (true, false, false) => ", result NOT delivered",
        },
        rec.tool,
        rec.host,
        fmt_time(rec.accepted_at),
        fmt_time(rec.updated_at),
        if delivers {
            describe_answer(rec, None, Audience::Cli)
        } else {
            describe(rec, None, Audience::Cli)
        }
    );
    if rec.state().has_result() {
        s.push_str(&if delivers && rec.lifecycle.result_observed {
            // The CLI prints the output this answer carries below it.
            format!(
                "\n  Output delivered with this answer, below; again: `waymark exec result {}`",
                rec.id
            )
        } else {
            format!("\n  Output: `waymark exec result {}`", rec.id)
        });
    }
    s
}

pub fn chain_position(h: &ChainHead) -> ChainPosition {
    ChainPosition {
        seq: h.seq,
        hash: h.hash.clone(),
    }
}

pub fn run_view(r: &waymark_ledger::RunRecord) -> RunView {
    RunView {
        id: r.id.clone(),
        actor: r.actor.clone(),
        transport: r.transport.clone(),
        started_at: r.started_at,
        ended_at: r.ended_at,
        calls: r.calls,
    }
}
