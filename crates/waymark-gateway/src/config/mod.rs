//! `waymark.toml`: parsing, validation with file:line:column errors, and default paths.
//!
//! Every reference is checked (tool → host → credential), unknown keys are rejected, and no
//! secret value has a place in the file: credentials name a key file and, optionally, the
//! environment variable that holds its passphrase.
//!
//! By concern: this file holds the configuration as the rest of the gateway sees it; `raw`
//! is the file's schema as serde reads it, `parse` turns it into a [`Config`] (checking every
//! reference, locating every error), `template` reads durations and argv templates.

use std::collections::BTreeMap;
use std::fmt;
use std::path::PathBuf;
use std::time::Duration;

use serde::Deserialize;
use waymark_core::ReplayContract;

mod actors;
mod fields;
mod http;
mod parse;
mod raw;
mod template;

pub use actors::{
    lookup_group, lookup_user, token_sha256, ActorDef, Pattern, Refusal, TokenSource, UnixId,
};
pub use template::{parse_duration, parse_template};

/// A configuration error, located in its file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    pub file: PathBuf,
    /// 1-based; 0 when the error has no location (a missing file).
    pub line: usize,
    pub column: usize,
    pub message: String,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.line == 0 {
            write!(f, "{}: {}", self.file.display(), self.message)
        } else {
            write!(
                f,
                "{}:{}:{}: {}",
                self.file.display(),
                self.line,
                self.column,
                self.message
            )
        }
    }
}

impl std::error::Error for ConfigError {}

/// Who must approve a tool's calls.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize, Default, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Approval {
    /// Runs without asking.
    #[default]
    None,
    /// An operator approves once per agent run.
    Session,
    /// An operator approves every call.
    PerCall,
}

/// How unknown host keys are treated.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "kebab-case")]
pub enum HostKeyPolicy {
    /// Refuse any key known_hosts does not pin.
    #[default]
    Strict,
    /// Pin a new host's key after authentication succeeds; refuse a changed key.
    AcceptNew,
}

impl fmt::Display for HostKeyPolicy {
    /// As written in the configuration (`strict`, `accept-new`).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            HostKeyPolicy::Strict => "strict",
            HostKeyPolicy::AcceptNew => "accept-new",
        })
    }
}

/// A tool argument's type.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ArgType {
    String,
    Integer,
    Boolean,
    Enum,
}

/// A credential: where the private key comes from. Never the key itself.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CredentialConfig {
    KeyFile {
        path: PathBuf,
        passphrase_env: Option<String>,
    },
    Agent,
    /// An HTTP API's credential: a value sent in a header, read when a request is sent (from
    /// an environment variable or a 0600 file), never held in the configuration.
    Http {
        /// Lower case: `authorization` for a bearer token.
        header: String,
        /// Sent as `Bearer <value>`.
        bearer: bool,
        source: SecretSource,
    },
}

/// Where an HTTP credential's value is read from, each time it is sent.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SecretSource {
    Env(String),
    /// Refused unless only its owner can read it (mode 0600 or stricter).
    File(PathBuf),
}

/// A configured host.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HostEntry {
    pub name: String,
    pub address: String,
    pub port: u16,
    pub user: String,
    pub credential: String,
    pub known_hosts: PathBuf,
    pub host_key_policy: HostKeyPolicy,
    pub remote_dir: String,
    pub max_sessions: usize,
    /// Run and status over long-lived serve channels (default); false: an exec channel each.
    pub serve: bool,
}

/// One argument of a tool.
#[derive(Clone, Debug)]
pub struct ArgSpec {
    pub name: String,
    pub ty: ArgType,
    pub description: Option<String>,
    pub values: Vec<String>,
    /// Anchored: the whole value must match.
    pub pattern: Option<regex::Regex>,
    pub secret: bool,
    pub required: bool,
}

/// The reserved template placeholder for the execution's own ID; no argument takes its name.
pub const EXECUTION_ID_PLACEHOLDER: &str = "execution_id";

/// The variable the wrapper gives every command; a tool's `env` cannot set it.
pub const EXECUTION_ID_ENV: &str = "WAYMARK_EXECUTION_ID";

/// One piece of an argv template word.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TemplatePart {
    Text(String),
    Arg(String),
    /// `{execution_id}`: filled in when the command is sent, outside the fingerprint.
    ExecutionId,
}

/// A configured tool.
#[derive(Clone, Debug)]
pub struct ToolDef {
    pub name: String,
    pub description: String,
    /// Fixed hosts; when `host_arg` is set, the caller picks one of them (or any host when
    /// the list is empty).
    pub hosts: Vec<String>,
    pub host_arg: bool,
    pub argv: Vec<Vec<TemplatePart>>,
    pub args: Vec<ArgSpec>,
    pub contract: ReplayContract,
    pub retry_window: Duration,
    pub dedup_window: Option<Duration>,
    pub approval: Approval,
    pub timeout: Duration,
    pub cwd: Option<String>,
    /// Value templates, like argv words: literal text, `{arg}` and `{execution_id}`. A secret
    /// argument in an env value reaches the host on the channel's stdin, never on a command
    /// line.
    pub env: BTreeMap<String, Vec<TemplatePart>>,
    /// Set for a `channel = "http"` tool, whose `hosts`, `argv`, `cwd` and `env` are empty.
    pub http: Option<HttpToolDef>,
}

/// What an HTTP tool sends.
#[derive(Clone, Debug, PartialEq)]
pub struct HttpToolDef {
    pub method: waymark_core::HttpMethod,
    /// An argument's value is percent-encoded into it; no secret, no `{execution_id}`.
    pub url: Vec<TemplatePart>,
    /// Names in lower case; values are templates (a secret argument is allowed).
    pub headers: BTreeMap<String, Vec<TemplatePart>>,
    pub body: Option<BodyTemplate>,
    /// A `[credentials.X]` of an HTTP kind.
    pub credential: Option<String>,
    /// The header that carries the execution ID; `None` for an API without one.
    pub idempotency_header: Option<String>,
    /// How to ask the API about an execution (`status_check` recovery).
    pub status: Option<StatusRequestDef>,
    /// `host:port` of the URL: the execution record's `host`.
    pub target: String,
}

/// A JSON body template: every string is a template; a string that is exactly one integer or
/// boolean argument becomes that JSON number or boolean.
#[derive(Clone, Debug, PartialEq)]
pub enum BodyTemplate {
    Json(serde_json::Value),
    Text(Vec<TemplatePart>),
    Array(Vec<BodyTemplate>),
    Object(BTreeMap<String, BodyTemplate>),
}

/// The request that asks the API how an execution ended; its URL holds `{execution_id}` and
/// no argument. Its answer decides: 2xx the operation exists and finished (the body is the
/// result), 202 still in flight, 404 or 410 never received, anything else proves nothing.
/// Whether a finished operation *succeeded* is read by `outcome`; without it, not proven.
#[derive(Clone, Debug, PartialEq)]
pub struct StatusRequestDef {
    pub method: waymark_core::HttpMethod,
    pub url: Vec<TemplatePart>,
    pub outcome: Option<StatusOutcome>,
}

/// How a status answer tells whether the operation succeeded.
#[derive(Clone, Debug, PartialEq)]
pub enum StatusOutcome {
    /// The request's own status code, at this JSON pointer of the answer's body (`/status`):
    /// below 400 succeeded, else failed.
    CodeAt(String),
    /// The request's own status code, in this header of the answer (lower case).
    CodeHeader(String),
    /// A value at this JSON pointer, one of the listed values for each reading; any other
    /// value proves nothing.
    ValueAt {
        pointer: String,
        succeeded: Vec<String>,
        failed: Vec<String>,
        pending: Vec<String>,
    },
}

/// Daemon settings.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DaemonConfig {
    pub socket: PathBuf,
    /// Where MCP over Streamable HTTP listens. Plain HTTP only on a loopback address; any
    /// other address comes with `tls` (checked at load).
    pub http_listen: Option<std::net::SocketAddr>,
    pub http_token_file: Option<PathBuf>,
    /// The certificate chain and key MCP over HTTP is served with (HTTPS); `None`: plain HTTP,
    /// which the load allows on loopback only.
    pub tls: Option<TlsFiles>,
    /// Where the Prometheus metrics endpoint listens (`GET /metrics`); a loopback address,
    /// checked at load. `None`: no endpoint.
    pub metrics_listen: Option<std::net::SocketAddr>,
    /// The group whose members may connect to the socket: the socket is made 0660 and its
    /// directory 0750, both of this group. `None`: the daemon's user alone (0600, 0700).
    pub socket_group: Option<UnixId>,
    /// `[daemon] env_file`: the variables the credentials name, applied to the daemon's
    /// environment at start (systemd EnvironmentFile format, 0600).
    pub env_file: Option<PathBuf>,
}

/// `[daemon] tls_cert` and `tls_key`: PEM files, read when the daemon starts (the key must be
/// readable by its owner only).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TlsFiles {
    /// The certificate chain, leaf first.
    pub cert: PathBuf,
    /// The private key of the leaf certificate.
    pub key: PathBuf,
}

/// Policy settings.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PolicyConfig {
    pub default_approval: Approval,
    /// Hosts on which the raw command tool exists.
    pub raw_commands: Vec<String>,
}

/// A validated configuration.
#[derive(Clone, Debug)]
pub struct Config {
    /// What is allowed but unsafe (a secret argument in argv), with its line: printed by
    /// `config check` and by the daemon as it starts, not by every command.
    pub warnings: Vec<ConfigError>,
    /// Where each credential and host table is (`credentials.deploy`, `hosts.web1`): line and
    /// column, for what is found wrong after loading (see [`Config::error_at`]).
    pub positions: BTreeMap<String, (usize, usize)>,
    pub file: PathBuf,
    pub ledger_path: PathBuf,
    /// Which ledger the daemon keeps: sled in `ledger_path` (the default) or PostgreSQL.
    pub ledger_backend: LedgerBackend,
    pub daemon: DaemonConfig,
    pub policy: PolicyConfig,
    pub credentials: BTreeMap<String, CredentialConfig>,
    pub hosts: BTreeMap<String, HostEntry>,
    pub tools: BTreeMap<String, ToolDef>,
    /// `[actors]`: who may connect and what each may do. Empty: single-user mode, where the
    /// actor is the peer's uid (or the HTTP token's name) and every caller may do everything.
    pub actors: BTreeMap<String, ActorDef>,
}

impl Config {
    /// An error about the table `key` (`credentials.deploy`, `hosts.web1`), at its line and
    /// column: a key file that does not exist, found by `config check` after loading.
    pub fn error_at(&self, key: &str, message: impl Into<String>) -> ConfigError {
        let (line, column) = self.positions.get(key).copied().unwrap_or((0, 0));
        ConfigError {
            file: self.file.clone(),
            line,
            column,
            message: message.into(),
        }
    }
}

/// The ledger's backend, from `[ledger] backend`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LedgerBackend {
    /// sled in `ledger_path`: one daemon.
    Sled,
    /// One PostgreSQL database shared by several daemons.
    Postgres(PostgresLedger),
}

/// Where a daemon finds the shared ledger. The connection string never is in `waymark.toml`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PostgresLedger {
    pub url: UrlSource,
    /// The master key every daemon sharing the database holds (hex, 0600; made on first use).
    pub key_file: PathBuf,
    /// This daemon's name among those sharing the database (unique per daemon).
    pub daemon_name: Option<String>,
    /// `file:line` of the `[ledger]` setting, for errors found when the daemon starts.
    pub origin: String,
}

/// Where the connection string comes from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum UrlSource {
    /// An environment variable of the daemon.
    Env(String),
    /// A file readable by its owner only (0600).
    File(PathBuf),
}

/// Where things live by default, following the XDG base directories.
#[derive(Clone, Debug)]
pub struct DefaultPaths {
    pub config_file: PathBuf,
    pub ledger: PathBuf,
    pub socket: PathBuf,
    pub home: PathBuf,
}

impl DefaultPaths {
    /// Computes defaults from an environment lookup (`std::env::var` in production).
    pub fn from_env(get: impl Fn(&str) -> Option<String>, uid: u32) -> Self {
        let home = PathBuf::from(get("HOME").unwrap_or_else(|| "/".into()));
        let xdg = |var: &str, fallback: &str| {
            get(var)
                .filter(|v| v.starts_with('/'))
                .map(PathBuf::from)
                .unwrap_or_else(|| home.join(fallback))
        };
        let runtime = get("XDG_RUNTIME_DIR")
            .filter(|v| v.starts_with('/'))
            .map(|d| PathBuf::from(d).join("waymark"))
            .unwrap_or_else(|| PathBuf::from(format!("/tmp/waymark-{uid}")));
        DefaultPaths {
            config_file: xdg("XDG_CONFIG_HOME", ".config")
                .join("waymark")
                .join("waymark.toml"),
            ledger: xdg("XDG_STATE_HOME", ".local/state")
                .join("waymark")
                .join("ledger"),
            socket: runtime.join("daemon.sock"),
            home,
        }
    }
}
