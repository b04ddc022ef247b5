//! Many sidecars, one database, through a pooler (DESIGN §8.3): several
//! `idemproxy` processes whose `database_url` is a real PgBouncer in
//! transaction mode with a small server pool, `prepared_statements = false`,
//! and `listen_url` pointing straight at PostgreSQL for LISTEN and
//! migrations.
//!
//! The pooler is the test server's, started per test by
//! [`support::pgbouncer`]; each test has a fresh database on the test
//! server and counts that database's backends on the real server, so
//! concurrent tests do not disturb the counts.
//!
//! ```text
//! scripts/dev test -- --test fleet -- --nocapture   # prints the figures
//! ```

mod support;

use std::collections::HashSet;
use std::time::{Duration, Instant};

use http::StatusCode;
use support::db::{DbLocale, TestDb};
use support::http::{HttpClient, Req, Resp};
use support::pgbouncer::{backends, PgBouncer, PgBouncerOptions};
use support::process::TempDir;
use support::proxy_proc::{ProxyConfig, ProxyProc};
use support::upstream_proc::UpstreamProc;

const PAY: &str = r#"{"amount": 100, "currency": "EUR"}"#;
const LISTEN: &str = "LISTEN idemproxy_keys";
/// The `application_name` of the replicas' direct (`listen_url`)
/// connections, which tells them from the pooler's on the server.
const DIRECT_APP: &str = "idemproxy-direct";

/// Replicas behind one pooler, on one fresh database. Fields drop in
/// order: the replicas and the pooler stop before the database is dropped.
struct Fleet {
    replicas: Vec<ProxyProc>,
    bouncer: PgBouncer,
    up: UpstreamProc,
    /// A direct connection to the test database (for counts and records).
    sql: tokio_postgres::Client,
    db: TestDb,
    _dir: TempDir,
}

impl Fleet {
    /// `replicas` processes with `pool_size` each, through a pooler of
    /// `server_pool` server connections; `tweak` edits their configuration
    /// (already pooled: `prepared_statements = false`, `listen_url`).
    async fn start(
        tag: &str,
        replicas: usize,
        server_pool: u32,
        tweak: impl Fn(ProxyConfig) -> ProxyConfig,
    ) -> Fleet {
        let dir = TempDir::new(tag);
        let db = TestDb::new().await;
        let sql = db.client().await;
        let up = UpstreamProc::start(&dir).await;
        let bouncer = PgBouncer::start(
            tag,
            &db.url,
            PgBouncerOptions {
                pool_size: server_pool,
                ..PgBouncerOptions::default()
            },
        )
        .await;
        let config = tweak(
            ProxyConfig::new(&up.url(), &bouncer.url(&db.name))
                .pooled(&format!("{}?application_name={DIRECT_APP}", db.url))
                .lease("3s")
                .store_timeout("2s"),
        );
        // With named statements through the pooler `/readyz/store` may
        // never answer 200 (its probe is such a statement: that is the point
        // of the test that turns them on), so there "ready" means listening
        // and the schema migrated, read on a direct connection.
        let named_statements = config.store.contains("prepared_statements = true");
        let mut procs = Vec::new();
        // One at a time: the first applies the migrations.
        for i in 0..replicas {
            let name = format!("replica-{i}");
            if named_statements {
                let p = ProxyProc::spawn(&dir, &name, &config);
                p.wait_listening(Duration::from_secs(20)).await;
                wait_migrated(&sql).await;
                procs.push(p);
            } else {
                procs.push(ProxyProc::start(&dir, &name, &config).await);
            }
        }
        let fleet = Fleet {
            _dir: dir,
            db,
            sql,
            up,
            bouncer,
            replicas: procs,
        };
        fleet.wait_listeners(replicas).await;
        fleet
    }

    /// Waits until `n` backends of the database are subscribed (each
    /// replica's listener has its own connection on `listen_url`).
    async fn wait_listeners(&self, n: usize) {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let seen = self.listeners().await.len();
            // And nothing else direct: a replica's migration check runs on
            // its own direct connection, whose backend may outlive it by a
            // moment and would count as a second direct connection.
            let direct = backends(&self.sql, &self.db.name)
                .await
                .iter()
                .filter(|(_, app, _)| app == DIRECT_APP)
                .count();
            if seen == n && direct == n {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "{seen} LISTEN connections on the database, expected {n}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Direct backends whose last statement was the LISTEN (or the empty
    /// query that pings the listening connection now and then).
    async fn listeners(&self) -> Vec<i32> {
        backends(&self.sql, &self.db.name)
            .await
            .into_iter()
            .filter(|(_, app, q)| app == DIRECT_APP && (q == LISTEN || q.is_empty()))
            .map(|(pid, _, _)| pid)
            .collect()
    }

    /// Keyed POST to replica `i` with an upstream delay.
    async fn post(&self, i: usize, key: &str, delay_ms: u64) -> Result<Resp, String> {
        send(&self.replicas[i], key, delay_ms).await
    }
}

/// Waits until the first migration is recorded (read directly, not through
/// the pooler).
async fn wait_migrated(sql: &tokio_postgres::Client) {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let done = sql
            .query_opt(
                "SELECT 1 FROM idemproxy_schema_migrations WHERE version = 1",
                &[],
            )
            .await
            .is_ok_and(|row| row.is_some());
        if done {
            return;
        }
        assert!(Instant::now() < deadline, "schema not migrated within 20s");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn send(p: &ProxyProc, key: &str, delay_ms: u64) -> Result<Resp, String> {
    p.try_post(
        key,
        PAY,
        &[("x-sample-delay-ms", &delay_ms.to_string())],
        Duration::from_secs(20),
    )
    .await
}

fn problem(r: &Resp) -> Option<String> {
    (r.header("content-type") == Some("application/problem+json")).then(|| {
        r.json()["type"]
            .as_str()
            .unwrap_or_default()
            .trim_start_matches("urn:idemproxy:problem:")
            .to_owned()
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn racing_duplicates_across_replicas_behind_a_transaction_pooler_execute_once() {
    let fleet = Fleet::start("fleet-race", 3, 4, |c| c).await;
    let keys: Vec<String> = (0..30).map(|i| format!("race-{i}")).collect();
    // Every key sent twice to every replica at once: 180 requests in flight.
    let mut tasks = Vec::new();
    for key in &keys {
        for i in 0..fleet.replicas.len() * 2 {
            let url = fleet.replicas[i % fleet.replicas.len()].url("/v1/orders");
            let key = key.clone();
            tasks.push(tokio::spawn(async move {
                let req = Req::post(&url)
                    .key(&key)
                    .json(PAY)
                    .header("x-sample-delay-ms", "300");
                (key, HttpClient::new().try_send(req).await)
            }));
        }
    }
    let mut fresh = std::collections::HashMap::<String, u32>::new();
    let mut outcomes = std::collections::BTreeMap::<String, u32>::new();
    for t in tasks {
        let (key, r) = t.await.unwrap();
        let r = r.unwrap_or_else(|e| panic!("{key}: {e}"));
        let label = match (r.status.as_u16(), problem(&r), r.replayed()) {
            (201, None, false) => {
                *fresh.entry(key.clone()).or_default() += 1;
                "201 executed".to_string()
            }
            (201, None, true) => "201 replayed".into(),
            (409, Some(p), _) if p == "request-in-progress" => "409 in progress".into(),
            (s, p, _) => panic!("{key}: unexpected {s} {p:?}: {}", r.text()),
        };
        *outcomes.entry(label).or_default() += 1;
    }
    eprintln!("fleet race: 30 keys x 6 sends over 3 replicas, pool 4: {outcomes:?}");
    let stats = fleet.up.stats().await;
    for key in &keys {
        assert_eq!(
            stats["keys"][key].as_u64(),
            Some(1),
            "{key} executed other than once: {stats}"
        );
        assert_eq!(fresh.get(key), Some(&1), "{key}: one executed answer");
        let row = support::records::read_row(&fleet.sql, "", key)
            .await
            .unwrap();
        assert_eq!((row.state.as_str(), row.attempt), ("completed", 1));
    }
    // Afterwards every replica replays each key.
    for key in keys.iter().take(5) {
        for i in 0..fleet.replicas.len() {
            let r = fleet.post(i, key, 0).await.unwrap();
            assert_eq!(r.status, StatusCode::CREATED, "{}", r.text());
            assert!(r.replayed(), "{key} via replica-{i}");
        }
    }
    assert_eq!(stats["total"].as_u64(), Some(keys.len() as u64));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiter_on_one_replica_is_woken_by_a_completion_on_another_through_listen_url() {
    let fleet = Fleet::start("fleet-wait", 2, 4, |mut c| {
        // Long lease, shorter wait: without the notification the waiter
        // would give up (409) before the lease could tell it anything.
        c.defaults = "wait = \"5s\"\n".into();
        c.lease("10s")
    })
    .await;
    let mut lags = Vec::new();
    for (n, (owner, waiter)) in [(1usize, 0usize), (0, 1), (1, 0)].into_iter().enumerate() {
        let key = format!("wait-{n}");
        let url = fleet.replicas[owner].url("/v1/orders");
        let k = key.clone();
        let original = tokio::spawn(async move {
            let r = HttpClient::new()
                .send(
                    Req::post(&url)
                        .key(&k)
                        .json(PAY)
                        .header("x-sample-delay-ms", "1000"),
                )
                .await;
            (r, Instant::now())
        });
        fleet
            .up
            .wait_executions(&key, 1, Duration::from_secs(10))
            .await;
        let started = Instant::now();
        let dup = fleet.post(waiter, &key, 0).await.unwrap();
        let dup_done = Instant::now();
        let (first, first_done) = original.await.unwrap();
        assert_eq!(first.status, StatusCode::CREATED, "{}", first.text());
        assert_eq!(
            dup.status,
            StatusCode::CREATED,
            "the waiter on replica-{waiter} was not woken by replica-{owner}'s completion: {}",
            dup.text()
        );
        assert!(dup.replayed());
        assert_eq!(dup.body, first.body);
        let lag = dup_done.saturating_duration_since(first_done);
        assert!(
            lag < Duration::from_millis(500),
            "woken {lag:?} after the original's answer (waited {:?})",
            dup_done - started
        );
        assert!(dup_done - started < Duration::from_secs(3));
        lags.push(lag);
        assert_eq!(fleet.up.executions(&key).await, 1);
    }
    eprintln!("fleet wait: waiter answered {lags:?} after the original's answer");
    // The subscriptions were on direct connections, not through the pooler.
    let pooled: HashSet<i32> = fleet
        .bouncer
        .servers()
        .await
        .iter()
        .map(|s| s.remote_pid)
        .collect();
    for pid in fleet.listeners().await {
        assert!(!pooled.contains(&pid), "LISTEN ran on a pooled connection");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_connections_stay_within_the_pool_plus_one_listen_connection_per_replica() {
    const REPLICAS: usize = 3;
    const SERVER_POOL: u32 = 4;
    let fleet = Fleet::start("fleet-conns", REPLICAS, SERVER_POOL, |mut c| {
        c.pool_size = 8;
        c
    })
    .await;
    // 48 clients of new keys for 3 s: each replica's own pool (8) would
    // hold 24 connections between them without the pooler.
    let deadline = Instant::now() + Duration::from_secs(3);
    let mut clients = Vec::new();
    for c in 0..48 {
        let url = fleet.replicas[c % REPLICAS].url("/v1/orders");
        clients.push(tokio::spawn(async move {
            let http = HttpClient::new();
            let (mut ok, mut other) = (0u32, Vec::new());
            let mut n = 0;
            while Instant::now() < deadline {
                n += 1;
                let req = Req::post(&url)
                    .key(&format!("conn-{c}-{n}"))
                    .json(PAY)
                    .header("x-sample-delay-ms", "20");
                match http.try_send(req).await {
                    Ok(r) if r.status == StatusCode::CREATED => ok += 1,
                    Ok(r) => other.push(format!("{} {}", r.status, r.text())),
                    Err(e) => other.push(e),
                }
            }
            (ok, other)
        }));
    }
    let mut max_total = 0;
    let mut max_pooled = 0;
    let mut max_direct = 0;
    let mut samples = 0;
    while Instant::now() < deadline {
        let all = backends(&fleet.sql, &fleet.db.name).await;
        let direct = all.iter().filter(|(_, app, _)| app == DIRECT_APP).count();
        max_total = max_total.max(all.len());
        max_pooled = max_pooled.max(all.len() - direct);
        max_direct = max_direct.max(direct);
        samples += 1;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let (mut ok, mut failures) = (0, Vec::new());
    for c in clients {
        let (o, f) = c.await.unwrap();
        ok += o;
        failures.extend(f);
    }
    let pool = fleet.bouncer.pool(&fleet.db.name).await;
    eprintln!(
        "fleet connections: {REPLICAS} replicas x pool_size 8 through a pooler of {SERVER_POOL}: \
         {ok} keys executed by 48 clients in 3 s, {} failures; backends on the server at most \
         {max_total} ({max_pooled} pooled, {max_direct} direct) over {samples} samples; \
         pool now {pool:?}",
        failures.len()
    );
    assert!(
        failures.is_empty(),
        "{:?}",
        &failures[..failures.len().min(5)]
    );
    assert!(ok > 100, "too little traffic to mean anything: {ok}");
    // Every 20 ms for 3 s; fewer on a starved machine, but enough to see
    // the peak.
    assert!(samples >= 10, "{samples} samples");
    assert!(
        max_pooled <= SERVER_POOL as usize,
        "{max_pooled} pooled backends, pool is {SERVER_POOL}"
    );
    assert_eq!(max_direct, REPLICAS, "one LISTEN connection per replica");
    assert!(max_total <= SERVER_POOL as usize + REPLICAS);
    assert_eq!(fleet.listeners().await.len(), REPLICAS);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn named_prepared_statements_through_a_transaction_pooler_fail_keyed_requests_closed() {
    // Why `prepared_statements = false` exists: with the default, the named
    // statements one transaction prepared are gone (or someone else's) on
    // the next server connection the pooler hands out.
    let fleet = Fleet::start("fleet-prepared", 1, 2, |mut c| {
        c.store = c
            .store
            .replace("prepared_statements = false", "prepared_statements = true");
        c
    })
    .await;
    let mut failed = 0;
    let mut executed = 0;
    let mut rounds = 0;
    while failed == 0 && rounds < 10 {
        rounds += 1;
        let answers = futures_util::future::join_all((0..32).map(|i| {
            let key = format!("prep-{rounds}-{i}");
            let fleet = &fleet;
            async move { fleet.post(0, &key, 5).await }
        }))
        .await;
        for r in answers {
            let r = r.unwrap();
            match (r.status.as_u16(), problem(&r)) {
                (201, None) => executed += 1,
                (503, Some(p)) if p == "store-unavailable" => failed += 1,
                (s, p) => panic!("unexpected {s} {p:?}: {}", r.text()),
            }
        }
    }
    let log = fleet.replicas[0].proc.log_text();
    let named = log.matches("prepared statement").count();
    eprintln!(
        "fleet prepared statements: {failed} of {} keyed requests 503 in {rounds} rounds, \
         {named} log lines naming a prepared statement",
        rounds * 32
    );
    assert!(
        failed > 0,
        "every keyed request succeeded with named statements through a transaction pooler"
    );
    assert!(named > 0, "the log names the cause");
    // Failing closed: nothing executed twice, nothing executed without a record.
    let stats = fleet.up.stats().await;
    assert_eq!(stats["total"].as_u64(), Some(executed));
    for (k, n) in stats["keys"].as_object().unwrap() {
        assert_eq!(n.as_u64(), Some(1), "{k}");
    }
}

/// The claim statements (reads or claims of a record) a replica ran.
const CLAIMS: &str = r#"idemproxy_store_duration_seconds_count{op="claim"}"#;
const HELD_HERE: &str = "idemproxy_duplicates_held_here_total";

// A key held in flight by one replica, behind a transaction-mode pooler on
// an en-US-collated database (DESIGN §8.3, §8.5): that replica answers its
// duplicates from memory, another replica through the pooler, and both
// keep answering 409 while the holder drains after SIGTERM with its
// client gone (the work detached, §8.2); then the completion replays.
#[tokio::test]
async fn a_key_held_by_one_replica_is_answered_from_memory_there_and_from_the_store_elsewhere_through_a_drain(
) {
    let dir = TempDir::new("held-here-fleet");
    let db = TestDb::with_locale(DbLocale::IcuEnUs).await;
    let up = UpstreamProc::start(&dir).await;
    let bouncer = PgBouncer::start("held-here-fleet", &db.url, PgBouncerOptions::default()).await;
    let config = ProxyConfig::new(&up.url(), &bouncer.url(&db.name))
        .pooled(&db.url)
        .lease("3s")
        .shutdown_grace("10s");
    let mut a = ProxyProc::start(&dir, "replica-a", &config).await;
    let b = ProxyProc::start(&dir, "replica-b", &config).await;

    // The original's client gives up after 0.8 s of a 3 s call.
    let impatient = a.try_post(
        "k-held",
        PAY,
        &[("x-sample-delay-ms", "3000")],
        Duration::from_millis(800),
    );
    let (gave_up, ()) = tokio::join!(impatient, async {
        up.wait_executions("k-held", 1, Duration::from_secs(5))
            .await;
        let claims = a.metric(CLAIMS).await;
        for _ in 0..3 {
            let r = a.post("k-held", PAY, &[]).await;
            assert_eq!(r.status, StatusCode::CONFLICT, "{}", r.text());
        }
        let r = a.post("k-held", r#"{"amount": 1}"#, &[]).await;
        assert_eq!(r.status, StatusCode::UNPROCESSABLE_ENTITY, "{}", r.text());
        assert_eq!(a.metric(CLAIMS).await, claims, "no statement at the holder");
        assert_eq!(a.metric(HELD_HERE).await, 4.0);

        let claims = b.metric(CLAIMS).await;
        let r = b.post("k-held", PAY, &[]).await;
        assert_eq!(r.status, StatusCode::CONFLICT, "{}", r.text());
        assert_eq!(b.metric(CLAIMS).await, claims + 1.0, "one read elsewhere");
        assert_eq!(b.metric(HELD_HERE).await, 0.0);
    });
    assert!(gave_up.is_err(), "the original's client gave up");

    // The holder drains: it finishes the detached call before it exits.
    a.proc.signal("TERM");
    let r = b.post("k-held", PAY, &[]).await;
    assert_eq!(
        r.status,
        StatusCode::CONFLICT,
        "during the drain: {}",
        r.text()
    );
    let status = a
        .proc
        .wait_exit(Duration::from_secs(10))
        .await
        .expect("the holder exits after its call");
    assert_eq!(status.code(), Some(0));
    let r = b.post("k-held", PAY, &[]).await;
    assert_eq!(r.status, StatusCode::CREATED, "{}", r.text());
    assert_eq!(r.header("idempotent-replayed"), Some("true"));
    assert_eq!(up.executions("k-held").await, 1);
}
