//! What a caller may do: its tools and hosts, its approval floor, which executions it may see
//! and move, and the operator's rights. A call outside them is refused before it is accepted,
//! and the refusal is a `refused` note in the audit chain.

use serde_json::json;
use waymark_core::{ExecutionId, ReplayContract};
use waymark_gateway::config::{Approval, Refusal};
use waymark_gateway::flow::now;
use waymark_gateway::host::HostExecutor;
use waymark_gateway::tools::ResolvedCall;
use waymark_ledger::{Durability, EventKind};

use super::{legacy, Frame, Service, Session};
use crate::exit;
use crate::protocol::{Answer, RefusalList, RefusalView};

/// The audit note a refused call leaves.
pub const REFUSED_NOTE: &str = "refused";

fn rank(a: Approval) -> u8 {
    match a {
        Approval::None => 0,
        Approval::Session => 1,
        Approval::PerCall => 2,
    }
}

impl<E: HostExecutor> Service<E> {
    /// Whether the caller may call `tool` at all (whatever its arguments, so a refused caller
    /// learns nothing of the tool); `call`, when its arguments resolved, gives the refusal's
    /// audit note its fingerprint (computed only for a refusal).
    pub(super) async fn may_call(
        &self,
        session: &Session,
        tool: &str,
        call: Option<&ResolvedCall>,
    ) -> Result<(), Box<Frame>> {
        let Some(rights) = &session.caller.rights else {
            return Ok(());
        };
        match rights.may_call(tool) {
            Ok(()) => Ok(()),
            Err(r) => Err(Box::new(self.refuse(session, tool, None, call, r).await)),
        }
    }

    /// Checks a resolved call, whose tool [`Self::may_call`] allowed, against the caller's
    /// hosts and raises its approval to the caller's floor. `Err` is the refusal, already
    /// audited.
    pub(super) async fn admit_call(
        &self,
        session: &Session,
        call: &mut ResolvedCall,
    ) -> Result<(), Box<Frame>> {
        let Some(rights) = session.caller.rights.clone() else {
            return Ok(());
        };
        if call.ssh_request().is_some() {
            let host = call.target();
            if let Err(e) = rights.may_target(host) {
                return Err(Box::new(
                    self.refuse(session, &call.tool, Some(host), Some(&*call), e)
                        .await,
                ));
            }
        }
        if call.policy.contract != ReplayContract::ReadOnly
            && rank(rights.approval) > rank(call.approval)
        {
            call.approval = rights.approval;
        }
        Ok(())
    }

    /// Records the refusal in the audit chain and answers it (exit 2).
    async fn refuse(
        &self,
        session: &Session,
        tool: &str,
        host: Option<&str>,
        call: Option<&ResolvedCall>,
        refusal: Refusal,
    ) -> Frame {
        let key = self.gateway.ledger().fingerprint_key();
        let fingerprint = call.map(|c| c.fingerprint(&key));
        let data = json!({
            "actor": session.caller.actor,
            "tool": tool,
            "host": host,
            "fingerprint": fingerprint.map(|f| f.to_string()),
            "rule": refusal.rule,
            "transport": session.caller.transport,
        });
        let recorded = self
            .gateway
            .ledger()
            .record_note(REFUSED_NOTE, data, now(), Durability::Flushed)
            .await;
        let audit = match recorded {
            Ok(seq) => format!("recorded in the audit chain as event {seq}"),
            Err(e) => {
                tracing::error!(error = %e, "cannot record a refused call in the audit chain");
                format!("not recorded: {e}")
            }
        };
        tracing::warn!(actor = %refusal.actor, tool, rule = %refusal.rule, "call refused");
        Frame::Error {
            message: format!("refused, nothing was accepted: {refusal} ({audit})"),
            exit: exit::USAGE,
        }
    }

    /// Operators only; `what` names the request in the refusal.
    pub(super) fn operator_only(session: &Session, what: &str) -> Result<(), Box<Frame>> {
        if session.caller.operator() {
            return Ok(());
        }
        Err(Box::new(Frame::Error {
            message: format!(
                "refused: {what} is for operators, and actor {} is none (operator = true in its [actors] entry)",
                session.caller.actor.0
            ),
            exit: exit::USAGE,
        }))
    }

    /// Whether the caller may see and move execution `id`: its own (the actor that created or
    /// attached to it, in either form of the actor) or any, for an operator. Another's is
    /// "not in the ledger", exactly as an id nobody knows: no oracle.
    pub(super) async fn may_see(
        &self,
        session: &Session,
        id: ExecutionId,
    ) -> Result<(), Box<Frame>> {
        if session.caller.operator() {
            return Ok(());
        }
        let cfg = self.gateway.config();
        match self.gateway.ledger().get(id).await {
            Ok(Some(r)) if legacy::same_actor(&r.actor, &session.caller.actor, &cfg) => Ok(()),
            Ok(_) => Err(Box::new(not_found(id))),
            Err(e) => Err(Box::new(Frame::Error {
                message: e.to_string(),
                exit: exit::ERROR,
            })),
        }
    }

    /// An operator's answer to an approval: never its own call's, unless `self_approve`.
    pub(super) async fn may_answer(
        &self,
        session: &Session,
        id: ExecutionId,
    ) -> Result<(), Box<Frame>> {
        Self::operator_only(session, "approving or denying")?;
        if session.caller.self_approve() {
            return Ok(());
        }
        let cfg = self.gateway.config();
        match self.gateway.ledger().get(id).await {
            Ok(Some(r)) if legacy::same_actor(&r.actor, &session.caller.actor, &cfg) => {
                Err(Box::new(Frame::Error {
                    message: format!(
                        "refused: {id} is actor {}'s own call; another operator answers it (or set self_approve = true)",
                        session.caller.actor.0
                    ),
                    exit: exit::USAGE,
                }))
            }
            _ => Ok(()),
        }
    }

    /// `AuditRefused`: the refused calls, newest first, at most `limit`.
    pub(super) async fn refusals(&self, limit: Option<usize>) -> Frame {
        let limit = limit.unwrap_or(50);
        let ledger = self.gateway.ledger();
        let mut items = Vec::new();
        let mut from = 0;
        loop {
            let events = match ledger.events(from, 1000).await {
                Ok(e) => e,
                Err(e) => {
                    return Frame::Error {
                        message: e.to_string(),
                        exit: exit::ERROR,
                    }
                }
            };
            let Some(last) = events.last().map(|e| e.seq) else {
                break;
            };
            for e in events {
                if let EventKind::Note { name, data } = &e.kind {
                    if name == REFUSED_NOTE {
                        items.push(RefusalView {
                            seq: e.seq,
                            at: e.at,
                            actor: waymark_core::Actor(
                                data["actor"].as_str().unwrap_or("?").to_string(),
                            ),
                            tool: data["tool"].as_str().unwrap_or("?").to_string(),
                            host: data["host"].as_str().map(str::to_string),
                            fingerprint: data["fingerprint"].as_str().map(str::to_string),
                            rule: data["rule"].as_str().unwrap_or("?").to_string(),
                            transport: data["transport"].as_str().unwrap_or("?").to_string(),
                        });
                    }
                }
            }
            from = last + 1;
        }
        items.reverse();
        items.truncate(limit);
        let text = if items.is_empty() {
            "No call was refused.".to_string()
        } else {
            items
                .iter()
                .map(|r| {
                    format!(
                        "#{}  {}  {}  {}{}  via {}\n    {}{}",
                        r.seq,
                        super::render::fmt_time(r.at),
                        r.actor.0,
                        r.tool,
                        r.host
                            .as_ref()
                            .map_or(String::new(), |h| format!(" on {h}")),
                        r.transport,
                        r.rule,
                        r.fingerprint
                            .as_ref()
                            .map_or(String::new(), |f| format!("\n    fingerprint {f}")),
                    )
                })
                .collect::<Vec<_>>()
                .join("\n")
        };
        Frame::Done {
            data: Answer::Refusals(RefusalList { items }),
            text,
            exit: 0,
        }
    }
}

/// What an execution nobody knows gets, and so another actor's.
pub(super) fn not_found(id: ExecutionId) -> Frame {
    Frame::Error {
        message: format!("execution {id} is not in the ledger"),
        exit: exit::USAGE,
    }
}
