//! Duplicates that wait for the original (`wait`), advertised expiry, and
//! keys that compose downstream.

mod support;

use std::time::{Duration, Instant, SystemTime};

use support::harness::{Harness, Setup};
use support::http::{HttpClient, Req};

const PAY: &str = r#"{"amount": 100}"#;

fn waiting(wait: &str) -> Setup {
    Setup::default().defaults(&format!("lease = \"5s\"\nwait = \"{wait}\"\n"))
}

fn spawn_slow(
    h: &Harness,
    key: &str,
    delay_ms: u64,
) -> tokio::task::JoinHandle<support::http::Resp> {
    h.spawn_slow("/v1/payments", key, PAY, delay_ms)
}

#[tokio::test]
async fn waiting_duplicate_on_the_same_replica_gets_the_replay_when_the_original_completes() {
    let h = Harness::start(waiting("5s")).await;
    let original = spawn_slow(&h, "k-wait", 800);
    h.wait_executions("k-wait", 1).await;
    let started = Instant::now();
    let dup = h.post("/v1/payments", "k-wait", PAY).await;
    let waited = started.elapsed();
    let first = original.await.unwrap();
    assert_eq!(dup.status, 201, "{}", dup.text());
    assert!(dup.replayed());
    assert_eq!(dup.body, first.body);
    assert!(
        waited < Duration::from_millis(2000),
        "woken by the completion, not the lease: {waited:?}"
    );
    assert!(
        waited >= Duration::from_millis(400),
        "it did wait: {waited:?}"
    );
    assert_eq!(h.upstream.executions("k-wait"), 1);
}

#[tokio::test]
async fn waiting_duplicate_on_another_replica_is_woken_by_notify() {
    let h = Harness::start(waiting("8s")).await;
    let since = h.db_now().await;
    let b = h.replica().await;
    // Replica B's waiter is woken by NOTIFY: its listener must be subscribed.
    h.wait_listener_since(&since).await;
    let original = spawn_slow(&h, "k-wait-x", 800);
    h.wait_executions("k-wait-x", 1).await;
    let started = Instant::now();
    let dup = HttpClient::new()
        .send(
            Req::post(&format!("http://{}/v1/payments", b.proxy_addr))
                .key("k-wait-x")
                .json(PAY),
        )
        .await;
    let waited = started.elapsed();
    assert_eq!(original.await.unwrap().status, 201);
    assert_eq!(dup.status, 201, "{}", dup.text());
    assert!(dup.replayed());
    // The lease is 5 s: only a push explains an early wake-up.
    assert!(waited < Duration::from_millis(2500), "{waited:?}");
    assert_eq!(h.upstream.executions("k-wait-x"), 1);
    b.shutdown().await;
}

#[tokio::test]
async fn waiting_duplicate_gets_409_when_the_wait_runs_out() {
    let h = Harness::start(waiting("300ms")).await;
    let original = spawn_slow(&h, "k-wait-timeout", 1500);
    h.wait_executions("k-wait-timeout", 1).await;
    let started = Instant::now();
    let dup = h.post("/v1/payments", "k-wait-timeout", PAY).await;
    let waited = started.elapsed();
    dup.assert_problem(409, "request-in-progress");
    assert!(dup.header("retry-after").is_some());
    assert!(waited >= Duration::from_millis(280), "{waited:?}");
    assert!(waited < Duration::from_millis(1200), "{waited:?}");
    assert_eq!(original.await.unwrap().status, 201);
}

/// A waiting duplicate on the owner's own replica finds the lease expired
/// in the database (what renewals that could not land during a stall leave
/// behind, written here directly): it does not take the key over, which
/// would execute the request a second time while the first is in flight,
/// but goes on waiting, and gets the original's response.
#[tokio::test]
async fn a_waiting_duplicate_here_does_not_take_over_a_claim_still_running_here() {
    let h = Harness::start(waiting("5s")).await;
    let original = spawn_slow(&h, "k-wait-expired", 1200);
    h.wait_executions("k-wait-expired", 1).await;
    // The first renewal is due a third of the 5 s lease after the claim.
    let expired =
        h.db.client()
            .await
            .execute(
                "UPDATE idempotency_records SET lease_expires_at = now() - interval '1 second'
              WHERE idempotency_key = 'k-wait-expired'",
                &[],
            )
            .await
            .unwrap();
    assert_eq!(expired, 1);
    let dup = h.post("/v1/payments", "k-wait-expired", PAY).await;
    let first = original.await.unwrap();
    assert_eq!(first.status, 201, "{}", first.text());
    assert_eq!(dup.status, 201, "{}", dup.text());
    assert!(dup.replayed());
    assert_eq!(dup.body, first.body);
    assert_eq!(h.upstream.executions("k-wait-expired"), 1);
    // Once for the one duplicate, however often it read the record again.
    assert_eq!(h.metric("idemproxy_takeovers_declined_total"), 1.0);
    assert_eq!(h.metric("idemproxy_takeovers_total"), 0.0);
}

#[tokio::test]
async fn waiters_are_bounded_and_the_excess_gets_409_at_once() {
    let h = Harness::start(waiting("5s").server("max_waiters = 1\n")).await;
    let original = spawn_slow(&h, "k-bound", 1000);
    h.wait_executions("k-bound", 1).await;
    let first_waiter = spawn_slow(&h, "k-bound", 0);
    // No signal that the first waiter is registered (it holds no claim and
    // is not counted anywhere): give it a head start.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let started = Instant::now();
    let excess = h.post("/v1/payments", "k-bound", PAY).await;
    excess.assert_problem(409, "request-in-progress");
    assert!(started.elapsed() < Duration::from_millis(500));
    assert!(first_waiter.await.unwrap().replayed());
    assert_eq!(original.await.unwrap().status, 201);
    assert_eq!(h.upstream.executions("k-bound"), 1);
}

#[tokio::test]
async fn waiter_executes_when_the_original_is_released() {
    let h = Harness::start(
        Setup::default().defaults("lease = \"5s\"\nwait = \"5s\"\nrelease_on = [503]\n"),
    )
    .await;
    let client = h.client.clone();
    let url = h.url("/v1/payments");
    let original = tokio::spawn(async move {
        client
            .send(
                Req::post(&url)
                    .key("k-released")
                    .json(PAY)
                    .header("x-sample-delay-ms", "600")
                    .header("x-sample-status", "503"),
            )
            .await
    });
    h.wait_executions("k-released", 1).await;
    let started = Instant::now();
    let dup = h.post("/v1/payments", "k-released", PAY).await;
    assert_eq!(original.await.unwrap().status, 503);
    assert_eq!(dup.status, 201, "{}", dup.text());
    assert!(!dup.replayed(), "the waiter executed it itself");
    assert!(started.elapsed() < Duration::from_millis(2500));
    assert_eq!(h.upstream.executions("k-released"), 2);
}

#[tokio::test]
async fn waiter_takes_over_when_the_original_lease_expires() {
    let h = Harness::start(Setup::default().defaults("lease = \"400ms\"\nwait = \"5s\"\n")).await;
    // An owner that died: a claim nobody renews.
    let store = h.store();
    let fp = idemproxy::idempotency::Fingerprint::compute(
        idemproxy::idempotency::FingerprintMode::Json,
        "POST",
        "/v1/payments",
        None,
        Some(b"application/json"),
        PAY.as_bytes(),
    );
    store
        .claim(
            &idemproxy::idempotency::RecordKey::new(
                idemproxy::idempotency::TenantId::none(),
                idemproxy::idempotency::IdempotencyKey::parse(b"k-dead-owner", 255).unwrap(),
            ),
            &fp,
            idemproxy::idempotency::OwnerToken::mint(),
            Duration::from_millis(400),
            Duration::from_secs(3600),
        )
        .await
        .unwrap();
    let started = Instant::now();
    let r = h.post("/v1/payments", "k-dead-owner", PAY).await;
    assert_eq!(r.status, 201, "{}", r.text());
    assert_eq!(r.header("x-request-echo-attempt"), Some("2"));
    assert!(started.elapsed() >= Duration::from_millis(250));
    assert!(started.elapsed() < Duration::from_millis(2000));
}

#[tokio::test]
async fn keyed_responses_advertise_until_when_the_key_is_remembered() {
    let h = Harness::start(Setup::default().defaults("lease = \"2s\"\nretention = \"1h\"\n")).await;
    let first = h.post("/v1/payments", "k-expiry", PAY).await;
    let again = h.post("/v1/payments", "k-expiry", PAY).await;
    for r in [&first, &again] {
        let at = httpdate::parse_http_date(r.header("idempotency-key-expires").expect("header"))
            .unwrap();
        let ahead = at.duration_since(SystemTime::now()).unwrap();
        assert!(
            ahead > Duration::from_secs(3500) && ahead <= Duration::from_secs(3601),
            "{ahead:?}"
        );
    }
    assert_eq!(
        first.header("idempotency-key-expires"),
        again.header("idempotency-key-expires")
    );
    // Pass-through requests carry no such promise.
    assert!(h
        .send(Req::get("/v1/payments"))
        .await
        .header("idempotency-key-expires")
        .is_none());
}

#[tokio::test]
async fn derived_key_keeps_two_tenants_apart_downstream() {
    let h = Harness::start(Setup::default().routes(
        r#"
[[route]]
path_prefix = "/v1/payments"
tenant_header = "X-Tenant-ID"
derived_key_header = "X-Upstream-Key"

[[route]]
path_prefix = "/v1/orders"
tenant_header = "X-Tenant-ID"
derived_key_header = "X-Upstream-Key"
derived_key = "tenant_key"
"#,
    ))
    .await;
    for t in ["acme", "globex"] {
        h.send(
            Req::post("/v1/payments")
                .key("same")
                .json(PAY)
                .header("X-Tenant-ID", t),
        )
        .await;
    }
    h.send(
        Req::post("/v1/orders")
            .key("o-1")
            .json(PAY)
            .header("X-Tenant-ID", "acme"),
    )
    .await;
    let seen = h.upstream.requests();
    let derived: Vec<String> = seen
        .iter()
        .map(|r| String::from_utf8(r.header("x-upstream-key").unwrap().to_vec()).unwrap())
        .collect();
    assert_eq!(derived[0].len(), 64);
    assert_ne!(derived[0], derived[1], "two tenants, two downstream keys");
    assert_eq!(derived[2], "acme:o-1");
    // The client's own key still reaches the upstream unchanged.
    assert_eq!(seen[0].header("idempotency-key"), Some(&b"same"[..]));
}
