//! The one audit chain of every daemon: appends serialized on the `chain_head` row, reads,
//! and `verify` with the sled ledger's rule.

use waymark_core::{ExecutionId, Timestamp};
use waymark_ledger::{verify_events, ChainHead, ChainKey, EventKind, LedgerEvent, VerifyReport};

use crate::{PgLedger, PgLedgerError, Result};

/// Appends one event to the chain inside `tx`: the head row is locked for the rest of the
/// transaction, so appends from every daemon form one chain, one event at a time. Returns its
/// sequence number.
pub(crate) async fn append_event(
    tx: &tokio_postgres::Transaction<'_>,
    key: &ChainKey,
    at: Timestamp,
    execution: Option<ExecutionId>,
    kind: EventKind,
) -> Result<u64> {
    let head = head_in(tx).await?;
    let event = chained(key, &head, at, execution, kind);
    write_event(tx, &event).await?;
    Ok(event.seq)
}

/// The event after `head`, hashed into the chain.
pub(crate) fn chained(
    key: &ChainKey,
    head: &ChainHead,
    at: Timestamp,
    execution: Option<ExecutionId>,
    kind: EventKind,
) -> LedgerEvent {
    let mut event = LedgerEvent {
        seq: head.seq + 1,
        at,
        execution,
        kind,
        prev: head.hash.clone(),
        hash: String::new(),
    };
    event.hash = key.hash(&event);
    event
}

/// Stores `event` and moves the head to it, both statements sent at once (one round trip):
/// the head's lock is held for as few round trips as the chain allows.
pub(crate) async fn write_event(
    tx: &tokio_postgres::Transaction<'_>,
    event: &LedgerEvent,
) -> Result<()> {
    let body = serde_json::to_value(event).expect("events serialize");
    let (seq, execution) = (event.seq as i64, event.execution.map(|id| id.to_string()));
    let insert: [&(dyn tokio_postgres::types::ToSql + Sync); 3] = [&seq, &execution, &body];
    let head: [&(dyn tokio_postgres::types::ToSql + Sync); 2] = [&seq, &event.hash];
    tokio::try_join!(
        tx.execute(
            "INSERT INTO events (seq, execution, body) VALUES ($1, $2, $3)",
            &insert,
        ),
        tx.execute(
            "UPDATE chain_head SET seq = $1, hash = $2 WHERE id = 1",
            &head,
        ),
    )?;
    Ok(())
}

/// The chain's head inside `tx`, locked until it ends (so the next append is `seq + 1`).
pub(crate) async fn head_in(tx: &tokio_postgres::Transaction<'_>) -> Result<ChainHead> {
    let row = tx
        .query_one(
            "SELECT seq, hash FROM chain_head WHERE id = 1 FOR UPDATE",
            &[],
        )
        .await?;
    Ok(ChainHead {
        seq: row.get::<_, i64>(0) as u64,
        hash: row.get(1),
    })
}

fn event_of(row: &tokio_postgres::Row) -> Result<LedgerEvent> {
    let seq: i64 = row.get(0);
    serde_json::from_value(row.get(1)).map_err(|e| PgLedgerError::Record {
        id: format!("event {seq}"),
        reason: e.to_string(),
    })
}

impl PgLedger {
    /// The chain's head as committed.
    pub async fn head(&self) -> Result<ChainHead> {
        let client = self.pool.get().await?;
        let row = client
            .query_one("SELECT seq, hash FROM chain_head WHERE id = 1", &[])
            .await?;
        Ok(ChainHead {
            seq: row.get::<_, i64>(0) as u64,
            hash: row.get(1),
        })
    }

    /// Verifies the whole chain with the rule the sled ledger uses, against the stored head
    /// and, when given, a head exported earlier.
    pub async fn verify(&self, exported: Option<&ChainHead>) -> Result<VerifyReport> {
        let client = self.pool.get().await?;
        let tx_head = self.head().await?;
        let rows = client
            .query(
                "SELECT seq, body FROM events WHERE seq <= $1 ORDER BY seq",
                &[&(tx_head.seq as i64)],
            )
            .await?;
        let events = rows.iter().map(|r| {
            let seq = r.get::<_, i64>(0) as u64;
            let event = serde_json::from_value::<LedgerEvent>(r.get(1)).map_err(|e| e.to_string());
            (seq, event)
        });
        Ok(verify_events(
            &self.keys.1,
            &ChainHead::genesis(),
            events,
            &tx_head,
            exported,
        ))
    }

    /// Audit events of one execution, in order.
    pub async fn events_of(&self, id: ExecutionId) -> Result<Vec<LedgerEvent>> {
        let client = self.pool.get().await?;
        let rows = client
            .query(
                "SELECT seq, body FROM events WHERE execution = $1 ORDER BY seq",
                &[&id.to_string()],
            )
            .await?;
        rows.iter().map(event_of).collect()
    }

    /// Audit events from `from` on, at most `limit`.
    pub async fn events(&self, from: u64, limit: usize) -> Result<Vec<LedgerEvent>> {
        let client = self.pool.get().await?;
        let limit = limit.min(i64::MAX as usize) as i64;
        let rows = client
            .query(
                "SELECT seq, body FROM events WHERE seq >= $1 ORDER BY seq LIMIT $2",
                &[&(from as i64), &limit],
            )
            .await?;
        rows.iter().map(event_of).collect()
    }
}
