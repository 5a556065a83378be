//! The audit chain: each event's hash is HMAC-SHA256(chain key, prev ‖ canonical body).

use hmac::{Hmac, Mac};
use serde_json::Value;
use sha2::Sha256;
use waymark_core::canonical_json;

use crate::records::{ChainHead, EventKind, LedgerEvent};

type HmacSha256 = Hmac<Sha256>;

/// The key of the audit chain's HMAC. Its bytes never leave it: `Debug` prints nothing of them.
pub struct ChainKey(pub(crate) [u8; 32]);

impl std::fmt::Debug for ChainKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ChainKey(<redacted>)")
    }
}

impl ChainKey {
    /// The hash an event must carry, computed over everything in it but the hash itself.
    pub fn hash(&self, event: &LedgerEvent) -> String {
        let mut body = serde_json::to_value(event).expect("events serialize");
        if let Value::Object(map) = &mut body {
            map.remove("hash");
        }
        let mut mac = HmacSha256::new_from_slice(&self.0).expect("any key size");
        mac.update(event.prev.as_bytes());
        mac.update(b"\n");
        mac.update(canonical_json(&body).as_bytes());
        hex::encode(mac.finalize().into_bytes())
    }
}

/// Why the chain failed verification at a given event.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ChainProblem {
    /// An event is missing: `expected` was not found, the next one present is `found`.
    Gap { expected: u64, found: u64 },
    /// The event's content no longer matches its hash.
    Edited,
    /// The event does not link to its predecessor, or claims another position.
    Reordered { detail: String },
    /// The chain ends at `last` but a head (stored or exported) says it reached `head`.
    Truncated { last: u64, head: u64 },
    /// The event at the exported head's position is not the one the head names.
    DivergedFromHead,
    /// The event cannot be parsed at all.
    Unreadable { detail: String },
    /// The chain starts after a retention checkpoint that no event in the chain confirms.
    UnconfirmedCheckpoint,
    /// The chain ends at `last` but the witness file saw this ledger reach `witness`: the
    /// events after `last` were lost to damage or the files were rolled back.
    BehindWitness { last: u64, witness: u64 },
    /// The event at the witness's position is not the one the witness names.
    NotItsWitness,
    /// The exported head names an event that retention pruned (before the base at `base`):
    /// nothing left in the chain can prove or refute it.
    HeadBeforeRetention { head: u64, base: u64 },
}

impl std::fmt::Display for ChainProblem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ChainProblem::Gap { expected, found } => {
                write!(
                    f,
                    "gap: event {expected} is missing (the next event present is {found})"
                )
            }
            ChainProblem::Edited => write!(f, "edited: its content does not match its hash"),
            ChainProblem::BehindWitness { last, witness } => write!(
                f,
                "the chain ends at event {last} but this ledger had reached event {witness} \
                 (its witness file says so): events {}-{witness} are missing",
                last + 1
            ),
            ChainProblem::NotItsWitness => write!(
                f,
                "this event is not the one this ledger had made durable at this position (its \
                 witness file names another): these are another ledger's or another history's files"
            ),
            ChainProblem::HeadBeforeRetention { head, base } => write!(
                f,
                "cannot be checked: the exported head is event {head}, but retention pruned the chain through event {base}; only a head at event {base} or later can be checked"
            ),
            ChainProblem::Reordered { detail } => write!(f, "reordered: {detail}"),
            ChainProblem::Truncated { last, head } => write!(
                f,
                "truncated: the chain ends at event {last} but its head was at event {head}"
            ),
            ChainProblem::DivergedFromHead => {
                write!(
                    f,
                    "edited: this event's hash is not the one the exported head names"
                )
            }
            ChainProblem::Unreadable { detail } => write!(f, "unreadable: {detail}"),
            ChainProblem::UnconfirmedCheckpoint => write!(
                f,
                "the chain starts after a retention checkpoint that no checkpoint event confirms"
            ),
        }
    }
}

/// The first bad event and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ChainBreak {
    pub seq: u64,
    pub problem: ChainProblem,
}

impl std::fmt::Display for ChainBreak {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "audit chain broken at event {}: {}",
            self.seq, self.problem
        )
    }
}

/// What `verify` found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VerifyReport {
    /// Events checked.
    pub events: u64,
    /// Where the walk started (genesis, or the latest retention checkpoint).
    pub base: ChainHead,
    /// The last good event.
    pub head: ChainHead,
    /// The first problem, if any.
    pub broken: Option<ChainBreak>,
}

impl VerifyReport {
    pub fn is_ok(&self) -> bool {
        self.broken.is_none()
    }
}

/// Events read, parsed and hashed together, spread over the machine's cores: parsing and the
/// hash are most of a walk's time, and each event's depends on that event alone.
const CHUNK: usize = 2048;

/// What a backend hands [`verify_events`] for one position: an event it has parsed, or the
/// bytes it stores (parsed, with the hash, on the walk's worker threads).
pub trait ChainInput: Send {
    fn into_event(self) -> Result<LedgerEvent, String>;
}

impl ChainInput for LedgerEvent {
    fn into_event(self) -> Result<LedgerEvent, String> {
        Ok(self)
    }
}

/// An event as stored: its JSON.
pub struct StoredJson(pub Vec<u8>);

impl ChainInput for StoredJson {
    fn into_event(self) -> Result<LedgerEvent, String> {
        serde_json::from_slice(&self.0).map_err(|e| e.to_string())
    }
}

/// One position of a walk, parsed, with the hash its event must carry.
type Checked = (u64, Result<(LedgerEvent, String), String>);

/// Parses and hashes `chunk`, in order.
fn check_all<E: ChainInput>(
    key: &ChainKey,
    mut chunk: Vec<(u64, Result<E, String>)>,
) -> Vec<Checked> {
    let one = |(seq, e): (u64, Result<E, String>)| -> Checked {
        let e = e.and_then(ChainInput::into_event).map(|e| {
            let hash = key.hash(&e);
            (e, hash)
        });
        (seq, e)
    };
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get().min(8));
    if threads == 1 || chunk.len() < 64 {
        return chunk.into_iter().map(one).collect();
    }
    let per = chunk.len().div_ceil(threads);
    let mut parts = Vec::new();
    while chunk.len() > per {
        parts.push(chunk.split_off(chunk.len() - per));
    }
    parts.push(chunk);
    parts.reverse();
    std::thread::scope(|s| {
        let parts: Vec<_> = parts
            .into_iter()
            .map(|p| s.spawn(move || p.into_iter().map(one).collect::<Vec<_>>()))
            .collect();
        parts
            .into_iter()
            .flat_map(|p| p.join().expect("hashing an event does not panic"))
            .collect()
    })
}

/// Walks `events` (in key order, each with its key) from `base`. Shared by every backend, so
/// one chain is verified by one rule wherever it is stored.
pub fn verify_events<E: ChainInput>(
    key: &ChainKey,
    base: &ChainHead,
    events: impl Iterator<Item = (u64, Result<E, String>)>,
    stored_head: &ChainHead,
    exported: Option<&ChainHead>,
) -> VerifyReport {
    let mut walk = ChainWalk::new(key, base, false, exported);
    walk.feed(events);
    walk.finish(stored_head)
}

/// A walk of the chain fed its events a page at a time (a backend that reads in pages, or
/// says how far it got), by the rule of [`verify_events`].
pub struct ChainWalk<'k> {
    key: &'k ChainKey,
    base: ChainHead,
    exported: Option<ChainHead>,
    report: VerifyReport,
    checkpoint_confirmed: bool,
    exported_seen: bool,
}

impl<'k> ChainWalk<'k> {
    /// A walk from `base`: genesis, the retention base (which the checkpoint event naming it
    /// must confirm), or, `anchored`, a head the operator kept elsewhere and gives as trusted.
    pub fn new(
        key: &'k ChainKey,
        base: &ChainHead,
        anchored: bool,
        exported: Option<&ChainHead>,
    ) -> Self {
        ChainWalk {
            key,
            base: base.clone(),
            exported: exported.cloned(),
            report: VerifyReport {
                events: 0,
                base: base.clone(),
                head: base.clone(),
                broken: None,
            },
            checkpoint_confirmed: base.seq == 0 || anchored,
            exported_seen: false,
        }
    }

    /// A walk that ends before its first event: `problem` at `seq`.
    pub fn refused(base: &ChainHead, seq: u64, problem: ChainProblem) -> VerifyReport {
        VerifyReport {
            events: 0,
            base: base.clone(),
            head: base.clone(),
            broken: Some(ChainBreak { seq, problem }),
        }
    }

    /// Events checked so far.
    pub fn events(&self) -> u64 {
        self.report.events
    }

    fn fail(&mut self, seq: u64, problem: ChainProblem) -> bool {
        self.report.broken = Some(ChainBreak { seq, problem });
        false
    }

    /// Walks `events`, the next ones in key order. Returns false once the walk found a break:
    /// feeding it more changes nothing.
    pub fn feed<E: ChainInput>(
        &mut self,
        events: impl Iterator<Item = (u64, Result<E, String>)>,
    ) -> bool {
        if self.report.broken.is_some() {
            return false;
        }
        let mut events = events.peekable();
        while events.peek().is_some() {
            let checked = check_all(self.key, events.by_ref().take(CHUNK).collect());
            for (key_seq, event) in checked {
                if !self.step(key_seq, event) {
                    return false;
                }
            }
        }
        true
    }

    /// One event of the walk; false at a break.
    fn step(&mut self, key_seq: u64, event: Result<(LedgerEvent, String), String>) -> bool {
        if key_seq <= self.base.seq {
            return true; // left over by an interrupted retention run; outside the chain
        }
        let expected = self.report.head.seq + 1;
        if key_seq != expected {
            let found = key_seq;
            return self.fail(expected, ChainProblem::Gap { expected, found });
        }
        let (event, computed) = match event {
            Ok(e) => e,
            Err(detail) => return self.fail(key_seq, ChainProblem::Unreadable { detail }),
        };
        if event.seq != key_seq {
            let detail = format!(
                "stored at position {key_seq} but says it is event {}",
                event.seq
            );
            return self.fail(key_seq, ChainProblem::Reordered { detail });
        }
        if computed != event.hash {
            return self.fail(key_seq, ChainProblem::Edited);
        }
        if event.prev != self.report.head.hash {
            let detail = format!("it does not link to event {}", self.report.head.seq);
            return self.fail(key_seq, ChainProblem::Reordered { detail });
        }
        if let EventKind::Checkpoint {
            pruned_through,
            pruned_head,
            ..
        } = &event.kind
        {
            if *pruned_through == self.base.seq && *pruned_head == self.base.hash {
                self.checkpoint_confirmed = true;
            }
        }
        if let Some(x) = &self.exported {
            if x.seq == key_seq {
                self.exported_seen = true;
                if x.hash != event.hash {
                    return self.fail(key_seq, ChainProblem::DivergedFromHead);
                }
            }
        }
        self.report.head = ChainHead {
            seq: key_seq,
            hash: event.hash,
        };
        self.report.events += 1;
        true
    }

    /// The report, once every event was fed: the walk must reach `stored_head` (and the
    /// exported head, if any).
    pub fn finish(mut self, stored_head: &ChainHead) -> VerifyReport {
        if self.report.broken.is_some() {
            return self.report;
        }
        let base = self.base.clone();
        if !self.checkpoint_confirmed {
            self.fail(base.seq + 1, ChainProblem::UnconfirmedCheckpoint);
            return self.report;
        }
        let last = self.report.head.seq;
        let exported = self.exported.clone();
        for head in [Some(stored_head), exported.as_ref()].into_iter().flatten() {
            if head.seq > last {
                let head = head.seq;
                self.fail(last + 1, ChainProblem::Truncated { last, head });
                return self.report;
            }
        }
        if let Some(x) = exported {
            if x.seq == base.seq && base.seq > 0 {
                // The head at the base is what the confirmed checkpoint (or the anchor) names.
                if x.hash != base.hash {
                    self.fail(x.seq, ChainProblem::DivergedFromHead);
                }
            } else if x.seq < base.seq {
                let problem = ChainProblem::HeadBeforeRetention {
                    head: x.seq,
                    base: base.seq,
                };
                self.fail(x.seq, problem);
            } else if !self.exported_seen && x.seq > base.seq {
                self.fail(x.seq, ChainProblem::DivergedFromHead);
            }
        }
        self.report
    }
}
