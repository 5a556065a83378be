//! Reconcile on daemon start: each channel's driver recovers what may be at its target.

use std::collections::BTreeMap;
use std::future::Future;
use std::pin::Pin;
use std::task::Poll;

use waymark_core::{ExecState, ExecutionId, Transition};
use waymark_ledger::{ExecutionRecord, LedgerError, ListQuery};

use crate::host::HostExecutor;

use super::{now, Gateway, GatewayError, FLUSHED};

impl<E: HostExecutor> Gateway<E> {
    /// On daemon start: every execution left dispatched, running or unknown is recovered by
    /// its channel's driver (an SSH host's markers read in batches of [`RECONCILE_BATCH`] ids
    /// per wrapper call, every host at the same time; an HTTP target by its tool's contract);
    /// accepted or authorized ones past their window expire.
    pub async fn reconcile(&self) -> Result<ReconcileReport, GatewayError> {
        let mut report = ReconcileReport::default();
        let on_host = [
            ExecState::Dispatched,
            ExecState::Running,
            ExecState::Unknown,
        ];
        // Each channel's driver recovers its own, as far as its target can tell.
        let mut by_channel: BTreeMap<String, Vec<ExecutionRecord>> = BTreeMap::new();
        for rec in self.oldest_first_in(on_host).await? {
            report.checked += 1;
            let name = rec.action.channel().name().to_string();
            by_channel.entry(name).or_default().push(rec);
        }
        for (name, recs) in by_channel {
            match self.driver_for(recs[0].action.channel()) {
                Ok(driver) => driver.reconcile(self, recs, &mut report).await,
                Err(e) => {
                    tracing::warn!(channel = %name, error = %e, "reconcile: cannot recover these executions");
                    report.unreachable += recs.len() as u64;
                }
            }
        }
        let not_sent = [
            ExecState::Accepted,
            ExecState::Authorized,
            ExecState::AwaitingApproval,
        ];
        for rec in self.oldest_first_in(not_sent).await? {
            if now().since(rec.accepted_at) > self.retry_window(&rec) {
                match self
                    .ledger
                    .transition(rec.id, Transition::Expire, now(), FLUSHED)
                    .await
                {
                    Ok(_) => report.expired += 1,
                    Err(e) => report.write_refused(rec.id, &e.into()),
                }
            }
        }
        Ok(report)
    }

    /// On a shared ledger, lets go of the executions in `ids` this daemon holds but no call of
    /// it drives (what a status check or a cancel adopted, or what the daemon took on a
    /// heartbeat and reconcile left unresolved: a command still running, a host it could not
    /// ask, an approval still awaited), so that the next call on any daemon adopts and drives
    /// them rather than following a lease nobody drives. Only ids the caller took: a call that
    /// has accepted an execution holds its lease before it drives it. One a call drives keeps its lease: its
    /// driver lets go when it ends.
    pub async fn let_go_of_idle(&self, ids: &[ExecutionId]) {
        if !self.ledger.shared() {
            return;
        }
        let releases: Vec<_> = {
            let driven = self.inflight.lock().expect("inflight");
            ids.iter()
                .filter(|id| !driven.contains_key(id))
                .filter_map(|id| self.ledger.let_go(*id).map(|r| (*id, r)))
                .collect()
        };
        for (id, release) in releases {
            if let Err(e) = release.await {
                tracing::warn!(%id, error = %e, "could not let go of an execution");
            }
        }
    }

    /// Every execution in one of `states`, oldest first within each state.
    async fn oldest_first_in(
        &self,
        states: [ExecState; 3],
    ) -> Result<Vec<ExecutionRecord>, GatewayError> {
        let mut all = Vec::new();
        for state in states {
            let q = ListQuery {
                state: Some(state),
                limit: 100_000,
                oldest_first: true,
                ..Default::default()
            };
            // A shared ledger lists every daemon's executions; this one moves only its own.
            let page = self.ledger.list(&q).await?;
            all.extend(page.items.into_iter().filter(|r| self.ledger.drives(r)));
        }
        Ok(all)
    }
}

/// Executions whose markers one wrapper call reads during [`Gateway::reconcile`].
pub const RECONCILE_BATCH: usize = 100;
/// Wrapper calls (and recordings) in flight at once during [`Gateway::reconcile`].
pub(super) const RECONCILE_PARALLEL: usize = 8;

/// Runs `f` on every item with at most `limit` futures in flight at once, all on the calling
/// task (so they may borrow), and returns the outputs in the items' order. Also what bounds a
/// fan-out (`fanout`).
pub(super) async fn join_bounded<T, F, Fut>(items: Vec<T>, limit: usize, f: F) -> Vec<Fut::Output>
where
    F: Fn(T) -> Fut,
    Fut: Future,
{
    let total = items.len();
    let mut pending = items.into_iter().enumerate();
    let mut running: Vec<(usize, Pin<Box<Fut>>)> = Vec::new();
    let mut out: Vec<Option<Fut::Output>> = (0..total).map(|_| None).collect();
    std::future::poll_fn(|cx| loop {
        while running.len() < limit.max(1) {
            match pending.next() {
                Some((i, item)) => running.push((i, Box::pin(f(item)))),
                None => break,
            }
        }
        if running.is_empty() {
            return Poll::Ready(());
        }
        let mut finished = false;
        let mut k = 0;
        while k < running.len() {
            if let Poll::Ready(v) = running[k].1.as_mut().poll(cx) {
                out[running[k].0] = Some(v);
                running.swap_remove(k);
                finished = true;
            } else {
                k += 1;
            }
        }
        if !finished {
            return Poll::Pending;
        }
    })
    .await;
    out.into_iter()
        .map(|o| o.expect("every future finished"))
        .collect()
}

/// What [`Gateway::reconcile`] did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ReconcileReport {
    pub checked: u64,
    pub moved: u64,
    pub unreachable: u64,
    pub expired: u64,
    /// Writes refused because another daemon drives the execution now (its lease was let go
    /// or taken over while this reconcile ran): that daemon records it.
    pub fenced: u64,
    /// Writes that failed otherwise (the database, an illegal transition): the execution stays
    /// as it was, for the next status check, retry or reconcile.
    pub failed: u64,
}

impl ReconcileReport {
    /// Counts execution `id`'s write that was refused with `e`, and says so.
    pub(super) fn write_refused(&mut self, id: ExecutionId, e: &GatewayError) {
        if let GatewayError::Ledger(LedgerError::Fenced { .. }) = e {
            tracing::info!(%id, error = %e, "reconcile: another daemon drives it now");
            self.fenced += 1;
        } else {
            tracing::warn!(%id, error = %e, "reconcile: cannot record what the marker shows");
            self.failed += 1;
        }
    }
}
