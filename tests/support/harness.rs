//! The in-process harness: the sample upstream and idemproxy on port-0
//! sockets in the test's own runtime, on a fresh database ([`Harness`]),
//! configured by a [`Setup`].

use std::net::SocketAddr;
use std::time::Duration;

use http::StatusCode;
use idemproxy::app::{self, Running, ServeOptions};
use idemproxy::config::{self, Config, Overrides};
use idemproxy::store::Store;
use sample_upstream::{SampleUpstream, SampleUpstreamHandle};
use tokio::sync::oneshot;

use super::db::TestDb;
use super::http::{HttpClient, Req, Resp};
use super::{eventually, poll_until};

/// Starts the sample upstream on a port-0 socket; it stops with the handle's
/// guard.
pub async fn start_upstream() -> (SampleUpstreamHandle, oneshot::Sender<()>) {
    let (tx, rx) = oneshot::channel::<()>();
    let handle = SampleUpstream::start("127.0.0.1:0".parse().unwrap(), async move {
        let _ = rx.await;
    })
    .await
    .unwrap();
    (handle, tx)
}

/// What a test can tune in the proxy's configuration.
#[derive(Clone)]
pub struct Setup {
    /// Body of `[defaults]`.
    pub defaults: String,
    /// `[[route]]` tables (may be empty: the catch-all route applies).
    pub routes: String,
    /// Extra `[store]` keys.
    pub store: String,
    /// Extra `[server]` keys.
    pub server: String,
    /// `upstream.timeout`.
    pub upstream_timeout: String,
    /// Overrides the upstream URL (e.g. a closed port).
    pub upstream_url: Option<String>,
    /// Overrides the database URL (e.g. an unreachable one).
    pub database_url: Option<String>,
}

impl Default for Setup {
    fn default() -> Self {
        Setup {
            defaults: "lease = \"2s\"\n".into(),
            routes: String::new(),
            store: String::new(),
            server: String::new(),
            upstream_timeout: "10s".into(),
            upstream_url: None,
            database_url: None,
        }
    }
}

impl Setup {
    pub fn defaults(mut self, toml: &str) -> Self {
        self.defaults = toml.into();
        self
    }
    pub fn routes(mut self, toml: &str) -> Self {
        self.routes = toml.into();
        self
    }
    pub fn store(mut self, toml: &str) -> Self {
        self.store = toml.into();
        self
    }
    pub fn server(mut self, toml: &str) -> Self {
        self.server = toml.into();
        self
    }
    pub fn upstream_timeout(mut self, t: &str) -> Self {
        self.upstream_timeout = t.into();
        self
    }
    pub fn upstream_url(mut self, url: &str) -> Self {
        self.upstream_url = Some(url.into());
        self
    }
    pub fn database_url(mut self, url: &str) -> Self {
        self.database_url = Some(url.into());
        self
    }

    /// The configuration text for this setup.
    pub fn toml(&self, upstream: &str, database: &str) -> String {
        format!(
            r#"
[server]
listen = "127.0.0.1:0"
admin_listen = "127.0.0.1:0"
shutdown_grace = "5s"
{server}

[upstream]
url = "{upstream}"
connect_timeout = "1s"
timeout = "{timeout}"

[store]
database_url = "{database}"
timeout = "2s"
pool_size = 8
{store}

[sweeper]
interval = "1h"

[defaults]
{defaults}

{routes}
"#,
            server = self.server,
            upstream = self.upstream_url.as_deref().unwrap_or(upstream),
            timeout = self.upstream_timeout,
            database = self.database_url.as_deref().unwrap_or(database),
            store = self.store,
            defaults = self.defaults,
            routes = self.routes,
        )
    }

    pub fn config(&self, upstream: &str, database: &str) -> Config {
        config::parse(
            &self.toml(upstream, database),
            "test.toml",
            &Overrides::default(),
        )
        .unwrap_or_else(|e| panic!("test configuration is invalid:\n{e}"))
    }
}

/// A proxy in front of the sample upstream, on a fresh database.
pub struct Harness {
    pub db: TestDb,
    pub upstream: SampleUpstreamHandle,
    _stop_upstream: oneshot::Sender<()>,
    pub proxy: Option<Running>,
    pub setup: Setup,
    pub client: HttpClient,
}

impl Harness {
    pub async fn start(setup: Setup) -> Harness {
        Harness::start_on(setup, TestDb::new().await).await
    }

    /// [`Harness::start`] on a database the caller made (the Citus tests:
    /// a schema of their own on the cluster, see [`super::citus`]).
    pub async fn start_on(setup: Setup, db: TestDb) -> Harness {
        let (upstream, stop) = start_upstream().await;
        let running = start_proxy(&setup, &upstream.url(), &db.url, true).await;
        Harness {
            db,
            upstream,
            _stop_upstream: stop,
            proxy: Some(running),
            setup,
            client: HttpClient::new(),
        }
    }

    pub fn running(&self) -> &Running {
        self.proxy.as_ref().expect("proxy running")
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{}", self.running().proxy_addr, path)
    }

    pub fn admin_url(&self, path: &str) -> String {
        format!("http://{}{}", self.running().admin_addr, path)
    }

    /// A POST with a key and a JSON body.
    pub async fn post(&self, path: &str, key: &str, body: &str) -> Resp {
        self.client
            .send(Req::post(&self.url(path)).key(key).json(body))
            .await
    }

    /// A keyed POST whose answer the sample upstream delays by `delay_ms`,
    /// sent from a task of its own: the original of a test of duplicates.
    pub fn spawn_slow(
        &self,
        path: &str,
        key: &str,
        body: &str,
        delay_ms: u64,
    ) -> tokio::task::JoinHandle<Resp> {
        let client = self.client.clone();
        let req = Req::post(&self.url(path))
            .key(key)
            .json(body)
            .header("x-sample-delay-ms", delay_ms.to_string());
        tokio::spawn(async move { client.send(req).await })
    }

    /// One series of the proxy's `/metrics` (see [`super::http::metric_value`]).
    pub fn metric(&self, series: &str) -> f64 {
        super::http::metric_value(&self.running().metrics.render(), series)
    }

    pub async fn send(&self, req: Req) -> Resp {
        let url = self.url(&req.path);
        self.client.send(req.at(&url)).await
    }

    /// Stops the proxy (drain) and starts a new one on the same database.
    pub async fn restart_proxy(&mut self) {
        if let Some(p) = self.proxy.take() {
            p.shutdown().await;
        }
        self.proxy = Some(start_proxy(&self.setup, &self.upstream.url(), &self.db.url, true).await);
    }

    /// A second replica on the same database and upstream.
    pub async fn replica(&self) -> Running {
        start_proxy(&self.setup, &self.upstream.url(), &self.db.url, true).await
    }

    /// A store handle on the test database, with the setup's store config.
    pub fn store(&self) -> Store {
        Store::new(&self.setup.config(&self.upstream.url(), &self.db.url).store).unwrap()
    }

    /// The stored record's state for a key, or None.
    pub async fn record_state(&self, tenant: &str, key: &str) -> Option<(String, i32)> {
        let c = self.db.client().await;
        c.query_opt(
            "SELECT state, attempt FROM idempotency_records WHERE tenant_id = $1 AND idempotency_key = $2",
            &[&tenant, &key],
        )
        .await
        .unwrap()
        .map(|r| (r.get(0), r.get(1)))
    }

    /// Waits until the upstream has executed `key` `n` times. Once the
    /// original of a key is executed it is claimed (the claim commits
    /// before the upstream call) and, while the upstream delays its
    /// answer, in flight: what a test of duplicates waits for.
    pub async fn wait_executions(&self, key: &str, n: u64) {
        let what = format!("{n} executions of {key} at the upstream");
        eventually(Duration::from_secs(10), what, || async {
            self.upstream.executions(key) >= n
        })
        .await
    }

    /// The database's clock now, for [`Harness::wait_listener_since`].
    pub async fn db_now(&self) -> String {
        let c = self.db.client().await;
        c.query_one("SELECT now()::text", &[]).await.unwrap().get(0)
    }

    /// Waits until a connection opened after `since` (from
    /// [`Harness::db_now`]) has subscribed to the key channel: a replica
    /// started after `since` then hears the others' completions.
    pub async fn wait_listener_since(&self, since: &str) {
        let c = self.db.client().await;
        eventually(
            Duration::from_secs(10),
            "a new LISTEN connection",
            || async {
                let n: i64 = c
                    .query_one(
                        "SELECT count(*) FROM pg_stat_activity
                      WHERE datname = $1 AND backend_start > $2::text::timestamptz
                        AND query LIKE 'LISTEN %'",
                        &[&self.db.name, &since],
                    )
                    .await
                    .unwrap()
                    .get(0);
                n > 0
            },
        )
        .await
    }

    pub async fn record_count(&self) -> i64 {
        let c = self.db.client().await;
        c.query_one("SELECT count(*) FROM idempotency_records", &[])
            .await
            .unwrap()
            .get(0)
    }
}

/// Starts a proxy and waits until it is ready (when `wait` and the
/// database is reachable).
pub async fn start_proxy(setup: &Setup, upstream: &str, db: &str, wait: bool) -> Running {
    let config = setup.config(upstream, db);
    // Two workers whatever the machine, so that every test runs with
    // connections on more than one thread (max_connections shared, pools
    // per worker, the drain of all of them).
    let options = ServeOptions {
        workers: 2,
        ..ServeOptions::default()
    };
    let running = app::start(config, options).await.unwrap();
    if wait && setup.database_url.is_none() {
        wait_ready(running.admin_addr).await;
    }
    running
}

/// Waits until `/readyz/store` answers 200 (the store reachable and
/// migrated: keyed requests can succeed).
pub async fn wait_ready(admin: SocketAddr) {
    let client = HttpClient::new();
    let url = format!("http://{admin}/readyz/store");
    poll_until(Duration::from_secs(20), "the proxy to be ready", || async {
        let r = client.send(Req::get(&url)).await;
        if r.status == StatusCode::OK {
            Ok(())
        } else {
            Err(r.text())
        }
    })
    .await
}
