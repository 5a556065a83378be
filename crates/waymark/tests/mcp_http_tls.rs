//! MCP over Streamable HTTP beyond loopback, only with TLS, end to end: a real OpenSSH sshd
//! (testkit), a real daemon listening on `0.0.0.0` with a certificate made here by a test CA
//! (rcgen), and rmcp's own Streamable HTTP client on a reqwest client that trusts that CA and
//! reaches the daemon through a name that is not a loopback one. The refusals are the daemon's
//! and `config check`'s own: plain HTTP off loopback, a key file others can read, a file that
//! holds no certificate. What a client that is no TLS client sends to the port costs its own
//! connection only.
//!
//! Every connection goes to 127.0.0.1: listening on `0.0.0.0` is what is tested, not reaching
//! the daemon from another machine.

mod common;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use common::*;
use rmcp::transport::streamable_http_client::StreamableHttpClientTransportConfig;
use rmcp::transport::StreamableHttpClientTransport;
use rmcp::ServiceExt;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName};
use serde_json::json;

const TOKEN: &str = "t0ken-for-the-mcp-https-suite";

/// The name the certificate is for; the clients resolve it to 127.0.0.1 themselves.
const NAME: &str = "waymark.test";

/// A test CA, a certificate for [`NAME`] it signed, the chain file (leaf, then CA) and the
/// key file (0600), and the token file (0600).
struct Files {
    _dir: tempfile::TempDir,
    ca_pem: String,
    cert: PathBuf,
    key: PathBuf,
    token: PathBuf,
}

fn files() -> Files {
    use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, IsCa, KeyPair};
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca_params
        .distinguished_name
        .push(rcgen::DnType::CommonName, "waymark test CA");
    let ca = CertifiedIssuer::self_signed(ca_params, KeyPair::generate().unwrap()).unwrap();
    let leaf_key = KeyPair::generate().unwrap();
    let leaf = CertificateParams::new(vec![NAME.to_string()])
        .unwrap()
        .signed_by(&leaf_key, &ca)
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let cert = dir.path().join("cert.pem");
    let key = dir.path().join("key.pem");
    let token = dir.path().join("agent.token");
    std::fs::write(&cert, format!("{}{}", leaf.pem(), ca.pem())).unwrap();
    std::fs::write(&key, leaf_key.serialize_pem()).unwrap();
    std::fs::write(&token, TOKEN).unwrap();
    for f in [&key, &token] {
        std::fs::set_permissions(f, std::fs::Permissions::from_mode(0o600)).unwrap();
    }
    Files {
        ca_pem: ca.pem(),
        _dir: dir,
        cert,
        key,
        token,
    }
}

/// A port that was free on every address a moment ago: as the other HTTP suites do
/// (`free_port`), the daemon binds it later, here on `0.0.0.0`.
fn free_port_on_all_addresses() -> u16 {
    std::net::TcpListener::bind("0.0.0.0:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// The `[daemon]` lines: MCP over HTTP on `0.0.0.0:port`, with TLS when `tls`.
fn settings(f: &Files, port: u16, tls: bool) -> String {
    let mut s = format!(
        "http_listen = \"0.0.0.0:{port}\"\nhttp_token_file = \"{}\"\n",
        f.token.display()
    );
    if tls {
        s.push_str(&format!(
            "tls_cert = \"{}\"\ntls_key = \"{}\"\n",
            f.cert.display(),
            f.key.display()
        ));
    }
    s
}

/// A daemon serving MCP over HTTPS on `0.0.0.0:port`, its log in `log`.
struct Https {
    env: Env,
    daemon: Daemon,
    files: Files,
    port: u16,
    log: PathBuf,
}

fn https() -> Https {
    let files = files();
    let port = free_port_on_all_addresses();
    let env = Env::builder()
        .daemon_settings(&settings(&files, port, true))
        .tools(APPEND_TOOL)
        .build();
    let log = env.dir.path().join("daemon.log");
    let daemon = env.start_daemon_with(
        &[("WAYMARK_LOG", "info")],
        Stdio::from(std::fs::File::create(&log).unwrap()),
    );
    wait_for(
        || TcpStream::connect(("127.0.0.1", port)).is_ok(),
        "the HTTPS endpoint to listen",
        Duration::from_secs(20),
    );
    Https {
        env,
        daemon,
        files,
        port,
        log,
    }
}

/// A TLS client configuration with ring, trusting `ca_pem` only (none: trusting nothing).
fn client_tls(ca_pem: Option<&str>, alpn: &[&[u8]]) -> rustls::ClientConfig {
    let mut roots = rustls::RootCertStore::empty();
    if let Some(pem) = ca_pem {
        roots
            .add(CertificateDer::from_pem_slice(pem.as_bytes()).unwrap())
            .unwrap();
    }
    let mut config = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_root_certificates(roots)
    .with_no_client_auth();
    config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    config
}

impl Https {
    fn url(&self) -> String {
        format!("https://{NAME}:{}/mcp", self.port)
    }

    /// rmcp's Streamable HTTP client on a reqwest client that trusts `ca_pem` and resolves
    /// [`NAME`] to 127.0.0.1 (so the request's `Host` is not a loopback name).
    fn transport(&self, ca_pem: Option<&str>) -> StreamableHttpClientTransport<reqwest::Client> {
        let client = reqwest::Client::builder()
            .tls_backend_preconfigured(client_tls(ca_pem, &[b"http/1.1"]))
            .resolve(NAME, SocketAddr::from(([127, 0, 0, 1], self.port)))
            .build()
            .unwrap();
        StreamableHttpClientTransport::with_client(
            client,
            StreamableHttpClientTransportConfig::with_uri(self.url()).auth_header(TOKEN),
        )
    }

    /// Lists the tools and calls `append` with `line` over TLS; the host ran it once and the
    /// result was delivered with its response.
    async fn list_and_call(&self, line: &str) {
        let client =
            ().serve(self.transport(Some(&self.files.ca_pem)))
                .await
                .expect("MCP initialize over HTTPS");
        let tools = client.list_all_tools().await.unwrap();
        assert!(
            tools.iter().any(|t| t.name == "append"),
            "append is listed: {tools:?}"
        );
        let r = client
            .call_tool(call("append", json!({"line": line, "secs": 0})))
            .await
            .unwrap();
        assert_eq!(structured(&r)["state"], "completed", "{r:?}");
        wait_delivered(&self.env, structured(&r)["id"].as_str().unwrap()).await;
        client.cancel().await.unwrap();
        assert_eq!(
            self.env
                .counter_lines()
                .iter()
                .filter(|l| *l == line)
                .count(),
            1,
            "{line} ran once: {:?}",
            self.env.counter_lines()
        );
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_mcp_client_over_tls_lists_and_calls_a_tool_on_a_non_loopback_address() {
    bounded(async {
        let h = https();
        h.list_and_call("over-tls").await;
        let url = format!("url=https://0.0.0.0:{}/mcp", h.port);
        assert!(h.log().contains(&url), "the log names {url}:\n{}", h.log());
    })
    .await
}

/// What a client that is no TLS client sends: the server's answer, or what it closed with.
fn send_raw(port: u16, bytes: &[u8]) -> Vec<u8> {
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    s.write_all(bytes).unwrap();
    let mut answer = Vec::new();
    // The server ends the connection (an alert at most); a read that times out means it kept
    // it open, which the caller's asserts then show.
    let _ = s.read_to_end(&mut answer);
    answer
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plain_http_garbage_and_stalled_handshakes_on_the_tls_port_cost_only_their_connection() {
    bounded(async {
        let mut h = https();
        // A client that connects and never says anything: its handshake waits on its own
        // task, so another client's handshake goes through while it stays open (the server
        // gives it 10 s; a handshake served after it would come only once it was closed).
        let stalled = TcpStream::connect(("127.0.0.1", h.port)).unwrap();
        // ALPN settles on HTTP/1.1, though h2 is offered first.
        let tls_handshake = || async {
            let tcp = tokio::net::TcpStream::connect(("127.0.0.1", h.port))
                .await
                .unwrap();
            let tls = tokio_rustls::TlsConnector::from(Arc::new(client_tls(
                Some(&h.files.ca_pem),
                &[b"h2", b"http/1.1"],
            )))
            .connect(ServerName::try_from(NAME).unwrap(), tcp)
            .await
            .expect("a TLS handshake");
            assert_eq!(tls.get_ref().1.alpn_protocol(), Some(&b"http/1.1"[..]));
        };
        tls_handshake().await;
        stalled.set_nonblocking(true).unwrap();
        let still_open = match (&stalled).read(&mut [0u8; 1]) {
            Err(e) => e.kind() == std::io::ErrorKind::WouldBlock,
            Ok(_) => false,
        };
        assert!(
            still_open,
            "a handshake went through only once the stalled client was dropped"
        );

        // Plain HTTP: never answered in plain HTTP.
        let plain = format!(
            "POST /mcp HTTP/1.1\r\nHost: 127.0.0.1:{}\r\nAuthorization: Bearer {TOKEN}\r\n\
             Content-Type: application/json\r\nContent-Length: 2\r\n\r\n{{}}",
            h.port
        );
        let answer = tokio::task::spawn_blocking({
            let port = h.port;
            move || send_raw(port, plain.as_bytes())
        })
        .await
        .unwrap();
        assert!(
            !answer.starts_with(b"HTTP/"),
            "plain HTTP got a plain answer: {:?}",
            String::from_utf8_lossy(&answer)
        );
        // Garbage: 64 KiB of bytes that are no TLS record.
        let garbage: Vec<u8> = (0..65536u32)
            .map(|i| (i.wrapping_mul(2654435761) >> 13) as u8)
            .collect();
        let port = h.port;
        tokio::task::spawn_blocking(move || send_raw(port, &garbage))
            .await
            .unwrap();

        // A TLS client that does not trust the certificate: its handshake fails, on its side.
        let refused = ().serve(h.transport(None)).await;
        assert!(
            refused.is_err(),
            "a client that does not trust the certificate got through"
        );

        // The endpoint still serves: a handshake...
        tls_handshake().await;
        // ...and an MCP client that lists and calls as before.
        h.list_and_call("after-garbage").await;
        assert!(h.daemon.0.try_wait().unwrap().is_none(), "the daemon runs");
        drop(stalled);

        let log = h.log();
        assert!(
            log.contains("TLS handshake failed; connection dropped"),
            "the failed handshakes are logged:\n{log}"
        );
        assert!(!log.contains("MCP over HTTP stopped"), "{log}");
    })
    .await
}

/// Runs `waymark daemon` to its end (it must refuse within 20 s); its exit code and stderr.
fn refused_daemon(env: &Env) -> (Option<i32>, String) {
    let child = env
        .cmd()
        .arg("daemon")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // A daemon that started would run on: it is killed (on drop) and the test fails.
    let mut daemon = Daemon(child);
    wait_for(
        || daemon.0.try_wait().unwrap().is_some(),
        "the daemon to refuse to start",
        Duration::from_secs(20),
    );
    let code = daemon.0.try_wait().unwrap().and_then(|s| s.code());
    let mut said = String::new();
    daemon
        .0
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut said)
        .unwrap();
    eprintln!("$ waymark daemon\n[exit {code:?}]\n{said}");
    (code, said)
}

#[test]
fn plain_http_off_loopback_is_refused_at_its_line_by_config_check_and_the_daemon() {
    let f = files();
    let port = free_port_on_all_addresses();
    let env = Env::builder()
        .tools(APPEND_TOOL)
        .daemon_settings(&settings(&f, port, false))
        .build();
    let text = std::fs::read_to_string(&env.config).unwrap();
    let line = text
        .lines()
        .position(|l| l.starts_with("http_listen"))
        .unwrap()
        + 1;
    let at = format!("{}:{line}:15:", env.config.display());
    let check = env.run(&["config", "check"]);
    assert_eq!(check.status.code(), Some(2));
    let message = stderr(&check)
        .lines()
        .find(|l| l.contains(&at))
        .unwrap_or_else(|| panic!("config check says {at}: {}", stderr(&check)))
        .to_string();
    assert!(
        message.contains("is not a loopback address, so MCP over HTTP there must use TLS")
            && message.contains("add tls_cert = ")
            && message.contains("and tls_key = "),
        "{message}"
    );
    let (code, said) = refused_daemon(&env);
    assert_eq!(code, Some(2), "{said}");
    assert!(
        said.contains(&message),
        "the daemon says what config check says: {said}"
    );
    assert!(
        TcpStream::connect(("127.0.0.1", port)).is_err(),
        "nothing listens"
    );
}

#[test]
fn a_tls_key_others_can_read_or_a_file_without_a_certificate_is_refused_by_the_daemon() {
    let f = files();
    let port = free_port_on_all_addresses();
    let env = Env::builder()
        .tools(APPEND_TOOL)
        .daemon_settings(&settings(&f, port, true))
        .build();
    // The files are read when the daemon starts.
    assert_eq!(env.run(&["config", "check"]).status.code(), Some(0));

    std::fs::set_permissions(&f.key, std::fs::Permissions::from_mode(0o644)).unwrap();
    // `config check` says so before the daemon refuses it.
    let check = env.run(&["config", "check"]);
    assert!(
        common::stderr(&check).contains("daemon.tls_key: ")
            && common::stderr(&check).contains("is mode 644"),
        "{}",
        common::stderr(&check)
    );
    let (code, said) = refused_daemon(&env);
    assert_ne!(code, Some(0), "{said}");
    let key = f.key.display().to_string();
    assert!(
        said.contains(&format!("the TLS key file {key} is mode 644"))
            && said.contains(&format!("`chmod 600 {key}`")),
        "{said}"
    );
    assert!(
        TcpStream::connect(("127.0.0.1", port)).is_err(),
        "nothing listens"
    );
    std::fs::set_permissions(&f.key, std::fs::Permissions::from_mode(0o600)).unwrap();

    // A certificate file that holds no certificate (here: the key) is named.
    let cert_text = std::fs::read(&f.cert).unwrap();
    std::fs::write(&f.cert, std::fs::read(&f.key).unwrap()).unwrap();
    let (code, said) = refused_daemon(&env);
    assert_ne!(code, Some(0), "{said}");
    assert!(
        said.contains(&format!(
            "the TLS certificate file {} holds no certificate",
            f.cert.display()
        )),
        "{said}"
    );
    std::fs::write(&f.cert, cert_text).unwrap();

    // Owner-only key and a real chain: it starts and listens.
    let _daemon = env.start_daemon();
    wait_for(
        || TcpStream::connect(("127.0.0.1", port)).is_ok(),
        "the HTTPS endpoint to listen",
        Duration::from_secs(20),
    );
}
