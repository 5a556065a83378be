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
