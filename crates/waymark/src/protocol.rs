//! The control protocol between the `waymark` CLI (or the MCP shim) and the daemon.
//!
//! One JSON object per line over a unix socket. A client sends one [`Request`]; the daemon
//! answers with zero or more [`Frame::Event`]s and then exactly one final frame
//! ([`Frame::Done`] or [`Frame::Error`]). The `v` field versions the protocol: a daemon refuses
//! a request of another version with an error that says which it speaks.

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

pub const PROTOCOL_VERSION: u32 = 1;
/// A request line longer than this is refused (and the connection closed).
pub const MAX_REQUEST_BYTES: usize = 1 << 20;

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Envelope {
    pub v: u32,
    #[serde(flatten)]
    pub request: Request,
}

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
        transport: Option<String>,
    },
    Status {
        id: String,
    },
    Result {
        id: String,
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
