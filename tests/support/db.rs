//! Databases on the shared test server: a fresh one per test ([`TestDb`],
//! dropped with it), and direct connections for assertions.
//!
//! The server comes from `IDEMPROXY_TEST_DATABASE_URL` (an admin URL on
//! which `CREATE DATABASE` is allowed; `scripts/dev test` provides one),
//! defaulting to `postgres://postgres@127.0.0.1:5432/postgres`.

use std::sync::atomic::{AtomicU32, Ordering};

use tokio_postgres::NoTls;

/// The admin URL of the test PostgreSQL server.
pub fn admin_url() -> String {
    std::env::var("IDEMPROXY_TEST_DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".into())
}

/// Replaces the database name in a URL.
fn with_database(url: &str, db: &str) -> String {
    let (base, query) = match url.split_once('?') {
        Some((b, q)) => (b, Some(q)),
        None => (url, None),
    };
    let base = match base.rfind('/') {
        Some(i) if i > base.find("//").map_or(0, |j| j + 1) => &base[..i],
        _ => base,
    };
    match query {
        Some(q) => format!("{base}/{db}?{q}"),
        None => format!("{base}/{db}"),
    }
}

static COUNTER: AtomicU32 = AtomicU32::new(0);

/// A fresh database, dropped when the test ends.
pub struct TestDb {
    pub name: String,
    pub url: String,
}

/// The default collation of a test database.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DbLocale {
    /// The server's template (the test servers are `C`).
    Default,
    /// ICU en-US, as managed PostgreSQL's en_US.UTF-8 sorts text: `a` <
    /// `A` < `b` < `B`, where bytes say `A` < `B` < `a` < `b` (DESIGN §8.5).
    IcuEnUs,
}

impl DbLocale {
    /// `IDEMPROXY_TEST_DB_LOCALE`: unset or `default`, or `icu-en-US`
    /// (`scripts/dev test` runs the state machine a second time with it).
    pub fn from_env() -> DbLocale {
        match std::env::var("IDEMPROXY_TEST_DB_LOCALE").as_deref() {
            Err(_) | Ok("") | Ok("default") => DbLocale::Default,
            Ok("icu-en-US") => DbLocale::IcuEnUs,
            Ok(other) => panic!("IDEMPROXY_TEST_DB_LOCALE={other}: expected icu-en-US or default"),
        }
    }

    fn create_options(self) -> &'static str {
        match self {
            DbLocale::Default => "",
            // LOCALE 'C' sets only the libc categories, which ICU does not
            // use for collation; it exists on every machine.
            DbLocale::IcuEnUs => {
                " TEMPLATE template0 ENCODING 'UTF8' LOCALE_PROVIDER icu ICU_LOCALE 'en-US' LOCALE 'C'"
            }
        }
    }
}

impl TestDb {
    /// A fresh database with the collation of `IDEMPROXY_TEST_DB_LOCALE`.
    pub async fn new() -> TestDb {
        TestDb::with_locale(DbLocale::from_env()).await
    }

    pub async fn with_locale(locale: DbLocale) -> TestDb {
        let name = format!(
            "idemproxy_test_{}_{}_{}",
            std::process::id(),
            COUNTER.fetch_add(1, Ordering::SeqCst),
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .subsec_nanos()
        );
        let admin = admin_client().await;
        admin
            .batch_execute(&format!(
                "CREATE DATABASE {name}{}",
                locale.create_options()
            ))
            .await
            .expect("CREATE DATABASE (is IDEMPROXY_TEST_DATABASE_URL an admin URL?)");
        let url = with_database(&admin_url(), &name);
        let db = TestDb { name, url };
        if locale == DbLocale::IcuEnUs {
            // The database really sorts as en-US (not bytewise).
            let c = db.client().await;
            let order: String = c
                .query_one(
                    "SELECT string_agg(x, ' ' ORDER BY x) FROM unnest(ARRAY['B','a','b','A']) x",
                    &[],
                )
                .await
                .unwrap()
                .get(0);
            assert_eq!(order, "a A b B", "{} does not collate as en-US", db.name);
        }
        db
    }

    /// A direct connection, for assertions on what is stored.
    pub async fn client(&self) -> tokio_postgres::Client {
        connect(&self.url).await
    }
}

impl Drop for TestDb {
    fn drop(&mut self) {
        // Only the databases of this module (and of unique_database_name)
        // are dropped: a TestDb on a schema of a shared database (the
        // Citus tests) leaves that database alone.
        if !self.name.starts_with("idemproxy_test_") {
            return;
        }
        execute_blocking(
            admin_url(),
            format!("DROP DATABASE IF EXISTS {} WITH (FORCE)", self.name),
        );
    }
}

/// Runs `sql` on `url` to completion, ignoring its error, from anywhere a
/// test cannot await (a `Drop` inside the test's runtime): on a thread and
/// runtime of its own.
pub fn execute_blocking(url: String, sql: String) {
    let _ = std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            let _ = connect(&url).await.batch_execute(&sql).await;
        });
    })
    .join();
}

pub async fn connect(url: &str) -> tokio_postgres::Client {
    let (client, conn) = tokio_postgres::connect(url, NoTls)
        .await
        .unwrap_or_else(|e| panic!("connecting to the test database: {e}"));
    tokio::spawn(async move {
        let _ = conn.await;
    });
    client
}

async fn admin_client() -> tokio_postgres::Client {
    connect(&admin_url()).await
}

/// The URL of database `name` on the test server (which may not exist yet).
pub fn database_url(name: &str) -> String {
    with_database(&admin_url(), name)
}

/// A database name no other test uses (the database is not created).
pub fn unique_database_name(tag: &str) -> String {
    format!(
        "idemproxy_test_{tag}_{}_{}_{}",
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::SeqCst),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .subsec_nanos()
    )
}
