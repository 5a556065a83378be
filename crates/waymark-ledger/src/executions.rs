//! Writes of an execution's life: accepted, each lifecycle transition (with its result), and
//! later calls that attached to it.

use waymark_core::{Actor, AttachAction, ExecutionId, Timestamp, Transition};

use crate::error::{LedgerError, Result};
use crate::records::{Durability, EventKind, ExecutionRecord, NewExecution, StoredResult};
use crate::Ledger;

impl Ledger {
    /// Records a newly accepted execution.
    pub fn accept(
        &self,
        new: NewExecution,
        now: Timestamp,
        durability: Durability,
    ) -> Result<ExecutionRecord> {
        let id = new.id;
        let (record, _) = self.write(now, durability, |store, seq, batch| {
            if store.contains(id)? {
                return Err(LedgerError::Duplicate(id));
            }
            let record = ExecutionRecord::accepted(&new, now, seq);
            batch.new_execution(&record);
            let kind = ExecutionRecord::accepted_event(&new);
            Ok((record, Some(id), kind))
        })?;
        Ok(record)
    }

    /// Applies a lifecycle transition to an execution, with its audit event, atomically.
    pub fn transition(
        &self,
        id: ExecutionId,
        transition: Transition,
        now: Timestamp,
        durability: Durability,
    ) -> Result<ExecutionRecord> {
        self.transition_inner(id, transition, None, now, durability)
    }

    /// Like [`Ledger::transition`], storing the execution's result in the same transaction.
    pub fn transition_with_result(
        &self,
        id: ExecutionId,
        transition: Transition,
        result: StoredResult,
        now: Timestamp,
        durability: Durability,
    ) -> Result<ExecutionRecord> {
        self.transition_inner(id, transition, Some(result), now, durability)
    }

    fn transition_inner(
        &self,
        id: ExecutionId,
        transition: Transition,
        result: Option<StoredResult>,
        now: Timestamp,
        durability: Durability,
    ) -> Result<ExecutionRecord> {
        let cap = self.inner.options.result_cap;
        let (record, _) = self.write_unless_repeated(now, durability, |store, seq, batch| {
            let mut rec = store.get_record(id)?.ok_or(LedgerError::NotFound(id))?;
            if result.is_none() && rec.repeats(&transition) {
                return Ok((rec, None));
            }
            let from = rec.lifecycle.state;
            let kind = rec
                .apply(&transition, now, seq)
                .map_err(|source| LedgerError::Illegal { id, source })?;
            batch.update_execution(&rec, from);
            if let Some(r) = &result {
                let mut capped = r.clone();
                capped.stdout.head.truncate(cap);
                capped.stderr.head.truncate(cap);
                batch.result(id, capped);
            }
            Ok((rec, Some((Some(id), kind))))
        })?;
        Ok(record)
    }

    /// Records that a later call attached to `id` instead of starting a new execution.
    pub fn record_attach(
        &self,
        id: ExecutionId,
        actor: Actor,
        action: AttachAction,
        run: Option<String>,
        now: Timestamp,
        durability: Durability,
    ) -> Result<ExecutionRecord> {
        let (rec, _) = self.write(now, durability, |store, seq, batch| {
            let mut rec = store.get_record(id)?.ok_or(LedgerError::NotFound(id))?;
            rec.last_seq = seq;
            let state = rec.state();
            batch.update_execution(&rec, state);
            Ok((
                rec,
                Some(id),
                EventKind::Attached {
                    actor: actor.clone(),
                    action,
                    run: run.clone(),
                },
            ))
        })?;
        Ok(rec)
    }
}
