//! Reads: records by id, the indexes, results, events, runs and settings.

use waymark_core::{ExecState, ExecutionId, Fingerprint};

use super::keys::*;
use super::Store;
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

    /// Every execution, oldest first, each with whether its id sorts before `before`.
    pub(crate) fn each_execution(
        &self,
        before: ExecutionId,
        mut f: impl FnMut(&ExecutionRecord, bool),
    ) -> Result<()> {
        let hi = before.to_bytes();
        for item in self.t.executions.iter() {
            let (k, v) = item.map_err(|e| self.storage(e))?;
            let rec: ExecutionRecord = self.parse(&v, "execution")?;
            f(&rec, k.as_ref() < hi.as_slice());
        }
        Ok(())
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
        if lo < hi {
            match q.state {
                // The state index keeps reconciliation scans proportional to what is in flight.
                Some(state) => self.list_state(state, lo, hi, q.oldest_first, &mut push)?,
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

    /// Feeds `push` the executions in `state` with ids in `lo..hi` until it says stop.
    fn list_state(
        &self,
        state: ExecState,
        lo: Vec<u8>,
        hi: Vec<u8>,
        oldest_first: bool,
        push: &mut impl FnMut(ExecutionRecord) -> bool,
    ) -> Result<()> {
        let prefix = state_prefix(state);
        let (mut a, mut b) = (prefix.clone(), prefix.clone());
        a.extend(&lo);
        b.extend(&hi);
        let iter = self.t.by_state.range(a..b);
        let ids: Box<dyn Iterator<Item = _>> = if oldest_first {
            Box::new(iter)
        } else {
            Box::new(iter.rev())
        };
        for item in ids {
            let (k, _) = item.map_err(|e| self.storage(e))?;
            let id = id_from_key(&k[prefix.len()..])
                .ok_or_else(|| self.corrupt("bad state index key"))?;
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
    ) -> impl Iterator<Item = (u64, std::result::Result<LedgerEvent, String>)> + '_ {
        let mut last_seq = base;
        self.t.events.iter().map(move |item| match item {
            Ok((k, v)) => {
                let seq = seq_of_event_key(&k).unwrap_or(u64::MAX);
                let ev = serde_json::from_slice::<LedgerEvent>(&v).map_err(|e| e.to_string());
                last_seq = last_seq.max(seq);
                (seq, ev)
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

    /// Agent runs, newest first.
    pub(crate) fn runs(&self, limit: usize) -> Result<Vec<RunRecord>> {
        let mut out = Vec::new();
        for item in self.t.runs.iter().rev().take(limit) {
            let (_, v) = item.map_err(|e| self.storage(e))?;
            out.push(self.parse(&v, "run")?);
        }
        Ok(out)
    }

    pub(crate) fn setting(&self, name: &str) -> Result<Option<serde_json::Value>> {
        self.get(&self.t.meta, setting_key(name), "setting")
    }
}
