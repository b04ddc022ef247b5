//! The store on Citus (docs/scale-out.md): the local cluster of
//! `scripts/citus` (a coordinator and two workers), each test on a schema of
//! its own, the proxy connected to the coordinator.
//!
//! A named subset of the suites, chosen so that every statement form the
//! store sends on Citus runs at least once against a real cluster:
//!
//! * schema: the migration distributes the records table by key, once, from
//!   replicas migrating at once, and distributes an existing table with its
//!   rows;
//! * plans: every statement of the request path is routed to one shard;
//! * requests: new key, replay, 409, 422 through the coordinator, keys of
//!   one tenant on both workers; concurrent new keys (the pipelined group
//!   commit);
//! * state machine: takeover of an expired lease, renewal, reclaim after
//!   retention;
//! * waiting: a duplicate on another replica woken by the coordinator's
//!   NOTIFY, whichever worker holds the key;
//! * operations: `idemproxy sweep`, `keys list|show|release`;
//! * partial failure: a stopped worker fails its keys closed (503) while the
//!   other worker's keep working, and heals without a proxy restart.

mod support;

use std::time::{Duration, Instant};

use idemproxy::idempotency::{
    Fingerprint, FingerprintMode, IdempotencyKey, OwnerToken, RecordKey, TenantId,
};
use idemproxy::store::{ClaimResult, Replace, StoredResponse};
use support::citus;
use support::cli::run as idemproxy;
use support::harness::{Harness, Setup};
use support::http::{HttpClient, Req};

const PAY: &str = r#"{"amount": 100}"#;

/// The harness on a fresh schema of the cluster; `None` when the cluster is
/// not configured (outside CI: said on stderr).
async fn harness(test: &str, setup: Setup) -> Option<(Harness, citus::Schema)> {
    let cluster = citus::url(test)?;
    let (db, schema) = citus::schema(&cluster, test).await;
    Some((Harness::start_on(setup, db).await, schema))
}

fn record_key(tenant: &str, key: &str) -> RecordKey {
    RecordKey::new(
        TenantId::from_stored(tenant),
        IdempotencyKey::parse(key.as_bytes(), 255).unwrap(),
    )
}

fn fingerprint(body: &str) -> Fingerprint {
    Fingerprint::compute(
        FingerprintMode::Bytes,
        "POST",
        "/",
        None,
        None,
        body.as_bytes(),
    )
}

/// Keys whose shards are on worker `port`, found by asking the cluster.
async fn keys_on(
    c: &tokio_postgres::Client,
    schema: &str,
    prefix: &str,
    port: i32,
    n: usize,
) -> Vec<String> {
    let mut keys = Vec::new();
    for i in 0.. {
        let key = format!("{prefix}-{i}");
        if citus::worker_port_of(c, schema, &key).await == port {
            keys.push(key);
            if keys.len() == n {
                break;
            }
        }
        assert!(i < 1000, "no key of {prefix}-* on worker {port}");
    }
    keys
}

#[tokio::test]
async fn migrate_distributes_the_records_table_by_key_once_even_from_replicas_at_once() {
    let _shared = citus::cluster_lock().read().await;
    let test = "migrate_distributes";
    let Some(cluster) = citus::url(test) else {
        return;
    };
    let (db, schema) = citus::schema(&cluster, "migrate").await;
    let setup = Setup::default();
    let config = setup.config("http://127.0.0.1:1", &db.url);
    let stores: Vec<_> = (0..3)
        .map(|_| idemproxy::store::Store::new(&config.store).unwrap())
        .collect();
    let results = futures_util::future::join_all(stores.iter().map(|s| s.migrate())).await;
    for r in &results {
        r.as_ref().expect("a replica's migration");
    }
    let c = db.client().await;
    let table = format!("{}.idempotency_records", schema.name);
    let column: String = c
        .query_one(
            "SELECT column_to_column_name(logicalrelid, partkey) FROM pg_dist_partition
              WHERE logicalrelid = $1::text::regclass",
            &[&table],
        )
        .await
        .expect("the records table is distributed")
        .get(0);
    assert_eq!(column, "idempotency_key");
    let nodes: i64 = c
        .query_one(
            "SELECT count(DISTINCT nodeport) FROM citus_shards WHERE table_name = $1::text::regclass",
            &[&table],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(nodes, 2, "the shards are spread over both workers");
    // The indexes came along (the sweeper's and the operators').
    let indexes: i64 = c
        .query_one(
            "SELECT count(*) FROM pg_indexes WHERE schemaname = $1
              AND indexname IN ('idempotency_records_expires_at', 'idempotency_records_in_flight')",
            &[&schema.name],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(indexes, 2);

    // An existing, non-distributed table with rows: migrate distributes it,
    // rows included.
    c.batch_execute(&format!(
        "SELECT undistribute_table('{table}');
         INSERT INTO idempotency_records
            (tenant_id, idempotency_key, fingerprint, owner_token, attempt, state,
             lease_expires_at, created_at, expires_at, response_status)
         SELECT '', 'k-old-' || i, decode(repeat('00', 32), 'hex'), gen_random_uuid(), 1,
                'completed', NULL, now(), now() + interval '1 hour', 201
           FROM generate_series(1, 50) i"
    ))
    .await
    .unwrap();
    let local: bool = c
        .query_one(
            "SELECT NOT EXISTS (SELECT 1 FROM pg_dist_partition WHERE logicalrelid = $1::text::regclass)",
            &[&table],
        )
        .await
        .unwrap()
        .get(0);
    assert!(local, "undistributed for the test");
    stores[0]
        .migrate()
        .await
        .expect("migrate an existing table");
    let (distributed, rows): (bool, i64) = c
        .query_one(
            "SELECT EXISTS (SELECT 1 FROM pg_dist_partition WHERE logicalrelid = $1::text::regclass),
                    (SELECT count(*) FROM idempotency_records)",
            &[&table],
        )
        .await
        .map(|r| (r.get(0), r.get(1)))
        .unwrap();
    assert!(distributed);
    assert_eq!(rows, 50, "the rows moved to the shards");
}

/// The plan of `sql` with `args` (SQL literals) for its parameters: Citus
/// says how many shards ("tasks") it runs on.
async fn task_count(c: &tokio_postgres::Client, name: &str, sql: &str, args: &str) -> String {
    c.batch_execute(&format!("DEALLOCATE ALL; PREPARE {name} AS {sql}"))
        .await
        .unwrap_or_else(|e| panic!("PREPARE {name}: {e:?}"));
    let mut plan = String::new();
    // Six executions: PostgreSQL may switch to a generic plan after five,
    // which Citus must still route (deferred pruning).
    for _ in 0..6 {
        plan = c
            .query(&format!("EXPLAIN EXECUTE {name}({args})"), &[])
            .await
            .unwrap_or_else(|e| panic!("EXPLAIN {name}: {e:?}"))
            .iter()
            .map(|r| r.get::<_, String>(0))
            .collect::<Vec<_>>()
            .join("\n");
    }
    plan
}

#[tokio::test]
async fn every_statement_of_the_request_path_is_routed_to_one_shard() {
    let _shared = citus::cluster_lock().read().await;
    let Some((h, _schema)) = harness("router_plans", Setup::default()).await else {
        return;
    };
    let c = h.db.client().await;
    let (k, u) = (
        "'', 'k-plan'",
        "'00000000-0000-0000-0000-000000000001'::uuid",
    );
    let fp = "decode(repeat('00', 32), 'hex')";
    let resp = "201::smallint, ARRAY['a']::text[], ARRAY['\\x00'::bytea], '\\x00'::bytea, false";
    let src = |f: &str| {
        std::fs::read_to_string(format!("{}/src/store/sql/{f}", env!("CARGO_MANIFEST_DIR")))
            .unwrap()
    };
    let cases = [
        (
            "claim_insert",
            "claim_insert.sql",
            format!("{k}, {fp}, {u}, 1000, 1000"),
        ),
        ("claim_read", "claim_read.sql", format!("{k}, {fp}")),
        (
            "take_over",
            "take_over.sql",
            format!("{k}, {fp}, {u}, {u}, 1000"),
        ),
        (
            "reclaim",
            "reclaim.sql",
            format!("{k}, {fp}, {u}, {u}, 1000, 1000"),
        ),
        (
            "complete",
            "complete.sql",
            format!("{k}, {u}, 1000, {resp}"),
        ),
        ("renew", "renew.sql", format!("{k}, {u}, 1000")),
        ("owned", "owned.sql", format!("{k}, {u}")),
        ("release", "release.sql", format!("{k}, {u}")),
        (
            "force_release",
            "force_release_plain.sql",
            format!("{k}, true"),
        ),
        ("show", "show.sql", format!("{k}, false")),
    ];
    for (name, file, args) in cases {
        let plan = task_count(&c, name, &src(file), &args).await;
        assert!(
            plan.contains("Citus Adaptive"),
            "{name}: not a Citus plan:\n{plan}"
        );
        assert!(
            plan.contains("Task Count: 1"),
            "{name}: not routed to one shard:\n{plan}"
        );
    }
    // The sweeper's form runs (on every shard): Citus accepts it.
    let sweep = task_count(&c, "sweep", &src("sweep_citus.sql"), "100, NULL").await;
    assert!(sweep.contains("Citus Adaptive"), "{sweep}");
}

#[tokio::test]
async fn new_keys_replays_conflicts_and_mismatches_through_the_coordinator() {
    let _shared = citus::cluster_lock().read().await;
    let Some((h, schema)) = harness("requests", Setup::default()).await else {
        return;
    };
    let c = h.db.client().await;
    let mut ports = std::collections::BTreeSet::new();
    for i in 0..8 {
        let key = format!("k-req-{i}");
        let first = h.post("/v1/payments", &key, PAY).await;
        assert_eq!(first.status, 201, "{}", first.text());
        assert!(!first.replayed());
        let again = h.post("/v1/payments", &key, PAY).await;
        assert_eq!(again.status, 201);
        assert!(again.replayed(), "a replay");
        assert_eq!(again.body, first.body);
        assert_eq!(h.upstream.executions(&key), 1);
        ports.insert(citus::worker_port_of(&c, &schema.name, &key).await);
    }
    assert_eq!(
        ports.len(),
        2,
        "one tenant's keys are on both workers: {ports:?}"
    );

    let other = h
        .post("/v1/payments", "k-req-0", r#"{"amount": 999}"#)
        .await;
    other.assert_problem(422, "key-reused");

    let client = h.client.clone();
    let url = h.url("/v1/payments");
    let slow = tokio::spawn(async move {
        client
            .send(
                Req::post(&url)
                    .key("k-req-slow")
                    .json(PAY)
                    .header("x-sample-delay-ms", "1500"),
            )
            .await
    });
    h.wait_executions("k-req-slow", 1).await;
    h.post("/v1/payments", "k-req-slow", PAY)
        .await
        .assert_problem(409, "request-in-progress");
    assert_eq!(slow.await.unwrap().status, 201);

    // With the default sslmode (prefer): Citus turns TLS on in every node
    // with a self-signed X.509 v1 certificate, and the proxy's sessions on
    // the coordinator use it.
    assert!(!h.db.url.contains("sslmode"), "{}", h.db.url);
    let row = c
        .query_one(
            "SELECT count(*) FILTER (WHERE s.ssl), count(*)
               FROM pg_stat_activity a JOIN pg_stat_ssl s USING (pid)
              WHERE a.application_name = 'idemproxy' AND a.datname = current_database()",
            &[],
        )
        .await
        .unwrap();
    let (tls, all): (i64, i64) = (row.get(0), row.get(1));
    assert!(all > 0, "no idemproxy session on the coordinator");
    assert_eq!(
        tls, all,
        "idemproxy sessions without TLS on the coordinator"
    );
}

#[tokio::test]
async fn concurrent_new_keys_are_each_claimed_and_completed_once() {
    let _shared = citus::cluster_lock().read().await;
    let Some((h, _schema)) = harness("concurrent", Setup::default()).await else {
        return;
    };
    let tasks: Vec<_> = (0..48)
        .map(|i| {
            let (client, url) = (h.client.clone(), h.url("/v1/payments"));
            tokio::spawn(async move {
                client
                    .send(Req::post(&url).key(&format!("k-many-{i}")).json(PAY))
                    .await
            })
        })
        .collect();
    for t in tasks {
        let r = t.await.unwrap();
        assert_eq!(r.status, 201, "{}", r.text());
    }
    for i in 0..48 {
        assert_eq!(h.upstream.executions(&format!("k-many-{i}")), 1);
        assert_eq!(
            h.record_state("", &format!("k-many-{i}")).await,
            Some(("completed".into(), 1))
        );
    }
}

#[tokio::test]
async fn takeover_renewal_and_reclaim_work_on_the_shards() {
    let _shared = citus::cluster_lock().read().await;
    let Some((h, _schema)) = harness("state_machine", Setup::default()).await else {
        return;
    };
    let store = h.store();
    let fp = fingerprint("body");
    let rk = record_key("tenant-a", "k-sm");
    let first = OwnerToken::mint();
    let claimed = store
        .claim(
            &rk,
            &fp,
            first,
            Duration::from_millis(300),
            Duration::from_secs(3600),
        )
        .await
        .unwrap();
    assert!(matches!(claimed, ClaimResult::Claimed(c) if c.attempt == 1));
    assert!(store
        .renew(&rk, first, Duration::from_millis(300))
        .await
        .unwrap());
    let c = h.db.client().await;
    support::poll_until(Duration::from_secs(10), "the lease to run out", || async {
        let expired: bool = c
            .query_one(
                "SELECT lease_expires_at <= now() FROM idempotency_records
                  WHERE tenant_id = 'tenant-a' AND idempotency_key = 'k-sm'",
                &[],
            )
            .await
            .unwrap()
            .get(0);
        if expired {
            Ok(())
        } else {
            Err("in flight".to_string())
        }
    })
    .await;
    let second = OwnerToken::mint();
    let took = store
        .replace(
            &rk,
            &fp,
            second,
            Replace::TakeOver(first),
            Duration::from_secs(5),
            Duration::from_secs(3600),
        )
        .await
        .unwrap()
        .expect("the expired lease is taken over");
    assert_eq!(took.attempt, 2);
    assert!(
        !store
            .renew(&rk, first, Duration::from_secs(5))
            .await
            .unwrap(),
        "the old owner is fenced out"
    );
    let renewed = store
        .renew_batch(&[
            idemproxy::store::RenewItem {
                tenant: "tenant-a".into(),
                key: "k-sm".into(),
                owner: second.as_uuid(),
                lease_ms: 5000,
            },
            idemproxy::store::RenewItem {
                tenant: "tenant-a".into(),
                key: "k-sm".into(),
                owner: first.as_uuid(),
                lease_ms: 5000,
            },
        ])
        .await
        .unwrap();
    assert_eq!(renewed, vec![true, false]);
    let response = StoredResponse {
        status: 201,
        headers: vec![("content-type".into(), "text/plain".into())],
        body: Some("done".into()),
    };
    assert!(
        store
            .complete(&rk, first, &response, Duration::from_millis(1), None)
            .await
            .unwrap()
            .is_none(),
        "the old owner cannot complete"
    );
    assert!(store
        .complete(&rk, second, &response, Duration::from_millis(1), Some("id"))
        .await
        .unwrap()
        .is_some());
    // Retention of 1 ms: the record is past it at once; a new claim finds
    // it and reclaims it.
    tokio::time::sleep(Duration::from_millis(20)).await;
    let third = OwnerToken::mint();
    let fresh = store
        .replace(
            &rk,
            &fingerprint("other"),
            third,
            Replace::Reclaim(second),
            Duration::from_secs(5),
            Duration::from_secs(3600),
        )
        .await
        .unwrap()
        .expect("reclaimed after retention");
    assert_eq!(fresh.attempt, 1);
    assert!(store.release(&rk, third, Some("id")).await.unwrap());
    assert_eq!(h.record_state("tenant-a", "k-sm").await, None);
}

#[tokio::test]
async fn a_waiting_duplicate_on_another_replica_is_woken_by_the_coordinators_notify() {
    let _shared = citus::cluster_lock().read().await;
    let setup = Setup::default().defaults("lease = \"5s\"\nwait = \"8s\"\n");
    let Some((h, schema)) = harness("waiting", setup).await else {
        return;
    };
    let c = h.db.client().await;
    let ports = citus::worker_ports(&c).await;
    let since = h.db_now().await;
    let b = h.replica().await;
    h.wait_listener_since(&since).await;
    // One key on each worker: the notification must come from the
    // coordinator whichever worker wrote the row.
    for port in &ports {
        let key = keys_on(&c, &schema.name, "k-wait", *port, 1)
            .await
            .remove(0);
        let client = h.client.clone();
        let url = h.url("/v1/payments");
        let k = key.clone();
        let original = tokio::spawn(async move {
            client
                .send(
                    Req::post(&url)
                        .key(&k)
                        .json(PAY)
                        .header("x-sample-delay-ms", "800"),
                )
                .await
        });
        h.wait_executions(&key, 1).await;
        let started = Instant::now();
        let dup = HttpClient::new()
            .send(
                Req::post(&format!("http://{}/v1/payments", b.proxy_addr))
                    .key(&key)
                    .json(PAY),
            )
            .await;
        let waited = started.elapsed();
        assert_eq!(original.await.unwrap().status, 201);
        assert_eq!(dup.status, 201, "{}", dup.text());
        assert!(dup.replayed());
        // The lease is 5 s: only a push explains an early wake-up.
        assert!(
            waited < Duration::from_millis(3000),
            "{key} on {port}: {waited:?}"
        );
        assert_eq!(h.upstream.executions(&key), 1);
    }
    b.shutdown().await;
}

#[tokio::test]
async fn sweep_and_the_keys_commands_work_on_the_cluster() {
    let _shared = citus::cluster_lock().read().await;
    let Some((h, _schema)) = harness("operations", Setup::default()).await else {
        return;
    };
    let store = h.store();
    for i in 0..6 {
        support::records::claim_in_flight(
            &store,
            "",
            &format!("k-expired-{i}"),
            Duration::from_millis(50),
            Duration::from_millis(50),
        )
        .await;
    }
    support::records::claim_in_flight(
        &store,
        "",
        "k-stuck",
        Duration::from_secs(60),
        Duration::from_secs(3600),
    )
    .await;
    let kept = h.post("/v1/payments", "k-kept", PAY).await;
    assert_eq!(kept.status, 201);
    tokio::time::sleep(Duration::from_millis(150)).await;
    let env = [("IDEMPROXY_DATABASE_URL", h.db.url.as_str())];

    let out = idemproxy(&["sweep"], &env).await;
    assert_eq!(out.code, Some(0), "{}", out.both());
    assert!(
        out.stdout.contains("deleted 6 expired record(s)"),
        "{}",
        out.both()
    );
    assert_eq!(h.record_count().await, 2);

    let list = idemproxy(&["keys", "list", "--state", "in-flight"], &env).await;
    assert_eq!(list.code, Some(0), "{}", list.both());
    assert!(list.stdout.contains("k-stuck"), "{}", list.both());
    assert!(!list.stdout.contains("k-kept"), "{}", list.both());

    let show = idemproxy(&["keys", "show", "--tenant", "", "--key", "k-kept"], &env).await;
    assert_eq!(show.code, Some(0), "{}", show.both());
    assert!(
        show.stdout.contains("state:           completed"),
        "{}",
        show.both()
    );

    let release = idemproxy(
        &[
            "keys", "release", "--tenant", "", "--key", "k-stuck", "--yes",
        ],
        &env,
    )
    .await;
    assert_eq!(release.code, Some(0), "{}", release.both());
    assert_eq!(h.record_state("", "k-stuck").await, None);
    // The released key is free again.
    let again = h.post("/v1/payments", "k-stuck", PAY).await;
    assert_eq!(again.status, 201, "{}", again.text());
    assert!(!again.replayed());
}

#[tokio::test]
async fn a_stopped_worker_fails_its_keys_closed_and_heals_without_a_proxy_restart() {
    // Alone on the cluster: the other tests would see the worker go (and
    // their coordinator sessions would keep a broken connection to it).
    let _alone = citus::cluster_lock().write().await;
    let Some((h, schema)) = harness("worker_failure", Setup::default()).await else {
        return;
    };
    let c = h.db.client().await;
    let ports = citus::worker_ports(&c).await;
    assert_eq!(ports.len(), 2, "{ports:?}");
    let down = keys_on(&c, &schema.name, "k-down", ports[1], 3).await;
    let up = keys_on(&c, &schema.name, "k-up", ports[0], 3).await;
    // A completed key on the worker that goes: its replay fails closed too
    // (unless this replica's cache answers it, which is not the store).
    let done = h.post("/v1/payments", &down[0], PAY).await;
    assert_eq!(done.status, 201);

    citus::script(&["worker-stop", "2"]).await;
    let healed = async {
        for key in &down[1..] {
            let r = h.post("/v1/payments", key, PAY).await;
            r.assert_problem(503, "store-unavailable");
            assert_eq!(
                h.upstream.executions(key),
                0,
                "fail closed: {key} not forwarded"
            );
        }
        for key in &up {
            let r = h.post("/v1/payments", key, PAY).await;
            assert_eq!(r.status, 201, "{key} on the live worker: {}", r.text());
        }
        // The schema check reads the coordinator only.
        let ready = h.client.send(Req::get(&h.admin_url("/readyz/store"))).await;
        assert_eq!(ready.status, 200, "{}", ready.text());
    };
    // Restart the worker even when an assertion failed.
    let outcome = futures_util::FutureExt::catch_unwind(std::panic::AssertUnwindSafe(healed)).await;
    citus::script(&["worker-start", "2"]).await;
    if let Err(panic) = outcome {
        std::panic::resume_unwind(panic);
    }

    // Healed, same proxy: the worker's keys work again.
    support::poll_until(
        Duration::from_secs(30),
        "the worker's keys to work again",
        || async {
            let r = h.post("/v1/payments", &down[1], PAY).await;
            if r.status == 201 {
                Ok(())
            } else {
                Err(format!("{} {}", r.status, r.text()))
            }
        },
    )
    .await;
    for key in &down[2..] {
        let r = h.post("/v1/payments", key, PAY).await;
        assert_eq!(r.status, 201, "{}", r.text());
    }
    assert_eq!(h.upstream.executions(&down[1]), 1);
}
