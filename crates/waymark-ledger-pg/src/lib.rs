//! Waymark's shared ledger on PostgreSQL (issue 14): several daemons, one ledger.
//!
//! Tested against a real PostgreSQL: the versioned schema (created and migrated by the daemon;
//! a newer schema than the binary knows is refused), exactly-once matching across daemons,
//! ownership with fencing of executions in flight, one audit chain for all daemons (verified by
//! the sled ledger's rule), results, agent runs, settings, listing and retention. A daemon uses
//! it through [`PgBackend`], its [`waymark_ledger::LedgerApi`]. Retention removes resolved
//! executions but never prunes the shared chain.
//!
//! **One chain.** Every write appends its audit event in the same transaction as the change,
//! under the lock of the one `chain_head` row, so appends from every daemon form one chain;
//! `verify` walks it with `waymark_ledger::verify_events`. A daemon's concurrent writes of
//! executions share that transaction and that lock (group commit, `batch`): one head lock, one
//! commit and one WAL flush for many events.
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
//! **Durable means committed, in the WAL on disk.** A write's transaction commits without
//! waiting for the disk (it holds the chain head's lock until then); a flushed write is then
//! answered once an empty transaction under the connection's `synchronous_commit = on` has
//! committed, which returns once the WAL is on disk past the write, sharing WAL flushes with
//! every other session's. A buffered write is covered by the next flushed one.
//!
//! **What it is not.** The only crate that knows tokio-postgres. It does no I/O beyond the
//! database and reads no clock: every instant is a parameter, as in core.

mod backend;
mod batch;
mod chain;
mod executions;
mod facts;
mod reads;
mod schema;
mod tx;

use deadpool_postgres::{Manager, ManagerConfig, Pool, RecyclingMethod};
use tokio_postgres::NoTls;
use waymark_core::{error_chain, ExecutionId, FingerprintKey, IdGenerator, IllegalTransition};
use waymark_ledger::{derive_keys, ChainKey, ExecutionRecord, FlushObserver, LedgerError};

pub use backend::PgBackend;

/// Why a ledger operation failed.
#[derive(Clone, Debug, thiserror::Error)]
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
    /// The database holds no Waymark ledger, and this connection may not make one.
    #[error(
        "this PostgreSQL database holds no Waymark ledger: run `waymark init` (or `waymark \
         daemon --init`) to create one, or point `[ledger]`'s connection string at the database \
         that holds it (a wrong database would otherwise become a new ledger that knows none of \
         the executions in flight)"
    )]
    NoLedger,
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
    #[error(
        "another daemon named `{0}` is running on this ledger: each daemon sharing it needs \
         its own name (set `daemon_name` in [ledger]), or stop the other one first"
    )]
    NameTaken(String),
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

/// What the gateway sees: the ledger's own errors, a fence or a missing execution as such.
impl From<PgLedgerError> for LedgerError {
    fn from(e: PgLedgerError) -> Self {
        match e {
            PgLedgerError::Fenced {
                id,
                owner,
                epoch,
                mine,
            } => LedgerError::Fenced {
                id,
                owner,
                epoch,
                mine,
            },
            PgLedgerError::NotFound(id) => LedgerError::NotFound(id),
            PgLedgerError::Illegal { id, source } => LedgerError::Illegal { id, source },
            other => LedgerError::Database {
                at: "the PostgreSQL ledger".into(),
                detail: other.to_string(),
            },
        }
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
        action: waymark_core::AttachAction,
    },
}

/// The shared ledger.
#[derive(Clone)]
pub struct PgLedger {
    pool: Pool,
    keys: std::sync::Arc<(FingerprintKey, ChainKey)>,
    ids: std::sync::Arc<std::sync::Mutex<IdGenerator>>,
    /// Bytes of each output stream stored, as the sled ledger's `result_cap`.
    result_cap: usize,
    /// Writes waiting for the next group commit (`batch`).
    queue: std::sync::Arc<batch::Queue>,
    /// How to open a connection of its own, outside the pool (a daemon's name claim).
    config: std::sync::Arc<tokio_postgres::Config>,
    /// Told how long each flushed write waited for the WAL (the daemon's metrics).
    on_flush: Option<FlushObserver>,
    /// The identity every daemon sharing this ledger (and so its key) has.
    identity: String,
    /// Where this daemon keeps the chain head it saw made durable (see [`PgLedger::with_witness`]).
    witness: Option<std::sync::Arc<Witness>>,
}

/// A daemon's witness of the shared chain: the newest head one of its batches made durable,
/// in a file outside the database. It may lag (another daemon's writes, a crash, a write
/// outside the batches), never lead: it is written after the WAL flush that covers the head.
pub(crate) struct Witness {
    path: std::path::PathBuf,
    written: std::sync::Mutex<u64>,
}

impl Witness {
    /// Records `head`, made durable, unless a newer one was recorded already (flushes finish
    /// in any order). A failed write leaves the witness lagging, which is safe.
    pub(crate) fn saw(&self, head: &waymark_ledger::ChainHead) {
        let mut written = self.written.lock().expect("witness lock");
        if head.seq > *written && waymark_ledger::write_witness_at(&self.path, head).is_ok() {
            *written = head.seq;
        }
    }
}

impl PgLedger {
    /// Connects to `url` (`postgresql://user@host:port/db`), then creates or migrates the
    /// schema. Refuses a database whose schema is newer than this binary knows. Every daemon
    /// sharing the ledger holds the same `master` key: fingerprints and the chain's HMAC are
    /// derived from it as for the sled ledger, and it is never stored in the database.
    pub async fn connect(url: &str, master: &[u8; 32]) -> Result<PgLedger> {
        Self::connect_with(url, master, true).await
    }

    /// [`PgLedger::connect`] that refuses a database holding no ledger yet
    /// ([`PgLedgerError::NoLedger`]), creating nothing: what a daemon does unless told `--init`.
    pub async fn connect_existing(url: &str, master: &[u8; 32]) -> Result<PgLedger> {
        Self::connect_with(url, master, false).await
    }

    async fn connect_with(url: &str, master: &[u8; 32], create: bool) -> Result<PgLedger> {
        let mut config: tokio_postgres::Config = url
            .parse()
            .map_err(|e: tokio_postgres::Error| PgLedgerError::Connect(error_chain(&e)))?;
        // Durable means committed to the WAL on disk, whatever the server's default says.
        config.options("-c synchronous_commit=on");
        let manager = Manager::from_config(
            config.clone(),
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
            ids: std::sync::Arc::new(facts::id_generator()),
            result_cap: 64 * 1024,
            queue: Default::default(),
            config: std::sync::Arc::new(config),
            on_flush: None,
            identity: waymark_ledger::ledger_identity(master),
            witness: None,
        };
        ledger.migrate(create).await?;
        Ok(ledger)
    }

    /// Tells `observer` how long each flush waited for the WAL to reach the disk: the
    /// empty synchronous commit a flushed write ends with (see ARCHITECTURE.md).
    pub fn with_flush_observer(mut self, observer: FlushObserver) -> Self {
        self.on_flush = Some(observer);
        self
    }

    /// Keeps this daemon's witness of the chain in `path` (beside the key file): after each
    /// group commit's WAL flush, the head it made durable. [`PgLedger::check_witness`] compares
    /// the database with it at start, so a database restored from an older dump, or another
    /// database, is not served as if nothing happened.
    pub fn with_witness(mut self, path: std::path::PathBuf) -> Self {
        let written = waymark_ledger::read_witness_at(&path).map_or(0, |h| h.seq);
        self.witness = Some(std::sync::Arc::new(Witness {
            path,
            written: std::sync::Mutex::new(written),
        }));
        self
    }

    /// Compares the chain in the database with the witness in `path`: `None` when the witness
    /// is missing or the chain holds the event it names; otherwise the witness's head and
    /// whether the chain ends before it (`true`: events lost) or holds another event there.
    pub async fn check_witness(
        &self,
        path: &std::path::Path,
    ) -> Result<Option<(waymark_ledger::ChainHead, bool)>> {
        let Some(witness) = waymark_ledger::read_witness_at(path) else {
            return Ok(None);
        };
        let head = self.head().await?;
        if witness.seq > head.seq {
            return Ok(Some((witness, true)));
        }
        if witness.seq == 0 {
            return Ok(None);
        }
        let event = self.events(witness.seq, 1).await?;
        let differs = match event.first() {
            Some(e) if e.seq == witness.seq => e.hash != witness.hash,
            // Pruned by retention: nothing left to compare.
            _ => false,
        };
        Ok(differs.then_some((witness, false)))
    }

    /// The `synchronous_commit` this ledger's connections run with: always `on`, whatever the
    /// server's or the database's default (a flushed write relies on it).
    pub async fn synchronous_commit(&self) -> Result<String> {
        let client = self.pool.get().await?;
        let row = client.query_one("SHOW synchronous_commit", &[]).await?;
        Ok(row.get(0))
    }

    /// The fingerprint key every daemon sharing this ledger uses.
    pub fn fingerprint_key(&self) -> FingerprintKey {
        self.keys.0.clone()
    }

    /// This ledger's identity, derived from the master key every sharing daemon holds.
    pub fn identity(&self) -> &str {
        &self.identity
    }
}

pub(crate) fn millis(t: waymark_core::Timestamp) -> i64 {
    t.as_millis() as i64
}

pub(crate) fn to_json(record: &ExecutionRecord) -> serde_json::Value {
    serde_json::to_value(record).expect("an execution record serializes")
}

pub(crate) fn record_of(id: String, value: serde_json::Value) -> Result<ExecutionRecord> {
    serde_json::from_value(value).map_err(|e| PgLedgerError::Record {
        id,
        reason: e.to_string(),
    })
}
