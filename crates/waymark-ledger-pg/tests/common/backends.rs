#![allow(dead_code)]
//! The two backends of `LedgerApi`, opened the same way for the suite that runs on both.

use std::sync::Arc;

use waymark_ledger::{Ledger, LedgerApi};
use waymark_ledger_pg::{PgBackend, PgLedger};
use waymark_testkit::TestPostgres;

/// The master key every daemon of a test shares.
pub const MASTER: [u8; 32] = *b"waymark-shared-ledger-test-key-!";

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Sled,
    Postgres,
}

/// Where one test's ledger lives: a temporary directory, or a database of the test cluster.
pub enum Place {
    Sled(tempfile::TempDir),
    Postgres(String),
}

impl Place {
    /// A new, empty ledger place of `kind`.
    pub fn new(kind: Kind, hint: &str) -> Place {
        match kind {
            Kind::Sled => Place::Sled(tempfile::tempdir().unwrap()),
            Kind::Postgres => Place::Postgres(TestPostgres::shared().create_database(hint)),
        }
    }

    /// Opens the ledger here as daemon `daemon` (the name matters for PostgreSQL only). A sled
    /// ledger must be dropped before it is opened again.
    pub async fn open(&self, daemon: &str) -> Arc<dyn LedgerApi> {
        match self {
            Place::Sled(dir) => Arc::new(Ledger::init(&dir.path().join("l")).unwrap()),
            Place::Postgres(url) => {
                let pg = PgLedger::connect(url, &MASTER).await.unwrap();
                Arc::new(PgBackend::new(pg, daemon))
            }
        }
    }

    /// What a child process needs to open the same ledger: the directory or the URL.
    pub fn address(&self) -> String {
        match self {
            Place::Sled(dir) => dir.path().join("l").display().to_string(),
            Place::Postgres(url) => url.clone(),
        }
    }
}

/// Opens the ledger at `address` (see [`Place::address`]) as daemon `daemon`.
pub async fn open_address(address: &str, daemon: &str) -> Arc<dyn LedgerApi> {
    if address.starts_with("postgresql://") {
        let pg = PgLedger::connect(address, &MASTER).await.unwrap();
        Arc::new(PgBackend::new(pg, daemon))
    } else {
        Arc::new(Ledger::init(address.as_ref()).unwrap())
    }
}

/// One test, run on each backend: `both!(name)` makes `name::sled` and `name::postgres` out of
/// `async fn name(kind: Kind)`.
macro_rules! both {
    ($($name:ident),* $(,)?) => {$(
        mod $name {
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn sled() {
                super::$name(super::Kind::Sled).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn postgres() {
                super::$name(super::Kind::Postgres).await
            }
        }
    )*};
}
