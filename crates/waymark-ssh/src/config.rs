//! What Waymark needs to know to reach one host.

use std::path::PathBuf;
use std::time::Duration;

/// How to reach and authenticate to one host.
///
/// Build one with [`HostConfig::new`] and adjust the public fields; the defaults are the
/// ones documented on each field.
#[derive(Debug, Clone)]
pub struct HostConfig {
    /// The name the operator gave the host in `waymark.toml`; every error names it.
    pub name: String,
    /// DNS name or IP address to connect to. Also the name looked up in `known_hosts`.
    pub address: String,
    /// TCP port (default 22). A port other than 22 is looked up as `[address]:port`.
    pub port: u16,
    /// Remote user name.
    pub user: String,
    /// Which credential proves who we are.
    pub credential: Credential,
    /// The OpenSSH `known_hosts` file that pins the host key.
    pub known_hosts: PathBuf,
    /// What to do with a host key that is not in `known_hosts` (default [`HostKeyPolicy::Strict`]).
    pub host_key_policy: HostKeyPolicy,
    /// Directory on the host holding the wrapper and the markers (default `~/.waymark`).
    /// A leading `~/` is resolved by the remote shell, relative to the user's home.
    pub remote_dir: String,
    /// Most exec channels open at once on one connection (default 10, OpenSSH's `MaxSessions`).
    /// More concurrent commands open more connections.
    pub max_sessions: usize,
    /// Send a keepalive after this long without hearing from the host (default 5 s).
    pub keepalive_interval: Duration,
    /// Declare the connection dead after this many keepalives went unanswered (default 3; 0 is
    /// taken as 1). See [`HostConfig::drop_detection_budget`].
    pub keepalive_max: usize,
    /// Bound on establishing a connection: TCP connect + SSH handshake + authentication, every
    /// attempt and the pauses between them included (default 10 s). A call that finds no
    /// connection fails with `NotSent` after at most this long.
    pub connect_timeout: Duration,
    /// How many times one call tries to establish a connection, within `connect_timeout`,
    /// before giving up (default 3). Only transport failures are retried; a refused host key
    /// or credential never is.
    pub connect_attempts: u32,
    /// Pause before the second attempt; doubled for each further one (default 200 ms).
    pub reconnect_backoff: Duration,
    /// Carry `run` (without stdin or secrets) and `status` over long-lived serve channels,
    /// one wrapper worker per channel, instead of one exec channel per request (default
    /// true). Other verbs always use exec channels. All of a connection's `max_sessions` but
    /// one may stay open as idle serve channels (an exec that finds no free slot closes one);
    /// with `max_sessions` 1 nothing is served.
    pub serve: bool,
    /// The identity of the ledger this daemon keeps (default none): recorded on the host
    /// beside its markers, and a host holding another ledger's markers is refused
    /// ([`crate::ConnectError::OtherLedger`]).
    pub ledger_identity: Option<String>,
}

/// The credential used to authenticate. Never holds a secret itself.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Credential {
    /// An OpenSSH private key file. If it is encrypted, its passphrase is read from the
    /// environment variable named by `passphrase_env` at connect time.
    KeyFile {
        /// Path to the private key.
        path: PathBuf,
        /// Name of the environment variable holding the passphrase, if the key is encrypted.
        passphrase_env: Option<String>,
    },
    /// The ssh-agent at `SSH_AUTH_SOCK`; every identity it offers is tried in turn.
    Agent,
}

/// What to do with a host key that `known_hosts` does not know.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum HostKeyPolicy {
    /// Refuse it. The error carries the fingerprint and how to pin the key.
    #[default]
    Strict,
    /// Trust it on first use: append it to `known_hosts`, but only once authentication to the
    /// host has succeeded. A *changed* key is refused under either policy.
    AcceptNew,
}

impl HostConfig {
    /// A configuration with every optional field at its default.
    pub fn new(
        name: impl Into<String>,
        address: impl Into<String>,
        user: impl Into<String>,
        credential: Credential,
        known_hosts: impl Into<PathBuf>,
    ) -> Self {
        HostConfig {
            name: name.into(),
            address: address.into(),
            port: 22,
            user: user.into(),
            credential,
            known_hosts: known_hosts.into(),
            host_key_policy: HostKeyPolicy::Strict,
            remote_dir: "~/.waymark".to_string(),
            max_sessions: 10,
            keepalive_interval: Duration::from_secs(5),
            keepalive_max: 3,
            connect_timeout: Duration::from_secs(10),
            connect_attempts: 3,
            reconnect_backoff: Duration::from_millis(200),
            serve: true,
            ledger_identity: None,
        }
    }

    /// The longest a silent dead link goes unnoticed: the first keepalive leaves after one
    /// silent interval, and the last of `keepalive_max` unanswered keepalives is declared
    /// lost one interval after it was sent, so `interval × (keepalive_max + 1)`.
    pub fn drop_detection_budget(&self) -> Duration {
        self.keepalive_interval * (self.keepalive_max.max(1) as u32 + 1)
    }

    /// How long a ping that wants a reply may go unanswered before the connection is taken for
    /// dead: `interval × keepalive_max`.
    pub fn ping_patience(&self) -> Duration {
        self.keepalive_interval * self.keepalive_max.max(1) as u32
    }

    /// `user@address:port`, the target as people write it.
    pub fn target(&self) -> String {
        format!("{}@{}:{}", self.user, self.address, self.port)
    }
}
