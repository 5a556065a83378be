//! Errors, split by the one question that matters after a failure: could the request have
//! reached the host?

use std::path::PathBuf;
use std::time::Duration;

/// Why no usable SSH session to a host could be had. Every variant happens before any
/// command request leaves this process, so nothing can have run because of it.
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    /// TCP connect failed (refused, unreachable, name not resolved).
    #[error("host {host}: cannot connect to {target}: {source}")]
    Unreachable {
        /// Configured host name.
        host: String,
        /// `user@address:port`.
        target: String,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// Connect, handshake and authentication together took longer than `connect_timeout`.
    #[error("host {host}: no SSH session with {target} within {timeout:?} (connect_timeout)")]
    Timeout {
        /// Configured host name.
        host: String,
        /// `user@address:port`.
        target: String,
        /// The configured bound.
        timeout: Duration,
    },
    /// The SSH protocol failed before a session was established.
    #[error("host {host}: SSH handshake with {target} failed: {reason}")]
    Handshake {
        /// Configured host name.
        host: String,
        /// `user@address:port`.
        target: String,
        /// What russh reported.
        reason: String,
    },
    /// The host key was refused: unknown (strict policy), changed, or revoked.
    #[error("{0}")]
    HostKey(Box<HostKeyRejection>),
    /// `known_hosts` could not be read, or (policy accept-new) the new key could not be saved.
    #[error("host {host}: known_hosts file {path}: {source}", path = path.display())]
    KnownHostsFile {
        /// Configured host name.
        host: String,
        /// The file.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// The key file is encrypted and the environment variable meant to hold its passphrase is
    /// not set.
    #[error(
        "host {host}: key {path} needs a passphrase, but environment variable {var} is not set",
        path = path.display()
    )]
    PassphraseMissing {
        /// Configured host name.
        host: String,
        /// Name of the environment variable.
        var: String,
        /// The key file.
        path: PathBuf,
    },
    /// The private key file could not be read or decrypted.
    #[error("host {host}: cannot load private key {path}: {reason}", path = path.display())]
    KeyFile {
        /// Configured host name.
        host: String,
        /// The key file.
        path: PathBuf,
        /// Why (never the passphrase).
        reason: String,
    },
    /// The ssh-agent could not be reached or offered no usable identity.
    #[error("host {host}: ssh-agent: {reason}")]
    Agent {
        /// Configured host name.
        host: String,
        /// Why.
        reason: String,
    },
    /// The server did not accept any offered key for this user.
    #[error(
        "host {host}: {target} rejected {method} authentication for user {user}; \
         check that the public key is in that user's authorized_keys"
    )]
    AuthRejected {
        /// Configured host name.
        host: String,
        /// `user@address:port`.
        target: String,
        /// Remote user.
        user: String,
        /// What was tried, e.g. `key /path/id_ed25519`.
        method: String,
    },
    /// The server refused to open a session channel on every connection tried.
    #[error("host {host}: {target} refused to open a session channel: {reason}")]
    ChannelRefused {
        /// Configured host name.
        host: String,
        /// `user@address:port`.
        target: String,
        /// The server's reason.
        reason: String,
    },
    /// The wrapper could not be installed or verified on the host, so nothing was run.
    #[error("host {host}: cannot install the remote wrapper: {reason}")]
    WrapperInstall {
        /// Configured host name.
        host: String,
        /// Why.
        reason: String,
    },
    /// The host holds markers of another ledger: this daemon's ledger does not know their
    /// executions, and would run them again. Nothing was installed, recorded or run.
    #[error(
        "host {host}: it holds execution markers of another ledger ({theirs}), and this \
         daemon's ledger is {ours}: a ledger that does not know those executions could run them \
         again, so nothing is sent there. If the other ledger is gone for good (and its \
         executions settled), `waymark hosts adopt {host}` makes this ledger the host's owner \
         (recorded in the audit chain); otherwise point this daemon at the ledger the host knows"
    )]
    OtherLedger {
        /// Configured host name.
        host: String,
        /// The ledger identity recorded on the host.
        theirs: String,
        /// This daemon's ledger identity.
        ours: String,
    },
    /// A connect attempt that this call queued behind has just failed; this call did not try
    /// again (the next call will).
    #[error("host {host}: cannot connect to {target}: a concurrent attempt just failed: {reason}")]
    Unavailable {
        /// Configured host name.
        host: String,
        /// `user@address:port`.
        target: String,
        /// That attempt's error.
        reason: String,
    },
    /// The connection closed before the request was sent.
    #[error("host {host}: connection to {target} closed before the request was sent: {reason}")]
    Disconnected {
        /// Configured host name.
        host: String,
        /// `user@address:port`.
        target: String,
        /// What is known about why.
        reason: String,
    },
}

/// A host key that was refused, with what is needed to act on it.
#[derive(Debug)]
pub struct HostKeyRejection {
    /// Configured host name.
    pub host: String,
    /// `user@address:port`.
    pub target: String,
    /// `SHA256:…` fingerprint of the presented key.
    pub fingerprint: String,
    /// Key algorithm, e.g. `ssh-ed25519`.
    pub algorithm: String,
    /// The `known_hosts` file that was consulted.
    pub known_hosts: PathBuf,
    /// What is wrong with the key.
    pub problem: HostKeyProblem,
}

/// Why a host key was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HostKeyProblem {
    /// No entry pins a key of this algorithm for the host (strict policy, or accept-new while
    /// keys of other algorithms are pinned).
    Unknown {
        /// The `known_hosts` line that would pin the presented key.
        line_to_add: String,
        /// Algorithms of keys pinned for this host, if any.
        other_algorithms: Vec<String>,
    },
    /// An entry pins a different key of the same algorithm.
    Changed {
        /// 1-based line number of that entry.
        line: usize,
    },
    /// An `@revoked` entry lists the presented key.
    Revoked {
        /// 1-based line number of that entry.
        line: usize,
    },
}

impl std::fmt::Display for HostKeyRejection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let HostKeyRejection {
            host,
            target,
            fingerprint,
            algorithm,
            known_hosts,
            problem,
        } = self;
        let file = known_hosts.display();
        match problem {
            HostKeyProblem::Unknown {
                line_to_add,
                other_algorithms,
            } => {
                write!(
                    f,
                    "host {host}: unknown host key {fingerprint} ({algorithm}) for {target}; refused"
                )?;
                if !other_algorithms.is_empty() {
                    write!(
                        f,
                        " ({file} pins only {} keys for it)",
                        other_algorithms.join(", ")
                    )?;
                }
                write!(
                    f,
                    ". Check the fingerprint out of band, then run `waymark hosts trust {host}`, \
                     or append this line to {file}:\n{line_to_add}"
                )
            }
            HostKeyProblem::Changed { line } => write!(
                f,
                "host {host}: HOST KEY CHANGED for {target}: it presents {fingerprint} \
                 ({algorithm}), which differs from the key pinned in {file} line {line}. Refused: \
                 this can be a man-in-the-middle attack. Only if the host was really re-keyed, \
                 delete that line and run `waymark hosts trust {host}`"
            ),
            HostKeyProblem::Revoked { line } => write!(
                f,
                "host {host}: host key {fingerprint} ({algorithm}) of {target} is marked @revoked \
                 in {file} line {line}; refused"
            ),
        }
    }
}

/// Why an [`Executor`](crate::Executor) call failed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Failed before any byte of the request left this process: it did not run. Safe to
    /// retry with the same execution ID.
    #[error("{0} (nothing was sent to the host)")]
    NotSent(#[from] ConnectError),
    /// The request may have reached the host and the connection failed before the answer came
    /// back: whether it ran is unknown. Ask [`Executor::status`](crate::Executor::status).
    #[error(
        "host {host}: connection lost after the {verb} request{for_id} was sent ({reason}); {next}",
        for_id = execution_id.as_ref().map(|id| format!(" for {id}")).unwrap_or_default(),
        next = lost_advice(verb, execution_id.as_deref())
    )]
    Lost {
        /// Configured host name.
        host: String,
        /// Wrapper verb that was in flight (`run`, `status`, ...).
        verb: &'static str,
        /// The execution concerned, if the verb names one.
        execution_id: Option<String>,
        /// What happened to the connection.
        reason: String,
    },
    /// The host answered, but not as the wrapper protocol says it should (a wrapper error, an
    /// unparsable reply). The request did reach the host: after a `run`, resolve the outcome
    /// with `status` as for [`Error::Lost`].
    #[error("host {host}: wrapper {verb}: {message}")]
    Wrapper {
        /// Configured host name.
        host: String,
        /// Wrapper verb concerned.
        verb: &'static str,
        /// What went wrong, with the wrapper's stderr when it said something.
        message: String,
    },
    /// The host has no marker for this execution ID (it never started there, or was
    /// collected by `gc`).
    #[error("host {host}: {verb}: no such execution on this host")]
    UnknownExecution {
        /// Configured host name.
        host: String,
        /// Wrapper verb concerned.
        verb: &'static str,
    },
    /// The request itself is unusable (e.g. an invalid execution ID); nothing was sent.
    #[error("host {host}: invalid request: {message}")]
    InvalidRequest {
        /// Configured host name.
        host: String,
        /// What is wrong.
        message: String,
    },
}

impl Error {
    /// True when the request provably did not reach the host.
    pub fn is_not_sent(&self) -> bool {
        matches!(self, Error::NotSent(_) | Error::InvalidRequest { .. })
    }

    /// True when the request may have reached the host and its outcome is unknown.
    pub fn is_lost(&self) -> bool {
        matches!(self, Error::Lost { .. })
    }
}

/// What to do after a `Lost`: only a lost `run` leaves an outcome to find out; the other
/// verbs read or converge, so sending them again is harmless.
fn lost_advice(verb: &str, execution_id: Option<&str>) -> String {
    match (verb, execution_id) {
        ("run", Some(id)) => format!(
            "whether it started is unknown: ask `waymark exec status {id}` (re-sending the same \
             execution ID is safe, the host refuses a second start)"
        ),
        _ => "the request is safe to send again".to_string(),
    }
}
