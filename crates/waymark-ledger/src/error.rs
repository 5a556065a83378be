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
    #[error(
        "{path} is not a Waymark ledger (it is not empty and has no LEDGER identity file); \
         point `ledger.path` at an empty or new directory"
    )]
    Foreign { path: PathBuf },
    #[error("ledger {path} is damaged: {detail}. Keep a copy of the directory before repairing it; `waymark audit verify --ledger {path}` tells what is still intact")]
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
