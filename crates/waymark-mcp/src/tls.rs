//! TLS for MCP over Streamable HTTP (`[daemon] tls_cert` and `tls_key`): the server
//! configuration, read from PEM files when the daemon starts.
//!
//! The key file must be readable by its owner only, as the bearer token's is. The crypto
//! provider is ring, named here rather than taken from a process-wide default: the workspace
//! builds rustls without a default provider (aws-lc-rs would need cmake), and nothing else in
//! the daemon has to have installed one first.

use std::io::Read;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::sync::Arc;

use rustls::pki_types::pem::{self, PemObject};
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::ServerConfig;

/// The only protocol the endpoint speaks (hyper serves HTTP/1.1 here), offered through ALPN.
pub const ALPN: &[u8] = b"http/1.1";

/// Reads the certificate chain (leaf first) and its private key and builds the server's TLS
/// configuration. Refuses a key file others may read, a file that holds no PEM item of its
/// kind, and a key that is not the certificate's; every message names the file.
pub fn server_config(cert: &Path, key: &Path) -> Result<Arc<ServerConfig>, String> {
    let chain = read_chain(cert)?;
    let key_der = read_key(key)?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| format!("cannot set up TLS: {e}"))?
        .with_no_client_auth()
        .with_single_cert(chain, key_der)
        .map_err(|e| {
            format!(
                "cannot serve TLS with the certificate {} and the key {}: {e} (the key must be the \
                 first certificate's, in PKCS#8, PKCS#1 or SEC1)",
                cert.display(),
                key.display()
            )
        })?;
    config.alpn_protocols = vec![ALPN.to_vec()];
    Ok(Arc::new(config))
}

fn read_chain(path: &Path) -> Result<Vec<CertificateDer<'static>>, String> {
    let text = std::fs::read(path).map_err(|e| {
        format!(
            "cannot read the TLS certificate file {}: {e}",
            path.display()
        )
    })?;
    let chain = CertificateDer::pem_slice_iter(&text)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| {
            format!(
                "the TLS certificate file {} is not valid PEM: {e}",
                path.display()
            )
        })?;
    if chain.is_empty() {
        return Err(format!(
            "the TLS certificate file {} holds no certificate: it needs the chain as PEM \
             (-----BEGIN CERTIFICATE----- blocks, the server's own first)",
            path.display()
        ));
    }
    Ok(chain)
}

/// The key, from a file whose mode is checked on the open file (no window between the check
/// and the read).
fn read_key(path: &Path) -> Result<PrivateKeyDer<'static>, String> {
    let cannot =
        |e: std::io::Error| format!("cannot read the TLS key file {}: {e}", path.display());
    let mut file = std::fs::File::open(path).map_err(cannot)?;
    let mode = file.metadata().map_err(cannot)?.permissions().mode() & 0o777;
    if mode & 0o077 != 0 {
        return Err(format!(
            "the TLS key file {} is mode {mode:o}: a private key must be readable by its owner \
             only; make it 0600 (`chmod 600 {}`)",
            path.display(),
            path.display()
        ));
    }
    let mut text = Vec::new();
    file.read_to_end(&mut text).map_err(cannot)?;
    PrivateKeyDer::from_pem_slice(&text).map_err(|e| match e {
        pem::Error::NoItemsFound => format!(
            "the TLS key file {} holds no private key: it needs one PEM block (-----BEGIN \
             PRIVATE KEY-----, RSA PRIVATE KEY or EC PRIVATE KEY)",
            path.display()
        ),
        e => format!("the TLS key file {} is not valid PEM: {e}", path.display()),
    })
}
