//! Resolving a tool call into the canonical action it requests.
//!
//! Arguments are checked against the tool's typed declarations and rendered into argv words;
//! they are never spliced into shell text. A secret argument becomes a
//! [`WordPart::Secret`], which the canonical record replaces by its own keyed MAC.
//! `{execution_id}` becomes a [`WordPart::ExecutionId`], filled in only when the command is
//! sent: a retry of the same call has the same fingerprint, whatever ID it would run under.

use std::collections::BTreeMap;
use std::time::Duration;

use serde_json::{Map, Value};
use waymark_core::{
    ActionRequest, Actor, CanonicalAction, Delivery, ExecutionId, Fingerprint, FingerprintKey,
    HttpActionRequest, IntentScope, JsonTemplate, ReplayContract, ReplayPolicy, SecretValue,
    Target, Word, WordPart,
};

use crate::config::{Approval, ArgType, Config, HostEntry, HttpToolDef, TemplatePart, ToolDef};

/// The name of the raw command tool, where policy allows it.
pub const RAW_TOOL: &str = "ssh_exec";
const MAX_ARG_BYTES: usize = 64 * 1024;
const MAX_ARGV_BYTES: usize = 96 * 1024;

/// Why a call cannot be resolved. Messages never include a secret argument's value.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CallError {
    #[error("unknown tool {name:?}; configured tools: {known}")]
    UnknownTool { name: String, known: String },
    #[error("tool {tool}: unknown argument {arg:?}; it takes: {known}")]
    UnknownArg {
        tool: String,
        arg: String,
        known: String,
    },
    #[error("tool {tool}: missing required argument {arg}")]
    MissingArg { tool: String, arg: String },
    #[error("tool {tool}: argument {arg} must be {expected}, got {got}")]
    BadValue {
        tool: String,
        arg: String,
        expected: String,
        got: String,
    },
    #[error("tool {tool}: choose one of its hosts ({allowed}) with `--host NAME` (MCP: `host`), or run it on all of them with `--all-hosts` (MCP: `all_hosts: true`)")]
    HostRequired { tool: String, allowed: String },
    #[error("tool {tool}: host {host:?} is not allowed for it (allowed: {allowed})")]
    HostNotAllowed {
        tool: String,
        host: String,
        allowed: String,
    },
    #[error("tool {tool}: {why}")]
    NoFanOut { tool: String, why: String },
    #[error("raw commands are not allowed on host {host:?}; policy.raw_commands lists: {allowed}")]
    RawNotAllowed { host: String, allowed: String },
    #[error("{what} is too large ({bytes} bytes, limit {limit})")]
    TooLarge {
        what: String,
        bytes: usize,
        limit: usize,
    },
}

/// A resolved call: the action, where it goes, and how it may be replayed.
#[derive(Clone, Debug)]
pub struct ResolvedCall {
    pub tool: String,
    pub effect: Effect,
    pub policy: ReplayPolicy,
    pub approval: Approval,
    pub timeout: Duration,
}

/// What a call does, by channel.
#[derive(Clone, Debug)]
pub enum Effect {
    /// A command on an SSH host, under the host's wrapper.
    Ssh {
        host: HostEntry,
        request: ActionRequest,
    },
    /// A request to an HTTP API.
    Http(HttpEffect),
}

/// An HTTP tool's call: the request and the tool's sending rules.
#[derive(Clone, Debug)]
pub struct HttpEffect {
    pub request: HttpActionRequest,
    pub def: HttpToolDef,
}

impl HttpEffect {
    /// Secret argument values of the call (headers and body), in clear, to mask in its result.
    pub fn secret_values(&self) -> Vec<Vec<u8>> {
        fn walk(t: &JsonTemplate, out: &mut Vec<Vec<u8>>) {
            match t {
                JsonTemplate::Json(_) => {}
                JsonTemplate::Word(w) => words(w, out),
                JsonTemplate::Array(items) => items.iter().for_each(|i| walk(i, out)),
                JsonTemplate::Object(m) => m.values().for_each(|i| walk(i, out)),
            }
        }
        fn words(w: &waymark_core::Word, out: &mut Vec<Vec<u8>>) {
            for p in &w.0 {
                if let WordPart::Secret { value, .. } = p {
                    out.push(value.expose().as_bytes().to_vec());
                }
            }
        }
        let mut out = Vec::new();
        self.request
            .call
            .headers
            .values()
            .for_each(|w| words(w, &mut out));
        if let Some(b) = &self.request.call.body {
            walk(b, &mut out);
        }
        out
    }
}

impl ResolvedCall {
    /// A call of configured `tool` with `effect`: the tool's contract, windows, approval and
    /// timeout.
    pub(crate) fn of_tool(tool: &ToolDef, effect: Effect) -> ResolvedCall {
        ResolvedCall {
            tool: tool.name.clone(),
            effect,
            policy: ReplayPolicy {
                contract: tool.contract,
                retry_window: tool.retry_window,
                dedup_window: tool.dedup_window,
            },
            approval: tool.approval,
            timeout: tool.timeout,
        }
    }

    /// The canonical, secret-free record of the call's effect.
    pub fn canonicalize(&self, key: &FingerprintKey) -> CanonicalAction {
        match &self.effect {
            Effect::Ssh { request, .. } => request.canonicalize(key),
            Effect::Http(h) => h.request.canonicalize(key),
        }
    }

    /// The intent fingerprint.
    pub fn fingerprint(&self, key: &FingerprintKey) -> Fingerprint {
        self.canonicalize(key).fingerprint(key)
    }

    pub fn actor(&self) -> &Actor {
        match &self.effect {
            Effect::Ssh { request, .. } => &request.actor,
            Effect::Http(h) => &h.request.actor,
        }
    }

    pub fn scope(&self) -> &IntentScope {
        match &self.effect {
            Effect::Ssh { request, .. } => &request.scope,
            Effect::Http(h) => &h.request.scope,
        }
    }

    /// Gives the call another origin: a resume runs as the execution's own actor and scope.
    pub fn set_origin(&mut self, actor: Actor, scope: IntentScope) {
        let (a, s) = match &mut self.effect {
            Effect::Ssh { request, .. } => (&mut request.actor, &mut request.scope),
            Effect::Http(h) => (&mut h.request.actor, &mut h.request.scope),
        };
        *a = actor;
        *s = scope;
    }

    /// Where it goes, as the execution record names it: the configured host for SSH, the
    /// URL's `host:port` for HTTP.
    pub fn target(&self) -> &str {
        match &self.effect {
            Effect::Ssh { host, .. } => &host.name,
            Effect::Http(h) => &h.def.target,
        }
    }

    /// The call's secret argument values, in clear: never record them (the ledger keeps
    /// their `MaskHint`s).
    pub fn secret_values(&self) -> Vec<Vec<u8>> {
        match &self.effect {
            Effect::Ssh { request, .. } => request
                .secret_values()
                .map(|v| v.expose().as_bytes().to_vec())
                .collect(),
            Effect::Http(h) => h.secret_values(),
        }
    }

    /// The SSH request, for an SSH call.
    pub fn ssh_request(&self) -> Option<&ActionRequest> {
        match &self.effect {
            Effect::Ssh { request, .. } => Some(request),
            Effect::Http(_) => None,
        }
    }

    /// The SSH request to change, for an SSH call.
    pub fn ssh_request_mut(&mut self) -> Option<&mut ActionRequest> {
        match &mut self.effect {
            Effect::Ssh { request, .. } => Some(request),
            Effect::Http(_) => None,
        }
    }
}

/// Who is calling, in which scope, through what.
#[derive(Clone, Debug)]
pub struct CallContext {
    pub actor: Actor,
    pub scope: IntentScope,
    pub delivery: Delivery,
}

pub(crate) fn describe(v: &Value, secret: bool) -> String {
    if secret {
        return "a value (redacted: secret)".into();
    }
    let s = v.to_string();
    if s.len() > 60 {
        format!(
            "{}…",
            &s[..s.char_indices().nth(57).map_or(s.len(), |c| c.0)]
        )
    } else {
        s
    }
}

fn render_arg(
    tool: &ToolDef,
    spec: &crate::config::ArgSpec,
    v: &Value,
) -> Result<String, CallError> {
    let bad = |expected: &str| CallError::BadValue {
        tool: tool.name.clone(),
        arg: spec.name.clone(),
        expected: expected.into(),
        got: describe(v, spec.secret),
    };
    let text = match (spec.ty, v) {
        (ArgType::String, Value::String(s)) => s.clone(),
        (ArgType::String, _) => return Err(bad("a string")),
        (ArgType::Integer, Value::Number(n)) if n.is_i64() => n.to_string(),
        (ArgType::Integer, Value::String(s)) => s
            .trim()
            .parse::<i64>()
            .map_err(|_| bad("an integer"))?
            .to_string(),
        (ArgType::Integer, _) => return Err(bad("an integer")),
        (ArgType::Boolean, Value::Bool(b)) => b.to_string(),
        (ArgType::Boolean, Value::String(s)) if s == "true" || s == "false" => s.clone(),
        (ArgType::Boolean, _) => return Err(bad("true or false")),
        (ArgType::Enum, Value::String(s)) if spec.values.contains(s) => s.clone(),
        (ArgType::Enum, _) => return Err(bad(&format!("one of: {}", spec.values.join(", ")))),
    };
    if text.contains('\0') {
        return Err(bad("text without NUL bytes"));
    }
    if text.len() > MAX_ARG_BYTES {
        return Err(CallError::TooLarge {
            what: format!("argument {}", spec.name),
            bytes: text.len(),
            limit: MAX_ARG_BYTES,
        });
    }
    if let Some(p) = &spec.pattern {
        if !p.is_match(&text) {
            let pat = p.as_str().trim_start_matches("^(?:").trim_end_matches(")$");
            return Err(bad(&format!("a value matching /{pat}/")));
        }
    }
    Ok(text)
}

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

/// The call's argument values, checked and rendered as text, with whether each is secret.
pub(crate) fn arg_values<'t>(
    tool: &'t ToolDef,
    args: &Map<String, Value>,
) -> Result<BTreeMap<&'t str, (String, bool)>, CallError> {
    let mut values = BTreeMap::new();
    for spec in &tool.args {
        match args.get(&spec.name) {
            Some(v) => {
                values.insert(
                    spec.name.as_str(),
                    (render_arg(tool, spec, v)?, spec.secret),
                );
            }
            None if spec.required => {
                return Err(CallError::MissingArg {
                    tool: tool.name.clone(),
                    arg: spec.name.clone(),
                })
            }
            None => {}
        }
    }
    Ok(values)
}

/// A template word with the call's argument values: a secret one becomes a
/// [`WordPart::Secret`]; `None` when it mentions an absent optional argument.
pub(crate) fn render(
    template: &[TemplatePart],
    values: &BTreeMap<&str, (String, bool)>,
) -> Option<Word> {
    let mut word = Vec::new();
    for part in template {
        word.push(match part {
            TemplatePart::Text(t) => WordPart::Literal(t.clone()),
            TemplatePart::ExecutionId => WordPart::ExecutionId,
            TemplatePart::Arg(a) => match values.get(a.as_str())? {
                (v, false) => WordPart::Literal(v.clone()),
                (v, true) => WordPart::Secret {
                    name: a.clone(),
                    value: SecretValue::new(v.clone()),
                },
            },
        });
    }
    Some(Word(word))
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
