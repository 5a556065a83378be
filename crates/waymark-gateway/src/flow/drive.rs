//! Driving: one driver per execution moves it on, sends it, and streams its output.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use tokio::sync::watch;
use waymark_core::{AttachAction, ExecState, ExecutionId, Transition};
use waymark_ledger::{ExecutionRecord, LedgerApi, LedgerFuture};

use crate::config::HostEntry;
use crate::host::{HostExecutor, Stream};
use crate::tools::ResolvedCall;

use super::policy::Admit;
use super::{now, CallEvent, CallEvents, CallOutcome, Gateway, GatewayError, Inflight, FLUSHED};

/// The pause after a read that found output, before the call asks for news again: a command
/// that writes all the time is read about three times a second, not once per round trip.
const OUTPUT_PAUSE: Duration = Duration::from_millis(300);
/// The pause after a watch that failed (the host unreachable, say), before the next.
const OUTPUT_RETRY: Duration = Duration::from_millis(2400);
/// The grid every pause ends on: the asks of calls that paused apart fall in one batch of the
/// output watch.
const LOOK_GRID: Duration = Duration::from_millis(100);

/// Sleeps `d`, to the next [`LOOK_GRID`] point after it.
async fn pause(d: Duration) {
    tokio::time::sleep_until(on_look_grid(tokio::time::Instant::now() + d)).await;
}

/// The first point of the process-wide [`LOOK_GRID`] at or after `t`.
fn on_look_grid(t: tokio::time::Instant) -> tokio::time::Instant {
    static BASE: std::sync::OnceLock<tokio::time::Instant> = std::sync::OnceLock::new();
    let base = *BASE.get_or_init(tokio::time::Instant::now);
    let grid = LOOK_GRID.as_nanos();
    let steps = t.saturating_duration_since(base).as_nanos().div_ceil(grid);
    base + Duration::from_nanos((steps * grid) as u64)
}

/// Largest read of one look; a look keeps reading while reads come back full.
const OUTPUT_CHUNK: u64 = 256 * 1024;

/// How long past the tool's timeout a call follows an execution another daemon drives.
const FOLLOW_MARGIN: Duration = Duration::from_secs(5);
/// How often a call following another daemon's execution reads the ledger.
const FOLLOW_POLL: Duration = Duration::from_millis(100);

/// Where a driver starts from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Start {
    /// This call has just recorded the execution's first dispatch itself (flushed), and nothing
    /// was sent since: send it.
    JustDispatched,
    /// Wherever the ledger stands: a dispatched execution is asked about at its marker before
    /// anything is sent again.
    AsRecorded,
}

/// A driver's place in the in-flight map, given up however the driver ends: with an outcome,
/// an error, or its task stopped halfway (a panic, an abort). A call never joins a driver that
/// is gone; it gets [`GatewayError::DriverEnded`] if it joined before, and drives after.
///
/// On a shared ledger the driver's lease goes with it when the execution is unresolved
/// ([`LedgerApi::let_go`]): given up under the in-flight map's lock, so no other task of this
/// daemon drives under it meanwhile, and told to the ledger in a task of its own, so the next
/// call on any daemon adopts the execution instead of following a lease nobody drives.
struct Driving<'a> {
    inflight: &'a Mutex<HashMap<ExecutionId, Inflight>>,
    ledger: &'a dyn LedgerApi,
    id: ExecutionId,
}

impl Drop for Driving<'_> {
    fn drop(&mut self) {
        let release = match self.inflight.lock() {
            Ok(mut m) => {
                m.remove(&self.id);
                self.ledger.let_go(self.id)
            }
            Err(_) => None,
        };
        if let Some(release) = release {
            spawn_release(self.id, release);
        }
    }
}

/// Runs a lease's release ([`LedgerApi::let_go`]) on its own: a release that fails leaves the
/// lease with this daemon, whose next run (or a daemon taking over from it) has it back.
fn spawn_release(id: ExecutionId, release: LedgerFuture<'static, ()>) {
    if let Ok(rt) = tokio::runtime::Handle::try_current() {
        rt.spawn(async move {
            if let Err(e) = release.await {
                tracing::warn!(%id, error = %e, "could not let go of an execution's lease");
            }
        });
    }
}

impl<E: HostExecutor> Gateway<E> {
    /// Drives an execution to an outcome, unless another task of this process already drives
    /// it: then waits for that task's outcome. One driver per execution at a time, so two
    /// racing calls can never both authorize or both send it.
    pub(super) async fn drive(
        &self,
        id: ExecutionId,
        attached: Option<AttachAction>,
        call: &ResolvedCall,
        run: Option<&str>,
        events: &dyn CallEvents,
        start: Start,
    ) -> Result<CallOutcome, GatewayError> {
        let (tx, rx) = watch::channel(None);
        let existing = {
            let mut m = self.inflight.lock().expect("inflight");
            match m.get(&id) {
                Some(other) => Some(other.clone()),
                None => {
                    m.insert(id, rx);
                    None
                }
            }
        };
        if let Some(other) = existing {
            return self.wait_inflight(id, other, attached).await;
        }
        let driving = Driving {
            inflight: &self.inflight,
            ledger: self.ledger.as_ref(),
            id,
        };
        let result = self.advance(id, call, run, events, start).await;
        drop(driving);
        if let Ok(o) = &result {
            let _ = tx.send(Some(o.clone()));
        }
        result.map(|o| CallOutcome { attached, ..o })
    }

    /// Moves an execution on from wherever it stands now (read fresh from the ledger): policy,
    /// approval, dispatch, or a marker check and a wait.
    async fn advance(
        &self,
        id: ExecutionId,
        call: &ResolvedCall,
        run: Option<&str>,
        events: &dyn CallEvents,
        start: Start,
    ) -> Result<CallOutcome, GatewayError> {
        let mut rec = self.get_or_adopt(id).await?;
        if !self.ledger.drives(&rec) {
            // Another daemon sharing the ledger drives it: follow it there, unless this one
            // takes it over meanwhile (its owner died or let it go); then go on from where it
            // stands.
            rec = self
                .follow_with_output(rec, call.timeout + FOLLOW_MARGIN, events)
                .await?;
            if !self.ledger.drives(&rec) {
                return self.outcome(rec, None).await;
            }
        }
        if rec.state() == ExecState::Accepted {
            rec = self.admit(rec, call, run, Admit::Authorize).await?;
        }
        if rec.state() == ExecState::AwaitingApproval {
            rec = self.settle_approval(rec, call, run, events).await?;
        }
        match rec.state() {
            ExecState::Authorized => self.dispatch_inner(rec, call, events).await,
            ExecState::Dispatched
                if start == Start::JustDispatched && rec.dispatch_attempts == 1 =>
            {
                self.send(rec, call, events).await
            }
            ExecState::Dispatched | ExecState::Unknown | ExecState::Running => {
                self.driver(&rec)?.recover(self, rec, call, events).await
            }
            _ => self.outcome(rec, None).await,
        }
    }

    /// Reads the shared ledger until the execution another daemon drives has its result (or
    /// is final), this daemon took it over (its driver died, or let it go: then it is adopted
    /// here), or `bound` passed: live state across daemons is the ledger, polled.
    pub(super) async fn follow(
        &self,
        mut rec: ExecutionRecord,
        bound: Duration,
    ) -> Result<ExecutionRecord, GatewayError> {
        let deadline = tokio::time::Instant::now() + bound;
        while !rec.state().is_final()
            && !rec.lifecycle.result_observed
            && !self.ledger.drives(&rec)
            && tokio::time::Instant::now() < deadline
        {
            tokio::time::sleep(FOLLOW_POLL).await;
            rec = self.get_or_adopt(rec.id).await?;
        }
        Ok(rec)
    }

    /// [`Gateway::follow`], and meanwhile, when `events` wants output, the command's output as
    /// the host's marker grows, read by this daemon (the same reads a driver makes), so a call
    /// attached on this daemon sees it live whoever drives the execution.
    async fn follow_with_output(
        &self,
        rec: ExecutionRecord,
        bound: Duration,
        events: &dyn CallEvents,
    ) -> Result<ExecutionRecord, GatewayError> {
        let watch = if events.wants_output() {
            self.driver(&rec)?.watch_output(self, &rec, events)?
        } else {
            None
        };
        let Some(watch) = watch else {
            return self.follow(rec, bound).await;
        };
        tokio::select! {
            r = self.follow(rec, bound) => r,
            never = watch => match never {},
        }
    }

    /// Streams the command's output to `events` while it runs: waits for news of the
    /// execution's streams on the host (batched with every other streaming call on the host,
    /// see `output_watch`: the host says when a stream grew), reads only a stream that grew,
    /// masks each piece and tells it to `events` at its offset, then pauses [`OUTPUT_PAUSE`]
    /// before it asks again. The first ask comes after that pause too. Runs beside whatever
    /// ends the execution, which drops it.
    pub(super) async fn stream_output(
        &self,
        host: &HostEntry,
        id: ExecutionId,
        events: &dyn CallEvents,
    ) -> std::convert::Infallible {
        let mut offsets = [0u64; 2];
        // A command that ends within the first pause is never watched: its reply carries it.
        pause(OUTPUT_PAUSE).await;
        loop {
            let news = match self.output_watch.news(&self.exec, host, id, offsets).await {
                Ok(Some(news)) => news,
                // The watch ran out without news: ask again.
                Ok(None) => continue,
                // Errors are fine here: the next watch asks again.
                Err(_) => {
                    pause(OUTPUT_RETRY).await;
                    continue;
                }
            };
            for ((stream, offset), size) in Stream::BOTH
                .into_iter()
                .zip(offsets.iter_mut())
                .zip(news.sizes)
            {
                if size <= *offset {
                    continue;
                }
                // Read again the bytes before the offset that a secret cut at it may have
                // begun in (see `mask`).
                let behind = (*offset).min(self.secrets.look_behind(id));
                // Errors are fine here: the next news says the stream is still ahead.
                while let Ok((mut bytes, _)) = self
                    .exec
                    .read_output(host, id, stream, *offset - behind, OUTPUT_CHUNK + behind)
                    .await
                {
                    if bytes.len() as u64 <= behind {
                        break;
                    }
                    // Same length masked: offsets stay the host's.
                    self.secrets
                        .mask_piece(id, &mut bytes, behind as usize, true);
                    events.event(CallEvent::Output {
                        stream,
                        offset: *offset,
                        bytes: &bytes,
                    });
                    *offset += bytes.len() as u64;
                    if (bytes.len() as u64) < OUTPUT_CHUNK {
                        break;
                    }
                }
            }
            if news.ended && offsets.iter().zip(news.sizes).all(|(o, s)| *o >= s) {
                // All of it is told; the dispatch's own reply ends the call.
                return std::future::pending().await;
            }
            pause(OUTPUT_PAUSE).await;
        }
    }

    /// Records the execution's dispatch (flushed) and sends it through its channel's driver.
    pub(super) async fn dispatch_inner(
        &self,
        rec: ExecutionRecord,
        call: &ResolvedCall,
        events: &dyn CallEvents,
    ) -> Result<CallOutcome, GatewayError> {
        // A channel this process cannot drive is refused before its dispatch is recorded.
        self.driver(&rec)?;
        let attempt = rec.dispatch_attempts + 1;
        // Durable BEFORE the first byte leaves.
        let rec = self
            .ledger
            .transition(rec.id, Transition::Dispatch { attempt }, now(), FLUSHED)
            .await?;
        self.send(rec, call, events).await
    }

    /// Sends an execution whose dispatch is already recorded (and flushed) through its
    /// channel's driver, which records what came back.
    async fn send(
        &self,
        rec: ExecutionRecord,
        call: &ResolvedCall,
        events: &dyn CallEvents,
    ) -> Result<CallOutcome, GatewayError> {
        let driver = self.driver(&rec)?;
        self.crash_point("dispatched");
        let o = driver.send(self, rec, call, events).await?;
        if o.record.lifecycle.result_observed {
            self.crash_point("completed");
        }
        Ok(o)
    }

    async fn wait_inflight(
        &self,
        id: ExecutionId,
        mut rx: Inflight,
        attached: Option<AttachAction>,
    ) -> Result<CallOutcome, GatewayError> {
        let done = rx
            .wait_for(|v| v.is_some())
            .await
            .ok()
            .and_then(|v| v.clone());
        match done {
            Some(o) => Ok(CallOutcome { attached, ..o }),
            None => Err(GatewayError::DriverEnded { id }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{Config, DefaultPaths};
    use crate::flow::output_watch::tests::ids;
    use crate::flow::test_host::{host, Held, TestHost};
    use std::sync::Arc;

    /// A gateway on a real ledger in `dir` whose test host holds one execution, as `held`.
    fn one_execution(
        dir: &std::path::Path,
        held: Held,
    ) -> (Gateway<TestHost>, Arc<TestHost>, ExecutionId) {
        let exec = Arc::new(TestHost::default());
        let id = ids(1)[0];
        exec.hold(id, held);
        let text = format!("[ledger]\npath = \"{}\"\n", dir.join("ledger").display());
        let defaults = DefaultPaths::from_env(|_| None, 0);
        let config = Config::parse(std::path::Path::new("t.toml"), &text, &defaults).unwrap();
        let ledger = waymark_ledger::Ledger::init(&config.ledger_path).unwrap();
        let g = Gateway::new(Arc::new(config), Arc::new(ledger), exec.clone());
        (g, exec, id)
    }

    /// Output events as told: stream, offset, bytes.
    type Told = Mutex<Vec<(Stream, u64, Vec<u8>)>>;

    fn sink(told: &Told) -> impl Fn(CallEvent<'_>) + Send + Sync + '_ {
        move |e| {
            if let CallEvent::Output {
                stream,
                offset,
                bytes,
            } = e
            {
                told.lock().unwrap().push((stream, offset, bytes.to_vec()));
            }
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_stream_asks_no_more_once_the_host_said_it_ended_and_all_of_it_is_read() {
        let dir = tempfile::tempdir().unwrap();
        let (g, exec, id) = one_execution(dir.path(), Held::new(b"hello\n", b"oops", true));
        let told = Told::default();
        let events = sink(&told);
        // It never returns by itself: whatever ends the execution drops it.
        let ran = tokio::time::timeout(
            Duration::from_secs(60),
            g.stream_output(&host("h1"), id, &events),
        )
        .await;
        assert!(ran.is_err());
        assert_eq!(
            *told.lock().unwrap(),
            vec![
                (Stream::Stdout, 0, b"hello\n".to_vec()),
                (Stream::Stderr, 0, b"oops".to_vec())
            ]
        );
        assert_eq!(
            exec.watches.lock().unwrap().len(),
            1,
            "asked again after the end"
        );
        assert_eq!(exec.reads.lock().unwrap().len(), 2);
    }

    #[tokio::test(start_paused = true)]
    async fn a_stream_asks_first_after_a_pause_and_pauses_after_each_read() {
        let dir = tempfile::tempdir().unwrap();
        let (g, exec, id) = one_execution(dir.path(), Held::new(b"a", b"", false));
        let told = Told::default();
        let events = sink(&told);
        let start = tokio::time::Instant::now();
        let host_exec = exec.clone();
        // The command writes again after a second, and ends after two.
        let writer = async move {
            tokio::time::sleep(Duration::from_secs(1)).await;
            host_exec.hold(id, Held::new(b"ab", b"", false));
            tokio::time::sleep(Duration::from_secs(1)).await;
            host_exec.hold(id, Held::new(b"ab", b"", true));
            std::future::pending::<()>().await
        };
        let h1 = host("h1");
        let ran = tokio::time::timeout(Duration::from_secs(60), async {
            tokio::select! {
                never = g.stream_output(&h1, id, &events) => match never {},
                () = writer => {}
            }
        })
        .await;
        assert!(ran.is_err());
        assert_eq!(
            *told.lock().unwrap(),
            vec![
                (Stream::Stdout, 0, b"a".to_vec()),
                (Stream::Stdout, 1, b"b".to_vec())
            ]
        );
        let watches: Vec<_> = exec
            .watches
            .lock()
            .unwrap()
            .iter()
            .map(|(at, _)| *at)
            .collect();
        let reads: Vec<_> = exec.reads.lock().unwrap().iter().map(|r| r.0).collect();
        assert_eq!(reads.len(), 2, "{reads:?}");
        assert!(
            watches[0] >= start + OUTPUT_PAUSE,
            "the first ask came before the pause"
        );
        // The ask after the first read (of what the first ask found) waits out the pause.
        assert!(
            watches[1] >= reads[0] + OUTPUT_PAUSE,
            "asked {:?} after a read",
            watches[1] - reads[0]
        );
        // The asks stopped at the end: one found "a", one ran out, one found "b" and the end.
        assert_eq!(watches.len(), 3, "{watches:?}");
    }

    #[tokio::test]
    async fn looks_of_calls_that_started_apart_land_on_one_grid_point() {
        let now = tokio::time::Instant::now();
        let base = on_look_grid(now);
        assert!(base >= now && base - now <= LOOK_GRID);
        // Two calls 30 ms apart, each pausing 300 ms, look at the same moment.
        let (a, b) = (
            base + Duration::from_millis(5),
            base + Duration::from_millis(35),
        );
        assert_eq!(
            on_look_grid(a + OUTPUT_PAUSE),
            on_look_grid(b + OUTPUT_PAUSE)
        );
        assert_eq!(on_look_grid(a + OUTPUT_PAUSE), base + 4 * LOOK_GRID);
        // A point on the grid stays where it is.
        assert_eq!(on_look_grid(base + LOOK_GRID), base + LOOK_GRID);
    }
}
