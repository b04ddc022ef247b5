//! Bad values and unknown keys: each reported with its line and key, all
//! at once.

use super::*;

#[test]
fn unknown_keys_in_several_sections_are_reported_together_with_their_lines() {
    let text = "\
[server]
listen = \"0.0.0.0:8080\"
lisen = \"0.0.0.0:8081\"

[store]
pool = 3

[[route]]
path_prefix = \"/a\"

[[route]]
path_prefix = \"/b\"
leese = \"1s\"

[extra]
x = 1
";
    let problems = problems(text);
    let expected = [
        ("server.lisen", 3),
        ("store.pool", 6),
        ("route[1].leese", 13),
        ("extra", 15),
    ];
    assert_eq!(problems.len(), expected.len(), "{problems:#?}");
    for (key, line) in expected {
        let p = problem(&problems, key);
        assert_eq!(p.line, Some(line), "{p:?}");
        assert!(p.message.contains("unknown key"), "{p:?}");
        assert_eq!(p.origin, "test.toml");
    }
    // In file order.
    let lines: Vec<_> = problems.iter().map(|p| p.line).collect();
    assert!(lines.windows(2).all(|w| w[0] <= w[1]), "{lines:?}");
}

#[test]
fn connection_limits_are_checked_with_the_other_server_keys() {
    let problems = problems(
        "[server]\nbody_read_timeout = \"0s\"\nmax_connections = 0\nh2_max_concurrent_streams = 10001\nidle_timeout = \"soon\"\n",
    );
    for (key, line) in [
        ("server.body_read_timeout", 2),
        ("server.max_connections", 3),
        ("server.h2_max_concurrent_streams", 4),
        ("server.idle_timeout", 5),
    ] {
        assert_eq!(problem(&problems, key).line, Some(line), "{key}");
    }
    assert_eq!(problems.len(), 4, "{problems:#?}");
    let config = parse_ok(
        "[server]\nbody_read_timeout = \"5s\"\nmax_connections = 1\nh2_max_concurrent_streams = 1\nidle_timeout = \"1s\"\n",
    );
    assert_eq!(config.server.body_read_timeout, secs(5));
    assert_eq!(config.server.max_connections, 1);
    assert_eq!(config.server.h2_max_concurrent_streams, 1);
    assert_eq!(config.server.idle_timeout, secs(1));
}

#[test]
fn unknown_keys_and_bad_values_are_reported_together() {
    let problems = problems("[server]\nbogus = 1\nshutdown_grace = \"soon\"\n");
    assert_eq!(problem(&problems, "server.bogus").line, Some(2));
    assert_eq!(problem(&problems, "server.shutdown_grace").line, Some(3));
}

#[test]
fn every_bad_value_is_reported_together() {
    let text = "\
[server]
listen = \"localhost\"
admin_listen = \"127.0.0.1:99999\"
max_request_body = \"1 parsec\"
shutdown_grace = \"10 parsecs\"
header_read_timeout = \"0s\"

[upstream]
url = \"ftp://example.com\"
connect_timeout = \"0ms\"
timeout = \"forever\"

[store]
database_url = \"mysql://root@db/app\"
pool_size = 2
timeout = \"0s\"
on_store_error = \"ignore\"

[sweeper]
interval = \"0s\"
batch_size = -5

[defaults]
key_header = \"Idempotency Key\"
methods = [\"post\", \"GET\", \"BAD METHOD\"]
key = \"sometimes\"
lease = \"50ms\"
max_key_length = 2000
fingerprint = \"xml\"
release_on = [429, 99, 600]
max_stored_response = \"lots\"
wait = \"-1s\"

[[route]]
path_prefix = \"v1\"
tenant_header = \"X Tenant\"
retention = \"0s\"
";
    let problems = problems(text);
    let expected = [
        ("server.listen", 2),
        ("server.admin_listen", 3),
        ("server.max_request_body", 4),
        ("server.shutdown_grace", 5),
        ("server.header_read_timeout", 6),
        ("upstream.url", 9),
        ("upstream.connect_timeout", 10),
        ("upstream.timeout", 11),
        ("store.database_url", 14),
        ("store.pool_size", 15),
        ("store.timeout", 16),
        ("store.on_store_error", 17),
        ("sweeper.interval", 20),
        ("sweeper.batch_size", 21),
        ("defaults.key_header", 24),
        ("defaults.methods[0]", 25),
        ("defaults.methods[2]", 25),
        ("defaults.key", 26),
        ("defaults.lease", 27),
        ("defaults.max_key_length", 28),
        ("defaults.fingerprint", 29),
        ("defaults.release_on[1]", 30),
        ("defaults.release_on[2]", 30),
        ("defaults.max_stored_response", 31),
        ("defaults.wait", 32),
        ("route[0].path_prefix", 35),
        ("route[0].tenant_header", 36),
        ("route[0].retention", 37),
    ];
    for (key, line) in expected {
        assert_eq!(problem(&problems, key).line, Some(line), "{key}");
    }
    assert_eq!(problems.len(), expected.len(), "{problems:#?}");
    let shutdown = problem(&problems, "server.shutdown_grace");
    assert!(
        shutdown
            .to_string()
            .starts_with("test.toml:5: server.shutdown_grace: invalid duration \"10 parsecs\": "),
        "{shutdown}"
    );
    assert!(problem(&problems, "defaults.methods[0]")
        .message
        .contains("\"POST\""));
}

#[test]
fn a_wrong_toml_type_is_reported_with_its_line_and_key() {
    let problems = problems("[server]\nlisten = \"0.0.0.0:1\"\n\n[store]\npool_size = \"x\"\n");
    assert_eq!(problems.len(), 1, "{problems:#?}");
    assert_eq!(problems[0].line, Some(5));
    assert_eq!(problems[0].key, "store.pool_size");

    let problems = self::problems("[[route]]\npath_prefix = \"/\"\n[[route]]\nlease = 10\n");
    assert_eq!(problems[0].line, Some(4));
    assert_eq!(problems[0].key, "route[1].lease");
}

#[test]
fn a_syntax_error_is_reported_with_its_line() {
    let problems = problems("[server]\nlisten = \"0.0.0.0:1\n");
    assert_eq!(problems.len(), 1, "{problems:#?}");
    assert_eq!(problems[0].line, Some(2));
}

#[test]
fn pool_sizes_below_three_are_refused_with_the_reason() {
    for n in [1, 2] {
        let problems = problems(&format!("[store]\npool_size = {n}\n"));
        let p = problem(&problems, "store.pool_size");
        assert!(p.message.contains("must be at least 3"), "{}", p.message);
        assert!(p.message.contains("renewals"), "{}", p.message);
    }
    assert_eq!(parse_ok("[store]\npool_size = 3\n").store.pool_size, 3);
}

#[test]
fn lease_not_shorter_than_retention_is_rejected() {
    let p = problems("[defaults]\nlease = \"1h\"\nretention = \"1h\"\n");
    assert_eq!(p.len(), 1, "{p:#?}");
    assert_eq!(p[0].key, "defaults.lease");
    assert_eq!(p[0].line, Some(2));

    // Against an inherited retention, reported on the route's own key.
    let p = problems("[defaults]\nretention = \"1m\"\n[[route]]\nlease = \"2m\"\n");
    assert_eq!(p.len(), 1, "{p:#?}");
    assert_eq!(p[0].key, "route[0].lease");
    assert_eq!(p[0].line, Some(4));

    let p = problems("[[route]]\nretention = \"5s\"\n");
    assert_eq!(p.len(), 1, "{p:#?}");
    assert_eq!(p[0].key, "route[0].retention");

    parse_ok("[defaults]\nlease = \"59s\"\nretention = \"1m\"\n");
}

#[test]
fn lease_below_100ms_is_rejected() {
    let p = problems("[defaults]\nlease = \"99ms\"\n");
    assert_eq!(p[0].key, "defaults.lease");
    parse_ok("[defaults]\nlease = \"100ms\"\n");
}

#[test]
fn tenant_rules_without_a_tenant_header_are_rejected() {
    let p =
        problems("[[route]]\npath_prefix = \"/\"\ntenant_required = true\ntenant_hash = true\n");
    assert_eq!(problem(&p, "route[0].tenant_required").line, Some(3));
    assert_eq!(problem(&p, "route[0].tenant_hash").line, Some(4));
    assert_eq!(p.len(), 2);
    parse_ok("[[route]]\npath_prefix = \"/\"\ntenant_required = false\n");
}

#[test]
fn a_route_behind_a_shorter_prefix_is_unreachable() {
    let p =
        problems("[[route]]\npath_prefix = \"/v1/\"\n[[route]]\npath_prefix = \"/v1/payments\"\n");
    assert_eq!(p.len(), 1, "{p:#?}");
    assert_eq!(p[0].key, "route[1].path_prefix");
    assert_eq!(p[0].line, Some(4));
    assert!(p[0].message.contains("route[0]"));

    // Checked even when the route has other problems.
    let p = problems(
        "[[route]]\npath_prefix = \"/v1/\"\n[[route]]\npath_prefix = \"/v1/x\"\nlease = \"soon\"\n",
    );
    assert_eq!(problem(&p, "route[1].path_prefix").line, Some(4));
    assert_eq!(problem(&p, "route[1].lease").line, Some(5));

    // Without a path_prefix of its own, the [[route]] header is named.
    let p = problems("[[route]]\npath_prefix = \"/\"\n\n[[route]]\nlease = \"5s\"\n");
    assert_eq!(p[0].key, "route[1].path_prefix");
    assert_eq!(p[0].line, Some(4));
}

#[test]
fn explicit_route_names_are_unique() {
    let p = problems("[[route]]\nname = \"x\"\npath_prefix = \"/a\"\n[[route]]\nname = \"x\"\npath_prefix = \"/b\"\n");
    assert_eq!(p.len(), 1, "{p:#?}");
    assert_eq!(p[0].key, "route[1].name");
    assert_eq!(p[0].line, Some(5));
}

#[test]
fn listen_and_admin_listen_must_differ_unless_port_zero() {
    let p = problems("[server]\nlisten = \"127.0.0.1:9000\"\nadmin_listen = \"127.0.0.1:9000\"\n");
    assert_eq!(p[0].key, "server.admin_listen");
    parse_ok("[server]\nlisten = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\n");
}

#[test]
fn upstream_url_must_be_absolute_http_with_a_host_and_no_query() {
    for bad in [
        "127.0.0.1:3000",
        "/relative",
        "ftp://host",
        "http://host/?q=1",
        "http://host/#frag",
        "http://host:99999",
        "http://",
    ] {
        let p = problems(&format!("[upstream]\nurl = {bad:?}\n"));
        assert_eq!(p.len(), 1, "{bad}: {p:#?}");
        assert_eq!(p[0].key, "upstream.url", "{bad}");
    }
    let p = problems("[upstream]\nurl = \"http://user:hunter2@host\"\n");
    assert!(!p[0].message.contains("hunter2"), "{p:?}");
    let config = parse_ok("[upstream]\nurl = \"https://legacy.internal:8443/api\"\n");
    assert_eq!(config.upstream.url.path(), "/api");
}

#[test]
fn database_url_accepts_postgres_urls_and_conninfo_strings() {
    for good in [
        "postgres://u@h/db",
        "postgresql://u:p@h:5432/db?sslmode=require",
        "host=db user=app dbname=app",
    ] {
        let config = parse_ok(&format!("[store]\ndatabase_url = {good:?}\n"));
        assert_eq!(config.store.database_url.expose(), good);
    }
    for bad in ["", "  ", "mysql://u@h/db", "db.internal:5432"] {
        let p = problems(&format!("[store]\ndatabase_url = {bad:?}\n"));
        assert_eq!(p[0].key, "store.database_url", "{bad:?}");
    }
}

#[test]
fn sweeper_pause_is_a_duration_and_zero_means_none() {
    let config = parse(
        "[sweeper]\npause = \"20ms\"\n",
        "p.toml",
        &Overrides::default(),
    )
    .unwrap();
    assert_eq!(config.sweeper.pause, Duration::from_millis(20));
    let config = parse(
        "[sweeper]\npause = \"0s\"\n",
        "p.toml",
        &Overrides::default(),
    )
    .unwrap();
    assert_eq!(config.sweeper.pause, Duration::ZERO);
    let err = parse(
        "[sweeper]\npause = \"soon\"\n",
        "p.toml",
        &Overrides::default(),
    )
    .unwrap_err();
    assert_eq!(err.problems.len(), 1, "{err}");
    assert_eq!(err.problems[0].key, "sweeper.pause");
    assert_eq!(err.problems[0].line, Some(2));
}
