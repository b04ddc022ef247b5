-- A key change on the channel, sent by the coordinator session itself after
-- a routed write on Citus (the write's own pg_notify would run on a worker).
SELECT pg_notify('idemproxy_keys', $1)
