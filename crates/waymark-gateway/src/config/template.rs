//! Durations and argv templates, as written in `waymark.toml`.

use std::time::Duration;

use super::{TemplatePart, EXECUTION_ID_PLACEHOLDER};

/// Parses a duration such as `500ms`, `30s`, `10m`, `2h`, `1d`.
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let t = text.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: u64 = num
        .parse()
        .map_err(|_| format!("{text:?} is not a duration (use e.g. 30s, 10m, 2h)"))?;
    let ms = match unit {
        "ms" => n,
        "s" => n * 1000,
        "m" => n * 60_000,
        "h" => n * 3_600_000,
        "d" => n * 86_400_000,
        _ => return Err(format!("{text:?} has unit {unit:?}; use ms, s, m, h or d")),
    };
    Ok(Duration::from_millis(ms))
}

pub(super) fn is_name(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 64
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_' || b == b'-')
}

/// Parses an argv template word: `{name}` is an argument, `{execution_id}` the execution's
/// ID, `{{` and `}}` are literal braces.
pub fn parse_template(word: &str) -> Result<Vec<TemplatePart>, String> {
    let mut parts = Vec::new();
    let mut text = String::new();
    let mut chars = word.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '{' if chars.peek() == Some(&'{') => {
                chars.next();
                text.push('{');
            }
            '}' if chars.peek() == Some(&'}') => {
                chars.next();
                text.push('}');
            }
            '{' => {
                let mut name = String::new();
                loop {
                    match chars.next() {
                        Some('}') => break,
                        Some(ch) => name.push(ch),
                        None => return Err(format!("{word:?}: `{{` without a closing `}}` (write `{{{{` for a literal brace)")),
                    }
                }
                if !is_name(&name) {
                    return Err(format!("{word:?}: {{{name}}} is not an argument name (lowercase letters, digits, _ and -); write `{{{{` and `}}}}` for literal braces, as in a shell's `${{{{#VAR}}}}`"));
                }
                if !text.is_empty() {
                    parts.push(TemplatePart::Text(std::mem::take(&mut text)));
                }
                parts.push(if name == EXECUTION_ID_PLACEHOLDER {
                    TemplatePart::ExecutionId
                } else {
                    TemplatePart::Arg(name)
                });
            }
            '}' => {
                return Err(format!(
                    "{word:?}: a lone `}}` (write `}}}}` for a literal brace)"
                ))
            }
            ch => text.push(ch),
        }
    }
    if !text.is_empty() || parts.is_empty() {
        parts.push(TemplatePart::Text(text));
    }
    Ok(parts)
}
