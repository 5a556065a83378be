//! Installing the wrapper on a connection, with the check of which ledger owns the host's
//! markers, and `hosts adopt`, which hands them to this daemon's ledger.

use super::Executor;
use crate::channel::{ExecFailure, OpenChannel, RemoteExit};
use crate::error::{ConnectError, Error};
use crate::wrapper::{InstallOutcome, WrapperError, WrapperReply, WRAPPER_SCRIPT};

impl Executor {
    /// Sends the wrapper script to the install command, which keeps an existing copy whose
    /// sha256 matches and otherwise writes and verifies a new one.
    pub(super) async fn install(&self, channel: OpenChannel) -> Result<(), Error> {
        let host = &self.config().name;
        let serial = channel.lease.connection.serial;
        let command = self.wrapper.install_command();
        let failed = |reason: String| {
            Error::NotSent(ConnectError::WrapperInstall {
                host: host.clone(),
                reason,
            })
        };
        let connection = channel.lease.connection.clone();
        // An install that did not end cleanly leaves the connection in an unknown state (the
        // host's install shell may still wait for the script): the next call must not find it
        // in the pool, unready, and install on it again.
        let abandon = |reason: String| {
            self.pool.retire(&connection);
            failed(reason)
        };
        let output = channel
            .exec(
                &command,
                Some(WRAPPER_SCRIPT.as_bytes()),
                Some(self.start_budget()),
                |_| {},
            )
            .await
            .map_err(|failure| match failure {
                ExecFailure::NotSent(e) => Error::NotSent(e),
                ExecFailure::Lost(reason) => abandon(format!("connection lost: {reason}")),
                ExecFailure::Oversized => failed("oversized reply".into()),
            })?;
        let reply = match output.exit {
            RemoteExit::Code(code) => WrapperReply {
                exit_status: code,
                stdout: output.stdout,
                stderr: output.stderr,
            },
            other => return Err(abandon(format!("the install command ended with {other:?}"))),
        };
        match InstallOutcome::parse(&reply) {
            Ok(outcome) => {
                tracing::debug!(host = %host, serial, ?outcome, "wrapper ready");
                Ok(())
            }
            Err(WrapperError::OtherLedger { ledger }) => {
                Err(Error::NotSent(ConnectError::OtherLedger {
                    host: host.clone(),
                    theirs: ledger,
                    ours: self.config().ledger_identity.clone().unwrap_or_default(),
                }))
            }
            Err(e) => Err(failed(e.to_string())),
        }
    }

    /// Makes this daemon's ledger the owner of the host's markers, whatever ledger owned
    /// them (`waymark hosts adopt`); returns the one recorded before (`None`: none was).
    pub async fn adopt(&self) -> Result<Option<String>, Error> {
        let host = &self.config().name;
        let command = self
            .wrapper
            .adopt_command()
            .ok_or_else(|| Error::InvalidRequest {
                host: host.clone(),
                message: "this daemon has no ledger identity to record".into(),
            })?;
        let channel = self.pool.open_channel().await?;
        let output = channel
            .exec(&command, None, Some(self.start_budget()), |_| {})
            .await
            .map_err(|failure| match failure {
                ExecFailure::NotSent(e) => Error::NotSent(e),
                ExecFailure::Lost(reason) => Error::Lost {
                    host: host.clone(),
                    verb: "adopt",
                    execution_id: None,
                    reason,
                },
                ExecFailure::Oversized => Error::Wrapper {
                    host: host.clone(),
                    verb: "adopt",
                    message: "oversized reply".into(),
                },
            })?;
        let text = String::from_utf8_lossy(&output.stdout);
        match (&output.exit, text.trim().strip_prefix("waymark-adopt/1 ")) {
            (RemoteExit::Code(0), Some("-")) => Ok(None),
            (RemoteExit::Code(0), Some(previous)) => Ok(Some(previous.to_string())),
            (exit, _) => Err(Error::Wrapper {
                host: host.clone(),
                verb: "adopt",
                message: format!(
                    "the adopt command ended with {exit:?}: {}{}",
                    text.trim(),
                    String::from_utf8_lossy(&output.stderr).trim()
                ),
            }),
        }
    }
}
