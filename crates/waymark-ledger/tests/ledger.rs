//! The sled ledger against a real database on disk: what only sled has (its files, its lock,
//! its flushes, its retention of the chain). What every backend does is in
//! `waymark-ledger-pg/tests/both_backends.rs`, run on sled and on PostgreSQL.

mod common;
#[path = "common/raw.rs"]
mod raw;

use std::os::unix::fs::PermissionsExt;
use std::sync::Arc;

use common::{accept, exited, fresh, new_execution, now, request, walk_to_completion};
use raw::raw_sled;
use waymark_core::{ExecState, ExecutionId, Timestamp, Transition};
use waymark_ledger::{
    CapturedOutput, ChainHead, ChainProblem, Durability, Ledger, LedgerError, ListQuery,
    StoredResult,
};

/// `n` executions accepted at `at`, completed and delivered: what retention removes.
fn delivered_executions(ledger: &Ledger, n: usize, at: Timestamp) -> Vec<ExecutionId> {
    (0..n)
        .map(|i| {
            let id = accept(ledger, &format!("old{i}"), at, Durability::Buffered).id;
            walk_to_completion(ledger, id, at);
            ledger
                .transition(id, Transition::Delivered, at, Durability::Buffered)
                .unwrap();
            id
        })
        .collect()
}

/// Every file and directory below `dir`.
fn everything_below(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                stack.push(p.clone());
            }
            out.push(p);
        }
    }
    out
}

#[test]
fn illegal_transition_is_rejected_and_changes_nothing() {
    let (_dir, ledger) = fresh();
    let t = now();
    let id = accept(&ledger, "v1", t, Durability::Flushed).id;
    let head = ledger.head();
    let err = ledger
        .transition(
            id,
            Transition::Dispatch { attempt: 1 },
            t,
            Durability::Flushed,
        )
        .unwrap_err();
    assert!(matches!(err, LedgerError::Illegal { .. }), "{err}");
    assert!(
        err.to_string()
            .contains("illegal transition `dispatch` from state `accepted`"),
        "{err}"
    );
    assert_eq!(ledger.head(), head, "no event was appended");
    assert_eq!(
        ledger.get(id).unwrap().unwrap().state(),
        ExecState::Accepted
    );
    let dup = ledger.get(id).unwrap().unwrap();
    let again = waymark_ledger::NewExecution {
        id,
        fingerprint: dup.fingerprint,
        action: dup.action,
        actor: dup.actor,
        scope: dup.scope,
        tool: dup.tool,
        host: dup.host,
        contract: dup.contract,
        run: None,
        mask: Vec::new(),
    };
    assert!(matches!(
        ledger.accept(again, t, Durability::Flushed),
        Err(LedgerError::Duplicate(_))
    ));
}

#[test]
fn fingerprint_index_lists_newest_first() {
    let (_dir, ledger) = fresh();
    let mut ids = Vec::new();
    for i in 0..3 {
        let t = Timestamp::from_millis(now().as_millis() + i);
        ids.push(accept(&ledger, "v1", t, Durability::Buffered).id);
    }
    let fp = ledger.get(ids[0]).unwrap().unwrap().fingerprint;
    accept(&ledger, "v2", now(), Durability::Buffered);
    let found: Vec<_> = ledger
        .by_fingerprint(&fp)
        .unwrap()
        .into_iter()
        .map(|r| r.id)
        .collect();
    ids.reverse();
    assert_eq!(found, ids);
}

#[test]
fn concurrent_flushed_transitions_share_flushes() {
    let (_dir, ledger) = fresh();
    let ledger = Arc::new(ledger);
    let threads = 16;
    let per_thread = 20;
    let before = ledger.flush_count();
    std::thread::scope(|s| {
        for n in 0..threads {
            let ledger = ledger.clone();
            s.spawn(move || {
                for i in 0..per_thread {
                    accept(&ledger, &format!("{n}-{i}"), now(), Durability::Flushed);
                }
            });
        }
    });
    let flushes = ledger.flush_count() - before;
    let writes = (threads * per_thread) as u64;
    assert_eq!(ledger.head().seq, writes);
    assert!(
        flushes < writes,
        "group commit shared no flush: {flushes} flushes for {writes} writes"
    );
    assert!(ledger.verify(None).unwrap().is_ok());
}

/// The daemon's metrics hear of every flush the ledger makes, once, with its duration; a
/// buffered write alone is no flush.
#[test]
fn the_flush_observer_is_told_each_flush_once() {
    let dir = tempfile::tempdir().unwrap();
    let told = Arc::new(std::sync::Mutex::new(Vec::new()));
    let options = waymark_ledger::LedgerOptions {
        on_flush: Some(waymark_ledger::FlushObserver({
            let told = told.clone();
            Arc::new(move |d| told.lock().unwrap().push(d))
        })),
        ..Default::default()
    };
    let ledger = Arc::new(Ledger::init_with(&dir.path().join("l"), options).unwrap());
    accept(&ledger, "buffered", now(), Durability::Buffered);
    assert_eq!(told.lock().unwrap().len(), 0);
    std::thread::scope(|s| {
        for n in 0..8 {
            let ledger = ledger.clone();
            s.spawn(move || {
                for i in 0..10 {
                    accept(&ledger, &format!("{n}-{i}"), now(), Durability::Flushed);
                }
            });
        }
    });
    let told = told.lock().unwrap();
    assert_eq!(told.len() as u64, ledger.flush_count());
    assert!(!told.is_empty() && told.len() <= 80, "{}", told.len());
}

#[test]
fn files_are_private() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ledger");
    {
        let ledger = Ledger::init(&path).unwrap();
        let t = now();
        let id = accept(&ledger, "v1", t, Durability::Flushed).id;
        walk_to_completion(&ledger, id, t);
    }
    let mode = |p: &std::path::Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode(&path), 0o700);
    assert_eq!(mode(&path.join("ledger.key")), 0o600);
    let mut files = 0;
    for p in everything_below(&path) {
        if p.is_dir() {
            assert_eq!(mode(&p), 0o700, "{}", p.display());
        } else {
            assert_eq!(mode(&p), 0o600, "{}", p.display());
            files += 1;
        }
    }
    assert!(files >= 3, "key, identity and sled's files");
}

#[test]
fn canary_secrets_never_reach_the_ledger_directory() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ledger");
    let canaries = ["CANARY-3f9d2c71-secret", "pässwörd-CANARY-ü-42"];
    {
        let ledger = Ledger::init(&path).unwrap();
        for (i, canary) in canaries.iter().enumerate() {
            let t = now();
            let req = request("deploy", &format!("v{i}"), canary);
            let new = new_execution(&ledger, &req, "web1", t);
            let id = new.id;
            assert!(
                req.exposed_argv(id).iter().any(|a| a.contains(canary)),
                "the host would get it"
            );
            ledger.accept(new, t, Durability::Flushed).unwrap();
            walk_to_completion(&ledger, id, t);
            ledger
                .transition(id, Transition::Delivered, t, Durability::Flushed)
                .unwrap();
        }
        ledger.flush().unwrap();
    }
    let mut scanned = 0;
    for p in everything_below(&path).into_iter().filter(|p| !p.is_dir()) {
        let bytes = std::fs::read(&p).unwrap();
        scanned += bytes.len();
        for canary in canaries {
            let found = bytes.windows(canary.len()).any(|w| w == canary.as_bytes());
            assert!(!found, "canary {canary:?} found in {}", p.display());
        }
    }
    assert!(scanned > 0);
    // The canonical record kept a MAC instead, so the fingerprint still tells secrets apart.
    let ledger = Ledger::init(&path).unwrap();
    let page = ledger.list(&ListQuery::default()).unwrap();
    assert!(page
        .items
        .iter()
        .all(|r| r.action.as_str().contains("\"secret\":\"password\"")));
}

#[test]
fn a_second_open_is_refused_as_locked_and_points_at_the_daemon() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("l");
    let _first = Ledger::init(&path).unwrap();
    let err = Ledger::init(&path).err().expect("second open must fail");
    assert!(matches!(err, LedgerError::Locked { .. }), "{err}");
    let text = err.to_string();
    assert!(
        text.contains("locked by another process") && text.contains("daemon"),
        "{text}"
    );
    assert!(text.contains(&path.display().to_string()), "{text}");
}

#[test]
fn a_foreign_directory_is_refused_by_name() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("notes.txt"), "my files").unwrap();
    let err = Ledger::init(dir.path()).err().expect("must refuse");
    assert!(matches!(err, LedgerError::Foreign { .. }), "{err}");
    assert!(err.to_string().contains(&dir.path().display().to_string()));
    assert_eq!(
        std::fs::read_to_string(dir.path().join("notes.txt")).unwrap(),
        "my files"
    );
    let file = dir.path().join("notes.txt");
    assert!(matches!(
        Ledger::init(&file),
        Err(LedgerError::Foreign { .. })
    ));
}

#[test]
fn corrupted_files_give_a_clear_error_naming_the_path() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("l");
    {
        let ledger = Ledger::init(&path).unwrap();
        accept(&ledger, "v1", now(), Durability::Flushed);
    }
    // A damaged key file.
    std::fs::write(path.join("ledger.key"), "not hex").unwrap();
    let err = Ledger::init(&path).err().expect("bad key");
    assert!(matches!(err, LedgerError::Corrupt { .. }), "{err}");
    assert!(err.to_string().contains("ledger.key"), "{err}");
    // A damaged identity file.
    let dir2 = tempfile::tempdir().unwrap();
    let p2 = dir2.path().join("l");
    drop(Ledger::init(&p2).unwrap());
    std::fs::write(p2.join("LEDGER"), "something else").unwrap();
    assert!(matches!(
        Ledger::init(&p2),
        Err(LedgerError::Corrupt { .. })
    ));
    // sled's own files overwritten with garbage: an error, never a panic.
    let dir3 = tempfile::tempdir().unwrap();
    let p3 = dir3.path().join("l");
    drop(Ledger::init(&p3).unwrap());
    for name in ["conf", "db"] {
        let f = p3.join("db").join(name);
        if f.exists() {
            std::fs::write(&f, vec![0xA5u8; 4096]).unwrap();
        }
    }
    let outcome = std::panic::catch_unwind(|| Ledger::init(&p3).map(|_| ()));
    match outcome {
        Ok(Err(e)) => {
            eprintln!("corrupted sled files: {e}");
            assert!(e.to_string().contains(&p3.display().to_string()), "{e}")
        }
        Ok(Ok(())) => panic!("garbage sled files opened as a ledger"),
        Err(_) => panic!("opening a corrupted ledger panicked"),
    }
}

#[test]
fn gc_keeps_unresolved_executions_and_a_verifiable_chain() {
    let (_dir, ledger) = fresh();
    let old = Timestamp::from_millis(now().as_millis() - 3_600_000);
    let done = delivered_executions(&ledger, 5, old);
    // Old but unresolved: completed, result not delivered; and one lost in flight.
    let undelivered_id = accept(&ledger, "undelivered", old, Durability::Buffered).id;
    walk_to_completion(&ledger, undelivered_id, old);
    let lost_id = accept(&ledger, "lost", old, Durability::Buffered).id;
    let lost = Transition::Lost {
        reason: "reset".into(),
    };
    for tr in [
        Transition::Authorize { by: "p".into() },
        Transition::Dispatch { attempt: 1 },
        lost,
    ] {
        ledger
            .transition(lost_id, tr, old, Durability::Buffered)
            .unwrap();
    }
    let recent_id = accept(&ledger, "recent", now(), Durability::Flushed).id;
    let head_before = ledger.head();

    let report = ledger
        .gc(Timestamp::from_millis(now().as_millis() - 60_000), now())
        .unwrap();
    assert_eq!(report.removed_executions, 5);
    // The old ones it kept: undelivered and lost (the recent one is not gc's to count).
    assert_eq!(report.kept_unresolved, 2);
    for id in &done {
        assert!(ledger.get(*id).unwrap().is_none());
        assert!(ledger.result(*id).unwrap().is_none());
    }
    for id in [undelivered_id, lost_id, recent_id] {
        assert!(ledger.get(id).unwrap().is_some());
    }
    assert_eq!(
        ledger.get(lost_id).unwrap().unwrap().state(),
        ExecState::Unknown
    );
    let pruned = report
        .pruned_events_through
        .expect("the old, resolved prefix is pruned");
    assert!(pruned >= 5 * 5, "events of the five removed executions");
    let verify = ledger.verify(Some(&head_before)).unwrap();
    assert!(verify.is_ok(), "{:?}", verify.broken);
    assert_eq!(verify.base.seq, pruned);
    assert!(ledger.events(1, 10).unwrap().first().unwrap().seq > pruned);
    // An exported head from before the base cannot be checked against what is left: it is
    // never "OK", whatever its hash says.
    let forged = ChainHead {
        seq: pruned - 3,
        hash: "f".repeat(64),
    };
    let v = ledger.verify(Some(&forged)).unwrap();
    assert_eq!(
        v.broken.map(|b| b.problem),
        Some(ChainProblem::HeadBeforeRetention {
            head: pruned - 3,
            base: pruned
        })
    );
    // A head at the base is checked against the checkpoint that names it.
    let at_base = ChainHead {
        seq: pruned,
        hash: "f".repeat(64),
    };
    let v = ledger.verify(Some(&at_base)).unwrap();
    assert_eq!(
        v.broken.map(|b| b.problem),
        Some(ChainProblem::DivergedFromHead)
    );
    assert!(ledger.verify(Some(&verify.base)).unwrap().is_ok());
    // A second gc with nothing to remove keeps it verifiable too.
    ledger
        .gc(Timestamp::from_millis(now().as_millis() - 60_000), now())
        .unwrap();
    assert!(ledger.verify(None).unwrap().is_ok());
}

#[test]
fn gc_sweeps_events_an_interrupted_run_left_below_the_base() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("l");
    let old = Timestamp::from_millis(now().as_millis() - 3_600_000);
    let cutoff = || Timestamp::from_millis(now().as_millis() - 60_000);
    let base = {
        let ledger = Ledger::init(&path).unwrap();
        delivered_executions(&ledger, 3, old);
        let report = ledger.gc(cutoff(), now()).unwrap();
        report.pruned_events_through.expect("a prefix is pruned")
    };
    // A run that died after moving the base but before removing the events behind it.
    {
        let events = raw_sled(&path).open_tree("events").unwrap();
        let (_, checkpoint) = events.last().unwrap().unwrap();
        events.insert((base - 1).to_be_bytes(), checkpoint).unwrap();
        events.flush().unwrap();
    }
    {
        let ledger = Ledger::init(&path).unwrap();
        assert!(
            ledger.verify(None).unwrap().is_ok(),
            "verify ignores leftovers"
        );
        let report = ledger.gc(cutoff(), now()).unwrap();
        assert_eq!(report.pruned_events_through, None, "nothing new to prune");
        assert!(ledger.verify(None).unwrap().is_ok());
    }
    let events = raw_sled(&path).open_tree("events").unwrap();
    let left = events.range(..=base.to_be_bytes()).count();
    assert_eq!(left, 0, "the leftover below the base is swept");
}

#[test]
fn reopening_keeps_everything_and_the_chain_continues() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("l");
    let (id, head) = {
        let ledger = Ledger::init(&path).unwrap();
        let id = accept(&ledger, "v1", now(), Durability::Flushed).id;
        (id, ledger.head())
    };
    let ledger = Ledger::init(&path).unwrap();
    assert_eq!(ledger.head(), head);
    assert_eq!(
        ledger.get(id).unwrap().unwrap().state(),
        ExecState::Accepted
    );
    walk_to_completion(&ledger, id, now());
    assert_eq!(ledger.head().seq, head.seq + 4);
    assert!(ledger.verify(Some(&head)).unwrap().is_ok());
}

#[test]
fn large_output_is_capped_by_reference_and_never_becomes_an_unsynced_blob() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("l");
    let options = waymark_ledger::LedgerOptions {
        result_cap: 256 * 1024,
        ..Default::default()
    };
    let ledger = Ledger::init_with(&path, options).unwrap();
    let t = now();
    let id = accept(&ledger, "big", t, Durability::Flushed).id;
    for tr in [
        Transition::Authorize { by: "p".into() },
        Transition::Dispatch { attempt: 1 },
    ] {
        ledger.transition(id, tr, t, Durability::Flushed).unwrap();
    }
    let full: Vec<u8> = (0..300_000u32).map(|i| (i % 251) as u8).collect();
    let result = StoredResult {
        stdout: CapturedOutput::capture(&full, usize::MAX),
        stderr: CapturedOutput::capture(&full[..10], usize::MAX),
    };
    ledger
        .transition_with_result(id, exited(0), result, t, Durability::Flushed)
        .unwrap();
    let stored = ledger.result(id).unwrap().unwrap();
    assert_eq!(
        stored.stdout.head,
        &full[..256 * 1024],
        "capped at the ledger's result cap"
    );
    assert_eq!(stored.stdout.total_bytes, 300_000);
    assert!(stored.stdout.truncated());
    assert_eq!(
        stored.stdout.sha256,
        CapturedOutput::capture(&full, 0).sha256,
        "hash of all of it"
    );
    assert_eq!(stored.stderr.head, &full[..10]);
    assert!(!stored.stderr.truncated());
    let blobs = path.join("db").join("blobs");
    let count = std::fs::read_dir(&blobs).map(|d| d.count()).unwrap_or(0);
    assert_eq!(count, 0, "sled wrote blob files, which it never fsyncs");
}

/// A loss's reason belongs to the unknown state it explains: once the outcome is known, the
/// record no longer says "its output could not be fetched" (issue 36, part 5).
#[test]
fn a_loss_reason_is_cleared_once_the_outcome_is_known() {
    let (_dir, ledger) = fresh();
    let t = now();
    let id = accept(&ledger, "v1", t, Durability::Flushed).id;
    for tr in [
        Transition::Authorize { by: "p".into() },
        Transition::Dispatch { attempt: 1 },
        Transition::Lost {
            reason: "it ended on the host, but its output could not be fetched".into(),
        },
    ] {
        ledger.transition(id, tr, t, Durability::Flushed).unwrap();
    }
    assert!(ledger.get(id).unwrap().unwrap().reason.is_some());
    let done = ledger
        .transition(
            id,
            Transition::Finished {
                outcome: waymark_core::Outcome::Exited {
                    exit_code: Some(0),
                    signal: None,
                },
            },
            t,
            Durability::Flushed,
        )
        .unwrap();
    assert_eq!(done.state(), ExecState::Completed);
    assert_eq!(
        done.reason, None,
        "a completed execution kept its loss's reason"
    );
    // A denial's reason stays: it is the outcome.
    let denied = accept(&ledger, "v2", t, Durability::Flushed).id;
    let rec = ledger
        .transition(
            denied,
            Transition::Deny {
                by: "op".into(),
                reason: "not now".into(),
            },
            t,
            Durability::Flushed,
        )
        .unwrap();
    assert_eq!(rec.reason.as_deref(), Some("not now"));
}

/// Issue 32: `open` never makes a ledger: a missing directory and an empty one (an unmounted
/// volume) are refused as missing, and stay as they were; a ledger whose database went missing
/// is damaged, not new. Only `init` makes one.
#[test]
fn open_never_makes_a_ledger_only_init_does() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("gone/l");
    let err = Ledger::open(&path).err().expect("missing");
    assert!(matches!(err, LedgerError::Missing { .. }), "{err}");
    assert!(err.to_string().contains("waymark init"), "{err}");
    assert!(!dir.path().join("gone").exists());
    std::fs::create_dir_all(&path).unwrap();
    let err = Ledger::open(&path).err().expect("empty");
    assert!(matches!(err, LedgerError::Missing { .. }), "{err}");
    assert_eq!(std::fs::read_dir(&path).unwrap().count(), 0);
    drop(Ledger::init(&path).unwrap());
    drop(Ledger::open(&path).unwrap());
    std::fs::remove_dir_all(path.join("db")).unwrap();
    let err = Ledger::open(&path).err().expect("no database");
    assert!(
        matches!(err, LedgerError::Corrupt { .. }) && err.to_string().contains("db is missing"),
        "{err}"
    );
    assert!(!path.join("db").exists(), "no fresh database was made");
}

/// Issue 32: the witness names a head that was flushed, never one still in sled's buffers, and
/// follows every flush.
#[test]
fn the_witness_follows_flushes_and_never_runs_ahead() {
    let (dir, ledger) = fresh();
    let witness = || -> Option<ChainHead> {
        let text = std::fs::read_to_string(ledger.dir().join("head.witness")).ok()?;
        Some(serde_json::from_str(text.trim()).unwrap())
    };
    let first = ledger
        .record_note(None, "a", serde_json::json!({}), now(), Durability::Flushed)
        .unwrap();
    assert_eq!(witness().map(|w| w.seq), Some(first));
    let buffered = ledger
        .record_note(
            None,
            "b",
            serde_json::json!({}),
            now(),
            Durability::Buffered,
        )
        .unwrap();
    assert_eq!(
        witness().map(|w| w.seq),
        Some(first),
        "a buffered write is not witnessed"
    );
    ledger.flush().unwrap();
    assert_eq!(witness(), Some(ledger.head()));
    assert_eq!(ledger.head().seq, buffered);
    drop(dir);
}

/// Issue 37: `exec list --tool/--host/--actor` reads an index, not every execution, and a
/// ledger recorded before that index gets it at its first open. An unreadable record of
/// another tool proves the read: a scan would parse it and fail, the index never reaches it.
#[test]
fn a_list_by_tool_reads_its_index_which_a_ledger_made_without_it_gets_at_open() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("l");
    let t = now();
    let (deploys, other) = {
        let ledger = Ledger::init(&path).unwrap();
        let deploys: Vec<ExecutionId> = (0..5)
            .map(|i| accept(&ledger, &format!("v{i}"), t, Durability::Buffered).id)
            .collect();
        let req = request("rollback", "v0", "pw");
        let other = new_execution(&ledger, &req, "web2", t);
        let other = ledger.accept(other, t, Durability::Flushed).unwrap().id;
        (deploys, other)
    };
    // As a ledger of the version before the index: no keys, no mark.
    {
        let db = raw_sled(&path);
        db.open_tree("by_attr").unwrap().clear().unwrap();
        db.open_tree("meta").unwrap().remove("index:attrs").unwrap();
        db.flush().unwrap();
    }
    let by = |ledger: &Ledger, q: ListQuery| -> Vec<ExecutionId> {
        let mut ids: Vec<ExecutionId> = ledger
            .list(&q)
            .unwrap()
            .items
            .iter()
            .map(|r| r.id)
            .collect();
        ids.sort();
        ids
    };
    {
        let ledger = Ledger::open(&path).unwrap();
        let tool = |t: &str| ListQuery {
            tool: Some(t.into()),
            ..ListQuery::default()
        };
        assert_eq!(by(&ledger, tool("deploy")), deploys);
        assert_eq!(by(&ledger, tool("rollback")), [other]);
        let host = ListQuery {
            host: Some("web2".into()),
            ..ListQuery::default()
        };
        assert_eq!(by(&ledger, host), [other]);
    }
    // The other tool's record made unreadable: a list by tool never reads it.
    {
        let db = raw_sled(&path);
        db.open_tree("executions")
            .unwrap()
            .insert(other.to_bytes(), b"not a record".to_vec())
            .unwrap();
        db.flush().unwrap();
    }
    let ledger = Ledger::open(&path).unwrap();
    let deploy = ListQuery {
        tool: Some("deploy".into()),
        ..ListQuery::default()
    };
    assert_eq!(by(&ledger, deploy), deploys);
    let everything = ledger.list(&ListQuery::default());
    assert!(everything.is_err(), "a scan reads the damaged record");
}
