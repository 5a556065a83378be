//! Waymark's MCP front: `waymark mcp`, a stdio MCP server that an agent starts.
//!
//! It publishes one MCP tool per configured tool (input schema from the typed arguments,
//! annotations and description from the replay contract), `ssh_exec` where raw commands are
//! allowed, and `exec_status`, `exec_result`, `exec_list`, `exec_cancel`. Every call is relayed
//! to the Waymark daemon over its control socket ([`waymark_protocol`]); the daemon is started
//! on demand when none answers. While a call runs, the daemon's events become MCP
//! `notifications/progress` for a client that sent a `progressToken` ([`progress`]).
//! A client that declared the tasks extension gets a durable task per call, whose id is the
//! execution ID and whose state is the ledger's ([`tasks`]).
//!
//! What it does not do: it decides nothing about executions (the daemon's gateway does), it
//! opens no ledger and no SSH connection, and it never writes anything but MCP to stdout.
//!
//! **Architecture Invariant:** the only crate that knows rmcp; it knows no clap.
//!
//! **Architecture Invariant:** a call's result is marked delivered only after the MCP response
//! carrying it was written to stdout ([`delivery::DeliveryTransport`]); the daemon is told to
//! defer its own marking (`defer_delivery`).

pub mod approval;
pub mod daemon;
pub mod delivery;
pub mod http;
pub mod progress;
mod relay;
mod resumption;
pub mod server;
pub mod tasks;
pub mod tls;
pub mod tools;

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use rmcp::ServiceExt;
use waymark_core::ExecutionId;
use waymark_protocol::client::ClientError;
use waymark_protocol::{Event, Frame, Request};

/// The `_meta` key under which a caller may send an explicit idempotency key with `tools/call`.
pub const IDEMPOTENCY_KEY_META: &str = "io.waymark/idempotency-key";

/// The answer to one control request: the final frame, or why there is none.
pub type Reply<'a> = Pin<Box<dyn Future<Output = Result<Frame, ClientError>> + Send + 'a>>;

/// Where control requests go: the daemon's socket ([`daemon::Control`], for `waymark mcp`), or
/// the daemon's own service, in process (for Streamable HTTP, implemented by the daemon).
pub trait Backend: Send + Sync + 'static {
    /// Carries out one request; `on_execution` sees the execution ID as soon as it is known,
    /// so that a connection lost afterwards can still name it.
    fn request<'a>(
        &'a self,
        req: Request,
        on_execution: &'a (dyn Fn(ExecutionId) + Send + Sync),
    ) -> Reply<'a>;

    /// Carries out one request; `on_event` sees the backend's events (`execution`, and
    /// `output` where the backend relays it) while it runs. The default relays only the
    /// execution ID, through [`Backend::request`].
    fn request_events<'a>(
        &'a self,
        req: Request,
        on_event: &'a (dyn Fn(&Event) + Send + Sync),
    ) -> Reply<'a> {
        Box::pin(async move {
            let on_execution = |id: ExecutionId| on_event(&Event::Execution { id, attached: None });
            self.request(req, &on_execution).await
        })
    }

    /// The actor the daemon records for this backend's calls, which `tasks/list` lists the
    /// executions of: the daemon's answer to `WhoAmI` (the daemon decides who a connection
    /// is, never the client). `None`: unknown, list nothing.
    fn actor(&self) -> Pin<Box<dyn Future<Output = Option<String>> + Send + '_>> {
        Box::pin(async move {
            match self.request(Request::WhoAmI, &|_| {}).await {
                Ok(Frame::Done { data, .. }) => data["actor"].as_str().map(str::to_string),
                _ => None,
            }
        })
    }
}

impl Backend for daemon::Control {
    fn request<'a>(
        &'a self,
        req: Request,
        on_execution: &'a (dyn Fn(ExecutionId) + Send + Sync),
    ) -> Reply<'a> {
        Box::pin(daemon::Control::request(self, req, move |e| {
            if let Event::Execution { id, .. } = e {
                on_execution(*id);
            }
        }))
    }

    fn request_events<'a>(
        &'a self,
        req: Request,
        on_event: &'a (dyn Fn(&Event) + Send + Sync),
    ) -> Reply<'a> {
        Box::pin(daemon::Control::request(self, req, on_event))
    }
}

/// How to reach the daemon, and how to start one (the CLI starts it the same way).
pub use waymark_protocol::control::DaemonStart as ShimOptions;

/// The configuration hash the daemon on `socket` runs, as its `daemon.json` beside the socket
/// says, watched once a second: the shim learns of a reload (or a daemon restarted on another
/// configuration) without a request of its own.
fn watch_daemon_file(socket: &std::path::Path) -> tokio::sync::watch::Receiver<String> {
    let file = socket.with_file_name("daemon.json");
    let read = move || {
        std::fs::read_to_string(&file)
            .ok()
            .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
            .and_then(|v| v["config_hash"].as_str().map(str::to_string))
    };
    let (tx, rx) = tokio::sync::watch::channel(read().unwrap_or_default());
    tokio::spawn(async move {
        loop {
            tokio::time::sleep(std::time::Duration::from_secs(1)).await;
            if tx.is_closed() {
                return;
            }
            // A daemon that is down (no file) changes nothing until one runs again.
            if let Some(hash) = read() {
                tx.send_if_modified(|now| {
                    let moved = *now != hash;
                    *now = hash;
                    moved
                });
            }
        }
    });
    rx
}

/// Serves MCP on stdin/stdout until the client closes stdin.
pub async fn serve_stdio(opts: ShimOptions) -> Result<(), String> {
    let socket = opts.socket.clone();
    let control = daemon::Control::new(opts);
    control.ensure_daemon().await.map_err(|e| e.message)?;
    let pending = delivery::Pending::default();
    let handler = server::WaymarkMcp::new(Arc::new(control.clone()), "mcp-stdio", pending.clone())
        .with_tool_changes(watch_daemon_file(&socket));
    let (stdin, stdout) = rmcp::transport::stdio();
    let transport = delivery::DeliveryTransport::new(
        rmcp::transport::async_rw::AsyncRwTransport::new_server(stdin, stdout),
        control,
        pending,
    );
    let service = match handler.serve(transport).await {
        Ok(s) => s,
        // A client that goes away before initializing (one that only asked `server/discover`,
        // the Python SDK's default connect) ends the session normally.
        Err(
            rmcp::service::ServerInitializeError::ConnectionClosed(_)
            | rmcp::service::ServerInitializeError::ExpectedInitializeRequest(None),
        ) => return Ok(()),
        Err(e) => return Err(format!("MCP initialization failed: {e}")),
    };
    service
        .waiting()
        .await
        .map_err(|e| format!("MCP service stopped: {e}"))?;
    Ok(())
}
