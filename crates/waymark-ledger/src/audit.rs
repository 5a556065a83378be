//! Reading the audit chain: events, and `verify`.

use waymark_core::ExecutionId;

use crate::chain::{self, VerifyReport};
use crate::error::Result;
use crate::records::{ChainHead, LedgerEvent};
use crate::Ledger;

impl Ledger {
    /// Audit events of one execution, in order.
    pub fn events_of(&self, id: ExecutionId) -> Result<Vec<LedgerEvent>> {
        let Some(rec) = self.get(id)? else {
            return Ok(Vec::new());
        };
        let events = self
            .inner
            .store
            .events(rec.first_seq, rec.last_seq, usize::MAX)?;
        Ok(events
            .into_iter()
            .filter(|ev| ev.execution == Some(id))
            .collect())
    }

    /// Audit events from `from` on, at most `limit`.
    pub fn events(&self, from: u64, limit: usize) -> Result<Vec<LedgerEvent>> {
        self.inner.store.events(from, u64::MAX, limit)
    }

    /// Walks the audit chain from genesis (or the retention checkpoint) and reports the first
    /// bad event. With `exported`, also proves that the chain still reaches that head.
    pub fn verify(&self, exported: Option<&ChainHead>) -> Result<VerifyReport> {
        let store = &self.inner.store;
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
    }
}
