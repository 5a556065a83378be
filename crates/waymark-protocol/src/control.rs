//! A client's side of the daemon: send control requests, start a daemon when none answers.
//!
//! The CLI and the MCP shim both reach the daemon through [`Control`], so there is one way to
//! start it: detached (its own session, stdio to a log next to the socket), serialized by a
//! start lock so that fifty clients finding no daemon start one, not fifty.

use std::os::unix::fs::DirBuilderExt;
use std::os::unix::process::CommandExt;
use std::process::ExitStatus;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use crate::client::{self, ClientError};
use crate::{Event, Frame, Request};

/// How to reach the daemon, and how to start one.
pub struct DaemonStart {
    /// The daemon's control socket.
    pub socket: std::path::PathBuf,
    /// The command that runs the daemon in the foreground (`waymark --config F daemon`); it is
    /// spawned detached when no daemon answers. `None`: never start one.
    pub daemon_command: Option<std::process::Command>,
    /// Where a daemon started here writes its stdout and stderr.
    pub daemon_log: std::path::PathBuf,
}

/// How long a client waits for a daemon it started (or another client started) to answer.
const START_WAIT: Duration = Duration::from_secs(20);
/// The least time between two daemon starts while waiting for one to answer.
const RESPAWN_AFTER: Duration = Duration::from_millis(500);
/// The most daemons one client starts in one turn: a start race or a ledger still being let go
/// of ends one or two; more that end on their own will all end the same way.
const MAX_STARTS: u32 = 3;

/// A handle on the daemon's control socket, cheap to clone.
#[derive(Clone)]
pub struct Control {
    opts: Arc<std::sync::Mutex<DaemonStart>>,
    socket: std::path::PathBuf,
    /// Why the last start failed, and the exit code that says it, for a client that tells its
    /// user ([`Control::start_error`]).
    start_error: Arc<std::sync::Mutex<Option<StartError>>>,
}

/// Why a daemon could not be started; `exit` is the code a client ends with: the daemon's own
/// when it refused its configuration or ledger (2), [`crate::exit::ERROR`] otherwise.
#[derive(Clone, Debug)]
pub struct StartError {
    pub message: String,
    pub exit: i32,
}

impl std::fmt::Display for StartError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl From<String> for StartError {
    fn from(message: String) -> StartError {
        StartError {
            message,
            exit: crate::exit::ERROR,
        }
    }
}

impl Control {
    pub fn new(opts: DaemonStart) -> Control {
        Control {
            socket: opts.socket.clone(),
            opts: Arc::new(std::sync::Mutex::new(opts)),
            start_error: Arc::default(),
        }
    }

    /// Sends one request. When no daemon listens (nothing was sent), starts one and tries
    /// again; `ClientError::Broken` means the request may have been received and is returned
    /// as is.
    pub async fn request(
        &self,
        req: Request,
        on_event: impl FnMut(&Event),
    ) -> Result<Frame, ClientError> {
        self.request_within(req, None, on_event).await
    }

    /// [`Control::request`] with a deadline for the host ([`client::request_within`]).
    pub async fn request_within(
        &self,
        req: Request,
        deadline: Option<Duration>,
        on_event: impl FnMut(&Event),
    ) -> Result<Frame, ClientError> {
        let mut on_event = on_event;
        match client::request_within(&self.socket, req.clone(), deadline, &mut on_event).await {
            Err(ClientError::NoDaemon) => {
                if let Err(e) = self.ensure_daemon().await {
                    tracing::error!(error = %e, "cannot start the daemon");
                    *self.start_error.lock().expect("start error") = Some(e);
                    return Err(ClientError::NoDaemon);
                }
                client::request_within(&self.socket, req, deadline, &mut on_event).await
            }
            other => other,
        }
    }

    /// Why the last [`Control::request`] that answered `NoDaemon` could not start a daemon,
    /// and the exit code that says it.
    pub fn start_error(&self) -> Option<StartError> {
        self.start_error.lock().expect("start error").clone()
    }

    async fn ping(&self) -> bool {
        matches!(
            client::request(&self.socket, Request::Ping, |_| {}).await,
            Ok(Frame::Done { .. })
        )
    }

    /// Makes sure a daemon answers on the socket, starting one if needed. Clients that race
    /// here take turns on a start lock (a file next to the socket): the first starts a daemon
    /// and waits until it answers, the others then find it answering. Should two daemons still
    /// start (a client without the lock, another build), the ledger's own lock lets one of
    /// them own it and the other exits, and every client waits for whichever answers.
    pub async fn ensure_daemon(&self) -> Result<(), StartError> {
        if self.ping().await {
            return Ok(());
        }
        let deadline = Instant::now() + START_WAIT;
        let _turn = self.start_lock(deadline).await.map_err(StartError::from)?;
        if self.ping().await {
            return Ok(());
        }
        let (log_path, mut exited) = self.spawn_daemon().map_err(StartError::from)?;
        let mut last_exit = None;
        let mut spawned_at = Instant::now();
        let mut starts = 1;
        while Instant::now() < deadline {
            if self.ping().await {
                return Ok(());
            }
            // The daemon we started may have ended at once: another one won the start race
            // (it answers soon), or the last owner of the ledger had not yet let go of it.
            // With no daemon answering, start another rather than wait out the whole window.
            if let Some(status) = exited.get() {
                last_exit = Some(*status);
                // A daemon that refused its configuration or its ledger (a missing ledger, say)
                // refuses again: say why at once, in its words, rather than start more.
                if status.code() == Some(crate::exit::USAGE) && !self.ping().await {
                    return Err(StartError {
                        message: refusal_in_log(&log_path).unwrap_or_else(|| {
                            format!(
                                "the daemon refused to start ({status}); see its log {log_path}"
                            )
                        }),
                        exit: crate::exit::USAGE,
                    });
                }
                // A daemon that keeps ending on its own (a damaged ledger, a bad token file) is
                // not started again and again: after a few, its own words and exit code.
                // One that found the ledger locked lost a start race to a daemon that is still
                // starting: that one will answer, so it does not count.
                let raced = refusal_in_log(&log_path)
                    .is_some_and(|m| m.contains("locked by another process"));
                if starts >= MAX_STARTS && !raced && !self.ping().await {
                    return Err(StartError {
                        message: refusal_in_log(&log_path).unwrap_or_else(|| {
                            format!(
                                "the daemon ended at once {starts} times ({status}); see its log {log_path}"
                            )
                        }),
                        exit: status.code().unwrap_or(crate::exit::ERROR),
                    });
                }
                if spawned_at.elapsed() >= RESPAWN_AFTER {
                    tracing::info!(%status, "the daemon started ended before answering; starting another");
                    (_, exited) = self.spawn_daemon().map_err(StartError::from)?;
                    spawned_at = Instant::now();
                    starts += 1;
                }
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let ended = match last_exit {
            Some(status) => format!(" (the last daemon started ended: {status})"),
            None => String::new(),
        };
        Err(format!(
            "no daemon answered on {} within {}s after starting one{ended}; see its log {}",
            self.socket.display(),
            START_WAIT.as_secs(),
            log_path
        )
        .into())
    }

    /// Takes the start lock (an exclusive `flock` on `daemon.start.lock` beside the socket),
    /// waiting for another client's turn to end, at most until `deadline`. The kernel drops
    /// the lock with its holder, so a client killed while starting a daemon blocks no one.
    async fn start_lock(&self, deadline: Instant) -> Result<std::fs::File, String> {
        let path = self.socket.with_file_name("daemon.start.lock");
        if let Some(dir) = path.parent() {
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(dir)
                .map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
        }
        let file = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&path)
            .map_err(|e| format!("cannot open the start lock {}: {e}", path.display()))?;
        loop {
            match file.try_lock() {
                Ok(()) => return Ok(file),
                Err(std::fs::TryLockError::WouldBlock) if Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                Err(std::fs::TryLockError::WouldBlock) => {
                    return Err(format!(
                        "another client held the daemon start lock {} for over {}s",
                        path.display(),
                        START_WAIT.as_secs()
                    ))
                }
                Err(std::fs::TryLockError::Error(e)) => {
                    return Err(format!("cannot lock {}: {e}", path.display()))
                }
            }
        }
    }

    /// Spawns the daemon detached (own session, stdio to the log file); returns the log path
    /// and where its exit status appears if it ends.
    fn spawn_daemon(&self) -> Result<(String, Arc<OnceLock<ExitStatus>>), String> {
        let mut opts = self.opts.lock().expect("shim options");
        let log_path = opts.daemon_log.clone();
        let Some(cmd) = opts.daemon_command.as_mut() else {
            return Err(format!(
                "no daemon answers on {} (start one with `waymark daemon`)",
                self.socket.display()
            ));
        };
        if let Some(dir) = log_path.parent() {
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(dir)
                .map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
        }
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log_path)
            .map_err(|e| format!("cannot open the daemon log {}: {e}", log_path.display()))?;
        let err = log
            .try_clone()
            .map_err(|e| format!("cannot open the daemon log {}: {e}", log_path.display()))?;
        cmd.stdin(std::process::Stdio::null())
            .stdout(log)
            .stderr(err);
        // SAFETY: setsid is async-signal-safe; it detaches the daemon from the agent's session
        // so that the agent closing this shim does not take the daemon with it.
        unsafe {
            cmd.pre_exec(|| {
                libc::setsid();
                Ok(())
            });
        }
        let child = cmd
            .spawn()
            .map_err(|e| format!("cannot start the daemon: {e}"))?;
        tracing::info!(pid = child.id(), log = %log_path.display(), "started a daemon");
        // Reap it in the background if it exits early (another daemon won the race).
        let exited = Arc::new(OnceLock::new());
        let status = exited.clone();
        std::thread::spawn(move || {
            let mut child = child;
            if let Ok(s) = child.wait() {
                let _ = status.set(s);
            }
        });
        Ok((log_path.display().to_string(), exited))
    }
}

/// The last refusal a daemon wrote to its log (`waymark: ...`), without the prefix.
fn refusal_in_log(log_path: &str) -> Option<String> {
    let text = std::fs::read_to_string(log_path).ok()?;
    let line = text.lines().rev().find(|l| l.starts_with("waymark: "))?;
    Some(format!(
        "{} (the daemon's log: {log_path})",
        line.trim_start_matches("waymark: ")
    ))
}
