-- An operator's release: in-flight records always, completed ones only
-- with $3 (force). Replicas drop the key from their response caches and
-- wake its waiters ($4: the key's id on the channel).
WITH gone AS (
     DELETE FROM idempotency_records
      WHERE tenant_id = $1 AND idempotency_key = $2
        AND (state = 'in_flight' OR $3)
  RETURNING state)
SELECT state, pg_notify('idemproxy_keys', $4) FROM gone
