//! The official MCP Inspector's command line (`@modelcontextprotocol/inspector` 2.x, `--cli`)
//! against `waymark mcp` over stdio and the daemon over Streamable HTTP: what a developer
//! trying Waymark with the Inspector sees. The Inspector declares the tasks extension at
//! `initialize`; a plain `tools/call` must still show the call's result, under the session
//! protocol and the stateless one (2026-07-28). Pinned with the conformance suite in `tests/conformance/package.json`.

mod common;

use std::path::Path;
use std::process::Output;
use std::time::Duration;

use common::*;
use serde_json::Value;

const TOKEN: &str = "t0ken-for-the-inspector";

/// How long one Inspector run may take (Node starts slowly on a loaded 2-core machine).
const RUN_LIMIT: Duration = Duration::from_secs(90);

/// Runs the Inspector's CLI with `args`; its JSON answer is on stdout.
async fn inspector(installed: &Path, args: &[&str]) -> Output {
    let launcher = installed
        .join("node_modules/@modelcontextprotocol/inspector/clients/launcher/build/index.js");
    let mut run = tokio::process::Command::new(npm::node_bin(installed).join("node"));
    run.arg(launcher)
        .arg("--cli")
        .args(args)
        .env("PATH", npm::path_with_node(installed))
        .env("NO_COLOR", "1")
        // Its catalog of servers goes to a scratch home, not the user's.
        .env("HOME", installed.join("home"))
        .kill_on_drop(true);
    let out = tokio::time::timeout(RUN_LIMIT, run.output())
        .await
        .unwrap_or_else(|_| panic!("the Inspector took over {RUN_LIMIT:?}: {args:?}"))
        .expect("the Inspector runs");
    eprintln!(
        "$ inspector --cli {}\n[exit {:?}]\n{}{}",
        args.join(" "),
        out.status.code(),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// The Inspector's answer as JSON, after checking it exited 0.
fn answer(out: &Output) -> Value {
    assert!(
        out.status.success(),
        "the Inspector failed: {}",
        stderr(out)
    );
    serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("not JSON ({e}): {}", stdout(out)))
}

/// The text of a `tools/call` answer's content.
fn result_text(v: &Value) -> String {
    assert_ne!(v["resultType"], "task", "a task handle, not a result: {v}");
    assert_ne!(v["isError"], true, "{v}");
    v["content"]
        .as_array()
        .unwrap_or_else(|| panic!("no content: {v}"))
        .iter()
        .filter_map(|c| c["text"].as_str())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_mcp_inspector_lists_the_tools_and_shows_a_calls_result_over_stdio_and_http() {
    use std::os::unix::fs::PermissionsExt;
    let installed = npm::installed().await;
    let scratch = tempfile::tempdir().unwrap();
    let token_file = scratch.path().join("agent.token");
    std::fs::write(&token_file, TOKEN).unwrap();
    std::fs::set_permissions(&token_file, std::fs::Permissions::from_mode(0o600)).unwrap();
    let env = Env::mcp_builder()
        .daemon_settings(&format!(
            "http_listen = \"127.0.0.1:0\"\nhttp_token_file = \"{}\"",
            token_file.display()
        ))
        .build();
    let _daemon = env.start_daemon();
    let port = env.listen_addr("http").port();
    let config_env = format!("WAYMARK_CONFIG={}", env.config.display());
    let stdio = [
        "-e",
        &config_env,
        "-e",
        "WAYMARK_LOG=warn",
        "--",
        bin(),
        "mcp",
    ];
    let url = format!("http://127.0.0.1:{port}/mcp");
    let bearer = format!("Authorization: Bearer {TOKEN}");
    let http = [
        "--transport",
        "http",
        "--server-url",
        &url,
        "--header",
        &bearer,
    ];

    // Every tool, with schemas the Inspector finds portable (--strict exits 6 otherwise).
    let listed = answer(
        &inspector(
            &installed,
            &[&["--method", "tools/list", "--strict"][..], &stdio[..]].concat(),
        )
        .await,
    );
    let names: Vec<&str> = listed["tools"]
        .as_array()
        .unwrap_or_else(|| panic!("no tools: {listed}"))
        .iter()
        .filter_map(|t| t["name"].as_str())
        .collect();
    for want in ["ssh_exec", "exec_status", "append", "guarded", "peek"] {
        assert!(names.contains(&want), "{want} missing from {names:?}");
    }

    // A call shows its result, not a task handle, though the Inspector declares tasks.
    let call = [
        "--method",
        "tools/call",
        "--tool-name",
        "append",
        "--tool-arg",
        "line=inspected",
        "secs=0",
    ];
    let first = answer(&inspector(&installed, &[&call[..], &stdio[..]].concat()).await);
    assert!(result_text(&first).contains("done inspected"), "{first}");

    // The same call again (another Inspector, so another shim, the same actor) is a retry:
    // it attaches and shows the same result.
    let again = answer(&inspector(&installed, &[&call[..], &stdio[..]].concat()).await);
    let said = result_text(&again);
    assert!(said.contains("done inspected"), "{again}");
    assert_eq!(said.matches("ttached").count(), 1, "said once: {said}");
    assert!(said.contains("it already ran"), "{said}");

    // Over HTTP (its actor is the bearer token's), under the session protocol, then retried
    // under the stateless one (2026-07-28, "modern" to the Inspector): one run.
    let over_http = |era: &'static str| {
        [
            "--method",
            "tools/call",
            "--tool-name",
            "append",
            "--protocol-era",
            era,
            "--tool-arg",
            "line=over-http",
            "secs=0",
        ]
    };
    for era in ["legacy", "modern"] {
        let args = [&over_http(era)[..], &http[..]].concat();
        let v = answer(&inspector(&installed, &args).await);
        assert!(result_text(&v).contains("done over-http"), "{era}: {v}");
    }

    let lines = env.counter_lines();
    assert_eq!(
        lines.iter().filter(|l| *l == "inspected").count(),
        1,
        "ran once: {lines:?}"
    );
    assert_eq!(
        lines.iter().filter(|l| *l == "over-http").count(),
        1,
        "{lines:?}"
    );
}
