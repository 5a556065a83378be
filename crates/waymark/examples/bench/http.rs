//! The HTTP channel's row: a durable HTTP action (accepted, authorized and dispatched flushed
//! before the request leaves, the answer flushed after) against a plain `curl` of the same
//! test-kit API endpoint, interleaved in one run.

use std::process::{Command, Stdio};

use serde_json::{Map, Value};
use waymark_protocol::client::request;
use waymark_protocol::{Frame, Request};
use waymark_testkit::TestHttpApi;

use super::{fmt_ms, fresh_id, median, ms, percentile, timed, Env, Table};

/// The tool the row calls: `POST /payments` with a distinct amount per call, keyed by the
/// execution ID.
pub fn tool(api: &TestHttpApi) -> String {
    format!(
        r#"
[tools.pay]
description = "POST /payments on the test kit's API; a distinct amount per call."
channel = "http"
method = "POST"
url = "{}"
body = {{ amount = "{{amount}}" }}
contract = "idempotent"
timeout = "30s"

[tools.pay.args.amount]
type = "integer"
"#,
        api.url("/payments")
    )
}

fn curl(api: &TestHttpApi, amount: usize) -> Command {
    let mut c = Command::new("curl");
    c.args(["-sSf", "-o", "/dev/null", "-X", "POST"])
        .arg("-H")
        .arg(format!("Idempotency-Key: {}", fresh_id()))
        .args(["-H", "content-type: application/json", "-d"])
        .arg(format!(r#"{{"amount":{amount}}}"#))
        .arg(api.url("/payments"))
        .stdout(Stdio::null());
    c
}

async fn call_pay(socket: &std::path::Path, amount: usize) -> std::time::Duration {
    let mut args = Map::new();
    args.insert("amount".into(), Value::String(amount.to_string()));
    let start = std::time::Instant::now();
    let frame = request(
        socket,
        Request::Call {
            tool: Some("pay".into()),
            args,
            host: None,
            raw: None,
            key: None,
            transport: Some("bench".into()),
            defer_delivery: false,
        },
        |_| {},
    )
    .await
    .unwrap_or_else(|e| panic!("pay failed: {e:?}"));
    let elapsed = start.elapsed();
    match frame {
        Frame::Done { exit: 0, .. } => elapsed,
        other => panic!("pay did not succeed: {other:?}"),
    }
}

/// Adds the two HTTP rows: `waymark exec run` (a CLI process) and the control-protocol call,
/// each against `curl` (a process) of the same endpoint.
pub fn rows(
    env: &Env,
    api: &TestHttpApi,
    rt: &tokio::runtime::Runtime,
    iters: usize,
    next: &dyn Fn() -> usize,
    table: &mut Table,
) {
    let cli_call = |n: usize| {
        let mut c = env.waymark();
        c.args(["exec", "run", "pay"])
            .arg(format!("amount={n}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        c
    };
    for _ in 0..5 {
        timed(&mut cli_call(next()), "waymark exec run pay");
        timed(&mut curl(api, next()), "curl");
    }
    let (mut cli, mut proto, mut peer) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..iters {
        cli.push(ms(timed(&mut cli_call(next()), "waymark exec run pay")));
        proto.push(ms(rt.block_on(call_pay(&env.socket, next()))));
        peer.push(ms(timed(&mut curl(api, next()), "curl")));
    }
    let (cli_m, proto_m, curl_m) = (median(&cli), median(&proto), median(&peer));
    table.add(
        "latency: durable HTTP action, `waymark exec run` (CLI process) vs `curl`, POST to the same loopback API",
        format!("{} (p95 {})", fmt_ms(cli_m), fmt_ms(percentile(&cli, 0.95))),
        format!("{} (p95 {})", fmt_ms(curl_m), fmt_ms(percentile(&peer, 0.95))),
        format!("{:.2}x", cli_m / curl_m),
        "<= 1.5x",
        Some(cli_m / curl_m <= 1.5),
        format!("{iters} each"),
    );
    table.add(
        "latency: durable HTTP action, control-protocol call (no CLI process) vs `curl`",
        format!(
            "{} (p95 {})",
            fmt_ms(proto_m),
            fmt_ms(percentile(&proto, 0.95))
        ),
        fmt_ms(curl_m),
        format!("{:.2}x", proto_m / curl_m),
        "<= 1.5x",
        Some(proto_m / curl_m <= 1.5),
        format!("{iters} each"),
    );
}
