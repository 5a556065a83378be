//! What the ledger keeps of a secret value so that a process that never held the value can
//! still mask it in output: a daemon restarted after the dispatch reads an execution's output
//! from the host's marker, and the values it would mask died with the process that sent them.
//!
//! A [`MaskHint`] is the value's length and its keyed MAC (the fingerprint key, under a label
//! of its own). Neither gives the value back, and the MAC cannot be checked without the key;
//! the ledger already holds a keyed MAC of every secret in the canonical action, so a hint adds
//! only the length. [`MaskFinder`] finds a hinted value in output by trying the MAC of every
//! window of that length: about a microsecond per byte and hint, paid only where no clear value
//! is known.

use hmac::Mac;
use serde::{Deserialize, Serialize};

use crate::action::{FingerprintKey, HmacSha256};

const LABEL: &[u8] = b"waymark-mask-v1";

/// A secret value as the ledger may keep it: its length and keyed MAC.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MaskHint {
    /// Length of the value in bytes.
    pub len: u32,
    /// `hmac-sha256:<hex>` of the value under the mask label.
    pub mac: String,
}

impl FingerprintKey {
    /// The hint of `value`.
    pub fn mask_hint(&self, value: &[u8]) -> MaskHint {
        MaskHint {
            len: value.len() as u32,
            mac: format!("hmac-sha256:{}", hex::encode(self.mask_finder().mac(value))),
        }
    }

    /// A finder of hinted values in output.
    pub fn mask_finder(&self) -> MaskFinder {
        let mut keyed = self.hmac();
        keyed.update(LABEL);
        MaskFinder { keyed }
    }
}

/// Finds values by their [`MaskHint`]s.
#[derive(Clone)]
pub struct MaskFinder {
    /// Keyed and labelled: a clone per window costs one block less than a fresh key.
    keyed: HmacSha256,
}

impl MaskFinder {
    fn mac(&self, value: &[u8]) -> [u8; 32] {
        let mut mac = self.keyed.clone();
        mac.update(value);
        mac.finalize().into_bytes().into()
    }

    /// Overwrites every occurrence of a hinted value in `bytes` with `*`, longest values first
    /// (a value that contains another is masked whole). Hints that do not parse are skipped.
    pub fn mask_all(&self, bytes: &mut [u8], hints: &[MaskHint]) {
        let mut wanted: Vec<(usize, [u8; 32])> = hints
            .iter()
            .filter_map(|h| {
                let hex = h.mac.strip_prefix("hmac-sha256:")?;
                let mac: [u8; 32] = hex::decode(hex).ok()?.try_into().ok()?;
                Some((h.len as usize, mac))
            })
            .filter(|(len, _)| *len > 0)
            .collect();
        wanted.sort_by_key(|(len, _)| std::cmp::Reverse(*len));
        for (len, mac) in wanted {
            let mut i = 0;
            while i + len <= bytes.len() {
                if self.mac(&bytes[i..i + len]) == mac {
                    bytes[i..i + len].fill(b'*');
                    i += len;
                } else {
                    i += 1;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_hinted_value_is_masked_wherever_it_stands_and_nothing_else_is() {
        let key = FingerprintKey::from_bytes([7; 32]);
        let hints = [key.mask_hint(b"hunter22"), key.mask_hint(b"s3cr3t-longer")];
        let mut out = b"a hunter22 b hunter2 c s3cr3t-longer hunter22hunter22".to_vec();
        key.mask_finder().mask_all(&mut out, &hints);
        assert_eq!(
            String::from_utf8(out).unwrap(),
            "a ******** b hunter2 c ************* ****************"
        );
    }

    #[test]
    fn another_key_finds_nothing_and_the_hint_keeps_no_clear_text() {
        let key = FingerprintKey::from_bytes([7; 32]);
        let hint = key.mask_hint(b"hunter22");
        assert!(!serde_json::to_string(&hint).unwrap().contains("hunter22"));
        let mut out = b"hunter22".to_vec();
        FingerprintKey::from_bytes([8; 32])
            .mask_finder()
            .mask_all(&mut out, &[hint]);
        assert_eq!(out, b"hunter22");
    }
}
