use std::path::PathBuf;

use waymark_core::{ExecutionId, IllegalTransition};

/// Everything that can go wrong with the ledger, each with what a person can do about it.
#[derive(Debug, thiserror::Error)]
pub enum LedgerError {
    #[error(
        "ledger {path} is locked by another process: the Waymark daemon probably owns it. Run \
         the command through the daemon (the CLI does this when the daemon runs), or stop the \
         daemon first"
    )]
    Locked { path: PathBuf },
    /// No ledger where one was expected; only `waymark init` makes one.
    #[error(
        "no ledger at {path} ({why}): run `waymark init` to create one, or point `[ledger] path` \
         at the existing one (a renamed directory, an unmounted volume or another \
         $XDG_STATE_HOME would otherwise become a new ledger that knows none of the executions in \
         flight)"
    )]
    Missing { path: PathBuf, why: String },
    /// The ledger's chain ends before the head its witness saw made durable: events were lost
    /// (damage that sled's recovery cut off) or the files were rolled back to an older copy.
    #[error(
        "ledger {path} is behind its witness: the chain ends at event {head} but this ledger had \
         reached event {witness}: events {}-{witness} are missing (the files were damaged, or \
         rolled back to an older copy). Keep a copy of the directory; restore the newest backup, \
         or see what is intact with `waymark audit verify --ledger {path}`. `waymark daemon \
         --accept-rollback` serves it as it is and records that in the audit chain", head + 1
    )]
    BehindWitness {
        path: PathBuf,
        head: u64,
        witness: u64,
    },
    /// The event at the witness's position is not the one the witness names: these files are
    /// another ledger's, or another history's.
    #[error(
        "ledger {path} is not the ledger its witness knows: its event {seq} is not the one this \
         ledger had made durable (another ledger's files, or a copy from another history). \
         Restore this ledger's own files; `waymark daemon --accept-rollback` serves it as it is \
         and records that in the audit chain"
    )]
    NotItsWitness { path: PathBuf, seq: u64 },
    /// A backup of another ledger (another key) offered to restore this one.
    #[error(
        "{backup} is a backup of another ledger (identity {theirs}); the ledger at {path} is \
         {ours}. Restoring it would make every intent fingerprint differently and every host \
         refuse it; give a backup of this ledger, or restore into a new directory"
    )]
    OtherLedger {
        path: PathBuf,
        backup: PathBuf,
        ours: String,
        theirs: String,
    },
    #[error(
        "{path} is not a Waymark ledger (it is not empty and has no LEDGER identity file); \
         point `ledger.path` at an empty or new directory"
    )]
    Foreign { path: PathBuf },
    #[error("ledger {path} is damaged: {detail}. Keep a copy of the directory before repairing it; restore a backup, or see what is still intact with `waymark audit verify --ledger {path}`")]
    Corrupt { path: PathBuf, detail: String },
    #[error("ledger {path}: {what}: {source}")]
    Io {
        path: PathBuf,
        what: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error("ledger {path}: storage error: {detail}")]
    Storage { path: PathBuf, detail: String },
    #[error("execution {0} is not in the ledger")]
    NotFound(ExecutionId),
    #[error("execution {0} is already in the ledger")]
    Duplicate(ExecutionId),
    /// A shared ledger's database refused or failed (or its schema is too new).
    #[error("{at}: {detail}")]
    Database { at: String, detail: String },
    /// Another daemon took the execution over: this one's lease is stale.
    #[error(
        "execution {id} is now driven by {owner} (epoch {epoch}); this daemon's lease \
         (epoch {mine}) is stale and may not change it"
    )]
    Fenced {
        id: ExecutionId,
        owner: String,
        epoch: i64,
        mine: i64,
    },
    #[error("execution {id}: {source}")]
    Illegal {
        id: ExecutionId,
        #[source]
        source: IllegalTransition,
    },
}

pub type Result<T> = std::result::Result<T, LedgerError>;
