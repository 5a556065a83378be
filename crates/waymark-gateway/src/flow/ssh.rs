//! The SSH channel's driver: a command sent through the host's wrapper, whose marker proves
//! whether it started, runs, or ended, and keeps its output by offset.

use std::collections::BTreeMap;
use std::time::Duration;

use waymark_core::{ExecState, ExecutionId, Transition, SSH_CHANNEL};
use waymark_ledger::{ExecutionRecord, StoredResult};

use crate::host::{
    Arg, DispatchError, DispatchOutcome, EnvVar, HostError, HostExecutor, MarkerView, Stream,
};
use crate::metrics::Channel;
use crate::tools::{Effect, ResolvedCall};

use super::channel::{other_channel, Driver, Step, Watch};
use super::marker::captured;
use super::reconcile::{join_bounded, ReconcileReport, RECONCILE_BATCH, RECONCILE_PARALLEL};
use super::{now, CallEvents, CallOutcome, Gateway, GatewayError, FLUSHED};

/// How long past the tool's timeout a call waits on a command its marker shows running.
const WAIT_MARGIN: Duration = Duration::from_secs(5);

/// The SSH channel: commands on hosts, through the gateway's [`HostExecutor`].
pub(super) struct SshDriver;

impl<E: HostExecutor> Driver<E> for SshDriver {
    fn channel(&self) -> &'static str {
        SSH_CHANNEL
    }

    fn send<'a>(
        &'a self,
        g: &'a Gateway<E>,
        rec: ExecutionRecord,
        call: &'a ResolvedCall,
        events: &'a dyn CallEvents,
    ) -> Step<'a, CallOutcome> {
        Box::pin(async move {
            let Effect::Ssh { host, request } = &call.effect else {
                return Err(other_channel(&rec));
            };
            let id = rec.id;
            g.secrets.remember(id, request);
            let send = g.exec.dispatch(
                host,
                id,
                request
                    .argv
                    .iter()
                    .map(|word| Arg {
                        value: word.expose(id),
                        secret: word.has_secret(),
                    })
                    .collect(),
                request.cwd.clone(),
                request
                    .env
                    .iter()
                    .map(|(name, word)| EnvVar {
                        name: name.clone(),
                        value: word.expose(id),
                        secret: word.has_secret(),
                    })
                    .collect(),
                call.timeout,
            );
            let sent = if events.wants_output() {
                // Both futures are polled together: the poller must never keep the dispatch
                // from making progress (it may hold the connection's install lock).
                tokio::select! {
                    r = send => r,
                    never = g.stream_output(host, id, events) => match never {},
                }
            } else {
                send.await
            };
            if sent.is_ok() {
                // The record's last change is its dispatch: the clock starts before that flush.
                let latency = now().since(rec.updated_at);
                g.metrics
                    .dispatch_answered(&rec.tool, Channel::Ssh, latency);
            }
            let rec = match sent {
                Ok(DispatchOutcome::Finished {
                    outcome,
                    stdout,
                    stderr,
                }) => {
                    let result = StoredResult {
                        stdout: captured(stdout, g.result_cap),
                        stderr: captured(stderr, g.result_cap),
                    };
                    g.observe_with_result(
                        id,
                        Transition::Finished { outcome },
                        result,
                        now(),
                        FLUSHED,
                    )
                    .await?
                }
                Ok(DispatchOutcome::Observed(view)) => {
                    let rec = g.apply_marker(rec, view, host).await?;
                    g.wait_on_host(rec, host, call.timeout + WAIT_MARGIN)
                        .await?
                }
                Err(DispatchError::NotSent(reason)) => {
                    let reason = format!("not sent: {reason}");
                    g.observe(id, Transition::NotStarted { reason }, now(), FLUSHED)
                        .await?
                }
                Err(DispatchError::Lost(reason)) => {
                    let reason = reason.to_string();
                    g.observe(id, Transition::Lost { reason }, now(), FLUSHED)
                        .await?
                }
            };
            g.outcome(rec, None).await
        })
    }

    fn recover<'a>(
        &'a self,
        g: &'a Gateway<E>,
        rec: ExecutionRecord,
        call: &'a ResolvedCall,
        events: &'a dyn CallEvents,
    ) -> Step<'a, CallOutcome> {
        Box::pin(async move {
            let host = g.host_of(&rec)?;
            let view = match g.exec.status(&host, rec.id).await {
                Ok(v) => v,
                Err(e) => {
                    let o = g.outcome(rec, None).await?;
                    return Ok(CallOutcome {
                        unasked: Some(e),
                        ..o
                    });
                }
            };
            if view == MarkerView::Absent && rec.state() != ExecState::Running {
                // Never started: send it again under the same id; the marker makes that safe.
                return g.dispatch_inner(rec, call, events).await;
            }
            let rec = g.apply_marker(rec, view, &host).await?;
            let rec = g
                .wait_on_host(rec, &host, call.timeout + WAIT_MARGIN)
                .await?;
            g.outcome(rec, None).await
        })
    }

    fn check<'a>(
        &'a self,
        g: &'a Gateway<E>,
        rec: ExecutionRecord,
    ) -> Step<'a, (CallOutcome, Option<HostError>)> {
        Box::pin(async move {
            let id = rec.id;
            let host = g.host_of(&rec)?;
            if g.inflight.lock().expect("inflight").contains_key(&id) {
                // Its driver records how it ends; a status check records only that it started,
                // so a command already running reads as running, not "not yet seen to start".
                if rec.state() == ExecState::Dispatched {
                    if let Ok(MarkerView::Starting | MarkerView::Running { .. }) =
                        g.exec.status(&host, id).await
                    {
                        let rec = g
                            .observe(id, Transition::Started { pid: None }, now(), FLUSHED)
                            .await?;
                        return Ok((g.outcome(rec, None).await?, None));
                    }
                }
                return Ok((g.outcome(rec, None).await?, None));
            }
            match g.exec.status(&host, id).await {
                Ok(view) => {
                    let rec = g.apply_marker(rec, view, &host).await?;
                    Ok((g.outcome(rec, None).await?, None))
                }
                Err(e) => Ok((g.outcome(rec, None).await?, Some(e))),
            }
        })
    }

    fn cancel<'a>(&'a self, g: &'a Gateway<E>, rec: ExecutionRecord) -> Step<'a, CallOutcome> {
        Box::pin(async move {
            let id = rec.id;
            let host = g.host_of(&rec)?;
            let view = g
                .exec
                .cancel(&host, id)
                .await
                .map_err(|e| GatewayError::Refused {
                    id,
                    why: e.to_string(),
                })?;
            let rec = if g.ledger.drives(&rec) {
                g.apply_marker(rec, view, &host).await?
            } else {
                // Another daemon sharing the ledger drives it: that one records how the
                // cancelled command ended (or, dead, its successor through the marker), unless
                // nobody drives it: then this one adopts it and reads the marker.
                let rec = g.follow(rec, Duration::from_secs(15)).await?;
                if !g.ledger.drives(&rec) {
                    return g.outcome(rec, None).await;
                }
                rec
            };
            let waited = g.wait_on_host(rec, &host, Duration::from_secs(15)).await;
            // Adopted here, or held by no call: the next call on any daemon drives it.
            g.let_go_of_idle(&[id]).await;
            g.outcome(waited?, None).await
        })
    }

    fn read_output<'a>(
        &'a self,
        g: &'a Gateway<E>,
        rec: ExecutionRecord,
        stream: Stream,
        offset: u64,
        max: u64,
    ) -> Step<'a, (Vec<u8>, u64)> {
        Box::pin(async move {
            let id = rec.id;
            let host = g.host_of(&rec)?;
            g.secrets.ensure(id, rec.mask.clone());
            // Read again the bytes before the offset that a value cut at it may have begun in,
            // and as many past the end, so that a value cut at the end is seen whole (see
            // `mask`).
            let around = g.secrets.look_behind(id);
            let behind = offset.min(around);
            let (mut bytes, size) = g
                .exec
                .read_output(&host, id, stream, offset - behind, max + behind + around)
                .await
                .map_err(|why| GatewayError::Refused {
                    id,
                    why: format!("cannot read its output from host {}: {why}", host.name),
                })?;
            // The end may be cut unless it is the end of a stream that ended.
            let read = bytes.len().saturating_sub(behind as usize) as u64;
            let cut = !rec.lifecycle.result_observed || offset + read < size;
            g.secrets.mask_piece(id, &mut bytes, behind as usize, cut);
            bytes.truncate(max as usize);
            Ok((bytes, size))
        })
    }

    fn watch_output<'a>(
        &'a self,
        g: &'a Gateway<E>,
        rec: &ExecutionRecord,
        events: &'a dyn CallEvents,
    ) -> Result<Option<Watch<'a>>, GatewayError> {
        let host = g.host_of(rec)?;
        let id = rec.id;
        // Its driver holds the secret values; the record's hints mask them here.
        g.secrets.ensure(id, rec.mask.clone());
        Ok(Some(Box::pin(async move {
            g.stream_output(&host, id, events).await
        })))
    }

    fn reconcile<'a>(
        &'a self,
        g: &'a Gateway<E>,
        recs: Vec<ExecutionRecord>,
        report: &'a mut ReconcileReport,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send + 'a>> {
        Box::pin(async move {
            // Markers are read in batches of ids per wrapper call (one round trip each), a few
            // batches at once over the pooled connections, every host at the same time.
            let mut by_host: BTreeMap<String, Vec<ExecutionRecord>> = BTreeMap::new();
            for rec in recs {
                by_host.entry(rec.host.clone()).or_default().push(rec);
            }
            let mut batches = Vec::new();
            for (name, recs) in by_host {
                let Some(host) = g.config().hosts.get(&name).cloned() else {
                    report.unreachable += recs.len() as u64;
                    continue;
                };
                for chunk in recs.chunks(RECONCILE_BATCH) {
                    batches.push((host.clone(), chunk.to_vec()));
                }
            }
            let looked = join_bounded(batches, RECONCILE_PARALLEL, |(host, recs)| async move {
                let ids: Vec<ExecutionId> = recs.iter().map(|r| r.id).collect();
                let views = g.exec.status_many(&host, &ids).await;
                (host, recs, views)
            })
            .await;
            let mut seen = Vec::new();
            for (host, recs, views) in looked {
                match views {
                    Ok(views) if views.len() == recs.len() => {
                        seen.extend(
                            recs.into_iter()
                                .zip(views)
                                .map(|(r, v)| (host.clone(), r, v)),
                        );
                    }
                    Ok(views) => {
                        tracing::warn!(host = %host.name, asked = recs.len(), got = views.len(), "reconcile: the host answered for a different number of executions");
                        report.unreachable += recs.len() as u64;
                    }
                    Err(e) => {
                        tracing::warn!(host = %host.name, error = %e, "reconcile: cannot read markers");
                        report.unreachable += recs.len() as u64;
                    }
                }
            }
            // What they show is recorded a few executions at a time (a finished one also
            // fetches its output).
            let applied = join_bounded(seen, RECONCILE_PARALLEL, |(host, rec, view)| async move {
                let (id, before) = (rec.id, rec.state());
                let moved = g
                    .apply_marker(rec, view, &host)
                    .await
                    .map(|after| after.state() != before);
                (id, moved)
            })
            .await;
            // One execution's write refused or failed costs that execution only: the others
            // are recorded all the same, and the report counts it.
            for (id, moved) in applied {
                match moved {
                    Ok(true) => report.moved += 1,
                    Ok(false) => {}
                    Err(e) => report.write_refused(id, &e),
                }
            }
        })
    }
}
