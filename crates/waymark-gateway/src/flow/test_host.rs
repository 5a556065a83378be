//! A host for the flow's unit tests of its output scheduling: it holds each execution's two
//! streams in memory, answers watches and reads of them as the wrapper would, and records
//! every watch and read with the (tokio) time it came. It serves nothing else. What is under
//! test with it is when and with what the flow asks; the wrapper's `watch` and `output`
//! themselves are tested against real shells (`wrapper_local`) and end to end through the
//! gateway and a real sshd (`flow_ssh`).

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use tokio::time::Instant;
use waymark_core::{ExecutionId, Stream};

use crate::config::HostEntry;
use crate::host::{
    Arg, DispatchError, DispatchOutcome, EnvVar, FetchedOutput, HostError, HostExecutor,
    MarkerView, OutputNews,
};

/// One execution as the host holds it: `[stdout, stderr]` and whether it ended.
#[derive(Clone, Default)]
pub(super) struct Held {
    pub streams: [Vec<u8>; 2],
    pub ended: bool,
}

/// A watch as the host got it: when, and the executions with the sizes the caller had.
pub(super) type Watch = (Instant, Vec<(ExecutionId, [u64; 2])>);

#[derive(Default)]
pub(super) struct TestHost {
    /// How long a watch with news takes to answer (a round trip).
    pub delay: Duration,
    /// Every watch fails (a dropped connection).
    pub fail: bool,
    pub held: Mutex<HashMap<ExecutionId, Held>>,
    /// Each watch: when it came and what it asked.
    pub watches: Mutex<Vec<Watch>>,
    /// Each read: when it came, of what, from which offset.
    pub reads: Mutex<Vec<(Instant, ExecutionId, Stream, u64)>>,
}

impl Held {
    pub fn new(stdout: &[u8], stderr: &[u8], ended: bool) -> Self {
        Held {
            streams: [stdout.to_vec(), stderr.to_vec()],
            ended,
        }
    }
}

impl TestHost {
    pub fn hold(&self, id: ExecutionId, held: Held) {
        self.held.lock().unwrap().insert(id, held);
    }

    fn news(&self, known: &[(ExecutionId, [u64; 2])]) -> Vec<OutputNews> {
        let held = self.held.lock().unwrap();
        known
            .iter()
            .filter_map(|(id, sizes)| {
                let h = held.get(id)?;
                let now = [h.streams[0].len() as u64, h.streams[1].len() as u64];
                (now != *sizes || h.ended).then_some(OutputNews {
                    id: *id,
                    sizes: now,
                    ended: h.ended,
                })
            })
            .collect()
    }
}

impl HostExecutor for TestHost {
    async fn dispatch(
        &self,
        _: &HostEntry,
        _: ExecutionId,
        _: Vec<Arg>,
        _: Option<String>,
        _: Vec<EnvVar>,
        _: Duration,
    ) -> Result<DispatchOutcome, DispatchError> {
        unreachable!("the test host only watches and reads")
    }

    async fn status(&self, _: &HostEntry, _: ExecutionId) -> Result<MarkerView, HostError> {
        unreachable!("the test host only watches and reads")
    }

    /// As the wrapper's `watch`: news as soon as there is any, else nothing once `wait` ran
    /// out. News already there when the watch comes is answered after `delay`.
    async fn watch_output(
        &self,
        _: &HostEntry,
        wait: Duration,
        known: &[(ExecutionId, [u64; 2])],
    ) -> Result<Vec<OutputNews>, HostError> {
        self.watches
            .lock()
            .unwrap()
            .push((Instant::now(), known.to_vec()));
        tokio::time::sleep(self.delay).await;
        if self.fail {
            return Err(HostError::Lost("the connection dropped".into()));
        }
        let news = self.news(known);
        if news.is_empty() {
            tokio::time::sleep(wait.saturating_sub(self.delay)).await;
        }
        Ok(news)
    }

    async fn fetch_output(
        &self,
        _: &HostEntry,
        _: ExecutionId,
        _: u64,
    ) -> Result<(FetchedOutput, FetchedOutput), HostError> {
        unreachable!("the test host only watches and reads")
    }

    async fn read_output(
        &self,
        _: &HostEntry,
        id: ExecutionId,
        stream: Stream,
        offset: u64,
        max: u64,
    ) -> Result<(Vec<u8>, u64), HostError> {
        self.reads
            .lock()
            .unwrap()
            .push((Instant::now(), id, stream, offset));
        let held = self.held.lock().unwrap();
        let bytes = &held.get(&id).map(|h| h.streams.clone()).unwrap_or_default()
            [usize::from(stream == Stream::Stderr)];
        let from = (offset as usize).min(bytes.len());
        let to = (from + max as usize).min(bytes.len());
        Ok((bytes[from..to].to_vec(), bytes.len() as u64))
    }

    async fn cancel(&self, _: &HostEntry, _: ExecutionId) -> Result<MarkerView, HostError> {
        unreachable!("the test host only watches and reads")
    }
}

/// A host entry by that name (the test host does not connect anywhere).
pub(super) fn host(name: &str) -> HostEntry {
    HostEntry {
        name: name.into(),
        address: "127.0.0.1".into(),
        port: 22,
        user: "u".into(),
        credential: "k".into(),
        known_hosts: "/dev/null".into(),
        host_key_policy: Default::default(),
        remote_dir: ".waymark".into(),
        max_sessions: 10,
        serve: true,
    }
}
