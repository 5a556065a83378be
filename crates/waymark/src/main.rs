//! `waymark`: the daemon, the CLI and the demo of the Waymark SSH action executor.
//!
//! This is the only crate that knows clap. Every command becomes a control [`protocol::Request`]
//! that the daemon carries out; a command that finds no daemon starts one. Only `init` and
//! `audit verify --ledger` open the ledger in this process, and never one a daemon owns.

/// `println!` for the CLI's stdout. A reader that went away (`waymark runs --json | head -c1`)
/// ends the command quietly, as a shell tool ends on SIGPIPE, instead of a panic. (SIGPIPE
/// itself stays ignored: a daemon that vanished mid-answer must be reported, not die silently.)
macro_rules! outln {
    ($($t:tt)*) => { out!("{}\n", format_args!($($t)*)) };
}

/// `print!` with the same rule as [`outln!`].
macro_rules! out {
    ($($t:tt)*) => {{
        use std::io::Write as _;
        let mut stdout = std::io::stdout().lock();
        if let Err(e) = write!(stdout, $($t)*).and_then(|()| stdout.flush()) {
            crate::stdout_failed(e);
        }
    }};
}

mod daemon;
mod demo;
mod exit;
mod service;

use waymark_protocol as protocol;
use waymark_protocol::client;
use waymark_protocol::control::{Control, DaemonStart};

use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;

use clap::{Args, Parser, Subcommand};
use serde_json::{Map, Value};
use waymark_gateway::config::{Config, DefaultPaths};
use waymark_gateway::ssh_hosts::SshHosts;
use waymark_ledger::{Ledger, LedgerError};

use protocol::{CallAnswer, Event, Frame, OutputHeads, OutputPage, Request, ResultView, Stream};
use waymark_core::ExecutionId;

#[derive(Parser)]
#[command(name = "waymark", version, about = "Run AI agents' actions on SSH hosts, exactly once.", after_help = exit::HELP)]
struct Cli {
    /// Configuration file [default: $XDG_CONFIG_HOME/waymark/waymark.toml]
    #[arg(long, global = true, env = "WAYMARK_CONFIG")]
    config: Option<PathBuf>,
    /// Print machine-readable JSON instead of text.
    #[arg(long, global = true)]
    json: bool,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Create a configuration skeleton, the ledger and its key, and the runtime directory.
    Init {
        /// Overwrite nothing; just show what would be created.
        #[arg(long)]
        dry_run: bool,
    },
    /// Run the daemon in the foreground (owns the ledger and the SSH connections).
    Daemon,
    /// Serve MCP on stdin/stdout for an agent (starts the daemon when none answers).
    Mcp,
    /// Show Waymark at work on a throwaway embedded SSH host: a dropped connection, the true
    /// outcome recovered, a retry that attaches instead of running twice.
    Demo,
    /// The configuration: check it without starting anything.
    #[command(subcommand)]
    Config(ConfigCommand),
    /// Configured hosts: list them, check a connection, pin a host's key.
    #[command(subcommand)]
    Hosts(HostsCommand),
    /// Executions: run, status, result, list, resume, cancel, review, explain.
    #[command(subcommand)]
    Exec(ExecCommand),
    /// Actions awaiting an operator's approval.
    Approvals,
    /// Approve an action that awaits approval.
    Approve { id: ExecutionId },
    /// Deny an action that awaits approval.
    Deny {
        id: ExecutionId,
        #[arg(long)]
        reason: String,
    },
    /// Refuse every new action (recorded) until `waymark unlock`.
    Lock,
    /// Accept new actions again.
    Unlock,
    /// The agent-session log.
    Runs {
        #[arg(long)]
        limit: Option<usize>,
    },
    /// The audit chain.
    #[command(subcommand)]
    Audit(AuditCommand),
    /// Remove resolved executions older than a duration (e.g. 30d); unresolved ones stay.
    Gc {
        #[arg(long, default_value = "30d")]
        older_than: String,
    },
}

#[derive(Subcommand)]
enum ExecCommand {
    /// Run a tool (`waymark exec run TOOL key=value ...`) or a raw command where policy allows
    /// (`waymark exec run --host H -- CMD ...`). Prints the execution ID first.
    Run {
        /// Tool name; omit with `--host H -- CMD ...`.
        tool: Option<String>,
        /// key=value arguments of the tool. A secret need not be on any command line:
        /// key=@- reads the value from stdin, key=@env:VAR from the environment, key=@prompt
        /// asks on the terminal without echo (key=@@x is the literal value @x).
        args: Vec<String>,
        #[arg(long)]
        host: Option<String>,
        /// Idempotency key: repeats with the same key (within the tool's window) attach.
        #[arg(long)]
        key: Option<String>,
        /// The raw command, after `--`.
        #[arg(last = true)]
        command: Vec<String>,
    },
    /// What really happened: the ledger plus a live check of the host's marker.
    Status { id: ExecutionId },
    /// The stored output of an execution.
    Result { id: ExecutionId },
    /// List executions.
    List(ListArgs),
    /// Re-send an execution under its own id (safe: the host marker refuses a second start).
    Resume {
        id: ExecutionId,
        /// The tool call again, for tools with arguments (secret ones are not stored):
        /// `TOOL key=value ...`.
        args: Vec<String>,
    },
    /// Cancel an execution (before dispatch, or its process group on the host).
    Cancel { id: ExecutionId },
    /// Resolve an unknown or interrupted execution by human review.
    Review {
        id: ExecutionId,
        #[arg(
            long,
            conflicts_with = "did_not_run",
            required_unless_present = "did_not_run"
        )]
        ran: bool,
        #[arg(long)]
        did_not_run: bool,
        #[arg(long)]
        note: String,
    },
    /// The incident view: who called, what was sent, what the host said, what was delivered.
    Explain { id: ExecutionId },
}

#[derive(Subcommand)]
enum ConfigCommand {
    /// Load and validate the configuration (references, patterns, durations, key and
    /// known_hosts files, secret-in-argv warnings) without starting or contacting anything.
    /// Exit 0 when usable (warnings included), 2 with file:line:column errors otherwise.
    Check,
}

#[derive(Subcommand)]
enum HostsCommand {
    /// List configured hosts.
    List,
    /// Connect, authenticate and install the wrapper: proves a host is usable.
    Check { name: String },
    /// Show the host's key fingerprint and pin it into its known_hosts file.
    Trust {
        name: String,
        /// Pin without asking.
        #[arg(long)]
        yes: bool,
    },
}

#[derive(Args)]
struct ListArgs {
    #[arg(long)]
    state: Option<String>,
    #[arg(long)]
    host: Option<String>,
    #[arg(long)]
    tool: Option<String>,
    #[arg(long)]
    actor: Option<String>,
    /// Only executions accepted within this duration (e.g. 2h).
    #[arg(long)]
    since: Option<String>,
    #[arg(long)]
    limit: Option<usize>,
    /// Continue after this execution id (the last one of the previous page).
    #[arg(long)]
    after: Option<ExecutionId>,
}

#[derive(Subcommand)]
enum AuditCommand {
    /// Walk the hash chain from genesis; name the first bad event. Works with the daemon stopped.
    Verify {
        /// Ledger directory (default: from the configuration).
        #[arg(long)]
        ledger: Option<PathBuf>,
        /// A head exported earlier (SEQ:HASH): prove nothing before it was truncated or edited.
        #[arg(long)]
        head: Option<String>,
    },
    /// The current chain head (SEQ:HASH), to keep somewhere else.
    Head,
}

fn defaults() -> DefaultPaths {
    DefaultPaths::from_env(|k| std::env::var(k).ok(), unsafe { libc::geteuid() })
}

fn fail(message: impl std::fmt::Display, code: i32) -> ! {
    eprintln!("waymark: {message}");
    std::process::exit(code)
}

/// The configuration file: `--config`, else the XDG default.
fn config_path(cli: &Cli, d: &DefaultPaths) -> PathBuf {
    cli.config.clone().unwrap_or_else(|| d.config_file.clone())
}

fn load_config(cli: &Cli) -> Config {
    let d = defaults();
    let config = Config::load(&config_path(cli, &d), &d).unwrap_or_else(|e| fail(e, exit::USAGE));
    for w in &config.warnings {
        eprintln!("waymark: warning: {w}");
    }
    config
}

/// `waymark config check`: what `Config::load` refuses (with its line), what it warns about, and
/// the files a first connection needs (key files, known_hosts under `strict`).
fn config_check(cli: &Cli) -> i32 {
    use waymark_gateway::config::{CredentialConfig, HostKeyPolicy};
    let d = defaults();
    let path = config_path(cli, &d);
    let config = match Config::load(&path, &d) {
        Ok(c) => c,
        Err(e) => {
            if cli.json {
                outln!(
                    "{}",
                    serde_json::json!({"ok": false, "errors": [e.to_string()], "warnings": []})
                );
                return exit::USAGE;
            }
            fail(e, exit::USAGE)
        }
    };
    let mut errors = Vec::new();
    let mut warnings: Vec<String> = config.warnings.iter().map(ToString::to_string).collect();
    for (name, c) in &config.credentials {
        if let CredentialConfig::KeyFile { path: key, .. } = c {
            if let Err(e) = std::fs::metadata(key) {
                errors.push(format!(
                    "{}: credential {name}: key file {}: {e}",
                    path.display(),
                    key.display()
                ));
            }
        }
    }
    for (name, h) in &config.hosts {
        if let Err(e) = std::fs::metadata(&h.known_hosts) {
            let line = format!(
                "{}: host {name}: known_hosts file {}: {e}; `waymark hosts trust {name}` pins the host's key into it",
                path.display(),
                h.known_hosts.display()
            );
            match h.host_key_policy {
                HostKeyPolicy::Strict => errors.push(line),
                HostKeyPolicy::AcceptNew => warnings.push(line),
            }
        }
    }
    if cli.json {
        outln!(
            "{}",
            serde_json::json!({"ok": errors.is_empty(), "file": path, "errors": errors, "warnings": warnings,
                "hosts": config.hosts.len(), "tools": config.tools.len()})
        );
    } else {
        for w in &warnings {
            eprintln!("waymark: warning: {w}");
        }
        for e in &errors {
            eprintln!("waymark: {e}");
        }
        if errors.is_empty() {
            outln!(
                "{}: OK ({} hosts, {} tools, {} warnings)",
                path.display(),
                config.hosts.len(),
                config.tools.len(),
                warnings.len()
            );
        }
    }
    if errors.is_empty() {
        0
    } else {
        exit::USAGE
    }
}

fn parse_kv(args: &[String]) -> Map<String, Value> {
    let mut m = Map::new();
    let mut stdin_used = false;
    for a in args {
        match a.split_once('=') {
            Some((k, v)) => {
                let v = arg_value(k, v, &mut stdin_used);
                m.insert(k.to_string(), Value::String(v));
            }
            None => fail(format!("argument {a:?} is not key=value"), exit::USAGE),
        }
    }
    m
}

/// An argument's value, from the command line or, so that a secret never has to be in any
/// process's argv, from elsewhere: `@-` stdin (one trailing newline dropped), `@env:VAR` the
/// environment, `@prompt` the terminal without echo. `@@...` is a literal value `@...`.
fn arg_value(name: &str, v: &str, stdin_used: &mut bool) -> String {
    if let Some(literal) = v.strip_prefix("@@") {
        return format!("@{literal}");
    }
    if v == "@-" {
        if std::mem::replace(stdin_used, true) {
            fail(
                format!("argument {name}: only one argument can read stdin (@-)"),
                exit::USAGE,
            );
        }
        let mut text = String::new();
        std::io::Read::read_to_string(&mut std::io::stdin(), &mut text).unwrap_or_else(|e| {
            fail(
                format!("argument {name}: cannot read it from stdin: {e}"),
                exit::USAGE,
            )
        });
        let text = text.strip_suffix('\n').unwrap_or(&text);
        return text.strip_suffix('\r').unwrap_or(text).to_string();
    }
    if let Some(var) = v.strip_prefix("@env:") {
        return std::env::var(var).unwrap_or_else(|_| {
            fail(
                format!("argument {name}: environment variable {var} is not set (or not UTF-8)"),
                exit::USAGE,
            )
        });
    }
    if v == "@prompt" {
        return prompt_hidden(name).unwrap_or_else(|e| {
            fail(
                format!("argument {name}: cannot ask on the terminal (@prompt): {e}; use @- or @env:VAR"),
                exit::USAGE,
            )
        });
    }
    v.to_string()
}

/// Asks for `name` on the controlling terminal with echo off, and restores the terminal.
fn prompt_hidden(name: &str) -> std::io::Result<String> {
    use std::io::{BufRead as _, Write as _};
    use std::os::fd::AsRawFd as _;
    let tty = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/tty")?;
    let fd = tty.as_raw_fd();
    // SAFETY: a zeroed termios is a valid buffer for tcgetattr to fill; fd is open.
    let mut term: libc::termios = unsafe { std::mem::zeroed() };
    if unsafe { libc::tcgetattr(fd, &mut term) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    let saved = term;
    term.c_lflag &= !libc::ECHO;
    // SAFETY: fd is open and term came from tcgetattr.
    unsafe { libc::tcsetattr(fd, libc::TCSANOW, &term) };
    let mut out = &tty;
    let asked = write!(out, "{name}: ").and_then(|()| out.flush());
    let mut line = String::new();
    let read = asked.and_then(|()| std::io::BufReader::new(&tty).read_line(&mut line));
    // SAFETY: restores what tcgetattr returned, on the same open fd.
    unsafe { libc::tcsetattr(fd, libc::TCSANOW, &saved) };
    let _ = writeln!(out);
    read?;
    Ok(line.trim_end_matches(['\n', '\r']).to_string())
}

fn duration_ms(text: &str) -> u64 {
    waymark_gateway::config::parse_duration(text)
        .unwrap_or_else(|e| fail(e, exit::USAGE))
        .as_millis() as u64
}

fn main() {
    let cli = Cli::parse();
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        // Colour only for a terminal: a daemon's stderr is its log file or the journal.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("WAYMARK_LOG")
                .unwrap_or_else(|_| "warn,waymark::daemon=info".into())
                // rmcp logs request parameters (secret arguments included) at debug level:
                // whatever WAYMARK_LOG says, it stays at warn so no secret reaches a log line.
                .add_directive("rmcp=warn".parse().expect("static directive")),
        )
        .init();
    // The daemon, the MCP shim and the demo serve many things at once; every other command is
    // one request to the daemon and starts faster without a pool of worker threads.
    let mut runtime = match cli.command {
        Command::Daemon | Command::Mcp | Command::Demo => {
            tokio::runtime::Builder::new_multi_thread()
        }
        _ => tokio::runtime::Builder::new_current_thread(),
    };
    let runtime = runtime.enable_all().build().expect("tokio runtime");
    let code = runtime.block_on(run(cli));
    std::io::stdout().flush().ok();
    std::process::exit(code);
}

async fn run(cli: Cli) -> i32 {
    let request = match &cli.command {
        Command::Init { dry_run } => return init(&cli, *dry_run).await,
        Command::Hosts(h) => return hosts(&cli, h).await,
        Command::Config(ConfigCommand::Check) => return config_check(&cli),
        Command::Demo => {
            return match demo::run().await {
                Ok(()) => 0,
                Err(e) => fail(format!("demo failed: {e}"), exit::ERROR),
            }
        }
        Command::Daemon => {
            let config = Arc::new(load_config(&cli));
            return match daemon::run(config).await {
                Ok(()) => 0,
                Err(e) => fail(e, exit::ERROR),
            };
        }
        Command::Mcp => {
            let config = load_config(&cli);
            return match waymark_mcp::serve_stdio(daemon_start(&config)).await {
                Ok(()) => 0,
                Err(e) => fail(e, exit::ERROR),
            };
        }
        Command::Audit(AuditCommand::Verify {
            ledger: Some(path),
            head,
        }) => {
            let ledger = open_ledger(path);
            return print_frame(
                &cli,
                service::audit_verify(&ledger, head.as_deref()).to_json(),
                None,
                [0, 0],
            );
        }
        Command::Audit(AuditCommand::Verify { ledger: None, head }) => Request::AuditVerify {
            exported_head: head.clone(),
        },
        Command::Audit(AuditCommand::Head) => Request::AuditHead,
        Command::Exec(ExecCommand::Run {
            tool,
            args,
            host,
            key,
            command,
        }) => {
            if tool.is_some() && !command.is_empty() {
                fail("give either a tool or `-- COMMAND`, not both", exit::USAGE);
            }
            Request::Call {
                tool: tool.clone(),
                args: parse_kv(args),
                host: host.clone(),
                raw: if command.is_empty() {
                    None
                } else {
                    Some(command.clone())
                },
                key: key.clone(),
                transport: Some("cli".into()),
                defer_delivery: false,
            }
        }
        Command::Exec(ExecCommand::Status { id }) => Request::Status {
            id: *id,
            defer_delivery: false,
        },
        Command::Exec(ExecCommand::Result { id }) => Request::Result {
            id: *id,
            defer_delivery: false,
        },
        Command::Exec(ExecCommand::List(l)) => Request::List {
            state: l
                .state
                .as_deref()
                .map(|s| protocol::answer::parse_state(s).unwrap_or_else(|e| fail(e, exit::USAGE))),
            host: l.host.clone(),
            tool: l.tool.clone(),
            actor: l.actor.clone(),
            since_ms: l.since.as_deref().map(|s| {
                waymark_gateway::flow::now()
                    .as_millis()
                    .saturating_sub(duration_ms(s))
            }),
            limit: l.limit,
            after: l.after,
        },
        Command::Exec(ExecCommand::Resume { id, args }) => {
            // `exec resume ID [TOOL key=value ...]`: a first word without `=` names the tool.
            let (tool, kv) = match args.split_first() {
                Some((tool, rest)) if !tool.contains('=') => (Some(tool.clone()), rest),
                _ => (None, &args[..]),
            };
            Request::Resume {
                id: *id,
                tool,
                args: parse_kv(kv),
                raw: None,
            }
        }
        Command::Exec(ExecCommand::Cancel { id }) => Request::Cancel { id: *id },
        Command::Exec(ExecCommand::Review {
            id,
            ran,
            did_not_run: _,
            note,
        }) => Request::Review {
            id: *id,
            ran: *ran,
            note: note.clone(),
        },
        Command::Exec(ExecCommand::Explain { id }) => Request::Explain { id: *id },
        Command::Approvals => Request::Approvals,
        Command::Approve { id } => Request::Approve { id: *id },
        Command::Deny { id, reason } => Request::Deny {
            id: *id,
            reason: reason.clone(),
        },
        Command::Lock => Request::Lock,
        Command::Unlock => Request::Unlock,
        Command::Runs { limit } => Request::Runs { limit: *limit },
        Command::Gc { older_than } => Request::Gc {
            older_than_ms: duration_ms(older_than),
        },
    };
    let config = Arc::new(load_config(&cli));
    let is_call = matches!(request, Request::Call { .. } | Request::Resume { .. });
    let is_result = matches!(request, Request::Result { .. });
    let show_output = is_call || is_result;
    let json = cli.json;
    let seen_id: std::sync::Mutex<Option<ExecutionId>> = std::sync::Mutex::new(None);
    // Bytes of stdout and stderr already written while the command ran.
    let printed: std::sync::Mutex<[u64; 2]> = std::sync::Mutex::new([0, 0]);
    let on_event = |e: &Event| match e {
        Event::Execution { id, attached } => {
            *seen_id.lock().expect("id") = Some(*id);
            if !json {
                match attached {
                    Some(a) => eprintln!(
                        "execution {id} (attached to the earlier call of the same intent: {})",
                        protocol::answer::attach_name(*a)
                    ),
                    None => eprintln!("execution {id}"),
                }
            }
        }
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
            let bytes = protocol::answer::decode_b64(data_b64);
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
    };
    // Every command that needs the ledger asks the daemon, which alone owns it; when none
    // answers, one is started (the same detached, race-safe start as `waymark mcp`).
    let control = Control::new(daemon_start(&config));
    let answer = async {
        if !is_call {
            return control.request(request, on_event).await;
        }
        // Ctrl-C leaves the execution to the daemon, which carries it on: say how to follow it.
        tokio::select! {
            a = control.request(request, on_event) => a,
            _ = tokio::signal::ctrl_c() => {
                let msg = match *seen_id.lock().expect("id") {
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
        Err(client::ClientError::NoDaemon) => fail(
            format!(
                "no daemon answers on {} and none could be started: {}. Nothing was sent.",
                config.daemon.socket.display(),
                control
                    .start_error()
                    .unwrap_or_else(|| "no reason given".into())
            ),
            exit::ERROR,
        ),
    };
    let already = *printed.lock().expect("printed");
    let carried = show_output.then(|| carried(&frame, is_result)).flatten();
    let code = print_frame(&cli, frame, carried.as_ref(), already);
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
                match control.request(req, |_| {}).await.map(Frame::answer::<OutputPage>) {
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

/// The output an answer carries, for a command that prints it (`exec run`, `exec result`).
struct Carried {
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
fn daemon_start(config: &Config) -> DaemonStart {
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

/// Stdout could not be written: a closed pipe ends the command quietly with 141 (what a
/// shell reports for a tool killed by SIGPIPE); anything else is an error.
fn stdout_failed(e: std::io::Error) -> ! {
    if e.kind() == std::io::ErrorKind::BrokenPipe {
        std::process::exit(exit::BROKEN_PIPE);
    }
    fail(format!("cannot write to stdout: {e}"), exit::ERROR)
}

/// Writes raw bytes to stdout (0) or stderr (1).
fn write_stream(i: usize, bytes: &[u8]) {
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

/// Opens the ledger in this process, for the commands that work without a daemon (`init`,
/// `audit verify --ledger`). A ledger a daemon owns is refused, never waited for or shared.
fn open_ledger(path: &std::path::Path) -> Ledger {
    Ledger::open(path).unwrap_or_else(|e| match e {
        LedgerError::Locked { .. } => fail(
            format!("{e}: a running daemon owns it. Ask the daemon instead (`waymark audit verify` without --ledger, `waymark audit head`), or stop it first"),
            exit::ERROR,
        ),
        e => fail(e, exit::ERROR),
    })
}

/// Prints a final frame and returns the exit code. `carried`: the output it carries, for a
/// command that prints it; `already` is how much of stdout and stderr was written while the
/// command ran.
fn print_frame(cli: &Cli, frame: Frame, carried: Option<&Carried>, already: [u64; 2]) -> i32 {
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

const SKELETON: &str = include_str!("../../../examples/waymark.toml");

async fn init(cli: &Cli, dry_run: bool) -> i32 {
    let d = defaults();
    let path = config_path(cli, &d);
    if path.exists() {
        outln!("configuration: {} (exists, kept)", path.display());
    } else if dry_run {
        outln!("configuration: would write {}", path.display());
    } else {
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).unwrap_or_else(|e| {
                fail(format!("cannot create {}: {e}", dir.display()), exit::ERROR)
            });
        }
        std::fs::write(&path, SKELETON)
            .unwrap_or_else(|e| fail(format!("cannot write {}: {e}", path.display()), exit::ERROR));
        outln!(
            "configuration: wrote {} (an example: edit hosts, credentials and tools)",
            path.display()
        );
    }
    if dry_run {
        return 0;
    }
    let config = Config::load(&path, &d).unwrap_or_else(|e| fail(e, exit::USAGE));
    // A running daemon owns the ledger: ask it, never open the ledger behind its back.
    match client::request(&config.daemon.socket, Request::AuditHead, |_| {}).await {
        Ok(Frame::Done { text, .. }) => outln!(
            "ledger: {} (owned by the running daemon; audit head {text})",
            config.ledger_path.display(),
        ),
        _ => {
            let ledger = open_ledger(&config.ledger_path);
            outln!(
                "ledger: {} (key in ledger.key, 0600; audit head {})",
                config.ledger_path.display(),
                ledger.head()
            );
        }
    }
    if let Some(dir) = config.daemon.socket.parent() {
        use std::os::unix::fs::DirBuilderExt;
        let _ = std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir);
        outln!("runtime directory: {}", dir.display());
    }
    0
}

async fn hosts(cli: &Cli, cmd: &HostsCommand) -> i32 {
    let config = Arc::new(load_config(cli));
    let ssh = SshHosts::new(config.clone());
    let entry = |name: &str| {
        config.hosts.get(name).cloned().unwrap_or_else(|| {
            fail(
                format!(
                    "unknown host {name:?}; configured: {}",
                    config.hosts.keys().cloned().collect::<Vec<_>>().join(", ")
                ),
                exit::USAGE,
            )
        })
    };
    match cmd {
        HostsCommand::List => {
            let rows: Vec<Value> = config
                .hosts
                .values()
                .map(|h| {
                    serde_json::json!({
                        "name": h.name, "target": format!("{}@{}:{}", h.user, h.address, h.port),
                        "credential": h.credential, "host_key_policy": h.host_key_policy.to_string(),
                        "known_hosts": h.known_hosts, "remote_dir": h.remote_dir, "max_sessions": h.max_sessions,
                    })
                })
                .collect();
            if cli.json {
                outln!("{}", serde_json::to_string_pretty(&rows).expect("json"));
            } else {
                for r in &rows {
                    outln!(
                        "{:<12} {:<32} credential={} policy={} known_hosts={}",
                        r["name"].as_str().unwrap_or(""),
                        r["target"].as_str().unwrap_or(""),
                        r["credential"].as_str().unwrap_or(""),
                        r["host_key_policy"].as_str().unwrap_or(""),
                        r["known_hosts"].as_str().unwrap_or("")
                    );
                }
            }
            0
        }
        HostsCommand::Check { name } => {
            let h = entry(name);
            let exec = ssh.executor(&h).unwrap_or_else(|e| fail(e, exit::USAGE));
            match exec.connect().await {
                Ok(()) => {
                    outln!("host {name}: connected to {}@{}:{}, host key pinned, authenticated, wrapper installed", h.user, h.address, h.port);
                    0
                }
                Err(e) => fail(e, exit::ERROR),
            }
        }
        HostsCommand::Trust { name, yes } => {
            let h = entry(name);
            let exec = ssh.executor(&h).unwrap_or_else(|e| fail(e, exit::USAGE));
            let rejection = match exec.connect().await {
                Ok(()) => {
                    outln!(
                        "host {name}: its key is already pinned in {}",
                        h.known_hosts.display()
                    );
                    return 0;
                }
                Err(waymark_ssh::Error::NotSent(waymark_ssh::ConnectError::HostKey(r))) => r,
                Err(e) => fail(
                    format!("cannot reach host {name} to read its key: {e}"),
                    exit::ERROR,
                ),
            };
            let line = match &rejection.problem {
                waymark_ssh::HostKeyProblem::Unknown { line_to_add, .. } => line_to_add.clone(),
                _ => fail(format!("{rejection}\nRefusing to pin over an existing entry: remove it by hand only if the host was really re-keyed."), exit::ERROR),
            };
            outln!(
                "host {name} ({}) presents {} key {}",
                rejection.target,
                rejection.algorithm,
                rejection.fingerprint
            );
            if !yes {
                out!(
                    "Pin it into {}? Compare the fingerprint out of band first. [y/N] ",
                    h.known_hosts.display()
                );
                let _ = std::io::stdout().flush();
                let mut answer = String::new();
                let _ = std::io::stdin().read_line(&mut answer);
                if !matches!(answer.trim(), "y" | "Y" | "yes") {
                    outln!("Not pinned.");
                    return exit::BLOCKED;
                }
            }
            if let Err(e) = append_known_host(&h.known_hosts, &line) {
                fail(
                    format!("cannot write {}: {e}", h.known_hosts.display()),
                    exit::ERROR,
                );
            }
            exec.disconnect();
            match exec.connect().await {
                Ok(()) => {
                    outln!(
                        "Pinned in {} and verified: connected and authenticated.",
                        h.known_hosts.display()
                    );
                    0
                }
                Err(e) => fail(
                    format!("pinned, but the check afterwards failed: {e}"),
                    exit::ERROR,
                ),
            }
        }
    }
}

fn append_known_host(path: &std::path::Path, line: &str) -> std::io::Result<()> {
    use std::os::unix::fs::OpenOptionsExt;
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .mode(0o600)
        .open(path)?;
    let existing = std::fs::read_to_string(path).unwrap_or_default();
    let sep = if existing.is_empty() || existing.ends_with('\n') {
        ""
    } else {
        "\n"
    };
    f.write_all(format!("{sep}{line}\n").as_bytes())?;
    f.sync_all()
}
