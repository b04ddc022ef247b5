//! DESIGN.md §5 and §6: operating the proxy. Restarts, replicas, the
//! sweeper, migrations, health and readiness, a database that is down or
//! appears late, graceful shutdown, metrics and h2c, against a real
//! PostgreSQL over real sockets.

mod support;

use std::time::{Duration, Instant};

use http::StatusCode;
use idemproxy::metrics::Metrics;
use idemproxy::store::migrate::MIGRATIONS;
use idemproxy::store::Store;
use support::db::TestDb;
use support::harness::Setup;
use support::http::{HttpClient, Req};

const PAY: &str = r#"{"amount": 100, "currency": "EUR"}"#;

/// A store on `db_url` with the test setup's store settings.
fn store_for(db_url: &str) -> Store {
    Store::new(&Setup::default().config("http://127.0.0.1:1", db_url).store).unwrap()
}

async fn get(url: &str) -> support::http::Resp {
    HttpClient::new().send(Req::get(url)).await
}

// §5: records live in PostgreSQL, so a restarted proxy still replays.
#[tokio::test]
async fn completed_key_replays_after_the_proxy_restarts() {
    let mut h = support::harness::Harness::start(Setup::default()).await;
    let first = h.post("/v1/payments", "k-restart", PAY).await;
    assert_eq!(first.status, 201, "{}", first.text());
    assert!(!first.replayed());
    let old_addr = h.running().proxy_addr;

    h.restart_proxy().await;
    assert_ne!(
        h.running().proxy_addr,
        old_addr,
        "a new process-like proxy on a new port"
    );

    let again = h.post("/v1/payments", "k-restart", PAY).await;
    assert_eq!(again.status, 201, "{}", again.text());
    assert!(
        again.replayed(),
        "not replayed after restart: {:?}",
        again.headers
    );
    assert_eq!(again.body, first.body, "body bytes differ after restart");
    assert_eq!(h.upstream.executions("k-restart"), 1);
}

// §5 "Scaling out": replicas are stateless and share one PostgreSQL.
#[tokio::test]
async fn replicas_on_one_database_share_completed_and_in_flight_keys() {
    let h = support::harness::Harness::start(Setup::default().defaults("lease = \"5s\"\n")).await;
    let b = h.replica().await;
    let b_url = format!("http://{}/v1/payments", b.proxy_addr);
    assert_ne!(b.proxy_addr, h.running().proxy_addr);

    // Completed through A, replayed through B.
    let on_a = h.post("/v1/payments", "k-replicas-done", PAY).await;
    assert_eq!(on_a.status, 201, "{}", on_a.text());
    let on_b = h
        .client
        .send(Req::post(&b_url).key("k-replicas-done").json(PAY))
        .await;
    assert_eq!(on_b.status, 201, "{}", on_b.text());
    assert!(on_b.replayed());
    assert_eq!(on_b.body, on_a.body);
    assert_eq!(h.upstream.executions("k-replicas-done"), 1);

    // In flight on A: 409 on B.
    let client = h.client.clone();
    let a_url = h.url("/v1/payments");
    let slow = tokio::spawn(async move {
        client
            .send(
                Req::post(&a_url)
                    .key("k-replicas-flight")
                    .json(PAY)
                    .header("x-sample-delay-ms", "1000"),
            )
            .await
    });
    h.wait_executions("k-replicas-flight", 1).await;
    let dup = h
        .client
        .send(Req::post(&b_url).key("k-replicas-flight").json(PAY))
        .await;
    dup.assert_problem(409, "request-in-progress");
    assert!(dup.header("retry-after").is_some());
    let original = slow.await.unwrap();
    assert_eq!(original.status, 201, "{}", original.text());
    assert!(!original.replayed());

    // Once it completes on A, B replays it.
    let later = h
        .client
        .send(Req::post(&b_url).key("k-replicas-flight").json(PAY))
        .await;
    assert!(later.replayed(), "{}", later.text());
    assert_eq!(later.body, original.body);
    assert_eq!(h.upstream.executions("k-replicas-flight"), 1);
    b.shutdown().await;
}

// §5: the sweeper deletes expired records in bounded batches, and nothing
// else: not a record whose lease is still valid, not an unexpired record.
#[tokio::test]
async fn sweeper_deletes_only_expired_records_in_batches_and_counts_them() {
    let h = support::harness::Harness::start(
        Setup::default().defaults("lease = \"200ms\"\nretention = \"1s\"\n"),
    )
    .await;
    let store = h.store();
    for i in 1..=4 {
        let r = h.post("/v1/payments", &format!("k-old-{i}"), PAY).await;
        assert_eq!(r.status, 201, "{}", r.text());
    }
    // An abandoned claim whose lease and retention both run out.
    support::records::claim_in_flight(
        &store,
        "",
        "k-old-abandoned",
        Duration::from_millis(100),
        Duration::from_millis(300),
    )
    .await;
    tokio::time::sleep(Duration::from_millis(1300)).await;

    // Not expired: completed just now (1 s retention).
    let fresh = h.post("/v1/payments", "k-fresh", PAY).await;
    assert_eq!(fresh.status, 201);
    // Past its retention, but its owner's lease is valid: still in flight.
    support::records::claim_in_flight(
        &store,
        "",
        "k-live-lease",
        Duration::from_secs(60),
        Duration::from_millis(1),
    )
    .await;
    tokio::time::sleep(Duration::from_millis(20)).await;
    assert_eq!(h.record_count().await, 7);

    let metrics = Metrics::new();
    let deleted = idemproxy::sweeper::sweep_once(&store, &metrics, 2)
        .await
        .unwrap();
    assert_eq!(
        deleted, 5,
        "4 expired completed records + 1 expired abandoned claim"
    );
    assert_eq!(h.record_count().await, 2);
    assert_eq!(
        h.record_state("", "k-fresh").await,
        Some(("completed".into(), 1))
    );
    assert_eq!(
        h.record_state("", "k-live-lease").await,
        Some(("in_flight".into(), 1))
    );
    let text = metrics.render();
    assert!(text.contains("idemproxy_sweeper_deleted_total 5"), "{text}");

    // A second pass has nothing to do.
    assert_eq!(
        idemproxy::sweeper::sweep_once(&store, &metrics, 2)
            .await
            .unwrap(),
        0
    );
    assert!(metrics
        .render()
        .contains("idemproxy_sweeper_deleted_total 5"));
    assert_eq!(h.record_count().await, 2);
}

// The sweeper's batches: oldest expiry first, each starting at the latest
// expiry the previous batch deleted; a record another transaction holds is
// skipped and left to the next pass (docs/retention.md).
#[tokio::test]
async fn sweep_batches_resume_in_expiry_order_and_leave_locked_records_to_the_next_pass() {
    let db = TestDb::new().await;
    let store = store_for(&db.url);
    store.migrate().await.unwrap();
    let c = db.client().await;
    // k-1 .. k-5 expired 1 .. 5 minutes ago; k-live expires tomorrow.
    c.batch_execute(
        "INSERT INTO idempotency_records
             (tenant_id, idempotency_key, fingerprint, owner_token, attempt, state,
              created_at, completed_at, expires_at, response_status)
         SELECT '', k, sha256(convert_to(k, 'UTF8')), gen_random_uuid(), 1, 'completed',
                now() - interval '1 day', now() - interval '1 day', now() + m * interval '1 minute', 200
           FROM (VALUES ('k-1', -1), ('k-2', -2), ('k-3', -3), ('k-4', -4), ('k-5', -5),
                        ('k-live', 1440)) AS v(k, m)",
    )
    .await
    .unwrap();
    let keys = || async {
        let rows = c
            .query(
                "SELECT idempotency_key FROM idempotency_records ORDER BY idempotency_key",
                &[],
            )
            .await
            .unwrap();
        rows.iter().map(|r| r.get(0)).collect::<Vec<String>>()
    };
    let expiry = |key: &'static str| {
        let c = &c;
        async move {
            c.query_one(
                "SELECT expires_at FROM idempotency_records WHERE idempotency_key = $1",
                &[&key],
            )
            .await
            .unwrap()
            .get::<_, std::time::SystemTime>(0)
        }
    };

    let k4 = expiry("k-4").await;
    let first = store.sweep_batch(2, None).await.unwrap();
    assert_eq!((first.deleted, first.last_expiry), (2, Some(k4)));
    assert_eq!(keys().await, ["k-1", "k-2", "k-3", "k-live"]);

    // Another transaction holds k-3.
    let mut locker = db.client().await;
    let tx = support::records::lock_key(&mut locker, "k-3").await;
    let k1 = expiry("k-1").await;
    let second = store.sweep_batch(2, first.last_expiry).await.unwrap();
    assert_eq!((second.deleted, second.last_expiry), (2, Some(k1)));
    assert_eq!(keys().await, ["k-3", "k-live"]);
    tx.commit().await.unwrap();

    // The rest of this pass starts after k-3's expiry: nothing left there.
    let third = store.sweep_batch(2, second.last_expiry).await.unwrap();
    assert_eq!((third.deleted, third.last_expiry), (0, None));
    // The next pass starts from the oldest again.
    let metrics = Metrics::new();
    let deleted = idemproxy::sweeper::sweep_once(&store, &metrics, 2)
        .await
        .unwrap();
    assert_eq!(deleted, 1);
    assert_eq!(keys().await, ["k-live"]);
}

// §7 migrations: replicas may start at once; each migration is applied once.
#[tokio::test]
async fn concurrent_migrations_apply_each_version_exactly_once() {
    let db = TestDb::new().await;
    let store = store_for(&db.url);
    assert!(
        !store.ready().await.unwrap(),
        "a fresh database is not ready"
    );

    let mut tasks = Vec::new();
    for _ in 0..6 {
        let store = store.clone();
        tasks.push(tokio::spawn(async move { store.migrate().await }));
    }
    let mut applied = Vec::new();
    for t in tasks {
        applied.extend(t.await.unwrap().expect("every concurrent migrate succeeds"));
    }
    applied.sort_unstable();
    let versions: Vec<i32> = MIGRATIONS.iter().map(|m| m.version).collect();
    assert_eq!(
        applied, versions,
        "each migration applied by exactly one task"
    );

    let c = db.client().await;
    let rows = c
        .query(
            "SELECT version, count(*) FROM idemproxy_schema_migrations GROUP BY version ORDER BY version",
            &[],
        )
        .await
        .unwrap();
    let recorded: Vec<(i32, i64)> = rows.iter().map(|r| (r.get(0), r.get(1))).collect();
    assert_eq!(
        recorded,
        versions.iter().map(|v| (*v, 1)).collect::<Vec<_>>()
    );

    assert_eq!(
        store.migrate().await.unwrap(),
        Vec::<i32>::new(),
        "second run applies nothing"
    );
    assert!(store.ready().await.unwrap());
}

// §5: /healthz is liveness, /readyz readiness.
#[tokio::test]
async fn healthz_and_readyz_answer_200_when_the_database_is_up() {
    let h = support::harness::Harness::start(Setup::default()).await;
    let health = get(&h.admin_url("/healthz")).await;
    assert_eq!(health.status, StatusCode::OK);
    let ready = get(&h.admin_url("/readyz")).await;
    assert_eq!(ready.status, StatusCode::OK, "{}", ready.text());
    let missing = get(&h.admin_url("/nope")).await;
    assert_eq!(missing.status, StatusCode::NOT_FOUND);
}

// §6, §8.1: `serve` starts with the database unreachable; keyed requests
// fail closed, but the process stays ready: readiness never follows the
// shared store (a store outage must not pull every replica out of its
// Service), and pass-through traffic keeps flowing.
#[tokio::test]
async fn unreachable_database_keeps_readyz_but_not_readyz_store_and_503s_keyed_requests() {
    let h = support::harness::Harness::start(
        Setup::default().database_url("postgres://postgres@127.0.0.1:1/nope"),
    )
    .await;
    let health = get(&h.admin_url("/healthz")).await;
    assert_eq!(health.status, StatusCode::OK);

    let t = Instant::now();
    let store_ready = get(&h.admin_url("/readyz/store")).await;
    assert_eq!(
        store_ready.status,
        StatusCode::SERVICE_UNAVAILABLE,
        "{}",
        store_ready.text()
    );
    assert!(
        t.elapsed() < Duration::from_secs(3),
        "readyz/store took {:?}",
        t.elapsed()
    );
    let ready = get(&h.admin_url("/readyz")).await;
    assert_eq!(ready.status, StatusCode::OK, "{}", ready.text());
    assert!(
        ready.text().contains("store: unreachable"),
        "{}",
        ready.text()
    );
    let metrics = get(&h.admin_url("/metrics")).await.text();
    assert!(
        metrics.lines().any(|l| l == "idemproxy_store_up 0"),
        "{metrics}"
    );

    let t = Instant::now();
    let r = h.post("/v1/payments", "k-no-db", PAY).await;
    r.assert_problem(503, "store-unavailable");
    assert!(
        t.elapsed() < Duration::from_secs(3),
        "keyed request took {:?}",
        t.elapsed()
    );
    let retry_after: u64 = r
        .header("retry-after")
        .expect("Retry-After on 503")
        .parse()
        .expect("Retry-After in seconds");
    assert!(retry_after >= 1);
    assert_eq!(
        h.upstream.total_requests(),
        0,
        "nothing forwarded (fail closed)"
    );
    let m = h
        .running()
        .metrics
        .request_count("default", idemproxy::metrics::Outcome::StoreError);
    assert_eq!(m, 1);
    // Pass-through traffic needs no store.
    let r = h.send(Req::get("/v1/payments/lookup")).await;
    assert!(r.status.is_success(), "{}", r.text());
    assert_eq!(h.upstream.total_requests(), 1);
}

// §6: `serve` keeps retrying to connect and migrate.
#[tokio::test]
async fn proxy_becomes_ready_once_its_database_appears() {
    let name = support::db::unique_database_name("late");
    let url = support::db::database_url(&name);
    // Drops the database at the end (it is created below), even on panic.
    let _guard = TestDb {
        name: name.clone(),
        url: url.clone(),
    };
    let h = support::harness::Harness::start(Setup::default().database_url(&url)).await;
    let ready = get(&h.admin_url("/readyz/store")).await;
    assert_eq!(
        ready.status,
        StatusCode::SERVICE_UNAVAILABLE,
        "{}",
        ready.text()
    );
    h.post("/v1/payments", "k-late", PAY)
        .await
        .assert_problem(503, "store-unavailable");

    let admin = support::db::connect(&support::db::admin_url()).await;
    admin
        .batch_execute(&format!("CREATE DATABASE {name}"))
        .await
        .unwrap();

    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let r = get(&h.admin_url("/readyz/store")).await;
        if r.status == StatusCode::OK {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "never became ready: {}",
            r.text()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let r = h.post("/v1/payments", "k-late", PAY).await;
    assert_eq!(r.status, 201, "{}", r.text());
    assert!(!r.replayed());
    assert_eq!(h.upstream.executions("k-late"), 1);
    let again = h.post("/v1/payments", "k-late", PAY).await;
    assert!(again.replayed());
}

// §5 SIGTERM: stop accepting, report not-ready, finish in-flight requests.
#[tokio::test]
async fn shutdown_drains_in_flight_requests_refuses_new_connections_and_reports_not_ready() {
    let mut h =
        support::harness::Harness::start(Setup::default().defaults("lease = \"5s\"\n")).await;
    let proxy_addr = h.running().proxy_addr;
    let admin_addr = h.running().admin_addr;
    let url = h.url("/v1/payments");
    let slow = tokio::spawn(async move {
        HttpClient::new()
            .send(
                Req::post(&url)
                    .key("k-drain")
                    .json(PAY)
                    .header("x-sample-delay-ms", "1000"),
            )
            .await
    });
    h.wait_executions("k-drain", 1).await;
    assert_eq!(
        h.upstream.executions("k-drain"),
        1,
        "the slow request reached the upstream"
    );

    let running = h.proxy.take().unwrap();
    let started = Instant::now();
    let shutdown = tokio::spawn(async move {
        running.shutdown().await;
        started.elapsed()
    });

    // A new connection is refused soon after the drain starts (one caught
    // in the closing listener's backlog may be reset instead).
    let deadline = Instant::now() + Duration::from_millis(500);
    loop {
        let attempt = tokio::net::TcpStream::connect(proxy_addr).await;
        if matches!(&attempt, Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the proxy still accepts connections while draining: {attempt:?}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // Not ready while draining (the admin listener is still up).
    let ready = get(&format!("http://{admin_addr}/readyz")).await;
    assert_eq!(
        ready.status,
        StatusCode::SERVICE_UNAVAILABLE,
        "{}",
        ready.text()
    );
    assert!(ready.text().contains("draining"), "{}", ready.text());
    let health = get(&format!("http://{admin_addr}/healthz")).await;
    assert_eq!(health.status, StatusCode::OK);
    assert!(!slow.is_finished(), "the checks above ran during the drain");

    let r = slow.await.unwrap();
    assert_eq!(r.status, 201, "{}", r.text());
    assert!(!r.replayed());
    let took = tokio::time::timeout(Duration::from_secs(10), shutdown)
        .await
        .expect("shutdown hung")
        .unwrap();
    assert!(
        took < Duration::from_secs(3),
        "shutdown took {took:?} (grace is 5s)"
    );
    assert_eq!(
        h.record_state("", "k-drain").await,
        Some(("completed".into(), 1))
    );
    assert_eq!(h.upstream.executions("k-drain"), 1);
    // The admin listener is gone too.
    assert!(tokio::net::TcpStream::connect(admin_addr).await.is_err());
}

// §5: Prometheus text; outcomes by route, never by key or tenant.
#[tokio::test]
async fn metrics_count_outcomes_by_route_without_keys_or_tenants() {
    let h = support::harness::Harness::start(Setup::default().routes(
        "[[route]]\nname = \"default\"\npath_prefix = \"/\"\ntenant_header = \"X-Tenant-ID\"\n",
    ))
    .await;
    let key = "key-very-secret-4711";
    let tenant = "tenant-very-secret-0815";
    let r = h
        .send(
            Req::post("/v1/payments")
                .key(key)
                .header("X-Tenant-ID", tenant)
                .json(PAY),
        )
        .await;
    assert_eq!(r.status, 201, "{}", r.text());
    let g = h
        .send(Req::get("/v1/payments").header("X-Tenant-ID", tenant))
        .await;
    assert_eq!(g.status, 201, "{}", g.text());
    assert_eq!(
        h.record_state(tenant, key).await,
        Some(("completed".into(), 1))
    );

    let m = get(&h.admin_url("/metrics")).await;
    assert_eq!(m.status, StatusCode::OK);
    let text = m.text();
    assert!(
        text.contains(
            r#"idemproxy_requests_total{status_class="2xx",route="default",outcome="claimed"} 1"#
        ),
        "{text}"
    );
    // The GET is not keyed on its route: counted as a pass-through (its
    // route label is the route's name or "unrouted").
    assert!(
        text.lines()
            .any(|l| l.starts_with("idemproxy_requests_total{")
                && l.ends_with(r#"outcome="passthrough"} 1"#)),
        "{text}"
    );
    assert!(text.contains("idemproxy_store_pool_connections"), "{text}");
    assert!(
        text.contains("idemproxy_upstream_duration_seconds"),
        "{text}"
    );
    assert!(!text.contains(key), "metrics name the key:\n{text}");
    assert!(!text.contains(tenant), "metrics name the tenant:\n{text}");
    assert!(
        !text.contains("/v1/payments"),
        "metrics name a raw path:\n{text}"
    );
}

// Both protocols on one port: h2c prior knowledge and HTTP/1.1 share keys.
#[tokio::test]
async fn h2c_keyed_post_executes_once_and_replays_over_h2c_and_http1() {
    let h = support::harness::Harness::start(Setup::default()).await;
    let h2 = HttpClient::h2c();
    let url = h.url("/v1/payments");
    let first = h2.send(Req::post(&url).key("k-h2c").json(PAY)).await;
    assert_eq!(first.status, 201, "{}", first.text());
    assert!(!first.replayed());
    assert_eq!(h.upstream.executions("k-h2c"), 1);

    let over_h2 = h2.send(Req::post(&url).key("k-h2c").json(PAY)).await;
    assert_eq!(over_h2.status, 201);
    assert!(over_h2.replayed(), "{:?}", over_h2.headers);
    assert_eq!(over_h2.body, first.body);

    let over_h1 = h.post("/v1/payments", "k-h2c", PAY).await;
    assert_eq!(over_h1.status, 201);
    assert!(over_h1.replayed(), "{:?}", over_h1.headers);
    assert_eq!(over_h1.body, first.body);
    assert_eq!(h.upstream.executions("k-h2c"), 1);
}

// DESIGN.md §8.4: a statement cut off by store.timeout (here: blocked by a
// lock, as on a frozen primary) must not hand its connection, with the
// late answer still due on it, to the next caller: the connection is closed
// and the pool opens a fresh one.
#[tokio::test]
async fn a_connection_whose_statement_timed_out_is_closed_not_reused() {
    let h = support::harness::Harness::start(Setup::default()).await;
    let mut config = h.setup.config(&h.upstream.url(), &h.db.url).store;
    config.timeout = Duration::from_millis(300);
    let store = Store::new(&config).unwrap();
    store.show("", "warm-up", false).await.unwrap();
    let (open_before, idle_before, _) = store.pool_status();
    assert_eq!((open_before, idle_before), (1, 1));

    let mut locker = h.db.client().await;
    let tx = locker.transaction().await.unwrap();
    tx.batch_execute("LOCK TABLE idempotency_records IN ACCESS EXCLUSIVE MODE")
        .await
        .unwrap();
    let t = Instant::now();
    let err = store.show("", "blocked", false).await.unwrap_err();
    assert!(
        matches!(err, idemproxy::store::StoreError::Timeout(_)),
        "{err}"
    );
    assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
    let (open_after, _, _) = store.pool_status();
    assert_eq!(open_after, 0, "the cut-off connection left the pool");
    // Its backend sees the client gone once the lock is released; the
    // next caller gets a fresh connection and a correct answer.
    tx.rollback().await.unwrap();
    assert!(store.show("", "blocked", false).await.unwrap().is_none());
    assert_eq!(store.pool_status().0, 1);
}
