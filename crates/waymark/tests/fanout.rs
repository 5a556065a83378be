//! Fan-out end to end: one tool call on three hosts, each its own real sshd, through the real
//! daemon (CLI and MCP). Each host's counter file (`$HOME/counter` there) gets one line per
//! execution that ran on it, the execution's ID, so a second run on a host shows as a second
//! line.

mod common;

use std::process::{Output, Stdio};
use std::time::Duration;

use serde_json::{json, Value};

use common::{bounded, call, stderr, structured, text, wait_for, Env};

/// `mark`, on `h1`, `h2`, `h3`: appends its execution ID to `$HOME/counter`, sleeps `secs`,
/// prints `marked <line>` and, on stderr, `noted <line>` (status_check, 10 min retry window).
const MARK_TOOL: &str = r#"
[tools.mark]
description = "Mark the host with this execution's ID."
hosts = ["h1", "h2", "h3"]
argv = ["sh", "-c", "echo \"$WAYMARK_EXECUTION_ID\" >> \"$HOME/counter\"; sleep \"$2\"; echo marked \"$1\"; echo noted \"$1\" >&2", "mark", "{line}", "{secs}"]
contract = "status_check"
retry_window = "10m"
dedup_window = "1h"
timeout = "60s"

[tools.mark.args.line]
type = "string"
pattern = "[a-z0-9-]+"

[tools.mark.args.secs]
type = "integer"
"#;

fn env() -> Env {
    Env::builder().extra_hosts(2).tools(MARK_TOOL).build()
}

const HOSTS: [&str; 3] = ["h1", "h2", "h3"];

/// `waymark --json exec run mark --all-hosts line=LINE secs=SECS`: its exit code and document.
fn fan_out_json(env: &Env, line: &str, secs: u32) -> (Option<i32>, Value) {
    let out = fan_out(env, &["--json"], line, secs);
    let doc = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("--json prints one document ({e}): {}", stderr(&out)));
    (out.status.code(), doc)
}

fn fan_out(env: &Env, extra: &[&str], line: &str, secs: u32) -> Output {
    let line = format!("line={line}");
    let secs = format!("secs={secs}");
    let mut args: Vec<&str> = extra.to_vec();
    args.extend(["exec", "run", "mark", "--all-hosts", &line, &secs]);
    env.run(&args)
}

/// Each host's execution ID in a fan-out document, in host order.
fn ids(doc: &Value) -> Vec<String> {
    doc["hosts"]
        .as_array()
        .expect("hosts is an array")
        .iter()
        .map(|h| h["execution"]["id"].as_str().expect("an id").to_string())
        .collect()
}

/// The counter lines of `h1`, `h2`, `h3`.
fn counters(env: &Env) -> Vec<Vec<String>> {
    (1..=3).map(|n| env.host_counter_lines(n)).collect()
}

#[test]
fn a_fan_out_runs_once_on_each_host_and_its_retry_attaches_per_host() {
    let env = env();
    let _daemon = env.start_daemon();

    let (code, doc) = fan_out_json(&env, "a", 0);
    assert_eq!(code, Some(0), "every host completed with 0: {doc}");
    assert_eq!(doc["tool"], "mark");
    let hosts = doc["hosts"].as_array().unwrap();
    assert_eq!(
        hosts.iter().map(|h| h["host"].clone()).collect::<Vec<_>>(),
        json!(HOSTS).as_array().unwrap().clone(),
        "one entry per host, in the tool's order"
    );
    let first = ids(&doc);
    for (h, id) in hosts.iter().zip(&first) {
        assert_eq!(h["exit"], 0, "{h}");
        assert_eq!(h["error"], Value::Null, "{h}");
        assert_eq!(h["execution"]["state"], "completed", "{h}");
        assert_eq!(h["execution"]["host"], h["host"], "{h}");
        assert_eq!(h["execution"]["attached"], Value::Null, "{h}");
        assert_eq!(h["execution"]["stdout"], "marked a\n", "{h}");
        assert!(id.starts_with("act_"), "{id}");
    }
    let distinct: std::collections::BTreeSet<&String> = first.iter().collect();
    assert_eq!(distinct.len(), 3, "one execution ID per host: {first:?}");
    let expected: Vec<Vec<String>> = first.iter().map(|id| vec![id.clone()]).collect();
    assert_eq!(
        counters(&env),
        expected,
        "each host ran its own execution once"
    );
    // The answer was written whole: each host's result counts as delivered (the daemon marks it
    // once the write returned, which may be just after the CLI read it).
    wait_for(
        || {
            let records = env.ledger_records();
            first
                .iter()
                .all(|id| records[id]["result_delivered"] == true)
        },
        "each host's result to be marked delivered",
        Duration::from_secs(20),
    );

    // The same call again attaches per host: the stored results, nothing runs again.
    let (code, again) = fan_out_json(&env, "a", 0);
    assert_eq!(code, Some(0), "{again}");
    assert_eq!(
        ids(&again),
        first,
        "each host attached to its first execution"
    );
    for h in again["hosts"].as_array().unwrap() {
        assert_eq!(h["execution"]["attached"], "return_stored_result", "{h}");
        assert_eq!(h["execution"]["stdout"], "marked a\n", "{h}");
    }
    assert_eq!(counters(&env), expected, "the retry ran nothing");

    // A host's execution is the one a single-host call of the tool on that host would make:
    // that call attaches to it too.
    let single = env.run(&[
        "--json", "exec", "run", "mark", "--host", "h2", "line=a", "secs=0",
    ]);
    assert_eq!(single.status.code(), Some(0), "{}", stderr(&single));
    let single: Value = serde_json::from_slice(&single.stdout).unwrap();
    assert_eq!(single["id"].as_str(), Some(first[1].as_str()));
    assert_eq!(counters(&env), expected);
    assert_eq!(
        env.executions().len(),
        3,
        "three executions in the ledger, no more"
    );
}

#[test]
fn a_fan_out_prints_each_hosts_id_its_output_by_host_and_a_summary_table() {
    let env = env();
    let _daemon = env.start_daemon();
    let out = fan_out(&env, &[], "t", 0);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let ids: Vec<String> = counters(&env).into_iter().flatten().collect();
    assert_eq!(ids.len(), 3);
    let (stdout, err) = (common::stdout(&out), stderr(&out));
    for (host, id) in HOSTS.iter().zip(&ids) {
        assert!(
            err.contains(&format!("{host}: execution {id}")),
            "stderr names {host}'s execution as it is accepted:\n{err}"
        );
        assert!(
            stdout.contains(&format!("== {host}: {id} completed, exit 0\nmarked t\n")),
            "stdout groups {host}'s output under it:\n{stdout}"
        );
        assert!(
            err.contains(&format!("== {host}: {id} completed, exit 0\nnoted t\n")),
            "stderr labels {host}'s lines too:\n{err}"
        );
        let row = stdout
            .lines()
            .find(|l| l.starts_with(host) && l.contains(id.as_str()))
            .unwrap_or_else(|| panic!("the summary has a row for {host}:\n{stdout}"));
        let cells: Vec<&str> = row.split_whitespace().collect();
        assert_eq!(cells, [host, id.as_str(), "completed", "0"], "{row}");
    }
    assert!(stdout.contains("HOST"), "{stdout}");
}

#[test]
fn a_host_that_is_down_did_not_start_the_others_complete_and_the_retry_starts_only_it() {
    let env = env();
    let _daemon = env.start_daemon();
    env.host_sshd(3).stop();

    let (code, doc) = fan_out_json(&env, "d", 0);
    assert_eq!(
        code,
        Some(201),
        "a host that did not start makes the fan-out 201: {doc}"
    );
    let hosts = doc["hosts"].as_array().unwrap();
    for h in &hosts[..2] {
        assert_eq!(h["exit"], 0, "{h}");
        assert_eq!(h["execution"]["state"], "completed", "{h}");
    }
    assert_eq!(hosts[2]["exit"], 201, "{}", hosts[2]);
    assert_eq!(hosts[2]["execution"]["state"], "failed", "{}", hosts[2]);
    let first = ids(&doc);
    assert_eq!(
        counters(&env),
        vec![vec![first[0].clone()], vec![first[1].clone()], vec![]],
        "h1 and h2 ran once, h3 not at all"
    );

    // h3 is back: the same call attaches on h1 and h2 and starts h3's for the first time.
    env.host_sshd(3).start();
    let (code, again) = fan_out_json(&env, "d", 0);
    assert_eq!(code, Some(0), "{again}");
    let second = ids(&again);
    assert_eq!(second[..2], first[..2], "h1 and h2 attached");
    assert_ne!(
        second[2], first[2],
        "h3's failed start made nothing to attach to"
    );
    assert_eq!(
        counters(&env),
        vec![
            vec![first[0].clone()],
            vec![first[1].clone()],
            vec![second[2].clone()]
        ],
        "every host ran once"
    );
}

#[test]
fn a_fan_out_whose_caller_vanished_is_followed_per_host_by_its_retry_never_run_twice() {
    let env = env();
    let _daemon = env.start_daemon();
    let mut first = env
        .cmd()
        .args(["exec", "run", "mark", "--all-hosts", "line=v", "secs=3"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    wait_for(
        || counters(&env).iter().all(|c| c.len() == 1),
        "every host started the command",
        Duration::from_secs(30),
    );
    first.kill().unwrap();
    first.wait().unwrap();
    let started: Vec<String> = counters(&env).into_iter().flatten().collect();

    let (code, doc) = fan_out_json(&env, "v", 3);
    assert_eq!(
        code,
        Some(0),
        "the retry followed each host to its end: {doc}"
    );
    assert_eq!(
        ids(&doc),
        started,
        "each host attached to the execution it runs"
    );
    for h in doc["hosts"].as_array().unwrap() {
        assert_ne!(h["execution"]["attached"], Value::Null, "{h}");
        assert_eq!(h["execution"]["stdout"], "marked v\n", "{h}");
    }
    let once: Vec<Vec<String>> = started.iter().map(|id| vec![id.clone()]).collect();
    assert_eq!(counters(&env), once, "nothing ran twice on any host");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_mcp_call_with_all_hosts_runs_once_per_host_and_answers_for_each() {
    bounded(async {
        let env = env();
        let _daemon = env.start_daemon();
        let (client, _) = env.client().await;
        let tools = client.list_all_tools().await.unwrap();
        let mark = tools.iter().find(|t| t.name == "mark").unwrap();
        let schema = Value::Object((*mark.input_schema).clone());
        assert_eq!(schema["properties"]["all_hosts"]["type"], "boolean");
        assert!(
            !schema["required"]
                .as_array()
                .unwrap()
                .contains(&json!("host")),
            "with all_hosts, host is not required: {schema}"
        );
        assert!(
            mark.description.as_deref().unwrap().contains("all_hosts"),
            "the description says how to run it on every host"
        );

        let a = json!({"all_hosts": true, "line": "m", "secs": 0});
        let r = client.call_tool(call("mark", a.clone())).await.unwrap();
        assert_eq!(r.is_error, Some(false), "{}", text(&r));
        let s = structured(&r);
        let hosts = s["hosts"].as_array().unwrap();
        assert_eq!(hosts.len(), 3, "{s}");
        let first = ids(&s);
        for (h, name) in hosts.iter().zip(HOSTS) {
            assert_eq!(h["host"], name);
            assert_eq!(h["execution"]["state"], "completed", "{h}");
            assert_eq!(h["execution"]["stdout"], "marked m\n", "{h}");
        }
        let t = text(&r);
        for (name, id) in HOSTS.iter().zip(&first) {
            assert!(
                t.contains(&format!("{name}: {id}")),
                "a section per host:\n{t}"
            );
        }
        let once: Vec<Vec<String>> = first.iter().map(|id| vec![id.clone()]).collect();
        assert_eq!(counters(&env), once);
        for id in &first {
            common::wait_delivered(&env, id).await;
        }

        let again = client.call_tool(call("mark", a)).await.unwrap();
        assert_eq!(
            ids(&structured(&again)),
            first,
            "the retry attached per host"
        );
        assert_eq!(counters(&env), once, "nothing ran twice");
        client.cancel().await.unwrap();
    })
    .await;
}

#[test]
fn a_fan_out_over_more_hosts_than_its_bound_runs_at_most_the_bound_at_once() {
    let limit = waymark_gateway::flow::FAN_OUT_PARALLEL;
    let n = limit + 4;
    let hosts: Vec<String> = (1..=n).map(|i| format!("\"h{i}\"")).collect();
    // Every host appends to one file on this machine (h1's counter): `+` when its command
    // starts, `-` when it ends, so the file's order says how many ran at once.
    let tool = format!(
        r#"
[tools.hold]
description = "Hold a place for two seconds."
hosts = [{}]
argv = ["sh", "-c", "echo + >> {{counter}}; sleep 2; echo - >> {{counter}}"]
contract = "idempotent"
timeout = "60s"
"#,
        hosts.join(", ")
    );
    let env = Env::builder().extra_hosts(n - 1).tools(&tool).build();
    let _daemon = env.start_daemon();
    let out = env.run(&["--json", "exec", "run", "hold", "--all-hosts"]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let doc: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(doc["hosts"].as_array().unwrap().len(), n);
    let lines = env.counter_lines();
    assert_eq!(lines.len(), 2 * n, "every host ran once: {lines:?}");
    let (mut now, mut most) = (0usize, 0usize);
    for l in &lines {
        if l == "+" {
            now += 1;
            most = most.max(now);
        } else {
            now -= 1;
        }
    }
    assert!(
        most > 1,
        "hosts ran at once, not one after the other: {lines:?}"
    );
    assert!(
        most <= limit,
        "at most {limit} hosts at once, saw {most}: {lines:?}"
    );
}
