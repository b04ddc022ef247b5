//! The in-process cache of completed responses.

mod support;

use std::time::{Duration, Instant};

use support::harness::{Harness, Setup};
use support::http::Req;

const PAY: &str = r#"{"amount": 100}"#;

fn claim_statements(h: &Harness) -> f64 {
    let m = h.running().metrics.render();
    m.lines()
        .find_map(|l| l.strip_prefix(r#"idemproxy_store_duration_seconds_count{op="claim"} "#))
        .map_or(0.0, |v| v.trim().parse().unwrap())
}

#[tokio::test]
async fn warm_replays_are_served_without_a_database_round_trip() {
    let h = Harness::start(Setup::default()).await;
    let first = h.post("/v1/payments", "k-cached", PAY).await;
    // The first replay reads the database and warms the cache.
    let before = claim_statements(&h);
    let from_db = h.post("/v1/payments", "k-cached", PAY).await;
    assert!(from_db.replayed());
    assert_eq!(claim_statements(&h), before + 1.0, "first replay: one read");
    // Every header but the per-answer ones, in order, repeats included.
    let kept = |r: &support::http::Resp| -> Vec<(String, Vec<u8>)> {
        r.headers
            .iter()
            .filter(|(n, _)| !matches!(n.as_str(), "date" | "x-request-id"))
            .map(|(n, v)| (n.as_str().to_owned(), v.as_bytes().to_vec()))
            .collect()
    };
    let before = claim_statements(&h);
    for _ in 0..5 {
        let r = h.post("/v1/payments", "k-cached", PAY).await;
        assert!(r.replayed());
        assert_eq!(r.status, from_db.status);
        assert_eq!(r.body, first.body);
        assert!(r.header("idempotency-key-expires").is_some());
        assert_eq!(
            kept(&r),
            kept(&from_db),
            "a cached replay is the database's"
        );
    }
    assert_eq!(
        claim_statements(&h),
        before,
        "no claim statement for cached replays"
    );
    // A different body is still a mismatch (answered by the database).
    h.post("/v1/payments", "k-cached", r#"{"amount": 1}"#)
        .await
        .assert_problem(422, "key-reused");
}

#[tokio::test]
async fn a_warm_entry_knows_its_requests_bytes_and_nothing_else() {
    // A replay from the cache takes the fingerprint of a retry whose bytes
    // are those of the request that filled the entry; anything else is
    // fingerprinted and compared as before.
    let h = Harness::start(Setup::default()).await;
    let key = "k-bytes";
    let first = h.post("/v1/payments", key, PAY).await;
    assert_eq!(first.status, 201);
    assert!(h.post("/v1/payments", key, PAY).await.replayed(), "warms");
    let before = claim_statements(&h);
    // The same bytes, and the same JSON in other bytes: both replays,
    // from memory.
    for body in [PAY, r#"{ "amount" : 100 }"#] {
        let r = h.post("/v1/payments", key, body).await;
        assert!(r.replayed(), "{body}");
        assert_eq!(r.body, first.body);
    }
    assert_eq!(claim_statements(&h), before, "answered from the cache");
    // One input different at a time, the rest the warm request's bytes:
    // each is another request (422), never the cached replay.
    let same_length = r#"{"amount": 101}"#;
    assert_eq!(same_length.len(), PAY.len());
    let variants = [
        ("body", Req::post("/v1/payments").key(key).json(same_length)),
        (
            "query",
            Req::post("/v1/payments?currency=eur").key(key).json(PAY),
        ),
        (
            "content type (hashed as bytes, not as JSON)",
            Req::post("/v1/payments")
                .key(key)
                .header("Content-Type", "text/plain")
                .body(PAY),
        ),
        ("method", {
            let mut r = Req::post("/v1/payments").key(key).json(PAY);
            r.method = http::Method::PATCH;
            r
        }),
    ];
    for (what, req) in variants {
        h.send(req).await.assert_problem(422, "key-reused");
        // And the entry still answers its own bytes.
        assert!(h.post("/v1/payments", key, PAY).await.replayed(), "{what}");
    }
    assert_eq!(h.upstream.executions(key), 1);
}

#[tokio::test]
async fn cache_can_be_turned_off() {
    let h = Harness::start(Setup::default().store("response_cache = \"0\"\n")).await;
    h.post("/v1/payments", "k-uncached", PAY).await;
    let before = claim_statements(&h);
    assert!(h.post("/v1/payments", "k-uncached", PAY).await.replayed());
    assert_eq!(claim_statements(&h), before + 1.0);
}

#[tokio::test]
async fn an_operators_forced_release_reaches_the_cache_of_every_replica() {
    let h = Harness::start(Setup::default()).await;
    let b = h.replica().await;
    let b_url = format!("http://{}/v1/payments", b.proxy_addr);
    let client = support::http::HttpClient::new();
    let post_b = || client.send(support::http::Req::post(&b_url).key("k-forced").json(PAY));
    h.post("/v1/payments", "k-forced", PAY).await;
    // Warm both caches.
    assert!(h.post("/v1/payments", "k-forced", PAY).await.replayed());
    assert!(post_b().await.replayed());
    let released = h.store().force_release("", "k-forced", true).await.unwrap();
    assert_eq!(released.as_deref(), Some("completed"));
    // The notification, not the TTL (60 s), drops it from both caches.
    let deadline = Instant::now() + Duration::from_secs(3);
    loop {
        let r = post_b().await;
        if !r.replayed() {
            assert_eq!(r.status, 201);
            break;
        }
        assert!(
            Instant::now() < deadline,
            "replica B still replays a released key"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(h.upstream.executions("k-forced"), 2);
    b.shutdown().await;
}
