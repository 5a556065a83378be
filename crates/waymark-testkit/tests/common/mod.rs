//! Helpers shared by the kit's own tests.
#![allow(dead_code)]

use std::thread;
use std::time::{Duration, Instant};

/// How long any one step of a test may take.
pub const LIMIT: Duration = Duration::from_secs(10);

/// Bytes as text, for messages.
pub fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// Polls `condition` every 20 ms for up to `limit`; true as soon as it holds.
pub fn wait_until(limit: Duration, mut condition: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + limit;
    while Instant::now() < deadline {
        if condition() {
            return true;
        }
        thread::sleep(Duration::from_millis(20));
    }
    condition()
}
