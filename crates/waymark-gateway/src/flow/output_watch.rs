//! Watching output: one wait on the host for the streams of every call streaming from it.
//!
//! A call that streams its command's output asks for news of its execution: the sizes of its
//! streams once they differ from what the call has read, or its end. The asks of every call on
//! one host that come within [`GATHER`] of the first go to the host as one
//! [`HostExecutor::watch_output`] (a wrapper `watch` of up to [`WATCH_BATCH`] executions),
//! which waits on the host until one of them has news or the wait runs out. So a thousand calls
//! whose commands stay quiet cost the daemon a handful of requests per [`WATCH_GRID`], not a
//! look each every few seconds; the host looks at its own files (a few `stat` calls per
//! execution a quarter second) and says when there is something to read.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tokio::sync::oneshot;
use waymark_core::ExecutionId;

use crate::config::HostEntry;
use crate::host::{HostError, HostExecutor, OutputNews};

/// How long a batch waits, from the first ask, for others to join it.
const GATHER: Duration = Duration::from_millis(50);
/// Most executions in one watch (the request carries them all).
const WATCH_BATCH: usize = 200;
/// A watch without news ends at a point of this grid (of the daemon's wall clock), at least
/// [`WATCH_MIN`] away: watches that began apart then end together, and the asks that follow
/// share one batch.
const WATCH_GRID: Duration = Duration::from_secs(10);
/// The shortest wait a watch is sent with.
const WATCH_MIN: Duration = Duration::from_secs(2);

/// What an ask gets: news of its execution, or `None` when the watch ran out without any (ask
/// again).
pub(super) type Answer = Result<Option<OutputNews>, HostError>;
/// One call's ask: the execution, the sizes the call has, and where its answer goes.
type Ask = (ExecutionId, [u64; 2], oneshot::Sender<Answer>);

/// The asks waiting for the next batch, per host name.
#[derive(Default)]
pub(super) struct OutputWatch {
    waiting: Mutex<HashMap<String, Vec<Ask>>>,
}

/// How long a watch sent now waits: up to the first point of [`WATCH_GRID`] at least
/// [`WATCH_MIN`] away.
fn watch_wait(now: SystemTime) -> Duration {
    let since = now.duration_since(UNIX_EPOCH).unwrap_or_default();
    let grid = WATCH_GRID.as_millis();
    let earliest = (since + WATCH_MIN).as_millis();
    let end = earliest.div_ceil(grid) * grid;
    Duration::from_millis((end - since.as_millis()) as u64)
}

impl OutputWatch {
    /// News of execution `id` on `host`, whose streams the caller has read up to `known`
    /// (`[stdout, stderr]`): answered by the next batch for that host, when the host has news
    /// or the batch's wait runs out.
    pub(super) async fn news<E: HostExecutor>(
        self: &Arc<Self>,
        exec: &Arc<E>,
        host: &HostEntry,
        id: ExecutionId,
        known: [u64; 2],
    ) -> Answer {
        let (tx, rx) = oneshot::channel();
        let first = {
            let mut waiting = self.waiting.lock().expect("output watch");
            let asks = waiting.entry(host.name.clone()).or_default();
            asks.push((id, known, tx));
            asks.len() == 1
        };
        if first {
            // The first ask of a batch starts it, in a task of its own: a batch outlives the
            // call that started it, so the others' answers never depend on that call.
            tokio::spawn(Self::batch(self.clone(), exec.clone(), host.clone()));
        }
        rx.await.unwrap_or_else(|_| {
            Err(HostError::Lost(
                "the watch of output ended without an answer".into(),
            ))
        })
    }

    /// Waits [`GATHER`], takes every ask for `host` and sends them, [`WATCH_BATCH`] a watch,
    /// the watches side by side. An ask that joins after the take starts the next batch.
    async fn batch<E: HostExecutor>(watch: Arc<Self>, exec: Arc<E>, host: HostEntry) {
        tokio::time::sleep(GATHER).await;
        let mut asks = watch
            .waiting
            .lock()
            .expect("output watch")
            .remove(&host.name)
            .unwrap_or_default();
        // A call that ended meanwhile (its dispatch answered) waits for nothing.
        asks.retain(|(_, _, tx)| !tx.is_closed());
        let wait = watch_wait(SystemTime::now());
        while !asks.is_empty() {
            let rest = asks.split_off(asks.len().min(WATCH_BATCH));
            tokio::spawn(Self::one_watch(exec.clone(), host.clone(), wait, asks));
            asks = rest;
        }
    }

    /// One watch of up to [`WATCH_BATCH`] asks, and their answers.
    async fn one_watch<E: HostExecutor>(
        exec: Arc<E>,
        host: HostEntry,
        wait: Duration,
        asks: Vec<Ask>,
    ) {
        let known: Vec<(ExecutionId, [u64; 2])> =
            asks.iter().map(|(id, sizes, _)| (*id, *sizes)).collect();
        match exec.watch_output(&host, wait, &known).await {
            Ok(news) => {
                let mut news: HashMap<ExecutionId, OutputNews> =
                    news.into_iter().map(|n| (n.id, n)).collect();
                for (id, _, tx) in asks {
                    let _ = tx.send(Ok(news.remove(&id)));
                }
            }
            Err(e) => {
                for (_, _, tx) in asks {
                    let _ = tx.send(Err(e.clone()));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_watch_ends_on_the_grid_at_least_the_shortest_wait_away() {
        let at = |ms: u64| UNIX_EPOCH + Duration::from_millis(ms);
        // 1 ms past a grid point: the next point is 9.999 s away.
        assert_eq!(watch_wait(at(10_001)), Duration::from_millis(9_999));
        // A second before one: too close, so the one after.
        assert_eq!(watch_wait(at(19_000)), Duration::from_millis(11_000));
        // Exactly the shortest wait before one: that one.
        assert_eq!(watch_wait(at(18_000)), Duration::from_millis(2_000));
        // Watches sent apart end together.
        let end = |ms: u64| ms + watch_wait(at(ms)).as_millis() as u64;
        assert_eq!(end(21_000), end(27_900));
        for ms in (0..60_000).step_by(37) {
            let w = watch_wait(at(ms));
            assert!(w >= WATCH_MIN && w < WATCH_MIN + WATCH_GRID, "{ms}: {w:?}");
            assert_eq!(end(ms) % WATCH_GRID.as_millis() as u64, 0);
        }
    }
}
