DELETE FROM idempotency_records
 WHERE tenant_id = $1 AND idempotency_key = $2 AND owner_token = $3
   AND state = 'in_flight'
