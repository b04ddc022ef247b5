//! The store: idempotency records in PostgreSQL, written only through
//! fenced statements.
//!
//! * `claim` is one statement and one round trip for both outcomes: it
//!   inserts the record for a new key (`ON CONFLICT DO NOTHING`, which takes
//!   no lock and writes nothing when the key exists) and otherwise returns
//!   the existing record, from which [`crate::idempotency::decide`] decides.
//!   A duplicate therefore costs one read and writes nothing.
//! * `take_over` replaces an expired owner (lease or retention) with a new
//!   owner token, fenced by the old token and the expiry condition.
//! * `complete`, `renew` and `release` are fenced by `(tenant, key, owner)`.
//! * Every time comparison uses the database's clock, so replicas with
//!   skewed clocks agree on who owns a lease.

//! * Every statement is bounded by `store.timeout` and a connection whose
//!   statement was cut off is closed, not reused; statements work with or
//!   without named prepared statements (poolers); connections are made host
//!   by host, each bounded (see `conn`).
//!
//! The SQL is in `sql/*.sql` ([`sql`]); the claim and completion paths in
//! `records`, batched by [`group_commit`]; the operators' statements in
//! `operator`; the schema in [`migrate`].
//!
//! # Citus
//!
//! On a Citus coordinator (the `citus` extension installed in the
//! database, detected once per store: `Flavor`) the records table is
//! distributed by `idempotency_key` ([`migrate`]) and every statement of the
//! request path filters by the whole primary key, so the coordinator routes
//! it to the one shard of its key. Four forms differ there
//! (docs/scale-out.md):
//!
//! * a claim is an insert and a read pipelined (Citus runs claim.sql's
//!   modifying CTE in steps, each a round trip to the worker);
//! * batches (claims, completions, renewals) are sent as single-row
//!   statements pipelined on one connection, each committing on its own
//!   shard, instead of one statement or transaction spanning shards;
//! * notifications are sent by the coordinator session after the write (a
//!   `pg_notify` inside a routed statement runs on the worker, whose
//!   listeners are not ours);
//! * the sweeper deletes by key without row locks (Citus refuses `FOR
//!   UPDATE` over several shards).

mod conn;
pub mod group_commit;
pub mod migrate;
pub mod notify;
mod operator;
mod pools;
mod records;
pub mod sql;
pub mod tls;

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use deadpool::managed::PoolError;
use thiserror::Error;

use crate::config::StoreConfig;
use crate::idempotency::{OwnerToken, RecordView};
use conn::{Conn, Connector, Manager};
pub use operator::{RecordDetails, RecordSummary, SweepBatch};
use pools::Pools;
pub use records::RenewItem;

/// Why a store operation failed. Messages never contain the database URL.
#[derive(Debug, Clone, Error)]
pub enum StoreError {
    /// The operation did not finish within `store.timeout`.
    #[error("store operation timed out after {0:?}")]
    Timeout(Duration),
    /// No connection could be had from the pool.
    #[error("no database connection: {0}")]
    Pool(String),
    /// The database answered with an error.
    #[error("database error: {0}")]
    Db(String),
    /// The database URL does not parse.
    #[error("invalid database URL: {0}")]
    Url(String),
    /// A migration could not be applied.
    #[error("migration failed: {0}")]
    Migration(String),
    /// A row did not hold what the schema promises.
    #[error("corrupt record: {0}")]
    Corrupt(String),
}

impl From<tokio_postgres::Error> for StoreError {
    fn from(e: tokio_postgres::Error) -> Self {
        StoreError::Db(describe_db_error(&e))
    }
}

/// A description of a driver error that names the cause (connection
/// refused, SQLSTATE and message) without the connection parameters.
pub(crate) fn describe_db_error(e: &tokio_postgres::Error) -> String {
    if let Some(db) = e.as_db_error() {
        return format!("{} ({})", db.message(), db.code().code());
    }
    let mut text = e.to_string();
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}

fn pool_error(e: PoolError<StoreError>) -> StoreError {
    match e {
        PoolError::Backend(e) => e,
        PoolError::Timeout(_) => {
            StoreError::Pool("timed out waiting for a database connection".into())
        }
        other => StoreError::Pool(other.to_string()),
    }
}

/// A response as stored and replayed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredResponse {
    /// HTTP status.
    pub status: u16,
    /// End-to-end headers in order, repeated headers as separate entries.
    pub headers: Vec<(String, Bytes)>,
    /// The body; `None` when it exceeded `max_stored_response` and was not
    /// stored.
    pub body: Option<Bytes>,
}

/// An owned claim on a key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Claim {
    /// This attempt's owner token.
    pub owner: OwnerToken,
    /// 1 for the first claim, +1 per takeover.
    pub attempt: i32,
    /// When the lease runs out unless renewed.
    pub lease_expires_at: SystemTime,
}

/// A record found for a key.
#[derive(Debug, Clone)]
pub struct Existing {
    /// What the decision needs.
    pub view: RecordView,
    /// The stored response (completed records whose fingerprint matched).
    pub response: Option<StoredResponse>,
    /// The database's clock when the record was read.
    pub now: SystemTime,
}

/// The result of [`Store::claim`].
#[derive(Debug, Clone)]
pub enum ClaimResult {
    /// The key was absent and is now ours.
    Claimed(Claim),
    /// The key has a record.
    Existing(Existing),
}

/// An owned claim being replaced after its owner's lease (or the record's
/// retention) ran out.
#[derive(Debug, Clone, Copy)]
pub enum Replace {
    /// Lease expired: attempt + 1, same fingerprint.
    TakeOver(OwnerToken),
    /// Past retention: a fresh record (attempt 1, the new fingerprint).
    Reclaim(OwnerToken),
}

/// The PostgreSQL-backed record store.
#[derive(Clone)]
pub struct Store {
    /// The pooled connections, one pool per lane (see `pools`).
    pools: Pools,
    batch: Option<Arc<records::Batchers>>,
    /// Direct connections: LISTEN and migrations (`listen_url`).
    direct: Arc<Connector>,
    timeout: Duration,
    flavor: Arc<Flavor>,
}

/// Plain PostgreSQL or a Citus coordinator, asked on first use and kept
/// (the extension is not dropped under a running proxy).
#[derive(Debug, Default)]
pub(crate) struct Flavor(std::sync::OnceLock<bool>);

impl Flavor {
    /// Whether `conn`'s database is a Citus coordinator.
    pub(crate) async fn citus(&self, conn: &Conn) -> Result<bool, StoreError> {
        if let Some(&citus) = self.0.get() {
            return Ok(citus);
        }
        let citus: bool = conn.query_one(&sql::IS_CITUS, &[]).await?.get(0);
        let _ = self.0.set(citus);
        Ok(citus)
    }
}

fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

impl Store {
    /// Builds the pool. Connects lazily: a database that is down does not
    /// stop the process from starting.
    pub fn new(config: &StoreConfig) -> Result<Self, StoreError> {
        Self::with_lanes(config, 1)
    }

    /// Builds the pools for `lanes` lanes: the threads that are no worker
    /// and one per worker, sharing `store.pool_size` (see `pools`).
    /// Connects lazily, like [`new`](Self::new).
    pub fn with_lanes(config: &StoreConfig, lanes: usize) -> Result<Self, StoreError> {
        let pooled = connector(config.database_url.expose(), config)?;
        let direct = match &config.listen_url {
            Some(url) => connector(url.expose(), config)?,
            None => pooled.clone(),
        };
        let pools = Pools::new(
            || Manager {
                connector: pooled.clone(),
            },
            config.pool_size,
            lanes,
            config.timeout,
            config.prepared_statements,
        )?;
        let flavor = Arc::new(Flavor::default());
        let batch = records::Batchers::start(&pools, config, &flavor, lanes);
        Ok(Store {
            pools,
            batch,
            direct,
            timeout: config.timeout,
            flavor,
        })
    }

    /// A connection of its own, outside the pool, to `listen_url` (else the
    /// database URL): the LISTEN connection of [`crate::waiters`] and
    /// migrations, which need a session. The caller drives the returned
    /// connection.
    pub async fn connect_dedicated(
        &self,
    ) -> Result<
        (
            tokio_postgres::Client,
            tokio_postgres::Connection<tokio_postgres::Socket, tls::TlsStream>,
        ),
        StoreError,
    > {
        self.bounded(self.direct.connect()).await
    }

    /// Group-commit counters by operation: (op, statements sent, items
    /// carried, largest batch), since the process started.
    pub fn batch_stats(&self) -> Vec<(&'static str, u64, u64, u64)> {
        self.batch.as_ref().map_or_else(Vec::new, |b| b.stats())
    }

    /// Pool occupancy: (size, available, waiting).
    pub fn pool_status(&self) -> (usize, usize, usize) {
        self.pools.status()
    }

    /// The per-operation bound.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Runs `op` within `store.timeout`. A connection it took from the pool
    /// and was still using when the bound fired is closed (see `conn`).
    ///
    /// The operation is boxed here, when the call is made: an operation's
    /// future (a pool checkout, statements, the group-commit hand-off) runs
    /// to kilobytes, and unboxed it would be laid out inline in every
    /// caller's future, in every request's task, whether or not that branch
    /// ever runs (the peak memory of many requests in flight).
    fn bounded<T, F>(&self, op: F) -> impl std::future::Future<Output = Result<T, StoreError>>
    where
        F: std::future::Future<Output = Result<T, StoreError>>,
    {
        bounded(self.timeout, Box::pin(op))
    }

    async fn conn(&self) -> Result<Conn, StoreError> {
        self.pools.checkout().await
    }

    /// Whether the store is a Citus coordinator (asked over `conn` once).
    async fn citus(&self, conn: &Conn) -> Result<bool, StoreError> {
        self.flavor.citus(conn).await
    }

    /// Applies pending migrations, over a direct connection (`listen_url`):
    /// they hold an advisory lock in a transaction, which wants a session.
    pub async fn migrate(&self) -> Result<Vec<i32>, StoreError> {
        let (mut client, connection) = self.connect_dedicated().await?;
        let driver = tokio::spawn(connection);
        let out = migrate::run(&mut client).await;
        drop(client);
        driver.abort();
        out
    }

    /// Database reachable and schema current.
    pub async fn ready(&self) -> Result<bool, StoreError> {
        self.bounded(async {
            let conn = self.conn().await?;
            migrate::is_current(&conn).await
        })
        .await
    }
}

/// A connector for `url` with the store's settings: the application name,
/// the per-host bound, TLS as the URL's `sslmode` says.
fn connector(url: &str, config: &StoreConfig) -> Result<Arc<Connector>, StoreError> {
    // sslmode (libpq's, verify-ca/verify-full included) picks the
    // connector; see `tls`.
    let tls::Connection {
        config: mut pg,
        tls,
        ..
    } = tls::connection(url, config.ca_file.as_deref())?;
    if pg.get_application_name().is_none() {
        pg.application_name("idemproxy");
    }
    Ok(Arc::new(Connector::new(&pg, tls, config.timeout)))
}

/// `op`, answered with [`StoreError::Timeout`] once `timeout` has passed.
///
/// A combinator, not an `async fn`: an `async fn` keeps its argument and
/// the future it makes of it in separate slots of its state, so `op` would
/// take its room twice, and the batches' futures, moved into a box for
/// every statement, were some 12 KiB.
fn bounded<T>(
    timeout: Duration,
    op: impl std::future::Future<Output = Result<T, StoreError>>,
) -> impl std::future::Future<Output = Result<T, StoreError>> {
    use futures_util::FutureExt as _;
    // A timer per statement: one kept for reuse (crate::timer).
    crate::timer::timeout(timeout, op).map(move |r| match r {
        Ok(r) => r,
        Err(_) => Err(StoreError::Timeout(timeout)),
    })
}

impl From<crate::pg_url::UrlError> for StoreError {
    fn from(e: crate::pg_url::UrlError) -> Self {
        StoreError::Url(e.0)
    }
}
