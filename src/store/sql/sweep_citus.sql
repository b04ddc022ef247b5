-- sweep.sql in a form Citus runs: it refuses FOR UPDATE on a query over
-- several shards, and a ctid means nothing across them. The oldest expired
-- keys are chosen first (the subquery's ORDER BY ... LIMIT runs on every
-- shard and is merged on the coordinator), then deleted on every shard by
-- primary key, the expiry rechecked on the row itself: a key claimed again
-- or taken over since it was chosen is no longer expired and stays.
-- Replicas sweeping at once may choose the same keys; the second delete
-- finds them gone. Returns how many rows went and the latest expiry.
WITH gone AS (
DELETE FROM idempotency_records
 WHERE (tenant_id, idempotency_key) IN (
        SELECT tenant_id, idempotency_key
          FROM idempotency_records
         WHERE expires_at >= coalesce($2::timestamptz, '-infinity')
           AND expires_at <= now()
           AND (state = 'completed' OR lease_expires_at <= now())
         ORDER BY expires_at
         LIMIT $1)
   AND expires_at <= now()
   AND (state = 'completed' OR lease_expires_at <= now())
RETURNING expires_at)
SELECT count(*), max(expires_at) FROM gone
