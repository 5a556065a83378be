//! The executor: runs wrapper verbs on one host over the pooled connections.

use std::sync::atomic::Ordering;
use std::sync::Mutex;
use std::time::Duration;

use crate::channel::{ExecFailure, ExecProgress, OpenChannel, RemoteExit, RemoteOutput};
use crate::config::HostConfig;
use crate::error::{ConnectError, Error};
use crate::pool::Pool;
use crate::serve::{RequestFailure, ServeChannel, StartFailure};
use crate::wrapper::{
    exit_status, GcReport, InstallOutcome, OutputChunk, RemoteDir, RemoteWrapper, RunOutcome,
    RunReport, StartOptions, StatusReport, Stream, WatchReport, WrapperError, WrapperReply,
    WRAPPER_SCRIPT,
};

/// Slack added to a dispatch's host-side timeout (and kill grace) before the client gives up
/// waiting for the reply: the wrapper drains the process group for up to a few seconds more.
const REPLY_SLACK: Duration = Duration::from_secs(15);

/// Default SIGTERM→SIGKILL grace of the wrapper, used to bound the wait for a reply.
const DEFAULT_KILL_GRACE: Duration = Duration::from_secs(5);

/// An idle serve channel unused this long is closed rather than reused.
const SERVE_IDLE_MAX: Duration = Duration::from_secs(60);

/// A serve channel idle longer than this is checked with a ping before a request leaves on it.
const SERVE_FRESH: Duration = Duration::from_secs(1);

/// After a serve worker failed to start on a host, how long its requests go on exec channels
/// before serving is tried again.
const SERVE_RETRY: Duration = Duration::from_secs(60);

/// Serve workers starting at once, per live connection (at least this many on a host). Each
/// start is a login on the host; where logins queue behind a host-wide lock, starting more at
/// once only lengthens every start, while a worker that is up serves the requests waiting.
const SERVE_STARTS_PER_CONNECTION: usize = 4;

/// Shortest wait for a serve worker before a request takes an exec channel instead.
const SERVE_PATIENCE_MIN: Duration = Duration::from_secs(1);

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

    /// Whether requests go on serve channels: configured, a connection has room to keep one
    /// idle beside exec channels, and no worker failed to start on this host.
    fn serving(&self) -> bool {
        self.config().serve
            && self.idle_serve_cap() > 0
            && self
                .serve_off_until
                .lock()
                .expect("serve lock")
                .is_none_or(|until| std::time::Instant::now() >= until)
    }

    /// Idle serve channels kept per connection: all its slots but one, so an exec channel
    /// finds room at once (more execs at once close idle serve channels: see `exec_channel`).
    fn idle_serve_cap(&self) -> usize {
        self.config().max_sessions.saturating_sub(1)
    }

    /// Sends `request` on a serve channel. `Ok(None)`: no serve worker could start, nothing
    /// was sent; use an exec channel.
    async fn serve_call(
        &self,
        verb: &'static str,
        execution_id: Option<&str>,
        request: &str,
        deadline: Option<Duration>,
        on_event: &mut (dyn FnMut(&DispatchEvent) + Send),
    ) -> Result<Option<WrapperReply>, Error> {
        let Some(mut serve) = self.take_serve().await? else {
            return Ok(None);
        };
        let connection = serve.connection().clone();
        let mut on_progress = |progress| {
            on_event(&match progress {
                ExecProgress::Sending => DispatchEvent::Sending,
                ExecProgress::Accepted => DispatchEvent::Accepted,
            })
        };
        match serve.request(request, deadline, &mut on_progress).await {
            Ok((reply, reusable)) => {
                if reusable {
                    self.put_serve(serve);
                } else {
                    tracing::warn!(host = %self.config().name, "bytes after a serve reply; closing that channel");
                }
                Ok(Some(reply))
            }
            Err(RequestFailure::NotSent(e)) => Err(Error::NotSent(e)),
            Err(RequestFailure::Lost(reason)) => {
                // As for an exec: whatever lost the reply may still hold this connection.
                self.pool.retire(&connection);
                Err(self.lost(verb, execution_id, reason))
            }
            Err(RequestFailure::Oversized) => {
                Err(self.exec_failure(verb, execution_id, ExecFailure::Oversized))
            }
        }
    }

    /// An idle serve channel that is still sound, or a new one. `Ok(None)`: no worker is ready
    /// for this request and none could start soon (wrapper missing, the host cannot serve, a
    /// start slower than its budget, or no worker came free for a while): nothing was sent,
    /// so the request takes an exec channel. The host's marker refuses a second start of an
    /// ID whichever channel carries it, so the choice never changes what runs.
    ///
    /// Starts are limited per connection ([`SERVE_STARTS_PER_CONNECTION`]); a request that
    /// finds every start slot taken waits for a worker to come free or a slot to open, as
    /// long as something moves.
    async fn take_serve(&self) -> Result<Option<ServeChannel>, Error> {
        let waiting_since = std::time::Instant::now();
        loop {
            // Registered before looking, so a change between the look and the wait is heard.
            let changed = self.serve_changed.notified();
            let mut changed = std::pin::pin!(changed);
            changed.as_mut().enable();
            if let Some(serve) = self.idle_serve().await {
                return Ok(Some(serve));
            }
            if !self.serving() {
                return Ok(None);
            }
            match self.start_serve().await? {
                Start::Ready(serve) => return Ok(Some(serve)),
                Start::Unavailable => return Ok(None),
                Start::Busy => {}
            }
            let patience = self.serve_patience();
            let moved = self.serve_moved.lock().expect("serve lock").elapsed();
            let still = moved.min(waiting_since.elapsed());
            let Some(left) = patience.checked_sub(still).filter(|l| !l.is_zero()) else {
                tracing::debug!(
                    host = %self.config().name,
                    "no serve worker came free in {patience:?}; using an exec channel"
                );
                return Ok(None);
            };
            let _ = tokio::time::timeout(left, changed).await;
        }
    }

    /// An idle serve channel that is still sound, if any.
    async fn idle_serve(&self) -> Option<ServeChannel> {
        loop {
            let mut serve = self.idle_serves.lock().expect("serve lock").pop()?;
            if self.serve_usable(&serve)
                && serve.is_quiet().await
                && self.still_heard(&mut serve).await
            {
                return Some(serve);
            }
            // Dropped: the channel closes.
        }
    }

    /// Starts a serve worker, if a start slot is free.
    async fn start_serve(&self) -> Result<Start, Error> {
        let limit = SERVE_STARTS_PER_CONNECTION * self.pool.connection_count().max(1);
        let claimed = self
            .serve_starting
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < limit).then_some(n + 1)
            });
        if claimed.is_err() {
            return Ok(Start::Busy);
        }
        // Frees the slot however this ends, a dropped call included.
        let _slot = StartSlot(self);
        let channel = self.ready_channel().await?;
        let command = self.wrapper.serve().map_err(|e| self.invalid(e))?;
        let budget = self.start_budget();
        let connection = channel.lease.connection.clone();
        let began = std::time::Instant::now();
        match ServeChannel::start(channel, &command, budget).await {
            Ok(serve) => {
                self.learn_start_time(began.elapsed());
                Ok(Start::Ready(serve))
            }
            Err(StartFailure::Slow) => {
                // The host is slow to log in, not gone: the connection stays (its pings
                // tell if it dies), and this request takes an exec channel on it.
                self.learn_start_time(began.elapsed());
                tracing::info!(
                    host = %self.config().name,
                    serial = connection.serial,
                    "a serve worker was not ready within {budget:?}; this request takes an \
                     exec channel"
                );
                Ok(Start::Unavailable)
            }
            Err(StartFailure::NotSent(e)) => {
                // The channel was refused or the connection ended: not for the next call.
                self.pool.retire(&connection);
                Err(Error::NotSent(e))
            }
            Err(StartFailure::Ended {
                exit: RemoteExit::Code(exit_status::NOT_INSTALLED),
                ..
            }) => Ok(Start::Unavailable),
            Err(StartFailure::Ended { exit, detail }) => {
                tracing::warn!(
                    host = %self.config().name,
                    "the wrapper's serve worker did not start ({exit:?}: {detail}); using exec \
                     channels for {SERVE_RETRY:?}"
                );
                *self.serve_off_until.lock().expect("serve lock") =
                    Some(std::time::Instant::now() + SERVE_RETRY);
                Ok(Start::Unavailable)
            }
        }
    }

    /// How long a worker start (or a wrapper install, also a login) may take before it is
    /// given up: the connect and drop-detection budgets, or four times what starts have been
    /// taking on this host when that is longer, so a host whose logins queue is not failed by
    /// a fixed bound.
    fn start_budget(&self) -> Duration {
        let base = self.config().connect_timeout + self.config().drop_detection_budget();
        let learned = self
            .worker_start_time
            .lock()
            .expect("serve lock")
            .map(|t| t * 4);
        learned.map_or(base, |l| l.clamp(base, base * 4))
    }

    /// How long a request waits, with nothing moving, for a worker before it takes an exec
    /// channel: twice a start's usual time (an exec costs a login too), at least
    /// [`SERVE_PATIENCE_MIN`]; the start budget until a start was seen.
    fn serve_patience(&self) -> Duration {
        let learned = *self.worker_start_time.lock().expect("serve lock");
        match learned {
            Some(t) => (t * 2).clamp(SERVE_PATIENCE_MIN, self.start_budget()),
            None => self.start_budget(),
        }
    }

    fn learn_start_time(&self, took: Duration) {
        let mut learned = self.worker_start_time.lock().expect("serve lock");
        *learned = Some(match *learned {
            Some(t) => (t * 3 + took) / 4,
            None => took,
        });
    }

    /// Something a waiting request may use: a worker came free or a start slot opened.
    fn serve_moved(&self) {
        *self.serve_moved.lock().expect("serve lock") = std::time::Instant::now();
        self.serve_changed.notify_waiters();
    }

    /// Whether the host still hears the connection of `serve`, idle since `idle_since`. A
    /// request written on a link that died while the channel sat idle could only be `Lost`;
    /// an exec channel's open was a round trip that turned that into `NotSent`. So a channel
    /// idle past [`SERVE_FRESH`] costs one ping first, whose answer also brings whatever the
    /// channel said before it (a worker that ended is seen, not written to). A ping that goes
    /// unanswered retires the connection.
    async fn still_heard(&self, serve: &mut ServeChannel) -> bool {
        if serve.idle_since.elapsed() < SERVE_FRESH {
            return true;
        }
        let config = self.config();
        let connection = serve.connection().clone();
        match tokio::time::timeout(config.ping_patience(), connection.handle.send_ping()).await {
            Ok(Ok(())) => serve.is_quiet().await,
            _ => {
                tracing::debug!(
                    host = %config.name,
                    serial = connection.serial,
                    "an idle serve channel's connection did not answer a ping; retiring it"
                );
                self.pool.retire(&connection);
                false
            }
        }
    }

    fn serve_usable(&self, serve: &ServeChannel) -> bool {
        serve.idle_since.elapsed() < SERVE_IDLE_MAX && self.pool.holds(serve.connection())
    }

    /// Keeps `serve` for the next request, unless its connection already keeps all its
    /// channel slots but one idle this way (an exec channel needs that one).
    fn put_serve(&self, mut serve: ServeChannel) {
        let mut idle = self.idle_serves.lock().expect("serve lock");
        idle.retain(|s| self.serve_usable(s));
        // All but one of the slots the connection is known to have: `max_sessions`, or what
        // the server's refusals showed (the limit starts there and only goes down).
        let cap = serve
            .connection()
            .channel_limit
            .load(Ordering::Acquire)
            .saturating_sub(1);
        let on_this = idle
            .iter()
            .filter(|s| std::sync::Arc::ptr_eq(s.connection(), serve.connection()))
            .count();
        if on_this < cap && self.pool.holds(serve.connection()) {
            serve.idle_since = std::time::Instant::now();
            idle.push(serve);
        }
        drop(idle);
        self.serve_moved();
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

    /// Sends the wrapper script to the install command, which keeps an existing copy whose
    /// sha256 matches and otherwise writes and verifies a new one.
    async fn install(&self, channel: OpenChannel) -> Result<(), Error> {
        let host = &self.config().name;
        let serial = channel.lease.connection.serial;
        let command = self.wrapper.install_command();
        let failed = |reason: String| {
            Error::NotSent(ConnectError::WrapperInstall {
                host: host.clone(),
                reason,
            })
        };
        let connection = channel.lease.connection.clone();
        // An install that did not end cleanly leaves the connection in an unknown state (the
        // host's install shell may still wait for the script): the next call must not find it
        // in the pool, unready, and install on it again.
        let abandon = |reason: String| {
            self.pool.retire(&connection);
            failed(reason)
        };
        let output = channel
            .exec(
                &command,
                Some(WRAPPER_SCRIPT.as_bytes()),
                Some(self.start_budget()),
                |_| {},
            )
            .await
            .map_err(|failure| match failure {
                ExecFailure::NotSent(e) => Error::NotSent(e),
                ExecFailure::Lost(reason) => abandon(format!("connection lost: {reason}")),
                ExecFailure::Oversized => failed("oversized reply".into()),
            })?;
        let reply = match output.exit {
            RemoteExit::Code(code) => WrapperReply {
                exit_status: code,
                stdout: output.stdout,
                stderr: output.stderr,
            },
            other => return Err(abandon(format!("the install command ended with {other:?}"))),
        };
        match InstallOutcome::parse(&reply) {
            Ok(outcome) => {
                tracing::debug!(host = %host, serial, ?outcome, "wrapper ready");
                Ok(())
            }
            Err(WrapperError::OtherLedger { ledger }) => {
                Err(Error::NotSent(ConnectError::OtherLedger {
                    host: host.clone(),
                    theirs: ledger,
                    ours: self.config().ledger_identity.clone().unwrap_or_default(),
                }))
            }
            Err(e) => Err(failed(e.to_string())),
        }
    }

    /// Makes this daemon's ledger the owner of the host's markers, whatever ledger owned
    /// them (`waymark hosts adopt`); returns the one recorded before (`None`: none was).
    pub async fn adopt(&self) -> Result<Option<String>, Error> {
        let host = &self.config().name;
        let command = self
            .wrapper
            .adopt_command()
            .ok_or_else(|| Error::InvalidRequest {
                host: host.clone(),
                message: "this daemon has no ledger identity to record".into(),
            })?;
        let channel = self.pool.open_channel().await?;
        let output = channel
            .exec(&command, None, Some(self.start_budget()), |_| {})
            .await
            .map_err(|failure| match failure {
                ExecFailure::NotSent(e) => Error::NotSent(e),
                ExecFailure::Lost(reason) => Error::Lost {
                    host: host.clone(),
                    verb: "adopt",
                    execution_id: None,
                    reason,
                },
                ExecFailure::Oversized => Error::Wrapper {
                    host: host.clone(),
                    verb: "adopt",
                    message: "oversized reply".into(),
                },
            })?;
        let text = String::from_utf8_lossy(&output.stdout);
        match (&output.exit, text.trim().strip_prefix("waymark-adopt/1 ")) {
            (RemoteExit::Code(0), Some("-")) => Ok(None),
            (RemoteExit::Code(0), Some(previous)) => Ok(Some(previous.to_string())),
            (exit, _) => Err(Error::Wrapper {
                host: host.clone(),
                verb: "adopt",
                message: format!(
                    "the adopt command ended with {exit:?}: {}{}",
                    text.trim(),
                    String::from_utf8_lossy(&output.stderr).trim()
                ),
            }),
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

/// What [`Executor::start_serve`] came to.
enum Start {
    /// A worker is ready for the request.
    Ready(ServeChannel),
    /// No worker: the request takes an exec channel.
    Unavailable,
    /// Every start slot is taken: wait for a worker or a slot.
    Busy,
}

/// One claimed start slot of an executor; released, and waiting requests told, when dropped.
struct StartSlot<'a>(&'a Executor);

impl Drop for StartSlot<'_> {
    fn drop(&mut self) {
        self.0.serve_starting.fetch_sub(1, Ordering::AcqRel);
        self.0.serve_moved();
    }
}
