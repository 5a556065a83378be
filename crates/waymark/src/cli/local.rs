//! The commands that work in this process, without the daemon: `init`, `config check`,
//! `hosts`, and `audit verify --ledger` (which opens a ledger no daemon owns).

use std::io::Write;
use std::sync::Arc;

use serde_json::Value;
use waymark_gateway::config::{Config, HostEntry, LedgerBackend};
use waymark_gateway::ssh_hosts::SshHosts;
use waymark_ledger::{Ledger, LedgerError, LedgerOptions, WitnessCheck};

use super::{Cli, HostsCommand};
use crate::protocol::{client, Frame, Request};
use crate::{config_path, defaults, exit, fail, load_config};

/// `waymark config check`: what `Config::load` refuses (with its line), what it warns about, and
/// the files a first connection needs (key files, known_hosts under `strict`).
pub async fn config_check(cli: &Cli) -> i32 {
    use waymark_gateway::config::{CredentialConfig, HostKeyPolicy};
    let d = defaults();
    let path = config_path(cli, &d);
    let config = match Config::load(&path, &d) {
        Ok(c) => c,
        Err(e) => {
            if cli.json {
                outln!(
                    "{}",
                    serde_json::json!({"ok": false, "errors": [e.to_string()], "warnings": []})
                );
                return exit::USAGE;
            }
            fail(e, exit::USAGE)
        }
    };
    let mut errors = Vec::new();
    let mut warnings: Vec<String> = config.warnings.iter().map(ToString::to_string).collect();
    for (name, c) in &config.credentials {
        if let CredentialConfig::KeyFile { path: key, .. } = c {
            if let Err(e) = std::fs::metadata(key) {
                let at = format!("credentials.{name}");
                let why = format!("credential {name}: key file {}: {e}", key.display());
                errors.push(config.error_at(&at, why).to_string());
            }
        }
    }
    // The daemon's env_file, read as the daemon reads it, and each variable a credential
    // names: in the file, in this shell, and in the running daemon (when one answers).
    let in_file = match &config.daemon.env_file {
        Some(f) => match crate::envfile::read(f) {
            Ok(vars) => vars.into_iter().map(|(n, _)| n).collect(),
            Err(e) => {
                errors.push(format!("{}: {e}", path.display()));
                Vec::new()
            }
        },
        None => Vec::new(),
    };
    let running = running_daemon_env(&config).await;
    let mut variables = Vec::new();
    for (name, what) in crate::envfile::named_variables(&config) {
        let file = in_file.contains(&name);
        let shell = std::env::var_os(&name).is_some();
        let daemon = running
            .as_ref()
            .map(|env| env.get(&name).cloned().unwrap_or_else(|| "missing".into()));
        variables.push(serde_json::json!({
            "name": name, "what": what, "env_file": file, "shell": shell, "daemon": daemon,
        }));
        let mut said = format!(
            "{name} ({what}): {}",
            match (file, config.daemon.env_file.is_some(), shell) {
                (true, _, _) => "set in the env_file",
                (false, true, true) => "not in the env_file; only this shell has it, and a daemon gets it only from the process that starts it",
                (false, false, true) => "only this shell has it: a daemon gets it only from the process that starts it (set [daemon] env_file)",
                (false, _, false) => "set nowhere: calls that need it will fail",
            }
        );
        if let Some(d) = &daemon {
            said.push_str(&format!("; the running daemon: {d}"));
        }
        if !cli.json {
            if !file && daemon.as_deref() != Some("env_file") {
                warnings.push(said);
            } else {
                eprintln!("waymark: {said}");
            }
        }
    }
    // The shared ledger's key file and connection string, read as the daemon reads them.
    if let LedgerBackend::Postgres(pg) = &config.ledger_backend {
        errors.extend(crate::ledger_backend::missing_key(pg));
        if let Err(e) = crate::ledger_backend::connection_string(pg) {
            errors.push(e);
        }
    }
    // What the daemon reads before it listens, read the same way (one validation path).
    if config.daemon.http_listen.is_some() {
        if let Err(e) = crate::daemon::http_callers(&config) {
            errors.push(format!("{}: {e}", path.display()));
        }
        if let Some(files) = &config.daemon.tls {
            if let Err(e) = waymark_mcp::tls::server_config(&files.cert, &files.key) {
                errors.push(format!("{}: {e}", path.display()));
            }
        }
    }
    for (name, h) in &config.hosts {
        if let Err(e) = std::fs::metadata(&h.known_hosts) {
            let why = format!(
                "host {name}: known_hosts file {}: {e}; `waymark hosts trust {name}` pins the host's key into it",
                h.known_hosts.display()
            );
            let line = config.error_at(&format!("hosts.{name}"), why).to_string();
            match h.host_key_policy {
                HostKeyPolicy::Strict => errors.push(line),
                HostKeyPolicy::AcceptNew => warnings.push(line),
            }
        }
    }
    if cli.json {
        outln!(
            "{}",
            serde_json::json!({"ok": errors.is_empty(), "file": path, "errors": errors, "warnings": warnings,
                "hosts": config.hosts.len(), "tools": config.tools.len(), "variables": variables})
        );
    } else {
        for w in &warnings {
            eprintln!("waymark: warning: {w}");
        }
        for e in &errors {
            eprintln!("waymark: {e}");
        }
        if errors.is_empty() {
            outln!(
                "{}: OK ({} hosts, {} tools, {} warnings)",
                path.display(),
                config.hosts.len(),
                config.tools.len(),
                warnings.len()
            );
        }
    }
    if errors.is_empty() {
        0
    } else {
        exit::USAGE
    }
}

/// Where the daemon running on this configuration's socket has each credential variable from
/// (`None` when no daemon answers, or it does not tell this caller).
async fn running_daemon_env(config: &Config) -> Option<std::collections::BTreeMap<String, String>> {
    let frame = client::request(&config.daemon.socket, Request::DaemonStatus, |_| {})
        .await
        .ok()?;
    match frame.answer::<crate::protocol::DaemonStatus>() {
        Frame::Done { data, .. } => Some(data.env.into_iter().map(|v| (v.name, v.from)).collect()),
        _ => None,
    }
}

/// Opens the existing ledger in this process, for `audit verify --ledger`; `witness` says
/// what a ledger behind its witness does. A ledger a daemon owns is refused, never waited for
/// or shared; a missing one is refused and nothing is made.
pub fn open_ledger(path: &std::path::Path, witness: WitnessCheck) -> Ledger {
    let options = LedgerOptions {
        witness,
        ..LedgerOptions::default()
    };
    Ledger::open_with(path, options).unwrap_or_else(|e| ledger_failed(e))
}

/// The exit code of a ledger that cannot be opened: 2 when there is none (the configuration
/// or the command points elsewhere), 204 when it is there but cannot be used.
pub fn ledger_exit_code(e: &LedgerError) -> i32 {
    match e {
        LedgerError::Missing { .. } => exit::USAGE,
        _ => exit::ERROR,
    }
}

fn ledger_failed(e: LedgerError) -> ! {
    let code = ledger_exit_code(&e);
    match e {
        LedgerError::Locked { .. } => fail(
            format!("{e}: a running daemon owns it. Ask the daemon instead (`waymark audit verify` without --ledger, `waymark audit head`), or stop it first"),
            code,
        ),
        e => fail(e, code),
    }
}

/// The sled ledger directory a local ledger command works on: `--ledger PATH`, or the
/// configured one. A configured PostgreSQL ledger is refused with `on_postgres`, what to do there.
fn sled_ledger(
    cli: &Cli,
    ledger: Option<&std::path::Path>,
    on_postgres: &str,
) -> std::path::PathBuf {
    if let Some(p) = ledger {
        return p.to_path_buf();
    }
    let config = load_config(cli);
    if let LedgerBackend::Postgres(pg) = &config.ledger_backend {
        fail(
            format!(
                "the shared ledger (configured at {}) lives in PostgreSQL: {on_postgres}; or \
                 give --ledger PATH for a sled ledger",
                pg.origin
            ),
            exit::USAGE,
        );
    }
    config.ledger_path
}

/// `waymark ledger restore BACKUP [--ledger PATH]`: puts a backup back into a ledger no daemon
/// owns, and says how far behind the ledger's witness it is.
pub fn ledger_restore(
    cli: &Cli,
    backup: &std::path::Path,
    ledger: Option<&std::path::Path>,
) -> i32 {
    let live = sled_ledger(
        cli,
        ledger,
        "restore it with the server's tools (pg_restore) and keep its key file",
    );
    let report = Ledger::restore(backup, &live).unwrap_or_else(|e| {
        let code = ledger_exit_code(&e);
        match e {
            LedgerError::Locked { .. } => fail(
                format!("{e}: stop the daemon before restoring; nothing was changed"),
                code,
            ),
            e => fail(format!("nothing was restored: {e}"), code),
        }
    });
    let missing = report
        .witness_ahead
        .as_ref()
        .map(|w| (report.head.seq + 1, w.seq));
    if cli.json {
        outln!(
            "{}",
            serde_json::json!({
                "backup": backup.display().to_string(),
                "ledger": live.display().to_string(),
                "head": report.head,
                "witness": report.witness_ahead,
                "missing_events": missing.map(|(from, to)| serde_json::json!({"from": from, "to": to})),
                "replaced": report.replaced.as_ref().map(|p| p.display().to_string()),
            })
        );
        return 0;
    }
    outln!(
        "Restored {} into {}: its audit chain verifies whole up to event {}.",
        backup.display(),
        live.display(),
        report.head.seq
    );
    if let Some(aside) = &report.replaced {
        outln!("The replaced database is kept at {}.", aside.display());
    }
    match missing {
        Some((from, to)) => outln!(
            "This ledger had reached event {to}: events {from}-{to} are missing, and the \
             executions they recorded are unknown to it. The daemon refuses it until you accept \
             that: `waymark daemon --accept-rollback` (recorded in the audit chain)."
        ),
        None => outln!("Nothing is missing: the ledger's witness is not ahead of the backup."),
    }
    0
}

/// `waymark ledger compact [--ledger PATH]`: gives the space of what retention removed back to
/// the disk, on a ledger no daemon owns.
pub fn ledger_compact(cli: &Cli, ledger: Option<&std::path::Path>) -> i32 {
    let live = sled_ledger(
        cli,
        ledger,
        "the server gives removed rows' space back itself (autovacuum; `VACUUM FULL` to shrink \
         its files)",
    );
    let report = Ledger::compact(&live).unwrap_or_else(|e| {
        let code = ledger_exit_code(&e);
        match e {
            LedgerError::Locked { path } => fail(
                format!(
                    "the ledger {} is open in a running daemon: stop the daemon before \
                     compacting (`waymark daemon stop`); nothing was changed",
                    path.display()
                ),
                code,
            ),
            e => fail(format!("nothing was compacted: {e}"), code),
        }
    });
    if cli.json {
        outln!(
            "{}",
            serde_json::json!({
                "ledger": live.display().to_string(),
                "head": report.head,
                "before_bytes": report.before_bytes,
                "after_bytes": report.after_bytes,
            })
        );
        return 0;
    }
    let mib = |b: u64| b as f64 / 1_048_576.0;
    outln!(
        "Compacted {}: {:.1} MiB before, {:.1} MiB after. Its audit chain verifies whole up to \
         event {}, as before.",
        live.display(),
        mib(report.before_bytes),
        mib(report.after_bytes),
        report.head.seq
    );
    0
}

const SKELETON: &str = include_str!("../../../../examples/waymark.toml");

pub async fn init(cli: &Cli, dry_run: bool) -> i32 {
    let d = defaults();
    let path = config_path(cli, &d);
    // What init did, said as text lines, or as one JSON object under --json.
    let mut said: Vec<String> = Vec::new();
    let mut json = serde_json::Map::new();
    let action = if path.exists() {
        said.push(format!("configuration: {} (exists, kept)", path.display()));
        "kept"
    } else if dry_run {
        said.push(format!("configuration: would write {}", path.display()));
        "would_write"
    } else {
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).unwrap_or_else(|e| {
                fail(format!("cannot create {}: {e}", dir.display()), exit::ERROR)
            });
        }
        std::fs::write(&path, SKELETON)
            .unwrap_or_else(|e| fail(format!("cannot write {}: {e}", path.display()), exit::ERROR));
        said.push(format!(
            "configuration: wrote {} (an example: edit hosts, credentials and tools)",
            path.display()
        ));
        "written"
    };
    json.insert(
        "configuration".into(),
        serde_json::json!({"path": path, "action": action}),
    );
    if !dry_run {
        let config = Config::load(&path, &d).unwrap_or_else(|e| fail(e, exit::USAGE));
        let ledger = &config.ledger_path;
        // A running daemon owns the ledger: ask it, never open the ledger behind its back.
        let (head, owned) =
            match client::request(&config.daemon.socket, Request::AuditHead, |_| {}).await {
                Ok(Frame::Done { text, .. }) => {
                    said.push(format!(
                        "ledger: {} (owned by the running daemon; audit head {text})",
                        ledger.display(),
                    ));
                    (text, true)
                }
                _ if matches!(config.ledger_backend, LedgerBackend::Postgres(_)) => {
                    let LedgerBackend::Postgres(pg) = &config.ledger_backend else {
                        unreachable!()
                    };
                    let line = crate::ledger_backend::init_shared(pg)
                        .await
                        .unwrap_or_else(|e| fail(e.message, e.code));
                    said.push(line);
                    (String::new(), false)
                }
                _ => {
                    let made = Ledger::init(ledger).unwrap_or_else(|e| ledger_failed(e));
                    let head = made.head().to_string();
                    said.push(format!(
                        "ledger: {} (key in ledger.key, 0600; audit head {head})",
                        ledger.display(),
                    ));
                    (head, false)
                }
            };
        json.insert(
            "ledger".into(),
            serde_json::json!({"path": ledger, "audit_head": head, "owned_by_daemon": owned}),
        );
        if let Some(dir) = config.daemon.socket.parent() {
            use std::os::unix::fs::DirBuilderExt;
            let _ = std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(dir);
            said.push(format!("runtime directory: {}", dir.display()));
            json.insert("runtime_dir".into(), serde_json::json!(dir));
        }
    }
    if cli.json {
        outln!("{}", Value::Object(json));
    } else {
        for line in said {
            outln!("{line}");
        }
    }
    0
}

pub async fn hosts(cli: &Cli, cmd: &HostsCommand) -> i32 {
    let config = Arc::new(load_config(cli));
    let ssh = SshHosts::new(config.clone());
    let entry = |name: &str| {
        config.hosts.get(name).cloned().unwrap_or_else(|| {
            fail(
                format!(
                    "unknown host {name:?}; configured: {}",
                    config.hosts.keys().cloned().collect::<Vec<_>>().join(", ")
                ),
                exit::USAGE,
            )
        })
    };
    let target = |h: &HostEntry| format!("{}@{}:{}", h.user, h.address, h.port);
    match cmd {
        HostsCommand::List => {
            if cli.json {
                let rows: Vec<Value> = config
                    .hosts
                    .values()
                    .map(|h| {
                        serde_json::json!({
                            "name": h.name, "target": target(h),
                            "credential": h.credential, "host_key_policy": h.host_key_policy.to_string(),
                            "known_hosts": h.known_hosts, "remote_dir": h.remote_dir, "max_sessions": h.max_sessions,
                            "serve": h.serve,
                        })
                    })
                    .collect();
                outln!("{}", serde_json::to_string_pretty(&rows).expect("json"));
            } else {
                for h in config.hosts.values() {
                    outln!(
                        "{:<12} {:<32} credential={} policy={} known_hosts={}",
                        h.name,
                        target(h),
                        h.credential,
                        h.host_key_policy,
                        h.known_hosts.display()
                    );
                }
            }
            0
        }
        HostsCommand::Check { name } => {
            let h = entry(name);
            let exec = ssh.executor(&h).unwrap_or_else(|e| fail(e, exit::USAGE));
            match exec.connect().await {
                Ok(()) if cli.json => {
                    let ok = serde_json::json!({"host": name, "target": target(&h), "ok": true});
                    outln!("{ok}");
                    0
                }
                Ok(()) => {
                    outln!("host {name}: connected to {}, host key pinned, authenticated, wrapper installed", target(&h));
                    0
                }
                // Nothing reached the host: the same cause and code as a call that did not start.
                Err(e @ waymark_ssh::Error::NotSent(_)) => fail(e, exit::NOT_STARTED),
                Err(e) => fail(e, exit::ERROR),
            }
        }
        HostsCommand::Adopt { .. } => unreachable!("`hosts adopt` is a request to the daemon"),
        HostsCommand::Trust { name, yes } => {
            let h = entry(name);
            let exec = ssh.executor(&h).unwrap_or_else(|e| fail(e, exit::USAGE));
            let rejection = match exec.connect().await {
                Ok(()) => {
                    if cli.json {
                        outln!(
                            "{}",
                            serde_json::json!({"host": name, "pinned": true, "newly_pinned": false, "known_hosts": h.known_hosts})
                        );
                    } else {
                        outln!(
                            "host {name}: its key is already pinned in {}",
                            h.known_hosts.display()
                        );
                    }
                    return 0;
                }
                Err(waymark_ssh::Error::NotSent(waymark_ssh::ConnectError::HostKey(r))) => r,
                Err(e) => {
                    let code = match e {
                        waymark_ssh::Error::NotSent(_) => exit::NOT_STARTED,
                        _ => exit::ERROR,
                    };
                    fail(
                        format!("cannot reach host {name} to read its key: {e}"),
                        code,
                    )
                }
            };
            let line = match &rejection.problem {
                waymark_ssh::HostKeyProblem::Unknown { line_to_add, .. } => line_to_add.clone(),
                // Nothing reached the host: the code `hosts check` and a call give this key.
                _ => fail(format!("{rejection}\nRefusing to pin over an existing entry: remove it by hand only if the host was really re-keyed."), exit::NOT_STARTED),
            };
            let presents = format!(
                "host {name} ({}) presents {} key {}",
                rejection.target, rejection.algorithm, rejection.fingerprint
            );
            let answer = |pinned: bool| {
                serde_json::json!({
                    "host": name, "target": rejection.target.to_string(),
                    "algorithm": rejection.algorithm.to_string(),
                    "fingerprint": rejection.fingerprint.to_string(),
                    "pinned": pinned, "newly_pinned": pinned, "known_hosts": h.known_hosts,
                })
            };
            if !yes {
                // The question goes to the terminal's stderr under --json, whose stdout is
                // the one JSON answer.
                let ask = format!(
                    "{presents}\nPin it into {}? Compare the fingerprint out of band first. [y/N] ",
                    h.known_hosts.display()
                );
                if cli.json {
                    eprint!("{ask}");
                } else {
                    out!("{ask}");
                }
                let _ = std::io::stdout().flush();
                let mut reply = String::new();
                let _ = std::io::stdin().read_line(&mut reply);
                if !matches!(reply.trim(), "y" | "Y" | "yes") {
                    if cli.json {
                        outln!("{}", answer(false));
                    } else {
                        outln!("Not pinned.");
                    }
                    return exit::DECLINED;
                }
            } else if !cli.json {
                outln!("{presents}");
            }
            if let Err(e) = append_known_host(&h.known_hosts, &line) {
                fail(
                    format!("cannot write {}: {e}", h.known_hosts.display()),
                    exit::ERROR,
                );
            }
            exec.disconnect();
            match exec.connect().await {
                Ok(()) if cli.json => {
                    outln!("{}", answer(true));
                    0
                }
                Ok(()) => {
                    outln!(
                        "Pinned in {} and verified: connected and authenticated.",
                        h.known_hosts.display()
                    );
                    0
                }
                Err(e) => fail(
                    format!("pinned, but the check afterwards failed: {e}"),
                    exit::ERROR,
                ),
            }
        }
    }
}

/// Appends `line` to the known_hosts file `path`, making the file 0600 and any directory it
/// needs 0700 (OpenSSH refuses a `~/.ssh` that others can write, and it holds keys).
fn append_known_host(path: &std::path::Path, line: &str) -> std::io::Result<()> {
    use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
    if let Some(dir) = path.parent() {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)?;
    }
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .mode(0o600)
        .open(path)?;
    let existing = std::fs::read_to_string(path).unwrap_or_default();
    let sep = if existing.is_empty() || existing.ends_with('\n') {
        ""
    } else {
        "\n"
    };
    f.write_all(format!("{sep}{line}\n").as_bytes())?;
    f.sync_all()
}
