//! Which crate may know which library, as ARCHITECTURE.md says ("only X knows Y"), read from
//! cargo's own view of the workspace: each crate's normal dependencies (a test may use
//! anything), and the features a shipped build resolves.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::process::Command;

/// Each workspace crate and the libraries it depends on to build (not its tests).
fn normal_dependencies() -> BTreeMap<String, BTreeSet<String>> {
    let out = cargo(&[
        "metadata",
        "--format-version",
        "1",
        "--no-deps",
        "--offline",
    ]);
    let metadata: serde_json::Value = serde_json::from_str(&out).expect("cargo metadata's JSON");
    let packages = metadata["packages"].as_array().expect("packages");
    let crates: BTreeMap<String, BTreeSet<String>> = packages
        .iter()
        .map(|p| {
            let deps = p["dependencies"]
                .as_array()
                .expect("dependencies")
                .iter()
                .filter(|d| d["kind"].is_null())
                .map(|d| d["name"].as_str().expect("a name").to_string())
                .collect();
            (p["name"].as_str().expect("a name").to_string(), deps)
        })
        .collect();
    assert!(crates.len() >= 9, "read {} crates", crates.len());
    crates
}

fn cargo(args: &[&str]) -> String {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let out = Command::new(env!("CARGO"))
        .args(args)
        .current_dir(&root)
        .output()
        .expect("cargo runs");
    assert!(
        out.status.success(),
        "cargo {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("UTF-8")
}

/// The crates that depend on `library`, which must be exactly `allowed`.
fn known_only_by(library: &str, allowed: &[&str]) {
    let knowing: BTreeSet<String> = normal_dependencies()
        .into_iter()
        .filter(|(_, deps)| deps.contains(library))
        .map(|(name, _)| name)
        .collect();
    let allowed: BTreeSet<String> = allowed.iter().map(|a| a.to_string()).collect();
    assert_eq!(
        knowing, allowed,
        "the crates that depend on {library} are not the ones ARCHITECTURE.md names"
    );
}

/// `krate` depends on none of `libraries`.
fn knows_none_of(krate: &str, libraries: &[&str]) {
    let deps = &normal_dependencies()[krate];
    let known: Vec<&&str> = libraries.iter().filter(|l| deps.contains(**l)).collect();
    assert!(known.is_empty(), "{krate} depends on {known:?}");
}

#[test]
fn only_the_ledger_knows_sled_and_only_the_shared_ledger_knows_postgres() {
    known_only_by("sled", &["waymark-ledger"]);
    known_only_by("tokio-postgres", &["waymark-ledger-pg"]);
    known_only_by("deadpool-postgres", &["waymark-ledger-pg"]);
}

/// The executor is the one russh client; the demo's host is russh's server side, which the
/// executor's crate does not carry.
#[test]
fn only_waymark_ssh_knows_russh_and_only_the_demo_serves_it() {
    known_only_by("russh", &["waymark-demo", "waymark-ssh"]);
    known_only_by("waymark-demo", &["waymark"]);
}

#[test]
fn only_waymark_http_knows_the_http_client() {
    known_only_by("reqwest", &["waymark-http"]);
}

#[test]
fn only_waymark_mcp_knows_rmcp() {
    known_only_by("rmcp", &["waymark-mcp"]);
}

/// The gateway and the ledgers report through `FlowMetrics` and `FlushObserver`, and take
/// their arguments already parsed: the metrics library and clap are the binary's alone.
#[test]
fn only_the_binary_knows_clap_and_the_metrics_library() {
    known_only_by("clap", &["waymark"]);
    known_only_by("prometheus-client", &["waymark"]);
}

/// The gateway holds a `dyn LedgerApi` and its drivers: no front end, no backend, no client
/// library of its own.
#[test]
fn the_gateway_knows_no_clap_rmcp_sled_russh_reqwest_or_metrics_library() {
    knows_none_of(
        "waymark-gateway",
        &[
            "clap",
            "rmcp",
            "sled",
            "russh",
            "reqwest",
            "prometheus-client",
            "waymark-ledger-pg",
            "tokio-postgres",
        ],
    );
}

/// The wire protocol is spoken by the binary and the MCP front end, and knows neither.
#[test]
fn the_protocol_knows_no_clap_rmcp_gateway_or_ledger() {
    known_only_by("waymark-protocol", &["waymark", "waymark-mcp"]);
    knows_none_of(
        "waymark-protocol",
        &[
            "clap",
            "rmcp",
            "waymark-gateway",
            "waymark-ledger",
            "waymark-ledger-pg",
        ],
    );
}

/// The MCP front end asks the daemon, which alone decides.
#[test]
fn the_mcp_front_end_knows_no_clap_gateway_or_ledger() {
    knows_none_of(
        "waymark-mcp",
        &[
            "clap",
            "waymark-gateway",
            "waymark-ledger",
            "waymark-ledger-pg",
            "sled",
        ],
    );
}

/// `waymark-core` does no I/O: no runtime, no system calls, no randomness, no clock library.
#[test]
fn the_core_crate_has_no_library_that_does_io() {
    let deps = &normal_dependencies()["waymark-core"];
    for io in [
        "tokio",
        "libc",
        "rand",
        "getrandom",
        "sled",
        "reqwest",
        "chrono",
    ] {
        assert!(!deps.contains(io), "waymark-core depends on {io}");
    }
    assert!(deps.contains("hmac"), "read the wrong crate: {deps:?}");
}

/// `WAYMARK_CRASH_AT` exists only where the tests turn on `crash-points`: a shipped build of
/// the binary resolves no such feature.
#[test]
fn a_shipped_build_has_no_crash_points() {
    let tree = cargo(&[
        "tree",
        "-p",
        "waymark",
        "-e",
        "normal",
        "--prefix",
        "none",
        "-f",
        "{p} {f}",
        "--offline",
        "--locked",
    ]);
    let gateway: Vec<&str> = tree
        .lines()
        .filter(|l| l.starts_with("waymark-gateway "))
        .collect();
    assert!(!gateway.is_empty(), "no waymark-gateway in:\n{tree}");
    for line in gateway {
        assert!(!line.contains("crash-points"), "a shipped build: {line}");
    }
    // The tests' build does have them, or the crash tests prove nothing.
    let tests = cargo(&[
        "tree",
        "-p",
        "waymark",
        "-e",
        "normal,dev",
        "--prefix",
        "none",
        "-f",
        "{p} {f}",
        "--offline",
        "--locked",
    ]);
    assert!(
        tests
            .lines()
            .any(|l| l.starts_with("waymark-gateway ") && l.contains("crash-points")),
        "the tests' build has no crash points:\n{tests}"
    );
}
