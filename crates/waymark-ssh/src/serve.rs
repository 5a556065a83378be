//! Serve channels: one long-lived `wrap serve` per channel, one request at a time.
//!
//! An exec channel costs the host sshd's session setup, the login shell and the wrapper's
//! interpreter for every request, and the client a channel open and close. A serve channel
//! pays that once: it stays open between requests and is handed to the next call. The
//! protocol (request lines, replies, the trailer) is in [`crate::wrapper`]'s serve module;
//! this is the I/O around it, and the same NotSent/Lost rule as an exec: a failure before
//! the request line is handed to the connection is `NotSent`, after it `Lost`.

use std::future::Future;
use std::task::Poll;
use std::time::{Duration, Instant};

use russh::ChannelMsg;

use crate::channel::{ExecProgress, OpenChannel, RemoteExit, REPLY_CAP};
use crate::error::ConnectError;
use crate::wrapper::{parse_serve_reply_at, ServeParse, WrapperReply, SERVE_READY};

/// Most bytes of stderr kept from a serve worker that ended before it was ready.
const START_STDERR_CAP: usize = 64 * 1024;

/// An open channel whose wrapper serve worker is ready for a request.
pub(crate) struct ServeChannel {
    open: OpenChannel,
    /// Bytes received and not yet part of a reply (empty between requests).
    buf: Vec<u8>,
    /// When it last became idle.
    pub(crate) idle_since: Instant,
}

/// Why a serve worker did not become ready. No request was sent on it.
pub(crate) enum StartFailure {
    /// The connection failed or refused the channel.
    NotSent(ConnectError),
    /// The worker did not say it was ready within the deadline: a slow login, most likely,
    /// since a dead connection ends the wait as `NotSent` (its pings go unanswered).
    Slow,
    /// The serve command ended, or said something other than ready: `exit` is
    /// [`RemoteExit::Code`] 69 when the wrapper is missing.
    Ended { exit: RemoteExit, detail: String },
}

/// Why a served request has no reply.
pub(crate) enum RequestFailure {
    /// The request line never left: nothing can have run.
    NotSent(ConnectError),
    /// The request may have reached the worker; its reply did not come whole.
    Lost(String),
    /// The reply grew past [`REPLY_CAP`].
    Oversized,
}

impl ServeChannel {
    /// Starts `command` (the wrapper's `serve` command line) on `open` and waits up to
    /// `deadline` for the worker to say it is ready.
    pub(crate) async fn start(
        mut open: OpenChannel,
        command: &str,
        deadline: Duration,
    ) -> Result<ServeChannel, StartFailure> {
        let config = open.config().clone();
        let connection = open.lease.connection.clone();
        let disconnected = |reason: String| ConnectError::Disconnected {
            host: config.name.clone(),
            target: config.target(),
            reason,
        };
        open.linger();
        if let Err(e) = open.raw().exec(true, command.as_bytes()).await {
            return Err(StartFailure::NotSent(disconnected(format!(
                "{e}; {}",
                connection.end_reason()
            ))));
        }
        let mut out = Vec::new();
        let mut err = Vec::new();
        let mut exit = RemoteExit::Unreported;
        let waited = tokio::time::timeout(deadline, async {
            loop {
                match open.raw().wait().await {
                    Some(ChannelMsg::Data { data }) => {
                        out.extend_from_slice(&data);
                        if out.starts_with(SERVE_READY) {
                            return Ok(());
                        }
                        if !SERVE_READY.starts_with(&out) {
                            return Err(None);
                        }
                    }
                    Some(ChannelMsg::ExtendedData { data, ext: 1 }) => {
                        if err.len() + data.len() <= START_STDERR_CAP {
                            err.extend_from_slice(&data);
                        }
                    }
                    Some(ChannelMsg::ExitStatus { exit_status }) => {
                        exit = RemoteExit::Code(exit_status)
                    }
                    Some(ChannelMsg::ExitSignal { signal_name, .. }) => {
                        exit = RemoteExit::Signal(format!("{signal_name:?}"))
                    }
                    Some(ChannelMsg::Failure) => {
                        return Err(Some(ConnectError::ChannelRefused {
                            host: config.name.clone(),
                            target: config.target(),
                            reason: "the server refused the exec request".into(),
                        }))
                    }
                    Some(ChannelMsg::Close) => return Err(None),
                    Some(_) => {}
                    None => return Err(Some(disconnected(connection.end_reason()))),
                }
            }
        })
        .await;
        match waited {
            Ok(Ok(())) => {
                let buf = out.split_off(SERVE_READY.len());
                Ok(ServeChannel {
                    open,
                    buf,
                    idle_since: Instant::now(),
                })
            }
            Ok(Err(Some(e))) => Err(StartFailure::NotSent(e)),
            Ok(Err(None)) => Err(StartFailure::Ended {
                exit,
                detail: format!(
                    "stdout {:?}, stderr {:?}",
                    String::from_utf8_lossy(&out[..out.len().min(200)]),
                    String::from_utf8_lossy(&err).trim()
                ),
            }),
            Err(_) => Err(StartFailure::Slow),
        }
    }

    /// Closes the channel (its worker reads end of file and exits) and returns once the host
    /// closed it too: its slot is then free on the server as well.
    pub(crate) async fn shut(self) {
        self.open.shut().await;
    }

    pub(crate) fn connection(&self) -> &std::sync::Arc<crate::session::Connection> {
        &self.open.lease.connection
    }

    /// Whether the channel said nothing while it was idle (or only adjusted its window): any
    /// data, end of file, exit or close means the worker is gone or out of step.
    pub(crate) async fn is_quiet(&mut self) -> bool {
        if !self.buf.is_empty() {
            return false;
        }
        let serial = self.connection().serial;
        loop {
            let mut next = std::pin::pin!(self.open.raw().wait());
            let polled = std::future::poll_fn(|cx| Poll::Ready(next.as_mut().poll(cx))).await;
            match polled {
                Poll::Pending => return true,
                Poll::Ready(Some(ChannelMsg::WindowAdjusted { .. })) => {}
                Poll::Ready(Some(other)) => {
                    tracing::debug!(serial, "an idle serve channel said {other:?}; not using it");
                    return false;
                }
                Poll::Ready(None) => return false,
            }
        }
    }

    /// Sends one request line (newline included) and reads its reply. `Ok((reply, reusable))`:
    /// `reusable` is false when anything followed the reply, and the channel must be dropped.
    pub(crate) async fn request(
        &mut self,
        line: &str,
        deadline: Option<Duration>,
        on_progress: &mut (dyn FnMut(ExecProgress) + Send),
    ) -> Result<(WrapperReply, bool), RequestFailure> {
        let config = self.open.config().clone();
        let connection = self.open.lease.connection.clone();
        on_progress(ExecProgress::Sending);
        // `data_bytes` fails only when the bytes could not be handed to the session task:
        // they were never written to the socket, and a line cut short is never run.
        if let Err(e) = self.open.raw().data_bytes(line.as_bytes().to_vec()).await {
            return Err(RequestFailure::NotSent(ConnectError::Disconnected {
                host: config.name.clone(),
                target: config.target(),
                reason: format!("{e}; {}", connection.end_reason()),
            }));
        }
        on_progress(ExecProgress::Accepted);
        let read = async {
            let mut resume = 0;
            loop {
                match parse_serve_reply_at(&self.buf, &mut resume) {
                    Ok(ServeParse::Reply { reply, consumed }) => {
                        let reusable = consumed == self.buf.len();
                        self.buf.clear();
                        return Ok((reply, reusable));
                    }
                    Ok(ServeParse::Incomplete) => {}
                    Err(e) => return Err(RequestFailure::Lost(e.to_string())),
                }
                match self.open.raw().wait().await {
                    Some(ChannelMsg::Data { data }) => {
                        if self.buf.len() + data.len() > REPLY_CAP {
                            return Err(RequestFailure::Oversized);
                        }
                        self.buf.extend_from_slice(&data);
                    }
                    Some(ChannelMsg::ExtendedData { data, .. }) => {
                        tracing::debug!(
                            serial = connection.serial,
                            "serve worker stderr: {}",
                            String::from_utf8_lossy(&data).trim()
                        );
                    }
                    Some(
                        msg @ (ChannelMsg::Eof
                        | ChannelMsg::Close
                        | ChannelMsg::ExitStatus { .. }
                        | ChannelMsg::ExitSignal { .. }),
                    ) => {
                        if matches!(msg, ChannelMsg::Close) {
                            self.open.closed_by_host();
                        }
                        return Err(RequestFailure::Lost(format!(
                            "the serve worker ended before its reply was whole ({msg:?})"
                        )));
                    }
                    Some(_) => {}
                    None => return Err(RequestFailure::Lost(connection.end_reason())),
                }
            }
        };
        match deadline {
            Some(d) => tokio::time::timeout(d, read)
                .await
                .unwrap_or_else(|_| Err(RequestFailure::Lost(format!("no reply within {d:?}")))),
            None => read.await,
        }
    }
}
