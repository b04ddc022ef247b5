UPDATE idempotency_records
   SET owner_token = $4, attempt = attempt + 1,
       lease_expires_at = now() + $6::bigint * interval '1 millisecond'
 WHERE tenant_id = $1 AND idempotency_key = $2 AND owner_token = $5
   AND fingerprint = $3
   AND state = 'in_flight' AND lease_expires_at <= now()
RETURNING attempt, lease_expires_at
