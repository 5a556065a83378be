//! Execution identity: `act_` followed by a 26-character ULID.
//!
//! ```
//! use waymark_core::{ExecutionId, IdGenerator, Timestamp};
//! let mut ids = IdGenerator::default();
//! let a = ids.next(Timestamp::from_millis(1_700_000_000_000), 7);
//! let b = ids.next(Timestamp::from_millis(1_700_000_000_000), 3);
//! assert!(a < b, "ids minted in the same millisecond still sort in mint order");
//! assert_eq!(a.to_string().len(), 30);
//! assert_eq!(a, a.to_string().parse::<ExecutionId>().unwrap());
//! ```

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::Timestamp;

const PREFIX: &str = "act_";
const ULID_LEN: usize = 26;
const CROCKFORD: &[u8; 32] = b"0123456789ABCDEFGHJKMNPQRSTVWXYZ";
const RANDOM_MASK: u128 = (1u128 << 80) - 1;

/// The durable identity of one accepted execution.
///
/// Minted by Waymark when an action is accepted, unique per accepted attempt, and sortable by
/// the time it was minted (a ULID: 48 bits of milliseconds, 80 bits of randomness). It is
/// the name of its marker on the host and travels back to the agent.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ExecutionId(u128);

/// Why a string is not an execution ID.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IdError {
    #[error(
        "execution id {0:?} must start with `act_` (ids look like act_01J9Z3K8Q4M7W2X5Y6Z8A9B0CD)"
    )]
    MissingPrefix(String),
    #[error("execution id {input:?} must have 26 characters after `act_`, it has {len}")]
    Length { input: String, len: usize },
    #[error("execution id {input:?} has {ch:?} at position {pos}; only Crockford base32 (0-9, A-Z without I, L, O, U) is allowed")]
    Character { input: String, ch: char, pos: usize },
    #[error("execution id {0:?} is out of range (its first character after `act_` must be 0-7)")]
    Overflow(String),
}

impl ExecutionId {
    /// Builds an id from its parts: milliseconds since the Unix epoch (48 bits kept) and 80
    /// bits of randomness (higher bits ignored).
    pub fn from_parts(at: Timestamp, random: u128) -> Self {
        let ms = (at.as_millis() as u128) & ((1u128 << 48) - 1);
        ExecutionId((ms << 80) | (random & RANDOM_MASK))
    }

    /// The time this id was minted, in milliseconds since the Unix epoch.
    pub fn minted_at(&self) -> Timestamp {
        Timestamp::from_millis((self.0 >> 80) as u64)
    }

    /// The smallest id minted at `at`: a lower bound for time-range scans.
    pub fn lower_bound(at: Timestamp) -> Self {
        Self::from_parts(at, 0)
    }

    /// The 16 big-endian bytes; their byte order is the id's time order.
    pub fn to_bytes(&self) -> [u8; 16] {
        self.0.to_be_bytes()
    }

    /// The inverse of [`ExecutionId::to_bytes`].
    pub fn from_bytes(bytes: [u8; 16]) -> Self {
        ExecutionId(u128::from_be_bytes(bytes))
    }

    /// Parses `act_<ULID>`. Lower-case letters are accepted and normalized.
    pub fn parse(input: &str) -> Result<Self, IdError> {
        let body = input
            .strip_prefix(PREFIX)
            .ok_or_else(|| IdError::MissingPrefix(input.to_string()))?;
        let len = body.chars().count();
        if len != ULID_LEN {
            return Err(IdError::Length {
                input: input.to_string(),
                len,
            });
        }
        let mut value: u128 = 0;
        for (pos, ch) in body.chars().enumerate() {
            let digit = decode_char(ch).ok_or_else(|| IdError::Character {
                input: input.to_string(),
                ch,
                pos: pos + PREFIX.len(),
            })?;
            if pos == 0 && digit > 7 {
                return Err(IdError::Overflow(input.to_string()));
            }
            value = (value << 5) | digit as u128;
        }
        Ok(ExecutionId(value))
    }
}

fn decode_char(ch: char) -> Option<u8> {
    let up = ch.to_ascii_uppercase() as u8;
    if !ch.is_ascii() {
        return None;
    }
    CROCKFORD.iter().position(|&c| c == up).map(|p| p as u8)
}

impl fmt::Display for ExecutionId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut out = [0u8; ULID_LEN];
        for (i, slot) in out.iter_mut().enumerate() {
            let shift = 5 * (ULID_LEN - 1 - i);
            *slot = CROCKFORD[((self.0 >> shift) & 31) as usize];
        }
        f.write_str(PREFIX)?;
        f.write_str(std::str::from_utf8(&out).expect("alphabet is ASCII"))
    }
}

impl fmt::Debug for ExecutionId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

impl FromStr for ExecutionId {
    type Err = IdError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::parse(s)
    }
}

impl Serialize for ExecutionId {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for ExecutionId {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        ExecutionId::parse(&s).map_err(serde::de::Error::custom)
    }
}

/// Mints execution ids that are strictly increasing even within one millisecond or when the
/// clock steps back, as the ULID monotonic rule prescribes.
///
/// It owns no clock and no randomness: the caller passes both, which keeps this crate pure.
#[derive(Debug, Default, Clone)]
pub struct IdGenerator {
    last: Option<ExecutionId>,
}

impl IdGenerator {
    /// The next id at time `now`, with `random` as its entropy (80 bits used).
    pub fn next(&mut self, now: Timestamp, random: u128) -> ExecutionId {
        let fresh = ExecutionId::from_parts(now, random);
        let id = match self.last {
            Some(last) if fresh <= last => ExecutionId(last.0 + 1),
            _ => fresh,
        };
        self.last = Some(id);
        id
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn display_and_parse_round_trip() {
        let id = ExecutionId::from_parts(Timestamp::from_millis(1_733_000_000_123), 0xDEAD_BEEF);
        let text = id.to_string();
        assert!(text.starts_with("act_"));
        assert_eq!(text.len(), 30);
        assert_eq!(ExecutionId::parse(&text).unwrap(), id);
        assert_eq!(ExecutionId::parse(&text.to_lowercase()).unwrap(), id);
        assert_eq!(id.minted_at(), Timestamp::from_millis(1_733_000_000_123));
    }

    #[test]
    fn malformed_ids_are_rejected_with_the_reason() {
        let err = ExecutionId::parse("01J9Z3K8Q4M7W2X5Y6Z8A9B0CD").unwrap_err();
        assert!(err.to_string().contains("must start with `act_`"), "{err}");
        let err = ExecutionId::parse("act_123").unwrap_err();
        assert!(err.to_string().contains("26 characters"), "{err}");
        let err = ExecutionId::parse("act_01J9Z3K8Q4M7W2X5Y6Z8A9B0CU").unwrap_err();
        assert!(
            matches!(
                err,
                IdError::Character {
                    ch: 'U',
                    pos: 29,
                    ..
                }
            ),
            "{err}"
        );
        let err = ExecutionId::parse("act_81J9Z3K8Q4M7W2X5Y6Z8A9B0CD").unwrap_err();
        assert!(matches!(err, IdError::Overflow(_)), "{err}");
        assert!(ExecutionId::parse("act_01J9Z3K8Q4M7W2X5Y6Z8A9B0Cé").is_err());
    }

    #[test]
    fn ids_sort_by_time_then_mint_order() {
        let mut g = IdGenerator::default();
        let a = g.next(Timestamp::from_millis(10), u128::MAX);
        let b = g.next(Timestamp::from_millis(10), 0);
        let c = g.next(Timestamp::from_millis(9), 0); // clock stepped back
        let d = g.next(Timestamp::from_millis(11), 0);
        assert!(a < b && b < c && c < d);
        assert!(a.to_string() < b.to_string() && c.to_string() < d.to_string());
        assert_eq!(
            a.to_bytes().to_vec().cmp(&b.to_bytes().to_vec()),
            std::cmp::Ordering::Less
        );
    }
}
