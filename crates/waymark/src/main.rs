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

mod cli;
mod daemon;
mod demo;
mod envfile;
mod exit;
mod ledger_backend;
mod metrics;
mod service;

use waymark_protocol as protocol;

use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;

use clap::Parser;
use waymark_gateway::config::{Config, DefaultPaths};

use cli::local::{config_check, hosts, init, open_ledger};
use cli::values::{duration_ms, parse_kv};
use cli::{
    AuditCommand, Cli, Command, ConfigCommand, DaemonCommand, ExecCommand, HostsCommand,
    LedgerCommand,
};
use protocol::Request;

fn defaults() -> DefaultPaths {
    DefaultPaths::from_env(|k| std::env::var(k).ok(), unsafe { libc::geteuid() })
}

fn fail(message: impl std::fmt::Display, code: i32) -> ! {
    if JSON_ERRORS.load(std::sync::atomic::Ordering::Relaxed) {
        let error = serde_json::json!({"error": message.to_string(), "exit": code});
        outln!("{error}");
    } else {
        eprintln!("waymark: {message}");
    }
    std::io::stdout().flush().ok();
    std::process::exit(code)
}

/// Set under `--json` (but never for `waymark mcp`, whose stdout is MCP's): [`fail`] then
/// writes its error as one JSON object on stdout, `{"error": ..., "exit": N}`.
static JSON_ERRORS: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// The configuration file: `--config`, else the XDG default.
fn config_path(cli: &Cli, d: &DefaultPaths) -> PathBuf {
    cli.config.clone().unwrap_or_else(|| d.config_file.clone())
}

/// The configuration, or exit 2 with its error. Its warnings are not printed here: `config
/// check` and the daemon's start say them, once, rather than every command.
fn load_config(cli: &Cli) -> Config {
    let d = defaults();
    Config::load(&config_path(cli, &d), &d).unwrap_or_else(|e| fail(e, exit::USAGE))
}

fn main() {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => {
            use clap::error::ErrorKind;
            let asked_json = std::env::args_os().any(|a| a == "--json");
            let is_error = !matches!(e.kind(), ErrorKind::DisplayHelp | ErrorKind::DisplayVersion);
            if asked_json && is_error {
                JSON_ERRORS.store(true, std::sync::atomic::Ordering::Relaxed);
                fail(e.render().to_string().trim_end(), exit::USAGE);
            }
            e.exit()
        }
    };
    if cli.json && !matches!(cli.command, Command::Mcp) {
        JSON_ERRORS.store(true, std::sync::atomic::Ordering::Relaxed);
    }
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
    quiet_sled_panics();
    // The daemon's env_file goes into its environment now, while this is the only thread.
    if let Command::Daemon { action: None, .. } = &cli.command {
        let d = defaults();
        if let Ok(config) = Config::load(&config_path(&cli, &d), &d) {
            if let Err(e) = envfile::apply(&config) {
                fail(e, exit::USAGE);
            }
        }
    }
    // The daemon, the MCP shim and the demo serve many things at once; every other command is
    // one request to the daemon and starts faster without a pool of worker threads.
    let mut runtime = match cli.command {
        Command::Daemon { .. } | Command::Mcp | Command::Demo => {
            tokio::runtime::Builder::new_multi_thread()
        }
        _ => tokio::runtime::Builder::new_current_thread(),
    };
    let runtime = runtime.enable_all().build().expect("tokio runtime");
    let code = runtime.block_on(run(cli));
    std::io::stdout().flush().ok();
    std::process::exit(code);
}

/// sled 0.34 panics on some damaged files instead of returning an error. The ledger turns
/// such a panic into an error that names the ledger and what to do, which the command prints;
/// the panic's own message ("thread 'main' panicked at .../sled-0.34.7/...") would only bury it,
/// so it goes to the debug log. Every other panic is printed as Rust prints it.
fn quiet_sled_panics() {
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        if info
            .location()
            .is_some_and(|l| l.file().contains("/sled-0."))
        {
            tracing::debug!(panic = %info, "sled panicked on damaged files");
            return;
        }
        default(info)
    }));
}

/// `waymark completions SHELL`: generated from the clap definitions, so they never drift.
fn completions(cli: &Cli, shell: clap_complete::Shell) -> i32 {
    let mut out = Vec::new();
    let mut cmd = <Cli as clap::CommandFactory>::command();
    // The configured tools and hosts, as the configuration names them now: the script offers
    // them (generate it again after adding one). No configuration: no names, still a script.
    let d = defaults();
    if let Ok(config) = Config::load(&config_path(cli, &d), &d) {
        // clap takes 'static names; this process prints one script and exits.
        let names = |v: Vec<String>| -> Vec<&'static str> {
            v.into_iter()
                .map(|n| &*Box::leak(n.into_boxed_str()))
                .collect()
        };
        let tools = names(config.tools.keys().cloned().collect());
        let hosts = names(config.hosts.keys().cloned().collect());
        let offer = |a: clap::Arg, names: &[&'static str]| {
            a.value_parser(clap::builder::PossibleValuesParser::new(names.to_vec()))
        };
        cmd = cmd.mut_subcommand("exec", |exec| {
            // In place (mut_arg would move the positional `tool` after the others).
            exec.mut_subcommand("run", |run| {
                run.mut_args(|a| match a.get_id().as_str() {
                    "tool" => offer(a, &tools),
                    "host" => offer(a, &hosts),
                    _ => a,
                })
            })
        });
    }
    clap_complete::generate(shell, &mut cmd, "waymark", &mut out);
    write_stdout(&out)
}

/// `waymark man [--dir D]`: the page of `waymark` on stdout, or every command's page into D.
fn man(dir: Option<&std::path::Path>) -> i32 {
    let cmd = <Cli as clap::CommandFactory>::command();
    match dir {
        Some(dir) => {
            if let Err(e) = std::fs::create_dir_all(dir) {
                fail(format!("cannot create {}: {e}", dir.display()), exit::ERROR);
            }
            match clap_mangen::generate_to(cmd, dir) {
                Ok(()) => {
                    outln!("manual pages written to {}", dir.display());
                    0
                }
                Err(e) => fail(
                    format!("cannot write manual pages to {}: {e}", dir.display()),
                    exit::ERROR,
                ),
            }
        }
        None => {
            let mut out = Vec::new();
            clap_mangen::Man::new(cmd)
                .render(&mut out)
                .expect("rendering into memory cannot fail");
            write_stdout(&out)
        }
    }
}

/// Writes `bytes` to stdout with the rule of [`outln!`].
fn write_stdout(bytes: &[u8]) -> i32 {
    let mut stdout = std::io::stdout().lock();
    if let Err(e) = stdout.write_all(bytes).and_then(|()| stdout.flush()) {
        stdout_failed(e);
    }
    0
}

async fn run(cli: Cli) -> i32 {
    let request = match &cli.command {
        Command::Init { dry_run } => return init(&cli, *dry_run).await,
        Command::Hosts(HostsCommand::Adopt { name }) => Request::AdoptHost { host: name.clone() },
        Command::Hosts(h) => return hosts(&cli, h).await,
        Command::Config(ConfigCommand::Check) => return config_check(&cli).await,
        Command::Completions { shell } => return completions(&cli, *shell),
        Command::Man { dir } => return man(dir.as_deref()),
        Command::Demo => {
            return match demo::run().await {
                Ok(()) => 0,
                Err(e) => fail(format!("demo failed: {e}"), exit::ERROR),
            }
        }
        Command::Daemon {
            action: Some(DaemonCommand::Status),
            ..
        } => Request::DaemonStatus,
        Command::Daemon {
            action: Some(DaemonCommand::Reload),
            ..
        } => {
            // A file that does not load is refused here as the daemon would refuse it (the
            // same parser): the daemon keeps what it runs.
            let d = defaults();
            if let Err(e) = Config::load(&config_path(&cli, &d), &d) {
                fail(
                    format!(
                        "the configuration was not reloaded; the daemon keeps the one it runs: {e}"
                    ),
                    exit::USAGE,
                );
            }
            Request::DaemonReload
        }
        Command::Daemon {
            action: Some(DaemonCommand::Stop { wait, grace }),
            ..
        } => {
            let grace_ms = grace.as_deref().map(duration_ms);
            return cli::ask::daemon_stop(&cli, *wait, grace_ms).await;
        }
        Command::Daemon {
            action: None,
            init,
            accept_rollback,
        } => {
            let d = defaults();
            let read = service::lifecycle::read_config(&config_path(&cli, &d), &d);
            let config = read.config.unwrap_or_else(|e| fail(e, exit::USAGE));
            for w in &config.warnings {
                eprintln!("waymark: warning: {w}");
            }
            let start = ledger_backend::Start {
                init: *init,
                accept_rollback: *accept_rollback,
            };
            return match daemon::run(Arc::new(config), read.hash, start).await {
                Ok(()) => 0,
                Err(e) => fail(e.message, e.code),
            };
        }
        Command::Mcp => {
            let config = load_config(&cli);
            cli::ask::warn_if_stale(&config);
            return match waymark_mcp::serve_stdio(cli::ask::daemon_start(&config)).await {
                Ok(()) => 0,
                Err(e) => fail(e, exit::ERROR),
            };
        }
        Command::Audit(AuditCommand::Verify {
            ledger,
            head,
            export: Some(file),
            ..
        }) => {
            return cli::export::verify_export(&cli, file, head.as_deref(), ledger.as_deref());
        }
        Command::Audit(AuditCommand::Verify {
            ledger: Some(path),
            head,
            since,
            export: None,
        }) => {
            let ledger = open_ledger(path, waymark_ledger::WitnessCheck::Report);
            return cli::ask::print_frame(
                &cli,
                service::audit_verify(
                    &ledger,
                    head.as_deref(),
                    since.as_deref(),
                    &|done, total| cli::ask::show_progress("events verified", done, Some(total)),
                )
                .await
                .to_json(),
                None,
                [0, 0],
            );
        }
        Command::Audit(AuditCommand::Verify {
            ledger: None,
            head,
            since,
            export: None,
        }) => Request::AuditVerify {
            exported_head: head.clone(),
            since: since.clone(),
        },
        Command::Audit(AuditCommand::Head) => Request::AuditHead,
        Command::Audit(AuditCommand::Export {
            from,
            since,
            ledger,
            ..
        }) => {
            let since = since.as_deref().map(duration_ms);
            return cli::export::audit_export(&cli, *from, since, ledger.as_deref()).await;
        }
        Command::Ledger(LedgerCommand::Backup {
            dir,
            ledger: Some(path),
        }) => {
            let ledger = open_ledger(path, waymark_ledger::WitnessCheck::Report);
            let frame = service::ledger_backup(&ledger, &dir.display().to_string()).await;
            return cli::ask::print_frame(&cli, frame.to_json(), None, [0, 0]);
        }
        Command::Ledger(LedgerCommand::Backup { dir, ledger: None }) => {
            // The daemon runs elsewhere (its own working directory): it gets an absolute path.
            let dir = std::path::absolute(dir)
                .unwrap_or_else(|e| fail(format!("{}: {e}", dir.display()), exit::USAGE));
            Request::LedgerBackup {
                dir: dir.display().to_string(),
            }
        }
        Command::Ledger(LedgerCommand::Restore { backup, ledger }) => {
            return cli::local::ledger_restore(&cli, backup, ledger.as_deref());
        }
        Command::Ledger(LedgerCommand::Compact { ledger }) => {
            return cli::local::ledger_compact(&cli, ledger.as_deref());
        }
        Command::Audit(AuditCommand::Refused { limit }) => Request::AuditRefused { limit: *limit },
        Command::Whoami => Request::WhoAmI,
        Command::Exec(ExecCommand::Run {
            tool: Some(tool),
            args,
            all_hosts: true,
            key,
            ..
        }) => Request::FanOut {
            tool: tool.clone(),
            args: parse_kv(args),
            hosts: None,
            key: key.clone(),
            transport: Some("cli".into()),
            defer_delivery: false,
        },
        Command::Exec(ExecCommand::Run {
            tool,
            args,
            host,
            key,
            command,
            ..
        }) => {
            if tool.is_some() && !command.is_empty() {
                fail("give either a tool or `-- COMMAND`, not both", exit::USAGE);
            }
            let args = parse_kv(args);
            if host.is_some() && args.contains_key("host") {
                fail(
                    "argument host is given twice (`--host` and host=); give it once",
                    exit::USAGE,
                );
            }
            Request::Call {
                tool: tool.clone(),
                args,
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
        Command::Exec(ExecCommand::Status { id, .. }) => Request::Status {
            id: *id,
            defer_delivery: false,
        },
        Command::Exec(ExecCommand::Result { id, .. }) => Request::Result {
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
            mine: l.mine,
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
        Command::Lock { reason } => Request::Lock {
            reason: reason.clone(),
        },
        Command::Unlock => Request::Unlock,
        Command::Runs { limit } => Request::Runs { limit: *limit },
        Command::Gc {
            older_than,
            dry_run,
        } => Request::Gc {
            older_than_ms: duration_ms(older_than),
            dry_run: *dry_run,
        },
    };
    cli::ask::ask(&cli, request).await
}

/// Stdout could not be written: a closed pipe ends the command quietly with 141 (what a
/// shell reports for a tool killed by SIGPIPE); anything else is an error.
fn stdout_failed(e: std::io::Error) -> ! {
    if e.kind() == std::io::ErrorKind::BrokenPipe {
        std::process::exit(exit::BROKEN_PIPE);
    }
    fail(format!("cannot write to stdout: {e}"), exit::ERROR)
}
