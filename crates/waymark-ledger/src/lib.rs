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
mod error;
mod executions;
mod files;
mod gc;
mod query;
mod records;
mod runs;
mod store;
mod write;

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use hmac::{Hmac, Mac};
use rand::RngCore;
use sha2::Sha256;
use waymark_core::{ExecutionId, FingerprintKey, IdGenerator, Timestamp};

pub use api::{prior_of, Intake, LedgerApi, LedgerFuture};
pub use chain::{verify_events, ChainBreak, ChainKey, ChainProblem, VerifyReport};
pub use error::{LedgerError, Result};
pub use gc::GcReport;
pub use query::{ListQuery, Page};
pub use records::{
    CapturedOutput, ChainHead, Durability, EventKind, ExecutionRecord, LedgerEvent, NewExecution,
    RunRecord, StoredResult,
};

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

impl Ledger {
    /// Opens (or creates) the ledger in `dir` with default options.
    pub fn open(dir: &Path) -> Result<Ledger> {
        Self::open_with(dir, LedgerOptions::default())
    }

    /// Opens (or creates) the ledger in `dir`.
    pub fn open_with(dir: &Path, options: LedgerOptions) -> Result<Ledger> {
        files::prepare_dir(dir)?;
        let master = files::load_or_create_key(dir)?;
        let store = Store::open(dir, options.cache_bytes)?;
        let head = store.chain_head()?;
        files::tighten_permissions(dir)?;
        let durable = head.seq;
        Ok(Ledger {
            inner: Arc::new(Inner {
                dir: dir.to_path_buf(),
                store,
                chain_key: derive_keys(&master).1,
                fingerprint_key: derive_keys(&master).0,
                writer: Mutex::new(Writer {
                    head,
                    ids: IdGenerator::default(),
                }),
                commit: GroupCommit::starting_at(durable),
                options,
            }),
        })
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
                inner.store.flush(inner.options.sync)?;
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
