//! The control protocol's JSON shape, pinned: every answer and event round-trips and has
//! exactly the keys the untyped answers had (an older peer reads them by these names).

use serde::de::DeserializeOwned;
use serde::Serialize;
use serde_json::{json, Value};
use waymark_core::{
    Actor, AttachAction, ExecState, ExecutionId, Fingerprint, Outcome, ReplayContract, Timestamp,
};
use waymark_protocol::*;

const ID: &str = "act_01J9Z3K8Q4M7W2X5Y6Z8A9B0CD";

fn id() -> ExecutionId {
    ID.parse().unwrap()
}

fn execution() -> ExecutionView {
    ExecutionView {
        id: id(),
        state: ExecState::Completed,
        result_observed: true,
        result_delivered: false,
        tool: "deploy".into(),
        host: "web1".into(),
        actor: Actor("uid:1000:/usr/bin/waymark".into()),
        contract: ReplayContract::Irreversible,
        fingerprint: Fingerprint([7; 32]),
        accepted_at_ms: Timestamp::from_millis(1_000),
        updated_at_ms: Timestamp::from_millis(2_000),
        finished_at_ms: Some(Timestamp::from_millis(2_000)),
        outcome: Some(Outcome::Exited {
            exit_code: Some(0),
            signal: None,
        }),
        reason: None,
        dispatch_attempts: 1,
        run: Some("run_1".into()),
    }
}

const EXECUTION_KEYS: &[&str] = &[
    "id",
    "state",
    "result_observed",
    "result_delivered",
    "tool",
    "host",
    "actor",
    "contract",
    "fingerprint",
    "accepted_at_ms",
    "updated_at_ms",
    "finished_at_ms",
    "outcome",
    "reason",
    "dispatch_attempts",
    "run",
];

const HEAD_KEYS: &[&str] = &[
    "stdout",
    "stderr",
    "stdout_b64",
    "stderr_b64",
    "stdout_stored",
    "stderr_stored",
    "stdout_bytes",
    "stderr_bytes",
];

const CALL_KEYS: &[&str] = &["attached", "message"];

const TRUNCATED_KEYS: &[&str] = &["stdout_truncated", "stderr_truncated"];

/// Serializes `v`, checks its keys are exactly `keys`, reads it back and compares.
fn pinned<T: Serialize + DeserializeOwned + PartialEq + std::fmt::Debug>(
    v: &T,
    keys: &[&[&str]],
) -> Value {
    let json = serde_json::to_value(v).unwrap();
    let mut got: Vec<&str> = json
        .as_object()
        .unwrap()
        .keys()
        .map(String::as_str)
        .collect();
    let mut want: Vec<&str> = keys.concat();
    got.sort_unstable();
    want.sort_unstable();
    assert_eq!(got, want, "keys of {json}");
    let back: T = serde_json::from_value(json.clone()).unwrap();
    assert_eq!(&back, v);
    json
}

fn call(output: bool) -> CallAnswer {
    CallAnswer {
        execution: execution(),
        attached: Some(AttachAction::PendingApproval),
        message: "done".into(),
        output: output.then(|| CallOutput {
            heads: OutputHeads::new(b"hi\n", 3, b"", 0),
            stdout_truncated: false,
            stderr_truncated: false,
        }),
    }
}

#[test]
fn an_execution_has_the_record_keys_and_typed_values_as_strings() {
    let v = pinned(&execution(), &[EXECUTION_KEYS]);
    assert_eq!(v["id"], ID);
    assert_eq!(v["state"], "completed");
    assert_eq!(v["contract"], "irreversible");
    assert_eq!(v["accepted_at_ms"], 1_000);
    assert_eq!(v["actor"], "uid:1000:/usr/bin/waymark");
    assert!(v["fingerprint"]
        .as_str()
        .unwrap()
        .starts_with("hmac-sha256:"));
}

#[test]
fn a_call_answer_carries_its_output_only_once_it_has_a_result() {
    let with = pinned(
        &call(true),
        &[EXECUTION_KEYS, HEAD_KEYS, CALL_KEYS, TRUNCATED_KEYS],
    );
    assert_eq!(with["attached"], "pending_approval");
    assert_eq!(with["stdout_b64"], "aGkK");
    assert_eq!(call(true).result_of(), Some(id()));
    let without = pinned(&call(false), &[EXECUTION_KEYS, CALL_KEYS]);
    assert_eq!(
        serde_json::from_value::<CallAnswer>(without)
            .unwrap()
            .output,
        None
    );
    let mut running = call(false);
    running.execution.result_observed = false;
    running.execution.state = ExecState::Running;
    assert_eq!(running.result_of(), None);
}

#[test]
fn a_status_answer_is_a_call_answer_with_the_host_check() {
    let s = StatusAnswer {
        call: call(true),
        host_check_error: None,
        delivered_with_this_answer: true,
    };
    let v = pinned(
        &s,
        &[
            EXECUTION_KEYS,
            HEAD_KEYS,
            CALL_KEYS,
            TRUNCATED_KEYS,
            &["host_check_error", "delivered_with_this_answer"],
        ],
    );
    assert_eq!(v["host_check_error"], Value::Null);
    assert_eq!(Answer::Status(s).result_of(), Some(id()));
}

#[test]
fn a_result_is_stored_or_partial_and_only_a_stored_one_is_a_result() {
    let stored = ResultView {
        id: id(),
        state: ExecState::Completed,
        partial: false,
        heads: OutputHeads::new(b"hi\n", 3, b"", 0),
        stdout_sha256: Some("ab".into()),
        stderr_sha256: Some("cd".into()),
        truncated: Some(false),
        message: None,
    };
    pinned(
        &stored,
        &[
            &["id", "state", "stdout_sha256", "stderr_sha256", "truncated"],
            HEAD_KEYS,
        ],
    );
    assert_eq!(Answer::Result(stored).result_of(), Some(id()));
    let partial = ResultView {
        id: id(),
        state: ExecState::Running,
        partial: true,
        heads: OutputHeads::new(b"so far", 6, b"", 0),
        stdout_sha256: None,
        stderr_sha256: None,
        truncated: None,
        message: Some("still running".into()),
    };
    let v = pinned(
        &partial,
        &[&["id", "state", "partial", "message"], HEAD_KEYS],
    );
    assert_eq!(v["partial"], true);
    assert_eq!(Answer::Result(partial).result_of(), None);
}

#[test]
fn the_other_answers_keep_their_keys() {
    let page = OutputPage {
        id: id(),
        stream: Stream::Stderr,
        offset: 4,
        length: 2,
        size: 6,
        data_b64: "aGk=".into(),
    };
    let v = pinned(
        &page,
        &[&["id", "stream", "offset", "length", "size", "data_b64"]],
    );
    assert_eq!(v["stream"], "stderr");
    assert_eq!(page.bytes(), b"hi");
    pinned(
        &ExecutionList {
            items: vec![execution()],
            next: Some(id()),
        },
        &[&["items", "next"]],
    );
    pinned(
        &ApprovalList {
            items: vec![execution()],
        },
        &[&["items"]],
    );
    pinned(&Pong { pong: true, pid: 7 }, &[&["pong", "pid"]]);
    pinned(
        &Explanation {
            execution: execution(),
            answers: vec!["1.".into()],
            timeline: vec![],
            later_executions: vec![id()],
        },
        &[&["execution", "answers", "timeline", "later_executions"]],
    );
    pinned(
        &LockState {
            locked: true,
            changed: false,
        },
        &[&["locked", "changed"]],
    );
    pinned(
        &RunView {
            id: "run_1".into(),
            actor: Actor("a".into()),
            transport: "cli".into(),
            started_at: Timestamp::from_millis(1),
            ended_at: None,
            calls: 2,
        },
        &[&[
            "id",
            "actor",
            "transport",
            "started_at",
            "ended_at",
            "calls",
        ]],
    );
    pinned(&RunList { items: vec![] }, &[&["items"]]);
    let head = ChainPosition {
        seq: 3,
        hash: "ff".into(),
    };
    pinned(&head, &[&["seq", "hash"]]);
    pinned(
        &AuditReport {
            ok: false,
            events: 3,
            base: head.clone(),
            head,
            broken: Some(ChainBreakView {
                seq: 2,
                problem: "edited".into(),
            }),
        },
        &[&["ok", "events", "base", "head", "broken"]],
    );
    pinned(
        &GcReport {
            removed: 1,
            removed_runs: 2,
            kept_unresolved: 0,
            pruned_through: None,
            dry_run: false,
        },
        &[&[
            "removed",
            "removed_runs",
            "kept_unresolved",
            "pruned_through",
            "dry_run",
        ]],
    );
}

#[test]
fn an_answer_is_written_as_its_value_and_read_back_as_the_requested_type() {
    let frame: Frame<Answer> = Frame::Done {
        data: Answer::Call(call(true)),
        text: "t".into(),
        exit: 0,
    };
    assert_eq!(frame.result_of(), Some(id()));
    let line = serde_json::to_string(&frame).unwrap();
    let read: Frame = serde_json::from_str(&line).unwrap();
    match read.answer::<CallAnswer>() {
        Frame::Done { data, .. } => assert_eq!(data, call(true)),
        other => panic!("{other:?}"),
    }
    let garbled: Frame = serde_json::from_value(
        json!({"frame": "done", "data": {"pong": true}, "text": "", "exit": 0}),
    )
    .unwrap();
    assert!(matches!(
        garbled.answer::<CallAnswer>(),
        Frame::Error { message, .. } if message.contains("garbled")
    ));
}

#[test]
fn events_keep_kind_and_data_and_an_unknown_kind_is_ignored() {
    let cases = [
        (
            Event::Execution {
                id: id(),
                attached: None,
            },
            json!({"frame": "event", "kind": "execution", "data": {"id": ID, "attached": null}}),
        ),
        (
            Event::Output {
                stream: Stream::Stdout,
                offset: 3,
                data_b64: "aGk=".into(),
            },
            json!({"frame": "event", "kind": "output", "data": {"stream": "stdout", "offset": 3, "data_b64": "aGk="}}),
        ),
        (
            Event::Calling {
                tool: "deploy".into(),
                host: "web1".into(),
            },
            json!({"frame": "event", "kind": "calling", "data": {"tool": "deploy", "host": "web1"}}),
        ),
        (
            Event::Progress {
                of: "events verified".into(),
                done: 8192,
                total: Some(20000),
            },
            json!({"frame": "event", "kind": "progress", "data": {"of": "events verified", "done": 8192, "total": 20000}}),
        ),
        (
            Event::AwaitingApproval(ApprovalQuestion {
                id: id(),
                tool: "deploy".into(),
                host: "web1".into(),
                actor: Actor("a".into()),
                contract: ReplayContract::Irreversible,
                action: "{}".into(),
            }),
            json!({"frame": "event", "kind": "awaiting_approval", "data": {"id": ID, "tool": "deploy", "host": "web1", "actor": "a", "contract": "irreversible", "action": "{}"}}),
        ),
    ];
    for (event, wire) in cases {
        let frame: Frame<Answer> = Frame::Event(event.clone());
        assert_eq!(serde_json::to_value(&frame).unwrap(), wire);
        match serde_json::from_value::<Frame>(wire).unwrap() {
            Frame::Event(e) => assert_eq!(e, event),
            other => panic!("{other:?}"),
        }
    }
    let newer = json!({"frame": "event", "kind": "from_a_newer_daemon", "data": {"x": 1}});
    assert!(matches!(
        serde_json::from_value::<Frame>(newer).unwrap(),
        Frame::Event(Event::Other(_))
    ));
}

#[test]
fn requests_carry_ids_states_and_streams_as_strings() {
    let r = Request::Output {
        id: id(),
        stream: Stream::Stderr,
        offset: 0,
        max: 10,
    };
    let v = serde_json::to_value(Envelope {
        v: PROTOCOL_VERSION,
        deadline_ms: None,
        request: r,
    })
    .unwrap();
    assert_eq!(
        v,
        json!({"v": 1, "op": "output", "id": ID, "stream": "stderr", "offset": 0, "max": 10})
    );
    let list: Request = serde_json::from_value(json!({"op": "list", "state": "timed_out", "host": null, "tool": null, "actor": null, "since_ms": null, "limit": null, "after": null})).unwrap();
    assert!(matches!(
        list,
        Request::List {
            state: Some(ExecState::TimedOut),
            ..
        }
    ));
    assert_eq!(
        answer::parse_state("nope").unwrap_err(),
        format!(
            "unknown state \"nope\"; states: {}",
            ExecState::ALL.map(|s| s.as_str()).join(", ")
        )
    );
}

/// A read's deadline travels beside the version, as `deadline_ms`; an envelope without one
/// (an older client's) reads as none, and a daemon of an older build, whose envelope has no
/// such field, reads the request as it always did.
#[test]
fn a_read_deadline_is_an_optional_field_of_the_envelope() {
    let status = Request::Status {
        id: id(),
        defer_delivery: false,
    };
    let v = serde_json::to_value(Envelope {
        v: PROTOCOL_VERSION,
        deadline_ms: Some(2000),
        request: status,
    })
    .unwrap();
    assert_eq!(
        v,
        json!({"v": 1, "deadline_ms": 2000, "op": "status", "id": ID, "defer_delivery": false})
    );
    let old: Envelope = serde_json::from_value(json!({"v": 1, "op": "status", "id": ID})).unwrap();
    assert_eq!(old.deadline_ms, None);

    #[derive(serde::Deserialize)]
    struct OlderEnvelope {
        v: u32,
        #[serde(flatten)]
        request: Request,
    }
    let older: OlderEnvelope = serde_json::from_value(v).unwrap();
    assert_eq!(older.v, 1);
    assert!(matches!(older.request, Request::Status { id: i, .. } if i == id()));
}

/// Only requests that change nothing are read-only: a client sends those again after a broken
/// connection, and never a call.
#[test]
fn only_reads_are_read_only() {
    let reads = [
        Request::Status {
            id: id(),
            defer_delivery: false,
        },
        Request::Result {
            id: id(),
            defer_delivery: true,
        },
        Request::Explain { id: id() },
        Request::List {
            state: None,
            host: None,
            tool: None,
            actor: None,
            since_ms: None,
            limit: None,
            after: None,
            mine: false,
        },
    ];
    assert!(reads.iter().all(Request::is_read_only));
    let effects = [
        Request::Call {
            tool: Some("t".into()),
            args: Default::default(),
            host: None,
            raw: None,
            key: None,
            transport: None,
            defer_delivery: false,
        },
        Request::Resume {
            id: id(),
            tool: None,
            args: Default::default(),
            raw: None,
        },
        Request::Cancel { id: id() },
        Request::Delivered { id: id() },
        Request::Approve { id: id() },
        Request::Unlock,
    ];
    assert!(!effects.iter().any(Request::is_read_only));
}

/// An answer a client cannot read is Waymark's own failure: the one `exit::ERROR` (204), which
/// was once written here as 1, a remote command's ordinary failure.
#[test]
fn an_answer_that_is_not_the_requested_type_is_waymarks_own_failure() {
    let frame: Frame<Value> = Frame::Done {
        data: json!("not a view"),
        text: String::new(),
        exit: 0,
    };
    match frame.answer::<ExecutionView>() {
        Frame::Error { message, exit } => {
            assert_eq!(exit, exit::ERROR, "{message}");
            assert_eq!(exit, 204);
            assert!(message.contains("garbled answer"), "{message}");
        }
        other => panic!("a garbled answer was read: {other:?}"),
    }
}
