//! MCP over Streamable HTTP end to end: a real OpenSSH sshd (testkit), a real daemon serving
//! `/mcp`, rmcp's own Streamable HTTP client (and raw HTTP where a well-behaved client cannot
//! say what is tested): protocol versions, twenty clients at once, approval through
//! elicitation, durable tasks, and SSE stream resumption with `Last-Event-ID`.

mod common;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::http::{self, Exchange};
use common::*;
use rmcp::model::{
    CallToolResponse, ClientCapabilities, ClientConfig, ElicitRequestParams, ElicitResult,
    ElicitationAction, GetTaskParams, Implementation, ProtocolVersion, TaskPayload, TaskStatus,
};
use rmcp::service::{RequestContext, RunningService};
use rmcp::transport::streamable_http_client::StreamableHttpClientTransportConfig;
use rmcp::{ClientHandler, ErrorData, RoleClient, ServiceExt};
use serde_json::json;

const TOKEN: &str = "t0ken-for-the-mcp-http-suite";

/// A daemon serving MCP over HTTP on a fresh port.
struct Http {
    env: Env,
    _daemon: Daemon,
    _scratch: tempfile::TempDir,
    port: u16,
}

fn http() -> Http {
    use std::os::unix::fs::PermissionsExt;
    let scratch = tempfile::tempdir().unwrap();
    let token_file = scratch.path().join("agent.token");
    std::fs::write(&token_file, TOKEN).unwrap();
    std::fs::set_permissions(&token_file, std::fs::Permissions::from_mode(0o600)).unwrap();
    let env = Env::builder()
        .daemon_settings(&format!(
            "http_listen = \"127.0.0.1:0\"\nhttp_token_file = \"{}\"",
            token_file.display()
        ))
        .tools(APPEND_TOOL)
        .tools(GUARDED_ECHO_TOOL)
        .tools(SLOW_READ_TOOL)
        .build();
    // MCP_HTTP_DEBUG_LOG=info,rmcp=debug shows the daemon's log when a test needs a look.
    let daemon = match std::env::var("MCP_HTTP_DEBUG_LOG") {
        Ok(log) => env.start_daemon_with(
            &[("WAYMARK_LOG", log.as_str())],
            std::process::Stdio::inherit(),
        ),
        Err(_) => env.start_daemon(),
    };
    let port = env.listen_addr("http").port();
    Http {
        env,
        _daemon: daemon,
        _scratch: scratch,
        port,
    }
}

impl Http {
    fn transport(
        &self,
    ) -> impl rmcp::transport::Transport<
        RoleClient,
        Error = impl std::error::Error + Send + Sync + 'static,
    > + 'static {
        common::http_client(
            StreamableHttpClientTransportConfig::with_uri(format!(
                "http://127.0.0.1:{}/mcp",
                self.port
            ))
            .auth_header(TOKEN),
        )
    }

    async fn client<H: ClientHandler>(&self, handler: H) -> RunningService<RoleClient, H> {
        handler
            .serve(self.transport())
            .await
            .expect("MCP initialize over HTTP")
    }
}

fn asking_for(version: ProtocolVersion, caps: ClientCapabilities) -> ClientConfig {
    ClientConfig::new(caps, Implementation::new("waymark-http-test", "0"))
        .with_protocol_version(version)
}

fn with_tasks(mut caps: ClientCapabilities) -> ClientCapabilities {
    caps.extensions
        .get_or_insert_with(Default::default)
        .insert(rmcp::model::TASKS_EXTENSION_ID.into(), Default::default());
    caps
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn protocol_versions_negotiate_and_calls_work_under_each_over_http() {
    bounded(async {
        let h = http();
        let cases = [
            // (asked for in `initialize`, what the server answers)
            (ProtocolVersion::V_2025_06_18, ProtocolVersion::V_2025_06_18),
            (ProtocolVersion::V_2025_11_25, ProtocolVersion::V_2025_11_25),
            // 2026-07-28 has no `initialize` (SEP-2567): the newest version that has it.
            (ProtocolVersion::V_2026_07_28, ProtocolVersion::V_2025_11_25),
        ];
        for (i, (asked, answered)) in cases.into_iter().enumerate() {
            let client = h
                .client(asking_for(asked.clone(), ClientCapabilities::default()))
                .await;
            let info = client.peer_info().expect("the server answered initialize");
            assert_eq!(info.protocol_version, answered, "asked for {asked}");
            let r = client
                .call_tool(call("append", json!({"line": format!("v{i}"), "secs": 0})))
                .await
                .unwrap();
            assert_eq!(structured(&r)["state"], "completed", "under {answered}");
            // Marked delivered once the response body that carried it was written.
            wait_delivered(&h.env, structured(&r)["id"].as_str().unwrap()).await;
            client.cancel().await.unwrap();
        }

        // 2026-07-28 proper: `server/discover`, per-request `_meta`, served statelessly; a
        // plain call, then one made as a task (the client declares the extension).
        let client = discover_2026_07_28(
            asking_for(
                ProtocolVersion::V_2026_07_28,
                with_tasks(ClientCapabilities::default()),
            ),
            h.transport(),
        )
        .await;
        let task = match client
            .call_tool_once(call("append", json!({"line": "modern", "secs": 1})))
            .await
            .unwrap()
        {
            CallToolResponse::Task(t) => t.task.task_id,
            other => panic!("a task, got {other:?}"),
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        let done = loop {
            let t = client
                .get_task(GetTaskParams::new(task.clone()))
                .await
                .unwrap()
                .task;
            if t.status().is_terminal() {
                break t;
            }
            assert_eq!(t.status(), TaskStatus::Working);
            assert!(Instant::now() < deadline, "the task never ended: {t:?}");
            tokio::time::sleep(Duration::from_millis(200)).await;
        };
        let TaskPayload::Completed { result } = done.payload else {
            panic!("completed, got {done:?}");
        };
        assert_eq!(result["structuredContent"]["state"], "completed");
        assert_eq!(result["structuredContent"]["id"], task.as_str());
        // Delivered with the tasks/get answer that carried it, once that body was written.
        wait_delivered(&h.env, &task).await;
        client.cancel().await.unwrap();
        assert_eq!(h.env.counter_lines(), vec!["v0", "v1", "v2", "modern"]);
    })
    .await
}

const CLIENTS: usize = 20;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn twenty_http_clients_distinct_calls_run_each_and_same_call_runs_once() {
    bounded(async {
        let h = http();
        let mut clients = Vec::new();
        for _ in 0..CLIENTS {
            clients.push(h.client(()).await);
        }
        many_clients_run_distinct_calls_each_and_the_same_call_once(&h.env, clients).await;
    })
    .await
}

/// A client that declares elicitation and approves every question, recording each.
#[derive(Clone, Default)]
struct Approver(Arc<Mutex<Vec<String>>>);

impl ClientHandler for Approver {
    fn get_info(&self) -> ClientConfig {
        ClientConfig::new(
            ClientCapabilities::builder().enable_elicitation().build(),
            Implementation::new("waymark-http-test", "0"),
        )
    }

    async fn create_elicitation(
        &self,
        request: ElicitRequestParams,
        _context: RequestContext<RoleClient>,
    ) -> Result<ElicitResult, ErrorData> {
        let ElicitRequestParams::FormElicitationParams { message, .. } = request else {
            panic!("a form elicitation");
        };
        self.0.lock().unwrap().push(message);
        Ok(ElicitResult::new(ElicitationAction::Accept).with_content(json!({"approve": true})))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn approving_through_elicitation_over_http_runs_the_command_once() {
    bounded(async {
        let h = http();
        let approver = Approver::default();
        let client = h.client(approver.clone()).await;
        let r = client
            .call_tool(call("guarded", json!({"line": "web-yes"})))
            .await
            .unwrap();
        let s = structured(&r);
        assert_eq!(s["state"], "completed", "{}", text(&r));
        assert!(s["stdout"].as_str().unwrap().contains("web-yes"), "{s}");
        let asked = approver.0.lock().unwrap().clone();
        assert_eq!(asked.len(), 1, "asked once: {asked:?}");
        let id = s["id"].as_str().unwrap();
        assert!(
            asked[0].contains(id) && asked[0].contains("guarded"),
            "{asked:?}"
        );
        // The actor is the token's name, and the audit trail says who approved.
        assert_eq!(s["actor"], "http:agent");
        client.cancel().await.unwrap();
    })
    .await
}

/// A `tools/call` of `slow_read` announcing protocol `version` (no session), with the
/// standard headers 2026-07-28 requires.
async fn exchange_as(port: u16, version: &str, body: &str) -> Exchange {
    let headers = [("Mcp-Method", "tools/call"), ("Mcp-Name", "slow_read")];
    exchange_with(port, "POST", version, &headers, body).await
}

async fn exchange(port: u16, method: &str, headers: &[(&str, &str)], body: &str) -> Exchange {
    exchange_with(port, method, "2025-11-25", headers, body).await
}

async fn exchange_with(
    port: u16,
    method: &str,
    version: &str,
    extra: &[(&str, &str)],
    body: &str,
) -> Exchange {
    let bearer = format!("Bearer {TOKEN}");
    let mut headers = vec![
        ("Accept", "application/json, text/event-stream"),
        ("Authorization", bearer.as_str()),
        ("MCP-Protocol-Version", version),
    ];
    if !body.is_empty() {
        headers.push(("Content-Type", "application/json"));
    }
    headers.extend_from_slice(extra);
    http::exchange(port, method, &headers, body.as_bytes()).await
}

/// A session under 2025-11-25 (initialize, initialized), opened with raw HTTP; its id.
async fn raw_session(port: u16) -> String {
    let init = json!({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
        "protocolVersion": "2025-11-25", "capabilities": {},
        "clientInfo": {"name": "raw", "version": "0"}}});
    let mut x = exchange(port, "POST", &[], &init.to_string()).await;
    assert_eq!(x.status, 200);
    let session = x.header("mcp-session-id").expect("a session id");
    while let Some(e) = x.event().await {
        if e.data.as_ref().is_some_and(|d| d["id"] == 1) {
            break;
        }
    }
    let done = json!({"jsonrpc": "2.0", "method": "notifications/initialized"});
    let x = exchange(
        port,
        "POST",
        &[("Mcp-Session-Id", &session)],
        &done.to_string(),
    )
    .await;
    assert!(x.status < 300, "initialized: {}", x.status);
    session
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_reconnecting_with_last_event_id_gets_the_events_and_result_it_missed() {
    bounded(async {
        let h = http();
        let session = raw_session(h.port).await;

        // A call that prints over three seconds, with a progress token: its stream carries
        // progress events (with SSE ids), then the result.
        let call = json!({"jsonrpc": "2.0", "id": 7, "method": "tools/call",
            "params": {"name": "append", "arguments": {"line": "resumed", "secs": 3},
                "_meta": {"progressToken": "p7"}}});
        let mut first = exchange(
            h.port,
            "POST",
            &[("Mcp-Session-Id", &session)],
            &call.to_string(),
        )
        .await;
        assert_eq!(first.status, 200);
        let mut last_id = None;
        let mut execution = None;
        while let Some(e) = first.event().await {
            if let Some(d) = &e.data {
                assert_ne!(d["id"], 7, "the result came before the cut: {d}");
                if d["method"] == "notifications/progress" {
                    let m = d["params"]["message"].as_str().unwrap_or("");
                    execution = m.split(':').next().map(str::to_string);
                    last_id = e.id.clone();
                    break;
                }
            }
        }
        let last_id = last_id.expect("a progress event with an SSE id before the cut");
        let execution = execution.unwrap();
        assert!(execution.starts_with("act_"), "{execution}");
        eprintln!("cut after event {last_id}");
        // The stream is cut while the command runs.
        drop(first);

        // Reconnect: GET with the session and the last event id seen.
        let mut again = exchange(
            h.port,
            "GET",
            &[("Mcp-Session-Id", &session), ("Last-Event-ID", &last_id)],
            "",
        )
        .await;
        assert_eq!(again.status, 200, "{:?}", again.headers);
        let deadline = Instant::now() + Duration::from_secs(15);
        let answer = loop {
            let e = tokio::time::timeout_at(deadline.into(), again.event())
                .await
                .expect("the result arrives on the resumed stream within 15 s")
                .expect("the resumed stream carries the result before it ends");
            eprintln!("resumed stream: {e:?}");
            if let Some(d) = e.data {
                if d["id"] == 7 {
                    break d;
                }
            }
        };
        let s = &answer["result"]["structuredContent"];
        assert_eq!(s["state"], "completed", "{answer}");
        assert_eq!(s["id"], execution.as_str());
        assert!(
            s["stdout"].as_str().unwrap().contains("done resumed"),
            "{answer}"
        );
        assert_eq!(
            h.env.counter_lines(),
            vec!["resumed"],
            "one run on the host"
        );
    })
    .await
}

/// How long rmcp's priming event asks a client to wait before it reconnects (`retry:`); the
/// SDKs honour it, so a short command has finished by the time they are back.
const SERVER_RETRY: Duration = Duration::from_secs(3);

/// What a reconnect while the command runs cannot show: the result is produced while no client
/// is attached, and the stream resumed after the server's retry interval must still carry it
/// (then end, as the request it belongs to is answered).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_result_produced_while_the_client_was_away_is_replayed_on_the_resumed_stream() {
    bounded(async {
        let h = http();
        let session = raw_session(h.port).await;
        let call = json!({"jsonrpc": "2.0", "id": 9, "method": "tools/call",
            "params": {"name": "append", "arguments": {"line": "away", "secs": 1}}});
        let mut first = exchange(
            h.port,
            "POST",
            &[("Mcp-Session-Id", &session)],
            &call.to_string(),
        )
        .await;
        assert_eq!(first.status, 200);
        // The priming event: an SSE id and no data. The client goes away right after it.
        let primed = first.event().await.expect("a priming event");
        assert!(primed.data.is_none(), "{primed:?}");
        let last_id = primed.id.expect("the priming event carries an SSE id");
        drop(first);
        let away = Instant::now();

        wait_for(
            || h.env.executions().values().any(|s| s == "completed"),
            "the call to complete on the host while no client is attached",
            Duration::from_secs(30),
        );
        tokio::time::sleep_until((away + SERVER_RETRY).into()).await;

        let mut again = exchange(
            h.port,
            "GET",
            &[("Mcp-Session-Id", &session), ("Last-Event-ID", &last_id)],
            "",
        )
        .await;
        assert_eq!(again.status, 200, "{:?}", again.headers);
        let deadline = Instant::now() + Duration::from_secs(15);
        let mut seen = Vec::new();
        let answer = loop {
            let e = tokio::time::timeout_at(deadline.into(), again.event())
                .await
                .expect("the resumed stream answers within 15 s")
                .unwrap_or_else(|| {
                    panic!("the resumed stream ended without the result; it carried {seen:?}")
                });
            match e.data {
                Some(d) if d["id"] == 9 => break d,
                other => seen.push(other),
            }
        };
        let s = &answer["result"]["structuredContent"];
        assert_eq!(s["state"], "completed", "{answer}");
        assert!(
            s["stdout"].as_str().unwrap().contains("done away"),
            "{answer}"
        );
        // The request is answered, so its stream ends (nothing more than the chunked body's
        // last size line) instead of idling on keep-alives.
        while let Some(e) = tokio::time::timeout_at(deadline.into(), again.event())
            .await
            .expect("the resumed stream ends after the result")
        {
            assert!(e.data.is_none(), "after the result: {e:?}");
        }
        assert_eq!(h.env.counter_lines(), vec!["away"], "one run on the host");
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn under_2026_07_28_over_http_an_approval_is_asked_with_input_required() {
    bounded(async {
        let h = http();
        let approver = Modern::new(true);
        let client = discover_2026_07_28(approver.clone(), h.transport()).await;
        let r = client
            .call_tool(call("guarded", json!({"line": "web-modern"})))
            .await
            .unwrap();
        let s = structured(&r);
        assert_eq!(s["state"], "completed", "{}", text(&r));
        assert!(s["stdout"].as_str().unwrap().contains("web-modern"), "{s}");
        assert_eq!(approver.asked.lock().unwrap().len(), 1);
        let list = h
            .env
            .control(json!({"v": 1, "op": "list", "tool": "guarded"}));
        assert_eq!(list["data"]["items"].as_array().unwrap().len(), 1, "{list}");
        client.cancel().await.unwrap();
    })
    .await
}

/// Under 2026-07-28 HTTP is stateless and rmcp's server ignores `notifications/cancelled`
/// (rmcp 3.11 `transport/streamable_http_server/tower.rs`, the stateless `Notification` arm),
/// so a client's only way to cancel a call is to close its stream; rmcp then drops the handler
/// (#857), and Waymark cancels the execution where the tool's replay contract allows it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn under_2026_07_28_closing_the_stream_of_a_read_only_call_cancels_its_execution() {
    bounded(async {
        let h = http();
        let call = json!({"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {
        "name": "slow_read", "arguments": {},
        "_meta": {
            "progressToken": "p1",
            "io.modelcontextprotocol/protocolVersion": "2026-07-28",
            "io.modelcontextprotocol/clientCapabilities": {},
            "io.modelcontextprotocol/clientInfo": {"name": "raw", "version": "0"},
        }}});
        let mut x = exchange_as(h.port, "2026-07-28", &call.to_string()).await;
        if x.status != 200 {
            let mut body = String::new();
            let _ = tokio::io::AsyncReadExt::read_to_string(&mut x.reader, &mut body).await;
            panic!("{} {:?} {body}", x.status, x.headers);
        }
        // The execution is named in the first progress event; then the client goes away.
        let id = loop {
            let e = x
                .event()
                .await
                .expect("a progress event before the stream ends");
            let Some(d) = e.data else { continue };
            if d["method"] == "notifications/progress" {
                let m = d["params"]["message"].as_str().unwrap_or("").to_string();
                break m.split(':').next().unwrap().to_string();
            }
        };
        assert!(id.starts_with("act_"), "{id}");
        wait_for(
            || ["dispatched", "running"].contains(&h.env.state(&id).as_str()),
            "the command to be sent to the host",
            Duration::from_secs(10),
        );
        // Give the host a moment to start it (a cancel before its marker exists is refused).
        tokio::time::sleep(Duration::from_millis(1500)).await;
        drop(x);
        wait_for(
            || h.env.state(&id) == "cancelled",
            "the execution to be cancelled",
            Duration::from_secs(15),
        );
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_task_is_seen_only_by_the_actor_that_made_it() {
    bounded(async {
        let h = http();
        let tasks = || {
            asking_for(
                ProtocolVersion::V_2025_11_25,
                with_tasks(ClientCapabilities::default()),
            )
        };
        let mine = h.client(tasks()).await;
        let task = match mine
            .call_tool_once(task_call("append", json!({"line": "mine", "secs": 0})))
            .await
            .unwrap()
        {
            CallToolResponse::Task(t) => t.task.task_id,
            other => panic!("a task, got {other:?}"),
        };
        // The bearer token's actor made it: another HTTP session of the same token sees it.
        let same = h.client(tasks()).await;
        same.get_task(GetTaskParams::new(task.clone()))
            .await
            .expect("the same actor sees its task");
        // Another actor (the stdio shim: uid and program) does not, though the daemon knows it.
        let other = shim_client(&h.env, tasks()).await;
        let refused = other
            .get_task(GetTaskParams::new(task.clone()))
            .await
            .expect_err("another actor's execution is no task of its");
        assert!(format!("{refused:?}").contains("no task"), "{refused:?}");
        let status = other
            .call_tool(call("exec_status", json!({"id": task})))
            .await
            .unwrap();
        assert_eq!(structured(&status)["id"], task.as_str());
        for c in [mine, same] {
            c.cancel().await.unwrap();
        }
        other.cancel().await.unwrap();
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deleting_a_session_answers_204_and_ends_it() {
    bounded(async {
        let h = http();
        let init = json!({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
            "protocolVersion": "2025-11-25", "capabilities": {},
            "clientInfo": {"name": "raw", "version": "0"}}});
        let mut x = exchange(h.port, "POST", &[], &init.to_string()).await;
        assert_eq!(x.status, 200);
        let session = x.header("mcp-session-id").expect("a session id");
        while let Some(e) = x.event().await {
            if e.data.as_ref().is_some_and(|d| d["id"] == 1) {
                break;
            }
        }
        // The SDKs (TypeScript, Python) expect 200 or 204 for a session they end.
        let gone = exchange(h.port, "DELETE", &[("Mcp-Session-Id", &session)], "").await;
        assert_eq!(gone.status, 204, "DELETE of a session");
        let ping = json!({"jsonrpc": "2.0", "id": 2, "method": "ping"});
        let after = exchange(
            h.port,
            "POST",
            &[("Mcp-Session-Id", &session)],
            &ping.to_string(),
        )
        .await;
        assert_eq!(after.status, 404, "a request in the ended session");
    })
    .await
}

/// Issue 36 part 3 with rmcp's own client: the call's SSE stream is cut (the fault proxy closes
/// every live connection) while its 1 s command runs, and the client's reconnect is held in the
/// proxy until the command has completed. The client resumes with `Last-Event-ID`; the result,
/// produced while it was away, arrives on the resumed stream, and the command ran once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rmcps_client_cut_off_mid_call_gets_the_result_on_its_resumed_stream() {
    bounded(async {
        let h = http();
        let proxy = waymark_testkit::FaultProxy::start(std::net::SocketAddr::from((
            [127, 0, 0, 1],
            h.port,
        )));
        let transport = common::http_client(
            StreamableHttpClientTransportConfig::with_uri(format!(
                "http://127.0.0.1:{}/mcp",
                proxy.port()
            ))
            .auth_header(TOKEN),
        );
        let client = asking_for(ProtocolVersion::V_2025_11_25, ClientCapabilities::default())
            .serve(transport)
            .await
            .expect("MCP initialize over HTTP through the proxy");
        let peer = client.peer().clone();
        let pending = tokio::spawn(async move {
            peer.call_tool(call("append", json!({"line": "cut", "secs": 1})))
                .await
        });
        // The command writes its line first: then the call's stream is open.
        let deadline = Instant::now() + Duration::from_secs(30);
        while h.env.counter_lines().is_empty() {
            assert!(Instant::now() < deadline, "the command never started");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        // Held off while the command finishes: the client's reconnect waits in the proxy, so
        // the result is produced while no client listens (the case rmcp alone loses).
        proxy.blackhole(true);
        proxy.cut_all();
        let deadline = Instant::now() + Duration::from_secs(30);
        while !h.env.executions().values().any(|s| s == "completed") {
            assert!(Instant::now() < deadline, "the command never completed");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        proxy.blackhole(false);
        let r = pending
            .await
            .unwrap()
            .expect("the result arrives on the resumed stream");
        assert_eq!(structured(&r)["state"], "completed", "{r:?}");
        assert_eq!(h.env.counter_lines(), ["cut"], "the command ran once");
        client.cancel().await.unwrap();
    })
    .await
}
