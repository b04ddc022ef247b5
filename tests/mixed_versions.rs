//! A rolling upgrade, through real processes: replicas of the previous
//! release (the newest release in CHANGELOG.md, built from its commit by
//! `support::previous`) and of this tree serve the same keys from one
//! database, whose schema this tree migrated while the previous release was
//! serving (docs/operations.md, "Upgrades and compatibility").
//!
//! What it catches: any change that breaks the previous release against
//! the schema and the records this tree writes, or this tree against what
//! the previous release writes — a column renamed or dropped in place, a
//! constraint the previous release violates, a changed header or
//! fingerprint encoding, a notification payload the other version does not
//! understand, a fence one version does not honour.
//!
//! Every case runs in both directions. The first run on a machine builds
//! the previous release (minutes; the binary is cached); a clone without
//! its commit fails here, on purpose.

mod support;

use std::time::{Duration, Instant};

use http::StatusCode;
use support::db::TestDb;
use support::http::{HttpClient, Req, Resp};
use support::previous::{newest_release, previous_binary, Release, Replica, Version};
use support::process::TempDir;
use support::proxy_proc::ProxyConfig;
use support::records::{read_row, wait_lease_expired};
use support::upstream_proc::UpstreamProc;

const PAY: &str = r#"{"amount": 100, "currency": "EUR"}"#;
/// A route whose duplicates wait for their original (DESIGN §1, `wait`).
const WAIT: &str = "/v1/wait/orders";
/// A route without waiting: duplicates of an in-flight key get 409.
const PLAIN: &str = "/v1/orders";
const CLAIM_STATEMENTS: &str = r#"idemproxy_store_duration_seconds_count{op="claim"}"#;

const ROUTES: &str = r#"
[[route]]
name = "wait"
path_prefix = "/v1/wait/"
wait = "5s"

[[route]]
name = "default"
path_prefix = "/"
"#;

/// One database, one upstream, a replica of each version.
struct Mix {
    /// Logs and configurations (kept when a test fails).
    _dir: TempDir,
    db: TestDb,
    sql: tokio_postgres::Client,
    up: UpstreamProc,
    previous: Replica,
    current: Replica,
}

fn succeeded(what: &str, out: &std::process::Output) {
    assert!(
        out.status.success(),
        "{what}: {}\n--- stdout\n{}\n--- stderr\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

impl Mix {
    /// The upgrade as an operator runs it: the previous release migrated
    /// the database and serves; this tree's `migrate` runs under it; then a
    /// replica of this tree joins.
    async fn start(tag: &str) -> Mix {
        let previous_bin = previous_binary();
        if previous_bin.built {
            eprintln!(
                "built the previous release {} in {:.0?}",
                previous_bin.release.version, previous_bin.build_time
            );
        }
        let dir = TempDir::new(tag);
        let db = TestDb::new().await;
        let sql = db.client().await;
        let up = UpstreamProc::start(&dir).await;
        let config = ProxyConfig::new(&up.url(), &db.url).lease("1s");
        let config = ProxyConfig {
            routes: ROUTES.into(),
            ..config
        };

        succeeded(
            "previous release: migrate",
            &Version::Previous.run(&["migrate"], &db.url),
        );
        let previous = Replica::start(&dir, "previous", Version::Previous, &config).await;

        // This tree's migrations, while the previous release serves.
        succeeded(
            "current: migrate under the previous release",
            &Version::Current.run(&["migrate"], &db.url),
        );
        succeeded(
            "current: migrate --status",
            &Version::Current.run(&["migrate", "--status"], &db.url),
        );
        // The previous release still sees a schema it can serve, and its
        // own `migrate` (a replica restarting) still accepts it.
        previous.wait_ready().await;
        succeeded(
            "previous release: migrate after the current one",
            &Version::Previous.run(&["migrate"], &db.url),
        );

        let current = Replica::start(&dir, "current", Version::Current, &config).await;
        Mix {
            _dir: dir,
            db,
            sql,
            up,
            previous,
            current,
        }
    }
}

async fn post(replica: &Replica, path: &str, key: &str, headers: &[(&str, &str)]) -> Resp {
    let mut req = Req::post(&replica.proxy.url(path)).key(key).json(PAY);
    for (n, v) in headers {
        req = req.header(n, v);
    }
    tokio::time::timeout(Duration::from_secs(20), HttpClient::new().try_send(req))
        .await
        .unwrap_or_else(|_| panic!("POST {key} via {}: no answer", replica.name()))
        .unwrap_or_else(|e| panic!("POST {key} via {}: {e}", replica.name()))
}

fn spawn_post(
    replica: &Replica,
    path: &str,
    key: &str,
    headers: &[(&str, &str)],
) -> tokio::task::JoinHandle<Result<Resp, String>> {
    let mut req = Req::post(&replica.proxy.url(path)).key(key).json(PAY);
    for (n, v) in headers {
        req = req.header(n, v);
    }
    tokio::spawn(async move {
        match tokio::time::timeout(Duration::from_secs(20), HttpClient::new().try_send(req)).await {
            Ok(r) => r,
            Err(_) => Err("no answer".into()),
        }
    })
}

fn assert_same_answer(original: &Resp, replay: &Resp, what: &str) {
    assert_eq!(replay.status, original.status, "{what}: {}", replay.text());
    assert!(replay.replayed(), "{what}: not a replay: {}", replay.text());
    assert_eq!(replay.body, original.body, "{what}: body differs");
    assert_eq!(
        replay.header("content-type"),
        original.header("content-type"),
        "{what}"
    );
    assert_eq!(
        replay.header("x-sample-execution"),
        original.header("x-sample-execution"),
        "{what}: stored headers differ"
    );
}

#[test]
fn the_previous_release_is_the_newest_one_in_the_changelog() {
    let text = "# Changelog\n\n## Unreleased\n\n### Added\n\n\
                ## 0.2.0 — 2027-01-10 — commit abcdef1\n\n## 0.1.0 — 2026-12-02 — commit 3d45772\n";
    assert_eq!(
        newest_release(text),
        Some(Release {
            version: "0.2.0".into(),
            commit: "abcdef1".into()
        })
    );
    assert_eq!(newest_release("## Unreleased\n"), None);
    let ours = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/CHANGELOG.md"))
        .expect("CHANGELOG.md");
    let release = newest_release(&ours).expect("a release heading in CHANGELOG.md");
    assert!(release.commit.chars().all(|c| c.is_ascii_hexdigit()));
}

#[tokio::test]
async fn concurrent_duplicates_split_between_versions_execute_once() {
    let mix = Mix::start("mixed-concurrent").await;
    let slow = [("x-sample-delay-ms", "800")];

    // Waiting duplicates: everyone gets the one execution's answer.
    let tasks: Vec<_> = (0..10)
        .map(|i| {
            let replica = if i % 2 == 0 {
                &mix.previous
            } else {
                &mix.current
            };
            spawn_post(replica, WAIT, "k-split-wait", &slow)
        })
        .collect();
    let mut answers = Vec::new();
    for t in tasks {
        answers.push(t.await.unwrap().expect("an answer"));
    }
    assert!(answers.iter().all(|r| r.status == StatusCode::CREATED));
    assert_eq!(answers.iter().filter(|r| !r.replayed()).count(), 1);
    assert!(answers.iter().all(|r| r.body == answers[0].body));
    assert_eq!(mix.up.executions("k-split-wait").await, 1);

    // Without waiting: one execution, the rest 409 or a replay.
    let tasks: Vec<_> = (0..10)
        .map(|i| {
            let replica = if i % 2 == 0 {
                &mix.current
            } else {
                &mix.previous
            };
            spawn_post(replica, PLAIN, "k-split-409", &slow)
        })
        .collect();
    let mut executed = 0;
    for t in tasks {
        let r = t.await.unwrap().expect("an answer");
        match r.status.as_u16() {
            201 if !r.replayed() => executed += 1,
            201 => {}
            409 => r.assert_problem(409, "request-in-progress"),
            other => panic!("unexpected {other}: {}", r.text()),
        }
    }
    assert_eq!(executed, 1);
    assert_eq!(mix.up.executions("k-split-409").await, 1);
}

#[tokio::test]
async fn a_key_completed_by_one_version_is_replayed_and_fenced_by_the_other() {
    let mix = Mix::start("mixed-replay").await;
    for (first, second, key) in [
        (&mix.previous, &mix.current, "k-previous-first"),
        (&mix.current, &mix.previous, "k-current-first"),
    ] {
        let original = post(first, PLAIN, key, &[("x-sample-set-cookie", "2")]).await;
        assert_eq!(original.status, StatusCode::CREATED, "{}", original.text());
        assert!(!original.replayed());
        let replay = post(second, PLAIN, key, &[]).await;
        assert_same_answer(&original, &replay, key);
        assert!(replay.header("idempotency-key-expires").is_some());
        // And back: the first version reads what it wrote, untouched.
        assert_same_answer(&original, &post(first, PLAIN, key, &[]).await, key);
        // A different request under the key: 422 from either version.
        let other = Req::post(&second.proxy.url(PLAIN))
            .key(key)
            .json(r#"{"amount": 1}"#);
        HttpClient::new()
            .send(other)
            .await
            .assert_problem(422, "key-reused");
        assert_eq!(mix.up.executions(key).await, 1);
    }
}

#[tokio::test]
async fn a_claim_whose_owner_was_killed_is_taken_over_by_the_other_version() {
    let mut mix = Mix::start("mixed-takeover").await;
    for previous_owns in [true, false] {
        let key = if previous_owns {
            "k-previous-dies"
        } else {
            "k-current-dies"
        };
        let (owner, other) = if previous_owns {
            (&mut mix.previous, &mix.current)
        } else {
            (&mut mix.current, &mix.previous)
        };
        let original = spawn_post(owner, PLAIN, key, &[("x-sample-delay-ms", "4000")]);
        mix.up
            .wait_executions(key, 1, Duration::from_secs(10))
            .await;
        let claimed = read_row(&mix.sql, "", key).await.unwrap();
        assert_eq!((claimed.state.as_str(), claimed.attempt), ("in_flight", 1));

        owner.proxy.proc.kill();
        assert!(original.await.unwrap().is_err(), "a killed owner answers");
        // Until the lease runs out, the other version refuses.
        let early = post(other, PLAIN, key, &[]).await;
        if early.status == StatusCode::CONFLICT {
            early.assert_problem(409, "request-in-progress");
        }
        wait_lease_expired(&mix.sql, key, Duration::from_secs(5)).await;
        let retry = post(other, PLAIN, key, &[]).await;
        assert_eq!(retry.status, StatusCode::CREATED, "{}", retry.text());
        assert!(!retry.replayed());
        assert_eq!(
            retry.json()["attempt"],
            "2",
            "{} forwarded Idempotency-Attempt: 2",
            other.name()
        );
        let done = read_row(&mix.sql, "", key).await.unwrap();
        assert_eq!((done.state.as_str(), done.attempt), ("completed", 2));
        assert_ne!(done.owner, claimed.owner, "a takeover mints a new owner");
        assert_eq!(mix.up.executions(key).await, 2);

        // The restarted owner replays the takeover's answer.
        owner.restart().await;
        assert_same_answer(&retry, &post(owner, PLAIN, key, &[]).await, key);
        assert_eq!(mix.up.executions(key).await, 2);
    }
}

#[tokio::test]
async fn a_waiter_on_one_version_is_woken_by_a_completion_on_the_other() {
    let mix = Mix::start("mixed-waiter").await;
    for (origin, waiter, key) in [
        (&mix.previous, &mix.current, "k-wake-current"),
        (&mix.current, &mix.previous, "k-wake-previous"),
    ] {
        let original = spawn_post(origin, WAIT, key, &[("x-sample-delay-ms", "1500")]);
        mix.up
            .wait_executions(key, 1, Duration::from_secs(10))
            .await;
        let asked = Instant::now();
        let woken = post(waiter, WAIT, key, &[]).await;
        let waited = asked.elapsed();
        let original = original.await.unwrap().expect("the original's answer");
        assert_eq!(original.status, StatusCode::CREATED);
        assert_same_answer(&original, &woken, key);
        assert!(
            waited < Duration::from_secs(4),
            "{} waited {waited:?} for a completion on {} (wait is 5s)",
            waiter.name(),
            origin.name()
        );
        assert_eq!(mix.up.executions(key).await, 1);
    }
}

/// Cached claims never reach the database: the count of claim statements.
async fn claim_statements(replica: &Replica) -> f64 {
    replica.proxy.metric(CLAIM_STATEMENTS).await
}

#[tokio::test]
async fn a_forced_release_by_one_versions_cli_clears_the_other_versions_cache() {
    let mix = Mix::start("mixed-cache").await;
    for (cacher, completer, cli, key) in [
        (
            &mix.previous,
            &mix.current,
            Version::Current,
            "k-cached-previous",
        ),
        (
            &mix.current,
            &mix.previous,
            Version::Previous,
            "k-cached-current",
        ),
    ] {
        let first = post(completer, PLAIN, key, &[]).await;
        assert_eq!(first.status, StatusCode::CREATED);
        // Warm the cacher: its first replay reads the database, the second
        // is served from memory.
        let before = claim_statements(cacher).await;
        assert_same_answer(&first, &post(cacher, PLAIN, key, &[]).await, key);
        assert_eq!(claim_statements(cacher).await, before + 1.0, "first replay");
        assert_same_answer(&first, &post(cacher, PLAIN, key, &[]).await, key);
        assert_eq!(
            claim_statements(cacher).await,
            before + 1.0,
            "{} did not cache the replay",
            cacher.name()
        );

        succeeded(
            "keys release --force",
            &cli.run(
                &["keys", "release", "--key", key, "--force", "--yes"],
                &mix.db.url,
            ),
        );
        // The release's notification, not the cache TTL (60 s), drops it.
        let deadline = Instant::now() + Duration::from_secs(3);
        loop {
            let r = post(cacher, PLAIN, key, &[]).await;
            if !r.replayed() {
                assert_eq!(r.status, StatusCode::CREATED, "{}", r.text());
                assert_ne!(r.body, first.body, "a new execution");
                break;
            }
            assert!(
                Instant::now() < deadline,
                "{} still replays a key the {} CLI released",
                cacher.name(),
                cli.label()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert_eq!(mix.up.executions(key).await, 2);
    }
}
