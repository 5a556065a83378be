//! `waymark mcp` end to end, driven by rmcp's own client over stdio: a real OpenSSH sshd
//! (testkit), a real daemon process, and the shim as a child process that a test may kill.
//! The daemon's Streamable HTTP endpoint is tested at the end, with rmcp's HTTP client.

mod common;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use rmcp::model::RequestMetaObject;
use rmcp::ServiceExt;
use serde_json::{json, Value};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt};

use common::{bin, bounded, call, structured, text, wait_delivered, Env, StartedDaemon};

/// Host `h1` direct, raw commands allowed, tools `append`, `guarded`, `peek`, `secret_echo`;
/// `daemon` goes into the `[daemon]` table.
fn env_with_daemon_settings(daemon: &str) -> Env {
    Env::mcp_builder().daemon_settings(daemon).build()
}

fn new_env() -> Env {
    env_with_daemon_settings("")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tools_list_publishes_configured_tools_with_schemas_and_annotations() {
    bounded(async {
        let env = new_env();
        let _daemon = env.start_daemon();
        let (client, _) = env.client().await;
        let tools = client.list_all_tools().await.unwrap();
        let by_name = |n: &str| {
            tools
                .iter()
                .find(|t| t.name == n)
                .unwrap_or_else(|| panic!("tool {n} is listed"))
                .clone()
        };
        let append = by_name("append");
        let schema = Value::Object((*append.input_schema).clone());
        assert_eq!(schema["properties"]["line"]["type"], "string");
        assert_eq!(schema["properties"]["line"]["pattern"], "^(?:[a-z0-9-]+)$");
        assert_eq!(
            schema["properties"]["line"]["description"],
            "The line to append."
        );
        assert_eq!(schema["properties"]["secs"]["type"], "integer");
        assert!(append.description.unwrap().contains("Status-checked"));
        let secret = Value::Object((*by_name("secret_echo").input_schema).clone());
        assert_eq!(secret["properties"]["token"]["writeOnly"], true);
        let guarded = by_name("guarded").annotations.unwrap();
        assert_eq!(guarded.destructive_hint, Some(true));
        let peek = by_name("peek").annotations.unwrap();
        assert_eq!(peek.read_only_hint, Some(true));
        let idem = by_name("secret_echo").annotations.unwrap();
        assert_eq!(idem.idempotent_hint, Some(true));
        let raw = Value::Object((*by_name("ssh_exec").input_schema).clone());
        assert_eq!(raw["properties"]["host"]["enum"], json!(["h1"]));
        for t in ["exec_status", "exec_result", "exec_list", "exec_cancel"] {
            by_name(t);
        }
        client.cancel().await.unwrap();
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_starts_the_daemon_returns_id_state_output_and_is_marked_delivered() {
    bounded(async {
        let env = new_env();
        // No daemon: the shim starts one (detached) and relays to it.
        let (client, _) = env.client().await;
        let _started = StartedDaemon(env.daemon_pid());
        let r = client
            .call_tool(call("append", json!({"line": "hello", "secs": 0})))
            .await
            .unwrap();
        let s = structured(&r);
        eprintln!("{}", text(&r));
        let id = s["id"].as_str().expect("an execution id").to_string();
        assert!(id.starts_with("act_"));
        assert_eq!(s["state"], "completed");
        assert_eq!(s["exit_code"], 0);
        assert_eq!(r.is_error, Some(false));
        assert!(s["stdout"].as_str().unwrap().contains("done hello"));
        assert!(text(&r).contains(&id) && text(&r).contains("completed"));
        assert_eq!(env.counter_lines(), vec!["hello"]);

        // Delivery is marked by the shim once the response was written to stdout.
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let st = client
                .call_tool(call("exec_status", json!({"id": id})))
                .await
                .unwrap();
            if structured(&st)["result_delivered"] == true {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "the result was never marked delivered"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let page = client
            .call_tool(call(
                "exec_result",
                json!({"id": id, "offset": 5, "limit": 100}),
            ))
            .await
            .unwrap();
        assert_eq!(structured(&page)["data"], "hello\n");

        // The run records the transport.
        let runs = Command::new(bin())
            .arg("--config")
            .arg(&env.config)
            .args(["runs", "--json"])
            .output()
            .unwrap();
        assert!(String::from_utf8_lossy(&runs.stdout).contains("mcp-stdio"));
        client.cancel().await.unwrap();
    })
    .await
}

/// A result whose response the client cannot read stays "completed, result not delivered":
/// the shim marks delivery only once its write to stdout succeeded, and the daemon never marks
/// it on the shim's behalf. A client that reads it later gets it, and then it is delivered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_result_whose_response_cannot_be_written_is_never_marked_delivered() {
    bounded(async {
        let env = new_env();
        let _daemon = env.start_daemon();
        let mut shim = tokio::process::Command::new(bin())
            .arg("--config")
            .arg(&env.config)
            .arg("mcp")
            .env("WAYMARK_LOG", "warn")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        let mut stdin = shim.stdin.take().unwrap();
        let mut stdout = tokio::io::BufReader::new(shim.stdout.take().unwrap());
        let init = json!({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
            "protocolVersion": "2025-06-18", "capabilities": {},
            "clientInfo": {"name": "unread", "version": "1"}}});
        stdin
            .write_all(format!("{init}\n").as_bytes())
            .await
            .unwrap();
        let mut line = String::new();
        stdout.read_line(&mut line).await.unwrap();
        assert!(line.contains("\"id\":1"), "{line}");
        let ready = json!({"jsonrpc": "2.0", "method": "notifications/initialized"});
        stdin
            .write_all(format!("{ready}\n").as_bytes())
            .await
            .unwrap();
        // The client stops reading: its end of the shim's stdout is gone.
        drop(stdout);
        let call_unread = json!({"jsonrpc": "2.0", "id": 2, "method": "tools/call",
            "params": {"name": "append", "arguments": {"line": "unread", "secs": 0}}});
        stdin
            .write_all(format!("{call_unread}\n").as_bytes())
            .await
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(30);
        let id = loop {
            let done = env
                .executions()
                .into_iter()
                .find(|(_, state)| state == "completed");
            if let Some((id, _)) = done {
                break id;
            }
            assert!(Instant::now() < deadline, "{:?}", env.executions());
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        // The shim has had its answer and tried to write it; nothing was read.
        tokio::time::sleep(Duration::from_secs(1)).await;
        let st = env.control(json!({"v": 1, "op": "status", "id": id, "defer_delivery": true}));
        assert_eq!(st["data"]["state"], "completed", "{st}");
        assert_eq!(st["data"]["result_delivered"], false, "{st}");
        let (client, _) = env.client().await;
        let r = client
            .call_tool(call("exec_result", json!({"id": id})))
            .await
            .unwrap();
        assert_eq!(structured(&r)["data"], "done unread\n", "{r:?}");
        wait_delivered(&env, &id).await;
        assert_eq!(env.counter_lines(), ["unread"]);
        client.cancel().await.unwrap();
        drop(stdin);
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shims_started_at_once_share_the_one_daemon_they_start() {
    bounded(async {
        let env = new_env();
        let (a, b, c) = tokio::join!(env.client(), env.client(), env.client());
        let _started = StartedDaemon(env.daemon_pid());
        for (client, _) in [&a, &b, &c] {
            let tools = client.list_all_tools().await.unwrap();
            assert!(tools.iter().any(|t| t.name == "append"));
        }
        let r =
            b.0.call_tool(call("append", json!({"line": "shared", "secs": 0})))
                .await
                .unwrap();
        assert_eq!(structured(&r)["state"], "completed");
        let list = c.0.call_tool(call("exec_list", json!({}))).await.unwrap();
        assert_eq!(structured(&list)["items"].as_array().unwrap().len(), 1);
        for (client, _) in [a, b, c] {
            client.cancel().await.unwrap();
        }
        // Daemons that lost the race exit by themselves (the ledger is locked); wait for that
        // before the test's directory goes, so none outlives the test.
        let deadline = Instant::now() + Duration::from_secs(15);
        while env.daemons().len() > 1 {
            assert!(
                Instant::now() < deadline,
                "daemons that lost the start race are still running: {:?}\n{}",
                env.daemons(),
                std::fs::read_to_string(env.dir.path().join("run/daemon.log")).unwrap_or_default()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert_eq!(env.daemons(), vec![_started.0]);
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shim_whose_daemon_found_the_ledger_busy_starts_another_once_it_is_free() {
    bounded(async {
        let env = new_env();
        // Another process (a CLI reading the ledger directly) holds the ledger while the shim
        // starts its daemon: that daemon gives up after its grace and exits. The shim must not
        // wait out its whole window on a daemon that is gone; it starts another.
        let held = waymark_ledger::Ledger::init(&env.ledger_dir()).unwrap();
        let release = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_secs(3));
            drop(held);
        });
        let began = Instant::now();
        let (client, _) = env.client().await;
        let r = client
            .call_tool(call("append", json!({"line": "late", "secs": 0})))
            .await
            .unwrap();
        let _started = StartedDaemon(env.daemon_pid());
        let log =
            std::fs::read_to_string(env.dir.path().join("run/daemon.log")).unwrap_or_default();
        assert_eq!(structured(&r)["state"], "completed", "{}\n{log}", text(&r));
        assert!(
            began.elapsed() < Duration::from_secs(15),
            "the shim waited {:?} for a daemon\n{log}",
            began.elapsed()
        );
        assert!(
            log.contains("lock"),
            "the first daemon reported the busy ledger in its log:\n{log}"
        );
        assert_eq!(env.counter_lines(), vec!["late"]);
        release.join().unwrap();
        client.cancel().await.unwrap();
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_killed_mid_call_then_retry_from_a_new_client_attaches_and_runs_once() {
    bounded(async {
        let env = new_env();
        let _daemon = env.start_daemon();
        let (first, pid) = env.client().await;
        let pending = tokio::spawn(async move {
            let r = first
                .call_tool(call("append", json!({"line": "once", "secs": 3})))
                .await;
            (r.is_ok(), first)
        });
        // Wait until the command runs on the host, then kill the shim mid-call.
        let deadline = Instant::now() + Duration::from_secs(20);
        while env.counter_lines().is_empty() {
            assert!(Instant::now() < deadline, "the command never started");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        unsafe { libc::kill(pid as i32, libc::SIGKILL) };
        let (answered, _first) = pending.await.unwrap();
        assert!(!answered, "the killed shim cannot have answered");

        let (second, _) = env.client().await;
        let r = second
            .call_tool(call("append", json!({"line": "once", "secs": 3})))
            .await
            .unwrap();
        let s = structured(&r);
        eprintln!("{}", text(&r));
        assert_eq!(s["state"], "completed");
        assert!(
            !s["attached"].is_null(),
            "the retry attached to the first execution"
        );
        assert!(
            text(&r).contains("not run again")
                && text(&r).contains("io.waymark/idempotency-key")
                && !text(&r).contains("ask_host_marker"),
            "said in words, with the way to a new intent: {}",
            text(&r)
        );
        let list = second
            .call_tool(call("exec_list", json!({})))
            .await
            .unwrap();
        let items = structured(&list)["items"].as_array().unwrap().clone();
        assert_eq!(items.len(), 1, "one execution in all: {items:?}");
        assert_eq!(items[0]["id"], s["id"]);
        assert_eq!(
            env.counter_lines(),
            vec!["once"],
            "exactly one run on the host"
        );
        second.cancel().await.unwrap();
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_arguments_get_a_tool_error_and_the_server_keeps_serving() {
    bounded(async {
        let env = new_env();
        let _daemon = env.start_daemon();
        let (client, _) = env.client().await;
        let r = client
            .call_tool(call("append", json!({"line": "x", "secs": "soon"})))
            .await
            .unwrap();
        eprintln!("{}", text(&r));
        assert_eq!(r.is_error, Some(true));
        assert!(text(&r).contains("secs"));
        let r = client
            .call_tool(call("append", json!({"line": "NOT OK", "secs": 0})))
            .await
            .unwrap();
        assert_eq!(r.is_error, Some(true), "the pattern is enforced");
        // Still serving, and nothing ran.
        let list = client
            .call_tool(call("exec_list", json!({})))
            .await
            .unwrap();
        assert_eq!(structured(&list)["items"], json!([]));
        let ok = client.call_tool(call("peek", json!({}))).await.unwrap();
        assert_eq!(structured(&ok)["state"], "completed");
        assert!(env.counter_lines().is_empty());
        client.cancel().await.unwrap();
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idempotency_key_in_meta_scopes_the_intent() {
    bounded(async {
        let env = new_env();
        let _daemon = env.start_daemon();
        let (client, _) = env.client().await;
        let with_key = |k: &str| {
            let mut meta = RequestMetaObject::default();
            meta.0
                 .0
                .insert("io.waymark/idempotency-key".into(), json!(k));
            let mut params = call("append", json!({"line": "keyed", "secs": 0}));
            params.meta = Some(meta);
            params
        };
        let a = structured(&client.call_tool(with_key("k1")).await.unwrap());
        let b = structured(&client.call_tool(with_key("k1")).await.unwrap());
        let c = structured(&client.call_tool(with_key("k2")).await.unwrap());
        assert_eq!(a["state"], "completed");
        assert_eq!(a["id"], b["id"], "the same key is the same intent");
        assert_ne!(a["id"], c["id"], "another key is another intent");
        assert_eq!(env.counter_lines(), vec!["keyed", "keyed"]);
        client.cancel().await.unwrap();
    })
    .await
}

/// One raw HTTP POST of `tools/list` to the MCP endpoint with these extra headers; returns the
/// status code.
async fn http_status(port: u16, extra: &[(&str, &str)]) -> u16 {
    let body = r#"{"jsonrpc":"2.0","id":1,"method":"tools/list"}"#;
    let mut headers = vec![
        ("Content-Type", "application/json"),
        ("Accept", "application/json, text/event-stream"),
    ];
    headers.extend_from_slice(extra);
    common::http::exchange(port, "POST", &headers, body.as_bytes())
        .await
        .status
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streamable_http_needs_the_token_refuses_foreign_origins_and_runs_calls() {
    use rmcp::transport::streamable_http_client::StreamableHttpClientTransportConfig;
    use std::os::unix::fs::PermissionsExt;

    bounded(async {
        let token = "t0ken-for-the-mcp-http-test";
        let scratch = tempfile::tempdir().unwrap();
        let token_file = scratch.path().join("agent.token");
        std::fs::write(&token_file, token).unwrap();
        std::fs::set_permissions(&token_file, std::fs::Permissions::from_mode(0o600)).unwrap();
        let env = env_with_daemon_settings(&format!(
            "http_listen = \"127.0.0.1:0\"\nhttp_token_file = \"{}\"",
            token_file.display()
        ));
        let _daemon = env.start_daemon();
        let port = env.listen_addr("http").port();

        assert_eq!(http_status(port, &[]).await, 401, "no token");
        assert_eq!(
            http_status(port, &[("Authorization", "Bearer wrong-token-wrong-token")]).await,
            401,
            "wrong token"
        );
        let auth = format!("Bearer {token}");
        assert_eq!(
            http_status(
                port,
                &[("Authorization", &auth), ("Origin", "https://evil.example")]
            )
            .await,
            403,
            "foreign origin"
        );

        let transport = common::http_client(
            StreamableHttpClientTransportConfig::with_uri(format!("http://127.0.0.1:{port}/mcp"))
                .auth_header(token),
        );
        let client = ().serve(transport).await.expect("MCP initialize over HTTP");
        let tools = client.list_all_tools().await.unwrap();
        assert!(tools.iter().any(|t| t.name == "append"));
        let r = client
            .call_tool(call("append", json!({"line": "web", "secs": 0})))
            .await
            .unwrap();
        let s = structured(&r);
        assert_eq!(s["state"], "completed");
        assert!(s["id"].as_str().unwrap().starts_with("act_"));
        assert_eq!(s["actor"], "http:agent");
        assert_eq!(env.counter_lines(), vec!["web"]);
        client.cancel().await.unwrap();
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exec_result_pages_past_the_ledger_from_the_host_by_byte_offset() {
    bounded(async {
        let env = new_env();
        let (client, _) = env.client().await;
        let _started = StartedDaemon(env.daemon_pid());
        // 100 000 bytes: the ledger keeps 64 KiB, the host keeps all of it.
        let script = "head -c 100000 /dev/zero | tr '\\0' y";
        let r = client
            .call_tool(call(
                "ssh_exec",
                json!({"host": "h1", "argv": ["sh", "-c", script]}),
            ))
            .await
            .unwrap();
        let id = structured(&r)["id"].as_str().unwrap().to_string();
        assert_eq!(structured(&r)["state"], "completed");
        let page = client
            .call_tool(call(
                "exec_result",
                json!({"id": id, "offset": 70000, "limit": 1000}),
            ))
            .await
            .unwrap();
        let p = structured(&page);
        assert_eq!(p["source"], "host", "{p}");
        assert_eq!(p["data"].as_str().unwrap(), "y".repeat(1000));
        assert_eq!(p["total_bytes"], 100000);
        assert_eq!(p["next_offset"], 71000);
        let last = client
            .call_tool(call(
                "exec_result",
                json!({"id": id, "offset": 99990, "limit": 1000}),
            ))
            .await
            .unwrap();
        assert_eq!(structured(&last)["data"].as_str().unwrap().len(), 10);
        assert!(structured(&last)["next_offset"].is_null());
        client.cancel().await.unwrap();
    })
    .await
}
