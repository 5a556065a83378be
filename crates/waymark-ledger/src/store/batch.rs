//! The changes of one write, and the one sled transaction that makes them.
//!
//! A write stages records, not keys: [`Batch`] says what changes (an execution, its state, a
//! result, an event), and [`Store::commit_batch`] turns that into puts and deletes on the
//! trees and commits them all in one transaction. This is the only code in the crate that
//! changes sled, and `Ledger::write`'s path, under the writer lock, is its only caller.

use sled::transaction::{ConflictableTransactionError, TransactionError};
use sled::Transactional;
use waymark_core::{ExecState, ExecutionId};

use super::keys::*;
use super::{to_json, Store};
use crate::error::Result;
use crate::records::{ChainHead, ExecutionRecord, LedgerEvent, ResultHeader, RunRecord};
use crate::StoredResult;

/// What one write changes, in the order staged.
#[derive(Default)]
pub(crate) struct Batch {
    changes: Vec<Change>,
}

enum Change {
    /// A new execution: its record and both indexes.
    NewExecution(ExecutionRecord),
    /// An execution's record, whose state moved from `from` (the state index follows).
    UpdateExecution {
        record: ExecutionRecord,
        from: ExecState,
    },
    /// An execution's result, already capped.
    Result {
        id: ExecutionId,
        result: StoredResult,
    },
    /// An execution's `by_attr` keys (made for executions recorded before that index).
    IndexAttrs(ExecutionRecord),
    /// Every execution has its `by_attr` keys.
    AttrsIndexed,
    /// An execution, its indexes and its result go (retention).
    RemoveExecution(ExecutionRecord),
    Run(RunRecord),
    /// An agent run goes (retention, once no kept execution names it).
    RemoveRun(String),
    Setting {
        name: String,
        value: serde_json::Value,
    },
    /// The next event of the chain, which becomes its head.
    Event(LedgerEvent),
    /// The retention base moves here.
    Base(ChainHead),
    /// Up to `at_most` of the events at or below `through` go (retention, after the base
    /// moved past them).
    PruneEvents {
        through: u64,
        at_most: usize,
    },
}

impl Batch {
    pub(crate) fn new_execution(&mut self, record: &ExecutionRecord) {
        self.changes.push(Change::NewExecution(record.clone()));
    }

    pub(crate) fn update_execution(&mut self, record: &ExecutionRecord, from: ExecState) {
        let record = record.clone();
        self.changes.push(Change::UpdateExecution { record, from });
    }

    pub(crate) fn result(&mut self, id: ExecutionId, result: StoredResult) {
        self.changes.push(Change::Result { id, result });
    }

    pub(crate) fn index_attrs(&mut self, record: &ExecutionRecord) {
        self.changes.push(Change::IndexAttrs(record.clone()));
    }

    pub(crate) fn attrs_indexed(&mut self) {
        self.changes.push(Change::AttrsIndexed);
    }

    pub(crate) fn remove_execution(&mut self, record: &ExecutionRecord) {
        self.changes.push(Change::RemoveExecution(record.clone()));
    }

    pub(crate) fn run(&mut self, run: &RunRecord) {
        self.changes.push(Change::Run(run.clone()));
    }

    pub(crate) fn remove_run(&mut self, id: &str) {
        self.changes.push(Change::RemoveRun(id.to_string()));
    }

    pub(crate) fn setting(&mut self, name: &str, value: &serde_json::Value) {
        let (name, value) = (name.to_string(), value.clone());
        self.changes.push(Change::Setting { name, value });
    }

    pub(crate) fn event(&mut self, event: LedgerEvent) {
        self.changes.push(Change::Event(event));
    }

    pub(crate) fn base(&mut self, base: &ChainHead) {
        self.changes.push(Change::Base(base.clone()));
    }

    pub(crate) fn prune_events(&mut self, through: u64, at_most: usize) {
        self.changes.push(Change::PruneEvents { through, at_most });
    }

    /// The chain head after this batch: its event's, if it appends one.
    pub(crate) fn new_head(&self) -> Option<ChainHead> {
        self.changes.iter().rev().find_map(|c| match c {
            Change::Event(e) => Some(ChainHead {
                seq: e.seq,
                hash: e.hash.clone(),
            }),
            _ => None,
        })
    }
}

#[derive(Clone, Copy)]
enum TreeId {
    Executions,
    ByFingerprint,
    ByState,
    ByAttr,
    Events,
    Results,
    Runs,
    Meta,
}

type Op = (TreeId, Vec<u8>, Option<Vec<u8>>);

impl Store {
    /// Commits `batch` in one sled transaction across all trees. Called only by
    /// `Ledger::commit_staged`, under the writer lock, so transactions never conflict, and no
    /// other write comes between the scans that find what a removal covers (result chunks,
    /// pruned events) and the transaction that removes it.
    pub(crate) fn commit_batch(&self, batch: Batch) -> Result<()> {
        let ops = self.ops(batch)?;
        if ops.is_empty() {
            return Ok(());
        }
        let t = &self.t;
        let trees = (
            &t.executions,
            &t.by_fingerprint,
            &t.by_state,
            &t.by_attr,
            &t.events,
            &t.results,
            &t.runs,
            &t.meta,
        );
        let result: std::result::Result<(), TransactionError<()>> =
            trees.transaction(|(ex, fp, st, at, ev, rs, ru, me)| {
                for (tree, k, v) in &ops {
                    let tt = match tree {
                        TreeId::Executions => ex,
                        TreeId::ByFingerprint => fp,
                        TreeId::ByState => st,
                        TreeId::ByAttr => at,
                        TreeId::Events => ev,
                        TreeId::Results => rs,
                        TreeId::Runs => ru,
                        TreeId::Meta => me,
                    };
                    match v {
                        Some(v) => {
                            tt.insert(k.as_slice(), v.as_slice())?;
                        }
                        None => {
                            tt.remove(k.as_slice())?;
                        }
                    }
                }
                Ok::<(), ConflictableTransactionError<()>>(())
            });
        result.map_err(|e| match e {
            TransactionError::Storage(e) => self.storage(e),
            TransactionError::Abort(()) => self.corrupt("transaction aborted"),
        })
    }

    /// The puts (`Some`) and deletes (`None`) that make `batch`'s changes, in order.
    fn ops(&self, batch: Batch) -> Result<Vec<Op>> {
        let mut ops = Ops::default();
        for change in batch.changes {
            match change {
                Change::NewExecution(rec) => {
                    ops.put(TreeId::Executions, rec.id.to_bytes(), to_json(&rec));
                    ops.put(TreeId::ByFingerprint, fp_key(&rec.fingerprint, rec.id), []);
                    ops.put(TreeId::ByState, state_key(rec.state(), rec.id), []);
                    for k in attr_keys(&rec) {
                        ops.put(TreeId::ByAttr, k, []);
                    }
                }
                Change::IndexAttrs(rec) => {
                    for k in attr_keys(&rec) {
                        ops.put(TreeId::ByAttr, k, []);
                    }
                }
                Change::AttrsIndexed => ops.put(TreeId::Meta, ATTRS_INDEXED_KEY, []),
                Change::UpdateExecution { record, from } => {
                    let (id, to) = (record.id, record.state());
                    if from != to {
                        ops.del(TreeId::ByState, state_key(from, id));
                        ops.put(TreeId::ByState, state_key(to, id), []);
                    }
                    ops.put(TreeId::Executions, id.to_bytes(), to_json(&record));
                }
                Change::Result { id, result } => {
                    let header = ResultHeader {
                        stdout: result.stdout.clone(),
                        stderr: result.stderr.clone(),
                    };
                    ops.put(
                        TreeId::Results,
                        result_key(id, RESULT_HEADER, 0),
                        to_json(&header),
                    );
                    let parts = [
                        (RESULT_STDOUT, &result.stdout.head),
                        (RESULT_STDERR, &result.stderr.head),
                    ];
                    for (part, bytes) in parts {
                        for (i, chunk) in bytes.chunks(RESULT_CHUNK).enumerate() {
                            ops.put(TreeId::Results, result_key(id, part, i as u32), chunk);
                        }
                    }
                }
                Change::RemoveExecution(rec) => {
                    ops.del(TreeId::Executions, rec.id.to_bytes());
                    ops.del(TreeId::ByFingerprint, fp_key(&rec.fingerprint, rec.id));
                    ops.del(TreeId::ByState, state_key(rec.state(), rec.id));
                    for k in attr_keys(&rec) {
                        ops.del(TreeId::ByAttr, k);
                    }
                    for item in self.t.results.scan_prefix(rec.id.to_bytes()) {
                        let (k, _) = item.map_err(|e| self.storage(e))?;
                        ops.del(TreeId::Results, k.as_ref());
                    }
                }
                Change::Run(run) => ops.put(TreeId::Runs, run.id.as_bytes(), to_json(&run)),
                Change::RemoveRun(id) => ops.del(TreeId::Runs, id.as_bytes()),
                Change::Setting { name, value } => {
                    ops.put(TreeId::Meta, setting_key(&name), to_json(&value))
                }
                Change::Event(event) => {
                    let head = ChainHead {
                        seq: event.seq,
                        hash: event.hash.clone(),
                    };
                    ops.put(TreeId::Events, event_key(event.seq), to_json(&event));
                    ops.put(TreeId::Meta, HEAD_KEY, to_json(&head));
                }
                Change::Base(base) => ops.put(TreeId::Meta, BASE_KEY, to_json(&base)),
                Change::PruneEvents { through, at_most } => {
                    for item in self.t.events.range(..=event_key(through)).take(at_most) {
                        let (k, _) = item.map_err(|e| self.storage(e))?;
                        ops.del(TreeId::Events, k.as_ref());
                    }
                }
            }
        }
        Ok(ops.0)
    }
}

#[derive(Default)]
struct Ops(Vec<Op>);

impl Ops {
    fn put(&mut self, t: TreeId, k: impl AsRef<[u8]>, v: impl AsRef<[u8]>) {
        self.0
            .push((t, k.as_ref().to_vec(), Some(v.as_ref().to_vec())));
    }
    fn del(&mut self, t: TreeId, k: impl AsRef<[u8]>) {
        self.0.push((t, k.as_ref().to_vec(), None));
    }
}
