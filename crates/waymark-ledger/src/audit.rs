//! Reading the audit chain: events, and `verify`.

use waymark_core::ExecutionId;

use crate::chain::{self, ChainBreak, ChainProblem, VerifyReport};
use crate::error::Result;
use crate::records::{ChainHead, LedgerEvent};
use crate::Ledger;

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
        let store = &self.inner.store;
        let mut report = store.guard("reading the audit chain", || {
            let base = store.chain_base()?;
            let stored_head = self.head();
            let events = store.events_to_verify(base.seq);
            // The iterator ends at the first unreadable event: verify_events stops there.
            let key = &self.inner.chain_key;
            Ok(chain::verify_events(
                key,
                &base,
                events,
                &stored_head,
                exported,
            ))
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
}
