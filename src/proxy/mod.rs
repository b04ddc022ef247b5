//! The request path.
//!
//! ```text
//! request ─ route? ─ no ─────────────────────────────────────── pass through
//!             │ yes, keyed method
//!           key header? ─ absent: optional → pass through, required → 400
//!             │ valid key, tenant
//!           body (≤ max_request_body, else 413) → fingerprint
//!             │
//!           store.claim ── existing → decide: replay │ 409 │ 422 │ take over
//!             │ claimed / taken over
//!           forward once, renewing the lease ── settle: complete │ release │ keep
//! ```
//!
//! Everything the proxy answers itself goes through [`problem`].

pub mod headers;
pub mod problem;
pub mod upstream;

use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant, SystemTime};

use bytes::{Bytes, BytesMut};
use http::header::{HeaderName, HeaderValue, CONTENT_LENGTH, CONTENT_TYPE, EXPECT, HOST};
use http::{request, response, Request, Response, StatusCode};
use http_body::{Body, Frame, SizeHint};
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use tracing::{info, warn};

use crate::backoff::Backoff;
use crate::cache::{Cached, ResponseCache};
use crate::config::{Config, DerivedKey, KeyRequirement, OnStoreError, Route};
use crate::idempotency::decision::retry_after_secs;
use crate::idempotency::{
    decide, settle, Decision, Fingerprint, IdempotencyKey, KeyError, KeyId, Settlement,
    TenantError, TenantId, UpstreamOutcome,
};
use crate::lease::{Renewal, Renewer};
use crate::lifecycle::Lifecycle;
use crate::metrics::{Metrics, Outcome};
use crate::store::{Claim, ClaimResult, Replace, Store, StoreError, StoredResponse};
use crate::waiters::{WaitGuard, Waiters};
use problem::{Problem, ProblemKind};
use upstream::{Upstream, UpstreamError};

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

/// Who sent a request, and over what.
#[derive(Debug, Clone, Copy)]
pub struct ClientInfo {
    /// The peer address.
    pub addr: SocketAddr,
    /// `http` or `https`, for `X-Forwarded-Proto`.
    pub proto: &'static str,
}

/// How a request was handled, for the access log and metrics.
struct Handled {
    response: Response<ProxyBody>,
    outcome: Outcome,
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

/// A keyed request, admitted and fingerprinted.
struct Keyed<'a> {
    route: &'a Route,
    key: IdempotencyKey,
    tenant: TenantId,
    fingerprint: Fingerprint,
    parts: request::Parts,
    body: Bytes,
    client: ClientInfo,
    timings: Timings,
}

/// Where a keyed request spent its time, for the access log.
#[derive(Default)]
struct Timings {
    store_us: AtomicU64,
    upstream_us: AtomicU64,
}

impl Keyed<'_> {
    /// Whether completions and releases of this key notify waiters.
    fn notifies(&self) -> bool {
        !self.route.policy.wait.is_zero()
    }

    /// The key's id on the notification channel.
    fn wait_id(&self) -> String {
        KeyId::new(&self.tenant, &self.key).to_string()
    }

    /// The key forwarded in `derived_key_header`.
    fn derived_key(&self) -> Option<(HeaderName, HeaderValue)> {
        let header = self.route.policy.derived_key_header.clone()?;
        let value = match self.route.policy.derived_key {
            DerivedKey::Sha256 => KeyId::new(&self.tenant, &self.key).hex(),
            DerivedKey::TenantKey => format!("{}:{}", self.tenant.as_str(), self.key),
        };
        Some((header, HeaderValue::from_str(&value).ok()?))
    }
}

/// What the upstream exchange of an owned claim produced.
enum Exchanged {
    /// A `release_on` status: passed on, not stored.
    Release(Response<Incoming>),
    /// A response whose body fits `max_stored_response`.
    Whole(response::Parts, Bytes),
    /// A response whose body does not: the prefix read so far and the rest.
    TooLarge(response::Parts, Bytes, Incoming),
}

/// The proxy service, shared by every connection.
pub struct Proxy {
    config: Arc<Config>,
    store: Store,
    upstream: Upstream,
    metrics: Arc<Metrics>,
    waiters: Arc<Waiters>,
    renewer: Arc<Renewer>,
    cache: Arc<ResponseCache>,
    lifecycle: Lifecycle,
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
        Proxy {
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

    /// The lifecycle whose work this proxy's owned requests are.
    pub fn lifecycle(&self) -> &Lifecycle {
        &self.lifecycle
    }

    /// Whether a request may end up owning a claim: a keyed method on a
    /// route, carrying the key header. Cheap: headers only.
    pub fn may_claim<B>(&self, req: &Request<B>) -> bool {
        self.config.route_for(req.uri().path()).is_some_and(|r| {
            r.policy.methods.contains(req.method())
                && req.headers().contains_key(&r.policy.key_header)
        })
    }

    /// Handles one request.
    pub async fn handle(&self, req: Request<Incoming>, client: ClientInfo) -> Response<ProxyBody> {
        let started = Instant::now();
        let method = req.method().clone();
        let path = req.uri().path().to_owned();
        let matched = self.config.route_for(&path);
        // Labelled by the route that covers the path, keyed method or not.
        let route_label = matched.map_or("unrouted", |r| r.name.as_str());
        let route = matched.filter(|r| r.policy.methods.contains(req.method()));
        let mut key_for_log = None;
        let mut timings = (None, None);
        let handled = match route {
            None => self.pass_through(req, client).await,
            Some(route) => match self.admit(route, req, client).await {
                Admission::PassThrough(req) => self.pass_through(req, client).await,
                Admission::Refused(h) => h,
                Admission::Keyed(k) => {
                    key_for_log = Some(k.key.clone());
                    let h = self.keyed(&k).await;
                    let us = |a: &AtomicU64| a.load(Ordering::Relaxed) as f64 / 1000.0;
                    timings = (
                        Some(us(&k.timings.store_us)),
                        Some(us(&k.timings.upstream_us)),
                    );
                    h
                }
            },
        };
        self.metrics.request(route_label, handled.outcome);
        let status = handled.response.status().as_u16();
        info!(
            target: "idemproxy::access",
            %method,
            path = %path,
            route = route_label,
            key = key_for_log.as_ref().map(|k| k.as_str()),
            attempt = handled.attempt,
            outcome = handled.outcome.as_str(),
            status,
            duration_ms = started.elapsed().as_secs_f64() * 1000.0,
            store_ms = timings.0,
            upstream_ms = timings.1,
            "request"
        );
        handled.response
    }

    /// Validates key and tenant, then reads and fingerprints the body.
    async fn admit<'a>(
        &self,
        route: &'a Route,
        req: Request<Incoming>,
        client: ClientInfo,
    ) -> Admission<'a> {
        let policy = &route.policy;
        let refuse = |kind, detail: String| {
            Admission::Refused(Handled::problem(
                Problem::new(kind, detail),
                Outcome::Rejected,
            ))
        };
        let key = {
            let values: Vec<&HeaderValue> =
                req.headers().get_all(&policy.key_header).iter().collect();
            match values.as_slice() {
                [] => match policy.key {
                    KeyRequirement::Optional => return Admission::PassThrough(req),
                    KeyRequirement::Required => {
                        return refuse(
                            ProblemKind::MissingKey,
                            format!("this route requires the {} header", policy.key_header),
                        )
                    }
                },
                [v] => match IdempotencyKey::parse(v.as_bytes(), policy.max_key_length) {
                    Ok(k) => k,
                    Err(e) => return refuse(ProblemKind::InvalidKey, e.to_string()),
                },
                _ => return refuse(ProblemKind::InvalidKey, KeyError::Repeated.to_string()),
            }
        };
        let tenant = match &route.tenant_header {
            None => TenantId::none(),
            Some(h) => {
                let values: Vec<&[u8]> = req
                    .headers()
                    .get_all(h)
                    .iter()
                    .map(|v| v.as_bytes())
                    .collect();
                match TenantId::from_header(
                    h.as_str(),
                    &values,
                    route.tenant_required,
                    route.tenant_hash,
                ) {
                    Ok(t) => t,
                    Err(e @ TenantError::Missing { .. }) => {
                        return refuse(ProblemKind::MissingTenant, e.to_string())
                    }
                    Err(e) => return refuse(ProblemKind::InvalidTenant, e.to_string()),
                }
            }
        };
        let limit = self.config.server.max_request_body;
        let too_large = || {
            refuse(
                ProblemKind::RequestTooLarge,
                format!("keyed request bodies are limited to {limit} bytes; nothing was stored or forwarded"),
            )
        };
        let declared = req
            .headers()
            .get(CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok());
        if declared.is_some_and(|n| n > limit) {
            return too_large();
        }
        let (parts, body) = req.into_parts();
        let body = match Limited::new(body, usize::try_from(limit).unwrap_or(usize::MAX))
            .collect()
            .await
        {
            Ok(c) => c.to_bytes(),
            Err(e) if e.is::<http_body_util::LengthLimitError>() => return too_large(),
            Err(e) => {
                return refuse(
                    ProblemKind::InvalidRequest,
                    format!("the request body could not be read: {e}"),
                )
            }
        };
        let fingerprint = Fingerprint::compute(
            policy.fingerprint,
            parts.method.as_str(),
            parts.uri.path(),
            parts.uri.query(),
            parts.headers.get(CONTENT_TYPE).map(|v| v.as_bytes()),
            &body,
        );
        Admission::Keyed(Keyed {
            route,
            key,
            tenant,
            fingerprint,
            parts,
            body,
            client,
            timings: Timings::default(),
        })
    }

    /// The state machine's I/O: claim, decide, and execute or answer.
    async fn keyed(&self, k: &Keyed<'_>) -> Handled {
        let policy = &k.route.policy;
        // A completion is immutable until it expires: a warm replica
        // replays it without a round trip.
        if let Some(c) = self.cache.get(&k.tenant, &k.key) {
            if c.fingerprint == k.fingerprint {
                let mut h = replay(Some(&c.response));
                set_expires(&mut h.response, c.expires_at);
                return h;
            }
        }
        let deadline = Instant::now() + policy.wait;
        let mut waiter = None;
        // A fenced write loses only when the record changed between our read
        // and our write; each turn re-reads. Bounded so that a pathological
        // flapping key cannot spin; waiting turns are bounded by `wait`.
        let mut races = 0;
        while races < 4 {
            // Armed before the read, so no wake-up falls in between.
            let notify = waiter.as_ref().map(WaitGuard::notify);
            let notified = notify.as_ref().map(|n| n.notified());
            let owner = crate::idempotency::OwnerToken::mint();
            let ticket = self.cache.ticket();
            let result = self
                .timed(
                    k,
                    "claim",
                    self.store.claim(
                        &k.tenant,
                        &k.key,
                        &k.fingerprint,
                        owner,
                        policy.lease,
                        policy.retention,
                    ),
                )
                .await;
            let existing = match result {
                Err(e) => return self.store_failed(k, e).await,
                Ok(ClaimResult::Claimed(claim)) => return self.execute(k, claim).await,
                Ok(ClaimResult::Existing(x)) => x,
            };
            let replace = match decide(&existing.view, &k.fingerprint, existing.now) {
                Decision::Replay => {
                    let mut h = replay(existing.response.as_ref());
                    set_expires(&mut h.response, existing.view.expires_at);
                    if let Some(response) = existing.response {
                        let cached = Cached {
                            fingerprint: existing.view.fingerprint,
                            response: Arc::new(response),
                            expires_at: existing.view.expires_at,
                        };
                        self.cache
                            .put(&k.tenant, &k.key, cached, existing.now, ticket);
                    }
                    return h;
                }
                Decision::Conflict { lease_remaining } => {
                    let now = Instant::now();
                    if now >= deadline {
                        return conflict(lease_remaining);
                    }
                    let Some(notified) = notified else {
                        // First conflict: register, then read again with the
                        // wake-up armed.
                        match self.waiters.register(k.wait_id()) {
                            Some(g) => waiter = Some(g),
                            None => return conflict(lease_remaining),
                        }
                        continue;
                    };
                    // Sleep until the key changes, the lease runs out (then
                    // take over as any request would) or the wait ends.
                    let until = deadline.min(now + lease_remaining + Duration::from_millis(5));
                    tokio::select! {
                        () = notified => {}
                        () = tokio::time::sleep_until(until.into()) => {}
                    }
                    continue;
                }
                Decision::Mismatch => {
                    return Handled::problem(
                        Problem::new(
                            ProblemKind::KeyReused,
                            format!("the key {} was first used with a different request (method, path, query or body)", k.key),
                        ),
                        Outcome::Mismatch,
                    )
                }
                Decision::TakeOver { previous, .. } => Replace::TakeOver(previous),
                Decision::Reclaim { previous } => Replace::Reclaim(previous),
            };
            let result = self
                .timed(
                    k,
                    "replace",
                    self.store.replace(
                        &k.tenant,
                        &k.key,
                        &k.fingerprint,
                        owner,
                        replace,
                        policy.lease,
                        policy.retention,
                    ),
                )
                .await;
            match result {
                Err(e) => return self.store_failed(k, e).await,
                Ok(None) => races += 1,
                Ok(Some(claim)) => {
                    if let Replace::TakeOver(previous) = replace {
                        self.metrics.takeover();
                        warn!(
                            key = %k.key,
                            attempt = claim.attempt,
                            previous_owner = %previous.as_uuid(),
                            "took over a claim whose lease expired; forwarding again"
                        );
                    }
                    return self.execute(k, claim).await;
                }
            }
        }
        conflict(Duration::from_secs(1))
    }

    /// Runs a store operation, recording its duration in the metrics and
    /// in the request's access-log timings.
    async fn timed<T>(
        &self,
        k: &Keyed<'_>,
        op: &'static str,
        fut: impl std::future::Future<Output = T>,
    ) -> T {
        let t = Instant::now();
        let out = fut.await;
        let elapsed = t.elapsed();
        self.metrics.store(op, elapsed);
        k.timings
            .store_us
            .fetch_add(elapsed.as_micros() as u64, Ordering::Relaxed);
        out
    }

    /// Forwards an owned claim once and settles it.
    async fn execute(&self, k: &Keyed<'_>, claim: Claim) -> Handled {
        let policy = &k.route.policy;
        let in_flight = self.metrics.in_flight().clone();
        in_flight.inc();
        let _in_flight = scopeguard(move || {
            in_flight.dec();
        });
        let mut req = match self.forward_request(
            &k.parts,
            full(k.body.clone()),
            k.client,
            Some(claim.attempt),
        ) {
            Ok(r) => r,
            Err(e) => {
                self.release(k, claim).await;
                return Handled::problem(
                    Problem::new(
                        ProblemKind::InvalidRequest,
                        format!("the request cannot be forwarded: {e}"),
                    ),
                    Outcome::Released,
                );
            }
        };
        // The body is already buffered: no 100-continue dance upstream.
        req.headers_mut().remove(EXPECT);
        if let Some((name, value)) = k.derived_key() {
            req.headers_mut().insert(name, value);
        }
        let release_on: Vec<u16> = policy.release_on.iter().map(|s| s.as_u16()).collect();
        let max_stored = policy.max_stored_response;
        let timeout = self.upstream.timeout();
        let exchange = async {
            let resp = self.upstream.send(req).await?;
            if settle(
                UpstreamOutcome::Answered(resp.status().as_u16()),
                &release_on,
            ) == Settlement::Release
            {
                return Ok(Exchanged::Release(resp));
            }
            read_limited(resp, max_stored).await
        };
        let bounded = async {
            match tokio::time::timeout(timeout, exchange).await {
                Ok(r) => r,
                Err(_) => Err(UpstreamError::Timeout(timeout)),
            }
        };
        let started = Instant::now();
        // The lease is renewed while the call is in flight and on until the
        // response is stored: an owner holding the answer must not lose its
        // key to a retry because the database was slow to take it.
        let renewal = self
            .renewer
            .hold(&k.tenant, &k.key, claim.owner, policy.lease);
        let result = bounded.await;
        let elapsed = started.elapsed();
        self.metrics.upstream(elapsed);
        k.timings
            .upstream_us
            .store(elapsed.as_micros() as u64, Ordering::Relaxed);
        // Unless a response is to be stored, renewal ends with the call: a
        // claim of unknown outcome is left to expire.
        let renewal = match &result {
            Ok(Exchanged::Whole(..) | Exchanged::TooLarge(..)) => Some(renewal),
            _ => None,
        };
        let mut handled = match result {
            Err(UpstreamError::Connect(e)) => {
                // settle(NotSent) == Release: the request never left.
                self.release(k, claim).await;
                Handled::problem(
                    Problem::new(
                        ProblemKind::UpstreamUnreachable,
                        format!("the upstream could not be reached; the request was not sent and may be retried at once ({e})"),
                    ),
                    Outcome::Released,
                )
            }
            Err(e @ UpstreamError::Timeout(_)) => {
                warn!(key = %k.key, attempt = claim.attempt, error = %e, "outcome unknown: the claim stays in flight until its lease expires");
                Handled::problem(
                    Problem::new(
                        ProblemKind::UpstreamTimeout,
                        "the upstream did not answer in time; the request may have been executed. Retry with the same key after the lease expires",
                    )
                    .retry_after(retry_after_secs(policy.lease)),
                    Outcome::Claimed,
                )
            }
            Err(e) => {
                warn!(key = %k.key, attempt = claim.attempt, error = %e, "outcome unknown: the claim stays in flight until its lease expires");
                Handled::problem(
                    Problem::new(
                        ProblemKind::UpstreamFailed,
                        "the upstream connection failed after the request was sent; it may have been executed. Retry with the same key after the lease expires",
                    )
                    .retry_after(retry_after_secs(policy.lease)),
                    Outcome::Claimed,
                )
            }
            Ok(Exchanged::Release(resp)) => {
                self.release(k, claim).await;
                Handled::new(stream_response(resp), Outcome::Released)
            }
            Ok(Exchanged::Whole(parts, body)) => {
                let stored = StoredResponse {
                    status: parts.status.as_u16(),
                    headers: headers::capture(&parts.headers),
                    body: Some(body.clone()),
                };
                let (outcome, expires) = self.complete(k, claim, stored, renewal).await;
                let mut resp = response_from(parts, full(body));
                if let Some(at) = expires {
                    set_expires(&mut resp, at);
                }
                Handled::new(resp, outcome)
            }
            Ok(Exchanged::TooLarge(parts, prefix, rest)) => {
                warn!(
                    key = %k.key,
                    status = parts.status.as_u16(),
                    limit = max_stored,
                    "response body exceeds max_stored_response: passed on, stored without its body; replays will get 502 response-not-stored"
                );
                let stored = StoredResponse {
                    status: parts.status.as_u16(),
                    headers: headers::capture(&parts.headers),
                    body: None,
                };
                let (outcome, _) = self.complete(k, claim, stored, renewal).await;
                let body = PrefixedBody {
                    prefix: Some(prefix),
                    rest,
                };
                Handled::new(response_from(parts, body.boxed()), outcome)
            }
        };
        handled.attempt = Some(claim.attempt);
        handled
    }

    /// Stores the response, fenced by our owner token. `renewal` keeps the
    /// lease alive until the response is stored (in the background, if the
    /// first attempt fails).
    async fn complete(
        &self,
        k: &Keyed<'_>,
        claim: Claim,
        stored: StoredResponse,
        renewal: Option<Renewal>,
    ) -> (Outcome, Option<SystemTime>) {
        let retention = k.route.policy.retention;
        let wait_id = k.notifies().then(|| k.wait_id());
        let result = self
            .timed(
                k,
                "complete",
                self.store.complete(
                    &k.tenant,
                    &k.key,
                    claim.owner,
                    &stored,
                    retention,
                    wait_id.as_deref(),
                ),
            )
            .await;
        if let Some(id) = &wait_id {
            self.waiters.wake(id);
        }
        match result {
            // Not cached here: most keys are never retried. A key enters
            // the cache on its first replay, read from the database.
            Ok(Some(expires)) => (Outcome::Claimed, Some(expires)),
            Ok(None) => {
                self.metrics.lost_lease();
                warn!(
                    key = %k.key,
                    attempt = claim.attempt,
                    "lease lost: another attempt owns this key now; this response goes to its client but is not stored"
                );
                (Outcome::LostLease, None)
            }
            Err(e) => {
                warn!(key = %k.key, error = %e, "could not store the response; retrying in the background");
                // Work of the lifecycle: the drain waits for it.
                self.lifecycle.spawn_work(retry_completion(
                    self.store.clone(),
                    self.metrics.clone(),
                    Completion {
                        tenant: k.tenant.clone(),
                        key: k.key.clone(),
                        claim,
                        stored,
                        retention,
                        wait_id,
                    },
                    renewal,
                ));
                (Outcome::Claimed, None)
            }
        }
    }

    /// Deletes our claim so a retry may run; a failure leaves it to expire.
    async fn release(&self, k: &Keyed<'_>, claim: Claim) {
        let wait_id = k.notifies().then(|| k.wait_id());
        let result = self
            .timed(
                k,
                "release",
                self.store
                    .release(&k.tenant, &k.key, claim.owner, wait_id.as_deref()),
            )
            .await;
        if let Some(id) = &wait_id {
            self.waiters.wake(id);
        }
        if let Err(e) = result {
            warn!(key = %k.key, error = %e, "could not release the claim; it will expire with its lease");
        }
    }

    /// The store failed before anything was forwarded.
    async fn store_failed(&self, k: &Keyed<'_>, e: StoreError) -> Handled {
        match self.config.store.on_store_error {
            OnStoreError::Reject => {
                warn!(key = %k.key, error = %e, "store unavailable: refusing the keyed request (fail closed)");
                Handled::problem(
                    Problem::new(
                        ProblemKind::StoreUnavailable,
                        "the idempotency store is unavailable; nothing was forwarded. Retry with the same key",
                    )
                    .retry_after(1),
                    Outcome::StoreError,
                )
            }
            OnStoreError::PassThrough => {
                warn!(
                    key = %k.key,
                    error = %e,
                    "store unavailable: forwarding UNPROTECTED (on_store_error = pass_through); a retry may execute twice"
                );
                let req = match self.forward_request(&k.parts, full(k.body.clone()), k.client, None)
                {
                    Ok(r) => r,
                    Err(e) => {
                        return Handled::problem(
                            Problem::new(
                                ProblemKind::InvalidRequest,
                                format!("the request cannot be forwarded: {e}"),
                            ),
                            Outcome::StoreError,
                        )
                    }
                };
                let mut h = self.forward_streaming(req).await;
                h.outcome = Outcome::StoreError;
                h
            }
        }
    }

    async fn pass_through(&self, req: Request<Incoming>, client: ClientInfo) -> Handled {
        let (parts, body) = req.into_parts();
        let body = body.map_err(BoxError::from).boxed();
        match self.forward_request(&parts, body, client, None) {
            Ok(req) => self.forward_streaming(req).await,
            Err(e) => Handled::problem(
                Problem::new(
                    ProblemKind::InvalidRequest,
                    format!("the request cannot be forwarded: {e}"),
                ),
                Outcome::Rejected,
            ),
        }
    }

    async fn forward_streaming(&self, req: Request<ProxyBody>) -> Handled {
        let started = Instant::now();
        let result = self.upstream.send(req).await;
        self.metrics.upstream(started.elapsed());
        match result {
            Ok(resp) => Handled::new(stream_response(resp), Outcome::Passthrough),
            Err(e) => {
                let kind = match e {
                    UpstreamError::Connect(_) => ProblemKind::UpstreamUnreachable,
                    UpstreamError::Timeout(_) => ProblemKind::UpstreamTimeout,
                    UpstreamError::Failed(_) => ProblemKind::UpstreamFailed,
                };
                Handled::problem(Problem::new(kind, e.to_string()), Outcome::Passthrough)
            }
        }
    }

    /// The request as the upstream gets it.
    fn forward_request(
        &self,
        parts: &request::Parts,
        body: ProxyBody,
        client: ClientInfo,
        attempt: Option<i32>,
    ) -> Result<Request<ProxyBody>, http::Error> {
        let uri = self.upstream.uri_for(parts.uri.path_and_query())?;
        let mut h = parts.headers.clone();
        headers::strip_hop_by_hop(&mut h);
        let original_host = parts
            .headers
            .get(HOST)
            .and_then(|v| v.to_str().ok())
            .or_else(|| parts.uri.authority().map(|a| a.as_str()));
        headers::add_forwarded(&mut h, client.addr.ip(), client.proto, original_host);
        h.insert(HOST, self.upstream.host_header().clone());
        match attempt {
            Some(a) => {
                h.insert(ATTEMPT, HeaderValue::from(a));
            }
            None => {
                h.remove(ATTEMPT);
            }
        }
        let mut req = Request::new(body);
        *req.method_mut() = parts.method.clone();
        *req.uri_mut() = uri;
        *req.headers_mut() = h;
        Ok(req)
    }
}

enum Admission<'a> {
    PassThrough(Request<Incoming>),
    Refused(Handled),
    Keyed(Keyed<'a>),
}

/// Advertises until when the key is remembered.
fn set_expires(resp: &mut Response<ProxyBody>, at: SystemTime) {
    if let Ok(v) = HeaderValue::from_str(&httpdate::fmt_http_date(at)) {
        resp.headers_mut().insert(EXPIRES, v);
    }
}

fn conflict(lease_remaining: Duration) -> Handled {
    let secs = retry_after_secs(lease_remaining);
    Handled::problem(
        Problem::new(
            ProblemKind::RequestInProgress,
            format!("a request with this key is being processed; retry in {secs} s"),
        )
        .retry_after(secs),
        Outcome::Conflict,
    )
}

/// A replay: the stored status, headers and body bytes, marked replayed.
fn replay(stored: Option<&StoredResponse>) -> Handled {
    let Some(stored) = stored else {
        return Handled::problem(
            Problem::new(
                ProblemKind::StoreUnavailable,
                "the stored response could not be read",
            )
            .retry_after(1),
            Outcome::StoreError,
        );
    };
    let Some(body) = &stored.body else {
        let mut resp = Problem::new(
            ProblemKind::ResponseNotStored,
            format!(
                "the original request was executed (upstream status {}) but its response body exceeded max_stored_response and was not stored; it will not be executed again",
                stored.status
            ),
        )
        .into_response();
        resp.headers_mut()
            .insert(REPLAYED, HeaderValue::from_static("true"));
        return Handled::new(resp, Outcome::Replayed);
    };
    let mut resp = Response::new(full(body.clone()));
    *resp.status_mut() = StatusCode::from_u16(stored.status).unwrap_or(StatusCode::BAD_GATEWAY);
    for (name, value) in &stored.headers {
        if let (Ok(n), Ok(v)) = (
            HeaderName::from_bytes(name.as_bytes()),
            HeaderValue::from_maybe_shared(value.clone()),
        ) {
            resp.headers_mut().append(n, v);
        }
    }
    resp.headers_mut()
        .insert(REPLAYED, HeaderValue::from_static("true"));
    Handled::new(resp, Outcome::Replayed)
}

/// An upstream response passed on as it streams, hop-by-hop headers removed.
fn stream_response(resp: Response<Incoming>) -> Response<ProxyBody> {
    let (parts, body) = resp.into_parts();
    response_from(parts, body.map_err(BoxError::from).boxed())
}

fn response_from(mut parts: response::Parts, body: ProxyBody) -> Response<ProxyBody> {
    headers::strip_hop_by_hop(&mut parts.headers);
    Response::from_parts(parts, body)
}

/// Reads a response body up to `limit` bytes.
async fn read_limited(resp: Response<Incoming>, limit: u64) -> Result<Exchanged, UpstreamError> {
    let (parts, mut body) = resp.into_parts();
    let mut buf = BytesMut::new();
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|e| UpstreamError::Failed(upstream::error_chain(&e)))?;
        if let Ok(data) = frame.into_data() {
            buf.extend_from_slice(&data);
            if buf.len() as u64 > limit {
                return Ok(Exchanged::TooLarge(parts, buf.freeze(), body));
            }
        }
    }
    Ok(Exchanged::Whole(parts, buf.freeze()))
}

/// A response to store for an owned claim.
struct Completion {
    tenant: TenantId,
    key: IdempotencyKey,
    claim: Claim,
    stored: StoredResponse,
    retention: Duration,
    wait_id: Option<String>,
}

/// Retries a failed completion in the background: the response is the
/// truth of what the upstream did, and a completed record is what stops a
/// second execution once the lease runs out. A lease lost meanwhile is
/// counted like any other (`lost_lease`).
async fn retry_completion(
    store: Store,
    metrics: Arc<Metrics>,
    c: Completion,
    renewal: Option<Renewal>,
) {
    // Renewed meanwhile: the first statement to land once the database
    // is back keeps the key ours.
    let _renewal = renewal;
    let mut backoff = Backoff::new(Duration::from_millis(100), Duration::from_secs(1));
    let deadline = Instant::now() + Duration::from_secs(300);
    while Instant::now() < deadline {
        backoff.wait().await;
        let result = store
            .complete(
                &c.tenant,
                &c.key,
                c.claim.owner,
                &c.stored,
                c.retention,
                c.wait_id.as_deref(),
            )
            .await;
        match result {
            Ok(Some(_)) => {
                info!(key = %c.key, "stored the response after a retry");
                return;
            }
            Ok(None) => {
                metrics.lost_lease();
                warn!(key = %c.key, attempt = c.claim.attempt, "lease lost before the response could be stored");
                return;
            }
            Err(e) => {
                tracing::debug!(key = %c.key, error = %e, "completion retry failed");
            }
        }
    }
    warn!(key = %c.key, "gave up storing the response; the claim will expire with its lease");
}

/// Runs a closure when dropped (the in-flight gauge must come down on every
/// path, cancellation included).
fn scopeguard<F: FnOnce()>(f: F) -> impl Drop {
    struct Guard<F: FnOnce()>(Option<F>);
    impl<F: FnOnce()> Drop for Guard<F> {
        fn drop(&mut self) {
            if let Some(f) = self.0.take() {
                f();
            }
        }
    }
    Guard(Some(f))
}

/// The part of a response body already read, then the rest as it streams.
struct PrefixedBody {
    prefix: Option<Bytes>,
    rest: Incoming,
}

impl Body for PrefixedBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        if let Some(p) = self.prefix.take() {
            return Poll::Ready(Some(Ok(Frame::data(p))));
        }
        Pin::new(&mut self.rest)
            .poll_frame(cx)
            .map_err(BoxError::from)
    }

    fn is_end_stream(&self) -> bool {
        self.prefix.is_none() && self.rest.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        let mut hint = self.rest.size_hint();
        if let Some(p) = &self.prefix {
            let n = p.len() as u64;
            // Raise the upper bound first: set_lower asserts lower <= upper.
            if let Some(u) = hint.upper() {
                hint.set_upper(u + n);
            }
            hint.set_lower(hint.lower() + n);
        }
        hint
    }
}
