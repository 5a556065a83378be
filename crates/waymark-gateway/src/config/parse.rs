//! From the file's text to a checked [`Config`]: every reference resolved (tool → host →
//! credential), every error at its file:line:column.

use std::collections::BTreeMap;
use std::path::Path;

use super::fields::{arg_specs, durations, expand_home, Locator};
use super::raw::{RawConfig, RawLedger};
use super::template::{is_name, parse_template};
use super::{
    Config, ConfigError, CredentialConfig, DaemonConfig, DefaultPaths, HostEntry, LedgerBackend,
    PolicyConfig, PostgresLedger, TemplatePart, TlsFiles, ToolDef, UrlSource, EXECUTION_ID_ENV,
};

impl Config {
    /// Reads and validates a configuration file.
    pub fn load(file: &Path, defaults: &DefaultPaths) -> Result<Config, ConfigError> {
        let text = std::fs::read_to_string(file).map_err(|e| ConfigError {
            file: file.to_path_buf(),
            line: 0,
            column: 0,
            message: format!("cannot read the configuration: {e} (create one with `waymark init`)"),
        })?;
        Self::parse(file, &text, defaults)
    }

    /// Parses and validates configuration text; `file` is used in error messages.
    pub fn parse(file: &Path, text: &str, defaults: &DefaultPaths) -> Result<Config, ConfigError> {
        let loc = Locator { file, text };
        let raw: RawConfig = toml::from_str(text).map_err(|e| {
            let mut message = e.message().trim().to_string();
            // toml locates a repeated key but does not name it; its span is the key's text.
            if message == "duplicate key" {
                if let Some(key) = e.span().and_then(|r| text.get(r)) {
                    message = format!(
                        "duplicate key `{}`: given twice in the same table",
                        key.trim()
                    );
                }
            }
            loc.at(e.span(), message)
        })?;
        let home = &defaults.home;

        let mut credentials = BTreeMap::new();
        let mut positions = BTreeMap::new();
        for (name, c) in &raw.credentials {
            let span = Some(c.span());
            positions.insert(format!("credentials.{name}"), loc.position(c.span()));
            if !is_name(name) {
                return Err(loc.at(
                    span,
                    format!("credential name {name:?}: use lowercase letters, digits, _ and -"),
                ));
            }
            let c = c.get_ref();
            if let Some(kind) = &c.kind {
                let cred = super::http::credential(&loc, name, kind, c, home)?;
                credentials.insert(name.clone(), cred);
                continue;
            }
            if c.token_env.is_some() || c.token_file.is_some() || c.header.is_some() {
                return Err(loc.at(span, format!("credential {name}: token_env, token_file and header belong to an HTTP credential; add kind = \"bearer\" or kind = \"header\"")));
            }
            let cred = match (&c.key_file, c.agent) {
                (Some(path), false) => CredentialConfig::KeyFile {
                    path: expand_home(path, home),
                    passphrase_env: c.passphrase_env.clone(),
                },
                (None, true) if c.passphrase_env.is_none() => CredentialConfig::Agent,
                (None, true) => return Err(loc.at(span, format!("credential {name}: passphrase_env applies to key_file only; the agent holds its own keys"))),
                (Some(_), true) => return Err(loc.at(span, format!("credential {name}: set either key_file or agent = true, not both"))),
                (None, false) => return Err(loc.at(span, format!("credential {name}: set key_file = \"~/.ssh/id_ed25519\" (and optionally passphrase_env) or agent = true"))),
            };
            credentials.insert(name.clone(), cred);
        }

        let mut hosts = BTreeMap::new();
        for (name, h) in &raw.hosts {
            let span = Some(h.span());
            positions.insert(format!("hosts.{name}"), loc.position(h.span()));
            if !is_name(name) {
                return Err(loc.at(
                    span,
                    format!("host name {name:?}: use lowercase letters, digits, _ and -"),
                ));
            }
            let h = h.get_ref();
            let cred = h.credential.get_ref();
            match credentials.get(cred) {
                None => return Err(loc.at(Some(h.credential.span()), format!(
                    "host {name}: credential {cred:?} is not defined; add a [credentials.{cred}] table or use one of: {}",
                    list(credentials.keys())
                ))),
                Some(CredentialConfig::Http { .. }) => return Err(loc.at(Some(h.credential.span()), format!(
                    "host {name}: credential {cred:?} is an HTTP credential; an SSH host needs key_file or agent = true"
                ))),
                Some(_) => {}
            }
            if h.max_sessions == 0 {
                return Err(loc.at(
                    span,
                    format!("host {name}: max_sessions must be at least 1"),
                ));
            }
            hosts.insert(
                name.clone(),
                HostEntry {
                    name: name.clone(),
                    address: h.address.clone(),
                    port: h.port,
                    user: h.user.clone(),
                    credential: cred.clone(),
                    known_hosts: h
                        .known_hosts
                        .as_deref()
                        .map(|p| expand_home(p, home))
                        .unwrap_or_else(|| home.join(".ssh/known_hosts")),
                    host_key_policy: h.host_key_policy,
                    remote_dir: h.remote_dir.clone().unwrap_or_else(|| "~/.waymark".into()),
                    max_sessions: h.max_sessions,
                    serve: h.serve,
                },
            );
        }

        let mut tools = BTreeMap::new();
        let mut warnings = Vec::new();
        for (name, t) in &raw.tools {
            let tool_span = Some(t.span());
            if !is_name(name) {
                return Err(loc.at(
                    tool_span,
                    format!("tool name {name:?}: use lowercase letters, digits, _ and -"),
                ));
            }
            let t = t.get_ref();
            match t.channel.as_ref().map(|c| c.get_ref().as_str()) {
                None | Some("ssh") => super::http::refuse_http_keys(&loc, name, t)?,
                Some("http") => {
                    let tool = super::http::tool(&loc, name, t, &credentials, &raw.policy)?;
                    tools.insert(name.clone(), tool);
                    continue;
                }
                Some(other) => {
                    return Err(loc.at(
                        t.channel.as_ref().map(|c| c.span()),
                        format!("tool {name}: channel {other:?} is not one Waymark has; use \"ssh\" (the default) or \"http\""),
                    ))
                }
            }
            for h in &t.hosts {
                if !hosts.contains_key(h.get_ref()) {
                    return Err(loc.at(Some(h.span()), format!(
                        "tool {name}: host {:?} is not defined; define [hosts.{}] or use one of: {}",
                        h.get_ref(), h.get_ref(), list(hosts.keys())
                    )));
                }
            }
            if t.hosts.is_empty() && !t.host_arg {
                return Err(loc.at(
                    tool_span,
                    format!("tool {name}: give it hosts = [\"...\"] or host_arg = true"),
                ));
            }
            let args = arg_specs(&loc, name, t)?;
            let Some(raw_argv) = &t.argv else {
                return Err(loc.at(
                    tool_span,
                    format!(
                        "tool {name}: give it argv = [\"...\"] (or channel = \"http\" with a url)"
                    ),
                ));
            };
            let mut argv = Vec::new();
            for word in raw_argv.get_ref() {
                let parts = parse_template(word.get_ref())
                    .map_err(|m| loc.at(Some(word.span()), format!("tool {name}: argv {m}")))?;
                for p in &parts {
                    if let TemplatePart::Arg(a) = p {
                        if !args.iter().any(|s| &s.name == a) {
                            return Err(loc.at(Some(word.span()), format!(
                                "tool {name}: argv uses {{{a}}} but no [tools.{name}.args.{a}] is declared"
                            )));
                        }
                        if args.iter().any(|s| &s.name == a && s.secret) {
                            let var = a.to_ascii_uppercase().replace('-', "_");
                            warnings.push(loc.at(Some(word.span()), format!(
                                "tool {name}: secret argument {a} is in argv, where every user of the host can read it while the command runs (/proc/PID/cmdline); put it in the environment instead: env = {{ {var} = \"{{{a}}}\" }} and read ${var} in the command"
                            )));
                        }
                    }
                }
                argv.push(parts);
            }
            if argv.is_empty() {
                return Err(loc.at(Some(raw_argv.span()), format!("tool {name}: argv is empty")));
            }
            let mut env = BTreeMap::new();
            for (var, value) in &t.env {
                let at = Some(value.span());
                if var == EXECUTION_ID_ENV {
                    return Err(loc.at(at, format!(
                        "tool {name}: env {var} is set by the wrapper to the execution's ID; leave it out"
                    )));
                }
                let parts = parse_template(value.get_ref())
                    .map_err(|m| loc.at(at.clone(), format!("tool {name}: env {var}: {m}")))?;
                for p in &parts {
                    if let TemplatePart::Arg(a) = p {
                        if !args.iter().any(|s| &s.name == a) {
                            return Err(loc.at(at, format!(
                                "tool {name}: env {var} uses {{{a}}} but no [tools.{name}.args.{a}] is declared (write {{{{ and }}}} for literal braces)"
                            )));
                        }
                    }
                }
                env.insert(var.clone(), parts);
            }
            let (retry_window, timeout, dedup_window) = durations(&loc, name, t)?;
            tools.insert(
                name.clone(),
                ToolDef {
                    name: name.clone(),
                    description: t.description.clone(),
                    hosts: t.hosts.iter().map(|h| h.get_ref().clone()).collect(),
                    host_arg: t.host_arg,
                    argv,
                    args,
                    contract: t.contract,
                    retry_window,
                    dedup_window,
                    approval: t.approval.unwrap_or(raw.policy.default_approval),
                    timeout,
                    cwd: t.cwd.clone(),
                    env,
                    http: None,
                },
            );
        }

        for h in &raw.policy.raw_commands {
            if !hosts.contains_key(h.get_ref()) {
                return Err(loc.at(
                    Some(h.span()),
                    format!(
                        "policy.raw_commands: host {:?} is not defined; use one of: {}",
                        h.get_ref(),
                        list(hosts.keys())
                    ),
                ));
            }
        }

        let (http_listen, tls) = http_listen(&raw.daemon, &loc, home)?;
        let metrics_listen = metrics_listen(&raw.daemon, &loc)?;
        let ledger_path = raw
            .ledger
            .path
            .as_deref()
            .map(|p| expand_home(p, home))
            .unwrap_or_else(|| defaults.ledger.clone());
        let ledger_backend = ledger_backend(&raw.ledger, &loc, home, &ledger_path)?;
        let actors = super::actors::parse(
            &loc,
            &raw.actors,
            &tools,
            &hosts.keys().collect::<Vec<_>>(),
            home,
        )?;
        // Secrets the daemon reads, readable by someone else: allowed, but said, at their line.
        for (name, c) in &raw.credentials {
            let path = match credentials.get(name) {
                Some(CredentialConfig::KeyFile { path, .. }) => path.clone(),
                Some(CredentialConfig::Http {
                    source: super::SecretSource::File(path),
                    ..
                }) => path.clone(),
                _ => continue,
            };
            for why in super::actors::readable_by_others(&path, &actors) {
                warnings.push(loc.at(Some(c.span()), format!("credentials.{name}: {why}")));
            }
        }
        for (name, a) in &raw.actors {
            let Some(f) = &a.get_ref().token_file else {
                continue;
            };
            let path = expand_home(f.get_ref(), home);
            for why in super::actors::readable_by_others(&path, &actors) {
                warnings.push(loc.at(Some(f.span()), format!("actors.{name}.token_file: {why}")));
            }
        }
        if let Some(f) = &raw.daemon.tls_key {
            let path = expand_home(f.get_ref(), home);
            for why in super::actors::readable_by_others(&path, &actors) {
                warnings.push(loc.at(Some(f.span()), format!("daemon.tls_key: {why}")));
            }
        }
        if let Some(f) = &raw.daemon.http_token_file {
            let path = expand_home(f.get_ref(), home);
            for why in super::actors::readable_by_others(&path, &actors) {
                warnings.push(loc.at(Some(f.span()), format!("daemon.http_token_file: {why}")));
            }
        }
        if let (false, Some(f)) = (actors.is_empty(), &raw.daemon.http_token_file) {
            return Err(loc.at(
                Some(f.span()),
                "daemon.http_token_file is the one token of single-user mode; with [actors], give each HTTP agent its own token (token_sha256 or token_file in its [actors] entry)",
            ));
        }
        let socket_group = match &raw.daemon.socket_group {
            Some(g) => Some(super::actors::lookup_group(g.get_ref()).ok_or_else(|| {
                loc.at(
                    Some(g.span()),
                    format!(
                        "daemon.socket_group: no Unix group {:?} on this machine; create it (`groupadd {}`) or name an existing one",
                        g.get_ref(),
                        g.get_ref()
                    ),
                )
            })?),
            None => None,
        };
        Ok(Config {
            warnings,
            positions,
            file: file.to_path_buf(),
            ledger_path,
            ledger_backend,
            daemon: DaemonConfig {
                socket: raw
                    .daemon
                    .socket
                    .as_deref()
                    .map(|p| expand_home(p, home))
                    .unwrap_or_else(|| defaults.socket.clone()),
                http_listen,
                http_token_file: raw
                    .daemon
                    .http_token_file
                    .as_ref()
                    .map(|p| expand_home(p.get_ref(), home)),
                tls,
                metrics_listen,
                socket_group,
                env_file: raw
                    .daemon
                    .env_file
                    .as_ref()
                    .map(|p| expand_home(p.get_ref(), home)),
            },
            policy: PolicyConfig {
                default_approval: raw.policy.default_approval,
                raw_commands: raw
                    .policy
                    .raw_commands
                    .iter()
                    .map(|h| h.get_ref().clone())
                    .collect(),
            },
            credentials,
            hosts,
            tools,
            actors,
        })
    }
}

/// `[daemon] http_listen` with `tls_cert` and `tls_key`. The bearer token and every call's
/// arguments and output cross the connection, so plain HTTP is served on loopback only; any
/// other address needs both TLS files, and TLS files without `http_listen` (or one without the
/// other) are refused, since they would silently do nothing.
fn http_listen(
    raw: &super::raw::RawDaemon,
    loc: &Locator<'_>,
    home: &Path,
) -> Result<(Option<std::net::SocketAddr>, Option<TlsFiles>), ConfigError> {
    let Some(s) = &raw.http_listen else {
        if let Some((key, v)) = [("tls_cert", &raw.tls_cert), ("tls_key", &raw.tls_key)]
            .into_iter()
            .find_map(|(k, v)| v.as_ref().map(|v| (k, v)))
        {
            return Err(loc.at(
                Some(v.span()),
                format!(
                    "daemon.{key} applies to MCP over HTTP only: set http_listen = \"...\" in \
                     [daemon] too, or remove {key}"
                ),
            ));
        }
        return Ok((None, None));
    };
    let addr: std::net::SocketAddr = s.get_ref().parse().map_err(|_| {
        loc.at(
            Some(s.span()),
            format!(
                "daemon.http_listen {:?} is not an address like 127.0.0.1:8931",
                s.get_ref()
            ),
        )
    })?;
    let missing: Vec<&str> = [("tls_cert", &raw.tls_cert), ("tls_key", &raw.tls_key)]
        .into_iter()
        .filter(|(_, v)| v.is_none())
        .map(|(k, _)| k)
        .collect();
    let example = |k: &str| match k {
        "tls_cert" => "tls_cert = \"/path/to/cert.pem\"",
        _ => "tls_key = \"/path/to/key.pem\" (a 0600 file)",
    };
    if !addr.ip().is_loopback() && !missing.is_empty() {
        return Err(loc.at(
            Some(s.span()),
            format!(
                "daemon.http_listen {:?} is not a loopback address, so MCP over HTTP there must \
                 use TLS (the bearer token and every call cross the network): add {} to \
                 [daemon], or listen on \"127.0.0.1:{}\"",
                s.get_ref(),
                missing
                    .iter()
                    .copied()
                    .map(example)
                    .collect::<Vec<_>>()
                    .join(" and "),
                addr.port()
            ),
        ));
    }
    let tls = match (&raw.tls_cert, &raw.tls_key) {
        (Some(cert), Some(key)) => Some(TlsFiles {
            cert: expand_home(cert.get_ref(), home),
            key: expand_home(key.get_ref(), home),
        }),
        (None, None) => None,
        (Some(given), None) | (None, Some(given)) => {
            let (set, add) = match raw.tls_cert {
                Some(_) => ("tls_cert", "tls_key"),
                None => ("tls_key", "tls_cert"),
            };
            return Err(loc.at(
                Some(given.span()),
                format!(
                    "daemon.{set} without {add}: TLS needs the certificate and its key; add {} \
                     to [daemon], or remove {set} to serve plain HTTP on loopback",
                    example(add)
                ),
            ));
        }
    };
    Ok((Some(addr), tls))
}

/// `[daemon] metrics_listen`: an address and port on loopback. The endpoint has no
/// authentication (Prometheus scrapes it as it is), and what it shows (tool and host names,
/// how many executions wait for approval) is for the operator, not the network; a scraper on
/// another machine reaches it through a tunnel or a local agent.
fn metrics_listen(
    raw: &super::raw::RawDaemon,
    loc: &Locator<'_>,
) -> Result<Option<std::net::SocketAddr>, ConfigError> {
    let Some(s) = &raw.metrics_listen else {
        return Ok(None);
    };
    let addr: std::net::SocketAddr = s.get_ref().parse().map_err(|_| {
        loc.at(
            Some(s.span()),
            format!(
                "daemon.metrics_listen {:?} is not an address like 127.0.0.1:9464",
                s.get_ref()
            ),
        )
    })?;
    if !addr.ip().is_loopback() {
        return Err(loc.at(
            Some(s.span()),
            format!(
                "daemon.metrics_listen {:?}: only a loopback address is allowed (127.0.0.1 or \
                 [::1]; the endpoint has no authentication): use \"127.0.0.1:{}\" and reach it \
                 from elsewhere through a tunnel or an agent on this machine",
                s.get_ref(),
                addr.port()
            ),
        ));
    }
    Ok(Some(addr))
}

/// `[ledger] backend` and, for PostgreSQL, where the connection string and the shared master
/// key come from. A connection string in the file is refused: it may carry a password.
fn ledger_backend(
    raw: &RawLedger,
    loc: &Locator<'_>,
    home: &Path,
    ledger_path: &Path,
) -> Result<LedgerBackend, ConfigError> {
    if let Some(url) = &raw.url {
        return Err(loc.at(
            Some(url.span()),
            "ledger.url: a connection string may carry a password and never goes in \
             waymark.toml; set url_env = \"VARIABLE\" (the daemon's environment) or url_file = \
             \"/path\" (a 0600 file) instead",
        ));
    }
    let backend = raw.backend.as_ref();
    match backend.map(|b| b.get_ref().as_str()) {
        None | Some("sled") => {
            for (key, set) in [
                ("url_env", raw.url_env.as_ref().map(|s| s.span())),
                ("url_file", raw.url_file.as_ref().map(|s| s.span())),
                ("key_file", raw.key_file.as_ref().map(|s| s.span())),
                ("daemon_name", raw.daemon_name.as_ref().map(|s| s.span())),
            ] {
                if set.is_some() {
                    return Err(loc.at(
                        set,
                        format!("ledger.{key} applies to backend = \"postgres\" only"),
                    ));
                }
            }
            Ok(LedgerBackend::Sled)
        }
        Some("postgres") => {
            let at = backend.map(|b| b.span());
            let url = match (&raw.url_env, &raw.url_file) {
                (Some(env), None) => UrlSource::Env(env.get_ref().clone()),
                (None, Some(file)) => UrlSource::File(expand_home(file.get_ref(), home)),
                (Some(env), Some(_)) => {
                    return Err(loc.at(
                        Some(env.span()),
                        "ledger: set either url_env or url_file, not both",
                    ))
                }
                (None, None) => {
                    return Err(loc.at(
                        at,
                        "ledger: backend = \"postgres\" needs url_env = \"VARIABLE\" or \
                         url_file = \"/path\" (a 0600 file) holding the connection string",
                    ))
                }
            };
            let origin = loc.at(at, "");
            Ok(LedgerBackend::Postgres(PostgresLedger {
                url,
                key_file: raw
                    .key_file
                    .as_ref()
                    .map(|k| expand_home(k.get_ref(), home))
                    .unwrap_or_else(|| ledger_path.join("ledger.key")),
                daemon_name: raw.daemon_name.as_ref().map(|n| n.get_ref().clone()),
                origin: format!("{}:{}", origin.file.display(), origin.line),
            }))
        }
        Some(other) => Err(loc.at(
            backend.map(|b| b.span()),
            format!(
                "ledger.backend {other:?}: use \"sled\" (one daemon) or \"postgres\" (several)"
            ),
        )),
    }
}

fn list<'a>(names: impl Iterator<Item = &'a String>) -> String {
    let v: Vec<&str> = names.map(|s| s.as_str()).collect();
    if v.is_empty() {
        "(none defined)".into()
    } else {
        v.join(", ")
    }
}
