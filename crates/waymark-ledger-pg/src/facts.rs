//! The facts around executions: settings, agent runs, and retention.

use waymark_core::{Actor, ExecutionId, IdGenerator, Timestamp};
use waymark_ledger::{Durability, EventKind, GcReport, RunRecord, GC_PAGE};

use crate::chain::append_event;
use crate::tx::begin;
use crate::{millis, record_of, PgLedger, PgLedgerError, Result};

impl PgLedger {
    /// A gateway setting (for example whether new actions are locked), if set.
    pub async fn setting(&self, name: &str) -> Result<Option<serde_json::Value>> {
        let client = self.pool.get().await?;
        let row = client
            .query_opt("SELECT value FROM settings WHERE name = $1", &[&name])
            .await?;
        Ok(row.map(|r| r.get(0)))
    }

    /// Sets a gateway setting and records the change in the audit chain, atomically.
    pub async fn set_setting(
        &self,
        name: &str,
        value: serde_json::Value,
        by: &str,
        now: Timestamp,
        durability: Durability,
    ) -> Result<u64> {
        let mut client = self.pool.get().await?;
        let tx = begin(&mut client).await?;
        tx.execute(
            "INSERT INTO settings (name, value) VALUES ($1, $2)
             ON CONFLICT (name) DO UPDATE SET value = EXCLUDED.value",
            &[&name, &value],
        )
        .await?;
        let data = serde_json::json!({ "name": name, "value": value, "by": by });
        let kind = EventKind::Note {
            name: "setting".into(),
            data,
        };
        let seq = append_event(&tx, &self.keys.1, now, None, kind).await?;
        tx.commit().await?;
        self.durable(&client, durability).await?;
        Ok(seq)
    }

    /// Records a gateway fact that belongs to no execution in the audit chain.
    pub async fn record_note(
        &self,
        name: &str,
        data: serde_json::Value,
        now: Timestamp,
        durability: Durability,
    ) -> Result<u64> {
        let mut client = self.pool.get().await?;
        let tx = begin(&mut client).await?;
        let kind = EventKind::Note {
            name: name.to_string(),
            data,
        };
        let seq = append_event(&tx, &self.keys.1, now, None, kind).await?;
        tx.commit().await?;
        self.durable(&client, durability).await?;
        Ok(seq)
    }

    /// Starts an agent run and returns its record.
    pub async fn start_run(
        &self,
        actor: Actor,
        transport: &str,
        now: Timestamp,
        durability: Durability,
    ) -> Result<RunRecord> {
        let run = RunRecord {
            id: format!("run_{}", &self.mint_id(now).to_string()[4..]),
            actor: actor.clone(),
            transport: transport.to_string(),
            started_at: now,
            ended_at: None,
            calls: 0,
        };
        let mut client = self.pool.get().await?;
        let tx = begin(&mut client).await?;
        tx.execute(
            "INSERT INTO runs (id, record) VALUES ($1, $2)",
            &[&run.id, &run_json(&run)],
        )
        .await?;
        let data = serde_json::json!({ "run": run.id, "actor": actor, "transport": transport });
        let kind = EventKind::Note {
            name: "run_started".into(),
            data,
        };
        append_event(&tx, &self.keys.1, now, None, kind).await?;
        tx.commit().await?;
        self.durable(&client, durability).await?;
        Ok(run)
    }

    /// Counts a call in a run: not an audit event (a lost count is not a lost fact), and
    /// committed without waiting for the WAL flush.
    pub async fn count_call(&self, run_id: &str) -> Result<()> {
        let mut client = self.pool.get().await?;
        let tx = begin(&mut client).await?;
        tx.execute(
            "UPDATE runs SET record = jsonb_set(record, '{calls}',
                to_jsonb((record->>'calls')::bigint + 1)) WHERE id = $1",
            &[&run_id],
        )
        .await?;
        tx.commit().await?;
        Ok(())
    }

    /// Ends an agent run.
    pub async fn end_run(
        &self,
        run_id: &str,
        now: Timestamp,
        durability: Durability,
    ) -> Result<()> {
        let mut client = self.pool.get().await?;
        let tx = begin(&mut client).await?;
        tx.execute(
            "UPDATE runs SET record = jsonb_set(record, '{ended_at}', to_jsonb($2::bigint))
             WHERE id = $1",
            &[&run_id, &millis(now)],
        )
        .await?;
        let kind = EventKind::Note {
            name: "run_ended".into(),
            data: serde_json::json!({ "run": run_id }),
        };
        append_event(&tx, &self.keys.1, now, None, kind).await?;
        tx.commit().await?;
        self.durable(&client, durability).await
    }

    /// One agent run, by its id.
    pub async fn run(&self, id: &str) -> Result<Option<RunRecord>> {
        let client = self.pool.get().await?;
        let row = client
            .query_opt("SELECT record FROM runs WHERE id = $1", &[&id])
            .await?;
        row.map(|r| {
            serde_json::from_value(r.get(0)).map_err(|e| PgLedgerError::Record {
                id: id.to_string(),
                reason: e.to_string(),
            })
        })
        .transpose()
    }

    /// Agent runs, newest first.
    pub async fn runs(&self, limit: usize) -> Result<Vec<RunRecord>> {
        let client = self.pool.get().await?;
        let rows = client
            .query(
                "SELECT id, record FROM runs ORDER BY id DESC LIMIT $1",
                &[&(limit.clamp(1, i64::MAX as usize) as i64)],
            )
            .await?;
        rows.iter()
            .map(|r| {
                let id: String = r.get(0);
                serde_json::from_value(r.get(1)).map_err(|e| PgLedgerError::Record {
                    id,
                    reason: e.to_string(),
                })
            })
            .collect()
    }

    /// Mints a new execution id at `now`, strictly after every id this handle minted.
    pub fn mint_id(&self, now: Timestamp) -> ExecutionId {
        let mut random = [0u8; 16];
        rand::RngCore::fill_bytes(&mut rand::rngs::OsRng, &mut random);
        let mut ids = self.ids.lock().expect("id generator");
        ids.next(now, u128::from_be_bytes(random))
    }

    /// Retention on the shared ledger: removes resolved executions (final, needing no
    /// attention) accepted before `older_than`, with their results, a page per transaction
    /// with a `retention` note in the chain, then the runs that ended before it and that no
    /// kept execution names. It does not prune the audit chain: every daemon appends to it and
    /// `verify` walks it from genesis, so its events stay (`pruned_events_through` is `None`).
    pub async fn gc(&self, older_than: Timestamp, now: Timestamp) -> Result<GcReport> {
        let cutoff = ExecutionId::lower_bound(older_than).to_string();
        let mut report = GcReport::default();
        let mut after = String::new();
        loop {
            let mut client = self.pool.get().await?;
            let tx = client.transaction().await?;
            // Rows another daemon is changing right now are in flight: not resolved, skipped.
            let rows = tx
                .query(
                    "SELECT id, record, accepted_ms FROM executions WHERE id > $1 AND id < $2
                     ORDER BY id LIMIT $3 FOR UPDATE SKIP LOCKED",
                    &[&after, &cutoff, &(GC_PAGE as i64)],
                )
                .await?;
            let Some(last) = rows.last() else { break };
            after = last.get(0);
            let (victims, kept_unresolved) = gc_victims(&rows, older_than)?;
            report.kept_unresolved += kept_unresolved;
            if !victims.is_empty() {
                tx.execute("DELETE FROM results WHERE id = ANY($1)", &[&victims])
                    .await?;
                tx.execute("DELETE FROM executions WHERE id = ANY($1)", &[&victims])
                    .await?;
                let kind = EventKind::Note {
                    name: "retention".into(),
                    data: serde_json::json!({ "removed_executions": victims.len() }),
                };
                append_event(&tx, &self.keys.1, now, None, kind).await?;
                report.removed_executions += victims.len() as u64;
                report.transactions += 1;
            }
            tx.commit().await?;
        }
        self.gc_runs(older_than, &cutoff, now, &mut report).await?;
        Ok(report)
    }

    /// Removes, a page per transaction, the runs that ended before `older_than` and that no
    /// execution accepted before the cutoff (a kept one) names as its own or an attached
    /// caller's. A later execution cannot name a run that had ended before it.
    async fn gc_runs(
        &self,
        older_than: Timestamp,
        cutoff: &str,
        now: Timestamp,
        report: &mut GcReport,
    ) -> Result<()> {
        let run_bound = format!("run_{}", &cutoff[4..]);
        loop {
            let mut client = self.pool.get().await?;
            let tx = client.transaction().await?;
            let gone = tx
                .query(
                    "DELETE FROM runs WHERE id IN (
                       SELECT r.id FROM runs r
                       WHERE r.id < $1 AND (r.record->>'ended_at')::bigint < $2
                         AND NOT EXISTS (SELECT 1 FROM executions x
                                         WHERE x.id < $3 AND x.record->>'run' = r.id)
                         AND NOT EXISTS (SELECT 1 FROM events e JOIN executions x
                                           ON e.execution = x.id
                                         WHERE x.id < $3
                                           AND e.body->'kind'->>'type' = 'attached'
                                           AND e.body->'kind'->>'run' = r.id)
                       ORDER BY r.id LIMIT $4 FOR UPDATE SKIP LOCKED)
                     RETURNING id",
                    &[&run_bound, &millis(older_than), &cutoff, &(GC_PAGE as i64)],
                )
                .await?;
            if gone.is_empty() {
                break;
            }
            let kind = EventKind::Note {
                name: "retention".into(),
                data: serde_json::json!({ "removed_runs": gone.len() }),
            };
            append_event(&tx, &self.keys.1, now, None, kind).await?;
            tx.commit().await?;
            report.removed_runs += gone.len() as u64;
            report.transactions += 1;
        }
        Ok(())
    }
}

impl PgLedger {
    /// What [`PgLedger::gc`] would remove now, removing nothing.
    pub async fn gc_plan(&self, older_than: Timestamp) -> Result<GcReport> {
        let cutoff = ExecutionId::lower_bound(older_than).to_string();
        let mut report = GcReport::default();
        let mut after = String::new();
        let mut kept: Vec<String> = Vec::new();
        let client = self.pool.get().await?;
        loop {
            let rows = client
                .query(
                    "SELECT id, record, accepted_ms FROM executions WHERE id > $1 AND id < $2
                     ORDER BY id LIMIT $3",
                    &[&after, &cutoff, &(GC_PAGE as i64)],
                )
                .await?;
            let Some(last) = rows.last() else { break };
            after = last.get(0);
            let (victims, kept_unresolved) = gc_victims(&rows, older_than)?;
            report.removed_executions += victims.len() as u64;
            report.kept_unresolved += kept_unresolved;
            let ids = rows.iter().map(|r| r.get::<_, String>(0));
            kept.extend(ids.filter(|id| !victims.contains(id)));
        }
        // The runs a gc would remove once those executions are gone: ended before the cutoff,
        // named by none of the kept ones (as their own or an attached caller's).
        let mut kept_runs: std::collections::HashSet<String> = std::collections::HashSet::new();
        for ids in kept.chunks(1000) {
            let rows = client
                .query(
                    "SELECT x.record->>'run' FROM executions x WHERE x.id = ANY($1)
                     UNION SELECT e.body->'kind'->>'run' FROM events e
                     WHERE e.execution = ANY($1) AND e.body->'kind'->>'type' = 'attached'",
                    &[&ids],
                )
                .await?;
            kept_runs.extend(rows.iter().filter_map(|r| r.get::<_, Option<String>>(0)));
        }
        let run_bound = format!("run_{}", &cutoff[4..]);
        let mut after = String::new();
        loop {
            let rows = client
                .query(
                    "SELECT id FROM runs WHERE id > $1 AND id < $2
                       AND (record->>'ended_at')::bigint < $3
                     ORDER BY id LIMIT $4",
                    &[&after, &run_bound, &millis(older_than), &(GC_PAGE as i64)],
                )
                .await?;
            let Some(last) = rows.last() else { break };
            after = last.get(0);
            let gone = rows
                .iter()
                .filter(|r| !kept_runs.contains(&r.get::<_, String>(0)));
            report.removed_runs += gone.count() as u64;
        }
        Ok(report)
    }
}

/// The executions retention removes (resolved, accepted before `older_than`), and how many
/// kept ones still need attention.
fn gc_victims(rows: &[tokio_postgres::Row], older_than: Timestamp) -> Result<(Vec<String>, u64)> {
    let mut victims = Vec::new();
    let mut kept_unresolved = 0;
    for r in rows {
        let rec = record_of(r.get(0), r.get(1))?;
        let before = r.get::<_, i64>(2) < millis(older_than);
        let resolved = rec.state().is_final() && !rec.lifecycle.needs_attention();
        if before && resolved {
            victims.push(rec.id.to_string());
        } else if rec.lifecycle.needs_attention() {
            kept_unresolved += 1;
        }
    }
    Ok((victims, kept_unresolved))
}

fn run_json(run: &RunRecord) -> serde_json::Value {
    serde_json::to_value(run).expect("a run serializes")
}

/// The id generator's state lives with the handle (see [`PgLedger::mint_id`]).
pub(crate) fn id_generator() -> std::sync::Mutex<IdGenerator> {
    std::sync::Mutex::new(IdGenerator::default())
}
