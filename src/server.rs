//! Listeners: accept loops for the proxy (HTTP/1.1 and h2 on one port, in
//! clear or over TLS) and the admin endpoints, each draining its
//! connections on shutdown.
//!
//! Slow clients are bounded before they reach the proxy: the first bytes
//! (which tell HTTP/1.1 from h2), the TLS handshake and the request headers
//! must each arrive within `header_read_timeout`, or the connection is
//! closed without an answer (there is no request to answer yet). The
//! protocol is chosen here, by those first bytes or by ALPN, rather than by
//! hyper-util's automatic detection, which waits for them without a bound:
//! a client that connects and sends nothing would hold its socket forever.
//! Malformed requests are refused by hyper's parser with a 4xx (400, 431)
//! before the proxy sees them, so nothing is stored or forwarded.

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use http::{Request, Response};
use hyper::body::Incoming;
use hyper::rt::{Read, Write};
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::{GracefulShutdown, Watcher};
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::TlsAcceptor;
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
        // A request that may own a claim runs as work of the lifecycle, in a
        // task of its own, not inside its connection's future: when a client
        // gives up and closes the connection, hyper drops that future and
        // everything polled by it, and an owned claim must outlive its
        // client (see `lifecycle`). The drain waits for these tasks.
        // Pass-through requests own nothing: they run inline, sparing the
        // hot path a task per request.
        if !self.may_claim(&req) {
            return self.handle(req, client).await;
        }
        let lifecycle = self.lifecycle().clone();
        match lifecycle
            .spawn_work(async move { self.handle(req, client).await })
            .await
        {
            Ok(response) => response,
            Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
            // Cancelled: only when the runtime itself shuts down.
            Err(_) => {
                let mut response = Response::new(crate::proxy::full(bytes::Bytes::new()));
                *response.status_mut() = http::StatusCode::SERVICE_UNAVAILABLE;
                response
            }
        }
    }
}

/// How a listener talks to its clients.
#[derive(Clone, Default)]
pub struct ListenerOptions {
    /// Bound on the TLS handshake and on the request headers.
    pub header_read_timeout: Duration,
    /// TLS (HTTP/1.1 and h2 by ALPN); `None`: HTTP/1.1 and h2c in clear.
    pub tls: Option<TlsAcceptor>,
}

/// Serves `listener` in clear; see [`serve_with`].
pub async fn serve<H: Handler>(
    listener: TcpListener,
    handler: Arc<H>,
    header_read_timeout: Duration,
    shutdown: impl Future<Output = ()>,
    grace: Duration,
) {
    let options = ListenerOptions {
        header_read_timeout,
        tls: None,
    };
    serve_with(listener, handler, options, shutdown, grace).await;
}

/// Serves `listener` until `shutdown` resolves, then stops accepting (the
/// listener is closed at once, so new connections are refused) and gives
/// open connections up to `grace` to finish their requests. (Work a request
/// handed to the lifecycle is waited for there, not here.)
pub async fn serve_with<H: Handler>(
    listener: TcpListener,
    handler: Arc<H>,
    options: ListenerOptions,
    shutdown: impl Future<Output = ()>,
    grace: Duration,
) {
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(options.header_read_timeout);
    builder.http2().timer(TokioTimer::new());
    let graceful = GracefulShutdown::new();
    tokio::pin!(shutdown);
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
                let connection = Connection {
                    builder: builder.clone(),
                    handler: handler.clone(),
                    watcher: graceful.watcher(),
                    addr,
                };
                match &options.tls {
                    None => {
                        tokio::spawn(connection.sniff(stream, options.header_read_timeout));
                    }
                    Some(acceptor) => {
                        tokio::spawn(connection.handshake(
                            acceptor.clone(),
                            stream,
                            options.header_read_timeout,
                        ));
                    }
                }
            }
            () = &mut shutdown => break,
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

/// One accepted connection, before it is served.
struct Connection<H> {
    builder: auto::Builder<TokioExecutor>,
    handler: Arc<H>,
    watcher: Watcher,
    addr: SocketAddr,
}

/// The HTTP version a connection speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Protocol {
    Http1,
    H2,
}

/// What an h2 client sends first ("prior knowledge", RFC 9113 §3.3).
const H2_PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

impl<H: Handler> Connection<H> {
    /// Tells HTTP/1.1 from h2c by the first bytes, which must arrive within
    /// `timeout`, then serves.
    async fn sniff(self, stream: TcpStream, timeout: Duration) {
        let deadline = tokio::time::Instant::now() + timeout;
        let mut buf = [0u8; H2_PREFACE.len()];
        let protocol = loop {
            let n = match tokio::time::timeout_at(deadline, stream.peek(&mut buf)).await {
                Ok(Ok(0)) => return, // closed before a byte
                Ok(Ok(n)) => n,
                Ok(Err(e)) => {
                    debug!(error = %e, client = %self.addr, "connection failed before a request");
                    return;
                }
                Err(_) => {
                    debug!(client = %self.addr, ?timeout, "no request within header_read_timeout");
                    return;
                }
            };
            if buf[..n] != H2_PREFACE[..n] {
                break Protocol::Http1;
            }
            if n == H2_PREFACE.len() {
                break Protocol::H2;
            }
            // A fragment of the h2 preface: `peek` would return the same
            // bytes at once, so wait a moment for the rest.
            tokio::time::sleep(Duration::from_millis(5)).await;
        };
        self.serve(TokioIo::new(stream), "http", protocol).await;
    }

    /// Completes the TLS handshake within `timeout`, then serves the
    /// protocol ALPN chose (HTTP/1.1 when the client named none).
    async fn handshake(self, acceptor: TlsAcceptor, stream: TcpStream, timeout: Duration) {
        match tokio::time::timeout(timeout, acceptor.accept(stream)).await {
            Ok(Ok(tls)) => {
                let protocol = match tls.get_ref().1.alpn_protocol() {
                    Some(b"h2") => Protocol::H2,
                    _ => Protocol::Http1,
                };
                self.serve(TokioIo::new(tls), "https", protocol).await;
            }
            Ok(Err(e)) => debug!(error = %e, client = %self.addr, "TLS handshake failed"),
            Err(_) => debug!(client = %self.addr, ?timeout, "TLS handshake timed out"),
        }
    }

    async fn serve<I>(self, io: I, proto: &'static str, protocol: Protocol)
    where
        I: Read + Write + Unpin + Send + 'static,
    {
        let Connection {
            builder,
            handler,
            watcher,
            addr,
        } = self;
        let client = ClientInfo { addr, proto };
        let service = service_fn(move |req| {
            let handler = handler.clone();
            async move { Ok::<_, Infallible>(handler.call(req, client).await) }
        });
        let builder = match protocol {
            Protocol::Http1 => builder.http1_only(),
            Protocol::H2 => builder.http2_only(),
        };
        let conn = builder.serve_connection(io, service).into_owned();
        if let Err(e) = watcher.watch(conn).await {
            debug!(error = %e, client = %addr, "connection ended with an error");
        }
    }
}
