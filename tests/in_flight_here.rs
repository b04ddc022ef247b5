//! Duplicates of a key this process holds in flight: answered from the
//! renewer's knowledge of its own lease, without the database, and only
//! while that lease is known to run on.

mod support;

use std::time::Duration;

use idemproxy::idempotency::{IdempotencyKey, OwnerToken, RecordKey, TenantId};
use idemproxy::metrics::Outcome;
use idemproxy::store::StoredResponse;
use support::harness::{Harness, Setup};
use support::http::{metric_value, Req};

const PAY: &str = r#"{"amount": 100, "currency": "EUR"}"#;

/// Statements that read or claimed a record (every duplicate the database
/// answers runs one).
fn claim_statements(h: &Harness) -> f64 {
    metric_value(
        &h.running().metrics.render(),
        r#"idemproxy_store_duration_seconds_count{op="claim"}"#,
    )
}

/// Sends a keyed request that the sample upstream holds for `delay_ms`,
/// in the background.
fn slow_original(
    h: &Harness,
    key: &'static str,
    delay_ms: u64,
) -> tokio::task::JoinHandle<support::http::Resp> {
    let client = h.client.clone();
    let url = h.url("/v1/payments");
    tokio::spawn(async move {
        client
            .send(
                Req::post(&url)
                    .key(key)
                    .json(PAY)
                    .header("x-sample-delay-ms", delay_ms.to_string()),
            )
            .await
    })
}

#[tokio::test]
async fn duplicates_of_a_key_held_here_are_answered_without_the_database() {
    let h = Harness::start(Setup::default().defaults("lease = \"5s\"\n")).await;
    let original = slow_original(&h, "k-here", 1500);
    h.wait_executions("k-here", 1).await;
    let before = claim_statements(&h);
    for _ in 0..5 {
        let dup = h.post("/v1/payments", "k-here", PAY).await;
        dup.assert_problem(409, "request-in-progress");
        let retry_after: u64 = dup.header("retry-after").unwrap().parse().unwrap();
        assert!((1..=5).contains(&retry_after), "Retry-After {retry_after}");
    }
    // Another request under the key: the claim's fingerprint says 422.
    h.post("/v1/payments", "k-here", r#"{"amount": 5}"#)
        .await
        .assert_problem(422, "key-reused");
    assert_eq!(claim_statements(&h), before, "no statement for any of them");
    let metrics = &h.running().metrics;
    assert_eq!(metrics.request_count("default", Outcome::Conflict), 5);
    assert_eq!(metrics.request_count("default", Outcome::Mismatch), 1);
    assert!(
        metrics
            .render()
            .contains("idemproxy_duplicates_held_here_total 6\n"),
        "{}",
        metrics.render()
    );

    // Completed: no longer held here; the next retry reads the record.
    assert_eq!(original.await.unwrap().status, 201);
    assert!(h.post("/v1/payments", "k-here", PAY).await.replayed());
    assert_eq!(claim_statements(&h), before + 1.0);
    assert_eq!(h.upstream.executions("k-here"), 1);
}

// A lease this process lost (another replica took the key over and
// completed it while this one's call was still running) must not be
// answered from here: the duplicate gets the other replica's completion.
#[tokio::test]
async fn a_lease_lost_here_is_no_longer_answered_from_here() {
    // Renewal every second (a third of the lease), checked every 500 ms.
    let h = Harness::start(Setup::default().defaults("lease = \"3s\"\n")).await;
    let original = slow_original(&h, "k-lost-here", 3000);
    h.wait_executions("k-lost-here", 1).await;
    h.post("/v1/payments", "k-lost-here", PAY)
        .await
        .assert_problem(409, "request-in-progress");

    // What another replica's takeover and completion leave in the table.
    let other = OwnerToken::mint();
    let c = h.db.client().await;
    let stolen = c
        .execute(
            "UPDATE idempotency_records SET owner_token = $1 WHERE idempotency_key = 'k-lost-here'",
            &[&other.as_uuid()],
        )
        .await
        .unwrap();
    assert_eq!(stolen, 1);
    let record = RecordKey::new(
        TenantId::none(),
        IdempotencyKey::parse(b"k-lost-here", 255).unwrap(),
    );
    let theirs = StoredResponse {
        status: 201,
        headers: vec![("content-type".into(), "text/plain".into())],
        body: Some(b"the other replica's answer"[..].into()),
    };
    assert!(h
        .store()
        .complete(&record, other, &theirs, Duration::from_secs(3600), None)
        .await
        .unwrap()
        .is_some());

    // The point: the first renewal (1–1.5 s into the lease) finds the lease
    // lost. The lease itself would run for another second from here.
    tokio::time::sleep(Duration::from_millis(1900)).await;
    let dup = h.post("/v1/payments", "k-lost-here", PAY).await;
    assert!(dup.replayed(), "{} {}", dup.status, dup.text());
    assert_eq!(dup.text(), "the other replica's answer");

    // The original's client still gets its own upstream answer; nothing
    // of it is stored over the other's.
    assert_eq!(original.await.unwrap().status, 201);
    let again = h.post("/v1/payments", "k-lost-here", PAY).await;
    assert_eq!(again.text(), "the other replica's answer");
    assert_eq!(h.upstream.executions("k-lost-here"), 1);
}
