//! The command line: what clap parses ([`Cli`]), and the commands by group: [`local`] works
//! on files in this process (init, config check, hosts), [`ask`] sends one request to the
//! daemon and prints its answer, [`values`] reads `key=value` arguments.

pub mod ask;
pub mod export;
pub mod local;
pub mod values;

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};
use waymark_core::ExecutionId;

use crate::exit;

#[derive(Parser)]
#[command(name = "waymark", version, about = "Run AI agents' actions on SSH hosts, exactly once.", after_help = exit::HELP)]
pub struct Cli {
    /// Configuration file [default: $XDG_CONFIG_HOME/waymark/waymark.toml]
    #[arg(long, global = true, env = "WAYMARK_CONFIG")]
    pub config: Option<PathBuf>,
    /// Print machine-readable JSON instead of text.
    #[arg(long, global = true)]
    pub json: bool,
    /// Write a command's output to a terminal as it is, control sequences included (colours,
    /// but also title changes and screen clears), as `less -R` does. By default a terminal
    /// gets them escaped (`^[`); a pipe or a file always gets the bytes as they are.
    #[arg(long, global = true)]
    pub raw_control_chars: bool,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand)]
pub enum Command {
    /// Create a configuration skeleton, the ledger and its key, and the runtime directory.
    Init {
        /// Overwrite nothing; just show what would be created.
        #[arg(long)]
        dry_run: bool,
    },
    /// Run the daemon in the foreground (owns the ledger and the SSH connections); or see,
    /// reload or stop the one running.
    Daemon {
        #[command(subcommand)]
        action: Option<DaemonCommand>,
        /// Make the ledger when its directory is missing or empty (as `waymark init` does);
        /// without it a missing ledger is refused, never made by accident.
        #[arg(long)]
        init: bool,
        /// Serve a ledger that is behind its witness (events lost to damage, or files rolled
        /// back to an older copy) as it is; the acceptance is recorded in the audit chain.
        #[arg(long)]
        accept_rollback: bool,
    },
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
    Approve {
        /// The execution ID (`act_...`), as `waymark approvals` lists it.
        id: ExecutionId,
    },
    /// Deny an action that awaits approval.
    Deny {
        /// The execution ID (`act_...`), as `waymark approvals` lists it.
        id: ExecutionId,
        /// Why, in words: recorded in the audit chain and told to the caller.
        #[arg(long)]
        reason: String,
    },
    /// Refuse every new action (recorded) until `waymark unlock`.
    Lock {
        /// Why, in words: recorded in the audit chain and told to every caller refused
        /// meanwhile (e.g. "database migration until 14:00").
        #[arg(long)]
        reason: Option<String>,
    },
    /// Accept new actions again.
    Unlock,
    /// Who the daemon takes you for (the actor it proves from your connection), and what that
    /// actor may do.
    Whoami,
    /// The agent-session log.
    Runs {
        /// Show at most this many runs, newest first (default 50).
        #[arg(long)]
        limit: Option<usize>,
    },
    /// The ledger itself: backups.
    #[command(subcommand)]
    Ledger(LedgerCommand),
    /// The audit chain.
    #[command(subcommand)]
    Audit(AuditCommand),
    /// Shell completions on stdout: `waymark completions bash > /etc/bash_completion.d/waymark`.
    Completions {
        /// The shell: bash, zsh, fish, elvish or powershell.
        #[arg(value_enum)]
        shell: clap_complete::Shell,
    },
    /// The manual page (roff) on stdout, or every page (one per command) into a directory:
    /// `waymark man --dir ~/.local/share/man/man1`.
    Man {
        /// Write waymark.1, waymark-exec.1, waymark-exec-run.1, ... into this directory.
        #[arg(long)]
        dir: Option<PathBuf>,
    },
    /// Remove resolved executions older than a duration (e.g. 30d); unresolved ones stay.
    Gc {
        /// Age beyond which a resolved execution goes: a number and a unit, s, m, h or d.
        #[arg(long, default_value = "30d")]
        older_than: String,
        /// Say what would be removed, removing nothing.
        #[arg(long)]
        dry_run: bool,
    },
}

#[derive(Subcommand)]
pub enum ExecCommand {
    /// Run a tool (`waymark exec run TOOL key=value ...`) or a raw command where policy allows
    /// (`waymark exec run --host H -- CMD ...`), or a tool on all its hosts at once
    /// (`--all-hosts`). Prints the execution ID first.
    Run {
        /// Tool name; omit with `--host H -- CMD ...`.
        tool: Option<String>,
        /// key=value arguments of the tool. A secret need not be on any command line:
        /// key=@- reads the value from stdin, key=@env:VAR from the environment, key=@prompt
        /// asks on the terminal without echo (key=@@x is the literal value @x).
        args: Vec<String>,
        /// The host: for a raw command (`--host H -- CMD ...`), or to pick one of a tool's
        /// hosts when the tool lets the caller choose.
        #[arg(long)]
        host: Option<String>,
        /// Run the tool on every host it may run on, at once: one execution per host, each
        /// with its own ID; prints a summary (host, execution ID, state, exit code). The same
        /// call again attaches per host: nothing runs twice on a host.
        #[arg(long, conflicts_with_all = ["host", "command"], requires = "tool")]
        all_hosts: bool,
        /// Idempotency key: repeats with the same key (within the tool's window) attach.
        #[arg(long)]
        key: Option<String>,
        /// The raw command, after `--`.
        #[arg(last = true)]
        command: Vec<String>,
    },
    /// What really happened: the ledger plus a live check of the host's marker.
    Status {
        /// The execution ID (`act_...`).
        id: ExecutionId,
        /// How long to wait for the host (default 5s): past it, the answer is what the ledger
        /// knows, with a line saying that the host did not answer in time. Seconds, or a
        /// number and a unit (500ms, 1m).
        #[arg(long, value_parser = values::read_timeout)]
        timeout: Option<std::time::Duration>,
    },
    /// The stored output of an execution.
    Result {
        /// The execution ID (`act_...`).
        id: ExecutionId,
        /// How long to wait for the host when the execution may still be there (default 5s;
        /// see `exec status --timeout`).
        #[arg(long, value_parser = values::read_timeout)]
        timeout: Option<std::time::Duration>,
    },
    /// List executions.
    List(ListArgs),
    /// Re-send an execution under its own id (safe: the host marker refuses a second start).
    Resume {
        /// The execution ID (`act_...`) to send again under its own id.
        id: ExecutionId,
        /// The tool call again, for tools with arguments (secret ones are not stored):
        /// `TOOL key=value ...`.
        args: Vec<String>,
    },
    /// Cancel an execution (before dispatch, or its process group on the host).
    Cancel {
        /// The execution ID (`act_...`).
        id: ExecutionId,
    },
    /// Resolve an unknown or interrupted execution by human review.
    #[command(group(clap::ArgGroup::new("finding").required(true).args(["ran", "did_not_run"])))]
    Review {
        /// The execution ID (`act_...`) of an unknown or interrupted execution.
        id: ExecutionId,
        /// The reviewer found that the command ran on the host.
        #[arg(long)]
        ran: bool,
        /// The reviewer found that the command did not run.
        #[arg(long)]
        did_not_run: bool,
        /// What the reviewer checked, in words: recorded in the audit chain.
        #[arg(long)]
        note: String,
    },
    /// The incident view: who called, what was sent, what the host said, what was delivered.
    Explain {
        /// The execution ID (`act_...`).
        id: ExecutionId,
    },
}

#[derive(Subcommand)]
pub enum ConfigCommand {
    /// Load and validate the configuration (references, patterns, durations, key and
    /// known_hosts files, secret-in-argv warnings) without starting or contacting anything.
    /// Exit 0 when usable (warnings included), 2 with file:line:column errors otherwise.
    Check,
}

#[derive(Subcommand)]
pub enum HostsCommand {
    /// List configured hosts.
    List,
    /// Connect, authenticate and install the wrapper: proves a host is usable.
    Check {
        /// The host's name in the configuration (`[hosts.NAME]`).
        name: String,
    },
    /// Show the host's key fingerprint and pin it into its known_hosts file.
    Trust {
        /// The host's name in the configuration (`[hosts.NAME]`).
        name: String,
        /// Pin without asking.
        #[arg(long)]
        yes: bool,
    },
    /// Make this daemon's ledger the owner of the host's execution markers, when the host
    /// holds markers of another ledger that is gone for good (recorded in the audit chain).
    Adopt {
        /// The host's name in the configuration (`[hosts.NAME]`).
        name: String,
    },
}

#[derive(Args)]
pub struct ListArgs {
    /// Only executions in this state.
    #[arg(long, value_parser = state_names())]
    pub state: Option<String>,
    /// Only executions on this host (its name in the configuration).
    #[arg(long)]
    pub host: Option<String>,
    /// Only executions of this tool.
    #[arg(long)]
    pub tool: Option<String>,
    /// Only executions asked for by this actor (as `exec explain` names it: a configured
    /// actor's name, or `uid:1000` in single-user mode).
    #[arg(long)]
    pub actor: Option<String>,
    /// Only your own executions (the actor the daemon takes you for, see `waymark whoami`).
    #[arg(long, conflicts_with = "actor")]
    pub mine: bool,
    /// Only executions accepted within this duration (e.g. 2h).
    #[arg(long)]
    pub since: Option<String>,
    /// Show at most this many executions, newest first (default 50).
    #[arg(long)]
    pub limit: Option<usize>,
    /// Continue after this execution id (the last one of the previous page).
    #[arg(long)]
    pub after: Option<ExecutionId>,
}

/// The states `--state` takes, as the ledger names them.
fn state_names() -> clap::builder::PossibleValuesParser {
    clap::builder::PossibleValuesParser::new(
        waymark_core::ExecState::ALL.map(|s| clap::builder::PossibleValue::new(s.as_str())),
    )
}

#[derive(Subcommand)]
pub enum DaemonCommand {
    /// What the running daemon runs: pid, uptime, version, its configuration (and whether the
    /// file changed since), ledger, unresolved executions, host connections, listeners.
    Status,
    /// Read the configuration file again (as SIGHUP does): new calls use it at once; a broken
    /// file changes nothing and its error is shown.
    Reload,
    /// Stop the running daemon gracefully: it accepts nothing new and finishes what it is
    /// answering; commands running on hosts go on and the next start reconciles them.
    Stop {
        /// Wait until the daemon's process has exited.
        #[arg(long)]
        wait: bool,
        /// How long the requests being answered may take to finish (e.g. 30s; default 10s).
        #[arg(long)]
        grace: Option<String>,
    },
}

#[derive(Subcommand)]
pub enum LedgerCommand {
    /// A consistent copy of the ledger into DIR (new or empty), taken through the running
    /// daemon while it serves, or offline with --ledger. `ledger restore` puts it back.
    Backup {
        /// Where the copy goes (on the daemon's machine; made 0700).
        dir: PathBuf,
        /// Copy this ledger directory offline instead of asking the daemon.
        #[arg(long)]
        ledger: Option<PathBuf>,
    },
    /// Put a backup back, with the daemon stopped: the backup is verified whole and must be of
    /// this ledger; the replaced database is kept beside it; the ledger's witness stays, so the
    /// answer (and the next daemon start) says which events the backup lacks.
    Restore {
        /// The backup directory (`ledger backup` made it).
        backup: PathBuf,
        /// The ledger directory to restore into (default: from the configuration).
        #[arg(long)]
        ledger: Option<PathBuf>,
    },
    /// Give the space of what `gc` removed back to the disk, with the daemon stopped: the
    /// database is copied into a new one (only what it holds now), proven equal, swapped in and
    /// verified to the same head; then the old one is removed.
    Compact {
        /// The ledger directory (default: from the configuration).
        #[arg(long)]
        ledger: Option<PathBuf>,
    },
}

#[derive(Subcommand)]
pub enum AuditCommand {
    /// Walk the hash chain from genesis; name the first bad event. Works with the daemon stopped.
    Verify {
        /// Ledger directory (default: from the configuration).
        #[arg(long)]
        ledger: Option<PathBuf>,
        /// A head exported earlier (SEQ:HASH): prove nothing before it was truncated or edited.
        #[arg(long)]
        head: Option<String>,
        /// Start from a head kept earlier (SEQ:HASH), trusted, instead of genesis: only the
        /// events after it are checked (a quick check of what was added since).
        #[arg(long, conflicts_with = "export")]
        since: Option<String>,
        /// Verify this file of `audit export` instead of a ledger: each line the next event,
        /// linked to the one before, its hash proven by the ledger's key (--ledger names the
        /// ledger whose key it is; default: the configured one).
        #[arg(long)]
        export: Option<PathBuf>,
    },
    /// The current chain head (SEQ:HASH), to keep somewhere else.
    Head,
    /// The chain's events as JSON lines (for a SIEM), each with its sequence, `prev` and `hash`
    /// so the export can be checked link by link; up to the head when it started.
    Export {
        /// Start at this event sequence number (default: the oldest kept).
        #[arg(long)]
        from: Option<u64>,
        /// Only events recorded within this duration (e.g. 24h).
        #[arg(long)]
        since: Option<String>,
        /// Output format; `jsonl` (one event per line) is the one there is.
        #[arg(long, default_value = "jsonl", value_parser = ["jsonl"])]
        format: String,
        /// Read this ledger directory offline instead of asking the daemon.
        #[arg(long)]
        ledger: Option<PathBuf>,
    },
    /// Calls refused for being outside their actor's rights, newest first (operators only).
    Refused {
        /// Show at most this many, newest first (default 50).
        #[arg(long)]
        limit: Option<usize>,
    },
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    use super::Cli;

    /// Every argument of every command says what it is for in `--help`.
    #[test]
    fn every_argument_has_help_text() {
        fn walk(cmd: &clap::Command, path: &str, missing: &mut Vec<String>) {
            for arg in cmd.get_arguments() {
                let id = arg.get_id().as_str();
                if arg.get_help().is_none() && !matches!(id, "help" | "version") {
                    missing.push(format!("{path} {id}"));
                }
            }
            for sub in cmd.get_subcommands() {
                walk(sub, &format!("{path} {}", sub.get_name()), missing);
            }
        }
        let mut missing = Vec::new();
        walk(&Cli::command(), "waymark", &mut missing);
        assert!(missing.is_empty(), "arguments without help: {missing:?}");
    }
}
