//! MCP over Streamable HTTP, served by the daemon: loopback only, a bearer token from a 0600
//! file, and no foreign browser origins.
//!
//! Every request must carry `Authorization: Bearer <token>` (else 401); a request with an
//! `Origin` header that is not a loopback origin is refused (403), so a web page in the
//! operator's browser cannot drive the daemon. What passes goes to rmcp's
//! `StreamableHttpService` with a [`WaymarkMcp`] handler over the given [`Backend`].
//!
//! Delivery: rmcp gives no hook after an HTTP response body was written, so over HTTP the
//! backend marks a result delivered when the handler returns (weaker than stdio).

use std::convert::Infallible;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::sync::Arc;

use http_body_util::{combinators::BoxBody, BodyExt, Full};
use hyper::body::{Bytes, Incoming};
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use rmcp::transport::streamable_http_server::session::local::LocalSessionManager;
use rmcp::transport::{StreamableHttpServerConfig, StreamableHttpService};
use tokio::net::TcpListener;

use crate::server::WaymarkMcp;
use crate::Backend;

/// The path the MCP endpoint is served on.
pub const MCP_PATH: &str = "/mcp";

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

fn refuse(status: StatusCode, message: &str) -> Response<BoxBody<Bytes, Infallible>> {
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

/// The gate in front of the MCP service: token, then origin, then path. `Err` is the refusal.
fn check<B>(req: &Request<B>, token: &str) -> Result<(), (StatusCode, &'static str)> {
    let presented = req
        .headers()
        .get(hyper::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    match presented {
        Some(t) if same_secret(t.trim().as_bytes(), token.as_bytes()) => {}
        _ => return Err((StatusCode::UNAUTHORIZED, "a valid bearer token is required")),
    }
    if let Some(origin) = req.headers().get(hyper::header::ORIGIN) {
        if !origin.to_str().is_ok_and(loopback_origin) {
            return Err((StatusCode::FORBIDDEN, "foreign origin refused"));
        }
    }
    if req.uri().path() != MCP_PATH {
        return Err((StatusCode::NOT_FOUND, "the MCP endpoint is /mcp"));
    }
    Ok(())
}

/// Serves MCP over Streamable HTTP on `listener` (which the caller bound to a loopback
/// address) until the task is dropped.
pub async fn serve(
    listener: TcpListener,
    token: String,
    backend: Arc<dyn Backend>,
) -> Result<(), String> {
    let local = listener.local_addr().map_err(|e| e.to_string())?;
    if !local.ip().is_loopback() {
        return Err(format!(
            "refusing to serve MCP over HTTP on {local}: only loopback addresses are allowed"
        ));
    }
    let service = Arc::new(StreamableHttpService::new(
        move || Ok(WaymarkMcp::new(backend.clone(), "mcp-http", None)),
        Arc::new(LocalSessionManager::default()),
        StreamableHttpServerConfig::default(),
    ));
    let token: Arc<str> = token.into();
    loop {
        let (stream, _) = match listener.accept().await {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(error = %e, "HTTP accept failed");
                continue;
            }
        };
        let service = service.clone();
        let token = token.clone();
        tokio::spawn(async move {
            let handler = hyper::service::service_fn(move |req: Request<Incoming>| {
                let service = service.clone();
                let token = token.clone();
                async move {
                    Ok::<_, Infallible>(match check(&req, &token) {
                        Ok(()) => service.handle(req).await,
                        Err((status, why)) => refuse(status, why),
                    })
                }
            });
            if let Err(e) = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(stream), handler)
                .await
            {
                tracing::debug!(error = %e, "HTTP connection ended");
            }
        });
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
    fn tokens_compare_whole() {
        assert!(same_secret(b"abcdef", b"abcdef"));
        assert!(!same_secret(b"abcdef", b"abcdeg"));
        assert!(!same_secret(b"abc", b"abcdef"));
    }
}
