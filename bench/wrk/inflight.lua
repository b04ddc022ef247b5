-- Every request carries the same key, KEY, which bench/run holds in flight
-- (its original request hangs at the upstream): each one is a duplicate of
-- an in-flight key and gets 409. Same method, path and body as the
-- original, so the fingerprint matches (a mismatch would be a 422).
--
--   wrk -s inflight.lua URL -- KEY
local dir = debug.getinfo(1, "S").source:match("^@(.*/)") or "./"
local common = dofile(dir .. "common.lua")

wrk.method = "POST"
wrk.path = common.slow_path
wrk.body = common.body

setup = common.setup
done = common.done

function init(args)
   local headers = common.base_headers()
   headers["Idempotency-Key"] = args[1] or "inflight"
   wrk.headers = headers
end
