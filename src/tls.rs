//! TLS, with rustls and its `ring` provider, for the three connections that
//! may be encrypted: clients to the proxy listener, the proxy to an
//! `https://` upstream, and the proxy to PostgreSQL (see
//! [`crate::store::tls`]).
//!
//! * The provider is named explicitly (never the process default), so the
//!   build does not depend on which rustls features another crate turns on.
//! * Trust for outgoing connections is the operating system's store (via
//!   `rustls-native-certs`: `/etc/ssl/certs`, or `SSL_CERT_FILE` /
//!   `SSL_CERT_DIR`) plus an optional CA file from the configuration. The
//!   system store rather than a compiled-in Mozilla list because a sidecar
//!   runs in an image its operators maintain: corporate CAs and CA updates
//!   arrive through the image, not through a rebuild of idemproxy.
//! * Certificates and keys are read once, at start; a problem names the
//!   configuration key and the file, and stops the start.

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::{ClientConfig, RootCertStore, ServerConfig};
use thiserror::Error;
use tokio_rustls::TlsAcceptor;

/// A TLS set-up problem, naming the configuration key and file involved.
#[derive(Debug, Error)]
#[error("{key}: {message}")]
pub struct TlsError {
    /// The configuration key, such as `server.tls_cert_file`.
    pub key: &'static str,
    /// What is wrong.
    pub message: String,
}

impl TlsError {
    fn new(key: &'static str, message: impl fmt::Display) -> Self {
        TlsError {
            key,
            message: message.to_string(),
        }
    }
}

/// The certificate and key files of a TLS listener.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsFiles {
    /// PEM file with the certificate chain, leaf first.
    pub cert_file: PathBuf,
    /// PEM file with the private key (PKCS#8, PKCS#1 or SEC1).
    pub key_file: PathBuf,
}

/// The crypto provider every TLS configuration here uses.
pub fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// Reads every certificate of a PEM file; an empty file is an error.
pub fn load_certs(
    key: &'static str,
    path: &Path,
) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let certs = CertificateDer::pem_file_iter(path)
        .and_then(|iter| iter.collect::<Result<Vec<_>, _>>())
        .map_err(|e| TlsError::new(key, format!("cannot read {}: {e}", path.display())))?;
    if certs.is_empty() {
        return Err(TlsError::new(
            key,
            format!("{} holds no PEM certificate", path.display()),
        ));
    }
    Ok(certs)
}

/// Reads the first private key of a PEM file.
pub fn load_key(key: &'static str, path: &Path) -> Result<PrivateKeyDer<'static>, TlsError> {
    PrivateKeyDer::from_pem_file(path).map_err(|e| {
        TlsError::new(
            key,
            format!("cannot read a private key from {}: {e}", path.display()),
        )
    })
}

/// Which certificate authorities an outgoing connection trusts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Trust<'a> {
    /// Only the CAs in this file.
    File(&'a Path),
    /// The operating system's store, plus the CAs in the file if one is given.
    System(Option<&'a Path>),
}

/// The root store for `trust`. The system store is loaded leniently (one
/// unreadable certificate does not disable the others); the configured file
/// strictly.
pub fn root_store(key: &'static str, trust: Trust<'_>) -> Result<RootCertStore, TlsError> {
    let mut roots = RootCertStore::empty();
    let file = match trust {
        Trust::File(path) => Some(path),
        Trust::System(file) => {
            let native = rustls_native_certs::load_native_certs();
            for error in &native.errors {
                tracing::debug!(%error, "skipping part of the system certificate store");
            }
            roots.add_parsable_certificates(native.certs);
            file
        }
    };
    if let Some(path) = file {
        for cert in load_certs(key, path)? {
            roots.add(cert).map_err(|e| {
                TlsError::new(
                    key,
                    format!(
                        "{} holds a certificate that is not a usable CA: {e}",
                        path.display()
                    ),
                )
            })?;
        }
    }
    if roots.is_empty() {
        return Err(TlsError::new(
            key,
            "no trusted certificate authority: the system store is empty and no CA file is set",
        ));
    }
    Ok(roots)
}

/// A client configuration that verifies servers against `roots` (chain and
/// name), TLS 1.2 and 1.3.
pub fn client_config(roots: RootCertStore) -> Result<ClientConfig, TlsError> {
    Ok(ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| TlsError::new("tls", e))?
        .with_root_certificates(roots)
        .with_no_client_auth())
}

/// The configuration of the upstream client for `https://` upstreams: the
/// system store plus `upstream.ca_file`.
pub fn upstream_client_config(ca_file: Option<&Path>) -> Result<ClientConfig, TlsError> {
    client_config(root_store("upstream.ca_file", Trust::System(ca_file))?)
}

/// The acceptor of a TLS listener: HTTP/1.1 and h2, chosen by ALPN.
pub fn server_acceptor(files: &TlsFiles) -> Result<TlsAcceptor, TlsError> {
    let certs = load_certs("server.tls_cert_file", &files.cert_file)?;
    let key = load_key("server.tls_key_file", &files.key_file)?;
    let mut config = ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| TlsError::new("server.tls_cert_file", e))?
        .with_no_client_auth()
        .with_single_cert(certs, key)
        .map_err(|e| {
            TlsError::new(
                "server.tls_key_file",
                format!("the key does not fit the certificate: {e}"),
            )
        })?;
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(TlsAcceptor::from(Arc::new(config)))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A file that is removed when dropped.
    struct TempFile(PathBuf);

    impl std::ops::Deref for TempFile {
        type Target = Path;
        fn deref(&self) -> &Path {
            &self.0
        }
    }

    impl Drop for TempFile {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.0);
        }
    }

    fn temp(name: &str, contents: &[u8]) -> TempFile {
        let path =
            std::env::temp_dir().join(format!("idemproxy-tls-unit-{}-{name}", std::process::id()));
        std::fs::write(&path, contents).unwrap();
        TempFile(path)
    }

    #[test]
    fn a_missing_file_names_the_key_and_the_path() {
        let err = load_certs("upstream.ca_file", Path::new("/nonexistent/ca.pem")).unwrap_err();
        let text = err.to_string();
        assert!(text.starts_with("upstream.ca_file: "), "{text}");
        assert!(text.contains("/nonexistent/ca.pem"), "{text}");
    }

    #[test]
    fn a_file_without_certificates_is_refused() {
        let path = temp("empty.pem", b"not a certificate\n");
        let err = load_certs("upstream.ca_file", &path).unwrap_err();
        assert!(err.to_string().contains("no PEM certificate"), "{err}");
        let err = root_store("upstream.ca_file", Trust::File(&path)).unwrap_err();
        assert!(err.to_string().contains("no PEM certificate"), "{err}");
    }

    #[test]
    fn a_file_without_a_key_is_refused() {
        let path = temp(
            "nokey.pem",
            b"-----BEGIN NOTHING-----\n-----END NOTHING-----\n",
        );
        let err = load_key("server.tls_key_file", &path).unwrap_err();
        assert!(
            err.to_string().starts_with("server.tls_key_file: "),
            "{err}"
        );
    }
}
