//! [`PgBackend`]: one daemon's handle on the shared ledger, as the gateway's [`LedgerApi`].
//!
//! It carries the daemon's name and the leases it holds: an execution this daemon accepted
//! (epoch 1), reclaimed from its own earlier run, or took over from a dead daemon. A transition
//! is written under the lease held for that execution, and fenced when none is held or another
//! daemon took it since: a daemon never moves an execution another one drives.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use waymark_core::{
    Actor, ExecutionId, Fingerprint, FingerprintKey, IncomingCall, Timestamp, Transition,
};
use waymark_ledger::{
    ChainHead, Durability, ExecutionRecord, GcReport, Intake as ApiIntake, LedgerApi, LedgerEvent,
    LedgerFuture, ListQuery, NewExecution, Page, RunRecord, StoredResult, VerifyReport,
};

use crate::{Intake, Lease, PgLedger, Result};

/// A daemon's handle on the shared ledger: see the module documentation.
pub struct PgBackend {
    ledger: PgLedger,
    me: String,
    /// Execution → the epoch of the lease this daemon holds on it.
    leases: Mutex<HashMap<ExecutionId, i64>>,
    /// The session holding this daemon's name, once claimed.
    name_claim: Mutex<Option<tokio_postgres::Client>>,
}

impl PgBackend {
    /// The handle of daemon `me` (unique among the daemons sharing the database).
    pub fn new(ledger: PgLedger, me: &str) -> PgBackend {
        PgBackend {
            ledger,
            me: me.to_string(),
            leases: Mutex::new(HashMap::new()),
            name_claim: Mutex::new(None),
        }
    }

    /// Claims this daemon's name on the ledger for the daemon's life; refused while a live
    /// daemon holds it ([`crate::PgLedgerError::NameTaken`]): two daemons of one name would
    /// each take the other's executions back as their own.
    pub async fn claim_name(&self) -> Result<()> {
        let claim = self.ledger.claim_name(&self.me).await?;
        *self.name_claim.lock().expect("name claim") = Some(claim);
        Ok(())
    }

    /// The shared ledger underneath.
    pub fn ledger(&self) -> &PgLedger {
        &self.ledger
    }

    /// This daemon's name.
    pub fn name(&self) -> &str {
        &self.me
    }

    /// Registers this daemon (or refreshes its heartbeat), then takes the executions it now
    /// has to drive: those its own earlier run left and those nobody drives (on the first
    /// call), and those of daemons whose heartbeat is older than `dead_after`. Returns the
    /// executions taken, for the caller to reconcile through their host markers (reconcile
    /// lets go of what it leaves unresolved).
    pub async fn beat(
        &self,
        now: Timestamp,
        dead_after: Duration,
        first: bool,
    ) -> Result<Vec<ExecutionRecord>> {
        self.ledger.heartbeat(&self.me, now).await?;
        let mut taken = if first {
            let mut taken = self.ledger.reclaim(&self.me, now).await?;
            taken.extend(self.ledger.adopt_idle(&self.me, now).await?);
            taken
        } else {
            Vec::new()
        };
        taken.extend(self.ledger.take_over(&self.me, dead_after, now).await?);
        Ok(taken
            .into_iter()
            .map(|(record, lease)| {
                self.hold(record.id, lease.epoch);
                record
            })
            .collect())
    }

    /// Holds the lease of `epoch` on `id`, unless a later one is held already: two tasks of
    /// this daemon may learn of leases on one execution in either order (an accept answered
    /// after an attached call adopted it), and only the newest one can write.
    fn hold(&self, id: ExecutionId, epoch: i64) {
        let mut leases = self.leases.lock().expect("leases");
        let held = leases.entry(id).or_insert(epoch);
        *held = (*held).max(epoch);
    }

    /// The lease this daemon holds on `id`, or one that can never match (epoch 0): a write
    /// under it is fenced and names the daemon that drives the execution.
    fn lease(&self, id: ExecutionId) -> Lease {
        let epoch = self
            .leases
            .lock()
            .expect("leases")
            .get(&id)
            .copied()
            .unwrap_or(0);
        Lease {
            owner: self.me.clone(),
            epoch,
        }
    }

    async fn transition_with(
        &self,
        id: ExecutionId,
        transitions: Vec<Transition>,
        result: Option<StoredResult>,
        now: Timestamp,
        durability: Durability,
    ) -> waymark_ledger::Result<ExecutionRecord> {
        let lease = self.lease(id);
        let record = self
            .ledger
            .transitions_with(id, &lease, transitions, result, now, durability)
            .await?;
        if record.state().is_final() {
            self.leases.lock().expect("leases").remove(&id);
        }
        Ok(record)
    }
}

impl LedgerApi for PgBackend {
    fn describe(&self) -> String {
        format!("PostgreSQL ledger (daemon {})", self.me)
    }

    fn backup<'a>(&'a self, _dest: &'a std::path::Path) -> LedgerFuture<'a, ChainHead> {
        Box::pin(async move {
            Err(waymark_ledger::LedgerError::Database {
                at: "backup".into(),
                detail: "the shared ledger lives in PostgreSQL: back it up with pg_dump (or the \
                         server's own backups), and keep the ledger key file with it"
                    .into(),
            })
        })
    }

    fn fingerprint_key(&self) -> FingerprintKey {
        self.ledger.fingerprint_key()
    }

    fn identity(&self) -> String {
        self.ledger.identity().to_string()
    }

    fn mint_id(&self, now: Timestamp) -> ExecutionId {
        self.ledger.mint_id(now)
    }

    fn drives(&self, record: &ExecutionRecord) -> bool {
        self.leases.lock().expect("leases").contains_key(&record.id)
    }

    fn shared(&self) -> bool {
        true
    }

    fn accept_or_attach<'a>(
        &'a self,
        new: NewExecution,
        call: &'a IncomingCall,
        durability: Durability,
    ) -> LedgerFuture<'a, ApiIntake> {
        Box::pin(async move {
            let intake = self
                .ledger
                .accept_or_attach_with(new, call, &self.me, durability)
                .await?;
            Ok(match intake {
                Intake::New { record, lease } => {
                    self.hold(record.id, lease.epoch);
                    ApiIntake::New(record)
                }
                Intake::Attach { record, action } => ApiIntake::Attach { record, action },
            })
        })
    }

    fn transition(
        &self,
        id: ExecutionId,
        transition: Transition,
        now: Timestamp,
        durability: Durability,
    ) -> LedgerFuture<'_, ExecutionRecord> {
        Box::pin(self.transition_with(id, vec![transition], None, now, durability))
    }

    fn transition_with_result(
        &self,
        id: ExecutionId,
        transition: Transition,
        result: StoredResult,
        now: Timestamp,
        durability: Durability,
    ) -> LedgerFuture<'_, ExecutionRecord> {
        Box::pin(self.transition_with(id, vec![transition], Some(result), now, durability))
    }

    fn transitions(
        &self,
        id: ExecutionId,
        transitions: Vec<Transition>,
        now: Timestamp,
        durability: Durability,
    ) -> LedgerFuture<'_, ExecutionRecord> {
        Box::pin(self.transition_with(id, transitions, None, now, durability))
    }

    fn get(&self, id: ExecutionId) -> LedgerFuture<'_, Option<ExecutionRecord>> {
        Box::pin(async move { Ok(self.ledger.get(id).await?.map(|(r, _)| r)) })
    }

    fn get_or_adopt(
        &self,
        id: ExecutionId,
        now: Timestamp,
    ) -> LedgerFuture<'_, Option<ExecutionRecord>> {
        Box::pin(async move {
            let Some((record, lease)) = self.ledger.get(id).await? else {
                return Ok(None);
            };
            let mine = self.leases.lock().expect("leases").contains_key(&id);
            let idle = match &lease {
                None => true,
                // Left under this daemon's name by a lease it no longer holds.
                Some(l) => l.owner == self.me && !mine,
            };
            if !idle || record.state().is_final() {
                return Ok(Some(record));
            }
            match self.ledger.adopt(id, &self.me, now).await? {
                Some((record, lease)) => {
                    self.hold(id, lease.epoch);
                    Ok(Some(record))
                }
                // Another daemon adopted it first: it drives it now.
                None => Ok(Some(record)),
            }
        })
    }

    fn let_go(&self, id: ExecutionId) -> Option<LedgerFuture<'static, ()>> {
        let epoch = self.leases.lock().expect("leases").remove(&id)?;
        let ledger = self.ledger.clone();
        let lease = Lease {
            owner: self.me.clone(),
            epoch,
        };
        Some(Box::pin(async move {
            ledger.release(id, &lease).await?;
            Ok(())
        }))
    }

    fn by_fingerprint<'a>(&'a self, fp: &'a Fingerprint) -> LedgerFuture<'a, Vec<ExecutionRecord>> {
        Box::pin(async move { Ok(self.ledger.by_fingerprint(fp).await?) })
    }

    fn list<'a>(&'a self, q: &'a ListQuery) -> LedgerFuture<'a, Page> {
        Box::pin(async move { Ok(self.ledger.list(q).await?) })
    }

    fn result(&self, id: ExecutionId) -> LedgerFuture<'_, Option<StoredResult>> {
        Box::pin(async move { Ok(self.ledger.result(id).await?) })
    }

    fn setting<'a>(&'a self, name: &'a str) -> LedgerFuture<'a, Option<serde_json::Value>> {
        Box::pin(async move { Ok(self.ledger.setting(name).await?) })
    }

    fn set_setting<'a>(
        &'a self,
        name: &'a str,
        value: serde_json::Value,
        by: &'a str,
        now: Timestamp,
        durability: Durability,
    ) -> LedgerFuture<'a, u64> {
        Box::pin(async move {
            Ok(self
                .ledger
                .set_setting(name, value, by, now, durability)
                .await?)
        })
    }

    fn record_note<'a>(
        &'a self,
        name: &'a str,
        data: serde_json::Value,
        now: Timestamp,
        durability: Durability,
    ) -> LedgerFuture<'a, u64> {
        Box::pin(async move { Ok(self.ledger.record_note(name, data, now, durability).await?) })
    }

    fn start_run<'a>(
        &'a self,
        actor: Actor,
        transport: &'a str,
        now: Timestamp,
        durability: Durability,
    ) -> LedgerFuture<'a, RunRecord> {
        Box::pin(async move {
            Ok(self
                .ledger
                .start_run(actor, transport, now, durability)
                .await?)
        })
    }

    fn count_call<'a>(&'a self, run_id: &'a str) -> LedgerFuture<'a, ()> {
        Box::pin(async move { Ok(self.ledger.count_call(run_id).await?) })
    }

    fn end_run<'a>(
        &'a self,
        run_id: &'a str,
        now: Timestamp,
        durability: Durability,
    ) -> LedgerFuture<'a, ()> {
        Box::pin(async move { Ok(self.ledger.end_run(run_id, now, durability).await?) })
    }

    fn runs(&self, limit: usize) -> LedgerFuture<'_, Vec<RunRecord>> {
        Box::pin(async move { Ok(self.ledger.runs(limit).await?) })
    }

    fn run<'a>(&'a self, id: &'a str) -> LedgerFuture<'a, Option<RunRecord>> {
        Box::pin(async move { Ok(self.ledger.run(id).await?) })
    }

    fn events_of(&self, id: ExecutionId) -> LedgerFuture<'_, Vec<LedgerEvent>> {
        Box::pin(async move { Ok(self.ledger.events_of(id).await?) })
    }

    fn events(&self, from: u64, limit: usize) -> LedgerFuture<'_, Vec<LedgerEvent>> {
        Box::pin(async move { Ok(self.ledger.events(from, limit).await?) })
    }

    fn head(&self) -> LedgerFuture<'_, ChainHead> {
        Box::pin(async move { Ok(self.ledger.head().await?) })
    }

    fn verify<'a>(&'a self, exported: Option<&'a ChainHead>) -> LedgerFuture<'a, VerifyReport> {
        Box::pin(async move { Ok(self.ledger.verify(exported).await?) })
    }

    fn verify_since<'a>(
        &'a self,
        since: Option<&'a ChainHead>,
        exported: Option<&'a ChainHead>,
        progress: waymark_ledger::Progress<'a>,
    ) -> LedgerFuture<'a, VerifyReport> {
        let walk = self.ledger.verify_since(since, exported, progress);
        Box::pin(async move { Ok(walk.await?) })
    }

    fn gc(&self, older_than: Timestamp, now: Timestamp) -> LedgerFuture<'_, GcReport> {
        Box::pin(async move { Ok(self.ledger.gc(older_than, now).await?) })
    }

    fn gc_plan(&self, older_than: Timestamp) -> LedgerFuture<'_, GcReport> {
        Box::pin(async move { Ok(self.ledger.gc_plan(older_than).await?) })
    }

    fn flush(&self) -> LedgerFuture<'_, ()> {
        Box::pin(async move { Ok(self.ledger.flush().await?) })
    }
}
