//! Seeded chaos over the real `waymark` binary: a real OpenSSH sshd behind a fault proxy, a real
//! daemon, and a sequence of tool calls each hit by one fault drawn from a seed (proxy cut,
//! daemon SIGKILL, daemon crash at a named point, sshd restart). After every fault the test
//! recovers as an agent would (status, then retry the same call) and checks at the end that
//! nothing ran twice, nothing was silently lost, every retry attached to the first execution,
//! and the audit chain verifies.
//!
//! Replay a run with `WAYMARK_CHAOS_SEED=<seed>`; scale it with `WAYMARK_CHAOS_ACTIONS=<n>`.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use waymark_testkit::{FaultProxy, TestSshd};

/// A daemon process, killed with SIGKILL when dropped so a failing test leaves none behind.
struct Daemon(Child);

impl Daemon {
    fn kill(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A call in flight, killed when dropped so a failing test leaves none behind.
struct Call(Option<Child>);

impl Call {
    fn finish(mut self) -> Output {
        self.0.take().unwrap().wait_with_output().unwrap()
    }
}

impl Drop for Call {
    fn drop(&mut self) {
        if let Some(c) = self.0.as_mut() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

struct Env {
    sshd: TestSshd,
    proxy: FaultProxy,
    dir: tempfile::TempDir,
    config: PathBuf,
    counter: PathBuf,
}

fn bin() -> &'static str {
    env!("CARGO_BIN_EXE_waymark")
}

impl Env {
    fn new() -> Env {
        let sshd = TestSshd::new();
        let proxy = FaultProxy::start(sshd.addr());
        let dir = tempfile::tempdir().unwrap();
        let counter = sshd.remote_home().join("counter");
        // The sshd's own known_hosts names its own port; Waymark connects to the proxy's.
        let kh = dir.path().join("known_hosts");
        std::fs::write(
            &kh,
            format!(
                "[127.0.0.1]:{} {}\n",
                proxy.port(),
                sshd.host_key_public_openssh().trim()
            ),
        )
        .unwrap();
        let config = dir.path().join("waymark.toml");
        let text = format!(
            r#"
[ledger]
path = "{ledger}"

[daemon]
socket = "{socket}"

[credentials.k]
key_file = "{key}"

[hosts.h1]
address = "127.0.0.1"
port = {port}
user = "{user}"
credential = "k"
known_hosts = "{kh}"
remote_dir = "{remote}"

[tools.append]
description = "Append a line to the counter file, then sleep."
hosts = ["h1"]
argv = ["sh", "-c", "echo \"$1\" >> {counter}; sleep \"$2\"; echo done \"$1\"", "append", "{{line}}", "{{secs}}"]
contract = "status_check"
retry_window = "10m"
dedup_window = "1h"
timeout = "60s"

[tools.append.args.line]
type = "string"

[tools.append.args.secs]
type = "integer"
"#,
            ledger = dir.path().join("ledger").display(),
            socket = dir.path().join("run/daemon.sock").display(),
            key = sshd.user_key_path().display(),
            port = proxy.port(),
            user = sshd.user(),
            kh = kh.display(),
            remote = sshd.remote_dir().display(),
            counter = counter.display(),
        );
        std::fs::write(&config, text).unwrap();
        Env {
            sshd,
            proxy,
            dir,
            config,
            counter,
        }
    }

    fn cmd(&self) -> Command {
        let mut c = Command::new(bin());
        c.arg("--config")
            .arg(&self.config)
            .env("WAYMARK_LOG", "warn")
            .stdin(Stdio::null());
        c
    }

    fn run(&self, args: &[&str]) -> Output {
        let out = self.cmd().args(args).output().unwrap();
        eprintln!(
            "$ waymark {}\n[exit {:?}]\n{}{}",
            args.join(" "),
            out.status.code(),
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        out
    }

    fn spawn(&self, args: &[&str]) -> Call {
        Call(Some(
            self.cmd()
                .args(args)
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap(),
        ))
    }

    fn counter_lines(&self) -> Vec<String> {
        std::fs::read_to_string(&self.counter)
            .unwrap_or_default()
            .lines()
            .map(str::to_string)
            .collect()
    }

    fn start_daemon_with(&self, envs: &[(&str, &str)]) -> Daemon {
        let mut cmd = self.cmd();
        cmd.arg("daemon")
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        for (k, v) in envs {
            cmd.env(k, v);
        }
        let child = Daemon(cmd.spawn().unwrap());
        let socket = self.dir.path().join("run/daemon.sock");
        let deadline = Instant::now() + Duration::from_secs(20);
        while Instant::now() < deadline {
            if socket.exists() && std::os::unix::net::UnixStream::connect(&socket).is_ok() {
                return child;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        panic!("daemon did not listen on {} within 20 s", socket.display());
    }

    /// Every execution in the ledger: id -> state.
    fn executions(&self) -> BTreeMap<String, String> {
        let list = self
            .cmd()
            .args(["--json", "exec", "list", "--limit", "10000"])
            .output()
            .unwrap();
        assert_eq!(list.status.code(), Some(0), "{}", stderr(&list));
        let v: serde_json::Value = serde_json::from_slice(&list.stdout).unwrap();
        v["items"]
            .as_array()
            .unwrap()
            .iter()
            .map(|i| {
                (
                    i["id"].as_str().unwrap().to_string(),
                    i["state"].as_str().unwrap().to_string(),
                )
            })
            .collect()
    }
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// Every execution id printed anywhere in the output.
fn ids_in(o: &Output) -> BTreeSet<String> {
    let text = format!("{}{}", stdout(o), stderr(o));
    let mut ids = BTreeSet::new();
    let mut rest = text.as_str();
    while let Some(i) = rest.find("act_") {
        if rest.len() >= i + 30 {
            ids.insert(rest[i..i + 30].to_string());
        }
        rest = &rest[i + 4..];
    }
    ids
}

fn wait_for(mut f: impl FnMut() -> bool, what: &str, limit: Duration) {
    let deadline = Instant::now() + limit;
    while Instant::now() < deadline {
        if f() {
            return;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    panic!("timed out waiting for {what}");
}

/// splitmix64: small, seedable, good enough to draw faults.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Fault {
    None,
    ProxyCut,
    DaemonKill,
    CrashAccepted,
    CrashDispatched,
    CrashCompleted,
    SshdRestart,
}

const FAULTS: [Fault; 7] = [
    Fault::None,
    Fault::ProxyCut,
    Fault::DaemonKill,
    Fault::CrashAccepted,
    Fault::CrashDispatched,
    Fault::CrashCompleted,
    Fault::SshdRestart,
];

impl Fault {
    /// Faults that strike while the command is running on the host.
    fn mid_command(self) -> bool {
        matches!(
            self,
            Fault::ProxyCut | Fault::DaemonKill | Fault::SshdRestart
        )
    }
    fn crash_point(self) -> Option<&'static str> {
        match self {
            Fault::CrashAccepted => Some("accepted"),
            Fault::CrashDispatched => Some("dispatched"),
            Fault::CrashCompleted => Some("completed"),
            _ => None,
        }
    }
}

/// A final answer for the agent: the command completed (its own exit code), or Waymark says it
/// is blocked (needs review / expired, 202) or stopped (203). 200 (unknown), 201 (did not
/// start) and 204 (Waymark failed) call for a status check and a retry.
fn is_final(code: Option<i32>) -> bool {
    !matches!(code, None | Some(200) | Some(201) | Some(204))
}

struct ActionReport {
    name: String,
    fault: Fault,
    id: String,
    final_code: Option<i32>,
    calls: usize,
    status: String,
}

const MAX_RETRIES: usize = 6;

#[test]
fn chaos_ci_profile_no_duplicates_no_silent_loss() {
    let started = Instant::now();
    let seed: u64 = match std::env::var("WAYMARK_CHAOS_SEED") {
        Ok(s) => s.trim().parse().expect("WAYMARK_CHAOS_SEED is a u64"),
        Err(_) => {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos() as u64
                ^ u64::from(std::process::id())
        }
    };
    let n: usize = std::env::var("WAYMARK_CHAOS_ACTIONS")
        .ok()
        .map(|s| s.trim().parse().expect("WAYMARK_CHAOS_ACTIONS is a number"))
        .unwrap_or(12);
    eprintln!("chaos: seed {seed} ({n} actions); replay with WAYMARK_CHAOS_SEED={seed}");

    // The plan is drawn up front from the seed alone: the first actions cover every fault kind
    // once (in a seeded order), the rest draw any kind.
    let mut rng = Rng(seed);
    let mut kinds = FAULTS.to_vec();
    for i in (1..kinds.len()).rev() {
        kinds.swap(i, rng.below(i as u64 + 1) as usize);
    }
    let plan: Vec<(String, Fault, u64)> = (0..n)
        .map(|i| {
            let fault = if i < kinds.len() {
                kinds[i]
            } else {
                FAULTS[rng.below(FAULTS.len() as u64) as usize]
            };
            // A mid-command fault needs the command to be running for a moment.
            let secs = if fault.mid_command() { 1 } else { rng.below(2) };
            (format!("chaos-{seed:x}-{i:03}"), fault, secs)
        })
        .collect();

    let env = Env::new();
    let mut daemon = env.start_daemon_with(&[]);
    let mut reports: Vec<ActionReport> = Vec::new();

    for (name, fault, secs) in &plan {
        eprintln!("chaos: action {name}: fault {fault:?}, sleep {secs}s");
        let line_arg = format!("line={name}");
        let secs_arg = format!("secs={secs}");
        let args = [
            "exec",
            "run",
            "append",
            line_arg.as_str(),
            secs_arg.as_str(),
        ];
        let before: BTreeSet<String> = env.executions().into_keys().collect();

        if let Some(point) = fault.crash_point() {
            daemon.kill();
            daemon = env.start_daemon_with(&[("WAYMARK_CRASH_AT", point)]);
        }
        let first = match fault {
            Fault::None | Fault::CrashAccepted | Fault::CrashDispatched | Fault::CrashCompleted => {
                env.run(&args)
            }
            Fault::ProxyCut | Fault::DaemonKill | Fault::SshdRestart => {
                let call = env.spawn(&args);
                wait_for(
                    || env.counter_lines().iter().any(|l| l == name),
                    "the command to start on the host",
                    Duration::from_secs(20),
                );
                match fault {
                    Fault::ProxyCut => env.proxy.cut_all(),
                    Fault::DaemonKill => daemon.kill(),
                    Fault::SshdRestart => env.sshd.restart(),
                    _ => unreachable!(),
                }
                let out = call.finish();
                eprintln!(
                    "$ waymark {} (under {fault:?})\n[exit {:?}]\n{}{}",
                    args.join(" "),
                    out.status.code(),
                    stdout(&out),
                    stderr(&out)
                );
                out
            }
        };
        if fault.crash_point().is_some() {
            // The crashing daemon must have died by its own SIGKILL at that point.
            let status = daemon.0.wait().unwrap();
            assert!(
                status.code().is_none(),
                "{name}: the daemon died by a signal at {fault:?}"
            );
        }
        if matches!(
            fault,
            Fault::DaemonKill
                | Fault::CrashAccepted
                | Fault::CrashDispatched
                | Fault::CrashCompleted
        ) {
            daemon = env.start_daemon_with(&[]);
        }

        // The action's execution: the id the first call printed, else the one new in the ledger.
        let new: Vec<String> = env
            .executions()
            .into_keys()
            .filter(|id| !before.contains(id))
            .collect();
        assert_eq!(
            new.len(),
            1,
            "{name}: exactly one execution accepted for the first call: {new:?}"
        );
        let printed = ids_in(&first);
        assert!(
            printed.len() <= 1,
            "{name}: the first call named one execution: {printed:?}"
        );
        let id = printed.into_iter().next().unwrap_or_else(|| new[0].clone());
        assert_eq!(id, new[0], "{name}: the printed id is the new execution");

        // Recover as an agent would: while the answer is not final, ask for the status, then
        // retry the same call. Every retry must attach to the first execution.
        let mut last = first;
        let mut calls = 1;
        while !is_final(last.status.code()) {
            assert!(
                calls <= MAX_RETRIES,
                "{name}: no final answer after {MAX_RETRIES} retries (last exit {:?})",
                last.status.code()
            );
            let st = env.run(&["exec", "status", &id]);
            for seen in ids_in(&st) {
                assert_eq!(seen, id, "{name}: status names the first execution");
            }
            if calls > 1 {
                std::thread::sleep(Duration::from_millis(300));
            }
            last = env.run(&args);
            calls += 1;
            let seen = ids_in(&last);
            assert!(
                seen.iter().all(|s| *s == id),
                "{name}: retry {calls} attached to {id}, not {seen:?}"
            );
        }
        let status = env.run(&["exec", "status", &id]);
        let final_code = last.status.code();
        if final_code == Some(0) {
            assert_eq!(
                stdout(&last),
                format!("done {name}\n"),
                "{name}: the result"
            );
        }
        reports.push(ActionReport {
            name: name.clone(),
            fault: *fault,
            id,
            final_code,
            calls,
            status: stdout(&status).trim().to_string(),
        });
    }
    drop(daemon);

    // The host: no line twice, every line an action of ours.
    let lines = env.counter_lines();
    let mut counts: BTreeMap<&str, usize> = BTreeMap::new();
    for l in &lines {
        *counts.entry(l.as_str()).or_default() += 1;
    }
    let duplicates: Vec<(&str, usize)> = counts
        .iter()
        .filter(|(_, c)| **c > 1)
        .map(|(l, c)| (*l, *c))
        .collect();
    let names: BTreeSet<&str> = plan.iter().map(|(n, _, _)| n.as_str()).collect();
    for l in counts.keys() {
        assert!(names.contains(l), "a line no action wrote: {l:?}");
    }

    // The ledger: one execution per action, no more (retries attached), ids all distinct.
    let executions = env.executions();
    let ids: BTreeSet<&str> = reports.iter().map(|r| r.id.as_str()).collect();
    assert_eq!(
        ids.len(),
        reports.len(),
        "each action has its own execution"
    );
    assert_eq!(
        executions
            .keys()
            .map(String::as_str)
            .collect::<BTreeSet<_>>(),
        ids,
        "no execution beyond one per action: retries never minted a new one"
    );

    // Each action: completed with its line exactly once, or unresolved with a reason.
    let mut unresolved = Vec::new();
    for r in &reports {
        let state = &executions[&r.id];
        let count = counts.get(r.name.as_str()).copied().unwrap_or(0);
        if r.final_code == Some(0) {
            assert_eq!(state, "completed", "{}: ledger state", r.name);
            assert_eq!(
                count, 1,
                "{}: completed, so its line is there exactly once",
                r.name
            );
        } else {
            assert!(
                matches!(
                    state.as_str(),
                    "unknown" | "needs_review" | "interrupted" | "expired"
                ) || state.contains("review"),
                "{}: not completed (exit {:?}) must be unknown or needs review, is {state}",
                r.name,
                r.final_code
            );
            assert!(count <= 1, "{}: ran at most once", r.name);
            assert!(
                !r.status.is_empty(),
                "{}: the status gives a reason",
                r.name
            );
            unresolved.push(r);
        }
    }

    let audit = env.run(&["audit", "verify"]);
    assert_eq!(
        audit.status.code(),
        Some(0),
        "audit verify: {}",
        stdout(&audit)
    );

    // The table.
    let mut by_kind: BTreeMap<Fault, usize> = BTreeMap::new();
    for r in &reports {
        *by_kind.entry(r.fault).or_default() += 1;
    }
    eprintln!("\n==== chaos summary (seed {seed}) ====");
    eprintln!("actions      {}", reports.len());
    for (k, c) in &by_kind {
        eprintln!("  fault {:<16} {c}", format!("{k:?}"));
    }
    eprintln!(
        "calls        {} (retries {})",
        reports.iter().map(|r| r.calls).sum::<usize>(),
        reports.iter().map(|r| r.calls - 1).sum::<usize>()
    );
    eprintln!("duplicates   {} (must be 0)", duplicates.len());
    eprintln!("unresolved   {}", unresolved.len());
    for r in &unresolved {
        eprintln!(
            "  {} [{:?}] exit {:?}: {}",
            r.name, r.fault, r.final_code, r.status
        );
    }
    eprintln!("wall time    {:.1} s", started.elapsed().as_secs_f64());
    eprintln!("=====================================");
    assert!(
        duplicates.is_empty(),
        "lines on the host twice: {duplicates:?}"
    );
    let _ = &env.dir;
}
