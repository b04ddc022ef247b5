//! Unit tests of the sample upstream: each control header, the control
//! endpoints, shutdown, and h2c, over a real port-0 socket.

use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::header::{HeaderMap, CONTENT_TYPE, SET_COOKIE};
use hyper::{Method, Request, StatusCode};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use sha2::{Digest, Sha256};
use tokio::sync::oneshot;

use crate::handlers::{form_decode, query_param};
use crate::*;

type TestClient = Client<HttpConnector, Full<Bytes>>;

async fn start() -> (SampleUpstreamHandle, oneshot::Sender<()>) {
    let (tx, rx) = oneshot::channel::<()>();
    let handle = SampleUpstream::start("127.0.0.1:0".parse().unwrap(), async move {
        let _ = rx.await;
    })
    .await
    .unwrap();
    (handle, tx)
}

fn client() -> TestClient {
    Client::builder(TokioExecutor::new()).build_http()
}

fn request(
    up: &SampleUpstreamHandle,
    method: Method,
    path: &str,
    headers: &[(&str, &str)],
    body: &'static [u8],
) -> Request<Full<Bytes>> {
    let mut builder = Request::builder()
        .method(method)
        .uri(format!("{}{}", up.url(), path));
    for (n, v) in headers {
        builder = builder.header(*n, *v);
    }
    builder.body(Full::new(Bytes::from_static(body))).unwrap()
}

async fn send(client: &TestClient, req: Request<Full<Bytes>>) -> (StatusCode, HeaderMap, Bytes) {
    let response = client.request(req).await.unwrap();
    let (parts, body) = response.into_parts();
    (
        parts.status,
        parts.headers,
        body.collect().await.unwrap().to_bytes(),
    )
}

fn json(body: &Bytes) -> serde_json::Value {
    serde_json::from_slice(body).unwrap()
}

#[tokio::test]
async fn counts_executions_per_key_and_describes_them() {
    let (up, _tx) = start().await;
    let c = client();
    let post = |key: Option<&'static str>, body: &'static [u8]| {
        let mut headers = vec![("idempotency-attempt", "1")];
        if let Some(key) = key {
            headers.push(("Idempotency-Key", key));
        }
        request(&up, Method::POST, "/orders?x=1", &headers, body)
    };

    let (status, headers, body) = send(&c, post(Some("a"), b"hello")).await;
    assert_eq!(status, StatusCode::CREATED);
    assert_eq!(headers[CONTENT_TYPE], "application/json");
    assert_eq!(headers[EXECUTION_HEADER], "1");
    assert_eq!(headers[ECHO_ATTEMPT_HEADER], "1");
    let first = json(&body);
    assert_eq!(
        first,
        serde_json::json!({
            "execution": 1, "key_executions": 1, "key": "a", "attempt": "1",
            "method": "POST", "path": "/orders?x=1",
            "body_sha256": hex::encode(Sha256::digest(b"hello")), "body_len": 5,
        })
    );

    let (_, headers, body) = send(&c, post(Some("a"), b"hello")).await;
    assert_eq!(headers[EXECUTION_HEADER], "2");
    let second = json(&body);
    assert_eq!(second["execution"], 2);
    assert_eq!(second["key_executions"], 2);
    assert_ne!(first, second, "a re-execution must be distinguishable");

    send(&c, post(Some("b"), b"")).await;
    let (_, headers, body) = send(&c, request(&up, Method::PUT, "/x", &[], b"no key")).await;
    assert_eq!(headers[ECHO_ATTEMPT_HEADER], "none");
    assert_eq!(json(&body)["key"], "");

    assert_eq!(up.executions("a"), 2);
    assert_eq!(up.executions("b"), 1);
    assert_eq!(up.executions(""), 1);
    assert_eq!(up.executions("missing"), 0);
    assert_eq!(up.total_requests(), 4);

    let recorded = up.requests();
    assert_eq!(recorded.len(), 4);
    assert_eq!(
        recorded.iter().map(|r| r.execution).collect::<Vec<_>>(),
        [1, 2, 3, 4]
    );
    assert_eq!(recorded[1].key_execution, 2);
    assert_eq!(recorded[0].method, "POST");
    assert_eq!(recorded[0].path, "/orders?x=1");
    assert_eq!(recorded[0].body, Bytes::from_static(b"hello"));
    assert_eq!(recorded[0].header("Idempotency-Key"), Some(&b"a"[..]));
    assert_eq!(recorded[3].method, "PUT");
    assert_eq!(recorded[3].key, "");
    assert_eq!(recorded[3].header("idempotency-key"), None);
}

#[tokio::test]
async fn delay_counts_before_answering() {
    let (up, _tx) = start().await;
    let c = client();
    let req = request(
        &up,
        Method::POST,
        "/slow",
        &[("idempotency-key", "slow"), (DELAY_HEADER, "400")],
        b"",
    );
    let started = Instant::now();
    let in_flight = tokio::spawn(async move { send(&c, req).await });
    tokio::time::sleep(Duration::from_millis(150)).await;
    assert!(!in_flight.is_finished(), "answered before the delay");
    assert_eq!(
        up.executions("slow"),
        1,
        "execution counted before the answer"
    );
    let (status, _, _) = in_flight.await.unwrap();
    assert_eq!(status, StatusCode::CREATED);
    assert!(started.elapsed() >= Duration::from_millis(400));
}

#[tokio::test]
async fn options_slow_every_execution_and_shape_a_charge() {
    let (tx, rx) = oneshot::channel::<()>();
    let options = Options {
        delay: Some(Duration::from_millis(300)),
        charges: true,
    };
    let up = SampleUpstream::start_with("127.0.0.1:0".parse().unwrap(), options, async move {
        let _ = rx.await;
    })
    .await
    .unwrap();
    let c = client();
    let started = Instant::now();
    let req = request(
        &up,
        Method::POST,
        "/v1/charges",
        &[("idempotency-key", "c")],
        b"amount=100",
    );
    let (status, _, body) = send(&c, req).await;
    assert_eq!(status, StatusCode::CREATED);
    assert!(
        started.elapsed() >= Duration::from_millis(300),
        "the default delay applies"
    );
    let json: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(json["id"], "ch_1");
    assert_eq!(json["object"], "charge");
    assert_eq!(json["key_executions"], 1);

    // A request's own delay header wins over the default.
    let started = Instant::now();
    let req = request(
        &up,
        Method::POST,
        "/v1/charges",
        &[(DELAY_HEADER, "0")],
        b"",
    );
    let (_, _, body) = send(&c, req).await;
    assert!(
        started.elapsed() < Duration::from_millis(300),
        "x-sample-delay-ms: 0 wins"
    );
    let json: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(json["id"], "ch_2");
    let _ = tx.send(());
    up.stopped().await;
}

#[tokio::test]
async fn status_override_still_executes() {
    let (up, _tx) = start().await;
    let c = client();
    let req = request(
        &up,
        Method::POST,
        "/",
        &[("idempotency-key", "k"), (STATUS_HEADER, "503")],
        b"",
    );
    let (status, headers, body) = send(&c, req).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(headers[EXECUTION_HEADER], "1");
    assert_eq!(json(&body)["execution"], 1);
    assert_eq!(up.executions("k"), 1);
}

#[tokio::test]
async fn set_cookie_lines_are_separate() {
    let (up, _tx) = start().await;
    let c = client();
    let req = request(&up, Method::POST, "/", &[(SET_COOKIE_HEADER, "3")], b"");
    let (_, headers, _) = send(&c, req).await;
    let cookies: Vec<_> = headers.get_all(SET_COOKIE).iter().collect();
    assert_eq!(cookies, ["c1=v1", "c2=v2", "c3=v3"]);
}

#[tokio::test]
async fn body_size_is_deterministic() {
    let (up, _tx) = start().await;
    let c = client();
    let mk = || request(&up, Method::POST, "/", &[(BODY_SIZE_HEADER, "1000")], b"");
    let (_, headers, first) = send(&c, mk()).await;
    let (_, headers2, second) = send(&c, mk()).await;
    assert_eq!(first.len(), 1000);
    assert_eq!(headers[CONTENT_TYPE], "application/octet-stream");
    assert_eq!(first, body_pattern(1000));
    assert_eq!(&first[..5], b"abcde");
    assert_eq!(first, second);
    assert_ne!(headers[EXECUTION_HEADER], headers2[EXECUTION_HEADER]);
}

#[tokio::test]
async fn slow_body_arrives_in_chunks() {
    let (up, _tx) = start().await;
    let c = client();
    let req = request(
        &up,
        Method::POST,
        "/",
        &[(BODY_SIZE_HEADER, "200"), (SLOW_BODY_HEADER, "60")],
        b"",
    );
    let started = Instant::now();
    let response = c.request(req).await.unwrap();
    let mut body = response.into_body();
    let mut frames = 0;
    let mut received = Vec::new();
    while let Some(frame) = body.frame().await {
        if let Ok(data) = frame.unwrap().into_data() {
            frames += 1;
            received.extend_from_slice(&data);
        }
    }
    assert_eq!(received, body_pattern(200));
    assert_eq!(frames, 4, "200 bytes in 64-byte chunks");
    assert!(started.elapsed() >= Duration::from_millis(180));
}

#[tokio::test]
async fn reset_counts_and_client_sees_an_error() {
    let (up, _tx) = start().await;
    let c = client();
    let req = request(
        &up,
        Method::POST,
        "/",
        &[("idempotency-key", "boom"), (FAIL_HEADER, "reset")],
        b"payload",
    );
    let result = c.request(req).await;
    assert!(
        result.is_err(),
        "expected a connection error, got {result:?}"
    );
    assert_eq!(up.executions("boom"), 1);
    // The server keeps serving afterwards.
    let (status, _, body) = send(&c, request(&up, Method::GET, "/__sample/health", &[], b"")).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(body, "ok");
}

#[tokio::test]
async fn hang_never_answers_and_shutdown_releases_it() {
    let (up, tx) = start().await;
    let c = client();
    let req = request(
        &up,
        Method::POST,
        "/",
        &[("idempotency-key", "hang"), (FAIL_HEADER, "hang")],
        b"",
    );
    let in_flight = tokio::spawn(async move { c.request(req).await });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!in_flight.is_finished(), "a hanging request was answered");
    assert_eq!(up.executions("hang"), 1);

    tx.send(()).unwrap();
    tokio::time::timeout(Duration::from_secs(1), up.stopped())
        .await
        .expect("shutdown must not wait for a hanging request");
    assert!(up.is_stopped());
    let result = tokio::time::timeout(Duration::from_secs(1), in_flight)
        .await
        .unwrap()
        .unwrap();
    assert!(result.is_err(), "hang must end without an answer");
    assert!(tokio::net::TcpStream::connect(up.addr()).await.is_err());
}

#[tokio::test]
async fn control_endpoints_report_and_are_not_counted() {
    let (up, _tx) = start().await;
    let c = client();
    for key in ["a b", "a b", "x"] {
        let req = request(&up, Method::POST, "/", &[("idempotency-key", key)], b"");
        send(&c, req).await;
    }
    send(&c, request(&up, Method::POST, "/", &[], b"")).await;

    let get = |path: &str| request(&up, Method::GET, path, &[], b"");
    let (status, _, body) = send(&c, get("/__sample/stats")).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(
        json(&body),
        serde_json::json!({ "total": 4, "keys": { "a b": 2, "x": 1, "": 1 } })
    );
    let (_, _, body) = send(&c, get("/__sample/executions?key=a%20b")).await;
    assert_eq!(
        json(&body),
        serde_json::json!({ "key": "a b", "executions": 2 })
    );
    let (_, _, body) = send(&c, get("/__sample/executions?other=1&key=a+b")).await;
    assert_eq!(json(&body)["executions"], 2);
    let (_, _, body) = send(&c, get("/__sample/executions?key=nope")).await;
    assert_eq!(json(&body)["executions"], 0);
    let (_, _, body) = send(&c, get("/__sample/executions?key=")).await;
    assert_eq!(json(&body)["executions"], 1);
    let (status, _, _) = send(&c, get("/__sample/executions")).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    let (status, _, _) = send(&c, get("/__sample/nope")).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    let (status, _, _) = send(&c, request(&up, Method::POST, "/__sample/stats", &[], b"")).await;
    assert_eq!(status, StatusCode::METHOD_NOT_ALLOWED);

    assert_eq!(up.total_requests(), 4, "control endpoints must not count");
    assert_eq!(up.requests().len(), 4);
}

#[tokio::test]
async fn malformed_control_header_is_rejected_without_executing() {
    let (up, _tx) = start().await;
    let c = client();
    for (name, value) in [
        (STATUS_HEADER, "abc"),
        (STATUS_HEADER, "101"),
        (FAIL_HEADER, "explode"),
        (DELAY_HEADER, "-1"),
    ] {
        let req = request(
            &up,
            Method::POST,
            "/",
            &[("idempotency-key", "k"), (name, value)],
            b"",
        );
        let (status, _, body) = send(&c, req).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{name}: {value}");
        assert!(json(&body)["error"].as_str().unwrap().contains(name));
    }
    assert_eq!(up.executions("k"), 0);
    assert_eq!(up.total_requests(), 0);
}

#[tokio::test]
async fn serves_h2c_prior_knowledge() {
    let (up, _tx) = start().await;
    let c: TestClient = Client::builder(TokioExecutor::new())
        .http2_only(true)
        .build_http();
    let req = request(&up, Method::POST, "/", &[("idempotency-key", "h2")], b"x");
    let response = c.request(req).await.unwrap();
    assert_eq!(response.version(), hyper::Version::HTTP_2);
    assert_eq!(response.status(), StatusCode::CREATED);
    assert_eq!(up.executions("h2"), 1);

    let req = request(&up, Method::POST, "/", &[(FAIL_HEADER, "reset")], b"");
    assert!(c.request(req).await.is_err());
    assert_eq!(up.executions(""), 1);
}

#[test]
fn form_decoding() {
    assert_eq!(form_decode("a%20b+c%2Bd"), "a b c+d");
    assert_eq!(form_decode("100%"), "100%");
    assert_eq!(form_decode("%zz"), "%zz");
    assert_eq!(query_param("a=1&key=k%3D1", "key").as_deref(), Some("k=1"));
    assert_eq!(query_param("a=1", "key"), None);
}
