//! A real OpenSSH `sshd` on a loopback port, with its keys, config and log in a temp dir.
//! See [`TestSshd`].
//!
//! Here: the options, user keys, and setting a `TestSshd` up. `lifecycle` starts, stops and
//! restarts the listener and cleans up session processes; `host` holds what the kit needs from
//! the machine (user, root or not, OpenSSH's version, `ssh-keygen`, file helpers).

use std::fs::{self, OpenOptions};
use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Mutex, MutexGuard};
use std::thread;
use std::time::{Duration, Instant};

use tempfile::TempDir;

use crate::tools::{describe, free_port, require_tool};

mod host;
mod lifecycle;

use host::{
    current_user, ensure_privsep_dir, fingerprint_sha256, is_root, lock, path_str, pub_path,
    read_public_key, run_checked, ssh_keygen, sshd_version, write_file,
};
use lifecycle::Process;

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

/// Settings for [`TestSshd::with_options`]. `Default` gives what [`TestSshd::new`] uses.
#[derive(Debug, Clone)]
pub struct SshdOptions {
    max_sessions: u32,
    rsa_host_key: bool,
    extra_config: Vec<String>,
    serialized_login: Option<Duration>,
}

impl Default for SshdOptions {
    fn default() -> Self {
        SshdOptions {
            max_sessions: 10,
            rsa_host_key: false,
            extra_config: Vec::new(),
            serialized_login: None,
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

    /// Makes every session, before its command, hold a lock shared by the whole host for
    /// `hold`, as a login script does whose version manager rehashes under a host-wide lock:
    /// logins queue behind each other, so many at once take `hold` each, one after another.
    ///
    /// sshd runs `~/.ssh/rc` from the user's real home, which the kit must not touch, so the
    /// hook is a `ForceCommand` script in the kit's dir that takes the lock (`flock`) and then
    /// runs the requested command with the user's shell, as sshd would have (exit status,
    /// stdin and output pass through).
    pub fn serialized_login(mut self, hold: Duration) -> Self {
        self.serialized_login = Some(hold);
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
        if options.serialized_login.is_some() {
            require_tool("flock", "install it (apt-get install util-linux)");
        }
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

    /// A file of the wrapper's marker for `id` on this host (`stdout`, `cmd`, `exit`, ...):
    /// `<remote_dir>/exec/<id>.<name>` (marker layout 2, remote-scripts/PROTOCOL.md).
    pub fn marker_file(&self, id: &str, name: &str) -> PathBuf {
        self.remote_dir().join("exec").join(format!("{id}.{name}"))
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

    /// The known_hosts line that trusts this server's host key at `127.0.0.1:port`: a fault
    /// proxy's port in front of it, say (its own port is in
    /// [`known_hosts_path`](TestSshd::known_hosts_path) already).
    pub fn known_hosts_line(&self, port: u16) -> String {
        format!(
            "[127.0.0.1]:{port} {}\n",
            self.host_key_public_openssh().trim()
        )
    }

    /// A known_hosts file for reaching this server at `port`: its own file for its own port,
    /// else `dir/known_hosts` holding [`known_hosts_line`](TestSshd::known_hosts_line).
    pub fn known_hosts_for(&self, port: u16, dir: &Path) -> PathBuf {
        if port == self.port() {
            return self.known_hosts_path();
        }
        let path = dir.join("known_hosts");
        fs::write(&path, self.known_hosts_line(port))
            .unwrap_or_else(|e| panic!("cannot write {}: {e}", path.display()));
        path
    }

    /// The `[hosts.NAME]` table of a `waymark.toml` that reaches this server at `port` (its
    /// own, or a fault proxy's) as its user, with credential `credential` and the host key
    /// trusted through `known_hosts`; remote files under [`remote_dir`](TestSshd::remote_dir).
    pub fn waymark_host_toml(
        &self,
        name: &str,
        credential: &str,
        port: u16,
        known_hosts: &Path,
    ) -> String {
        format!(
            "\n[hosts.{name}]\naddress = \"127.0.0.1\"\nport = {port}\nuser = \"{user}\"\n\
             credential = \"{credential}\"\nknown_hosts = \"{kh}\"\nremote_dir = \"{remote}\"\n",
            user = self.user(),
            kh = known_hosts.display(),
            remote = self.remote_dir().display(),
        )
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
        let out = run_checked(&mut cmd);
        String::from_utf8_lossy(&out.stdout).into_owned()
    }
}
