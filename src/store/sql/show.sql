SELECT tenant_id, idempotency_key, state, attempt, owner_token, fingerprint,
       lease_expires_at, created_at, completed_at, expires_at, response_status,
       octet_length(response_body)::bigint, response_body_omitted,
       CASE WHEN $3 THEN response_body END, now()
  FROM idempotency_records
 WHERE tenant_id = $1 AND idempotency_key = $2
