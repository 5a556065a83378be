//! A command that the daemon carries out: one request, its events shown as they come, its
//! answer printed; the rest of a long output read from the host.

use std::io::Write;
use std::sync::Arc;

use waymark_core::ExecutionId;
use waymark_gateway::config::Config;
use waymark_protocol::control::{Control, DaemonStart};

use super::Cli;
use crate::protocol::{
    client, CallAnswer, Event, FanOutAnswer, Frame, OutputHeads, OutputPage, Request, ResultView,
    StatusAnswer, Stream,
};
use crate::{exit, fail, load_config, stdout_failed};

/// Sends `request` to the daemon (starting one when none answers) and prints its answer;
/// returns the exit code.
pub async fn ask(cli: &Cli, request: Request) -> i32 {
    let config = Arc::new(load_config(cli));
    let is_fan_out = matches!(request, Request::FanOut { .. });
    let is_call = is_fan_out || matches!(request, Request::Call { .. } | Request::Resume { .. });
    let is_result = matches!(request, Request::Result { .. });
    let is_status = matches!(request, Request::Status { .. });
    escape_controls_on_terminals(cli.raw_control_chars);
    let show_output = (is_call && !is_fan_out) || is_result;
    let json = cli.json;
    let seen_id: std::sync::Mutex<Option<ExecutionId>> = std::sync::Mutex::new(None);
    // Bytes of stdout and stderr already written while the command ran.
    let printed: std::sync::Mutex<[u64; 2]> = std::sync::Mutex::new([0, 0]);
    let on_event = |e: &Event| {
        match e {
        Event::Execution { id, attached } => {
            *seen_id.lock().expect("id") = Some(*id);
            if !json {
                match attached {
                    Some(a) => eprintln!(
                        "execution {id}: attached to an earlier call of the same intent, not run again ({}). A new `--key` makes a new intent.",
                        crate::protocol::answer::attach_words(*a)
                    ),
                    None => eprintln!("execution {id}"),
                }
            }
        }
        Event::Host { host, event } if !json => match &**event {
            Event::Execution { id, attached } => match attached {
                Some(a) => eprintln!(
                    "{host}: execution {id}: attached to an earlier call of the same intent, not run again ({})",
                    crate::protocol::answer::attach_words(*a)
                ),
                None => eprintln!("{host}: execution {id}"),
            },
            Event::AwaitingApproval(q) => eprintln!(
                "{host}: {} awaits an operator's approval (`waymark approve {}`); waiting for it",
                q.id, q.id
            ),
            _ => {}
        },
        Event::Progress { of, done, total } if !json => show_progress(of, *done, *total),
        Event::AwaitingApproval(q) if !json => {
            let id = q.id;
            eprintln!(
                "waymark: {id} awaits an operator's approval; waiting for it. An operator runs `waymark approve {id}` or `waymark deny {id} --reason ...`; Ctrl-C stops waiting and leaves it pending."
            );
        }
        Event::Output {
            stream,
            offset,
            data_b64,
        } if !json => {
            let bytes = crate::protocol::answer::decode_b64(data_b64);
            let i = stream.index();
            let offset = *offset;
            let mut p = printed.lock().expect("printed");
            let end = offset + bytes.len() as u64;
            if offset <= p[i] && end > p[i] {
                write_stream(i, &bytes[(p[i] - offset) as usize..]);
                p[i] = end;
            }
        }
        _ => {}
    }
    };
    // Every command that needs the ledger asks the daemon, which alone owns it; when none
    // answers, one is started (the same detached, race-safe start as `waymark mcp`).
    // Seeing, reloading or stopping a daemon never starts one.
    let mut start = daemon_start(&config);
    let about_the_daemon = matches!(request, Request::DaemonStatus | Request::DaemonReload);
    if about_the_daemon {
        start.daemon_command = None;
    }
    if !about_the_daemon {
        warn_if_stale(&config);
    }
    let control = Control::new(start);
    let deadline = read_deadline(cli);
    let answer = async {
        if !is_call {
            return ask_again_if_broken(&control, request, deadline, &on_event).await;
        }
        // Ctrl-C leaves the execution to the daemon, which carries it on: say how to follow it.
        tokio::select! {
            a = control.request(request, on_event) => a,
            _ = tokio::signal::ctrl_c() => {
                let msg = match *seen_id.lock().expect("id") {
                    _ if is_fan_out => "interrupted: the executions named above go on in the daemon (they are not cancelled). Run the same call again to follow them: it attaches per host.".into(),
                    Some(id) => format!("interrupted: execution {id} goes on in the daemon (it is not cancelled). Follow it with `waymark exec status {id}` and `waymark exec result {id}`; stop it with `waymark exec cancel {id}`."),
                    None => "interrupted before the daemon named the execution: it may have been accepted. Run `waymark exec list --since 10m`, or the same call again (it attaches).".into(),
                };
                fail(msg, exit::INTERRUPTED)
            }
        }
    };
    let frame = match answer.await {
        Ok(f) => f,
        Err(client::ClientError::Broken(why)) => {
            let hint = match (is_call, *seen_id.lock().expect("id")) {
                _ if is_fan_out => " The outcome of every execution named above is UNKNOWN. Run the same call again: it attaches per host and runs nothing twice.".to_string(),
                (true, Some(id)) => format!(
                    " The outcome of {id} is UNKNOWN: it may have started and may still be running. Run `waymark exec status {id}` (do not retry blindly)."
                ),
                (true, None) => " The action may have been accepted and may be running: run `waymark exec list --since 10m`, then `waymark exec status <id>`.".to_string(),
                (false, _) => String::new(),
            };
            fail(
                format!("lost the connection to the daemon: {why}.{hint}"),
                if is_call { exit::UNKNOWN } else { exit::ERROR },
            )
        }
        Err(client::ClientError::NoDaemon) if about_the_daemon => fail(
            format!(
                "no daemon runs on {} (it starts with the first command that needs it, or with \
                 `waymark daemon`)",
                config.daemon.socket.display()
            ),
            exit::ERROR,
        ),
        Err(client::ClientError::NoDaemon) => {
            let (why, code) = control
                .start_error()
                .map_or(("no reason given".into(), exit::ERROR), |e| {
                    (e.message, e.exit)
                });
            fail(
                format!(
                    "no daemon answers on {} and none could be started: {why}. Nothing was sent.",
                    config.daemon.socket.display(),
                ),
                code,
            )
        }
    };
    if is_fan_out && !json {
        print_host_outputs(&frame);
    }
    let already = *printed.lock().expect("printed");
    let carried = show_output.then(|| carried(&frame, is_result)).flatten();
    let delivered_output = (is_status && !json)
        .then(|| frame.view::<StatusAnswer>())
        .flatten()
        .filter(|s| s.delivered_with_this_answer)
        .and_then(|s| s.call.output.map(|o| (s.call.execution.id, o)));
    let code = print_frame(cli, frame, carried.as_ref(), already);
    if let Some((id, output)) = delivered_output {
        // The answer delivered the result: show what it delivered, as `exec run` would have.
        for stream in Stream::BOTH {
            write_stream(stream.index(), &output.heads.bytes(stream));
            if output.truncated(stream) {
                eprintln!(
                    "waymark: {stream} shows its first {} of {} bytes; the rest: `waymark exec result {id}`",
                    output.heads.stored(stream),
                    output.heads.total(stream),
                );
            }
        }
    }
    if let (
        Some(Carried {
            id,
            heads: Some(heads),
            ..
        }),
        false,
    ) = (&carried, json)
    {
        // The ledger keeps the first part of each stream; the rest is on the host.
        for stream in Stream::BOTH {
            let i = stream.index();
            let mut offset = heads.stored(stream).max(already[i]);
            let total = heads.total(stream);
            while offset < total {
                let req = Request::Output {
                    id: *id,
                    stream,
                    offset,
                    max: 1 << 20,
                };
                match ask_again_if_broken(&control, req, None, &|_: &Event| {})
                    .await
                    .map(Frame::answer::<OutputPage>)
                {
                    Ok(Frame::Done { data: chunk, .. }) => {
                        let bytes = chunk.bytes();
                        if bytes.is_empty() {
                            break;
                        }
                        write_stream(i, &bytes);
                        offset += bytes.len() as u64;
                    }
                    Ok(Frame::Error { message, .. }) => fail(
                        format!("the rest of {stream} (from byte {offset}) could not be read from the host: {message}"),
                        exit::ERROR,
                    ),
                    _ => fail(format!("the rest of {stream} could not be read from the host"), exit::ERROR),
                }
            }
        }
    }
    code
}

/// How many times a read-only request is sent again after its daemon connection broke.
const READ_RESENDS: u32 = 3;

/// Sends `request`; when it is read-only ([`Request::is_read_only`]) and the daemon's
/// connection broke before the answer (the daemon was killed or restarted under it), sends it
/// again, up to [`READ_RESENDS`] times, starting a daemon when none answers. A read changes
/// nothing, so asking twice is harmless, and an operator asking what happened after a crash
/// should get the answer rather than a lost connection (issue 36). Any other request may have
/// been carried out, so its broken connection is returned as is.
async fn ask_again_if_broken(
    control: &Control,
    request: Request,
    deadline: Option<std::time::Duration>,
    on_event: &impl Fn(&Event),
) -> Result<Frame, client::ClientError> {
    let mut resent = 0;
    loop {
        match control
            .request_within(request.clone(), deadline, on_event)
            .await
        {
            Err(client::ClientError::Broken(why))
                if request.is_read_only() && resent < READ_RESENDS =>
            {
                resent += 1;
                tracing::warn!(%why, resent, "the daemon's connection broke before it answered; asking again (a read changes nothing)");
                // A daemon that is going away may still hold its socket for a moment.
                tokio::time::sleep(std::time::Duration::from_millis(100 * u64::from(resent))).await;
            }
            answer => return answer,
        }
    }
}

/// The `--timeout` of a read that asks the host (`exec status`, `exec result`); `None` for
/// any other command, and when not given (the daemon then waits its default,
/// [`crate::protocol::READ_DEADLINE`]).
fn read_deadline(cli: &Cli) -> Option<std::time::Duration> {
    match &cli.command {
        super::Command::Exec(
            super::ExecCommand::Status { timeout, .. } | super::ExecCommand::Result { timeout, .. },
        ) => *timeout,
        _ => None,
    }
}

/// A fan-out's output, grouped by host: a header line per host on stdout, then what its
/// command printed (stdout to stdout, stderr to stderr), as the ledger holds it. A host's
/// stderr gets the same header on stderr, so each stream says whose lines follow.
fn print_host_outputs(frame: &Frame) {
    let Some(fan_out) = frame.view::<FanOutAnswer>() else {
        return;
    };
    for h in &fan_out.hosts {
        let Some(call) = &h.execution else { continue };
        let header = format!(
            "== {}: {} {}, exit {}",
            h.host, call.execution.id, call.execution.state, h.exit
        );
        outln!("{header}");
        if let Some(o) = &call.output {
            for stream in Stream::BOTH {
                let bytes = o.heads.bytes(stream);
                if stream == Stream::Stderr && !bytes.is_empty() {
                    eprintln!("{header}");
                }
                write_stream(stream.index(), &bytes);
                if o.truncated(stream) {
                    eprintln!(
                        "waymark: {}: {stream} shows its first {} of {} bytes; the rest: `waymark exec result {}`",
                        h.host,
                        o.heads.stored(stream),
                        o.heads.total(stream),
                        call.execution.id
                    );
                }
            }
        }
    }
}

/// The output an answer carries, for a command that prints it (`exec run`, `exec result`).
pub struct Carried {
    id: ExecutionId,
    /// `None`: the call has no result yet.
    heads: Option<OutputHeads>,
    /// The answer's text is a message about the output (printed to stderr beside it).
    message: bool,
}

fn carried(frame: &Frame, is_result: bool) -> Option<Carried> {
    if is_result {
        let r: ResultView = frame.view()?;
        Some(Carried {
            id: r.id,
            message: r.message.is_some(),
            heads: Some(r.heads),
        })
    } else {
        let c: CallAnswer = frame.view()?;
        Some(Carried {
            id: c.execution.id,
            heads: c.output.map(|o| o.heads),
            message: true,
        })
    }
}

/// How this configuration's daemon is reached, and started when none answers: `waymark
/// --config F daemon`, detached, its log next to the socket.
/// `waymark daemon stop [--wait]`: asks the running daemon to stop (never starts one to stop
/// it); with `wait`, returns once its process has exited.
pub async fn daemon_stop(cli: &Cli, wait: bool, grace_ms: Option<u64>) -> i32 {
    let config = load_config(cli);
    let mut start = daemon_start(&config);
    start.daemon_command = None;
    let control = Control::new(start);
    let frame = match control
        .request(Request::DaemonStop { grace_ms }, |_| {})
        .await
    {
        Ok(f) => f,
        Err(client::ClientError::NoDaemon) => {
            outln!(
                "No daemon runs on {}: nothing to stop.",
                config.daemon.socket.display()
            );
            return 0;
        }
        Err(client::ClientError::Broken(why)) => fail(
            format!("lost the connection to the daemon: {why}"),
            exit::ERROR,
        ),
    };
    let pid = match &frame {
        Frame::Done { data, .. } => data["pid"].as_u64().map(|p| p as i32),
        _ => None,
    };
    let code = print_frame(cli, frame, None, [0, 0]);
    if code != 0 || !wait {
        return code;
    }
    let Some(pid) = pid else { return code };
    // Its requests get their grace to finish; a daemon that has not exited well after is
    // stuck, which is said, not waited on forever.
    let grace = grace_ms.map_or(crate::service::lifecycle::STOP_GRACE, |ms| {
        std::time::Duration::from_millis(ms)
    });
    let deadline = std::time::Instant::now() + grace + std::time::Duration::from_secs(20);
    // SAFETY: kill with signal 0 only asks whether the process exists.
    while unsafe { libc::kill(pid, 0) } == 0 {
        if std::time::Instant::now() > deadline {
            fail(
                format!(
                    "the daemon (pid {pid}) was asked to stop but is still running {} s after",
                    (grace.as_secs() + 20)
                ),
                exit::ERROR,
            );
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    if !cli.json {
        eprintln!("waymark: the daemon (pid {pid}) has exited");
    }
    0
}

/// How far a long request got, on one line of stderr rewritten in place: only on a terminal
/// (a log or a pipe gets the answer alone). The line ends once everything is done.
pub fn show_progress(of: &str, done: u64, total: Option<u64>) {
    use std::io::IsTerminal;
    if !std::io::stderr().is_terminal() {
        return;
    }
    match total {
        Some(t) if t > 0 => {
            let pct = done.saturating_mul(100) / t;
            eprint!("\r{of}: {done} of {t} ({pct}%)\x1b[K");
            if done >= t {
                eprintln!();
            }
        }
        _ => eprint!("\r{of}: {done}\x1b[K"),
    }
}

/// Warns (on stderr) when the daemon running on this configuration's socket runs another
/// text of the configuration file than the one on disk now: a tool added since is unknown to
/// it, a changed argv not yet used. `waymark daemon reload` makes it current.
pub fn warn_if_stale(config: &Config) {
    let described = config
        .daemon
        .socket
        .with_file_name(crate::daemon::DAEMON_FILE);
    let Ok(text) = std::fs::read_to_string(&described) else {
        return;
    };
    let Ok(d) = serde_json::from_str::<serde_json::Value>(&text) else {
        return;
    };
    let pid = d["pid"].as_i64().unwrap_or(0) as i32;
    // SAFETY: kill with signal 0 only asks whether the process exists.
    if pid <= 0 || unsafe { libc::kill(pid, 0) } != 0 {
        return;
    }
    let Ok(ours) = std::fs::read_to_string(&config.file) else {
        return;
    };
    let runs = d["config_file"].as_str().unwrap_or_default();
    if std::path::Path::new(runs) != config.file {
        eprintln!(
            "waymark: warning: the daemon on {} (pid {pid}) runs another configuration file, \
             {runs}; this command uses {}",
            config.daemon.socket.display(),
            config.file.display()
        );
    } else if d["config_hash"].as_str() != Some(&crate::service::lifecycle::config_hash(&ours)) {
        let loaded = d["config_loaded_ms"].as_u64().unwrap_or(0);
        eprintln!(
            "waymark: warning: {} changed after the daemon (pid {pid}) loaded it at {}; it \
             still runs the old one: `waymark daemon reload`",
            config.file.display(),
            crate::service::render::fmt_time(waymark_core::Timestamp::from_millis(loaded))
        );
    }
}

pub fn daemon_start(config: &Config) -> DaemonStart {
    let mut daemon = std::process::Command::new(
        std::env::current_exe().unwrap_or_else(|e| fail(e, exit::ERROR)),
    );
    daemon.arg("--config").arg(&config.file).arg("daemon");
    let socket = config.daemon.socket.clone();
    DaemonStart {
        daemon_log: socket.with_file_name("daemon.log"),
        socket,
        daemon_command: Some(daemon),
    }
}

/// Per stream (stdout, stderr): whether a command's output written there has its terminal
/// control characters escaped. Set once, by [`escape_controls_on_terminals`].
static ESCAPE: std::sync::OnceLock<[bool; 2]> = std::sync::OnceLock::new();

/// A command's output written to a terminal could retitle it, clear it or worse: there its
/// control characters are shown escaped ([`escape_controls`]), unless `raw`
/// (`--raw-control-chars`, as `less -R`). A pipe or a file gets the bytes as they are.
fn escape_controls_on_terminals(raw: bool) {
    use std::io::IsTerminal;
    let _ = ESCAPE.set([
        !raw && std::io::stdout().is_terminal(),
        !raw && std::io::stderr().is_terminal(),
    ]);
}

/// `bytes` with every control character a terminal would act on shown as text instead: C0
/// controls but tab, newline and carriage return as `^X` (ESC is `^[`), DEL as `^?`, and the
/// C1 controls (U+0080 to U+009F, as UTF-8) as `<U+009B>`.
fn escape_controls(bytes: &[u8]) -> std::borrow::Cow<'_, [u8]> {
    let is_c1 =
        |i: usize| bytes[i] == 0xc2 && bytes.get(i + 1).is_some_and(|b| (0x80..0xa0).contains(b));
    let is_control = |i: usize| {
        let b = bytes[i];
        (b < 0x20 && !matches!(b, b'\t' | b'\n' | b'\r')) || b == 0x7f || is_c1(i)
    };
    if !(0..bytes.len()).any(is_control) {
        return std::borrow::Cow::Borrowed(bytes);
    }
    let mut out = Vec::with_capacity(bytes.len() + 16);
    let mut i = 0;
    while i < bytes.len() {
        let b = bytes[i];
        if is_c1(i) {
            out.extend_from_slice(format!("<U+{:04X}>", bytes[i + 1]).as_bytes());
            i += 2;
            continue;
        }
        if is_control(i) {
            out.extend_from_slice(&[b'^', b ^ 0x40]);
        } else {
            out.push(b);
        }
        i += 1;
    }
    std::borrow::Cow::Owned(out)
}

/// Writes a command's output to stdout (0) or stderr (1), escaped on a terminal (see
/// [`escape_controls_on_terminals`]).
fn write_stream(i: usize, bytes: &[u8]) {
    let bytes = match ESCAPE.get() {
        Some(escape) if escape[i] => escape_controls(bytes),
        _ => std::borrow::Cow::Borrowed(bytes),
    };
    let bytes = &bytes[..];
    if i == 0 {
        let mut out = std::io::stdout().lock();
        if let Err(e) = out.write_all(bytes).and_then(|()| out.flush()) {
            stdout_failed(e);
        }
    } else {
        let mut err = std::io::stderr().lock();
        let _ = err.write_all(bytes);
    }
}

/// Prints a final frame and returns the exit code. `carried`: the output it carries, for a
/// command that prints it; `already` is how much of stdout and stderr was written while the
/// command ran.
pub fn print_frame(cli: &Cli, frame: Frame, carried: Option<&Carried>, already: [u64; 2]) -> i32 {
    match frame {
        Frame::Done { data, text, exit } => {
            if cli.json {
                outln!("{}", serde_json::to_string_pretty(&data).expect("json"));
            } else {
                if let Some(heads) = carried.and_then(|c| c.heads.as_ref()) {
                    for stream in Stream::BOTH {
                        let i = stream.index();
                        let bytes = heads.bytes(stream);
                        let skip = (already[i] as usize).min(bytes.len());
                        write_stream(i, &bytes[skip..]);
                    }
                }
                if !text.is_empty() {
                    if carried.is_some_and(|c| c.message) {
                        eprintln!("waymark: {text}");
                    } else {
                        outln!("{text}");
                    }
                }
            }
            exit
        }
        Frame::Error { message, exit } => fail(message, exit),
        Frame::Event(_) => exit::ERROR,
    }
}
