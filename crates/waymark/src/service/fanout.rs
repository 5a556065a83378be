//! `FanOut`: one tool call on several hosts, as one ordinary execution per host.

use waymark_gateway::flow::{CallEvent, CallOutcome, GatewayError};
use waymark_gateway::host::HostExecutor;
use waymark_gateway::tools::ResolvedCall;

use super::calls::call_event;
use super::render::{call_answer, exit_for};
use super::{gw_err, Frame, Service, Session};
use crate::exit;
use crate::protocol::{Answer, Event, FanOutAnswer, HostAnswer};

impl<E: HostExecutor> Service<E> {
    /// Runs `calls` (one per host) through the gateway's fan-out; `event` gets each host's
    /// events as [`Event::Host`]. The answer lists every host, and its exit code is
    /// [`exit::fan_out`] of theirs.
    pub(super) async fn fan_out(
        &self,
        tool: String,
        calls: Vec<ResolvedCall>,
        session: &mut Session,
        event: impl FnMut(Event) + Send,
    ) -> Frame {
        let run = self.ensure_run(session).await;
        let hosts: Vec<String> = calls.iter().map(|c| c.target().to_string()).collect();
        let events = std::sync::Mutex::new(event);
        let on_event = |host: &str, e: CallEvent<'_>| {
            (events.lock().expect("events"))(Event::Host {
                host: host.to_string(),
                event: Box::new(call_event(e)),
            })
        };
        let outcomes = self.gateway.fan_out(calls, run, &on_event).await;
        let answers: Vec<HostAnswer> = hosts
            .into_iter()
            .zip(outcomes)
            .map(|(host, outcome)| host_answer(host, outcome))
            .collect();
        let codes: Vec<i32> = answers.iter().map(|h| h.exit).collect();
        Frame::Done {
            text: summary(&tool, &answers),
            data: Answer::FanOut(FanOutAnswer {
                tool,
                hosts: answers,
            }),
            exit: exit::fan_out(&codes),
        }
    }
}

fn host_answer(host: String, outcome: Result<CallOutcome, GatewayError>) -> HostAnswer {
    match outcome {
        Ok(o) => HostAnswer {
            host,
            exit: exit_for(&o.record),
            execution: Some(call_answer(&o)),
            error: None,
        },
        Err(e) => match gw_err(e) {
            Frame::Error { message, exit } => HostAnswer {
                host,
                exit,
                execution: None,
                error: Some(message),
            },
            _ => unreachable!("gw_err makes an error frame"),
        },
    }
}

/// The summary table (host, execution ID, state, exit code), then what each host that did not
/// complete with 0 says.
fn summary(tool: &str, hosts: &[HostAnswer]) -> String {
    let width = hosts.iter().map(|h| h.host.len()).max().unwrap_or(0).max(4);
    let mut text = format!(
        "tool {tool} on {} host{}:\n{:width$}  {:30}  {:28}  EXIT",
        hosts.len(),
        if hosts.len() == 1 { "" } else { "s" },
        "HOST",
        "EXECUTION",
        "STATE",
    );
    for h in hosts {
        let (id, state) = match &h.execution {
            Some(c) => (
                c.execution.id.to_string(),
                match c.attached {
                    Some(_) => format!("{} (attached)", c.execution.state),
                    None => c.execution.state.to_string(),
                },
            ),
            None => ("-".into(), "not accepted".into()),
        };
        text.push_str(&format!(
            "\n{:width$}  {id:30}  {state:28}  {}",
            h.host, h.exit
        ));
    }
    for h in hosts.iter().filter(|h| h.exit != 0) {
        let why = match (&h.execution, &h.error) {
            (Some(c), _) => c.message.clone(),
            (None, Some(e)) => e.clone(),
            (None, None) => String::new(),
        };
        text.push_str(&format!("\n{}: {why}", h.host));
    }
    text
}
