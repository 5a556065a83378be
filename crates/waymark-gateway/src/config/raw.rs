//! The schema of `waymark.toml` as serde reads it: unknown keys rejected, spans kept for
//! error locations.

use std::collections::BTreeMap;

use serde::Deserialize;
use toml::Spanned;
use waymark_core::ReplayContract;

use super::{Approval, ArgType, HostKeyPolicy};

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(super) struct RawLedger {
    pub(super) path: Option<String>,
    pub(super) backend: Option<Spanned<String>>,
    /// Refused when present: a connection string may carry a password.
    pub(super) url: Option<Spanned<toml::Value>>,
    pub(super) url_env: Option<Spanned<String>>,
    pub(super) url_file: Option<Spanned<String>>,
    pub(super) key_file: Option<Spanned<String>>,
    pub(super) daemon_name: Option<Spanned<String>>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(super) struct RawDaemon {
    pub(super) socket: Option<String>,
    pub(super) http_listen: Option<Spanned<String>>,
    pub(super) http_token_file: Option<Spanned<String>>,
    pub(super) tls_cert: Option<Spanned<String>>,
    pub(super) tls_key: Option<Spanned<String>>,
    pub(super) metrics_listen: Option<Spanned<String>>,
    /// The group whose members may connect to the socket (0660, its directory 0750).
    pub(super) socket_group: Option<Spanned<String>>,
    /// The variables credentials name, systemd EnvironmentFile format, 0600.
    pub(super) env_file: Option<Spanned<String>>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(super) struct RawPolicy {
    #[serde(default)]
    pub(super) default_approval: Approval,
    #[serde(default)]
    pub(super) raw_commands: Vec<Spanned<String>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawCredential {
    pub(super) key_file: Option<String>,
    pub(super) passphrase_env: Option<String>,
    #[serde(default)]
    pub(super) agent: bool,
    /// HTTP credentials: `bearer` or `header`.
    pub(super) kind: Option<Spanned<String>>,
    pub(super) token_env: Option<String>,
    pub(super) token_file: Option<String>,
    /// The header a `kind = "header"` credential is sent in.
    pub(super) header: Option<Spanned<String>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawHost {
    pub(super) address: String,
    #[serde(default = "default_port")]
    pub(super) port: u16,
    pub(super) user: String,
    pub(super) credential: Spanned<String>,
    pub(super) known_hosts: Option<String>,
    #[serde(default)]
    pub(super) host_key_policy: HostKeyPolicy,
    pub(super) remote_dir: Option<String>,
    #[serde(default = "default_max_sessions")]
    pub(super) max_sessions: usize,
    #[serde(default = "yes")]
    pub(super) serve: bool,
}

fn default_port() -> u16 {
    22
}

fn default_max_sessions() -> usize {
    10
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawArg {
    #[serde(rename = "type")]
    pub(super) ty: ArgType,
    pub(super) description: Option<String>,
    pub(super) values: Option<Vec<String>>,
    pub(super) pattern: Option<Spanned<String>>,
    #[serde(default)]
    pub(super) secret: bool,
    #[serde(default = "yes")]
    pub(super) required: bool,
}

fn yes() -> bool {
    true
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawTool {
    pub(super) description: String,
    /// `ssh` (the default) or `http`.
    pub(super) channel: Option<Spanned<String>>,
    #[serde(default)]
    pub(super) hosts: Vec<Spanned<String>>,
    #[serde(default)]
    pub(super) host_arg: bool,
    pub(super) argv: Option<Spanned<Vec<Spanned<String>>>>,
    #[serde(default)]
    pub(super) args: BTreeMap<String, Spanned<RawArg>>,
    pub(super) contract: ReplayContract,
    pub(super) retry_window: Option<Spanned<String>>,
    pub(super) dedup_window: Option<Spanned<String>>,
    pub(super) approval: Option<Approval>,
    pub(super) timeout: Option<Spanned<String>>,
    pub(super) cwd: Option<String>,
    #[serde(default)]
    pub(super) env: BTreeMap<String, Spanned<String>>,
    // The HTTP channel's keys (`channel = "http"`).
    pub(super) method: Option<Spanned<String>>,
    pub(super) url: Option<Spanned<String>>,
    #[serde(default)]
    pub(super) headers: BTreeMap<String, Spanned<String>>,
    pub(super) body: Option<Spanned<toml::Value>>,
    pub(super) credential: Option<Spanned<String>>,
    /// A header name, or `false` for an API that takes no idempotency key.
    pub(super) idempotency_header: Option<Spanned<toml::Value>>,
    pub(super) status: Option<Spanned<RawStatusRequest>>,
}

/// The request that asks an HTTP API how an execution ended (`status_check` recovery).
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawStatusRequest {
    pub(super) method: Option<Spanned<String>>,
    pub(super) url: Spanned<String>,
    /// How the answer tells whether the operation succeeded: one of these three ways.
    pub(super) code_pointer: Option<Spanned<String>>,
    pub(super) code_header: Option<Spanned<String>>,
    pub(super) outcome_pointer: Option<Spanned<String>>,
    #[serde(default)]
    pub(super) succeeded: Vec<String>,
    #[serde(default)]
    pub(super) failed: Vec<String>,
    #[serde(default)]
    pub(super) pending: Vec<String>,
}

/// `[actors.NAME]`.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawActor {
    pub(super) unix_user: Option<Spanned<String>>,
    pub(super) unix_group: Option<Spanned<String>>,
    pub(super) token_sha256: Option<Spanned<String>>,
    pub(super) token_file: Option<Spanned<String>>,
    #[serde(default)]
    pub(super) tools: Vec<Spanned<String>>,
    #[serde(default)]
    pub(super) deny_tools: Vec<Spanned<String>>,
    pub(super) hosts: Option<Vec<Spanned<String>>>,
    pub(super) approval: Option<Approval>,
    #[serde(default)]
    pub(super) operator: bool,
    #[serde(default)]
    pub(super) self_approve: bool,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawConfig {
    #[serde(default)]
    pub(super) ledger: RawLedger,
    #[serde(default)]
    pub(super) daemon: RawDaemon,
    #[serde(default)]
    pub(super) policy: RawPolicy,
    #[serde(default)]
    pub(super) credentials: BTreeMap<String, Spanned<RawCredential>>,
    #[serde(default)]
    pub(super) hosts: BTreeMap<String, Spanned<RawHost>>,
    #[serde(default)]
    pub(super) tools: BTreeMap<String, Spanned<RawTool>>,
    #[serde(default)]
    pub(super) actors: BTreeMap<String, Spanned<RawActor>>,
}
