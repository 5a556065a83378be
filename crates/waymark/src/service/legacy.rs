//! Executions recorded under the actor's old form, `uid:N:PROGRAM` (before the actor was
//! proven at connect time) and `uid:N:mcp-http-token:NAME`.
//!
//! They keep answering `exec status` (their owner is the actor their old form stands for), and
//! a retry of one within its window still attaches: when the daemon starts, it reads the
//! executions recent enough to be retried and computes, for each in the old form, the
//! fingerprint its call has in the new form. A call whose fingerprint is one of those runs as
//! the old actor, so the ledger's matching rule finds the old execution. Nothing is rewritten:
//! the audit chain stays as it was, and the map only shrinks in use (no new execution takes
//! the old form), so it is read once.

use std::collections::HashMap;

use waymark_core::{Actor, Fingerprint, Timestamp};
use waymark_gateway::config::Config;
use waymark_ledger::{LedgerApi, ListQuery};

/// The new form of an old actor: `uid:N` (or the actor configured for exactly uid N), and
/// `http:NAME` for the single token file's; `None` for an actor in the new form.
pub fn new_form(old: &Actor, config: &Config) -> Option<Actor> {
    let rest = old.0.strip_prefix("uid:")?;
    let (uid, program) = rest.split_once(':')?;
    let uid: u32 = uid.parse().ok()?;
    if let Some(token) = program.strip_prefix("mcp-http-token:") {
        return config
            .actors
            .is_empty()
            .then(|| Actor(format!("http:{token}")));
    }
    if config.actors.is_empty() {
        return Some(Actor(format!("uid:{uid}")));
    }
    let mut by_user = config
        .actors
        .values()
        .filter(|a| a.unix_user.as_ref().is_some_and(|u| u.id == uid));
    match (by_user.next(), by_user.next()) {
        (Some(a), None) => Some(Actor(a.name.clone())),
        _ => Some(Actor(format!("uid:{uid}"))),
    }
}

/// Whether `caller` is the actor of an execution recorded as `owner`, in either form.
pub fn same_actor(owner: &Actor, caller: &Actor, config: &Config) -> bool {
    owner == caller || new_form(owner, config).as_ref() == Some(caller)
}

/// New-form fingerprint → the old actor, for the executions a retry may still attach to.
#[derive(Default)]
pub struct LegacyIntents {
    by_new_fingerprint: HashMap<Fingerprint, Actor>,
}

impl LegacyIntents {
    /// Reads the executions accepted within the longest retry or dedup window of any tool
    /// and maps those in the old form.
    pub async fn scan(
        ledger: &dyn LedgerApi,
        config: &Config,
        now: Timestamp,
    ) -> Result<LegacyIntents, String> {
        let window = config
            .tools
            .values()
            .map(|t| t.retry_window.max(t.dedup_window.unwrap_or_default()))
            .max()
            .unwrap_or_default();
        let since = now.minus(window);
        let key = ledger.fingerprint_key();
        let mut out = LegacyIntents::default();
        let mut q = ListQuery {
            since: Some(since),
            limit: 1000,
            ..Default::default()
        };
        loop {
            let page = ledger.list(&q).await.map_err(|e| e.to_string())?;
            for r in &page.items {
                let Some(new) = new_form(&r.actor, config) else {
                    continue;
                };
                if let Some(action) = r.action.with_actor(&new) {
                    out.by_new_fingerprint
                        .insert(action.fingerprint(&key), r.actor.clone());
                }
            }
            match page.next {
                Some(next) => q.after = Some(next),
                None => break,
            }
        }
        Ok(out)
    }

    pub fn is_empty(&self) -> bool {
        self.by_new_fingerprint.is_empty()
    }

    /// The old actor a call of fingerprint `fp` (computed in the new form) runs as.
    pub fn old_actor(&self, fp: &Fingerprint) -> Option<&Actor> {
        self.by_new_fingerprint.get(fp)
    }
}
