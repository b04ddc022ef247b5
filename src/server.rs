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
//!
//! Connections themselves are bounded (DESIGN.md §8.6, [`ConnectionLimits`]):
//! at most `max_connections` are open at once, and one past it is closed as
//! soon as it is accepted, so the client learns at once rather than
//! waiting unseen in the kernel's backlog; an h2 connection advertises
//! `h2_max_concurrent_streams`; and a connection with no request in
//! progress for `idle_timeout` is shut down gracefully (h2 `GOAWAY`;
//! HTTP/1.1 closed between requests). The idle clock is kept here, by
//! counting requests in progress, because hyper has no idle timeout of its
//! own for h2 (its keep-alive pings detect dead peers, not idle ones). That
//! is also why connections are drained with a cancellation token and a
//! task tracker rather than hyper-util's `GracefulShutdown`, whose watcher
//! takes the connection and leaves no way to shut it down for idleness.

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use http::{Request, Response};
use hyper::body::Incoming;
use hyper::rt::{Read, Write};
use hyper::server::conn::{http1, http2};
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{oneshot, OwnedSemaphorePermit, Semaphore};
use tokio_rustls::TlsAcceptor;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{debug, error, warn};

use crate::proxy::{ClientInfo, Proxy, ProxyBody};
use crate::timer::HyperTimer;
use crate::workers::{Load, Served, Spread, Workers};

/// A handler for one request, given the peer.
pub trait Handler: Send + Sync + 'static {
    /// Answers one request.
    fn call(
        self: Arc<Self>,
        req: Request<Incoming>,
        client: ClientInfo,
    ) -> impl Future<Output = Response<ProxyBody>> + Send;

    /// Limits on the connections it is served over; none by default.
    fn limits(&self) -> ConnectionLimits {
        ConnectionLimits::default()
    }
}

/// Bounds on a listener's client connections; `None`: hyper's default (no
/// bound for the connection count and the idle time, 200 h2 streams).
#[derive(Debug, Clone, Copy, Default)]
pub struct ConnectionLimits {
    /// Most connections open at once; those past it are closed on accept.
    pub max_connections: Option<usize>,
    /// Most concurrent streams on one h2 connection.
    pub h2_max_concurrent_streams: Option<u32>,
    /// How long a connection may stay open with no request in progress.
    pub idle_timeout: Option<Duration>,
}

impl Handler for Proxy {
    fn limits(&self) -> ConnectionLimits {
        let server = &self.config().server;
        ConnectionLimits {
            max_connections: Some(server.max_connections),
            h2_max_concurrent_streams: Some(server.h2_max_concurrent_streams),
            idle_timeout: Some(server.idle_timeout),
        }
    }

    fn call(
        self: Arc<Self>,
        req: Request<Incoming>,
        client: ClientInfo,
    ) -> impl Future<Output = Response<ProxyBody>> + Send {
        // Inline, in the connection's task: a pass-through or a cached
        // replay owns nothing. The keyed path, which may own a claim, moves
        // to a task of its own there (`Proxy::handle`). Not `async`:
        // `handle`'s future is the request's, not one wrapped around it.
        let routing = self.routing(&req);
        self.handle(req, client, routing)
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
    let slots = slots_for(&handler.limits());
    accept(listener, handler, options, slots, None, shutdown, grace).await;
}

/// The places under `max_connections`, shared by every accept loop of a
/// listener.
fn slots_for(limits: &ConnectionLimits) -> Option<Arc<Semaphore>> {
    limits.max_connections.map(|n| Arc::new(Semaphore::new(n)))
}

/// Serves `listener` on `count` worker threads ([`crate::workers`]), each
/// accepting from it on a runtime of its own and serving the connections
/// it accepted or was handed ([`Spread`]), until `shutdown` is cancelled;
/// then each drains as [`serve_with`] does. `max_connections` bounds them
/// together. The returned future resolves when every worker has drained
/// its listener; the [`Workers`] keep their runtimes until released. The
/// [`Load`] reads how many connections each worker serves.
pub fn serve_on_workers<H: Handler>(
    listener: TcpListener,
    handler: Arc<H>,
    options: ListenerOptions,
    shutdown: CancellationToken,
    grace: Duration,
    count: usize,
) -> std::io::Result<(Workers, Load, impl Future<Output = ()> + Send + 'static)> {
    // One descriptor per worker, each registered with its own runtime:
    // every worker waits on the same accept queue and the first free one
    // takes the connection, then hands it to another worker when it serves
    // two more than that one ([`Spread`]): the first free one may take a
    // whole burst.
    let served = TaskTracker::new();
    let listener = listener.into_std()?;
    let (spread, inboxes) = Spread::new(count);
    let load = spread.load();
    let mut each = Vec::new();
    for (index, inbox) in inboxes.into_iter().enumerate() {
        // The token counts the worker as serving until its loop has ended.
        let share = Share {
            spread: spread.clone(),
            index,
            inbox,
        };
        each.push(Some((listener.try_clone()?, served.token(), share)));
    }
    drop(spread);
    drop(listener);
    served.close();
    let each = std::sync::Mutex::new(each);
    let slots = slots_for(&handler.limits());
    let workers = Workers::start(count, move |lane| {
        // Worker `lane` takes share `lane`: the spread's counts (and
        // `idemproxy_worker_connections`) are by the workers' own numbers.
        let taken = each
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .get_mut(lane)
            .and_then(Option::take);
        let (handler, options, slots, shutdown) = (
            handler.clone(),
            options.clone(),
            slots.clone(),
            shutdown.clone(),
        );
        async move {
            let Some((listener, _serving, share)) = taken else {
                return;
            };
            let listener = match TcpListener::from_std(listener) {
                Ok(l) => l,
                Err(e) => {
                    error!(error = %e, "a worker could not take the proxy listener");
                    return;
                }
            };
            accept(
                listener,
                handler,
                options,
                slots,
                Some(share),
                shutdown.cancelled_owned(),
                grace,
            )
            .await;
        }
    })?;
    Ok((workers, load, async move { served.wait().await }))
}

/// A connection handed from one worker to another: the socket, taken off
/// the first worker's reactor, its peer and its place under
/// `max_connections`.
type Handoff = (
    std::net::TcpStream,
    SocketAddr,
    Option<OwnedSemaphorePermit>,
);

/// One worker's part of the spread: its index there and its inbox.
struct Share {
    spread: Spread<Handoff>,
    index: usize,
    inbox: tokio::sync::mpsc::UnboundedReceiver<(Handoff, Served)>,
}

/// The next connection handed to this worker; never, off the workers.
async fn handed(share: &mut Option<Share>) -> Option<(Handoff, Served)> {
    match share {
        Some(share) => share.inbox.recv().await,
        None => std::future::pending().await,
    }
}

/// The accept loop of [`serve_with`] and of each worker (`share`: the
/// worker's part of the spread of connections among them).
async fn accept<H: Handler>(
    listener: TcpListener,
    handler: Arc<H>,
    options: ListenerOptions,
    slots: Option<Arc<Semaphore>>,
    mut share: Option<Share>,
    shutdown: impl Future<Output = ()>,
    grace: Duration,
) {
    let limits = handler.limits();
    let mut http1 = http1::Builder::new();
    http1
        // A response's head and a small body go out as one buffer: hyper
        // copies the body in rather than queueing both for `writev`, 2 %
        // fewer instructions per pass-through (BENCHMARKS.md, sixteenth
        // pass); a large body is still written a buffer at a time.
        .writev(false)
        .timer(HyperTimer)
        .header_read_timeout(options.header_read_timeout);
    let mut http2 = http2::Builder::new(TokioExecutor::new());
    http2
        .timer(HyperTimer)
        .max_concurrent_streams(limits.h2_max_concurrent_streams);
    let builders = Arc::new(Builders { http1, http2 });
    let mut refused = Refusals::default();
    let stop = CancellationToken::new();
    let connections = TaskTracker::new();
    let start = |stream: TcpStream, addr, slot, served| {
        let connection = Connection {
            builders: builders.clone(),
            handler: handler.clone(),
            stop: stop.clone(),
            idle_timeout: limits.idle_timeout,
            addr,
            _slot: slot,
            _served: served,
        };
        match &options.tls {
            None => {
                connections.spawn(connection.sniff(stream, options.header_read_timeout));
            }
            Some(acceptor) => {
                connections.spawn(connection.handshake(
                    acceptor.clone(),
                    stream,
                    options.header_read_timeout,
                ));
            }
        }
    };
    // A connection handed over: registered with this worker's reactor.
    let take = |stream, addr, slot, served| match TcpStream::from_std(stream) {
        Ok(stream) => start(stream, addr, slot, Some(served)),
        Err(e) => warn!(error = %e, "a worker could not take a connection handed to it"),
    };
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
                let slot = match &slots {
                    None => None,
                    Some(slots) => match slots.clone().try_acquire_owned() {
                        Ok(permit) => Some(permit),
                        Err(_) => {
                            // Dropped: closed before a byte is read.
                            refused.count(limits.max_connections.unwrap_or_default());
                            continue;
                        }
                    },
                };
                let _ = stream.set_nodelay(true);
                let Some(share) = &share else {
                    start(stream, addr, slot, None);
                    continue;
                };
                let Some(to) = share.spread.elsewhere(share.index) else {
                    start(stream, addr, slot, Some(share.spread.here(share.index)));
                    continue;
                };
                // Taken off this worker's reactor, to join the other's.
                let stream = match stream.into_std() {
                    Ok(s) => s,
                    Err(e) => {
                        warn!(error = %e, "a connection could not be handed to another worker");
                        continue;
                    }
                };
                if let Err((stream, addr, slot)) = share.spread.hand(to, (stream, addr, slot)) {
                    // That worker has stopped taking connections.
                    take(stream, addr, slot, share.spread.here(share.index));
                }
            }
            Some(((stream, addr, slot), served)) = handed(&mut share) => {
                take(stream, addr, slot, served);
            }
            () = &mut shutdown => break,
        }
    }
    drop(listener);
    // Connections handed here and not started yet are closed with it, as
    // those still in the kernel's accept queue are.
    drop(share);
    stop.cancel();
    connections.close();
    tokio::select! {
        () = connections.wait() => {}
        () = tokio::time::sleep(grace) => {
            warn!(?grace, "shutdown grace elapsed with connections still open; closing them");
        }
    }
}

/// Connections closed for `max_connections`, warned about at most every
/// 10 s: a flood must not become a flood of log lines.
#[derive(Default)]
struct Refusals {
    since_warning: u64,
    warned_at: Option<Instant>,
}

impl Refusals {
    fn count(&mut self, limit: usize) {
        self.since_warning += 1;
        let due = self
            .warned_at
            .is_none_or(|at| at.elapsed() >= Duration::from_secs(10));
        if due {
            warn!(
                limit,
                refused = self.since_warning,
                "server.max_connections reached: closing new connections"
            );
            self.since_warning = 0;
            self.warned_at = Some(Instant::now());
        }
    }
}

/// Requests in progress on one connection, and when the last one ended.
///
/// Kept with two atomics and no wake-up: a request's start and end touch
/// no lock and wake no task. The idle clock instead checks, when its timer
/// fires, whether the connection really was idle that long, and if not
/// sets itself for the moment it would be.
struct Activity {
    active: AtomicUsize,
    /// When the last request ended (or the connection opened), as
    /// nanoseconds since `epoch`.
    last_end: AtomicU64,
    epoch: tokio::time::Instant,
}

impl Activity {
    fn new() -> Self {
        Activity {
            active: AtomicUsize::new(0),
            last_end: AtomicU64::new(0),
            epoch: tokio::time::Instant::now(),
        }
    }

    /// Counts a request in progress until the guard is dropped (when the
    /// handler has produced the response head; a body still streaming is
    /// left to hyper's graceful shutdown, which finishes it).
    fn begin(self: &Arc<Self>) -> impl Drop + Send {
        self.active.fetch_add(1, Ordering::SeqCst);
        scopeguard::guard(self.clone(), |a| {
            let since = tokio::time::Instant::now().saturating_duration_since(a.epoch);
            // Stored before the count drops: a check that sees no request
            // in progress sees this end too.
            a.last_end
                .fetch_max(since.as_nanos() as u64, Ordering::SeqCst);
            a.active.fetch_sub(1, Ordering::SeqCst);
        })
    }

    /// Resolves once no request has been in progress for `timeout`.
    async fn idle_for(&self, timeout: Duration) {
        let mut deadline = self.epoch + timeout;
        loop {
            tokio::time::sleep_until(deadline).await;
            let now = tokio::time::Instant::now();
            if self.active.load(Ordering::SeqCst) > 0 {
                // Busy: not idle before a request ends, at the earliest
                // `timeout` from now.
                deadline = now + timeout;
                continue;
            }
            let last_end = self.epoch + Duration::from_nanos(self.last_end.load(Ordering::SeqCst));
            if now >= last_end + timeout {
                return;
            }
            deadline = last_end + timeout;
        }
    }
}

/// How a listener serves each protocol: hyper's own connections, chosen
/// here by the first bytes or ALPN (`Connection::sniff`, `handshake`).
/// hyper-util's automatic builder would read them again and wrap every
/// read of the connection in a rewind buffer.
struct Builders {
    http1: http1::Builder,
    http2: http2::Builder<TokioExecutor>,
}

/// One accepted connection, before it is served.
struct Connection<H> {
    builders: Arc<Builders>,
    handler: Arc<H>,
    /// Cancelled when the listener drains: shut down gracefully.
    stop: CancellationToken,
    /// Shut down gracefully after this long with no request in progress.
    idle_timeout: Option<Duration>,
    addr: SocketAddr,
    /// Its place under `max_connections`, given back when it ends.
    _slot: Option<OwnedSemaphorePermit>,
    /// Counted on its worker while it is open (`None` off the workers).
    _served: Option<Served>,
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
            builders,
            handler,
            stop,
            idle_timeout,
            addr,
            _slot,
            _served,
        } = self;
        let client = ClientInfo::new(addr, proto);
        let activity = Arc::new(Activity::new());
        let counted = activity.clone();
        let service = service_fn(move |req| Counted {
            guard: Some(counted.begin()),
            answer: handler.clone().call(req, client.clone()),
        });
        let closed = Closing {
            stop,
            idle_timeout,
            activity,
            addr,
        };
        let result = match protocol {
            Protocol::Http1 => {
                let conn = builders.http1.serve_connection(io, service);
                closed.drive(conn, |c| c.graceful_shutdown()).await
            }
            Protocol::H2 => {
                let conn = builders.http2.serve_connection(io, service);
                closed.drive(conn, |c| c.graceful_shutdown()).await
            }
        };
        if let Some(Err(e)) = result {
            debug!(error = %e, client = %addr, "connection ended with an error");
        }
    }
}

pin_project_lite::pin_project! {
    /// A request's answer, the request counted as in progress
    /// ([`Activity`]) until the handler has produced it. A future of its
    /// own rather than an `async` block awaiting the handler: the block
    /// would hold the handler's future (3.5 KB) beside its own state and
    /// copy it in when first polled; this holds it where `call` built it.
    struct Counted<F, G> {
        #[pin]
        answer: F,
        guard: Option<G>,
    }
}

impl<F: Future, G> Future for Counted<F, G> {
    type Output = Result<F::Output, Infallible>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        let response = std::task::ready!(this.answer.poll(cx));
        drop(this.guard.take());
        Poll::Ready(Ok(response))
    }
}

/// What ends a connection other than its client: the listener draining,
/// or no request in progress for `idle_timeout`.
struct Closing {
    stop: CancellationToken,
    idle_timeout: Option<Duration>,
    activity: Arc<Activity>,
    addr: SocketAddr,
}

/// Why the proxy closes a connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Close {
    /// The listener drains.
    Drain,
    /// No request in progress for `idle_timeout`.
    Idle,
}

impl Closing {
    /// Serves `conn` to its end, shutting it down gracefully (`shutdown`)
    /// when the listener drains or the connection idles; `None` when it
    /// was dropped instead, after an idle period with no graceful end.
    ///
    /// The drain and the idle clock are watched by a task of their own,
    /// which tells this one once, when it is time. Polled here beside the
    /// connection, they were polled on every wake-up of it, two or three
    /// a request: the drain's token takes a lock that every connection of
    /// the listener shares, on both workers, and the idle timer registers
    /// its waker again (BENCHMARKS.md, nineteenth pass).
    async fn drive<C>(self, conn: C, shutdown: impl Fn(Pin<&mut C>)) -> Option<hyper::Result<()>>
    where
        C: Future<Output = hyper::Result<()>>,
    {
        let (idle_timeout, addr) = (self.idle_timeout, self.addr);
        let (tell, mut told) = oneshot::channel();
        tokio::spawn(self.watch(tell));
        tokio::pin!(conn);
        let mut closing = false;
        // A graceful h2 shutdown waits for the client to acknowledge a
        // ping, which a hostile client never does: an idle connection gets
        // one more idle period to close, then it is dropped.
        let cut = tokio::time::sleep(Duration::MAX);
        tokio::pin!(cut);
        let mut cutting = false;
        loop {
            tokio::select! {
                // The connection first, and no random start: the other
                // branches are ready at most once.
                biased;
                result = conn.as_mut() => return Some(result),
                why = &mut told, if !closing => {
                    closing = true;
                    // An error: the watcher was dropped with its runtime,
                    // which drops this connection too.
                    let Ok(why) = why else { continue };
                    shutdown(conn.as_mut());
                    if let (Close::Idle, Some(t)) = (why, idle_timeout) {
                        cut.as_mut().reset(tokio::time::Instant::now() + t);
                        cutting = true;
                    }
                }
                () = &mut cut, if cutting => {
                    debug!(client = %addr, "an idle connection did not close gracefully; dropping it");
                    return None;
                }
            }
        }
    }

    /// Tells `drive` when the listener drains or the connection idles;
    /// ends without a word when the connection ends first.
    async fn watch(self, mut tell: oneshot::Sender<Close>) {
        let Closing {
            stop,
            idle_timeout,
            activity,
            addr,
        } = self;
        let idle = async {
            match idle_timeout {
                Some(t) => activity.idle_for(t).await,
                None => std::future::pending().await,
            }
        };
        let why = tokio::select! {
            () = tell.closed() => return,
            () = stop.cancelled() => Close::Drain,
            () = idle => {
                debug!(client = %addr, "closing an idle connection");
                Close::Idle
            }
        };
        let _ = tell.send(why);
    }
}

#[cfg(test)]
mod tests {
    use std::io::{Read as _, Write as _};

    use super::*;
    use crate::proxy::full;

    /// Answers with the worker that serves the request.
    struct WhichWorker;

    impl Handler for WhichWorker {
        async fn call(self: Arc<Self>, _: Request<Incoming>, _: ClientInfo) -> Response<ProxyBody> {
            let lane = crate::workers::lane().map_or("none".to_owned(), |l| l.to_string());
            Response::new(full(lane.into()))
        }
    }

    /// Waits up to 5 s for `load` to count `total` connections in all.
    async fn counted(load: &Load, total: usize) -> Vec<usize> {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        loop {
            let now = load.connections();
            if now.iter().sum::<usize>() == total || tokio::time::Instant::now() > deadline {
                return now;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    // A client that opens its connections in a burst (a pool warming up)
    // finds them shared among the workers, whichever worker the kernel
    // wakes to accept them; the load (`idemproxy_worker_connections`)
    // counts them where they are served, and no more once they close.
    #[tokio::test]
    async fn a_burst_of_connections_is_shared_among_the_workers() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let shutdown = CancellationToken::new();
        let (workers, load, served) = serve_on_workers(
            listener,
            Arc::new(WhichWorker),
            ListenerOptions {
                header_read_timeout: Duration::from_secs(5),
                tls: None,
            },
            shutdown.clone(),
            Duration::from_secs(1),
            2,
        )
        .unwrap();
        // Every connection is open before any request is sent.
        let mut conns: Vec<_> = tokio::task::spawn_blocking(move || {
            (0..32)
                .map(|_| std::net::TcpStream::connect(addr).unwrap())
                .collect()
        })
        .await
        .unwrap();
        let open = counted(&load, 32).await;
        let lanes = tokio::task::spawn_blocking(move || {
            conns
                .iter_mut()
                .map(|c| {
                    c.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
                    c.write_all(b"GET / HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
                        .unwrap();
                    let mut answer = String::new();
                    c.read_to_string(&mut answer).unwrap();
                    answer.rsplit("\r\n\r\n").next().unwrap().to_owned()
                })
                .collect::<Vec<_>>()
        })
        .await
        .unwrap();
        let on = |lane: &str| lanes.iter().filter(|l| *l == lane).count();
        assert_eq!(on("0") + on("1"), 32, "{lanes:?}");
        assert_eq!(open, [on("0"), on("1")], "counted where they were served");
        assert_eq!(counted(&load, 0).await, [0, 0], "closed, no longer counted");
        assert!(
            on("0").abs_diff(on("1")) <= 4,
            "32 connections at once: {} on worker 0, {} on worker 1",
            on("0"),
            on("1")
        );
        shutdown.cancel();
        tokio::time::timeout(Duration::from_secs(5), served)
            .await
            .expect("the workers drain");
        workers.release();
    }
}
