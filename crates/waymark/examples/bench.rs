//! The peer benchmark: Waymark's release daemon side by side with OpenSSH (multiplexed and
//! fresh), `parallel-ssh` and Ansible, in one run, against OpenSSH sshd instances on loopback
//! started by the test kit. Prints one table of medians and ratios.
//!
//! ```text
//! ./scripts/bench                 # installs what is missing, builds, runs this
//! BENCH_QUICK=1 ./scripts/bench   # smaller counts, for a smoke run
//! ```
//!
//! Run directly (after `cargo build --release`):
//! `cargo run --release -p waymark --example bench`. Environment:
//! `BENCH_WAYMARK` (the `waymark` binary; default: next to this example's directory),
//! `BENCH_ANSIBLE` (the `ansible` program; default `ansible` on PATH), `BENCH_QUICK=1`,
//! `BENCH_ONLY=latency` (the latency rows alone, and where the protocol call's time goes), `BENCH_ONLY=http` (the HTTP rows alone),
//! `BENCH_ONLY=throughput` (the throughput rows alone) or `BENCH_ONLY=inflight` (the in-flight
//! and recovery rows alone), `BENCH_ONLY=stream` (the streaming-output rows alone),
//! `BENCH_ONLY=slowlogin` (the burst on a slow-login host alone). `BENCH_SERVE=off` sends every
//! request to the hosts as its own exec instead of over serve channels.
//!
//! Not a timed test: it asserts only that every action succeeded.

use std::fmt::Write as _;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{Map, Value};
use waymark_protocol::client::{request, ClientError};
use waymark_protocol::{Frame, Request};
use waymark_ssh::wrapper::{RemoteDir, RemoteWrapper, StartOptions};
use waymark_testkit::{SshdOptions, TestHttpApi, TestSshd};

#[path = "bench/http.rs"]
mod http;

/// A fresh execution id for a wrapper call made outside Waymark (time + a counter).
fn fresh_id() -> String {
    const CROCKFORD: &[u8] = b"0123456789ABCDEFGHJKMNPQRSTVWXYZ";
    static N: AtomicUsize = AtomicUsize::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    let mut v: u128 = (nanos << 24) ^ N.fetch_add(1, Ordering::Relaxed) as u128;
    let mut chars = [b'0'; 26];
    for c in chars.iter_mut().rev() {
        *c = CROCKFORD[(v & 31) as usize];
        v >>= 5;
    }
    format!("act_{}", std::str::from_utf8(&chars).unwrap())
}

/// Counts for one run (full or quick).
struct Plan {
    quick: bool,
    latency_iters: usize,
    fresh_iters: usize,
    ansible_iters: usize,
    throughput_actions: usize,
    concurrencies: Vec<usize>,
    hosts: usize,
    fanout_reps: usize,
    ansible_fanout_reps: usize,
    inflight: usize,
    /// `BENCH_ONLY=latency`: only the Waymark-vs-ControlMaster latency rows (a quick check
    /// while working on the per-action cost).
    latency_only: bool,
    /// `BENCH_ONLY=http`: only the durable-HTTP-action-vs-curl rows.
    http_only: bool,
    /// `BENCH_ONLY=inflight`: only the executions-in-flight and recovery rows.
    inflight_only: bool,
    /// `BENCH_ONLY=throughput`: only the throughput rows (with their host CPU).
    throughput_only: bool,
    /// `BENCH_ONLY=stream`: only the streaming-output rows.
    stream_only: bool,
    /// Calls at once in the streaming rows.
    streams: usize,
    /// `BENCH_ONLY=slowlogin`: only the burst on a slow-login host.
    slow_login_only: bool,
    /// Calls at once in the burst on a slow-login host.
    slow_burst: usize,
}

impl Plan {
    fn from_env() -> Plan {
        let quick = std::env::var("BENCH_QUICK").is_ok_and(|v| !v.is_empty() && v != "0");
        let latency_only = std::env::var("BENCH_ONLY").is_ok_and(|v| v == "latency");
        let http_only = std::env::var("BENCH_ONLY").is_ok_and(|v| v == "http");
        let inflight_only = std::env::var("BENCH_ONLY").is_ok_and(|v| v == "inflight");
        let throughput_only = std::env::var("BENCH_ONLY").is_ok_and(|v| v == "throughput");
        let stream_only = std::env::var("BENCH_ONLY").is_ok_and(|v| v == "stream");
        let slow_login_only = std::env::var("BENCH_ONLY").is_ok_and(|v| v == "slowlogin");
        if quick {
            Plan {
                quick,
                latency_iters: 30,
                fresh_iters: 10,
                ansible_iters: 2,
                throughput_actions: 200,
                concurrencies: vec![1, 8, 32, 64],
                hosts: 10,
                fanout_reps: 3,
                ansible_fanout_reps: 1,
                inflight: 200,
                latency_only,
                http_only,
                inflight_only,
                throughput_only,
                stream_only,
                streams: 5,
                slow_login_only,
                slow_burst: 100,
            }
        } else {
            Plan {
                quick,
                latency_iters: 200,
                fresh_iters: 50,
                ansible_iters: 10,
                throughput_actions: 1000,
                concurrencies: vec![1, 8, 32, 64],
                hosts: 50,
                fanout_reps: 15,
                ansible_fanout_reps: 3,
                inflight: 1000,
                latency_only,
                http_only,
                inflight_only,
                throughput_only,
                stream_only,
                streams: 20,
                slow_login_only,
                slow_burst: 200,
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Statistics and the table.

fn median(v: &[f64]) -> f64 {
    percentile(v, 0.5)
}

fn percentile(v: &[f64], p: f64) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(|a, b| a.partial_cmp(b).unwrap());
    if s.is_empty() {
        return f64::NAN;
    }
    let i = ((s.len() - 1) as f64 * p).round() as usize;
    s[i]
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

struct Row {
    measure: String,
    waymark: String,
    peer: String,
    ratio: String,
    target: String,
    met: String,
    n: String,
}

#[derive(Default)]
struct Table {
    rows: Vec<Row>,
    notes: Vec<String>,
}

impl Table {
    #[allow(clippy::too_many_arguments)]
    fn add(
        &mut self,
        measure: impl Into<String>,
        waymark: impl Into<String>,
        peer: impl Into<String>,
        ratio: impl Into<String>,
        target: impl Into<String>,
        met: Option<bool>,
        n: impl Into<String>,
    ) {
        let row = Row {
            measure: measure.into(),
            waymark: waymark.into(),
            peer: peer.into(),
            ratio: ratio.into(),
            target: target.into(),
            met: match met {
                Some(true) => "yes".into(),
                Some(false) => "NO".into(),
                None => "".into(),
            },
            n: n.into(),
        };
        eprintln!(
            "bench: {} | {} | {} | {} | {} | {}",
            row.measure, row.waymark, row.peer, row.ratio, row.target, row.met
        );
        self.rows.push(row);
    }

    fn render(&self) -> String {
        let head = ["measure", "waymark", "peer", "ratio", "target", "met?", "n"];
        let cells: Vec<[&str; 7]> = self
            .rows
            .iter()
            .map(|r| {
                [
                    r.measure.as_str(),
                    r.waymark.as_str(),
                    r.peer.as_str(),
                    r.ratio.as_str(),
                    r.target.as_str(),
                    r.met.as_str(),
                    r.n.as_str(),
                ]
            })
            .collect();
        let mut out = String::new();
        let line = |c: &[&str; 7]| format!("| {} |\n", c.join(" | "));
        out.push_str(&line(&head));
        out.push_str("| --- | ---: | ---: | ---: | --- | --- | --- |\n");
        for c in &cells {
            out.push_str(&line(c));
        }
        for n in &self.notes {
            let _ = writeln!(out, "\n{n}");
        }
        out
    }
}

// ---------------------------------------------------------------------------------------------
// The daemon and its configuration.

struct Daemon {
    child: Option<Child>,
    log: PathBuf,
}

impl Daemon {
    fn pid(&self) -> u32 {
        self.child.as_ref().expect("running").id()
    }

    fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    fn log_text(&self) -> String {
        fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        self.kill();
    }
}

struct Env {
    dir: tempfile::TempDir,
    bin: PathBuf,
    config: PathBuf,
    socket: PathBuf,
    /// The daemon's Prometheus endpoint, for the latency breakdown.
    metrics_port: u16,
    /// hosts[0] is the one every single-host measure uses.
    hosts: Vec<TestSshd>,
    /// A host whose every login holds a host-wide lock for [`SLOW_LOGIN`], named
    /// [`SLOW_HOST`]: its logins queue (see [`slow_login_row`]).
    slow: TestSshd,
    key: PathBuf,
    known_hosts: PathBuf,
    daemon_starts: usize,
    /// The test kit's HTTP API, for the HTTP rows.
    http_api: TestHttpApi,
}

/// How long each login holds the slow host's lock.
const SLOW_LOGIN: Duration = Duration::from_millis(300);
/// The slow-login host's name in the configuration.
const SLOW_HOST: &str = "slow";

fn host_name(i: usize) -> String {
    format!("h{i:02}")
}

impl Env {
    fn new(plan: &Plan, bin: PathBuf) -> Env {
        let dir = tempfile::Builder::new()
            .prefix("waymark-bench-")
            .tempdir()
            .unwrap();
        let start = Instant::now();
        let hosts: Vec<TestSshd> = (0..plan.hosts).map(|_| TestSshd::new()).collect();
        eprintln!(
            "bench: {} sshd instances on loopback in {:.1} s",
            hosts.len(),
            start.elapsed().as_secs_f64()
        );
        // One user key and one known_hosts file for every tool.
        let key = hosts[0].user_key_path().to_path_buf();
        let mut known = String::new();
        for h in &hosts {
            if !std::ptr::eq(h, &hosts[0]) {
                h.authorize_key(hosts[0].user_key_public());
            }
            known.push_str(&fs::read_to_string(h.known_hosts_path()).unwrap());
        }
        let slow = TestSshd::with_options(SshdOptions::default().serialized_login(SLOW_LOGIN));
        slow.authorize_key(hosts[0].user_key_public());
        known.push_str(&fs::read_to_string(slow.known_hosts_path()).unwrap());
        let known_hosts = dir.path().join("known_hosts");
        fs::write(&known_hosts, known).unwrap();

        let socket = dir.path().join("run/daemon.sock");
        let metrics_port = waymark_testkit::free_port();
        let mut text = format!(
            r#"[ledger]
path = "{ledger}"

[daemon]
socket = "{socket}"
metrics_listen = "127.0.0.1:{metrics_port}"

[policy]
default_approval = "none"

[credentials.k]
key_file = "{key}"

[tools.noop]
description = "true, with a distinct argument per call."
host_arg = true
hosts = [{hosts}, "{slow}"]
argv = ["true", "{{n}}"]
contract = "idempotent"
timeout = "60s"

[tools.noop.args.n]
type = "string"
pattern = "[0-9]+"

[tools.nap]
description = "sleep; the fraction makes each call distinct."
host_arg = true
hosts = [{hosts}]
argv = ["sleep", "{{t}}"]
contract = "idempotent"
timeout = "30m"

[tools.nap.args.t]
type = "string"
pattern = "[0-9]+[.][0-9]+"

[tools.drip]
description = "Prints a line every 0.1 s for 3 s (one program: perl sleeps without a fork)."
host_arg = true
hosts = [{hosts}]
argv = ["perl", "-e", "$| = 1; for (1 .. 30) {{{{ print qq(line $_ of $ARGV[0]\\n); select(undef, undef, undef, 0.1) }}}}", "{{n}}"]
contract = "idempotent"
timeout = "60s"

[tools.drip.args.n]
type = "string"
pattern = "[0-9]+"
"#,
            ledger = dir.path().join("ledger").display(),
            socket = socket.display(),
            metrics_port = metrics_port,
            slow = SLOW_HOST,
            key = key.display(),
            hosts = (0..hosts.len())
                .map(|i| format!("\"{}\"", host_name(i)))
                .collect::<Vec<_>>()
                .join(", "),
        );
        let named = hosts
            .iter()
            .enumerate()
            .map(|(i, h)| (host_name(i), h))
            .chain([(SLOW_HOST.to_string(), &slow)]);
        for (name, h) in named {
            text.push_str(&h.waymark_host_toml(&name, "k", h.port(), &known_hosts));
            // BENCH_SERVE=off: every request as its own exec, to compare with serve channels.
            if std::env::var("BENCH_SERVE").is_ok_and(|v| v == "off") {
                text.push_str("serve = false\n");
            }
        }
        let http_api = TestHttpApi::start();
        text.push_str(&http::tool(&http_api));
        let config = dir.path().join("waymark.toml");
        fs::write(&config, text).unwrap();
        // What `waymark init` does: a daemon never makes its ledger.
        drop(waymark_ledger::Ledger::init(&dir.path().join("ledger")).unwrap());
        let _ = SSH_LOG.set(dir.path().join("ssh.log"));
        Env {
            dir,
            bin,
            config,
            socket,
            metrics_port,
            hosts,
            slow,
            key,
            known_hosts,
            daemon_starts: 0,
            http_api,
        }
    }

    fn waymark(&self) -> Command {
        let mut c = Command::new(&self.bin);
        c.arg("--config").arg(&self.config).stdin(Stdio::null());
        c
    }

    /// Starts the release daemon; returns it once its socket accepts connections.
    fn start_daemon(&mut self) -> (Daemon, Instant) {
        self.daemon_starts += 1;
        let log = self
            .dir
            .path()
            .join(format!("daemon-{}.log", self.daemon_starts));
        let started = Instant::now();
        let child = self
            .waymark()
            .arg("daemon")
            .stdout(Stdio::null())
            .stderr(fs::File::create(&log).unwrap())
            .spawn()
            .expect("start the waymark daemon");
        let daemon = Daemon {
            child: Some(child),
            log,
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        while Instant::now() < deadline {
            if std::os::unix::net::UnixStream::connect(&self.socket).is_ok() {
                return (daemon, started);
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        panic!(
            "the daemon did not listen within 30 s:\n{}",
            daemon.log_text()
        );
    }

    fn ssh(&self, i: usize) -> Command {
        self.ssh_to(&self.hosts[i])
    }

    fn ssh_to(&self, h: &TestSshd) -> Command {
        let mut cmd = Command::new("ssh");
        cmd.args(["-F", "/dev/null", "-i"])
            .arg(&self.key)
            .args(["-p", &h.port().to_string(), "-l", h.user()])
            .args(["-o", "IdentitiesOnly=yes", "-o", "IdentityAgent=none"])
            .arg("-o")
            .arg(format!("UserKnownHostsFile={}", self.known_hosts.display()))
            .args([
                "-o",
                "GlobalKnownHostsFile=/dev/null",
                "-o",
                "StrictHostKeyChecking=yes",
                "-o",
                "BatchMode=yes",
                "127.0.0.1",
            ])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(self.ssh_log());
        cmd
    }

    /// ssh's diagnostics go to a file: a ControlPersist master keeps its stderr open for
    /// minutes, so a pipe would never see its end.
    fn ssh_log(&self) -> fs::File {
        fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.path().join("ssh.log"))
            .unwrap()
    }

    fn ssh_mux(&self, i: usize) -> Command {
        self.ssh_mux_on(i, 0)
    }

    /// `ssh` to host `i` through ControlMaster number `master` (each its own connection).
    fn ssh_mux_on(&self, i: usize, master: usize) -> Command {
        let mut cmd = self.ssh(i);
        cmd.args(["-o", "ControlMaster=auto", "-o"])
            .arg(format!(
                "ControlPath={}",
                self.dir.path().join(format!("cm-{master}-%C")).display()
            ))
            .args(["-o", "ControlPersist=120"]);
        cmd
    }

    fn ansible_inventory(&self, count: usize) -> PathBuf {
        let python = if Path::new("/usr/bin/python3").exists() {
            "/usr/bin/python3".to_string()
        } else {
            "python3".to_string()
        };
        let mut inv = String::from("[bench]\n");
        for (i, h) in self.hosts.iter().take(count).enumerate() {
            let _ = writeln!(
                inv,
                "{name} ansible_host=127.0.0.1 ansible_port={port} ansible_user={user} \
                 ansible_ssh_private_key_file={key} ansible_python_interpreter={python}",
                name = host_name(i),
                port = h.port(),
                user = h.user(),
                key = self.key.display(),
            );
        }
        let _ = writeln!(
            inv,
            "\n[bench:vars]\nansible_ssh_common_args='-F /dev/null -o IdentitiesOnly=yes \
             -o UserKnownHostsFile={} -o GlobalKnownHostsFile=/dev/null \
             -o StrictHostKeyChecking=yes'",
            self.known_hosts.display()
        );
        let path = self.dir.path().join(format!("inventory-{count}.ini"));
        fs::write(&path, inv).unwrap();
        path
    }

    fn ansible(&self, program: &str) -> Command {
        let mut cmd = Command::new(program);
        let adir = self.dir.path().join("ansible");
        fs::create_dir_all(&adir).unwrap();
        // Nothing from the user's own ansible.cfg.
        let cfg = adir.join("ansible.cfg");
        fs::write(&cfg, "[defaults]\n").unwrap();
        cmd.env("ANSIBLE_HOST_KEY_CHECKING", "True")
            .env("ANSIBLE_LOCAL_TEMP", adir.join("tmp"))
            .env("ANSIBLE_SSH_CONTROL_PATH_DIR", adir.join("cp"))
            // sshd sets HOME for the session (SetEnv) while Ansible expands `~` from the
            // passwd entry: an absolute async dir keeps the job files where both look.
            .env("ANSIBLE_ASYNC_DIR", adir.join("async"))
            .env("ANSIBLE_NOCOLOR", "1")
            .env("ANSIBLE_DEPRECATION_WARNINGS", "False")
            .env("ANSIBLE_CONFIG", &cfg)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        cmd
    }
}

static SSH_LOG: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();

fn timed(cmd: &mut Command, what: &str) -> Duration {
    let start = Instant::now();
    let out = cmd.output().unwrap_or_else(|e| panic!("{what}: {e}"));
    let elapsed = start.elapsed();
    assert!(
        out.status.success(),
        "{what} failed ({}):\n{}{}\nssh log:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
        SSH_LOG
            .get()
            .and_then(|p| fs::read_to_string(p).ok())
            .unwrap_or_default()
    );
    elapsed
}

fn call_request(tool: &str, host: usize, arg: (&str, String)) -> Request {
    call_request_on(tool, &host_name(host), arg)
}

fn call_request_on(tool: &str, host: &str, arg: (&str, String)) -> Request {
    let mut args = Map::new();
    args.insert(arg.0.into(), Value::String(arg.1));
    Request::Call {
        tool: Some(tool.into()),
        args,
        host: Some(host.to_string()),
        raw: None,
        key: None,
        transport: Some("bench".into()),
        defer_delivery: false,
    }
}

/// Streaming output: `plan.streams` calls at once, each a command that prints a line every
/// 0.1 s for 3 s (`drip`: one `perl`, no program per line), made over the control protocol
/// with their output told live, beside as many `ssh` calls of the same command through
/// ControlMaster (8 clients a master), whose output sshd pushes as it comes. Host CPU per
/// call (the sshd cgroup: everything the host spent, the command's own CPU included on both
/// sides), the daemon's CPU per call, and how many of the 30 lines each Waymark call was told
/// before it ended.
fn stream_rows(
    plan: &Plan,
    env: &Env,
    rt: &tokio::runtime::Runtime,
    daemon_pid: u32,
    host_cpu: Option<&HostCpu>,
    counter: &Arc<AtomicUsize>,
    table: &mut Table,
) {
    let c = plan.streams;
    let script = "$| = 1; for (1 .. 30) { print qq(line $_ of $ARGV[0]\n); select(undef, undef, undef, 0.1) }";
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    let ticks = cpu_ticks(daemon_pid);
    let ((walls, told), host) = with_host_cpu(host_cpu, c, || {
        rt.block_on(async {
            let tasks: Vec<_> = (0..c)
                .map(|_| {
                    let n = counter.fetch_add(1, Ordering::Relaxed);
                    let socket = env.socket.clone();
                    tokio::spawn(async move {
                        let start = Instant::now();
                        let mut pieces = 0usize;
                        let frame = request(
                            &socket,
                            call_request("drip", 0, ("n", n.to_string())),
                            |e| {
                                if let waymark_protocol::Event::Output { .. } = e {
                                    pieces += 1;
                                }
                            },
                        )
                        .await
                        .unwrap_or_else(|e| panic!("drip failed: {e:?}"));
                        assert!(matches!(frame, Frame::Done { exit: 0, .. }), "{frame:?}");
                        (ms(start.elapsed()), pieces)
                    })
                })
                .collect();
            let mut walls = Vec::new();
            let mut told = Vec::new();
            for t in tasks {
                let (w, l) = t.await.unwrap();
                walls.push(w);
                told.push(l as f64);
            }
            (walls, told)
        })
    });
    let daemon_ms = (cpu_ticks(daemon_pid) - ticks) as f64 / hz * 1e3 / c as f64;
    warm_masters(env, c);
    let (ssh_walls, ssh_host) = with_host_cpu(host_cpu, c, || {
        let walls = std::sync::Mutex::new(Vec::new());
        std::thread::scope(|scope| {
            for t in 0..c {
                let walls = &walls;
                scope.spawn(move || {
                    let d = timed(
                        env.ssh_mux_on(0, t / 8)
                            .arg(format!("perl -e '{script}' {t}")),
                        "ssh mux drip",
                    );
                    walls.lock().unwrap().push(ms(d));
                });
            }
        });
        walls.into_inner().unwrap()
    });
    table.add(
        format!(
            "streaming: {c} calls at once, each a line every 0.1 s for 3 s, output told live: \
             host CPU per call (command included), daemon CPU per call, pieces told per call"
        ),
        format!(
            "host {host}; daemon {daemon_ms:.1} ms; {:.0} pieces (call {})",
            median(&told),
            fmt_ms(median(&walls))
        ),
        format!("host {ssh_host} (call {})", fmt_ms(median(&ssh_walls))),
        "",
        "",
        None,
        format!("{c} each"),
    );
}

/// The sum and count of every series of histogram `name` on the daemon's metrics endpoint.
fn scrape_histogram(port: u16, name: &str) -> (f64, f64) {
    use std::io::{Read, Write};
    let mut conn = std::net::TcpStream::connect(("127.0.0.1", port))
        .unwrap_or_else(|e| panic!("the daemon's metrics endpoint on port {port}: {e}"));
    conn.write_all(b"GET /metrics HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")
        .unwrap();
    let mut text = String::new();
    conn.read_to_string(&mut text).unwrap();
    let (mut sum, mut count) = (0.0, 0.0);
    for line in text.lines() {
        let Some(rest) = line.strip_prefix(name) else {
            continue;
        };
        let value = |r: &str| -> f64 {
            r.rsplit(' ')
                .next()
                .and_then(|v| v.parse().ok())
                .unwrap_or(0.0)
        };
        if rest.starts_with("_sum") {
            sum += value(rest);
        } else if rest.starts_with("_count") {
            count += value(rest);
        }
    }
    (sum, count)
}

/// Where a control-protocol call's time goes, next to the same for `ssh` with ControlMaster:
/// `n` calls of each, one after another, with the daemon's own histograms (its dispatch: from
/// the dispatch's record, flush included, to the host's reply; its ledger flushes), the host's
/// CPU (the sshd cgroup) and the daemon's CPU per call. A profile of the latency rows, not a
/// target.
fn latency_breakdown(
    env: &Env,
    rt: &tokio::runtime::Runtime,
    daemon_pid: u32,
    host_cpu: Option<&HostCpu>,
    n: usize,
    counter: &AtomicUsize,
    table: &mut Table,
) {
    let n = n.max(1);
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    let dispatch = "waymark_dispatch_duration_seconds";
    let flush = "waymark_ledger_flush_duration_seconds";
    let (d0, f0) = (
        scrape_histogram(env.metrics_port, dispatch),
        scrape_histogram(env.metrics_port, flush),
    );
    let ticks0 = cpu_ticks(daemon_pid);
    let mut walls = Vec::new();
    let (_, host) = with_host_cpu(host_cpu, n, || {
        for _ in 0..n {
            let i = counter.fetch_add(1, Ordering::Relaxed);
            walls.push(ms(rt.block_on(call_noop(&env.socket, 0, i))));
        }
    });
    let daemon_ms = (cpu_ticks(daemon_pid) - ticks0) as f64 / hz * 1e3 / n as f64;
    let (d1, f1) = (
        scrape_histogram(env.metrics_port, dispatch),
        scrape_histogram(env.metrics_port, flush),
    );
    let per = |a: (f64, f64), b: (f64, f64)| (b.0 - a.0) * 1e3 / (b.1 - a.1).max(1.0);
    let mut mux = Vec::new();
    let (_, mux_host) = with_host_cpu(host_cpu, n, || {
        for _ in 0..n {
            mux.push(ms(timed(env.ssh_mux(0).arg("true"), "ssh mux")));
        }
    });
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len().max(1) as f64;
    table.add(
        "latency breakdown (means): control-protocol call: its dispatch (dispatch flush + host \
         round trip) / ledger flushes per call x mean flush / host CPU / daemon CPU, per call",
        format!(
            "{} = dispatch {} + rest; {:.1} flushes x {}; host {host}; daemon {daemon_ms:.2} ms",
            fmt_ms(mean(&walls)),
            fmt_ms(per(d0, d1)),
            (f1.1 - f0.1) / n as f64,
            fmt_ms(per(f0, f1)),
        ),
        format!("ssh {}; host {mux_host}", fmt_ms(mean(&mux))),
        "",
        "",
        None,
        format!("{n} each"),
    );
}

/// One control-protocol call of `noop` to completion; panics unless it exited 0.
async fn call_noop(socket: &Path, host: usize, n: usize) -> Duration {
    let start = Instant::now();
    let frame = request(
        socket,
        call_request("noop", host, ("n", n.to_string())),
        |_| {},
    )
    .await
    .unwrap_or_else(|e| panic!("call failed: {e:?}"));
    let elapsed = start.elapsed();
    match frame {
        Frame::Done { exit: 0, .. } => elapsed,
        other => panic!("noop did not succeed: {other:?}"),
    }
}

fn rss_kib(pid: u32) -> u64 {
    let status = fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

fn threads(pid: u32) -> u64 {
    let status = fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("Threads:"))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0)
}

/// utime + stime of a process, in clock ticks.
fn cpu_ticks(pid: u32) -> u64 {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let after = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let f: Vec<&str> = after.split_whitespace().collect();
    // Fields after the command: state is f[0] (field 3); utime is field 14, stime 15.
    let u: u64 = f.get(11).and_then(|v| v.parse().ok()).unwrap_or(0);
    let s: u64 = f.get(12).and_then(|v| v.parse().ok()).unwrap_or(0);
    u + s
}

/// (busy, total) clock ticks of the whole machine, from /proc/stat.
fn machine_ticks() -> (u64, u64) {
    let stat = fs::read_to_string("/proc/stat").unwrap_or_default();
    let f: Vec<u64> = stat
        .lines()
        .next()
        .unwrap_or("")
        .split_whitespace()
        .skip(1)
        .filter_map(|v| v.parse().ok())
        .collect();
    let total: u64 = f.iter().take(8).sum();
    let idle = f.get(3).copied().unwrap_or(0) + f.get(4).copied().unwrap_or(0);
    (total - idle, total)
}

/// Where the CPU went while something ran: the daemon's share of one core and the whole
/// machine's busy share of all its cores.
struct CpuMeter {
    pid: u32,
    daemon: u64,
    machine: (u64, u64),
    start: Instant,
}

impl CpuMeter {
    fn start(pid: u32) -> CpuMeter {
        CpuMeter {
            pid,
            daemon: cpu_ticks(pid),
            machine: machine_ticks(),
            start: Instant::now(),
        }
    }

    /// The daemon's CPU since the start, as a share of one core.
    fn daemon_share(&self) -> f64 {
        let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
        let secs = self.start.elapsed().as_secs_f64();
        (cpu_ticks(self.pid) - self.daemon) as f64 / hz / secs
    }

    fn report(&self) -> String {
        let daemon = self.daemon_share();
        let (busy, total) = machine_ticks();
        let machine = (busy - self.machine.0) as f64 / (total - self.machine.1).max(1) as f64;
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        format!(
            "daemon {:.1}% of a core, machine {:.0}% of {cores} cores",
            daemon * 100.0,
            machine * 100.0
        )
    }
}

/// The CPU of everything one host's sshd runs: its per-connection processes, the login
/// shells, the wrapper, the commands, also those that outlive their session (a detached
/// supervisor), from a cgroup its listener is moved into before the first connection (every
/// process it forks is born there). `cpuacct` of cgroup v1, or `cpu.stat` of cgroup v2; `None`
/// where no cgroup can be made (not root): the rows then say "host CPU n/a".
struct HostCpu {
    dir: PathBuf,
    /// The cgroup the processes go back to when the bench ends.
    parent: PathBuf,
    v2: bool,
}

impl HostCpu {
    fn new(pid: u32) -> Option<HostCpu> {
        let name = format!("waymark-bench-{}", std::process::id());
        let roots = [
            ("/sys/fs/cgroup/cpuacct", false),
            ("/sys/fs/cgroup/cpu,cpuacct", false),
            ("/sys/fs/cgroup", true),
            ("/sys/fs/cgroup/unified", true),
        ];
        for (root, v2) in roots {
            let root = Path::new(root);
            let usage = if v2 { "cpu.stat" } else { "cpuacct.usage" };
            if !root.join(usage).exists() && !root.join("cgroup.procs").exists() {
                continue;
            }
            let dir = root.join(&name);
            if fs::create_dir(&dir).is_err() || !dir.join(usage).exists() {
                let _ = fs::remove_dir(&dir);
                continue;
            }
            if fs::write(dir.join("cgroup.procs"), pid.to_string()).is_err() {
                let _ = fs::remove_dir(&dir);
                continue;
            }
            return Some(HostCpu {
                dir,
                parent: root.to_path_buf(),
                v2,
            });
        }
        None
    }

    /// CPU used so far, in nanoseconds.
    fn used_ns(&self) -> u64 {
        if self.v2 {
            let stat = fs::read_to_string(self.dir.join("cpu.stat")).unwrap_or_default();
            stat.lines()
                .find_map(|l| l.strip_prefix("usage_usec "))
                .and_then(|v| v.trim().parse::<u64>().ok())
                .map_or(0, |us| us * 1000)
        } else {
            fs::read_to_string(self.dir.join("cpuacct.usage"))
                .ok()
                .and_then(|v| v.trim().parse().ok())
                .unwrap_or(0)
        }
    }
}

impl Drop for HostCpu {
    fn drop(&mut self) {
        // A cgroup is removed empty: its processes go back where they came from.
        for _ in 0..3 {
            let procs = fs::read_to_string(self.dir.join("cgroup.procs")).unwrap_or_default();
            for pid in procs.lines() {
                let _ = fs::write(self.parent.join("cgroup.procs"), pid);
            }
            if fs::remove_dir(&self.dir).is_ok() {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

/// What `f` returns, and the host CPU per action while it ran `actions` actions ("n/a" without
/// a [`HostCpu`]).
fn with_host_cpu<T>(host: Option<&HostCpu>, actions: usize, f: impl FnOnce() -> T) -> (T, String) {
    let before = host.map(HostCpu::used_ns);
    let out = f();
    let cpu = match (host, before) {
        (Some(h), Some(b)) => format!(
            "{:.2} ms",
            h.used_ns().saturating_sub(b) as f64 / 1e6 / actions.max(1) as f64
        ),
        _ => "n/a".into(),
    };
    (out, cpu)
}

/// Bare multiplexed `ssh … true` on host 0 from `c` clients at once, one ControlMaster per 8
/// of them (sshd allows 10 sessions a connection; the daemon's pool opens connections alike),
/// `total` in all: actions per second. The masters are up before (see [`warm_masters`]).
fn mux_rate(env: &Env, c: usize, total: usize) -> f64 {
    let issued = AtomicUsize::new(0);
    let start = Instant::now();
    std::thread::scope(|scope| {
        for t in 0..c {
            let issued = &issued;
            scope.spawn(move || {
                while issued.fetch_add(1, Ordering::Relaxed) < total {
                    timed(env.ssh_mux_on(0, t / 8).arg("true"), "ssh mux");
                }
            });
        }
    });
    total as f64 / start.elapsed().as_secs_f64()
}

/// Starts the ControlMasters [`mux_rate`] uses for `c` clients.
fn warm_masters(env: &Env, c: usize) {
    for m in 0..c.div_ceil(8) {
        timed(env.ssh_mux_on(0, m).arg("true"), "ssh mux");
    }
}

/// Markers on a host whose command is recorded and that have no exit record yet.
fn live_markers(remote_dir: &Path) -> Vec<PathBuf> {
    let Ok(rd) = fs::read_dir(remote_dir.join("exec")) else {
        return Vec::new();
    };
    // Marker layout 2: `exec/<id>` and its files `exec/<id>.cmd`, `exec/<id>.exit`, ...
    rd.filter_map(|e| e.ok())
        .map(|e| e.path())
        .filter(|p| {
            p.extension().is_none()
                && p.with_extension("cmd").exists()
                && !p.with_extension("exit").exists()
        })
        .collect()
}

/// The daemon colours its log even into a file; the table wants plain text.
fn strip_ansi(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut chars = s.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            for d in chars.by_ref() {
                if d.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

fn mib(kib: u64) -> String {
    format!("{:.1} MiB", kib as f64 / 1024.0)
}

fn fmt_ms(v: f64) -> String {
    if v >= 1000.0 {
        format!("{:.2} s", v / 1000.0)
    } else {
        format!("{v:.1} ms")
    }
}

/// The throughput rows: durable actions per second at several concurrencies, one host, each
/// beside bare multiplexed `ssh … true` from as many clients at once, with the CPU each
/// costs the host per action.
fn throughput_rows(
    plan: &Plan,
    env: &Env,
    rt: &tokio::runtime::Runtime,
    daemon_pid: u32,
    host_cpu: Option<&HostCpu>,
    n_counter: &Arc<AtomicUsize>,
    table: &mut Table,
) {
    let socket = env.socket.clone();
    for &c in &plan.concurrencies {
        let total = plan.throughput_actions;
        let issued = Arc::new(AtomicUsize::new(0));
        let meter = CpuMeter::start(daemon_pid);
        let ((lat, secs), host_w) = with_host_cpu(host_cpu, total, || {
            let start = Instant::now();
            let lat: Vec<f64> = rt.block_on(async {
                let mut tasks = Vec::new();
                for _ in 0..c {
                    let issued = issued.clone();
                    let counter = n_counter.clone();
                    let socket = socket.clone();
                    tasks.push(tokio::spawn(async move {
                        let mut lat = Vec::new();
                        while issued.fetch_add(1, Ordering::Relaxed) < total {
                            let n = counter.fetch_add(1, Ordering::Relaxed);
                            lat.push(ms(call_noop(&socket, 0, n).await));
                        }
                        lat
                    }));
                }
                let mut all = Vec::new();
                for t in tasks {
                    all.extend(t.await.unwrap());
                }
                all
            });
            (lat, start.elapsed().as_secs_f64())
        });
        let cpu = meter.report();
        let rate = total as f64 / secs;
        warm_masters(env, c);
        let (mux, host_m) = with_host_cpu(host_cpu, total, || mux_rate(env, c, total));
        let ratio = rate / mux;
        let (target, met) = if c == 32 {
            (">= 1.5x", Some(ratio >= 1.5))
        } else {
            ("", None)
        };
        table.add(
            format!(
                "throughput: durable `true` actions/s vs `ssh` multiplexed `true`, concurrency {c}, one host (host CPU per action)"
            ),
            format!(
                "{rate:.0}/s (call p50 {}, p95 {}; host {host_w}; {cpu})",
                fmt_ms(median(&lat)),
                fmt_ms(percentile(&lat, 0.95))
            ),
            format!("{mux:.0}/s (host {host_m})"),
            format!("{ratio:.2}x"),
            target,
            met,
            format!("{total} each"),
        );
    }

    table.notes.push(format!(
        "Host CPU per action: the CPU of everything host h00's sshd ran (its connections, login \
         shells, the wrapper, the commands and their supervisors), from a {} the listener was \
         moved into before anything connected, over the row's actions.",
        match host_cpu {
            Some(h) if h.v2 => "cgroup v2 (`cpu.stat`)",
            Some(_) => "cgroup v1 (`cpuacct.usage`)",
            None => "cgroup, which could not be made here (run as root): n/a",
        }
    ));
}

/// Prints the table of a `BENCH_ONLY` run, with a note of which rows it holds.
fn print_only(table: &mut Table, only: &str, rows: &str) {
    table.notes.push(format!("BENCH_ONLY={only}: {rows}"));
    println!("{}", table.render());
}

fn main() {
    let plan = Plan::from_env();
    let bin = std::env::var_os("BENCH_WAYMARK")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            let exe = std::env::current_exe().unwrap();
            // target/release/examples/bench → target/release/waymark
            exe.parent().and_then(Path::parent).unwrap().join("waymark")
        });
    assert!(
        bin.exists(),
        "no waymark binary at {}: run `cargo build --release` (or set BENCH_WAYMARK)",
        bin.display()
    );
    let ansible = std::env::var("BENCH_ANSIBLE").unwrap_or_else(|_| "ansible".into());
    let pssh = ["parallel-ssh", "pssh"]
        .into_iter()
        .find(|p| {
            Command::new(p)
                .arg("--version")
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status()
                .is_ok()
        })
        // The rows BENCH_ONLY keeps do not use it.
        .or((plan.latency_only
            || plan.http_only
            || plan.inflight_only
            || plan.throughput_only
            || plan.stream_only
            || plan.slow_login_only)
            .then_some("parallel-ssh"))
        .expect("parallel-ssh (Debian package pssh) is needed");
    let bench_start = Instant::now();
    let mut env = Env::new(&plan, bin);
    // Before anything connects to host 0: every process its sshd forks is counted.
    let host_cpu = HostCpu::new(env.hosts[0].listener_pid().expect("sshd h00 runs"));
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let mut table = Table::default();
    let socket = env.socket.clone();

    // ---- Memory, idle: a fresh daemon that has answered one ping.
    let (daemon, _) = env.start_daemon();
    rt.block_on(request(&socket, Request::Ping, |_| {}))
        .unwrap();
    std::thread::sleep(Duration::from_millis(500));
    let rss_fresh = rss_kib(daemon.pid());

    // ---- 1. Latency per action, host h00.
    let n_counter = Arc::new(AtomicUsize::new(1));
    let next = |c: &AtomicUsize| c.fetch_add(1, Ordering::Relaxed);
    let next_n = || n_counter.fetch_add(1, Ordering::Relaxed);
    if plan.slow_login_only {
        slow_login_row(&plan, &env, &rt, &socket, &n_counter, &mut table);
        print_only(
            &mut table,
            "slowlogin",
            "the burst on a slow-login host alone.",
        );
        return;
    }
    if plan.inflight_only {
        inflight_rows(&plan, &mut env, &rt, daemon, &socket, &mut table);
        print_only(
            &mut table,
            "inflight",
            "the in-flight and recovery rows alone.",
        );
        return;
    }
    if plan.http_only {
        http::rows(
            &env,
            &env.http_api,
            &rt,
            plan.latency_iters,
            &next_n,
            &mut table,
        );
        print_only(&mut table, "http", "the HTTP rows alone.");
        return;
    }
    // Warm up: the pool's connection and the wrapper install, and the ssh ControlMaster.
    for _ in 0..5 {
        timed(
            env.waymark()
                .args(["exec", "run", "--host", "h00", "noop"])
                .arg(format!("n={}", next(&n_counter))),
            "waymark exec run",
        );
        timed(env.ssh_mux(0).arg("true"), "ssh mux");
    }
    if plan.stream_only {
        stream_rows(
            &plan,
            &env,
            &rt,
            daemon.pid(),
            host_cpu.as_ref(),
            &n_counter,
            &mut table,
        );
        print_only(&mut table, "stream", "the streaming-output rows alone.");
        return;
    }
    if plan.throughput_only {
        throughput_rows(
            &plan,
            &env,
            &rt,
            daemon.pid(),
            host_cpu.as_ref(),
            &n_counter,
            &mut table,
        );
        print_only(&mut table, "throughput", "the throughput rows alone.");
        return;
    }
    let iters = plan.latency_iters;
    let mut cli = Vec::new();
    let mut proto = Vec::new();
    let mut mux = Vec::new();
    for _ in 0..iters {
        // Interleaved, so drift in the machine's load hits every column alike.
        cli.push(ms(timed(
            env.waymark()
                .args(["exec", "run", "--host", "h00", "noop"])
                .arg(format!("n={}", next(&n_counter)))
                .stdout(Stdio::null())
                .stderr(Stdio::null()),
            "waymark exec run",
        )));
        let n = next(&n_counter);
        proto.push(ms(rt.block_on(call_noop(&socket, 0, n))));
        mux.push(ms(timed(env.ssh_mux(0).arg("true"), "ssh mux")));
    }
    let (cli_m, proto_m, mux_m) = (median(&cli), median(&proto), median(&mux));
    table.add(
        "latency: `waymark exec run` (CLI process) vs `ssh` multiplexed (ControlMaster), `true`",
        format!("{} (p95 {})", fmt_ms(cli_m), fmt_ms(percentile(&cli, 0.95))),
        format!("{} (p95 {})", fmt_ms(mux_m), fmt_ms(percentile(&mux, 0.95))),
        format!("{:.2}x", cli_m / mux_m),
        // Issue 16's targets (they were 1.5x for both rows before it).
        "<= 1.0x",
        Some(cli_m / mux_m <= 1.0),
        format!("{iters} each"),
    );
    table.add(
        "latency: control-protocol call (no CLI process) vs `ssh` multiplexed",
        format!(
            "{} (p95 {})",
            fmt_ms(proto_m),
            fmt_ms(percentile(&proto, 0.95))
        ),
        fmt_ms(mux_m),
        format!("{:.2}x", proto_m / mux_m),
        "<= 0.7x",
        Some(proto_m / mux_m <= 0.7),
        format!("{iters} each"),
    );
    latency_breakdown(
        &env,
        &rt,
        daemon.pid(),
        host_cpu.as_ref(),
        iters / 2,
        &n_counter,
        &mut table,
    );
    http::rows(&env, &env.http_api, &rt, iters, &next_n, &mut table);
    if plan.latency_only {
        print_only(&mut table, "latency", "the latency rows alone.");
        return;
    }
    let fresh: Vec<f64> = (0..plan.fresh_iters)
        .map(|_| ms(timed(env.ssh(0).arg("true"), "ssh fresh")))
        .collect();
    let inv1 = env.ansible_inventory(1);
    // One unmeasured run: ansible's own first-run work and its ControlPersist master.
    let ansible_async = |env: &Env| {
        timed(
            env.ansible(&ansible).args([
                "h00",
                "-i",
                inv1.to_str().unwrap(),
                "-m",
                "command",
                "-a",
                "true",
                "-B",
                "30",
                "-P",
                "1",
            ]),
            "ansible async",
        )
    };
    ansible_async(&env);
    let ans: Vec<f64> = (0..plan.ansible_iters)
        .map(|_| ms(ansible_async(&env)))
        .collect();
    let (fresh_m, ans_m) = (median(&fresh), median(&ans));
    table.add(
        "latency: `waymark exec run` vs fresh `ssh` per call",
        fmt_ms(cli_m),
        format!(
            "{} (p95 {})",
            fmt_ms(fresh_m),
            fmt_ms(percentile(&fresh, 0.95))
        ),
        format!("{:.1}x faster", fresh_m / cli_m),
        ">= 3x faster",
        Some(fresh_m / cli_m >= 3.0),
        format!("{} ssh", plan.fresh_iters),
    );
    table.add(
        "latency: `waymark exec run` vs `ansible -m command -B 30 -P 1` (async + poll)",
        fmt_ms(cli_m),
        format!("{} (min {})", fmt_ms(ans_m), fmt_ms(percentile(&ans, 0.0))),
        format!("{:.0}x faster", ans_m / cli_m),
        ">= 20x faster",
        Some(ans_m / cli_m >= 20.0),
        format!("{} ansible", plan.ansible_iters),
    );

    let rss_after_latency = rss_kib(daemon.pid());

    stream_rows(
        &plan,
        &env,
        &rt,
        daemon.pid(),
        host_cpu.as_ref(),
        &n_counter,
        &mut table,
    );

    throughput_rows(
        &plan,
        &env,
        &rt,
        daemon.pid(),
        host_cpu.as_ref(),
        &n_counter,
        &mut table,
    );
    let rss_after_throughput = rss_kib(daemon.pid());

    // The ceiling this machine puts on any SSH action: OpenSSH multiplexed, 8 clients at once
    // (one master: MaxSessions 10), running `true`, and running the same wrapper `run` line
    // Waymark sends for `true` (no Waymark client, no ledger).
    let wrapper = RemoteWrapper::new(
        RemoteDir::new(&env.hosts[0].remote_dir().display().to_string()).unwrap(),
    );
    let ceiling = |line: Option<String>| -> f64 {
        let total = plan.throughput_actions;
        let issued = AtomicUsize::new(0);
        let start = Instant::now();
        std::thread::scope(|scope| {
            for _ in 0..8 {
                scope.spawn(|| {
                    while issued.fetch_add(1, Ordering::Relaxed) < total {
                        let cmd = match &line {
                            None => "true".to_string(),
                            Some(_) => wrapper
                                .run(
                                    &fresh_id(),
                                    &StartOptions {
                                        timeout: Some(Duration::from_secs(60)),
                                        ..Default::default()
                                    },
                                    &["true"],
                                )
                                .unwrap(),
                        };
                        timed(env.ssh_mux(0).arg(cmd), "ssh mux");
                    }
                });
            }
        });
        total as f64 / start.elapsed().as_secs_f64()
    };
    let mux_true = ceiling(None);
    let mux_wrapped = ceiling(Some(String::new()));
    table.add(
        "throughput ceiling: `ssh` ControlMaster, 8 at once: `true` / the wrapper's `run true` line",
        "",
        format!("{mux_true:.0}/s / {mux_wrapped:.0}/s"),
        "",
        "",
        None,
        format!("{} each", plan.throughput_actions),
    );

    // ---- 3. Fan-out: one action on every host at once.
    let hosts = env.hosts.len();
    let fan_out = |n_counter: &AtomicUsize| -> f64 {
        let start = Instant::now();
        rt.block_on(async {
            let mut tasks = Vec::new();
            for h in 0..hosts {
                let n = n_counter.fetch_add(1, Ordering::Relaxed);
                let socket = socket.clone();
                tasks.push(tokio::spawn(async move { call_noop(&socket, h, n).await }));
            }
            for t in tasks {
                t.await.unwrap();
            }
        });
        ms(start.elapsed())
    };
    // Cold: the daemon has no connection to hosts 1.. yet (connect, authenticate, install).
    let cold = fan_out(&n_counter);
    let warm: Vec<f64> = (0..plan.fanout_reps).map(|_| fan_out(&n_counter)).collect();
    // The same through the CLI: one `waymark exec run` process per host, all at once.
    let cli_fan: Vec<f64> = (0..plan.fanout_reps)
        .map(|_| {
            let start = Instant::now();
            let children: Vec<Child> = (0..hosts)
                .map(|h| {
                    env.waymark()
                        .args(["exec", "run", "--host", &host_name(h), "noop"])
                        .arg(format!("n={}", next(&n_counter)))
                        .stdout(Stdio::null())
                        .stderr(Stdio::null())
                        .spawn()
                        .unwrap()
                })
                .collect();
            for mut c in children {
                assert!(c.wait().unwrap().success(), "waymark exec run failed");
            }
            ms(start.elapsed())
        })
        .collect();
    let hostsfile = env.dir.path().join("pssh-hosts");
    fs::write(
        &hostsfile,
        env.hosts
            .iter()
            .map(|h| format!("{}@127.0.0.1:{}\n", h.user(), h.port()))
            .collect::<String>(),
    )
    .unwrap();
    let pssh_run = || {
        let mut cmd = Command::new(pssh);
        cmd.arg("-h")
            .arg(&hostsfile)
            .args(["-p", &hosts.to_string(), "-t", "60"])
            .arg("-x")
            .arg(format!(
                "-F /dev/null -i {} -o IdentitiesOnly=yes -o IdentityAgent=none \
                 -o UserKnownHostsFile={} -o GlobalKnownHostsFile=/dev/null \
                 -o StrictHostKeyChecking=yes -o BatchMode=yes",
                env.key.display(),
                env.known_hosts.display()
            ))
            .arg("true")
            .stdin(Stdio::null());
        ms(timed(&mut cmd, "parallel-ssh"))
    };
    let pssh_t: Vec<f64> = (0..plan.fanout_reps).map(|_| pssh_run()).collect();
    let inv_all = env.ansible_inventory(hosts);
    let ansible_fan = || {
        ms(timed(
            env.ansible(&ansible).args([
                "all",
                "-i",
                inv_all.to_str().unwrap(),
                "-f",
                &hosts.to_string(),
                "-m",
                "command",
                "-a",
                "true",
            ]),
            "ansible fan-out",
        ))
    };
    ansible_fan(); // unmeasured: first run
    let ans_fan: Vec<f64> = (0..plan.ansible_fanout_reps)
        .map(|_| ansible_fan())
        .collect();
    let (warm_m, cli_fan_m, pssh_m, ans_fan_m) = (
        median(&warm),
        median(&cli_fan),
        median(&pssh_t),
        median(&ans_fan),
    );
    table.add(
        format!("fan-out: one action on {hosts} hosts, control protocol (warm pool) vs `parallel-ssh -p {hosts}`"),
        format!("{} (p95 {})", fmt_ms(warm_m), fmt_ms(percentile(&warm, 0.95))),
        format!("{} (p95 {})", fmt_ms(pssh_m), fmt_ms(percentile(&pssh_t, 0.95))),
        format!("{:.2}x", warm_m / pssh_m),
        "<= 1x",
        Some(warm_m <= pssh_m),
        format!("{} each", plan.fanout_reps),
    );
    table.add(
        format!("fan-out: {hosts} `waymark exec run` processes at once (warm) vs `parallel-ssh`"),
        fmt_ms(cli_fan_m),
        fmt_ms(pssh_m),
        format!("{:.2}x", cli_fan_m / pssh_m),
        "<= 1x",
        Some(cli_fan_m <= pssh_m),
        format!("{} each", plan.fanout_reps),
    );
    table.add(
        format!(
            "fan-out: cold (first call: connect + wrapper check on {} new hosts) vs `parallel-ssh`",
            hosts - 1
        ),
        fmt_ms(cold),
        fmt_ms(pssh_m),
        format!("{:.2}x", cold / pssh_m),
        "",
        None,
        "1",
    );
    table.add(
        format!("fan-out: control protocol (warm) vs `ansible all -f {hosts} -m command`"),
        fmt_ms(warm_m),
        fmt_ms(ans_fan_m),
        format!("{:.0}x faster", ans_fan_m / warm_m),
        "",
        None,
        format!("{} ansible", plan.ansible_fanout_reps),
    );

    // ---- 5a. Memory idle after all of the above (pools to every host open).
    std::thread::sleep(Duration::from_secs(1));
    let rss_warm = rss_kib(daemon.pid());
    table.notes.push(format!(
        "Daemon RSS after each phase: fresh {}, after latency (1 host) {}, after throughput \
         (1 host, up to 64 at once) {}, after fan-out ({hosts} hosts) {}.",
        mib(rss_fresh),
        mib(rss_after_latency),
        mib(rss_after_throughput),
        mib(rss_warm)
    ));
    table.add(
        "memory: daemon RSS idle (fresh start / after the runs above, pools open)",
        format!("{} / {}", mib(rss_fresh), mib(rss_warm)),
        "",
        "",
        "<= 50 MiB",
        Some(rss_fresh.max(rss_warm) <= 50 * 1024),
        "1",
    );

    slow_login_row(&plan, &env, &rt, &socket, &n_counter, &mut table);
    inflight_rows(&plan, &mut env, &rt, daemon, &socket, &mut table);

    let total = bench_start.elapsed().as_secs_f64();
    table.notes.push(format!(
        "{} run, {} s in all; {} sshd instances on 127.0.0.1 (OpenSSH, MaxSessions 10); medians \
         unless said; every Waymark action is fully durable (each state on disk before the next \
         step; accepted, authorized and dispatched share one fdatasync, the outcome a second).",
        if plan.quick { "BENCH_QUICK" } else { "Full" },
        total.round(),
        env.hosts.len(),
    ));
    println!("{}", table.render());
}

/// A burst on a host whose logins are slow and serialized (each holds a host-wide lock for
/// [`SLOW_LOGIN`], as a login script behind a version manager's rehash does): `plan.slow_burst`
/// control-protocol calls of `noop` at once, and the time to the last completion, beside as
/// many `ssh … true` at once through ControlMaster (8 clients a master, as in the throughput
/// rows), where every command is a session and so a login. Both sides warm: the daemon's
/// connection and wrapper are up, and so are the masters.
fn slow_login_row(
    plan: &Plan,
    env: &Env,
    rt: &tokio::runtime::Runtime,
    socket: &Path,
    n_counter: &AtomicUsize,
    table: &mut Table,
) {
    let burst = plan.slow_burst;
    let noop = |n: usize| {
        let socket = socket.to_path_buf();
        async move {
            let frame = request(
                &socket,
                call_request_on("noop", SLOW_HOST, ("n", n.to_string())),
                |_| {},
            )
            .await
            .unwrap_or_else(|e| panic!("call to the slow host failed: {e:?}"));
            match frame {
                Frame::Done { exit: 0, .. } => {}
                other => panic!("noop on the slow host did not succeed: {other:?}"),
            }
        }
    };
    rt.block_on(noop(n_counter.fetch_add(1, Ordering::Relaxed)));
    let start = Instant::now();
    rt.block_on(async {
        let calls: Vec<_> = (0..burst)
            .map(|_| tokio::spawn(noop(n_counter.fetch_add(1, Ordering::Relaxed))))
            .collect();
        for call in calls {
            call.await.unwrap();
        }
    });
    let waymark = start.elapsed();

    let master = |m: usize| {
        let mut cmd = env.ssh_to(&env.slow);
        cmd.args(["-o", "ControlMaster=auto", "-o"])
            .arg(format!(
                "ControlPath={}",
                env.dir.path().join(format!("slow-cm-{m}-%C")).display()
            ))
            .args(["-o", "ControlPersist=120"]);
        cmd
    };
    let masters = burst.div_ceil(8);
    for m in 0..masters {
        timed(master(m).arg("true"), "ssh mux (slow host)");
    }
    let start = Instant::now();
    std::thread::scope(|scope| {
        for t in 0..burst {
            let master = &master;
            scope.spawn(move || timed(master(t / 8).arg("true"), "ssh mux (slow host)"));
        }
    });
    let mux = start.elapsed();
    table.add(
        format!(
            "burst on a slow-login host (each login holds a host-wide lock {} ms): {burst} calls \
             at once, time to the last completion, vs `ssh` ControlMaster",
            SLOW_LOGIN.as_millis()
        ),
        format!("{:.1} s", waymark.as_secs_f64()),
        format!("{:.1} s", mux.as_secs_f64()),
        format!("{:.1}x faster", mux.as_secs_f64() / waymark.as_secs_f64()),
        "all run; faster",
        Some(waymark < mux),
        format!("{burst} each"),
    );
}

/// Rows 5b and 4: `plan.inflight` executions in flight (memory, CPU of the daemon and of the
/// machine while they sit), then the daemon SIGKILLed and restarted (recovery).
fn inflight_rows(
    plan: &Plan,
    env: &mut Env,
    rt: &tokio::runtime::Runtime,
    mut daemon: Daemon,
    socket: &Path,
    table: &mut Table,
) {
    // ---- 5b. 1,000 executions in flight, then 4. recovery after SIGKILL.
    let inflight = plan.inflight;
    let remote_dir = env.hosts[0].remote_dir();
    let before = live_markers(&remote_dir).len();
    let dispatch_start = Instant::now();
    let calls: Vec<_> = (0..inflight)
        .map(|i| {
            let socket = socket.to_path_buf();
            rt.spawn(async move {
                let req = call_request("nap", 0, ("t", format!("900.{i:06}")));
                request(&socket, req, |_| {}).await
            })
        })
        .collect();
    let deadline = Instant::now() + Duration::from_secs(300);
    loop {
        let live = live_markers(&remote_dir).len() - before;
        if live >= inflight {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "only {live} of {inflight} executions started on the host within 300 s"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let dispatch_secs = dispatch_start.elapsed().as_secs_f64();
    std::thread::sleep(Duration::from_secs(2));
    let pid = daemon.pid();
    let rss_busy = rss_kib(pid);
    let meter = CpuMeter::start(pid);
    std::thread::sleep(Duration::from_secs(5));
    let (daemon_share, cpu) = (meter.daemon_share(), meter.report());
    let thr = threads(pid);
    table.add(
        format!("memory: daemon RSS with {inflight} executions in flight"),
        mib(rss_busy),
        "",
        "",
        "<= 200 MiB",
        Some(rss_busy <= 200 * 1024),
        "1",
    );
    table.add(
        format!("cpu: daemon while {inflight} executions sit in flight (streaming output)"),
        cpu,
        "",
        "",
        "<= 2% of a core",
        Some(daemon_share <= 0.02),
        "5 s window",
    );
    table.notes.push(format!(
        "{inflight} `sleep` executions reached the host in {dispatch_secs:.1} s; daemon threads \
         then: {thr}."
    ));

    daemon.kill();
    for c in calls {
        match rt.block_on(c).unwrap() {
            Err(ClientError::Broken(_)) => {}
            other => panic!("a call in flight ended otherwise than broken: {other:?}"),
        }
    }
    let (restarted, started) = env.start_daemon();
    let listening = started.elapsed();
    let deadline = Instant::now() + Duration::from_secs(600);
    let line = loop {
        let log = restarted.log_text();
        if let Some(l) = log
            .lines()
            .find(|l| l.contains("reconcil"))
            .map(str::to_owned)
        {
            break l;
        }
        assert!(
            Instant::now() < deadline,
            "no reconcile report in 600 s:\n{log}"
        );
        std::thread::sleep(Duration::from_millis(5));
    };
    let recovery = started.elapsed();
    let line = strip_ansi(&line);
    assert!(line.contains("reconciled"), "reconcile failed: {line}");
    let running = rt
        .block_on(request(
            socket,
            Request::List {
                state: Some(waymark_core::ExecState::Running),
                host: None,
                tool: Some("nap".into()),
                actor: None,
                since_ms: None,
                limit: Some(inflight + 10),
                after: None,
                mine: false,
            },
            |_| {},
        ))
        .unwrap();
    let running = match running {
        Frame::Done { data, .. } => data["items"].as_array().map_or(0, Vec::len),
        other => panic!("list failed: {other:?}"),
    };
    table.add(
        format!("recovery: daemon SIGKILL with {inflight} in flight → restart → reconcile done"),
        fmt_ms(ms(recovery)),
        "",
        "",
        "<= 5 s",
        Some(recovery <= Duration::from_secs(5)),
        "1",
    );
    table.notes.push(format!(
        "Recovery: the restarted daemon listened after {}; its report: `{}`; the ledger then \
         shows {running} of {inflight} as running.",
        fmt_ms(ms(listening)),
        line.split_once("INFO")
            .map_or(line.as_str(), |(_, r)| r.trim()),
    ));
    drop(restarted);
    drop(daemon);

    // The `sleep`s still run on the host: end each one's process group (the ids were recorded
    // by the wrapper), then the test kit cleans up the rest.
    for m in live_markers(&remote_dir) {
        if let Ok(cmd) = fs::read_to_string(m.with_extension("cmd")) {
            if let Some(pid) = cmd
                .split_whitespace()
                .next()
                .and_then(|p| p.parse::<i32>().ok())
            {
                // SAFETY: kill(2) on a process group this run started.
                unsafe {
                    libc::kill(-pid, libc::SIGKILL);
                }
            }
        }
    }
}
