//! Tampering with the audit chain on disk, and what `verify` says about it.

mod common;
#[path = "common/raw.rs"]
mod raw;

use std::path::{Path, PathBuf};

use common::{accept, now};
use raw::raw_sled;
use waymark_core::Transition;
use waymark_ledger::{ChainBreak, ChainHead, ChainProblem, Durability, Ledger, LedgerError};

/// A ledger with 3 executions × 3 events = events 1..=9; returns its head.
fn build(path: &Path) -> ChainHead {
    let ledger = Ledger::init(path).unwrap();
    for i in 0..3 {
        let t = now();
        let id = accept(&ledger, &format!("v{i}"), t, Durability::Buffered).id;
        let authorize = Transition::Authorize {
            by: "policy".into(),
        };
        ledger
            .transition(id, authorize, t, Durability::Buffered)
            .unwrap();
        let dispatch = Transition::Dispatch { attempt: 1 };
        ledger
            .transition(id, dispatch, t, Durability::Flushed)
            .unwrap();
    }
    ledger.head()
}

/// A built ledger in a temporary directory: the guard, its path, its head.
fn built() -> (tempfile::TempDir, PathBuf, ChainHead) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("l");
    let head = build(&path);
    (dir, path, head)
}

/// Opens sled directly, as an attacker with file access would, and edits the events tree.
fn tamper(path: &Path, f: impl FnOnce(&sled::Tree, &sled::Tree)) {
    let db = raw_sled(path);
    let events = db.open_tree("events").unwrap();
    let meta = db.open_tree("meta").unwrap();
    f(&events, &meta);
    db.flush().unwrap();
}

/// Where `verify` (with no exported head) finds the chain broken after `edit` on a built one.
fn broken_after(edit: impl FnOnce(&sled::Tree, &sled::Tree)) -> ChainBreak {
    let (_dir, path, _) = built();
    tamper(&path, edit);
    verify(&path, None).broken.expect("the edit is detected")
}

fn key(seq: u64) -> [u8; 8] {
    seq.to_be_bytes()
}

fn verify(path: &Path, exported: Option<&ChainHead>) -> waymark_ledger::VerifyReport {
    Ledger::init(path).unwrap().verify(exported).unwrap()
}

#[test]
fn an_untouched_chain_verifies_from_genesis() {
    let (_dir, path, head) = built();
    assert_eq!(head.seq, 9);
    let report = verify(&path, Some(&head));
    assert!(report.is_ok(), "{:?}", report.broken);
    assert_eq!(report.events, 9);
    assert_eq!(report.head, head);
}

#[test]
fn an_edited_event_is_named_with_its_sequence_number() {
    let b = broken_after(|events, _| {
        let v = events.get(key(5)).unwrap().unwrap();
        let text = String::from_utf8(v.to_vec())
            .unwrap()
            .replace("policy", "attacker");
        assert!(text.contains("attacker"));
        events.insert(key(5), text.as_bytes()).unwrap();
    });
    assert_eq!((b.seq, b.problem), (5, ChainProblem::Edited));
}

#[test]
fn a_removed_event_is_a_gap() {
    let b = broken_after(|events, _| {
        events.remove(key(4)).unwrap();
    });
    assert_eq!(b.seq, 4);
    assert_eq!(
        b.problem,
        ChainProblem::Gap {
            expected: 4,
            found: 5
        }
    );
    assert!(b.to_string().contains("event 4 is missing"), "{b}");
}

#[test]
fn swapped_events_are_reordered() {
    let b = broken_after(|events, _| {
        let a = events.get(key(3)).unwrap().unwrap();
        let b = events.get(key(6)).unwrap().unwrap();
        events.insert(key(3), b).unwrap();
        events.insert(key(6), a).unwrap();
    });
    assert_eq!(b.seq, 3);
    assert!(matches!(b.problem, ChainProblem::Reordered { .. }), "{b}");
}

#[test]
fn a_rewritten_sequence_field_is_caught_as_an_edit_or_reorder() {
    // Delete event 2 and renumber the rest down by one: no gap left in the keys.
    let b = broken_after(|events, _| {
        for seq in 2..9 {
            let next = events.get(key(seq + 1)).unwrap().unwrap();
            events.insert(key(seq), next).unwrap();
        }
        events.remove(key(9)).unwrap();
    });
    assert_eq!(b.seq, 2);
    assert!(matches!(b.problem, ChainProblem::Reordered { .. }), "{b}");
}

#[test]
fn truncation_before_an_exported_head_is_detected() {
    let (_dir, path, exported) = built();
    // The attacker cuts the last three events and rewinds the stored head to match.
    tamper(&path, |events, meta| {
        let six: serde_json::Value =
            serde_json::from_slice(&events.get(key(6)).unwrap().unwrap()).unwrap();
        for seq in 7..=9 {
            events.remove(key(seq)).unwrap();
        }
        let head = serde_json::json!({ "seq": 6, "hash": six["hash"] });
        meta.insert("chain_head", serde_json::to_vec(&head).unwrap())
            .unwrap();
    });
    // The witness beside the database saw event 9 made durable.
    let err = Ledger::open(&path).err().expect("behind its witness");
    assert!(
        matches!(
            err,
            LedgerError::BehindWitness {
                head: 6,
                witness: 9,
                ..
            }
        ),
        "{err}"
    );
    // An attacker who removes the witness too leaves a chain consistent by itself: only the
    // exported head can tell.
    std::fs::remove_file(path.join("head.witness")).unwrap();
    assert!(verify(&path, None).is_ok());
    let b = verify(&path, Some(&exported))
        .broken
        .expect("truncation detected");
    assert_eq!(b.problem, ChainProblem::Truncated { last: 6, head: 9 });
    assert!(b.to_string().contains("truncated"), "{b}");
}

#[test]
fn truncation_without_rewinding_the_head_is_detected_without_an_export() {
    let b = broken_after(|events, _| {
        events.remove(key(9)).unwrap();
    });
    assert_eq!(b.problem, ChainProblem::Truncated { last: 8, head: 9 });
}

#[test]
fn an_exported_head_that_names_another_event_is_divergence() {
    let (_dir, path, head) = built();
    let forged = ChainHead {
        seq: 5,
        hash: head.hash.clone(),
    };
    let b = verify(&path, Some(&forged))
        .broken
        .expect("divergence detected");
    assert_eq!((b.seq, b.problem), (5, ChainProblem::DivergedFromHead));
}

#[test]
fn a_head_exports_and_parses_as_text() {
    let (_dir, _, head) = built();
    let text = head.to_string();
    assert_eq!(text.parse::<ChainHead>().unwrap(), head);
    assert!("9:xyz".parse::<ChainHead>().is_err());
}

#[test]
fn a_damaged_event_is_named_with_its_sequence_number_not_a_storage_error() {
    let (_dir, path, _) = built();
    tamper(&path, |events, _| {
        events
            .insert(key(6), &b"\x00\x9f not an event"[..])
            .unwrap();
    });
    let report = Ledger::init(&path)
        .unwrap()
        .verify(None)
        .expect("a report, not a bare storage error");
    let b = report.broken.expect("damage detected");
    assert_eq!(b.seq, 6, "{b:?}");
    assert!(
        matches!(b.problem, ChainProblem::Unreadable { .. }),
        "{:?}",
        b.problem
    );
    assert_eq!(report.events, 5, "the events before it verified");
}
