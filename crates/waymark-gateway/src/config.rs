//! `waymark.toml`: parsing, validation with file:line:column errors, and default paths.
//!
//! Every reference is checked (tool → host → credential), unknown keys are rejected, and no
//! secret value has a place in the file: credentials name a key file and, optionally, the
//! environment variable that holds its passphrase.

use std::collections::BTreeMap;
use std::fmt;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;
use toml::Spanned;
use waymark_core::ReplayContract;

/// A configuration error, located in its file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    pub file: PathBuf,
    /// 1-based; 0 when the error has no location (a missing file).
    pub line: usize,
    pub column: usize,
    pub message: String,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.line == 0 {
            write!(f, "{}: {}", self.file.display(), self.message)
        } else {
            write!(
                f,
                "{}:{}:{}: {}",
                self.file.display(),
                self.line,
                self.column,
                self.message
            )
        }
    }
}

impl std::error::Error for ConfigError {}

/// Who must approve a tool's calls.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize, Default, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Approval {
    /// Runs without asking.
    #[default]
    None,
    /// An operator approves once per agent run.
    Session,
    /// An operator approves every call.
    PerCall,
}

/// How unknown host keys are treated.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "kebab-case")]
pub enum HostKeyPolicy {
    /// Refuse any key known_hosts does not pin.
    #[default]
    Strict,
    /// Pin a new host's key after authentication succeeds; refuse a changed key.
    AcceptNew,
}

impl fmt::Display for HostKeyPolicy {
    /// As written in the configuration (`strict`, `accept-new`).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            HostKeyPolicy::Strict => "strict",
            HostKeyPolicy::AcceptNew => "accept-new",
        })
    }
}

/// A tool argument's type.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ArgType {
    String,
    Integer,
    Boolean,
    Enum,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawLedger {
    path: Option<String>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawDaemon {
    socket: Option<String>,
    http_listen: Option<Spanned<String>>,
    http_token_file: Option<String>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawPolicy {
    #[serde(default)]
    default_approval: Approval,
    #[serde(default)]
    raw_commands: Vec<Spanned<String>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawCredential {
    key_file: Option<String>,
    passphrase_env: Option<String>,
    #[serde(default)]
    agent: bool,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawHost {
    address: String,
    #[serde(default = "default_port")]
    port: u16,
    user: String,
    credential: Spanned<String>,
    known_hosts: Option<String>,
    #[serde(default)]
    host_key_policy: HostKeyPolicy,
    remote_dir: Option<String>,
    #[serde(default = "default_max_sessions")]
    max_sessions: usize,
}

fn default_port() -> u16 {
    22
}

fn default_max_sessions() -> usize {
    10
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawArg {
    #[serde(rename = "type")]
    ty: ArgType,
    description: Option<String>,
    values: Option<Vec<String>>,
    pattern: Option<Spanned<String>>,
    #[serde(default)]
    secret: bool,
    #[serde(default = "yes")]
    required: bool,
}

fn yes() -> bool {
    true
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawTool {
    description: String,
    #[serde(default)]
    hosts: Vec<Spanned<String>>,
    #[serde(default)]
    host_arg: bool,
    argv: Spanned<Vec<Spanned<String>>>,
    #[serde(default)]
    args: BTreeMap<String, Spanned<RawArg>>,
    contract: ReplayContract,
    retry_window: Option<Spanned<String>>,
    dedup_window: Option<Spanned<String>>,
    approval: Option<Approval>,
    timeout: Option<Spanned<String>>,
    cwd: Option<String>,
    #[serde(default)]
    env: BTreeMap<String, Spanned<String>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawConfig {
    #[serde(default)]
    ledger: RawLedger,
    #[serde(default)]
    daemon: RawDaemon,
    #[serde(default)]
    policy: RawPolicy,
    #[serde(default)]
    credentials: BTreeMap<String, Spanned<RawCredential>>,
    #[serde(default)]
    hosts: BTreeMap<String, Spanned<RawHost>>,
    #[serde(default)]
    tools: BTreeMap<String, Spanned<RawTool>>,
}

/// A credential: where the private key comes from. Never the key itself.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CredentialConfig {
    KeyFile {
        path: PathBuf,
        passphrase_env: Option<String>,
    },
    Agent,
}

/// A configured host.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HostEntry {
    pub name: String,
    pub address: String,
    pub port: u16,
    pub user: String,
    pub credential: String,
    pub known_hosts: PathBuf,
    pub host_key_policy: HostKeyPolicy,
    pub remote_dir: String,
    pub max_sessions: usize,
}

/// One argument of a tool.
#[derive(Clone, Debug)]
pub struct ArgSpec {
    pub name: String,
    pub ty: ArgType,
    pub description: Option<String>,
    pub values: Vec<String>,
    /// Anchored: the whole value must match.
    pub pattern: Option<regex::Regex>,
    pub secret: bool,
    pub required: bool,
}

/// The reserved template placeholder for the execution's own ID; no argument takes its name.
pub const EXECUTION_ID_PLACEHOLDER: &str = "execution_id";

/// The variable the wrapper gives every command; a tool's `env` cannot set it.
pub const EXECUTION_ID_ENV: &str = "WAYMARK_EXECUTION_ID";

/// One piece of an argv template word.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TemplatePart {
    Text(String),
    Arg(String),
    /// `{execution_id}`: filled in when the command is sent, outside the fingerprint.
    ExecutionId,
}

/// A configured tool.
#[derive(Clone, Debug)]
pub struct ToolDef {
    pub name: String,
    pub description: String,
    /// Fixed hosts; when `host_arg` is set, the caller picks one of them (or any host when
    /// the list is empty).
    pub hosts: Vec<String>,
    pub host_arg: bool,
    pub argv: Vec<Vec<TemplatePart>>,
    pub args: Vec<ArgSpec>,
    pub contract: ReplayContract,
    pub retry_window: Duration,
    pub dedup_window: Option<Duration>,
    pub approval: Approval,
    pub timeout: Duration,
    pub cwd: Option<String>,
    /// Value templates, like argv words: literal text, `{arg}` and `{execution_id}`. A secret
    /// argument in an env value reaches the host on the channel's stdin, never on a command
    /// line.
    pub env: BTreeMap<String, Vec<TemplatePart>>,
}

/// Daemon settings.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DaemonConfig {
    pub socket: PathBuf,
    pub http_listen: Option<std::net::SocketAddr>,
    pub http_token_file: Option<PathBuf>,
}

/// Policy settings.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PolicyConfig {
    pub default_approval: Approval,
    /// Hosts on which the raw command tool exists.
    pub raw_commands: Vec<String>,
}

/// A validated configuration.
#[derive(Clone, Debug)]
pub struct Config {
    /// What is allowed but unsafe (a secret argument in argv), with its line: printed by the
    /// CLI and logged by the daemon at load.
    pub warnings: Vec<ConfigError>,
    pub file: PathBuf,
    pub ledger_path: PathBuf,
    pub daemon: DaemonConfig,
    pub policy: PolicyConfig,
    pub credentials: BTreeMap<String, CredentialConfig>,
    pub hosts: BTreeMap<String, HostEntry>,
    pub tools: BTreeMap<String, ToolDef>,
}

/// Where things live by default, following the XDG base directories.
#[derive(Clone, Debug)]
pub struct DefaultPaths {
    pub config_file: PathBuf,
    pub ledger: PathBuf,
    pub socket: PathBuf,
    pub home: PathBuf,
}

impl DefaultPaths {
    /// Computes defaults from an environment lookup (`std::env::var` in production).
    pub fn from_env(get: impl Fn(&str) -> Option<String>, uid: u32) -> Self {
        let home = PathBuf::from(get("HOME").unwrap_or_else(|| "/".into()));
        let xdg = |var: &str, fallback: &str| {
            get(var)
                .filter(|v| v.starts_with('/'))
                .map(PathBuf::from)
                .unwrap_or_else(|| home.join(fallback))
        };
        let runtime = get("XDG_RUNTIME_DIR")
            .filter(|v| v.starts_with('/'))
            .map(|d| PathBuf::from(d).join("waymark"))
            .unwrap_or_else(|| PathBuf::from(format!("/tmp/waymark-{uid}")));
        DefaultPaths {
            config_file: xdg("XDG_CONFIG_HOME", ".config")
                .join("waymark")
                .join("waymark.toml"),
            ledger: xdg("XDG_STATE_HOME", ".local/state")
                .join("waymark")
                .join("ledger"),
            socket: runtime.join("daemon.sock"),
            home,
        }
    }
}

/// Parses a duration such as `500ms`, `30s`, `10m`, `2h`, `1d`.
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let t = text.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: u64 = num
        .parse()
        .map_err(|_| format!("{text:?} is not a duration (use e.g. 30s, 10m, 2h)"))?;
    let ms = match unit {
        "ms" => n,
        "s" => n * 1000,
        "m" => n * 60_000,
        "h" => n * 3_600_000,
        "d" => n * 86_400_000,
        _ => return Err(format!("{text:?} has unit {unit:?}; use ms, s, m, h or d")),
    };
    Ok(Duration::from_millis(ms))
}

fn is_name(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 64
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_' || b == b'-')
}

/// Parses an argv template word: `{name}` is an argument, `{execution_id}` the execution's
/// ID, `{{` and `}}` are literal braces.
pub fn parse_template(word: &str) -> Result<Vec<TemplatePart>, String> {
    let mut parts = Vec::new();
    let mut text = String::new();
    let mut chars = word.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '{' if chars.peek() == Some(&'{') => {
                chars.next();
                text.push('{');
            }
            '}' if chars.peek() == Some(&'}') => {
                chars.next();
                text.push('}');
            }
            '{' => {
                let mut name = String::new();
                loop {
                    match chars.next() {
                        Some('}') => break,
                        Some(ch) => name.push(ch),
                        None => return Err(format!("{word:?}: `{{` without a closing `}}` (write `{{{{` for a literal brace)")),
                    }
                }
                if !is_name(&name) {
                    return Err(format!("{word:?}: {{{name}}} is not an argument name (lowercase letters, digits, _ and -)"));
                }
                if !text.is_empty() {
                    parts.push(TemplatePart::Text(std::mem::take(&mut text)));
                }
                parts.push(if name == EXECUTION_ID_PLACEHOLDER {
                    TemplatePart::ExecutionId
                } else {
                    TemplatePart::Arg(name)
                });
            }
            '}' => {
                return Err(format!(
                    "{word:?}: a lone `}}` (write `}}}}` for a literal brace)"
                ))
            }
            ch => text.push(ch),
        }
    }
    if !text.is_empty() || parts.is_empty() {
        parts.push(TemplatePart::Text(text));
    }
    Ok(parts)
}

struct Locator<'a> {
    file: &'a Path,
    text: &'a str,
}

impl Locator<'_> {
    fn at(&self, span: Option<Range<usize>>, message: impl Into<String>) -> ConfigError {
        let (line, column) = match span {
            Some(r) => {
                let before = &self.text[..r.start.min(self.text.len())];
                let line = before.matches('\n').count() + 1;
                let column = before.rsplit('\n').next().map_or(0, |l| l.chars().count()) + 1;
                (line, column)
            }
            None => (0, 0),
        };
        ConfigError {
            file: self.file.to_path_buf(),
            line,
            column,
            message: message.into(),
        }
    }
}

fn expand_home(path: &str, home: &Path) -> PathBuf {
    match path.strip_prefix("~/") {
        Some(rest) => home.join(rest),
        None if path == "~" => home.to_path_buf(),
        None => PathBuf::from(path),
    }
}

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
        let raw: RawConfig =
            toml::from_str(text).map_err(|e| loc.at(e.span(), e.message().trim().to_string()))?;
        let home = &defaults.home;

        let mut credentials = BTreeMap::new();
        for (name, c) in &raw.credentials {
            let span = Some(c.span());
            if !is_name(name) {
                return Err(loc.at(
                    span,
                    format!("credential name {name:?}: use lowercase letters, digits, _ and -"),
                ));
            }
            let c = c.get_ref();
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
            if !is_name(name) {
                return Err(loc.at(
                    span,
                    format!("host name {name:?}: use lowercase letters, digits, _ and -"),
                ));
            }
            let h = h.get_ref();
            let cred = h.credential.get_ref();
            if !credentials.contains_key(cred) {
                return Err(loc.at(Some(h.credential.span()), format!(
                    "host {name}: credential {cred:?} is not defined; add a [credentials.{cred}] table or use one of: {}",
                    list(credentials.keys())
                )));
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
            let mut args = Vec::new();
            for (arg_name, a) in &t.args {
                let aspan = Some(a.span());
                if arg_name == EXECUTION_ID_PLACEHOLDER {
                    return Err(loc.at(aspan, format!(
                        "tool {name}: argument name {arg_name:?} is reserved: {{{arg_name}}} is the execution's own ID; rename the argument"
                    )));
                }
                if !is_name(arg_name) || arg_name == "host" {
                    return Err(loc.at(
                        aspan,
                        format!("tool {name}: argument name {arg_name:?} is reserved or invalid"),
                    ));
                }
                let a = a.get_ref();
                let values = a.values.clone().unwrap_or_default();
                if a.ty == ArgType::Enum && values.is_empty() {
                    return Err(loc.at(aspan, format!("tool {name}: argument {arg_name} is an enum; list its values = [\"...\"]")));
                }
                if a.ty != ArgType::Enum && a.values.is_some() {
                    return Err(loc.at(aspan, format!("tool {name}: argument {arg_name}: values apply to type = \"enum\" only")));
                }
                let pattern = match &a.pattern {
                    Some(p) => Some(
                        regex::Regex::new(&format!("^(?:{})$", p.get_ref())).map_err(|e| {
                            loc.at(
                                Some(p.span()),
                                format!("tool {name}: argument {arg_name}: bad pattern: {e}"),
                            )
                        })?,
                    ),
                    None => None,
                };
                args.push(ArgSpec {
                    name: arg_name.clone(),
                    ty: a.ty,
                    description: a.description.clone(),
                    values,
                    pattern,
                    secret: a.secret,
                    required: a.required,
                });
            }
            let mut argv = Vec::new();
            for word in t.argv.get_ref() {
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
                return Err(loc.at(Some(t.argv.span()), format!("tool {name}: argv is empty")));
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
            let dur = |d: &Option<Spanned<String>>,
                       default: Option<Duration>|
             -> Result<Option<Duration>, ConfigError> {
                match d {
                    Some(s) => parse_duration(s.get_ref())
                        .map(Some)
                        .map_err(|m| loc.at(Some(s.span()), format!("tool {name}: {m}"))),
                    None => Ok(default),
                }
            };
            let retry_window =
                dur(&t.retry_window, Some(Duration::from_secs(600)))?.expect("default");
            let timeout = dur(&t.timeout, Some(Duration::from_secs(300)))?.expect("default");
            let dedup_window = dur(&t.dedup_window, None)?;
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

        let http_listen = match &raw.daemon.http_listen {
            Some(s) => Some(s.get_ref().parse().map_err(|_| {
                loc.at(
                    Some(s.span()),
                    format!(
                        "daemon.http_listen {:?} is not an address like 127.0.0.1:8931",
                        s.get_ref()
                    ),
                )
            })?),
            None => None,
        };
        Ok(Config {
            warnings,
            file: file.to_path_buf(),
            ledger_path: raw
                .ledger
                .path
                .as_deref()
                .map(|p| expand_home(p, home))
                .unwrap_or_else(|| defaults.ledger.clone()),
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
                    .as_deref()
                    .map(|p| expand_home(p, home)),
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
        })
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
