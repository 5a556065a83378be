//! Daemons on the shared PostgreSQL ledger (the test kit's cluster, a database per test), real
//! `waymark daemon` processes and a real sshd: configuration and start (schema, refusals), then
//! two daemons on one database: one execution for one intent, takeover after a daemon dies,
//! and a restarted daemon that cannot move what another took over.

mod common;

use std::collections::BTreeMap;
use std::io::BufReader;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{
    append_tool_naming_its_id, bin, daemons_on, id_in, read_until_id, stderr, stdout, wait_for,
    Daemon, Env, APPEND_TOOL,
};
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

/// An Env whose daemon `gw-a` keeps its ledger in `shared`'s database, made by `waymark init`
/// (a daemon never makes a ledger).
fn env_on(shared: &Shared) -> Env {
    let env = env_without_ledger(shared);
    init(&env.config, shared);
    env
}

/// [`env_on`] before `waymark init`: the database holds no ledger.
fn env_without_ledger(_shared: &Shared) -> Env {
    Env::builder()
        .ledger_settings(&format!(
            "backend = \"postgres\"\nurl_env = \"{URL_VAR}\"\ndaemon_name = \"gw-a\""
        ))
        .tools(APPEND_TOOL)
        .build()
}

/// A ledger key file where `env`'s configuration looks for it, as copied from another daemon.
fn write_key(env: &Env) {
    let key = env.dir.path().join("ledger/ledger.key");
    std::fs::create_dir_all(key.parent().unwrap()).unwrap();
    std::fs::write(&key, format!("{}\n", "ab".repeat(32))).unwrap();
    std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o600)).unwrap();
}

/// `waymark init` on `config`: the key file and the schema.
fn init(config: &Path, shared: &Shared) {
    let out = waymark_testkit::output_within(
        waymark(config, shared).arg("init"),
        Duration::from_secs(60),
    );
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert!(stdout(&out).contains("PostgreSQL"), "{}", stdout(&out));
}

/// Daemon B's configuration beside A's: the same hosts, tools, ledger and key, its own socket
/// and name.
fn config_b(env: &Env) -> PathBuf {
    config_named(env, "b")
}

/// Daemon `gw-LETTER`'s configuration beside A's, its socket `run-LETTER/daemon.sock`.
fn config_named(env: &Env, letter: &str) -> PathBuf {
    let text = std::fs::read_to_string(&env.config)
        .unwrap()
        .replace("run/daemon.sock", &format!("run-{letter}/daemon.sock"))
        .replace(
            "daemon_name = \"gw-a\"",
            &format!("daemon_name = \"gw-{letter}\""),
        );
    let path = env.dir.path().join(format!("waymark-{letter}.toml"));
    std::fs::write(&path, text).unwrap();
    path
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
    start_daemon_with(config, socket, shared, "1500")
}

/// [`start_daemon`] whose daemon takes a peer for dead after `dead_after_ms` without a
/// heartbeat.
fn start_daemon_with(config: &Path, socket: &Path, shared: &Shared, dead_after_ms: &str) -> Daemon {
    let mut child = Daemon(
        waymark(config, shared)
            .env("WAYMARK_DEAD_AFTER_MS", dead_after_ms)
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
    let out = waymark_testkit::output_within(
        waymark(config, shared).arg("daemon"),
        Duration::from_secs(30),
    );
    assert!(
        !out.status.success(),
        "the daemon started: {}",
        stderr(&out)
    );
    stderr(&out)
}

/// `exec run TOOL line=LINE` on daemon `config`, its output piped.
fn call_tool(config: &Path, shared: &Shared, tool: &str, line: &str) -> Child {
    waymark(config, shared)
        .args(["exec", "run", tool])
        .arg(format!("line={line}"))
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
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
    assert_eq!(
        shared.sql("SELECT version FROM waymark_schema"),
        waymark_ledger_pg::PgLedger::known_schema_version().to_string()
    );
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
    let env = env_without_ledger(&shared);
    write_key(&env);
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
    // `config check` refuses it in the daemon's words.
    let check = waymark(&env.config, &shared)
        .args(["config", "check"])
        .output()
        .unwrap();
    assert_eq!(check.status.code(), Some(2), "{}", stdout(&check));
    let why = said.lines().last().unwrap().trim_start_matches("waymark: ");
    assert!(stderr(&check).contains(why), "{} vs {said}", stderr(&check));
    assert!(
        !said.contains(&shared.url),
        "the connection string is not echoed: {said}"
    );
    // Owner-only, it starts (once `init` made the ledger).
    std::fs::set_permissions(&url_file, std::fs::Permissions::from_mode(0o600)).unwrap();
    init(&env.config, &shared);
    let _a = start_daemon(&env.config, &env.socket(), &shared);
}

/// Issue 32: a daemon pointed at a database that holds no ledger (a wrong connection string,
/// a new server) is refused, exit 2, and creates nothing there; so is one whose ledger key is
/// missing. `daemon --init` makes the ledger, as `init` does.
#[test]
fn a_daemon_on_a_database_without_a_ledger_is_refused_and_creates_nothing() {
    let shared = Shared::new("noledger");
    let env = env_without_ledger(&shared);
    let refused = || {
        let out = waymark_testkit::output_within(
            waymark(&env.config, &shared).arg("daemon"),
            Duration::from_secs(30),
        );
        assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
        let said = stderr(&out);
        assert!(said.contains("waymark init"), "{said}");
        said
    };
    let said = refused();
    assert!(said.contains("ledger key"), "{said}");
    let check = waymark(&env.config, &shared)
        .args(["config", "check"])
        .output()
        .unwrap();
    assert_eq!(check.status.code(), Some(2), "{}", stdout(&check));
    let why = said.lines().last().unwrap().trim_start_matches("waymark: ");
    assert!(stderr(&check).contains(why), "{} vs {said}", stderr(&check));
    // With the key there (copied from another daemon), the database is still no ledger.
    write_key(&env);
    let said = refused();
    assert!(said.contains("holds no Waymark ledger"), "{said}");
    assert_eq!(
        shared.sql("SELECT to_regclass('waymark_schema') IS NULL"),
        "t",
        "nothing was created"
    );
    let mut a = Daemon(
        waymark(&env.config, &shared)
            .args(["daemon", "--init"])
            .stdout(Stdio::null())
            .spawn()
            .unwrap(),
    );
    wait_for(
        || std::os::unix::net::UnixStream::connect(env.socket()).is_ok(),
        "the daemon started with --init to listen",
        Duration::from_secs(30),
    );
    a.kill();
    assert_eq!(
        shared.sql("SELECT version FROM waymark_schema"),
        waymark_ledger_pg::PgLedger::known_schema_version().to_string()
    );
}

/// Issue 32 on PostgreSQL: each daemon keeps a witness of the chain head it saw made durable
/// beside its key file. A database restored from an older copy (here: a copy taken as a
/// template database, put back in its place) is refused at start, naming the events it lacks,
/// until the operator accepts it; the acceptance is an audit event and the witness moves on.
#[test]
fn a_shared_ledger_rolled_back_to_an_older_copy_is_refused_until_accepted() {
    let shared = Shared::new("rollback");
    let env = env_on(&shared);
    let postgres = |sql: &str| {
        let out = TestPostgres::shared()
            .psql("postgres")
            .args(["-c", sql])
            .output()
            .unwrap();
        assert!(out.status.success(), "{sql}: {}", stderr(&out));
    };
    let calls = |lines: &[&str]| {
        for line in lines {
            let out = call(&env.config, &shared, line, "0")
                .wait_with_output()
                .unwrap();
            assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
        }
    };
    let head = || -> u64 { shared.sql("SELECT seq FROM chain_head").parse().unwrap() };
    let witness_file = env.dir.path().join("ledger/ledger.key.witness");
    let witnessed = || -> u64 {
        let text = std::fs::read_to_string(&witness_file).unwrap();
        let v: serde_json::Value = serde_json::from_str(text.trim()).unwrap();
        v["seq"].as_u64().unwrap()
    };

    let mut a = start_daemon(&env.config, &env.socket(), &shared);
    calls(&["one", "two"]);
    a.kill();
    let copy = format!("{}_copy", shared.db);
    postgres(&format!("CREATE DATABASE {copy} TEMPLATE {}", shared.db));
    let copied = head();
    let mut a = start_daemon(&env.config, &env.socket(), &shared);
    calls(&["three", "four"]);
    a.kill();
    let reached = witnessed();
    assert!(reached > copied, "{reached} > {copied}");
    assert!(reached <= head(), "the witness never leads the chain");

    // The database goes back to the older copy.
    postgres(&format!("DROP DATABASE {}", shared.db));
    postgres(&format!("ALTER DATABASE {copy} RENAME TO {}", shared.db));
    assert_eq!(head(), copied);
    let said = refused_start(&env.config, &shared);
    assert!(
        said.contains(&format!("events {}-{reached} are missing", copied + 1)),
        "{said}"
    );
    assert!(said.contains("--accept-rollback"), "{said}");

    // Accepted: recorded in the chain, and the next start serves it without being told.
    let mut a = Daemon(
        waymark(&env.config, &shared)
            .args(["daemon", "--accept-rollback"])
            .stdout(Stdio::null())
            .spawn()
            .unwrap(),
    );
    wait_for(
        || std::os::unix::net::UnixStream::connect(env.socket()).is_ok(),
        "the daemon started with --accept-rollback to listen",
        Duration::from_secs(30),
    );
    let accepted = shared.sql(
        "SELECT body->'kind'->'data'->>'missing_events' FROM events \
         WHERE body->'kind'->>'name' = 'rollback accepted'",
    );
    assert_eq!(accepted, (reached - copied).to_string());
    a.kill();
    let _a = start_daemon(&env.config, &env.socket(), &shared);
    calls(&["five"]);
    assert_eq!(env.counter_lines(), ["one", "two", "three", "four", "five"]);
}

#[test]
fn a_second_daemon_with_the_name_of_a_live_one_is_refused_at_start() {
    let shared = Shared::new("samename");
    let env = env_on(&shared);
    // B's socket, A's name.
    let twin = config_b(&env);
    let text = std::fs::read_to_string(&twin)
        .unwrap()
        .replace("daemon_name = \"gw-b\"", "daemon_name = \"gw-a\"");
    std::fs::write(&twin, text).unwrap();
    let mut a = start_daemon(&env.config, &env.socket(), &shared);
    let said = refused_start(&twin, &shared);
    assert!(
        said.contains("another daemon named `gw-a` is running on this ledger"),
        "{said}"
    );
    assert!(said.contains("daemon_name"), "says what to change: {said}");
    assert!(
        said.contains("waymark-b.toml:"),
        "names the configuration: {said}"
    );
    // Once A is gone (SIGKILL: no goodbye), the name is free at once, heartbeat or not.
    a.kill();
    let _twin = start_daemon(&twin, &env.dir.path().join("run-b/daemon.sock"), &shared);
}

#[test]
fn the_same_call_sent_to_two_daemons_at_once_runs_once() {
    let shared = Shared::new("race");
    let env = env_on(&shared);
    let b = config_b(&env);
    let _a = start_daemon(&env.config, &env.socket(), &shared);
    let _b = start_daemon(&b, &env.dir.path().join("run-b/daemon.sock"), &shared);
    for round in 0..3 {
        let line = format!("race{round}");
        let to_a = call(&env.config, &shared, &line, "1");
        let to_b = call(&b, &shared, &line, "1");
        let (a, b_out) = (
            to_a.wait_with_output().unwrap(),
            to_b.wait_with_output().unwrap(),
        );
        assert_eq!(a.status.code(), Some(0), "{}", stderr(&a));
        assert_eq!(b_out.status.code(), Some(0), "{}", stderr(&b_out));
        assert_eq!(
            id_in(&stderr(&a)),
            id_in(&stderr(&b_out)),
            "one execution for one intent"
        );
        assert_eq!(stdout(&a), format!("done {line}\n"));
        assert_eq!(
            stdout(&b_out),
            format!("done {line}\n"),
            "B sees A's result"
        );
    }
    assert_eq!(
        env.counter_lines(),
        ["race0", "race1", "race2"],
        "the host ran each once"
    );
}

/// Daemons A and B on `shared` (a peer dead after `dead_after_ms`), a call of `line` (sleeping
/// `secs`) on A, and A SIGKILLed with the client once the command started on the host; returns
/// B (its configuration and daemon) and the execution's id.
fn a_killed_mid_command(
    env: &Env,
    shared: &Shared,
    dead_after_ms: &str,
    line: &str,
    secs: &str,
) -> (PathBuf, Daemon, String) {
    let b = config_b(env);
    let socket_b = env.dir.path().join("run-b/daemon.sock");
    let mut a = start_daemon_with(&env.config, &env.socket(), shared, dead_after_ms);
    let daemon_b = start_daemon_with(&b, &socket_b, shared, dead_after_ms);
    let mut first = call(&env.config, shared, line, secs);
    let (_, id) = read_until_id(&mut BufReader::new(first.stderr.take().unwrap()));
    wait_for(
        || env.counter_lines() == [line],
        "the command started on the host",
        Duration::from_secs(20),
    );
    a.kill();
    let _ = first.kill();
    let _ = first.wait();
    (b, daemon_b, id)
}

/// The retry of [`a_killed_mid_command`]'s call on B (configuration `b`): it attaches to
/// execution `id` and delivers the marker's result, the host ran it once, and its row reads
/// `row` (`state|owner|epoch`).
fn retry_on_b_delivers(
    env: &Env,
    shared: &Shared,
    b: &Path,
    id: &str,
    line: &str,
    secs: &str,
    row: &str,
) {
    let retry = call(b, shared, line, secs).wait_with_output().unwrap();
    assert_eq!(retry.status.code(), Some(0), "{}", stderr(&retry));
    assert_eq!(id_in(&stderr(&retry)), id, "the retry attached");
    assert_eq!(
        stdout(&retry),
        format!("done {line}\n"),
        "B delivered the marker's result"
    );
    assert_eq!(env.counter_lines(), [line], "the host ran it once");
    assert_eq!(
        shared.sql(&format!(
            "SELECT state, owner, epoch FROM executions WHERE id = '{id}'"
        )),
        row,
        "B drives it with epoch + 1 over the last lease"
    );
}

#[test]
fn a_retry_on_b_after_a_died_mid_command_attaches_and_b_takes_over_through_the_marker() {
    let shared = Shared::new("takeover");
    let env = env_on(&shared);
    let (b, _b, id) = a_killed_mid_command(&env, &shared, "1500", "slow", "4");
    retry_on_b_delivers(&env, &shared, &b, &id, "slow", "4", "completed|gw-b|2");

    // A restarted (same name) takes back only what it still owns: not this one.
    let _a = start_daemon(&env.config, &env.socket(), &shared);
    let status = waymark(&env.config, &shared)
        .args(["exec", "status", &id])
        .output()
        .unwrap();
    assert!(stdout(&status).contains("completed"), "{}", stdout(&status));
    assert_eq!(
        shared.sql(&format!(
            "SELECT owner, epoch FROM executions WHERE id = '{id}'"
        )),
        "gw-b|2"
    );
    assert!(waymark(&env.config, &shared)
        .args(["audit", "verify"])
        .output()
        .unwrap()
        .status
        .success());
}

/// A peer's heartbeat age that never counts as dead during a test: only restarts and calls
/// move a lease.
const NEVER: &str = "600000";

/// Execution `id`'s row: `state|owner|epoch`, `nobody` for no owner.
fn row(shared: &Shared, id: &str) -> String {
    shared.sql(&format!(
        "SELECT state, coalesce(owner, 'nobody'), epoch FROM executions WHERE id = '{id}'"
    ))
}

/// [`a_killed_mid_command`] (no peer ever counted dead), then A restarted under its name: it
/// takes the execution back (epoch 2), finds it running on the host and, no call driving it,
/// lets it go. Returns B's configuration, B, the restarted A and the execution's id.
fn let_go_by_a_restarted(
    env: &Env,
    shared: &Shared,
    line: &str,
    secs: &str,
) -> (PathBuf, Daemon, Daemon, String) {
    let (b, daemon_b, id) = a_killed_mid_command(env, shared, NEVER, line, secs);
    let a = start_daemon_with(&env.config, &env.socket(), shared, NEVER);
    wait_for(
        || row(shared, &id) == "running|nobody|2",
        "the restarted A let go of the execution it found running",
        Duration::from_secs(20),
    );
    (b, daemon_b, a, id)
}

fn audit_verifies(env: &Env, shared: &Shared) {
    let out = waymark(&env.config, shared)
        .args(["audit", "verify"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
}

#[test]
fn a_retry_on_b_adopts_what_a_restarted_a_took_back_and_let_go() {
    let shared = Shared::new("adopt");
    let env = env_on(&shared);
    let (b, _b, _a, id) = let_go_by_a_restarted(&env, &shared, "idle", "8");

    // A status check on B adopts it to read the marker (epoch 3), and lets it go again.
    let status = waymark(&b, &shared)
        .args(["exec", "status", &id])
        .output()
        .unwrap();
    assert!(stdout(&status).contains("running"), "{}", stdout(&status));
    assert_eq!(
        row(&shared, &id),
        "running|nobody|3",
        "B adopted it for the check and let it go"
    );

    // The retry on B adopts it (epoch 4), waits on the host and delivers the marker's result,
    // well before the tool's timeout a follower of a lease nobody drives would wait out.
    retry_on_b_delivers(&env, &shared, &b, &id, "idle", "8", "completed|gw-b|4");
    audit_verifies(&env, &shared);
}

#[test]
fn a_cancel_on_b_adopts_what_nobody_drives_and_records_its_end() {
    let shared = Shared::new("cancel_idle");
    let env = env_on(&shared);
    let (b, _b, _a, id) = let_go_by_a_restarted(&env, &shared, "long", "60");

    // The cancel through B ends the command on the host, adopts the execution (epoch 3) and
    // waits until the marker shows the end, which it records.
    let cancel = waymark(&b, &shared)
        .args(["exec", "cancel", &id])
        .output()
        .unwrap();
    assert_eq!(cancel.status.code(), Some(0), "{}", stderr(&cancel));
    assert_eq!(
        row(&shared, &id),
        "cancelled|gw-b|3",
        "B adopted it and recorded the end: {}",
        stdout(&cancel)
    );
    assert_eq!(env.counter_lines(), ["long"], "the host ran it once");
    audit_verifies(&env, &shared);
}

#[test]
fn a_daemon_starting_settles_what_nobody_drives_without_a_call() {
    let shared = Shared::new("settle");
    let env = env_on(&shared);
    let (b, mut daemon_b, _a, id) = let_go_by_a_restarted(&env, &shared, "idle", "3");
    // The command ends on the host; nobody asks about it.
    let exit = env.sshd.marker_file(&id, "exit");
    wait_for(
        || exit.exists(),
        "the command ended on the host",
        Duration::from_secs(20),
    );
    assert_eq!(
        row(&shared, &id),
        "running|nobody|2",
        "no daemon moved it on its own"
    );

    // B starting (again) adopts what nobody drives and settles it through the marker.
    daemon_b.kill();
    let _b = start_daemon_with(
        &b,
        &env.dir.path().join("run-b/daemon.sock"),
        &shared,
        NEVER,
    );
    wait_for(
        || row(&shared, &id) == "completed|gw-b|3",
        "B's start settled the execution nobody drove",
        Duration::from_secs(20),
    );
    assert_eq!(env.counter_lines(), ["idle"], "the host ran it once");
    audit_verifies(&env, &shared);
}

#[test]
fn a_daemon_frozen_mid_command_and_taken_over_cannot_move_it_when_it_wakes() {
    let shared = Shared::new("frozen");
    let env = env_on(&shared);
    let b = config_b(&env);
    let a = start_daemon(&env.config, &env.socket(), &shared);
    let _b = start_daemon(&b, &env.dir.path().join("run-b/daemon.sock"), &shared);
    let mut first = call(&env.config, &shared, "frozen", "3");
    let (_, id) = read_until_id(&mut BufReader::new(first.stderr.take().unwrap()));
    wait_for(
        || env.counter_lines() == ["frozen"],
        "the command started on the host",
        Duration::from_secs(20),
    );
    // A stops beating (SIGSTOP): B takes the execution over and settles it at the marker.
    unsafe { libc::kill(a.0.id() as i32, libc::SIGSTOP) };
    let retry = call(&b, &shared, "frozen", "3").wait_with_output().unwrap();
    assert_eq!(retry.status.code(), Some(0), "{}", stderr(&retry));
    assert_eq!(id_in(&stderr(&retry)), id);
    let row = format!("SELECT state, owner, epoch FROM executions WHERE id = '{id}'");
    assert_eq!(shared.sql(&row), "completed|gw-b|2");
    // A wakes with epoch 1: whatever its driver records now is refused or already settled.
    unsafe { libc::kill(a.0.id() as i32, libc::SIGCONT) };
    let _ = first.wait();
    std::thread::sleep(Duration::from_secs(1));
    assert_eq!(shared.sql(&row), "completed|gw-b|2", "A moved nothing");
    assert_eq!(env.counter_lines(), ["frozen"], "the host ran it once");
    assert!(waymark(&env.config, &shared)
        .args(["audit", "verify"])
        .output()
        .unwrap()
        .status
        .success());
}

/// `gated`, on `h2`: appends `line` to `$HOME/counter` there, waits until `$HOME/gate` exists,
/// prints `done <line>`.
const GATED_TOOL: &str = r#"
[tools.gated]
description = "Append a line to h2's counter file, then wait for the gate."
hosts = ["h2"]
argv = ["sh", "-c", "echo \"$1\" >> \"$HOME/counter\"; while [ ! -e \"$HOME/gate\" ]; do sleep 0.1; done; echo done \"$1\"", "gated", "{line}"]
contract = "status_check"
retry_window = "10m"
timeout = "60s"

[tools.gated.args.line]
type = "string"
"#;

/// Daemon `name`'s last heartbeat (ms since the epoch).
fn heartbeat_ms(shared: &Shared, name: &str) -> i64 {
    shared
        .sql(&format!(
            "SELECT heartbeat_ms FROM daemons WHERE name = '{name}'"
        ))
        .parse()
        .unwrap()
}

#[test]
fn a_live_daemon_whose_reconcile_hangs_keeps_beating_and_keeps_its_executions() {
    const DEAD_AFTER_MS: i64 = 3000;
    let dead_after = DEAD_AFTER_MS.to_string();
    let shared = Shared::new("beat_alone");
    // h1 behind the fault proxy (its marker reads are made to hang), h2 direct.
    let env = Env::builder()
        .ledger_settings(&format!(
            "backend = \"postgres\"\nurl_env = \"{URL_VAR}\"\ndaemon_name = \"gw-a\""
        ))
        .tools(APPEND_TOOL)
        .tools(GATED_TOOL)
        .fault_proxy()
        .extra_hosts(1)
        .build();
    init(&env.config, &shared);
    let (b, c) = (config_b(&env), config_named(&env, "c"));
    let _a = start_daemon_with(&env.config, &env.socket(), &shared, &dead_after);
    let mut daemon_c = start_daemon_with(
        &c,
        &env.dir.path().join("run-c/daemon.sock"),
        &shared,
        &dead_after,
    );

    // A drives a live call on h2, which runs until the gate opens.
    let live = call_tool(&env.config, &shared, "gated", "live");
    wait_for(
        || env.host_counter_lines(2) == ["live"],
        "the live call started on h2",
        Duration::from_secs(20),
    );
    // C dies mid-command on h1, and h1 stops answering: whoever reconciles C's execution
    // waits on its marker read (an SSH handshake that never ends, until the connect timeout).
    let mut orphan = call(&c, &shared, "orphan", "60");
    let (_, orphan_id) = read_until_id(&mut BufReader::new(orphan.stderr.take().unwrap()));
    wait_for(
        || env.counter_lines() == ["orphan"],
        "C's command started on h1",
        Duration::from_secs(20),
    );
    daemon_c.kill();
    let _ = orphan.kill();
    let _ = orphan.wait();
    env.proxy().blackhole(true);
    let before = env.proxy().stats().accepted;

    // A's heartbeat takes C's execution over, and A starts reconciling it (the read hangs).
    let owner = |id: &str| {
        shared.sql(&format!(
            "SELECT coalesce(owner, 'nobody'), epoch FROM executions WHERE id = '{id}'"
        ))
    };
    wait_for(
        || owner(&orphan_id) == "gw-a|2",
        "A took over the dead C's execution",
        Duration::from_secs(20),
    );
    wait_for(
        || env.proxy().stats().accepted > before,
        "A's reconcile reading the marker on h1",
        Duration::from_secs(20),
    );
    // On a stalled heartbeat, A's last beat is no later than this.
    let a_beat = heartbeat_ms(&shared, "gw-a");

    // B starts and beats. Once it has beaten twice after A's beat would be stale if A's
    // heartbeat waited for that reconcile, a B that found A dead has taken A's call over.
    let _b = start_daemon_with(
        &b,
        &env.dir.path().join("run-b/daemon.sock"),
        &shared,
        &dead_after,
    );
    let live_id = shared.sql(&format!(
        "SELECT id FROM executions WHERE id <> '{orphan_id}'"
    ));
    let mut past = Vec::new();
    wait_for(
        || {
            let beat = heartbeat_ms(&shared, "gw-b");
            if beat > a_beat + DEAD_AFTER_MS && !past.contains(&beat) {
                past.push(beat);
            }
            past.len() >= 2 || owner(&live_id) != "gw-a|1"
        },
        "B beating past A's deadline",
        Duration::from_secs(20),
    );
    assert_eq!(
        owner(&live_id),
        "gw-a|1",
        "the call a live daemon drives was taken over while its reconcile hung"
    );

    // The gate opens: A delivers its call.
    std::fs::write(env.host_sshd(2).remote_home().join("gate"), "").unwrap();
    let live = live.wait_with_output().unwrap();
    assert_eq!(live.status.code(), Some(0), "{}", stderr(&live));
    assert_eq!(stdout(&live), "done live\n");
    assert_eq!(row(&shared, &live_id), "completed|gw-a|1");
    assert_eq!(env.host_counter_lines(2), ["live"], "h2 ran it once");
}

/// A seeded xorshift: the two-daemon chaos run prints its seed, `WAYMARK_CHAOS_SEED` replays it.
/// `gappend`: `append` that needs an operator's approval per call.
const GUARDED_APPEND_TOOL: &str = r#"
[tools.gappend]
description = "Append a line to the counter file once an operator approves."
hosts = ["h1"]
argv = ["sh", "-c", "echo \"$1\" >> {counter}; echo done \"$1\"", "gappend", "{line}"]
contract = "status_check"
approval = "per_call"
retry_window = "10m"

[tools.gappend.args.line]
type = "string"
"#;

/// The one execution awaiting approval, as daemon `config` lists it.
fn awaiting_approval(config: &Path, shared: &Shared) -> String {
    let mut id = String::new();
    wait_for(
        || {
            let out = waymark(config, shared)
                .args(["--json", "approvals"])
                .output()
                .unwrap();
            let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_default();
            match v["items"][0]["id"].as_str() {
                Some(found) => {
                    id = found.to_string();
                    true
                }
                None => false,
            }
        },
        "an execution awaiting approval",
        Duration::from_secs(20),
    );
    id
}

/// Daemons A and B on `shared` with [`APPEND_TOOL`] and [`GUARDED_APPEND_TOOL`]: the
/// environment (A's configuration), B's configuration and both daemons.
fn guarded_pair(shared: &Shared) -> (Env, PathBuf, [Daemon; 2]) {
    let env = Env::builder()
        .ledger_settings(&format!(
            "backend = \"postgres\"\nurl_env = \"{URL_VAR}\"\ndaemon_name = \"gw-a\""
        ))
        .tools(APPEND_TOOL)
        .tools(GUARDED_APPEND_TOOL)
        .build();
    init(&env.config, shared);
    let b = config_b(&env);
    let a = start_daemon(&env.config, &env.socket(), shared);
    let daemon_b = start_daemon(&b, &env.dir.path().join("run-b/daemon.sock"), shared);
    (env, b, [a, daemon_b])
}

/// `gappend line=LINE` on `config`'s daemon, its output piped.
fn guarded(config: &Path, shared: &Shared, line: &str) -> Child {
    waymark(config, shared)
        .args(["exec", "run", "gappend"])
        .arg(format!("line={line}"))
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

#[test]
fn calls_awaiting_approval_on_a_shared_ledger_are_watched_by_one_reader() {
    let shared = Shared::new("approval_reads");
    // Every statement of this database's sessions is logged, after the database's name (the
    // test kit's `log_line_prefix`).
    shared.sql(&format!(
        "ALTER DATABASE {} SET log_statement = 'all'",
        shared.db
    ));
    let (env, b, _daemons) = guarded_pair(&shared);
    const CALLS: usize = 8;
    let waiting: Vec<Child> = (0..CALLS)
        .map(|i| guarded(&env.config, &shared, &format!("w{i}")))
        .collect();
    let pending = || {
        let out = waymark(&b, &shared)
            .args(["--json", "approvals"])
            .output()
            .unwrap();
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_default();
        (v["items"].as_array().into_iter().flatten())
            .filter_map(|i| i["id"].as_str().map(str::to_string))
            .collect::<Vec<_>>()
    };
    wait_for(
        || pending().len() == CALLS,
        "every call awaits approval",
        Duration::from_secs(30),
    );

    // Three seconds of waiting: A reads no execution by its id (each call read its own every
    // 500 ms before: about 48 reads), only the list of what still awaits approval.
    let pg = TestPostgres::shared();
    let from = pg.log_text().len();
    std::thread::sleep(Duration::from_secs(3));
    let log = pg.log_text();
    let ours = format!("db={}:", shared.db);
    let statements: Vec<&str> = log[from..]
        .lines()
        .filter(|l| l.starts_with(&ours) && l.contains("execute"))
        .collect();
    let reads = statements
        .iter()
        .filter(|l| l.contains("FROM executions WHERE id = $1"))
        .count();
    let lists = statements
        .iter()
        .filter(|l| l.contains("SELECT id, record FROM executions"))
        .count();
    assert!(
        reads < CALLS,
        "{reads} reads of one execution in 3 s while {CALLS} calls waited:\n{}",
        statements.join("\n")
    );
    assert!(
        lists >= 2,
        "the reader listed what awaits approval: {lists}"
    );

    // Approved through B, every call waiting on A hears it and runs, once.
    for id in pending() {
        let approve = waymark(&b, &shared)
            .args(["approve", &id])
            .output()
            .unwrap();
        assert_eq!(approve.status.code(), Some(0), "{}", stderr(&approve));
    }
    for (i, call) in waiting.into_iter().enumerate() {
        let out = call.wait_with_output().unwrap();
        assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
        assert_eq!(stdout(&out), format!("done w{i}\n"));
    }
    let mut ran = env.counter_lines();
    ran.sort();
    assert_eq!(ran, (0..CALLS).map(|i| format!("w{i}")).collect::<Vec<_>>());
}

#[test]
fn an_operator_answers_through_either_daemon_a_call_the_other_drives() {
    let shared = Shared::new("operator");
    let (env, b, _daemons) = guarded_pair(&shared);
    let guarded = |line: &str| guarded(&env.config, &shared, line);

    // Approved on B, the call waiting on A runs, once.
    let waiting = guarded("yes");
    let id = awaiting_approval(&b, &shared);
    let approve = waymark(&b, &shared)
        .args(["approve", &id])
        .output()
        .unwrap();
    assert_eq!(approve.status.code(), Some(0), "{}", stderr(&approve));
    let out = waiting.wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert_eq!(stdout(&out), "done yes\n");
    assert_eq!(id_in(&stderr(&out)), id);

    // Denied on B, the call waiting on A is told so, and nothing runs.
    let waiting = guarded("no");
    let id = awaiting_approval(&b, &shared);
    let deny = waymark(&b, &shared)
        .args(["deny", &id, "--reason", "not now"])
        .output()
        .unwrap();
    assert_eq!(deny.status.code(), Some(0), "{}", stderr(&deny));
    let out = waiting.wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(202), "{}", stderr(&out));
    assert!(stderr(&out).contains("not now"), "{}", stderr(&out));

    // Cancelled on B, the command A drives stops, and A records how it ended.
    let mut running = call(&env.config, &shared, "long", "30");
    let mut err = BufReader::new(running.stderr.take().unwrap());
    let (_, id) = read_until_id(&mut err);
    // The rest of what the caller says, read to its end (a closed pipe would stop it).
    let said = std::thread::spawn(move || {
        let mut rest = String::new();
        std::io::Read::read_to_string(&mut err, &mut rest).unwrap();
        rest
    });
    wait_for(
        || env.counter_lines().last().map(String::as_str) == Some("long"),
        "the command to start",
        Duration::from_secs(20),
    );
    let started = Instant::now();
    let cancel = waymark(&b, &shared)
        .args(["exec", "cancel", &id])
        .output()
        .unwrap();
    assert_eq!(cancel.status.code(), Some(0), "{}", stderr(&cancel));
    let out = running.wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(203), "{}", said.join().unwrap());
    assert!(
        started.elapsed() < Duration::from_secs(25),
        "stopped, not run to its end"
    );
    assert_eq!(
        shared.sql(&format!(
            "SELECT state, owner FROM executions WHERE id = '{id}'"
        )),
        "cancelled|gw-a",
        "A drove it to its end"
    );
    assert_eq!(
        env.counter_lines(),
        ["yes", "long"],
        "each ran at most once"
    );
}

/// `ticks`: prints `first`, waits 3 s, prints `second`.
const TICKS_TOOL: &str = r#"
[tools.ticks]
description = "Print a line, wait, print another."
hosts = ["h1"]
argv = ["sh", "-c", "echo first; sleep 3; echo second"]
contract = "status_check"
retry_window = "10m"

[tools.echo_later]
description = "Print a secret, wait, print another line."
hosts = ["h1"]
argv = ["sh", "-c", "echo \"t=$1\"; sleep 3; echo second", "x", "{token}"]
contract = "status_check"
retry_window = "10m"

[tools.echo_later.args.token]
type = "string"
secret = true
"#;

#[test]
fn a_call_attached_on_b_shows_the_output_of_a_command_a_drives_as_it_comes() {
    let shared = Shared::new("live");
    let env = Env::builder()
        .ledger_settings(&format!(
            "backend = \"postgres\"\nurl_env = \"{URL_VAR}\"\ndaemon_name = \"gw-a\""
        ))
        .tools(TICKS_TOOL)
        .build();
    init(&env.config, &shared);
    let b = config_b(&env);
    let _a = start_daemon(&env.config, &env.socket(), &shared);
    let _b = start_daemon(&b, &env.dir.path().join("run-b/daemon.sock"), &shared);
    let ticks = |config: &Path| {
        waymark(config, &shared)
            .args(["exec", "run", "ticks"])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    };
    let on_a = ticks(&env.config);
    let mut id = String::new();
    wait_for(
        || {
            id = shared.sql("SELECT id FROM executions");
            !id.is_empty()
                && std::fs::read_to_string(env.sshd.marker_file(&id, "stdout"))
                    .is_ok_and(|o| o == "first\n")
        },
        "the command's first line on the host, driven by A",
        Duration::from_secs(20),
    );
    let mut on_b = ticks(&b);
    let mut out_b = BufReader::new(on_b.stdout.take().unwrap());
    let mut first = String::new();
    std::io::BufRead::read_line(&mut out_b, &mut first).unwrap();
    assert_eq!(first, "first\n");
    assert!(
        !std::fs::read_to_string(env.sshd.marker_file(&id, "stdout"))
            .unwrap()
            .contains("second"),
        "B showed the first line while the command still ran, not with the result"
    );
    let mut rest = String::new();
    std::io::Read::read_to_string(&mut out_b, &mut rest).unwrap();
    assert_eq!(rest, "second\n", "each byte once");
    assert_eq!(on_b.wait().unwrap().code(), Some(0));
    let a = on_a.wait_with_output().unwrap();
    assert_eq!(stdout(&a), "first\nsecond\n", "{}", stderr(&a));
    assert_eq!(
        shared.sql("SELECT count(*), min(owner) FROM executions"),
        "1|gw-a",
        "one execution, driven by A"
    );

    // A secret the command prints is masked in what B shows, though B never held its value.
    let canary = "CANARY-5e4f3a2b";
    let secret_call = |config: &Path| {
        waymark(config, &shared)
            .args(["exec", "run", "echo_later"])
            .arg(format!("token={canary}"))
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    };
    let on_a = secret_call(&env.config);
    wait_for(
        || shared.sql("SELECT count(*) FROM executions") == "2",
        "the second execution",
        Duration::from_secs(20),
    );
    let mut on_b = secret_call(&b);
    let mut out_b = BufReader::new(on_b.stdout.take().unwrap());
    let mut first = String::new();
    std::io::BufRead::read_line(&mut out_b, &mut first).unwrap();
    assert!(
        first.starts_with("t=") && !first.contains(canary),
        "B masks the secret: {first:?}"
    );
    let mut rest = String::new();
    std::io::Read::read_to_string(&mut out_b, &mut rest).unwrap();
    assert!(!rest.contains(canary), "{rest}");
    assert_eq!(on_b.wait().unwrap().code(), Some(0));
    let a = on_a.wait_with_output().unwrap();
    assert!(!stdout(&a).contains(canary), "{}", stdout(&a));
}

struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n
    }
}

/// SIGKILLs every daemon running on `config` (ours, or one a CLI call started).
fn kill_daemons_on(config: &Path) {
    for pid in daemons_on(config) {
        unsafe { libc::kill(pid as i32, libc::SIGKILL) };
    }
}

/// The chaos suite's two-daemon profile: calls of a `status_check` tool spread over two
/// daemons on one PostgreSQL ledger, each round's calls in flight together while one of the
/// daemons, drawn from the seed, is SIGKILLed; every call whose answer was lost is retried on
/// either daemon (a call to the dead one starts it again, as the CLI does when none answers)
/// until it answers. Then: no execution id ran twice on the host, no action ran under two
/// ids, every `completed` execution ran and no `failed` one did, and the chain verifies.
#[test]
fn two_daemon_chaos_no_duplicates_no_silent_loss() {
    let seed = std::env::var("WAYMARK_CHAOS_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos() as u64
                | 1
        });
    println!("two-daemon chaos: WAYMARK_CHAOS_SEED={seed} (WAYMARK_CHAOS_ROUNDS for more rounds)");
    let mut rng = Rng(seed);
    let shared = Shared::new("chaos2");
    let env = Env::builder()
        .ledger_settings(&format!(
            "backend = \"postgres\"\nurl_env = \"{URL_VAR}\"\ndaemon_name = \"gw-a\""
        ))
        .tools(&append_tool_naming_its_id())
        // The agents are a configured actor, as a team deploys it: the actor every call and
        // retry of this user is, on either daemon.
        .tools(&format!(
            "[actors.chaos]\nunix_user = \"{}\"\ntools = [\"*\"]\noperator = true\n",
            unsafe { libc::geteuid() }
        ))
        .build();
    init(&env.config, &shared);
    let configs = [env.config.clone(), config_b(&env)];
    let sockets = [env.socket(), env.dir.path().join("run-b/daemon.sock")];
    let _started = [
        start_daemon(&configs[0], &sockets[0], &shared),
        start_daemon(&configs[1], &sockets[1], &shared),
    ];
    // CI size: every round kills a daemon and its calls wait out the heartbeat's 5 s before
    // the survivor takes them over, so rounds cost seconds each on a loaded machine.
    // `WAYMARK_CHAOS_ROUNDS` scales it up.
    let rounds: usize = std::env::var("WAYMARK_CHAOS_ROUNDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(2);
    let per_round = 4;
    let mut answered: Vec<(String, String)> = Vec::new();
    let mut kills = [0, 0];
    let mut retries = 0;
    for round in 0..rounds {
        let mut calls: Vec<(String, String, Child)> = (0..per_round)
            .map(|i| {
                let line = format!("r{round}c{i}");
                let d = rng.below(2) as usize;
                let secs = rng.below(3).to_string();
                let child = call(&configs[d], &shared, &line, &secs);
                (line, secs, child)
            })
            .collect();
        // Issue 30's fault: a daemon stopped (SIGSTOP) while a client sends it a call, the
        // client killed before the daemon read it, the daemon resumed. The dead client's call
        // is taken all the same; the agent's retry, from a new process on either daemon, must
        // attach to it.
        {
            let line = format!("r{round}z");
            let d = rng.below(2) as usize;
            let stopped = daemons_on(&configs[d]);
            for pid in &stopped {
                unsafe { libc::kill(*pid as i32, libc::SIGSTOP) };
            }
            let mut orphan = call(&configs[d], &shared, &line, "1");
            std::thread::sleep(Duration::from_millis(300));
            let _ = orphan.kill();
            let _ = orphan.wait();
            for pid in &stopped {
                unsafe { libc::kill(*pid as i32, libc::SIGCONT) };
            }
            let retry = call(&configs[rng.below(2) as usize], &shared, &line, "1");
            calls.push((line, "1".into(), retry));
        }
        std::thread::sleep(Duration::from_millis(100 + rng.below(1500)));
        let victim = rng.below(2) as usize;
        kill_daemons_on(&configs[victim]);
        kills[victim] += 1;
        for (line, secs, child) in calls {
            let first = child.wait_with_output().unwrap();
            let mut out = first;
            let mut attempts = 0;
            // A lost answer is retried as an agent would, on either daemon.
            while !(out.status.code() == Some(0) && stdout(&out) == format!("done {line}\n")) {
                attempts += 1;
                assert!(
                    attempts <= 8,
                    "{line}: no answer after {attempts} retries (seed {seed}): exit {:?} {}",
                    out.status.code(),
                    stderr(&out)
                );
                let d = rng.below(2) as usize;
                out = call(&configs[d], &shared, &line, &secs)
                    .wait_with_output()
                    .unwrap();
            }
            retries += attempts;
            answered.push((line, id_in(&stderr(&out))));
        }
    }

    // What the host ran: `<id> <line>`, one line per execution that started.
    let mut ran: BTreeMap<String, String> = BTreeMap::new();
    let mut lines_ran: BTreeMap<String, String> = BTreeMap::new();
    for entry in env.counter_lines() {
        let (id, line) = entry.split_once(' ').expect("`<id> <line>`");
        assert!(
            ran.insert(id.to_string(), line.to_string()).is_none(),
            "execution {id} ran twice on the host (seed {seed})"
        );
        if let Some(other) = lines_ran.insert(line.to_string(), id.to_string()) {
            panic!("{line} ran under two ids, {other} and {id} (seed {seed})");
        }
    }
    for (line, id) in &answered {
        assert_eq!(
            ran.get(id),
            Some(line),
            "{line}: its answer names {id}, which ran it (seed {seed})"
        );
    }
    for row in shared.sql("SELECT id, state FROM executions").lines() {
        let (id, state) = row.split_once('|').unwrap();
        match state {
            "completed" => assert!(ran.contains_key(id), "{id} completed without running"),
            "failed" => assert!(!ran.contains_key(id), "{id} failed but ran"),
            _ => {}
        }
    }
    let verify = waymark(&configs[0], &shared)
        .args(["audit", "verify"])
        .output()
        .unwrap();
    assert_eq!(verify.status.code(), Some(0), "{}", stderr(&verify));
    for config in &configs {
        kill_daemons_on(config);
    }
    println!(
        "two-daemon chaos: {} actions, kills a={} b={}, {retries} retries, {} executions",
        answered.len(),
        kills[0],
        kills[1],
        ran.len()
    );
}
