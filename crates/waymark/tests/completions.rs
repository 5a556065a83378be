//! Shell completions and manual pages, generated from the clap definitions: each shell loads
//! them and really completes `waymark` commands; `man` renders the pages.

mod common;

use std::process::Command;
use std::time::Duration;

use common::bin;
use waymark_testkit::{output_within, require_tool};

fn generated(args: &[&str]) -> String {
    let out = output_within(Command::new(bin()).args(args), Duration::from_secs(30));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

fn shell_says(shell: &str, hint: &str, args: &[&str]) -> String {
    let program = require_tool(shell, hint);
    let out = output_within(Command::new(program).args(args), Duration::from_secs(30));
    assert!(
        out.status.success(),
        "{shell} {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

#[test]
fn bash_completes_commands_and_subcommands() {
    let dir = tempfile::tempdir().unwrap();
    let script = dir.path().join("waymark.bash");
    std::fs::write(&script, generated(&["completions", "bash"])).unwrap();
    let complete = |line: &str| {
        let words: Vec<&str> = line.split(' ').collect();
        let program = format!(
            "source '{}'; COMP_WORDS=({}); COMP_CWORD={}; COMP_LINE='{line}'; COMP_POINT=${{#COMP_LINE}}; _waymark waymark '{}' '{}'; printf '%s\\n' \"${{COMPREPLY[@]}}\"",
            script.display(),
            words.iter().map(|w| format!("'{w}'")).collect::<Vec<_>>().join(" "),
            words.len() - 1,
            words[words.len() - 1],
            words[words.len() - 2],
        );
        shell_says(
            "bash",
            "install it (apt-get install bash)",
            &["-c", &program],
        )
    };
    assert!(
        complete("waymark ex").lines().any(|l| l == "exec"),
        "{}",
        complete("waymark ex")
    );
    let exec = complete("waymark exec st");
    assert!(exec.lines().any(|l| l == "status"), "{exec}");
}

#[test]
fn zsh_loads_the_completion_and_registers_it() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("_waymark"),
        generated(&["completions", "zsh"]),
    )
    .unwrap();
    let program = format!(
        "fpath=('{}' $fpath); autoload -Uz compinit; compinit -u -d '{}/zcompdump'; print -r -- ${{_comps[waymark]}}",
        dir.path().display(),
        dir.path().display()
    );
    let out = shell_says(
        "zsh",
        "install it (apt-get install zsh)",
        &["-f", "-c", &program],
    );
    assert_eq!(
        out.trim(),
        "_waymark",
        "zsh registered no completion for waymark"
    );
}

#[test]
fn fish_completes_commands_and_subcommands() {
    let dir = tempfile::tempdir().unwrap();
    let script = dir.path().join("waymark.fish");
    std::fs::write(&script, generated(&["completions", "fish"])).unwrap();
    let complete = |line: &str| {
        let program = format!("source '{}'; complete -C '{line}'", script.display());
        shell_says(
            "fish",
            "install it (apt-get install fish)",
            &["--no-config", "-c", &program],
        )
    };
    let top = complete("waymark ex");
    assert!(top.lines().any(|l| l.starts_with("exec")), "{top}");
    let exec = complete("waymark exec st");
    assert!(exec.lines().any(|l| l.starts_with("status")), "{exec}");
}

#[test]
fn man_renders_the_page_and_writes_one_per_command() {
    let page = generated(&["man"]);
    assert!(page.contains(".TH waymark 1"), "{page}");
    let dir = tempfile::tempdir().unwrap();
    let pages = dir.path().join("man1");
    generated(&["man", "--dir", pages.to_str().unwrap()]);
    for name in [
        "waymark.1",
        "waymark-exec.1",
        "waymark-exec-run.1",
        "waymark-completions.1",
    ] {
        assert!(pages.join(name).exists(), "{name} missing");
    }
    let rendered = shell_says(
        "man",
        "install it (apt-get install man-db)",
        &[
            "-l",
            "-P",
            "cat",
            pages.join("waymark-exec-run.1").to_str().unwrap(),
        ],
    );
    assert!(rendered.contains("--key"), "{rendered}");
}

/// The script generated for a configuration offers its tools after `exec run` and its hosts
/// after `--host` (as configured when it was generated).
#[test]
fn bash_completes_the_configured_tools_and_hosts() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("waymark.toml");
    std::fs::write(
        &config,
        r#"
[hosts.web1]
address = "127.0.0.1"
user = "deploy"
credential = "deploy"

[credentials.deploy]
key_file = "~/.ssh/id_ed25519"

[tools.restart_app]
description = "Restart the app."
hosts = ["web1"]
argv = ["true"]
contract = "read_only"
"#,
    )
    .unwrap();
    let script = dir.path().join("waymark.bash");
    let config_arg = config.display().to_string();
    std::fs::write(
        &script,
        generated(&["--config", &config_arg, "completions", "bash"]),
    )
    .unwrap();
    let complete = |words: &[&str]| {
        let program = format!(
            "source '{}'; COMP_WORDS=({}); COMP_CWORD={}; _waymark waymark '{}' '{}'; printf '%s\\n' \"${{COMPREPLY[@]}}\"",
            script.display(),
            words.iter().map(|w| format!("'{w}'")).collect::<Vec<_>>().join(" "),
            words.len() - 1,
            words[words.len() - 1],
            words[words.len() - 2],
        );
        shell_says(
            "bash",
            "install it (apt-get install bash)",
            &["-c", &program],
        )
    };
    let tools = complete(&["waymark", "exec", "run", "re"]);
    assert!(tools.lines().any(|l| l == "restart_app"), "{tools}");
    let hosts = complete(&["waymark", "exec", "run", "restart_app", "--host", "w"]);
    assert!(hosts.lines().any(|l| l == "web1"), "{hosts}");
}
