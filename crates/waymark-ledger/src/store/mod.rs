//! Everything that knows sled: the trees, how keys encode what they index, the reads, and the
//! one transaction that changes them ([`Batch`], committed only by `Ledger::write`'s path).
//!
//! The rest of the crate speaks in records (executions, events, runs, settings) and decides
//! what changes; this module only stores and finds them, so another backend would implement
//! the same reads and the same batch of changes.

mod batch;
mod compact;
mod keys;
mod read;

use std::fs::File;
use std::path::{Path, PathBuf};

pub(crate) use batch::Batch;

use crate::error::{LedgerError, Result};
use crate::files;
use crate::SyncMode;

/// The sled database of one ledger and its trees.
pub(crate) struct Store {
    dir: PathBuf,
    db: sled::Db,
    t: Trees,
    /// sled's data file, for `fdatasync`.
    data_file: File,
}

struct Trees {
    executions: sled::Tree,
    by_fingerprint: sled::Tree,
    by_state: sled::Tree,
    /// Tool, host and actor → executions: `exec list` by what users filter on.
    by_attr: sled::Tree,
    events: sled::Tree,
    results: sled::Tree,
    runs: sled::Tree,
    meta: sled::Tree,
}

impl Store {
    /// Opens sled in `dir`'s database directory, which `files::prepare_dir` made or checked.
    /// sled 0.34 panics on some damaged files; that is a [`LedgerError::Corrupt`] here.
    pub(crate) fn open(dir: &Path, cache_bytes: u64) -> Result<Store> {
        guard(dir, "opening the database", || {
            Self::open_unguarded(dir, cache_bytes)
        })
    }

    /// Runs `f`, a read of sled's files, turning a panic of sled's (some damaged pages make
    /// it panic instead of returning an error) into [`LedgerError::Corrupt`].
    pub(crate) fn guard<T>(&self, what: &str, f: impl FnOnce() -> Result<T>) -> Result<T> {
        guard(&self.dir, what, f)
    }

    fn open_unguarded(dir: &Path, cache_bytes: u64) -> Result<Store> {
        let db_path = dir.join(files::DB_DIR);
        // sled releases its file lock only when its background flusher thread has exited,
        // a moment after the last handle is dropped; a reopen in that moment must not read as
        // "locked by another process". A real owner keeps it locked past this grace.
        let grace = std::time::Instant::now() + std::time::Duration::from_millis(1500);
        let db = loop {
            let opened = sled::Config::new()
                .path(&db_path)
                .flush_every_ms(Some(200))
                .cache_capacity(cache_bytes)
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
            by_attr: db.open_tree("by_attr").map_err(storage)?,
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
        Ok(Store {
            dir: dir.to_path_buf(),
            db,
            t,
            data_file,
        })
    }

    /// Makes every write so far durable (the group commit leader's flush).
    pub(crate) fn flush(&self, sync: SyncMode) -> std::result::Result<(), String> {
        self.db.flush().map_err(|e| e.to_string())?;
        if sync == SyncMode::Fdatasync {
            self.data_file.sync_data().map_err(|e| e.to_string())?;
        }
        Ok(())
    }

    /// Bytes sled uses on disk.
    pub(crate) fn size_on_disk(&self) -> Result<u64> {
        self.db.size_on_disk().map_err(|e| self.storage(e))
    }

    /// A sled error of a read or write: corruption sled found in its files is damage
    /// ([`LedgerError::Corrupt`]), the rest a storage failure.
    fn storage(&self, e: sled::Error) -> LedgerError {
        match e {
            sled::Error::Corruption { .. } => corruption(&self.dir, &e),
            e => LedgerError::Storage {
                path: self.dir.clone(),
                detail: e.to_string(),
            },
        }
    }

    pub(crate) fn corrupt(&self, detail: &str) -> LedgerError {
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
}

fn to_json<T: serde::Serialize>(v: &T) -> Vec<u8> {
    serde_json::to_vec(v).expect("ledger records serialize")
}

/// See [`Store::guard`].
pub(crate) fn guard<T>(dir: &Path, what: &str, f: impl FnOnce() -> Result<T>) -> Result<T> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).unwrap_or_else(|panic| {
        let message = panic
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| panic.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "no message".into());
        Err(LedgerError::Corrupt {
            path: dir.to_path_buf(),
            detail: format!("sled failed {what} ({message})"),
        })
    })
}

/// Corruption sled found in its files, at open or in a read: damage, said one way.
fn corruption(dir: &Path, e: &sled::Error) -> LedgerError {
    LedgerError::Corrupt {
        path: dir.to_path_buf(),
        detail: format!("sled reports corruption ({e})"),
    }
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
        sled::Error::Corruption { .. } => corruption(dir, &e),
        _ => LedgerError::Corrupt {
            path: dir.to_path_buf(),
            detail: text,
        },
    }
}
