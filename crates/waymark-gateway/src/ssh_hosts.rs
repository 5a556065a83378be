//! [`HostExecutor`] over SSH: one `waymark_ssh::Executor` (a pool of connections) per host.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use waymark_core::{ExecutionId, Outcome};
use waymark_ssh::wrapper::{
    InlineOutput, Launched, MarkerState, OutputChunk, StatusReport, Stream,
};
use waymark_ssh::{DispatchOutcome as SshOutcome, DispatchRequest, Executor};

use crate::config::{Config, CredentialConfig, HostEntry, HostKeyPolicy};
use crate::host::{
    Arg, DispatchError, DispatchOutcome, EnvVar, FetchedOutput, HostError, HostExecutor,
    MarkerView, OutputNews,
};

/// Every configured host, reached over SSH through pooled connections.
pub struct SshHosts {
    /// Hosts and credentials as configured now; a reload swaps it ([`SshHosts::set_config`]).
    config: std::sync::RwLock<Arc<Config>>,
    executors: Mutex<HashMap<String, Arc<Executor>>>,
    /// Keepalive settings for every host: they bound how long a silent drop goes unnoticed.
    pub keepalive_interval: Duration,
    pub keepalive_max: usize,
    /// Bytes of each stream fetched for the ledger.
    pub fetch_cap: u64,
    /// The daemon's ledger identity, recorded on each host beside the markers it owns.
    ledger_identity: Option<String>,
}

impl SshHosts {
    pub fn new(config: Arc<Config>) -> Self {
        SshHosts {
            config: std::sync::RwLock::new(config),
            executors: Mutex::new(HashMap::new()),
            keepalive_interval: Duration::from_secs(5),
            keepalive_max: 3,
            fetch_cap: 64 * 1024,
            ledger_identity: None,
        }
    }

    /// Hosts remember this ledger: the wrapper's install records `identity` on each host and
    /// refuses a host holding another ledger's markers (`waymark hosts adopt` resolves it).
    pub fn with_ledger_identity(mut self, identity: String) -> Self {
        self.ledger_identity = Some(identity);
        self
    }

    /// The SSH settings for one configured host.
    pub fn host_config(&self, host: &HostEntry) -> Result<waymark_ssh::HostConfig, HostError> {
        let config = self.config.read().expect("config").clone();
        let credential = match config.credentials.get(&host.credential) {
            Some(CredentialConfig::KeyFile {
                path,
                passphrase_env,
            }) => waymark_ssh::Credential::KeyFile {
                path: path.clone(),
                passphrase_env: passphrase_env.clone(),
            },
            Some(CredentialConfig::Agent) => waymark_ssh::Credential::Agent,
            Some(CredentialConfig::Http { .. }) | None => {
                return Err(HostError::Config(format!(
                    "host {}: credential {} is not an SSH credential in the configuration",
                    host.name, host.credential
                )))
            }
        };
        let mut c = waymark_ssh::HostConfig::new(
            &host.name,
            &host.address,
            &host.user,
            credential,
            &host.known_hosts,
        );
        c.port = host.port;
        c.remote_dir = host.remote_dir.clone();
        c.max_sessions = host.max_sessions;
        c.serve = host.serve;
        c.host_key_policy = match host.host_key_policy {
            HostKeyPolicy::Strict => waymark_ssh::HostKeyPolicy::Strict,
            HostKeyPolicy::AcceptNew => waymark_ssh::HostKeyPolicy::AcceptNew,
        };
        c.keepalive_interval = self.keepalive_interval;
        c.keepalive_max = self.keepalive_max;
        c.ledger_identity = self.ledger_identity.clone();
        Ok(c)
    }

    /// Swaps the configuration (a reload). A host whose settings or credential changed gets a
    /// new pool on its next use; calls holding the old one finish on it.
    pub fn set_config(&self, config: Arc<Config>) {
        let old = std::mem::replace(&mut *self.config.write().expect("config"), config.clone());
        let changed = |name: &String| {
            let was = old.hosts.get(name);
            let is = config.hosts.get(name);
            let credential = |c: &Config, h: Option<&HostEntry>| {
                h.and_then(|h| c.credentials.get(&h.credential))
                    .map(|c| format!("{c:?}"))
            };
            format!("{was:?}") != format!("{is:?}")
                || credential(&old, was) != credential(&config, is)
        };
        self.executors
            .lock()
            .expect("executors")
            .retain(|name, _| !changed(name));
    }

    /// The executor (connection pool) of a host, created on first use.
    pub fn executor(&self, host: &HostEntry) -> Result<Arc<Executor>, HostError> {
        let mut m = self.executors.lock().expect("executors");
        if let Some(e) = m.get(&host.name) {
            return Ok(e.clone());
        }
        let e =
            Executor::new(self.host_config(host)?).map_err(|e| HostError::Config(e.to_string()))?;
        let e = Arc::new(e);
        m.insert(host.name.clone(), e.clone());
        Ok(e)
    }

    /// Live pooled connections of every configured host (0 for one not reached yet), by name.
    pub fn connections(&self) -> Vec<(String, usize)> {
        let executors = self.executors.lock().expect("executors").clone();
        self.config
            .read()
            .expect("config")
            .hosts
            .keys()
            .map(|name| {
                let live = executors.get(name).map_or(0, |e| e.connection_count());
                (name.clone(), live)
            })
            .collect()
    }

    /// A finished stream as the run's reply gave it: inline, or fetched by offset (the first
    /// `cap` bytes, with the host's hash of all of it). A failed fetch is an error, never an
    /// empty result.
    async fn stream(
        &self,
        exec: &Executor,
        id: &str,
        stream: Stream,
        inline: &InlineOutput,
        cap: u64,
    ) -> Result<FetchedOutput, HostError> {
        match inline {
            InlineOutput::Inline(bytes) => Ok(FetchedOutput {
                bytes: bytes.clone(),
                total: bytes.len() as u64,
                sha256: None,
            }),
            InlineOutput::Fetch { size } => {
                let chunk = exec.output(id, stream, 0, cap).await.map_err(host_error)?;
                Ok(fetched(chunk, *size))
            }
        }
    }
}

/// An SSH failure in the gateway's terms: whether the request can have left, or the host
/// answered otherwise than the protocol says.
pub fn host_error(e: waymark_ssh::Error) -> HostError {
    if e.is_not_sent() {
        HostError::NotSent(e.to_string())
    } else if e.is_lost() {
        HostError::Lost(e.to_string())
    } else {
        HostError::Answer(e.to_string())
    }
}

/// What `output` from offset 0 gave: the head, the total size, the host's hash of the whole.
fn fetched(chunk: OutputChunk, size: u64) -> FetchedOutput {
    FetchedOutput {
        total: size.max(chunk.size).max(chunk.data.len() as u64),
        bytes: chunk.data,
        sha256: chunk.sha256,
    }
}

/// What a marker status means to the gateway.
pub fn marker_view(s: &StatusReport) -> MarkerView {
    match s.state {
        MarkerState::Absent => MarkerView::Absent,
        MarkerState::Starting => MarkerView::Starting,
        MarkerState::Running => MarkerView::Running { pid: s.command_pid },
        MarkerState::Completed => MarkerView::Finished(Outcome::Exited {
            exit_code: s.exit_code,
            signal: s.signal,
        }),
        MarkerState::TimedOut => MarkerView::Finished(Outcome::TimedOut),
        MarkerState::Cancelled => MarkerView::Finished(Outcome::Cancelled),
        MarkerState::Interrupted if s.launched == Some(Launched::No) => MarkerView::NotLaunched {
            reason: s
                .error
                .clone()
                .unwrap_or_else(|| "the supervisor ended before launching it".into()),
        },
        MarkerState::Interrupted => MarkerView::Interrupted,
    }
}

impl HostExecutor for SshHosts {
    async fn adopt(&self, host: &HostEntry) -> Result<Option<String>, HostError> {
        let exec = self.executor(host)?;
        exec.adopt().await.map_err(host_error)
    }

    async fn dispatch(
        &self,
        host: &HostEntry,
        id: ExecutionId,
        argv: Vec<Arg>,
        cwd: Option<String>,
        env: Vec<EnvVar>,
        timeout: Duration,
    ) -> Result<DispatchOutcome, DispatchError> {
        let exec = self.executor(host)?;
        let secret_args = (argv.iter().enumerate())
            .filter(|(_, a)| a.secret)
            .map(|(i, _)| i)
            .collect();
        let argv = argv.into_iter().map(|a| a.value).collect();
        let (secret, plain): (Vec<EnvVar>, Vec<EnvVar>) = env.into_iter().partition(|v| v.secret);
        let pairs = |vars: Vec<EnvVar>| vars.into_iter().map(|v| (v.name, v.value)).collect();
        let request = DispatchRequest {
            execution_id: id.to_string(),
            argv,
            cwd,
            env: pairs(plain),
            secret_env: pairs(secret),
            secret_args,
            stdin: None,
            timeout: Some(timeout),
            inline_max: Some(self.fetch_cap),
        };
        match exec.dispatch(&request, |_| {}).await {
            Ok(SshOutcome::Completed(report)) => match marker_view(&report.status) {
                MarkerView::Finished(outcome) => {
                    let id_s = id.to_string();
                    let cap = self.fetch_cap;
                    let fetched = async {
                        let stdout = self
                            .stream(&exec, &id_s, Stream::Stdout, &report.stdout, cap)
                            .await?;
                        let stderr = self
                            .stream(&exec, &id_s, Stream::Stderr, &report.stderr, cap)
                            .await?;
                        Ok::<_, HostError>((stdout, stderr))
                    };
                    match fetched.await {
                        Ok((stdout, stderr)) => Ok(DispatchOutcome::Finished {
                            outcome,
                            stdout,
                            stderr,
                        }),
                        // It ended, but the output did not arrive: the gateway fetches it
                        // again from the marker, which keeps it.
                        Err(e) => {
                            tracing::info!(%id, error = %e, "output fetch failed after the run ended");
                            Ok(DispatchOutcome::Observed(MarkerView::Finished(outcome)))
                        }
                    }
                }
                other => Ok(DispatchOutcome::Observed(other)),
            },
            Ok(SshOutcome::AlreadyStarted(status)) => {
                Ok(DispatchOutcome::Observed(marker_view(&status)))
            }
            // Anything but "not sent" happened after the request may have left: unknown, ask
            // the marker.
            Err(e) => Err(DispatchError::from(host_error(e))),
        }
    }

    async fn status(&self, host: &HostEntry, id: ExecutionId) -> Result<MarkerView, HostError> {
        let exec = self.executor(host)?;
        exec.status(&id.to_string())
            .await
            .map(|s| marker_view(&s))
            .map_err(host_error)
    }

    async fn status_many(
        &self,
        host: &HostEntry,
        ids: &[ExecutionId],
    ) -> Result<Vec<MarkerView>, HostError> {
        let exec = self.executor(host)?;
        let ids: Vec<String> = ids.iter().map(ToString::to_string).collect();
        exec.status_many(&ids)
            .await
            .map(|reports| reports.iter().map(marker_view).collect())
            .map_err(host_error)
    }

    async fn watch_output(
        &self,
        host: &HostEntry,
        wait: Duration,
        known: &[(ExecutionId, [u64; 2])],
    ) -> Result<Vec<OutputNews>, HostError> {
        let exec = self.executor(host)?;
        let asked: Vec<(String, [u64; 2])> =
            known.iter().map(|(id, s)| (id.to_string(), *s)).collect();
        let reports = exec.watch(wait, &asked).await.map_err(host_error)?;
        // The parse kept only ids asked for, in order: each report finds its id past the last.
        let mut at = 0;
        let mut news = Vec::with_capacity(reports.len());
        for r in reports {
            while asked[at].0 != r.id {
                at += 1;
            }
            news.push(OutputNews {
                id: known[at].0,
                sizes: [r.stdout_bytes, r.stderr_bytes],
                ended: r.ended,
            });
            at += 1;
        }
        Ok(news)
    }

    async fn fetch_output(
        &self,
        host: &HostEntry,
        id: ExecutionId,
        cap: u64,
    ) -> Result<(FetchedOutput, FetchedOutput), HostError> {
        let exec = self.executor(host)?;
        let id_s = id.to_string();
        let mut out = Vec::new();
        for stream in [Stream::Stdout, Stream::Stderr] {
            let chunk = exec
                .output(&id_s, stream, 0, cap)
                .await
                .map_err(host_error)?;
            let size = chunk.size;
            out.push(fetched(chunk, size));
        }
        let stderr = out.pop().unwrap_or_default();
        let stdout = out.pop().unwrap_or_default();
        Ok((stdout, stderr))
    }

    async fn read_output(
        &self,
        host: &HostEntry,
        id: ExecutionId,
        stream: crate::host::Stream,
        offset: u64,
        max: u64,
    ) -> Result<(Vec<u8>, u64), HostError> {
        let exec = self.executor(host)?;
        let stream = match stream {
            crate::host::Stream::Stdout => Stream::Stdout,
            crate::host::Stream::Stderr => Stream::Stderr,
        };
        let chunk = exec
            .output(&id.to_string(), stream, offset, max)
            .await
            .map_err(host_error)?;
        Ok((chunk.data, chunk.size))
    }

    async fn cancel(&self, host: &HostEntry, id: ExecutionId) -> Result<MarkerView, HostError> {
        let exec = self.executor(host)?;
        exec.cancel(&id.to_string(), None)
            .await
            .map(|s| marker_view(&s))
            .map_err(host_error)
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use waymark_ssh::{ConnectError, Error};

    use super::host_error;
    use crate::host::{DispatchError, HostError};

    /// An SSH error, and what its dispatch error must be.
    type Case = (Error, fn(&DispatchError) -> bool);

    fn errors() -> [Case; 5] {
        let host = || "h1".to_string();
        [
            (
                Error::NotSent(ConnectError::Timeout {
                    host: host(),
                    target: "u@h:22".into(),
                    timeout: Duration::from_secs(1),
                }),
                |d| matches!(d, DispatchError::NotSent(HostError::NotSent(_))),
            ),
            (
                Error::InvalidRequest {
                    host: host(),
                    message: "bad id".into(),
                },
                |d| matches!(d, DispatchError::NotSent(HostError::NotSent(_))),
            ),
            (
                Error::Lost {
                    host: host(),
                    verb: "run",
                    execution_id: None,
                    reason: "reset".into(),
                },
                |d| matches!(d, DispatchError::Lost(HostError::Lost(_))),
            ),
            (
                Error::Wrapper {
                    host: host(),
                    verb: "run",
                    message: "garbled".into(),
                },
                |d| matches!(d, DispatchError::Lost(HostError::Answer(_))),
            ),
            (
                Error::UnknownExecution {
                    host: host(),
                    verb: "run",
                },
                |d| matches!(d, DispatchError::Lost(HostError::Answer(_))),
            ),
        ]
    }

    #[test]
    fn only_an_error_that_proves_nothing_left_makes_a_dispatch_not_sent() {
        for (e, expected) in errors() {
            let text = e.to_string();
            let d = DispatchError::from(host_error(e));
            assert!(expected(&d), "{text} became {d:?}");
            assert_eq!(d.to_string(), text, "the SSH layer's words are kept");
        }
        let config = DispatchError::from(HostError::Config("no credential".into()));
        assert!(matches!(config, DispatchError::NotSent(_)));
    }
}
