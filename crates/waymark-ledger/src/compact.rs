//! Giving retention's space back: `waymark ledger compact`.
//!
//! With the daemon stopped, the ledger's database is copied into a new one beside it (only what
//! it holds now), the copy is proven equal, swapped in, and proven to open and verify to the
//! same head; only then is the old database removed. The chain, the key, the identity and the
//! witness do not change: a compacted ledger is the same ledger.

use std::fs;
use std::path::Path;

use crate::error::{LedgerError, Result};
use crate::files::{self, DB_DIR};
use crate::records::ChainHead;
use crate::Ledger;

/// What [`Ledger::compact`] did.
#[derive(Clone, Debug)]
pub struct CompactReport {
    /// The head the ledger holds, before and after (verified whole both times).
    pub head: ChainHead,
    /// Bytes of the database directory before and after.
    pub before_bytes: u64,
    pub after_bytes: u64,
}

impl Ledger {
    /// Rewrites the database of the ledger in `live` (no process may own it) into a new one
    /// holding only what it holds now. Refuses a ledger that does not verify whole (a copy
    /// would keep its damage and lose the evidence): restore or repair it first.
    pub fn compact(live: &Path) -> Result<CompactReport> {
        files::prepare_dir(live, files::Create::Never)?;
        files::refuse_if_owned(live)?;
        let db = live.join(DB_DIR);
        let staging = live.join(format!("{DB_DIR}.compact"));
        let aside = live.join(format!("{DB_DIR}.before-compact"));
        for stale in [&staging, &aside] {
            if stale.exists() {
                fs::remove_dir_all(stale).map_err(files::io(
                    stale,
                    "cannot clear what a stopped compaction left",
                ))?;
            }
        }
        let before_bytes = size_of(&db);
        let head = {
            let ledger = Ledger::open(live)?;
            let head = verified_head(&ledger, live)?;
            ledger.inner.store.copy_into(&staging)?;
            head
        };
        fs::rename(&db, &aside).map_err(files::io(live, "cannot move the database aside"))?;
        fs::rename(&staging, &db).map_err(files::io(live, "cannot move the copy into place"))?;
        let reopened = Ledger::open(live).and_then(|l| verified_head(&l, live));
        match reopened {
            Ok(h) if h == head => {}
            other => {
                // Put the old database back; the copy stays beside it for a look.
                let failed = live.join(format!("{DB_DIR}.compact-failed"));
                let _ = fs::rename(&db, &failed);
                fs::rename(&aside, &db).map_err(files::io(live, "cannot put the database back"))?;
                let why = match other {
                    Ok(h) => format!("it ends at event {} instead of {}", h.seq, head.seq),
                    Err(e) => e.to_string(),
                };
                return Err(LedgerError::Corrupt {
                    path: failed,
                    detail: format!(
                        "the compacted copy does not verify like the ledger ({why}); the ledger \
                         was put back unchanged"
                    ),
                });
            }
        }
        fs::remove_dir_all(&aside)
            .map_err(files::io(&aside, "cannot remove the database it replaced"))?;
        Ok(CompactReport {
            head,
            before_bytes,
            after_bytes: size_of(&db),
        })
    }
}

/// The head of `ledger`'s chain when it verifies whole.
fn verified_head(ledger: &Ledger, live: &Path) -> Result<ChainHead> {
    let report = ledger.verify(None)?;
    match report.broken {
        None => Ok(report.head),
        Some(b) => Err(LedgerError::Corrupt {
            path: live.to_path_buf(),
            detail: format!(
                "the ledger does not verify whole (event {}: {}); a compacted copy would keep \
                 the damage: restore a backup first (`waymark ledger restore`)",
                b.seq, b.problem
            ),
        }),
    }
}

/// Bytes of the files under `dir`.
fn size_of(dir: &Path) -> u64 {
    let Ok(entries) = fs::read_dir(dir) else {
        return 0;
    };
    entries
        .flatten()
        .map(|e| match e.file_type() {
            Ok(t) if t.is_dir() => size_of(&e.path()),
            _ => e.metadata().map_or(0, |m| m.len()),
        })
        .sum()
}
