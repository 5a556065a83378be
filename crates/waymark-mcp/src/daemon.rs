//! The shim's side of the daemon: the control client the CLI uses too, which starts a daemon
//! when none answers ([`waymark_protocol::control`]).

pub use waymark_protocol::control::Control;
