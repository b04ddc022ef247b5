//! Hostile clients (DESIGN.md §8.6 and the request-path points of §8.7):
//! forged downstream keys, paths spelled to escape a route's rules, bodies
//! and connections that never end, and answers that would tell a client
//! where the upstream lives.

mod support;

use std::time::{Duration, Instant};

use sha2::{Digest, Sha256};
use support::harness::{Harness, Setup};
use support::http::Req;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const PAY: &str = r#"{"amount": 100}"#;

/// Payments require a key and a tenant; orders key optionally. Both forward
/// a derived key. Nothing else is routed.
const ROUTES: &str = r#"
[[route]]
name = "payments"
path_prefix = "/v1/payments"
tenant_header = "X-Tenant-ID"
tenant_required = true
key = "required"
derived_key_header = "X-Upstream-Key"

[[route]]
name = "orders"
path_prefix = "/v1/orders"
tenant_header = "X-Tenant-ID"
derived_key_header = "X-Upstream-Key"
derived_key = "tenant_key"
"#;

const FORGED: &str = "victim:order-1";

fn routed() -> Setup {
    Setup::default().routes(ROUTES)
}

/// The `sha256` derived key: SHA-256 of tenant, NUL, key.
fn sha256_derived(tenant: &str, key: &str) -> String {
    hex::encode(Sha256::digest(format!("{tenant}\0{key}").as_bytes()))
}

/// What the upstream got in `X-Upstream-Key` on its `n`-th request.
fn derived_seen(h: &Harness, n: usize) -> Option<String> {
    h.upstream.requests()[n]
        .header("x-upstream-key")
        .map(|v| String::from_utf8_lossy(v).into_owned())
}

/// A port nothing listens on.
fn closed_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap().port()
}

// ---------------------------------------------------------------------------
// Forged downstream keys (§8.7).

#[tokio::test]
async fn a_forged_derived_key_never_reaches_the_upstream_on_a_pass_through() {
    let h = Harness::start(routed()).await;
    let cases = [
        // Keyed route, optional key absent.
        Req::post("/v1/orders").json(PAY),
        // Keyed route, method not keyed.
        Req::get("/v1/payments/p-1"),
        // No route at all.
        Req::post("/elsewhere").json(PAY),
    ];
    for (n, req) in cases.into_iter().enumerate() {
        let r = h
            .send(
                req.header("X-Upstream-Key", FORGED)
                    .header("X-Tenant-ID", "acme"),
            )
            .await;
        assert_eq!(r.status, 201, "{}", r.text());
        assert_eq!(derived_seen(&h, n), None, "case {n}");
    }
}

#[tokio::test]
async fn a_keyed_forward_replaces_a_forged_derived_key_with_its_own() {
    let h = Harness::start(routed()).await;
    let r = h
        .send(
            Req::post("/v1/payments")
                .key("k-fwd")
                .json(PAY)
                .header("X-Tenant-ID", "acme")
                .header("X-Upstream-Key", FORGED)
                .header("X-Upstream-Key", "second"),
        )
        .await;
    assert_eq!(r.status, 201, "{}", r.text());
    let seen = &h.upstream.requests()[0];
    let values: Vec<&[u8]> = seen
        .headers
        .iter()
        .filter(|(n, _)| n == "x-upstream-key")
        .map(|(_, v)| v.as_slice())
        .collect();
    assert_eq!(values, [sha256_derived("acme", "k-fwd").as_bytes()]);
}

#[tokio::test]
async fn an_unprotected_forward_on_store_error_carries_our_derived_key_not_the_clients() {
    let h = Harness::start(
        routed()
            .store("on_store_error = \"pass_through\"\n")
            .database_url("postgres://postgres@127.0.0.1:1/unreachable"),
    )
    .await;
    let r = h
        .send(
            Req::post("/v1/orders")
                .key("k-unprotected")
                .json(PAY)
                .header("X-Tenant-ID", "acme")
                .header("X-Upstream-Key", FORGED),
        )
        .await;
    assert_eq!(r.status, 201, "{}", r.text());
    // Unprotected is exactly when an upstream that deduplicates needs it.
    assert_eq!(derived_seen(&h, 0).as_deref(), Some("acme:k-unprotected"));
}

// ---------------------------------------------------------------------------
// Route escape (§8.7): the route's rules apply however the path is spelled.

#[tokio::test]
async fn paths_spelled_differently_get_the_rules_of_the_route_they_name() {
    let h = Harness::start(routed()).await;
    let spellings = [
        "//v1/payments/x",
        "/v1//payments/x",
        "/v1/%70ayments/x",
        "/v1/%70%61yments/x",
        "/v1/./payments/x",
        "/v1/orders/../payments/x",
        "/v1/orders/%2e%2E/payments/x",
    ];
    for path in spellings {
        // No key: the payments route requires one.
        h.send(Req::post(path).json(PAY).header("X-Tenant-ID", "acme"))
            .await
            .assert_problem(400, "missing-key");
        // No tenant: the payments route requires one.
        h.send(Req::post(path).key("k-escape").json(PAY))
            .await
            .assert_problem(400, "missing-tenant");
    }
    assert_eq!(h.upstream.total_requests(), 0);
    assert_eq!(h.record_count().await, 0);
}

#[tokio::test]
async fn a_retry_spelled_differently_is_the_same_request_and_the_upstream_gets_the_normal_form() {
    let h = Harness::start(routed()).await;
    let post = |path: &str| {
        Req::post(path)
            .key("k-spelled")
            .json(PAY)
            .header("X-Tenant-ID", "acme")
    };
    let first = h.send(post("/v1/./payments//p-%31?x=%2f")).await;
    assert_eq!(first.status, 201, "{}", first.text());
    let retry = h.send(post("/v1/%70ayments/p-1?x=%2f")).await;
    assert!(retry.replayed(), "{:?}", retry.headers);
    assert_eq!(retry.body, first.body);
    assert_eq!(h.upstream.executions("k-spelled"), 1);
    // Forwarded as matched: the upstream executes the path whose rules
    // were applied. The query is forwarded as sent.
    assert_eq!(h.upstream.requests()[0].path, "/v1/payments/p-1?x=%2f");
}

#[tokio::test]
async fn ambiguous_paths_are_refused_before_anything_is_stored_or_forwarded() {
    let h = Harness::start(routed()).await;
    for path in [
        // An encoded slash that would make it a payment for an upstream
        // that decodes it.
        "/v1%2Fpayments/x",
        "/v1%2fpayments/x",
        // Above the root.
        "/../v1/payments/x",
        "/v1/../../v1/payments/x",
    ] {
        h.send(
            Req::post(path)
                .key("k-ambiguous")
                .json(PAY)
                .header("X-Tenant-ID", "acme"),
        )
        .await
        .assert_problem(400, "ambiguous-path");
    }
    assert_eq!(h.upstream.total_requests(), 0);
    assert_eq!(h.record_count().await, 0);
    // An encoded slash that changes no route is passed on as it is.
    let r = h.send(Req::get("/files/a%2Fb")).await;
    assert_eq!(r.status, 201, "{}", r.text());
    assert_eq!(h.upstream.requests()[0].path, "/files/a%2Fb");
}

// ---------------------------------------------------------------------------
// No internal addresses in answers (§8.7).

#[tokio::test]
async fn upstream_failures_answer_without_the_upstreams_address_or_os_error() {
    let port = closed_port();
    let h = Harness::start(routed().upstream_url(&format!("http://127.0.0.1:{port}"))).await;
    let keyed = h
        .send(
            Req::post("/v1/payments")
                .key("k-closed")
                .json(PAY)
                .header("X-Tenant-ID", "acme"),
        )
        .await;
    let plain = h.send(Req::get("/v1/payments/p-1")).await;
    for r in [keyed, plain] {
        r.assert_problem(502, "upstream-unreachable");
        let text = r.text();
        for leak in [
            port.to_string().as_str(),
            "127.0.0.1",
            "Connection refused",
            "os error",
            "tcp connect",
        ] {
            assert!(!text.contains(leak), "{leak:?} in {text}");
        }
    }
    // Released: nothing stored.
    assert_eq!(h.record_count().await, 0);
}

// ---------------------------------------------------------------------------
// Slow bodies and connection limits (§8.6).

/// Reads until the server closes the connection or `wait` passes.
async fn read_until_closed(s: &mut TcpStream, wait: Duration) -> (Vec<u8>, bool) {
    let deadline = Instant::now() + wait;
    let mut buf = Vec::new();
    let mut chunk = [0u8; 8192];
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match tokio::time::timeout(left, s.read(&mut chunk)).await {
            Err(_) => return (buf, false),
            Ok(Ok(0)) | Ok(Err(_)) => return (buf, true),
            Ok(Ok(n)) => buf.extend_from_slice(&chunk[..n]),
        }
    }
}

#[tokio::test]
async fn a_keyed_body_that_stalls_gets_408_and_nothing_is_stored_or_forwarded() {
    let h = Harness::start(routed().server("body_read_timeout = \"500ms\"\n")).await;
    let mut s = TcpStream::connect(h.running().proxy_addr).await.unwrap();
    let started = Instant::now();
    s.write_all(
        b"POST /v1/payments HTTP/1.1\r\nHost: x\r\nX-Tenant-ID: acme\r\nIdempotency-Key: k-slow\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"amount\":",
    )
    .await
    .unwrap();
    let (answer, _) = read_until_closed(&mut s, Duration::from_secs(5)).await;
    let text = String::from_utf8_lossy(&answer);
    assert!(text.starts_with("HTTP/1.1 408"), "{text}");
    assert!(
        text.contains("urn:idemproxy:problem:request-timeout"),
        "{text}"
    );
    assert!(started.elapsed() < Duration::from_secs(4));
    assert_eq!(h.upstream.total_requests(), 0);
    assert_eq!(h.record_count().await, 0);
}

#[tokio::test]
async fn connections_past_max_connections_are_closed_at_once() {
    let h = Harness::start(routed().server("max_connections = 2\nheader_read_timeout = \"10s\"\n"))
        .await;
    let addr = h.running().proxy_addr;
    let held = [
        TcpStream::connect(addr).await.unwrap(),
        TcpStream::connect(addr).await.unwrap(),
    ];
    // Let the accept loop take both.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let mut excess = TcpStream::connect(addr).await.unwrap();
    let (_, closed) = read_until_closed(&mut excess, Duration::from_secs(2)).await;
    assert!(closed, "a third connection was kept open");
    // A slot freed is a slot to use.
    drop(held);
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let mut s = TcpStream::connect(addr).await.unwrap();
        s.write_all(b"GET /elsewhere HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            .await
            .unwrap();
        let (answer, _) = read_until_closed(&mut s, Duration::from_secs(2)).await;
        if answer.starts_with(b"HTTP/1.1 201") {
            break;
        }
        assert!(Instant::now() < deadline, "no slot came free");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The h2 client preface and an empty SETTINGS frame.
const H2_HELLO: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\0\0\0\x04\0\0\0\0\0";

/// The settings of the first SETTINGS frame in `bytes`, as (id, value).
fn first_settings(bytes: &[u8]) -> Vec<(u16, u32)> {
    let mut at = 0;
    while at + 9 <= bytes.len() {
        let len = u32::from_be_bytes([0, bytes[at], bytes[at + 1], bytes[at + 2]]) as usize;
        let kind = bytes[at + 3];
        let payload = &bytes[at + 9..(at + 9 + len).min(bytes.len())];
        if kind == 0x4 && bytes[at + 4] & 0x1 == 0 {
            return payload
                .chunks_exact(6)
                .map(|c| {
                    (
                        u16::from_be_bytes([c[0], c[1]]),
                        u32::from_be_bytes([c[2], c[3], c[4], c[5]]),
                    )
                })
                .collect();
        }
        at += 9 + len;
    }
    Vec::new()
}

#[tokio::test]
async fn h2_connections_advertise_the_stream_limit_and_close_when_idle() {
    let h = Harness::start(routed().server(
        "h2_max_concurrent_streams = 7\nidle_timeout = \"500ms\"\nheader_read_timeout = \"10s\"\n",
    ))
    .await;
    let mut s = TcpStream::connect(h.running().proxy_addr).await.unwrap();
    let started = Instant::now();
    s.write_all(H2_HELLO).await.unwrap();
    let (bytes, closed) = read_until_closed(&mut s, Duration::from_secs(4)).await;
    // SETTINGS_MAX_CONCURRENT_STREAMS is 0x3.
    assert!(
        first_settings(&bytes).contains(&(0x3, 7)),
        "{:?}",
        first_settings(&bytes)
    );
    assert!(closed, "an idle h2 connection was kept open");
    assert!(started.elapsed() >= Duration::from_millis(400));
}

#[tokio::test]
async fn an_idle_http1_connection_is_closed_after_idle_timeout() {
    let h = Harness::start(
        routed().server("idle_timeout = \"500ms\"\nheader_read_timeout = \"10s\"\n"),
    )
    .await;
    let mut s = TcpStream::connect(h.running().proxy_addr).await.unwrap();
    s.write_all(b"GET /elsewhere HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    let started = Instant::now();
    let (bytes, closed) = read_until_closed(&mut s, Duration::from_secs(4)).await;
    assert!(bytes.starts_with(b"HTTP/1.1 201"));
    assert!(closed, "an idle keep-alive connection was kept open");
    assert!(started.elapsed() >= Duration::from_millis(400));
}

#[tokio::test]
async fn a_request_in_progress_longer_than_idle_timeout_is_answered_before_the_close() {
    // A connection is idle only with no request in progress: the upstream
    // takes three idle timeouts to answer, and the answer still arrives.
    let h = Harness::start(
        routed().server("idle_timeout = \"300ms\"\nheader_read_timeout = \"10s\"\n"),
    )
    .await;
    let mut s = TcpStream::connect(h.running().proxy_addr).await.unwrap();
    let started = Instant::now();
    s.write_all(b"GET /elsewhere HTTP/1.1\r\nHost: x\r\nx-sample-delay-ms: 900\r\n\r\n")
        .await
        .unwrap();
    let (bytes, closed) = read_until_closed(&mut s, Duration::from_secs(5)).await;
    assert!(
        bytes.starts_with(b"HTTP/1.1 201"),
        "cut before its answer: {:?}",
        String::from_utf8_lossy(&bytes)
    );
    assert!(closed, "the connection was not closed once idle");
    // The answer after 900 ms, then the idle timeout from there.
    assert!(started.elapsed() >= Duration::from_millis(1100));
}

#[tokio::test]
async fn an_http1_connection_waiting_for_its_next_request_is_bound_by_header_read_timeout() {
    // As docs/configuration.md says: hyper starts the header clock as soon
    // as it waits for a request head, so it bounds keep-alive idleness too.
    let h = Harness::start(
        routed().server("idle_timeout = \"60s\"\nheader_read_timeout = \"500ms\"\n"),
    )
    .await;
    let mut s = TcpStream::connect(h.running().proxy_addr).await.unwrap();
    s.write_all(b"GET /elsewhere HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    let (bytes, closed) = read_until_closed(&mut s, Duration::from_secs(4)).await;
    assert!(bytes.starts_with(b"HTTP/1.1 201"));
    assert!(
        closed,
        "an idle keep-alive connection outlived header_read_timeout"
    );
}
