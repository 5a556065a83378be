//! The one write path: every change is staged under the writer lock and committed as one
//! transaction, [`Store::commit_batch`]. A change that is a fact appends the next chained
//! event in the same transaction ([`Ledger::write`]); the two that are not facts (a run's call
//! count, events already behind the retention base) go the same way without one
//! ([`Ledger::write_unaudited`]).

use waymark_core::{ExecutionId, Timestamp};

use crate::error::Result;
use crate::records::{ChainHead, Durability, EventKind, LedgerEvent};
use crate::store::{Batch, Store};
use crate::Ledger;

impl Ledger {
    /// Stages changes under the writer lock, appends the chained event `stage` names (for the
    /// execution it names, if any), and commits everything in one transaction. `stage` gets the
    /// sequence number its event will have.
    pub(crate) fn write<T>(
        &self,
        now: Timestamp,
        durability: Durability,
        stage: impl FnOnce(&Store, u64, &mut Batch) -> Result<(T, Option<ExecutionId>, EventKind)>,
    ) -> Result<(T, u64)> {
        self.write_unless_repeated(now, durability, |store, seq, batch| {
            let (value, execution, kind) = stage(store, seq, batch)?;
            Ok((value, Some((execution, kind))))
        })
    }

    /// Like [`Ledger::write`], but `stage` may find under the lock that there is no fact to
    /// record (`None`: a repeated observation); then nothing is committed, and the sequence
    /// returned is the head's, waited for like any write of that `durability`.
    pub(crate) fn write_unless_repeated<T>(
        &self,
        now: Timestamp,
        durability: Durability,
        stage: impl FnOnce(
            &Store,
            u64,
            &mut Batch,
        ) -> Result<(T, Option<(Option<ExecutionId>, EventKind)>)>,
    ) -> Result<(T, u64)> {
        let chain_key = &self.inner.chain_key;
        let (value, seq) = self.commit_staged(|store, head, batch| {
            let seq = head.seq + 1;
            let (value, event) = stage(store, seq, batch)?;
            let Some((execution, kind)) = event else {
                return Ok((value, head.seq));
            };
            let mut event = LedgerEvent {
                seq,
                at: now,
                execution,
                kind,
                prev: head.hash.clone(),
                hash: String::new(),
            };
            event.hash = chain_key.hash(&event);
            batch.event(event);
            Ok((value, seq))
        })?;
        if durability == Durability::Flushed {
            self.wait_durable(seq)?;
        }
        Ok((value, seq))
    }

    /// Like [`Ledger::write`] for a change that is no fact of the audit chain: no event, and
    /// the chain head stays. Buffered only: a group commit ticket is an event's sequence
    /// number, so a write without one has nothing to wait on; the next flush covers it.
    pub(crate) fn write_unaudited<T>(
        &self,
        stage: impl FnOnce(&Store, &mut Batch) -> Result<T>,
    ) -> Result<T> {
        self.commit_staged(|store, _, batch| stage(store, batch))
    }

    /// Holds the writer lock while `stage` reads what it needs and stages its changes, and
    /// while they commit; moves the chain head if the batch appended an event.
    fn commit_staged<T>(
        &self,
        stage: impl FnOnce(&Store, &ChainHead, &mut Batch) -> Result<T>,
    ) -> Result<T> {
        let inner = &self.inner;
        let mut w = inner.writer.lock().expect("writer lock");
        let mut batch = Batch::default();
        let value = stage(&inner.store, &w.head, &mut batch)?;
        let head = batch.new_head();
        inner.store.commit_batch(batch)?;
        if let Some(head) = head {
            inner.commit.written(head.seq);
            w.head = head;
        }
        Ok(value)
    }
}
