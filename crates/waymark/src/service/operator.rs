//! What an operator decides: cancel, review, approvals, lock.

use waymark_core::{ExecutionId, ReviewVerdict};
use waymark_gateway::flow::{describe, now, Audience};
use waymark_gateway::host::HostExecutor;
use waymark_ledger::Durability;

use super::render::{call_answer, execution_view, fmt_time};
use super::{gw_err, Frame, Service};
use crate::exit;
use crate::protocol::{Answer, ApprovalList, HostAdopted, LockState};

impl<E: HostExecutor> Service<E> {
    /// `Cancel`: before dispatch, or its process group on the host.
    pub(super) async fn cancel(&self, id: ExecutionId, by: &str) -> Frame {
        let g = &self.gateway;
        match g.cancel(id, by).await {
            Ok(o) => Frame::Done {
                text: o.message(Audience::Cli),
                data: Answer::Call(call_answer(&o)),
                exit: 0,
            },
            Err(e) => gw_err(e),
        }
    }

    /// `Review`: resolves an unknown or interrupted execution.
    pub(super) async fn review(&self, id: ExecutionId, ran: bool, by: &str, note: &str) -> Frame {
        let g = &self.gateway;
        let verdict = if ran {
            ReviewVerdict::Ran
        } else {
            ReviewVerdict::DidNotRun
        };
        match g.review(id, verdict, by, note).await {
            Ok(r) => Frame::Done {
                text: describe(&r, None, Audience::Cli),
                data: Answer::Execution(execution_view(&r)),
                exit: 0,
            },
            Err(e) => Frame::Error {
                message: e.to_string(),
                exit: exit::USAGE,
            },
        }
    }

    /// `Approvals`: every execution that awaits approval (`own`: only that actor's).
    pub(super) async fn approvals(&self, own: Option<&waymark_core::Actor>) -> Frame {
        let g = &self.gateway;
        match g.pending_approvals().await {
            Ok(mut items) => {
                if let Some(a) = own {
                    items.retain(|r| &r.actor == a);
                }
                let text = if items.is_empty() {
                    "No execution awaits approval.".into()
                } else {
                    items
                        .iter()
                        .map(|r| {
                            format!(
                                "{}  {}  on {}  by {}  since {}\n    {}",
                                r.id,
                                r.tool,
                                r.host,
                                r.actor.0,
                                fmt_time(r.accepted_at),
                                r.action.as_str()
                            )
                        })
                        .collect::<Vec<_>>()
                        .join("\n")
                };
                Frame::Done {
                    data: Answer::Approvals(ApprovalList {
                        items: items.iter().map(execution_view).collect(),
                    }),
                    text,
                    exit: 0,
                }
            }
            Err(e) => gw_err(e),
        }
    }

    /// `Approve`.
    pub(super) async fn approve(&self, id: ExecutionId, by: &str) -> Frame {
        let g = &self.gateway;
        match g.approve(id, by).await {
            Ok(r) => Frame::Done {
                text: format!("Approved {id}; it runs now (or on the caller's retry)."),
                data: Answer::Execution(execution_view(&r)),
                exit: 0,
            },
            Err(e) => gw_err(e),
        }
    }

    /// `Deny`.
    pub(super) async fn deny(&self, id: ExecutionId, by: &str, reason: &str) -> Frame {
        let g = &self.gateway;
        match g.deny(id, by, reason).await {
            Ok(r) => Frame::Done {
                text: format!("Denied {id}: {reason}"),
                data: Answer::Execution(execution_view(&r)),
                exit: 0,
            },
            Err(e) => gw_err(e),
        }
    }

    /// `Lock` (`lock`) and `Unlock`.
    pub(super) async fn lock(&self, lock: bool, reason: Option<&str>, by: &str) -> Frame {
        let g = &self.gateway;
        if g.locked().await.is_ok_and(|now| now == lock) {
            return Frame::Done {
                text: if lock {
                    let why = match g.lock_reason().await {
                        Ok(Some(r)) => format!(" ({r})"),
                        _ => String::new(),
                    };
                    format!("Already locked{why}: new actions stay denied until `waymark unlock`.")
                } else {
                    "Not locked: new actions are accepted.".into()
                },
                data: Answer::Lock(LockState {
                    locked: lock,
                    changed: false,
                }),
                exit: 0,
            };
        }
        match g.set_locked(lock, reason, by).await {
            Ok(()) => Frame::Done {
                text: if lock {
                    let why = reason.map_or(String::new(), |r| format!(" ({r})"));
                    format!("Locked{why}: every new action is denied until `waymark unlock`.")
                } else {
                    "Unlocked: new actions are accepted again.".into()
                },
                data: Answer::Lock(LockState {
                    locked: lock,
                    changed: true,
                }),
                exit: 0,
            },
            Err(e) => gw_err(e),
        }
    }

    /// `AdoptHost` (`hosts adopt NAME`): records this ledger on the host as the owner of its
    /// markers, then the adoption in the audit chain, with the ledger it replaced.
    pub(super) async fn adopt_host(&self, name: &str, by: &str) -> Frame {
        let g = &self.gateway;
        let config = g.config();
        let Some(host) = config.hosts.get(name).cloned() else {
            let known: Vec<&str> = config.hosts.keys().map(String::as_str).collect();
            return Frame::Error {
                message: format!(
                    "unknown host {name:?}; configured SSH hosts: {}",
                    known.join(", ")
                ),
                exit: exit::USAGE,
            };
        };
        let ledger = g.ledger().identity();
        // Recorded before the host is touched, as every action is; the outcome after.
        let asked = serde_json::json!({"host": name, "ledger": ledger, "by": by});
        if let Err(e) = g
            .ledger()
            .record_note(HOST_ADOPTING_NOTE, asked, now(), Durability::Flushed)
            .await
        {
            return Frame::Error {
                message: format!(
                    "host {name} was not adopted: the ledger refused to record it: {e}"
                ),
                exit: exit::ERROR,
            };
        }
        let previous = match g.executor().adopt(&host).await {
            Ok(p) => p,
            Err(e) => {
                return Frame::Error {
                    message: format!("host {name} was not adopted: {e}"),
                    exit: exit::ERROR,
                }
            }
        };
        let data =
            serde_json::json!({"host": name, "previous": previous, "ledger": ledger, "by": by});
        if let Err(e) = g
            .ledger()
            .record_note(HOST_ADOPTED_NOTE, data, now(), Durability::Flushed)
            .await
        {
            return Frame::Error {
                message: format!("host {name} was adopted, but recording it failed: {e}"),
                exit: exit::ERROR,
            };
        }
        let text = match &previous {
            Some(p) if *p != ledger => format!(
                "Host {name} adopted: its markers belonged to ledger {p}; they now belong to this \
                 ledger ({ledger}). Recorded in the audit chain."
            ),
            Some(_) => format!("Host {name} already belonged to this ledger ({ledger})."),
            None => format!(
                "Host {name} adopted: no ledger was recorded there; it now belongs to this ledger \
                 ({ledger}). Recorded in the audit chain."
            ),
        };
        Frame::Done {
            text,
            data: Answer::Adopted(HostAdopted {
                host: name.to_string(),
                previous,
                ledger,
            }),
            exit: 0,
        }
    }
}

/// The audit notes of `hosts adopt`: asked (before the host is touched), and done.
pub const HOST_ADOPTING_NOTE: &str = "host adoption asked";
pub const HOST_ADOPTED_NOTE: &str = "host adopted";
