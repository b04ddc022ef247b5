-- Whether the key's record is still ours (Citus: follows renew.sql).
SELECT 1 FROM idempotency_records
 WHERE tenant_id = $1 AND idempotency_key = $2 AND owner_token = $3
