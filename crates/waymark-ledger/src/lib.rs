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
//! Only this crate knows sled.

mod chain;
mod commit;
mod error;
mod files;
mod records;

use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use hmac::{Hmac, Mac};
use rand::RngCore;
use sha2::Sha256;
use sled::transaction::{ConflictableTransactionError, TransactionError};
use sled::Transactional;
use waymark_core::{
    Actor, AttachAction, ExecState, ExecutionId, Fingerprint, FingerprintKey, IdGenerator,
    Timestamp, Transition,
};

pub use chain::{ChainBreak, ChainProblem, VerifyReport};
pub use error::{LedgerError, Result};
pub use records::{
    CapturedOutput, ChainHead, Durability, EventKind, ExecutionRecord, LedgerEvent, NewExecution,
    RunRecord, StoredResult,
};

use chain::ChainKey;
use commit::GroupCommit;
use records::ResultHeader;

const HEAD_KEY: &[u8] = b"chain_head";
const BASE_KEY: &[u8] = b"chain_base";

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
}

impl Default for LedgerOptions {
    fn default() -> Self {
        LedgerOptions {
            sync: SyncMode::Fdatasync,
            result_cap: 64 * 1024,
            cache_bytes: 8 * 1024 * 1024,
        }
    }
}

/// Filters and paging for [`Ledger::list`].
#[derive(Clone, Debug, Default)]
pub struct ListQuery {
    pub state: Option<ExecState>,
    pub actor: Option<Actor>,
    pub host: Option<String>,
    pub tool: Option<String>,
    /// Accepted at or after.
    pub since: Option<Timestamp>,
    /// Accepted before.
    pub until: Option<Timestamp>,
    /// Continue after this id (the `next` of the previous page).
    pub after: Option<ExecutionId>,
    /// Page size; 0 means 100.
    pub limit: usize,
    /// Oldest first instead of newest first.
    pub oldest_first: bool,
}

/// One page of [`Ledger::list`].
#[derive(Clone, Debug)]
pub struct Page {
    pub items: Vec<ExecutionRecord>,
    /// Pass as `after` to get the next page; `None` when this was the last.
    pub next: Option<ExecutionId>,
}

/// What retention removed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GcReport {
    pub removed_executions: u64,
    pub kept_unresolved: u64,
    pub pruned_events_through: Option<u64>,
}

/// A handle on an open ledger. Cheap to clone; all clones share one database.
#[derive(Clone)]
pub struct Ledger {
    inner: Arc<Inner>,
}

struct Trees {
    executions: sled::Tree,
    by_fingerprint: sled::Tree,
    by_state: sled::Tree,
    events: sled::Tree,
    results: sled::Tree,
    runs: sled::Tree,
    meta: sled::Tree,
}

struct Inner {
    dir: PathBuf,
    db: sled::Db,
    t: Trees,
    chain_key: ChainKey,
    fingerprint_key: FingerprintKey,
    /// Serializes writers: the chain head moves one event at a time.
    writer: Mutex<Writer>,
    commit: GroupCommit,
    data_file: File,
    options: LedgerOptions,
}

struct Writer {
    head: ChainHead,
    ids: IdGenerator,
}

/// A staged write: the puts and deletes of one transaction.
#[derive(Default)]
struct Batch {
    ops: Vec<(TreeId, Vec<u8>, Option<Vec<u8>>)>,
}

#[derive(Clone, Copy)]
enum TreeId {
    Executions,
    ByFingerprint,
    ByState,
    Events,
    Results,
    Runs,
    Meta,
}

impl Batch {
    fn put(&mut self, t: TreeId, k: impl Into<Vec<u8>>, v: impl Into<Vec<u8>>) {
        self.ops.push((t, k.into(), Some(v.into())));
    }
    fn del(&mut self, t: TreeId, k: impl Into<Vec<u8>>) {
        self.ops.push((t, k.into(), None));
    }
}

fn derive_key(master: &[u8; 32], purpose: &[u8]) -> [u8; 32] {
    let mut mac = Hmac::<Sha256>::new_from_slice(master).expect("any key size");
    mac.update(purpose);
    mac.finalize().into_bytes().into()
}

fn fp_key(fp: &Fingerprint, id: ExecutionId) -> Vec<u8> {
    // Inverted id bytes: an ascending scan of the prefix yields the newest execution first.
    let mut k = fp.0.to_vec();
    k.extend(id.to_bytes().iter().map(|b| !b));
    k
}

fn state_key(state: ExecState, id: ExecutionId) -> Vec<u8> {
    let mut k = state.as_str().as_bytes().to_vec();
    k.push(0);
    k.extend(id.to_bytes());
    k
}

/// Output is stored in chunks this small so that no sled value, and no 16-item leaf of them,
/// crosses sled's blob threshold (segment size / 4): sled writes blob files without any
/// fsync, which would defeat the `Fdatasync` mode.
const RESULT_CHUNK: usize = 4096;

fn result_key(id: ExecutionId, part: u8, chunk: u32) -> Vec<u8> {
    let mut k = id.to_bytes().to_vec();
    k.push(part);
    k.extend(chunk.to_be_bytes());
    k
}

fn id_from_key(bytes: &[u8]) -> Option<ExecutionId> {
    let arr: [u8; 16] = bytes.try_into().ok()?;
    Some(ExecutionId::from_bytes(arr))
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
        let db_path = dir.join(files::DB_DIR);
        // sled releases its file lock only when its background flusher thread has exited,
        // a moment after the last handle is dropped; a reopen in that moment must not read as
        // "locked by another process". A real owner keeps it locked past this grace.
        let grace = std::time::Instant::now() + std::time::Duration::from_millis(1500);
        let db = loop {
            let opened = sled::Config::new()
                .path(&db_path)
                .flush_every_ms(Some(200))
                .cache_capacity(options.cache_bytes)
                .open()
                .map_err(|e| open_error(dir, e));
            match opened {
                Err(LedgerError::Locked { .. }) if std::time::Instant::now() < grace => {
                    std::thread::sleep(std::time::Duration::from_millis(20));
                }
                other => break other?,
            }
        };
        // Waiting out the grace, the directory may have been removed under us (a daemon that
        // lost a start race); sled would then have made a fresh database there. Refuse it.
        if !dir.join(files::IDENTITY_FILE).exists() {
            return Err(LedgerError::Foreign {
                path: dir.to_path_buf(),
            });
        }
        let storage = |e: sled::Error| open_error(dir, e);
        let t = Trees {
            executions: db.open_tree("executions").map_err(storage)?,
            by_fingerprint: db.open_tree("by_fingerprint").map_err(storage)?,
            by_state: db.open_tree("by_state").map_err(storage)?,
            events: db.open_tree("events").map_err(storage)?,
            results: db.open_tree("results").map_err(storage)?,
            runs: db.open_tree("runs").map_err(storage)?,
            meta: db.open_tree("meta").map_err(storage)?,
        };
        let data_path = db_path.join("db");
        let data_file = File::open(&data_path).map_err(|source| LedgerError::Io {
            path: data_path.clone(),
            what: "cannot open sled's data file for fdatasync",
            source,
        })?;
        let head = match t.meta.get(HEAD_KEY).map_err(storage)? {
            Some(v) => serde_json::from_slice(&v).map_err(|e| LedgerError::Corrupt {
                path: dir.to_path_buf(),
                detail: format!("the chain head record is unreadable ({e})"),
            })?,
            None => {
                if !t.events.is_empty() {
                    return Err(LedgerError::Corrupt {
                        path: dir.to_path_buf(),
                        detail: "events exist but the chain head record is missing".into(),
                    });
                }
                ChainHead::genesis()
            }
        };
        files::tighten_permissions(dir)?;
        let durable = head.seq;
        Ok(Ledger {
            inner: Arc::new(Inner {
                dir: dir.to_path_buf(),
                db,
                t,
                chain_key: ChainKey(derive_key(&master, b"waymark audit chain v1")),
                fingerprint_key: FingerprintKey::from_bytes(derive_key(
                    &master,
                    b"waymark intent fingerprint v1",
                )),
                writer: Mutex::new(Writer {
                    head,
                    ids: IdGenerator::default(),
                }),
                commit: GroupCommit::starting_at(durable),
                data_file,
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

    /// Records a newly accepted execution.
    pub fn accept(
        &self,
        new: NewExecution,
        now: Timestamp,
        durability: Durability,
    ) -> Result<ExecutionRecord> {
        let id = new.id;
        let (record, _) = self.write(now, durability, |inner, seq, batch| {
            if inner
                .t
                .executions
                .contains_key(id.to_bytes())
                .map_err(|e| inner.storage(e))?
            {
                return Err(LedgerError::Duplicate(id));
            }
            let record = ExecutionRecord {
                id,
                fingerprint: new.fingerprint,
                action: new.action.clone(),
                actor: new.actor.clone(),
                scope: new.scope.clone(),
                tool: new.tool.clone(),
                host: new.host.clone(),
                contract: new.contract,
                run: new.run.clone(),
                lifecycle: waymark_core::Lifecycle::accepted(),
                accepted_at: now,
                updated_at: now,
                finished_at: None,
                outcome: None,
                reason: None,
                dispatch_attempts: 0,
                first_seq: seq,
                last_seq: seq,
            };
            batch.put(TreeId::Executions, id.to_bytes(), to_json(&record));
            batch.put(TreeId::ByFingerprint, fp_key(&record.fingerprint, id), []);
            batch.put(TreeId::ByState, state_key(ExecState::Accepted, id), []);
            let kind = EventKind::Accepted {
                fingerprint: new.fingerprint,
                actor: new.actor.clone(),
                tool: new.tool.clone(),
                host: new.host.clone(),
                scope: new.scope.clone(),
                run: new.run.clone(),
            };
            Ok((record, Some(id), kind))
        })?;
        Ok(record)
    }

    /// Applies a lifecycle transition to an execution, with its audit event, atomically.
    pub fn transition(
        &self,
        id: ExecutionId,
        transition: Transition,
        now: Timestamp,
        durability: Durability,
    ) -> Result<ExecutionRecord> {
        self.transition_inner(id, transition, None, now, durability)
    }

    /// Like [`Ledger::transition`], storing the execution's result in the same transaction.
    pub fn transition_with_result(
        &self,
        id: ExecutionId,
        transition: Transition,
        result: StoredResult,
        now: Timestamp,
        durability: Durability,
    ) -> Result<ExecutionRecord> {
        self.transition_inner(id, transition, Some(result), now, durability)
    }

    fn transition_inner(
        &self,
        id: ExecutionId,
        transition: Transition,
        result: Option<StoredResult>,
        now: Timestamp,
        durability: Durability,
    ) -> Result<ExecutionRecord> {
        let cap = self.inner.options.result_cap;
        let (record, _) = self.write(now, durability, |inner, seq, batch| {
            let mut rec = inner.get_record(id)?.ok_or(LedgerError::NotFound(id))?;
            let from = rec.lifecycle.state;
            rec.lifecycle = rec
                .lifecycle
                .apply(&transition)
                .map_err(|source| LedgerError::Illegal { id, source })?;
            let to = rec.lifecycle.state;
            match &transition {
                Transition::Dispatch { .. } => rec.dispatch_attempts += 1,
                Transition::Finished { outcome } => rec.outcome = Some(outcome.clone()),
                Transition::Deny { reason, .. }
                | Transition::NotStarted { reason }
                | Transition::Lost { reason } => rec.reason = Some(reason.clone()),
                Transition::Review { note, verdict, .. } => {
                    rec.reason = Some(format!("reviewed ({verdict:?}): {note}"))
                }
                _ => {}
            }
            if rec.finished_at.is_none() && rec.lifecycle.result_observed {
                rec.finished_at = Some(now);
            }
            rec.updated_at = now;
            rec.last_seq = seq;
            if from != to {
                batch.del(TreeId::ByState, state_key(from, id));
                batch.put(TreeId::ByState, state_key(to, id), []);
            }
            batch.put(TreeId::Executions, id.to_bytes(), to_json(&rec));
            if let Some(r) = &result {
                let mut stdout = r.stdout.clone();
                let mut stderr = r.stderr.clone();
                stdout.head.truncate(cap);
                stderr.head.truncate(cap);
                let header = ResultHeader {
                    stdout: stdout.clone(),
                    stderr: stderr.clone(),
                };
                batch.put(TreeId::Results, result_key(id, 0, 0), to_json(&header));
                for (part, bytes) in [(1u8, &stdout.head), (2u8, &stderr.head)] {
                    for (i, chunk) in bytes.chunks(RESULT_CHUNK).enumerate() {
                        batch.put(TreeId::Results, result_key(id, part, i as u32), chunk);
                    }
                }
            }
            let kind = EventKind::Transition {
                from,
                to,
                transition: transition.clone(),
            };
            Ok((rec, Some(id), kind))
        })?;
        Ok(record)
    }

    /// Records that a later call attached to `id` instead of starting a new execution.
    pub fn record_attach(
        &self,
        id: ExecutionId,
        actor: Actor,
        action: AttachAction,
        run: Option<String>,
        now: Timestamp,
        durability: Durability,
    ) -> Result<ExecutionRecord> {
        let (rec, _) = self.write(now, durability, |inner, seq, batch| {
            let mut rec = inner.get_record(id)?.ok_or(LedgerError::NotFound(id))?;
            rec.last_seq = seq;
            batch.put(TreeId::Executions, id.to_bytes(), to_json(&rec));
            Ok((
                rec,
                Some(id),
                EventKind::Attached {
                    actor: actor.clone(),
                    action,
                    run: run.clone(),
                },
            ))
        })?;
        Ok(rec)
    }

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
        let key = format!("setting:{name}");
        match self
            .inner
            .t
            .meta
            .get(key.as_bytes())
            .map_err(|e| self.inner.storage(e))?
        {
            Some(v) => Ok(Some(self.inner.parse(&v, "setting")?)),
            None => Ok(None),
        }
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
            batch.put(
                TreeId::Meta,
                format!("setting:{name}").into_bytes(),
                to_json(&value),
            );
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
            batch.put(TreeId::Runs, run.id.as_bytes(), to_json(&run));
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

    /// Counts a call in a run (buffered: a lost count is not a lost fact, the execution
    /// records carry their run).
    pub fn count_call(&self, run_id: &str) -> Result<()> {
        let tree = &self.inner.t.runs;
        let _guard = self.inner.writer.lock().expect("writer lock");
        if let Some(v) = tree
            .get(run_id.as_bytes())
            .map_err(|e| self.inner.storage(e))?
        {
            let mut run: RunRecord = self.inner.parse(&v, "run")?;
            run.calls += 1;
            tree.insert(run_id.as_bytes(), to_json(&run))
                .map_err(|e| self.inner.storage(e))?;
        }
        Ok(())
    }

    /// Ends an agent run.
    pub fn end_run(&self, run_id: &str, now: Timestamp, durability: Durability) -> Result<()> {
        self.write(now, durability, |inner, _, batch| {
            if let Some(v) = inner
                .t
                .runs
                .get(run_id.as_bytes())
                .map_err(|e| inner.storage(e))?
            {
                let mut run: RunRecord = inner.parse(&v, "run")?;
                run.ended_at = Some(now);
                batch.put(TreeId::Runs, run_id.as_bytes(), to_json(&run));
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

    /// Agent runs, newest first.
    pub fn runs(&self, limit: usize) -> Result<Vec<RunRecord>> {
        let mut out = Vec::new();
        for item in self.inner.t.runs.iter().rev().take(limit.max(1)) {
            let (_, v) = item.map_err(|e| self.inner.storage(e))?;
            out.push(self.inner.parse(&v, "run")?);
        }
        Ok(out)
    }

    /// The execution with this id.
    pub fn get(&self, id: ExecutionId) -> Result<Option<ExecutionRecord>> {
        self.inner.get_record(id)
    }

    /// Executions with this fingerprint, newest first.
    pub fn by_fingerprint(&self, fp: &Fingerprint) -> Result<Vec<ExecutionRecord>> {
        let mut out = Vec::new();
        for item in self.inner.t.by_fingerprint.scan_prefix(fp.0) {
            let (k, _) = item.map_err(|e| self.inner.storage(e))?;
            let inverted: Vec<u8> = k[32..].iter().map(|b| !b).collect();
            let id = id_from_key(&inverted)
                .ok_or_else(|| self.inner.corrupt("bad fingerprint index key"))?;
            if let Some(rec) = self.inner.get_record(id)? {
                out.push(rec);
            }
        }
        Ok(out)
    }

    /// Executions matching `q`, one page at a time.
    pub fn list(&self, q: &ListQuery) -> Result<Page> {
        let limit = if q.limit == 0 { 100 } else { q.limit };
        let lo = q
            .since
            .map(ExecutionId::lower_bound)
            .map(|i| i.to_bytes().to_vec())
            .unwrap_or_default();
        let hi = q
            .until
            .map(ExecutionId::lower_bound)
            .map(|i| i.to_bytes().to_vec())
            .unwrap_or(vec![0xff; 17]);
        let (lo, hi) = match (q.after, q.oldest_first) {
            (Some(after), true) => {
                let mut k = after.to_bytes().to_vec();
                k.push(0);
                (lo.max(k), hi)
            }
            (Some(after), false) => (lo, hi.min(after.to_bytes().to_vec())),
            (None, _) => (lo, hi),
        };
        let matches = |r: &ExecutionRecord| {
            q.state.is_none_or(|s| r.lifecycle.state == s)
                && q.actor.as_ref().is_none_or(|a| &r.actor == a)
                && q.host.as_ref().is_none_or(|h| &r.host == h)
                && q.tool.as_ref().is_none_or(|t| &r.tool == t)
        };
        let mut items = Vec::new();
        let mut push = |rec: ExecutionRecord| -> bool {
            if matches(&rec) {
                items.push(rec);
            }
            items.len() > limit
        };
        if lo < hi {
            if let Some(state) = q.state {
                // The state index keeps reconciliation scans proportional to what is in flight.
                let mut plo = state_key(state, ExecutionId::from_bytes([0; 16]));
                plo.truncate(plo.len() - 16);
                let (mut a, mut b) = (plo.clone(), plo.clone());
                a.extend(&lo);
                b.extend(&hi);
                let iter = self.inner.t.by_state.range(a..b);
                let ids: Box<dyn Iterator<Item = _>> = if q.oldest_first {
                    Box::new(iter)
                } else {
                    Box::new(iter.rev())
                };
                for item in ids {
                    let (k, _) = item.map_err(|e| self.inner.storage(e))?;
                    let id = id_from_key(&k[plo.len()..])
                        .ok_or_else(|| self.inner.corrupt("bad state index key"))?;
                    if let Some(rec) = self.inner.get_record(id)? {
                        if push(rec) {
                            break;
                        }
                    }
                }
            } else {
                let iter = self.inner.t.executions.range(lo..hi);
                let rows: Box<dyn Iterator<Item = _>> = if q.oldest_first {
                    Box::new(iter)
                } else {
                    Box::new(iter.rev())
                };
                for item in rows {
                    let (_, v) = item.map_err(|e| self.inner.storage(e))?;
                    if push(self.inner.parse(&v, "execution")?) {
                        break;
                    }
                }
            }
        }
        let next = if items.len() > limit {
            items.truncate(limit);
            items.last().map(|r| r.id)
        } else {
            None
        };
        Ok(Page { items, next })
    }

    /// The stored result of an execution.
    pub fn result(&self, id: ExecutionId) -> Result<Option<StoredResult>> {
        let t = &self.inner.t.results;
        let Some(h) = t
            .get(result_key(id, 0, 0))
            .map_err(|e| self.inner.storage(e))?
        else {
            return Ok(None);
        };
        let header: ResultHeader = self.inner.parse(&h, "result")?;
        let get = |part: u8| -> Result<Vec<u8>> {
            let mut prefix = id.to_bytes().to_vec();
            prefix.push(part);
            let mut out = Vec::new();
            for item in t.scan_prefix(prefix) {
                out.extend_from_slice(&item.map_err(|e| self.inner.storage(e))?.1);
            }
            Ok(out)
        };
        let mut stdout = header.stdout;
        let mut stderr = header.stderr;
        stdout.head = get(1)?;
        stderr.head = get(2)?;
        Ok(Some(StoredResult { stdout, stderr }))
    }

    /// Audit events of one execution, in order.
    pub fn events_of(&self, id: ExecutionId) -> Result<Vec<LedgerEvent>> {
        let Some(rec) = self.get(id)? else {
            return Ok(Vec::new());
        };
        let mut out = Vec::new();
        for item in self
            .inner
            .t
            .events
            .range(rec.first_seq.to_be_bytes()..=rec.last_seq.to_be_bytes())
        {
            let (_, v) = item.map_err(|e| self.inner.storage(e))?;
            let ev: LedgerEvent = self.inner.parse(&v, "event")?;
            if ev.execution == Some(id) {
                out.push(ev);
            }
        }
        Ok(out)
    }

    /// Audit events from `from` on, at most `limit`.
    pub fn events(&self, from: u64, limit: usize) -> Result<Vec<LedgerEvent>> {
        let mut out = Vec::new();
        for item in self.inner.t.events.range(from.to_be_bytes()..).take(limit) {
            let (_, v) = item.map_err(|e| self.inner.storage(e))?;
            out.push(self.inner.parse(&v, "event")?);
        }
        Ok(out)
    }

    /// The current head of the audit chain, to export and keep elsewhere.
    pub fn head(&self) -> ChainHead {
        self.inner.writer.lock().expect("writer lock").head.clone()
    }

    /// Walks the audit chain from genesis (or the retention checkpoint) and reports the first
    /// bad event. With `exported`, also proves that the chain still reaches that head.
    pub fn verify(&self, exported: Option<&ChainHead>) -> Result<VerifyReport> {
        let inner = &self.inner;
        let base: ChainHead = match inner.t.meta.get(BASE_KEY).map_err(|e| inner.storage(e))? {
            Some(v) => inner.parse(&v, "chain base")?,
            None => ChainHead::genesis(),
        };
        let stored_head = self.head();
        // An event the storage cannot read is reported at its position (the one after the
        // last event read), like any other break, not as a bare storage error.
        let mut last_seq = base.seq;
        let events = inner.t.events.iter().map(|item| match item {
            Ok((k, v)) => {
                let seq = u64::from_be_bytes(k.as_ref().try_into().unwrap_or([0xff; 8]));
                let ev = serde_json::from_slice::<LedgerEvent>(&v).map_err(|e| e.to_string());
                last_seq = last_seq.max(seq);
                (seq, ev)
            }
            Err(e) => (
                last_seq + 1,
                Err(format!("the storage cannot read it: {e}")),
            ),
        });
        // The iterator ends at the first unreadable event: verify_events stops there.
        let report = chain::verify_events(&inner.chain_key, &base, events, &stored_head, exported);
        Ok(report)
    }

    /// Removes resolved executions accepted before `older_than` and prunes the audit events
    /// that only they needed, leaving a checkpoint event so the chain still verifies.
    /// Never removes an execution that still needs attention.
    pub fn gc(&self, older_than: Timestamp, now: Timestamp) -> Result<GcReport> {
        let inner = &self.inner;
        let hi = ExecutionId::lower_bound(older_than).to_bytes();
        let mut victims = Vec::new();
        let mut kept_unresolved = 0;
        let mut oldest_kept_seq = None;
        for item in inner.t.executions.iter() {
            let (k, v) = item.map_err(|e| inner.storage(e))?;
            let rec: ExecutionRecord = inner.parse(&v, "execution")?;
            if k.as_ref() < hi.as_slice()
                && rec.lifecycle.state.is_final()
                && !rec.lifecycle.needs_attention()
            {
                victims.push(rec);
            } else {
                if rec.lifecycle.needs_attention() {
                    kept_unresolved += 1;
                }
                oldest_kept_seq =
                    Some(oldest_kept_seq.map_or(rec.first_seq, |s: u64| s.min(rec.first_seq)));
            }
        }
        // Events before the cutoff, and before the first event of any kept execution, go.
        let mut prune_through = 0;
        for item in inner.t.events.iter() {
            let (k, v) = item.map_err(|e| inner.storage(e))?;
            let seq = u64::from_be_bytes(k.as_ref().try_into().unwrap_or([0; 8]));
            let ev: LedgerEvent = inner.parse(&v, "event")?;
            if ev.at >= older_than || oldest_kept_seq.is_some_and(|s| seq >= s) {
                break;
            }
            prune_through = seq;
        }
        let current_base: ChainHead =
            match inner.t.meta.get(BASE_KEY).map_err(|e| inner.storage(e))? {
                Some(v) => inner.parse(&v, "chain base")?,
                None => ChainHead::genesis(),
            };
        let prune = prune_through > current_base.seq;
        let pruned_head = if prune {
            let v = inner
                .t
                .events
                .get(prune_through.to_be_bytes())
                .map_err(|e| inner.storage(e))?
                .ok_or_else(|| inner.corrupt("event to prune vanished"))?;
            inner.parse::<LedgerEvent>(&v, "event")?.hash
        } else {
            current_base.hash.clone()
        };
        let mut result_keys = Vec::new();
        for rec in &victims {
            for item in inner.t.results.scan_prefix(rec.id.to_bytes()) {
                result_keys.push(item.map_err(|e| inner.storage(e))?.0.to_vec());
            }
        }
        let removed = victims.len() as u64;
        let new_base = ChainHead {
            seq: if prune {
                prune_through
            } else {
                current_base.seq
            },
            hash: pruned_head.clone(),
        };
        // One transaction: remove the records, move the base, append the checkpoint.
        self.write(now, Durability::Flushed, |_, _, batch| {
            for rec in &victims {
                batch.del(TreeId::Executions, rec.id.to_bytes());
                batch.del(TreeId::ByFingerprint, fp_key(&rec.fingerprint, rec.id));
                batch.del(TreeId::ByState, state_key(rec.lifecycle.state, rec.id));
            }
            for k in &result_keys {
                batch.del(TreeId::Results, k.clone());
            }
            batch.put(TreeId::Meta, BASE_KEY, to_json(&new_base));
            let kind = EventKind::Checkpoint {
                pruned_through: new_base.seq,
                pruned_head: new_base.hash.clone(),
                removed_executions: removed,
            };
            Ok(((), None, kind))
        })
        .map(|_| ())?;
        if prune {
            // Outside the transaction: events at or below the base are ignored by verify, so a
            // crash here leaves only harmless leftovers that the next gc removes.
            let mut seqs = Vec::new();
            for item in inner.t.events.range(..=prune_through.to_be_bytes()) {
                seqs.push(item.map_err(|e| inner.storage(e))?.0);
            }
            for chunk in seqs.chunks(1000) {
                let mut b = sled::Batch::default();
                for k in chunk {
                    b.remove(k.clone());
                }
                inner
                    .t
                    .events
                    .apply_batch(b)
                    .map_err(|e| inner.storage(e))?;
            }
            self.flush()?;
        }
        Ok(GcReport {
            removed_executions: removed,
            kept_unresolved,
            pruned_events_through: prune.then_some(prune_through),
        })
    }

    /// Makes everything written so far durable.
    pub fn flush(&self) -> Result<()> {
        let t = self.head().seq;
        self.wait_durable(t)
    }

    /// Bytes sled uses on disk.
    pub fn size_on_disk(&self) -> Result<u64> {
        self.inner
            .db
            .size_on_disk()
            .map_err(|e| self.inner.storage(e))
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
                inner.db.flush().map_err(|e| e.to_string())?;
                if inner.options.sync == SyncMode::Fdatasync {
                    inner.data_file.sync_data().map_err(|e| e.to_string())?;
                }
                Ok(())
            })
            .map_err(|detail| LedgerError::Storage {
                path: inner.dir.clone(),
                detail: format!("flush failed: {detail}"),
            })
    }

    /// The one write path: stage changes under the writer lock, append the chained event, and
    /// commit everything in one sled transaction.
    fn write<T>(
        &self,
        now: Timestamp,
        durability: Durability,
        stage: impl FnOnce(&Inner, u64, &mut Batch) -> Result<(T, Option<ExecutionId>, EventKind)>,
    ) -> Result<(T, u64)> {
        let inner = &self.inner;
        let (value, seq) = {
            let mut w = inner.writer.lock().expect("writer lock");
            let seq = w.head.seq + 1;
            let mut batch = Batch::default();
            let (value, execution, kind) = stage(inner, seq, &mut batch)?;
            let mut event = LedgerEvent {
                seq,
                at: now,
                execution,
                kind,
                prev: w.head.hash.clone(),
                hash: String::new(),
            };
            event.hash = inner.chain_key.hash(&event);
            let head = ChainHead {
                seq,
                hash: event.hash.clone(),
            };
            batch.put(TreeId::Events, seq.to_be_bytes(), to_json(&event));
            batch.put(TreeId::Meta, HEAD_KEY, to_json(&head));
            inner.commit_batch(batch)?;
            w.head = head;
            inner.commit.written(seq);
            (value, seq)
        };
        if durability == Durability::Flushed {
            self.wait_durable(seq)?;
        }
        Ok((value, seq))
    }
}

impl Inner {
    fn storage(&self, e: sled::Error) -> LedgerError {
        LedgerError::Storage {
            path: self.dir.clone(),
            detail: e.to_string(),
        }
    }

    fn corrupt(&self, detail: &str) -> LedgerError {
        LedgerError::Corrupt {
            path: self.dir.clone(),
            detail: detail.to_string(),
        }
    }

    fn parse<T: serde::de::DeserializeOwned>(&self, bytes: &[u8], what: &str) -> Result<T> {
        serde_json::from_slice(bytes).map_err(|e| LedgerError::Corrupt {
            path: self.dir.clone(),
            detail: format!("a stored {what} is unreadable ({e})"),
        })
    }

    fn get_record(&self, id: ExecutionId) -> Result<Option<ExecutionRecord>> {
        match self
            .t
            .executions
            .get(id.to_bytes())
            .map_err(|e| self.storage(e))?
        {
            Some(v) => Ok(Some(self.parse(&v, "execution")?)),
            None => Ok(None),
        }
    }

    fn commit_batch(&self, batch: Batch) -> Result<()> {
        let t = &self.t;
        let trees = (
            &t.executions,
            &t.by_fingerprint,
            &t.by_state,
            &t.events,
            &t.results,
            &t.runs,
            &t.meta,
        );
        let result: std::result::Result<(), TransactionError<()>> =
            trees.transaction(|(ex, fp, st, ev, rs, ru, me)| {
                for (tree, k, v) in &batch.ops {
                    let tt = match tree {
                        TreeId::Executions => ex,
                        TreeId::ByFingerprint => fp,
                        TreeId::ByState => st,
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
}

impl Drop for Inner {
    fn drop(&mut self) {
        let _ = self.db.flush();
        let _ = files::tighten_permissions(&self.dir);
    }
}

fn to_json<T: serde::Serialize>(v: &T) -> Vec<u8> {
    serde_json::to_vec(v).expect("ledger records serialize")
}

fn open_error(dir: &Path, e: sled::Error) -> LedgerError {
    let text = e.to_string();
    if text.contains("could not acquire lock") {
        return LedgerError::Locked {
            path: dir.to_path_buf(),
        };
    }
    match e {
        sled::Error::Io(source) => LedgerError::Io {
            path: dir.to_path_buf(),
            what: "cannot open the database",
            source,
        },
        sled::Error::Corruption { .. } => LedgerError::Corrupt {
            path: dir.to_path_buf(),
            detail: format!("sled reports corruption ({text})"),
        },
        _ => LedgerError::Corrupt {
            path: dir.to_path_buf(),
            detail: text,
        },
    }
}
