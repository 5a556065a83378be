//! Dropped, silent and restarted connections: the command runs exactly once, the client says
//! `Lost` (never a guess), and status resolves what happened.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{config_via, eventually, host_file_lines, ran, sh, within};
use waymark_ssh::wrapper::{MarkerState, Stream};
use waymark_ssh::{DispatchEvent, DispatchOutcome, DispatchRequest, Error, Executor, HostConfig};
use waymark_testkit::{CutScope, Direction, FaultProxy, SshdOptions, TestSshd};

/// Appends one line to `~/counter`, sleeps, then reports: the host-side proof of how many
/// times the command really ran.
const COUNTED: &str = "echo ran >> \"$HOME/counter\"; sleep 3; echo finished; exit 3";

/// A real sshd, a fault proxy in front of it, and an executor that reaches the sshd through the
/// proxy. Fields drop in order: the executor first, the sshd last.
struct ProxiedHost {
    exec: Arc<Executor>,
    /// The executor's keepalive budget, interval × (max + 1).
    budget: Duration,
    _known_hosts: tempfile::TempDir,
    proxy: FaultProxy,
    sshd: TestSshd,
}

impl ProxiedHost {
    fn new() -> Self {
        Self::with(TestSshd::new(), |_| {})
    }

    /// Over `sshd`, with the executor's config adjusted by `adjust`.
    fn with(sshd: TestSshd, adjust: impl FnOnce(&mut HostConfig)) -> Self {
        let proxy = FaultProxy::start(sshd.addr());
        let dir = tempfile::tempdir().unwrap();
        let mut config = config_via(&sshd, &proxy, dir.path());
        adjust(&mut config);
        ProxiedHost {
            budget: config.drop_detection_budget(),
            exec: Arc::new(Executor::new(config).unwrap()),
            _known_hosts: dir,
            proxy,
            sshd,
        }
    }

    /// Dispatches `request` on its own task.
    fn spawn_dispatch(
        &self,
        request: &DispatchRequest,
    ) -> tokio::task::JoinHandle<Result<DispatchOutcome, Error>> {
        let exec = self.exec.clone();
        let request = request.clone();
        tokio::spawn(async move { exec.dispatch(&request, |_| {}).await })
    }

    /// Waits until a [`COUNTED`]-style command has written its first line on the host.
    async fn started_once(&self) {
        eventually(10, "command started", || {
            host_file_lines(&self.sshd, "counter").len() == 1
        })
        .await;
    }

    fn counter(&self) -> Vec<String> {
        host_file_lines(&self.sshd, "counter")
    }
}

async fn wait_until_completed(exec: &Executor, id: &str) -> waymark_ssh::wrapper::StatusReport {
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        match exec.status(id).await {
            Ok(status) if status.state.is_finished() => return status,
            Ok(_) => {}
            Err(e) => assert!(e.is_not_sent() || e.is_lost(), "status: {e}"),
        }
        assert!(Instant::now() < deadline, "{id} did not finish on the host");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cut_connection_is_lost_and_the_command_still_runs_exactly_once() {
    let host = ProxiedHost::new();
    let exec = &host.exec;
    within(45, "cut", async {
        exec.connect().await.unwrap();
        let request = sh(COUNTED);
        let id = request.execution_id.clone();
        let dispatch = {
            let exec = exec.clone();
            let request = request.clone();
            tokio::spawn(async move {
                let mut events = Vec::new();
                let result = exec.dispatch(&request, |e| events.push(e.clone())).await;
                (result, events)
            })
        };
        host.started_once().await;
        host.proxy.cut_all();
        let (result, events) = dispatch.await.unwrap();
        let err = result.expect_err("a cut connection cannot produce a result");
        assert!(err.is_lost(), "expected Lost, got {err}");
        assert!(events.contains(&DispatchEvent::Sending));
        assert!(err.to_string().contains(&id), "{err}");

        // The command finishes on the host regardless; status (on a fresh connection) says so.
        let status = wait_until_completed(exec, &id).await;
        assert_eq!(status.state, MarkerState::Completed);
        assert_eq!(status.exit_code, Some(3));
        let stdout = exec.read_stream(&id, Stream::Stdout, 0).await.unwrap();
        assert_eq!(stdout, b"finished\n");

        // Retrying the same execution attaches instead of running it again.
        match exec.dispatch(&request, |_| {}).await.unwrap() {
            DispatchOutcome::AlreadyStarted(existing) => {
                assert_eq!(existing.state, MarkerState::Completed);
                assert_eq!(existing.exit_code, Some(3));
            }
            other => panic!("the retry ran again: {other:?}"),
        }
        let report = exec.wait(&id, None).await.unwrap();
        assert_eq!(report.stdout.inline(), Some(&b"finished\n"[..]));
        assert_eq!(host.counter(), vec!["ran".to_string()]);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_blackholed_connection_is_lost_within_the_keepalive_budget() {
    let host = ProxiedHost::new();
    let (exec, budget) = (&host.exec, host.budget);
    within(45, "blackhole", async {
        exec.connect().await.unwrap();
        let request = sh("echo ran >> \"$HOME/counter\"; sleep 4; echo finished");
        let id = request.execution_id.clone();
        let dispatch = host.spawn_dispatch(&request);
        host.started_once().await;
        host.proxy.blackhole(true);
        let silent_since = Instant::now();
        let err = dispatch
            .await
            .unwrap()
            .expect_err("no reply can cross a blackhole");
        let noticed = silent_since.elapsed();
        assert!(err.is_lost(), "expected Lost, got {err}");
        assert!(
            noticed <= budget + Duration::from_millis(1500),
            "took {noticed:?} to notice; budget {budget:?}"
        );
        eprintln!("blackhole noticed after {noticed:?} (budget {budget:?}): {err}");

        host.proxy.blackhole(false);
        let status = wait_until_completed(exec, &id).await;
        assert_eq!(status.exit_code, Some(0));
        assert_eq!(
            exec.wait(&id, None).await.unwrap().stdout.inline(),
            Some(&b"finished\n"[..])
        );
        assert_eq!(host.counter().len(), 1);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_command_survives_sshd_restarting_under_it() {
    let host = ProxiedHost::new();
    let exec = &host.exec;
    within(60, "restart", async {
        exec.connect().await.unwrap();
        let request = sh(COUNTED);
        let id = request.execution_id.clone();
        let dispatch = host.spawn_dispatch(&request);
        host.started_once().await;

        // sshd goes down and the session with it.
        host.sshd.stop();
        host.proxy.cut_all();
        let err = dispatch.await.unwrap().unwrap_err();
        assert!(err.is_lost(), "{err}");

        // While sshd is down nothing can be sent: a status call is NotSent, not Lost.
        let err = exec.status(&id).await.unwrap_err();
        assert!(
            matches!(err, Error::NotSent(_)),
            "with sshd down, status must fail as NotSent: {err}"
        );

        host.sshd.start();
        let status = wait_until_completed(exec, &id).await;
        assert_eq!(status.state, MarkerState::Completed);
        assert_eq!(status.exit_code, Some(3));
        match exec.dispatch(&request, |_| {}).await.unwrap() {
            DispatchOutcome::AlreadyStarted(existing) => {
                assert_eq!(existing.state, MarkerState::Completed)
            }
            other => panic!("ran again after restart: {other:?}"),
        }
        assert_eq!(host.counter().len(), 1);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_connection_is_not_sent_and_a_retry_then_runs_once() {
    let host = ProxiedHost::with(TestSshd::new(), |c| c.connect_attempts = 2);
    let exec = &host.exec;
    within(30, "refused", async {
        host.proxy.refuse_new(true);
        let request = sh("echo ran >> \"$HOME/counter\"");
        let mut events = Vec::new();
        let err = exec
            .dispatch(&request, |e| events.push(e.clone()))
            .await
            .unwrap_err();
        assert!(matches!(err, Error::NotSent(_)), "{err}");
        assert!(
            events.is_empty(),
            "nothing may be reported sent: {events:?}"
        );
        assert!(host.counter().is_empty());

        host.proxy.refuse_new(false);
        ran(exec.dispatch(&request, |_| {}).await.unwrap());
        assert_eq!(host.counter().len(), 1);
    })
    .await;
}

/// Whatever byte a served request or its reply is cut at, the command runs at most once; a
/// `NotSent` never ran, a `Completed` ran once, and a `Lost` is what the marker says.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_served_call_cut_at_any_byte_runs_at_most_once_and_never_when_not_sent() {
    let host = ProxiedHost::with(TestSshd::new(), |c| {
        c.connect_timeout = Duration::from_secs(2);
        c.connect_attempts = 2;
    });
    let exec = &host.exec;
    within(90, "cut sweep over serve", async {
        let cuts = [0, 8, 40, 90, 140, 200, 400]
            .map(|n| (n, Direction::ClientToServer))
            .into_iter()
            .chain([0, 60, 300, 900].map(|n| (n, Direction::ServerToClient)));
        let mut outcomes = Vec::new();
        for (bytes, direction) in cuts {
            // A warm serve channel on a live connection, then the cut armed on it.
            ran(exec.dispatch(&sh("true"), |_| {}).await.unwrap());
            assert!(exec.idle_serve_count() >= 1);
            host.proxy.cut_after(bytes, direction, CutScope::Live);
            let request = sh("echo \"$WAYMARK_EXECUTION_ID\" >> \"$HOME/counter\"");
            let outcome = exec.dispatch(&request, |_| {}).await;
            outcomes.push((bytes, direction, request.execution_id, outcome));
            // A budget the call did not use up stays armed on that connection: start afresh.
            exec.disconnect();
        }
        host.proxy.heal();
        tokio::time::sleep(Duration::from_millis(500)).await;
        let counter = host.counter();
        let mut lost = 0;
        for (bytes, direction, id, outcome) in outcomes {
            let runs = counter.iter().filter(|l| **l == id).count();
            let what = format!("cut after {bytes} bytes {direction:?}");
            eprintln!(
                "{what}: ran {runs}, {}",
                match &outcome {
                    Ok(_) => "completed".to_string(),
                    Err(e) if e.is_not_sent() => "not sent".to_string(),
                    Err(e) => format!("lost ({e})"),
                }
            );
            match outcome {
                Err(e) if e.is_not_sent() => assert_eq!(runs, 0, "{what}: NotSent but ran: {e}"),
                Ok(DispatchOutcome::Completed(_)) => assert_eq!(runs, 1, "{what}"),
                Err(e) if e.is_lost() => {
                    lost += 1;
                    let status = exec.status(&id).await.unwrap();
                    let expected = if runs == 0 {
                        MarkerState::Absent
                    } else {
                        MarkerState::Completed
                    };
                    assert!(runs <= 1, "{what}: ran {runs} times");
                    assert_eq!(status.state, expected, "{what}: {e}");
                }
                other => panic!("{what}: {other:?}"),
            }
        }
        assert!(lost > 0, "some cut fell between the request and its reply");
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_never_leaves_on_a_serve_channel_whose_link_went_silent_while_idle() {
    let host = ProxiedHost::with(TestSshd::new(), |c| {
        c.connect_timeout = Duration::from_secs(1);
        c.connect_attempts = 1;
    });
    let exec = &host.exec;
    within(40, "silent idle link", async {
        ran(exec.dispatch(&sh("true"), |_| {}).await.unwrap());
        assert_eq!(exec.idle_serve_count(), 1);
        // Idle long enough to be checked, then the link goes silent.
        tokio::time::sleep(Duration::from_millis(1200)).await;
        host.proxy.blackhole(true);
        let mut events = Vec::new();
        let err = exec
            .dispatch(&sh("echo ran >> \"$HOME/counter\""), |e| {
                events.push(e.clone())
            })
            .await
            .unwrap_err();
        assert!(err.is_not_sent(), "expected NotSent, got {err}");
        assert!(events.is_empty(), "{events:?}");
        host.proxy.blackhole(false);
        ran(exec
            .dispatch(&sh("echo after >> \"$HOME/counter\""), |_| {})
            .await
            .unwrap());
        assert_eq!(host.counter(), vec!["after".to_string()]);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_calls_to_a_silent_host_all_fail_fast_as_not_sent() {
    let host = ProxiedHost::with(TestSshd::new(), |c| {
        c.connect_timeout = Duration::from_secs(1);
        c.connect_attempts = 2;
    });
    within(30, "silent host", async {
        // Connections are accepted but nothing ever answers.
        host.proxy.blackhole(true);
        let started = Instant::now();
        let calls: Vec<_> = (0..8)
            .map(|_| host.spawn_dispatch(&sh("echo ran >> \"$HOME/counter\"")))
            .collect();
        for call in calls {
            let err = call.await.unwrap().unwrap_err();
            assert!(matches!(err, Error::NotSent(_)), "{err}");
        }
        // One caller spends its connect_timeout (1 s, both attempts within it); the others
        // do not queue more.
        let took = started.elapsed();
        assert!(took < Duration::from_secs(5), "took {took:?}");
        host.proxy.blackhole(false);
        assert!(host.counter().is_empty());
    })
    .await;
}

/// `connect_timeout` bounds the whole wait for a session, retries included: the error names
/// the bound, so the call must not have waited a multiple of it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_to_a_blackholed_host_gives_up_within_connect_timeout() {
    let host = ProxiedHost::with(TestSshd::new(), |c| {
        c.connect_timeout = Duration::from_secs(2);
        c.connect_attempts = 3;
    });
    within(30, "blackholed host", async {
        host.proxy.blackhole(true);
        let started = Instant::now();
        let err = host
            .exec
            .dispatch(&sh("echo ran >> \"$HOME/counter\""), |_| {})
            .await
            .unwrap_err();
        let took = started.elapsed();
        assert!(err.is_not_sent(), "{err}");
        assert!(err.to_string().contains("2s (connect_timeout)"), "{err}");
        // The timer's own lateness, not another attempt's 2 s.
        assert!(
            took < Duration::from_millis(3500),
            "the error said 2 s but the call waited {took:?}"
        );
        host.proxy.blackhole(false);
        assert!(host.counter().is_empty());
    })
    .await;
}

/// Whatever byte of the server's side of the handshake the connection is cut at, the error is
/// about the connection, never "the key was rejected": a transport failure during
/// authentication must not send an operator to authorized_keys.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_cut_during_authentication_is_not_a_rejected_key() {
    let sshd = TestSshd::new();
    let proxy = FaultProxy::start(sshd.addr());
    let dir = tempfile::tempdir().unwrap();
    let mut config = config_via(&sshd, &proxy, dir.path());
    config.connect_attempts = 1;
    within(120, "cut sweep", async {
        let mut budget = 0u64;
        let mut cut_in_auth = 0;
        loop {
            proxy.cut_after(budget, Direction::ServerToClient, CutScope::Next);
            let exec = Executor::new(config.clone()).unwrap();
            match exec.connect().await {
                Ok(()) => break,
                Err(e) => {
                    let text = e.to_string();
                    assert!(
                        !text.contains("authorized_keys") && !text.contains("rejected"),
                        "cut after {budget} bytes from the server: {text}"
                    );
                    if text.contains("during authentication") {
                        cut_in_auth += 1;
                    }
                }
            }
            proxy.heal();
            budget += 8;
            assert!(budget < 64 * 1024, "the connection never completed");
        }
        assert!(
            cut_in_auth > 0,
            "the sweep cut at least once while authentication waited for its answer"
        );
    })
    .await;
}

/// An sshd that probes its clients every second (`ClientAliveInterval 1`) and keeps probing for
/// as long as a test runs. While a link is half dead (the host no longer hears the client, but
/// still talks to it), those probes reach the client: a keepalive that counts any traffic from
/// the host as a sign of life never gives up on such a connection.
fn talkative_sshd() -> TestSshd {
    TestSshd::with_options(
        SshdOptions::default()
            .extra_config("ClientAliveInterval 1")
            .extra_config("ClientAliveCountMax 1000"),
    )
}

/// Upper bound for noticing a wedged connection and getting a fresh one: the keepalive budget,
/// then a reconnect (handshake and wrapper check) on loopback, with slack for a loaded machine.
fn replace_bound(budget: Duration) -> Duration {
    budget + Duration::from_secs(6)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pooled_connection_the_host_no_longer_hears_is_replaced_within_the_keepalive_budget() {
    let host = ProxiedHost::with(talkative_sshd(), |_| {});
    let (exec, budget) = (&host.exec, host.budget);
    within(40, "wedged pooled connection", async {
        exec.connect().await.unwrap();
        // From now on nothing the client sends on that connection reaches sshd, while sshd's
        // probes still reach the client. New connections are not affected.
        host.proxy
            .stall_after(0, Direction::ClientToServer, CutScope::Live);
        let wedged_at = Instant::now();
        let status = exec.status(&common::new_id()).await;
        let took = wedged_at.elapsed();
        let status = status.expect("a call after the fault runs on a fresh connection");
        assert_eq!(status.state, MarkerState::Absent);
        assert!(
            took <= replace_bound(budget),
            "took {took:?} to get past the wedged connection (budget {budget:?})"
        );
        assert_eq!(
            host.proxy.stats().accepted,
            2,
            "one fresh connection replaced it"
        );
    })
    .await;
}

/// The field report behind this test: the host's install shell sat in `cat` waiting for the
/// wrapper script on its stdin, the install failed with "no reply", and every later call went
/// to that same connection again and hung.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_install_whose_stdin_never_arrives_leaves_no_wedged_connection_behind() {
    let host = ProxiedHost::with(talkative_sshd(), |_| {});
    let (exec, budget) = (&host.exec, host.budget);
    within(50, "wedged install", async {
        exec.connect().await.unwrap();
        remove_wrapper(&host.sshd);
        // Enough for the next call's command line (which finds the wrapper gone) and the
        // reinstall's command line, not for the 23 KB script that follows on stdin.
        host.proxy
            .stall_after(STALL_IN_INSTALL, Direction::ClientToServer, CutScope::Live);
        let request = sh("echo ran >> \"$HOME/counter\"");
        let wedged_at = Instant::now();
        let first = exec.dispatch(&request, |_| {}).await;
        let took = wedged_at.elapsed();
        eprintln!("first call after the fault, after {took:?}: {first:?}");
        match &first {
            Ok(outcome) => panic!("nothing could reach the host: {outcome:?}"),
            Err(e) => assert!(matches!(e, Error::NotSent(_)), "{e}"),
        }
        assert!(
            took <= replace_bound(budget),
            "the failed install took {took:?} (budget {budget:?})"
        );
        let again = Instant::now();
        ran(exec.dispatch(&request, |_| {}).await.unwrap());
        let took = again.elapsed();
        assert!(
            took <= replace_bound(budget),
            "the next call took {took:?} (budget {budget:?})"
        );
        assert_eq!(host.counter(), vec!["ran".to_string()]);
    })
    .await;
}

/// Client-to-server bytes that pass in [`an_install_whose_stdin_never_arrives_leaves_no_wedged_connection_behind`].
const STALL_IN_INSTALL: u64 = 4096;

fn remove_wrapper(sshd: &TestSshd) {
    let bin = sshd.remote_dir().join("bin");
    for entry in std::fs::read_dir(&bin).unwrap() {
        std::fs::remove_file(entry.unwrap().path()).unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_a_reply_was_lost_on_is_not_handed_out_again() {
    let host = ProxiedHost::new();
    let exec = &host.exec;
    within(40, "lost reply", async {
        exec.connect().await.unwrap();
        let request = sh("sleep 20");
        let id = request.execution_id.clone();
        let dispatch = host.spawn_dispatch(&request);
        while exec.status(&id).await.unwrap().state != MarkerState::Running {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let waiting = {
            let exec = exec.clone();
            let id = id.clone();
            tokio::spawn(async move { exec.wait(&id, None).await })
        };
        // The wrapper answering `wait` dies on the host: its reply is lost, though the
        // connection itself is fine.
        let mut killed = false;
        for _ in 0..200 {
            if let Some(pid) = wrapper_process(&["wait", &id]) {
                let status = std::process::Command::new("kill")
                    .args(["-KILL", &pid.to_string()])
                    .status()
                    .unwrap();
                killed = status.success();
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert!(killed, "found and killed the wrapper answering wait");
        let err = waiting.await.unwrap().unwrap_err();
        assert!(err.is_lost(), "{err}");
        assert_eq!(host.proxy.stats().accepted, 1);

        let status = exec.status(&id).await.unwrap();
        assert_eq!(status.state, MarkerState::Running);
        assert_eq!(
            host.proxy.stats().accepted,
            2,
            "the next call went to a fresh connection"
        );
        exec.cancel(&id, Some(Duration::from_millis(100)))
            .await
            .unwrap();
        ran(dispatch.await.unwrap().unwrap());
    })
    .await;
}

/// The pid of a wrapper process on this machine whose arguments include all of `words`.
fn wrapper_process(words: &[&str]) -> Option<u32> {
    std::fs::read_dir("/proc")
        .ok()?
        .flatten()
        .find_map(|entry| {
            let pid: u32 = entry.file_name().to_str()?.parse().ok()?;
            let cmdline = std::fs::read(entry.path().join("cmdline")).ok()?;
            let args: Vec<&[u8]> = cmdline.split(|b| *b == 0).collect();
            let is_wrapper = args.iter().any(|a| a.windows(5).any(|w| w == b"wrap-"));
            let has_all = words.iter().all(|w| args.contains(&w.as_bytes()));
            (is_wrapper && has_all).then_some(pid)
        })
}
