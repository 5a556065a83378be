//! Crash safety on both backends: a child process (a daemon, as far as the ledger knows)
//! makes flushed transitions in a loop and is killed with SIGKILL at random moments. Every
//! transition it acknowledged must survive, and the chain must verify.

#[path = "../../waymark-ledger/tests/common/mod.rs"]
mod common;
#[path = "common/backends.rs"]
#[macro_use]
mod backends;

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use backends::{open_address, Kind, Place};
use common::{new_execution, now, request};
use rand::{Rng, SeedableRng};
use waymark_core::{ExecutionId, Outcome, Transition};
use waymark_ledger::{CapturedOutput, Durability, Intake, StoredResult};

const CHILD_ENV: &str = "WAYMARK_LEDGER_CRASH_CHILD";

both!(sigkill_never_loses_an_acknowledged_transition);

/// The child's body: runs only when the parent test re-executes this binary with CHILD_ENV.
#[tokio::test]
async fn crash_child_entry() {
    let Ok(address) = std::env::var(CHILD_ENV) else {
        return;
    };
    let ledger = open_address(&address, "child").await;
    let out = std::io::stdout();
    let ack = |id: ExecutionId, seq: u64| {
        let mut o = out.lock();
        writeln!(o, "ACK {id} {seq}").unwrap();
        o.flush().unwrap();
    };
    let mut i = 0u64;
    loop {
        let t = now();
        let new = new_execution(
            ledger.as_ref(),
            &request("deploy", &format!("crash-{}-{i}", std::process::id()), "pw"),
            "web1",
            t,
        );
        let id = new.id;
        let call = waymark_core::IncomingCall {
            actor: new.actor.clone(),
            scope: new.scope.clone(),
            policy: waymark_core::ReplayPolicy::new(
                waymark_core::ReplayContract::StatusCheck,
                Duration::from_secs(600),
            ),
            now: t,
        };
        let Intake::New(rec) = ledger
            .accept_or_attach(new, &call, Durability::Flushed)
            .await
            .unwrap()
        else {
            panic!("every intent of the child is new");
        };
        ack(id, rec.last_seq);
        let steps = [
            Transition::Authorize {
                by: "policy".into(),
            },
            Transition::Dispatch { attempt: 1 },
            Transition::Started { pid: Some(1) },
        ];
        for s in steps {
            let rec = ledger
                .transition(id, s, t, Durability::Flushed)
                .await
                .unwrap();
            ack(id, rec.last_seq);
        }
        let result = StoredResult {
            stdout: CapturedOutput::capture(format!("output {i}\n").as_bytes(), 4096),
            stderr: CapturedOutput::capture(b"", 4096),
        };
        let done = Transition::Finished {
            outcome: Outcome::Exited {
                exit_code: Some(0),
                signal: None,
            },
        };
        let rec = ledger
            .transition_with_result(id, done, result, t, Durability::Flushed)
            .await
            .unwrap();
        ack(id, rec.last_seq);
        i += 1;
    }
}

async fn sigkill_never_loses_an_acknowledged_transition(kind: Kind) {
    let seed: u64 = std::env::var("WAYMARK_CRASH_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| rand::thread_rng().gen());
    eprintln!("crash test seed: {seed} (set WAYMARK_CRASH_SEED to replay)");
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let place = Place::new(kind, "crash");
    let address = place.address();
    let rounds: usize = std::env::var("WAYMARK_CRASH_ROUNDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(12);
    let mut acked: HashMap<ExecutionId, u64> = HashMap::new();
    let mut total_acks = 0;
    for round in 0..rounds {
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args([
                "crash_child_entry",
                "--exact",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(CHILD_ENV, &address)
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let stdout = child.stdout.take().unwrap();
        let (tx, rx) = mpsc::channel();
        let reader = std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if let Some(rest) = line.strip_prefix("ACK ") {
                    let (id, seq) = rest.split_once(' ').unwrap();
                    let _ = tx.send((
                        id.parse::<ExecutionId>().unwrap(),
                        seq.parse::<u64>().unwrap(),
                    ));
                }
            }
        });
        // Wait for the child to start acknowledging, then kill it at a random moment.
        let first = rx
            .recv_timeout(Duration::from_secs(30))
            .expect("child acknowledged nothing in 30 s");
        let mut round_acks = vec![first];
        let kill_after = Duration::from_millis(rng.gen_range(1..250));
        let start = Instant::now();
        while start.elapsed() < kill_after {
            if let Ok(a) = rx.recv_timeout(Duration::from_millis(1)) {
                round_acks.push(a);
            }
        }
        child.kill().unwrap(); // SIGKILL
        child.wait().unwrap();
        reader.join().unwrap();
        round_acks.extend(rx.try_iter());
        total_acks += round_acks.len();
        for (id, seq) in round_acks {
            let e = acked.entry(id).or_insert(0);
            *e = (*e).max(seq);
        }
        let ledger = place.open("parent").await;
        for (id, seq) in &acked {
            let rec = ledger.get(*id).await.unwrap().unwrap_or_else(|| {
                panic!("round {round}, seed {seed}: acknowledged {id} is missing")
            });
            assert!(
                rec.last_seq >= *seq,
                "round {round}, seed {seed}: {id} acknowledged through event {seq}, ledger has {}",
                rec.last_seq
            );
        }
        let report = ledger.verify(None).await.unwrap();
        assert!(
            report.is_ok(),
            "round {round}, seed {seed}: {:?}",
            report.broken
        );
    }
    eprintln!("{rounds} rounds, {total_acks} acknowledged transitions, all present");
    assert!(total_acks > rounds, "the child must have made progress");
}
