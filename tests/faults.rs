//! Faults, with the real binaries as separate processes: a proxy killed or
//! paused mid-flight, a database restarted, late or failed over, an
//! upstream that dies, crawls or is abandoned by its client, and SIGTERM.
//! RELIABILITY.md tells what each test shows and how long it takes.
//!
//! Leases are short (600 ms – 3 s) so that every test takes seconds. The
//! tests that stop their database use private clusters
//! ([`support::pgcluster`]); the others a fresh database on the shared test
//! server.

mod support;

use std::time::{Duration, Instant};

use http::StatusCode;
use support::db::DbLocale;
use support::db::TestDb;
use support::eventually;
use support::pgbouncer::{PgBouncer, PgBouncerOptions};
use support::pgcluster::{self, PgCluster};
use support::process::{connection_refused, TempDir};
use support::proxy_proc::{ProxyConfig, ProxyProc};
use support::records::{read_row, wait_lease_expired};
use support::upstream_proc::UpstreamProc;

const PAY: &str = r#"{"amount": 100, "currency": "EUR"}"#;
const LOST_LEASE: &str = r#"idemproxy_requests_total{route="default",outcome="lost_lease"}"#;
const STORE_ERROR: &str = r#"idemproxy_requests_total{route="default",outcome="store_error"}"#;
const TAKEOVERS: &str = "idemproxy_takeovers_total";

fn spawn_post(
    proxy: &ProxyProc,
    key: &str,
    headers: &[(&str, &str)],
    timeout: Duration,
) -> tokio::task::JoinHandle<Result<support::http::Resp, String>> {
    let url = proxy.url("/v1/orders");
    let mut req = support::http::Req::post(&url).key(key).json(PAY);
    for (n, v) in headers {
        req = req.header(n, v);
    }
    tokio::spawn(async move {
        match tokio::time::timeout(timeout, support::http::HttpClient::new().try_send(req)).await {
            Ok(r) => r,
            Err(_) => Err("no answer".into()),
        }
    })
}

// ---------------------------------------------------------------------------
// 1. Crash mid-flight.

#[tokio::test]
async fn sigkilled_proxy_leaves_its_claim_to_expire_then_a_retry_takes_over_with_attempt_2() {
    let dir = TempDir::new("crash");
    let db = TestDb::new().await;
    let sql = db.client().await;
    let up = UpstreamProc::start(&dir).await;
    let mut proxy = ProxyProc::start(
        &dir,
        "proxy",
        &ProxyConfig::new(&up.url(), &db.url).lease("3s"),
    )
    .await;

    let original = spawn_post(
        &proxy,
        "k-crash",
        &[("x-sample-delay-ms", "2000")],
        Duration::from_secs(10),
    );
    up.wait_executions("k-crash", 1, Duration::from_secs(10))
        .await;
    let claimed = read_row(&sql, "", "k-crash").await.unwrap();
    assert_eq!((claimed.state.as_str(), claimed.attempt), ("in_flight", 1));

    proxy.proc.kill();
    let lost = original.await.unwrap();
    assert!(
        lost.is_err(),
        "the client of a killed proxy gets no answer: {lost:?}"
    );
    proxy.restart().await;

    // The lease the dead owner renewed is still valid: a retry is a 409.
    let row = read_row(&sql, "", "k-crash").await.unwrap();
    assert_eq!(
        row.lease_expired,
        Some(false),
        "restart took longer than the lease"
    );
    let early = proxy.post("k-crash", PAY, &[]).await;
    early.assert_problem(409, "request-in-progress");
    assert!(early.header("retry-after").is_some());
    assert_eq!(up.executions("k-crash").await, 1);

    // Once it runs out (no one renews it), a retry takes over.
    wait_lease_expired(&sql, "k-crash", Duration::from_secs(5)).await;
    let retry = proxy.post("k-crash", PAY, &[]).await;
    assert_eq!(retry.status, StatusCode::CREATED, "{}", retry.text());
    assert!(!retry.replayed());
    assert_eq!(retry.header("x-request-echo-attempt"), Some("2"));
    assert_eq!(
        retry.json()["attempt"],
        "2",
        "the upstream saw Idempotency-Attempt: 2"
    );
    let done = read_row(&sql, "", "k-crash").await.unwrap();
    assert_eq!((done.state.as_str(), done.attempt), ("completed", 2));
    assert_ne!(
        done.owner, claimed.owner,
        "a takeover mints a new owner token"
    );
    // The first attempt ran too (its outcome was unknown): 1 + 1 takeover.
    assert_eq!(up.executions("k-crash").await, 2);
    assert_eq!(proxy.metric(TAKEOVERS).await, 1.0);

    let replay = proxy.post("k-crash", PAY, &[]).await;
    assert!(replay.replayed());
    assert_eq!(replay.body, retry.body);
    assert_eq!(up.executions("k-crash").await, 2);
}

// ---------------------------------------------------------------------------
// 2. Paused owner: the fence.

#[tokio::test]
async fn paused_owner_is_fenced_out_its_client_gets_its_answer_and_the_takeover_response_stays() {
    let dir = TempDir::new("pause");
    let db = TestDb::new().await;
    let sql = db.client().await;
    let up = UpstreamProc::start(&dir).await;
    let config = ProxyConfig::new(&up.url(), &db.url).lease("600ms");
    let a = ProxyProc::start(&dir, "proxy-a", &config).await;
    let b = ProxyProc::start(&dir, "proxy-b", &config).await;

    let via_a = spawn_post(
        &a,
        "k-fence",
        &[("x-sample-delay-ms", "1500")],
        Duration::from_secs(15),
    );
    up.wait_executions("k-fence", 1, Duration::from_secs(10))
        .await;
    let a_claim = read_row(&sql, "", "k-fence").await.unwrap();

    a.proc.pause();
    wait_lease_expired(&sql, "k-fence", Duration::from_secs(5)).await;
    let via_b = b.post("k-fence", PAY, &[]).await;
    assert_eq!(via_b.status, StatusCode::CREATED, "{}", via_b.text());
    assert!(!via_b.replayed());
    assert_eq!(via_b.header("x-request-echo-attempt"), Some("2"));
    let b_stored = read_row(&sql, "", "k-fence").await.unwrap();
    assert_eq!(
        (b_stored.state.as_str(), b_stored.attempt),
        ("completed", 2)
    );
    assert_ne!(b_stored.owner, a_claim.owner);
    assert_eq!(b_stored.body.as_deref(), Some(&via_b.body[..]));

    a.proc.resume();
    let a_answer = via_a.await.unwrap().expect("A's client gets an answer");
    // A's client gets what the upstream told A: the truth of attempt 1.
    assert_eq!(a_answer.status, StatusCode::CREATED, "{}", a_answer.text());
    assert!(!a_answer.replayed());
    assert_eq!(a_answer.header("x-request-echo-attempt"), Some("1"));
    assert_ne!(a_answer.body, via_b.body);

    // The fence refused A's completion: B's response is still the stored one.
    let after = read_row(&sql, "", "k-fence").await.unwrap();
    assert_eq!(after.owner, b_stored.owner);
    assert_eq!(after.attempt, 2);
    let text = |b: &Option<Vec<u8>>| {
        String::from_utf8_lossy(b.as_deref().unwrap_or_default()).into_owned()
    };
    assert_eq!(
        text(&after.body),
        text(&b_stored.body),
        "B's stored response was overwritten"
    );
    assert_eq!(a.metric(LOST_LEASE).await, 1.0, "{}", a.metrics().await);
    assert!(a.proc.log_text().contains("lease lost"));
    assert_eq!(up.executions("k-fence").await, 2, "1 + 1 takeover");

    for (name, p) in [("A", &a), ("B", &b)] {
        let r = p.post("k-fence", PAY, &[]).await;
        assert!(r.replayed(), "via {name}: {}", r.text());
        assert_eq!(r.body, via_b.body, "via {name}: not B's response");
    }
    assert_eq!(up.executions("k-fence").await, 2);
}

// ---------------------------------------------------------------------------
// 2b. A claim answered after its lease ran out.
//
// The claim statement waits (on a row another transaction is inserting)
// for longer than the lease, then commits: its lease (now() + lease, now()
// the statement's start) has run out by the time the proxy hears of it, as
// after a database stall or a proxy descheduled or paused while it waited.
// Forwarding at once would race a retry's takeover into a second execution.

/// Holds `key` behind an uncommitted insert of the same record, in an open
/// transaction: a claim of `key` waits on it until it ends (ROLLBACK).
async fn hold_key(db_url: &str, key: &str) -> tokio_postgres::Client {
    let locker = support::db::connect(db_url).await;
    locker.batch_execute("BEGIN").await.unwrap();
    locker
        .execute(
            "INSERT INTO idempotency_records
                 (tenant_id, idempotency_key, fingerprint, owner_token, attempt, state,
                  lease_expires_at, created_at, expires_at)
             VALUES ('', $1, sha256('held'::bytea), gen_random_uuid(), 1, 'in_flight',
                     now() + interval '1 minute', now(), now() + interval '1 hour')",
            &[&key],
        )
        .await
        .unwrap();
    locker
}

/// Waits until a statement waits on a lock (the claim, behind `hold_key`).
async fn claim_waits_on_the_lock(sql: &tokio_postgres::Client) {
    support::eventually(
        Duration::from_secs(5),
        "a claim waiting on the lock",
        || async {
            let row = sql
                .query_one(
                    "SELECT count(*) FROM pg_stat_activity
                  WHERE datname = current_database() AND wait_event_type = 'Lock'",
                    &[],
                )
                .await
                .unwrap();
            row.get::<_, i64>(0) > 0
        },
    )
    .await;
}

/// Two proxies (lease 600 ms, store timeout 5 s) on one database, and a
/// POST of `key` sent through A whose claim waits behind `hold_key`.
/// (Fields drop in order: the processes before their database and files.)
struct LateClaim {
    via_a: tokio::task::JoinHandle<Result<support::http::Resp, String>>,
    a: ProxyProc,
    b: ProxyProc,
    up: UpstreamProc,
    locker: tokio_postgres::Client,
    sql: tokio_postgres::Client,
    _bouncer: Option<PgBouncer>,
    _db: TestDb,
    _dir: TempDir,
}

/// Where the proxies of a [`LateClaim`] keep their records.
#[derive(Clone, Copy, PartialEq)]
enum LateStore {
    /// The test server, directly.
    Direct,
    /// An ICU en-US database behind PgBouncer in transaction mode
    /// (DESIGN §8.1, §8.5).
    PooledEnUs,
}

async fn late_claim(
    name: &str,
    key: &str,
    headers: &[(&str, &str)],
    store: LateStore,
) -> LateClaim {
    let dir = TempDir::new(name);
    let db = match store {
        LateStore::Direct => TestDb::new().await,
        LateStore::PooledEnUs => TestDb::with_locale(DbLocale::IcuEnUs).await,
    };
    let sql = db.client().await;
    let up = UpstreamProc::start(&dir).await;
    let bouncer = match store {
        LateStore::Direct => None,
        LateStore::PooledEnUs => {
            Some(PgBouncer::start(name, &db.url, PgBouncerOptions::default()).await)
        }
    };
    let config = match &bouncer {
        None => ProxyConfig::new(&up.url(), &db.url),
        Some(b) => ProxyConfig::new(&up.url(), &b.url(&db.name)).pooled(&db.url),
    }
    .lease("600ms")
    .store_timeout("5s");
    let a = ProxyProc::start(&dir, "proxy-a", &config).await;
    let b = ProxyProc::start(&dir, "proxy-b", &config).await;
    let locker = hold_key(&db.url, key).await;
    let via_a = spawn_post(&a, key, headers, Duration::from_secs(15));
    claim_waits_on_the_lock(&sql).await;
    LateClaim {
        _dir: dir,
        _db: db,
        _bouncer: bouncer,
        sql,
        up,
        a,
        b,
        via_a,
        locker,
    }
}

#[tokio::test]
async fn a_claim_answered_after_its_lease_ran_out_is_renewed_before_it_is_forwarded() {
    let t = late_claim(
        "late-claim",
        "k-late",
        &[("x-sample-delay-ms", "1500")],
        LateStore::Direct,
    )
    .await;
    tokio::time::sleep(Duration::from_millis(900)).await;
    t.locker.batch_execute("ROLLBACK").await.unwrap();
    // A's claim committed with a lease that had run out already; A renewed
    // it before forwarding, so the retry right behind finds it held.
    t.up.wait_executions("k-late", 1, Duration::from_secs(5))
        .await;
    let row = read_row(&t.sql, "", "k-late").await.unwrap();
    assert_eq!(
        (row.state.as_str(), row.lease_expired),
        ("in_flight", Some(false))
    );
    t.b.post("k-late", PAY, &[])
        .await
        .assert_problem(409, "request-in-progress");

    let a_answer = t.via_a.await.unwrap().expect("A's client gets an answer");
    assert_eq!(a_answer.status, StatusCode::CREATED, "{}", a_answer.text());
    assert_eq!(a_answer.header("x-request-echo-attempt"), Some("1"));
    let replay = t.b.post("k-late", PAY, &[]).await;
    assert!(replay.replayed(), "{}", replay.text());
    assert_eq!(replay.body, a_answer.body);
    assert_eq!(t.up.executions("k-late").await, 1);
    assert_eq!(
        t.a.metric(TAKEOVERS).await + t.b.metric(TAKEOVERS).await,
        0.0
    );
    assert_eq!(t.a.metric(LOST_LEASE).await, 0.0, "{}", t.a.metrics().await);
}

#[tokio::test]
async fn a_claim_whose_answer_outlived_its_lease_and_its_key_is_not_forwarded() {
    stale_claim_is_not_forwarded("stale-claim", LateStore::Direct).await;
}

#[tokio::test]
async fn a_stale_claim_is_not_forwarded_behind_pgbouncer_on_an_en_us_database() {
    stale_claim_is_not_forwarded("stale-claim-pooled", LateStore::PooledEnUs).await;
}

async fn stale_claim_is_not_forwarded(name: &str, store: LateStore) {
    // A sends its claim, then is paused before it hears the answer: the
    // claim commits behind A's back and its lease runs out.
    let t = late_claim(name, "k-stale", &[], store).await;
    t.a.proc.pause();
    t.locker.batch_execute("ROLLBACK").await.unwrap();
    support::eventually(Duration::from_secs(5), "A's claim committed", || async {
        read_row(&t.sql, "", "k-stale").await.is_some()
    })
    .await;
    wait_lease_expired(&t.sql, "k-stale", Duration::from_secs(5)).await;
    let via_b = t.b.post("k-stale", PAY, &[]).await;
    assert_eq!(via_b.status, StatusCode::CREATED, "{}", via_b.text());
    assert_eq!(via_b.header("x-request-echo-attempt"), Some("2"));

    // A resumes to its claim's answer: its renewal finds the key taken
    // over, and nothing is forwarded.
    t.a.proc.resume();
    let a_answer = t.via_a.await.unwrap().expect("A's client gets an answer");
    a_answer.assert_problem(409, "request-in-progress");
    assert!(a_answer.header("retry-after").is_some());
    assert_eq!(t.up.executions("k-stale").await, 1, "B's execution only");
    assert_eq!(t.a.metric(LOST_LEASE).await, 1.0, "{}", t.a.metrics().await);
    assert!(t
        .a
        .proc
        .log_text()
        .contains("lease ran out before it could be forwarded"));
    let row = read_row(&t.sql, "", "k-stale").await.unwrap();
    assert_eq!((row.state.as_str(), row.attempt), ("completed", 2));
    assert_eq!(row.body.as_deref(), Some(&via_b.body[..]));
}

// ---------------------------------------------------------------------------
// 3. Database restart under traffic (private cluster).

/// What the traffic clients saw.
#[derive(Default)]
struct Seen {
    /// Key → the answer the client accepted.
    acknowledged: Vec<(String, bytes::Bytes)>,
    /// 503s, and how many of them had no Retry-After.
    unavailable: u32,
    unavailable_without_retry_after: u32,
    conflicts: u32,
    errors: u32,
    other: Vec<String>,
}

/// A client that keeps sending new keys, each retried until the proxy
/// gives a definitive answer, until `stop` is set.
async fn traffic(
    proxy_url: String,
    client_no: usize,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
) -> Seen {
    use std::sync::atomic::Ordering;
    let mut seen = Seen::default();
    let mut n = 0;
    while !stop.load(Ordering::Relaxed) {
        n += 1;
        let key = format!("t{client_no}-{n}");
        let body = format!(r#"{{"client": {client_no}, "n": {n}}}"#);
        for _ in 0..300 {
            let req = support::http::Req::post(&proxy_url)
                .key(&key)
                .json(&body)
                .header("x-sample-delay-ms", "30");
            let r = tokio::time::timeout(
                Duration::from_secs(5),
                support::http::HttpClient::new().try_send(req),
            )
            .await;
            match r {
                Ok(Ok(r)) if r.status == StatusCode::CREATED => {
                    seen.acknowledged.push((key.clone(), r.body));
                    break;
                }
                Ok(Ok(r)) if r.status == StatusCode::SERVICE_UNAVAILABLE => {
                    seen.unavailable += 1;
                    if r.header("retry-after").is_none() {
                        seen.unavailable_without_retry_after += 1;
                    }
                }
                Ok(Ok(r)) if r.status == StatusCode::CONFLICT => seen.conflicts += 1,
                Ok(Ok(r)) => seen.other.push(format!("{key}: {} {}", r.status, r.text())),
                _ => seen.errors += 1,
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    seen
}

#[tokio::test]
async fn database_restart_under_traffic_fails_closed_recovers_by_itself_and_loses_nothing() {
    let Some(bindir) = pgcluster::bindir_or_skip("database restart under traffic") else {
        return;
    };
    let dir = TempDir::new("dbrestart");
    let pg = PgCluster::init(&bindir, "restart", "");
    pg.start();
    let db_url = pg.url("postgres");
    let up = UpstreamProc::start(&dir).await;
    let lease = Duration::from_secs(1);
    let proxy = ProxyProc::start(
        &dir,
        "proxy",
        &ProxyConfig::new(&up.url(), &db_url)
            .lease("1s")
            .store_timeout("500ms"),
    )
    .await;

    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let clients: Vec<_> = (0..4)
        .map(|i| tokio::spawn(traffic(proxy.url("/v1/orders"), i, stop.clone())))
        .collect();
    tokio::time::sleep(Duration::from_millis(800)).await;

    // What is completed before the restart must be there after it.
    let before: Vec<(String, Vec<u8>)> = {
        let sql = support::db::connect(&db_url).await;
        sql.query(
            "SELECT idempotency_key, response_body FROM idempotency_records WHERE state = 'completed'",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect()
    };
    assert!(
        !before.is_empty(),
        "no traffic completed before the restart"
    );

    pg.stop_fast();
    let down_at = Instant::now();
    // While it is down: 503 + Retry-After within the store timeout, and
    // nothing reaches the upstream.
    let mut probes = Vec::new();
    for i in 0..5 {
        let key = format!("probe-down-{i}");
        let t = Instant::now();
        let r = proxy.post(&key, PAY, &[]).await;
        r.assert_problem(503, "store-unavailable");
        assert!(r.header("retry-after").is_some());
        assert!(
            t.elapsed() < Duration::from_millis(1500),
            "took {:?}",
            t.elapsed()
        );
        probes.push(key);
        tokio::time::sleep(Duration::from_millis(150)).await;
    }
    // The store is not ready, the process is (DESIGN.md §8.1): an outage
    // must not pull every replica out of its Service.
    let store_ready = proxy.store_readyz().await.unwrap();
    assert_eq!(
        store_ready.status,
        StatusCode::SERVICE_UNAVAILABLE,
        "{}",
        store_ready.text()
    );
    let ready = proxy.readyz().await.unwrap();
    assert_eq!(ready.status, StatusCode::OK, "{}", ready.text());
    pg.start();
    let up_at = Instant::now();
    let outage = up_at - down_at;

    // The pool recovers by itself: no restart of the proxy.
    let recovered_in = proxy.wait_ready(Duration::from_secs(10)).await;
    let first_ok = {
        let t = Instant::now();
        loop {
            let r = proxy.post("after-restart", PAY, &[]).await;
            if r.status == StatusCode::CREATED {
                break t.elapsed();
            }
            assert!(t.elapsed() < Duration::from_secs(10), "{}", r.text());
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    tokio::time::sleep(Duration::from_millis(800)).await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let mut seen = Seen::default();
    for c in clients {
        let s = c.await.unwrap();
        seen.acknowledged.extend(s.acknowledged);
        seen.unavailable += s.unavailable;
        seen.unavailable_without_retry_after += s.unavailable_without_retry_after;
        seen.conflicts += s.conflicts;
        seen.errors += s.errors;
        seen.other.extend(s.other);
    }
    assert!(
        seen.other.is_empty(),
        "unexpected answers: {:?}",
        seen.other
    );
    assert!(seen.unavailable > 0, "the clients never saw the outage");
    assert_eq!(seen.unavailable_without_retry_after, 0);

    // No key stuck: once past the lease (and the background completion
    // retries of responses that could not be stored during the outage),
    // nothing is in flight.
    let sql = support::db::connect(&db_url).await;
    let settle_deadline = Instant::now() + lease + Duration::from_secs(8);
    loop {
        let n: i64 = sql
            .query_one(
                "SELECT count(*) FROM idempotency_records WHERE state = 'in_flight'",
                &[],
            )
            .await
            .unwrap()
            .get(0);
        if n == 0 {
            break;
        }
        assert!(Instant::now() < settle_deadline, "{n} keys still in flight");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // No completed record lost, none changed.
    for (key, body) in &before {
        let row = read_row(&sql, "", key).await;
        assert_eq!(
            row.as_ref().and_then(|r| r.body.as_deref()),
            Some(&body[..]),
            "{key} lost or changed"
        );
    }
    // Every acknowledged key is stored with the answer its client got, and
    // was executed once.
    let stats = up.stats().await;
    for (key, body) in &seen.acknowledged {
        let row = read_row(&sql, "", key)
            .await
            .expect("acknowledged key not stored");
        assert_eq!(row.state, "completed", "{key}");
        assert_eq!(
            row.body.as_deref(),
            Some(&body[..]),
            "{key}: stored ≠ answered"
        );
        assert_eq!(
            stats["keys"][key], 1,
            "{key} executed {} times",
            stats["keys"][key]
        );
    }
    for key in &probes {
        assert!(
            stats["keys"].get(key).is_none(),
            "{key} was forwarded while the store was down"
        );
    }
    assert!(proxy.metric(STORE_ERROR).await >= 5.0);
    eprintln!(
        "database restart: outage {outage:?}, ready again {recovered_in:?} after start, first keyed \
         success {first_ok:?} after ready; {} keys acknowledged ({} completed before), {} × 503, \
         {} × 409, {} client errors",
        seen.acknowledged.len(),
        before.len(),
        seen.unavailable,
        seen.conflicts,
        seen.errors
    );
}

// ---------------------------------------------------------------------------
// 4. Database unreachable at startup (private cluster).

#[tokio::test]
async fn proxy_started_before_its_database_is_not_ready_then_ready_once_it_appears() {
    let Some(bindir) = pgcluster::bindir_or_skip("database unreachable at startup") else {
        return;
    };
    let dir = TempDir::new("dblate");
    let pg = PgCluster::init(&bindir, "late", "");
    let up = UpstreamProc::start(&dir).await;
    let proxy = ProxyProc::spawn(
        &dir,
        "proxy",
        &ProxyConfig::new(&up.url(), &pg.url("postgres")).store_timeout("500ms"),
    );

    // It listens, is alive and ready (readiness never follows the store),
    // its store is not ready, and it fails closed.
    let deadline = Instant::now() + Duration::from_secs(10);
    let ready = loop {
        if let Some(r) = proxy.readyz().await {
            break r;
        }
        assert!(Instant::now() < deadline, "{}", proxy.proc.log_tail(20));
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!(ready.status, StatusCode::OK, "{}", ready.text());
    let store_ready = proxy.store_readyz().await.unwrap();
    assert_eq!(
        store_ready.status,
        StatusCode::SERVICE_UNAVAILABLE,
        "{}",
        store_ready.text()
    );
    let health = support::http::HttpClient::new()
        .send(support::http::Req::get(&proxy.admin_url("/healthz")))
        .await;
    assert_eq!(health.status, StatusCode::OK);
    let r = proxy.post("k-late", PAY, &[]).await;
    r.assert_problem(503, "store-unavailable");
    assert!(r.header("retry-after").is_some());
    assert_eq!(up.executions("k-late").await, 0);
    // The log line of the store's retry loop.
    eventually(
        Duration::from_secs(10),
        "a \"retrying\" log line",
        || async { proxy.proc.log_text().contains("retrying") },
    )
    .await;

    pg.start();
    let ready_in = proxy.wait_ready(Duration::from_secs(15)).await;
    let r = proxy.post("k-late", PAY, &[]).await;
    assert_eq!(r.status, StatusCode::CREATED, "{}", r.text());
    assert!(proxy.post("k-late", PAY, &[]).await.replayed());
    assert_eq!(up.executions("k-late").await, 1);
    eprintln!("database late at startup: ready {ready_in:?} after the database started");
}

// ---------------------------------------------------------------------------
// 5. Failover to a synchronous standby (two private clusters).

/// A primary and its synchronous standby (`pg_basebackup -R`), both
/// running, the standby streaming in sync.
async fn synchronous_pair(bindir: &std::path::Path) -> (PgCluster, PgCluster) {
    let primary = PgCluster::init(
        bindir,
        "primary",
        "synchronous_standby_names = '*'\nsynchronous_commit = on",
    );
    primary.start();
    // The standby must not wait for a standby of its own once promoted.
    let standby = PgCluster::standby_of(&primary, "standby", "synchronous_standby_names = ''");
    standby.start();
    let sql = support::db::connect(&primary.url("postgres")).await;
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let sync: i64 = sql
            .query_one(
                "SELECT count(*) FROM pg_stat_replication WHERE sync_state = 'sync'",
                &[],
            )
            .await
            .unwrap()
            .get(0);
        if sync == 1 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the standby never became synchronous"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    (primary, standby)
}

/// The primary first; only a server that accepts writes is used.
fn multi_host_url(primary: &PgCluster, standby: &PgCluster) -> String {
    format!(
        "postgres://postgres@127.0.0.1:{},127.0.0.1:{}/postgres?target_session_attrs=read-write",
        primary.port, standby.port
    )
}

#[tokio::test]
async fn failover_to_a_synchronous_standby_loses_no_acknowledged_key() {
    let Some(bindir) = pgcluster::bindir_or_skip("failover") else {
        return;
    };
    let dir = TempDir::new("failover");
    let (primary, standby) = synchronous_pair(&bindir).await;
    let url = multi_host_url(&primary, &standby);
    let up = UpstreamProc::start(&dir).await;
    let mut proxy = ProxyProc::start(
        &dir,
        "proxy",
        &ProxyConfig::new(&up.url(), &url)
            .lease("1s")
            .store_timeout("1s"),
    )
    .await;

    let mut acknowledged = Vec::new();
    for i in 0..20 {
        let key = format!("k-failover-{i}");
        let r = proxy.post(&key, PAY, &[]).await;
        assert_eq!(r.status, StatusCode::CREATED, "{}", r.text());
        acknowledged.push((key, r.body));
    }

    primary.stop_immediate();
    let failed_at = Instant::now();
    // Between the crash and the promotion there is no writable database:
    // keyed requests fail closed (the standby is refused: read-only).
    let r = proxy.post("k-during-failover", PAY, &[]).await;
    r.assert_problem(503, "store-unavailable");
    standby.promote();
    let promoted_at = Instant::now();

    // The proxy reconnects by itself: its first write on the new primary.
    let reconnected = loop {
        let key = format!("k-after-failover-{}", promoted_at.elapsed().as_millis());
        let r = proxy.post(&key, PAY, &[]).await;
        if r.status == StatusCode::CREATED {
            break promoted_at.elapsed();
        }
        r.assert_problem(503, "store-unavailable");
        assert!(
            promoted_at.elapsed() < Duration::from_secs(15),
            "no reconnection: {}",
            r.text()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    proxy.wait_ready(Duration::from_secs(5)).await;
    // Every acknowledged key is on the new primary, with the answer given…
    let sql = support::db::connect(&standby.url("postgres")).await;
    for (key, body) in &acknowledged {
        let row = read_row(&sql, "", key)
            .await
            .unwrap_or_else(|| panic!("{key} was lost in the failover"));
        assert_eq!(row.state, "completed", "{key}");
        assert_eq!(row.body.as_deref(), Some(&body[..]), "{key}");
    }
    // …and replays from there: through a new process, whose memory holds no
    // response.
    proxy.restart().await;
    for (key, body) in &acknowledged {
        let r = proxy.post(key, PAY, &[]).await;
        assert!(
            r.replayed(),
            "{key} not replayed after the failover: {}",
            r.text()
        );
        assert_eq!(&r.body, body, "{key}");
        assert_eq!(up.executions(key).await, 1, "{key}");
    }
    assert_eq!(up.executions("k-during-failover").await, 0);
    eprintln!(
        "failover: {} keys acknowledged before it, all on the new primary and replayed; \
         crash → promote {:?}, promote → first write {reconnected:?}",
        acknowledged.len(),
        promoted_at - failed_at
    );
}

// A primary that hangs instead of dying (every process stopped: the kernel
// still accepts connections, nothing answers) is the harder failover
// (DESIGN.md §8.4): statements on pooled connections to it time out and
// those connections are closed; new connections try each host with its
// share of store.timeout for the whole startup, so the promoted standby is
// reached; keyed requests succeed again within 10 s of the promotion.
#[tokio::test]
async fn failover_from_a_hung_primary_reconnects_to_the_promoted_standby() {
    let Some(bindir) = pgcluster::bindir_or_skip("failover from a hung primary") else {
        return;
    };
    let dir = TempDir::new("hung-primary");
    let (primary, standby) = synchronous_pair(&bindir).await;
    let up = UpstreamProc::start(&dir).await;
    let proxy = ProxyProc::start(
        &dir,
        "proxy",
        &ProxyConfig::new(&up.url(), &multi_host_url(&primary, &standby)),
    )
    .await;
    let r = proxy.post("k-before-hang", PAY, &[]).await;
    assert_eq!(r.status, StatusCode::CREATED, "{}", r.text());

    primary.freeze(true);
    standby.promote();
    let promoted_at = Instant::now();
    let mut last = String::new();
    let mut failed = 0;
    while promoted_at.elapsed() < Duration::from_secs(10) {
        let key = format!("k-after-hang-{}", promoted_at.elapsed().as_millis());
        let r = proxy.post(&key, PAY, &[]).await;
        if r.status == StatusCode::CREATED {
            // The key that was acknowledged before the hang is on the new
            // primary (synchronous replication) and replays from there.
            let again = proxy.post("k-before-hang", PAY, &[]).await;
            assert!(again.replayed(), "{}", again.text());
            assert_eq!(up.executions("k-before-hang").await, 1);
            eprintln!(
                "hung primary: first write on the promoted standby {:?} after the promotion ({failed} keyed requests refused meanwhile)",
                promoted_at.elapsed()
            );
            primary.freeze(false);
            return;
        }
        // Refused, never executed: fail closed while the store is away.
        r.assert_problem(503, "store-unavailable");
        assert_eq!(up.executions(&key).await, 0);
        failed += 1;
        last = r.text();
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    primary.freeze(false);
    panic!("no write reached the promoted standby within 10 s: {last}");
}

// ---------------------------------------------------------------------------
// 6. Upstream faults (beyond tests/requests.rs).

// The lease is renewed while the response body streams, not only while
// waiting for the headers.
#[tokio::test]
async fn slow_response_body_longer_than_the_lease_is_renewed_stored_and_replayed() {
    let dir = TempDir::new("slowbody");
    let db = TestDb::new().await;
    let sql = db.client().await;
    let up = UpstreamProc::start(&dir).await;
    let proxy = ProxyProc::start(
        &dir,
        "proxy",
        &ProxyConfig::new(&up.url(), &db.url).lease("600ms"),
    )
    .await;
    // 640 bytes in 10 chunks, 200 ms apart: about 2 s, over 3 leases.
    let slow = [
        ("x-sample-body-size", "640"),
        ("x-sample-slow-body-ms", "200"),
    ];
    let original = spawn_post(&proxy, "k-slow-body", &slow, Duration::from_secs(10));
    up.wait_executions("k-slow-body", 1, Duration::from_secs(5))
        .await;
    tokio::time::sleep(Duration::from_millis(1200)).await;
    let dup = proxy.post("k-slow-body", PAY, &[]).await;
    dup.assert_problem(409, "request-in-progress");
    let first = original.await.unwrap().unwrap();
    assert_eq!(first.status, StatusCode::CREATED);
    assert_eq!(&first.body[..], &sample_upstream::body_pattern(640)[..]);
    let row = read_row(&sql, "", "k-slow-body").await.unwrap();
    assert_eq!((row.state.as_str(), row.attempt), ("completed", 1));
    assert_eq!(row.body.as_deref(), Some(&first.body[..]));
    let again = proxy.post("k-slow-body", PAY, &[]).await;
    assert!(again.replayed());
    assert_eq!(again.body, first.body);
    assert_eq!(up.executions("k-slow-body").await, 1);
    assert!(
        proxy
            .metric(r#"idemproxy_lease_renewals_total{result="ok"}"#)
            .await
            >= 3.0
    );
}

// upstream.timeout bounds the whole exchange, body included.
#[tokio::test]
async fn slow_body_past_the_upstream_timeout_is_504_and_keeps_the_claim() {
    let dir = TempDir::new("slowbody-timeout");
    let db = TestDb::new().await;
    let sql = db.client().await;
    let up = UpstreamProc::start(&dir).await;
    let proxy = ProxyProc::start(
        &dir,
        "proxy",
        &ProxyConfig::new(&up.url(), &db.url)
            .lease("2s")
            .upstream_timeout("500ms"),
    )
    .await;
    let slow = [
        ("x-sample-body-size", "640"),
        ("x-sample-slow-body-ms", "200"),
    ];
    let r = proxy.post("k-slow-timeout", PAY, &slow).await;
    r.assert_problem(504, "upstream-timeout");
    assert!(r.header("retry-after").is_some());
    let row = read_row(&sql, "", "k-slow-timeout").await.unwrap();
    assert_eq!(row.state, "in_flight", "outcome unknown: the claim is kept");
    proxy
        .post("k-slow-timeout", PAY, &[])
        .await
        .assert_problem(409, "request-in-progress");
    assert_eq!(up.executions("k-slow-timeout").await, 1);
}

// The upstream process dies while its response body streams: the request
// was executed, the outcome is unknown to the proxy.
#[tokio::test]
async fn upstream_killed_mid_body_is_502_and_the_claim_waits_for_its_lease() {
    let dir = TempDir::new("upkill");
    let db = TestDb::new().await;
    let sql = db.client().await;
    let mut up = UpstreamProc::start(&dir).await;
    let proxy = ProxyProc::start(
        &dir,
        "proxy",
        &ProxyConfig::new(&up.url(), &db.url).lease("1s"),
    )
    .await;
    let slow = [
        ("x-sample-body-size", "2000"),
        ("x-sample-slow-body-ms", "100"),
    ];
    let original = spawn_post(&proxy, "k-upkill", &slow, Duration::from_secs(10));
    up.wait_executions("k-upkill", 1, Duration::from_secs(5))
        .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    up.kill();
    let r = original.await.unwrap().unwrap();
    r.assert_problem(502, "upstream-failed");
    assert!(r.header("retry-after").is_some());
    assert_eq!(
        read_row(&sql, "", "k-upkill").await.unwrap().state,
        "in_flight"
    );

    up.restart().await;
    proxy
        .post("k-upkill", PAY, &[])
        .await
        .assert_problem(409, "request-in-progress");
    wait_lease_expired(&sql, "k-upkill", Duration::from_secs(5)).await;
    let retry = proxy.post("k-upkill", PAY, &[]).await;
    assert_eq!(retry.status, StatusCode::CREATED, "{}", retry.text());
    assert_eq!(retry.header("x-request-echo-attempt"), Some("2"));
    assert_eq!(
        up.executions("k-upkill").await,
        1,
        "once on the restarted upstream"
    );
}

// No upstream process at all: the request provably never left, so the
// claim is released and a retry runs as soon as the upstream is back.
#[tokio::test]
async fn upstream_down_releases_the_claim_and_a_retry_runs_once_it_is_back() {
    let dir = TempDir::new("updown");
    let db = TestDb::new().await;
    let sql = db.client().await;
    let mut up = UpstreamProc::start(&dir).await;
    let proxy = ProxyProc::start(
        &dir,
        "proxy",
        &ProxyConfig::new(&up.url(), &db.url).lease("5s"),
    )
    .await;
    up.kill();
    proxy
        .post("k-updown", PAY, &[])
        .await
        .assert_problem(502, "upstream-unreachable");
    assert!(
        read_row(&sql, "", "k-updown").await.is_none(),
        "claim released"
    );
    up.restart().await;
    let r = proxy.post("k-updown", PAY, &[]).await;
    assert_eq!(r.status, StatusCode::CREATED, "{}", r.text());
    assert_eq!(r.header("x-request-echo-attempt"), Some("1"));
    assert_eq!(up.executions("k-updown").await, 1);
}

// A client that gives up (its own timeout) while the upstream call is in
// flight must not cancel the owner: the call goes on, the lease stays
// renewed, the response is stored, and the client's retry gets it.
#[tokio::test]
async fn client_giving_up_mid_flight_does_not_abandon_the_claim() {
    let dir = TempDir::new("giveup");
    let db = TestDb::new().await;
    let sql = db.client().await;
    let up = UpstreamProc::start(&dir).await;
    let proxy = ProxyProc::start(
        &dir,
        "proxy",
        &ProxyConfig::new(&up.url(), &db.url).lease("600ms"),
    )
    .await;
    let r = proxy
        .try_post(
            "k-giveup",
            PAY,
            &[("x-sample-delay-ms", "1500")],
            Duration::from_millis(300),
        )
        .await;
    assert!(r.is_err(), "the client gave up: {r:?}");
    // Well past the lease: still renewed by the owner.
    tokio::time::sleep(Duration::from_millis(900)).await;
    let row = read_row(&sql, "", "k-giveup").await.unwrap();
    assert_eq!(row.state, "in_flight");
    assert_eq!(row.lease_expired, Some(false), "the owner stopped renewing");
    proxy
        .post("k-giveup", PAY, &[])
        .await
        .assert_problem(409, "request-in-progress");
    // The owner finishes by itself: the record completes.
    eventually(Duration::from_secs(10), "k-giveup to complete", || async {
        read_row(&sql, "", "k-giveup").await.unwrap().state == "completed"
    })
    .await;
    // And it is accounted for, though nobody got the answer: counted as
    // claimed, with its access line.
    eventually(
        Duration::from_secs(5),
        "the given-up request counted",
        || async {
            proxy
                .metric("idemproxy_requests_total{outcome=\"claimed\"}")
                .await
                == 1.0
        },
    )
    .await;
    eventually(Duration::from_secs(5), "its access line", || async {
        proxy.proc.log_text().lines().any(|l| {
            l.contains("idemproxy::access")
                && l.contains("key=\"k-giveup\"")
                && l.contains("outcome=\"claimed\"")
        })
    })
    .await;
    let retry = proxy.post("k-giveup", PAY, &[]).await;
    assert!(retry.replayed(), "{}", retry.text());
    assert_eq!(retry.header("x-request-echo-attempt"), Some("1"));
    assert_eq!(up.executions("k-giveup").await, 1);
}

// ---------------------------------------------------------------------------
// 7. Graceful shutdown of the real process.

#[tokio::test]
async fn sigterm_drains_in_flight_requests_refuses_new_connections_and_exits_0() {
    let dir = TempDir::new("sigterm");
    let db = TestDb::new().await;
    let sql = db.client().await;
    let up = UpstreamProc::start(&dir).await;
    let mut proxy = ProxyProc::start(
        &dir,
        "proxy",
        &ProxyConfig::new(&up.url(), &db.url)
            .lease("5s")
            .shutdown_grace("4s"),
    )
    .await;
    let keys = ["k-term-1", "k-term-2", "k-term-3"];
    let in_flight: Vec<_> = keys
        .iter()
        .map(|k| {
            spawn_post(
                &proxy,
                k,
                &[("x-sample-delay-ms", "1200")],
                Duration::from_secs(10),
            )
        })
        .collect();
    for k in keys {
        up.wait_executions(k, 1, Duration::from_secs(5)).await;
    }

    proxy.proc.signal("TERM");
    let term_at = Instant::now();
    // Not ready while draining; new connections refused.
    let mut saw_draining = false;
    let mut saw_refused = false;
    while term_at.elapsed() < Duration::from_millis(800) && !(saw_draining && saw_refused) {
        if let Some(r) = proxy.readyz().await {
            if r.status == StatusCode::SERVICE_UNAVAILABLE && r.text().contains("draining") {
                saw_draining = true;
            }
        }
        saw_refused |= connection_refused(proxy.listen).await;
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(saw_draining, "/readyz never said draining");
    assert!(saw_refused, "the proxy port still accepts connections");
    for (k, h) in keys.iter().zip(in_flight) {
        let r = h.await.unwrap().unwrap();
        assert_eq!(r.status, StatusCode::CREATED, "{k}: {}", r.text());
    }
    let status = proxy
        .proc
        .wait_exit(Duration::from_secs(4))
        .await
        .expect("no exit within shutdown_grace");
    let took = term_at.elapsed();
    assert_eq!(status.code(), Some(0), "{}", proxy.proc.log_tail(10));
    for k in keys {
        let row = read_row(&sql, "", k).await.unwrap();
        assert_eq!(row.state, "completed", "{k}");
        assert_eq!(up.executions(k).await, 1);
    }
    eprintln!("SIGTERM with 3 requests in flight: exit 0 after {took:?}");
}

// A request longer than shutdown_grace is cut off at the grace: the process
// still exits 0 on time, and the claim, whose outcome is now unknown, is
// left to expire like a crashed owner's.
#[tokio::test]
async fn sigterm_cuts_requests_longer_than_the_grace_and_leaves_their_claims_to_expire() {
    let dir = TempDir::new("sigterm-grace");
    let db = TestDb::new().await;
    let sql = db.client().await;
    let up = UpstreamProc::start(&dir).await;
    let mut proxy = ProxyProc::start(
        &dir,
        "proxy",
        &ProxyConfig::new(&up.url(), &db.url)
            .lease("1s")
            .shutdown_grace("1s"),
    )
    .await;
    let long = spawn_post(
        &proxy,
        "k-grace",
        &[("x-sample-delay-ms", "3000")],
        Duration::from_secs(10),
    );
    up.wait_executions("k-grace", 1, Duration::from_secs(5))
        .await;
    proxy.proc.signal("TERM");
    let term_at = Instant::now();
    let status = proxy
        .proc
        .wait_exit(Duration::from_secs(3))
        .await
        .expect("no exit after shutdown_grace");
    let took = term_at.elapsed();
    assert_eq!(status.code(), Some(0));
    assert!(
        took >= Duration::from_millis(900) && took < Duration::from_millis(2500),
        "exit after {took:?} with a 1s grace"
    );
    assert!(
        long.await.unwrap().is_err(),
        "the cut request has no answer"
    );
    let row = read_row(&sql, "", "k-grace").await.unwrap();
    assert_eq!(row.state, "in_flight");
    wait_lease_expired(&sql, "k-grace", Duration::from_secs(3)).await;
    eprintln!("SIGTERM with a request longer than the 1s grace: exit 0 after {took:?}");
}

// DESIGN.md §8.2, the rolling deploy: a client with a short timeout gives up
// on a slow call, and the proxy gets SIGTERM a moment later. The request
// owns a claim whose client is gone; the drain waits for it all the same,
// stores its response and only then exits 0, so the client's retry (on
// another replica, here the next process) replays instead of executing the
// request a second time.
#[tokio::test]
async fn sigterm_after_the_client_gave_up_still_finishes_and_stores_the_owned_request() {
    let dir = TempDir::new("sigterm-gaveup");
    let db = TestDb::new().await;
    let sql = db.client().await;
    let up = UpstreamProc::start(&dir).await;
    let mut proxy = ProxyProc::start(
        &dir,
        "proxy",
        &ProxyConfig::new(&up.url(), &db.url)
            .lease("1s")
            .shutdown_grace("8s"),
    )
    .await;
    let client = spawn_post(
        &proxy,
        "k-gaveup",
        &[("x-sample-delay-ms", "3000")],
        Duration::from_millis(800),
    );
    up.wait_executions("k-gaveup", 1, Duration::from_secs(5))
        .await;
    assert!(client.await.unwrap().is_err(), "the client gave up");
    proxy.proc.signal("TERM");
    let term_at = Instant::now();
    let status = proxy
        .proc
        .wait_exit(Duration::from_secs(8))
        .await
        .expect("no exit within shutdown_grace");
    let took = term_at.elapsed();
    assert_eq!(status.code(), Some(0), "{}", proxy.proc.log_tail(10));
    assert!(
        took >= Duration::from_millis(1500),
        "exited after {took:?}, before the owned call (3 s) ended"
    );
    let row = read_row(&sql, "", "k-gaveup").await.unwrap();
    assert_eq!(row.state, "completed", "stored before the exit");
    // The retry, past the 1 s lease, replays.
    proxy.proc.spawn(false);
    proxy.wait_ready(Duration::from_secs(20)).await;
    let retry = proxy.post("k-gaveup", PAY, &[]).await;
    assert!(retry.replayed(), "{}", retry.text());
    assert_eq!(up.executions("k-gaveup").await, 1);
    eprintln!("SIGTERM after the client gave up: exit 0 after {took:?}, response stored");
}

// DESIGN.md §8.2: a completion that failed (the store was locked out) is
// retried in the background after its client has its answer; SIGTERM waits
// for that retry too, within the grace, instead of dropping the only record
// of what the upstream did.
#[tokio::test]
async fn sigterm_waits_for_a_completion_being_retried_in_the_background() {
    let dir = TempDir::new("sigterm-retry");
    let db = TestDb::new().await;
    let sql = db.client().await;
    let up = UpstreamProc::start(&dir).await;
    let mut proxy = ProxyProc::start(
        &dir,
        "proxy",
        &ProxyConfig::new(&up.url(), &db.url)
            .lease("10s")
            .store_timeout("300ms")
            .shutdown_grace("10s"),
    )
    .await;
    let (answer, locker) = answer_while_the_store_is_locked(&proxy, &up, &db.url, "k-retry").await;
    proxy.proc.signal("TERM");
    let term_at = Instant::now();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert!(
        proxy.proc.is_running(),
        "exited while its completion was still being retried"
    );
    locker.batch_execute("ROLLBACK").await.unwrap();
    let released_at = term_at.elapsed();
    let status = proxy
        .proc
        .wait_exit(Duration::from_secs(10))
        .await
        .expect("no exit within shutdown_grace");
    assert_eq!(status.code(), Some(0), "{}", proxy.proc.log_tail(10));
    let row = read_row(&sql, "", "k-retry").await.unwrap();
    assert_eq!(row.state, "completed", "the background retry stored it");
    assert_eq!(row.body.as_deref(), Some(&answer.body[..]));
    eprintln!(
        "SIGTERM during a background completion retry: store released after {released_at:?}, exit 0 after {:?}",
        term_at.elapsed()
    );
}

// A completion retried in the background that finds its lease lost (another
// attempt took the key over meanwhile) stores nothing and is counted as a
// lost lease, like one refused while its client waited.
#[tokio::test]
async fn a_lease_lost_during_a_background_completion_retry_is_counted() {
    let dir = TempDir::new("retry-lost");
    let db = TestDb::new().await;
    let up = UpstreamProc::start(&dir).await;
    let proxy = ProxyProc::start(
        &dir,
        "proxy",
        &ProxyConfig::new(&up.url(), &db.url)
            .lease("10s")
            .store_timeout("300ms"),
    )
    .await;
    let (_, locker) = answer_while_the_store_is_locked(&proxy, &up, &db.url, "k-retry-lost").await;
    // While the completion waits in the background, another owner takes
    // the key (what a takeover writes).
    let taken = locker
        .execute(
            "UPDATE idempotency_records
                SET owner_token = gen_random_uuid(), attempt = attempt + 1
              WHERE idempotency_key = 'k-retry-lost'",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(taken, 1);
    locker.batch_execute("COMMIT").await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(5);
    while proxy.metric("idemproxy_lost_leases_total").await < 1.0 {
        assert!(Instant::now() < deadline, "{}", proxy.proc.log_tail(10));
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let sql = db.client().await;
    let row = read_row(&sql, "", "k-retry-lost").await.unwrap();
    assert_eq!(
        (row.state.as_str(), row.attempt),
        ("in_flight", 2),
        "the fence kept the retry out"
    );
    assert!(proxy
        .proc
        .log_text()
        .contains("lease lost before the response could be stored"));
}

/// Sends a keyed POST whose upstream answer (after 800 ms) arrives while
/// the records table is locked: the client gets its answer, the completion
/// times out (the proxy's store timeout must be well under 800 ms) and is
/// retried in the background. Returns the answer and the connection that
/// holds the lock, in an open transaction (end it with ROLLBACK or COMMIT).
async fn answer_while_the_store_is_locked(
    proxy: &ProxyProc,
    up: &UpstreamProc,
    db_url: &str,
    key: &str,
) -> (support::http::Resp, tokio_postgres::Client) {
    let client = spawn_post(
        proxy,
        key,
        &[("x-sample-delay-ms", "800")],
        Duration::from_secs(10),
    );
    up.wait_executions(key, 1, Duration::from_secs(5)).await;
    let locker = support::db::connect(db_url).await;
    locker
        .batch_execute("BEGIN; LOCK TABLE idempotency_records IN ACCESS EXCLUSIVE MODE")
        .await
        .unwrap();
    let answer = client.await.unwrap().unwrap();
    assert_eq!(answer.status, StatusCode::CREATED, "{}", answer.text());
    (answer, locker)
}

// `serve` runs the number of worker threads TOKIO_WORKER_THREADS asks for
// (src/workers.rs), serves keyed requests spread over their connections
// exactly once each, and a SIGTERM drains every worker: the slow request in
// flight on one of them is answered and the process exits 0.
#[tokio::test]
async fn serve_runs_the_worker_threads_asked_for_and_sigterm_drains_them_all() {
    let dir = TempDir::new("workers");
    let db = TestDb::new().await;
    let up = UpstreamProc::start(&dir).await;
    let mut config = ProxyConfig::new(&up.url(), &db.url);
    config.env.push(("TOKIO_WORKER_THREADS".into(), "3".into()));
    let mut proxy = ProxyProc::start(&dir, "proxy", &config).await;

    // Concurrent requests, each on a connection of its own.
    let calls: Vec<_> = (0..6)
        .map(|i| {
            spawn_post(
                &proxy,
                &format!("k-worker-{i}"),
                &[("x-sample-delay-ms", "200")],
                Duration::from_secs(10),
            )
        })
        .collect();
    for call in calls {
        let r = call.await.unwrap().expect("an answer");
        assert_eq!(r.status, 201, "{}", r.text());
    }
    for i in 0..6 {
        assert_eq!(up.executions(&format!("k-worker-{i}")).await, 1);
    }

    let workers = std::fs::read_dir(format!("/proc/{}/task", proxy.proc.pid()))
        .unwrap()
        .filter_map(|t| std::fs::read_to_string(t.unwrap().path().join("comm")).ok())
        // The kernel keeps 15 bytes of a thread's name.
        .filter(|comm| comm.trim_end() == "idemproxy-worke")
        .count();
    assert_eq!(workers, 3, "worker threads of TOKIO_WORKER_THREADS=3");

    let slow = spawn_post(
        &proxy,
        "k-worker-drain",
        &[("x-sample-delay-ms", "1500")],
        Duration::from_secs(10),
    );
    up.wait_executions("k-worker-drain", 1, Duration::from_secs(5))
        .await;
    proxy.proc.signal("TERM");
    let status = proxy
        .proc
        .wait_exit(Duration::from_secs(5))
        .await
        .expect("no exit after SIGTERM");
    assert_eq!(status.code(), Some(0));
    let answered = slow
        .await
        .unwrap()
        .expect("the request in flight is answered");
    assert_eq!(answered.status, 201, "{}", answered.text());
    assert_eq!(up.executions("k-worker-drain").await, 1);
}
