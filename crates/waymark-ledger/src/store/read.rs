//! Reads: records by id, the indexes, results, events, runs and settings.

use waymark_core::{ExecutionId, Fingerprint};

use super::keys::*;
use super::Store;
use crate::chain::StoredJson;
use crate::error::{LedgerError, Result};
use crate::query::{ListQuery, Page};
use crate::records::{ChainHead, ExecutionRecord, LedgerEvent, ResultHeader, RunRecord};
use crate::StoredResult;

impl Store {
    /// The chain head record; genesis for a new ledger.
    pub(crate) fn chain_head(&self) -> Result<ChainHead> {
        match self.t.meta.get(HEAD_KEY).map_err(|e| self.storage(e))? {
            Some(v) => serde_json::from_slice(&v).map_err(|e| LedgerError::Corrupt {
                path: self.dir.clone(),
                detail: format!("the chain head record is unreadable ({e})"),
            }),
            None if !self.t.events.is_empty() => {
                Err(self.corrupt("events exist but the chain head record is missing"))
            }
            None => Ok(ChainHead::genesis()),
        }
    }

    /// The retention base: where the chain starts (genesis until retention pruned events).
    pub(crate) fn chain_base(&self) -> Result<ChainHead> {
        let base = self.get(&self.t.meta, BASE_KEY, "chain base")?;
        Ok(base.unwrap_or_else(ChainHead::genesis))
    }

    pub(crate) fn contains(&self, id: ExecutionId) -> Result<bool> {
        let key = id.to_bytes();
        self.t
            .executions
            .contains_key(key)
            .map_err(|e| self.storage(e))
    }

    pub(crate) fn get_record(&self, id: ExecutionId) -> Result<Option<ExecutionRecord>> {
        self.get(&self.t.executions, id.to_bytes(), "execution")
    }

    /// The value under `key` in `tree`, parsed as a `what`.
    fn get<T: serde::de::DeserializeOwned>(
        &self,
        tree: &sled::Tree,
        key: impl AsRef<[u8]>,
        what: &str,
    ) -> Result<Option<T>> {
        match tree.get(key).map_err(|e| self.storage(e))? {
            Some(v) => Ok(Some(self.parse(&v, what)?)),
            None => Ok(None),
        }
    }

    /// Up to `limit` executions with ids after `after` (from the start when `None`) and before
    /// `before`, oldest first: retention reads the old part of the ledger a page at a time.
    pub(crate) fn executions_before(
        &self,
        after: Option<ExecutionId>,
        before: ExecutionId,
        limit: usize,
    ) -> Result<Vec<ExecutionRecord>> {
        let after = after.map(|a| a.to_bytes());
        let (tree, before) = (&self.t.executions, before.to_bytes());
        self.page_before(
            tree,
            after.as_ref().map(|a| &a[..]),
            &before,
            limit,
            "execution",
        )
    }

    /// Up to `limit` values of `tree` with keys after `after` (from the start when `None`) and
    /// before `before`, in key order, each parsed as a `what`.
    fn page_before<T: serde::de::DeserializeOwned>(
        &self,
        tree: &sled::Tree,
        after: Option<&[u8]>,
        before: &[u8],
        limit: usize,
        what: &str,
    ) -> Result<Vec<T>> {
        let lo = after.map(|a| {
            let mut k = a.to_vec();
            k.push(0);
            k
        });
        let range = match lo {
            Some(lo) if lo.as_slice() >= before => return Ok(Vec::new()),
            Some(lo) => tree.range(lo..before.to_vec()),
            None => tree.range(..before.to_vec()),
        };
        let mut out = Vec::new();
        for item in range.take(limit) {
            let (_, v) = item.map_err(|e| self.storage(e))?;
            out.push(self.parse(&v, what)?);
        }
        Ok(out)
    }

    /// Executions with this fingerprint, newest first.
    pub(crate) fn by_fingerprint(&self, fp: &Fingerprint) -> Result<Vec<ExecutionRecord>> {
        let mut out = Vec::new();
        for item in self.t.by_fingerprint.scan_prefix(fp.0) {
            let (k, _) = item.map_err(|e| self.storage(e))?;
            let id = id_of_fp_key(&k).ok_or_else(|| self.corrupt("bad fingerprint index key"))?;
            if let Some(rec) = self.get_record(id)? {
                out.push(rec);
            }
        }
        Ok(out)
    }

    /// Executions matching `q`, one page at a time.
    pub(crate) fn list(&self, q: &ListQuery) -> Result<Page> {
        let limit = if q.limit == 0 { 100 } else { q.limit };
        let lo = q
            .since
            .map(ExecutionId::lower_bound)
            .map(|i| i.to_bytes().to_vec())
            .unwrap_or_default();
        let hi = q
            .until
            .map(ExecutionId::lower_bound)
            .map(|i| i.to_bytes().to_vec())
            .unwrap_or(vec![0xff; 17]);
        let (lo, hi) = match (q.after, q.oldest_first) {
            (Some(after), true) => {
                let mut k = after.to_bytes().to_vec();
                k.push(0);
                (lo.max(k), hi)
            }
            (Some(after), false) => (lo, hi.min(after.to_bytes().to_vec())),
            (None, _) => (lo, hi),
        };
        let mut items = Vec::new();
        let mut push = |rec: ExecutionRecord| -> bool {
            if q.matches(&rec) {
                items.push(rec);
            }
            items.len() > limit
        };
        // The narrowest index the query names: a state in flight (few), else tool, host or
        // actor, else a final state; the other filters are checked on each record.
        let attr = [
            (ATTR_TOOL, q.tool.as_deref()),
            (ATTR_HOST, q.host.as_deref()),
            (ATTR_ACTOR, q.actor.as_ref().map(|a| a.0.as_str())),
        ]
        .into_iter()
        .find_map(|(a, v)| Some((a, v?)));
        let index = match (q.state, attr) {
            (Some(state), Some(_)) if state.is_final() => None,
            (Some(state), _) => Some((&self.t.by_state, state_prefix(state))),
            (None, _) => None,
        }
        .or_else(|| attr.map(|(a, v)| (&self.t.by_attr, attr_prefix(a, v))));
        if lo < hi {
            match index {
                Some((tree, prefix)) => {
                    self.list_index(tree, prefix, lo, hi, q.oldest_first, &mut push)?
                }
                None => {
                    let iter = self.t.executions.range(lo..hi);
                    let rows: Box<dyn Iterator<Item = _>> = if q.oldest_first {
                        Box::new(iter)
                    } else {
                        Box::new(iter.rev())
                    };
                    for item in rows {
                        let (_, v) = item.map_err(|e| self.storage(e))?;
                        if push(self.parse(&v, "execution")?) {
                            break;
                        }
                    }
                }
            }
        }
        Ok(Page::of(items, limit))
    }

    /// Feeds `push` the executions an index lists under `prefix` (then an id) with ids in
    /// `lo..hi`, until it says stop.
    fn list_index(
        &self,
        tree: &sled::Tree,
        prefix: Vec<u8>,
        lo: Vec<u8>,
        hi: Vec<u8>,
        oldest_first: bool,
        push: &mut impl FnMut(ExecutionRecord) -> bool,
    ) -> Result<()> {
        let (mut a, mut b) = (prefix.clone(), prefix.clone());
        a.extend(&lo);
        b.extend(&hi);
        let iter = tree.range(a..b);
        let ids: Box<dyn Iterator<Item = _>> = if oldest_first {
            Box::new(iter)
        } else {
            Box::new(iter.rev())
        };
        for item in ids {
            let (k, _) = item.map_err(|e| self.storage(e))?;
            let id =
                id_from_key(&k[prefix.len()..]).ok_or_else(|| self.corrupt("bad index key"))?;
            if let Some(rec) = self.get_record(id)? {
                if push(rec) {
                    break;
                }
            }
        }
        Ok(())
    }

    /// The stored result of an execution.
    pub(crate) fn result(&self, id: ExecutionId) -> Result<Option<StoredResult>> {
        let t = &self.t.results;
        let header = result_key(id, RESULT_HEADER, 0);
        let Some(h) = t.get(header).map_err(|e| self.storage(e))? else {
            return Ok(None);
        };
        let header: ResultHeader = self.parse(&h, "result")?;
        let get = |part: u8| -> Result<Vec<u8>> {
            let mut out = Vec::new();
            for item in t.scan_prefix(result_prefix(id, part)) {
                out.extend_from_slice(&item.map_err(|e| self.storage(e))?.1);
            }
            Ok(out)
        };
        let mut stdout = header.stdout;
        let mut stderr = header.stderr;
        stdout.head = get(RESULT_STDOUT)?;
        stderr.head = get(RESULT_STDERR)?;
        Ok(Some(StoredResult { stdout, stderr }))
    }

    pub(crate) fn event(&self, seq: u64) -> Result<Option<LedgerEvent>> {
        self.get(&self.t.events, event_key(seq), "event")
    }

    /// Events from `from` through `through`, at most `limit`.
    pub(crate) fn events(&self, from: u64, through: u64, limit: usize) -> Result<Vec<LedgerEvent>> {
        let mut out = Vec::new();
        let range = self.t.events.range(event_key(from)..=event_key(through));
        for item in range.take(limit) {
            let (_, v) = item.map_err(|e| self.storage(e))?;
            out.push(self.parse(&v, "event")?);
        }
        Ok(out)
    }

    /// The sequence number of the oldest event stored, even one below the retention base.
    pub(crate) fn oldest_event(&self) -> Result<Option<u64>> {
        let first = self.t.events.first().map_err(|e| self.storage(e))?;
        // A malformed key reads as past every base, so a sweep never loops on it.
        Ok(first.map(|(k, _)| seq_of_event_key(&k).unwrap_or(u64::MAX)))
    }

    /// Events through `through` in key order, each with the sequence number of its key, until
    /// `f` says stop.
    pub(crate) fn each_event_through(
        &self,
        through: u64,
        mut f: impl FnMut(u64, &LedgerEvent) -> bool,
    ) -> Result<()> {
        for item in self.t.events.range(..=event_key(through)) {
            let (k, v) = item.map_err(|e| self.storage(e))?;
            let seq = seq_of_event_key(&k).unwrap_or(0);
            let ev: LedgerEvent = self.parse(&v, "event")?;
            if !f(seq, &ev) {
                break;
            }
        }
        Ok(())
    }

    /// Every event in key order for `verify`: its key's sequence number and the event, or why
    /// it cannot be read. An event the storage cannot read is reported at its position (the
    /// one after the last event read), like any other break, not as a bare storage error; the
    /// walk stops there.
    pub(crate) fn events_to_verify(
        &self,
        base: u64,
    ) -> impl Iterator<Item = (u64, std::result::Result<StoredJson, String>)> + '_ {
        let mut last_seq = base;
        let from = event_key(base.saturating_add(1));
        self.t.events.range(from..).map(move |item| match item {
            Ok((k, v)) => {
                let seq = seq_of_event_key(&k).unwrap_or(u64::MAX);
                last_seq = last_seq.max(seq);
                (seq, Ok(StoredJson(v.to_vec())))
            }
            Err(e) => (
                last_seq + 1,
                Err(format!("the storage cannot read it: {e}")),
            ),
        })
    }

    pub(crate) fn run(&self, id: &str) -> Result<Option<RunRecord>> {
        self.get(&self.t.runs, id.as_bytes(), "run")
    }

    /// Up to `limit` agent runs with ids after `after` and before `before`, oldest first.
    pub(crate) fn runs_before(
        &self,
        after: Option<&str>,
        before: &str,
        limit: usize,
    ) -> Result<Vec<RunRecord>> {
        let after = after.map(str::as_bytes);
        self.page_before(&self.t.runs, after, before.as_bytes(), limit, "run")
    }

    /// Agent runs, newest first.
    pub(crate) fn runs(&self, limit: usize) -> Result<Vec<RunRecord>> {
        let mut out = Vec::new();
        for item in self.t.runs.iter().rev().take(limit) {
            let (_, v) = item.map_err(|e| self.storage(e))?;
            out.push(self.parse(&v, "run")?);
        }
        Ok(out)
    }

    /// Whether every execution has its `by_attr` keys.
    pub(crate) fn attrs_indexed(&self) -> Result<bool> {
        let found = self.t.meta.get(ATTRS_INDEXED_KEY);
        Ok(found.map_err(|e| self.storage(e))?.is_some())
    }

    pub(crate) fn setting(&self, name: &str) -> Result<Option<serde_json::Value>> {
        self.get(&self.t.meta, setting_key(name), "setting")
    }
}
