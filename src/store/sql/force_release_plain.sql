-- force_release.sql without the notification, the form used on Citus: the
-- coordinator routes the whole statement to the worker holding the key, so
-- a pg_notify in it would reach that worker's listeners, not the
-- coordinator's. The store notifies from its coordinator session after it
-- (store::records, "Citus").
DELETE FROM idempotency_records
 WHERE tenant_id = $1 AND idempotency_key = $2
   AND (state = 'in_flight' OR $3)
RETURNING state
