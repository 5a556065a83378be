//! Fan-out: one tool call on several hosts at once, as one ordinary call per host.
//!
//! Nothing here decides identity: each host's call goes through [`Gateway::call`] with its own
//! canonical action (the target is part of it), so it gets its own execution ID, fingerprint,
//! ledger life and marker, exactly as a single-host call of the tool on that host would. A
//! repeat of the same fan-out therefore attaches per host by the ordinary matching rule: a host
//! that is done returns its stored result, one in flight is followed, one never accepted starts.

use crate::host::HostExecutor;
use crate::tools::ResolvedCall;

use super::reconcile::join_bounded;
use super::{CallEvent, CallEvents, CallOutcome, Gateway, GatewayError};

/// Hosts a fan-out drives at once; the others wait for a free place, so one call never opens
/// an unbounded number of connections.
pub const FAN_OUT_PARALLEL: usize = 16;

/// One host's sink: the fan-out's caller, told which host an event is of. Output is not read
/// live (a fan-out shows each host's output with its result, not interleaved).
struct HostEvents<'a> {
    host: &'a str,
    caller: &'a (dyn Fn(&str, CallEvent<'_>) + Send + Sync),
}

impl CallEvents for HostEvents<'_> {
    fn event(&self, event: CallEvent<'_>) {
        (self.caller)(self.host, event)
    }

    fn wants_output(&self) -> bool {
        false
    }
}

impl<E: HostExecutor> Gateway<E> {
    /// Runs `calls` (one per host, as [`crate::tools::resolve_fan_out`] makes them), at most
    /// [`FAN_OUT_PARALLEL`] at once, each an ordinary [`Gateway::call`]; `events` learns each
    /// call's events with its host. The outcomes come back in the order of `calls`: a host
    /// that fails (did not start, unknown, an error of the flow) fails alone.
    pub async fn fan_out(
        &self,
        calls: Vec<ResolvedCall>,
        run: Option<String>,
        events: &(dyn Fn(&str, CallEvent<'_>) + Send + Sync),
    ) -> Vec<Result<CallOutcome, GatewayError>> {
        join_bounded(calls, FAN_OUT_PARALLEL, |call| {
            let run = run.clone();
            async move {
                let host = call.target().to_string();
                let sink = HostEvents {
                    host: &host,
                    caller: events,
                };
                self.call(call, run, &sink).await
            }
        })
        .await
    }
}
