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

    // Invalid, from the environment: reported, never echoed.
    let overrides = Overrides {
        database_url: Some(Secret::new(format!("app:{PASSWORD}@db"))),
        ..Overrides::default()
    };
    let err = parse("", "t.toml", &overrides).unwrap_err();
    assert_eq!(err.problems[0].origin, OVERRIDE_ORIGIN);
    assert_eq!(err.problems[0].key, "store.database_url");
    assert!(!err.to_string().contains(PASSWORD), "{err}");
}

#[test]
fn environment_overrides_the_file_and_flags_override_both() {
    let file = "[server]\nlisten = \"127.0.0.1:1000\"\nadmin_listen = \"127.0.0.1:1001\"\n\
                [store]\ndatabase_url = \"postgres://file@h/db\"\n";
    let env =
        env_overrides(|name| (name == DATABASE_URL_ENV).then(|| "postgres://env@h/db".to_string()));
    let flags = Overrides {
        listen: Some("127.0.0.1:2000".parse().unwrap()),
        ..Overrides::default()
    };

    let from_file = parse(file, "t.toml", &Overrides::default()).unwrap();
    assert_eq!(
        from_file.store.database_url.expose(),
        "postgres://file@h/db"
    );

    let with_env = parse(file, "t.toml", &env).unwrap();
    assert_eq!(with_env.store.database_url.expose(), "postgres://env@h/db");
    assert_eq!(with_env.server.listen, "127.0.0.1:1000".parse().unwrap());

    let with_both = parse(file, "t.toml", &Overrides::merge(env.clone(), flags)).unwrap();
    assert_eq!(with_both.store.database_url.expose(), "postgres://env@h/db");
    assert_eq!(with_both.server.listen, "127.0.0.1:2000".parse().unwrap());
    assert_eq!(
        with_both.server.admin_listen,
        "127.0.0.1:1001".parse().unwrap()
    );

    let flag_url = Overrides {
        database_url: Some(Secret::new("postgres://flag@h/db")),
        ..Overrides::default()
    };
    let flags_win = parse(file, "t.toml", &Overrides::merge(env, flag_url)).unwrap();
    assert_eq!(
        flags_win.store.database_url.expose(),
        "postgres://flag@h/db"
    );
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
fn env_overrides_reads_the_database_url_variable_only() {
    let seen = std::cell::RefCell::new(Vec::new());
    let overrides = env_overrides(|name| {
        seen.borrow_mut().push(name.to_string());
        Some("postgres://env@h/db".to_string())
    });
    assert_eq!(seen.into_inner(), [DATABASE_URL_ENV]);
    assert_eq!(
        overrides.database_url.unwrap().expose(),
        "postgres://env@h/db"
    );
    assert!(overrides.listen.is_none());
    assert!(env_overrides(|_| None).database_url.is_none());
    // Set but empty still overrides, and fails loudly.
    let empty = env_overrides(|_| Some(String::new()));
    let err = parse("", "t.toml", &empty).unwrap_err();
    assert_eq!(err.problems[0].key, "store.database_url");
}
