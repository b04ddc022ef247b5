//! Wiring: build every component from a [`Config`], run them, drain them.
//!
//! `serve` starts even when the database is unreachable: it listens,
//! answers keyed requests with 503, passes the rest through, reports ready
//! (readiness never depends on the shared store, DESIGN.md §8.1), and keeps
//! trying (with backoff) to connect and migrate. Every task it spawns
//! belongs to the [`Lifecycle`], which drains them on shutdown.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::admin::{Admin, StoreHealth};
use crate::backoff::Backoff;
use crate::cache::ResponseCache;
use crate::config::Config;
use crate::lease::Renewer;
use crate::lifecycle::Lifecycle;
use crate::metrics::Metrics;
use crate::proxy::upstream::Upstream;
use crate::proxy::Proxy;
use crate::store::{notify, Store};
use crate::waiters::Waiters;
use crate::{server, sweeper};

/// Options of `serve` that are not configuration.
#[derive(Debug, Clone, Copy)]
pub struct ServeOptions {
    /// Apply pending migrations at start (in the background, retried).
    pub migrate: bool,
    /// Run the retention sweeper.
    pub sweeper: bool,
}

impl Default for ServeOptions {
    fn default() -> Self {
        ServeOptions {
            migrate: true,
            sweeper: true,
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
        finished
    }

    /// The process's lifecycle (tests watch its work).
    pub fn lifecycle(&self) -> &Lifecycle {
        &self.lifecycle
    }
}

/// Builds and starts everything.
pub async fn start(config: Config, options: ServeOptions) -> anyhow::Result<Running> {
    let config = Arc::new(config);
    let lifecycle = Lifecycle::new();
    let store = Store::new(&config.store).context("building the database pool")?;
    let upstream = Upstream::new(&config.upstream).context("building the upstream client")?;
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
    if config.routes.iter().any(|r| !r.policy.wait.is_zero()) || config.store.response_cache > 0 {
        // One listening connection per process: wake-ups for waiting
        // duplicates, invalidations for the response cache.
        let (w1, c1, w2, c2) = (
            waiters.clone(),
            cache.clone(),
            waiters.clone(),
            cache.clone(),
        );
        lifecycle.spawn_background(notify::listen(
            store.clone(),
            move |id| {
                c1.invalidate(id);
                w1.wake(id);
            },
            move || {
                c2.clear();
                w2.wake_all();
            },
            stop.clone(),
        ));
    }
    let shortest_lease = config
        .routes
        .iter()
        .map(|r| r.policy.lease)
        .min()
        .unwrap_or(Duration::from_secs(10));
    let renewer = Arc::new(Renewer::new(
        store.clone(),
        metrics.clone(),
        crate::lease::tick_for(shortest_lease),
    ));
    // Renewals go on through the drain: owned calls still need them.
    lifecycle.spawn_background(renewer.clone().run(stop.clone()));
    let proxy = Arc::new(Proxy::new(
        config.clone(),
        store,
        upstream,
        metrics.clone(),
        waiters,
        renewer,
        cache,
        lifecycle.clone(),
    ));
    let drain = lifecycle.drain_token();
    let proxy_task = tokio::spawn(server::serve_with(
        proxy_listener,
        proxy,
        server::ListenerOptions {
            header_read_timeout: config.server.header_read_timeout,
            tls,
        },
        cancelled(drain),
        config.server.shutdown_grace,
    ));
    let admin = Arc::new(Admin::new(health, metrics.clone(), lifecycle.clone()));
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
