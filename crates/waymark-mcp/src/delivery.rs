//! "Delivered" means the response left through stdout: a transport wrapper that marks a call's
//! result delivered only after rmcp's write of the JSON-RPC response carrying it completed.
//!
//! The handler records, per JSON-RPC request id, the execution whose result its response
//! carries ([`Pending`]); [`DeliveryTransport::send`] writes the response through the inner
//! transport (framed, flushed) and then, only if the write succeeded, sends
//! `Request::Delivered` to the daemon. A write that fails leaves the execution "completed,
//! result not delivered", which a retry or `exec_result` recovers.

use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, Mutex};

use rmcp::model::{JsonRpcMessage, RequestId};
use rmcp::service::{RequestContext, RoleServer, RxJsonRpcMessage, TxJsonRpcMessage};
use rmcp::transport::Transport;
use waymark_core::ExecutionId;
use waymark_protocol::{Frame, Request};

use crate::daemon::Control;

/// Executions whose results travel in a response, by delivery key: the JSON-RPC request id
/// ([`rpc_key`]) on stdio, the exchange [`crate::http`] opened for the HTTP request over HTTP.
/// A fan-out's response carries one per host.
#[derive(Clone, Default)]
pub struct Pending(Arc<Mutex<HashMap<String, Vec<ExecutionId>>>>);

/// The request header that names a POST's delivery exchange to the handler. Set by
/// [`crate::http`] only: a client's own value is removed before rmcp sees the request.
pub const EXCHANGE_HEADER: &str = "x-waymark-exchange";

/// The delivery key of a request the handler answers: the HTTP exchange its
/// [`EXCHANGE_HEADER`] names over HTTP, its JSON-RPC id ([`rpc_key`]) on stdio.
pub fn request_key(context: &RequestContext<RoleServer>) -> Option<String> {
    match context.extensions.get::<hyper::http::request::Parts>() {
        Some(parts) => {
            let exchange = parts.headers.get(EXCHANGE_HEADER)?;
            Some(format!("http:{}", exchange.to_str().ok()?))
        }
        None => Some(rpc_key(&context.id)),
    }
}

/// The delivery key of a JSON-RPC request id (stdio).
pub fn rpc_key(request: &RequestId) -> String {
    format!("rpc:{}", serde_json::to_string(request).unwrap_or_default())
}

impl Pending {
    /// The response with this key carries the result of execution `id` (too). An `http:` key
    /// counts only while its exchange is open: a response nobody will write is never delivered.
    pub fn insert(&self, key: String, id: ExecutionId) {
        let mut map = self.0.lock().expect("pending");
        if key.starts_with("rpc:") || map.contains_key(&key) {
            map.entry(key).or_default().push(id);
        }
    }

    /// An HTTP exchange begins: a handler may now record the execution its response carries.
    pub fn open(&self, key: String) {
        self.0.lock().expect("pending").insert(key, Vec::new());
    }

    /// Forgets the key; the executions recorded for it.
    pub fn take(&self, key: &str) -> Vec<ExecutionId> {
        self.0
            .lock()
            .expect("pending")
            .remove(key)
            .unwrap_or_default()
    }
}

/// Wraps the stdio transport; see the module documentation.
pub struct DeliveryTransport<T> {
    inner: T,
    control: Control,
    pending: Pending,
}

impl<T> DeliveryTransport<T> {
    pub fn new(inner: T, control: Control, pending: Pending) -> Self {
        DeliveryTransport {
            inner,
            control,
            pending,
        }
    }
}

impl<T> Transport<RoleServer> for DeliveryTransport<T>
where
    T: Transport<RoleServer>,
{
    type Error = T::Error;

    fn send(
        &mut self,
        item: TxJsonRpcMessage<RoleServer>,
    ) -> impl Future<Output = Result<(), Self::Error>> + Send + 'static {
        let executions = match &item {
            JsonRpcMessage::Response(r) => self.pending.take(&rpc_key(&r.id)),
            JsonRpcMessage::Error(e) => {
                e.id.as_ref()
                    .map(|id| self.pending.take(&rpc_key(id)))
                    .unwrap_or_default()
            }
            _ => Vec::new(),
        };
        let write = self.inner.send(item);
        let control = self.control.clone();
        async move {
            let written = write.await;
            if written.is_ok() {
                for id in executions {
                    match control.request(Request::Delivered { id }, |_| {}).await {
                        Ok(Frame::Done { .. }) => tracing::debug!(%id, "result delivered"),
                        other => {
                            tracing::warn!(%id, answer = ?other.ok(), "could not mark the result delivered")
                        }
                    }
                }
            }
            written
        }
    }

    fn receive(&mut self) -> impl Future<Output = Option<RxJsonRpcMessage<RoleServer>>> + Send {
        self.inner.receive()
    }

    fn close(&mut self) -> impl Future<Output = Result<(), Self::Error>> + Send {
        self.inner.close()
    }
}
