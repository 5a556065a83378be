//! A real OpenSSH `sshd` on a loopback port, with its keys, config and log in a temp dir.
//! See [`TestSshd`].

use std::fs::{self, File, OpenOptions};
use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Mutex, MutexGuard};
use std::thread;
use std::time::{Duration, Instant};

use tempfile::TempDir;

use crate::tools::{describe, free_port, require_tool};

const SSHD_MISSING: &str = "OpenSSH sshd not found: install it (apt-get install openssh-server) \
                            or run the README test command (./scripts/test)";
const OPENSSH_CLIENT_HINT: &str = "install it (apt-get install openssh-client)";
/// How long sshd gets to print its banner after being spawned.
const START_TIMEOUT: Duration = Duration::from_secs(10);
/// How many fresh ports the first start tries before giving up.
const PORT_ATTEMPTS: usize = 10;
/// Set, to the sshd's temp dir, in the environment of every session (by `SetEnv`) so that
/// [`TestSshd::kill_session_processes`] can find what sessions started, even detached.
pub const SESSION_MARKER_VAR: &str = "WAYMARK_TESTKIT_SSHD";
/// Root's sshd refuses to start without its privilege separation directory.
const PRIVSEP_DIR: &str = "/run/sshd";

/// Settings for [`TestSshd::with_options`]. `Default` gives what [`TestSshd::new`] uses.
#[derive(Debug, Clone)]
pub struct SshdOptions {
    max_sessions: u32,
    rsa_host_key: bool,
    extra_config: Vec<String>,
}

impl Default for SshdOptions {
    fn default() -> Self {
        SshdOptions {
            max_sessions: 10,
            rsa_host_key: false,
            extra_config: Vec::new(),
        }
    }
}

impl SshdOptions {
    /// `MaxSessions`: how many sessions (channels running a command or shell) one SSH
    /// connection may have open at once. Default 10, as OpenSSH's own default.
    pub fn max_sessions(mut self, max_sessions: u32) -> Self {
        self.max_sessions = max_sessions;
        self
    }

    /// Also generate an RSA (3072-bit) host key, offered beside the ed25519 one and listed in
    /// the known_hosts file. Off by default because generating it takes a noticeable moment.
    pub fn rsa_host_key(mut self, enabled: bool) -> Self {
        self.rsa_host_key = enabled;
        self
    }

    /// Adds one line of `sshd_config`.
    ///
    /// Lines go *before* the kit's own settings: sshd keeps the first value it reads for most
    /// keywords, so an extra line overrides the kit's default for the same keyword (e.g.
    /// `"ClientAliveInterval 1"`). From the first line starting with `Match` on, lines go at the
    /// end of the file instead, where sshd requires `Match` blocks to be.
    pub fn extra_config(mut self, line: impl Into<String>) -> Self {
        self.extra_config.push(line.into());
        self
    }
}

/// A user key pair generated with `ssh-keygen` (ed25519).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UserKey {
    path: PathBuf,
    public_openssh: String,
}

impl UserKey {
    /// The private key file (OpenSSH format, mode 0600). The public key is beside it with
    /// `.pub` appended.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The public key as one authorized_keys line without comment: `ssh-ed25519 AAAA...`.
    pub fn public_openssh(&self) -> &str {
        &self.public_openssh
    }
}

/// Generates an ed25519 key pair at `dir/name` (and `dir/name.pub`), encrypted with
/// `passphrase` when given. The key is not authorized anywhere: see
/// [`TestSshd::authorize_key`] and [`TestSshd::add_encrypted_user_key`].
pub fn generate_user_key(dir: &Path, name: &str, passphrase: Option<&str>) -> UserKey {
    let path = dir.join(name);
    ssh_keygen(&[
        "-q",
        "-t",
        "ed25519",
        "-N",
        passphrase.unwrap_or(""),
        "-C",
        "waymark-testkit-user",
        "-f",
        path_str(&path),
    ]);
    let public_openssh = read_public_key(&pub_path(&path));
    UserKey {
        path,
        public_openssh,
    }
}

/// A running OpenSSH `sshd` listening on `127.0.0.1:<port>`, owned by the test.
///
/// ```no_run
/// use waymark_testkit::{output_within, TestSshd};
/// use std::time::Duration;
///
/// let sshd = TestSshd::new();
/// let out = output_within(sshd.ssh_command().arg("echo hi"), Duration::from_secs(10));
/// assert_eq!(String::from_utf8_lossy(&out.stdout), "hi\n");
/// ```
///
/// The login user is the user running the test (root or not). The remote side sees
/// `HOME=<tmp>/remote` (set with `SetEnv HOME=...` in the config), so `~` and `$HOME` in remote
/// commands resolve into the temp dir. The session still *starts* in the user's real home
/// directory from the passwd entry: sshd `chdir`s there before running the command, and reads
/// `~/.ssh/rc` from there too (and starts in `/` if that directory does not exist). Remote
/// commands that must stay inside the temp dir should use `~`, `$HOME` or
/// [`TestSshd::remote_dir`], never a relative path.
///
/// Sessions also see [`SESSION_MARKER_VAR`]`=<tmp>`, by which the kit finds and kills what they
/// started when the `TestSshd` is dropped.
///
/// Everything lives in one temp dir: host keys, a user key pair, `authorized_keys`,
/// `known_hosts`, `sshd_config`, the pid file, the log and the remote HOME. Dropping it runs
/// [`kill_session_processes`](TestSshd::kill_session_processes), stops the listener, then
/// removes the temp dir, so no test leaves remote commands running behind it.
///
/// All methods take `&self`, so a `TestSshd` can be shared (`Arc`) with a thread that restarts
/// it while another uses it.
#[derive(Debug)]
pub struct TestSshd {
    dir: TempDir,
    sshd: PathBuf,
    port: u16,
    user: String,
    host_key_public: String,
    host_key_fingerprint: String,
    rsa_host_key_public: Option<String>,
    user_key: UserKey,
    listener: Mutex<Option<Child>>,
    /// Per-connection sshd processes of listeners stopped earlier.
    orphaned_connections: Mutex<Vec<Process>>,
}

enum StartFailure {
    PortInUse(String),
    Other(String),
}

impl TestSshd {
    /// Starts an sshd with default [`SshdOptions`]. Panics, with the sshd log, if it does not
    /// come up; panics with an install hint if OpenSSH is missing.
    pub fn new() -> Self {
        Self::with_options(SshdOptions::default())
    }

    /// Starts an sshd with the given options.
    pub fn with_options(options: SshdOptions) -> Self {
        let sshd = crate::tools::find_tool("sshd").unwrap_or_else(|| panic!("{SSHD_MISSING}"));
        require_tool("ssh-keygen", OPENSSH_CLIENT_HINT);
        if is_root() {
            ensure_privsep_dir();
        }
        let dir = tempfile::Builder::new()
            .prefix("waymark-sshd-")
            .tempdir()
            .unwrap_or_else(|e| panic!("cannot create a temp dir for sshd: {e}"));
        let root = dir.path();
        if root.to_string_lossy().contains(char::is_whitespace) {
            panic!(
                "temp dir {} contains whitespace, which sshd_config and the ssh command line \
                 cannot carry safely: set TMPDIR to a path without spaces",
                root.display()
            );
        }
        fs::create_dir(root.join("remote"))
            .unwrap_or_else(|e| panic!("cannot create {}/remote: {e}", root.display()));

        let host_key = root.join("ssh_host_ed25519_key");
        ssh_keygen(&[
            "-q",
            "-t",
            "ed25519",
            "-N",
            "",
            "-C",
            "waymark-testkit-host",
            "-f",
            path_str(&host_key),
        ]);
        let host_key_public = read_public_key(&pub_path(&host_key));
        let host_key_fingerprint = fingerprint_sha256(&pub_path(&host_key));
        let rsa_host_key_public = options.rsa_host_key.then(|| {
            let rsa = root.join("ssh_host_rsa_key");
            ssh_keygen(&[
                "-q",
                "-t",
                "rsa",
                "-b",
                "3072",
                "-N",
                "",
                "-C",
                "waymark-testkit-host",
                "-f",
                path_str(&rsa),
            ]);
            read_public_key(&pub_path(&rsa))
        });
        let user_key = generate_user_key(root, "id_ed25519", None);
        write_file(
            &root.join("authorized_keys"),
            &format!("{}\n", user_key.public_openssh),
        );

        let mut sshd = TestSshd {
            sshd,
            port: 0,
            user: current_user(),
            host_key_public,
            host_key_fingerprint,
            rsa_host_key_public,
            user_key,
            listener: Mutex::new(None),
            orphaned_connections: Mutex::new(Vec::new()),
            dir,
        };
        let version = sshd_version(&sshd.sshd);
        let mut last_failure = String::new();
        for _ in 0..PORT_ATTEMPTS {
            sshd.port = free_port();
            sshd.write_config(&options, version);
            match sshd.spawn_listener() {
                Ok(child) => {
                    *sshd.lock_listener() = Some(child);
                    sshd.write_known_hosts();
                    return sshd;
                }
                Err(StartFailure::PortInUse(log)) => last_failure = log,
                Err(StartFailure::Other(log)) => sshd.start_failed(&log),
            }
        }
        sshd.start_failed(&format!(
            "every one of {PORT_ATTEMPTS} free ports was taken before sshd could bind it; last \
             attempt:\n{last_failure}"
        ))
    }

    /// The port sshd listens on (kept across [`restart`](TestSshd::restart)).
    pub fn port(&self) -> u16 {
        self.port
    }

    /// `127.0.0.1:<port>`.
    pub fn addr(&self) -> SocketAddr {
        SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::LOCALHOST, self.port))
    }

    /// The login user: the user running the test (`getpwuid(geteuid())`).
    pub fn user(&self) -> &str {
        &self.user
    }

    /// The temp dir holding everything of this sshd.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// The generated `sshd_config`.
    pub fn config_path(&self) -> PathBuf {
        self.dir().join("sshd_config")
    }

    /// The sshd log (`LogLevel VERBOSE`; sshd runs with `-e` and its stderr goes here). Kept
    /// across restarts.
    pub fn log_path(&self) -> PathBuf {
        self.dir().join("sshd.log")
    }

    /// The sshd log so far, for test diagnostics.
    pub fn log(&self) -> String {
        fs::read_to_string(self.log_path()).unwrap_or_default()
    }

    /// The remote side's `HOME`: `<tmp>/remote` (exists, empty at start).
    pub fn remote_home(&self) -> PathBuf {
        self.dir().join("remote")
    }

    /// The directory tests pass as the wrapper's remote dir: `<tmp>/remote/.waymark`, which is
    /// `~/.waymark` on the remote side. It is *not* created, so a test can watch the wrapper
    /// create it.
    pub fn remote_dir(&self) -> PathBuf {
        self.remote_home().join(".waymark")
    }

    /// The ed25519 host public key as `ssh-ed25519 AAAA...` (no comment).
    pub fn host_key_public_openssh(&self) -> &str {
        &self.host_key_public
    }

    /// The ed25519 host key's fingerprint as `ssh-keygen -lf` prints it: `SHA256:...`.
    pub fn host_key_fingerprint_sha256(&self) -> &str {
        &self.host_key_fingerprint
    }

    /// The RSA host public key (`ssh-rsa AAAA...`), when [`SshdOptions::rsa_host_key`] was set.
    pub fn rsa_host_key_public_openssh(&self) -> Option<&str> {
        self.rsa_host_key_public.as_deref()
    }

    /// The authorized, unencrypted ed25519 user key.
    pub fn user_key(&self) -> &UserKey {
        &self.user_key
    }

    /// The private key file of [`user_key`](TestSshd::user_key).
    pub fn user_key_path(&self) -> &Path {
        self.user_key.path()
    }

    /// The public half of [`user_key`](TestSshd::user_key): `ssh-ed25519 AAAA...`.
    pub fn user_key_public(&self) -> &str {
        self.user_key.public_openssh()
    }

    /// Generates a new ed25519 user key encrypted with `passphrase` and authorizes it. Each
    /// call makes a new key (`id_ed25519_encrypted_<n>`).
    pub fn add_encrypted_user_key(&self, passphrase: &str) -> UserKey {
        let n = (0..)
            .find(|n| {
                !self
                    .dir()
                    .join(format!("id_ed25519_encrypted_{n}"))
                    .exists()
            })
            .expect("some key name is free");
        let key = generate_user_key(
            self.dir(),
            &format!("id_ed25519_encrypted_{n}"),
            Some(passphrase),
        );
        self.authorize_key(key.public_openssh());
        key
    }

    /// Appends a public key line to `authorized_keys`. sshd reads the file at each login, so
    /// this takes effect at once.
    pub fn authorize_key(&self, public_openssh: &str) {
        let path = self.dir().join("authorized_keys");
        let mut file = OpenOptions::new()
            .append(true)
            .open(&path)
            .unwrap_or_else(|e| panic!("cannot open {}: {e}", path.display()));
        writeln!(file, "{}", public_openssh.trim())
            .unwrap_or_else(|e| panic!("cannot write {}: {e}", path.display()));
    }

    /// A known_hosts file with `[127.0.0.1]:<port> ssh-ed25519 ...` (and the RSA key when
    /// enabled), in plain (unhashed) form.
    pub fn known_hosts_path(&self) -> PathBuf {
        self.dir().join("known_hosts")
    }

    /// Writes the same entries as [`known_hosts_path`](TestSshd::known_hosts_path) hashed by
    /// `ssh-keygen -H` (`|1|salt|hash ssh-ed25519 ...`) to `known_hosts.hashed` and returns its
    /// path. Rewrites the file on each call.
    pub fn write_hashed_known_hosts(&self) -> PathBuf {
        let hashed = self.dir().join("known_hosts.hashed");
        fs::copy(self.known_hosts_path(), &hashed)
            .unwrap_or_else(|e| panic!("cannot copy known_hosts: {e}"));
        ssh_keygen(&["-H", "-f", path_str(&hashed)]);
        let _ = fs::remove_file(self.dir().join("known_hosts.hashed.old"));
        hashed
    }

    /// An OpenSSH `ssh` command to this sshd, hermetic and non-interactive:
    /// `ssh -F /dev/null -i KEY -p PORT -l USER -o IdentitiesOnly=yes -o IdentityAgent=none
    /// -o UserKnownHostsFile=KNOWN_HOSTS -o GlobalKnownHostsFile=/dev/null
    /// -o StrictHostKeyChecking=yes -o UpdateHostKeys=no -o BatchMode=yes -o ConnectTimeout=5
    /// 127.0.0.1`.
    ///
    /// The destination is already the last argument; add more `-o` options (ssh accepts
    /// options after the destination) and then the remote command. ssh keeps the *first* value
    /// it is given for an option, so to override one of the above, put yours before them:
    /// `Command::new("ssh").args(["-o", "BatchMode=no"]).args(sshd.ssh_command().get_args())`.
    pub fn ssh_command(&self) -> Command {
        self.ssh_command_via(self.addr())
    }

    /// Like [`ssh_command`](TestSshd::ssh_command) but connects to `addr` (e.g. a
    /// [`FaultProxy`](crate::FaultProxy) in front of this sshd) while still checking the host
    /// key against this sshd's known_hosts entry (`-o HostKeyAlias=[127.0.0.1]:<port>`).
    pub fn ssh_command_via(&self, addr: SocketAddr) -> Command {
        let ssh = require_tool("ssh", OPENSSH_CLIENT_HINT);
        let mut cmd = Command::new(ssh);
        cmd.args(["-F", "/dev/null", "-i"])
            .arg(self.user_key_path())
            .args(["-p", &addr.port().to_string(), "-l", &self.user])
            .args(["-o", "IdentitiesOnly=yes", "-o", "IdentityAgent=none"])
            .arg("-o")
            .arg(format!(
                "UserKnownHostsFile={}",
                self.known_hosts_path().display()
            ))
            .args([
                "-o",
                "GlobalKnownHostsFile=/dev/null",
                "-o",
                "StrictHostKeyChecking=yes",
                "-o",
                "UpdateHostKeys=no",
                "-o",
                "BatchMode=yes",
                "-o",
                "ConnectTimeout=5",
            ]);
        if addr != self.addr() {
            cmd.arg("-o")
                .arg(format!("HostKeyAlias=[127.0.0.1]:{}", self.port));
        }
        cmd.arg(addr.ip().to_string());
        cmd
    }

    /// The configuration sshd would run with, as `sshd -T` prints it (lower-case keywords,
    /// one per line), evaluated for this user connecting from 127.0.0.1.
    pub fn effective_config(&self) -> String {
        let mut cmd = Command::new(&self.sshd);
        cmd.arg("-T")
            .arg("-f")
            .arg(self.config_path())
            .arg("-C")
            .arg(format!("user={},host=localhost,addr=127.0.0.1", self.user));
        let out = cmd
            .output()
            .unwrap_or_else(|e| panic!("cannot run {}: {e}", describe(&cmd)));
        if !out.status.success() {
            panic!(
                "{} failed ({}): {}",
                describe(&cmd),
                out.status,
                String::from_utf8_lossy(&out.stderr)
            );
        }
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

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

    fn lock_listener(&self) -> MutexGuard<'_, Option<Child>> {
        lock(&self.listener)
    }

    fn write_config(&self, options: &SshdOptions, version: (u32, u32)) {
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

    fn write_known_hosts(&self) {
        let mut lines = format!("[127.0.0.1]:{} {}\n", self.port, self.host_key_public);
        if let Some(rsa) = &self.rsa_host_key_public {
            lines.push_str(&format!("[127.0.0.1]:{} {rsa}\n", self.port));
        }
        write_file(&self.known_hosts_path(), &lines);
    }

    fn spawn_listener(&self) -> Result<Child, StartFailure> {
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

    fn log_since(&self, offset: u64) -> String {
        let log = self.log();
        log.get(offset as usize..).unwrap_or(&log).to_string()
    }

    fn start_failed(&self, report: &str) -> ! {
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
struct Process {
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

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|e| e.into_inner())
}

fn is_root() -> bool {
    // SAFETY: geteuid(2) cannot fail and has no memory effects.
    unsafe { libc::geteuid() == 0 }
}

fn ensure_privsep_dir() {
    use std::os::unix::fs::PermissionsExt;
    if Path::new(PRIVSEP_DIR).is_dir() {
        return;
    }
    fs::create_dir_all(PRIVSEP_DIR)
        .and_then(|()| fs::set_permissions(PRIVSEP_DIR, fs::Permissions::from_mode(0o755)))
        .unwrap_or_else(|e| {
            panic!("root's sshd needs its privilege separation dir {PRIVSEP_DIR}: cannot create it: {e}")
        });
}

/// The name of the effective user, from the passwd database.
fn current_user() -> String {
    // SAFETY: getpwuid_r writes into `pwd` and `buf`, which outlive the call; the strings it
    // points `pwd` at live in `buf` and are copied out before `buf` is dropped.
    unsafe {
        let uid = libc::geteuid();
        let mut buf_len = 1024;
        loop {
            let mut pwd: libc::passwd = std::mem::zeroed();
            let mut buf = vec![0 as libc::c_char; buf_len];
            let mut result: *mut libc::passwd = std::ptr::null_mut();
            let rc = libc::getpwuid_r(uid, &mut pwd, buf.as_mut_ptr(), buf.len(), &mut result);
            if rc == libc::ERANGE && buf_len < 1 << 20 {
                buf_len *= 2;
                continue;
            }
            if rc != 0 || result.is_null() {
                panic!(
                    "uid {uid} has no passwd entry (getpwuid_r: {rc}); sshd can only log in a \
                     user it can look up: run the tests as a user that exists in /etc/passwd"
                );
            }
            return std::ffi::CStr::from_ptr(pwd.pw_name)
                .to_string_lossy()
                .into_owned();
        }
    }
}

/// `(major, minor)` of the sshd binary, from `sshd -V` (`OpenSSH_9.2p1, ...`); `(0, 0)` when it
/// cannot be read, which enables no version-specific settings.
fn sshd_version(sshd: &Path) -> (u32, u32) {
    let Ok(out) = Command::new(sshd).arg("-V").output() else {
        return (0, 0);
    };
    let text = String::from_utf8_lossy(&out.stderr);
    let Some(rest) = text.split("OpenSSH_").nth(1) else {
        return (0, 0);
    };
    let mut numbers = rest
        .split(|c: char| !c.is_ascii_digit())
        .map(|n| n.parse::<u32>().unwrap_or(0));
    (numbers.next().unwrap_or(0), numbers.next().unwrap_or(0))
}

fn ssh_keygen(args: &[&str]) {
    let mut cmd = Command::new(require_tool("ssh-keygen", OPENSSH_CLIENT_HINT));
    cmd.args(args).stdin(Stdio::null());
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", describe(&cmd)));
    if !out.status.success() {
        panic!(
            "{} failed ({}): {}",
            describe(&cmd),
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

/// `SHA256:...` of a public key file, as `ssh-keygen -lf` prints it.
fn fingerprint_sha256(public_key: &Path) -> String {
    let mut cmd = Command::new(require_tool("ssh-keygen", OPENSSH_CLIENT_HINT));
    cmd.args(["-l", "-E", "sha256", "-f"]).arg(public_key);
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", describe(&cmd)));
    let text = String::from_utf8_lossy(&out.stdout);
    text.split_whitespace()
        .find(|field| field.starts_with("SHA256:"))
        .unwrap_or_else(|| panic!("{} printed no SHA256 fingerprint: {text}", describe(&cmd)))
        .to_string()
}

/// The first two fields (`type base64`) of a `.pub` file.
fn read_public_key(path: &Path) -> String {
    let text =
        fs::read_to_string(path).unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
    let fields: Vec<&str> = text.split_whitespace().take(2).collect();
    if fields.len() != 2 {
        panic!("{} is not an OpenSSH public key: {text}", path.display());
    }
    fields.join(" ")
}

fn pub_path(private: &Path) -> PathBuf {
    let mut name = private.as_os_str().to_owned();
    name.push(".pub");
    PathBuf::from(name)
}

fn path_str(path: &Path) -> &str {
    path.to_str()
        .unwrap_or_else(|| panic!("path {} is not UTF-8", path.display()))
}

fn write_file(path: &Path, contents: &str) {
    File::create(path)
        .and_then(|mut f| f.write_all(contents.as_bytes()))
        .unwrap_or_else(|e| panic!("cannot write {}: {e}", path.display()));
}
