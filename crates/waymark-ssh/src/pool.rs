//! Pooled connections to one host, and running one remote command over an exec channel.
//!
//! A connection carries at most `max_sessions` channels (OpenSSH's `MaxSessions`); past that,
//! or when the server refuses a channel anyway, another connection is opened. Dead
//! connections (keepalive timeout, EOF, a ping the host did not answer) are dropped from the
//! pool and replaced on demand, with backoff between failed attempts. So is a connection a
//! reply was lost on: whatever went wrong there, the next call gets a fresh one.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use russh::client::Msg;
use russh::{Channel, ChannelMsg};
use tokio::io::AsyncWriteExt;

use crate::config::HostConfig;
use crate::error::ConnectError;
use crate::session::{self, Connection, Identity};

/// How often one call retries a refused channel open on another connection.
const CHANNEL_OPEN_ATTEMPTS: usize = 8;

/// Cap on what one exec collects from stdout or stderr. Replies of the wrapper are small or
/// bounded by the `max` the caller gave to `output`; this only stops a runaway host.
pub(crate) const REPLY_CAP: usize = 64 * 1024 * 1024;

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
}

impl Lease {
    fn new(connection: Arc<Connection>) -> Self {
        connection.open_channels.fetch_add(1, Ordering::AcqRel);
        Lease {
            connection,
            confirmed: false,
        }
    }

    fn confirm(&mut self) {
        self.connection
            .confirmed_channels
            .fetch_add(1, Ordering::AcqRel);
        self.confirmed = true;
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        if self.confirmed {
            self.connection
                .confirmed_channels
                .fetch_sub(1, Ordering::AcqRel);
        }
        self.connection.open_channels.fetch_sub(1, Ordering::AcqRel);
    }
}

/// A session channel that is closed when dropped, unless the host closed it already.
/// (russh's own close-on-drop wrapper is private.)
struct ClosingChannel {
    channel: Option<Channel<Msg>>,
    closed_by_host: bool,
}

impl Drop for ClosingChannel {
    fn drop(&mut self) {
        let Some(channel) = self.channel.take() else {
            return;
        };
        if self.closed_by_host {
            return;
        }
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move {
                let _ = channel.close().await;
            });
        }
    }
}

/// An open session channel. Field order matters: the channel (closed on drop) goes before
/// the lease, so the slot is released only once the close is on its way.
pub(crate) struct OpenChannel {
    channel: ClosingChannel,
    pub(crate) lease: Lease,
    config: Arc<HostConfig>,
}

/// How a remote command ended, as sshd reported it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum RemoteExit {
    Code(u32),
    Signal(String),
    /// The channel closed without an exit status.
    Unreported,
}

/// Everything one remote command sent back.
#[derive(Debug)]
pub(crate) struct RemoteOutput {
    pub(crate) stdout: Vec<u8>,
    pub(crate) stderr: Vec<u8>,
    pub(crate) exit: RemoteExit,
}

/// Milestones of one exec, in order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ExecProgress {
    /// The exec request is about to be handed to russh.
    Sending,
    /// sshd confirmed the exec request.
    Accepted,
}

/// Why an exec did not produce a [`RemoteOutput`].
#[derive(Debug)]
pub(crate) enum ExecFailure {
    /// Provably nothing reached the host's shell.
    NotSent(ConnectError),
    /// The exec request may have been delivered; the reply did not arrive.
    Lost(String),
    /// The reply arrived but was larger than [`REPLY_CAP`].
    Oversized,
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

    async fn reserve(&self) -> Result<Lease, ConnectError> {
        if let Some(lease) = self.try_reserve() {
            return Ok(lease);
        }
        let failures_before = self.connect_failures.load(Ordering::Acquire);
        let mut last_failure = self.connect_lock.lock().await;
        if let Some(lease) = self.try_reserve() {
            return Ok(lease);
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
        Ok(lease)
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
        let attempts = config.connect_attempts.max(1);
        let mut attempt = 0;
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
    }

    /// Opens a session channel on a connection with room, opening connections as needed.
    pub(crate) async fn open_channel(&self) -> Result<OpenChannel, ConnectError> {
        let mut last_refusal = String::new();
        for _ in 0..CHANNEL_OPEN_ATTEMPTS {
            let mut lease = self.reserve().await?;
            match lease.connection.handle.channel_open_session().await {
                Ok(channel) => {
                    lease.confirm();
                    return Ok(OpenChannel {
                        channel: ClosingChannel {
                            channel: Some(channel),
                            closed_by_host: false,
                        },
                        lease,
                        config: self.config.clone(),
                    });
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

impl OpenChannel {
    /// Runs `command` through the user's shell on this channel, feeds it `stdin` (then EOF),
    /// and collects its output until the channel closes.
    ///
    /// `on_progress` hears [`ExecProgress::Sending`] just before the exec request is handed to
    /// russh (the point after which a failure is `Lost`), then [`ExecProgress::Accepted`] when
    /// sshd confirms the request.
    /// `deadline` bounds the wait for the reply once the request is out (`None`: rely on
    /// keepalive to notice a dead link).
    pub(crate) async fn exec(
        mut self,
        command: &str,
        stdin: Option<&[u8]>,
        deadline: Option<Duration>,
        mut on_progress: impl FnMut(ExecProgress),
    ) -> Result<RemoteOutput, ExecFailure> {
        let host = self.lease.connection.clone();
        let config = self.config.clone();
        let closing = &mut self.channel;
        let channel = closing
            .channel
            .as_mut()
            .expect("channel present until drop");
        on_progress(ExecProgress::Sending);
        // `exec` only fails when the request could not be handed to the session task: it was
        // never written to the socket.
        if let Err(e) = channel.exec(true, command.as_bytes()).await {
            return Err(ExecFailure::NotSent(ConnectError::Disconnected {
                host: config.name.clone(),
                target: config.target(),
                reason: format!("{e}; {}", host.end_reason()),
            }));
        }
        // From here on the request may have reached the host.
        let mut writer = channel.make_writer();
        let feed = async move {
            if let Some(data) = stdin.filter(|d| !d.is_empty()) {
                writer.write_all(data).await?;
            }
            writer.shutdown().await
        };
        tokio::pin!(feed);
        let mut fed = false;

        let mut reply = ReplyCollector::new(REPLY_CAP);
        let sleep = async {
            match deadline {
                Some(d) => tokio::time::sleep(d).await,
                None => std::future::pending().await,
            }
        };
        tokio::pin!(sleep);
        loop {
            tokio::select! {
                result = &mut feed, if !fed => {
                    fed = true;
                    if let Err(e) = result {
                        tracing::debug!(serial = host.serial, "stdin not fully delivered: {e}");
                    }
                }
                () = &mut sleep => {
                    return Err(ExecFailure::Lost(format!(
                        "no reply within {:?}", deadline.unwrap_or_default()
                    )));
                }
                msg = channel.wait() => match reply.on_message(msg) {
                    Step::Pending => {}
                    Step::Accepted => on_progress(ExecProgress::Accepted),
                    Step::Finished => {
                        closing.closed_by_host = true;
                        break;
                    }
                    Step::Refused => {
                        // sshd answers an exec request with failure before starting anything.
                        return Err(ExecFailure::NotSent(ConnectError::ChannelRefused {
                            host: config.name.clone(),
                            target: config.target(),
                            reason: "the server refused the exec request".into(),
                        }));
                    }
                    Step::Broken => {
                        closing.closed_by_host = true;
                        return Err(ExecFailure::Lost(host.end_reason()));
                    }
                },
            }
        }
        reply.into_output()
    }
}

/// What one channel message means for the exec waiting on it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Step {
    /// Keep reading.
    Pending,
    /// sshd accepted the exec request (reported once).
    Accepted,
    /// The channel closed: the reply is whole.
    Finished,
    /// sshd refused the exec request: nothing was started.
    Refused,
    /// The session ended before the reply was whole.
    Broken,
}

/// Collects one exec channel's reply, whatever order sshd sends its parts in: exit status
/// before or after EOF, close with or without either. Only the end of the channel decides
/// that the reply is complete.
#[derive(Debug)]
pub(crate) struct ReplyCollector {
    out: RemoteOutput,
    cap: usize,
    eof: bool,
    accepted: bool,
    overflow: bool,
}

impl ReplyCollector {
    pub(crate) fn new(cap: usize) -> Self {
        ReplyCollector {
            out: RemoteOutput {
                stdout: Vec::new(),
                stderr: Vec::new(),
                exit: RemoteExit::Unreported,
            },
            cap,
            eof: false,
            accepted: false,
            overflow: false,
        }
    }

    /// Takes the next message (`None`: the session is gone) and says what it means.
    pub(crate) fn on_message(&mut self, msg: Option<ChannelMsg>) -> Step {
        match msg {
            Some(ChannelMsg::Data { data }) => {
                self.append(Stream::Out, &data);
                Step::Pending
            }
            Some(ChannelMsg::ExtendedData { data, ext }) => {
                if ext == 1 {
                    self.append(Stream::Err, &data);
                }
                Step::Pending
            }
            Some(ChannelMsg::ExitStatus { exit_status }) => {
                self.out.exit = RemoteExit::Code(exit_status);
                Step::Pending
            }
            Some(ChannelMsg::ExitSignal { signal_name, .. }) => {
                self.out.exit = RemoteExit::Signal(format!("{signal_name:?}"));
                Step::Pending
            }
            Some(ChannelMsg::Success) if !self.accepted => {
                self.accepted = true;
                Step::Accepted
            }
            Some(ChannelMsg::Failure) => Step::Refused,
            Some(ChannelMsg::Eof) => {
                self.eof = true;
                Step::Pending
            }
            Some(ChannelMsg::Close) => Step::Finished,
            Some(_) => Step::Pending,
            // The session ended without closing the channel. If everything had arrived
            // (all output, then the exit status), nothing is missing.
            None if self.eof && self.out.exit != RemoteExit::Unreported => Step::Finished,
            None => Step::Broken,
        }
    }

    /// The reply, once [`Step::Finished`] was seen.
    pub(crate) fn into_output(self) -> Result<RemoteOutput, ExecFailure> {
        if self.overflow {
            Err(ExecFailure::Oversized)
        } else {
            Ok(self.out)
        }
    }

    fn append(&mut self, stream: Stream, data: &[u8]) {
        let buf = match stream {
            Stream::Out => &mut self.out.stdout,
            Stream::Err => &mut self.out.stderr,
        };
        if buf.len() + data.len() > self.cap {
            self.overflow = true;
        } else {
            buf.extend_from_slice(data);
        }
    }
}

#[derive(Clone, Copy)]
enum Stream {
    Out,
    Err,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn b(s: &str) -> ChannelMsg {
        ChannelMsg::Data {
            data: s.as_bytes().to_vec().into(),
        }
    }

    fn feed(msgs: Vec<Option<ChannelMsg>>) -> (Vec<Step>, ReplyCollector) {
        let mut reply = ReplyCollector::new(1024);
        let steps = msgs.into_iter().map(|m| reply.on_message(m)).collect();
        (steps, reply)
    }

    #[test]
    fn exit_status_before_or_after_eof_is_kept() {
        for order in [
            vec![
                b("out"),
                ChannelMsg::Eof,
                ChannelMsg::ExitStatus { exit_status: 3 },
            ],
            vec![
                ChannelMsg::ExitStatus { exit_status: 3 },
                b("out"),
                ChannelMsg::Eof,
            ],
            vec![b("o"), ChannelMsg::ExitStatus { exit_status: 3 }, b("ut")],
        ] {
            let mut msgs: Vec<_> = order.into_iter().map(Some).collect();
            msgs.push(Some(ChannelMsg::Close));
            let (steps, reply) = feed(msgs);
            assert_eq!(steps.last(), Some(&Step::Finished));
            let out = reply.into_output().unwrap();
            assert_eq!(out.exit, RemoteExit::Code(3));
            assert_eq!(out.stdout, b"out");
        }
    }

    #[test]
    fn close_without_exit_status_is_unreported() {
        let (steps, reply) = feed(vec![Some(ChannelMsg::Eof), Some(ChannelMsg::Close)]);
        assert_eq!(steps, vec![Step::Pending, Step::Finished]);
        assert_eq!(reply.into_output().unwrap().exit, RemoteExit::Unreported);
    }

    #[test]
    fn a_session_ending_mid_reply_is_broken_but_after_the_whole_reply_is_fine() {
        let (steps, _) = feed(vec![
            Some(b("partial")),
            Some(ChannelMsg::ExitStatus { exit_status: 0 }),
            None,
        ]);
        assert_eq!(
            steps.last(),
            Some(&Step::Broken),
            "no EOF: output may be cut"
        );
        let (steps, _) = feed(vec![Some(b("partial")), Some(ChannelMsg::Eof), None]);
        assert_eq!(steps.last(), Some(&Step::Broken), "no exit status");
        let (steps, reply) = feed(vec![
            Some(b("whole")),
            Some(ChannelMsg::Eof),
            Some(ChannelMsg::ExitStatus { exit_status: 0 }),
            None,
        ]);
        assert_eq!(steps.last(), Some(&Step::Finished));
        assert_eq!(reply.into_output().unwrap().stdout, b"whole");
    }

    #[test]
    fn stderr_signal_acceptance_and_refusal_are_reported() {
        let (steps, reply) = feed(vec![
            Some(ChannelMsg::Success),
            Some(ChannelMsg::Success),
            Some(ChannelMsg::ExtendedData {
                data: b"err".to_vec().into(),
                ext: 1,
            }),
            Some(ChannelMsg::ExitSignal {
                signal_name: russh::Sig::KILL,
                core_dumped: false,
                error_message: String::new(),
                lang_tag: String::new(),
            }),
            Some(ChannelMsg::Close),
        ]);
        assert_eq!(steps[..2], [Step::Accepted, Step::Pending]);
        let out = reply.into_output().unwrap();
        assert_eq!(out.stderr, b"err");
        assert!(matches!(out.exit, RemoteExit::Signal(_)));
        let (steps, _) = feed(vec![Some(ChannelMsg::Failure)]);
        assert_eq!(steps, vec![Step::Refused]);
    }

    #[test]
    fn output_past_the_cap_is_oversized() {
        let mut reply = ReplyCollector::new(4);
        reply.on_message(Some(b("abc")));
        reply.on_message(Some(b("de")));
        reply.on_message(Some(ChannelMsg::Close));
        assert!(matches!(reply.into_output(), Err(ExecFailure::Oversized)));
    }
}
