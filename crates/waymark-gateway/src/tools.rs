//! Resolving a tool call into the canonical action it requests.
//!
//! Arguments are checked against the tool's typed declarations and rendered into argv words;
//! they are never spliced into shell text. A secret argument becomes a
//! [`waymark_core::WordPart::Secret`], which the canonical record replaces by its own keyed
//! MAC. `{execution_id}` becomes a [`waymark_core::WordPart::ExecutionId`], filled in only when
//! the command is sent: a retry of the same call has the same fingerprint, whatever ID it would
//! run under.
use std::collections::BTreeMap;
use std::time::Duration;

use serde_json::{Map, Value};
use waymark_core::{ActionRequest, ExecutionId, ReplayContract, ReplayPolicy, Target, Word};

use crate::config::{Config, ToolDef};
use crate::resolved::{arg_values, describe, render};
pub use crate::resolved::{CallContext, CallError, Effect, HttpEffect, ResolvedCall};

/// The name of the raw command tool, where policy allows it.
pub const RAW_TOOL: &str = "ssh_exec";
const MAX_ARGV_BYTES: usize = 96 * 1024;

/// The hosts a tool may run on: its own list, or every configured host when it names none.
pub fn allowed_hosts(tool: &ToolDef, config: &Config) -> Vec<String> {
    if tool.hosts.is_empty() {
        config.hosts.keys().cloned().collect()
    } else {
        tool.hosts.clone()
    }
}

fn tool_def<'c>(config: &'c Config, tool_name: &str) -> Result<&'c ToolDef, CallError> {
    config
        .tools
        .get(tool_name)
        .ok_or_else(|| CallError::UnknownTool {
            name: tool_name.into(),
            known: config.tools.keys().cloned().collect::<Vec<_>>().join(", "),
        })
}

/// Resolves a fan-out of `tool`: one call per host, on every host it may run on (`hosts` =
/// `None`, in the tool's order) or on the `hosts` given. Each is the call [`resolve`] makes
/// with `host=NAME`, so its canonical action and fingerprint are those of a single-host call
/// of the tool on that host, and a repeat attaches per host. All or nothing: a bad argument or
/// host refuses the whole fan-out before any host's call is accepted.
pub fn resolve_fan_out(
    config: &Config,
    tool_name: &str,
    args: &Map<String, Value>,
    hosts: Option<&[String]>,
    ctx: CallContext,
) -> Result<Vec<ResolvedCall>, CallError> {
    let tool = tool_def(config, tool_name)?;
    let refuse = |why: &str| CallError::NoFanOut {
        tool: tool.name.clone(),
        why: why.into(),
    };
    if tool.http.is_some() {
        return Err(refuse(
            "an HTTP tool has no hosts to run on: call it without a fan-out",
        ));
    }
    if args.contains_key("host") {
        return Err(refuse(
            "a fan-out runs on the tool's hosts: give no host argument",
        ));
    }
    let mut targets: Vec<String> = Vec::new();
    for h in hosts.map_or_else(|| allowed_hosts(tool, config), <[String]>::to_vec) {
        if !targets.contains(&h) {
            targets.push(h);
        }
    }
    if targets.is_empty() {
        return Err(refuse("a fan-out needs at least one host"));
    }
    targets
        .into_iter()
        .map(|h| {
            let mut args = args.clone();
            args.insert("host".into(), Value::String(h));
            resolve(config, tool_name, &args, ctx.clone())
        })
        .collect()
}

/// Resolves `tool` with `args` (a JSON object, as MCP sends; the CLI sends strings).
pub fn resolve(
    config: &Config,
    tool_name: &str,
    args: &Map<String, Value>,
    ctx: CallContext,
) -> Result<ResolvedCall, CallError> {
    let tool = tool_def(config, tool_name)?;
    for k in args.keys() {
        if k != "host" && !tool.args.iter().any(|a| &a.name == k) {
            let mut known: Vec<&str> = tool.args.iter().map(|a| a.name.as_str()).collect();
            if tool.host_arg || tool.hosts.len() > 1 {
                known.push("host");
            }
            return Err(CallError::UnknownArg {
                tool: tool.name.clone(),
                arg: k.clone(),
                known: known.join(", "),
            });
        }
    }
    if tool.http.is_some() {
        return crate::http_tool::resolve(tool, args, ctx);
    }
    let allowed = allowed_hosts(tool, config);
    let host_name = match args.get("host") {
        Some(Value::String(h)) => {
            if !allowed.contains(h)
                || (!tool.host_arg && tool.hosts.len() <= 1 && !tool.hosts.contains(h))
            {
                return Err(CallError::HostNotAllowed {
                    tool: tool.name.clone(),
                    host: h.clone(),
                    allowed: allowed.join(", "),
                });
            }
            h.clone()
        }
        Some(other) => {
            return Err(CallError::BadValue {
                tool: tool.name.clone(),
                arg: "host".into(),
                expected: "a host name".into(),
                got: describe(other, false),
            })
        }
        None if tool.hosts.len() == 1 => tool.hosts[0].clone(),
        None => {
            return Err(CallError::HostRequired {
                tool: tool.name.clone(),
                allowed: allowed.join(", "),
            })
        }
    };
    let host = config.hosts[&host_name].clone();

    let values = arg_values(tool, args)?;
    // A word or variable that mentions an absent optional argument is left out whole.
    let argv: Vec<Word> = tool
        .argv
        .iter()
        .filter_map(|t| render(t, &values))
        .collect();
    let env: BTreeMap<String, Word> = tool
        .env
        .iter()
        .filter_map(|(var, t)| Some((var.clone(), render(t, &values)?)))
        .collect();
    let request = ActionRequest {
        actor: ctx.actor,
        tool: tool.name.clone(),
        channel: waymark_core::SSH_CHANNEL.into(),
        target: Target {
            user: host.user.clone(),
            host: host.address.clone(),
            port: host.port,
        },
        credential_ref: host.credential.clone(),
        argv,
        cwd: tool.cwd.clone(),
        env,
        scope: ctx.scope,
        delivery: ctx.delivery,
    };
    check_size(&request)?;
    Ok(ResolvedCall::of_tool(tool, Effect::Ssh { host, request }))
}

/// Resolves a raw command (`waymark exec run --host H -- CMD ...`, or MCP `ssh_exec`) where
/// policy allows it. Raw commands are treated as irreversible: never repeated blindly.
pub fn resolve_raw(
    config: &Config,
    host_name: &str,
    argv: &[String],
    ctx: CallContext,
) -> Result<ResolvedCall, CallError> {
    if !config.policy.raw_commands.iter().any(|h| h == host_name) {
        return Err(CallError::RawNotAllowed {
            host: host_name.into(),
            allowed: config.policy.raw_commands.join(", "),
        });
    }
    let host = config.hosts[host_name].clone();
    if argv.is_empty() {
        return Err(CallError::MissingArg {
            tool: RAW_TOOL.into(),
            arg: "command".into(),
        });
    }
    if let Some(a) = argv.iter().find(|a| a.contains('\0')) {
        return Err(CallError::BadValue {
            tool: RAW_TOOL.into(),
            arg: "command".into(),
            expected: "text without NUL bytes".into(),
            got: describe(&Value::String(a.clone()), false),
        });
    }
    let request = ActionRequest {
        actor: ctx.actor,
        tool: RAW_TOOL.into(),
        channel: waymark_core::SSH_CHANNEL.into(),
        target: Target {
            user: host.user.clone(),
            host: host.address.clone(),
            port: host.port,
        },
        credential_ref: host.credential.clone(),
        argv: argv.iter().map(|a| Word::literal(a.clone())).collect(),
        cwd: None,
        env: BTreeMap::new(),
        scope: ctx.scope,
        delivery: ctx.delivery,
    };
    check_size(&request)?;
    Ok(ResolvedCall {
        tool: RAW_TOOL.into(),
        effect: Effect::Ssh { host, request },
        policy: ReplayPolicy::new(ReplayContract::Irreversible, Duration::from_secs(600)),
        approval: config.policy.default_approval,
        timeout: Duration::from_secs(300),
    })
}

/// Bounds the argv so the canonical record stays far below sled's blob threshold (see
/// ARCHITECTURE.md, "Durability").
fn check_size(req: &ActionRequest) -> Result<(), CallError> {
    // Every execution ID has the same length, so any one measures the argv it will be sent in.
    let probe = ExecutionId::from_bytes([0; 16]);
    let bytes: usize = req.exposed_argv(probe).iter().map(|w| w.len() + 1).sum();
    if bytes > MAX_ARGV_BYTES {
        return Err(CallError::TooLarge {
            what: "the command line".into(),
            bytes,
            limit: MAX_ARGV_BYTES,
        });
    }
    Ok(())
}
