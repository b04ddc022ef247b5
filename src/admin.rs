//! The admin listener: `/healthz` (alive), `/readyz` (this process can take
//! traffic), `/readyz/store` (the store is reachable and its schema
//! current) and `/metrics` (Prometheus text).
//!
//! `/readyz` never depends on the shared store (DESIGN.md §8.1). Every
//! replica shares one database: if readiness followed it, a store outage
//! would pull every replica out of its Service at once, taking down the
//! pass-through traffic that needs no store and leaving
//! `on_store_error = "pass_through"` nothing to act on. Keyed requests
//! already answer 503 while the store is away. So `/readyz` is 200 from the
//! moment the listeners are up until draining starts, and its body only
//! names the store's last known state; `/readyz/store` is the check for
//! operators and start-up gates that do want the store.

use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use http::header::{HeaderValue, CONTENT_TYPE};
use http::{Method, Request, Response, StatusCode};
use hyper::body::Incoming;
use tokio_util::sync::CancellationToken;

use crate::lifecycle::Lifecycle;
use crate::metrics::Metrics;
use crate::proxy::{full, ClientInfo, ProxyBody};
use crate::server::Handler;
use crate::store::Store;

/// How often the store's state is checked in the background (for the
/// `/readyz` body and `idemproxy_store_up`).
const CHECK_EVERY: Duration = Duration::from_secs(5);

/// The store's state as last seen.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoreState {
    /// Not checked yet.
    Unknown,
    /// Reachable, schema current.
    Up,
    /// Reachable, migrations pending.
    SchemaPending,
    /// Unreachable or failing.
    Down,
}

impl StoreState {
    fn describe(self) -> &'static str {
        match self {
            StoreState::Unknown => "store: not checked yet",
            StoreState::Up => "store: up",
            StoreState::SchemaPending => {
                "store: schema not current (migrations pending); keyed requests get 503"
            }
            StoreState::Down => "store: unreachable; keyed requests get 503",
        }
    }
}

/// Checks the store and remembers what it found.
pub struct StoreHealth {
    store: Store,
    metrics: Arc<Metrics>,
    state: AtomicU8,
}

impl StoreHealth {
    /// Nothing checked yet.
    pub fn new(store: Store, metrics: Arc<Metrics>) -> Self {
        StoreHealth {
            store,
            metrics,
            state: AtomicU8::new(StoreState::Unknown as u8),
        }
    }

    /// The last state seen.
    pub fn last(&self) -> StoreState {
        match self.state.load(Ordering::Relaxed) {
            x if x == StoreState::Up as u8 => StoreState::Up,
            x if x == StoreState::SchemaPending as u8 => StoreState::SchemaPending,
            x if x == StoreState::Down as u8 => StoreState::Down,
            _ => StoreState::Unknown,
        }
    }

    /// Checks now (bounded by `store.timeout`); the error, if any, for the
    /// operator.
    pub async fn check(&self) -> (StoreState, Option<String>) {
        let (state, error) = match self.store.ready().await {
            Ok(true) => (StoreState::Up, None),
            Ok(false) => (StoreState::SchemaPending, None),
            Err(e) => (StoreState::Down, Some(e.to_string())),
        };
        self.state.store(state as u8, Ordering::Relaxed);
        self.metrics.store_up(state == StoreState::Up);
        (state, error)
    }

    /// Checks every few seconds until `stop`.
    pub async fn monitor(self: Arc<Self>, stop: CancellationToken) {
        loop {
            self.check().await;
            tokio::select! {
                () = tokio::time::sleep(CHECK_EVERY) => {}
                () = stop.cancelled() => return,
            }
        }
    }

    fn store(&self) -> &Store {
        &self.store
    }
}

/// The configuration's last (re)load, for the `/readyz` body.
pub struct ReloadStatus {
    loaded_at: SystemTime,
    /// The last reload: when, its result, a short note.
    last: Mutex<Option<(SystemTime, String, String)>>,
}

impl ReloadStatus {
    /// Loaded at start, now.
    pub fn started() -> Self {
        ReloadStatus {
            loaded_at: SystemTime::now(),
            last: Mutex::new(None),
        }
    }

    /// Records a reload now: its result (the metric's label) and a short
    /// note (never a value: it could be a secret).
    pub fn record(&self, result: &str, note: &str) {
        *self.last.lock().unwrap_or_else(PoisonError::into_inner) =
            Some((SystemTime::now(), result.to_string(), note.to_string()));
    }

    /// `config: reload ok at Wed, 02 Dec 2026 21:39:02 GMT`, or when it was
    /// loaded if it never was reloaded.
    pub fn describe(&self) -> String {
        let last = self
            .last
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        match last {
            None => format!(
                "config: loaded at {}; not reloaded since",
                httpdate::fmt_http_date(self.loaded_at)
            ),
            Some((at, result, note)) => {
                let at = httpdate::fmt_http_date(at);
                if note.is_empty() {
                    format!("config: reload {result} at {at}")
                } else {
                    format!("config: reload {result} at {at} ({note})")
                }
            }
        }
    }
}

/// State the admin endpoints report.
pub struct Admin {
    health: Arc<StoreHealth>,
    metrics: Arc<Metrics>,
    lifecycle: Lifecycle,
    reloads: Arc<ReloadStatus>,
}

impl Admin {
    /// Wires the admin endpoints.
    pub fn new(
        health: Arc<StoreHealth>,
        metrics: Arc<Metrics>,
        lifecycle: Lifecycle,
        reloads: Arc<ReloadStatus>,
    ) -> Self {
        Admin {
            health,
            metrics,
            lifecycle,
            reloads,
        }
    }

    fn readiness(&self) -> (StatusCode, String) {
        let store = self.health.last().describe();
        let config = self.reloads.describe();
        if self.lifecycle.draining() {
            return (
                StatusCode::SERVICE_UNAVAILABLE,
                format!("not ready: draining\n{store}\n{config}\n"),
            );
        }
        (StatusCode::OK, format!("ready\n{store}\n{config}\n"))
    }

    async fn store_readiness(&self) -> (StatusCode, String) {
        match self.health.check().await {
            (StoreState::Up, _) => (StatusCode::OK, "store ready\n".into()),
            (StoreState::SchemaPending, _) => (
                StatusCode::SERVICE_UNAVAILABLE,
                "store not ready: database schema is not current (migrations pending)\n".into(),
            ),
            (_, error) => (
                StatusCode::SERVICE_UNAVAILABLE,
                format!(
                    "store not ready: {}\n",
                    error.as_deref().unwrap_or("unreachable")
                ),
            ),
        }
    }
}

fn text(
    status: StatusCode,
    body: impl Into<Bytes>,
    content_type: &'static str,
) -> Response<ProxyBody> {
    let mut resp = Response::new(full(body.into()));
    *resp.status_mut() = status;
    resp.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
    resp
}

impl Handler for Admin {
    async fn call(
        self: Arc<Self>,
        req: Request<Incoming>,
        _client: ClientInfo,
    ) -> Response<ProxyBody> {
        if req.method() != Method::GET && req.method() != Method::HEAD {
            return text(StatusCode::METHOD_NOT_ALLOWED, "GET only\n", "text/plain");
        }
        match req.uri().path() {
            "/healthz" => text(StatusCode::OK, "ok\n", "text/plain"),
            "/readyz" => {
                let (status, body) = self.readiness();
                text(status, body, "text/plain")
            }
            "/readyz/store" => {
                let (status, body) = self.store_readiness().await;
                text(status, body, "text/plain")
            }
            "/metrics" => {
                let store = self.health.store();
                let (size, available, waiting) = store.pool_status();
                self.metrics.pool(size, available, waiting);
                for (op, batches, items, largest) in store.batch_stats() {
                    self.metrics.batching(op, batches, items, largest);
                }
                text(
                    StatusCode::OK,
                    self.metrics.render(),
                    "application/openmetrics-text; version=1.0.0; charset=utf-8",
                )
            }
            _ => text(StatusCode::NOT_FOUND, "not found\n", "text/plain"),
        }
    }
}
