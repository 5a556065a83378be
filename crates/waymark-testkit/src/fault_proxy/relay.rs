//! The proxy's thread: accepting connections and pumping bytes through each one, consulting
//! the faults armed by the handle for every chunk.

use std::collections::HashMap;
use std::future::pending;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc as std_mpsc, Arc, Condvar, Mutex};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch, Notify};

use super::{lock, Direction};

/// Most bytes a pump reads and forwards at once.
const CHUNK: usize = 16 * 1024;

/// Faults every pump consults for each chunk.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Faults {
    pub(super) blackhole: bool,
    pub(super) delay: Duration,
}

#[derive(Debug)]
pub(super) enum ListenerCommand {
    RefuseNew(bool, std_mpsc::Sender<Result<(), String>>),
    Shutdown,
}

/// State shared by the handle and the proxy thread.
#[derive(Debug, Default)]
pub(super) struct Shared {
    pub(super) registry: Mutex<Registry>,
    /// Signalled each time a connection leaves the registry.
    pub(super) closed: Condvar,
    pub(super) accepted: AtomicU64,
    pub(super) client_to_server: AtomicU64,
    pub(super) server_to_client: AtomicU64,
}

#[derive(Debug, Default)]
pub(super) struct Registry {
    pub(super) next_id: u64,
    pub(super) conns: HashMap<u64, Arc<Conn>>,
    pub(super) next_budget: Option<Budget>,
    pub(super) future_budget: Option<Budget>,
}

/// One proxied connection, as the handle sees it.
#[derive(Debug, Default)]
pub(super) struct Conn {
    pub(super) budget: Mutex<Option<Budget>>,
    pub(super) cut: Notify,
    /// Signalled each time the budget changes, so a held pump looks again.
    pub(super) rearmed: Notify,
}

/// Bytes still allowed in one direction before the connection is cut or stalled.
#[derive(Debug, Clone, Copy)]
pub(super) struct Budget {
    pub(super) direction: Direction,
    pub(super) remaining: u64,
    pub(super) then: BudgetEnd,
}

/// What happens once a budget is spent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum BudgetEnd {
    /// Close the connection, both sides.
    Cut,
    /// Keep the connection but forward nothing more in the budget's direction.
    Hold,
}

impl Conn {
    pub(super) fn arm(&self, budget: Option<Budget>) {
        *lock(&self.budget) = budget;
        if budget.is_some_and(|b| b.remaining == 0 && b.then == BudgetEnd::Cut) {
            self.cut.notify_one();
        }
        self.rearmed.notify_waiters();
    }

    /// True while a spent stall budget holds `direction`.
    pub(super) fn holds(&self, direction: Direction) -> bool {
        lock(&self.budget).is_some_and(|b| {
            b.direction == direction && b.then == BudgetEnd::Hold && b.remaining == 0
        })
    }
}

pub(super) async fn accept_loop(
    listener: std::net::TcpListener,
    target: SocketAddr,
    shared: Arc<Shared>,
    faults: watch::Receiver<Faults>,
    mut commands: mpsc::UnboundedReceiver<ListenerCommand>,
) {
    let addr = listener.local_addr().expect("listener has an address");
    let mut listener = Some(TcpListener::from_std(listener).expect("inside the proxy runtime"));
    loop {
        tokio::select! {
            command = commands.recv() => match command {
                None | Some(ListenerCommand::Shutdown) => return,
                Some(ListenerCommand::RefuseNew(true, reply)) => {
                    listener = None;
                    let _ = reply.send(Ok(()));
                }
                Some(ListenerCommand::RefuseNew(false, reply)) => {
                    let result = match listener {
                        Some(_) => Ok(()),
                        None => TcpListener::bind(addr).await.map(|l| listener = Some(l)).map_err(
                            |e| format!("cannot listen on {addr} again (another process took the port?): {e}"),
                        ),
                    };
                    let _ = reply.send(result);
                }
            },
            accepted = accept(listener.as_ref()) => match accepted {
                Ok((client, _)) => {
                    shared.accepted.fetch_add(1, Ordering::SeqCst);
                    let (id, conn) = register(&shared);
                    let guard = Registered { shared: Arc::clone(&shared), id };
                    tokio::spawn(serve(client, target, conn, faults.clone(), guard));
                }
                // Out of file descriptors and the like: back off instead of spinning.
                Err(_) => tokio::time::sleep(Duration::from_millis(10)).await,
            },
        }
    }
}

async fn accept(listener: Option<&TcpListener>) -> std::io::Result<(TcpStream, SocketAddr)> {
    match listener {
        Some(listener) => listener.accept().await,
        None => pending().await,
    }
}

fn register(shared: &Shared) -> (u64, Arc<Conn>) {
    let mut registry = lock(&shared.registry);
    let id = registry.next_id;
    registry.next_id += 1;
    let conn = Arc::new(Conn::default());
    let budget = registry.next_budget.take().or(registry.future_budget);
    conn.arm(budget);
    registry.conns.insert(id, Arc::clone(&conn));
    (id, conn)
}

/// Removes its connection from the registry when the connection task ends or is dropped.
struct Registered {
    shared: Arc<Shared>,
    id: u64,
}

impl Drop for Registered {
    fn drop(&mut self) {
        lock(&self.shared.registry).conns.remove(&self.id);
        self.shared.closed.notify_all();
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PumpEnd {
    /// The reader reached end of stream; the half-close was passed on.
    Eof,
    /// The byte budget ran out.
    Cut,
    /// A read or write failed.
    Failed,
}

async fn serve(
    client: TcpStream,
    target: SocketAddr,
    conn: Arc<Conn>,
    faults: watch::Receiver<Faults>,
    registered: Registered,
) {
    let server = tokio::select! {
        connected = TcpStream::connect(target) => match connected {
            Ok(server) => server,
            Err(_) => return,
        },
        _ = conn.cut.notified() => return,
    };
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    let (client_read, client_write) = client.into_split();
    let (server_read, server_write) = server.into_split();
    let shared = &registered.shared;
    let c2s = pump(
        client_read,
        server_write,
        Direction::ClientToServer,
        &conn,
        faults.clone(),
        shared,
    );
    let s2c = pump(
        server_read,
        client_write,
        Direction::ServerToClient,
        &conn,
        faults,
        shared,
    );
    tokio::pin!(c2s, s2c);
    let (mut c2s_done, mut s2c_done) = (false, false);
    while !(c2s_done && s2c_done) {
        tokio::select! {
            _ = conn.cut.notified() => break,
            end = &mut c2s, if !c2s_done => match end {
                PumpEnd::Eof => c2s_done = true,
                PumpEnd::Cut | PumpEnd::Failed => break,
            },
            end = &mut s2c, if !s2c_done => match end {
                PumpEnd::Eof => s2c_done = true,
                PumpEnd::Cut | PumpEnd::Failed => break,
            },
        }
    }
    // Returning drops both pumps and with them all four socket halves: both sides close.
}

async fn pump(
    mut from: OwnedReadHalf,
    mut to: OwnedWriteHalf,
    direction: Direction,
    conn: &Conn,
    mut faults: watch::Receiver<Faults>,
    shared: &Shared,
) -> PumpEnd {
    let mut buf = vec![0u8; CHUNK];
    loop {
        if !wait_while_blackholed(&mut faults).await {
            return PumpEnd::Failed;
        }
        let n = tokio::select! {
            read = from.read(&mut buf) => match read {
                Ok(0) => {
                    let _ = to.shutdown().await;
                    return PumpEnd::Eof;
                }
                Ok(n) => n,
                Err(_) => return PumpEnd::Failed,
            },
            // Re-check the blackhole when faults change; read() is cancel-safe.
            changed = faults.changed() => {
                if changed.is_err() {
                    return PumpEnd::Failed;
                }
                continue;
            }
        };
        let delay = faults.borrow().delay;
        if !delay.is_zero() {
            tokio::time::sleep(delay).await;
        }
        if !wait_while_blackholed(&mut faults).await {
            return PumpEnd::Failed;
        }
        let mut pending = &buf[..n];
        loop {
            let (allowed, spent) = spend(conn, shared, direction, pending.len());
            if to.write_all(&pending[..allowed]).await.is_err() {
                return PumpEnd::Failed;
            }
            pending = &pending[allowed..];
            match spent {
                None => break,
                Some(BudgetEnd::Cut) => return PumpEnd::Cut,
                Some(BudgetEnd::Hold) => wait_released(conn, direction).await,
            }
        }
    }
}

/// Takes up to `n` bytes from the connection's budget and counts them as forwarded; returns
/// how many may be written and, once the budget is spent, what happens next.
fn spend(
    conn: &Conn,
    shared: &Shared,
    direction: Direction,
    n: usize,
) -> (usize, Option<BudgetEnd>) {
    let mut budget = lock(&conn.budget);
    let (allowed, spent) = match budget.as_mut() {
        Some(b) if b.direction == direction => {
            let allowed = (n as u64).min(b.remaining);
            b.remaining -= allowed;
            (allowed as usize, (b.remaining == 0).then_some(b.then))
        }
        _ => (n, None),
    };
    let counter = match direction {
        Direction::ClientToServer => &shared.client_to_server,
        Direction::ServerToClient => &shared.server_to_client,
    };
    counter.fetch_add(allowed as u64, Ordering::SeqCst);
    (allowed, spent)
}

/// Returns once no spent stall budget holds `direction` any more.
async fn wait_released(conn: &Conn, direction: Direction) {
    loop {
        let rearmed = conn.rearmed.notified();
        tokio::pin!(rearmed);
        rearmed.as_mut().enable();
        if !conn.holds(direction) {
            return;
        }
        rearmed.await;
    }
}

/// Returns once no blackhole is set; false when the handle is gone (the proxy is stopping).
async fn wait_while_blackholed(faults: &mut watch::Receiver<Faults>) -> bool {
    loop {
        if !faults.borrow_and_update().blackhole {
            return true;
        }
        if faults.changed().await.is_err() {
            return false;
        }
    }
}
