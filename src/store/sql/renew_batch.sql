-- Renews every due claim of this process at once. Rows are locked in
-- bytewise (tenant, key) order first, like every batch, so renewals and
-- batched completions never wait on each other in opposite orders, whatever
-- the database's collation (an en_US one orders 'a' < 'B', bytes 'B' < 'a').
-- Returns the items still owned by us: renewed, or completed by us
-- meanwhile (a completion that raced this tick is not a lost lease).
WITH u AS (
    SELECT *
      FROM unnest($1::text[], $2::text[], $3::uuid[], $4::bigint[])
           WITH ORDINALITY AS u(tenant_id, idempotency_key, owner_token, lease_ms, i)
), locked AS (
    SELECT t.tenant_id, t.idempotency_key, t.state, u.lease_ms, u.i
      FROM idempotency_records t
      JOIN u ON t.tenant_id = u.tenant_id AND t.idempotency_key = u.idempotency_key
            AND t.owner_token = u.owner_token
     ORDER BY t.tenant_id COLLATE "C", t.idempotency_key COLLATE "C"
       FOR UPDATE OF t
), renewed AS (
    UPDATE idempotency_records t
       SET lease_expires_at = now() + locked.lease_ms * interval '1 millisecond'
      FROM locked
     WHERE t.tenant_id = locked.tenant_id AND t.idempotency_key = locked.idempotency_key
       AND locked.state = 'in_flight'
    RETURNING locked.i
)
SELECT i FROM locked
