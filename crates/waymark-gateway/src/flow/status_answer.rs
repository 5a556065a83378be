//! Reading an HTTP status answer by the tool's rule (`code_pointer`, `code_header`,
//! `outcome_pointer`): whether the operation succeeded, failed, is still pending, or the answer
//! does not prove it. Pure: the answer in, a reading in words out.

use waymark_http::HttpAnswer;

use crate::config::StatusOutcome;

/// A finished operation's status answer, read by the tool's rule. Each reading says what was
/// read, in words kept on the record.
pub(super) enum Reading {
    Succeeded(String),
    Failed(String),
    /// The answer does not say, or says something the rule does not list.
    Unproven(String),
}

/// A status answer that is either still pending by the rule, or finished with a reading.
pub(super) enum StatusRead {
    Pending(String),
    Done(Reading),
}

/// Reads whether the operation succeeded from a 2xx status answer, by the tool's rule. With no
/// rule the answer proves the operation finished, not that it succeeded.
pub(super) fn read_outcome(rule: Option<&StatusOutcome>, a: &HttpAnswer) -> StatusRead {
    use Reading::{Failed, Succeeded, Unproven};
    use StatusRead::Done;
    let Some(rule) = rule else {
        return StatusRead::Done(Unproven(
            "the tool names no code_pointer, code_header or outcome_pointer to read success from its status answer".into(),
        ));
    };
    let json = || -> Result<serde_json::Value, String> {
        if a.truncated() {
            return Err(format!(
                "the status answer's body was cut at {} of {} bytes",
                a.body.len(),
                a.total
            ));
        }
        serde_json::from_slice(&a.body)
            .map_err(|e| format!("the status answer's body is not JSON ({e})"))
    };
    let by_code = |code: Option<u16>, from: String| match code {
        Some(c) if (100..400).contains(&c) => {
            Done(Succeeded(format!("{from} says the request answered {c}")))
        }
        Some(c) if (400..600).contains(&c) => {
            Done(Failed(format!("{from} says the request answered {c}")))
        }
        _ => Done(Unproven(format!("{from} holds no status code"))),
    };
    match rule {
        StatusOutcome::CodeAt(pointer) => match json() {
            Ok(v) => {
                let code = v.pointer(pointer).and_then(|c| match c {
                    serde_json::Value::Number(n) => n.as_u64(),
                    serde_json::Value::String(s) => s.trim().parse().ok(),
                    _ => None,
                });
                by_code(
                    code.and_then(|c| u16::try_from(c).ok()),
                    format!("field {pointer}"),
                )
            }
            Err(why) => Done(Unproven(why)),
        },
        StatusOutcome::CodeHeader(name) => {
            let code = a
                .headers
                .iter()
                .find(|(k, _)| k == name)
                .and_then(|(_, v)| v.trim().parse().ok());
            by_code(code, format!("header {name}"))
        }
        StatusOutcome::ValueAt {
            pointer,
            succeeded,
            failed,
            pending,
        } => match json() {
            Ok(v) => {
                let value = match v.pointer(pointer) {
                    Some(serde_json::Value::String(s)) => s.clone(),
                    Some(other) => other.to_string(),
                    None => {
                        return Done(Unproven(format!(
                            "the status answer has no field {pointer}"
                        )))
                    }
                };
                let said = format!("field {pointer} is {value:?}");
                if succeeded.contains(&value) {
                    Done(Succeeded(said))
                } else if failed.contains(&value) {
                    Done(Failed(said))
                } else if pending.contains(&value) {
                    StatusRead::Pending(said)
                } else {
                    Done(Unproven(format!(
                        "{said}, which the tool lists neither as succeeded nor as failed"
                    )))
                }
            }
            Err(why) => Done(Unproven(why)),
        },
    }
}
