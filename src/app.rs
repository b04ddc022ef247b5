//! Wiring: build every component from a [`Config`], run them, drain them.
//!
//! `serve` starts even when the database is unreachable: it listens,
//! answers keyed requests with 503, reports not-ready, and keeps trying
//! (with backoff) to connect and migrate.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tracing::{info, warn};

use crate::admin::Admin;
use crate::cache::ResponseCache;
use crate::config::Config;
use crate::lease::Renewer;
use crate::metrics::Metrics;
use crate::proxy::upstream::Upstream;
use crate::proxy::Proxy;
use crate::store::Store;
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
    draining: Arc<AtomicBool>,
    stop_proxy: watch::Sender<bool>,
    stop_admin: watch::Sender<bool>,
    proxy_task: JoinHandle<()>,
    admin_task: JoinHandle<()>,
}

impl Running {
    /// Drains: report not-ready, stop accepting, let in-flight requests
    /// finish within the grace period, then stop the admin listener and the
    /// background tasks.
    pub async fn shutdown(self) {
        self.draining.store(true, Ordering::SeqCst);
        let _ = self.stop_proxy.send(true);
        let _ = self.proxy_task.await;
        let _ = self.stop_admin.send(true);
        let _ = self.admin_task.await;
    }
}

/// Builds and starts everything.
pub async fn start(config: Config, options: ServeOptions) -> anyhow::Result<Running> {
    let config = Arc::new(config);
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

    let (stop_proxy, proxy_rx) = watch::channel(false);
    let (stop_admin, admin_rx) = watch::channel(false);
    let draining = Arc::new(AtomicBool::new(false));

    if options.migrate {
        tokio::spawn(migrate_with_backoff(store.clone(), admin_rx.clone()));
    }
    if options.sweeper {
        tokio::spawn(sweeper::run(
            store.clone(),
            metrics.clone(),
            config.sweeper.clone(),
            admin_rx.clone(),
        ));
    }

    let waiters = Arc::new(Waiters::new(config.server.max_waiters));
    let cache = Arc::new(ResponseCache::new(
        config.store.response_cache,
        config.store.response_cache_ttl,
    ));
    if config.routes.iter().any(|r| !r.policy.wait.is_zero()) || config.store.response_cache > 0 {
        // One listening connection per process: wake-ups for waiting
        // duplicates, invalidations for the response cache.
        tokio::spawn(crate::waiters::listen(
            store.clone(),
            waiters.clone(),
            cache.clone(),
            admin_rx.clone(),
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
    // Renewals go on through the drain: in-flight calls still need them.
    tokio::spawn(renewer.clone().run(admin_rx.clone()));
    let proxy = Arc::new(Proxy::new(
        config.clone(),
        store.clone(),
        upstream,
        metrics.clone(),
        waiters,
        renewer,
        cache,
    ));
    let proxy_task = tokio::spawn(server::serve_with(
        proxy_listener,
        proxy,
        server::ListenerOptions {
            header_read_timeout: config.server.header_read_timeout,
            tls,
        },
        proxy_rx,
        config.server.shutdown_grace,
    ));
    let admin = Arc::new(Admin::new(store, metrics.clone(), draining.clone()));
    let admin_task = tokio::spawn(server::serve(
        admin_listener,
        admin,
        config.server.header_read_timeout,
        admin_rx,
        Duration::from_secs(1),
    ));
    info!(%proxy_addr, %admin_addr, tls = config.server.tls.is_some(), upstream = %config.upstream.url, routes = config.routes.len(), "idemproxy listening");
    Ok(Running {
        proxy_addr,
        admin_addr,
        metrics,
        draining,
        stop_proxy,
        stop_admin,
        proxy_task,
        admin_task,
    })
}

/// Applies migrations, retrying with capped exponential backoff until it
/// succeeds or the process stops.
async fn migrate_with_backoff(store: Store, mut shutdown: watch::Receiver<bool>) {
    let mut delay = Duration::from_millis(200);
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
                warn!(error = %e, retry_in = ?delay, "database not ready for migrations; retrying");
            }
        }
        tokio::select! {
            () = tokio::time::sleep(delay) => {}
            () = crate::server::stopped(&mut shutdown) => return,
        }
        delay = (delay * 2).min(Duration::from_secs(10));
    }
}
