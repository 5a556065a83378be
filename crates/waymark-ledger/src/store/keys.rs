//! How sled keys encode what they index. Big-endian and fixed-width, so key order is the order
//! a scan wants.

use waymark_core::{ExecState, ExecutionId, Fingerprint};

use crate::records::ExecutionRecord;

pub(super) const HEAD_KEY: &[u8] = b"chain_head";
pub(super) const BASE_KEY: &[u8] = b"chain_base";

/// Output is stored in chunks this small so that no sled value, and no 16-item leaf of them,
/// crosses sled's blob threshold (segment size / 4): sled writes blob files without any
/// fsync, which would defeat the `Fdatasync` mode.
pub(super) const RESULT_CHUNK: usize = 4096;

/// Result parts: the header (sizes and hashes), then each stream's chunks.
pub(super) const RESULT_HEADER: u8 = 0;
pub(super) const RESULT_STDOUT: u8 = 1;
pub(super) const RESULT_STDERR: u8 = 2;

pub(super) fn fp_key(fp: &Fingerprint, id: ExecutionId) -> Vec<u8> {
    // Inverted id bytes: an ascending scan of the prefix yields the newest execution first.
    let mut k = fp.0.to_vec();
    k.extend(id.to_bytes().iter().map(|b| !b));
    k
}

/// The id in a `by_fingerprint` key.
pub(super) fn id_of_fp_key(k: &[u8]) -> Option<ExecutionId> {
    let inverted: Vec<u8> = k.get(32..)?.iter().map(|b| !b).collect();
    id_from_key(&inverted)
}

/// The state's prefix in `by_state`: every key of that state starts with it.
pub(super) fn state_prefix(state: ExecState) -> Vec<u8> {
    let mut k = state.as_str().as_bytes().to_vec();
    k.push(0);
    k
}

pub(super) fn state_key(state: ExecState, id: ExecutionId) -> Vec<u8> {
    let mut k = state_prefix(state);
    k.extend(id.to_bytes());
    k
}

pub(super) fn result_key(id: ExecutionId, part: u8, chunk: u32) -> Vec<u8> {
    let mut k = result_prefix(id, part);
    k.extend(chunk.to_be_bytes());
    k
}

pub(super) fn result_prefix(id: ExecutionId, part: u8) -> Vec<u8> {
    let mut k = id.to_bytes().to_vec();
    k.push(part);
    k
}

pub(super) fn event_key(seq: u64) -> [u8; 8] {
    seq.to_be_bytes()
}

pub(super) fn seq_of_event_key(k: &[u8]) -> Option<u64> {
    Some(u64::from_be_bytes(k.try_into().ok()?))
}

pub(super) fn id_from_key(bytes: &[u8]) -> Option<ExecutionId> {
    let arr: [u8; 16] = bytes.try_into().ok()?;
    Some(ExecutionId::from_bytes(arr))
}

/// Set once every execution's `by_attr` keys are written (a ledger made before that index
/// gets them at its first open by this version).
pub(super) const ATTRS_INDEXED_KEY: &[u8] = b"index:attrs";

/// The attributes `by_attr` indexes: what `exec list` filters by besides state and time.
pub(crate) const ATTR_TOOL: u8 = 1;
pub(crate) const ATTR_HOST: u8 = 2;
pub(crate) const ATTR_ACTOR: u8 = 3;

/// Every key of one attribute's value in `by_attr` starts with this: the attribute, the
/// value's length, the value (so no value is a prefix of another's keys).
pub(super) fn attr_prefix(attr: u8, value: &str) -> Vec<u8> {
    let mut k = vec![attr];
    k.extend((value.len() as u32).to_be_bytes());
    k.extend(value.as_bytes());
    k
}

/// The `by_attr` keys of an execution: tool, host and actor, each followed by its id.
pub(super) fn attr_keys(rec: &ExecutionRecord) -> [Vec<u8>; 3] {
    [
        (ATTR_TOOL, rec.tool.as_str()),
        (ATTR_HOST, rec.host.as_str()),
        (ATTR_ACTOR, rec.actor.0.as_str()),
    ]
    .map(|(attr, value)| {
        let mut k = attr_prefix(attr, value);
        k.extend(rec.id.to_bytes());
        k
    })
}

pub(super) fn setting_key(name: &str) -> Vec<u8> {
    format!("setting:{name}").into_bytes()
}
