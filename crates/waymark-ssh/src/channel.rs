//! Running one remote command over an exec channel: send the request, feed stdin then EOF,
//! and collect the reply whatever order sshd sends its parts in.

use std::sync::Arc;
use std::time::Duration;

use russh::client::Msg;
use russh::{Channel, ChannelMsg};
use tokio::io::AsyncWriteExt;

use crate::config::HostConfig;
use crate::error::ConnectError;
use crate::pool::Lease;

/// Cap on what one exec collects from stdout or stderr. Replies of the wrapper are small or
/// bounded by the `max` the caller gave to `output`; this only stops a runaway host.
pub(crate) const REPLY_CAP: usize = 64 * 1024 * 1024;

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
    /// Dropped while its remote process may still run: keep the slot until the host closed
    /// the channel too (see [`OpenChannel::linger`]).
    linger: bool,
}

/// Closes `channel` and waits, up to `patience`, for the host's close.
async fn close_and_wait(channel: &mut Channel<Msg>, patience: Duration) {
    let _ = channel.close().await;
    let _ = tokio::time::timeout(patience, async {
        while let Some(msg) = channel.wait().await {
            if matches!(msg, ChannelMsg::Close) {
                break;
            }
        }
    })
    .await;
}

impl Drop for OpenChannel {
    /// A lingering channel keeps its slot until the host's close arrives (at most the ping
    /// patience): sshd counts a session against `MaxSessions` until its process has exited,
    /// and a channel opened in that gap would be refused, which would teach the pool a lower
    /// limit than the server's.
    fn drop(&mut self) {
        if !self.linger || self.channel.closed_by_host {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let Some(mut channel) = self.channel.channel.take() else {
            return;
        };
        let lease = self.lease.hand_over();
        let patience = self.config.ping_patience();
        runtime.spawn(async move {
            close_and_wait(&mut channel, patience).await;
            drop(lease);
        });
    }
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

impl OpenChannel {
    /// Wraps a channel the server confirmed on `lease`'s connection.
    pub(crate) fn new(channel: Channel<Msg>, lease: Lease, config: Arc<HostConfig>) -> Self {
        OpenChannel {
            channel: ClosingChannel {
                channel: Some(channel),
                closed_by_host: false,
            },
            lease,
            config,
            linger: false,
        }
    }

    /// Closes the channel and returns once the host closed it too (at most the ping
    /// patience), releasing its slot: what a lingering drop does, awaited.
    pub(crate) async fn shut(mut self) {
        let Some(mut channel) = self.channel.channel.take() else {
            return;
        };
        if self.channel.closed_by_host {
            return;
        }
        close_and_wait(&mut channel, self.config.ping_patience()).await;
    }

    /// From now on, a drop keeps the slot until the host closes the channel: for a channel
    /// whose remote process outlives the requests on it (a serve worker).
    pub(crate) fn linger(&mut self) {
        self.linger = true;
    }

    /// The channel itself, for a caller that drives it (see `serve`).
    pub(crate) fn raw(&mut self) -> &mut Channel<Msg> {
        self.channel
            .channel
            .as_mut()
            .expect("channel present until drop")
    }

    /// The host closed this channel: nothing to close on drop.
    pub(crate) fn closed_by_host(&mut self) {
        self.channel.closed_by_host = true;
    }

    pub(crate) fn config(&self) -> &Arc<HostConfig> {
        &self.config
    }

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
