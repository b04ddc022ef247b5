//! Lease renewal while owned upstream calls are in flight.
//!
//! An owner renews its lease about every third of it with a fenced UPDATE,
//! so a short lease means a fast takeover after a crash without limiting
//! how long an upstream call may run. Renewal is per process, not per
//! request: one task ticks and renews every claim that is due in a single
//! statement (rows locked in `(tenant, key)` order, like every batch), so
//! a thousand slow calls cost one UPDATE per tick, not a thousand.
//!
//! Renewal runs beside the upstream call, never between its polls, so a
//! slow database never delays a response. A claim leaves the renewer when
//! its response is stored (or, if its outcome is unknown, when its call
//! ends: such a claim is left to expire), and calls are bounded by the
//! upstream timeout. A renewal
//! that finds the lease lost stops renewing it but does not abort the call:
//! aborting would only make its outcome unknown.
//!
//! What the renewer holds is also what this process knows for certain about
//! a key without asking the database: a claim it holds, whose lease it took
//! or last renewed at `since`, cannot have expired in the database before
//! `since + lease` (the database started the lease no earlier than the
//! statement was sent). Until then no other attempt can own the key, so a
//! duplicate arriving here is answered from [`Renewer::held_here`] (409, or
//! 422 for another fingerprint), as the database would answer it, without a
//! round trip. A lost lease, a lease past that point (renewals failing), or
//! a claim no longer renewed (outcome unknown, left to expire) is not held
//! here: such duplicates read the record as before. If the database then
//! finds the lease expired while the claim is still renewed here (renewals
//! that could not land while the database stalled), a duplicate here does
//! not take it over ([`Renewer::running_here`]): its owner is alive, and a
//! takeover would forward the request a second time while the first is in
//! flight. It gets `409` (or waits, on a route with `wait`) until the
//! original's response is stored or a renewal finds the lease lost.
//!
//! The reasoning trusts this process's monotonic clock, as the lease check
//! before forwarding does; where it stood still while the database's ran
//! on (a suspended VM), the worst a duplicate gets from here is a `409`
//! where the database would have replayed or let it take over, and its
//! retry reads again once the renewal has found the lease lost.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;
use tracing::warn;

use crate::idempotency::{Fingerprint, OwnerToken, RecordKey};
use crate::metrics::Metrics;
use crate::store::{RenewItem, Store};

/// Renewal period for a lease: a third of it, at least 50 ms.
pub fn renewal_period(lease: Duration) -> Duration {
    (lease / 3).max(Duration::from_millis(50))
}

/// How often the renewer looks for due claims, given the shortest lease
/// of any route: half its renewal period, so a claim is renewed between a
/// third and a half of its lease after the last renewal.
pub fn tick_for(shortest_lease: Duration) -> Duration {
    (renewal_period(shortest_lease) / 2).max(Duration::from_millis(25))
}

struct Entry {
    record: RecordKey,
    owner: OwnerToken,
    fingerprint: Fingerprint,
    lease: Duration,
    /// When the lease was taken or last renewed (the statement was sent):
    /// it runs in the database until no earlier than `since + lease`.
    since: Instant,
    lost: Arc<AtomicBool>,
}

impl Entry {
    fn due(&self) -> Instant {
        self.since + renewal_period(self.lease)
    }
}

/// The claims held, and which of them holds each key. (A key is held twice
/// only when this process's claim on it was superseded, by another replica's
/// takeover, and this process then took the key over from that owner while
/// its own first call still ran: the key then names the newer. It never
/// takes over its own running claim: [`Renewer::running_here`].)
#[derive(Default)]
struct Held {
    entries: HashMap<u64, Entry>,
    by_key: HashMap<RecordKey, u64>,
}

/// A duplicate's answer, known here: the key is held by this process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HeldHere {
    /// The fingerprint its claim was taken with.
    pub fingerprint: Fingerprint,
    /// How long its lease runs on, at least.
    pub lease_remaining: Duration,
}

/// The process's lease renewer.
pub struct Renewer {
    store: Store,
    metrics: Arc<Metrics>,
    held: Mutex<Held>,
    next_id: AtomicU64,
    /// The tick, in microseconds: a reload may shorten it (see
    /// [`Renewer::tick_at_most`]).
    tick_micros: AtomicU64,
    /// Wakes the ticker when the tick is shortened.
    tick_shortened: tokio::sync::Notify,
}

/// A claim held by the renewer; leaves it on drop.
pub struct Renewal {
    renewer: Arc<Renewer>,
    id: u64,
    lost: Arc<AtomicBool>,
}

impl Renewal {
    /// Whether a renewal found the lease lost.
    pub fn lost(&self) -> bool {
        self.lost.load(Ordering::SeqCst)
    }
}

impl Drop for Renewal {
    fn drop(&mut self) {
        let mut held = self.renewer.lock();
        if let Some(e) = held.entries.remove(&self.id) {
            if held.by_key.get(&e.record) == Some(&self.id) {
                held.by_key.remove(&e.record);
            }
        }
    }
}

impl Renewer {
    /// A renewer that looks for due claims every `tick`.
    pub fn new(store: Store, metrics: Arc<Metrics>, tick: Duration) -> Self {
        Renewer {
            store,
            metrics,
            held: Mutex::new(Held::default()),
            next_id: AtomicU64::new(0),
            tick_micros: AtomicU64::new(micros(tick)),
            tick_shortened: tokio::sync::Notify::new(),
        }
    }

    /// How often it looks for due claims now.
    pub fn tick(&self) -> Duration {
        Duration::from_micros(self.tick_micros.load(Ordering::Relaxed))
    }

    /// Ticks at least every `tick` from now on (a reload that brings a
    /// shorter lease). It never ticks slower: claims taken under the
    /// previous configuration may still be in flight with their leases.
    pub fn tick_at_most(&self, tick: Duration) {
        let before = self.tick_micros.fetch_min(micros(tick), Ordering::Relaxed);
        if micros(tick) < before {
            self.tick_shortened.notify_one();
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Held> {
        self.held.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Keeps a claim alive until the returned guard is dropped. `since`:
    /// when its lease began (or was last renewed); the first renewal is due
    /// a renewal period after that, not after this call. `fingerprint`:
    /// the one it was claimed with, which a duplicate must match.
    pub fn hold(
        self: &Arc<Self>,
        record: &RecordKey,
        owner: OwnerToken,
        fingerprint: Fingerprint,
        lease: Duration,
        since: Instant,
    ) -> Renewal {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let lost = Arc::new(AtomicBool::new(false));
        let entry = Entry {
            record: record.clone(),
            owner,
            fingerprint,
            lease,
            since,
            lost: lost.clone(),
        };
        let mut held = self.lock();
        held.entries.insert(id, entry);
        held.by_key.insert(record.clone(), id);
        drop(held);
        Renewal {
            renewer: self.clone(),
            id,
            lost,
        }
    }

    /// Whether `owner`'s claim on `record` is held by this process and not
    /// known lost, however long ago its lease was last renewed: its call,
    /// or the storing of its response, is still running here. The database
    /// may find its lease expired (renewals that could not land while it
    /// stalled), but its owner is alive: a duplicate here must not take it
    /// over, which would forward the request a second time while the first
    /// is still in flight.
    pub fn running_here(&self, record: &RecordKey, owner: OwnerToken) -> bool {
        let held = self.lock();
        held.by_key
            .get(record)
            .and_then(|id| held.entries.get(id))
            .is_some_and(|e| e.owner == owner && !e.lost.load(Ordering::SeqCst))
    }

    /// Claims currently held.
    pub fn held(&self) -> usize {
        self.lock().entries.len()
    }

    /// Whether this process holds `record` in flight, with a lease not
    /// lost and known to run on (see the module's notes): then no other
    /// attempt can own the key, and a duplicate's answer is known here.
    pub fn held_here(&self, record: &RecordKey) -> Option<HeldHere> {
        let held = self.lock();
        let e = held.entries.get(held.by_key.get(record)?)?;
        if e.lost.load(Ordering::SeqCst) {
            return None;
        }
        let lease_remaining = (e.since + e.lease).checked_duration_since(Instant::now())?;
        Some(HeldHere {
            fingerprint: e.fingerprint,
            lease_remaining,
        })
    }

    /// Renews every due claim in one statement. Returns how many were sent.
    pub async fn renew_due(&self) -> usize {
        let now = Instant::now();
        let due: Vec<(u64, RenewItem)> = self
            .lock()
            .entries
            .iter()
            .filter(|(_, e)| e.due() <= now && !e.lost.load(Ordering::SeqCst))
            .map(|(id, e)| {
                let item = RenewItem {
                    tenant: e.record.tenant.as_str().to_owned(),
                    key: e.record.key.as_str().to_owned(),
                    owner: e.owner.as_uuid(),
                    lease_ms: i64::try_from(e.lease.as_millis()).unwrap_or(i64::MAX),
                };
                (*id, item)
            })
            .collect();
        if due.is_empty() {
            return 0;
        }
        let (ids, items): (Vec<u64>, Vec<RenewItem>) = due.into_iter().unzip();
        let started = Instant::now();
        let result = self.store.renew_batch(&items).await;
        self.metrics.store("renew", started.elapsed());
        match result {
            Ok(renewed) => {
                let mut held = self.lock();
                for (id, ok) in ids.iter().zip(renewed) {
                    // Gone already: its call ended meanwhile.
                    let Some(e) = held.entries.get_mut(id) else {
                        continue;
                    };
                    if ok {
                        self.metrics.renewal("ok");
                        e.since = started;
                    } else {
                        self.metrics.renewal("lost");
                        e.lost.store(true, Ordering::SeqCst);
                        warn!(
                            key = %e.record.key,
                            "lease lost while the upstream call is in flight; the call continues, its result will not be stored"
                        );
                    }
                }
            }
            Err(e) => {
                // Keep trying at the next tick: the fence decides in the end.
                for _ in &ids {
                    self.metrics.renewal("error");
                }
                warn!(error = %e, claims = ids.len(), "lease renewal failed");
            }
        }
        ids.len()
    }

    /// Ticks until shutdown.
    pub async fn run(self: Arc<Self>, stop: CancellationToken) {
        let mut ticker = tokio::time::interval(self.tick());
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = ticker.tick() => {
                    self.renew_due().await;
                }
                () = self.tick_shortened.notified() => {
                    // Claims due sooner than the old tick are renewed now.
                    self.renew_due().await;
                }
                () = stop.cancelled() => return,
            }
            if ticker.period() != self.tick() {
                ticker = tokio::time::interval(self.tick());
                ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                // An interval's first tick is immediate: the renewal just ran.
                ticker.reset();
            }
        }
    }
}

fn micros(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX).max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renews_about_every_third_of_the_lease() {
        assert_eq!(
            renewal_period(Duration::from_secs(30)),
            Duration::from_secs(10)
        );
        assert_eq!(
            renewal_period(Duration::from_millis(60)),
            Duration::from_millis(50)
        );
    }

    #[test]
    fn ticks_fast_enough_to_renew_before_half_the_lease() {
        for lease in [
            Duration::from_millis(300),
            Duration::from_secs(10),
            Duration::from_secs(30),
        ] {
            assert!(
                renewal_period(lease) + tick_for(lease) <= lease / 2 + Duration::from_millis(25)
            );
        }
    }
}
