//! Marker states and the replies of `status` and `start`.

use std::fmt;

use super::reply::{Block, WrapperReply};
use super::{exit_status, validate_execution_id, Result, WrapperError};

/// The state of an execution's marker on the host.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MarkerState {
    /// No marker: this ID was never started on this host (or was collected by `gc`).
    Absent,
    /// The marker exists, the supervisor has not recorded itself yet.
    Starting,
    /// The supervisor is alive (pid, start time and boot all match).
    Running,
    /// The command ended on its own; see the exit code or signal.
    Completed,
    /// The supervisor is gone without an exit record (killed, reboot), or
    /// the start never got as far as launching it: the outcome is unknown.
    Interrupted,
    /// The host-side timeout fired and the process group was killed.
    TimedOut,
    /// A cancel request ended it (or kept it from launching).
    Cancelled,
}

impl MarkerState {
    /// The name used on the wire.
    pub fn as_str(self) -> &'static str {
        match self {
            MarkerState::Absent => "absent",
            MarkerState::Starting => "starting",
            MarkerState::Running => "running",
            MarkerState::Completed => "completed",
            MarkerState::Interrupted => "interrupted",
            MarkerState::TimedOut => "timed_out",
            MarkerState::Cancelled => "cancelled",
        }
    }

    /// Parses the wire name.
    pub fn from_wire(s: &str) -> Option<Self> {
        Some(match s {
            "absent" => MarkerState::Absent,
            "starting" => MarkerState::Starting,
            "running" => MarkerState::Running,
            "completed" => MarkerState::Completed,
            "interrupted" => MarkerState::Interrupted,
            "timed_out" => MarkerState::TimedOut,
            "cancelled" => MarkerState::Cancelled,
            _ => return None,
        })
    }

    /// An exit record exists: the state will not change any more.
    pub fn is_finished(self) -> bool {
        matches!(
            self,
            MarkerState::Completed | MarkerState::TimedOut | MarkerState::Cancelled
        )
    }
}

impl fmt::Display for MarkerState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Whether the command itself was started.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Launched {
    /// The command process was recorded before it was executed.
    Yes,
    /// Proven not started: it never will be for this marker.
    No,
    /// The supervisor died between launching and recording: it may have run.
    Unknown,
}

/// The `status` block: what the host's marker says about one execution.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StatusReport {
    /// The execution ID.
    pub id: String,
    /// The marker's state.
    pub state: MarkerState,
    /// Whether the command was started (`None` when absent).
    pub launched: Option<Launched>,
    /// When the marker was created (Unix ms, host clock).
    pub created_ms: Option<u64>,
    /// When the supervisor recorded itself (Unix ms).
    pub started_ms: Option<u64>,
    /// When the exit record was written (Unix ms).
    pub finished_ms: Option<u64>,
    /// The supervisor's pid.
    pub supervisor_pid: Option<u32>,
    /// The command's pid (also its process group id).
    pub command_pid: Option<u32>,
    /// The raw status the shell reported (exit code, or 128 + signal).
    pub wait_status: Option<u32>,
    /// The exit code when the command exited.
    pub exit_code: Option<i32>,
    /// The signal that ended the command (wait status 129–192; a shell cannot
    /// tell `exit 130` from death by SIGINT).
    pub signal: Option<i32>,
    /// The host-side timeout, in seconds.
    pub timeout_s: Option<u64>,
    /// A cancel request was recorded.
    pub cancel_requested: bool,
    /// For `interrupted`: whether the orphaned command still runs.
    pub command_alive: Option<bool>,
    /// A failure of the wrapper itself, e.g. `not_launched` (bad cwd).
    pub error: Option<String>,
    /// Bytes of stdout so far.
    pub stdout_bytes: u64,
    /// Bytes of stderr so far.
    pub stderr_bytes: u64,
}

impl StatusReport {
    /// Parses a reply to `status` or `cancel`.
    pub fn parse(reply: &WrapperReply) -> Result<Self> {
        reply.check("status")?;
        let block = Block::parse("status", "status", &reply.stdout)?;
        block.no_payload()?;
        Self::from_block(&block)
    }

    /// Parses a reply to `status` of many IDs: one block per ID of `ids`, in that order.
    pub fn parse_many<S: AsRef<str>>(reply: &WrapperReply, ids: &[S]) -> Result<Vec<Self>> {
        reply.check("status")?;
        let mut rest: &[u8] = &reply.stdout;
        let mut reports = Vec::with_capacity(ids.len());
        for id in ids {
            let block = Block::parse("status", "status", rest)?;
            let report = Self::from_block(&block)?;
            if report.id != id.as_ref() {
                return Err(block.malformed(format!(
                    "expected the status of {}, got {}",
                    id.as_ref(),
                    report.id
                )));
            }
            rest = block.payload;
            reports.push(report);
        }
        if !rest.is_empty() {
            return Err(WrapperError::Malformed {
                verb: "status",
                detail: format!(
                    "{} unexpected bytes after the {} status blocks",
                    rest.len(),
                    ids.len()
                ),
            });
        }
        Ok(reports)
    }

    pub(super) fn from_block(b: &Block<'_>) -> Result<Self> {
        let state_s = b.required("state")?;
        let state = MarkerState::from_wire(state_s)
            .ok_or_else(|| b.malformed(format!("unknown state {state_s:?}")))?;
        let id = b.required("id")?;
        validate_execution_id(id).map_err(|_| b.malformed(format!("bad id {id:?}")))?;
        let launched = match b.get("launched").unwrap_or("") {
            "" => None,
            "yes" => Some(Launched::Yes),
            "no" => Some(Launched::No),
            "unknown" => Some(Launched::Unknown),
            other => return Err(b.malformed(format!("bad `launched` value {other:?}"))),
        };
        let yes_no = |key: &str| -> Result<Option<bool>> {
            match b.get(key).unwrap_or("") {
                "" => Ok(None),
                "yes" => Ok(Some(true)),
                "no" => Ok(Some(false)),
                other => Err(b.malformed(format!("bad `{key}` value {other:?}"))),
            }
        };
        Ok(Self {
            id: id.to_owned(),
            state,
            launched,
            created_ms: b.opt_num("created_ms")?,
            started_ms: b.opt_num("started_ms")?,
            finished_ms: b.opt_num("finished_ms")?,
            supervisor_pid: b.opt_num("supervisor_pid")?,
            command_pid: b.opt_num("command_pid")?,
            wait_status: b.opt_num("wait_status")?,
            exit_code: b.opt_num("exit_code")?,
            signal: b.opt_num("signal")?,
            timeout_s: b.opt_num("timeout_s")?,
            cancel_requested: yes_no("cancel_requested")?.unwrap_or(false),
            command_alive: yes_no("command_alive")?,
            error: b.get("error").filter(|e| !e.is_empty()).map(str::to_owned),
            stdout_bytes: b.opt_num("stdout_bytes")?.unwrap_or(0),
            stderr_bytes: b.opt_num("stderr_bytes")?.unwrap_or(0),
        })
    }
}

/// `start` or `run` met an existing marker (exit 65): nothing was started,
/// and this is the status of the execution that already holds the ID.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StartRefused {
    /// The existing execution.
    pub existing: StatusReport,
}

impl StartRefused {
    pub(super) fn parse(verb: &'static str, reply: &WrapperReply) -> Result<Self> {
        let block = Block::parse(verb, "status", &reply.stdout)?;
        block.no_payload()?;
        Ok(Self {
            existing: StatusReport::from_block(&block)?,
        })
    }
}

/// The reply to `start`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StartOutcome {
    /// The execution was started: usually `running`, or already finished.
    Started(StatusReport),
    /// The ID was already taken; nothing ran.
    Refused(StartRefused),
}

impl StartOutcome {
    /// Parses a reply to `start`.
    pub fn parse(reply: &WrapperReply) -> Result<Self> {
        if reply.exit_status == exit_status::ALREADY_STARTED {
            return Ok(Self::Refused(StartRefused::parse("start", reply)?));
        }
        reply.check("start")?;
        let block = Block::parse("start", "status", &reply.stdout)?;
        block.no_payload()?;
        Ok(Self::Started(StatusReport::from_block(&block)?))
    }
}

/// News of one execution from `watch`: its streams' sizes now, and whether it has ended (its
/// exit record is there, so the sizes are final).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WatchReport {
    /// The execution ID.
    pub id: String,
    /// Bytes of stdout now.
    pub stdout_bytes: u64,
    /// Bytes of stderr now.
    pub stderr_bytes: u64,
    /// The execution has ended.
    pub ended: bool,
}

impl WatchReport {
    /// Parses a reply to `watch` of the executions `ids`: a block for each one with news, in
    /// the order asked, none twice (no block at all when the wait ran out without news).
    pub fn parse_many<S: AsRef<str>>(reply: &WrapperReply, ids: &[S]) -> Result<Vec<Self>> {
        reply.check("watch")?;
        let mut rest: &[u8] = &reply.stdout;
        let mut reports: Vec<Self> = Vec::new();
        let mut next = 0;
        while !rest.is_empty() {
            let block = Block::parse("watch", "watch", rest)?;
            let id = block.required("id")?;
            // In the order asked, so each id is looked for after the last one's place.
            let Some(at) = ids[next..].iter().position(|i| i.as_ref() == id) else {
                return Err(block.malformed(format!(
                    "news of {id:?}, which was not asked for (or came twice or out of order)"
                )));
            };
            next += at + 1;
            let ended = match block.required("ended")? {
                "0" => false,
                "1" => true,
                other => return Err(block.malformed(format!("bad `ended` value {other:?}"))),
            };
            reports.push(Self {
                id: id.to_owned(),
                stdout_bytes: block.num("stdout_bytes")?,
                stderr_bytes: block.num("stderr_bytes")?,
                ended,
            });
            rest = block.payload;
        }
        Ok(reports)
    }
}
