//! The channel an action's effect goes through, decoded from its canonical record.
//!
//! The canonical record is the stored truth (its fingerprint is over its text); [`Channel`] is
//! what code reads of it. It is decoded once per record read ([`CanonicalAction::channel`]), so
//! no caller parses the record's JSON or reads it by string key.

use std::fmt;

use serde_json::Value;

use crate::action::CanonicalAction;
use crate::http::{HttpMethod, HTTP_CHANNEL};

/// The channel name recorded for commands run on SSH hosts through the wrapper.
pub const SSH_CHANNEL: &str = "ssh-exec";

/// Where an execution's effect goes, as its canonical record names it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Channel {
    /// A command run on an SSH host through the wrapper.
    Ssh {
        user: String,
        /// The host's address as recorded (lower case).
        host: String,
        port: u16,
        /// The command's words; `None` for a word holding a secret (recorded as its MAC) or
        /// the execution ID.
        argv: Vec<Option<String>>,
    },
    /// A request to an HTTP API.
    Http {
        method: HttpMethod,
        /// `scheme://host:port/path`, normalized.
        target: String,
    },
    /// A channel this build does not know, or a record it cannot read: never sent, and said
    /// so by name.
    Unknown { name: String },
}

impl Channel {
    /// The channel's recorded name: `ssh-exec`, `http`, or whatever an unknown one says.
    pub fn name(&self) -> &str {
        match self {
            Channel::Ssh { .. } => SSH_CHANNEL,
            Channel::Http { .. } => HTTP_CHANNEL,
            Channel::Unknown { name } => name,
        }
    }

    /// The argv when every word of it is plain text (none holds a secret or the execution
    /// ID): what a raw command is resumed with.
    pub fn plain_argv(&self) -> Option<Vec<String>> {
        match self {
            Channel::Ssh { argv, .. } => argv.iter().cloned().collect(),
            _ => None,
        }
    }

    /// Decodes the channel of a canonical record's text.
    pub(crate) fn decode(json: &str) -> Channel {
        let Ok(record) = serde_json::from_str::<Value>(json) else {
            return Channel::Unknown {
                name: "(unreadable record)".into(),
            };
        };
        let name = record["channel"].as_str().unwrap_or("(none)");
        let decoded = match name {
            SSH_CHANNEL => decode_ssh(&record),
            HTTP_CHANNEL => decode_http(&record),
            _ => None,
        };
        decoded.unwrap_or_else(|| Channel::Unknown {
            name: name.to_string(),
        })
    }
}

fn decode_ssh(record: &Value) -> Option<Channel> {
    let target = &record["target"];
    Some(Channel::Ssh {
        user: target["user"].as_str()?.to_string(),
        host: target["host"].as_str()?.to_string(),
        port: u16::try_from(target["port"].as_u64()?).ok()?,
        argv: record["argv"]
            .as_array()?
            .iter()
            .map(|w| w.as_str().map(str::to_string))
            .collect(),
    })
}

fn decode_http(record: &Value) -> Option<Channel> {
    let http = &record["http"];
    let url = &http["url"];
    Some(Channel::Http {
        method: HttpMethod::parse(http["method"].as_str()?).ok()?,
        target: format!(
            "{}://{}:{}{}",
            url["scheme"].as_str()?,
            url["host"].as_str()?,
            url["port"].as_u64()?,
            url["path"].as_str()?
        ),
    })
}

impl fmt::Display for Channel {
    /// How a person is told where the effect goes: `ssh deploy@web1:22`, `HTTP POST
    /// https://api:443/deploys`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Channel::Ssh {
                user, host, port, ..
            } => write!(f, "ssh {user}@{host}:{port}"),
            Channel::Http { method, target } => write!(f, "HTTP {method} {target}"),
            Channel::Unknown { name } => write!(f, "channel {name}"),
        }
    }
}

impl CanonicalAction {
    /// The channel this record names, decoded on first use and kept with the record.
    pub fn channel(&self) -> &Channel {
        self.decoded
            .get_or_init(|| Box::new(Channel::decode(self.as_str())))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::action::{ActionRequest, Actor, FingerprintKey, IntentScope, Target, Word};
    use crate::http::{HttpActionRequest, HttpCall, HttpUrl};

    fn key() -> FingerprintKey {
        FingerprintKey::from_bytes([7; 32])
    }

    #[test]
    fn an_ssh_record_decodes_to_its_target_and_plain_words() {
        let req = ActionRequest {
            actor: Actor("a".into()),
            tool: "t".into(),
            channel: SSH_CHANNEL.into(),
            target: Target {
                user: "deploy".into(),
                host: "Web1".into(),
                port: 2222,
            },
            credential_ref: "k".into(),
            argv: vec![Word::literal("echo"), Word::literal("hi")],
            cwd: None,
            env: Default::default(),
            scope: IntentScope::ToolWindow,
            delivery: Default::default(),
        };
        let action = req.canonicalize(&key());
        let channel = action.channel();
        assert_eq!(
            *channel,
            Channel::Ssh {
                user: "deploy".into(),
                host: "web1".into(),
                port: 2222,
                argv: vec![Some("echo".into()), Some("hi".into())],
            }
        );
        assert_eq!(channel.to_string(), "ssh deploy@web1:2222");
        assert_eq!(channel.plain_argv(), Some(vec!["echo".into(), "hi".into()]));
        // Decoded once: the same value on every read of this record.
        assert!(std::ptr::eq(channel, action.channel()));
    }

    #[test]
    fn an_http_record_decodes_to_its_method_and_normalized_target() {
        let req = HttpActionRequest {
            actor: Actor("a".into()),
            tool: "t".into(),
            credential_ref: None,
            call: HttpCall {
                method: HttpMethod::Post,
                url: HttpUrl::parse("HTTPS://API.example/deploys?b=2&a=1").unwrap(),
                headers: Default::default(),
                body: None,
            },
            scope: IntentScope::ToolWindow,
            delivery: Default::default(),
        };
        let channel = req.canonicalize(&key()).channel().clone();
        assert_eq!(
            channel,
            Channel::Http {
                method: HttpMethod::Post,
                target: "https://api.example:443/deploys".into(),
            }
        );
        assert_eq!(channel.name(), HTTP_CHANNEL);
        assert_eq!(channel.plain_argv(), None);
    }

    #[test]
    fn a_record_of_another_channel_or_none_is_unknown_by_name() {
        assert_eq!(
            Channel::decode(r#"{"channel":"carrier-pigeon","v":1}"#),
            Channel::Unknown {
                name: "carrier-pigeon".into()
            }
        );
        // An SSH record missing its target is not guessed at.
        assert_eq!(
            Channel::decode(r#"{"channel":"ssh-exec"}"#).name(),
            "ssh-exec"
        );
        assert!(matches!(
            Channel::decode(r#"{"channel":"ssh-exec"}"#),
            Channel::Unknown { .. }
        ));
        assert_eq!(
            Channel::decode("not json").to_string(),
            "channel (unreadable record)"
        );
    }
}
