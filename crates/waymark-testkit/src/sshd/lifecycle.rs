//! Starting, stopping and restarting the listener, and cleaning up the processes of its
//! sessions.

use super::*;

impl TestSshd {
    /// The pid of the listening sshd (the one in its `PidFile`), if running.
    pub fn listener_pid(&self) -> Option<u32> {
        self.lock_listener().as_ref().map(Child::id)
    }

    /// Whether the listener is running (it may have been stopped, or have died).
    pub fn is_running(&self) -> bool {
        match self.lock_listener().as_mut() {
            Some(child) => matches!(child.try_wait(), Ok(None)),
            None => false,
        }
    }

    /// Stops the listener (SIGTERM, then SIGKILL after 5 s) and waits for it to exit. Only the
    /// listener is signalled: established sessions are served by their own sshd processes and
    /// keep running. Does nothing when already stopped.
    pub fn stop(&self) {
        if let Some(child) = self.lock_listener().take() {
            // Once the listener is gone its per-connection processes are reparented and can no
            // longer be found from it; remember them for kill_session_processes.
            let table = processes();
            lock(&self.orphaned_connections).extend(descendants(child.id(), &table));
            terminate(child);
        }
    }

    /// SIGKILLs every process serving or started by a session of this sshd, as if the remote
    /// host lost them all at once; the listener keeps running. Returns how many were killed.
    ///
    /// That is: the per-connection sshd processes (also those from before a
    /// [`restart`](TestSshd::restart)) and every process whose environment carries this
    /// sshd's marker variable (see [`SESSION_MARKER_VAR`]), which includes commands detached
    /// with `setsid` or `nohup`. A command that clears its environment (`env -i`) escapes.
    /// Linux only (it reads `/proc`); elsewhere it kills nothing.
    pub fn kill_session_processes(&self) -> usize {
        let table = processes();
        let marker = format!("{SESSION_MARKER_VAR}={}", self.dir().display());
        let mut doomed: Vec<u32> = table
            .iter()
            .filter(|p| has_env(p.pid, &marker))
            .map(|p| p.pid)
            .collect();
        if let Some(listener) = self.listener_pid() {
            doomed.extend(descendants(listener, &table).iter().map(|p| p.pid));
        }
        for orphan in lock(&self.orphaned_connections).drain(..) {
            if table
                .iter()
                .any(|p| p.pid == orphan.pid && p.start_time == orphan.start_time)
            {
                doomed.push(orphan.pid);
            }
        }
        doomed.sort_unstable();
        doomed.dedup();
        for pid in &doomed {
            sigkill(*pid);
        }
        doomed.len()
    }

    /// Starts the listener again on the same port with the same keys and config. Does nothing
    /// when already running. Panics, with the log, if sshd does not come up.
    pub fn start(&self) {
        let mut listener = self.lock_listener();
        if let Some(child) = listener.as_mut() {
            if matches!(child.try_wait(), Ok(None)) {
                return;
            }
        }
        // The port was ours a moment ago; a bind failure now is most likely a connection
        // racing us for it, so retry a few times before giving up.
        let mut last_failure = String::new();
        for _ in 0..PORT_ATTEMPTS {
            match self.spawn_listener() {
                Ok(child) => {
                    *listener = Some(child);
                    return;
                }
                Err(StartFailure::PortInUse(log)) => {
                    last_failure = log;
                    thread::sleep(Duration::from_millis(200));
                }
                Err(StartFailure::Other(log)) => {
                    drop(listener);
                    self.start_failed(&log)
                }
            }
        }
        drop(listener);
        self.start_failed(&format!(
            "port {} stayed in use by another process:\n{last_failure}",
            self.port
        ))
    }

    /// [`stop`](TestSshd::stop) then [`start`](TestSshd::start): same port, same keys, new
    /// listener pid. Sessions (and processes they started) survive it, as on a real host where
    /// `systemctl restart ssh` does not end open sessions.
    pub fn restart(&self) {
        self.stop();
        self.start();
    }

    pub(super) fn lock_listener(&self) -> MutexGuard<'_, Option<Child>> {
        lock(&self.listener)
    }

    pub(super) fn write_config(&self, options: &SshdOptions, version: (u32, u32)) {
        let root = self.dir();
        let (before, matches) = match options
            .extra_config
            .iter()
            .position(|l| l.trim_start().to_ascii_lowercase().starts_with("match"))
        {
            Some(i) => options.extra_config.split_at(i),
            None => (&options.extra_config[..], &[][..]),
        };
        let mut config = String::from("# Written by waymark-testkit.\n");
        for line in before {
            config.push_str(line);
            config.push('\n');
        }
        config.push_str(&format!(
            "Port {port}\n\
             ListenAddress 127.0.0.1\n\
             HostKey {root}/ssh_host_ed25519_key\n",
            port = self.port,
            root = root.display()
        ));
        if self.rsa_host_key_public.is_some() {
            config.push_str(&format!("HostKey {}/ssh_host_rsa_key\n", root.display()));
        }
        config.push_str(&format!(
            "PidFile {root}/sshd.pid\n\
             AuthorizedKeysFile {root}/authorized_keys\n\
             SetEnv HOME={root}/remote {marker}={root}\n\
             StrictModes no\n\
             UsePAM no\n\
             PubkeyAuthentication yes\n\
             PasswordAuthentication no\n\
             KbdInteractiveAuthentication no\n\
             HostbasedAuthentication no\n\
             PermitRootLogin {root_login}\n\
             MaxSessions {max_sessions}\n\
             MaxStartups 100:30:200\n\
             LoginGraceTime 30\n\
             ClientAliveInterval 15\n\
             ClientAliveCountMax 4\n\
             TCPKeepAlive yes\n\
             UseDNS no\n\
             PrintMotd no\n\
             PrintLastLog no\n\
             X11Forwarding no\n\
             PermitUserEnvironment no\n\
             Subsystem sftp internal-sftp\n\
             LogLevel VERBOSE\n",
            root = root.display(),
            marker = SESSION_MARKER_VAR,
            root_login = if is_root() { "prohibit-password" } else { "no" },
            max_sessions = options.max_sessions,
        ));
        if let Some(hold) = options.serialized_login {
            let script = root.join("login");
            write_file(
                &script,
                &format!(
                    "# Written by waymark-testkit: a slow login behind a host-wide lock.\n\
                     flock {root}/login.lock sleep {secs}\n\
                     if [ -n \"${{SSH_ORIGINAL_COMMAND+set}}\" ]; then\n\
                     \x20 exec \"$SHELL\" -c \"$SSH_ORIGINAL_COMMAND\"\n\
                     fi\n\
                     exec \"$SHELL\" -l\n",
                    root = root.display(),
                    secs = hold.as_secs_f64(),
                ),
            );
            config.push_str(&format!("ForceCommand /bin/sh {}\n", script.display()));
        }
        if version >= (9, 8) {
            // The fault tests make many connections die early; OpenSSH 9.8+ would answer by
            // refusing 127.0.0.1 for a while.
            config.push_str("PerSourcePenalties no\n");
        }
        for line in matches {
            config.push_str(line);
            config.push('\n');
        }
        write_file(&self.config_path(), &config);
    }

    pub(super) fn write_known_hosts(&self) {
        let mut lines = format!("[127.0.0.1]:{} {}\n", self.port, self.host_key_public);
        if let Some(rsa) = &self.rsa_host_key_public {
            lines.push_str(&format!("[127.0.0.1]:{} {rsa}\n", self.port));
        }
        write_file(&self.known_hosts_path(), &lines);
    }

    pub(super) fn spawn_listener(&self) -> Result<Child, StartFailure> {
        let log_path = self.log_path();
        let log = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log_path)
            .unwrap_or_else(|e| panic!("cannot open {}: {e}", log_path.display()));
        let log_start = log
            .metadata()
            .map(|m| m.len())
            .unwrap_or_else(|e| panic!("cannot stat {}: {e}", log_path.display()));
        let stderr = log
            .try_clone()
            .unwrap_or_else(|e| panic!("cannot dup log file handle: {e}"));
        let mut cmd = Command::new(&self.sshd);
        // sshd re-executes itself for each connection and requires an absolute path for that;
        // find_tool returns one.
        cmd.args(["-D", "-e", "-f"])
            .arg(self.config_path())
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(stderr);
        let mut child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {}: {e}", describe(&cmd)));
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            if let Ok(Some(status)) = child.try_wait() {
                let log = self.log_since(log_start);
                let report = format!("sshd exited during start-up ({status}):\n{log}");
                return Err(if log.contains("Address already in use") {
                    StartFailure::PortInUse(report)
                } else {
                    StartFailure::Other(report)
                });
            }
            // Probe only once sshd says it listens: before that, a connection could reach
            // whichever other process holds the port and hang waiting for a banner.
            if self.log_since(log_start).contains("Server listening on")
                && banner_ready(self.addr())
            {
                return Ok(child);
            }
            if Instant::now() >= deadline {
                terminate(child);
                return Err(StartFailure::Other(format!(
                    "sshd did not send an SSH-2.0 banner on {} within {START_TIMEOUT:?}:\n{}",
                    self.addr(),
                    self.log_since(log_start)
                )));
            }
            thread::sleep(Duration::from_millis(20));
        }
    }

    pub(super) fn log_since(&self, offset: u64) -> String {
        let log = self.log();
        log.get(offset as usize..).unwrap_or(&log).to_string()
    }

    pub(super) fn start_failed(&self, report: &str) -> ! {
        let hint = if report.contains("Privilege separation user") {
            "\nhint: root's sshd needs the `sshd` system user; installing openssh-server creates it"
        } else {
            ""
        };
        panic!(
            "test sshd on {} failed to start (config {}):\n{report}{hint}",
            self.addr(),
            self.config_path().display()
        )
    }
}

impl Default for TestSshd {
    fn default() -> Self {
        Self::new()
    }
}

impl Drop for TestSshd {
    fn drop(&mut self) {
        self.kill_session_processes();
        self.stop();
    }
}

/// SIGTERM, wait up to 5 s, then SIGKILL; always reaps.
fn terminate(mut child: Child) {
    // SAFETY: kill(2) on our own child's pid, which is not reaped yet and so cannot be reused.
    unsafe {
        libc::kill(child.id() as libc::pid_t, libc::SIGTERM);
    }
    if crate::tools::wait_within(&mut child, Duration::from_secs(5)).is_none() {
        let _ = child.kill();
        let _ = child.wait();
    }
}

/// A process as seen in `/proc` (Linux; nothing is seen elsewhere).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Process {
    pid: u32,
    ppid: u32,
    /// Start time in clock ticks since boot: with the pid, names one process even after the
    /// pid is reused.
    start_time: u64,
}

fn processes() -> Vec<Process> {
    let Ok(entries) = fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|entry| entry.file_name().to_str()?.parse::<u32>().ok())
        .filter_map(process)
        .collect()
}

fn process(pid: u32) -> Option<Process> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // "pid (comm) state ppid pgrp ... starttime(22nd field) ...": comm may contain spaces and
    // parentheses, so count fields from the last ')'.
    let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
    Some(Process {
        pid,
        ppid: fields.get(1)?.parse().ok()?,
        start_time: fields.get(19)?.parse().ok()?,
    })
}

/// Every process below `root` in the process tree.
fn descendants(root: u32, table: &[Process]) -> Vec<Process> {
    let mut found: Vec<Process> = Vec::new();
    let mut parents = vec![root];
    while let Some(parent) = parents.pop() {
        for p in table.iter().filter(|p| p.ppid == parent) {
            found.push(*p);
            parents.push(p.pid);
        }
    }
    found
}

/// Whether the process's initial environment contains `marker` (`NAME=value`). Processes of
/// other users are unreadable and never match.
fn has_env(pid: u32, marker: &str) -> bool {
    fs::read(format!("/proc/{pid}/environ"))
        .map(|env| env.split(|b| *b == 0).any(|var| var == marker.as_bytes()))
        .unwrap_or(false)
}

fn sigkill(pid: u32) {
    // SAFETY: kill(2) has no memory effects; callers pass pids they just read from /proc.
    unsafe {
        libc::kill(pid as libc::pid_t, libc::SIGKILL);
    }
}

/// True once something on `addr` sends an SSH-2.0 identification line.
fn banner_ready(addr: SocketAddr) -> bool {
    let Ok(mut stream) = TcpStream::connect_timeout(&addr, Duration::from_millis(500)) else {
        return false;
    };
    let _ = stream.set_read_timeout(Some(Duration::from_secs(2)));
    let mut banner = Vec::new();
    let mut byte = [0u8; 1];
    while banner.len() < 255 && !banner.ends_with(b"\n") {
        match stream.read(&mut byte) {
            Ok(1) => banner.push(byte[0]),
            _ => break,
        }
    }
    banner.starts_with(b"SSH-2.0-")
}
