//! Exit codes of the `waymark` command: the codes themselves are the protocol's
//! ([`waymark_protocol::exit`], one definition for daemon, CLI and MCP); here, how a fan-out
//! combines them and the help text that lists them.

pub use waymark_protocol::exit::*;

/// The exit code of a fan-out (`exec run TOOL --all-hosts`) from its hosts' codes: 0 only
/// when every host completed with 0; otherwise the most serious class any host is in, in
/// this order: unknown (200), still running (205), Waymark failed (204), blocked (202),
/// stopped (203), did not start (201), bad arguments (2), then the largest exit code a command
/// completed with.
pub fn fan_out(codes: &[i32]) -> i32 {
    const SERIOUS: [i32; 7] = [
        UNKNOWN,
        RUNNING,
        ERROR,
        BLOCKED,
        STOPPED,
        NOT_STARTED,
        USAGE,
    ];
    SERIOUS
        .into_iter()
        .find(|c| codes.contains(c))
        .or_else(|| codes.iter().copied().max())
        .unwrap_or(0)
}

/// The help text listing every code.
pub const HELP: &str = "\
EXIT CODES:
    N      `exec run`, `exec status`, `exec result`: the remote command completed with exit
           code N (128+S when signal S killed it); an HTTP request: 0 when the target's
           answer says it succeeded, 1 when it says it failed (4xx, 5xx)
    0      success (other commands)
    1      declined at a prompt (`hosts trust`): nothing changed
    2      bad arguments or configuration (under --json: {\"error\": ..., \"exit\": 2} on stdout)
    200    outcome UNKNOWN: it may have started and may still be running, or an HTTP
           operation finished and its status answer does not prove it succeeded;
           run `waymark exec status <id>`, do not retry blindly
    205    still RUNNING: the host's marker said so at the last look (`exec status`,
           `exec result` of a command not done yet); wait, then ask again
    201    did not start: nothing ran; safe to try again (`hosts check`: nothing reached
           the host)
    202    blocked: denied, awaiting approval, interrupted (needs review) or expired
    203    stopped: timed out on the host, or cancelled
    204    Waymark failed (ledger locked or damaged, daemon unreachable, ...)
    130    interrupted (Ctrl-C) while waiting: the execution goes on in the daemon;
           the message names it and how to follow it
    141    stdout was closed by its reader (a pipe)
    `exec run TOOL --all-hosts`: 0 when every host completed with 0, else the most
           serious host's class: 200 > 205 > 204 > 202 > 203 > 201 > 2 > the largest N";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fan_out_exits_with_its_most_serious_host() {
        assert_eq!(fan_out(&[0, 0, 0]), 0);
        assert_eq!(fan_out(&[0, 3, 1]), 3);
        assert_eq!(fan_out(&[0, NOT_STARTED, 7]), NOT_STARTED);
        assert_eq!(fan_out(&[STOPPED, NOT_STARTED]), STOPPED);
        assert_eq!(fan_out(&[BLOCKED, STOPPED]), BLOCKED);
        assert_eq!(fan_out(&[BLOCKED, ERROR]), ERROR);
        assert_eq!(fan_out(&[ERROR, UNKNOWN, 0]), UNKNOWN);
        assert_eq!(fan_out(&[ERROR, RUNNING, 0]), RUNNING);
        assert_eq!(fan_out(&[RUNNING, UNKNOWN]), UNKNOWN);
    }
}
