//! Behaviour of the helpers: ports, tools, shells, bounded child processes.

use std::net::{Ipv4Addr, TcpListener};
use std::process::Command;
use std::time::{Duration, Instant};

use waymark_testkit::{find_tool, free_port, output_within, require_tool, which_shells};

#[test]
fn free_port_can_be_bound() {
    let port = free_port();
    assert_ne!(port, 0);
    TcpListener::bind((Ipv4Addr::LOCALHOST, port)).expect("the port was just free");
}

#[test]
fn find_tool_looks_beyond_path_into_sbin() {
    let sshd = find_tool("sshd").expect("sshd is installed on test machines");
    assert!(sshd.is_absolute(), "{}", sshd.display());
    assert_eq!(find_tool(sshd.to_str().unwrap()), Some(sshd));
    assert_eq!(find_tool("waymark-no-such-tool"), None);
}

#[test]
#[should_panic(expected = "`waymark-no-such-tool` not found (searched PATH and")]
fn require_tool_panics_with_what_to_do() {
    require_tool(
        "waymark-no-such-tool",
        "apt-get install waymark-no-such-tool",
    );
}

#[test]
fn which_shells_finds_dash_bash_and_busybox_and_each_runs_posix_sh() {
    let shells = which_shells();
    let names: Vec<&str> = shells.iter().map(|s| s.name).collect();
    assert_eq!(
        names,
        ["dash", "bash", "busybox"],
        "the wrapper is tested under all three: apt-get install dash bash busybox"
    );
    for shell in &shells {
        let out = output_within(
            shell.command().args(["-c", "x=$((20 + 22)); echo \"$x\""]),
            Duration::from_secs(5),
        );
        assert_eq!(
            String::from_utf8_lossy(&out.stdout),
            "42\n",
            "{}",
            shell.name
        );
    }
}

#[test]
fn output_within_returns_what_the_command_printed() {
    let out = output_within(
        Command::new("sh").args(["-c", "echo out; echo err >&2; exit 3"]),
        Duration::from_secs(5),
    );
    assert_eq!(out.status.code(), Some(3));
    assert_eq!(out.stdout, b"out\n");
    assert_eq!(out.stderr, b"err\n");
}

#[test]
fn output_within_kills_a_command_that_overruns() {
    let start = Instant::now();
    let result = std::panic::catch_unwind(|| {
        output_within(
            Command::new("sh").args(["-c", "echo partial; exec sleep 30"]),
            Duration::from_millis(300),
        )
    });
    let message = *result
        .expect_err("must panic")
        .downcast::<String>()
        .unwrap();
    assert!(message.contains("did not finish within"), "{message}");
    assert!(message.contains("partial"), "{message}");
    assert!(start.elapsed() < Duration::from_secs(10));
}
