-- The second half of claim.sql (Citus, see claim_insert.sql): the key's
-- record, with the stored response only when the fingerprint matches.
SELECT false AS claimed, owner_token, attempt, fingerprint, state, lease_expires_at,
       expires_at, response_status,
       CASE WHEN fingerprint = $3 THEN response_header_names END AS header_names,
       CASE WHEN fingerprint = $3 THEN response_header_values END AS header_values,
       CASE WHEN fingerprint = $3 THEN response_body END AS body,
       response_body_omitted AS body_omitted, now() AS now
  FROM idempotency_records
 WHERE tenant_id = $1 AND idempotency_key = $2
