//! Records read (and claimed) directly, beside the proxy: what a test
//! asserts on, or sets up as a crashed owner would have left it.

use std::time::Duration;

use idemproxy::store::Store;

use super::poll_until;

/// The record of one key, read directly from the database.
#[derive(Debug, Clone)]
pub struct Row {
    pub state: String,
    pub attempt: i32,
    pub owner: uuid::Uuid,
    pub lease_expired: Option<bool>,
    pub status: Option<i16>,
    pub body: Option<Vec<u8>>,
}

/// Holds the record of `key` (every tenant's) locked, `FOR UPDATE`, until
/// the returned transaction ends: what a stalled writer does to every
/// statement that would update it.
pub async fn lock_key<'c>(
    db: &'c mut tokio_postgres::Client,
    key: &str,
) -> tokio_postgres::Transaction<'c> {
    let tx = db.transaction().await.unwrap();
    tx.execute(
        "SELECT 1 FROM idempotency_records WHERE idempotency_key = $1 FOR UPDATE",
        &[&key],
    )
    .await
    .unwrap();
    tx
}

pub async fn read_row(db: &tokio_postgres::Client, tenant: &str, key: &str) -> Option<Row> {
    db.query_opt(
        "SELECT state, attempt, owner_token, lease_expires_at <= now(),
                response_status, response_body
           FROM idempotency_records WHERE tenant_id = $1 AND idempotency_key = $2",
        &[&tenant, &key],
    )
    .await
    .unwrap()
    .map(|r| Row {
        state: r.get(0),
        attempt: r.get(1),
        owner: r.get(2),
        lease_expired: r.get(3),
        status: r.get(4),
        body: r.get(5),
    })
}

/// Waits until the key's lease has run out by the database's clock.
pub async fn wait_lease_expired(db: &tokio_postgres::Client, key: &str, timeout: Duration) {
    let what = format!("the lease of {key} to run out");
    poll_until(timeout, what, || async {
        let row = read_row(db, "", key).await.expect("no record");
        if row.lease_expired == Some(true) {
            Ok(())
        } else {
            Err(format!("{row:?}"))
        }
    })
    .await
}

/// Claims `key` for `tenant` (as stored) directly through the store, as an
/// owner that never completes would: the record stays in flight.
pub async fn claim_in_flight(
    store: &Store,
    tenant: &str,
    key: &str,
    lease: Duration,
    retention: Duration,
) -> idemproxy::idempotency::OwnerToken {
    use idemproxy::idempotency::{
        Fingerprint, FingerprintMode, IdempotencyKey, OwnerToken, RecordKey, TenantId,
    };
    use idemproxy::store::ClaimResult;
    let fp = Fingerprint::compute(
        FingerprintMode::Bytes,
        "POST",
        "/",
        None,
        None,
        key.as_bytes(),
    );
    let owner = OwnerToken::mint();
    let result = store
        .claim(
            &RecordKey::new(
                TenantId::from_stored(tenant),
                IdempotencyKey::parse(key.as_bytes(), 255).unwrap(),
            ),
            &fp,
            owner,
            lease,
            retention,
        )
        .await
        .unwrap();
    assert!(
        matches!(result, ClaimResult::Claimed(_)),
        "{key} was already claimed"
    );
    owner
}
