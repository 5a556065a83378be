//! Operator reads under faults: a read answers within its deadline with what the ledger knows
//! when the host does not answer, and a read whose daemon connection broke is asked again,
//! while a call whose connection broke never is.

mod common;

use std::io::BufReader;
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use common::{read_until_id, stderr, stdout, wait_for, Env, APPEND_TOOL};

/// How long `exec status --timeout 2` may take end to end, the CLI's own start and a loaded
/// machine included. Without a deadline the read waits for the SSH layer to give up on a dark
/// host: `connect_timeout` plus the keepalive budget, 30 s.
const ANSWERED_WITHIN: Duration = Duration::from_secs(12);

/// The state an execution has in the ledger, read without asking the host (`exec list`).
fn ledger_state(env: &Env, id: &str) -> String {
    let out = env.run(&["--json", "exec", "list", "--limit", "100"]);
    let list: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    list["items"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["id"] == id)
        .and_then(|e| e["state"].as_str())
        .unwrap_or("?")
        .to_string()
}

/// The listening control socket's accept queue: connections the kernel completed that the
/// daemon has not taken yet (a stopped daemon takes none).
fn waiting_connections(env: &Env) -> usize {
    let out = std::process::Command::new("ss")
        .args(["-xlnH", "src"])
        .arg(env.socket())
        .output()
        .expect("`ss` (iproute2) lists the control socket's accept queue");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split_whitespace().nth(2)?.parse::<usize>().ok())
        .sum()
}

/// Starts `waymark ARGS` against a stopped daemon, waits until its request sits unread in the
/// socket's queue, then SIGKILLs the daemon: the client's connection breaks after the request
/// left. Returns the client.
fn send_then_kill_daemon(env: &Env, daemon_pid: u32, args: &[&str]) -> Child {
    unsafe { libc::kill(daemon_pid as i32, libc::SIGSTOP) };
    let client = env
        .cmd()
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    wait_for(
        || waiting_connections(env) >= 1,
        "the client's request to wait in the stopped daemon's queue",
        Duration::from_secs(30),
    );
    unsafe { libc::kill(daemon_pid as i32, libc::SIGKILL) };
    wait_for(
        || common::daemons_on(&env.config).is_empty(),
        "the killed daemon to be gone",
        Duration::from_secs(30),
    );
    client
}

/// Issue 36: ten consecutive `exec status` calls each hung 2-30 s on a host that did not
/// answer. A status read answers within its `--timeout` with the ledger's state and says that
/// the host did not answer in time; the slow read records nothing (the execution stays
/// `running`), and once the host answers again a read records how it ended.
#[test]
fn status_of_a_dark_host_answers_within_its_timeout_from_the_ledger() {
    let env = Env::builder().tools(APPEND_TOOL).fault_proxy().build();
    let mut first = env.start_daemon();
    let mut call = env
        .cmd()
        .args(["exec", "run", "append", "line=a", "secs=6"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let (_, id) = read_until_id(&mut BufReader::new(call.stderr.take().unwrap()));
    wait_for(
        || env.counter_lines().len() == 1,
        "the command to start on the host",
        Duration::from_secs(30),
    );
    // A status read records that it started (its driver records only its end).
    wait_for(
        || env.state(&id) == "running",
        "the ledger to record it running",
        Duration::from_secs(30),
    );
    // The daemon that drives it dies; the next one must ask the host, which is dark.
    first.kill();
    call.wait().unwrap();
    env.proxy().blackhole(true);
    let _second = env.start_daemon();

    for _ in 0..3 {
        let asked = Instant::now();
        let status = env.run(&["exec", "status", &id, "--timeout", "2"]);
        let took = asked.elapsed();
        assert!(
            took < ANSWERED_WITHIN,
            "exec status --timeout 2 took {took:?} on a dark host"
        );
        assert_eq!(
            status.status.code(),
            Some(205),
            "running as the ledger last knew it: {}",
            stderr(&status)
        );
        let text = stdout(&status);
        assert!(text.contains(&format!("{id}  running")), "{text}");
        assert!(text.contains("did not answer in time"), "{text}");
        assert_eq!(
            ledger_state(&env, &id),
            "running",
            "a slow read recorded a loss"
        );
    }
    // `exec result` asks the host too, whether it ended, and for the output so far.
    let asked = Instant::now();
    let result = env.run(&["exec", "result", &id, "--timeout", "2"]);
    let took = asked.elapsed();
    assert!(
        took < ANSWERED_WITHIN,
        "exec result --timeout 2 took {took:?} on a dark host"
    );
    assert_eq!(result.status.code(), Some(205), "{}", stderr(&result));
    assert!(
        stderr(&result).contains("did not answer in time"),
        "{}",
        stderr(&result)
    );
    let json = env.run(&["--json", "exec", "status", &id, "--timeout", "1"]);
    let answer: serde_json::Value = serde_json::from_slice(&json.stdout).unwrap();
    assert!(
        answer["host_check_error"]
            .as_str()
            .is_some_and(|e| e.contains("did not answer in time")),
        "{answer}"
    );

    // The host answers again: a read records how the command ended.
    env.proxy().blackhole(false);
    wait_for(
        || env.run(&["exec", "status", &id]).status.code() == Some(0),
        "the outcome to be recorded once the host answers",
        Duration::from_secs(90),
    );
    assert_eq!(ledger_state(&env, &id), "completed");
    assert_eq!(env.counter_lines(), ["a"]);
}

/// Issue 36: every daemon kill made the reads in flight exit 204 ("the daemon closed the
/// connection before answering"). A read-only request (status, result, explain, list) whose
/// connection broke after it left is sent again, to the daemon the CLI starts in its place.
#[test]
fn a_read_whose_daemon_died_under_it_is_asked_again() {
    let env = Env::builder().tools(APPEND_TOOL).build();
    // Killed below; the daemons the CLI starts in its place, Env kills when dropped.
    let daemon = env.start_daemon();
    let ran = env.run(&["exec", "run", "append", "line=r", "secs=0"]);
    assert_eq!(ran.status.code(), Some(0), "{}", stderr(&ran));
    let id = common::id_in(&stderr(&ran));
    let mut pid = daemon.0.id();

    for read in [
        vec!["exec", "status", id.as_str()],
        vec!["exec", "result", id.as_str()],
        vec!["exec", "explain", id.as_str()],
        vec!["exec", "list"],
    ] {
        let client = send_then_kill_daemon(&env, pid, &read);
        let out = client.wait_with_output().unwrap();
        eprintln!(
            "$ waymark {}\n[exit {:?}]\n{}{}",
            read.join(" "),
            out.status.code(),
            stdout(&out),
            stderr(&out)
        );
        assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
        assert!(
            stdout(&out).contains("completed") || stdout(&out).contains("done r"),
            "{}",
            stdout(&out)
        );
        pid = env.daemon_pid();
    }
    assert_eq!(env.counter_lines(), ["r"]);
}

/// The other side of re-sending reads: a call whose connection broke after it left is never
/// sent again by the CLI (the daemon may have accepted it). It says the outcome is unknown,
/// and nothing ran: the one daemon that got the request died before reading it.
#[test]
fn a_call_whose_daemon_died_under_it_is_not_sent_again() {
    let env = Env::builder().tools(APPEND_TOOL).build();
    let daemon = env.start_daemon();
    let pid = daemon.0.id();

    let client = send_then_kill_daemon(&env, pid, &["exec", "run", "append", "line=c", "secs=0"]);
    let out = client.wait_with_output().unwrap();
    eprintln!(
        "[exit {:?}]\n{}{}",
        out.status.code(),
        stdout(&out),
        stderr(&out)
    );
    assert_eq!(out.status.code(), Some(200), "{}", stderr(&out));
    assert!(stderr(&out).contains("lost the connection to the daemon"));
    // Sent again, the call would have started a daemon and run there before the CLI ended.
    assert!(common::daemons_on(&env.config).is_empty());
    assert!(env.counter_lines().is_empty(), "{:?}", env.counter_lines());
}
