//! `waymark.toml`: the documented example parses; every mistake is reported at its line.

mod common;

use std::path::{Path, PathBuf};
use std::time::Duration;

use common::{ctx, defaults, BASE};

use serde_json::{json, Map, Value};
use waymark_core::{ExecutionId, FingerprintKey, ReplayContract};
use waymark_gateway::config::{
    Approval, Config, ConfigError, CredentialConfig, DefaultPaths, TlsFiles,
};
use waymark_gateway::tools::{resolve, resolve_fan_out, resolve_raw, CallError, Effect};

fn example() -> Config {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples/waymark.toml");
    Config::load(&path, &defaults()).unwrap_or_else(|e| panic!("{e}"))
}

fn parse(text: &str) -> Result<Config, ConfigError> {
    Config::parse(Path::new("waymark.toml"), text, &defaults())
}

/// An execution ID to render commands with.
fn id() -> ExecutionId {
    "act_01J9Z3K8Q4M7W2X5Y6Z8A9B0CD".parse().unwrap()
}

fn args(v: Value) -> Map<String, Value> {
    v.as_object().unwrap().clone()
}

/// The example is also `waymark init`'s skeleton: what a newcomer starts from warns about
/// nothing (no secret in argv) and names no host a first `hosts check` would reach.
#[test]
fn the_skeleton_keeps_secrets_out_of_argv_and_reaches_no_real_host() {
    let c = example();
    assert!(c.warnings.is_empty(), "{:?}", c.warnings);
    for h in c.hosts.values() {
        assert!(
            h.address.ends_with(".invalid"),
            "{} points at {}",
            h.name,
            h.address
        );
    }
}

#[test]
fn the_example_configuration_parses_with_defaults_materialized() {
    let c = example();
    assert_eq!(
        c.ledger_path,
        PathBuf::from("/home/op/.local/state/waymark/ledger")
    );
    assert_eq!(
        c.daemon.socket,
        PathBuf::from("/tmp/waymark-1000/daemon.sock")
    );
    assert_eq!(c.hosts["db1"].port, 22);
    assert_eq!(c.hosts["db1"].remote_dir, "~/.waymark");
    assert!(c.hosts["db1"].serve, "serve channels by default");
    assert_eq!(
        c.hosts["web1"].known_hosts,
        PathBuf::from("/home/op/.ssh/known_hosts")
    );
    assert_eq!(c.credentials["agent"], CredentialConfig::Agent);
    let t = &c.tools["restart_service"];
    assert_eq!(t.contract, ReplayContract::Idempotent);
    assert_eq!(t.retry_window.as_secs(), 600);
    assert_eq!(t.dedup_window.unwrap().as_secs(), 3600);
    assert_eq!(c.tools["rotate_db_password"].approval, Approval::PerCall);
    assert_eq!(
        c.tools["disk_usage"].approval,
        Approval::None,
        "policy default"
    );
    assert_eq!(c.policy.raw_commands, ["web1"]);
    // A repeat after its result was delivered runs again unless dedup_window covers it: the
    // irreversible and HTTP examples, whose repeat is more likely a retry, keep their result.
    for name in ["refund", "rotate_db_password"] {
        assert_eq!(
            c.tools[name].dedup_window,
            Some(Duration::from_secs(86_400)),
            "{name}"
        );
    }
    let refund = c.tools["refund"].http.as_ref().unwrap();
    assert_eq!(refund.target, "payments.example.com:443");
    assert!(refund.status.is_some());
}

#[test]
fn xdg_variables_move_the_defaults() {
    let env = |k: &str| match k {
        "HOME" => Some("/home/op".to_string()),
        "XDG_STATE_HOME" => Some("/state".to_string()),
        "XDG_RUNTIME_DIR" => Some("/run/user/1000".to_string()),
        "XDG_CONFIG_HOME" => Some("relative/ignored".to_string()),
        _ => None,
    };
    let d = DefaultPaths::from_env(env, 1000);
    assert_eq!(d.ledger, PathBuf::from("/state/waymark/ledger"));
    assert_eq!(
        d.socket,
        PathBuf::from("/run/user/1000/waymark/daemon.sock")
    );
    assert_eq!(
        d.config_file,
        PathBuf::from("/home/op/.config/waymark/waymark.toml")
    );
}

fn err_at(text: &str) -> ConfigError {
    match parse(text) {
        Ok(_) => panic!("accepted a bad configuration:\n{text}"),
        Err(e) => e,
    }
}

#[test]
fn a_host_can_turn_serve_channels_off_and_a_bad_value_names_its_line() {
    assert!(parse(BASE).unwrap().hosts["web1"].serve);
    let off = BASE.replace("user = \"ops\"", "user = \"ops\"\nserve = false");
    assert!(!parse(&off).unwrap().hosts["web1"].serve);
    let e = err_at(&BASE.replace("user = \"ops\"", "user = \"ops\"\nserve = \"no\""));
    assert_eq!(e.line, 8, "{e}");
}

#[test]
fn syntax_errors_carry_file_line_and_column() {
    let e = err_at("[hosts.web1]\naddress = \"x\"\nuser = = \"y\"\n");
    assert_eq!(
        (e.line, e.file.as_path()),
        (3, Path::new("waymark.toml")),
        "{e}"
    );
    assert!(e.to_string().starts_with("waymark.toml:3:"), "{e}");
}

#[test]
fn a_duplicate_key_is_named_at_its_second_line() {
    let e = err_at("[hosts.web1]\naddress = \"x\"\nuser = \"a\"\nuser = \"b\"\n");
    assert_eq!((e.line, e.column), (4, 1), "{e}");
    assert!(e.message.contains("duplicate key `user`"), "{e}");
    let e = err_at("[hosts.web1]\naddress = \"x\"\n[hosts.web1]\naddress = \"y\"\n");
    assert_eq!(e.line, 3, "{e}");
    assert!(e.message.contains("`web1`"), "{e}");
}

#[test]
fn unknown_keys_are_rejected_at_their_line() {
    let text = BASE.replace("user = \"ops\"", "user = \"ops\"\nadress = \"typo\"");
    let e = err_at(&text);
    assert!(e.message.contains("adress"), "{e}");
    assert_eq!(e.line, 8, "{e}");
}

#[test]
fn every_reference_is_checked_at_its_line() {
    let e = err_at(&BASE.replace("credential = \"k\"", "credential = \"nope\""));
    assert!(
        e.message.contains("credential \"nope\" is not defined"),
        "{e}"
    );
    assert_eq!((e.line, e.column), (8, 14), "{e}");

    let e = err_at(&BASE.replace("hosts = [\"web1\"]", "hosts = [\"web2\"]"));
    assert!(
        e.message.contains("host \"web2\" is not defined") && e.message.contains("web1"),
        "{e}"
    );
    assert_eq!(e.line, 12, "{e}");

    let e = err_at(&BASE.replace("{msg}", "{mesage}"));
    assert!(
        e.message.contains("{mesage}") && e.message.contains("no [tools.t.args.mesage]"),
        "{e}"
    );
    assert_eq!(e.line, 13, "{e}");

    let e = err_at(&format!("{BASE}\n[policy]\nraw_commands = [\"db9\"]\n"));
    assert!(e.message.contains("db9"), "{e}");
}

#[test]
fn bad_values_are_explained() {
    let e = err_at(&BASE.replace(
        "contract = \"idempotent\"",
        "contract = \"idempotent\"\ntimeout = \"5 minutes\"",
    ));
    assert!(
        e.message.contains("not a duration") || e.message.contains("unit"),
        "{e}"
    );
    assert_eq!(e.line, 15, "{e}");
    let e = err_at(&BASE.replace("contract = \"idempotent\"", "contract = \"maybe\""));
    assert!(e.message.contains("maybe"), "{e}");
    let e = err_at(&BASE.replace("type = \"string\"", "type = \"enum\""));
    assert!(e.message.contains("list its values"), "{e}");
    let e = err_at(&BASE.replace("[\"echo\", \"{msg}\"]", "[\"echo\", \"{msg\"]"));
    assert!(e.message.contains("without a closing"), "{e}");
    // A shell's `${#VAR}` in an argv word: the error says how to write the braces.
    let e = err_at(&BASE.replace(
        "[\"echo\", \"{msg}\"]",
        "[\"sh\", \"-c\", \"echo ${#HOME}\"]",
    ));
    assert!(e.message.contains("`${{#VAR}}`"), "{e}");
    let e = err_at(&BASE.replace("key_file = \"~/.ssh/id\"", "agent = true\nkey_file = \"x\""));
    assert!(e.message.contains("not both"), "{e}");
    let e = err_at(&BASE.replace("hosts = [\"web1\"]\n", ""));
    assert!(e.message.contains("host_arg"), "{e}");
    let e = err_at(&BASE.replace("type = \"string\"", "type = \"string\"\npattern = \"(\""));
    assert!(e.message.contains("bad pattern"), "{e}");
}

#[test]
fn a_missing_file_says_how_to_create_one() {
    let e = Config::load(Path::new("/nonexistent/waymark.toml"), &defaults()).unwrap_err();
    assert!(e.to_string().contains("waymark init"), "{e}");
}

#[test]
fn calls_resolve_to_quoted_argv_never_shell_text() {
    let c = parse(BASE).unwrap();
    let call = resolve(
        &c,
        "t",
        &args(json!({"msg": "$(rm -rf /); echo `x` 'q' \"dq\" *"})),
        ctx(),
    )
    .unwrap();
    assert_eq!(
        call.ssh_request().unwrap().exposed_argv(id()),
        ["echo", "$(rm -rf /); echo `x` 'q' \"dq\" *"]
    );
    assert_eq!(call.target(), "web1");
    assert_eq!(
        call.ssh_request().unwrap().target.to_string(),
        "ops@127.0.0.1:22"
    );
}

#[test]
fn arguments_are_typed_and_checked() {
    let c = example();
    let e = resolve(
        &c,
        "restart_service",
        &args(json!({"service": "postgres"})),
        ctx(),
    )
    .unwrap_err();
    assert!(e.to_string().contains("one of: nginx, app"), "{e}");
    let e = resolve(&c, "restart_service", &args(json!({})), ctx()).unwrap_err();
    assert_eq!(
        e,
        CallError::MissingArg {
            tool: "restart_service".into(),
            arg: "service".into()
        }
    );
    let e = resolve(
        &c,
        "restart_service",
        &args(json!({"service": "app", "force": true})),
        ctx(),
    )
    .unwrap_err();
    assert!(matches!(e, CallError::UnknownArg { .. }), "{e}");
    let e = resolve(
        &c,
        "disk_usage",
        &args(json!({"path": "/var; rm -rf /", "host": "db1"})),
        ctx(),
    )
    .unwrap_err();
    assert!(e.to_string().contains("matching"), "{e}");
    let e = resolve(&c, "disk_usage", &args(json!({"path": "/var"})), ctx()).unwrap_err();
    assert!(matches!(e, CallError::HostRequired { .. }), "{e}");
    assert!(
        e.to_string().contains("--host NAME") && e.to_string().contains("--all-hosts"),
        "{e}"
    );
    let ok = resolve(
        &c,
        "disk_usage",
        &args(json!({"path": "/var", "host": "db1"})),
        ctx(),
    )
    .unwrap();
    assert_eq!(ok.target(), "db1");
    let e = resolve(&c, "nope", &args(json!({})), ctx()).unwrap_err();
    assert!(e.to_string().contains("restart_service"), "{e}");
}

#[test]
fn a_fan_out_is_one_single_host_call_per_host_and_refuses_all_or_nothing() {
    let c = example();
    let key = FingerprintKey::from_bytes([1; 32]);
    let a = args(json!({"path": "/var"}));
    let calls = resolve_fan_out(&c, "disk_usage", &a, None, ctx()).unwrap();
    let targets: Vec<&str> = calls.iter().map(|c| c.target()).collect();
    assert_eq!(
        targets,
        ["web1", "db1"],
        "every host of the tool, in its order"
    );
    for call in &calls {
        let mut one = a.clone();
        one.insert("host".into(), json!(call.target()));
        let single = resolve(&c, "disk_usage", &one, ctx()).unwrap();
        assert_eq!(
            call.canonicalize(&key).as_str(),
            single.canonicalize(&key).as_str(),
            "a host's action is that of a single-host call on it"
        );
    }
    assert_ne!(calls[0].fingerprint(&key), calls[1].fingerprint(&key));

    let subset = ["db1".to_string(), "db1".to_string()];
    let calls = resolve_fan_out(&c, "disk_usage", &a, Some(&subset), ctx()).unwrap();
    assert_eq!(calls.len(), 1, "a host named twice runs once");

    let bad = args(json!({"path": "/var; rm -rf /"}));
    let e = resolve_fan_out(&c, "disk_usage", &bad, None, ctx()).unwrap_err();
    assert!(e.to_string().contains("matching"), "{e}");
    let outside = ["web1".to_string(), "nope".to_string()];
    let e = resolve_fan_out(&c, "disk_usage", &a, Some(&outside), ctx()).unwrap_err();
    assert!(matches!(e, CallError::HostNotAllowed { .. }), "{e}");
    let mut with_host = a.clone();
    with_host.insert("host".into(), json!("db1"));
    let e = resolve_fan_out(&c, "disk_usage", &with_host, None, ctx()).unwrap_err();
    assert!(matches!(e, CallError::NoFanOut { .. }), "{e}");
    let http = c.tools.values().find(|t| t.http.is_some()).unwrap();
    let e = resolve_fan_out(&c, &http.name, &Map::new(), None, ctx()).unwrap_err();
    assert!(matches!(e, CallError::NoFanOut { .. }), "{e}");
}

#[test]
fn secrets_are_sent_to_the_host_but_never_recorded_or_echoed() {
    let c = example();
    let secret = "CANARY-pw-1f2e";
    let call = resolve(
        &c,
        "rotate_db_password",
        &args(json!({"user": "app", "password": secret})),
        ctx(),
    )
    .unwrap();
    assert!(!call
        .ssh_request()
        .unwrap()
        .exposed_argv(id())
        .concat()
        .contains(secret));
    assert_eq!(
        call.ssh_request().unwrap().exposed_env(id()),
        [("NEW_PASSWORD".to_string(), secret.to_string())]
    );
    let key = FingerprintKey::from_bytes([1; 32]);
    assert!(!call
        .ssh_request()
        .unwrap()
        .canonicalize(&key)
        .as_str()
        .contains(secret));
    assert!(
        !format!("{:?}", call.effect).contains(secret),
        "Debug must redact"
    );
    // A bad secret value is not echoed in the error.
    let mut c2 = c.clone();
    c2.tools.get_mut("rotate_db_password").unwrap().args[0].pattern =
        Some(regex::Regex::new("^(?:x)$").unwrap());
    c2.tools.get_mut("rotate_db_password").unwrap().args[0].secret = true;
    let e = resolve(
        &c2,
        "rotate_db_password",
        &args(json!({"user": secret, "password": "p"})),
        ctx(),
    )
    .unwrap_err();
    assert!(!e.to_string().contains(secret), "{e}");
}

#[test]
fn raw_commands_follow_policy_and_are_irreversible() {
    let c = example();
    let argv = vec!["sh".to_string(), "-c".to_string(), "echo hi".to_string()];
    let call = resolve_raw(&c, "web1", &argv, ctx()).unwrap();
    assert_eq!(call.policy.contract, ReplayContract::Irreversible);
    assert_eq!(call.ssh_request().unwrap().exposed_argv(id()), argv);
    let e = resolve_raw(&c, "db1", &argv, ctx()).unwrap_err();
    assert!(e.to_string().contains("not allowed on host \"db1\""), "{e}");
}

/// [`BASE`]'s tool `t` with `argv` and `env` as given (TOML values).
fn t_with(argv: &str, env: &str) -> String {
    BASE.replace(
        "argv = [\"echo\", \"{msg}\"]",
        &format!("argv = {argv}\nenv = {env}"),
    )
}

#[test]
fn the_execution_id_is_rendered_at_dispatch_and_never_enters_the_fingerprint() {
    let c = parse(&t_with(
        r#"["echo", "{msg}", "--run={execution_id}"]"#,
        r#"{ RUN_ID = "{execution_id}", LANG = "C" }"#,
    ))
    .unwrap();
    let key = FingerprintKey::from_bytes([1; 32]);
    let first: ExecutionId = "act_01J9Z3K8Q4M7W2X5Y6Z8A9B0CD".parse().unwrap();
    let second: ExecutionId = "act_01J9Z3K8Q4M7W2X5Y6Z8A9B0CE".parse().unwrap();
    let a = resolve(&c, "t", &args(json!({"msg": "hi"})), ctx()).unwrap();
    let b = resolve(&c, "t", &args(json!({"msg": "hi"})), ctx()).unwrap();
    assert_eq!(
        a.ssh_request().unwrap().fingerprint(&key),
        b.ssh_request().unwrap().fingerprint(&key),
        "the same call has one fingerprint, whatever id it will run under"
    );
    assert_eq!(
        a.ssh_request().unwrap().exposed_argv(first),
        ["echo", "hi", &format!("--run={first}")]
    );
    assert_eq!(
        b.ssh_request().unwrap().exposed_argv(second)[2],
        format!("--run={second}")
    );
    assert_eq!(
        a.ssh_request().unwrap().exposed_env(first),
        [
            ("LANG".to_string(), "C".to_string()),
            ("RUN_ID".to_string(), first.to_string())
        ]
    );
    let record = a.ssh_request().unwrap().canonicalize(&key);
    assert!(!record.as_str().contains("act_"), "{}", record.as_str());

    // `{{execution_id}}` is the literal text, another effect than the placeholder.
    let literal = parse(&t_with(
        r#"["echo", "{msg}", "--run={{execution_id}}"]"#,
        r#"{ RUN_ID = "{execution_id}", LANG = "C" }"#,
    ))
    .unwrap();
    let l = resolve(&literal, "t", &args(json!({"msg": "hi"})), ctx()).unwrap();
    assert_eq!(
        l.ssh_request().unwrap().exposed_argv(first)[2],
        "--run={execution_id}"
    );
    assert_ne!(
        l.ssh_request().unwrap().fingerprint(&key),
        a.ssh_request().unwrap().fingerprint(&key)
    );
}

#[test]
fn execution_id_is_reserved_and_env_values_take_only_declared_arguments() {
    let e = err_at(&format!(
        "{BASE}\n[tools.t.args.execution_id]\ntype = \"string\"\n"
    ));
    assert!(e.message.contains("\"execution_id\" is reserved"), "{e}");
    assert_eq!(e.line, 19, "{e}");

    let e = err_at(&t_with(r#"["echo", "{msg}"]"#, r#"{ MSG = "{nope}" }"#));
    assert!(
        e.message.contains("env MSG") && e.message.contains("no [tools.t.args.nope]"),
        "{e}"
    );
    assert_eq!(e.line, 14, "{e}");

    let e = err_at(&t_with(
        r#"["echo", "{msg}"]"#,
        r#"{ WAYMARK_EXECUTION_ID = "x" }"#,
    ));
    assert!(
        e.message.contains("WAYMARK_EXECUTION_ID") && e.message.contains("wrapper"),
        "{e}"
    );
    assert_eq!(e.line, 14, "{e}");
}

#[test]
fn a_secret_in_argv_is_warned_about_with_its_line_and_one_in_env_is_not() {
    let secret = |argv: &str, env: &str| format!("{}\nsecret = true\n", t_with(argv, env));
    let c = parse(&secret(r#"["echo", "--token={msg}"]"#, "{}")).unwrap();
    assert_eq!(c.warnings.len(), 1, "{:?}", c.warnings);
    let w = &c.warnings[0];
    assert!(
        w.message.contains("secret argument msg is in argv")
            && w.message.contains(r#"env = { MSG = "{msg}" }"#),
        "{w}"
    );
    assert_eq!(w.line, 13, "{w}");
    let c = parse(&secret(
        r#"["sh", "-c", "use \"$MSG\""]"#,
        r#"{ MSG = "{msg}" }"#,
    ))
    .unwrap();
    assert!(c.warnings.is_empty(), "{:?}", c.warnings);
    // The secret travels as a secret part of the env value: MAC'd in the record.
    let key = FingerprintKey::from_bytes([1; 32]);
    let r = resolve(&c, "t", &args(json!({"msg": "CANARY-cfg"})), ctx()).unwrap();
    let rec = r.ssh_request().unwrap().canonicalize(&key);
    assert!(!rec.as_str().contains("CANARY-cfg"), "{}", rec.as_str());
}

#[test]
fn a_postgres_ledger_takes_its_connection_string_from_the_environment_or_a_file() {
    use waymark_gateway::config::{LedgerBackend, UrlSource};
    let c = parse(&format!(
        "[ledger]\nbackend = \"postgres\"\nurl_env = \"WAYMARK_LEDGER_URL\"\n{BASE}"
    ))
    .unwrap();
    let LedgerBackend::Postgres(pg) = &c.ledger_backend else {
        panic!("{:?}", c.ledger_backend);
    };
    assert_eq!(pg.url, UrlSource::Env("WAYMARK_LEDGER_URL".into()));
    assert_eq!(pg.key_file, c.ledger_path.join("ledger.key"));
    assert_eq!(pg.origin, "waymark.toml:2");
    let c = parse(&format!(
        "[ledger]\nbackend = \"postgres\"\nurl_file = \"/etc/waymark/ledger-url\"\n{BASE}"
    ))
    .unwrap();
    let LedgerBackend::Postgres(pg) = &c.ledger_backend else {
        panic!("{:?}", c.ledger_backend);
    };
    assert_eq!(pg.url, UrlSource::File("/etc/waymark/ledger-url".into()));
    assert_eq!(parse(BASE).unwrap().ledger_backend, LedgerBackend::Sled);
}

#[test]
fn a_connection_string_in_the_file_is_refused_at_its_line() {
    let e = err_at(&format!(
        "[ledger]\nbackend = \"postgres\"\nurl = \"postgresql://u:secret@db/w\"\n{BASE}"
    ));
    assert_eq!(e.line, 3, "{e}");
    assert!(e.to_string().contains("url_env"), "{e}");
    assert!(
        !e.to_string().contains("secret@"),
        "the value is not echoed: {e}"
    );
    let e = err_at(&format!("[ledger]\nbackend = \"postgres\"\n{BASE}"));
    assert_eq!(e.line, 2, "{e}");
    assert!(e.to_string().contains("url_file"), "{e}");
    let e = err_at(&format!("[ledger]\nbackend = \"mysql\"\n{BASE}"));
    assert_eq!(e.line, 2, "{e}");
    let e = err_at(&format!("[ledger]\nurl_env = \"X\"\n{BASE}"));
    assert!(e.to_string().contains("postgres"), "{e}");
}

const HTTP_TOOL: &str = r#"
[credentials.pay]
kind = "bearer"
token_env = "PAY_TOKEN"

[tools.pay]
description = "Charges."
channel = "http"
method = "POST"
url = "https://api.example.com/v1/accounts/{account}/payments"
headers = { "X-Source" = "waymark" }
body = { amount = "{amount}", note = "for {account}", live = true }
credential = "pay"
contract = "idempotent"

[tools.pay.args.amount]
type = "integer"

[tools.pay.args.account]
type = "string"
"#;

#[test]
fn an_http_tool_resolves_to_its_canonical_request_with_typed_body_and_encoded_url() {
    let c = parse(HTTP_TOOL).unwrap();
    let http = c.tools["pay"].http.as_ref().unwrap();
    assert_eq!(http.target, "api.example.com:443");
    assert_eq!(http.idempotency_header.as_deref(), Some("Idempotency-Key"));
    let call = resolve(
        &c,
        "pay",
        &args(json!({"amount": 12, "account": "a/b?c"})),
        ctx(),
    )
    .unwrap();
    assert_eq!(call.target(), "api.example.com:443");
    let Effect::Http(h) = &call.effect else {
        panic!("an HTTP call")
    };
    assert_eq!(
        h.request.call.url.as_sent(),
        "https://api.example.com/v1/accounts/a%2Fb%3Fc/payments"
    );
    assert_eq!(
        h.request.exposed_body(id()).unwrap(),
        br#"{"amount":12,"live":true,"note":"for a/b?c"}"#
    );
    let key = FingerprintKey::from_bytes([7; 32]);
    assert!(call
        .canonicalize(&key)
        .as_str()
        .contains(r#""credential":"pay""#));
}

#[test]
fn a_malformed_http_tool_is_refused_at_its_line() {
    let cases = [
        // No secret in a URL.
        (
            HTTP_TOOL.replace("type = \"string\"", "type = \"string\"\nsecret = true"),
            "secret argument account",
        ),
        (
            HTTP_TOOL.replace("method = \"POST\"", "method = \"BREW\""),
            "not one Waymark sends",
        ),
        (
            HTTP_TOOL.replace("credential = \"pay\"", "credential = \"nope\""),
            "credential \"nope\" is not defined",
        ),
        (
            HTTP_TOOL.replace(
                "token_env = \"PAY_TOKEN\"",
                "token_env = \"A\"\ntoken_file = \"/x\"",
            ),
            "exactly one of token_env",
        ),
        (
            HTTP_TOOL.replace("contract = \"idempotent\"", "contract = \"status_check\""),
            "contract status_check needs status",
        ),
        (
            HTTP_TOOL.replace("channel = \"http\"", "channel = \"http\"\nargv = [\"x\"]"),
            "argv belongs to an SSH tool",
        ),
        // How a status answer tells success: a JSON pointer, one way, values with their field.
        (
            HTTP_TOOL.replace("contract = \"idempotent\"", "contract = \"status_check\"\nstatus = { url = \"https://api.example.com/ops/{execution_id}\", code_pointer = \"status\" }"),
            "code_pointer \"status\" is not a JSON pointer; it starts with /",
        ),
        (
            HTTP_TOOL.replace("contract = \"idempotent\"", "contract = \"status_check\"\nstatus = { url = \"https://api.example.com/ops/{execution_id}\", code_pointer = \"/status\", code_header = \"x-status\" }"),
            "give one of code_pointer, code_header and outcome_pointer",
        ),
        (
            HTTP_TOOL.replace("contract = \"idempotent\"", "contract = \"status_check\"\nstatus = { url = \"https://api.example.com/ops/{execution_id}\", succeeded = [\"paid\"] }"),
            "succeeded, failed and pending go with outcome_pointer",
        ),
        (
            HTTP_TOOL.replace("contract = \"idempotent\"", "contract = \"status_check\"\nstatus = { url = \"https://api.example.com/ops/{execution_id}\", outcome_pointer = \"/state\", succeeded = [\"paid\"] }"),
            "outcome_pointer needs the values that mean success and failure",
        ),
    ];
    for (text, says) in cases {
        let e = err_at(&text);
        assert!(e.line > 0, "{e}");
        assert!(e.to_string().contains(says), "{e} should say {says}");
    }
    let e = err_at(&HTTP_TOOL.replace("method = \"POST\"", "method = \"BREW\""));
    assert_eq!((e.line, e.column), (9, 10), "{e}");
}

/// `[daemon]` with `lines`, then [`BASE`]: line 1 is `[daemon]`, line 2 the first of `lines`.
fn daemon(lines: &str) -> String {
    format!("[daemon]\n{lines}\n{BASE}")
}

#[test]
fn plain_http_off_loopback_is_refused_at_the_http_listen_line_naming_the_tls_keys_to_add() {
    for addr in ["0.0.0.0:8931", "192.168.1.20:8931", "[::]:8931"] {
        for (tls, adds) in [
            (
                "",
                "add tls_cert = \"/path/to/cert.pem\" and tls_key = \"/path/to/key.pem\"",
            ),
            (
                "\ntls_cert = \"/c.pem\"",
                "add tls_key = \"/path/to/key.pem\" (a 0600 file)",
            ),
            (
                "\ntls_key = \"/k.pem\"",
                "add tls_cert = \"/path/to/cert.pem\" to [daemon]",
            ),
        ] {
            let e = err_at(&daemon(&format!("http_listen = \"{addr}\"{tls}")));
            assert_eq!((e.line, e.column), (2, 15), "{addr}{tls}: {e}");
            let said = e.to_string();
            assert!(said.contains("is not a loopback address"), "{said}");
            assert!(said.contains("must use TLS"), "{said}");
            assert!(said.contains(adds), "{addr}{tls}: {said}");
            assert!(said.contains("or listen on \"127.0.0.1:8931\""), "{said}");
        }
    }
}

#[test]
fn http_listen_takes_tls_on_any_address_and_plain_http_on_loopback_only() {
    // Loopback, plain: as before TLS existed.
    for addr in ["127.0.0.1:8931", "[::1]:8931"] {
        let c = parse(&daemon(&format!("http_listen = \"{addr}\""))).unwrap();
        assert_eq!(c.daemon.http_listen, Some(addr.parse().unwrap()));
        assert_eq!(c.daemon.tls, None);
    }
    // Any address with both files, `~` expanded like every path.
    for addr in ["0.0.0.0:8931", "127.0.0.1:8931", "[::]:8931"] {
        let c = parse(&daemon(&format!(
            "http_listen = \"{addr}\"\ntls_cert = \"~/tls/cert.pem\"\ntls_key = \"/etc/waymark/key.pem\""
        )))
        .unwrap();
        assert_eq!(c.daemon.http_listen, Some(addr.parse().unwrap()));
        assert_eq!(
            c.daemon.tls,
            Some(TlsFiles {
                cert: PathBuf::from("/home/op/tls/cert.pem"),
                key: PathBuf::from("/etc/waymark/key.pem"),
            })
        );
    }
    assert_eq!(parse(BASE).unwrap().daemon.tls, None);
}

#[test]
fn a_tls_file_alone_or_without_http_listen_is_refused_at_its_line() {
    // One of the two on loopback: at the one given, naming the other.
    let e = err_at(&daemon(
        "http_listen = \"127.0.0.1:8931\"\ntls_cert = \"/c.pem\"",
    ));
    assert_eq!((e.line, e.column), (3, 12), "{e}");
    assert!(
        e.to_string().contains("daemon.tls_cert without tls_key")
            && e.to_string()
                .contains("add tls_key = \"/path/to/key.pem\" (a 0600 file)"),
        "{e}"
    );
    let e = err_at(&daemon(
        "http_listen = \"127.0.0.1:8931\"\ntls_key = \"/k.pem\"",
    ));
    assert_eq!((e.line, e.column), (3, 11), "{e}");
    assert!(
        e.to_string().contains("daemon.tls_key without tls_cert")
            && e.to_string()
                .contains("add tls_cert = \"/path/to/cert.pem\""),
        "{e}"
    );
    // Without http_listen they would do nothing: refused at the first one given.
    for (lines, key, at) in [
        (
            "tls_cert = \"/c.pem\"\ntls_key = \"/k.pem\"",
            "tls_cert",
            (2, 12),
        ),
        (
            "socket = \"/tmp/s\"\ntls_key = \"/k.pem\"",
            "tls_key",
            (3, 11),
        ),
    ] {
        let e = err_at(&daemon(lines));
        assert_eq!((e.line, e.column), at, "{lines}: {e}");
        assert!(
            e.to_string().contains(&format!(
                "daemon.{key} applies to MCP over HTTP only: set http_listen"
            )),
            "{e}"
        );
    }
}

#[test]
fn the_metrics_endpoint_listens_on_loopback_only_and_a_bad_address_is_refused_at_its_line() {
    assert_eq!(parse(BASE).unwrap().daemon.metrics_listen, None);
    let c = parse(&format!(
        "[daemon]\nsocket = \"/tmp/s\"\nmetrics_listen = \"127.0.0.1:9464\"\n{BASE}"
    ))
    .unwrap();
    assert_eq!(
        c.daemon.metrics_listen,
        Some("127.0.0.1:9464".parse().unwrap())
    );
    let c = parse(&format!(
        "[daemon]\nmetrics_listen = \"[::1]:9464\"\n{BASE}"
    ))
    .unwrap();
    assert_eq!(c.daemon.metrics_listen, Some("[::1]:9464".parse().unwrap()));
    for (value, says) in [
        ("0.0.0.0:9464", "only a loopback address"),
        ("192.168.1.20:9464", "only a loopback address"),
        ("[::]:9464", "only a loopback address"),
        ("localhost:9464", "not an address like 127.0.0.1:9464"),
        ("127.0.0.1", "not an address like 127.0.0.1:9464"),
    ] {
        let e = err_at(&format!(
            "[daemon]\nsocket = \"/tmp/s\"\nmetrics_listen = \"{value}\"\n{BASE}"
        ));
        assert_eq!((e.line, e.column), (3, 18), "{value}: {e}");
        assert!(e.to_string().contains(says), "{value}: {e}");
    }
}

/// `[actors]`: identities resolved, rules kept, and every mistake at its line.
#[test]
fn actors_parse_with_their_rights_and_mistakes_name_their_line() {
    let text = format!(
        "{BASE}
[actors.agent]
unix_user = \"root\"
tools = [\"t\", \"ssh_*\"]
deny_tools = [\"ssh_exec\"]
hosts = [\"web1\"]
approval = \"per_call\"

[actors.ops]
unix_group = \"0\"
token_sha256 = \"{}\"
operator = true
tools = [\"*\"]
",
        "ab".repeat(32)
    );
    let c = parse(&text).unwrap_or_else(|e| panic!("{e}"));
    let agent = &c.actors["agent"];
    assert_eq!(agent.unix_user.as_ref().map(|u| u.id), Some(0));
    assert_eq!(agent.approval, Approval::PerCall);
    assert!(agent.may_call("t").is_ok());
    let denied = agent.may_call("ssh_exec").unwrap_err();
    assert!(denied.rule.contains("deny_tools"), "{}", denied.rule);
    assert!(agent
        .may_call("other")
        .unwrap_err()
        .rule
        .contains("not in actors.agent.tools"));
    assert!(agent.may_target("web1").is_ok());
    assert!(agent.may_target("db1").is_err());
    let ops = &c.actors["ops"];
    assert!(ops.operator && ops.may_call("anything").is_ok() && ops.may_target("db1").is_ok());
    assert_eq!(ops.unix_group.as_ref().map(|g| g.id), Some(0));

    let line_of = |needle: &str| text.lines().position(|l| l.contains(needle)).unwrap() + 1;
    let e = err_at(&text.replace("unix_user = \"root\"", "unix_user = \"no-such-user-wm\""));
    assert!(
        e.message.contains("no Unix user \"no-such-user-wm\""),
        "{e}"
    );
    assert_eq!(e.line, line_of("unix_user = \"root\""), "{e}");
    let e = err_at(&text.replace("tools = [\"t\", \"ssh_*\"]", "tools = [\"tt\"]"));
    assert!(e.message.contains("\"tt\" is not defined"), "{e}");
    assert_eq!(e.line, line_of("tools = [\"t\", \"ssh_*\"]"), "{e}");
    let e = err_at(&text.replace(
        "hosts = [\"web1\"]\napproval",
        "hosts = [\"web9\"]\napproval",
    ));
    assert!(e.message.contains("actors.agent.hosts"), "{e}");
    let e = err_at(&text.replace(&"ab".repeat(32), "abc"));
    assert!(e.message.contains("64 hex digits"), "{e}");
    let e = err_at(&format!(
        "{text}\n[actors.ops2]\ntoken_sha256 = \"{}\"\n",
        "ab".repeat(32)
    ));
    assert!(e.message.contains("actor ops has the same token"), "{e}");
    let e = err_at(&format!("{text}\n[actors.twin]\nunix_user = \"0\"\n"));
    assert!(e.message.contains("same unix_user"), "{e}");
    let e = err_at(&format!("{BASE}\n[actors.\"a:b\"]\nunix_user = \"root\"\n"));
    assert!(e.message.contains("actor name"), "{e}");
    let e = err_at(&format!("{BASE}\n[actors.x]\ntools = [\"t\"]\n"));
    assert!(e.message.contains("say how it is recognized"), "{e}");
    let e = err_at(&format!(
        "{BASE}\n[actors.x]\nunix_user = \"root\"\nself_approve = true\n"
    ));
    assert!(e.message.contains("self_approve needs operator"), "{e}");
    // The single-user token and [actors] do not mix: each HTTP agent has its own token.
    let e = err_at(&format!(
        "[daemon]\nhttp_token_file = \"/t\"\n{BASE}\n[actors.x]\nunix_user = \"root\"\n"
    ));
    assert_eq!(e.line, 2, "{e}");
    assert!(e.message.contains("its own token"), "{e}");
    // The socket group must exist.
    let e = err_at(&format!(
        "[daemon]\nsocket_group = \"no-such-group-wm\"\n{BASE}"
    ));
    assert_eq!(e.line, 2, "{e}");
    assert!(e.message.contains("groupadd"), "{e}");
    assert_eq!(
        parse(&format!("[daemon]\nsocket_group = \"root\"\n{BASE}"))
            .unwrap()
            .daemon
            .socket_group
            .map(|g| g.id),
        Some(0)
    );
}
