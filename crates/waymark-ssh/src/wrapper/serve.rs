//! The serve protocol: many requests over one long-lived `wrap serve` channel.
//!
//! A serve channel runs `wrap serve` once; the host's login shell and the wrapper's interpreter
//! start once per channel, not once per request. The wrapper writes [`SERVE_READY`], then
//! answers one request line at a time: the verb's reply exactly as an exec channel's stdout
//! would hold it, then a trailer `waymark-serve/1 end EXIT LINES` and LINES lines of the
//! verb's stderr. Only `run` (without stdin or secrets), `status`, `watch` and `output` (with
//! a boundary line after its bytes) are served; everything else goes on exec channels.
//!
//! A request line is the verb and its words, each led by one space: every word is pieces in
//! single quotes (`'text without a quote or newline'`, maybe empty) joined by `"$Q"` for a quote
//! or `"$NL"` for a newline. The wrapper checks that shape in one split at the quotes before
//! it lets `eval` unquote the words. A line cut short (the channel ended before its newline)
//! is never run.

use std::time::Duration;

use super::command::{RemoteWrapper, StartOptions, Stream};
use super::{validate_execution_id, Result, WrapperError, WrapperReply, PROTOCOL_VERSION};

/// The first line a serve worker writes, once it reads requests.
pub const SERVE_READY: &[u8] = b"waymark-serve/1 ready\n";

const TRAILER: &[u8] = b"waymark-serve/1 end ";

/// Quotes `word` for a serve request line (see the module docs). NUL is refused.
pub fn serve_quote(word: &str) -> Result<String> {
    if word.contains('\0') {
        return Err(WrapperError::Nul {
            what: format!("{word:?}"),
        });
    }
    let mut out = String::with_capacity(word.len() + 2);
    out.push('\'');
    for c in word.chars() {
        match c {
            '\'' => out.push_str("'\"$Q\"'"),
            '\n' => out.push_str("'\"$NL\"'"),
            c => out.push(c),
        }
    }
    out.push('\'');
    Ok(out)
}

fn request_line<S: AsRef<str>>(verb: &str, words: &[S]) -> Result<String> {
    let mut line = verb.to_owned();
    for w in words {
        line.push(' ');
        line.push_str(&serve_quote(w.as_ref())?);
    }
    line.push('\n');
    Ok(line)
}

impl RemoteWrapper {
    /// The command line that starts a serve worker on a channel.
    pub fn serve(&self) -> Result<String> {
        self.command_line::<&str>("serve", &[])
    }

    /// `run` as a serve request line (newline included). Stdin and secrets are not served:
    /// they need the channel's own stdin, so such a request is refused here.
    pub fn serve_run<S: AsRef<str>>(
        &self,
        id: &str,
        opts: &StartOptions,
        argv: &[S],
    ) -> Result<String> {
        if !opts.servable() {
            return Err(WrapperError::InvalidOption {
                option: "serve request",
                reason: "stdin and secrets go on an exec channel",
            });
        }
        let mut words = Self::start_args(id, opts, argv, true)?;
        // Its inline bytes end at a random boundary line (see `parse_serve_reply`).
        words.splice(1..1, ["--boundary".to_string(), random_boundary()]);
        request_line("run", &words)
    }

    /// `watch` as a serve request line (newline included).
    pub fn serve_watch<S: AsRef<str>>(
        &self,
        wait: Duration,
        known: &[(S, [u64; 2])],
    ) -> Result<String> {
        request_line("watch", &Self::watch_args(wait, known)?)
    }

    /// `output` as a serve request line (newline included), with a random boundary that
    /// ends its bytes: a served reply must stay in step even when the stream was cut shorter
    /// while the host read it.
    pub fn serve_output(&self, id: &str, stream: Stream, offset: u64, max: u64) -> Result<String> {
        validate_execution_id(id)?;
        request_line(
            "output",
            &[
                id,
                stream.as_str(),
                &offset.to_string(),
                &max.to_string(),
                &random_boundary(),
            ],
        )
    }

    /// `status` of one or more IDs as a serve request line (newline included).
    pub fn serve_status_many<S: AsRef<str>>(&self, ids: &[S]) -> Result<String> {
        Self::status_ids(ids)?;
        request_line("status", ids)
    }
}

/// Where the bytes a serve channel sent stand.
#[derive(Debug, PartialEq, Eq)]
pub enum ServeParse {
    /// More bytes are needed.
    Incomplete,
    /// A whole reply, and how many bytes of the buffer it took.
    Reply {
        /// The reply, as an exec channel would have given it.
        reply: WrapperReply,
        /// Bytes consumed from the start of the buffer.
        consumed: usize,
    },
}

/// Looks for one whole reply at the start of `buf`: wrapper blocks (each a header ended by an
/// empty line, then as many payload bytes as its `length`, `stdout_inline` and
/// `stderr_inline` fields say), then the trailer and its stderr lines. Anything else is a
/// protocol error: the channel is out of step and must not carry another request.
pub fn parse_serve_reply(buf: &[u8]) -> Result<ServeParse> {
    parse_serve_reply_at(buf, &mut 0)
}

/// [`parse_serve_reply`] for a buffer that grows: it starts at `*resume` (0 at first) and
/// leaves there the end of the whole blocks seen so far, so the next call with more bytes
/// does not read them again. (A `status` of many ids comes a block per packet: parsing from the
/// start at each would be quadratic.)
pub fn parse_serve_reply_at(buf: &[u8], resume: &mut usize) -> Result<ServeParse> {
    let malformed = |detail: String| WrapperError::Malformed {
        verb: "serve",
        detail,
    };
    let version = format!("waymark-wrap/{PROTOCOL_VERSION} ");
    let mut pos = (*resume).min(buf.len());
    loop {
        *resume = pos;
        let rest = &buf[pos..];
        if !rest.starts_with(TRAILER) && !rest.starts_with(version.as_bytes()) {
            if TRAILER.starts_with(rest) || version.as_bytes().starts_with(rest) {
                return Ok(ServeParse::Incomplete);
            }
            return Err(malformed(format!(
                "expected a wrapper block or the trailer, got {:?}",
                String::from_utf8_lossy(&rest[..rest.len().min(60)])
            )));
        }
        if let Some(after) = rest.strip_prefix(TRAILER) {
            let Some(end) = after.iter().position(|&b| b == b'\n') else {
                return Ok(ServeParse::Incomplete);
            };
            let line = std::str::from_utf8(&after[..end])
                .map_err(|_| malformed("the trailer is not UTF-8".into()))?;
            let (exit, lines) = line
                .split_once(' ')
                .and_then(|(e, l)| Some((e.parse::<u32>().ok()?, l.parse::<usize>().ok()?)))
                .ok_or_else(|| malformed(format!("bad trailer: {line:?}")))?;
            let mut at = end + 1;
            for _ in 0..lines {
                match after[at..].iter().position(|&b| b == b'\n') {
                    Some(n) => at += n + 1,
                    None => return Ok(ServeParse::Incomplete),
                }
            }
            let consumed = pos + TRAILER.len() + at;
            return Ok(ServeParse::Reply {
                reply: WrapperReply {
                    exit_status: exit,
                    stdout: buf[..pos].to_vec(),
                    stderr: after[end + 1..at].to_vec(),
                },
                consumed,
            });
        }
        let Some(header_end) = rest.windows(2).position(|w| w == b"\n\n") else {
            return Ok(ServeParse::Incomplete);
        };
        let header = std::str::from_utf8(&rest[..header_end])
            .map_err(|_| malformed("a block header is not UTF-8".into()))?;
        // The payload fields, in order: with a boundary, each one's bytes end at its own
        // boundary line; without, they follow one another, as long as the fields add up to.
        let mut parts: Vec<usize> = Vec::new();
        let mut boundary = None;
        for line in header.lines().skip(1) {
            let Some((key, value)) = line.split_once('=') else {
                return Err(malformed(format!("header line without `=`: {line:?}")));
            };
            if key == "boundary" {
                boundary = Some(value);
            }
            if matches!(key, "length" | "stdout_inline" | "stderr_inline") {
                match value {
                    "" | "-" => {}
                    v => parts.push(
                        v.parse()
                            .map_err(|_| malformed(format!("bad {key}: {v:?}")))?,
                    ),
                }
            }
        }
        let mut block_end = header_end + 2;
        match boundary {
            // Each part's bytes end at the boundary line, at most its length on: fewer when
            // the stream was cut shorter while the host read it (see `output`).
            Some(b) => {
                let delimiter = format!("\n--{b}\n");
                for promised in parts {
                    match bounded_part(rest, block_end, promised, delimiter.as_bytes())
                        .map_err(malformed)?
                    {
                        Some((_, next)) => block_end = next,
                        None => return Ok(ServeParse::Incomplete),
                    }
                }
            }
            None => {
                for n in parts {
                    block_end = block_end
                        .checked_add(n)
                        .ok_or_else(|| malformed("payload length overflows".into()))?;
                }
                if rest.len() < block_end {
                    return Ok(ServeParse::Incomplete);
                }
            }
        }
        pos += block_end;
    }
}

/// One part of a block with a boundary: it starts at `start` of `buf`, holds at most
/// `promised` bytes, then `delimiter` (a newline, `--BOUNDARY`, a newline). `Ok(Some((end,
/// next)))`: its bytes are `buf[start..end]`, and what follows starts at `next`. `Ok(None)`:
/// more bytes are needed. `Err`: no delimiter within the promised bytes, out of step.
pub(super) fn bounded_part(
    buf: &[u8],
    start: usize,
    promised: usize,
    delimiter: &[u8],
) -> std::result::Result<Option<(usize, usize)>, String> {
    let overflow = || "payload length overflows".to_string();
    let full = start.checked_add(promised).ok_or_else(overflow)?;
    let window_end = full.checked_add(delimiter.len()).ok_or_else(overflow)?;
    if buf.get(full..window_end) == Some(delimiter) {
        // All the bytes promised came.
        return Ok(Some((full, window_end)));
    }
    if buf.len() < window_end && !buf.ends_with(b"\n") {
        // A reply ends with a whole line: more is coming. (So a reply of many packets is
        // searched for its boundary a few times, not at each packet.)
        return Ok(None);
    }
    let window = &buf[start.min(buf.len())..buf.len().min(window_end)];
    match memchr::memmem::find(window, delimiter) {
        Some(at) => Ok(Some((start + at, start + at + delimiter.len()))),
        None if buf.len() < window_end => Ok(None),
        None => Err(format!(
            "no boundary line within {promised} bytes of a block's part"
        )),
    }
}

/// 16 random bytes in hex: a boundary that ends bytes on a serve channel. Without
/// randomness (never seen), the clock and a counter: what matters is that the command's
/// output does not hold it by chance.
fn random_boundary() -> String {
    let mut bytes = [0u8; 16];
    if getrandom::fill(&mut bytes).is_err() {
        use sha2::Digest as _;
        static COUNTER: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let seed = format!(
            "{:?}{}{}",
            std::time::SystemTime::now(),
            std::process::id(),
            COUNTER.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        );
        bytes.copy_from_slice(&sha2::Sha256::digest(seed.as_bytes())[..16]);
    }
    hex::encode(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn whole(buf: &[u8]) -> (WrapperReply, usize) {
        match parse_serve_reply(buf).unwrap() {
            ServeParse::Reply { reply, consumed } => (reply, consumed),
            ServeParse::Incomplete => panic!("incomplete: {:?}", String::from_utf8_lossy(buf)),
        }
    }

    const RUN: &[u8] = b"waymark-wrap/1 run\nid=x\nstdout_inline=3\nstderr_inline=-\n\nab\n";

    #[test]
    fn a_run_block_and_its_payload_then_the_trailer() {
        let mut buf = RUN.to_vec();
        buf.extend_from_slice(b"waymark-serve/1 end 0 0\n");
        let (reply, consumed) = whole(&buf);
        assert_eq!(consumed, buf.len());
        assert_eq!(reply.stdout, RUN);
        assert_eq!(reply.exit_status, 0);
        // Every prefix is incomplete, never an error or a reply.
        for cut in 0..buf.len() {
            assert_eq!(
                parse_serve_reply(&buf[..cut]).unwrap(),
                ServeParse::Incomplete,
                "cut at {cut}"
            );
        }
    }

    #[test]
    fn a_growing_buffer_is_read_once_and_gives_the_same_reply() {
        let mut buf = Vec::new();
        for id in ["a", "b", "c"] {
            buf.extend_from_slice(format!("waymark-wrap/1 status\nid={id}\n\n").as_bytes());
        }
        buf.extend_from_slice(RUN);
        buf.extend_from_slice(b"waymark-serve/1 end 0 1\nwarn\n");
        let whole_reply = whole(&buf);
        let mut resume = 0;
        let mut seen = Vec::new();
        for n in 1..=buf.len() {
            let before = resume;
            match parse_serve_reply_at(&buf[..n], &mut resume).unwrap() {
                ServeParse::Incomplete => {
                    assert!(resume >= before && resume <= n, "resume {resume} at {n}");
                    seen.push(resume);
                }
                ServeParse::Reply { reply, consumed } => {
                    assert_eq!(n, buf.len());
                    assert_eq!((reply, consumed), whole_reply);
                }
            }
        }
        // It moved past each whole block, never into one.
        for end in [28, 56, 84, 84 + RUN.len()] {
            assert!(seen.contains(&end), "{end} in {seen:?}");
        }
    }

    #[test]
    fn bytes_with_a_boundary_end_at_its_line_however_many_the_header_promised() {
        let head = "waymark-wrap/1 output\nid=x\nlength=40\nboundary=00112233445566778899\n\n";
        // Fewer bytes than promised (the stream was cut), one of them a line like the
        // trailer, one like another boundary.
        let body = b"a\nwaymark-serve/1 end 0 0\n--0123456789abcdef\n";
        let mut buf = head.as_bytes().to_vec();
        buf.extend_from_slice(&body[..30]);
        buf.extend_from_slice(b"\n--00112233445566778899\n");
        let reply_end = buf.len();
        buf.extend_from_slice(b"waymark-serve/1 end 0 0\n");
        let (reply, consumed) = whole(&buf);
        assert_eq!(consumed, buf.len());
        assert_eq!(reply.stdout, &buf[..reply_end]);
        // Every prefix short of the trailer is incomplete, never a reply or an error.
        for end in 0..buf.len() {
            assert_eq!(
                parse_serve_reply(&buf[..end]).unwrap(),
                ServeParse::Incomplete,
                "{end}"
            );
        }
        // No boundary line within the promised bytes: out of step.
        let mut long = head.as_bytes().to_vec();
        long.extend_from_slice(&[b'z'; 100]);
        assert!(parse_serve_reply(&long).is_err());
    }

    #[test]
    fn a_run_block_with_a_boundary_ends_each_stream_at_its_line() {
        let head = "waymark-wrap/1 run\nid=x\nstdout_inline=5\nstderr_inline=3\n\
                    boundary=00112233445566778899\n\n";
        let end = "\n--00112233445566778899\n";
        // stdout cut to two bytes, stderr whole.
        let reply = format!("{head}ab{end}err{end}waymark-serve/1 end 0 0\n");
        let (r, consumed) = whole(reply.as_bytes());
        assert_eq!(consumed, reply.len());
        assert_eq!(r.stdout, format!("{head}ab{end}err{end}").as_bytes());
        for cut in 0..reply.len() {
            assert_eq!(
                parse_serve_reply(&reply.as_bytes()[..cut]).unwrap(),
                ServeParse::Incomplete,
                "{cut}"
            );
        }
        // No inline stream (`-`): no part, no line.
        let none = "waymark-wrap/1 run\nid=x\nstdout_inline=-\nstderr_inline=0\n\
                    boundary=00112233445566778899\n\n";
        let reply = format!("{none}{end}waymark-serve/1 end 0 0\n");
        assert_eq!(whole(reply.as_bytes()).1, reply.len());
    }

    #[test]
    fn a_payload_that_looks_like_a_trailer_is_payload() {
        let body = b"waymark-serve/1 end 0 0\n";
        let mut buf =
            format!("waymark-wrap/1 output\nid=x\nlength={}\n\n", body.len()).into_bytes();
        buf.extend_from_slice(body);
        buf.extend_from_slice(b"waymark-serve/1 end 0 2\nline one\nline two\nnext");
        let (reply, consumed) = whole(&buf);
        assert_eq!(consumed, buf.len() - 4, "the next bytes are left");
        assert!(reply.stdout.ends_with(body));
        assert_eq!(reply.stderr, b"line one\nline two\n");
    }

    #[test]
    fn many_status_blocks_and_an_error_without_blocks() {
        let buf = b"waymark-wrap/1 status\nid=a\n\nwaymark-wrap/1 status\nid=b\n\nwaymark-serve/1 end 0 0\n";
        let (reply, _) = whole(buf);
        assert_eq!(reply.stdout.len(), buf.len() - 24);
        let (reply, _) = whole(b"waymark-serve/1 end 64 1\nwaymark-wrap: bad\n");
        assert_eq!(reply.exit_status, 64);
        assert!(reply.stdout.is_empty());
        assert_eq!(reply.stderr, b"waymark-wrap: bad\n");
    }

    #[test]
    fn garbage_is_a_protocol_error() {
        for buf in [
            &b"hello\n"[..],
            b"x",
            b"waymark-wrap/2 run\n\n",
            b"waymark-serve/1 end zero 0\n",
            b"waymark-wrap/1 run\nstdout_inline=many\n\n",
            b"waymark-wrap/1 run\nno equals sign\n\n",
        ] {
            assert!(
                parse_serve_reply(buf).is_err(),
                "{:?}",
                String::from_utf8_lossy(buf)
            );
        }
    }

    #[test]
    fn quoting_keeps_quotes_and_newlines_out_of_the_syntax() {
        assert_eq!(serve_quote("").unwrap(), "''");
        assert_eq!(serve_quote("it's").unwrap(), "'it'\"$Q\"'s'");
        assert_eq!(serve_quote("'").unwrap(), "''\"$Q\"''");
        assert_eq!(serve_quote("a\nb").unwrap(), "'a'\"$NL\"'b'");
        assert!(serve_quote("a\0").is_err());
        let line = RemoteWrapper::default()
            .serve_run(
                "act_01J0000000000000000000000A",
                &StartOptions::default(),
                &["echo", "x\ny"],
            )
            .unwrap();
        assert_eq!(line.matches('\n').count(), 1, "{line:?}");
        assert!(line.ends_with('\n'));
        let with_stdin = StartOptions {
            stdin: true,
            ..Default::default()
        };
        assert!(RemoteWrapper::default()
            .serve_run("act_01J0000000000000000000000A", &with_stdin, &["cat"])
            .is_err());
    }
}
