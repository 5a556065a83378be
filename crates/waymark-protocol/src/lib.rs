//! The control protocol between the `waymark` CLI (or the MCP shim) and the daemon.
//!
//! One JSON object per line over a unix socket. A client sends one [`Request`]; the daemon
//! answers with zero or more [`Frame::Event`]s and then exactly one final frame
//! ([`Frame::Done`] or [`Frame::Error`]). The `v` field versions the protocol: a daemon refuses
//! a request of another version with an error that says which it speaks.
//!
//! **API Boundary:** this is the wire format between processes that may be of different builds;
//! a change here is a protocol change. New fields carry a serde default so that older clients
//! keep working.
//!
//! This crate knows no clap, no rmcp, no gateway: it is the vocabulary the `waymark` binary and
//! `waymark-mcp` share, plus [`client::request`], the one way to send a request, and
//! [`control::Control`], the one way to start a daemon when none answers.

pub mod client;
pub mod control;

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use waymark_core::ReplayContract;

pub const PROTOCOL_VERSION: u32 = 1;
/// A request line longer than this is refused (and the connection closed).
pub const MAX_REQUEST_BYTES: usize = 1 << 20;

#[derive(Clone, Debug, Serialize, Deserialize)]
/// One request on the wire: the protocol version and the request itself.
pub struct Envelope {
    pub v: u32,
    #[serde(flatten)]
    pub request: Request,
}

/// What a client asks the daemon to do.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Request {
    Ping,
    /// Run a configured tool, or a raw command where policy allows.
    Call {
        tool: Option<String>,
        #[serde(default)]
        args: Map<String, Value>,
        host: Option<String>,
        raw: Option<Vec<String>>,
        /// An explicit idempotency key (intent scope).
        key: Option<String>,
        /// How the call reached Waymark (`cli`, `mcp-stdio`, ...), recorded in the agent run.
        transport: Option<String>,
        /// The client marks the result delivered itself (with [`Request::Delivered`]) once its
        /// own caller has it; the daemon then does not mark it after writing the final frame.
        #[serde(default)]
        defer_delivery: bool,
    },
    /// The result of a call made with `defer_delivery` reached its caller.
    Delivered {
        id: String,
    },
    /// The configured tools and raw-command hosts, as a [`ToolCatalog`], for a front end (the
    /// MCP shim) that publishes them.
    ListTools,
    /// An execution's state; the answer carries its stored result when it has one.
    Status {
        id: String,
        /// As for [`Request::Call`]: the client marks delivery itself.
        #[serde(default)]
        defer_delivery: bool,
    },
    /// An execution's stored result.
    Result {
        id: String,
        /// As for [`Request::Call`]: the client marks delivery itself.
        #[serde(default)]
        defer_delivery: bool,
    },
    /// Output of an execution by byte offset, read from the host's marker (binary-safe:
    /// the answer carries base64 in `data_b64`).
    Output {
        id: String,
        /// `stdout` or `stderr`.
        stream: String,
        offset: u64,
        max: u64,
    },
    List {
        state: Option<String>,
        host: Option<String>,
        tool: Option<String>,
        actor: Option<String>,
        since_ms: Option<u64>,
        limit: Option<usize>,
        after: Option<String>,
    },
    Resume {
        id: String,
        tool: Option<String>,
        #[serde(default)]
        args: Map<String, Value>,
        raw: Option<Vec<String>>,
    },
    Cancel {
        id: String,
    },
    Review {
        id: String,
        ran: bool,
        note: String,
    },
    Explain {
        id: String,
    },
    Approvals,
    Approve {
        id: String,
    },
    Deny {
        id: String,
        reason: String,
    },
    Lock,
    Unlock,
    Runs {
        limit: Option<usize>,
    },
    AuditVerify {
        exported_head: Option<String>,
    },
    AuditHead,
    Gc {
        older_than_ms: u64,
    },
}

/// What the daemon sends back: events, then one final frame.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(tag = "frame", rename_all = "snake_case")]
pub enum Frame {
    /// Progress: e.g. `{"kind":"accepted","id":"act_..."}` before a call runs.
    Event {
        kind: String,
        data: Value,
    },
    /// The answer. `exit` is the CLI exit code this answer maps to.
    Done {
        data: Value,
        text: String,
        exit: i32,
    },
    Error {
        message: String,
        exit: i32,
    },
}

impl Request {
    /// Whether the transport that writes this request's answer marks the result it carries
    /// delivered once the whole answer was written: every request that can answer with a
    /// result, unless its client defers (and sends [`Request::Delivered`] itself).
    pub fn delivered_by_transport(&self) -> bool {
        match self {
            Request::Call { defer_delivery, .. }
            | Request::Status { defer_delivery, .. }
            | Request::Result { defer_delivery, .. } => !defer_delivery,
            Request::Resume { .. } => true,
            _ => false,
        }
    }
}

impl Frame {
    /// The execution whose result this answer carries, if any: a `Done` whose data holds the
    /// output, or an execution record whose end was observed (a failure to start, a denial,
    /// an expiry are results too, without output). Output so far of a running execution
    /// (`partial`) is not a result.
    pub fn result_of(&self) -> Option<&str> {
        match self {
            Frame::Done { data, .. }
                if data["partial"] != true
                    && (data.get("stdout_b64").is_some() || data["result_observed"] == true) =>
            {
                data["id"].as_str()
            }
            _ => None,
        }
    }
}

/// The answer to [`Request::ListTools`] (the `data` of its [`Frame::Done`]).
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct ToolCatalog {
    pub tools: Vec<ToolSpec>,
    /// Hosts that accept raw commands (`policy.raw_commands`); empty: no raw commands.
    #[serde(default)]
    pub raw_hosts: Vec<String>,
}

/// One configured tool, as a front end needs to publish it.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ToolSpec {
    pub name: String,
    pub description: String,
    pub contract: ReplayContract,
    pub args: Vec<ArgInfo>,
    /// The hosts it may run on.
    pub hosts: Vec<String>,
    /// Whether the caller picks the host with a `host` argument.
    pub host_arg: bool,
}

/// One typed argument of a tool.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ArgInfo {
    pub name: String,
    /// `string`, `integer`, `boolean` or `enum`.
    #[serde(rename = "type")]
    pub ty: String,
    pub description: Option<String>,
    /// The allowed values of an enum.
    #[serde(default)]
    pub values: Vec<String>,
    /// An anchored regular expression the whole value must match.
    pub pattern: Option<String>,
    pub secret: bool,
    pub required: bool,
}
