//! What the flow tells a metrics registry: a narrow, write-only interface, so the gateway
//! knows no metrics library and keeps no counters of its own. The daemon implements it on its
//! registry (`waymark`'s `metrics` module); everything else passes [`NoMetrics`].

use std::time::Duration;

use waymark_core::AttachAction;

/// Events of the flow that a metrics registry counts. Each method has an empty default.
pub trait FlowMetrics: Send + Sync {
    /// The host (over SSH) or the API (over HTTP) answered a dispatch of `tool`, `latency`
    /// after its dispatch was recorded (that flush included).
    fn dispatch_answered(&self, _tool: &str, _channel: Channel, _latency: Duration) {}

    /// An execution of `tool` was recorded as unknown: Waymark cannot prove whether it ran.
    fn unknown_outcome(&self, _tool: &str) {}

    /// A call of `tool` attached to an earlier execution of the same intent (`action` says
    /// what the attach does) instead of starting a new one.
    fn attached_retry(&self, _tool: &str, _action: AttachAction) {}
}

/// How a dispatch reached its target.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Channel {
    Ssh,
    Http,
}

impl Channel {
    /// As written in a tool's `channel`.
    pub fn as_str(self) -> &'static str {
        match self {
            Channel::Ssh => "ssh",
            Channel::Http => "http",
        }
    }
}

/// Counts nothing: the gateway of a process that serves no metrics.
pub struct NoMetrics;

impl FlowMetrics for NoMetrics {}
