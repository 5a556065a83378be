//! Host key pinning against an OpenSSH `known_hosts` file.
//!
//! Understands what OpenSSH writes and reads: plain and hashed (`|1|salt|hash`) host fields,
//! `[host]:port` for non-standard ports, comma-separated patterns with `*`/`?` wildcards and
//! `!` negation, `@revoked` lines, and comments. `@cert-authority` lines are ignored (host
//! certificates are checked by their plain key). A line whose key cannot be parsed is
//! skipped, so one odd entry does not lock every host out.
//!
//! russh ships `check_known_hosts_path`, but it splits on single spaces, stops at the first
//! unparsable key and miscounts lines after comments; the line number matters here because the
//! "host key changed" error names it.

use std::fs::OpenOptions;
use std::io::{self, Read, Write};
use std::path::Path;

use data_encoding::BASE64;
use hmac::{Hmac, KeyInit, Mac};
use russh::keys::{HashAlg, PublicKey};
use sha1::Sha1;

/// What `known_hosts` says about the key a host presented.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// A line for this host pins exactly this key.
    Known,
    /// No line for this host pins a key of this algorithm.
    /// `other_algorithms` lists the algorithms of keys pinned for the host, if any.
    Unknown { other_algorithms: Vec<String> },
    /// A line for this host pins a different key of the same algorithm.
    Changed { line: usize },
    /// An `@revoked` line lists this key.
    Revoked { line: usize },
}

/// The host field OpenSSH uses for `address:port`: the bare name on port 22, `[name]:port`
/// otherwise. Lower-cased, as OpenSSH does before matching.
pub(crate) fn host_field(address: &str, port: u16) -> String {
    let address = address.to_ascii_lowercase();
    if port == 22 {
        address
    } else {
        format!("[{address}]:{port}")
    }
}

/// `SHA256:…`, the fingerprint `ssh-keygen -l` and `ssh` print.
pub(crate) fn fingerprint(key: &PublicKey) -> String {
    key.fingerprint(HashAlg::Sha256).to_string()
}

/// The `known_hosts` line pinning `key` for `address:port`, as `ssh-keyscan` prints it.
pub(crate) fn line_for(address: &str, port: u16, key: &PublicKey) -> String {
    let mut key = key.clone();
    key.set_comment("");
    let encoded = key
        .to_openssh()
        .unwrap_or_else(|_| format!("{} <unencodable key>", key.algorithm().as_str()));
    format!("{} {}", host_field(address, port), encoded.trim_end())
}

/// Looks `key` up for `address:port` in the file at `path`. A missing file knows nothing.
pub(crate) fn check(path: &Path, address: &str, port: u16, key: &PublicKey) -> io::Result<Verdict> {
    let mut text = String::new();
    match std::fs::File::open(path) {
        Ok(mut file) => {
            file.read_to_string(&mut text)?;
        }
        Err(err) if err.kind() == io::ErrorKind::NotFound => {}
        Err(err) => return Err(err),
    }
    Ok(check_text(&text, &host_field(address, port), key))
}

fn check_text(text: &str, host: &str, key: &PublicKey) -> Verdict {
    let mut known = false;
    let mut changed = None;
    let mut other_algorithms = Vec::new();
    for (index, raw) in text.lines().enumerate() {
        let line_no = index + 1;
        let Some(entry) = Entry::parse(raw) else {
            continue;
        };
        if !entry.matches(host) {
            continue;
        }
        let Ok(pinned) = russh::keys::parse_public_key_base64(entry.key_base64) else {
            continue;
        };
        let same_key = pinned.key_data() == key.key_data();
        match entry.marker {
            Some(Marker::Revoked) if same_key => return Verdict::Revoked { line: line_no },
            Some(_) => continue,
            None => {}
        }
        if same_key {
            known = true;
        } else if pinned.algorithm() == key.algorithm() {
            changed.get_or_insert(line_no);
        } else {
            let name = pinned.algorithm().as_str().to_string();
            if !other_algorithms.contains(&name) {
                other_algorithms.push(name);
            }
        }
    }
    // A pinned match wins over a stale line for the same host, as in OpenSSH.
    if known {
        Verdict::Known
    } else if let Some(line) = changed {
        Verdict::Changed { line }
    } else {
        Verdict::Unknown { other_algorithms }
    }
}

/// Appends `line` to `path` with a single `write` on an `O_APPEND` descriptor, so concurrent
/// readers and appenders never see half a line, then syncs it. Creates the file (0600) and
/// its directory if needed, and adds the missing newline of a file that lacks one.
pub(crate) fn append_line(path: &Path, line: &str) -> io::Result<()> {
    if let Some(parent) = path.parent() {
        if !parent.as_os_str().is_empty() {
            std::fs::create_dir_all(parent)?;
        }
    }
    let mut options = OpenOptions::new();
    options.read(true).append(true).create(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        options.mode(0o600);
    }
    let mut file = options.open(path)?;
    let needs_newline = {
        let len = file.metadata()?.len();
        if len == 0 {
            false
        } else {
            use std::io::{Seek, SeekFrom};
            let mut last = [0u8; 1];
            file.seek(SeekFrom::Start(len - 1))?;
            file.read_exact(&mut last)?;
            last[0] != b'\n'
        }
    };
    let mut buf = String::with_capacity(line.len() + 2);
    if needs_newline {
        buf.push('\n');
    }
    buf.push_str(line);
    buf.push('\n');
    file.write_all(buf.as_bytes())?;
    file.sync_all()
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Marker {
    Revoked,
    CertAuthority,
}

struct Entry<'a> {
    marker: Option<Marker>,
    hosts: &'a str,
    key_base64: &'a str,
}

impl<'a> Entry<'a> {
    fn parse(line: &'a str) -> Option<Self> {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            return None;
        }
        let mut fields = line.split_ascii_whitespace();
        let mut first = fields.next()?;
        let marker = match first {
            "@revoked" => Some(Marker::Revoked),
            "@cert-authority" => Some(Marker::CertAuthority),
            other if other.starts_with('@') => return None,
            _ => None,
        };
        if marker.is_some() {
            first = fields.next()?;
        }
        let _algorithm = fields.next()?;
        let key_base64 = fields.next()?;
        Some(Entry {
            marker,
            hosts: first,
            key_base64,
        })
    }

    /// OpenSSH semantics: the line applies if some pattern matches and no negated one does.
    fn matches(&self, host: &str) -> bool {
        if let Some(hashed) = self.hosts.strip_prefix("|1|") {
            return hashed_matches(hashed, host);
        }
        let mut positive = false;
        for pattern in self.hosts.split(',') {
            if let Some(negated) = pattern.strip_prefix('!') {
                if wildcard_match(&negated.to_ascii_lowercase(), host) {
                    return false;
                }
            } else if wildcard_match(&pattern.to_ascii_lowercase(), host) {
                positive = true;
            }
        }
        positive
    }
}

/// `salt|hash`, both base64: HMAC-SHA1 keyed with the salt over the host field.
fn hashed_matches(salt_and_hash: &str, host: &str) -> bool {
    let Some((salt, hash)) = salt_and_hash.split_once('|') else {
        return false;
    };
    let (Ok(salt), Ok(hash)) = (
        BASE64.decode(salt.as_bytes()),
        BASE64.decode(hash.as_bytes()),
    ) else {
        return false;
    };
    let Ok(mac) = Hmac::<Sha1>::new_from_slice(&salt) else {
        return false;
    };
    mac.chain_update(host.as_bytes())
        .verify_slice(&hash)
        .is_ok()
}

/// `*` matches any run of characters, `?` exactly one; everything else literally.
fn wildcard_match(pattern: &str, text: &str) -> bool {
    let (p, t) = (pattern.as_bytes(), text.as_bytes());
    let (mut pi, mut ti) = (0, 0);
    let mut backtrack: Option<(usize, usize)> = None;
    while ti < t.len() {
        match p.get(pi) {
            Some(b'*') => {
                backtrack = Some((pi, ti));
                pi += 1;
            }
            Some(&c) if c == b'?' || c == t[ti] => {
                pi += 1;
                ti += 1;
            }
            _ => match backtrack {
                Some((star, at)) => {
                    pi = star + 1;
                    ti = at + 1;
                    backtrack = Some((star, at + 1));
                }
                None => return false,
            },
        }
    }
    p[pi..].iter().all(|&c| c == b'*')
}

#[cfg(test)]
mod tests {
    use super::*;

    const ED_A: &str = "AAAAC3NzaC1lZDI1NTE5AAAAIPEtGZvHz9p1Zhumx9HuP7wayxSyVYTGVU5pleTRdjNL";
    const ED_B: &str = "AAAAC3NzaC1lZDI1NTE5AAAAICgA/83IGU348AV4SYoe953BtXRWnAzOUoCCJVhsGCO0";

    fn key(b64: &str) -> PublicKey {
        russh::keys::parse_public_key_base64(b64).unwrap()
    }

    #[test]
    fn plain_entry_on_port_22_is_known() {
        let text = format!("# comment\nexample.com ssh-ed25519 {ED_A}\n");
        assert_eq!(check_text(&text, "example.com", &key(ED_A)), Verdict::Known);
    }

    #[test]
    fn bracketed_port_entry_only_matches_that_port() {
        let text = format!("[example.com]:2222 ssh-ed25519 {ED_A}\n");
        assert_eq!(
            check_text(&text, &host_field("example.com", 2222), &key(ED_A)),
            Verdict::Known
        );
        assert!(matches!(
            check_text(&text, &host_field("example.com", 22), &key(ED_A)),
            Verdict::Unknown { .. }
        ));
    }

    #[test]
    fn changed_key_names_the_physical_line() {
        let text = format!("# one\n\n# three\nexample.com ssh-ed25519 {ED_B}\n");
        assert_eq!(
            check_text(&text, "example.com", &key(ED_A)),
            Verdict::Changed { line: 4 }
        );
    }

    #[test]
    fn matching_line_wins_over_stale_line() {
        let text = format!("example.com ssh-ed25519 {ED_B}\nexample.com ssh-ed25519 {ED_A}\n");
        assert_eq!(check_text(&text, "example.com", &key(ED_A)), Verdict::Known);
    }

    #[test]
    fn hashed_entry_matches_its_host_only() {
        // `ssh-keygen -H` output for "[127.0.0.1]:2222" with a fixed salt.
        let salt = [7u8; 20];
        let mut mac = Hmac::<Sha1>::new_from_slice(&salt).unwrap();
        mac.update(b"[127.0.0.1]:2222");
        let hash = mac.finalize().into_bytes();
        let text = format!(
            "|1|{}|{} ssh-ed25519 {ED_A}\n",
            BASE64.encode(&salt),
            BASE64.encode(&hash)
        );
        assert_eq!(
            check_text(&text, &host_field("127.0.0.1", 2222), &key(ED_A)),
            Verdict::Known
        );
        assert!(matches!(
            check_text(&text, &host_field("127.0.0.1", 2223), &key(ED_A)),
            Verdict::Unknown { .. }
        ));
    }

    #[test]
    fn wildcards_and_negation_follow_openssh() {
        let text = format!("*.example.com,!bad.example.com ssh-ed25519 {ED_A}\n");
        assert_eq!(
            check_text(&text, "web1.example.com", &key(ED_A)),
            Verdict::Known
        );
        assert!(matches!(
            check_text(&text, "bad.example.com", &key(ED_A)),
            Verdict::Unknown { .. }
        ));
        assert!(wildcard_match("web?", "web1"));
        assert!(!wildcard_match("web?", "web12"));
        assert!(wildcard_match("*", ""));
    }

    #[test]
    fn revoked_key_is_refused_even_if_pinned() {
        let text = format!("example.com ssh-ed25519 {ED_A}\n@revoked * ssh-ed25519 {ED_A}\n");
        assert_eq!(
            check_text(&text, "example.com", &key(ED_A)),
            Verdict::Revoked { line: 2 }
        );
    }

    #[test]
    fn unparsable_and_tab_separated_lines_are_handled() {
        let text =
            format!("example.com ssh-ed25519 !!notbase64\nexample.com\tssh-ed25519\t{ED_A}\n");
        assert_eq!(check_text(&text, "example.com", &key(ED_A)), Verdict::Known);
    }

    #[test]
    fn other_algorithm_is_unknown_not_changed() {
        let text = "example.com ecdsa-sha2-nistp256 AAAAE2VjZHNhLXNoYTItbmlzdHAyNTYAAAAIbmlzdHAyNTYAAABBBME2UUPeOwVz6KNpw0BBUsm5cVx8A/rbvqlgs8Pa8B7mqmgcFQjg7WF0XLjEPtqNNP+s7T71neUoA+VDUUHqFqk=\n";
        match check_text(text, "example.com", &key(ED_A)) {
            Verdict::Unknown { other_algorithms } => {
                assert_eq!(other_algorithms, vec!["ecdsa-sha2-nistp256".to_string()])
            }
            other => panic!("unexpected {other:?}"),
        }
    }

    #[test]
    fn append_adds_missing_newline_and_line_is_then_known() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sub/known_hosts");
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, format!("other ssh-ed25519 {ED_B}")).unwrap();
        let line = line_for("127.0.0.1", 2222, &key(ED_A));
        assert!(
            line.starts_with("[127.0.0.1]:2222 ssh-ed25519 AAAA"),
            "{line}"
        );
        append_line(&path, &line).unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        assert_eq!(text.lines().count(), 2);
        assert_eq!(
            check(&path, "127.0.0.1", 2222, &key(ED_A)).unwrap(),
            Verdict::Known
        );
    }
}
