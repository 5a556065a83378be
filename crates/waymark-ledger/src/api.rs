//! [`LedgerApi`]: the ledger as the gateway and the daemon use it, whatever stores it.
//!
//! Two backends implement it: the sled [`Ledger`] of this crate (one daemon) and the shared
//! ledger of `waymark-ledger-pg` (several daemons on one PostgreSQL database). The interface is
//! async because a database is; it is object safe (each method returns a boxed future) so a
//! daemon holds `Arc<dyn LedgerApi>` and picks the backend from its configuration at run time.
//! The names and arguments are those of [`Ledger`]'s own methods, so a call site differs only
//! by its `.await`.
//!
//! The one new operation is [`LedgerApi::accept_or_attach`]: the matching rule and the write
//! it leads to, together, so that a backend shared by several daemons decides it in the
//! database rather than in one process.

use std::future::Future;
use std::pin::Pin;

use waymark_core::{
    decide, AttachAction, ExecutionId, Fingerprint, FingerprintKey, IncomingCall, MatchDecision,
    PriorExecution, Timestamp, Transition,
};

use crate::error::{LedgerError, Result};
use crate::gc::GcReport;
use crate::query::{ListQuery, Page};
use crate::records::{
    ChainHead, Durability, ExecutionRecord, LedgerEvent, NewExecution, RunRecord, StoredResult,
};
use crate::{Ledger, VerifyReport};

/// What a [`LedgerApi`] method returns: a future of the ledger's own result.
pub type LedgerFuture<'a, T> = Pin<Box<dyn Future<Output = Result<T>> + Send + 'a>>;

/// What [`LedgerApi::accept_or_attach`] decided and wrote.
#[derive(Clone, Debug, PartialEq)]
pub enum Intake {
    /// A new intent: the execution was accepted.
    New(ExecutionRecord),
    /// A retry of an earlier execution: the attach is recorded; do `action` with it.
    Attach {
        record: ExecutionRecord,
        action: AttachAction,
    },
}

/// Told how far a walk of the chain got: events checked, of how many it will check.
pub type Progress<'a> = &'a (dyn Fn(u64, u64) + Send + Sync);

/// The matching rule's view of a stored execution.
pub fn prior_of(r: &ExecutionRecord) -> PriorExecution {
    PriorExecution {
        id: r.id,
        lifecycle: r.lifecycle,
        actor: r.actor.clone(),
        scope: r.scope.clone(),
        accepted_at: r.accepted_at,
        finished_at: r.finished_at,
    }
}

/// The ledger, as the gateway and the daemon use it. See the module documentation.
pub trait LedgerApi: Send + Sync {
    /// Which backend this is, and where: for logs, `waymark config check` and errors.
    fn describe(&self) -> String;

    /// The key for intent fingerprints and secret MACs, derived from the master key.
    fn fingerprint_key(&self) -> FingerprintKey;

    /// The ledger's identity ([`crate::ledger_identity`]), the same for every daemon sharing
    /// it: hosts record it beside the markers it owns.
    fn identity(&self) -> String;

    /// Mints a new execution id at `now`.
    fn mint_id(&self, now: Timestamp) -> ExecutionId;

    /// Whether this process may move `record` on (drive it, reconcile it): always for a ledger
    /// one daemon owns; for a shared one, only an execution whose lease this daemon holds.
    fn drives(&self, record: &ExecutionRecord) -> bool;

    /// Whether other daemons write this ledger too, so that a change this process waits for
    /// (an operator's answer to an approval) may be recorded by another one and must be read
    /// from the ledger, not only heard of in process.
    fn shared(&self) -> bool {
        false
    }

    /// Execution `id`, as [`LedgerApi::get`]; on a shared ledger, also taken over by this
    /// process (its lease, epoch + 1) when it is unresolved and no daemon drives it: its driver
    /// let it go ([`LedgerApi::let_go`]), or it is this daemon's own. Whoever needs such an
    /// execution moved on (a retry, a resume, a call following it) drives it from there, on any
    /// daemon; two daemons adopting at once get one lease, decided by the database.
    fn get_or_adopt(
        &self,
        id: ExecutionId,
        _now: Timestamp,
    ) -> LedgerFuture<'_, Option<ExecutionRecord>> {
        self.get(id)
    }

    /// Stops this process driving execution `id`, on a shared ledger: the lease is given up as
    /// this returns (a write under it from here on is fenced), and the future tells the ledger
    /// that nobody drives the execution, so that the next call on any daemon adopts it
    /// ([`LedgerApi::get_or_adopt`]). `None` when no lease was held: always for a ledger one
    /// process owns, and for an execution that reached a final state (its lease ends there).
    fn let_go(&self, _id: ExecutionId) -> Option<LedgerFuture<'static, ()>> {
        None
    }

    /// Decides `call` with core's matching rule against the executions of `new`'s fingerprint
    /// and, in the same decision, accepts `new` (with `durability`) or records the attach
    /// (flushed). No other decision about the same intent can come in between.
    fn accept_or_attach<'a>(
        &'a self,
        new: NewExecution,
        call: &'a IncomingCall,
        durability: Durability,
    ) -> LedgerFuture<'a, Intake>;

    /// Applies a lifecycle transition to an execution, with its audit event, atomically.
    fn transition(
        &self,
        id: ExecutionId,
        transition: Transition,
        now: Timestamp,
        durability: Durability,
    ) -> LedgerFuture<'_, ExecutionRecord>;

    /// Applies `transitions` to `id` in order, the last with `durability` (those before it are
    /// covered by its flush): the first refused ends the call with its error, and those before
    /// it stay written. A shared ledger makes them one write (one round of its group commit
    /// instead of one each), which is why the gateway authorizes and dispatches with it.
    fn transitions(
        &self,
        id: ExecutionId,
        transitions: Vec<Transition>,
        now: Timestamp,
        durability: Durability,
    ) -> LedgerFuture<'_, ExecutionRecord> {
        Box::pin(async move {
            let last = transitions.len().saturating_sub(1);
            let mut record = None;
            for (i, t) in transitions.into_iter().enumerate() {
                let d = if i == last {
                    durability
                } else {
                    Durability::Buffered
                };
                record = Some(self.transition(id, t, now, d).await?);
            }
            match record {
                Some(r) => Ok(r),
                None => self.get(id).await?.ok_or(LedgerError::NotFound(id)),
            }
        })
    }

    /// Like [`LedgerApi::transition`], storing the execution's result in the same transaction.
    fn transition_with_result(
        &self,
        id: ExecutionId,
        transition: Transition,
        result: StoredResult,
        now: Timestamp,
        durability: Durability,
    ) -> LedgerFuture<'_, ExecutionRecord>;

    /// The execution with this id.
    fn get(&self, id: ExecutionId) -> LedgerFuture<'_, Option<ExecutionRecord>>;

    /// Executions with this fingerprint, newest first.
    fn by_fingerprint<'a>(&'a self, fp: &'a Fingerprint) -> LedgerFuture<'a, Vec<ExecutionRecord>>;

    /// Executions matching `q`, one page at a time.
    fn list<'a>(&'a self, q: &'a ListQuery) -> LedgerFuture<'a, Page>;

    /// The stored result of an execution.
    fn result(&self, id: ExecutionId) -> LedgerFuture<'_, Option<StoredResult>>;

    /// A gateway setting (for example whether new actions are locked), if set.
    fn setting<'a>(&'a self, name: &'a str) -> LedgerFuture<'a, Option<serde_json::Value>>;

    /// Sets a gateway setting and records the change in the audit chain, atomically.
    fn set_setting<'a>(
        &'a self,
        name: &'a str,
        value: serde_json::Value,
        by: &'a str,
        now: Timestamp,
        durability: Durability,
    ) -> LedgerFuture<'a, u64>;

    /// Records a gateway fact that belongs to no execution's life (a call refused for being
    /// outside its actor's rights, say) in the audit chain, as a `note` event named `name`.
    fn record_note<'a>(
        &'a self,
        name: &'a str,
        data: serde_json::Value,
        now: Timestamp,
        durability: Durability,
    ) -> LedgerFuture<'a, u64>;

    /// Starts an agent run and returns its record.
    fn start_run<'a>(
        &'a self,
        actor: waymark_core::Actor,
        transport: &'a str,
        now: Timestamp,
        durability: Durability,
    ) -> LedgerFuture<'a, RunRecord>;

    /// Counts a call in a run (not an audit event: a lost count is not a lost fact).
    fn count_call<'a>(&'a self, run_id: &'a str) -> LedgerFuture<'a, ()>;

    /// Ends an agent run.
    fn end_run<'a>(
        &'a self,
        run_id: &'a str,
        now: Timestamp,
        durability: Durability,
    ) -> LedgerFuture<'a, ()>;

    /// Agent runs, newest first.
    fn runs(&self, limit: usize) -> LedgerFuture<'_, Vec<RunRecord>>;

    /// One agent run, by its id (an index read, whatever its age).
    fn run<'a>(&'a self, id: &'a str) -> LedgerFuture<'a, Option<RunRecord>>;

    /// Audit events of one execution, in order.
    fn events_of(&self, id: ExecutionId) -> LedgerFuture<'_, Vec<LedgerEvent>>;

    /// Audit events from `from` on, at most `limit`.
    fn events(&self, from: u64, limit: usize) -> LedgerFuture<'_, Vec<LedgerEvent>>;

    /// The current head of the audit chain.
    fn head(&self) -> LedgerFuture<'_, ChainHead>;

    /// Walks the audit chain and reports the first bad event; with `exported`, also proves
    /// that the chain still reaches that head.
    fn verify<'a>(&'a self, exported: Option<&'a ChainHead>) -> LedgerFuture<'a, VerifyReport>;

    /// [`LedgerApi::verify`], from `since` when given (a head kept earlier and trusted: only the
    /// events after it are checked), telling `progress` how many events it checked of how many
    /// it will, a page at a time.
    fn verify_since<'a>(
        &'a self,
        since: Option<&'a ChainHead>,
        exported: Option<&'a ChainHead>,
        progress: Progress<'a>,
    ) -> LedgerFuture<'a, VerifyReport>;

    /// A consistent copy of the ledger in `dest` (missing or empty), taken while it serves;
    /// returns the head the copy holds. A backend that cannot says how to back it up instead.
    fn backup<'a>(&'a self, dest: &'a std::path::Path) -> LedgerFuture<'a, ChainHead>;

    /// Retention: removes resolved executions accepted before `older_than` and the audit
    /// events only they needed.
    fn gc(&self, older_than: Timestamp, now: Timestamp) -> LedgerFuture<'_, GcReport>;

    /// What [`LedgerApi::gc`] would remove now, removing nothing.
    fn gc_plan(&self, older_than: Timestamp) -> LedgerFuture<'_, GcReport>;

    /// Makes everything written so far durable.
    fn flush(&self) -> LedgerFuture<'_, ()>;
}

impl Ledger {
    /// [`LedgerApi::accept_or_attach`] on this ledger. The caller serializes calls of one
    /// intent (the gateway's intent lock): this reads, decides, then writes.
    pub fn accept_or_attach(
        &self,
        new: NewExecution,
        call: &IncomingCall,
        durability: Durability,
    ) -> Result<Intake> {
        let priors: Vec<PriorExecution> = self
            .by_fingerprint(&new.fingerprint)?
            .iter()
            .map(prior_of)
            .collect();
        match decide(&priors, call) {
            MatchDecision::New => Ok(Intake::New(self.accept(new, call.now, durability)?)),
            MatchDecision::Attach { execution, action } => {
                let record = self.record_attach(
                    execution,
                    call.actor.clone(),
                    action,
                    new.run.clone(),
                    call.now,
                    Durability::Flushed,
                )?;
                Ok(Intake::Attach { record, action })
            }
        }
    }
}

/// sled's ledger is synchronous: each method does its work when the future is first polled,
/// on the caller's task, as the gateway did before the interface existed.
impl LedgerApi for Ledger {
    fn describe(&self) -> String {
        format!("sled ledger {}", self.dir().display())
    }

    fn fingerprint_key(&self) -> FingerprintKey {
        Ledger::fingerprint_key(self)
    }

    fn identity(&self) -> String {
        Ledger::identity(self).to_string()
    }

    fn mint_id(&self, now: Timestamp) -> ExecutionId {
        Ledger::mint_id(self, now)
    }

    fn drives(&self, _record: &ExecutionRecord) -> bool {
        true
    }

    fn accept_or_attach<'a>(
        &'a self,
        new: NewExecution,
        call: &'a IncomingCall,
        durability: Durability,
    ) -> LedgerFuture<'a, Intake> {
        Box::pin(async move { Ledger::accept_or_attach(self, new, call, durability) })
    }

    fn transition(
        &self,
        id: ExecutionId,
        transition: Transition,
        now: Timestamp,
        durability: Durability,
    ) -> LedgerFuture<'_, ExecutionRecord> {
        Box::pin(async move { Ledger::transition(self, id, transition, now, durability) })
    }

    fn transition_with_result(
        &self,
        id: ExecutionId,
        transition: Transition,
        result: StoredResult,
        now: Timestamp,
        durability: Durability,
    ) -> LedgerFuture<'_, ExecutionRecord> {
        Box::pin(async move {
            Ledger::transition_with_result(self, id, transition, result, now, durability)
        })
    }

    fn get(&self, id: ExecutionId) -> LedgerFuture<'_, Option<ExecutionRecord>> {
        Box::pin(async move { Ledger::get(self, id) })
    }

    fn by_fingerprint<'a>(&'a self, fp: &'a Fingerprint) -> LedgerFuture<'a, Vec<ExecutionRecord>> {
        Box::pin(async move { Ledger::by_fingerprint(self, fp) })
    }

    fn list<'a>(&'a self, q: &'a ListQuery) -> LedgerFuture<'a, Page> {
        Box::pin(async move { Ledger::list(self, q) })
    }

    fn result(&self, id: ExecutionId) -> LedgerFuture<'_, Option<StoredResult>> {
        Box::pin(async move { Ledger::result(self, id) })
    }

    fn setting<'a>(&'a self, name: &'a str) -> LedgerFuture<'a, Option<serde_json::Value>> {
        Box::pin(async move { Ledger::setting(self, name) })
    }

    fn set_setting<'a>(
        &'a self,
        name: &'a str,
        value: serde_json::Value,
        by: &'a str,
        now: Timestamp,
        durability: Durability,
    ) -> LedgerFuture<'a, u64> {
        Box::pin(async move { Ledger::set_setting(self, name, value, by, now, durability) })
    }

    fn record_note<'a>(
        &'a self,
        name: &'a str,
        data: serde_json::Value,
        now: Timestamp,
        durability: Durability,
    ) -> LedgerFuture<'a, u64> {
        Box::pin(async move { Ledger::record_note(self, None, name, data, now, durability) })
    }

    fn start_run<'a>(
        &'a self,
        actor: waymark_core::Actor,
        transport: &'a str,
        now: Timestamp,
        durability: Durability,
    ) -> LedgerFuture<'a, RunRecord> {
        Box::pin(async move { Ledger::start_run(self, actor, transport, now, durability) })
    }

    fn count_call<'a>(&'a self, run_id: &'a str) -> LedgerFuture<'a, ()> {
        Box::pin(async move { Ledger::count_call(self, run_id) })
    }

    fn end_run<'a>(
        &'a self,
        run_id: &'a str,
        now: Timestamp,
        durability: Durability,
    ) -> LedgerFuture<'a, ()> {
        Box::pin(async move { Ledger::end_run(self, run_id, now, durability) })
    }

    fn runs(&self, limit: usize) -> LedgerFuture<'_, Vec<RunRecord>> {
        Box::pin(async move { Ledger::runs(self, limit) })
    }

    fn run<'a>(&'a self, id: &'a str) -> LedgerFuture<'a, Option<RunRecord>> {
        Box::pin(async move { Ledger::run(self, id) })
    }

    fn events_of(&self, id: ExecutionId) -> LedgerFuture<'_, Vec<LedgerEvent>> {
        Box::pin(async move { Ledger::events_of(self, id) })
    }

    fn events(&self, from: u64, limit: usize) -> LedgerFuture<'_, Vec<LedgerEvent>> {
        Box::pin(async move { Ledger::events(self, from, limit) })
    }

    fn head(&self) -> LedgerFuture<'_, ChainHead> {
        Box::pin(async move { Ok(Ledger::head(self)) })
    }

    fn verify<'a>(&'a self, exported: Option<&'a ChainHead>) -> LedgerFuture<'a, VerifyReport> {
        Box::pin(async move { Ledger::verify(self, exported) })
    }

    fn verify_since<'a>(
        &'a self,
        since: Option<&'a ChainHead>,
        exported: Option<&'a ChainHead>,
        progress: Progress<'a>,
    ) -> LedgerFuture<'a, VerifyReport> {
        Box::pin(async move { Ledger::verify_since(self, since, exported, progress) })
    }

    fn backup<'a>(&'a self, dest: &'a std::path::Path) -> LedgerFuture<'a, ChainHead> {
        Box::pin(async move { Ledger::backup(self, dest) })
    }

    fn gc(&self, older_than: Timestamp, now: Timestamp) -> LedgerFuture<'_, GcReport> {
        Box::pin(async move { Ledger::gc(self, older_than, now) })
    }

    fn gc_plan(&self, older_than: Timestamp) -> LedgerFuture<'_, GcReport> {
        Box::pin(async move { Ledger::gc_plan(self, older_than) })
    }

    fn flush(&self) -> LedgerFuture<'_, ()> {
        Box::pin(async move { Ledger::flush(self) })
    }
}
