//! Setup shared by the gateway's suites that need a configuration but no host.
#![allow(dead_code)]

use waymark_core::{Actor, Delivery, IntentScope};
use waymark_gateway::config::DefaultPaths;
use waymark_gateway::tools::CallContext;

/// Credential `k`, host `web1`, and tool `t` (`echo {msg}`, idempotent, `msg` a string).
pub const BASE: &str = r#"
[credentials.k]
key_file = "~/.ssh/id"

[hosts.web1]
address = "127.0.0.1"
user = "ops"
credential = "k"

[tools.t]
description = "d"
hosts = ["web1"]
argv = ["echo", "{msg}"]
contract = "idempotent"

[tools.t.args.msg]
type = "string"
"#;

/// Paths as for user 1000 with `HOME=/home/op`.
pub fn defaults() -> DefaultPaths {
    DefaultPaths::from_env(|k| (k == "HOME").then(|| "/home/op".to_string()), 1000)
}

/// A call by an agent of uid 1000, in the tool's window.
pub fn ctx() -> CallContext {
    CallContext {
        actor: Actor("uid:1000:/usr/bin/agent".into()),
        scope: IntentScope::ToolWindow,
        delivery: Delivery::default(),
    }
}
