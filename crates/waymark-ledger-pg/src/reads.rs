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
        // Only the filters given, so the planner sees each one and can take its index
        // (`state`, or the tool, host and actor expression indexes of schema 4).
        let after_cond = format!("id {after_cmp} ");
        let filters: [(&str, Option<&str>); 7] = [
            ("state = ", q.state.map(|s| s.as_str())),
            (
                "record->>'actor' = ",
                q.actor.as_ref().map(|a| a.0.as_str()),
            ),
            ("record->>'host' = ", q.host.as_deref()),
            ("record->>'tool' = ", q.tool.as_deref()),
            ("id >= ", lo.as_deref()),
            ("id < ", hi.as_deref()),
            (after_cond.as_str(), after.as_deref()),
        ];
        let values: Vec<(&str, &str)> = filters
            .iter()
            .filter_map(|(c, v)| Some((*c, (*v)?)))
            .collect();
        let mut conds = Vec::new();
        let mut params: Vec<&(dyn tokio_postgres::types::ToSql + Sync)> = Vec::new();
        for (cond, value) in &values {
            params.push(value);
            conds.push(format!("{cond}${}", params.len()));
        }
        let fetch = (limit + 1) as i64;
        params.push(&fetch);
        let sql = format!(
            "SELECT id, record FROM executions {} ORDER BY id {order} LIMIT ${}",
            if conds.is_empty() {
                String::new()
            } else {
                format!("WHERE {}", conds.join(" AND "))
            },
            params.len()
        );
        let client = self.pool.get().await?;
        let rows = client.query(&sql, &params).await?;
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
