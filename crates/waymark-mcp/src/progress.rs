//! MCP progress for a running call: the daemon's `execution` and `output` events, turned into
//! `notifications/progress` for a client that sent a `progressToken`.
//!
//! `progress` is the number of output bytes seen so far (both streams), so it only grows; the
//! message names the execution ID and carries a short tail of what the command printed. The
//! daemon masks secret values in the output it streams (every byte of one becomes `*`), so
//! the tail needs no masking here and the shim needs no values to mask.

use rmcp::model::{ProgressNotificationParam, ProgressToken};
use waymark_core::ExecutionId;
use waymark_protocol::answer::decode_b64;
use waymark_protocol::Event;

/// How many characters of output a progress message carries at most.
pub const TAIL_CHARS: usize = 200;

/// The progress of one call, fed with the daemon's events.
pub struct Progress {
    token: ProgressToken,
    execution: Option<ExecutionId>,
    /// Bytes seen so far per stream (stdout, stderr): the end offset of the latest chunk.
    seen: [u64; 2],
    /// The latest output, at most [`TAIL_CHARS`] characters.
    tail: String,
}

impl Progress {
    pub fn new(token: ProgressToken) -> Progress {
        Progress {
            token,
            execution: None,
            seen: [0, 0],
            tail: String::new(),
        }
    }

    /// The notification one daemon event is worth, if any.
    pub fn on_event(&mut self, event: &Event) -> Option<ProgressNotificationParam> {
        match event {
            Event::Execution { id, .. } => {
                self.execution = Some(*id);
            }
            Event::Output {
                stream,
                offset,
                data_b64,
            } => {
                let stream = stream.index();
                let bytes = decode_b64(data_b64);
                self.seen[stream] = self.seen[stream].max(offset + bytes.len() as u64);
                self.tail.push_str(&String::from_utf8_lossy(&bytes));
                let chars = self.tail.chars().count();
                if chars > TAIL_CHARS {
                    self.tail = self.tail.chars().skip(chars - TAIL_CHARS).collect();
                }
            }
            _ => return None,
        }
        let mut p = ProgressNotificationParam::new(
            self.token.clone(),
            (self.seen[0] + self.seen[1]) as f64,
        );
        p.message = Some(self.message());
        Some(p)
    }

    fn message(&self) -> String {
        let tail = &self.tail;
        let id = self
            .execution
            .map_or("execution not yet known".to_string(), |id| id.to_string());
        if tail.is_empty() {
            format!("{id}: running")
        } else {
            format!("{id}: {}", tail.trim_end())
        }
    }

    /// The output so far in words, for a running task's status message: the byte count and
    /// the latest output.
    pub fn summary(&self) -> String {
        let bytes = self.seen[0] + self.seen[1];
        let tail = self.tail.trim_end();
        if tail.is_empty() {
            format!("{bytes} bytes of output so far")
        } else {
            format!("{bytes} bytes of output so far, latest: {tail}")
        }
    }

    /// The execution the events named, once they did.
    pub fn execution(&self) -> Option<ExecutionId> {
        self.execution
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rmcp::model::NumberOrString;
    use waymark_protocol::answer::encode_b64;
    use waymark_protocol::Stream;

    const ID: &str = "act_01J9Z3K8Q4M7W2X5Y6Z8A9B0CD";

    fn output(offset: u64, text: &str) -> Event {
        Event::Output {
            stream: Stream::Stdout,
            offset,
            data_b64: encode_b64(text.as_bytes()),
        }
    }

    fn progress() -> Progress {
        Progress::new(ProgressToken(NumberOrString::Number(1)))
    }

    #[test]
    fn summary_counts_bytes_and_shows_the_latest_output() {
        let mut p = progress();
        assert_eq!(p.summary(), "0 bytes of output so far");
        p.on_event(&output(0, "token ******* ok\n"));
        assert_eq!(
            p.summary(),
            "17 bytes of output so far, latest: token ******* ok"
        );
    }

    #[test]
    fn progress_counts_output_bytes_and_names_the_execution() {
        let mut p = progress();
        let first = p
            .on_event(&Event::Execution {
                id: ID.parse().unwrap(),
                attached: None,
            })
            .unwrap();
        assert_eq!(first.progress, 0.0);
        assert_eq!(first.message, Some(format!("{ID}: running")));
        let second = p.on_event(&output(0, "hello\n")).unwrap();
        assert_eq!(second.progress, 6.0);
        assert_eq!(second.message, Some(format!("{ID}: hello")));
        let third = p.on_event(&output(6, "world\n")).unwrap();
        assert_eq!(third.progress, 12.0);
        assert!(p
            .on_event(&Event::Calling {
                tool: "t".into(),
                host: "h".into()
            })
            .is_none());
    }

    #[test]
    fn the_tail_is_short() {
        let mut p = progress();
        let long = "x".repeat(1000);
        p.on_event(&output(0, &long));
        let n = p.on_event(&output(1000, "token=******* ok")).unwrap();
        let m = n.message.unwrap();
        assert!(m.ends_with("xtoken=******* ok"), "{m}");
        assert!(m.chars().count() <= TAIL_CHARS + "execution not yet known: ".len());
    }
}
