//! Agent runs, gateway notes and settings: the facts around executions.

use waymark_core::{Actor, ExecutionId, Timestamp};

use crate::error::Result;
use crate::records::{Durability, EventKind, RunRecord};
use crate::Ledger;

impl Ledger {
    /// Records a gateway fact (a lock, an operator action) in the audit chain.
    pub fn record_note(
        &self,
        execution: Option<ExecutionId>,
        name: &str,
        data: serde_json::Value,
        now: Timestamp,
        durability: Durability,
    ) -> Result<u64> {
        let (_, seq) = self.write(now, durability, |_, _, _| {
            Ok((
                (),
                execution,
                EventKind::Note {
                    name: name.to_string(),
                    data: data.clone(),
                },
            ))
        })?;
        Ok(seq)
    }

    /// A gateway setting (for example whether new actions are locked), if set.
    pub fn setting(&self, name: &str) -> Result<Option<serde_json::Value>> {
        let store = &self.inner.store;
        store.guard("reading a setting", || store.setting(name))
    }

    /// Sets a gateway setting and records the change in the audit chain, atomically.
    pub fn set_setting(
        &self,
        name: &str,
        value: serde_json::Value,
        by: &str,
        now: Timestamp,
        durability: Durability,
    ) -> Result<u64> {
        let (_, seq) = self.write(now, durability, |_, _, batch| {
            batch.setting(name, &value);
            let data = serde_json::json!({ "name": name, "value": value, "by": by });
            Ok((
                (),
                None,
                EventKind::Note {
                    name: "setting".into(),
                    data,
                },
            ))
        })?;
        Ok(seq)
    }

    /// Starts an agent run and returns its record.
    pub fn start_run(
        &self,
        actor: Actor,
        transport: &str,
        now: Timestamp,
        durability: Durability,
    ) -> Result<RunRecord> {
        let run_id = format!("run_{}", &self.mint_id(now).to_string()[4..]);
        let (run, _) = self.write(now, durability, |_, _, batch| {
            let run = RunRecord {
                id: run_id.clone(),
                actor: actor.clone(),
                transport: transport.to_string(),
                started_at: now,
                ended_at: None,
                calls: 0,
            };
            batch.run(&run);
            let data = serde_json::json!({ "run": run.id, "actor": actor, "transport": transport });
            Ok((
                run,
                None,
                EventKind::Note {
                    name: "run_started".into(),
                    data,
                },
            ))
        })?;
        Ok(run)
    }

    /// Counts a call in a run. Buffered and not an audit event: a lost count is not a lost
    /// fact, the execution records carry their run.
    pub fn count_call(&self, run_id: &str) -> Result<()> {
        self.write_unaudited(|store, batch| {
            if let Some(mut run) = store.run(run_id)? {
                run.calls += 1;
                batch.run(&run);
            }
            Ok(())
        })
    }

    /// Ends an agent run.
    pub fn end_run(&self, run_id: &str, now: Timestamp, durability: Durability) -> Result<()> {
        self.write(now, durability, |store, _, batch| {
            if let Some(mut run) = store.run(run_id)? {
                run.ended_at = Some(now);
                batch.run(&run);
            }
            let data = serde_json::json!({ "run": run_id });
            Ok((
                (),
                None,
                EventKind::Note {
                    name: "run_ended".into(),
                    data,
                },
            ))
        })?;
        Ok(())
    }

    /// One agent run, by its id.
    pub fn run(&self, id: &str) -> Result<Option<RunRecord>> {
        let store = &self.inner.store;
        store.guard("reading a run", || store.run(id))
    }

    /// Agent runs, newest first.
    pub fn runs(&self, limit: usize) -> Result<Vec<RunRecord>> {
        let store = &self.inner.store;
        store.guard("reading runs", || store.runs(limit.max(1)))
    }
}
