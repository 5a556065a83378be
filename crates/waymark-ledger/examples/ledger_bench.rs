//! Durable transitions per second at concurrency 1, 8 and 64, and ledger bytes per completed
//! execution. A benchmark, not a test: run it with
//! `cargo run --release -p waymark-ledger --example ledger_bench`.
//!
//! Each "durable transition" is one atomic multi-tree write (record, indexes, chained event)
//! that returns only after the group commit flushed it.

#[path = "../tests/common/mod.rs"]
mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{now, request_argv};
use waymark_core::{Outcome, Transition, Word};
use waymark_ledger::{
    CapturedOutput, Durability, Ledger, LedgerOptions, NewExecution, StoredResult, SyncMode,
};

fn new_execution(ledger: &Ledger, n: u64) -> NewExecution {
    let argv = vec![
        Word::literal("systemctl"),
        Word::literal("restart"),
        Word::literal(format!("app{n}")),
    ];
    let req = request_argv("restart_service", argv);
    common::new_execution(ledger, &req, "web1", now())
}

/// One full life: accepted, authorized, dispatched, running, completed with a small result,
/// delivered. Six durable transitions.
fn one_execution(ledger: &Ledger, n: u64) {
    let d = Durability::Flushed;
    let t = now();
    let id = ledger.accept(new_execution(ledger, n), t, d).unwrap().id;
    ledger
        .transition(
            id,
            Transition::Authorize {
                by: "policy".into(),
            },
            t,
            d,
        )
        .unwrap();
    ledger
        .transition(id, Transition::Dispatch { attempt: 1 }, t, d)
        .unwrap();
    ledger
        .transition(id, Transition::Started { pid: Some(4242) }, t, d)
        .unwrap();
    let result = StoredResult {
        stdout: CapturedOutput::capture(b"restarted app\n", 1 << 20),
        stderr: CapturedOutput::capture(b"", 1 << 20),
    };
    let done = Transition::Finished {
        outcome: Outcome::Exited {
            exit_code: Some(0),
            signal: None,
        },
    };
    ledger
        .transition_with_result(id, done, result, t, d)
        .unwrap();
    ledger.transition(id, Transition::Delivered, t, d).unwrap();
}

fn run(sync: SyncMode, concurrency: usize, budget: Duration) -> (f64, f64, u64) {
    let dir = tempfile::tempdir().unwrap();
    let ledger = Arc::new(
        Ledger::init_with(
            dir.path(),
            LedgerOptions {
                sync,
                ..Default::default()
            },
        )
        .unwrap(),
    );
    let per_thread = (2000 / concurrency).max(4) as u64;
    let start = Instant::now();
    let flushes0 = ledger.flush_count();
    let executions: u64 = std::thread::scope(|s| {
        let handles: Vec<_> = (0..concurrency)
            .map(|c| {
                let ledger = ledger.clone();
                s.spawn(move || {
                    let mut done = 0;
                    for i in 0..per_thread {
                        if start.elapsed() > budget {
                            break;
                        }
                        one_execution(&ledger, c as u64 * 1_000_000 + i);
                        done += 1;
                    }
                    done
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).sum()
    });
    let elapsed = start.elapsed().as_secs_f64();
    let transitions = executions * 6;
    let flushes = ledger.flush_count() - flushes0;
    ledger.flush().unwrap();
    let bytes = common::dir_size(dir.path()) / executions.max(1);
    (
        transitions as f64 / elapsed,
        transitions as f64 / flushes.max(1) as f64,
        bytes,
    )
}

fn main() {
    let budget = Duration::from_secs(
        std::env::var("BENCH_SECONDS")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(6),
    );
    println!(
        "durable transitions per second (each: one atomic multi-tree write + flush before return)"
    );
    println!(
        "{:<12} {:>11} {:>14} {:>16} {:>18}",
        "sync", "concurrency", "transitions/s", "writes per flush", "disk bytes/exec"
    );
    for sync in [SyncMode::Fdatasync, SyncMode::SledFlush] {
        for concurrency in [1usize, 8, 64] {
            let (rate, per_flush, bytes) = run(sync, concurrency, budget);
            println!(
                "{:<12} {:>11} {:>14.0} {:>16.1} {:>18}",
                format!("{sync:?}"),
                concurrency,
                rate,
                per_flush,
                bytes
            );
        }
    }
    println!("(disk bytes/exec is the sled directory size over completed executions, incl. sled's preallocated segments)");
}
