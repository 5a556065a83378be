//! The copy behind `waymark ledger compact`: sled 0.34 reuses the space of removed keys but
//! never gives a file's space back, so what retention removed comes back to the disk only by
//! copying what is left into a new database.

use std::path::Path;

use super::{guard, open_error, Store};
use crate::error::{LedgerError, Result};

impl Store {
    /// Copies every tree into a new database at `dest` (which must not exist) and proves the
    /// copy holds the same keys and values (sled's checksum of each). Writes only `dest`: the
    /// ledger's own database is read, never changed.
    pub(crate) fn copy_into(&self, dest: &Path) -> Result<()> {
        guard(dest, "copying the database", || {
            let copy = sled::Config::new()
                .path(dest)
                .cache_capacity(8 * 1024 * 1024)
                .open()
                .map_err(|e| open_error(dest, e))?;
            copy.import(self.db.export());
            copy.flush().map_err(|e| self.storage(e))?;
            let ours = self.db.checksum().map_err(|e| self.storage(e))?;
            let theirs = copy.checksum().map_err(|e| self.storage(e))?;
            if ours != theirs {
                return Err(LedgerError::Corrupt {
                    path: dest.to_path_buf(),
                    detail: "the compacted copy does not hold what the ledger holds".into(),
                });
            }
            Ok(())
        })
    }
}
