//! A seeded, bounded chaos run: many clients retrying through several
//! `idemproxy` processes on one database while a driver kills and restarts,
//! pauses and resumes them, and slows the upstream down. Afterwards the
//! invariants of "executed once, nothing lost" are checked against the
//! upstream's execution counts and the database, the stored truth:
//!
//! * (a) a key's upstream executions ≤ 1 + its takeovers (the record's
//!   `attempt` is 1 + the number of takeovers);
//! * (b) a second execution happens only to keys whose earlier owner was
//!   killed, or paused for longer than the lease, while it held the key;
//! * (c) every replay a client received equals the stored response, and the
//!   stored response is the one of the record's current attempt (the fence
//!   held);
//! * (d) once the run quiesces past the lease, no lease is still being
//!   renewed, and once every client has its answer nothing is in flight.
//!
//! The smoke run (the default, part of the test suite) takes about 30 s. The
//! environment makes it longer or different:
//!
//! ```text
//! IDEMPROXY_CHAOS_SECS=600 IDEMPROXY_CHAOS_CLIENTS=32 IDEMPROXY_CHAOS_SEED=7 \
//!     scripts/dev test -- --test chaos -- --nocapture
//! ```
//!
//! `IDEMPROXY_CHAOS_REPLICAS` (default 3) sets the number of proxies,
//! `IDEMPROXY_CHAOS_REPORT=FILE` also writes the report to FILE, and
//! `IDEMPROXY_CHAOS_STRICT=1` fails the run on the known issue of
//! RELIABILITY.md as well (a live owner whose lease ran out while it stored
//! its response: by default reported with the owner's log lines, not
//! counted as an anomaly).
//!
//! The seed fixes the intended fault schedule and every client's choices;
//! the interleavings (and which faults are skipped because their replica is
//! still busy with the previous one) depend on timing.

mod support;

use std::sync::Arc;

use support::chaos::{self, Defaults, Settings};
use support::db::TestDb;
use support::process::TempDir;
use support::proxy_proc::{ProxyConfig, ProxyProc};
use support::slowlink::SlowLink;
use support::upstream_proc::UpstreamProc;
use tokio::sync::Mutex as AsyncMutex;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chaos_run_keeps_every_invariant() {
    let settings = Settings::from_env(
        "IDEMPROXY_CHAOS",
        Defaults {
            secs: 25,
            clients: 12,
            replicas: 3,
            lease_ms: 1000,
            sigterm: false,
        },
    );
    let dir = TempDir::new("chaos");
    let db = TestDb::new().await;
    let sql = db.client().await;
    let up = UpstreamProc::start(&dir).await;
    let link = Arc::new(SlowLink::start(up.addr).await);
    let lease_ms = settings.lease.as_millis() as u64;
    let mut config = ProxyConfig::new(&link.url(), &db.url)
        .lease(&format!("{lease_ms}ms"))
        .upstream_timeout("20s")
        // A lease of several store timeouts (as RELIABILITY.md recommends):
        // a slow database fails one operation (503, or a renewal retried at
        // the next tick) well before it can outrun a live owner's lease.
        .store_timeout(&format!("{}ms", lease_ms * 3 / 10));
    config.pool_size = 6;
    let mut replicas = Vec::new();
    for i in 0..settings.replicas {
        let p = ProxyProc::start(&dir, &format!("replica-{i}"), &config).await;
        replicas.push(Arc::new(AsyncMutex::new(p)));
    }
    let result = chaos::run("chaos run", &settings, replicas, link, &up, &sql).await;
    let full = &result.report;
    eprintln!("{full}");
    if let Ok(path) = std::env::var("IDEMPROXY_CHAOS_REPORT") {
        std::fs::write(path, full).unwrap();
    }
    assert!(result.anomalies.is_empty(), "{full}");
    assert!(result.intents > 0 && !result.faults.is_empty(), "{full}");
}
