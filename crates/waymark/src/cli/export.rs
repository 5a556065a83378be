//! `waymark audit export`: the audit chain as JSON lines, through the daemon or offline.

use std::path::Path;

use serde_json::Value;

use super::ask::daemon_start;
use super::local::open_ledger;
use super::Cli;
use crate::protocol::client::ClientError;
use crate::protocol::control::Control;
use crate::protocol::{EventPage, Frame, Request};
use crate::{exit, fail, load_config, service};

/// Prints every event from `from` (or the oldest kept) up to the head as it was when the export
/// began, one JSON object per line, as stored: its sequence, time, execution, kind, `prev` and
/// `hash`. `since_ms` keeps only events recorded within that many milliseconds.
pub async fn audit_export(
    cli: &Cli,
    from: Option<u64>,
    since_ms: Option<u64>,
    ledger: Option<&Path>,
) -> i32 {
    let offline = ledger.map(|p| open_ledger(p, waymark_ledger::WitnessCheck::Report));
    let control = if offline.is_none() {
        Some(Control::new(daemon_start(&load_config(cli))))
    } else {
        None
    };
    let page = |from: u64| {
        let offline = offline.clone();
        let control = control.clone();
        async move {
            let frame = match (&offline, &control) {
                (Some(l), _) => service::audit_events(l, from, service::EVENTS_PAGE)
                    .await
                    .to_json(),
                (None, Some(c)) => c
                    .request(
                        Request::AuditEvents {
                            from,
                            limit: service::EVENTS_PAGE,
                        },
                        |_| {},
                    )
                    .await
                    .unwrap_or_else(|e| {
                        let why = match e {
                            ClientError::NoDaemon => c
                                .start_error()
                                .map_or("no daemon answers".into(), |e| e.message),
                            ClientError::Broken(why) => why,
                        };
                        fail(format!("audit export: {why}"), exit::ERROR)
                    }),
                (None, None) => unreachable!("one source or the other"),
            };
            match frame.answer::<EventPage>() {
                Frame::Done { data, .. } => data,
                Frame::Error { message, exit } => fail(message, exit),
                Frame::Event(_) => fail("audit export: an unexpected event frame", exit::ERROR),
            }
        }
    };
    let cutoff = since_ms.map(|ms| {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64);
        now.saturating_sub(ms)
    });
    let mut next = from.unwrap_or(0);
    let mut until = None;
    loop {
        let p = page(next).await;
        let until = *until.get_or_insert(p.head);
        let mut last = None;
        for event in &p.events {
            let seq = event["seq"].as_u64().unwrap_or(0);
            if seq > until {
                return 0;
            }
            last = Some(seq);
            let at = event["at"].as_u64().unwrap_or(0);
            if cutoff.is_some_and(|c| at < c) {
                continue;
            }
            outln!("{}", Value::to_string(event));
        }
        match last {
            Some(seq) if seq < until => next = seq + 1,
            _ => return 0,
        }
    }
}

/// `waymark audit verify --export FILE`: checks an export of `audit export` line by line: each
/// event is the next one, links to the one before, and carries the hash the ledger key gives
/// it. The key comes from `--ledger PATH`, else from the configured ledger (its key file).
/// `head` (SEQ:HASH, kept elsewhere) also proves the export was not cut short.
pub fn verify_export(cli: &Cli, file: &Path, head: Option<&str>, ledger: Option<&Path>) -> i32 {
    use waymark_ledger::{verify_events, ChainHead, ChainProblem, LedgerEvent};
    let exported = head.map(|h| {
        h.parse::<ChainHead>()
            .unwrap_or_else(|e| fail(format!("--head: {e}"), exit::USAGE))
    });
    let key_file = match ledger {
        Some(dir) => dir.join("ledger.key"),
        None => {
            let config = load_config(cli);
            match &config.ledger_backend {
                waymark_gateway::config::LedgerBackend::Sled => {
                    config.ledger_path.join("ledger.key")
                }
                waymark_gateway::config::LedgerBackend::Postgres(pg) => pg.key_file.clone(),
            }
        }
    };
    let master = read_key(&key_file).unwrap_or_else(|why| {
        fail(
            format!(
                "cannot prove the export's hashes: {why}. Give the ledger it came from with \
                 --ledger PATH (its key file proves each hash)"
            ),
            exit::USAGE,
        )
    });
    let (_, chain_key) = waymark_ledger::derive_keys(&master);
    let text = std::fs::read_to_string(file)
        .unwrap_or_else(|e| fail(format!("{}: {e}", file.display()), exit::USAGE));
    let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
    let parsed: Vec<(u64, Result<LedgerEvent, String>)> = lines
        .iter()
        .enumerate()
        .map(|(i, line)| {
            let event = serde_json::from_str::<LedgerEvent>(line)
                .map_err(|e| format!("line {} is not an event: {e}", i + 1));
            let seq = match &event {
                Ok(e) => e.seq,
                // An unreadable line stands where the next event should be.
                Err(_) => serde_json::from_str::<Value>(line)
                    .ok()
                    .and_then(|v| v["seq"].as_u64())
                    .unwrap_or(0),
            };
            (seq, event)
        })
        .collect();
    let Some((_, Ok(first))) = parsed.first() else {
        let why = match parsed.first() {
            None => "it holds no event".to_string(),
            Some((_, Err(e))) => e.clone(),
            Some(_) => unreachable!("the first line parsed"),
        };
        fail(format!("{}: {why}", file.display()), exit::ERROR)
    };
    // The export starts where it was asked to: the event before its first is its base.
    let base = ChainHead {
        seq: first.seq.saturating_sub(1),
        hash: first.prev.clone(),
    };
    let last = match parsed.last() {
        Some((seq, Ok(e))) => ChainHead {
            seq: *seq,
            hash: e.hash.clone(),
        },
        _ => base.clone(),
    };
    let mut report = verify_events(
        &chain_key,
        &base,
        parsed.into_iter(),
        &last,
        exported.as_ref(),
    );
    // An export that begins after genesis has no checkpoint to confirm its base: it proves
    // itself from its first line on, which is what was asked.
    if matches!(
        report.broken.as_ref().map(|b| &b.problem),
        Some(ChainProblem::UnconfirmedCheckpoint)
    ) {
        report.broken = None;
    }
    let ok = report.broken.is_none();
    if cli.json {
        outln!(
            "{}",
            serde_json::json!({
                "ok": ok,
                "events": report.events,
                "from": base.seq + 1,
                "head": report.head,
                "broken": report.broken.as_ref().map(|b| serde_json::json!({
                    "seq": b.seq,
                    "problem": b.problem.to_string(),
                })),
            })
        );
    } else if let Some(b) = &report.broken {
        outln!(
            "EXPORT BROKEN at event {}: {}. The {} events before it are intact.",
            b.seq,
            b.problem,
            report.events
        );
    } else {
        outln!(
            "Export OK: {} events from {} to head {}, each linked to the one before and proven \
             by the ledger key{}.",
            report.events,
            base.seq + 1,
            report.head,
            if exported.is_some() {
                "; it reaches the head given"
            } else {
                " (give --head SEQ:HASH to prove it was not cut short)"
            }
        );
    }
    if ok {
        0
    } else {
        exit::ERROR
    }
}

/// A ledger master key file: 64 hex digits.
fn read_key(path: &Path) -> Result<[u8; 32], String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let mut key = [0u8; 32];
    hex::decode_to_slice(text.trim(), &mut key)
        .map_err(|_| format!("{} does not hold 64 hex digits", path.display()))?;
    Ok(key)
}
