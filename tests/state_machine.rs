//! DESIGN.md §1: the state machine, one test per cell, against a real
//! PostgreSQL and the sample upstream over real sockets.

mod support;

use std::time::Duration;

use idemproxy::idempotency::{
    Fingerprint, FingerprintMode, IdempotencyKey, OwnerToken, RecordKey, TenantId,
};
use idemproxy::store::{ClaimResult, Replace, StoredResponse};
use support::harness::{Harness, Setup};
use support::http::Req;

const PAY: &str = r#"{"amount": 100, "currency": "EUR"}"#;

// Row "absent": claim it, forward once.
#[tokio::test]
async fn absent_key_is_claimed_and_forwarded_once_with_attempt_1() {
    let h = Harness::start(Setup::default()).await;
    let r = h.post("/v1/payments", "k-absent", PAY).await;
    assert_eq!(r.status, 201, "{}", r.text());
    assert!(!r.replayed());
    assert_eq!(h.upstream.executions("k-absent"), 1);
    let seen = &h.upstream.requests()[0];
    assert_eq!(seen.header("idempotency-key"), Some(&b"k-absent"[..]));
    assert_eq!(seen.header("idempotency-attempt"), Some(&b"1"[..]));
    assert_eq!(
        h.record_state("", "k-absent").await,
        Some(("completed".into(), 1))
    );
}

// Row "completed", same fingerprint: replay verbatim.
#[tokio::test]
async fn completed_key_replays_status_headers_and_body_verbatim() {
    let h = Harness::start(Setup::default()).await;
    let first = h
        .send(
            Req::post("/v1/payments")
                .key("k-replay")
                .json(PAY)
                .header("x-sample-set-cookie", "3"),
        )
        .await;
    assert_eq!(first.status, 201);
    let again = h
        .send(
            Req::post("/v1/payments")
                .key("k-replay")
                .json(PAY)
                .header("x-sample-set-cookie", "3"),
        )
        .await;
    assert_eq!(again.status, first.status);
    assert_eq!(again.body, first.body, "body bytes differ");
    assert!(again.replayed());
    assert_eq!(h.upstream.executions("k-replay"), 1);
    let cookies: Vec<_> = again.headers.get_all("set-cookie").iter().collect();
    assert_eq!(cookies, ["c1=v1", "c2=v2", "c3=v3"]);
    assert_eq!(again.header("content-type"), first.header("content-type"));
    assert_eq!(
        again.header("x-sample-execution"),
        first.header("x-sample-execution")
    );
    assert!(
        again.header("date").is_some(),
        "a replay carries a fresh Date"
    );
}

// A retry from a client whose serialiser orders keys differently matches.
#[tokio::test]
async fn reordered_json_body_is_the_same_request() {
    let h = Harness::start(Setup::default()).await;
    h.post("/v1/payments", "k-order", r#"{"a":1,"b":[1,2]}"#)
        .await;
    let r = h
        .post("/v1/payments", "k-order", "{ \"b\": [1, 2], \"a\": 1 }")
        .await;
    assert!(r.replayed(), "{}", r.text());
    assert_eq!(h.upstream.executions("k-order"), 1);
}

// Row "completed", different fingerprint: 422.
#[tokio::test]
async fn completed_key_with_different_body_path_or_method_is_422() {
    let h = Harness::start(Setup::default().defaults("methods = [\"POST\", \"PATCH\"]\n")).await;
    h.post("/v1/payments", "k-mismatch", PAY).await;
    h.post(
        "/v1/payments",
        "k-mismatch",
        r#"{"amount": 101, "currency": "EUR"}"#,
    )
    .await
    .assert_problem(422, "key-reused");
    h.post("/v1/refunds", "k-mismatch", PAY)
        .await
        .assert_problem(422, "key-reused");
    h.send(
        Req::new(http::Method::PATCH, "/v1/payments")
            .key("k-mismatch")
            .json(PAY),
    )
    .await
    .assert_problem(422, "key-reused");
    h.post("/v1/payments?x=1", "k-mismatch", PAY)
        .await
        .assert_problem(422, "key-reused");
    // Number text is kept: 100 and 100.0 are different requests.
    h.post(
        "/v1/payments",
        "k-mismatch",
        r#"{"amount": 100.0, "currency": "EUR"}"#,
    )
    .await
    .assert_problem(422, "key-reused");
    assert_eq!(h.upstream.executions("k-mismatch"), 1);
}

// Row "in flight, lease valid", same fingerprint: 409 + Retry-After.
#[tokio::test]
async fn in_flight_duplicate_gets_409_with_retry_after() {
    let h = Harness::start(Setup::default().defaults("lease = \"5s\"\n")).await;
    let slow = Req::post("/v1/payments")
        .key("k-409")
        .json(PAY)
        .header("x-sample-delay-ms", "1500");
    let original = {
        let h_client = h.client.clone();
        let url = h.url("/v1/payments");
        let req = slow.clone();
        tokio::spawn(async move {
            let mut req = req;
            req.path = url;
            h_client.send(req).await
        })
    };
    h.wait_executions("k-409", 1).await;
    let dup = h.send(slow.clone()).await;
    dup.assert_problem(409, "request-in-progress");
    let retry_after: u64 = dup.header("retry-after").unwrap().parse().unwrap();
    assert!((1..=5).contains(&retry_after), "Retry-After {retry_after}");
    let first = original.await.unwrap();
    assert_eq!(first.status, 201);
    assert_eq!(h.upstream.executions("k-409"), 1);
}

// Row "in flight, lease valid", different fingerprint: 422.
#[tokio::test]
async fn in_flight_key_with_different_body_is_422() {
    let h = Harness::start(Setup::default().defaults("lease = \"5s\"\n")).await;
    let original = h.spawn_slow("/v1/payments", "k-422-inflight", PAY, 1000);
    h.wait_executions("k-422-inflight", 1).await;
    h.post("/v1/payments", "k-422-inflight", r#"{"amount": 5}"#)
        .await
        .assert_problem(422, "key-reused");
    assert_eq!(original.await.unwrap().status, 201);
    assert_eq!(h.upstream.executions("k-422-inflight"), 1);
}

/// Claims a key as a "crashed" owner would: in flight, never completed.
async fn abandoned_claim(h: &Harness, key: &str, body: &str, lease: Duration) -> OwnerToken {
    let store = h.store();
    let fp = Fingerprint::compute(
        FingerprintMode::Json,
        "POST",
        "/v1/payments",
        None,
        Some(b"application/json"),
        body.as_bytes(),
    );
    let owner = OwnerToken::mint();
    let result = store
        .claim(
            &RecordKey::new(
                TenantId::none(),
                IdempotencyKey::parse(key.as_bytes(), 255).unwrap(),
            ),
            &fp,
            owner,
            lease,
            Duration::from_secs(3600),
        )
        .await
        .unwrap();
    assert!(matches!(result, ClaimResult::Claimed(_)));
    owner
}

// Row "in flight, lease expired", same fingerprint: take over, new owner,
// attempt 2 reaches the upstream.
#[tokio::test]
async fn expired_lease_is_taken_over_with_a_new_owner_and_attempt_2() {
    let h = Harness::start(Setup::default()).await;
    let stale = abandoned_claim(&h, "k-takeover", PAY, Duration::from_millis(200)).await;
    // Before expiry: 409.
    h.post("/v1/payments", "k-takeover", PAY)
        .await
        .assert_problem(409, "request-in-progress");
    // The point: the 200 ms lease runs out unrenewed.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let r = h.post("/v1/payments", "k-takeover", PAY).await;
    assert_eq!(r.status, 201, "{}", r.text());
    assert_eq!(h.upstream.executions("k-takeover"), 1);
    assert_eq!(
        h.upstream.requests()[0].header("idempotency-attempt"),
        Some(&b"2"[..])
    );
    let c = h.db.client().await;
    let owner: uuid::Uuid = c
        .query_one(
            "SELECT owner_token FROM idempotency_records WHERE idempotency_key = 'k-takeover'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_ne!(
        owner,
        stale.as_uuid(),
        "the takeover minted a new owner token"
    );
    assert_eq!(
        h.record_state("", "k-takeover").await,
        Some(("completed".into(), 2))
    );
    assert_eq!(
        h.running()
            .metrics
            .request_count("default", idemproxy::metrics::Outcome::Claimed),
        1
    );
}

// Row "in flight, lease expired", different fingerprint: 422.
#[tokio::test]
async fn expired_lease_with_different_body_is_422_and_not_taken_over() {
    let h = Harness::start(Setup::default()).await;
    abandoned_claim(&h, "k-expired-422", PAY, Duration::from_millis(100)).await;
    // The point: the 100 ms lease runs out unrenewed.
    tokio::time::sleep(Duration::from_millis(200)).await;
    h.post("/v1/payments", "k-expired-422", r#"{"amount": 1}"#)
        .await
        .assert_problem(422, "key-reused");
    assert_eq!(h.upstream.total_requests(), 0);
    assert_eq!(
        h.record_state("", "k-expired-422").await,
        Some(("in_flight".into(), 1))
    );
}

// The fence: a stale owner's completion never overwrites its successor's.
#[tokio::test]
async fn stale_owner_completion_is_refused_by_the_fence() {
    let h = Harness::start(Setup::default()).await;
    let store = h.store();
    let record = RecordKey::new(
        TenantId::none(),
        IdempotencyKey::parse(b"k-fence", 255).unwrap(),
    );
    let fp = Fingerprint::compute(FingerprintMode::Bytes, "POST", "/", None, None, b"x");
    let a = OwnerToken::mint();
    let lease = Duration::from_millis(100);
    let retention = Duration::from_secs(60);
    assert!(matches!(
        store
            .claim(&record, &fp, a, lease, retention)
            .await
            .unwrap(),
        ClaimResult::Claimed(_)
    ));
    // The point: owner a's lease runs out.
    tokio::time::sleep(Duration::from_millis(150)).await;
    let b = OwnerToken::mint();
    let claim = store
        .replace(&record, &fp, b, Replace::TakeOver(a), lease, retention)
        .await
        .unwrap()
        .expect("takeover after the lease expired");
    assert_eq!(claim.attempt, 2);
    // A cannot take over again from itself, nor renew, nor release.
    assert!(!store.renew(&record, a, lease).await.unwrap());
    assert!(!store.release(&record, a, None).await.unwrap());
    let response = |body: &'static [u8]| StoredResponse {
        status: 201,
        headers: vec![("content-type".into(), "text/plain".into())],
        body: Some(body.into()),
    };
    assert!(store
        .complete(&record, b, &response(b"B"), retention, None)
        .await
        .unwrap()
        .is_some());
    assert_eq!(
        store
            .complete(&record, a, &response(b"A"), retention, None)
            .await
            .unwrap(),
        None
    );
    match store
        .claim(&record, &fp, OwnerToken::mint(), lease, retention)
        .await
        .unwrap()
    {
        ClaimResult::Existing(x) => assert_eq!(x.response.unwrap().body.unwrap(), &b"B"[..]),
        other => panic!("expected the completed record, got {other:?}"),
    }
}

// Two racing takeovers: exactly one wins.
#[tokio::test]
async fn racing_takeovers_have_exactly_one_winner() {
    let h = Harness::start(Setup::default()).await;
    let store = h.store();
    let record = RecordKey::new(
        TenantId::none(),
        IdempotencyKey::parse(b"k-race", 255).unwrap(),
    );
    let fp = Fingerprint::compute(FingerprintMode::Bytes, "POST", "/", None, None, b"x");
    let a = OwnerToken::mint();
    store
        .claim(
            &record,
            &fp,
            a,
            Duration::from_millis(50),
            Duration::from_secs(60),
        )
        .await
        .unwrap();
    // The point: the 50 ms lease runs out before the racers start.
    tokio::time::sleep(Duration::from_millis(100)).await;
    let mut tasks = Vec::new();
    for _ in 0..8 {
        let (store, record) = (store.clone(), record.clone());
        tasks.push(tokio::spawn(async move {
            store
                .replace(
                    &record,
                    &fp,
                    OwnerToken::mint(),
                    Replace::TakeOver(a),
                    Duration::from_secs(5),
                    Duration::from_secs(60),
                )
                .await
                .unwrap()
        }));
    }
    let mut winners = 0;
    for t in tasks {
        winners += usize::from(t.await.unwrap().is_some());
    }
    assert_eq!(winners, 1);
}

// The lease is renewed while a slow upstream call is in flight: a
// duplicate long after the first lease would have run out still gets 409.
#[tokio::test]
async fn lease_is_renewed_while_a_slow_upstream_call_is_in_flight() {
    let h =
        Harness::start(Setup::default().defaults("lease = \"300ms\"\nretention = \"1h\"\n")).await;
    let original = h.spawn_slow("/v1/payments", "k-renew", PAY, 1500);
    for _ in 0..4 {
        // The point: each check comes a whole (300 ms) lease later.
        tokio::time::sleep(Duration::from_millis(300)).await;
        h.post("/v1/payments", "k-renew", PAY)
            .await
            .assert_problem(409, "request-in-progress");
    }
    assert_eq!(original.await.unwrap().status, 201);
    assert_eq!(h.upstream.executions("k-renew"), 1);
    assert!(h.post("/v1/payments", "k-renew", PAY).await.replayed());
    let metrics = h.running().metrics.render();
    assert!(
        metrics.contains(r#"idemproxy_lease_renewals_total{result="ok"}"#),
        "{metrics}"
    );
}

// Row "in flight, lease expired", but its owner still runs in this replica:
// its renewals could not land (here a row lock held by the test makes each
// wait out `store.timeout`, as a stalled primary or a slow checkpoint
// would), so the database finds the lease expired. A duplicate here gets
// 409 and is not forwarded: a takeover would execute the request a second
// time while the first is in flight. The owner's next renewal lands once
// the database answers again, and its response is stored.
#[tokio::test]
async fn a_duplicate_here_does_not_take_over_a_claim_still_running_here_when_renewals_stall() {
    let h = Harness::start(Setup::default().defaults("lease = \"1s\"\n")).await;
    let original = h.spawn_slow("/v1/payments", "k-stalled", PAY, 3500);
    h.wait_executions("k-stalled", 1).await;
    let mut lock = h.db.client().await;
    let tx = support::records::lock_key(&mut lock, "k-stalled").await;
    // Past the lease, by this replica's clock and the database's: the
    // renewal due a third of a lease after the claim is still waiting.
    tokio::time::sleep(Duration::from_millis(1300)).await;
    let expired: bool =
        h.db.client()
            .await
            .query_one(
                "SELECT lease_expires_at <= now() FROM idempotency_records
              WHERE idempotency_key = 'k-stalled'",
                &[],
            )
            .await
            .unwrap()
            .get(0);
    assert!(expired, "the lease ran out in the database");
    let started = std::time::Instant::now();
    let dup = h.post("/v1/payments", "k-stalled", PAY).await;
    dup.assert_problem(409, "request-in-progress");
    assert!(
        started.elapsed() < Duration::from_millis(1500),
        "answered without waiting on the locked row: {:?}",
        started.elapsed()
    );
    tx.rollback().await.unwrap();
    let first = original.await.unwrap();
    assert_eq!(first.status, 201, "{}", first.text());
    assert_eq!(h.upstream.executions("k-stalled"), 1);
    assert_eq!(
        h.record_state("", "k-stalled").await,
        Some(("completed".into(), 1))
    );
    let replay = h.post("/v1/payments", "k-stalled", PAY).await;
    assert!(replay.replayed());
    assert_eq!(replay.body, first.body);
    assert_eq!(h.metric("idemproxy_takeovers_declined_total"), 1.0);
    assert_eq!(h.metric("idemproxy_takeovers_total"), 0.0);
}

// The interesting duplicates arrive at the same time.
#[tokio::test]
async fn fifty_concurrent_identical_requests_execute_exactly_once() {
    let h = Harness::start(Setup::default().defaults("lease = \"5s\"\n")).await;
    let url = h.url("/v1/payments");
    let mut tasks = Vec::new();
    for _ in 0..50 {
        let client = support::http::HttpClient::new();
        let url = url.clone();
        tasks.push(tokio::spawn(async move {
            client
                .send(
                    Req::post(&url)
                        .key("k-herd")
                        .json(PAY)
                        .header("x-sample-delay-ms", "500"),
                )
                .await
        }));
    }
    let mut created = 0;
    let mut conflicts = 0;
    let mut replays = 0;
    for t in tasks {
        let r = t.await.unwrap();
        match r.status.as_u16() {
            201 if r.replayed() => replays += 1,
            201 => created += 1,
            409 => conflicts += 1,
            s => panic!("unexpected {s}: {}", r.text()),
        }
    }
    assert_eq!(created, 1, "exactly one request executed");
    assert_eq!(created + conflicts + replays, 50);
    assert_eq!(h.upstream.executions("k-herd"), 1);
}

// Row "absent (or expired past retention)": a record past retention is
// treated as absent even before the sweeper deletes it.
#[tokio::test]
async fn record_past_retention_is_treated_as_absent() {
    let h =
        Harness::start(Setup::default().defaults("lease = \"200ms\"\nretention = \"1s\"\n")).await;
    h.post("/v1/payments", "k-retention", PAY).await;
    assert!(h.post("/v1/payments", "k-retention", PAY).await.replayed());
    // The point: the 1 s retention passes.
    tokio::time::sleep(Duration::from_millis(1200)).await;
    // Even a different body: the old record is gone as far as answers go.
    let r = h
        .post("/v1/payments", "k-retention", r#"{"amount": 7}"#)
        .await;
    assert_eq!(r.status, 201);
    assert!(!r.replayed());
    assert_eq!(h.upstream.executions("k-retention"), 2);
    assert_eq!(
        h.upstream.requests()[1].header("idempotency-attempt"),
        Some(&b"1"[..])
    );
    assert_eq!(h.record_count().await, 1);
}

// Completion fenced through the proxy: if another attempt owns the key by
// the time the upstream answers, the response still reaches its client,
// nothing is overwritten, and lost_lease is counted.
#[tokio::test]
async fn lost_lease_still_answers_the_client_and_overwrites_nothing() {
    let h = Harness::start(Setup::default().defaults("lease = \"5s\"\n")).await;
    let original = h.spawn_slow("/v1/payments", "k-lost", PAY, 800);
    h.wait_executions("k-lost", 1).await;
    // Another attempt takes the key over (as a replica would after a pause).
    let c = h.db.client().await;
    let usurper = uuid::Uuid::new_v4();
    let n = c
        .execute(
            "UPDATE idempotency_records SET owner_token = $1, attempt = 2 WHERE idempotency_key = 'k-lost'",
            &[&usurper],
        )
        .await
        .unwrap();
    assert_eq!(n, 1);
    let r = original.await.unwrap();
    assert_eq!(r.status, 201, "the client still gets the upstream's answer");
    assert!(!r.replayed());
    let row = c
        .query_one(
            "SELECT state, owner_token, response_body IS NULL FROM idempotency_records WHERE idempotency_key = 'k-lost'",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(row.get::<_, String>(0), "in_flight");
    assert_eq!(
        row.get::<_, uuid::Uuid>(1),
        usurper,
        "the new owner's claim is untouched"
    );
    assert!(row.get::<_, bool>(2));
    assert_eq!(
        h.running()
            .metrics
            .request_count("default", idemproxy::metrics::Outcome::LostLease),
        1
    );
}

// Group commit: many new keys at once are claimed and completed in shared
// statements, and each is still executed exactly once and stored.
#[tokio::test]
async fn concurrent_new_keys_are_grouped_into_shared_commits_and_each_executes_once() {
    let h = Harness::start(Setup::default().defaults("lease = \"5s\"\n")).await;
    let url = h.url("/v1/payments");
    let mut tasks = Vec::new();
    for i in 0..120 {
        let client = support::http::HttpClient::new();
        let url = url.clone();
        tasks.push(tokio::spawn(async move {
            // Two requests per key: a duplicate may land in the same batch.
            let key = format!("k-batch-{}", i / 2);
            client.send(Req::post(&url).key(&key).json(PAY)).await
        }));
    }
    let mut fresh = 0;
    for t in tasks {
        let r = t.await.unwrap();
        assert!(
            matches!(r.status.as_u16(), 201 | 409),
            "{} {}",
            r.status,
            r.text()
        );
        fresh += usize::from(r.status == 201 && !r.replayed());
    }
    assert_eq!(fresh, 60, "one execution per key");
    for i in 0..60 {
        assert_eq!(h.upstream.executions(&format!("k-batch-{i}")), 1);
    }
    let c = h.db.client().await;
    let completed: i64 = c
        .query_one(
            "SELECT count(*) FROM idempotency_records WHERE state = 'completed'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(completed, 60);
    let metrics = support::http::HttpClient::new()
        .send(Req::get(&h.admin_url("/metrics")))
        .await
        .text();
    let gauge = |name: &str, op: &str| -> u64 {
        let prefix = format!("idemproxy_{name}_total{{op=\"{op}\"}} ");
        metrics
            .lines()
            .find_map(|l| l.strip_prefix(&prefix))
            .unwrap_or_else(|| panic!("{prefix} missing:\n{metrics}"))
            .parse()
            .unwrap()
    };
    let (batches, items) = (
        gauge("store_batches", "claim"),
        gauge("store_batched_items", "claim"),
    );
    assert!(
        items >= 120,
        "every claim went through the batcher: {items}"
    );
    assert!(
        batches < items,
        "some claims shared a statement: {batches} statements for {items} claims"
    );
}

// The pool is split among the threads (the main one's two, and each
// worker's share, where its batches run; store::pools): the harness's pool
// of 8 on two workers is 2 + 3 + 3. A burst of new keys and their duplicates on
// connections spread over both workers all get their answers (a worker
// whose share is busy borrows or waits, never fails), each key executes
// once, and the database never sees more than `pool_size` pooled
// connections.
#[tokio::test]
async fn a_pool_split_among_the_workers_serves_a_burst_within_pool_size() {
    const POOL: i64 = 8; // the harness's store.pool_size
    let h = Harness::start(
        Setup::default()
            .store("response_cache = \"0\"\n")
            .defaults("lease = \"5s\"\n"),
    )
    .await;
    let db = h.db.client().await;
    let pooled = "SELECT count(*) FROM pg_stat_activity \
                  WHERE datname = current_database() AND pid <> pg_backend_pid() \
                  AND application_name = 'idemproxy' AND query NOT LIKE 'LISTEN%'";
    let url = h.url("/v1/payments");
    let mut tasks = Vec::new();
    for i in 0..48 {
        let url = url.clone();
        tasks.push(tokio::spawn(async move {
            // A connection of its own per client: spread over the workers.
            let client = support::http::HttpClient::new();
            let mut statuses = Vec::new();
            for round in 0..6 {
                // Three requests per key: the first claims, the others are
                // in-flight duplicates (409) or replays (a database read).
                let key = format!("k-split-{}-{round}", i / 3);
                let r = client
                    .send(
                        Req::post(&url)
                            .key(&key)
                            .json(PAY)
                            .header("x-sample-delay-ms", "5"),
                    )
                    .await;
                statuses.push((r.status.as_u16(), r.replayed(), r.text()));
            }
            statuses
        }));
    }
    let mut most = 0;
    while !tasks.iter().all(|t| t.is_finished()) {
        let n: i64 = db.query_one(pooled, &[]).await.unwrap().get(0);
        most = most.max(n);
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let mut fresh = 0;
    for t in tasks {
        for (status, replayed, text) in t.await.unwrap() {
            assert!(matches!(status, 201 | 409), "{status} {text}");
            fresh += usize::from(status == 201 && !replayed);
        }
    }
    assert_eq!(fresh, 16 * 6, "one execution per key");
    for i in 0..16 {
        for round in 0..6 {
            assert_eq!(h.upstream.executions(&format!("k-split-{i}-{round}")), 1);
        }
    }
    eprintln!("pool split: at most {most} pooled connections for pool_size {POOL}");
    assert!(most > 0, "the sampling saw the pool");
    assert!(
        most <= POOL,
        "{most} pooled connections for pool_size {POOL}"
    );
}

// Renewal is per process: many slow calls share one UPDATE per tick.
#[tokio::test]
async fn leases_of_many_slow_calls_are_renewed_together() {
    let h =
        Harness::start(Setup::default().defaults("lease = \"300ms\"\nretention = \"1h\"\n")).await;
    let url = h.url("/v1/payments");
    let tasks: Vec<_> = (0..20)
        .map(|i| {
            let client = support::http::HttpClient::new();
            let url = url.clone();
            tokio::spawn(async move {
                client
                    .send(
                        Req::post(&url)
                            .key(&format!("k-slow-{i}"))
                            .json(PAY)
                            .header("x-sample-delay-ms", "1200"),
                    )
                    .await
            })
        })
        .collect();
    // Well past the lease: nobody else may take any of them over.
    tokio::time::sleep(Duration::from_millis(700)).await;
    for i in 0..20 {
        h.post("/v1/payments", &format!("k-slow-{i}"), PAY)
            .await
            .assert_problem(409, "request-in-progress");
    }
    for t in tasks {
        assert_eq!(t.await.unwrap().status, 201);
    }
    let metrics = h.running().metrics.render();
    let value = |prefix: &str| -> f64 {
        metrics
            .lines()
            .find_map(|l| l.strip_prefix(prefix))
            .unwrap_or_else(|| panic!("{prefix} missing:\n{metrics}"))
            .trim()
            .parse()
            .unwrap()
    };
    let renewed = value(r#"idemproxy_lease_renewals_total{result="ok"} "#);
    let statements = value(r#"idemproxy_store_duration_seconds_count{op="renew"} "#);
    assert!(
        renewed >= 40.0,
        "every call renewed several times: {renewed}"
    );
    assert!(
        statements * 4.0 <= renewed,
        "{statements} statements for {renewed} renewals"
    );
}

/// The row's version and lock marks: a row lock or an update changes them.
async fn row_marks(h: &Harness, key: &str) -> (String, String, String) {
    let c = h.db.client().await;
    let r = c
        .query_one(
            "SELECT xmin::text, xmax::text, ctid::text FROM idempotency_records WHERE idempotency_key = $1",
            &[&key],
        )
        .await
        .unwrap();
    (r.get(0), r.get(1), r.get(2))
}

// DESIGN.md §1: a duplicate costs one round trip and writes nothing — no
// new row version, no row lock (a lock would set xmax and force a commit
// flush).
#[tokio::test]
async fn duplicates_take_no_row_lock_and_write_nothing() {
    let h = Harness::start(Setup::default().store("response_cache = \"0\"\n")).await;
    h.post("/v1/payments", "k-quiet", PAY).await;
    let completed = row_marks(&h, "k-quiet").await;
    for _ in 0..5 {
        assert!(h.post("/v1/payments", "k-quiet", PAY).await.replayed());
    }
    h.post("/v1/payments", "k-quiet", r#"{"amount": 1}"#)
        .await
        .assert_problem(422, "key-reused");
    assert_eq!(row_marks(&h, "k-quiet").await, completed);
    assert_eq!(completed.1, "0", "never locked");

    abandoned_claim(&h, "k-quiet-inflight", PAY, Duration::from_secs(30)).await;
    let in_flight = row_marks(&h, "k-quiet-inflight").await;
    for _ in 0..5 {
        h.post("/v1/payments", "k-quiet-inflight", PAY)
            .await
            .assert_problem(409, "request-in-progress");
    }
    assert_eq!(row_marks(&h, "k-quiet-inflight").await, in_flight);
}
