-- Keyed requests with a large JSON body read from FILE (bench/run writes a
-- ~1 MiB array of order lines into its scratch directory), each with a fresh
-- Idempotency-Key "<prefix>-<thread>-<counter>", so every one is a new key
-- whose body idemproxy buffers and canonicalises to fingerprint it (a
-- replay would be answered from the record and skip that work).
--
--   wrk -s big_body.lua URL -- PREFIX FILE
local dir = debug.getinfo(1, "S").source:match("^@(.*/)") or "./"
local common = dofile(dir .. "common.lua")

local prefix = "big"
local body = nil
local n = 0

setup = common.setup
done = common.done

function init(args)
   prefix = (args[1] or prefix) .. "-" .. tostring(tid) .. "-"
   local f = assert(io.open(assert(args[2], "big_body.lua: FILE missing"), "rb"))
   body = f:read("*a")
   f:close()
end

function request()
   n = n + 1
   local headers = common.base_headers()
   headers["Idempotency-Key"] = prefix .. n
   return wrk.format("POST", common.path, headers, body)
end
