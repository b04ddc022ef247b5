//! The retention sweeper: deletes expired records in bounded batches.
//!
//! Records past retention are already treated as absent by the claim, so
//! the sweeper only reclaims space; it never changes an answer. Each batch
//! is one short statement (`FOR UPDATE SKIP LOCKED`, so replicas sweeping
//! at once split the work instead of queueing on each other's locks).

use std::time::Instant;

use tokio::sync::watch;
use tracing::{debug, info, warn};

use crate::config::SweeperConfig;
use crate::metrics::Metrics;
use crate::store::{Store, StoreError};

/// One full pass: batches until a batch comes back short. Returns the
/// number of records deleted.
pub async fn sweep_once(
    store: &Store,
    metrics: &Metrics,
    batch_size: u32,
) -> Result<u64, StoreError> {
    let mut total = 0;
    loop {
        let t = Instant::now();
        let n = store.sweep_batch(batch_size).await?;
        metrics.store("sweep", t.elapsed());
        metrics.swept(n);
        total += n;
        if n < u64::from(batch_size) {
            return Ok(total);
        }
        // Yield between batches so a large backlog does not starve claims.
        tokio::task::yield_now().await;
    }
}

/// Sweeps every `interval` until shutdown.
pub async fn run(
    store: Store,
    metrics: std::sync::Arc<Metrics>,
    config: SweeperConfig,
    mut shutdown: watch::Receiver<bool>,
) {
    loop {
        tokio::select! {
            () = tokio::time::sleep(config.interval) => {}
            () = crate::server::stopped(&mut shutdown) => return,
        }
        match sweep_once(&store, &metrics, config.batch_size).await {
            Ok(0) => debug!("sweeper: nothing expired"),
            Ok(n) => info!(deleted = n, "sweeper: deleted expired records"),
            Err(e) => warn!(error = %e, "sweeper pass failed; retrying next interval"),
        }
    }
}
