//! The request path's statements: claim, take over, complete, renew,
//! release. Claims and completions go through [`group_commit`] batches.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use tokio_postgres::Row;

use super::conn::Conn;
use super::group_commit::{BatchStats, Batcher};
use super::pools::Pools;
use super::{
    bounded, millis, sql, Claim, ClaimResult, Existing, Flavor, Replace, Store, StoreError,
    StoredResponse,
};
use crate::config::StoreConfig;
use crate::idempotency::{Fingerprint, OwnerToken, RecordKey, RecordState, RecordView};

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

impl Store {
    /// Claims a new key, or returns the record it already has.
    pub async fn claim(
        &self,
        record: &RecordKey,
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
                    tenant: record.tenant.as_str().to_owned(),
                    key: record.key.as_str().to_owned(),
                    fingerprint: *fingerprint.as_bytes(),
                    owner: owner.as_uuid(),
                    lease_ms: millis(lease),
                    retention_ms: millis(retention),
                };
                let out = match &self.batch {
                    Some(b) => b.claim(item).await?,
                    None => {
                        let conn = self.conn().await?;
                        let citus = self.citus(&conn).await?;
                        exec_claims(&conn, vec![item], citus).await?.pop().flatten()
                    }
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
    pub async fn replace(
        &self,
        record: &RecordKey,
        fingerprint: &Fingerprint,
        owner: OwnerToken,
        replace: Replace,
        lease: Duration,
        retention: Duration,
    ) -> Result<Option<Claim>, StoreError> {
        self.bounded(async {
            let conn = self.conn().await?;
            let (tenant, key, fp, owner_id) = (
                record.tenant.as_str(),
                record.key.as_str(),
                &fingerprint.as_bytes()[..],
                owner.as_uuid(),
            );
            let lease_ms = millis(lease);
            let row = match replace {
                Replace::TakeOver(previous) => {
                    let prev = previous.as_uuid();
                    conn.query_opt(
                        &sql::TAKE_OVER,
                        &[&tenant, &key, &fp, &owner_id, &prev, &lease_ms],
                    )
                    .await?
                }
                Replace::Reclaim(previous) => {
                    let prev = previous.as_uuid();
                    let retention_ms = millis(retention);
                    conn.query_opt(
                        &sql::RECLAIM,
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
        record: &RecordKey,
        owner: OwnerToken,
        response: &StoredResponse,
        retention: Duration,
        notify: Option<&str>,
    ) -> Result<Option<SystemTime>, StoreError> {
        self.bounded(async {
            let item = CompleteItem {
                tenant: record.tenant.as_str().to_owned(),
                key: record.key.as_str().to_owned(),
                owner: owner.as_uuid(),
                retention_ms: millis(retention),
                status: i16::try_from(response.status)
                    .map_err(|_| StoreError::Corrupt(format!("status {}", response.status)))?,
                response: response.clone(),
                notify: notify.map(str::to_owned),
            };
            match &self.batch {
                Some(b) => b.complete(item).await,
                None => {
                    let conn = self.conn().await?;
                    let citus = self.citus(&conn).await?;
                    Ok(exec_completions(&conn, vec![item], citus)
                        .await?
                        .pop()
                        .flatten())
                }
            }
        })
        .await
    }

    /// Extends the lease; `false` if the fence refused it (lease lost).
    pub async fn renew(
        &self,
        record: &RecordKey,
        owner: OwnerToken,
        lease: Duration,
    ) -> Result<bool, StoreError> {
        let item = RenewItem {
            tenant: record.tenant.as_str().to_owned(),
            key: record.key.as_str().to_owned(),
            owner: owner.as_uuid(),
            lease_ms: millis(lease),
        };
        Ok(self.renew_batch(&[item]).await?.pop().unwrap_or(false))
    }

    /// Renews many claims in one statement; for each, `false` if the fence
    /// refused it (lease lost). A claim that its owner completed meanwhile
    /// counts as renewed: it was not lost.
    pub async fn renew_batch(&self, items: &[RenewItem]) -> Result<Vec<bool>, StoreError> {
        self.bounded(async {
            let conn = self.conn().await?;
            if self.citus(&conn).await? {
                let conn = &conn;
                // One routed statement per claim, pipelined; each commits
                // alone on its shard, so no lock order spans them.
                // Renewed, or completed by us meanwhile: still ours.
                let rows = futures_util::future::join_all(items.iter().map(|i| async move {
                    let (renewed, owned) = futures_util::future::join(
                        conn.query_opt(&sql::RENEW, &[&i.tenant, &i.key, &i.owner, &i.lease_ms]),
                        conn.query_opt(&sql::OWNED, &[&i.tenant, &i.key, &i.owner]),
                    )
                    .await;
                    renewed?;
                    owned
                }))
                .await;
                return rows
                    .into_iter()
                    .map(|r| r.map(|row| row.is_some()))
                    .collect();
            }
            let tenants: Vec<&str> = items.iter().map(|i| i.tenant.as_str()).collect();
            let keys: Vec<&str> = items.iter().map(|i| i.key.as_str()).collect();
            let owners: Vec<uuid::Uuid> = items.iter().map(|i| i.owner).collect();
            let leases: Vec<i64> = items.iter().map(|i| i.lease_ms).collect();
            let rows = conn
                .query(&sql::RENEW_BATCH, &[&tenants, &keys, &owners, &leases])
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
        record: &RecordKey,
        owner: OwnerToken,
        notify: Option<&str>,
    ) -> Result<bool, StoreError> {
        self.bounded(async {
            let conn = self.conn().await?;
            let (tenant, key, owner) =
                (record.tenant.as_str(), record.key.as_str(), owner.as_uuid());
            let n = match notify {
                None => {
                    conn.execute(&sql::RELEASE, &[&tenant, &key, &owner])
                        .await?
                }
                Some(id) if self.citus(&conn).await? => {
                    let n = conn
                        .execute(&sql::RELEASE, &[&tenant, &key, &owner])
                        .await?;
                    if n == 1 {
                        conn.query(&sql::NOTIFY, &[&id]).await?;
                    }
                    n
                }
                Some(id) => conn
                    .query(&sql::RELEASE_NOTIFY, &[&tenant, &key, &owner, &id])
                    .await?
                    .len() as u64,
            };
            Ok(n == 1)
        })
        .await
    }
}

/// The batchers of one store: a set per lane, each run on its lane's own
/// thread.
///
/// A request on a worker thread ([`crate::workers`]) submits its claim and
/// its completion to its own lane's set, whose tasks run on that worker's
/// runtime and check out of that lane's pool: a batch is formed, sent and
/// answered without leaving the thread. With one set for the process (on
/// the main runtime), each queued item woke the main thread and each answer
/// woke the worker back, a system call and a context switch per statement
/// at full load. The price is company: a lane batches only its own
/// requests.
pub(super) struct Batchers {
    /// For the threads that are no worker (and a store of one lane).
    main: LaneBatchers,
    /// Worker `n`'s set, started on its thread at its first claim.
    workers: Box<[std::sync::OnceLock<LaneBatchers>]>,
    /// Group-commit workers of each kind in a worker's set.
    per_worker: usize,
    pools: Pools,
    flavor: Arc<Flavor>,
    timeout: Duration,
}

/// One lane's batchers.
struct LaneBatchers {
    claims: Batcher<ClaimItem, Option<ClaimResult>>,
    completions: Batcher<CompleteItem, Option<SystemTime>>,
}

impl LaneBatchers {
    /// Starts `workers` tasks of each kind on the current runtime. Each
    /// batch is bounded by `timeout` like any statement: a worker stuck on
    /// a frozen primary gives up, and its connection is closed.
    ///
    /// A batch's statement future (checkout, Citus probe and statement,
    /// inline) is boxed where it is made: unboxed, the timeout, its `map`
    /// and the batcher's own box would each move all of it again.
    fn start(workers: usize, pools: &Pools, flavor: &Arc<Flavor>, timeout: Duration) -> Self {
        let (p1, p2) = (pools.clone(), pools.clone());
        let (f1, f2) = (flavor.clone(), flavor.clone());
        LaneBatchers {
            claims: Batcher::start(workers, MAX_BATCH, move |items| {
                let (pools, flavor) = (p1.clone(), f1.clone());
                bounded(
                    timeout,
                    Box::pin(async move {
                        let conn = pools.checkout().await?;
                        let citus = flavor.citus(&conn).await?;
                        exec_claims(&conn, items, citus).await
                    }),
                )
            }),
            completions: Batcher::start(workers, MAX_BATCH, move |items| {
                let (pools, flavor) = (p2.clone(), f2.clone());
                bounded(
                    timeout,
                    Box::pin(async move {
                        let conn = pools.checkout().await?;
                        let citus = flavor.citus(&conn).await?;
                        exec_completions(&conn, items, citus).await
                    }),
                )
            }),
        }
    }
}

impl Batchers {
    /// Starts the main lane's set now, on the current runtime, and leaves
    /// each of the `lanes - 1` workers' sets to its first use. The main
    /// set has a quarter of the pool each for claims and for completions
    /// (at least one each); the workers share that number, at least one
    /// each, so the process runs no more batches at once than with one
    /// set, and reads, renewals and takeovers keep connections. `None`
    /// outside a tokio runtime (then every statement goes alone).
    pub(super) fn start(
        pools: &Pools,
        config: &StoreConfig,
        flavor: &Arc<Flavor>,
        lanes: usize,
    ) -> Option<Arc<Batchers>> {
        tokio::runtime::Handle::try_current().ok()?;
        let workers = batch_workers(config.pool_size);
        let worker_lanes = lanes.saturating_sub(1);
        Some(Arc::new(Batchers {
            main: LaneBatchers::start(workers, pools, flavor, config.timeout),
            workers: (0..worker_lanes).map(|_| Default::default()).collect(),
            per_worker: workers.div_ceil(worker_lanes.max(1)),
            pools: pools.clone(),
            flavor: flavor.clone(),
            timeout: config.timeout,
        }))
    }

    /// The calling thread's set: its worker's, started here (on that
    /// worker's runtime) the first time, else the main one.
    fn own(&self) -> &LaneBatchers {
        match crate::workers::lane().and_then(|n| self.workers.get(n)) {
            Some(lane) => lane.get_or_init(|| {
                LaneBatchers::start(self.per_worker, &self.pools, &self.flavor, self.timeout)
            }),
            None => &self.main,
        }
    }

    async fn claim(&self, item: ClaimItem) -> Result<Option<ClaimResult>, StoreError> {
        self.own().claims.submit(item).await
    }

    async fn complete(&self, item: CompleteItem) -> Result<Option<SystemTime>, StoreError> {
        self.own().completions.submit(item).await
    }

    /// (op, statements sent, items carried, largest batch), over every
    /// lane.
    pub(super) fn stats(&self) -> Vec<(&'static str, u64, u64, u64)> {
        let sets: Vec<&LaneBatchers> = std::iter::once(&self.main)
            .chain(self.workers.iter().filter_map(|w| w.get()))
            .collect();
        let claims = totals(sets.iter().map(|s| s.claims.stats()));
        let completions = totals(sets.iter().map(|s| s.completions.stats()));
        vec![
            ("claim", claims.0, claims.1, claims.2),
            ("complete", completions.0, completions.1, completions.2),
        ]
    }
}

/// Statements, items and the largest batch over several batchers' counters.
fn totals<'a>(stats: impl Iterator<Item = &'a BatchStats>) -> (u64, u64, u64) {
    use std::sync::atomic::Ordering::Relaxed;
    stats.fold((0, 0, 0), |(batches, items, largest), s| {
        (
            batches + s.batches.load(Relaxed),
            items + s.items.load(Relaxed),
            largest.max(s.largest.load(Relaxed)),
        )
    })
}

/// Group-commit workers of each kind (claims, completions) for a pool of
/// `pool_size`: a quarter of it each, at least one.
pub(super) fn batch_workers(pool_size: usize) -> usize {
    (pool_size / 4).max(1)
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

/// Runs a batch of claims as one statement (on Citus: one routed
/// statement per claim, pipelined on the connection). `None` for an item:
/// neither claimed nor visible yet (retry).
async fn exec_claims(
    conn: &Conn,
    items: Vec<ClaimItem>,
    citus: bool,
) -> Result<Vec<Option<ClaimResult>>, StoreError> {
    let one = |item| claim_one(conn, item, citus);
    if let [item] = &items[..] {
        // Alone (light load): the plain single-key statement.
        return Ok(vec![one(item).await?]);
    }
    if citus {
        // A statement over many keys spans shards: the coordinator would
        // plan it across every worker. Each claim alone is routed to its
        // shard; pipelined, the batch still costs one round trip here.
        return futures_util::future::join_all(items.iter().map(one))
            .await
            .into_iter()
            .collect();
    }
    let tenants: Vec<&str> = items.iter().map(|i| i.tenant.as_str()).collect();
    let keys: Vec<&str> = items.iter().map(|i| i.key.as_str()).collect();
    let fps: Vec<&[u8]> = items.iter().map(|i| &i.fingerprint[..]).collect();
    let owners: Vec<uuid::Uuid> = items.iter().map(|i| i.owner).collect();
    let leases: Vec<i64> = items.iter().map(|i| i.lease_ms).collect();
    let retentions: Vec<i64> = items.iter().map(|i| i.retention_ms).collect();
    let rows = conn
        .query(
            &sql::CLAIM_BATCH,
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

/// One claim alone: `claim.sql`, or on Citus its two halves pipelined.
async fn claim_one(
    conn: &Conn,
    item: &ClaimItem,
    citus: bool,
) -> Result<Option<ClaimResult>, StoreError> {
    let fp = &item.fingerprint[..];
    let fp_param: &(dyn tokio_postgres::types::ToSql + Sync) = &fp;
    let params: [&(dyn tokio_postgres::types::ToSql + Sync); 6] = [
        &item.tenant,
        &item.key,
        fp_param,
        &item.owner,
        &item.lease_ms,
        &item.retention_ms,
    ];
    if citus {
        // Insert, then read, pipelined: both routed to the key's
        // shard (claim_insert.sql).
        let (inserted, read) = futures_util::future::join(
            conn.query_opt(&sql::CLAIM_INSERT, &params),
            conn.query_opt(&sql::CLAIM_READ, &params[..3]),
        )
        .await;
        return match (inserted?, read?) {
            (Some(row), _) => Ok(Some(ClaimResult::Claimed(Claim {
                owner: OwnerToken::from_uuid(row.get("owner_token")),
                attempt: row.get("attempt"),
                lease_expires_at: row.get("lease_expires_at"),
            }))),
            (None, read) => read.as_ref().map(claim_result).transpose(),
        };
    }
    let rows = conn.query(&sql::CLAIM, &params).await?;
    rows.first().map(claim_result).transpose()
}

/// Runs a batch of completions in one transaction: each row the same
/// fenced UPDATE as alone, all pipelined (BEGIN, the updates and COMMIT
/// leave together: one round trip, one commit), in bytewise `(tenant, key)`
/// order (the order of every multi-row lock, see [`sql`]). `None` for an
/// item: the fence refused it (lease lost).
async fn exec_completions(
    conn: &Conn,
    items: Vec<CompleteItem>,
    citus: bool,
) -> Result<Vec<Option<SystemTime>>, StoreError> {
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
        let stmt = match &p.notify {
            Some(_) if citus => &sql::COMPLETE,
            Some(id) => {
                args.push(id);
                &sql::COMPLETE_NOTIFY
            }
            None => &sql::COMPLETE,
        };
        async move { conn.query_opt(stmt, &args).await }
    };
    if citus {
        // Each completion alone, routed to its shard and committing there
        // (a transaction over several shards would commit in two phases),
        // pipelined; then the notifications, from this coordinator
        // session: a pg_notify inside the routed statement would run on
        // the worker, unheard by the replicas listening on the coordinator.
        let rows = futures_util::future::join_all((0..items.len()).map(run)).await;
        let mut out = Vec::with_capacity(items.len());
        for row in rows {
            out.push(row?.map(|r| r.get::<_, SystemTime>(0)));
        }
        let notes = items
            .iter()
            .zip(&out)
            .filter_map(|(item, done)| done.and(item.notify.as_ref()));
        for r in futures_util::future::join_all(
            notes.map(|id| async move { conn.query(&sql::NOTIFY, &[id]).await }),
        )
        .await
        {
            r?;
        }
        return Ok(out);
    }
    if items.len() == 1 {
        let row = run(0).await?;
        return Ok(vec![row.map(|r| r.get(0))]);
    }
    let mut order: Vec<usize> = (0..items.len()).collect();
    // `str`'s order is bytewise: the order of `COLLATE "C"`.
    order.sort_by(|&a, &b| {
        (&items[a].tenant, &items[a].key).cmp(&(&items[b].tenant, &items[b].key))
    });
    // join3 polls in argument order, and each query is sent on its first
    // poll: BEGIN, the updates, COMMIT go out in that order.
    let (begin, rows, commit) = futures_util::future::join3(
        conn.batch_execute("BEGIN"),
        futures_util::future::join_all(order.iter().map(|&i| run(i))),
        conn.batch_execute("COMMIT"),
    )
    .await;
    if begin.is_err() || commit.is_err() {
        // The transaction's state is unknown: the connection goes.
        conn.poison();
    }
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

#[cfg(test)]
mod tests;
