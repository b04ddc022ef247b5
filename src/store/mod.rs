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

pub mod batch;
pub mod migrate;
pub mod tls;

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use deadpool_postgres::{Manager, ManagerConfig, Pool, RecyclingMethod, Runtime};
use thiserror::Error;
use tokio_postgres::Row;

use crate::config::StoreConfig;
use crate::idempotency::{
    Fingerprint, IdempotencyKey, OwnerToken, RecordState, RecordView, TenantId,
};
use batch::Batcher;

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

fn pool_error(e: deadpool_postgres::PoolError) -> StoreError {
    match e {
        deadpool_postgres::PoolError::Backend(db) => StoreError::Pool(describe_db_error(&db)),
        deadpool_postgres::PoolError::Timeout(_) => {
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

/// Everything stored about a key, for operators.
#[derive(Debug, Clone)]
pub struct RecordDetails {
    /// The tenant as stored.
    pub tenant: String,
    /// The key.
    pub key: String,
    /// `in_flight` or `completed`.
    pub state: String,
    /// Attempt number.
    pub attempt: i32,
    /// Current owner.
    pub owner: uuid::Uuid,
    /// Hex fingerprint.
    pub fingerprint: String,
    /// Lease deadline (in flight).
    pub lease_expires_at: Option<SystemTime>,
    /// First claim (or reclaim).
    pub created_at: SystemTime,
    /// Completion.
    pub completed_at: Option<SystemTime>,
    /// Retention deadline.
    pub expires_at: SystemTime,
    /// Stored status.
    pub response_status: Option<i16>,
    /// Stored body size in bytes.
    pub response_body_len: Option<i64>,
    /// The body was too large to store.
    pub response_body_omitted: bool,
    /// The body itself, when asked for.
    pub response_body: Option<Vec<u8>>,
    /// The database clock at the time of reading.
    pub now: SystemTime,
}

/// One claim to renew.
#[derive(Debug, Clone)]
pub struct RenewItem {
    /// The tenant as stored.
    pub tenant: String,
    /// The key.
    pub key: String,
    /// Our owner token.
    pub owner: uuid::Uuid,
    /// The lease to extend to, in milliseconds from the database's now.
    pub lease_ms: i64,
}

/// One line of `idemproxy keys list`.
#[derive(Debug, Clone)]
pub struct RecordSummary {
    /// The tenant as stored.
    pub tenant: String,
    /// The key.
    pub key: String,
    /// `in_flight` or `completed`.
    pub state: String,
    /// Attempt number.
    pub attempt: i32,
    /// First claim.
    pub created_at: SystemTime,
    /// Lease deadline (in flight).
    pub lease_expires_at: Option<SystemTime>,
    /// Whether that lease is still valid.
    pub lease_valid: bool,
    /// Stored status (completed).
    pub response_status: Option<i16>,
}

const CLAIM_SQL: &str = "
WITH ins AS (
    INSERT INTO idempotency_records AS r
        (tenant_id, idempotency_key, fingerprint, owner_token, attempt, state,
         lease_expires_at, created_at, expires_at)
    VALUES ($1, $2, $3, $4, 1, 'in_flight',
            now() + $5::bigint * interval '1 millisecond', now(),
            now() + $6::bigint * interval '1 millisecond')
    ON CONFLICT (tenant_id, idempotency_key) DO NOTHING
    RETURNING owner_token, attempt, lease_expires_at
)
SELECT true AS claimed, owner_token, attempt, NULL::bytea AS fingerprint,
       NULL::text AS state, lease_expires_at, NULL::timestamptz AS expires_at,
       NULL::smallint AS response_status, NULL::text[] AS header_names,
       NULL::bytea[] AS header_values, NULL::bytea AS body,
       false AS body_omitted, now() AS now
  FROM ins
UNION ALL
SELECT false, owner_token, attempt, fingerprint, state, lease_expires_at, expires_at,
       response_status,
       CASE WHEN fingerprint = $3 THEN response_header_names END,
       CASE WHEN fingerprint = $3 THEN response_header_values END,
       CASE WHEN fingerprint = $3 THEN response_body END,
       response_body_omitted, now()
  FROM idempotency_records
 WHERE tenant_id = $1 AND idempotency_key = $2
   AND NOT EXISTS (SELECT 1 FROM ins)";

/// `CLAIM_SQL` for a batch of keys: one statement, one commit. Rows are
/// inserted in `(tenant, key)` order so concurrent batches never wait on
/// each other in opposite orders. A key claimed twice in one batch is
/// inserted once; the other item finds no row (the record is invisible to
/// the statement's snapshot) and is retried, as a racing claim would be.
const CLAIM_BATCH_SQL: &str = "
WITH req AS (
    SELECT *
      FROM unnest($1::text[], $2::text[], $3::bytea[], $4::uuid[], $5::bigint[], $6::bigint[])
           WITH ORDINALITY AS r(tenant_id, idempotency_key, fingerprint, owner_token,
                                lease_ms, retention_ms, i)
), ins AS (
    INSERT INTO idempotency_records AS t
        (tenant_id, idempotency_key, fingerprint, owner_token, attempt, state,
         lease_expires_at, created_at, expires_at)
    SELECT tenant_id, idempotency_key, fingerprint, owner_token, 1, 'in_flight',
           now() + lease_ms * interval '1 millisecond', now(),
           now() + retention_ms * interval '1 millisecond'
      FROM req
     ORDER BY tenant_id, idempotency_key
    ON CONFLICT (tenant_id, idempotency_key) DO NOTHING
    RETURNING owner_token, attempt, lease_expires_at
)
SELECT req.i, true AS claimed, ins.owner_token, ins.attempt, NULL::bytea AS fingerprint,
       NULL::text AS state, ins.lease_expires_at, NULL::timestamptz AS expires_at,
       NULL::smallint AS response_status, NULL::text[] AS header_names,
       NULL::bytea[] AS header_values, NULL::bytea AS body,
       false AS body_omitted, now() AS now
  FROM req JOIN ins ON ins.owner_token = req.owner_token
UNION ALL
SELECT req.i, false, r.owner_token, r.attempt, r.fingerprint, r.state,
       r.lease_expires_at, r.expires_at, r.response_status,
       CASE WHEN r.fingerprint = req.fingerprint THEN r.response_header_names END,
       CASE WHEN r.fingerprint = req.fingerprint THEN r.response_header_values END,
       CASE WHEN r.fingerprint = req.fingerprint THEN r.response_body END,
       r.response_body_omitted, now()
  FROM req
  JOIN idempotency_records r
    ON r.tenant_id = req.tenant_id AND r.idempotency_key = req.idempotency_key
 WHERE NOT EXISTS (SELECT 1 FROM ins WHERE ins.owner_token = req.owner_token)";

const TAKE_OVER_SQL: &str = "
UPDATE idempotency_records
   SET owner_token = $4, attempt = attempt + 1,
       lease_expires_at = now() + $6::bigint * interval '1 millisecond'
 WHERE tenant_id = $1 AND idempotency_key = $2 AND owner_token = $5
   AND fingerprint = $3
   AND state = 'in_flight' AND lease_expires_at <= now()
RETURNING attempt, lease_expires_at";

const RECLAIM_SQL: &str = "
UPDATE idempotency_records
   SET owner_token = $4, attempt = 1, fingerprint = $3, state = 'in_flight',
       lease_expires_at = now() + $6::bigint * interval '1 millisecond',
       created_at = now(), completed_at = NULL,
       expires_at = now() + $7::bigint * interval '1 millisecond',
       response_status = NULL, response_header_names = NULL,
       response_header_values = NULL, response_body = NULL,
       response_body_omitted = false
 WHERE tenant_id = $1 AND idempotency_key = $2 AND owner_token = $5
   AND expires_at <= now()
   AND (state = 'completed' OR lease_expires_at <= now())
RETURNING attempt, lease_expires_at";

const COMPLETE_SQL: &str = "
UPDATE idempotency_records
   SET state = 'completed', lease_expires_at = NULL, completed_at = now(),
       expires_at = now() + $4::bigint * interval '1 millisecond',
       response_status = $5, response_header_names = $6,
       response_header_values = $7, response_body = $8,
       response_body_omitted = $9
 WHERE tenant_id = $1 AND idempotency_key = $2 AND owner_token = $3
   AND state = 'in_flight'
RETURNING expires_at";

/// `COMPLETE_SQL` that also notifies waiters (`$10`: the key's channel id),
/// on routes where duplicates wait. NOTIFY serialises committing
/// transactions on a global lock, so routes without waiters skip it.
const COMPLETE_NOTIFY_SQL: &str = "
WITH done AS (
UPDATE idempotency_records
   SET state = 'completed', lease_expires_at = NULL, completed_at = now(),
       expires_at = now() + $4::bigint * interval '1 millisecond',
       response_status = $5, response_header_names = $6,
       response_header_values = $7, response_body = $8,
       response_body_omitted = $9
 WHERE tenant_id = $1 AND idempotency_key = $2 AND owner_token = $3
   AND state = 'in_flight'
RETURNING expires_at)
SELECT expires_at, pg_notify('idemproxy_keys', $10) FROM done";

const RENEW_SQL: &str = "
UPDATE idempotency_records
   SET lease_expires_at = now() + $4::bigint * interval '1 millisecond'
 WHERE tenant_id = $1 AND idempotency_key = $2 AND owner_token = $3
   AND state = 'in_flight'";

/// `RENEW_SQL` for every due claim of this process at once. Rows are
/// locked in `(tenant, key)` order first, like every batch, so renewals and
/// batched completions never wait on each other in opposite orders.
const RENEW_BATCH_SQL: &str = "
WITH u AS (
    SELECT *
      FROM unnest($1::text[], $2::text[], $3::uuid[], $4::bigint[])
           WITH ORDINALITY AS u(tenant_id, idempotency_key, owner_token, lease_ms, i)
), locked AS (
    SELECT t.tenant_id, t.idempotency_key, u.lease_ms, u.i
      FROM idempotency_records t
      JOIN u ON t.tenant_id = u.tenant_id AND t.idempotency_key = u.idempotency_key
            AND t.owner_token = u.owner_token
     WHERE t.state = 'in_flight'
     ORDER BY t.tenant_id, t.idempotency_key
       FOR UPDATE OF t
)
UPDATE idempotency_records t
   SET lease_expires_at = now() + locked.lease_ms * interval '1 millisecond'
  FROM locked
 WHERE t.tenant_id = locked.tenant_id AND t.idempotency_key = locked.idempotency_key
RETURNING locked.i";

const RELEASE_SQL: &str = "
DELETE FROM idempotency_records
 WHERE tenant_id = $1 AND idempotency_key = $2 AND owner_token = $3
   AND state = 'in_flight'";

const RELEASE_NOTIFY_SQL: &str = "
WITH gone AS (
DELETE FROM idempotency_records
 WHERE tenant_id = $1 AND idempotency_key = $2 AND owner_token = $3
   AND state = 'in_flight'
RETURNING 1)
SELECT pg_notify('idemproxy_keys', $4) FROM gone";

/// One sweeper batch: the oldest expired rows at or after `$2` (the latest
/// expiry the previous batch of the pass deleted; NULL for the first), locked
/// (`SKIP LOCKED`: replicas split the work) and deleted by `ctid`, which is
/// stable while the lock is held. Starting at `$2` keeps each batch from
/// walking the index entries of the rows the pass already deleted, which
/// nothing can remove while an older snapshot is open; the `ctid` join
/// spares a primary-key probe per row (docs/retention.md). Returns how many
/// rows went and the latest expiry among them.
const SWEEP_SQL: &str = "
WITH gone AS (
DELETE FROM idempotency_records
 WHERE ctid = ANY (ARRAY(
        SELECT ctid
          FROM idempotency_records
         WHERE expires_at >= coalesce($2::timestamptz, '-infinity')
           AND expires_at <= now()
           AND (state = 'completed' OR lease_expires_at <= now())
         ORDER BY expires_at
         LIMIT $1
         FOR UPDATE SKIP LOCKED))
RETURNING expires_at)
SELECT count(*), max(expires_at) FROM gone";

/// Run before `SWEEP_SQL` in its transaction: the pages a batch dirties are
/// handed to the kernel for writing as they leave shared buffers, not left
/// for it to write all at once some 30 s later (its dirty-page expiry), when
/// every commit of the claims would queue behind that burst. Without it a
/// swept backlog of 1M records stalled claims ~300 ms half a minute after
/// the sweep (docs/retention.md).
const SWEEP_FLUSH_SQL: &str = "SET LOCAL backend_flush_after = '256kB'";

const SHOW_SQL: &str = "
SELECT tenant_id, idempotency_key, state, attempt, owner_token, fingerprint,
       lease_expires_at, created_at, completed_at, expires_at, response_status,
       octet_length(response_body)::bigint, response_body_omitted,
       CASE WHEN $3 THEN response_body END, now()
  FROM idempotency_records
 WHERE tenant_id = $1 AND idempotency_key = $2";

/// What one sweeper batch did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SweepBatch {
    /// Records deleted.
    pub deleted: u64,
    /// The latest expiry among them (`None` when none was deleted): where
    /// the next batch of the pass starts.
    pub last_expiry: Option<SystemTime>,
}

/// The PostgreSQL-backed record store.
#[derive(Clone)]
pub struct Store {
    pool: Pool,
    batch: Option<Arc<Batchers>>,
    pg: tokio_postgres::Config,
    tls: tokio_postgres_rustls::MakeRustlsConnect,
    timeout: Duration,
}

fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

impl Store {
    /// Builds the pool. Connects lazily: a database that is down does not
    /// stop the process from starting.
    pub fn new(config: &StoreConfig) -> Result<Self, StoreError> {
        // sslmode (libpq's, verify-ca/verify-full included) picks the
        // connector; see `tls`.
        let tls::Connection {
            config: pg, tls, ..
        } = tls::connection(config.database_url.expose(), config.ca_file.as_deref())?;
        let mut pg = pg;
        if pg.get_application_name().is_none() {
            pg.application_name("idemproxy");
        }
        pg.connect_timeout(config.timeout);
        let manager = Manager::from_config(
            pg.clone(),
            tls.clone(),
            ManagerConfig {
                recycling_method: RecyclingMethod::Fast,
            },
        );
        let pool = Pool::builder(manager)
            .max_size(config.pool_size)
            .wait_timeout(Some(config.timeout))
            .create_timeout(Some(config.timeout))
            .recycle_timeout(Some(config.timeout))
            .runtime(Runtime::Tokio1)
            .build()
            .map_err(|e| StoreError::Pool(e.to_string()))?;
        let batch = Batchers::start(&pool, config.pool_size);
        Ok(Store {
            pool,
            batch,
            pg,
            tls,
            timeout: config.timeout,
        })
    }

    /// A connection of its own, outside the pool (the LISTEN connection of
    /// [`crate::waiters`]), made with the pool's settings and TLS. The
    /// caller drives the returned connection.
    pub async fn connect_dedicated(
        &self,
    ) -> Result<
        (
            tokio_postgres::Client,
            tokio_postgres::Connection<tokio_postgres::Socket, tls::TlsStream>,
        ),
        StoreError,
    > {
        self.bounded(async { Ok(self.pg.connect(self.tls.clone()).await?) })
            .await
    }

    /// Group-commit counters by operation: (op, statements sent, items
    /// carried, largest batch), since the process started.
    pub fn batch_stats(&self) -> Vec<(&'static str, u64, u64, u64)> {
        use std::sync::atomic::Ordering::Relaxed;
        let Some(b) = &self.batch else {
            return Vec::new();
        };
        [
            ("claim", b.claims.stats()),
            ("complete", b.completions.stats()),
        ]
        .into_iter()
        .map(|(op, s)| {
            (
                op,
                s.batches.load(Relaxed),
                s.items.load(Relaxed),
                s.largest.load(Relaxed),
            )
        })
        .collect()
    }

    /// Pool occupancy: (size, available, waiting).
    pub fn pool_status(&self) -> (usize, usize, usize) {
        let s = self.pool.status();
        (s.size, s.available, s.waiting)
    }

    /// The per-operation bound.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    async fn bounded<T, F>(&self, op: F) -> Result<T, StoreError>
    where
        F: std::future::Future<Output = Result<T, StoreError>>,
    {
        match tokio::time::timeout(self.timeout, op).await {
            Ok(r) => r,
            Err(_) => Err(StoreError::Timeout(self.timeout)),
        }
    }

    async fn client(&self) -> Result<deadpool_postgres::Object, StoreError> {
        self.pool.get().await.map_err(pool_error)
    }

    /// Claims a new key, or returns the record it already has.
    pub async fn claim(
        &self,
        tenant: &TenantId,
        key: &IdempotencyKey,
        fingerprint: &Fingerprint,
        owner: OwnerToken,
        lease: Duration,
        retention: Duration,
    ) -> Result<ClaimResult, StoreError> {
        self.bounded(async {
            // The statement sees the snapshot taken at its start: a record
            // committed by a racing claim after that instant makes the insert
            // do nothing yet stays invisible to the select. Running it again
            // takes a new snapshot that sees it.
            for _ in 0..3 {
                let item = ClaimItem {
                    tenant: tenant.as_str().to_owned(),
                    key: key.as_str().to_owned(),
                    fingerprint: *fingerprint.as_bytes(),
                    owner: owner.as_uuid(),
                    lease_ms: millis(lease),
                    retention_ms: millis(retention),
                };
                let out = match &self.batch {
                    Some(b) => b.claims.submit(item).await?,
                    None => exec_claims(self.pool.clone(), vec![item])
                        .await?
                        .pop()
                        .flatten(),
                };
                if let Some(result) = out {
                    return Ok(result);
                }
            }
            Err(StoreError::Db(
                "the claim found neither a record nor room for one".into(),
            ))
        })
        .await
    }

    /// Replaces an expired owner with `owner`. `None`: the record changed
    /// since it was read (someone else took over, or it completed).
    #[allow(clippy::too_many_arguments)]
    pub async fn replace(
        &self,
        tenant: &TenantId,
        key: &IdempotencyKey,
        fingerprint: &Fingerprint,
        owner: OwnerToken,
        replace: Replace,
        lease: Duration,
        retention: Duration,
    ) -> Result<Option<Claim>, StoreError> {
        self.bounded(async {
            let client = self.client().await?;
            let (sql, previous) = match replace {
                Replace::TakeOver(p) => (TAKE_OVER_SQL, p),
                Replace::Reclaim(p) => (RECLAIM_SQL, p),
            };
            let stmt = client.prepare_cached(sql).await?;
            let lease_ms = millis(lease);
            let retention_ms = millis(retention);
            let (tenant, key, fp, owner_id, prev) = (
                tenant.as_str(),
                key.as_str(),
                &fingerprint.as_bytes()[..],
                owner.as_uuid(),
                previous.as_uuid(),
            );
            let row = match replace {
                Replace::TakeOver(_) => {
                    client
                        .query_opt(&stmt, &[&tenant, &key, &fp, &owner_id, &prev, &lease_ms])
                        .await?
                }
                Replace::Reclaim(_) => {
                    client
                        .query_opt(
                            &stmt,
                            &[
                                &tenant,
                                &key,
                                &fp,
                                &owner_id,
                                &prev,
                                &lease_ms,
                                &retention_ms,
                            ],
                        )
                        .await?
                }
            };
            Ok(row.map(|r| Claim {
                owner,
                attempt: r.get(0),
                lease_expires_at: r.get(1),
            }))
        })
        .await
    }

    /// Stores the response; `None` if the fence refused it (lease lost),
    /// otherwise when the record expires.
    pub async fn complete(
        &self,
        tenant: &TenantId,
        key: &IdempotencyKey,
        owner: OwnerToken,
        response: &StoredResponse,
        retention: Duration,
        notify: Option<&str>,
    ) -> Result<Option<SystemTime>, StoreError> {
        self.bounded(async {
            let item = CompleteItem {
                tenant: tenant.as_str().to_owned(),
                key: key.as_str().to_owned(),
                owner: owner.as_uuid(),
                retention_ms: millis(retention),
                status: i16::try_from(response.status)
                    .map_err(|_| StoreError::Corrupt(format!("status {}", response.status)))?,
                response: response.clone(),
                notify: notify.map(str::to_owned),
            };
            match &self.batch {
                Some(b) => b.completions.submit(item).await,
                None => Ok(exec_completions(self.pool.clone(), vec![item])
                    .await?
                    .pop()
                    .flatten()),
            }
        })
        .await
    }

    /// Extends the lease; `false` if the fence refused it (lease lost).
    pub async fn renew(
        &self,
        tenant: &TenantId,
        key: &IdempotencyKey,
        owner: OwnerToken,
        lease: Duration,
    ) -> Result<bool, StoreError> {
        self.bounded(async {
            let client = self.client().await?;
            let stmt = client.prepare_cached(RENEW_SQL).await?;
            let n = client
                .execute(
                    &stmt,
                    &[
                        &tenant.as_str(),
                        &key.as_str(),
                        &owner.as_uuid(),
                        &millis(lease),
                    ],
                )
                .await?;
            Ok(n == 1)
        })
        .await
    }

    /// Renews many claims in one statement; for each, `false` if the fence
    /// refused it (lease lost).
    pub async fn renew_batch(&self, items: &[RenewItem]) -> Result<Vec<bool>, StoreError> {
        self.bounded(async {
            let client = self.client().await?;
            let stmt = client.prepare_cached(RENEW_BATCH_SQL).await?;
            let tenants: Vec<&str> = items.iter().map(|i| i.tenant.as_str()).collect();
            let keys: Vec<&str> = items.iter().map(|i| i.key.as_str()).collect();
            let owners: Vec<uuid::Uuid> = items.iter().map(|i| i.owner).collect();
            let leases: Vec<i64> = items.iter().map(|i| i.lease_ms).collect();
            let rows = client
                .query(&stmt, &[&tenants, &keys, &owners, &leases])
                .await?;
            let mut renewed = vec![false; items.len()];
            for row in rows {
                let i: i64 = row.get(0);
                if let Some(slot) = usize::try_from(i - 1).ok().and_then(|i| renewed.get_mut(i)) {
                    *slot = true;
                }
            }
            Ok(renewed)
        })
        .await
    }

    /// Deletes our in-flight claim; `false` if we no longer owned it.
    pub async fn release(
        &self,
        tenant: &TenantId,
        key: &IdempotencyKey,
        owner: OwnerToken,
        notify: Option<&str>,
    ) -> Result<bool, StoreError> {
        self.bounded(async {
            let client = self.client().await?;
            let (tenant, key, owner) = (tenant.as_str(), key.as_str(), owner.as_uuid());
            let n = match notify {
                None => {
                    let stmt = client.prepare_cached(RELEASE_SQL).await?;
                    client.execute(&stmt, &[&tenant, &key, &owner]).await?
                }
                Some(id) => {
                    let stmt = client.prepare_cached(RELEASE_NOTIFY_SQL).await?;
                    client
                        .query(&stmt, &[&tenant, &key, &owner, &id])
                        .await?
                        .len() as u64
                }
            };
            Ok(n == 1)
        })
        .await
    }

    /// Deletes up to `limit` expired records, oldest first, starting at the
    /// expiry `from` (the previous batch's [`SweepBatch::last_expiry`]; `None`
    /// for the first batch of a pass).
    pub async fn sweep_batch(
        &self,
        limit: u32,
        from: Option<SystemTime>,
    ) -> Result<SweepBatch, StoreError> {
        self.bounded(async {
            let mut client = self.client().await?;
            let tx = client.transaction().await?;
            tx.batch_execute(SWEEP_FLUSH_SQL).await?;
            let stmt = tx.prepare_cached(SWEEP_SQL).await?;
            let row = tx.query_one(&stmt, &[&i64::from(limit), &from]).await?;
            tx.commit().await?;
            Ok(SweepBatch {
                deleted: u64::try_from(row.get::<_, i64>(0)).unwrap_or(0),
                last_expiry: row.get(1),
            })
        })
        .await
    }

    /// Reads a record for operators.
    pub async fn show(
        &self,
        tenant: &str,
        key: &str,
        with_body: bool,
    ) -> Result<Option<RecordDetails>, StoreError> {
        self.bounded(async {
            let client = self.client().await?;
            let row = client
                .query_opt(SHOW_SQL, &[&tenant, &key, &with_body])
                .await?;
            Ok(row.map(|r| RecordDetails {
                tenant: r.get(0),
                key: r.get(1),
                state: r.get(2),
                attempt: r.get(3),
                owner: r.get(4),
                fingerprint: hex::encode(r.get::<_, Vec<u8>>(5)),
                lease_expires_at: r.get(6),
                created_at: r.get(7),
                completed_at: r.get(8),
                expires_at: r.get(9),
                response_status: r.get(10),
                response_body_len: r.get(11),
                response_body_omitted: r.get(12),
                response_body: r.get(13),
                now: r.get(14),
            }))
        })
        .await
    }

    /// Lists records for operators, oldest first: `state` (`in_flight`,
    /// `completed` or any), created at least `older_than` ago, optionally
    /// for one tenant, at most `limit`.
    pub async fn list(
        &self,
        state: Option<&str>,
        older_than: Duration,
        tenant: Option<&str>,
        limit: i64,
    ) -> Result<Vec<RecordSummary>, StoreError> {
        self.bounded(async {
            let client = self.client().await?;
            let rows = client
                .query(
                    "SELECT tenant_id, idempotency_key, state, attempt, created_at,
                            lease_expires_at, lease_expires_at > now(), response_status
                       FROM idempotency_records
                      WHERE ($1::text IS NULL OR state = $1)
                        AND created_at <= now() - $2::bigint * interval '1 millisecond'
                        AND ($3::text IS NULL OR tenant_id = $3)
                      ORDER BY created_at
                      LIMIT $4",
                    &[&state, &millis(older_than), &tenant, &limit],
                )
                .await?;
            Ok(rows
                .iter()
                .map(|r| RecordSummary {
                    tenant: r.get(0),
                    key: r.get(1),
                    state: r.get(2),
                    attempt: r.get(3),
                    created_at: r.get(4),
                    lease_expires_at: r.get(5),
                    lease_valid: r.get::<_, Option<bool>>(6).unwrap_or(false),
                    response_status: r.get(7),
                })
                .collect())
        })
        .await
    }

    /// Deletes a record for an operator: in-flight records always,
    /// completed ones only with `force`. Returns the state deleted, or
    /// `Err` naming why nothing was.
    pub async fn force_release(
        &self,
        tenant: &str,
        key: &str,
        force: bool,
    ) -> Result<Option<String>, StoreError> {
        self.bounded(async {
            let client = self.client().await?;
            let row = client
                .query_opt(
                    // Replicas drop the key from their response caches and
                    // wake its waiters.
                    "WITH gone AS (
                         DELETE FROM idempotency_records
                          WHERE tenant_id = $1 AND idempotency_key = $2
                            AND (state = 'in_flight' OR $3)
                      RETURNING state)
                     SELECT state, pg_notify('idemproxy_keys', $4) FROM gone",
                    &[
                        &tenant,
                        &key,
                        &force,
                        &crate::waiters::raw_key_id(tenant, key),
                    ],
                )
                .await?;
            Ok(row.map(|r| r.get(0)))
        })
        .await
    }

    /// Applies pending migrations.
    pub async fn migrate(&self) -> Result<Vec<i32>, StoreError> {
        let mut client = self.client().await?;
        migrate::run(&mut client).await
    }

    /// Database reachable and schema current.
    pub async fn ready(&self) -> Result<bool, StoreError> {
        self.bounded(async {
            let client = self.client().await?;
            migrate::is_current(&client).await
        })
        .await
    }
}

/// The batchers of one store (one set per process).
struct Batchers {
    claims: Batcher<ClaimItem, Option<ClaimResult>>,
    completions: Batcher<CompleteItem, Option<SystemTime>>,
}

impl Batchers {
    /// Starts the workers: a quarter of the pool each for claims and for
    /// completions, so reads, renewals and takeovers keep connections.
    /// `None` outside a tokio runtime (then every statement goes alone).
    fn start(pool: &Pool, pool_size: usize) -> Option<Arc<Batchers>> {
        tokio::runtime::Handle::try_current().ok()?;
        let workers = (pool_size / 4).max(1);
        let (p1, p2) = (pool.clone(), pool.clone());
        Some(Arc::new(Batchers {
            claims: Batcher::start(workers, MAX_BATCH, move |items| {
                exec_claims(p1.clone(), items)
            }),
            completions: Batcher::start(workers, MAX_BATCH, move |items| {
                exec_completions(p2.clone(), items)
            }),
        }))
    }
}

/// Most items in one batch (bounds statement size and lock hold time).
const MAX_BATCH: usize = 128;

/// One claim waiting for its batch.
struct ClaimItem {
    tenant: String,
    key: String,
    fingerprint: [u8; 32],
    owner: uuid::Uuid,
    lease_ms: i64,
    retention_ms: i64,
}

/// One completion waiting for its batch.
struct CompleteItem {
    tenant: String,
    key: String,
    owner: uuid::Uuid,
    retention_ms: i64,
    status: i16,
    response: StoredResponse,
    notify: Option<String>,
}

/// Runs a batch of claims as one statement. `None` for an item: neither
/// claimed nor visible yet (retry).
async fn exec_claims(
    pool: Pool,
    items: Vec<ClaimItem>,
) -> Result<Vec<Option<ClaimResult>>, StoreError> {
    let client = pool.get().await.map_err(pool_error)?;
    if let [item] = &items[..] {
        // Alone (light load): the plain single-key statement.
        let stmt = client.prepare_cached(CLAIM_SQL).await?;
        let rows = client
            .query(
                &stmt,
                &[
                    &item.tenant,
                    &item.key,
                    &&item.fingerprint[..],
                    &item.owner,
                    &item.lease_ms,
                    &item.retention_ms,
                ],
            )
            .await?;
        return Ok(vec![rows.first().map(claim_result).transpose()?]);
    }
    let stmt = client.prepare_cached(CLAIM_BATCH_SQL).await?;
    let tenants: Vec<&str> = items.iter().map(|i| i.tenant.as_str()).collect();
    let keys: Vec<&str> = items.iter().map(|i| i.key.as_str()).collect();
    let fps: Vec<&[u8]> = items.iter().map(|i| &i.fingerprint[..]).collect();
    let owners: Vec<uuid::Uuid> = items.iter().map(|i| i.owner).collect();
    let leases: Vec<i64> = items.iter().map(|i| i.lease_ms).collect();
    let retentions: Vec<i64> = items.iter().map(|i| i.retention_ms).collect();
    let rows = client
        .query(
            &stmt,
            &[&tenants, &keys, &fps, &owners, &leases, &retentions],
        )
        .await?;
    let mut out = vec![None; items.len()];
    for row in &rows {
        let i: i64 = row.get("i");
        let slot = usize::try_from(i - 1)
            .ok()
            .and_then(|i| out.get_mut(i))
            .ok_or_else(|| StoreError::Corrupt(format!("claim batch returned row {i}")))?;
        *slot = Some(claim_result(row)?);
    }
    Ok(out)
}

/// Runs a batch of completions in one transaction: each row the same
/// fenced UPDATE as alone, all pipelined (BEGIN, the updates and COMMIT
/// leave together: one round trip, one commit), in `(tenant, key)` order.
/// `None` for an item: the fence refused it (lease lost).
async fn exec_completions(
    pool: Pool,
    items: Vec<CompleteItem>,
) -> Result<Vec<Option<SystemTime>>, StoreError> {
    let client = pool.get().await.map_err(pool_error)?;
    let plain = client.prepare_cached(COMPLETE_SQL).await?;
    let notifying = if items.iter().any(|i| i.notify.is_some()) {
        Some(client.prepare_cached(COMPLETE_NOTIFY_SQL).await?)
    } else {
        None
    };
    struct Params<'a> {
        tenant: &'a str,
        key: &'a str,
        names: Vec<&'a str>,
        values: Vec<&'a [u8]>,
        body: Option<&'a [u8]>,
        omitted: bool,
        notify: Option<&'a str>,
    }
    let params: Vec<Params<'_>> = items
        .iter()
        .map(|i| Params {
            tenant: &i.tenant,
            key: &i.key,
            names: i.response.headers.iter().map(|(n, _)| n.as_str()).collect(),
            values: i.response.headers.iter().map(|(_, v)| &v[..]).collect(),
            body: i.response.body.as_deref(),
            omitted: i.response.body.is_none(),
            notify: i.notify.as_deref(),
        })
        .collect();
    let run = |idx: usize| {
        let (item, p) = (&items[idx], &params[idx]);
        let mut args: Vec<&(dyn tokio_postgres::types::ToSql + Sync)> = vec![
            &p.tenant,
            &p.key,
            &item.owner,
            &item.retention_ms,
            &item.status,
            &p.names,
            &p.values,
            &p.body,
            &p.omitted,
        ];
        let stmt = match (&p.notify, &notifying) {
            (Some(id), Some(stmt)) => {
                args.push(id);
                stmt
            }
            _ => &plain,
        };
        let client = &client;
        async move { client.query_opt(stmt, &args).await }
    };
    if items.len() == 1 {
        let row = run(0).await?;
        return Ok(vec![row.map(|r| r.get(0))]);
    }
    let mut order: Vec<usize> = (0..items.len()).collect();
    order.sort_by(|&a, &b| {
        (&items[a].tenant, &items[a].key).cmp(&(&items[b].tenant, &items[b].key))
    });
    // join3 polls in argument order, and each query is sent on its first
    // poll: BEGIN, the updates, COMMIT go out in that order.
    let (begin, rows, commit) = futures_util::future::join3(
        client.batch_execute("BEGIN"),
        futures_util::future::join_all(order.iter().map(|&i| run(i))),
        client.batch_execute("COMMIT"),
    )
    .await;
    begin?;
    let mut out = vec![None; items.len()];
    // An error in any row aborted the transaction (its COMMIT rolled
    // back): the batch failed as a whole.
    for (&idx, row) in order.iter().zip(rows) {
        out[idx] = row?.map(|r| r.get::<_, SystemTime>(0));
    }
    commit?;
    Ok(out)
}

fn claim_result(row: &Row) -> Result<ClaimResult, StoreError> {
    let owner = OwnerToken::from_uuid(row.get("owner_token"));
    let attempt: i32 = row.get("attempt");
    if row.get::<_, bool>("claimed") {
        return Ok(ClaimResult::Claimed(Claim {
            owner,
            attempt,
            lease_expires_at: row.get("lease_expires_at"),
        }));
    }
    let fp_bytes: Vec<u8> = row.get("fingerprint");
    let fingerprint = Fingerprint::from_bytes(&fp_bytes)
        .ok_or_else(|| StoreError::Corrupt("fingerprint is not 32 bytes".into()))?;
    let state: String = row.get("state");
    let state = match state.as_str() {
        "completed" => RecordState::Completed,
        "in_flight" => RecordState::InFlight {
            lease_expires_at: row
                .get::<_, Option<SystemTime>>("lease_expires_at")
                .ok_or_else(|| StoreError::Corrupt("in-flight record without a lease".into()))?,
        },
        other => return Err(StoreError::Corrupt(format!("unknown state {other:?}"))),
    };
    let response = match state {
        RecordState::Completed => {
            let status: Option<i16> = row.get("response_status");
            let names: Option<Vec<String>> = row.get("header_names");
            let values: Option<Vec<Vec<u8>>> = row.get("header_values");
            match (status, names, values) {
                (Some(status), Some(names), Some(values)) if names.len() == values.len() => {
                    let omitted: bool = row.get("body_omitted");
                    let body: Option<Vec<u8>> = row.get("body");
                    Some(StoredResponse {
                        status: u16::try_from(status)
                            .map_err(|_| StoreError::Corrupt(format!("status {status}")))?,
                        headers: names
                            .into_iter()
                            .zip(values.into_iter().map(Bytes::from))
                            .collect(),
                        body: if omitted {
                            None
                        } else {
                            Some(Bytes::from(body.unwrap_or_default()))
                        },
                    })
                }
                // Fingerprint differs: the response is not fetched.
                (Some(_), None, None) => None,
                _ => {
                    return Err(StoreError::Corrupt(
                        "completed record without a response".into(),
                    ))
                }
            }
        }
        RecordState::InFlight { .. } => None,
    };
    Ok(ClaimResult::Existing(Existing {
        view: RecordView {
            fingerprint,
            owner,
            attempt,
            state,
            expires_at: row.get("expires_at"),
        },
        response,
        now: row.get("now"),
    }))
}

/// The driver's URL parse errors may quote the URL; keep only a generic
/// description.
fn redacted_parse_error(e: &tokio_postgres::Error) -> String {
    let text = e.to_string();
    if text.contains("://") || text.contains('@') || text.contains("password") {
        "the URL could not be parsed (details withheld: they may contain the password)".into()
    } else {
        text
    }
}
