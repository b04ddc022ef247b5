//! No body and no stored header value reaches the log at any level
//! (DESIGN.md §5, §8.7): the real `idemproxy serve` at `RUST_LOG=trace`,
//! driven through a keyed request, its replay, an upstream error and a
//! store error, with markers in the request body, the upstream's body and
//! its `Set-Cookie`.

mod support;

use std::convert::Infallible;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;

use support::db::TestDb;
use support::http::{HttpClient, Req};
use support::process::TempDir;
use support::proxy_proc::{ProxyConfig, ProxyProc};
use support::slowlink::SlowLink;

const REQUEST_MARKER: &str = "reqbodymarker7Hq2";
const RESPONSE_MARKER: &str = "respbodymarker4Kx9";
const COOKIE_MARKER: &str = "cookiemarker2Vb6";
/// A request with this header is answered after the proxy's upstream
/// timeout: an upstream error.
const HANG_HEADER: &str = "x-test-hang";

/// An upstream that answers every request with the markers (and hangs
/// when asked to).
async fn start_marker_upstream() -> String {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            tokio::spawn(async move {
                let service = hyper::service::service_fn(|req: Request<Incoming>| async move {
                    let hang = req.headers().contains_key(HANG_HEADER);
                    let _ = req.into_body().collect().await;
                    if hang {
                        tokio::time::sleep(Duration::from_secs(3)).await;
                    }
                    let body = format!(r#"{{"receipt": "{RESPONSE_MARKER}"}}"#);
                    let resp = Response::builder()
                        .status(201)
                        .header("content-type", "application/json")
                        .header("set-cookie", format!("session={COOKIE_MARKER}; HttpOnly"))
                        .body(Full::new(Bytes::from(body)))
                        .unwrap();
                    Ok::<_, Infallible>(resp)
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    format!("http://{addr}")
}

/// `text` as the log would show it: plain, or as the `Debug` of its bytes
/// (how tokio-postgres prints a `bytea` parameter).
fn forms(text: &str) -> Vec<String> {
    let bytes: Vec<String> = text.bytes().map(|b| b.to_string()).collect();
    vec![text.to_string(), bytes.join(", ")]
}

#[tokio::test]
async fn no_body_or_stored_header_value_reaches_a_trace_level_log() {
    let db = TestDb::new().await;
    let upstream = start_marker_upstream().await;
    // The proxy reaches PostgreSQL through a relay whose answers a test can
    // hold back: a store error without stopping the server.
    let pg = SlowLink::start("127.0.0.1:5432".parse().unwrap()).await;
    let pg_host = db.url.split('@').nth(1).unwrap().split('/').next().unwrap();
    let pg_port: u16 = pg_host.rsplit(':').next().unwrap().parse().unwrap();
    assert_eq!(pg_port, 5432, "the relay assumes the test server's port");
    let url = db.url.replace(pg_host, &pg.addr.to_string());

    let dir = TempDir::new("debug-logs");
    let mut config = ProxyConfig::new(&upstream, &url)
        .upstream_timeout("500ms")
        .store_timeout("1s");
    config.store.push_str("on_store_error = \"pass_through\"\n");
    config.rust_log = "trace".into();
    let proxy = ProxyProc::start(&dir, "proxy", &config).await;

    let client = HttpClient::new();
    let body = format!(r#"{{"note": "{REQUEST_MARKER}"}}"#);
    let keyed = |key: &str| Req::post(&proxy.url("/orders")).key(key).json(&body);

    // Keyed, then replayed: the response and its Set-Cookie are stored.
    let first = client.send(keyed("k-debug-1")).await;
    assert_eq!(first.status, 201, "{}", first.text());
    assert!(first.text().contains(RESPONSE_MARKER));
    let replay = client.send(keyed("k-debug-1")).await;
    assert!(replay.replayed(), "{:?}", replay.headers);
    assert!(replay.text().contains(RESPONSE_MARKER));
    assert!(replay.header("set-cookie").unwrap().contains(COOKIE_MARKER));

    // Upstream error: the answer comes after the upstream timeout.
    let late = client
        .send(keyed("k-debug-2").header(HANG_HEADER, "1"))
        .await;
    assert_eq!(late.status, 504, "{}", late.text());

    // Store error: the database answers after the store timeout; the
    // request is passed through, the upstream's answer with it.
    pg.set_delay(Duration::from_secs(2));
    let unprotected = client.send(keyed("k-debug-3")).await;
    assert_eq!(unprotected.status, 201, "{}", unprotected.text());
    assert!(unprotected.text().contains(RESPONSE_MARKER));
    pg.set_delay(Duration::ZERO);

    proxy.proc.signal("TERM");
    let log = proxy.proc.log_text();
    assert!(
        log.contains("TRACE") || log.contains("DEBUG"),
        "not a debug-level log:\n{log}"
    );
    assert!(log.contains("store"), "no store error logged:\n{log}");
    for marker in [REQUEST_MARKER, RESPONSE_MARKER, COOKIE_MARKER] {
        for form in forms(marker) {
            let at = log.find(&form);
            assert!(
                at.is_none(),
                "{marker:?} reached the log as {form:?}:\n{}",
                &log[at.unwrap().saturating_sub(300)..(at.unwrap() + 300).min(log.len())]
            );
        }
    }
}
