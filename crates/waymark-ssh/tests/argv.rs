//! Arbitrary arguments go through the login shell, the wrapper and back byte for byte: no
//! argument ever becomes shell syntax.

mod common;

use std::time::Duration;

use common::{config, new_id, ran};
use proptest::prelude::*;
use proptest::test_runner::TestRunner;
use waymark_ssh::{DispatchRequest, Executor};
use waymark_testkit::TestSshd;

/// Strings heavy in what shells care about, plus arbitrary Unicode. No NUL: no command line
/// can carry one (the wrapper module refuses it before sending).
fn nasty_arg() -> impl Strategy<Value = String> {
    let pieces = prop::sample::select(vec![
        "'", "\"", "\\", "$", "$(id)", "`id`", ";", "&&", "|", "*", "?", "[a]", "~", "\n", "\t",
        " ", "-", "--", "#", "!", "{a,b}", ">", "<", "%s", "\\n", "é", "日本", "🦀", "\u{7f}",
        "\u{1}",
    ]);
    prop_oneof![
        prop::collection::vec(pieces, 0..6).prop_map(|p| p.concat()),
        any::<String>().prop_map(|s| s.replace('\0', "")),
    ]
}

#[test]
fn arbitrary_arguments_come_back_byte_for_byte() {
    // One sshd and one pool for every case; all dropped (sshd stopped) at the end.
    let sshd = TestSshd::new();
    let exec = Executor::new(config(&sshd)).unwrap();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let mut runner = TestRunner::new(ProptestConfig {
        cases: 32,
        failure_persistence: None,
        ..ProptestConfig::default()
    });
    let strategy = prop::collection::vec(nasty_arg(), 1..6);
    let result = runner.run(&strategy, |args| {
        // printf's format is fixed; every argument is only ever a %s value.
        let mut argv = vec!["printf".to_string(), "%s\\0".to_string()];
        argv.extend(args.iter().cloned());
        let request = DispatchRequest {
            execution_id: new_id(),
            argv,
            ..Default::default()
        };
        let outcome = runtime.block_on(async {
            tokio::time::timeout(Duration::from_secs(20), exec.dispatch(&request, |_| {}))
                .await
                .expect("dispatch within 20 s")
                .expect("dispatch")
        });
        let report = ran(outcome);
        prop_assert_eq!(
            report.status.exit_code,
            Some(0),
            "stderr: {:?}",
            report.stderr
        );
        let mut expected = Vec::new();
        for a in &args {
            expected.extend_from_slice(a.as_bytes());
            expected.push(0);
        }
        prop_assert_eq!(report.stdout.inline().expect("inline"), &expected[..]);
        Ok(())
    });
    if let Err(e) = result {
        panic!("{e}");
    }
}
