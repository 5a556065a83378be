//! Carries out control requests against the gateway, for the daemon's clients: over the
//! socket and, for MCP over HTTP, in process. One runner ([`Service::run`]) for both, so both
//! behave alike and both mark delivery after the write.
//!
//! By concern: [`peer`] (who is calling), [`rights`] (what the caller may do), [`legacy`]
//! (executions recorded under the actor's old form), this module (the runner and the dispatch
//! of a request), [`calls`] (calls and results), [`fanout`] (one call on many hosts), [`operator`] (cancel, review, approvals, lock),
//! [`listing`], [`audit`] (the chain and retention), [`explain`], [`catalog`], and [`render`]
//! (the protocol's views of ledger records, exit codes, times, status text).

mod audit;
mod calls;
mod catalog;
mod explain;
mod fanout;
mod legacy;
pub mod lifecycle;
mod listing;
mod operator;
mod peer;
pub(crate) mod render;
mod rights;

use std::sync::Arc;

use serde_json::{json, Value};
use waymark_core::{Actor, Delivery, ExecutionId, IntentScope, Timestamp};
use waymark_gateway::flow::{now, Gateway, GatewayError};
use waymark_gateway::host::HostExecutor;
use waymark_gateway::tools::{self, CallContext, ResolvedCall};
use waymark_ledger::ListQuery;

use crate::exit;
use crate::protocol::{Answer, Event, Pong, Request};

pub use audit::{audit_events, audit_verify, ledger_backup, EVENTS_PAGE};
pub use explain::explain;
pub use legacy::LegacyIntents;
pub use peer::{Caller, Peer};
pub use render::status_text;

/// A final frame as the daemon builds it: a typed answer, or an error.
pub type Frame = crate::protocol::Frame<Answer>;

pub struct Service<E: HostExecutor> {
    pub gateway: Arc<Gateway<E>>,
    /// Executions recorded under the actor's old form that a retry may still attach to.
    pub legacy: LegacyIntents,
    /// The daemon's own state: its configuration, listeners, requests and stop switch.
    pub life: Arc<lifecycle::Lifecycle>,
}

/// What a caller asked for, before it is resolved against a configuration.
#[derive(Clone, Copy)]
struct Asked<'a> {
    tool: Option<&'a str>,
    args: &'a serde_json::Map<String, Value>,
    host: Option<&'a str>,
    raw: Option<&'a [String]>,
    key: Option<&'a str>,
}

/// One client connection: who it is (decided when it was taken) and, once it made a call, its
/// agent run.
pub struct Session {
    pub caller: Caller,
    /// What the client says it is (`cli`, `mcp-stdio`): recorded as its claim, never trusted.
    pub client_says: Option<String>,
    pub run: Option<String>,
    /// How long a read waits for a host before it answers with what the ledger knows, as the
    /// client asked (`Envelope::deadline_ms`), else [`crate::protocol::READ_DEADLINE`].
    pub read_deadline: std::time::Duration,
}

impl Session {
    pub fn new(caller: Caller) -> Session {
        Session {
            caller,
            client_says: None,
            run: None,
            read_deadline: crate::protocol::READ_DEADLINE,
        }
    }
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
        actor: session.caller.actor.clone(),
        scope: key.map_or(IntentScope::ToolWindow, |k| IntentScope::Key(k.to_string())),
        delivery: Delivery {
            transport: Some(session.caller.transport.to_string()),
            ..Default::default()
        },
    }
}

impl<E: HostExecutor> Service<E> {
    /// Resolves a call as its caller may make it: refused (and audited) outside the caller's
    /// rights, its approval raised to the caller's floor, and run as the old form of the
    /// actor when it is the retry of an execution recorded so ([`legacy`]).
    async fn resolve_admitted(
        &self,
        session: &Session,
        tool: Option<&str>,
        args: &serde_json::Map<String, Value>,
        host: Option<&str>,
        raw: Option<&[String]>,
        key: Option<&str>,
    ) -> Result<ResolvedCall, Box<Frame>> {
        let asked = Asked {
            tool,
            args,
            host,
            raw,
            key,
        };
        let resolved = self.resolve_in(&self.gateway.config(), session, &asked);
        // Refused by the tool alone, the refusal records the call's fingerprint when its
        // arguments resolve, and says nothing of what is wrong with them when they do not.
        self.may_call(
            session,
            tool.unwrap_or(tools::RAW_TOOL),
            resolved.as_ref().ok(),
        )
        .await?;
        let mut call = resolved.map_err(|m| Box::new(usage(m)))?;
        self.admit_call(session, &mut call).await?;
        self.as_legacy(&mut call);
        let replaced = self.life.replaced_configs();
        if !replaced.is_empty() {
            self.as_before_reload(session, &asked, &replaced, &mut call)
                .await;
        }
        Ok(call)
    }

    /// The retry of a call accepted before a reload resolves, under the configuration it was
    /// accepted with, to the execution it retries: when the call as it resolves now matches no
    /// execution, but as a replaced configuration resolved it (another argv, another contract)
    /// it attaches to one, it is that call. A dropped connection never becomes a second run
    /// because the daemon reloaded meanwhile.
    async fn as_before_reload(
        &self,
        session: &Session,
        asked: &Asked<'_>,
        replaced: &[Arc<waymark_gateway::config::Config>],
        call: &mut ResolvedCall,
    ) {
        let ledger = self.gateway.ledger();
        let key = ledger.fingerprint_key();
        let now_fp = call.fingerprint(&key);
        if !ledger
            .by_fingerprint(&now_fp)
            .await
            .unwrap_or_default()
            .is_empty()
        {
            return;
        }
        for cfg in replaced {
            let Ok(mut old) = self.resolve_in(cfg, session, asked) else {
                continue;
            };
            if self.admit_call(session, &mut old).await.is_err() {
                continue;
            }
            self.as_legacy(&mut old);
            let fp = old.fingerprint(&key);
            if fp == now_fp {
                continue;
            }
            let priors: Vec<_> = ledger
                .by_fingerprint(&fp)
                .await
                .unwrap_or_default()
                .iter()
                .map(waymark_ledger::prior_of)
                .collect();
            let incoming = waymark_core::IncomingCall {
                actor: old.actor().clone(),
                scope: old.scope().clone(),
                policy: old.policy,
                now: now(),
            };
            if matches!(
                waymark_core::decide(&priors, &incoming),
                waymark_core::MatchDecision::Attach { .. }
            ) {
                *call = old;
                return;
            }
        }
    }

    /// Runs `call` as the old form of its actor when that is how the execution it retries was
    /// recorded.
    fn as_legacy(&self, call: &mut ResolvedCall) {
        if self.legacy.is_empty() {
            return;
        }
        let fp = call.fingerprint(&self.gateway.ledger().fingerprint_key());
        if let Some(old) = self.legacy.old_actor(&fp) {
            let scope = call.scope().clone();
            call.set_origin(old.clone(), scope);
        }
    }

    fn resolve(
        &self,
        session: &Session,
        tool: Option<&str>,
        args: &serde_json::Map<String, Value>,
        host: Option<&str>,
        raw: Option<&[String]>,
        key: Option<&str>,
    ) -> Result<ResolvedCall, String> {
        let asked = Asked {
            tool,
            args,
            host,
            raw,
            key,
        };
        self.resolve_in(&self.gateway.config(), session, &asked)
    }

    /// Resolves what the caller asked against `cfg`.
    fn resolve_in(
        &self,
        cfg: &waymark_gateway::config::Config,
        session: &Session,
        asked: &Asked<'_>,
    ) -> Result<ResolvedCall, String> {
        let Asked {
            tool,
            args,
            host,
            raw,
            key,
        } = *asked;
        let ctx = call_context(session, key);
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
            let claim = session
                .client_says
                .as_ref()
                .map_or(String::new(), |c| format!(" (client says {c:?})"));
            let transport = format!(
                "{}{claim}; {}",
                session.caller.transport, session.caller.detail
            );
            if let Ok(run) = self
                .gateway
                .ledger()
                .start_run(
                    session.caller.actor.clone(),
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
        let _answering = lifecycle::Answering::new(&self.life.requests);
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

    /// Handles one request as its caller may make it; `event` receives its events; the final
    /// frame is returned.
    async fn handle(
        &self,
        req: Request,
        session: &mut Session,
        event: impl FnMut(Event) + Send,
    ) -> Frame {
        match self.gate(&req, session).await {
            Ok(()) => self.dispatch(req, session, event).await,
            Err(refused) => *refused,
        }
    }

    /// What a request needs of its caller beyond a call's own rights: an execution of its
    /// own (or operator rights), or operator rights.
    async fn gate(&self, req: &Request, session: &Session) -> Result<(), Box<Frame>> {
        match req {
            Request::Delivered { id }
            | Request::Status { id, .. }
            | Request::Result { id, .. }
            | Request::Output { id, .. }
            | Request::Resume { id, .. }
            | Request::Cancel { id }
            | Request::Explain { id } => self.may_see(session, *id).await,
            Request::Approve { id } | Request::Deny { id, .. } => {
                self.may_answer(session, *id).await
            }
            Request::Review { .. } => Self::operator_only(session, "reviewing an execution"),
            Request::Lock { .. } | Request::Unlock => {
                Self::operator_only(session, "locking and unlocking")
            }
            Request::AdoptHost { .. } => Self::operator_only(session, "adopting a host"),
            Request::LedgerBackup { .. } => Self::operator_only(session, "backing up the ledger"),
            Request::AuditVerify { .. }
            | Request::AuditHead
            | Request::AuditRefused { .. }
            | Request::AuditEvents { .. } => Self::operator_only(session, "the audit chain"),
            Request::Gc { .. } => Self::operator_only(session, "retention (gc)"),
            Request::DaemonStatus | Request::DaemonStop { .. } | Request::DaemonReload => {
                Self::operator_only(session, "the daemon itself")
            }
            Request::Ping
            | Request::WhoAmI
            | Request::ListTools
            | Request::Call { .. }
            | Request::FanOut { .. }
            | Request::List { .. }
            | Request::Approvals
            | Request::Runs { .. } => Ok(()),
        }
    }

    async fn dispatch(
        &self,
        req: Request,
        session: &mut Session,
        event: impl FnMut(Event) + Send,
    ) -> Frame {
        let g = &self.gateway;
        let by = session.caller.actor.0.clone();
        // What only an operator sees whole; another caller sees its own.
        let own = (!session.caller.operator()).then(|| session.caller.actor.clone());
        match req {
            Request::Ping => Frame::Done {
                data: Answer::Pong(Pong {
                    pong: true,
                    pid: std::process::id(),
                }),
                text: "daemon is running".into(),
                exit: 0,
            },
            Request::WhoAmI => self.who_am_i(session),
            Request::DaemonStatus => self.daemon_status().await,
            Request::DaemonStop { grace_ms } => self.daemon_stop(&by, grace_ms).await,
            Request::DaemonReload => self.daemon_reload(&by).await,
            Request::Call {
                tool,
                args,
                host,
                raw,
                key,
                transport,
                defer_delivery: _,
            } => {
                session.client_says = transport;
                let call = self
                    .resolve_admitted(
                        session,
                        tool.as_deref(),
                        &args,
                        host.as_deref(),
                        raw.as_deref(),
                        key.as_deref(),
                    )
                    .await;
                match call {
                    Ok(call) => self.call(call, session, event).await,
                    Err(refused) => *refused,
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
                session.client_says = transport;
                if let Err(refused) = self.may_call(session, &tool, None).await {
                    return *refused;
                }
                let ctx = call_context(session, key.as_deref());
                match tools::resolve_fan_out(&g.config(), &tool, &args, hosts.as_deref(), ctx) {
                    Ok(mut calls) => {
                        for call in &mut calls {
                            if let Err(refused) = self.admit_call(session, call).await {
                                return *refused;
                            }
                            self.as_legacy(call);
                        }
                        self.fan_out(tool, calls, session, event).await
                    }
                    Err(e) => usage(e.to_string()),
                }
            }
            Request::Delivered { id } => self.delivered(id).await,
            Request::ListTools => Frame::Done {
                data: Answer::Catalog(catalog::tool_catalog(
                    &g.config(),
                    session.caller.rights.as_deref(),
                )),
                text: String::new(),
                exit: 0,
            },
            Request::Status { id, .. } => self.status(id, session.read_deadline).await,
            Request::Result { id, .. } => self.result(id, session.read_deadline).await,
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
                mine,
            } => {
                let asked = actor.map(Actor);
                let me = mine.then(|| session.caller.actor.clone());
                // A caller that is no operator sees its own executions only.
                let actor = match (own, me.or(asked.clone())) {
                    (Some(own), Some(a)) if a != own => {
                        return Frame::Done {
                            data: Answer::List(crate::protocol::ExecutionList {
                                items: Vec::new(),
                                next: None,
                            }),
                            text: String::new(),
                            exit: 0,
                        };
                    }
                    (Some(own), _) => Some(own),
                    (None, a) => a,
                };
                self.list(&ListQuery {
                    state,
                    host,
                    tool,
                    actor,
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
            Request::Approvals => self.approvals(own.as_ref()).await,
            Request::Approve { id } => self.approve(id, &by).await,
            Request::Deny { id, reason } => self.deny(id, &by, &reason).await,
            Request::Lock { reason } => self.lock(true, reason.as_deref(), &by).await,
            Request::Unlock => self.lock(false, None, &by).await,
            Request::AdoptHost { host } => self.adopt_host(&host, &by).await,
            Request::LedgerBackup { dir } => ledger_backup(g.ledger().as_ref(), &dir).await,
            Request::AuditEvents { from, limit } => {
                audit_events(g.ledger().as_ref(), from, limit).await
            }
            Request::Runs { limit } => self.runs(limit, own.as_ref()).await,
            Request::AuditVerify {
                exported_head,
                since,
            } => {
                // The CLI shows it on a terminal: a walk of millions of events takes a while.
                let sink = std::sync::Mutex::new(event);
                let progress = |done, total| {
                    (sink.lock().expect("progress sink"))(Event::Progress {
                        of: "events verified".into(),
                        done,
                        total: Some(total),
                    })
                };
                let (head, since) = (exported_head.as_deref(), since.as_deref());
                audit_verify(g.ledger().as_ref(), head, since, &progress).await
            }
            Request::AuditHead => self.audit_head().await,
            Request::AuditRefused { limit } => self.refusals(limit).await,
            Request::Gc {
                older_than_ms,
                dry_run,
            } => self.gc(older_than_ms, dry_run).await,
        }
    }

    /// `WhoAmI`: the caller as the daemon proved it, and its rights.
    fn who_am_i(&self, session: &Session) -> Frame {
        let c = &session.caller;
        let texts = |p: &[waymark_gateway::config::Pattern]| {
            p.iter().map(|p| p.text.clone()).collect::<Vec<_>>()
        };
        let data = crate::protocol::Identity {
            actor: c.actor.clone(),
            transport: c.transport.to_string(),
            operator: c.operator(),
            tools: c.rights.as_ref().map(|r| texts(&r.tools)),
            deny_tools: c.rights.as_ref().map(|r| texts(&r.deny_tools)),
            hosts: c
                .rights
                .as_ref()
                .and_then(|r| r.hosts.as_deref().map(texts)),
        };
        let mut text = format!("actor {} (via {})", c.actor.0, c.transport);
        match &c.rights {
            None => text.push_str(", every tool and host, operator"),
            Some(r) => {
                text.push_str(&format!(
                    "\n  tools: {}",
                    data.tools.clone().unwrap_or_default().join(", ")
                ));
                if !r.deny_tools.is_empty() {
                    text.push_str(&format!(
                        "\n  denied: {}",
                        data.deny_tools.clone().unwrap_or_default().join(", ")
                    ));
                }
                text.push_str(&format!(
                    "\n  hosts: {}",
                    data.hosts
                        .as_ref()
                        .map_or("every host".to_string(), |h| h.join(", "))
                ));
                text.push_str(&format!(
                    "\n  approval floor: {:?}; operator: {}",
                    r.approval, r.operator
                ));
            }
        }
        Frame::Done {
            data: Answer::Identity(data),
            text,
            exit: 0,
        }
    }
}
