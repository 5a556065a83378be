//! Exit codes of the `waymark` command, defined once: the daemon puts them in its answers,
//! the CLI exits with them, and MCP reports them. A completed command exits with the remote
//! command's own exit code (128 + N when a signal N killed it); Waymark's own outcomes use
//! codes that commands rarely use. The CLI's help lists them (`waymark`'s `exit::HELP`).

/// The user declined at a prompt (`hosts trust`): nothing changed.
pub const DECLINED: i32 = 1;
/// Bad arguments or configuration.
pub const USAGE: i32 = 2;
/// The outcome is unknown: the command may have started and may still be running, or an HTTP
/// operation finished but its status answer does not prove it succeeded. Run
/// `waymark exec status <id>`; do not retry blindly.
pub const UNKNOWN: i32 = 200;
/// It is running: the host's marker said so at the last look (or, when the host did not
/// answer in time, the ledger's last word was that it runs). Not an unknown outcome: wait, and
/// ask `waymark exec status <id>` again.
pub const RUNNING: i32 = 205;
/// It did not start: nothing ran, it is safe to try again.
pub const NOT_STARTED: i32 = 201;
/// It is blocked: denied, awaiting approval, interrupted (needs review), or expired.
pub const BLOCKED: i32 = 202;
/// It was stopped: timed out on the host, or cancelled.
pub const STOPPED: i32 = 203;
/// Ctrl-C (SIGINT) stopped the CLI while it waited; the execution goes on in the daemon.
pub const INTERRUPTED: i32 = 130;
/// Stdout's reader went away (128 + SIGPIPE, what a shell pipeline expects).
pub const BROKEN_PIPE: i32 = 141;
/// Waymark itself failed (ledger locked or damaged, daemon unreachable, host unreachable for a
/// status check).
pub const ERROR: i32 = 204;
