//! One server connection: authentication, channel requests, and running each `exec` as
//! `/bin/sh -c` with the channel as its stdio.

use std::collections::HashSet;
use std::ffi::OsStr;
use std::net::SocketAddr;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use russh::keys::PublicKey;
use russh::server::{self, Auth, Msg, PublicKeyOffer, Session, VerifiedPublicKey};
use russh::{Channel, ChannelId, ChannelMsg, Sig};
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::process::{ChildStdin, Command};
use tokio::sync::{mpsc, oneshot, watch};

/// `PATH` for commands when Waymark itself runs without one.
const DEFAULT_PATH: &str = "/usr/local/bin:/usr/bin:/bin";

/// Environment variables passed through from Waymark to commands, besides `PATH`. Everything
/// else is left out, as sshd does, so nothing of Waymark's own environment (agent socket,
/// tokens) leaks into commands.
const PASSED_ENV: &[&str] = &[
    "USER", "LOGNAME", "LANG", "LC_ALL", "LC_CTYPE", "TZ", "TMPDIR",
];

/// What every connection of one server needs.
#[derive(Debug)]
pub(super) struct Shared {
    pub(super) home: PathBuf,
    pub(super) authorized: PublicKey,
    pub(super) user: Option<String>,
    pub(super) exec_count: Arc<AtomicU64>,
}

impl Shared {
    fn admits(&self, user: &str, key: &PublicKey) -> bool {
        let user_ok = self.user.as_deref().is_none_or(|u| u == user);
        user_ok && key.key_data() == self.authorized.key_data()
    }
}

pub(super) async fn accept_loop(
    listener: TcpListener,
    config: Arc<server::Config>,
    shared: Arc<Shared>,
    mut stopped: watch::Receiver<bool>,
) {
    loop {
        let (stream, peer) = tokio::select! {
            () = stop_requested(&mut stopped) => break,
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(e) => {
                    // Out of file descriptors and the like: pause rather than spin.
                    tracing::warn!("embedded SSH server: accept failed: {e}");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
        };
        tokio::spawn(serve_connection(
            stream,
            peer,
            config.clone(),
            shared.clone(),
            stopped.clone(),
        ));
    }
    tracing::info!(addr = ?listener.local_addr().ok(), "embedded SSH server stopped listening");
}

/// Resolves once the server is told to stop (or is gone).
async fn stop_requested(stopped: &mut watch::Receiver<bool>) {
    // The guard `wait_for` returns is not `Send`: drop it here, not across an await.
    let _ = stopped.wait_for(|stop| *stop).await.map(|_| ());
}

async fn serve_connection(
    stream: TcpStream,
    peer: SocketAddr,
    config: Arc<server::Config>,
    shared: Arc<Shared>,
    mut stopped: watch::Receiver<bool>,
) {
    let _ = stream.set_nodelay(true);
    tracing::debug!(%peer, "embedded SSH server: connection");
    let handler = ConnectionHandler {
        shared,
        peer,
        exec_channels: HashSet::new(),
    };
    // The handshake itself runs inside `run_stream`, so a silent peer must not block shutdown.
    let session = tokio::select! {
        () = stop_requested(&mut stopped) => return,
        session = server::run_stream(config, stream, handler) => match session {
            Ok(session) => session,
            Err(e) => {
                tracing::debug!(%peer, "embedded SSH server: handshake failed: {e}");
                return;
            }
        },
    };
    let handle = session.handle();
    tokio::select! {
        () = stop_requested(&mut stopped) => {
            let _ = handle
                .disconnect(russh::Disconnect::ByApplication, "server shutting down".into(), String::new())
                .await;
        }
        ended = session => match ended {
            Ok(()) => tracing::debug!(%peer, "embedded SSH server: connection closed"),
            Err(e) => tracing::debug!(%peer, "embedded SSH server: connection ended: {e}"),
        },
    }
}

/// One connection's russh handler: authentication and channel requests.
struct ConnectionHandler {
    shared: Arc<Shared>,
    peer: SocketAddr,
    /// Channels that already had their one exec request.
    exec_channels: HashSet<ChannelId>,
}

impl ConnectionHandler {
    fn refuse(
        &self,
        channel: ChannelId,
        what: &str,
        session: &mut Session,
    ) -> Result<(), russh::Error> {
        tracing::debug!(peer = %self.peer, ?channel, "embedded SSH server: refused {what} request");
        session.channel_failure(channel)
    }
}

impl server::Handler for ConnectionHandler {
    type Error = russh::Error;

    async fn auth_publickey_offered(
        &mut self,
        user: &str,
        offer: PublicKeyOffer<'_>,
    ) -> Result<Auth, Self::Error> {
        Ok(if self.shared.admits(user, offer.public_key) {
            Auth::Accept
        } else {
            Auth::reject()
        })
    }

    async fn auth_publickey(
        &mut self,
        user: &str,
        key: VerifiedPublicKey<'_>,
    ) -> Result<Auth, Self::Error> {
        if self.shared.admits(user, key.public_key) {
            tracing::debug!(peer = %self.peer, user, "embedded SSH server: authenticated");
            Ok(Auth::Accept)
        } else {
            tracing::info!(peer = %self.peer, user, "embedded SSH server: refused a public key");
            Ok(Auth::reject())
        }
    }

    async fn channel_open_session(
        &mut self,
        channel: Channel<Msg>,
        reply: server::ChannelOpenHandle,
        session: &mut Session,
    ) -> Result<(), Self::Error> {
        reply.accept().await;
        tokio::spawn(serve_channel(
            channel,
            session.handle(),
            self.shared.clone(),
        ));
        Ok(())
    }

    async fn exec_request(
        &mut self,
        channel: ChannelId,
        data: &[u8],
        session: &mut Session,
    ) -> Result<(), Self::Error> {
        if !self.exec_channels.insert(channel) {
            return self.refuse(channel, "second exec", session);
        }
        self.shared.exec_count.fetch_add(1, Ordering::Relaxed);
        // The command itself may hold secrets: log its size, never its text.
        tracing::debug!(peer = %self.peer, ?channel, bytes = data.len(), "embedded SSH server: exec");
        // Accepted before it is spawned, as sshd does: a command that cannot start shows up as
        // exit status 127 with a message on stderr.
        session.channel_success(channel)
    }

    async fn channel_close(
        &mut self,
        channel: ChannelId,
        _session: &mut Session,
    ) -> Result<(), Self::Error> {
        self.exec_channels.remove(&channel);
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    async fn pty_request(
        &mut self,
        channel: ChannelId,
        _term: &str,
        _col_width: u32,
        _row_height: u32,
        _pix_width: u32,
        _pix_height: u32,
        _modes: &[(russh::Pty, u32)],
        session: &mut Session,
    ) -> Result<(), Self::Error> {
        self.refuse(channel, "pty", session)
    }

    async fn x11_request(
        &mut self,
        channel: ChannelId,
        _single_connection: bool,
        _x11_auth_protocol: &str,
        _x11_auth_cookie: &str,
        _x11_screen_number: u32,
        session: &mut Session,
    ) -> Result<(), Self::Error> {
        self.refuse(channel, "x11", session)
    }

    async fn env_request(
        &mut self,
        channel: ChannelId,
        _variable_name: &str,
        _variable_value: &str,
        session: &mut Session,
    ) -> Result<(), Self::Error> {
        self.refuse(channel, "env", session)
    }

    async fn shell_request(
        &mut self,
        channel: ChannelId,
        session: &mut Session,
    ) -> Result<(), Self::Error> {
        self.refuse(channel, "shell", session)
    }

    async fn subsystem_request(
        &mut self,
        channel: ChannelId,
        _name: &str,
        session: &mut Session,
    ) -> Result<(), Self::Error> {
        self.refuse(channel, "subsystem", session)
    }
}

/// Runs one session channel: waits for its exec request, runs the command, streams its output
/// back, then reports how it ended.
///
/// russh hands every channel message both to the handler and to this task's [`Channel`], and
/// its connection loop waits while the channel's queue is full, so this task keeps reading the
/// channel until it closes, whatever the command does.
async fn serve_channel(mut channel: Channel<Msg>, handle: server::Handle, shared: Arc<Shared>) {
    let command = loop {
        match channel.wait().await {
            Some(ChannelMsg::Exec { command, .. }) => break command,
            // Refused requests (pty, shell, ...) were answered by the handler.
            Some(_) => continue,
            None => return,
        }
    };
    let id = channel.id();
    let (mut incoming, outgoing) = channel.split();

    let spawned = Command::new("/bin/sh")
        .arg("-c")
        .arg(OsStr::from_bytes(&command))
        .current_dir(&shared.home)
        .env_clear()
        .envs(command_env(&shared.home))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0)
        .kill_on_drop(false)
        .spawn();
    let mut child = match spawned {
        Ok(child) => child,
        Err(e) => {
            tracing::warn!(?id, "embedded SSH server: cannot start /bin/sh: {e}");
            let message = format!("waymark embedded server: cannot start /bin/sh: {e}\n");
            let _ = outgoing.extended_data_bytes(1, message.into_bytes()).await;
            let _ = outgoing.exit_status(127).await;
            let _ = outgoing.eof().await;
            let _ = outgoing.close().await;
            drain(incoming).await;
            return;
        }
    };

    // Stdin is buffered without bound so that reading the channel never waits on the command
    // (see above); what the client sends is small (scripts, request bodies).
    let (stdin_tx, stdin_rx) = mpsc::unbounded_channel();
    if let Some(stdin) = child.stdin.take() {
        tokio::spawn(feed_stdin(stdin, stdin_rx));
    }
    // Dropped when the channel is gone (closed by the client, or the connection ended).
    let (gone_tx, gone) = oneshot::channel::<()>();
    tokio::spawn(async move {
        let _gone_tx = gone_tx;
        let mut stdin_tx = Some(stdin_tx);
        while let Some(msg) = incoming.wait().await {
            match msg {
                ChannelMsg::Data { data } => {
                    if let Some(tx) = &stdin_tx {
                        let _ = tx.send(data);
                    }
                }
                ChannelMsg::Eof => stdin_tx = None,
                _ => {}
            }
        }
    });

    let stdout = child.stdout.take();
    let stderr = child.stderr.take();
    let relayed = async {
        tokio::join!(
            relay(stdout, outgoing.make_writer()),
            relay(stderr, outgoing.make_writer_ext(Some(1))),
        )
    };
    // Nothing reads a vanished channel: its window never reopens, and a relay waiting on it
    // would block the command on a full pipe forever. Dropping the pipes instead is what sshd
    // does.
    let channel_gone = tokio::select! {
        _ = relayed => false,
        _ = gone => true,
    };
    // Reaped even when nobody is left to tell: the command may outlive its connection.
    let status = match child.wait().await {
        Ok(status) => status,
        Err(e) => {
            tracing::warn!(?id, "embedded SSH server: cannot wait for the command: {e}");
            let _ = outgoing.close().await;
            return;
        }
    };
    tracing::debug!(?id, %status, channel_gone, "embedded SSH server: command ended");
    if channel_gone {
        return;
    }
    match (status.code(), status.signal()) {
        (Some(code), _) => {
            let _ = outgoing.exit_status(code as u32).await;
        }
        (None, Some(signal)) => {
            let _ = handle
                .exit_signal_request(
                    id,
                    signal_name(signal),
                    status.core_dumped(),
                    String::new(),
                    String::new(),
                )
                .await;
        }
        (None, None) => {}
    }
    let _ = outgoing.eof().await;
    let _ = outgoing.close().await;
}

/// The environment of a command: a clean one, like sshd's.
fn command_env(home: &Path) -> Vec<(String, std::ffi::OsString)> {
    let mut env = vec![
        ("HOME".to_string(), home.as_os_str().to_owned()),
        (
            "PATH".to_string(),
            std::env::var_os("PATH").unwrap_or_else(|| DEFAULT_PATH.into()),
        ),
        ("SHELL".to_string(), "/bin/sh".into()),
    ];
    for name in PASSED_ENV {
        if let Some(value) = std::env::var_os(name) {
            env.push((name.to_string(), value));
        }
    }
    env
}

/// Copies what the client sends to the command's stdin; dropping the pipe at the end is the
/// command's EOF. A command that stops reading just loses the rest.
async fn feed_stdin<B: AsRef<[u8]>>(mut stdin: ChildStdin, mut data: mpsc::UnboundedReceiver<B>) {
    while let Some(chunk) = data.recv().await {
        if stdin.write_all(chunk.as_ref()).await.is_err() {
            return;
        }
    }
}

/// Copies one output stream of the command to the channel until EOF. If the connection is
/// gone, the pipe is dropped: the command gets `SIGPIPE`/`EPIPE` on its next write, and is not
/// otherwise disturbed.
async fn relay(source: Option<impl AsyncRead + Unpin>, mut sink: impl AsyncWrite + Unpin) {
    if let Some(mut source) = source {
        if let Err(e) = tokio::io::copy(&mut source, &mut sink).await {
            tracing::debug!("embedded SSH server: output not relayed: {e}");
        }
    }
}

/// Reads a channel until it closes, so russh never waits on it.
async fn drain(mut incoming: russh::ChannelReadHalf) {
    while incoming.wait().await.is_some() {}
}

/// The SSH name of a signal (RFC 4254 §6.10) from its number. Only numbers POSIX fixes are
/// named; others travel as their number.
fn signal_name(signal: i32) -> Sig {
    match signal {
        1 => Sig::HUP,
        2 => Sig::INT,
        3 => Sig::QUIT,
        4 => Sig::ILL,
        6 => Sig::ABRT,
        8 => Sig::FPE,
        9 => Sig::KILL,
        11 => Sig::SEGV,
        13 => Sig::PIPE,
        14 => Sig::ALRM,
        15 => Sig::TERM,
        other => Sig::Custom(other.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn posix_signals_get_their_ssh_names() {
        assert!(matches!(signal_name(9), Sig::KILL));
        assert!(matches!(signal_name(15), Sig::TERM));
        assert!(matches!(signal_name(64), Sig::Custom(ref n) if n == "64"));
    }

    #[test]
    fn only_the_authorized_key_and_user_are_admitted() {
        let key = super::super::generate_ed25519("k").expect("key");
        let other = super::super::generate_ed25519("o").expect("key");
        let shared = Shared {
            home: PathBuf::from("/"),
            authorized: key.public_key().clone(),
            user: Some("demo".into()),
            exec_count: Arc::default(),
        };
        assert!(shared.admits("demo", key.public_key()));
        assert!(!shared.admits("root", key.public_key()));
        assert!(!shared.admits("demo", other.public_key()));
    }
}
