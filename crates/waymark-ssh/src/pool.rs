//! Pooled connections to one host (the exec channels they carry are in `channel`).
//!
//! A connection carries at most `max_sessions` channels (OpenSSH's `MaxSessions`); past that,
//! or when the server refuses a channel anyway, another connection is opened. Dead
//! connections (keepalive timeout, EOF, a ping the host did not answer) are dropped from the
//! pool and replaced on demand, with backoff between failed attempts. So is a connection a
//! reply was lost on: whatever went wrong there, the next call gets a fresh one.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use crate::channel::OpenChannel;
use crate::config::HostConfig;
use crate::error::ConnectError;
use crate::session::{self, Connection, Identity};

/// How often one call retries a refused channel open on another connection.
const CHANNEL_OPEN_ATTEMPTS: usize = 8;
/// Pause before a refused channel open is tried once more on the same connection.
const REFUSED_RETRY_PAUSE: std::time::Duration = std::time::Duration::from_millis(20);

/// The connections to one host.
pub(crate) struct Pool {
    pub(crate) config: Arc<HostConfig>,
    identity: tokio::sync::OnceCell<Identity>,
    connections: Mutex<Vec<Arc<Connection>>>,
    /// One handshake at a time: concurrent callers wait for it and share its room. Holds the
    /// last connect failure, which callers that queued behind it get at once.
    connect_lock: tokio::sync::Mutex<Option<String>>,
    /// Number of failed connects so far.
    connect_failures: AtomicU64,
    next_serial: AtomicU64,
}

/// A channel slot reserved on one connection; released on drop.
pub(crate) struct Lease {
    pub(crate) connection: Arc<Connection>,
    /// The server confirmed the channel this slot holds.
    confirmed: bool,
    /// The slot moved to another `Lease` (see [`Lease::hand_over`]): this one releases nothing.
    handed_over: bool,
}

impl Lease {
    fn new(connection: Arc<Connection>) -> Self {
        connection.open_channels.fetch_add(1, Ordering::AcqRel);
        Lease {
            connection,
            confirmed: false,
            handed_over: false,
        }
    }

    /// Moves the slot into the returned lease, which releases it when dropped; this one then
    /// releases nothing.
    pub(crate) fn hand_over(&mut self) -> Lease {
        self.handed_over = true;
        Lease {
            connection: self.connection.clone(),
            confirmed: self.confirmed,
            handed_over: false,
        }
    }

    pub(crate) fn confirm(&mut self) {
        self.connection
            .confirmed_channels
            .fetch_add(1, Ordering::AcqRel);
        self.confirmed = true;
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        if self.handed_over {
            return;
        }
        if self.confirmed {
            self.connection
                .confirmed_channels
                .fetch_sub(1, Ordering::AcqRel);
        }
        self.connection.open_channels.fetch_sub(1, Ordering::AcqRel);
    }
}

impl Pool {
    pub(crate) fn new(config: HostConfig) -> Self {
        Pool {
            config: Arc::new(config),
            identity: tokio::sync::OnceCell::new(),
            connections: Mutex::new(Vec::new()),
            connect_lock: tokio::sync::Mutex::new(None),
            connect_failures: AtomicU64::new(0),
            next_serial: AtomicU64::new(1),
        }
    }

    /// The channel limit each live connection works with: the configured `max_sessions`, or
    /// less where the server refused a channel below it (for tests and diagnostics).
    pub(crate) fn channel_limits(&self) -> Vec<usize> {
        let mut connections = self.connections.lock().expect("pool lock");
        connections.retain(|c| !c.is_closed());
        connections
            .iter()
            .map(|c| c.channel_limit.load(Ordering::Acquire))
            .collect()
    }

    /// Number of live connections (for tests and diagnostics).
    pub(crate) fn connection_count(&self) -> usize {
        let mut connections = self.connections.lock().expect("pool lock");
        connections.retain(|c| !c.is_closed());
        connections.len()
    }

    /// Drops every connection; channels in use keep theirs until they finish.
    pub(crate) fn clear(&self) {
        self.connections.lock().expect("pool lock").clear();
    }

    fn try_reserve(&self) -> Option<Lease> {
        let mut connections = self.connections.lock().expect("pool lock");
        connections.retain(|c| !c.is_closed());
        // Least loaded first: spreads concurrent commands over the connections we have.
        let connection = connections
            .iter()
            .filter(|c| c.has_room())
            .min_by_key(|c| c.open_channels.load(Ordering::Acquire))?
            .clone();
        Some(Lease::new(connection))
    }

    async fn reserve(&self, may_connect: bool) -> Result<Option<Lease>, ConnectError> {
        if let Some(lease) = self.try_reserve() {
            return Ok(Some(lease));
        }
        if !may_connect {
            return Ok(None);
        }
        let failures_before = self.connect_failures.load(Ordering::Acquire);
        let mut last_failure = self.connect_lock.lock().await;
        if let Some(lease) = self.try_reserve() {
            return Ok(Some(lease));
        }
        // Whoever held the lock just tried (with its retries) and failed: do not queue up
        // another full round of attempts behind it.
        if self.connect_failures.load(Ordering::Acquire) != failures_before {
            if let Some(reason) = last_failure.as_ref() {
                return Err(ConnectError::Unavailable {
                    host: self.config.name.clone(),
                    target: self.config.target(),
                    reason: reason.clone(),
                });
            }
        }
        let connection = match self.connect_with_retry().await {
            Ok(connection) => {
                let connection = Arc::new(connection);
                session::watch(&connection, &self.config);
                connection
            }
            Err(e) => {
                *last_failure = Some(e.to_string());
                self.connect_failures.fetch_add(1, Ordering::AcqRel);
                return Err(e);
            }
        };
        let lease = Lease::new(connection.clone());
        self.connections.lock().expect("pool lock").push(connection);
        Ok(Some(lease))
    }

    async fn connect_with_retry(&self) -> Result<Connection, ConnectError> {
        let config = &self.config;
        let identity = self
            .identity
            .get_or_try_init(|| async {
                // Decrypting a key runs a deliberately slow KDF: keep it off the runtime.
                let config = config.clone();
                tokio::task::spawn_blocking(move || session::load_identity(&config))
                    .await
                    .unwrap_or_else(|e| {
                        Err(ConnectError::KeyFile {
                            host: self.config.name.clone(),
                            path: Default::default(),
                            reason: format!("loading the credential failed: {e}"),
                        })
                    })
            })
            .await?;
        // `connect_timeout` bounds the whole wait, retries and their backoff included: the
        // error names that bound, and a caller (an operator at a prompt) waits for it, not
        // for a multiple of it. Retries are for failures that come fast (a refused or reset
        // connection while sshd restarts), which leave time for another attempt.
        let attempts = config.connect_attempts.max(1);
        let mut attempt = 0;
        let tries = async {
            loop {
                tokio::time::sleep(session::backoff(config, attempt)).await;
                let serial = self.next_serial.fetch_add(1, Ordering::Relaxed);
                match session::connect(config, identity, serial).await {
                    Ok(connection) => {
                        tracing::debug!(host = %config.name, serial, "connected");
                        return Ok(connection);
                    }
                    Err(e) if attempt + 1 < attempts && is_transient(&e) => {
                        tracing::debug!(host = %config.name, attempt, "connect failed, will retry: {e}");
                        attempt += 1;
                    }
                    Err(e) => return Err(e),
                }
            }
        };
        match tokio::time::timeout(config.connect_timeout, tries).await {
            Ok(result) => result,
            Err(_) => Err(ConnectError::Timeout {
                host: config.name.clone(),
                target: config.target(),
                timeout: config.connect_timeout,
            }),
        }
    }

    /// Opens a session channel on a connection with room, opening connections as needed.
    pub(crate) async fn open_channel(&self) -> Result<OpenChannel, ConnectError> {
        Ok(self
            .open_channel_on(true)
            .await?
            .expect("may connect: a channel or an error"))
    }

    /// Opens a session channel on a connection the pool holds; `Ok(None)` when none has room
    /// (as the server's refusals showed), where [`open_channel`](Pool::open_channel) would
    /// open a connection.
    pub(crate) async fn open_channel_held(&self) -> Result<Option<OpenChannel>, ConnectError> {
        self.open_channel_on(false).await
    }

    async fn open_channel_on(
        &self,
        may_connect: bool,
    ) -> Result<Option<OpenChannel>, ConnectError> {
        let mut last_refusal = String::new();
        for _ in 0..CHANNEL_OPEN_ATTEMPTS {
            let Some(mut lease) = self.reserve(may_connect).await? else {
                return Ok(None);
            };
            let mut opened = lease.connection.handle.channel_open_session().await;
            if matches!(opened, Err(russh::Error::ChannelOpenFailure(_))) {
                // sshd frees a session only once it has read our close of it, and counts it
                // until then: a slot released a moment ago can be refused. A second try after
                // a pause tells that apart from a server whose MaxSessions is below ours.
                tokio::time::sleep(REFUSED_RETRY_PAUSE).await;
                opened = lease.connection.handle.channel_open_session().await;
            }
            match opened {
                Ok(channel) => {
                    lease.confirm();
                    return Ok(Some(OpenChannel::new(channel, lease, self.config.clone())));
                }
                Err(russh::Error::ChannelOpenFailure(reason)) => {
                    // The server's MaxSessions is below ours: remember what it holds. Count
                    // only channels it confirmed; opens still in flight may be refused too.
                    let connection = &lease.connection;
                    let others = connection.confirmed_channels.load(Ordering::Acquire);
                    tracing::debug!(
                        host = %self.config.name,
                        serial = connection.serial,
                        others,
                        "channel refused ({reason:?}), lowering this connection's limit"
                    );
                    connection
                        .channel_limit
                        .fetch_min(others.max(1), Ordering::AcqRel);
                    // Refused while alone on the connection: it will never give us a channel.
                    if connection.open_channels.load(Ordering::Acquire) == 1 {
                        self.retire(connection);
                    }
                    last_refusal = format!("{reason:?}");
                }
                Err(e) => {
                    // A dead connection: forget it and try a fresh one.
                    let reason = if lease.connection.is_closed() {
                        lease.connection.end_reason()
                    } else {
                        e.to_string()
                    };
                    tracing::debug!(host = %self.config.name, "channel open failed: {reason}");
                    self.retire(&lease.connection);
                    last_refusal = reason;
                }
            }
        }
        Err(ConnectError::ChannelRefused {
            host: self.config.name.clone(),
            target: self.config.target(),
            reason: last_refusal,
        })
    }

    /// Whether `connection` is open and still handed out.
    pub(crate) fn holds(&self, connection: &Arc<Connection>) -> bool {
        !connection.is_closed()
            && self
                .connections
                .lock()
                .expect("pool lock")
                .iter()
                .any(|c| Arc::ptr_eq(c, connection))
    }

    /// Stops handing `connection` out; channels already on it keep it until they end.
    pub(crate) fn retire(&self, connection: &Arc<Connection>) {
        self.connections
            .lock()
            .expect("pool lock")
            .retain(|c| !Arc::ptr_eq(c, connection));
    }
}

fn is_transient(e: &ConnectError) -> bool {
    matches!(
        e,
        ConnectError::Unreachable { .. }
            | ConnectError::Timeout { .. }
            | ConnectError::Handshake { .. }
            | ConnectError::Disconnected { .. }
    )
}
