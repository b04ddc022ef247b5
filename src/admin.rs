//! The admin listener: `/healthz` (alive), `/readyz` (database reachable,
//! schema current, not draining) and `/metrics` (Prometheus text).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use bytes::Bytes;
use http::header::{HeaderValue, CONTENT_TYPE};
use http::{Method, Request, Response, StatusCode};
use hyper::body::Incoming;

use crate::metrics::Metrics;
use crate::proxy::{full, ClientInfo, ProxyBody};
use crate::server::Handler;
use crate::store::Store;

/// State the admin endpoints report.
pub struct Admin {
    store: Store,
    metrics: Arc<Metrics>,
    draining: Arc<AtomicBool>,
}

impl Admin {
    /// Wires the admin endpoints.
    pub fn new(store: Store, metrics: Arc<Metrics>, draining: Arc<AtomicBool>) -> Self {
        Admin {
            store,
            metrics,
            draining,
        }
    }

    async fn readiness(&self) -> (StatusCode, String) {
        if self.draining.load(Ordering::SeqCst) {
            return (
                StatusCode::SERVICE_UNAVAILABLE,
                "not ready: draining\n".into(),
            );
        }
        match self.store.ready().await {
            Ok(true) => (StatusCode::OK, "ready\n".into()),
            Ok(false) => (
                StatusCode::SERVICE_UNAVAILABLE,
                "not ready: database schema is not current (migrations pending)\n".into(),
            ),
            Err(e) => (StatusCode::SERVICE_UNAVAILABLE, format!("not ready: {e}\n")),
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
                let (status, body) = self.readiness().await;
                text(status, body, "text/plain")
            }
            "/metrics" => {
                let (size, available, waiting) = self.store.pool_status();
                self.metrics.pool(size, available, waiting);
                for (op, batches, items, largest) in self.store.batch_stats() {
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
