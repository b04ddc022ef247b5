//! The upstream client: pooled keep-alive connections, bounded connect and
//! exchange times, and errors sorted by what they prove.
//!
//! An `https://` upstream is verified (chain and host name) against the
//! system trust store plus `upstream.ca_file` (see [`crate::tls`]). A
//! certificate that does not verify fails the connection before any request
//! byte is written, so it is a [`UpstreamError::Connect`]: the claim is
//! released and the client gets 502.
//!
//! The client is our own, over `hyper::client::conn::http1`: there is one
//! upstream, so its pool (`pool`) is a stack keyed by nothing, and new
//! connections are made by `connect`. What it keeps of hyper-util's
//! legacy client is the one behaviour a proxy depends on: a pooled
//! connection that the upstream closed while it sat idle does not fail a
//! request never written to it. hyper hands such a request back
//! (`TrySendError::take_message`), and it is sent again on another
//! connection. A request that may have been written is never sent again:
//! its outcome is unknown (DESIGN.md §2).

mod connect;
mod pool;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use http::uri::{PathAndQuery, Scheme};
use http::{HeaderValue, Request, Response, Uri, Version};
use hyper::body::Incoming;
use thiserror::Error;

use super::ProxyBody;
use crate::config::UpstreamConfig;
use crate::idempotency::UpstreamOutcome;
use connect::Connector;
use pool::Pool;

/// Why an upstream exchange produced no response.
#[derive(Debug, Error)]
pub enum UpstreamError {
    /// No connection could be made: the request provably never left.
    #[error("could not connect to the upstream: {0}")]
    Connect(String),
    /// The upstream's TLS certificate did not verify: the connection was
    /// refused before a request byte was written.
    #[error("the upstream's certificate did not verify: {0}")]
    Certificate(String),
    /// No answer within `upstream.timeout`: the outcome is unknown.
    #[error("the upstream did not answer within {0:?}")]
    Timeout(Duration),
    /// The connection failed after the request was (maybe) sent.
    #[error("the upstream exchange failed: {0}")]
    Failed(String),
}

impl UpstreamError {
    /// What the failure proves about the request, for
    /// [`settle`](crate::idempotency::settle): a connection never made means
    /// it was never sent; anything later leaves its outcome unknown.
    pub fn outcome(&self) -> UpstreamOutcome {
        match self {
            UpstreamError::Connect(_) | UpstreamError::Certificate(_) => UpstreamOutcome::NotSent,
            UpstreamError::Timeout(_) | UpstreamError::Failed(_) => UpstreamOutcome::Unknown,
        }
    }
}

/// The upstream as the proxy sees it. Clones share the connections.
#[derive(Clone)]
pub struct Upstream {
    /// The connections and how to make more, shared by every clone.
    shared: Arc<Shared>,
    host_header: HeaderValue,
    base_path: String,
    timeout: Duration,
}

/// What the clones of an [`Upstream`] share.
struct Shared {
    /// One pool per lane: lane 0 for threads that are no worker, lane
    /// `n + 1` for worker `n` ([`crate::workers::lane`]). A connection is
    /// driven by a task on the runtime that made it, so a worker that keeps
    /// to its own pool never hands an exchange to another thread.
    pools: Box<[Pool]>,
    connector: Connector,
    /// Whether the task that lets idle connections go has been started: on
    /// the first connection made, since building the client needs no
    /// runtime.
    sweeping: AtomicBool,
}

impl Upstream {
    /// Builds the client with one pool. Fails for URLs the client cannot
    /// serve.
    pub fn new(config: &UpstreamConfig) -> anyhow::Result<Self> {
        Self::with_lanes(config, 1)
    }

    /// Builds the client with `lanes` pools: one for the threads that are
    /// no worker and one per worker, each keeping at most its share of
    /// the connections. Fails for URLs the client cannot serve.
    pub fn with_lanes(config: &UpstreamConfig, lanes: usize) -> anyhow::Result<Self> {
        let uri = &config.url;
        let scheme = uri.scheme().cloned().unwrap_or(Scheme::HTTP);
        if scheme != Scheme::HTTP && scheme != Scheme::HTTPS {
            anyhow::bail!("upstream.url: only http:// and https:// upstreams are supported");
        }
        let authority = uri
            .authority()
            .cloned()
            .ok_or_else(|| anyhow::anyhow!("upstream.url has no host"))?;
        let host_header = HeaderValue::from_str(authority.as_str())?;
        let base_path = uri.path().trim_end_matches('/').to_owned();
        let https = scheme == Scheme::HTTPS;
        let port = authority.port_u16().unwrap_or(if https { 443 } else { 80 });
        let tls = if https {
            Some(crate::tls::upstream_client_config(
                config.ca_file.as_deref(),
            )?)
        } else {
            None
        };
        let connector = Connector::new(authority.host(), port, tls, config.connect_timeout)?;
        Ok(Upstream {
            shared: Arc::new(Shared {
                pools: (0..lanes.max(1))
                    .map(|_| Pool::new(pool::MAX_KEPT.div_ceil(lanes.max(1))))
                    .collect(),
                connector,
                sweeping: AtomicBool::new(false),
            }),
            host_header,
            base_path,
            timeout: config.timeout,
        })
    }

    /// The exchange bound.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// The `Host` the upstream is addressed as.
    pub fn host_header(&self) -> &HeaderValue {
        &self.host_header
    }

    /// The upstream URI for a request's path and query: origin-form
    /// (`/base/path?query`), as it goes on the request line; the upstream
    /// is named by the `Host` header.
    pub fn uri_for(&self, pq: Option<&PathAndQuery>) -> Result<Uri, http::Error> {
        if self.base_path.is_empty() {
            // No copy and no parse: the client's own path and query.
            return Ok(match pq {
                Some(pq) => Uri::from(pq.clone()),
                None => Uri::from_static("/"),
            });
        }
        let pq = pq.map_or("/", |p| p.as_str());
        Uri::builder()
            .path_and_query(format!("{}{}", self.base_path, pq))
            .build()
    }

    /// Sends a request and waits for the response headers, within the
    /// exchange bound.
    pub async fn send(
        &self,
        mut req: Request<ProxyBody>,
    ) -> Result<Response<Incoming>, UpstreamError> {
        *req.version_mut() = Version::HTTP_11;
        // hyper::client::conn writes the URI as given: origin-form only.
        if req.uri().scheme().is_some() {
            let origin = req
                .uri()
                .path_and_query()
                .cloned()
                .map_or_else(|| Uri::from_static("/"), Uri::from);
            *req.uri_mut() = origin;
        }
        match crate::timer::timeout(self.timeout, self.exchange(req)).await {
            Err(_) => Err(UpstreamError::Timeout(self.timeout)),
            Ok(result) => result,
        }
    }

    /// One exchange: on a kept connection if one is ready, else on a new
    /// one; sent again only when hyper proves it was not written.
    async fn exchange(
        &self,
        mut req: Request<ProxyBody>,
    ) -> Result<Response<Incoming>, UpstreamError> {
        let pool = self.shared.pool();
        loop {
            let (mut sender, reused) = match pool.checkout() {
                Some(sender) => (sender, true),
                // Boxed: a new connection's future (TCP, TLS, the
                // HTTP/1 handshake) is large and rarely needed; inline, it
                // would be laid out in, and moved with, every request's.
                None => (Box::pin(self.connect()).await?, false),
            };
            match sender.try_send_request(req).await {
                Ok(resp) => {
                    // Kept while the body streams: checkout skips it until
                    // hyper says it is ready again.
                    pool.put(sender);
                    return Ok(resp);
                }
                Err(mut e) => match e.take_message() {
                    // The connection closed before the request was written
                    // (the upstream timed it out while it sat idle): any
                    // other connection will do. Each such connection is
                    // dropped, so this ends, on a new connection at worst.
                    Some(back) if reused => req = back,
                    // A new connection that closed before the request was
                    // written: not reached.
                    Some(_) => {
                        return Err(UpstreamError::Connect(error_chain(&e.into_error())));
                    }
                    None => return Err(UpstreamError::Failed(error_chain(&e.into_error()))),
                },
            }
        }
    }

    /// A new connection; the first one also starts the sweeper.
    async fn connect(
        &self,
    ) -> Result<hyper::client::conn::http1::SendRequest<ProxyBody>, UpstreamError> {
        if !self.shared.sweeping.swap(true, Ordering::Relaxed) {
            tokio::spawn(sweep(Arc::downgrade(&self.shared)));
        }
        self.shared.connector.connect().await
    }
}

impl Shared {
    /// The pool of the calling thread's lane.
    fn pool(&self) -> &Pool {
        let lane = crate::workers::lane().map_or(0, |n| n + 1);
        self.pools.get(lane).unwrap_or(&self.pools[0])
    }
}

/// Lets connections idle past the timeout go even when no request comes to
/// check them out; ends with the last clone of its [`Upstream`] (a reload
/// builds a new one).
async fn sweep(shared: Weak<Shared>) {
    let mut tick = tokio::time::interval(pool::IDLE_TIMEOUT / 2);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let Some(shared) = shared.upgrade() else {
            return;
        };
        let now = Instant::now();
        for pool in &shared.pools {
            pool.sweep(now);
        }
    }
}

/// Whether TLS refused the connection. rustls's error reaches us inside
/// `io::Error`s (one in another), whose `source()` skips the error each
/// wraps: look inside them too.
fn is_tls_failure(e: &(dyn std::error::Error + 'static)) -> bool {
    let mut next = Some(e);
    while let Some(err) = next {
        if err.is::<rustls::Error>() {
            return true;
        }
        if let Some(inner) = err
            .downcast_ref::<std::io::Error>()
            .and_then(|io| io.get_ref())
        {
            if is_tls_failure(inner) {
                return true;
            }
        }
        next = err.source();
    }
    false
}

/// An error and its causes on one line.
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    // DESIGN.md §2: refused → released; timed out or reset → kept.
    #[test]
    fn connect_failure_proves_the_request_was_not_sent() {
        assert_eq!(
            UpstreamError::Connect("refused".into()).outcome(),
            UpstreamOutcome::NotSent
        );
    }

    #[test]
    fn a_certificate_refused_by_tls_is_told_apart_from_other_io_errors() {
        let tls = std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            rustls::Error::InvalidCertificate(rustls::CertificateError::UnknownIssuer),
        );
        assert!(is_tls_failure(&tls));
        // As hyper-rustls hands it on: wrapped once more.
        assert!(is_tls_failure(&std::io::Error::other(tls)));
        let refused = std::io::Error::from(std::io::ErrorKind::ConnectionRefused);
        assert!(!is_tls_failure(&refused));
        assert_eq!(
            UpstreamError::Certificate("x".into()).outcome(),
            UpstreamOutcome::NotSent
        );
    }

    #[test]
    fn timeout_and_later_failure_leave_the_outcome_unknown() {
        assert_eq!(
            UpstreamError::Timeout(Duration::from_secs(1)).outcome(),
            UpstreamOutcome::Unknown
        );
        assert_eq!(
            UpstreamError::Failed("reset".into()).outcome(),
            UpstreamOutcome::Unknown
        );
    }

    // -----------------------------------------------------------------
    // The pool, against a real local TCP upstream.

    use std::io::{Read, Write};
    use std::net::{TcpListener, TcpStream};
    use std::sync::mpsc;
    use std::sync::Mutex;

    use http_body_util::BodyExt;

    /// A raw HTTP/1.1 upstream on threads of its own: every request gets
    /// `200 ok`, keep-alive; each connection answers at most `per_conn`
    /// requests and is then closed by the upstream (once `close` is sent,
    /// if the test holds it), which says so on `closed`. `GET /slow`'s body
    /// ends only once another request arrived. What it saw: (connection
    /// number, request line).
    struct RawUpstream {
        addr: std::net::SocketAddr,
        seen: Arc<Mutex<Vec<(usize, String)>>>,
        close: Option<mpsc::Sender<()>>,
        closed: mpsc::Receiver<usize>,
    }

    /// What the connection threads share.
    struct Serving {
        per_conn: usize,
        seen: Arc<Mutex<Vec<(usize, String)>>>,
        close: Option<Mutex<mpsc::Receiver<()>>>,
        closed: Mutex<mpsc::Sender<usize>>,
    }

    impl RawUpstream {
        fn start(per_conn: usize) -> Self {
            Self::spawn(per_conn, false)
        }

        /// Connections close only when the test says so.
        fn gated(per_conn: usize) -> Self {
            Self::spawn(per_conn, true)
        }

        fn spawn(per_conn: usize, gated: bool) -> Self {
            let listener = TcpListener::bind("127.0.0.1:0").unwrap();
            let addr = listener.local_addr().unwrap();
            let seen = Arc::new(Mutex::new(Vec::new()));
            let (closed_tx, closed) = mpsc::channel();
            let (close, gate) = if gated {
                let (tx, rx) = mpsc::channel();
                (Some(tx), Some(Mutex::new(rx)))
            } else {
                (None, None)
            };
            let serving = Arc::new(Serving {
                per_conn,
                seen: seen.clone(),
                close: gate,
                closed: Mutex::new(closed_tx),
            });
            std::thread::spawn(move || {
                for (n, stream) in listener.incoming().enumerate() {
                    let serving = serving.clone();
                    std::thread::spawn(move || serve(n, stream.unwrap(), &serving));
                }
            });
            RawUpstream {
                addr,
                seen,
                close,
                closed,
            }
        }

        fn upstream(&self, base: &str) -> Upstream {
            Upstream::new(&UpstreamConfig {
                url: format!("http://{}{base}", self.addr).parse().unwrap(),
                connect_timeout: Duration::from_secs(5),
                timeout: Duration::from_secs(5),
                ca_file: None,
            })
            .unwrap()
        }

        fn seen(&self) -> Vec<(usize, String)> {
            self.seen.lock().unwrap().clone()
        }
    }

    fn serve(n: usize, mut s: TcpStream, serving: &Serving) {
        let mut buf = Vec::new();
        for _ in 0..serving.per_conn {
            let mut byte = [0u8; 1];
            while !buf.ends_with(b"\r\n\r\n") {
                match s.read(&mut byte) {
                    Ok(1) => buf.push(byte[0]),
                    _ => return,
                }
            }
            let head = String::from_utf8_lossy(&buf).into_owned();
            buf.clear();
            let line = head.lines().next().unwrap_or("").to_owned();
            let slow = line.starts_with("GET /slow ");
            serving.seen.lock().unwrap().push((n, line));
            if slow {
                s.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 4\r\n\r\nok")
                    .unwrap();
                for _ in 0..5000 {
                    if serving.seen.lock().unwrap().len() > 1 {
                        break;
                    }
                    std::thread::sleep(Duration::from_millis(1));
                }
                s.write_all(b"ok").unwrap();
            } else {
                s.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
                    .unwrap();
            }
        }
        if let Some(gate) = &serving.close {
            let _ = gate.lock().unwrap().recv();
        }
        drop(s);
        let _ = serving.closed.lock().unwrap().send(n);
    }

    fn get(path: &str) -> Request<ProxyBody> {
        let mut req = Request::new(crate::proxy::full(bytes::Bytes::new()));
        *req.uri_mut() = path.parse().unwrap();
        req.headers_mut()
            .insert(http::header::HOST, HeaderValue::from_static("upstream"));
        req
    }

    /// Sends and reads the whole answer.
    async fn fetch(u: &Upstream, req: Request<ProxyBody>) -> String {
        let resp = u.send(req).await.unwrap();
        let body = resp.into_body().collect().await.unwrap().to_bytes();
        String::from_utf8(body.to_vec()).unwrap()
    }

    /// Polls a state the connection tasks change.
    async fn until(what: impl Fn() -> bool) {
        for _ in 0..5000 {
            if what() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        panic!("condition not reached in 5 s");
    }

    #[tokio::test]
    async fn a_connection_is_reused_once_its_response_was_read_and_requests_go_in_origin_form() {
        let raw = RawUpstream::start(10);
        let u = raw.upstream("/base/");
        let pq = PathAndQuery::from_static("/v1/orders?x=1");
        let mut req = get("/");
        *req.uri_mut() = u.uri_for(Some(&pq)).unwrap();
        assert_eq!(fetch(&u, req).await, "ok");
        until(|| u.shared.pool().all_ready()).await;
        // An absolute-form URI is sent in origin-form too.
        let mut req = get("http://elsewhere:1/v1/orders/2");
        *req.method_mut() = http::Method::POST;
        assert_eq!(fetch(&u, req).await, "ok");
        assert_eq!(
            raw.seen(),
            vec![
                (0, "GET /base/v1/orders?x=1 HTTP/1.1".to_owned()),
                (0, "POST /v1/orders/2 HTTP/1.1".to_owned()),
            ]
        );
        assert_eq!(u.shared.pool().len(), 1);
    }

    #[tokio::test]
    async fn a_connection_still_streaming_its_response_is_not_used() {
        let raw = RawUpstream::start(10);
        let u = raw.upstream("");
        let first = u.send(get("/slow")).await.unwrap();
        // The first body has not ended: its connection is busy.
        assert_eq!(fetch(&u, get("/b")).await, "ok");
        let body = first.into_body().collect().await.unwrap().to_bytes();
        assert_eq!(&body[..], b"okok");
        assert_eq!(
            raw.seen(),
            vec![
                (0, "GET /slow HTTP/1.1".to_owned()),
                (1, "GET /b HTTP/1.1".to_owned())
            ]
        );
        // Both are kept, and both are ready once their answers were read.
        until(|| u.shared.pool().len() == 2 && u.shared.pool().all_ready()).await;
    }

    #[tokio::test]
    async fn an_idle_connection_the_upstream_closed_is_not_used() {
        let raw = RawUpstream::start(1);
        let u = raw.upstream("");
        assert_eq!(fetch(&u, get("/a")).await, "ok");
        // hyper has seen the close: checkout drops the connection.
        until(|| u.shared.pool().all_closed()).await;
        assert_eq!(fetch(&u, get("/b")).await, "ok");
        assert_eq!(
            raw.seen(),
            vec![
                (0, "GET /a HTTP/1.1".to_owned()),
                (1, "GET /b HTTP/1.1".to_owned())
            ]
        );
    }

    // The legacy client's one indispensable behaviour: a kept connection
    // closes after checkout but before its task took the request. hyper
    // hands the request back unwritten; it goes out on a new connection.
    #[tokio::test]
    async fn a_request_handed_back_unwritten_is_sent_on_a_new_connection() {
        let raw = RawUpstream::start(10);
        let u = raw.upstream("");
        let (io, _peer) = tokio::io::duplex(1024);
        let (sender, mut conn) =
            hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(io))
                .await
                .unwrap();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        tokio::spawn(async move {
            tokio::select! {
                biased;
                _ = stopped => {}
                _ = &mut conn => {}
            }
            // `conn` dropped here: a request still queued comes back.
        });
        u.shared.pool().put(sender);
        until(|| u.shared.pool().all_ready()).await;
        // The connection's task runs only once `send` yields, after the
        // request was queued on this connection: it ends without taking it.
        stop.send(()).unwrap();
        assert_eq!(fetch(&u, get("/b")).await, "ok");
        assert_eq!(raw.seen(), vec![(0, "GET /b HTTP/1.1".to_owned())]);
    }

    // The other side of the same rule: once hyper may have written the
    // request, it is not sent again, even when the connection turns out to
    // have been closed by the upstream while idle (the close arrived, but
    // this runtime had not yet seen it). Its outcome is unknown.
    #[tokio::test]
    async fn a_request_maybe_written_to_a_closed_connection_is_not_sent_again() {
        let raw = RawUpstream::gated(1);
        let u = raw.upstream("");
        assert_eq!(fetch(&u, get("/a")).await, "ok");
        until(|| u.shared.pool().all_ready()).await;
        // Closed while this (single) runtime thread is blocked: the
        // connection's task cannot run, so hyper has not seen the close.
        raw.close.as_ref().unwrap().send(()).unwrap();
        assert_eq!(raw.closed.recv_timeout(Duration::from_secs(5)), Ok(0));
        assert!(!u.shared.pool().all_closed() && u.shared.pool().len() == 1);
        let err = u.send(get("/b")).await.unwrap_err();
        assert!(matches!(err, UpstreamError::Failed(_)), "{err}");
        assert_eq!(err.outcome(), UpstreamOutcome::Unknown);
        assert_eq!(raw.seen(), vec![(0, "GET /a HTTP/1.1".to_owned())]);
    }

    #[tokio::test]
    async fn connections_idle_past_the_timeout_are_let_go() {
        let raw = RawUpstream::start(10);
        let u = raw.upstream("");
        assert_eq!(fetch(&u, get("/a")).await, "ok");
        until(|| u.shared.pool().all_ready()).await;
        u.shared.pool().sweep(Instant::now());
        assert_eq!(u.shared.pool().len(), 1);
        u.shared.pool().sweep(Instant::now() + pool::IDLE_TIMEOUT);
        assert_eq!(u.shared.pool().len(), 0);
    }

    #[tokio::test]
    async fn a_refused_connection_proves_the_request_was_not_sent() {
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let u = Upstream::new(&UpstreamConfig {
            url: format!("http://127.0.0.1:{port}").parse().unwrap(),
            connect_timeout: Duration::from_secs(5),
            timeout: Duration::from_secs(5),
            ca_file: None,
        })
        .unwrap();
        let err = u.send(get("/a")).await.unwrap_err();
        assert!(matches!(err, UpstreamError::Connect(_)), "{err}");
        assert_eq!(err.outcome(), UpstreamOutcome::NotSent);
    }
}
