//! Wiring: build every component from a [`Config`], run them, drain them.
//!
//! `serve` starts even when the database is unreachable: it listens,
//! answers keyed requests with 503, passes the rest through, reports ready
//! (readiness never depends on the shared store, DESIGN.md §8.1), and keeps
//! trying (with backoff) to connect and migrate. Every task it spawns
//! belongs to the [`Lifecycle`], which drains them on shutdown.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, PoisonError, RwLock};
use std::time::Duration;

use anyhow::Context;
use http::{Request, Response};
use hyper::body::Incoming;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

use crate::admin::{Admin, ReloadStatus, StoreHealth};
use crate::backoff::Backoff;
use crate::cache::ResponseCache;
use crate::config::{self, Config, ConfigError};
use crate::lease::Renewer;
use crate::lifecycle::Lifecycle;
use crate::metrics::Metrics;
use crate::proxy::upstream::Upstream;
use crate::proxy::{ClientInfo, Proxy, ProxyBody};
use crate::server::{ConnectionLimits, Handler};
use crate::store::{notify, Store};
use crate::waiters::Waiters;
use crate::workers::Workers;
use crate::{server, sweeper};

/// Options of `serve` that are not configuration.
#[derive(Debug, Clone, Copy)]
pub struct ServeOptions {
    /// Apply pending migrations at start (in the background, retried).
    pub migrate: bool,
    /// Run the retention sweeper.
    pub sweeper: bool,
    /// Worker threads serving the proxy listener ([`crate::workers`]).
    pub workers: usize,
}

impl Default for ServeOptions {
    fn default() -> Self {
        ServeOptions {
            migrate: true,
            sweeper: true,
            workers: crate::workers::available(),
        }
    }
}

/// A running proxy.
pub struct Running {
    /// Where the proxy listens.
    pub proxy_addr: SocketAddr,
    /// Where the admin endpoints listen.
    pub admin_addr: SocketAddr,
    /// The process's metrics.
    pub metrics: Arc<Metrics>,
    lifecycle: Lifecycle,
    grace: Duration,
    proxy_task: JoinHandle<()>,
    /// The threads serving the proxy listener, kept until the drain ends.
    workers: Workers,
    reloader: Reloader,
}

/// The proxy the listener serves. A reload replaces it whole; a request
/// keeps the one it started with (its routes, policies, upstream and
/// timeouts) until it ends, owned work included.
///
/// A `RwLock<Arc<_>>` rather than a crate such as `arc-swap`: the read
/// lock is held only to clone the `Arc` (never across an await), writers
/// are rare signals, and it costs no dependency.
pub struct LiveProxy {
    current: RwLock<Arc<Proxy>>,
}

impl LiveProxy {
    fn new(proxy: Arc<Proxy>) -> Self {
        LiveProxy {
            current: RwLock::new(proxy),
        }
    }

    /// The proxy new requests get.
    pub fn current(&self) -> Arc<Proxy> {
        self.current
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    fn replace(&self, proxy: Arc<Proxy>) {
        *self.current.write().unwrap_or_else(PoisonError::into_inner) = proxy;
    }
}

impl Handler for LiveProxy {
    fn limits(&self) -> ConnectionLimits {
        // Restart-only: every proxy a reload builds has the same.
        self.current().limits()
    }

    // Not `async`: the proxy's own future is returned as it is, not
    // wrapped in (and moved into) another one per request.
    fn call(
        self: Arc<Self>,
        req: Request<Incoming>,
        client: ClientInfo,
    ) -> impl Future<Output = Response<ProxyBody>> + Send {
        self.current().call(req, client)
    }
}

/// What a reload did: the label of `idemproxy_config_reloads_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReloadResult {
    /// The new configuration applies to new requests.
    Ok,
    /// It applies, except the changes that need a restart (kept as they
    /// run, each logged).
    RestartRequired,
    /// Refused (invalid, or the upstream client could not be built): the
    /// running configuration is kept.
    Error,
    /// Nothing to do: no configuration file, or draining.
    Skipped,
}

impl ReloadResult {
    /// The metric's label.
    pub fn as_str(self) -> &'static str {
        match self {
            ReloadResult::Ok => "ok",
            ReloadResult::RestartRequired => "restart_required",
            ReloadResult::Error => "error",
            ReloadResult::Skipped => "skipped",
        }
    }
}

/// What a reload needs: the live proxy and the parts every proxy shares.
/// Cheap to clone.
#[derive(Clone)]
pub struct Reloader {
    live: Arc<LiveProxy>,
    /// One reload at a time: concurrent signals are applied in turn.
    lock: Arc<tokio::sync::Mutex<()>>,
    status: Arc<ReloadStatus>,
    parts: Parts,
}

/// The parts every proxy shares, whatever its configuration.
#[derive(Clone)]
struct Parts {
    store: Store,
    metrics: Arc<Metrics>,
    waiters: Arc<Waiters>,
    renewer: Arc<Renewer>,
    cache: Arc<ResponseCache>,
    lifecycle: Lifecycle,
    /// Whether the LISTEN task runs (wake-ups for `wait`).
    listening: Arc<AtomicBool>,
    /// Upstream pools to build ([`Upstream::with_lanes`]).
    upstream_lanes: usize,
}

impl Parts {
    fn proxy(&self, config: Arc<Config>, upstream: Upstream) -> Proxy {
        Proxy::new(
            config,
            self.store.clone(),
            upstream,
            self.metrics.clone(),
            self.waiters.clone(),
            self.renewer.clone(),
            self.cache.clone(),
            self.lifecycle.clone(),
        )
    }

    /// Starts the one LISTEN connection of the process if `config` needs
    /// it (a route that waits, or the response cache) and it is not
    /// running: wake-ups for waiting duplicates, invalidations for the
    /// cache.
    fn listen_if_needed(&self, config: &Config) {
        let needed = config.routes.iter().any(|r| !r.policy.wait.is_zero())
            || config.store.response_cache > 0;
        if !needed || self.listening.swap(true, Ordering::SeqCst) {
            return;
        }
        let (w1, c1, w2, c2) = (
            self.waiters.clone(),
            self.cache.clone(),
            self.waiters.clone(),
            self.cache.clone(),
        );
        self.lifecycle.spawn_background(notify::listen(
            self.store.clone(),
            move |id| {
                c1.invalidate(id);
                w1.wake(id);
            },
            move || {
                c2.clear();
                w2.wake_all();
            },
            self.lifecycle.stop_token(),
        ));
    }
}

impl Reloader {
    /// Applies a configuration read again (SIGHUP): `None` when there is no
    /// file to read. See `config::reload` for what applies and what needs
    /// a restart. Logged, counted, and shown on `/readyz`.
    pub async fn reload(&self, fresh: Option<Result<Config, ConfigError>>) -> ReloadResult {
        let _one_at_a_time = self.lock.lock().await;
        let (result, note) = self.apply(fresh);
        self.parts.metrics.config_reload(result.as_str());
        self.status.record(result.as_str(), &note);
        result
    }

    /// Counts a reload that was not attempted (the signal came while
    /// draining).
    pub fn skip(&self, why: &str) {
        warn!("configuration reload skipped: {why}");
        self.parts
            .metrics
            .config_reload(ReloadResult::Skipped.as_str());
        self.status.record(ReloadResult::Skipped.as_str(), why);
    }

    fn apply(&self, fresh: Option<Result<Config, ConfigError>>) -> (ReloadResult, String) {
        if self.parts.lifecycle.draining() {
            warn!("configuration reload skipped: draining");
            return (ReloadResult::Skipped, "draining".into());
        }
        let fresh = match fresh {
            None => {
                warn!("configuration reload skipped: serve runs without a configuration file, so there is nothing to read again");
                return (ReloadResult::Skipped, "no configuration file".into());
            }
            Some(Err(e)) => {
                for problem in &e.problems {
                    error!(%problem, "configuration reload refused");
                }
                error!(
                    problems = e.problems.len(),
                    "configuration reload refused: the running configuration is kept"
                );
                return (
                    ReloadResult::Error,
                    format!(
                        "{} problem(s); the running configuration is kept",
                        e.problems.len()
                    ),
                );
            }
            Some(Ok(config)) => config,
        };
        let current = self.live.current();
        let running = current.config();
        let changes = config::restart_only_changes(running, &fresh);
        for (key, kept, wanted) in &changes {
            warn!(key = %key, running = %kept, new = %wanted, "configuration reload: this change needs a restart; the running value is kept");
        }
        let applied = fresh.keeping_restart_only(running);
        let upstream = match Upstream::with_lanes(&applied.upstream, self.parts.upstream_lanes) {
            Ok(upstream) => upstream,
            Err(e) => {
                error!(error = %format!("{e:#}"), "configuration reload refused: the upstream client cannot be built; the running configuration is kept");
                return (
                    ReloadResult::Error,
                    "upstream client; the running configuration is kept".into(),
                );
            }
        };
        for warning in applied.warnings() {
            warn!("{warning}");
        }
        let config = Arc::new(applied);
        self.parts
            .renewer
            .tick_at_most(crate::lease::tick_for(shortest_lease(&config)));
        self.parts.listen_if_needed(&config);
        let routes = config.routes.len();
        self.live
            .replace(Arc::new(self.parts.proxy(config, upstream)));
        if changes.is_empty() {
            info!(routes, "configuration reloaded: new requests use it");
            (ReloadResult::Ok, String::new())
        } else {
            info!(
                routes,
                needing_restart = changes.len(),
                "configuration reloaded but for changes that need a restart: new requests use it"
            );
            let keys: Vec<&str> = changes.iter().map(|(k, _, _)| k.as_str()).collect();
            (
                ReloadResult::RestartRequired,
                format!("needs a restart: {}", keys.join(", ")),
            )
        }
    }
}

/// The shortest lease of any route.
fn shortest_lease(config: &Config) -> Duration {
    config
        .routes
        .iter()
        .map(|r| r.policy.lease)
        .min()
        .unwrap_or(Duration::from_secs(10))
}

impl Running {
    /// Drains: report not-ready, stop accepting, let open connections and
    /// every request that owns a claim (its client gone or not) and every
    /// background completion retry finish, all within
    /// `server.shutdown_grace`; then stop the background tasks and the
    /// admin listener. Returns whether all work finished in time.
    pub async fn shutdown(self) -> bool {
        let deadline = tokio::time::Instant::now() + self.grace;
        self.lifecycle.start_drain();
        let _ = self.proxy_task.await;
        let finished = self.lifecycle.drain_work(deadline).await;
        self.lifecycle.stop_background(Duration::from_secs(2)).await;
        self.workers.release();
        finished
    }

    /// The process's lifecycle (tests watch its work).
    pub fn lifecycle(&self) -> &Lifecycle {
        &self.lifecycle
    }

    /// What reloads the configuration (it outlives the drain's start, so
    /// a signal during the drain can still be counted).
    pub fn reloader(&self) -> Reloader {
        self.reloader.clone()
    }

    /// The proxy (and so the configuration) new requests get.
    pub fn proxy(&self) -> Arc<Proxy> {
        self.reloader.live.current()
    }
}

/// Builds and starts everything.
pub async fn start(config: Config, options: ServeOptions) -> anyhow::Result<Running> {
    let config = Arc::new(config);
    let lifecycle = Lifecycle::new();
    // A database and an upstream pool per worker, and one for the main
    // runtime: connections stay on the thread that drives them.
    let lanes = options.workers + 1;
    let store = Store::with_lanes(&config.store, lanes).context("building the database pool")?;
    let upstream =
        Upstream::with_lanes(&config.upstream, lanes).context("building the upstream client")?;
    let tls = match &config.server.tls {
        Some(files) => Some(
            crate::tls::server_acceptor(files).context("setting up TLS on the proxy listener")?,
        ),
        None => None,
    };
    let metrics = Arc::new(Metrics::new());
    let proxy_listener = TcpListener::bind(config.server.listen)
        .await
        .with_context(|| format!("binding the proxy listener on {}", config.server.listen))?;
    let admin_listener = TcpListener::bind(config.server.admin_listen)
        .await
        .with_context(|| {
            format!(
                "binding the admin listener on {}",
                config.server.admin_listen
            )
        })?;
    let proxy_addr = proxy_listener.local_addr()?;
    let admin_addr = admin_listener.local_addr()?;
    let stop = lifecycle.stop_token();

    if options.migrate {
        lifecycle.spawn_background(migrate_with_backoff(store.clone(), stop.clone()));
    }
    if options.sweeper {
        lifecycle.spawn_background(sweeper::run(
            store.clone(),
            metrics.clone(),
            config.sweeper.clone(),
            stop.clone(),
        ));
    }
    let health = Arc::new(StoreHealth::new(store.clone(), metrics.clone()));
    lifecycle.spawn_background(health.clone().monitor(stop.clone()));

    let waiters = Arc::new(Waiters::new(config.server.max_waiters));
    let cache = Arc::new(ResponseCache::new(
        config.store.response_cache,
        config.store.response_cache_ttl,
        config.store.timeout,
    ));
    let renewer = Arc::new(Renewer::new(
        store.clone(),
        metrics.clone(),
        crate::lease::tick_for(shortest_lease(&config)),
    ));
    // Renewals go on through the drain: owned calls still need them.
    lifecycle.spawn_background(renewer.clone().run(stop.clone()));
    let parts = Parts {
        store,
        metrics: metrics.clone(),
        waiters,
        renewer,
        cache,
        lifecycle: lifecycle.clone(),
        listening: Arc::new(AtomicBool::new(false)),
        upstream_lanes: lanes,
    };
    parts.listen_if_needed(&config);
    let live = Arc::new(LiveProxy::new(Arc::new(
        parts.proxy(config.clone(), upstream),
    )));
    let status = Arc::new(ReloadStatus::started());
    let reloader = Reloader {
        live: live.clone(),
        lock: Arc::new(tokio::sync::Mutex::new(())),
        status: status.clone(),
        parts,
    };
    let drain = lifecycle.drain_token();
    let (workers, load, served) = server::serve_on_workers(
        proxy_listener,
        live,
        server::ListenerOptions {
            header_read_timeout: config.server.header_read_timeout,
            tls,
        },
        drain.clone(),
        config.server.shutdown_grace,
        options.workers,
    )
    .inspect_err(|_| drain.cancel())
    .context("starting the proxy's worker threads")?;
    let proxy_task = tokio::spawn(served);
    metrics.set_worker_load(load);
    let admin = Arc::new(Admin::new(
        health,
        metrics.clone(),
        lifecycle.clone(),
        status,
    ));
    lifecycle.spawn_background(server::serve(
        admin_listener,
        admin,
        config.server.header_read_timeout,
        cancelled(stop),
        Duration::from_secs(1),
    ));
    info!(%proxy_addr, %admin_addr, tls = config.server.tls.is_some(), upstream = %config.upstream.url, routes = config.routes.len(), "idemproxy listening");
    Ok(Running {
        proxy_addr,
        admin_addr,
        metrics,
        lifecycle,
        grace: config.server.shutdown_grace,
        proxy_task,
        workers,
        reloader,
    })
}

async fn cancelled(token: CancellationToken) {
    token.cancelled().await;
}

/// Applies migrations, retrying with capped exponential backoff until it
/// succeeds or the process stops.
async fn migrate_with_backoff(store: Store, stop: CancellationToken) {
    let mut backoff = Backoff::new(Duration::from_millis(200), Duration::from_secs(10));
    loop {
        match store.migrate().await {
            Ok(applied) if applied.is_empty() => {
                info!("database schema is current");
                return;
            }
            Ok(applied) => {
                info!(?applied, "applied database migrations");
                return;
            }
            Err(e) => {
                warn!(error = %e, retry_in = ?backoff.peek(), "database not ready for migrations; retrying");
            }
        }
        tokio::select! {
            () = backoff.wait() => {}
            () = stop.cancelled() => return,
        }
    }
}
