-- renew_batch.sql for one claim, the form used on Citus: a single-row
-- statement filtered by the whole primary key, which the coordinator routes
-- to the one shard holding the key (renew_batch.sql joins an array and
-- would run on every shard). Renews an in-flight claim of ours; the store
-- pipelines owned.sql behind it to tell a claim completed by us meanwhile
-- (not lost) from one lost to a takeover (Citus refuses now() in a CASE or
-- beside a column reference, which one statement would need).
UPDATE idempotency_records
   SET lease_expires_at = now() + $4::bigint * interval '1 millisecond'
 WHERE tenant_id = $1 AND idempotency_key = $2 AND owner_token = $3
   AND state = 'in_flight'
RETURNING 1
