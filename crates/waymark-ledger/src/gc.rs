//! Retention: removing resolved executions and the prefix of events that only they needed.

use waymark_core::{ExecutionId, Timestamp};

use crate::error::Result;
use crate::records::{ChainHead, Durability, EventKind, ExecutionRecord};
use crate::Ledger;

/// What retention removed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GcReport {
    pub removed_executions: u64,
    pub kept_unresolved: u64,
    pub pruned_events_through: Option<u64>,
}

/// What the scans of a retention run found.
struct Scan {
    victims: Vec<ExecutionId>,
    kept_unresolved: u64,
    prune_through: u64,
}

/// Events removed per transaction once the base moved past them.
const PRUNE_CHUNK: usize = 1000;

/// An execution retention may remove: final, and nothing about it needs attention.
fn resolved(rec: &ExecutionRecord) -> bool {
    rec.lifecycle.state.is_final() && !rec.lifecycle.needs_attention()
}

impl Ledger {
    /// Removes resolved executions accepted before `older_than` and prunes the audit events
    /// that only they needed, leaving a checkpoint event so the chain still verifies.
    /// Never removes an execution that still needs attention.
    pub fn gc(&self, older_than: Timestamp, now: Timestamp) -> Result<GcReport> {
        let Scan {
            victims,
            kept_unresolved,
            prune_through,
        } = self.gc_scan(older_than)?;
        self.gc_apply(victims, kept_unresolved, prune_through, now)
    }

    /// What [`Ledger::gc`] would remove now, removing nothing (`waymark gc --dry-run`): a
    /// concurrent writer may change it by the time a real run comes.
    pub fn gc_plan(&self, older_than: Timestamp) -> Result<GcReport> {
        let scan = self.gc_scan(older_than)?;
        let base = self.inner.store.chain_base()?;
        Ok(GcReport {
            removed_executions: scan.victims.len() as u64,
            kept_unresolved: scan.kept_unresolved,
            pruned_events_through: (scan.prune_through > base.seq).then_some(scan.prune_through),
        })
    }

    /// The scans of a retention run: they run outside the writer lock, so writers go on
    /// meanwhile.
    fn gc_scan(&self, older_than: Timestamp) -> Result<Scan> {
        let store = &self.inner.store;
        // Every execution whose first event is at or below this head is in the scan; one
        // accepted later starts after it, so no event up to it can be one that a later
        // execution needs.
        let scanned_through = self.head().seq;
        let mut victims = Vec::new();
        let mut kept_unresolved = 0;
        let mut oldest_kept_seq: Option<u64> = None;
        let cutoff = ExecutionId::lower_bound(older_than);
        store.each_execution(cutoff, |rec, before_cutoff| {
            if before_cutoff && resolved(rec) {
                victims.push(rec.id);
            } else {
                if rec.lifecycle.needs_attention() {
                    kept_unresolved += 1;
                }
                oldest_kept_seq =
                    Some(oldest_kept_seq.map_or(rec.first_seq, |s| s.min(rec.first_seq)));
            }
        })?;
        // Events before the cutoff, and before the first event of any kept execution, go.
        let mut prune_through = 0;
        store.each_event_through(scanned_through, |seq, ev| {
            if ev.at >= older_than || oldest_kept_seq.is_some_and(|s| seq >= s) {
                return false;
            }
            prune_through = seq;
            true
        })?;
        Ok(Scan {
            victims,
            kept_unresolved,
            prune_through,
        })
    }

    fn gc_apply(
        &self,
        victims: Vec<ExecutionId>,
        kept_unresolved: u64,
        prune_through: u64,
        now: Timestamp,
    ) -> Result<GcReport> {
        // One transaction, under the writer lock: remove the records, move the base, append
        // the checkpoint. What the scans found is checked again here, where nothing moves.
        let ((removed, base, pruned), _) =
            self.write(now, Durability::Flushed, |store, _, batch| {
                let current = store.chain_base()?;
                let mut removed = 0;
                let mut through = prune_through;
                for id in &victims {
                    // Another gc may have removed it meanwhile.
                    let Some(rec) = store.get_record(*id)? else {
                        continue;
                    };
                    if resolved(&rec) {
                        batch.remove_execution(&rec);
                        removed += 1;
                    } else {
                        through = through.min(rec.first_seq.saturating_sub(1));
                    }
                }
                // Never behind a base another gc already moved further.
                let pruned = through > current.seq;
                let base = if pruned {
                    let ev = store
                        .event(through)?
                        .ok_or_else(|| store.corrupt("event to prune vanished"))?;
                    ChainHead {
                        seq: through,
                        hash: ev.hash,
                    }
                } else {
                    current
                };
                batch.base(&base);
                let kind = EventKind::Checkpoint {
                    pruned_through: base.seq,
                    pruned_head: base.hash.clone(),
                    removed_executions: removed,
                };
                Ok(((removed, base, pruned), None, kind))
            })?;
        // The events at or below the base go in chunks, each its own transaction through the
        // same path: verify ignores them, so a crash between chunks leaves only leftovers,
        // which this sweep of the next gc removes.
        loop {
            let more = self.write_unaudited(|store, batch| {
                let more = store.oldest_event()?.is_some_and(|seq| seq <= base.seq);
                if more {
                    batch.prune_events(base.seq, PRUNE_CHUNK);
                }
                Ok(more)
            })?;
            if !more {
                break;
            }
        }
        Ok(GcReport {
            removed_executions: removed,
            kept_unresolved,
            pruned_events_through: pruned.then_some(base.seq),
        })
    }
}
