//! Calls and their results: `Call`, `Resume`, `Status`, `Result`, `Output`, `Delivered`.

use std::time::Duration;

use serde_json::{Map, Value};
use waymark_core::ExecutionId;
use waymark_gateway::flow::{describe, Audience, CallEvent, Unchecked};
use waymark_gateway::host::HostExecutor;
use waymark_gateway::tools::{self, ResolvedCall};
use waymark_ledger::ExecutionRecord;

use super::render::{approval_question, call_answer, execution_view, exit_for, status_text};
use super::{gw_err, Frame, Service, Session};
use crate::exit;
use crate::protocol::answer::encode_b64;
use crate::protocol::{Answer, Event, OutputHeads, OutputPage, ResultView, StatusAnswer, Stream};

impl<E: HostExecutor> Service<E> {
    /// `Call`, once resolved: runs it through the gateway; `event` gets its events.
    pub(super) async fn call(
        &self,
        call: ResolvedCall,
        session: &mut Session,
        mut event: impl FnMut(Event) + Send,
    ) -> Frame {
        let g = &self.gateway;
        let run = self.ensure_run(session).await;
        event(Event::Calling {
            tool: call.tool.clone(),
            host: call.target().to_string(),
        });
        let events = std::sync::Mutex::new(&mut event);
        let on_event = |e: CallEvent<'_>| (events.lock().expect("events"))(call_event(e));
        let answer = g.call(call, run, &on_event).await;
        match answer {
            Ok(o) => {
                let exit = exit_for(&o.record);
                Frame::Done {
                    text: o.message(Audience::Cli),
                    data: Answer::Call(call_answer(&o)),
                    exit,
                }
            }
            Err(e) => gw_err(e),
        }
    }

    /// `Delivered`: the client marks the result of a call it relayed delivered.
    pub(super) async fn delivered(&self, id: ExecutionId) -> Frame {
        let g = &self.gateway;
        match g.delivered(id).await {
            Ok(rec) => Frame::Done {
                data: Answer::Execution(execution_view(&rec)),
                text: format!("{id}: result delivered"),
                exit: 0,
            },
            Err(e) => gw_err(e),
        }
    }

    /// `Status`: the ledger plus a live check of the host's marker, which has until `deadline`
    /// to answer.
    pub(super) async fn status(&self, id: ExecutionId, deadline: Duration) -> Frame {
        let g = &self.gateway;
        match g.status_within(id, deadline).await {
            Ok((o, probe_error)) => {
                // This answer carries the result to a caller that gets it delivered
                // (the transport marks it after the write, or the client after its own).
                let delivers =
                    o.record.lifecycle.result_observed && !o.record.lifecycle.result_delivered;
                let mut text = status_text(&o.record, delivers);
                match &probe_error {
                    Some(late @ Unchecked::Late(_)) => text.push_str(&format!(
                        "\n{}: this is what the ledger knows. The check goes on and records what it finds; `waymark exec status {id}` again shows it.",
                        capitalized(&late.to_string())
                    )),
                    Some(e) => text.push_str(&format!("\nThe host could not be asked just now: {e}")),
                    None => {}
                }
                if let Some(h) = &o.heard {
                    text.push_str(&format!("\n{h}"));
                }
                let data = StatusAnswer {
                    call: call_answer(&o),
                    host_check_error: probe_error.as_ref().map(ToString::to_string),
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

    /// `Result`: the stored result, or the output so far of one still on the host; the host
    /// has until `deadline` to say whether it ended.
    pub(super) async fn result(&self, id: ExecutionId, deadline: Duration) -> Frame {
        let g = &self.gateway;
        let mut rec = match g.ledger().get(id).await {
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
            let asked = tokio::time::Instant::now();
            let mut late = None;
            if let Ok((o, unchecked)) = g.status_within(id, deadline).await {
                rec = o.record;
                late = unchecked.filter(|u| matches!(u, Unchecked::Late(_)));
            }
            if !rec.lifecycle.result_observed && rec.state().may_be_on_host() {
                // A host that did not say within the deadline whether it ended would not
                // send its output in time either.
                return match late {
                    Some(late) => Frame::Error {
                        message: format!(
                            "{} {}: no output can be read just now; `waymark exec result {id}` again later.",
                            describe(&rec, None, Audience::Cli),
                            capitalized(&late.to_string())
                        ),
                        exit: exit_for(&rec),
                    },
                    None => self.output_so_far(&rec, asked + deadline, deadline).await,
                };
            }
        }
        match g.ledger().result(id).await {
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
                message: format!(
                    "{id} has no stored result yet. {}",
                    describe(&rec, None, Audience::Cli)
                ),
                exit: exit_for(&rec),
            },
            Err(e) => Frame::Error {
                message: e.to_string(),
                exit: exit::ERROR,
            },
        }
    }

    /// The answer to `result` for an execution that has not ended: what it printed so far, read
    /// from the host's marker (the first `result_cap` bytes of each stream). Marked `partial`:
    /// it is not a result and is never marked delivered.
    ///
    /// The host has `until` (the end of the read's `deadline`) to send it: a read of output
    /// changes nothing, so one given up on leaves nothing half done.
    async fn output_so_far(
        &self,
        rec: &ExecutionRecord,
        until: tokio::time::Instant,
        deadline: Duration,
    ) -> Frame {
        let g = &self.gateway;
        let cap = g.result_cap;
        let mut so_far: [(Vec<u8>, u64); 2] = Default::default();
        for stream in Stream::BOTH {
            let read = tokio::time::timeout_at(until, g.read_output(rec.id, stream, 0, cap));
            match read.await {
                Ok(Ok((bytes, size))) => {
                    let size = size.max(bytes.len() as u64);
                    so_far[stream.index()] = (bytes, size);
                }
                Err(_) => {
                    return Frame::Error {
                        message: format!(
                            "{} {}: no output can be read just now; `waymark exec result {}` again later.",
                            describe(rec, None, Audience::Cli),
                            capitalized(&Unchecked::Late(deadline).to_string()),
                            rec.id
                        ),
                        exit: exit_for(rec),
                    }
                }
                Ok(Err(e)) => {
                    return Frame::Error {
                        message: format!(
                            "{} no output can be read just now: {e}",
                            describe(rec, None, Audience::Cli)
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

    /// `Output`: bytes of one stream by offset, read from the host's marker.
    pub(super) async fn output(
        &self,
        id: ExecutionId,
        stream: Stream,
        offset: u64,
        max: u64,
    ) -> Frame {
        let g = &self.gateway;
        match g.read_output(id, stream, offset, max.min(4 << 20)).await {
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

    /// `Resume`: re-sends an execution under its own id.
    pub(super) async fn resume(
        &self,
        session: &mut Session,
        id: ExecutionId,
        tool: Option<String>,
        args: Map<String, Value>,
        raw: Option<Vec<String>>,
    ) -> Frame {
        let g = &self.gateway;
        let rec = match g.ledger().get(id).await {
            Ok(Some(r)) => r,
            _ => {
                return Frame::Error {
                    message: format!("execution {id} is not in the ledger"),
                    exit: exit::USAGE,
                }
            }
        };
        // An HTTP execution's record names its target, which is no host argument.
        let http = g
            .config()
            .tools
            .get(&rec.tool)
            .is_some_and(|t| t.http.is_some());
        let host = (!http).then(|| rec.host.clone());
        let host = host.as_deref();
        let call = match (tool, raw) {
                    (None, None) => match rec.action.channel().plain_argv() {
                        Some(argv) if rec.tool == tools::RAW_TOOL => self.resolve(session, None, &Default::default(), host, Some(&argv), None),
                        _ => return Frame::Error { message: format!("give the call again to resume {id}: `waymark exec resume {id} {} key=value ...` (secret arguments are not stored)", rec.tool), exit: exit::USAGE },
                    },
                    (t, r) => self.resolve(session, t.as_deref(), &args, host, r.as_deref(), None),
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
        call.set_origin(rec.actor.clone(), rec.scope.clone());
        match g.resume(id, &call).await {
            Ok(o) => Frame::Done {
                text: o.message(Audience::Cli),
                data: Answer::Call(call_answer(&o)),
                exit: exit_for(&o.record),
            },
            Err(e) => gw_err(e),
        }
    }
}

/// A gateway call event as the protocol tells it.
pub(super) fn call_event(e: CallEvent<'_>) -> Event {
    match e {
        CallEvent::Decided { id, attached } => Event::Execution { id, attached },
        // MCP-approval hook: an `awaiting_approval` event, at most once per call, when this
        // call's execution waits on an approval.
        CallEvent::AwaitingApproval { record } => {
            Event::AwaitingApproval(approval_question(record))
        }
        CallEvent::Output {
            stream,
            offset,
            bytes,
        } => Event::Output {
            stream,
            offset,
            data_b64: encode_b64(bytes),
        },
    }
}

/// `text` with its first letter in capitals, to begin a sentence.
fn capitalized(text: &str) -> String {
    let mut chars = text.chars();
    chars
        .next()
        .map_or(String::new(), |c| c.to_uppercase().chain(chars).collect())
}
