//! Waymark's HTTP channel (issue 15): the executor that sends an HTTP tool's request.
//!
//! It sends one request and says which of two things a failure is: [`SendError::NotSent`] when
//! no byte of the request can have left (connection refused, name not resolved, TLS handshake
//! failed), so the execution did not start; [`SendError::Lost`] when the request may have left
//! (a timeout or reset after connecting, a body cut short, an answer that is not HTTP), so the
//! outcome is unknown and recovery goes by the tool's contract. It never re-sends on its own and
//! never follows a redirect: a redirect is the target's answer.
//!
//! The execution ID is sent as the idempotency key ([`idempotency_header`]): the same value for
//! every send of one execution, never the fingerprint. [`read_status`] says what the target's
//! status means for the execution: `409` is the first request still in flight, `422` is the key
//! reused with a different payload (which Waymark must never cause), any other status is a
//! completed execution whose result says whether it is an error.
//!
//! **What it is not.** It knows nothing of the ledger, tools or templates: the gateway renders
//! the request from `waymark_core::HttpActionRequest` and stores what this returns. Only this
//! crate knows the HTTP client (reqwest on rustls with the ring provider).

use std::time::Duration;

use sha2::{Digest, Sha256};
use waymark_core::{error_chain, ExecutionId, HttpMethod};

/// The header the execution ID travels in unless a tool names another.
pub const DEFAULT_IDEMPOTENCY_HEADER: &str = "Idempotency-Key";

/// Answer headers kept in the result: what an operator or agent needs to follow up.
pub const KEPT_HEADERS: &[&str] = &[
    "content-type",
    "location",
    "retry-after",
    "etag",
    "idempotent-replayed",
];

/// The request to send, secrets in clear: build it just before sending, never record it.
#[derive(Clone, Debug)]
pub struct OutgoingRequest {
    pub method: HttpMethod,
    pub url: String,
    /// Every header to send, the credential's and the idempotency key's included.
    pub headers: Vec<(String, String)>,
    /// A JSON body, sent with `content-type: application/json`.
    pub body: Option<Vec<u8>>,
    /// For the whole exchange: connect, send, answer and body.
    pub timeout: Duration,
    /// How many bytes of the answer's body to keep; the rest is counted and hashed.
    pub body_cap: usize,
    /// Answer headers to keep beyond [`KEPT_HEADERS`] (lower case): a status request's header
    /// that carries the operation's own status code.
    pub keep_headers: Vec<String>,
}

/// The target's answer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HttpAnswer {
    pub status: u16,
    /// The [`KEPT_HEADERS`] (and the request's `keep_headers`) the target sent, names in
    /// lower case.
    pub headers: Vec<(String, String)>,
    /// The first `body_cap` bytes of the body.
    pub body: Vec<u8>,
    /// The body's full size.
    pub total: u64,
    /// SHA-256 of the whole body, hex.
    pub sha256: String,
}

impl HttpAnswer {
    /// The body was longer than the cap and only its start is kept.
    pub fn truncated(&self) -> bool {
        self.total > self.body.len() as u64
    }
}

/// Why a send produced no answer.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SendError {
    /// No byte of the request can have left: the execution did not start.
    #[error("the request was not sent: {0}")]
    NotSent(String),
    /// The request may have reached the target: the outcome is unknown.
    #[error("the request may have reached the target, its outcome is unknown: {0}")]
    Lost(String),
}

/// What the target's status code means for the execution.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StatusReading {
    /// The target answered: the execution completed (an HTTP error is a completed execution
    /// whose result says so).
    Completed { is_error: bool },
    /// `409` to a keyed request: the first request with this key is still being processed.
    /// The execution stays dispatched; ask again later.
    StillInFlight,
    /// `422` to a keyed request: the key was used before with a different payload. Waymark
    /// never reuses an execution ID for another payload, so this is a loud failure.
    KeyReusedWithOtherPayload,
}

/// Reads a status code; `keyed` is whether the request carried an idempotency key (without
/// one, 409 and 422 are ordinary errors of the API).
pub fn read_status(status: u16, keyed: bool) -> StatusReading {
    match status {
        409 if keyed => StatusReading::StillInFlight,
        422 if keyed => StatusReading::KeyReusedWithOtherPayload,
        s => StatusReading::Completed { is_error: s >= 400 },
    }
}

/// The idempotency header for execution `id`: `(name, "act_…")`.
pub fn idempotency_header(name: &str, id: ExecutionId) -> (String, String) {
    (name.to_string(), id.to_string())
}

/// Why the channel cannot be set up.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("cannot set up the HTTP client: {0}")]
pub struct SetupError(String);

/// Sends requests; one per daemon, connections pooled per target.
#[derive(Clone)]
pub struct HttpChannel {
    client: reqwest::Client,
}

impl HttpChannel {
    /// A client that verifies TLS with the platform's roots, follows no redirect, reads no
    /// proxy from the environment and never re-sends a request on its own (reqwest retries
    /// what it deems safe by default): a re-send is the flow's decision, by the tool's contract.
    pub fn new() -> Result<HttpChannel, SetupError> {
        // Err means a provider is already installed, which is what is needed.
        let _ = rustls::crypto::ring::default_provider().install_default();
        let client = reqwest::Client::builder()
            .redirect(reqwest::redirect::Policy::none())
            .retry(reqwest::retry::never())
            .no_proxy()
            .user_agent(concat!("waymark/", env!("CARGO_PKG_VERSION")))
            .build()
            .map_err(|e| SetupError(error_chain(&e)))?;
        Ok(HttpChannel { client })
    }

    /// Sends `req` once and reads the whole answer.
    pub async fn send(&self, req: &OutgoingRequest) -> Result<HttpAnswer, SendError> {
        let method = reqwest::Method::from_bytes(req.method.as_str().as_bytes())
            .expect("HttpMethod names are valid methods");
        let mut builder = self.client.request(method, &req.url).timeout(req.timeout);
        for (k, v) in &req.headers {
            builder = builder.header(k.as_str(), v.as_str());
        }
        if let Some(body) = &req.body {
            builder = builder
                .header("content-type", "application/json")
                .body(body.clone());
        }
        let request = builder.build().map_err(|e| {
            SendError::NotSent(format!("the request is malformed: {}", error_chain(&e)))
        })?;
        let mut response = self.client.execute(request).await.map_err(classify)?;
        let status = response.status().as_u16();
        let headers = response
            .headers()
            .iter()
            .filter(|(k, _)| {
                KEPT_HEADERS.contains(&k.as_str())
                    || req.keep_headers.iter().any(|h| h == k.as_str())
            })
            .map(|(k, v)| {
                (
                    k.as_str().to_string(),
                    String::from_utf8_lossy(v.as_bytes()).into_owned(),
                )
            })
            .collect();
        let mut hasher = Sha256::new();
        let mut body = Vec::new();
        let mut total: u64 = 0;
        loop {
            let chunk = response.chunk().await.map_err(|e| {
                SendError::Lost(format!(
                    "the target answered {status} but its body was cut after {total} bytes: {}",
                    error_chain(&e)
                ))
            })?;
            let Some(chunk) = chunk else { break };
            hasher.update(&chunk);
            total += chunk.len() as u64;
            let room = req.body_cap.saturating_sub(body.len());
            body.extend_from_slice(&chunk[..room.min(chunk.len())]);
        }
        Ok(HttpAnswer {
            status,
            headers,
            body,
            total,
            sha256: hex::encode(hasher.finalize()),
        })
    }
}

/// A connect-phase failure (refused, unresolved, TLS handshake, connect timeout) sent nothing;
/// everything else may have sent the request.
fn classify(e: reqwest::Error) -> SendError {
    if e.is_connect() || e.is_builder() {
        SendError::NotSent(error_chain(&e))
    } else if e.is_timeout() {
        SendError::Lost(format!("no answer within the timeout: {}", error_chain(&e)))
    } else {
        SendError::Lost(error_chain(&e))
    }
}
