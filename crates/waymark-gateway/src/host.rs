//! What the gateway needs from a host, in core terms. `waymark-ssh` provides it over SSH;
//! the demo's embedded server provides the same through the same SSH client.

use std::future::Future;
use std::time::Duration;

use waymark_core::{ExecutionId, Outcome};

use crate::config::HostEntry;

/// What the host's marker says about an execution.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum MarkerView {
    /// No marker: the host never started it.
    Absent,
    /// The marker exists and the process is being launched.
    Starting,
    /// Running, with its pid.
    Running { pid: Option<u32> },
    /// Ended as recorded.
    Finished(Outcome),
    /// Started, process gone, no exit record.
    Interrupted,
    /// The marker exists but the command was provably never launched (a bad cwd, say, or a
    /// cancel that came first). The id is spent; nothing ran.
    NotLaunched { reason: String },
}

/// One of a command's two output streams (core's, shared with the control protocol).
pub use waymark_core::Stream;

/// One word of the command's argv.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Arg {
    /// In clear: never record it.
    pub value: String,
    /// Holds a secret argument: it reaches the host without passing the wrapper's command line
    /// or its marker (the command's own argv still shows it; config load warns of that).
    pub secret: bool,
}

/// An environment variable for the command.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EnvVar {
    pub name: String,
    /// In clear: never record it.
    pub value: String,
    /// Made from a secret argument: it reaches the host without passing any command line.
    pub secret: bool,
}

/// Output of one stream as fetched from the host.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct FetchedOutput {
    /// The bytes fetched (all of them, or the first `cap`).
    pub bytes: Vec<u8>,
    /// Total size on the host.
    pub total: u64,
    /// SHA-256 of all of it, when the whole output was fetched or the host reported it.
    pub sha256: Option<String>,
}

/// How a dispatch ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DispatchOutcome {
    /// The command ran to an end on the host.
    Finished {
        outcome: Outcome,
        stdout: FetchedOutput,
        stderr: FetchedOutput,
    },
    /// The host answered with a marker that is not a finished run: the id was started
    /// before (nothing new ran), or the run was interrupted or never launched.
    Observed(MarkerView),
}

/// Why a host gave no answer. The text names the host and says what happened.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum HostError {
    /// Waymark's settings for the host cannot be used (its credential is not configured, say).
    /// Nothing was sent.
    #[error("{0}")]
    Config(String),
    /// No byte of the request left: the connection could not be made, or the request itself
    /// was unusable.
    #[error("{0}")]
    NotSent(String),
    /// The connection failed after the request may have left.
    #[error("{0}")]
    Lost(String),
    /// The host answered, but not as the wrapper protocol says (a wrapper error, an unreadable
    /// reply, no marker for the id).
    #[error("{0}")]
    Answer(String),
}

/// Why a dispatch did not produce an outcome.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum DispatchError {
    /// Certainly not sent: no byte of the exec request left. Safe to retry.
    #[error("{0}")]
    NotSent(HostError),
    /// The request may have left: the outcome is unknown; ask the marker.
    #[error("{0}")]
    Lost(HostError),
}

impl From<HostError> for DispatchError {
    /// Only an error that proves nothing left is "not sent"; a wrapper's answer means the
    /// request reached the host, so its outcome is unknown like a lost connection's.
    fn from(e: HostError) -> Self {
        match e {
            HostError::Config(_) | HostError::NotSent(_) => DispatchError::NotSent(e),
            HostError::Lost(_) | HostError::Answer(_) => DispatchError::Lost(e),
        }
    }
}

/// The host operations the flow uses.
/// News of one execution's output streams, from [`HostExecutor::watch_output`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OutputNews {
    /// The execution.
    pub id: ExecutionId,
    /// The sizes `[stdout, stderr]` of its streams on the host now.
    pub sizes: [u64; 2],
    /// It has ended: the sizes are final.
    pub ended: bool,
}

pub trait HostExecutor: Send + Sync + 'static {
    /// Starts `argv` under `id` and waits for it to end.
    fn dispatch(
        &self,
        host: &HostEntry,
        id: ExecutionId,
        argv: Vec<Arg>,
        cwd: Option<String>,
        env: Vec<EnvVar>,
        timeout: Duration,
    ) -> impl Future<Output = Result<DispatchOutcome, DispatchError>> + Send;

    /// Reads the marker of `id`.
    fn status(
        &self,
        host: &HostEntry,
        id: ExecutionId,
    ) -> impl Future<Output = Result<MarkerView, HostError>> + Send;

    /// Reads the markers of many executions on one host: one view per id, in order. This
    /// default asks one at a time; an executor that can batch answers in one round trip.
    fn status_many(
        &self,
        host: &HostEntry,
        ids: &[ExecutionId],
    ) -> impl Future<Output = Result<Vec<MarkerView>, HostError>> + Send {
        async move {
            let mut views = Vec::with_capacity(ids.len());
            for id in ids {
                views.push(self.status(host, *id).await?);
            }
            Ok(views)
        }
    }

    /// Waits on the host up to `wait` for news of the executions in `known`, each with the
    /// sizes `[stdout, stderr]` of its output streams the caller has: news of each whose
    /// streams have other sizes now or that has ended (none when `wait` ran out without any).
    /// What a streaming call waits on before it reads bytes (batched across calls by the flow's
    /// output watch).
    fn watch_output(
        &self,
        host: &HostEntry,
        wait: Duration,
        known: &[(ExecutionId, [u64; 2])],
    ) -> impl Future<Output = Result<Vec<OutputNews>, HostError>> + Send;

    /// Fetches up to `cap` bytes of each output stream of a finished execution.
    fn fetch_output(
        &self,
        host: &HostEntry,
        id: ExecutionId,
        cap: u64,
    ) -> impl Future<Output = Result<(FetchedOutput, FetchedOutput), HostError>> + Send;

    /// Reads up to `max` bytes of one stream from byte `offset`, straight from the host's marker: the way to output beyond what the ledger
    /// keeps. Returns the bytes and the stream's size on the host.
    fn read_output(
        &self,
        host: &HostEntry,
        id: ExecutionId,
        stream: Stream,
        offset: u64,
        max: u64,
    ) -> impl Future<Output = Result<(Vec<u8>, u64), HostError>> + Send;

    /// Cancels `id` on the host (TERM to its process group, then KILL).
    fn cancel(
        &self,
        host: &HostEntry,
        id: ExecutionId,
    ) -> impl Future<Output = Result<MarkerView, HostError>> + Send;

    /// Makes this daemon's ledger the owner of the host's markers (`waymark hosts adopt`),
    /// whatever ledger owned them; returns the identity recorded there before (`None`: none).
    /// An executor whose hosts keep no record of their ledger refuses.
    fn adopt(
        &self,
        host: &HostEntry,
    ) -> impl Future<Output = Result<Option<String>, HostError>> + Send {
        let name = host.name.clone();
        async move {
            Err(HostError::Config(format!(
                "host {name}: this executor keeps no record of the ledger owning its markers"
            )))
        }
    }
}
