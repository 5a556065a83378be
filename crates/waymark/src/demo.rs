//! `waymark demo`: the whole story on a fresh machine, in about twenty seconds.
//!
//! An embedded SSH server stands in for a host (loopback, throwaway keys, commands run with the
//! local `sh` in a temp directory). Between Waymark and it sits a small TCP relay that the demo
//! cuts mid-command, as a flaky network would. Then: `exec status` finds the true outcome,
//! a retry of the same call attaches instead of running again (the host-side log proves it),
//! `exec explain` tells the story, and `audit verify` checks the chain.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::{json, Map, Value};
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream};
use waymark_core::{Delivery, IntentScope};
use waymark_demo::{ClientKey, EmbeddedServer, EmbeddedServerOptions};
use waymark_gateway::config::{Config, DefaultPaths};
use waymark_gateway::flow::{describe, Audience, Gateway, NoEvents};
use waymark_gateway::ssh_hosts::SshHosts;
use waymark_gateway::tools::{resolve, CallContext};
use waymark_ledger::{Ledger, LedgerApi};

use crate::service::{self, Caller, Peer};

/// A TCP relay whose live connections can be cut at once.
struct Relay {
    addr: SocketAddr,
    live: Arc<Mutex<Vec<tokio::task::AbortHandle>>>,
}

impl Relay {
    async fn start(target: SocketAddr) -> std::io::Result<Relay> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let live: Arc<Mutex<Vec<tokio::task::AbortHandle>>> = Arc::default();
        let tasks = live.clone();
        tokio::spawn(async move {
            while let Ok((mut inbound, _)) = listener.accept().await {
                let task = tokio::spawn(async move {
                    if let Ok(mut outbound) = TcpStream::connect(target).await {
                        let _ = inbound.set_nodelay(true);
                        let _ = outbound.set_nodelay(true);
                        let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                        let _ = outbound.shutdown().await;
                    }
                });
                tasks.lock().expect("relay").push(task.abort_handle());
            }
        });
        Ok(Relay { addr, live })
    }

    /// Drops every live connection (both sockets close), as a dead network path would.
    fn cut_all(&self) {
        for t in self.live.lock().expect("relay").drain(..) {
            t.abort();
        }
    }
}

/// A step's title: bold on a terminal, plain text into a pipe or a file.
fn say(text: &str) {
    if std::io::IsTerminal::is_terminal(&std::io::stdout()) {
        outln!("\n\x1b[1m▶ {text}\x1b[0m");
    } else {
        outln!("\n▶ {text}");
    }
}

fn show(text: &str) {
    for line in text.lines() {
        outln!("    {line}");
    }
}

fn host_log(home: &Path) -> Vec<String> {
    std::fs::read_to_string(home.join("deployments.log"))
        .unwrap_or_default()
        .lines()
        .map(str::to_string)
        .collect()
}

pub async fn run() -> Result<(), String> {
    let dir = tempfile::Builder::new()
        .prefix("waymark-demo-")
        .tempdir()
        .map_err(|e| e.to_string())?;
    let home = dir.path().join("host-home");
    std::fs::create_dir_all(&home).map_err(|e| e.to_string())?;
    let key = dir.path().join("id_ed25519");
    say("Starting a throwaway SSH host on loopback (embedded server, generated keys)");
    let server = EmbeddedServer::start(EmbeddedServerOptions::new(
        &home,
        ClientKey::Generate(key.clone()),
    ))
    .await
    .map_err(|e| e.to_string())?;
    let relay = Relay::start(server.addr())
        .await
        .map_err(|e| e.to_string())?;
    let known_hosts = dir.path().join("known_hosts");
    std::fs::write(
        &known_hosts,
        format!(
            "[127.0.0.1]:{} {}\n",
            relay.addr.port(),
            server.host_key_openssh()
        ),
    )
    .map_err(|e| e.to_string())?;
    show(&format!(
        "host key {} pinned in a throwaway known_hosts",
        server.host_key_fingerprint_sha256()
    ));
    show(&format!(
        "Waymark reaches it through a relay on {} that the demo will cut",
        relay.addr
    ));

    let config_text = format!(
        r#"[ledger]
path = "{ledger}"

[credentials.demo]
key_file = "{key}"

[hosts.demo]
address = "127.0.0.1"
port = {port}
user = "demo"
credential = "demo"
known_hosts = "{kh}"

[tools.deploy]
description = "Deploy a release: appends to the host's deployments.log, then takes a few seconds."
hosts = ["demo"]
argv = ["sh", "-c", "echo \"deploy $1 pid $$\" >> \"$HOME/deployments.log\"; sleep 3; echo \"release $1 is live\"", "deploy", "{{release}}"]
contract = "status_check"
retry_window = "10m"
timeout = "60s"

[tools.deploy.args.release]
type = "string"
pattern = "v[0-9]+(\\.[0-9]+)*"
"#,
        ledger = dir.path().join("ledger").display(),
        key = key.display(),
        port = relay.addr.port(),
        kh = known_hosts.display(),
    );
    let config_path = dir.path().join("waymark.toml");
    std::fs::write(&config_path, &config_text).map_err(|e| e.to_string())?;
    let defaults = DefaultPaths::from_env(|k| std::env::var(k).ok(), unsafe { libc::geteuid() });
    let config =
        Arc::new(Config::parse(&config_path, &config_text, &defaults).map_err(|e| e.to_string())?);
    let ledger: Arc<dyn LedgerApi> =
        Arc::new(Ledger::init(&config.ledger_path).map_err(|e| e.to_string())?);
    let mut hosts = SshHosts::new(config.clone());
    hosts.keepalive_interval = Duration::from_secs(1);
    hosts.keepalive_max = 2;
    let gateway = Arc::new(Gateway::new(config.clone(), ledger, Arc::new(hosts)));

    let caller = Caller::of_peer(&Peer::this_process(), &config)?;
    let call = || {
        let mut args = Map::new();
        args.insert("release".into(), Value::String("v2.4.1".into()));
        let ctx = CallContext {
            actor: caller.actor.clone(),
            scope: IntentScope::ToolWindow,
            delivery: Delivery {
                jsonrpc_id: Some(json!(7)),
                ..Default::default()
            },
        };
        resolve(&config, "deploy", &args, ctx).map_err(|e| e.to_string())
    };

    say("An agent calls the tool `deploy release=v2.4.1`");
    let session = |name: &'static str| {
        let (ledger, actor) = (gateway.ledger().clone(), caller.actor.clone());
        async move {
            ledger
                .start_run(
                    actor,
                    name,
                    waymark_gateway::flow::now(),
                    waymark_ledger::Durability::Flushed,
                )
                .await
                .map(|r| r.id)
                .map_err(|e| e.to_string())
        }
    };
    let first_run = session("mcp: agent session 1 (before the drop)").await?;
    let first = {
        let gateway = gateway.clone();
        let c = call()?;
        tokio::spawn(async move { gateway.call(c, Some(first_run), &NoEvents).await })
    };
    // Wait for the command to be running on the host, then cut the network.
    for _ in 0..100 {
        if !host_log(&home).is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    show(&format!("host log now: {:?}", host_log(&home)));
    say("The network drops mid-command (the relay cuts every connection)");
    relay.cut_all();
    let outcome = first
        .await
        .map_err(|e| e.to_string())?
        .map_err(|e| e.to_string())?;
    let id = outcome.record.id;
    show(&format!("execution {id}: state {}", outcome.record.state()));
    show(&outcome.message(Audience::Cli));

    say(&format!(
        "The operator asks what really happened: waymark exec status {id}"
    ));
    let (o, _) = gateway.status(id).await.map_err(|e| e.to_string())?;
    show(&service::status_text(&o.record, false));
    for _ in 0..80 {
        let (o, _) = gateway.status(id).await.map_err(|e| e.to_string())?;
        if o.record.state().has_result() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    say(&format!("A few seconds later: waymark exec status {id}"));
    let (o, _) = gateway.status(id).await.map_err(|e| e.to_string())?;
    show(&service::status_text(&o.record, false));

    say("The agent retries the very same call (new JSON-RPC id, same intent)");
    let mut retry_call = call()?;
    if let Some(request) = retry_call.ssh_request_mut() {
        request.delivery.jsonrpc_id = Some(json!("retry-1"));
    }
    let retry_run = session("mcp: agent session 2 (reconnected)").await?;
    let retry = gateway
        .call(retry_call, Some(retry_run), &NoEvents)
        .await
        .map_err(|e| e.to_string())?;
    let delivered = gateway
        .delivered(retry.record.id)
        .await
        .map_err(|e| e.to_string())?;
    show(&format!(
        "execution {}: {}",
        retry.record.id,
        describe(&delivered, retry.attached, Audience::Cli)
    ));
    if let Some(r) = &retry.result {
        show(&format!(
            "output: {}",
            String::from_utf8_lossy(&r.stdout.head).trim_end()
        ));
    }
    let log = host_log(&home);
    show(&format!(
        "host deployments.log has {} line(s): {:?}",
        log.len(),
        log
    ));
    if log.len() != 1 || retry.record.id != id {
        return Err(format!(
            "the demo expected exactly one run under one id; the host log says {log:?}"
        ));
    }
    show("One intent, one execution id, one run on the host.");

    say(&format!("The incident view: waymark exec explain {id}"));
    let (text, _) = service::explain(gateway.ledger().as_ref(), id).await?;
    show(&text);

    say("waymark audit verify");
    if let crate::protocol::Frame::Done { text, .. } =
        service::audit_verify(gateway.ledger().as_ref(), None, None, &|_, _| {}).await
    {
        show(&text);
    }
    outln!(
        "\nDone. Everything lived in {} and is removed now.",
        dir.path().display()
    );
    server.shutdown().await;
    Ok(())
}
