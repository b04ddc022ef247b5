-- The database ceiling: idemproxy's own claim and completion statements,
-- one key per transaction of this script, as two autocommit statements
-- (two commits, like the proxy: the claim must commit before the upstream
-- is called). Copied from src/store/sql/claim.sql and complete.sql, with
-- the positional parameters renamed; bench/run warns when they drift.
--
-- bench/run passes (-D): tenant, fp (32-byte fingerprint), owner (uuid),
-- lease_ms, retention_ms, and a response as idemproxy stored it for the
-- bench's own request: status, names (text[]), hvalues (bytea[]), body,
-- omitted. With -M prepared every :name becomes a bind parameter.
\set key random(1, 9000000000000000000)
WITH ins AS (
    INSERT INTO idempotency_records AS r
        (tenant_id, idempotency_key, fingerprint, owner_token, attempt, state,
         lease_expires_at, created_at, expires_at)
    VALUES (:tenant, :key, :fp, :owner, 1, 'in_flight',
            now() + :lease_ms::bigint * interval '1 millisecond', now(),
            now() + :retention_ms::bigint * interval '1 millisecond')
    ON CONFLICT (tenant_id, idempotency_key) DO NOTHING
    RETURNING owner_token, attempt, lease_expires_at
)
SELECT true AS claimed, owner_token, attempt, NULL::bytea AS fingerprint,
       NULL::text AS state, lease_expires_at, NULL::timestamptz AS expires_at,
       NULL::smallint AS response_status, NULL::text[] AS header_names,
       NULL::bytea[] AS header_values, NULL::bytea AS body,
       false AS body_omitted, now() AS now
  FROM ins
UNION ALL
SELECT false, owner_token, attempt, fingerprint, state, lease_expires_at, expires_at,
       response_status,
       CASE WHEN fingerprint = :fp THEN response_header_names END,
       CASE WHEN fingerprint = :fp THEN response_header_values END,
       CASE WHEN fingerprint = :fp THEN response_body END,
       response_body_omitted, now()
  FROM idempotency_records
 WHERE tenant_id = :tenant AND idempotency_key = :key
   AND NOT EXISTS (SELECT 1 FROM ins);
UPDATE idempotency_records
   SET state = 'completed', lease_expires_at = NULL, completed_at = now(),
       expires_at = now() + :retention_ms::bigint * interval '1 millisecond',
       response_status = :status, response_header_names = :names,
       response_header_values = :hvalues, response_body = :body,
       response_body_omitted = :omitted
 WHERE tenant_id = :tenant AND idempotency_key = :key AND owner_token = :owner
   AND state = 'in_flight'
RETURNING expires_at;
