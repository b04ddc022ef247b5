//! Execution of an owned claim: forward once, then settle.
//!
//! The upstream result becomes an [`UpstreamOutcome`] (an answer and its
//! status, or what the failure proves: not sent, or unknown), and the pure
//! [`settle`] says what becomes of the claim: complete (store the
//! response), release (delete it, so a retry may run) or keep it in flight
//! until its lease expires. This module only acts on that decision.
//!
//! Completion is fenced by the owner token: if the lease was lost meanwhile,
//! the response still goes to this client (it is the truth of what the
//! upstream did) but nothing is overwritten. A completion the database did
//! not take is retried in the background, as work of the lifecycle, so the
//! client is not kept waiting and the drain still waits for it.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use bytes::{Bytes, BytesMut};
use http::header::EXPECT;
use http::{response, Response};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use tracing::{info, warn};

use super::admit::Keyed;
use super::forward::{response_from, stream_response, PrefixedBody};
use super::headers;
use super::keyed::conflict;
use super::problem::{Forwarded, Problem};
use super::upstream::{self, UpstreamError};
use super::{full, set_expires, Handled, Proxy};
use crate::backoff::Backoff;
use crate::idempotency::{settle, RecordKey, Settlement, UpstreamOutcome};
use crate::lease::{renewal_period, Renewal};
use crate::metrics::{Metrics, Outcome};
use crate::store::{Claim, Store, StoreError, StoredResponse};

/// What the upstream exchange of an owned claim produced.
enum Exchanged {
    /// A status that [`settle`] releases (`release_on`): passed on as it
    /// streams, not stored.
    Release(Response<Incoming>),
    /// A response whose body fits `max_stored_response`.
    Whole(response::Parts, Bytes),
    /// A response whose body does not: the prefix read so far and the rest.
    TooLarge(response::Parts, Bytes, Incoming),
}

impl Proxy {
    /// Forwards an owned claim once and settles it. `since`: when the
    /// statement that took the claim was sent (its lease runs from no
    /// earlier).
    pub(super) async fn execute(&self, k: &Keyed<'_>, claim: Claim, since: Instant) -> Handled {
        let policy = &k.route.policy;
        // Boxed, and built only for a late answer: the common claim, back
        // well within its lease, pays one clock read.
        let since = if since.elapsed() < renewal_period(policy.lease) {
            since
        } else {
            match Box::pin(self.confirm_lease(k, claim, since)).await {
                Ok(since) => since,
                Err(refused) => return refused,
            }
        };
        let in_flight = self.metrics.in_flight().clone();
        in_flight.inc();
        // The in-flight gauge must come down on every path, cancellation
        // included.
        let _in_flight = scopeguard::guard(in_flight, |g| {
            g.dec();
        });
        let mut req = match self.forward_request(
            &k.parts,
            full(k.body.clone()),
            &k.client,
            Some(claim.attempt),
        ) {
            Ok(r) => r,
            Err(e) => {
                // Nothing was sent: released, as settle() does for NotSent.
                self.release(k, claim).await;
                return Handled::problem(Problem::unforwardable(&e), Outcome::Released);
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
        // Boxed, like every sizeable step below: the futures of the
        // upstream exchange and of the store's completion each run to
        // kilobytes, and laid out inline they would all sit in every
        // request's task at once, the whole time it is in flight (the peak
        // memory of many requests at the upstream).
        let exchange = Box::pin(async {
            let resp = self.upstream.send(req).await?;
            // Settled on the status, before the body is read: a released
            // answer streams on unbuffered, only a completed one is read
            // (bounded) to be stored.
            let answered = UpstreamOutcome::Answered(resp.status().as_u16());
            if settle(answered, &release_on) == Settlement::Release {
                return Ok(Exchanged::Release(resp));
            }
            read_limited(resp, max_stored).await
        });
        let bounded = async {
            match crate::timer::timeout(timeout, exchange).await {
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
            .hold(&k.record, claim.owner, k.fingerprint, policy.lease, since);
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
            _ => {
                // Now, not when this function returns (after a release's
                // round trip): a shadowed guard would live on.
                drop(renewal);
                None
            }
        };
        let mut handled = match result {
            Err(e) => self.unanswered(k, claim, e, &release_on).await,
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
                let (outcome, expires) = Box::pin(self.complete(k, claim, stored, renewal)).await;
                let mut resp = response_from(parts, full(body));
                if let Some(at) = expires {
                    set_expires(&mut resp, at);
                }
                Handled::new(resp, outcome)
            }
            Ok(Exchanged::TooLarge(parts, prefix, rest)) => {
                warn!(
                    key = %k.record.key,
                    status = parts.status.as_u16(),
                    limit = max_stored,
                    "response body exceeds max_stored_response: passed on, stored without its body; replays will get 502 response-not-stored"
                );
                let stored = StoredResponse {
                    status: parts.status.as_u16(),
                    headers: headers::capture(&parts.headers),
                    body: None,
                };
                let (outcome, _) = Box::pin(self.complete(k, claim, stored, renewal)).await;
                let body = PrefixedBody::new(prefix, rest);
                Handled::new(response_from(parts, body.boxed()), outcome)
            }
        };
        handled.attempt = Some(claim.attempt);
        handled
    }

    /// Makes sure the lease is still ours before anything is forwarded.
    ///
    /// A lease runs from when the database took the claim, which is no
    /// earlier than `since`. An answer that came back late (the database
    /// stalled, or this process was descheduled or paused while it waited)
    /// may come back to a lease that has run out, and to a key a retry
    /// elsewhere has already taken over: forwarding then would execute the
    /// request twice. So an answer later than a renewal period is renewed
    /// first, fenced by the owner token, and a claim found lost is given up
    /// unforwarded (`409`: the key is another attempt's now). Returns when
    /// the lease now runs from.
    async fn confirm_lease(
        &self,
        k: &Keyed<'_>,
        claim: Claim,
        mut since: Instant,
    ) -> Result<Instant, Handled> {
        let lease = k.route.policy.lease;
        let period = renewal_period(lease);
        let mut renewals = 0;
        while since.elapsed() >= period {
            // Each renewal is bounded by `store.timeout`; a process stalled
            // again and again in between gives up rather than loop.
            if renewals == 3 {
                let e = StoreError::Timeout(since.elapsed());
                return Err(Box::pin(self.store_failed(k, e)).await);
            }
            renewals += 1;
            let sent = Instant::now();
            let renewed = self
                .timed(k, "renew", self.store.renew(&k.record, claim.owner, lease))
                .await;
            match renewed {
                Ok(true) => since = sent,
                Ok(false) => {
                    self.metrics.lost_lease();
                    warn!(
                        key = %k.record.key,
                        attempt = claim.attempt,
                        waited_ms = since.elapsed().as_millis() as u64,
                        "the claim's lease ran out before it could be forwarded, and another attempt owns the key now: not forwarded"
                    );
                    let mut h = conflict(lease);
                    h.outcome = Outcome::LostLease;
                    return Err(h);
                }
                Err(e) => return Err(Box::pin(self.store_failed(k, e)).await),
            }
        }
        Ok(since)
    }

    /// The exchange produced no response: settles the claim by what the
    /// failure proves (never sent: release; maybe executed: keep).
    async fn unanswered(
        &self,
        k: &Keyed<'_>,
        claim: Claim,
        e: UpstreamError,
        release_on: &[u16],
    ) -> Handled {
        let problem = Problem::upstream(
            &e,
            Forwarded::Claimed {
                lease: k.route.policy.lease,
            },
        );
        match settle(e.outcome(), release_on) {
            Settlement::Release => {
                // The chain (address, OS error) is for the operator only.
                warn!(key = %k.record.key, attempt = claim.attempt, error = %e, "upstream not reached: the claim is released");
                self.release(k, claim).await;
                Handled::problem(problem, Outcome::Released)
            }
            // With no response there is nothing to complete: anything but a
            // release leaves the claim to expire with its lease.
            Settlement::KeepInFlight | Settlement::Complete => {
                warn!(key = %k.record.key, attempt = claim.attempt, error = %e, "outcome unknown: the claim stays in flight until its lease expires");
                Handled::problem(problem, Outcome::Claimed)
            }
        }
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
                    &k.record,
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
                    key = %k.record.key,
                    attempt = claim.attempt,
                    "lease lost: another attempt owns this key now; this response goes to its client but is not stored"
                );
                (Outcome::LostLease, None)
            }
            Err(e) => {
                warn!(key = %k.record.key, error = %e, "could not store the response; retrying in the background");
                // Work of the lifecycle: the drain waits for it.
                self.lifecycle.spawn_work(retry_completion(
                    self.store.clone(),
                    self.metrics.clone(),
                    Completion {
                        record: k.record.clone(),
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
                    .release(&k.record, claim.owner, wait_id.as_deref()),
            )
            .await;
        if let Some(id) = &wait_id {
            self.waiters.wake(id);
        }
        if let Err(e) = result {
            warn!(key = %k.record.key, error = %e, "could not release the claim; it will expire with its lease");
        }
    }
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
    record: RecordKey,
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
                &c.record,
                c.claim.owner,
                &c.stored,
                c.retention,
                c.wait_id.as_deref(),
            )
            .await;
        match result {
            Ok(Some(_)) => {
                info!(key = %c.record.key, "stored the response after a retry");
                return;
            }
            Ok(None) => {
                metrics.lost_lease();
                warn!(key = %c.record.key, attempt = c.claim.attempt, "lease lost before the response could be stored");
                return;
            }
            Err(e) => {
                tracing::debug!(key = %c.record.key, error = %e, "completion retry failed");
            }
        }
    }
    warn!(key = %c.record.key, "gave up storing the response; the claim will expire with its lease");
}
