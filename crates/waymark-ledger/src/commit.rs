//! Group commit: concurrent writers that need durability share one flush.
//!
//! Each write gets a ticket (its event sequence number). A writer waiting for its ticket either
//! finds it already covered by a finished flush, joins the flush in progress, or leads the next
//! flush, which covers every write made before it started. Under load one fsync serves many
//! writers instead of one each.

use std::sync::{Condvar, Mutex};

#[derive(Default)]
struct State {
    /// Highest ticket written to sled's buffers.
    written: u64,
    /// Highest ticket known durable.
    durable: u64,
    /// A leader is flushing up to this ticket.
    flushing: Option<u64>,
    /// A flush failed; every waiter it covered gets the error.
    failed: Option<(u64, String)>,
}

#[derive(Default)]
pub(crate) struct GroupCommit {
    state: Mutex<State>,
    done: Condvar,
    flushes: std::sync::atomic::AtomicU64,
}

impl GroupCommit {
    pub(crate) fn starting_at(durable: u64) -> Self {
        GroupCommit {
            state: Mutex::new(State {
                written: durable,
                durable,
                ..State::default()
            }),
            ..GroupCommit::default()
        }
    }

    /// Records that ticket `t` is in sled's buffers.
    pub(crate) fn written(&self, t: u64) {
        let mut s = self.state.lock().expect("group commit lock");
        s.written = s.written.max(t);
    }

    /// Number of flushes performed, for measurements.
    pub(crate) fn flush_count(&self) -> u64 {
        self.flushes.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Returns once ticket `t` is durable, running `flush` as the leader when needed.
    pub(crate) fn wait_durable(
        &self,
        t: u64,
        flush: impl Fn() -> Result<(), String>,
    ) -> Result<(), String> {
        let mut s = self.state.lock().expect("group commit lock");
        loop {
            if s.durable >= t {
                return Ok(());
            }
            if let Some((upto, err)) = &s.failed {
                if *upto >= t {
                    return Err(err.clone());
                }
            }
            match s.flushing {
                Some(_) => s = self.done.wait(s).expect("group commit lock"),
                None => {
                    let target = s.written.max(t);
                    s.flushing = Some(target);
                    drop(s);
                    let result = flush();
                    self.flushes
                        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    s = self.state.lock().expect("group commit lock");
                    s.flushing = None;
                    match result {
                        Ok(()) => {
                            s.durable = s.durable.max(target);
                            s.failed = None;
                        }
                        Err(e) => s.failed = Some((target, e)),
                    }
                    self.done.notify_all();
                }
            }
        }
    }
}
