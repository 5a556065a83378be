//! The MCP face of Waymark's tools: schemas and annotations from the catalog, and results from
//! the daemon's frames.

use std::sync::Arc;

use rmcp::model::{CallToolResult, ContentBlock, JsonObject, Tool, ToolAnnotations};
use serde_json::{json, Map, Value};
use waymark_core::{ExecState, ExecutionId, ReplayContract};
use waymark_protocol::answer::attach_words;

use crate::IDEMPOTENCY_KEY_META;
use waymark_protocol::{ArgInfo, CallAnswer, FanOutAnswer, Frame, Stream, ToolCatalog, ToolSpec};

/// Built-in tool: a raw command on a host that `policy.raw_commands` lists.
pub const SSH_EXEC: &str = "ssh_exec";
/// Built-in tool: what really happened to an execution (ledger plus a live marker check).
pub const EXEC_STATUS: &str = "exec_status";
/// Built-in tool: an execution's stored output, paged by byte offset.
pub const EXEC_RESULT: &str = "exec_result";
/// Built-in tool: recent executions.
pub const EXEC_LIST: &str = "exec_list";
/// Built-in tool: cancel an execution.
pub const EXEC_CANCEL: &str = "exec_cancel";

/// How many bytes of one output stream `exec_result` returns per page by default.
pub const DEFAULT_PAGE: usize = 64 * 1024;

fn object(v: Value) -> Arc<JsonObject> {
    match v {
        Value::Object(m) => Arc::new(m),
        _ => unreachable!("schemas are objects"),
    }
}

fn arg_schema(a: &ArgInfo) -> Value {
    let mut s = match a.ty.as_str() {
        "integer" => json!({"type": "integer"}),
        "boolean" => json!({"type": "boolean"}),
        "enum" => json!({"type": "string", "enum": a.values}),
        _ => json!({"type": "string"}),
    };
    if let Some(p) = &a.pattern {
        s["pattern"] = json!(p);
    }
    let mut description = a.description.clone().unwrap_or_default();
    if a.secret {
        s["writeOnly"] = json!(true);
        if !description.is_empty() {
            description.push(' ');
        }
        description.push_str("Secret: never stored, logged or returned in clear.");
    }
    if !description.is_empty() {
        s["description"] = json!(description);
    }
    s
}

/// The argument that runs a tool on all its hosts at once (a fan-out).
pub const ALL_HOSTS: &str = "all_hosts";

/// Whether a tool can run on all its hosts at once: one whose caller picks among several.
pub fn fans_out(t: &ToolSpec) -> bool {
    t.host_arg && t.hosts.len() > 1
}

/// The JSON Schema of a configured tool's arguments.
pub fn input_schema(t: &ToolSpec) -> Arc<JsonObject> {
    let mut props = Map::new();
    let mut required = Vec::new();
    for a in &t.args {
        props.insert(a.name.clone(), arg_schema(a));
        if a.required {
            required.push(a.name.clone());
        }
    }
    if fans_out(t) {
        props.insert(
            "host".into(),
            json!({"type": "string", "enum": t.hosts, "description": "The host to run on; omit it with all_hosts."}),
        );
        props.insert(
            ALL_HOSTS.into(),
            json!({"type": "boolean", "description": "Run on every one of its hosts at once instead of one: one execution per host, a result per host."}),
        );
    } else if t.host_arg {
        props.insert(
            "host".into(),
            json!({"type": "string", "enum": t.hosts, "description": "The host to run on."}),
        );
        required.push("host".into());
    }
    object(json!({
        "type": "object",
        "properties": props,
        "required": required,
        "additionalProperties": false,
    }))
}

/// MCP annotations from a replay contract.
pub fn annotations(contract: ReplayContract) -> ToolAnnotations {
    let a = ToolAnnotations::new().open_world(false);
    match contract {
        ReplayContract::ReadOnly => a.read_only(true).destructive(false).idempotent(true),
        ReplayContract::Idempotent => a.read_only(false).destructive(false).idempotent(true),
        ReplayContract::StatusCheck => a.read_only(false).idempotent(false),
        ReplayContract::Irreversible => a.read_only(false).destructive(true).idempotent(false),
    }
}

/// Every MCP tool this shim publishes for a catalog.
pub fn list(catalog: &ToolCatalog) -> Vec<Tool> {
    let mut out: Vec<Tool> = catalog
        .tools
        .iter()
        .map(|t| {
            let mut description = format!(
                "{} {} Every call gets an execution ID; if the answer is lost, call exec_status \
                 with it, or repeat the same call: a retry attaches to the first execution.",
                t.description.trim_end(),
                t.contract.describe()
            );
            if fans_out(t) {
                description.push_str(&format!(
                    " Give host to run on one host, or {ALL_HOSTS}: true to run on all of \
                     them ({}) at once: one execution per host, and a result with a section per \
                     host; repeating that call attaches per host and runs nothing twice.",
                    t.hosts.join(", ")
                ));
            }
            Tool::new(t.name.clone(), description, input_schema(t))
                .with_annotations(annotations(t.contract))
        })
        .collect();
    let id_arg = json!({"type": "string", "pattern": "^act_[0-9A-Za-z]{26}$", "description": "The execution ID (act_...)."});
    if !catalog.raw_hosts.is_empty() {
        out.push(
            Tool::new(
                SSH_EXEC,
                "Run a raw command (an argv array, never shell text) on a host that allows raw \
                 commands. Irreversible: after an unknown outcome it is blocked for human review; \
                 a retry of the same command attaches to the first execution.",
                object(json!({
                    "type": "object",
                    "properties": {
                        "host": {"type": "string", "enum": catalog.raw_hosts},
                        "argv": {"type": "array", "items": {"type": "string"}, "minItems": 1,
                                 "description": "Program and arguments; each word is passed as is, not through a shell."},
                    },
                    "required": ["host", "argv"],
                    "additionalProperties": false,
                })),
            )
            .with_annotations(annotations(ReplayContract::Irreversible)),
        );
    }
    out.push(
        Tool::new(
            EXEC_STATUS,
            "What really happened to an execution: the ledger plus a live check of the host's \
             marker. Use it after a lost answer or an unknown outcome.",
            object(json!({"type": "object", "properties": {"id": id_arg}, "required": ["id"], "additionalProperties": false})),
        )
        .with_annotations(annotations(ReplayContract::ReadOnly)),
    );
    out.push(
        Tool::new(
            EXEC_RESULT,
            "The stored output of an execution, paged by byte offset (next_offset in the answer).",
            object(json!({"type": "object", "properties": {
                "id": id_arg,
                "stream": {"type": "string", "enum": ["stdout", "stderr"], "description": "Default stdout."},
                "offset": {"type": "integer", "minimum": 0, "description": "Byte offset; default 0."},
                "limit": {"type": "integer", "minimum": 1, "description": "Bytes per page; default 65536."},
            }, "required": ["id"], "additionalProperties": false})),
        )
        .with_annotations(annotations(ReplayContract::ReadOnly)),
    );
    out.push(
        Tool::new(
            EXEC_LIST,
            "Recent executions, newest first, optionally by state, tool or host.",
            object(json!({"type": "object", "properties": {
                "state": {"type": "string", "description": "e.g. running, unknown, completed"},
                "tool": {"type": "string"},
                "host": {"type": "string"},
                "limit": {"type": "integer", "minimum": 1, "maximum": 500},
                "after": {"type": "string", "description": "The `next` of the previous page."},
            }, "additionalProperties": false})),
        )
        .with_annotations(annotations(ReplayContract::ReadOnly)),
    );
    out.push(
        Tool::new(
            EXEC_CANCEL,
            "Cancel an execution: before dispatch, or by killing its process group on the host.",
            object(json!({"type": "object", "properties": {"id": id_arg}, "required": ["id"], "additionalProperties": false})),
        )
        .with_annotations(annotations(ReplayContract::Irreversible).idempotent(true)),
    );
    out
}

/// What the agent should do next, for a state that is not final or needs a human.
fn next_step(state: ExecState, id: ExecutionId) -> Option<String> {
    use ExecState::*;
    Some(match state {
        Unknown | Dispatched | Running | Accepted | Authorized => format!(
            "The outcome of {id} is not known yet: it may have started and may still be running. \
             Call exec_status with id {id} later (or repeat the same call: it attaches to this \
             execution and does not run it again). Do not treat this as a failure."
        ),
        AwaitingApproval => format!(
            "{id} waits for an operator's approval. Repeat the same call or call exec_status with \
             id {id} later."
        ),
        Interrupted => format!(
            "{id} started and its process vanished without an exit record; an operator must \
             review it (`waymark exec review {id}`)."
        ),
        Failed => {
            format!("{id} did not start: nothing ran on the host; it is safe to try again.")
        }
        Completed | TimedOut | Cancelled | Denied | Expired | Reviewed => return None,
    })
}

/// Whether a state (and exit code) is reported with `isError: true`: a command that ran and
/// exited non-zero, one that provably did not start, timed out, or was refused. An unknown or
/// pending outcome is never an error.
fn is_error(state: ExecState, exit: i32) -> bool {
    match state {
        ExecState::Completed => exit != 0,
        ExecState::Failed | ExecState::TimedOut | ExecState::Denied | ExecState::Expired => true,
        _ => false,
    }
}

/// A call's (or a status's) final frame as an MCP tool result: structured content carries the
/// execution ID and state; the text says the same in words, with the output.
pub fn execution_result(frame: Frame) -> CallToolResult {
    match frame {
        Frame::Done { data, text, exit } => {
            let answer: CallAnswer = match serde_json::from_value(data.clone()) {
                Ok(a) => a,
                Err(e) => return garbled(&e.to_string()),
            };
            // The structured content is the daemon's answer as it came, with what an agent
            // needs added: the exit code, the next step, the message in its terms.
            let Value::Object(mut content) = data else {
                return garbled("not an object");
            };
            let (id, state) = (answer.execution.id, answer.execution.state);
            let mut lines = vec![format!("execution {id}: {state}")];
            if state == ExecState::Completed {
                content.insert("exit_code".into(), json!(exit));
                lines[0].push_str(&format!(" (exit code {exit})"));
            }
            if !text.is_empty() {
                lines.push(for_agent(&text));
            }
            if let Some(a) = answer.attached {
                // The daemon's text says it attached and to which execution; this, why, and
                // how to make a new intent instead.
                lines.push(format!(
                    "Same intent as an earlier call: {}. A new `{IDEMPOTENCY_KEY_META}` in the call's `_meta` makes a new intent.",
                    attach_words(a)
                ));
            }
            content.insert("message".into(), json!(for_agent(&answer.message)));
            if let Some(next) = next_step(state, id) {
                lines.push(next.clone());
                content.insert("next".into(), json!(next));
            }
            if let Some(out) = &answer.output {
                for stream in Stream::BOTH {
                    // The output once: as text when it is UTF-8, else as base64 only (the
                    // lossy text of binary output would mislead a model).
                    let bytes = out.heads.bytes(stream);
                    let utf8 = std::str::from_utf8(&bytes).is_ok();
                    let drop = if utf8 {
                        format!("{stream}_b64")
                    } else {
                        stream.to_string()
                    };
                    content.remove(&drop);
                    let s = out.heads.text(stream);
                    if !utf8 {
                        lines.push(format!(
                            "--- {stream}: {} bytes of binary output, base64 in structuredContent.{stream}_b64 ---",
                            bytes.len()
                        ));
                    } else if !s.is_empty() {
                        lines.push(format!("--- {stream} ---\n{s}"));
                    }
                    if out.truncated(stream) {
                        lines.push(format!(
                            "({stream} truncated in the ledger; {} bytes in all)",
                            out.heads.total(stream)
                        ));
                    }
                }
            }
            let error = is_error(state, exit);
            build(Value::Object(content), lines.join("\n"), error)
        }
        Frame::Error { message, exit } => {
            build(json!({"error": message, "exit": exit}), message, true)
        }
        Frame::Event(_) => build(json!({}), "unexpected answer".into(), true),
    }
}

/// A fan-out's final frame as an MCP tool result: a section per host, each what a call on
/// that host alone would answer ([`execution_result`]), in the text and under `hosts` in the
/// structured content. It is an error when any host's result is one; an unknown or pending
/// host is not.
pub fn fan_out_result(frame: Frame) -> CallToolResult {
    let (data, exit) = match frame {
        Frame::Done { data, exit, .. } => (data, exit),
        other => return execution_result(other),
    };
    let answer: FanOutAnswer = match serde_json::from_value(data) {
        Ok(a) => a,
        Err(e) => return garbled(&e.to_string()),
    };
    let mut lines = vec![format!(
        "tool {} on {} hosts (exit code {exit}):",
        answer.tool,
        answer.hosts.len()
    )];
    let mut hosts = Vec::new();
    let mut error = false;
    for h in answer.hosts {
        let one = match h.execution {
            Some(call) => execution_result(Frame::Done {
                data: serde_json::to_value(call).expect("answers serialize"),
                text: String::new(),
                exit: h.exit,
            }),
            None => execution_result(Frame::Error {
                message: h.error.unwrap_or_default(),
                exit: h.exit,
            }),
        };
        let content = one.structured_content.clone().unwrap_or_default();
        let id = content["id"].as_str().unwrap_or("no execution").to_string();
        lines.push(format!("== {}: {id} ==\n{}", h.host, text_of(&one)));
        error |= one.is_error == Some(true);
        hosts.push(json!({"host": h.host, "exit": h.exit, "execution": content}));
    }
    build(
        json!({"tool": answer.tool, "exit_code": exit, "hosts": hosts}),
        lines.join("\n"),
        error,
    )
}

fn text_of(r: &CallToolResult) -> String {
    r.content
        .iter()
        .filter_map(|c| c.as_text().map(|t| t.text.clone()))
        .collect::<Vec<_>>()
        .join("\n")
}

/// An answer of the daemon that is not what the request answers with.
fn garbled(why: &str) -> CallToolResult {
    let message = format!("garbled answer from the Waymark daemon: {why}");
    build(json!({"error": message, "exit": 1}), message, true)
}

/// The daemon's texts name CLI commands; an agent has tools instead. Every
/// "`waymark exec status|result|cancel ID`" becomes the MCP tool to call with that id; other
/// commands are for an operator, and the texts say so where they name them.
pub fn for_agent(text: &str) -> String {
    const TOOLS: [(&str, &str); 3] = [
        ("`waymark exec status ", EXEC_STATUS),
        ("`waymark exec result ", EXEC_RESULT),
        ("`waymark exec cancel ", EXEC_CANCEL),
    ];
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    'scan: while let Some(at) = rest.find("`waymark exec ") {
        out.push_str(&rest[..at]);
        let tail = &rest[at..];
        for (cli, tool) in TOOLS {
            if let Some(args) = tail.strip_prefix(cli) {
                if let Some(end) = args.find('`') {
                    let id = &args[..end];
                    if !id.is_empty() && id.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_')
                    {
                        out.push_str(&format!("the `{tool}` tool with id {id}"));
                        rest = &args[end + 1..];
                        continue 'scan;
                    }
                }
            }
        }
        out.push('`');
        rest = &tail[1..];
    }
    out.push_str(rest);
    out
}

/// The connection to the daemon broke after the call was sent: the outcome is unknown.
pub fn lost_call(id: Option<ExecutionId>, why: &str) -> CallToolResult {
    let (next, data) = match id {
        Some(id) => {
            let next = next_step(ExecState::Unknown, id).expect("unknown has a next step");
            (
                next.clone(),
                json!({"id": id, "state": "unknown", "next": next}),
            )
        }
        None => {
            let next = "The call may have been accepted and may be running: call exec_list, then \
                        exec_status with its id; repeating the same call attaches to it."
                .to_string();
            (
                next.clone(),
                json!({"id": null, "state": "unknown", "next": next}),
            )
        }
    };
    build(
        data,
        format!("lost the connection to the Waymark daemon: {why}. {next}"),
        false,
    )
}

/// A plain answer (list, stored output page) or an error message.
pub fn build(data: Value, text: String, error: bool) -> CallToolResult {
    let mut r = if error {
        CallToolResult::structured_error(data)
    } else {
        CallToolResult::structured(data)
    };
    r.content = vec![ContentBlock::text(text)];
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_agent_is_told_the_tool_not_the_cli_command() {
        let t = "Running on the host. Run `waymark exec status act_01ABC` or `waymark exec result act_01ABC` later.";
        assert_eq!(
            for_agent(t),
            "Running on the host. Run the `exec_status` tool with id act_01ABC or the `exec_result` tool with id act_01ABC later."
        );
        let op = "Awaiting approval: an operator runs `waymark approve act_1` or `waymark exec review act_1 --ran`.";
        assert_eq!(for_agent(op), op, "operator commands stay as they are");
        assert_eq!(
            for_agent("`waymark exec status `"),
            "`waymark exec status `"
        );
    }

    fn spec() -> ToolSpec {
        ToolSpec {
            name: "deploy".into(),
            description: "Deploy.".into(),
            contract: ReplayContract::Irreversible,
            args: vec![
                ArgInfo {
                    name: "version".into(),
                    ty: "string".into(),
                    description: Some("Version.".into()),
                    values: vec![],
                    pattern: Some("^(?:v[0-9]+)$".into()),
                    secret: false,
                    required: true,
                },
                ArgInfo {
                    name: "token".into(),
                    ty: "string".into(),
                    description: None,
                    values: vec![],
                    pattern: None,
                    secret: true,
                    required: false,
                },
            ],
            hosts: vec!["a".into(), "b".into()],
            host_arg: true,
        }
    }

    #[test]
    fn schema_carries_types_patterns_secrets_and_host() {
        let s = Value::Object((*input_schema(&spec())).clone());
        assert_eq!(s["properties"]["version"]["pattern"], "^(?:v[0-9]+)$");
        assert_eq!(s["properties"]["token"]["writeOnly"], true);
        assert_eq!(s["properties"]["host"]["enum"], json!(["a", "b"]));
        assert_eq!(s["properties"][ALL_HOSTS]["type"], "boolean");
        assert_eq!(
            s["required"],
            json!(["version"]),
            "host, or all_hosts: neither alone is required"
        );
        let one_host = ToolSpec {
            hosts: vec!["a".into()],
            ..spec()
        };
        let s = Value::Object((*input_schema(&one_host)).clone());
        assert_eq!(s["properties"].get(ALL_HOSTS), None, "one host: no fan-out");
        assert_eq!(s["required"], json!(["version", "host"]));
    }

    #[test]
    fn irreversible_is_destructive_and_read_only_is_read_only() {
        assert_eq!(
            annotations(ReplayContract::Irreversible).destructive_hint,
            Some(true)
        );
        assert_eq!(
            annotations(ReplayContract::ReadOnly).read_only_hint,
            Some(true)
        );
        assert_eq!(
            annotations(ReplayContract::Idempotent).idempotent_hint,
            Some(true)
        );
    }

    #[test]
    fn unknown_is_not_an_error_and_says_what_to_do() {
        let answer = CallAnswer {
            execution: waymark_protocol::ExecutionView {
                id: "act_01J9Z3K8Q4M7W2X5Y6Z8A9B0CD".parse().unwrap(),
                state: ExecState::Unknown,
                result_observed: false,
                result_delivered: false,
                tool: "deploy".into(),
                host: "web1".into(),
                actor: waymark_core::Actor("a".into()),
                contract: ReplayContract::Irreversible,
                fingerprint: waymark_core::Fingerprint([0; 32]),
                accepted_at_ms: waymark_core::Timestamp::from_millis(1),
                updated_at_ms: waymark_core::Timestamp::from_millis(2),
                finished_at_ms: None,
                outcome: None,
                reason: Some("lost".into()),
                dispatch_attempts: 1,
                run: None,
            },
            attached: None,
            message: "lost".into(),
            output: None,
        };
        let r = execution_result(Frame::Done {
            data: serde_json::to_value(answer).unwrap(),
            text: "lost".into(),
            exit: 200,
        });
        assert_eq!(r.is_error, Some(false));
        assert!(r.structured_content.unwrap()["next"]
            .as_str()
            .unwrap()
            .contains("exec_status"));
    }
}
