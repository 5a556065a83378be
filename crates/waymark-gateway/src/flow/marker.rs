//! Marker observation: what the host's marker proves, recorded in the ledger.

use std::time::Duration;

use waymark_core::{ExecState, ExecutionId, Timestamp, Transition};
use waymark_ledger::{CapturedOutput, Durability, ExecutionRecord, LedgerError, StoredResult};

use crate::config::HostEntry;
use crate::host::{FetchedOutput, HostExecutor, MarkerView};

use super::{now, Gateway, GatewayError, FLUSHED};

impl<E: HostExecutor> Gateway<E> {
    /// Polls the marker of a running execution until it ends or `bound` passes.
    pub(super) async fn wait_on_host(
        &self,
        mut rec: ExecutionRecord,
        host: &HostEntry,
        bound: Duration,
    ) -> Result<ExecutionRecord, GatewayError> {
        let deadline = tokio::time::Instant::now() + bound;
        let mut pause = Duration::from_millis(50);
        while matches!(rec.state(), ExecState::Running | ExecState::Dispatched)
            && tokio::time::Instant::now() < deadline
        {
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(Duration::from_millis(500));
            match self.exec.status(host, rec.id).await {
                Ok(view) => rec = self.apply_marker(rec, view, host).await?,
                Err(_) => break,
            }
        }
        Ok(rec)
    }

    /// Moves the ledger to what the host's marker proves.
    pub(super) async fn apply_marker(
        &self,
        rec: ExecutionRecord,
        view: MarkerView,
        host: &HostEntry,
    ) -> Result<ExecutionRecord, GatewayError> {
        let id = rec.id;
        let state = rec.state();
        if !state.may_be_on_host() {
            return Ok(rec);
        }
        let rec = match view {
            // No marker: it has not started. It stays as it is, never "failed": a request
            // delayed in the network could still arrive, and only the same id is safe to send
            // again (a retry or `exec resume` does that; the marker refuses a second start).
            MarkerView::Absent => rec,
            MarkerView::Starting | MarkerView::Running { .. } => {
                let pid = if let MarkerView::Running { pid } = view {
                    pid
                } else {
                    None
                };
                if state == ExecState::Running {
                    rec
                } else {
                    self.observe(id, Transition::Started { pid }, now(), FLUSHED)
                        .await?
                }
            }
            MarkerView::Finished(outcome) => {
                match self.exec.fetch_output(host, id, self.result_cap).await {
                    Ok((stdout, stderr)) => {
                        let result = StoredResult {
                            stdout: captured(stdout, self.result_cap),
                            stderr: captured(stderr, self.result_cap),
                        };
                        self.observe_with_result(
                            id,
                            Transition::Finished { outcome },
                            result,
                            now(),
                            FLUSHED,
                        )
                        .await?
                    }
                    // Never an empty result for a failed fetch: the outcome stays open (the
                    // marker keeps the output) and the next status, retry or reconcile
                    // fetches it again.
                    Err(e) if state == ExecState::Unknown => {
                        tracing::info!(%id, error = %e, "output fetch failed; still unknown");
                        rec
                    }
                    Err(e) => {
                        let reason = format!("{OUTPUT_NOT_FETCHED} ({e})");
                        self.observe(id, Transition::Lost { reason }, now(), FLUSHED)
                            .await?
                    }
                }
            }
            MarkerView::Interrupted => {
                self.observe(id, Transition::Interrupted, now(), FLUSHED)
                    .await?
            }
            MarkerView::NotLaunched { reason } => {
                let reason = format!("the host never launched it: {reason}");
                self.observe(id, Transition::NotStarted { reason }, now(), FLUSHED)
                    .await?
            }
        };
        Ok(rec)
    }

    /// Records what the host showed. Two tasks can observe the same end (the driver's reply and
    /// a status or cancel request); the marker is one truth, so the first record wins and a
    /// later, now illegal, observation returns the record as it stands.
    pub(super) async fn observe(
        &self,
        id: ExecutionId,
        t: Transition,
        at: Timestamp,
        d: Durability,
    ) -> Result<ExecutionRecord, GatewayError> {
        // Counted once per execution that becomes unknown, not per failed re-check of one
        // that already was (an outage would inflate it with every retry).
        let newly_unknown = matches!(t, Transition::Lost { .. })
            && self
                .ledger
                .get(id)
                .await?
                .is_some_and(|r| r.state() != ExecState::Unknown);
        let not_started = matches!(t, Transition::NotStarted { .. });
        let rec = self
            .settle(id, self.ledger.transition(id, t, at, d).await)
            .await?;
        if newly_unknown && rec.state() == ExecState::Unknown {
            self.metrics.unknown_outcome(&rec.tool);
        }
        // An operator reads why a call did not start in the log too, not only in its answer.
        if not_started && rec.state() == ExecState::Failed {
            tracing::warn!(
                %id,
                tool = %rec.tool,
                host = %rec.host,
                cause = rec.reason.as_deref().unwrap_or("no reason recorded"),
                "did not start"
            );
        }
        Ok(rec)
    }

    pub(super) async fn observe_with_result(
        &self,
        id: ExecutionId,
        t: Transition,
        mut result: StoredResult,
        at: Timestamp,
        d: Durability,
    ) -> Result<ExecutionRecord, GatewayError> {
        // The stored heads are masked; sizes and hashes stay those of the streams on the host.
        // A head cut by the cap may end inside a value. This process may never have seen the
        // values (a restart since the dispatch): its record's hints stand in for them.
        if !self.secrets.knows(id) {
            let hints = self.get(id).await.map(|r| r.mask).unwrap_or_default();
            self.secrets.ensure(id, hints);
        }
        for out in [&mut result.stdout, &mut result.stderr] {
            let cut = out.truncated();
            self.secrets.mask_piece(id, &mut out.head, 0, cut);
        }
        self.settle(
            id,
            self.ledger
                .transition_with_result(id, t, result, at, d)
                .await,
        )
        .await
    }

    async fn settle(
        &self,
        id: ExecutionId,
        r: Result<ExecutionRecord, LedgerError>,
    ) -> Result<ExecutionRecord, GatewayError> {
        match r {
            Err(LedgerError::Illegal { .. }) => {
                let rec = self.get(id).await?;
                if rec.lifecycle.result_observed || rec.state() == ExecState::Running {
                    Ok(rec)
                } else {
                    Err(GatewayError::Refused {
                        id,
                        why: format!(
                            "cannot record the host's observation in state {}",
                            rec.state()
                        ),
                    })
                }
            }
            other => Ok(other?),
        }
    }
}

pub(super) fn captured(f: FetchedOutput, cap: u64) -> CapturedOutput {
    let mut c = CapturedOutput::capture(&f.bytes, cap as usize);
    if f.total > f.bytes.len() as u64 {
        c.total_bytes = f.total;
        c.sha256 = f.sha256.unwrap_or_default();
    }
    c
}

/// The reason recorded when an execution ended on the host but its output did not arrive.
pub(super) const OUTPUT_NOT_FETCHED: &str =
    "it ended on the host, but its output could not be fetched";
