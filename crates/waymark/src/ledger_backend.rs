//! The daemon's ledger, from `[ledger]`: sled in its directory, or the PostgreSQL database
//! several daemons share (connection string from an environment variable or a 0600 file,
//! schema created or migrated on start, the daemon's name claimed, a heartbeat, and the
//! takeover of a dead daemon's executions).

use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use waymark_gateway::config::{Config, LedgerBackend, PostgresLedger, UrlSource};
use waymark_ledger::{FlushObserver, Ledger, LedgerApi, LedgerOptions, WitnessCheck};

use crate::daemon::Failure;
use waymark_ledger_pg::{PgBackend, PgLedger};

/// How often a daemon on the shared ledger beats, and when another one counts it dead.
pub struct Heartbeat {
    pub every: Duration,
    pub dead_after: Duration,
}

impl Heartbeat {
    /// One beat a second, dead after five missed (`WAYMARK_DEAD_AFTER_MS` overrides, for tests).
    pub fn from_env() -> Heartbeat {
        let dead_after = std::env::var("WAYMARK_DEAD_AFTER_MS")
            .ok()
            .and_then(|v| v.parse().ok())
            .map_or(Duration::from_secs(5), Duration::from_millis);
        Heartbeat {
            every: (dead_after / 5).max(Duration::from_millis(100)),
            dead_after,
        }
    }
}

/// The opened ledger; `shared` is set for PostgreSQL, whose daemon must keep beating.
pub struct Opened {
    pub ledger: Arc<dyn LedgerApi>,
    pub shared: Option<Arc<PgBackend>>,
}

/// How the daemon was told to treat its ledger at start (`daemon --init`, `--accept-rollback`).
#[derive(Clone, Copy, Debug, Default)]
pub struct Start {
    pub init: bool,
    pub accept_rollback: bool,
}

/// Opens the ledger `config` names; `on_flush` hears of each flush (the daemon's metrics).
pub async fn open(
    config: &Config,
    on_flush: Option<FlushObserver>,
    start: Start,
) -> Result<Opened, Failure> {
    match &config.ledger_backend {
        LedgerBackend::Sled => {
            let options = LedgerOptions {
                on_flush,
                witness: if start.accept_rollback {
                    WitnessCheck::Accept
                } else {
                    WitnessCheck::Refuse
                },
                ..LedgerOptions::default()
            };
            let opened = if start.init {
                Ledger::init_with(&config.ledger_path, options)
            } else {
                Ledger::open_with(&config.ledger_path, options)
            };
            let ledger = opened.map_err(|e| Failure {
                code: crate::cli::local::ledger_exit_code(&e),
                message: e.to_string(),
            })?;
            if start.accept_rollback {
                tracing::warn!(ledger = %config.ledger_path.display(), "serving the ledger as it is (--accept-rollback)");
            }
            Ok(Opened {
                ledger: Arc::new(ledger),
                shared: None,
            })
        }
        LedgerBackend::Postgres(pg) => {
            let url = connection_string(pg)?;
            if !start.init {
                if let Some(message) = missing_key(pg) {
                    return Err(Failure {
                        message,
                        code: crate::exit::USAGE,
                    });
                }
            }
            let master = load_or_create_key(&pg.key_file)?;
            let connected = if start.init {
                PgLedger::connect(&url, &master).await
            } else {
                PgLedger::connect_existing(&url, &master).await
            };
            let mut ledger = connected.map_err(|e| Failure {
                code: match e {
                    waymark_ledger_pg::PgLedgerError::NoLedger => crate::exit::USAGE,
                    _ => crate::exit::ERROR,
                },
                message: format!("{} (ledger configured at {})", e, pg.origin),
            })?;
            if let Some(observer) = on_flush {
                ledger = ledger.with_flush_observer(observer);
            }
            let witness = witness_path(&pg.key_file);
            check_shared_witness(&ledger, &witness, pg, start).await?;
            ledger = ledger.with_witness(witness);
            let name = pg
                .daemon_name
                .clone()
                .unwrap_or_else(|| default_name(&config.daemon.socket));
            let backend = Arc::new(PgBackend::new(ledger, &name));
            backend
                .claim_name()
                .await
                .map_err(|e| format!("{} (ledger configured at {})", e, pg.origin))?;
            Ok(Opened {
                ledger: backend.clone(),
                shared: Some(backend),
            })
        }
    }
}

/// Where a daemon on the shared ledger keeps its witness of the chain: beside the key file
/// (`ledger.key` → `ledger.key.witness`), outside the database it vouches for.
pub fn witness_path(key_file: &Path) -> std::path::PathBuf {
    let mut name = key_file.file_name().unwrap_or_default().to_os_string();
    name.push(".witness");
    key_file.with_file_name(name)
}

/// The shared ledger's witness check at start, as the sled ledger's: a database whose chain
/// ends before the head this daemon saw made durable (restored from an older dump, a
/// point-in-time recovery too far back) or holds another event there (another database) is
/// refused unless the operator accepts it (`--accept-rollback`, recorded in the chain).
async fn check_shared_witness(
    ledger: &PgLedger,
    witness: &Path,
    pg: &PostgresLedger,
    start: Start,
) -> Result<(), Failure> {
    let found = ledger
        .check_witness(witness)
        .await
        .map_err(|e| format!("{} (ledger configured at {})", e, pg.origin))?;
    let Some((seen, behind)) = found else {
        return Ok(());
    };
    let head = ledger
        .head()
        .await
        .map_err(|e| format!("{} (ledger configured at {})", e, pg.origin))?;
    if start.accept_rollback {
        let data = serde_json::json!({
            "witness": seen,
            "head": head,
            "missing_events": seen.seq.saturating_sub(head.seq),
        });
        ledger
            .record_note(
                "rollback accepted",
                data,
                waymark_gateway::flow::now(),
                waymark_ledger::Durability::Flushed,
            )
            .await
            .map_err(|e| format!("{} (ledger configured at {})", e, pg.origin))?;
        tracing::warn!(witness = %witness.display(), "serving the shared ledger as it is (--accept-rollback)");
        // The head just recorded is the witness from now on.
        let _ = waymark_ledger::write_witness_at(
            witness,
            &ledger.head().await.map_err(|e| e.to_string())?,
        );
        return Ok(());
    }
    let what = if behind {
        format!(
            "the chain ends at event {} but this daemon saw it reach event {}: events {}-{} \
             are missing (the database was restored from an older copy, or recovered to an \
             earlier point)",
            head.seq,
            seen.seq,
            head.seq + 1,
            seen.seq
        )
    } else {
        format!(
            "its event {} is not the one this daemon saw made durable (another database, or a \
             copy from another history)",
            seen.seq
        )
    };
    Err(Failure {
        message: format!(
            "the shared ledger (configured at {}) is not the one this daemon's witness {} \
             knows: {what}. Restore the newest backup of the database, or serve it as it is \
             with `waymark daemon --accept-rollback` (recorded in the audit chain)",
            pg.origin,
            witness.display()
        ),
        code: crate::exit::ERROR,
    })
}

/// `waymark init` on the shared ledger: the key file (made when missing) and the schema
/// (created or migrated); claims no daemon name. Says what it did.
pub async fn init_shared(pg: &PostgresLedger) -> Result<String, Failure> {
    let url = connection_string(pg)?;
    let master = load_or_create_key(&pg.key_file)?;
    let ledger = PgLedger::connect(&url, &master)
        .await
        .map_err(|e| format!("{} (ledger configured at {})", e, pg.origin))?;
    let version = ledger
        .schema_version()
        .await
        .map_err(|e| format!("{} (ledger configured at {})", e, pg.origin))?;
    Ok(format!(
        "ledger: PostgreSQL, schema version {version}; key in {} (0600: copy it to every daemon \
         sharing this ledger)",
        pg.key_file.display()
    ))
}

/// What a daemon on the shared ledger says when its key file is missing (and `config check`
/// says it the same way).
pub fn missing_key(pg: &PostgresLedger) -> Option<String> {
    (!pg.key_file.exists()).then(|| {
        format!(
            "the ledger key {} is missing: copy it from a daemon that shares this ledger, or run \
             `waymark init` for a new ledger (ledger configured at {})",
            pg.key_file.display(),
            pg.origin
        )
    })
}

/// The connection string, from the daemon's environment or a file only its owner can read.
pub fn connection_string(pg: &PostgresLedger) -> Result<String, String> {
    match &pg.url {
        UrlSource::Env(var) => std::env::var(var).map_err(|_| {
            format!(
                "{}: ledger.url_env names {var}, which is not set in the daemon's environment",
                pg.origin
            )
        }),
        UrlSource::File(path) => {
            let meta = std::fs::metadata(path)
                .map_err(|e| format!("{}: ledger.url_file {}: {e}", pg.origin, path.display()))?;
            let mode = meta.permissions().mode() & 0o777;
            if mode & 0o077 != 0 {
                return Err(format!(
                    "{}: ledger.url_file {} is mode {mode:o}; the connection string may carry a \
                     password, so it must be readable by its owner only: chmod 600 {}",
                    pg.origin,
                    path.display(),
                    path.display()
                ));
            }
            let text = std::fs::read_to_string(path)
                .map_err(|e| format!("{}: ledger.url_file {}: {e}", pg.origin, path.display()))?;
            Ok(text.trim().to_string())
        }
    }
}

/// The master key every daemon sharing the database holds: 64 hex digits in a 0600 file,
/// made on first use (copy it to the other daemons). Never stored in the database.
fn load_or_create_key(path: &Path) -> Result<[u8; 32], String> {
    let parse = |text: &str| -> Option<[u8; 32]> {
        let text = text.trim();
        if text.len() != 64 {
            return None;
        }
        let mut key = [0u8; 32];
        for (i, b) in key.iter_mut().enumerate() {
            *b = u8::from_str_radix(text.get(2 * i..2 * i + 2)?, 16).ok()?;
        }
        Some(key)
    };
    match std::fs::read_to_string(path) {
        Ok(text) => {
            let mode = std::fs::metadata(path)
                .map_err(|e| format!("{}: {e}", path.display()))?
                .permissions()
                .mode();
            if mode & 0o077 != 0 {
                return Err(format!(
                    "the ledger key {} is mode {:o}; chmod 600 it",
                    path.display(),
                    mode & 0o777
                ));
            }
            parse(&text).ok_or_else(|| {
                format!(
                    "the ledger key {} is not 64 hex digits; restore the key the other daemons \
                     use",
                    path.display()
                )
            })
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let mut key = [0u8; 32];
            let mut random = std::fs::File::open("/dev/urandom")
                .map_err(|e| format!("cannot read /dev/urandom: {e}"))?;
            std::io::Read::read_exact(&mut random, &mut key)
                .map_err(|e| format!("cannot read /dev/urandom: {e}"))?;
            if let Some(dir) = path.parent() {
                std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
            }
            let hex: String = key.iter().map(|b| format!("{b:02x}")).collect();
            let file = std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o600)
                .open(path);
            let mut file = match file {
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                    return load_or_create_key(path)
                }
                other => other
                    .map_err(|e| format!("cannot create the ledger key {}: {e}", path.display()))?,
            };
            std::io::Write::write_all(&mut file, format!("{hex}\n").as_bytes())
                .map_err(|e| format!("{}: {e}", path.display()))?;
            // Another daemon may have made it at the same moment: the file on disk wins.
            load_or_create_key(path)
        }
        Err(e) => Err(format!("the ledger key {}: {e}", path.display())),
    }
}

/// A daemon's default name: the host's name and its socket, unique on a machine.
fn default_name(socket: &Path) -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .unwrap_or_else(|_| "localhost".into());
    format!("{host}:{}", socket.display())
}
