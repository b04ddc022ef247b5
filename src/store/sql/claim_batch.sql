-- claim.sql for a batch of keys: one statement, one commit. Rows are
-- inserted in bytewise (tenant, key) order, whatever the database's
-- collation, so concurrent batches never wait on each other in opposite
-- orders. A key claimed twice in one batch is inserted once; the other item
-- finds no row (the record is invisible to the statement's snapshot) and is
-- retried, as a racing claim would be.
WITH req AS (
    SELECT *
      FROM unnest($1::text[], $2::text[], $3::bytea[], $4::uuid[], $5::bigint[], $6::bigint[])
           WITH ORDINALITY AS r(tenant_id, idempotency_key, fingerprint, owner_token,
                                lease_ms, retention_ms, i)
), ins AS (
    INSERT INTO idempotency_records AS t
        (tenant_id, idempotency_key, fingerprint, owner_token, attempt, state,
         lease_expires_at, created_at, expires_at)
    SELECT tenant_id, idempotency_key, fingerprint, owner_token, 1, 'in_flight',
           now() + lease_ms * interval '1 millisecond', now(),
           now() + retention_ms * interval '1 millisecond'
      FROM req
     ORDER BY tenant_id COLLATE "C", idempotency_key COLLATE "C"
    ON CONFLICT (tenant_id, idempotency_key) DO NOTHING
    RETURNING owner_token, attempt, lease_expires_at
)
SELECT req.i, true AS claimed, ins.owner_token, ins.attempt, NULL::bytea AS fingerprint,
       NULL::text AS state, ins.lease_expires_at, NULL::timestamptz AS expires_at,
       NULL::smallint AS response_status, NULL::text[] AS header_names,
       NULL::bytea[] AS header_values, NULL::bytea AS body,
       false AS body_omitted, now() AS now
  FROM req JOIN ins ON ins.owner_token = req.owner_token
UNION ALL
SELECT req.i, false, r.owner_token, r.attempt, r.fingerprint, r.state,
       r.lease_expires_at, r.expires_at, r.response_status,
       CASE WHEN r.fingerprint = req.fingerprint THEN r.response_header_names END,
       CASE WHEN r.fingerprint = req.fingerprint THEN r.response_header_values END,
       CASE WHEN r.fingerprint = req.fingerprint THEN r.response_body END,
       r.response_body_omitted, now()
  FROM req
  JOIN idempotency_records r
    ON r.tenant_id = req.tenant_id AND r.idempotency_key = req.idempotency_key
 WHERE NOT EXISTS (SELECT 1 FROM ins WHERE ins.owner_token = req.owner_token)
