//! Waymark's durable ledger, on sled 0.34.
//!
//! The ledger remembers every accepted execution and every step of its life, before and after
//! it touches the world. It holds:
//!
//! - `executions`: one record per execution id (time-sortable, so key order is time order);
//! - `by_fingerprint`: fingerprint → executions, newest first;
//! - `by_state`: state → executions, for reconciliation and listing;
//! - `events`: the append-only audit log, keyed by a u64 sequence, hash-chained with HMAC;
//! - `results`: captured output, size-capped, with the byte count and SHA-256 of all of it;
//! - `runs`: agent sessions (actor, transport, start and end, calls);
//! - `meta`: the chain head and the retention base.
//!
//! Every write is one sled transaction across these trees (record, indexes, event, chain head).
//! [`Durability::Flushed`] returns only once the write is on disk; concurrent callers share
//! flushes (group commit).
//!
//! ```no_run
//! use waymark_ledger::{Ledger, Durability};
//! let ledger = Ledger::open("/var/lib/waymark/ledger".as_ref()).unwrap();
//! let report = ledger.verify(None).unwrap();
//! assert!(report.is_ok(), "{:?}", report.broken);
//! ```
//!
//! What it does not do: decide anything. Which transition is legal comes from `waymark-core`;
//! which execution a call attaches to is the gateway's call, made with the core's matching rule.
//! Only this crate knows sled, and within it only `store`.

mod api;
mod audit;
mod chain;
mod commit;
mod compact;
mod error;
mod executions;
mod files;
mod gc;
mod query;
mod records;
mod restore;
mod runs;
mod store;
mod write;

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use hmac::{Hmac, Mac};
use rand::RngCore;
use sha2::Sha256;
use waymark_core::{ExecutionId, FingerprintKey, IdGenerator, Timestamp};

pub use api::{prior_of, Intake, LedgerApi, LedgerFuture, Progress};
pub use audit::PROGRESS_PAGE;
pub use chain::{
    verify_events, ChainBreak, ChainInput, ChainKey, ChainProblem, ChainWalk, StoredJson,
    VerifyReport,
};
pub use compact::CompactReport;
pub use error::{LedgerError, Result};
pub use files::{read_witness_at, write_witness_at};
pub use gc::{GcReport, GC_PAGE, PRUNE_CHUNK};
pub use query::{ListQuery, Page};
pub use records::{
    CapturedOutput, ChainHead, Durability, EventKind, ExecutionRecord, LedgerEvent, NewExecution,
    RunRecord, StoredResult,
};
pub use restore::RestoreReport;

use commit::GroupCommit;
use store::Store;

/// How a flushed write reaches the disk.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SyncMode {
    /// sled's own flush: `pwrite` + `sync_file_range`. Survives a process crash; see
    /// ARCHITECTURE.md for why that is not enough against power loss.
    SledFlush,
    /// sled's flush, then `fdatasync` on its data file: also pushes file size metadata and
    /// asks the device to flush its cache. The default.
    Fdatasync,
}

/// Options for [`Ledger::open_with`].
#[derive(Clone, Debug)]
pub struct LedgerOptions {
    pub sync: SyncMode,
    /// Bytes of each output stream stored in the ledger; the rest stays on the host.
    pub result_cap: usize,
    /// Bytes of sled's page cache. sled's own default (1 GiB) keeps every page the daemon
    /// ever wrote in memory; the working set (executions in flight, recent lookups) is small,
    /// and a miss costs a read from the OS page cache, not from the disk.
    pub cache_bytes: u64,
    /// Told how long each flush took (a group commit leader's sled flush and, by default, its
    /// fdatasync): the daemon's metrics. One call per flush, however many writes it covered.
    pub on_flush: Option<FlushObserver>,
    /// What to do when the ledger is behind its witness (see [`WitnessCheck`]).
    pub witness: WitnessCheck,
}

/// What opening a ledger does when its chain is behind the head its witness file saw made
/// durable, or its event at that position is another one.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum WitnessCheck {
    /// Refuse to open it ([`LedgerError::BehindWitness`], [`LedgerError::NotItsWitness`]): the
    /// daemon never serves a ledger that lost executions in flight without being told to.
    #[default]
    Refuse,
    /// Open it and say so in [`Ledger::verify`]'s report (`audit verify --ledger`).
    Report,
    /// Open it, record the operator's acceptance as an audit event, and take the current head
    /// as the witness from then on (`daemon --accept-rollback`).
    Accept,
}

/// Receives the duration of each flush that made the ledger's writes durable. The ledger
/// knows nothing of what is done with it (the daemon's metrics registry).
#[derive(Clone)]
pub struct FlushObserver(pub Arc<dyn Fn(std::time::Duration) + Send + Sync>);

impl std::fmt::Debug for FlushObserver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("FlushObserver")
    }
}

impl Default for LedgerOptions {
    fn default() -> Self {
        LedgerOptions {
            sync: SyncMode::Fdatasync,
            result_cap: 64 * 1024,
            cache_bytes: 8 * 1024 * 1024,
            on_flush: None,
            witness: WitnessCheck::Refuse,
        }
    }
}

/// A handle on an open ledger. Cheap to clone; all clones share one database.
#[derive(Clone)]
pub struct Ledger {
    inner: Arc<Inner>,
}

struct Inner {
    dir: PathBuf,
    store: Store,
    chain_key: ChainKey,
    fingerprint_key: FingerprintKey,
    /// Serializes writers: the chain head moves one event at a time.
    writer: Mutex<Writer>,
    commit: GroupCommit,
    options: LedgerOptions,
    /// The witness's head as read at open when it was ahead of this ledger or named another
    /// event (opened under [`WitnessCheck::Report`]): [`Ledger::verify`] reports it.
    witness_ahead: Option<ChainHead>,
    /// The identity shared by every copy of this ledger (derived from its master key).
    identity: String,
}

struct Writer {
    head: ChainHead,
    ids: IdGenerator,
}

fn derive_key(master: &[u8; 32], purpose: &[u8]) -> [u8; 32] {
    let mut mac = Hmac::<Sha256>::new_from_slice(master).expect("any key size");
    mac.update(purpose);
    mac.finalize().into_bytes().into()
}

/// The two keys derived from a ledger's master key, with distinct labels: for a backend that
/// keeps the master key elsewhere than `ledger.key` (the shared ledger).
pub fn derive_keys(master: &[u8; 32]) -> (FingerprintKey, ChainKey) {
    (
        FingerprintKey::from_bytes(derive_key(master, b"waymark intent fingerprint v1")),
        ChainKey(derive_key(master, b"waymark audit chain v1")),
    )
}

/// A ledger's identity: derived from its master key, so every daemon that shares a ledger (and
/// so its key) has the same one, and no two ledgers do. Not secret: it cannot give the key back.
pub fn ledger_identity(master: &[u8; 32]) -> String {
    hex::encode(&derive_key(master, b"waymark ledger identity v1")[..8])
}

impl Ledger {
    /// Opens the ledger in `dir` with default options; refuses when there is none
    /// ([`LedgerError::Missing`]): only [`Ledger::init`] makes a ledger.
    pub fn open(dir: &Path) -> Result<Ledger> {
        Self::open_with(dir, LedgerOptions::default())
    }

    /// Opens the ledger in `dir`; refuses when there is none ([`LedgerError::Missing`]), when
    /// it is damaged, and (unless `options.witness` says otherwise) when it is behind its
    /// witness.
    pub fn open_with(dir: &Path, options: LedgerOptions) -> Result<Ledger> {
        Self::open_mode(dir, options, files::Create::Never)
    }

    /// Opens the ledger in `dir`, making it first when the directory is missing or empty:
    /// `waymark init`, `daemon --init`, and tests.
    pub fn init(dir: &Path) -> Result<Ledger> {
        Self::init_with(dir, LedgerOptions::default())
    }

    /// [`Ledger::init`] with options.
    pub fn init_with(dir: &Path, options: LedgerOptions) -> Result<Ledger> {
        Self::open_mode(dir, options, files::Create::IfMissing)
    }

    fn open_mode(dir: &Path, options: LedgerOptions, create: files::Create) -> Result<Ledger> {
        files::prepare_dir(dir, create)?;
        let master = files::load_or_create_key(dir)?;
        let store = Store::open(dir, options.cache_bytes)?;
        let head = store.guard("reading the chain head", || store.chain_head())?;
        let witness_ahead = Self::check_witness(dir, &store, &head, options.witness)?;
        files::tighten_permissions(dir)?;
        let durable = head.seq;
        let (fingerprint_key, chain_key) = derive_keys(&master);
        let ledger = Ledger {
            inner: Arc::new(Inner {
                dir: dir.to_path_buf(),
                store,
                chain_key,
                fingerprint_key,
                writer: Mutex::new(Writer {
                    head,
                    ids: IdGenerator::default(),
                }),
                commit: GroupCommit::starting_at(durable),
                witness_ahead: witness_ahead
                    .clone()
                    .filter(|_| options.witness == WitnessCheck::Report),
                identity: ledger_identity(&master),
                options,
            }),
        };
        ledger.index_attrs_once()?;
        if let (Some(witness), WitnessCheck::Accept) = (witness_ahead, ledger.inner.options.witness)
        {
            let head = ledger.head();
            let data = serde_json::json!({
                "witness": witness,
                "head": head,
                "missing_events": witness.seq.saturating_sub(head.seq),
            });
            let now = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_millis() as u64);
            ledger.record_note(
                None,
                "rollback accepted",
                data,
                Timestamp::from_millis(now),
                Durability::Flushed,
            )?;
        }
        Ok(ledger)
    }

    /// Compares the head sled recovered with the witness file: `Some(witness)` when the ledger
    /// is behind it or differs from it, which `check` refuses or lets through.
    fn check_witness(
        dir: &Path,
        store: &Store,
        head: &ChainHead,
        check: WitnessCheck,
    ) -> Result<Option<ChainHead>> {
        // No readable witness proves nothing either way; the next flush writes it.
        let Some(witness) = files::read_witness(dir) else {
            return Ok(None);
        };
        let problem = if witness.seq > head.seq {
            Some(LedgerError::BehindWitness {
                path: dir.to_path_buf(),
                head: head.seq,
                witness: witness.seq,
            })
        } else {
            let base = store.guard("reading the chain base", || store.chain_base())?;
            let event = if witness.seq > base.seq {
                store.guard("reading an event", || store.event(witness.seq))?
            } else {
                None
            };
            let differs = match event {
                Some(e) => e.hash != witness.hash,
                None => witness.seq == head.seq && witness.seq > 0 && witness.hash != head.hash,
            };
            differs.then(|| LedgerError::NotItsWitness {
                path: dir.to_path_buf(),
                seq: witness.seq,
            })
        };
        match (problem, check) {
            (None, _) => Ok(None),
            (Some(e), WitnessCheck::Refuse) => Err(e),
            (Some(_), _) => Ok(Some(witness)),
        }
    }

    /// This ledger's identity ([`ledger_identity`]): hosts record it beside their markers.
    pub fn identity(&self) -> &str {
        &self.inner.identity
    }

    /// The witness's head when it was ahead of this ledger at open (opened to report it).
    pub fn witness_ahead(&self) -> Option<&ChainHead> {
        self.inner.witness_ahead.as_ref()
    }

    /// The directory this ledger lives in.
    pub fn dir(&self) -> &Path {
        &self.inner.dir
    }

    /// The key for intent fingerprints and secret MACs, derived from the ledger's master key.
    pub fn fingerprint_key(&self) -> FingerprintKey {
        self.inner.fingerprint_key.clone()
    }

    /// Mints a new execution id at `now`, strictly after every id this handle minted.
    pub fn mint_id(&self, now: Timestamp) -> ExecutionId {
        let mut random = [0u8; 16];
        rand::rngs::OsRng.fill_bytes(&mut random);
        let mut w = self.inner.writer.lock().expect("writer lock");
        w.ids.next(now, u128::from_be_bytes(random))
    }

    /// The current head of the audit chain, to export and keep elsewhere.
    pub fn head(&self) -> ChainHead {
        self.inner.writer.lock().expect("writer lock").head.clone()
    }

    /// Makes everything written so far durable.
    pub fn flush(&self) -> Result<()> {
        let t = self.head().seq;
        self.wait_durable(t)
    }

    /// Copies the ledger into `dest` (missing or empty) while it serves: writers wait while
    /// everything written is flushed and the files are copied, so the copy is the ledger as of
    /// one head, which it returns; the copy's witness names that head. Restoring it is
    /// documented in the README (the live witness then says how far behind it is).
    pub fn backup(&self, dest: &Path) -> Result<ChainHead> {
        let inner = &self.inner;
        files::prepare_backup_dir(dest)?;
        let w = inner.writer.lock().expect("writer lock");
        let head = w.head.clone();
        inner
            .store
            .flush(SyncMode::Fdatasync)
            .map_err(|detail| LedgerError::Storage {
                path: inner.dir.clone(),
                detail: format!("flush before the backup failed: {detail}"),
            })?;
        files::copy_ledger(&inner.dir, dest)?;
        drop(w);
        files::write_witness(dest, &head).map_err(|source| LedgerError::Io {
            path: dest.to_path_buf(),
            what: "cannot write the backup's witness",
            source,
        })?;
        files::tighten_permissions(dest)?;
        Ok(head)
    }

    /// Bytes sled uses on disk.
    pub fn size_on_disk(&self) -> Result<u64> {
        self.inner.store.size_on_disk()
    }

    /// Flushes performed so far (group commit makes this smaller than the flushed writes).
    pub fn flush_count(&self) -> u64 {
        self.inner.commit.flush_count()
    }

    fn wait_durable(&self, seq: u64) -> Result<()> {
        let inner = &self.inner;
        inner
            .commit
            .wait_durable(seq, || {
                let began = std::time::Instant::now();
                // Everything up to this head is in sled's buffers, so the flush covers it.
                let head = self.head();
                inner.store.flush(inner.options.sync)?;
                // The witness follows the flush, never precedes it. A failure to write it
                // leaves it lagging, which is safe; the write itself is durable.
                let _ = files::write_witness(&inner.dir, &head);
                if let Some(observe) = &inner.options.on_flush {
                    (observe.0)(began.elapsed());
                }
                Ok(())
            })
            .map_err(|detail| LedgerError::Storage {
                path: inner.dir.clone(),
                detail: format!("flush failed: {detail}"),
            })
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        let _ = self.store.flush(SyncMode::SledFlush);
        let _ = files::tighten_permissions(&self.dir);
    }
}
