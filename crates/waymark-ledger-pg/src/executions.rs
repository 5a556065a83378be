//! Writes of an execution's life across daemons: the matching rule decided under the intent's
//! advisory lock, transitions under a lease (fenced), and takeover of a dead daemon's work.

use std::time::Duration;

use waymark_core::{ExecutionId, IncomingCall, Timestamp, Transition};
use waymark_ledger::{Durability, EventKind, ExecutionRecord, NewExecution, StoredResult};

use crate::batch::{Write, Written};
use crate::chain::append_event;
use crate::tx::durable;
use crate::{millis, record_of, to_json, Intake, Lease, PgLedger, PgLedgerError, Result};

/// States no daemon drives any more (the partial index on owners skips them too).
pub(crate) const RESOLVED: &str =
    "('denied', 'expired', 'completed', 'failed', 'timed_out', 'cancelled', 'reviewed')";

impl PgLedger {
    /// [`durable`], telling [`PgLedger::with_flush_observer`]'s observer of the wait.
    pub(crate) async fn durable(
        &self,
        client: &deadpool_postgres::Client,
        durability: Durability,
    ) -> Result<()> {
        durable(client, durability, self.on_flush.as_ref()).await
    }

    /// Makes every commit so far durable: a transaction with an id commits with
    /// `synchronous_commit = on`, and the WAL flush it waits for covers every commit before it.
    pub async fn flush(&self) -> Result<()> {
        let client = self.pool.get().await?;
        self.durable(&client, Durability::Flushed).await
    }

    /// Registers daemon `name` (or refreshes it) with a heartbeat at `now`.
    pub async fn heartbeat(&self, name: &str, now: Timestamp) -> Result<()> {
        let client = self.pool.get().await?;
        let now = millis(now);
        client
            .execute(
                "INSERT INTO daemons (name, started_ms, heartbeat_ms) VALUES ($1, $2, $2)
                 ON CONFLICT (name) DO UPDATE SET heartbeat_ms = EXCLUDED.heartbeat_ms",
                &[&name, &now],
            )
            .await?;
        Ok(())
    }

    /// Claims daemon name `name` for as long as the returned connection lives: a session
    /// advisory lock, which PostgreSQL lets go when the session ends, however the daemon
    /// ended. Refused ([`PgLedgerError::NameTaken`]) while another live daemon holds it.
    pub async fn claim_name(&self, name: &str) -> Result<tokio_postgres::Client> {
        let (client, connection) = self
            .config
            .connect(tokio_postgres::NoTls)
            .await
            .map_err(|e| PgLedgerError::Connect(waymark_core::error_chain(&e)))?;
        tokio::spawn(connection);
        let claimed: bool = client
            .query_one(
                "SELECT pg_try_advisory_lock($1, hashtext($2))",
                &[&NAME_LOCK, &name],
            )
            .await?
            .get(0);
        if !claimed {
            return Err(PgLedgerError::NameTaken(name.to_string()));
        }
        Ok(client)
    }

    /// Decides `new`'s intent against the executions with its fingerprint, across every daemon,
    /// and accepts it (owned by `owner`, epoch 1) when the rule says it is new.
    pub async fn accept_or_attach(
        &self,
        new: NewExecution,
        call: &IncomingCall,
        owner: &str,
    ) -> Result<Intake> {
        self.accept_or_attach_with(new, call, owner, Durability::Flushed)
            .await
    }

    /// [`PgLedger::accept_or_attach`], the acceptance committed as `durability` asks (an attach
    /// is always flushed).
    pub async fn accept_or_attach_with(
        &self,
        new: NewExecution,
        call: &IncomingCall,
        owner: &str,
        durability: Durability,
    ) -> Result<Intake> {
        let write = Write::Accept {
            new,
            call: call.clone(),
            owner: owner.to_string(),
        };
        match self.submit(write, durability).await? {
            Written::Intake(intake) => Ok(intake),
            Written::Record(_) => unreachable!("an accept is answered with its intake"),
        }
    }

    /// The execution, with the lease that currently drives it (`None` owner: nobody).
    pub async fn get(&self, id: ExecutionId) -> Result<Option<(ExecutionRecord, Option<Lease>)>> {
        let client = self.pool.get().await?;
        let row = client
            .query_opt(
                "SELECT id, record, owner, epoch FROM executions WHERE id = $1",
                &[&id.to_string()],
            )
            .await?;
        row.map(|r| {
            let record = record_of(r.get(0), r.get(1))?;
            let lease = r.get::<_, Option<String>>(2).map(|owner| Lease {
                owner,
                epoch: r.get(3),
            });
            Ok((record, lease))
        })
        .transpose()
    }

    /// Applies `transition` to execution `id` under `lease`: refused when another daemon took
    /// the execution over (owner or epoch moved on), so a stale daemon cannot write.
    pub async fn transition(
        &self,
        id: ExecutionId,
        lease: &Lease,
        transition: Transition,
        now: Timestamp,
    ) -> Result<ExecutionRecord> {
        self.transition_with(id, lease, transition, None, now, Durability::Flushed)
            .await
    }

    /// [`PgLedger::transition`], storing `result` (each head capped) in the same transaction
    /// and committing as `durability` asks.
    pub async fn transition_with(
        &self,
        id: ExecutionId,
        lease: &Lease,
        transition: Transition,
        result: Option<StoredResult>,
        now: Timestamp,
        durability: Durability,
    ) -> Result<ExecutionRecord> {
        self.transitions_with(id, lease, vec![transition], result, now, durability)
            .await
    }

    /// Applies `transitions` to execution `id` in order, as one write (one place in a batch,
    /// one answer): the first refused ends it with its error, those before it stay written.
    /// `result` is stored with the last.
    pub async fn transitions_with(
        &self,
        id: ExecutionId,
        lease: &Lease,
        transitions: Vec<Transition>,
        result: Option<StoredResult>,
        now: Timestamp,
        durability: Durability,
    ) -> Result<ExecutionRecord> {
        let write = Write::Transition {
            id,
            lease: lease.clone(),
            transitions,
            result,
            now,
        };
        match self.submit(write, durability).await? {
            Written::Record(record) => Ok(record),
            Written::Intake(_) => unreachable!("a transition is answered with its record"),
        }
    }

    /// Takes over the unresolved executions of daemons whose last heartbeat is older than
    /// `dead_after` at `now`: each moves to `me` with epoch + 1 and is returned for the caller to
    /// reconcile through the host marker. Rows another daemon is taking over right now are
    /// skipped (`SKIP LOCKED`), so two survivors never take the same execution.
    pub async fn take_over(
        &self,
        me: &str,
        dead_after: Duration,
        now: Timestamp,
    ) -> Result<Vec<(ExecutionRecord, Lease)>> {
        let cutoff = millis(now.minus(dead_after));
        let sql = format!(
            "SELECT e.id, e.record, e.epoch FROM executions e
             JOIN daemons d ON d.name = e.owner
             WHERE d.heartbeat_ms < $1 AND e.owner <> $2 AND e.state NOT IN {RESOLVED}
             ORDER BY e.id
             FOR UPDATE OF e SKIP LOCKED"
        );
        self.move_leases(me, now, &sql, &[&cutoff, &me]).await
    }

    /// Takes back the unresolved executions an earlier run of daemon `me` (the same name, so
    /// the same socket and configuration) left, with epoch + 1: the earlier run, should it
    /// still be alive somewhere, is fenced from them.
    pub async fn reclaim(&self, me: &str, now: Timestamp) -> Result<Vec<(ExecutionRecord, Lease)>> {
        let sql = format!(
            "SELECT e.id, e.record, e.epoch FROM executions e
             WHERE e.owner = $1 AND e.state NOT IN {RESOLVED}
             ORDER BY e.id
             FOR UPDATE OF e SKIP LOCKED"
        );
        self.move_leases(me, now, &sql, &[&me]).await
    }

    /// Lets execution `id` go: nobody drives it any more, if `lease` still holds it. The next
    /// [`PgLedger::adopt`] on any daemon takes it. Not flushed: a release lost in a crash
    /// leaves the lease with its daemon, whose next run takes it back anyway.
    pub async fn release(&self, id: ExecutionId, lease: &Lease) -> Result<bool> {
        let client = self.pool.get().await?;
        let n = client
            .execute(
                "UPDATE executions SET owner = NULL WHERE id = $1 AND owner = $2 AND epoch = $3",
                &[&id.to_string(), &lease.owner, &lease.epoch],
            )
            .await?;
        Ok(n == 1)
    }

    /// Takes execution `id` for `me` (epoch + 1) when it is unresolved and nobody drives it:
    /// let go, or left under `me`'s own name (a daemon name has one live holder, see
    /// [`PgLedger::claim_name`]). `None` when another daemon drives it, or adopts it right now
    /// (`SKIP LOCKED`): two daemons adopting one execution get one lease.
    pub async fn adopt(
        &self,
        id: ExecutionId,
        me: &str,
        now: Timestamp,
    ) -> Result<Option<(ExecutionRecord, Lease)>> {
        let sql = format!(
            "SELECT e.id, e.record, e.epoch FROM executions e
             WHERE e.id = $1 AND (e.owner IS NULL OR e.owner = $2)
               AND e.state NOT IN {RESOLVED}
             FOR UPDATE OF e SKIP LOCKED"
        );
        let id = id.to_string();
        Ok(self
            .move_leases(me, now, &sql, &[&id, &me])
            .await?
            .into_iter()
            .next())
    }

    /// Takes every unresolved execution nobody drives (let go, see [`PgLedger::release`]) for
    /// `me`, epoch + 1: what a daemon does as it starts, so that its first reconcile settles
    /// them through their markers even when no call asks for them. Rows another daemon adopts
    /// right now are skipped (`SKIP LOCKED`).
    pub async fn adopt_idle(
        &self,
        me: &str,
        now: Timestamp,
    ) -> Result<Vec<(ExecutionRecord, Lease)>> {
        let sql = format!(
            "SELECT e.id, e.record, e.epoch FROM executions e
             WHERE e.owner IS NULL AND e.state NOT IN {RESOLVED}
             ORDER BY e.id
             FOR UPDATE OF e SKIP LOCKED"
        );
        self.move_leases(me, now, &sql, &[]).await
    }

    /// Moves the executions `select` locks (id, record, epoch) to `me`, epoch + 1, each with a
    /// `taken_over` event, in one transaction.
    async fn move_leases(
        &self,
        me: &str,
        now: Timestamp,
        select: &str,
        params: &[&(dyn tokio_postgres::types::ToSql + Sync)],
    ) -> Result<Vec<(ExecutionRecord, Lease)>> {
        let mut client = self.pool.get().await?;
        let tx = client.transaction().await?;
        let rows = tx.query(select, params).await?;
        let mut taken = Vec::with_capacity(rows.len());
        for r in &rows {
            let id: String = r.get(0);
            let epoch: i64 = r.get::<_, i64>(2) + 1;
            let mut record = record_of(id.clone(), r.get(1))?;
            let kind = EventKind::Note {
                name: "taken_over".into(),
                data: serde_json::json!({ "by": me, "epoch": epoch }),
            };
            record.last_seq = append_event(&tx, &self.keys.1, now, Some(record.id), kind).await?;
            tx.execute(
                "UPDATE executions SET owner = $2, epoch = $3, record = $4 WHERE id = $1",
                &[&id, &me, &epoch, &to_json(&record)],
            )
            .await?;
            taken.push((
                record,
                Lease {
                    owner: me.to_string(),
                    epoch,
                },
            ));
        }
        tx.commit().await?;
        Ok(taken)
    }
}

/// The first key of a daemon name's advisory lock ("Waym"); two-key locks never meet the
/// one-key locks of intents and migrations.
const NAME_LOCK: i32 = 0x5761_796d;

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use waymark_core::ExecState;

    /// The state names in a SQL list `('a', 'b')`.
    fn names(list: &str) -> BTreeSet<String> {
        list.trim()
            .trim_start_matches('(')
            .trim_end_matches(')')
            .split(',')
            .map(|s| s.trim().trim_matches('\'').to_string())
            .collect()
    }

    /// The final states are written three times: core's `ExecState::is_final`, the queries'
    /// `RESOLVED`, and the first migration's partial index (append only, so not generated).
    /// They must name the same states.
    #[test]
    fn the_resolved_states_in_sql_are_cores_final_states() {
        let finals: BTreeSet<String> = ExecState::ALL
            .into_iter()
            .filter(|s| s.is_final())
            .map(|s| s.as_str().to_string())
            .collect();
        assert_eq!(names(super::RESOLVED), finals, "RESOLVED");
        let index = crate::schema::MIGRATIONS[0]
            .split("WHERE state NOT IN ")
            .nth(1)
            .and_then(|rest| rest.split(';').next())
            .expect("the first migration's partial index on unresolved executions");
        assert_eq!(names(index), finals, "the partial index of migration 1");
    }
}
