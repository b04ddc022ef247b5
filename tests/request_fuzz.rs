//! The request path under arbitrary input (issue 10, "fuzzing of the
//! request path itself"): methods, paths (dot segments, `//`, `%xx`, bytes
//! the parser may or may not take), keys, tenants, headers and bodies,
//! written on a real socket to a real proxy on a real PostgreSQL. For every
//! request: the proxy answers with a valid HTTP response (its own answers
//! are problem+json), and nothing is stored without being forwarded.

mod support;

use std::time::Duration;

use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestRunner};
use support::harness::{Harness, Setup};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const ROUTES: &str = r#"
[[route]]
name = "payments"
path_prefix = "/v1/payments"
tenant_header = "X-Tenant-ID"
tenant_required = true
derived_key_header = "X-Upstream-Key"
derived_key = "tenant_key"

[[route]]
name = "api"
path_prefix = "/v1/"
tenant_header = "Authorization"
tenant_hash = true
"#;

/// One generated request.
#[derive(Debug, Clone)]
struct Input {
    method: &'static str,
    path: Vec<u8>,
    key: Option<&'static [u8]>,
    tenant: Option<&'static [u8]>,
    extra: Vec<(&'static str, &'static [u8])>,
    json: bool,
    body: Vec<u8>,
}

fn segment() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        Just(b"v1".to_vec()),
        Just(b"payments".to_vec()),
        Just(b"orders".to_vec()),
        Just(b"..".to_vec()),
        Just(b".".to_vec()),
        Just(Vec::new()),
        Just(b"%70ayments".to_vec()),
        Just(b"%2e%2E".to_vec()),
        Just(b"%2F".to_vec()),
        Just(b"%zz".to_vec()),
        Just(b"%".to_vec()),
        Just(b"%ff%00".to_vec()),
        Just("caf\u{e9}".as_bytes().to_vec()),
        Just(b"\xff\xfe".to_vec()),
        Just(b"a;b=c".to_vec()),
        Just(b"p-1?q=%2f&x".to_vec()),
        proptest::collection::vec(0x21u8..0x7f, 0..6),
    ]
}

fn input() -> impl Strategy<Value = Input> {
    let method = prop_oneof![
        Just("POST"),
        Just("POST"),
        Just("PATCH"),
        Just("GET"),
        Just("DELETE"),
        Just("BREW"),
    ];
    // Mostly under a route, so that keyed requests get through.
    let prefix = prop_oneof![
        Just(&b"/v1/payments"[..]),
        Just(&b"/v1/orders"[..]),
        Just(&b"//v1/%70ayments"[..]),
        Just(&b"/v1/./payments/x/.."[..]),
        Just(&b""[..]),
    ];
    let path = (prefix, proptest::collection::vec(segment(), 0..4)).prop_map(|(prefix, segs)| {
        let mut p = prefix.to_vec();
        for s in segs {
            p.push(b'/');
            p.extend(s);
        }
        if p.is_empty() {
            p.push(b'/');
        }
        p
    });
    let key = proptest::option::weighted(
        0.8,
        prop_oneof![
            Just(&b"k-1"[..]),
            Just(&b"k-1"[..]),
            Just(&b"k-2"[..]),
            Just(&b"\"k-1\""[..]),
            Just(&b""[..]),
            Just(&b"k 3"[..]),
            Just(&b"\xc3\xa9"[..]),
        ],
    );
    let tenant = proptest::option::weighted(
        0.8,
        prop_oneof![
            Just(&b"acme"[..]),
            Just(&b"acme"[..]),
            Just(&b"a:b"[..]),
            Just(&b"sha256:00"[..]),
            Just(&b""[..]),
            Just(&b"\xff"[..]),
        ],
    );
    let extra = proptest::collection::vec(
        prop_oneof![
            Just(("X-Upstream-Key", &b"victim:k-1"[..])),
            Just(("Authorization", &b"Bearer t"[..])),
            Just(("Authorization", &b"Bearer u"[..])),
            Just(("Idempotency-Key", &b"k-2"[..])),
            Just(("X-Tenant-ID", &b"globex"[..])),
            Just(("Connection", &b"X-Tenant-ID"[..])),
            Just(("Expect", &b"100-continue"[..])),
        ],
        0..3,
    );
    let body = prop_oneof![
        Just(br#"{"amount": 1}"#.to_vec()),
        Just(br#"{ "amount" : 1 }"#.to_vec()),
        proptest::collection::vec(any::<u8>(), 0..64),
    ];
    (method, path, key, tenant, extra, any::<bool>(), body).prop_map(
        |(method, path, key, tenant, extra, json, body)| Input {
            method,
            path,
            key,
            tenant,
            extra,
            json,
            body,
        },
    )
}

impl Input {
    fn bytes(&self) -> Vec<u8> {
        let mut r = Vec::new();
        r.extend_from_slice(self.method.as_bytes());
        r.push(b' ');
        r.extend_from_slice(&self.path);
        r.extend_from_slice(b" HTTP/1.1\r\nHost: fuzz\r\nConnection: close\r\n");
        let mut header = |name: &str, value: &[u8]| {
            r.extend_from_slice(name.as_bytes());
            r.extend_from_slice(b": ");
            r.extend_from_slice(value);
            r.extend_from_slice(b"\r\n");
        };
        if let Some(k) = self.key {
            header("Idempotency-Key", k);
        }
        if let Some(t) = self.tenant {
            header("X-Tenant-ID", t);
        }
        for (n, v) in &self.extra {
            header(n, v);
        }
        if self.json {
            header("Content-Type", b"application/json");
        }
        header("Content-Length", self.body.len().to_string().as_bytes());
        r.extend_from_slice(b"\r\n");
        r.extend_from_slice(&self.body);
        r
    }
}

/// A response as read off the socket.
struct Answer {
    status: u16,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

impl Answer {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

/// Parses one HTTP/1.1 response with a `Content-Length` (or none and an
/// empty body, which is all the proxy and hyper send on `close`).
fn parse(mut raw: &[u8]) -> Result<Answer, String> {
    // Interim answers (`100 Continue`) come first.
    while raw.starts_with(b"HTTP/1.1 1") {
        let end = raw
            .windows(4)
            .position(|w| w == b"\r\n\r\n")
            .ok_or("an incomplete interim answer")?;
        raw = &raw[end + 4..];
    }
    let text = String::from_utf8_lossy(raw);
    let (head, _) = text
        .split_once("\r\n\r\n")
        .ok_or_else(|| format!("no complete head: {text:?}"))?;
    let body = raw[head.len() + 4..].to_vec();
    let mut lines = head.split("\r\n");
    let status_line = lines.next().unwrap_or_default();
    let mut parts = status_line.splitn(3, ' ');
    if parts.next() != Some("HTTP/1.1") {
        return Err(format!("not an HTTP/1.1 status line: {status_line:?}"));
    }
    let status: u16 = parts
        .next()
        .and_then(|s| s.parse().ok())
        .filter(|s| (100..600).contains(s))
        .ok_or_else(|| format!("bad status: {status_line:?}"))?;
    let mut headers = Vec::new();
    for line in lines {
        let (n, v) = line
            .split_once(':')
            .ok_or_else(|| format!("bad header line {line:?}"))?;
        headers.push((n.trim().to_owned(), v.trim().to_owned()));
    }
    let answer = Answer {
        status,
        headers,
        body,
    };
    if let Some(len) = answer.header("content-length") {
        let len: usize = len.parse().map_err(|_| format!("bad length {len:?}"))?;
        if len != answer.body.len() {
            return Err(format!("length {len} but {} bytes", answer.body.len()));
        }
    } else if answer.header("transfer-encoding").is_none() && !answer.body.is_empty() {
        return Err("a body without framing".into());
    }
    Ok(answer)
}

/// Writes the request and reads until the server closes.
async fn exchange(h: &Harness, request: &[u8]) -> Vec<u8> {
    let mut s = TcpStream::connect(h.running().proxy_addr).await.unwrap();
    // The server may answer (and close) before taking the whole request.
    let _ = s.write_all(request).await;
    let mut out = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut out)).await;
    out
}

/// Checks one answer; the upstream's answers carry its execution number.
fn check(input: &Input, raw: &[u8]) -> Result<(), TestCaseError> {
    let answer = parse(raw).map_err(|e| TestCaseError::fail(format!("{input:?}: {e}")))?;
    if answer.header("x-sample-execution").is_some() {
        return Ok(());
    }
    if answer.body.is_empty() {
        // hyper's own refusal of what it cannot parse: a bare 4xx.
        prop_assert!(
            (400..500).contains(&answer.status),
            "{input:?}: a bodyless {}",
            answer.status
        );
        return Ok(());
    }
    prop_assert_eq!(
        answer.header("content-type"),
        Some("application/problem+json"),
        "{:?}",
        input
    );
    let v: serde_json::Value = serde_json::from_slice(&answer.body)
        .map_err(|e| TestCaseError::fail(format!("{input:?}: problem is not JSON: {e}")))?;
    prop_assert!(
        v["type"]
            .as_str()
            .is_some_and(|t| t.starts_with("urn:idemproxy:problem:")),
        "{:?}: {}",
        input,
        v
    );
    prop_assert_eq!(v["status"].as_u64(), Some(u64::from(answer.status)));
    prop_assert!(v["title"].is_string() && v["detail"].is_string());
    Ok(())
}

/// Every stored record's key was executed at least as often as it has
/// records (one per tenant), and no forged derived key was forwarded.
async fn stored_only_what_was_forwarded(h: &Harness) -> Result<(), String> {
    let c = h.db.client().await;
    let rows = c
        .query(
            "SELECT idempotency_key, count(*) FROM idempotency_records GROUP BY 1",
            &[],
        )
        .await
        .map_err(|e| e.to_string())?;
    let requests = h.upstream.requests();
    // A client's own derived key never reaches the upstream.
    if let Some(r) = requests
        .iter()
        .find(|r| r.header("x-upstream-key") == Some(&b"victim:k-1"[..]))
    {
        return Err(format!("a forged derived key was forwarded: {r:?}"));
    }
    for row in rows {
        let key: String = row.get(0);
        let records: i64 = row.get(1);
        let executed = requests
            .iter()
            .filter(|r| {
                r.header("idempotency-key")
                    .is_some_and(|v| v == key.as_bytes() || v == format!("\"{key}\"").as_bytes())
            })
            .count() as i64;
        if executed < records {
            return Err(format!(
                "{records} record(s) of {key:?}, {executed} execution(s)"
            ));
        }
    }
    Ok(())
}

#[test]
fn arbitrary_requests_get_valid_answers_and_nothing_is_stored_unforwarded() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let h = rt.block_on(Harness::start(
        Setup::default()
            .routes(ROUTES)
            .server("max_request_body = \"32\"\n"),
    ));
    let mut runner = TestRunner::new(Config {
        cases: 96,
        failure_persistence: None,
        ..Config::default()
    });
    let result = runner.run(&input(), |input| {
        let raw = rt.block_on(exchange(&h, &input.bytes()));
        check(&input, &raw)?;
        rt.block_on(stored_only_what_was_forwarded(&h))
            .map_err(|e| TestCaseError::fail(format!("at or before {input:?}: {e}")))
    });
    rt.block_on(async {
        // Still serving after all of it.
        let ok = exchange(
            &h,
            b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
        )
        .await;
        assert!(ok.starts_with(b"HTTP/1.1 201"), "{ok:?}");
        // Not vacuous: keyed requests were stored and forwarded.
        assert!(h.record_count().await > 0, "no keyed request got through");
    });
    drop(rt.block_on(async move { h }));
    result.unwrap();
}
