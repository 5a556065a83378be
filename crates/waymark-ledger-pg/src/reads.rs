//! Reading executions: by fingerprint, filtered pages, results, counts.

use waymark_core::{ExecState, ExecutionId, Fingerprint};
use waymark_ledger::{CapturedOutput, ExecutionRecord, ListQuery, Page, StoredResult};

use crate::{record_of, PgLedger, Result};

impl PgLedger {
    /// Executions with this fingerprint, newest first.
    pub async fn by_fingerprint(&self, fp: &Fingerprint) -> Result<Vec<ExecutionRecord>> {
        let client = self.pool.get().await?;
        let rows = client
            .query(
                "SELECT id, record FROM executions WHERE fingerprint = $1 ORDER BY id DESC",
                &[&fp.to_string()],
            )
            .await?;
        rows.iter().map(|r| record_of(r.get(0), r.get(1))).collect()
    }

    /// Executions matching `q`, one page at a time, as the sled ledger pages them: ids bound
    /// the time range (they sort by time), `after` continues a page, `next` is set when more
    /// remain.
    pub async fn list(&self, q: &ListQuery) -> Result<Page> {
        let limit = if q.limit == 0 { 100 } else { q.limit };
        let lo = q.since.map(|t| ExecutionId::lower_bound(t).to_string());
        let hi = q.until.map(|t| ExecutionId::lower_bound(t).to_string());
        let after = q.after.map(|id| id.to_string());
        let (order, after_cmp) = if q.oldest_first {
            ("ASC", ">")
        } else {
            ("DESC", "<")
        };
        let sql = format!(
            "SELECT id, record FROM executions
             WHERE ($1::text IS NULL OR state = $1)
               AND ($2::text IS NULL OR record->>'actor' = $2)
               AND ($3::text IS NULL OR record->>'host' = $3)
               AND ($4::text IS NULL OR record->>'tool' = $4)
               AND ($5::text IS NULL OR id >= $5)
               AND ($6::text IS NULL OR id < $6)
               AND ($7::text IS NULL OR id {after_cmp} $7)
             ORDER BY id {order}
             LIMIT $8"
        );
        let client = self.pool.get().await?;
        let rows = client
            .query(
                &sql,
                &[
                    &q.state.map(|s| s.as_str()),
                    &q.actor.as_ref().map(|a| a.0.as_str()),
                    &q.host.as_deref(),
                    &q.tool.as_deref(),
                    &lo,
                    &hi,
                    &after,
                    &((limit + 1) as i64),
                ],
            )
            .await?;
        let items: Vec<ExecutionRecord> = rows
            .iter()
            .map(|r| record_of(r.get(0), r.get(1)))
            .collect::<Result<_>>()?;
        Ok(Page::of(items, limit))
    }

    /// The stored result of an execution.
    pub async fn result(&self, id: ExecutionId) -> Result<Option<StoredResult>> {
        let client = self.pool.get().await?;
        let row = client
            .query_opt(
                "SELECT stdout_head, stdout_total, stdout_sha256,
                        stderr_head, stderr_total, stderr_sha256
                 FROM results WHERE id = $1",
                &[&id.to_string()],
            )
            .await?;
        Ok(row.map(|r| {
            let stream = |at: usize| CapturedOutput {
                head: r.get(at),
                total_bytes: r.get::<_, i64>(at + 1) as u64,
                sha256: r.get(at + 2),
            };
            StoredResult {
                stdout: stream(0),
                stderr: stream(3),
            }
        }))
    }

    /// How many executions are in `state` (for tests and, later, metrics).
    pub async fn count_in_state(&self, state: ExecState) -> Result<u64> {
        let client = self.pool.get().await?;
        let row = client
            .query_one(
                "SELECT count(*) FROM executions WHERE state = $1",
                &[&state.as_str()],
            )
            .await?;
        Ok(row.get::<_, i64>(0) as u64)
    }
}
