//! Transactions as every writer opens them, and what makes a commit durable: the leaf the
//! execution writes, the batch queue and the facts share.

use waymark_ledger::{Durability, FlushObserver};

use crate::Result;

/// Opens a transaction that commits without waiting for the WAL flush: the chain head's row
/// lock is held until commit, so a commit that waited for the disk would serialize every
/// writer of every daemon on one fsync each. Durability is asked for after the lock is gone,
/// by `PgLedger::durable`.
pub(crate) async fn begin(
    client: &mut deadpool_postgres::Client,
) -> Result<deadpool_postgres::Transaction<'_>> {
    let tx = client.transaction().await?;
    tx.batch_execute(COMMIT_WITHOUT_WAITING).await?;
    Ok(tx)
}

/// Makes the current transaction commit without waiting for the WAL flush (see [`begin`]).
pub(crate) const COMMIT_WITHOUT_WAITING: &str = "SET LOCAL synchronous_commit TO OFF";

/// After a commit by [`begin`]'s transaction: for a flushed write, commits one more (empty)
/// transaction with `synchronous_commit = on` (the connection's setting); it returns once the
/// WAL is on disk up to its own commit record, which is after the write's. Concurrent
/// flushes from every session share one WAL flush (PostgreSQL's own group commit), as sled's
/// writers share one fdatasync. A buffered write is covered by the next flushed one.
/// `on_flush` is told how long the wait took.
pub(crate) async fn durable(
    client: &deadpool_postgres::Client,
    durability: Durability,
    on_flush: Option<&FlushObserver>,
) -> Result<()> {
    if durability == Durability::Flushed {
        let began = std::time::Instant::now();
        client
            .batch_execute("BEGIN; SELECT txid_current(); COMMIT")
            .await?;
        if let Some(observe) = on_flush {
            (observe.0)(began.elapsed());
        }
    }
    Ok(())
}

/// The advisory lock of an intent: the first 8 bytes of its fingerprint.
pub(crate) fn intent_lock(fingerprint: &[u8; 32]) -> i64 {
    i64::from_be_bytes(fingerprint[..8].try_into().expect("8 bytes"))
}
