//! The fixtures of the integration tests, in one place. Every test file
//! declares `mod support;` and uses the parts it needs.
//!
//! * [`harness`]: the sample upstream and idemproxy in the test's own
//!   runtime on port-0 sockets, on a fresh database ([`harness::Harness`],
//!   configured by a [`harness::Setup`]).
//! * [`http`]: the test client ([`http::HttpClient`], [`http::Req`],
//!   [`http::Resp`]) and the `/metrics` reader.
//! * [`db`]: a fresh database per test on the shared server
//!   ([`db::TestDb`]); [`records`]: records read or claimed directly.
//! * The real binaries as child processes that a test can kill, pause and
//!   restart: [`process`] (any child, ports, directories),
//!   [`upstream_proc`] (`sample-upstream`), [`proxy_proc`] (`idemproxy
//!   serve`).
//! * Around them: the local Citus cluster and a schema per test on it
//!   ([`citus`]), private PostgreSQL clusters ([`pgcluster`]), a real
//!   PgBouncer ([`pgbouncer`]), a TCP link whose latency a test can turn up
//!   ([`slowlink`]), the seeded chaos driver and checker ([`chaos`]), a
//!   seeded generator ([`rng`]), and a throwaway PKI ([`tls_fixtures`]).
//!
//! Waiting: a test that waits for something observable polls it with
//! [`eventually`] (or [`poll_until`]) instead of sleeping for a guessed
//! time; a sleep in a test is the test's point (a lease left to run out, a
//! client that gives up, load paced on purpose).
// Each test binary uses a different part of this module.
#![allow(dead_code, unreachable_pub)]

pub mod chaos;
pub mod citus;
pub mod cli;
pub mod db;
pub mod harness;
pub mod http;
pub mod pgbouncer;
pub mod pgcluster;
pub mod previous;
pub mod process;
pub mod proxy_proc;
pub mod records;
pub mod rng;
pub mod slowlink;
pub mod tls_fixtures;
pub mod upstream_proc;

use std::cell::RefCell;
use std::fmt::Display;
use std::future::Future;
use std::time::{Duration, Instant};

/// How often [`poll`], [`poll_until`] and [`eventually`] look again.
const POLL_INTERVAL: Duration = Duration::from_millis(10);

/// Polls `check` until it yields `Some`, and returns that; `None` once
/// `within` has passed (for a caller that decides what a timeout means).
pub async fn poll<T, F, Fut>(within: Duration, check: F) -> Option<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    poll_every(POLL_INTERVAL, within, check).await
}

/// [`poll`], looking again every `every`: for a check that costs the
/// system under test something (a store query through a pooler).
pub async fn poll_every<T, F, Fut>(every: Duration, within: Duration, mut check: F) -> Option<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let deadline = Instant::now() + within;
    loop {
        if let Some(value) = check().await {
            return Some(value);
        }
        if Instant::now() >= deadline {
            return None;
        }
        tokio::time::sleep(every).await;
    }
}

/// Polls `check` until it yields `Ok`, and returns that; when `within` has
/// passed, panics naming `what` and the last `Err` (what was seen instead).
pub async fn poll_until<T, F, Fut>(within: Duration, what: impl Display, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, String>>,
{
    let last = RefCell::new(String::new());
    let found = poll(within, || {
        let fut = check();
        let last = &last;
        async move {
            match fut.await {
                Ok(value) => Some(value),
                Err(seen) => {
                    *last.borrow_mut() = seen;
                    None
                }
            }
        }
    })
    .await;
    found.unwrap_or_else(|| {
        panic!(
            "waited {within:?} for {what}, in vain; last seen: {}",
            last.borrow()
        )
    })
}

/// Polls `condition` until it holds; panics naming `what` when `within`
/// has passed.
pub async fn eventually<F, Fut>(within: Duration, what: impl Display, mut condition: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let held = poll(within, || {
        let fut = condition();
        async move { fut.await.then_some(()) }
    })
    .await;
    assert!(held.is_some(), "waited {within:?} for {what}, in vain");
}
