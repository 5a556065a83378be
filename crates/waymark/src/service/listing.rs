//! Reading the ledger's lists: executions (`List`) and agent runs (`Runs`).

use waymark_core::Actor;
use waymark_gateway::host::HostExecutor;
use waymark_ledger::ListQuery;

use super::render::{execution_view, fmt_time, run_view};
use super::{Frame, Service};
use crate::exit;
use crate::protocol::{Answer, ExecutionList, RunList};

impl<E: HostExecutor> Service<E> {
    /// `List`: a page of executions, newest first.
    pub(super) async fn list(&self, q: &ListQuery) -> Frame {
        let g = &self.gateway;
        match g.ledger().list(q).await {
            Ok(page) => {
                let text = page
                    .items
                    .iter()
                    .map(|r| {
                        format!(
                            "{}  {:<18} {:<10} {:<16} {}",
                            r.id,
                            r.state().as_str(),
                            r.host,
                            r.tool,
                            fmt_time(r.accepted_at)
                        )
                    })
                    .collect::<Vec<_>>()
                    .join("\n");
                // An empty page says so, as `approvals` does: no output reads like a failure.
                let text = if text.is_empty() {
                    "No execution matches.".to_string()
                } else {
                    text
                };
                let data = ExecutionList {
                    items: page.items.iter().map(execution_view).collect(),
                    next: page.next,
                };
                Frame::Done {
                    data: Answer::List(data),
                    text,
                    exit: 0,
                }
            }
            Err(e) => Frame::Error {
                message: e.to_string(),
                exit: exit::ERROR,
            },
        }
    }

    /// `Runs`: the agent-session log; `own`: only that actor's runs.
    pub(super) async fn runs(&self, limit: Option<usize>, own: Option<&Actor>) -> Frame {
        let g = &self.gateway;
        match g.ledger().runs(limit.unwrap_or(50)).await {
            Ok(mut runs) => {
                if let Some(a) = own {
                    runs.retain(|r| &r.actor == a);
                }
                let text = runs
                    .iter()
                    .map(|r| {
                        format!(
                            "{}  {}  {}  calls={}  started {}{}",
                            r.id,
                            r.actor.0,
                            r.transport,
                            r.calls,
                            fmt_time(r.started_at),
                            r.ended_at
                                .map(|e| format!("  ended {}", fmt_time(e)))
                                .unwrap_or_default()
                        )
                    })
                    .collect::<Vec<_>>()
                    .join("\n");
                let text = if text.is_empty() {
                    "No agent run is recorded.".to_string()
                } else {
                    text
                };
                Frame::Done {
                    data: Answer::Runs(RunList {
                        items: runs.iter().map(run_view).collect(),
                    }),
                    text,
                    exit: 0,
                }
            }
            Err(e) => Frame::Error {
                message: e.to_string(),
                exit: exit::ERROR,
            },
        }
    }
}
