//! What a resolved call is ([`ResolvedCall`], its [`Effect`] on one channel, the caller's
//! [`CallContext`], [`CallError`]), and the argument checks and rendering every kind of tool
//! shares: the leaf that `tools` (SSH tools and raw commands) and `http_tool` both build on.

use std::collections::BTreeMap;
use std::time::Duration;

use serde_json::{Map, Value};
use waymark_core::{
    ActionRequest, Actor, CanonicalAction, Delivery, Fingerprint, FingerprintKey,
    HttpActionRequest, IntentScope, JsonTemplate, ReplayPolicy, SecretValue, Word, WordPart,
};

use crate::config::{Approval, ArgType, HostEntry, HttpToolDef, TemplatePart, ToolDef};

const MAX_ARG_BYTES: usize = 64 * 1024;

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
