//! Approval through MCP elicitation, and MCP cancellation of an in-flight `tools/call`, end to
//! end. Setup from `common`: a real OpenSSH sshd (testkit), a real
//! daemon process, and rmcp's own client driving `waymark mcp`.

mod common;

use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rmcp::model::{
    CallToolRequestParams, ClientCapabilities, ClientConfig, ElicitRequestParams, ElicitResult,
    ElicitationAction, Implementation,
};
use rmcp::service::{RequestContext, RunningService};
use rmcp::{ClientHandler, ErrorData, RoleClient};
use serde_json::json;

use common::{bounded, call, shim_client, structured, text, Daemon, Env};

/// `guarded` appends `line` (irreversible, approval per call); `slow_read` is read-only and
/// takes 30 s; `slow_append` appends `line`, then sleeps 3 s (status_check).
const TOOLS: &str = r#"
[tools.guarded]
description = "Append a line to the counter file; needs approval."
hosts = ["h1"]
argv = ["sh", "-c", "echo \"$1\" >> {counter}; echo appended \"$1\"", "guarded", "{line}"]
contract = "irreversible"
approval = "per_call"

[tools.guarded.args.line]
type = "string"
pattern = "[a-z0-9-]+"

[tools.slow_read]
description = "Read-only, slow."
hosts = ["h1"]
argv = ["sh", "-c", "echo start; sleep 30; echo end"]
contract = "read_only"
timeout = "60s"

[tools.slow_append]
description = "Append a line, then sleep."
hosts = ["h1"]
argv = ["sh", "-c", "echo \"$1\" >> {counter}; sleep 3; echo done \"$1\"", "slow_append", "{line}"]
contract = "status_check"
retry_window = "10m"
dedup_window = "1h"
timeout = "60s"

[tools.slow_append.args.line]
type = "string"
pattern = "[a-z0-9-]+"
"#;

/// Host `h1` direct with this suite's tools.
fn new_env() -> Env {
    Env::builder().tools(TOOLS).build()
}

/// A daemon that waits `approval_wait_secs` for an approval before answering "pending".
fn start_daemon(env: &Env, approval_wait_secs: u64) -> Daemon {
    env.start_daemon_with(
        &[(
            "WAYMARK_APPROVAL_WAIT_SECS",
            approval_wait_secs.to_string().as_str(),
        )],
        Stdio::inherit(),
    )
}

/// How the test user answers an approval question.
#[derive(Clone, Copy)]
enum Answer {
    Approve,
    Refuse,
    Decline,
    Cancel,
}

/// A client that declares elicitation and answers every question the same way, recording
/// the messages it was shown.
#[derive(Clone)]
struct Asker {
    answer: Answer,
    asked: Arc<Mutex<Vec<String>>>,
}

impl Asker {
    fn new(answer: Answer) -> Asker {
        Asker {
            answer,
            asked: Arc::default(),
        }
    }

    fn asked(&self) -> Vec<String> {
        self.asked.lock().unwrap().clone()
    }
}

impl ClientHandler for Asker {
    fn get_info(&self) -> ClientConfig {
        ClientConfig::new(
            ClientCapabilities::builder().enable_elicitation().build(),
            Implementation::new("waymark-test", "0"),
        )
    }

    async fn create_elicitation(
        &self,
        request: ElicitRequestParams,
        _context: RequestContext<RoleClient>,
    ) -> Result<ElicitResult, ErrorData> {
        let ElicitRequestParams::FormElicitationParams {
            message,
            requested_schema,
            ..
        } = request
        else {
            panic!("a form elicitation");
        };
        let schema = serde_json::to_value(&requested_schema).unwrap();
        assert_eq!(schema["properties"]["approve"]["type"], "boolean");
        self.asked.lock().unwrap().push(message);
        Ok(match self.answer {
            Answer::Approve => {
                ElicitResult::new(ElicitationAction::Accept).with_content(json!({"approve": true}))
            }
            Answer::Refuse => ElicitResult::new(ElicitationAction::Accept)
                .with_content(json!({"approve": false, "reason": "not today"})),
            Answer::Decline => ElicitResult::new(ElicitationAction::Decline),
            Answer::Cancel => ElicitResult::new(ElicitationAction::Cancel),
        })
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn approving_through_elicitation_runs_the_command_once() {
    bounded(async {
        let env = new_env();
        let _daemon = start_daemon(&env, 60);
        let asker = Asker::new(Answer::Approve);
        let client = shim_client(&env, asker.clone()).await;
        let r = client
            .call_tool(call("guarded", json!({"line": "yes-1"})))
            .await
            .unwrap();
        let s = structured(&r);
        assert_eq!(s["state"], "completed", "{}", text(&r));
        assert!(text(&r).contains("appended yes-1"), "{}", text(&r));
        assert_eq!(env.counter_lines(), vec!["yes-1"]);
        let asked = asker.asked();
        assert_eq!(asked.len(), 1, "{asked:?}");
        let id = s["id"].as_str().unwrap();
        for want in ["guarded", "h1", id, "yes-1", ">>"] {
            assert!(asked[0].contains(want), "{want} not in {}", asked[0]);
        }
        client.cancel().await.unwrap();
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refusing_or_declining_the_elicitation_denies_the_call() {
    bounded(async {
        let env = new_env();
        let _daemon = start_daemon(&env, 60);
        for (answer, line, reason) in [
            (Answer::Refuse, "no-1", "not today"),
            (Answer::Decline, "no-2", "declined"),
        ] {
            let asker = Asker::new(answer);
            let client = shim_client(&env, asker.clone()).await;
            let r = client
                .call_tool(call("guarded", json!({"line": line})))
                .await
                .unwrap();
            let s = structured(&r);
            assert_eq!(s["state"], "denied", "{}", text(&r));
            assert_eq!(r.is_error, Some(true));
            assert!(s["reason"].as_str().unwrap_or("").contains(reason), "{s}");
            assert_eq!(asker.asked().len(), 1);
            client.cancel().await.unwrap();
        }
        assert!(env.counter_lines().is_empty());
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_question_stays_pending_and_a_retry_does_not_ask_again() {
    bounded(async {
        let env = new_env();
        // A short wait, so that the call answers "pending" soon.
        let _daemon = start_daemon(&env, 2);
        let asker = Asker::new(Answer::Cancel);
        let client = shim_client(&env, asker.clone()).await;
        let r = client
            .call_tool(call("guarded", json!({"line": "later-1"})))
            .await
            .unwrap();
        let s = structured(&r);
        assert_eq!(s["state"], "awaiting_approval", "{}", text(&r));
        let id = s["id"].as_str().unwrap().to_string();
        // The retry attaches to the same pending approval and is not asked about again.
        let r = client
            .call_tool(call("guarded", json!({"line": "later-1"})))
            .await
            .unwrap();
        let s = structured(&r);
        assert_eq!(s["state"], "awaiting_approval", "{}", text(&r));
        assert_eq!(s["id"], id.as_str());
        assert_eq!(asker.asked().len(), 1, "{:?}", asker.asked());
        assert_eq!(env.pending(), vec![id.clone()]);
        // The operator still decides.
        env.operator_approve(&id);
        let r = client
            .call_tool(call("guarded", json!({"line": "later-1"})))
            .await
            .unwrap();
        let s = structured(&r);
        assert_eq!(s["state"], "completed", "{}", text(&r));
        assert_eq!(s["id"], id.as_str());
        assert_eq!(env.counter_lines(), vec!["later-1"]);
        assert_eq!(asker.asked().len(), 1);
        client.cancel().await.unwrap();
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_elicitation_the_operator_approves() {
    bounded(async {
        let env = new_env();
        let _daemon = start_daemon(&env, 60);
        // The default client declares no elicitation capability.
        let client = shim_client(&env, ClientConfig::default()).await;
        let calling = client.call_tool(call("guarded", json!({"line": "op-1"})));
        let approving = async {
            let id = loop {
                if let Some(id) = env.pending().pop() {
                    break id;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            };
            env.operator_approve(&id);
            id
        };
        let (r, id) = tokio::join!(calling, approving);
        let r = r.unwrap();
        let s = structured(&r);
        assert_eq!(s["state"], "completed", "{}", text(&r));
        assert_eq!(s["id"], id.as_str());
        assert_eq!(env.counter_lines(), vec!["op-1"]);
        client.cancel().await.unwrap();
    })
    .await
}

/// Sends a call, and drops it (rmcp then sends `notifications/cancelled`) after `after`.
async fn call_and_abandon<H: ClientHandler>(
    client: &RunningService<RoleClient, H>,
    params: CallToolRequestParams,
    after: Duration,
) {
    let r = tokio::time::timeout(after, client.call_tool(params)).await;
    assert!(r.is_err(), "the call ended before it was cancelled: {r:?}");
}

/// The one execution of a tool, from the daemon's list.
fn only_execution(env: &Env, tool: &str) -> String {
    let v = env.control(json!({"v": 1, "op": "list", "tool": tool}));
    let items = v["data"]["items"].as_array().cloned().unwrap_or_default();
    assert_eq!(items.len(), 1, "{v}");
    items[0]["id"].as_str().unwrap().to_string()
}

async fn wait_for_state(env: &Env, id: &str, want: &[&str], within: Duration) -> String {
    let deadline = Instant::now() + within;
    loop {
        let s = env.state(id);
        if want.contains(&s.as_str()) || Instant::now() > deadline {
            return s;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelling_a_read_only_call_cancels_its_execution() {
    bounded(async {
        let env = new_env();
        let _daemon = start_daemon(&env, 60);
        let client = shim_client(&env, ClientConfig::default()).await;
        let started = Instant::now();
        call_and_abandon(
            &client,
            call("slow_read", json!({})),
            Duration::from_secs(3),
        )
        .await;
        let id = only_execution(&env, "slow_read");
        // The command sleeps 30 s; cancelled, it ends long before.
        let state = wait_for_state(&env, &id, &["cancelled"], Duration::from_secs(20)).await;
        assert_eq!(state, "cancelled");
        assert!(started.elapsed() < Duration::from_secs(25));
        // The session still works.
        let r = client
            .call_tool(call("exec_status", json!({"id": id})))
            .await
            .unwrap();
        assert_eq!(structured(&r)["state"], "cancelled");
        client.cancel().await.unwrap();
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelling_a_status_check_call_abandons_it_and_the_command_runs_to_its_end() {
    bounded(async {
        let env = new_env();
        let _daemon = start_daemon(&env, 60);
        let client = shim_client(&env, ClientConfig::default()).await;
        call_and_abandon(
            &client,
            call("slow_append", json!({"line": "keep-1"})),
            Duration::from_millis(1500),
        )
        .await;
        let id = only_execution(&env, "slow_append");
        let state = wait_for_state(&env, &id, &["completed"], Duration::from_secs(20)).await;
        assert_eq!(state, "completed");
        // A later identical call attaches to it: the command ran once.
        let r = client
            .call_tool(call("slow_append", json!({"line": "keep-1"})))
            .await
            .unwrap();
        let s = structured(&r);
        assert_eq!(s["state"], "completed", "{}", text(&r));
        assert_eq!(s["id"], id.as_str());
        assert!(s["attached"].is_string(), "{s}");
        assert!(text(&r).contains("done keep-1"), "{}", text(&r));
        assert_eq!(env.counter_lines(), vec!["keep-1"]);
        client.cancel().await.unwrap();
    })
    .await
}
