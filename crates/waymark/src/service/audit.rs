//! The audit chain and retention: `AuditVerify`, `AuditHead`, `Gc`.

use std::time::Duration;

use waymark_gateway::flow::now;
use waymark_gateway::host::HostExecutor;
use waymark_ledger::{ChainHead, LedgerApi};

use super::render::chain_position;
use super::{Frame, Service};
use crate::exit;
use crate::protocol::{Answer, AuditReport, ChainBreakView, GcReport};

impl<E: HostExecutor> Service<E> {
    /// `AuditHead`: the chain head, to keep somewhere else.
    pub(super) async fn audit_head(&self) -> Frame {
        let g = &self.gateway;
        let h = match g.ledger().head().await {
            Ok(h) => h,
            Err(e) => {
                return Frame::Error {
                    message: e.to_string(),
                    exit: exit::ERROR,
                }
            }
        };
        Frame::Done {
            text: h.to_string(),
            data: Answer::Head(chain_position(&h)),
            exit: 0,
        }
    }

    /// `Gc`: removes resolved executions older than `older_than_ms`.
    pub(super) async fn gc(&self, older_than_ms: u64) -> Frame {
        let g = &self.gateway;
        let cutoff = now().minus(Duration::from_millis(older_than_ms));
        match g.ledger().gc(cutoff, now()).await {
                    Ok(r) => Frame::Done {
                        text: format!("Removed {} resolved executions; kept {} that still need attention; pruned events through {}.", r.removed_executions, r.kept_unresolved, r.pruned_events_through.map_or("none".into(), |s| s.to_string())),
                        data: Answer::Gc(GcReport {
                            removed: r.removed_executions,
                            kept_unresolved: r.kept_unresolved,
                            pruned_through: r.pruned_events_through,
                        }),
                        exit: 0,
                    },
                    Err(e) => Frame::Error { message: e.to_string(), exit: exit::ERROR },
                }
    }
}

pub async fn audit_verify(ledger: &dyn LedgerApi, exported: Option<&str>) -> Frame {
    let exported = match exported.map(str::parse::<ChainHead>) {
        Some(Err(e)) => {
            return Frame::Error {
                message: format!("--head: {e}"),
                exit: exit::USAGE,
            }
        }
        Some(Ok(h)) => Some(h),
        None => None,
    };
    match ledger.verify(exported.as_ref()).await {
        Ok(r) => {
            let data = Answer::Audit(AuditReport {
                ok: r.is_ok(),
                events: r.events,
                base: chain_position(&r.base),
                head: chain_position(&r.head),
                broken: r.broken.as_ref().map(|b| ChainBreakView {
                    seq: b.seq,
                    problem: b.problem.to_string(),
                }),
            });
            match &r.broken {
                None => Frame::Done {
                    text: format!(
                        "Audit chain OK: {} events verified from {} to head {}.",
                        r.events,
                        if r.base.seq == 0 {
                            "genesis".to_string()
                        } else {
                            format!("checkpoint {}", r.base.seq)
                        },
                        r.head
                    ),
                    data,
                    exit: 0,
                },
                Some(b) => Frame::Done {
                    text: format!(
                        "AUDIT CHAIN BROKEN: {b}. Events before it ({} checked) are intact.",
                        r.events
                    ),
                    data,
                    exit: exit::ERROR,
                },
            }
        }
        Err(e) => Frame::Error {
            message: e.to_string(),
            exit: exit::ERROR,
        },
    }
}
