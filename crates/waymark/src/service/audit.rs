//! The audit chain and retention: `AuditVerify`, `AuditHead`, `Gc`.

use std::time::Duration;

use waymark_gateway::flow::now;
use waymark_gateway::host::HostExecutor;
use waymark_ledger::{ChainHead, LedgerApi};

use super::render::chain_position;
use super::{Frame, Service};
use crate::exit;
use crate::protocol::{Answer, AuditReport, BackupReport, ChainBreakView, EventPage, GcReport};

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

    /// `Gc`: removes resolved executions older than `older_than_ms`, or says what it would.
    pub(super) async fn gc(&self, older_than_ms: u64, dry_run: bool) -> Frame {
        let g = &self.gateway;
        let cutoff = now().minus(Duration::from_millis(older_than_ms));
        let report = if dry_run {
            g.ledger().gc_plan(cutoff).await
        } else {
            g.ledger().gc(cutoff, now()).await
        };
        match report {
            Ok(r) => Frame::Done {
                text: gc_words(&r, older_than_ms, dry_run),
                data: Answer::Gc(GcReport {
                    removed: r.removed_executions,
                    removed_runs: r.removed_runs,
                    kept_unresolved: r.kept_unresolved,
                    pruned_through: r.pruned_events_through,
                    dry_run,
                }),
                exit: 0,
            },
            Err(e) => Frame::Error {
                message: e.to_string(),
                exit: exit::ERROR,
            },
        }
    }
}

/// What a retention run did (or would do), in words.
fn gc_words(r: &waymark_ledger::GcReport, older_than_ms: u64, dry_run: bool) -> String {
    let (remove, keep, prune) = if dry_run {
        ("Would remove", "would keep", "would prune")
    } else {
        ("Removed", "kept", "pruned")
    };
    let age = older_than_ms / 1000;
    let age = match age {
        a if a % 86_400 == 0 && a > 0 => format!("{}d", a / 86_400),
        a if a % 3_600 == 0 && a > 0 => format!("{}h", a / 3_600),
        a if a % 60 == 0 && a > 0 => format!("{}m", a / 60),
        a => format!("{a}s"),
    };
    let plural = |n: u64| if n == 1 { "" } else { "s" };
    let mut text = format!(
        "{remove} {} resolved execution{} accepted more than {age} ago, with their results; {keep} {} that still need{} attention (unknown, interrupted or not yet delivered).",
        r.removed_executions,
        plural(r.removed_executions),
        r.kept_unresolved,
        if r.kept_unresolved == 1 { "s" } else { "" },
    );
    if r.removed_runs > 0 {
        text.push_str(&format!(
            " {remove} {} agent run{} whose executions are all gone.",
            r.removed_runs,
            plural(r.removed_runs)
        ));
    }
    match r.pruned_events_through {
        Some(seq) => text.push_str(&format!(
            " The audit chain {prune} its events through {seq}; a checkpoint keeps it verifiable."
        )),
        None => text.push_str(" No audit events pruned."),
    }
    if dry_run {
        text.push_str(" Nothing was removed (--dry-run).");
    }
    text
}

pub async fn audit_verify(
    ledger: &dyn LedgerApi,
    exported: Option<&str>,
    since: Option<&str>,
    progress: waymark_ledger::Progress<'_>,
) -> Frame {
    let parse = |flag: &str, v: Option<&str>| match v.map(str::parse::<ChainHead>) {
        Some(Err(e)) => Err(format!("{flag}: {e}")),
        Some(Ok(h)) => Ok(Some(h)),
        None => Ok(None),
    };
    let (exported, since) = match (parse("--head", exported), parse("--since", since)) {
        (Ok(e), Ok(s)) => (e, s),
        (Err(message), _) | (_, Err(message)) => {
            return Frame::Error {
                message,
                exit: exit::USAGE,
            }
        }
    };
    let report = ledger
        .verify_since(since.as_ref(), exported.as_ref(), progress)
        .await;
    match report {
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
                        match &since {
                            Some(s) => format!("the given head {}", s.seq),
                            None if r.base.seq == 0 => "genesis".to_string(),
                            None => format!("checkpoint {}", r.base.seq),
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

/// `LedgerBackup` (`ledger backup DIR`), through the daemon or on a ledger opened offline.
pub async fn ledger_backup(ledger: &dyn LedgerApi, dir: &str) -> Frame {
    match ledger.backup(std::path::Path::new(dir)).await {
        Ok(head) => Frame::Done {
            text: format!(
                "Backed up the ledger to {dir}: a consistent copy at audit head {head}. Restore it \
                 as the README says; the live ledger's witness then tells how far behind it is."
            ),
            data: Answer::Backup(BackupReport {
                dir: dir.to_string(),
                head: chain_position(&head),
            }),
            exit: 0,
        },
        Err(e) => Frame::Error {
            message: format!("no backup was made: {e}"),
            exit: exit::ERROR,
        },
    }
}

/// The most events one `AuditEvents` answer carries.
pub const EVENTS_PAGE: usize = 1000;

/// `AuditEvents`: a page of the chain as stored, for `audit export`.
pub async fn audit_events(ledger: &dyn LedgerApi, from: u64, limit: usize) -> Frame {
    let page = async {
        let head = ledger.head().await?.seq;
        let events = ledger.events(from, limit.clamp(1, EVENTS_PAGE)).await?;
        Ok::<_, waymark_ledger::LedgerError>((head, events))
    };
    match page.await {
        Ok((head, events)) => Frame::Done {
            text: format!("{} events", events.len()),
            data: Answer::Events(EventPage {
                events: events
                    .iter()
                    .map(|e| serde_json::to_value(e).expect("events serialize"))
                    .collect(),
                head,
            }),
            exit: 0,
        },
        Err(e) => Frame::Error {
            message: e.to_string(),
            exit: exit::ERROR,
        },
    }
}
