//! What the daemon answers: the `data` of a [`Frame::Done`](crate::Frame::Done), one named
//! type per kind of answer, and the events a call sends before it ([`Event`]).
//!
//! The request decides the answer's type (see each [`Request`](crate::Request) variant), so a
//! client reads `data` as that type with [`Frame::answer`](crate::Frame::answer). The field
//! names are the wire format: they are those the untyped answers always had, pinned by the
//! tests at the end of this file.

use serde::{Deserialize, Serialize};
use waymark_core::{
    Actor, AttachAction, ExecState, ExecutionId, Fingerprint, Outcome, ReplayContract, Timestamp,
};

use crate::ToolCatalog;

pub use waymark_core::Stream;

/// Parses a state name as the CLI and MCP callers give it (`running`, `timed_out`, ...).
pub fn parse_state(s: &str) -> Result<ExecState, String> {
    ExecState::parse(s).ok_or_else(|| {
        format!(
            "unknown state {s:?}; states: {}",
            ExecState::ALL.map(|s| s.as_str()).join(", ")
        )
    })
}

fn is_false(b: &bool) -> bool {
    !b
}

/// Base64 (standard alphabet, padded) of output bytes, as every answer carries them.
pub fn encode_b64(bytes: &[u8]) -> String {
    data_encoding::BASE64.encode(bytes)
}

/// The bytes of a base64 field; empty when it is not valid base64 (the daemon always sends
/// valid base64).
pub fn decode_b64(text: &str) -> Vec<u8> {
    data_encoding::BASE64
        .decode(text.as_bytes())
        .unwrap_or_default()
}

/// An execution as the ledger records it: the answer to `Delivered`, `Review`, `Approve` and
/// `Deny`, an item of `List` and `Approvals`, and the base of every call answer.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ExecutionView {
    pub id: ExecutionId,
    pub state: ExecState,
    pub result_observed: bool,
    pub result_delivered: bool,
    pub tool: String,
    pub host: String,
    pub actor: Actor,
    pub contract: ReplayContract,
    pub fingerprint: Fingerprint,
    pub accepted_at_ms: Timestamp,
    pub updated_at_ms: Timestamp,
    pub finished_at_ms: Option<Timestamp>,
    pub outcome: Option<Outcome>,
    pub reason: Option<String>,
    pub dispatch_attempts: u32,
    pub run: Option<String>,
}

/// The first part of both output streams, as the ledger stores it (or the host has it so
/// far): text (lossy UTF-8) for reading, base64 for the exact bytes, how many bytes are here
/// (`stored`) and how many there are in all (`bytes`).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct OutputHeads {
    pub stdout: String,
    pub stderr: String,
    pub stdout_b64: String,
    pub stderr_b64: String,
    pub stdout_stored: u64,
    pub stderr_stored: u64,
    pub stdout_bytes: u64,
    pub stderr_bytes: u64,
}

impl OutputHeads {
    /// The heads of two streams, given their bytes here and their total sizes.
    pub fn new(stdout: &[u8], stdout_bytes: u64, stderr: &[u8], stderr_bytes: u64) -> Self {
        OutputHeads {
            stdout: String::from_utf8_lossy(stdout).into_owned(),
            stderr: String::from_utf8_lossy(stderr).into_owned(),
            stdout_b64: encode_b64(stdout),
            stderr_b64: encode_b64(stderr),
            stdout_stored: stdout.len() as u64,
            stderr_stored: stderr.len() as u64,
            stdout_bytes,
            stderr_bytes,
        }
    }

    /// A stream's text (lossy UTF-8).
    pub fn text(&self, s: Stream) -> &str {
        match s {
            Stream::Stdout => &self.stdout,
            Stream::Stderr => &self.stderr,
        }
    }

    /// A stream's bytes here.
    pub fn bytes(&self, s: Stream) -> Vec<u8> {
        decode_b64(match s {
            Stream::Stdout => &self.stdout_b64,
            Stream::Stderr => &self.stderr_b64,
        })
    }

    /// How many bytes of a stream are here.
    pub fn stored(&self, s: Stream) -> u64 {
        match s {
            Stream::Stdout => self.stdout_stored,
            Stream::Stderr => self.stderr_stored,
        }
    }

    /// How many bytes the stream has in all.
    pub fn total(&self, s: Stream) -> u64 {
        match s {
            Stream::Stdout => self.stdout_bytes,
            Stream::Stderr => self.stderr_bytes,
        }
    }
}

/// The stored result a call answer carries once the execution ended on the host.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CallOutput {
    #[serde(flatten)]
    pub heads: OutputHeads,
    pub stdout_truncated: bool,
    pub stderr_truncated: bool,
}

impl CallOutput {
    /// Whether the ledger holds only the first part of a stream (the rest is on the host).
    pub fn truncated(&self, s: Stream) -> bool {
        match s {
            Stream::Stdout => self.stdout_truncated,
            Stream::Stderr => self.stderr_truncated,
        }
    }
}

/// The answer to `Call`, `Resume` and `Cancel`: the execution, how this call came to it, the
/// message for a person, and its result once it has one.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CallAnswer {
    #[serde(flatten)]
    pub execution: ExecutionView,
    /// This call attached to an earlier execution of the same intent, and what that did.
    pub attached: Option<AttachAction>,
    pub message: String,
    #[serde(flatten)]
    pub output: Option<CallOutput>,
}

impl CallAnswer {
    /// The execution whose result this answer carries: one with output, or whose end was
    /// observed (a failure to start, a denial, an expiry are results too, without output).
    pub fn result_of(&self) -> Option<ExecutionId> {
        (self.output.is_some() || self.execution.result_observed).then_some(self.execution.id)
    }
}

/// The answer to `Status`: a call answer, plus whether the host could be asked and whether
/// this answer delivers the result.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct StatusAnswer {
    #[serde(flatten)]
    pub call: CallAnswer,
    /// Why the host's marker could not be read just now, if it could not.
    pub host_check_error: Option<String>,
    pub delivered_with_this_answer: bool,
}

/// The answer to `Result`: the stored result of an execution that ended, or (`partial`) the
/// output so far of one still on the host, which is not a result and is never delivered.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ResultView {
    pub id: ExecutionId,
    pub state: ExecState,
    #[serde(default, skip_serializing_if = "is_false")]
    pub partial: bool,
    #[serde(flatten)]
    pub heads: OutputHeads,
    /// The SHA-256 (hex) of the whole stream; only for a stored result.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stdout_sha256: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stderr_sha256: Option<String>,
    /// Whether either stream is longer than what the ledger holds; only for a stored result.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub truncated: Option<bool>,
    /// What output so far means; only for a partial answer.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
}

impl ResultView {
    /// The execution whose result this answer carries: any answer but output so far.
    pub fn result_of(&self) -> Option<ExecutionId> {
        (!self.partial).then_some(self.id)
    }
}

/// The answer to `Output`: bytes of one stream from `offset`, read from the host's marker.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct OutputPage {
    pub id: ExecutionId,
    pub stream: Stream,
    pub offset: u64,
    pub length: u64,
    /// The stream's size on the host.
    pub size: u64,
    pub data_b64: String,
}

impl OutputPage {
    pub fn bytes(&self) -> Vec<u8> {
        decode_b64(&self.data_b64)
    }
}

/// The answer to `List`: a page of executions, newest first.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ExecutionList {
    pub items: Vec<ExecutionView>,
    /// The `after` of the next page; `None`: this is the last.
    pub next: Option<ExecutionId>,
}

/// The answer to `Approvals`: every execution that awaits approval.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ApprovalList {
    pub items: Vec<ExecutionView>,
}

/// The answer to `Ping`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Pong {
    pub pong: bool,
    /// The daemon's process id.
    pub pid: u32,
}

/// The answer to `DaemonStatus`, `DaemonStop` and `DaemonReload`: what the daemon runs.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DaemonStatus {
    pub pid: u32,
    pub version: String,
    pub started: Timestamp,
    pub uptime_ms: u64,
    /// The configuration file it runs, and the SHA-256 (hex) of the text it loaded.
    pub config_file: String,
    pub config_hash: String,
    /// When that configuration was loaded (at start or by the last reload).
    pub config_loaded: Timestamp,
    /// The file on disk now: `same`, `changed` (a reload would change what runs), or why it
    /// cannot be read.
    pub config_on_disk: String,
    /// The ledger: its backend and where it is.
    pub ledger: String,
    /// Executions not yet final (in flight, awaiting approval, unknown, ...).
    pub unresolved: u64,
    /// Requests being answered now (this one included).
    pub requests: u64,
    pub hosts: Vec<HostPool>,
    pub listeners: Listeners,
    /// What the last reload refused, each error with its file:line:column (empty when it
    /// took, or before any).
    #[serde(default)]
    pub reload_errors: Vec<String>,
    /// Each environment variable the configuration's credentials name, and where the daemon
    /// has it from.
    #[serde(default)]
    pub env: Vec<EnvSource>,
}

/// An environment variable a credential names, as the daemon has it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct EnvSource {
    pub name: String,
    /// What names it (`credential payments`, `ledger.url_env`).
    pub what: String,
    /// `env_file`, `environment` (inherited from the process that started the daemon), or
    /// `missing`.
    pub from: String,
}

/// One configured host's SSH connection pool.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct HostPool {
    pub host: String,
    pub connections: usize,
}

/// Where the daemon listens.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Listeners {
    pub socket: String,
    /// MCP over Streamable HTTP, when `[daemon] http_listen` is set.
    pub http: Option<String>,
    /// The Prometheus endpoint, when `[daemon] metrics_listen` is set.
    pub metrics: Option<String>,
}

/// The answer to `Explain`: the incident view of one execution.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Explanation {
    pub execution: ExecutionView,
    /// The numbered answers (callers, authorization, host outcome, delivery, later calls).
    pub answers: Vec<String>,
    /// One line per ledger event.
    pub timeline: Vec<String>,
    /// Later executions of the same intent.
    pub later_executions: Vec<ExecutionId>,
}

/// The answer to `Lock` and `Unlock`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LockState {
    pub locked: bool,
    /// False: it already was so.
    pub changed: bool,
}

/// The answer to `AdoptHost`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct HostAdopted {
    pub host: String,
    /// The ledger identity the host recorded before (`None`: none).
    pub previous: Option<String>,
    /// This daemon's ledger identity, now recorded on the host.
    pub ledger: String,
}

/// The answer to `LedgerBackup`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BackupReport {
    pub dir: String,
    /// The head the copy holds.
    pub head: ChainPosition,
}

/// The answer to `AuditEvents`: events as stored, oldest first.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct EventPage {
    pub events: Vec<serde_json::Value>,
    /// The chain's head now: events after it do not exist yet.
    pub head: u64,
}

/// The answer to `Runs`: agent runs, newest first (`{"items": [...]}`, as every list).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RunList {
    pub items: Vec<RunView>,
}

/// One agent run (an item of [`RunList`]).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RunView {
    pub id: String,
    pub actor: Actor,
    pub transport: String,
    pub started_at: Timestamp,
    pub ended_at: Option<Timestamp>,
    pub calls: u64,
}

/// An audit chain position: the answer to `AuditHead`, and the ends of an [`AuditReport`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChainPosition {
    pub seq: u64,
    pub hash: String,
}

/// The answer to `AuditVerify`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct AuditReport {
    pub ok: bool,
    pub events: u64,
    pub base: ChainPosition,
    pub head: ChainPosition,
    pub broken: Option<ChainBreakView>,
}

/// Where and why the audit chain is broken.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChainBreakView {
    pub seq: u64,
    pub problem: String,
}

/// The answer to `Gc`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct GcReport {
    pub removed: u64,
    /// Agent runs removed with them (ended, named by no kept execution).
    #[serde(default)]
    pub removed_runs: u64,
    pub kept_unresolved: u64,
    pub pruned_through: Option<u64>,
    /// Nothing was removed: the counts are what a real run would remove now.
    #[serde(default)]
    pub dry_run: bool,
}

/// Every answer the daemon gives, as it builds them. On the wire an answer is its value alone
/// (untagged): the request says which type to read ([`Frame::answer`](crate::Frame::answer)).
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(untagged)]
pub enum Answer {
    Pong(Pong),
    Execution(ExecutionView),
    Call(CallAnswer),
    Status(StatusAnswer),
    Result(ResultView),
    Output(OutputPage),
    List(ExecutionList),
    Approvals(ApprovalList),
    Catalog(ToolCatalog),
    Explain(Explanation),
    Lock(LockState),
    Adopted(HostAdopted),
    Backup(BackupReport),
    Events(EventPage),
    Runs(RunList),
    Audit(AuditReport),
    Head(ChainPosition),
    Gc(GcReport),
    FanOut(FanOutAnswer),
    Identity(Identity),
    Refusals(RefusalList),
    Daemon(DaemonStatus),
}

/// The answer to `WhoAmI`: the actor the daemon proved this connection to be, and its rights.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Identity {
    pub actor: Actor,
    /// The listener that received the request (`socket`, `mcp-http`).
    pub transport: String,
    pub operator: bool,
    /// `None`: every tool and host (single-user mode, or the daemon's own user).
    pub tools: Option<Vec<String>>,
    pub deny_tools: Option<Vec<String>>,
    pub hosts: Option<Vec<String>>,
}

/// The answer to `AuditRefused`: calls refused for being outside their actor's rights, newest
/// first, as the audit chain records them.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RefusalList {
    pub items: Vec<RefusalView>,
}

/// One refused call.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RefusalView {
    /// Its audit event's sequence number.
    pub seq: u64,
    pub at: Timestamp,
    pub actor: Actor,
    pub tool: String,
    pub host: Option<String>,
    /// The call's intent fingerprint, when its arguments resolved.
    pub fingerprint: Option<String>,
    pub rule: String,
    pub transport: String,
}

impl Answer {
    /// The execution whose result this answer carries, if any: a call's, a status's or a
    /// result's answer once the execution ended (never output so far).
    pub fn result_of(&self) -> Option<ExecutionId> {
        match self {
            Answer::Call(c) => c.result_of(),
            Answer::Status(s) => s.call.result_of(),
            Answer::Result(r) => r.result_of(),
            _ => None,
        }
    }

    /// Every execution whose result this answer carries: a fan-out's carries one per host
    /// that has one, any other answer at most one ([`Answer::result_of`]).
    pub fn results_of(&self) -> Vec<ExecutionId> {
        match self {
            Answer::FanOut(f) => f.results_of(),
            other => other.result_of().into_iter().collect(),
        }
    }
}

/// The answer to `FanOut`: one entry per host, in the order the call named them (the tool's
/// own order for all of its hosts). Each host's execution is an ordinary one: its own ID,
/// fingerprint, ledger life and marker.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct FanOutAnswer {
    pub tool: String,
    pub hosts: Vec<HostAnswer>,
}

impl FanOutAnswer {
    /// The executions whose results this answer carries.
    pub fn results_of(&self) -> Vec<ExecutionId> {
        self.hosts
            .iter()
            .filter_map(|h| h.execution.as_ref()?.result_of())
            .collect()
    }
}

/// One host of a fan-out: its call's answer, or why there is none (the gateway failed for it:
/// nothing was accepted on that host), and the exit code that host alone would have given.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct HostAnswer {
    pub host: String,
    pub exit: i32,
    pub execution: Option<CallAnswer>,
    pub error: Option<String>,
}

/// What an execution that awaits approval shows the person who decides: the data of an
/// [`Event::AwaitingApproval`]. The canonical action text is secret-free by construction.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ApprovalQuestion {
    pub id: ExecutionId,
    pub tool: String,
    pub host: String,
    pub actor: Actor,
    pub contract: ReplayContract,
    /// The canonical action (JSON text).
    pub action: String,
}

/// Progress of a request before its final frame. On the wire: `"kind"` names it and `"data"`
/// carries its fields.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", content = "data", rename_all = "snake_case")]
pub enum Event {
    /// A call was resolved and is about to be decided.
    Calling { tool: String, host: String },
    /// The call's execution is known (durably accepted, or attached to an earlier one).
    Execution {
        id: ExecutionId,
        attached: Option<AttachAction>,
    },
    /// The call's execution waits on an operator's approval.
    AwaitingApproval(ApprovalQuestion),
    /// Output the command printed, at a byte offset of its stream. Secret argument values are
    /// already masked by the daemon.
    Output {
        stream: Stream,
        offset: u64,
        data_b64: String,
    },
    /// How far a long request got: `done` of `total` (when known) units named by `of`, e.g.
    /// `audit verify`'s events.
    Progress {
        of: String,
        done: u64,
        total: Option<u64>,
    },
    /// An event of one host's call within a fan-out (`FanOut`): which host, and its event.
    Host { host: String, event: Box<Event> },
    /// An event of a newer daemon that this build does not know (the whole event): ignored.
    #[serde(untagged)]
    Other(serde_json::Value),
}

/// How an [`AttachAction`] is named on the wire (`pending_approval`, ...), for a person.
/// What attaching did, in words for a person or a model: never the internal name.
pub fn attach_words(a: AttachAction) -> &'static str {
    match a {
        AttachAction::PendingApproval => "it still awaits approval; this is the same request",
        AttachAction::ReturnDenial => "it was denied; this is the same denial",
        AttachAction::Continue => "it was accepted and not yet sent; this call carries it on",
        AttachAction::AskHostMarker => {
            "it may have reached its host or API; the host's marker, or the API under the same idempotency key, tells what happened to it"
        }
        AttachAction::ReturnStoredResult => "it already ran; this is its stored result",
        AttachAction::NeedsReview => {
            "its outcome is unknown and it is irreversible; a human must review it first"
        }
    }
}
