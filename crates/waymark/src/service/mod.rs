//! Carries out control requests against the gateway, for the daemon's clients: over the
//! socket and, for MCP over HTTP, in process. One runner ([`Service::run`]) for both, so both
//! behave alike and both mark delivery after the write.
//!
//! By concern: [`peer`] (who is calling), this module (the runner and the dispatch of a
//! request), [`calls`] (calls and results), [`fanout`] (one call on many hosts), [`operator`] (cancel, review, approvals, lock),
//! [`listing`], [`audit`] (the chain and retention), [`explain`], [`catalog`], and [`render`]
//! (the protocol's views of ledger records, exit codes, times, status text).

mod audit;
mod calls;
mod catalog;
mod explain;
mod fanout;
mod listing;
mod operator;
mod peer;
mod render;

use std::sync::Arc;

use serde_json::{json, Value};
use waymark_core::{Actor, Delivery, ExecutionId, IntentScope, Timestamp};
use waymark_gateway::flow::{now, Gateway, GatewayError};
use waymark_gateway::host::HostExecutor;
use waymark_gateway::tools::{self, CallContext, ResolvedCall};
use waymark_ledger::ListQuery;

use crate::exit;
use crate::protocol::{Answer, Event, Pong, Request};

pub use audit::audit_verify;
pub use explain::explain;
pub use peer::Peer;
pub use render::status_text;

/// A final frame as the daemon builds it: a typed answer, or an error.
pub type Frame = crate::protocol::Frame<Answer>;

pub struct Service<E: HostExecutor> {
    pub gateway: Arc<Gateway<E>>,
}

/// One client connection: its peer and, once it made a call, its agent run.
pub struct Session {
    pub peer: Peer,
    pub transport: String,
    pub run: Option<String>,
}

fn gw_err(e: GatewayError) -> Frame {
    let code = match &e {
        GatewayError::NotFound(_) | GatewayError::Refused { .. } => exit::USAGE,
        _ => exit::ERROR,
    };
    Frame::Error {
        message: e.to_string(),
        exit: code,
    }
}

/// A request refused as malformed (bad arguments or a call that cannot be resolved).
fn usage(message: String) -> Frame {
    Frame::Error {
        message,
        exit: exit::USAGE,
    }
}

/// Who calls, in which scope (an explicit key, or the tool's window), through what.
fn call_context(session: &Session, key: Option<&str>) -> CallContext {
    CallContext {
        actor: session.peer.actor(),
        scope: key.map_or(IntentScope::ToolWindow, |k| IntentScope::Key(k.to_string())),
        delivery: Delivery {
            transport: Some(session.transport.clone()),
            ..Default::default()
        },
    }
}

impl<E: HostExecutor> Service<E> {
    fn resolve(
        &self,
        session: &Session,
        tool: Option<&str>,
        args: &serde_json::Map<String, Value>,
        host: Option<&str>,
        raw: Option<&[String]>,
        key: Option<&str>,
    ) -> Result<ResolvedCall, String> {
        let ctx = call_context(session, key);
        let cfg = self.gateway.config();
        let usage = |e: tools::CallError| e.to_string();
        match (tool, raw) {
            (Some(t), None) => {
                let mut args = args.clone();
                if let Some(h) = host {
                    args.insert("host".into(), json!(h));
                }
                tools::resolve(cfg, t, &args, ctx).map_err(usage)
            }
            (None, Some(argv)) => {
                let h = host.ok_or("a raw command needs --host")?;
                if !cfg.hosts.contains_key(h) {
                    return Err(format!(
                        "unknown host {h:?}; configured: {}",
                        cfg.hosts.keys().cloned().collect::<Vec<_>>().join(", ")
                    ));
                }
                tools::resolve_raw(cfg, h, argv, ctx).map_err(usage)
            }
            _ => Err("give a tool name, or --host H -- COMMAND...".into()),
        }
    }

    async fn ensure_run(&self, session: &mut Session) -> Option<String> {
        if session.run.is_none() {
            let transport = format!("{} {}", session.transport, session.peer.describe());
            if let Ok(run) = self
                .gateway
                .ledger()
                .start_run(
                    session.peer.actor(),
                    &transport,
                    now(),
                    waymark_ledger::Durability::Buffered,
                )
                .await
            {
                session.run = Some(run.id);
            }
        }
        session.run.clone()
    }

    /// Carries out one request for any transport: the one request runner, used by the socket
    /// server and the in-process HTTP backend. `event` gets the request's events as they
    /// happen; `write` writes the final frame and says whether the whole answer reached the
    /// caller. Only then is a result the answer carries marked delivered, and only when the
    /// client does not mark it itself (`defer_delivery`). The session's agent run ends with
    /// the request.
    pub async fn run<W: std::future::Future<Output = bool>>(
        &self,
        req: Request,
        mut session: Session,
        event: impl FnMut(Event) + Send,
        write: impl FnOnce(Frame) -> W,
    ) {
        let by_transport = req.delivered_by_transport();
        let done = self.handle(req, &mut session, event).await;
        let carried = done.results_of();
        if write(done).await && by_transport {
            self.answer_written(carried).await;
        }
        self.end_session(&session).await;
    }

    /// The whole answer carrying the `carried` executions' results was written to the caller's
    /// transport: the one place that marks a result delivered for a transport.
    async fn answer_written(&self, carried: Vec<ExecutionId>) {
        for id in carried {
            if let Err(e) = self.gateway.delivered(id).await {
                tracing::warn!(%id, error = %e, "cannot record the delivery of a written result");
            }
        }
    }

    /// Ends the session's agent run, if it started one.
    async fn end_session(&self, session: &Session) {
        if let Some(r) = &session.run {
            let _ = self
                .gateway
                .ledger()
                .end_run(r, now(), waymark_ledger::Durability::Buffered)
                .await;
        }
    }

    /// Handles one request; `event` receives its events; the final frame is returned.
    async fn handle(
        &self,
        req: Request,
        session: &mut Session,
        event: impl FnMut(Event) + Send,
    ) -> Frame {
        let g = &self.gateway;
        let by = format!("uid:{}", session.peer.uid);
        match req {
            Request::Ping => Frame::Done {
                data: Answer::Pong(Pong {
                    pong: true,
                    pid: std::process::id(),
                }),
                text: "daemon is running".into(),
                exit: 0,
            },
            Request::Call {
                tool,
                args,
                host,
                raw,
                key,
                transport,
                defer_delivery: _,
            } => {
                if let Some(t) = transport {
                    session.transport = t;
                }
                let call = self.resolve(
                    session,
                    tool.as_deref(),
                    &args,
                    host.as_deref(),
                    raw.as_deref(),
                    key.as_deref(),
                );
                match call {
                    Ok(call) => self.call(call, session, event).await,
                    Err(message) => usage(message),
                }
            }
            Request::FanOut {
                tool,
                args,
                hosts,
                key,
                transport,
                defer_delivery: _,
            } => {
                if let Some(t) = transport {
                    session.transport = t;
                }
                let ctx = call_context(session, key.as_deref());
                match tools::resolve_fan_out(g.config(), &tool, &args, hosts.as_deref(), ctx) {
                    Ok(calls) => self.fan_out(tool, calls, session, event).await,
                    Err(e) => usage(e.to_string()),
                }
            }
            Request::Delivered { id } => self.delivered(id).await,
            Request::ListTools => Frame::Done {
                data: Answer::Catalog(catalog::tool_catalog(g.config())),
                text: String::new(),
                exit: 0,
            },
            Request::Status { id, .. } => self.status(id).await,
            Request::Result { id, .. } => self.result(id).await,
            Request::Output {
                id,
                stream,
                offset,
                max,
            } => self.output(id, stream, offset, max).await,
            Request::List {
                state,
                host,
                tool,
                actor,
                since_ms,
                limit,
                after,
            } => {
                self.list(&ListQuery {
                    state,
                    host,
                    tool,
                    actor: actor.map(Actor),
                    since: since_ms.map(Timestamp::from_millis),
                    limit: limit.unwrap_or(50),
                    after,
                    ..Default::default()
                })
                .await
            }
            Request::Resume {
                id,
                tool,
                args,
                raw,
            } => self.resume(session, id, tool, args, raw).await,
            Request::Cancel { id } => self.cancel(id, &by).await,
            Request::Review { id, ran, note } => self.review(id, ran, &by, &note).await,
            Request::Explain { id } => match explain::explain(g.ledger().as_ref(), id).await {
                Ok((text, data)) => Frame::Done {
                    data: Answer::Explain(data),
                    text,
                    exit: 0,
                },
                Err(m) => usage(m),
            },
            Request::Approvals => self.approvals().await,
            Request::Approve { id } => self.approve(id, &by).await,
            Request::Deny { id, reason } => self.deny(id, &by, &reason).await,
            Request::Lock { reason } => self.lock(true, reason.as_deref(), &by).await,
            Request::Unlock => self.lock(false, None, &by).await,
            Request::Runs { limit } => self.runs(limit).await,
            Request::AuditVerify { exported_head } => {
                audit_verify(g.ledger().as_ref(), exported_head.as_deref()).await
            }
            Request::AuditHead => self.audit_head().await,
            Request::Gc {
                older_than_ms,
                dry_run,
            } => self.gc(older_than_ms, dry_run).await,
        }
    }
}
