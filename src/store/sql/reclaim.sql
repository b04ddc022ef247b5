UPDATE idempotency_records
   SET owner_token = $4, attempt = 1, fingerprint = $3, state = 'in_flight',
       lease_expires_at = now() + $6::bigint * interval '1 millisecond',
       created_at = now(), completed_at = NULL,
       expires_at = now() + $7::bigint * interval '1 millisecond',
       response_status = NULL, response_header_names = NULL,
       response_header_values = NULL, response_body = NULL,
       response_body_omitted = false
 WHERE tenant_id = $1 AND idempotency_key = $2 AND owner_token = $5
   AND expires_at <= now()
   AND (state = 'completed' OR lease_expires_at <= now())
RETURNING attempt, lease_expires_at
