//! The one write path: every change to sled is one transaction staged under the writer lock.
//! One test reads the crate's source for sled mutations outside that transaction; the other
//! races call counts, retention and transitions and checks that nothing is left inconsistent.

mod common;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};

use common::{new_execution, now, request, walk_to_completion};
use waymark_core::{Actor, ExecState, ExecutionId, Timestamp, Transition};
use waymark_ledger::{Durability, EventKind, Ledger, ListQuery};

/// Calls that change a sled tree or database. Any of them outside `commit_batch` is a second
/// write path.
const SLED_MUTATORS: &[&str] = &[
    ".insert(",
    ".remove(",
    ".apply_batch(",
    ".import(",
    "sled::Batch",
    ".transaction(",
    ".compare_and_swap(",
    ".fetch_and_update(",
    ".update_and_fetch(",
    ".merge(",
    ".set_merge_operator(",
    ".clear(",
    ".drop_tree(",
    ".pop_min(",
    ".pop_max(",
    ".import(",
];

/// Lines that match a mutator's name but change no sled tree.
const NOT_SLED: &[(&str, &str)] = &[
    ("chain.rs", "map.remove(\"hash\");"),
    // `ledger compact` fills a new database, never the ledger's own (which it only reads).
    ("compact.rs", "copy.import(self.db.export());"),
];

fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            sources(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// One file of the crate's `src`.
struct Source {
    /// Its path below `src`.
    name: String,
    text: String,
    /// `text` with literals and comments blanked ([`code_only`]).
    code: String,
}

impl Source {
    /// Where byte `at` of the code is: `name:line: the line`.
    fn place(&self, at: usize) -> String {
        let n = self.code[..at].matches('\n').count() + 1;
        let line = self.text.lines().nth(n - 1).unwrap().trim();
        format!("{}:{n}: {line}", self.name)
    }
}

fn crate_sources() -> Vec<Source> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    sources(&src, &mut files);
    files
        .iter()
        .map(|file| {
            let text = std::fs::read_to_string(file).unwrap();
            Source {
                name: file.strip_prefix(&src).unwrap().display().to_string(),
                code: code_only(&text),
                text,
            }
        })
        .collect()
}

/// The source with string and char literals and comments blanked, so braces count as code.
fn code_only(text: &str) -> String {
    let chars: Vec<char> = text.chars().collect();
    let mut out = String::with_capacity(text.len());
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        if c == '/' && chars.get(i + 1) == Some(&'/') {
            while i < chars.len() && chars[i] != '\n' {
                out.push(' ');
                i += 1;
            }
        } else if c == '"' {
            out.push('"');
            i += 1;
            while i < chars.len() && chars[i] != '"' {
                if chars[i] == '\\' {
                    out.push(' ');
                    i += 1;
                }
                out.push(if chars[i] == '\n' { '\n' } else { ' ' });
                i += 1;
            }
            out.push('"');
            i += 1;
        } else if c == '\'' && (chars.get(i + 2) == Some(&'\'') || chars.get(i + 1) == Some(&'\\'))
        {
            // A char literal ('{', '\n'), not a lifetime.
            let end = (i + 1..chars.len()).find(|&j| j > i + 1 && chars[j] == '\'');
            let end = end.unwrap_or(i);
            out.extend(std::iter::repeat_n(' ', end + 1 - i));
            i = end + 1;
        } else {
            out.push(c);
            i += 1;
        }
    }
    out
}

/// Byte ranges of the bodies of every `fn NAME` in `code`.
fn bodies_of(code: &str, name: &str) -> Vec<std::ops::Range<usize>> {
    let mut out = Vec::new();
    let needle = format!("fn {name}");
    let mut from = 0;
    while let Some(at) = code[from..].find(&needle) {
        let start = from + at;
        from = start + needle.len();
        let next = code[from..].chars().next();
        if next.is_some_and(|c| c.is_alphanumeric() || c == '_') {
            continue;
        }
        let open = start + code[start..].find('{').expect("a body");
        let mut depth = 0;
        for (j, c) in code[open..].char_indices() {
            match c {
                '{' => depth += 1,
                '}' => {
                    depth -= 1;
                    if depth == 0 {
                        out.push(open..open + j + 1);
                        break;
                    }
                }
                _ => {}
            }
        }
    }
    out
}

#[test]
fn sled_is_changed_only_in_the_one_transaction_under_the_writer_lock() {
    let mut outside = Vec::new();
    let mut commit_fns = 0;
    let mut callers = Vec::new();
    for source in crate_sources() {
        let commit = bodies_of(&source.code, "commit_batch");
        commit_fns += commit.len();
        for m in SLED_MUTATORS {
            for (at, _) in source.code.match_indices(m) {
                let place = source.place(at);
                let allowed = NOT_SLED
                    .iter()
                    .any(|(f, l)| source.name.ends_with(f) && place.ends_with(l));
                if !allowed && !commit.iter().any(|b| b.contains(&at)) {
                    outside.push(place);
                }
            }
        }
        let calls: Vec<usize> = source
            .code
            .match_indices("commit_batch(")
            .map(|(at, _)| at)
            .filter(|&at| !source.code[..at].ends_with("fn "))
            .collect();
        for at in calls {
            let body = bodies_of(&source.code, "commit_staged")
                .into_iter()
                .find(|b| b.contains(&at));
            callers.push((source.place(at), body, source.code.clone(), at));
        }
    }
    assert!(
        outside.is_empty(),
        "sled is changed outside the one transaction (`commit_batch`):\n{}",
        outside.join("\n")
    );
    assert_eq!(commit_fns, 1, "exactly one `fn commit_batch`");
    // Its one caller stages and commits under the writer lock.
    assert_eq!(callers.len(), 1, "`commit_batch` has exactly one caller");
    let (place, body, code, at) = &callers[0];
    let body = body
        .clone()
        .unwrap_or_else(|| panic!("{place}: `commit_batch` is called outside `commit_staged`"));
    let lock = code[body.clone()].find(".writer.lock()");
    assert!(
        lock.is_some_and(|l| body.start + l < *at),
        "{place}: `commit_staged` commits without holding the writer lock"
    );
}

#[test]
fn only_the_store_module_knows_sled() {
    let mut found = Vec::new();
    for source in crate_sources() {
        if source.name.starts_with("store") {
            continue;
        }
        for (at, _) in source.code.match_indices("sled") {
            found.push(source.place(at));
        }
    }
    assert!(
        found.is_empty(),
        "sled outside src/store (a second backend would have to untangle it):\n{}",
        found.join("\n")
    );
}

/// Every record's state index entry, found by listing each state.
fn by_state(ledger: &Ledger) -> Vec<(ExecState, ExecutionId)> {
    let mut out = Vec::new();
    for state in ExecState::ALL {
        let q = ListQuery {
            state: Some(state),
            limit: 100_000,
            ..ListQuery::default()
        };
        for r in ledger.list(&q).unwrap().items {
            assert_eq!(
                r.state(),
                state,
                "{} is indexed under the wrong state",
                r.id
            );
            out.push((state, r.id));
        }
    }
    out.sort();
    out
}

#[test]
fn racing_call_counts_retention_and_transitions_leave_everything_consistent() {
    let dir = tempfile::tempdir().unwrap();
    let ledger = Ledger::init(&dir.path().join("l")).unwrap();
    let old = Timestamp::from_millis(now().as_millis() - 3_600_000);
    let actor = Actor("uid:1000:/usr/bin/agent".into());
    let run = ledger
        .start_run(actor, "stdio", old, Durability::Flushed)
        .unwrap();
    let (writers, per_writer, counters, counts) = (3, 40, 2, 150);
    let done = AtomicBool::new(false);
    let kept: Vec<ExecutionId> = std::thread::scope(|s| {
        let mut gcs = Vec::new();
        for _ in 0..2 {
            gcs.push(s.spawn(|| {
                let mut rounds = 0;
                while !done.load(Ordering::Relaxed) || rounds == 0 {
                    let cutoff = Timestamp::from_millis(now().as_millis() - 60_000);
                    ledger.gc(cutoff, now()).unwrap();
                    rounds += 1;
                }
            }));
        }
        for _ in 0..counters {
            s.spawn(|| {
                for _ in 0..counts {
                    ledger.count_call(&run.id).unwrap();
                }
            });
        }
        let writers: Vec<_> = (0..writers)
            .map(|w| {
                let ledger = &ledger;
                s.spawn(move || {
                    let mut kept = Vec::new();
                    for i in 0..per_writer {
                        let req = request("deploy", &format!("{w}-{i}"), "pw");
                        let new = new_execution(ledger, &req, "web1", old);
                        let id = new.id;
                        ledger.accept(new, old, Durability::Buffered).unwrap();
                        walk_to_completion(ledger, id, old);
                        if i % 4 == 0 {
                            kept.push(id); // completed, result not delivered: gc keeps it
                        } else {
                            ledger
                                .transition(id, Transition::Delivered, old, Durability::Buffered)
                                .unwrap();
                        }
                    }
                    kept
                })
            })
            .collect();
        let kept = writers
            .into_iter()
            .flat_map(|w| w.join().unwrap())
            .collect();
        done.store(true, Ordering::Relaxed);
        for gc in gcs {
            gc.join().unwrap();
        }
        kept
    });
    ledger
        .gc(Timestamp::from_millis(now().as_millis() - 60_000), now())
        .unwrap();

    let runs = ledger.runs(10).unwrap();
    assert_eq!(
        runs[0].calls,
        (counters * counts) as u64,
        "no count was lost"
    );
    let head = ledger.head();
    let report = ledger.verify(Some(&head)).unwrap();
    assert!(report.is_ok(), "{:?}", report.broken);
    assert_eq!(report.head, head);
    let all = ledger
        .list(&ListQuery {
            limit: 100_000,
            ..ListQuery::default()
        })
        .unwrap()
        .items;
    let mut ids: Vec<ExecutionId> = all.iter().map(|r| r.id).collect();
    ids.sort();
    let mut want = kept.clone();
    want.sort();
    assert_eq!(ids, want, "exactly the undelivered executions are kept");
    let mut indexed: Vec<_> = all.iter().map(|r| (r.state(), r.id)).collect();
    indexed.sort();
    assert_eq!(
        by_state(&ledger),
        indexed,
        "the state index matches the records"
    );
    for rec in &all {
        assert_eq!(
            ledger.by_fingerprint(&rec.fingerprint).unwrap()[0].id,
            rec.id
        );
        assert!(ledger.result(rec.id).unwrap().is_some(), "{}", rec.id);
        let events = ledger.events_of(rec.id).unwrap();
        assert!(
            matches!(
                events.first().map(|e| &e.kind),
                Some(EventKind::Accepted { .. })
            ),
            "{}: retention pruned events of a kept execution: {events:?}",
            rec.id
        );
        assert_eq!(events.last().unwrap().seq, rec.last_seq);
    }
}
