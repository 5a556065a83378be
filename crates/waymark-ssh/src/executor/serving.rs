//! The serve channels of one executor: which requests they carry, the idle ones kept for
//! reuse, and how workers start (a few at a time per connection, within a budget learned from
//! the host's login times).

#[allow(clippy::wildcard_imports)]
use super::*;

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

impl Executor {
    /// Whether requests go on serve channels: configured, a connection has room to keep one
    /// idle beside exec channels, and no worker failed to start on this host.
    pub(super) fn serving(&self) -> bool {
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
    pub(super) async fn serve_call(
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
    pub(super) fn start_budget(&self) -> Duration {
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

    pub(super) fn serve_usable(&self, serve: &ServeChannel) -> bool {
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
