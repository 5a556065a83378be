#![allow(dead_code)]
//! Shared helpers for ledger tests (and `examples/ledger_bench.rs`); the shared ledger's
//! suite runs on both backends with them too. What opens sled itself is in `raw.rs`.

use std::collections::BTreeMap;
use std::time::{SystemTime, UNIX_EPOCH};

use waymark_core::{
    ActionRequest, Actor, Delivery, ExecutionId, IntentScope, Outcome, ReplayContract, SecretValue,
    Target, Timestamp, Transition, Word, WordPart,
};
use waymark_ledger::{
    CapturedOutput, Durability, ExecutionRecord, Ledger, LedgerApi, NewExecution, StoredResult,
};

pub fn now() -> Timestamp {
    Timestamp::from_millis(
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap()
            .as_millis() as u64,
    )
}

/// `deploy ARG --password=SECRET` (a secret argument) as `tool`.
pub fn request(tool: &str, arg: &str, secret: &str) -> ActionRequest {
    let argv = vec![
        Word::literal("/usr/local/bin/deploy"),
        Word::literal(arg),
        Word(vec![
            WordPart::Literal("--password=".into()),
            WordPart::Secret {
                name: "password".into(),
                value: SecretValue::new(secret),
            },
        ]),
    ];
    request_argv(tool, argv)
}

/// `argv` as `tool`, run by ops@web1 for the usual agent.
pub fn request_argv(tool: &str, argv: Vec<Word>) -> ActionRequest {
    ActionRequest {
        actor: Actor("uid:1000:/usr/bin/agent".into()),
        tool: tool.into(),
        channel: "ssh-exec".into(),
        target: Target {
            user: "ops".into(),
            host: "web1".into(),
            port: 22,
        },
        credential_ref: "ops-key".into(),
        argv,
        cwd: None,
        env: BTreeMap::new(),
        scope: IntentScope::ToolWindow,
        delivery: Delivery::default(),
    }
}

pub fn new_execution(
    ledger: &dyn LedgerApi,
    req: &ActionRequest,
    host: &str,
    at: Timestamp,
) -> NewExecution {
    let key = ledger.fingerprint_key();
    let action = req.canonicalize(&key);
    NewExecution {
        id: ledger.mint_id(at),
        fingerprint: action.fingerprint(&key),
        action,
        actor: req.actor.clone(),
        scope: req.scope.clone(),
        tool: req.tool.clone(),
        host: host.into(),
        contract: ReplayContract::StatusCheck,
        run: None,
        mask: Vec::new(),
    }
}

/// A new, empty ledger in a temporary directory (removed when the guard drops).
pub fn fresh() -> (tempfile::TempDir, Ledger) {
    let dir = tempfile::tempdir().unwrap();
    let ledger = Ledger::init(&dir.path().join("l")).unwrap();
    (dir, ledger)
}

/// Accepts a `deploy ARG` execution on web1 at `at`.
pub fn accept(
    ledger: &Ledger,
    arg: &str,
    at: Timestamp,
    durability: Durability,
) -> ExecutionRecord {
    let new = new_execution(ledger, &request("deploy", arg, "pw"), "web1", at);
    ledger.accept(new, at, durability).unwrap()
}

pub fn exited(code: i32) -> Transition {
    Transition::Finished {
        outcome: Outcome::Exited {
            exit_code: Some(code),
            signal: None,
        },
    }
}

/// Authorized, dispatched, running, completed with output `deployed\n`; result not delivered.
pub fn walk_to_completion(ledger: &Ledger, id: ExecutionId, at: Timestamp) {
    let d = Durability::Buffered;
    for t in [
        Transition::Authorize {
            by: "policy".into(),
        },
        Transition::Dispatch { attempt: 1 },
        Transition::Started { pid: Some(7) },
    ] {
        ledger.transition(id, t, at, d).unwrap();
    }
    let result = StoredResult {
        stdout: CapturedOutput::capture(b"deployed\n", 1024),
        stderr: CapturedOutput::capture(b"", 1024),
    };
    ledger
        .transition_with_result(id, exited(0), result, at, d)
        .unwrap();
}

/// Bytes of the files under `dir` (a ledger's size on disk).
pub fn dir_size(dir: &std::path::Path) -> u64 {
    std::fs::read_dir(dir)
        .unwrap()
        .flatten()
        .map(|e| {
            let m = e.metadata().unwrap();
            if m.is_dir() {
                dir_size(&e.path())
            } else {
                m.len()
            }
        })
        .sum()
}
