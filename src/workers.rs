//! The proxy's worker threads: one single-threaded runtime per CPU, each
//! accepting from the proxy listener and serving its connections to the
//! end, as nginx runs its worker processes.
//!
//! A request on a worker stays on that thread: its connection, the task
//! that owns its claim, and the upstream connection it is forwarded on
//! (each worker has its own upstream pool and its own share of the database
//! pool, both found through [`lane`]). Handing
//! a request from one task to another then costs a local queue push rather
//! than waking a thread on another core, and nothing is stolen between
//! threads. The process's other work (admin endpoints, renewals, group
//! commit, the sweeper, reloads) runs on the main runtime.
//!
//! Everything the workers run is `Send`, so tasks and connections may still
//! cross threads (a worker whose database share is busy borrows another
//! thread's idle connection);
//! the split is for speed, not correctness. For that reason a worker's
//! runtime is kept until the whole process has drained, not only its own
//! listener ([`Workers::release`]): a database connection driven by it may
//! still carry another worker's completion.

use std::cell::Cell;
use std::future::Future;
use std::num::NonZeroUsize;

use tokio_util::sync::CancellationToken;

/// The variable that sets the number of workers (tokio's own name for it).
pub const ENV_VAR: &str = "TOKIO_WORKER_THREADS";

thread_local! {
    static LANE: Cell<Option<usize>> = const { Cell::new(None) };
}

/// The worker this thread is (0-based), or `None` off the workers (the
/// main runtime, the blocking pool, tests).
pub fn lane() -> Option<usize> {
    LANE.with(Cell::get)
}

/// Makes this thread worker `lane` (`None`: no worker), for tests of what
/// depends on the lane.
#[cfg(test)]
pub(crate) fn set_lane(lane: Option<usize>) {
    LANE.with(|l| l.set(lane));
}

/// The number of workers: `TOKIO_WORKER_THREADS` when set, else one per CPU
/// available to the process (affinity and cgroup quota included). A value
/// that is not a positive whole number is refused.
pub fn count_from_env() -> Result<usize, String> {
    match std::env::var_os(ENV_VAR) {
        None => Ok(available()),
        Some(value) => match value.to_str().and_then(|v| v.trim().parse::<usize>().ok()) {
            Some(n) if n > 0 => Ok(n),
            _ => Err(format!(
                "{ENV_VAR} must be a whole number of worker threads, 1 or more (got {value:?})"
            )),
        },
    }
}

/// One per CPU available to the process.
pub fn available() -> usize {
    std::thread::available_parallelism().map_or(1, NonZeroUsize::get)
}

/// Running worker threads. Dropping it releases them (see
/// [`release`](Self::release)).
pub struct Workers {
    release: CancellationToken,
}

impl Workers {
    /// Starts `count` threads named `idemproxy-worker-N`, each running
    /// `work(N)` on a runtime of its own and then keeping that runtime (and
    /// every task still on it) until released. A release cuts short a
    /// `work` that has not ended.
    pub fn start<F, Fut>(count: usize, work: F) -> std::io::Result<Self>
    where
        F: Fn(usize) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = ()> + 'static,
    {
        let release = CancellationToken::new();
        let work = std::sync::Arc::new(work);
        for lane in 0..count.max(1) {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .thread_name(format!("idemproxy-blocking-{lane}"))
                .build()?;
            let (work, release) = (work.clone(), release.clone());
            std::thread::Builder::new()
                .name(format!("idemproxy-worker-{lane}"))
                .spawn(move || {
                    LANE.with(|l| l.set(Some(lane)));
                    // This thread runs this runtime until it ends.
                    crate::timer::bind_thread();
                    runtime.block_on(async move {
                        // Released early (dropped without a drain): the
                        // work itself is cut short.
                        tokio::select! {
                            () = work(lane) => release.cancelled().await,
                            () = release.cancelled() => {}
                        }
                    });
                    // Dropping the runtime here cancels what is left on it.
                })?;
        }
        Ok(Workers { release })
    }

    /// Lets the workers end their runtimes: call once everything that may
    /// run on them (connections, owned work, database connections they
    /// drive) is done or given up.
    pub fn release(&self) {
        self.release.cancel();
    }
}

impl Drop for Workers {
    fn drop(&mut self) {
        self.release.cancel();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_worker_knows_its_lane_and_stays_until_released() {
        let (tx, rx) = std::sync::mpsc::channel();
        let ended = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let workers = {
            let ended = ended.clone();
            Workers::start(3, move |n| {
                let (tx, ended) = (tx.clone(), ended.clone());
                async move {
                    tx.send((n, lane())).unwrap();
                    let count_end = move || {
                        let ended = ended.clone();
                        scopeguard::guard((), move |()| {
                            ended.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                        })
                    };
                    // A task left on the runtime runs until the release.
                    let guard = count_end();
                    tokio::spawn(async move {
                        let _guard = guard;
                        std::future::pending::<()>().await;
                    });
                    // Work that never ends is cut short by the release.
                    if n == 2 {
                        let _guard = count_end();
                        std::future::pending::<()>().await;
                    }
                }
            })
            .unwrap()
        };
        let mut seen: Vec<_> = (0..3).map(|_| rx.recv().unwrap()).collect();
        seen.sort();
        assert_eq!(seen, vec![(0, Some(0)), (1, Some(1)), (2, Some(2))]);
        assert_eq!(lane(), None, "the test's own thread is no worker");
        std::thread::sleep(std::time::Duration::from_millis(50));
        assert_eq!(ended.load(std::sync::atomic::Ordering::SeqCst), 0);
        drop(workers);
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        while ended.load(std::sync::atomic::Ordering::SeqCst) < 4 {
            assert!(std::time::Instant::now() < deadline, "workers not released");
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
    }
}
