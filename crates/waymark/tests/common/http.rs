//! Raw HTTP/1.1 exchanges with the daemon's Streamable HTTP endpoint, for what rmcp's client
//! will not send: missing or wrong tokens, foreign origins, malformed or oversized bodies,
//! streams closed on purpose, `Last-Event-ID` resumption. One connection per exchange
//! (`Connection: close`); the body is read as it arrives.

use serde_json::Value;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;

/// One exchange: status, headers, and the body still to read.
pub struct Exchange {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub reader: BufReader<TcpStream>,
}

/// One SSE event: its `id:` (if any) and its `data:` as JSON (if any).
#[derive(Debug)]
pub struct Event {
    pub id: Option<String>,
    pub data: Option<Value>,
}

/// Sends `METHOD /mcp` to `127.0.0.1:port` with `Host`, `Content-Length`, `Connection: close`
/// and then `headers` as given, then `body`; reads the status line and the headers. A body the
/// server refuses may be cut short by it: that is an answer too, so a failed body write is not
/// an error.
pub async fn exchange(port: u16, method: &str, headers: &[(&str, &str)], body: &[u8]) -> Exchange {
    let mut s = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
    let mut head = format!(
        "{method} /mcp HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Length: {}\r\nConnection: close\r\n",
        body.len()
    );
    for (k, v) in headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    head.push_str("\r\n");
    s.write_all(head.as_bytes()).await.unwrap();
    let _ = s.write_all(body).await;
    let mut reader = BufReader::new(s);
    let mut status_line = String::new();
    reader.read_line(&mut status_line).await.unwrap();
    let status = status_line
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or_else(|| panic!("an HTTP status line, got {status_line:?}"));
    let mut headers = Vec::new();
    loop {
        let mut h = String::new();
        reader.read_line(&mut h).await.unwrap();
        let h = h.trim_end();
        if h.is_empty() {
            break;
        }
        if let Some((k, v)) = h.split_once(':') {
            headers.push((k.trim().to_string(), v.trim().to_string()));
        }
    }
    Exchange {
        status,
        headers,
        reader,
    }
}

impl Exchange {
    pub fn header(&self, name: &str) -> Option<String> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.clone())
    }

    /// The next SSE event (up to its blank line); `None` when the stream ends. A chunked
    /// body's size lines are neither `id:` nor `data:` and are skipped as noise.
    pub async fn event(&mut self) -> Option<Event> {
        let mut ev = Event {
            id: None,
            data: None,
        };
        let mut any = false;
        loop {
            let mut line = String::new();
            if self.reader.read_line(&mut line).await.ok()? == 0 {
                return any.then_some(ev);
            }
            let line = line.trim_end();
            if line.is_empty() {
                if any {
                    return Some(ev);
                }
                continue;
            }
            any = true;
            if let Some(id) = line.strip_prefix("id:") {
                ev.id = Some(id.trim().to_string());
            } else if let Some(d) = line.strip_prefix("data:") {
                ev.data = serde_json::from_str(d.trim()).ok();
            }
        }
    }

    /// Reads the body until a JSON message (plain JSON or an SSE `data:` line) for which
    /// `wanted` holds arrives; `None` when the connection closes first.
    pub async fn until(&mut self, wanted: impl Fn(&Value) -> bool) -> Option<Value> {
        let mut line = String::new();
        loop {
            line.clear();
            if self.reader.read_line(&mut line).await.ok()? == 0 {
                return None;
            }
            let candidate = line
                .trim()
                .strip_prefix("data:")
                .unwrap_or(line.trim())
                .trim();
            if let Ok(v) = serde_json::from_str::<Value>(candidate) {
                if wanted(&v) {
                    return Some(v);
                }
            }
        }
    }

    /// Reads the body until the JSON-RPC message with this id arrives.
    pub async fn message(&mut self, id: Value) -> Option<Value> {
        self.until(|v| v["id"] == id).await
    }

    /// Reads the body until a progress notification arrives.
    pub async fn progress(&mut self) -> Option<Value> {
        self.until(|v| v["method"] == "notifications/progress")
            .await
    }
}
