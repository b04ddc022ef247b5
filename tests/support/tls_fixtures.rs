//! TLS fixtures: a throwaway PKI (a test CA and its leaf certificates, or
//! an X.509 v1 self-signed certificate from the `openssl` command), and
//! configuration edits for the TLS tests.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};

use idemproxy::app::{self, Running, ServeOptions};
use idemproxy::config::{self, Overrides};
use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, IsCa, KeyPair, KeyUsagePurpose,
};

use super::harness::{wait_ready, Setup};

// A throwaway PKI.

static SEQ: AtomicU32 = AtomicU32::new(0);

/// A directory removed when dropped.
pub struct TempDir(pub PathBuf);

impl TempDir {
    pub fn new(tag: &str) -> TempDir {
        let dir = std::env::temp_dir().join(format!(
            "idemproxy-{tag}-{}-{}",
            std::process::id(),
            SEQ.fetch_add(1, Ordering::SeqCst)
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        TempDir(dir)
    }

    pub fn write(&self, name: &str, contents: &str) -> PathBuf {
        let path = self.0.join(name);
        std::fs::write(&path, contents).unwrap();
        path
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A test certificate authority.
pub struct Ca {
    pub issuer: CertifiedIssuer<'static, KeyPair>,
}

/// A leaf certificate and its key, in PEM.
pub struct Leaf {
    pub cert_pem: String,
    pub key_pem: String,
}

impl Ca {
    pub fn new(name: &str) -> Ca {
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.distinguished_name.push(DnType::CommonName, name);
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let issuer = CertifiedIssuer::self_signed(params, KeyPair::generate().unwrap()).unwrap();
        Ca { issuer }
    }

    pub fn pem(&self) -> String {
        self.issuer.pem()
    }

    /// A server certificate for these names (DNS names or IP addresses).
    pub fn leaf(&self, names: &[&str]) -> Leaf {
        let names: Vec<String> = names.iter().map(|n| n.to_string()).collect();
        let mut params = CertificateParams::new(names).unwrap();
        params
            .distinguished_name
            .push(DnType::CommonName, "idemproxy test server");
        let key = KeyPair::generate().unwrap();
        let cert = params.signed_by(&key, &self.issuer).unwrap();
        Leaf {
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
        }
    }
}

/// Inserts `line` at the top of the `[section]` table of a configuration.
pub fn with_key(text: String, section: &str, line: &str) -> String {
    let header = format!("[{section}]\n");
    assert!(text.contains(&header), "no [{section}] in\n{text}");
    text.replacen(&header, &format!("{header}{line}\n"), 1)
}

/// A TOML string literal.
pub fn quoted(path: &Path) -> String {
    toml::Value::String(path.display().to_string()).to_string()
}

/// Starts idemproxy with `setup`'s configuration, edited by `edit`, and
/// waits until it is ready.
pub async fn start_edited(
    setup: &Setup,
    upstream: &str,
    db: &str,
    edit: impl FnOnce(String) -> String,
) -> Running {
    let text = edit(setup.toml(upstream, db));
    let config = config::parse(&text, "tls-test.toml", &Overrides::default())
        .unwrap_or_else(|e| panic!("{e}\n{text}"));
    // Two workers whatever the machine, so that every test runs with
    // connections on more than one thread (max_connections shared, pools
    // per worker, the drain of all of them).
    let options = ServeOptions {
        workers: 2,
        ..ServeOptions::default()
    };
    let running = app::start(config, options).await.unwrap();
    wait_ready(running.admin_addr).await;
    running
}

/// A self-signed X.509 **v1** certificate (no extensions: what Citus and
/// many hand-made set-ups generate) for `cn`, made by `openssl` in `dir`.
/// rcgen writes v3 only.
pub fn v1_self_signed(dir: &TempDir, cn: &str) -> Leaf {
    let key = dir.0.join("v1.key");
    let csr = dir.0.join("v1.csr");
    let crt = dir.0.join("v1.crt");
    let run = |args: &[&str]| {
        let out = Command::new("openssl")
            .args(args)
            .output()
            .unwrap_or_else(|e| panic!("this test needs the openssl command: {e}"));
        assert!(
            out.status.success(),
            "openssl {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    let path = |p: &PathBuf| p.display().to_string();
    run(&[
        "ecparam",
        "-name",
        "prime256v1",
        "-genkey",
        "-noout",
        "-out",
        &path(&key),
    ]);
    let subject = format!("/CN={cn}");
    run(&[
        "req",
        "-new",
        "-key",
        &path(&key),
        "-subj",
        &subject,
        "-out",
        &path(&csr),
    ]);
    // `x509 -req` without `-extfile` writes no extensions, hence version 1.
    run(&[
        "x509",
        "-req",
        "-in",
        &path(&csr),
        "-signkey",
        &path(&key),
        "-days",
        "2",
        "-out",
        &path(&crt),
    ]);
    let text = Command::new("openssl")
        .args(["x509", "-noout", "-text", "-in", &path(&crt)])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&text.stdout);
    assert!(
        text.contains("Version: 1 (0x0)"),
        "not a v1 certificate:\n{text}"
    );
    Leaf {
        cert_pem: std::fs::read_to_string(&crt).unwrap(),
        key_pem: std::fs::read_to_string(&key).unwrap(),
    }
}
