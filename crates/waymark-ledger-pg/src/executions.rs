//! Writes of an execution's life across daemons: the matching rule decided under the intent's
//! advisory lock, transitions under a lease (fenced), and takeover of a dead daemon's work.

use std::time::Duration;

use waymark_core::{decide, ExecutionId, IncomingCall, MatchDecision, Timestamp, Transition};
use waymark_ledger::{
    prior_of, Durability, EventKind, ExecutionRecord, NewExecution, StoredResult,
};

use crate::chain::{append_event, chained, head_in, write_event};
use crate::{millis, record_of, to_json, Intake, Lease, PgLedger, PgLedgerError, Result};

/// States no daemon drives any more (the partial index on owners skips them too).
pub(crate) const RESOLVED: &str =
    "('denied', 'expired', 'completed', 'failed', 'timed_out', 'cancelled', 'reviewed')";

/// Opens a transaction that commits without waiting for the WAL flush: the chain head's row
/// lock is held until commit, so a commit that waited for the disk would serialize every
/// writer of every daemon on one fsync each. Durability is asked for after the lock is gone,
/// by [`durable`].
pub(crate) async fn begin(
    client: &mut deadpool_postgres::Client,
) -> Result<deadpool_postgres::Transaction<'_>> {
    let tx = client.transaction().await?;
    tx.batch_execute("SET LOCAL synchronous_commit TO OFF")
        .await?;
    Ok(tx)
}

/// After a commit by [`begin`]'s transaction: for a flushed write, commits one more (empty)
/// transaction with `synchronous_commit = on` (the connection's setting); it returns once the
/// WAL is on disk up to its own commit record, which is after the write's. Concurrent
/// flushes from every session share one WAL flush (PostgreSQL's own group commit), as sled's
/// writers share one fdatasync. A buffered write is covered by the next flushed one.
pub(crate) async fn durable(
    client: &deadpool_postgres::Client,
    durability: Durability,
) -> Result<()> {
    if durability == Durability::Flushed {
        client
            .batch_execute("BEGIN; SELECT txid_current(); COMMIT")
            .await?;
    }
    Ok(())
}

impl PgLedger {
    /// Makes every commit so far durable: a transaction with an id commits with
    /// `synchronous_commit = on`, and the WAL flush it waits for covers every commit before it.
    pub async fn flush(&self) -> Result<()> {
        let client = self.pool.get().await?;
        durable(&client, Durability::Flushed).await
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
        let mut client = self.pool.get().await?;
        let tx = begin(&mut client).await?;
        tx.execute(
            "SELECT pg_advisory_xact_lock($1)",
            &[&intent_lock(&new.fingerprint.0)],
        )
        .await?;
        let fingerprint = new.fingerprint.to_string();
        // Locked as read: a transition of one of them (by its driver, on any daemon) waits
        // until this decision commits, so the attach below never writes back a stale record.
        // In id order, as every statement that locks several executions takes them.
        let rows = tx
            .query(
                "SELECT id, record FROM executions WHERE fingerprint = $1 ORDER BY id FOR UPDATE",
                &[&fingerprint],
            )
            .await?;
        let priors: Vec<ExecutionRecord> = rows
            .iter()
            .rev()
            .map(|r| record_of(r.get(0), r.get(1)))
            .collect::<Result<_>>()?;
        let views: Vec<_> = priors.iter().map(prior_of).collect();
        match decide(&views, call) {
            MatchDecision::Attach { execution, action } => {
                let mut record = priors
                    .into_iter()
                    .find(|r| r.id == execution)
                    .expect("decide attaches to one of the priors it was given");
                let kind = EventKind::Attached {
                    actor: call.actor.clone(),
                    action,
                    run: new.run.clone(),
                };
                record.last_seq =
                    append_event(&tx, &self.keys.1, call.now, Some(execution), kind).await?;
                tx.execute(
                    "UPDATE executions SET record = $2 WHERE id = $1",
                    &[&execution.to_string(), &to_json(&record)],
                )
                .await?;
                tx.commit().await?;
                durable(&client, Durability::Flushed).await?;
                Ok(Intake::Attach { record, action })
            }
            MatchDecision::New => {
                let kind = ExecutionRecord::accepted_event(&new);
                let seq = append_event(&tx, &self.keys.1, call.now, Some(new.id), kind).await?;
                let record = ExecutionRecord::accepted(&new, call.now, seq);
                let lease = Lease {
                    owner: owner.to_string(),
                    epoch: 1,
                };
                tx.execute(
                    "INSERT INTO executions
                       (id, fingerprint, state, record, owner, epoch, accepted_ms, updated_ms)
                     VALUES ($1, $2, $3, $4, $5, $6, $7, $7)",
                    &[
                        &record.id.to_string(),
                        &fingerprint,
                        &record.state().as_str(),
                        &to_json(&record),
                        &lease.owner,
                        &lease.epoch,
                        &millis(call.now),
                    ],
                )
                .await?;
                tx.commit().await?;
                durable(&client, durability).await?;
                Ok(Intake::New { record, lease })
            }
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
        let mut client = self.pool.get().await?;
        let tx = begin(&mut client).await?;
        let row = tx
            .query_opt(
                "SELECT id, record, owner, epoch FROM executions WHERE id = $1 FOR UPDATE",
                &[&id.to_string()],
            )
            .await?
            .ok_or(PgLedgerError::NotFound(id))?;
        let owner: Option<String> = row.get(2);
        let epoch: i64 = row.get(3);
        let mut record = record_of(row.get(0), row.get(1))?;
        // Only an execution some daemon drives is fenced: what follows its end (delivered,
        // an operator's review) any daemon may record.
        let driven = !record.state().is_final();
        if driven && (owner.as_deref() != Some(lease.owner.as_str()) || epoch != lease.epoch) {
            return Err(PgLedgerError::Fenced {
                id,
                owner: owner.unwrap_or_else(|| "nobody".into()),
                epoch,
                mine: lease.epoch,
            });
        }
        // The result first: it needs no sequence number, so it is written before the head is
        // locked. Then the head (locked until commit), and the event with the record together.
        if let Some(r) = result {
            let cap = self.result_cap;
            let head = |h: &[u8]| h[..h.len().min(cap)].to_vec();
            tx.execute(
                "INSERT INTO results (id, stdout_head, stdout_total, stdout_sha256,
                                      stderr_head, stderr_total, stderr_sha256)
                 VALUES ($1, $2, $3, $4, $5, $6, $7)
                 ON CONFLICT (id) DO UPDATE SET
                   stdout_head = EXCLUDED.stdout_head, stdout_total = EXCLUDED.stdout_total,
                   stdout_sha256 = EXCLUDED.stdout_sha256, stderr_head = EXCLUDED.stderr_head,
                   stderr_total = EXCLUDED.stderr_total, stderr_sha256 = EXCLUDED.stderr_sha256",
                &[
                    &id.to_string(),
                    &head(&r.stdout.head),
                    &(r.stdout.total_bytes as i64),
                    &r.stdout.sha256,
                    &head(&r.stderr.head),
                    &(r.stderr.total_bytes as i64),
                    &r.stderr.sha256,
                ],
            )
            .await?;
        }
        let head = head_in(&tx).await?;
        let kind = record
            .apply(&transition, now, head.seq + 1)
            .map_err(|source| PgLedgerError::Illegal { id, source })?;
        let event = chained(&self.keys.1, &head, now, Some(id), kind);
        let (id_text, state, json) = (id.to_string(), record.state().as_str(), to_json(&record));
        tokio::try_join!(write_event(&tx, &event), async {
            tx.execute(
                "UPDATE executions SET state = $2, record = $3, updated_ms = $4 WHERE id = $1",
                &[&id_text, &state, &json, &millis(now)],
            )
            .await
            .map_err(PgLedgerError::from)
        },)?;
        tx.commit().await?;
        durable(&client, durability).await?;
        Ok(record)
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

/// The advisory lock of an intent: the first 8 bytes of its fingerprint.
fn intent_lock(fingerprint: &[u8; 32]) -> i64 {
    i64::from_be_bytes(fingerprint[..8].try_into().expect("8 bytes"))
}
