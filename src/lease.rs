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

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;
use tracing::warn;

use crate::idempotency::{OwnerToken, RecordKey};
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
    item: RenewItem,
    lease: Duration,
    due: Instant,
    lost: Arc<AtomicBool>,
}

/// The process's lease renewer.
pub struct Renewer {
    store: Store,
    metrics: Arc<Metrics>,
    entries: Mutex<HashMap<u64, Entry>>,
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
        self.renewer.lock().remove(&self.id);
    }
}

impl Renewer {
    /// A renewer that looks for due claims every `tick`.
    pub fn new(store: Store, metrics: Arc<Metrics>, tick: Duration) -> Self {
        Renewer {
            store,
            metrics,
            entries: Mutex::new(HashMap::new()),
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

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Entry>> {
        self.entries.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Keeps a claim alive until the returned guard is dropped. `since`:
    /// when its lease began (or was last renewed); the first renewal is due
    /// a renewal period after that, not after this call.
    pub fn hold(
        self: &Arc<Self>,
        record: &RecordKey,
        owner: OwnerToken,
        lease: Duration,
        since: Instant,
    ) -> Renewal {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let lost = Arc::new(AtomicBool::new(false));
        self.lock().insert(
            id,
            Entry {
                item: RenewItem {
                    tenant: record.tenant.as_str().to_owned(),
                    key: record.key.as_str().to_owned(),
                    owner: owner.as_uuid(),
                    lease_ms: i64::try_from(lease.as_millis()).unwrap_or(i64::MAX),
                },
                lease,
                due: since + renewal_period(lease),
                lost: lost.clone(),
            },
        );
        Renewal {
            renewer: self.clone(),
            id,
            lost,
        }
    }

    /// Claims currently held.
    pub fn held(&self) -> usize {
        self.lock().len()
    }

    /// Renews every due claim in one statement. Returns how many were sent.
    pub async fn renew_due(&self) -> usize {
        let now = Instant::now();
        let due: Vec<(u64, RenewItem)> = self
            .lock()
            .iter()
            .filter(|(_, e)| e.due <= now && !e.lost.load(Ordering::SeqCst))
            .map(|(id, e)| (*id, e.item.clone()))
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
                let mut entries = self.lock();
                for (id, ok) in ids.iter().zip(renewed) {
                    // Gone already: its call ended meanwhile.
                    let Some(e) = entries.get_mut(id) else {
                        continue;
                    };
                    if ok {
                        self.metrics.renewal("ok");
                        e.due = started + renewal_period(e.lease);
                    } else {
                        self.metrics.renewal("lost");
                        e.lost.store(true, Ordering::SeqCst);
                        warn!(
                            key = %e.item.key,
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
