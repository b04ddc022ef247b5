//! Test harness: a fresh PostgreSQL database per test, the sample upstream
//! and idemproxy on port-0 sockets, and a small HTTP client.
//!
//! The database server comes from `IDEMPROXY_TEST_DATABASE_URL` (an admin
//! URL on which `CREATE DATABASE` is allowed; `scripts/dev test` provides
//! one), defaulting to `postgres://postgres@127.0.0.1:5432/postgres`.
#![allow(dead_code, unreachable_pub)]

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{HeaderMap, Method, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use idemproxy::app::{self, Running, ServeOptions};
use idemproxy::config::{self, Config, Overrides};
use idemproxy::store::Store;
use sample_upstream::{SampleUpstream, SampleUpstreamHandle};
use tokio::sync::oneshot;
use tokio_postgres::NoTls;

/// The admin URL of the test PostgreSQL server.
pub fn admin_url() -> String {
    std::env::var("IDEMPROXY_TEST_DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".into())
}

/// Replaces the database name in a URL.
fn with_database(url: &str, db: &str) -> String {
    let (base, query) = match url.split_once('?') {
        Some((b, q)) => (b, Some(q)),
        None => (url, None),
    };
    let base = match base.rfind('/') {
        Some(i) if i > base.find("//").map_or(0, |j| j + 1) => &base[..i],
        _ => base,
    };
    match query {
        Some(q) => format!("{base}/{db}?{q}"),
        None => format!("{base}/{db}"),
    }
}

static COUNTER: AtomicU32 = AtomicU32::new(0);

/// A fresh database, dropped when the test ends.
pub struct TestDb {
    pub name: String,
    pub url: String,
}

/// The default collation of a test database.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DbLocale {
    /// The server's template (the test servers are `C`).
    Default,
    /// ICU en-US, as managed PostgreSQL's en_US.UTF-8 sorts text: `a` <
    /// `A` < `b` < `B`, where bytes say `A` < `B` < `a` < `b` (DESIGN §8.5).
    IcuEnUs,
}

impl DbLocale {
    /// `IDEMPROXY_TEST_DB_LOCALE`: unset or `default`, or `icu-en-US`
    /// (`scripts/dev test` runs the state machine a second time with it).
    pub fn from_env() -> DbLocale {
        match std::env::var("IDEMPROXY_TEST_DB_LOCALE").as_deref() {
            Err(_) | Ok("") | Ok("default") => DbLocale::Default,
            Ok("icu-en-US") => DbLocale::IcuEnUs,
            Ok(other) => panic!("IDEMPROXY_TEST_DB_LOCALE={other}: expected icu-en-US or default"),
        }
    }

    fn create_options(self) -> &'static str {
        match self {
            DbLocale::Default => "",
            // LOCALE 'C' sets only the libc categories, which ICU does not
            // use for collation; it exists on every machine.
            DbLocale::IcuEnUs => {
                " TEMPLATE template0 ENCODING 'UTF8' LOCALE_PROVIDER icu ICU_LOCALE 'en-US' LOCALE 'C'"
            }
        }
    }
}

impl TestDb {
    /// A fresh database with the collation of `IDEMPROXY_TEST_DB_LOCALE`.
    pub async fn new() -> TestDb {
        TestDb::with_locale(DbLocale::from_env()).await
    }

    pub async fn with_locale(locale: DbLocale) -> TestDb {
        let name = format!(
            "idemproxy_test_{}_{}_{}",
            std::process::id(),
            COUNTER.fetch_add(1, Ordering::SeqCst),
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .subsec_nanos()
        );
        let admin = admin_client().await;
        admin
            .batch_execute(&format!(
                "CREATE DATABASE {name}{}",
                locale.create_options()
            ))
            .await
            .expect("CREATE DATABASE (is IDEMPROXY_TEST_DATABASE_URL an admin URL?)");
        let url = with_database(&admin_url(), &name);
        let db = TestDb { name, url };
        if locale == DbLocale::IcuEnUs {
            // The database really sorts as en-US (not bytewise).
            let c = db.client().await;
            let order: String = c
                .query_one(
                    "SELECT string_agg(x, ' ' ORDER BY x) FROM unnest(ARRAY['B','a','b','A']) x",
                    &[],
                )
                .await
                .unwrap()
                .get(0);
            assert_eq!(order, "a A b B", "{} does not collate as en-US", db.name);
        }
        db
    }

    /// A direct connection, for assertions on what is stored.
    pub async fn client(&self) -> tokio_postgres::Client {
        connect(&self.url).await
    }
}

impl Drop for TestDb {
    fn drop(&mut self) {
        let name = self.name.clone();
        // Drop runs inside the test's runtime: use a thread of our own.
        let _ = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async {
                let admin = admin_client().await;
                let _ = admin
                    .batch_execute(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
                    .await;
            });
        })
        .join();
    }
}

pub async fn connect(url: &str) -> tokio_postgres::Client {
    let (client, conn) = tokio_postgres::connect(url, NoTls)
        .await
        .unwrap_or_else(|e| panic!("connecting to the test database: {e}"));
    tokio::spawn(async move {
        let _ = conn.await;
    });
    client
}

async fn admin_client() -> tokio_postgres::Client {
    connect(&admin_url()).await
}

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
        let db = TestDb::new().await;
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
    let running = app::start(config, ServeOptions::default()).await.unwrap();
    if wait && setup.database_url.is_none() {
        wait_ready(running.admin_addr).await;
    }
    running
}

pub async fn wait_ready(admin: SocketAddr) {
    let client = HttpClient::new();
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let r = client
            .send(Req::get(&format!("http://{admin}/readyz/store")))
            .await;
        if r.status == StatusCode::OK {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "proxy never became ready: {}",
            r.text()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A request to send.
#[derive(Clone, Debug)]
pub struct Req {
    pub method: Method,
    pub path: String,
    pub headers: Vec<(String, Vec<u8>)>,
    pub body: Bytes,
}

impl Req {
    pub fn new(method: Method, url: &str) -> Req {
        Req {
            method,
            path: url.into(),
            headers: Vec::new(),
            body: Bytes::new(),
        }
    }
    pub fn post(url: &str) -> Req {
        Req::new(Method::POST, url)
    }
    pub fn get(url: &str) -> Req {
        Req::new(Method::GET, url)
    }
    fn at(mut self, url: &str) -> Req {
        self.path = url.into();
        self
    }
    pub fn header(mut self, name: &str, value: impl AsRef<[u8]>) -> Req {
        self.headers.push((name.into(), value.as_ref().to_vec()));
        self
    }
    pub fn key(self, key: &str) -> Req {
        self.header("Idempotency-Key", key)
    }
    pub fn json(mut self, body: &str) -> Req {
        self.body = Bytes::copy_from_slice(body.as_bytes());
        self.header("Content-Type", "application/json")
    }
    pub fn body(mut self, body: impl Into<Bytes>) -> Req {
        self.body = body.into();
        self
    }
}

/// A response, read whole.
#[derive(Debug, Clone)]
pub struct Resp {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Bytes,
}

impl Resp {
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {}", self.text()))
    }
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }
    pub fn replayed(&self) -> bool {
        self.header("idempotent-replayed") == Some("true")
    }
    /// The upstream's execution number (sample upstream header).
    pub fn execution(&self) -> Option<u64> {
        self.header("x-sample-execution")
            .and_then(|v| v.parse().ok())
    }
    /// Asserts a proxy problem of the given type slug and status.
    pub fn assert_problem(&self, status: u16, slug: &str) {
        assert_eq!(self.status.as_u16(), status, "{}", self.text());
        assert_eq!(
            self.header("content-type"),
            Some("application/problem+json"),
            "{}",
            self.text()
        );
        let v = self.json();
        assert_eq!(
            v["type"],
            format!("urn:idemproxy:problem:{slug}"),
            "{}",
            self.text()
        );
        assert_eq!(v["status"], status);
        assert!(v["title"].is_string() && v["detail"].is_string());
    }
}

/// An HTTP/1.1 client (or h2c with `http2_only`).
#[derive(Clone)]
pub struct HttpClient {
    client: Client<HttpConnector, Full<Bytes>>,
}

impl Default for HttpClient {
    fn default() -> Self {
        Self::new()
    }
}

impl HttpClient {
    pub fn new() -> Self {
        HttpClient {
            client: Client::builder(TokioExecutor::new()).build(HttpConnector::new()),
        }
    }

    pub fn h2c() -> Self {
        HttpClient {
            client: Client::builder(TokioExecutor::new())
                .http2_only(true)
                .build(HttpConnector::new()),
        }
    }

    pub async fn send(&self, req: Req) -> Resp {
        self.try_send(req).await.expect("request failed")
    }

    pub async fn try_send(&self, req: Req) -> Result<Resp, String> {
        let mut b = Request::builder().method(req.method).uri(&req.path);
        for (n, v) in &req.headers {
            b = b.header(n.as_str(), v.as_slice());
        }
        let request = b.body(Full::new(req.body)).map_err(|e| e.to_string())?;
        let resp = tokio::time::timeout(Duration::from_secs(30), self.client.request(request))
            .await
            .map_err(|_| "timed out".to_string())?
            .map_err(|e| format!("{e:?}"))?;
        let (parts, body) = resp.into_parts();
        let body = body.collect().await.map_err(|e| e.to_string())?.to_bytes();
        Ok(Resp {
            status: parts.status,
            headers: parts.headers,
            body,
        })
    }
}

// ---------------------------------------------------------------------------
// Helpers for tests/operations.rs and tests/cli.rs.

/// The URL of database `name` on the test server (which may not exist yet).
pub fn database_url(name: &str) -> String {
    with_database(&admin_url(), name)
}

/// A database name no other test uses (the database is not created).
pub fn unique_database_name(tag: &str) -> String {
    format!(
        "idemproxy_test_{tag}_{}_{}_{}",
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::SeqCst),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .subsec_nanos()
    )
}

/// Claims `key` for `tenant` (as stored) directly through the store, as an
/// owner that never completes would: the record stays in flight.
pub async fn claim_in_flight(
    store: &Store,
    tenant: &str,
    key: &str,
    lease: Duration,
    retention: Duration,
) -> idemproxy::idempotency::OwnerToken {
    use idemproxy::idempotency::{
        Fingerprint, FingerprintMode, IdempotencyKey, OwnerToken, RecordKey, TenantId,
    };
    use idemproxy::store::ClaimResult;
    let fp = Fingerprint::compute(
        FingerprintMode::Bytes,
        "POST",
        "/",
        None,
        None,
        key.as_bytes(),
    );
    let owner = OwnerToken::mint();
    let result = store
        .claim(
            &RecordKey::new(
                TenantId::from_stored(tenant),
                IdempotencyKey::parse(key.as_bytes(), 255).unwrap(),
            ),
            &fp,
            owner,
            lease,
            retention,
        )
        .await
        .unwrap();
    assert!(
        matches!(result, ClaimResult::Claimed(_)),
        "{key} was already claimed"
    );
    owner
}
