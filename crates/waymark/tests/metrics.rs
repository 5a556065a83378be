//! The daemon's Prometheus endpoint (`[daemon] metrics_listen`), scraped over real HTTP while
//! the daemon runs real actions on the test kit's sshd: a completed call, an attached retry,
//! a call awaiting approval, an unknown outcome cut by the fault proxy, a restart.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::Stdio;
use std::time::Duration;

use common::{id_in, stderr, wait_for, Env, APPEND_TOOL, GUARDED_ECHO_TOOL};

/// One HTTP/1.1 exchange on a fresh connection: the status, the headers (names lower case) and
/// the body.
fn http(port: u16, request: &[u8]) -> (u16, Vec<(String, String)>, String) {
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    s.write_all(request).unwrap();
    let mut raw = String::new();
    s.read_to_string(&mut raw).unwrap();
    let (head, body) = raw
        .split_once("\r\n\r\n")
        .unwrap_or_else(|| panic!("an HTTP answer, got {raw:?}"));
    let mut lines = head.lines();
    let status = lines
        .next()
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|c| c.parse().ok())
        .unwrap_or_else(|| panic!("a status line in {head:?}"));
    let headers = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string()))
        .collect();
    (status, headers, body.to_string())
}

fn get(port: u16, path: &str) -> (u16, Vec<(String, String)>, String) {
    http(
        port,
        format!("GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nConnection: close\r\n\r\n")
            .as_bytes(),
    )
}

/// `name{labels} value`.
struct Sample {
    name: String,
    labels: Vec<(String, String)>,
    value: f64,
}

/// The parsed text format: one sample per line.
struct Scrape(Vec<Sample>);

impl Scrape {
    fn of(port: u16) -> Scrape {
        let (status, headers, body) = get(port, "/metrics");
        assert_eq!(status, 200, "{body}");
        let ct = headers
            .iter()
            .find(|(k, _)| k == "content-type")
            .map(|(_, v)| v.as_str());
        assert_eq!(ct, Some("text/plain; version=0.0.4; charset=utf-8"));
        let mut samples = Vec::new();
        for line in body
            .lines()
            .filter(|l| !l.starts_with('#') && !l.is_empty())
        {
            let (series, value) = line.rsplit_once(' ').expect("name value");
            let (name, labels) = match series.split_once('{') {
                Some((n, rest)) => {
                    let rest = rest.strip_suffix('}').expect("closing brace");
                    let labels = rest
                        .split(',')
                        .filter(|p| !p.is_empty())
                        .map(|p| {
                            let (k, v) = p.split_once('=').expect("label=value");
                            (k.to_string(), v.trim_matches('"').to_string())
                        })
                        .collect();
                    (n, labels)
                }
                None => (series, Vec::new()),
            };
            let value = match value {
                "+Inf" => f64::INFINITY,
                v => v.parse().unwrap_or_else(|_| panic!("a number in {line:?}")),
            };
            samples.push(Sample {
                name: name.to_string(),
                labels,
                value,
            });
        }
        Scrape(samples)
    }

    /// The sample `name` with exactly `labels` (any order); `None` when absent.
    fn get(&self, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
        self.0
            .iter()
            .find(|s| {
                s.name == name
                    && s.labels.len() == labels.len()
                    && labels
                        .iter()
                        .all(|(k, v)| s.labels.iter().any(|(lk, lv)| lk == k && lv == v))
            })
            .map(|s| s.value)
    }

    fn value(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        self.get(name, labels)
            .unwrap_or_else(|| panic!("no sample {name}{labels:?} in the scrape"))
    }

    /// Dispatches of `tool` over SSH that the host answered.
    fn dispatches(&self, tool: &str) -> f64 {
        self.get(
            "waymark_dispatch_duration_seconds_count",
            &[("tool", tool), ("channel", "ssh")],
        )
        .unwrap_or(0.0)
    }
}

/// The endpoint on port 0: the daemon says which port it got ([`Env::listen_addr`]).
fn metrics_env() -> Env {
    Env::builder()
        .raw_commands()
        .tools(APPEND_TOOL)
        .tools(GUARDED_ECHO_TOOL)
        .fault_proxy()
        .daemon_settings("metrics_listen = \"127.0.0.1:0\"")
        .build()
}

const APPROVAL_WAIT: (&str, &str) = ("WAYMARK_APPROVAL_WAIT_SECS", "1");

#[test]
fn scraping_the_endpoint_shows_what_the_daemon_did_and_what_the_ledger_holds_after_a_restart() {
    let env = metrics_env();
    let mut daemon = env.start_daemon_with(&[APPROVAL_WAIT], Stdio::inherit());
    let port = env.listen_addr("metrics").port();
    let unknown = [("state", "unknown"), ("tool", "append")];
    let waiting = [("state", "awaiting_approval"), ("tool", "guarded")];

    let before = Scrape::of(port);
    assert_eq!(before.value("waymark_executions", &unknown), 0.0);
    assert_eq!(before.value("waymark_executions", &waiting), 0.0);
    assert_eq!(before.value("waymark_approvals_waiting", &[]), 0.0);
    assert_eq!(
        before.value("waymark_ssh_pool_connections", &[("host", "h1")]),
        0.0
    );
    assert_eq!(before.dispatches("append"), 0.0);
    // Counters exist at zero before their first event, and raw commands have their gauges.
    assert_eq!(
        before.value("waymark_unknown_outcomes_total", &[("tool", "append")]),
        0.0
    );
    assert_eq!(
        before.value(
            "waymark_attached_retries_total",
            &[("tool", "append"), ("action", "return_stored_result")]
        ),
        0.0
    );
    assert_eq!(
        before.value(
            "waymark_executions",
            &[("state", "running"), ("tool", "ssh_exec")]
        ),
        0.0
    );
    let flushes_before = before.value("waymark_ledger_flushes_total", &[]);

    // A completed call: one dispatch answered, flushes made, a pooled connection.
    let done = env.run(&["exec", "run", "append", "line=a", "secs=0"]);
    assert_eq!(done.status.code(), Some(0), "{}", stderr(&done));
    let after_call = Scrape::of(port);
    assert_eq!(after_call.dispatches("append"), 1.0);
    let flushes = after_call.value("waymark_ledger_flushes_total", &[]);
    assert!(
        flushes >= flushes_before + 2.0,
        "a call flushes twice: {flushes_before} -> {flushes}"
    );
    assert_eq!(
        after_call.value("waymark_ledger_flush_duration_seconds_count", &[]),
        flushes,
        "the histogram holds one observation per flush"
    );
    assert_eq!(
        after_call.value("waymark_ssh_pool_connections", &[("host", "h1")]),
        1.0
    );

    // The same call again, within the tool's dedup window: it attaches, nothing is sent.
    let again = env.run(&["exec", "run", "append", "line=a", "secs=0"]);
    assert_eq!(again.status.code(), Some(0), "{}", stderr(&again));
    let after_retry = Scrape::of(port);
    assert_eq!(
        after_retry.value(
            "waymark_attached_retries_total",
            &[("tool", "append"), ("action", "return_stored_result")]
        ),
        1.0
    );
    assert_eq!(after_retry.dispatches("append"), 1.0);
    assert_eq!(env.counter_lines(), ["a"]);

    // A call that waits for an operator's approval.
    let pending = env.run(&["exec", "run", "guarded", "line=x"]);
    assert_eq!(pending.status.code(), Some(202), "{}", stderr(&pending));
    let with_approval = Scrape::of(port);
    assert_eq!(with_approval.value("waymark_executions", &waiting), 1.0);
    assert_eq!(with_approval.value("waymark_approvals_waiting", &[]), 1.0);

    // A connection cut while the command runs: the outcome is unknown.
    let cut = env
        .cmd()
        .args(["exec", "run", "append", "line=u", "secs=5"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    wait_for(
        || env.counter_lines().len() == 2,
        "the command to start on the host",
        Duration::from_secs(30),
    );
    env.proxy().cut_all();
    let cut = cut.wait_with_output().unwrap();
    assert_eq!(cut.status.code(), Some(200), "unknown: {}", stderr(&cut));
    let unknown_id = id_in(&stderr(&cut));
    let with_unknown = Scrape::of(port);
    assert_eq!(
        with_unknown.value("waymark_unknown_outcomes_total", &[("tool", "append")]),
        1.0
    );
    assert_eq!(with_unknown.value("waymark_executions", &unknown), 1.0);
    assert_eq!(
        with_unknown.dispatches("append"),
        1.0,
        "a cut dispatch was never answered"
    );

    // A restart: the counters start again, the gauges read the ledger, which kept the
    // approval waiting (the unknown one is settled by reconcile through the marker).
    daemon.kill();
    let _daemon = env.start_daemon_with(&[APPROVAL_WAIT], Stdio::inherit());
    let port = env.listen_addr("metrics").port();
    wait_for(
        || env.state(&unknown_id) == "completed",
        "reconcile to settle the unknown execution from its marker",
        Duration::from_secs(30),
    );
    let restarted = Scrape::of(port);
    assert_eq!(restarted.value("waymark_executions", &waiting), 1.0);
    assert_eq!(restarted.value("waymark_approvals_waiting", &[]), 1.0);
    assert_eq!(restarted.value("waymark_executions", &unknown), 0.0);
    assert_eq!(
        restarted.get("waymark_unknown_outcomes_total", &[("tool", "append")]),
        Some(0.0),
        "a restart starts the counters again, at zero"
    );
    assert_eq!(restarted.dispatches("append"), 0.0);
}

/// An HTTP tool's dispatch is timed on its own channel, once per answered request, and a
/// retry that takes the stored answer sends (and times) nothing.
#[test]
fn an_http_dispatch_is_timed_on_the_http_channel() {
    let api = waymark_testkit::TestHttpApi::start();
    let env = Env::builder()
        .tools(&format!(
            r#"
[tools.pay]
description = "Charges an amount."
channel = "http"
method = "POST"
url = "{}"
body = {{ amount = "{{amount}}" }}
contract = "idempotent"
dedup_window = "1h"

[tools.pay.args.amount]
type = "integer"
"#,
            api.url("/payments")
        ))
        .daemon_settings("metrics_listen = \"127.0.0.1:0\"")
        .build();
    let _daemon = env.start_daemon();
    let port = env.listen_addr("metrics").port();
    let http = [("tool", "pay"), ("channel", "http")];
    let count = "waymark_dispatch_duration_seconds_count";
    assert_eq!(Scrape::of(port).get(count, &http), None);
    for _ in 0..2 {
        let paid = env.run(&["exec", "run", "pay", "amount=5"]);
        assert_eq!(paid.status.code(), Some(0), "{}", stderr(&paid));
    }
    let scrape = Scrape::of(port);
    assert_eq!(scrape.value(count, &http), 1.0);
    assert_eq!(api.effects(), 1);
}

#[test]
fn the_endpoint_answers_only_get_metrics_and_garbage_hurts_nothing() {
    let env = metrics_env();
    let _daemon = env.start_daemon();
    let port = env.listen_addr("metrics").port();
    let (status, _, _) = get(port, "/");
    assert_eq!(status, 404);
    let (status, _, _) = get(port, "/metrics/extra");
    assert_eq!(status, 404);
    let (status, _, _) = http(
        port,
        format!("POST /metrics HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
            .as_bytes(),
    );
    assert_eq!(status, 405);
    // Bytes that are not HTTP: the connection is answered 400 or closed, nothing else.
    let mut garbage = TcpStream::connect(("127.0.0.1", port)).unwrap();
    garbage
        .set_read_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    let _ = garbage.write_all(b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03\r\n\r\n\0\0\xff");
    let mut answer = Vec::new();
    let _ = garbage.read_to_end(&mut answer);
    let answer = String::from_utf8_lossy(&answer);
    assert!(
        answer.is_empty() || answer.starts_with("HTTP/1.1 400"),
        "{answer:?}"
    );
    // A head that never ends, and a connection that says nothing, stay open alongside.
    let mut half = TcpStream::connect(("127.0.0.1", port)).unwrap();
    half.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")
        .unwrap();
    let _silent = TcpStream::connect(("127.0.0.1", port)).unwrap();
    // The endpoint and the daemon still answer.
    let scrape = Scrape::of(port);
    assert_eq!(scrape.value("waymark_approvals_waiting", &[]), 0.0);
    let done = env.run(&["exec", "run", "append", "line=b", "secs=0"]);
    assert_eq!(done.status.code(), Some(0), "{}", stderr(&done));
    assert_eq!(Scrape::of(port).dispatches("append"), 1.0);
}

#[test]
fn a_metrics_address_off_loopback_is_refused_at_its_line_by_config_check_and_the_daemon() {
    let env = Env::builder()
        .tools(APPEND_TOOL)
        .daemon_settings("metrics_listen = \"0.0.0.0:9464\"")
        .build();
    let text = std::fs::read_to_string(&env.config).unwrap();
    let line = text
        .lines()
        .position(|l| l.starts_with("metrics_listen"))
        .unwrap()
        + 1;
    let at = format!("{}:{line}:18:", env.config.display());
    let check = env.run(&["config", "check"]);
    assert_eq!(check.status.code(), Some(2));
    assert!(stderr(&check).contains(&at), "{}", stderr(&check));
    assert!(
        stderr(&check).contains("only a loopback address"),
        "{}",
        stderr(&check)
    );
    let daemon = env
        .cmd()
        .arg("daemon")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // A daemon that took the address would run on: it is killed (on drop) and the test fails.
    let mut daemon = common::Daemon(daemon);
    wait_for(
        || daemon.0.try_wait().unwrap().is_some(),
        "the daemon to refuse the configuration",
        Duration::from_secs(20),
    );
    assert_eq!(daemon.0.try_wait().unwrap().and_then(|s| s.code()), Some(2));
    let mut said = String::new();
    daemon
        .0
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut said)
        .unwrap();
    assert!(said.contains(&at), "{said}");
}

/// A tool a reload adds has its series from the next scrape: its executions gauges and its
/// counters at zero, as the tools configured at start have theirs.
#[test]
fn a_tool_added_by_a_reload_has_its_series_at_zero() {
    let env = Env::builder()
        .tools(APPEND_TOOL)
        .daemon_settings("metrics_listen = \"127.0.0.1:0\"")
        .build();
    let _daemon = env.start_daemon();
    let port = env.listen_addr("metrics").port();
    let series = [("state", "unknown"), ("tool", "append2")];
    assert_eq!(Scrape::of(port).get("waymark_executions", &series), None);
    let text = std::fs::read_to_string(&env.config).unwrap()
        + &APPEND_TOOL
            .replace("[tools.append", "[tools.append2")
            .replace("{counter}", &env.counter.display().to_string());
    std::fs::write(&env.config, text).unwrap();
    let out = env.run(&["daemon", "reload"]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let after = Scrape::of(port);
    assert_eq!(after.value("waymark_executions", &series), 0.0);
    assert_eq!(
        after.value("waymark_unknown_outcomes_total", &[("tool", "append2")]),
        0.0
    );
}
