//! Who is on the other end of a connection, as the OS or the transport proves it at connect
//! time, and which actor that makes: the caller every request of the connection runs as.
//!
//! The actor is decided once, from what stays the same across a retry: on the socket the
//! peer's uid and groups (SO_PEERCRED, SO_PEERGROUPS), over HTTP the token that matched. The
//! program path and pid are read for the agent run's record only, never for the actor: the
//! peer may be gone by the time the daemon looks (its pid reused, its binary replaced).

use std::sync::Arc;

use tokio::net::UnixStream;
use waymark_core::Actor;
use waymark_gateway::config::{ActorDef, Config};

/// The socket peer's credentials, read when the daemon took the connection.
#[derive(Clone, Debug)]
pub struct Peer {
    pub uid: u32,
    pub gid: u32,
    /// Supplementary groups (SO_PEERGROUPS), as the peer's process held them at connect.
    pub groups: Vec<u32>,
    pub pid: Option<u32>,
}

impl Peer {
    /// SO_PEERCRED's uid, gid and pid, and SO_PEERGROUPS's groups: what the kernel recorded
    /// when the peer connected (they hold even if the peer is gone since). `Err` when the
    /// kernel cannot say: such a peer is refused.
    pub fn of_stream(stream: &UnixStream) -> Result<Peer, String> {
        let cred = stream
            .peer_cred()
            .map_err(|e| format!("cannot identify the peer (SO_PEERCRED: {e})"))?;
        Ok(Peer {
            uid: cred.uid(),
            gid: cred.gid(),
            groups: peer_groups(stream),
            pid: cred.pid().and_then(|p| u32::try_from(p).ok()),
        })
    }

    /// This process, for the demo that runs the gateway in process.
    pub fn this_process() -> Peer {
        // SAFETY: these calls have no preconditions and cannot fail.
        let (uid, gid) = unsafe { (libc::geteuid(), libc::getegid()) };
        Peer {
            uid,
            gid,
            groups: Vec::new(),
            pid: Some(std::process::id()),
        }
    }

    /// For the agent run's record: pid, start time and program, read now (they may be gone).
    pub fn describe(&self) -> String {
        let exe = self
            .pid
            .and_then(|p| std::fs::read_link(format!("/proc/{p}/exe")).ok())
            .map_or_else(|| "?".into(), |p| p.display().to_string());
        format!(
            "uid={} gid={} pid={} start={} exe={exe}",
            self.uid,
            self.gid,
            self.pid.map_or("?".into(), |p| p.to_string()),
            self.pid
                .and_then(process_start_ticks)
                .map_or("?".into(), |t| t.to_string()),
        )
    }

    fn in_group(&self, gid: u32) -> bool {
        self.gid == gid || self.groups.contains(&gid)
    }
}

/// Field 22 of /proc/PID/stat.
pub fn process_start_ticks(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let after = &stat[stat.rfind(')')? + 2..];
    after.split_whitespace().nth(19)?.parse().ok()
}

/// `SO_PEERGROUPS` (Linux 4.13+), which the libc crate does not export for every target: 59
/// in the generic socket numbering (x86, ARM, RISC-V), other numbers on alpha, MIPS, PA-RISC and
/// SPARC, where the peer's supplementary groups are not read (only its primary gid counts).
const SO_PEERGROUPS: Option<libc::c_int> = if cfg!(all(
    target_os = "linux",
    any(
        target_arch = "x86_64",
        target_arch = "x86",
        target_arch = "aarch64",
        target_arch = "arm",
        target_arch = "riscv64"
    )
)) {
    Some(59)
} else {
    None
};

/// The peer's supplementary groups as the kernel recorded them at connect; empty when the
/// kernel does not say (then only the primary gid counts).
fn peer_groups(stream: &UnixStream) -> Vec<u32> {
    let Some(option) = SO_PEERGROUPS else {
        return Vec::new();
    };
    use std::os::fd::AsRawFd;
    let fd = stream.as_raw_fd();
    let mut groups = vec![0 as libc::gid_t; 256];
    let mut len = (groups.len() * std::mem::size_of::<libc::gid_t>()) as libc::socklen_t;
    // SAFETY: the buffer and its length describe valid memory for the kernel to fill.
    let rc = unsafe {
        libc::getsockopt(
            fd,
            libc::SOL_SOCKET,
            option,
            groups.as_mut_ptr().cast(),
            &mut len,
        )
    };
    if rc != 0 {
        return Vec::new();
    }
    groups.truncate(len as usize / std::mem::size_of::<libc::gid_t>());
    groups
}

/// Who a connection's requests run as, decided when it was taken.
#[derive(Clone, Debug)]
pub struct Caller {
    /// The actor of its executions, its fingerprints and the matching rule.
    pub actor: Actor,
    /// Its configured rights; `None`: every right (single-user mode, or the daemon's own
    /// user, who holds the ledger and the credentials anyway).
    pub rights: Option<Arc<ActorDef>>,
    /// The listener that received it (`socket`, `mcp-http`), set by the daemon, never by what
    /// the client says.
    pub transport: &'static str,
    /// For the agent run's record (pid, program); never part of the actor.
    pub detail: String,
}

impl Caller {
    /// Whether it may approve, deny, review, cancel others' executions, lock and unlock.
    pub fn operator(&self) -> bool {
        self.rights.as_ref().is_none_or(|r| r.operator)
    }

    /// Whether it may approve its own calls.
    pub fn self_approve(&self) -> bool {
        self.rights.as_ref().is_none_or(|r| r.self_approve)
    }

    /// The caller a socket peer is: the configured actor its uid and groups match (a match by
    /// `unix_user` before one by group alone); with no `[actors]`, or for the daemon's own
    /// uid when no actor names it, `uid:N` with every right. A peer no actor matches is
    /// refused, with what to configure.
    pub fn of_peer(peer: &Peer, config: &Config) -> Result<Caller, String> {
        let detail = format!("socket {}", peer.describe());
        let plain = |detail| Caller {
            actor: Actor(format!("uid:{}", peer.uid)),
            rights: None,
            transport: "socket",
            detail,
        };
        if config.actors.is_empty() {
            return Ok(plain(detail));
        }
        let matches = |a: &&ActorDef| {
            (a.unix_user.is_some() || a.unix_group.is_some())
                && a.unix_user.as_ref().is_none_or(|u| u.id == peer.uid)
                && a.unix_group.as_ref().is_none_or(|g| peer.in_group(g.id))
        };
        let found: Vec<&ActorDef> = config.actors.values().filter(matches).collect();
        let by_user: Vec<&ActorDef> = found
            .iter()
            .copied()
            .filter(|a| a.unix_user.is_some())
            .collect();
        let chosen = match (by_user.as_slice(), found.as_slice()) {
            ([one], _) => Some(*one),
            ([], [one]) => Some(*one),
            ([], []) => None,
            (_, _) => {
                let names: Vec<&str> = found.iter().map(|a| a.name.as_str()).collect();
                return Err(format!(
                    "uid {} matches several actors ({}); give it one actor with unix_user",
                    peer.uid,
                    names.join(", ")
                ));
            }
        };
        match chosen {
            Some(a) => Ok(Caller {
                actor: Actor(a.name.clone()),
                rights: Some(Arc::new(a.clone())),
                transport: "socket",
                detail,
            }),
            // SAFETY: geteuid has no preconditions and cannot fail.
            None if peer.uid == unsafe { libc::geteuid() } => Ok(plain(detail)),
            None => Err(format!(
                "uid {} (gid {}) is no configured actor; add an [actors.NAME] with unix_user = \"{}\" or a unix_group it is in",
                peer.uid, peer.gid, peer.uid
            )),
        }
    }

    /// The caller an HTTP request is, by the actor its token matched (`None`: the single
    /// `http_token_file` of single-user mode, named by `token_name`).
    pub fn of_token(actor: Option<&ActorDef>, token_name: &str) -> Caller {
        match actor {
            Some(a) => Caller {
                actor: Actor(a.name.clone()),
                rights: Some(Arc::new(a.clone())),
                transport: "mcp-http",
                detail: "mcp-http bearer token".into(),
            },
            None => Caller {
                actor: Actor(format!("http:{token_name}")),
                rights: None,
                transport: "mcp-http",
                detail: format!("mcp-http bearer token {token_name}"),
            },
        }
    }
}
