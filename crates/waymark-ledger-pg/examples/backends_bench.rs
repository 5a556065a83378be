//! sled and PostgreSQL side by side, in one run, through the `LedgerApi` the gateway uses. A
//! benchmark, not a test:
//! `cargo run --release -p waymark-ledger-pg --example backends_bench` (starts its own
//! PostgreSQL cluster with the test kit; `BENCH_SECONDS` per row, default 5).
//!
//! Two rows per backend and concurrency (1, 8, 32 tasks):
//! - durable transitions/s: each transition flushed (sled: group commit + fdatasync;
//!   PostgreSQL: committed with `synchronous_commit = on`) before it returns;
//! - durable actions/s: the ledger's share of one `true` call as the gateway writes it: the
//!   intent decided and accepted (buffered), authorized (buffered), dispatched (flushed), the
//!   outcome with its result (flushed), delivered (flushed).

#[path = "../tests/common/backends.rs"]
#[allow(unused_macros)]
mod backends;
#[path = "../../waymark-ledger/tests/common/mod.rs"]
mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use backends::{Kind, Place};
use common::{new_execution, now, request_argv};
use waymark_core::{
    ExecutionId, IncomingCall, Outcome, ReplayContract, ReplayPolicy, Transition, Word,
};
use waymark_ledger::{CapturedOutput, Durability, Intake, LedgerApi, StoredResult};

/// Decides and accepts a new `systemctl restart appN` intent.
async fn accept(ledger: &dyn LedgerApi, n: u64, d: Durability) -> ExecutionId {
    let argv = vec![
        Word::literal("systemctl"),
        Word::literal("restart"),
        Word::literal(format!("app{n}")),
    ];
    let req = request_argv("restart_service", argv);
    let t = now();
    let new = new_execution(ledger, &req, "web1", t);
    let call = IncomingCall {
        actor: req.actor.clone(),
        scope: req.scope.clone(),
        policy: ReplayPolicy::new(ReplayContract::Idempotent, Duration::from_secs(600)),
        now: t,
    };
    match ledger.accept_or_attach(new, &call, d).await.unwrap() {
        Intake::New(rec) => rec.id,
        Intake::Attach { .. } => panic!("every benchmark intent is new"),
    }
}

fn finished() -> (Transition, StoredResult) {
    let done = Transition::Finished {
        outcome: Outcome::Exited {
            exit_code: Some(0),
            signal: None,
        },
    };
    let result = StoredResult {
        stdout: CapturedOutput::capture(b"", 1 << 16),
        stderr: CapturedOutput::capture(b"", 1 << 16),
    };
    (done, result)
}

/// One execution's life with the durabilities `d` gives each step (accept, authorize,
/// dispatch, result, delivered); returns how many of its writes were flushed. The
/// authorization and the dispatch are one write, as the gateway makes them: two writes when
/// `d` makes the authorization flushed on its own.
async fn one_life(ledger: &dyn LedgerApi, n: u64, d: [Durability; 5]) -> u64 {
    let t = now();
    let id = accept(ledger, n, d[0]).await;
    let authorize = Transition::Authorize {
        by: "policy".to_string(),
    };
    let dispatch = Transition::Dispatch { attempt: 1 };
    if d[1] == Durability::Flushed {
        ledger.transition(id, authorize, t, d[1]).await.unwrap();
        ledger.transition(id, dispatch, t, d[2]).await.unwrap();
    } else {
        ledger
            .transitions(id, vec![authorize, dispatch], t, d[2])
            .await
            .unwrap();
    }
    let (done, result) = finished();
    ledger
        .transition_with_result(id, done, result, t, d[3])
        .await
        .unwrap();
    ledger
        .transition(id, Transition::Delivered, t, d[4])
        .await
        .unwrap();
    d.iter().filter(|d| **d == Durability::Flushed).count() as u64
}

/// Runs `tasks` concurrent lives for `budget`; returns lives/s and flushed writes/s.
async fn rate(
    ledger: Arc<dyn LedgerApi>,
    tasks: usize,
    budget: Duration,
    d: [Durability; 5],
) -> (f64, f64) {
    let start = Instant::now();
    let handles: Vec<_> = (0..tasks)
        .map(|task| {
            let ledger = ledger.clone();
            tokio::spawn(async move {
                let (mut lives, mut flushed) = (0u64, 0u64);
                while start.elapsed() < budget {
                    let n = task as u64 * 10_000_000 + lives;
                    flushed += one_life(ledger.as_ref(), n, d).await;
                    lives += 1;
                }
                (lives, flushed)
            })
        })
        .collect();
    let (mut lives, mut flushed) = (0, 0);
    for h in handles {
        let (l, f) = h.await.unwrap();
        lives += l;
        flushed += f;
    }
    let secs = start.elapsed().as_secs_f64();
    (lives as f64 / secs, flushed as f64 / secs)
}

#[tokio::main(flavor = "multi_thread")]
async fn main() {
    let budget = Duration::from_secs(
        std::env::var("BENCH_SECONDS")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(5),
    );
    use Durability::{Buffered as B, Flushed as F};
    println!(
        "{:<10} {:>11} {:>22} {:>18}",
        "backend", "concurrency", "durable transitions/s", "durable actions/s"
    );
    let mut table = Vec::new();
    for tasks in [1usize, 8, 32] {
        for kind in [Kind::Sled, Kind::Postgres] {
            let place = Place::new(kind, &format!("bench{tasks}"));
            let ledger = place.open("bench").await;
            let (_, transitions) = rate(ledger.clone(), tasks, budget, [F; 5]).await;
            let (actions, _) = rate(ledger, tasks, budget, [B, B, F, F, F]).await;
            println!(
                "{:<10} {:>11} {:>22.0} {:>18.0}",
                format!("{kind:?}"),
                tasks,
                transitions,
                actions
            );
            table.push((kind, tasks, transitions, actions));
        }
    }
    println!("\nPostgreSQL / sled (1.0 = as fast; the target is at least 0.5 per action at 32):");
    for tasks in [1usize, 8, 32] {
        let of = |k: Kind| {
            table
                .iter()
                .find(|r| r.0 == k && r.1 == tasks)
                .map(|r| (r.2, r.3))
                .unwrap()
        };
        let (s, p) = (of(Kind::Sled), of(Kind::Postgres));
        println!(
            "concurrency {tasks:>2}: transitions {:.2}, actions {:.2}",
            p.0 / s.0,
            p.1 / s.1
        );
    }
}
