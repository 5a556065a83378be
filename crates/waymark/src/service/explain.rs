//! `exec explain`: the incident view of one execution, from its ledger events.

use waymark_core::{ExecState, ExecutionId, Outcome};
use waymark_ledger::{EventKind, ExecutionRecord};

use super::render::{execution_view, fmt_time};
use crate::protocol::Explanation;

/// The incident view of one execution, from its ledger events.
pub async fn explain(
    ledger: &dyn waymark_ledger::LedgerApi,
    id: ExecutionId,
) -> Result<(String, Explanation), String> {
    let rec = ledger
        .get(id)
        .await
        .map_err(|e| e.to_string())?
        .ok_or(format!("execution {id} is not in the ledger"))?;
    let events = ledger.events_of(id).await.map_err(|e| e.to_string())?;
    // The runs its callers came in, each read by its id: as cheap for the oldest execution
    // as for the newest.
    let mut runs = std::collections::HashMap::new();
    for e in &events {
        let run = match &e.kind {
            EventKind::Accepted { run, .. } | EventKind::Attached { run, .. } => run,
            _ => continue,
        };
        if let Some(r) = run.as_ref().filter(|r| !runs.contains_key(*r)) {
            let found = ledger.run(r).await.map_err(|e| e.to_string())?;
            runs.insert(r.clone(), found);
        }
    }
    let proc_of = |run: &Option<String>| -> String {
        run.as_ref()
            .and_then(|r| runs.get(r).cloned().flatten())
            .map(|x| x.transport)
            .unwrap_or_else(|| "an unrecorded process".into())
    };
    let mut lines = vec![format!(
        "Execution {id}: tool {} on {}, now {}.",
        rec.tool,
        rec.host,
        rec.state()
    )];
    let http = http_line(ledger, &rec).await;
    // Where the outcome comes from, in the channel's terms: an SSH host's marker, or an HTTP
    // target's answers (the key makes a re-send answer the first request's result).
    let (once, outcome_from) = match &http {
        Some(_) => (
            "each send carried the same idempotency key",
            "the target's answer",
        ),
        None => (
            "the host marker refuses a second start",
            "the host's marker",
        ),
    };
    lines.extend(http);
    let mut timeline = Vec::new();
    let mut callers: Vec<String> = Vec::new();
    let mut attached = 0;
    let (mut authorized, mut dispatched, mut observed, mut delivered, mut lost) =
        (None, None, None, None, None);
    // An end Waymark recorded without the host (denied, expired, never sent or never started).
    let mut settled: Option<(String, ExecState)> = None;
    for e in &events {
        let at = fmt_time(e.at);
        let what = match &e.kind {
            EventKind::Accepted { actor, run, .. } => {
                callers.push(proc_of(run));
                format!("accepted: first call, from {} ({})", actor.0, proc_of(run))
            }
            EventKind::Attached { actor, action, run } => {
                attached += 1;
                callers.push(proc_of(run));
                format!(
                    "a later call from {} ({}) attached instead of starting a new execution: {}",
                    actor.0,
                    proc_of(run),
                    crate::protocol::answer::attach_words(*action)
                )
            }
            EventKind::Transition { to, transition, .. } => {
                match to {
                    ExecState::Authorized => authorized = Some(at.clone()),
                    ExecState::Dispatched => dispatched = Some(at.clone()),
                    ExecState::Unknown => lost = Some(at.clone()),
                    s if s.has_result()
                        && matches!(transition, waymark_core::Transition::Delivered) =>
                    {
                        delivered = Some(at.clone())
                    }
                    ExecState::Running if observed.is_some() => {}
                    ExecState::Completed
                    | ExecState::TimedOut
                    | ExecState::Cancelled
                    | ExecState::Interrupted
                    | ExecState::Running => observed = Some((at.clone(), *to)),
                    ExecState::Failed | ExecState::Denied | ExecState::Expired => {
                        settled = Some((at.clone(), *to))
                    }
                    _ => {}
                }
                format!("{} → {}", transition.name(), to)
            }
            EventKind::Note { name, .. } => name.clone(),
            EventKind::Checkpoint { .. } => "checkpoint".into(),
        };
        timeline.push(format!("  #{:<6} {at}  {what}", e.seq));
    }
    let distinct: std::collections::BTreeSet<&String> = callers.iter().collect();
    lines.push(format!(
        "1. Callers: {} call(s) ({} attached) from {} distinct agent session(s): {}.",
        callers.len(),
        attached,
        distinct.len(),
        distinct
            .iter()
            .map(|s| s.as_str())
            .collect::<Vec<_>>()
            .join("; ")
    ));
    lines.push(format!(
        "2. Authorized: {}. Dispatched: {}{}.",
        authorized.as_deref().unwrap_or("no"),
        dispatched.as_deref().unwrap_or("no"),
        if rec.dispatch_attempts > 1 {
            format!(
                " ({} attempts under this one id; {once})",
                rec.dispatch_attempts
            )
        } else {
            String::new()
        }
    ));
    lines.push(match (&observed, &lost) {
        (Some((at, s)), Some(l)) => format!("3. The connection was lost at {l}; {outcome_from} later showed {s} (recorded {at})."),
        (Some((at, s)), None) => format!("3. The host reported {s} at {at}."),
        (None, Some(l)) => format!("3. The connection was lost at {l}; no host outcome is known yet (run `waymark exec status {id}`)."),
        (None, None) => match &settled {
            Some((at, ExecState::Failed)) => format!("3. It did not start on the host ({}; recorded {at}).", rec.reason.as_deref().unwrap_or("no reason recorded")),
            Some((at, s)) => format!("3. It never reached the host: {s} at {at}."),
            None => "3. No host outcome is recorded.".into(),
        },
    });
    let ended = observed.clone().or(settled.clone());
    let first_attach = events
        .iter()
        .find(|e| matches!(e.kind, EventKind::Attached { .. }))
        .map(|e| fmt_time(e.at));
    lines.push(match (&ended, &delivered) {
        (Some((at, _)), Some(d)) if lost.is_some() && first_attach.as_deref().is_some_and(|a| a <= d.as_str()) => format!(
            "4. Delivery failed for the first caller: its connection was lost before the host finished (recorded {at}). The result reached a later, attached call at {d}."
        ),
        (Some(_), Some(d)) => format!("4. The result was delivered to the caller at {d}."),
        (Some((at, _)), None) if rec.state().has_result() => format!("4. NOT DELIVERED: it ended (recorded {at}) but no caller has received the result yet; `waymark exec result {id}` (or the same call again) delivers it."),
        (_, Some(d)) => format!("4. The result was delivered to the caller at {d}."),
        _ => "4. Nothing to deliver yet.".into(),
    });
    let later: Vec<ExecutionRecord> = ledger
        .by_fingerprint(&rec.fingerprint)
        .await
        .map_err(|e| e.to_string())?
        .into_iter()
        .filter(|r| r.id > id)
        .collect();
    lines.push(if attached > 0 && later.is_empty() {
        format!("5. {attached} later call(s) attached to this execution; none started a new one.")
    } else if later.is_empty() {
        "5. No later call of the same intent.".into()
    } else {
        let ids = later.iter().map(|r| r.id.to_string()).collect::<Vec<_>>().join(", ");
        let never_ran = matches!(rec.state(), ExecState::Failed | ExecState::Denied | ExecState::Expired)
            || (rec.state() == ExecState::Cancelled && dispatched.is_none());
        if never_ran {
            format!("5. Later calls of the same intent started new executions: {ids}. This one provably never ran ({}), so a new one was safe.", rec.state())
        } else {
            format!("5. Later calls of the same intent started new executions: {ids} (outside the retry window or scope).")
        }
    });
    let text = format!("{}\n\nTimeline:\n{}", lines.join("\n"), timeline.join("\n"));
    let data = Explanation {
        execution: execution_view(&rec),
        later_executions: later.iter().map(|r| r.id).collect(),
        answers: lines,
        timeline,
    };
    Ok((text, data))
}

/// For an HTTP execution: the method, the target, and which request answered with what
/// (the request, a re-send under the same key, or the status request: never the request's
/// status when only the status request answered).
async fn http_line(
    ledger: &dyn waymark_ledger::LedgerApi,
    rec: &ExecutionRecord,
) -> Option<String> {
    let waymark_core::Channel::Http { method, target } = rec.action.channel() else {
        return None;
    };
    let answer = match &rec.outcome {
        Some(Outcome::Answered {
            by,
            status,
            succeeded,
            reported,
        }) => {
            let read = reported
                .as_deref()
                .map(|r| format!(" ({r})"))
                .unwrap_or_default();
            let verdict = match succeeded {
                Some(true) => "succeeded",
                Some(false) => "failed",
                None => "success NOT PROVEN",
            };
            format!("{} answered {status}{read}: {verdict}", by.words())
        }
        // Recorded before answers named their request: the stored status line.
        _ => match ledger
            .result(rec.id)
            .await
            .ok()
            .flatten()
            .and_then(|r| waymark_gateway::flow::status_code(&r))
        {
            Some(code) => format!("answered {code}"),
            None => "no answer recorded".into(),
        },
    };
    Some(format!("HTTP: {method} {target}; {answer}."))
}
