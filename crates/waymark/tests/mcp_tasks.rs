//! Durable MCP tasks (SEP-2663 as rmcp 3.11 implements it), end to end: a real OpenSSH sshd
//! (testkit), real daemon processes, `waymark mcp` driven by rmcp's own client declaring the
//! tasks extension. A task's id is the execution ID and its state is the ledger's, so it
//! survives the daemon being killed.

mod common;

use std::time::{Duration, Instant};

use common::*;
use std::sync::{Arc, Mutex};

use rmcp::model::{
    CallToolResponse, CallToolResult, CancelTaskParams, ClientCapabilities, ClientConfig,
    ClientRequest, CustomRequest, DetailedTask, GetTaskParams, Implementation,
    ProgressNotificationParam, ProtocolVersion, ServerResult, TaskPayload, TaskStatus,
    UpdateTaskParams,
};
use rmcp::service::{NotificationContext, RunningService};
use rmcp::{ClientHandler, RoleClient};
use serde_json::{json, Value};

const TICKER_TOOL: &str = r#"
[tools.ticker]
description = "Print a line, wait, print another."
hosts = ["h1"]
argv = ["sh", "-c", "echo first tick; sleep 4; echo last tick"]
contract = "read_only"
"#;

fn env() -> Env {
    Env::builder()
        .tools(APPEND_TOOL)
        .tools(GUARDED_ECHO_TOOL)
        .tools(SLOW_READ_TOOL)
        .tools(TICKER_TOOL)
        .build()
}

/// A client that declares the tasks extension (and, with `elicit`, form elicitation).
fn tasks_client(elicit: bool) -> ClientConfig {
    let caps = if elicit {
        ClientCapabilities::builder().enable_elicitation().build()
    } else {
        ClientCapabilities::default()
    };
    let mut caps = caps;
    caps.extensions
        .get_or_insert_with(Default::default)
        .insert(rmcp::model::TASKS_EXTENSION_ID.into(), Default::default());
    ClientConfig::new(caps, Implementation::new("waymark-tasks-test", "0"))
}

/// Starts a call as a task; returns the task id.
async fn start(
    client: &RunningService<RoleClient, ClientConfig>,
    name: &'static str,
    a: Value,
) -> String {
    match client.call_tool_once(task_call(name, a)).await.unwrap() {
        CallToolResponse::Task(t) => {
            assert_eq!(t.task.status, TaskStatus::Working);
            assert!(t.task.task_id.starts_with("act_"), "{t:?}");
            t.task.task_id
        }
        other => panic!("a task, got {other:?}"),
    }
}

async fn get(client: &RunningService<RoleClient, ClientConfig>, id: &str) -> DetailedTask {
    client
        .get_task(GetTaskParams::new(id.to_string()))
        .await
        .unwrap()
        .task
}

/// Polls `tasks/get` until `done` holds (or `within` runs out); returns every task seen.
async fn poll_until(
    client: &RunningService<RoleClient, ClientConfig>,
    id: &str,
    within: Duration,
    done: impl Fn(&DetailedTask) -> bool,
) -> Vec<DetailedTask> {
    let deadline = Instant::now() + within;
    let mut seen = Vec::new();
    loop {
        let t = get(client, id).await;
        let stop = done(&t);
        seen.push(t);
        if stop {
            return seen;
        }
        assert!(
            Instant::now() < deadline,
            "task {id} never reached the expected status; last {:?}",
            seen.last()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

fn result_of(t: &DetailedTask) -> CallToolResult {
    match &t.payload {
        TaskPayload::Completed { result } => {
            serde_json::from_value(Value::Object(result.clone())).unwrap()
        }
        other => panic!("a completed task, got {other:?}"),
    }
}

/// A 2025-11-25 task method that SEP-2663 dropped (`tasks/result`, `tasks/list`).
async fn custom(
    client: &RunningService<RoleClient, ClientConfig>,
    method: &str,
    params: Value,
) -> Value {
    let r = client
        .send_request(ClientRequest::CustomRequest(CustomRequest::new(
            method,
            Some(params),
        )))
        .await
        .unwrap();
    match r {
        ServerResult::CustomResult(c) => c.0,
        ServerResult::CallToolResult(c) => serde_json::to_value(c).unwrap(),
        other => serde_json::to_value(other).unwrap(),
    }
}

fn pid_alive(pid: u32) -> bool {
    // A zombie (killed, not yet reaped by the shim that started it) is not alive.
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|s| {
            let state = s.rsplit(')').next().unwrap_or("").trim_start();
            !state.starts_with('Z') && !state.starts_with('X')
        })
        .unwrap_or(false)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_task_survives_the_daemon_being_killed_and_reports_the_true_outcome() {
    bounded(async {
        let env = env();
        // The shim starts the daemon (detached).
        let first = shim_client(&env, tasks_client(false)).await;
        let killed = StartedDaemon(env.daemon_pid());
        let id = start(&first, "append", json!({"line": "durable", "secs": 4})).await;
        // The task is durable before the answer: the daemon's ledger knows the id.
        assert_ne!(env.state(&id), "?");
        let t = get(&first, &id).await;
        assert_eq!(t.status(), TaskStatus::Working, "{t:?}");

        // The command runs on the host: kill the daemon mid-run, and the first client too.
        wait_for(
            || !env.counter_lines().is_empty(),
            "the command to start",
            Duration::from_secs(10),
        );
        unsafe { libc::kill(killed.0 as i32, libc::SIGKILL) };
        wait_for(
            || !pid_alive(killed.0),
            "the daemon to die",
            Duration::from_secs(5),
        );
        first.cancel().await.unwrap();

        // A new client (a new shim, which starts a new daemon) asks about the same task.
        let second = shim_client(&env, tasks_client(false)).await;
        let restarted = StartedDaemon(env.daemon_pid());
        assert_ne!(restarted.0, killed.0);
        let seen = poll_until(&second, &id, Duration::from_secs(15), |t| {
            t.status().is_terminal()
        })
        .await;
        for t in &seen {
            eprintln!(
                "after the restart: {:?} {:?}",
                t.status(),
                t.task.status_message
            );
        }
        for t in &seen[..seen.len() - 1] {
            assert_eq!(t.status(), TaskStatus::Working, "{t:?}");
            assert!(t.task.status_message.as_deref().unwrap_or("").contains(&id));
        }
        let last = seen.last().unwrap();
        assert_eq!(last.status(), TaskStatus::Completed, "{last:?}");
        let r = result_of(last);
        let s = structured(&r);
        assert_eq!(s["id"], id.as_str());
        assert_eq!(s["state"], "completed");
        assert_eq!(s["exit_code"], 0);
        assert_eq!(r.is_error, Some(false));
        assert!(
            s["stdout"].as_str().unwrap().contains("done durable"),
            "{s}"
        );

        // tasks/result (2025-11-25) gives the same result; tasks/list names the task.
        let r = custom(&second, "tasks/result", json!({"taskId": id})).await;
        assert_eq!(r["structuredContent"]["state"], "completed", "{r}");
        assert_eq!(r["structuredContent"]["exit_code"], 0, "{r}");
        let list = custom(&second, "tasks/list", json!({})).await;
        let tasks = list["tasks"].as_array().unwrap();
        assert!(
            tasks
                .iter()
                .any(|t| t["taskId"] == id.as_str() && t["status"] == "completed"),
            "{list}"
        );

        // The result counts as delivered once tasks/get carried it.
        wait_for(
            || {
                env.control(json!({"v": 1, "op": "status", "id": id, "defer_delivery": true}))
                    ["data"]["result_delivered"]
                    == true
            },
            "the result to be marked delivered",
            Duration::from_secs(5),
        );
        assert_eq!(env.counter_lines(), vec!["durable"], "one run on the host");
        second.cancel().await.unwrap();
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tasks_cancel_follows_the_replay_contract() {
    bounded(async {
        let env = env();
        let _daemon = env.start_daemon();
        let client = shim_client(&env, tasks_client(false)).await;

        // read_only: cancelled on the host.
        let read = start(&client, "slow_read", json!({})).await;
        tokio::time::sleep(Duration::from_millis(1500)).await;
        client
            .cancel_task(CancelTaskParams::new(read.clone()))
            .await
            .unwrap();
        let seen = poll_until(&client, &read, Duration::from_secs(10), |t| {
            t.status().is_terminal()
        })
        .await;
        assert_eq!(seen.last().unwrap().status(), TaskStatus::Cancelled);
        assert_eq!(env.state(&read), "cancelled");

        // status_check: refused, and the command runs to its end.
        let append = start(&client, "append", json!({"line": "kept", "secs": 2})).await;
        let refused = client
            .cancel_task(CancelTaskParams::new(append.clone()))
            .await
            .unwrap_err()
            .to_string();
        assert!(refused.contains("runs to its end"), "{refused}");
        let seen = poll_until(&client, &append, Duration::from_secs(10), |t| {
            t.status().is_terminal()
        })
        .await;
        let r = result_of(seen.last().unwrap());
        assert_eq!(structured(&r)["state"], "completed");
        assert_eq!(env.counter_lines(), vec!["kept"]);

        // A finished task cannot be cancelled; an id the ledger does not know is no task.
        let late = client
            .cancel_task(CancelTaskParams::new(append.clone()))
            .await
            .unwrap_err()
            .to_string();
        assert!(late.contains("already completed"), "{late}");
        let none = client
            .get_task(GetTaskParams::new("act_00000000000000000000000000"))
            .await
            .unwrap_err()
            .to_string();
        assert!(none.contains("no task"), "{none}");
        client.cancel().await.unwrap();
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn under_2026_07_28_an_approval_is_an_input_required_task_answered_by_tasks_update() {
    bounded(async {
        let env = env();
        let _daemon = env.start_daemon();
        // 2026-07-28 proper: `server/discover`, capabilities in every request's `_meta`; the
        // server may not send `elicitation/create` here, so the question travels in the task.
        let client = discover_2026_07_28(
            tasks_client(true).with_protocol_version(ProtocolVersion::V_2026_07_28),
            shim_transport(&env),
        )
        .await;
        let id = start(&client, "guarded", json!({"line": "asked-1"})).await;
        let seen = poll_until(&client, &id, Duration::from_secs(10), |t| {
            t.status() != TaskStatus::Working
        })
        .await;
        let t = seen.last().unwrap();
        let TaskPayload::InputRequired { input_requests } = &t.payload else {
            panic!("input_required, got {t:?}");
        };
        let q = serde_json::to_value(&input_requests["approval"]).unwrap();
        assert_eq!(q["method"], "elicitation/create", "{q}");
        let message = q["params"]["message"].as_str().unwrap();
        assert!(
            message.contains(&id) && message.contains("guarded"),
            "{message}"
        );
        assert!(
            env.counter_lines().is_empty(),
            "nothing ran before approval"
        );

        let mut answer = std::collections::BTreeMap::new();
        answer.insert(
            "approval".to_string(),
            json!({"action": "accept", "content": {"approve": true}}),
        );
        client
            .update_task(UpdateTaskParams::new(id.clone(), answer))
            .await
            .unwrap();
        let seen = poll_until(&client, &id, Duration::from_secs(10), |t| {
            t.status().is_terminal()
        })
        .await;
        let r = result_of(seen.last().unwrap());
        let s = structured(&r);
        assert_eq!(s["state"], "completed", "{s}");
        assert!(s["stdout"].as_str().unwrap().contains("asked-1"), "{s}");
        client.cancel().await.unwrap();
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_elicitation_an_approval_task_is_working_and_the_operator_decides() {
    bounded(async {
        let env = env();
        let _daemon = env.start_daemon();
        let client = shim_client(&env, tasks_client(false)).await;
        let id = start(&client, "guarded", json!({"line": "op-2"})).await;
        wait_for(
            || env.state(&id) == "awaiting_approval",
            "the approval wait",
            Duration::from_secs(10),
        );
        let t = get(&client, &id).await;
        assert_eq!(t.status(), TaskStatus::Working, "{t:?}");
        assert!(
            t.task
                .status_message
                .as_deref()
                .unwrap()
                .contains("waymark approve"),
            "{t:?}"
        );
        env.operator_approve(&id);
        let seen = poll_until(&client, &id, Duration::from_secs(10), |t| {
            t.status().is_terminal()
        })
        .await;
        assert_eq!(
            structured(&result_of(seen.last().unwrap()))["state"],
            "completed"
        );
        // A client that did not declare the extension still gets plain results.
        let plain = shim_client(&env, ClientConfig::default()).await;
        let r = plain
            .call_tool(call("append", json!({"line": "plain", "secs": 0})))
            .await
            .unwrap();
        assert_eq!(structured(&r)["state"], "completed");
        plain.cancel().await.unwrap();
        client.cancel().await.unwrap();
    })
    .await
}

/// A tasks client that keeps the progress notifications it receives.
#[derive(Clone)]
struct TaskProgressLog {
    config: ClientConfig,
    seen: Arc<Mutex<Vec<ProgressNotificationParam>>>,
}

impl ClientHandler for TaskProgressLog {
    fn get_info(&self) -> ClientConfig {
        self.config.clone()
    }

    async fn on_progress(
        &self,
        params: ProgressNotificationParam,
        _context: NotificationContext<RoleClient>,
    ) {
        self.seen.lock().unwrap().push(params);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_running_task_reports_its_output_in_progress_and_in_tasks_get() {
    bounded(async {
        let env = env();
        let _daemon = env.start_daemon();
        let log = TaskProgressLog {
            config: tasks_client(false),
            seen: Arc::default(),
        };
        let client = shim_client(&env, log.clone()).await;
        let id = match client
            .call_tool_once(task_call("ticker", json!({})))
            .await
            .unwrap()
        {
            CallToolResponse::Task(t) => t.task.task_id,
            other => panic!("a task, got {other:?}"),
        };
        // The answer came at acceptance; the command prints its first line, then waits.
        let running = Instant::now() + Duration::from_secs(10);
        let message = loop {
            let t = client
                .get_task(GetTaskParams::new(id.clone()))
                .await
                .unwrap()
                .task;
            let m = t.task.status_message.clone().unwrap_or_default();
            if m.contains("first tick") {
                assert_eq!(t.status(), TaskStatus::Working, "{t:?}");
                break m;
            }
            assert!(
                Instant::now() < running && !t.status().is_terminal(),
                "tasks/get never showed the output of the running command: {t:?}"
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        };
        eprintln!("tasks/get while running: {message}");
        assert!(message.contains(&id), "{message}");
        assert!(message.contains("11 bytes of output so far"), "{message}");
        assert!(!message.contains("last tick"), "{message}");

        // The call's progress token stays good for the task's life.
        let seen = log.seen.lock().unwrap().clone();
        assert!(
            seen.iter().any(
                |p| p.message.as_deref().unwrap_or("").contains("first tick") && p.progress == 11.0
            ),
            "a progress notification carried the first line: {seen:?}"
        );

        let t = loop {
            let t = client
                .get_task(GetTaskParams::new(id.clone()))
                .await
                .unwrap()
                .task;
            if t.status().is_terminal() {
                break t;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        };
        let s = structured(&result_of(&t));
        assert_eq!(s["state"], "completed", "{s}");
        assert_eq!(s["stdout"], "first tick\nlast tick\n", "{s}");
        client.cancel().await.unwrap();
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_that_declares_tasks_gets_a_plain_result_unless_the_call_asks_for_a_task() {
    bounded(async {
        let env = env();
        let _daemon = env.start_daemon();
        // 2025-11-25, the extension declared at `initialize` (as the Inspector does).
        let client = shim_client(
            &env,
            tasks_client(false).with_protocol_version(ProtocolVersion::V_2025_11_25),
        )
        .await;
        // A call that does not ask: a plain result, which every client can show.
        match client
            .call_tool_once(call("append", json!({"line": "plain", "secs": 0})))
            .await
            .unwrap()
        {
            CallToolResponse::Complete(r) => {
                assert_eq!(structured(&r)["state"], "completed", "{r:?}")
            }
            other => panic!("a plain result, got {other:?}"),
        }
        // A call whose own `_meta` asks for a task: a task.
        let id = start(&client, "append", json!({"line": "as-task", "secs": 0})).await;
        let done = poll_until(&client, &id, Duration::from_secs(10), |t| {
            t.status().is_terminal()
        })
        .await;
        assert_eq!(
            structured(&result_of(done.last().unwrap()))["state"],
            "completed"
        );
        assert_eq!(env.counter_lines(), vec!["plain", "as-task"]);
        // The shim ends before the test does (nextest saw it hold the output as a leak).
        client.cancel().await.unwrap();
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_attached_repeat_of_a_completed_task_carries_its_true_state_and_times() {
    bounded(async {
        let env = env();
        let _daemon = env.start_daemon();
        let client = shim_client(&env, tasks_client(false)).await;
        let a = json!({"line": "once", "secs": 0});
        let id = start(&client, "append", a.clone()).await;
        let done = poll_until(&client, &id, Duration::from_secs(10), |t| {
            t.status().is_terminal()
        })
        .await;
        let first = &done.last().unwrap().task;
        // The same call again attaches to the completed execution: its handle says so.
        let again = match client.call_tool_once(task_call("append", a)).await.unwrap() {
            CallToolResponse::Task(t) => t.task,
            other => panic!("a task, got {other:?}"),
        };
        assert_eq!(again.task_id, id, "attached to the first execution");
        assert_eq!(again.status, TaskStatus::Completed, "{again:?}");
        assert_eq!(again.created_at, first.created_at, "accepted then, not now");
        // The execution's own last change (the attach itself may record one, such as delivery).
        assert!(again.last_updated_at >= first.last_updated_at, "{again:?}");
        let message = again.status_message.clone().unwrap_or_default();
        assert!(!message.contains("not yet sent"), "{message}");
        assert_eq!(env.counter_lines(), vec!["once"]);
        client.cancel().await.unwrap();
    })
    .await
}
