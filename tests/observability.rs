//! What an operator sees of the running binary: request ids end to end, the
//! access line, the request-duration histogram past `upstream.timeout`,
//! build info, and a `/metrics` that shows nothing docs/operations.md does
//! not list (DESIGN.md §8.10).

mod support;

use std::time::Duration;

use support::db::TestDb;
use support::harness::start_upstream;
use support::http::{HttpClient, Req};
use support::poll_every;
use support::process::TempDir;
use support::proxy_proc::{ProxyConfig, ProxyProc};

const PAY: &str = r#"{"amount": 100}"#;
const TRACEPARENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
const TRACESTATE: &str = "vendor=opaque,other=x";

/// The proxy's access lines so far (JSON is not asked for: text lines).
fn access_lines(proxy: &ProxyProc) -> Vec<String> {
    proxy
        .proc
        .log_text()
        .lines()
        .filter(|l| l.contains("idemproxy::access"))
        .map(str::to_owned)
        .collect()
}

/// Waits for the access line naming `request_id` (written when the
/// response body is done, so just after the client has it).
async fn access_line(proxy: &ProxyProc, request_id: &str) -> String {
    let needle = format!("request_id={request_id} ");
    poll_every(
        Duration::from_millis(20),
        Duration::from_secs(10),
        || async {
            access_lines(proxy)
                .into_iter()
                .find(|l| l.contains(&needle))
        },
    )
    .await
    .unwrap_or_else(|| panic!("no access line with {needle}\n{}", proxy.proc.log_tail(20)))
}

#[tokio::test]
async fn request_ids_are_kept_or_made_returned_on_every_answer_forwarded_and_logged() {
    let db = TestDb::new().await;
    let (upstream, _stop) = start_upstream().await;
    let dir = TempDir::new("observability");
    let mut config = ProxyConfig::new(&upstream.url(), &db.url).upstream_timeout("3s");
    config.routes = r#"
[[route]]
name = "payments"
path_prefix = "/v1/payments"
key = "required"
"#
    .into();
    let proxy = ProxyProc::start(&dir, "proxy", &config).await;
    let client = HttpClient::new();

    // A client's sane id is kept, forwarded and returned; trace context
    // passes through untouched.
    let first = client
        .send(
            Req::post(&proxy.url("/v1/payments?token=secret-in-query"))
                .key("pay-1")
                .json(PAY)
                .header("x-request-id", "client-abc-1")
                .header("traceparent", TRACEPARENT)
                .header("tracestate", TRACESTATE)
                .header("user-agent", "legacy-client/1.0 \"quoted\""),
        )
        .await;
    assert_eq!(first.status, 201, "{}", first.text());
    assert_eq!(first.header("x-request-id"), Some("client-abc-1"));
    let seen = upstream.requests();
    let forwarded = seen.last().expect("the upstream got the request");
    let header = |name: &str| -> Vec<String> {
        forwarded
            .headers
            .iter()
            .filter(|(n, _)| n == name)
            .map(|(_, v)| String::from_utf8_lossy(v).into_owned())
            .collect()
    };
    assert_eq!(header("x-request-id"), ["client-abc-1"]);
    assert_eq!(header("traceparent"), [TRACEPARENT]);
    assert_eq!(header("tracestate"), [TRACESTATE]);

    let line = access_line(&proxy, "client-abc-1").await;
    for field in [
        "method=POST",
        "path=/v1/payments ",
        "route=payments",
        "outcome=\"claimed\"",
        "status=201",
        "client=127.0.0.1:",
        "request_bytes=15",
        "key=\"pay-1\"",
    ] {
        assert!(line.contains(field), "{field} missing from {line}");
    }
    assert!(
        line.contains(r#"user_agent=legacy-client/1.0 "quoted""#),
        "{line}"
    );
    let sent: usize = line
        .split("response_bytes=")
        .nth(1)
        .and_then(|r| r.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("response_bytes in {line}"));
    assert_eq!(sent, first.body.len(), "{line}");
    assert!(!line.contains("secret-in-query"), "no query string: {line}");
    assert!(!line.contains("amount"), "no body: {line}");

    // A replay answers with the retry's id, not the stored one.
    let replay = client
        .send(
            // The same request (the query is part of it).
            Req::post(&proxy.url("/v1/payments?token=secret-in-query"))
                .key("pay-1")
                .json(PAY)
                .header("x-request-id", "retry-2"),
        )
        .await;
    assert!(replay.replayed());
    assert_eq!(replay.header("x-request-id"), Some("retry-2"));
    assert!(access_line(&proxy, "retry-2")
        .await
        .contains("outcome=\"replayed\""));

    // No id, or one that is not sane: one is made, forwarded and returned.
    for sent in [None, Some("has space"), Some(&*"x".repeat(200))] {
        let mut req = Req::post(&proxy.url("/v1/payments"))
            .key(&format!("pay-gen-{}", sent.map_or(0, str::len)))
            .json(PAY);
        if let Some(id) = sent {
            req = req.header("x-request-id", id);
        }
        let r = client.send(req).await;
        assert_eq!(r.status, 201);
        let id = r.header("x-request-id").expect("an id").to_owned();
        assert_eq!(id.len(), 32, "{id}");
        assert!(id.bytes().all(|b| b.is_ascii_hexdigit()), "{id}");
        let forwarded = upstream.requests().last().unwrap().clone();
        let ids: Vec<&[u8]> = forwarded
            .headers
            .iter()
            .filter(|(n, _)| n == "x-request-id")
            .map(|(_, v)| v.as_slice())
            .collect();
        assert_eq!(ids, [id.as_bytes()], "the upstream gets the made id only");
        access_line(&proxy, &id).await;
    }

    // The proxy's own problems carry one too.
    let missing = client
        .send(Req::post(&proxy.url("/v1/payments")).json(PAY))
        .await;
    missing.assert_problem(400, "missing-key");
    let id = missing.header("x-request-id").expect("an id on a problem");
    assert!(access_line(&proxy, id).await.contains("status=400"));
}

#[tokio::test]
async fn metrics_show_the_request_histogram_past_the_timeout_build_info_and_only_documented_families(
) {
    let db = TestDb::new().await;
    let (upstream, _stop) = start_upstream().await;
    let dir = TempDir::new("observability-metrics");
    let config = ProxyConfig::new(&upstream.url(), &db.url).upstream_timeout("3s");
    let proxy = ProxyProc::start(&dir, "proxy", &config).await;
    let client = HttpClient::new();
    for _ in 0..2 {
        let r = client
            .send(Req::post(&proxy.url("/v1/orders")).key("o-1").json(PAY))
            .await;
        assert_eq!(r.status, 201);
    }
    client.send(Req::get(&proxy.url("/v1/orders/o-1"))).await;
    let text = proxy.metrics().await;

    // Buckets reach past upstream.timeout (3 s): 3, 3.75 and 6 s.
    for le in ["2.5", "3.0", "3.75", "6.0"] {
        let series = format!(
            r#"idemproxy_request_duration_seconds_bucket{{le="{le}",route="default",outcome="claimed"}} 1"#
        );
        assert!(text.contains(&series), "{series} missing:\n{text}");
    }
    assert!(
        text.contains(r#"idemproxy_upstream_duration_seconds_bucket{le="3.75"}"#),
        "{text}"
    );
    assert!(
        text.contains(
            r#"idemproxy_requests_total{status_class="2xx",route="default",outcome="replayed"} 1"#
        ),
        "{text}"
    );
    let build = format!(
        r#"idemproxy_build_info{{version="{}",commit="#,
        env!("CARGO_PKG_VERSION")
    );
    assert!(
        text.lines()
            .any(|l| l.starts_with(&build) && l.ends_with("} 1")),
        "{build} missing:\n{text}"
    );
    // Counts since start are counters, and the cache is visible.
    assert!(
        text.contains("# TYPE idemproxy_store_batches counter"),
        "{text}"
    );
    assert!(text.contains("idemproxy_cache_misses_total "), "{text}");
    assert!(text.contains("idemproxy_waiters 0"), "{text}");
    // Each worker thread's connections, worker 0 on every machine.
    assert!(
        text.contains(r#"idemproxy_worker_connections{worker="0"} "#),
        "{text}"
    );

    // Every family the binary shows is in docs/operations.md's table.
    let doc = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/operations.md"))
        .unwrap();
    for l in text.lines().filter_map(|l| l.strip_prefix("# TYPE ")) {
        let (name, kind) = l.split_once(' ').unwrap();
        let name = if kind == "counter" {
            format!("{name}_total")
        } else {
            name.to_owned()
        };
        assert!(
            doc.contains(&format!("| `{name}` | {kind} |")),
            "{name} ({kind}) is exposed but not documented in docs/operations.md"
        );
    }
}
