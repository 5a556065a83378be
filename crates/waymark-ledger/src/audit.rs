//! Reading the audit chain: events, and `verify`.

use waymark_core::ExecutionId;

use crate::chain::{ChainBreak, ChainProblem, ChainWalk, VerifyReport};
use crate::error::Result;
use crate::records::{ChainHead, LedgerEvent};
use crate::{Ledger, Progress};

/// Events a walk checks between two reports of its progress.
pub const PROGRESS_PAGE: usize = 8192;

impl Ledger {
    /// Audit events of one execution, in order.
    pub fn events_of(&self, id: ExecutionId) -> Result<Vec<LedgerEvent>> {
        let Some(rec) = self.get(id)? else {
            return Ok(Vec::new());
        };
        let store = &self.inner.store;
        let events = store.guard("reading events", || {
            store.events(rec.first_seq, rec.last_seq, usize::MAX)
        })?;
        Ok(events
            .into_iter()
            .filter(|ev| ev.execution == Some(id))
            .collect())
    }

    /// Audit events from `from` on, at most `limit`.
    pub fn events(&self, from: u64, limit: usize) -> Result<Vec<LedgerEvent>> {
        let store = &self.inner.store;
        store.guard("reading events", || store.events(from, u64::MAX, limit))
    }

    /// Walks the audit chain from genesis (or the retention checkpoint) and reports the first
    /// bad event. With `exported`, also proves that the chain still reaches that head.
    pub fn verify(&self, exported: Option<&ChainHead>) -> Result<VerifyReport> {
        self.verify_since(None, exported, &|_, _| {})
    }

    /// [`Ledger::verify`], from `since` when given: a head the operator kept earlier, trusted,
    /// so only the events after it are checked. It must be this chain's event at its position.
    pub fn verify_since(
        &self,
        since: Option<&ChainHead>,
        exported: Option<&ChainHead>,
        progress: Progress<'_>,
    ) -> Result<VerifyReport> {
        let store = &self.inner.store;
        let mut report = store.guard("reading the audit chain", || {
            let base = store.chain_base()?;
            let stored_head = self.head();
            let start = match since {
                None => base,
                Some(a) => match self.anchor_problem(a, &base, &stored_head)? {
                    Some((seq, problem)) => return Ok(ChainWalk::refused(a, seq, problem)),
                    None => a.clone(),
                },
            };
            let key = &self.inner.chain_key;
            let mut walk = ChainWalk::new(key, &start, since.is_some(), exported);
            // The iterator ends at the first unreadable event: the walk stops there.
            let total = stored_head.seq.saturating_sub(start.seq);
            let mut events = store.events_to_verify(start.seq).peekable();
            while events.peek().is_some() && walk.feed(events.by_ref().take(PROGRESS_PAGE)) {
                progress(walk.events(), total);
            }
            Ok(walk.finish(&stored_head))
        })?;
        if let (None, Some(witness)) = (&report.broken, self.witness_ahead()) {
            let last = report.head.seq;
            report.broken = Some(if witness.seq > last {
                ChainBreak {
                    seq: last + 1,
                    problem: ChainProblem::BehindWitness {
                        last,
                        witness: witness.seq,
                    },
                }
            } else {
                ChainBreak {
                    seq: witness.seq,
                    problem: ChainProblem::NotItsWitness,
                }
            });
        }
        Ok(report)
    }

    /// Why `anchor` cannot start a walk of this chain (a position and the problem), if it
    /// cannot: it is behind the retention base, past the head, or another event.
    fn anchor_problem(
        &self,
        anchor: &ChainHead,
        base: &ChainHead,
        head: &ChainHead,
    ) -> Result<Option<(u64, ChainProblem)>> {
        if anchor.seq < base.seq {
            let problem = ChainProblem::HeadBeforeRetention {
                head: anchor.seq,
                base: base.seq,
            };
            return Ok(Some((anchor.seq, problem)));
        }
        if anchor.seq > head.seq {
            let (last, head) = (head.seq, anchor.seq);
            return Ok(Some((last + 1, ChainProblem::Truncated { last, head })));
        }
        let there = if anchor.seq == base.seq {
            Some(base.hash.clone())
        } else {
            self.inner.store.event(anchor.seq)?.map(|e| e.hash)
        };
        let differs = there.as_deref() != Some(anchor.hash.as_str());
        Ok(differs.then_some((anchor.seq, ChainProblem::DivergedFromHead)))
    }
}
