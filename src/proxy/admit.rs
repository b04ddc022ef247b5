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
use std::time::Duration;

use bytes::Bytes;
use http::header::{HeaderName, HeaderValue, CONTENT_LENGTH, CONTENT_TYPE};
use http::{request, HeaderMap, Request};
use http_body_util::{BodyExt, Limited};
use hyper::body::Incoming;

use super::problem::{Problem, ProblemKind};
use super::{ClientInfo, Handled, Proxy};
use crate::config::{DerivedKey, KeyRequirement, Policy, Route};
use crate::idempotency::{Fingerprint, IdempotencyKey, KeyError, RecordKey, TenantError, TenantId};
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
    /// The route that keys it.
    pub(super) route: &'a Route,
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
        matched: Option<&'a Route>,
        req: Request<Incoming>,
        client: &ClientInfo,
    ) -> Admission<'a> {
        let Some(route) = matched.filter(|r| r.policy.methods.contains(req.method())) else {
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
            record: RecordKey::new(tenant, key),
            fingerprint,
            parts,
            body,
            client: client.clone(),
            timings: Timings::default(),
        })
    }
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
    let Ok(collected) = tokio::time::timeout(timeout, collect).await else {
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
