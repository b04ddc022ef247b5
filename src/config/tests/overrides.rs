//! The environment and flags over the file, and the database URL as a
//! secret.

use super::*;

#[test]
fn database_url_that_the_driver_rejects_is_a_problem_without_echoing_it() {
    let overrides = Overrides {
        database_url: Some(Secret::new("postgres://u:pw@127.0.0.1:notaport/x")),
        ..Overrides::default()
    };
    let err = parse("", "t.toml", &overrides).unwrap_err();
    let text = err.to_string();
    assert!(text.contains("store.database_url"), "{text}");
    assert!(!text.contains("pw@"), "{text}");
}

#[test]
fn pooler_settings_default_to_prepared_statements_and_the_database_url() {
    let config = parse_ok("");
    assert!(config.store.prepared_statements);
    assert!(config.store.listen_url.is_none());
    let config = parse_ok(
        "[store]\nprepared_statements = false\nlisten_url = \"postgres://u:pw@db:5432/x\"\n",
    );
    assert!(!config.store.prepared_statements);
    assert_eq!(
        config.store.listen_url.as_ref().map(Secret::expose),
        Some("postgres://u:pw@db:5432/x")
    );
    assert!(!format!("{:?}", config.store).contains("pw@"));
    let problems = problems("[store]\nlisten_url = \"mysql://db/x\"\n");
    assert_eq!(problem(&problems, "store.listen_url").line, Some(2));
}

#[test]
fn the_database_url_never_shows_in_debug_display_or_problems() {
    const PASSWORD: &str = "s3cr3t-pa55";
    let url = format!("postgres://app:{PASSWORD}@db:5432/app");
    let secret = Secret::new(url.as_str());
    assert!(!format!("{secret:?}").contains(PASSWORD));
    assert!(!format!("{secret}").contains(PASSWORD));

    let config = parse_ok(&format!("[store]\ndatabase_url = {url:?}\n"));
    assert_eq!(config.store.database_url.expose(), url);
    assert!(!format!("{config:?}").contains(PASSWORD));
    assert!(!format!("{:?}", config.store).contains(PASSWORD));

    // Invalid, from the file: reported, never echoed.
    let bad = format!("mysql://app:{PASSWORD}@db/app");
    let err = parse(
        &format!("[store]\ndatabase_url = {bad:?}\n"),
        "t.toml",
        &Overrides::default(),
    )
    .unwrap_err();
    assert_eq!(err.problems[0].key, "store.database_url");
    assert!(!err.to_string().contains(PASSWORD), "{err}");
    assert!(!format!("{err:?}").contains(PASSWORD), "{err:?}");

    // Invalid, from a flag: reported, never echoed.
    let overrides = Overrides {
        database_url: Some(Secret::new(format!("app:{PASSWORD}@db"))),
        ..Overrides::default()
    };
    let err = parse("", "t.toml", &overrides).unwrap_err();
    assert_eq!(err.problems[0].origin, "--database-url");
    assert_eq!(err.problems[0].key, "store.database_url");
    assert!(!err.to_string().contains(PASSWORD), "{err}");

    // Invalid, from the environment: the variable is named, the value not.
    let bad = format!("app:{PASSWORD}@db");
    let env = Environment::from_pairs([(DATABASE_URL_ENV, bad.as_str())]);
    let err = parse_layers("", "t.toml", &env, &Overrides::default()).unwrap_err();
    assert_eq!(err.problems[0].origin, DATABASE_URL_ENV);
    assert_eq!(err.problems[0].key, "store.database_url");
    assert!(!err.to_string().contains(PASSWORD), "{err}");
}

#[test]
fn environment_overrides_the_file_and_flags_override_both() {
    let file = "[server]\nlisten = \"127.0.0.1:1000\"\nadmin_listen = \"127.0.0.1:1001\"\n\
                [store]\ndatabase_url = \"postgres://file@h/db\"\n";
    let env = Environment::from_pairs([
        (DATABASE_URL_ENV, "postgres://env@h/db"),
        ("IDEMPROXY_SERVER_LISTEN", "127.0.0.1:1500"),
    ]);
    let flags = Overrides {
        listen: Some("127.0.0.1:2000".parse().unwrap()),
        ..Overrides::default()
    };
    let none = Overrides::default();

    let from_file = parse(file, "t.toml", &none).unwrap();
    assert_eq!(
        from_file.store.database_url.expose(),
        "postgres://file@h/db"
    );

    let with_env = parse_layers(file, "t.toml", &env, &none).unwrap();
    assert_eq!(with_env.store.database_url.expose(), "postgres://env@h/db");
    assert_eq!(with_env.server.listen, "127.0.0.1:1500".parse().unwrap());
    assert_eq!(
        with_env.server.admin_listen,
        "127.0.0.1:1001".parse().unwrap()
    );

    let with_both = parse_layers(file, "t.toml", &env, &flags).unwrap();
    assert_eq!(with_both.store.database_url.expose(), "postgres://env@h/db");
    assert_eq!(with_both.server.listen, "127.0.0.1:2000".parse().unwrap());

    let flag_url = Overrides {
        database_url: Some(Secret::new("postgres://flag@h/db")),
        ..Overrides::default()
    };
    let flags_win = parse_layers(file, "t.toml", &env, &flag_url).unwrap();
    assert_eq!(
        flags_win.store.database_url.expose(),
        "postgres://flag@h/db"
    );
}

#[test]
fn every_section_key_can_come_from_the_environment() {
    let env = Environment::from_pairs([
        ("IDEMPROXY_UPSTREAM_URL", "http://upstream.internal:8000"),
        ("IDEMPROXY_STORE_POOL_SIZE", "5"),
        ("IDEMPROXY_STORE_PREPARED_STATEMENTS", "false"),
        ("IDEMPROXY_SWEEPER_INTERVAL", "5m"),
        ("IDEMPROXY_DEFAULTS_METHODS", "POST, PUT"),
        ("IDEMPROXY_DEFAULTS_RELEASE_ON", "429,503"),
        ("IDEMPROXY_DEFAULTS_LEASE", "20s"),
    ]);
    let file = "[defaults]\nlease = \"5s\"\n[[route]]\npath_prefix = \"/a\"\n\
                [[route]]\npath_prefix = \"/b\"\nlease = \"40s\"\n";
    let config = parse_layers(file, "t.toml", &env, &Overrides::default()).unwrap();
    assert_eq!(config.upstream.url, "http://upstream.internal:8000");
    assert_eq!(config.store.pool_size, 5);
    assert!(!config.store.prepared_statements);
    assert_eq!(config.sweeper.interval, std::time::Duration::from_secs(300));
    let policy = &config.routes[0].policy;
    assert_eq!(policy.methods, [http::Method::POST, http::Method::PUT]);
    assert_eq!(policy.release_on, [429, 503]);
    // [defaults] from the environment beats the file's [defaults]; a
    // route's own value (in the file) still beats [defaults].
    assert_eq!(policy.lease, std::time::Duration::from_secs(20));
    assert_eq!(
        config.routes[1].policy.lease,
        std::time::Duration::from_secs(40)
    );
}

#[test]
fn a_bad_value_from_the_environment_names_its_variable() {
    let env = Environment::from_pairs([
        ("IDEMPROXY_STORE_POOL_SIZE", "1"),
        ("IDEMPROXY_DEFAULTS_METHODS", "POST,get"),
        ("IDEMPROXY_SERVER_SHUTDOWN_GRACE", "soon"),
    ]);
    let err = parse_layers(
        "[server]\nlisten = \"nonsense\"\n",
        "t.toml",
        &env,
        &Overrides::default(),
    )
    .unwrap_err();
    let lines: Vec<String> = err.problems.iter().map(ToString::to_string).collect();
    assert_eq!(lines.len(), 4, "{err}");
    assert!(lines[0].starts_with("t.toml:2: server.listen: "), "{err}");
    for expected in [
        "IDEMPROXY_STORE_POOL_SIZE: store.pool_size: must be at least 3",
        "IDEMPROXY_DEFAULTS_METHODS: defaults.methods[1]: methods are case-sensitive",
        "IDEMPROXY_SERVER_SHUTDOWN_GRACE: server.shutdown_grace: invalid duration",
    ] {
        assert!(
            lines.iter().any(|l| l.starts_with(expected)),
            "{expected}\n{err}"
        );
    }
}

#[test]
fn a_file_variable_reads_its_file_without_one_trailing_newline() {
    let dir = std::env::temp_dir().join(format!("idemproxy-env-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let secret = dir.join("db-url");
    std::fs::write(&secret, "postgres://app:pw@db/app\n").unwrap();
    let name = secret.display().to_string();
    let env = Environment::from_pairs([("IDEMPROXY_STORE_DATABASE_URL_FILE", name.as_str())]);
    let config = parse_layers("", "t.toml", &env, &Overrides::default()).unwrap();
    assert_eq!(
        config.store.database_url.expose(),
        "postgres://app:pw@db/app"
    );

    let missing = dir.join("missing").display().to_string();
    let env = Environment::from_pairs([("IDEMPROXY_UPSTREAM_URL_FILE", missing.as_str())]);
    let err = parse_layers("", "t.toml", &env, &Overrides::default()).unwrap_err();
    assert_eq!(err.problems[0].origin, "IDEMPROXY_UPSTREAM_URL_FILE");
    assert!(
        err.problems[0].message.contains("cannot read the file"),
        "{err}"
    );

    let env = Environment::from_pairs([
        ("IDEMPROXY_UPSTREAM_URL", "http://a:1"),
        ("IDEMPROXY_UPSTREAM_URL_FILE", name.as_str()),
    ]);
    let err = parse_layers("", "t.toml", &env, &Overrides::default()).unwrap_err();
    assert!(err.to_string().contains("set only one"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn an_overridden_key_is_not_checked_in_the_file() {
    let overrides = Overrides {
        listen: Some("127.0.0.1:2000".parse().unwrap()),
        database_url: Some(Secret::new("postgres://env@h/db")),
        ..Overrides::default()
    };
    let config = parse(
        "[server]\nlisten = \"nonsense\"\n[store]\ndatabase_url = \"\"\n",
        "t.toml",
        &overrides,
    )
    .unwrap();
    assert_eq!(config.server.listen, "127.0.0.1:2000".parse().unwrap());
}

#[test]
fn merge_takes_the_later_value_per_field() {
    let a: SocketAddr = "127.0.0.1:1".parse().unwrap();
    let b: SocketAddr = "127.0.0.1:2".parse().unwrap();
    let earlier = Overrides {
        database_url: Some(Secret::new("postgres://earlier@h/db")),
        listen: Some(a),
        admin_listen: Some(a),
    };
    let later = Overrides {
        listen: Some(b),
        ..Overrides::default()
    };
    let merged = Overrides::merge(earlier, later);
    assert_eq!(merged.listen, Some(b));
    assert_eq!(merged.admin_listen, Some(a));
    assert_eq!(
        merged.database_url.unwrap().expose(),
        "postgres://earlier@h/db"
    );
}

#[test]
fn an_empty_variable_still_overrides_and_fails_loudly() {
    let env = Environment::from_pairs([(DATABASE_URL_ENV, "")]);
    let err = parse_layers(
        "[store]\ndatabase_url = \"postgres://file@h/db\"\n",
        "t.toml",
        &env,
        &Overrides::default(),
    )
    .unwrap_err();
    assert_eq!(err.problems[0].key, "store.database_url");
    assert_eq!(err.problems[0].origin, DATABASE_URL_ENV);
}
