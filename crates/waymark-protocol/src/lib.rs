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

pub mod answer;
pub mod client;
pub mod control;
pub mod exit;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use waymark_core::{ExecState, ExecutionId, ReplayContract};

pub use answer::{
    Answer, ApprovalList, ApprovalQuestion, AuditReport, BackupReport, CallAnswer, CallOutput,
    ChainBreakView, ChainPosition, DaemonStatus, EnvSource, Event, EventPage, ExecutionList,
    ExecutionView, Explanation, FanOutAnswer, GcReport, HostAdopted, HostAnswer, HostPool,
    Identity, Listeners, LockState, OutputHeads, OutputPage, Pong, RefusalList, RefusalView,
    ResultView, RunList, RunView, StatusAnswer, Stream,
};

pub const PROTOCOL_VERSION: u32 = 1;
/// How long a read (`Status`, `Result`) waits for a host when its envelope names no deadline:
/// past it, the answer is what the ledger knows and says that the host did not answer in time.
pub const READ_DEADLINE: std::time::Duration = std::time::Duration::from_secs(5);
/// A request line longer than this is refused (and the connection closed).
pub const MAX_REQUEST_BYTES: usize = 1 << 20;

#[derive(Clone, Debug, Serialize, Deserialize)]
/// One request on the wire: the protocol version and the request itself.
pub struct Envelope {
    pub v: u32,
    /// How long the request may wait for a host (milliseconds) before it answers with what the
    /// ledger knows; `None`: [`READ_DEADLINE`]. Only reads that ask a host use it. A daemon of
    /// an older build ignores it (and waits for the host as it always did).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deadline_ms: Option<u64>,
    #[serde(flatten)]
    pub request: Request,
}

/// What a client asks the daemon to do. Each variant says what its answer is.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Request {
    /// Answers [`Pong`].
    Ping,
    /// Run a configured tool, or a raw command where policy allows. Answers [`CallAnswer`],
    /// after [`Event`]s.
    Call {
        tool: Option<String>,
        #[serde(default)]
        args: Map<String, Value>,
        host: Option<String>,
        raw: Option<Vec<String>>,
        /// An explicit idempotency key (intent scope).
        key: Option<String>,
        /// What the client says it is (`cli`, `mcp-stdio`, ...): recorded in the agent run as
        /// its claim, beside the listener the daemon received the call on. Never trusted.
        transport: Option<String>,
        /// The client marks the result delivered itself (with [`Request::Delivered`]) once its
        /// own caller has it; the daemon then does not mark it after writing the final frame.
        #[serde(default)]
        defer_delivery: bool,
    },
    /// Run a configured tool on several of its hosts in one call: one ordinary execution per
    /// host (its own ID, fingerprint and marker, the same as a single-host call of the tool on
    /// that host, so a repeat attaches per host). `hosts`: a subset of the tool's hosts;
    /// `None`, all of them. Answers [`FanOutAnswer`], after [`Event::Host`] events.
    FanOut {
        tool: String,
        #[serde(default)]
        args: Map<String, Value>,
        hosts: Option<Vec<String>>,
        /// As for [`Request::Call`].
        key: Option<String>,
        transport: Option<String>,
        #[serde(default)]
        defer_delivery: bool,
    },
    /// The result of a call made with `defer_delivery` reached its caller.
    /// Answers [`ExecutionView`].
    Delivered { id: ExecutionId },
    /// The configured tools and raw-command hosts, as a [`ToolCatalog`], for a front end (the
    /// MCP shim) that publishes them.
    ListTools,
    /// An execution's state; the answer ([`StatusAnswer`]) carries its stored result when it
    /// has one.
    Status {
        id: ExecutionId,
        /// As for [`Request::Call`]: the client marks delivery itself.
        #[serde(default)]
        defer_delivery: bool,
    },
    /// An execution's stored result ([`ResultView`]).
    Result {
        id: ExecutionId,
        /// As for [`Request::Call`]: the client marks delivery itself.
        #[serde(default)]
        defer_delivery: bool,
    },
    /// Output of an execution by byte offset, read from the host's marker (binary-safe:
    /// the answer, an [`OutputPage`], carries base64 in `data_b64`).
    Output {
        id: ExecutionId,
        stream: Stream,
        offset: u64,
        max: u64,
    },
    /// Answers [`ExecutionList`].
    List {
        state: Option<ExecState>,
        host: Option<String>,
        tool: Option<String>,
        actor: Option<String>,
        since_ms: Option<u64>,
        limit: Option<usize>,
        after: Option<ExecutionId>,
        /// Only the caller's own executions (the actor the daemon proved it to be).
        #[serde(default)]
        mine: bool,
    },
    /// Answers [`CallAnswer`].
    Resume {
        id: ExecutionId,
        tool: Option<String>,
        #[serde(default)]
        args: Map<String, Value>,
        raw: Option<Vec<String>>,
    },
    /// Answers [`CallAnswer`].
    Cancel { id: ExecutionId },
    /// Answers [`ExecutionView`].
    Review {
        id: ExecutionId,
        ran: bool,
        note: String,
    },
    /// Answers [`Explanation`].
    Explain { id: ExecutionId },
    /// Answers [`ApprovalList`].
    Approvals,
    /// Answers [`ExecutionView`].
    Approve { id: ExecutionId },
    /// Answers [`ExecutionView`].
    Deny { id: ExecutionId, reason: String },
    /// Answers [`LockState`].
    Lock {
        /// Why, in words; told to every caller refused while it holds.
        #[serde(default)]
        reason: Option<String>,
    },
    /// Answers [`LockState`].
    Unlock,
    /// Makes this daemon's ledger the owner of a host's execution markers, whatever ledger
    /// owned them (recorded in the audit chain). Answers [`HostAdopted`].
    AdoptHost { host: String },
    /// A consistent copy of the ledger into `dir` (on the daemon's machine, missing or
    /// empty), taken while it serves. Answers [`BackupReport`].
    LedgerBackup { dir: String },
    /// Audit events from sequence `from` on, at most `limit`, as stored (each with its
    /// sequence, `prev` and `hash`). Answers [`EventPage`].
    AuditEvents { from: u64, limit: usize },
    /// Answers [`RunList`].
    Runs { limit: Option<usize> },
    /// Answers [`AuditReport`].
    AuditVerify {
        exported_head: Option<String>,
        /// Start from this head (SEQ:HASH) kept earlier instead of genesis.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        since: Option<String>,
    },
    /// Answers [`ChainPosition`].
    AuditHead,
    /// Who the daemon proved this connection to be, and its rights. Answers [`Identity`].
    WhoAmI,
    /// Calls refused for being outside their actor's rights (operators only). Answers
    /// [`RefusalList`].
    AuditRefused { limit: Option<usize> },
    /// What the daemon runs and how (operators only). Answers [`DaemonStatus`].
    DaemonStatus,
    /// Stops the daemon gracefully (operators only): it accepts nothing new, finishes the
    /// requests it is answering (for `grace_ms`, 10 s by default), and leaves commands still
    /// running on hosts for the next start's reconcile. Answers [`DaemonStatus`] as it was.
    DaemonStop {
        #[serde(default)]
        grace_ms: Option<u64>,
    },
    /// Reads the configuration file again (operators only). Valid: new calls use it at once;
    /// executions already accepted keep what their record holds. Invalid: the daemon keeps the
    /// one it runs and the answer names each error. Answers [`DaemonStatus`].
    DaemonReload,
    /// Answers [`GcReport`].
    Gc {
        older_than_ms: u64,
        /// Say what would go, removing nothing.
        #[serde(default)]
        dry_run: bool,
    },
}

/// What the daemon sends back: events, then one final frame. `A` is the answer: the daemon
/// writes an [`Answer`]; a client reads it as JSON (the default) and then as the type its
/// request answers with [`Frame::answer`].
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(tag = "frame", rename_all = "snake_case")]
pub enum Frame<A = Value> {
    /// Progress: e.g. `{"kind":"execution","data":{"id":"act_..."}}` once a call's execution
    /// is known.
    Event(Event),
    /// The answer. `exit` is the CLI exit code this answer maps to.
    Done {
        data: A,
        text: String,
        exit: i32,
    },
    Error {
        message: String,
        exit: i32,
    },
}

impl Frame {
    /// This frame with its answer read as `T`, the type the request answers with. An answer
    /// that is not a `T` becomes an [`Frame::Error`] that says so.
    pub fn answer<T: DeserializeOwned>(self) -> Frame<T> {
        match self {
            Frame::Done { data, text, exit } => match serde_json::from_value(data) {
                Ok(data) => Frame::Done { data, text, exit },
                Err(e) => Frame::Error {
                    message: format!("garbled answer from the daemon: {e}"),
                    exit: exit::ERROR,
                },
            },
            Frame::Event(e) => Frame::Event(e),
            Frame::Error { message, exit } => Frame::Error { message, exit },
        }
    }
}

impl Frame {
    /// Reads the answer as `T` without taking it (a part of it, say the [`ExecutionView`] of a
    /// call answer); `None` for an error, or an answer that is no `T`.
    pub fn view<T: DeserializeOwned>(&self) -> Option<T> {
        match self {
            Frame::Done { data, .. } => T::deserialize(data).ok(),
            _ => None,
        }
    }
}

impl<A: Serialize> Frame<A> {
    /// This frame as a client reads it (what the wire does to it).
    pub fn to_json(&self) -> Frame {
        match self {
            Frame::Done { data, text, exit } => Frame::Done {
                data: serde_json::to_value(data).expect("answers serialize"),
                text: text.clone(),
                exit: *exit,
            },
            Frame::Event(e) => Frame::Event(e.clone()),
            Frame::Error { message, exit } => Frame::Error {
                message: message.clone(),
                exit: *exit,
            },
        }
    }
}

impl Request {
    /// Whether the transport that writes this request's answer marks the result it carries
    /// delivered once the whole answer was written: every request that can answer with a
    /// result, unless its client defers (and sends [`Request::Delivered`] itself).
    pub fn delivered_by_transport(&self) -> bool {
        match self {
            Request::Call { defer_delivery, .. }
            | Request::FanOut { defer_delivery, .. }
            | Request::Status { defer_delivery, .. }
            | Request::Result { defer_delivery, .. } => !defer_delivery,
            Request::Resume { .. } => true,
            _ => false,
        }
    }
}

impl Request {
    /// Whether sending this request again can change nothing a person would call an effect: it
    /// reads the ledger or a host's marker (a result it carries may be marked delivered, which
    /// a second answer only repeats). A client may send such a request again when its
    /// connection broke before the answer; any other request it never sends again, since the
    /// daemon may have carried it out.
    pub fn is_read_only(&self) -> bool {
        match self {
            Request::Ping
            | Request::ListTools
            | Request::Status { .. }
            | Request::Result { .. }
            | Request::Output { .. }
            | Request::List { .. }
            | Request::Explain { .. }
            | Request::Approvals
            | Request::Runs { .. }
            | Request::AuditVerify { .. }
            | Request::AuditHead
            | Request::AuditEvents { .. }
            | Request::WhoAmI
            | Request::DaemonStatus
            | Request::AuditRefused { .. } => true,
            Request::Call { .. }
            | Request::FanOut { .. }
            | Request::Delivered { .. }
            | Request::Resume { .. }
            | Request::Cancel { .. }
            | Request::Review { .. }
            | Request::Approve { .. }
            | Request::Deny { .. }
            | Request::Lock { .. }
            | Request::Unlock
            | Request::AdoptHost { .. }
            | Request::LedgerBackup { .. }
            | Request::DaemonStop { .. }
            | Request::DaemonReload
            | Request::Gc { .. } => false,
        }
    }
}

impl Frame<Answer> {
    /// The execution whose result this answer carries, if any ([`Answer::result_of`]).
    pub fn result_of(&self) -> Option<ExecutionId> {
        match self {
            Frame::Done { data, .. } => data.result_of(),
            _ => None,
        }
    }

    /// Every execution whose result this answer carries ([`Answer::results_of`]).
    pub fn results_of(&self) -> Vec<ExecutionId> {
        match self {
            Frame::Done { data, .. } => data.results_of(),
            _ => Vec::new(),
        }
    }
}

/// The answer to [`Request::ListTools`] (the `data` of its [`Frame::Done`]).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ToolCatalog {
    pub tools: Vec<ToolSpec>,
    /// Hosts that accept raw commands (`policy.raw_commands`); empty: no raw commands.
    #[serde(default)]
    pub raw_hosts: Vec<String>,
}

/// One configured tool, as a front end needs to publish it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
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
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
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
