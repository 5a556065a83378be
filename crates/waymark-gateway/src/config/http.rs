//! The HTTP channel's part of `waymark.toml`: `[credentials.X] kind = "bearer" | "header"` and
//! `[tools.NAME] channel = "http"`.

use std::collections::BTreeMap;
use std::path::Path;

use toml::Spanned;
use waymark_core::{HttpCall, HttpMethod, HttpUrl, ReplayContract};

use super::fields::{arg_specs, durations, expand_home, Locator};
use super::raw::{RawCredential, RawPolicy, RawStatusRequest, RawTool};
use super::template::parse_template;
use super::{
    ArgSpec, BodyTemplate, ConfigError, CredentialConfig, HttpToolDef, SecretSource, StatusOutcome,
    StatusRequestDef, TemplatePart, ToolDef,
};

/// The header the execution ID travels in unless a tool says otherwise.
const DEFAULT_IDEMPOTENCY_HEADER: &str = "Idempotency-Key";

/// An HTTP credential (`kind` is set).
pub(super) fn credential(
    loc: &Locator<'_>,
    name: &str,
    kind: &Spanned<String>,
    c: &RawCredential,
    home: &Path,
) -> Result<CredentialConfig, ConfigError> {
    let at = Some(kind.span());
    if c.key_file.is_some() || c.agent || c.passphrase_env.is_some() {
        return Err(loc.at(at, format!("credential {name}: an HTTP credential takes token_env or token_file, not key_file, agent or passphrase_env")));
    }
    let source = match (&c.token_env, &c.token_file) {
        (Some(var), None) => SecretSource::Env(var.clone()),
        (None, Some(path)) => SecretSource::File(expand_home(path, home)),
        _ => return Err(loc.at(at, format!("credential {name}: set exactly one of token_env = \"VAR\" or token_file = \"~/.config/waymark/{name}.token\" (mode 0600); the value itself never goes in this file"))),
    };
    match (kind.get_ref().as_str(), &c.header) {
        ("bearer", None) => Ok(CredentialConfig::Http {
            header: "authorization".into(),
            bearer: true,
            source,
        }),
        ("bearer", Some(h)) => Err(loc.at(Some(h.span()), format!("credential {name}: a bearer token is sent as `Authorization: Bearer …`; header applies to kind = \"header\""))),
        ("header", Some(h)) => Ok(CredentialConfig::Http {
            header: HttpCall::header_name(h.get_ref())
                .map_err(|e| loc.at(Some(h.span()), format!("credential {name}: {e}")))?,
            bearer: false,
            source,
        }),
        ("header", None) => Err(loc.at(at, format!("credential {name}: kind = \"header\" needs header = \"X-Api-Key\" (the header it is sent in)"))),
        (other, _) => Err(loc.at(at, format!("credential {name}: kind {other:?} is not one Waymark has; use \"bearer\" or \"header\" (or key_file / agent for SSH)"))),
    }
}

/// An SSH tool must not carry the HTTP channel's keys.
pub(super) fn refuse_http_keys(
    loc: &Locator<'_>,
    name: &str,
    t: &RawTool,
) -> Result<(), ConfigError> {
    let stray = [
        t.method.as_ref().map(|s| ("method", s.span())),
        t.url.as_ref().map(|s| ("url", s.span())),
        t.body.as_ref().map(|s| ("body", s.span())),
        t.credential.as_ref().map(|s| ("credential", s.span())),
        t.idempotency_header
            .as_ref()
            .map(|s| ("idempotency_header", s.span())),
        t.status.as_ref().map(|s| ("status", s.span())),
        t.headers.values().next().map(|s| ("headers", s.span())),
    ];
    match stray.into_iter().flatten().next() {
        Some((key, span)) => Err(loc.at(Some(span), format!("tool {name}: {key} belongs to an HTTP tool; add channel = \"http\" (an SSH tool takes argv and hosts)"))),
        None => Ok(()),
    }
}

/// A `channel = "http"` tool.
pub(super) fn tool(
    loc: &Locator<'_>,
    name: &str,
    t: &RawTool,
    credentials: &BTreeMap<String, CredentialConfig>,
    policy: &RawPolicy,
) -> Result<ToolDef, ConfigError> {
    let tool_at = t.channel.as_ref().map(|c| c.span());
    let ssh_key = [
        t.argv.as_ref().map(|_| "argv"),
        (!t.hosts.is_empty()).then_some("hosts"),
        t.host_arg.then_some("host_arg"),
        t.cwd.as_ref().map(|_| "cwd"),
        (!t.env.is_empty()).then_some("env"),
    ];
    if let Some(key) = ssh_key.into_iter().flatten().next() {
        return Err(loc.at(tool_at, format!("tool {name}: {key} belongs to an SSH tool; an HTTP tool takes method, url, headers and body")));
    }
    let args = arg_specs(loc, name, t)?;
    let method = match &t.method {
        Some(m) => HttpMethod::parse(m.get_ref())
            .map_err(|e| loc.at(Some(m.span()), format!("tool {name}: {e}")))?,
        None => return Err(loc.at(tool_at, format!("tool {name}: an HTTP tool needs method = \"POST\" (GET, HEAD, POST, PUT, PATCH or DELETE)"))),
    };
    let Some(url) = &t.url else {
        return Err(loc.at(
            tool_at,
            format!("tool {name}: an HTTP tool needs url = \"https://api.example.com/...\""),
        ));
    };
    let url_at = Some(url.span());
    let url_parts = parse_template(url.get_ref())
        .map_err(|m| loc.at(url_at.clone(), format!("tool {name}: url {m}")))?;
    for p in &url_parts {
        match p {
            TemplatePart::ExecutionId => return Err(loc.at(url_at, format!("tool {name}: url: {{execution_id}} cannot be part of the target (it would make every retry a new intent); it travels in the idempotency header"))),
            TemplatePart::Arg(a) => match args.iter().find(|s| &s.name == a) {
                None => return Err(loc.at(url_at, format!("tool {name}: url uses {{{a}}} but no [tools.{name}.args.{a}] is declared"))),
                Some(s) if s.secret => return Err(loc.at(url_at, format!("tool {name}: url uses secret argument {a}; a URL is recorded and logged by servers, so put it in a header or the body"))),
                Some(_) => {}
            },
            TemplatePart::Text(_) => {}
        }
    }
    let target = target_of(&url_parts).map_err(|m| loc.at(url_at, format!("tool {name}: {m}")))?;

    let idempotency_header = match &t.idempotency_header {
        None => Some(DEFAULT_IDEMPOTENCY_HEADER.to_string()),
        Some(v) => match v.get_ref() {
            toml::Value::Boolean(false) => None,
            toml::Value::Boolean(true) => Some(DEFAULT_IDEMPOTENCY_HEADER.to_string()),
            toml::Value::String(h) => {
                HttpCall::header_name(h).map_err(|e| loc.at(Some(v.span()), format!("tool {name}: idempotency_header: {e}")))?;
                Some(h.clone())
            }
            _ => return Err(loc.at(Some(v.span()), format!("tool {name}: idempotency_header is a header name, or false for an API that takes none"))),
        },
    };
    let mut headers = BTreeMap::new();
    for (h, value) in &t.headers {
        let at = Some(value.span());
        let lower = HttpCall::header_name(h)
            .map_err(|e| loc.at(at.clone(), format!("tool {name}: headers: {e}")))?;
        if idempotency_header
            .as_deref()
            .is_some_and(|i| i.eq_ignore_ascii_case(&lower))
        {
            return Err(loc.at(at, format!("tool {name}: header {h} carries the execution ID and is set by Waymark; leave it out")));
        }
        let parts = parse_template(value.get_ref())
            .map_err(|m| loc.at(at.clone(), format!("tool {name}: header {h}: {m}")))?;
        check_args(&parts, &args)
            .map_err(|a| loc.at(at, format!("tool {name}: header {h} uses {{{a}}} but no [tools.{name}.args.{a}] is declared")))?;
        headers.insert(lower, parts);
    }
    let body = match &t.body {
        Some(b) => Some(
            body_template(b.get_ref(), &args)
                .map_err(|m| loc.at(Some(b.span()), format!("tool {name}: body: {m}")))?,
        ),
        None => None,
    };
    let credential = match &t.credential {
        Some(c) => match credentials.get(c.get_ref()) {
            Some(CredentialConfig::Http { .. }) => Some(c.get_ref().clone()),
            Some(_) => return Err(loc.at(Some(c.span()), format!("tool {name}: credential {:?} is an SSH credential; an HTTP tool needs kind = \"bearer\" or \"header\"", c.get_ref()))),
            None => return Err(loc.at(Some(c.span()), format!("tool {name}: credential {:?} is not defined; add a [credentials.{}] table with kind = \"bearer\" and token_env or token_file", c.get_ref(), c.get_ref()))),
        },
        None => None,
    };
    let status = match &t.status {
        Some(s) => {
            let at = Some(s.span());
            let raw = s.get_ref();
            let method = match &raw.method {
                Some(m) => HttpMethod::parse(m.get_ref())
                    .map_err(|e| loc.at(Some(m.span()), format!("tool {name}: status: {e}")))?,
                None => HttpMethod::Get,
            };
            let url = parse_template(raw.url.get_ref()).map_err(|m| {
                loc.at(Some(raw.url.span()), format!("tool {name}: status url {m}"))
            })?;
            if url.iter().any(|p| matches!(p, TemplatePart::Arg(_)))
                || !url.contains(&TemplatePart::ExecutionId)
            {
                return Err(loc.at(at, format!("tool {name}: status url names the execution by {{execution_id}} and takes no argument, e.g. \"https://api.example.com/operations/{{execution_id}}\"")));
            }
            target_of(&url).map_err(|m| loc.at(at.clone(), format!("tool {name}: status {m}")))?;
            let outcome =
                status_outcome(raw).map_err(|m| loc.at(at, format!("tool {name}: status: {m}")))?;
            Some(StatusRequestDef {
                method,
                url,
                outcome,
            })
        }
        None => None,
    };
    if t.contract == ReplayContract::StatusCheck && status.is_none() {
        return Err(loc.at(tool_at, format!("tool {name}: contract status_check needs status = {{ url = \"https://…/operations/{{execution_id}}\" }}, the request that says how an execution ended")));
    }
    let (retry_window, timeout, dedup_window) = durations(loc, name, t)?;
    Ok(ToolDef {
        name: name.to_string(),
        description: t.description.clone(),
        hosts: Vec::new(),
        host_arg: false,
        argv: Vec::new(),
        args,
        contract: t.contract,
        retry_window,
        dedup_window,
        approval: t.approval.unwrap_or(policy.default_approval),
        timeout,
        cwd: None,
        env: BTreeMap::new(),
        http: Some(HttpToolDef {
            method,
            url: url_parts,
            headers,
            body,
            credential,
            idempotency_header,
            status,
            target,
        }),
    })
}

/// How the status answer tells success: at most one of `code_pointer`, `code_header` and
/// `outcome_pointer`; the value lists go with `outcome_pointer` only.
fn status_outcome(raw: &RawStatusRequest) -> Result<Option<StatusOutcome>, String> {
    let pointer = |p: &Spanned<String>, key: &str| -> Result<String, String> {
        let p = p.get_ref();
        if p.is_empty() || p.starts_with('/') {
            Ok(p.clone())
        } else {
            Err(format!("{key} {p:?} is not a JSON pointer; it starts with / (e.g. \"/status\" for the field status)"))
        }
    };
    let lists = !(raw.succeeded.is_empty() && raw.failed.is_empty() && raw.pending.is_empty());
    let ways = [
        raw.code_pointer.is_some(),
        raw.code_header.is_some(),
        raw.outcome_pointer.is_some(),
    ];
    if ways.iter().filter(|w| **w).count() > 1 {
        return Err(
            "give one of code_pointer, code_header and outcome_pointer, not several".into(),
        );
    }
    if lists && raw.outcome_pointer.is_none() {
        return Err(
            "succeeded, failed and pending go with outcome_pointer (the field they are values of)"
                .into(),
        );
    }
    Ok(if let Some(p) = &raw.code_pointer {
        Some(StatusOutcome::CodeAt(pointer(p, "code_pointer")?))
    } else if let Some(h) = &raw.code_header {
        Some(StatusOutcome::CodeHeader(h.get_ref().to_ascii_lowercase()))
    } else if let Some(p) = &raw.outcome_pointer {
        if raw.succeeded.is_empty() || raw.failed.is_empty() {
            return Err("outcome_pointer needs the values that mean success and failure, e.g. succeeded = [\"paid\"], failed = [\"declined\"] (and pending = [...] for still in flight)".into());
        }
        Some(StatusOutcome::ValueAt {
            pointer: pointer(p, "outcome_pointer")?,
            succeeded: raw.succeeded.clone(),
            failed: raw.failed.clone(),
            pending: raw.pending.clone(),
        })
    } else {
        None
    })
}

/// `host:port` of a URL template whose scheme and authority are literal text.
fn target_of(url: &[TemplatePart]) -> Result<String, String> {
    let Some(TemplatePart::Text(head)) = url.first() else {
        return Err("url must start with a literal http:// or https:// address".into());
    };
    let authority_end = head
        .find("://")
        .and_then(|i| head[i + 3..].find('/').map(|j| i + 3 + j));
    let literal =
        match authority_end {
            Some(end) => &head[..end],
            None if url.len() == 1 => head.as_str(),
            None => return Err(
                "url: the scheme, host and port must be literal, arguments go in the path or query"
                    .into(),
            ),
        };
    let parsed = HttpUrl::parse(literal).map_err(|e| format!("url: {e}"))?;
    let t = parsed.target();
    let authority = t.split("://").nth(1).unwrap_or(&t);
    Ok(authority.split('/').next().unwrap_or(authority).to_string())
}

fn check_args(parts: &[TemplatePart], args: &[ArgSpec]) -> Result<(), String> {
    for p in parts {
        if let TemplatePart::Arg(a) = p {
            if !args.iter().any(|s| &s.name == a) {
                return Err(a.clone());
            }
        }
    }
    Ok(())
}

fn body_template(v: &toml::Value, args: &[ArgSpec]) -> Result<BodyTemplate, String> {
    Ok(match v {
        toml::Value::String(s) => {
            let parts = parse_template(s)?;
            check_args(&parts, args)
                .map_err(|a| format!("uses {{{a}}} but no such argument is declared"))?;
            match parts.as_slice() {
                [TemplatePart::Text(t)] => BodyTemplate::Json(serde_json::Value::String(t.clone())),
                _ => BodyTemplate::Text(parts),
            }
        }
        toml::Value::Integer(i) => BodyTemplate::Json((*i).into()),
        toml::Value::Float(f) => BodyTemplate::Json(
            serde_json::Number::from_f64(*f)
                .map(serde_json::Value::Number)
                .ok_or("a number JSON cannot hold")?,
        ),
        toml::Value::Boolean(b) => BodyTemplate::Json((*b).into()),
        toml::Value::Datetime(d) => BodyTemplate::Json(d.to_string().into()),
        toml::Value::Array(items) => BodyTemplate::Array(
            items
                .iter()
                .map(|i| body_template(i, args))
                .collect::<Result<_, _>>()?,
        ),
        toml::Value::Table(map) => BodyTemplate::Object(
            map.iter()
                .map(|(k, v)| Ok((k.clone(), body_template(v, args)?)))
                .collect::<Result<_, String>>()?,
        ),
    })
}
