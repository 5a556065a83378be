//! The daemon as a service: `DaemonStatus`, `DaemonStop`, `DaemonReload` (and SIGHUP).
//!
//! A reload reads the configuration file again; when it is valid, every call from then on
//! resolves against it, and the hosts' pools reconnect with its settings. Executions already
//! accepted keep what their record holds. When it is not valid, nothing changes and the answer
//! (or, for SIGHUP, the log) names the error with its file:line:column. Each reload that took
//! is an audit event with the configuration's hash before and after.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use sha2::{Digest, Sha256};
use waymark_core::Timestamp;
use waymark_gateway::config::Config;
use waymark_gateway::flow::now;
use waymark_gateway::host::HostExecutor;

use super::render::fmt_time;
use super::{Frame, Service};
use crate::exit;
use crate::protocol::{Answer, DaemonStatus, EnvSource, HostPool, Listeners};

/// The daemon's own state, beside the gateway's: when it started, which configuration it runs,
/// where it listens, the requests it is answering, and the switch that stops it.
pub struct Lifecycle {
    started: Timestamp,
    config_file: PathBuf,
    loaded: Mutex<Loaded>,
    listeners: Mutex<Listeners>,
    /// Requests being answered now (`Service::run`).
    pub(super) requests: AtomicU64,
    /// Set once a stop is asked, with how long the requests being answered may take.
    stop: tokio::sync::watch::Sender<Option<std::time::Duration>>,
    /// Live pooled connections of every configured host.
    pools: Box<dyn Fn() -> Vec<(String, usize)> + Send + Sync>,
    /// Hands a reloaded configuration to what keeps its own copy (the hosts' pools).
    on_reload: Box<dyn Fn(Arc<Config>) + Send + Sync>,
    /// The hash of the configuration it runs, for MCP sessions to tell their clients that
    /// the tool list changed.
    changes: tokio::sync::watch::Sender<String>,
}

struct Loaded {
    hash: String,
    at: Timestamp,
    errors: Vec<String>,
    /// The configurations reloads replaced, newest first (at most [`REPLACED_KEPT`]): a retry
    /// of a call accepted under one resolves as it did then.
    replaced: Vec<Arc<Config>>,
}

/// How long a stopping daemon waits for the requests it is answering, unless told.
pub const STOP_GRACE: std::time::Duration = std::time::Duration::from_secs(10);

/// How many replaced configurations a daemon keeps for retries of calls accepted under them.
const REPLACED_KEPT: usize = 8;

/// A configuration file read once: its text's hash and what it parses to.
pub struct ConfigText {
    pub hash: String,
    pub config: Result<Config, waymark_gateway::config::ConfigError>,
}

/// Reads `file` and parses it, with the hash of exactly the text parsed.
pub fn read_config(file: &Path, defaults: &waymark_gateway::config::DefaultPaths) -> ConfigText {
    match std::fs::read_to_string(file) {
        Ok(text) => ConfigText {
            hash: config_hash(&text),
            config: Config::parse(file, &text, defaults),
        },
        Err(e) => ConfigText {
            hash: String::new(),
            config: Err(waymark_gateway::config::ConfigError {
                file: file.to_path_buf(),
                line: 0,
                column: 0,
                message: format!("cannot read the configuration: {e}"),
            }),
        },
    }
}

/// The SHA-256 (hex) of a configuration's text: what `daemon status` shows and every CLI
/// command compares with the file on disk.
pub fn config_hash(text: &str) -> String {
    hex::encode(Sha256::digest(text.as_bytes()))
}

impl Lifecycle {
    pub fn new(
        config_file: PathBuf,
        hash: String,
        pools: Box<dyn Fn() -> Vec<(String, usize)> + Send + Sync>,
        on_reload: Box<dyn Fn(Arc<Config>) + Send + Sync>,
    ) -> (
        Lifecycle,
        tokio::sync::watch::Receiver<Option<std::time::Duration>>,
    ) {
        let (stop, stopped) = tokio::sync::watch::channel(None);
        let (changes, _) = tokio::sync::watch::channel(hash.clone());
        let started = now();
        let life = Lifecycle {
            started,
            config_file,
            loaded: Mutex::new(Loaded {
                hash,
                at: started,
                errors: Vec::new(),
                replaced: Vec::new(),
            }),
            listeners: Mutex::new(Listeners::default()),
            requests: AtomicU64::new(0),
            stop,
            pools,
            on_reload,
            changes,
        };
        (life, stopped)
    }

    /// Records where the daemon listens, once its listeners are bound.
    pub fn set_listeners(&self, listeners: Listeners) {
        *self.listeners.lock().expect("listeners") = listeners;
    }

    /// The configuration file this daemon runs, and its hash.
    pub fn config(&self) -> (PathBuf, String, Timestamp) {
        let l = self.loaded.lock().expect("loaded");
        (self.config_file.clone(), l.hash.clone(), l.at)
    }

    /// Moves with the configuration's hash at each reload that changed it.
    pub fn config_changes(&self) -> tokio::sync::watch::Receiver<String> {
        self.changes.subscribe()
    }

    /// The configurations reloads replaced, newest first.
    pub fn replaced_configs(&self) -> Vec<Arc<Config>> {
        self.loaded.lock().expect("loaded").replaced.clone()
    }

    /// Requests being answered now.
    pub fn requests(&self) -> u64 {
        self.requests.load(Ordering::SeqCst)
    }

    /// The daemon's description for `daemon.json`, beside the socket: what a CLI reads to warn
    /// that the daemon runs an older configuration than the file.
    pub fn describe_file(&self) -> serde_json::Value {
        let (file, hash, at) = self.config();
        serde_json::json!({
            "pid": std::process::id(),
            "version": env!("CARGO_PKG_VERSION"),
            "started_ms": self.started.as_millis(),
            "config_file": file.display().to_string(),
            "config_hash": hash,
            "config_loaded_ms": at.as_millis(),
        })
    }
}

/// Counts a request as being answered for as long as it lives.
pub(super) struct Answering<'a>(&'a AtomicU64);

impl<'a> Answering<'a> {
    pub(super) fn new(count: &'a AtomicU64) -> Self {
        count.fetch_add(1, Ordering::SeqCst);
        Answering(count)
    }
}

impl Drop for Answering<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

impl<E: HostExecutor> Service<E> {
    /// `DaemonStatus`.
    pub(super) async fn daemon_status(&self) -> Frame {
        let status = self.status_now().await;
        Frame::Done {
            text: status_text(&status),
            data: Answer::Daemon(status),
            exit: 0,
        }
    }

    /// `DaemonStop`: the daemon stops accepting, finishes what it answers, and exits.
    pub(super) async fn daemon_stop(&self, by: &str, grace_ms: Option<u64>) -> Frame {
        let status = self.status_now().await;
        let grace = grace_ms.map_or(STOP_GRACE, std::time::Duration::from_millis);
        tracing::info!(%by, ?grace, "stop asked");
        let _ = self.life.stop.send(Some(grace));
        Frame::Done {
            text: format!(
                "Stopping the daemon (pid {}): it accepts nothing new and finishes the {} other \
                 request(s) it is answering. Commands running on hosts go on; the next start \
                 reconciles them.",
                status.pid,
                status.requests.saturating_sub(1)
            ),
            data: Answer::Daemon(status),
            exit: 0,
        }
    }

    /// `DaemonReload` and SIGHUP: see the module documentation.
    pub async fn daemon_reload(&self, by: &str) -> Frame {
        let read = read_config(&self.life.config_file, &crate::defaults());
        let before = self.life.config().1;
        match read.config {
            Err(e) => {
                let error = e.to_string();
                tracing::error!(%by, %error, "reload refused: the daemon keeps the configuration it runs");
                self.life.loaded.lock().expect("loaded").errors = vec![error.clone()];
                Frame::Error {
                    message: format!(
                        "the configuration was not reloaded; the daemon keeps the one it runs \
                         (sha256 {}): {error}",
                        short(&before)
                    ),
                    exit: exit::USAGE,
                }
            }
            Ok(config) => {
                for w in &config.warnings {
                    tracing::warn!(warning = %w, "configuration");
                }
                let config = Arc::new(config);
                let old = self.gateway.config();
                self.gateway.set_config(config.clone());
                (self.life.on_reload)(config);
                {
                    let mut l = self.life.loaded.lock().expect("loaded");
                    l.hash = read.hash.clone();
                    l.at = now();
                    l.errors.clear();
                    l.replaced.insert(0, old);
                    l.replaced.truncate(REPLACED_KEPT);
                }
                let data = serde_json::json!({
                    "by": by,
                    "file": self.life.config_file.display().to_string(),
                    "before": before,
                    "after": read.hash,
                });
                if let Err(e) = self
                    .gateway
                    .ledger()
                    .record_note(
                        "configuration reloaded",
                        data,
                        now(),
                        waymark_ledger::Durability::Flushed,
                    )
                    .await
                {
                    tracing::warn!(error = %e, "cannot record the reload in the audit chain");
                }
                crate::daemon::write_daemon_file(&self.gateway.config(), &self.life);
                self.life.changes.send_if_modified(|now| {
                    let moved = *now != read.hash;
                    now.clone_from(&read.hash);
                    moved
                });
                tracing::info!(%by, before = %short(&before), after = %short(&read.hash), "configuration reloaded");
                let status = self.status_now().await;
                Frame::Done {
                    text: if before == read.hash {
                        format!(
                            "Reloaded {}: it is the configuration the daemon ran (sha256 {}).",
                            self.life.config_file.display(),
                            short(&read.hash)
                        )
                    } else {
                        format!(
                            "Reloaded {}: new calls use it from now on (sha256 {} → {}); \
                             executions already accepted keep what they were accepted with.",
                            self.life.config_file.display(),
                            short(&before),
                            short(&read.hash)
                        )
                    },
                    data: Answer::Daemon(status),
                    exit: 0,
                }
            }
        }
    }

    async fn status_now(&self) -> DaemonStatus {
        let life = &self.life;
        let (file, hash, loaded) = life.config();
        let on_disk = match std::fs::read_to_string(&file) {
            Ok(text) if config_hash(&text) == hash => "same".to_string(),
            Ok(_) => "changed".to_string(),
            Err(e) => format!("cannot be read: {e}"),
        };
        let unresolved = crate::metrics::count_unresolved(self.gateway.ledger().as_ref(), &[])
            .await
            .map_or(0, |c| c.values().sum::<i64>().max(0) as u64);
        let now = now();
        DaemonStatus {
            pid: std::process::id(),
            version: env!("CARGO_PKG_VERSION").to_string(),
            started: life.started,
            uptime_ms: now.since(life.started).as_millis() as u64,
            config_file: file.display().to_string(),
            config_hash: hash,
            config_loaded: loaded,
            config_on_disk: on_disk,
            ledger: self.gateway.ledger().describe(),
            unresolved,
            requests: life.requests(),
            hosts: (life.pools)()
                .into_iter()
                .map(|(host, connections)| HostPool { host, connections })
                .collect(),
            listeners: life.listeners.lock().expect("listeners").clone(),
            reload_errors: life.loaded.lock().expect("loaded").errors.clone(),
            env: crate::envfile::named_variables(&self.gateway.config())
                .into_iter()
                .map(|(name, what)| EnvSource {
                    from: crate::envfile::source_of(&name).to_string(),
                    name,
                    what,
                })
                .collect(),
        }
    }
}

fn short(hash: &str) -> &str {
    hash.get(..12).unwrap_or(hash)
}

fn status_text(s: &DaemonStatus) -> String {
    let secs = s.uptime_ms / 1000;
    let up = match secs {
        s if s >= 86_400 => format!("{}d{}h", s / 86_400, s % 86_400 / 3600),
        s if s >= 3600 => format!("{}h{}m", s / 3600, s % 3600 / 60),
        s if s >= 60 => format!("{}m{}s", s / 60, s % 60),
        s => format!("{s}s"),
    };
    let disk = match s.config_on_disk.as_str() {
        "same" => "the file on disk is the same".to_string(),
        "changed" => "the file on disk has changed since: `waymark daemon reload`".to_string(),
        other => format!("the file {other}"),
    };
    let mut text = format!(
        "Daemon pid {}, version {}, up {up} (since {}).\nConfiguration: {} (sha256 {}), loaded {}; {disk}.\nLedger: {}.\nUnresolved executions: {}; requests being answered: {}.",
        s.pid,
        s.version,
        fmt_time(s.started),
        s.config_file,
        short(&s.config_hash),
        fmt_time(s.config_loaded),
        s.ledger,
        s.unresolved,
        s.requests,
    );
    if !s.hosts.is_empty() {
        let hosts: Vec<String> = s
            .hosts
            .iter()
            .map(|h| format!("{} {}", h.host, h.connections))
            .collect();
        text.push_str(&format!("\nHost connections: {}.", hosts.join(", ")));
    }
    let mut listening = vec![format!("socket {}", s.listeners.socket)];
    if let Some(a) = &s.listeners.http {
        listening.push(format!("MCP over HTTP {a}"));
    }
    if let Some(a) = &s.listeners.metrics {
        listening.push(format!("metrics {a}"));
    }
    text.push_str(&format!("\nListening: {}.", listening.join(", ")));
    for v in &s.env {
        let from = match v.from.as_str() {
            "env_file" => "from its env_file",
            "environment" => "from the environment it was started in (not its env_file)",
            _ => "MISSING",
        };
        text.push_str(&format!("\n{} ({}): {from}.", v.name, v.what));
    }
    for e in &s.reload_errors {
        text.push_str(&format!("\nThe last reload was refused: {e}"));
    }
    text
}
