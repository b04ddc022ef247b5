//! Operators' statements: the sweeper's batches, `keys show`, `keys list`
//! and `keys release`.

use std::time::{Duration, SystemTime};

use super::{millis, sql, Store, StoreError};
use crate::idempotency::KeyId;

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

/// What one sweeper batch did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SweepBatch {
    /// Records deleted.
    pub deleted: u64,
    /// The latest expiry among them (`None` when none was deleted): where
    /// the next batch of the pass starts.
    pub last_expiry: Option<SystemTime>,
}

impl Store {
    /// Deletes up to `limit` expired records, oldest first, starting at the
    /// expiry `from` (the previous batch's [`SweepBatch::last_expiry`]; `None`
    /// for the first batch of a pass).
    pub async fn sweep_batch(
        &self,
        limit: u32,
        from: Option<SystemTime>,
    ) -> Result<SweepBatch, StoreError> {
        self.bounded(async {
            let conn = self.conn().await?;
            let sweep = if self.citus(&conn).await? {
                &sql::SWEEP_CITUS
            } else {
                &sql::SWEEP
            };
            conn.batch_execute(sql::SWEEP_BEGIN).await?;
            let row = match conn.query_one(sweep, &[&i64::from(limit), &from]).await {
                Ok(row) => row,
                Err(e) => {
                    // Inside a failed transaction: not to be handed on.
                    conn.poison();
                    return Err(e);
                }
            };
            conn.batch_execute("COMMIT").await?;
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
            let conn = self.conn().await?;
            let row = conn
                .query_opt(&sql::SHOW, &[&tenant, &key, &with_body])
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
            let conn = self.conn().await?;
            let rows = conn
                .query(&sql::LIST, &[&state, &millis(older_than), &tenant, &limit])
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
    /// `None` when nothing was.
    pub async fn force_release(
        &self,
        tenant: &str,
        key: &str,
        force: bool,
    ) -> Result<Option<String>, StoreError> {
        self.bounded(async {
            let conn = self.conn().await?;
            let id = KeyId::of_stored(tenant, key).to_string();
            if self.citus(&conn).await? {
                // Routed to the key's worker: notified from here (see
                // force_release_plain.sql).
                let row = conn
                    .query_opt(&sql::FORCE_RELEASE_PLAIN, &[&tenant, &key, &force])
                    .await?;
                if row.is_some() {
                    conn.query(&sql::NOTIFY, &[&id]).await?;
                }
                return Ok(row.map(|r| r.get(0)));
            }
            let row = conn
                .query_opt(&sql::FORCE_RELEASE, &[&tenant, &key, &force, &id])
                .await?;
            Ok(row.map(|r| r.get(0)))
        })
        .await
    }
}
