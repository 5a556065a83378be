//! The remote wrapper protocol: command lines to send, replies to parse.
//!
//! On every host, Waymark runs its commands through one POSIX `sh` script,
//! [`WRAPPER_SCRIPT`] (`remote-scripts/wrap.sh`, specified in
//! `remote-scripts/PROTOCOL.md`). The script keeps a durable marker per
//! execution ID, `<remote_dir>/exec/<id>` (claimed by an exclusive create) and
//! its files `<id>.<name>` beside it, refuses a second start of
//! the same ID, runs the command detached from the SSH session, and records
//! how it ended.
//!
//! This module is pure: it builds the exact strings to send as SSH `exec`
//! requests ([`RemoteWrapper`]) and turns the bytes and exit status that come
//! back into typed reports ([`WrapperReply`] and the `parse` functions). It
//! does no I/O and knows nothing of SSH.
//!
//! Here: the script, quoting, ID checks and errors. `command` builds command lines
//! ([`RemoteWrapper`], [`StartOptions`], [`RemoteDir`]); `reply` holds [`WrapperReply`] and the
//! block format every reply is written in; `status` parses marker states and `status`/`start`
//! replies; `report` parses `run`/`wait`, `output`, `gc`, `version` and install replies.
//!
//! ```
//! use waymark_ssh::wrapper::{RemoteWrapper, StartOptions, RunOutcome, WrapperReply};
//!
//! let wrapper = RemoteWrapper::default();
//! let line = wrapper
//!     .run("act_01J0000000000000000000000A", &StartOptions::default(), &["uname", "-a"])
//!     .unwrap();
//! assert!(line.contains(" run act_01J0000000000000000000000A -- uname -a"));
//!
//! // What the host answered (exit status 0, this stdout):
//! let stdout = b"waymark-wrap/1 run\nid=act_01J0000000000000000000000A\nstate=completed\n\
//!     exit_code=0\nstdout_bytes=6\nstderr_bytes=0\nstdout_inline=6\nstderr_inline=0\n\nLinux\n";
//! let reply = WrapperReply { exit_status: 0, stdout: stdout.to_vec(), stderr: Vec::new() };
//! match RunOutcome::parse(&reply).unwrap() {
//!     RunOutcome::Ran(report) => assert_eq!(report.stdout.inline(), Some(&b"Linux\n"[..])),
//!     RunOutcome::Refused(_) => unreachable!("a new id is never refused"),
//! }
//! ```

use sha2::{Digest, Sha256};

/// The wrapper script, byte for byte as it is installed on hosts.
pub const WRAPPER_SCRIPT: &str = include_str!("../../../../remote-scripts/wrap.sh");

/// The protocol version spoken by [`WRAPPER_SCRIPT`]: every reply starts with
/// `waymark-wrap/<version> <kind>`.
pub const PROTOCOL_VERSION: u32 = 1;

/// The longest a `watch` waits on the host for news.
pub const WATCH_MAX: std::time::Duration = std::time::Duration::from_secs(60);

/// Where the wrapper lives on a host unless configured otherwise.
pub const DEFAULT_REMOTE_DIR: &str = "~/.waymark";

/// Largest stream (in bytes) that `run` and `wait` return inline by default.
pub const DEFAULT_INLINE_MAX: u64 = 64 * 1024;

/// Exit statuses of the wrapper and of the command lines built here.
pub mod exit_status {
    /// The request was carried out; the reply is on stdout.
    pub const OK: u32 = 0;
    /// The request was malformed; nothing was changed on the host.
    pub const USAGE: u32 = 64;
    /// `start`/`run`: the marker already exists; stdout holds its status.
    pub const ALREADY_STARTED: u32 = 65;
    /// `wait`/`output`/`cancel`: no marker for this execution ID.
    pub const UNKNOWN_ID: u32 = 66;
    /// The wrapper script is not installed at the expected path.
    pub const NOT_INSTALLED: u32 = 69;
    /// The wrapper failed on the host (disk full, missing tool, ...).
    pub const INTERNAL: u32 = 70;
    /// Install: the wrapper could not be written into place.
    pub const INSTALL_FAILED: u32 = 73;
    /// Install: what arrived on stdin does not hash to the expected value.
    pub const INSTALL_HASH_MISMATCH: u32 = 74;
    /// Install: the host holds markers of another ledger; nothing was installed or recorded.
    pub const OTHER_LEDGER: u32 = 75;
}

/// Everything that can go wrong building a command line or reading a reply.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WrapperError {
    /// A value would have to carry a NUL byte, which no command line can.
    #[error("{what} contains a NUL byte, which no remote command line can carry")]
    Nul {
        /// Which value (e.g. "argument 2", "cwd").
        what: String,
    },
    /// Not an execution ID the wrapper accepts.
    #[error(
        "invalid execution id {id:?}: expected `act_` followed by 26 uppercase Crockford base32 characters"
    )]
    InvalidExecutionId {
        /// The rejected value.
        id: String,
    },
    /// An environment variable name the wrapper would refuse.
    #[error("invalid environment variable name {name:?}: use letters, digits and `_`, not starting with a digit")]
    InvalidEnvName {
        /// The rejected name.
        name: String,
    },
    /// A remote dir the command line cannot express.
    #[error("invalid remote dir {dir:?}: {reason}")]
    InvalidRemoteDir {
        /// The rejected value.
        dir: String,
        /// Why.
        reason: &'static str,
    },
    /// An option value out of range (a zero timeout, an empty cwd, ...).
    #[error("invalid {option}: {reason}")]
    InvalidOption {
        /// The option, as the wrapper names it.
        option: &'static str,
        /// Why.
        reason: &'static str,
    },
    /// The command to run has no `argv[0]`.
    #[error("empty command: an execution needs at least a program name")]
    EmptyArgv,
    /// The reply does not follow the protocol (truncated, garbled, another version).
    #[error("malformed wrapper reply to `{verb}`: {detail}")]
    Malformed {
        /// The verb whose reply this was.
        verb: &'static str,
        /// What is wrong with it.
        detail: String,
    },
    /// The wrapper rejected the request as malformed (exit 64).
    #[error("the wrapper rejected the `{verb}` request (exit 64): {stderr}")]
    Usage {
        /// The verb.
        verb: &'static str,
        /// The wrapper's explanation.
        stderr: String,
    },
    /// The host has no marker for this execution ID (exit 66).
    #[error("the host has no marker for this execution id (exit 66): {stderr}")]
    UnknownExecution {
        /// The wrapper's explanation.
        stderr: String,
    },
    /// The wrapper is not installed on the host (exit 69): install it and retry.
    #[error("the wrapper is not installed on the host (exit 69); install it and retry")]
    NotInstalled,
    /// The wrapper failed on the host (exit 70).
    #[error("the wrapper failed on the host during `{verb}` (exit 70): {stderr}")]
    Internal {
        /// The verb.
        verb: &'static str,
        /// The wrapper's explanation.
        stderr: String,
    },
    /// The install command received a script whose sha256 is not the expected one.
    #[error("wrapper install: sha256 mismatch, the script was corrupted in transit: {stderr}")]
    InstallHashMismatch {
        /// The install command's explanation.
        stderr: String,
    },
    /// The install command could not write the script into place (exit 73).
    #[error("wrapper install: could not write the script into place (exit 73): {stderr}")]
    InstallFailed {
        /// The install command's explanation.
        stderr: String,
    },
    /// The host holds markers of another ledger (exit 75): a ledger that does not know them
    /// could run their executions again.
    #[error("the host holds markers of another ledger ({ledger})")]
    OtherLedger {
        /// The identity recorded on the host.
        ledger: String,
    },
    /// The wrapper or install command exited with a status the protocol does not define.
    #[error("`{verb}` exited with status {status}: {stderr}")]
    UnexpectedExit {
        /// The verb (or "install").
        verb: &'static str,
        /// The exit status.
        status: u32,
        /// What the remote side printed on stderr.
        stderr: String,
    },
}

type Result<T, E = WrapperError> = std::result::Result<T, E>;

/// Hex sha256 of [`WRAPPER_SCRIPT`].
pub fn wrapper_sha256() -> String {
    hex::encode(Sha256::digest(WRAPPER_SCRIPT.as_bytes()))
}

/// File name of the installed wrapper: `wrap-<first 16 hex of its sha256>`.
///
/// The name changes with every edit of the script, so hosts never run a
/// wrapper that disagrees with the client about the protocol.
pub fn wrapper_name() -> String {
    format!("wrap-{}", &wrapper_sha256()[..16])
}

/// Quotes `arg` as one POSIX shell word: the shell hands it to the program
/// unchanged, whatever it contains (quotes, `$()`, `;`, globs, newlines).
///
/// Words made only of `A-Z a-z 0-9 _ . / : , + @ % -` are left bare; others
/// are single-quoted, each `'` written as `'\''`. NUL is the one byte a
/// command line cannot carry, and is refused.
pub fn shell_quote(arg: &str) -> Result<String> {
    if arg.contains('\0') {
        return Err(WrapperError::Nul {
            what: format!("{arg:?}"),
        });
    }
    let bare = !arg.is_empty()
        && arg
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"_./:,+@%-".contains(&b));
    if bare {
        return Ok(arg.to_owned());
    }
    let mut out = String::with_capacity(arg.len() + 2);
    out.push('\'');
    for c in arg.chars() {
        if c == '\'' {
            out.push_str("'\\''");
        } else {
            out.push(c);
        }
    }
    out.push('\'');
    Ok(out)
}

/// Checks that `id` is an execution ID the wrapper accepts: `act_` and 26
/// characters of uppercase Crockford base32 (`0-9A-Z` without `I L O U`).
pub fn validate_execution_id(id: &str) -> Result<()> {
    let ok = id.len() == 30
        && id.starts_with("act_")
        && id[4..]
            .bytes()
            .all(|b| b.is_ascii_digit() || (b.is_ascii_uppercase() && !b"ILOU".contains(&b)));
    if ok {
        Ok(())
    } else {
        Err(WrapperError::InvalidExecutionId { id: id.to_owned() })
    }
}

fn validate_env_name(name: &str) -> Result<()> {
    let ok = name
        .bytes()
        .next()
        .is_some_and(|b| b.is_ascii_alphabetic() || b == b'_')
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_');
    if ok {
        Ok(())
    } else {
        Err(WrapperError::InvalidEnvName {
            name: name.to_owned(),
        })
    }
}

mod command;
mod reply;
mod report;
mod serve;
mod status;
#[cfg(test)]
mod tests;

pub use command::{RemoteDir, RemoteWrapper, StartOptions, Stream};
pub use reply::WrapperReply;
pub use report::{
    GcReport, InlineOutput, InstallOutcome, OutputChunk, RunOutcome, RunReport, VersionReport,
};
pub use serve::{parse_serve_reply, parse_serve_reply_at, serve_quote, ServeParse, SERVE_READY};
pub use status::{Launched, MarkerState, StartOutcome, StartRefused, StatusReport, WatchReport};
