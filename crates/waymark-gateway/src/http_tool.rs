//! Resolving a call of an HTTP tool (`channel = "http"`) into its canonical request.
//!
//! An argument in the URL is percent-encoded (it can add a path segment's text, never a `/`,
//! `?` or `#`); in a header or the body it is text, and a string of the body that is exactly
//! one integer or boolean argument becomes that JSON number or boolean. A secret argument
//! becomes a [`WordPart::Secret`] (header or body only), replaced by its keyed MAC in the
//! record. `{execution_id}` is filled in only when the request is sent.

use std::collections::{BTreeMap, HashMap};

use serde_json::{Map, Value};
use waymark_core::{HttpActionRequest, HttpCall, HttpUrl, JsonTemplate, Word, WordPart};

use crate::config::{ArgType, BodyTemplate, TemplatePart, ToolDef};
use crate::resolved::{
    arg_values, describe, render, CallContext, CallError, Effect, HttpEffect, ResolvedCall,
};

/// Bytes of a rendered body; keeps the record far below sled's blob threshold.
const MAX_BODY_BYTES: usize = 64 * 1024;

/// Resolves a call of `tool`, which has an `http` definition.
pub(crate) fn resolve(
    tool: &ToolDef,
    args: &Map<String, Value>,
    ctx: CallContext,
) -> Result<ResolvedCall, CallError> {
    let def = tool.http.as_ref().expect("an HTTP tool");
    if let Some(h) = args.get("host") {
        return Err(CallError::BadValue {
            tool: tool.name.clone(),
            arg: "host".into(),
            expected: "nothing: an HTTP tool's target is its url".into(),
            got: describe(h, false),
        });
    }
    let values = arg_values(tool, args)?;
    let mut url = String::new();
    for part in &def.url {
        match part {
            TemplatePart::Text(t) => url.push_str(t),
            TemplatePart::Arg(a) => match values.get(a.as_str()) {
                Some((v, _)) => url.push_str(&percent_encode(v)),
                None => {
                    return Err(CallError::MissingArg {
                        tool: tool.name.clone(),
                        arg: a.clone(),
                    })
                }
            },
            TemplatePart::ExecutionId => unreachable!("refused by the configuration"),
        }
    }
    let url = HttpUrl::parse(&url).map_err(|e| CallError::BadValue {
        tool: tool.name.clone(),
        arg: "url".into(),
        expected: "arguments that make a valid URL".into(),
        got: e.to_string(),
    })?;
    let headers: BTreeMap<String, Word> = def
        .headers
        .iter()
        .filter_map(|(k, t)| Some((k.clone(), render(t, &values)?)))
        .collect();
    let types: HashMap<&str, ArgType> = tool.args.iter().map(|a| (a.name.as_str(), a.ty)).collect();
    let body = match &def.body {
        Some(b) => body(b, &values, &types),
        None => None,
    };
    let request = HttpActionRequest {
        actor: ctx.actor,
        tool: tool.name.clone(),
        credential_ref: def.credential.clone(),
        call: HttpCall {
            method: def.method,
            url,
            headers,
            body,
        },
        scope: ctx.scope,
        delivery: ctx.delivery,
    };
    let probe = waymark_core::ExecutionId::from_bytes([0; 16]);
    let bytes = request.exposed_body(probe).map_or(0, |b| b.len());
    if bytes > MAX_BODY_BYTES {
        return Err(CallError::TooLarge {
            what: "the request body".into(),
            bytes,
            limit: MAX_BODY_BYTES,
        });
    }
    Ok(ResolvedCall::of_tool(
        tool,
        Effect::Http(HttpEffect {
            request,
            def: def.clone(),
        }),
    ))
}

/// The body with the call's values; `None` for a part that mentions an absent optional
/// argument (an object leaves that key out, an array that element).
fn body(
    t: &BodyTemplate,
    values: &BTreeMap<&str, (String, bool)>,
    types: &HashMap<&str, ArgType>,
) -> Option<JsonTemplate> {
    Some(match t {
        BodyTemplate::Json(v) => JsonTemplate::Json(v.clone()),
        BodyTemplate::Text(parts) => {
            if let [TemplatePart::Arg(a)] = parts.as_slice() {
                let (v, secret) = values.get(a.as_str())?;
                let typed = match types.get(a.as_str()) {
                    Some(ArgType::Integer) => v.parse::<i64>().ok().map(Value::from),
                    Some(ArgType::Boolean) => v.parse::<bool>().ok().map(Value::from),
                    _ => None,
                };
                if let (Some(typed), false) = (typed, secret) {
                    return Some(JsonTemplate::Json(typed));
                }
            }
            let word = render(parts, values)?;
            let plain = word.0.iter().all(|p| matches!(p, WordPart::Literal(_)));
            if plain {
                JsonTemplate::Json(Value::String(
                    word.expose(waymark_core::ExecutionId::from_bytes([0; 16])),
                ))
            } else {
                JsonTemplate::Word(word)
            }
        }
        BodyTemplate::Array(items) => JsonTemplate::Array(
            items
                .iter()
                .filter_map(|i| body(i, values, types))
                .collect(),
        ),
        BodyTemplate::Object(map) => JsonTemplate::Object(
            map.iter()
                .filter_map(|(k, v)| Some((k.clone(), body(v, values, types)?)))
                .collect(),
        ),
    })
}

/// Percent-encodes everything but RFC 3986's unreserved characters.
fn percent_encode(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}
