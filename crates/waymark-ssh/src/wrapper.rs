//! The remote wrapper protocol: command lines to send, replies to parse.
//!
//! On every host, Waymark runs its commands through one POSIX `sh` script,
//! [`WRAPPER_SCRIPT`] (`remote-scripts/wrap.sh`, specified in
//! `remote-scripts/PROTOCOL.md`). The script keeps a durable marker per
//! execution ID under `<remote_dir>/exec/<id>/`, refuses a second start of
//! the same ID, runs the command detached from the SSH session, and records
//! how it ended.
//!
//! This module is pure: it builds the exact strings to send as SSH `exec`
//! requests ([`RemoteWrapper`]) and turns the bytes and exit status that come
//! back into typed reports ([`WrapperReply`] and the `parse` functions). It
//! does no I/O and knows nothing of SSH.
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

use std::fmt::{self, Write as _};
use std::time::Duration;

use sha2::{Digest, Sha256};

/// The wrapper script, byte for byte as it is installed on hosts.
pub const WRAPPER_SCRIPT: &str = include_str!("../../../remote-scripts/wrap.sh");

/// The protocol version spoken by [`WRAPPER_SCRIPT`]: every reply starts with
/// `waymark-wrap/<version> <kind>`.
pub const PROTOCOL_VERSION: u32 = 1;

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
    /// The command to run has no argv[0].
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

/// The directory that holds `bin/` and `exec/` on a host.
///
/// Absolute (`/srv/waymark`), relative to the login directory (`.waymark`),
/// or under the remote user's home (`~` or `~/...`: expanded by the remote
/// shell through `$HOME`, so it works whatever the login shell quotes).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RemoteDir(String);

impl RemoteDir {
    /// Validates `dir`; trailing slashes are dropped.
    pub fn new(dir: &str) -> Result<Self> {
        let invalid = |reason| WrapperError::InvalidRemoteDir {
            dir: dir.to_owned(),
            reason,
        };
        if dir.contains('\0') {
            return Err(invalid("contains a NUL byte"));
        }
        let trimmed = dir.trim_end_matches('/');
        let trimmed = if trimmed.is_empty() && dir.starts_with('/') {
            "/"
        } else {
            trimmed
        };
        if trimmed.is_empty() {
            return Err(invalid("is empty"));
        }
        if trimmed.starts_with('~') && trimmed != "~" && !trimmed.starts_with("~/") {
            return Err(invalid(
                "only `~` and `~/...` are expanded; write the path out",
            ));
        }
        Ok(Self(trimmed.to_owned()))
    }

    /// The directory as configured (`~/.waymark`).
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// One shell word naming `<dir><suffix>` (`suffix` starts with `/`).
    fn shell_word(&self, suffix: &str) -> String {
        let quoted = |s: &str| shell_quote(s).expect("validated: no NUL");
        match self.0.strip_prefix('~') {
            Some(rest) => format!("\"$HOME\"{}", quoted(&format!("{rest}{suffix}"))),
            None if self.0 == "/" => quoted(suffix),
            None => quoted(&format!("{}{suffix}", self.0)),
        }
    }
}

impl Default for RemoteDir {
    fn default() -> Self {
        Self(DEFAULT_REMOTE_DIR.to_owned())
    }
}

impl fmt::Display for RemoteDir {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// Which output stream of an execution.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Stream {
    /// The command's standard output.
    Stdout,
    /// The command's standard error.
    Stderr,
}

impl Stream {
    /// The name used on the wire.
    pub fn as_str(self) -> &'static str {
        match self {
            Stream::Stdout => "stdout",
            Stream::Stderr => "stderr",
        }
    }
}

/// How to start an execution. `Default` runs the command with no timeout, in
/// the login directory, with stdin from `/dev/null`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StartOptions {
    /// Enforced on the host, independently of any SSH session: the command's
    /// process group gets SIGTERM, then SIGKILL after `kill_grace`. Rounded
    /// up to whole seconds; at least one second.
    pub timeout: Option<Duration>,
    /// Time between SIGTERM and SIGKILL on timeout (default 5 s).
    pub kill_grace: Option<Duration>,
    /// Working directory of the command (relative paths start from the login directory).
    pub cwd: Option<String>,
    /// Extra environment variables for the command.
    pub env: Vec<(String, String)>,
    /// Environment variables whose values must never be on a command line or in the marker
    /// (secrets): sent first on the channel's stdin ([`Wrapper::stdin_prefix`]), announced by
    /// `--secret-env N`. A value may not hold a newline or NUL.
    pub secret_env: Vec<(String, String)>,
    /// The command reads the bytes sent on the SSH channel's stdin (the
    /// wrapper stores them in the marker first); otherwise `/dev/null`.
    pub stdin: bool,
    /// `run` only: largest stream returned inline (default 64 KiB); larger
    /// streams are fetched with `output`.
    pub inline_max: Option<u64>,
}

fn whole_seconds(d: Duration, option: &'static str, at_least_one: bool) -> Result<u64> {
    let secs = d.as_secs() + u64::from(d.subsec_nanos() > 0);
    if at_least_one && secs == 0 {
        return Err(WrapperError::InvalidOption {
            option,
            reason: "must be at least one second",
        });
    }
    Ok(secs)
}

/// The wrapper as installed on one host: builds the command lines to send as
/// SSH `exec` requests. Every argument is quoted into a single word; nothing a
/// caller passes can become shell syntax.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RemoteWrapper {
    remote_dir: RemoteDir,
    interpreter: Vec<String>,
}

impl Default for RemoteWrapper {
    fn default() -> Self {
        Self::new(RemoteDir::default())
    }
}

impl RemoteWrapper {
    /// The wrapper under `remote_dir`, run by the host's `sh`.
    pub fn new(remote_dir: RemoteDir) -> Self {
        Self {
            remote_dir,
            interpreter: vec!["sh".to_owned()],
        }
    }

    /// Runs the wrapper (and its supervisors) with another POSIX shell, given
    /// as words: `["busybox", "sh"]`, `["dash"]`.
    pub fn with_interpreter<S: AsRef<str>>(mut self, words: &[S]) -> Result<Self> {
        if words.is_empty() {
            return Err(WrapperError::InvalidOption {
                option: "interpreter",
                reason: "needs at least one word",
            });
        }
        for w in words {
            shell_quote(w.as_ref())?;
        }
        self.interpreter = words.iter().map(|w| w.as_ref().to_owned()).collect();
        Ok(self)
    }

    /// The remote dir this wrapper lives in.
    pub fn remote_dir(&self) -> &RemoteDir {
        &self.remote_dir
    }

    /// Path of the installed script, as configured (`~/.waymark/bin/wrap-…`).
    pub fn script_path(&self) -> String {
        format!("{}/bin/{}", self.remote_dir, wrapper_name())
    }

    fn script_word(&self) -> String {
        self.remote_dir
            .shell_word(&format!("/bin/{}", wrapper_name()))
    }

    /// The command line that runs `VERB ARGS...` through the wrapper.
    ///
    /// It works whether the login shell is sh, dash or bash, and exits with
    /// [`exit_status::NOT_INSTALLED`] when the script is missing.
    pub fn command_line<S: AsRef<str>>(&self, verb: &str, args: &[S]) -> Result<String> {
        let script = self.script_word();
        let mut line = format!("test -f {script} || exit {}; ", exit_status::NOT_INSTALLED);
        if self.interpreter != ["sh"] {
            let joined = self.interpreter.join(" ");
            write!(line, "WAYMARK_SH={} ", shell_quote(&joined)?).expect("write to String");
        }
        line.push_str("exec");
        for w in &self.interpreter {
            line.push(' ');
            line.push_str(&shell_quote(w)?);
        }
        line.push(' ');
        line.push_str(&script);
        line.push(' ');
        line.push_str(&shell_quote(verb)?);
        for (i, a) in args.iter().enumerate() {
            let a = a.as_ref();
            if a.contains('\0') {
                return Err(WrapperError::Nul {
                    what: format!("argument {i}"),
                });
            }
            line.push(' ');
            line.push_str(&shell_quote(a)?);
        }
        Ok(line)
    }

    /// The command line that installs [`WRAPPER_SCRIPT`], sent on its stdin.
    ///
    /// It creates `<remote_dir>/bin` (mode 0700), writes a unique temporary
    /// file, checks its sha256, and renames it into place, so concurrent
    /// installs are safe and a partial upload never becomes the wrapper. When
    /// the right script is already there it only drains stdin. Parse the
    /// result with [`InstallOutcome::parse`].
    pub fn install_command(&self) -> String {
        let bin = self.remote_dir.shell_word("/bin");
        let name = wrapper_name();
        let hash = wrapper_sha256();
        format!(
            "umask 077; d={bin}; f=\"$d/{name}\"; h={hash}; \
             if [ -f \"$f\" ]; then s=$(sha256sum <\"$f\"); \
             if [ \"${{s%% *}}\" = \"$h\" ]; then cat >/dev/null; echo \"waymark-install/1 present $f\"; exit 0; fi; fi; \
             mkdir -p \"$d\" || exit {failed}; t=\"$d/.{name}.$$.tmp\"; \
             if ! cat >\"$t\"; then rm -f \"$t\"; exit {failed}; fi; \
             s=$(sha256sum <\"$t\"); s=${{s%% *}}; \
             if [ \"$s\" != \"$h\" ]; then rm -f \"$t\"; \
             echo \"waymark-install: sha256 mismatch for $f: expected $h, received $s\" >&2; exit {mismatch}; fi; \
             if ! chmod 0700 \"$t\" || ! mv -f \"$t\" \"$f\"; then rm -f \"$t\"; exit {failed}; fi; \
             echo \"waymark-install/1 installed $f\"",
            failed = exit_status::INSTALL_FAILED,
            mismatch = exit_status::INSTALL_HASH_MISMATCH,
        )
    }

    /// What must come first on the channel's stdin for `opts`: the `--secret-env` block of
    /// `NAME=VALUE` lines (empty without secret variables). The command's own stdin follows.
    pub fn stdin_prefix(opts: &StartOptions) -> Result<Vec<u8>> {
        let mut block = Vec::new();
        for (k, v) in &opts.secret_env {
            validate_env_name(k)?;
            if v.contains('\0') || v.contains('\n') {
                return Err(WrapperError::InvalidOption {
                    option: "secret environment variable",
                    reason: "a value cannot hold a newline or NUL",
                });
            }
            block.extend_from_slice(format!("{k}={v}\n").as_bytes());
        }
        Ok(block)
    }

    fn start_args<S: AsRef<str>>(
        id: &str,
        opts: &StartOptions,
        argv: &[S],
        run: bool,
    ) -> Result<Vec<String>> {
        validate_execution_id(id)?;
        if argv.is_empty() {
            return Err(WrapperError::EmptyArgv);
        }
        let mut args = vec![id.to_owned()];
        if let Some(t) = opts.timeout {
            args.push("--timeout".into());
            args.push(whole_seconds(t, "timeout", true)?.to_string());
        }
        if let Some(g) = opts.kill_grace {
            args.push("--grace".into());
            args.push(whole_seconds(g, "kill grace", false)?.to_string());
        }
        if let Some(cwd) = &opts.cwd {
            if cwd.is_empty() {
                return Err(WrapperError::InvalidOption {
                    option: "cwd",
                    reason: "must not be empty",
                });
            }
            if cwd.contains('\0') {
                return Err(WrapperError::Nul { what: "cwd".into() });
            }
            args.push("--cwd".into());
            args.push(cwd.clone());
        }
        if opts.stdin {
            args.push("--stdin".into());
        }
        for (k, v) in &opts.env {
            validate_env_name(k)?;
            if v.contains('\0') {
                return Err(WrapperError::Nul {
                    what: format!("environment variable {k}"),
                });
            }
            args.push("--env".into());
            args.push(format!("{k}={v}"));
        }
        let secret = Self::stdin_prefix(opts)?;
        if !secret.is_empty() {
            args.push("--secret-env".into());
            args.push(secret.len().to_string());
        }
        if run {
            if let Some(max) = opts.inline_max {
                args.push("--inline-max".into());
                args.push(max.to_string());
            }
        }
        args.push("--".into());
        args.extend(argv.iter().map(|a| a.as_ref().to_owned()));
        Ok(args)
    }

    /// `start`: create the marker and launch `argv` detached; the reply comes
    /// once the command is recorded. Parse with [`StartOutcome::parse`].
    /// (`opts.inline_max` does not apply.)
    pub fn start<S: AsRef<str>>(
        &self,
        id: &str,
        opts: &StartOptions,
        argv: &[S],
    ) -> Result<String> {
        self.command_line("start", &Self::start_args(id, opts, argv, false)?)
    }

    /// `run`: `start`, wait for the end, and return status and small outputs
    /// in one round trip. Parse with [`RunOutcome::parse`].
    pub fn run<S: AsRef<str>>(&self, id: &str, opts: &StartOptions, argv: &[S]) -> Result<String> {
        self.command_line("run", &Self::start_args(id, opts, argv, true)?)
    }

    /// `wait`: wait for an existing execution to end, then reply as `run`
    /// does. The way back to a `run` whose connection dropped. Parse with
    /// [`RunReport::parse`].
    pub fn wait(&self, id: &str, inline_max: Option<u64>) -> Result<String> {
        validate_execution_id(id)?;
        let mut args = vec![id.to_owned()];
        if let Some(max) = inline_max {
            args.push("--inline-max".into());
            args.push(max.to_string());
        }
        self.command_line("wait", &args)
    }

    /// `status`: the marker's state. Parse with [`StatusReport::parse`].
    pub fn status(&self, id: &str) -> Result<String> {
        validate_execution_id(id)?;
        self.command_line("status", &[id])
    }

    /// `status` of many IDs in one invocation: one status block per ID, in the order given.
    /// Parse with [`StatusReport::parse_many`]. At least one ID; keep batches to a few
    /// hundred so the command line stays small.
    pub fn status_many<S: AsRef<str>>(&self, ids: &[S]) -> Result<String> {
        if ids.is_empty() {
            return Err(WrapperError::InvalidOption {
                option: "status",
                reason: "at least one execution id is needed",
            });
        }
        for id in ids {
            validate_execution_id(id.as_ref())?;
        }
        self.command_line("status", ids)
    }

    /// `output`: up to `max` bytes of `stream` from byte `offset`. Parse with
    /// [`OutputChunk::parse`].
    pub fn output(&self, id: &str, stream: Stream, offset: u64, max: u64) -> Result<String> {
        validate_execution_id(id)?;
        self.command_line(
            "output",
            &[id, stream.as_str(), &offset.to_string(), &max.to_string()],
        )
    }

    /// `cancel`: SIGTERM the command's process group, SIGKILL after `grace`
    /// (default 5 s); replies with the final status. Parse with
    /// [`StatusReport::parse`].
    pub fn cancel(&self, id: &str, grace: Option<Duration>) -> Result<String> {
        validate_execution_id(id)?;
        let mut args = vec![id.to_owned()];
        if let Some(g) = grace {
            args.push(whole_seconds(g, "cancel grace", false)?.to_string());
        }
        self.command_line("cancel", &args)
    }

    /// `gc`: remove finished markers (completed, timed out, cancelled) that
    /// finished more than `older_than` ago. Parse with [`GcReport::parse`].
    ///
    /// A removed marker no longer refuses its ID: collect only executions
    /// whose result the ledger already holds.
    pub fn gc(&self, older_than: Duration) -> Result<String> {
        self.command_line("gc", &["--older-than", &older_than.as_secs().to_string()])
    }

    /// `version`: the protocol version the installed wrapper speaks. Parse
    /// with [`VersionReport::parse`].
    pub fn version(&self) -> Result<String> {
        self.command_line::<&str>("version", &[])
    }
}

// ------------------------------------------------------------------ replies

/// What came back from one command line: exit status and both streams.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct WrapperReply {
    /// The remote command's exit status.
    pub exit_status: u32,
    /// Everything it wrote on stdout.
    pub stdout: Vec<u8>,
    /// Everything it wrote on stderr.
    pub stderr: Vec<u8>,
}

impl WrapperReply {
    fn stderr_text(&self) -> String {
        String::from_utf8_lossy(&self.stderr).trim().to_owned()
    }

    /// Maps the exit statuses every verb shares to errors.
    fn check(&self, verb: &'static str) -> Result<()> {
        let stderr = self.stderr_text();
        match self.exit_status {
            exit_status::OK => Ok(()),
            exit_status::USAGE => Err(WrapperError::Usage { verb, stderr }),
            exit_status::UNKNOWN_ID => Err(WrapperError::UnknownExecution { stderr }),
            exit_status::NOT_INSTALLED => Err(WrapperError::NotInstalled),
            exit_status::INTERNAL => Err(WrapperError::Internal { verb, stderr }),
            status => Err(WrapperError::UnexpectedExit {
                verb,
                status,
                stderr,
            }),
        }
    }
}

/// One reply block: `waymark-wrap/1 KIND`, `key=value` lines, a blank line,
/// then the payload.
struct Block<'a> {
    verb: &'static str,
    fields: Vec<(&'a str, &'a str)>,
    payload: &'a [u8],
}

impl<'a> Block<'a> {
    fn parse(verb: &'static str, kind: &str, bytes: &'a [u8]) -> Result<Self> {
        let malformed = |detail: String| WrapperError::Malformed { verb, detail };
        let mut rest = bytes;
        let mut next_line = |what: &str| -> Result<&'a str> {
            let end = rest
                .iter()
                .position(|&b| b == b'\n')
                .ok_or_else(|| malformed(format!("truncated: no end of line in the {what}")))?;
            let line = std::str::from_utf8(&rest[..end])
                .map_err(|_| malformed(format!("the {what} is not UTF-8")))?;
            rest = &rest[end + 1..];
            Ok(line)
        };
        let first = next_line("first line")?;
        let (version, got_kind) = first
            .strip_prefix("waymark-wrap/")
            .and_then(|r| r.split_once(' '))
            .ok_or_else(|| malformed(format!("not a wrapper reply: {first:?}")))?;
        if version != PROTOCOL_VERSION.to_string() {
            return Err(malformed(format!(
                "protocol version {version:?}, this client speaks {PROTOCOL_VERSION}"
            )));
        }
        if got_kind != kind {
            return Err(malformed(format!(
                "expected a `{kind}` block, got `{got_kind}`"
            )));
        }
        let mut fields = Vec::new();
        loop {
            let line = next_line("header")?;
            if line.is_empty() {
                break;
            }
            let (k, v) = line
                .split_once('=')
                .ok_or_else(|| malformed(format!("header line without `=`: {line:?}")))?;
            if fields.iter().any(|&(seen, _)| seen == k) {
                return Err(malformed(format!("field `{k}` appears twice")));
            }
            fields.push((k, v));
        }
        Ok(Self {
            verb,
            fields,
            payload: rest,
        })
    }

    fn malformed(&self, detail: String) -> WrapperError {
        WrapperError::Malformed {
            verb: self.verb,
            detail,
        }
    }

    fn get(&self, key: &str) -> Option<&'a str> {
        self.fields
            .iter()
            .find(|&&(k, _)| k == key)
            .map(|&(_, v)| v)
    }

    fn required(&self, key: &str) -> Result<&'a str> {
        self.get(key)
            .ok_or_else(|| self.malformed(format!("missing field `{key}`")))
    }

    /// A number that may be empty (unknown) or absent.
    fn opt_num<T: std::str::FromStr>(&self, key: &str) -> Result<Option<T>> {
        match self.get(key) {
            None | Some("") => Ok(None),
            Some(v) => v
                .parse()
                .map(Some)
                .map_err(|_| self.malformed(format!("field `{key}` is not a number: {v:?}"))),
        }
    }

    fn num<T: std::str::FromStr>(&self, key: &str) -> Result<T> {
        self.opt_num(key)?
            .ok_or_else(|| self.malformed(format!("missing field `{key}`")))
    }

    fn no_payload(&self) -> Result<()> {
        if self.payload.is_empty() {
            Ok(())
        } else {
            Err(self.malformed(format!(
                "{} unexpected bytes after the header",
                self.payload.len()
            )))
        }
    }
}

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

    fn from_block(b: &Block<'_>) -> Result<Self> {
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
    fn parse(verb: &'static str, reply: &WrapperReply) -> Result<Self> {
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

/// One stream in a `run`/`wait` reply.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum InlineOutput {
    /// The whole stream, inline.
    Inline(Vec<u8>),
    /// Too large to inline: fetch it with `output`, by offset.
    Fetch {
        /// Its size when the reply was made.
        size: u64,
    },
}

impl InlineOutput {
    /// The bytes, when they came inline.
    pub fn inline(&self) -> Option<&[u8]> {
        match self {
            InlineOutput::Inline(bytes) => Some(bytes),
            InlineOutput::Fetch { .. } => None,
        }
    }
}

/// The reply to `run` or `wait`: the final status and the outputs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunReport {
    /// The status once the supervisor had ended (finished or interrupted).
    pub status: StatusReport,
    /// The command's stdout.
    pub stdout: InlineOutput,
    /// The command's stderr.
    pub stderr: InlineOutput,
}

impl RunReport {
    /// Parses a reply to `wait` (exit 66 if the ID is unknown).
    pub fn parse(reply: &WrapperReply) -> Result<Self> {
        reply.check("wait")?;
        Self::parse_block("wait", &reply.stdout)
    }

    fn parse_block(verb: &'static str, stdout: &[u8]) -> Result<Self> {
        let block = Block::parse(verb, "run", stdout)?;
        let status = StatusReport::from_block(&block)?;
        let inline_len = |key: &str, size: u64| -> Result<Option<usize>> {
            match block.required(key)? {
                "-" => Ok(None),
                v => {
                    let n: u64 = v.parse().map_err(|_| {
                        block.malformed(format!("field `{key}` is not a number: {v:?}"))
                    })?;
                    if n != size {
                        return Err(block
                            .malformed(format!("`{key}` is {n} but the stream has {size} bytes")));
                    }
                    usize::try_from(n)
                        .map(Some)
                        .map_err(|_| block.malformed(format!("`{key}` too large")))
                }
            }
        };
        let out_len = inline_len("stdout_inline", status.stdout_bytes)?;
        let err_len = inline_len("stderr_inline", status.stderr_bytes)?;
        let want = out_len.unwrap_or(0) + err_len.unwrap_or(0);
        if block.payload.len() != want {
            return Err(block.malformed(format!(
                "expected {want} bytes of inline output, got {}",
                block.payload.len()
            )));
        }
        let (out, err) = block.payload.split_at(out_len.unwrap_or(0));
        let stream = |len: Option<usize>, bytes: &[u8], size: u64| match len {
            Some(_) => InlineOutput::Inline(bytes.to_vec()),
            None => InlineOutput::Fetch { size },
        };
        Ok(Self {
            stdout: stream(out_len, out, status.stdout_bytes),
            stderr: stream(err_len, err, status.stderr_bytes),
            status,
        })
    }
}

/// The reply to `run`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RunOutcome {
    /// The execution ran (or was interrupted): here is how it ended.
    Ran(RunReport),
    /// The ID was already taken; nothing ran. Use `wait` to attach to it.
    Refused(StartRefused),
}

impl RunOutcome {
    /// Parses a reply to `run`.
    pub fn parse(reply: &WrapperReply) -> Result<Self> {
        if reply.exit_status == exit_status::ALREADY_STARTED {
            return Ok(Self::Refused(StartRefused::parse("run", reply)?));
        }
        reply.check("run")?;
        Ok(Self::Ran(RunReport::parse_block("run", &reply.stdout)?))
    }
}

/// The reply to `output`: a byte range of one stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutputChunk {
    /// The execution ID.
    pub id: String,
    /// Which stream.
    pub stream: Stream,
    /// The stream's size when the chunk was read.
    pub size: u64,
    /// Where `data` starts in the stream.
    pub offset: u64,
    /// The bytes.
    pub data: Vec<u8>,
    /// The execution had finished before the size was taken: `size` is final.
    pub finished: bool,
    /// SHA-256 (hex) of the whole stream (its first `size` bytes), sent by the host with the
    /// first chunk of a finished stream that does not fit in it.
    pub sha256: Option<String>,
}

impl OutputChunk {
    /// Parses a reply to `output`.
    pub fn parse(reply: &WrapperReply) -> Result<Self> {
        reply.check("output")?;
        let b = Block::parse("output", "output", &reply.stdout)?;
        let id = b.required("id")?;
        let stream = match b.required("stream")? {
            "stdout" => Stream::Stdout,
            "stderr" => Stream::Stderr,
            other => return Err(b.malformed(format!("unknown stream {other:?}"))),
        };
        let length: u64 = b.num("length")?;
        if b.payload.len() as u64 != length {
            return Err(b.malformed(format!(
                "header says {length} bytes, got {}",
                b.payload.len()
            )));
        }
        let finished = match b.required("finished")? {
            "1" => true,
            "0" => false,
            other => return Err(b.malformed(format!("bad `finished` value {other:?}"))),
        };
        let sha256 = match b.get("sha256") {
            None | Some("") | Some("-") => None,
            Some(h) if h.len() == 64 && h.bytes().all(|c| c.is_ascii_hexdigit()) => {
                Some(h.to_ascii_lowercase())
            }
            Some(other) => return Err(b.malformed(format!("bad `sha256` value {other:?}"))),
        };
        Ok(Self {
            id: id.to_owned(),
            stream,
            size: b.num("size")?,
            offset: b.num("offset")?,
            data: b.payload.to_vec(),
            finished,
            sha256,
        })
    }

    /// The offset to ask for next.
    pub fn next_offset(&self) -> u64 {
        self.offset + self.data.len() as u64
    }

    /// This chunk reaches the end of a stream that will not grow.
    pub fn is_last(&self) -> bool {
        self.finished && self.next_offset() >= self.size
    }
}

/// The reply to `gc`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GcReport {
    /// The execution IDs whose markers were removed.
    pub removed: Vec<String>,
}

impl GcReport {
    /// Parses a reply to `gc`.
    pub fn parse(reply: &WrapperReply) -> Result<Self> {
        reply.check("gc")?;
        // `removed=` repeats, so this block is read line by line.
        let malformed = |detail: String| WrapperError::Malformed { verb: "gc", detail };
        let text = std::str::from_utf8(&reply.stdout).map_err(|_| malformed("not UTF-8".into()))?;
        let body = text
            .strip_prefix(&format!("waymark-wrap/{PROTOCOL_VERSION} gc\n"))
            .ok_or_else(|| malformed("missing `waymark-wrap/1 gc` header".into()))?;
        let body = body
            .strip_suffix("\n\n")
            .or_else(|| (body == "\n").then_some(""))
            .ok_or_else(|| malformed("truncated: no terminating blank line".into()))?;
        let mut removed = Vec::new();
        for line in body.lines() {
            let id = line
                .strip_prefix("removed=")
                .ok_or_else(|| malformed(format!("unexpected line {line:?}")))?;
            validate_execution_id(id).map_err(|_| malformed(format!("bad id {id:?}")))?;
            removed.push(id.to_owned());
        }
        Ok(Self { removed })
    }
}

/// The reply to `version`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VersionReport {
    /// The protocol version the installed wrapper speaks.
    pub protocol: u32,
}

impl VersionReport {
    /// Parses a reply to `version`.
    pub fn parse(reply: &WrapperReply) -> Result<Self> {
        reply.check("version")?;
        let b = Block::parse("version", "version", &reply.stdout)?;
        b.no_payload()?;
        Ok(Self {
            protocol: b.num("protocol")?,
        })
    }
}

/// The result of [`RemoteWrapper::install_command`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum InstallOutcome {
    /// The script was written to this path (as the remote shell expanded it).
    Installed {
        /// Absolute path on the host.
        path: String,
    },
    /// The right script was already there; nothing was written.
    AlreadyPresent {
        /// Absolute path on the host.
        path: String,
    },
}

impl InstallOutcome {
    /// Parses the reply of the install command.
    pub fn parse(reply: &WrapperReply) -> Result<Self> {
        let stderr = reply.stderr_text();
        match reply.exit_status {
            exit_status::OK => {}
            exit_status::INSTALL_HASH_MISMATCH => {
                return Err(WrapperError::InstallHashMismatch { stderr })
            }
            exit_status::INSTALL_FAILED => return Err(WrapperError::InstallFailed { stderr }),
            status => {
                return Err(WrapperError::UnexpectedExit {
                    verb: "install",
                    status,
                    stderr,
                })
            }
        }
        let malformed = |detail: String| WrapperError::Malformed {
            verb: "install",
            detail,
        };
        let text = std::str::from_utf8(&reply.stdout).map_err(|_| malformed("not UTF-8".into()))?;
        let line = text
            .strip_suffix('\n')
            .filter(|l| !l.contains('\n'))
            .ok_or_else(|| malformed(format!("expected one line, got {text:?}")))?;
        if let Some(path) = line.strip_prefix("waymark-install/1 installed ") {
            Ok(Self::Installed { path: path.into() })
        } else if let Some(path) = line.strip_prefix("waymark-install/1 present ") {
            Ok(Self::AlreadyPresent { path: path.into() })
        } else {
            Err(malformed(format!("unexpected line {line:?}")))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ID: &str = "act_01J0000000000000000000000A";

    fn reply(exit_status: u32, stdout: &[u8]) -> WrapperReply {
        WrapperReply {
            exit_status,
            stdout: stdout.to_vec(),
            stderr: b"why".to_vec(),
        }
    }

    #[test]
    fn quoting_leaves_plain_words_bare_and_quotes_the_rest() {
        assert_eq!(shell_quote("abc-1.2/x").unwrap(), "abc-1.2/x");
        assert_eq!(shell_quote("").unwrap(), "''");
        assert_eq!(shell_quote("a b").unwrap(), "'a b'");
        assert_eq!(shell_quote("it's").unwrap(), "'it'\\''s'");
        assert_eq!(shell_quote("$(x)").unwrap(), "'$(x)'");
        assert_eq!(shell_quote("~").unwrap(), "'~'");
        assert_eq!(shell_quote("a=b").unwrap(), "'a=b'");
        assert!(matches!(shell_quote("a\0b"), Err(WrapperError::Nul { .. })));
    }

    #[test]
    fn execution_ids_are_checked_like_the_wrapper_does() {
        assert!(validate_execution_id(ID).is_ok());
        for bad in [
            "act_01J0000000000000000000000",
            "act_01J0000000000000000000000AB",
            "act_01J000000000000000000000IA",
            "act_01j0000000000000000000000a",
            "xct_01J0000000000000000000000A",
            "act_01J000000000000000000000 A",
        ] {
            assert!(validate_execution_id(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn home_relative_remote_dirs_leave_home_to_the_remote_shell() {
        let w = RemoteWrapper::default();
        let line = w.status(ID).unwrap();
        let script = format!("\"$HOME\"/.waymark/bin/{}", wrapper_name());
        assert_eq!(
            line,
            format!("test -f {script} || exit 69; exec sh {script} status {ID}")
        );
        let abs = RemoteWrapper::new(RemoteDir::new("/srv/way mark/").unwrap());
        assert!(abs
            .status(ID)
            .unwrap()
            .contains(&format!("'/srv/way mark/bin/{}'", wrapper_name())));
        assert_eq!(
            RemoteDir::new("~").unwrap().shell_word("/bin"),
            "\"$HOME\"/bin"
        );
        assert!(RemoteDir::new("~bob/x").is_err());
        assert!(RemoteDir::new("").is_err());
    }

    #[test]
    fn other_interpreters_are_passed_to_the_supervisor() {
        let w = RemoteWrapper::default()
            .with_interpreter(&["busybox", "sh"])
            .unwrap();
        let line = w.version().unwrap();
        assert!(
            line.contains("; WAYMARK_SH='busybox sh' exec busybox sh "),
            "{line}"
        );
    }

    #[test]
    fn start_options_become_wrapper_options() {
        let opts = StartOptions {
            timeout: Some(Duration::from_millis(1500)),
            kill_grace: Some(Duration::from_secs(2)),
            cwd: Some("/tmp/a b".into()),
            env: vec![("LANG".into(), "C".into())],
            secret_env: Vec::new(),
            stdin: true,
            inline_max: Some(10),
        };
        let line = RemoteWrapper::default()
            .run(ID, &opts, &["ls", "-l"])
            .unwrap();
        assert!(line.ends_with(&format!(
            " run {ID} --timeout 2 --grace 2 --cwd '/tmp/a b' --stdin --env 'LANG=C' --inline-max 10 -- ls -l"
        )));
        let start = RemoteWrapper::default().start(ID, &opts, &["ls"]).unwrap();
        assert!(!start.contains("--inline-max"));
        let zero = StartOptions {
            timeout: Some(Duration::ZERO),
            ..StartOptions::default()
        };
        assert!(RemoteWrapper::default().start(ID, &zero, &["ls"]).is_err());
        let bad_env = StartOptions {
            env: vec![("1X".into(), "v".into())],
            ..StartOptions::default()
        };
        assert!(matches!(
            RemoteWrapper::default().start(ID, &bad_env, &["ls"]),
            Err(WrapperError::InvalidEnvName { .. })
        ));
        assert_eq!(
            RemoteWrapper::default().start::<&str>(ID, &StartOptions::default(), &[]),
            Err(WrapperError::EmptyArgv)
        );
    }

    #[test]
    fn status_block_parses_and_garbage_is_refused() {
        let text = format!(
            "waymark-wrap/1 status\nid={ID}\nstate=completed\nlaunched=yes\ncreated_ms=1\n\
             started_ms=2\nfinished_ms=3\nsupervisor_pid=10\ncommand_pid=11\nwait_status=137\n\
             exit_code=\nsignal=9\ntimeout_s=\ncancel_requested=no\ncommand_alive=\nerror=\n\
             stdout_bytes=5\nstderr_bytes=0\nfuture_field=x\n\n"
        );
        let s = StatusReport::parse(&reply(0, text.as_bytes())).unwrap();
        assert_eq!(s.state, MarkerState::Completed);
        assert_eq!(s.signal, Some(9));
        assert_eq!(s.exit_code, None);
        assert_eq!(s.command_pid, Some(11));
        assert_eq!(s.stdout_bytes, 5);
        // Truncated before the blank line, wrong version, garbage.
        for bad in [
            &text[..text.len() - 1],
            &text.replace("wrap/1", "wrap/2"),
            "hello\n\n",
            "",
            &text.replace("state=completed", "state=exploded"),
            &text.replace("signal=9", "signal=nine"),
        ] {
            assert!(
                matches!(
                    StatusReport::parse(&reply(0, bad.as_bytes())),
                    Err(WrapperError::Malformed { .. })
                ),
                "{bad:?}"
            );
        }
        assert!(matches!(
            StatusReport::parse(&reply(64, b"")),
            Err(WrapperError::Usage { .. })
        ));
        assert!(matches!(
            StatusReport::parse(&reply(69, b"")),
            Err(WrapperError::NotInstalled)
        ));
    }

    #[test]
    fn run_block_checks_inline_lengths() {
        let head = format!(
            "waymark-wrap/1 run\nid={ID}\nstate=completed\nexit_code=0\nstdout_bytes=3\nstderr_bytes=2\n"
        );
        let ok = format!("{head}stdout_inline=3\nstderr_inline=2\n\nabcde");
        match RunOutcome::parse(&reply(0, ok.as_bytes())).unwrap() {
            RunOutcome::Ran(r) => {
                assert_eq!(r.stdout, InlineOutput::Inline(b"abc".to_vec()));
                assert_eq!(r.stderr, InlineOutput::Inline(b"de".to_vec()));
            }
            other => panic!("{other:?}"),
        }
        let fetch = format!("{head}stdout_inline=-\nstderr_inline=2\n\nde");
        let RunOutcome::Ran(r) = RunOutcome::parse(&reply(0, fetch.as_bytes())).unwrap() else {
            panic!("not ran")
        };
        assert_eq!(r.stdout, InlineOutput::Fetch { size: 3 });
        for bad in [
            format!("{head}stdout_inline=3\nstderr_inline=2\n\nabcd"),
            format!("{head}stdout_inline=3\nstderr_inline=2\n\nabcdef"),
            format!("{head}stdout_inline=2\nstderr_inline=2\n\nabcd"),
        ] {
            assert!(
                RunOutcome::parse(&reply(0, bad.as_bytes())).is_err(),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn output_chunk_length_must_match() {
        let mut bytes = format!(
            "waymark-wrap/1 output\nid={ID}\nstream=stderr\nsize=10\noffset=4\nlength=3\nfinished=1\n\n"
        )
        .into_bytes();
        bytes.extend_from_slice(b"\0\n\xff");
        let c = OutputChunk::parse(&reply(0, &bytes)).unwrap();
        assert_eq!(c.data, b"\0\n\xff");
        assert_eq!(c.next_offset(), 7);
        assert!(!c.is_last());
        bytes.pop();
        assert!(OutputChunk::parse(&reply(0, &bytes)).is_err());
    }

    #[test]
    fn refusals_and_gc_and_install_replies() {
        let status = format!("waymark-wrap/1 status\nid={ID}\nstate=running\n\n");
        match StartOutcome::parse(&reply(65, status.as_bytes())).unwrap() {
            StartOutcome::Refused(r) => assert_eq!(r.existing.state, MarkerState::Running),
            other => panic!("{other:?}"),
        }
        let gc = format!("waymark-wrap/1 gc\nremoved={ID}\n\n");
        assert_eq!(
            GcReport::parse(&reply(0, gc.as_bytes())).unwrap().removed,
            vec![ID.to_owned()]
        );
        assert!(GcReport::parse(&reply(0, b"waymark-wrap/1 gc\n\n"))
            .unwrap()
            .removed
            .is_empty());
        assert!(GcReport::parse(&reply(0, b"waymark-wrap/1 gc\nremoved=x\n\n")).is_err());
        assert_eq!(
            InstallOutcome::parse(&reply(0, b"waymark-install/1 present /h/w\n")).unwrap(),
            InstallOutcome::AlreadyPresent {
                path: "/h/w".into()
            }
        );
        assert!(matches!(
            InstallOutcome::parse(&reply(74, b"")),
            Err(WrapperError::InstallHashMismatch { .. })
        ));
    }

    #[test]
    fn wrapper_name_carries_the_script_hash() {
        assert_eq!(wrapper_name().len(), "wrap-".len() + 16);
        assert!(wrapper_sha256().starts_with(&wrapper_name()[5..]));
    }
}
