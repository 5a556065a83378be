//! The gateway: the one code path every Waymark action takes, whether it came from the CLI or
//! from MCP.
//!
//! It reads `waymark.toml` ([`config`]), resolves a tool call into a canonical
//! [`waymark_core::ActionRequest`] ([`tools`]), and runs the flow ([`flow`]): matching rule,
//! accepted, policy, authorized, dispatched (durable before the first byte leaves), observed,
//! result stored, delivered. Hosts are reached through [`host::HostExecutor`].
//!
//! What it does not do: parse command lines (the `waymark` binary does), speak MCP
//! (`waymark-mcp`), or know sled or russh.

pub mod config;
pub mod flow;
pub mod host;
mod http_tool;
pub mod mask;
pub mod metrics;
mod resolved;
pub mod ssh_hosts;
pub mod tools;
