//! `idemproxy serve` as a child process ([`ProxyProc`]) on fixed ports, for
//! tests that kill, pause and restart replicas; its configuration
//! ([`ProxyConfig`]).

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use http::StatusCode;

use super::http::{metric_value, HttpClient, Req, Resp};
use super::poll_every;
use super::process::{free_port, Proc, TempDir};

/// The knobs the fault tests turn; everything else is the built-in default.
#[derive(Clone, Debug)]
pub struct ProxyConfig {
    pub upstream: String,
    pub database_url: String,
    pub lease: String,
    pub upstream_timeout: String,
    pub shutdown_grace: String,
    pub store_timeout: String,
    pub pool_size: usize,
    /// Extra `[defaults]` lines.
    pub defaults: String,
    /// Extra `[store]` lines (`prepared_statements`, `listen_url`, …).
    pub store: String,
    /// `[[route]]` tables (none: the built-in catch-all route).
    pub routes: String,
    /// The child's `RUST_LOG` (`info` unless a test turns it up).
    pub rust_log: String,
    /// More environment variables for the child (`IDEMPROXY_<SECTION>_<KEY>`).
    pub env: Vec<(String, String)>,
}

impl ProxyConfig {
    pub fn new(upstream: &str, database_url: &str) -> ProxyConfig {
        ProxyConfig {
            upstream: upstream.into(),
            database_url: database_url.into(),
            lease: "1s".into(),
            upstream_timeout: "10s".into(),
            shutdown_grace: "5s".into(),
            store_timeout: "1s".into(),
            pool_size: 8,
            defaults: String::new(),
            store: String::new(),
            routes: String::new(),
            rust_log: "info".into(),
            env: Vec::new(),
        }
    }
    /// Behind a pooler in transaction mode: no named prepared statements,
    /// and `listen_url` (a direct session) for LISTEN and migrations.
    pub fn pooled(mut self, direct_url: &str) -> Self {
        self.store.push_str(&format!(
            "prepared_statements = false\nlisten_url = \"{direct_url}\"\n"
        ));
        self
    }
    pub fn lease(mut self, d: &str) -> Self {
        self.lease = d.into();
        self
    }
    pub fn upstream_timeout(mut self, d: &str) -> Self {
        self.upstream_timeout = d.into();
        self
    }
    pub fn shutdown_grace(mut self, d: &str) -> Self {
        self.shutdown_grace = d.into();
        self
    }
    pub fn store_timeout(mut self, d: &str) -> Self {
        self.store_timeout = d.into();
        self
    }

    pub fn toml(&self, listen: SocketAddr, admin: SocketAddr) -> String {
        format!(
            r#"# Written by a fault test.
[server]
listen = "{listen}"
admin_listen = "{admin}"
shutdown_grace = "{grace}"

[upstream]
url = "{upstream}"
connect_timeout = "1s"
timeout = "{upstream_timeout}"

[store]
database_url = "{db}"
timeout = "{store_timeout}"
pool_size = {pool}
{store}

[sweeper]
interval = "1h"

[defaults]
lease = "{lease}"
{defaults}

{routes}
"#,
            grace = self.shutdown_grace,
            upstream = self.upstream,
            upstream_timeout = self.upstream_timeout,
            db = self.database_url,
            store_timeout = self.store_timeout,
            pool = self.pool_size,
            lease = self.lease,
            defaults = self.defaults,
            store = self.store,
            routes = self.routes,
        )
    }
}

/// An `idemproxy serve` process on fixed ports (restarts keep them).
pub struct ProxyProc {
    pub proc: Proc,
    pub listen: SocketAddr,
    pub admin: SocketAddr,
    /// Its configuration file.
    pub config_path: std::path::PathBuf,
}

impl ProxyProc {
    /// Writes the configuration and starts the process; does not wait.
    pub fn spawn(dir: &TempDir, name: &str, config: &ProxyConfig) -> ProxyProc {
        let listen: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
        let admin: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
        let path = dir.join(&format!("{name}.toml"));
        std::fs::write(&path, config.toml(listen, admin)).unwrap();
        let mut proc = Proc::new(
            name,
            env!("CARGO_BIN_EXE_idemproxy"),
            vec![
                "serve".into(),
                "--config".into(),
                path.display().to_string(),
            ],
            dir.join(&format!("{name}.log")),
        )
        .env("RUST_LOG", &config.rust_log);
        for (k, v) in &config.env {
            proc = proc.env(k, v);
        }
        proc.spawn(false);
        ProxyProc {
            proc,
            listen,
            admin,
            config_path: path,
        }
    }

    /// Writes `config` (on the same ports) over its configuration file, for
    /// a reload.
    pub fn rewrite_config(&self, config: &ProxyConfig) {
        std::fs::write(&self.config_path, config.toml(self.listen, self.admin)).unwrap();
    }

    /// Starts the process and waits until `/readyz/store` answers 200 (the
    /// store reachable and migrated: keyed requests can succeed).
    pub async fn start(dir: &TempDir, name: &str, config: &ProxyConfig) -> ProxyProc {
        let p = ProxyProc::spawn(dir, name, config);
        p.wait_ready(Duration::from_secs(20)).await;
        p
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{}", self.listen, path)
    }

    pub fn admin_url(&self, path: &str) -> String {
        format!("http://{}{}", self.admin, path)
    }

    /// `GET /readyz` (None if the admin listener does not answer).
    pub async fn readyz(&self) -> Option<Resp> {
        self.admin_get("/readyz").await
    }

    pub async fn admin_get(&self, path: &str) -> Option<Resp> {
        tokio::time::timeout(
            Duration::from_secs(3),
            HttpClient::new().try_send(Req::get(&self.admin_url(path))),
        )
        .await
        .ok()?
        .ok()
    }

    /// `GET /readyz/store` (None if the admin listener does not answer).
    pub async fn store_readyz(&self) -> Option<Resp> {
        self.admin_get("/readyz/store").await
    }

    /// Waits until `/readyz/store` answers 200.
    pub async fn wait_ready(&self, timeout: Duration) -> Duration {
        let started = Instant::now();
        // Every 25 ms, as before: each probe is a store query, which the
        // pooler tests run through PgBouncer.
        let ready = poll_every(Duration::from_millis(25), timeout, || async {
            let r = self.store_readyz().await?;
            (r.status == StatusCode::OK).then_some(())
        })
        .await;
        assert!(
            ready.is_some(),
            "{} not ready within {timeout:?}\n{}",
            self.proc.name,
            self.proc.log_tail(30)
        );
        started.elapsed()
    }

    /// Waits until `/readyz` answers 200 (listening, not draining), whatever
    /// the store's state.
    pub async fn wait_listening(&self, timeout: Duration) {
        let ready = poll_every(Duration::from_millis(25), timeout, || async {
            let r = self.readyz().await?;
            (r.status == StatusCode::OK).then_some(())
        })
        .await;
        assert!(
            ready.is_some(),
            "{} not listening within {timeout:?}\n{}",
            self.proc.name,
            self.proc.log_tail(30)
        );
    }

    /// The Prometheus text of `/metrics`.
    pub async fn metrics(&self) -> String {
        HttpClient::new()
            .send(Req::get(&self.admin_url("/metrics")))
            .await
            .text()
    }

    /// The value of one sample line of `/metrics` (0 if absent).
    pub async fn metric(&self, series: &str) -> f64 {
        metric_value(&self.metrics().await, series)
    }

    /// SIGKILL, then start again on the same ports and wait until ready.
    pub async fn restart(&mut self) {
        self.proc.kill();
        self.proc.spawn(false);
        self.wait_ready(Duration::from_secs(20)).await;
    }

    /// Sends a keyed POST (fresh connection) with a bounded wait.
    pub async fn post(&self, key: &str, body: &str, headers: &[(&str, &str)]) -> Resp {
        self.try_post(key, body, headers, Duration::from_secs(20))
            .await
            .unwrap_or_else(|e| panic!("POST {key} via {}: {e}", self.proc.name))
    }

    pub async fn try_post(
        &self,
        key: &str,
        body: &str,
        headers: &[(&str, &str)],
        timeout: Duration,
    ) -> Result<Resp, String> {
        let mut req = Req::post(&self.url("/v1/orders")).key(key).json(body);
        for (n, v) in headers {
            req = req.header(n, v);
        }
        match tokio::time::timeout(timeout, HttpClient::new().try_send(req)).await {
            Ok(r) => r,
            Err(_) => Err(format!("no answer within {timeout:?}")),
        }
    }
}
