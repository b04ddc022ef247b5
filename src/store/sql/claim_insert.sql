-- The first half of claim.sql, the form used on Citus: the coordinator
-- runs a modifying CTE in steps (the INSERT, then the SELECT, then their
-- union), each a round trip to the worker, where this plain INSERT is
-- routed whole to the key's shard. The store pipelines claim_read.sql
-- right behind it on the same connection (one round trip): when the key
-- had a record, the INSERT returns nothing and the read returns the record
-- (ON CONFLICT DO NOTHING waits for an uncommitted insert of the same key,
-- so the read, which starts after, sees it).
INSERT INTO idempotency_records AS r
    (tenant_id, idempotency_key, fingerprint, owner_token, attempt, state,
     lease_expires_at, created_at, expires_at)
VALUES ($1, $2, $3, $4, 1, 'in_flight',
        now() + $5::bigint * interval '1 millisecond', now(),
        now() + $6::bigint * interval '1 millisecond')
ON CONFLICT (tenant_id, idempotency_key) DO NOTHING
RETURNING true AS claimed, owner_token, attempt, lease_expires_at
