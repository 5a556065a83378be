//! The daemon's metrics: a Prometheus registry (`prometheus-client`) and the endpoint that
//! serves it, `GET /metrics` in the text format 0.0.4 on `[daemon] metrics_listen` (loopback
//! only, checked at the configuration's line).
//!
//! Two kinds of figures. Counters and histograms of what this daemon did since it started
//! (dispatch latency, unknown outcomes, attached retries, ledger flushes): the gateway and the
//! ledger report into [`Metrics`] through narrow interfaces (`FlowMetrics`, `FlushObserver`)
//! and know no metrics library; a restart starts them at zero, which Prometheus reads as a
//! counter reset. Gauges of how things stand (executions in each unresolved state, approvals
//! waiting, pooled connections) are read at scrape time from the ledger and the pools, so they
//! are true after a restart and, on a shared ledger, across daemons. Only unresolved states
//! are counted: the ledger's state index makes that a scan of what is in flight, where counting
//! the final states would read every record retention keeps, at every scrape.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use http_body_util::Full;
use hyper::body::{Bytes, Incoming};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use prometheus_client::encoding::prometheus_text;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use waymark_core::{AttachAction, ExecState};
use waymark_gateway::metrics::{Channel, FlowMetrics};
use waymark_gateway::ssh_hosts::SshHosts;
use waymark_ledger::{FlushObserver, LedgerApi, ListQuery};

/// The endpoint's one path.
pub const METRICS_PATH: &str = "/metrics";

/// How long a connection may take to send its request head.
const HEAD_TIMEOUT: Duration = Duration::from_secs(10);
/// How long one connection may stay open, kept alive or not.
const CONNECTION_LIFETIME: Duration = Duration::from_secs(60);
/// Executions read per ledger page while counting a state.
const PAGE: usize = 500;

type Labels1 = [(&'static str, String); 1];
type Labels2 = [(&'static str, String); 2];
type Histograms<L> = Family<L, Histogram, fn() -> Histogram>;

fn dispatch_histogram() -> Histogram {
    // A dispatch answered by `run` carries a short command's whole run, hence the long tail.
    Histogram::new([
        0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
    ])
}

fn flush_histogram() -> Histogram {
    Histogram::new([
        0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0,
    ])
}

/// Every metric the daemon serves, registered once.
pub struct Metrics {
    registry: Registry,
    executions: Family<Labels2, Gauge>,
    approvals_waiting: Gauge,
    dispatch_seconds: Histograms<Labels2>,
    unknown_outcomes: Family<Labels1, Counter>,
    attached_retries: Family<Labels2, Counter>,
    ledger_flushes: Counter,
    ledger_flush_seconds: Histogram,
    pool_connections: Family<Labels1, Gauge>,
    /// One scrape at a time: the gauges are cleared and refilled for each.
    scrape: tokio::sync::Mutex<()>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Metrics {
        let mut registry = Registry::default();
        let executions = Family::<Labels2, Gauge>::default();
        registry.register(
            "waymark_executions",
            "Executions in the ledger in each unresolved state, by tool (read at scrape time)",
            executions.clone(),
        );
        let approvals_waiting = Gauge::default();
        registry.register(
            "waymark_approvals_waiting",
            "Executions awaiting an operator's approval (read from the ledger at scrape time)",
            approvals_waiting.clone(),
        );
        let dispatch_seconds: Histograms<Labels2> =
            Family::new_with_constructor(dispatch_histogram);
        registry.register(
            "waymark_dispatch_duration_seconds",
            "From an execution's dispatch being recorded to the host's or API's answer, by tool and channel",
            dispatch_seconds.clone(),
        );
        let unknown_outcomes = Family::<Labels1, Counter>::default();
        registry.register(
            "waymark_unknown_outcomes",
            "Executions recorded as unknown (Waymark cannot prove whether they ran), by tool",
            unknown_outcomes.clone(),
        );
        let attached_retries = Family::<Labels2, Counter>::default();
        registry.register(
            "waymark_attached_retries",
            "Calls that attached to an earlier execution of the same intent, by tool and what the attach did",
            attached_retries.clone(),
        );
        let ledger_flushes = Counter::default();
        registry.register(
            "waymark_ledger_flushes",
            "Flushes that made ledger writes durable (group commit: one serves many writes)",
            ledger_flushes.clone(),
        );
        let ledger_flush_seconds = flush_histogram();
        registry.register(
            "waymark_ledger_flush_duration_seconds",
            "Duration of each ledger flush (sled: flush and fdatasync; PostgreSQL: the synchronous commit's wait for the WAL)",
            ledger_flush_seconds.clone(),
        );
        let pool_connections = Family::<Labels1, Gauge>::default();
        registry.register(
            "waymark_ssh_pool_connections",
            "Live pooled SSH connections, by configured host",
            pool_connections.clone(),
        );
        Metrics {
            registry,
            executions,
            approvals_waiting,
            dispatch_seconds,
            unknown_outcomes,
            attached_retries,
            ledger_flushes,
            ledger_flush_seconds,
            pool_connections,
            scrape: tokio::sync::Mutex::new(()),
        }
    }

    /// What the ledger is told to call after each flush.
    pub fn flush_observer(self: &Arc<Self>) -> FlushObserver {
        let metrics = self.clone();
        FlushObserver(Arc::new(move |took: Duration| {
            metrics.ledger_flushes.inc();
            metrics.ledger_flush_seconds.observe(took.as_secs_f64());
        }))
    }

    /// Reads the gauges afresh and encodes every metric.
    async fn render(&self, sources: &Sources) -> Result<String, String> {
        let _one = self.scrape.lock().await;
        // The tools as configured now: a reload may have added one, whose series start at 0.
        let tools = (sources.tools)();
        self.start_at_zero(&tools);
        let counts = count_unresolved(sources.ledger.as_ref(), &tools).await?;
        self.executions.clear();
        let mut waiting = 0;
        for ((state, tool), n) in counts {
            if state == ExecState::AwaitingApproval {
                waiting += n;
            }
            self.executions
                .get_or_create(&[("state", state.as_str().to_string()), ("tool", tool)])
                .set(n);
        }
        self.approvals_waiting.set(waiting);
        self.pool_connections.clear();
        for (host, live) in sources.hosts.connections() {
            self.pool_connections
                .get_or_create(&[("host", host)])
                .set(live as i64);
        }
        let mut text = String::new();
        prometheus_text::encode(&mut text, &self.registry).map_err(|e| e.to_string())?;
        Ok(text)
    }
}

impl FlowMetrics for Metrics {
    fn dispatch_answered(&self, tool: &str, channel: Channel, latency: Duration) {
        self.dispatch_seconds
            .get_or_create(&[
                ("tool", tool.to_string()),
                ("channel", channel.as_str().to_string()),
            ])
            .observe(latency.as_secs_f64());
    }

    fn unknown_outcome(&self, tool: &str) {
        self.unknown_outcomes
            .get_or_create(&[("tool", tool.to_string())])
            .inc();
    }

    fn attached_retry(&self, tool: &str, action: AttachAction) {
        self.attached_retries
            .get_or_create(&[("tool", tool.to_string()), ("action", action_label(action))])
            .inc();
    }
}

impl Metrics {
    /// Creates the counters of every tool at zero, so that a series exists before its first
    /// event (`rate()` and alerts on `increase()` need a series to start from).
    fn start_at_zero(&self, tools: &[String]) {
        for tool in tools {
            self.unknown_outcomes
                .get_or_create(&[("tool", tool.clone())])
                .inc_by(0);
            for action in AttachAction::ALL {
                self.attached_retries
                    .get_or_create(&[("tool", tool.clone()), ("action", action_label(action))])
                    .inc_by(0);
            }
        }
    }
}

/// An attach action as its label value: its wire name (`ask_host_marker`, ...).
fn action_label(action: AttachAction) -> String {
    serde_json::to_value(action)
        .ok()
        .and_then(|v| v.as_str().map(str::to_string))
        .unwrap_or_default()
}

/// Executions in each unresolved state by tool: every configured tool in every such state
/// (zero included, so a series does not vanish when it empties), and any other tool the
/// ledger names (a raw command, a tool since removed from the configuration).
pub(crate) async fn count_unresolved(
    ledger: &dyn LedgerApi,
    tools: &[String],
) -> Result<BTreeMap<(ExecState, String), i64>, String> {
    let mut counts = BTreeMap::new();
    for state in ExecState::ALL.into_iter().filter(|s| !s.is_final()) {
        for tool in tools {
            counts.insert((state, tool.clone()), 0);
        }
        let mut q = ListQuery {
            state: Some(state),
            limit: PAGE,
            ..ListQuery::default()
        };
        loop {
            let page = ledger.list(&q).await.map_err(|e| e.to_string())?;
            for r in &page.items {
                *counts.entry((state, r.tool.clone())).or_insert(0) += 1;
            }
            match page.next {
                Some(next) => q.after = Some(next),
                None => break,
            }
        }
    }
    Ok(counts)
}

/// Where the scrape-time gauges are read.
pub struct Sources {
    pub ledger: Arc<dyn LedgerApi>,
    pub hosts: Arc<SshHosts>,
    /// The tools calls can name, as configured now (a reload changes them): the configured
    /// ones, and the raw command tool (`ssh_exec`) when some host allows raw commands.
    pub tools: Box<dyn Fn() -> Vec<String> + Send + Sync>,
}

/// Binds `addr` and serves the endpoint until the daemon exits. A request the endpoint cannot
/// read (not HTTP, too slow) closes its own connection and touches nothing else.
pub async fn serve(
    addr: SocketAddr,
    metrics: Arc<Metrics>,
    sources: Sources,
) -> Result<SocketAddr, String> {
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|e| format!("daemon.metrics_listen: cannot listen on {addr}: {e}"))?;
    // Port 0 in the configuration: the port the system gave.
    let addr = listener.local_addr().map_err(|e| e.to_string())?;
    tracing::info!(url = %format!("http://{addr}{METRICS_PATH}"), "Prometheus metrics");
    metrics.start_at_zero(&(sources.tools)());
    let sources = Arc::new(sources);
    tokio::spawn(async move {
        loop {
            let stream = match listener.accept().await {
                Ok((stream, _)) => stream,
                Err(e) => {
                    tracing::warn!(error = %e, "metrics: accept failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            };
            let metrics = metrics.clone();
            let sources = sources.clone();
            tokio::spawn(async move {
                let handler = hyper::service::service_fn(move |req: Request<Incoming>| {
                    let metrics = metrics.clone();
                    let sources = sources.clone();
                    async move { Ok::<_, Infallible>(answer(&req, &metrics, &sources).await) }
                });
                let connection = hyper::server::conn::http1::Builder::new()
                    .timer(TokioTimer::new())
                    .header_read_timeout(HEAD_TIMEOUT)
                    .serve_connection(TokioIo::new(stream), handler);
                // Past its lifetime a connection is dropped, which closes it.
                if let Ok(Err(e)) = tokio::time::timeout(CONNECTION_LIFETIME, connection).await {
                    tracing::debug!(error = %e, "metrics: connection ended");
                }
            });
        }
    });
    Ok(addr)
}

async fn answer(
    req: &Request<Incoming>,
    metrics: &Metrics,
    sources: &Sources,
) -> Response<Full<Bytes>> {
    if req.uri().path() != METRICS_PATH {
        return plain(
            StatusCode::NOT_FOUND,
            format!("not found; metrics are at {METRICS_PATH}\n"),
        );
    }
    if req.method() != Method::GET && req.method() != Method::HEAD {
        return plain(StatusCode::METHOD_NOT_ALLOWED, "GET only\n".into());
    }
    match metrics.render(sources).await {
        Ok(text) => {
            let mut r = Response::new(Full::new(Bytes::from(text)));
            r.headers_mut().insert(
                hyper::header::CONTENT_TYPE,
                hyper::header::HeaderValue::from_static(prometheus_text::CONTENT_TYPE),
            );
            r
        }
        Err(e) => {
            tracing::error!(error = %e, "metrics: reading the ledger failed");
            plain(
                StatusCode::INTERNAL_SERVER_ERROR,
                format!("reading the ledger failed: {e}\n"),
            )
        }
    }
}

fn plain(status: StatusCode, text: String) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(Bytes::from(text)));
    *r.status_mut() = status;
    r.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    r
}
