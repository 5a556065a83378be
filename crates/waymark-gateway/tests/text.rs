//! What the gateway tells a person, per audience: an MCP caller reads the same summary as a
//! CLI user, with each `waymark exec status|result|cancel ID` it can take itself named as the
//! MCP tool to call, exactly as the MCP server's `for_agent` rewrites the CLI text.

mod common;

use std::path::Path;

use common::{ctx, defaults, BASE};

use serde_json::Map;
use waymark_core::{AttachAction, ExecState, Outcome};
use waymark_gateway::config::Config;
use waymark_gateway::flow::{describe, now, Audience};
use waymark_gateway::tools::resolve;
use waymark_ledger::{Durability, ExecutionRecord, Ledger, NewExecution};
use waymark_mcp::tools::for_agent;

/// One accepted execution, read back from a real ledger.
fn record(dir: &Path) -> ExecutionRecord {
    let config = Config::parse(Path::new("waymark.toml"), BASE, &defaults()).unwrap();
    let args: Map<String, serde_json::Value> =
        [("msg".to_string(), "hi".into())].into_iter().collect();
    let call = resolve(&config, "t", &args, ctx()).unwrap();
    let ledger = Ledger::init(&dir.join("ledger")).unwrap();
    let key = ledger.fingerprint_key();
    let action = call.ssh_request().unwrap().canonicalize(&key);
    let new = NewExecution {
        id: ledger.mint_id(now()),
        fingerprint: action.fingerprint(&key),
        action,
        actor: call.ssh_request().unwrap().actor.clone(),
        scope: call.ssh_request().unwrap().scope.clone(),
        tool: call.tool.clone(),
        host: call.target().to_string(),
        contract: call.policy.contract,
        run: None,
        mask: Vec::new(),
    };
    ledger.accept(new, now(), Durability::Flushed).unwrap()
}

#[test]
fn an_mcp_caller_reads_the_cli_text_with_its_own_steps_as_tools() {
    let dir = tempfile::tempdir().unwrap();
    let base = record(dir.path());
    let reasons = [
        None,
        Some("connection reset".to_string()),
        Some("it ended on the host, but its output could not be fetched (reset)".to_string()),
    ];
    let outcomes = [
        None,
        Some(Outcome::Exited {
            exit_code: Some(3),
            signal: None,
        }),
    ];
    let mut rewritten = 0;
    for state in ExecState::ALL {
        for reason in &reasons {
            for outcome in &outcomes {
                for attached in [None, Some(AttachAction::AskHostMarker)] {
                    let mut rec = base.clone();
                    rec.lifecycle.state = state;
                    rec.reason = reason.clone();
                    rec.outcome = outcome.clone();
                    let cli = describe(&rec, attached, Audience::Cli);
                    let mcp = describe(&rec, attached, Audience::Mcp);
                    assert_eq!(mcp, for_agent(&cli), "{state} with reason {reason:?}");
                    if mcp != cli {
                        rewritten += 1;
                        assert!(!mcp.contains("`waymark exec status"), "{mcp}");
                    }
                }
            }
        }
    }
    assert!(rewritten > 0, "some states name a step the caller takes");
}
