//! A TCP proxy on loopback that injects network faults into live connections.
//! See [`FaultProxy`].

use std::net::{Ipv4Addr, SocketAddr};
use std::sync::atomic::Ordering;
use std::sync::{mpsc as std_mpsc, Arc, Mutex, MutexGuard};
use std::thread;
use std::time::{Duration, Instant};

use tokio::sync::{mpsc, watch};

mod relay;

use relay::{accept_loop, Budget, BudgetEnd, Faults, ListenerCommand, Shared};

/// How long a control call waits for the proxy thread to carry it out before panicking.
const CONTROL_TIMEOUT: Duration = Duration::from_secs(5);

/// Which way bytes flow through the proxy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Direction {
    /// From the connecting client to the target (for SSH: client to sshd).
    ClientToServer,
    /// From the target back to the client.
    ServerToClient,
}

/// Which connections a [`FaultProxy::cut_after`] or [`FaultProxy::stall_after`] budget
/// applies to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CutScope {
    /// Every connection the proxy has accepted and not yet closed at the time of the call.
    Live,
    /// Only the next connection the proxy accepts (one-shot, used up even if that connection
    /// then fails to reach the target).
    Next,
    /// Every live connection, and every connection accepted later until
    /// [`FaultProxy::heal`].
    LiveAndFuture,
}

/// Counters since the proxy started. Bytes are counted as the proxy hands them to the
/// receiving socket, after any budget has truncated them, so after a cut they show exactly what
/// [`FaultProxy::cut_after`] let through.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ProxyStats {
    /// Connections accepted from clients.
    pub accepted: u64,
    /// Connections currently open (accepted and not yet closed).
    pub live: usize,
    /// Bytes forwarded from clients to the target.
    pub client_to_server_bytes: u64,
    /// Bytes forwarded from the target to clients.
    pub server_to_client_bytes: u64,
}

impl ProxyStats {
    /// Bytes forwarded in `direction`.
    pub fn bytes(&self, direction: Direction) -> u64 {
        match direction {
            Direction::ClientToServer => self.client_to_server_bytes,
            Direction::ServerToClient => self.server_to_client_bytes,
        }
    }
}

/// A TCP proxy on 127.0.0.1 that injects network faults into live connections.
///
/// ```no_run
/// use waymark_testkit::{CutScope, Direction, FaultProxy, TestSshd};
///
/// let sshd = TestSshd::new();
/// let proxy = FaultProxy::start(sshd.addr());
/// let mut ssh = sshd.ssh_command_via(proxy.addr());
/// // ... start a session through the proxy, then:
/// proxy.cut_after(4096, Direction::ServerToClient, CutScope::Live);
/// proxy.cut_all();
/// ```
///
/// The proxy runs on its own thread with its own single-threaded tokio runtime, so it works the
/// same from a plain `#[test]` and from `#[tokio::test]` (whose runtime it never touches). The
/// handle is `Clone + Send + Sync`; the proxy stops, closing every connection, when the last
/// clone is dropped.
///
/// Each accepted connection gets its own connection to the target and two pumps, one per
/// [`Direction`], each reading a chunk (up to 16 KiB) and writing it on. End of stream in one
/// direction is passed on as a half-close; the connection ends when both directions have ended,
/// when either side errors, or when a fault cuts it. A cut closes both sockets (the client's and
/// the target's).
#[derive(Clone, Debug)]
pub struct FaultProxy {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    addr: SocketAddr,
    target: SocketAddr,
    shared: Arc<Shared>,
    faults: watch::Sender<Faults>,
    commands: mpsc::UnboundedSender<ListenerCommand>,
    thread: Mutex<Option<thread::JoinHandle<()>>>,
}

impl FaultProxy {
    /// Starts a proxy on a free port of 127.0.0.1 forwarding to `target`.
    pub fn start(target: SocketAddr) -> FaultProxy {
        let listener = std::net::TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
            .unwrap_or_else(|e| panic!("fault proxy: cannot bind 127.0.0.1:0: {e}"));
        listener
            .set_nonblocking(true)
            .unwrap_or_else(|e| panic!("fault proxy: cannot make the listener non-blocking: {e}"));
        let addr = listener
            .local_addr()
            .unwrap_or_else(|e| panic!("fault proxy: cannot read its own address: {e}"));
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap_or_else(|e| panic!("fault proxy: cannot build its tokio runtime: {e}"));
        let shared = Arc::new(Shared::default());
        let (faults, faults_rx) = watch::channel(Faults::default());
        let (commands, commands_rx) = mpsc::unbounded_channel();
        let thread_shared = Arc::clone(&shared);
        let thread = thread::Builder::new()
            .name(format!("fault-proxy-{}", addr.port()))
            .spawn(move || {
                runtime.block_on(accept_loop(
                    listener,
                    target,
                    thread_shared,
                    faults_rx,
                    commands_rx,
                ));
                // Dropping the runtime drops every connection task, closing their sockets.
            })
            .unwrap_or_else(|e| panic!("fault proxy: cannot spawn its thread: {e}"));
        FaultProxy {
            inner: Arc::new(Inner {
                addr,
                target,
                shared,
                faults,
                commands,
                thread: Mutex::new(Some(thread)),
            }),
        }
    }

    /// Where clients connect: `127.0.0.1:<port>`.
    pub fn addr(&self) -> SocketAddr {
        self.inner.addr
    }

    /// The proxy's port.
    pub fn port(&self) -> u16 {
        self.inner.addr.port()
    }

    /// Where the proxy forwards to.
    pub fn target(&self) -> SocketAddr {
        self.inner.target
    }

    /// Closes every live connection now, both the client's socket and the target's, and
    /// returns once they are all closed. Connections accepted afterwards are not affected.
    pub fn cut_all(&self) {
        let shared = &self.inner.shared;
        let ids: Vec<u64> = {
            let registry = lock(&shared.registry);
            for conn in registry.conns.values() {
                conn.cut.notify_one();
            }
            registry.conns.keys().copied().collect()
        };
        let deadline = Instant::now() + CONTROL_TIMEOUT;
        let mut registry = lock(&shared.registry);
        while ids.iter().any(|id| registry.conns.contains_key(id)) {
            let now = Instant::now();
            if now >= deadline {
                panic!(
                    "fault proxy {}: cut_all: connections still open after {CONTROL_TIMEOUT:?}",
                    self.addr()
                );
            }
            registry = shared
                .closed
                .wait_timeout(registry, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    /// Arms a byte budget: a connection it applies to (see [`CutScope`]) forwards exactly
    /// `bytes` more bytes in `direction`, counted from this call for live connections and from
    /// the accept for later ones, and is then closed (both sides) right after the last allowed
    /// byte is written. Bytes past the budget in the same chunk are dropped, never delivered.
    /// Traffic in the other direction is unaffected until the cut.
    ///
    /// With `bytes == 0` a connection is closed as soon as the budget applies to it: at once
    /// for live connections, right after the accept for new ones.
    ///
    /// A connection has at most one budget: arming again replaces a live connection's budget
    /// (and the pending one-shot or future budget of the same scope).
    ///
    /// The close is a normal close, but the kernel turns it into a reset when the proxy's side
    /// still holds unread data from that peer; a peer may then lose the tail of what was
    /// written to it.
    pub fn cut_after(&self, bytes: u64, direction: Direction, scope: CutScope) {
        self.arm(
            Budget {
                direction,
                remaining: bytes,
                then: BudgetEnd::Cut,
            },
            scope,
        );
    }

    /// Arms a stall: a connection it applies to (see [`CutScope`]) forwards exactly `bytes`
    /// more bytes in `direction`, then holds every further byte in that direction, while the
    /// connection stays open and the other direction flows as before. This is the half-dead
    /// link: one side still hears its peer (keepalives *from* it arrive, output arrives) but
    /// nothing it sends gets through. [`heal`](FaultProxy::heal) releases the held bytes, in
    /// order; [`cut_all`](FaultProxy::cut_all) still cuts.
    ///
    /// With `bytes == 0` a live connection holds from its next chunk on. A held pump stops
    /// reading, so once the kernel buffers fill TCP flow control stalls the sender. Arming
    /// again replaces the budget, as for [`cut_after`](FaultProxy::cut_after).
    pub fn stall_after(&self, bytes: u64, direction: Direction, scope: CutScope) {
        self.arm(
            Budget {
                direction,
                remaining: bytes,
                then: BudgetEnd::Hold,
            },
            scope,
        );
    }

    fn arm(&self, budget: Budget, scope: CutScope) {
        let mut registry = lock(&self.inner.shared.registry);
        match scope {
            CutScope::Next => registry.next_budget = Some(budget),
            CutScope::Live | CutScope::LiveAndFuture => {
                for conn in registry.conns.values() {
                    conn.arm(Some(budget));
                }
                if scope == CutScope::LiveAndFuture {
                    registry.future_budget = Some(budget);
                }
            }
        }
    }

    /// While `on`, the proxy stops forwarding in both directions without closing anything:
    /// each pump stops reading, so bytes stay in the kernel buffers (and, once those fill, TCP
    /// flow control stalls the senders). New connections are still accepted and connected to
    /// the target, but nothing flows. Nothing is lost: after `blackhole(false)` the held bytes
    /// are forwarded in order, so endpoints that did not time out meanwhile carry on.
    ///
    /// Takes effect for the next chunk each pump reads; a chunk already read is held until the
    /// blackhole ends.
    pub fn blackhole(&self, on: bool) {
        self.inner.faults.send_modify(|f| f.blackhole = on);
    }

    /// Delays every chunk by `delay` before it is forwarded, in both directions
    /// (`Duration::ZERO` turns it off). A pump forwards its chunks in order, so throughput
    /// drops to at most one chunk per `delay` per direction.
    pub fn delay(&self, delay: Duration) {
        self.inner.faults.send_modify(|f| f.delay = delay);
    }

    /// While `on`, the proxy's port is closed, so new connections are refused
    /// (`ECONNREFUSED`), as if the host were up but the SSH daemon down. Live connections are
    /// untouched. `refuse_new(false)` listens on the same port again. Returns once the change
    /// is in effect.
    ///
    /// A connection the kernel completed but the proxy had not yet accepted is reset: "live"
    /// here and everywhere in this API means accepted by the proxy.
    pub fn refuse_new(&self, on: bool) {
        let (reply, result) = std_mpsc::channel();
        self.inner
            .commands
            .send(ListenerCommand::RefuseNew(on, reply))
            .unwrap_or_else(|_| panic!("fault proxy {}: its thread has stopped", self.addr()));
        match result.recv_timeout(CONTROL_TIMEOUT) {
            Ok(Ok(())) => {}
            Ok(Err(e)) => panic!("fault proxy {}: refuse_new({on}): {e}", self.addr()),
            Err(_) => panic!(
                "fault proxy {}: refuse_new({on}) not carried out within {CONTROL_TIMEOUT:?}",
                self.addr()
            ),
        }
    }

    /// Removes every fault: no blackhole, no delay, accepting again, and no byte budgets (live,
    /// one-shot or future; held bytes flow on). Connections already cut stay closed.
    pub fn heal(&self) {
        self.blackhole(false);
        self.delay(Duration::ZERO);
        self.refuse_new(false);
        let mut registry = lock(&self.inner.shared.registry);
        registry.next_budget = None;
        registry.future_budget = None;
        for conn in registry.conns.values() {
            conn.arm(None);
        }
    }

    /// Counters since the proxy started.
    pub fn stats(&self) -> ProxyStats {
        let shared = &self.inner.shared;
        ProxyStats {
            accepted: shared.accepted.load(Ordering::SeqCst),
            live: lock(&shared.registry).conns.len(),
            client_to_server_bytes: shared.client_to_server.load(Ordering::SeqCst),
            server_to_client_bytes: shared.server_to_client.load(Ordering::SeqCst),
        }
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        let _ = self.commands.send(ListenerCommand::Shutdown);
        if let Some(thread) = lock(&self.thread).take() {
            let _ = thread.join();
        }
    }
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|e| e.into_inner())
}
