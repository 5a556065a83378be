//! Waymark's SSH executor: runs commands on a host through the remote wrapper, over pooled
//! russh connections, and says precisely whether a failed request could have reached the host.
//!
//! **What it does.**
//! - Connects with russh ([`HostConfig`]): host keys pinned in an OpenSSH `known_hosts` file
//!   (plain, hashed `|1|` and `[host]:port` entries; [`HostKeyPolicy::Strict`] by default,
//!   [`HostKeyPolicy::AcceptNew`] pins a new key only once authentication succeeded); user keys
//!   from files (encrypted ones with the passphrase from a named environment variable) or from
//!   ssh-agent.
//! - Pools connections per host: many exec channels per connection, at most `max_sessions`
//!   each (more connections past that, or when the server refuses a channel), channels always
//!   closed, keepalive to notice a dead link within [`HostConfig::drop_detection_budget`],
//!   reconnects with backoff.
//! - Installs the wrapper ([`wrapper::WRAPPER_SCRIPT`]) once per connection, verified by
//!   sha256, and drives its verbs: [`Executor::dispatch`] (`run`), [`Executor::status`],
//!   [`Executor::wait`], [`Executor::output`], [`Executor::cancel`], [`Executor::gc`].
//! - Classifies every failure: [`Error::NotSent`] (provably nothing reached the host: safe to
//!   retry) versus [`Error::Lost`] (the request may have reached it: ask `status`). A dispatch
//!   whose execution ID the host already holds comes back as
//!   [`DispatchOutcome::AlreadyStarted`], never as a second run.
//!
//! **What it does not do.** It keeps no ledger, mints no execution IDs and decides nothing
//! about retries or approvals: that is `waymark-core` and the daemon. It never writes marker
//! files itself (only the wrapper does), never runs a command without the wrapper, never
//! allocates a PTY, forwards nothing, and never accepts an unknown or changed host key unless
//! the policy says so. It ships no SSH server: the demo's is `waymark-demo`. Apart from that
//! server, it is the only crate that knows russh.
//!
//! ```no_run
//! # async fn demo() -> Result<(), waymark_ssh::Error> {
//! use waymark_ssh::{Credential, DispatchOutcome, DispatchRequest, Executor, HostConfig};
//!
//! let host = HostConfig::new(
//!     "web1",
//!     "web1.example.com",
//!     "deploy",
//!     Credential::Agent,
//!     "/home/me/.ssh/known_hosts",
//! );
//! let executor = Executor::new(host)?;
//! let request = DispatchRequest {
//!     execution_id: "act_01J0000000000000000000000A".into(),
//!     argv: vec!["uname".into(), "-a".into()],
//!     ..Default::default()
//! };
//! match executor.dispatch(&request, |event| println!("{event:?}")).await {
//!     Ok(DispatchOutcome::Completed(report)) => println!("exit {:?}", report.status.exit_code),
//!     Ok(DispatchOutcome::AlreadyStarted(status)) => println!("already {}", status.state),
//!     Err(e) if e.is_lost() => println!("unknown: ask status ({e})"),
//!     Err(e) => println!("not run: {e}"),
//! }
//! # Ok(()) }
//! ```

pub mod wrapper;

mod channel;
mod config;
mod error;
mod executor;
mod known_hosts;
mod pool;
mod serve;
mod session;

pub use config::{Credential, HostConfig, HostKeyPolicy};
pub use error::{ConnectError, Error, HostKeyProblem, HostKeyRejection};
pub use executor::{DispatchEvent, DispatchOutcome, DispatchRequest, Executor, DEFAULT_CHUNK};
