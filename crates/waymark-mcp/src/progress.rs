//! MCP progress for a running call: the daemon's `execution` and `output` events, turned into
//! `notifications/progress` for a client that sent a `progressToken`.
//!
//! `progress` is the number of output bytes seen so far (both streams), so it only grows; the
//! message names the execution ID and carries a short tail of what the command printed. The
//! daemon masks secret values in the output it streams (every byte of one becomes `*`), so
//! the tail needs no masking here and the shim needs no values to mask.
//!
//! One notification goes out per output line (a chunk the daemon read from the host may hold
//! many), not one per chunk: the daemon reads the host's output only every few hundred
//! milliseconds, so a command that prints three steps quickly would otherwise show one. They
//! are rate-limited by a token bucket ([`BURST`], refilled at [`PER_SECOND`]): a line over the
//! budget is counted but not announced, and the next notification carries its bytes. Output
//! that only the result carried (a command that ended before the daemon first read its
//! output) is announced the same way before the result ([`Progress::on_result`]).

use std::time::Instant;

use rmcp::model::{ProgressNotificationParam, ProgressToken};
use waymark_core::ExecutionId;
use waymark_protocol::answer::{decode_b64, CallOutput};
use waymark_protocol::{Event, Stream};

/// How many characters of output a progress message carries at most.
pub const TAIL_CHARS: usize = 200;

/// How many notifications may go out at once.
pub const BURST: f64 = 10.0;

/// How many notifications per second may go out after a burst.
pub const PER_SECOND: f64 = 10.0;

/// The progress of one call, fed with the daemon's events.
pub struct Progress {
    token: ProgressToken,
    execution: Option<ExecutionId>,
    /// Bytes seen so far per stream (stdout, stderr): the end offset of the latest chunk.
    seen: [u64; 2],
    /// The latest output, at most [`TAIL_CHARS`] characters.
    tail: String,
    /// Notifications that may go out now, and when that was counted.
    budget: (f64, Option<Instant>),
}

impl Progress {
    pub fn new(token: ProgressToken) -> Progress {
        Progress {
            token,
            execution: None,
            seen: [0, 0],
            tail: String::new(),
            budget: (BURST, None),
        }
    }

    /// The notifications one daemon event is worth, now.
    pub fn on_event(&mut self, event: &Event) -> Vec<ProgressNotificationParam> {
        self.on_event_at(event, Instant::now())
    }

    /// The notifications one daemon event is worth at `now`: one for the execution, one per
    /// output line within the budget.
    pub fn on_event_at(&mut self, event: &Event, now: Instant) -> Vec<ProgressNotificationParam> {
        match event {
            Event::Execution { id, .. } => {
                self.execution = Some(*id);
                self.take(now).then(|| self.note()).into_iter().collect()
            }
            Event::Output {
                stream,
                offset,
                data_b64,
            } => self.output(*stream, *offset, &decode_b64(data_b64), now),
            _ => Vec::new(),
        }
    }

    /// The notifications for the output a call's result carries beyond what the events
    /// showed, at `now`.
    pub fn on_result(
        &mut self,
        output: &CallOutput,
        now: Instant,
    ) -> Vec<ProgressNotificationParam> {
        let mut notes = Vec::new();
        for (stream, b64) in [
            (Stream::Stdout, &output.heads.stdout_b64),
            (Stream::Stderr, &output.heads.stderr_b64),
        ] {
            let bytes = decode_b64(b64);
            let seen = self.seen[stream.index()] as usize;
            if bytes.len() > seen {
                notes.extend(self.output(stream, seen as u64, &bytes[seen..], now));
            }
        }
        notes
    }

    /// Counts a chunk of output line by line; one notification per line within the budget.
    fn output(
        &mut self,
        stream: Stream,
        offset: u64,
        bytes: &[u8],
        now: Instant,
    ) -> Vec<ProgressNotificationParam> {
        let stream = stream.index();
        let mut notes = Vec::new();
        let mut at = offset;
        for line in bytes.split_inclusive(|b| *b == b'\n') {
            at += line.len() as u64;
            self.seen[stream] = self.seen[stream].max(at);
            self.tail.push_str(&String::from_utf8_lossy(line));
            let chars = self.tail.chars().count();
            if chars > TAIL_CHARS {
                self.tail = self.tail.chars().skip(chars - TAIL_CHARS).collect();
            }
            if self.take(now) {
                notes.push(self.note());
            }
        }
        notes
    }

    /// Whether one more notification fits the budget at `now` (and takes it if so).
    fn take(&mut self, now: Instant) -> bool {
        let (tokens, at) = &mut self.budget;
        if let Some(before) = *at {
            let refill = now.saturating_duration_since(before).as_secs_f64() * PER_SECOND;
            *tokens = (*tokens + refill).min(BURST);
        }
        *at = Some(now);
        if *tokens >= 1.0 {
            *tokens -= 1.0;
            true
        } else {
            false
        }
    }

    fn note(&self) -> ProgressNotificationParam {
        let mut p = ProgressNotificationParam::new(
            self.token.clone(),
            (self.seen[0] + self.seen[1]) as f64,
        );
        p.message = Some(self.message());
        p
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
            .pop()
            .unwrap();
        assert_eq!(first.progress, 0.0);
        assert_eq!(first.message, Some(format!("{ID}: running")));
        let second = p.on_event(&output(0, "hello\n")).pop().unwrap();
        assert_eq!(second.progress, 6.0);
        assert_eq!(second.message, Some(format!("{ID}: hello")));
        let third = p.on_event(&output(6, "world\n")).pop().unwrap();
        assert_eq!(third.progress, 12.0);
        assert!(p
            .on_event(&Event::Calling {
                tool: "t".into(),
                host: "h".into()
            })
            .is_empty());
    }

    #[test]
    fn the_tail_is_short() {
        let mut p = progress();
        let long = "x".repeat(1000);
        p.on_event(&output(0, &long));
        let n = p.on_event(&output(1000, "token=******* ok")).pop().unwrap();
        let m = n.message.unwrap();
        assert!(m.ends_with("xtoken=******* ok"), "{m}");
        assert!(m.chars().count() <= TAIL_CHARS + "execution not yet known: ".len());
    }

    #[test]
    fn each_line_of_a_chunk_is_a_notification_of_its_own() {
        let mut p = progress();
        let notes = p.on_event(&output(0, "0/100\n50/100\n100/100\n"));
        let bytes: Vec<f64> = notes.iter().map(|n| n.progress).collect();
        assert_eq!(bytes, vec![6.0, 13.0, 21.0]);
        assert!(notes[2].message.as_ref().unwrap().ends_with("100/100"));
    }

    #[test]
    fn notifications_are_rate_limited_and_the_next_one_carries_the_bytes() {
        let mut p = progress();
        let t0 = Instant::now();
        let many: String = (0..100).map(|i| format!("{i:02}\n")).collect();
        let notes = p.on_event_at(&output(0, &many), t0);
        assert_eq!(notes.len(), BURST as usize, "a burst at most");
        // A second later the budget has refilled: the next line says all 303 bytes.
        let later = t0 + std::time::Duration::from_secs(1);
        let next = p.on_event_at(&output(300, "x\n"), later);
        assert_eq!(next.len(), 1);
        assert_eq!(next[0].progress, 302.0);
    }

    #[test]
    fn output_only_the_result_carried_is_announced_line_by_line() {
        use waymark_protocol::answer::OutputHeads;
        let mut p = progress();
        p.on_event(&output(0, "0/100\n"));
        let out = CallOutput {
            heads: OutputHeads::new(b"0/100\n50/100\n100/100\n", 21, b"", 0),
            stdout_truncated: false,
            stderr_truncated: false,
        };
        let notes = p.on_result(&out, Instant::now());
        let bytes: Vec<f64> = notes.iter().map(|n| n.progress).collect();
        assert_eq!(bytes, vec![13.0, 21.0], "only what the events did not show");
        assert!(p.on_result(&out, Instant::now()).is_empty());
    }
}
