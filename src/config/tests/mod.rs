//! The configuration's unit tests, by theme; this file holds the shared
//! helpers and the tests of the whole: the DESIGN example, the defaults,
//! the shipped files, loading and the report's format.

use super::*;

mod overrides;
mod properties;
mod reference;
mod values;

/// DESIGN.md §3's example with the documented deviation of the
/// defaults: `shutdown_grace` is 35s, not 30s.
fn deviating(design: &str) -> String {
    assert!(design.contains("shutdown_grace = \"30s\""));
    design.replace("shutdown_grace = \"30s\"", "shutdown_grace = \"35s\"")
}

/// DESIGN.md §3, verbatim.
const DESIGN_EXAMPLE: &str = r#"[server]
listen = "0.0.0.0:8080"
admin_listen = "127.0.0.1:9090"      # /healthz, /readyz, /metrics
max_request_body = "1MiB"
shutdown_grace = "30s"

[upstream]
url = "http://127.0.0.1:3000"
connect_timeout = "2s"
timeout = "30s"

[store]
database_url = "postgres://idemproxy@127.0.0.1:5432/idemproxy"
pool_size = 16
timeout = "2s"                        # bound on any one store operation
on_store_error = "reject"             # or "pass_through"

[defaults]                            # every route inherits these
key_header = "Idempotency-Key"
methods = ["POST", "PATCH"]
key = "optional"                      # or "required"
lease = "10s"
retention = "24h"
max_key_length = 255
fingerprint = "json"                  # or "bytes"
release_on = []                       # e.g. [429, 503]
max_stored_response = "1MiB"
wait = "0s"                           # > 0: duplicates wait for the original

[[route]]
path_prefix = "/v1/payments"
tenant_header = "X-Tenant-ID"
tenant_required = true
lease = "30s"                         # any [defaults] key may be overridden

[[route]]
path_prefix = "/v1/"
tenant_header = "Authorization"
tenant_hash = true                    # store SHA-256 of the value, never the secret
"#;

const MIB: u64 = 1024 * 1024;

fn parse_ok(text: &str) -> Config {
    match parse(text, "test.toml", &Overrides::default()) {
        Ok(config) => config,
        Err(err) => panic!("expected a valid config, got:\n{err}"),
    }
}

fn problems(text: &str) -> Vec<Problem> {
    match parse(text, "test.toml", &Overrides::default()) {
        Ok(config) => panic!("expected problems, got {config:?}"),
        Err(err) => err.problems,
    }
}

fn problem<'a>(problems: &'a [Problem], key: &str) -> &'a Problem {
    problems
        .iter()
        .find(|p| p.key == key)
        .unwrap_or_else(|| panic!("no problem for {key} in {problems:#?}"))
}

fn secs(s: u64) -> Duration {
    Duration::from_secs(s)
}

#[test]
fn design_example_parses_to_the_expected_values() {
    let config = parse_ok(DESIGN_EXAMPLE);
    assert_eq!(config.server.listen, "0.0.0.0:8080".parse().unwrap());
    assert_eq!(
        config.server.admin_listen,
        "127.0.0.1:9090".parse().unwrap()
    );
    assert_eq!(config.server.max_request_body, MIB);
    assert_eq!(config.server.shutdown_grace, secs(30));
    assert_eq!(
        config.upstream.url,
        Uri::from_static("http://127.0.0.1:3000")
    );
    assert_eq!(config.upstream.connect_timeout, secs(2));
    assert_eq!(config.upstream.timeout, secs(30));
    assert_eq!(
        config.store.database_url.expose(),
        "postgres://idemproxy@127.0.0.1:5432/idemproxy"
    );
    assert_eq!(config.store.pool_size, 16);
    assert_eq!(config.store.timeout, secs(2));
    assert_eq!(config.store.on_store_error, OnStoreError::Reject);

    assert_eq!(config.routes.len(), 2);
    let payments = &config.routes[0];
    assert_eq!(payments.name, "/v1/payments");
    assert_eq!(payments.path_prefix, "/v1/payments");
    assert_eq!(
        payments.tenant_header,
        Some(HeaderName::from_static("x-tenant-id"))
    );
    assert!(payments.tenant_required);
    assert!(!payments.tenant_hash);
    assert_eq!(payments.policy.lease, secs(30));
    assert_eq!(payments.policy.retention, secs(24 * 3600));

    let v1 = &config.routes[1];
    assert_eq!(v1.path_prefix, "/v1/");
    assert_eq!(v1.tenant_header, Some(http::header::AUTHORIZATION));
    assert!(!v1.tenant_required);
    assert!(v1.tenant_hash);
    let policy = &v1.policy;
    assert_eq!(
        policy.key_header,
        HeaderName::from_static("idempotency-key")
    );
    assert_eq!(policy.methods, vec![Method::POST, Method::PATCH]);
    assert_eq!(policy.key, KeyRequirement::Optional);
    assert_eq!(policy.lease, secs(10));
    assert_eq!(policy.retention, secs(24 * 3600));
    assert_eq!(policy.max_key_length, 255);
    assert_eq!(policy.fingerprint, FingerprintMode::Json);
    assert!(policy.release_on.is_empty());
    assert_eq!(policy.max_stored_response, MIB);
    assert_eq!(policy.wait, Duration::ZERO);

    assert_eq!(
        config.route_for("/v1/payments/42").map(|r| r.name.as_str()),
        Some("/v1/payments")
    );
    assert_eq!(
        config.route_for("/v1/refunds").map(|r| r.name.as_str()),
        Some("/v1/")
    );
    assert!(config.route_for("/health").is_none());
}

#[test]
fn the_defaults_drain_an_owned_request_within_the_grace() {
    assert_eq!(parse_ok("").warnings(), Vec::<String>::new());
}

#[test]
fn a_grace_shorter_than_upstream_and_store_timeouts_is_warned_about() {
    let config = parse_ok("[server]\nshutdown_grace = \"10s\"\n");
    let warnings = config.warnings();
    assert_eq!(warnings.len(), 1, "{warnings:?}");
    assert!(
        warnings[0].contains("server.shutdown_grace (10s)"),
        "{warnings:?}"
    );
    assert!(warnings[0].contains("(32s)"), "{warnings:?}");
}

#[test]
fn empty_file_is_valid_and_every_key_has_its_default() {
    let config = parse_ok("");
    assert_eq!(config.server.listen, "0.0.0.0:8080".parse().unwrap());
    assert_eq!(
        config.server.admin_listen,
        "127.0.0.1:9090".parse().unwrap()
    );
    assert_eq!(config.server.max_request_body, MIB);
    assert_eq!(config.server.shutdown_grace, secs(35));
    assert_eq!(config.server.header_read_timeout, secs(10));
    assert_eq!(config.server.body_read_timeout, secs(30));
    assert_eq!(config.server.max_connections, 10_000);
    assert_eq!(config.server.h2_max_concurrent_streams, 100);
    assert_eq!(config.server.idle_timeout, secs(60));
    assert_eq!(
        config.upstream.url,
        Uri::from_static("http://127.0.0.1:3000")
    );
    assert_eq!(config.upstream.connect_timeout, secs(2));
    assert_eq!(config.upstream.timeout, secs(30));
    assert_eq!(
        config.store.database_url.expose(),
        "postgres://idemproxy@127.0.0.1:5432/idemproxy"
    );
    assert_eq!(config.store.pool_size, 16);
    assert_eq!(config.store.timeout, secs(2));
    assert_eq!(config.store.on_store_error, OnStoreError::Reject);
    assert_eq!(config.sweeper.interval, secs(60));
    assert_eq!(config.sweeper.batch_size, 1000);
    assert_eq!(config.sweeper.pause, Duration::from_millis(10));
    let policy = &config.routes[0].policy;
    assert_eq!(
        policy.key_header,
        HeaderName::from_static("idempotency-key")
    );
    assert_eq!(policy.methods, vec![Method::POST, Method::PATCH]);
    assert_eq!(policy.key, KeyRequirement::Optional);
    assert_eq!(policy.lease, secs(10));
    assert_eq!(policy.retention, secs(24 * 3600));
    assert_eq!(policy.max_key_length, 255);
    assert_eq!(policy.fingerprint, FingerprintMode::Json);
    assert!(policy.release_on.is_empty());
    assert_eq!(policy.max_stored_response, MIB);
    assert_eq!(policy.wait, Duration::ZERO);
    // Empty sections are as good as absent ones.
    let sections = "[server]\n[upstream]\n[store]\n[sweeper]\n[defaults]\n";
    assert_eq!(format!("{:?}", parse_ok(sections)), format!("{config:?}"));
}

#[test]
fn builtin_defaults_are_the_design_example_without_routes() {
    let Some((without_routes, _)) = DESIGN_EXAMPLE.split_once("[[route]]") else {
        panic!("the example has routes");
    };
    // One deliberate deviation (docs/configuration.md): the grace
    // covers upstream.timeout + store.timeout, 30s + 2s.
    let without_routes = deviating(without_routes);
    assert_eq!(
        format!("{:?}", parse_ok(&without_routes)),
        format!("{:?}", parse_ok(""))
    );
}

#[test]
fn no_route_means_one_catch_all_route_with_the_defaults_policy() {
    let config = parse_ok("[defaults]\nkey = \"required\"\nlease = \"3s\"\n");
    assert_eq!(config.routes.len(), 1);
    let route = &config.routes[0];
    assert_eq!(route.name, "default");
    assert_eq!(route.path_prefix, "/");
    assert_eq!(route.tenant_header, None);
    assert!(!route.tenant_required);
    assert!(!route.tenant_hash);
    assert_eq!(route.policy.key, KeyRequirement::Required);
    assert_eq!(route.policy.lease, secs(3));
    assert_eq!(
        config.route_for("/anything").map(|r| r.name.as_str()),
        Some("default")
    );
}

#[test]
fn route_inherits_the_defaults_and_overrides_one_key() {
    let config = parse_ok(
        "[defaults]\nmethods = [\"POST\"]\nwait = \"2s\"\nrelease_on = [429]\n\n\
         [[route]]\npath_prefix = \"/a\"\nwait = \"5s\"\n\n\
         [[route]]\npath_prefix = \"/b\"\n",
    );
    let (a, b) = (&config.routes[0].policy, &config.routes[1].policy);
    assert_eq!(a.wait, secs(5));
    assert_eq!(b.wait, secs(2));
    for policy in [a, b] {
        assert_eq!(policy.methods, vec![Method::POST]);
        assert_eq!(policy.release_on, vec![StatusCode::TOO_MANY_REQUESTS]);
        assert_eq!(policy.lease, secs(10));
    }
}

#[test]
fn route_name_defaults_to_its_path_prefix_and_path_prefix_to_slash() {
    let config = parse_ok(
        "[[route]]\nname = \"payments\"\npath_prefix = \"/pay\"\n\
         [[route]]\npath_prefix = \"/v1/\"\n\
         [[route]]\ntenant_header = \"X-Tenant\"\n",
    );
    let names: Vec<&str> = config.routes.iter().map(|r| r.name.as_str()).collect();
    assert_eq!(names, ["payments", "/v1/", "/"]);
    assert_eq!(config.routes[2].path_prefix, "/");
}

#[test]
fn problems_display_file_line_key_and_message() {
    let problem = Problem {
        origin: "example.toml".into(),
        line: Some(12),
        key: "route[1].lease".into(),
        message: "invalid duration \"10 parsecs\"".into(),
    };
    assert_eq!(
        problem.to_string(),
        "example.toml:12: route[1].lease: invalid duration \"10 parsecs\""
    );
    let no_line = Problem {
        line: None,
        key: String::new(),
        ..problem.clone()
    };
    assert_eq!(
        no_line.to_string(),
        "example.toml: invalid duration \"10 parsecs\""
    );
    let err = ConfigError {
        problems: vec![problem, no_line],
    };
    assert_eq!(err.to_string().lines().count(), 2);
}

#[test]
fn load_reads_the_file_and_reports_a_missing_one() {
    let missing = Path::new("/nonexistent/idemproxy/config.toml");
    let err = load(missing, &Overrides::default()).unwrap_err();
    assert_eq!(err.problems.len(), 1);
    assert_eq!(err.problems[0].origin, missing.display().to_string());

    let path =
        std::env::temp_dir().join(format!("idemproxy-config-test-{}.toml", std::process::id()));
    std::fs::write(&path, "[server]\nlisten = \"127.0.0.1:7000\"\nbogus = 1\n").unwrap();
    let err = load(&path, &Overrides::default()).unwrap_err();
    std::fs::remove_file(&path).unwrap();
    assert_eq!(err.problems[0].origin, path.display().to_string());
    assert_eq!(err.problems[0].line, Some(3));
}

#[test]
fn shipped_config_files_parse() {
    let example = parse(
        include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/config/example.toml")),
        "example.toml",
        &Overrides::default(),
    )
    .unwrap_or_else(|err| panic!("{err}"));
    assert_eq!(
        format!("{:?}", example),
        format!("{:?}", parse_ok(&deviating(DESIGN_EXAMPLE)))
    );

    let dev = parse(
        include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/config/dev.toml")),
        "dev.toml",
        &Overrides::default(),
    )
    .unwrap_or_else(|err| panic!("{err}"));
    assert_eq!(dev.server.listen, "127.0.0.1:8080".parse().unwrap());
    assert_eq!(dev.server.admin_listen, "127.0.0.1:9190".parse().unwrap());
    assert_eq!(dev.upstream.url, Uri::from_static("http://127.0.0.1:3000"));
    assert_eq!(
        dev.store.database_url.expose(),
        "postgres://postgres@127.0.0.1:5432/idemproxy"
    );
    assert_eq!(dev.routes.len(), 1);
    assert_eq!(dev.routes[0].path_prefix, "/");
    assert_eq!(dev.routes[0].policy.lease, secs(5));
}
