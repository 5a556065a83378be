//! The replies of `run`/`wait`, `output`, `gc`, `version` and the install command.

use super::command::Stream;
use super::reply::{Block, WrapperReply};
use super::status::{StartRefused, StatusReport};
use super::{exit_status, validate_execution_id, Result, WrapperError, PROTOCOL_VERSION};

/// One stream in a `run`/`wait` reply.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum InlineOutput {
    /// The whole stream, inline.
    Inline(Vec<u8>),
    /// Too large to inline: fetch it with `output`, by offset.
    Fetch {
        /// Its size when the reply was made.
        size: u64,
    },
}

impl InlineOutput {
    /// The bytes, when they came inline.
    pub fn inline(&self) -> Option<&[u8]> {
        match self {
            InlineOutput::Inline(bytes) => Some(bytes),
            InlineOutput::Fetch { .. } => None,
        }
    }
}

/// The reply to `run` or `wait`: the final status and the outputs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunReport {
    /// The status once the supervisor had ended (finished or interrupted).
    pub status: StatusReport,
    /// The command's stdout.
    pub stdout: InlineOutput,
    /// The command's stderr.
    pub stderr: InlineOutput,
}

impl RunReport {
    /// Parses a reply to `wait` (exit 66 if the ID is unknown).
    pub fn parse(reply: &WrapperReply) -> Result<Self> {
        reply.check("wait")?;
        Self::parse_block("wait", &reply.stdout)
    }

    pub(super) fn parse_block(verb: &'static str, stdout: &[u8]) -> Result<Self> {
        let block = Block::parse(verb, "run", stdout)?;
        let status = StatusReport::from_block(&block)?;
        let inline_len = |key: &str, size: u64| -> Result<Option<usize>> {
            match block.required(key)? {
                "-" => Ok(None),
                v => {
                    let n: u64 = v.parse().map_err(|_| {
                        block.malformed(format!("field `{key}` is not a number: {v:?}"))
                    })?;
                    if n != size {
                        return Err(block
                            .malformed(format!("`{key}` is {n} but the stream has {size} bytes")));
                    }
                    usize::try_from(n)
                        .map(Some)
                        .map_err(|_| block.malformed(format!("`{key}` too large")))
                }
            }
        };
        let out_len = inline_len("stdout_inline", status.stdout_bytes)?;
        let err_len = inline_len("stderr_inline", status.stderr_bytes)?;
        let (out, err) = match block.get("boundary") {
            // Served: each inline stream's bytes end at the boundary line.
            Some(boundary) => {
                let parts = bounded_parts(&block, boundary, &[out_len, err_len])?;
                (parts[0], parts[1])
            }
            None => {
                let want = out_len.unwrap_or(0) + err_len.unwrap_or(0);
                if block.payload.len() != want {
                    return Err(block.malformed(format!(
                        "expected {want} bytes of inline output, got {}",
                        block.payload.len()
                    )));
                }
                block.payload.split_at(out_len.unwrap_or(0))
            }
        };
        // Fewer bytes than the size (a served stream cut shorter while the host read it):
        // not a result to keep; it is fetched by offset, like output too large to inline.
        let stream = |len: Option<usize>, bytes: &[u8], size: u64| match len {
            Some(n) if bytes.len() == n => InlineOutput::Inline(bytes.to_vec()),
            _ => InlineOutput::Fetch { size },
        };
        Ok(Self {
            stdout: stream(out_len, out, status.stdout_bytes),
            stderr: stream(err_len, err, status.stderr_bytes),
            status,
        })
    }
}

/// The parts of a served block whose bytes end at boundary lines (see `serve`): for each
/// `Some(n)` of `lens`, in order, the bytes up to its line, at most `n` (fewer when the
/// stream was cut shorter while the host read it); a `None` part is absent and empty here.
/// Nothing may follow the last line.
fn bounded_parts<'a>(
    block: &Block<'a>,
    boundary: &str,
    lens: &[Option<usize>],
) -> Result<Vec<&'a [u8]>> {
    let delimiter = format!("\n--{boundary}\n");
    let mut cursor = 0;
    let mut parts = Vec::with_capacity(lens.len());
    for len in lens {
        let Some(n) = *len else {
            parts.push(&block.payload[..0]);
            continue;
        };
        match super::serve::bounded_part(block.payload, cursor, n, delimiter.as_bytes()) {
            Ok(Some((end, next))) => {
                parts.push(&block.payload[cursor..end]);
                cursor = next;
            }
            Ok(None) => return Err(block.malformed("bytes cut short of their boundary".into())),
            Err(e) => return Err(block.malformed(e)),
        }
    }
    if cursor != block.payload.len() {
        return Err(block.malformed("bytes after the last boundary line".into()));
    }
    Ok(parts)
}

/// The reply to `run`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RunOutcome {
    /// The execution ran (or was interrupted): here is how it ended.
    Ran(RunReport),
    /// The ID was already taken; nothing ran. Use `wait` to attach to it.
    Refused(StartRefused),
}

impl RunOutcome {
    /// Parses a reply to `run`.
    pub fn parse(reply: &WrapperReply) -> Result<Self> {
        if reply.exit_status == exit_status::ALREADY_STARTED {
            return Ok(Self::Refused(StartRefused::parse("run", reply)?));
        }
        reply.check("run")?;
        Ok(Self::Ran(RunReport::parse_block("run", &reply.stdout)?))
    }
}

/// The reply to `output`: a byte range of one stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutputChunk {
    /// The execution ID.
    pub id: String,
    /// Which stream.
    pub stream: Stream,
    /// The stream's size when the chunk was read.
    pub size: u64,
    /// Where `data` starts in the stream.
    pub offset: u64,
    /// The bytes.
    pub data: Vec<u8>,
    /// The execution had finished before the size was taken: `size` is final.
    pub finished: bool,
    /// SHA-256 (hex) of the whole stream (its first `size` bytes), sent by the host with the
    /// first chunk of a finished stream that does not fit in it.
    pub sha256: Option<String>,
}

impl OutputChunk {
    /// Parses a reply to `output`.
    pub fn parse(reply: &WrapperReply) -> Result<Self> {
        reply.check("output")?;
        let b = Block::parse("output", "output", &reply.stdout)?;
        let id = b.required("id")?;
        let stream = match b.required("stream")? {
            "stdout" => Stream::Stdout,
            "stderr" => Stream::Stderr,
            other => return Err(b.malformed(format!("unknown stream {other:?}"))),
        };
        let length: u64 = b.num("length")?;
        let data = match b.get("boundary") {
            // Served: the bytes end at the boundary line, and may be fewer than `length` when
            // the stream was cut shorter while the host read it. They are what it then held
            // from `offset`.
            Some(boundary) => {
                let length = usize::try_from(length)
                    .map_err(|_| b.malformed(format!("`length` too large: {length}")))?;
                bounded_parts(&b, boundary, &[Some(length)])?[0]
            }
            None if b.payload.len() as u64 != length => {
                return Err(b.malformed(format!(
                    "header says {length} bytes, got {}",
                    b.payload.len()
                )));
            }
            None => b.payload,
        };
        let finished = match b.required("finished")? {
            "1" => true,
            "0" => false,
            other => return Err(b.malformed(format!("bad `finished` value {other:?}"))),
        };
        let sha256 = match b.get("sha256") {
            None | Some("") | Some("-") => None,
            Some(h) if h.len() == 64 && h.bytes().all(|c| c.is_ascii_hexdigit()) => {
                Some(h.to_ascii_lowercase())
            }
            Some(other) => return Err(b.malformed(format!("bad `sha256` value {other:?}"))),
        };
        Ok(Self {
            id: id.to_owned(),
            stream,
            size: b.num("size")?,
            offset: b.num("offset")?,
            data: data.to_vec(),
            finished,
            sha256,
        })
    }

    /// The offset to ask for next.
    pub fn next_offset(&self) -> u64 {
        self.offset + self.data.len() as u64
    }

    /// This chunk reaches the end of a stream that will not grow.
    pub fn is_last(&self) -> bool {
        self.finished && self.next_offset() >= self.size
    }
}

/// The reply to `gc`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GcReport {
    /// The execution IDs whose markers were removed.
    pub removed: Vec<String>,
}

impl GcReport {
    /// Parses a reply to `gc`.
    pub fn parse(reply: &WrapperReply) -> Result<Self> {
        reply.check("gc")?;
        // `removed=` repeats, so this block is read line by line.
        let malformed = |detail: String| WrapperError::Malformed { verb: "gc", detail };
        let text = std::str::from_utf8(&reply.stdout).map_err(|_| malformed("not UTF-8".into()))?;
        let body = text
            .strip_prefix(&format!("waymark-wrap/{PROTOCOL_VERSION} gc\n"))
            .ok_or_else(|| malformed("missing `waymark-wrap/1 gc` header".into()))?;
        let body = body
            .strip_suffix("\n\n")
            .or_else(|| (body == "\n").then_some(""))
            .ok_or_else(|| malformed("truncated: no terminating blank line".into()))?;
        let mut removed = Vec::new();
        for line in body.lines() {
            let id = line
                .strip_prefix("removed=")
                .ok_or_else(|| malformed(format!("unexpected line {line:?}")))?;
            validate_execution_id(id).map_err(|_| malformed(format!("bad id {id:?}")))?;
            removed.push(id.to_owned());
        }
        Ok(Self { removed })
    }
}

/// The reply to `version`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VersionReport {
    /// The protocol version the installed wrapper speaks.
    pub protocol: u32,
}

impl VersionReport {
    /// Parses a reply to `version`.
    pub fn parse(reply: &WrapperReply) -> Result<Self> {
        reply.check("version")?;
        let b = Block::parse("version", "version", &reply.stdout)?;
        b.no_payload()?;
        Ok(Self {
            protocol: b.num("protocol")?,
        })
    }
}

/// The result of [`RemoteWrapper::install_command`](super::RemoteWrapper::install_command).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum InstallOutcome {
    /// The script was written to this path (as the remote shell expanded it).
    Installed {
        /// Absolute path on the host.
        path: String,
    },
    /// The right script was already there; nothing was written.
    AlreadyPresent {
        /// Absolute path on the host.
        path: String,
    },
}

impl InstallOutcome {
    /// Parses the reply of the install command.
    pub fn parse(reply: &WrapperReply) -> Result<Self> {
        let stderr = reply.stderr_text();
        match reply.exit_status {
            exit_status::OK => {}
            exit_status::INSTALL_HASH_MISMATCH => {
                return Err(WrapperError::InstallHashMismatch { stderr })
            }
            exit_status::INSTALL_FAILED => return Err(WrapperError::InstallFailed { stderr }),
            exit_status::OTHER_LEDGER => {
                let text = String::from_utf8_lossy(&reply.stdout);
                let ledger = text
                    .trim()
                    .strip_prefix("waymark-install/1 other-ledger ")
                    .unwrap_or("unknown")
                    .to_string();
                return Err(WrapperError::OtherLedger { ledger });
            }
            status => {
                return Err(WrapperError::UnexpectedExit {
                    verb: "install",
                    status,
                    stderr,
                })
            }
        }
        let malformed = |detail: String| WrapperError::Malformed {
            verb: "install",
            detail,
        };
        let text = std::str::from_utf8(&reply.stdout).map_err(|_| malformed("not UTF-8".into()))?;
        let line = text
            .strip_suffix('\n')
            .filter(|l| !l.contains('\n'))
            .ok_or_else(|| malformed(format!("expected one line, got {text:?}")))?;
        if let Some(path) = line.strip_prefix("waymark-install/1 installed ") {
            Ok(Self::Installed { path: path.into() })
        } else if let Some(path) = line.strip_prefix("waymark-install/1 present ") {
            Ok(Self::AlreadyPresent { path: path.into() })
        } else {
            Err(malformed(format!("unexpected line {line:?}")))
        }
    }
}
