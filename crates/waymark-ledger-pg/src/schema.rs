//! The schema: versioned migrations, applied under an advisory lock by whichever daemon
//! starts first; a schema newer than this binary is refused.

use crate::{PgLedger, PgLedgerError, Result};

/// The schema, one migration per version; version N is `MIGRATIONS[N - 1]`. Append only.
pub(crate) const MIGRATIONS: &[&str] = &[
    // 1: executions with owner and epoch, daemons with heartbeats.
    r#"
    CREATE TABLE executions (
        id          text PRIMARY KEY,
        fingerprint text NOT NULL,
        state       text NOT NULL,
        record      jsonb NOT NULL,
        owner       text,
        epoch       bigint NOT NULL,
        accepted_ms bigint NOT NULL,
        updated_ms  bigint NOT NULL
    );
    CREATE INDEX executions_by_fingerprint ON executions (fingerprint, id DESC);
    CREATE INDEX executions_unresolved_by_owner ON executions (owner)
        WHERE state NOT IN ('denied', 'expired', 'completed', 'failed', 'timed_out', 'cancelled', 'reviewed');
    CREATE TABLE daemons (
        name         text PRIMARY KEY,
        started_ms   bigint NOT NULL,
        heartbeat_ms bigint NOT NULL
    );
    "#,
    // 2: the audit chain, one total order across daemons, appended under the head row's lock.
    r#"
    CREATE TABLE events (
        seq       bigint PRIMARY KEY,
        execution text,
        body      jsonb NOT NULL
    );
    CREATE INDEX events_by_execution ON events (execution, seq);
    CREATE TABLE chain_head (
        id   integer PRIMARY KEY CHECK (id = 1),
        seq  bigint NOT NULL,
        hash text NOT NULL
    );
    INSERT INTO chain_head (id, seq, hash) VALUES (1, 0, repeat('0', 64));
    "#,
    // 3: what the gateway needs besides executions: results, agent runs, settings, and a
    //    retention base. Ids compare byte-wise (ULIDs sort by time only in the C collation).
    r#"
    ALTER TABLE executions ALTER COLUMN id TYPE text COLLATE "C";
    CREATE INDEX executions_by_state ON executions (state, id);
    CREATE TABLE results (
        id            text COLLATE "C" PRIMARY KEY,
        stdout_head   bytea NOT NULL,
        stdout_total  bigint NOT NULL,
        stdout_sha256 text NOT NULL,
        stderr_head   bytea NOT NULL,
        stderr_total  bigint NOT NULL,
        stderr_sha256 text NOT NULL
    );
    CREATE TABLE runs (
        id     text COLLATE "C" PRIMARY KEY,
        record jsonb NOT NULL
    );
    CREATE TABLE settings (
        name  text PRIMARY KEY,
        value jsonb NOT NULL
    );
    "#,
    // 4: `exec list` by tool, host or actor reads an index, newest first, not the table.
    r#"
    CREATE INDEX executions_by_tool ON executions ((record->>'tool'), id);
    CREATE INDEX executions_by_host ON executions ((record->>'host'), id);
    CREATE INDEX executions_by_actor ON executions ((record->>'actor'), id);
    "#,
];

/// Serializes schema changes between daemons starting at once ("Waymark" + 1).
const MIGRATION_LOCK: i64 = 0x5761_796d_6172_6b01;

impl PgLedger {
    /// The schema version this binary creates and reads.
    pub fn known_schema_version() -> u32 {
        MIGRATIONS.len() as u32
    }

    pub(crate) async fn migrate(&self, create: bool) -> Result<()> {
        let mut client = self.pool.get().await?;
        let tx = client.transaction().await?;
        tx.execute("SELECT pg_advisory_xact_lock($1)", &[&MIGRATION_LOCK])
            .await?;
        if !create {
            let exists: bool = tx
                .query_one("SELECT to_regclass('waymark_schema') IS NOT NULL", &[])
                .await?
                .get(0);
            if !exists {
                return Err(PgLedgerError::NoLedger);
            }
        }
        tx.batch_execute("CREATE TABLE IF NOT EXISTS waymark_schema (version integer NOT NULL)")
            .await?;
        let found: Option<i32> = tx
            .query_opt("SELECT version FROM waymark_schema", &[])
            .await?
            .map(|r| r.get(0));
        let found = found.unwrap_or(0) as u32;
        let known = Self::known_schema_version();
        if found > known {
            return Err(PgLedgerError::SchemaTooNew { found, known });
        }
        for sql in &MIGRATIONS[found as usize..] {
            tx.batch_execute(sql).await?;
        }
        if found == 0 {
            tx.execute(
                "INSERT INTO waymark_schema (version) VALUES ($1)",
                &[&(known as i32)],
            )
            .await?;
        } else if found < known {
            tx.execute("UPDATE waymark_schema SET version = $1", &[&(known as i32)])
                .await?;
        }
        tx.commit().await?;
        Ok(())
    }

    /// The schema version stored in the database.
    pub async fn schema_version(&self) -> Result<u32> {
        let client = self.pool.get().await?;
        let row = client
            .query_one("SELECT version FROM waymark_schema", &[])
            .await?;
        Ok(row.get::<_, i32>(0) as u32)
    }
}
