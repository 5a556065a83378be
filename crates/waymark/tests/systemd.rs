//! The systemd units in `examples/systemd/`: they verify with systemd's own checker, and the
//! daemon serves on a socket passed by real socket activation (`systemd-socket-activate`), so
//! a CLI call never starts a daemon of its own while systemd owns the socket.

mod common;

use std::process::{Command, Stdio};
use std::time::Duration;

use common::{bin, stdout, wait_for, Env};
use waymark_testkit::{output_within, require_tool};

const SYSTEMD_HINT: &str = "install it (apt-get install systemd)";

fn units_dir() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples/systemd")
}

#[test]
fn the_example_units_pass_systemd_analyze_verify() {
    let analyze = require_tool("systemd-analyze", SYSTEMD_HINT);
    // The user units and the system-wide ones (daemon as its own user, a group socket).
    for (dir, installed) in [
        (units_dir(), "%h/.cargo/bin/waymark"),
        (units_dir().join("system"), "/usr/local/bin/waymark"),
    ] {
        let copy = tempfile::tempdir().unwrap();
        for unit in ["waymark.service", "waymark.socket"] {
            // The unit names the installed binary; verify checks that ExecStart exists, so
            // point it at the binary under test.
            let text = std::fs::read_to_string(dir.join(unit)).unwrap();
            assert!(
                unit != "waymark.service" || text.contains(installed),
                "{unit} in {dir:?} no longer names {installed}"
            );
            std::fs::write(copy.path().join(unit), text.replace(installed, bin())).unwrap();
        }
        for unit in ["waymark.service", "waymark.socket"] {
            let out = output_within(
                Command::new(&analyze)
                    .arg("verify")
                    .arg(copy.path().join(unit))
                    .env("SYSTEMD_LOG_LEVEL", "warning"),
                Duration::from_secs(60),
            );
            let err = String::from_utf8_lossy(&out.stderr);
            assert!(
                out.status.success(),
                "{unit} in {dir:?}: systemd-analyze verify failed:\n{err}"
            );
            for bad in ["Unknown key", "Unknown section", "ignoring", "Invalid"] {
                assert!(!err.contains(bad), "{unit} in {dir:?}: {err}");
            }
        }
    }
    let system = std::fs::read_to_string(units_dir().join("system/waymark.service")).unwrap();
    for key in ["User=waymark", "StateDirectory=", "RuntimeDirectory="] {
        assert!(system.contains(key), "the system service lacks {key}");
    }
    let socket = std::fs::read_to_string(units_dir().join("system/waymark.socket")).unwrap();
    assert!(socket.contains("SocketGroup=") && socket.contains("SocketMode=0660"));
}

/// `systemd-socket-activate -l SOCKET waymark daemon`: systemd's own tool listens on `socket`
/// and starts the daemon on the first connection, passing the socket as systemd does.
fn activated_daemon(env: &Env, socket: &std::path::Path, stderr: Stdio) -> std::process::Child {
    let activate = require_tool("systemd-socket-activate", SYSTEMD_HINT);
    Command::new(activate)
        .arg("-l")
        .arg(socket)
        .arg(bin())
        .arg("--config")
        .arg(&env.config)
        .arg("daemon")
        .env("WAYMARK_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(stderr)
        .spawn()
        .unwrap()
}

#[test]
fn a_socket_activated_daemon_serves_and_leaves_the_socket_to_systemd() {
    let env = Env::builder().raw_commands().build();
    let socket = env.socket();
    std::fs::create_dir_all(socket.parent().unwrap()).unwrap();
    let mut activator = activated_daemon(&env, &socket, Stdio::inherit());
    wait_for(
        || socket.exists(),
        "the activator's socket",
        Duration::from_secs(20),
    );

    // The first connection starts the daemon in the activator's process (exec).
    let out = env.run(&["exec", "run", "--host", "h1", "--", "echo", "activated"]);
    assert!(out.status.success());
    assert_eq!(stdout(&out).trim(), "activated");
    assert_eq!(
        env.daemon_pid(),
        activator.id(),
        "the socket-activated daemon answered"
    );
    assert_eq!(
        env.daemons(),
        vec![activator.id()],
        "no CLI started a daemon of its own"
    );

    // Stopped as systemd stops it: a clean exit, and the socket stays (systemd's to keep).
    unsafe { libc::kill(activator.id() as i32, libc::SIGTERM) };
    let status = waymark_testkit::wait_within(&mut activator, Duration::from_secs(20))
        .expect("the daemon stops on SIGTERM");
    assert!(status.success(), "{status}");
    assert!(
        socket.exists(),
        "the daemon removed the socket systemd owns"
    );
}

#[test]
fn a_passed_socket_at_another_path_is_refused_with_what_to_change() {
    let env = Env::builder().build();
    let elsewhere = env.dir.path().join("elsewhere.sock");
    let mut activator = activated_daemon(&env, &elsewhere, Stdio::piped());
    // The file exists once the activator bound it, maybe before it listens: a connection
    // refused then starts nothing, so connect until one is taken.
    let mut held = Vec::new();
    wait_for(
        || match std::os::unix::net::UnixStream::connect(&elsewhere) {
            Ok(c) => {
                held.push(c);
                true
            }
            Err(_) => false,
        },
        "the activator to take a connection",
        Duration::from_secs(20),
    );
    let status = waymark_testkit::wait_within(&mut activator, Duration::from_secs(20))
        .expect("the daemon refuses at once");
    assert!(!status.success());
    let mut err = String::new();
    std::io::Read::read_to_string(&mut activator.stderr.take().unwrap(), &mut err).unwrap();
    assert!(err.contains("ListenStream="), "{err}");
    assert!(err.contains(&elsewhere.display().to_string()), "{err}");
}
