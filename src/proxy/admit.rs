//! Admission: from a request to a keyed request, a pass-through, or a
//! refusal.
//!
//! Route match → key → tenant → body (≤ `max_request_body`) → fingerprint,
//! in that order, each step able to refuse. Admission reads only the
//! request: a refused request has touched neither the store nor the
//! upstream, so it costs nothing and leaves nothing behind (DESIGN.md §2:
//! "nothing stored or forwarded"). A missing key on a route where it is
//! optional is a pass-through, decided before the tenant is looked at,
//! because tenant rules apply only to keyed requests (§6).
//!
//! The body of a keyed request is buffered here, bounded: it must be whole
//! to be fingerprinted, and it is forwarded from the buffer, so the
//! fingerprint and what the upstream gets cannot differ.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::header::{HeaderName, HeaderValue, CONTENT_LENGTH, CONTENT_TYPE};
use http::{request, HeaderMap, Request};
use http_body_util::{BodyExt, Limited};
use hyper::body::Incoming;

use super::problem::{Problem, ProblemKind};
use super::{ClientInfo, Handled, Proxy};
use crate::cache::Cached;
use crate::config::{DerivedKey, KeyRequirement, Policy, Route};
use crate::idempotency::fingerprint::{is_json_content_type, Inputs};
use crate::idempotency::{
    Fingerprint, FingerprintMode, IdempotencyKey, KeyError, RecordKey, TenantError, TenantId,
};
use crate::metrics::Outcome;

/// What admission made of a request.
pub(super) enum Admission<'a> {
    /// Not keyed (no route, method not keyed, optional key absent):
    /// forwarded untouched.
    PassThrough(Request<Incoming>),
    /// Refused before anything was stored or forwarded.
    Refused(Handled),
    /// Keyed: on to the claim.
    Keyed(Keyed<'a>),
}

/// A keyed request, admitted and fingerprinted.
pub(super) struct Keyed<'a> {
    /// The route that keys it, and its index in the configuration's
    /// routes (a spawned task finds it again from there).
    pub(super) route: &'a Route,
    pub(super) route_index: usize,
    /// The tenant and the key (as the client sent it, unquoted).
    pub(super) record: RecordKey,
    /// What a duplicate must match.
    pub(super) fingerprint: Fingerprint,
    /// The request head, forwarded as received (less hop-by-hop headers).
    pub(super) parts: request::Parts,
    /// The whole body, as fingerprinted and as forwarded.
    pub(super) body: Bytes,
    /// The peer, for the `X-Forwarded-*` headers.
    pub(super) client: ClientInfo,
    /// Where the request spent its time, for the access log.
    pub(super) timings: Timings,
    /// The response cache's entry for the key, looked up at admission.
    pub(super) cached: Option<Arc<Cached>>,
}

/// Where a keyed request spent its time, for the access log.
#[derive(Default)]
pub(super) struct Timings {
    /// Sum of its store operations, in microseconds.
    pub(super) store_us: AtomicU64,
    /// Its upstream call, in microseconds.
    pub(super) upstream_us: AtomicU64,
}

impl Timings {
    /// Store and upstream time, in milliseconds.
    pub(super) fn millis(&self) -> (f64, f64) {
        let ms = |a: &AtomicU64| a.load(Ordering::Relaxed) as f64 / 1000.0;
        (ms(&self.store_us), ms(&self.upstream_us))
    }
}

impl Keyed<'_> {
    /// Whether completions and releases of this key notify waiters.
    pub(super) fn notifies(&self) -> bool {
        !self.route.policy.wait.is_zero()
    }

    /// The key's id on the notification channel.
    pub(super) fn wait_id(&self) -> String {
        self.record.id().to_string()
    }

    /// The key forwarded in `derived_key_header`.
    pub(super) fn derived_key(&self) -> Option<(HeaderName, HeaderValue)> {
        let header = self.route.policy.derived_key_header.clone()?;
        let value = match self.route.policy.derived_key {
            DerivedKey::Sha256 => self.record.id().hex(),
            DerivedKey::TenantKey => self.record.tenant_key(),
        };
        Some((header, HeaderValue::from_str(&value).ok()?))
    }
}

impl Proxy {
    /// Admits a request: `matched` is the route covering its path, if any.
    pub(super) async fn admit<'a>(
        &self,
        matched: Option<(usize, &'a Route)>,
        req: Request<Incoming>,
        client: &ClientInfo,
    ) -> Admission<'a> {
        let Some((route_index, route)) =
            matched.filter(|(_, r)| r.policy.methods.contains(req.method()))
        else {
            return Admission::PassThrough(req);
        };
        let policy = &route.policy;
        let key = match key(policy, req.headers()) {
            Ok(Some(key)) => key,
            Ok(None) => return Admission::PassThrough(req),
            Err(p) => return refused(p),
        };
        let tenant = match tenant(route, req.headers()) {
            Ok(tenant) => tenant,
            Err(p) => return refused(p),
        };
        let server = &self.config.server;
        let (parts, body) = match Box::pin(read_body(
            req,
            server.max_request_body,
            server.body_read_timeout,
        ))
        .await
        {
            Ok(read) => read,
            Err(p) => return refused(p),
        };
        let record = RecordKey::new(tenant, key);
        // Asked before the fingerprint: a retry with the bytes of the
        // request that filled the entry has its fingerprint already.
        let cached = self.cache.get(&record);
        let known = cached.as_ref().and_then(|c| {
            let seen = c.seen.as_ref()?;
            inputs_match(seen, policy.fingerprint, &parts, &body).then_some(c.fingerprint)
        });
        let fingerprint = match known {
            Some(f) => f,
            None => fingerprint(policy.fingerprint, &parts, &body).await,
        };
        Admission::Keyed(Keyed {
            route,
            route_index,
            record,
            fingerprint,
            parts,
            body,
            client: client.clone(),
            timings: Timings::default(),
            cached,
        })
    }
}

/// JSON bodies up to this size are canonicalised and hashed inline; larger
/// ones on tokio's blocking pool.
///
/// Measured with benches/fingerprint.rs (machine busy): a JSON fingerprint
/// costs ~30 µs per KiB (10 µs idle, BENCHMARKS.md), so a 1 MiB body holds
/// a worker thread for 10–30 ms, and every other request on that worker
/// with it; the hand-off to the blocking pool and back costs ~38 µs, four
/// times a 200 B body's whole fingerprint. At 16 KiB a body holds a worker
/// for at most ~0.5 ms (~0.15 ms idle), and above it the hand-off adds
/// under a tenth to the work moved.
pub(super) const INLINE_JSON_MAX: usize = 16 * 1024;

/// The same bound for bodies hashed as raw bytes (non-JSON, or
/// `fingerprint = "bytes"`): SHA-256 alone runs at ~1 GiB/s, so 16 times
/// the JSON bound costs about as much.
pub(super) const INLINE_BYTES_MAX: usize = 16 * INLINE_JSON_MAX;

/// The request's fingerprint: the same value inline or offloaded, computed
/// on the blocking pool when the body is over the bound of its kind.
pub(super) async fn fingerprint(
    mode: FingerprintMode,
    parts: &request::Parts,
    body: &Bytes,
) -> Fingerprint {
    let content_type = parts.headers.get(CONTENT_TYPE);
    let json = mode == FingerprintMode::Json
        && is_json_content_type(content_type.map(HeaderValue::as_bytes));
    let inline_max = if json {
        INLINE_JSON_MAX
    } else {
        INLINE_BYTES_MAX
    };
    if body.len() <= inline_max {
        return compute(mode, &parts.method, &parts.uri, content_type, body);
    }
    let (method, uri, ct, owned) = (
        parts.method.clone(),
        parts.uri.clone(),
        content_type.cloned(),
        body.clone(),
    );
    let offloaded = move || compute(mode, &method, &uri, ct.as_ref(), &owned);
    match tokio::task::spawn_blocking(offloaded).await {
        Ok(fp) => fp,
        Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
        // Cancelled: the runtime is shutting down and never started it.
        Err(_) => compute(mode, &parts.method, &parts.uri, content_type, body),
    }
}

/// A request's fingerprint inputs, kept with a cached completion when its
/// body is at most this long (they count against the cache's budget).
/// Larger bodies are fingerprinted on every replay, as before.
pub(super) const KEPT_INPUTS_MAX: usize = INLINE_JSON_MAX;

/// The inputs of a keyed request, to keep with the completion it replays
/// (`None` when the body is over [`KEPT_INPUTS_MAX`]).
pub(super) fn inputs(mode: FingerprintMode, parts: &request::Parts, body: &[u8]) -> Option<Inputs> {
    (body.len() <= KEPT_INPUTS_MAX).then(|| {
        Inputs::new(
            mode,
            parts.method.as_str(),
            parts.uri.path(),
            parts.uri.query(),
            parts.headers.get(CONTENT_TYPE).map(HeaderValue::as_bytes),
            body,
        )
    })
}

fn inputs_match(seen: &Inputs, mode: FingerprintMode, parts: &request::Parts, body: &[u8]) -> bool {
    seen.matches(
        mode,
        parts.method.as_str(),
        parts.uri.path(),
        parts.uri.query(),
        parts.headers.get(CONTENT_TYPE).map(HeaderValue::as_bytes),
        body,
    )
}

fn compute(
    mode: FingerprintMode,
    method: &http::Method,
    uri: &http::Uri,
    content_type: Option<&HeaderValue>,
    body: &[u8],
) -> Fingerprint {
    Fingerprint::compute(
        mode,
        method.as_str(),
        uri.path(),
        uri.query(),
        content_type.map(HeaderValue::as_bytes),
        body,
    )
}

fn refused(p: Problem) -> Admission<'static> {
    Admission::Refused(Handled::problem(p, Outcome::Rejected))
}

/// The key, `None` when it is absent and optional.
fn key(policy: &Policy, headers: &HeaderMap) -> Result<Option<IdempotencyKey>, Problem> {
    let values: Vec<&HeaderValue> = headers.get_all(&policy.key_header).iter().collect();
    match values.as_slice() {
        [] => match policy.key {
            KeyRequirement::Optional => Ok(None),
            KeyRequirement::Required => Err(Problem::new(
                ProblemKind::MissingKey,
                format!("this route requires the {} header", policy.key_header),
            )),
        },
        [v] => IdempotencyKey::parse(v.as_bytes(), policy.max_key_length)
            .map(Some)
            .map_err(|e| Problem::new(ProblemKind::InvalidKey, e.to_string())),
        _ => Err(Problem::new(
            ProblemKind::InvalidKey,
            KeyError::Repeated.to_string(),
        )),
    }
}

/// The tenant that scopes the key: the empty tenant when the route names
/// no tenant header.
fn tenant(route: &Route, headers: &HeaderMap) -> Result<TenantId, Problem> {
    let Some(h) = &route.tenant_header else {
        return Ok(TenantId::none());
    };
    let values: Vec<&[u8]> = headers.get_all(h).iter().map(|v| v.as_bytes()).collect();
    TenantId::from_header(
        h.as_str(),
        &values,
        route.tenant_required,
        route.tenant_hash,
    )
    .map_err(|e| match e {
        TenantError::Missing { .. } => Problem::new(ProblemKind::MissingTenant, e.to_string()),
        e => Problem::new(ProblemKind::InvalidTenant, e.to_string()),
    })
}

/// Reads the whole body, up to `limit` bytes, within `timeout`. A declared
/// length over the limit is refused before a byte of the body is read.
///
/// Why a deadline on the whole body, not on each read: a client that
/// trickles a byte a second would pass any per-read bound while it holds a
/// task and up to `limit` bytes of memory.
async fn read_body(
    req: Request<Incoming>,
    limit: u64,
    timeout: Duration,
) -> Result<(request::Parts, Bytes), Problem> {
    let too_large = || {
        Problem::new(
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
        return Err(too_large());
    }
    let (parts, body) = req.into_parts();
    let collect = Limited::new(body, usize::try_from(limit).unwrap_or(usize::MAX)).collect();
    let Ok(collected) = crate::timer::timeout(timeout, collect).await else {
        return Err(Problem::new(
            ProblemKind::RequestTimeout,
            format!(
                "the request body did not arrive within {}; nothing was stored or forwarded",
                humantime::format_duration(timeout)
            ),
        ));
    };
    match collected {
        Ok(c) => Ok((parts, c.to_bytes())),
        Err(e) if e.is::<http_body_util::LengthLimitError>() => Err(too_large()),
        Err(e) => Err(Problem::new(
            ProblemKind::InvalidRequest,
            format!("the request body could not be read: {e}"),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicBool;
    use std::sync::Arc;

    fn parts(content_type: &str) -> request::Parts {
        Request::builder()
            .method("POST")
            .uri("/v1/orders?x=1")
            .header(CONTENT_TYPE, content_type)
            .body(())
            .unwrap()
            .into_parts()
            .0
    }

    /// A JSON document of about `size` bytes, keys unsorted, with
    /// whitespace: canonicalisation has work to do.
    fn json_body(size: usize) -> Bytes {
        let mut s = String::from("{\"z\": 1, \"items\": [");
        let mut i = 0;
        while s.len() < size {
            if i > 0 {
                s.push_str(", ");
            }
            s.push_str(&format!(
                "{{\"sku\": \"S-{i}\", \"qty\": {i}, \"a\": true}}"
            ));
            i += 1;
        }
        s.push_str("]}");
        Bytes::from(s)
    }

    fn inline(mode: FingerprintMode, parts: &request::Parts, body: &[u8]) -> Fingerprint {
        Fingerprint::compute(
            mode,
            parts.method.as_str(),
            parts.uri.path(),
            parts.uri.query(),
            parts.headers.get(CONTENT_TYPE).map(HeaderValue::as_bytes),
            body,
        )
    }

    #[tokio::test]
    async fn large_and_small_bodies_get_the_inline_fingerprint() {
        let large = json_body(INLINE_BYTES_MAX * 2);
        let medium = json_body(INLINE_JSON_MAX * 2);
        let small = json_body(200);
        let at_bound = json_body(INLINE_JSON_MAX - 64);
        let not_json = Bytes::from(vec![b'{'; INLINE_JSON_MAX + 1]);
        for ct in ["application/json", "text/plain"] {
            let p = parts(ct);
            for mode in [FingerprintMode::Json, FingerprintMode::Bytes] {
                for body in [&large, &medium, &small, &at_bound, &not_json] {
                    assert_eq!(
                        fingerprint(mode, &p, body).await,
                        inline(mode, &p, body),
                        "{ct}, {mode:?}, {} bytes",
                        body.len()
                    );
                }
            }
        }
    }

    /// On a one-thread runtime a task spawned before the fingerprint can
    /// only run if fingerprinting yields the thread.
    async fn runs_meanwhile(body: &Bytes) -> bool {
        let ran = Arc::new(AtomicBool::new(false));
        let other = tokio::spawn({
            let ran = ran.clone();
            async move { ran.store(true, Ordering::SeqCst) }
        });
        fingerprint(FingerprintMode::Json, &parts("application/json"), body).await;
        let meanwhile = ran.load(Ordering::SeqCst);
        other.await.unwrap();
        meanwhile
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_large_body_is_fingerprinted_without_holding_the_runtime() {
        let large = json_body(1024 * 1024);
        assert!(
            runs_meanwhile(&large).await,
            "another task ran while the 1 MiB body was fingerprinted"
        );
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_small_body_is_fingerprinted_inline() {
        // The other side of the test above: inline, nothing else runs.
        assert!(!runs_meanwhile(&json_body(200)).await);
    }
}
