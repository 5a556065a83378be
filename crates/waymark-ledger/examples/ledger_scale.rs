//! How the sled ledger behaves as it grows (issue 37). A benchmark, not a test: run it with
//! `cargo run --release -p waymark-ledger --example ledger_scale` (sizes in `LEDGER_SCALE`,
//! default `10000,100000`).
//!
//! It fills one ledger in this process (two writers, each execution's whole life: accepted,
//! authorized, dispatched, running, completed with a small result, delivered) to each size,
//! and prints at each: disk bytes per execution, the process's RSS, a new action's latency
//! (accept, flushed), a status read of the newest and oldest execution, a list by a tool that
//! has 1% of the executions, the events of the oldest (what `exec explain` reads) and
//! `verify`'s rate. Then a gc of every filled execution while a writer keeps accepting: its
//! time and transactions, RSS before and at its peak, the writer's usual and worst wait, and
//! the disk before and after, and what `ledger compact` gives back.
//!
//! Filled in process, not through the daemon: the figures are the ledger's own, without the
//! socket and the gateway (the daemon adds its own RSS and ~1 ms per call on top).

#[path = "../tests/common/mod.rs"]
mod common;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use common::{now, request};
use waymark_core::{ExecutionId, Timestamp, Transition};
use waymark_ledger::{CapturedOutput, Durability, Ledger, LedgerOptions, ListQuery, StoredResult};

/// A day ago: every filled execution is older than the gc's cutoff (an hour ago), and the
/// clock moves on, so ids (minted in order) stay in time order.
fn past() -> Timestamp {
    Timestamp::from_millis(now().as_millis() - 86_400_000)
}

/// One execution's whole life, buffered like the daemon's intermediate steps.
fn one_execution(ledger: &Ledger, n: u64, at: Timestamp, durability: Durability) -> ExecutionId {
    let tool = if n.is_multiple_of(100) {
        "rare"
    } else {
        "deploy"
    };
    let req = request(tool, &format!("v{n}"), "pw");
    let new = common::new_execution(ledger, &req, &format!("web{}", n % 10), at);
    let id = ledger.accept(new, at, durability).unwrap().id;
    let d = Durability::Buffered;
    for t in [
        Transition::Authorize {
            by: "policy".into(),
        },
        Transition::Dispatch { attempt: 1 },
        Transition::Started { pid: Some(4242) },
    ] {
        ledger.transition(id, t, at, d).unwrap();
    }
    let result = StoredResult {
        stdout: CapturedOutput::capture(b"deployed\n", 1 << 16),
        stderr: CapturedOutput::capture(b"", 1 << 16),
    };
    ledger
        .transition_with_result(id, common::exited(0), result, at, d)
        .unwrap();
    ledger.transition(id, Transition::Delivered, at, d).unwrap();
    id
}

fn rss_kib() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches(" kB").trim().parse().ok())
        .unwrap_or(0)
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// The p50 and p99 of `samples`, in milliseconds.
fn p50_p99(mut samples: Vec<Duration>) -> (f64, f64) {
    samples.sort();
    let at = |q: f64| ms(samples[((samples.len() - 1) as f64 * q) as usize]);
    (at(0.5), at(0.99))
}

/// Milliseconds `f` takes, best of three.
fn best_of_three<T>(mut f: impl FnMut() -> T) -> f64 {
    (0..3)
        .map(|_| {
            let t = Instant::now();
            std::hint::black_box(f());
            ms(t.elapsed())
        })
        .fold(f64::MAX, f64::min)
}

fn main() {
    let sizes: Vec<u64> = std::env::var("LEDGER_SCALE")
        .unwrap_or_else(|_| "10000,100000".into())
        .split(',')
        .map(|s| {
            s.trim()
                .parse()
                .expect("LEDGER_SCALE: sizes separated by commas")
        })
        .collect();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ledger");
    let ledger = Ledger::init_with(&path, LedgerOptions::default()).unwrap();
    let filled = AtomicU64::new(0);
    let (mut oldest, mut newest) = (None, None);
    println!(
        "{:>9} {:>10} {:>8} {:>17} {:>15} {:>13} {:>13} {:>12}",
        "executions",
        "disk/exec",
        "RSS MiB",
        "new action p50/99",
        "status new/old",
        "list rare",
        "events old",
        "verify ev/s"
    );
    for &size in &sizes {
        let fill_from = filled.load(Ordering::Relaxed);
        std::thread::scope(|s| {
            for _ in 0..2 {
                s.spawn(|| loop {
                    let n = filled.fetch_add(1, Ordering::Relaxed);
                    if n >= size {
                        filled.fetch_sub(1, Ordering::Relaxed);
                        break;
                    }
                    one_execution(&ledger, n, past(), Durability::Buffered);
                });
            }
        });
        ledger.flush().unwrap();
        if fill_from == 0 {
            let first = ledger.list(&ListQuery {
                limit: 1,
                oldest_first: true,
                ..ListQuery::default()
            });
            oldest = first.unwrap().items.first().map(|r| r.id);
        }
        let accepts: Vec<Duration> = (0..200)
            .map(|i| {
                let t = Instant::now();
                let req = request("probe", &format!("{size}-{i}"), "pw");
                let at = past();
                let new = common::new_execution(&ledger, &req, "web1", at);
                let id = ledger.accept(new, at, Durability::Flushed).unwrap().id;
                let took = t.elapsed();
                newest = Some(id);
                // Resolved too, so that gc may take it with the rest.
                ledger
                    .transition(
                        id,
                        Transition::Deny {
                            by: "bench".into(),
                            reason: "probe".into(),
                        },
                        at,
                        Durability::Buffered,
                    )
                    .unwrap();
                ledger
                    .transition(id, Transition::Delivered, at, Durability::Buffered)
                    .unwrap();
                took
            })
            .collect();
        let (p50, p99) = p50_p99(accepts);
        let (old, new) = (oldest.unwrap(), newest.unwrap());
        let status_new = best_of_three(|| ledger.get(new).unwrap());
        let status_old = best_of_three(|| ledger.get(old).unwrap());
        let rare = ListQuery {
            tool: Some("rare".into()),
            limit: 50,
            ..ListQuery::default()
        };
        let list = best_of_three(|| ledger.list(&rare).unwrap());
        let events = best_of_three(|| ledger.events_of(old).unwrap());
        let t = Instant::now();
        let report = ledger.verify(None).unwrap();
        assert!(report.is_ok(), "{:?}", report.broken);
        let rate = report.events as f64 / t.elapsed().as_secs_f64();
        println!(
            "{:>9} {:>8} B {:>8.0} {:>8.2}/{:<8.2} {:>7.2}/{:<7.2} {:>10.2} ms {:>10.2} ms {:>12.0}",
            size,
            common::dir_size(&path) / size,
            rss_kib() as f64 / 1024.0,
            p50,
            p99,
            status_new,
            status_old,
            list,
            events,
            rate
        );
    }

    // gc of everything filled, while a writer keeps making new actions.
    let disk_before = common::dir_size(&path);
    let rss_before = rss_kib();
    let done = AtomicBool::new(false);
    let peak = AtomicU64::new(rss_before);
    let (report, took, waits) = std::thread::scope(|s| {
        s.spawn(|| {
            while !done.load(Ordering::Relaxed) {
                peak.fetch_max(rss_kib(), Ordering::Relaxed);
                std::thread::sleep(Duration::from_millis(20));
            }
        });
        let writer = s.spawn(|| {
            let mut waits = Vec::new();
            let mut n = 0u64;
            while !done.load(Ordering::Relaxed) {
                let t = Instant::now();
                let req = request("during", &format!("{n}"), "pw");
                let new = common::new_execution(&ledger, &req, "web1", now());
                ledger.accept(new, now(), Durability::Flushed).unwrap();
                waits.push((t, t.elapsed()));
                n += 1;
            }
            waits
        });
        // The writer's usual wait first, then the gc.
        std::thread::sleep(Duration::from_secs(2));
        let t = Instant::now();
        let cutoff = Timestamp::from_millis(now().as_millis() - 3_600_000);
        let report = ledger.gc(cutoff, now()).unwrap();
        let took = t.elapsed();
        done.store(true, Ordering::Relaxed);
        let waits: Vec<(Instant, Duration)> = writer.join().unwrap();
        let (before, during): (Vec<_>, Vec<_>) = waits.into_iter().partition(|(at, _)| *at < t);
        let strip = |v: Vec<(Instant, Duration)>| v.into_iter().map(|(_, d)| d).collect::<Vec<_>>();
        (report, took, (strip(before), strip(during)))
    });
    let (before, during) = waits;
    let (usual_p50, usual_p99) = p50_p99(before);
    let worst = during.iter().max().copied().unwrap_or_default();
    let during_n = during.len();
    let (during_p50, during_p99) = p50_p99(during);
    println!();
    println!(
        "gc of {} executions and {} runs: {:.1} s in {} transactions, base moved to {:?}",
        report.removed_executions,
        report.removed_runs,
        took.as_secs_f64(),
        report.transactions,
        report.pruned_events_through
    );
    println!(
        "RSS {:.0} MiB before, {:.0} MiB at its peak during gc ({:.2}x)",
        rss_before as f64 / 1024.0,
        peak.load(Ordering::Relaxed) as f64 / 1024.0,
        peak.load(Ordering::Relaxed) as f64 / rss_before.max(1) as f64
    );
    println!(
        "a new action: p50/p99 {usual_p50:.2}/{usual_p99:.2} ms before gc; during it ({during_n} actions) \
         {during_p50:.2}/{during_p99:.2} ms, worst {:.1} ms ({:.1}x the p99 before)",
        ms(worst),
        ms(worst) / usual_p99.max(0.001)
    );
    println!(
        "disk {:.1} MiB before gc, {:.1} MiB after",
        disk_before as f64 / 1048576.0,
        common::dir_size(&path) as f64 / 1048576.0
    );
    let report = ledger.verify(None).unwrap();
    assert!(report.is_ok(), "{:?}", report.broken);
    drop(ledger);
    // What `waymark ledger compact` (daemon stopped) gives back.
    let t = Instant::now();
    let compacted = Ledger::compact(&path).unwrap();
    println!(
        "ledger compact: {:.1} s, {:.1} MiB to {:.1} MiB",
        t.elapsed().as_secs_f64(),
        compacted.before_bytes as f64 / 1048576.0,
        compacted.after_bytes as f64 / 1048576.0
    );
}
