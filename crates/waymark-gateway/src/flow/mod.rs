//! The flow every action takes: matching rule → accepted → policy → authorized → dispatched
//! (durable before the first byte leaves) → observed → result stored → delivered.
//!
//! The gateway never calls a host for an execution whose ledger entry it could not write:
//! every host call is preceded by a flushed transition, and an error from the ledger stops the
//! flow before the host is touched.
//!
//! By concern: `intake` (matching rule under the intent locks), `policy` (lock, approval),
//! `drive` (one driver per execution: send, stream output), `marker` (what the host's marker
//! proves), `operator` (status, cancel, review, resume), `reconcile` (daemon start), `events`
//! (what a call tells its own caller), `fanout` (one call per host, bounded), `output_watch`
//! (streaming calls' output sizes, one round trip per host for all of them), `approval_watch`
//! (on a shared ledger, one reader for every call awaiting an answer) and [`text`] (what a
//! person is told).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tokio::sync::watch;
use waymark_core::{AttachAction, ExecutionId, Fingerprint, Timestamp};
use waymark_ledger::{Durability, ExecutionRecord, LedgerApi, LedgerError, StoredResult};

use crate::config::{Config, HostEntry};
use crate::host::{HostError, HostExecutor};

mod approval_watch;
mod channel;
mod drive;
mod events;
mod fanout;
mod http;
mod intake;
mod marker;
mod operator;
mod output_watch;
mod policy;
mod reconcile;
mod ssh;
mod status_answer;
#[cfg(test)]
mod test_host;
pub mod text;

pub use events::{CallEvent, CallEvents, NoEvents};
pub use fanout::FAN_OUT_PARALLEL;
pub use http::status_code;
pub use operator::Unchecked;
pub use reconcile::{ReconcileReport, RECONCILE_BATCH};
pub use text::{describe, describe_answer, Audience};

/// Every transition the flow records before or after it touches a target is flushed.
const FLUSHED: Durability = Durability::Flushed;

/// Errors of the flow itself (not outcomes of an execution).
#[derive(Debug, thiserror::Error)]
pub enum GatewayError {
    #[error(transparent)]
    Ledger(#[from] LedgerError),
    #[error("execution {0} is not in the ledger")]
    NotFound(ExecutionId),
    #[error("execution {id}: {why}")]
    Refused { id: ExecutionId, why: String },
    /// This call joined the task driving the execution, and that task ended without an
    /// outcome (it failed, or was stopped); the ledger has where the execution stands.
    #[error("execution {id}: the task driving it ended without an outcome")]
    DriverEnded { id: ExecutionId },
    /// A call or an execution of a channel this process has no driver for.
    #[error("this process has no driver for {channel}, so it sends nothing there")]
    NoDriver { channel: String },
    #[error("execution {id} names host {host:?}, which is no longer configured")]
    UnknownHost { id: ExecutionId, host: String },
}

/// What a call, status or attach ended with. `record.lifecycle.state` says which outcome.
#[derive(Clone, Debug)]
pub struct CallOutcome {
    pub record: ExecutionRecord,
    /// Set when this call attached to an earlier execution instead of starting one.
    pub attached: Option<AttachAction>,
    pub result: Option<StoredResult>,
    /// Set when the host could not be asked about the execution just now (the record is the
    /// ledger's, unchecked).
    pub unasked: Option<HostError>,
    /// What the target said just now that the record does not keep (an HTTP status request
    /// that found no such operation), said after the summary.
    pub heard: Option<String>,
}

impl CallOutcome {
    /// What to tell the caller, in words: the summary that travels with the answer.
    pub fn message(&self, to: Audience) -> String {
        let mut text = describe_answer(&self.record, self.attached, to);
        if let Some(e) = &self.unasked {
            text.push_str(&text::host_unasked(self.record.id, e, to));
        }
        if let Some(h) = &self.heard {
            text.push(' ');
            text.push_str(h);
        }
        text
    }
}

/// The current time, in milliseconds since the epoch.
pub fn now() -> Timestamp {
    Timestamp::from_millis(
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64),
    )
}

type Inflight = watch::Receiver<Option<CallOutcome>>;

/// The gateway: one per daemon (or per CLI process when no daemon runs).
pub struct Gateway<E: HostExecutor> {
    /// The configuration new calls resolve against; a reload swaps it
    /// ([`Gateway::set_config`]).
    config: std::sync::RwLock<Arc<Config>>,
    ledger: Arc<dyn LedgerApi>,
    exec: Arc<E>,
    /// One driver per channel records name ([`channel::Driver`]): SSH always, HTTP once
    /// [`Gateway::with_http`] gave it its channel.
    drivers: Vec<Arc<dyn channel::Driver<E>>>,
    inflight: Mutex<HashMap<ExecutionId, Inflight>>,
    /// Status checks of the host under way, one per execution, that later reads join.
    probes: Mutex<HashMap<ExecutionId, operator::Probe>>,
    intents: Mutex<HashMap<Fingerprint, Arc<tokio::sync::Mutex<()>>>>,
    approvals: Mutex<HashMap<ExecutionId, watch::Sender<Option<policy::Answer>>>>,
    /// Secret argument values of the executions this process dispatched, to mask in output.
    secrets: crate::mask::Secrets,
    /// Where streaming calls ask for their output's sizes, batched per host.
    output_watch: Arc<output_watch::OutputWatch>,
    /// Where calls awaiting approval on a shared ledger learn of an answer given elsewhere.
    approval_watch: Arc<approval_watch::ApprovalWatch>,
    /// Where dispatch latencies, unknown outcomes and attached retries are counted.
    metrics: Arc<dyn crate::metrics::FlowMetrics>,
    /// Bytes of each stream fetched from the host and stored in the ledger.
    pub result_cap: u64,
    /// How long a call waits for an operator's approval before returning "pending".
    pub approval_wait: Duration,
    /// Crash-test hook, in test builds only (feature `crash-points`): the process kills
    /// itself with SIGKILL right after this point of the flow (`accepted`, `dispatched` or
    /// `completed`), read from `WAYMARK_CRASH_AT`; tests prove recovery from a crash at each.
    #[cfg(feature = "crash-points")]
    crash_at: Option<String>,
}

impl<E: HostExecutor> Gateway<E> {
    /// Kills this process with SIGKILL when `WAYMARK_CRASH_AT` names `point`. A build without
    /// the `crash-points` feature (every shipped one) has no such hook.
    fn crash_point(&self, point: &str) {
        #[cfg(feature = "crash-points")]
        if self.crash_at.as_deref() == Some(point) {
            tracing::error!(point, "WAYMARK_CRASH_AT: killing this process with SIGKILL");
            // SAFETY: kill(2) on our own pid has no memory-safety preconditions.
            unsafe {
                libc::kill(libc::getpid(), libc::SIGKILL);
            }
        }
        #[cfg(not(feature = "crash-points"))]
        let _ = point;
    }
}

impl<E: HostExecutor> Gateway<E> {
    pub fn new(config: Arc<Config>, ledger: Arc<dyn LedgerApi>, exec: Arc<E>) -> Self {
        let secrets = crate::mask::Secrets::new(&ledger.fingerprint_key());
        Gateway {
            config: std::sync::RwLock::new(config),
            ledger,
            exec,
            drivers: vec![Arc::new(ssh::SshDriver)],
            inflight: Mutex::new(HashMap::new()),
            probes: Mutex::new(HashMap::new()),
            intents: Mutex::new(HashMap::new()),
            approvals: Mutex::new(HashMap::new()),
            secrets,
            output_watch: Arc::default(),
            approval_watch: Arc::default(),
            metrics: Arc::new(crate::metrics::NoMetrics),
            result_cap: 64 * 1024,
            approval_wait: Duration::from_secs(600),
            #[cfg(feature = "crash-points")]
            crash_at: std::env::var("WAYMARK_CRASH_AT").ok(),
        }
    }

    /// Sends HTTP tools' requests through `channel` (one per daemon).
    pub fn with_http(mut self, channel: waymark_http::HttpChannel) -> Self {
        self.drivers.push(Arc::new(http::HttpDriver::new(channel)));
        self
    }

    /// Reports dispatch latencies, unknown outcomes and attached retries to `metrics`.
    pub fn with_metrics(mut self, metrics: Arc<dyn crate::metrics::FlowMetrics>) -> Self {
        self.metrics = metrics;
        self
    }

    /// The ledger this gateway records in, whichever backend holds it.
    pub fn ledger(&self) -> &Arc<dyn LedgerApi> {
        &self.ledger
    }

    /// The configuration as it is now: a reload swaps it for later calls, never under one
    /// already holding it.
    pub fn config(&self) -> Arc<Config> {
        self.config.read().expect("config").clone()
    }

    /// Swaps the configuration (a reload): calls resolved from now on use `config`.
    pub fn set_config(&self, config: Arc<Config>) {
        *self.config.write().expect("config") = config;
    }

    /// The hosts' executor.
    pub fn executor(&self) -> &Arc<E> {
        &self.exec
    }

    async fn outcome(
        &self,
        record: ExecutionRecord,
        attached: Option<AttachAction>,
    ) -> Result<CallOutcome, GatewayError> {
        let result = if record.lifecycle.result_observed {
            self.ledger.result(record.id).await?
        } else {
            None
        };
        Ok(CallOutcome {
            record,
            attached,
            result,
            unasked: None,
            heard: None,
        })
    }

    fn host_of(&self, rec: &ExecutionRecord) -> Result<HostEntry, GatewayError> {
        self.config()
            .hosts
            .get(&rec.host)
            .cloned()
            .ok_or_else(|| GatewayError::UnknownHost {
                id: rec.id,
                host: rec.host.clone(),
            })
    }

    async fn get(&self, id: ExecutionId) -> Result<ExecutionRecord, GatewayError> {
        self.ledger.get(id).await?.ok_or(GatewayError::NotFound(id))
    }

    /// [`Gateway::get`], adopting the execution when nobody drives it
    /// ([`LedgerApi::get_or_adopt`]).
    async fn get_or_adopt(&self, id: ExecutionId) -> Result<ExecutionRecord, GatewayError> {
        self.ledger
            .get_or_adopt(id, now())
            .await?
            .ok_or(GatewayError::NotFound(id))
    }

    fn timeout_of(&self, rec: &ExecutionRecord) -> Duration {
        self.config()
            .tools
            .get(&rec.tool)
            .map_or(Duration::from_secs(300), |t| t.timeout)
    }

    fn retry_window(&self, rec: &ExecutionRecord) -> Duration {
        self.config()
            .tools
            .get(&rec.tool)
            .map_or(Duration::from_secs(600), |t| t.retry_window)
    }
}
