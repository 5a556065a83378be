//! Opening a ledger's sled database behind its back, as an attacker with file access would.

use std::path::Path;

/// Opens the ledger's sled database directly, as an attacker with file access would.
pub fn raw_sled(path: &Path) -> sled::Db {
    // sled lets go of its file lock only once the dropped ledger's flusher thread has exited,
    // a moment after the drop (`Ledger::open` waits the same way); on a loaded machine that
    // moment is long enough for a raw open to find the lock still held.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    loop {
        match sled::open(path.join("db")) {
            Err(e)
                if e.to_string().contains("could not acquire lock")
                    && std::time::Instant::now() < deadline =>
            {
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
            other => break other.unwrap(),
        }
    }
}
