//! `key=@prompt`: the CLI asks for a secret on its controlling terminal (a real pseudo-terminal
//! here) with echo off, restores the terminal, and the host receives the typed value.

mod common;

use std::io::{Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::process::Stdio;
use std::time::{Duration, Instant};

use common::{stdout, Env};

const STORE_TOOL: &str = r#"
[tools.store_secret]
description = "Writes its secret to the counter file."
hosts = ["h1"]
argv = ["sh", "-c", "printf '%s' \"$1\" > {counter}; echo stored", "x", "{token}"]
contract = "idempotent"

[tools.store_secret.args.token]
type = "string"
secret = true
"#;

fn echo_on(fd: i32) -> bool {
    // SAFETY: a zeroed termios is a valid buffer for tcgetattr; fd is an open terminal.
    let mut term: libc::termios = unsafe { std::mem::zeroed() };
    assert_eq!(unsafe { libc::tcgetattr(fd, &mut term) }, 0);
    term.c_lflag & libc::ECHO != 0
}

#[test]
fn a_secret_typed_at_the_prompt_is_not_echoed_and_reaches_the_host() {
    let env = Env::builder().tools(STORE_TOOL).build();
    let (mut master, mut slave) = (-1, -1);
    // SAFETY: openpty fills two fds; the name, termios and winsize arguments may be null.
    let rc = unsafe {
        libc::openpty(
            &mut master,
            &mut slave,
            std::ptr::null_mut(),
            std::ptr::null(),
            std::ptr::null(),
        )
    };
    assert_eq!(rc, 0, "openpty: {}", std::io::Error::last_os_error());
    // SAFETY: openpty returned these fds and nothing else owns them.
    let (master, slave) = unsafe { (OwnedFd::from_raw_fd(master), OwnedFd::from_raw_fd(slave)) };
    assert!(echo_on(slave.as_raw_fd()), "a new pty echoes");
    let slave_fd = slave.as_raw_fd();
    let mut cmd = env.cmd();
    cmd.args(["exec", "run", "store_secret", "token=@prompt"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    // SAFETY: only async-signal-safe calls between fork and exec: a new session whose
    // controlling terminal is the pty, so /dev/tty is it.
    unsafe {
        cmd.pre_exec(move || {
            if libc::setsid() < 0 || libc::ioctl(slave_fd, libc::TIOCSCTTY, 0) < 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let child = cmd.spawn().unwrap();
    let mut terminal = std::fs::File::from(master);
    let mut seen = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(30);
    // The prompt names the argument; answer once it is there.
    while !String::from_utf8_lossy(&seen).contains("token: ") {
        assert!(
            Instant::now() < deadline,
            "no prompt on the terminal: {seen:?}"
        );
        let mut buf = [0u8; 256];
        let n = terminal.read(&mut buf).unwrap();
        seen.extend_from_slice(&buf[..n]);
    }
    assert!(!echo_on(slave_fd), "echo is off while the secret is typed");
    terminal.write_all(b"typed-s3cret-42\n").unwrap();
    let out = child.wait_with_output().unwrap();
    // What the terminal showed after the answer: a newline, never the secret.
    // SAFETY: fd is the open master; O_NONBLOCK so a read finds only what is there.
    unsafe { libc::fcntl(terminal.as_raw_fd(), libc::F_SETFL, libc::O_NONBLOCK) };
    let mut rest = [0u8; 4096];
    if let Ok(n) = terminal.read(&mut rest) {
        seen.extend_from_slice(&rest[..n]);
    }
    let shown = String::from_utf8_lossy(&seen);
    assert!(
        !shown.contains("typed-s3cret-42"),
        "the terminal echoed the secret: {shown:?}"
    );
    assert!(echo_on(slave_fd), "the terminal's echo is restored");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout(&out).contains("stored"), "{}", stdout(&out));
    assert_eq!(
        std::fs::read_to_string(&env.counter).unwrap(),
        "typed-s3cret-42"
    );
    drop(slave);
}

/// `retitle`: prints a terminal title change, a clear screen, then `hello` (read_only, so
/// every call runs).
const RETITLE_TOOL: &str = r#"
[tools.retitle]
description = "Prints terminal control sequences."
hosts = ["h1"]
argv = ["printf", "\\033]0;pwned\\007\\033[2Jhello\\n"]
contract = "read_only"
"#;

/// Runs `waymark ARGS` with its stdout on a new pseudo-terminal; returns what the terminal got.
fn on_a_terminal(env: &Env, args: &[&str]) -> String {
    let (mut master, mut slave) = (-1, -1);
    // SAFETY: openpty fills two fds; the name, termios and winsize arguments may be null.
    let rc = unsafe {
        libc::openpty(
            &mut master,
            &mut slave,
            std::ptr::null_mut(),
            std::ptr::null(),
            std::ptr::null(),
        )
    };
    assert_eq!(rc, 0, "openpty: {}", std::io::Error::last_os_error());
    // SAFETY: openpty returned these fds and nothing else owns them.
    let (master, slave) = unsafe { (OwnedFd::from_raw_fd(master), OwnedFd::from_raw_fd(slave)) };
    let mut cmd = env.cmd();
    cmd.args(args)
        .stdout(Stdio::from(slave))
        .stderr(Stdio::piped());
    let child = cmd.spawn().unwrap();
    // The command held the last copy of the slave here: once the child exits, the master
    // reads what is left, then EIO.
    drop(cmd);
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mut terminal = std::fs::File::from(master);
    let mut seen = Vec::new();
    let mut buf = [0u8; 4096];
    while let Ok(n @ 1..) = terminal.read(&mut buf) {
        seen.extend_from_slice(&buf[..n]);
    }
    String::from_utf8_lossy(&seen).into_owned()
}

/// A command's output that would drive the operator's terminal (a title change, a screen
/// clear) reaches a terminal escaped; `--raw-control-chars` passes it as it is (`less -R`), and
/// a pipe always gets the bytes the command wrote.
#[test]
fn control_sequences_in_output_reach_a_terminal_escaped_unless_asked_raw() {
    let env = Env::builder().tools(RETITLE_TOOL).build();
    let _daemon = env.start_daemon();
    let escaped = on_a_terminal(&env, &["exec", "run", "retitle"]);
    assert!(escaped.contains("^[]0;pwned^G^[[2Jhello"), "{escaped:?}");
    assert!(!escaped.contains('\u{1b}'), "{escaped:?}");
    let raw = on_a_terminal(&env, &["--raw-control-chars", "exec", "run", "retitle"]);
    assert!(raw.contains("\u{1b}]0;pwned\u{7}\u{1b}[2Jhello"), "{raw:?}");
    let piped = env.run(&["exec", "run", "retitle"]);
    assert_eq!(stdout(&piped), "\u{1b}]0;pwned\u{7}\u{1b}[2Jhello\n");
}
