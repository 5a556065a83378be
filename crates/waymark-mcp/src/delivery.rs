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
use rmcp::service::{RoleServer, RxJsonRpcMessage, TxJsonRpcMessage};
use rmcp::transport::Transport;
use waymark_protocol::{Frame, Request};

use crate::daemon::Control;

/// Executions whose result travels in the response to a JSON-RPC request, by request id.
#[derive(Clone, Default)]
pub struct Pending(Arc<Mutex<HashMap<RequestId, String>>>);

impl Pending {
    /// The response to `request` carries the result of execution `id`.
    pub fn insert(&self, request: RequestId, id: String) {
        self.0.lock().expect("pending").insert(request, id);
    }

    fn take(&self, request: &RequestId) -> Option<String> {
        self.0.lock().expect("pending").remove(request)
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
        let execution = match &item {
            JsonRpcMessage::Response(r) => self.pending.take(&r.id),
            JsonRpcMessage::Error(e) => e.id.as_ref().and_then(|id| self.pending.take(id)),
            _ => None,
        };
        let write = self.inner.send(item);
        let control = self.control.clone();
        async move {
            let written = write.await;
            if let (Ok(()), Some(id)) = (&written, execution) {
                match control
                    .request(Request::Delivered { id: id.clone() }, |_| {})
                    .await
                {
                    Ok(Frame::Done { .. }) => tracing::debug!(%id, "result delivered"),
                    other => {
                        tracing::warn!(%id, answer = ?other.ok(), "could not mark the result delivered")
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
