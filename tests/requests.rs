//! DESIGN.md §2: what each request gets, one test per row, and the header
//! rules of §6.

mod support;

use std::time::Duration;

use support::harness::{Harness, Setup};
use support::http::Req;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const PAY: &str = r#"{"amount": 100}"#;

const ROUTES: &str = r#"
[[route]]
name = "payments"
path_prefix = "/v1/payments"
tenant_header = "X-Tenant-ID"
tenant_required = true
key = "required"

[[route]]
name = "api"
path_prefix = "/v1/"
tenant_header = "Authorization"
tenant_hash = true
"#;

fn routed() -> Setup {
    Setup::default().routes(ROUTES)
}

// Row: method/path not covered by a route → pass-through.
#[tokio::test]
async fn path_outside_every_route_is_passed_through_untouched() {
    let h = Harness::start(routed()).await;
    for _ in 0..2 {
        let r = h.post("/health/deep", "k-unrouted", PAY).await;
        assert_eq!(r.status, 201);
        assert!(!r.replayed());
    }
    assert_eq!(h.upstream.executions("k-unrouted"), 2);
    assert_eq!(h.record_count().await, 0);
    assert!(h.upstream.requests()[0]
        .header("idempotency-attempt")
        .is_none());
}

// Row: method not keyed on that route → pass-through.
#[tokio::test]
async fn method_not_keyed_on_the_route_is_passed_through() {
    let h = Harness::start(routed()).await;
    for _ in 0..2 {
        let r = h
            .send(
                Req::new(http::Method::PUT, "/v1/orders")
                    .key("k-put")
                    .header("Authorization", "t"),
            )
            .await;
        assert_eq!(r.status, 201);
    }
    assert_eq!(h.upstream.executions("k-put"), 2);
    assert_eq!(h.record_count().await, 0);
}

// Row: keyed route, no key, optional → pass-through.
#[tokio::test]
async fn missing_optional_key_is_passed_through() {
    let h = Harness::start(routed()).await;
    for _ in 0..2 {
        let r = h.send(Req::post("/v1/orders").json(PAY)).await;
        assert_eq!(r.status, 201);
    }
    assert_eq!(h.upstream.total_requests(), 2);
    assert_eq!(h.record_count().await, 0);
}

// Row: keyed route, no key, required → 400.
#[tokio::test]
async fn missing_required_key_is_400() {
    let h = Harness::start(routed()).await;
    h.send(
        Req::post("/v1/payments")
            .json(PAY)
            .header("X-Tenant-ID", "acme"),
    )
    .await
    .assert_problem(400, "missing-key");
    assert_eq!(h.upstream.total_requests(), 0);
}

// Row: key empty, too long, not visible ASCII → 400; quoted form accepted.
#[tokio::test]
async fn invalid_keys_are_400_and_nothing_is_stored_or_forwarded() {
    let h = Harness::start(Setup::default().defaults("max_key_length = 16\n")).await;
    let long = "k".repeat(17);
    let bad: [&[u8]; 5] = [
        b"",
        long.as_bytes(),
        b"a b",
        b"caf\xc3\xa9",
        br#""unterminated"#,
    ];
    for key in bad {
        h.send(
            Req::post("/v1/orders")
                .header("Idempotency-Key", key)
                .json(PAY),
        )
        .await
        .assert_problem(400, "invalid-key");
    }
    // Sent twice: which one is meant?
    h.send(Req::post("/v1/orders").key("a").key("b").json(PAY))
        .await
        .assert_problem(400, "invalid-key");
    assert_eq!(h.upstream.total_requests(), 0);
    assert_eq!(h.record_count().await, 0);
    // 16 bytes is within the limit.
    assert_eq!(h.post("/v1/orders", &"k".repeat(16), PAY).await.status, 201);
}

#[tokio::test]
async fn quoted_structured_field_key_is_the_same_key_and_forwarded_as_sent() {
    let h = Harness::start(Setup::default()).await;
    let r = h.post("/v1/orders", r#""sf-key-1""#, PAY).await;
    assert_eq!(r.status, 201);
    let seen = &h.upstream.requests()[0];
    assert_eq!(seen.header("idempotency-key"), Some(&br#""sf-key-1""#[..]));
    assert!(h.post("/v1/orders", "sf-key-1", PAY).await.replayed());
    assert_eq!(h.record_state("", "sf-key-1").await.unwrap().0, "completed");
}

// Row: route requires a tenant and the header is missing → 400.
#[tokio::test]
async fn missing_required_tenant_is_400_and_repeated_tenant_too() {
    let h = Harness::start(routed()).await;
    h.post("/v1/payments", "k-tenant", PAY)
        .await
        .assert_problem(400, "missing-tenant");
    h.send(
        Req::post("/v1/payments")
            .key("k-tenant")
            .json(PAY)
            .header("X-Tenant-ID", "a")
            .header("X-Tenant-ID", "b"),
    )
    .await
    .assert_problem(400, "invalid-tenant");
    assert_eq!(h.upstream.total_requests(), 0);
}

// Tenants never see each other's records.
#[tokio::test]
async fn same_key_in_two_tenants_executes_twice_and_never_replays_across() {
    let h = Harness::start(routed()).await;
    let as_tenant = |t: &str| {
        Req::post("/v1/payments")
            .key("shared-key")
            .json(PAY)
            .header("X-Tenant-ID", t)
    };
    let a = h.send(as_tenant("acme")).await;
    let b = h.send(as_tenant("globex")).await;
    assert_eq!((a.status.as_u16(), b.status.as_u16()), (201, 201));
    assert!(!a.replayed() && !b.replayed());
    assert_ne!(a.execution(), b.execution());
    assert_eq!(h.upstream.executions("shared-key"), 2);
    let a2 = h.send(as_tenant("acme")).await;
    assert!(a2.replayed());
    assert_eq!(a2.body, a.body);
    // A different body is a mismatch only within the tenant that used it.
    h.send(as_tenant("acme").json(r#"{"amount": 1}"#))
        .await
        .assert_problem(422, "key-reused");
    assert_eq!(
        h.record_state("acme", "shared-key").await.unwrap().0,
        "completed"
    );
    assert_eq!(
        h.record_state("globex", "shared-key").await.unwrap().0,
        "completed"
    );
}

// tenant_hash: only the digest reaches the database.
#[tokio::test]
async fn hashed_tenant_stores_only_the_digest() {
    let h = Harness::start(routed()).await;
    let secret = "Bearer sk_live_very_secret";
    let r = h
        .send(
            Req::post("/v1/orders")
                .key("k-hash")
                .json(PAY)
                .header("Authorization", secret),
        )
        .await;
    assert_eq!(r.status, 201);
    let c = h.db.client().await;
    let rows = c
        .query("SELECT tenant_id FROM idempotency_records", &[])
        .await
        .unwrap();
    let tenant: String = rows[0].get(0);
    assert!(
        tenant.starts_with("sha256:") && tenant.len() == 7 + 64,
        "{tenant}"
    );
    assert!(!tenant.contains("sk_live"));
    let leaked = c
        .query_one(
            "SELECT count(*) FROM idempotency_records r WHERE r::text LIKE '%sk_live%'",
            &[],
        )
        .await
        .unwrap()
        .get::<_, i64>(0);
    assert_eq!(leaked, 0);
    // Another bearer is another tenant.
    let other = h
        .send(
            Req::post("/v1/orders")
                .key("k-hash")
                .json(PAY)
                .header("Authorization", "Bearer other"),
        )
        .await;
    assert!(!other.replayed());
    assert_eq!(h.upstream.executions("k-hash"), 2);
}

// Row: request body larger than max_request_body → 413, nothing stored or forwarded.
#[tokio::test]
async fn oversized_keyed_body_is_413_and_nothing_is_stored_or_forwarded() {
    let h = Harness::start(Setup::default().server("max_request_body = \"1KiB\"\n")).await;
    let big = format!(r#"{{"pad": "{}"}}"#, "x".repeat(2000));
    h.post("/v1/orders", "k-big", &big)
        .await
        .assert_problem(413, "request-too-large");
    assert_eq!(h.upstream.total_requests(), 0);
    assert_eq!(h.record_count().await, 0);
    // A pass-through request is streamed, not limited.
    assert_eq!(h.send(Req::post("/v1/orders").json(&big)).await.status, 201);
}

#[tokio::test]
async fn oversized_chunked_keyed_body_without_content_length_is_413() {
    let h = Harness::start(Setup::default().server("max_request_body = \"1KiB\"\n")).await;
    let mut s = tokio::net::TcpStream::connect(h.running().proxy_addr)
        .await
        .unwrap();
    let chunk = "y".repeat(800);
    let req = format!(
        "POST /v1/orders HTTP/1.1\r\nHost: x\r\nIdempotency-Key: k-chunked\r\nTransfer-Encoding: chunked\r\n\r\n{len:x}\r\n{chunk}\r\n{len:x}\r\n{chunk}\r\n0\r\n\r\n",
        len = chunk.len()
    );
    s.write_all(req.as_bytes()).await.unwrap();
    let mut buf = vec![0u8; 4096];
    let n = tokio::time::timeout(Duration::from_secs(5), s.read(&mut buf))
        .await
        .unwrap()
        .unwrap();
    let text = String::from_utf8_lossy(&buf[..n]);
    assert!(text.starts_with("HTTP/1.1 413"), "{text}");
    assert_eq!(h.upstream.total_requests(), 0);
    assert_eq!(h.record_count().await, 0);
}

// Row: store unreachable → 503 + Retry-After, nothing forwarded.
#[tokio::test]
async fn unreachable_store_fails_closed_with_503_and_forwards_nothing() {
    let h =
        Harness::start(Setup::default().database_url("postgres://postgres@127.0.0.1:1/none")).await;
    let started = std::time::Instant::now();
    let r = h.post("/v1/orders", "k-503", PAY).await;
    r.assert_problem(503, "store-unavailable");
    assert!(r.header("retry-after").is_some());
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "answered within store.timeout"
    );
    assert_eq!(h.upstream.total_requests(), 0);
    // Pass-through traffic is unaffected.
    assert_eq!(h.send(Req::get("/v1/orders")).await.status, 201);
}

// on_store_error = "pass_through" opts into forwarding unprotected.
#[tokio::test]
async fn unreachable_store_with_pass_through_forwards_unprotected() {
    let h = Harness::start(
        Setup::default()
            .database_url("postgres://postgres@127.0.0.1:1/none")
            .store("on_store_error = \"pass_through\"\n"),
    )
    .await;
    let r = h.post("/v1/orders", "k-unprotected", PAY).await;
    assert_eq!(r.status, 201);
    assert_eq!(h.upstream.executions("k-unprotected"), 1);
    let m = h.running().metrics.render();
    assert!(m.contains(r#"outcome="store_error"} 1"#), "{m}");
}

// Row: upstream refused the connection → claim released, 502; an immediate retry may run.
#[tokio::test]
async fn refused_upstream_connection_releases_the_claim() {
    let closed = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap()
    };
    let h = Harness::start(Setup::default().upstream_url(&format!("http://{closed}"))).await;
    h.post("/v1/orders", "k-refused", PAY)
        .await
        .assert_problem(502, "upstream-unreachable");
    assert_eq!(
        h.record_state("", "k-refused").await,
        None,
        "claim released"
    );
    // The immediate retry is not refused as a duplicate.
    h.post("/v1/orders", "k-refused", PAY)
        .await
        .assert_problem(502, "upstream-unreachable");
}

// Row: upstream timed out after the request was sent → claim kept until its lease expires, 504.
#[tokio::test]
async fn upstream_timeout_keeps_the_claim_until_the_lease_expires() {
    let h = Harness::start(
        Setup::default()
            .upstream_timeout("300ms")
            .defaults("lease = \"1s\"\n"),
    )
    .await;
    let slow = || {
        Req::post("/v1/orders")
            .key("k-timeout")
            .json(PAY)
            .header("x-sample-delay-ms", "2000")
    };
    h.send(slow()).await.assert_problem(504, "upstream-timeout");
    assert_eq!(
        h.record_state("", "k-timeout").await,
        Some(("in_flight".into(), 1))
    );
    // Not renewed any more: a retry within the lease is a conflict…
    h.send(slow())
        .await
        .assert_problem(409, "request-in-progress");
    // The point: the unrenewed lease runs out.
    tokio::time::sleep(Duration::from_millis(1100)).await;
    // …and after it, a takeover with attempt 2.
    let r = h
        .send(Req::post("/v1/orders").key("k-timeout").json(PAY))
        .await;
    assert_eq!(r.status, 201, "{}", r.text());
    assert_eq!(r.header("x-request-echo-attempt"), Some("2"));
    assert_eq!(h.upstream.executions("k-timeout"), 2);
}

// Row: upstream reset after the request was sent → 502, claim left in flight.
#[tokio::test]
async fn upstream_reset_after_sending_keeps_the_claim_in_flight() {
    let h = Harness::start(Setup::default().defaults("lease = \"5s\"\n")).await;
    h.send(
        Req::post("/v1/orders")
            .key("k-reset")
            .json(PAY)
            .header("x-sample-fail", "reset"),
    )
    .await
    .assert_problem(502, "upstream-failed");
    assert_eq!(
        h.record_state("", "k-reset").await,
        Some(("in_flight".into(), 1))
    );
    h.send(
        Req::post("/v1/orders")
            .key("k-reset")
            .json(PAY)
            .header("x-sample-fail", "reset"),
    )
    .await
    .assert_problem(409, "request-in-progress");
    assert_eq!(h.upstream.executions("k-reset"), 1);
}

// Row: upstream answered with a release_on status → released, passed on, nothing stored.
#[tokio::test]
async fn release_on_status_passes_the_response_on_and_lets_a_retry_execute() {
    let h = Harness::start(Setup::default().defaults("release_on = [429, 503]\n")).await;
    let r = h
        .send(
            Req::post("/v1/orders")
                .key("k-429")
                .json(PAY)
                .header("x-sample-status", "429"),
        )
        .await;
    assert_eq!(r.status, 429);
    assert!(
        r.execution().is_some(),
        "the upstream's own response is passed on"
    );
    assert_eq!(h.record_state("", "k-429").await, None);
    let retry = h.post("/v1/orders", "k-429", PAY).await;
    assert_eq!(retry.status, 201);
    assert!(!retry.replayed());
    assert_eq!(h.upstream.executions("k-429"), 2);
}

// Row: any other upstream answer, 5xx included → stored and replayed.
#[tokio::test]
async fn upstream_500_is_stored_and_replayed() {
    let h = Harness::start(Setup::default().defaults("release_on = [429]\n")).await;
    let req = || {
        Req::post("/v1/orders")
            .key("k-500")
            .json(PAY)
            .header("x-sample-status", "500")
    };
    let first = h.send(req()).await;
    assert_eq!(first.status, 500);
    let again = h.send(req()).await;
    assert_eq!(again.status, 500);
    assert!(again.replayed());
    assert_eq!(again.body, first.body);
    assert_eq!(h.upstream.executions("k-500"), 1);
}

// Row: upstream response body larger than max_stored_response.
#[tokio::test]
async fn response_larger_than_max_stored_response_is_passed_on_and_never_replayed_truncated() {
    let h = Harness::start(Setup::default().defaults("max_stored_response = \"1KiB\"\n")).await;
    let req = || {
        Req::post("/v1/orders")
            .key("k-huge")
            .json(PAY)
            .header("x-sample-body-size", "5000")
    };
    let first = h.send(req()).await;
    assert_eq!(first.status, 201);
    assert_eq!(
        first.body.len(),
        5000,
        "the first client gets the whole body"
    );
    assert_eq!(&first.body[..], &sample_upstream::body_pattern(5000)[..]);
    let again = h.send(req()).await;
    again.assert_problem(502, "response-not-stored");
    assert!(again.replayed());
    assert!(
        again.text().contains("201"),
        "names the original status: {}",
        again.text()
    );
    assert_eq!(h.upstream.executions("k-huge"), 1);
    assert_eq!(h.record_state("", "k-huge").await.unwrap().0, "completed");
}

// §6: forwarded requests keep the key, add the attempt and X-Forwarded-*,
// and drop hop-by-hop headers.
#[tokio::test]
async fn forwarded_request_headers_follow_the_rules() {
    let h = Harness::start(Setup::default()).await;
    let r = h
        .send(
            Req::post("/v1/orders?x=1")
                .key("k-headers")
                .json(PAY)
                .header("Connection", "X-Hop")
                .header("X-Hop", "1")
                .header("Keep-Alive", "timeout=5")
                .header("Proxy-Authorization", "Basic eA==")
                .header("X-Forwarded-For", "203.0.113.9")
                .header("Idempotency-Attempt", "99")
                .header("X-Custom", "kept"),
        )
        .await;
    assert_eq!(r.status, 201);
    let seen = &h.upstream.requests()[0];
    assert_eq!(seen.path, "/v1/orders?x=1");
    assert_eq!(seen.header("idempotency-attempt"), Some(&b"1"[..]));
    assert_eq!(seen.header("x-custom"), Some(&b"kept"[..]));
    assert_eq!(
        seen.header("x-forwarded-for"),
        Some(&b"203.0.113.9, 127.0.0.1"[..])
    );
    assert_eq!(seen.header("x-forwarded-proto"), Some(&b"http"[..]));
    assert!(seen.header("x-forwarded-host").is_some());
    for hop in ["x-hop", "keep-alive", "proxy-authorization"] {
        assert!(seen.header(hop).is_none(), "{hop} was forwarded");
    }
    assert_eq!(&seen.body[..], PAY.as_bytes());
}

// Hop-by-hop response headers are neither passed on nor stored.
#[tokio::test]
async fn replayed_response_has_no_hop_by_hop_headers() {
    let h = Harness::start(Setup::default()).await;
    let req = || {
        Req::post("/v1/orders")
            .key("k-slowbody")
            .json(PAY)
            .header("x-sample-slow-body-ms", "5")
            .header("x-sample-body-size", "300")
    };
    let first = h.send(req()).await;
    let again = h.send(req()).await;
    assert!(again.replayed());
    assert_eq!(again.body, first.body);
    assert!(again.header("transfer-encoding").is_none());
    let c = h.db.client().await;
    let names: Vec<String> = c
        .query_one("SELECT response_header_names FROM idempotency_records", &[])
        .await
        .unwrap()
        .get(0);
    assert!(
        !names
            .iter()
            .any(|n| n == "transfer-encoding" || n == "date" || n == "connection"),
        "{names:?}"
    );
}
