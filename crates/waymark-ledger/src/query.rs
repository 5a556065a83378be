//! Reading executions: by id, by fingerprint, by filters a page at a time, and results.

use waymark_core::{Actor, ExecState, ExecutionId, Fingerprint, Timestamp};

use crate::error::Result;
use crate::records::{ExecutionRecord, StoredResult};
use crate::Ledger;

/// Filters and paging for [`Ledger::list`].
#[derive(Clone, Debug, Default)]
pub struct ListQuery {
    pub state: Option<ExecState>,
    pub actor: Option<Actor>,
    pub host: Option<String>,
    pub tool: Option<String>,
    /// Accepted at or after.
    pub since: Option<Timestamp>,
    /// Accepted before.
    pub until: Option<Timestamp>,
    /// Continue after this id (the `next` of the previous page).
    pub after: Option<ExecutionId>,
    /// Page size; 0 means 100.
    pub limit: usize,
    /// Oldest first instead of newest first.
    pub oldest_first: bool,
}

impl ListQuery {
    /// Whether `r` passes the filters other than time and paging, which bound the scan.
    pub(crate) fn matches(&self, r: &ExecutionRecord) -> bool {
        self.state.is_none_or(|s| r.lifecycle.state == s)
            && self.actor.as_ref().is_none_or(|a| &r.actor == a)
            && self.host.as_ref().is_none_or(|h| &r.host == h)
            && self.tool.as_ref().is_none_or(|t| &r.tool == t)
    }
}

/// One page of [`Ledger::list`].
#[derive(Clone, Debug)]
pub struct Page {
    pub items: Vec<ExecutionRecord>,
    /// Pass as `after` to get the next page; `None` when this was the last.
    pub next: Option<ExecutionId>,
}

impl Page {
    /// The page of `limit` items out of `items`, read one past the limit: whether that one
    /// exists says whether a next page does. Every backend pages this way.
    pub fn of(mut items: Vec<ExecutionRecord>, limit: usize) -> Page {
        let next = if items.len() > limit {
            items.truncate(limit);
            items.last().map(|r| r.id)
        } else {
            None
        };
        Page { items, next }
    }
}

impl Ledger {
    /// The execution with this id.
    pub fn get(&self, id: ExecutionId) -> Result<Option<ExecutionRecord>> {
        let store = &self.inner.store;
        store.guard("reading an execution", || store.get_record(id))
    }

    /// Executions with this fingerprint, newest first.
    pub fn by_fingerprint(&self, fp: &Fingerprint) -> Result<Vec<ExecutionRecord>> {
        let store = &self.inner.store;
        store.guard("reading the fingerprint index", || store.by_fingerprint(fp))
    }

    /// Executions matching `q`, one page at a time.
    pub fn list(&self, q: &ListQuery) -> Result<Page> {
        let store = &self.inner.store;
        store.guard("listing executions", || store.list(q))
    }

    /// Gives every execution recorded before the `by_attr` index (tool, host, actor) its keys:
    /// once, at the first open by a version that has the index, a page per transaction.
    pub(crate) fn index_attrs_once(&self) -> Result<()> {
        let store = &self.inner.store;
        if store.guard("reading the index state", || store.attrs_indexed())? {
            return Ok(());
        }
        let end = ExecutionId::from_bytes([0xff; 16]);
        let mut after = None;
        loop {
            let page = store.guard("indexing executions", || {
                store.executions_before(after, end, 1000)
            })?;
            let Some(last) = page.last() else { break };
            after = Some(last.id);
            self.write_unaudited(|_, batch| {
                page.iter().for_each(|r| batch.index_attrs(r));
                Ok(())
            })?;
        }
        self.write_unaudited(|_, batch| {
            batch.attrs_indexed();
            Ok(())
        })?;
        self.flush()
    }

    /// The stored result of an execution.
    pub fn result(&self, id: ExecutionId) -> Result<Option<StoredResult>> {
        let store = &self.inner.store;
        store.guard("reading a result", || store.result(id))
    }
}
