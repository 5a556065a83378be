//! A tool's `key=value` arguments, and durations, as the CLI reads them.

use serde_json::{Map, Value};

use crate::{exit, fail};

/// A tool's `key=value` arguments. A key given twice is refused (exit 2), never resolved to
/// one of its values: `path=/a path=/b` is a mistake only the caller can settle.
pub fn parse_kv(args: &[String]) -> Map<String, Value> {
    let mut m = Map::new();
    let mut stdin_used = false;
    for a in args {
        match a.split_once('=') {
            Some((k, _)) if m.contains_key(k) => fail(
                format!("argument {k} is given twice; give it once"),
                exit::USAGE,
            ),
            Some((k, v)) => {
                let v = arg_value(k, v, &mut stdin_used);
                m.insert(k.to_string(), Value::String(v));
            }
            None => fail(format!("argument {a:?} is not key=value"), exit::USAGE),
        }
    }
    m
}

/// An argument's value, from the command line or, so that a secret never has to be in any
/// process's argv, from elsewhere: `@-` stdin (one trailing newline dropped), `@env:VAR` the
/// environment, `@prompt` the terminal without echo. `@@...` is a literal value `@...`.
fn arg_value(name: &str, v: &str, stdin_used: &mut bool) -> String {
    if let Some(literal) = v.strip_prefix("@@") {
        return format!("@{literal}");
    }
    if v == "@-" {
        if std::mem::replace(stdin_used, true) {
            fail(
                format!("argument {name}: only one argument can read stdin (@-)"),
                exit::USAGE,
            );
        }
        let mut text = String::new();
        std::io::Read::read_to_string(&mut std::io::stdin(), &mut text).unwrap_or_else(|e| {
            fail(
                format!("argument {name}: cannot read it from stdin: {e}"),
                exit::USAGE,
            )
        });
        let text = text.strip_suffix('\n').unwrap_or(&text);
        return text.strip_suffix('\r').unwrap_or(text).to_string();
    }
    if let Some(var) = v.strip_prefix("@env:") {
        return std::env::var(var).unwrap_or_else(|_| {
            fail(
                format!("argument {name}: environment variable {var} is not set (or not UTF-8)"),
                exit::USAGE,
            )
        });
    }
    if v == "@prompt" {
        return prompt_hidden(name).unwrap_or_else(|e| {
            fail(
                format!("argument {name}: cannot ask on the terminal (@prompt): {e}; use @- or @env:VAR"),
                exit::USAGE,
            )
        });
    }
    v.to_string()
}

/// Asks for `name` on the controlling terminal with echo off, and restores the terminal.
fn prompt_hidden(name: &str) -> std::io::Result<String> {
    use std::io::{BufRead as _, Write as _};
    use std::os::fd::AsRawFd as _;
    let tty = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/tty")?;
    let fd = tty.as_raw_fd();
    // SAFETY: a zeroed termios is a valid buffer for tcgetattr to fill; fd is open.
    let mut term: libc::termios = unsafe { std::mem::zeroed() };
    if unsafe { libc::tcgetattr(fd, &mut term) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    let saved = term;
    term.c_lflag &= !libc::ECHO;
    // SAFETY: fd is open and term came from tcgetattr.
    unsafe { libc::tcsetattr(fd, libc::TCSANOW, &term) };
    let mut out = &tty;
    let asked = write!(out, "{name}: ").and_then(|()| out.flush());
    let mut line = String::new();
    let read = asked.and_then(|()| std::io::BufReader::new(&tty).read_line(&mut line));
    // SAFETY: restores what tcgetattr returned, on the same open fd.
    unsafe { libc::tcsetattr(fd, libc::TCSANOW, &saved) };
    let _ = writeln!(out);
    read?;
    Ok(line.trim_end_matches(['\n', '\r']).to_string())
}

pub fn duration_ms(text: &str) -> u64 {
    waymark_gateway::config::parse_duration(text)
        .unwrap_or_else(|e| fail(e, exit::USAGE))
        .as_millis() as u64
}

/// A read's `--timeout`: seconds (`2`), or a number and a unit (`500ms`, `1m`).
pub fn read_timeout(text: &str) -> Result<std::time::Duration, String> {
    let timeout = match text.parse::<u64>() {
        Ok(secs) => std::time::Duration::from_secs(secs),
        Err(_) => waymark_gateway::config::parse_duration(text)?,
    };
    if timeout.is_zero() {
        return Err("a read needs some time to ask the host: give at least 1ms".into());
    }
    Ok(timeout)
}
