//! What one command line sent back, and the block format every reply is written in.

use super::{exit_status, Result, WrapperError, PROTOCOL_VERSION};

/// What came back from one command line: exit status and both streams.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct WrapperReply {
    /// The remote command's exit status.
    pub exit_status: u32,
    /// Everything it wrote on stdout.
    pub stdout: Vec<u8>,
    /// Everything it wrote on stderr.
    pub stderr: Vec<u8>,
}

impl WrapperReply {
    pub(super) fn stderr_text(&self) -> String {
        String::from_utf8_lossy(&self.stderr).trim().to_owned()
    }

    /// Maps the exit statuses every verb shares to errors.
    pub(super) fn check(&self, verb: &'static str) -> Result<()> {
        let stderr = self.stderr_text();
        match self.exit_status {
            exit_status::OK => Ok(()),
            exit_status::USAGE => Err(WrapperError::Usage { verb, stderr }),
            exit_status::UNKNOWN_ID => Err(WrapperError::UnknownExecution { stderr }),
            exit_status::NOT_INSTALLED => Err(WrapperError::NotInstalled),
            exit_status::INTERNAL => Err(WrapperError::Internal { verb, stderr }),
            status => Err(WrapperError::UnexpectedExit {
                verb,
                status,
                stderr,
            }),
        }
    }
}

/// One reply block: `waymark-wrap/1 KIND`, `key=value` lines, a blank line,
/// then the payload.
pub(super) struct Block<'a> {
    pub(super) verb: &'static str,
    pub(super) fields: Vec<(&'a str, &'a str)>,
    pub(super) payload: &'a [u8],
}

impl<'a> Block<'a> {
    pub(super) fn parse(verb: &'static str, kind: &str, bytes: &'a [u8]) -> Result<Self> {
        let malformed = |detail: String| WrapperError::Malformed { verb, detail };
        let mut rest = bytes;
        let mut next_line = |what: &str| -> Result<&'a str> {
            let end = rest
                .iter()
                .position(|&b| b == b'\n')
                .ok_or_else(|| malformed(format!("truncated: no end of line in the {what}")))?;
            let line = std::str::from_utf8(&rest[..end])
                .map_err(|_| malformed(format!("the {what} is not UTF-8")))?;
            rest = &rest[end + 1..];
            Ok(line)
        };
        let first = next_line("first line")?;
        let (version, got_kind) = first
            .strip_prefix("waymark-wrap/")
            .and_then(|r| r.split_once(' '))
            .ok_or_else(|| malformed(format!("not a wrapper reply: {first:?}")))?;
        if version != PROTOCOL_VERSION.to_string() {
            return Err(malformed(format!(
                "protocol version {version:?}, this client speaks {PROTOCOL_VERSION}"
            )));
        }
        if got_kind != kind {
            return Err(malformed(format!(
                "expected a `{kind}` block, got `{got_kind}`"
            )));
        }
        let mut fields = Vec::new();
        loop {
            let line = next_line("header")?;
            if line.is_empty() {
                break;
            }
            let (k, v) = line
                .split_once('=')
                .ok_or_else(|| malformed(format!("header line without `=`: {line:?}")))?;
            if fields.iter().any(|&(seen, _)| seen == k) {
                return Err(malformed(format!("field `{k}` appears twice")));
            }
            fields.push((k, v));
        }
        Ok(Self {
            verb,
            fields,
            payload: rest,
        })
    }

    pub(super) fn malformed(&self, detail: String) -> WrapperError {
        WrapperError::Malformed {
            verb: self.verb,
            detail,
        }
    }

    pub(super) fn get(&self, key: &str) -> Option<&'a str> {
        self.fields
            .iter()
            .find(|&&(k, _)| k == key)
            .map(|&(_, v)| v)
    }

    pub(super) fn required(&self, key: &str) -> Result<&'a str> {
        self.get(key)
            .ok_or_else(|| self.malformed(format!("missing field `{key}`")))
    }

    /// A number that may be empty (unknown) or absent.
    pub(super) fn opt_num<T: std::str::FromStr>(&self, key: &str) -> Result<Option<T>> {
        match self.get(key) {
            None | Some("") => Ok(None),
            Some(v) => v
                .parse()
                .map(Some)
                .map_err(|_| self.malformed(format!("field `{key}` is not a number: {v:?}"))),
        }
    }

    pub(super) fn num<T: std::str::FromStr>(&self, key: &str) -> Result<T> {
        self.opt_num(key)?
            .ok_or_else(|| self.malformed(format!("missing field `{key}`")))
    }

    pub(super) fn no_payload(&self) -> Result<()> {
        if self.payload.is_empty() {
            Ok(())
        } else {
            Err(self.malformed(format!(
                "{} unexpected bytes after the header",
                self.payload.len()
            )))
        }
    }
}
