-- A fresh Idempotency-Key per request: "<prefix>-<thread>-<counter>".
-- wrk runs each thread in its own Lua state and calls request() from that
-- thread only, so thread id + counter is unique across threads and
-- connections; bench/run passes a prefix unique to the run.
--
--   wrk -s new_keys.lua URL -- PREFIX
local dir = debug.getinfo(1, "S").source:match("^@(.*/)") or "./"
local common = dofile(dir .. "common.lua")

local prefix = "new"
local n = 0

setup = common.setup
done = common.done

function init(args)
   prefix = (args[1] or prefix) .. "-" .. tostring(tid) .. "-"
end

function request()
   n = n + 1
   local headers = common.base_headers()
   headers["Idempotency-Key"] = prefix .. n
   return wrk.format("POST", common.path, headers, common.body)
end
