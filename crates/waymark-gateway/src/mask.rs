//! Masking of secret argument values in what a command printed, as CI systems mask secrets:
//! every occurrence becomes as many `*` as it has bytes, so offsets into the stream stay
//! true (the rest of a stream is read from the host by offset after the stored part).
//!
//! The values are known while this process knows the call: from its dispatch on, for the
//! daemon's life (bounded, oldest first out). An execution this process never dispatched (a
//! daemon restarted since) is masked by the hints its ledger record keeps
//! (`waymark_core::MaskHint`: each value's length and keyed MAC), loaded on first use.
//!
//! Output is read in pieces (live chunks, reads by offset, the stored head), so a value can be
//! cut between two pieces. A piece is therefore masked with the bytes before it
//! ([`Secrets::look_behind`] of them, read again from the host) and with its end taken as
//! possibly cut: trailing bytes that begin a value are masked too. Both halves of a cut value
//! are then masked; the cost is that a piece ending in the first bytes of a value, by chance,
//! shows those bytes as `*`. A hint cannot tell the first bytes of a value, so a piece masked
//! by hints whose end may be cut shows its last `len - 1` bytes as `*`; a reader avoids that
//! by reading [`Secrets::look_behind`] bytes past what it shows.

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;

use waymark_core::{ActionRequest, ExecutionId, FingerprintKey, MaskFinder, MaskHint};

/// Values shorter than this are not masked: a one- or two-byte secret would blank out
/// ordinary output.
pub const MIN_MASKED: usize = 4;

/// How many executions' values are kept.
const KEPT: usize = 4096;

/// What is known of one execution's secret values: the values this process holds, and the
/// hints its ledger record keeps, once loaded. Both mask.
#[derive(Default)]
struct Known {
    /// The values in clear, longest first.
    values: Vec<Vec<u8>>,
    /// Hints from the ledger record: another process dispatched it.
    hints: Vec<MaskHint>,
    /// This process dispatched it and holds every value, or the record's hints are loaded:
    /// reading the record again adds nothing.
    whole: bool,
}

impl Known {
    fn longest(&self) -> usize {
        let values = self.values.first().map_or(0, Vec::len);
        let hints = self.hints.iter().map(|h| h.len as usize).max().unwrap_or(0);
        values.max(hints)
    }
}

/// The secret values of executions, by id, and the order they came in (oldest first out).
#[derive(Default)]
struct Kept {
    known: HashMap<ExecutionId, Known>,
    order: VecDeque<ExecutionId>,
}

impl Kept {
    /// What is known of `id`, made empty when nothing was.
    fn entry(&mut self, id: ExecutionId) -> &mut Known {
        if !self.known.contains_key(&id) {
            while self.order.len() >= KEPT {
                if let Some(old) = self.order.pop_front() {
                    self.known.remove(&old);
                }
            }
            self.order.push_back(id);
        }
        self.known.entry(id).or_default()
    }
}

/// The secret values of executions, by id.
pub struct Secrets {
    inner: Mutex<Kept>,
    finder: MaskFinder,
}

/// The `values` worth masking, longest first, each once.
fn maskable(values: Vec<Vec<u8>>) -> Vec<Vec<u8>> {
    let mut values: Vec<Vec<u8>> = values
        .into_iter()
        .filter(|v| v.len() >= MIN_MASKED)
        .collect();
    // Longest first: a value that contains another is masked whole.
    values.sort_by_key(|v| std::cmp::Reverse(v.len()));
    values.dedup();
    values
}

/// `old` and `new` values worth masking, longest first, each once.
fn merged(mut old: Vec<Vec<u8>>, new: Vec<Vec<u8>>) -> Vec<Vec<u8>> {
    old.extend(new);
    maskable(old)
}

/// The hints the ledger keeps for a call's secret `values`.
pub fn hints(key: &FingerprintKey, values: Vec<Vec<u8>>) -> Vec<MaskHint> {
    maskable(values).iter().map(|v| key.mask_hint(v)).collect()
}

impl Secrets {
    /// Masks with values remembered here, or hints checked under `key`.
    pub fn new(key: &FingerprintKey) -> Secrets {
        Secrets {
            inner: Mutex::default(),
            finder: key.mask_finder(),
        }
    }

    /// Remembers the secret argument values `request` carries (argv and env) for `id`.
    pub fn remember(&self, id: ExecutionId, request: &ActionRequest) {
        let values = request
            .secret_values()
            .map(|v| v.expose().as_bytes().to_vec())
            .collect();
        self.remember_values(id, values);
    }

    /// Keeps `values` (secrets in clear) to mask in what execution `id` returns.
    /// None at all is remembered too: then storing the execution's result need not read its
    /// record for hints. An entry pushed out of this bounded memory costs only that read: the
    /// record's hints mask as its values would.
    pub fn remember_values(&self, id: ExecutionId, values: Vec<Vec<u8>>) {
        let mut g = self.inner.lock().expect("secrets");
        let known = g.entry(id);
        known.values = merged(std::mem::take(&mut known.values), values);
        known.whole = true;
    }

    /// Adds `values` this process sends for `id` now without holding the others (a status
    /// request's credential, after a restart): the record's hints are still to be loaded.
    pub fn add_values(&self, id: ExecutionId, values: Vec<Vec<u8>>) {
        let mut g = self.inner.lock().expect("secrets");
        let known = g.entry(id);
        known.values = merged(std::mem::take(&mut known.values), values);
    }

    /// Whether everything there is to know of `id`'s values is known here: its record need
    /// not be read for hints.
    pub fn knows(&self, id: ExecutionId) -> bool {
        let g = self.inner.lock().expect("secrets");
        g.known.get(&id).is_some_and(|k| k.whole)
    }

    /// Keeps `hints` (from `id`'s ledger record) unless everything is known already.
    pub fn ensure(&self, id: ExecutionId, hints: Vec<MaskHint>) {
        let mut g = self.inner.lock().expect("secrets");
        let known = g.entry(id);
        if !known.whole {
            known.hints = hints;
            known.whole = true;
        }
    }

    /// How many bytes before a piece to read with it so that a value cut at the piece's start
    /// is seen whole: the longest value's length minus one (zero when none is known).
    pub fn look_behind(&self, id: ExecutionId) -> u64 {
        let g = self.inner.lock().expect("secrets");
        g.known
            .get(&id)
            .map_or(0, |k| k.longest().saturating_sub(1) as u64)
    }

    /// Masks the values known for `id` in a piece of output, in place: every whole occurrence,
    /// and, when `end_may_be_cut` (the stream goes on after the piece, or may), trailing bytes
    /// that begin a value. `bytes` starts with `behind` bytes of look-behind, which are removed.
    pub fn mask_piece(
        &self,
        id: ExecutionId,
        bytes: &mut Vec<u8>,
        behind: usize,
        end_may_be_cut: bool,
    ) {
        {
            let g = self.inner.lock().expect("secrets");
            if let Some(known) = g.known.get(&id) {
                for v in &known.values {
                    mask_all(bytes, v);
                }
                for v in known.values.iter().filter(|_| end_may_be_cut) {
                    mask_cut_tail(bytes, v);
                }
                if !known.hints.is_empty() {
                    self.finder.mask_all(bytes, &known.hints);
                    if end_may_be_cut {
                        // A hint cannot tell a value's first bytes: the whole possible cut goes.
                        let longest = known.hints.iter().map(|h| h.len as usize).max();
                        let n = bytes.len();
                        bytes[n.saturating_sub(longest.unwrap_or(1).saturating_sub(1))..]
                            .fill(b'*');
                    }
                }
            }
        }
        bytes.drain(..behind.min(bytes.len()));
    }
}

/// Overwrites the longest end of `bytes` that is a proper prefix of `value` with `*`.
fn mask_cut_tail(bytes: &mut [u8], value: &[u8]) {
    let longest = (value.len() - 1).min(bytes.len());
    for k in (1..=longest).rev() {
        let tail = bytes.len() - k;
        if bytes[tail..] == value[..k] {
            bytes[tail..].fill(b'*');
            return;
        }
    }
}

/// Overwrites every occurrence of `value` in `bytes` with `*`.
fn mask_all(bytes: &mut [u8], value: &[u8]) {
    if value.is_empty() || value.len() > bytes.len() {
        return;
    }
    let mut i = 0;
    while i + value.len() <= bytes.len() {
        if &bytes[i..i + value.len()] == value {
            bytes[i..i + value.len()].fill(b'*');
            i += value.len();
        } else {
            i += 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_value_cut_between_two_pieces_is_masked_in_both() {
        let id = ExecutionId::from_parts(waymark_core::Timestamp::from_millis(1), 1);
        let secrets = Secrets::new(&FingerprintKey::from_bytes([1; 32]));
        secrets.inner.lock().unwrap().entry(id).values = vec![b"hunter22".to_vec()];
        let stream = b"pw=hunter22; done".to_vec();
        for cut in 0..=stream.len() {
            let mut first = stream[..cut].to_vec();
            secrets.mask_piece(id, &mut first, 0, true);
            let behind = (cut as u64).min(secrets.look_behind(id)) as usize;
            let mut second = stream[cut - behind..].to_vec();
            secrets.mask_piece(id, &mut second, behind, true);
            let shown = [first, second].concat();
            assert_eq!(shown.len(), stream.len(), "same length at cut {cut}");
            assert_eq!(
                &shown[3..11],
                b"********",
                "cut at {cut}: {}",
                String::from_utf8_lossy(&shown)
            );
            assert!(shown.ends_with(b"; done"), "cut at {cut}");
        }
        // A whole stream that ends in the first bytes of a value shows them.
        let mut whole = b"ends with hun".to_vec();
        secrets.mask_piece(id, &mut whole, 0, false);
        assert_eq!(whole, b"ends with hun");
    }

    #[test]
    fn every_occurrence_is_masked_byte_for_byte() {
        let mut b = b"token=hunter22 and hunter22hunter22; hunt".to_vec();
        mask_all(&mut b, b"hunter22");
        assert_eq!(b, b"token=******** and ****************; hunt".to_vec());
    }
}
