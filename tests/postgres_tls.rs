//! PostgreSQL over TLS with libpq's `sslmode`s, against private clusters
//! started from the machine's PostgreSQL binaries: a CA-signed certificate
//! through every mode, and an X.509 v1 self-signed certificate, which
//! `prefer` and `require` accept (nothing is verified in those modes) and
//! only `verify-ca`/`verify-full` refuse.

mod support;

use std::path::PathBuf;
use std::process::Command;

use idemproxy::config::{self, Overrides};
use idemproxy::store::Store;
use support::harness::{start_upstream, Setup};
use support::http::{HttpClient, Req};
use support::tls_fixtures::{quoted, start_edited, v1_self_signed, with_key, Ca, Leaf, TempDir};

const PAY: &str = r#"{"amount": 100}"#;

/// A private PostgreSQL cluster with `ssl = on`, accepting TLS connections
/// only, on a free port; stopped and removed when dropped. Never the
/// machine's shared server.
struct TlsCluster {
    dir: TempDir,
    bindir: PathBuf,
    run_as: Option<String>,
    port: u16,
}

/// The server binaries: `IDEMPROXY_PG_BINDIR`, else the newest
/// `/usr/lib/postgresql/*/bin` with `initdb`.
fn pg_bindir() -> Option<PathBuf> {
    if let Ok(dir) = std::env::var("IDEMPROXY_PG_BINDIR") {
        return Some(PathBuf::from(dir));
    }
    let mut dirs: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .ok()?
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            let version = e.file_name().to_str()?.parse::<u32>().ok()?;
            let bin = e.path().join("bin");
            bin.join("initdb").exists().then_some((version, bin))
        })
        .collect();
    dirs.sort();
    dirs.pop().map(|(_, bin)| bin)
}

fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
        .unwrap_or(false)
}

impl TlsCluster {
    /// `None` when the machine has no PostgreSQL server binaries.
    fn start(leaf: &Leaf) -> Option<TlsCluster> {
        let bindir = pg_bindir()?;
        // PostgreSQL refuses to run as root: run it as `postgres` then.
        let run_as = is_root().then(|| "postgres".to_string());
        let dir = TempDir::new("pg-tls");
        if let Some(user) = &run_as {
            let status = Command::new("chown")
                .args(["-R", user, &dir.0.display().to_string()])
                .status()
                .unwrap();
            assert!(status.success());
        }
        let port = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap().port()
        };
        let cluster = TlsCluster {
            dir,
            bindir,
            run_as,
            port,
        };
        let data = cluster.data();
        cluster.run(
            "initdb",
            &[
                "-D",
                &data,
                "-U",
                "postgres",
                "--auth=trust",
                "-E",
                "UTF8",
                "--locale=C",
                "--no-sync",
            ],
        );
        let data_dir = PathBuf::from(&data);
        std::fs::write(data_dir.join("server.crt"), &leaf.cert_pem).unwrap();
        std::fs::write(data_dir.join("server.key"), &leaf.key_pem).unwrap();
        {
            use std::io::Write;
            let mut conf = std::fs::OpenOptions::new()
                .append(true)
                .open(data_dir.join("postgresql.conf"))
                .unwrap();
            writeln!(
                conf,
                "\nlisten_addresses = '127.0.0.1'\nport = {port}\nunix_socket_directories = ''\n\
                 ssl = on\nssl_cert_file = 'server.crt'\nssl_key_file = 'server.key'\n\
                 fsync = off\nmax_connections = 40"
            )
            .unwrap();
        }
        // TLS or nothing: a plaintext connection is rejected outright.
        std::fs::write(
            data_dir.join("pg_hba.conf"),
            "hostssl all all 127.0.0.1/32 trust\nhostnossl all all 127.0.0.1/32 reject\n",
        )
        .unwrap();
        if let Some(user) = &cluster.run_as {
            for file in ["server.crt", "server.key"] {
                let path = data_dir.join(file).display().to_string();
                assert!(Command::new("chown")
                    .args([user, &path])
                    .status()
                    .unwrap()
                    .success());
            }
        }
        let key = data_dir.join("server.key").display().to_string();
        assert!(Command::new("chmod")
            .args(["600", &key])
            .status()
            .unwrap()
            .success());
        let log = cluster.dir.0.join("server.log").display().to_string();
        cluster.run(
            "pg_ctl",
            &["-D", &data, "-l", &log, "-w", "-t", "60", "-s", "start"],
        );
        Some(cluster)
    }

    fn data(&self) -> String {
        self.dir.0.join("data").display().to_string()
    }

    fn run(&self, tool: &str, args: &[&str]) {
        let program = self.bindir.join(tool);
        let mut cmd = match &self.run_as {
            Some(user) => {
                let mut c = Command::new("runuser");
                c.args(["-u", user, "--"]).arg(&program);
                c
            }
            None => Command::new(&program),
        };
        let out = cmd
            .args(args)
            .current_dir("/")
            .env("LC_ALL", "C")
            .output()
            .unwrap_or_else(|e| panic!("{tool}: {e}"));
        assert!(
            out.status.success(),
            "{tool} failed: {}\n{}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// A URL for `host` (connecting to 127.0.0.1 whatever the name).
    fn url(&self, host: &str, params: &str) -> String {
        format!(
            "postgres://postgres@{host}:{}/postgres?hostaddr=127.0.0.1&{params}",
            self.port
        )
    }
}

impl Drop for TlsCluster {
    fn drop(&mut self) {
        let data = self.data();
        let program = self.bindir.join("pg_ctl");
        let mut cmd = match &self.run_as {
            Some(user) => {
                let mut c = Command::new("runuser");
                c.args(["-u", user, "--"]).arg(&program);
                c
            }
            None => Command::new(&program),
        };
        let _ = cmd
            .args(["-D", &data, "-m", "immediate", "-w", "-s", "stop"])
            .current_dir("/")
            .output();
    }
}

/// A store on `url` with `store_toml` extra `[store]` keys; its first
/// operation's result.
async fn store_check(url: &str, store_toml: &str) -> Result<(), String> {
    let text = format!(
        "[store]\ndatabase_url = {}\ntimeout = \"5s\"\n{store_toml}",
        toml::Value::String(url.into())
    );
    let config = config::parse(&text, "t.toml", &Overrides::default()).unwrap();
    let store = Store::new(&config.store).map_err(|e| e.to_string())?;
    store.migrate().await.map(|_| ()).map_err(|e| e.to_string())
}

#[tokio::test]
async fn postgres_over_tls_follows_libpq_sslmodes() {
    let ca = Ca::new("idemproxy test CA");
    let other = Ca::new("some other CA");
    let files = TempDir::new("pg-tls-ca");
    let ca_file = files.write("ca.pem", &ca.pem());
    let other_file = files.write("other.pem", &other.pem());
    // The server's certificate names `localhost` only.
    // A test that cannot run fails: no silent skip without the binaries.
    let Some(cluster) = TlsCluster::start(&ca.leaf(&["localhost"])) else {
        panic!(
            "this test needs the PostgreSQL server binaries (initdb, pg_ctl, postgres) in \
             IDEMPROXY_PG_BINDIR or /usr/lib/postgresql/*/bin: install the PostgreSQL \
             server package (Debian/Ubuntu: postgresql)"
        );
    };
    let ca_key = format!("ca_file = {}\n", quoted(&ca_file));
    let other_key = format!("ca_file = {}\n", quoted(&other_file));

    // verify-full with the right CA and name: the whole proxy runs on it.
    let url = cluster.url("localhost", "sslmode=verify-full");
    let (upstream, _stop) = start_upstream().await;
    let proxy = start_edited(&Setup::default(), &upstream.url(), &url, |t| {
        with_key(t, "store", ca_key.trim_end())
    })
    .await;
    let client = HttpClient::new();
    let post = || {
        Req::post(&format!("http://{}/v1/orders", proxy.proxy_addr))
            .key("k-pg-tls")
            .json(PAY)
    };
    assert_eq!(client.send(post()).await.status, 201);
    assert!(client.send(post()).await.replayed());
    assert_eq!(upstream.executions("k-pg-tls"), 1);
    // Its connections are encrypted (and could not be otherwise: the
    // cluster rejects plaintext).
    let tls = idemproxy::store::tls::connection(&url, Some(&ca_file)).unwrap();
    let (pg, conn) = tls.config.connect(tls.tls).await.unwrap();
    tokio::spawn(conn);
    let encrypted: i64 = pg
        .query_one(
            "SELECT count(*) FROM pg_stat_ssl JOIN pg_stat_activity USING (pid) \
             WHERE ssl AND application_name = 'idemproxy'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert!(encrypted >= 1, "no encrypted idemproxy connection");
    proxy.shutdown().await;

    // The CA may come from libpq's sslrootcert instead.
    let rootcert = format!(
        "sslmode=verify-full&sslrootcert={}",
        ca_file.display().to_string().replace(' ', "%20")
    );
    store_check(&cluster.url("localhost", &rootcert), "")
        .await
        .unwrap();
    // verify-full checks the name: 127.0.0.1 is not in the certificate…
    let err = store_check(&cluster.url("127.0.0.1", "sslmode=verify-full"), &ca_key)
        .await
        .unwrap_err();
    assert!(err.contains("certificate"), "{err}");
    // …which verify-ca does not compare.
    store_check(&cluster.url("127.0.0.1", "sslmode=verify-ca"), &ca_key)
        .await
        .unwrap();
    // Another CA: refused, whatever the name.
    for mode in ["verify-full", "verify-ca", "require"] {
        let err = store_check(
            &cluster.url("localhost", &format!("sslmode={mode}")),
            &other_key,
        )
        .await
        .unwrap_err();
        assert!(err.contains("certificate"), "{mode}: {err}");
    }
    // require without a CA encrypts without verifying, as libpq does; so
    // does the default (prefer).
    store_check(&cluster.url("127.0.0.1", "sslmode=require"), "")
        .await
        .unwrap();
    store_check(&cluster.url("127.0.0.1", "application_name=x"), "")
        .await
        .unwrap();
    // disable sends plaintext, which this cluster rejects.
    let err = store_check(&cluster.url("localhost", "sslmode=disable"), "")
        .await
        .unwrap_err();
    assert!(
        err.contains("no encryption") || err.contains("pg_hba"),
        "{err}"
    );
    drop(cluster);
}

#[tokio::test]
async fn v1_server_certificate_connects_under_prefer_and_require_and_only_verify_modes_refuse_it() {
    let files = TempDir::new("pg-tls-v1");
    let leaf = v1_self_signed(&files, "localhost");
    let own_ca = files.write("v1.pem", &leaf.cert_pem);
    let Some(cluster) = TlsCluster::start(&leaf) else {
        panic!(
            "this test needs the PostgreSQL server binaries (initdb, pg_ctl, postgres) in \
             IDEMPROXY_PG_BINDIR or /usr/lib/postgresql/*/bin"
        );
    };
    // Nothing is verified under prefer (the default) and require, as in
    // libpq: the certificate's form does not matter.
    for params in ["application_name=x", "sslmode=prefer", "sslmode=require"] {
        store_check(&cluster.url("localhost", params), "")
            .await
            .unwrap_or_else(|e| panic!("{params}: {e}"));
    }
    // The verifying modes refuse it, even trusting the certificate itself:
    // a v1 certificate cannot be checked, and the error says why.
    let trust_it = format!("ca_file = {}\n", quoted(&own_ca));
    for mode in ["verify-ca", "verify-full"] {
        let err = store_check(
            &cluster.url("localhost", &format!("sslmode={mode}")),
            &trust_it,
        )
        .await
        .unwrap_err();
        assert!(err.contains("certificate"), "{mode}: {err}");
        assert!(err.contains("version"), "{mode}: {err}");
    }
    drop(cluster);
}
