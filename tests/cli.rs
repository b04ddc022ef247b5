//! DESIGN.md §4: the `idemproxy` command line, run as the real binary
//! against a real PostgreSQL.

mod support;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use support::db::TestDb;
use support::harness::{Harness, Setup};
use support::http::Req;

const PAY: &str = r#"{"amount": 100, "currency": "EUR"}"#;

use support::cli::{command, run as idemproxy, Output};

static FILES: AtomicU32 = AtomicU32::new(0);

/// A configuration file in the test's scratch directory, removed on drop.
struct ConfigFile(PathBuf);

impl ConfigFile {
    fn to_str(&self) -> &str {
        self.0.to_str().unwrap()
    }
}

impl Drop for ConfigFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

fn write_config(text: &str) -> ConfigFile {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR"));
    std::fs::create_dir_all(dir).unwrap();
    let path = dir.join(format!(
        "cli-{}-{}.toml",
        std::process::id(),
        FILES.fetch_add(1, Ordering::SeqCst)
    ));
    std::fs::write(&path, text).unwrap();
    ConfigFile(path)
}

/// A valid configuration (loopback, port 0) whose database URL is a
/// placeholder: the tests pass the real one in `IDEMPROXY_DATABASE_URL`.
fn config_file(setup: &Setup, upstream: &str) -> ConfigFile {
    write_config(&setup.toml(upstream, "postgres://placeholder@127.0.0.1:1/placeholder"))
}

// ---------------------------------------------------------------------------
// check-config

#[tokio::test]
async fn check_config_accepts_the_shipped_configs() {
    for file in ["config/example.toml", "config/dev.toml"] {
        if !Path::new(env!("CARGO_MANIFEST_DIR")).join(file).exists() {
            continue;
        }
        let out = idemproxy(&["check-config", "--config", file], &[]).await;
        assert_eq!(out.code, Some(0), "{file}\n{}", out.both());
        assert!(out.stdout.contains("valid"), "{}", out.both());
    }
}

#[tokio::test]
async fn check_config_names_every_problem_with_its_line() {
    let path = write_config(
        "[server]\n\
         listen = \"127.0.0.1:8080\"\n\
         bogus_key = 1\n\
         \n\
         [defaults]\n\
         lease = \"10 parsecs\"\n\
         another_unknown = \"x\"\n",
    );
    let file = path.to_str();
    let out = idemproxy(&["check-config", "--config", file], &[]).await;
    assert_ne!(out.code, Some(0), "{}", out.both());
    for (line, key) in [
        (3, "server.bogus_key"),
        (6, "defaults.lease"),
        (7, "defaults.another_unknown"),
    ] {
        let wanted = format!("{file}:{line}: {key}");
        assert!(
            out.stderr.contains(&wanted),
            "{wanted:?} missing\n{}",
            out.both()
        );
    }
    assert!(out.stderr.contains("10 parsecs"), "{}", out.both());
    assert!(out.stderr.contains("unknown key"), "{}", out.both());
}

#[tokio::test]
async fn check_config_of_a_missing_file_fails_with_a_clear_message() {
    let file = "/nonexistent/idemproxy-no-such-file.toml";
    let out = idemproxy(&["check-config", "--config", file], &[]).await;
    assert_ne!(out.code, Some(0), "{}", out.both());
    assert!(out.stderr.contains(file), "{}", out.both());
    assert!(out.stderr.contains("cannot read"), "{}", out.both());
}

#[tokio::test]
async fn worker_threads_come_from_tokio_worker_threads_and_a_bad_value_is_refused_not_a_panic() {
    let file = "config/example.toml";
    let out = idemproxy(
        &["check-config", "--config", file],
        &[("TOKIO_WORKER_THREADS", "1")],
    )
    .await;
    assert_eq!(out.code, Some(0), "{}", out.both());
    for bad in ["0", "two", "-1", ""] {
        let out = idemproxy(
            &["check-config", "--config", file],
            &[("TOKIO_WORKER_THREADS", bad)],
        )
        .await;
        assert_eq!(out.code, Some(1), "{bad:?}\n{}", out.both());
        assert!(
            out.stderr
                .contains("TOKIO_WORKER_THREADS must be a whole number"),
            "{bad:?}\n{}",
            out.both()
        );
        assert!(!out.stderr.contains("panicked"), "{bad:?}\n{}", out.both());
    }
}

// ---------------------------------------------------------------------------
// migrate and sweep

#[tokio::test]
async fn migrate_applies_pending_versions_then_reports_the_schema_current() {
    let db = TestDb::new().await;
    let path = config_file(&Setup::default(), "http://127.0.0.1:1");
    let args = ["migrate", "--config", path.to_str()];
    let env = [("IDEMPROXY_DATABASE_URL", db.url.as_str())];

    let first = idemproxy(&args, &env).await;
    assert_eq!(first.code, Some(0), "{}", first.both());
    assert!(
        first.stdout.contains("applied migrations: [1]"),
        "{}",
        first.both()
    );

    let second = idemproxy(&args, &env).await;
    assert_eq!(second.code, Some(0), "{}", second.both());
    assert!(
        second.stdout.contains("schema is current"),
        "{}",
        second.both()
    );
    assert!(!second.stdout.contains("applied"), "{}", second.both());

    let c = db.client().await;
    let n: i64 = c
        .query_one("SELECT count(*) FROM idemproxy_schema_migrations", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(n, idemproxy::store::migrate::MIGRATIONS.len() as i64);
}

#[tokio::test]
async fn sweep_deletes_expired_records_and_prints_how_many() {
    let h = Harness::start(Setup::default()).await;
    let store = h.store();
    for i in 0..3 {
        support::records::claim_in_flight(
            &store,
            "",
            &format!("k-expired-{i}"),
            Duration::from_millis(100),
            Duration::from_millis(100),
        )
        .await;
    }
    let kept = h.post("/v1/payments", "k-kept", PAY).await;
    assert_eq!(kept.status, 201);
    tokio::time::sleep(Duration::from_millis(200)).await;

    let path = config_file(&h.setup, &h.upstream.url());
    let args = ["sweep", "--config", path.to_str()];
    let env = [("IDEMPROXY_DATABASE_URL", h.db.url.as_str())];
    let out = idemproxy(&args, &env).await;
    assert_eq!(out.code, Some(0), "{}", out.both());
    assert!(
        out.stdout.contains("deleted 3 expired record(s)"),
        "{}",
        out.both()
    );
    assert_eq!(h.record_count().await, 1);
    assert!(h.record_state("", "k-kept").await.is_some());

    let again = idemproxy(&args, &env).await;
    assert_eq!(again.code, Some(0), "{}", again.both());
    assert!(
        again.stdout.contains("deleted 0 expired record(s)"),
        "{}",
        again.both()
    );
}

// ---------------------------------------------------------------------------
// keys show / keys release

const KEYS_ROUTES: &str = "
[[route]]
path_prefix = \"/v1/hashed\"
tenant_header = \"Authorization\"
tenant_hash = true

[[route]]
name = \"default\"
path_prefix = \"/\"
";

struct KeysFixture {
    h: Harness,
    config: ConfigFile,
}

impl KeysFixture {
    async fn new() -> KeysFixture {
        let h = Harness::start(Setup::default().routes(KEYS_ROUTES)).await;
        let config = config_file(&h.setup, &h.upstream.url());
        KeysFixture { h, config }
    }

    async fn keys(&self, args: &[&str]) -> Output {
        let mut all = vec!["keys"];
        all.extend_from_slice(&args[..1]);
        all.extend_from_slice(&["--config", self.config.to_str()]);
        all.extend_from_slice(&args[1..]);
        idemproxy(&all, &[("IDEMPROXY_DATABASE_URL", self.h.db.url.as_str())]).await
    }
}

#[tokio::test]
async fn keys_show_prints_the_record_and_the_body_only_when_asked() {
    let f = KeysFixture::new().await;
    let done = f.h.post("/v1/payments", "k-show", PAY).await;
    assert_eq!(done.status, 201);
    support::records::claim_in_flight(
        &f.h.store(),
        "",
        "k-show-flight",
        Duration::from_secs(60),
        Duration::from_secs(3600),
    )
    .await;

    let out = f.keys(&["show", "--tenant", "", "--key", "k-show"]).await;
    assert_eq!(out.code, Some(0), "{}", out.both());
    for line in [
        "state:           completed".to_string(),
        "attempt:         1".to_string(),
        "response status: 201".to_string(),
        format!("response body:   {} bytes", done.body.len()),
    ] {
        assert!(
            out.stdout.contains(&line),
            "{line:?} missing\n{}",
            out.both()
        );
    }
    assert!(
        !out.stdout.contains("body_sha256"),
        "the body is printed without --body\n{}",
        out.both()
    );

    let with_body = f
        .keys(&["show", "--tenant", "", "--key", "k-show", "--body"])
        .await;
    assert_eq!(with_body.code, Some(0), "{}", with_body.both());
    assert!(
        with_body.stdout.contains(&done.text()),
        "{}",
        with_body.both()
    );

    let flight = f.keys(&["show", "--key", "k-show-flight"]).await;
    assert_eq!(flight.code, Some(0), "{}", flight.both());
    assert!(
        flight.stdout.contains("state:           in_flight"),
        "{}",
        flight.both()
    );
    assert!(flight.stdout.contains("valid for"), "{}", flight.both());
    assert!(
        flight.stdout.contains("response status: -"),
        "{}",
        flight.both()
    );
}

#[tokio::test]
async fn keys_show_and_release_of_an_unknown_key_exit_3() {
    let f = KeysFixture::new().await;
    let show = f.keys(&["show", "--tenant", "", "--key", "k-nobody"]).await;
    assert_eq!(show.code, Some(3), "{}", show.both());
    assert!(show.stdout.contains("no record"), "{}", show.both());
    let release = f.keys(&["release", "--key", "k-nobody", "--yes"]).await;
    assert_eq!(release.code, Some(3), "{}", release.both());
}

#[tokio::test]
async fn keys_release_deletes_an_in_flight_claim_so_the_retry_executes() {
    let f = KeysFixture::new().await;
    support::records::claim_in_flight(
        &f.h.store(),
        "",
        "k-stuck",
        Duration::from_secs(60),
        Duration::from_secs(3600),
    )
    .await;
    f.h.post("/v1/payments", "k-stuck", PAY)
        .await
        .assert_problem(422, "key-reused");
    // Stuck (a different fingerprint than the claim, so 422; the same one would be 409).
    assert_eq!(f.h.upstream.executions("k-stuck"), 0);

    let out = f
        .keys(&["release", "--tenant", "", "--key", "k-stuck", "--yes"])
        .await;
    assert_eq!(out.code, Some(0), "{}", out.both());
    assert!(
        out.stdout.contains("deleted the in_flight record"),
        "{}",
        out.both()
    );
    assert_eq!(f.h.record_state("", "k-stuck").await, None);

    let retry = f.h.post("/v1/payments", "k-stuck", PAY).await;
    assert_eq!(retry.status, 201, "{}", retry.text());
    assert!(!retry.replayed());
    assert_eq!(f.h.upstream.executions("k-stuck"), 1);
}

#[tokio::test]
async fn keys_release_refuses_a_completed_record_without_force() {
    let f = KeysFixture::new().await;
    assert_eq!(f.h.post("/v1/payments", "k-done", PAY).await.status, 201);

    let refused = f.keys(&["release", "--key", "k-done", "--yes"]).await;
    assert_ne!(refused.code, Some(0), "{}", refused.both());
    assert!(refused.stderr.contains("--force"), "{}", refused.both());
    assert_eq!(
        f.h.record_state("", "k-done").await,
        Some(("completed".into(), 1))
    );
    assert!(f.h.post("/v1/payments", "k-done", PAY).await.replayed());

    // Without --yes and no terminal to ask on: nothing deleted.
    let unconfirmed = f.keys(&["release", "--key", "k-done", "--force"]).await;
    assert_ne!(unconfirmed.code, Some(0), "{}", unconfirmed.both());
    assert_eq!(
        f.h.record_state("", "k-done").await,
        Some(("completed".into(), 1))
    );

    let forced = f
        .keys(&["release", "--key", "k-done", "--force", "--yes"])
        .await;
    assert_eq!(forced.code, Some(0), "{}", forced.both());
    assert!(
        forced.stdout.contains("deleted the completed record"),
        "{}",
        forced.both()
    );
    assert_eq!(f.h.record_state("", "k-done").await, None);
    // The proxy cached the completion; the release's notification drops it
    // from the cache moments later (not synchronously with the CLI's exit).
    let deadline = std::time::Instant::now() + Duration::from_secs(3);
    loop {
        let again = f.h.post("/v1/payments", "k-done", PAY).await;
        if !again.replayed() {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the release never reached the proxy's cache"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(f.h.upstream.executions("k-done"), 2);
}

#[tokio::test]
async fn keys_hash_tenant_finds_a_record_on_a_tenant_hash_route() {
    let f = KeysFixture::new().await;
    let secret = "Bearer tok-s3cr3t-42";
    let r =
        f.h.send(
            Req::post("/v1/hashed/orders")
                .key("k-hashed")
                .header("Authorization", secret)
                .json(PAY),
        )
        .await;
    assert_eq!(r.status, 201, "{}", r.text());
    let c = f.h.db.client().await;
    let stored: String = c
        .query_one(
            "SELECT tenant_id FROM idempotency_records WHERE idempotency_key = 'k-hashed'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert!(
        !stored.contains("s3cr3t"),
        "the secret was stored: {stored}"
    );

    let hashed = f
        .keys(&[
            "show",
            "--tenant",
            secret,
            "--hash-tenant",
            "--key",
            "k-hashed",
        ])
        .await;
    assert_eq!(hashed.code, Some(0), "{}", hashed.both());
    assert!(
        hashed.stdout.contains("state:           completed"),
        "{}",
        hashed.both()
    );
    assert!(hashed.stdout.contains(&stored), "{}", hashed.both());

    let raw = f
        .keys(&["show", "--tenant", secret, "--key", "k-hashed"])
        .await;
    assert_eq!(
        raw.code,
        Some(3),
        "without --hash-tenant the raw value is looked up\n{}",
        raw.both()
    );

    let release = f
        .keys(&[
            "release",
            "--tenant",
            secret,
            "--hash-tenant",
            "--key",
            "k-hashed",
            "--force",
            "--yes",
        ])
        .await;
    assert_eq!(release.code, Some(0), "{}", release.both());
    assert_eq!(f.h.record_count().await, 0);
}

// ---------------------------------------------------------------------------
// Secrets

const PASSWORD: &str = "S3cretPw";

#[tokio::test]
async fn migrate_failure_never_prints_the_database_password() {
    let path = config_file(&Setup::default(), "http://127.0.0.1:1");
    let url = format!("postgres://postgres:{PASSWORD}@127.0.0.1:1/x");
    let out = idemproxy(
        &["migrate", "--config", path.to_str()],
        &[("IDEMPROXY_DATABASE_URL", url.as_str())],
    )
    .await;
    assert_ne!(out.code, Some(0), "{}", out.both());
    assert!(!out.both().contains(PASSWORD), "{}", out.both());
    assert!(
        !out.stderr.trim().is_empty(),
        "the failure is explained\n{}",
        out.both()
    );

    // A URL that does not even parse is not echoed either.
    let bad = format!("postgres://postgres:{PASSWORD}@127.0.0.1:notaport/x");
    for sub in ["migrate", "serve", "check-config"] {
        let out = idemproxy(
            &[sub, "--config", path.to_str()],
            &[("IDEMPROXY_DATABASE_URL", bad.as_str())],
        )
        .await;
        assert!(!out.both().contains(PASSWORD), "{sub}: {}", out.both());
        // Every subcommand refuses it as configuration, naming the key.
        assert_ne!(out.code, Some(0), "{sub}: {}", out.both());
        assert!(
            out.stderr.contains("store.database_url"),
            "{sub}: {}",
            out.both()
        );
    }
}

#[tokio::test]
async fn serve_logs_never_contain_the_database_password_and_sigterm_exits_0() {
    let path = config_file(&Setup::default(), "http://127.0.0.1:1");
    let url = format!("postgres://postgres:{PASSWORD}@127.0.0.1:1/x");
    let mut child = command(
        &["--log-format", "json", "serve", "--config", path.to_str()],
        &[
            ("IDEMPROXY_DATABASE_URL", url.as_str()),
            ("RUST_LOG", "debug"),
        ],
    )
    .spawn()
    .expect("spawning idemproxy serve");
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(
        child.try_wait().unwrap().is_none(),
        "serve exited with the database down"
    );

    let pid = child.id().expect("running").to_string();
    let status = std::process::Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .expect("kill -TERM");
    assert!(status.success());
    let out = tokio::time::timeout(Duration::from_secs(10), child.wait_with_output())
        .await
        .expect("serve did not stop on SIGTERM")
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !stdout.contains(PASSWORD) && !stderr.contains(PASSWORD),
        "{stdout}\n{stderr}"
    );
    assert!(
        stderr.contains("idemproxy listening"),
        "the logs were captured\n{stderr}"
    );
    assert!(
        stderr.contains("retrying"),
        "the migration retries were logged\n{stderr}"
    );
    for line in stderr.lines().filter(|l| !l.trim().is_empty()) {
        assert!(
            serde_json::from_str::<serde_json::Value>(line).is_ok(),
            "not a JSON log line: {line}"
        );
    }
    assert_eq!(
        out.status.code(),
        Some(0),
        "SIGTERM drains and exits 0\n{stderr}"
    );
}

#[tokio::test]
async fn serve_logs_name_keys_but_never_bodies_or_tenant_secrets() {
    use tokio::io::{AsyncBufReadExt, BufReader};

    let db = TestDb::new().await;
    let (upstream, _stop_upstream) = support::harness::start_upstream().await;
    let path = config_file(&Setup::default().routes(KEYS_ROUTES), &upstream.url());
    let mut child = command(
        &["--log-format", "json", "serve", "--config", path.to_str()],
        &[
            ("IDEMPROXY_DATABASE_URL", db.url.as_str()),
            ("RUST_LOG", "info,idemproxy=debug"),
        ],
    )
    .spawn()
    .expect("spawning idemproxy serve");
    let stderr = child.stderr.take().unwrap();
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<String>();
    let reader = tokio::spawn(async move {
        let mut lines = BufReader::new(stderr).lines();
        let mut all = Vec::new();
        while let Ok(Some(line)) = lines.next_line().await {
            let _ = tx.send(line.clone());
            all.push(line);
        }
        all
    });
    // The listeners are on port 0: their addresses are in the start-up log.
    let (proxy, admin) = tokio::time::timeout(Duration::from_secs(10), async {
        while let Some(line) = rx.recv().await {
            let v: serde_json::Value = serde_json::from_str(&line).unwrap_or_default();
            if v["message"] == "idemproxy listening" {
                let addr = |k: &str| {
                    v[k].as_str()
                        .unwrap()
                        .parse::<std::net::SocketAddr>()
                        .unwrap()
                };
                return (addr("proxy_addr"), addr("admin_addr"));
            }
        }
        panic!("serve exited before listening");
    })
    .await
    .expect("no 'idemproxy listening' log line");
    support::harness::wait_ready(admin).await;

    let secret = "Bearer tok-LOGSECRET-99";
    let body = r#"{"card": "BODYMARKER-4242"}"#;
    let client = support::http::HttpClient::new();
    let url = format!("http://{proxy}/v1/hashed/orders");
    let send = |body: &str| {
        client.send(
            Req::post(&url)
                .key("k-logged-key")
                .header("Authorization", secret)
                .json(body),
        )
    };
    let first = send(body).await;
    assert_eq!(first.status, 201, "{}", first.text());
    assert!(send(body).await.replayed());
    send(r#"{"card": "BODYMARKER-other"}"#)
        .await
        .assert_problem(422, "key-reused");

    let pid = child.id().expect("running").to_string();
    assert!(std::process::Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .unwrap()
        .success());
    let status = tokio::time::timeout(Duration::from_secs(10), child.wait())
        .await
        .expect("serve did not stop on SIGTERM")
        .unwrap();
    assert_eq!(status.code(), Some(0));
    let logs = reader.await.unwrap().join("\n");
    assert!(
        logs.contains("k-logged-key"),
        "the requests were logged\n{logs}"
    );
    assert!(
        !logs.contains("LOGSECRET"),
        "a tenant secret was logged\n{logs}"
    );
    assert!(!logs.contains("BODYMARKER"), "a body was logged\n{logs}");
}

// ---------------------------------------------------------------------------
// --help

/// The subcommands listed in the "Commands:" section of a help text.
fn listed_commands(help: &str) -> Vec<String> {
    help.lines()
        .skip_while(|l| !l.starts_with("Commands:"))
        .skip(1)
        .take_while(|l| l.starts_with("  "))
        .filter_map(|l| l.split_whitespace().next())
        .filter(|c| *c != "help")
        .map(str::to_owned)
        .collect()
}

#[tokio::test]
async fn every_subcommand_has_help_naming_its_flags() {
    let expected: &[(&[&str], &[&str])] = &[
        (
            &[],
            &[
                "serve",
                "migrate",
                "check-config",
                "sweep",
                "keys",
                "--log-format",
            ],
        ),
        (
            &["serve"],
            &[
                "--config",
                "--database-url",
                "--listen",
                "--admin-listen",
                "--no-migrate",
            ],
        ),
        (&["migrate"], &["--config", "--database-url"]),
        (&["check-config"], &["--config", "--database-url"]),
        (&["sweep"], &["--config", "--database-url"]),
        (&["keys"], &["show", "release"]),
        (
            &["keys", "show"],
            &["--config", "--tenant", "--hash-tenant", "--key", "--body"],
        ),
        (
            &["keys", "release"],
            &[
                "--config",
                "--tenant",
                "--hash-tenant",
                "--key",
                "--yes",
                "--force",
            ],
        ),
    ];
    for (sub, flags) in expected {
        let mut args = sub.to_vec();
        args.push("--help");
        let out = idemproxy(&args, &[]).await;
        assert_eq!(out.code, Some(0), "{args:?}\n{}", out.both());
        for flag in *flags {
            assert!(
                out.stdout.contains(flag),
                "{args:?}: {flag} missing\n{}",
                out.stdout
            );
        }
    }

    // Every listed subcommand (including any not named above) has a
    // working --help, and every leaf takes --config (DESIGN.md §6).
    let mut pending: Vec<Vec<String>> = vec![vec![]];
    let mut seen = 0;
    while let Some(path) = pending.pop() {
        let mut args: Vec<&str> = path.iter().map(String::as_str).collect();
        args.push("--help");
        let out = idemproxy(&args, &[]).await;
        assert_eq!(out.code, Some(0), "{args:?}\n{}", out.both());
        seen += 1;
        let children = listed_commands(&out.stdout);
        if children.is_empty() {
            assert!(
                out.stdout.contains("--config"),
                "{args:?}: no --config\n{}",
                out.stdout
            );
        }
        for child in children {
            let mut next = path.clone();
            next.push(child);
            pending.push(next);
        }
    }
    assert!(seen >= 8, "only {seen} help texts found");
}
