//! `[actors.NAME]`: who may connect, how each is recognized (a Unix user or group on the
//! socket, a token over HTTP), and what each may do (tools, hosts, an approval floor, operator
//! rights). Parsing and the rules are here; recognizing a peer is the daemon's.

use std::collections::BTreeMap;
use std::path::PathBuf;

use regex::Regex;
use toml::Spanned;

use super::fields::{expand_home, Locator};
use super::raw::RawActor;
use super::{Approval, ConfigError, ToolDef};

/// A configured actor.
#[derive(Clone, Debug)]
pub struct ActorDef {
    /// Its name: the actor of its executions (no `:`, so it never reads as `uid:N`).
    pub name: String,
    /// Socket peers with this uid are this actor.
    pub unix_user: Option<UnixId>,
    /// Socket peers in this group (primary or supplementary, as SO_PEERCRED and SO_PEERGROUPS
    /// prove) are this actor; with `unix_user` too, both must hold.
    pub unix_group: Option<UnixId>,
    /// HTTP bearer tokens, as the SHA-256 of each (from `token_sha256`, or hashed from
    /// `token_file` when the daemon starts).
    pub tokens: Vec<TokenSource>,
    /// Tools it may call (names or globs); empty: none.
    pub tools: Vec<Pattern>,
    /// Tools it may not call, whatever `tools` says.
    pub deny_tools: Vec<Pattern>,
    /// Hosts its calls may target (raw commands included); `None`: every host.
    pub hosts: Option<Vec<Pattern>>,
    /// Its approval floor: never weakens a tool's own policy.
    pub approval: Approval,
    /// Approves, denies, reviews, cancels others' executions, locks and unlocks.
    pub operator: bool,
    /// May approve its own calls (an operator only).
    pub self_approve: bool,
}

/// A Unix user or group as configured, with its numeric id resolved when the file was read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UnixId {
    pub name: String,
    pub id: u32,
}

/// Where an actor's HTTP token is known from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TokenSource {
    /// `token_sha256`: the token's SHA-256, lower-case hex; the token itself is not stored.
    Sha256(String),
    /// `token_file`: a 0600 file holding the token, read when the daemon starts.
    File(PathBuf),
}

/// A tool or host name pattern: a name, or a glob with `*` and `?`.
#[derive(Clone, Debug)]
pub struct Pattern {
    pub text: String,
    re: Regex,
}

impl Pattern {
    pub fn new(text: &str) -> Pattern {
        let mut re = String::from("^");
        for c in text.chars() {
            match c {
                '*' => re.push_str(".*"),
                '?' => re.push('.'),
                c => re.push_str(&regex::escape(&c.to_string())),
            }
        }
        re.push('$');
        Pattern {
            text: text.to_string(),
            re: Regex::new(&re).expect("an escaped glob is a valid regex"),
        }
    }

    pub fn matches(&self, name: &str) -> bool {
        self.re.is_match(name)
    }

    fn is_glob(&self) -> bool {
        self.text.contains(['*', '?'])
    }
}

/// Why a call is outside an actor's rights: the rule, as the refusal and the audit name it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Refusal {
    pub actor: String,
    pub rule: String,
}

impl std::fmt::Display for Refusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "actor {} may not do this: {}", self.actor, self.rule)
    }
}

impl ActorDef {
    /// Whether this actor may call `tool` (deny wins over allow).
    pub fn may_call(&self, tool: &str) -> Result<(), Refusal> {
        let refuse = |rule: String| {
            Err(Refusal {
                actor: self.name.clone(),
                rule,
            })
        };
        if let Some(p) = self.deny_tools.iter().find(|p| p.matches(tool)) {
            return refuse(format!(
                "tool {tool:?} is denied by actors.{}.deny_tools ({:?})",
                self.name, p.text
            ));
        }
        if !self.tools.iter().any(|p| p.matches(tool)) {
            return refuse(format!(
                "tool {tool:?} is not in actors.{}.tools",
                self.name
            ));
        }
        Ok(())
    }

    /// Whether this actor's calls may target host `host`.
    pub fn may_target(&self, host: &str) -> Result<(), Refusal> {
        match &self.hosts {
            Some(hosts) if !hosts.iter().any(|p| p.matches(host)) => Err(Refusal {
                actor: self.name.clone(),
                rule: format!("host {host:?} is not in actors.{}.hosts", self.name),
            }),
            _ => Ok(()),
        }
    }
}

/// The SHA-256 of a token, lower-case hex: how tokens are compared and stored.
pub fn token_sha256(token: &str) -> String {
    use sha2::{Digest, Sha256};
    hex::encode(Sha256::digest(token.trim().as_bytes()))
}

/// Looks a Unix user up by name or number: its uid (and name).
pub fn lookup_user(name: &str) -> Option<UnixId> {
    lookup(name, true)
}

/// Looks a Unix group up by name or number: its gid (and name).
pub fn lookup_group(name: &str) -> Option<UnixId> {
    lookup(name, false)
}

fn lookup(name: &str, user: bool) -> Option<UnixId> {
    if let Ok(id) = name.parse::<u32>() {
        return Some(UnixId {
            name: name.to_string(),
            id,
        });
    }
    let cname = std::ffi::CString::new(name).ok()?;
    let mut buf = vec![0u8; 16 * 1024];
    // SAFETY: the out-structs and the buffer live across the call; the result pointer is
    // null or points into them.
    unsafe {
        if user {
            let mut pw: libc::passwd = std::mem::zeroed();
            let mut out: *mut libc::passwd = std::ptr::null_mut();
            let rc = libc::getpwnam_r(
                cname.as_ptr(),
                &mut pw,
                buf.as_mut_ptr().cast(),
                buf.len(),
                &mut out,
            );
            (rc == 0 && !out.is_null()).then(|| UnixId {
                name: name.to_string(),
                id: pw.pw_uid,
            })
        } else {
            let mut gr: libc::group = std::mem::zeroed();
            let mut out: *mut libc::group = std::ptr::null_mut();
            let rc = libc::getgrnam_r(
                cname.as_ptr(),
                &mut gr,
                buf.as_mut_ptr().cast(),
                buf.len(),
                &mut out,
            );
            (rc == 0 && !out.is_null()).then(|| UnixId {
                name: name.to_string(),
                id: gr.gr_gid,
            })
        }
    }
}

/// Checks and resolves `[actors]`: names, identities (users and groups must exist), patterns
/// that name a tool or host that does not exist (a typo would silently grant nothing), tokens.
pub(super) fn parse(
    loc: &Locator,
    raw: &BTreeMap<String, Spanned<RawActor>>,
    tools: &BTreeMap<String, ToolDef>,
    hosts: &[&String],
    home: &std::path::Path,
) -> Result<BTreeMap<String, ActorDef>, ConfigError> {
    let mut out: BTreeMap<String, ActorDef> = BTreeMap::new();
    for (name, a) in raw {
        let span = Some(a.span());
        if name.is_empty()
            || !name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-' || c == '.')
        {
            return Err(loc.at(
                span,
                format!("actor name {name:?}: use letters, digits, _, - and ."),
            ));
        }
        let a = a.get_ref();
        let resolve = |s: &Option<Spanned<String>>,
                       user: bool|
         -> Result<Option<UnixId>, ConfigError> {
            let Some(s) = s else { return Ok(None) };
            let found = if user {
                lookup_user(s.get_ref())
            } else {
                lookup_group(s.get_ref())
            };
            found.map(Some).ok_or_else(|| {
                let what = if user { "user" } else { "group" };
                loc.at(
                    Some(s.span()),
                    format!(
                        "actors.{name}: no Unix {what} {:?} on this machine; create it or name an existing one (or its number)",
                        s.get_ref()
                    ),
                )
            })
        };
        let unix_user = resolve(&a.unix_user, true)?;
        let unix_group = resolve(&a.unix_group, false)?;
        let mut tokens = Vec::new();
        if let Some(h) = &a.token_sha256 {
            let hex = h.get_ref().to_ascii_lowercase();
            if hex.len() != 64 || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
                return Err(loc.at(
                    Some(h.span()),
                    format!("actors.{name}.token_sha256: 64 hex digits, the SHA-256 of the token (`printf %s TOKEN | sha256sum`)"),
                ));
            }
            tokens.push(TokenSource::Sha256(hex));
        }
        if let Some(f) = &a.token_file {
            tokens.push(TokenSource::File(expand_home(f.get_ref(), home)));
        }
        if unix_user.is_none() && unix_group.is_none() && tokens.is_empty() {
            return Err(loc.at(
                span,
                format!("actors.{name}: say how it is recognized: unix_user, unix_group (socket), token_sha256 or token_file (HTTP)"),
            ));
        }
        let patterns = |list: &Vec<Spanned<String>>,
                        key: &str,
                        known: &mut dyn Iterator<Item = &String>|
         -> Result<Vec<Pattern>, ConfigError> {
            let known: Vec<&String> = known.collect();
            list.iter()
                .map(|s| {
                    let p = Pattern::new(s.get_ref());
                    if !p.is_glob() && !known.iter().any(|k| *k == s.get_ref()) {
                        return Err(loc.at(
                            Some(s.span()),
                            format!(
                                "actors.{name}.{key}: {:?} is not defined (a name or a glob with * and ?)",
                                s.get_ref()
                            ),
                        ));
                    }
                    Ok(p)
                })
                .collect()
        };
        let raw = crate::tools::RAW_TOOL.to_string();
        let tool_list = patterns(&a.tools, "tools", &mut tools.keys().chain([&raw]))?;
        let deny_tools = patterns(&a.deny_tools, "deny_tools", &mut tools.keys().chain([&raw]))?;
        let host_list = match &a.hosts {
            Some(h) => Some(patterns(h, "hosts", &mut hosts.iter().copied())?),
            None => None,
        };
        if a.self_approve && !a.operator {
            return Err(loc.at(
                span,
                format!("actors.{name}: self_approve needs operator = true"),
            ));
        }
        let def = ActorDef {
            name: name.clone(),
            unix_user,
            unix_group,
            tokens,
            tools: tool_list,
            deny_tools,
            hosts: host_list,
            approval: a.approval.unwrap_or_default(),
            operator: a.operator,
            self_approve: a.self_approve,
        };
        for other in out.values() {
            let id = |u: &Option<UnixId>| u.as_ref().map(|u| u.id);
            if def.unix_user.is_some()
                && id(&def.unix_user) == id(&other.unix_user)
                && id(&def.unix_group) == id(&other.unix_group)
            {
                return Err(loc.at(
                    span,
                    format!(
                        "actors.{name}: actor {} is recognized by the same unix_user and unix_group; a peer must be one actor",
                        other.name
                    ),
                ));
            }
            if def
                .tokens
                .iter()
                .any(|t| matches!(t, TokenSource::Sha256(_)) && other.tokens.contains(t))
            {
                return Err(loc.at(
                    span,
                    format!(
                        "actors.{name}: actor {} has the same token; each token is one actor",
                        other.name
                    ),
                ));
            }
        }
        out.insert(name.clone(), def);
    }
    Ok(out)
}

/// The groups of Unix user `uid` (its primary `gid` included), as the system's databases say.
fn groups_of(uid: u32) -> Vec<u32> {
    // SAFETY: getpwuid_r and getgrouplist write only into the buffers given with their sizes.
    unsafe {
        let mut pw: libc::passwd = std::mem::zeroed();
        let mut out: *mut libc::passwd = std::ptr::null_mut();
        let mut buf = vec![0u8; 16 * 1024];
        if libc::getpwuid_r(uid, &mut pw, buf.as_mut_ptr().cast(), buf.len(), &mut out) != 0
            || out.is_null()
        {
            return Vec::new();
        }
        let mut n: libc::c_int = 256;
        let mut groups = vec![0 as libc::gid_t; n as usize];
        if libc::getgrouplist(pw.pw_name, pw.pw_gid, groups.as_mut_ptr(), &mut n) < 0 {
            return vec![pw.pw_gid];
        }
        groups.truncate(n.max(0) as usize);
        groups
    }
}

/// Why a secret file may be read by someone it should not be: anyone but its owner (group or
/// world read), or an actor's Unix user (its owner, or through a group it is in).
pub(super) fn readable_by_others(
    path: &std::path::Path,
    actors: &BTreeMap<String, ActorDef>,
) -> Vec<String> {
    use std::os::unix::fs::MetadataExt;
    let Ok(meta) = std::fs::metadata(path) else {
        return Vec::new();
    };
    let mode = meta.mode() & 0o777;
    let mut why = Vec::new();
    if mode & 0o077 != 0 {
        why.push(format!(
            "{} is mode {mode:o}: others than its owner may read it; `chmod 600 {}` (owner: the daemon's user)",
            path.display(),
            path.display()
        ));
    }
    for a in actors.values() {
        let Some(u) = &a.unix_user else { continue };
        let by_group = mode & 0o040 != 0 && groups_of(u.id).contains(&meta.gid());
        if meta.uid() == u.id || by_group || mode & 0o004 != 0 {
            why.push(format!(
                "{} can be read by actor {}'s Unix user {}: the agent could use it around the gateway",
                path.display(),
                a.name,
                u.name
            ));
        }
    }
    why
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn globs_match_whole_names() {
        let p = Pattern::new("deploy_*");
        assert!(p.matches("deploy_web"));
        assert!(!p.matches("x_deploy_web"));
        assert!(Pattern::new("a?c").matches("abc"));
        assert!(!Pattern::new("a.c").matches("abc"), "a dot is a dot");
    }

    #[test]
    fn root_and_numbers_resolve() {
        assert_eq!(lookup_user("root").map(|u| u.id), Some(0));
        assert_eq!(lookup_group("root").map(|g| g.id), Some(0));
        assert_eq!(lookup_user("4242").map(|u| u.id), Some(4242));
        assert_eq!(lookup_user("no-such-user-waymark"), None);
    }
}
