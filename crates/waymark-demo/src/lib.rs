//! The host `waymark demo` runs on: a small SSH server on loopback, for a machine without sshd.
//!
//! **What it does.** [`EmbeddedServer`] listens on `127.0.0.1` only, holds an ed25519 host key
//! generated in memory, and lets in exactly one public key ([`ClientKey`]). It serves only `exec`
//! requests. Each one runs `/bin/sh -c <command>` as the user running Waymark, in the demo's home
//! directory (`HOME` is set to it too), with the channel as stdin/stdout/stderr, then reports the
//! exit status (or signal), EOF and close, in that order, as OpenSSH's sshd does. It gives the
//! `known_hosts` line that pins it ([`EmbeddedServer::known_hosts_line`]).
//!
//! A command outlives its connection: the server never signals a command. When the connection
//! drops, the command's stdout and stderr pipes are closed (it gets `SIGPIPE` or `EPIPE` if it
//! writes again) and its stdin reaches EOF. Each command runs in its own process group, so a
//! Ctrl-C aimed at the demo does not reach it either.
//!
//! **What it does not do.** It is a stand-in host, not a general sshd. It accepts no password,
//! keyboard-interactive or certificate login, and refuses PTY, shell, subsystem, env and
//! forwarding requests. It listens on no other address and keeps no key on disk but the client
//! key it was asked to write. It knows nothing of the wrapper, the ledger or Waymark's client:
//! `waymark-ssh` connects to it as to any host, and ships no server itself. Only the demo uses it.
//!
//! ```no_run
//! # async fn demo() -> Result<(), waymark_demo::EmbeddedServerError> {
//! use waymark_demo::{ClientKey, EmbeddedServer, EmbeddedServerOptions};
//!
//! let server = EmbeddedServer::start(EmbeddedServerOptions::new(
//!     "/tmp/demo/home",
//!     ClientKey::Generate("/tmp/demo/id_ed25519".into()),
//! ))
//! .await?;
//! std::fs::write("/tmp/demo/known_hosts", format!("{}\n", server.known_hosts_line())).unwrap();
//! // ssh -i /tmp/demo/id_ed25519 -p {server.port()} -o UserKnownHostsFile=/tmp/demo/known_hosts ...
//! server.shutdown().await;
//! # Ok(()) }
//! ```

use std::fs;
use std::io::{self, Write};
use std::net::{Ipv4Addr, SocketAddr};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use russh::keys::ssh_key::private::Ed25519Keypair;
use russh::keys::ssh_key::LineEnding;
use russh::keys::{HashAlg, PrivateKey, PublicKey};
use russh::server;
use russh::{MethodKind, MethodSet};
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;

mod serve;

use serve::{accept_loop, Shared};

/// How to start an [`EmbeddedServer`].
#[derive(Debug, Clone)]
pub struct EmbeddedServerOptions {
    /// Port on 127.0.0.1; 0 (the default) picks a free one.
    pub port: u16,
    /// Working directory and `HOME` of every command (made absolute). Must exist.
    pub home: PathBuf,
    /// The one key allowed to log in.
    pub client_key: ClientKey,
    /// The only user name accepted, if set; by default any name is accepted (the key is the
    /// credential, and commands run as the user running Waymark whatever the name).
    pub user: Option<String>,
}

impl EmbeddedServerOptions {
    /// Options with an ephemeral port and any user name.
    pub fn new(home: impl Into<PathBuf>, client_key: ClientKey) -> Self {
        EmbeddedServerOptions {
            port: 0,
            home: home.into(),
            client_key,
            user: None,
        }
    }
}

/// The client key an [`EmbeddedServer`] authorizes.
#[derive(Debug, Clone)]
pub enum ClientKey {
    /// This public key, as an OpenSSH public key line (`ssh-ed25519 AAAA... comment`).
    Authorized(String),
    /// Generate an ed25519 key pair and write the private key to this path (OpenSSH format,
    /// unencrypted, mode 0600; an existing file is replaced). See
    /// [`EmbeddedServer::client_key_path`].
    Generate(PathBuf),
}

/// Why an [`EmbeddedServer`] could not start.
#[derive(Debug, thiserror::Error)]
pub enum EmbeddedServerError {
    /// The listening socket could not be opened.
    #[error("embedded SSH server: cannot listen on 127.0.0.1:{port}: {source}")]
    Bind {
        /// The port asked for (0: any).
        port: u16,
        /// What the OS said.
        source: io::Error,
    },
    /// The home directory is missing or not a directory.
    #[error("embedded SSH server: home directory {}: {reason}", path.display())]
    Home {
        /// The directory from the options.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
    /// [`ClientKey::Authorized`] is not a public key line.
    #[error("embedded SSH server: the authorized client key is not an OpenSSH public key line: {reason}")]
    AuthorizedKey {
        /// What the parser said.
        reason: String,
    },
    /// A key could not be generated or encoded.
    #[error("embedded SSH server: cannot generate a key: {reason}")]
    KeyGeneration {
        /// What failed.
        reason: String,
    },
    /// The generated client key could not be written.
    #[error("embedded SSH server: cannot write the client key to {}: {source}", path.display())]
    ClientKeyFile {
        /// The path from [`ClientKey::Generate`].
        path: PathBuf,
        /// What the OS said.
        source: io::Error,
    },
}

/// A running embedded SSH server. Dropping it stops it as [`EmbeddedServer::shutdown`] does,
/// without waiting.
#[derive(Debug)]
pub struct EmbeddedServer {
    addr: SocketAddr,
    host_key: PublicKey,
    client_key_path: Option<PathBuf>,
    exec_count: Arc<AtomicU64>,
    stop: watch::Sender<bool>,
    accept_loop: Mutex<Option<JoinHandle<()>>>,
}

impl EmbeddedServer {
    /// Binds 127.0.0.1, generates the host key (and the client key, if asked), and starts
    /// serving in the background on the current tokio runtime.
    pub async fn start(opts: EmbeddedServerOptions) -> Result<EmbeddedServer, EmbeddedServerError> {
        let home_error = |reason: String| EmbeddedServerError::Home {
            path: opts.home.clone(),
            reason,
        };
        // Absolute, so that `HOME` and `pwd` agree whatever directory Waymark runs in.
        let home = fs::canonicalize(&opts.home).map_err(|e| home_error(e.to_string()))?;
        if !home.is_dir() {
            return Err(home_error("not a directory".into()));
        }
        let (authorized, client_key_path) = match &opts.client_key {
            ClientKey::Authorized(line) => {
                let key = PublicKey::from_openssh(line.trim()).map_err(|e| {
                    EmbeddedServerError::AuthorizedKey {
                        reason: e.to_string(),
                    }
                })?;
                (key, None)
            }
            ClientKey::Generate(path) => {
                let key = generate_ed25519("waymark-demo-client")?;
                write_private_key(&key, path)?;
                (key.public_key().clone(), Some(path.clone()))
            }
        };
        let host_key = generate_ed25519("waymark-demo-host")?;
        let host_public = host_key.public_key().clone();

        let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, opts.port))
            .await
            .map_err(|source| EmbeddedServerError::Bind {
                port: opts.port,
                source,
            })?;
        let addr = listener
            .local_addr()
            .map_err(|source| EmbeddedServerError::Bind {
                port: opts.port,
                source,
            })?;

        let config = Arc::new(server::Config {
            server_id: russh::SshId::Standard(
                concat!("SSH-2.0-waymark_demo_", env!("CARGO_PKG_VERSION")).into(),
            ),
            methods: MethodSet::from(&[MethodKind::PublicKey][..]),
            // OpenSSH probes with "none" first; answering it at once saves a second per login.
            auth_rejection_time_initial: Some(Duration::ZERO),
            keys: vec![host_key],
            // A dead peer is noticed by keepalives, not by idleness: a pooled client
            // connection may legitimately sit idle for a long time.
            inactivity_timeout: None,
            keepalive_interval: Some(Duration::from_secs(15)),
            keepalive_max: 3,
            nodelay: true,
            ..Default::default()
        });
        let exec_count = Arc::new(AtomicU64::new(0));
        let shared = Arc::new(Shared {
            home,
            authorized,
            user: opts.user,
            exec_count: exec_count.clone(),
        });
        let (stop, stopped) = watch::channel(false);
        let accept_loop = tokio::spawn(accept_loop(listener, config, shared, stopped));

        tracing::info!(
            %addr,
            fingerprint = %fingerprint(&host_public),
            "embedded SSH server listening"
        );
        Ok(EmbeddedServer {
            addr,
            host_key: host_public,
            client_key_path,
            exec_count,
            stop,
            accept_loop: Mutex::new(Some(accept_loop)),
        })
    }

    /// The listening address (always on 127.0.0.1).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The listening port.
    pub fn port(&self) -> u16 {
        self.addr.port()
    }

    /// The host public key as an OpenSSH public key line, `ssh-ed25519 AAAA...`.
    pub fn host_key_openssh(&self) -> String {
        let mut key = self.host_key.clone();
        key.set_comment("");
        key.to_openssh()
            .map(|line| line.trim_end().to_string())
            .unwrap_or_default()
    }

    /// The host key fingerprint as `ssh-keygen -l` prints it, `SHA256:...`.
    pub fn host_key_fingerprint_sha256(&self) -> String {
        fingerprint(&self.host_key)
    }

    /// The `known_hosts` line that pins this server: `[127.0.0.1]:PORT ssh-ed25519 AAAA...`.
    pub fn known_hosts_line(&self) -> String {
        // OpenSSH's host field: the bare address on port 22, `[address]:port` on any other.
        let host = match self.port() {
            22 => self.addr.ip().to_string(),
            port => format!("[{}]:{port}", self.addr.ip()),
        };
        format!("{host} {}", self.host_key_openssh())
    }

    /// Where the generated client private key was written ([`ClientKey::Generate`]).
    pub fn client_key_path(&self) -> Option<&Path> {
        self.client_key_path.as_deref()
    }

    /// How many exec requests the server has accepted since it started.
    pub fn exec_count(&self) -> u64 {
        self.exec_count.load(Ordering::Relaxed)
    }

    /// Stops accepting connections and disconnects the live ones. Returns once the listening
    /// socket is closed. Commands already started keep running.
    pub async fn shutdown(&self) {
        self.stop.send_replace(true);
        let accept_loop = self.accept_loop.lock().ok().and_then(|mut h| h.take());
        if let Some(handle) = accept_loop {
            let _ = handle.await;
        }
    }
}

impl Drop for EmbeddedServer {
    fn drop(&mut self) {
        self.stop.send_replace(true);
    }
}

/// `SHA256:...`, as `ssh-keygen -l` and `ssh` print it.
fn fingerprint(key: &PublicKey) -> String {
    key.fingerprint(HashAlg::Sha256).to_string()
}

fn generate_ed25519(comment: &str) -> Result<PrivateKey, EmbeddedServerError> {
    let mut seed = [0u8; 32];
    getrandom::fill(&mut seed).map_err(|e| EmbeddedServerError::KeyGeneration {
        reason: format!("no randomness from the OS: {e}"),
    })?;
    let mut key = PrivateKey::from(Ed25519Keypair::from_seed(&seed));
    seed.fill(0);
    key.set_comment(comment);
    Ok(key)
}

fn write_private_key(key: &PrivateKey, path: &Path) -> Result<(), EmbeddedServerError> {
    let pem = key
        .to_openssh(LineEnding::LF)
        .map_err(|e| EmbeddedServerError::KeyGeneration {
            reason: e.to_string(),
        })?;
    let file_error = |source| EmbeddedServerError::ClientKeyFile {
        path: path.to_path_buf(),
        source,
    };
    // Replaced rather than truncated, so the new file is born 0600 whatever the old one was.
    match fs::remove_file(path) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(file_error(e)),
    }
    fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
        .and_then(|mut file| file.write_all(pem.as_bytes()))
        .map_err(file_error)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generated_keys_are_distinct_ed25519() {
        let a = generate_ed25519("a").expect("key");
        let b = generate_ed25519("b").expect("key");
        assert_eq!(a.algorithm(), russh::keys::Algorithm::Ed25519);
        assert_ne!(a.public_key().key_data(), b.public_key().key_data());
    }
}
