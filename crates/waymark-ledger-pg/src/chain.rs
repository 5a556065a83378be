//! The one audit chain of every daemon: appends serialized on the `chain_head` row, reads,
//! and `verify` with the sled ledger's rule.

use waymark_core::{ExecutionId, Timestamp};
use waymark_ledger::{
    ChainHead, ChainKey, ChainProblem, ChainWalk, EventKind, LedgerEvent, Progress, StoredJson,
    VerifyReport, PROGRESS_PAGE,
};

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
        self.verify_since(None, exported, &|_, _| {}).await
    }

    /// [`PgLedger::verify`], from `since` when given (a head kept earlier, trusted: only the
    /// events after it are checked). The events are read a page at a time.
    pub async fn verify_since(
        &self,
        since: Option<&ChainHead>,
        exported: Option<&ChainHead>,
        progress: Progress<'_>,
    ) -> Result<VerifyReport> {
        const PAGE: i64 = PROGRESS_PAGE as i64;
        let client = self.pool.get().await?;
        let head = self.head().await?;
        let genesis = ChainHead::genesis();
        let start = match since {
            None => genesis,
            Some(a) if a.seq > head.seq => {
                let (last, ahead) = (head.seq, a.seq);
                let problem = ChainProblem::Truncated { last, head: ahead };
                return Ok(ChainWalk::refused(a, last + 1, problem));
            }
            Some(a) => {
                let there: Option<String> = if a.seq == 0 {
                    Some(genesis.hash)
                } else {
                    client
                        .query_opt(
                            "SELECT body->>'hash' FROM events WHERE seq = $1",
                            &[&(a.seq as i64)],
                        )
                        .await?
                        .map(|r| r.get(0))
                };
                if there.as_deref() != Some(a.hash.as_str()) {
                    let problem = ChainProblem::DivergedFromHead;
                    return Ok(ChainWalk::refused(a, a.seq, problem));
                }
                a.clone()
            }
        };
        let mut walk = ChainWalk::new(&self.keys.1, &start, since.is_some(), exported);
        let mut after = start.seq as i64;
        loop {
            let rows = client
                .query(
                    "SELECT seq, body::text FROM events WHERE seq > $1 AND seq <= $2
                     ORDER BY seq LIMIT $3",
                    &[&after, &(head.seq as i64), &PAGE],
                )
                .await?;
            let Some(last) = rows.last() else { break };
            after = last.get(0);
            let events = rows.iter().map(|r| {
                let body: String = r.get(1);
                (r.get::<_, i64>(0) as u64, Ok(StoredJson(body.into_bytes())))
            });
            if !walk.feed(events) {
                break;
            }
            progress(walk.events(), head.seq.saturating_sub(start.seq));
        }
        Ok(walk.finish(&head))
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
