//! PostgreSQL over TLS, with libpq's `sslmode` semantics.
//!
//! `tokio-postgres` knows `sslmode=disable|prefer|require` and nothing about
//! certificates; libpq users write `verify-ca`, `verify-full` and
//! `sslrootcert` too. This module takes those parameters out of the database
//! URL (or `key=value` string), hands the rest to `tokio-postgres`, and picks
//! the connector:
//!
//! | `sslmode` | TLS | certificate check |
//! |---|---|---|
//! | `disable` | never | — |
//! | `prefer` (the default, as in libpq) | if the server offers it | none |
//! | `require` | always | none; chain only when a CA file is given (as libpq) |
//! | `verify-ca` | always | chain, against the CA file or else the system store |
//! | `verify-full` | always | chain and host name |
//!
//! "none" means none: under `prefer` and `require` a certificate of any
//! form (X.509 v1 included, as libpq) is accepted, and only the handshake
//! signature is checked, against its public key (`NoVerification`).
//!
//! The CA file is `store.ca_file`, or libpq's `sslrootcert` parameter in the
//! URL (one of the two). `allow` is refused: it would try plaintext first.
//!
//! Unlike libpq, a failed TLS handshake under `prefer` does not fall back to
//! plaintext; a server that rustls cannot talk to needs `sslmode=disable`.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::client::WebPkiServerVerifier;
use rustls::crypto::{verify_tls13_signature_with_raw_key, CryptoProvider};
use rustls::pki_types::{CertificateDer, ServerName, SubjectPublicKeyInfoDer, UnixTime};
use rustls::{
    CertificateError, ClientConfig, DigitallySignedStruct, PeerMisbehaved, SignatureScheme,
};
use tokio_postgres::tls::MakeTlsConnect;
use tokio_postgres::Socket;
use tokio_postgres_rustls::MakeRustlsConnect;

use super::StoreError;
pub use crate::pg_url::{parse_url, ParsedUrl, SslMode};
use crate::tls::{provider, root_store, Trust};

/// The stream of a connection made with [`Connection::tls`] (TLS or not,
/// as the mode says).
pub type TlsStream = <MakeRustlsConnect as MakeTlsConnect<Socket>>::Stream;

/// What `Store::new` needs to connect: the driver's configuration and the
/// connector.
pub struct Connection {
    /// The parsed URL, without the parameters handled here, and with the
    /// driver's `sslmode` set.
    pub config: tokio_postgres::Config,
    /// The TLS connector. Under `sslmode=disable` the driver never uses it;
    /// it is there all the same so that every connection has one type.
    pub tls: MakeRustlsConnect,
    /// The mode in force.
    pub mode: SslMode,
}

/// Parses the database URL and builds its TLS connector. `ca_file` is
/// `store.ca_file`. Error messages never contain the URL.
pub fn connection(url: &str, ca_file: Option<&Path>) -> Result<Connection, StoreError> {
    let ParsedUrl {
        config,
        mode,
        sslrootcert,
    } = parse_url(url)?;
    let ca = match (sslrootcert.as_deref(), ca_file) {
        (Some(_), Some(_)) => {
            return Err(StoreError::Url(
                "both store.ca_file and the URL's sslrootcert name a CA file; keep one".into(),
            ))
        }
        (Some(url_ca), None) => Some(PathBuf::from(url_ca)),
        (None, file) => file.map(Path::to_path_buf),
    };
    let mut config = config;
    let verifier: Arc<dyn ServerCertVerifier> = match mode {
        SslMode::Disable => {
            config.ssl_mode(tokio_postgres::config::SslMode::Disable);
            Arc::new(NoVerification(provider()))
        }
        SslMode::Prefer => {
            config.ssl_mode(tokio_postgres::config::SslMode::Prefer);
            Arc::new(NoVerification(provider()))
        }
        SslMode::Require if ca.is_none() => {
            config.ssl_mode(tokio_postgres::config::SslMode::Require);
            Arc::new(NoVerification(provider()))
        }
        SslMode::Require | SslMode::VerifyCa => {
            config.ssl_mode(tokio_postgres::config::SslMode::Require);
            Arc::new(Verifying {
                webpki: webpki_verifier(ca.as_deref())?,
                check_name: false,
            })
        }
        SslMode::VerifyFull => {
            config.ssl_mode(tokio_postgres::config::SslMode::Require);
            Arc::new(Verifying {
                webpki: webpki_verifier(ca.as_deref())?,
                check_name: true,
            })
        }
    };
    let tls = ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| StoreError::Url(format!("TLS set-up failed: {e}")))?
        .dangerous()
        .with_custom_certificate_verifier(verifier)
        .with_no_client_auth();
    Ok(Connection {
        config,
        tls: MakeRustlsConnect::new(tls),
        mode,
    })
}

fn webpki_verifier(ca: Option<&Path>) -> Result<Arc<WebPkiServerVerifier>, StoreError> {
    let trust = match ca {
        Some(path) => Trust::File(path),
        None => Trust::System(None),
    };
    let roots = root_store("store.ca_file", trust).map_err(|e| StoreError::Url(e.to_string()))?;
    WebPkiServerVerifier::builder_with_provider(Arc::new(roots), provider())
        .build()
        .map_err(|e| StoreError::Url(format!("TLS set-up failed: {e}")))
}

/// Accepts any certificate (libpq's `prefer` and `require` without a CA
/// file): the connection is encrypted against eavesdroppers but not
/// authenticated. The handshake signatures are still checked, so the peer
/// holds the key of the certificate it sent.
///
/// The signatures are checked against the certificate's bare public key,
/// never by parsing it as a certificate to verify: rustls's own
/// `verify_tls1x_signature` go through webpki's end-entity parser, which
/// refuses anything but X.509 v3 (`UnsupportedCertVersion`), and so would
/// refuse the v1 certificates that libpq accepts in these modes (Citus
/// generates them, as do many hand-made set-ups). Only `verify-ca` and
/// `verify-full` may refuse a certificate.
#[derive(Debug)]
struct NoVerification(Arc<CryptoProvider>);

impl ServerCertVerifier for NoVerification {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        let spki = SubjectPublicKeyInfoDer::from(certificate_key(cert)?);
        let key = webpki::RawPublicKeyEntity::try_from(&spki)
            .map_err(|_| rustls::Error::InvalidCertificate(CertificateError::BadEncoding))?;
        // In TLS 1.2 an ECDSA scheme does not name the curve: the provider
        // maps it to several algorithms, and the key's own picks one.
        let algorithms = self
            .0
            .signature_verification_algorithms
            .mapping
            .iter()
            .find(|(scheme, _)| *scheme == dss.scheme)
            .map(|(_, algorithms)| *algorithms)
            .ok_or(PeerMisbehaved::SignedHandshakeWithUnadvertisedSigScheme)?;
        if algorithms
            .iter()
            .any(|alg| key.verify_signature(*alg, message, dss.signature()).is_ok())
        {
            Ok(HandshakeSignatureValid::assertion())
        } else {
            Err(rustls::Error::InvalidCertificate(
                CertificateError::BadSignature,
            ))
        }
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        let spki = SubjectPublicKeyInfoDer::from(certificate_key(cert)?);
        verify_tls13_signature_with_raw_key(
            message,
            &spki,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

/// The DER `SubjectPublicKeyInfo` of an X.509 certificate of any version
/// (v1 has no `[0] version` field; v2 and v3 have one).
fn certificate_key<'c>(cert: &'c CertificateDer<'_>) -> Result<&'c [u8], rustls::Error> {
    spki_of(cert.as_ref()).ok_or(rustls::Error::InvalidCertificate(
        CertificateError::BadEncoding,
    ))
}

/// `Certificate ::= SEQUENCE { tbsCertificate SEQUENCE { [0] version
/// OPTIONAL, serialNumber, signature, issuer, validity, subject,
/// subjectPublicKeyInfo, … }, … }`: the whole `subjectPublicKeyInfo`
/// element, or `None` when the DER does not have that shape.
fn spki_of(cert: &[u8]) -> Option<&[u8]> {
    const SEQUENCE: u8 = 0x30;
    const VERSION: u8 = 0xA0;
    let certificate = der_element(cert).filter(|e| e.tag == SEQUENCE)?;
    let tbs = der_element(certificate.contents).filter(|e| e.tag == SEQUENCE)?;
    let mut rest = tbs.contents;
    if rest.first() == Some(&VERSION) {
        rest = der_element(rest)?.rest;
    }
    // serialNumber, signature, issuer, validity, subject.
    for _ in 0..5 {
        rest = der_element(rest)?.rest;
    }
    let spki = der_element(rest).filter(|e| e.tag == SEQUENCE)?;
    Some(spki.whole)
}

/// One DER element at the start of some input.
struct DerElement<'a> {
    tag: u8,
    /// Tag, length and contents.
    whole: &'a [u8],
    contents: &'a [u8],
    /// What follows the element.
    rest: &'a [u8],
}

/// The DER element at the start of `input`. Single-byte tags, definite
/// lengths up to 4 bytes: all a certificate's outer structure uses.
fn der_element(input: &[u8]) -> Option<DerElement<'_>> {
    let tag = *input.first()?;
    let first = *input.get(1)?;
    let (len, header) = if first < 0x80 {
        (usize::from(first), 2)
    } else {
        let n = usize::from(first & 0x7f);
        if n == 0 || n > 4 {
            return None;
        }
        let bytes = input.get(2..2 + n)?;
        let len = bytes
            .iter()
            .fold(0usize, |acc, b| (acc << 8) | usize::from(*b));
        (len, 2 + n)
    };
    let end = header.checked_add(len)?;
    let whole = input.get(..end)?;
    Some(DerElement {
        tag,
        whole,
        contents: &whole[header..],
        rest: &input[end..],
    })
}

/// libpq's `verify-ca` (`check_name: false`: the chain must lead to a
/// trusted CA, the host name is not compared) and `verify-full`; webpki's
/// checks, with the one refusal that libpq would not make explained.
#[derive(Debug)]
struct Verifying {
    webpki: Arc<WebPkiServerVerifier>,
    check_name: bool,
}

/// webpki verifies X.509 v3 certificates only, where OpenSSL also takes v1:
/// say so rather than `UnsupportedCertVersion`.
fn explain(e: rustls::Error) -> rustls::Error {
    let unsupported_version = matches!(
        &e,
        rustls::Error::InvalidCertificate(CertificateError::Other(other))
            if matches!(other.0.downcast_ref::<webpki::Error>(), Some(webpki::Error::UnsupportedCertVersion))
    );
    if unsupported_version {
        rustls::Error::General(
            "the server's certificate is not X.509 version 3, which sslmode=verify-ca and \
             verify-full require (sslmode=require does not verify it)"
                .into(),
        )
    } else {
        e
    }
}

impl ServerCertVerifier for Verifying {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        match self.webpki.verify_server_cert(
            end_entity,
            intermediates,
            server_name,
            ocsp_response,
            now,
        ) {
            Err(rustls::Error::InvalidCertificate(
                CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. },
            )) if !self.check_name => Ok(ServerCertVerified::assertion()),
            other => other.map_err(explain),
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.webpki.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.webpki.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.webpki.supported_verify_schemes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pg_url::{split_tls_params, Split};
    use std::str::FromStr;

    fn split(url: &str) -> Split {
        split_tls_params(url).unwrap()
    }

    #[test]
    fn url_tls_parameters_are_taken_out_and_the_rest_kept() {
        let s = split("postgres://u:pw@db:5432/app?application_name=x&sslmode=verify-full&sslrootcert=%2Fetc%2Fca%20x.pem&connect_timeout=3");
        assert_eq!(s.sslmode.as_deref(), Some("verify-full"));
        assert_eq!(s.sslrootcert.as_deref(), Some("/etc/ca x.pem"));
        assert_eq!(
            s.rest,
            "postgres://u:pw@db:5432/app?application_name=x&connect_timeout=3"
        );
        let s = split("postgresql://db/app?sslmode=require");
        assert_eq!(s.rest, "postgresql://db/app");
        assert_eq!(s.sslmode.as_deref(), Some("require"));
        let s = split("postgres://db/app");
        assert_eq!((s.rest.as_str(), s.sslmode), ("postgres://db/app", None));
    }

    #[test]
    fn conninfo_tls_parameters_are_taken_out_and_quotes_understood() {
        let s = split(
            r"host=db user=u password='p w\'x' sslmode = verify-ca sslrootcert='/etc/my ca.pem' dbname=app",
        );
        assert_eq!(s.sslmode.as_deref(), Some("verify-ca"));
        assert_eq!(s.sslrootcert.as_deref(), Some("/etc/my ca.pem"));
        assert_eq!(s.rest, r"host=db user=u password='p w\'x' dbname=app");
        assert!(tokio_postgres::Config::from_str(&s.rest).is_ok());
    }

    #[test]
    fn malformed_conninfo_is_refused_without_echoing_it() {
        for bad in [
            "host=db password='secret",
            "host",
            "=x",
            "host=db password=abc\\",
        ] {
            let err = split_tls_params(bad).unwrap_err().to_string();
            assert!(!err.contains("secret") && !err.contains("abc"), "{err}");
        }
    }

    #[test]
    fn sslmodes_map_to_connectors() {
        let plain = connection("postgres://db/app?sslmode=disable", None).unwrap();
        assert_eq!(plain.mode, SslMode::Disable);
        assert_eq!(
            plain.config.get_ssl_mode(),
            tokio_postgres::config::SslMode::Disable
        );
        for (url, mode) in [
            ("postgres://db/app", SslMode::Prefer),
            ("postgres://db/app?sslmode=prefer", SslMode::Prefer),
            ("postgres://db/app?sslmode=require", SslMode::Require),
            ("host=db sslmode=require", SslMode::Require),
        ] {
            let c = connection(url, None).unwrap();
            assert_eq!(c.mode, mode, "{url}");
        }
        let prefer = connection("postgres://db/app", None).unwrap();
        assert_eq!(
            prefer.config.get_ssl_mode(),
            tokio_postgres::config::SslMode::Prefer
        );
        let require = connection("postgres://db/app?sslmode=verify-ca", None);
        // verify-ca without a CA file uses the system store, which may be
        // empty on a minimal machine: then it is a clear error.
        if let Ok(c) = require {
            assert_eq!(
                c.config.get_ssl_mode(),
                tokio_postgres::config::SslMode::Require
            );
        }
    }

    #[test]
    fn unsupported_or_invalid_sslmodes_are_refused() {
        for url in [
            "postgres://u:hunter2@db/app?sslmode=allow",
            "postgres://u:hunter2@db/app?sslmode=bogus",
        ] {
            let err = connection(url, None).err().unwrap().to_string();
            assert!(err.contains("sslmode"), "{err}");
            assert!(!err.contains("hunter2"), "{err}");
        }
    }

    #[test]
    fn a_ca_file_twice_or_missing_is_refused() {
        let err = connection(
            "postgres://db/app?sslmode=verify-full&sslrootcert=/a.pem",
            Some(Path::new("/b.pem")),
        )
        .err()
        .unwrap()
        .to_string();
        assert!(err.contains("keep one"), "{err}");
        let err = connection(
            "postgres://db/app?sslmode=verify-full",
            Some(Path::new("/nonexistent/ca.pem")),
        )
        .err()
        .unwrap()
        .to_string();
        assert!(
            err.contains("store.ca_file") && err.contains("/nonexistent/ca.pem"),
            "{err}"
        );
    }

    #[test]
    fn the_public_key_is_found_in_a_v3_certificate_and_garbage_is_refused() {
        let key = rcgen::KeyPair::generate().unwrap();
        let cert = rcgen::CertificateParams::new(vec!["db".into()])
            .unwrap()
            .self_signed(&key)
            .unwrap();
        use rcgen::PublicKeyData;
        let spki = key.subject_public_key_info();
        assert_eq!(spki_of(cert.der()), Some(spki.as_slice()));
        let der = cert.der().to_vec();
        for cut in [0, 1, 2, 10, der.len() / 2, der.len() - 1] {
            assert_eq!(spki_of(&der[..cut]), None, "{cut}");
        }
        assert_eq!(spki_of(&[0x30, 0x85, 1, 1, 1, 1, 1]), None);
    }
}
