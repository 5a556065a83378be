//! Reconcile on the shared PostgreSQL ledger (the test kit's cluster, a database per test),
//! where fencing is the database's: a lease lost while a reconcile runs costs that execution
//! only. The host is a stand-in that answers marker reads; the ledger and its fencing are real.

mod common;

use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::{Map, Value};
use waymark_core::{ExecState, ExecutionId, IncomingCall, Timestamp, Transition};
use waymark_gateway::config::{Config, HostEntry};
use waymark_gateway::flow::{now, Gateway};
use waymark_gateway::host::{
    Arg, DispatchError, DispatchOutcome, EnvVar, FetchedOutput, HostError, HostExecutor,
    MarkerView, OutputNews, Stream,
};
use waymark_gateway::tools::resolve;
use waymark_ledger::{Durability, Intake, LedgerApi, NewExecution};
use waymark_ledger_pg::{PgBackend, PgLedger};
use waymark_testkit::TestPostgres;

/// The master key both daemons share.
const MASTER: [u8; 32] = *b"waymark-gateway-reconcile-pg-key";

/// A host whose markers all show a running command. On the first marker read, before it
/// answers, it takes `fence` from daemon A: A lets it go and B adopts it, as a status check or
/// a call on B would, so that A's lease listed at the start of the reconcile is stale by the
/// time A records what the marker showed.
struct RunningHost {
    fence: Mutex<Option<ExecutionId>>,
    a: Arc<PgBackend>,
    b: Arc<PgBackend>,
}

impl HostExecutor for RunningHost {
    async fn dispatch(
        &self,
        _: &HostEntry,
        _: ExecutionId,
        _: Vec<Arg>,
        _: Option<String>,
        _: Vec<EnvVar>,
        _: Duration,
    ) -> Result<DispatchOutcome, DispatchError> {
        unreachable!("reconcile sends nothing")
    }

    async fn status(&self, host: &HostEntry, id: ExecutionId) -> Result<MarkerView, HostError> {
        Ok(self.status_many(host, &[id]).await?.remove(0))
    }

    async fn status_many(
        &self,
        _: &HostEntry,
        ids: &[ExecutionId],
    ) -> Result<Vec<MarkerView>, HostError> {
        let fence = self.fence.lock().unwrap().take();
        if let Some(id) = fence {
            self.a.let_go(id).expect("A held it").await.unwrap();
            let adopted = self.b.get_or_adopt(id, now()).await.unwrap().unwrap();
            assert!(self.b.drives(&adopted), "B adopted what A let go");
        }
        Ok(ids
            .iter()
            .map(|_| MarkerView::Running { pid: None })
            .collect())
    }

    async fn watch_output(
        &self,
        _: &HostEntry,
        _: Duration,
        _: &[(ExecutionId, [u64; 2])],
    ) -> Result<Vec<OutputNews>, HostError> {
        unreachable!("reconcile watches no output")
    }

    async fn fetch_output(
        &self,
        _: &HostEntry,
        _: ExecutionId,
        _: u64,
    ) -> Result<(FetchedOutput, FetchedOutput), HostError> {
        unreachable!("no marker shows a finished command")
    }

    async fn read_output(
        &self,
        _: &HostEntry,
        _: ExecutionId,
        _: Stream,
        _: u64,
        _: u64,
    ) -> Result<(Vec<u8>, u64), HostError> {
        unreachable!("reconcile reads no output")
    }

    async fn cancel(&self, _: &HostEntry, _: ExecutionId) -> Result<MarkerView, HostError> {
        unreachable!("reconcile cancels nothing")
    }
}

/// Accepts a call of tool `t` with `msg` on daemon `a` at `t0`; dispatched unless `sent` is
/// false (then it stays accepted).
async fn accepted(
    config: &Config,
    a: &PgBackend,
    msg: &str,
    t0: Timestamp,
    sent: bool,
) -> ExecutionId {
    let mut args = Map::new();
    args.insert("msg".into(), Value::String(msg.into()));
    let call = resolve(config, "t", &args, common::ctx()).unwrap();
    let key = a.fingerprint_key();
    let action = call.canonicalize(&key);
    let new = NewExecution {
        id: a.mint_id(t0),
        fingerprint: action.fingerprint(&key),
        action,
        actor: call.actor().clone(),
        scope: call.scope().clone(),
        tool: call.tool.clone(),
        host: call.target().to_string(),
        contract: call.policy.contract,
        run: None,
        mask: Vec::new(),
    };
    let incoming = IncomingCall {
        actor: call.actor().clone(),
        scope: call.scope().clone(),
        policy: call.policy,
        now: t0,
    };
    let Intake::New(rec) = a
        .accept_or_attach(new, &incoming, Durability::Flushed)
        .await
        .unwrap()
    else {
        panic!("a new intent attached");
    };
    if sent {
        let steps = vec![
            Transition::Authorize {
                by: "policy".into(),
            },
            Transition::Dispatch { attempt: 1 },
        ];
        a.transitions(rec.id, steps, t0, Durability::Flushed)
            .await
            .unwrap();
    }
    rec.id
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_lost_during_a_reconcile_costs_that_execution_only() {
    let url = TestPostgres::shared().create_database("reconcile_fenced");
    let a = Arc::new(PgBackend::new(
        PgLedger::connect(&url, &MASTER).await.unwrap(),
        "gw-a",
    ));
    let b = Arc::new(PgBackend::new(
        PgLedger::connect(&url, &MASTER).await.unwrap(),
        "gw-b",
    ));
    let config =
        Arc::new(Config::parse(Path::new("t.toml"), common::BASE, &common::defaults()).unwrap());
    // Three commands A dispatched, whose markers show them running; the first (the oldest,
    // the first recorded) is taken from A while the markers are read.
    let t0 = now();
    let mut sent = Vec::new();
    for n in 0..3 {
        sent.push(accepted(&config, &a, &format!("sent-{n}"), t0, true).await);
    }
    // And one accepted an hour ago and never sent: past its window, reconcile expires it.
    let stale = accepted(
        &config,
        &a,
        "never-sent",
        t0.minus(Duration::from_secs(3600)),
        false,
    )
    .await;

    let host = Arc::new(RunningHost {
        fence: Mutex::new(Some(sent[0])),
        a: a.clone(),
        b: b.clone(),
    });
    let gateway = Gateway::new(config, a.clone(), host);
    let report = gateway.reconcile().await;

    let state = |id| {
        let a = a.clone();
        async move { a.get(id).await.unwrap().unwrap().state() }
    };
    assert_eq!(
        state(sent[0]).await,
        ExecState::Dispatched,
        "B's now: A moved nothing"
    );
    for id in &sent[1..] {
        assert_eq!(
            state(*id).await,
            ExecState::Running,
            "the others were recorded"
        );
    }
    assert_eq!(
        state(stale).await,
        ExecState::Expired,
        "and the rest of the reconcile ran"
    );
    let report = report.expect("a reconcile goes on past one execution's fenced write");
    assert_eq!(report.checked, 3, "{report:?}");
    assert_eq!(report.moved, 2, "{report:?}");
    assert_eq!(report.fenced, 1, "{report:?}");
    assert_eq!(report.failed, 0, "{report:?}");
    assert_eq!(report.expired, 1, "{report:?}");
}
