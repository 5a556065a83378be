//! The ledger directory on disk: identity file, key file, permissions.

use std::fs::{self, DirBuilder, OpenOptions};
use std::io::{ErrorKind, Read, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use rand::RngCore;

use crate::error::{LedgerError, Result};
use crate::records::ChainHead;

pub(crate) const IDENTITY_FILE: &str = "LEDGER";
pub(crate) const KEY_FILE: &str = "ledger.key";
pub(crate) const DB_DIR: &str = "db";
/// The witness: the chain head as of the newest flush, kept outside sled (see [`write_witness`]).
pub(crate) const WITNESS_FILE: &str = "head.witness";
const IDENTITY: &str = "waymark-ledger v1\n";

pub(crate) fn io<'a>(
    path: &'a Path,
    what: &'static str,
) -> impl FnOnce(std::io::Error) -> LedgerError + 'a {
    move |source| LedgerError::Io {
        path: path.to_path_buf(),
        what,
        source,
    }
}

/// Whether opening a ledger may create it. Only `waymark init` (and `daemon --init`) may: a
/// ledger made by accident (a renamed directory, an unmounted volume, a wrong
/// `$XDG_STATE_HOME`) knows none of the executions in flight, and their retries would run again.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Create {
    /// The ledger must exist: its identity file, key and database.
    Never,
    /// Make it when the directory is missing or empty; open it when it is a ledger.
    IfMissing,
}

/// Checks that `dir` is a Waymark ledger, or (under [`Create::IfMissing`]) makes one there:
/// the directory (0700) and its identity file.
pub(crate) fn prepare_dir(dir: &Path, create: Create) -> Result<()> {
    let missing = |why: &str| LedgerError::Missing {
        path: dir.to_path_buf(),
        why: why.to_string(),
    };
    match fs::metadata(dir) {
        Ok(meta) if !meta.is_dir() => {
            return Err(LedgerError::Foreign {
                path: dir.to_path_buf(),
            });
        }
        Ok(_) => {}
        Err(e) if e.kind() == ErrorKind::NotFound && create == Create::Never => {
            return Err(missing("the directory does not exist"));
        }
        Err(e) if e.kind() == ErrorKind::NotFound => {
            DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(dir)
                .map_err(io(dir, "cannot create the ledger directory"))?;
        }
        Err(e) => return Err(io(dir, "cannot read the ledger directory")(e)),
    }
    let identity = dir.join(IDENTITY_FILE);
    match fs::read_to_string(&identity) {
        Ok(text) if text == IDENTITY => {}
        Ok(_) => {
            return Err(LedgerError::Corrupt {
                path: dir.to_path_buf(),
                detail: format!("{} does not say `{}`", identity.display(), IDENTITY.trim()),
            })
        }
        Err(e) if e.kind() == ErrorKind::NotFound => {
            let empty = fs::read_dir(dir)
                .map_err(io(dir, "cannot list the ledger directory"))?
                .next()
                .is_none();
            if !empty {
                return Err(LedgerError::Foreign {
                    path: dir.to_path_buf(),
                });
            }
            if create == Create::Never {
                return Err(missing("the directory is empty"));
            }
            write_new_file(&identity, IDENTITY.as_bytes())?;
        }
        Err(e) => return Err(io(&identity, "cannot read the identity file")(e)),
    }
    if create == Create::Never {
        // A ledger whose database or key went missing is damaged, not new: sled would make a
        // fresh database, and a fresh key would fingerprint every intent differently.
        for (name, what) in [
            (DB_DIR, "its database directory"),
            (KEY_FILE, "its key file"),
        ] {
            if !dir.join(name).exists() {
                return Err(LedgerError::Corrupt {
                    path: dir.to_path_buf(),
                    detail: format!("{what} {name} is missing"),
                });
            }
        }
    }
    fs::set_permissions(dir, fs::Permissions::from_mode(0o700))
        .map_err(io(dir, "cannot set the ledger directory to 0700"))?;
    Ok(())
}

fn write_new_file(path: &Path, bytes: &[u8]) -> Result<()> {
    let mut f = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
        .map_err(io(path, "cannot create file"))?;
    f.write_all(bytes).map_err(io(path, "cannot write file"))?;
    f.sync_all().map_err(io(path, "cannot sync file"))?;
    Ok(())
}

/// Reads the ledger's master key, generating it (0600) on first use (only when
/// [`prepare_dir`] made or accepted a new ledger; an existing one was checked to have it).
pub(crate) fn load_or_create_key(dir: &Path) -> Result<[u8; 32]> {
    let path = dir.join(KEY_FILE);
    let mut text = String::new();
    match fs::File::open(&path) {
        Ok(mut f) => {
            f.read_to_string(&mut text)
                .map_err(io(&path, "cannot read the key file"))?;
        }
        Err(e) if e.kind() == ErrorKind::NotFound => {
            let mut key = [0u8; 32];
            rand::rngs::OsRng.fill_bytes(&mut key);
            write_new_file(&path, format!("{}\n", hex::encode(key)).as_bytes())?;
            return Ok(key);
        }
        Err(e) => return Err(io(&path, "cannot open the key file")(e)),
    }
    let mut key = [0u8; 32];
    hex::decode_to_slice(text.trim(), &mut key).map_err(|_| LedgerError::Corrupt {
        path: dir.to_path_buf(),
        detail: format!("{} does not hold 64 hex digits", path.display()),
    })?;
    Ok(key)
}

/// Reads the ledger's master key without making one: `None` when the key file is missing.
pub(crate) fn read_key(dir: &Path) -> Result<Option<[u8; 32]>> {
    if !dir.join(KEY_FILE).exists() {
        return Ok(None);
    }
    load_or_create_key(dir).map(Some)
}

/// Refuses a ledger whose database a process holds open (sled keeps an exclusive `flock` on
/// `db/db` while it is open): a running daemon owns it.
pub(crate) fn refuse_if_owned(dir: &Path) -> Result<()> {
    use std::os::fd::AsRawFd;
    let data = dir.join(DB_DIR).join("db");
    let file = match fs::File::open(&data) {
        Ok(f) => f,
        Err(e) if e.kind() == ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(io(&data, "cannot open the database file")(e)),
    };
    // SAFETY: flock on a descriptor this function owns; closing it releases the lock.
    let taken = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } == 0;
    if taken {
        Ok(())
    } else {
        Err(LedgerError::Locked {
            path: dir.to_path_buf(),
        })
    }
}

/// Sets every file under `dir` to 0600 and every directory to 0700. sled creates its files
/// with the process umask; the 0700 directory already keeps others out, this makes it exact.
pub(crate) fn tighten_permissions(dir: &Path) -> Result<()> {
    let mut stack: Vec<PathBuf> = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let entries = match fs::read_dir(&d) {
            Ok(e) => e,
            Err(e) if e.kind() == ErrorKind::NotFound => continue,
            Err(e) => return Err(io(&d, "cannot list directory")(e)),
        };
        for entry in entries.flatten() {
            let path = entry.path();
            let Ok(meta) = fs::symlink_metadata(&path) else {
                continue;
            };
            let mode = if meta.is_dir() {
                stack.push(path.clone());
                0o700
            } else if meta.is_file() {
                0o600
            } else {
                continue;
            };
            if meta.permissions().mode() & 0o777 != mode {
                // A file sled removed meanwhile is not an error.
                let _ = fs::set_permissions(&path, fs::Permissions::from_mode(mode));
            }
        }
    }
    Ok(())
}

/// Writes the chain head that was just made durable to the witness file, by atomic rename. It
/// is written after sled's flush, so it may lag behind the ledger after a crash but never runs
/// ahead of it. It is not synced: after a power loss it may be older, which reads as a lag.
pub(crate) fn write_witness(dir: &Path, head: &ChainHead) -> std::io::Result<()> {
    write_witness_at(&dir.join(WITNESS_FILE), head)
}

/// Writes `head` to the witness file at `path` by atomic rename (the shared ledger keeps its
/// witness beside its key file, not in a ledger directory). Never synced: see [`write_witness`].
pub fn write_witness_at(path: &Path, head: &ChainHead) -> std::io::Result<()> {
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(".tmp");
    let tmp = path.with_file_name(name);
    let mut f = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&tmp)?;
    let text = serde_json::to_string(head).expect("a chain head serializes");
    f.write_all(format!("{text}\n").as_bytes())?;
    drop(f);
    fs::rename(&tmp, path)
}

/// What the witness file says, if there is one. A missing or unreadable witness (a power loss
/// can leave it empty, since it is not synced) is no witness: it can prove no loss.
pub(crate) fn read_witness(dir: &Path) -> Option<ChainHead> {
    read_witness_at(&dir.join(WITNESS_FILE))
}

/// What the witness file at `path` says, if there is one (see [`read_witness`]).
pub fn read_witness_at(path: &Path) -> Option<ChainHead> {
    let text = fs::read_to_string(path).ok()?;
    serde_json::from_str(text.trim()).ok()
}

/// Makes `dest` for a backup (0700): it must not exist, or be an empty directory.
pub(crate) fn prepare_backup_dir(dest: &Path) -> Result<()> {
    match fs::read_dir(dest).map(|mut entries| entries.next().is_some()) {
        Ok(true) => Err(LedgerError::Io {
            path: dest.to_path_buf(),
            what: "the backup directory is not empty; give a new or empty one",
            source: std::io::Error::from(ErrorKind::AlreadyExists),
        }),
        Ok(false) => Ok(()),
        Err(e) if e.kind() == ErrorKind::NotFound => DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dest)
            .map_err(io(dest, "cannot create the backup directory")),
        Err(e) => Err(io(dest, "cannot read the backup directory")(e)),
    }
}

/// Copies a ledger's identity, key and database into `dest` (the witness is the caller's).
pub(crate) fn copy_ledger(from: &Path, dest: &Path) -> Result<()> {
    for name in [IDENTITY_FILE, KEY_FILE] {
        fs::copy(from.join(name), dest.join(name))
            .map_err(io(dest, "cannot copy into the backup"))?;
    }
    copy_tree(&from.join(DB_DIR), &dest.join(DB_DIR))
}

fn copy_tree(from: &Path, to: &Path) -> Result<()> {
    DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(to)
        .map_err(io(to, "cannot create a backup directory"))?;
    for entry in fs::read_dir(from).map_err(io(from, "cannot list the database"))? {
        let entry = entry.map_err(io(from, "cannot list the database"))?;
        let target = to.join(entry.file_name());
        let kind = entry
            .file_type()
            .map_err(io(from, "cannot list the database"))?;
        if kind.is_dir() {
            copy_tree(&entry.path(), &target)?;
        } else if kind.is_file() {
            fs::copy(entry.path(), &target).map_err(io(to, "cannot copy into the backup"))?;
        }
    }
    Ok(())
}
