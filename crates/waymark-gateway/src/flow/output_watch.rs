//! Watching output: the sizes of the output streams of every call streaming from one host,
//! read for all of them in one round trip.
//!
//! A call that streams its command's output asks, each time it looks, how large the marker's
//! streams are, and reads bytes only from a stream that grew. The asks of every call on one
//! host that come within [`GATHER`] of the first go to the host as one
//! [`HostExecutor::output_sizes_many`] (one wrapper `status` of up to [`WATCH_BATCH`] ids): as
//! looks land on a 100 ms grid, a host gets one such batch per grid point at most while fewer
//! than that many calls look at once, not two wrapper runs per call per look.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::oneshot;
use waymark_core::ExecutionId;

use crate::config::HostEntry;
use crate::host::{HostError, HostExecutor};

/// How long a batch waits, from the first ask, for others to join it.
const GATHER: Duration = Duration::from_millis(50);
/// Most ids in one round trip (the wrapper's command line carries them all).
const WATCH_BATCH: usize = 200;

type Answer = Result<[u64; 2], HostError>;
/// One call's ask: the execution, and where its answer goes.
type Ask = (ExecutionId, oneshot::Sender<Answer>);

/// The asks waiting for the next batch, per host name.
#[derive(Default)]
pub(super) struct OutputWatch {
    waiting: Mutex<HashMap<String, Vec<Ask>>>,
}

impl OutputWatch {
    /// The sizes `[stdout, stderr]` of execution `id`'s streams on `host` (0 for a marker that
    /// does not exist yet), read in the next batch for that host.
    pub(super) async fn sizes<E: HostExecutor>(
        self: &Arc<Self>,
        exec: &Arc<E>,
        host: &HostEntry,
        id: ExecutionId,
    ) -> Answer {
        let (tx, rx) = oneshot::channel();
        let first = {
            let mut waiting = self.waiting.lock().expect("output watch");
            let asks = waiting.entry(host.name.clone()).or_default();
            asks.push((id, tx));
            asks.len() == 1
        };
        if first {
            // The first ask of a batch starts it, in a task of its own: a batch outlives the
            // call that started it, so the others' answers never depend on that call.
            tokio::spawn(Self::batch(self.clone(), exec.clone(), host.clone()));
        }
        rx.await.unwrap_or_else(|_| {
            Err(HostError::Lost(
                "the batch reading output sizes ended without an answer".into(),
            ))
        })
    }

    /// Waits [`GATHER`], takes every ask for `host` and answers them, [`WATCH_BATCH`] ids a
    /// round trip. An ask that joins after the take starts the next batch.
    async fn batch<E: HostExecutor>(watch: Arc<Self>, exec: Arc<E>, host: HostEntry) {
        tokio::time::sleep(GATHER).await;
        let mut asks = watch
            .waiting
            .lock()
            .expect("output watch")
            .remove(&host.name)
            .unwrap_or_default();
        while !asks.is_empty() {
            let rest = asks.split_off(asks.len().min(WATCH_BATCH));
            let ids: Vec<ExecutionId> = asks.iter().map(|(id, _)| *id).collect();
            match exec.output_sizes_many(&host, &ids).await {
                Ok(sizes) if sizes.len() == ids.len() => {
                    for ((_, tx), size) in asks.into_iter().zip(sizes) {
                        let _ = tx.send(Ok(size));
                    }
                }
                Ok(sizes) => {
                    let why = format!(
                        "the host answered for {} executions, asked for {}",
                        sizes.len(),
                        ids.len()
                    );
                    for (_, tx) in asks {
                        let _ = tx.send(Err(HostError::Answer(why.clone())));
                    }
                }
                Err(e) => {
                    for (_, tx) in asks {
                        let _ = tx.send(Err(e.clone()));
                    }
                }
            }
            asks = rest;
        }
    }
}
