//! A ledger that grows (issue 37): what a call reads does not grow with the ledger, and gc
//! removes what it kept only for executions that are gone.

mod common;

use common::*;
use waymark_core::Actor;
use waymark_gateway::flow::now;
use waymark_ledger::{Durability, Ledger};

/// Stops the daemon the way an operator does: what it recorded is on disk after.
fn stop_daemon(env: &Env) {
    let stop = env.run(&["daemon", "stop", "--wait"]);
    assert_eq!(stop.status.code(), Some(0), "{}", stderr(&stop));
}

/// `exec explain` once read the newest 10,000 agent runs to name each caller's process, so an
/// execution older than the last 10,000 runs was "from an unrecorded process". It reads each
/// caller's run by its id now; then gc removes the runs whose executions are all gone.
#[test]
fn explain_names_the_run_of_an_execution_older_than_ten_thousand_runs_and_gc_removes_runs() {
    let env = Env::builder().tools(APPEND_TOOL).build();
    let out = env.run(&["exec", "run", "append", "line=x", "secs=0"]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let id = ids_in(&out).into_iter().next().expect("an execution id");
    let explained = |env: &Env| {
        let out = env.run(&["exec", "explain", &id]);
        assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
        stdout(&out)
    };
    let before = explained(&env);
    assert!(
        before.contains("accepted: first call") && !before.contains("unrecorded process"),
        "{before}"
    );
    stop_daemon(&env);
    let fillers = 10_001;
    {
        let ledger = Ledger::open(&env.ledger_dir()).unwrap();
        let actor = Actor("uid:0".into());
        for _ in 0..fillers {
            let run = ledger
                .start_run(actor.clone(), "filler", now(), Durability::Buffered)
                .unwrap();
            ledger
                .end_run(&run.id, now(), Durability::Buffered)
                .unwrap();
        }
        ledger.flush().unwrap();
    }
    let after = explained(&env);
    assert!(
        !after.contains("unrecorded process"),
        "the caller's run was not found among {fillers} newer runs:\n{after}"
    );
    assert_eq!(
        before.lines().find(|l| l.contains("accepted: first call")),
        after.lines().find(|l| l.contains("accepted: first call")),
        "the caller's process is said the same way"
    );

    // `audit verify` through the daemon says how far it got, a page of events at a time (the
    // CLI shows it on a terminal).
    use waymark_protocol::{client, Event, Frame, Request};
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let mut seen = Vec::new();
    let verify = Request::AuditVerify {
        exported_head: None,
        since: None,
    };
    let frame = rt
        .block_on(client::request(&env.socket(), verify, |e| {
            if let Event::Progress { done, total, .. } = e {
                seen.push((*done, *total));
            }
        }))
        .unwrap();
    let Frame::Done { data, .. } = frame else {
        panic!("{frame:?}")
    };
    let events = data["events"].as_u64().unwrap();
    assert!(seen.len() >= 2, "{events} events and progress {seen:?}");
    assert!(seen.windows(2).all(|w| w[0].0 < w[1].0), "{seen:?}");
    assert_eq!(seen.last().copied(), Some((events, Some(events))));

    std::thread::sleep(std::time::Duration::from_millis(1100));
    let gc = env.run(&["--json", "gc", "--older-than", "1s"]);
    assert_eq!(gc.status.code(), Some(0), "{}", stderr(&gc));
    let v: serde_json::Value = serde_json::from_slice(&gc.stdout).unwrap();
    assert_eq!(v["removed"], 1, "{v}");
    // Every filler, and the runs of the calls before this gc; not the gc's own.
    let removed = v["removed_runs"].as_u64().unwrap();
    assert!(removed >= fillers, "{v}");
    let runs = env.run(&["--json", "runs"]);
    let runs: serde_json::Value = serde_json::from_slice(&runs.stdout).unwrap();
    let left = runs["items"].as_array().unwrap();
    assert!(left.len() <= 3, "runs left after gc: {runs}");
    assert_eq!(env.run(&["audit", "verify"]).status.code(), Some(0));
}

/// Bytes of the files under `dir`.
fn size_of(dir: &std::path::Path) -> u64 {
    std::fs::read_dir(dir)
        .unwrap()
        .flatten()
        .map(|e| {
            if e.file_type().unwrap().is_dir() {
                size_of(&e.path())
            } else {
                e.metadata().unwrap().len()
            }
        })
        .sum()
}

/// sled never gives a file's space back: after a gc the ledger is as large as before.
/// `ledger compact` (daemon stopped) copies what is left into a new database; the ledger is
/// the same one after (same chain, same executions, a daemon serves it) and much smaller.
#[test]
fn compact_gives_back_the_space_gc_freed_and_the_ledger_stays_the_same() {
    let env = Env::builder().tools(APPEND_TOOL).build();
    let out = env.run(&["exec", "run", "append", "line=x", "secs=0"]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    stop_daemon(&env);
    {
        let ledger = Ledger::open(&env.ledger_dir()).unwrap();
        let actor = Actor("uid:0".into());
        let note = serde_json::json!({ "padding": "x".repeat(2000) });
        for _ in 0..5_000 {
            let run = ledger
                .start_run(actor.clone(), "filler", now(), Durability::Buffered)
                .unwrap();
            ledger
                .record_note(None, "filler", note.clone(), now(), Durability::Buffered)
                .unwrap();
            ledger
                .end_run(&run.id, now(), Durability::Buffered)
                .unwrap();
        }
        ledger.flush().unwrap();
    }
    std::thread::sleep(std::time::Duration::from_millis(1100));
    let gc = env.run(&["--json", "gc", "--older-than", "1s"]);
    assert_eq!(gc.status.code(), Some(0), "{}", stderr(&gc));
    let v: serde_json::Value = serde_json::from_slice(&gc.stdout).unwrap();
    assert_eq!(v["removed"], 1, "{v}");
    // One made after the gc: it stays.
    let out = env.run(&["exec", "run", "append", "line=y", "secs=0"]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let id = ids_in(&out).into_iter().next().expect("an execution id");

    // The daemon owns the ledger: refused, nothing changed.
    let refused = env.run(&["ledger", "compact"]);
    assert_ne!(refused.status.code(), Some(0));
    assert!(
        stderr(&refused).contains("stop the daemon before compacting"),
        "{}",
        stderr(&refused)
    );
    let out = env.run(&["--json", "audit", "head"]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let head: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let head = format!("{}:{}", head["seq"], head["hash"].as_str().unwrap());
    stop_daemon(&env);
    let db = env.ledger_dir().join("db");
    let before = size_of(&db);
    let out = env.run(&["--json", "ledger", "compact"]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let after = size_of(&db);
    assert_eq!(v["before_bytes"], before, "{v}");
    assert_eq!(v["after_bytes"], after, "{v}");
    assert!(
        after * 4 < before,
        "compacting a ledger gc emptied left {after} of {before} bytes"
    );
    let left: Vec<String> = std::fs::read_dir(env.ledger_dir())
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("db."))
        .collect();
    assert!(left.is_empty(), "left beside the ledger: {left:?}");

    // The same ledger: the daemon serves it, its chain still reaches the head it had, the
    // execution answers.
    let verify = env.run(&["audit", "verify", "--head", &head]);
    assert_eq!(verify.status.code(), Some(0), "{}", stdout(&verify));
    // And from that head on alone (`--since`): only the events after it.
    let since = env.run(&["audit", "verify", "--since", &head]);
    assert_eq!(since.status.code(), Some(0), "{}", stderr(&since));
    let seq = head.split(':').next().unwrap();
    assert!(
        stdout(&since).contains(&format!("from the given head {seq} to head")),
        "{}",
        stdout(&since)
    );
    let status = env.run(&["exec", "status", &id]);
    assert_eq!(status.status.code(), Some(0), "{}", stderr(&status));
}
