//! Serve channels against a real OpenSSH sshd: runs and statuses share long-lived wrapper
//! workers, one id raced on two of them starts once, and a worker that dies is a lost reply
//! (mid-request) or a channel nobody uses again (while idle), never a second run.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::{config, eventually, host_file_lines, new_id, ran, sh, within};
use waymark_ssh::wrapper::{MarkerState, Stream};
use waymark_ssh::{DispatchEvent, DispatchOutcome, DispatchRequest, Executor};
use waymark_testkit::TestSshd;

/// The pids of the serve workers (`wrap _serve`) running under `sshd`'s remote dir: each
/// leads its own session (the subshells it forks for a request share its command line).
fn serve_workers(sshd: &TestSshd) -> Vec<u32> {
    let dir = sshd.remote_dir();
    let dir = dir.to_str().unwrap().as_bytes();
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|entry| {
            let pid: u32 = entry.file_name().to_str()?.parse().ok()?;
            let cmdline = std::fs::read(entry.path().join("cmdline")).ok()?;
            let args: Vec<&[u8]> = cmdline.split(|b| *b == 0).collect();
            let under_dir = args.iter().any(|a| a.starts_with(dir));
            let stat = std::fs::read_to_string(entry.path().join("stat")).ok()?;
            // Fields after the command name: state, ppid, pgrp, session.
            let session: u32 = stat
                .rsplit_once(')')?
                .1
                .split_whitespace()
                .nth(3)?
                .parse()
                .ok()?;
            (under_dir && args.contains(&&b"_serve"[..]) && session == pid).then_some(pid)
        })
        .collect()
}

fn kill(pid: u32) {
    let status = std::process::Command::new("kill")
        .args(["-KILL", &pid.to_string()])
        .status()
        .unwrap();
    assert!(status.success(), "kill {pid}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn runs_and_statuses_share_one_serve_worker_and_exec_stays_for_the_rest() {
    let sshd = TestSshd::new();
    let exec = Executor::new(config(&sshd)).unwrap();
    within(60, "served calls", async {
        let mut ids = Vec::new();
        for i in 0..5 {
            let mut events = Vec::new();
            let request = sh(&format!("echo served {i}"));
            let report = ran(exec
                .dispatch(&request, |e| events.push(e.clone()))
                .await
                .unwrap());
            assert_eq!(
                report.stdout.inline(),
                Some(format!("served {i}\n").as_bytes())
            );
            assert_eq!(
                events,
                vec![
                    DispatchEvent::Sending,
                    DispatchEvent::Accepted,
                    DispatchEvent::Completed
                ]
            );
            ids.push(request.execution_id);
        }
        let statuses = exec.status_many(&ids).await.unwrap();
        assert!(statuses.iter().all(|s| s.state == MarkerState::Completed));
        assert_eq!(
            exec.status(&new_id()).await.unwrap().state,
            MarkerState::Absent
        );
        assert_eq!(
            exec.idle_serve_count(),
            1,
            "one serve channel carried them all"
        );
        assert_eq!(serve_workers(&sshd).len(), 1, "one worker on the host");
        assert_eq!(exec.connection_count(), 1);

        // Output is read on the serve channel too: no session of its own, byte for byte.
        let sessions = || sshd.log().matches("Starting session: command").count();
        let before = sessions();
        for (i, id) in ids.iter().enumerate() {
            let text = format!("served {i}\n");
            let whole = exec.output(id, Stream::Stdout, 0, 100).await.unwrap();
            assert_eq!(
                (whole.data, whole.finished),
                (text.clone().into_bytes(), true)
            );
            let tail = exec.output(id, Stream::Stdout, 3, 4).await.unwrap();
            assert_eq!(tail.data, &text.as_bytes()[3..7]);
        }
        assert_eq!(sessions(), before, "an output read opened a session");
        assert_eq!(exec.idle_serve_count(), 1);

        // Stdin goes on an exec channel, beside the idle serve channel.
        let request = DispatchRequest {
            stdin: Some(b"piped\n".to_vec()),
            ..sh("cat")
        };
        let report = ran(exec.dispatch(&request, |_| {}).await.unwrap());
        assert_eq!(report.stdout.inline(), Some(&b"piped\n"[..]));
        assert_eq!(serve_workers(&sshd).len(), 1);

        // Closing the idle channel ends its worker on the host.
        exec.disconnect();
        eventually(10, "the worker ended with its channel", || {
            serve_workers(&sshd).is_empty()
        })
        .await;
    })
    .await;
}

/// Two calls run, and no serve channel or worker is left: they went on exec channels.
async fn two_calls_run_on_exec_channels(exec: &Executor, sshd: &TestSshd) {
    for _ in 0..2 {
        let report = ran(exec.dispatch(&sh("echo x"), |_| {}).await.unwrap());
        assert_eq!(report.stdout.inline(), Some(&b"x\n"[..]));
    }
    assert_eq!(exec.idle_serve_count(), 0);
    assert!(serve_workers(sshd).is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_serve_off_every_call_takes_an_exec_channel() {
    let sshd = TestSshd::new();
    let mut config = config(&sshd);
    config.serve = false;
    let exec = Executor::new(config).unwrap();
    within(30, "exec calls", async {
        two_calls_run_on_exec_channels(&exec, &sshd).await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_whose_worker_cannot_start_is_served_by_exec_channels_meanwhile() {
    let sshd = TestSshd::new();
    let exec = Executor::new(config(&sshd)).unwrap();
    within(60, "no serve worker", async {
        exec.connect().await.unwrap();
        // The worker needs the markers' directory; a file in its place stops it before it is
        // ready (exit 70), and the exec path's run fails the same way, with the reason.
        let markers = sshd.remote_dir().join("exec");
        let _ = std::fs::remove_dir_all(&markers);
        std::fs::write(&markers, b"not a directory").unwrap();
        let err = exec.dispatch(&sh("echo x"), |_| {}).await.unwrap_err();
        assert!(!err.is_lost(), "{err}");
        assert!(err.to_string().contains("cannot create"), "{err}");
        assert_eq!(exec.idle_serve_count(), 0);

        // Repaired: the next calls run, on exec channels, without trying serve again yet.
        std::fs::remove_file(&markers).unwrap();
        two_calls_run_on_exec_channels(&exec, &sshd).await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_id_raced_on_two_serve_channels_starts_once() {
    let sshd = TestSshd::new();
    let exec = Arc::new(Executor::new(config(&sshd)).unwrap());
    within(60, "race", async {
        // Two idle serve channels first, so both requests leave at once.
        let warm: Vec<_> = (0..2)
            .map(|_| {
                let exec = exec.clone();
                tokio::spawn(async move { exec.dispatch(&sh("sleep 0.3"), |_| {}).await })
            })
            .collect();
        for w in warm {
            ran(w.await.unwrap().unwrap());
        }
        assert_eq!(exec.idle_serve_count(), 2);

        let request = sh("echo ran >> \"$HOME/counter\"; sleep 0.5; echo done");
        let racers: Vec<_> = (0..2)
            .map(|_| {
                let exec = exec.clone();
                let request = request.clone();
                tokio::spawn(async move { exec.dispatch(&request, |_| {}).await })
            })
            .collect();
        let mut ran_count = 0;
        let mut refused = 0;
        for r in racers {
            match r.await.unwrap().unwrap() {
                DispatchOutcome::Completed(report) => {
                    assert_eq!(report.stdout.inline(), Some(&b"done\n"[..]));
                    ran_count += 1;
                }
                DispatchOutcome::AlreadyStarted(_) => refused += 1,
            }
        }
        assert_eq!((ran_count, refused), (1, 1));
        assert_eq!(host_file_lines(&sshd, "counter"), vec!["ran".to_string()]);
        assert_eq!(exec.idle_serve_count(), 2, "both went over serve channels");
    })
    .await;
}

/// A request that finds no serve worker ready goes on an exec channel: the marker refuses a
/// second start of its ID whichever channel carries either send, in either order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_id_sent_on_a_serve_channel_and_on_an_exec_channel_starts_once() {
    let sshd = TestSshd::new();
    let served = Executor::new(config(&sshd)).unwrap();
    let mut plain = config(&sshd);
    plain.serve = false;
    let plain = Executor::new(plain).unwrap();
    within(60, "serve then exec, exec then serve", async {
        for (first, second) in [(&served, &plain), (&plain, &served)] {
            let request = sh("echo \"$WAYMARK_EXECUTION_ID\" >> \"$HOME/counter\"");
            ran(first.dispatch(&request, |_| {}).await.unwrap());
            match second.dispatch(&request, |_| {}).await.unwrap() {
                DispatchOutcome::AlreadyStarted(status) => {
                    assert_eq!(status.state, MarkerState::Completed)
                }
                other => panic!("the second send ran again: {other:?}"),
            }
        }
        assert_eq!(served.idle_serve_count(), 1, "the serve side used a worker");
        assert_eq!(host_file_lines(&sshd, "counter").len(), 2);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_killed_mid_request_is_a_lost_reply_and_the_command_runs_on_once() {
    let sshd = TestSshd::new();
    let exec = Arc::new(Executor::new(config(&sshd)).unwrap());
    within(60, "killed worker", async {
        exec.connect().await.unwrap();
        let request = sh("echo ran >> \"$HOME/counter\"; sleep 2; echo finished");
        let id = request.execution_id.clone();
        let dispatch = {
            let exec = exec.clone();
            tokio::spawn(async move { exec.dispatch(&request, |_| {}).await })
        };
        eventually(10, "command started", || {
            host_file_lines(&sshd, "counter").len() == 1
        })
        .await;
        let workers = serve_workers(&sshd);
        assert_eq!(workers.len(), 1, "{workers:?}");
        kill(workers[0]);
        let err = dispatch.await.unwrap().unwrap_err();
        assert!(err.is_lost(), "{err}");

        // The supervisor outlives the worker: it still reads as running (its own pid is
        // recorded, not the worker's), and it records how the command ended.
        let status = exec.status(&id).await.unwrap();
        assert_eq!(status.state, MarkerState::Running, "{status:?}");
        let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
        let report = loop {
            let status = exec.status(&id).await.unwrap();
            if status.state.is_finished() {
                break exec.wait(&id, None).await.unwrap();
            }
            assert!(tokio::time::Instant::now() < deadline, "{status:?}");
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        assert_eq!(report.status.state, MarkerState::Completed);
        assert_eq!(report.stdout.inline(), Some(&b"finished\n"[..]));
        assert_eq!(host_file_lines(&sshd, "counter"), vec!["ran".to_string()]);

        // The killed worker could not remove its stderr file; gc does.
        let leftover = sshd
            .remote_dir()
            .join("exec")
            .join(format!(".serve.{}", workers[0]));
        assert!(leftover.exists(), "{leftover:?}");
        exec.gc(Duration::from_secs(3600)).await.unwrap();
        assert!(!leftover.exists(), "{leftover:?}");
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_channel_whose_worker_died_is_never_sent_a_request() {
    let sshd = TestSshd::new();
    let exec = Executor::new(config(&sshd)).unwrap();
    within(60, "dead idle worker", async {
        ran(exec.dispatch(&sh("true"), |_| {}).await.unwrap());
        assert_eq!(exec.idle_serve_count(), 1);
        let workers = serve_workers(&sshd);
        assert_eq!(workers.len(), 1);
        kill(workers[0]);
        // Idle past a second, the channel is checked with a ping before a request leaves on
        // it, and the ping's answer comes after the channel's end: the next call sees it.
        tokio::time::sleep(Duration::from_millis(1200)).await;
        let report = ran(exec.dispatch(&sh("echo after"), |_| {}).await.unwrap());
        assert_eq!(report.stdout.inline(), Some(&b"after\n"[..]));
        let now = serve_workers(&sshd);
        assert_eq!(now.len(), 1);
        assert_ne!(now, workers, "a new worker");
    })
    .await;
}
