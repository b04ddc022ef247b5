-- One sweeper batch: the oldest expired rows at or after $2 (the latest
-- expiry the previous batch of the pass deleted; NULL for the first), locked
-- (SKIP LOCKED: replicas split the work) and deleted by ctid, which is
-- stable while the lock is held. Starting at $2 keeps each batch from
-- walking the index entries of the rows the pass already deleted, which
-- nothing can remove while an older snapshot is open; the ctid join spares
-- a primary-key probe per row (docs/retention.md). Returns how many rows
-- went and the latest expiry among them.
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
SELECT count(*), max(expires_at) FROM gone
