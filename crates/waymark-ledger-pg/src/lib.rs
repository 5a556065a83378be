//! Waymark's shared ledger on PostgreSQL (issue 14): several daemons, one ledger.
//!
//! Built so far, and tested against a real PostgreSQL: the versioned schema (created and
//! migrated by the daemon; a newer schema than the binary knows is refused), exactly-once
//! matching across daemons, ownership with fencing of executions in flight, and one audit chain
//! for all daemons, verified by the sled ledger's rule. Not built yet: the ledger interface that
//! lets the gateway use this in place of the sled ledger, results, runs, retention, and live
//! output across daemons. Nothing uses this crate yet.
//!
//! **One chain.** Every write appends its audit event in the same transaction, under the lock
//! of the one `chain_head` row, so appends from every daemon form one chain, one event at a
//! time; `verify` walks it with `waymark_ledger::verify_events`.
//!
//! **Matching is decided by the database.** [`PgLedger::accept_or_attach`] runs core's matching
//! rule ([`waymark_core::decide`]) inside one transaction that holds a transaction-scoped
//! advisory lock on the intent's fingerprint (`pg_advisory_xact_lock`), so two daemons racing
//! the same intent serialize on the lock: the second sees the first's execution and attaches.
//! The rule itself stays in one place, core, rather than being re-encoded in SQL.
//!
//! **Ownership and fencing.** Each execution has an owner (the daemon driving it) and an
//! epoch. A write names the [`Lease`] it holds and is refused ([`PgLedgerError::Fenced`]) when
//! the row's owner or epoch moved on. A daemon whose heartbeat stopped loses its unresolved
//! executions to [`PgLedger::take_over`] (`FOR UPDATE SKIP LOCKED`, epoch + 1), which hands them
//! to the caller to reconcile through the host marker: a lease that expired never re-dispatches.
//!
//! **Durable means committed.** Every write is one transaction with PostgreSQL's default
//! `synchronous_commit = on`.
//!
//! **What it is not.** The only crate that knows tokio-postgres. It does no I/O beyond the
//! database and reads no clock: every instant is a parameter, as in core.

use std::time::Duration;

use deadpool_postgres::{Manager, ManagerConfig, Pool, RecyclingMethod};
use tokio_postgres::NoTls;
use waymark_core::FingerprintKey;
use waymark_core::{
    decide, error_chain, AttachAction, ExecState, ExecutionId, IllegalTransition, IncomingCall,
    MatchDecision, PriorExecution, Timestamp, Transition,
};
use waymark_ledger::{
    derive_keys, verify_events, ChainHead, ChainKey, EventKind, ExecutionRecord, LedgerEvent,
    NewExecution, VerifyReport,
};

/// The schema, one migration per version; version N is `MIGRATIONS[N - 1]`. Append only.
const MIGRATIONS: &[&str] = &[
    // 1: executions with owner and epoch, daemons with heartbeats.
    r#"
    CREATE TABLE executions (
        id          text PRIMARY KEY,
        fingerprint text NOT NULL,
        state       text NOT NULL,
        record      jsonb NOT NULL,
        owner       text,
        epoch       bigint NOT NULL,
        accepted_ms bigint NOT NULL,
        updated_ms  bigint NOT NULL
    );
    CREATE INDEX executions_by_fingerprint ON executions (fingerprint, id DESC);
    CREATE INDEX executions_unresolved_by_owner ON executions (owner)
        WHERE state NOT IN ('denied', 'expired', 'completed', 'failed', 'timed_out', 'cancelled', 'reviewed');
    CREATE TABLE daemons (
        name         text PRIMARY KEY,
        started_ms   bigint NOT NULL,
        heartbeat_ms bigint NOT NULL
    );
    "#,
    // 2: the audit chain, one total order across daemons, appended under the head row's lock.
    r#"
    CREATE TABLE events (
        seq       bigint PRIMARY KEY,
        execution text,
        body      jsonb NOT NULL
    );
    CREATE INDEX events_by_execution ON events (execution, seq);
    CREATE TABLE chain_head (
        id   integer PRIMARY KEY CHECK (id = 1),
        seq  bigint NOT NULL,
        hash text NOT NULL
    );
    INSERT INTO chain_head (id, seq, hash) VALUES (1, 0, repeat('0', 64));
    "#,
];

/// Serializes schema changes between daemons starting at once ("Waymark" + 1).
const MIGRATION_LOCK: i64 = 0x5761_796d_6172_6b01;

/// Why a ledger operation failed.
#[derive(Debug, thiserror::Error)]
pub enum PgLedgerError {
    #[error("cannot reach the PostgreSQL ledger: {0}")]
    Connect(String),
    #[error("PostgreSQL ledger: {0}")]
    Db(String),
    #[error(
        "the ledger's schema is version {found}, newer than this waymark knows ({known}): \
         upgrade waymark here before it uses this database"
    )]
    SchemaTooNew { found: u32, known: u32 },
    #[error(
        "execution {id} is now driven by {owner} (epoch {epoch}); this daemon's lease (epoch \
         {mine}) is stale and may not change it"
    )]
    Fenced {
        id: ExecutionId,
        owner: String,
        epoch: i64,
        mine: i64,
    },
    #[error("no execution {0} in the ledger")]
    NotFound(ExecutionId),
    #[error("execution {id}: {source}")]
    Illegal {
        id: ExecutionId,
        source: IllegalTransition,
    },
    #[error("execution {id}: its stored record is unreadable: {reason}")]
    Record { id: String, reason: String },
}

impl From<tokio_postgres::Error> for PgLedgerError {
    fn from(e: tokio_postgres::Error) -> Self {
        PgLedgerError::Db(error_chain(&e))
    }
}

impl From<deadpool_postgres::PoolError> for PgLedgerError {
    fn from(e: deadpool_postgres::PoolError) -> Self {
        PgLedgerError::Connect(error_chain(&e))
    }
}

pub type Result<T> = std::result::Result<T, PgLedgerError>;

/// A daemon's right to drive an execution: who and in which epoch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Lease {
    pub owner: String,
    pub epoch: i64,
}

/// What [`PgLedger::accept_or_attach`] decided.
#[derive(Clone, Debug, PartialEq)]
pub enum Intake {
    /// A new intent: this execution was accepted, owned by the caller.
    New {
        record: ExecutionRecord,
        lease: Lease,
    },
    /// A retry of an earlier execution (possibly another daemon's): do `action` with it.
    Attach {
        record: ExecutionRecord,
        action: AttachAction,
    },
}

/// The shared ledger.
#[derive(Clone)]
pub struct PgLedger {
    pool: Pool,
    keys: std::sync::Arc<(FingerprintKey, ChainKey)>,
}

impl PgLedger {
    /// Connects to `url` (`postgresql://user@host:port/db`), then creates or migrates the
    /// schema. Refuses a database whose schema is newer than this binary knows. Every daemon
    /// sharing the ledger holds the same `master` key: fingerprints and the chain's HMAC are
    /// derived from it as for the sled ledger, and it is never stored in the database.
    pub async fn connect(url: &str, master: &[u8; 32]) -> Result<PgLedger> {
        let config: tokio_postgres::Config = url
            .parse()
            .map_err(|e: tokio_postgres::Error| PgLedgerError::Connect(error_chain(&e)))?;
        let manager = Manager::from_config(
            config,
            NoTls,
            ManagerConfig {
                recycling_method: RecyclingMethod::Fast,
            },
        );
        let pool = Pool::builder(manager)
            .max_size(16)
            .build()
            .map_err(|e| PgLedgerError::Connect(e.to_string()))?;
        let ledger = PgLedger {
            pool,
            keys: std::sync::Arc::new(derive_keys(master)),
        };
        ledger.migrate().await?;
        Ok(ledger)
    }

    /// The schema version this binary creates and reads.
    pub fn known_schema_version() -> u32 {
        MIGRATIONS.len() as u32
    }

    async fn migrate(&self) -> Result<()> {
        let mut client = self.pool.get().await?;
        let tx = client.transaction().await?;
        tx.execute("SELECT pg_advisory_xact_lock($1)", &[&MIGRATION_LOCK])
            .await?;
        tx.batch_execute("CREATE TABLE IF NOT EXISTS waymark_schema (version integer NOT NULL)")
            .await?;
        let found: Option<i32> = tx
            .query_opt("SELECT version FROM waymark_schema", &[])
            .await?
            .map(|r| r.get(0));
        let found = found.unwrap_or(0) as u32;
        let known = Self::known_schema_version();
        if found > known {
            return Err(PgLedgerError::SchemaTooNew { found, known });
        }
        for sql in &MIGRATIONS[found as usize..] {
            tx.batch_execute(sql).await?;
        }
        if found == 0 {
            tx.execute(
                "INSERT INTO waymark_schema (version) VALUES ($1)",
                &[&(known as i32)],
            )
            .await?;
        } else if found < known {
            tx.execute("UPDATE waymark_schema SET version = $1", &[&(known as i32)])
                .await?;
        }
        tx.commit().await?;
        Ok(())
    }

    /// The schema version stored in the database.
    pub async fn schema_version(&self) -> Result<u32> {
        let client = self.pool.get().await?;
        let row = client
            .query_one("SELECT version FROM waymark_schema", &[])
            .await?;
        Ok(row.get::<_, i32>(0) as u32)
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
        let mut client = self.pool.get().await?;
        let tx = client.transaction().await?;
        tx.execute(
            "SELECT pg_advisory_xact_lock($1)",
            &[&intent_lock(&new.fingerprint.0)],
        )
        .await?;
        let fingerprint = new.fingerprint.to_string();
        let rows = tx
            .query(
                "SELECT id, record FROM executions WHERE fingerprint = $1 ORDER BY id DESC",
                &[&fingerprint],
            )
            .await?;
        let priors: Vec<ExecutionRecord> = rows
            .iter()
            .map(|r| record_of(r.get(0), r.get(1)))
            .collect::<Result<_>>()?;
        let prior_views: Vec<PriorExecution> = priors
            .iter()
            .map(|r| PriorExecution {
                id: r.id,
                lifecycle: r.lifecycle,
                actor: r.actor.clone(),
                scope: r.scope.clone(),
                accepted_at: r.accepted_at,
                finished_at: r.finished_at,
            })
            .collect();
        match decide(&prior_views, call) {
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
        let mut client = self.pool.get().await?;
        let tx = client.transaction().await?;
        let row = tx
            .query_opt(
                "SELECT id, record, owner, epoch FROM executions WHERE id = $1 FOR UPDATE",
                &[&id.to_string()],
            )
            .await?
            .ok_or(PgLedgerError::NotFound(id))?;
        let owner: Option<String> = row.get(2);
        let epoch: i64 = row.get(3);
        if owner.as_deref() != Some(lease.owner.as_str()) || epoch != lease.epoch {
            return Err(PgLedgerError::Fenced {
                id,
                owner: owner.unwrap_or_else(|| "nobody".into()),
                epoch,
                mine: lease.epoch,
            });
        }
        let mut record = record_of(row.get(0), row.get(1))?;
        // The event's sequence number is known once it is appended: apply with the next one.
        let next = self.head_in(&tx).await?.seq + 1;
        let kind = record
            .apply(&transition, now, next)
            .map_err(|source| PgLedgerError::Illegal { id, source })?;
        let seq = append_event(&tx, &self.keys.1, now, Some(id), kind).await?;
        debug_assert_eq!(seq, next);
        tx.execute(
            "UPDATE executions SET state = $2, record = $3, updated_ms = $4 WHERE id = $1",
            &[
                &id.to_string(),
                &record.state().as_str(),
                &to_json(&record),
                &millis(now),
            ],
        )
        .await?;
        tx.commit().await?;
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
        let mut client = self.pool.get().await?;
        let tx = client.transaction().await?;
        let cutoff = millis(now.minus(dead_after));
        let rows = tx
            .query(
                "SELECT e.id, e.record, e.epoch FROM executions e
                 JOIN daemons d ON d.name = e.owner
                 WHERE d.heartbeat_ms < $1 AND e.owner <> $2
                   AND e.state NOT IN ('denied', 'expired', 'completed', 'failed', 'timed_out', 'cancelled', 'reviewed')
                 ORDER BY e.id
                 FOR UPDATE OF e SKIP LOCKED",
                &[&cutoff, &me],
            )
            .await?;
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

    /// The fingerprint key every daemon sharing this ledger uses.
    pub fn fingerprint_key(&self) -> FingerprintKey {
        self.keys.0.clone()
    }

    /// The chain's head inside `tx`, locked until it ends (so the next append is `seq + 1`).
    async fn head_in(&self, tx: &tokio_postgres::Transaction<'_>) -> Result<ChainHead> {
        let row = tx
            .query_one(
                "SELECT seq, hash FROM chain_head WHERE id = 1 FOR UPDATE",
                &[],
            )
            .await?;
        Ok(ChainHead {
            seq: row.get::<_, i64>(0) as u64,
            hash: row.get(1),
        })
    }

    /// The chain's head as committed.
    pub async fn head(&self) -> Result<ChainHead> {
        let client = self.pool.get().await?;
        let row = client
            .query_one("SELECT seq, hash FROM chain_head WHERE id = 1", &[])
            .await?;
        Ok(ChainHead {
            seq: row.get::<_, i64>(0) as u64,
            hash: row.get(1),
        })
    }

    /// Verifies the whole chain with the rule the sled ledger uses, against the stored head
    /// and, when given, a head exported earlier.
    pub async fn verify(&self, exported: Option<&ChainHead>) -> Result<VerifyReport> {
        let client = self.pool.get().await?;
        let tx_head = self.head().await?;
        let rows = client
            .query(
                "SELECT seq, body FROM events WHERE seq <= $1 ORDER BY seq",
                &[&(tx_head.seq as i64)],
            )
            .await?;
        let events = rows.iter().map(|r| {
            let seq = r.get::<_, i64>(0) as u64;
            let event = serde_json::from_value::<LedgerEvent>(r.get(1)).map_err(|e| e.to_string());
            (seq, event)
        });
        Ok(verify_events(
            &self.keys.1,
            &ChainHead::genesis(),
            events,
            &tx_head,
            exported,
        ))
    }

    /// How many executions are in `state` (for tests and, later, metrics).
    pub async fn count_in_state(&self, state: ExecState) -> Result<u64> {
        let client = self.pool.get().await?;
        let row = client
            .query_one(
                "SELECT count(*) FROM executions WHERE state = $1",
                &[&state.as_str()],
            )
            .await?;
        Ok(row.get::<_, i64>(0) as u64)
    }
}

/// Appends one event to the chain inside `tx`: the head row is locked for the rest of the
/// transaction, so appends from every daemon form one chain, one event at a time. Returns its
/// sequence number.
async fn append_event(
    tx: &tokio_postgres::Transaction<'_>,
    key: &ChainKey,
    at: Timestamp,
    execution: Option<ExecutionId>,
    kind: EventKind,
) -> Result<u64> {
    let head = tx
        .query_one(
            "SELECT seq, hash FROM chain_head WHERE id = 1 FOR UPDATE",
            &[],
        )
        .await?;
    let (prev_seq, prev): (i64, String) = (head.get(0), head.get(1));
    let mut event = LedgerEvent {
        seq: prev_seq as u64 + 1,
        at,
        execution,
        kind,
        prev,
        hash: String::new(),
    };
    event.hash = key.hash(&event);
    let body = serde_json::to_value(&event).expect("events serialize");
    tx.execute(
        "INSERT INTO events (seq, execution, body) VALUES ($1, $2, $3)",
        &[
            &(event.seq as i64),
            &execution.map(|id| id.to_string()),
            &body,
        ],
    )
    .await?;
    tx.execute(
        "UPDATE chain_head SET seq = $1, hash = $2 WHERE id = 1",
        &[&(event.seq as i64), &event.hash],
    )
    .await?;
    Ok(event.seq)
}

/// The advisory lock of an intent: the first 8 bytes of its fingerprint.
fn intent_lock(fingerprint: &[u8; 32]) -> i64 {
    i64::from_be_bytes(fingerprint[..8].try_into().expect("8 bytes"))
}

fn millis(t: Timestamp) -> i64 {
    t.as_millis() as i64
}

fn to_json(record: &ExecutionRecord) -> serde_json::Value {
    serde_json::to_value(record).expect("an execution record serializes")
}

fn record_of(id: String, value: serde_json::Value) -> Result<ExecutionRecord> {
    serde_json::from_value(value).map_err(|e| PgLedgerError::Record {
        id,
        reason: e.to_string(),
    })
}
