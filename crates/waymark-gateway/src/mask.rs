//! Masking of secret argument values in what a command printed, as CI systems mask secrets:
//! every occurrence becomes as many `*` as it has bytes, so offsets into the stream stay
//! true (the rest of a stream is read from the host by offset after the stored part).
//!
//! The values are known while this process knows the call: from its dispatch on, for the
//! daemon's life (bounded, oldest first out). An execution recovered after a restart has no
//! values here and is not masked.

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;

use waymark_core::{ActionRequest, ExecutionId, WordPart};

/// Values shorter than this are not masked: a one- or two-byte secret would blank out
/// ordinary output.
pub const MIN_MASKED: usize = 4;

/// How many executions' values are kept.
const KEPT: usize = 4096;

/// The secret values of executions, by id, and the order they came in (oldest first out).
#[derive(Default)]
struct Kept {
    values: HashMap<ExecutionId, Vec<Vec<u8>>>,
    order: VecDeque<ExecutionId>,
}

/// The secret values of executions, by id.
#[derive(Default)]
pub struct Secrets {
    inner: Mutex<Kept>,
}

impl Secrets {
    /// Remembers the secret argument values `request` carries (argv and env) for `id`.
    pub fn remember(&self, id: ExecutionId, request: &ActionRequest) {
        let mut values: Vec<Vec<u8>> = request
            .argv
            .iter()
            .chain(request.env.values())
            .flat_map(|w| w.0.iter())
            .filter_map(|p| match p {
                WordPart::Secret { value, .. } => Some(value.expose().as_bytes().to_vec()),
                _ => None,
            })
            .filter(|v| v.len() >= MIN_MASKED)
            .collect();
        if values.is_empty() {
            return;
        }
        // Longest first: a value that contains another is masked whole.
        values.sort_by_key(|v| std::cmp::Reverse(v.len()));
        values.dedup();
        let mut g = self.inner.lock().expect("secrets");
        if g.values.insert(id, values).is_none() {
            g.order.push_back(id);
            while g.order.len() > KEPT {
                if let Some(old) = g.order.pop_front() {
                    g.values.remove(&old);
                }
            }
        }
    }

    /// Masks the values known for `id` in `bytes`, in place.
    pub fn mask(&self, id: ExecutionId, bytes: &mut [u8]) {
        let g = self.inner.lock().expect("secrets");
        if let Some(values) = g.values.get(&id) {
            for v in values {
                mask_all(bytes, v);
            }
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
    fn every_occurrence_is_masked_byte_for_byte() {
        let mut b = b"token=hunter22 and hunter22hunter22; hunt".to_vec();
        mask_all(&mut b, b"hunter22");
        assert_eq!(b, b"token=******** and ****************; hunt".to_vec());
    }
}
