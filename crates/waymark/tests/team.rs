//! Waymark deployed for a team: the daemon as its own user (here root, as CI runs), agents and
//! operators as other Unix users created for the test, reaching it through a group socket.
//! Real users, a real group, real file modes; each user is removed after.

mod common;

use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::process::{Command, Output, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use common::{stderr, stdout, wait_for, Env, APPEND_TOOL, GUARDED_ECHO_TOOL, PEEK_TOOL};

/// A Unix group and users made for one test, removed when dropped.
struct Accounts {
    group: String,
    gid: u32,
    users: Vec<(String, u32)>,
}

static NEXT: AtomicU32 = AtomicU32::new(0);

fn run_ok(cmd: &mut Command) {
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("{cmd:?}: {e} (install passwd: apt-get install passwd)"));
    assert!(out.status.success(), "{cmd:?}: {}", stderr(&out));
}

impl Accounts {
    /// A group and one user per role, all in the group. Needs root (CI runs as root).
    fn new(roles: &[&str]) -> Accounts {
        assert_eq!(
            unsafe { libc::geteuid() },
            0,
            "this test creates Unix users and groups: run the suite as root (CI does)"
        );
        let tag = format!(
            "{}{}",
            std::process::id() % 100_000,
            NEXT.fetch_add(1, Ordering::Relaxed)
        );
        let group = format!("wmg{tag}");
        run_ok(Command::new("groupadd").arg(&group));
        let gid = waymark_gateway::config::lookup_group(&group).unwrap().id;
        let mut accounts = Accounts {
            group,
            gid,
            users: Vec::new(),
        };
        for role in roles {
            let name = format!("wm{role}{tag}");
            run_ok(Command::new("useradd").args([
                "--no-create-home",
                "--no-user-group",
                "--gid",
                &accounts.group,
                "--shell",
                "/usr/sbin/nologin",
                &name,
            ]));
            let uid = waymark_gateway::config::lookup_user(&name).unwrap().id;
            accounts.users.push((name, uid));
        }
        accounts
    }

    fn user(&self, role: &str) -> (&str, u32) {
        let (name, uid) = self
            .users
            .iter()
            .find(|(n, _)| n.starts_with(&format!("wm{role}")))
            .unwrap();
        (name, *uid)
    }
}

impl Drop for Accounts {
    fn drop(&mut self) {
        for (name, _) in &self.users {
            let _ = Command::new("userdel").arg(name).output();
        }
        let _ = Command::new("groupdel").arg(&self.group).output();
    }
}

/// `waymark ARGS` as Unix user `uid` (primary group `gid`, no other group), echoed.
fn as_user(env: &Env, uid: u32, gid: u32, args: &[&str]) -> Output {
    let mut cmd = env.cmd();
    cmd.args(args)
        .env("HOME", "/tmp")
        .env_remove("XDG_RUNTIME_DIR")
        .uid(uid)
        .gid(gid);
    let out = cmd.output().unwrap();
    eprintln!(
        "$ [uid {uid}] waymark {}\n[exit {:?}]\n{}{}",
        args.join(" "),
        out.status.code(),
        stdout(&out),
        stderr(&out)
    );
    out
}

/// `waymark exec run guarded LINE` as Unix user `uid`, left waiting for its approval: the
/// process, and the execution ID (the only one awaiting approval).
fn awaiting_approval(env: &Env, uid: u32, gid: u32, line: &str) -> (std::process::Child, String) {
    let child = env
        .cmd()
        .args(["exec", "run", "guarded", line])
        .env("HOME", "/tmp")
        .uid(uid)
        .gid(gid)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    wait_for(
        || env.pending().len() == 1,
        &format!("uid {uid}'s call to await approval"),
        Duration::from_secs(30),
    );
    let id = env.pending()[0].clone();
    (child, id)
}

/// The test's directory is traversable by the agents (the config readable), as a team's
/// `/etc/waymark` would be; the ledger and keys stay the daemon's.
fn open_to_agents(env: &Env) {
    std::fs::set_permissions(env.dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    std::fs::set_permissions(&env.config, std::fs::Permissions::from_mode(0o644)).unwrap();
}

#[test]
fn agents_and_operators_as_unix_users_get_their_rights_through_a_group_socket() {
    let accounts = Accounts::new(&["agent", "ops", "stranger"]);
    let (agent, agent_uid) = accounts.user("agent");
    let (_, ops_uid) = accounts.user("ops");
    let (_, stranger_uid) = accounts.user("stranger");
    let gid = accounts.gid;
    let env = Env::builder()
        .extra_hosts(1)
        .daemon_settings(&format!("socket_group = \"{}\"", accounts.group))
        .tools(APPEND_TOOL)
        .tools(PEEK_TOOL)
        .tools(GUARDED_ECHO_TOOL)
        .tools(&format!(
            r#"
[policy]
raw_commands = ["h1", "h2"]

[actors.agent]
unix_user = "{agent}"
tools = ["append", "guarded", "ssh_exec"]
hosts = ["h1"]

[actors.ops]
unix_user = "{ops_uid}"
tools = ["*"]
operator = true
"#
        ))
        .build();
    open_to_agents(&env);
    let _daemon = env.start_daemon();

    // The socket and its directory let the group in, and no one else.
    let socket_dir = env.socket().parent().unwrap().to_path_buf();
    let mode = |p: &std::path::Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode(&socket_dir), 0o750);
    assert_eq!(mode(&env.socket()), 0o660);
    use std::os::unix::fs::MetadataExt;
    assert_eq!(std::fs::metadata(env.socket()).unwrap().gid(), gid);

    // The agent cannot read the key the daemon uses.
    let key = env.sshd.user_key_path().to_path_buf();
    let cat = Command::new("cat")
        .arg(&key)
        .uid(agent_uid)
        .gid(gid)
        .stdout(Stdio::null())
        .output()
        .unwrap();
    assert!(!cat.status.success(), "the agent read the SSH key {key:?}");

    // The daemon knows who it is.
    let who = as_user(&env, agent_uid, gid, &["whoami"]);
    assert_eq!(who.status.code(), Some(0));
    assert!(
        stdout(&who).starts_with("actor agent (via socket)"),
        "{}",
        stdout(&who)
    );

    // Its allowed tool runs.
    let ok = as_user(
        &env,
        agent_uid,
        gid,
        &["exec", "run", "append", "line=a", "secs=0"],
    );
    assert_eq!(ok.status.code(), Some(0), "{}", stderr(&ok));
    assert_eq!(env.counter_lines(), ["a"]);
    let before = env.executions().len();

    // A forbidden tool and a forbidden host are refused before anything is accepted, with
    // the actor and the rule, and audited.
    let tool = as_user(&env, agent_uid, gid, &["exec", "run", "peek"]);
    assert_eq!(tool.status.code(), Some(2));
    assert!(
        stderr(&tool).contains("actor agent")
            && stderr(&tool).contains("not in actors.agent.tools"),
        "{}",
        stderr(&tool)
    );
    let host = as_user(
        &env,
        agent_uid,
        gid,
        &[
            "exec",
            "run",
            "--host",
            "h2",
            "--",
            "sh",
            "-c",
            "echo x >> counter",
        ],
    );
    assert_eq!(host.status.code(), Some(2));
    assert!(
        stderr(&host).contains("host \"h2\" is not in actors.agent.hosts"),
        "{}",
        stderr(&host)
    );
    assert_eq!(
        env.executions().len(),
        before,
        "a refused call was accepted"
    );
    assert!(env.host_counter_lines(2).is_empty(), "h2 was touched");
    assert!(
        !env.host_sshd(2).remote_home().join(".waymark").exists(),
        "the wrapper reached h2"
    );
    let refused = env.run(&["--json", "audit", "refused"]);
    let refused: serde_json::Value = serde_json::from_slice(&refused.stdout).unwrap();
    let items = refused["items"].as_array().unwrap();
    assert_eq!(items.len(), 2, "{refused}");
    assert_eq!(items[0]["host"], "h2");
    assert_eq!(items[0]["tool"], "ssh_exec");
    assert!(items[0]["fingerprint"]
        .as_str()
        .unwrap()
        .starts_with("hmac-sha256:"));
    assert_eq!(items[1]["tool"], "peek");
    assert_eq!(items[1]["actor"], "agent");
    assert!(items[1]["fingerprint"]
        .as_str()
        .unwrap()
        .starts_with("hmac-sha256:"));
    // ... and an agent may not read the audit chain.
    let audit = as_user(&env, agent_uid, gid, &["audit", "refused"]);
    assert_eq!(audit.status.code(), Some(2));

    // A user no actor names is refused at connect.
    let stranger = as_user(&env, stranger_uid, gid, &["exec", "list"]);
    assert_eq!(stranger.status.code(), Some(2));
    assert!(
        stderr(&stranger).contains("is no configured actor"),
        "{}",
        stderr(&stranger)
    );

    // The agent's call that needs approval: the agent cannot approve it, the operator can.
    let (waiting, id) = awaiting_approval(&env, agent_uid, gid, "line=g");
    let self_approve = as_user(&env, agent_uid, gid, &["approve", &id]);
    assert_eq!(self_approve.status.code(), Some(2));
    assert!(
        stderr(&self_approve).contains("is for operators"),
        "{}",
        stderr(&self_approve)
    );
    let approve = as_user(&env, ops_uid, gid, &["approve", &id]);
    assert_eq!(approve.status.code(), Some(0), "{}", stderr(&approve));
    let waited = waiting.wait_with_output().unwrap();
    assert_eq!(waited.status.code(), Some(0), "{}", stderr(&waited));
    assert!(stdout(&waited).contains('g'));

    // An operator may not approve its own call either (no self_approve).
    let (own, own_id) = awaiting_approval(&env, ops_uid, gid, "line=o");
    let own_approve = as_user(&env, ops_uid, gid, &["approve", &own_id]);
    assert_eq!(own_approve.status.code(), Some(2));
    assert!(
        stderr(&own_approve).contains("own call"),
        "{}",
        stderr(&own_approve)
    );

    // Another actor's execution does not exist for the agent; the operator sees it.
    let status = as_user(&env, agent_uid, gid, &["exec", "status", &own_id]);
    assert_eq!(status.status.code(), Some(2));
    assert!(
        stderr(&status).contains("is not in the ledger"),
        "{}",
        stderr(&status)
    );
    let agents_list = as_user(&env, agent_uid, gid, &["--json", "exec", "list"]);
    let listed: serde_json::Value = serde_json::from_slice(&agents_list.stdout).unwrap();
    assert!(
        listed["items"]
            .as_array()
            .unwrap()
            .iter()
            .all(|i| i["actor"] == "agent"),
        "{listed}"
    );
    // The daemon's own user (root here) holds every right: it denies the operator's call.
    let deny = env.run(&["deny", &own_id, "--reason", "not now"]);
    assert_eq!(deny.status.code(), Some(0));
    let _ = own.wait_with_output().unwrap();
    let ops_status = as_user(&env, ops_uid, gid, &["exec", "status", &id]);
    assert_eq!(ops_status.status.code(), Some(0), "{}", stderr(&ops_status));
}

/// `config check` says, at the credential's line, when a key the daemon uses can be read by
/// others than its owner, and when an actor's Unix user could read it.
#[test]
fn config_check_warns_of_a_credential_an_agent_could_read() {
    use std::os::unix::fs::PermissionsExt;
    let accounts = Accounts::new(&["reader"]);
    let (reader, _) = accounts.user("reader");
    let dir = tempfile::tempdir().unwrap();
    let key = dir.path().join("id_ed25519");
    std::fs::write(&key, "not a real key").unwrap();
    std::os::unix::fs::chown(&key, None, Some(accounts.gid)).unwrap();
    std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o640)).unwrap();
    let config = dir.path().join("waymark.toml");
    let text = format!(
        r#"[ledger]
path = "{ledger}"

[credentials.k]
key_file = "{key}"

[hosts.h1]
address = "127.0.0.1"
user = "ops"
credential = "k"
known_hosts = "{known_hosts}"

[tools.t]
description = "d"
hosts = ["h1"]
argv = ["true"]
contract = "idempotent"

[actors.reader]
unix_user = "{reader}"
tools = ["t"]
"#,
        ledger = dir.path().join("ledger").display(),
        key = key.display(),
        known_hosts = dir.path().join("known_hosts").display()
    );
    std::fs::write(dir.path().join("known_hosts"), "").unwrap();
    std::fs::write(&config, &text).unwrap();
    let check = |cfg: &std::path::Path| {
        let out = Command::new(common::bin())
            .arg("--config")
            .arg(cfg)
            .args(["--json", "config", "check"])
            .output()
            .unwrap();
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        (out.status.code(), v)
    };
    let (code, v) = check(&config);
    assert_eq!(code, Some(0), "{v}");
    let warnings: Vec<&str> = v["warnings"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| w.as_str().unwrap())
        .collect();
    let line = text.lines().position(|l| l == "[credentials.k]").unwrap() + 1;
    let at = format!("{}:{line}:", config.display());
    assert!(
        warnings
            .iter()
            .any(|w| w.starts_with(&at) && w.contains("mode 640")),
        "{warnings:?}"
    );
    assert!(
        warnings.iter().any(
            |w| w.starts_with(&at) && w.contains(&format!("actor reader's Unix user {reader}"))
        ),
        "{warnings:?}"
    );
    // 0600, owned by the daemon's user: nothing to say.
    std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o600)).unwrap();
    let (_, v) = check(&config);
    assert!(
        v["warnings"]
            .as_array()
            .unwrap()
            .iter()
            .all(|w| !w.as_str().unwrap().contains("credentials.k")),
        "{v}"
    );
}

/// The agent's MCP configuration stays `waymark mcp`: the shim, run as the agent's Unix user,
/// reaches the daemon through the group socket, lists the agent's tools only, and a tool
/// outside its rights is a JSON-RPC error naming the actor and the rule.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agents_stdio_shim_reaches_the_daemon_through_the_group_socket() {
    use rmcp::ServiceExt;
    common::bounded(async {
        let accounts = Accounts::new(&["shim"]);
        let (agent, agent_uid) = accounts.user("shim");
        let env = Env::builder()
            .daemon_settings(&format!("socket_group = \"{}\"", accounts.group))
            .tools(APPEND_TOOL)
            .tools(PEEK_TOOL)
            .tools(&format!(
                "[actors.shim]\nunix_user = \"{agent}\"\ntools = [\"append\"]\n"
            ))
            .build();
        open_to_agents(&env);
        let _daemon = env.start_daemon();
        let mut cmd = tokio::process::Command::new(common::bin());
        cmd.arg("--config")
            .arg(&env.config)
            .arg("mcp")
            .env("WAYMARK_LOG", "warn")
            .env("HOME", "/tmp")
            .uid(agent_uid)
            .gid(accounts.gid);
        let client =
            ().serve(rmcp::transport::TokioChildProcess::new(cmd).unwrap())
                .await
                .expect("MCP initialize as the agent's user");
        let tools: Vec<String> = client
            .list_all_tools()
            .await
            .unwrap()
            .into_iter()
            .map(|t| t.name.to_string())
            .collect();
        assert!(tools.contains(&"append".to_string()), "{tools:?}");
        assert!(!tools.contains(&"peek".to_string()), "{tools:?}");
        let r = client
            .call_tool(common::call(
                "append",
                serde_json::json!({"line": "m", "secs": 0}),
            ))
            .await
            .unwrap();
        assert_eq!(common::structured(&r)["actor"], "shim");
        let refused = client
            .call_tool(common::call("peek", serde_json::json!({})))
            .await
            .expect_err("peek ran for an actor without it")
            .to_string();
        assert!(
            refused.contains("actor shim") && refused.contains("not in actors.shim.tools"),
            "{refused}"
        );
        assert_eq!(env.counter_lines(), ["m"]);
        client.cancel().await.unwrap();
    })
    .await;
}

/// An actor named by `unix_group` is whoever is in that group when it connects, by its
/// supplementary groups too (SO_PEERGROUPS), not only its primary one; out of the group, the
/// socket itself (0660) keeps it out.
#[test]
fn a_member_of_an_actors_group_is_that_actor_by_its_supplementary_groups() {
    let setpriv =
        waymark_testkit::require_tool("setpriv", "install it (apt-get install util-linux)");
    let accounts = Accounts::new(&["member"]);
    let (_, uid) = accounts.user("member");
    let env = Env::builder()
        .daemon_settings(&format!("socket_group = \"{}\"", accounts.group))
        .tools(APPEND_TOOL)
        .tools(&format!(
            "[actors.crew]\nunix_group = \"{}\"\ntools = [\"append\"]\n",
            accounts.group
        ))
        .build();
    open_to_agents(&env);
    let _daemon = env.start_daemon();
    let nogroup = waymark_gateway::config::lookup_group("nogroup").map_or(65534, |g| g.id);
    let whoami = |groups: &[&str]| {
        let out = Command::new(&setpriv)
            .args(["--reuid", &uid.to_string(), "--regid", &nogroup.to_string()])
            .args(groups)
            .arg(common::bin())
            .arg("--config")
            .arg(&env.config)
            .arg("whoami")
            .env("HOME", "/tmp")
            .env("WAYMARK_LOG", "warn")
            .stdin(Stdio::null())
            .output()
            .unwrap();
        eprintln!(
            "{groups:?}: [exit {:?}] {}{}",
            out.status.code(),
            stdout(&out),
            stderr(&out)
        );
        out
    };
    // Primary group nogroup, the actor's group only as a supplementary one.
    let member = whoami(&["--groups", &accounts.gid.to_string()]);
    assert_eq!(member.status.code(), Some(0), "{}", stderr(&member));
    assert!(
        stdout(&member).starts_with("actor crew (via socket)"),
        "{}",
        stdout(&member)
    );
    let outsider = whoami(&["--clear-groups"]);
    assert_ne!(outsider.status.code(), Some(0), "{}", stdout(&outsider));
}
