//! `[daemon] env_file`: the variables the daemon's credentials name (`token_env`,
//! `passphrase_env`, `url_env`), in systemd's EnvironmentFile format, 0600.
//!
//! The rule: the daemon applies the file to its own environment when it starts, before any
//! thread exists, so a variable set there wins over the environment of whichever process
//! started the daemon (a CLI call in some shell, `waymark mcp` under some agent). A variable the
//! configuration names that the file does not set comes from that environment, and the daemon
//! says so in its log and in `daemon status`; `config check` lists each one. A change to the
//! file takes effect at the next start (a reload does not re-read it).

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::sync::OnceLock;

use waymark_gateway::config::{Config, CredentialConfig, LedgerBackend, SecretSource, UrlSource};

/// The names the daemon took from its env_file at start.
static FROM_FILE: OnceLock<Vec<String>> = OnceLock::new();

/// Reads an env file: `NAME=VALUE` lines, `#` and `;` comments, values optionally in double
/// quotes (with `\"`, `\\` and `\n` escapes) or single quotes (literal). Refused when others
/// than its owner may read it, and at the first line that is not an assignment (file:line).
pub fn read(path: &Path) -> Result<Vec<(String, String)>, String> {
    let meta =
        std::fs::metadata(path).map_err(|e| format!("daemon.env_file {}: {e}", path.display()))?;
    let mode = meta.permissions().mode() & 0o777;
    if mode & 0o077 != 0 {
        return Err(format!(
            "daemon.env_file {} is mode {mode:o}: it holds credentials, so only its owner may \
             read it; `chmod 600 {}`",
            path.display(),
            path.display()
        ));
    }
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("daemon.env_file {}: {e}", path.display()))?;
    let mut vars = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let l = line.trim();
        if l.is_empty() || l.starts_with('#') || l.starts_with(';') {
            continue;
        }
        let at = |why: &str| format!("{}:{}: {why}", path.display(), i + 1);
        let Some((name, value)) = l.split_once('=') else {
            return Err(at("not NAME=VALUE"));
        };
        let name = name.trim();
        let valid = !name.is_empty()
            && !name.starts_with(|c: char| c.is_ascii_digit())
            && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
        if !valid {
            return Err(at(&format!(
                "{name:?} is not a variable name (letters, digits and _, not starting with a digit)"
            )));
        }
        vars.push((name.to_string(), unquote(value.trim()).map_err(|w| at(&w))?));
    }
    Ok(vars)
}

fn unquote(v: &str) -> Result<String, String> {
    let quoted = |q: char| v.len() >= 2 && v.starts_with(q) && v.ends_with(q);
    if quoted('\'') {
        return Ok(v[1..v.len() - 1].to_string());
    }
    if !quoted('"') {
        if v.starts_with(['"', '\'']) {
            return Err("the value's quote is not closed".into());
        }
        return Ok(v.to_string());
    }
    let mut out = String::new();
    let mut chars = v[1..v.len() - 1].chars();
    while let Some(c) = chars.next() {
        match (c, c == '\\') {
            (_, true) => match chars.next() {
                Some('n') => out.push('\n'),
                Some(e @ ('"' | '\\' | '$' | '`')) => out.push(e),
                Some(e) => {
                    out.push('\\');
                    out.push(e);
                }
                None => out.push('\\'),
            },
            (c, false) => out.push(c),
        }
    }
    Ok(out)
}

/// Applies the configuration's env_file to this process's environment. Called by `main`
/// before the daemon's runtime (and so any other thread) exists.
pub fn apply(config: &Config) -> Result<(), String> {
    let Some(path) = &config.daemon.env_file else {
        let _ = FROM_FILE.set(Vec::new());
        return Ok(());
    };
    let vars = read(path)?;
    for (name, value) in &vars {
        // Sound only while no other thread reads or writes the environment: main calls this
        // before it builds the daemon's runtime.
        std::env::set_var(name, value);
    }
    let _ = FROM_FILE.set(vars.into_iter().map(|(n, _)| n).collect());
    Ok(())
}

/// Every environment variable the configuration's credentials name, with what names it.
pub fn named_variables(config: &Config) -> Vec<(String, String)> {
    let mut named = Vec::new();
    for (name, c) in &config.credentials {
        match c {
            CredentialConfig::KeyFile {
                passphrase_env: Some(var),
                ..
            } => named.push((var.clone(), format!("credential {name} (key passphrase)"))),
            CredentialConfig::Http {
                source: SecretSource::Env(var),
                ..
            } => named.push((var.clone(), format!("credential {name}"))),
            _ => {}
        }
    }
    if let LedgerBackend::Postgres(pg) = &config.ledger_backend {
        if let UrlSource::Env(var) = &pg.url {
            named.push((var.clone(), "ledger.url_env".to_string()));
        }
    }
    named
}

/// Where this process has `var` from: `env_file`, `environment` (inherited from whichever
/// process started it), or `missing`.
pub fn source_of(var: &str) -> &'static str {
    if std::env::var_os(var).is_none() {
        "missing"
    } else if FROM_FILE
        .get()
        .is_some_and(|names| names.iter().any(|n| n == var))
    {
        "env_file"
    } else {
        "environment"
    }
}

/// Logs each variable the configuration names that the daemon took from the environment it
/// was started with, or lacks: a credential that works or not by which shell started it.
pub fn log_sources(config: &Config) {
    for (var, what) in named_variables(config) {
        match source_of(&var) {
            "environment" => {
                tracing::warn!(%var, %what, "taken from the environment of the process that started the daemon; set it in [daemon] env_file so it does not depend on which shell that was")
            }
            "missing" => {
                tracing::warn!(%var, %what, "not set in the daemon's environment nor its env_file: calls that need it will fail")
            }
            _ => {}
        }
    }
}
