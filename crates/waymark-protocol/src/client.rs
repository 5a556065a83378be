//! The client side of the control socket, shared by the CLI and the MCP shim.

use std::path::Path;

use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::UnixStream;

use crate::{Envelope, Event, Frame, Request, MAX_REQUEST_BYTES, PROTOCOL_VERSION};

/// Why the daemon could not be used.
#[derive(Debug)]
pub enum ClientError {
    /// No daemon listens: the CLI may work on the ledger itself.
    NoDaemon,
    /// The daemon was reached and then the connection failed: the request may have been
    /// received. Never fall back to local work after this.
    Broken(String),
}

/// Sends one request and returns the final frame; `on_event` sees the events before it.
pub async fn request(
    socket: &Path,
    req: Request,
    on_event: impl FnMut(&Event),
) -> Result<Frame, ClientError> {
    request_within(socket, req, None, on_event).await
}

/// [`request`], with the longest the daemon may wait for a host before it answers with what
/// the ledger knows (`None`: the daemon's [`crate::READ_DEADLINE`]).
pub async fn request_within(
    socket: &Path,
    req: Request,
    deadline: Option<std::time::Duration>,
    mut on_event: impl FnMut(&Event),
) -> Result<Frame, ClientError> {
    let mut line = serde_json::to_vec(&Envelope {
        v: PROTOCOL_VERSION,
        deadline_ms: deadline.map(|d| d.as_millis().max(1) as u64),
        request: req,
    })
    .expect("requests serialize");
    line.push(b'\n');
    // The daemon refuses a longer line and closes the connection while the rest is still on
    // its way, which would read as a lost connection (an unknown outcome). Nothing is sent.
    if line.len() > MAX_REQUEST_BYTES {
        return Ok(Frame::Error {
            message: format!(
                "the request is {} bytes, over the control protocol's limit of {} bytes (1 MiB): refused, nothing was sent and nothing was run; pass large data another way (a file on the host)",
                line.len(),
                MAX_REQUEST_BYTES
            ),
            exit: crate::exit::USAGE,
        });
    }
    let stream = match UnixStream::connect(socket).await {
        Ok(s) => s,
        // A daemon may well run: it is another user's, and starting one of ours in its place
        // would only fail. Nothing was sent.
        Err(e) if e.kind() == std::io::ErrorKind::PermissionDenied => {
            return Ok(Frame::Error {
                message: format!(
                    "permission denied on the daemon's socket {} ({e}): it belongs to another user (the socket is 0600 in a 0700 directory). Run as that user, or give this user a configuration with its own [daemon] socket and ledger. Nothing was sent.",
                    socket.display()
                ),
                exit: crate::exit::ERROR,
            })
        }
        Err(_) => return Err(ClientError::NoDaemon),
    };
    let (read, mut write) = stream.into_split();
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
                    Frame::Event(e) => on_event(&e),
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
