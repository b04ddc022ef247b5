//! DESIGN.md §8.9: configuration from the environment
//! (`IDEMPROXY_<SECTION>_<KEY>`, `_FILE`), precedence flags > environment >
//! file, and `check-config --print`; all through the real binary.

mod support;

use std::time::Duration;

use http::StatusCode;
use support::cli::{command, run as idemproxy, Output};
use support::db::TestDb;
use support::http::{metric_value, HttpClient, Req};
use support::process::{connection_refused, free_port, write, TempDir};
use support::upstream_proc::UpstreamProc;
use support::{eventually, poll_until};

const PASSWORD: &str = "hunter2-not-for-logs";

/// The line of `--print` output that sets `key` (the first one).
fn printed<'a>(out: &'a Output, key: &str) -> &'a str {
    let prefix = format!("{key} = ");
    out.stdout
        .lines()
        .find(|line| line.starts_with(&prefix))
        .unwrap_or_else(|| panic!("no line for {key}\n{}", out.both()))
}

/// `value` is printed for `key`, followed by `# source`.
fn assert_printed(out: &Output, key: &str, value: &str, source: &str) {
    let line = printed(out, key);
    let (shown, from) = line.split_once("  # ").unwrap_or((line, ""));
    assert_eq!(shown.trim_end(), format!("{key} = {value}"), "{line}");
    assert_eq!(from, source, "{line}");
}

#[tokio::test]
async fn check_config_print_shows_each_value_with_its_source_and_no_secret() {
    let dir = TempDir::new("config-env-print");
    let file = dir.join("idemproxy.toml");
    write(
        &file,
        "[server]\nlisten = \"127.0.0.1:18080\"\n\n[defaults]\nlease = \"5s\"\n\n\
         [[route]]\nname = \"payments\"\npath_prefix = \"/v1/payments\"\nlease = \"30s\"\n",
    );
    let file = file.display().to_string();
    let secret = dir.join("database-url");
    // A secret file as `echo` or an editor writes it: one trailing newline.
    write(
        &secret,
        &format!("postgres://app:{PASSWORD}@db.internal:5432/app\n"),
    );
    let secret = secret.display().to_string();
    let env = [
        ("IDEMPROXY_UPSTREAM_URL", "http://orders.internal:8000"),
        ("IDEMPROXY_STORE_POOL_SIZE", "5"),
        ("IDEMPROXY_DEFAULTS_METHODS", "POST,PUT"),
        ("IDEMPROXY_DEFAULTS_RELEASE_ON", "429, 503"),
        ("IDEMPROXY_DATABASE_URL_FILE", secret.as_str()),
        // Not configuration: no section follows the prefix.
        ("IDEMPROXY_TEST_SOMETHING_ELSE", "ignored"),
    ];
    let out = idemproxy(&["check-config", "--config", &file, "--print"], &env).await;
    assert_eq!(out.code, Some(0), "{}", out.both());
    assert_printed(&out, "listen", "\"127.0.0.1:18080\"", &format!("{file}:2"));
    assert_printed(&out, "admin_listen", "\"127.0.0.1:9090\"", "default");
    assert_printed(
        &out,
        "url",
        "\"http://orders.internal:8000/\"",
        "IDEMPROXY_UPSTREAM_URL",
    );
    assert_printed(&out, "pool_size", "5", "IDEMPROXY_STORE_POOL_SIZE");
    // The file's contents without the newline, the password redacted.
    assert_printed(
        &out,
        "database_url",
        "\"postgres://app:<redacted>@db.internal:5432/app\"",
        "IDEMPROXY_DATABASE_URL_FILE",
    );
    // A route inherits [defaults], whatever set it; its own keys win.
    assert_printed(
        &out,
        "methods",
        "[\"POST\", \"PUT\"]",
        "defaults.methods: IDEMPROXY_DEFAULTS_METHODS",
    );
    assert_printed(
        &out,
        "release_on",
        "[429, 503]",
        "defaults.release_on: IDEMPROXY_DEFAULTS_RELEASE_ON",
    );
    assert_printed(&out, "lease", "\"30s\"", &format!("{file}:10"));
    assert!(!out.both().contains(PASSWORD), "{}", out.both());

    // A flag beats the environment.
    let out = idemproxy(
        &[
            "check-config",
            "--config",
            &file,
            "--print",
            "--database-url",
            "postgres://flag@db.internal/app",
        ],
        &env,
    )
    .await;
    assert_eq!(out.code, Some(0), "{}", out.both());
    assert_printed(
        &out,
        "database_url",
        "\"postgres://flag@db.internal/app\"",
        "--database-url",
    );
}

#[tokio::test]
async fn check_config_names_the_variable_of_every_bad_value() {
    let dir = TempDir::new("config-env-bad");
    let file = dir.join("idemproxy.toml");
    write(&file, "[store]\npool_siz = 3\n");
    let file = file.display().to_string();
    let url_file = dir.join("upstream-url");
    write(&url_file, "http://b:2\n");
    let url_file = url_file.display().to_string();
    let missing = dir.join("missing").display().to_string();
    let out = idemproxy(
        &["check-config", "--config", &file],
        &[
            ("IDEMPROXY_STORE_POOL_SIZE", "two"),
            ("IDEMPROXY_STORE_POOLSIZE", "3"),
            ("IDEMPROXY_UPSTREAM_TIMEOUT", "soon"),
            ("IDEMPROXY_UPSTREAM_URL", "http://a:1"),
            ("IDEMPROXY_UPSTREAM_URL_FILE", url_file.as_str()),
            ("IDEMPROXY_SERVER_LISTEN_FILE", missing.as_str()),
            (
                "IDEMPROXY_DATABASE_URL",
                &format!("mysql://app:{PASSWORD}@db/app"),
            ),
        ],
    )
    .await;
    assert_eq!(out.code, Some(1), "{}", out.both());
    for expected in [
        format!("{file}:2: store.pool_siz: unknown key"),
        "IDEMPROXY_STORE_POOL_SIZE: store.pool_size: expected an integer, not \"two\"".into(),
        "IDEMPROXY_STORE_POOLSIZE: unknown configuration variable".into(),
        "IDEMPROXY_UPSTREAM_TIMEOUT: upstream.timeout: invalid duration \"soon\"".into(),
        "IDEMPROXY_UPSTREAM_URL, IDEMPROXY_UPSTREAM_URL_FILE: upstream.url: set by 2 variables at once".into(),
        format!("IDEMPROXY_SERVER_LISTEN_FILE: server.listen: cannot read the file \"{missing}\""),
        "IDEMPROXY_DATABASE_URL: store.database_url: must be a postgres:// or postgresql:// URL".into(),
    ] {
        assert!(
            out.stderr.lines().any(|line| line.starts_with(&expected)),
            "missing: {expected}\n{}",
            out.both()
        );
    }
    assert!(!out.both().contains(PASSWORD), "{}", out.both());
}

#[tokio::test]
async fn serve_runs_from_the_environment_alone_and_a_flag_beats_it() {
    let dir = TempDir::new("config-env-serve");
    let db = TestDb::new().await;
    let upstream = UpstreamProc::start(&dir).await;
    let secret = dir.join("database-url");
    write(&secret, &format!("{}\n", db.url));
    let secret = secret.display().to_string();
    let listen = format!("127.0.0.1:{}", free_port());
    let beaten = format!("127.0.0.1:{}", free_port());
    let admin = format!("127.0.0.1:{}", free_port());
    let upstream_url = upstream.url();
    // No configuration file: what `docker run -e ...` does.
    let child = command(
        &["serve", "--listen", &listen],
        &[
            ("IDEMPROXY_SERVER_LISTEN", beaten.as_str()),
            ("IDEMPROXY_SERVER_ADMIN_LISTEN", admin.as_str()),
            ("IDEMPROXY_UPSTREAM_URL", upstream_url.as_str()),
            ("IDEMPROXY_STORE_DATABASE_URL_FILE", secret.as_str()),
            ("IDEMPROXY_STORE_POOL_SIZE", "4"),
            ("IDEMPROXY_DEFAULTS_KEY", "required"),
            ("IDEMPROXY_SWEEPER_INTERVAL", "1h"),
            ("RUST_LOG", "info"),
        ],
    )
    .spawn()
    .expect("spawning idemproxy serve");
    let client = HttpClient::new();
    let admin_url = |path: &str| format!("http://{admin}{path}");
    poll_until(
        Duration::from_secs(20),
        "the store ready on the admin listener from IDEMPROXY_SERVER_ADMIN_LISTEN",
        || async {
            match client.try_send(Req::get(&admin_url("/readyz/store"))).await {
                Ok(r) if r.status == StatusCode::OK => Ok(()),
                Ok(r) => Err(format!("{} {}", r.status, r.text())),
                Err(e) => Err(e),
            }
        },
    )
    .await;

    // The upstream and the database came from the environment.
    let url = format!("http://{listen}/v1/orders");
    let first = client
        .send(Req::post(&url).key("env-1").json("{\"n\": 1}"))
        .await;
    assert_eq!(first.status, StatusCode::CREATED, "{}", first.text());
    let again = client
        .send(Req::post(&url).key("env-1").json("{\"n\": 1}"))
        .await;
    assert!(again.replayed(), "{}", again.text());
    assert_eq!(upstream.executions("env-1").await, 1);
    // [defaults] key = "required" from IDEMPROXY_DEFAULTS_KEY.
    let keyless = client.send(Req::post(&url).json("{\"n\": 2}")).await;
    assert_eq!(
        keyless.status,
        StatusCode::BAD_REQUEST,
        "{}",
        keyless.text()
    );
    // --listen beat IDEMPROXY_SERVER_LISTEN.
    assert!(connection_refused(beaten.parse().unwrap()).await);

    // Without a file, SIGHUP has nothing to read again: counted, skipped,
    // and the process goes on serving.
    let pid = child.id().expect("running").to_string();
    let hup = std::process::Command::new("kill")
        .args(["-s", "HUP", &pid])
        .status()
        .expect("kill -s HUP");
    assert!(hup.success());
    eventually(
        Duration::from_secs(10),
        "idemproxy_config_reloads_total{result=\"skipped\"} 1",
        || async {
            let text = client.send(Req::get(&admin_url("/metrics"))).await.text();
            metric_value(&text, "idemproxy_config_reloads_total{result=\"skipped\"}") == 1.0
        },
    )
    .await;
    let served = client
        .send(Req::post(&url).key("env-2").json("{\"n\": 3}"))
        .await;
    assert_eq!(served.status, StatusCode::CREATED, "{}", served.text());

    // Other commands read the same variables: the papercut's spelling of
    // the state works, and so does the old one.
    for state in ["in_flight", "in-flight"] {
        let out = idemproxy(
            &["keys", "list", "--state", state],
            &[("IDEMPROXY_STORE_DATABASE_URL_FILE", secret.as_str())],
        )
        .await;
        assert_eq!(out.code, Some(0), "--state {state}\n{}", out.both());
        assert!(out.stdout.contains("0 record(s)"), "{}", out.both());
    }

    let term = std::process::Command::new("kill")
        .args(["-s", "TERM", &pid])
        .status()
        .expect("kill -s TERM");
    assert!(term.success());
    let out = tokio::time::timeout(Duration::from_secs(15), child.wait_with_output())
        .await
        .expect("serve did not stop on SIGTERM")
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    assert!(
        stderr.contains("nothing to read again"),
        "the skipped reload was logged\n{stderr}"
    );
}

/// `docs/check-config-print.txt` (written by `scripts/config-print-example`)
/// is what the binary prints today.
#[tokio::test]
async fn the_documented_print_sample_is_current() {
    let dir = TempDir::new("config-env-doc");
    let secret = dir.join("database-url");
    write(
        &secret,
        "postgres://idemproxy:example-password@db.internal:5432/idemproxy\n",
    );
    let secret = secret.display().to_string();
    let out = idemproxy(
        &["check-config", "--config", "config/example.toml", "--print"],
        &[
            ("IDEMPROXY_UPSTREAM_URL", "http://orders.internal:8000"),
            ("IDEMPROXY_STORE_DATABASE_URL_FILE", secret.as_str()),
            ("IDEMPROXY_DEFAULTS_RELEASE_ON", "429,503"),
        ],
    )
    .await;
    assert_eq!(out.code, Some(0), "{}", out.both());
    let committed = include_str!("../docs/check-config-print.txt");
    assert_eq!(
        out.stdout, committed,
        "docs/check-config-print.txt is stale: run scripts/config-print-example"
    );
    assert!(!committed.contains("example-password"));
}
