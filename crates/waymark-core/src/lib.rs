//! Waymark's pure decisions: execution identity, intent fingerprints, lifecycle states,
//! replay contracts and the matching rule.
//!
//! This crate does no I/O. It opens no socket and no file, reads no clock and draws no random
//! number: every time and every byte of entropy it needs is handed to it. That keeps each
//! decision a function that tests can pin down in a table.
//!
//! What it does not do: persist anything (that is `waymark-ledger`), talk to hosts
//! (`waymark-ssh`) or APIs, or know any transport's request ids beyond excluding them from fingerprints.

mod action;
mod canonical;
mod channel;
mod contract;
mod errors;
mod http;
mod id;
mod mask;
mod matching;
mod state;
mod stream;
mod time;

pub use action::{
    ActionRequest, Actor, CanonicalAction, Delivery, Fingerprint, FingerprintError, FingerprintKey,
    IntentScope, SecretValue, Target, Word, WordPart,
};
pub use canonical::canonical_json;
pub use channel::{Channel, SSH_CHANNEL};
pub use contract::{ReplayContract, ReplayPolicy};
pub use errors::error_chain;
pub use http::{
    HttpActionError, HttpActionRequest, HttpCall, HttpMethod, HttpUrl, JsonTemplate, HTTP_CHANNEL,
};
pub use id::{ExecutionId, IdError, IdGenerator};
pub use mask::{MaskFinder, MaskHint};
pub use matching::{decide, AttachAction, IncomingCall, MatchDecision, PriorExecution};
pub use state::{
    AnsweredBy, ExecState, IllegalTransition, Lifecycle, Outcome, ReviewVerdict, Transition,
};
pub use stream::Stream;
pub use time::Timestamp;
