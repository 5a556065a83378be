//! What the kit needs from the machine: the current user, root or not, OpenSSH's version and
//! `ssh-keygen`, and small file helpers that panic with the path.

use std::fs::{self, File};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::{Mutex, MutexGuard};

use super::OPENSSH_CLIENT_HINT;
use crate::tools::{describe, require_tool};

/// Root's sshd refuses to start without its privilege separation directory.
const PRIVSEP_DIR: &str = "/run/sshd";

pub(super) fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|e| e.into_inner())
}

pub(super) fn is_root() -> bool {
    // SAFETY: geteuid(2) cannot fail and has no memory effects.
    unsafe { libc::geteuid() == 0 }
}

pub(super) fn ensure_privsep_dir() {
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
pub(super) fn current_user() -> String {
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
pub(super) fn sshd_version(sshd: &Path) -> (u32, u32) {
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

pub(super) fn ssh_keygen(args: &[&str]) {
    let mut cmd = Command::new(require_tool("ssh-keygen", OPENSSH_CLIENT_HINT));
    cmd.args(args).stdin(Stdio::null());
    run_checked(&mut cmd);
}

/// Runs `cmd` to its end; panics, with its stderr, unless it succeeds.
pub(super) fn run_checked(cmd: &mut Command) -> Output {
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", describe(cmd)));
    if !out.status.success() {
        panic!(
            "{} failed ({}): {}",
            describe(cmd),
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    out
}

/// `SHA256:...` of a public key file, as `ssh-keygen -lf` prints it.
pub(super) fn fingerprint_sha256(public_key: &Path) -> String {
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
pub(super) fn read_public_key(path: &Path) -> String {
    let text =
        fs::read_to_string(path).unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
    let fields: Vec<&str> = text.split_whitespace().take(2).collect();
    if fields.len() != 2 {
        panic!("{} is not an OpenSSH public key: {text}", path.display());
    }
    fields.join(" ")
}

pub(super) fn pub_path(private: &Path) -> PathBuf {
    let mut name = private.as_os_str().to_owned();
    name.push(".pub");
    PathBuf::from(name)
}

pub(super) fn path_str(path: &Path) -> &str {
    path.to_str()
        .unwrap_or_else(|| panic!("path {} is not UTF-8", path.display()))
}

pub(super) fn write_file(path: &Path, contents: &str) {
    File::create(path)
        .and_then(|mut f| f.write_all(contents.as_bytes()))
        .unwrap_or_else(|e| panic!("cannot write {}: {e}", path.display()));
}
