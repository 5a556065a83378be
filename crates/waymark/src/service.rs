//! Carries out control requests against the gateway: the daemon does it for its clients, the
//! CLI does it in-process when no daemon runs. One implementation, so both behave alike.

use std::sync::Arc;
use std::time::Duration;

use serde_json::{json, Value};
use waymark_core::{Actor, Delivery, ExecState, ExecutionId, IntentScope, Outcome, Timestamp};
use waymark_gateway::flow::{describe, describe_answer, now, CallOutcome, Gateway, GatewayError};
use waymark_gateway::host::HostExecutor;
use waymark_gateway::tools::{self, CallContext, ResolvedCall};
use waymark_ledger::{ChainHead, EventKind, ExecutionRecord, ListQuery};

use crate::exit;
use crate::protocol::answer::encode_b64;
use crate::protocol::{
    Answer, ApprovalList, ApprovalQuestion, ArgInfo, AuditReport, CallAnswer, CallOutput,
    ChainBreakView, ChainPosition, Event, ExecutionList, ExecutionView, Explanation, GcReport,
    LockState, OutputHeads, OutputPage, Pong, Request, ResultView, RunView, StatusAnswer, Stream,
    ToolCatalog, ToolSpec,
};

/// A final frame as the daemon builds it: a typed answer, or an error.
pub type Frame = crate::protocol::Frame<Answer>;

/// Who is on the other end, as the OS proves it.
#[derive(Clone, Debug)]
pub struct Peer {
    pub uid: u32,
    pub pid: Option<u32>,
    pub exe: String,
    /// Process start time in clock ticks since boot (tells a reused pid apart).
    pub start_ticks: Option<u64>,
}

impl Peer {
    /// The actor of the matching rule: user and program. A retry from a new process of the
    /// same program is the same actor; the process itself is recorded in the run.
    pub fn actor(&self) -> Actor {
        Actor(format!("uid:{}:{}", self.uid, self.exe))
    }

    /// This process, for the CLI working without a daemon.
    pub fn this_process() -> Peer {
        let pid = std::process::id();
        Peer {
            uid: unsafe { libc::geteuid() },
            pid: Some(pid),
            exe: std::env::current_exe()
                .map(|p| p.display().to_string())
                .unwrap_or_else(|_| "?".into()),
            start_ticks: process_start_ticks(pid),
        }
    }

    pub fn describe(&self) -> String {
        format!(
            "pid={} start={} exe={}",
            self.pid.map_or("?".into(), |p| p.to_string()),
            self.start_ticks.map_or("?".into(), |t| t.to_string()),
            self.exe
        )
    }
}

/// Field 22 of /proc/PID/stat.
pub fn process_start_ticks(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let after = &stat[stat.rfind(')')? + 2..];
    after.split_whitespace().nth(19)?.parse().ok()
}

pub struct Service<E: HostExecutor> {
    pub gateway: Arc<Gateway<E>>,
}

/// One client connection: its peer and, once it made a call, its agent run.
pub struct Session {
    pub peer: Peer,
    pub transport: String,
    pub run: Option<String>,
}

fn gw_err(e: GatewayError) -> Frame {
    let code = match &e {
        GatewayError::NotFound(_) | GatewayError::Refused { .. } => exit::USAGE,
        _ => exit::ERROR,
    };
    Frame::Error {
        message: e.to_string(),
        exit: code,
    }
}

/// The exit code an execution's state maps to.
pub fn exit_for(rec: &ExecutionRecord) -> i32 {
    match rec.state() {
        ExecState::Completed => match &rec.outcome {
            Some(Outcome::Exited {
                exit_code: Some(c), ..
            }) => *c,
            Some(Outcome::Exited {
                signal: Some(s), ..
            }) => 128 + s,
            _ => 0,
        },
        ExecState::Failed => exit::NOT_STARTED,
        ExecState::Unknown | ExecState::Dispatched | ExecState::Running => exit::UNKNOWN,
        ExecState::TimedOut | ExecState::Cancelled => exit::STOPPED,
        ExecState::Reviewed => 0,
        _ => exit::BLOCKED,
    }
}

/// An execution record as the protocol shows it.
pub fn execution_view(rec: &ExecutionRecord) -> ExecutionView {
    ExecutionView {
        id: rec.id,
        state: rec.state(),
        result_observed: rec.lifecycle.result_observed,
        result_delivered: rec.lifecycle.result_delivered,
        tool: rec.tool.clone(),
        host: rec.host.clone(),
        actor: rec.actor.clone(),
        contract: rec.contract,
        fingerprint: rec.fingerprint,
        accepted_at_ms: rec.accepted_at,
        updated_at_ms: rec.updated_at,
        finished_at_ms: rec.finished_at,
        outcome: rec.outcome.clone(),
        reason: rec.reason.clone(),
        dispatch_attempts: rec.dispatch_attempts,
        run: rec.run.clone(),
    }
}

/// The data of an `awaiting_approval` event: what a front end shows its user to decide on.
pub fn approval_question(rec: &ExecutionRecord) -> ApprovalQuestion {
    ApprovalQuestion {
        id: rec.id,
        tool: rec.tool.clone(),
        host: rec.host.clone(),
        actor: rec.actor.clone(),
        contract: rec.contract,
        action: rec.action.as_str().to_string(),
    }
}

fn call_answer(o: &CallOutcome) -> CallAnswer {
    CallAnswer {
        execution: execution_view(&o.record),
        attached: o.attached,
        message: o.message.clone(),
        output: o.result.as_ref().map(|r| CallOutput {
            heads: OutputHeads::new(
                &r.stdout.head,
                r.stdout.total_bytes,
                &r.stderr.head,
                r.stderr.total_bytes,
            ),
            stdout_truncated: r.stdout.truncated(),
            stderr_truncated: r.stderr.truncated(),
        }),
    }
}

pub fn fmt_time(t: Timestamp) -> String {
    let ms = t.as_millis();
    let secs = (ms / 1000) as i64;
    let days = secs.div_euclid(86_400);
    let rem = secs.rem_euclid(86_400);
    // Civil date from days since the epoch (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let y = yoe + era * 400;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = if m <= 2 { y + 1 } else { y };
    format!(
        "{y:04}-{m:02}-{d:02} {:02}:{:02}:{:02}.{:03}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60,
        ms % 1000
    )
}

impl<E: HostExecutor> Service<E> {
    fn resolve(
        &self,
        session: &Session,
        tool: Option<&str>,
        args: &serde_json::Map<String, Value>,
        host: Option<&str>,
        raw: Option<&[String]>,
        key: Option<&str>,
    ) -> Result<ResolvedCall, String> {
        let ctx = CallContext {
            actor: session.peer.actor(),
            scope: key.map_or(IntentScope::ToolWindow, |k| IntentScope::Key(k.to_string())),
            delivery: Delivery {
                transport: Some(session.transport.clone()),
                ..Default::default()
            },
        };
        let cfg = self.gateway.config();
        let usage = |e: tools::CallError| e.to_string();
        match (tool, raw) {
            (Some(t), None) => {
                let mut args = args.clone();
                if let Some(h) = host {
                    args.insert("host".into(), json!(h));
                }
                tools::resolve(cfg, t, &args, ctx).map_err(usage)
            }
            (None, Some(argv)) => {
                let h = host.ok_or("a raw command needs --host")?;
                if !cfg.hosts.contains_key(h) {
                    return Err(format!(
                        "unknown host {h:?}; configured: {}",
                        cfg.hosts.keys().cloned().collect::<Vec<_>>().join(", ")
                    ));
                }
                tools::resolve_raw(cfg, h, argv, ctx).map_err(usage)
            }
            _ => Err("give a tool name, or --host H -- COMMAND...".into()),
        }
    }

    fn ensure_run(&self, session: &mut Session) -> Option<String> {
        if session.run.is_none() {
            let transport = format!("{} {}", session.transport, session.peer.describe());
            if let Ok(run) = self.gateway.ledger().start_run(
                session.peer.actor(),
                &transport,
                now(),
                waymark_ledger::Durability::Buffered,
            ) {
                session.run = Some(run.id);
            }
        }
        session.run.clone()
    }

    /// Carries out one request for any transport: the one request runner, used by the socket
    /// server and the in-process HTTP backend. `event` gets the request's events as they
    /// happen; `write` writes the final frame and says whether the whole answer reached the
    /// caller. Only then is a result the answer carries marked delivered, and only when the
    /// client does not mark it itself (`defer_delivery`). The session's agent run ends with
    /// the request.
    pub async fn run<W: std::future::Future<Output = bool>>(
        &self,
        req: Request,
        mut session: Session,
        event: impl FnMut(Event) + Send,
        write: impl FnOnce(Frame) -> W,
    ) {
        let by_transport = req.delivered_by_transport();
        let done = self.handle(req, &mut session, event).await;
        let carried = done.result_of();
        if write(done).await && by_transport {
            self.answer_written(carried);
        }
        self.end_session(&session);
    }

    /// The whole answer carrying `carried`'s result was written to the caller's transport: the
    /// one place that marks a result delivered for a transport.
    fn answer_written(&self, carried: Option<ExecutionId>) {
        if let Some(id) = carried {
            if let Err(e) = self.gateway.delivered(id) {
                tracing::warn!(%id, error = %e, "cannot record the delivery of a written result");
            }
        }
    }

    /// The answer to `result` for an execution that has not ended: what it printed so far, read
    /// from the host's marker (the first `result_cap` bytes of each stream). Marked `partial`:
    /// it is not a result and is never marked delivered.
    async fn output_so_far(&self, rec: &ExecutionRecord) -> Frame {
        let g = &self.gateway;
        let cap = g.result_cap;
        let mut so_far: [(Vec<u8>, u64); 2] = Default::default();
        for stream in Stream::BOTH {
            match g
                .read_output(rec.id, stream == Stream::Stdout, 0, cap)
                .await
            {
                Ok((bytes, size)) => {
                    let size = size.max(bytes.len() as u64);
                    so_far[stream.index()] = (bytes, size);
                }
                Err(e) => {
                    return Frame::Error {
                        message: format!(
                            "{} no output can be read just now: {e}",
                            describe(rec, None)
                        ),
                        exit: exit_for(rec),
                    }
                }
            }
        }
        let text = format!(
            "{} still running on the host: this is its output so far, not its result. Run `waymark exec result {}` again once it ended.",
            rec.id, rec.id
        );
        let [(stdout, stdout_bytes), (stderr, stderr_bytes)] = &so_far;
        let data = ResultView {
            id: rec.id,
            state: rec.state(),
            partial: true,
            heads: OutputHeads::new(stdout, *stdout_bytes, stderr, *stderr_bytes),
            stdout_sha256: None,
            stderr_sha256: None,
            truncated: None,
            message: Some(text.clone()),
        };
        Frame::Done {
            data: Answer::Result(data),
            text,
            exit: exit_for(rec),
        }
    }

    /// Ends the session's agent run, if it started one.
    fn end_session(&self, session: &Session) {
        if let Some(r) = &session.run {
            let _ = self
                .gateway
                .ledger()
                .end_run(r, now(), waymark_ledger::Durability::Buffered);
        }
    }

    /// Handles one request; `event` receives its events; the final frame is returned.
    async fn handle(
        &self,
        req: Request,
        session: &mut Session,
        mut event: impl FnMut(Event) + Send,
    ) -> Frame {
        let g = &self.gateway;
        let by = format!("uid:{}", session.peer.uid);
        match req {
            Request::Ping => Frame::Done {
                data: Answer::Pong(Pong {
                    pong: true,
                    pid: std::process::id(),
                }),
                text: "daemon is running".into(),
                exit: 0,
            },
            Request::Call {
                tool,
                args,
                host,
                raw,
                key,
                transport,
                defer_delivery: _,
            } => {
                if let Some(t) = transport {
                    session.transport = t;
                }
                let call = match self.resolve(
                    session,
                    tool.as_deref(),
                    &args,
                    host.as_deref(),
                    raw.as_deref(),
                    key.as_deref(),
                ) {
                    Ok(c) => c,
                    Err(message) => {
                        return Frame::Error {
                            message,
                            exit: exit::USAGE,
                        }
                    }
                };
                let run = self.ensure_run(session);
                event(Event::Calling {
                    tool: call.tool.clone(),
                    host: call.host.name.clone(),
                });
                let events = std::sync::Mutex::new(&mut event);
                // MCP-approval hook (additive): an `awaiting_approval` event, at most once per
                // request, when this call's execution waits on an approval (the gateway
                // announces it, or this call attached to one already waiting).
                let mut approvals = g.approval_requests();
                let this_id: std::sync::Mutex<(Option<ExecutionId>, bool)> =
                    std::sync::Mutex::new((None, false));
                let announce = |id: ExecutionId| {
                    {
                        let mut t = this_id.lock().expect("this id");
                        if t.0 != Some(id) || t.1 {
                            return;
                        }
                        t.1 = true;
                    }
                    if let Ok(Some(rec)) = g.ledger().get(id) {
                        if rec.state() == ExecState::AwaitingApproval {
                            (events.lock().expect("events"))(Event::AwaitingApproval(
                                approval_question(&rec),
                            ));
                        }
                    }
                };
                let on_id = |id: ExecutionId, attached: Option<waymark_core::AttachAction>| {
                    this_id.lock().expect("this id").0 = Some(id);
                    (events.lock().expect("events"))(Event::Execution { id, attached });
                    if attached == Some(waymark_core::AttachAction::PendingApproval) {
                        announce(id);
                    }
                };
                let on_output = |is_stdout: bool, offset: u64, bytes: &[u8]| {
                    let stream = if is_stdout {
                        Stream::Stdout
                    } else {
                        Stream::Stderr
                    };
                    (events.lock().expect("events"))(Event::Output {
                        stream,
                        offset,
                        data_b64: encode_b64(bytes),
                    });
                };
                let calling = g.call_stream(call, run, &on_id, Some(&on_output));
                tokio::pin!(calling);
                let answer = loop {
                    tokio::select! {
                        o = &mut calling => break o,
                        r = approvals.recv() => match r {
                            Ok(id) => announce(id),
                            // Lagged: ids were lost; the call's own may be among them.
                            Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => {
                                let id = this_id.lock().expect("this id").0;
                                if let Some(id) = id {
                                    announce(id);
                                }
                            }
                            Err(tokio::sync::broadcast::error::RecvError::Closed) => {
                                break calling.await;
                            }
                        },
                    }
                };
                match answer {
                    Ok(o) => {
                        let exit = exit_for(&o.record);
                        Frame::Done {
                            text: o.message.clone(),
                            data: Answer::Call(call_answer(&o)),
                            exit,
                        }
                    }
                    Err(e) => gw_err(e),
                }
            }
            Request::Delivered { id } => match g.delivered(id) {
                Ok(rec) => Frame::Done {
                    data: Answer::Execution(execution_view(&rec)),
                    text: format!("{id}: result delivered"),
                    exit: 0,
                },
                Err(e) => gw_err(e),
            },
            Request::ListTools => Frame::Done {
                data: Answer::Catalog(tool_catalog(g.config())),
                text: String::new(),
                exit: 0,
            },
            Request::Status { id, .. } => {
                match g.status(id).await {
                    Ok((o, probe_error)) => {
                        // This answer carries the result to a caller that gets it delivered
                        // (the transport marks it after the write, or the client after its own).
                        let delivers = o.record.lifecycle.result_observed
                            && !o.record.lifecycle.result_delivered;
                        let mut text = status_text(&o.record, delivers);
                        if let Some(e) = &probe_error {
                            text.push_str(&format!("\nThe host could not be asked just now: {e}"));
                        }
                        let data = StatusAnswer {
                            call: call_answer(&o),
                            host_check_error: probe_error,
                            delivered_with_this_answer: delivers,
                        };
                        Frame::Done {
                            data: Answer::Status(data),
                            text,
                            exit: exit_for(&o.record),
                        }
                    }
                    Err(e) => gw_err(e),
                }
            }
            Request::Result { id, .. } => {
                let mut rec = match g.ledger().get(id) {
                    Ok(Some(r)) => r,
                    Ok(None) => {
                        return Frame::Error {
                            message: format!("execution {id} is not in the ledger"),
                            exit: exit::USAGE,
                        }
                    }
                    Err(e) => {
                        return Frame::Error {
                            message: e.to_string(),
                            exit: exit::ERROR,
                        }
                    }
                };
                if !rec.lifecycle.result_observed && rec.state().may_be_on_host() {
                    // Ask the host first: it may have ended meanwhile (then its result is
                    // fetched and stored), or it runs and has output so far.
                    if let Ok((o, _)) = g.status(id).await {
                        rec = o.record;
                    }
                    if !rec.lifecycle.result_observed && rec.state().may_be_on_host() {
                        return self.output_so_far(&rec).await;
                    }
                }
                match g.ledger().result(id) {
                    Ok(Some(r)) => {
                        let data = ResultView {
                            id,
                            state: rec.state(),
                            partial: false,
                            heads: OutputHeads::new(
                                &r.stdout.head,
                                r.stdout.total_bytes,
                                &r.stderr.head,
                                r.stderr.total_bytes,
                            ),
                            stdout_sha256: Some(r.stdout.sha256.clone()),
                            stderr_sha256: Some(r.stderr.sha256.clone()),
                            truncated: Some(r.stdout.truncated() || r.stderr.truncated()),
                            message: None,
                        };
                        Frame::Done {
                            data: Answer::Result(data),
                            text: String::new(),
                            exit: exit_for(&rec),
                        }
                    }
                    Ok(None) => Frame::Error {
                        message: format!("{id} has no stored result yet. {}", describe(&rec, None)),
                        exit: exit_for(&rec),
                    },
                    Err(e) => Frame::Error {
                        message: e.to_string(),
                        exit: exit::ERROR,
                    },
                }
            }
            Request::Output {
                id,
                stream,
                offset,
                max,
            } => {
                let stdout = stream == Stream::Stdout;
                match g.read_output(id, stdout, offset, max.min(4 << 20)).await {
                    Ok((bytes, size)) => Frame::Done {
                        data: Answer::Output(OutputPage {
                            id,
                            stream,
                            offset,
                            length: bytes.len() as u64,
                            size,
                            data_b64: encode_b64(&bytes),
                        }),
                        text: String::new(),
                        exit: 0,
                    },
                    Err(e) => gw_err(e),
                }
            }
            Request::List {
                state,
                host,
                tool,
                actor,
                since_ms,
                limit,
                after,
            } => {
                let q = ListQuery {
                    state,
                    host,
                    tool,
                    actor: actor.map(Actor),
                    since: since_ms.map(Timestamp::from_millis),
                    limit: limit.unwrap_or(50),
                    after,
                    ..Default::default()
                };
                match g.ledger().list(&q) {
                    Ok(page) => {
                        let text = page
                            .items
                            .iter()
                            .map(|r| {
                                format!(
                                    "{}  {:<18} {:<10} {:<16} {}",
                                    r.id,
                                    r.state().as_str(),
                                    r.host,
                                    r.tool,
                                    fmt_time(r.accepted_at)
                                )
                            })
                            .collect::<Vec<_>>()
                            .join("\n");
                        let data = ExecutionList {
                            items: page.items.iter().map(execution_view).collect(),
                            next: page.next,
                        };
                        Frame::Done {
                            data: Answer::List(data),
                            text,
                            exit: 0,
                        }
                    }
                    Err(e) => Frame::Error {
                        message: e.to_string(),
                        exit: exit::ERROR,
                    },
                }
            }
            Request::Resume {
                id,
                tool,
                args,
                raw,
            } => {
                let rec = match g.ledger().get(id) {
                    Ok(Some(r)) => r,
                    _ => {
                        return Frame::Error {
                            message: format!("execution {id} is not in the ledger"),
                            exit: exit::USAGE,
                        }
                    }
                };
                let host = rec.host.clone();
                let call = match (tool, raw) {
                    (None, None) => match reconstruct(&rec) {
                        Some(argv) if rec.tool == tools::RAW_TOOL => self.resolve(session, None, &Default::default(), Some(&host), Some(&argv), None),
                        _ => return Frame::Error { message: format!("give the call again to resume {id}: `waymark exec resume {id} {} key=value ...` (secret arguments are not stored)", rec.tool), exit: exit::USAGE },
                    },
                    (t, r) => self.resolve(session, t.as_deref(), &args, Some(&host), r.as_deref(), None),
                };
                let call = match call {
                    Ok(c) => c,
                    Err(message) => {
                        return Frame::Error {
                            message,
                            exit: exit::USAGE,
                        }
                    }
                };
                let mut call = call;
                call.request.scope = rec.scope.clone();
                call.request.actor = rec.actor.clone();
                match g.resume(id, &call).await {
                    Ok(o) => Frame::Done {
                        text: o.message.clone(),
                        data: Answer::Call(call_answer(&o)),
                        exit: exit_for(&o.record),
                    },
                    Err(e) => gw_err(e),
                }
            }
            Request::Cancel { id } => match g.cancel(id, &by).await {
                Ok(o) => Frame::Done {
                    text: o.message.clone(),
                    data: Answer::Call(call_answer(&o)),
                    exit: 0,
                },
                Err(e) => gw_err(e),
            },
            Request::Review { id, ran, note } => match g.review(id, ran, &by, &note) {
                Ok(r) => Frame::Done {
                    text: describe(&r, None),
                    data: Answer::Execution(execution_view(&r)),
                    exit: 0,
                },
                Err(e) => Frame::Error {
                    message: e.to_string(),
                    exit: exit::USAGE,
                },
            },
            Request::Explain { id } => match explain(g.ledger(), id) {
                Ok((text, data)) => Frame::Done {
                    data: Answer::Explain(data),
                    text,
                    exit: 0,
                },
                Err(m) => Frame::Error {
                    message: m,
                    exit: exit::USAGE,
                },
            },
            Request::Approvals => match g.pending_approvals() {
                Ok(items) => {
                    let text = if items.is_empty() {
                        "No execution awaits approval.".into()
                    } else {
                        items
                            .iter()
                            .map(|r| {
                                format!(
                                    "{}  {}  on {}  by {}  since {}\n    {}",
                                    r.id,
                                    r.tool,
                                    r.host,
                                    r.actor.0,
                                    fmt_time(r.accepted_at),
                                    r.action.as_str()
                                )
                            })
                            .collect::<Vec<_>>()
                            .join("\n")
                    };
                    Frame::Done {
                        data: Answer::Approvals(ApprovalList {
                            items: items.iter().map(execution_view).collect(),
                        }),
                        text,
                        exit: 0,
                    }
                }
                Err(e) => gw_err(e),
            },
            Request::Approve { id } => match g.approve(id, &by) {
                Ok(r) => Frame::Done {
                    text: format!("Approved {id}; it runs now (or on the caller's retry)."),
                    data: Answer::Execution(execution_view(&r)),
                    exit: 0,
                },
                Err(e) => gw_err(e),
            },
            Request::Deny { id, reason } => match g.deny(id, &by, &reason) {
                Ok(r) => Frame::Done {
                    text: format!("Denied {id}: {reason}"),
                    data: Answer::Execution(execution_view(&r)),
                    exit: 0,
                },
                Err(e) => gw_err(e),
            },
            Request::Lock | Request::Unlock => {
                let lock = matches!(req, Request::Lock);
                if g.locked().is_ok_and(|now| now == lock) {
                    return Frame::Done {
                        text: if lock {
                            "Already locked: new actions stay denied until `waymark unlock`.".into()
                        } else {
                            "Not locked: new actions are accepted.".into()
                        },
                        data: Answer::Lock(LockState {
                            locked: lock,
                            changed: false,
                        }),
                        exit: 0,
                    };
                }
                match g.set_locked(lock, &by) {
                    Ok(()) => Frame::Done {
                        text: if lock {
                            "Locked: every new action is denied (reason \"locked\") until `waymark unlock`.".into()
                        } else {
                            "Unlocked: new actions are accepted again.".into()
                        },
                        data: Answer::Lock(LockState {
                            locked: lock,
                            changed: true,
                        }),
                        exit: 0,
                    },
                    Err(e) => gw_err(e),
                }
            }
            Request::Runs { limit } => match g.ledger().runs(limit.unwrap_or(50)) {
                Ok(runs) => {
                    let text = runs
                        .iter()
                        .map(|r| {
                            format!(
                                "{}  {}  {}  calls={}  started {}{}",
                                r.id,
                                r.actor.0,
                                r.transport,
                                r.calls,
                                fmt_time(r.started_at),
                                r.ended_at
                                    .map(|e| format!("  ended {}", fmt_time(e)))
                                    .unwrap_or_default()
                            )
                        })
                        .collect::<Vec<_>>()
                        .join("\n");
                    Frame::Done {
                        data: Answer::Runs(runs.iter().map(run_view).collect()),
                        text,
                        exit: 0,
                    }
                }
                Err(e) => Frame::Error {
                    message: e.to_string(),
                    exit: exit::ERROR,
                },
            },
            Request::AuditVerify { exported_head } => {
                audit_verify(g.ledger(), exported_head.as_deref())
            }
            Request::AuditHead => {
                let h = g.ledger().head();
                Frame::Done {
                    text: h.to_string(),
                    data: Answer::Head(chain_position(&h)),
                    exit: 0,
                }
            }
            Request::Gc { older_than_ms } => {
                let cutoff = now().minus(Duration::from_millis(older_than_ms));
                match g.ledger().gc(cutoff, now()) {
                    Ok(r) => Frame::Done {
                        text: format!("Removed {} resolved executions; kept {} that still need attention; pruned events through {}.", r.removed_executions, r.kept_unresolved, r.pruned_events_through.map_or("none".into(), |s| s.to_string())),
                        data: Answer::Gc(GcReport {
                            removed: r.removed_executions,
                            kept_unresolved: r.kept_unresolved,
                            pruned_through: r.pruned_events_through,
                        }),
                        exit: 0,
                    },
                    Err(e) => Frame::Error { message: e.to_string(), exit: exit::ERROR },
                }
            }
        }
    }
}

/// What a front end needs to publish the configured tools.
pub fn tool_catalog(cfg: &waymark_gateway::config::Config) -> ToolCatalog {
    use waymark_gateway::config::ArgType;
    let tools = cfg
        .tools
        .values()
        .map(|t| ToolSpec {
            name: t.name.clone(),
            description: t.description.clone(),
            contract: t.contract,
            hosts: tools::allowed_hosts(t, cfg),
            host_arg: t.host_arg || t.hosts.len() > 1,
            args: t
                .args
                .iter()
                .map(|a| ArgInfo {
                    name: a.name.clone(),
                    ty: match a.ty {
                        ArgType::String => "string",
                        ArgType::Integer => "integer",
                        ArgType::Boolean => "boolean",
                        ArgType::Enum => "enum",
                    }
                    .into(),
                    description: a.description.clone(),
                    values: a.values.clone(),
                    pattern: a.pattern.as_ref().map(|p| p.as_str().to_string()),
                    secret: a.secret,
                    required: a.required,
                })
                .collect(),
        })
        .collect();
    ToolCatalog {
        tools,
        raw_hosts: cfg.policy.raw_commands.clone(),
    }
}

/// The argv of a secret-free canonical record, for resuming raw commands.
fn reconstruct(rec: &ExecutionRecord) -> Option<Vec<String>> {
    let v: Value = serde_json::from_str(rec.action.as_str()).ok()?;
    v["argv"]
        .as_array()?
        .iter()
        .map(|w| w.as_str().map(str::to_string))
        .collect()
}

fn chain_position(h: &ChainHead) -> ChainPosition {
    ChainPosition {
        seq: h.seq,
        hash: h.hash.clone(),
    }
}

fn run_view(r: &waymark_ledger::RunRecord) -> RunView {
    RunView {
        id: r.id.clone(),
        actor: r.actor.clone(),
        transport: r.transport.clone(),
        started_at: r.started_at,
        ended_at: r.ended_at,
        calls: r.calls,
    }
}

pub fn audit_verify(ledger: &waymark_ledger::Ledger, exported: Option<&str>) -> Frame {
    let exported = match exported.map(str::parse::<ChainHead>) {
        Some(Err(e)) => {
            return Frame::Error {
                message: format!("--head: {e}"),
                exit: exit::USAGE,
            }
        }
        Some(Ok(h)) => Some(h),
        None => None,
    };
    match ledger.verify(exported.as_ref()) {
        Ok(r) => {
            let data = Answer::Audit(AuditReport {
                ok: r.is_ok(),
                events: r.events,
                base: chain_position(&r.base),
                head: chain_position(&r.head),
                broken: r.broken.as_ref().map(|b| ChainBreakView {
                    seq: b.seq,
                    problem: b.problem.to_string(),
                }),
            });
            match &r.broken {
                None => Frame::Done {
                    text: format!(
                        "Audit chain OK: {} events verified from {} to head {}.",
                        r.events,
                        if r.base.seq == 0 {
                            "genesis".to_string()
                        } else {
                            format!("checkpoint {}", r.base.seq)
                        },
                        r.head
                    ),
                    data,
                    exit: 0,
                },
                Some(b) => Frame::Done {
                    text: format!(
                        "AUDIT CHAIN BROKEN: {b}. Events before it ({} checked) are intact.",
                        r.events
                    ),
                    data,
                    exit: exit::ERROR,
                },
            }
        }
        Err(e) => Frame::Error {
            message: e.to_string(),
            exit: exit::ERROR,
        },
    }
}

/// A status summary: what is known, since when, what to do next. `delivers`: the answer that
/// carries this text also carries the result to its caller, so it is delivered with it.
pub fn status_text(rec: &ExecutionRecord, delivers: bool) -> String {
    let mut s = format!(
        "{}  {}{}\n  tool {} on host {}, accepted {}, last change {}\n  {}",
        rec.id,
        rec.state(),
        match (
            rec.state().has_result(),
            rec.lifecycle.result_delivered,
            delivers
        ) {
            (false, _, _) => "",
            (true, true, _) => ", result delivered",
            (true, false, true) => ", result delivered with this answer",
            (true, false, false) => ", result NOT delivered",
        },
        rec.tool,
        rec.host,
        fmt_time(rec.accepted_at),
        fmt_time(rec.updated_at),
        if delivers {
            describe_answer(rec, None)
        } else {
            describe(rec, None)
        }
    );
    if rec.state().has_result() {
        s.push_str(&format!("\n  Output: `waymark exec result {}`", rec.id));
    }
    s
}

/// The incident view of one execution, from its ledger events.
pub fn explain(
    ledger: &waymark_ledger::Ledger,
    id: ExecutionId,
) -> Result<(String, Explanation), String> {
    let rec = ledger
        .get(id)
        .map_err(|e| e.to_string())?
        .ok_or(format!("execution {id} is not in the ledger"))?;
    let events = ledger.events_of(id).map_err(|e| e.to_string())?;
    let runs = ledger.runs(10_000).map_err(|e| e.to_string())?;
    let proc_of = |run: &Option<String>| -> String {
        run.as_ref()
            .and_then(|r| runs.iter().find(|x| &x.id == r))
            .map(|x| x.transport.clone())
            .unwrap_or_else(|| "an unrecorded process".into())
    };
    let mut lines = vec![format!(
        "Execution {id}: tool {} on {}, now {}.",
        rec.tool,
        rec.host,
        rec.state()
    )];
    let mut timeline = Vec::new();
    let mut callers: Vec<String> = Vec::new();
    let mut attached = 0;
    let (mut authorized, mut dispatched, mut observed, mut delivered, mut lost) =
        (None, None, None, None, None);
    // An end Waymark recorded without the host (denied, expired, never sent or never started).
    let mut settled: Option<(String, ExecState)> = None;
    for e in &events {
        let at = fmt_time(e.at);
        let what = match &e.kind {
            EventKind::Accepted { actor, run, .. } => {
                callers.push(proc_of(run));
                format!("accepted: first call, from {} ({})", actor.0, proc_of(run))
            }
            EventKind::Attached { actor, action, run } => {
                attached += 1;
                callers.push(proc_of(run));
                format!(
                    "a later call from {} ({}) attached ({:?}) instead of starting a new execution",
                    actor.0,
                    proc_of(run),
                    action
                )
            }
            EventKind::Transition { to, transition, .. } => {
                match to {
                    ExecState::Authorized => authorized = Some(at.clone()),
                    ExecState::Dispatched => dispatched = Some(at.clone()),
                    ExecState::Unknown => lost = Some(at.clone()),
                    s if s.has_result()
                        && matches!(transition, waymark_core::Transition::Delivered) =>
                    {
                        delivered = Some(at.clone())
                    }
                    ExecState::Running if observed.is_some() => {}
                    ExecState::Completed
                    | ExecState::TimedOut
                    | ExecState::Cancelled
                    | ExecState::Interrupted
                    | ExecState::Running => observed = Some((at.clone(), *to)),
                    ExecState::Failed | ExecState::Denied | ExecState::Expired => {
                        settled = Some((at.clone(), *to))
                    }
                    _ => {}
                }
                format!("{} → {}", transition.name(), to)
            }
            EventKind::Note { name, .. } => name.clone(),
            EventKind::Checkpoint { .. } => "checkpoint".into(),
        };
        timeline.push(format!("  #{:<6} {at}  {what}", e.seq));
    }
    let distinct: std::collections::BTreeSet<&String> = callers.iter().collect();
    lines.push(format!(
        "1. Callers: {} call(s) ({} attached) from {} distinct agent session(s): {}.",
        callers.len(),
        attached,
        distinct.len(),
        distinct
            .iter()
            .map(|s| s.as_str())
            .collect::<Vec<_>>()
            .join("; ")
    ));
    lines.push(format!(
        "2. Authorized: {}. Dispatched: {}{}.",
        authorized.as_deref().unwrap_or("no"),
        dispatched.as_deref().unwrap_or("no"),
        if rec.dispatch_attempts > 1 {
            format!(
                " ({} attempts under this one id; the host marker refuses a second start)",
                rec.dispatch_attempts
            )
        } else {
            String::new()
        }
    ));
    lines.push(match (&observed, &lost) {
        (Some((at, s)), Some(l)) => format!("3. The connection was lost at {l}; the host's marker later showed {s} (recorded {at})."),
        (Some((at, s)), None) => format!("3. The host reported {s} at {at}."),
        (None, Some(l)) => format!("3. The connection was lost at {l}; no host outcome is known yet (run `waymark exec status {id}`)."),
        (None, None) => match &settled {
            Some((at, ExecState::Failed)) => format!("3. It did not start on the host ({}; recorded {at}).", rec.reason.as_deref().unwrap_or("no reason recorded")),
            Some((at, s)) => format!("3. It never reached the host: {s} at {at}."),
            None => "3. No host outcome is recorded.".into(),
        },
    });
    let ended = observed.clone().or(settled.clone());
    let first_attach = events
        .iter()
        .find(|e| matches!(e.kind, EventKind::Attached { .. }))
        .map(|e| fmt_time(e.at));
    lines.push(match (&ended, &delivered) {
        (Some((at, _)), Some(d)) if lost.is_some() && first_attach.as_deref().is_some_and(|a| a <= d.as_str()) => format!(
            "4. Delivery failed for the first caller: its connection was lost before the host finished (recorded {at}). The result reached a later, attached call at {d}."
        ),
        (Some(_), Some(d)) => format!("4. The result was delivered to the caller at {d}."),
        (Some((at, _)), None) if rec.state().has_result() => format!("4. NOT DELIVERED: it ended (recorded {at}) but no caller has received the result yet; `waymark exec result {id}` (or the same call again) delivers it."),
        (_, Some(d)) => format!("4. The result was delivered to the caller at {d}."),
        _ => "4. Nothing to deliver yet.".into(),
    });
    let later: Vec<ExecutionRecord> = ledger
        .by_fingerprint(&rec.fingerprint)
        .map_err(|e| e.to_string())?
        .into_iter()
        .filter(|r| r.id > id)
        .collect();
    lines.push(if attached > 0 && later.is_empty() {
        format!("5. {attached} later call(s) attached to this execution; none started a new one.")
    } else if later.is_empty() {
        "5. No later call of the same intent.".into()
    } else {
        let ids = later.iter().map(|r| r.id.to_string()).collect::<Vec<_>>().join(", ");
        let never_ran = matches!(rec.state(), ExecState::Failed | ExecState::Denied | ExecState::Expired)
            || (rec.state() == ExecState::Cancelled && dispatched.is_none());
        if never_ran {
            format!("5. Later calls of the same intent started new executions: {ids}. This one provably never ran ({}), so a new one was safe.", rec.state())
        } else {
            format!("5. Later calls of the same intent started new executions: {ids} (outside the retry window or scope).")
        }
    });
    let text = format!("{}\n\nTimeline:\n{}", lines.join("\n"), timeline.join("\n"));
    let data = Explanation {
        execution: execution_view(&rec),
        later_executions: later.iter().map(|r| r.id).collect(),
        answers: lines,
        timeline,
    };
    Ok((text, data))
}
