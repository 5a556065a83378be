//! The ledger knows when it is missing, damaged or rolled back (issue 32): only `init` makes a
//! ledger; a damaged one is an error, never a panic; a ledger behind its witness file is refused
//! until the operator accepts it, and `audit verify` says how many events it lacks.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::Duration;

use common::*;
use serde_json::Value;
use waymark_core::Timestamp;
use waymark_ledger::{Durability, Ledger};

fn now() -> Timestamp {
    Timestamp::from_millis(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_millis() as u64,
    )
}

/// Copies a directory tree (the ledger, with no daemon on it).
fn copy_tree(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let target = to.join(entry.file_name());
        if entry.file_type().unwrap().is_dir() {
            copy_tree(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), &target).unwrap();
        }
    }
}

/// `waymark ARGS` with no daemon behind it; a hang past `limit` fails the test.
fn run_bounded(args: &[&std::ffi::OsStr], limit: Duration) -> Output {
    waymark_testkit::output_within(
        Command::new(bin()).args(args).env("WAYMARK_LOG", "warn"),
        limit,
    )
}

/// `waymark --json audit verify --ledger DIR`: exit code and the JSON it printed.
fn verify(dir: &Path) -> (Option<i32>, Value, String) {
    let out = run_bounded(
        &[
            "--json".as_ref(),
            "audit".as_ref(),
            "verify".as_ref(),
            "--ledger".as_ref(),
            dir.as_os_str(),
        ],
        Duration::from_secs(60),
    );
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    let json = serde_json::from_str(text.trim()).unwrap_or(Value::Null);
    (
        out.status.code(),
        json,
        String::from_utf8_lossy(&out.stderr).to_string(),
    )
}

/// A real ledger with 1,500 events over many group commits (notes and runs) and five openings
/// (as a daemon's restarts leave it), each flush moving its witness; returns its head.
fn build_ledger(dir: &Path) -> u64 {
    for session in 0..5 {
        let ledger = Ledger::init(dir).unwrap();
        write_some(&ledger, session * 100..(session + 1) * 100);
    }
    Ledger::open(dir).unwrap().head().seq
}

fn write_some(ledger: &Ledger, range: std::ops::Range<u64>) {
    for i in range {
        let durability = if i % 10 == 9 {
            Durability::Flushed
        } else {
            Durability::Buffered
        };
        let data = serde_json::json!({"i": i, "padding": "x".repeat((i % 7 * 40) as usize)});
        ledger
            .record_note(None, "fuzz", data, now(), durability)
            .unwrap();
        let run = ledger
            .start_run(
                waymark_core::Actor(format!("uid:{}", 1000 + i % 3)),
                "socket",
                now(),
                durability,
            )
            .unwrap();
        ledger.end_run(&run.id, now(), durability).unwrap();
    }
    ledger.flush().unwrap();
}

/// A tiny deterministic generator, so a failing seed can be run again
/// (`WAYMARK_DAMAGE_SEED=N`).
struct XorShift(u64);

impl XorShift {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

/// sled's files of a ledger copy, with their sizes.
fn sled_files(ledger: &Path) -> Vec<(PathBuf, u64)> {
    let mut out = Vec::new();
    let mut stack = vec![ledger.join("db")];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let e = e.unwrap();
            let meta = e.metadata().unwrap();
            if meta.is_dir() {
                stack.push(e.path());
            } else if meta.len() > 0 {
                out.push((e.path(), meta.len()));
            }
        }
    }
    out.sort();
    out
}

/// One damaged copy's answer judged: `Err` says what is wrong with it.
fn judge(
    copy: &Path,
    full: u64,
    answer: &(Option<i32>, Value, String),
) -> Result<&'static str, String> {
    let (code, json, stderr) = answer;
    if std::env::var("WAYMARK_DAMAGE_SHOW").is_ok() {
        eprintln!("{code:?} {json}");
    }
    if *code == Some(101) || stderr.contains("panicked") {
        return Err(format!("panicked (exit {code:?}): {stderr}"));
    }
    match code {
        Some(0) => {
            let head = json["head"]["seq"].as_u64();
            if json["ok"] == true && head == Some(full) {
                Ok("intact")
            } else {
                Err(format!("exit 0 without the full head {full}: {json}"))
            }
        }
        Some(_) if json["ok"] == false => {
            let problem = json["broken"]["problem"].as_str().unwrap_or("");
            if problem.is_empty() {
                Err(format!("a broken chain without its problem: {json}"))
            } else if problem.contains("missing") {
                Ok("events missing")
            } else {
                Ok("chain broken")
            }
        }
        Some(204) => {
            let error = json["error"].as_str().unwrap_or("");
            if error.contains(&copy.display().to_string()) && error.contains("damaged") {
                Ok("damaged")
            } else if error.contains("behind its witness") || error.contains("witness knows") {
                Ok("behind its witness")
            } else {
                Err(format!(
                    "an error that names neither the ledger nor the damage: {json} {stderr}"
                ))
            }
        }
        other => Err(format!("exit {other:?}: {json} {stderr}")),
    }
}

/// What is done to a copy of the ledger.
type Damage = Box<dyn Fn(&Path) + Send + Sync>;

/// Issue 32: a copy of a real ledger with one byte flipped at 200 random offsets and cut at 20
/// random lengths. Every answer of `audit verify --ledger` is either OK with the full head or an
/// error that names what is missing or damaged; never a panic, never OK with a shorter chain.
#[test]
fn a_damaged_ledger_copy_is_never_a_panic_nor_ok_with_fewer_events() {
    let seed: u64 = std::env::var("WAYMARK_DAMAGE_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| now().as_millis() | 1);
    eprintln!("damage seed {seed} (WAYMARK_DAMAGE_SEED={seed} repeats these damages; the ledger's random ids differ)");
    let mut rng = XorShift(seed);
    let tmp = tempfile::tempdir().unwrap();
    let original = tmp.path().join("ledger");
    let full = build_ledger(&original);
    let (code, json, _) = verify(&original);
    assert_eq!(code, Some(0), "{json}");
    assert_eq!(json["head"]["seq"].as_u64(), Some(full), "{json}");

    // The daemon on a damaged copy: a refusal that names it, exit 204, no panic.
    let cut = tmp.path().join("cut");
    copy_tree(&original, &cut);
    let db = cut.join("db/db");
    let half = std::fs::metadata(&db).unwrap().len() / 2;
    std::fs::OpenOptions::new()
        .write(true)
        .open(&db)
        .unwrap()
        .set_len(half)
        .unwrap();
    let out = waymark(&daemon_config(tmp.path(), &cut), &["daemon"]);
    let text = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(204), "{text}");
    assert!(
        text.contains(&cut.display().to_string()) && !text.contains("panicked"),
        "{text}"
    );
    std::fs::remove_dir_all(&cut).unwrap();

    let files = sled_files(&original);
    let total: u64 = files.iter().map(|(_, n)| n).sum();
    let mut cases: Vec<(String, Damage)> = Vec::new();
    for _ in 0..200 {
        let mut at = rng.below(total);
        let (file, _) = files
            .iter()
            .find(|(_, n)| {
                let here = at < *n;
                if !here {
                    at -= n;
                }
                here
            })
            .unwrap()
            .clone();
        let bit = 1u8 << rng.below(8);
        let rel = file.strip_prefix(&original).unwrap().to_path_buf();
        cases.push((
            format!("flip bit {bit:#04x} at {} byte {at}", rel.display()),
            Box::new(move |copy: &Path| {
                let path = copy.join(&rel);
                let mut bytes = std::fs::read(&path).unwrap();
                bytes[at as usize] ^= bit;
                std::fs::write(&path, bytes).unwrap();
            }),
        ));
    }
    let db = original.join("db/db");
    let db_len = std::fs::metadata(&db).unwrap().len();
    for _ in 0..20 {
        let keep = rng.below(db_len);
        cases.push((
            format!("db/db cut to {keep} of {db_len} bytes"),
            Box::new(move |copy: &Path| {
                let f = std::fs::OpenOptions::new()
                    .write(true)
                    .open(copy.join("db/db"))
                    .unwrap();
                f.set_len(keep).unwrap();
            }),
        ));
    }

    // Two at a time: the machine is shared.
    let next = std::sync::atomic::AtomicUsize::new(0);
    let results = std::sync::Mutex::new(Vec::new());
    std::thread::scope(|s| {
        for _ in 0..2 {
            s.spawn(|| loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let Some((what, damage)) = cases.get(i) else {
                    return;
                };
                let copy = tmp.path().join(format!("copy{i}"));
                copy_tree(&original, &copy);
                damage(&copy);
                let answer = verify(&copy);
                let verdict = judge(&copy, full, &answer);
                std::fs::remove_dir_all(&copy).unwrap();
                results.lock().unwrap().push((what.clone(), verdict));
            });
        }
    });
    let results = results.into_inner().unwrap();
    let mut tally = std::collections::BTreeMap::new();
    let mut failures = Vec::new();
    for (what, verdict) in &results {
        match verdict {
            Ok(kind) => {
                if std::env::var("WAYMARK_DAMAGE_SHOW").is_ok() {
                    eprintln!("{what}: {kind}");
                }
                *tally.entry(*kind).or_insert(0) += 1
            }
            Err(e) => failures.push(format!("{what}: {e}")),
        }
    }
    eprintln!("seed {seed}: {tally:?}, {} failures", failures.len());
    assert!(
        failures.is_empty(),
        "seed {seed}: {} of {} damaged copies were answered wrongly:\n{}",
        failures.len(),
        results.len(),
        failures.join("\n")
    );
}

/// A minimal configuration for a daemon on `ledger`, its socket in `dir`.
fn daemon_config(dir: &Path, ledger: &Path) -> PathBuf {
    let config = dir.join("waymark.toml");
    std::fs::write(
        &config,
        format!(
            "[ledger]\npath = \"{}\"\n\n[daemon]\nsocket = \"{}\"\n",
            ledger.display(),
            dir.join("run/daemon.sock").display()
        ),
    )
    .unwrap();
    config
}

/// Runs `waymark --config CONFIG ARGS` to its end (bounded).
fn waymark(config: &Path, args: &[&str]) -> Output {
    let mut all: Vec<&std::ffi::OsStr> = vec!["--config".as_ref(), config.as_os_str()];
    all.extend(args.iter().map(|a| std::ffi::OsStr::new(*a)));
    let out = run_bounded(&all, Duration::from_secs(60));
    echo_run(args, &out);
    out
}

/// Starts `waymark daemon ARGS` on `config`; returns once it answers on `socket`.
fn start_daemon(config: &Path, socket: &Path, args: &[&str]) -> Daemon {
    let mut child = Daemon(
        Command::new(bin())
            .arg("--config")
            .arg(config)
            .arg("daemon")
            .args(args)
            .env("WAYMARK_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .spawn()
            .unwrap(),
    );
    wait_for(
        || {
            if let Ok(Some(status)) = child.0.try_wait() {
                panic!("the daemon ended at once: {status}");
            }
            std::os::unix::net::UnixStream::connect(socket).is_ok()
        },
        "the daemon to listen",
        Duration::from_secs(30),
    );
    child
}

/// SIGTERM, then wait: the daemon flushes and lets its ledger go.
fn stop(mut daemon: Daemon) {
    unsafe { libc::kill(daemon.0.id() as i32, libc::SIGTERM) };
    let _ = daemon.0.wait();
}

/// Issue 32: a daemon, a CLI and `audit verify --ledger` whose ledger is missing (a renamed
/// directory, an empty mount point) refuse with what to do, exit 2, and make nothing; `init`
/// and `daemon --init` make it.
#[test]
fn a_missing_ledger_is_refused_everywhere_and_nothing_is_made() {
    let tmp = tempfile::tempdir().unwrap();
    let ledger = tmp.path().join("state/ledger");
    let config = daemon_config(tmp.path(), &ledger);
    let said = |out: &Output| {
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    };
    let refused = |out: &Output| {
        assert_eq!(out.status.code(), Some(2), "{}", said(out));
        let text = said(out);
        assert!(
            text.contains(&format!("no ledger at {}", ledger.display()))
                && text.contains("waymark init"),
            "{text}"
        );
    };
    // The daemon itself.
    refused(&waymark(&config, &["daemon"]));
    assert!(!ledger.exists() && !ledger.parent().unwrap().exists());
    // The CLI, which starts a daemon when none answers: the daemon's refusal is the answer.
    let out = waymark(&config, &["exec", "list"]);
    assert_ne!(out.status.code(), Some(0), "{}", said(&out));
    assert!(said(&out).contains("no ledger at"), "{}", said(&out));
    assert!(!ledger.exists());
    // Offline verification of a path that does not exist.
    let out = waymark(
        &config,
        &["audit", "verify", "--ledger", &ledger.display().to_string()],
    );
    refused(&out);
    assert!(!ledger.exists());
    // An empty directory (a volume that is not mounted) is no ledger either.
    std::fs::create_dir_all(&ledger).unwrap();
    refused(&waymark(&config, &["daemon"]));
    assert_eq!(std::fs::read_dir(&ledger).unwrap().count(), 0);
    // `daemon --init` makes it, as `init` does.
    let socket = tmp.path().join("run/daemon.sock");
    let daemon = start_daemon(&config, &socket, &["--init"]);
    stop(daemon);
    assert!(ledger.join("LEDGER").exists());
    let daemon = start_daemon(&config, &socket, &[]);
    stop(daemon);
}

/// Issue 32: a ledger whose files were rolled back to an older copy (the witness kept) is
/// refused by the daemon, exit 204, naming the events it lacks; `audit verify --ledger` says
/// exactly how many; `daemon --accept-rollback` serves it and records that in the chain, after
/// which it opens as usual.
#[test]
fn a_ledger_behind_its_witness_is_refused_until_the_operator_accepts_it() {
    let tmp = tempfile::tempdir().unwrap();
    let ledger = tmp.path().join("ledger");
    let config = daemon_config(tmp.path(), &ledger);
    let socket = tmp.path().join("run/daemon.sock");
    let notes = |n: u64| {
        let l = Ledger::init(&ledger).unwrap();
        for i in 0..n {
            l.record_note(
                None,
                "work",
                serde_json::json!({"i": i}),
                now(),
                Durability::Flushed,
            )
            .unwrap();
        }
        l.head().seq
    };
    let older = notes(40);
    let backup = tmp.path().join("backup");
    copy_tree(&ledger, &backup);
    let newer = notes(25);
    assert_eq!(newer, older + 25);
    // The files go back to the older copy; the witness beside them stays.
    std::fs::remove_dir_all(ledger.join("db")).unwrap();
    copy_tree(&backup.join("db"), &ledger.join("db"));

    let out = waymark(&config, &["daemon"]);
    assert_eq!(out.status.code(), Some(204));
    let text = String::from_utf8_lossy(&out.stderr);
    let missing = format!("events {}-{newer} are missing", older + 1);
    assert!(
        text.contains("behind its witness") && text.contains(&missing),
        "{text}"
    );
    assert!(text.contains("--accept-rollback"), "{text}");

    let (code, json, _) = verify(&ledger);
    assert_ne!(code, Some(0), "{json}");
    assert_eq!(json["ok"], false, "{json}");
    let problem = json["broken"]["problem"].as_str().unwrap();
    assert!(
        problem.contains(&format!("ends at event {older}"))
            && problem.contains(&format!("reached event {newer}"))
            && problem.contains(&missing),
        "{problem}"
    );

    let daemon = start_daemon(&config, &socket, &["--accept-rollback"]);
    let events = waymark(&config, &["--json", "audit", "head"]);
    assert_eq!(events.status.code(), Some(0));
    stop(daemon);
    // The acceptance is an event of the chain, with what was missing.
    let l = Ledger::open(&ledger).unwrap();
    let last = l.events(older + 1, 10).unwrap();
    let accepted = last
        .iter()
        .find(|e| matches!(&e.kind, waymark_ledger::EventKind::Note { name, .. } if name == "rollback accepted"))
        .unwrap_or_else(|| panic!("no acceptance recorded: {last:?}"));
    let waymark_ledger::EventKind::Note { data, .. } = &accepted.kind else {
        unreachable!()
    };
    assert_eq!(data["missing_events"], newer - older, "{data}");
    assert_eq!(data["witness"]["seq"], newer, "{data}");
    drop(l);
    // From then on it opens as usual, and verifies whole.
    let (code, json, _) = verify(&ledger);
    assert_eq!(code, Some(0), "{json}");
}

/// Issue 32: hosts remember their ledger. A fresh ledger (a lost or replaced one) meeting a
/// host that ran executions under another is exactly where an intent in flight would run
/// again: the call is refused before anything is sent, with what to do; `hosts adopt` makes
/// the new ledger the host's owner, recorded in the audit chain, and calls run again.
#[test]
fn a_fresh_ledger_is_refused_by_a_host_another_ledger_ran_on_until_it_adopts_the_host() {
    let env = Env::builder().tools(APPEND_TOOL).build();
    let call = ["exec", "run", "append", "line=one", "secs=0"];
    let out = env.run(&call);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert_eq!(env.counter_lines(), ["one"]);
    let old = Ledger::open_with(&env.ledger_dir(), waymark_ledger::LedgerOptions::default())
        .err()
        .map(|e| e.to_string());
    assert!(
        old.is_some_and(|e| e.contains("locked")),
        "the daemon owns it"
    );
    env.kill_daemons();
    let old_identity = Ledger::open(&env.ledger_dir())
        .unwrap()
        .identity()
        .to_string();

    // The ledger is replaced by a new one (lost, or a wrong path made new by `init`).
    std::fs::remove_dir_all(env.ledger_dir()).unwrap();
    let new_identity = Ledger::init(&env.ledger_dir())
        .unwrap()
        .identity()
        .to_string();
    assert_ne!(old_identity, new_identity);

    let out = env.run(&call);
    assert_eq!(
        out.status.code(),
        Some(201),
        "not started: {}",
        stderr(&out)
    );
    let text = stderr(&out);
    assert!(
        text.contains(&format!("markers of another ledger ({old_identity})"))
            && text.contains("waymark hosts adopt h1"),
        "{text}"
    );
    assert_eq!(env.counter_lines(), ["one"], "nothing ran again");
    let refused = id_in(&text);
    let status = env.run(&["exec", "status", &refused]);
    assert!(
        stdout(&status).contains("another ledger"),
        "the refusal is recorded: {}",
        stdout(&status)
    );

    let adopt = env.run(&["hosts", "adopt", "h1"]);
    assert_eq!(adopt.status.code(), Some(0), "{}", stderr(&adopt));
    assert!(
        stdout(&adopt).contains(&format!("belonged to ledger {old_identity}")),
        "{}",
        stdout(&adopt)
    );
    let out = env.run(&call);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert_eq!(env.counter_lines(), ["one", "one"]);

    env.kill_daemons();
    let ledger = Ledger::open(&env.ledger_dir()).unwrap();
    let notes: Vec<(String, Value)> = ledger
        .events(1, 10_000)
        .unwrap()
        .into_iter()
        .filter_map(|e| match e.kind {
            waymark_ledger::EventKind::Note { name, data } if name.starts_with("host adopt") => {
                Some((name, data))
            }
            _ => None,
        })
        .collect();
    let names: Vec<&str> = notes.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(
        names,
        ["host adoption asked", "host adopted"],
        "recorded before the host is touched, and after"
    );
    let adopted = [notes[1].1.clone()];
    assert_eq!(adopted[0]["previous"], old_identity.as_str());
    assert_eq!(adopted[0]["ledger"], new_identity.as_str());
    assert_eq!(adopted[0]["host"], "h1");
}

/// The events `audit export` printed, checked link by link: consecutive sequence numbers, each
/// event's `prev` the hash of the one before. Returns them.
fn exported_chain(out: &Output) -> Vec<Value> {
    assert_eq!(out.status.code(), Some(0), "{}", stderr(out));
    let events: Vec<Value> = stdout(out)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    for pair in events.windows(2) {
        assert_eq!(pair[1]["seq"], pair[0]["seq"].as_u64().unwrap() + 1);
        assert_eq!(pair[1]["prev"], pair[0]["hash"], "{pair:?}");
    }
    events
}

/// Issue 32: a backup taken through the running daemon while calls run is a consistent copy at
/// the head it names; restored under the live witness, `audit verify` says exactly which
/// events it lacks. `audit export` gives the chain as JSON lines, through the daemon and
/// offline, each event linking to the one before.
#[test]
fn a_backup_taken_while_calls_run_restores_and_the_witness_says_what_it_lacks() {
    let env = Env::builder().tools(APPEND_TOOL).build();
    let backup = env.dir.path().join("backup");
    let calls = 12;
    let backed_up = std::thread::scope(|s| {
        let running = s.spawn(|| {
            for i in 0..calls {
                let line = format!("line=l{i}");
                let out = env.run(&["exec", "run", "append", &line, "secs=0"]);
                assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
            }
        });
        wait_for(
            || env.counter_lines().len() >= 3,
            "three calls to run",
            Duration::from_secs(60),
        );
        let out = env.run(&["--json", "ledger", "backup", &backup.display().to_string()]);
        assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
        let report: Value = serde_json::from_str(&stdout(&out)).unwrap();
        running.join().unwrap();
        report["head"]["seq"].as_u64().unwrap()
    });
    assert_eq!(env.counter_lines().len(), calls);
    let head: Value =
        serde_json::from_str(&stdout(&env.run(&["--json", "audit", "head"]))).unwrap();
    let live = head["seq"].as_u64().unwrap();
    assert!(
        live > backed_up,
        "calls ran after the backup: {live} > {backed_up}"
    );
    // Through the daemon: the whole chain up to its head.
    let events = exported_chain(&env.run(&["audit", "export"]));
    assert_eq!(events.first().unwrap()["seq"], 1);
    assert_eq!(events.last().unwrap()["seq"], live);
    // A restore while the daemon owns the ledger is refused and changes nothing.
    let backup_arg = backup.display().to_string();
    let out = env.run(&["ledger", "restore", &backup_arg]);
    assert_eq!(out.status.code(), Some(204), "{}", stderr(&out));
    assert!(stderr(&out).contains("stop the daemon"), "{}", stderr(&out));
    assert!(!env.ledger_dir().join("restore.tmp").exists());
    env.kill_daemons();

    // The copy is whole at the head it named.
    let (code, json, _) = verify(&backup);
    assert_eq!(code, Some(0), "{json}");
    assert_eq!(json["head"]["seq"], backed_up, "{json}");
    let offline =
        exported_chain(&env.run(&["audit", "export", "--ledger", &backup.display().to_string()]));
    assert_eq!(offline.len() as u64, backed_up);
    assert_eq!(offline[..], events[..backed_up as usize]);

    // A backup of another ledger (another key) is refused: nothing changes.
    let (_, before, _) = verify(&env.ledger_dir());
    let stranger = env.dir.path().join("stranger");
    drop(Ledger::init(&stranger).unwrap());
    let out = env.run(&["ledger", "restore", &stranger.display().to_string()]);
    assert_eq!(out.status.code(), Some(204), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("a backup of another ledger"),
        "{}",
        stderr(&out)
    );
    let (code, json, _) = verify(&env.ledger_dir());
    assert_eq!(code, Some(0), "the live ledger is untouched: {json}");
    assert_eq!(json, before);

    // Restored under the live ledger's witness, it says exactly what it lacks.
    let witness: Value = serde_json::from_str(
        std::fs::read_to_string(env.ledger_dir().join("head.witness"))
            .unwrap()
            .trim(),
    )
    .unwrap();
    let reached = witness["seq"].as_u64().unwrap();
    assert!(reached > backed_up);
    let out = env.run(&["--json", "ledger", "restore", &backup_arg]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let restored: Value = serde_json::from_str(&stdout(&out)).unwrap();
    assert_eq!(restored["head"]["seq"], backed_up, "{restored}");
    assert_eq!(
        restored["missing_events"],
        serde_json::json!({"from": backed_up + 1, "to": reached}),
        "{restored}"
    );
    // The replaced database is kept, whole: nothing is lost by a restore.
    let aside = std::path::PathBuf::from(restored["replaced"].as_str().unwrap());
    assert!(aside.join("db").exists(), "{restored}");
    let (code, json, _) = verify(&env.ledger_dir());
    assert_ne!(code, Some(0), "{json}");
    let problem = json["broken"]["problem"].as_str().unwrap();
    assert!(
        problem.contains(&format!("events {}-{reached} are missing", backed_up + 1)),
        "{problem}"
    );
    // The daemon refuses the restored ledger until the operator accepts it; the CLI that
    // started it says why in the daemon's words, with its exit code, after a few starts at
    // most (issue 33: not forty).
    let log = env.socket().with_file_name("daemon.log");
    let refusals = || {
        std::fs::read_to_string(&log)
            .unwrap_or_default()
            .matches("behind its witness")
            .count()
    };
    let before = refusals();
    let out = env.run(&["audit", "head"]);
    assert_eq!(out.status.code(), Some(204), "{}", stdout(&out));
    assert!(
        stderr(&out).contains("behind its witness"),
        "{}",
        stderr(&out)
    );
    let started = refusals() - before;
    assert!((1..=3).contains(&started), "{started} daemons started");
}

/// Issue 32: an `audit export` file proves itself: `audit verify --export` checks each line is
/// the next event, links to the one before and carries the hash the ledger key gives it, and
/// names the first line an edit, a removal, a swap or a cut (with `--head`) broke. Another
/// ledger's key proves nothing of it.
#[test]
fn an_exported_chain_verifies_and_an_edit_a_removal_or_a_cut_is_named() {
    let env = Env::builder().tools(APPEND_TOOL).build();
    for i in 0..3 {
        let line = format!("line=e{i}");
        let out = env.run(&["exec", "run", "append", &line, "secs=0"]);
        assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    }
    let out = env.run(&["audit", "export"]);
    let events = exported_chain(&out);
    let head = stdout(&env.run(&["audit", "head"])).trim().to_string();
    let file = env.dir.path().join("export.jsonl");
    let check = |lines: &[String], extra: &[&str]| -> (Option<i32>, Value) {
        std::fs::write(&file, lines.join("\n") + "\n").unwrap();
        let mut args = vec!["--json", "audit", "verify", "--export"];
        let f = file.display().to_string();
        args.push(&f);
        args.extend_from_slice(extra);
        let out = env.run(&args);
        let json = serde_json::from_str(stdout(&out).trim())
            .unwrap_or_else(|_| panic!("{} {}", stdout(&out), stderr(&out)));
        (out.status.code(), json)
    };
    let lines: Vec<String> = stdout(&out).lines().map(str::to_string).collect();
    let n = events.len();
    assert!(n >= 10, "{n} events");

    let (code, json) = check(&lines, &["--head", &head]);
    assert_eq!(code, Some(0), "{json}");
    assert_eq!(json["events"], n as u64, "{json}");
    // An export that starts later (`--from`) proves itself from its first line.
    let (code, json) = check(&lines[4..], &[]);
    assert_eq!(code, Some(0), "{json}");
    assert_eq!(json["from"], 5, "{json}");

    let broken_at = |(code, json): (Option<i32>, Value)| {
        assert_eq!(code, Some(204), "{json}");
        (
            json["broken"]["seq"].as_u64().unwrap(),
            json["broken"]["problem"].as_str().unwrap().to_string(),
        )
    };
    // An edit of one event's time.
    let mut edited = lines.clone();
    let mut e: Value = serde_json::from_str(&edited[5]).unwrap();
    e["at"] = Value::from(e["at"].as_u64().unwrap() + 1);
    edited[5] = e.to_string();
    assert_eq!(broken_at(check(&edited, &[])).0, 6);
    // A removed event.
    let mut removed = lines.clone();
    removed.remove(3);
    assert_eq!(broken_at(check(&removed, &[])).0, 4);
    // Two events swapped.
    let mut swapped = lines.clone();
    swapped.swap(6, 7);
    assert_eq!(broken_at(check(&swapped, &[])).0, 7);
    // Cut short: only the head kept elsewhere shows it.
    let cut = &lines[..n - 2];
    assert_eq!(check(cut, &[]).0, Some(0));
    let (seq, problem) = broken_at(check(cut, &["--head", &head]));
    assert!(
        problem.contains("truncated") || problem.contains("ends"),
        "{seq}: {problem}"
    );
    // Another ledger's key proves none of it.
    let stranger = env.dir.path().join("stranger");
    drop(Ledger::init(&stranger).unwrap());
    let (seq, _) = broken_at(check(
        &lines,
        &["--ledger", &stranger.display().to_string()],
    ));
    assert_eq!(seq, 1);
}
