//! Who is on the other end of a control connection, as the OS proves it.

use tokio::net::UnixStream;
use waymark_core::Actor;

/// Who is on the other end, as the OS proves it.
#[derive(Clone, Debug)]
pub struct Peer {
    pub uid: u32,
    pub pid: Option<u32>,
    pub exe: String,
    /// Process start time in clock ticks since boot (tells a reused pid apart).
    pub start_ticks: Option<u64>,
}

impl Peer {
    /// The actor of the matching rule: user and program. A retry from a new process of the
    /// same program is the same actor; the process itself is recorded in the run.
    pub fn actor(&self) -> Actor {
        Actor(format!("uid:{}:{}", self.uid, self.exe))
    }

    /// This process, for the CLI working without a daemon.
    pub fn this_process() -> Peer {
        let pid = std::process::id();
        Peer {
            uid: unsafe { libc::geteuid() },
            pid: Some(pid),
            exe: std::env::current_exe()
                .map(|p| p.display().to_string())
                .unwrap_or_else(|_| "?".into()),
            start_ticks: process_start_ticks(pid),
        }
    }

    pub fn describe(&self) -> String {
        format!(
            "pid={} start={} exe={}",
            self.pid.map_or("?".into(), |p| p.to_string()),
            self.start_ticks.map_or("?".into(), |t| t.to_string()),
            self.exe
        )
    }
}

/// Field 22 of /proc/PID/stat.
pub fn process_start_ticks(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let after = &stat[stat.rfind(')')? + 2..];
    after.split_whitespace().nth(19)?.parse().ok()
}

impl Peer {
    /// The peer of a unix socket connection: SO_PEERCRED's uid and pid, the program from
    /// `/proc/PID/exe`, the process start time. Nothing the client says.
    pub fn of_stream(stream: &UnixStream) -> Peer {
        let cred = stream.peer_cred().ok();
        let pid = cred.as_ref().and_then(|c| c.pid()).map(|p| p as u32);
        let exe = pid
            .and_then(|p| std::fs::read_link(format!("/proc/{p}/exe")).ok())
            .map(|p| p.display().to_string())
            .unwrap_or_else(|| "unknown-program".into());
        Peer {
            uid: cred.map_or(u32::MAX, |c| c.uid()),
            pid,
            exe,
            start_ticks: pid.and_then(process_start_ticks),
        }
    }
}
