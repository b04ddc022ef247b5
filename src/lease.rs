//! Lease renewal while an owned upstream call is in flight.
//!
//! The owner renews about every third of the lease with a fenced UPDATE.
//! A short lease therefore means a fast takeover after a crash without
//! limiting how long an upstream call may run. Renewal runs beside the
//! upstream call (not between its polls), so a slow database never delays
//! a response; it ends when the call ends, and the call is bounded by the
//! upstream timeout. A renewal that finds the lease lost stops renewing but
//! does not abort the call: aborting would only make its outcome unknown.

use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use crate::idempotency::{IdempotencyKey, OwnerToken, TenantId};
use crate::metrics::Metrics;
use crate::store::Store;

/// The claim being kept alive.
pub struct LeaseHolder<'a> {
    /// The store to renew in.
    pub store: &'a Store,
    /// Where renewals are counted.
    pub metrics: &'a Metrics,
    /// The claim's tenant.
    pub tenant: &'a TenantId,
    /// The claim's key.
    pub key: &'a IdempotencyKey,
    /// Our owner token.
    pub owner: OwnerToken,
    /// The route's lease.
    pub lease: Duration,
}

/// Renewal period for a lease: a third of it, at least 50 ms.
pub fn renewal_period(lease: Duration) -> Duration {
    (lease / 3).max(Duration::from_millis(50))
}

impl LeaseHolder<'_> {
    /// Runs `fut` to completion, renewing the lease meanwhile. Returns its
    /// output and whether a renewal found the lease lost.
    pub async fn renew_while<F: Future>(&self, fut: F) -> (F::Output, bool) {
        let lost = AtomicBool::new(false);
        let period = renewal_period(self.lease);
        let renew = async {
            loop {
                tokio::time::sleep(period).await;
                let started = Instant::now();
                let result = self
                    .store
                    .renew(self.tenant, self.key, self.owner, self.lease)
                    .await;
                self.metrics.store("renew", started.elapsed());
                match result {
                    Ok(true) => self.metrics.renewal("ok"),
                    Ok(false) => {
                        self.metrics.renewal("lost");
                        tracing::warn!(
                            key = %self.key,
                            "lease lost while the upstream call is in flight; the call continues, its result will not be stored"
                        );
                        lost.store(true, Ordering::Relaxed);
                        return;
                    }
                    Err(e) => {
                        // Keep trying: the fence decides in the end.
                        self.metrics.renewal("error");
                        tracing::warn!(key = %self.key, error = %e, "lease renewal failed");
                    }
                }
            }
        };
        tokio::pin!(fut);
        let out = tokio::select! {
            biased;
            out = &mut fut => out,
            () = renew => fut.await,
        };
        (out, lost.load(Ordering::Relaxed))
    }
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
}
