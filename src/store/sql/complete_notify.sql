-- complete.sql that also notifies waiters and caches ($10: the key's id on
-- the channel), on routes where duplicates wait. NOTIFY serialises
-- committing transactions on a global lock, so routes without waiters skip
-- it.
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
SELECT expires_at, pg_notify('idemproxy_keys', $10) FROM done
