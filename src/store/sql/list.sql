SELECT tenant_id, idempotency_key, state, attempt, created_at,
       lease_expires_at, lease_expires_at > now(), response_status
  FROM idempotency_records
 WHERE ($1::text IS NULL OR state = $1)
   AND created_at <= now() - $2::bigint * interval '1 millisecond'
   AND ($3::text IS NULL OR tenant_id = $3)
 ORDER BY created_at
 LIMIT $4
