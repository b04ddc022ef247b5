//! The proxy's worker threads: one single-threaded runtime per CPU, each
//! accepting from the proxy listener and serving its connections to the
//! end, as nginx runs its worker processes.
//!
//! A request on a worker stays on that thread: its connection, the task
//! that owns its claim, and the upstream connection it is forwarded on
//! (each worker has its own upstream pool, its own share of the database
//! pool and its own group commit, all found through [`lane`]). Handing
//! a request from one task to another then costs a local queue push rather
//! than waking a thread on another core, and nothing is stolen between
//! threads. The process's other work (admin endpoints, renewals, the
//! sweeper, reloads) runs on the main runtime.
//!
//! Everything the workers run is `Send`, so tasks and connections may still
//! cross threads (a worker whose database share is busy borrows another
//! thread's idle connection);
//! the split is for speed, not correctness. For that reason a worker's
//! runtime is kept until the whole process has drained, not only its own
//! listener ([`Workers::release`]): a database connection driven by it may
//! still carry another worker's completion.
//!
//! Since a connection stays on the worker that serves it, the workers must
//! share the connections, not only the accept queue. Every worker is woken
//! by a connection arriving and the first one awake takes it; a client that
//! opens its connections in a burst (a connection pool, a load balancer)
//! would often find them all, or most, on one thread, whose core then
//! bounds the throughput while the other waits (seen with 64 connections
//! on two workers: anything from 64–0 to 32–32 from one burst to the next).
//! [`Spread`] counts each worker's connections, and one accepted by a
//! worker that serves two more than the least busy is handed to that one.

use std::cell::Cell;
use std::future::Future;
use std::num::NonZeroUsize;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use tokio::sync::mpsc;
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

/// The connections each worker serves, and the way to hand one to
/// another worker. Cheap to clone.
pub struct Spread<T> {
    live: Arc<[AtomicUsize]>,
    inboxes: Arc<[mpsc::UnboundedSender<(T, Served)>]>,
}

impl<T> Clone for Spread<T> {
    fn clone(&self) -> Self {
        Spread {
            live: self.live.clone(),
            inboxes: self.inboxes.clone(),
        }
    }
}

/// One connection counted on a worker, until it is dropped.
pub struct Served {
    live: Arc<[AtomicUsize]>,
    worker: usize,
}

impl Drop for Served {
    fn drop(&mut self) {
        self.live[self.worker].fetch_sub(1, Ordering::Relaxed);
    }
}

impl<T> Spread<T> {
    /// A spread over `count` workers, and each worker's inbox, by index.
    pub fn new(count: usize) -> (Self, Vec<mpsc::UnboundedReceiver<(T, Served)>>) {
        let (senders, receivers): (Vec<_>, Vec<_>) =
            (0..count.max(1)).map(|_| mpsc::unbounded_channel()).unzip();
        let live = (0..count.max(1)).map(|_| AtomicUsize::new(0)).collect();
        let spread = Spread {
            live,
            inboxes: senders.into(),
        };
        (spread, receivers)
    }

    /// Where a connection just accepted by worker `me` should go: `None`,
    /// stay (counted with [`Spread::here`]), unless `me` serves two or
    /// more connections more than the least busy worker, which is then
    /// named. Within two a connection is never moved (the hand-off costs
    /// two `epoll_ctl`s and a wake-up of another thread), so short-lived
    /// connections nearly always stay where they arrive.
    pub fn elsewhere(&self, me: usize) -> Option<usize> {
        let mine = self.live[me].load(Ordering::Relaxed);
        let (least, fewest) = self
            .live
            .iter()
            .enumerate()
            .map(|(i, n)| (i, n.load(Ordering::Relaxed)))
            .min_by_key(|&(_, n)| n)?;
        (mine >= fewest + 2).then_some(least)
    }

    /// Counts a connection on worker `me`, which serves it.
    pub fn here(&self, me: usize) -> Served {
        self.count(me)
    }

    /// Hands `conn` to worker `to`, counted there; given back when that
    /// worker has stopped taking connections (its inbox is closed).
    pub fn hand(&self, to: usize, conn: T) -> Result<(), T> {
        self.inboxes[to].send((conn, self.count(to))).map_err(
            |mpsc::error::SendError((conn, counted))| {
                drop(counted);
                conn
            },
        )
    }

    fn count(&self, worker: usize) -> Served {
        self.live[worker].fetch_add(1, Ordering::Relaxed);
        Served {
            live: self.live.clone(),
            worker,
        }
    }

    /// The counts, to read from elsewhere (the metrics).
    pub fn load(&self) -> Load {
        Load(self.live.clone())
    }
}

/// The connections each worker serves, as [`Spread`] counts them, read
/// without a lock (`idemproxy_worker_connections`). Cheap to clone.
#[derive(Clone)]
pub struct Load(Arc<[AtomicUsize]>);

impl Load {
    /// Connections each worker serves now (or has been handed), by worker.
    pub fn connections(&self) -> Vec<usize> {
        self.0.iter().map(|n| n.load(Ordering::Relaxed)).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Worker `me` accepts `conn` and does what the server does with it.
    fn accept(spread: &Spread<u32>, me: usize, conn: u32, open: &mut Vec<Served>) -> bool {
        match spread.elsewhere(me) {
            None => {
                open.push(spread.here(me));
                false
            }
            Some(to) => match spread.hand(to, conn) {
                Ok(()) => true,
                Err(_) => {
                    open.push(spread.here(me));
                    false
                }
            },
        }
    }

    #[test]
    fn a_burst_accepted_by_one_worker_is_shared_within_two() {
        let (spread, mut inboxes) = Spread::<u32>::new(2);
        let mut here = Vec::new();
        for conn in 0..64 {
            accept(&spread, 0, conn, &mut here);
        }
        let handed: Vec<_> = std::iter::from_fn(|| inboxes[1].try_recv().ok()).collect();
        assert_eq!(here.len() + handed.len(), 64);
        assert!(
            here.len().abs_diff(handed.len()) <= 2,
            "{} here, {} handed",
            here.len(),
            handed.len()
        );
        assert_eq!(spread.load().connections(), vec![here.len(), handed.len()]);
        // Closing connections gives their places back.
        drop(here);
        drop(handed);
        assert_eq!(spread.load().connections(), vec![0, 0]);
    }

    #[test]
    fn short_lived_connections_stay_where_they_arrive() {
        let (spread, mut inboxes) = Spread::<u32>::new(2);
        for conn in 0..100 {
            // One open at a time on each worker, never two more than the
            // other.
            let mut open = Vec::new();
            assert!(!accept(&spread, conn as usize % 2, conn, &mut open));
        }
        assert!(inboxes[0].try_recv().is_err() && inboxes[1].try_recv().is_err());
        assert_eq!(spread.load().connections(), vec![0, 0]);
    }

    #[test]
    fn a_worker_that_stopped_taking_connections_is_handed_none() {
        let (spread, mut inboxes) = Spread::<u32>::new(2);
        inboxes.pop(); // worker 1 has stopped
        let mut open = Vec::new();
        let moved: Vec<_> = (0..4).map(|c| accept(&spread, 0, c, &mut open)).collect();
        assert_eq!(moved, [false; 4]);
        assert_eq!(spread.load().connections(), vec![4, 0]);
    }

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
