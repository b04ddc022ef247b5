//! Who owns the process's work, and how it ends.
//!
//! Two kinds of task run in a proxy:
//!
//! * **Work**: a request that owns (or may come to own) a claim, and a
//!   completion that is being retried in the background. Each runs in a
//!   task of its own, not inside its client's connection, because it must
//!   outlive its client: when a client gives up, the upstream call goes on,
//!   the lease stays renewed and the response is stored, so that the
//!   client's retry replays it instead of taking over an abandoned claim and
//!   executing the request a second time. The same holds on SIGTERM: a
//!   rolling deploy must not drop a claim whose upstream call is running.
//! * **Background**: the lease renewer, the key listener, the sweeper, the
//!   store monitor, migrations, the admin listener. They serve the work and
//!   stop after it.
//!
//! Shutdown therefore has two steps, one token each. **Drain** (SIGTERM):
//! `/readyz` turns 503, the proxy listener closes, open connections finish
//! their requests, and every work task is waited for, all within
//! `server.shutdown_grace`. **Stop**: the background tasks end. Work still
//! running at the grace is cut when the process exits, and its claims
//! expire as a crashed owner's would (never renewed, never completed).

use std::future::Future;
use std::time::Duration;

use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{info, warn};

/// The tokens and trackers of one process (cheap to clone: all handles).
#[derive(Clone, Default)]
pub struct Lifecycle {
    drain: CancellationToken,
    stop: CancellationToken,
    work: TaskTracker,
    background: TaskTracker,
}

impl Lifecycle {
    /// A process that is neither draining nor stopped.
    pub fn new() -> Self {
        Self::default()
    }

    /// Cancelled when draining starts.
    pub fn drain_token(&self) -> CancellationToken {
        self.drain.clone()
    }

    /// Cancelled when background tasks must end (after the drain).
    pub fn stop_token(&self) -> CancellationToken {
        self.stop.clone()
    }

    /// Whether draining has started.
    pub fn draining(&self) -> bool {
        self.drain.is_cancelled()
    }

    /// Spawns work the drain waits for.
    pub fn spawn_work<F>(&self, task: F) -> JoinHandle<F::Output>
    where
        F: Future + Send + 'static,
        F::Output: Send + 'static,
    {
        self.work.spawn(task)
    }

    /// Work tasks running now.
    pub fn work_in_progress(&self) -> usize {
        self.work.len()
    }

    /// Spawns a background task; it should end when
    /// [`stop_token`](Self::stop_token) is cancelled.
    pub fn spawn_background<F>(&self, task: F) -> JoinHandle<F::Output>
    where
        F: Future + Send + 'static,
        F::Output: Send + 'static,
    {
        self.background.spawn(task)
    }

    /// Starts draining; the listeners see it through their drain token.
    pub fn start_drain(&self) {
        self.drain.cancel();
    }

    /// Waits for every work task until `deadline`; `false` if some were
    /// still running then.
    pub async fn drain_work(&self, deadline: Instant) -> bool {
        self.work.close();
        let running = self.work.len();
        if running > 0 {
            info!(
                running,
                "waiting for requests that own a claim and for completion retries"
            );
        }
        if tokio::time::timeout_at(deadline, self.work.wait())
            .await
            .is_ok()
        {
            return true;
        }
        warn!(
            still_running = self.work.len(),
            "shutdown grace elapsed with owned requests still running: they are cut, and their claims expire with their leases"
        );
        false
    }

    /// Stops the background tasks and waits for them (briefly: each only
    /// has to notice its token).
    pub async fn stop_background(&self, bound: Duration) {
        self.stop.cancel();
        self.background.close();
        if tokio::time::timeout(bound, self.background.wait())
            .await
            .is_err()
        {
            warn!("background tasks did not stop in time");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn the_drain_waits_for_work_but_not_past_its_deadline() {
        let life = Lifecycle::new();
        let quick = life.spawn_work(tokio::time::sleep(Duration::from_secs(1)));
        let started = Instant::now();
        assert!(life.drain_work(started + Duration::from_secs(5)).await);
        assert_eq!(started.elapsed(), Duration::from_secs(1));
        quick.await.unwrap();

        let life = Lifecycle::new();
        let _slow = life.spawn_work(tokio::time::sleep(Duration::from_secs(60)));
        let started = Instant::now();
        assert!(!life.drain_work(started + Duration::from_secs(5)).await);
        assert_eq!(started.elapsed(), Duration::from_secs(5));
        assert_eq!(life.work_in_progress(), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn background_tasks_end_on_stop() {
        let life = Lifecycle::new();
        let stop = life.stop_token();
        let task = life.spawn_background(async move { stop.cancelled().await });
        life.stop_background(Duration::from_secs(1)).await;
        assert!(task.is_finished());
        assert!(!life.draining(), "stopping is not draining");
    }
}
