//! The official MCP conformance suite (`@modelcontextprotocol/conformance`, server scenarios)
//! against a real daemon over Streamable HTTP.
//!
//! The suite and the Node it needs (>= 22) are pinned in `tests/conformance/package.json` and
//! its lock file, installed by `common::npm`. The tools the scenarios call by name (`test_simple_text`, ...) are real
//! Waymark tools running real commands on the test kit's sshd. The suite sends no
//! `Authorization` header, so it talks to a loopback proxy that adds the bearer token to every
//! request and changes nothing else; the daemon's own checks (token, `Host`, `Origin`) stay
//! as they are. The run passes only when every failure is in
//! `tests/conformance/baseline.yml` and every scenario there still fails.

mod common;

use std::path::Path;
use std::time::Duration;

use common::*;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};

const TOKEN: &str = "t0ken-for-the-conformance-suite";

/// How long the whole suite may take (it runs in CI on a 2-core machine).
const SUITE_LIMIT: Duration = Duration::from_secs(300);

/// The tools the scenarios call by name, as real commands on the host. Their texts are the
/// ones the scenarios describe.
const SCENARIO_TOOLS: &str = r#"
[tools.test_simple_text]
description = "Prints a simple text (conformance scenario tools-call-simple-text)."
hosts = ["h1"]
argv = ["echo", "This is a simple text response for testing."]
contract = "read_only"

[tools.test_error_handling]
description = "Always fails (conformance scenario tools-call-error)."
hosts = ["h1"]
argv = ["sh", "-c", "echo 'This tool intentionally returns an error for testing' >&2; exit 1"]
contract = "read_only"

[tools.test_tool_with_progress]
description = "Prints three steps, 50 ms apart (conformance scenario tools-call-with-progress)."
hosts = ["h1"]
argv = ["sh", "-c", "echo 0/100; sleep 0.05; echo 50/100; sleep 0.05; echo 100/100"]
contract = "read_only"

[tools.test_tool_with_logging]
description = "Prints three lines, 50 ms apart (conformance scenario tools-call-with-logging)."
hosts = ["h1"]
argv = ["sh", "-c", "echo 'Tool execution started'; sleep 0.05; echo 'Tool processing data'; sleep 0.05; echo 'Tool execution completed'"]
contract = "read_only"
"#;

/// A loopback HTTP/1.1 proxy to `127.0.0.1:upstream` that adds `Authorization: Bearer TOKEN`
/// to every request head and forwards every byte otherwise as it came. Request bodies are
/// framed by `Content-Length` (what the suite's client sends); a chunked request body is
/// refused loudly rather than guessed at. Returns the proxy's port.
///
/// Every request also asks `Connection: close`, one request per connection: the suite's
/// client keeps connections alive, and a request it sent on one the daemon was closing (after
/// a refusal, whose body it does not read) failed now and then on a loaded machine as "other
/// side closed" (the DNS rebinding scenario's second request, once in a few full runs).
async fn bearer_proxy(upstream: u16) -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move {
        loop {
            let Ok((client, _)) = listener.accept().await else {
                return;
            };
            tokio::spawn(async move {
                let Ok(server) = TcpStream::connect(("127.0.0.1", upstream)).await else {
                    return;
                };
                let (client_read, mut client_write) = client.into_split();
                let (mut server_read, mut server_write) = server.into_split();
                let requests = async move {
                    let mut from = BufReader::new(client_read);
                    loop {
                        let mut head = String::new();
                        let mut length = 0usize;
                        loop {
                            let mut line = String::new();
                            if from.read_line(&mut line).await.ok()? == 0 {
                                return None;
                            }
                            if line == "\r\n" || line == "\n" {
                                break;
                            }
                            let lower = line.to_ascii_lowercase();
                            if let Some(v) = lower.strip_prefix("content-length:") {
                                length = v.trim().parse().ok()?;
                            }
                            if lower.starts_with("connection:") {
                                continue;
                            }
                            assert!(
                                !lower.starts_with("transfer-encoding:"),
                                "the proxy does not forward chunked request bodies: {line}"
                            );
                            head.push_str(&line);
                        }
                        head.push_str(&format!(
                            "Authorization: Bearer {TOKEN}\r\nConnection: close\r\n\r\n"
                        ));
                        server_write.write_all(head.as_bytes()).await.ok()?;
                        let mut body = vec![0u8; length];
                        from.read_exact(&mut body).await.ok()?;
                        server_write.write_all(&body).await.ok()?;
                    }
                };
                let responses = async move {
                    let _ = tokio::io::copy(&mut server_read, &mut client_write).await;
                    let _ = client_write.shutdown().await;
                };
                tokio::join!(
                    async {
                        let _: Option<()> = requests.await;
                    },
                    responses
                );
            });
        }
    });
    port
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_official_mcp_conformance_suite_passes_but_for_its_baseline() {
    use std::os::unix::fs::PermissionsExt;
    let suite = npm::installed().await;
    let scratch = tempfile::tempdir().unwrap();
    let token_file = scratch.path().join("agent.token");
    std::fs::write(&token_file, TOKEN).unwrap();
    std::fs::set_permissions(&token_file, std::fs::Permissions::from_mode(0o600)).unwrap();
    let env = Env::builder()
        .daemon_settings(&format!(
            "http_listen = \"127.0.0.1:0\"\nhttp_token_file = \"{}\"",
            token_file.display()
        ))
        .tools(SCENARIO_TOOLS)
        .build();
    let _daemon = env.start_daemon();
    let port = env.listen_addr("http").port();
    let proxy = bearer_proxy(port).await;

    let path = npm::path_with_node(&suite);
    let mut run = tokio::process::Command::new(npm::node_bin(&suite).join("node"));
    run.arg(suite.join("node_modules/@modelcontextprotocol/conformance/dist/index.js"))
        .args(["server", "--url", &format!("http://127.0.0.1:{proxy}/mcp")])
        .arg("--expected-failures")
        .arg(npm::repo_root().join("tests/conformance/baseline.yml"))
        .arg("--output-dir")
        .arg(scratch.path().join("results"))
        .env("PATH", path)
        .env("NO_COLOR", "1")
        .kill_on_drop(true);
    let out = tokio::time::timeout(SUITE_LIMIT, run.output())
        .await
        .unwrap_or_else(|_| panic!("the conformance suite took over {SUITE_LIMIT:?}"))
        .expect("the conformance suite runs");
    let report = format!(
        "{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    println!("{report}");
    let failed = failed_checks(&scratch.path().join("results"));
    println!("{failed}");
    assert!(
        out.status.success(),
        "the conformance suite found failures outside tests/conformance/baseline.yml, or \
         baseline entries that now pass ({}):\n{report}\nfailed checks:\n{failed}",
        out.status
    );
}

/// Every check the suite saved under `results` that did not succeed: scenario, check and
/// message, one a line (the suite's summary names only the scenarios).
fn failed_checks(results: &Path) -> String {
    let mut lines = Vec::new();
    let mut dirs = vec![results.to_path_buf()];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
            let path = entry.path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.file_name().is_some_and(|n| n == "checks.json") {
                let text = std::fs::read_to_string(&path).unwrap_or_default();
                let checks: serde_json::Value = serde_json::from_str(&text).unwrap_or_default();
                for c in checks.as_array().into_iter().flatten() {
                    if c["status"] != "SUCCESS" {
                        lines.push(format!(
                            "{} {} {}: {}",
                            path.parent().unwrap().display(),
                            c["id"],
                            c["status"],
                            c["errorMessage"]
                        ));
                    }
                }
            }
        }
    }
    lines.sort();
    lines.join("\n")
}
