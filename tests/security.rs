//! Security (issue "Security"): tenant isolation under crafted requests,
//! secrets that never reach the logs of the real binary, and an admin
//! listener that is private by default. (TLS is in tests/tls.rs; the plain
//! tenant rows of DESIGN.md §2 are in tests/requests.rs.)

mod support;

use std::path::PathBuf;
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use idemproxy::config::{self, Overrides};
use sha2::{Digest, Sha256};
use support::db::TestDb;
use support::eventually;
use support::harness::{start_upstream, Harness, Setup};
use support::http::{HttpClient, Req};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

const PAY: &str = r#"{"amount": 100}"#;

const ROUTES: &str = r#"
[[route]]
name = "payments"
path_prefix = "/v1/payments"
tenant_header = "X-Tenant-ID"
tenant_required = true

[[route]]
name = "orders"
path_prefix = "/v1/orders"
tenant_header = "X-Tenant-ID"

[[route]]
name = "api"
path_prefix = "/v1/"
tenant_header = "Authorization"
tenant_hash = true
"#;

fn routed() -> Setup {
    Setup::default().routes(ROUTES)
}

fn digest(value: &str) -> String {
    hex::encode(Sha256::digest(value.as_bytes()))
}

// ---------------------------------------------------------------------------
// Tenant isolation.

#[tokio::test]
async fn a_plain_tenant_spelled_like_a_hashed_digest_never_gets_that_tenants_replay() {
    // An attacker who sends the victim's digest as a plain tenant, with the
    // victim's key and body, must never reach the victim's record: not its
    // replay, not a 409 or 422 that would reveal the key exists.
    let h = Harness::start(routed()).await;
    let victim = "Bearer sk_live_victim";
    let original = h
        .send(
            Req::post("/v1/refunds")
                .key("k-victim")
                .json(PAY)
                .header("Authorization", victim),
        )
        .await;
    assert_eq!(original.status, 201, "{}", original.text());
    let attack = h
        .send(
            Req::post("/v1/payments")
                .key("k-victim")
                .json(PAY)
                .header("X-Tenant-ID", digest(victim)),
        )
        .await;
    // Hashed tenants are stored as "sha256:<hex>": the bare digest is just
    // another plain tenant, with records of its own…
    assert!(!attack.replayed(), "{:?}", attack.headers);
    assert_ne!(attack.body, original.body);
    assert_eq!(attack.status, 201, "{}", attack.text());
    // …and the stored form itself is refused as a plain tenant.
    h.send(
        Req::post("/v1/payments")
            .key("k-victim")
            .json(PAY)
            .header("X-Tenant-ID", format!("sha256:{}", digest(victim))),
    )
    .await
    .assert_problem(400, "invalid-tenant");
    assert_eq!(h.upstream.executions("k-victim"), 2);
    // The victim's record is untouched and still replays to the victim.
    let again = h
        .send(
            Req::post("/v1/refunds")
                .key("k-victim")
                .json(PAY)
                .header("Authorization", victim),
        )
        .await;
    assert!(again.replayed());
    assert_eq!(again.body, original.body);
}

#[tokio::test]
async fn tenant_values_are_compared_byte_for_byte() {
    let h = Harness::start(routed()).await;
    let as_tenant = |t: &str| {
        Req::post("/v1/payments")
            .key("k-exact")
            .json(PAY)
            .header("X-Tenant-ID", t)
    };
    // Case, list syntax and look-alikes are all other tenants.
    let tenants = ["acme", "ACME", "acme, globex", "acme corp", "acme."];
    let mut bodies = Vec::new();
    for t in tenants {
        let r = h.send(as_tenant(t)).await;
        assert_eq!(r.status, 201, "{t:?}: {}", r.text());
        assert!(!r.replayed(), "{t:?} got another tenant's replay");
        bodies.push(r.body);
    }
    assert_eq!(h.upstream.executions("k-exact"), tenants.len() as u64);
    // Trailing whitespace is not part of an HTTP field value: the same tenant.
    let r = h.send(as_tenant("acme ")).await;
    assert!(r.replayed());
    assert_eq!(r.body, bodies[0]);
}

#[tokio::test]
async fn a_request_without_a_tenant_cannot_reach_a_tenants_records() {
    let h = Harness::start(routed()).await;
    let with = h
        .send(
            Req::post("/v1/orders")
                .key("k-optional")
                .json(PAY)
                .header("X-Tenant-ID", "acme"),
        )
        .await;
    assert_eq!(with.status, 201);
    // Leaving the optional header out is the empty tenant, not "any tenant".
    let without = h
        .send(Req::post("/v1/orders").key("k-optional").json(PAY))
        .await;
    assert_eq!(without.status, 201);
    assert!(!without.replayed());
    // An empty value does not name the empty tenant either: it is refused.
    h.send(
        Req::post("/v1/orders")
            .key("k-optional")
            .json(PAY)
            .header("X-Tenant-ID", ""),
    )
    .await
    .assert_problem(400, "invalid-tenant");
    // On a route that requires the tenant, leaving it out is refused.
    h.send(Req::post("/v1/payments").key("k-optional").json(PAY))
        .await
        .assert_problem(400, "missing-tenant");
    assert_eq!(h.upstream.executions("k-optional"), 2);
    assert_eq!(
        h.record_state("", "k-optional").await.unwrap().0,
        "completed"
    );
    assert_eq!(
        h.record_state("acme", "k-optional").await.unwrap().0,
        "completed"
    );
}

#[tokio::test]
async fn a_repeated_tenant_header_is_refused_even_when_both_values_agree() {
    let h = Harness::start(routed()).await;
    let secret = "Bearer sk_live_repeated_secret";
    for (path, header, values) in [
        ("/v1/payments", "X-Tenant-ID", ["acme", "acme"]),
        ("/v1/payments", "X-Tenant-ID", ["acme", "globex"]),
        ("/v1/refunds", "Authorization", [secret, secret]),
        ("/v1/refunds", "Authorization", [secret, "Bearer other"]),
    ] {
        let r = h
            .send(
                Req::post(path)
                    .key("k-repeated")
                    .json(PAY)
                    .header(header, values[0])
                    .header(header, values[1]),
            )
            .await;
        r.assert_problem(400, "invalid-tenant");
        assert!(
            !r.text().contains("sk_live"),
            "the secret was echoed: {}",
            r.text()
        );
    }
    assert_eq!(h.upstream.total_requests(), 0);
    assert_eq!(h.record_count().await, 0);
}

#[tokio::test]
async fn problems_and_metrics_never_carry_tenant_secrets_or_per_key_labels() {
    let h = Harness::start(routed()).await;
    let secret = "Bearer sk_live_metrics_secret";
    let post = |body: &str| {
        Req::post("/v1/refunds")
            .key("k-metrics-key")
            .json(body)
            .header("Authorization", secret)
    };
    assert_eq!(h.send(post(PAY)).await.status, 201);
    let mismatch = h.send(post(r#"{"amount": 1}"#)).await;
    mismatch.assert_problem(422, "key-reused");
    assert!(!mismatch.text().contains("sk_live"), "{}", mismatch.text());
    let metrics = HttpClient::new()
        .send(Req::get(&h.admin_url("/metrics")))
        .await
        .text();
    for leak in ["sk_live", "k-metrics-key", &digest(secret)] {
        assert!(!metrics.contains(leak), "/metrics carries {leak:?}");
    }
}

// ---------------------------------------------------------------------------
// The admin listener.

#[test]
fn admin_listener_binds_loopback_by_default() {
    let config = config::parse("", "empty.toml", &Overrides::default()).unwrap();
    assert!(config.server.admin_listen.ip().is_loopback());
    assert_eq!(
        config.server.admin_listen,
        "127.0.0.1:9090".parse().unwrap()
    );
    // A file that moves only the proxy listener keeps the admin private.
    let config = config::parse(
        "[server]\nlisten = \"0.0.0.0:8443\"\n",
        "t.toml",
        &Overrides::default(),
    )
    .unwrap();
    assert!(config.server.admin_listen.ip().is_loopback());
    // And so do the shipped configurations.
    for (name, text) in [
        ("example.toml", include_str!("../config/example.toml")),
        ("dev.toml", include_str!("../config/dev.toml")),
    ] {
        let config = config::parse(text, name, &Overrides::default()).unwrap();
        assert!(config.server.admin_listen.ip().is_loopback(), "{name}");
    }
}

// ---------------------------------------------------------------------------
// Secrets never in logs: the real binary, debug logging, JSON format.

/// The password put into database URLs; trust-auth servers ignore it.
const DB_PASSWORD: &str = "Pw4idemproxyLogTest9x";
/// A tenant_hash header value.
const TENANT_SECRET: &str = "Bearer sk_live_log_secret_7Q2";
/// A request body, which DESIGN.md §5 keeps out of the logs too.
const BODY_MARKER: &str = "body-marker-5Zt8";

/// `url` with `password` for its user, and the password that is in force
/// (the URL's own, if it has one).
fn with_password(url: &str) -> (String, String) {
    let (scheme, rest) = url.split_once("://").expect("a postgres:// URL");
    let (userinfo, host) = rest.split_once('@').expect("a user in the test URL");
    match userinfo.split_once(':') {
        Some((_, existing)) => (url.to_string(), existing.to_string()),
        None => (
            format!("{scheme}://{userinfo}:{DB_PASSWORD}@{host}"),
            DB_PASSWORD.to_string(),
        ),
    }
}

/// A running idemproxy process whose output is collected.
struct Process {
    child: Child,
    lines: Arc<Mutex<Vec<String>>>,
}

impl Process {
    fn spawn(args: &[&str], env: &[(&str, &str)]) -> Process {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_idemproxy"));
        cmd.args(args)
            .env("RUST_LOG", "debug")
            .env_remove("IDEMPROXY_DATABASE_URL")
            .env_remove("IDEMPROXY_CONFIG")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        for (k, v) in env {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().expect("spawning idemproxy");
        let lines = Arc::new(Mutex::new(Vec::new()));
        let out = child.stdout.take().unwrap();
        let err = child.stderr.take().unwrap();
        for pipe in [
            Box::new(out) as Box<dyn tokio::io::AsyncRead + Send + Unpin>,
            Box::new(err),
        ] {
            let lines = lines.clone();
            tokio::spawn(async move {
                let mut reader = BufReader::new(pipe).lines();
                while let Ok(Some(line)) = reader.next_line().await {
                    lines.lock().unwrap().push(line);
                }
            });
        }
        Process { child, lines }
    }

    /// The value of `field` in the first JSON log line whose message is
    /// `message`, waiting for it.
    async fn field_of(&self, message: &str, field: &str) -> String {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let found = self.lines.lock().unwrap().iter().find_map(|line| {
                let v: serde_json::Value = serde_json::from_str(line).ok()?;
                (v["message"] == message).then(|| v[field].as_str().map(str::to_string))?
            });
            if let Some(value) = found {
                return value;
            }
            assert!(
                Instant::now() < deadline,
                "no {message:?} log line; output so far:\n{}",
                self.output()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    fn output(&self) -> String {
        self.lines.lock().unwrap().join("\n")
    }

    /// SIGTERM, then the exit status and everything it printed.
    async fn stop(mut self) -> String {
        if let Some(pid) = self.child.id() {
            let _ = std::process::Command::new("kill")
                .args(["-TERM", &pid.to_string()])
                .status();
        }
        let status = tokio::time::timeout(Duration::from_secs(15), self.child.wait())
            .await
            .expect("idemproxy did not exit after SIGTERM")
            .unwrap();
        assert!(status.success(), "{status}\n{}", self.output());
        // Let the readers drain the pipes.
        tokio::time::sleep(Duration::from_millis(100)).await;
        self.output()
    }

    /// Runs to completion (a one-shot subcommand); everything it printed.
    async fn finish(mut self) -> String {
        let _ = tokio::time::timeout(Duration::from_secs(30), self.child.wait())
            .await
            .expect("idemproxy did not finish");
        tokio::time::sleep(Duration::from_millis(100)).await;
        self.output()
    }
}

fn write_config(dir: &std::path::Path, name: &str, text: &str) -> PathBuf {
    std::fs::create_dir_all(dir).unwrap();
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    path
}

#[tokio::test]
async fn secrets_never_appear_in_the_logs_of_a_full_run_with_failures() {
    let db = TestDb::new().await;
    let (url, password) = with_password(&db.url);
    let (upstream, _stop) = start_upstream().await;
    let dir = std::env::temp_dir().join(format!("idemproxy-logs-{}", std::process::id()));
    let serve_config = |database_line: &str| {
        format!(
            "[server]\nlisten = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\nshutdown_grace = \"5s\"\n\
             [upstream]\nurl = \"{}\"\ntimeout = \"300ms\"\n\
             [store]\ntimeout = \"1s\"\n{database_line}\n\
             [defaults]\nlease = \"1s\"\n{ROUTES}",
            upstream.url()
        )
    };
    let mut secrets: Vec<String> = vec![password.clone(), TENANT_SECRET.into()];
    let client = HttpClient::new();
    let mut outputs = Vec::new();

    // 1. A healthy run, the URL (with its password) from the environment:
    // replays, a mismatch, a refused duplicate tenant, an upstream timeout.
    let path = write_config(&dir, "healthy.toml", &serve_config(""));
    let p = Process::spawn(
        &[
            "--log-format",
            "json",
            "serve",
            "--config",
            path.to_str().unwrap(),
        ],
        &[("IDEMPROXY_DATABASE_URL", &url)],
    );
    let proxy = p.field_of("idemproxy listening", "proxy_addr").await;
    let admin = p.field_of("idemproxy listening", "admin_addr").await;
    support::harness::wait_ready(admin.parse().unwrap()).await;
    let base = format!("http://{proxy}/v1/refunds");
    let body = format!(r#"{{"note": "{BODY_MARKER}"}}"#);
    let keyed = |key: &str| {
        Req::post(&base)
            .key(key)
            .json(&body)
            .header("Authorization", TENANT_SECRET)
    };
    assert_eq!(client.send(keyed("k-log-1")).await.status, 201);
    assert!(client.send(keyed("k-log-1")).await.replayed());
    client
        .send(keyed("k-log-1").json(r#"{"other": 1}"#))
        .await
        .assert_problem(422, "key-reused");
    client
        .send(keyed("k-log-2").header("Authorization", "Bearer second"))
        .await
        .assert_problem(400, "invalid-tenant");
    client
        .send(keyed("k-log-3").header("x-sample-delay-ms", "1500"))
        .await
        .assert_problem(504, "upstream-timeout");
    let plain = client
        .send(
            Req::get(&format!("http://{proxy}/v1/refunds")).header("Authorization", TENANT_SECRET),
        )
        .await;
    assert_eq!(plain.status, 201);
    let healthy = p.stop().await;
    assert!(
        healthy.contains("\"outcome\":\"replayed\""),
        "no access log:\n{healthy}"
    );
    assert!(healthy.contains("\"outcome\":\"mismatch\""), "{healthy}");
    outputs.push(("healthy run", healthy));

    // 2. The database unreachable, its URL (and password) in the file.
    let unreachable = format!("postgres://app:{DB_PASSWORD}Unreachable@127.0.0.1:1/nowhere");
    secrets.push(format!("{DB_PASSWORD}Unreachable"));
    let path = write_config(
        &dir,
        "unreachable.toml",
        &serve_config(&format!("database_url = \"{unreachable}\"")),
    );
    let p = Process::spawn(
        &[
            "--log-format",
            "json",
            "serve",
            "--config",
            path.to_str().unwrap(),
        ],
        &[],
    );
    let proxy = p.field_of("idemproxy listening", "proxy_addr").await;
    let r = client
        .send(
            Req::post(&format!("http://{proxy}/v1/refunds"))
                .key("k-down")
                .json(&body)
                .header("Authorization", TENANT_SECRET),
        )
        .await;
    r.assert_problem(503, "store-unavailable");
    // The migration retry logs its failure at least once.
    eventually(Duration::from_secs(10), "a WARN log line", || async {
        p.output().contains("\"level\":\"WARN\"")
    })
    .await;
    let down = p.stop().await;
    assert!(
        down.contains("\"level\":\"WARN\""),
        "no failure was logged:\n{down}"
    );
    outputs.push(("unreachable database", down));

    // 3. A live server that refuses the login (no such role), from a flag.
    let (scheme, rest) = db.url.split_once("://").unwrap();
    let host = rest.split_once('@').map_or(rest, |(_, h)| h);
    let refused = format!("{scheme}://no_such_role_x:{DB_PASSWORD}Refused@{host}");
    secrets.push(format!("{DB_PASSWORD}Refused"));
    let path = write_config(&dir, "refused.toml", &serve_config(""));
    let p = Process::spawn(
        &[
            "--log-format",
            "json",
            "serve",
            "--config",
            path.to_str().unwrap(),
            "--database-url",
            &refused,
        ],
        &[],
    );
    let proxy = p.field_of("idemproxy listening", "proxy_addr").await;
    let r = client
        .send(
            Req::post(&format!("http://{proxy}/v1/refunds"))
                .key("k-refused")
                .json(&body)
                .header("Authorization", TENANT_SECRET),
        )
        .await;
    r.assert_problem(503, "store-unavailable");
    tokio::time::sleep(Duration::from_millis(300)).await;
    outputs.push(("refused login", p.stop().await));

    // 4. One-shot subcommands that fail on the same URLs.
    let path = write_config(&dir, "oneshot.toml", &serve_config(""));
    for (what, args) in [
        (
            "migrate",
            vec!["migrate", "--database-url", unreachable.as_str()],
        ),
        ("sweep", vec!["sweep", "--database-url", refused.as_str()]),
        (
            "keys show",
            vec![
                "keys",
                "show",
                "--tenant",
                TENANT_SECRET,
                "--hash-tenant",
                "--key",
                "k",
                "--database-url",
                unreachable.as_str(),
            ],
        ),
    ] {
        let mut full = vec!["--log-format", "json"];
        full.extend(args);
        full.extend(["--config", path.to_str().unwrap()]);
        outputs.push((what, Process::spawn(&full, &[]).finish().await));
    }
    // check-config with a URL that does not parse.
    let bad = write_config(
        &dir,
        "bad-url.toml",
        &serve_config(&format!(
            "database_url = \"postgres://app:{DB_PASSWORD}Bad@db:notaport/x\""
        )),
    );
    secrets.push(format!("{DB_PASSWORD}Bad"));
    outputs.push((
        "check-config",
        Process::spawn(&["check-config", "--config", bad.to_str().unwrap()], &[])
            .finish()
            .await,
    ));
    let _ = std::fs::remove_dir_all(&dir);

    let secrets: Vec<&str> = secrets.iter().map(String::as_str).collect();
    let mut failures = Vec::new();
    for (what, output) in &outputs {
        assert!(!output.is_empty(), "{what}: nothing was logged");
        if let Some(secret) = secrets.iter().find(|s| output.contains(*s)) {
            let line = output.lines().find(|l| l.contains(secret)).unwrap();
            failures.push(format!("{what}: {secret:?} in: {line}"));
        }
        if let Some(line) = output.lines().find(|l| l.contains(BODY_MARKER)) {
            failures.push(format!("{what}: a request body in: {line}"));
        }
    }
    assert!(
        failures.is_empty(),
        "secrets in the logs:\n{}",
        failures.join("\n")
    );
}
