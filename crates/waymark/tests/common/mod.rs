//! Setup shared by the end-to-end suites of the `waymark` binary: a real OpenSSH sshd
//! (testkit), optionally behind a real fault proxy, a generated `waymark.toml` in a temporary
//! directory, real daemon processes (SIGKILL on drop), and helpers for the CLI and for rmcp's
//! client driving `waymark mcp`.
//!
//! Each suite states its own tools (TOML, with `{counter}` standing for the counter file on the
//! host) and builds its environment with [`Env::builder`].
#![allow(dead_code)]

pub mod http;
pub mod npm;

use std::collections::{BTreeMap, BTreeSet};
use std::io::{BufRead, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use std::sync::{Arc, Mutex};

use rmcp::model::{
    CallToolRequestParams, CallToolResult, ClientCapabilities, ClientConfig, ElicitRequestParams,
    ElicitResult, ElicitationAction, Implementation, ProtocolVersion,
};
use rmcp::service::{ClientLifecycleMode, ClientServiceExt, RequestContext, RunningService};
use rmcp::transport::TokioChildProcess;
use rmcp::{ClientHandler, ErrorData, RoleClient, ServiceExt};
use serde_json::{json, Value};
use waymark_testkit::{FaultProxy, TestSshd};

/// Every async (MCP) test is bounded by this; see [`bounded`].
pub const LIMIT: Duration = Duration::from_secs(90);

/// How long a daemon may take to listen on its socket.
const DAEMON_START: Duration = Duration::from_secs(20);

/// rmcp's Streamable HTTP client for `config`. The workspace also builds reqwest with
/// `rustls-no-provider` (waymark-http installs ring itself), and Cargo unifies features, so a
/// test binary's reqwest needs a process-wide crypto provider before it builds a client.
pub fn http_client(
    config: rmcp::transport::streamable_http_client::StreamableHttpClientTransportConfig,
) -> impl rmcp::transport::Transport<
    RoleClient,
    Error = impl std::error::Error + Send + Sync + 'static,
> + 'static {
    let _ = rustls::crypto::ring::default_provider().install_default();
    rmcp::transport::StreamableHttpClientTransport::from_config(config)
}

/// The `waymark` binary under test.
pub fn bin() -> &'static str {
    env!("CARGO_BIN_EXE_waymark")
}

/// `append`: appends `line` to the counter file, sleeps `secs`, prints `done <line>`
/// (status_check, 10 min retry window). `line` takes any string.
pub const APPEND_TOOL: &str = r#"
[tools.append]
description = "Append a line to the counter file, then sleep."
hosts = ["h1"]
argv = ["sh", "-c", "echo \"$1\" >> {counter}; sleep \"$2\"; echo done \"$1\"", "append", "{line}", "{secs}"]
contract = "status_check"
retry_window = "10m"
dedup_window = "1h"
timeout = "60s"

[tools.append.args.secs]
type = "integer"

[tools.append.args.line]
type = "string"
"#;

/// [`APPEND_TOOL`] whose command also writes its execution id (the name of the marker
/// directory that holds the command's stdout) before its line: `<id> <line>`.
pub fn append_tool_naming_its_id() -> String {
    let tool = APPEND_TOOL.replace(
        r#"echo \"$1\" >> {counter}"#,
        r#"id=$(basename \"$(readlink /proc/$$/fd/1)\" .stdout); echo \"$id $1\" >> {counter}"#,
    );
    assert_ne!(
        tool, APPEND_TOOL,
        "the append tool's command changed: adapt append_tool_naming_its_id()"
    );
    tool
}

/// [`APPEND_TOOL`] whose `line` has a description and must match `[a-z0-9-]+` (the keys go
/// into `[tools.append.args.line]`, the last table of [`APPEND_TOOL`]).
pub fn append_tool_strict() -> String {
    format!("{APPEND_TOOL}description = \"The line to append.\"\npattern = \"[a-z0-9-]+\"\n")
}

/// `secret_echo`: takes a secret `token` and prints `ok` (idempotent).
pub const SECRET_ECHO_TOOL: &str = r#"
[tools.secret_echo]
description = "Uses a secret."
hosts = ["h1"]
argv = ["sh", "-c", "test -n \"$1\" && echo ok", "x", "{token}"]
contract = "idempotent"

[tools.secret_echo.args.token]
type = "string"
secret = true
"#;

/// `peek`: prints the counter file (read_only).
pub const PEEK_TOOL: &str = r#"
[tools.peek]
description = "Read the counter file."
hosts = ["h1"]
argv = ["cat", "{counter}"]
contract = "read_only"
"#;

/// `slow_read`, read_only: sleeps 30 s, then prints the counter file (a call to cancel or cut).
pub const SLOW_READ_TOOL: &str = r#"
[tools.slow_read]
description = "Read, slowly."
hosts = ["h1"]
argv = ["sh", "-c", "sleep 30; cat {counter}"]
contract = "read_only"
"#;

/// `guarded`: echoes `line`; irreversible, needs an approval per call.
pub const GUARDED_ECHO_TOOL: &str = r#"
[tools.guarded]
description = "Irreversible, needs approval."
hosts = ["h1"]
argv = ["sh", "-c", "echo \"$1\"", "guarded", "{line}"]
contract = "irreversible"
approval = "per_call"

[tools.guarded.args.line]
type = "string"
"#;

/// A daemon process, killed with SIGKILL when dropped so a failing test leaves none behind.
pub struct Daemon(pub Child);

impl Daemon {
    /// SIGKILL, then reap.
    pub fn kill(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A daemon someone else started (detached, e.g. by the MCP shim): SIGKILL by pid on drop.
pub struct StartedDaemon(pub u32);

impl Drop for StartedDaemon {
    fn drop(&mut self) {
        unsafe { libc::kill(self.0 as i32, libc::SIGKILL) };
    }
}

/// What a test environment is made of; see [`Env::builder`].
#[derive(Default)]
pub struct EnvBuilder {
    ledger: String,
    daemon: String,
    raw_commands: bool,
    tools: String,
    fault_proxy: bool,
    extra_hosts: usize,
}

impl EnvBuilder {
    /// Appends tool tables (TOML); `{counter}` stands for the counter file's path.
    pub fn tools(mut self, toml: &str) -> Self {
        self.tools.push_str(toml);
        self
    }

    /// Appends lines to the `[ledger]` table (e.g. `backend = "postgres"`).
    pub fn ledger_settings(mut self, toml: &str) -> Self {
        self.ledger.push_str(toml);
        self.ledger.push('\n');
        self
    }

    /// Appends lines to the `[daemon]` table (e.g. `http_listen`).
    pub fn daemon_settings(mut self, toml: &str) -> Self {
        self.daemon.push_str(toml);
        self.daemon.push('\n');
        self
    }

    /// `[policy] raw_commands = ["h1"]`: `exec run --host h1 -- ...` and `ssh_exec` allowed.
    pub fn raw_commands(mut self) -> Self {
        self.raw_commands = true;
        self
    }

    /// Host `h1` is reached through a [`FaultProxy`] in front of the sshd (see [`Env::proxy`]).
    pub fn fault_proxy(mut self) -> Self {
        self.fault_proxy = true;
        self
    }

    /// `n` more hosts, `h2`, `h3`, ..., each its own sshd (see [`Env::extra`]), reached with
    /// `h1`'s credential. Their counter files are `$HOME/counter` on each (a tool names it so,
    /// [`Env::host_counter_lines`] reads it).
    pub fn extra_hosts(mut self, n: usize) -> Self {
        self.extra_hosts = n;
        self
    }

    /// Starts the sshd (and proxy) and writes `waymark.toml`: ledger and socket in the temporary
    /// directory, credential `k`, host `h1`, then the tools.
    pub fn build(self) -> Env {
        let sshd = TestSshd::new();
        let proxy = self.fault_proxy.then(|| FaultProxy::start(sshd.addr()));
        let dir = tempfile::tempdir().unwrap();
        let counter = sshd.remote_home().join("counter");
        // The sshd's own known_hosts names its own port; Waymark may connect to the proxy's.
        let port = proxy.as_ref().map_or(sshd.port(), |p| p.port());
        let known_hosts = sshd.known_hosts_for(port, dir.path());
        let policy = if self.raw_commands {
            "[policy]\nraw_commands = [\"h1\"]\n"
        } else {
            ""
        };
        let text = format!(
            r#"
[ledger]
path = "{ledger}"
{ledger_settings}
[daemon]
socket = "{socket}"
{daemon}
{policy}
[credentials.k]
key_file = "{key}"
{host}{tools}"#,
            ledger = dir.path().join("ledger").display(),
            socket = dir.path().join("run/daemon.sock").display(),
            ledger_settings = self.ledger,
            daemon = self.daemon,
            key = sshd.user_key_path().display(),
            host = sshd.waymark_host_toml("h1", "k", port, &known_hosts),
            tools = self
                .tools
                .replace("{counter}", &counter.display().to_string()),
        );
        let extra: Vec<TestSshd> = (0..self.extra_hosts).map(|_| TestSshd::new()).collect();
        let mut text = text;
        for (i, h) in extra.iter().enumerate() {
            h.authorize_key(sshd.user_key_public());
            let name = format!("h{}", i + 2);
            text.push_str(&h.waymark_host_toml(&name, "k", h.port(), &h.known_hosts_path()));
        }
        let config = dir.path().join("waymark.toml");
        std::fs::write(&config, text).unwrap();
        if !self.ledger.contains("postgres") {
            // What `waymark init` does: a daemon never makes its ledger.
            drop(waymark_ledger::Ledger::init(&dir.path().join("ledger")).unwrap());
        }
        Env {
            sshd,
            proxy,
            dir,
            config,
            counter,
            extra,
        }
    }
}

/// Echoes a finished `waymark ARGS` to stderr: the command, its exit code and its output.
pub fn echo_run(args: &[&str], out: &Output) {
    eprintln!(
        "$ waymark {}\n[exit {:?}]\n{}{}",
        args.join(" "),
        out.status.code(),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// One test's world: sshd, optional fault proxy, temporary directory (ledger, socket, config)
/// and the counter file on the host.
pub struct Env {
    pub sshd: TestSshd,
    pub proxy: Option<FaultProxy>,
    pub dir: tempfile::TempDir,
    pub config: PathBuf,
    pub counter: PathBuf,
    /// The sshd of hosts `h2`, `h3`, ... ([`EnvBuilder::extra_hosts`]).
    pub extra: Vec<TestSshd>,
}

/// A CLI call that finds no daemon starts one, detached: whatever daemons run on this test's
/// configuration when it ends are killed with it.
impl Drop for Env {
    fn drop(&mut self) {
        self.kill_daemons();
    }
}

impl Env {
    /// SIGKILLs every daemon running on this configuration (the ones the CLI or the shim
    /// started too) and waits until none is left.
    pub fn kill_daemons(&self) {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let pids = self.daemons();
            if pids.is_empty() || Instant::now() > deadline {
                return;
            }
            for pid in pids {
                unsafe { libc::kill(pid as i32, libc::SIGKILL) };
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// An empty description: no tools, no raw commands, no proxy.
    pub fn builder() -> EnvBuilder {
        EnvBuilder::default()
    }

    /// What the MCP suites share: raw commands on `h1`, tools `append` (strict `line`),
    /// `guarded` (echo), `peek` and `secret_echo`.
    pub fn mcp_builder() -> EnvBuilder {
        Env::builder()
            .raw_commands()
            .tools(&append_tool_strict())
            .tools(GUARDED_ECHO_TOOL)
            .tools(PEEK_TOOL)
            .tools(SECRET_ECHO_TOOL)
    }

    /// The fault proxy in front of the sshd; panics when built without one.
    pub fn proxy(&self) -> &FaultProxy {
        self.proxy
            .as_ref()
            .expect("this Env was built without .fault_proxy()")
    }

    /// The daemon's control socket.
    pub fn socket(&self) -> PathBuf {
        self.dir.path().join("run/daemon.sock")
    }

    /// The ledger directory.
    pub fn ledger_dir(&self) -> PathBuf {
        self.dir.path().join("ledger")
    }

    /// `waymark --config <ours>` with `WAYMARK_LOG=warn` and no stdin.
    pub fn cmd(&self) -> Command {
        let mut c = Command::new(bin());
        c.arg("--config")
            .arg(&self.config)
            .env("WAYMARK_LOG", "warn")
            .stdin(Stdio::null());
        c
    }

    /// Runs `waymark ARGS` to its end and echoes command, exit code and output to stderr.
    pub fn run(&self, args: &[&str]) -> Output {
        let out = self.cmd().args(args).output().unwrap();
        echo_run(args, &out);
        out
    }

    /// The sshd of host `hN` (`h1` is [`Env::sshd`]).
    pub fn host_sshd(&self, n: usize) -> &TestSshd {
        if n == 1 {
            &self.sshd
        } else {
            &self.extra[n - 2]
        }
    }

    /// The lines of `$HOME/counter` on host `hN` (none when it does not exist yet).
    pub fn host_counter_lines(&self, n: usize) -> Vec<String> {
        std::fs::read_to_string(self.host_sshd(n).remote_home().join("counter"))
            .unwrap_or_default()
            .lines()
            .map(str::to_string)
            .collect()
    }

    /// The counter file's lines (none when it does not exist yet).
    pub fn counter_lines(&self) -> Vec<String> {
        std::fs::read_to_string(&self.counter)
            .unwrap_or_default()
            .lines()
            .map(str::to_string)
            .collect()
    }

    /// `waymark daemon`, its stderr inherited; returns once it listens.
    pub fn start_daemon(&self) -> Daemon {
        self.start_daemon_with(&[], Stdio::inherit())
    }

    /// `waymark daemon` with extra environment variables; returns once it listens.
    pub fn start_daemon_with(&self, envs: &[(&str, &str)], stderr: Stdio) -> Daemon {
        let mut cmd = self.cmd();
        cmd.arg("daemon").stdout(Stdio::null()).stderr(stderr);
        for (k, v) in envs {
            cmd.env(k, v);
        }
        let mut child = Daemon(cmd.spawn().unwrap());
        let socket = self.socket();
        let deadline = Instant::now() + DAEMON_START;
        while Instant::now() < deadline {
            if let Ok(Some(status)) = child.0.try_wait() {
                panic!("the daemon ended at once ({status}): is another one (started by a CLI call) still running? call env.kill_daemons() first");
            }
            if std::os::unix::net::UnixStream::connect(&socket).is_ok() {
                let answering = self.daemon_pid();
                assert_eq!(
                    answering,
                    child.0.id(),
                    "another daemon (started by a CLI call?) answers; call env.kill_daemons() first"
                );
                return child;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        panic!(
            "daemon did not listen on {} within {DAEMON_START:?}",
            socket.display()
        );
    }

    /// The address a daemon's TCP listener got (`name`: `http` or `metrics`), as it writes it
    /// beside its socket once it listens: configure port 0 and read the port here, never pick a
    /// free port for the daemon to bind later (another process may take it in between).
    pub fn listen_addr(&self, name: &str) -> std::net::SocketAddr {
        let path = self.socket().with_file_name(format!("{name}.addr"));
        let mut addr = None;
        wait_for(
            || {
                addr = std::fs::read_to_string(&path)
                    .ok()
                    .and_then(|t| t.trim().parse().ok());
                addr.is_some()
            },
            &format!("the daemon to write {}", path.display()),
            DAEMON_START,
        );
        addr.unwrap()
    }

    /// One control request straight to the daemon's socket; returns the final (non-event)
    /// frame.
    pub fn control(&self, req: Value) -> Value {
        let mut s = std::os::unix::net::UnixStream::connect(self.socket()).unwrap();
        let mut line = serde_json::to_vec(&req).unwrap();
        line.push(b'\n');
        s.write_all(&line).unwrap();
        for l in std::io::BufReader::new(s).lines() {
            let v: Value = serde_json::from_str(&l.unwrap()).unwrap();
            if v["frame"] != "event" {
                return v;
            }
        }
        panic!("no final frame");
    }

    /// The pid of whatever daemon answers on the socket (control protocol `ping`).
    pub fn daemon_pid(&self) -> u32 {
        let v = self.control(json!({"v": 1, "op": "ping"}));
        v["data"]["pid"]
            .as_u64()
            .expect("ping answers with the pid") as u32
    }

    /// Pids of the daemon processes running on this test's configuration.
    pub fn daemons(&self) -> Vec<u32> {
        daemons_on(&self.config)
    }

    /// Ids of the executions awaiting approval (control `approvals`).
    pub fn pending(&self) -> Vec<String> {
        let v = self.control(json!({"v": 1, "op": "approvals"}));
        v["data"]["items"]
            .as_array()
            .unwrap()
            .iter()
            .map(|i| i["id"].as_str().unwrap().to_string())
            .collect()
    }

    /// An execution's state as the daemon reports it (control `status`), `?` when none.
    pub fn state(&self, id: &str) -> String {
        let v = self.control(json!({"v": 1, "op": "status", "id": id, "defer_delivery": true}));
        v["data"]["state"].as_str().unwrap_or("?").to_string()
    }

    /// `waymark approve ID`, the operator's way.
    pub fn operator_approve(&self, id: &str) {
        let out = self.cmd().arg("approve").arg(id).output().unwrap();
        assert!(
            out.status.success(),
            "waymark approve: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// Every execution in the ledger (`exec list --json`): id -> full record.
    pub fn ledger_records(&self) -> BTreeMap<String, Value> {
        let list = self
            .cmd()
            .args(["--json", "exec", "list", "--limit", "100000"])
            .output()
            .unwrap();
        assert_eq!(list.status.code(), Some(0), "{}", stderr(&list));
        let v: Value = serde_json::from_slice(&list.stdout).unwrap();
        v["items"]
            .as_array()
            .unwrap()
            .iter()
            .map(|i| (i["id"].as_str().unwrap().to_string(), i.clone()))
            .collect()
    }

    /// Every execution in the ledger: id -> state.
    pub fn executions(&self) -> BTreeMap<String, String> {
        self.ledger_records()
            .into_iter()
            .map(|(id, r)| (id, r["state"].as_str().unwrap().to_string()))
            .collect()
    }

    /// `waymark mcp` as a child process with rmcp's client connected; returns the client and
    /// the shim's pid (to kill it mid-call).
    pub async fn client(&self) -> (RunningService<RoleClient, ()>, u32) {
        let transport = shim_transport(self);
        let pid = transport.id().expect("the shim runs");
        let client = ().serve(transport).await.expect("MCP initialize");
        (client, pid)
    }
}

/// A `waymark mcp` child process as an rmcp transport.
pub fn shim_transport(env: &Env) -> TokioChildProcess {
    let mut cmd = tokio::process::Command::new(bin());
    cmd.arg("--config")
        .arg(&env.config)
        .arg("mcp")
        .env("WAYMARK_LOG", "warn");
    TokioChildProcess::new(cmd).unwrap()
}

/// Starts `waymark mcp` and connects an rmcp client with the given handler (which also says
/// which protocol version and capabilities it declares).
pub async fn shim_client<H: ClientHandler>(env: &Env, handler: H) -> RunningService<RoleClient, H> {
    handler
        .serve(shim_transport(env))
        .await
        .expect("MCP initialize")
}

/// A process's stderr as text.
pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// A process's stdout as text.
pub fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// Every file under `dir` (recursively) whose bytes contain `needle`.
pub fn files_containing(dir: &std::path::Path, needle: &str) -> Vec<PathBuf> {
    let mut found = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            let p = e.path();
            if p.is_dir() {
                stack.push(p);
            } else if std::fs::read(&p)
                .is_ok_and(|b| b.windows(needle.len()).any(|w| w == needle.as_bytes()))
            {
                found.push(p);
            }
        }
    }
    found
}

/// Reads a running CLI's stderr up to the line that names its execution (a config warning may
/// come first); returns what was read and the id.
pub fn read_until_id(err: &mut impl std::io::BufRead) -> (String, String) {
    let mut text = String::new();
    while !text.contains("act_") {
        assert_ne!(
            err.read_line(&mut text).unwrap(),
            0,
            "no execution id: {text}"
        );
    }
    let id = id_in(&text);
    (text, id)
}

/// Pids of the `waymark daemon` processes running on configuration file `config`.
pub fn daemons_on(config: &Path) -> Vec<u32> {
    let config = config.to_str().unwrap();
    let mut pids = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let cmdline = std::fs::read(entry.path().join("cmdline")).unwrap_or_default();
        let words: Vec<String> = cmdline
            .split(|b| *b == 0)
            .map(|w| String::from_utf8_lossy(w).into_owned())
            .collect();
        if words.iter().any(|w| w == config) && words.iter().any(|w| w == "daemon") {
            pids.push(pid);
        }
    }
    pids
}

/// The first execution id (`act_` + 26 characters) in `text`; panics when there is none.
pub fn id_in(text: &str) -> String {
    let i = text.find("act_").expect("an execution id is printed");
    text[i..i + 30].to_string()
}

/// Every execution id printed anywhere in a process's output.
pub fn ids_in(o: &Output) -> BTreeSet<String> {
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

/// Polls `f` every 20 ms until it holds; panics naming `what` after `limit`.
pub fn wait_for(mut f: impl FnMut() -> bool, what: &str, limit: Duration) {
    let deadline = Instant::now() + limit;
    while Instant::now() < deadline {
        if f() {
            return;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    panic!("timed out waiting for {what}");
}

/// A loopback port that was free a moment ago.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A JSON object as tool-call arguments; panics on anything else.
pub fn args(v: Value) -> serde_json::Map<String, Value> {
    match v {
        Value::Object(m) => m,
        _ => panic!("arguments are an object"),
    }
}

/// A `tools/call` of `name` with arguments `a` (a JSON object).
pub fn call(name: &'static str, a: Value) -> CallToolRequestParams {
    CallToolRequestParams::new(name).with_arguments(args(a))
}

/// A `tools/call` that asks for a task: its own `_meta` declares the tasks extension in its
/// per-request client capabilities (SEP-2663 decides task creation per request).
pub fn task_call(name: &'static str, a: Value) -> CallToolRequestParams {
    let mut caps = ClientCapabilities::default();
    caps.extensions
        .get_or_insert_with(Default::default)
        .insert(rmcp::model::TASKS_EXTENSION_ID.into(), Default::default());
    let mut meta = rmcp::model::RequestMetaObject::default();
    meta.set_client_capabilities(caps);
    let mut c = call(name, a);
    c.meta = Some(meta);
    c
}

/// A result's `structuredContent`; panics when missing (every Waymark result has one).
pub fn structured(r: &CallToolResult) -> Value {
    r.structured_content
        .clone()
        .expect("every result carries structured content")
}

/// A result's text content, joined by newlines.
pub fn text(r: &CallToolResult) -> String {
    r.content
        .iter()
        .filter_map(|c| c.as_text().map(|t| t.text.clone()))
        .collect::<Vec<_>>()
        .join("\n")
}

/// Runs `f` within [`LIMIT`]; panics when it takes longer.
pub async fn bounded<T>(f: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(LIMIT, f)
        .await
        .expect("the test finished within its bound")
}

/// Runs the futures concurrently and returns their outputs in order.
pub async fn join_all<F: std::future::Future>(futures: impl Iterator<Item = F>) -> Vec<F::Output> {
    let mut set: Vec<_> = futures.map(Box::pin).collect();
    let mut out: Vec<Option<F::Output>> = set.iter().map(|_| None).collect();
    std::future::poll_fn(|cx| {
        let mut pending = false;
        for (i, f) in set.iter_mut().enumerate() {
            if out[i].is_none() {
                match f.as_mut().poll(cx) {
                    std::task::Poll::Ready(v) => out[i] = Some(v),
                    std::task::Poll::Pending => pending = true,
                }
            }
        }
        if pending {
            std::task::Poll::Pending
        } else {
            std::task::Poll::Ready(())
        }
    })
    .await;
    out.into_iter().map(|v| v.expect("finished")).collect()
}

/// Many clients at once (any transport): a distinct `append` from each runs once under its own
/// id; then the same call from all of them is one execution, one run on the host, and every
/// caller gets its outcome. Cancels the clients at the end.
pub async fn many_clients_run_distinct_calls_each_and_the_same_call_once<H: ClientHandler>(
    env: &Env,
    clients: Vec<RunningService<RoleClient, H>>,
) {
    let n = clients.len();
    let ids = join_all(clients.iter().enumerate().map(|(i, c)| async move {
        let r = c
            .call_tool(call("append", json!({"line": format!("c{i}"), "secs": 0})))
            .await
            .unwrap();
        let s = structured(&r);
        assert_eq!(s["state"], "completed", "client {i}: {}", text(&r));
        s["id"].as_str().unwrap().to_string()
    }))
    .await;
    let distinct: BTreeSet<&String> = ids.iter().collect();
    assert_eq!(distinct.len(), n, "distinct calls, distinct ids: {ids:?}");
    assert_eq!(env.counter_lines().len(), n);

    let same = join_all(clients.iter().map(|c| async move {
        let r = c
            .call_tool(call("append", json!({"line": "same", "secs": 1})))
            .await
            .unwrap();
        let s = structured(&r);
        assert_eq!(
            s["state"],
            "completed",
            "every caller gets the outcome: {}",
            text(&r)
        );
        s["id"].as_str().unwrap().to_string()
    }))
    .await;
    let one: BTreeSet<&String> = same.iter().collect();
    assert_eq!(one.len(), 1, "the same call is one execution: {same:?}");
    let lines = env.counter_lines();
    assert_eq!(
        lines.iter().filter(|l| *l == "same").count(),
        1,
        "one run on the host: {lines:?}"
    );
    for c in clients {
        c.cancel().await.unwrap();
    }
}

/// A 2026-07-28 client that declares form elicitation and answers every approval question
/// with `approve`, recording the messages it was shown.
#[derive(Clone)]
pub struct Modern {
    pub approve: bool,
    pub asked: Arc<Mutex<Vec<String>>>,
}

impl Modern {
    pub fn new(approve: bool) -> Modern {
        Modern {
            approve,
            asked: Arc::default(),
        }
    }
}

impl ClientHandler for Modern {
    fn get_info(&self) -> ClientConfig {
        ClientConfig::new(
            ClientCapabilities::builder().enable_elicitation().build(),
            Implementation::new("waymark-modern-test", "0"),
        )
        .with_protocol_version(ProtocolVersion::V_2026_07_28)
    }

    async fn create_elicitation(
        &self,
        request: ElicitRequestParams,
        _context: RequestContext<RoleClient>,
    ) -> Result<ElicitResult, ErrorData> {
        let ElicitRequestParams::FormElicitationParams { message, .. } = request else {
            panic!("a form elicitation");
        };
        self.asked.lock().unwrap().push(message);
        Ok(ElicitResult::new(ElicitationAction::Accept)
            .with_content(json!({"approve": self.approve, "reason": "not under test"})))
    }
}

/// Connects `handler` over `transport` the 2026-07-28 way (`server/discover`, capabilities in
/// every request's `_meta`, no handshake) and checks that 2026-07-28 is what was agreed.
pub async fn discover_2026_07_28<H, T, E, A>(
    handler: H,
    transport: T,
) -> RunningService<RoleClient, H>
where
    H: ClientHandler,
    T: rmcp::transport::IntoTransport<RoleClient, E, A>,
    E: std::error::Error + Send + Sync + 'static,
{
    let client = handler
        .serve_with_lifecycle(
            transport,
            ClientLifecycleMode::Discover {
                preferred_versions: vec![ProtocolVersion::V_2026_07_28],
            },
        )
        .await
        .expect("server/discover under 2026-07-28");
    assert_eq!(
        client.peer_info().unwrap().protocol_version,
        ProtocolVersion::V_2026_07_28
    );
    client
}

/// Waits (at most 30 s: CI runs many suites at once on two cores) until the ledger says
/// execution `id`'s result was delivered.
pub async fn wait_delivered(env: &Env, id: &str) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let st = env.control(json!({"v": 1, "op": "status", "id": id, "defer_delivery": true}));
        if st["data"]["result_delivered"] == true {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "the result of {id} was never marked delivered: {st}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
