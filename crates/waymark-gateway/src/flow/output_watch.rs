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
pub(super) mod tests {
    use super::*;
    use crate::flow::test_host::{host, Held, TestHost};
    use waymark_core::Timestamp;

    pub(in crate::flow) fn ids(n: u128) -> Vec<ExecutionId> {
        (1..=n)
            .map(|r| ExecutionId::from_parts(Timestamp::from_millis(1_800_000_000_000), r))
            .collect()
    }

    /// A test host whose watches take 20 ms, each of `ended` there with one byte more of each
    /// stream than the calls below know (`[5, 7]`), and ended.
    fn watched(ended: &[ExecutionId], fail: bool) -> Arc<TestHost> {
        let exec = TestHost {
            delay: Duration::from_millis(20),
            fail,
            ..Default::default()
        };
        for id in ended {
            exec.hold(*id, Held::new(&[b'o'; 6], &[b'e'; 8], true));
        }
        Arc::new(exec)
    }

    /// The executions each watch asked about, in the order the watches came.
    fn asked(exec: &TestHost) -> Vec<Vec<ExecutionId>> {
        let watches = exec.watches.lock().unwrap();
        watches
            .iter()
            .map(|(_, known)| known.iter().map(|(id, _)| *id).collect())
            .collect()
    }

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

    #[tokio::test(start_paused = true)]
    async fn asks_within_the_gather_go_as_one_watch_and_each_gets_its_own_news() {
        let all = ids(3);
        let exec = watched(&[all[1]], false);
        let watch = Arc::new(OutputWatch::default());
        let (h1, h2) = (host("h1"), host("h2"));
        let ask = |id: ExecutionId, h: &HostEntry, after: u64| {
            let (watch, exec, h) = (watch.clone(), exec.clone(), h.clone());
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(after)).await;
                watch.news(&exec, &h, id, [5, 7]).await
            })
        };
        // Three asks on h1 within the gather, one on h2.
        let a = ask(all[0], &h1, 0);
        let b = ask(all[1], &h1, 10);
        let c = ask(all[2], &h1, 40);
        let d = ask(all[1], &h2, 5);
        let news = b.await.unwrap().unwrap().expect("b ended");
        assert_eq!((news.id, news.sizes, news.ended), (all[1], [6, 8], true));
        assert!(d.await.unwrap().unwrap().is_some());
        assert!(a.await.unwrap().unwrap().is_none());
        assert!(c.await.unwrap().unwrap().is_none());
        let mut lists = asked(&exec);
        lists.sort_by_key(|l| l.len());
        assert_eq!(lists, vec![vec![all[1]], all.clone()], "one watch per host");
        // A watch without news waits on the host until a point of the grid.
        for (_, known) in exec.watches.lock().unwrap().iter() {
            assert!(known.iter().all(|(_, sizes)| *sizes == [5, 7]));
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_batch_leaves_out_the_asks_of_calls_that_ended_while_it_gathered() {
        let all = ids(3);
        let exec = watched(&[], false);
        let watch = Arc::new(OutputWatch::default());
        let h = host("h1");
        let ask = |id: ExecutionId| {
            let (watch, exec, h) = (watch.clone(), exec.clone(), h.clone());
            tokio::spawn(async move { watch.news(&exec, &h, id, [0, 0]).await })
        };
        let kept = ask(all[0]);
        let gone = ask(all[1]);
        let also_kept = ask(all[2]);
        tokio::time::sleep(Duration::from_millis(10)).await;
        // The call's dispatch answered: it drops its ask.
        gone.abort();
        assert!(kept.await.unwrap().unwrap().is_none());
        assert!(also_kept.await.unwrap().unwrap().is_none());
        assert_eq!(asked(&exec), vec![vec![all[0], all[2]]]);
    }

    #[tokio::test(start_paused = true)]
    async fn a_batch_of_more_than_one_watch_holds_sends_its_watches_side_by_side() {
        let all = ids(2 * WATCH_BATCH as u128 + 1);
        let exec = watched(&[], false);
        let watch = Arc::new(OutputWatch::default());
        let h = host("h1");
        let asks: Vec<_> = all
            .iter()
            .map(|id| {
                let (watch, exec, h, id) = (watch.clone(), exec.clone(), h.clone(), *id);
                tokio::spawn(async move { watch.news(&exec, &h, id, [0, 0]).await })
            })
            .collect();
        for a in asks {
            assert!(a.await.unwrap().unwrap().is_none());
        }
        let lists = asked(&exec);
        let sizes: Vec<usize> = lists.iter().map(Vec::len).collect();
        assert_eq!(sizes.len(), 3, "{sizes:?}");
        assert!(sizes.iter().all(|&n| n <= WATCH_BATCH), "{sizes:?}");
        let mut every: Vec<ExecutionId> = lists.concat();
        every.sort();
        every.dedup();
        assert_eq!(
            every.len(),
            all.len(),
            "an execution asked about twice, or not at all"
        );
        // Side by side: each was sent before the first one's answer came.
        let watches = exec.watches.lock().unwrap();
        let first = watches.iter().map(|(at, _)| *at).min().unwrap();
        assert!(watches.iter().all(|(at, _)| *at < first + exec.delay));
    }

    #[tokio::test(start_paused = true)]
    async fn a_failed_watch_fails_every_ask_in_it_and_the_next_ask_starts_a_new_batch() {
        let all = ids(2);
        let exec = watched(&[], true);
        let watch = Arc::new(OutputWatch::default());
        let h = host("h1");
        let first = {
            let (watch, exec, h, id) = (watch.clone(), exec.clone(), h.clone(), all[0]);
            tokio::spawn(async move { watch.news(&exec, &h, id, [0, 0]).await })
        };
        let second = watch.news(&exec, &h, all[1], [0, 0]).await;
        assert!(matches!(second, Err(HostError::Lost(_))), "{second:?}");
        assert!(matches!(first.await.unwrap(), Err(HostError::Lost(_))));
        // After the take, an ask starts the next batch.
        assert!(watch.news(&exec, &h, all[0], [0, 0]).await.is_err());
        assert_eq!(asked(&exec).len(), 2);
    }
}
