//! More of the MCP front end to end: progress notifications, protocol versions, many clients
//! at once, malformed input, and a Streamable HTTP stream closed mid-call. Setup from `common`: a
//! real OpenSSH sshd (testkit), a real daemon process, rmcp's own
//! client, and raw JSON-RPC where a well-behaved client cannot say what is tested.

mod common;

use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::http::{self, Exchange};
use rmcp::model::{
    ClientCapabilities, ClientConfig, Implementation, ProgressNotificationParam, ProtocolVersion,
};
use rmcp::service::{NotificationContext, RunningService};
use rmcp::transport::streamable_http_client::StreamableHttpClientTransportConfig;
use rmcp::{ClientHandler, RoleClient, ServiceExt};
use serde_json::{json, Value};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt};

use common::{
    bin, bounded, call, discover_2026_07_28, join_all,
    many_clients_run_distinct_calls_each_and_the_same_call_once, shim_client, shim_transport,
    structured, wait_delivered, Daemon, Env,
};

/// `ticker` prints, pauses 2 s, prints; `secret_show` echoes its secret (on purpose).
const MORE_TOOLS: &str = r#"
[tools.ticker]
description = "Print, pause, print."
hosts = ["h1"]
argv = ["sh", "-c", "echo first tick; sleep 2; echo second tick"]
contract = "read_only"

[tools.secret_show]
description = "Echoes its secret (badly written on purpose)."
hosts = ["h1"]
argv = ["sh", "-c", "echo \"token=$1\"; sleep 1; echo end", "x", "{token}"]
contract = "idempotent"

[tools.secret_show.args.token]
type = "string"
secret = true
"#;

/// Host `h1` direct, raw commands allowed, tools `append`, `guarded`, `ticker`,
/// `secret_show`, `peek`, `secret_echo`; `daemon` goes into the `[daemon]` table.
fn env_with_daemon_settings(daemon: &str) -> Env {
    Env::mcp_builder()
        .daemon_settings(daemon)
        .tools(MORE_TOOLS)
        .build()
}

fn new_env() -> Env {
    env_with_daemon_settings("")
}

/// A client that records the progress notifications it receives, and when.
#[derive(Clone, Default)]
struct ProgressLog(Arc<Mutex<Vec<(Instant, ProgressNotificationParam)>>>);

impl ClientHandler for ProgressLog {
    async fn on_progress(
        &self,
        params: ProgressNotificationParam,
        _context: NotificationContext<RoleClient>,
    ) {
        self.0.lock().unwrap().push((Instant::now(), params));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_with_a_progress_token_reports_output_before_the_result() {
    bounded(async {
        let env = new_env();
        let _daemon = env.start_daemon();
        let log = ProgressLog::default();
        let client = shim_client(&env, log.clone()).await;
        // rmcp's client sends a progressToken with every request.
        let r = client.call_tool(call("ticker", json!({}))).await.unwrap();
        let answered = Instant::now();
        let s = structured(&r);
        assert_eq!(s["state"], "completed");
        let id = s["id"].as_str().unwrap().to_string();
        let seen = log.0.lock().unwrap().clone();
        for (at, p) in &seen {
            eprintln!(
                "progress {} {:?} {:?} {:?} before the answer",
                p.progress,
                p.message,
                p.progress_token,
                answered.checked_duration_since(*at)
            );
        }
        assert!(!seen.is_empty(), "no progress notification at all");
        // rmcp's client puts its own token on every request (it routes progress by it).
        let token = &seen[0].1.progress_token;
        assert!(seen
            .iter()
            .all(|(at, p)| *at <= answered && &p.progress_token == token));
        // The first line was printed two seconds before the command ended.
        let first = seen
            .iter()
            .find(|(_, p)| p.message.as_deref().unwrap_or("").contains("first tick"))
            .expect("a progress message carries the first line of output");
        assert!(answered.duration_since(first.0) >= Duration::from_millis(1000));
        assert!(first.1.message.as_deref().unwrap().contains(&id));
        assert_eq!(first.1.progress, "first tick\n".len() as f64);
        let progress: Vec<f64> = seen.iter().map(|(_, p)| p.progress).collect();
        assert!(
            progress.windows(2).all(|w| w[0] <= w[1]),
            "progress never goes back: {progress:?}"
        );
        assert!(seen
            .iter()
            .all(|(_, p)| p.message.as_deref().unwrap_or("").chars().count() <= 260));

        client.cancel().await.unwrap();
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_secret_argument_echoed_by_the_command_is_masked_in_progress() {
    bounded(async {
        let env = new_env();
        let _daemon = env.start_daemon();
        let log = ProgressLog::default();
        let client = shim_client(&env, log.clone()).await;
        let r = client
            .call_tool(call("secret_show", json!({"token": "s3cr3t-value-xyz"})))
            .await
            .unwrap();
        assert_eq!(structured(&r)["state"], "completed");
        let answer = format!("{}{}", common::text(&r), structured(&r));
        assert!(
            !answer.contains("s3cr3t"),
            "the result is masked too: {answer}"
        );
        let page = client
            .call_tool(call("exec_result", json!({"id": structured(&r)["id"]})))
            .await
            .unwrap();
        let page = format!("{}{}", common::text(&page), structured(&page));
        assert!(!page.contains("s3cr3t"), "{page}");
        let seen = log.0.lock().unwrap().clone();
        let messages: Vec<String> = seen.iter().filter_map(|(_, p)| p.message.clone()).collect();
        // The daemon masks it in the output it streams; the shim has no value to mask with.
        assert!(
            messages
                .iter()
                .any(|m| m.contains("token=****************")),
            "{messages:?}"
        );
        assert!(
            messages.iter().all(|m| !m.contains("s3cr3t")),
            "{messages:?}"
        );
        client.cancel().await.unwrap();
    })
    .await
}

fn asking_for(version: ProtocolVersion) -> ClientConfig {
    ClientConfig::new(
        ClientCapabilities::default(),
        Implementation::new("waymark-test", "0"),
    )
    .with_protocol_version(version)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn protocol_versions_negotiate_and_calls_work_under_each() {
    bounded(async {
        let env = new_env();
        let _daemon = env.start_daemon();
        let cases = [
            // (asked for in `initialize`, what the server answers)
            (ProtocolVersion::V_2025_06_18, ProtocolVersion::V_2025_06_18),
            (ProtocolVersion::V_2025_11_25, ProtocolVersion::V_2025_11_25),
            // 2026-07-28 has no `initialize` handshake (SEP-2567): a client that still sends
            // one is answered with the newest version that has it.
            (ProtocolVersion::V_2026_07_28, ProtocolVersion::V_2025_11_25),
        ];
        for (i, (asked, answered)) in cases.into_iter().enumerate() {
            let client = shim_client(&env, asking_for(asked.clone())).await;
            let info = client.peer_info().expect("the server answered initialize");
            assert_eq!(info.protocol_version, answered, "asked for {asked}");
            let r = client
                .call_tool(call("append", json!({"line": format!("v{i}"), "secs": 0})))
                .await
                .unwrap();
            assert_eq!(structured(&r)["state"], "completed", "under {answered}");
            client.cancel().await.unwrap();
        }

        // 2026-07-28 proper: `server/discover`, then per-request `_meta`, no handshake.
        let client = discover_2026_07_28(
            asking_for(ProtocolVersion::V_2026_07_28),
            shim_transport(&env),
        )
        .await;
        let r = client
            .call_tool(call("append", json!({"line": "modern", "secs": 0})))
            .await
            .unwrap();
        assert_eq!(structured(&r)["state"], "completed");
        client.cancel().await.unwrap();
        assert_eq!(env.counter_lines(), vec!["v0", "v1", "v2", "modern"]);
    })
    .await
}

const CLIENTS: usize = 20;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn twenty_stdio_clients_distinct_calls_run_each_and_same_call_runs_once() {
    bounded(async {
        let env = new_env();
        let _daemon = env.start_daemon();
        let clients = join_all((0..CLIENTS).map(|_| shim_client(&env, ()))).await;
        many_clients_run_distinct_calls_each_and_the_same_call_once(&env, clients).await;
    })
    .await
}

/// A daemon serving MCP over HTTP on a fresh port, with its token.
struct HttpEnv {
    env: Env,
    _daemon: Daemon,
    _scratch: tempfile::TempDir,
    port: u16,
    token: &'static str,
}

async fn http_env() -> HttpEnv {
    use std::os::unix::fs::PermissionsExt;
    let token = "t0ken-for-the-mcp-more-test";
    let scratch = tempfile::tempdir().unwrap();
    let token_file = scratch.path().join("agent.token");
    std::fs::write(&token_file, token).unwrap();
    std::fs::set_permissions(&token_file, std::fs::Permissions::from_mode(0o600)).unwrap();
    let env = env_with_daemon_settings(&format!(
        "http_listen = \"127.0.0.1:0\"\nhttp_token_file = \"{}\"",
        token_file.display()
    ));
    let daemon = env.start_daemon();
    let port = env.listen_addr("http").port();
    HttpEnv {
        env,
        _daemon: daemon,
        _scratch: scratch,
        port,
        token,
    }
}

impl HttpEnv {
    async fn post(&self, session: Option<&str>, body: &[u8]) -> Exchange {
        let bearer = format!("Bearer {}", self.token);
        let mut headers = vec![
            ("Content-Type", "application/json"),
            ("Accept", "application/json, text/event-stream"),
            ("Authorization", bearer.as_str()),
            ("MCP-Protocol-Version", "2025-11-25"),
        ];
        if let Some(id) = session {
            headers.push(("Mcp-Session-Id", id));
        }
        http::exchange(self.port, "POST", &headers, body).await
    }

    /// `initialize` and `notifications/initialized` over raw HTTP; returns the session id.
    async fn session(&self) -> String {
        let init = json!({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
            "protocolVersion": "2025-11-25", "capabilities": {},
            "clientInfo": {"name": "raw", "version": "0"}}});
        let mut x = self.post(None, init.to_string().as_bytes()).await;
        assert_eq!(x.status, 200);
        let session = x.header("mcp-session-id").expect("a session id");
        let answer = x.message(json!(1)).await.expect("an initialize result");
        assert_eq!(answer["result"]["protocolVersion"], "2025-11-25");
        let done = json!({"jsonrpc": "2.0", "method": "notifications/initialized"});
        let x = self.post(Some(&session), done.to_string().as_bytes()).await;
        assert!(x.status < 300, "initialized: {}", x.status);
        session
    }

    /// rmcp's own HTTP client, connected.
    async fn rmcp_client(&self) -> RunningService<RoleClient, ()> {
        let transport = common::http_client(
            StreamableHttpClientTransportConfig::with_uri(format!(
                "http://127.0.0.1:{}/mcp",
                self.port
            ))
            .auth_header(self.token),
        );
        ().serve(transport).await.expect("MCP initialize over HTTP")
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_malformed_and_oversized_bodies_are_refused_and_serving_goes_on() {
    bounded(async {
        let h = http_env().await;
        let client = h.rmcp_client().await;
        let session = h.session().await;

        // Not JSON at all: a JSON-RPC parse error.
        let mut x = h
            .post(Some(&session), b"{\"jsonrpc\":\"2.0\",\"id\":5,\"method\":")
            .await;
        assert_eq!(x.status, 400);
        let e = x.message(Value::Null).await.expect("a JSON-RPC error");
        assert_eq!(e["error"]["code"], -32700, "{e}");
        // JSON, but not JSON-RPC: an invalid request.
        let mut x = h.post(Some(&session), br#"{"hello":"world"}"#).await;
        assert_eq!(x.status, 400);
        let e = x.message(Value::Null).await.expect("a JSON-RPC error");
        assert_eq!(e["error"]["code"], -32600, "{e}");
        // A method that does not exist: an error answer to that request.
        let mut x = h
            .post(
                Some(&session),
                br#"{"jsonrpc":"2.0","id":7,"method":"tools/frobnicate","params":{}}"#,
            )
            .await;
        assert_eq!(x.status, 200);
        let e = x.message(json!(7)).await.expect("an answer to id 7");
        assert_eq!(e["error"]["code"], -32601, "{e}");
        // 8 MiB: refused before it reaches the daemon's service.
        let big = format!(
            r#"{{"jsonrpc":"2.0","id":8,"method":"tools/call","params":{{"name":"peek","arguments":{{"pad":"{}"}}}}}}"#,
            "a".repeat(8 << 20)
        );
        let x = h.post(Some(&session), big.as_bytes()).await;
        assert_eq!(x.status, 413, "an oversized body is refused");

        // The daemon still serves, on the raw session and on another client.
        let call7 = json!({"jsonrpc": "2.0", "id": 9, "method": "tools/call",
            "params": {"name": "peek", "arguments": {}}});
        let mut x = h.post(Some(&session), call7.to_string().as_bytes()).await;
        assert_eq!(x.status, 200);
        let r = x.message(json!(9)).await.expect("an answer to id 9");
        assert_eq!(r["result"]["structuredContent"]["state"], "completed", "{r}");
        let r = client.call_tool(call("peek", json!({}))).await.unwrap();
        assert_eq!(structured(&r)["state"], "completed");
        assert_eq!(
            h.env.daemon_pid(),
            h._daemon.0.id(),
            "the same daemon answers"
        );
        client.cancel().await.unwrap();
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_stream_closed_mid_call_then_a_new_request_id_attaches_to_the_same_execution() {
    bounded(async {
        let h = http_env().await;
        let session = h.session().await;
        let call_with = |rpc: u64| {
            json!({"jsonrpc": "2.0", "id": rpc, "method": "tools/call",
                "params": {"name": "append", "arguments": {"line": "cut", "secs": 3},
                    "_meta": {"progressToken": rpc}}})
            .to_string()
        };
        let mut first = h.post(Some(&session), call_with(2).as_bytes()).await;
        assert_eq!(first.status, 200);
        // The first stream learns the execution id from a progress notification.
        let note = first.progress().await.expect("a progress notification");
        assert_eq!(note["params"]["progressToken"], 2, "{note}");
        let message = note["params"]["message"].as_str().unwrap().to_string();
        let first_id = message.split(':').next().unwrap().to_string();
        assert!(first_id.starts_with("act_"), "{note}");
        let deadline = Instant::now() + Duration::from_secs(20);
        while h.env.counter_lines().is_empty() {
            assert!(Instant::now() < deadline, "the command never started");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        // The agent's stream goes away while the command runs.
        drop(first);
        // The result then has nowhere to go: completed, and not delivered.
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let st = h
                .env
                .control(json!({"v": 1, "op": "status", "id": first_id, "defer_delivery": true}));
            if st["data"]["state"] == "completed" {
                tokio::time::sleep(Duration::from_millis(500)).await;
                let st = h.env.control(
                    json!({"v": 1, "op": "status", "id": first_id, "defer_delivery": true}),
                );
                assert_eq!(st["data"]["result_delivered"], false, "{st}");
                break;
            }
            assert!(
                Instant::now() < deadline,
                "the command never completed: {st}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }

        let mut second = h.post(Some(&session), call_with(3).as_bytes()).await;
        assert_eq!(second.status, 200);
        let r = second.message(json!(3)).await.expect("an answer to id 3");
        let s = &r["result"]["structuredContent"];
        eprintln!("{r}");
        assert_eq!(s["state"], "completed", "{r}");
        assert!(!s["attached"].is_null(), "the retry attached: {r}");
        assert_eq!(
            s["id"],
            first_id.as_str(),
            "the same execution as the first stream's"
        );
        // Delivered once the response carrying it was written.
        wait_delivered(&h.env, &first_id).await;

        // A third look from a fresh session: one execution in all, one run on the host.
        let client = h.rmcp_client().await;
        let list = client
            .call_tool(call("exec_list", json!({})))
            .await
            .unwrap();
        let items = structured(&list)["items"].as_array().unwrap().clone();
        assert_eq!(items.len(), 1, "one execution: {items:?}");
        assert_eq!(items[0]["id"], s["id"]);
        assert_eq!(h.env.counter_lines(), vec!["cut"], "one run on the host");
        client.cancel().await.unwrap();
    })
    .await
}

/// `waymark mcp` driven line by line, for what rmcp's client will not send.
struct RawShim {
    child: tokio::process::Child,
    stdin: tokio::process::ChildStdin,
    lines: tokio::io::Lines<tokio::io::BufReader<tokio::process::ChildStdout>>,
}

impl RawShim {
    fn start(env: &Env) -> RawShim {
        let mut child = tokio::process::Command::new(bin())
            .arg("--config")
            .arg(&env.config)
            .arg("mcp")
            .env("WAYMARK_LOG", "warn")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        let stdin = child.stdin.take().unwrap();
        let lines = tokio::io::BufReader::new(child.stdout.take().unwrap()).lines();
        RawShim {
            child,
            stdin,
            lines,
        }
    }

    async fn send(&mut self, line: &str) {
        self.stdin.write_all(line.as_bytes()).await.unwrap();
        self.stdin.write_all(b"\n").await.unwrap();
        self.stdin.flush().await.unwrap();
    }

    /// Every message up to and including the one with JSON-RPC id `id`.
    async fn until(&mut self, id: Value) -> Vec<Value> {
        let mut seen = Vec::new();
        while let Some(l) = self.lines.next_line().await.unwrap() {
            let v: Value = serde_json::from_str(&l).expect("the shim writes only JSON-RPC");
            let done = v["id"] == id;
            seen.push(v);
            if done {
                return seen;
            }
        }
        panic!("the shim closed stdout before answering {id}: {seen:?}");
    }
}

impl RawShim {
    async fn initialize(&mut self) {
        self.send(
            &json!({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
                "protocolVersion": "2025-11-25", "capabilities": {},
                "clientInfo": {"name": "raw", "version": "0"}}})
            .to_string(),
        )
        .await;
        self.until(json!(1)).await;
        self.send(r#"{"jsonrpc":"2.0","method":"notifications/initialized"}"#)
            .await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn progress_goes_only_to_the_token_the_client_sent() {
    bounded(async {
        let env = new_env();
        let _daemon = env.start_daemon();
        let mut shim = RawShim::start(&env);
        shim.initialize().await;
        shim.send(r#"{"jsonrpc":"2.0","id":2,"method":"tools/call","params":{"name":"ticker","arguments":{},"_meta":{"progressToken":"tick"}}}"#)
            .await;
        let seen = shim.until(json!(2)).await;
        let (answer, before) = seen.split_last().unwrap();
        assert_eq!(answer["result"]["structuredContent"]["state"], "completed");
        assert!(!before.is_empty(), "progress came before the result");
        for n in before {
            assert_eq!(n["method"], "notifications/progress", "{n}");
            assert_eq!(n["params"]["progressToken"], "tick", "{n}");
        }
        assert!(before
            .iter()
            .any(|n| n["params"]["message"].as_str().unwrap().contains("first tick")));

        shim.send(r#"{"jsonrpc":"2.0","id":3,"method":"tools/call","params":{"name":"ticker","arguments":{}}}"#)
            .await;
        let seen = shim.until(json!(3)).await;
        assert_eq!(seen.len(), 1, "no token, no progress: {seen:?}");
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stdio_garbage_line_does_not_stop_the_next_request() {
    bounded(async {
        let env = new_env();
        let _daemon = env.start_daemon();
        let mut shim = RawShim::start(&env);
        shim.initialize().await;
        shim.send("this is not JSON {{{").await;
        shim.send(r#"{"jsonrpc":"2.0","id":2,"method":"tools/call","params":{"name":"peek","arguments":{}}}"#)
            .await;
        let seen = shim.until(json!(2)).await;
        eprintln!("{seen:?}");
        let last = seen.last().unwrap();
        assert_eq!(
            last["result"]["structuredContent"]["state"], "completed",
            "{last}"
        );
        // Whatever came before the answer is an error about the garbage, not a result.
        for v in &seen[..seen.len() - 1] {
            assert!(v["error"]["code"].is_i64(), "{v}");
        }
        assert!(shim.child.try_wait().unwrap().is_none(), "the shim still runs");
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_ten_mib_argument_is_refused_plainly_and_nothing_runs() {
    bounded(async {
        let env = new_env();
        let _daemon = env.start_daemon();
        let client = shim_client(&env, ()).await;
        let huge = "x".repeat(10 << 20);
        let r = client
            .call_tool(call("append", json!({"line": huge, "secs": 0})))
            .await;
        let said = match &r {
            Ok(r) => {
                assert_eq!(r.is_error, Some(true), "{r:?}");
                common::text(r)
            }
            Err(e) => e.to_string(),
        };
        eprintln!("{said}");
        assert!(
            said.contains("refused") && said.contains("nothing was run"),
            "a plain refusal, not an unknown outcome: {said}"
        );
        assert!(
            !said.to_lowercase().contains("unknown"),
            "not an unknown outcome: {said}"
        );
        // The client is still usable, and the ledger holds no execution for it.
        let ok = client
            .call_tool(call("append", json!({"line": "small", "secs": 0})))
            .await
            .unwrap();
        assert_eq!(structured(&ok)["state"], "completed", "{ok:?}");
        assert_eq!(
            env.executions().len(),
            1,
            "only the small call was accepted"
        );
        assert_eq!(env.counter_lines(), ["small"]);
        client.cancel().await.unwrap();
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exec_result_and_exec_status_deliver_the_result_they_carry_once_written() {
    bounded(async {
        let env = new_env();
        let _daemon = env.start_daemon();
        // Two executions completed for a client that never confirmed delivery.
        let mut ids = Vec::new();
        for line in ["r", "s"] {
            let v = env.control(json!({"v": 1, "op": "call", "tool": "append",
                "args": {"line": line, "secs": 0}, "defer_delivery": true}));
            assert_eq!(v["data"]["state"], "completed", "{v}");
            let id = v["data"]["id"].as_str().unwrap().to_string();
            let st = env.control(json!({"v": 1, "op": "status", "id": id, "defer_delivery": true}));
            assert_eq!(st["data"]["result_delivered"], false, "{st}");
            ids.push(id);
        }
        let client = shim_client(&env, ()).await;
        let r = client
            .call_tool(call("exec_result", json!({"id": ids[0]})))
            .await
            .unwrap();
        assert_eq!(structured(&r)["data"], "done r\n", "{r:?}");
        wait_delivered(&env, &ids[0]).await;
        let s = client
            .call_tool(call("exec_status", json!({"id": ids[1]})))
            .await
            .unwrap();
        assert_eq!(structured(&s)["stdout"], "done s\n", "{s:?}");
        // What the agent reads is true once it reads it, and names tools, not CLI commands.
        let said = common::text(&s);
        assert!(said.contains("delivered with this answer"), "{said}");
        assert!(
            !said.contains("NOT delivered") && !said.contains("not yet delivered"),
            "{said}"
        );
        assert!(!said.contains("`waymark exec"), "{said}");
        assert!(said.contains("`exec_result` tool"), "{said}");
        wait_delivered(&env, &ids[1]).await;
        let call_answer = client
            .call_tool(call("append", json!({"line": "t", "secs": 0})))
            .await
            .unwrap();
        let said = common::text(&call_answer);
        assert!(!said.contains("not yet delivered"), "{said}");
        client.cancel().await.unwrap();
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unknown_tool_is_an_invalid_params_error_listing_every_tool() {
    bounded(async {
        let env = new_env();
        let _daemon = env.start_daemon();
        let client = shim_client(&env, ()).await;
        let err = client
            .call_tool(call("no_such_tool", json!({})))
            .await
            .expect_err("a protocol error, not a tool result");
        let rmcp::ServiceError::McpError(e) = &err else {
            panic!("{err:?}")
        };
        assert_eq!(e.code, rmcp::model::ErrorCode::INVALID_PARAMS, "{e:?}");
        for name in [
            "append",
            "ticker",
            "ssh_exec",
            "exec_status",
            "exec_result",
            "exec_list",
            "exec_cancel",
        ] {
            assert!(e.message.contains(name), "{name} missing: {}", e.message);
        }
        assert!(env.executions().is_empty(), "nothing was accepted");
        client.cancel().await.unwrap();
    })
    .await
}

#[test]
fn a_client_that_only_discovers_and_leaves_ends_the_shim_with_exit_0() {
    use std::io::Write as _;
    let env = new_env();
    let _daemon = env.start_daemon();
    for first in [
        r#"{"jsonrpc":"2.0","id":1,"method":"server/discover","params":{}}"#,
        "",
    ] {
        let mut shim = std::process::Command::new(bin())
            .arg("--config")
            .arg(&env.config)
            .arg("mcp")
            .env("WAYMARK_LOG", "warn")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let mut stdin = shim.stdin.take().unwrap();
        if !first.is_empty() {
            writeln!(stdin, "{first}").unwrap();
        }
        drop(stdin);
        let out = shim.wait_with_output().unwrap();
        assert_eq!(
            out.status.code(),
            Some(0),
            "after {first:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_result_carries_its_output_once_text_for_utf8_base64_for_binary() {
    bounded(async {
        let env = new_env();
        let _daemon = env.start_daemon();
        let client = shim_client(&env, ProgressLog::default()).await;
        let raw = |argv: Value| call("ssh_exec", json!({"host": "h1", "argv": argv}));
        let r = client
            .call_tool(raw(json!(["echo", "plain words"])))
            .await
            .unwrap();
        let s = structured(&r);
        assert_eq!(s["stdout"], "plain words\n", "{s}");
        assert!(s.get("stdout_b64").is_none(), "no base64 copy of text: {s}");
        let r = client
            .call_tool(raw(json!(["printf", "\\377\\376bin"])))
            .await
            .unwrap();
        let s = structured(&r);
        assert_eq!(s["stdout_b64"], "//5iaW4=", "{s}");
        assert!(s.get("stdout").is_none(), "no lossy text of binary: {s}");
        assert!(
            common::text(&r).contains("5 bytes of binary output"),
            "{}",
            common::text(&r)
        );
        client.cancel().await.unwrap();
    })
    .await
}
