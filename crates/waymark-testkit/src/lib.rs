//! Test kit for Waymark: real infrastructure for tests, used as a dev-dependency by every other
//! crate's integration tests.
//!
//! - [`TestSshd`]: a real OpenSSH `sshd` on a free loopback port, with generated host and user
//!   keys, a known_hosts file, a temp remote HOME, a log for diagnostics, and restart on the same
//!   port. [`TestSshd::ssh_command`] gives a matching OpenSSH `ssh` command for peer comparisons.
//! - [`FaultProxy`]: a TCP proxy that cuts, stalls, delays or refuses connections on demand
//!   while they are live, to test what Waymark does when the network fails mid-action.
//! - [`TestHttpApi`]: a real HTTP/1.1 API on a free loopback port that honours
//!   `Idempotency-Key` (replay, `409` in flight, `422` on a changed payload), counts its effects
//!   and injects faults around them ([`HttpFault`]).
//! - [`TestPostgres`]: a real PostgreSQL cluster (`initdb` + `pg_ctl`) on a free loopback port
//!   in a temp directory, one per test process ([`TestPostgres::shared`]), a database per test.
//! - Helpers: [`free_port`], [`require_tool`] and [`find_tool`], [`which_shells`], and
//!   [`output_within`] / [`wait_within`] to keep every child process bounded in time.
//!
//! ```no_run
//! use std::time::Duration;
//! use waymark_testkit::{output_within, FaultProxy, TestSshd};
//!
//! let sshd = TestSshd::new();
//! let proxy = FaultProxy::start(sshd.addr());
//! let out = output_within(
//!     sshd.ssh_command_via(proxy.addr()).arg("echo hi"),
//!     Duration::from_secs(10),
//! );
//! assert_eq!(out.stdout, b"hi\n");
//! ```
//!
//! **What it is not.** It knows nothing of Waymark's own types, the remote wrapper or russh: it
//! provides hosts and networks, and tests bring the code under test. It never skips a test: a
//! missing tool is a panic with an install hint. It is Unix-only (Linux for cleaning up session
//! processes on drop), binds only to 127.0.0.1, and is not for production use.
//!
//! **Root or not.** The login user is whoever runs the tests. As root, sshd needs its
//! privilege separation directory `/run/sshd` (created if missing) and the `sshd` system user
//! (created by the openssh-server package). As an ordinary user, sshd runs unprivileged and can
//! log in only that same user, which is all the kit asks of it.

mod fault_proxy;
mod http_api;
mod postgres;
mod sshd;
mod tools;

pub use fault_proxy::{CutScope, Direction, FaultProxy, ProxyStats};
pub use http_api::{HttpFault, ReceivedRequest, TestHttpApi};
pub use postgres::{TestPostgres, POSTGRES_TEST_ROLE};
pub use sshd::{generate_user_key, SshdOptions, TestSshd, UserKey, SESSION_MARKER_VAR};
pub use tools::{
    find_tool, free_port, output_within, require_tool, wait_within, which_shells, Shell,
};

const CROCKFORD: &[u8] = b"0123456789ABCDEFGHJKMNPQRSTVWXYZ";

/// A fresh execution ID (`act_` + 26 Crockford base-32 digits) from time, pid and a counter,
/// so IDs never repeat across runs: for tests that drive the wrapper without a ledger.
pub fn new_id() -> String {
    static COUNTER: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock after 1970")
        .as_nanos();
    let mut n: u128 = (nanos << 40)
        ^ (u128::from(std::process::id()) << 20)
        ^ u128::from(COUNTER.fetch_add(1, std::sync::atomic::Ordering::Relaxed));
    let mut chars = [b'0'; 26];
    for c in chars.iter_mut().rev() {
        *c = CROCKFORD[(n & 31) as usize];
        n >>= 5;
    }
    format!("act_{}", std::str::from_utf8(&chars).expect("ascii"))
}
