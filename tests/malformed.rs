//! Malformed HTTP on raw sockets (issue "Bad input"): each gets a clear 4xx,
//! or a closed connection where HTTP says so; never a panic, a hang or a
//! proxy 5xx; and nothing is stored or forwarded.

mod support;

use std::time::{Duration, Instant};

use support::harness::{Harness, Setup};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const ROUTES: &str = r#"
[[route]]
name = "payments"
path_prefix = "/v1/payments"
tenant_header = "X-Tenant-ID"
tenant_required = true

[[route]]
name = "api"
path_prefix = "/v1/"
tenant_header = "Authorization"
tenant_hash = true
"#;

async fn harness() -> Harness {
    Harness::start(
        Setup::default()
            .routes(ROUTES)
            .server("header_read_timeout = \"1s\"\nmax_request_body = \"64KiB\"\n"),
    )
    .await
}

/// What came back on a raw connection.
#[derive(Debug)]
struct Raw {
    /// Everything the server sent.
    text: String,
    /// The server closed (or reset) the connection.
    closed: bool,
    /// How long until the server closed it, or until we stopped reading.
    took: Duration,
}

impl Raw {
    /// The status of the first response, if one came.
    fn status(&self) -> Option<u16> {
        let line = self.text.lines().next()?;
        let mut parts = line.split(' ');
        (parts.next()? == "HTTP/1.1").then_some(())?;
        parts.next()?.parse().ok()
    }

    fn assert_status(&self, status: u16) {
        assert_eq!(self.status(), Some(status), "{self:#?}");
    }

    /// A proxy problem of this type (status checked separately).
    fn assert_problem(&self, status: u16, slug: &str) {
        self.assert_status(status);
        assert!(
            self.text.contains("application/problem+json")
                && self
                    .text
                    .contains(&format!("\"urn:idemproxy:problem:{slug}\"")),
            "{self:#?}"
        );
    }
}

/// Writes `parts` on a fresh connection (pausing `gap` between them), then
/// reads until the server closes the connection or `wait` has passed.
/// `half_close` shuts our side for writing after the last part, as a client
/// that gave up mid-request would.
async fn exchange(
    h: &Harness,
    parts: &[&[u8]],
    gap: Duration,
    half_close: bool,
    wait: Duration,
) -> Raw {
    let mut s = TcpStream::connect(h.running().proxy_addr).await.unwrap();
    let started = Instant::now();
    for (i, part) in parts.iter().enumerate() {
        if i > 0 {
            tokio::time::sleep(gap).await;
        }
        if s.write_all(part).await.is_err() {
            break; // the server already closed: read what it said
        }
    }
    if half_close {
        let _ = s.shutdown().await;
    }
    let mut buf = Vec::new();
    let mut chunk = [0u8; 8192];
    let deadline = started + wait;
    let closed = loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match tokio::time::timeout(left, s.read(&mut chunk)).await {
            Err(_) => break false,
            Ok(Ok(0)) | Ok(Err(_)) => break true,
            Ok(Ok(n)) => buf.extend_from_slice(&chunk[..n]),
        }
    };
    Raw {
        text: String::from_utf8_lossy(&buf).into_owned(),
        closed,
        took: started.elapsed(),
    }
}

/// One request, whole; the connection is closed by whoever is done first.
async fn send(h: &Harness, request: &[u8]) -> Raw {
    exchange(h, &[request], Duration::ZERO, false, Duration::from_secs(5)).await
}

/// Nothing was stored or forwarded, and the proxy still serves.
async fn assert_untouched(h: &Harness) {
    assert_eq!(
        h.upstream.total_requests(),
        0,
        "{:?}",
        h.upstream.requests()
    );
    assert_eq!(h.record_count().await, 0);
    assert_still_serving(h).await;
}

async fn assert_still_serving(h: &Harness) {
    let ok = send(
        h,
        b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
    )
    .await;
    ok.assert_status(201);
}

/// A keyed request on the hashed-tenant route, with `head` spliced in.
fn keyed(head: &str, body: &str) -> Vec<u8> {
    format!(
        "POST /v1/orders HTTP/1.1\r\nHost: x\r\nConnection: close\r\nAuthorization: Bearer t\r\nContent-Type: application/json\r\n{head}Content-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

#[tokio::test]
async fn invalid_header_bytes_get_400_and_reach_nothing() {
    let h = harness().await;
    let cases: [&[u8]; 5] = [
        // A control byte in a value.
        b"POST /v1/orders HTTP/1.1\r\nHost: x\r\nIdempotency-Key: a\x01b\r\nContent-Length: 2\r\n\r\n{}",
        // NUL in a value.
        b"POST /v1/orders HTTP/1.1\r\nHost: x\r\nIdempotency-Key: a\x00b\r\nContent-Length: 2\r\n\r\n{}",
        // A space in a header name.
        b"POST /v1/orders HTTP/1.1\r\nHost: x\r\nIdempotency Key: k\r\nContent-Length: 2\r\n\r\n{}",
        // A header line without a colon.
        b"POST /v1/orders HTTP/1.1\r\nHost: x\r\nIdempotency-Key k\r\nContent-Length: 2\r\n\r\n{}",
        // Obsolete line folding (a request smuggling classic).
        b"POST /v1/orders HTTP/1.1\r\nHost: x\r\nIdempotency-Key: k\r\n continued\r\nContent-Length: 2\r\n\r\n{}",
    ];
    for case in cases {
        let r = send(&h, case).await;
        r.assert_status(400);
        assert!(r.closed, "{r:#?}");
    }
    assert_untouched(&h).await;
}

#[tokio::test]
async fn non_ascii_key_bytes_are_a_proxy_400_not_a_parser_error() {
    // obs-text (0x80-0xFF) is legal in a header value, so hyper lets it
    // through and the key rules refuse it.
    let h = harness().await;
    let r = send(&h, &keyed("Idempotency-Key: caf\u{e9}\r\n", "{}")).await;
    r.assert_problem(400, "invalid-key");
    // A lone 0xFF (not UTF-8) spliced into the key.
    let mut raw = keyed("Idempotency-Key: k\r\n", "{}");
    let at = raw
        .windows(18)
        .position(|w| w == b"Idempotency-Key: k")
        .unwrap()
        + 18;
    raw.insert(at, 0xff);
    send(&h, &raw).await.assert_problem(400, "invalid-key");
    assert_untouched(&h).await;
}

#[tokio::test]
async fn oversized_headers_get_431_and_reach_nothing() {
    let h = harness().await;
    // One enormous header (hyper buffers about 400 KiB of head at most).
    let huge = format!(
        "POST /v1/orders HTTP/1.1\r\nHost: x\r\nIdempotency-Key: k-huge\r\nX-Pad: {}\r\nContent-Length: 2\r\n\r\n{{}}",
        "p".repeat(600 * 1024)
    );
    let r = send(&h, huge.as_bytes()).await;
    r.assert_status(431);
    assert!(r.closed, "{r:#?}");
    // Too many headers (hyper allows 100).
    let mut many =
        String::from("POST /v1/orders HTTP/1.1\r\nHost: x\r\nIdempotency-Key: k-many\r\n");
    for i in 0..150 {
        many.push_str(&format!("X-H{i}: v\r\n"));
    }
    many.push_str("Content-Length: 2\r\n\r\n{}");
    let r = send(&h, many.as_bytes()).await;
    r.assert_status(431);
    // A key far beyond max_key_length is a proxy 400.
    let long = keyed(&format!("Idempotency-Key: {}\r\n", "k".repeat(8192)), "{}");
    send(&h, &long).await.assert_problem(400, "invalid-key");
    assert_untouched(&h).await;
}

#[tokio::test]
async fn headers_sent_slowly_are_cut_off_at_header_read_timeout() {
    let h = harness().await;
    let head = b"POST /v1/orders HTTP/1.1\r\nHost: x\r\nIdempotency-Key: k-slow\r\nX-Drip: ";
    let drip: Vec<&[u8]> = std::iter::once(&head[..])
        .chain(std::iter::repeat_n(&b"z"[..], 40))
        .collect();
    // 40 bytes, one every 100 ms: 4 s of headers against a 1 s limit.
    let r = exchange(
        &h,
        &drip,
        Duration::from_millis(100),
        false,
        Duration::from_secs(6),
    )
    .await;
    assert!(r.closed, "the slow client was never cut off: {r:#?}");
    assert!(
        r.took >= Duration::from_millis(900) && r.took < Duration::from_secs(3),
        "{r:#?}"
    );
    // HTTP allows either a 408 or just closing.
    assert!(r.text.is_empty() || r.status() == Some(408), "{r:#?}");
    // An idle connection that sends nothing is cut off the same way.
    let idle = exchange(&h, &[], Duration::ZERO, false, Duration::from_secs(6)).await;
    assert!(
        idle.closed && idle.took < Duration::from_secs(3),
        "{idle:#?}"
    );
    assert_untouched(&h).await;
}

#[tokio::test]
async fn conflicting_or_absurd_content_length_gets_400() {
    let h = harness().await;
    let cases: [&[u8]; 5] = [
        b"POST /v1/orders HTTP/1.1\r\nHost: x\r\nIdempotency-Key: k-cl\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\n{}x",
        b"POST /v1/orders HTTP/1.1\r\nHost: x\r\nIdempotency-Key: k-cl\r\nContent-Length: 2, 3\r\n\r\n{}x",
        b"POST /v1/orders HTTP/1.1\r\nHost: x\r\nIdempotency-Key: k-cl\r\nContent-Length: -1\r\n\r\n{}",
        b"POST /v1/orders HTTP/1.1\r\nHost: x\r\nIdempotency-Key: k-cl\r\nContent-Length: 99999999999999999999999999\r\n\r\n{}",
        b"POST /v1/orders HTTP/1.1\r\nHost: x\r\nIdempotency-Key: k-cl\r\nContent-Length: 0x10\r\n\r\n{}",
    ];
    for case in cases {
        let r = send(&h, case).await;
        r.assert_status(400);
        assert!(r.closed, "{r:#?}");
    }
    assert_untouched(&h).await;
}

#[tokio::test]
async fn huge_declared_content_length_on_a_keyed_route_is_413_without_reading_it() {
    let h = harness().await;
    // A terabyte is announced, two bytes are sent: answered at once.
    let r = exchange(
        &h,
        &[b"POST /v1/orders HTTP/1.1\r\nHost: x\r\nAuthorization: t\r\nIdempotency-Key: k-tb\r\nContent-Length: 1099511627776\r\n\r\n{}"],
        Duration::ZERO,
        false,
        Duration::from_secs(5),
    )
    .await;
    r.assert_problem(413, "request-too-large");
    assert!(r.took < Duration::from_secs(3), "{r:#?}");
    assert_untouched(&h).await;
}

#[tokio::test]
async fn content_length_with_transfer_encoding_is_never_forwarded_ambiguously() {
    // Both framings at once is how requests are smuggled past a proxy. The
    // proxy may refuse it (400) or go by Transfer-Encoding alone; either
    // way the upstream must see one request with one framing, and the
    // second "request" hidden in the body must never reach it.
    let h = harness().await;
    let smuggled = b"GET /smuggled HTTP/1.1\r\nHost: x\r\n\r\n";
    for path in ["/v1/orders", "/open/orders"] {
        let body = format!(
            "{:x}\r\n{{}}{}\r\n0\r\n\r\n",
            2 + smuggled.len(),
            String::from_utf8_lossy(smuggled)
        );
        let req = format!(
            "POST {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\nAuthorization: t\r\nIdempotency-Key: k-te-cl\r\nContent-Length: 2\r\nTransfer-Encoding: chunked\r\n\r\n{body}"
        );
        let r = send(&h, req.as_bytes()).await;
        let status = r.status().unwrap_or(0);
        assert!(status == 400 || status == 201, "{r:#?}");
    }
    for seen in h.upstream.requests() {
        assert_ne!(
            seen.path, "/smuggled",
            "a smuggled request reached the upstream"
        );
        assert!(
            seen.header("content-length").is_none() || seen.header("transfer-encoding").is_none(),
            "forwarded with both framings: {seen:?}"
        );
    }
    assert!(!h.upstream.requests().iter().any(|r| r.path == "/smuggled"));
    assert_still_serving(&h).await;
}

#[tokio::test]
async fn keyed_bodies_that_end_early_store_and_forward_nothing() {
    let h = harness().await;
    // Chunked, closed after the first chunk.
    let chunked = exchange(
        &h,
        &[b"POST /v1/orders HTTP/1.1\r\nHost: x\r\nAuthorization: t\r\nIdempotency-Key: k-early-1\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n5\r\n{\"a\":"],
        Duration::ZERO,
        true,
        Duration::from_secs(5),
    )
    .await;
    assert!(chunked.closed, "{chunked:#?}");
    assert!(
        chunked.text.is_empty() || chunked.status() == Some(400),
        "{chunked:#?}"
    );
    // Content-Length promises 100 bytes, 10 come.
    let short = exchange(
        &h,
        &[b"POST /v1/orders HTTP/1.1\r\nHost: x\r\nAuthorization: t\r\nIdempotency-Key: k-early-2\r\nContent-Length: 100\r\n\r\n0123456789"],
        Duration::ZERO,
        true,
        Duration::from_secs(5),
    )
    .await;
    assert!(short.closed, "{short:#?}");
    assert!(
        short.text.is_empty() || short.status() == Some(400),
        "{short:#?}"
    );
    // The client drops the connection (no half-close) mid-chunk.
    {
        let mut s = TcpStream::connect(h.running().proxy_addr).await.unwrap();
        s.write_all(b"POST /v1/orders HTTP/1.1\r\nHost: x\r\nAuthorization: t\r\nIdempotency-Key: k-early-3\r\nTransfer-Encoding: chunked\r\n\r\n100\r\nonly a few bytes")
            .await
            .unwrap();
        drop(s);
    }
    // Give the proxy time to see the end of each connection.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_untouched(&h).await;
    // And the keys are free: the same keys with whole bodies execute.
    for key in ["k-early-1", "k-early-2", "k-early-3"] {
        let r = send(&h, &keyed(&format!("Idempotency-Key: {key}\r\n"), "{}")).await;
        r.assert_status(201);
    }
}

#[tokio::test]
async fn malformed_chunked_framing_gets_400_and_reaches_nothing() {
    let h = harness().await;
    let cases: [&[u8]; 3] = [
        // Not a hex chunk size.
        b"POST /v1/orders HTTP/1.1\r\nHost: x\r\nAuthorization: t\r\nIdempotency-Key: k-ch\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n",
        // A chunk size that overflows.
        b"POST /v1/orders HTTP/1.1\r\nHost: x\r\nAuthorization: t\r\nIdempotency-Key: k-ch\r\nTransfer-Encoding: chunked\r\n\r\nfffffffffffffffffffff\r\n{}\r\n0\r\n\r\n",
        // Chunk data longer than its size says.
        b"POST /v1/orders HTTP/1.1\r\nHost: x\r\nAuthorization: t\r\nIdempotency-Key: k-ch\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}xx\r\n0\r\n\r\n",
    ];
    for case in cases {
        let r = send(&h, case).await;
        assert!(r.closed, "{r:#?}");
        assert!(
            r.text.is_empty() || r.status() == Some(400),
            "neither 400 nor closed: {r:#?}"
        );
    }
    assert_untouched(&h).await;
}

#[tokio::test]
async fn invalid_utf8_or_bytes_in_the_path_get_400() {
    let h = harness().await;
    let cases: [&[u8]; 3] = [
        b"POST /v1/orders/\xff\xfe HTTP/1.1\r\nHost: x\r\nAuthorization: t\r\nIdempotency-Key: k-path\r\nContent-Length: 2\r\n\r\n{}",
        b"POST /v1/orders/\xc3 HTTP/1.1\r\nHost: x\r\nAuthorization: t\r\nIdempotency-Key: k-path\r\nContent-Length: 2\r\n\r\n{}",
        b"POST /v1/ord\x01ers HTTP/1.1\r\nHost: x\r\nAuthorization: t\r\nIdempotency-Key: k-path\r\nContent-Length: 2\r\n\r\n{}",
    ];
    for case in cases {
        send(&h, case).await.assert_status(400);
    }
    assert_untouched(&h).await;
}

#[tokio::test]
async fn utf8_in_the_path_is_tolerated_and_forwarded_exactly_as_sent() {
    // Not legal in a URI, but sent by real clients; the parser accepts
    // well-formed UTF-8 and the proxy passes the bytes on unchanged, so the
    // upstream sees what the client sent and retries fingerprint alike.
    let h = harness().await;
    let req = "POST /v1/orders/caf\u{e9} HTTP/1.1\r\nHost: x\r\nConnection: close\r\nAuthorization: t\r\nIdempotency-Key: k-utf8-path\r\nContent-Length: 2\r\n\r\n{}";
    send(&h, req.as_bytes()).await.assert_status(201);
    let replay = send(&h, req.as_bytes()).await;
    replay.assert_status(201);
    assert!(
        replay.text.contains("idempotent-replayed: true"),
        "{replay:#?}"
    );
    assert_eq!(h.upstream.requests()[0].path, "/v1/orders/caf\u{e9}");
    assert_eq!(h.upstream.executions("k-utf8-path"), 1);
}

#[tokio::test]
async fn invalid_utf8_in_a_plain_tenant_header_is_400_and_hashed_tenants_take_any_bytes() {
    let h = harness().await;
    let plain = b"POST /v1/payments HTTP/1.1\r\nHost: x\r\nConnection: close\r\nX-Tenant-ID: \xff\xfeacme\r\nIdempotency-Key: k-tenant\r\nContent-Length: 2\r\n\r\n{}";
    send(&h, plain).await.assert_problem(400, "invalid-tenant");
    assert_untouched(&h).await;

    // On a tenant_hash route the bytes are only hashed.
    let hashed = b"POST /v1/orders HTTP/1.1\r\nHost: x\r\nConnection: close\r\nAuthorization: Bearer \xff\xfe\x80\r\nIdempotency-Key: k-tenant\r\nContent-Length: 2\r\n\r\n{}";
    send(&h, hashed).await.assert_status(201);
    send(&h, hashed).await.assert_status(201);
    assert_eq!(
        h.upstream.executions("k-tenant"),
        1,
        "the retry was replayed"
    );
    let digest = {
        use sha2::{Digest, Sha256};
        format!(
            "sha256:{}",
            hex::encode(Sha256::digest(b"Bearer \xff\xfe\x80"))
        )
    };
    assert_eq!(
        h.record_state(&digest, "k-tenant").await,
        Some(("completed".into(), 1))
    );
}

#[tokio::test]
async fn duplicate_idempotency_key_headers_are_400_whatever_their_values() {
    let h = harness().await;
    let cases = [
        "Idempotency-Key: k-dup\r\nIdempotency-Key: k-dup\r\n",
        "Idempotency-Key: k-dup\r\nIdempotency-Key: k-other\r\n",
        "Idempotency-Key: k-dup\r\nidempotency-key: k-dup\r\n",
        // One header, two list members: not a valid key either.
        "Idempotency-Key: k-dup, k-other\r\n",
        "Idempotency-Key: \"k-dup\", \"k-other\"\r\n",
    ];
    for head in cases {
        send(&h, &keyed(head, "{}"))
            .await
            .assert_problem(400, "invalid-key");
    }
    assert_untouched(&h).await;
}
