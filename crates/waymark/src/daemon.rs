//! `waymark daemon`: owns the ledger and the SSH pool, serves the control socket.

use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
use std::path::Path;
use std::sync::Arc;

use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{UnixListener, UnixStream};
use waymark_core::ExecutionId;
use waymark_gateway::config::Config;
use waymark_gateway::flow::{now, Gateway};
use waymark_gateway::host::HostExecutor;
use waymark_gateway::ssh_hosts::SshHosts;

use waymark_ledger_pg::PgBackend;

use crate::exit;
use crate::ledger_backend::{self, Heartbeat};
use crate::protocol::{Envelope, Event, Request, MAX_REQUEST_BYTES, PROTOCOL_VERSION};
use crate::service::lifecycle::Lifecycle;
use crate::service::{Caller, Frame, LegacyIntents, Peer, Service, Session};
use waymark_gateway::config::UnixId;

/// The listening socket systemd passed (socket activation: `LISTEN_PID` is this process,
/// `LISTEN_FDS` ≥ 1, the socket is fd 3). It must be the configured socket path, since that is
/// where the CLI and `waymark mcp` connect. The variables stay (changing the environment of a
/// running multi-threaded process is a race); a child cannot mistake them for its own, since
/// `LISTEN_PID` names this process.
fn inherited(socket: &Path) -> Result<Option<UnixListener>, String> {
    use std::os::fd::FromRawFd;
    let for_us = std::env::var("LISTEN_PID")
        .ok()
        .and_then(|p| p.parse::<u32>().ok())
        == Some(std::process::id());
    let fds: u32 = std::env::var("LISTEN_FDS")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(0);
    if !for_us || fds == 0 {
        return Ok(None);
    }
    if fds > 1 {
        return Err(format!(
            "systemd passed {fds} sockets; the daemon takes one (one ListenStream= in the socket unit)"
        ));
    }
    const SD_LISTEN_FDS_START: i32 = 3;
    // SAFETY: systemd's protocol hands this process fd 3 as its own listening socket; nothing
    // else in the process owns it.
    let std_listener =
        unsafe { std::os::unix::net::UnixListener::from_raw_fd(SD_LISTEN_FDS_START) };
    let addr = std_listener.local_addr().map_err(|e| {
        format!("the socket systemd passed (fd 3) is not a Unix stream socket: {e}")
    })?;
    let passed = addr.as_pathname().map(Path::to_path_buf);
    if passed.as_deref() != Some(socket) {
        return Err(format!(
            "systemd passed the socket {} but the configuration's daemon socket is {}: make ListenStream= in the socket unit match [daemon] socket",
            passed.map_or("(unnamed)".into(), |p| p.display().to_string()),
            socket.display()
        ));
    }
    std_listener
        .set_nonblocking(true)
        .map_err(|e| format!("cannot make the inherited socket non-blocking: {e}"))?;
    // SAFETY: fd 3 stays open for the life of the listener; FD_CLOEXEC keeps it from the
    // children the daemon starts.
    unsafe { libc::fcntl(SD_LISTEN_FDS_START, libc::F_SETFD, libc::FD_CLOEXEC) };
    UnixListener::from_std(std_listener)
        .map(Some)
        .map_err(|e| format!("cannot use the socket systemd passed: {e}"))
}

/// Creates the socket's directory and refuses to start when a daemon already answers. With
/// `[daemon] socket_group`, the directory is 0750 and the socket 0660, both of that group, so
/// its members can connect (and are mapped to actors by uid and groups); otherwise 0700 and
/// 0600, the daemon's user alone.
async fn bind(socket: &Path, group: Option<&UnixId>) -> Result<UnixListener, String> {
    let (dir_mode, sock_mode) = match group {
        Some(_) => (0o750, 0o660),
        None => (0o700, 0o600),
    };
    if let Some(dir) = socket.parent() {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(dir_mode)
            .create(dir)
            .map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
        set_group(dir, group)?;
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(dir_mode))
            .map_err(|e| format!("cannot set {} to {dir_mode:o}: {e}", dir.display()))?;
    }
    if socket.exists() {
        if UnixStream::connect(socket).await.is_ok() {
            return Err(format!(
                "a daemon already serves {}; stop it first",
                socket.display()
            ));
        }
        std::fs::remove_file(socket)
            .map_err(|e| format!("cannot remove the stale socket {}: {e}", socket.display()))?;
    }
    let listener = UnixListener::bind(socket)
        .map_err(|e| format!("cannot listen on {}: {e}", socket.display()))?;
    set_group(socket, group)?;
    std::fs::set_permissions(socket, std::fs::Permissions::from_mode(sock_mode))
        .map_err(|e| format!("cannot set {} to {sock_mode:o}: {e}", socket.display()))?;
    Ok(listener)
}

/// Gives `path` the socket group (its owner stays the daemon's user).
fn set_group(path: &Path, group: Option<&UnixId>) -> Result<(), String> {
    let Some(g) = group else { return Ok(()) };
    std::os::unix::fs::chown(path, None, Some(g.id)).map_err(|e| {
        format!(
            "cannot give {} the group {} (daemon.socket_group): {e}; the daemon's user must be a member of it, or root",
            path.display(),
            g.name
        )
    })
}

/// Beside the socket, the address MCP over HTTP listens on (`IP:PORT`), once it listens.
pub const HTTP_ADDR_FILE: &str = "http.addr";
/// Beside the socket, the address the metrics endpoint listens on, once it listens.
pub const METRICS_ADDR_FILE: &str = "metrics.addr";

fn beside_socket(config: &Config, name: &str) -> std::path::PathBuf {
    config.daemon.socket.with_file_name(name)
}

/// Writes the address a listener got (a configured port 0 becomes the port the system gave) to
/// `name` beside the socket, whole or not at all (written aside, then renamed), so a client
/// never binds a port itself and hopes it is still free when the daemon starts.
/// A file that cannot be written is logged, not fatal: the log names the address too.
fn write_listen_addr(config: &Config, name: &str, addr: std::net::SocketAddr) {
    let path = beside_socket(config, name);
    let tmp = path.with_extension("addr.tmp");
    if let Err(e) =
        std::fs::write(&tmp, format!("{addr}\n")).and_then(|()| std::fs::rename(&tmp, &path))
    {
        tracing::warn!(path = %path.display(), error = %e, "cannot write the listening address");
    }
}

/// Why the daemon ended or did not start, and its exit code.
pub struct Failure {
    pub message: String,
    pub code: i32,
}

impl From<String> for Failure {
    fn from(message: String) -> Failure {
        Failure {
            message,
            code: crate::exit::ERROR,
        }
    }
}

/// Runs the daemon until SIGTERM or SIGINT.
pub async fn run(
    config: Arc<Config>,
    config_hash: String,
    start: ledger_backend::Start,
) -> Result<(), Failure> {
    // What the daemon would refuse once listening, it refuses before: the HTTP endpoint's
    // tokens are read now (a configuration error, exit 2, as `config check` says).
    if config.daemon.http_listen.is_some() {
        http_callers(&config).map_err(|message| Failure {
            message,
            code: crate::exit::USAGE,
        })?;
        if let Some(files) = &config.daemon.tls {
            waymark_mcp::tls::server_config(&files.cert, &files.key).map_err(|message| {
                Failure {
                    message,
                    code: crate::exit::USAGE,
                }
            })?;
        }
    }
    crate::envfile::log_sources(&config);
    let metrics = config
        .daemon
        .metrics_listen
        .map(|_| Arc::new(crate::metrics::Metrics::new()));
    let opened =
        ledger_backend::open(&config, metrics.as_ref().map(|m| m.flush_observer()), start).await?;
    let ledger = opened.ledger.clone();
    let hosts = Arc::new(SshHosts::new(config.clone()).with_ledger_identity(ledger.identity()));
    // One HTTP client for every HTTP tool: connections pooled per target.
    let http = waymark_http::HttpChannel::new().map_err(|e| e.to_string())?;
    let mut gateway = Gateway::new(config.clone(), ledger.clone(), hosts.clone()).with_http(http);
    if let Some(metrics) = &metrics {
        gateway = gateway.with_metrics(metrics.clone());
    }
    if let Ok(secs) = std::env::var("WAYMARK_APPROVAL_WAIT_SECS") {
        gateway.approval_wait =
            std::time::Duration::from_secs(secs.parse().map_err(|_| {
                "WAYMARK_APPROVAL_WAIT_SECS must be a number of seconds".to_string()
            })?);
    }
    let gateway = Arc::new(gateway);
    // The addresses this daemon's TCP listeners got are written beside the socket; an earlier
    // daemon's must not be read for this one's.
    for name in [HTTP_ADDR_FILE, METRICS_ADDR_FILE] {
        let _ = std::fs::remove_file(beside_socket(&config, name));
    }
    let activated = inherited(&config.daemon.socket)?;
    let socket_activated = activated.is_some();
    let listener = match activated {
        Some(listener) => listener,
        None => bind(&config.daemon.socket, config.daemon.socket_group.as_ref()).await?,
    };
    // Executions recorded under the actor's old form, which a retry may still attach to.
    let legacy = LegacyIntents::scan(gateway.ledger().as_ref(), &config, now()).await?;
    if !legacy.is_empty() {
        tracing::info!("executions recorded under the old actor form are still matched by retries");
    }
    let pools = hosts.clone();
    let reloaded = hosts.clone();
    let (life, mut stopped) = Lifecycle::new(
        config.file.clone(),
        config_hash,
        Box::new(move || pools.connections()),
        Box::new(move |c| reloaded.set_config(c)),
    );
    let service = Arc::new(Service {
        gateway: gateway.clone(),
        legacy,
        life: Arc::new(life),
    });
    if let Some(addr) = config.daemon.http_listen {
        serve_mcp_http(&config, addr, service.clone()).await?;
    }
    if let (Some(addr), Some(metrics)) = (config.daemon.metrics_listen, metrics) {
        let sources = crate::metrics::Sources {
            ledger,
            hosts,
            tools: {
                let gateway = gateway.clone();
                Box::new(move || {
                    let config = gateway.config();
                    config
                        .tools
                        .keys()
                        .cloned()
                        .chain(
                            (!config.policy.raw_commands.is_empty())
                                .then(|| waymark_gateway::tools::RAW_TOOL.to_string()),
                        )
                        .collect()
                })
            },
        };
        let bound = crate::metrics::serve(addr, metrics, sources).await?;
        write_listen_addr(&config, METRICS_ADDR_FILE, bound);
    }
    let addr_of = |name| {
        std::fs::read_to_string(beside_socket(&config, name))
            .ok()
            .map(|a| a.trim().to_string())
    };
    service.life.set_listeners(crate::protocol::Listeners {
        socket: config.daemon.socket.display().to_string(),
        http: addr_of(HTTP_ADDR_FILE),
        metrics: addr_of(METRICS_ADDR_FILE),
    });
    write_daemon_file(&config, &service.life);
    tracing::info!(socket = %config.daemon.socket.display(), socket_activated, ledger = %gateway.ledger().describe(), "daemon listening");
    // One task reconciles, one reconcile at a time: first what was left in flight at start,
    // then whatever the heartbeat takes over. The heartbeat only hands it over and beats on.
    let (to_reconcile, reconcile_asks) = tokio::sync::mpsc::unbounded_channel();
    if let Some(shared) = opened.shared {
        // Registered, with what an earlier run of this daemon, nobody, and dead daemons left
        // taken over, before the first reconcile: that reconcile then covers them.
        let beat = Heartbeat::from_env();
        let taken = shared
            .beat(now(), beat.dead_after, true)
            .await
            .map_err(|e| e.to_string())?
            .into_iter()
            .map(|r| r.id)
            .collect();
        let _ = to_reconcile.send(Reconcile::Start(taken));
        tokio::spawn(keep_beating(shared, to_reconcile, beat));
    } else {
        let _ = to_reconcile.send(Reconcile::Start(Vec::new()));
        drop(to_reconcile);
    }
    tokio::spawn(reconciling(gateway.clone(), reconcile_asks));
    let signal = |kind| tokio::signal::unix::signal(kind).map_err(|e| e.to_string());
    let mut term = signal(tokio::signal::unix::SignalKind::terminate())?;
    let mut hup = signal(tokio::signal::unix::SignalKind::hangup())?;
    loop {
        tokio::select! {
            accepted = listener.accept() => {
                let Ok((stream, _)) = accepted else { continue };
                let service = service.clone();
                tokio::spawn(async move { serve(service, stream).await });
            }
            _ = hup.recv() => {
                let service = service.clone();
                tokio::spawn(async move { service.daemon_reload("SIGHUP").await });
            }
            _ = stopped.changed() => break,
            _ = term.recv() => break,
            _ = tokio::signal::ctrl_c() => break,
        }
    }
    // Nothing new is accepted; the requests being answered get a few seconds to finish. A
    // call still waiting for its command leaves it to the host and the next start's reconcile.
    drop(listener);
    let grace = std::time::Instant::now()
        + stopped
            .borrow()
            .unwrap_or(crate::service::lifecycle::STOP_GRACE);
    while service.life.requests() > 0 && std::time::Instant::now() < grace {
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    // A socket systemd passed is systemd's: it keeps listening and starts the next daemon.
    if !socket_activated {
        let _ = std::fs::remove_file(&config.daemon.socket);
    }
    let _ = std::fs::remove_file(beside_socket(&config, DAEMON_FILE));
    tracing::info!(unfinished = service.life.requests(), "daemon stopped");
    Ok(())
}

/// What the daemon runs, beside its socket (`daemon.json`): a CLI compares the configuration
/// file's hash with it and warns when the daemon runs an older one.
pub const DAEMON_FILE: &str = "daemon.json";

/// Writes [`DAEMON_FILE`] (by rename, so a reader never sees half of it).
pub fn write_daemon_file(config: &Config, life: &Lifecycle) {
    let path = beside_socket(config, DAEMON_FILE);
    let tmp = path.with_extension("json.tmp");
    let text = format!("{}\n", life.describe_file());
    if let Err(e) = std::fs::write(&tmp, text).and_then(|()| std::fs::rename(&tmp, &path)) {
        tracing::warn!(path = %path.display(), error = %e, "cannot write the daemon file");
    }
}

/// What the reconciler is asked to reconcile: what was left in flight at start, or what the
/// heartbeat took over; with the ids taken, which it lets go of when reconcile left them
/// unresolved.
enum Reconcile {
    Start(Vec<ExecutionId>),
    TakenOver(Vec<ExecutionId>),
}

/// Reconciles what it is asked to, one reconcile at a time (asks that came meanwhile are
/// covered by one more), until the last sender is gone. A reconcile may wait long on a host
/// (a marker read that hangs): nothing but this task waits with it.
async fn reconciling<E: HostExecutor>(
    gateway: Arc<Gateway<E>>,
    mut asks: tokio::sync::mpsc::UnboundedReceiver<Reconcile>,
) {
    while let Some(first) = asks.recv().await {
        let mut start = false;
        let mut taken = Vec::new();
        let mut ask = Some(first);
        while let Some(a) = ask.take().or_else(|| asks.try_recv().ok()) {
            match a {
                Reconcile::Start(ids) => {
                    start = true;
                    taken.extend(ids);
                }
                Reconcile::TakenOver(ids) => taken.extend(ids),
            }
        }
        let what = if start {
            "reconciled executions left in flight"
        } else {
            "reconciled taken-over executions"
        };
        match gateway.reconcile().await {
            // A fenced write is another daemon's to record; a failed one waits for the next
            // status check, retry or reconcile. Both are named, never the end of a reconcile.
            Ok(r) if r.fenced + r.failed > 0 => tracing::warn!(
                checked = r.checked,
                moved = r.moved,
                unreachable = r.unreachable,
                expired = r.expired,
                fenced = r.fenced,
                failed = r.failed,
                "{what}"
            ),
            Ok(r) => tracing::info!(
                checked = r.checked,
                moved = r.moved,
                unreachable = r.unreachable,
                expired = r.expired,
                "{what}"
            ),
            Err(e) => tracing::error!(error = %e, "reconciliation failed"),
        }
        // What it took and reconcile left unresolved, nobody drives: let go of it (never of
        // what a call accepted meanwhile and is about to drive).
        gateway.let_go_of_idle(&taken).await;
    }
}

/// Beats on the shared ledger for as long as the daemon runs; what a dead daemon left is taken
/// over (epoch + 1) and handed to the reconciler, to be settled through the host markers, never
/// re-sent because a lease expired. The beat never waits for a reconcile: one slowed by a host
/// must not let this daemon look dead, or another would take over the calls it drives.
async fn keep_beating(
    shared: Arc<PgBackend>,
    to_reconcile: tokio::sync::mpsc::UnboundedSender<Reconcile>,
    beat: Heartbeat,
) {
    loop {
        tokio::time::sleep(beat.every).await;
        match shared.beat(now(), beat.dead_after, false).await {
            Ok(taken) if !taken.is_empty() => {
                tracing::warn!(taken = taken.len(), "took over a dead daemon's executions");
                let ids = taken.iter().map(|r| r.id).collect();
                let _ = to_reconcile.send(Reconcile::TakenOver(ids));
            }
            Ok(_) => {}
            Err(e) => tracing::error!(error = %e, "heartbeat on the shared ledger failed"),
        }
    }
}

async fn write_frame(w: &mut (impl AsyncWriteExt + Unpin), frame: &Frame) -> std::io::Result<()> {
    let mut line = serde_json::to_vec(frame).expect("frames serialize");
    line.push(b'\n');
    w.write_all(&line).await?;
    w.flush().await
}

/// One connection, one request.
async fn serve<E: HostExecutor>(service: Arc<Service<E>>, stream: UnixStream) {
    // Who the peer is, decided now from what the kernel recorded at connect: the actor of
    // every request on this connection, whatever the client says and wherever it is by now.
    let caller =
        Peer::of_stream(&stream).and_then(|peer| Caller::of_peer(&peer, &service.gateway.config()));
    let (read, mut write) = stream.into_split();
    let caller = match caller {
        Ok(c) => c,
        Err(why) => {
            tracing::warn!(%why, "connection refused");
            let _ = write_frame(
                &mut write,
                &Frame::Error {
                    message: format!("refused, nothing was accepted: {why}"),
                    exit: exit::USAGE,
                },
            )
            .await;
            return;
        }
    };
    let mut reader = BufReader::new(read).take(MAX_REQUEST_BYTES as u64 + 1);
    let mut line = Vec::new();
    match reader.read_until(b'\n', &mut line).await {
        Ok(0) => return,
        Ok(_) => {}
        Err(_) => return,
    }
    if line.len() > MAX_REQUEST_BYTES {
        let _ = write_frame(
            &mut write,
            &Frame::Error {
                message: format!("request larger than {MAX_REQUEST_BYTES} bytes; refused"),
                exit: exit::USAGE,
            },
        )
        .await;
        return;
    }
    let envelope: Envelope = match serde_json::from_slice(&line) {
        Ok(e) => e,
        Err(e) => {
            let _ = write_frame(&mut write, &Frame::Error { message: format!("not a Waymark control request ({e}); this socket speaks protocol v{PROTOCOL_VERSION}, one JSON object per line"), exit: exit::USAGE }).await;
            return;
        }
    };
    if envelope.v != PROTOCOL_VERSION {
        let _ = write_frame(&mut write, &Frame::Error { message: format!("protocol v{} is not spoken here; this daemon speaks v{PROTOCOL_VERSION} (upgrade or restart the daemon)", envelope.v), exit: exit::ERROR }).await;
        return;
    }
    let mut session = Session::new(caller);
    if let Some(ms) = envelope.deadline_ms {
        session.read_deadline = std::time::Duration::from_millis(ms.max(1));
    }
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<Frame>();
    let writer = tokio::spawn(async move {
        let mut ok = true;
        while let Some(f) = rx.recv().await {
            if ok && write_frame(&mut write, &f).await.is_err() {
                ok = false;
            }
        }
        (write, ok)
    });
    // The events' sender goes with the request's handling, which ends the writer's loop.
    let event = move |e| {
        let _ = tx.send(Frame::Event(e));
    };
    let write = |done: Frame| async move {
        let (mut write, events_ok) = writer.await.expect("writer task");
        // The transport accepted the whole answer: the caller has the result.
        events_ok && write_frame(&mut write, &done).await.is_ok()
    };
    service.run(envelope.request, session, event, write).await;
}

/// MCP over Streamable HTTP reaches the service in process, as the actor of the bearer token
/// the request presented (each token has its own backend), never anything the client says.
struct InProcess {
    service: Arc<Service<SshHosts>>,
    caller: Caller,
}

impl waymark_mcp::Backend for InProcess {
    fn request<'a>(
        &'a self,
        req: Request,
        on_execution: &'a (dyn Fn(ExecutionId) + Send + Sync),
    ) -> waymark_mcp::Reply<'a> {
        Box::pin(async move {
            let on_event = |e: &Event| {
                if let Event::Execution { id, .. } = e {
                    on_execution(*id);
                }
            };
            self.request_events(req, &on_event).await
        })
    }

    fn request_events<'a>(
        &'a self,
        req: Request,
        on_event: &'a (dyn Fn(&Event) + Send + Sync),
    ) -> waymark_mcp::Reply<'a> {
        Box::pin(async move {
            // MCP over HTTP defers delivery: the result is delivered once the HTTP response
            // body carrying it was written (`waymark_mcp::http`), or with the `tasks/get`
            // answer that carries it for a task, not when this call ends. A request that does
            // not defer (none over HTTP today) is delivered once its answer reached this
            // caller.
            let session = Session::new(self.caller.clone());
            // The request runs on its own task, as it would in the daemon behind a socket: a
            // caller that goes away (an MCP request cancelled or answered early) abandons the
            // answer, never the gateway's work halfway.
            let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<Event>();
            let (done_tx, done_rx) = tokio::sync::oneshot::channel::<Frame>();
            let service = self.service.clone();
            tokio::spawn(async move {
                let event = move |e| {
                    let _ = tx.send(e);
                };
                let write = |done| async move { done_tx.send(done).is_ok() };
                service.run(req, session, event, write).await;
            });
            while let Some(e) = rx.recv().await {
                on_event(&e);
            }
            let done = done_rx.await.map_err(|_| {
                waymark_protocol::client::ClientError::Broken(
                    "the request failed: it ended without an answer".into(),
                )
            })?;
            Ok(done.to_json())
        })
    }

    fn actor(
        &self,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = Option<String>> + Send + '_>> {
        Box::pin(std::future::ready(Some(self.caller.actor.0.clone())))
    }
}

/// Starts MCP over Streamable HTTP, over TLS when `[daemon] tls_cert` and `tls_key` are set
/// (the configuration allows plain HTTP on loopback only); the bearer tokens are the
/// configured actors' (each its own actor), or in single-user mode the one `http_token_file`
/// (0600).
async fn serve_mcp_http(
    config: &Config,
    addr: std::net::SocketAddr,
    service: Arc<Service<SshHosts>>,
) -> Result<(), String> {
    let backend = |caller: Caller| -> Arc<dyn waymark_mcp::Backend> {
        Arc::new(InProcess {
            service: service.clone(),
            caller,
        })
    };
    let tokens: Vec<waymark_mcp::http::BearerToken> = http_callers(config)?
        .into_iter()
        .map(|(sha256, caller)| waymark_mcp::http::BearerToken {
            sha256,
            backend: backend(caller),
        })
        .collect();
    let tls = match &config.daemon.tls {
        Some(files) => Some(waymark_mcp::tls::server_config(&files.cert, &files.key)?),
        None => None,
    };
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|e| format!("cannot listen on {addr}: {e}"))?;
    // Port 0 in the configuration: the port the system gave, told in the log and the file.
    let addr = listener.local_addr().map_err(|e| e.to_string())?;
    write_listen_addr(config, HTTP_ADDR_FILE, addr);
    let changes = service.life.config_changes();
    let scheme = if tls.is_some() { "https" } else { "http" };
    tracing::info!(url = %format!("{scheme}://{addr}{}", waymark_mcp::http::MCP_PATH), tokens = tokens.len(), "MCP over Streamable HTTP");
    tokio::spawn(async move {
        if let Err(e) = waymark_mcp::http::serve(listener, tokens, tls, changes).await {
            tracing::error!(error = %e, "MCP over HTTP stopped");
        }
    });
    Ok(())
}

/// Every bearer token the HTTP endpoint takes (its SHA-256), each with the actor it proves.
/// The daemon reads them before it says it listens, and `config check` reads them the same way,
/// so whatever one refuses (a token file others can read, a short token) the other refuses
/// with the same words.
pub fn http_callers(config: &Config) -> Result<Vec<([u8; 32], Caller)>, String> {
    use waymark_gateway::config::TokenSource;
    use waymark_mcp::http::{read_token, token_digest};
    if config.actors.is_empty() {
        let token_file = config.daemon.http_token_file.as_ref().ok_or(
            "daemon.http_listen needs daemon.http_token_file (a 0600 file holding the bearer token), or [actors] with tokens",
        )?;
        let token = read_token(token_file)?;
        let name = token_file
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_else(|| "http".into());
        return Ok(vec![(token_digest(&token), Caller::of_token(None, &name))]);
    }
    let mut tokens = Vec::new();
    for actor in config.actors.values() {
        for source in &actor.tokens {
            let sha256 = match source {
                TokenSource::Sha256(hex) => {
                    let mut d = [0u8; 32];
                    hex::decode_to_slice(hex, &mut d)
                        .map_err(|e| format!("actors.{}.token_sha256: {e}", actor.name))?;
                    d
                }
                TokenSource::File(path) => token_digest(
                    &read_token(path).map_err(|e| format!("actors.{}: {e}", actor.name))?,
                ),
            };
            tokens.push((sha256, Caller::of_token(Some(actor), "")));
        }
    }
    if tokens.is_empty() {
        return Err(
            "daemon.http_listen: no [actors] entry has a token (token_sha256 or token_file); no HTTP agent could connect".into(),
        );
    }
    Ok(tokens)
}
