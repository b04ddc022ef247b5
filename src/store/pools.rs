//! The store's connections: one pool per lane, each connection kept on the
//! thread that drives it.
//!
//! A tokio-postgres connection is two halves: the client a request uses,
//! and the connection task that writes its statements to the socket and
//! reads the answers. The task runs on the runtime that opened the
//! connection, and the socket is registered with that runtime's reactor.
//! With one runtime per worker thread ([`crate::workers`]), a statement on
//! a connection opened by another thread crosses threads twice (request →
//! connection task → request), each crossing a wake-up of a parked thread:
//! at low concurrency that is most of what a new key pays above its two
//! commits.
//!
//! So the store keeps a pool per lane, like the upstream client: lane 0
//! for the threads that are no worker (the main runtime: renewals, the
//! sweeper, admin), lane `n + 1` for worker `n` (its requests and its
//! group-commit batches). `store.pool_size` stays the limit for the whole
//! process: lane 0 keeps two connections (renewals must find one), and the
//! workers share the rest ([`split`]). Checkouts
//! are work-conserving:
//!
//! 1. the caller's own lane, without waiting: an idle connection, or room
//!    to open one (opened on the caller's runtime, so it stays local);
//! 2. else an idle connection of another lane (it crosses threads, as every
//!    statement did before; better than waiting while one sits idle);
//! 3. else wait, up to `store.timeout`, for the first connection given
//!    back to the caller's own lane or to any other lane that is full (a
//!    lane with room would open one here instead; its own thread will). A
//!    thread whose lane is small never waits while another lane's
//!    connections come free.
//!
//! A pool too small to leave each worker a connection is one pool for all.
//!
//! Within a lane the connection given back last is taken first (LIFO, as
//! PgBouncer does with its server connections). deadpool's default, first
//! in first out, sent each statement to the backend idle longest, so a
//! lane's connections took turns, none kept warm: at one request at a time
//! that cost the database a fifth to a third more CPU per new key (379–408
//! µs against 310–324) and the key 0.08–0.17 ms.

use std::sync::Arc;
use std::time::Duration;

use deadpool::managed::{PoolError, QueueMode, Timeouts};
use deadpool_postgres::Runtime;
use futures_util::stream::{FuturesUnordered, StreamExt};

use super::conn::{Conn, Manager, Pool};
use super::{pool_error, StoreError};

/// Every lane's pool, and how to check out of them.
#[derive(Clone)]
pub(crate) struct Pools {
    pools: Arc<[Pool]>,
    /// The bounds of a checkout that does not wait for a free connection.
    no_wait: Timeouts,
    prepared: bool,
}

/// How `pool_size` connections are split among `lanes`: lane 0 (the main
/// runtime) keeps [`MAIN_LANE`], for renewals and the rest of its work
/// (the group commit runs on the workers' lanes, see `records`); the
/// workers share the remainder evenly. One pool for all when that would
/// leave a worker none.
pub(crate) fn split(pool_size: usize, lanes: usize) -> Vec<usize> {
    let workers = lanes.saturating_sub(1);
    if workers == 0 || pool_size < MAIN_LANE + workers {
        return vec![pool_size];
    }
    let rest = pool_size - MAIN_LANE;
    std::iter::once(MAIN_LANE)
        .chain((0..workers).map(|i| rest / workers + usize::from(i < rest % workers)))
        .collect()
}

/// Lane 0's connections when the workers have lanes of their own: one
/// that renewals always find, and one for the sweeper, the operators'
/// statements and the main lane's own batches.
const MAIN_LANE: usize = 2;

impl Pools {
    /// Builds the pools (connecting lazily) for `pool_size` connections in
    /// all over `lanes` lanes, each connection opened by `manager`'s
    /// connector and every wait, open and recycle bounded by `timeout`.
    pub(crate) fn new(
        manager: impl Fn() -> Manager,
        pool_size: usize,
        lanes: usize,
        timeout: Duration,
        prepared: bool,
    ) -> Result<Self, StoreError> {
        let timeouts = Timeouts {
            wait: Some(timeout),
            create: Some(timeout),
            recycle: Some(timeout),
        };
        let pools = split(pool_size, lanes)
            .into_iter()
            .map(|size| {
                Pool::builder(manager())
                    .max_size(size)
                    .timeouts(timeouts)
                    // Last in, first out (module docs).
                    .queue_mode(QueueMode::Lifo)
                    .runtime(Runtime::Tokio1)
                    .build()
                    .map_err(|e| StoreError::Pool(e.to_string()))
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Pools {
            pools: pools.into(),
            no_wait: Timeouts {
                wait: Some(Duration::ZERO),
                ..timeouts
            },
            prepared,
        })
    }

    /// The calling thread's lane (lane 0 when there is one pool).
    fn own(&self) -> usize {
        let lane = crate::workers::lane().map_or(0, |n| n + 1);
        if lane < self.pools.len() {
            lane
        } else {
            0
        }
    }

    /// A connection, preferring the calling thread's own (module docs).
    pub(crate) async fn checkout(&self) -> Result<Conn, StoreError> {
        let own = self.own();
        let pool = &self.pools[own];
        match pool.timeout_get(&self.no_wait).await {
            Ok(object) => return Ok(Conn::new(object, self.prepared)),
            Err(PoolError::Timeout(_)) => {}
            Err(e) => return Err(pool_error(e)),
        }
        for (lane, other) in self.pools.iter().enumerate() {
            // Only idle ones: room to open one in another lane would open
            // it here, on a runtime that is not that lane's.
            if lane == own || other.status().available == 0 {
                continue;
            }
            if let Ok(object) = other.timeout_get(&self.no_wait).await {
                return Ok(Conn::new(object, self.prepared));
            }
        }
        // Wait for the own lane, and as well for every other lane that is
        // at its size: a connection comes from there only once one is given
        // back, never by opening one on this thread. Whichever comes first.
        let mut waits: FuturesUnordered<_> = self
            .pools
            .iter()
            .enumerate()
            .filter(|&(lane, other)| {
                let s = other.status();
                lane == own || s.size >= s.max_size
            })
            .map(|(lane, pool)| async move { (lane, pool.get().await) })
            .collect();
        while let Some((lane, got)) = waits.next().await {
            match got {
                Ok(object) => return Ok(Conn::new(object, self.prepared)),
                // The own lane's error (its wait ran out, or opening a
                // connection failed) is the answer; another lane's is not.
                Err(e) if lane == own => return Err(pool_error(e)),
                Err(_) => {}
            }
        }
        unreachable!("the own lane is always waited for")
    }

    /// Occupancy of all the lanes together: (size, available, waiting).
    pub(crate) fn status(&self) -> (usize, usize, usize) {
        self.pools
            .iter()
            .fold((0, 0, 0), |(size, free, waiting), p| {
                let s = p.status();
                (size + s.size, free + s.available, waiting + s.waiting)
            })
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use super::{split, Pools, MAIN_LANE};
    use crate::config::StoreConfig;
    use crate::store::conn::{Conn, Manager, Sql};
    use crate::workers::set_lane;

    /// The pools of `pool_size` connections over `lanes` lanes, on the test
    /// database (as `scripts/dev test` exports it, else the local server).
    fn pools(pool_size: usize, lanes: usize, timeout: Duration) -> Pools {
        let url = std::env::var("IDEMPROXY_TEST_DATABASE_URL")
            .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".into());
        let config = StoreConfig::for_test(&url, pool_size, timeout);
        let connector = crate::store::connector(&url, &config).unwrap();
        Pools::new(
            || Manager {
                connector: connector.clone(),
            },
            pool_size,
            lanes,
            timeout,
            false,
        )
        .unwrap()
    }

    // Work-conserving: a worker whose own share is busy and finds nothing
    // idle does not wait for its own share alone. 8 over two workers is
    // 2 (main) + 3 (worker 0) + 3 (worker 1).
    #[tokio::test]
    async fn a_thread_whose_share_is_busy_takes_the_first_connection_given_back_to_a_full_one() {
        let pools = pools(8, 3, Duration::from_secs(5));
        let mut held = Vec::new();
        for (lane, n) in [(Some(1), 3), (Some(0), 3), (None, 2)] {
            set_lane(lane);
            for _ in 0..n {
                held.push(pools.checkout().await.unwrap());
            }
        }
        assert_eq!(pools.status(), (8, 0, 0), "every share full");
        let given_back = held.pop().expect("one of the main thread's");
        // Worker 1 asks (its lane is read when the checkout starts); one of
        // the main thread's comes free 200 ms later.
        set_lane(Some(1));
        let started = Instant::now();
        let (got, ()) = tokio::join!(pools.checkout(), async move {
            tokio::time::sleep(Duration::from_millis(200)).await;
            drop(given_back);
        });
        set_lane(None);
        let waited = started.elapsed();
        let _conn = got.expect("a connection, not the 5 s timeout");
        assert!(
            waited < Duration::from_secs(3),
            "took {waited:?}: it waited for its own share"
        );
        assert_eq!(pools.status(), (8, 0, 0));
    }

    // The own share's timeout is still the answer when nothing comes free.
    #[tokio::test]
    async fn a_checkout_with_nothing_given_back_times_out_after_the_store_timeout() {
        let pools = pools(8, 3, Duration::from_millis(300));
        let mut held = Vec::new();
        for (lane, n) in [(Some(1), 3), (Some(0), 3), (None, 2)] {
            set_lane(lane);
            for _ in 0..n {
                held.push(pools.checkout().await.unwrap());
            }
        }
        set_lane(Some(1));
        let started = Instant::now();
        let got = pools.checkout().await;
        set_lane(None);
        assert!(got.is_err());
        let waited = started.elapsed();
        assert!(
            waited >= Duration::from_millis(250) && waited < Duration::from_secs(3),
            "{waited:?}"
        );
    }

    /// The backend process behind a connection.
    async fn backend(conn: &Conn) -> i32 {
        const PID: Sql = Sql {
            text: "SELECT pg_backend_pid()",
            types: &[],
        };
        conn.query_one(&PID, &[]).await.unwrap().get(0)
    }

    // The connection given back last is the next one out, so at low
    // concurrency one warm backend serves statement after statement
    // instead of each going to the one idle longest.
    #[tokio::test]
    async fn the_connection_given_back_last_is_taken_first() {
        let pools = pools(4, 1, Duration::from_secs(5));
        set_lane(None);
        let (a, b, c) = (
            pools.checkout().await.unwrap(),
            pools.checkout().await.unwrap(),
            pools.checkout().await.unwrap(),
        );
        let last = backend(&c).await;
        assert_ne!(backend(&a).await, last);
        drop(a);
        drop(b);
        drop(c);
        for _ in 0..3 {
            let conn = pools.checkout().await.unwrap();
            assert_eq!(backend(&conn).await, last, "not the one given back last");
        }
        assert_eq!(pools.status(), (3, 3, 0), "no connection opened or lost");
    }

    #[test]
    fn the_pool_size_is_split_among_the_lanes_and_never_exceeded() {
        // The shipped pool on two workers: the batches run on theirs.
        assert_eq!(split(16, 3), [2, 7, 7]);
        assert_eq!(split(8, 3), [2, 3, 3]);
        assert_eq!(split(16, 1), [16]);
        for size in 3..64 {
            for lanes in 1..10 {
                let s = split(size, lanes);
                assert_eq!(s.iter().sum::<usize>(), size, "{size} over {lanes}");
                assert!(s.iter().all(|&n| n > 0), "{size} over {lanes}: {s:?}");
                if s.len() > 1 {
                    assert_eq!(s[0], MAIN_LANE, "{size} over {lanes}");
                    let (least, most) = (s[1..].iter().min(), s[1..].iter().max());
                    assert!(
                        most.zip(least).is_some_and(|(m, l)| m - l <= 1),
                        "{size} over {lanes}: the workers share evenly: {s:?}"
                    );
                }
            }
        }
    }

    #[test]
    fn a_pool_too_small_to_leave_each_worker_one_is_shared() {
        assert_eq!(split(3, 3), [3]);
        assert_eq!(split(4, 3), [2, 1, 1]);
        assert_eq!(split(9, 9), [9]);
        assert_eq!(split(10, 9), [2, 1, 1, 1, 1, 1, 1, 1, 1]);
    }
}
