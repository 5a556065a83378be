//! The client side of the control socket, shared by the CLI and the MCP shim.

use std::path::Path;

use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::UnixStream;

use crate::{Envelope, Frame, Request, PROTOCOL_VERSION};

/// Why the daemon could not be used.
#[derive(Debug)]
pub enum ClientError {
    /// No daemon listens: the CLI may work on the ledger itself.
    NoDaemon,
    /// The daemon was reached and then the connection failed: the request may have been
    /// received. Never fall back to local work after this.
    Broken(String),
}

/// Sends one request and returns the final frame; `on_event` sees progress frames.
pub async fn request(
    socket: &Path,
    req: Request,
    mut on_event: impl FnMut(&Frame),
) -> Result<Frame, ClientError> {
    let stream = match UnixStream::connect(socket).await {
        Ok(s) => s,
        Err(_) => return Err(ClientError::NoDaemon),
    };
    let (read, mut write) = stream.into_split();
    let mut line = serde_json::to_vec(&Envelope {
        v: PROTOCOL_VERSION,
        request: req,
    })
    .expect("requests serialize");
    line.push(b'\n');
    write
        .write_all(&line)
        .await
        .map_err(|e| ClientError::Broken(e.to_string()))?;
    let mut lines = BufReader::new(read).lines();
    loop {
        match lines.next_line().await {
            Ok(Some(l)) => {
                let frame: Frame = serde_json::from_str(&l).map_err(|e| {
                    ClientError::Broken(format!("garbled answer from the daemon: {e}"))
                })?;
                match frame {
                    Frame::Event { .. } => on_event(&frame),
                    _ => return Ok(frame),
                }
            }
            Ok(None) => {
                return Err(ClientError::Broken(
                    "the daemon closed the connection before answering".into(),
                ))
            }
            Err(e) => return Err(ClientError::Broken(e.to_string())),
        }
    }
}
