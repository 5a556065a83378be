//! Command lines: what to send as SSH `exec` requests, and the remote directory they act on.

use std::fmt::{self, Write as _};
use std::time::Duration;

use super::{
    exit_status, shell_quote, validate_env_name, validate_execution_id, wrapper_name,
    wrapper_sha256, Result, WrapperError, DEFAULT_REMOTE_DIR,
};

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
    pub(super) fn shell_word(&self, suffix: &str) -> String {
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
    /// (secrets): sent first on the channel's stdin ([`RemoteWrapper::stdin_prefix`]), announced by
    /// `--secret-env N`. A value may not hold a newline or NUL.
    pub secret_env: Vec<(String, String)>,
    /// Words of the argv (index from 0, value) that hold secrets: sent in the same stdin block
    /// as `@N=VALUE` lines (N from 1), an empty word in their place on the command line and in
    /// the marker; the wrapper puts them back just before it becomes the command. A value may
    /// not hold a newline or NUL.
    pub secret_argv: Vec<(usize, String)>,
    /// The command reads the bytes sent on the SSH channel's stdin (the
    /// wrapper stores them in the marker first); otherwise `/dev/null`.
    pub stdin: bool,
    /// `run` only: largest stream returned inline (default 64 KiB); larger
    /// streams are fetched with `output`.
    pub inline_max: Option<u64>,
}

impl StartOptions {
    /// Whether a `run` with these options can go on a serve channel: stdin and secrets come on
    /// the channel's own stdin, which a serve worker reads requests from.
    pub fn servable(&self) -> bool {
        !self.stdin && self.secret_env.is_empty() && self.secret_argv.is_empty()
    }
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
    /// The identity of the ledger whose markers this wrapper keeps; the install command
    /// records it on the host and refuses a host holding another ledger's markers.
    ledger: Option<String>,
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
            ledger: None,
        }
    }

    /// Ties the host's markers to the ledger `identity` (letters and digits): the install
    /// command records it in `<remote_dir>/ledger` on first use and refuses a host whose
    /// markers another ledger left there ([`exit_status::OTHER_LEDGER`]).
    pub fn with_ledger(mut self, identity: &str) -> Result<Self> {
        if identity.is_empty() || !identity.bytes().all(|b| b.is_ascii_alphanumeric()) {
            return Err(WrapperError::InvalidOption {
                option: "ledger identity",
                reason: "must be letters and digits",
            });
        }
        self.ledger = Some(identity.to_owned());
        Ok(self)
    }

    /// The shell that records this wrapper's ledger in `<remote_dir>/ledger`, unless the host
    /// holds markers of another ledger and `adopt` is false: then it drains stdin, prints
    /// `waymark-install/1 other-ledger ID` and exits [`exit_status::OTHER_LEDGER`]. A host
    /// without a recorded ledger (new, or from before ledgers were recorded) is claimed.
    fn ledger_check(&self, identity: &str, adopt: bool) -> String {
        format!(
            "l={file}; w={identity}; o=$(cat \"$l\" 2>/dev/null); \
             if [ \"$o\" != \"$w\" ]; then set -- {exec}/act_*; \
             if [ {adopt} = 0 ] && [ -n \"$o\" ] && [ -e \"$1\" ]; then cat >/dev/null; \
             echo \"waymark-install/1 other-ledger $o\"; exit {other}; fi; \
             mkdir -p \"${{l%/*}}\" || exit {failed}; \
             {{ printf '%s\\n' \"$w\" >\"$l.$$\" && mv -f \"$l.$$\" \"$l\"; }} || exit {failed}; fi; ",
            file = self.remote_dir.shell_word("/ledger"),
            exec = self.remote_dir.shell_word("/exec"),
            adopt = u8::from(adopt),
            other = exit_status::OTHER_LEDGER,
            failed = exit_status::INSTALL_FAILED,
        )
    }

    /// The command line that makes this wrapper's ledger the owner of the host's markers,
    /// whatever ledger owned them: `waymark hosts adopt`. It prints `waymark-adopt/1 PREVIOUS`
    /// (`-` when none was recorded). `None` without a ledger identity.
    pub fn adopt_command(&self) -> Option<String> {
        let identity = self.ledger.as_deref()?;
        Some(format!(
            "umask 077; {}echo \"waymark-adopt/1 ${{o:--}}\"",
            self.ledger_check(identity, true)
        ))
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

    /// The command line that installs [`WRAPPER_SCRIPT`](super::WRAPPER_SCRIPT), sent on its stdin.
    ///
    /// It creates `<remote_dir>/bin` (mode 0700), writes a unique temporary
    /// file, checks its sha256, and renames it into place, so concurrent
    /// installs are safe and a partial upload never becomes the wrapper. When
    /// the right script is already there it only drains stdin. Parse the
    /// result with [`InstallOutcome::parse`](super::InstallOutcome::parse).
    pub fn install_command(&self) -> String {
        let bin = self.remote_dir.shell_word("/bin");
        let name = wrapper_name();
        let hash = wrapper_sha256();
        let ledger = self
            .ledger
            .as_deref()
            .map_or(String::new(), |id| self.ledger_check(id, false));
        format!(
            "umask 077; {ledger}d={bin}; f=\"$d/{name}\"; h={hash}; \
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
    /// `NAME=VALUE` lines and `@N=VALUE` secret argv words (empty without secrets). The
    /// command's own stdin follows.
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
        for (i, v) in &opts.secret_argv {
            if v.contains('\0') || v.contains('\n') {
                return Err(WrapperError::InvalidOption {
                    option: "secret argument",
                    reason: "a value cannot hold a newline or NUL",
                });
            }
            block.extend_from_slice(format!("@{}={v}\n", i + 1).as_bytes());
        }
        Ok(block)
    }

    pub(super) fn start_args<S: AsRef<str>>(
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
        // A secret word travels in the stdin block; its place on the command line stays empty.
        args.extend(argv.iter().enumerate().map(|(i, a)| {
            if opts.secret_argv.iter().any(|(j, _)| *j == i) {
                String::new()
            } else {
                a.as_ref().to_owned()
            }
        }));
        Ok(args)
    }

    /// `start`: create the marker and launch `argv` detached; the reply comes
    /// once the command is recorded. Parse with [`StartOutcome::parse`](super::StartOutcome::parse).
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
    /// in one round trip. Parse with [`RunOutcome::parse`](super::RunOutcome::parse).
    pub fn run<S: AsRef<str>>(&self, id: &str, opts: &StartOptions, argv: &[S]) -> Result<String> {
        self.command_line("run", &Self::start_args(id, opts, argv, true)?)
    }

    /// `wait`: wait for an existing execution to end, then reply as `run`
    /// does. The way back to a `run` whose connection dropped. Parse with
    /// [`RunReport::parse`](super::RunReport::parse).
    pub fn wait(&self, id: &str, inline_max: Option<u64>) -> Result<String> {
        validate_execution_id(id)?;
        let mut args = vec![id.to_owned()];
        if let Some(max) = inline_max {
            args.push("--inline-max".into());
            args.push(max.to_string());
        }
        self.command_line("wait", &args)
    }

    /// `status`: the marker's state. Parse with [`StatusReport::parse`](super::StatusReport::parse).
    pub fn status(&self, id: &str) -> Result<String> {
        validate_execution_id(id)?;
        self.command_line("status", &[id])
    }

    /// `status` of many IDs in one invocation: one status block per ID, in the order given.
    /// Parse with [`StatusReport::parse_many`](super::StatusReport::parse_many). At least one ID; keep batches to a few
    /// hundred so the command line stays small.
    pub fn status_many<S: AsRef<str>>(&self, ids: &[S]) -> Result<String> {
        Self::status_ids(ids)?;
        self.command_line("status", ids)
    }

    /// `watch`: waits up to `wait` (at most [`WATCH_MAX`](super::WATCH_MAX)) for news of the
    /// executions in `known`, each with the sizes `[stdout, stderr]` the caller knows: a stream
    /// of another size, or an end. Parse with [`WatchReport::parse_many`](super::WatchReport::parse_many).
    pub fn watch<S: AsRef<str>>(&self, wait: Duration, known: &[(S, [u64; 2])]) -> Result<String> {
        self.command_line("watch", &Self::watch_args(wait, known)?)
    }

    /// The words of a `watch`: milliseconds, then id and both sizes per execution.
    pub(super) fn watch_args<S: AsRef<str>>(
        wait: Duration,
        known: &[(S, [u64; 2])],
    ) -> Result<Vec<String>> {
        if known.is_empty() {
            return Err(WrapperError::InvalidOption {
                option: "watch",
                reason: "at least one execution id is needed",
            });
        }
        if wait > super::WATCH_MAX {
            return Err(WrapperError::InvalidOption {
                option: "watch",
                reason: "it waits at most 60 s",
            });
        }
        let mut args = Vec::with_capacity(1 + 3 * known.len());
        args.push(wait.as_millis().to_string());
        for (id, [out, err]) in known {
            validate_execution_id(id.as_ref())?;
            args.push(id.as_ref().to_owned());
            args.push(out.to_string());
            args.push(err.to_string());
        }
        Ok(args)
    }

    /// What `status` accepts: at least one id, every one valid.
    pub(super) fn status_ids<S: AsRef<str>>(ids: &[S]) -> Result<()> {
        if ids.is_empty() {
            return Err(WrapperError::InvalidOption {
                option: "status",
                reason: "at least one execution id is needed",
            });
        }
        ids.iter()
            .try_for_each(|id| validate_execution_id(id.as_ref()))
    }

    /// `output`: up to `max` bytes of `stream` from byte `offset`. Parse with
    /// [`OutputChunk::parse`](super::OutputChunk::parse).
    pub fn output(&self, id: &str, stream: Stream, offset: u64, max: u64) -> Result<String> {
        validate_execution_id(id)?;
        self.command_line(
            "output",
            &[id, stream.as_str(), &offset.to_string(), &max.to_string()],
        )
    }

    /// `cancel`: SIGTERM the command's process group, SIGKILL after `grace`
    /// (default 5 s); replies with the final status. Parse with
    /// [`StatusReport::parse`](super::StatusReport::parse).
    pub fn cancel(&self, id: &str, grace: Option<Duration>) -> Result<String> {
        validate_execution_id(id)?;
        let mut args = vec![id.to_owned()];
        if let Some(g) = grace {
            args.push(whole_seconds(g, "cancel grace", false)?.to_string());
        }
        self.command_line("cancel", &args)
    }

    /// `gc`: remove finished markers (completed, timed out, cancelled) that
    /// finished more than `older_than` ago. Parse with [`GcReport::parse`](super::GcReport::parse).
    ///
    /// A removed marker no longer refuses its ID: collect only executions
    /// whose result the ledger already holds.
    pub fn gc(&self, older_than: Duration) -> Result<String> {
        self.command_line("gc", &["--older-than", &older_than.as_secs().to_string()])
    }

    /// `version`: the protocol version the installed wrapper speaks. Parse
    /// with [`VersionReport::parse`](super::VersionReport::parse).
    pub fn version(&self) -> Result<String> {
        self.command_line::<&str>("version", &[])
    }
}
