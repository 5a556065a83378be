//! Streamable HTTP sessions whose request streams can be resumed after their answer.
//!
//! A client that loses a POST's SSE stream reconnects with `GET` and `Last-Event-ID`, and the
//! README promises it gets the events and the result it missed. rmcp's `LocalSessionManager`
//! keeps each request stream's events for that, but forgets the stream the moment the request
//! is answered (rmcp 3.11, `LocalSessionWorker::handle_server_message`: on a response or an
//! error it does `self.tx_router.remove(&id)`, although `SessionConfig::completed_cache_ttl`
//! says answered streams are kept for late resumes). So a client that was away when a short
//! command finished reconnected to an empty stream that ended at once, and never got its
//! result.
//!
//! [`ResumableSessions`] is rmcp's manager with request streams kept here instead: a task
//! drains each stream rmcp opens for a POST whether or not a client listens, and keeps its
//! events; the POST's response, and any resume of it, follow that record from the event after
//! the one the client names, live until rmcp ends the stream (the request is answered), then
//! end. An ended record is kept for rmcp's `completed_cache_ttl`. The standalone GET stream
//! and everything else stay rmcp's.
//!
//! rmcp ends a request stream early in two more cases: `notifications/cancelled` (the client
//! gave the request up) and `close_sse_stream`, which Waymark never calls.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use futures::{Stream, StreamExt};
use rmcp::model::{ClientJsonRpcMessage, ServerJsonRpcMessage};
use rmcp::transport::streamable_http_server::session::local::{
    LocalSessionManager, LocalSessionManagerError,
};
use rmcp::transport::streamable_http_server::session::{
    EventStore, RestoreOutcome, ServerSseMessage, SessionId, SessionManager,
};

/// How many events a request stream keeps (the oldest go first; the answer, the last event,
/// always stays). A client further behind than this misses progress, never its result.
const KEPT_EVENTS: usize = 256;

/// rmcp's [`LocalSessionManager`], with each request stream's events kept until the stream has
/// been over for `completed_cache_ttl`, so a resume after the answer still carries it.
#[derive(Default)]
pub struct ResumableSessions {
    inner: LocalSessionManager,
    streams: Arc<Mutex<Streams>>,
}

/// Each request stream by its session and rmcp's number for it (the `N` in its SSE ids,
/// `index/N`).
type Streams = HashMap<(SessionId, u64), Arc<Record>>;

/// The events of one request stream, and whether it is over.
struct Record {
    kept: Mutex<Kept>,
    /// Rings on every change of `kept`, for the clients following it.
    changed: tokio::sync::watch::Sender<()>,
}

#[derive(Default)]
struct Kept {
    /// Events in order, each with its position (0 for the first the stream ever had).
    events: VecDeque<(u64, ServerSseMessage)>,
    next: u64,
    ended: Option<Instant>,
}

impl Record {
    fn new() -> Arc<Record> {
        Arc::new(Record {
            kept: Mutex::default(),
            changed: tokio::sync::watch::Sender::new(()),
        })
    }

    fn kept(&self) -> std::sync::MutexGuard<'_, Kept> {
        // A follower that panicked mid-read leaves the events as they were.
        self.kept.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn push(&self, event: ServerSseMessage) {
        let mut kept = self.kept();
        let at = kept.next;
        kept.next += 1;
        kept.events.push_back((at, event));
        if kept.events.len() > KEPT_EVENTS {
            kept.events.pop_front();
        }
        drop(kept);
        self.changed.send_replace(());
    }

    fn end(&self) {
        self.kept().ended = Some(Instant::now());
        self.changed.send_replace(());
    }

    fn ended_at(&self) -> Option<Instant> {
        self.kept().ended
    }

    /// The position after the event whose SSE id is `last_event_id`; when this record no
    /// longer holds it, the oldest it holds (a duplicate is better than a lost event).
    fn after(&self, last_event_id: &str) -> u64 {
        let kept = self.kept();
        kept.events
            .iter()
            .find(|(_, e)| e.event_id.as_deref() == Some(last_event_id))
            .map_or(0, |(at, _)| at + 1)
    }

    /// The events from position `from` on (from the oldest kept when `from` is gone), and
    /// whether the stream is over.
    fn since(&self, from: u64) -> (Vec<(u64, ServerSseMessage)>, bool) {
        let kept = self.kept();
        let events = kept
            .events
            .iter()
            .filter(|(at, _)| *at >= from)
            .cloned()
            .collect();
        (events, kept.ended.is_some())
    }
}

/// rmcp's number for the request stream an SSE id belongs to: `index/N` is event `index` of
/// request stream `N`; an id without `/` is the standalone stream's.
fn request_stream_of(event_id: &str) -> Option<u64> {
    event_id.split_once('/')?.1.parse().ok()
}

/// Drains rmcp's stream for one request into `record`, whether or not a client follows it,
/// and files the record under its session and number once its first event names them.
async fn keep(
    inner: impl Stream<Item = ServerSseMessage> + Send + 'static,
    record: Arc<Record>,
    streams: Arc<Mutex<Streams>>,
    session: SessionId,
) {
    let mut inner = std::pin::pin!(inner);
    let mut filed = false;
    while let Some(event) = inner.next().await {
        if !filed {
            if let Some(n) = event.event_id.as_deref().and_then(request_stream_of) {
                lock(&streams).insert((session.clone(), n), record.clone());
                filed = true;
            }
        }
        record.push(event);
    }
    record.end();
}

/// A stream of `record`'s events from position `from`, live until the record ends. A task
/// feeds it, so the stream rmcp hands to hyper is a plain channel (`Send + Sync`); the task
/// stops when the client goes away.
fn follow(record: Arc<Record>, from: u64) -> impl Stream<Item = ServerSseMessage> + Send + Sync {
    let (tx, mut rx) = tokio::sync::mpsc::channel(16);
    tokio::spawn(async move {
        let mut changes = record.changed.subscribe();
        let mut from = from;
        loop {
            // Marked seen before reading, so a change after the read wakes the wait below.
            changes.borrow_and_update();
            let (events, ended) = record.since(from);
            let idle = events.is_empty();
            for (at, event) in events {
                if tx.send(event).await.is_err() {
                    return;
                }
                from = at + 1;
            }
            if ended {
                return;
            }
            if idle {
                tokio::select! {
                    changed = changes.changed() => if changed.is_err() { return },
                    _ = tx.closed() => return,
                }
            }
        }
    });
    futures::stream::poll_fn(move |cx| rx.poll_recv(cx))
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl ResumableSessions {
    /// Forgets request streams over for longer than rmcp keeps answered ones.
    fn evict(&self) {
        let ttl = self.inner.session_config.completed_cache_ttl;
        lock(&self.streams).retain(|_, r| r.ended_at().is_none_or(|at| at.elapsed() < ttl));
    }
}

impl SessionManager for ResumableSessions {
    type Error = LocalSessionManagerError;
    type Transport = <LocalSessionManager as SessionManager>::Transport;

    async fn create_session(&self) -> Result<(SessionId, Self::Transport), Self::Error> {
        self.inner.create_session().await
    }

    async fn initialize_session(
        &self,
        id: &SessionId,
        message: ClientJsonRpcMessage,
    ) -> Result<ServerJsonRpcMessage, Self::Error> {
        self.inner.initialize_session(id, message).await
    }

    async fn has_session(&self, id: &SessionId) -> Result<bool, Self::Error> {
        self.inner.has_session(id).await
    }

    async fn close_session(&self, id: &SessionId) -> Result<(), Self::Error> {
        lock(&self.streams).retain(|(session, _), _| session != id);
        self.inner.close_session(id).await
    }

    async fn create_stream(
        &self,
        id: &SessionId,
        message: ClientJsonRpcMessage,
    ) -> Result<impl Stream<Item = ServerSseMessage> + Send + Sync + 'static, Self::Error> {
        self.evict();
        let inner = self.inner.create_stream(id, message).await?;
        let record = Record::new();
        tokio::spawn(keep(
            inner,
            record.clone(),
            self.streams.clone(),
            id.clone(),
        ));
        Ok(follow(record, 0))
    }

    async fn accept_message(
        &self,
        id: &SessionId,
        message: ClientJsonRpcMessage,
    ) -> Result<(), Self::Error> {
        self.inner.accept_message(id, message).await
    }

    async fn create_standalone_stream(
        &self,
        id: &SessionId,
    ) -> Result<impl Stream<Item = ServerSseMessage> + Send + Sync + 'static, Self::Error> {
        self.inner.create_standalone_stream(id).await
    }

    async fn resume(
        &self,
        id: &SessionId,
        last_event_id: String,
    ) -> Result<impl Stream<Item = ServerSseMessage> + Send + Sync + 'static, Self::Error> {
        self.evict();
        let record = request_stream_of(&last_event_id)
            .and_then(|n| lock(&self.streams).get(&(id.clone(), n)).cloned());
        match record {
            Some(record) => {
                let from = record.after(&last_event_id);
                Ok(follow(record, from).left_stream())
            }
            // The standalone stream, or a request stream forgotten: rmcp's answer.
            None => Ok(self.inner.resume(id, last_event_id).await?.right_stream()),
        }
    }

    async fn restore_session(
        &self,
        id: SessionId,
    ) -> Result<RestoreOutcome<Self::Transport>, Self::Error> {
        self.inner.restore_session(id).await
    }

    fn event_store(&self) -> Option<Arc<dyn EventStore>> {
        self.inner.event_store()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn event(id: &str) -> ServerSseMessage {
        ServerSseMessage::priming(id, Duration::from_secs(3))
    }

    async fn next_id(s: &mut (impl Stream<Item = ServerSseMessage> + Unpin)) -> Option<String> {
        tokio::time::timeout(Duration::from_secs(10), s.next())
            .await
            .expect("the follower answers")
            .map(|e| e.event_id.unwrap())
    }

    #[test]
    fn an_sse_id_names_its_request_stream() {
        assert_eq!(request_stream_of("3/17"), Some(17));
        assert_eq!(request_stream_of("3"), None);
        assert_eq!(request_stream_of("x/y"), None);
    }

    #[tokio::test]
    async fn a_resume_gets_what_came_after_the_named_event_live_then_ends() {
        let record = Record::new();
        record.push(event("0/1"));
        record.push(event("1/1"));
        let mut resumed = std::pin::pin!(follow(record.clone(), record.after("0/1")));
        assert_eq!(next_id(&mut resumed).await.as_deref(), Some("1/1"));
        record.push(event("2/1"));
        assert_eq!(next_id(&mut resumed).await.as_deref(), Some("2/1"));
        record.end();
        assert_eq!(next_id(&mut resumed).await, None, "an ended record ends");
        // After the end, a resume from the start still gets every event, then the end.
        let mut late = std::pin::pin!(follow(record.clone(), record.after("0/1")));
        assert_eq!(next_id(&mut late).await.as_deref(), Some("1/1"));
        assert_eq!(next_id(&mut late).await.as_deref(), Some("2/1"));
        assert_eq!(next_id(&mut late).await, None);
    }

    #[test]
    fn a_long_stream_keeps_its_latest_events_and_a_forgotten_id_replays_them_all() {
        let record = Record::new();
        for i in 0..KEPT_EVENTS + 10 {
            record.push(event(&format!("{i}/1")));
        }
        let (events, ended) = record.since(record.after("0/1"));
        assert!(!ended);
        assert_eq!(events.len(), KEPT_EVENTS);
        assert_eq!(events[0].1.event_id.as_deref(), Some("10/1"));
        let last = format!("{}/1", KEPT_EVENTS + 9);
        assert_eq!(events.last().unwrap().1.event_id.as_deref(), Some(&*last));
    }
}
