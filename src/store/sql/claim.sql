WITH ins AS (
    INSERT INTO idempotency_records AS r
        (tenant_id, idempotency_key, fingerprint, owner_token, attempt, state,
         lease_expires_at, created_at, expires_at)
    VALUES ($1, $2, $3, $4, 1, 'in_flight',
            now() + $5::bigint * interval '1 millisecond', now(),
            now() + $6::bigint * interval '1 millisecond')
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
       CASE WHEN fingerprint = $3 THEN response_header_names END,
       CASE WHEN fingerprint = $3 THEN response_header_values END,
       CASE WHEN fingerprint = $3 THEN response_body END,
       response_body_omitted, now()
  FROM idempotency_records
 WHERE tenant_id = $1 AND idempotency_key = $2
   AND NOT EXISTS (SELECT 1 FROM ins)
