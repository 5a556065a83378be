//! Protocol 2026-07-28 specifics, end to end over stdio (real sshd, real daemon, `waymark mcp`
//! with rmcp's own client in `server/discover` mode): the server may not send
//! `elicitation/create` any more, so an approval is asked with an `input_required` result
//! (SEP-2322) that rmcp's client answers and retries; and cancelling a `tools/call` still
//! follows the tool's replay contract.

mod common;

use std::time::{Duration, Instant};

use common::*;
use rmcp::service::RunningService;
use rmcp::RoleClient;
use serde_json::json;

async fn modern_client(env: &Env, approve: bool) -> (RunningService<RoleClient, Modern>, Modern) {
    let handler = Modern::new(approve);
    let client = discover_2026_07_28(handler.clone(), shim_transport(env)).await;
    (client, handler)
}

fn env() -> Env {
    Env::builder()
        .tools(GUARDED_ECHO_TOOL)
        .tools(SLOW_READ_TOOL)
        .build()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_approval_is_asked_with_input_required_and_the_retry_runs_the_command_once() {
    bounded(async {
        let env = env();
        let _daemon = env.start_daemon();
        let (client, handler) = modern_client(&env, true).await;
        // rmcp's client answers the input_required round through its handler and retries.
        let r = client
            .call_tool(call("guarded", json!({"line": "modern-yes"})))
            .await
            .unwrap();
        let s = structured(&r);
        assert_eq!(s["state"], "completed", "{}", text(&r));
        assert!(s["stdout"].as_str().unwrap().contains("modern-yes"), "{s}");
        let asked = handler.asked.lock().unwrap().clone();
        assert_eq!(asked.len(), 1, "asked once: {asked:?}");
        let id = s["id"].as_str().unwrap();
        assert!(
            asked[0].contains(id) && asked[0].contains("guarded"),
            "{asked:?}"
        );
        // One execution, approved by the client's answer.
        let list = env.control(json!({"v": 1, "op": "list", "tool": "guarded"}));
        assert_eq!(list["data"]["items"].as_array().unwrap().len(), 1, "{list}");
        client.cancel().await.unwrap();

        // A refusal denies it.
        let (client, handler) = modern_client(&env, false).await;
        let r = client
            .call_tool(call("guarded", json!({"line": "modern-no"})))
            .await
            .unwrap();
        assert_eq!(structured(&r)["state"], "denied", "{}", text(&r));
        assert_eq!(r.is_error, Some(true));
        assert_eq!(handler.asked.lock().unwrap().len(), 1);
        client.cancel().await.unwrap();
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelling_a_read_only_call_under_2026_07_28_cancels_its_execution() {
    bounded(async {
        let env = env();
        let _daemon = env.start_daemon();
        let (client, _) = modern_client(&env, true).await;
        let started = Instant::now();
        // Dropping the call makes rmcp's client send notifications/cancelled.
        let r = tokio::time::timeout(
            Duration::from_secs(3),
            client.call_tool(call("slow_read", json!({}))),
        )
        .await;
        assert!(r.is_err(), "the call ended before it was cancelled: {r:?}");
        let list = env.control(json!({"v": 1, "op": "list", "tool": "slow_read"}));
        let id = list["data"]["items"][0]["id"].as_str().unwrap().to_string();
        wait_for(
            || env.state(&id) == "cancelled",
            "the execution to be cancelled",
            Duration::from_secs(15),
        );
        assert!(started.elapsed() < Duration::from_secs(20));
        client.cancel().await.unwrap();
    })
    .await
}
