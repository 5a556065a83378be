#![allow(dead_code)]
//! Shared helpers for ledger tests.

use std::collections::BTreeMap;
use std::time::{SystemTime, UNIX_EPOCH};

use waymark_core::{
    ActionRequest, Actor, Delivery, IntentScope, ReplayContract, SecretValue, Target, Timestamp,
    Word, WordPart,
};
use waymark_ledger::{Ledger, NewExecution};

pub fn now() -> Timestamp {
    Timestamp::from_millis(
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap()
            .as_millis() as u64,
    )
}

pub fn request(tool: &str, arg: &str, secret: &str) -> ActionRequest {
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
        argv: vec![
            Word::literal("/usr/local/bin/deploy"),
            Word::literal(arg),
            Word(vec![
                WordPart::Literal("--password=".into()),
                WordPart::Secret {
                    name: "password".into(),
                    value: SecretValue::new(secret),
                },
            ]),
        ],
        cwd: None,
        env: BTreeMap::new(),
        scope: IntentScope::ToolWindow,
        delivery: Delivery::default(),
    }
}

pub fn new_execution(
    ledger: &Ledger,
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
    }
}
