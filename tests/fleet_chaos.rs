//! The chaos run as a fleet (DESIGN §8.3): at least six replicas through a
//! real PgBouncer in transaction mode (`prepared_statements = false`,
//! LISTEN and migrations over `listen_url`) in front of a private
//! PostgreSQL with `max_connections = 40` — fewer than the replicas' pools
//! would take directly (6 × (8 + 1) = 54) — under the seeded driver of
//! [`support::chaos`]: SIGKILL + restart, pauses past the lease and short
//! ones, SIGTERM restarts (drain, exit 0, start) and one rolling restart
//! of every replica, upstream slowdowns.
//!
//! Asserted: the chaos invariants (a)–(d) (see `tests/chaos.rs`), no
//! `503 store-unavailable` that no injected fault explains, every SIGTERM
//! ends in exit 0, and the connections held: the pooler never opens more
//! than its pool; the server never sees more than the pool plus one direct
//! connection per replica (LISTEN) plus one per replica for migrations at a
//! restart; and no log says "too many clients".
//!
//! ```text
//! scripts/dev test -- --test fleet_chaos -- --nocapture      # 30 s, 6 replicas, 24 clients
//! IDEMPROXY_FLEET_CHAOS_SECS=300 IDEMPROXY_FLEET_CHAOS_CLIENTS=24 \
//!     IDEMPROXY_FLEET_CHAOS_REPLICAS=8 IDEMPROXY_FLEET_CHAOS_SEED=7 \
//!     scripts/dev test -- --test fleet_chaos -- --nocapture   # longer
//! ```
//!
//! `IDEMPROXY_FLEET_CHAOS_REPORT=FILE` also writes the report to FILE.

mod support;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use support::chaos::{self, Defaults, Settings};
use support::pgbouncer::{PgBouncer, PgBouncerOptions};
use support::pgcluster::{self, PgCluster};
use support::process::TempDir;
use support::proxy_proc::{ProxyConfig, ProxyProc};
use support::slowlink::SlowLink;
use support::upstream_proc::UpstreamProc;
use tokio::sync::Mutex as AsyncMutex;

const MAX_CONNECTIONS: usize = 40;
const SERVER_POOL: u32 = 8;
const REPLICA_POOL: usize = 8;
const DIRECT_APP: &str = "idemproxy-direct";
/// The test's own connections (setup, checks, the sampler): not counted.
const TEST_APP: &str = "idemproxy-test";
const TOO_MANY: &[&str] = &[
    "too many clients",
    "too many connections",
    "no more connections allowed",
];

/// The largest counts the sampler saw on the server.
#[derive(Debug, Default, Clone)]
struct ConnPeak {
    samples: u64,
    total: i64,
    direct: i64,
    pooled: i64,
    /// Server connections by the pooler's own count (`SHOW POOLS`).
    pooler_servers: i64,
    cl_waiting: i64,
    maxwait_s: i64,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fleet_of_six_through_a_transaction_pooler_keeps_every_invariant_and_the_connection_bound()
{
    let settings = Settings::from_env(
        "IDEMPROXY_FLEET_CHAOS",
        Defaults {
            secs: 30,
            clients: 24,
            replicas: 6,
            lease_ms: 1500,
            sigterm: true,
        },
    );
    assert!(settings.replicas >= 2);
    let started = Instant::now();
    let bindir = pgcluster::require_bindir("the fleet chaos run");
    let pg = PgCluster::init(
        &bindir,
        "fleet",
        &format!("max_connections = {MAX_CONNECTIONS}\nsuperuser_reserved_connections = 3\n"),
    );
    pg.start();
    let test_url = |db: &str| format!("{}?application_name={TEST_APP}", pg.url(db));
    let admin = support::db::connect(&test_url("postgres")).await;
    admin
        .batch_execute("CREATE DATABASE idemproxy")
        .await
        .unwrap();
    let sql = support::db::connect(&test_url("idemproxy")).await;
    let bouncer = PgBouncer::start(
        "the fleet chaos run",
        &pg.url("idemproxy"),
        PgBouncerOptions {
            pool_size: SERVER_POOL,
            // Server connections open before the traffic starts, as a
            // pooler in production has them: otherwise the first burst
            // waits for eight backends to start within one store timeout.
            min_pool_size: SERVER_POOL,
            ..PgBouncerOptions::default()
        },
    )
    .await;

    let dir = TempDir::new("fleet-chaos");
    let up = UpstreamProc::start(&dir).await;
    let link = Arc::new(SlowLink::start(up.addr).await);
    let lease_ms = settings.lease.as_millis() as u64;
    let mut config = ProxyConfig::new(&link.url(), &bouncer.url("idemproxy"))
        .pooled(&format!(
            "{}?application_name={DIRECT_APP}",
            pg.url("idemproxy")
        ))
        .lease(&format!("{lease_ms}ms"))
        .upstream_timeout("20s")
        .shutdown_grace("10s")
        .store_timeout(&format!("{}ms", lease_ms * 3 / 10));
    config.pool_size = REPLICA_POOL;
    let mut replicas = Vec::new();
    for i in 0..settings.replicas {
        let p = ProxyProc::start(&dir, &format!("replica-{i}"), &config).await;
        replicas.push(Arc::new(AsyncMutex::new(p)));
    }

    // The pool exists once the replicas have checked their readiness
    // through it; wait for the pooler to have filled it.
    let warm = Instant::now();
    loop {
        let p = bouncer.pool("idemproxy").await;
        if p.sv_active + p.sv_idle + p.sv_used >= i64::from(SERVER_POOL) {
            break;
        }
        assert!(
            warm.elapsed() < Duration::from_secs(20),
            "the pooler did not open its {SERVER_POOL} server connections: {p:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    // The sampler: the whole server's client backends (max_connections is
    // server-wide), and the pooler's queue.
    let stop = Arc::new(AtomicBool::new(false));
    let sampler = {
        let stop = stop.clone();
        let url = test_url("postgres");
        let pool_admin = bouncer.admin().await;
        tokio::spawn(async move {
            let server = support::db::connect(&url).await;
            let mut peak = ConnPeak::default();
            while !stop.load(Ordering::SeqCst) {
                let row = server
                    .query_one(
                        "SELECT count(*), count(*) FILTER (WHERE application_name = $1)
                           FROM pg_stat_activity
                          WHERE backend_type = 'client backend'
                            AND application_name IS DISTINCT FROM $2",
                        &[&DIRECT_APP, &TEST_APP],
                    )
                    .await
                    .unwrap();
                let (total, direct): (i64, i64) = (row.get(0), row.get(1));
                peak.total = peak.total.max(total);
                peak.direct = peak.direct.max(direct);
                peak.pooled = peak.pooled.max(total - direct);
                for m in pool_admin.simple_query("SHOW POOLS").await.unwrap() {
                    if let tokio_postgres::SimpleQueryMessage::Row(r) = m {
                        if r.get("database") == Some("idemproxy") {
                            let n = |c: &str| -> i64 {
                                r.get(c).and_then(|v| v.parse().ok()).unwrap_or_default()
                            };
                            let servers = n("sv_active")
                                + n("sv_idle")
                                + n("sv_used")
                                + n("sv_tested")
                                + n("sv_login");
                            peak.pooler_servers = peak.pooler_servers.max(servers);
                            peak.cl_waiting = peak.cl_waiting.max(n("cl_waiting"));
                            peak.maxwait_s = peak.maxwait_s.max(n("maxwait"));
                        }
                    }
                }
                peak.samples += 1;
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            peak
        })
    };

    let title = format!(
        "fleet chaos run (PgBouncer transaction mode, server pool {SERVER_POOL}, \
         max_connections {MAX_CONNECTIONS}, replica pool_size {REPLICA_POOL})"
    );
    let result = chaos::run(&title, &settings, replicas.clone(), link, &up, &sql).await;
    stop.store(true, Ordering::SeqCst);
    let peak = sampler.await.unwrap();

    let mut too_many = Vec::new();
    let mut logs = vec![
        ("server".to_string(), pg.log_text()),
        ("pgbouncer".into(), bouncer.log_text()),
    ];
    for (i, r) in replicas.iter().enumerate() {
        logs.push((format!("replica-{i}"), r.lock().await.proc.log_text()));
    }
    for (name, text) in &logs {
        for line in text.lines() {
            if TOO_MANY.iter().any(|t| line.to_lowercase().contains(t)) {
                too_many.push(format!("{name}: {line}"));
            }
        }
    }
    let replicas_n = settings.replicas as i64;
    // Pool + a LISTEN connection per replica + a migration connection per
    // replica (a restarted replica migrates while its old LISTEN backend
    // may not have gone yet).
    let bound = i64::from(SERVER_POOL) + 2 * replicas_n;
    let report = format!(
        "{}server connections: at most {} ({} pooled, {} direct) over {} samples; bound {bound} \
         (pool {SERVER_POOL} + 2 x {replicas_n} replicas), max_connections {MAX_CONNECTIONS}; \
         the pooler's own count of server connections at most {}; pooler queue: at most {} \
         clients waiting, longest wait {} s; \"too many clients\" lines: {}\n\
         whole test {:.1} s\n",
        result.report,
        peak.total,
        peak.pooled,
        peak.direct,
        peak.samples,
        peak.pooler_servers,
        peak.cl_waiting,
        peak.maxwait_s,
        too_many.len(),
        started.elapsed().as_secs_f64(),
    );
    eprintln!("{report}");
    if let Ok(path) = std::env::var("IDEMPROXY_FLEET_CHAOS_REPORT") {
        std::fs::write(path, &report).unwrap();
    }
    assert!(result.anomalies.is_empty(), "{report}");
    assert!(result.intents > 0 && !result.faults.is_empty(), "{report}");
    assert!(
        result
            .faults
            .iter()
            .filter(|f| f.kind == chaos::FaultKind::Term)
            .count()
            >= settings.replicas,
        "the rolling restart did not happen: {report}"
    );
    assert!(result.store_errors_unexplained.is_empty(), "{report}");
    assert!(peak.samples > 10, "{report}");
    // The pooler never opens more than its pool (its own count; the
    // server-side split above goes by application_name, and a backend of a
    // closed pooled connection may outlive it by a moment: the bound below
    // covers the server side).
    assert!(peak.pooler_servers <= i64::from(SERVER_POOL), "{report}");
    assert!(peak.pooler_servers > 0, "{report}");
    assert!(peak.total <= bound, "{report}");
    assert!(too_many.is_empty(), "{report}{too_many:#?}");
}
