//! Seeded chaos over the real `waymark` binary: a real OpenSSH sshd behind a fault proxy, a real
//! daemon, CLI calls and `waymark mcp` shims driven by rmcp's client, in batches of 3–4 actions
//! in flight at once, each batch hit by one fault drawn from a printed seed:
//!
//! - `cut_up` / `cut_down`: the proxy closes the SSH connection after a random number of bytes
//!   client→server / server→client, at a random moment;
//! - `blackhole`: nothing flows for a while (shorter than keepalive detection), then it resumes;
//! - `blackhole_cut`: nothing flows, then the connection is cut while dark: the calls in flight
//!   lose their answer and must come back "unknown";
//! - `blackhole_long` (long profile only): nothing flows past the keepalive budget (5 s × 4),
//!   so the calls come back "unknown" on their own;
//! - `daemon_kill`: the daemon is SIGKILLed at a random moment and restarted;
//! - `crash_accepted` / `crash_dispatched` / `crash_completed`: the daemon kills itself
//!   (`WAYMARK_CRASH_AT`) at that point of the first call reaching it;
//! - `sshd_restart`: the sshd restarts while the commands run;
//! - `mcp_kill`: an MCP shim is SIGKILLed mid-call; the call is retried from a new shim.
//!
//! A third or more of the actions are HTTP actions (tools `pay`, `idempotent`, and
//! `pay_checked`, `status_check` with a status request) on the test kit's Idempotency-Key API,
//! reached through a second fault proxy: cuts and blackholes strike the SSH and the HTTP path
//! alike, daemon kills and crashes whichever call reaches the daemon first (in a crash batch that
//! covers its kind the first call is an HTTP one; an sshd restart leaves HTTP alone). The API
//! takes as long to answer as the batch's commands take to run.
//!
//! Each action's command appends `<execution id> <action name>` to a counter file on the host
//! (the id is the name of the marker directory holding the command's stdout, which the wrapper
//! opens for it); an HTTP action's request carries its name in the body and its execution id as
//! `Idempotency-Key`, and the API performs one effect per key. After each batch the test
//! recovers as an agent would (status, then `exec resume` or a retry of the same call, drawn
//! from the seed) and at the end asserts: no execution id ran twice and no action ran (or was
//! charged by the API) under two ids; the API charged each key once; an execution `completed`
//! ran (its line is on the host, or the API charged its key) and one `failed` did not; every
//! execution is proven (completed, or failed = proven not started) or unresolved with its
//! reason; every retry attached; the audit chain verifies. It prints a table.
//!
//! `WAYMARK_CHAOS_SEED=<u64>` replays a run; `WAYMARK_CHAOS_PROFILE=long` runs the long profile
//! (200 actions, `blackhole_long` included); `WAYMARK_CHAOS_ACTIONS=<n>` sets the number of
//! actions of either profile (every fault kind still gets at least one batch). The CI profile
//! (about 36 actions) takes about 25 s. nextest ends a test after 120 s, so run long ones with
//! `cargo test`:
//!
//! ```sh
//! WAYMARK_CHAOS_PROFILE=long cargo test -p waymark --test chaos -- --nocapture
//! ```

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::process::{Child, Output, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use waymark_testkit::{CutScope, Direction, FaultProxy, TestHttpApi};

use common::{
    append_tool_naming_its_id, call, ids_in, stderr, stdout, structured, wait_for, Daemon, Env,
};

/// The HTTP tools, on the API behind `base` (the HTTP fault proxy): the request's body names the
/// action (`ref`), its `Idempotency-Key` is the execution id.
fn http_tools(base: &str) -> String {
    format!(
        r#"
[tools.pay]
description = "Charges for a line."
channel = "http"
method = "POST"
url = "{base}/payments"
body = {{ ref = "{{line}}" }}
contract = "idempotent"
timeout = "10s"

[tools.pay.args.line]
type = "string"

[tools.pay_checked]
description = "Charges for a line; the operations endpoint says how it ended."
channel = "http"
method = "POST"
url = "{base}/payments"
body = {{ ref = "{{line}}", checked = true }}
contract = "status_check"
status = {{ url = "{base}/operations/{{execution_id}}" }}
timeout = "10s"

[tools.pay_checked.args.line]
type = "string"
"#
    )
}

/// `(execution id, action name)` of every payment request the API received (the key it was
/// sent under, the `ref` of its body), in arrival order, repeats included.
fn http_requests(api: &TestHttpApi) -> Vec<(String, String)> {
    api.requests()
        .iter()
        .filter(|r| r.method == "POST" && r.path == "/payments")
        .map(|r| {
            let key = r
                .header("idempotency-key")
                .unwrap_or_else(|| panic!("a payment without an Idempotency-Key: {r:?}"))
                .to_string();
            let body: Value = serde_json::from_slice(&r.body)
                .unwrap_or_else(|e| panic!("a payment body that is not JSON ({e}): {r:?}"));
            let name = body["ref"]
                .as_str()
                .unwrap_or_else(|| panic!("a payment without a ref: {body}"))
                .to_string();
            assert!(
                key.starts_with("act_") && key.len() == 30,
                "payment {name}: the key {key:?} is an execution id"
            );
            (key, name)
        })
        .collect()
}

/// `(execution id, action name)` of everything that ran: counter lines on the host, and one
/// entry per key the API charged (a key's repeats are answered from the first, not charged).
fn effects(env: &Env, api: &TestHttpApi) -> Vec<(String, String)> {
    let mut out = counter_entries(env);
    let mut seen = BTreeMap::new();
    for (key, name) in http_requests(api) {
        match seen.get(&key) {
            None => {
                seen.insert(key.clone(), name.clone());
                out.push((key, name));
            }
            Some(first) => assert_eq!(
                *first, name,
                "key {key} was sent for two actions: a key reused with another payload"
            ),
        }
    }
    out
}

/// A first call or a retry must answer within this (a hang is a failure, not a wait).
const CALL_LIMIT: Duration = Duration::from_secs(120);
/// Recovery steps (status + resume or retry) per action before giving up.
const MAX_RECOVERY: usize = 8;

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
    fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.below(hi - lo + 1)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Kind {
    None,
    CutUp,
    CutDown,
    Blackhole,
    BlackholeCut,
    BlackholeLong,
    DaemonKill,
    CrashAccepted,
    CrashDispatched,
    CrashCompleted,
    SshdRestart,
    McpKill,
}

const CI_KINDS: [Kind; 11] = [
    Kind::None,
    Kind::CutUp,
    Kind::CutDown,
    Kind::Blackhole,
    Kind::BlackholeCut,
    Kind::DaemonKill,
    Kind::CrashAccepted,
    Kind::CrashDispatched,
    Kind::CrashCompleted,
    Kind::SshdRestart,
    Kind::McpKill,
];

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::None => "none",
            Kind::CutUp => "cut_up",
            Kind::CutDown => "cut_down",
            Kind::Blackhole => "blackhole",
            Kind::BlackholeCut => "blackhole_cut",
            Kind::BlackholeLong => "blackhole_long",
            Kind::DaemonKill => "daemon_kill",
            Kind::CrashAccepted => "crash_accepted",
            Kind::CrashDispatched => "crash_dispatched",
            Kind::CrashCompleted => "crash_completed",
            Kind::SshdRestart => "sshd_restart",
            Kind::McpKill => "mcp_kill",
        }
    }
    fn crash_point(self) -> Option<&'static str> {
        match self {
            Kind::CrashAccepted => Some("accepted"),
            Kind::CrashDispatched => Some("dispatched"),
            Kind::CrashCompleted => Some("completed"),
            _ => None,
        }
    }
    /// Faults that wait for a command of the batch to run on the host before they strike.
    fn mid_command(self) -> bool {
        matches!(
            self,
            Kind::BlackholeCut | Kind::BlackholeLong | Kind::SshdRestart | Kind::McpKill
        )
    }
}

/// One batch's fault, with every parameter drawn up front from the seed.
#[derive(Debug, Clone, Copy)]
struct Fault {
    kind: Kind,
    /// Wait before striking (after the calls start, or after a command started on the host).
    delay_ms: u64,
    /// Byte budget of a cut.
    bytes: u64,
    /// How long a blackhole lasts.
    dark_ms: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Channel {
    Cli,
    Mcp,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Recover {
    Retry,
    Resume,
}

#[derive(Debug, Clone)]
struct Action {
    name: String,
    /// `append` (SSH), `pay` or `pay_checked` (HTTP).
    tool: &'static str,
    secs: u64,
    channel: Channel,
    recover: Recover,
}

/// What became of an action.
#[derive(Debug, Default)]
struct Report {
    /// Every execution id this action was told of, in order (first call, retries, host).
    ids: Vec<String>,
    first_unknown: bool,
    retries: usize,
    /// Retries that attached to the execution the agent knew of.
    attached: usize,
    resumes: usize,
    statuses: usize,
}

impl Report {
    fn see(&mut self, id: &str) {
        if !self.ids.iter().any(|i| i == id) {
            self.ids.push(id.to_string());
        }
    }
    fn current(&self) -> Option<&str> {
        self.ids.last().map(String::as_str)
    }
}

/// A CLI call in flight, killed when dropped so a failing test leaves none behind.
struct Call(Option<Child>);

impl Call {
    fn spawn(env: &Env, args: &[String]) -> Call {
        Call(Some(
            env.cmd()
                .args(args)
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap(),
        ))
    }

    /// Waits for the end, at most `CALL_LIMIT` (then it is a hang: panic).
    fn finish(mut self, what: &str) -> Output {
        let deadline = Instant::now() + CALL_LIMIT;
        let child = self.0.as_mut().unwrap();
        while child.try_wait().unwrap().is_none() {
            assert!(
                Instant::now() < deadline,
                "{what}: no answer within {CALL_LIMIT:?} (a hang)"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
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

/// A first call in flight: a CLI process, or an MCP shim with the task awaiting its answer.
enum InFlight {
    Cli(Call),
    Mcp {
        pid: u32,
        task: tokio::task::JoinHandle<Option<Value>>,
    },
}

/// The first answer: a CLI output, or an MCP result's structured content (`None`: the shim died
/// before answering).
enum Answer {
    Cli(Output),
    Mcp(Option<Value>),
}

impl Action {
    fn http(&self) -> bool {
        self.tool != "append"
    }
    /// The tool's arguments as `key=value` words.
    fn words(&self) -> Vec<String> {
        let mut w = vec![format!("line={}", self.name)];
        if !self.http() {
            w.push(format!("secs={}", self.secs));
        }
        w
    }
    /// The tool's arguments for an MCP call.
    fn mcp_args(&self) -> Value {
        if self.http() {
            json!({"line": self.name})
        } else {
            json!({"line": self.name, "secs": self.secs})
        }
    }
}

fn call_args(a: &Action) -> Vec<String> {
    let mut args = vec!["exec".into(), "run".into(), a.tool.to_string()];
    args.extend(a.words());
    args
}

/// Our daemons log to `daemons.log` in the test's directory (shown when the test fails).
fn start_daemon(env: &Env, envs: &[(&str, &str)]) -> Daemon {
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(env.dir.path().join("daemons.log"))
        .unwrap();
    env.start_daemon_with(envs, Stdio::from(log))
}

/// On a failing test, prints the daemons' logs (ours, and the one a shim starts) before the
/// temporary directory goes.
struct LogsOnPanic<'a>(&'a Env);

impl Drop for LogsOnPanic<'_> {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            return;
        }
        for path in [
            self.0.dir.path().join("daemons.log"),
            self.0.socket().with_file_name("daemon.log"),
        ] {
            let text = std::fs::read_to_string(&path).unwrap_or_default();
            eprintln!("---- {} ----\n{text}", path.display());
        }
    }
}

/// `waymark --json exec status ID`: the record with the live marker check.
fn status(env: &Env, id: &str) -> Value {
    let out = env
        .cmd()
        .args(["--json", "exec", "status", id])
        .output()
        .unwrap();
    serde_json::from_slice(&out.stdout).unwrap_or_else(|_| {
        panic!(
            "exec status {id}: not JSON (exit {:?}): {}{}",
            out.status.code(),
            stdout(&out),
            stderr(&out)
        )
    })
}

/// States that need no further recovery: proven, or parked for a human with a reason.
fn settled(state: &str) -> bool {
    matches!(
        state,
        "completed" | "timed_out" | "cancelled" | "interrupted" | "denied" | "expired" | "reviewed"
    )
}

/// `(id, name)` of every counter line; panics on a line the command cannot have written.
fn counter_entries(env: &Env) -> Vec<(String, String)> {
    env.counter_lines()
        .iter()
        .map(|l| {
            let (id, name) = l
                .split_once(' ')
                .unwrap_or_else(|| panic!("counter line {l:?} is `<id> <name>`"));
            assert!(
                id.starts_with("act_") && id.len() == 30,
                "counter line {l:?}: the command found its execution id"
            );
            (id.to_string(), name.to_string())
        })
        .collect()
}

/// Kills daemons on our configuration that a shim started while ours was down (they would keep
/// the ledger from the one we start next). A shim may start one a moment after its answer (to
/// mark the result delivered), so this repeats until two scans 300 ms apart find none.
/// Returns how many it killed.
fn kill_stray_daemons(env: &Env) -> usize {
    let mut killed = 0;
    let mut quiet = 0;
    while quiet < 2 {
        let strays = env.daemons();
        if strays.is_empty() {
            quiet += 1;
        } else {
            quiet = 0;
            for pid in &strays {
                unsafe { libc::kill(*pid as i32, libc::SIGKILL) };
            }
            killed += strays.len();
            wait_for(
                || env.daemons().is_empty(),
                "stray daemons to die",
                Duration::from_secs(10),
            );
        }
        std::thread::sleep(Duration::from_millis(300));
    }
    killed
}

struct Profile {
    name: &'static str,
    actions: usize,
    kinds: Vec<Kind>,
}

fn profile() -> Profile {
    let long = match std::env::var("WAYMARK_CHAOS_PROFILE").as_deref() {
        Ok("long") => true,
        Ok("ci") | Err(_) => false,
        Ok(other) => panic!("WAYMARK_CHAOS_PROFILE is `ci` or `long`, not {other:?}"),
    };
    let mut kinds = CI_KINDS.to_vec();
    if long {
        kinds.push(Kind::BlackholeLong);
    }
    let default = if long { 200 } else { 36 };
    let actions = std::env::var("WAYMARK_CHAOS_ACTIONS")
        .ok()
        .map(|s| s.trim().parse().expect("WAYMARK_CHAOS_ACTIONS is a number"))
        .unwrap_or(default);
    Profile {
        name: if long { "long" } else { "ci" },
        actions,
        kinds,
    }
}

/// The whole plan, from the seed alone: batches of 3–4 actions, the first batches covering
/// every fault kind once (in a seeded order), the rest drawing any kind.
fn plan(seed: u64, p: &Profile) -> Vec<(Fault, Vec<Action>)> {
    let mut rng = Rng(seed);
    let mut order = p.kinds.clone();
    for i in (1..order.len()).rev() {
        order.swap(i, rng.below(i as u64 + 1) as usize);
    }
    let mut batches = Vec::new();
    let mut n = 0;
    // Every kind gets at least one batch, whatever the number of actions asked for.
    while n < p.actions || batches.len() < order.len() {
        let kind = if batches.len() < order.len() {
            order[batches.len()]
        } else {
            p.kinds[rng.below(p.kinds.len() as u64) as usize]
        };
        let fault = Fault {
            kind,
            delay_ms: match kind {
                // The daemon must have the calls before it dies (a shim finding no daemon
                // would start its own).
                Kind::DaemonKill => rng.range(300, 1500),
                Kind::CutUp | Kind::CutDown | Kind::Blackhole => rng.range(0, 1000),
                _ => rng.range(0, 400),
            },
            // Small enough to strike within the batch's traffic most of the time.
            bytes: rng.range(0, 1500),
            dark_ms: match kind {
                Kind::BlackholeLong => 26_000,
                _ => rng.range(300, 2500),
            },
        };
        let size = (rng.range(3, 4) as usize).min(p.actions.saturating_sub(n).max(3));
        let covering = batches.len() < order.len();
        let mut actions = (0..size)
            .map(|j| {
                let channel = if (kind == Kind::McpKill && j == 0) || rng.below(4) == 0 {
                    Channel::Mcp
                } else {
                    Channel::Cli
                };
                let tool = match rng.below(6) {
                    0 => "pay",
                    1 => "pay_checked",
                    _ => "append",
                };
                Action {
                    name: format!("c{seed:x}-{:03}", n + j),
                    tool,
                    secs: if kind.mid_command() {
                        rng.range(1, 2)
                    } else {
                        rng.range(0, 1)
                    },
                    channel,
                    recover: if rng.below(2) == 0 {
                        Recover::Retry
                    } else {
                        Recover::Resume
                    },
                }
            })
            .collect::<Vec<_>>();
        // Every fault kind meets an HTTP action at least once; a crash strikes the first call
        // reaching the daemon, so in a crash batch the first call is an HTTP one.
        if covering {
            let http = if rng.below(2) == 0 {
                "pay"
            } else {
                "pay_checked"
            };
            if kind.crash_point().is_some() {
                actions[0].tool = http;
            } else if !actions.iter().any(Action::http) {
                actions.last_mut().unwrap().tool = http;
            }
        }
        n += actions.len();
        batches.push((fault, actions));
    }
    batches
}

/// The call from a new MCP shim; its structured result.
fn mcp_call(rt: &tokio::runtime::Runtime, env: &Env, a: &Action) -> Value {
    rt.block_on(async {
        tokio::time::timeout(CALL_LIMIT, async {
            let (client, _) = env.client().await;
            let r = client
                .call_tool(call(a.tool, a.mcp_args()))
                .await
                .expect("the MCP call answers");
            let _ = client.cancel().await;
            structured(&r)
        })
        .await
        .unwrap_or_else(|_| panic!("{}: the MCP call hung", a.name))
    })
}

/// Repeats the action's call on its own channel (a new shim for MCP). It must attach to the
/// execution the agent knows of, unless that one is `failed` (proven not started): then a new
/// execution is right.
fn retry(env: &Env, rt: &tokio::runtime::Runtime, a: &Action, r: &mut Report, state: &str) {
    let before = r.current().map(str::to_string);
    let must_attach = before.is_some() && state != "failed";
    let new_id = match a.channel {
        Channel::Cli => {
            let args = call_args(a);
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            let out = env.run(&args);
            let seen = ids_in(&out);
            assert!(seen.len() <= 1, "{}: one execution: {seen:?}", a.name);
            seen.into_iter().next()
        }
        Channel::Mcp => {
            let v = mcp_call(rt, env, a);
            eprintln!("mcp retry {} -> {v}", a.name);
            if must_attach {
                assert!(
                    !v["attached"].is_null(),
                    "{}: the MCP retry attached to {before:?}: {v}",
                    a.name
                );
            }
            v["id"].as_str().map(str::to_string)
        }
    };
    r.retries += 1;
    if let Some(new_id) = new_id {
        if must_attach {
            assert_eq!(
                Some(&new_id),
                before.as_ref(),
                "{}: the retry attached to the first execution",
                a.name
            );
            r.attached += 1;
        }
        r.see(&new_id);
    }
}

/// `waymark exec resume ID TOOL line=.. [secs=..]`: sends the same id again (the host marker
/// refuses a second start; the API answers a repeated key from the first request). Refused (exit 2) only when the execution is no longer resumable.
fn resume(env: &Env, a: &Action, r: &mut Report) {
    let id = r.current().unwrap().to_string();
    let mut args = vec![
        "exec".to_string(),
        "resume".into(),
        id.clone(),
        a.tool.into(),
    ];
    args.extend(a.words());
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let out = env.run(&args);
    assert!(
        !stderr(&out).contains("give the call again"),
        "{}: resume took the call: {}",
        a.name,
        stderr(&out)
    );
    r.resumes += 1;
    for seen in ids_in(&out) {
        assert_eq!(seen, id, "{}: resume names the same execution", a.name);
    }
}

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
    let prof = profile();
    let batches = plan(seed, &prof);
    eprintln!(
        "chaos: seed {seed}, profile {} ({} actions in {} batches); replay with \
         WAYMARK_CHAOS_SEED={seed}{}",
        prof.name,
        prof.actions,
        batches.len(),
        if prof.name == "long" {
            " WAYMARK_CHAOS_PROFILE=long"
        } else {
            ""
        }
    );

    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let api = TestHttpApi::start();
    let hproxy = FaultProxy::start(api.addr());
    let env = Env::builder()
        .fault_proxy()
        .tools(&append_tool_naming_its_id())
        .tools(&http_tools(&format!("http://{}", hproxy.addr())))
        // The agents (CLI and MCP shim alike) are a configured actor, as a team deploys it.
        .tools(&format!(
            "[actors.chaos]\nunix_user = \"{}\"\ntools = [\"*\"]\noperator = true\n",
            unsafe { libc::geteuid() }
        ))
        .build();
    let _logs = LogsOnPanic(&env);
    let proxy = env.proxy();
    let mut daemon = start_daemon(&env, &[]);
    let mut reports: BTreeMap<String, Report> = BTreeMap::new();
    let mut actions: Vec<Action> = Vec::new();
    // Per kind: batches, actions in flight, HTTP actions among them, SSH connections the proxy
    // accepted meanwhile (a cut or a restart that struck shows up as reconnections).
    let mut by_kind: BTreeMap<Kind, (usize, usize, usize, u64)> = BTreeMap::new();
    let mut strays = 0;

    for (b, (fault, batch)) in batches.iter().enumerate() {
        eprintln!(
            "chaos: batch {b}: {fault:?}; actions {:?}",
            batch
                .iter()
                .map(|a| format!("{}({:?},{}s,{:?})", a.name, a.channel, a.secs, a.recover))
                .collect::<Vec<_>>()
        );
        let accepted_before = proxy.stats().accepted;
        // The API answers as slowly as the batch's commands run (a fault that waits for a
        // command to start finds the HTTP ones in flight too).
        let slowest = batch
            .iter()
            .filter(|a| a.http())
            .map(|a| a.secs)
            .max()
            .unwrap_or(0);
        api.set_processing_time(Duration::from_secs(slowest));

        if let Some(point) = fault.kind.crash_point() {
            daemon.kill();
            daemon = start_daemon(&env, &[("WAYMARK_CRASH_AT", point)]);
        }

        // The MCP shims start first, while the daemon is sound (a shim that finds none starts
        // one, which cannot open a ledger that a CLI working without a daemon holds: not what
        // this batch is about). Then the calls, all in flight at once.
        let mut shims: Vec<_> = batch
            .iter()
            .map(|a| (a.channel == Channel::Mcp).then(|| rt.block_on(env.client())))
            .collect();
        let mut flying: Vec<InFlight> = Vec::new();
        for (a, shim) in batch.iter().zip(shims.iter_mut()) {
            flying.push(match shim.take() {
                None => InFlight::Cli(Call::spawn(&env, &call_args(a))),
                Some((client, pid)) => {
                    let (tool, args) = (a.tool, a.mcp_args());
                    let task = rt.spawn(async move {
                        let r = client.call_tool(call(tool, args)).await;
                        let _ = client.cancel().await;
                        r.ok().map(|r| structured(&r))
                    });
                    InFlight::Mcp { pid, task }
                }
            });
        }
        let names: BTreeSet<&str> = batch.iter().map(|a| a.name.as_str()).collect();
        let started_on_host = |who: &dyn Fn(&str) -> bool| {
            wait_for(
                || effects(&env, &api).iter().any(|(_, n)| who(n)),
                "a command of the batch to start on the host (or its request to reach the API)",
                Duration::from_secs(30),
            )
        };
        if fault.kind.mid_command() {
            if fault.kind == Kind::McpKill {
                let victim = batch[0].name.clone();
                started_on_host(&|n| n == victim);
            } else {
                started_on_host(&|n| names.contains(n));
            }
        }
        std::thread::sleep(Duration::from_millis(fault.delay_ms));

        // The fault.
        let mut daemon_down = false;
        match fault.kind {
            Kind::None | Kind::CrashAccepted | Kind::CrashDispatched | Kind::CrashCompleted => {}
            Kind::CutUp | Kind::CutDown => {
                let dir = if fault.kind == Kind::CutUp {
                    Direction::ClientToServer
                } else {
                    Direction::ServerToClient
                };
                let scope = if proxy.stats().live > 0 {
                    CutScope::Live
                } else {
                    CutScope::Next
                };
                proxy.cut_after(fault.bytes, dir, scope);
                let scope = if hproxy.stats().live > 0 {
                    CutScope::Live
                } else {
                    CutScope::Next
                };
                hproxy.cut_after(fault.bytes, dir, scope);
            }
            Kind::Blackhole | Kind::BlackholeLong => {
                proxy.blackhole(true);
                hproxy.blackhole(true);
                std::thread::sleep(Duration::from_millis(fault.dark_ms));
                proxy.blackhole(false);
                hproxy.blackhole(false);
            }
            Kind::BlackholeCut => {
                proxy.blackhole(true);
                hproxy.blackhole(true);
                std::thread::sleep(Duration::from_millis(fault.dark_ms));
                proxy.cut_all();
                hproxy.cut_all();
                std::thread::sleep(Duration::from_millis(fault.dark_ms / 2));
                proxy.blackhole(false);
                hproxy.blackhole(false);
            }
            Kind::DaemonKill => {
                daemon.kill();
                daemon_down = true;
            }
            Kind::SshdRestart => env.sshd.restart(),
            Kind::McpKill => match &flying[0] {
                InFlight::Mcp { pid, .. } => unsafe {
                    libc::kill(*pid as i32, libc::SIGKILL);
                },
                InFlight::Cli(_) => unreachable!("the first action of an mcp_kill batch is MCP"),
            },
        }

        // The first answers.
        let mut answers = Vec::new();
        for (a, f) in batch.iter().zip(flying) {
            answers.push(match f {
                InFlight::Cli(c) => {
                    let out = c.finish(&a.name);
                    eprintln!(
                        "$ waymark {} [{:?}]\n[exit {:?}]\n{}{}",
                        call_args(a).join(" "),
                        fault.kind,
                        out.status.code(),
                        stdout(&out),
                        stderr(&out)
                    );
                    Answer::Cli(out)
                }
                InFlight::Mcp { task, .. } => {
                    let v = rt
                        .block_on(async { tokio::time::timeout(CALL_LIMIT, task).await })
                        .unwrap_or_else(|_| panic!("{}: the MCP call hung", a.name))
                        .unwrap();
                    eprintln!("mcp {} [{:?}] -> {v:?}", a.name, fault.kind);
                    Answer::Mcp(v)
                }
            });
        }
        if let Some(point) = fault.kind.crash_point() {
            // The crashing daemon must have died by its own SIGKILL at that point.
            let deadline = Instant::now() + Duration::from_secs(30);
            let status = loop {
                if let Some(s) = daemon.0.try_wait().unwrap() {
                    break s;
                }
                assert!(
                    Instant::now() < deadline,
                    "batch {b}: the daemon did not crash at {point}"
                );
                std::thread::sleep(Duration::from_millis(20));
            };
            assert!(
                status.code().is_none(),
                "batch {b}: the daemon died by a signal at {point}, not {status:?}"
            );
            daemon_down = true;
        }
        if daemon_down {
            strays += kill_stray_daemons(&env);
            daemon = start_daemon(&env, &[]);
            std::thread::sleep(Duration::from_millis(300));
            let exited = daemon.0.try_wait().unwrap();
            assert!(
                exited.is_none(),
                "batch {b}: the daemon just started (pid {}) exited: {exited:?}; daemons now: {:?}",
                daemon.0.id(),
                env.daemons()
            );
            assert_eq!(
                env.daemon_pid(),
                daemon.0.id(),
                "batch {b}: the daemon answering is the one just started"
            );
        }
        // Faults end; recovery happens on a healed network, as after any outage, and the API
        // answers at once.
        proxy.heal();
        hproxy.heal();
        api.set_processing_time(Duration::ZERO);
        if fault.kind == Kind::SshdRestart {
            assert!(env.sshd.is_running(), "the sshd came back");
        }

        // Recover each action as an agent would.
        for (a, answer) in batch.iter().zip(answers) {
            let mut r = Report::default();
            let mut settled_now = false;
            let first_final = match &answer {
                Answer::Cli(out) => !matches!(
                    out.status.code(),
                    None | Some(200) | Some(201) | Some(204) | Some(205)
                ),
                Answer::Mcp(Some(v)) => settled(v["state"].as_str().unwrap_or("?")),
                Answer::Mcp(None) => false,
            };
            match &answer {
                Answer::Cli(out) => {
                    let seen = ids_in(out);
                    assert!(
                        seen.len() <= 1,
                        "{}: the first call named one execution: {seen:?}",
                        a.name
                    );
                    if let Some(id) = seen.into_iter().next() {
                        r.see(&id);
                    }
                    r.first_unknown = out.status.code() == Some(200);
                }
                Answer::Mcp(Some(v)) => {
                    if let Some(id) = v["id"].as_str() {
                        r.see(id);
                    }
                    r.first_unknown = v["state"] == "unknown";
                }
                Answer::Mcp(None) => {}
            }
            // A command that ran names its execution on the host; a request that reached the
            // API, by its key.
            for (id, n) in effects(&env, &api) {
                if n == a.name {
                    if let Some(cur) = r.current() {
                        assert_eq!(
                            cur, id,
                            "{}: the host ran the execution the caller was told of",
                            a.name
                        );
                    }
                    r.see(&id);
                }
            }
            // No final answer: an agent that retries does so at once (a lost MCP answer is
            // retried from a new shim); one that resumes sends the same id again.
            if !first_final {
                let lost_mcp_answer = matches!(answer, Answer::Mcp(None));
                if a.recover == Recover::Resume && r.current().is_some() && !lost_mcp_answer {
                    resume(&env, a, &mut r);
                } else {
                    // What the first answer said of the execution: "did not start" (201) makes
                    // a new execution right.
                    let said = match &answer {
                        Answer::Cli(out) if out.status.code() == Some(201) => "failed",
                        Answer::Mcp(Some(v)) => v["state"].as_str().unwrap_or("?"),
                        _ => "?",
                    };
                    retry(&env, &rt, a, &mut r, said);
                }
            }
            for step in 0..=MAX_RECOVERY {
                let state = match r.current().map(str::to_string) {
                    Some(id) => {
                        let st = status(&env, &id);
                        r.statuses += 1;
                        assert_eq!(st["id"], id, "{}: status names the execution", a.name);
                        st["state"].as_str().unwrap_or("?").to_string()
                    }
                    None => "none".to_string(),
                };
                if settled(&state) {
                    settled_now = true;
                    break;
                }
                if step == MAX_RECOVERY {
                    break;
                }
                std::thread::sleep(Duration::from_millis(200 * step as u64));
                let resumable = matches!(state.as_str(), "dispatched" | "unknown" | "authorized");
                if a.recover == Recover::Resume && resumable {
                    resume(&env, a, &mut r);
                } else {
                    retry(&env, &rt, a, &mut r, &state);
                }
            }
            if !settled_now {
                eprintln!(
                    "chaos: {} not settled after {MAX_RECOVERY} recovery steps",
                    a.name
                );
            }
            reports.insert(a.name.clone(), r);
            actions.push(a.clone());
        }
        let e = by_kind.entry(fault.kind).or_default();
        e.0 += 1;
        e.1 += batch.len();
        e.2 += batch.iter().filter(|a| a.http()).count();
        e.3 += proxy.stats().accepted - accepted_before;
    }
    drop(daemon);
    strays += kill_stray_daemons(&env);

    // The API performed one effect per key it received, no more (a request it recorded is
    // charged once its processing ends; none is still processing by now, but wait a little).
    let keys: BTreeSet<String> = http_requests(&api).into_iter().map(|(k, _)| k).collect();
    let http_actions = batches
        .iter()
        .flat_map(|(_, b)| b)
        .filter(|a| a.http())
        .count();
    let deadline = Instant::now() + Duration::from_secs(5);
    while api.effects() < keys.len() as u64 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    let charged = api.effects();

    // The host and the API: no execution id twice, no action under two ids.
    let entries = effects(&env, &api);
    let mut per_id: BTreeMap<&str, usize> = BTreeMap::new();
    let mut per_name: BTreeMap<&str, BTreeSet<&str>> = BTreeMap::new();
    for (id, name) in &entries {
        *per_id.entry(id).or_default() += 1;
        per_name.entry(name).or_default().insert(id);
    }
    let duplicates: Vec<(&str, usize)> = per_id
        .iter()
        .filter(|(_, c)| **c > 1)
        .map(|(i, c)| (*i, *c))
        .collect();
    let twice: Vec<(&str, &BTreeSet<&str>)> = per_name
        .iter()
        .filter(|(_, ids)| ids.len() > 1)
        .map(|(n, ids)| (*n, ids))
        .collect();
    for (id, name) in &entries {
        let r = reports
            .get(name.as_str())
            .unwrap_or_else(|| panic!("a counter line no action wrote: {id} {name}"));
        assert!(
            r.ids.contains(id),
            "{name}: ran as {id}, an execution it was never told of ({:?})",
            r.ids
        );
    }

    // The ledger: every execution belongs to an action; per action, every execution but the
    // last is proven not started; the last is proven, or unresolved with its reason.
    let ledger = env.ledger_records();
    let mut owner: BTreeMap<&str, &str> = BTreeMap::new();
    for (name, r) in &reports {
        for id in &r.ids {
            assert!(
                owner.insert(id, name).is_none(),
                "{id} is claimed by two actions"
            );
            assert!(ledger.contains_key(id), "{name}: {id} is in the ledger");
        }
    }
    for id in ledger.keys() {
        assert!(
            owner.contains_key(id.as_str()),
            "execution {id} belongs to no action: a retry minted an id nobody was told of"
        );
    }
    let mut unresolved: Vec<(String, String, String)> = Vec::new();
    let mut proven = 0;
    for a in &actions {
        let r = &reports[&a.name];
        let ran: BTreeSet<&str> = per_name.get(a.name.as_str()).cloned().unwrap_or_default();
        assert!(
            !r.ids.is_empty(),
            "{}: no execution id after recovery: a silent loss",
            a.name
        );
        for (i, id) in r.ids.iter().enumerate() {
            let rec = &ledger[id];
            let state = rec["state"].as_str().unwrap();
            if i + 1 < r.ids.len() {
                assert_eq!(
                    state, "failed",
                    "{}: {id} was replaced by a new execution, so it is proven not started",
                    a.name
                );
            }
            if state == "failed" {
                assert!(
                    !ran.contains(id.as_str()),
                    "{}: {id} is `failed` (proven not started) but ran on the host or was charged by the API",
                    a.name
                );
            }
            if state == "completed" {
                assert!(
                    ran.contains(id.as_str()),
                    "{}: {id} is completed but its line is not on the host nor its key charged by the API",
                    a.name
                );
            }
        }
        let last = r.current().unwrap();
        let rec = &ledger[last];
        let state = rec["state"].as_str().unwrap();
        if matches!(state, "completed" | "failed" | "timed_out" | "cancelled") {
            proven += 1;
        } else {
            let reason = rec["reason"].as_str().unwrap_or("").to_string();
            assert!(
                !reason.is_empty(),
                "{}: {last} ended {state} with no reason: {rec}",
                a.name
            );
            unresolved.push((a.name.clone(), state.to_string(), reason));
        }
    }

    let audit = env.run(&["audit", "verify"]);
    let audit_ok = audit.status.code() == Some(0);

    // The table.
    let sum = |f: fn(&Report) -> usize| reports.values().map(f).sum::<usize>();
    let first_unknown = sum(|r| usize::from(r.first_unknown));
    eprintln!(
        "\n==== chaos summary (seed {seed}, profile {}) ====",
        prof.name
    );
    eprintln!(
        "actions            {} ({} HTTP: {} keys sent, {} charged by the API)",
        actions.len(),
        http_actions,
        keys.len(),
        charged
    );
    eprintln!("batches            {}", batches.len());
    eprintln!("faults by kind     (batches / actions in flight / HTTP ones / new SSH connections)");
    for (k, (nb, na, nh, nc)) in &by_kind {
        eprintln!("  {:<18} {nb:>3} / {na:>3} / {nh:>3} / {nc:>3}", k.name());
    }
    eprintln!("unknown answers    {first_unknown} (first answers that were unknown)");
    eprintln!(
        "recovery           {} status, {} resume, {} retry ({} attached)",
        sum(|r| r.statuses),
        sum(|r| r.resumes),
        sum(|r| r.retries),
        sum(|r| r.attached)
    );
    eprintln!(
        "executions         {} for {} actions ({} proven not started, replaced)",
        ledger.len(),
        actions.len(),
        ledger.len() - actions.len()
    );
    eprintln!("stray daemons      {strays} (started by a shim while ours was down)");
    eprintln!(
        "duplicates         {} (must be 0)",
        duplicates.len() + twice.len()
    );
    eprintln!("proven             {proven}");
    eprintln!("unresolved         {}", unresolved.len());
    for (n, s, why) in &unresolved {
        eprintln!("  {n}: {s}: {why}");
    }
    eprintln!(
        "audit verify       {}",
        if audit_ok { "ok" } else { "FAILED" }
    );
    eprintln!(
        "wall time          {:.1} s",
        started.elapsed().as_secs_f64()
    );
    eprintln!("replay             WAYMARK_CHAOS_SEED={seed}");
    eprintln!("=========================================");

    assert!(
        duplicates.is_empty(),
        "execution ids on the host twice: {duplicates:?}"
    );
    assert!(twice.is_empty(), "actions run under two ids: {twice:?}");
    assert_eq!(
        charged,
        keys.len() as u64,
        "the API charged once per Idempotency-Key it received ({keys:?})"
    );
    assert!(audit_ok, "audit verify: {}", stdout(&audit));
    if by_kind.contains_key(&Kind::BlackholeCut) || by_kind.contains_key(&Kind::BlackholeLong) {
        assert!(
            first_unknown > 0,
            "a connection lost in the dark must leave some call unknown"
        );
    }
}
