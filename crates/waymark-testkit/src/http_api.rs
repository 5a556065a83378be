//! A real HTTP/1.1 API on a free loopback port, for the HTTP channel's tests: it honours the
//! `Idempotency-Key` header the way the IETF draft describes, counts the effects it performs,
//! and injects faults at the points that matter (after the request arrived, before or after the
//! effect, instead of the answer).
//!
//! Routes:
//! - `POST /payments`: the effect. Without a key it charges every time. With a key it charges
//!   once, answers `201` with `{"payment": N, ...}`, replays that answer (header
//!   `Idempotent-Replayed: true`) for the same key and body, answers `409` while the first
//!   request with that key is still being processed and `422` when the key comes back with a
//!   different body.
//!   While [`TestHttpApi::set_decline`] is on, a payment is declined instead: `402` with
//!   `{"declined":true}`, remembered under its key like any answer (nothing is charged).
//! - `GET /operations/{key}`: `200 {"state":"done","status":S,"outcome":"charged"|"declined",
//!   "body":...}` once the payment with that key is done (a declined one too: the operation
//!   exists and finished; only `status` and `outcome` say it failed), `202 {"state":"in_flight"}` while it runs, `404` if it never arrived.
//! - `ANY /status/{code}`: answers that code with a small JSON body (an effect is counted).
//! - `GET /bytes/{n}`: `n` bytes of binary output.
//! - anything else: `200` echoing method, path, headers and body as JSON.
//!
//! Threads and blocking sockets, so it needs no runtime of the test's; stopped on drop.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{Ipv4Addr, Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread;
use std::time::Duration;

/// A fault applied to the requests that arrive while it is set.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum HttpFault {
    /// Answer normally.
    None,
    /// Read the whole request, then reset the connection without doing anything: the request
    /// left the client, the effect never happened.
    ResetBeforeEffect,
    /// Do the effect, then reset the connection instead of answering: the effect happened and
    /// the client cannot know.
    ResetAfterEffect,
    /// Do the effect, then hold the answer this long before sending it.
    DelayAnswer(Duration),
    /// Answer with bytes that are not HTTP.
    Garbage,
}

/// One request as the API received it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReceivedRequest {
    pub method: String,
    pub path: String,
    /// Header names in lower case.
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl ReceivedRequest {
    /// The value of header `name` (any case), if present.
    pub fn header(&self, name: &str) -> Option<&str> {
        let name = name.to_ascii_lowercase();
        self.headers
            .iter()
            .find(|(k, _)| *k == name)
            .map(|(_, v)| v.as_str())
    }
}

#[derive(Clone, Debug)]
enum KeyState {
    InFlight,
    Done {
        body: Vec<u8>,
        status: u16,
        answer: String,
    },
}

#[derive(Default)]
struct State {
    requests: Vec<ReceivedRequest>,
    effects: u64,
    keys: HashMap<String, KeyState>,
    processing: Duration,
    decline: bool,
}

struct Shared {
    state: Mutex<State>,
    fault: Mutex<HttpFault>,
    changed: Condvar,
    stop: AtomicBool,
}

/// The API server; stops listening on drop.
pub struct TestHttpApi {
    addr: SocketAddr,
    shared: Arc<Shared>,
}

impl TestHttpApi {
    /// Starts the API on a free loopback port.
    pub fn start() -> TestHttpApi {
        let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
            .unwrap_or_else(|e| panic!("cannot bind 127.0.0.1:0 for the test HTTP API: {e}"));
        let addr = listener
            .local_addr()
            .expect("a bound socket has an address");
        let shared = Arc::new(Shared {
            state: Mutex::new(State::default()),
            fault: Mutex::new(HttpFault::None),
            changed: Condvar::new(),
            stop: AtomicBool::new(false),
        });
        let accept = shared.clone();
        thread::spawn(move || {
            for conn in listener.incoming() {
                if accept.stop.load(Ordering::SeqCst) {
                    break;
                }
                let Ok(conn) = conn else { continue };
                let shared = accept.clone();
                thread::spawn(move || serve(conn, &shared));
            }
        });
        TestHttpApi { addr, shared }
    }

    /// `127.0.0.1:PORT`.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `http://127.0.0.1:PORT` followed by `path`.
    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    /// Sets the fault for requests that arrive from now on.
    pub fn set_fault(&self, fault: HttpFault) {
        *self.shared.fault.lock().unwrap() = fault;
    }

    /// How long a payment takes to process (the window in which a second request with the same
    /// key gets `409`).
    pub fn set_processing_time(&self, d: Duration) {
        self.shared.state.lock().unwrap().processing = d;
    }

    /// Whether payments from now on are declined (`402`, nothing charged) instead of charged.
    pub fn set_decline(&self, on: bool) {
        self.shared.state.lock().unwrap().decline = on;
    }

    /// How many effects (payments, `/status` calls) the API performed.
    pub fn effects(&self) -> u64 {
        self.shared.state.lock().unwrap().effects
    }

    /// Every request received so far, in arrival order.
    pub fn requests(&self) -> Vec<ReceivedRequest> {
        self.shared.state.lock().unwrap().requests.clone()
    }

    /// Waits until at least `n` requests arrived, for at most `limit`.
    pub fn wait_requests(&self, n: usize, limit: Duration) -> bool {
        let state = self.shared.state.lock().unwrap();
        let (state, _) = self
            .shared
            .changed
            .wait_timeout_while(state, limit, |s| s.requests.len() < n)
            .unwrap();
        state.requests.len() >= n
    }
}

impl Drop for TestHttpApi {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        let _ = TcpStream::connect(self.addr);
    }
}

fn serve(mut conn: TcpStream, shared: &Shared) {
    let _ = conn.set_read_timeout(Some(Duration::from_secs(30)));
    let mut buf = Vec::new();
    loop {
        let Some(req) = read_request(&mut conn, &mut buf) else {
            return;
        };
        {
            let mut state = shared.state.lock().unwrap();
            state.requests.push(req.clone());
            shared.changed.notify_all();
        }
        let fault = shared.fault.lock().unwrap().clone();
        if fault == HttpFault::ResetBeforeEffect {
            return reset(conn);
        }
        let (status, extra, body) = handle(&req, shared);
        match fault {
            HttpFault::ResetAfterEffect => return reset(conn),
            HttpFault::Garbage => {
                let _ = conn.write_all(b"\x00\x01garbage, not HTTP\r\n\r\n");
                return;
            }
            HttpFault::DelayAnswer(d) => thread::sleep(d),
            _ => {}
        }
        let mut head = format!(
            "HTTP/1.1 {status} {}\r\ncontent-length: {}\r\n",
            reason(status),
            body.len()
        );
        for (k, v) in extra {
            head.push_str(&format!("{k}: {v}\r\n"));
        }
        head.push_str("\r\n");
        // One write: a head and a body written apart meet Nagle's algorithm on this side and
        // a delayed ACK on a kept-alive client's, which stalls every answer by ~40 ms.
        let mut answer = head.into_bytes();
        answer.extend_from_slice(&body);
        if conn.write_all(&answer).is_err() {
            return;
        }
    }
}

/// Closes with a TCP reset (linger 0), as a crashed server or a middlebox would.
fn reset(conn: TcpStream) {
    let fd = std::os::unix::io::AsRawFd::as_raw_fd(&conn);
    let linger = libc::linger {
        l_onoff: 1,
        l_linger: 0,
    };
    // SAFETY: fd is a valid socket owned by `conn`; the option value is a properly sized linger.
    unsafe {
        libc::setsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_LINGER,
            &linger as *const libc::linger as *const libc::c_void,
            std::mem::size_of::<libc::linger>() as libc::socklen_t,
        );
    }
    drop(conn);
}

fn read_request(conn: &mut TcpStream, buf: &mut Vec<u8>) -> Option<ReceivedRequest> {
    let mut chunk = [0u8; 8192];
    loop {
        let mut headers = [httparse::EMPTY_HEADER; 64];
        let mut parsed = httparse::Request::new(&mut headers);
        match parsed.parse(buf) {
            Ok(httparse::Status::Complete(head_len)) => {
                let method = parsed.method.unwrap_or("").to_string();
                let path = parsed.path.unwrap_or("").to_string();
                let headers: Vec<(String, String)> = parsed
                    .headers
                    .iter()
                    .map(|h| {
                        (
                            h.name.to_ascii_lowercase(),
                            String::from_utf8_lossy(h.value).into_owned(),
                        )
                    })
                    .collect();
                let len: usize = headers
                    .iter()
                    .find(|(k, _)| k == "content-length")
                    .and_then(|(_, v)| v.trim().parse().ok())
                    .unwrap_or(0);
                while buf.len() < head_len + len {
                    let n = conn.read(&mut chunk).ok()?;
                    if n == 0 {
                        return None;
                    }
                    buf.extend_from_slice(&chunk[..n]);
                }
                let body = buf[head_len..head_len + len].to_vec();
                buf.drain(..head_len + len);
                return Some(ReceivedRequest {
                    method,
                    path,
                    headers,
                    body,
                });
            }
            Ok(httparse::Status::Partial) => {
                let n = conn.read(&mut chunk).ok()?;
                if n == 0 {
                    return None;
                }
                buf.extend_from_slice(&chunk[..n]);
            }
            Err(_) => {
                let _ = conn.write_all(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\n\r\n");
                let _ = conn.shutdown(Shutdown::Both);
                return None;
            }
        }
    }
}

type Answer = (u16, Vec<(String, String)>, Vec<u8>);

fn json_answer(status: u16, body: String) -> Answer {
    (
        status,
        vec![("content-type".into(), "application/json".into())],
        body.into_bytes(),
    )
}

fn handle(req: &ReceivedRequest, shared: &Shared) -> Answer {
    let path = req.path.split('?').next().unwrap_or("");
    if req.method == "POST" && path == "/payments" {
        return payment(req, shared);
    }
    if let Some(key) = path.strip_prefix("/operations/") {
        let state = shared.state.lock().unwrap();
        return match state.keys.get(key) {
            None => json_answer(404, r#"{"error":"no operation with that key"}"#.into()),
            Some(KeyState::InFlight) => json_answer(202, r#"{"state":"in_flight"}"#.into()),
            Some(KeyState::Done { status, answer, .. }) => {
                let outcome = if *status < 400 { "charged" } else { "declined" };
                json_answer(
                    200,
                    format!(
                        r#"{{"state":"done","status":{status},"outcome":"{outcome}","body":{answer}}}"#
                    ),
                )
            }
        };
    }
    if let Some(code) = path.strip_prefix("/status/") {
        shared.state.lock().unwrap().effects += 1;
        let code: u16 = code.parse().unwrap_or(400);
        return json_answer(code, format!(r#"{{"status":{code}}}"#));
    }
    if let Some(n) = path.strip_prefix("/bytes/") {
        let n: usize = n.parse().unwrap_or(0);
        let bytes: Vec<u8> = (0..n).map(|i| (i % 251) as u8).collect();
        return (
            200,
            vec![("content-type".into(), "application/octet-stream".into())],
            bytes,
        );
    }
    let echo = serde_json_like(req);
    json_answer(200, echo)
}

fn payment(req: &ReceivedRequest, shared: &Shared) -> Answer {
    let key = req.header("idempotency-key").map(str::to_string);
    let processing = {
        let mut state = shared.state.lock().unwrap();
        if let Some(key) = &key {
            match state.keys.get(key) {
                Some(KeyState::InFlight) => return json_answer(
                    409,
                    r#"{"error":"a request with this Idempotency-Key is still being processed"}"#
                        .into(),
                ),
                Some(KeyState::Done { body, .. }) if *body != req.body => {
                    return json_answer(
                        422,
                        r#"{"error":"this Idempotency-Key was used with a different payload"}"#
                            .into(),
                    )
                }
                Some(KeyState::Done { status, answer, .. }) => {
                    let (status, answer) = (*status, answer.clone());
                    let mut a = json_answer(status, answer);
                    a.1.push(("idempotent-replayed".into(), "true".into()));
                    return a;
                }
                None => {
                    state.keys.insert(key.clone(), KeyState::InFlight);
                }
            }
        }
        state.processing
    };
    thread::sleep(processing);
    let mut state = shared.state.lock().unwrap();
    let (status, answer) = if state.decline {
        (402, r#"{"declined":true,"charged":false}"#.to_string())
    } else {
        state.effects += 1;
        (
            201,
            format!(r#"{{"payment":{},"charged":true}}"#, state.effects),
        )
    };
    if let Some(key) = key {
        state.keys.insert(
            key,
            KeyState::Done {
                body: req.body.clone(),
                status,
                answer: answer.clone(),
            },
        );
    }
    json_answer(status, answer)
}

/// The echo answer, written by hand to keep the kit free of a JSON dependency.
fn serde_json_like(req: &ReceivedRequest) -> String {
    let esc = |s: &str| {
        let mut out = String::from("\"");
        for c in s.chars() {
            match c {
                '"' => out.push_str("\\\""),
                '\\' => out.push_str("\\\\"),
                c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
                c => out.push(c),
            }
        }
        out.push('"');
        out
    };
    let headers: Vec<String> = req
        .headers
        .iter()
        .map(|(k, v)| format!("[{},{}]", esc(k), esc(v)))
        .collect();
    format!(
        r#"{{"method":{},"path":{},"headers":[{}],"body":{}}}"#,
        esc(&req.method),
        esc(&req.path),
        headers.join(","),
        esc(&String::from_utf8_lossy(&req.body))
    )
}

fn reason(status: u16) -> &'static str {
    match status {
        200 => "OK",
        201 => "Created",
        400 => "Bad Request",
        402 => "Payment Required",
        404 => "Not Found",
        409 => "Conflict",
        422 => "Unprocessable Content",
        500 => "Internal Server Error",
        503 => "Service Unavailable",
        _ => "Status",
    }
}
