//! The canonical action of an HTTP tool (issue 15's channel `http`).
//!
//! An [`HttpActionRequest`] is what a caller asked of an HTTP API: method, target URL, headers
//! and a JSON body rendered from the tool's templates, plus who asked and the intent scope. Its
//! canonical record keeps what decides the effect on the API: the method, the URL normalized
//! (scheme and host lower case, default port written out, dot segments resolved, fragment
//! dropped, query pairs decoded and sorted), header names lower case, the body as canonical
//! JSON, the credential by name only, and every secret as its own keyed MAC. The execution ID is
//! never part of it: a template's `{execution_id}` is recorded as the placeholder.
//!
//! The request that is sent keeps the URL as rendered; only the record is normalized.

use std::collections::BTreeMap;
use std::fmt;

use serde_json::{json, Value};

use crate::action::{CanonicalAction, Delivery, Fingerprint, FingerprintKey, Word};
use crate::canonical::canonical_json;
use crate::{Actor, ExecutionId, IntentScope};

/// Version of the HTTP record layout (the SSH record has its own).
const HTTP_RECORD_VERSION: u64 = 1;

/// The channel name recorded for HTTP actions.
pub const HTTP_CHANNEL: &str = "http";

/// An HTTP method Waymark sends.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum HttpMethod {
    Get,
    Head,
    Post,
    Put,
    Patch,
    Delete,
}

impl HttpMethod {
    /// Parses a method name in any case.
    pub fn parse(s: &str) -> Result<Self, HttpActionError> {
        Ok(match s.to_ascii_uppercase().as_str() {
            "GET" => HttpMethod::Get,
            "HEAD" => HttpMethod::Head,
            "POST" => HttpMethod::Post,
            "PUT" => HttpMethod::Put,
            "PATCH" => HttpMethod::Patch,
            "DELETE" => HttpMethod::Delete,
            _ => {
                return Err(HttpActionError::Method(s.to_string()));
            }
        })
    }

    /// The method as sent: `POST`.
    pub fn as_str(self) -> &'static str {
        match self {
            HttpMethod::Get => "GET",
            HttpMethod::Head => "HEAD",
            HttpMethod::Post => "POST",
            HttpMethod::Put => "PUT",
            HttpMethod::Patch => "PATCH",
            HttpMethod::Delete => "DELETE",
        }
    }
}

impl fmt::Display for HttpMethod {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Why an HTTP action cannot be built.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum HttpActionError {
    #[error(
        "HTTP method {0:?} is not one Waymark sends: use GET, HEAD, POST, PUT, PATCH or DELETE"
    )]
    Method(String),
    #[error("{url:?} is not a valid URL: {reason}")]
    Url { url: String, reason: String },
    #[error("{0:?} is not an http:// or https:// URL")]
    Scheme(String),
    #[error(
        "{0:?} carries a user name or password: put credentials in [credentials], never in the URL"
    )]
    UserInfo(String),
    #[error("header name {0:?} is not a valid HTTP header name")]
    HeaderName(String),
}

/// A target URL: as rendered (sent) and normalized (recorded).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HttpUrl {
    sent: String,
    scheme: String,
    host: String,
    port: u16,
    path: String,
    query: Vec<(String, String)>,
}

impl HttpUrl {
    /// Parses an absolute `http`/`https` URL with no user information.
    pub fn parse(text: &str) -> Result<Self, HttpActionError> {
        let url = url::Url::parse(text).map_err(|e| HttpActionError::Url {
            url: text.to_string(),
            reason: e.to_string(),
        })?;
        if url.scheme() != "http" && url.scheme() != "https" {
            return Err(HttpActionError::Scheme(text.to_string()));
        }
        if !url.username().is_empty() || url.password().is_some() {
            return Err(HttpActionError::UserInfo(text.to_string()));
        }
        let host = url
            .host_str()
            .ok_or_else(|| HttpActionError::Url {
                url: text.to_string(),
                reason: "it names no host".into(),
            })?
            .to_string();
        let port = url
            .port_or_known_default()
            .expect("http and https have known default ports");
        let mut query: Vec<(String, String)> = url
            .query_pairs()
            .map(|(k, v)| (k.into_owned(), v.into_owned()))
            .collect();
        query.sort();
        Ok(HttpUrl {
            sent: text.to_string(),
            scheme: url.scheme().to_string(),
            host,
            port,
            path: url.path().to_string(),
            query,
        })
    }

    /// The URL as the tool rendered it: what is sent.
    pub fn as_sent(&self) -> &str {
        &self.sent
    }

    /// `scheme://host:port/path`, normalized: how `explain` names the target.
    pub fn target(&self) -> String {
        format!("{}://{}:{}{}", self.scheme, self.host, self.port, self.path)
    }

    fn canonical(&self) -> Value {
        json!({
            "scheme": self.scheme,
            "host": self.host,
            "port": self.port,
            "path": self.path,
            "query": self.query.iter().map(|(k, v)| json!([k, v])).collect::<Vec<_>>(),
        })
    }
}

/// A JSON body template rendered with typed arguments: JSON, where a string may hold secret
/// arguments or the execution ID placeholder.
#[derive(Clone, Debug, PartialEq)]
pub enum JsonTemplate {
    /// A JSON value with no secret and no placeholder in it.
    Json(Value),
    /// A string built from literal text, secret arguments and the execution ID.
    Word(Word),
    Array(Vec<JsonTemplate>),
    Object(BTreeMap<String, JsonTemplate>),
}

impl JsonTemplate {
    /// The body as sent for execution `id`, secrets in clear. Never record this.
    pub fn expose(&self, id: ExecutionId) -> Value {
        match self {
            JsonTemplate::Json(v) => v.clone(),
            JsonTemplate::Word(w) => Value::String(w.expose(id)),
            JsonTemplate::Array(items) => {
                Value::Array(items.iter().map(|t| t.expose(id)).collect())
            }
            JsonTemplate::Object(map) => {
                Value::Object(map.iter().map(|(k, t)| (k.clone(), t.expose(id))).collect())
            }
        }
    }

    /// The recorded body: JSON where each templated string is replaced by its canonical word
    /// (MACs for secrets, the placeholder for the ID), and the JSON pointers of those strings,
    /// so a literal object that looks like a canonical word is never confused with one.
    fn canonical(&self, key: &FingerprintKey, pointer: &str, templated: &mut Vec<String>) -> Value {
        match self {
            JsonTemplate::Json(v) => v.clone(),
            JsonTemplate::Word(w) => {
                let word = w.canonical(key);
                if !word.is_string() {
                    templated.push(pointer.to_string());
                }
                word
            }
            JsonTemplate::Array(items) => Value::Array(
                items
                    .iter()
                    .enumerate()
                    .map(|(i, t)| t.canonical(key, &format!("{pointer}/{i}"), templated))
                    .collect(),
            ),
            JsonTemplate::Object(map) => Value::Object(
                map.iter()
                    .map(|(k, t)| {
                        let escaped = k.replace('~', "~0").replace('/', "~1");
                        (
                            k.clone(),
                            t.canonical(key, &format!("{pointer}/{escaped}"), templated),
                        )
                    })
                    .collect(),
            ),
        }
    }
}

/// The HTTP effect of an action, rendered from a tool's templates.
#[derive(Clone, Debug, PartialEq)]
pub struct HttpCall {
    pub method: HttpMethod,
    pub url: HttpUrl,
    /// Header names in lower case; values may hold secrets. The credential's header (for
    /// example `authorization`) is not here: it is added when sending, from `credential_ref`.
    pub headers: BTreeMap<String, Word>,
    /// A JSON body, sent as `application/json`.
    pub body: Option<JsonTemplate>,
}

impl HttpCall {
    /// Checks and lower-cases a header name (RFC 9110 token characters).
    pub fn header_name(name: &str) -> Result<String, HttpActionError> {
        let token = |c: char| c.is_ascii_alphanumeric() || "!#$%&'*+-.^_`|~".contains(c);
        if name.is_empty() || !name.chars().all(token) {
            return Err(HttpActionError::HeaderName(name.to_string()));
        }
        Ok(name.to_ascii_lowercase())
    }

    fn canonical(&self, key: &FingerprintKey) -> Value {
        let headers: serde_json::Map<String, Value> = self
            .headers
            .iter()
            .map(|(k, v)| (k.to_ascii_lowercase(), v.canonical(key)))
            .collect();
        let mut templated = Vec::new();
        let body = self
            .body
            .as_ref()
            .map(|b| b.canonical(key, "", &mut templated))
            .unwrap_or(Value::Null);
        json!({
            "method": self.method.as_str(),
            "url": self.url.canonical(),
            "headers": headers,
            "body": body,
            "body_templated": templated,
        })
    }
}

/// Everything a caller asked of an HTTP tool.
#[derive(Clone, Debug, PartialEq)]
pub struct HttpActionRequest {
    pub actor: Actor,
    pub tool: String,
    /// The name of the credential in the configuration, never its material.
    pub credential_ref: Option<String>,
    pub call: HttpCall,
    pub scope: IntentScope,
    pub delivery: Delivery,
}

impl HttpActionRequest {
    /// The canonical, secret-free record of this request's effect.
    pub fn canonicalize(&self, key: &FingerprintKey) -> CanonicalAction {
        let record = json!({
            "v": HTTP_RECORD_VERSION,
            "actor": self.actor.0,
            "tool": self.tool,
            "channel": HTTP_CHANNEL,
            "credential": self.credential_ref,
            "http": self.call.canonical(key),
            "scope": serde_json::to_value(&self.scope).expect("scope serializes"),
        });
        CanonicalAction::from_canonical_json(canonical_json(&record))
    }

    /// The intent fingerprint: keyed HMAC-SHA256 of the canonical record.
    pub fn fingerprint(&self, key: &FingerprintKey) -> Fingerprint {
        self.canonicalize(key).fingerprint(key)
    }

    /// The headers to send for execution `id`, secrets in clear (credential not included).
    /// Never record this.
    pub fn exposed_headers(&self, id: ExecutionId) -> Vec<(String, String)> {
        self.call
            .headers
            .iter()
            .map(|(k, v)| (k.clone(), v.expose(id)))
            .collect()
    }

    /// The body to send for execution `id` as JSON bytes, secrets in clear. Never record this.
    pub fn exposed_body(&self, id: ExecutionId) -> Option<Vec<u8>> {
        self.call
            .body
            .as_ref()
            .map(|b| serde_json::to_vec(&b.expose(id)).expect("a JSON value serializes"))
    }
}
