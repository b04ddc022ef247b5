//! The retention sweeper: deletes expired records in bounded batches.
//!
//! Records past retention are already treated as absent by the claim, so
//! the sweeper only reclaims space; it never changes an answer. Each batch
//! is one short statement (`FOR UPDATE SKIP LOCKED`, so replicas sweeping
//! at once split the work instead of queueing on each other's locks) that
//! starts where the previous batch of the pass stopped, in expiry order, so
//! a batch costs the same at the end of a large backlog as at its start. A
//! record skipped because it was locked is left to the next pass. A pass
//! may pause between batches (`[sweeper] pause`). Measurements and the
//! reasoning behind the defaults: docs/retention.md.

use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use crate::config::SweeperConfig;
use crate::metrics::Metrics;
use crate::store::{Store, StoreError};

/// One full pass without pauses: batches until a batch comes back short.
/// Returns the number of records deleted.
pub async fn sweep_once(
    store: &Store,
    metrics: &Metrics,
    batch_size: u32,
) -> Result<u64, StoreError> {
    sweep_paced(store, metrics, batch_size, Duration::ZERO).await
}

/// One full pass: batches of `batch_size` until a batch comes back short,
/// sleeping `pause` between batches. Returns the number of records deleted.
pub async fn sweep_paced(
    store: &Store,
    metrics: &Metrics,
    batch_size: u32,
    pause: Duration,
) -> Result<u64, StoreError> {
    let mut total = 0;
    let mut from = None;
    loop {
        let t = Instant::now();
        let batch = store.sweep_batch(batch_size, from).await?;
        let elapsed = t.elapsed();
        let n = batch.deleted;
        from = batch.last_expiry.or(from);
        metrics.store("sweep", elapsed);
        metrics.swept(n);
        debug!(
            deleted = n,
            elapsed_us = u64::try_from(elapsed.as_micros()).unwrap_or(u64::MAX),
            "sweeper: batch"
        );
        total += n;
        if n < u64::from(batch_size) {
            return Ok(total);
        }
        if pause.is_zero() {
            // Yield between batches so a large backlog does not starve claims.
            tokio::task::yield_now().await;
        } else {
            tokio::time::sleep(pause).await;
        }
    }
}

/// One pass as configured (`batch_size`, `pause`).
pub async fn sweep_configured(
    store: &Store,
    metrics: &Metrics,
    config: &SweeperConfig,
) -> Result<u64, StoreError> {
    sweep_paced(store, metrics, config.batch_size, config.pause).await
}

/// Sweeps every `interval` until shutdown; a pass in progress stops at
/// shutdown too (between statements or mid-batch: each batch commits alone).
pub async fn run(
    store: Store,
    metrics: std::sync::Arc<Metrics>,
    config: SweeperConfig,
    stop: CancellationToken,
) {
    loop {
        tokio::select! {
            () = tokio::time::sleep(config.interval) => {}
            () = stop.cancelled() => return,
        }
        let result = tokio::select! {
            r = sweep_configured(&store, &metrics, &config) => r,
            () = stop.cancelled() => return,
        };
        match result {
            Ok(0) => debug!("sweeper: nothing expired"),
            Ok(n) => info!(deleted = n, "sweeper: deleted expired records"),
            Err(e) => warn!(error = %e, "sweeper pass failed; retrying next interval"),
        }
    }
}
