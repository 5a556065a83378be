//! Watching approvals on a shared ledger: one reader per daemon for every call it has waiting.
//!
//! An operator may answer a call through another daemon, and then only the ledger tells the
//! daemon whose call waits. Rather than each waiting call reading its own record (a thousand
//! waiting calls made two thousand reads a second), the calls register here, and one task
//! lists the executions still awaiting approval every [`APPROVAL_POLL`] while any call waits:
//! a registered execution missing from that list has been decided (approved, denied,
//! cancelled or expired), and its call is woken to read how.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::watch;
use waymark_core::{ExecState, ExecutionId};
use waymark_ledger::{LedgerApi, ListQuery};

/// How often the executions still awaiting approval are listed while calls wait.
const APPROVAL_POLL: Duration = Duration::from_millis(500);
/// Page size of that list.
const PAGE: usize = 1000;

/// The calls of this daemon waiting for an answer, by execution.
#[derive(Default)]
pub(super) struct ApprovalWatch {
    waiting: Mutex<HashMap<ExecutionId, watch::Sender<bool>>>,
}

impl ApprovalWatch {
    /// Returns once execution `id` no longer awaits approval in `ledger`; the reader task runs
    /// while some call waits here.
    pub(super) async fn decided(self: &Arc<Self>, ledger: &Arc<dyn LedgerApi>, id: ExecutionId) {
        let mut rx = {
            let mut waiting = self.waiting.lock().expect("approval watch");
            let start = waiting.is_empty();
            let rx = waiting
                .entry(id)
                .or_insert_with(|| watch::channel(false).0)
                .subscribe();
            if start {
                tokio::spawn(Self::read(self.clone(), ledger.clone()));
            }
            rx
        };
        let _ = rx.wait_for(|decided| *decided).await;
    }

    /// Lists what still awaits approval every [`APPROVAL_POLL`] and wakes the calls whose
    /// execution is no longer in it; ends when no call waits (a call that went away no longer
    /// counts), under the lock a new call registers with, so that call starts the next one.
    async fn read(watch: Arc<Self>, ledger: Arc<dyn LedgerApi>) {
        loop {
            tokio::time::sleep(APPROVAL_POLL).await;
            {
                let mut waiting = watch.waiting.lock().expect("approval watch");
                waiting.retain(|_, tx| tx.receiver_count() > 0);
                if waiting.is_empty() {
                    return;
                }
            }
            let still = match awaiting(ledger.as_ref()).await {
                Ok(still) => still,
                // The ledger unreachable: the heartbeat says so; the next round asks again.
                Err(e) => {
                    tracing::debug!(error = %e, "cannot list the executions awaiting approval");
                    continue;
                }
            };
            let waiting = watch.waiting.lock().expect("approval watch");
            for (id, tx) in waiting.iter() {
                if !still.contains(id) {
                    tx.send_replace(true);
                }
            }
        }
    }
}

/// Every execution awaiting approval in `ledger`, page after page.
async fn awaiting(
    ledger: &dyn LedgerApi,
) -> Result<HashSet<ExecutionId>, waymark_ledger::LedgerError> {
    let mut ids = HashSet::new();
    let mut q = ListQuery {
        state: Some(ExecState::AwaitingApproval),
        limit: PAGE,
        oldest_first: true,
        ..Default::default()
    };
    loop {
        let page = ledger.list(&q).await?;
        ids.extend(page.items.iter().map(|r| r.id));
        match page.next {
            Some(next) => q.after = Some(next),
            None => return Ok(ids),
        }
    }
}
