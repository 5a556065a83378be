//! MCP over Streamable HTTP, served by the daemon: plain HTTP on loopback only, HTTPS (with
//! [`crate::tls`]) on any address; bearer tokens (each the proof of one actor), and no
//! foreign browser origins.
//!
//! Every request must carry `Authorization: Bearer <token>` with one of the endpoint's tokens
//! (else 401), and goes to that token's own MCP service and backend; a request with an
//! `Origin` header that is not a loopback origin is refused (403), so a web page in the
//! operator's browser cannot drive the daemon. What passes goes to rmcp's
//! `StreamableHttpService` with a [`WaymarkMcp`] handler over the given [`Backend`].
//!
//! A POST body is read here first, at most [`MAX_BODY_BYTES`] (else 413). A body that is not
//! JSON, or JSON that is not a JSON-RPC message, is answered 400 with a JSON-RPC error
//! (`-32700` parse error, `-32600` invalid request) instead of rmcp's bare 415.
//!
//! Delivery: a result counts as delivered once the whole response body carrying it went to
//! the connection. Each JSON POST opens an exchange (a key in [`Pending`], passed to the handler
//! in the [`EXCHANGE_HEADER`] request header, which a client cannot set); the handler records
//! there the execution whose result its response carries, and [`DeliveryBody`] marks it
//! delivered when hyper has taken the body's last frame. A stream the client closes first is
//! dropped before its end: the result stays "completed, not delivered".
//!
//! Resumption: sessions are [`ResumableSessions`], rmcp's with each POST's stream kept past
//! its answer, so a client that reconnects with `Last-Event-ID` gets the events and the result
//! it missed even when the result came while it was away.

use std::convert::Infallible;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::sync::Arc;

use http_body_util::{combinators::BoxBody, BodyExt, Full, LengthLimitError, Limited};
use hyper::body::{Bytes, Incoming};
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use rmcp::transport::{StreamableHttpServerConfig, StreamableHttpService};
use tokio::net::TcpListener;

use crate::delivery::{Pending, EXCHANGE_HEADER};
use crate::resumption::ResumableSessions;
use crate::server::WaymarkMcp;
use crate::Backend;

/// The path the MCP endpoint is served on.
pub const MCP_PATH: &str = "/mcp";

/// The largest POST body accepted: the daemon refuses a control request longer than this, so a
/// bigger body could only fail later, after it was buffered.
pub const MAX_BODY_BYTES: usize = waymark_protocol::MAX_REQUEST_BYTES;

type HttpResponse = Response<BoxBody<Bytes, Infallible>>;

/// A response body that marks the execution recorded for its exchange delivered once hyper
/// took its last frame; dropped before that, it forgets the exchange and marks nothing.
struct DeliveryBody {
    inner: BoxBody<Bytes, Infallible>,
    key: String,
    pending: Pending,
    backend: Arc<dyn Backend>,
    ended: bool,
}

impl DeliveryBody {
    fn finish(&mut self) {
        if std::mem::replace(&mut self.ended, true) {
            return;
        }
        for id in self.pending.take(&self.key) {
            let backend = self.backend.clone();
            tokio::spawn(async move {
                let answer = backend
                    .request(waymark_protocol::Request::Delivered { id }, &|_| {})
                    .await;
                match answer {
                    Ok(waymark_protocol::Frame::Done { .. }) => {
                        tracing::debug!(%id, "result delivered over HTTP")
                    }
                    other => {
                        tracing::warn!(%id, answer = ?other.ok(), "could not mark the result delivered")
                    }
                }
            });
        }
    }
}

impl hyper::body::Body for DeliveryBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<hyper::body::Frame<Bytes>, Infallible>>> {
        let this = &mut *self;
        let polled = std::pin::Pin::new(&mut this.inner).poll_frame(cx);
        match &polled {
            std::task::Poll::Ready(None) => this.finish(),
            // hyper does not poll a body again once it says it has ended.
            std::task::Poll::Ready(Some(_)) if this.inner.is_end_stream() => this.finish(),
            _ => {}
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        self.inner.size_hint()
    }
}

impl Drop for DeliveryBody {
    fn drop(&mut self) {
        if !self.ended {
            self.pending.take(&self.key);
        }
    }
}

/// Reads the bearer token; refuses a file that others may read (it must be 0600 or stricter).
pub fn read_token(path: &Path) -> Result<String, String> {
    let meta = std::fs::metadata(path)
        .map_err(|e| format!("cannot read the HTTP token file {}: {e}", path.display()))?;
    let mode = meta.permissions().mode() & 0o777;
    if mode & 0o077 != 0 {
        return Err(format!(
            "the HTTP token file {} is mode {mode:o}; make it 0600 (`chmod 600 {}`)",
            path.display(),
            path.display()
        ));
    }
    let token = std::fs::read_to_string(path)
        .map_err(|e| format!("cannot read the HTTP token file {}: {e}", path.display()))?
        .trim()
        .to_string();
    if token.len() < 16 {
        return Err(format!(
            "the HTTP token in {} is shorter than 16 characters",
            path.display()
        ));
    }
    Ok(token)
}

/// Byte comparison whose time does not depend on where the first difference is.
fn same_secret(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Whether an `Origin` header names this machine (a loopback host, any port, http or https).
fn loopback_origin(origin: &str) -> bool {
    let rest = origin
        .strip_prefix("http://")
        .or_else(|| origin.strip_prefix("https://"));
    let Some(hostport) = rest else { return false };
    let host = if let Some(v6) = hostport.strip_prefix('[') {
        v6.split(']').next().unwrap_or("")
    } else {
        hostport.split(':').next().unwrap_or("")
    };
    host == "localhost"
        || host
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

fn refuse(status: StatusCode, message: &str) -> HttpResponse {
    let mut r = Response::new(Full::new(Bytes::from(format!("{message}\n"))).boxed());
    *r.status_mut() = status;
    if status == StatusCode::UNAUTHORIZED {
        r.headers_mut().insert(
            hyper::header::WWW_AUTHENTICATE,
            hyper::header::HeaderValue::from_static("Bearer"),
        );
    }
    r
}

/// A JSON-RPC error with no request id (the request could not be read), as a 400.
fn rpc_error(code: i64, message: &str) -> HttpResponse {
    let body = serde_json::json!({
        "jsonrpc": "2.0",
        "id": null,
        "error": {"code": code, "message": message},
    });
    let mut r = Response::new(Full::new(Bytes::from(body.to_string())).boxed());
    *r.status_mut() = StatusCode::BAD_REQUEST;
    r.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_static("application/json"),
    );
    r
}

fn is_json<B>(req: &Request<B>) -> bool {
    req.headers()
        .get(hyper::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| {
            let essence = v.split(';').next().unwrap_or("");
            essence.trim().eq_ignore_ascii_case("application/json")
        })
}

/// Hands a request that passed [`check`] to rmcp; a JSON POST body is read and judged first
/// (see the module documentation).
async fn relay(
    service: &StreamableHttpService<WaymarkMcp, ResumableSessions>,
    delivery: &Delivery,
    mut req: Request<Incoming>,
) -> HttpResponse {
    req.headers_mut().remove(EXCHANGE_HEADER);
    if req.method() == hyper::Method::DELETE {
        // rmcp answers an ended session 202; the SDKs (TypeScript, Python) expect 200 or
        // 204, and 202 ("accepted, not yet done") is not true: the session is gone.
        let mut answer = service.handle(req).await;
        if answer.status() == StatusCode::ACCEPTED {
            *answer.status_mut() = StatusCode::NO_CONTENT;
        }
        return answer;
    }
    if req.method() != hyper::Method::POST || !is_json(&req) {
        return service.handle(req).await;
    }
    let (mut parts, body) = req.into_parts();
    let bytes = match Limited::new(body, MAX_BODY_BYTES).collect().await {
        Ok(c) => c.to_bytes(),
        Err(e) if e.downcast_ref::<LengthLimitError>().is_some() => {
            return refuse(
                StatusCode::PAYLOAD_TOO_LARGE,
                &format!("the request body exceeds {MAX_BODY_BYTES} bytes"),
            )
        }
        Err(e) => {
            return refuse(
                StatusCode::BAD_REQUEST,
                &format!("cannot read the request body: {e}"),
            )
        }
    };
    if let Err(e) = serde_json::from_slice::<serde_json::Value>(&bytes) {
        return rpc_error(-32700, &format!("Parse error: the body is not JSON ({e})"));
    }
    let exchange = delivery
        .next
        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let key = format!("http:{exchange}");
    parts.headers.insert(EXCHANGE_HEADER, exchange.into());
    delivery.pending.open(key.clone());
    let answer = service
        .handle(Request::from_parts(parts, Full::new(bytes)))
        .await;
    // The body is JSON (checked above), so rmcp's 415 means it is not a JSON-RPC message.
    if answer.status() == StatusCode::UNSUPPORTED_MEDIA_TYPE {
        delivery.pending.take(&key);
        return rpc_error(
            -32600,
            "Invalid Request: the body is not a JSON-RPC message",
        );
    }
    answer.map(|inner| {
        DeliveryBody {
            inner,
            key,
            pending: delivery.pending.clone(),
            backend: delivery.backend.clone(),
            ended: false,
        }
        .boxed()
    })
}

/// What [`relay`] needs to mark results delivered: the exchanges and where to report.
struct Delivery {
    pending: Pending,
    backend: Arc<dyn Backend>,
    next: std::sync::atomic::AtomicU64,
}

/// A bearer token the endpoint takes, and the backend its requests go to: the daemon's
/// service as the actor that token proves.
pub struct BearerToken {
    /// SHA-256 of the token; the token itself need not be kept.
    pub sha256: [u8; 32],
    pub backend: Arc<dyn Backend>,
}

/// SHA-256 of a presented or configured token (surrounding whitespace ignored).
pub fn token_digest(token: &str) -> [u8; 32] {
    use sha2::{Digest, Sha256};
    Sha256::digest(token.trim().as_bytes()).into()
}

/// The gate in front of the MCP service: token, then origin, then path. `Ok` is the index of
/// the token that matched (each token's digest compared whole, in time that does not depend
/// on where they differ); `Err` is the refusal.
fn check<B>(req: &Request<B>, tokens: &[[u8; 32]]) -> Result<usize, (StatusCode, &'static str)> {
    let presented = req
        .headers()
        .get(hyper::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(token_digest);
    let matched = presented.and_then(|p| {
        tokens
            .iter()
            .enumerate()
            .fold(None, |found, (i, t)| match same_secret(&p, t) {
                true => Some(i),
                false => found,
            })
    });
    let Some(which) = matched else {
        return Err((StatusCode::UNAUTHORIZED, "a valid bearer token is required"));
    };
    if let Some(origin) = req.headers().get(hyper::header::ORIGIN) {
        if !origin.to_str().is_ok_and(loopback_origin) {
            return Err((StatusCode::FORBIDDEN, "foreign origin refused"));
        }
    }
    if req.uri().path() != MCP_PATH {
        return Err((StatusCode::NOT_FOUND, "the MCP endpoint is /mcp"));
    }
    Ok(which)
}

/// One token's MCP service: its own sessions (a session opened with one token is unknown to
/// another's, so no client can drive another actor's session) and its own exchanges.
struct Gate {
    service: StreamableHttpService<WaymarkMcp, ResumableSessions>,
    delivery: Delivery,
}

/// How long a client may take to finish its TLS handshake; one that takes longer loses its
/// connection (and only that).
const TLS_HANDSHAKE: std::time::Duration = std::time::Duration::from_secs(10);

/// Serves MCP over Streamable HTTP on `listener` until the task is dropped: over TLS with
/// `tls` ([`crate::tls::server_config`]), else plain, which only a loopback address may be.
/// Each connection, its TLS handshake included, is served on its own task, so a client that
/// sends garbage or stalls costs its own connection only. Each request goes to the backend
/// of the token it presents.
pub async fn serve(
    listener: TcpListener,
    tokens: Vec<BearerToken>,
    tls: Option<Arc<rustls::ServerConfig>>,
    tool_changes: tokio::sync::watch::Receiver<String>,
) -> Result<(), String> {
    let local = listener.local_addr().map_err(|e| e.to_string())?;
    if tls.is_none() && !local.ip().is_loopback() {
        return Err(format!(
            "refusing to serve plain MCP over HTTP on {local}: off loopback it needs TLS"
        ));
    }
    let acceptor = tls.map(tokio_rustls::TlsAcceptor::from);
    // rmcp refuses a `Host` that is not a loopback name (against DNS rebinding). Over TLS a
    // client names the server as its certificate does, and a browser led there by a rebound
    // name fails the certificate check before it sends anything, so the check is left to TLS.
    let mut rmcp_config =
        StreamableHttpServerConfig::default().with_max_request_body_bytes(MAX_BODY_BYTES);
    if acceptor.is_some() {
        rmcp_config = rmcp_config.disable_allowed_hosts();
    }
    if tokens.is_empty() {
        return Err("MCP over HTTP needs at least one bearer token".into());
    }
    let digests: Arc<[[u8; 32]]> = tokens.iter().map(|t| t.sha256).collect();
    let gates: Arc<[Gate]> = tokens
        .into_iter()
        .map(|t| {
            let backend = t.backend;
            let delivery = Delivery {
                pending: Pending::default(),
                backend: backend.clone(),
                next: std::sync::atomic::AtomicU64::new(1),
            };
            let pending = delivery.pending.clone();
            let changes = tool_changes.clone();
            let service = StreamableHttpService::new(
                move || {
                    Ok(
                        WaymarkMcp::new(backend.clone(), "mcp-http", pending.clone())
                            .with_tool_changes(changes.clone()),
                    )
                },
                Arc::new(ResumableSessions::default()),
                rmcp_config.clone(),
            );
            Gate { service, delivery }
        })
        .collect();
    loop {
        let (stream, peer) = match listener.accept().await {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(error = %e, "HTTP accept failed");
                continue;
            }
        };
        let gates = gates.clone();
        let digests = digests.clone();
        let acceptor = acceptor.clone();
        tokio::spawn(async move {
            let handler = hyper::service::service_fn(move |req: Request<Incoming>| {
                let gates = gates.clone();
                let digests = digests.clone();
                async move {
                    Ok::<_, Infallible>(match check(&req, &digests) {
                        Ok(i) => relay(&gates[i].service, &gates[i].delivery, req).await,
                        Err((status, why)) => refuse(status, why),
                    })
                }
            });
            let Some(acceptor) = acceptor else {
                return serve_connection(stream, handler).await;
            };
            match tokio::time::timeout(TLS_HANDSHAKE, acceptor.accept(stream)).await {
                Ok(Ok(stream)) => serve_connection(stream, handler).await,
                Ok(Err(e)) => {
                    tracing::warn!(%peer, error = %e, "TLS handshake failed; connection dropped");
                }
                Err(_) => {
                    tracing::warn!(%peer, "TLS handshake not done within {TLS_HANDSHAKE:?}; connection dropped");
                }
            }
        });
    }
}

/// One HTTP/1.1 connection, plain or TLS, served to its end.
async fn serve_connection<S, H>(stream: S, handler: H)
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
    H: hyper::service::HttpService<Incoming, ResBody = BoxBody<Bytes, Infallible>>,
    H::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    H::Future: Send + 'static,
{
    if let Err(e) = hyper::server::conn::http1::Builder::new()
        .serve_connection(TokioIo::new(stream), handler)
        .await
    {
        tracing::debug!(error = %e, "HTTP connection ended");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_loopback_origins_pass() {
        assert!(loopback_origin("http://localhost:3000"));
        assert!(loopback_origin("http://127.0.0.1"));
        assert!(loopback_origin("http://[::1]:8080"));
        assert!(!loopback_origin("https://evil.example"));
        assert!(!loopback_origin("http://localhost.evil.example"));
        assert!(!loopback_origin("null"));
    }

    #[test]
    fn the_presented_token_picks_its_own_backend() {
        let req = |t: &str| {
            Request::builder()
                .uri(MCP_PATH)
                .header("authorization", format!("Bearer {t}"))
                .body(())
                .unwrap()
        };
        let tokens = [
            token_digest("first-token-0123456"),
            token_digest("second-token-012345"),
        ];
        assert_eq!(check(&req("first-token-0123456"), &tokens), Ok(0));
        assert_eq!(check(&req("second-token-012345"), &tokens), Ok(1));
        assert_eq!(
            check(&req("third-token-0123456"), &tokens).map_err(|e| e.0),
            Err(StatusCode::UNAUTHORIZED)
        );
    }

    #[test]
    fn tokens_compare_whole() {
        assert!(same_secret(b"abcdef", b"abcdef"));
        assert!(!same_secret(b"abcdef", b"abcdeg"));
        assert!(!same_secret(b"abc", b"abcdef"));
    }
}
