//! `idemproxy --version`, `migrate --status` and `migrate --dry-run`, run as
//! the real binary against a real PostgreSQL (docs/operations.md,
//! "Upgrades and compatibility").

mod support;

use support::db::TestDb;

use support::cli::Output;

/// Runs `idemproxy ARGS` against `db` (at most 20 s).
async fn idemproxy(args: &[&str], db: Option<&TestDb>) -> Output {
    match db {
        Some(db) => support::cli::run(args, &[("IDEMPROXY_DATABASE_URL", db.url.as_str())]).await,
        None => support::cli::run(args, &[]).await,
    }
}

async fn table_exists(db: &TestDb, table: &str) -> bool {
    db.client()
        .await
        .query_one("SELECT to_regclass($1) IS NOT NULL", &[&table])
        .await
        .unwrap()
        .get(0)
}

#[tokio::test]
async fn version_names_the_release_and_the_commit_it_was_built_from() {
    let out = idemproxy(&["--version"], None).await;
    assert_eq!(out.code, Some(0), "{}", out.both());
    let line = out.stdout.trim();
    let expected = format!("idemproxy {} (commit ", env!("CARGO_PKG_VERSION"));
    assert!(line.starts_with(&expected), "{line}");
    let (commit, pgo) = line
        .strip_prefix(&expected)
        .and_then(|r| r.strip_suffix(')'))
        .and_then(|r| r.split_once(", pgo "))
        .unwrap_or_else(|| panic!("{line}"));
    assert!(
        commit == "unknown" || (commit.len() >= 7 && commit.chars().all(|c| c.is_ascii_hexdigit())),
        "{line}"
    );
    // The tests' debug build gets no profile (scripts/rustflags.sh gives
    // it to release builds only).
    assert_eq!(pgo, "none", "{line}");
    // Subcommands say the same.
    let sub = idemproxy(&["migrate", "--version"], None).await;
    assert_eq!(
        sub.stdout.trim(),
        format!("idemproxy-migrate {}", &line[10..])
    );
}

#[tokio::test]
async fn status_on_an_empty_database_lists_every_migration_pending_exits_3_and_writes_nothing() {
    let db = TestDb::new().await;
    let out = idemproxy(&["migrate", "--status"], Some(&db)).await;
    assert_eq!(out.code, Some(3), "{}", out.both());
    assert!(
        out.stdout
            .contains("pending   0001_idempotency_records.sql"),
        "{}",
        out.both()
    );
    assert!(
        out.stdout.contains("run `idemproxy migrate`"),
        "{}",
        out.both()
    );
    assert!(!table_exists(&db, "idemproxy_schema_migrations").await);
    assert!(!table_exists(&db, "idempotency_records").await);
}

#[tokio::test]
async fn dry_run_prints_the_sql_it_would_apply_and_writes_nothing() {
    let db = TestDb::new().await;
    let out = idemproxy(&["migrate", "--dry-run"], Some(&db)).await;
    assert_eq!(out.code, Some(0), "{}", out.both());
    assert!(
        out.stdout.contains("would apply 1 migration(s)"),
        "{}",
        out.both()
    );
    assert!(
        out.stdout.contains("CREATE TABLE idempotency_records"),
        "{}",
        out.both()
    );
    assert!(out.stdout.contains("nothing written"), "{}", out.both());
    assert!(!table_exists(&db, "idemproxy_schema_migrations").await);
    assert!(!table_exists(&db, "idempotency_records").await);

    // Once migrated, there is nothing to apply.
    let migrated = idemproxy(&["migrate"], Some(&db)).await;
    assert_eq!(migrated.code, Some(0), "{}", migrated.both());
    let again = idemproxy(&["migrate", "--dry-run"], Some(&db)).await;
    assert_eq!(again.code, Some(0), "{}", again.both());
    assert!(
        again.stdout.contains("nothing to apply"),
        "{}",
        again.both()
    );
}

#[tokio::test]
async fn status_after_migrate_is_current_and_exits_0() {
    let db = TestDb::new().await;
    assert_eq!(idemproxy(&["migrate"], Some(&db)).await.code, Some(0));
    let out = idemproxy(&["migrate", "--status"], Some(&db)).await;
    assert_eq!(out.code, Some(0), "{}", out.both());
    assert!(
        out.stdout
            .contains("applied   0001_idempotency_records.sql"),
        "{}",
        out.both()
    );
    assert!(
        out.stdout.contains("compatible with this binary"),
        "{}",
        out.both()
    );
}

#[tokio::test]
async fn a_later_releases_expand_step_is_compatible_but_its_contract_step_is_not() {
    let db = TestDb::new().await;
    assert_eq!(idemproxy(&["migrate"], Some(&db)).await.code, Some(0));
    let sql = db.client().await;
    // What a later release's `migrate` would have recorded.
    sql.batch_execute(
        "INSERT INTO idemproxy_schema_migrations (version, name, checksum, requires)
         VALUES (900, '0900_add_column.sql', '\\x00', 0)",
    )
    .await
    .unwrap();
    let expand = idemproxy(&["migrate", "--status"], Some(&db)).await;
    assert_eq!(expand.code, Some(0), "{}", expand.both());
    assert!(
        expand.stdout.contains("newer     0900_add_column.sql"),
        "{}",
        expand.both()
    );

    sql.batch_execute(
        "INSERT INTO idemproxy_schema_migrations (version, name, checksum, requires)
         VALUES (901, '0901_drop_column.sql', '\\x00', 900)",
    )
    .await
    .unwrap();
    let contract = idemproxy(&["migrate", "--status"], Some(&db)).await;
    assert_eq!(contract.code, Some(4), "{}", contract.both());
    assert!(
        contract.stdout.contains("requires migration 900"),
        "{}",
        contract.both()
    );
    assert!(
        contract.stdout.contains("NOT compatible"),
        "{}",
        contract.both()
    );
}

#[tokio::test]
async fn a_migration_applied_with_other_contents_is_incompatible_and_migrate_refuses() {
    let db = TestDb::new().await;
    assert_eq!(idemproxy(&["migrate"], Some(&db)).await.code, Some(0));
    db.client()
        .await
        .batch_execute(
            "UPDATE idemproxy_schema_migrations SET checksum = '\\x00' WHERE version = 1",
        )
        .await
        .unwrap();
    let status = idemproxy(&["migrate", "--status"], Some(&db)).await;
    assert_eq!(status.code, Some(4), "{}", status.both());
    assert!(status.stdout.contains("MODIFIED"), "{}", status.both());
    let dry = idemproxy(&["migrate", "--dry-run"], Some(&db)).await;
    assert_eq!(dry.code, Some(4), "{}", dry.both());
    let migrate = idemproxy(&["migrate"], Some(&db)).await;
    assert_eq!(migrate.code, Some(1), "{}", migrate.both());
    assert!(
        migrate.stderr.contains("applied with different contents"),
        "{}",
        migrate.both()
    );
}

#[tokio::test]
async fn status_of_an_unreachable_database_is_an_error_exit_1() {
    let out = idemproxy(
        &[
            "migrate",
            "--status",
            "--database-url",
            "postgres://postgres@127.0.0.1:1/none?connect_timeout=2",
        ],
        None,
    )
    .await;
    assert_eq!(out.code, Some(1), "{}", out.both());
}
