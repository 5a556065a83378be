//! Retention: removing resolved executions, the agent runs no kept execution names, and the
//! prefix of events that only they needed.
//!
//! A gc reads the old part of the ledger a page at a time and removes each page in its own
//! short transaction, pausing between them, so its memory is bounded by a page and a call
//! made meanwhile waits for the writer about as long as behind any other write.

use std::collections::HashSet;
use std::time::Duration;

use waymark_core::{ExecutionId, Timestamp};

use crate::error::Result;
use crate::records::{ChainHead, Durability, EventKind, ExecutionRecord};
use crate::Ledger;

/// What retention removed.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct GcReport {
    pub removed_executions: u64,
    /// Agent runs removed: ended before the cutoff, and named by no kept execution.
    pub removed_runs: u64,
    /// Executions accepted before the cutoff that were kept because they need attention.
    pub kept_unresolved: u64,
    pub pruned_events_through: Option<u64>,
    /// Transactions the removal took (each of at most [`GC_PAGE`] executions, runs or
    /// [`PRUNE_CHUNK`] events); 0 for a plan.
    pub transactions: u64,
}

/// Executions (or runs) read and removed per transaction.
pub const GC_PAGE: usize = 32;

/// Events removed per transaction once the base moved past them.
pub const PRUNE_CHUNK: usize = 128;

/// After each transaction, a gc pauses as long as it took (at least this): std's mutex is not
/// fair, and without a pause the gc thread, still running, takes the writer lock back before
/// a woken writer gets to it; as long as it took, so that a gc holds the writer (and leaves
/// the next flush its dirty pages) at most about half the time.
const PAUSE: Duration = Duration::from_millis(2);

/// Runs one transaction of a gc, then pauses (see [`PAUSE`]).
fn paced<T>(f: impl FnOnce() -> Result<T>) -> Result<T> {
    let t = std::time::Instant::now();
    let value = f()?;
    std::thread::sleep(t.elapsed().max(PAUSE));
    Ok(value)
}

/// An execution retention may remove: final, and nothing about it needs attention.
fn resolved(rec: &ExecutionRecord) -> bool {
    rec.lifecycle.state.is_final() && !rec.lifecycle.needs_attention()
}

/// What a read of the executions older than the cutoff found.
#[derive(Default)]
struct Survey {
    /// Resolved, so removable (a plan's count; a gc removes them page by page).
    removable: u64,
    /// Kept because they need attention.
    kept_unresolved: u64,
    /// The first event of the oldest kept one: no event from it on may be pruned.
    oldest_kept_seq: Option<u64>,
    /// The runs kept executions name (their own and their attached callers'): they stay.
    kept_runs: HashSet<String>,
}

impl Ledger {
    /// Removes resolved executions accepted before `older_than`, the agent runs that ended
    /// before it and that no kept execution names, and the audit events only they needed,
    /// leaving a checkpoint event so the chain still verifies. Never removes an execution
    /// that still needs attention.
    pub fn gc(&self, older_than: Timestamp, now: Timestamp) -> Result<GcReport> {
        let cutoff = ExecutionId::lower_bound(older_than);
        // Events past this head belong to writes made during the gc: never pruned by it.
        let scanned_through = self.head().seq;
        let mut report = GcReport::default();
        let mut after = None;
        loop {
            let page = self.read_old(after, cutoff)?;
            let Some(last) = page.last() else { break };
            after = Some(last.id);
            let victims: Vec<ExecutionId> =
                page.iter().filter(|r| resolved(r)).map(|r| r.id).collect();
            if !victims.is_empty() {
                report.removed_executions += paced(|| self.remove_page(&victims, now))?;
                report.transactions += 1;
            }
        }
        // What is left before the cutoff is what was kept (one resolved since its page was
        // read too: it is still there, so its events stay).
        let survey = self.survey(cutoff, false)?;
        report.kept_unresolved = survey.kept_unresolved;
        let (runs, transactions) = self.remove_runs(older_than, &survey.kept_runs, now)?;
        report.removed_runs = runs;
        report.transactions += transactions;
        let prune_through = self.prune_point(older_than, cutoff, &survey, scanned_through)?;
        let (base, pruned, transactions) = self.move_base(prune_through, &report, now)?;
        report.transactions += transactions;
        report.pruned_events_through = pruned.then_some(base.seq);
        // What it says it removed is gone from the disk too, not only from sled's buffers.
        self.flush()?;
        Ok(report)
    }

    /// What [`Ledger::gc`] would remove now, removing nothing (`waymark gc --dry-run`): a
    /// concurrent writer may change it by the time a real run comes.
    pub fn gc_plan(&self, older_than: Timestamp) -> Result<GcReport> {
        let cutoff = ExecutionId::lower_bound(older_than);
        let scanned_through = self.head().seq;
        let survey = self.survey(cutoff, true)?;
        let prune_through = self.prune_point(older_than, cutoff, &survey, scanned_through)?;
        let base = self.inner.store.chain_base()?;
        let mut removed_runs = 0;
        self.old_runs(older_than, &survey.kept_runs, |gone| {
            removed_runs += gone.len() as u64;
            Ok(())
        })?;
        Ok(GcReport {
            removed_executions: survey.removable,
            removed_runs,
            kept_unresolved: survey.kept_unresolved,
            pruned_events_through: (prune_through > base.seq).then_some(prune_through),
            ..GcReport::default()
        })
    }

    /// The next page of executions accepted before `cutoff`, oldest first.
    fn read_old(
        &self,
        after: Option<ExecutionId>,
        cutoff: ExecutionId,
    ) -> Result<Vec<ExecutionRecord>> {
        let store = &self.inner.store;
        store.guard("reading old executions", || {
            store.executions_before(after, cutoff, GC_PAGE)
        })
    }

    /// Reads the executions accepted before `cutoff` a page at a time. For a `plan`, the
    /// resolved ones are counted as removable; otherwise every one found is kept.
    fn survey(&self, cutoff: ExecutionId, plan: bool) -> Result<Survey> {
        let mut s = Survey::default();
        let mut after = None;
        loop {
            let page = self.read_old(after, cutoff)?;
            let Some(last) = page.last() else { break };
            after = Some(last.id);
            for rec in page {
                if plan && resolved(&rec) {
                    s.removable += 1;
                    continue;
                }
                if rec.lifecycle.needs_attention() {
                    s.kept_unresolved += 1;
                }
                s.oldest_kept_seq = Some(
                    s.oldest_kept_seq
                        .map_or(rec.first_seq, |x| x.min(rec.first_seq)),
                );
                s.kept_runs.extend(rec.run.clone());
                let attached = self
                    .events_of(rec.id)?
                    .into_iter()
                    .filter_map(|ev| match ev.kind {
                        EventKind::Attached { run, .. } => run,
                        _ => None,
                    });
                s.kept_runs.extend(attached);
            }
        }
        Ok(s)
    }

    /// One page of removals in one transaction, with a `retention` note in the chain; what
    /// the read found is checked again here, where nothing moves (another gc may have
    /// removed it, a review may have changed it).
    fn remove_page(&self, victims: &[ExecutionId], now: Timestamp) -> Result<u64> {
        let (removed, _) = self.write(now, Durability::Buffered, |store, _, batch| {
            let mut removed = 0;
            for id in victims {
                if let Some(rec) = store.get_record(*id)? {
                    if resolved(&rec) {
                        batch.remove_execution(&rec);
                        removed += 1;
                    }
                }
            }
            let data = serde_json::json!({ "removed_executions": removed });
            let name = "retention".into();
            Ok((removed, None, EventKind::Note { name, data }))
        })?;
        Ok(removed)
    }

    /// Removes, a page per transaction, the runs that ended before `older_than` and that no
    /// kept execution names. A run with no end (its daemon died) stays. Returns the runs
    /// removed and the transactions it took.
    fn remove_runs(
        &self,
        older_than: Timestamp,
        kept: &HashSet<String>,
        now: Timestamp,
    ) -> Result<(u64, u64)> {
        let (mut removed, mut transactions) = (0, 0);
        self.old_runs(older_than, kept, |gone| {
            paced(|| {
                self.write(now, Durability::Buffered, |store, _, batch| {
                    for id in &gone {
                        if store.run(id)?.is_some() {
                            batch.remove_run(id);
                        }
                    }
                    let data = serde_json::json!({ "removed_runs": gone.len() });
                    let name = "retention".into();
                    Ok(((), None, EventKind::Note { name, data }))
                })
            })?;
            removed += gone.len() as u64;
            transactions += 1;
            Ok(())
        })?;
        Ok((removed, transactions))
    }

    /// Gives `each` the runs retention removes, a page at a time: ended before `older_than`,
    /// named by no kept execution.
    fn old_runs(
        &self,
        older_than: Timestamp,
        kept: &HashSet<String>,
        mut each: impl FnMut(Vec<String>) -> Result<()>,
    ) -> Result<()> {
        let store = &self.inner.store;
        // Run ids are `run_` and the ULID of their start: key order is start order.
        let bound = format!(
            "run_{}",
            &ExecutionId::lower_bound(older_than).to_string()[4..]
        );
        let mut after: Option<String> = None;
        loop {
            let page = store.guard("reading old runs", || {
                store.runs_before(after.as_deref(), &bound, GC_PAGE)
            })?;
            let Some(last) = page.last() else { break };
            after = Some(last.id.clone());
            let gone: Vec<String> = page
                .into_iter()
                .filter(|r| r.ended_at.is_some_and(|e| e < older_than) && !kept.contains(&r.id))
                .map(|r| r.id)
                .collect();
            if !gone.is_empty() {
                each(gone)?;
            }
        }
        Ok(())
    }

    /// The last event retention may prune: events before `older_than` and before the first
    /// event of any kept execution. An execution accepted at or after the cutoff is kept, so
    /// the walk also stops at the first event that names one.
    fn prune_point(
        &self,
        older_than: Timestamp,
        cutoff: ExecutionId,
        survey: &Survey,
        scanned_through: u64,
    ) -> Result<u64> {
        let store = &self.inner.store;
        let mut prune_through = 0;
        store.guard("reading old events", || {
            store.each_event_through(scanned_through, |seq, ev| {
                if ev.at >= older_than
                    || survey.oldest_kept_seq.is_some_and(|s| seq >= s)
                    || ev.execution.is_some_and(|e| e >= cutoff)
                {
                    return false;
                }
                prune_through = seq;
                true
            })
        })?;
        Ok(prune_through)
    }

    /// Moves the base to `prune_through` with a checkpoint event (durable before it returns),
    /// then removes the events at or below it in chunks. Returns the base, whether it moved,
    /// and the transactions it took.
    fn move_base(
        &self,
        prune_through: u64,
        report: &GcReport,
        now: Timestamp,
    ) -> Result<(ChainHead, bool, u64)> {
        let removed = report.removed_executions;
        let ((base, pruned), _) = self.write(now, Durability::Flushed, |store, _, batch| {
            let current = store.chain_base()?;
            // Never behind a base another gc already moved further.
            let pruned = prune_through > current.seq;
            let base = if pruned {
                let ev = store
                    .event(prune_through)?
                    .ok_or_else(|| store.corrupt("event to prune vanished"))?;
                ChainHead {
                    seq: prune_through,
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
            Ok(((base, pruned), None, kind))
        })?;
        let mut transactions = 1;
        // The events at or below the base go in chunks, each its own transaction through the
        // same path: verify ignores them, so a crash between chunks leaves only leftovers,
        // which this sweep of the next gc removes.
        loop {
            let more = paced(|| {
                self.write_unaudited(|store, batch| {
                    let more = store.oldest_event()?.is_some_and(|seq| seq <= base.seq);
                    if more {
                        batch.prune_events(base.seq, PRUNE_CHUNK);
                    }
                    Ok(more)
                })
            })?;
            if !more {
                break;
            }
            transactions += 1;
        }
        Ok((base, pruned, transactions))
    }
}
