//! DESIGN.md §8.9: SIGHUP re-reads the file. Real signals to the real
//! binary: new requests get the new routes, policies and timeouts while a
//! request in flight finishes under the configuration it started with; a
//! change that needs a restart is reported and kept as it runs while the
//! rest applies; a bad file is refused and the running configuration kept;
//! the environment still beats the file after a reload; a SIGHUP while
//! draining is ignored.

mod support;

use std::time::Duration;

use http::StatusCode;
use support::db::TestDb;
use support::eventually;
use support::http::{HttpClient, Req, Resp};
use support::process::{connection_refused, free_port, TempDir};
use support::proxy_proc::{ProxyConfig, ProxyProc};
use support::upstream_proc::UpstreamProc;

const SLOW: &str = "x-sample-delay-ms";

/// Sends SIGHUP and waits until `idemproxy_config_reloads_total{result}`
/// reaches `count`.
async fn reload(proxy: &ProxyProc, result: &str, count: f64) {
    proxy.proc.signal("HUP");
    let series = format!("idemproxy_config_reloads_total{{result=\"{result}\"}}");
    eventually(
        Duration::from_secs(10),
        format!("{series} {count}\n{}", proxy.proc.log_tail(20)),
        || async { proxy.metric(&series).await == count },
    )
    .await;
}

/// The `config:` line of the `/readyz` body.
async fn readyz_config(proxy: &ProxyProc) -> String {
    let r = proxy.readyz().await.expect("/readyz answers");
    assert_eq!(r.status, StatusCode::OK, "{}", r.text());
    r.text()
        .lines()
        .find(|l| l.starts_with("config: "))
        .unwrap_or_else(|| panic!("no config line in /readyz:\n{}", r.text()))
        .to_string()
}

fn post(proxy: &ProxyProc, path: &str, key: &str) -> Req {
    Req::post(&proxy.url(path)).key(key).json("{\"amount\": 1}")
}

#[tokio::test]
async fn sighup_applies_to_new_requests_while_one_in_flight_keeps_its_configuration() {
    let dir = TempDir::new("reload-good");
    let db = TestDb::new().await;
    let upstream = UpstreamProc::start(&dir).await;
    let config = ProxyConfig::new(&upstream.url(), &db.url).upstream_timeout("10s");
    let proxy = ProxyProc::start(&dir, "reload-good", &config).await;
    assert!(readyz_config(&proxy)
        .await
        .starts_with("config: loaded at "));
    let client = HttpClient::new();

    // In flight across the reload: a 4 s upstream call, allowed 10 s.
    let slow = {
        let req = post(&proxy, "/v1/orders", "slow-before").header(SLOW, "4000");
        let client = client.clone();
        tokio::spawn(async move { client.send(req).await })
    };
    upstream
        .wait_executions("slow-before", 1, Duration::from_secs(10))
        .await;

    // The new file: a 500 ms upstream timeout, and a route of its own for
    // /v1/refunds whose key is required.
    let mut new = config.clone().upstream_timeout("500ms");
    new.routes =
        "[[route]]\nname = \"refunds\"\npath_prefix = \"/v1/refunds\"\nkey = \"required\"\n".into();
    proxy.rewrite_config(&new);
    reload(&proxy, "ok", 1.0).await;
    assert!(
        !slow.is_finished(),
        "the slow request ended before the reload was seen: the test proves nothing"
    );
    let line = readyz_config(&proxy).await;
    assert!(line.starts_with("config: reload ok at "), "{line}");

    // The request that started before it finishes under the old timeout.
    let before: Resp = slow.await.unwrap();
    assert_eq!(before.status, StatusCode::CREATED, "{}", before.text());

    // New requests get the new timeout...
    let after = client
        .send(post(&proxy, "/v1/orders", "slow-after").header(SLOW, "2500"))
        .await;
    after.assert_problem(504, "upstream-timeout");
    // ...and the new route and its policy.
    let keyless = client
        .send(Req::post(&proxy.url("/v1/refunds/1")).json("{}"))
        .await;
    assert_eq!(
        keyless.status,
        StatusCode::BAD_REQUEST,
        "{}",
        keyless.text()
    );
    let keyed = client.send(post(&proxy, "/v1/refunds/1", "refund-1")).await;
    assert_eq!(keyed.status, StatusCode::CREATED, "{}", keyed.text());
    assert_eq!(
        proxy
            .metric("idemproxy_requests_total{route=\"refunds\",outcome=\"claimed\"}")
            .await,
        1.0
    );
    assert!(proxy.proc.log_text().contains("configuration reloaded"));
}

#[tokio::test]
async fn sighup_refuses_a_bad_file_reports_a_restart_only_change_and_waits_out_a_drain() {
    let dir = TempDir::new("reload-bad");
    let db = TestDb::new().await;
    let upstream = UpstreamProc::start(&dir).await;
    let mut config = ProxyConfig::new(&upstream.url(), &db.url);
    // The environment makes keys required; the file says optional. After
    // every reload the environment must still win.
    config.defaults = "key = \"optional\"\n".into();
    config
        .env
        .push(("IDEMPROXY_DEFAULTS_KEY".into(), "required".into()));
    let mut proxy = ProxyProc::start(&dir, "reload-bad", &config).await;
    let client = HttpClient::new();
    let keyless = || async {
        client
            .send(Req::post(&proxy.url("/v1/orders")).json("{}"))
            .await
            .status
    };
    assert_eq!(keyless().await, StatusCode::BAD_REQUEST);

    // A bad file: refused, every problem logged, the running one kept.
    std::fs::write(
        &proxy.config_path,
        "[server]\nlisen = \"127.0.0.1:1\"\n[upstream]\ntimeout = \"soon\"\n",
    )
    .unwrap();
    reload(&proxy, "error", 1.0).await;
    let line = readyz_config(&proxy).await;
    assert!(line.starts_with("config: reload error at "), "{line}");
    assert!(line.contains("(2 problem(s)"), "{line}");
    let log = proxy.proc.log_text();
    let path = proxy.config_path.display().to_string();
    assert!(
        log.contains(&format!("{path}:2: server.lisen: unknown key")),
        "{log}"
    );
    assert!(
        log.contains(&format!("{path}:4: upstream.timeout: invalid duration")),
        "{log}"
    );
    let kept = client.send(post(&proxy, "/v1/orders", "after-bad")).await;
    assert_eq!(kept.status, StatusCode::CREATED, "{}", kept.text());
    assert_eq!(keyless().await, StatusCode::BAD_REQUEST);

    // A restart-only change (the listen address, the pool) with a change
    // that applies (the largest keyed body): the first is logged and kept,
    // the second applies.
    let elsewhere = format!("127.0.0.1:{}", free_port());
    let mut new = config.clone();
    new.pool_size = 5;
    let text = new
        .toml(proxy.listen, proxy.admin)
        .replace(
            &format!("listen = \"{}\"", proxy.listen),
            &format!("listen = \"{elsewhere}\""),
        )
        .replace("[server]\n", "[server]\nmax_request_body = \"16\"\n");
    std::fs::write(&proxy.config_path, text).unwrap();
    reload(&proxy, "restart_required", 1.0).await;
    let line = readyz_config(&proxy).await;
    assert!(
        line.contains("needs a restart: server.listen, store.pool_size"),
        "{line}"
    );
    let log = proxy.proc.log_text();
    assert!(log.contains("this change needs a restart"), "{log}");
    assert!(connection_refused(elsewhere.parse().unwrap()).await);
    // Still on the old address; the body limit applies: an 18-byte body is
    // over 16 bytes.
    let big = client
        .send(
            Req::post(&proxy.url("/v1/orders"))
                .key("big")
                .json("{\"amount\": 123456}"),
        )
        .await;
    assert_eq!(big.status, StatusCode::PAYLOAD_TOO_LARGE, "{}", big.text());
    // The environment still beats the file.
    assert_eq!(keyless().await, StatusCode::BAD_REQUEST);

    // SIGHUP while draining is ignored (logged), and the drain goes on: the
    // request in flight is answered, the process exits 0.
    let slow = {
        let req = post(&proxy, "/v1/orders", "slow-drain").header(SLOW, "2000");
        let client = client.clone();
        tokio::spawn(async move { client.send(req).await })
    };
    upstream
        .wait_executions("slow-drain", 1, Duration::from_secs(10))
        .await;
    proxy.proc.signal("TERM");
    eventually(Duration::from_secs(10), "/readyz says draining", || async {
        proxy
            .readyz()
            .await
            .is_some_and(|r| r.status == StatusCode::SERVICE_UNAVAILABLE)
    })
    .await;
    proxy.proc.signal("HUP");
    eventually(
        Duration::from_secs(10),
        "the reload skipped while draining, in the log",
        || async {
            proxy
                .proc
                .log_text()
                .contains("configuration reload skipped: SIGHUP while draining")
        },
    )
    .await;
    let drained = slow.await.unwrap();
    assert_eq!(drained.status, StatusCode::CREATED, "{}", drained.text());
    let status = proxy
        .proc
        .wait_exit(Duration::from_secs(15))
        .await
        .expect("the process exits after the drain");
    assert!(status.success(), "{status:?}\n{}", proxy.proc.log_tail(20));
}
