//! A host whose logins are slow and serialized: every session first holds a host-wide lock for
//! 0.3 s (a login script behind a version manager's rehash does this), so logins queue. Serve
//! workers each cost a login; a burst must still run every call exactly once, with none left
//! "not started" behind a fixed start budget.

mod common;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{config, host_file_lines, sh, within};
use waymark_ssh::{DispatchOutcome, Executor};
use waymark_testkit::{SshdOptions, TestSshd};

const LOGIN_HOLD: Duration = Duration::from_millis(300);

fn slow_login_host() -> TestSshd {
    TestSshd::with_options(SshdOptions::default().serialized_login(LOGIN_HOLD))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_of_200_calls_on_a_host_whose_logins_queue_runs_every_call_once() {
    let sshd = slow_login_host();
    let exec = Arc::new(Executor::new(config(&sshd)).unwrap());
    // 200 logins one after another would take 60 s; the bound leaves room for a loaded
    // machine, not for a start budget running out.
    within(100, "a burst on a slow-login host", async {
        let started = Instant::now();
        let calls: Vec<_> = (0..200)
            .map(|_| {
                let exec = exec.clone();
                let request = sh("echo \"$WAYMARK_EXECUTION_ID\" >> \"$HOME/counter\"");
                tokio::spawn(async move {
                    let outcome = exec.dispatch(&request, |_| {}).await;
                    (request.execution_id, outcome)
                })
            })
            .collect();
        let mut ids = Vec::new();
        let mut failures = Vec::new();
        for call in calls {
            let (id, outcome) = call.await.unwrap();
            match outcome {
                Ok(DispatchOutcome::Completed(report)) => {
                    assert_eq!(report.status.exit_code, Some(0), "{id}: {report:?}")
                }
                Ok(other) => failures.push(format!("{id}: {other:?}")),
                Err(e) => failures.push(format!("{id}: {e}")),
            }
            ids.push(id);
        }
        let took = started.elapsed();
        let sessions = sshd.log().matches("Starting session:").count();
        eprintln!("200 calls in {took:?} over {sessions} sessions");
        assert!(
            failures.is_empty(),
            "{} of 200 calls failed, first: {}",
            failures.len(),
            failures[0]
        );
        let mut runs: HashMap<String, usize> = HashMap::new();
        for line in host_file_lines(&sshd, "counter") {
            *runs.entry(line).or_default() += 1;
        }
        for id in &ids {
            assert_eq!(runs.get(id), Some(&1), "{id} ran {:?} times", runs.get(id));
        }
        assert_eq!(runs.len(), 200);
    })
    .await;
}
