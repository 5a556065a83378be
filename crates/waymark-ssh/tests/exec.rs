//! The executor against a real OpenSSH sshd: outputs, exit codes, big and binary output,
//! long commands, pooling under MaxSessions.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{argv, config, new_id, ran, sh, within};
use waymark_ssh::wrapper::{InlineOutput, MarkerState, Stream};
use waymark_ssh::{DispatchEvent, DispatchOutcome, DispatchRequest, Error, Executor};
use waymark_testkit::{SshdOptions, TestSshd};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn echo_comes_back_inline_with_exit_code_zero() {
    let sshd = TestSshd::new();
    let exec = Executor::new(config(&sshd)).unwrap();
    within(30, "echo", async {
        let mut events = Vec::new();
        let request = DispatchRequest {
            execution_id: new_id(),
            argv: argv(&["echo", "hello", "world"]),
            ..Default::default()
        };
        let report = ran(exec
            .dispatch(&request, |e| events.push(e.clone()))
            .await
            .unwrap());
        assert_eq!(report.status.state, MarkerState::Completed);
        assert_eq!(report.status.exit_code, Some(0));
        assert_eq!(
            report.stdout,
            InlineOutput::Inline(b"hello world\n".to_vec())
        );
        assert_eq!(report.stderr, InlineOutput::Inline(Vec::new()));
        assert_eq!(
            events,
            vec![
                DispatchEvent::Sending,
                DispatchEvent::Accepted,
                DispatchEvent::Completed
            ]
        );
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exit_codes_stderr_cwd_env_and_stdin_reach_the_report() {
    let sshd = TestSshd::new();
    let exec = Executor::new(config(&sshd)).unwrap();
    within(30, "exit codes", async {
        for code in [1, 2, 7, 126, 255] {
            let report = ran(exec
                .dispatch(&sh(&format!("echo oops >&2; exit {code}")), |_| {})
                .await
                .unwrap());
            assert_eq!(report.status.state, MarkerState::Completed);
            assert_eq!(report.status.exit_code, Some(code), "exit {code}");
            assert_eq!(report.stderr.inline(), Some(&b"oops\n"[..]));
            assert_eq!(report.stdout.inline(), Some(&b""[..]));
        }

        let killed = ran(exec.dispatch(&sh("kill -TERM $$"), |_| {}).await.unwrap());
        assert_eq!(killed.status.signal, Some(15));
        assert_eq!(killed.status.exit_code, None);

        let home = sshd.remote_home();
        let request = DispatchRequest {
            execution_id: new_id(),
            argv: argv(&["sh", "-c", "pwd; echo \"$GREETING\"; cat"]),
            cwd: Some(home.display().to_string()),
            env: vec![("GREETING".into(), "hi there; $(not run)".into())],
            stdin: Some(b"from stdin\n\x00\xff".to_vec()),
            ..Default::default()
        };
        let report = ran(exec.dispatch(&request, |_| {}).await.unwrap());
        let mut expected = format!("{}\nhi there; $(not run)\n", home.display()).into_bytes();
        expected.extend_from_slice(b"from stdin\n\x00\xff");
        assert_eq!(report.stdout.inline(), Some(&expected[..]));
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_mib_of_binary_output_is_fetched_by_offset() {
    let sshd = TestSshd::new();
    let exec = Executor::new(config(&sshd)).unwrap();
    within(60, "10 MiB", async {
        // 10 MiB + 123 bytes of every byte value, on stdout; 70 KiB on stderr.
        let script = "i=0; while [ $i -lt 40 ]; do cat \"$HOME/block\"; i=$((i+1)); done; \
                      head -c 123 \"$HOME/block\"; head -c 71680 /dev/zero >&2";
        let block: Vec<u8> = (0..256 * 1024).map(|i| (i % 256) as u8).collect();
        std::fs::write(sshd.remote_home().join("block"), &block).unwrap();
        let request = sh(script);
        let report = ran(exec.dispatch(&request, |_| {}).await.unwrap());
        assert_eq!(report.status.exit_code, Some(0));
        let expected_len = 40 * block.len() as u64 + 123;
        assert_eq!(report.status.stdout_bytes, expected_len);
        assert_eq!(report.stdout, InlineOutput::Fetch { size: expected_len });
        assert_eq!(report.stderr, InlineOutput::Fetch { size: 71680 });

        let started = Instant::now();
        let stdout = exec
            .read_stream(&request.execution_id, Stream::Stdout, 1024 * 1024)
            .await
            .unwrap();
        eprintln!("fetched {} bytes in {:?}", stdout.len(), started.elapsed());
        assert_eq!(stdout.len() as u64, expected_len);
        for (i, chunk) in stdout.chunks(block.len()).enumerate() {
            assert_eq!(chunk, &block[..chunk.len()], "block {i} differs");
        }
        let stderr = exec
            .read_stream(&request.execution_id, Stream::Stderr, 0)
            .await
            .unwrap();
        assert_eq!(stderr, vec![0u8; 71680]);

        // An odd offset in the middle of the stream.
        let piece = exec
            .output(&request.execution_id, Stream::Stdout, 1_000_001, 10)
            .await
            .unwrap();
        assert_eq!(
            piece.data,
            block[(1_000_001 % block.len())..][..10].to_vec()
        );
        assert!(piece.finished);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_command_is_waited_for_and_status_tracks_it() {
    let sshd = TestSshd::new();
    let exec = Arc::new(Executor::new(config(&sshd)).unwrap());
    within(30, "long command", async {
        let request = sh("sleep 2; echo slept");
        let id = request.execution_id.clone();
        let started = Instant::now();
        let running = {
            let exec = exec.clone();
            tokio::spawn(async move { exec.dispatch(&request, |_| {}).await })
        };
        // While it runs, status (on another channel) says so.
        let mut seen_running = false;
        while !running.is_finished() {
            if exec.status(&id).await.unwrap().state == MarkerState::Running {
                seen_running = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let report = ran(running.await.unwrap().unwrap());
        assert!(seen_running, "status never said running");
        assert!(started.elapsed() >= Duration::from_secs(2));
        assert_eq!(report.stdout.inline(), Some(&b"slept\n"[..]));
        let status = exec.status(&id).await.unwrap();
        assert_eq!(status.state, MarkerState::Completed);
        assert!(status.finished_ms.is_some());
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn host_side_timeout_and_cancel_end_the_command() {
    let sshd = TestSshd::new();
    let exec = Arc::new(Executor::new(config(&sshd)).unwrap());
    within(40, "timeout and cancel", async {
        let mut request = sh("sleep 30");
        request.timeout = Some(Duration::from_secs(1));
        let report = ran(exec.dispatch(&request, |_| {}).await.unwrap());
        assert_eq!(report.status.state, MarkerState::TimedOut);

        let request = sh("echo started; sleep 30");
        let id = request.execution_id.clone();
        let running = {
            let exec = exec.clone();
            tokio::spawn(async move { exec.dispatch(&request, |_| {}).await })
        };
        common::eventually(10, "running", || !running.is_finished()).await;
        loop {
            if exec.status(&id).await.unwrap().state == MarkerState::Running {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let status = exec
            .cancel(&id, Some(Duration::from_secs(1)))
            .await
            .unwrap();
        assert_eq!(status.state, MarkerState::Cancelled);
        let report = ran(running.await.unwrap().unwrap());
        assert_eq!(report.status.state, MarkerState::Cancelled);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_ids_and_bad_requests_are_told_apart() {
    let sshd = TestSshd::new();
    let exec = Executor::new(config(&sshd)).unwrap();
    within(30, "unknown ids", async {
        let id = new_id();
        let status = exec.status(&id).await.unwrap();
        assert_eq!(status.state, MarkerState::Absent);
        let err = exec.wait(&id, None).await.unwrap_err();
        assert!(
            matches!(err, Error::UnknownExecution { .. }),
            "wait on an unknown id: {err}"
        );
        let err = exec.output(&id, Stream::Stdout, 0, 10).await.unwrap_err();
        assert!(matches!(err, Error::UnknownExecution { .. }), "{err}");

        let mut request = sh("true");
        request.execution_id = "act_not-an-id".into();
        let err = exec.dispatch(&request, |_| {}).await.unwrap_err();
        assert!(matches!(err, Error::InvalidRequest { .. }), "{err}");
        assert!(err.is_not_sent());
        let mut request = sh("true");
        request.argv = vec!["echo".into(), "nul\0byte".into()];
        assert!(exec
            .dispatch(&request, |_| {})
            .await
            .unwrap_err()
            .is_not_sent());

        // gc removes finished markers only once they are old enough.
        let done = sh("true");
        ran(exec.dispatch(&done, |_| {}).await.unwrap());
        assert!(exec
            .gc(Duration::from_secs(3600))
            .await
            .unwrap()
            .removed
            .is_empty());
        let removed = exec.gc(Duration::ZERO).await.unwrap().removed;
        assert!(removed.contains(&done.execution_id), "{removed:?}");
        assert_eq!(
            exec.status(&done.execution_id).await.unwrap().state,
            MarkerState::Absent
        );
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_wrapper_is_installed_once_and_reinstalled_if_removed() {
    let sshd = TestSshd::new();
    let exec = Executor::new(config(&sshd)).unwrap();
    within(30, "install", async {
        exec.connect().await.unwrap();
        let bin = sshd.remote_dir().join("bin");
        let installed: Vec<_> = std::fs::read_dir(&bin).unwrap().collect();
        assert_eq!(installed.len(), 1, "one wrapper file in {}", bin.display());
        let path = installed.into_iter().next().unwrap().unwrap().path();
        std::fs::remove_file(&path).unwrap();
        // The pooled connection believes it is installed; the exit 69 path reinstalls.
        let report = ran(exec.dispatch(&sh("echo again"), |_| {}).await.unwrap());
        assert_eq!(report.stdout.inline(), Some(&b"again\n"[..]));
        assert!(path.exists());
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifty_concurrent_commands_share_pooled_connections_under_max_sessions() {
    let sshd = TestSshd::with_options(SshdOptions::default().max_sessions(10));
    let exec = Arc::new(Executor::new(config(&sshd)).unwrap());
    within(60, "50 concurrent", async {
        let mut tasks = Vec::new();
        for i in 0..50 {
            let exec = exec.clone();
            tasks.push(tokio::spawn(async move {
                let request = sh(&format!(
                    "sleep 0.5; echo {i}; echo err{i} >&2; exit {}",
                    i % 5
                ));
                let report = ran(exec.dispatch(&request, |_| {}).await.unwrap());
                (i, report)
            }));
        }
        for task in tasks {
            let (i, report) = task.await.unwrap();
            assert_eq!(report.status.exit_code, Some(i % 5));
            assert_eq!(report.stdout.inline(), Some(format!("{i}\n").as_bytes()));
            assert_eq!(report.stderr.inline(), Some(format!("err{i}\n").as_bytes()));
        }
        let connections = exec.connection_count();
        assert!(
            (5..=8).contains(&connections),
            "50 commands at 10 per connection should need 5 connections, have {connections}"
        );
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn closing_surplus_serve_channels_never_teaches_the_pool_a_lower_limit() {
    // Our limit is the server's. Each round returns 4 serve channels where 2 stay idle: the
    // other 2 close while the next round opens channels at once. sshd counts a session until
    // its worker has exited, so a slot reused before the host's close would be refused and
    // the pool would take the server for one allowing fewer.
    let sshd = TestSshd::with_options(SshdOptions::default().max_sessions(4));
    let mut config = config(&sshd);
    config.max_sessions = 4;
    let exec = Arc::new(Executor::new(config).unwrap());
    within(60, "rounds of serve channels", async {
        for round in 0..12 {
            let mut tasks = Vec::new();
            for _ in 0..4 {
                let exec = exec.clone();
                tasks.push(tokio::spawn(async move {
                    ran(exec.dispatch(&sh("true"), |_| {}).await.unwrap())
                }));
            }
            for task in tasks {
                assert_eq!(
                    task.await.unwrap().status.exit_code,
                    Some(0),
                    "round {round}"
                );
            }
            let limits = exec.channel_limits();
            assert!(
                limits.iter().all(|l| *l == 4),
                "round {round}: the pool learned limits {limits:?} from a server allowing 4"
            );
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_exec_verb_on_a_connection_full_of_serve_channels_closes_one_and_needs_no_new_connection(
) {
    let sshd = TestSshd::with_options(SshdOptions::default().max_sessions(4));
    let mut config = config(&sshd);
    config.max_sessions = 4;
    let exec = Arc::new(Executor::new(config).unwrap());
    let dir = tempfile::tempdir().unwrap();
    within(60, "an exec verb beside serve channels", async {
        // Four calls at once, each until its gate opens: all four slots hold serve channels.
        let mut calls = Vec::new();
        for i in 0..4 {
            let gate = dir.path().join(format!("gate{i}"));
            // Gives up once the temp dir is gone: a test that dies first leaves no loop.
            let request = sh(&format!(
                "while [ ! -e '{}' ]; do [ -d '{}' ] || exit 8; sleep 0.05; done; echo {i}",
                gate.display(),
                dir.path().display()
            ));
            let id = request.execution_id.clone();
            let exec = exec.clone();
            let task =
                tokio::spawn(async move { ran(exec.dispatch(&request, |_| {}).await.unwrap()) });
            calls.push((gate, id, task));
        }
        let (gate, first, task) = calls.remove(0);
        std::fs::write(&gate, b"").unwrap();
        assert_eq!(task.await.unwrap().stdout.inline(), Some(&b"0\n"[..]));
        // Three calls and one idle serve channel: the connection is full.
        assert_eq!(exec.idle_serve_count(), 1);
        assert_eq!(exec.connection_count(), 1);
        // An exec verb (`wait` is never served) closes the idle serve channel and takes its
        // slot.
        let report = exec.wait(&first, None).await.unwrap();
        assert_eq!(report.stdout.inline(), Some(&b"0\n"[..]));
        assert_eq!(
            exec.connection_count(),
            1,
            "the exec verb opened a connection"
        );
        assert_eq!(exec.idle_serve_count(), 0);
        for (gate, _, task) in calls {
            std::fs::write(&gate, b"").unwrap();
            task.await.unwrap();
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_refusing_channels_below_our_limit_gets_more_connections() {
    // sshd allows 3 sessions per connection; the config believes 10.
    let sshd = TestSshd::with_options(SshdOptions::default().max_sessions(3));
    let mut config = config(&sshd);
    config.max_sessions = 10;
    let exec = Arc::new(Executor::new(config).unwrap());
    within(60, "refused channels", async {
        let mut tasks = Vec::new();
        let mut ids = Vec::new();
        for i in 0..12 {
            let exec = exec.clone();
            let request = sh(&format!("sleep 0.5; echo {i}"));
            ids.push(request.execution_id.clone());
            tasks.push(tokio::spawn(async move {
                exec.dispatch(&request, |_| {}).await
            }));
        }
        for (i, task) in tasks.into_iter().enumerate() {
            let outcome = task
                .await
                .unwrap()
                .unwrap_or_else(|e| panic!("command {i}: {e}"));
            let DispatchOutcome::Completed(report) = outcome else {
                panic!("command {i} was refused");
            };
            assert_eq!(report.stdout.inline(), Some(format!("{i}\n").as_bytes()));
        }
        // One connection holds 3; the rest needed at least one more.
        assert!(
            exec.connection_count() >= 2,
            "connections: {}",
            exec.connection_count()
        );
        // Idle serve channels keep all but one of the slots each connection is known to have
        // (what the server's refusals showed, else max_sessions). A connection never refused
        // may so hold all the server's slots idle: a verb that needs an exec channel then
        // closes one rather than open a connection.
        let connections = exec.connection_count();
        let known: usize = exec.channel_limits().iter().map(|l| l - 1).sum();
        assert!(
            exec.idle_serve_count() <= known,
            "{} idle serve channels where the known limits {:?} allow {known}",
            exec.idle_serve_count(),
            exec.channel_limits()
        );
        let chunk = exec.output(&ids[0], Stream::Stdout, 0, 100).await.unwrap();
        assert_eq!(chunk.data, b"0\n");
        assert_eq!(exec.connection_count(), connections);
    })
    .await;
}
