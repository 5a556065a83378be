//! The command line: what clap parses ([`Cli`]), and the commands by group: [`local`] works
//! on files in this process (init, config check, hosts), [`ask`] sends one request to the
//! daemon and prints its answer, [`values`] reads `key=value` arguments.

pub mod ask;
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
        #[arg(long, default_value = "30d")]
        older_than: String,
    },
}

#[derive(Subcommand)]
pub enum ExecCommand {
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
pub struct ListArgs {
    #[arg(long)]
    pub state: Option<String>,
    #[arg(long)]
    pub host: Option<String>,
    #[arg(long)]
    pub tool: Option<String>,
    #[arg(long)]
    pub actor: Option<String>,
    /// Only executions accepted within this duration (e.g. 2h).
    #[arg(long)]
    pub since: Option<String>,
    #[arg(long)]
    pub limit: Option<usize>,
    /// Continue after this execution id (the last one of the previous page).
    #[arg(long)]
    pub after: Option<ExecutionId>,
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
    },
    /// The current chain head (SEQ:HASH), to keep somewhere else.
    Head,
}
