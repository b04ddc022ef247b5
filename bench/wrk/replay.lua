-- Cycles over a fixed set of COUNT keys "<prefix>-<i>", i = 0..COUNT-1,
-- each thread starting at a different offset. The first pass over the set
-- (bench/run's warm-up) claims and completes them; every later request is
-- a replay of a completed key.
--
--   wrk -s replay.lua URL -- PREFIX COUNT
local dir = debug.getinfo(1, "S").source:match("^@(.*/)") or "./"
local common = dofile(dir .. "common.lua")

local prefix = "replay"
local count = 1000
local n = 0

setup = common.setup
done = common.done

function init(args)
   prefix = (args[1] or prefix) .. "-"
   count = tonumber(args[2]) or count
   n = (tid - 1) * 7919 -- spread the threads over the set
end

function request()
   local headers = common.base_headers()
   headers["Idempotency-Key"] = prefix .. (n % count)
   n = n + 1
   return wrk.format("POST", common.path, headers, common.body)
end
