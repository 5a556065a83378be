//! The channel driver: everything the flow asks of a channel, behind one trait that SSH
//! (`ssh`) and HTTP (`http`) implement. The flow decides (the ledger's states, the intent
//! locks, approvals, crash points); a driver only moves an execution whose dispatch is already
//! recorded and flushed, and finds out what happened to one that may have reached its target.
//!
//! The gateway holds its drivers as it holds its ledger, and picks one by the channel the
//! execution's record names ([`Channel`], decoded once from the canonical record). A third
//! channel is one more driver: no flow code asks which channel an execution goes through.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;

use waymark_core::Channel;
use waymark_ledger::ExecutionRecord;

use crate::host::{HostError, HostExecutor, Stream};
use crate::tools::ResolvedCall;

use super::reconcile::ReconcileReport;
use super::{CallEvents, CallOutcome, Gateway, GatewayError};

/// A driver's step: a boxed future borrowing the gateway and the call.
pub(super) type Step<'a, T> = Pin<Box<dyn Future<Output = Result<T, GatewayError>> + Send + 'a>>;

/// Output told to a caller while an execution runs; it never ends by itself (whatever ends
/// the execution drops it).
pub(super) type Watch<'a> = Pin<Box<dyn Future<Output = Infallible> + Send + 'a>>;

/// What the flow asks of one channel. Every method gets the gateway, whose ledger, secrets and
/// configuration the driver uses; none decides what the ledger's states allow.
pub(super) trait Driver<E: HostExecutor>: Send + Sync {
    /// The channel name it drives, as records name it ([`Channel::name`]).
    fn channel(&self) -> &'static str;

    /// Sends an execution whose dispatch is recorded (and flushed), and records what came
    /// back. `call` is the caller's resolved call (the secrets are only there), of this
    /// channel.
    fn send<'a>(
        &'a self,
        g: &'a Gateway<E>,
        rec: ExecutionRecord,
        call: &'a ResolvedCall,
        events: &'a dyn CallEvents,
    ) -> Step<'a, CallOutcome>;

    /// Finds out what became of an execution that may have reached its target (dispatched,
    /// running or unknown), and moves it on: sends it again where that is proven safe, waits
    /// for it where it runs. `call` is the caller's retry or resume.
    fn recover<'a>(
        &'a self,
        g: &'a Gateway<E>,
        rec: ExecutionRecord,
        call: &'a ResolvedCall,
        events: &'a dyn CallEvents,
    ) -> Step<'a, CallOutcome>;

    /// A status check of an execution this daemon drives that may be at its target: what the
    /// target says now, recorded, and the error when it could not be asked.
    fn check<'a>(
        &'a self,
        g: &'a Gateway<E>,
        rec: ExecutionRecord,
    ) -> Step<'a, (CallOutcome, Option<HostError>)>;

    /// Stops an execution that may be at its target, or says why it cannot be.
    fn cancel<'a>(&'a self, g: &'a Gateway<E>, rec: ExecutionRecord) -> Step<'a, CallOutcome>;

    /// Its output by offset, masked, and the stream's size, from wherever the channel keeps
    /// more than the ledger's capped copy.
    fn read_output<'a>(
        &'a self,
        g: &'a Gateway<E>,
        rec: ExecutionRecord,
        stream: Stream,
        offset: u64,
        max: u64,
    ) -> Step<'a, (Vec<u8>, u64)>;

    /// The output of an execution another daemon drives, told to `events` as it comes, when
    /// the channel has any to tell while it runs.
    fn watch_output<'a>(
        &'a self,
        g: &'a Gateway<E>,
        rec: &ExecutionRecord,
        events: &'a dyn CallEvents,
    ) -> Result<Option<Watch<'a>>, GatewayError>;

    /// On daemon start: recovers every execution of `recs` (of this channel, left
    /// dispatched, running or unknown) as far as the target can tell without a caller.
    fn reconcile<'a>(
        &'a self,
        g: &'a Gateway<E>,
        recs: Vec<ExecutionRecord>,
        report: &'a mut ReconcileReport,
    ) -> Pin<Box<dyn Future<Output = ()> + Send + 'a>>;
}

impl<E: HostExecutor> Gateway<E> {
    /// The driver of the channel `rec` names, or why this process cannot move it.
    pub(super) fn driver(&self, rec: &ExecutionRecord) -> Result<&dyn Driver<E>, GatewayError> {
        self.driver_for(rec.action.channel())
    }

    /// The driver of `channel`, or [`GatewayError::NoDriver`].
    pub(super) fn driver_for(&self, channel: &Channel) -> Result<&dyn Driver<E>, GatewayError> {
        self.drivers
            .iter()
            .find(|d| d.channel() == channel.name())
            .map(|d| d.as_ref())
            .ok_or_else(|| GatewayError::NoDriver {
                channel: channel.to_string(),
            })
    }
}

/// What a driver says when a call resolves to another channel than the record it drives
/// (its tool was redefined since): nothing is sent.
pub(super) fn other_channel(rec: &ExecutionRecord) -> GatewayError {
    GatewayError::Refused {
        id: rec.id,
        why: format!(
            "it was recorded for {}, and this call's tool now resolves to another channel",
            rec.action.channel()
        ),
    }
}
