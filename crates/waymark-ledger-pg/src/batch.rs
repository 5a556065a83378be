//! Group commit: the concurrent writes of one daemon's executions (accept or attach, and
//! transitions) share one transaction, one lock of the chain head and one WAL flush.
//!
//! Every write of every daemon appends to the one audit chain, under the lock of the one
//! `chain_head` row, held from reading the head to the commit. One write per transaction made
//! that lock the ledger's limit: a few round trips per write, one write at a time for all
//! daemons. So a daemon queues its writes, and one task at a time (spawned by the write that
//! found no such task running) takes everything queued as one batch:
//!
//! 1. in one transaction (committed without waiting for the disk, see `durable`), it takes the
//!    advisory lock of every intent the batch accepts (sorted, so two daemons' batches never
//!    wait on each other in a cycle), then locks `FOR UPDATE`, in id order, the executions the
//!    batch moves and those with the fingerprints it decides; then the chain head;
//! 2. in memory, it decides and applies each write in the order they were queued, each seeing
//!    the ones before it (a retry queued after its first call attaches to it): a write that is
//!    refused (fenced, illegal, unknown execution) is answered with its error, takes no sequence
//!    number and changes nothing, so the others are written as if it had not been queued;
//! 3. it sends every event, the head, the records and the results in a few set-based
//!    statements at once, and commits;
//! 4. the next batch may start at once; this one's flushed writes are answered once one empty
//!    transaction with `synchronous_commit = on` has committed on its connection (it returns
//!    when the WAL is on disk past the batch), its buffered writes right after the commit.
//!
//! A batch the database refuses as a whole (a deadlock with another daemon, a constraint) is
//! rolled back and each of its writes is tried again alone, so one bad write cannot fail the
//! others. A failed commit is reported to every write of the batch (its outcome is unknown).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use tokio::sync::oneshot;
use tokio_postgres::types::ToSql;
use waymark_core::{
    decide, ExecState, ExecutionId, IncomingCall, MatchDecision, Timestamp, Transition,
};
use waymark_ledger::{
    prior_of, ChainHead, ChainKey, Durability, EventKind, ExecutionRecord, FlushObserver,
    LedgerEvent, NewExecution, StoredResult,
};

use crate::chain::chained;
use crate::tx::{durable, intent_lock, COMMIT_WITHOUT_WAITING};
use crate::{millis, record_of, to_json, Intake, Lease, PgLedger, PgLedgerError, Result};

/// At most this many writes share a transaction.
const MAX_BATCH: usize = 256;

/// A write that goes through the group commit.
pub(crate) enum Write {
    /// Decide an intent and accept it for `owner` when it is new.
    Accept {
        new: NewExecution,
        call: IncomingCall,
        owner: String,
    },
    /// Move an execution under `lease` by `transitions` in order (the first refused ends the
    /// write with its error; those before it stay), storing `result` with the last.
    Transition {
        id: ExecutionId,
        lease: Lease,
        transitions: Vec<Transition>,
        result: Option<StoredResult>,
        now: Timestamp,
    },
}

/// What a write gave.
pub(crate) enum Written {
    Intake(Intake),
    Record(ExecutionRecord),
}

struct Pending {
    write: Write,
    durability: Durability,
    reply: oneshot::Sender<Result<Written>>,
}

/// The writes waiting for the next batch, whether a task is committing them, and how many
/// batches were committed.
#[derive(Default)]
pub(crate) struct Queue {
    state: Mutex<QueueState>,
    committed: AtomicU64,
}

#[derive(Default)]
struct QueueState {
    pending: Vec<Pending>,
    draining: bool,
}

/// Lets the next write start a task again should the draining one end early (a panic, its
/// runtime shutting down): its writes are then answered with an error, never left waiting.
struct Draining<'a>(&'a Queue);

impl Drop for Draining<'_> {
    fn drop(&mut self) {
        self.0.state.lock().expect("write queue").draining = false;
    }
}

/// One execution as the batch sees it: read under its row lock, then moved in memory.
struct Row {
    record: ExecutionRecord,
    owner: Option<String>,
    epoch: i64,
    /// Accepted by this batch: inserted rather than updated.
    inserted: bool,
    /// Changed by this batch.
    changed: bool,
    /// When a transition of this batch last moved it (an attach does not).
    updated_ms: Option<i64>,
}

/// A write's answer, and whether it waits for the WAL flush.
type Answer = (Result<Written>, bool);

/// A batch that was not committed (`committed: false`: rolled back, safe to try again) or
/// whose commit failed (its outcome unknown).
struct Refused {
    error: PgLedgerError,
    committed: bool,
}

impl From<PgLedgerError> for Refused {
    fn from(error: PgLedgerError) -> Self {
        Refused {
            error,
            committed: false,
        }
    }
}

impl From<tokio_postgres::Error> for Refused {
    fn from(e: tokio_postgres::Error) -> Self {
        PgLedgerError::from(e).into()
    }
}

impl PgLedger {
    /// Queues `write` for the next batch and waits for its answer (after the WAL flush when
    /// `durability` is flushed; an attach is always flushed).
    pub(crate) async fn submit(&self, write: Write, durability: Durability) -> Result<Written> {
        let (reply, answer) = oneshot::channel();
        let start = {
            let mut q = self.queue.state.lock().expect("write queue");
            q.pending.push(Pending {
                write,
                durability,
                reply,
            });
            !std::mem::replace(&mut q.draining, true)
        };
        if start {
            let ledger = self.clone();
            tokio::spawn(async move { ledger.drain().await });
        }
        answer.await.unwrap_or_else(|_| {
            Err(PgLedgerError::Db(
                "the write was abandoned before it was committed (the daemon is stopping)".into(),
            ))
        })
    }

    /// How many batches of writes this handle committed (a test proves writes share one).
    pub fn batches_committed(&self) -> u64 {
        self.queue.committed.load(Ordering::Relaxed)
    }

    /// Commits batches until the queue is empty.
    async fn drain(self) {
        let draining = Draining(&self.queue);
        loop {
            let batch: Vec<Pending> = {
                let mut q = self.queue.state.lock().expect("write queue");
                if q.pending.is_empty() {
                    q.draining = false;
                    drop(q);
                    // Already let go, under the lock: a task started since must keep its turn.
                    std::mem::forget(draining);
                    return;
                }
                let n = q.pending.len().min(MAX_BATCH);
                q.pending.drain(..n).collect()
            };
            self.commit_batch(batch).await;
        }
    }

    /// Commits `batch`, or each of its writes alone when the database refused it as a whole,
    /// and answers every write.
    async fn commit_batch(&self, batch: Vec<Pending>) {
        let (writes, replies): (Vec<_>, Vec<_>) = batch
            .into_iter()
            .map(|p| ((p.write, p.durability), p.reply))
            .unzip();
        match self.commit_once(&writes).await {
            Ok(flush) => flush.answer(replies),
            Err(refused) if !refused.committed && writes.len() > 1 => {
                for (write, reply) in writes.into_iter().zip(replies) {
                    match self.commit_once(std::slice::from_ref(&write)).await {
                        Ok(flush) => flush.answer(vec![reply]),
                        Err(r) => {
                            let _ = reply.send(Err(r.error));
                        }
                    }
                }
            }
            Err(refused) => {
                for reply in replies {
                    let _ = reply.send(Err(refused.error.clone()));
                }
            }
        }
    }

    /// One transaction for `writes`: see the module documentation. Returns the answers, to be
    /// sent once the WAL flush (when one is needed) is done.
    async fn commit_once(
        &self,
        writes: &[(Write, Durability)],
    ) -> std::result::Result<Flush, Refused> {
        let mut client = self.pool.get().await.map_err(PgLedgerError::from)?;
        let tx = client.transaction().await?;
        let mut locks: Vec<i64> = Vec::new();
        let mut fingerprints: Vec<String> = Vec::new();
        let mut ids: Vec<String> = Vec::new();
        for (write, _) in writes {
            match write {
                Write::Accept { new, .. } => {
                    locks.push(intent_lock(&new.fingerprint.0));
                    fingerprints.push(new.fingerprint.to_string());
                }
                Write::Transition { id, .. } => ids.push(id.to_string()),
            }
        }
        locks.sort_unstable();
        locks.dedup();
        // Prepared once per connection, so that the statements below leave in this order in
        // one round trip (`biased`: each is sent when first polled) and the server takes their
        // locks in this order: intents, executions (in id order, as every statement that locks
        // several executions takes them), the chain head. The executions are locked as read:
        // a transition by another daemon waits until this batch commits, so an attach never
        // writes back a stale record.
        let lock_intents = tx
            .prepare_cached("SELECT pg_advisory_xact_lock(k) FROM unnest($1::bigint[]) AS k")
            .await?;
        let read_executions = tx
            .prepare_cached(
                "SELECT id, record, owner, epoch FROM executions
                 WHERE id = ANY($1) OR fingerprint = ANY($2) ORDER BY id FOR UPDATE",
            )
            .await?;
        let read_head = tx
            .prepare_cached("SELECT seq, hash FROM chain_head WHERE id = 1 FOR UPDATE")
            .await?;
        let lock_params: [&(dyn ToSql + Sync); 1] = [&locks];
        let read_params: [&(dyn ToSql + Sync); 2] = [&ids, &fingerprints];
        let (_, _, read, head) = tokio::try_join!(
            biased;
            tx.batch_execute(COMMIT_WITHOUT_WAITING),
            tx.execute(&lock_intents, &lock_params),
            tx.query(&read_executions, &read_params),
            tx.query_one(&read_head, &[]),
        )?;
        let mut rows = BTreeMap::new();
        for r in &read {
            let record = record_of(r.get(0), r.get(1))?;
            let row = Row {
                owner: r.get(2),
                epoch: r.get(3),
                inserted: false,
                changed: false,
                updated_ms: None,
                record,
            };
            rows.insert(row.record.id, row);
        }
        let mut chain = Appends {
            key: &self.keys.1,
            head: ChainHead {
                seq: head.get::<_, i64>(0) as u64,
                hash: head.get(1),
            },
            events: Vec::new(),
        };
        let mut results = BTreeMap::new();
        let answers: Vec<Answer> = writes
            .iter()
            .map(|(write, durability)| {
                let flushed = *durability == Durability::Flushed;
                match write {
                    Write::Accept { new, call, owner } => {
                        accept(&mut rows, &mut chain, new, call, owner, flushed)
                    }
                    Write::Transition {
                        id,
                        lease,
                        transitions,
                        result,
                        now,
                    } => {
                        let mut moved = Err(PgLedgerError::Db(format!(
                            "no transition was given for {id}"
                        )));
                        for transition in transitions {
                            moved = apply(&mut rows, &mut chain, *id, lease, transition, *now);
                            if moved.is_err() {
                                break;
                            }
                        }
                        if let (Ok(_), Some(r)) = (&moved, result) {
                            results.insert(*id, r);
                        }
                        (moved.map(Written::Record), flushed)
                    }
                }
            })
            .collect();
        if !chain.events.is_empty() {
            self.store(&tx, &chain.events, &chain.head, &rows, &results)
                .await?;
        }
        tx.commit().await.map_err(|e| Refused {
            error: e.into(),
            committed: true,
        })?;
        self.queue.committed.fetch_add(1, Ordering::Relaxed);
        Ok(Flush {
            client,
            answers,
            on_flush: self.on_flush.clone(),
            witnessed: self.witness.clone().map(|w| (w, chain.head.clone())),
        })
    }

    /// Sends the batch's events, head, executions and results, all statements at once.
    async fn store(
        &self,
        tx: &deadpool_postgres::Transaction<'_>,
        events: &[LedgerEvent],
        head: &ChainHead,
        rows: &BTreeMap<ExecutionId, Row>,
        results: &BTreeMap<ExecutionId, &StoredResult>,
    ) -> Result<()> {
        let seqs: Vec<i64> = events.iter().map(|e| e.seq as i64).collect();
        let of: Vec<Option<String>> = events
            .iter()
            .map(|e| e.execution.map(|id| id.to_string()))
            .collect();
        let bodies: Vec<serde_json::Value> = events
            .iter()
            .map(|e| serde_json::to_value(e).expect("events serialize"))
            .collect();
        let (new, moved): (Vec<&Row>, Vec<&Row>) = rows
            .values()
            .filter(|r| r.changed)
            .partition(|r| r.inserted);
        let column = |rows: &[&Row], f: &dyn Fn(&Row) -> String| -> Vec<String> {
            rows.iter().map(|r| f(r)).collect()
        };
        let id = |r: &Row| r.record.id.to_string();
        let state = |r: &Row| r.record.state().as_str().to_string();
        let json = |rows: &[&Row]| -> Vec<serde_json::Value> {
            rows.iter().map(|r| to_json(&r.record)).collect()
        };
        let new_ids = column(&new, &id);
        let new_fps = column(&new, &|r| r.record.fingerprint.to_string());
        let new_states = column(&new, &state);
        let new_records = json(&new);
        let new_owners = column(&new, &|r| r.owner.clone().unwrap_or_default());
        let new_epochs: Vec<i64> = new.iter().map(|r| r.epoch).collect();
        let new_accepted: Vec<i64> = new.iter().map(|r| millis(r.record.accepted_at)).collect();
        let new_ms: Vec<i64> = new.iter().map(|r| r.updated_ms.unwrap_or(0)).collect();
        let moved_ids = column(&moved, &id);
        let moved_states = column(&moved, &state);
        let moved_records = json(&moved);
        let moved_ms: Vec<Option<i64>> = moved.iter().map(|r| r.updated_ms).collect();
        let cap = self.result_cap;
        let capped = |h: &[u8]| h[..h.len().min(cap)].to_vec();
        let result_ids: Vec<String> = results.keys().map(|id| id.to_string()).collect();
        let out_heads: Vec<Vec<u8>> = results.values().map(|r| capped(&r.stdout.head)).collect();
        let out_totals: Vec<i64> = results
            .values()
            .map(|r| r.stdout.total_bytes as i64)
            .collect();
        let out_sums: Vec<&str> = results.values().map(|r| r.stdout.sha256.as_str()).collect();
        let err_heads: Vec<Vec<u8>> = results.values().map(|r| capped(&r.stderr.head)).collect();
        let err_totals: Vec<i64> = results
            .values()
            .map(|r| r.stderr.total_bytes as i64)
            .collect();
        let err_sums: Vec<&str> = results.values().map(|r| r.stderr.sha256.as_str()).collect();
        let head_seq = head.seq as i64;
        let events_params: [&(dyn ToSql + Sync); 3] = [&seqs, &of, &bodies];
        let head_params: [&(dyn ToSql + Sync); 2] = [&head_seq, &head.hash];
        let insert_params: [&(dyn ToSql + Sync); 8] = [
            &new_ids,
            &new_fps,
            &new_states,
            &new_records,
            &new_owners,
            &new_epochs,
            &new_accepted,
            &new_ms,
        ];
        let update_params: [&(dyn ToSql + Sync); 4] =
            [&moved_ids, &moved_states, &moved_records, &moved_ms];
        let results_params: [&(dyn ToSql + Sync); 7] = [
            &result_ids,
            &out_heads,
            &out_totals,
            &out_sums,
            &err_heads,
            &err_totals,
            &err_sums,
        ];
        tokio::try_join!(
            run(
                tx,
                "INSERT INTO events (seq, execution, body)
                 SELECT * FROM unnest($1::bigint[], $2::text[], $3::jsonb[])",
                &events_params,
            ),
            run(
                tx,
                "UPDATE chain_head SET seq = $1, hash = $2 WHERE id = 1",
                &head_params,
            ),
            run(
                tx,
                "INSERT INTO executions
                   (id, fingerprint, state, record, owner, epoch, accepted_ms, updated_ms)
                 SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::jsonb[],
                                      $5::text[], $6::bigint[], $7::bigint[], $8::bigint[])",
                &insert_params,
            ),
            run(
                tx,
                "UPDATE executions AS e
                 SET state = u.s, record = u.r, updated_ms = COALESCE(u.m, e.updated_ms)
                 FROM unnest($1::text[], $2::text[], $3::jsonb[], $4::bigint[]) AS u(i, s, r, m)
                 WHERE e.id = u.i",
                &update_params,
            ),
            run(
                tx,
                "INSERT INTO results (id, stdout_head, stdout_total, stdout_sha256,
                                      stderr_head, stderr_total, stderr_sha256)
                 SELECT * FROM unnest($1::text[], $2::bytea[], $3::bigint[], $4::text[],
                                      $5::bytea[], $6::bigint[], $7::text[])
                 ON CONFLICT (id) DO UPDATE SET
                   stdout_head = EXCLUDED.stdout_head, stdout_total = EXCLUDED.stdout_total,
                   stdout_sha256 = EXCLUDED.stdout_sha256, stderr_head = EXCLUDED.stderr_head,
                   stderr_total = EXCLUDED.stderr_total, stderr_sha256 = EXCLUDED.stderr_sha256",
                &results_params,
            ),
        )?;
        Ok(())
    }
}

/// Runs `sql` as a statement prepared once per connection.
async fn run(
    tx: &deadpool_postgres::Transaction<'_>,
    sql: &str,
    params: &[&(dyn ToSql + Sync)],
) -> Result<u64> {
    let statement = tx.prepare_cached(sql).await?;
    Ok(tx.execute(&statement, params).await?)
}

/// Decides `new`'s intent against the executions with its fingerprint (those read under the
/// batch's locks and those this batch accepted before it), newest first.
fn accept(
    rows: &mut BTreeMap<ExecutionId, Row>,
    chain: &mut Appends<'_>,
    new: &NewExecution,
    call: &IncomingCall,
    owner: &str,
    flushed: bool,
) -> Answer {
    let priors: Vec<_> = rows
        .values()
        .rev()
        .filter(|r| r.record.fingerprint == new.fingerprint)
        .map(|r| prior_of(&r.record))
        .collect();
    match decide(&priors, call) {
        MatchDecision::Attach { execution, action } => {
            let row = rows
                .get_mut(&execution)
                .expect("decide attaches to one of the priors it was given");
            let kind = EventKind::Attached {
                actor: call.actor.clone(),
                action,
                run: new.run.clone(),
            };
            row.record.last_seq = chain.append(call.now, execution, kind);
            row.changed = true;
            let record = row.record.clone();
            // The caller acts on the attach at once: it is flushed whatever was asked.
            (Ok(Written::Intake(Intake::Attach { record, action })), true)
        }
        MatchDecision::New => {
            let seq = chain.append(call.now, new.id, ExecutionRecord::accepted_event(new));
            let record = ExecutionRecord::accepted(new, call.now, seq);
            let lease = Lease {
                owner: owner.to_string(),
                epoch: 1,
            };
            rows.insert(
                new.id,
                Row {
                    record: record.clone(),
                    owner: Some(lease.owner.clone()),
                    epoch: lease.epoch,
                    inserted: true,
                    changed: true,
                    updated_ms: Some(millis(call.now)),
                },
            );
            (Ok(Written::Intake(Intake::New { record, lease })), flushed)
        }
    }
}

/// Applies `transition` to execution `id` under `lease`, or refuses it without changing
/// anything: unknown, fenced (another daemon drives it), or illegal from its state.
fn apply(
    rows: &mut BTreeMap<ExecutionId, Row>,
    chain: &mut Appends<'_>,
    id: ExecutionId,
    lease: &Lease,
    transition: &Transition,
    now: Timestamp,
) -> Result<ExecutionRecord> {
    let row = rows.get_mut(&id).ok_or(PgLedgerError::NotFound(id))?;
    // Only an execution some daemon drives is fenced: what follows its end (delivered) and an
    // operator's decision any daemon may record.
    let driven = !row.record.state().is_final();
    let fenced = row.owner.as_deref() != Some(lease.owner.as_str()) || row.epoch != lease.epoch;
    if driven && fenced && !operator_decision(row.record.state(), transition) {
        return Err(PgLedgerError::Fenced {
            id,
            owner: row.owner.clone().unwrap_or_else(|| "nobody".into()),
            epoch: row.epoch,
            mine: lease.epoch,
        });
    }
    if row.record.repeats(transition) {
        return Ok(row.record.clone());
    }
    let mut record = row.record.clone();
    let kind = record
        .apply(transition, now, chain.head.seq + 1)
        .map_err(|source| PgLedgerError::Illegal { id, source })?;
    chain.append(now, id, kind);
    row.record = record.clone();
    row.changed = true;
    row.updated_ms = Some(millis(now));
    Ok(record)
}

/// Whether `transition` from `state` is an operator's decision, which the daemon the operator
/// asked records whoever drives the execution: an approval or a denial of an execution awaiting
/// one, a cancel before dispatch, a review of an unknown or interrupted one. Each is legal only
/// from a state in which the driver is waiting (for the operator, or before it dispatched), and
/// the row is locked `FOR UPDATE` while it is applied: the driver's next write sees it (its
/// dispatch of a cancelled execution is illegal), never a half of it.
fn operator_decision(state: ExecState, transition: &Transition) -> bool {
    match transition {
        Transition::Authorize { .. } | Transition::Deny { .. } => {
            state == ExecState::AwaitingApproval
        }
        Transition::CancelBeforeDispatch { .. } | Transition::Review { .. } => true,
        _ => false,
    }
}

/// The events a batch appends after the head it locked.
struct Appends<'k> {
    key: &'k ChainKey,
    head: ChainHead,
    events: Vec<LedgerEvent>,
}

impl Appends<'_> {
    /// Appends an event of execution `id`; returns its sequence number.
    fn append(&mut self, at: Timestamp, id: ExecutionId, kind: EventKind) -> u64 {
        let event = chained(self.key, &self.head, at, Some(id), kind);
        self.head = ChainHead {
            seq: event.seq,
            hash: event.hash.clone(),
        };
        self.events.push(event);
        self.head.seq
    }
}

/// A committed batch's answers, sent once its WAL flush (when one is needed) is done.
struct Flush {
    client: deadpool_postgres::Object,
    answers: Vec<Answer>,
    on_flush: Option<FlushObserver>,
    /// The daemon's witness and the head this batch committed, to record after the flush.
    witnessed: Option<(std::sync::Arc<crate::Witness>, ChainHead)>,
}

impl Flush {
    /// Answers the buffered writes now, and the flushed ones from a task of their own after
    /// the flush, so the next batch need not wait for the disk.
    fn answer(self, replies: Vec<oneshot::Sender<Result<Written>>>) {
        let mut waiting = Vec::new();
        for ((answer, flushed), reply) in self.answers.into_iter().zip(replies) {
            if flushed && answer.is_ok() {
                waiting.push((answer, reply));
            } else {
                let _ = reply.send(answer);
            }
        }
        if waiting.is_empty() {
            return;
        }
        let (client, on_flush, witnessed) = (self.client, self.on_flush, self.witnessed);
        tokio::spawn(async move {
            let flushed = durable(&client, Durability::Flushed, on_flush.as_ref()).await;
            if let (Ok(()), Some((witness, head))) = (&flushed, &witnessed) {
                witness.saw(head);
            }
            for (answer, reply) in waiting {
                let _ = reply.send(match &flushed {
                    Ok(()) => answer,
                    Err(e) => Err(e.clone()),
                });
            }
        });
    }
}
