//! One authenticated russh connection to a host: handshake, host key check, authentication.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use russh::client;
use russh::keys::agent::client::AgentClient;
use russh::keys::agent::AgentIdentity;
use russh::keys::{HashAlg, PrivateKey, PrivateKeyWithHashAlg, PublicKey, PublicKeyOrCertificate};

use crate::config::{Credential, HostConfig, HostKeyPolicy};
use crate::error::{ConnectError, HostKeyProblem, HostKeyRejection};
use crate::known_hosts::{self, Verdict};

/// A live SSH connection and what the pool tracks about it.
pub(crate) struct Connection {
    pub(crate) handle: client::Handle<ClientHandler>,
    /// Distinguishes connections in logs.
    pub(crate) serial: u64,
    /// Why the connection ended, once it has (recorded by the handler).
    ended: Arc<Mutex<Option<String>>>,
    /// Channels currently reserved or open on this connection.
    pub(crate) open_channels: AtomicUsize,
    /// Channels the server has confirmed and we have not closed yet.
    pub(crate) confirmed_channels: AtomicUsize,
    /// Most channels this connection may hold: `max_sessions`, lowered when the server
    /// refuses a channel below it.
    pub(crate) channel_limit: AtomicUsize,
    /// Set once the wrapper has been verified (or installed) over this connection.
    pub(crate) wrapper_ready: tokio::sync::OnceCell<()>,
    /// A second handle on the TCP socket russh owns: shutting it down ends the session from
    /// outside, whatever russh is waiting for (see [`Connection::abandon`]). Dropped once the
    /// session has ended, so a dead connection does not hold its socket open.
    socket: Mutex<Option<std::net::TcpStream>>,
    /// Set by [`Connection::abandon`]: never hand this connection out again.
    abandoned: AtomicBool,
}

impl Connection {
    pub(crate) fn is_closed(&self) -> bool {
        self.abandoned.load(Ordering::Acquire) || self.handle.is_closed()
    }

    /// Ends the connection now, for `reason`. russh's session then ends as on a dropped link:
    /// every channel on it sees the end, so a reply still awaited becomes `Lost` (its outcome
    /// unknown); nothing is re-sent. Works even when russh itself is stuck (a channel it cannot
    /// flush, a socket write the host no longer drains), which a message to its session task
    /// would not.
    pub(crate) fn abandon(&self, reason: String) {
        if let Ok(mut ended) = self.ended.lock() {
            ended.get_or_insert(reason);
        }
        self.abandoned.store(true, Ordering::Release);
        if let Some(socket) = self.socket.lock().ok().and_then(|mut s| s.take()) {
            let _ = socket.shutdown(std::net::Shutdown::Both);
        }
    }

    /// What is known about why the connection ended (or is ending).
    pub(crate) fn end_reason(&self) -> String {
        self.ended
            .lock()
            .ok()
            .and_then(|r| r.clone())
            .unwrap_or_else(|| "connection closed".to_string())
    }

    pub(crate) fn has_room(&self) -> bool {
        self.open_channels.load(Ordering::Acquire) < self.channel_limit.load(Ordering::Acquire)
    }
}

/// The russh handler: pins the host key and records why the connection ended.
pub(crate) struct ClientHandler {
    config: Arc<HostConfig>,
    /// A key seen for the first time under [`HostKeyPolicy::AcceptNew`]; written to
    /// `known_hosts` only after authentication succeeds.
    learned: Arc<Mutex<Option<PublicKey>>>,
    ended: Arc<Mutex<Option<String>>>,
}

/// The handler's error: russh's own, or a host key refusal carried out of the handshake.
#[derive(Debug)]
pub(crate) enum HandlerError {
    Russh(russh::Error),
    Refused(Box<ConnectError>),
}

impl From<russh::Error> for HandlerError {
    fn from(e: russh::Error) -> Self {
        HandlerError::Russh(e)
    }
}

impl client::Handler for ClientHandler {
    type Error = HandlerError;

    async fn check_server_key(
        &mut self,
        presented: &PublicKeyOrCertificate,
    ) -> Result<bool, Self::Error> {
        // A host certificate is trusted only through the plain key it certifies.
        let key = match presented {
            PublicKeyOrCertificate::PublicKey { key, .. } => key.clone(),
            PublicKeyOrCertificate::Certificate(cert) => PublicKey::from(cert.public_key().clone()),
        };
        let c = &self.config;
        let verdict =
            known_hosts::check(&c.known_hosts, &c.address, c.port, &key).map_err(|source| {
                HandlerError::Refused(Box::new(ConnectError::KnownHostsFile {
                    host: c.name.clone(),
                    path: c.known_hosts.clone(),
                    source,
                }))
            })?;
        let problem = match verdict {
            Verdict::Known => return Ok(true),
            Verdict::Unknown { other_algorithms }
                if c.host_key_policy == HostKeyPolicy::AcceptNew && other_algorithms.is_empty() =>
            {
                *self.learned.lock().expect("learned key lock") = Some(key);
                return Ok(true);
            }
            Verdict::Unknown { other_algorithms } => HostKeyProblem::Unknown {
                line_to_add: known_hosts::line_for(&c.address, c.port, &key),
                other_algorithms,
            },
            Verdict::Changed { line } => HostKeyProblem::Changed { line },
            Verdict::Revoked { line } => HostKeyProblem::Revoked { line },
        };
        Err(HandlerError::Refused(Box::new(host_key_refused(
            c, &key, problem,
        ))))
    }

    async fn disconnected(
        &mut self,
        reason: client::DisconnectReason<Self::Error>,
    ) -> Result<(), Self::Error> {
        let (text, result) = match reason {
            client::DisconnectReason::ReceivedDisconnect(info) => (
                format!(
                    "host sent disconnect: {:?} {}",
                    info.reason_code, info.message
                ),
                Ok(()),
            ),
            client::DisconnectReason::Error(e) => {
                (describe_handler_error(&e, &self.config), Err(e))
            }
        };
        if let Ok(mut ended) = self.ended.lock() {
            ended.get_or_insert(text);
        }
        result
    }
}

fn describe_handler_error(e: &HandlerError, config: &HostConfig) -> String {
    match e {
        HandlerError::Russh(russh::Error::KeepaliveTimeout) => format!(
            "no answer to {} keepalives sent {:?} apart",
            config.keepalive_max, config.keepalive_interval
        ),
        HandlerError::Russh(other) => other.to_string(),
        HandlerError::Refused(refusal) => refusal.to_string(),
    }
}

/// The russh client configuration derived from a host's settings.
pub(crate) fn russh_config(config: &HostConfig) -> Arc<client::Config> {
    Arc::new(client::Config {
        keepalive_interval: Some(config.keepalive_interval),
        keepalive_max: config.keepalive_max.max(1),
        // Small requests dominate: Nagle would add up to one RTT per round trip.
        nodelay: true,
        // Bigger window and packets: fewer window adjustments on bulk output.
        window_size: 8 * 1024 * 1024,
        maximum_packet_size: 32768,
        ..Default::default()
    })
}

/// Everything needed to authenticate, loaded once per host.
pub(crate) enum Identity {
    Key(Arc<PrivateKey>),
    Agent,
}

/// Loads the credential. Key decryption is slow (bcrypt KDF), so callers keep the result.
pub(crate) fn load_identity(config: &HostConfig) -> Result<Identity, ConnectError> {
    match &config.credential {
        Credential::Agent => Ok(Identity::Agent),
        Credential::KeyFile {
            path,
            passphrase_env,
        } => {
            let passphrase = match passphrase_env {
                None => None,
                Some(var) => match std::env::var(var) {
                    Ok(value) => Some(value),
                    Err(_) => {
                        return Err(ConnectError::PassphraseMissing {
                            host: config.name.clone(),
                            var: var.clone(),
                            path: path.clone(),
                        })
                    }
                },
            };
            let key_error = |reason: String| ConnectError::KeyFile {
                host: config.name.clone(),
                path: path.clone(),
                reason,
            };
            match russh::keys::load_secret_key(path, passphrase.as_deref()) {
                Ok(key) => Ok(Identity::Key(Arc::new(key))),
                Err(russh::keys::Error::KeyIsEncrypted) => Err(key_error(
                    "the key is encrypted and the credential names no passphrase_env".into(),
                )),
                Err(russh::keys::Error::IO(e)) => Err(key_error(e.to_string())),
                // ssh-key reports a wrong passphrase as a decryption/padding error; say so
                // without echoing anything secret.
                Err(e) if passphrase.is_some() => Err(key_error(format!(
                    "cannot decrypt it (wrong passphrase in {}?): {e}",
                    passphrase_env.as_deref().unwrap_or_default()
                ))),
                Err(e) => Err(key_error(e.to_string())),
            }
        }
    }
}

/// Connects, checks the host key, authenticates, and (policy accept-new) persists a newly
/// seen host key. Bounded by `connect_timeout`.
pub(crate) async fn connect(
    config: &Arc<HostConfig>,
    identity: &Identity,
    serial: u64,
) -> Result<Connection, ConnectError> {
    let attempt = connect_unbounded(config, identity, serial);
    match tokio::time::timeout(config.connect_timeout, attempt).await {
        Ok(result) => result,
        Err(_) => Err(ConnectError::Timeout {
            host: config.name.clone(),
            target: config.target(),
            timeout: config.connect_timeout,
        }),
    }
}

async fn connect_unbounded(
    config: &Arc<HostConfig>,
    identity: &Identity,
    serial: u64,
) -> Result<Connection, ConnectError> {
    let host = || config.name.clone();
    let target = || config.target();
    let socket = tokio::net::TcpStream::connect((config.address.as_str(), config.port))
        .await
        .map_err(|source| ConnectError::Unreachable {
            host: host(),
            target: target(),
            source,
        })?;
    let learned = Arc::new(Mutex::new(None));
    let ended = Arc::new(Mutex::new(None));
    let handler = ClientHandler {
        config: config.clone(),
        learned: learned.clone(),
        ended: ended.clone(),
    };
    let _ = socket.set_nodelay(true);
    let socket_handle = |source| ConnectError::Unreachable {
        host: host(),
        target: target(),
        source,
    };
    let socket = socket.into_std().map_err(socket_handle)?;
    let kill_switch = socket.try_clone().map_err(socket_handle)?;
    let socket = tokio::net::TcpStream::from_std(socket).map_err(socket_handle)?;
    let mut handle = client::connect_stream(russh_config(config), socket, handler)
        .await
        .map_err(|e| match e {
            HandlerError::Refused(refusal) => *refusal,
            HandlerError::Russh(e) => ConnectError::Handshake {
                host: host(),
                target: target(),
                reason: e.to_string(),
            },
        })?;

    authenticate(config, identity, &mut handle).await?;

    let learned = learned.lock().expect("learned key lock").take();
    if let Some(key) = learned {
        persist_learned_key(config, &key)?;
    }

    Ok(Connection {
        handle,
        serial,
        ended,
        open_channels: AtomicUsize::new(0),
        confirmed_channels: AtomicUsize::new(0),
        channel_limit: AtomicUsize::new(config.max_sessions.max(1)),
        wrapper_ready: tokio::sync::OnceCell::new(),
        socket: Mutex::new(Some(kill_switch)),
        abandoned: AtomicBool::new(false),
    })
}

/// Watches that the host still *hears* `connection`, for as long as it lives.
///
/// russh's own keepalive counts any traffic from the host as a sign of life, so it never gives
/// up on a half-dead link: the host's own keepalive probes or a running command's output keep
/// arriving while nothing this side sends gets through (or russh holds everything back behind
/// a channel it cannot flush). Calls on such a connection waited for ever. So every
/// `keepalive_interval` this sends a ping that wants a reply (`keepalive@openssh.com`, which
/// OpenSSH and russh servers answer) through the same queue as every request, and abandons the
/// connection when no reply came within `keepalive_interval × keepalive_max`: a wedge is
/// noticed within [`HostConfig::drop_detection_budget`], as a silent link is.
pub(crate) fn watch(connection: &Arc<Connection>, config: &HostConfig) {
    let interval = config.keepalive_interval;
    if interval.is_zero() {
        return;
    }
    let patience = config.ping_patience();
    let connection: Weak<Connection> = Arc::downgrade(connection);
    tokio::spawn(async move {
        loop {
            tokio::time::sleep(interval).await;
            let Some(connection) = connection.upgrade() else {
                return;
            };
            if connection.is_closed() {
                // russh has let go of the socket; so do we.
                if let Ok(mut socket) = connection.socket.lock() {
                    socket.take();
                }
                return;
            }
            let ping = connection.handle.send_ping();
            if tokio::time::timeout(patience, ping).await.is_err() {
                tracing::debug!(serial = connection.serial, "ping unanswered, abandoning");
                connection.abandon(format!(
                    "the host stopped answering: a ping went unanswered for {patience:?} while \
                     the connection stayed open"
                ));
                return;
            }
        }
    });
}

/// Accept-new: write the key only now that the host let us in. Re-checks first, so two
/// connections learning at once add one line, and a key that changed in between is refused.
fn persist_learned_key(config: &HostConfig, key: &PublicKey) -> Result<(), ConnectError> {
    let file_error = |source| ConnectError::KnownHostsFile {
        host: config.name.clone(),
        path: config.known_hosts.clone(),
        source,
    };
    match known_hosts::check(&config.known_hosts, &config.address, config.port, key)
        .map_err(file_error)?
    {
        Verdict::Known => Ok(()),
        Verdict::Unknown { .. } => {
            let line = known_hosts::line_for(&config.address, config.port, key);
            known_hosts::append_line(&config.known_hosts, &line).map_err(file_error)?;
            tracing::info!(
                host = %config.name,
                fingerprint = %known_hosts::fingerprint(key),
                "accept-new: pinned host key in {}",
                config.known_hosts.display()
            );
            Ok(())
        }
        Verdict::Changed { line } => Err(host_key_refused(
            config,
            key,
            HostKeyProblem::Changed { line },
        )),
        Verdict::Revoked { line } => Err(host_key_refused(
            config,
            key,
            HostKeyProblem::Revoked { line },
        )),
    }
}

fn host_key_refused(config: &HostConfig, key: &PublicKey, problem: HostKeyProblem) -> ConnectError {
    ConnectError::HostKey(Box::new(HostKeyRejection {
        host: config.name.clone(),
        target: config.target(),
        fingerprint: known_hosts::fingerprint(key),
        algorithm: key.algorithm().as_str().to_string(),
        known_hosts: config.known_hosts.clone(),
        problem,
    }))
}

async fn authenticate(
    config: &HostConfig,
    identity: &Identity,
    handle: &mut client::Handle<ClientHandler>,
) -> Result<(), ConnectError> {
    let handshake = |e: russh::Error| ConnectError::Handshake {
        host: config.name.clone(),
        target: config.target(),
        reason: format!("during authentication: {e}"),
    };
    let rejected = |method: String| ConnectError::AuthRejected {
        host: config.name.clone(),
        target: config.target(),
        user: config.user.clone(),
        method,
    };
    // russh answers "failure" when the connection ends while it waits for the verdict: that is
    // a transport problem, never a diagnosis of the key.
    let closed = |handle: &client::Handle<ClientHandler>| {
        handle.is_closed().then(|| ConnectError::Disconnected {
            host: config.name.clone(),
            target: config.target(),
            reason: "the connection closed during authentication, before the server answered \
                     (a network or server problem, not a key problem)"
                .into(),
        })
    };
    match identity {
        Identity::Key(key) => {
            let hash_alg = rsa_hash(handle, key.algorithm().is_rsa()).await;
            let result = handle
                .authenticate_publickey(
                    config.user.clone(),
                    PrivateKeyWithHashAlg::new(key.clone(), hash_alg),
                )
                .await
                .map_err(handshake)?;
            if result.success() {
                Ok(())
            } else if let Some(e) = closed(handle) {
                Err(e)
            } else {
                let path = match &config.credential {
                    Credential::KeyFile { path, .. } => path.display().to_string(),
                    Credential::Agent => String::new(),
                };
                Err(rejected(format!("public key {path}")))
            }
        }
        Identity::Agent => {
            let agent_error = |reason: String| ConnectError::Agent {
                host: config.name.clone(),
                reason,
            };
            if std::env::var_os("SSH_AUTH_SOCK").is_none() {
                return Err(agent_error(
                    "SSH_AUTH_SOCK is not set; start ssh-agent and add the key (ssh-add)".into(),
                ));
            }
            let mut agent = AgentClient::connect_env().await.map_err(|e| {
                agent_error(format!("cannot reach the agent at SSH_AUTH_SOCK: {e}"))
            })?;
            if let Some(binding) = handle.agent_session_binding() {
                // Older agents do not know session-bind; they still sign.
                let _ = agent.bind_session(binding, false).await;
            }
            let identities = agent
                .request_identities()
                .await
                .map_err(|e| agent_error(format!("cannot list identities: {e}")))?;
            let keys: Vec<PublicKey> = identities
                .iter()
                .filter_map(|identity| match identity {
                    AgentIdentity::PublicKey { key, .. } => Some(key.clone()),
                    _ => None,
                })
                .collect();
            if keys.is_empty() {
                return Err(agent_error("the agent holds no keys (ssh-add one)".into()));
            }
            for key in &keys {
                let hash_alg = rsa_hash(handle, key.algorithm().is_rsa()).await;
                match handle
                    .authenticate_publickey_with(
                        config.user.clone(),
                        key.clone(),
                        hash_alg,
                        &mut agent,
                    )
                    .await
                {
                    Ok(result) if result.success() => return Ok(()),
                    Ok(_) => continue,
                    Err(e) => {
                        tracing::debug!(host = %config.name, "agent could not sign: {e}");
                        continue;
                    }
                }
            }
            if let Some(e) = closed(handle) {
                return Err(e);
            }
            Err(rejected(format!("ssh-agent ({} keys offered)", keys.len())))
        }
    }
}

/// The RSA signature hash the server accepts (SHA-2 when it says nothing), `None` for others.
async fn rsa_hash(handle: &client::Handle<ClientHandler>, is_rsa: bool) -> Option<HashAlg> {
    if !is_rsa {
        return None;
    }
    match handle.best_supported_rsa_hash().await {
        Ok(Some(alg)) => alg,
        _ => Some(HashAlg::Sha256),
    }
}

/// How long to wait before connect attempt `attempt` (0-based): nothing, then doubling.
pub(crate) fn backoff(config: &HostConfig, attempt: u32) -> Duration {
    if attempt == 0 {
        Duration::ZERO
    } else {
        let factor = 1u32 << (attempt - 1).min(8);
        (config.reconnect_backoff * factor).min(Duration::from_secs(5))
    }
}
