//! Finding the programs a test needs, free loopback ports, and running a child process with a
//! deadline.
//!
//! Tests never skip: a missing tool is a panic that says how to install it.

use std::ffi::OsStr;
use std::io::Read;
use std::net::{Ipv4Addr, TcpListener};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::thread;
use std::time::{Duration, Instant};

/// Directories searched after `PATH`: an ordinary user's `PATH` usually lacks the `sbin`
/// directories where `sshd` lives.
const EXTRA_TOOL_DIRS: &[&str] = &[
    "/usr/local/sbin",
    "/usr/local/bin",
    "/usr/sbin",
    "/usr/bin",
    "/sbin",
    "/bin",
];

/// Returns a TCP port on 127.0.0.1 that was free a moment ago.
///
/// The port is found by binding `127.0.0.1:0` and releasing it, so another process may take it
/// before the caller binds it: callers that start a server on it must retry with a new port when
/// the bind fails (as [`crate::TestSshd`] does).
pub fn free_port() -> u16 {
    let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
        .unwrap_or_else(|e| panic!("cannot bind 127.0.0.1:0 to find a free port: {e}"));
    listener
        .local_addr()
        .unwrap_or_else(|e| panic!("cannot read the port bound on 127.0.0.1:0: {e}"))
        .port()
}

/// Finds an executable by name in `PATH`, then in the usual `bin` and `sbin` directories.
///
/// A name containing `/` is taken as a path and returned if it is an executable file.
pub fn find_tool(name: &str) -> Option<PathBuf> {
    if name.contains('/') {
        let path = PathBuf::from(name);
        return is_executable(&path).then_some(path);
    }
    let from_path = std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
        .unwrap_or_default();
    from_path
        .into_iter()
        .chain(EXTRA_TOOL_DIRS.iter().map(PathBuf::from))
        .map(|dir| dir.join(name))
        .find(|candidate| is_executable(candidate))
}

/// Like [`find_tool`], but panics when the tool is missing, with `install_hint` telling the
/// reader what to do (for example `"install it (apt-get install openssh-client)"`).
pub fn require_tool(name: &str, install_hint: &str) -> PathBuf {
    find_tool(name).unwrap_or_else(|| {
        panic!(
            "`{name}` not found (searched PATH and {}): {install_hint}",
            EXTRA_TOOL_DIRS.join(", ")
        )
    })
}

fn is_executable(path: &Path) -> bool {
    path.metadata()
        .map(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        .unwrap_or(false)
}

/// A POSIX shell found on this machine, to run the remote wrapper under each shell it must
/// support.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Shell {
    /// `"dash"`, `"bash"` or `"busybox"`.
    pub name: &'static str,
    /// The executable.
    pub program: PathBuf,
    /// Arguments that make `program` a shell: `["sh"]` for busybox, empty otherwise.
    pub args: Vec<&'static str>,
}

impl Shell {
    /// A command that runs this shell; add `-c SCRIPT` or a script path.
    pub fn command(&self) -> Command {
        let mut cmd = Command::new(&self.program);
        cmd.args(&self.args);
        cmd
    }
}

/// The shells among dash, bash and busybox `sh` that are installed, in that order.
///
/// A test that must cover all three checks the length, or calls [`require_tool`] for the one it
/// needs, so that a missing shell fails the test rather than shrinking it.
pub fn which_shells() -> Vec<Shell> {
    [
        ("dash", &[][..]),
        ("bash", &[][..]),
        ("busybox", &["sh"][..]),
    ]
    .into_iter()
    .filter_map(|(name, args)| {
        find_tool(name).map(|program| Shell {
            name,
            program,
            args: args.to_vec(),
        })
    })
    .collect()
}

/// Waits for `child` to exit for at most `limit`; `None` when it is still running (it is left
/// running: kill it or wait again).
pub fn wait_within(child: &mut Child, limit: Duration) -> Option<ExitStatus> {
    let deadline = Instant::now() + limit;
    loop {
        match child.try_wait() {
            Ok(Some(status)) => return Some(status),
            Ok(None) if Instant::now() >= deadline => return None,
            Ok(None) => thread::sleep(Duration::from_millis(10)),
            Err(e) => panic!("cannot wait for child process {}: {e}", child.id()),
        }
    }
}

/// Runs `cmd` to completion like [`Command::output`], but kills it and panics (showing what it
/// printed) if it has not exited within `limit`. Standard input is `/dev/null`.
pub fn output_within(cmd: &mut Command, limit: Duration) -> Output {
    cmd.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = cmd
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start {}: {e}", describe(cmd)));
    let stdout = collect(child.stdout.take());
    let stderr = collect(child.stderr.take());
    let status = wait_within(&mut child, limit);
    if status.is_none() {
        let _ = child.kill();
        let _ = child.wait();
    }
    let stdout = stdout.join().unwrap_or_default();
    let stderr = stderr.join().unwrap_or_default();
    match status {
        Some(status) => Output {
            status,
            stdout,
            stderr,
        },
        None => panic!(
            "{} did not finish within {limit:?} and was killed\n--- stdout ---\n{}\n--- stderr ---\n{}",
            describe(cmd),
            String::from_utf8_lossy(&stdout),
            String::from_utf8_lossy(&stderr)
        ),
    }
}

fn collect(pipe: Option<impl Read + Send + 'static>) -> thread::JoinHandle<Vec<u8>> {
    thread::spawn(move || {
        let mut bytes = Vec::new();
        if let Some(mut pipe) = pipe {
            let _ = pipe.read_to_end(&mut bytes);
        }
        bytes
    })
}

pub(crate) fn describe(cmd: &Command) -> String {
    std::iter::once(cmd.get_program())
        .chain(cmd.get_args())
        .map(OsStr::to_string_lossy)
        .collect::<Vec<_>>()
        .join(" ")
}
