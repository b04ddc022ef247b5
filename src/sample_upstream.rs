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
//! # Example
//!
//! ```no_run
//! # async fn demo() -> std::io::Result<()> {
//! use idemproxy::sample_upstream::SampleUpstream;
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

use std::collections::{BTreeMap, HashMap};
use std::convert::Infallible;
use std::future::Future;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::task::{ready, Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full};
use hyper::body::{Body, Frame, Incoming};
use hyper::header::{HeaderMap, HeaderName, HeaderValue, CONTENT_TYPE, SET_COOKIE};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use sha2::{Digest, Sha256};
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinSet;
use tokio::time::Sleep;

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

/// The shared state of a running sample upstream: execution counters and the
/// record of every executed request. Create one with [`SampleUpstream::start`]
/// and inspect it through the returned [`SampleUpstreamHandle`].
#[derive(Debug)]
pub struct SampleUpstream {
    counters: Mutex<Counters>,
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
        let listener = TcpListener::bind(addr).await?;
        let addr = listener.local_addr()?;
        let (stopping, _) = watch::channel(false);
        let state = Arc::new(SampleUpstream {
            counters: Mutex::new(Counters::default()),
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

/// What the control headers of a request ask for.
#[derive(Debug, Default)]
struct Controls {
    delay: Option<Duration>,
    status: Option<StatusCode>,
    fail: Option<Fail>,
    body_size: Option<usize>,
    set_cookies: usize,
    slow_body: Option<Duration>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fail {
    Reset,
    Hang,
}

impl Controls {
    fn parse(headers: &HeaderMap) -> Result<Self, String> {
        let status = parse_number::<u16>(headers, STATUS_HEADER)?
            .map(|code| {
                StatusCode::from_u16(code)
                    .ok()
                    .filter(|s| !s.is_informational())
                    .ok_or_else(|| format!("{STATUS_HEADER}: {code} is not a final status code"))
            })
            .transpose()?;
        let fail = match header_str(headers, FAIL_HEADER)? {
            None => None,
            Some(v) if v.eq_ignore_ascii_case("reset") => Some(Fail::Reset),
            Some(v) if v.eq_ignore_ascii_case("hang") => Some(Fail::Hang),
            Some(v) => {
                return Err(format!(
                    "{FAIL_HEADER}: expected `reset` or `hang`, got {v:?}"
                ))
            }
        };
        let body_size = parse_number::<usize>(headers, BODY_SIZE_HEADER)?;
        if body_size.is_some_and(|n| n > MAX_BODY_SIZE) {
            return Err(format!("{BODY_SIZE_HEADER}: at most {MAX_BODY_SIZE}"));
        }
        let set_cookies = parse_number::<usize>(headers, SET_COOKIE_HEADER)?.unwrap_or(0);
        if set_cookies > MAX_SET_COOKIES {
            return Err(format!("{SET_COOKIE_HEADER}: at most {MAX_SET_COOKIES}"));
        }
        Ok(Controls {
            delay: parse_number::<u64>(headers, DELAY_HEADER)?.map(Duration::from_millis),
            status,
            fail,
            body_size,
            set_cookies,
            slow_body: parse_number::<u64>(headers, SLOW_BODY_HEADER)?.map(Duration::from_millis),
        })
    }
}

fn header_str<'h>(headers: &'h HeaderMap, name: &str) -> Result<Option<&'h str>, String> {
    headers
        .get(name)
        .map(|v| {
            v.to_str()
                .map(str::trim)
                .map_err(|_| format!("{name}: not visible ASCII"))
        })
        .transpose()
}

fn parse_number<T: std::str::FromStr>(
    headers: &HeaderMap,
    name: &str,
) -> Result<Option<T>, String> {
    header_str(headers, name)?
        .map(|v| {
            v.parse::<T>()
                .map_err(|_| format!("{name}: {v:?} is not a valid non-negative integer"))
        })
        .transpose()
}

fn lossy_header(headers: &HeaderMap, name: &str) -> Option<String> {
    headers
        .get(name)
        .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
}

async fn handle(
    state: Arc<SampleUpstream>,
    req: Request<Incoming>,
) -> Result<Response<SampleBody>, ServiceError> {
    if req.uri().path().starts_with(CONTROL_PREFIX) {
        return Ok(control(&state, &req));
    }
    let controls = match Controls::parse(req.headers()) {
        Ok(controls) => controls,
        Err(error) => {
            tracing::warn!(%error, "sample upstream: malformed control header; not executed");
            let body = serde_json::json!({ "error": error });
            return Ok(json_response(StatusCode::BAD_REQUEST, &body));
        }
    };

    let (parts, body) = req.into_parts();
    let body = body.collect().await?.to_bytes();
    let key = lossy_header(&parts.headers, IDEMPOTENCY_KEY_HEADER).unwrap_or_default();
    let attempt =
        lossy_header(&parts.headers, IDEMPOTENCY_ATTEMPT_HEADER).unwrap_or_else(|| "none".into());
    let method = parts.method.to_string();
    let path = parts
        .uri
        .path_and_query()
        .map_or_else(|| parts.uri.path().to_owned(), |pq| pq.as_str().to_owned());
    let headers = parts
        .headers
        .iter()
        .map(|(n, v)| (n.as_str().to_owned(), v.as_bytes().to_vec()))
        .collect();
    let (execution, key_executions) = state.record(RecordedRequest {
        method: method.clone(),
        path: path.clone(),
        key: key.clone(),
        headers,
        body: body.clone(),
        execution: 0,
        key_execution: 0,
    });
    tracing::info!(%method, %path, %key, execution, key_executions, "sample upstream executed a request");

    if let Some(delay) = controls.delay {
        tokio::time::sleep(delay).await;
    }
    match controls.fail {
        Some(Fail::Reset) => return Err(ServiceError::Reset),
        Some(Fail::Hang) => {
            let mut stopping = state.stopping.subscribe();
            let _ = stopping.wait_for(|s| *s).await;
            return Err(ServiceError::ShuttingDown);
        }
        None => {}
    }

    let (content_type, payload) = match controls.body_size {
        Some(n) => ("application/octet-stream", Bytes::from(body_pattern(n))),
        None => {
            let json = serde_json::json!({
                "execution": execution,
                "key_executions": key_executions,
                "key": key,
                "attempt": attempt,
                "method": method,
                "path": path,
                "body_sha256": hex::encode(Sha256::digest(&body)),
                "body_len": body.len(),
            });
            ("application/json", Bytes::from(json.to_string()))
        }
    };
    let body = match controls.slow_body {
        Some(interval) => SlowBody::new(payload, interval).boxed(),
        None => Full::new(payload).boxed(),
    };
    let mut response = Response::new(body);
    *response.status_mut() = controls.status.unwrap_or(StatusCode::CREATED);
    let headers = response.headers_mut();
    headers.insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
    headers.insert(
        HeaderName::from_static(EXECUTION_HEADER),
        HeaderValue::from(execution),
    );
    headers.insert(
        HeaderName::from_static(ECHO_ATTEMPT_HEADER),
        HeaderValue::from_bytes(attempt.as_bytes())
            .unwrap_or_else(|_| HeaderValue::from_static("invalid")),
    );
    for i in 1..=controls.set_cookies {
        if let Ok(cookie) = HeaderValue::try_from(format!("c{i}=v{i}")) {
            headers.append(SET_COOKIE, cookie);
        }
    }
    Ok(response)
}

/// Answers the `/__sample/` control endpoints; never counted.
fn control(state: &SampleUpstream, req: &Request<Incoming>) -> Response<SampleBody> {
    let endpoint = req.uri().path().trim_start_matches(CONTROL_PREFIX);
    if !matches!(endpoint, "health" | "executions" | "stats") {
        let body = serde_json::json!({ "error": "unknown control endpoint" });
        return json_response(StatusCode::NOT_FOUND, &body);
    }
    if req.method() != Method::GET {
        let body = serde_json::json!({ "error": "control endpoints only answer GET" });
        let mut response = json_response(StatusCode::METHOD_NOT_ALLOWED, &body);
        response
            .headers_mut()
            .insert(hyper::header::ALLOW, HeaderValue::from_static("GET"));
        return response;
    }
    match endpoint {
        "health" => {
            let mut response = Response::new(Full::new(Bytes::from_static(b"ok")).boxed());
            response
                .headers_mut()
                .insert(CONTENT_TYPE, HeaderValue::from_static("text/plain"));
            response
        }
        "executions" => {
            let key = req.uri().query().and_then(|q| query_param(q, "key"));
            match key {
                Some(key) => {
                    let executions = state.counters().per_key.get(&key).copied().unwrap_or(0);
                    let body = serde_json::json!({ "key": key, "executions": executions });
                    json_response(StatusCode::OK, &body)
                }
                None => {
                    let body = serde_json::json!({ "error": "missing query parameter `key`" });
                    json_response(StatusCode::BAD_REQUEST, &body)
                }
            }
        }
        _ => {
            let counters = state.counters();
            let keys: BTreeMap<&str, u64> = counters
                .per_key
                .iter()
                .map(|(k, n)| (k.as_str(), *n))
                .collect();
            let body = serde_json::json!({ "total": counters.total, "keys": keys });
            json_response(StatusCode::OK, &body)
        }
    }
}

fn json_response(status: StatusCode, body: &serde_json::Value) -> Response<SampleBody> {
    let mut response = Response::new(Full::new(Bytes::from(body.to_string())).boxed());
    *response.status_mut() = status;
    response
        .headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    response
}

/// The form-url-decoded value of the first `name` parameter of `query`.
fn query_param(query: &str, name: &str) -> Option<String> {
    query.split('&').find_map(|pair| {
        let (n, v) = pair.split_once('=').unwrap_or((pair, ""));
        (form_decode(n) == name).then(|| form_decode(v))
    })
}

/// Decodes `application/x-www-form-urlencoded` text (`+` is a space, `%XX`
/// an escaped byte; malformed escapes are kept as-is), lossily as UTF-8.
fn form_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'+' => out.push(b' '),
            b'%' => {
                let hex = bytes.get(i + 1..i + 3).and_then(|h| {
                    std::str::from_utf8(h)
                        .ok()
                        .and_then(|h| u8::from_str_radix(h, 16).ok())
                });
                match hex {
                    Some(byte) => {
                        out.push(byte);
                        i += 2;
                    }
                    None => out.push(b'%'),
                }
            }
            b => out.push(b),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// A response body sent in chunks with a pause between them.
struct SlowBody {
    remaining: Bytes,
    chunk: usize,
    interval: Duration,
    pause: Option<Pin<Box<Sleep>>>,
}

impl SlowBody {
    fn new(payload: Bytes, interval: Duration) -> Self {
        let chunk = SLOW_BODY_CHUNK.max(payload.len().div_ceil(SLOW_BODY_MAX_CHUNKS));
        SlowBody {
            remaining: payload,
            chunk,
            interval,
            pause: None,
        }
    }
}

impl Body for SlowBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        let this = &mut *self;
        if let Some(pause) = this.pause.as_mut() {
            ready!(pause.as_mut().poll(cx));
            this.pause = None;
        }
        if this.remaining.is_empty() {
            return Poll::Ready(None);
        }
        let n = this.chunk.min(this.remaining.len());
        let data = this.remaining.split_to(n);
        if !this.remaining.is_empty() {
            this.pause = Some(Box::pin(tokio::time::sleep(this.interval)));
        }
        Poll::Ready(Some(Ok(Frame::data(data))))
    }

    fn is_end_stream(&self) -> bool {
        self.remaining.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use hyper_util::client::legacy::connect::HttpConnector;
    use hyper_util::client::legacy::Client;
    use std::time::Instant;
    use tokio::sync::oneshot;

    type TestClient = Client<HttpConnector, Full<Bytes>>;

    async fn start() -> (SampleUpstreamHandle, oneshot::Sender<()>) {
        let (tx, rx) = oneshot::channel::<()>();
        let handle = SampleUpstream::start("127.0.0.1:0".parse().unwrap(), async move {
            let _ = rx.await;
        })
        .await
        .unwrap();
        (handle, tx)
    }

    fn client() -> TestClient {
        Client::builder(TokioExecutor::new()).build_http()
    }

    fn request(
        up: &SampleUpstreamHandle,
        method: Method,
        path: &str,
        headers: &[(&str, &str)],
        body: &'static [u8],
    ) -> Request<Full<Bytes>> {
        let mut builder = Request::builder()
            .method(method)
            .uri(format!("{}{}", up.url(), path));
        for (n, v) in headers {
            builder = builder.header(*n, *v);
        }
        builder.body(Full::new(Bytes::from_static(body))).unwrap()
    }

    async fn send(
        client: &TestClient,
        req: Request<Full<Bytes>>,
    ) -> (StatusCode, HeaderMap, Bytes) {
        let response = client.request(req).await.unwrap();
        let (parts, body) = response.into_parts();
        (
            parts.status,
            parts.headers,
            body.collect().await.unwrap().to_bytes(),
        )
    }

    fn json(body: &Bytes) -> serde_json::Value {
        serde_json::from_slice(body).unwrap()
    }

    #[tokio::test]
    async fn counts_executions_per_key_and_describes_them() {
        let (up, _tx) = start().await;
        let c = client();
        let post = |key: Option<&'static str>, body: &'static [u8]| {
            let mut headers = vec![("idempotency-attempt", "1")];
            if let Some(key) = key {
                headers.push(("Idempotency-Key", key));
            }
            request(&up, Method::POST, "/orders?x=1", &headers, body)
        };

        let (status, headers, body) = send(&c, post(Some("a"), b"hello")).await;
        assert_eq!(status, StatusCode::CREATED);
        assert_eq!(headers[CONTENT_TYPE], "application/json");
        assert_eq!(headers[EXECUTION_HEADER], "1");
        assert_eq!(headers[ECHO_ATTEMPT_HEADER], "1");
        let first = json(&body);
        assert_eq!(
            first,
            serde_json::json!({
                "execution": 1, "key_executions": 1, "key": "a", "attempt": "1",
                "method": "POST", "path": "/orders?x=1",
                "body_sha256": hex::encode(Sha256::digest(b"hello")), "body_len": 5,
            })
        );

        let (_, headers, body) = send(&c, post(Some("a"), b"hello")).await;
        assert_eq!(headers[EXECUTION_HEADER], "2");
        let second = json(&body);
        assert_eq!(second["execution"], 2);
        assert_eq!(second["key_executions"], 2);
        assert_ne!(first, second, "a re-execution must be distinguishable");

        send(&c, post(Some("b"), b"")).await;
        let (_, headers, body) = send(&c, request(&up, Method::PUT, "/x", &[], b"no key")).await;
        assert_eq!(headers[ECHO_ATTEMPT_HEADER], "none");
        assert_eq!(json(&body)["key"], "");

        assert_eq!(up.executions("a"), 2);
        assert_eq!(up.executions("b"), 1);
        assert_eq!(up.executions(""), 1);
        assert_eq!(up.executions("missing"), 0);
        assert_eq!(up.total_requests(), 4);

        let recorded = up.requests();
        assert_eq!(recorded.len(), 4);
        assert_eq!(
            recorded.iter().map(|r| r.execution).collect::<Vec<_>>(),
            [1, 2, 3, 4]
        );
        assert_eq!(recorded[1].key_execution, 2);
        assert_eq!(recorded[0].method, "POST");
        assert_eq!(recorded[0].path, "/orders?x=1");
        assert_eq!(recorded[0].body, Bytes::from_static(b"hello"));
        assert_eq!(recorded[0].header("Idempotency-Key"), Some(&b"a"[..]));
        assert_eq!(recorded[3].method, "PUT");
        assert_eq!(recorded[3].key, "");
        assert_eq!(recorded[3].header("idempotency-key"), None);
    }

    #[tokio::test]
    async fn delay_counts_before_answering() {
        let (up, _tx) = start().await;
        let c = client();
        let req = request(
            &up,
            Method::POST,
            "/slow",
            &[("idempotency-key", "slow"), (DELAY_HEADER, "400")],
            b"",
        );
        let started = Instant::now();
        let in_flight = tokio::spawn(async move { send(&c, req).await });
        tokio::time::sleep(Duration::from_millis(150)).await;
        assert!(!in_flight.is_finished(), "answered before the delay");
        assert_eq!(
            up.executions("slow"),
            1,
            "execution counted before the answer"
        );
        let (status, _, _) = in_flight.await.unwrap();
        assert_eq!(status, StatusCode::CREATED);
        assert!(started.elapsed() >= Duration::from_millis(400));
    }

    #[tokio::test]
    async fn status_override_still_executes() {
        let (up, _tx) = start().await;
        let c = client();
        let req = request(
            &up,
            Method::POST,
            "/",
            &[("idempotency-key", "k"), (STATUS_HEADER, "503")],
            b"",
        );
        let (status, headers, body) = send(&c, req).await;
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(headers[EXECUTION_HEADER], "1");
        assert_eq!(json(&body)["execution"], 1);
        assert_eq!(up.executions("k"), 1);
    }

    #[tokio::test]
    async fn set_cookie_lines_are_separate() {
        let (up, _tx) = start().await;
        let c = client();
        let req = request(&up, Method::POST, "/", &[(SET_COOKIE_HEADER, "3")], b"");
        let (_, headers, _) = send(&c, req).await;
        let cookies: Vec<_> = headers.get_all(SET_COOKIE).iter().collect();
        assert_eq!(cookies, ["c1=v1", "c2=v2", "c3=v3"]);
    }

    #[tokio::test]
    async fn body_size_is_deterministic() {
        let (up, _tx) = start().await;
        let c = client();
        let mk = || request(&up, Method::POST, "/", &[(BODY_SIZE_HEADER, "1000")], b"");
        let (_, headers, first) = send(&c, mk()).await;
        let (_, headers2, second) = send(&c, mk()).await;
        assert_eq!(first.len(), 1000);
        assert_eq!(headers[CONTENT_TYPE], "application/octet-stream");
        assert_eq!(first, body_pattern(1000));
        assert_eq!(&first[..5], b"abcde");
        assert_eq!(first, second);
        assert_ne!(headers[EXECUTION_HEADER], headers2[EXECUTION_HEADER]);
    }

    #[tokio::test]
    async fn slow_body_arrives_in_chunks() {
        let (up, _tx) = start().await;
        let c = client();
        let req = request(
            &up,
            Method::POST,
            "/",
            &[(BODY_SIZE_HEADER, "200"), (SLOW_BODY_HEADER, "60")],
            b"",
        );
        let started = Instant::now();
        let response = c.request(req).await.unwrap();
        let mut body = response.into_body();
        let mut frames = 0;
        let mut received = Vec::new();
        while let Some(frame) = body.frame().await {
            if let Ok(data) = frame.unwrap().into_data() {
                frames += 1;
                received.extend_from_slice(&data);
            }
        }
        assert_eq!(received, body_pattern(200));
        assert_eq!(frames, 4, "200 bytes in 64-byte chunks");
        assert!(started.elapsed() >= Duration::from_millis(180));
    }

    #[tokio::test]
    async fn reset_counts_and_client_sees_an_error() {
        let (up, _tx) = start().await;
        let c = client();
        let req = request(
            &up,
            Method::POST,
            "/",
            &[("idempotency-key", "boom"), (FAIL_HEADER, "reset")],
            b"payload",
        );
        let result = c.request(req).await;
        assert!(
            result.is_err(),
            "expected a connection error, got {result:?}"
        );
        assert_eq!(up.executions("boom"), 1);
        // The server keeps serving afterwards.
        let (status, _, body) =
            send(&c, request(&up, Method::GET, "/__sample/health", &[], b"")).await;
        assert_eq!(status, StatusCode::OK);
        assert_eq!(body, "ok");
    }

    #[tokio::test]
    async fn hang_never_answers_and_shutdown_releases_it() {
        let (up, tx) = start().await;
        let c = client();
        let req = request(
            &up,
            Method::POST,
            "/",
            &[("idempotency-key", "hang"), (FAIL_HEADER, "hang")],
            b"",
        );
        let in_flight = tokio::spawn(async move { c.request(req).await });
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert!(!in_flight.is_finished(), "a hanging request was answered");
        assert_eq!(up.executions("hang"), 1);

        tx.send(()).unwrap();
        tokio::time::timeout(Duration::from_secs(1), up.stopped())
            .await
            .expect("shutdown must not wait for a hanging request");
        assert!(up.is_stopped());
        let result = tokio::time::timeout(Duration::from_secs(1), in_flight)
            .await
            .unwrap()
            .unwrap();
        assert!(result.is_err(), "hang must end without an answer");
        assert!(tokio::net::TcpStream::connect(up.addr()).await.is_err());
    }

    #[tokio::test]
    async fn control_endpoints_report_and_are_not_counted() {
        let (up, _tx) = start().await;
        let c = client();
        for key in ["a b", "a b", "x"] {
            let req = request(&up, Method::POST, "/", &[("idempotency-key", key)], b"");
            send(&c, req).await;
        }
        send(&c, request(&up, Method::POST, "/", &[], b"")).await;

        let get = |path: &str| request(&up, Method::GET, path, &[], b"");
        let (status, _, body) = send(&c, get("/__sample/stats")).await;
        assert_eq!(status, StatusCode::OK);
        assert_eq!(
            json(&body),
            serde_json::json!({ "total": 4, "keys": { "a b": 2, "x": 1, "": 1 } })
        );
        let (_, _, body) = send(&c, get("/__sample/executions?key=a%20b")).await;
        assert_eq!(
            json(&body),
            serde_json::json!({ "key": "a b", "executions": 2 })
        );
        let (_, _, body) = send(&c, get("/__sample/executions?other=1&key=a+b")).await;
        assert_eq!(json(&body)["executions"], 2);
        let (_, _, body) = send(&c, get("/__sample/executions?key=nope")).await;
        assert_eq!(json(&body)["executions"], 0);
        let (_, _, body) = send(&c, get("/__sample/executions?key=")).await;
        assert_eq!(json(&body)["executions"], 1);
        let (status, _, _) = send(&c, get("/__sample/executions")).await;
        assert_eq!(status, StatusCode::BAD_REQUEST);
        let (status, _, _) = send(&c, get("/__sample/nope")).await;
        assert_eq!(status, StatusCode::NOT_FOUND);
        let (status, _, _) =
            send(&c, request(&up, Method::POST, "/__sample/stats", &[], b"")).await;
        assert_eq!(status, StatusCode::METHOD_NOT_ALLOWED);

        assert_eq!(up.total_requests(), 4, "control endpoints must not count");
        assert_eq!(up.requests().len(), 4);
    }

    #[tokio::test]
    async fn malformed_control_header_is_rejected_without_executing() {
        let (up, _tx) = start().await;
        let c = client();
        for (name, value) in [
            (STATUS_HEADER, "abc"),
            (STATUS_HEADER, "101"),
            (FAIL_HEADER, "explode"),
            (DELAY_HEADER, "-1"),
        ] {
            let req = request(
                &up,
                Method::POST,
                "/",
                &[("idempotency-key", "k"), (name, value)],
                b"",
            );
            let (status, _, body) = send(&c, req).await;
            assert_eq!(status, StatusCode::BAD_REQUEST, "{name}: {value}");
            assert!(json(&body)["error"].as_str().unwrap().contains(name));
        }
        assert_eq!(up.executions("k"), 0);
        assert_eq!(up.total_requests(), 0);
    }

    #[tokio::test]
    async fn serves_h2c_prior_knowledge() {
        let (up, _tx) = start().await;
        let c: TestClient = Client::builder(TokioExecutor::new())
            .http2_only(true)
            .build_http();
        let req = request(&up, Method::POST, "/", &[("idempotency-key", "h2")], b"x");
        let response = c.request(req).await.unwrap();
        assert_eq!(response.version(), hyper::Version::HTTP_2);
        assert_eq!(response.status(), StatusCode::CREATED);
        assert_eq!(up.executions("h2"), 1);

        let req = request(&up, Method::POST, "/", &[(FAIL_HEADER, "reset")], b"");
        assert!(c.request(req).await.is_err());
        assert_eq!(up.executions(""), 1);
    }

    #[test]
    fn form_decoding() {
        assert_eq!(form_decode("a%20b+c%2Bd"), "a b c+d");
        assert_eq!(form_decode("100%"), "100%");
        assert_eq!(form_decode("%zz"), "%zz");
        assert_eq!(query_param("a=1&key=k%3D1", "key").as_deref(), Some("k=1"));
        assert_eq!(query_param("a=1", "key"), None);
    }
}
