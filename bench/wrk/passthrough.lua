-- The request without an Idempotency-Key: the upstream directly, nginx, and
-- idemproxy's pass-through all get exactly these bytes. No request()
-- function, so wrk builds the request once and reuses it.
local dir = debug.getinfo(1, "S").source:match("^@(.*/)") or "./"
local common = dofile(dir .. "common.lua")

wrk.method = "POST"
wrk.path = common.path
wrk.body = common.body
wrk.headers = common.base_headers()

setup = common.setup
done = common.done
