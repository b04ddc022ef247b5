//! A small, real HTTP server standing in for a "legacy", non-idempotent API.
//!
//! The sample upstream is what the README quick start puts behind idemproxy,
//! and what the integration tests use (in-process on a port-0 socket, or as the
//! separate `sample-upstream` binary). Its one job is to make side effects
//! observable: every request it *executes* increments a global counter and a
//! counter for the request's `Idempotency-Key`, so a test can prove that a key
//! was executed exactly once, and every answer carries the execution number so
//! a replay (same bytes) can be told apart from a re-execution (new number).
//!
//! # Behaviour
//!
//! Every request (any method, any path) outside the reserved `/__sample/`
//! prefix is an *execution*: the whole body is read, the counters are
//! incremented (requests without an `Idempotency-Key` header are counted under
//! the empty key `""`), the request is recorded and logged at `info`, and then
//! the request is answered. The answer can be shaped with request headers
//! (headers, so that they are not part of the request's idempotency
//! fingerprint):
//!
//! | header | effect |
//! |---|---|
//! | [`DELAY_HEADER`] `x-sample-delay-ms: N` | sleep N ms after counting, before answering (or failing) |
//! | [`STATUS_HEADER`] `x-sample-status: NNN` | answer with status NNN (200..=999) instead of 201 |
//! | [`FAIL_HEADER`] `x-sample-fail: reset` | count, then close the connection without answering (HTTP/2: reset the stream) |
//! | [`FAIL_HEADER`] `x-sample-fail: hang` | count, then never answer (until the server shuts down) |
//! | [`BODY_SIZE_HEADER`] `x-sample-body-size: N` | answer with N bytes of [`body_pattern`] (`application/octet-stream`) instead of the JSON |
//! | [`SET_COOKIE_HEADER`] `x-sample-set-cookie: N` | add N separate `Set-Cookie: c{i}=v{i}` lines, i = 1..=N |
//! | [`SLOW_BODY_HEADER`] `x-sample-slow-body-ms: N` | send the body in small chunks with N ms between them |
//!
//! Two options of [`SampleUpstream::start_with`] (the binary's `--delay-ms`
//! and `--charges`) make it the demo's slow legacy payment service:
//! [`Options::delay`] is the delay of every execution that does not send
//! [`DELAY_HEADER`] itself (a client that knows nothing of this server still
//! meets a slow service), and [`Options::charges`] adds `"id": "ch_<n>"` and
//! `"object": "charge"` to the JSON answer, enough for a Stripe SDK to read
//! it as a Charge.
//!
//! A request whose control headers cannot be parsed is answered `400` with a
//! JSON `{"error": ...}` body and is **not** counted or recorded.
//!
//! The default answer is status `201`, headers `content-type:
//! application/json`, `x-sample-execution: <global execution number>` and
//! `x-request-echo-attempt: <Idempotency-Attempt received, or "none">`, and
//! the JSON body
//!
//! ```json
//! {"execution": 7, "key_executions": 1, "key": "k", "attempt": "1",
//!  "method": "POST", "path": "/orders?x=1", "body_sha256": "…", "body_len": 12}
//! ```
//!
//! # Control endpoints
//!
//! These are never counted as executions nor recorded:
//!
//! * `GET /__sample/health` → `200 ok`
//! * `GET /__sample/executions?key=K` → `{"key": K, "executions": n}` (`K` is
//!   form-url-decoded: `%XX` escapes and `+` for a space; `key=` asks for the
//!   empty key, i.e. requests without the header)
//! * `GET /__sample/stats` → `{"total": n, "keys": {key: n, ...}}`
//!
//! Any other path under `/__sample/` is `404`, another method `405`.
//!
//! # Layout
//!
//! * this file: the counters, [`SampleUpstream::start`] and the handle a
//!   test inspects, and the accept loop with its graceful shutdown;
//! * `handlers.rs`: the control headers, the executed request and the
//!   `/__sample/` endpoints;
//! * `slow_body.rs`: the chunked body of [`SLOW_BODY_HEADER`];
//! * `main.rs`: the `sample-upstream` binary (what `deploy/`, `scripts/dev
//!   run`, `bench/run` and the fault tests start).
//!
//! It is its own package, outside the `idemproxy` library, so that nothing
//! the proxy ships depends on it; the proxy's tests take it as a
//! dev-dependency.
//!
//! # Example
//!
//! ```no_run
//! # async fn demo() -> std::io::Result<()> {
//! use sample_upstream::SampleUpstream;
//! let (tx, rx) = tokio::sync::oneshot::channel::<()>();
//! let upstream = SampleUpstream::start("127.0.0.1:0".parse().unwrap(), async move {
//!     let _ = rx.await;
//! })
//! .await?;
//! println!("sample upstream at {}", upstream.url());
//! // ... send requests through the proxy ...
//! assert_eq!(upstream.executions("order-42"), 1);
//! let _ = tx.send(());
//! upstream.stopped().await;
//! # Ok(())
//! # }
//! ```

use std::collections::HashMap;
use std::convert::Infallible;
use std::future::Future;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::combinators::BoxBody;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinSet;

mod handlers;
mod slow_body;
#[cfg(test)]
mod tests;

use handlers::handle;

/// Request header carrying the idempotency key that executions are counted under.
pub const IDEMPOTENCY_KEY_HEADER: &str = "idempotency-key";
/// Request header carrying the attempt number; echoed in [`ECHO_ATTEMPT_HEADER`].
pub const IDEMPOTENCY_ATTEMPT_HEADER: &str = "idempotency-attempt";
/// Control header: sleep this many milliseconds after counting, before answering.
pub const DELAY_HEADER: &str = "x-sample-delay-ms";
/// Control header: answer with this status code instead of `201`.
pub const STATUS_HEADER: &str = "x-sample-status";
/// Control header: `reset` (close without answering) or `hang` (never answer).
pub const FAIL_HEADER: &str = "x-sample-fail";
/// Control header: answer with this many bytes of [`body_pattern`] instead of JSON.
pub const BODY_SIZE_HEADER: &str = "x-sample-body-size";
/// Control header: add this many `Set-Cookie: c{i}=v{i}` lines (i = 1..=N).
pub const SET_COOKIE_HEADER: &str = "x-sample-set-cookie";
/// Control header: send the body in chunks with this many milliseconds between them.
pub const SLOW_BODY_HEADER: &str = "x-sample-slow-body-ms";
/// Response header carrying the global execution number of the answer.
pub const EXECUTION_HEADER: &str = "x-sample-execution";
/// Response header echoing the received `Idempotency-Attempt`, or `none`.
pub const ECHO_ATTEMPT_HEADER: &str = "x-request-echo-attempt";

/// Largest body [`BODY_SIZE_HEADER`] may ask for (256 MiB).
pub const MAX_BODY_SIZE: usize = 256 * 1024 * 1024;
/// Largest number of cookies [`SET_COOKIE_HEADER`] may ask for.
pub const MAX_SET_COOKIES: usize = 10_000;
/// Smallest chunk a slow body ([`SLOW_BODY_HEADER`]) is sent in, in bytes.
pub const SLOW_BODY_CHUNK: usize = 64;
/// Most chunks a slow body is split into; larger bodies get larger chunks.
pub const SLOW_BODY_MAX_CHUNKS: usize = 64;
/// How long shutdown waits for in-flight requests before dropping connections.
pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(2);

const CONTROL_PREFIX: &str = "/__sample/";
const BODY_ALPHABET: &[u8] = b"abcdefghijklmnopqrstuvwxyz0123456789";

/// The deterministic body content used for [`BODY_SIZE_HEADER`]: `len` bytes
/// cycling through `a`..`z` then `0`..`9`.
pub fn body_pattern(len: usize) -> Vec<u8> {
    BODY_ALPHABET.iter().copied().cycle().take(len).collect()
}

/// How a sample upstream behaves when a request does not say otherwise.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Options {
    /// Delay of every execution without a [`DELAY_HEADER`] of its own.
    pub delay: Option<Duration>,
    /// Answer JSON that a Stripe SDK reads as a Charge (`id`, `object`).
    pub charges: bool,
}

/// The shared state of a running sample upstream: execution counters and the
/// record of every executed request. Create one with [`SampleUpstream::start`]
/// and inspect it through the returned [`SampleUpstreamHandle`].
#[derive(Debug)]
pub struct SampleUpstream {
    counters: Mutex<Counters>,
    options: Options,
    /// Flipped to `true` when shutdown begins; releases `hang` requests.
    stopping: watch::Sender<bool>,
}

#[derive(Debug, Default)]
struct Counters {
    total: u64,
    per_key: HashMap<String, u64>,
    requests: Vec<RecordedRequest>,
}

/// One executed request, as the sample upstream received it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecordedRequest {
    /// The request method, e.g. `POST`.
    pub method: String,
    /// The path and query, e.g. `/orders?dry=1`.
    pub path: String,
    /// The `Idempotency-Key` value (lossily decoded), `""` if absent.
    pub key: String,
    /// Every header in received order, as (lower-case name, raw value bytes).
    pub headers: Vec<(String, Vec<u8>)>,
    /// The complete request body.
    pub body: Bytes,
    /// The global execution number this request got (1-based).
    pub execution: u64,
    /// The execution number for this request's key (1-based).
    pub key_execution: u64,
}

impl RecordedRequest {
    /// The value of the first header named `name` (case-insensitive), if any.
    pub fn header(&self, name: &str) -> Option<&[u8]> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_slice())
    }
}

/// A running sample upstream: where it listens and what it has executed.
///
/// Cheap to clone; all clones observe the same server.
#[derive(Debug, Clone)]
pub struct SampleUpstreamHandle {
    addr: SocketAddr,
    state: Arc<SampleUpstream>,
    stopped: watch::Receiver<bool>,
}

impl SampleUpstream {
    /// Binds `addr` (port 0 allowed) and serves until `shutdown` resolves
    /// (HTTP/1.1 + h2c via hyper_util auto builder). Returns a handle
    /// immediately after binding.
    ///
    /// When `shutdown` resolves the listener is closed, `hang` requests are
    /// released (their connections are closed without an answer), and
    /// in-flight requests get [`SHUTDOWN_GRACE`] to finish before their
    /// connections are dropped; [`SampleUpstreamHandle::stopped`] then
    /// completes.
    ///
    /// # Errors
    ///
    /// Fails if the address cannot be bound.
    pub async fn start(
        addr: SocketAddr,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> std::io::Result<SampleUpstreamHandle> {
        Self::start_with(addr, Options::default(), shutdown).await
    }

    /// [`SampleUpstream::start`] with [`Options`].
    ///
    /// # Errors
    ///
    /// Fails if the address cannot be bound.
    pub async fn start_with(
        addr: SocketAddr,
        options: Options,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> std::io::Result<SampleUpstreamHandle> {
        let listener = TcpListener::bind(addr).await?;
        let addr = listener.local_addr()?;
        let (stopping, _) = watch::channel(false);
        let state = Arc::new(SampleUpstream {
            counters: Mutex::new(Counters::default()),
            options,
            stopping,
        });
        let (stopped_tx, stopped) = watch::channel(false);
        tokio::spawn(serve(listener, Arc::clone(&state), shutdown, stopped_tx));
        Ok(SampleUpstreamHandle {
            addr,
            state,
            stopped,
        })
    }

    fn counters(&self) -> MutexGuard<'_, Counters> {
        self.counters.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Counts and records one execution; returns (global n, per-key n).
    fn record(&self, mut request: RecordedRequest) -> (u64, u64) {
        let mut counters = self.counters();
        counters.total += 1;
        let execution = counters.total;
        let key_count = counters.per_key.entry(request.key.clone()).or_insert(0);
        *key_count += 1;
        let key_execution = *key_count;
        request.execution = execution;
        request.key_execution = key_execution;
        counters.requests.push(request);
        (execution, key_execution)
    }
}

impl SampleUpstreamHandle {
    /// The address actually bound (with the real port when started on port 0).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The base URL to reach the server, e.g. `http://127.0.0.1:PORT`
    /// (an unspecified bind address is replaced by the loopback address).
    pub fn url(&self) -> String {
        let ip = match self.addr.ip() {
            IpAddr::V4(ip) if ip.is_unspecified() => IpAddr::V4(Ipv4Addr::LOCALHOST),
            IpAddr::V6(ip) if ip.is_unspecified() => IpAddr::V6(Ipv6Addr::LOCALHOST),
            ip => ip,
        };
        format!("http://{}", SocketAddr::new(ip, self.addr.port()))
    }

    /// Executions recorded so far for this idempotency key (the value of the
    /// `Idempotency-Key` request header as received), 0 if none. Requests
    /// without the header are counted under `""`.
    pub fn executions(&self, key: &str) -> u64 {
        self.state.counters().per_key.get(key).copied().unwrap_or(0)
    }

    /// Every request received, in order (method, path+query, headers as
    /// (name, value-bytes) pairs, body bytes, the execution number it got).
    /// Control-endpoint requests and requests rejected for malformed control
    /// headers are not included.
    pub fn requests(&self) -> Vec<RecordedRequest> {
        self.state.counters().requests.clone()
    }

    /// The number of executions so far, over all keys (control endpoints excluded).
    pub fn total_requests(&self) -> u64 {
        self.state.counters().total
    }

    /// Whether the server has finished shutting down.
    pub fn is_stopped(&self) -> bool {
        *self.stopped.borrow()
    }

    /// Completes once the server has stopped serving (after its `shutdown`
    /// future resolved and connections were drained or dropped).
    pub async fn stopped(&self) {
        let mut stopped = self.stopped.clone();
        // An error means the serving task is gone, which is stopped as well.
        let _ = stopped.wait_for(|s| *s).await;
    }
}

type SampleBody = BoxBody<Bytes, Infallible>;

#[derive(Debug, thiserror::Error)]
enum ServiceError {
    #[error("connection reset on request ({FAIL_HEADER}: reset)")]
    Reset,
    #[error("server shutting down while a request hangs ({FAIL_HEADER}: hang)")]
    ShuttingDown,
    #[error("reading the request body: {0}")]
    Body(#[from] hyper::Error),
}

async fn serve(
    listener: TcpListener,
    state: Arc<SampleUpstream>,
    shutdown: impl Future<Output = ()> + Send + 'static,
    stopped: watch::Sender<bool>,
) {
    let builder = auto::Builder::new(TokioExecutor::new());
    let graceful = GracefulShutdown::new();
    let mut connections = JoinSet::new();
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            () = &mut shutdown => break,
            accepted = listener.accept() => match accepted {
                Ok((stream, peer)) => {
                    // Best effort: small answers should not wait for Nagle.
                    let _ = stream.set_nodelay(true);
                    let state = Arc::clone(&state);
                    let service = hyper::service::service_fn(move |req| {
                        handle(Arc::clone(&state), req)
                    });
                    let conn = builder
                        .serve_connection(TokioIo::new(stream), service)
                        .into_owned();
                    let conn = graceful.watch(conn);
                    connections.spawn(async move {
                        if let Err(error) = conn.await {
                            tracing::debug!(%peer, %error, "sample upstream connection ended with an error");
                        }
                    });
                }
                Err(error) => {
                    tracing::warn!(%error, "sample upstream accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            },
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
        }
    }
    drop(listener);
    state.stopping.send_replace(true);
    if tokio::time::timeout(SHUTDOWN_GRACE, graceful.shutdown())
        .await
        .is_err()
    {
        tracing::warn!("sample upstream: in-flight requests did not finish in time; dropping them");
    }
    connections.shutdown().await;
    stopped.send_replace(true);
}
