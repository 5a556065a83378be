//! Putting a backup back: `waymark ledger restore`.
//!
//! A restore replaces the database of a ledger no process owns with a backup's, after checking
//! that the backup is whole and of this ledger. It keeps the live ledger's witness, so the
//! restored ledger is refused (and `audit verify` says exactly which events it lacks) until the
//! operator accepts it; it keeps the replaced database beside it, so nothing is lost.

use std::fs;
use std::path::{Path, PathBuf};

use crate::error::{LedgerError, Result};
use crate::files::{self, DB_DIR, IDENTITY_FILE, KEY_FILE, WITNESS_FILE};
use crate::records::ChainHead;
use crate::{ledger_identity, Ledger, LedgerOptions, WitnessCheck};

/// What [`Ledger::restore`] did.
#[derive(Clone, Debug)]
pub struct RestoreReport {
    /// The head the backup holds, verified whole.
    pub head: ChainHead,
    /// The head the live ledger's witness saw, when it is ahead of the backup: the restored
    /// ledger lacks the events after `head` up to it, and a daemon refuses it until told.
    pub witness_ahead: Option<ChainHead>,
    /// Where the replaced database was moved (none when there was no ledger at the path).
    pub replaced: Option<PathBuf>,
}

impl Ledger {
    /// Restores the backup in `backup` (made by [`Ledger::backup`]) into `live`, a ledger no
    /// process owns or a directory that does not exist yet. Refuses a backup that does not
    /// verify whole or is another ledger's (another key), and a ledger a daemon owns.
    pub fn restore(backup: &Path, live: &Path) -> Result<RestoreReport> {
        files::prepare_dir(backup, files::Create::Never)?;
        let backup_key = files::read_key(backup)?.ok_or_else(|| LedgerError::Corrupt {
            path: backup.to_path_buf(),
            detail: format!("the backup has no {KEY_FILE}"),
        })?;
        let exists = live.join(IDENTITY_FILE).exists();
        if exists {
            files::prepare_dir(live, files::Create::Never).or_else(|e| match e {
                // A damaged live ledger is what a restore is for.
                LedgerError::Corrupt { .. } => Ok(()),
                e => Err(e),
            })?;
            files::refuse_if_owned(live)?;
            if let Some(key) = files::read_key(live)? {
                if key != backup_key {
                    return Err(LedgerError::OtherLedger {
                        path: live.to_path_buf(),
                        backup: backup.to_path_buf(),
                        ours: ledger_identity(&key),
                        theirs: ledger_identity(&backup_key),
                    });
                }
            }
        } else {
            files::prepare_dir(live, files::Create::IfMissing)?;
        }

        // The backup is copied beside the live database first and verified there: the backup
        // itself is never opened (sled writes to what it opens), the live one not yet touched.
        let staging = live.join("restore.tmp");
        if staging.exists() {
            fs::remove_dir_all(&staging)
                .map_err(files::io(&staging, "cannot clear a stale restore"))?;
        }
        files::prepare_backup_dir(&staging)?;
        files::copy_ledger(backup, &staging)?;
        if let Ok(w) = fs::read(backup.join(WITNESS_FILE)) {
            fs::write(staging.join(WITNESS_FILE), w)
                .map_err(files::io(&staging, "cannot copy the backup's witness"))?;
        }
        let head = verify_whole(&staging).inspect_err(|_| {
            let _ = fs::remove_dir_all(&staging);
        })?;

        let replaced = if live.join(DB_DIR).exists() {
            let millis = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_millis());
            let aside = live.join(format!("{DB_DIR}.replaced-{millis}"));
            fs::rename(live.join(DB_DIR), &aside)
                .map_err(files::io(live, "cannot move the replaced database aside"))?;
            Some(aside)
        } else {
            None
        };
        fs::rename(staging.join(DB_DIR), live.join(DB_DIR)).map_err(files::io(
            live,
            "cannot move the restored database into place",
        ))?;
        if !live.join(KEY_FILE).exists() {
            fs::rename(staging.join(KEY_FILE), live.join(KEY_FILE))
                .map_err(files::io(live, "cannot move the key into place"))?;
        }
        // The live witness stays: it is what tells how far behind the backup is. A ledger that
        // had none takes the backup's.
        if !live.join(WITNESS_FILE).exists() {
            if let Ok(w) = fs::read(staging.join(WITNESS_FILE)) {
                fs::write(live.join(WITNESS_FILE), w)
                    .map_err(files::io(live, "cannot write the witness"))?;
            }
        }
        fs::remove_dir_all(&staging)
            .map_err(files::io(&staging, "cannot remove the staging copy"))?;

        let restored = Ledger::open_with(
            live,
            LedgerOptions {
                witness: WitnessCheck::Report,
                ..LedgerOptions::default()
            },
        )?;
        Ok(RestoreReport {
            head,
            witness_ahead: restored.witness_ahead().cloned(),
            replaced,
        })
    }
}

/// Opens the copy in `dir` and verifies its chain against its own witness: the head it holds
/// when whole, the damage otherwise.
fn verify_whole(dir: &Path) -> Result<ChainHead> {
    let copy = Ledger::open_with(
        dir,
        LedgerOptions {
            witness: WitnessCheck::Report,
            ..LedgerOptions::default()
        },
    )?;
    let report = copy.verify(None)?;
    match report.broken {
        None => Ok(report.head),
        Some(b) => Err(LedgerError::Corrupt {
            path: dir.to_path_buf(),
            detail: format!(
                "the backup does not verify whole: event {}: {}",
                b.seq, b.problem
            ),
        }),
    }
}
