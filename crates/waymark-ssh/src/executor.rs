//! The executor: runs wrapper verbs on one host over the pooled connections.

use std::sync::atomic::Ordering;
use std::sync::Mutex;
use std::time::Duration;

use crate::channel::{ExecFailure, ExecProgress, OpenChannel, RemoteExit, RemoteOutput};
use crate::config::HostConfig;
use crate::error::Error;
use crate::pool::Pool;
use crate::serve::{RequestFailure, ServeChannel, StartFailure};
mod install;
mod serving;

use crate::wrapper::{
    exit_status, GcReport, OutputChunk, RemoteDir, RemoteWrapper, RunOutcome, RunReport,
    StartOptions, StatusReport, Stream, WatchReport, WrapperError, WrapperReply,
};

/// Slack added to a dispatch's host-side timeout (and kill grace) before the client gives up
/// waiting for the reply: the wrapper drains the process group for up to a few seconds more.
const REPLY_SLACK: Duration = Duration::from_secs(15);

/// Default SIGTERM→SIGKILL grace of the wrapper, used to bound the wait for a reply.
const DEFAULT_KILL_GRACE: Duration = Duration::from_secs(5);

/// Chunk size used by [`Executor::read_stream`].
pub const DEFAULT_CHUNK: u64 = 4 * 1024 * 1024;

/// One command to run on the host under an execution ID.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DispatchRequest {
    /// The execution ID (`act_…`), which names the host-side marker.
    pub execution_id: String,
    /// Program and arguments. Each element reaches the program as one argument, byte for byte:
    /// nothing in it is interpreted by a shell.
    pub argv: Vec<String>,
    /// Working directory on the host (default: the login directory).
    pub cwd: Option<String>,
    /// Extra environment variables for the command.
    pub env: Vec<(String, String)>,
    /// Environment variables holding secrets: sent on the channel's stdin, never on a command
    /// line or into the marker (see [`StartOptions::secret_env`]).
    pub secret_env: Vec<(String, String)>,
    /// Indices into `argv` of words holding secrets: sent on the channel's stdin like
    /// `secret_env`, never on the wrapper's command line or into the marker (the command's own
    /// argv still holds them, as it must).
    pub secret_args: Vec<usize>,
    /// Bytes for the command's stdin (default: `/dev/null`). The wrapper stores them in the
    /// marker before the command starts.
    pub stdin: Option<Vec<u8>>,
    /// Enforced on the host, whether or not a connection survives: the command's process
    /// group gets SIGTERM, then SIGKILL after the kill grace. Rounded up to whole seconds.
    pub timeout: Option<Duration>,
    /// Largest stream returned inline (default 64 KiB); larger ones are read with
    /// [`Executor::output`].
    pub inline_max: Option<u64>,
}

/// Progress of one [`Executor::dispatch`], reported as it happens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DispatchEvent {
    /// A connection and the wrapper are ready, and the request is about to be written. Until
    /// this event a failure is [`Error::NotSent`]; from it on, the host may run the command.
    /// Record "dispatched" durably when this arrives: the callback runs before the send. (If
    /// the call still ends in [`Error::NotSent`], the request provably never left.)
    Sending,
    /// sshd accepted the exec request: the wrapper is starting on the host.
    Accepted,
    /// The execution finished (or its supervisor was interrupted); the report follows.
    Completed,
    /// The ID already had a marker: nothing new was started.
    AlreadyStarted,
}

/// How a dispatch ended, when the host answered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DispatchOutcome {
    /// The command ran under this ID. The report's state says how it ended (completed,
    /// timed out, cancelled, or interrupted); small outputs are inline.
    Completed(RunReport),
    /// The ID was already taken on the host: nothing ran now. This is the existing
    /// execution's status; attach to it with [`Executor::wait`].
    AlreadyStarted(StatusReport),
}

/// Runs commands on one host through the remote wrapper, over pooled SSH connections.
///
/// Every call is cancel-safe: dropping its future closes the channel it used. Dropping a
/// [`dispatch`](Executor::dispatch) after [`DispatchEvent::Sending`] leaves the outcome
/// unknown, as a lost connection would; the command, if it started, runs on.
pub struct Executor {
    pool: Pool,
    wrapper: RemoteWrapper,
    /// Serve channels waiting for their next request, most recently used last.
    idle_serves: Mutex<Vec<ServeChannel>>,
    /// Until when requests go on exec channels only: set when a serve worker exited before it
    /// was ready (the host cannot serve, or could not just then).
    serve_off_until: Mutex<Option<std::time::Instant>>,
    /// Serve workers being started now (see [`SERVE_STARTS_PER_CONNECTION`]).
    serve_starting: std::sync::atomic::AtomicUsize,
    /// What starting a serve worker has been taking on this host (a moving average): mostly
    /// its login, and the queue in front of it. It sets the start budget and how long a
    /// request waits for a worker before it takes an exec channel.
    worker_start_time: Mutex<Option<Duration>>,
    /// When a worker last became free or a start last ended: a request waiting for a worker
    /// falls back to an exec channel only when nothing moved for a while.
    serve_moved: Mutex<std::time::Instant>,
    /// Wakes requests waiting for a worker: one became idle or a start ended.
    serve_changed: tokio::sync::Notify,
}

impl Executor {
    /// An executor for one host. Connects lazily, on the first call.
    pub fn new(config: HostConfig) -> Result<Self, Error> {
        let remote_dir = RemoteDir::new(&config.remote_dir).map_err(|e| Error::InvalidRequest {
            host: config.name.clone(),
            message: e.to_string(),
        })?;
        let mut wrapper = RemoteWrapper::new(remote_dir);
        if let Some(identity) = &config.ledger_identity {
            wrapper = wrapper
                .with_ledger(identity)
                .map_err(|e| Error::InvalidRequest {
                    host: config.name.clone(),
                    message: e.to_string(),
                })?;
        }
        Ok(Executor {
            wrapper,
            pool: Pool::new(config),
            idle_serves: Mutex::new(Vec::new()),
            serve_off_until: Mutex::new(None),
            serve_starting: std::sync::atomic::AtomicUsize::new(0),
            worker_start_time: Mutex::new(None),
            serve_moved: Mutex::new(std::time::Instant::now()),
            serve_changed: tokio::sync::Notify::new(),
        })
    }

    /// The host's configuration.
    pub fn config(&self) -> &HostConfig {
        &self.pool.config
    }

    /// Number of live pooled connections.
    pub fn connection_count(&self) -> usize {
        self.pool.connection_count()
    }

    /// The channel limit each live connection works with: `max_sessions`, or what the server
    /// was found to allow where it refused a channel below that.
    pub fn channel_limits(&self) -> Vec<usize> {
        self.pool.channel_limits()
    }

    /// Forgets every pooled connection (calls in flight keep theirs until they finish).
    pub fn disconnect(&self) {
        self.pool.clear();
        self.idle_serves.lock().expect("serve lock").clear();
    }

    /// Number of serve channels waiting for a request (for tests and diagnostics).
    pub fn idle_serve_count(&self) -> usize {
        self.idle_serves.lock().expect("serve lock").len()
    }

    /// Opens a connection and makes sure the wrapper is installed, ahead of the first call.
    pub async fn connect(&self) -> Result<(), Error> {
        let channel = self.ready_channel().await?;
        drop(channel);
        Ok(())
    }

    /// Starts `request` under its execution ID and waits for it to end, in one round trip.
    ///
    /// `on_event` is called synchronously as the dispatch progresses (see
    /// [`DispatchEvent`]). Outcomes:
    /// - `Ok(Completed)`: it ran; the report says how it ended.
    /// - `Ok(AlreadyStarted)`: the host already had this ID; nothing ran again.
    /// - `Err(NotSent)`: it provably did not reach the host; retrying is safe.
    /// - `Err(Lost)`: it may have reached the host; ask [`status`](Executor::status).
    pub async fn dispatch(
        &self,
        request: &DispatchRequest,
        mut on_event: impl FnMut(&DispatchEvent) + Send,
    ) -> Result<DispatchOutcome, Error> {
        let options = StartOptions {
            timeout: request.timeout,
            kill_grace: None,
            cwd: request.cwd.clone(),
            env: request.env.clone(),
            secret_env: request.secret_env.clone(),
            secret_argv: request
                .secret_args
                .iter()
                .filter_map(|&i| request.argv.get(i).map(|v| (i, v.clone())))
                .collect(),
            stdin: request.stdin.is_some(),
            inline_max: request.inline_max,
        };
        let line = self
            .wrapper
            .run(&request.execution_id, &options, &request.argv)
            .map_err(|e| self.invalid(e))?;
        // Stdin and secrets need the channel's own stdin: those go on an exec channel.
        let served = options
            .servable()
            .then(|| {
                self.wrapper
                    .serve_run(&request.execution_id, &options, &request.argv)
            })
            .transpose()
            .map_err(|e| self.invalid(e))?;
        // Secret variables come first on stdin, then the command's own stdin.
        let mut stdin = RemoteWrapper::stdin_prefix(&options).map_err(|e| self.invalid(e))?;
        let stdin = match &request.stdin {
            Some(bytes) => {
                stdin.extend_from_slice(bytes);
                Some(stdin)
            }
            None if stdin.is_empty() => None,
            None => Some(stdin),
        };
        let deadline = request
            .timeout
            .map(|t| t + DEFAULT_KILL_GRACE + REPLY_SLACK);
        let reply = self
            .call(
                "run",
                Some(&request.execution_id),
                &line,
                served.as_deref(),
                stdin.as_deref(),
                deadline,
                &mut on_event,
            )
            .await?;
        match RunOutcome::parse(&reply) {
            Ok(RunOutcome::Ran(report)) => {
                on_event(&DispatchEvent::Completed);
                Ok(DispatchOutcome::Completed(report))
            }
            Ok(RunOutcome::Refused(refused)) => {
                on_event(&DispatchEvent::AlreadyStarted);
                Ok(DispatchOutcome::AlreadyStarted(refused.existing))
            }
            Err(e) => Err(self.wrapper_error("run", e)),
        }
    }

    /// What the host's marker says about `execution_id` (state `absent` if it never started
    /// there).
    pub async fn status(&self, execution_id: &str) -> Result<StatusReport, Error> {
        let line = self
            .wrapper
            .status(execution_id)
            .map_err(|e| self.invalid(e))?;
        let served = self
            .wrapper
            .serve_status_many(&[execution_id])
            .map_err(|e| self.invalid(e))?;
        let reply = self
            .call_read("status", Some(execution_id), &line, &served)
            .await?;
        StatusReport::parse(&reply).map_err(|e| self.wrapper_error("status", e))
    }

    /// The markers of many executions in one round trip: one report per ID, in order. Keep
    /// batches to a few hundred IDs (the command line carries them all).
    pub async fn status_many<S: AsRef<str>>(
        &self,
        execution_ids: &[S],
    ) -> Result<Vec<StatusReport>, Error> {
        let line = self
            .wrapper
            .status_many(execution_ids)
            .map_err(|e| self.invalid(e))?;
        let served = self
            .wrapper
            .serve_status_many(execution_ids)
            .map_err(|e| self.invalid(e))?;
        let reply = self.call_read("status", None, &line, &served).await?;
        StatusReport::parse_many(&reply, execution_ids).map_err(|e| self.wrapper_error("status", e))
    }

    /// Waits on the host up to `wait` for news of the executions in `known` (each with the
    /// sizes `[stdout, stderr]` the caller has): a report for each whose streams have other
    /// sizes now or that has ended, none when `wait` passed without news. The host looks a
    /// quarter second apart at first, then up to a second, by file times, so a quiet
    /// execution costs it a few `stat` calls a look and the caller nothing until there is
    /// news. Keep batches to a few hundred IDs.
    pub async fn watch<S: AsRef<str>>(
        &self,
        wait: Duration,
        known: &[(S, [u64; 2])],
    ) -> Result<Vec<WatchReport>, Error> {
        let line = self
            .wrapper
            .watch(wait, known)
            .map_err(|e| self.invalid(e))?;
        let served = self
            .wrapper
            .serve_watch(wait, known)
            .map_err(|e| self.invalid(e))?;
        let reply = self
            .call(
                "watch",
                None,
                &line,
                Some(&served),
                None,
                Some(wait + REPLY_SLACK),
                &mut |_| {},
            )
            .await?;
        let ids: Vec<&str> = known.iter().map(|(id, _)| id.as_ref()).collect();
        WatchReport::parse_many(&reply, &ids).map_err(|e| self.wrapper_error("watch", e))
    }

    /// Waits for an execution that is already under way to end, then reports as a dispatch
    /// does. The way back to a dispatch whose connection was lost.
    pub async fn wait(
        &self,
        execution_id: &str,
        inline_max: Option<u64>,
    ) -> Result<RunReport, Error> {
        let line = self
            .wrapper
            .wait(execution_id, inline_max)
            .map_err(|e| self.invalid(e))?;
        let reply = self.call_plain("wait", Some(execution_id), &line).await?;
        RunReport::parse(&reply).map_err(|e| self.wrapper_error("wait", e))
    }

    /// Up to `max` bytes of one output stream, from byte `offset`. Binary-safe; resumable.
    /// On a serve channel when the host serves (no session of its own); fewer bytes than the
    /// stream's size promised when it was cut shorter while the host read it.
    pub async fn output(
        &self,
        execution_id: &str,
        stream: Stream,
        offset: u64,
        max: u64,
    ) -> Result<OutputChunk, Error> {
        let line = self
            .wrapper
            .output(execution_id, stream, offset, max)
            .map_err(|e| self.invalid(e))?;
        let served = self
            .wrapper
            .serve_output(execution_id, stream, offset, max)
            .map_err(|e| self.invalid(e))?;
        let reply = self
            .call_read("output", Some(execution_id), &line, &served)
            .await?;
        OutputChunk::parse(&reply).map_err(|e| self.wrapper_error("output", e))
    }

    /// A whole output stream of a finished execution, read by offset in chunks of `chunk`
    /// bytes ([`DEFAULT_CHUNK`] if zero).
    pub async fn read_stream(
        &self,
        execution_id: &str,
        stream: Stream,
        chunk: u64,
    ) -> Result<Vec<u8>, Error> {
        let chunk = if chunk == 0 { DEFAULT_CHUNK } else { chunk };
        let mut data = Vec::new();
        loop {
            let piece = self
                .output(execution_id, stream, data.len() as u64, chunk)
                .await?;
            let done = piece.is_last() || piece.data.is_empty();
            data.extend_from_slice(&piece.data);
            if done {
                return Ok(data);
            }
        }
    }

    /// Ends the command's process group (SIGTERM, SIGKILL after `grace`) and returns the
    /// final status.
    pub async fn cancel(
        &self,
        execution_id: &str,
        grace: Option<Duration>,
    ) -> Result<StatusReport, Error> {
        let line = self
            .wrapper
            .cancel(execution_id, grace)
            .map_err(|e| self.invalid(e))?;
        let reply = self.call_plain("cancel", Some(execution_id), &line).await?;
        StatusReport::parse(&reply).map_err(|e| self.wrapper_error("cancel", e))
    }

    /// Removes the markers of executions that finished more than `older_than` ago. A removed
    /// marker no longer refuses its ID: collect only what the ledger already holds.
    pub async fn gc(&self, older_than: Duration) -> Result<GcReport, Error> {
        let line = self.wrapper.gc(older_than).map_err(|e| self.invalid(e))?;
        let reply = self.call_plain("gc", None, &line).await?;
        GcReport::parse(&reply).map_err(|e| self.wrapper_error("gc", e))
    }

    /// Runs one wrapper command line and returns what came back. Failures before the request
    /// is written are `NotSent`; after, `Lost`. A wrapper found missing (exit 69, which the
    /// command line returns before running anything) is reinstalled and the line re-sent once.
    ///
    /// `served`, the same request as a serve line, goes on a serve channel instead when the
    /// host serves; if a serve worker cannot start there, the exec line is used.
    #[allow(clippy::too_many_arguments)] // one request in its two spellings, and its context
    async fn call(
        &self,
        verb: &'static str,
        execution_id: Option<&str>,
        line: &str,
        served: Option<&str>,
        stdin: Option<&[u8]>,
        deadline: Option<Duration>,
        on_event: &mut (dyn FnMut(&DispatchEvent) + Send),
    ) -> Result<WrapperReply, Error> {
        if let Some(request) = served.filter(|_| self.serving()) {
            if let Some(reply) = self
                .serve_call(verb, execution_id, request, deadline, on_event)
                .await?
            {
                return Ok(reply);
            }
        }
        let mut reinstalled = false;
        loop {
            let channel = self.exec_channel().await?;
            let connection = channel.lease.connection.clone();
            let reply = channel
                .exec(line, stdin, deadline, |progress| {
                    on_event(&match progress {
                        ExecProgress::Sending => DispatchEvent::Sending,
                        ExecProgress::Accepted => DispatchEvent::Accepted,
                    })
                })
                .await
                .map_err(|failure| self.exec_failure(verb, execution_id, failure))
                .and_then(|output| self.reply(verb, execution_id, output));
            let reply = match reply {
                Err(e) if e.is_lost() => {
                    // Whatever lost the reply may still hold this connection: not for the
                    // next call. (Nothing is re-sent: the outcome stays unknown.)
                    self.pool.retire(&connection);
                    return Err(e);
                }
                other => other?,
            };
            if reply.exit_status == exit_status::NOT_INSTALLED && !reinstalled {
                // Someone removed the wrapper since this connection checked it.
                tracing::warn!(host = %self.config().name, "wrapper missing on the host; reinstalling");
                reinstalled = true;
                let channel = self.pool.open_channel().await?;
                self.install(channel).await?;
                continue;
            }
            return Ok(reply);
        }
    }

    /// [`call`](Executor::call) for a verb that reads (`served` on a serve channel when the
    /// host serves), without stdin, a deadline or events.
    async fn call_read(
        &self,
        verb: &'static str,
        execution_id: Option<&str>,
        line: &str,
        served: &str,
    ) -> Result<WrapperReply, Error> {
        self.call(
            verb,
            execution_id,
            line,
            Some(served),
            None,
            None,
            &mut |_| {},
        )
        .await
    }

    /// [`call`](Executor::call) for a verb that goes on an exec channel, without stdin, a
    /// deadline or events.
    async fn call_plain(
        &self,
        verb: &'static str,
        execution_id: Option<&str>,
        line: &str,
    ) -> Result<WrapperReply, Error> {
        self.call(verb, execution_id, line, None, None, None, &mut |_| {})
            .await
    }

    /// A channel for an exec. While idle serve channels hold slots, it takes a free slot on a
    /// connection the pool holds, closing the longest-idle serve channel (and waiting for the
    /// host's close) when none is free, rather than open a connection.
    async fn exec_channel(&self) -> Result<OpenChannel, Error> {
        loop {
            // Those on a retired connection, or idle too long, just go (their close is not
            // waited for: a host that lost a reply may never answer it).
            let none_idle = {
                let mut idle = self.idle_serves.lock().expect("serve lock");
                idle.retain(|s| self.serve_usable(s));
                idle.is_empty()
            };
            if none_idle {
                return self.ready_channel().await;
            }
            if let Some(channel) = self.pool.open_channel_held().await? {
                if channel.lease.connection.wrapper_ready.initialized() {
                    return Ok(channel);
                }
                drop(channel);
                return self.ready_channel().await;
            }
            let shed = {
                let mut idle = self.idle_serves.lock().expect("serve lock");
                (!idle.is_empty()).then(|| idle.remove(0))
            };
            if let Some(serve) = shed {
                serve.shut().await;
            }
        }
    }

    /// A channel on a connection whose wrapper has been checked (installing it if needed).
    async fn ready_channel(&self) -> Result<OpenChannel, Error> {
        loop {
            let channel = self.pool.open_channel().await?;
            let connection = channel.lease.connection.clone();
            if connection.wrapper_ready.initialized() {
                return Ok(channel);
            }
            // The first caller on a new connection installs with its own channel; others
            // wait here and then use theirs.
            let mut own = Some(channel);
            connection
                .wrapper_ready
                .get_or_try_init(|| {
                    let channel = own.take().expect("channel taken once");
                    self.install(channel)
                })
                .await?;
            if let Some(channel) = own {
                return Ok(channel);
            }
        }
    }

    fn reply(
        &self,
        verb: &'static str,
        execution_id: Option<&str>,
        output: RemoteOutput,
    ) -> Result<WrapperReply, Error> {
        match output.exit {
            RemoteExit::Code(code) => Ok(WrapperReply {
                exit_status: code,
                stdout: output.stdout,
                stderr: output.stderr,
            }),
            // The wrapper always exits with a status; anything else means it was cut short and
            // its reply cannot be trusted to be whole.
            RemoteExit::Signal(signal) => Err(self.lost(
                verb,
                execution_id,
                format!("the wrapper was killed by signal {signal}"),
            )),
            RemoteExit::Unreported => Err(self.lost(
                verb,
                execution_id,
                "the host closed the channel without an exit status".into(),
            )),
        }
    }

    fn exec_failure(
        &self,
        verb: &'static str,
        execution_id: Option<&str>,
        failure: ExecFailure,
    ) -> Error {
        match failure {
            ExecFailure::NotSent(e) => Error::NotSent(e),
            ExecFailure::Lost(reason) => self.lost(verb, execution_id, reason),
            ExecFailure::Oversized => Error::Wrapper {
                host: self.config().name.clone(),
                verb,
                message: format!(
                    "the reply exceeded {} bytes; ask for smaller output chunks",
                    crate::channel::REPLY_CAP
                ),
            },
        }
    }

    fn lost(&self, verb: &'static str, execution_id: Option<&str>, reason: String) -> Error {
        Error::Lost {
            host: self.config().name.clone(),
            verb,
            execution_id: execution_id.map(str::to_owned),
            reason,
        }
    }

    fn invalid(&self, e: WrapperError) -> Error {
        Error::InvalidRequest {
            host: self.config().name.clone(),
            message: e.to_string(),
        }
    }

    fn wrapper_error(&self, verb: &'static str, e: WrapperError) -> Error {
        match e {
            WrapperError::UnknownExecution { .. } => Error::UnknownExecution {
                host: self.config().name.clone(),
                verb,
            },
            other => Error::Wrapper {
                host: self.config().name.clone(),
                verb,
                message: other.to_string(),
            },
        }
    }
}
