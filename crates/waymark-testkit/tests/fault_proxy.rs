//! Behaviour of `FaultProxy`, against plain TCP servers (for exact byte counts) and against a
//! real sshd with the OpenSSH client.

mod common;

use std::io::{ErrorKind, Read, Write};
use std::net::{Ipv4Addr, Shutdown, SocketAddr, TcpListener, TcpStream};
use std::process::{Child, Stdio};
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

use waymark_testkit::{output_within, wait_within, CutScope, Direction, FaultProxy, TestSshd};

use common::{text, wait_until, LIMIT};

/// An echo server on loopback; each connection is served by its own thread.
fn echo_server() -> SocketAddr {
    let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).unwrap();
    let addr = listener.local_addr().unwrap();
    thread::spawn(move || {
        for stream in listener.incoming().flatten() {
            thread::spawn(move || {
                let mut reader = stream.try_clone().unwrap();
                let mut writer = stream;
                let _ = std::io::copy(&mut reader, &mut writer);
            });
        }
    });
    addr
}

/// What a [`byte_sink`] reports on its channel.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Reports {
    /// Each connection's total, once it ends.
    Total,
    /// The bytes received so far, after every read.
    SoFar,
}

/// A server that reads each connection to its end and reports how many bytes it got. With
/// `ticking`, it also sends a byte every 20 ms on each connection.
fn byte_sink(reports: Reports, ticking: bool) -> (SocketAddr, mpsc::Receiver<usize>) {
    let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).unwrap();
    let addr = listener.local_addr().unwrap();
    let (tx, rx) = mpsc::channel();
    thread::spawn(move || {
        for stream in listener.incoming().flatten() {
            if ticking {
                let mut ticker = stream.try_clone().unwrap();
                thread::spawn(move || {
                    while ticker.write_all(b"t").is_ok() {
                        thread::sleep(Duration::from_millis(20));
                    }
                });
            }
            let tx = tx.clone();
            thread::spawn(move || {
                let mut stream = stream;
                stream.set_read_timeout(Some(LIMIT)).unwrap();
                let mut total = 0;
                let mut buf = [0u8; 4096];
                while let Ok(n) = stream.read(&mut buf) {
                    if n == 0 {
                        break;
                    }
                    total += n;
                    if reports == Reports::SoFar {
                        let _ = tx.send(total);
                    }
                }
                if reports == Reports::Total {
                    let _ = tx.send(total);
                }
            });
        }
    });
    (addr, rx)
}

fn connect(addr: SocketAddr) -> TcpStream {
    let stream = TcpStream::connect(addr).unwrap();
    stream.set_read_timeout(Some(LIMIT)).unwrap();
    stream.set_write_timeout(Some(LIMIT)).unwrap();
    stream
}

fn round_trip(stream: &mut TcpStream, message: &[u8]) -> Vec<u8> {
    stream.write_all(message).unwrap();
    let mut reply = vec![0u8; message.len()];
    stream.read_exact(&mut reply).unwrap();
    reply
}

/// Reads until end of stream or error; true when the peer closed or reset the connection.
fn closed_by_peer(stream: &mut TcpStream) -> bool {
    let mut buf = [0u8; 4096];
    loop {
        match stream.read(&mut buf) {
            Ok(0) => return true,
            Ok(_) => continue,
            Err(e) if e.kind() == ErrorKind::WouldBlock || e.kind() == ErrorKind::TimedOut => {
                return false
            }
            Err(_) => return true,
        }
    }
}

/// Starts `remote` through the proxy with piped stdio and waits until it has touched
/// `~/started`, so the session is established when this returns.
fn start_session(sshd: &TestSshd, proxy: &FaultProxy, extra: &[&str], remote: &str) -> Child {
    let child = sshd
        .ssh_command_via(proxy.addr())
        .args(extra)
        .arg(format!("touch ~/started; {remote}"))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let started = sshd.remote_home().join("started");
    assert!(
        wait_until(LIMIT, || started.exists()),
        "session did not start\n{}",
        sshd.log()
    );
    child
}

#[test]
fn handle_is_send_sync_and_clone() {
    fn assert_traits<T: Send + Sync + Clone + 'static>() {}
    assert_traits::<FaultProxy>();
}

#[test]
fn forwards_an_ssh_session_and_counts_it() {
    let sshd = TestSshd::new();
    let proxy = FaultProxy::start(sshd.addr());
    assert_eq!(proxy.target(), sshd.addr());
    let out = output_within(sshd.ssh_command_via(proxy.addr()).arg("echo hi"), LIMIT);
    assert!(
        out.status.success(),
        "{}\n{}",
        text(&out.stderr),
        sshd.log()
    );
    assert_eq!(text(&out.stdout), "hi\n");
    let stats = proxy.stats();
    assert_eq!(stats.accepted, 1);
    assert!(stats.client_to_server_bytes > 0 && stats.server_to_client_bytes > 0);
    assert!(wait_until(LIMIT, || proxy.stats().live == 0));
}

#[test]
fn cut_all_kills_a_live_ssh_session() {
    let sshd = TestSshd::new();
    let proxy = FaultProxy::start(sshd.addr());
    let mut ssh = start_session(&sshd, &proxy, &[], "sleep 5; echo late");
    assert_eq!(proxy.stats().live, 1);
    proxy.cut_all();
    assert_eq!(
        proxy.stats().live,
        0,
        "cut_all returns once connections are closed"
    );
    let status = wait_within(&mut ssh, LIMIT).expect("ssh must notice the cut");
    let out = ssh.wait_with_output().unwrap();
    assert!(!status.success(), "ssh exited {status} after the cut");
    assert_eq!(text(&out.stdout), "");

    // The proxy still serves new connections.
    let out = output_within(sshd.ssh_command_via(proxy.addr()).arg("echo again"), LIMIT);
    assert_eq!(text(&out.stdout), "again\n");
}

#[test]
fn cut_after_ends_an_ssh_session_after_exactly_the_budget() {
    let sshd = TestSshd::new();
    let proxy = FaultProxy::start(sshd.addr());
    // The session is quiet until it reads a line, so nothing flows between stats() and
    // cut_after().
    let mut ssh = start_session(&sshd, &proxy, &[], "read go; head -c 1000000 /dev/zero");
    let before = proxy.stats().server_to_client_bytes;
    proxy.cut_after(10_000, Direction::ServerToClient, CutScope::Live);
    ssh.stdin.take().unwrap().write_all(b"go\n").unwrap();
    let status = wait_within(&mut ssh, LIMIT).expect("ssh must notice the cut");
    let out = ssh.wait_with_output().unwrap();
    assert!(!status.success(), "ssh exited {status}");
    assert!(out.stdout.len() < 1_000_000);
    assert_eq!(proxy.stats().server_to_client_bytes - before, 10_000);
    // ssh may notice the cut before the proxy's task has counted the connection closed.
    let deadline = std::time::Instant::now() + LIMIT;
    while proxy.stats().live != 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "the cut connection still counts as live"
        );
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
}

#[test]
fn cut_after_next_delivers_exactly_the_budget_then_closes_both_sides() {
    let (sink, received) = byte_sink(Reports::Total, false);
    let proxy = FaultProxy::start(sink);
    proxy.cut_after(1000, Direction::ClientToServer, CutScope::Next);

    let mut client = connect(proxy.addr());
    let _ = client.write_all(&[7u8; 10_000]);
    assert_eq!(received.recv_timeout(LIMIT).unwrap(), 1000);
    assert!(
        closed_by_peer(&mut client),
        "client side must be closed too"
    );

    // One-shot: the next connection passes everything.
    let mut client = connect(proxy.addr());
    client.write_all(&[7u8; 10_000]).unwrap();
    client.shutdown(Shutdown::Write).unwrap();
    assert_eq!(received.recv_timeout(LIMIT).unwrap(), 10_000);
}

#[test]
fn cut_after_live_and_future_applies_until_healed() {
    let echo = echo_server();
    let proxy = FaultProxy::start(echo);
    let mut live = connect(proxy.addr());
    assert_eq!(round_trip(&mut live, b"ping"), b"ping");

    proxy.cut_after(0, Direction::ServerToClient, CutScope::LiveAndFuture);
    assert!(
        closed_by_peer(&mut live),
        "budget 0 closes a live connection at once"
    );
    let mut later = connect(proxy.addr());
    assert!(closed_by_peer(&mut later), "and every new one");

    proxy.heal();
    let mut healed = connect(proxy.addr());
    assert_eq!(round_trip(&mut healed, b"pong"), b"pong");
}

#[test]
fn blackhole_stalls_a_live_ssh_session_until_keepalives_give_up() {
    let sshd = TestSshd::new();
    let proxy = FaultProxy::start(sshd.addr());
    let keepalive = ["-o", "ServerAliveInterval=1", "-o", "ServerAliveCountMax=2"];
    let mut ssh = start_session(&sshd, &proxy, &keepalive, "sleep 30; echo late");
    proxy.blackhole(true);
    let status = wait_within(&mut ssh, LIMIT).expect("ssh must give up on a stalled link");
    let out = ssh.wait_with_output().unwrap();
    assert!(!status.success());
    assert!(
        text(&out.stderr).contains("Timeout"),
        "{}",
        text(&out.stderr)
    );
    assert_eq!(
        proxy.stats().live,
        1,
        "a blackhole never closes the connection"
    );
    proxy.blackhole(false);
    assert!(wait_until(LIMIT, || proxy.stats().live == 0));
}

#[test]
fn blackhole_holds_bytes_and_delivers_them_when_lifted() {
    let echo = echo_server();
    let proxy = FaultProxy::start(echo);
    let mut client = connect(proxy.addr());
    assert_eq!(round_trip(&mut client, b"before"), b"before");

    proxy.blackhole(true);
    client.write_all(b"held").unwrap();
    client
        .set_read_timeout(Some(Duration::from_millis(300)))
        .unwrap();
    let mut buf = [0u8; 4];
    let stalled = client.read(&mut buf);
    assert!(
        stalled.is_err(),
        "nothing may arrive through a blackhole: {stalled:?}"
    );

    proxy.blackhole(false);
    client.set_read_timeout(Some(LIMIT)).unwrap();
    client.read_exact(&mut buf).unwrap();
    assert_eq!(&buf, b"held");
}

#[test]
fn delay_slows_every_chunk() {
    let echo = echo_server();
    let proxy = FaultProxy::start(echo);
    let mut client = connect(proxy.addr());
    proxy.delay(Duration::from_millis(200));
    let start = Instant::now();
    assert_eq!(round_trip(&mut client, b"x"), b"x");
    assert!(
        start.elapsed() >= Duration::from_millis(400),
        "one chunk each way, each delayed: {:?}",
        start.elapsed()
    );
    proxy.delay(Duration::ZERO);
    assert_eq!(round_trip(&mut client, b"y"), b"y");
}

#[test]
fn stall_after_holds_one_direction_while_the_other_flows_until_healed() {
    let (sink, received) = byte_sink(Reports::SoFar, true);
    let proxy = FaultProxy::start(sink);
    let mut client = connect(proxy.addr());
    client.write_all(b"ab").unwrap();
    assert_eq!(received.recv_timeout(LIMIT).unwrap(), 2);

    proxy.stall_after(3, Direction::ClientToServer, CutScope::Live);
    client.write_all(b"cdefgh").unwrap();
    let mut got = 2;
    while got < 5 {
        got = received.recv_timeout(LIMIT).unwrap();
    }
    assert_eq!(got, 5, "exactly the budget gets through");
    assert!(
        received.recv_timeout(Duration::from_millis(300)).is_err(),
        "nothing past the budget may arrive"
    );
    // The other direction still flows, and the connection stays open.
    let mut ticks = [0u8; 8];
    client.read_exact(&mut ticks).unwrap();
    assert_eq!(&ticks, b"tttttttt");
    assert_eq!(proxy.stats().live, 1);

    proxy.heal();
    let mut got = 5;
    while got < 8 {
        got = received.recv_timeout(LIMIT).unwrap();
    }
    assert_eq!(got, 8, "the held bytes are delivered, once");
}

#[test]
fn refuse_new_refuses_connections_but_keeps_live_ones() {
    let echo = echo_server();
    let proxy = FaultProxy::start(echo);
    let mut live = connect(proxy.addr());
    // Only accepted connections are live; one still in the kernel's backlog is reset.
    assert_eq!(round_trip(&mut live, b"accepted"), b"accepted");

    proxy.refuse_new(true);
    let refused = TcpStream::connect(proxy.addr()).map(|_| ());
    assert_eq!(
        refused.map_err(|e| e.kind()),
        Err(ErrorKind::ConnectionRefused)
    );
    assert_eq!(round_trip(&mut live, b"still"), b"still");

    proxy.refuse_new(false);
    let mut again = connect(proxy.addr());
    assert_eq!(round_trip(&mut again, b"again"), b"again");
    assert_eq!(proxy.stats().accepted, 2);
}

#[test]
fn dropping_the_last_handle_closes_connections_and_the_port() {
    let echo = echo_server();
    let proxy = FaultProxy::start(echo);
    let addr = proxy.addr();
    let clone = proxy.clone();
    let mut client = connect(addr);
    assert_eq!(round_trip(&mut client, b"hi"), b"hi");
    drop(proxy);
    assert_eq!(
        round_trip(&mut client, b"on"),
        b"on",
        "a clone keeps it running"
    );
    drop(clone);
    assert!(closed_by_peer(&mut client));
    assert!(TcpStream::connect(addr).is_err());
}

#[tokio::test]
async fn works_from_a_tokio_test() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let echo = echo_server();
    let proxy = FaultProxy::start(echo);
    let mut client = tokio::net::TcpStream::connect(proxy.addr()).await.unwrap();
    client.write_all(b"async").await.unwrap();
    let mut buf = [0u8; 5];
    tokio::time::timeout(LIMIT, client.read_exact(&mut buf))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(&buf, b"async");
    proxy.cut_all();
    let n = tokio::time::timeout(LIMIT, client.read(&mut buf))
        .await
        .unwrap()
        .unwrap_or(0);
    assert_eq!(n, 0);
    drop(proxy);
}
