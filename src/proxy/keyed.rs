//! The keyed path: claim the key or decide what its record means.
//!
//! One turn reads (or claims) the record in a single statement and lets the
//! pure [`decide`] say what it means: replay, 409 (or wait), 422, or take
//! over. Only the store, the waiters and the renewer (which knows the
//! claims this process holds) are touched here; an owned claim
//! goes on to `execute`, which is the only place the upstream is called.
//!
//! Why a loop: a takeover is a fenced write, and it loses when the record
//! changed between our read and our write (another replica took over or
//! completed first). The next turn reads again and decides afresh, from the
//! record as it now is.

use std::ops::ControlFlow;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use http::header::{HeaderMap, HeaderName, HeaderValue};
use http::{Response, StatusCode};
use tokio::sync::futures::Notified;
use tracing::warn;

use super::admit::{inputs, Keyed};
use super::problem::{Problem, ProblemKind};
use super::{expires_header, full, Handled, Proxy, EXPIRES, REPLAYED};
use crate::cache::{Cached, Ticket};
use crate::config::OnStoreError;
use crate::idempotency::decision::retry_after_secs;
use crate::idempotency::{decide, Decision, OwnerToken};
use crate::lease::renewal_period;
use crate::metrics::Outcome;
use crate::store::{Claim, ClaimResult, Existing, Replace, StoreError, StoredResponse};
use crate::waiters::WaitGuard;

/// A duplicate's wait for its original (route setting `wait`).
struct Waiting<'w> {
    /// When the wait runs out and the duplicate gets its 409.
    deadline: Instant,
    /// Registered on the first conflict, then held until the request ends.
    guard: Option<WaitGuard<'w>>,
}

impl Proxy {
    /// The state machine's I/O: claim, decide, and execute or answer.
    ///
    /// The cache (looked up at admission, answered by `cached_replay`) is
    /// asked first, by the caller, without building this future. The branches that own a claim or wait are
    /// boxed: their state is large, and inline it would be carried (and
    /// moved) by every replay and 409 too.
    pub(super) async fn keyed(&self, k: &Keyed<'_>) -> Handled {
        let policy = &k.route.policy;
        let mut waiting = Waiting {
            deadline: Instant::now() + policy.wait,
            guard: None,
        };
        // A fenced write loses only when the record changed between our read
        // and our write; each turn re-reads. Bounded so that a pathological
        // flapping key cannot spin; waiting turns are bounded by `wait`.
        let mut races = 0;
        // Counted once per request, however many times a waiting one
        // re-reads the same stalled claim.
        let mut declined = false;
        while races < 4 {
            // Armed before the read, so no wake-up falls in between.
            let notify = waiting.guard.as_ref().map(WaitGuard::notify);
            let notified = notify.as_ref().map(|n| n.notified());
            let owner = OwnerToken::mint();
            let ticket = self.cache.ticket();
            // A lease taken by this statement runs from no earlier than now.
            let sent = Instant::now();
            let result = self
                .timed(
                    k,
                    "claim",
                    self.store.claim(
                        &k.record,
                        &k.fingerprint,
                        owner,
                        policy.lease,
                        policy.retention,
                    ),
                )
                .await;
            let existing = match result {
                Err(e) => return Box::pin(self.store_failed(k, e)).await,
                Ok(ClaimResult::Claimed(claim)) => {
                    return Box::pin(self.execute(k, claim, sent)).await
                }
                Ok(ClaimResult::Existing(x)) => x,
            };
            let decision = match decide(&existing.view, &k.fingerprint, existing.now) {
                // The lease ran out in the database (renewals could not
                // land: a stall), but its owner is running here: a takeover
                // would forward the request again while the first is in
                // flight. Answered as a live lease, until the original's
                // response is stored or a renewal finds the lease lost;
                // the next renewal is due within a renewal period.
                Decision::TakeOver { previous, .. }
                    if self.renewer.running_here(&k.record, previous) =>
                {
                    if !std::mem::replace(&mut declined, true) {
                        self.metrics.takeover_declined();
                    }
                    Decision::Conflict {
                        lease_remaining: renewal_period(policy.lease),
                    }
                }
                decision => decision,
            };
            let replace = match decision {
                Decision::Replay => return self.replay_existing(k, existing, ticket),
                Decision::Conflict { lease_remaining } => {
                    match Box::pin(self.wait_for_change(k, &mut waiting, notified, lease_remaining))
                        .await
                    {
                        ControlFlow::Break(h) => return h,
                        ControlFlow::Continue(()) => continue,
                    }
                }
                Decision::Mismatch => return mismatch(k),
                Decision::TakeOver { previous, .. } => Replace::TakeOver(previous),
                Decision::Reclaim { previous } => Replace::Reclaim(previous),
            };
            let sent = Instant::now();
            match self.replace(k, owner, replace).await {
                Err(e) => return Box::pin(self.store_failed(k, e)).await,
                Ok(None) => races += 1,
                Ok(Some(claim)) => return Box::pin(self.execute(k, claim, sent)).await,
            }
        }
        conflict(Duration::from_secs(1))
    }

    /// A replay from this replica's cache, if it holds the completion.
    /// (Looked up at admission: the entry is taken from `k`.)
    pub(super) fn cached_replay(&self, k: &mut Keyed<'_>) -> Option<Handled> {
        // A completion is immutable until it expires: a warm replica
        // replays it without a round trip.
        let c = k.cached.take()?;
        if c.fingerprint != k.fingerprint {
            // A mismatch is the database's to answer.
            return None;
        }
        let Some(body) = &c.response.body else {
            return Some(replay(Some(&c.response), c.headers.get(EXPIRES)));
        };
        let mut resp = Response::new(full(body.clone()));
        *resp.status_mut() = replay_status(c.response.status);
        *resp.headers_mut() = c.headers.clone();
        Some(Handled::new(resp, Outcome::Replayed))
    }

    /// A duplicate of a key this process holds in flight, answered without
    /// the database: while the lease is known to run on, the record can
    /// only be our in-flight claim, so the answer is the one the database
    /// would give, `409` (or `422` for another fingerprint). A route that
    /// waits for the original is left to the keyed path.
    pub(super) fn held_here(&self, k: &Keyed<'_>) -> Option<Handled> {
        if k.notifies() {
            return None;
        }
        let held = self.renewer.held_here(&k.record)?;
        self.metrics.duplicate_held_here();
        Some(if held.fingerprint == k.fingerprint {
            conflict(held.lease_remaining)
        } else {
            mismatch(k)
        })
    }

    /// Replays a completed record read from the database, and caches it for
    /// the next retry.
    fn replay_existing(&self, k: &Keyed<'_>, existing: Existing, ticket: Ticket) -> Handled {
        let expires = expires_header(existing.view.expires_at);
        let h = replay(existing.response.as_ref(), expires.as_ref());
        // Only a cache that may hold it pays for the copy of the headers
        // (a cache-off replay is a hot path too).
        if let Some(response) = existing.response.filter(|_| self.cache.enabled()) {
            // What this replay answered is what the next one answers.
            let headers = h.response.headers().clone();
            let cached = Cached {
                fingerprint: existing.view.fingerprint,
                response: Arc::new(response),
                expires_at: existing.view.expires_at,
                headers,
                // This request's fingerprint is the record's (a replay).
                seen: inputs(k.route.policy.fingerprint, &k.parts, &k.body),
            };
            self.cache.put(&k.record, cached, existing.now, ticket);
        }
        h
    }

    /// A duplicate of an in-flight request: answers 409 once the wait is
    /// over (or was never asked for), else sleeps until it is worth reading
    /// the record again.
    async fn wait_for_change<'w>(
        &'w self,
        k: &Keyed<'_>,
        waiting: &mut Waiting<'w>,
        notified: Option<Notified<'_>>,
        lease_remaining: Duration,
    ) -> ControlFlow<Handled> {
        let now = Instant::now();
        if now >= waiting.deadline {
            return ControlFlow::Break(conflict(lease_remaining));
        }
        let Some(notified) = notified else {
            // First conflict: register, then read again with the
            // wake-up armed.
            match self.waiters.register(k.wait_id()) {
                Some(g) => waiting.guard = Some(g),
                None => return ControlFlow::Break(conflict(lease_remaining)),
            }
            return ControlFlow::Continue(());
        };
        // Sleep until the key changes, the lease runs out (then
        // take over as any request would) or the wait ends.
        let until = waiting
            .deadline
            .min(now + lease_remaining + Duration::from_millis(5));
        tokio::select! {
            () = notified => {}
            () = tokio::time::sleep_until(until.into()) => {}
        }
        ControlFlow::Continue(())
    }

    /// Takes over (or reclaims) the key with a fenced write. `None`: the
    /// record changed since it was read, and the race was lost.
    async fn replace(
        &self,
        k: &Keyed<'_>,
        owner: OwnerToken,
        replace: Replace,
    ) -> Result<Option<Claim>, StoreError> {
        let policy = &k.route.policy;
        let claim = self
            .timed(
                k,
                "replace",
                self.store.replace(
                    &k.record,
                    &k.fingerprint,
                    owner,
                    replace,
                    policy.lease,
                    policy.retention,
                ),
            )
            .await?;
        if let (Some(claim), Replace::TakeOver(previous)) = (&claim, replace) {
            self.metrics.takeover();
            warn!(
                key = %k.record.key,
                attempt = claim.attempt,
                previous_owner = %previous.as_uuid(),
                "took over a claim whose lease expired; forwarding again"
            );
        }
        Ok(claim)
    }

    /// Runs a store operation, recording its duration in the metrics and
    /// in the request's access-log timings.
    pub(super) async fn timed<T>(
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

    /// The store failed before anything was forwarded.
    pub(super) async fn store_failed(&self, k: &Keyed<'_>, e: StoreError) -> Handled {
        match self.config.store.on_store_error {
            OnStoreError::Reject => {
                warn!(key = %k.record.key, error = %e, "store unavailable: refusing the keyed request (fail closed)");
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
                    key = %k.record.key,
                    error = %e,
                    "store unavailable: forwarding UNPROTECTED (on_store_error = pass_through); a retry may execute twice"
                );
                let mut req =
                    match self.forward_request(&k.parts, full(k.body.clone()), &k.client, None) {
                        Ok(r) => r,
                        Err(e) => {
                            return Handled::problem(
                                Problem::unforwardable(&e),
                                Outcome::StoreError,
                            )
                        }
                    };
                // Unprotected here is exactly when an upstream that
                // deduplicates on the derived key needs it.
                if let Some((name, value)) = k.derived_key() {
                    req.headers_mut().insert(name, value);
                }
                let mut h = self.forward_streaming(req).await;
                h.outcome = Outcome::StoreError;
                h
            }
        }
    }
}

/// A 409 for a duplicate of a request in flight, retryable when its lease
/// runs out.
pub(super) fn conflict(lease_remaining: Duration) -> Handled {
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

/// A 422 for a key reused with a different request.
fn mismatch(k: &Keyed<'_>) -> Handled {
    Handled::problem(
        Problem::new(
            ProblemKind::KeyReused,
            format!(
                "the key {} was first used with a different request (method, path, query or body)",
                k.record.key
            ),
        ),
        Outcome::Mismatch,
    )
}

/// A replay: the stored status, headers and body bytes, marked replayed
/// and, when known, with the record's `Idempotency-Key-Expires`.
fn replay(stored: Option<&StoredResponse>, expires: Option<&HeaderValue>) -> Handled {
    let mut h = match stored {
        Some(
            stored @ StoredResponse {
                body: Some(body), ..
            },
        ) => {
            // The headers carry the expiry already.
            let mut resp = Response::new(full(body.clone()));
            *resp.status_mut() = replay_status(stored.status);
            *resp.headers_mut() = replay_headers(stored, expires);
            return Handled::new(resp, Outcome::Replayed);
        }
        None => Handled::problem(
            Problem::new(
                ProblemKind::StoreUnavailable,
                "the stored response could not be read",
            )
            .retry_after(1),
            Outcome::StoreError,
        ),
        Some(stored) => {
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
            Handled::new(resp, Outcome::Replayed)
        }
    };
    if let Some(v) = expires {
        h.response.headers_mut().insert(EXPIRES, v.clone());
    }
    h
}

/// The stored status (a stored value that is not one, impossible from
/// our own writes, answers 502).
fn replay_status(status: u16) -> StatusCode {
    StatusCode::from_u16(status).unwrap_or(StatusCode::BAD_GATEWAY)
}

/// A replay's headers: the stored ones in order, repeated ones kept (a
/// name or value that is no longer valid is left out), then
/// `Idempotency-Replayed` and, when known, `Idempotency-Key-Expires`.
fn replay_headers(stored: &StoredResponse, expires: Option<&HeaderValue>) -> HeaderMap {
    let mut headers = HeaderMap::with_capacity(stored.headers.len() + 2);
    for (name, value) in &stored.headers {
        if let (Ok(n), Ok(v)) = (
            HeaderName::from_bytes(name.as_bytes()),
            HeaderValue::from_maybe_shared(value.clone()),
        ) {
            headers.append(n, v);
        }
    }
    headers.insert(REPLAYED, HeaderValue::from_static("true"));
    if let Some(v) = expires {
        headers.insert(EXPIRES, v.clone());
    }
    headers
}
