//! The group commit's lanes, on a fresh database of the test server (as
//! `scripts/dev test` exports it, else the local server).

use std::sync::atomic::Ordering::Relaxed;
use std::time::Duration;

use super::super::{ClaimResult, Store, StoredResponse};
use crate::config::StoreConfig;
use crate::idempotency::{Fingerprint, IdempotencyKey, OwnerToken, RecordKey, TenantId};
use crate::workers::set_lane;

/// A migrated database of its own, dropped at the end of the test.
struct FreshDb {
    admin: tokio_postgres::Client,
    name: String,
    url: String,
}

impl FreshDb {
    async fn new(tag: &str) -> FreshDb {
        let admin_url = std::env::var("IDEMPROXY_TEST_DATABASE_URL")
            .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".into());
        let (admin, conn) = tokio_postgres::connect(&admin_url, tokio_postgres::NoTls)
            .await
            .expect("the test database server");
        tokio::spawn(conn);
        let name = format!("idemproxy_unit_{tag}_{}", std::process::id());
        // Two statements: neither runs in a transaction block.
        let drop = format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)");
        admin.batch_execute(&drop).await.unwrap();
        let create = format!("CREATE DATABASE {name}");
        admin.batch_execute(&create).await.unwrap();
        // The admin URL with the database's name in place of its own.
        let (base, query) = admin_url
            .split_once('?')
            .map_or((admin_url.as_str(), None), |(b, q)| (b, Some(q)));
        let base = base.rsplit_once('/').map_or(base, |(b, _)| b);
        let url = format!(
            "{base}/{name}{}",
            query.map_or(String::new(), |q| format!("?{q}"))
        );
        FreshDb { admin, name, url }
    }

    fn config(&self, pool_size: usize) -> StoreConfig {
        StoreConfig::for_test(&self.url, pool_size, Duration::from_secs(5))
    }

    async fn drop(self, store: Store) {
        drop(store);
        let sql = format!("DROP DATABASE IF EXISTS {} WITH (FORCE)", self.name);
        self.admin.batch_execute(&sql).await.unwrap();
    }
}

/// The items each lane's claim batcher carried: the main set, then each
/// worker's (`None`: never started).
fn claims_by_lane(store: &Store) -> (u64, Vec<Option<u64>>) {
    let b = store.batch.as_ref().expect("batchers in a runtime");
    let items = |set: &super::LaneBatchers| set.claims.stats().items.load(Relaxed);
    (
        items(&b.main),
        b.workers.iter().map(|w| w.get().map(items)).collect(),
    )
}

// A burst of new keys on worker 1 (two workers: three lanes) is claimed,
// batched and completed by worker 1's own set, started on its thread; the
// main set and worker 0's carry nothing.
#[tokio::test]
async fn a_workers_claims_and_completions_batch_in_its_own_lane() {
    let db = FreshDb::new("lanes").await;
    let store = Store::with_lanes(&db.config(8), 3).unwrap();
    store.migrate().await.unwrap();
    let fp = Fingerprint::from_bytes(&[7; 32]).unwrap();
    let (lease, retention) = (Duration::from_secs(30), Duration::from_secs(3600));
    let response = StoredResponse {
        status: 201,
        headers: Vec::new(),
        body: Some("done".into()),
    };
    set_lane(Some(1));
    let keys: Vec<RecordKey> = (0..32)
        .map(|i| {
            let key = IdempotencyKey::parse(format!("lane-{i}").as_bytes(), 255).unwrap();
            RecordKey::new(TenantId::none(), key)
        })
        .collect();
    let outcomes = futures_util::future::join_all(keys.iter().map(|record| {
        let (store, response) = (&store, &response);
        async move {
            let owner = OwnerToken::mint();
            match store.claim(record, &fp, owner, lease, retention).await? {
                ClaimResult::Claimed(_) => {}
                other => panic!("{record:?}: not claimed: {other:?}"),
            }
            store
                .complete(record, owner, response, retention, None)
                .await
        }
    }))
    .await;
    set_lane(None);
    for outcome in outcomes {
        assert!(outcome.unwrap().is_some(), "a completion was fenced off");
    }
    let (main, workers) = claims_by_lane(&store);
    assert_eq!((main, &workers[..]), (0, &[None, Some(32)][..]));
    let stats = store.batch_stats();
    let (_, claim_batches, claims, _) = stats[0];
    let (_, complete_batches, completions, _) = stats[1];
    assert_eq!((claims, completions), (32, 32));
    assert!(
        claim_batches < 32 && complete_batches < 32,
        "no company within the lane: {stats:?}"
    );
    // Off the workers (the main runtime), the main set.
    let record = RecordKey::new(
        TenantId::none(),
        IdempotencyKey::parse(b"main", 255).unwrap(),
    );
    let claimed = store
        .claim(&record, &fp, OwnerToken::mint(), lease, retention)
        .await
        .unwrap();
    assert!(matches!(claimed, ClaimResult::Claimed(_)), "{claimed:?}");
    assert_eq!(claims_by_lane(&store).0, 1);
    db.drop(store).await;
}
