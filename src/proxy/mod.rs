//! The request path, as named phases.
//!
//! ```text
//! admit    request ─ route? ─ no ──────────────────────────────── pass through (forward)
//!                      │ yes, keyed method
//!                    key header? ─ absent: optional → pass through, required → 400
//!                      │ valid key, tenant
//!                    body (≤ max_request_body, else 413) → cache entry? → fingerprint
//!                      │                  (known if the bytes are the entry's)
//! (cached)           the entry's fingerprint matches → replay from memory
//!                      │ no entry, or another fingerprint
//! (held here)        this process holds the key in flight, lease running → 409 │ 422
//!                      │ not held here
//! keyed              store.claim ── existing → decide: replay │ 409 │ 422 │ take over
//!                      │ claimed / taken over
//! execute            forward once, renewing the lease ── settle: complete │ release │ keep
//! ```
//!
//! Each phase is a module, and [`Proxy::handle`] reads as their sequence:
//!
//! * `admit` turns a request into a `Keyed` one (key, tenant, buffered
//!   body, fingerprint), a pass-through, or a refusal. It touches neither
//!   the store nor the upstream, so a refused request costs nothing and
//!   leaves nothing behind. It looks the key up in the response cache
//!   before fingerprinting: a retry whose method, path, query, content
//!   type and body are byte for byte those of the request that filled
//!   the entry has the entry's fingerprint, and is not canonicalised and
//!   hashed again.
//! * A duplicate of a key this process holds in flight, under a lease it
//!   knows runs on (the renewer's), is answered `409` (or `422`) without
//!   the database, which could only say the same (`lease`'s notes).
//! * `keyed` is the state machine's I/O: claim, decide (the pure
//!   [`decide`](crate::idempotency::decide)), and answer, wait or take over.
//! * `execute` forwards an owned claim once and acts on what the pure
//!   [`settle`](crate::idempotency::settle) makes of the exchange:
//!   complete, release or keep the claim.
//! * `forward` builds the upstream request and streams what needs no
//!   storing; it knows nothing of keys.
//!
//! Everything the proxy answers itself goes through [`problem`].

pub mod access;
pub mod headers;
pub mod problem;
pub mod upstream;

mod admit;
mod execute;
mod forward;
mod keyed;
mod path;

use std::borrow::Cow;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::{Instant, SystemTime};

use bytes::Bytes;
use http::header::{HeaderName, HeaderValue};
use http::uri::PathAndQuery;
use http::{Request, Response, Uri};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;

use crate::cache::ResponseCache;
use crate::config::{Config, Route};
use crate::lease::Renewer;
use crate::lifecycle::Lifecycle;
use crate::metrics::{Metrics, Outcome, RouteMetrics};
use crate::store::Store;
use crate::waiters::Waiters;
use access::{AccessLine, Counted, Logged, RequestBytes, RequestIds, REQUEST_ID};
use admit::{Admission, Keyed};
use problem::{Problem, ProblemKind};
use upstream::Upstream;

/// Errors carried by proxied bodies.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;
/// Every body the proxy sends or forwards.
pub type ProxyBody = http_body_util::combinators::BoxBody<Bytes, BoxError>;

/// A complete, in-memory body.
pub fn full(bytes: Bytes) -> ProxyBody {
    Full::new(bytes).map_err(|never| match never {}).boxed()
}

/// Header added to replayed responses.
pub const REPLAYED: HeaderName = HeaderName::from_static("idempotent-replayed");
/// Header telling the client until when its key is remembered (HTTP-date).
pub const EXPIRES: HeaderName = HeaderName::from_static("idempotency-key-expires");
/// Header carrying the attempt number on keyed forwards.
pub const ATTEMPT: HeaderName = HeaderName::from_static("idempotency-attempt");

/// Advertises until when the key is remembered.
fn set_expires(resp: &mut Response<ProxyBody>, at: SystemTime) {
    if let Some(v) = expires_header(at) {
        resp.headers_mut().insert(EXPIRES, v);
    }
}

/// The `Idempotency-Key-Expires` value for a record expiring `at` (an HTTP
/// date).
fn expires_header(at: SystemTime) -> Option<HeaderValue> {
    HeaderValue::from_str(&httpdate::fmt_http_date(at)).ok()
}

/// Who sent a request, and over what (one per connection).
#[derive(Debug, Clone)]
pub struct ClientInfo {
    /// The peer address.
    pub addr: SocketAddr,
    /// `http` or `https`, for `X-Forwarded-Proto`.
    pub proto: &'static str,
    /// The peer's `X-Forwarded-For` entry, formatted once.
    forwarded_for: HeaderValue,
}

impl ClientInfo {
    /// The peer `addr`, over `proto` (`http` or `https`).
    pub fn new(addr: SocketAddr, proto: &'static str) -> Self {
        ClientInfo {
            addr,
            proto,
            forwarded_for: headers::forwarded_for(addr.ip()),
        }
    }
}

/// Where a request goes, decided once from its path: the path's normal
/// form when it differs from what was sent, and the index of the route
/// covering it; or why the path is refused.
pub struct Routing(Result<(Option<String>, Option<usize>), Problem>);

/// How a request was handled, for the access log and metrics.
struct Handled {
    /// What the client gets.
    response: Response<ProxyBody>,
    /// The metrics' outcome label.
    outcome: Outcome,
    /// The attempt number, when this request owned a claim.
    attempt: Option<i32>,
}

impl Handled {
    fn new(response: Response<ProxyBody>, outcome: Outcome) -> Self {
        Handled {
            response,
            outcome,
            attempt: None,
        }
    }
    fn problem(p: Problem, outcome: Outcome) -> Self {
        Handled::new(p.into_response(), outcome)
    }
}

/// The route label of requests no route covers.
const UNROUTED: &str = "unrouted";

/// The proxy service, shared by every connection.
pub struct Proxy {
    /// Routes, limits and the store's failure policy.
    config: Arc<Config>,
    /// The idempotency records.
    store: Store,
    /// The legacy API.
    upstream: Upstream,
    /// Request outcomes and latencies.
    metrics: Arc<Metrics>,
    /// Duplicates waiting for their original (`wait`).
    waiters: Arc<Waiters>,
    /// Keeps owned claims' leases alive while their calls run.
    renewer: Arc<Renewer>,
    /// Completions this replica has replayed, to replay without a round trip.
    cache: Arc<ResponseCache>,
    /// Owner of background work (completion retries) and of the drain.
    lifecycle: Lifecycle,
    /// Mints `X-Request-Id` for requests that come without a usable one.
    request_ids: RequestIds,
    /// Every route's derived-key header, removed from what clients send.
    derived_key_headers: Vec<HeaderName>,
    /// Each route's series, by index in `config.routes`: counting a
    /// request looks nothing up.
    route_metrics: Vec<RouteMetrics>,
    /// The series of requests no route covers.
    unrouted_metrics: RouteMetrics,
}

impl Proxy {
    /// Wires the proxy.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        config: Arc<Config>,
        store: Store,
        upstream: Upstream,
        metrics: Arc<Metrics>,
        waiters: Arc<Waiters>,
        renewer: Arc<Renewer>,
        cache: Arc<ResponseCache>,
        lifecycle: Lifecycle,
    ) -> Self {
        let longest_wait = config
            .routes
            .iter()
            .map(|r| r.policy.wait)
            .max()
            .unwrap_or_default();
        metrics.configure_durations(config.upstream.timeout, longest_wait);
        let (sampled_cache, sampled_waiters) = (cache.clone(), waiters.clone());
        metrics.set_sampler(Box::new(move |m| {
            m.cache(sampled_cache.sample());
            m.waiters(sampled_waiters.waiting());
        }));
        let mut derived_key_headers: Vec<HeaderName> = config
            .routes
            .iter()
            .filter_map(|r| r.policy.derived_key_header.clone())
            .collect();
        derived_key_headers.sort_by(|a, b| a.as_str().cmp(b.as_str()));
        derived_key_headers.dedup();
        let route_metrics = config
            .routes
            .iter()
            .map(|r| metrics.route_metrics(&r.name))
            .collect();
        Proxy {
            derived_key_headers,
            route_metrics,
            unrouted_metrics: metrics.route_metrics(UNROUTED),
            request_ids: RequestIds::new(),
            cache,
            config,
            store,
            upstream,
            metrics,
            waiters,
            renewer,
            lifecycle,
        }
    }

    /// The configuration it was built with.
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// The lifecycle whose work this proxy's owned requests are.
    pub fn lifecycle(&self) -> &Lifecycle {
        &self.lifecycle
    }

    /// Where a request goes (see [`Routing`]). Cheap for a path already
    /// in normal form: no allocation.
    pub fn routing<B>(&self, req: &Request<B>) -> Routing {
        Routing(self.resolve(req.uri().path()).map(|(normal, route)| {
            let normal = match normal {
                Cow::Borrowed(_) => None,
                Cow::Owned(n) => Some(n),
            };
            let index =
                route.and_then(|r| self.config.routes.iter().position(|c| std::ptr::eq(c, r)));
            (normal, index)
        }))
    }

    /// The normal form of a path (see `path`) and the route it matches,
    /// or why the path is refused.
    fn resolve<'p>(&self, raw: &'p str) -> Result<(Cow<'p, str>, Option<&Route>), Problem> {
        let refuse = |a: path::Ambiguous| Problem::new(ProblemKind::AmbiguousPath, a.detail());
        let normal = path::normalise(raw).map_err(refuse)?;
        let route = self.config.route_for(&normal);
        if let Some(slashed) = path::with_slashes_decoded(&normal) {
            // Refused only when a server that decodes `%2F` would route it
            // elsewhere: identifiers may hold an encoded slash.
            let other = slashed.map_err(refuse)?;
            let same = match (route, self.config.route_for(&other)) {
                (None, None) => true,
                (Some(a), Some(b)) => std::ptr::eq(a, b),
                _ => false,
            };
            if !same {
                return Err(refuse(path::Ambiguous::EncodedSlash));
            }
        }
        Ok((normal, route))
    }

    /// Handles one request: admit, then pass through or run the keyed
    /// path, then account for it once (metrics now, the access line when
    /// the response body is done). `routing` is [`Proxy::routing`] of it.
    pub async fn handle(
        self: Arc<Self>,
        mut req: Request<Incoming>,
        client: ClientInfo,
        routing: Routing,
    ) -> Response<ProxyBody> {
        let started = Instant::now();
        let logged = access::enabled();
        let request_id = self.request_ids.assign(req.headers_mut());
        let mut line = AccessLine {
            method: req.method().clone(),
            path: String::new(),
            route: String::new(),
            key: None,
            attempt: None,
            outcome: Outcome::Rejected,
            status: 0,
            request_id,
            client: client.addr,
            user_agent: if logged {
                AccessLine::user_agent(req.headers())
            } else {
                None
            },
            request_bytes: RequestBytes::Known(0),
            started,
            timings: None,
        };
        let (normal, matched) = match routing.0 {
            Ok(routed) => routed,
            Err(p) => {
                if logged {
                    line.path = req.uri().path().to_owned();
                }
                return self.respond(p.into_response(), Outcome::Rejected, None, line);
            }
        };
        if let Some(normal) = &normal {
            // What the route matched is what is fingerprinted and
            // forwarded.
            match with_path(req.uri(), normal) {
                Ok(uri) => *req.uri_mut() = uri,
                Err(p) => {
                    if logged {
                        line.path = req.uri().path().to_owned();
                    }
                    return self.respond(p.into_response(), Outcome::Rejected, None, line);
                }
            }
        }
        let matched = matched.map(|i| (i, &self.config.routes[i]));
        // Labelled by the route that covers the path, keyed method or not.
        let route_label = matched.map_or(UNROUTED, |(_, r)| r.name.as_str());
        if logged {
            line.path = normal.unwrap_or_else(|| req.uri().path().to_owned());
            line.route = route_label.to_owned();
        }
        let handled = match self.admit(matched, req, &client).await {
            Admission::PassThrough(req) if logged => {
                let read = Arc::new(AtomicU64::new(0));
                line.request_bytes = RequestBytes::Counted(read.clone());
                let req = req.map(|b| Counted::new(b, read).boxed());
                self.pass_through(req, &client).await
            }
            Admission::PassThrough(req) => {
                let req = req.map(|b| b.map_err(BoxError::from).boxed());
                self.pass_through(req, &client).await
            }
            Admission::Refused(h) => h,
            Admission::Keyed(mut k) => {
                line.key = Some(k.record.key.as_str().to_owned());
                line.request_bytes = RequestBytes::Known(k.body.len() as u64);
                // A replay this replica holds, or a duplicate of a key it
                // holds in flight, owns nothing: answered here, in the
                // connection's task.
                match self.cached_replay(&mut k).or_else(|| self.held_here(&k)) {
                    Some(h) => {
                        line.timings = Some(k.timings.millis());
                        h
                    }
                    None => return self.detached(k, line).await,
                }
            }
        };
        line.attempt = handled.attempt;
        self.respond(
            handled.response,
            handled.outcome,
            matched.map(|(i, _)| i),
            line,
        )
    }

    /// Runs the keyed path, which may own a claim, and accounts for it,
    /// as work of the lifecycle in a task of its own, not inside the
    /// connection's future: when a client gives up and closes the
    /// connection, hyper drops that future and everything polled by it,
    /// and an owned claim must outlive its client (see `lifecycle`), as
    /// must its metrics and its access line. The drain waits for these
    /// tasks.
    ///
    /// Not `async`: the task is spawned when this is called (`handle`
    /// awaits it at once), and the future `handle` keeps is only the wait
    /// for its answer.
    fn detached(
        self: &Arc<Self>,
        k: Keyed<'_>,
        mut line: AccessLine,
    ) -> impl Future<Output = Response<ProxyBody>> + Send + 'static {
        let Keyed {
            route: _,
            route_index,
            record,
            fingerprint,
            parts,
            body,
            client,
            timings,
            cached: _,
        } = k;
        let this = Arc::clone(self);
        let work = async move {
            let route = &this.config.routes[route_index];
            let k = Keyed {
                route,
                route_index,
                record,
                fingerprint,
                parts,
                body,
                client,
                timings,
                cached: None,
            };
            let handled = this.keyed(&k).await;
            line.timings = Some(k.timings.millis());
            line.attempt = handled.attempt;
            this.respond(handled.response, handled.outcome, Some(route_index), line)
        };
        // Boxed: spawning moves a future into the task's cell, and this
        // one (the whole keyed path) is large; a box moves as a pointer.
        let task = self.lifecycle.spawn_work(Box::pin(work));
        async move {
            match task.await {
                Ok(response) => response,
                Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
                // Cancelled: only when the runtime itself shuts down, and
                // with it this connection; the answer is never sent.
                Err(_) => {
                    let mut response = Response::new(full(Bytes::new()));
                    *response.status_mut() = http::StatusCode::SERVICE_UNAVAILABLE;
                    response
                }
            }
        }
    }

    /// Counts the request on `route` (an index in `config.routes`; `None`:
    /// none covers it), stamps its id on the response, and leaves the
    /// access line to the body.
    fn respond(
        &self,
        mut response: Response<ProxyBody>,
        outcome: Outcome,
        route: Option<usize>,
        mut line: AccessLine,
    ) -> Response<ProxyBody> {
        let status = response.status().as_u16();
        let route = route.map_or(&self.unrouted_metrics, |i| &self.route_metrics[i]);
        self.metrics
            .request_on(route, outcome, status, line.started.elapsed());
        // Ours, whatever the upstream or a stored response said.
        response
            .headers_mut()
            .insert(REQUEST_ID, line.request_id.clone());
        if !access::enabled() {
            // Nobody reads the line: no counting body around the answer.
            return response;
        }
        if line.route.is_empty() {
            line.route = route.name().to_owned();
        }
        line.outcome = outcome;
        line.status = status;
        response.map(|body| Logged::new(body, line).boxed())
    }
}

/// `uri` with its path replaced by `path` (query, scheme and authority
/// kept).
fn with_path(uri: &Uri, path: &str) -> Result<Uri, Problem> {
    let pq = match uri.query() {
        Some(q) => format!("{path}?{q}"),
        None => path.to_owned(),
    };
    let mut parts = uri.clone().into_parts();
    parts.path_and_query = Some(PathAndQuery::try_from(pq).map_err(|e| {
        Problem::new(
            ProblemKind::InvalidRequest,
            format!("the request path cannot be forwarded: {e}"),
        )
    })?);
    Uri::from_parts(parts).map_err(|e| {
        Problem::new(
            ProblemKind::InvalidRequest,
            format!("the request path cannot be forwarded: {e}"),
        )
    })
}
