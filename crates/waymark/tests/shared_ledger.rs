//! Daemons on the shared PostgreSQL ledger (the test kit's cluster, a database per test), real
//! `waymark daemon` processes and a real sshd: configuration and start (schema, refusals).

mod common;

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{bin, id_in, stderr, stdout, Daemon, Env, APPEND_TOOL};
use waymark_testkit::TestPostgres;

/// The environment variable the daemons read the connection string from.
const URL_VAR: &str = "WAYMARK_TEST_LEDGER_URL";

/// One database and the daemons' `[ledger]` settings for it.
struct Shared {
    url: String,
    db: String,
}

impl Shared {
    fn new(hint: &str) -> Shared {
        let url = TestPostgres::shared().create_database(hint);
        let db = url.rsplit('/').next().unwrap().to_string();
        Shared { url, db }
    }

    /// Runs `sql` on the database; its rows, one a line, columns split by `|`.
    fn sql(&self, sql: &str) -> String {
        let out = TestPostgres::shared()
            .psql(&self.db)
            .args(["-c", sql])
            .output()
            .unwrap();
        assert!(out.status.success(), "{sql}: {}", stderr(&out));
        stdout(&out).trim().to_string()
    }
}

/// An Env whose daemon `gw-a` keeps its ledger in `shared`'s database.
fn env_on(_shared: &Shared) -> Env {
    Env::builder()
        .ledger_settings(&format!(
            "backend = \"postgres\"\nurl_env = \"{URL_VAR}\"\ndaemon_name = \"gw-a\""
        ))
        .tools(APPEND_TOOL)
        .build()
}

/// `waymark --config CONFIG ARGS...` with the connection string in its environment.
fn waymark(config: &Path, shared: &Shared) -> Command {
    let mut c = Command::new(bin());
    c.arg("--config")
        .arg(config)
        .env("WAYMARK_LOG", "warn")
        .env(URL_VAR, &shared.url)
        .env("WAYMARK_DEAD_AFTER_MS", "1500")
        .stdin(Stdio::null());
    c
}

/// Starts `waymark daemon` on `config` and waits until it listens on `socket`.
fn start_daemon(config: &Path, socket: &Path, shared: &Shared) -> Daemon {
    let mut child = Daemon(
        waymark(config, shared)
            .arg("daemon")
            .stdout(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let deadline = Instant::now() + Duration::from_secs(30);
    while std::os::unix::net::UnixStream::connect(socket).is_err() {
        if let Ok(Some(status)) = child.0.try_wait() {
            panic!(
                "the daemon on {} ended at once ({status})",
                config.display()
            );
        }
        assert!(
            Instant::now() < deadline,
            "no daemon on {}",
            socket.display()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    child
}

/// Runs `waymark daemon` on `config`, which must refuse to start; returns what it said.
fn refused_start(config: &Path, shared: &Shared) -> String {
    let out = waymark(config, shared).arg("daemon").output().unwrap();
    assert!(
        !out.status.success(),
        "the daemon started: {}",
        stderr(&out)
    );
    stderr(&out)
}

fn call(config: &Path, shared: &Shared, line: &str, secs: &str) -> Child {
    waymark(config, shared)
        .args(["exec", "run", "append"])
        .arg(format!("line={line}"))
        .arg(format!("secs={secs}"))
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

#[test]
fn a_daemon_on_postgres_creates_the_schema_registers_and_serves_calls() {
    let shared = Shared::new("serves");
    let env = env_on(&shared);
    let _a = start_daemon(&env.config, &env.socket(), &shared);
    let out = call(&env.config, &shared, "one", "0")
        .wait_with_output()
        .unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert_eq!(stdout(&out), "done one\n");
    assert_eq!(env.counter_lines(), ["one"]);
    assert_eq!(shared.sql("SELECT version FROM waymark_schema"), "3");
    assert_eq!(shared.sql("SELECT name FROM daemons"), "gw-a");
    let id = id_in(&stderr(&out));
    assert_eq!(
        shared.sql(&format!(
            "SELECT state, owner, epoch FROM executions WHERE id = '{id}'"
        )),
        "completed|gw-a|1"
    );
    let verify = waymark(&env.config, &shared)
        .args(["audit", "verify"])
        .output()
        .unwrap();
    assert_eq!(verify.status.code(), Some(0), "{}", stderr(&verify));
    assert!(
        stdout(&verify).contains("Audit chain OK"),
        "{}",
        stdout(&verify)
    );
}

#[test]
fn a_schema_newer_than_the_binary_is_refused_at_start() {
    let shared = Shared::new("newer");
    shared.sql("CREATE TABLE waymark_schema (version integer NOT NULL)");
    shared.sql("INSERT INTO waymark_schema VALUES (99)");
    let env = env_on(&shared);
    let said = refused_start(&env.config, &shared);
    assert!(
        said.contains("schema is version 99, newer than this waymark knows"),
        "{said}"
    );
    assert!(
        said.contains("waymark.toml:"),
        "names the configuration: {said}"
    );
}

#[test]
fn a_connection_string_file_others_can_read_is_refused_at_start() {
    let shared = Shared::new("urlfile");
    let env = Env::builder()
        .ledger_settings("backend = \"postgres\"\nurl_file = \"{dir}/ledger-url\"")
        .build();
    let url_file = env.dir.path().join("ledger-url");
    let text = std::fs::read_to_string(&env.config)
        .unwrap()
        .replace("{dir}", &env.dir.path().display().to_string());
    std::fs::write(&env.config, text).unwrap();
    std::fs::write(&url_file, &shared.url).unwrap();
    std::fs::set_permissions(&url_file, std::fs::Permissions::from_mode(0o644)).unwrap();
    let said = refused_start(&env.config, &shared);
    assert!(said.contains("chmod 600"), "{said}");
    assert!(said.contains("waymark.toml:"), "{said}");
    assert!(
        !said.contains(&shared.url),
        "the connection string is not echoed: {said}"
    );
    // Owner-only, it starts.
    std::fs::set_permissions(&url_file, std::fs::Permissions::from_mode(0o600)).unwrap();
    let _a = start_daemon(&env.config, &env.socket(), &shared);
}
