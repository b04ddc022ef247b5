//! The local Citus cluster (`scripts/citus`: a coordinator and two workers)
//! and a schema per test on it.
//!
//! Every Citus database needs the extension on each node and the workers
//! registered, a few seconds each; the tests therefore share the cluster's
//! one database and each gets a schema of its own: the proxy's URL sets
//! `search_path` to it (the store's SQL names its tables unqualified), so its
//! migration creates and distributes a records table there. Notifications
//! are per database: a test may hear another's, which only wakes a waiter
//! to re-read or drops a cache entry, never changes an answer.
//!
//! The cluster comes from `IDEMPROXY_TEST_CITUS_URL` (`scripts/dev test`
//! starts it and sets it). Unset under CI, a test fails naming what to run;
//! elsewhere it says it did not run.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::OnceLock;

use tokio::sync::RwLock;

use super::db::{connect, execute_blocking, TestDb};

/// The coordinator's URL, or `None` (outside CI) after saying why the test
/// does not run.
pub fn url(test: &str) -> Option<String> {
    match std::env::var("IDEMPROXY_TEST_CITUS_URL") {
        Ok(url) if !url.is_empty() => Some(url),
        _ => {
            let what = "IDEMPROXY_TEST_CITUS_URL is not set: start the local Citus cluster with \
                        `scripts/citus start` (as root it builds Citus first with \
                        scripts/install-citus) and export the URL it prints, or run \
                        `scripts/dev test`, which does both";
            if std::env::var_os("CI").is_some() {
                panic!("{test}: {what}");
            }
            eprintln!("{test}: NOT RUN: {what}");
            None
        }
    }
}

/// The worker-failure test stops a worker: it holds this for writing, every
/// other test for reading.
pub fn cluster_lock() -> &'static RwLock<()> {
    static LOCK: OnceLock<RwLock<()>> = OnceLock::new();
    LOCK.get_or_init(|| RwLock::new(()))
}

/// The database name in a `postgres://host:port/NAME` URL.
fn database_name(url: &str) -> String {
    let path = url.split('?').next().unwrap_or(url);
    path.rsplit('/').next().unwrap_or("").to_owned()
}

static COUNTER: AtomicU32 = AtomicU32::new(0);

/// A fresh schema on the cluster as a [`TestDb`]: `url` selects it with
/// `search_path`, `name` is the cluster's database (whose listeners
/// [`super::harness::Harness::wait_listener_since`] looks for). The schema
/// is dropped when the test ends, with [`Schema`].
pub async fn schema(cluster: &str, tag: &str) -> (TestDb, Schema) {
    static SWEPT: tokio::sync::OnceCell<()> = tokio::sync::OnceCell::const_new();
    // Schemas a killed earlier run left behind.
    SWEPT
        .get_or_init(|| async {
            let c = connect(cluster).await;
            let rows = c
                .query(
                    "SELECT nspname FROM pg_namespace WHERE nspname LIKE 'idemproxy\\_t\\_%'",
                    &[],
                )
                .await
                .unwrap();
            for r in rows {
                let name: String = r.get(0);
                let _ = c
                    .batch_execute(&format!("DROP SCHEMA IF EXISTS {name} CASCADE"))
                    .await;
            }
        })
        .await;
    let name = format!(
        "idemproxy_t_{tag}_{}_{}",
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::SeqCst)
    );
    let c = connect(cluster).await;
    c.batch_execute(&format!("CREATE SCHEMA {name}"))
        .await
        .unwrap_or_else(|e| panic!("CREATE SCHEMA {name} on the Citus cluster: {e}"));
    let sep = if cluster.contains('?') { '&' } else { '?' };
    let url = format!("{cluster}{sep}options=-csearch_path%3D{name}");
    let db = TestDb {
        name: database_name(cluster),
        url,
    };
    (
        db,
        Schema {
            cluster: cluster.to_owned(),
            name,
        },
    )
}

/// Drops its schema (and the distributed table in it) when dropped.
pub struct Schema {
    cluster: String,
    pub name: String,
}

impl Drop for Schema {
    fn drop(&mut self) {
        execute_blocking(
            self.cluster.clone(),
            format!("DROP SCHEMA IF EXISTS {} CASCADE", self.name),
        );
    }
}

/// The port of the worker holding `key`'s shard of the records table in
/// `schema`.
pub async fn worker_port_of(client: &tokio_postgres::Client, schema: &str, key: &str) -> i32 {
    client
        .query_one(
            "SELECT nodeport FROM citus_shards
              WHERE shardid = get_shard_id_for_distribution_column($1::text::regclass, $2::text)",
            &[&format!("{schema}.idempotency_records"), &key],
        )
        .await
        .unwrap_or_else(|e| panic!("locating the shard of {key:?}: {e:?}"))
        .get(0)
}

/// The ports of the cluster's workers, in order (worker 1 first).
pub async fn worker_ports(client: &tokio_postgres::Client) -> Vec<i32> {
    client
        .query(
            "SELECT nodeport FROM pg_dist_node WHERE noderole = 'primary' AND groupid > 0
              ORDER BY nodeport",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect()
}

/// Runs `scripts/citus ARGS` (stopping or starting a worker), panicking
/// with its output when it fails.
pub async fn script(args: &[&str]) {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/citus");
    let out = tokio::time::timeout(
        std::time::Duration::from_secs(90),
        tokio::process::Command::new(path)
            .args(args)
            .stdin(std::process::Stdio::null())
            .output(),
    )
    .await
    .unwrap_or_else(|_| panic!("scripts/citus {args:?} did not finish"))
    .expect("running scripts/citus");
    assert!(
        out.status.success(),
        "scripts/citus {args:?} failed:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}
