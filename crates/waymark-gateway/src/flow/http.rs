//! The HTTP channel's driver: send an execution's request once, record the target's answer,
//! and recover an execution whose request may have left by the tool's contract.
//!
//! An HTTP target keeps no marker Waymark can read, so what a marker proves for SSH is proved
//! here by the tool's contract: `read_only` and `idempotent` with a key re-send the same
//! execution (the same key: the target answers the first request's result), `status_check`
//! asks the configured status request, `irreversible` leaves the outcome unknown for a human.

use std::os::unix::fs::PermissionsExt;
use std::time::Duration;

use waymark_core::{
    AnsweredBy, ExecState, ExecutionId, HttpMethod, Outcome, ReplayContract, Transition,
    HTTP_CHANNEL,
};
use waymark_http::{HttpAnswer, HttpChannel, OutgoingRequest, SendError, StatusReading};
use waymark_ledger::{ExecutionRecord, StoredResult};

use crate::config::{CredentialConfig, HttpToolDef, SecretSource, StatusOutcome, TemplatePart};
use crate::host::{FetchedOutput, HostError, HostExecutor, Stream};
use crate::metrics::Channel;
use crate::tools::{Effect, HttpEffect, ResolvedCall};

use super::channel::{other_channel, Driver, Step, Watch};
use super::marker::captured;
use super::reconcile::{join_bounded, ReconcileReport, RECONCILE_PARALLEL};
use super::status_answer::{read_outcome, Reading, StatusRead};
use super::{now, CallEvents, CallOutcome, Gateway, GatewayError, FLUSHED};

/// First pause before asking again after a `409` (doubled up to a second).
const IN_FLIGHT_PAUSE: Duration = Duration::from_millis(100);

/// What a status request says about an execution.
enum Probe {
    /// The target finished it: its answer is the result, read by the tool's rule.
    Done(HttpAnswer, Reading),
    /// The target has it and is still working on it.
    InFlight,
    /// The target never received it.
    Absent,
    /// The answer proves nothing (an error, no answer).
    Unclear(String),
}

impl<E: HostExecutor> Gateway<E> {
    /// The HTTP definition of `rec`'s tool, from the configuration.
    fn http_def(&self, rec: &ExecutionRecord) -> Result<HttpToolDef, GatewayError> {
        self.config()
            .tools
            .get(&rec.tool)
            .and_then(|t| t.http.clone())
            .ok_or_else(|| GatewayError::Refused {
                id: rec.id,
                why: format!(
                    "HTTP tool {} is no longer configured, so its target cannot be asked",
                    rec.tool
                ),
            })
    }

    /// The header an HTTP credential is sent in, its value read now.
    fn credential_header(&self, name: &str) -> Result<(String, String), String> {
        let config = self.config();
        let Some(CredentialConfig::Http {
            header,
            bearer,
            source,
        }) = config.credentials.get(name)
        else {
            return Err(format!(
                "credential {name} is not an HTTP credential in the configuration"
            ));
        };
        let value = read_secret(name, source)?;
        let value = if *bearer {
            format!("Bearer {value}")
        } else {
            value
        };
        Ok((header.clone(), value))
    }

    /// Every secret value `call` sends: its secret arguments and, for an HTTP call, its
    /// credential, so that any process reading what came back masks them (the ledger keeps
    /// their hints).
    pub(super) fn values_to_mask(&self, call: &ResolvedCall) -> Vec<Vec<u8>> {
        let mut values = call.secret_values();
        if let Effect::Http(h) = &call.effect {
            values.extend(self.credential_values(&h.def));
        }
        values
    }

    /// The credential values a request of `def` sends, to mask in what its target answers.
    pub(super) fn credential_values(&self, def: &HttpToolDef) -> Vec<Vec<u8>> {
        def.credential
            .as_ref()
            .and_then(|n| match self.config().credentials.get(n) {
                Some(CredentialConfig::Http { source, .. }) => read_secret(n, source).ok(),
                _ => None,
            })
            .map(|v| vec![v.into_bytes()])
            .unwrap_or_default()
    }
}

/// The HTTP channel's driver: requests sent once through the daemon's [`HttpChannel`], and
/// recovered by the tool's contract.
pub(super) struct HttpDriver {
    channel: HttpChannel,
}

impl HttpDriver {
    pub(super) fn new(channel: HttpChannel) -> Self {
        HttpDriver { channel }
    }

    /// Sends an HTTP execution whose dispatch is already recorded (and flushed), and records
    /// what came back. `resent` says the request may have reached the target before: then a
    /// send that certainly did not leave proves nothing about the first one.
    async fn send_http<E: HostExecutor>(
        &self,
        g: &Gateway<E>,
        rec: ExecutionRecord,
        h: &HttpEffect,
        timeout: Duration,
        resent: bool,
    ) -> Result<CallOutcome, GatewayError> {
        let id = rec.id;
        let mut secrets = h.secret_values();
        secrets.extend(g.credential_values(&h.def));
        g.secrets.remember_values(id, secrets);
        let built = self.outgoing(
            g,
            &h.def,
            id,
            h.request.call.method,
            h.request.call.url.as_sent().to_string(),
            h.request.exposed_headers(id),
            h.request.exposed_body(id),
            timeout,
        );
        let req = match built {
            Ok(req) => req,
            Err(reason) => {
                let t = if resent {
                    Transition::Lost { reason }
                } else {
                    Transition::NotStarted { reason }
                };
                let rec = g.observe(id, t, now(), FLUSHED).await?;
                return g.outcome(rec, None).await;
            }
        };
        let keyed = h.def.idempotency_header.is_some();
        let deadline = tokio::time::Instant::now() + timeout;
        let mut pause = IN_FLIGHT_PAUSE;
        let channel = &self.channel;
        let dispatched_at = rec.updated_at;
        let mut first_answer = true;
        let rec = loop {
            let sent = channel.send(&req).await;
            if sent.is_ok() && std::mem::replace(&mut first_answer, false) {
                let latency = now().since(dispatched_at);
                g.metrics
                    .dispatch_answered(&rec.tool, Channel::Http, latency);
            }
            let t = match sent {
                Ok(answer) => match waymark_http::read_status(answer.status, keyed) {
                    StatusReading::Completed { is_error } => {
                        let by = if resent { AnsweredBy::Resend } else { AnsweredBy::Request };
                        let result = http_result(&answer, &format!("HTTP {}", answer.status), g.result_cap);
                        let t = answered(by, answer.status, Some(!is_error), None);
                        break g.observe_with_result(id, t, result, now(), FLUSHED).await?;
                    }
                    StatusReading::StillInFlight
                        if tokio::time::Instant::now() + pause < deadline =>
                    {
                        tokio::time::sleep(pause).await;
                        pause = (pause * 2).min(Duration::from_secs(1));
                        continue;
                    }
                    // The first request with this key is still being worked on: the execution
                    // stays dispatched, and a retry or status asks again later.
                    StatusReading::StillInFlight => break rec,
                    StatusReading::KeyReusedWithOtherPayload => Transition::NotStarted {
                        reason: format!(
                            "REFUSED BY THE TARGET (422): {} says idempotency key {id} was used before with a different payload. \
                             Waymark sends one payload per execution ID, so something else reused this key: nothing ran for this request; investigate before retrying",
                            h.def.target
                        ),
                    },
                },
                Err(SendError::NotSent(why)) if resent => Transition::Lost {
                    reason: format!("a re-send was not sent ({why}); the first send's outcome is still unknown"),
                },
                Err(SendError::NotSent(why)) => Transition::NotStarted {
                    reason: format!("not sent: {why}"),
                },
                Err(e @ SendError::Lost(_)) => Transition::Lost {
                    reason: e.to_string(),
                },
            };
            break g.observe(id, t, now(), FLUSHED).await?;
        };
        g.outcome(rec, None).await
    }

    /// Recovers an HTTP execution that may have reached its target (dispatched, running or
    /// unknown), by its contract. `call` is the caller's retry or resume; status and reconcile
    /// have none, so they can ask a status request but never re-send.
    async fn recover_http<E: HostExecutor>(
        &self,
        g: &Gateway<E>,
        rec: ExecutionRecord,
        call: Option<&HttpEffect>,
        timeout: Duration,
    ) -> Result<CallOutcome, GatewayError> {
        let def = match call {
            Some(h) => h.def.clone(),
            None => g.http_def(&rec)?,
        };
        let id = rec.id;
        if let Some(status) = &def.status {
            match self.probe(g, &def, status, id, timeout).await {
                Probe::Done(answer, reading) => {
                    let head = format!("HTTP {} (status request)", answer.status);
                    let result = http_result(&answer, &head, g.result_cap);
                    let (succeeded, reported) = match reading {
                        Reading::Succeeded(r) => (Some(true), r),
                        Reading::Failed(r) => (Some(false), r),
                        Reading::Unproven(r) => (None, r),
                    };
                    let t = answered(
                        AnsweredBy::StatusRequest,
                        answer.status,
                        succeeded,
                        Some(reported),
                    );
                    let rec = g.observe_with_result(id, t, result, now(), FLUSHED).await?;
                    return g.outcome(rec, None).await;
                }
                Probe::InFlight => {
                    let rec = match rec.state() {
                        ExecState::Running => rec,
                        _ => {
                            g.observe(id, Transition::Started { pid: None }, now(), FLUSHED)
                                .await?
                        }
                    };
                    return g.outcome(rec, None).await;
                }
                Probe::Absent => {
                    return match call {
                        // Never received: send it again under the same id and key.
                        Some(h) if rec.state() != ExecState::Running => {
                            self.resend_http(g, rec, h, timeout).await
                        }
                        // Stays as it is, never "failed": a request delayed in the network
                        // could still arrive; a retry re-sends the same id.
                        _ => {
                            let o = g.outcome(rec, None).await?;
                            Ok(CallOutcome {
                                heard: Some(format!(
                                    "Just now the status request said {} has no such operation (not received): a retry of the same call re-sends it under the same idempotency key.",
                                    def.target
                                )),
                                ..o
                            })
                        }
                    };
                }
                Probe::Unclear(why) => {
                    let o = g.outcome(rec, None).await?;
                    return Ok(CallOutcome {
                        unasked: Some(HostError::Lost(why)),
                        ..o
                    });
                }
            }
        }
        let resend = match rec.contract {
            ReplayContract::ReadOnly => true,
            ReplayContract::Idempotent => def.idempotency_header.is_some(),
            ReplayContract::StatusCheck | ReplayContract::Irreversible => false,
        };
        match call {
            Some(h) if resend && rec.state() != ExecState::Running => {
                self.resend_http(g, rec, h, timeout).await
            }
            _ if rec.state() == ExecState::Unknown => {
                let o = g.outcome(rec, None).await?;
                let heard = resend.then(|| {
                    format!(
                        "{} has no status request to ask; a retry of the same call (or `waymark exec resume`) re-sends it under the same idempotency key, and the target answers the first request's result.",
                        def.target
                    )
                });
                Ok(CallOutcome { heard, ..o })
            }
            _ => {
                let how = if resend {
                    "retry the same call (or `waymark exec resume`) to re-send it under the same idempotency key"
                } else {
                    "its contract allows no re-send: a human must review it"
                };
                let reason = format!(
                    "the request may have reached {} and no answer was recorded; {how}",
                    def.target
                );
                let rec = g
                    .observe(id, Transition::Lost { reason }, now(), FLUSHED)
                    .await?;
                g.outcome(rec, None).await
            }
        }
    }

    /// Re-sends the same execution: dispatch recorded (flushed) first, then the same key.
    async fn resend_http<E: HostExecutor>(
        &self,
        g: &Gateway<E>,
        rec: ExecutionRecord,
        h: &HttpEffect,
        timeout: Duration,
    ) -> Result<CallOutcome, GatewayError> {
        let attempt = rec.dispatch_attempts + 1;
        let rec = g
            .ledger
            .transition(rec.id, Transition::Dispatch { attempt }, now(), FLUSHED)
            .await?;
        self.send_http(g, rec, h, timeout, true).await
    }

    /// Asks the tool's status request about `id`. Its answer decides: 2xx (but 202) done,
    /// 202 still in flight, 404 or 410 never received, anything else nothing. A done answer
    /// is read by the tool's rule: a value it lists as pending is still in flight too.
    async fn probe<E: HostExecutor>(
        &self,
        g: &Gateway<E>,
        def: &HttpToolDef,
        status: &crate::config::StatusRequestDef,
        id: ExecutionId,
        timeout: Duration,
    ) -> Probe {
        let url: String = status
            .url
            .iter()
            .map(|p| match p {
                TemplatePart::Text(t) => t.clone(),
                TemplatePart::ExecutionId => id.to_string(),
                TemplatePart::Arg(_) => unreachable!("refused by the configuration"),
            })
            .collect();
        let mut def = def.clone();
        // The status request is no new effect: no idempotency key.
        def.idempotency_header = None;
        let mut req =
            match self.outgoing(g, &def, id, status.method, url, Vec::new(), None, timeout) {
                Ok(r) => r,
                Err(why) => return Probe::Unclear(why),
            };
        if let Some(StatusOutcome::CodeHeader(h)) = &status.outcome {
            req.keep_headers.push(h.clone());
        }
        // The answer may echo the credential; this process may not have sent the request itg.
        g.secrets.add_values(id, g.credential_values(&def));
        let channel = &self.channel;
        match channel.send(&req).await {
            Ok(a) if a.status == 202 => Probe::InFlight,
            Ok(a) if (200..300).contains(&a.status) => {
                match read_outcome(status.outcome.as_ref(), &a) {
                    StatusRead::Pending(said) => {
                        tracing::debug!(execution = %id, %said, "the status answer says still pending");
                        Probe::InFlight
                    }
                    StatusRead::Done(r) => Probe::Done(a, r),
                }
            }
            Ok(a) if a.status == 404 || a.status == 410 => Probe::Absent,
            Ok(a) => Probe::Unclear(format!(
                "the status request to {} answered {}",
                def.target, a.status
            )),
            Err(e) => Probe::Unclear(format!("the status request to {} failed: {e}", def.target)),
        }
    }

    /// The request as sent, with the credential's header and the idempotency key. Its error
    /// says why nothing can be sent, and never holds a secret.
    #[allow(clippy::too_many_arguments)]
    fn outgoing<E: HostExecutor>(
        &self,
        g: &Gateway<E>,
        def: &HttpToolDef,
        id: ExecutionId,
        method: HttpMethod,
        url: String,
        mut headers: Vec<(String, String)>,
        body: Option<Vec<u8>>,
        timeout: Duration,
    ) -> Result<OutgoingRequest, String> {
        if let Some(name) = &def.credential {
            headers.push(g.credential_header(name)?);
        }
        if let Some(k) = &def.idempotency_header {
            headers.push(waymark_http::idempotency_header(k, id));
        }
        Ok(OutgoingRequest {
            method,
            url,
            headers,
            body,
            timeout,
            body_cap: g.result_cap as usize,
            keep_headers: Vec::new(),
        })
    }
}

impl<E: HostExecutor> Driver<E> for HttpDriver {
    fn channel(&self) -> &'static str {
        HTTP_CHANNEL
    }

    fn send<'a>(
        &'a self,
        g: &'a Gateway<E>,
        rec: ExecutionRecord,
        call: &'a ResolvedCall,
        _events: &'a dyn CallEvents,
    ) -> Step<'a, CallOutcome> {
        Box::pin(async move {
            let Effect::Http(h) = &call.effect else {
                return Err(other_channel(&rec));
            };
            let resent = rec.dispatch_attempts > 1;
            self.send_http(g, rec, h, call.timeout, resent).await
        })
    }

    fn recover<'a>(
        &'a self,
        g: &'a Gateway<E>,
        rec: ExecutionRecord,
        call: &'a ResolvedCall,
        _events: &'a dyn CallEvents,
    ) -> Step<'a, CallOutcome> {
        Box::pin(async move {
            let Effect::Http(h) = &call.effect else {
                return Err(other_channel(&rec));
            };
            self.recover_http(g, rec, Some(h), call.timeout).await
        })
    }

    fn check<'a>(
        &'a self,
        g: &'a Gateway<E>,
        rec: ExecutionRecord,
    ) -> Step<'a, (CallOutcome, Option<HostError>)> {
        Box::pin(async move {
            // Its driver records how it ends; without one, the contract says what to ask.
            if g.inflight.lock().expect("inflight").contains_key(&rec.id) {
                return Ok((g.outcome(rec, None).await?, None));
            }
            let timeout = g.timeout_of(&rec);
            let o = self.recover_http(g, rec, None, timeout).await?;
            let unasked = o.unasked.clone();
            Ok((o, unasked))
        })
    }

    fn cancel<'a>(&'a self, _g: &'a Gateway<E>, rec: ExecutionRecord) -> Step<'a, CallOutcome> {
        Box::pin(async move {
            Err(GatewayError::Refused {
                id: rec.id,
                why: format!(
                    "it is {}: an HTTP request cannot be called back once it may have left",
                    rec.state()
                ),
            })
        })
    }

    fn read_output<'a>(
        &'a self,
        _g: &'a Gateway<E>,
        rec: ExecutionRecord,
        _stream: Stream,
        _offset: u64,
        _max: u64,
    ) -> Step<'a, (Vec<u8>, u64)> {
        Box::pin(async move {
            Err(GatewayError::Refused {
                id: rec.id,
                why: "an HTTP answer is kept in the ledger only up to its cap (its full size and SHA-256 are in the result); there is no host to read the rest from".into(),
            })
        })
    }

    fn watch_output<'a>(
        &'a self,
        _g: &'a Gateway<E>,
        _rec: &ExecutionRecord,
        _events: &'a dyn CallEvents,
    ) -> Result<Option<Watch<'a>>, GatewayError> {
        // An answer comes whole: nothing to tell while the request is out.
        Ok(None)
    }

    fn reconcile<'a>(
        &'a self,
        g: &'a Gateway<E>,
        recs: Vec<ExecutionRecord>,
        report: &'a mut ReconcileReport,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send + 'a>> {
        Box::pin(async move {
            // A target keeps no marker: each is recovered by its contract (a status request
            // where configured), a few at a time.
            let recovered = join_bounded(recs, RECONCILE_PARALLEL, |rec| async move {
                let (id, before) = (rec.id, rec.state());
                let timeout = g.timeout_of(&rec);
                let moved = match self.recover_http(g, rec, None, timeout).await {
                    Ok(o) => Ok(o.record.state() != before),
                    Err(e) => Err(e),
                };
                (id, moved)
            })
            .await;
            for (id, moved) in recovered {
                match moved {
                    Ok(true) => report.moved += 1,
                    Ok(false) => {}
                    Err(e @ GatewayError::Ledger(_)) => report.write_refused(id, &e),
                    Err(e) => {
                        tracing::warn!(error = %e, "reconcile: cannot recover an HTTP execution");
                        report.unreachable += 1;
                    }
                }
            }
        })
    }
}

/// Reads a credential's value; the error names where it looked, never a value.
fn read_secret(name: &str, source: &SecretSource) -> Result<String, String> {
    let value = match source {
        SecretSource::Env(var) => std::env::var(var).map_err(|_| {
            format!("credential {name}: environment variable {var} is not set in the daemon's environment")
        })?,
        SecretSource::File(path) => {
            let meta = std::fs::metadata(path).map_err(|e| {
                format!("credential {name}: cannot read {}: {e}", path.display())
            })?;
            if meta.permissions().mode() & 0o077 != 0 {
                return Err(format!(
                    "credential {name}: {} is readable by others (mode {:o}); run `chmod 600 {}`",
                    path.display(),
                    meta.permissions().mode() & 0o777,
                    path.display()
                ));
            }
            std::fs::read_to_string(path).map_err(|e| {
                format!("credential {name}: cannot read {}: {e}", path.display())
            })?
        }
    };
    let value = value.trim_end_matches(['\r', '\n']).to_string();
    if value.is_empty() || value.contains(['\r', '\n']) {
        return Err(format!(
            "credential {name}: the value is empty or spans lines"
        ));
    }
    Ok(value)
}

/// How a completed HTTP execution is recorded: the answer that settled it, and whether the
/// operation succeeded as far as that answer proves.
fn answered(
    by: AnsweredBy,
    status: u16,
    succeeded: Option<bool>,
    reported: Option<String>,
) -> Transition {
    Transition::Finished {
        outcome: Outcome::Answered {
            by,
            status,
            succeeded,
            reported,
        },
    }
}

/// The stored result of an answer: the body as stdout (capped, with its full size and
/// SHA-256), and the status line and kept headers as stderr (`HTTP 201` then `name: value`
/// lines), as `curl -i` would show them.
fn http_result(a: &HttpAnswer, status_line: &str, cap: u64) -> StoredResult {
    let mut head = format!("{status_line}\n");
    for (k, v) in &a.headers {
        head.push_str(&format!("{k}: {v}\n"));
    }
    StoredResult {
        stdout: captured(
            FetchedOutput {
                bytes: a.body.clone(),
                total: a.total,
                sha256: Some(a.sha256.clone()),
            },
            cap,
        ),
        stderr: captured(
            FetchedOutput {
                bytes: head.into_bytes(),
                total: 0,
                sha256: None,
            },
            cap,
        ),
    }
}

/// The status code an HTTP execution's stored result records (`HTTP 201` on its first line).
pub fn status_code(result: &StoredResult) -> Option<u16> {
    let head = std::str::from_utf8(&result.stderr.head).ok()?;
    head.strip_prefix("HTTP ")?.get(..3)?.parse().ok()
}
