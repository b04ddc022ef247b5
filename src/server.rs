//! Listeners: accept loops for the proxy (HTTP/1.1 and h2c on one port)
//! and the admin endpoints, each draining its connections on shutdown.

use std::convert::Infallible;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use http::{Request, Response};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tracing::{debug, warn};

use crate::proxy::{ClientInfo, Proxy, ProxyBody};

/// A handler for one request, given the peer.
pub trait Handler: Send + Sync + 'static {
    /// Answers one request.
    fn call(
        self: Arc<Self>,
        req: Request<Incoming>,
        client: ClientInfo,
    ) -> impl Future<Output = Response<ProxyBody>> + Send;
}

impl Handler for Proxy {
    async fn call(
        self: Arc<Self>,
        req: Request<Incoming>,
        client: ClientInfo,
    ) -> Response<ProxyBody> {
        self.handle(req, client).await
    }
}

/// Serves `listener` until `shutdown` flips to true, then stops accepting
/// (the listener is closed at once, so new connections are refused) and
/// gives open connections up to `grace` to finish their requests.
pub async fn serve<H: Handler>(
    listener: TcpListener,
    handler: Arc<H>,
    header_read_timeout: Duration,
    mut shutdown: watch::Receiver<bool>,
    grace: Duration,
) {
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(header_read_timeout);
    builder.http2().timer(TokioTimer::new());
    let graceful = GracefulShutdown::new();
    loop {
        tokio::select! {
            accepted = listener.accept() => {
                let (stream, addr) = match accepted {
                    Ok(a) => a,
                    Err(e) => {
                        // Out of file descriptors and the like: back off
                        // instead of spinning.
                        warn!(error = %e, "accept failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                };
                let _ = stream.set_nodelay(true);
                let handler = handler.clone();
                let client = ClientInfo { addr, proto: "http" };
                let service = service_fn(move |req| {
                    let handler = handler.clone();
                    async move { Ok::<_, Infallible>(handler.call(req, client).await) }
                });
                let conn = builder.serve_connection(TokioIo::new(stream), service).into_owned();
                let conn = graceful.watch(conn);
                tokio::spawn(async move {
                    if let Err(e) = conn.await {
                        debug!(error = %e, client = %addr, "connection ended with an error");
                    }
                });
            }
            () = stopped(&mut shutdown) => break,
        }
    }
    drop(listener);
    tokio::select! {
        () = graceful.shutdown() => {}
        () = tokio::time::sleep(grace) => {
            warn!(?grace, "shutdown grace elapsed with connections still open; closing them");
        }
    }
}

/// Resolves once `shutdown` is true (or its sender is gone).
pub async fn stopped(shutdown: &mut watch::Receiver<bool>) {
    let _ = shutdown.wait_for(|stop| *stop).await;
}
