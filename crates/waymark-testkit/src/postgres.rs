//! A real PostgreSQL cluster for tests: `initdb` into a temporary directory, `pg_ctl start` on a
//! free loopback port, one database per test.
//!
//! PostgreSQL refuses to run as root, so when the tests run as root the cluster runs as an
//! unprivileged system user (`postgres`, which Debian's package creates, else `nobody`) that owns
//! the temporary directory. The server never outlives the test process: a watchdog shell stops it
//! (`pg_ctl stop -m immediate`) when the process that started it is gone, even after a SIGKILL.
//!
//! One cluster per test process is enough: [`TestPostgres::shared`] starts it once and
//! [`TestPostgres::create_database`] gives each test its own database.

use std::ffi::CString;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::OnceLock;
use std::time::Duration;

use crate::tools::{describe, find_tool, free_port, output_within};

const POSTGRES_HINT: &str = "install it (apt-get install postgresql)";

/// The role every test connects as (trust authentication on loopback only).
pub const POSTGRES_TEST_ROLE: &str = "waymark";

/// How long `initdb`, `pg_ctl` and `createdb` may take before the test fails.
const STEP_LIMIT: Duration = Duration::from_secs(60);

/// A running PostgreSQL cluster in a temporary directory; stopped on drop.
pub struct TestPostgres {
    port: u16,
    bin: PathBuf,
    data: PathBuf,
    socket_dir: PathBuf,
    log: PathBuf,
    run_as: Option<(u32, u32)>,
    databases: AtomicU32,
    _dir: tempfile::TempDir,
}

impl TestPostgres {
    /// The cluster of this test process, started on first use.
    pub fn shared() -> &'static TestPostgres {
        static SHARED: OnceLock<TestPostgres> = OnceLock::new();
        SHARED.get_or_init(TestPostgres::start)
    }

    /// Starts a new cluster; panics with what to install when PostgreSQL is missing, or with
    /// the server log when it does not come up.
    pub fn start() -> TestPostgres {
        let bin = postgres_bin_dir();
        let dir = tempfile::Builder::new()
            .prefix("waymark-pg-")
            .tempdir()
            .unwrap_or_else(|e| panic!("cannot create a temporary directory for PostgreSQL: {e}"));
        let run_as = unprivileged_user();
        if let Some((uid, gid)) = run_as {
            chown(dir.path(), uid, gid);
        }
        let data = dir.path().join("data");
        let socket_dir = dir.path().join("sock");
        let log = dir.path().join("postgres.log");
        std::fs::create_dir(&socket_dir)
            .unwrap_or_else(|e| panic!("cannot create {}: {e}", socket_dir.display()));
        if let Some((uid, gid)) = run_as {
            chown(&socket_dir, uid, gid);
        }
        let mut pg = TestPostgres {
            port: 0,
            bin,
            data,
            socket_dir,
            log,
            run_as,
            databases: AtomicU32::new(0),
            _dir: dir,
        };
        pg.run(
            pg.tool("initdb")
                .arg("-D")
                .arg(&pg.data)
                .args(["-A", "trust", "-U", POSTGRES_TEST_ROLE])
                .args(["-E", "UTF8", "--no-locale", "--no-sync"]),
        );
        // A port found free may be taken before the server binds it: try a few.
        for _ in 0..5 {
            pg.port = free_port();
            let options = format!(
                "-p {} -k {} -c listen_addresses=127.0.0.1 -c max_connections=200 \
                 -c log_line_prefix=db=%d:",
                pg.port,
                pg.socket_dir.display()
            );
            let out = output_within(
                pg.tool("pg_ctl")
                    .arg("-D")
                    .arg(&pg.data)
                    .arg("-l")
                    .arg(&pg.log)
                    .args(["-w", "-t", "30", "-o", &options, "start"]),
                STEP_LIMIT,
            );
            if out.status.success() {
                pg.watch_parent();
                return pg;
            }
            if !pg.log_text().contains("could not bind") {
                panic!(
                    "PostgreSQL did not start: {}\n--- server log ---\n{}",
                    String::from_utf8_lossy(&out.stderr),
                    pg.log_text()
                );
            }
        }
        panic!(
            "PostgreSQL found no free port in five tries\n--- server log ---\n{}",
            pg.log_text()
        );
    }

    /// The loopback port the server listens on.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// A new, empty database with a unique name, owned by [`POSTGRES_TEST_ROLE`]; returns its
    /// connection string.
    pub fn create_database(&self, hint: &str) -> String {
        let n = self.databases.fetch_add(1, Ordering::Relaxed);
        let clean: String = hint
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() {
                    c.to_ascii_lowercase()
                } else {
                    '_'
                }
            })
            .take(40)
            .collect();
        let name = format!("t{n}_{clean}");
        self.run(
            self.tool("createdb")
                .args(["-h", "127.0.0.1", "-p", &self.port.to_string()])
                .args(["-U", POSTGRES_TEST_ROLE, &name]),
        );
        self.url(&name)
    }

    /// The connection string of database `name` (no password: trust on loopback).
    pub fn url(&self, name: &str) -> String {
        format!(
            "postgresql://{POSTGRES_TEST_ROLE}@127.0.0.1:{}/{name}",
            self.port
        )
    }

    /// A `psql` command connected to database `name`, for checks and diagnostics.
    pub fn psql(&self, name: &str) -> Command {
        let mut cmd = self.tool("psql");
        cmd.args([
            "-X",
            "-q",
            "-v",
            "ON_ERROR_STOP=1",
            "-At",
            "-d",
            &self.url(name),
        ]);
        cmd
    }

    /// What the server has logged so far.
    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Stops the server at once (like a crash: no checkpoint), as a fault.
    pub fn kill(&self) {
        let _ = output_within(
            self.tool("pg_ctl")
                .arg("-D")
                .arg(&self.data)
                .args(["-m", "immediate", "stop"]),
            STEP_LIMIT,
        );
    }

    fn tool(&self, name: &str) -> Command {
        let program = if name == "sh" {
            PathBuf::from("/bin/sh")
        } else {
            self.bin.join(name)
        };
        let mut cmd = Command::new(program);
        if let Some((uid, gid)) = self.run_as {
            cmd.uid(uid).gid(gid);
            // `pg_ctl` and `initdb` look for a HOME-relative config only; keep them away from
            // root's.
            cmd.env("HOME", self._dir.path());
        }
        cmd.current_dir(self._dir.path());
        cmd
    }

    fn run(&self, cmd: &mut Command) {
        let out = output_within(cmd, STEP_LIMIT);
        if !out.status.success() {
            panic!(
                "{} failed ({}):\n{}{}",
                describe(cmd),
                out.status,
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
    }

    /// A shell that stops the server and removes its directory when this process is gone (the
    /// shared cluster is a static that is never dropped, and a test process may be killed). It
    /// runs as the server's user, so it watches `/proc/PID` rather than signalling root's pid.
    fn watch_parent(&self) {
        let script = format!(
            "while [ -d /proc/{pid} ]; do sleep 1; done; '{pg_ctl}' -D '{data}' -m immediate stop >/dev/null 2>&1; rm -rf '{dir}'",
            pid = std::process::id(),
            pg_ctl = self.bin.join("pg_ctl").display(),
            data = self.data.display(),
            dir = self._dir.path().display(),
        );
        let mut cmd = self.tool("sh");
        let _ = cmd
            .args(["-c", &script])
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .process_group(0)
            .spawn();
    }
}

impl Drop for TestPostgres {
    fn drop(&mut self) {
        self.kill();
    }
}

/// The directory holding `initdb`, `pg_ctl`, `createdb` and `psql`: next to `initdb` on the
/// `PATH` or the newest `/usr/lib/postgresql/<major>/bin` (Debian keeps them off the `PATH`).
fn postgres_bin_dir() -> PathBuf {
    let mut versions: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let major = e.file_name().to_str()?.parse::<u32>().ok()?;
            let bin = e.path().join("bin");
            bin.join("initdb").exists().then_some((major, bin))
        })
        .collect();
    versions.sort();
    if let Some((_, bin)) = versions.pop() {
        return bin;
    }
    match find_tool("initdb").and_then(|p| std::fs::canonicalize(p).ok()) {
        Some(initdb) => initdb.parent().map(Path::to_path_buf).unwrap_or_default(),
        None => panic!(
            "PostgreSQL's `initdb` not found (searched /usr/lib/postgresql/*/bin and PATH): {POSTGRES_HINT}"
        ),
    }
}

/// As root: the uid and gid of `postgres`, else `nobody`. Otherwise `None` (run as we are).
fn unprivileged_user() -> Option<(u32, u32)> {
    // SAFETY: geteuid(2) cannot fail and has no memory effects.
    if unsafe { libc::geteuid() } != 0 {
        return None;
    }
    for name in ["postgres", "nobody"] {
        let c = CString::new(name).expect("no NUL in a user name");
        // SAFETY: getpwnam returns NULL or a pointer to a static passwd record, read at once.
        let pw = unsafe { libc::getpwnam(c.as_ptr()) };
        if !pw.is_null() {
            // SAFETY: pw is non-null and points to a valid passwd record.
            return Some(unsafe { ((*pw).pw_uid, (*pw).pw_gid) });
        }
    }
    panic!("running as root, PostgreSQL needs an unprivileged user: {POSTGRES_HINT} (it creates `postgres`)");
}

fn chown(path: &Path, uid: u32, gid: u32) {
    std::os::unix::fs::chown(path, Some(uid), Some(gid))
        .unwrap_or_else(|e| panic!("cannot give {} to uid {uid}: {e}", path.display()));
}
