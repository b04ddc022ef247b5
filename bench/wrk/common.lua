-- Shared by every wrk script of the harness (loaded with dofile from the
-- script's own directory): the request every scenario sends, the per-thread
-- id, and a machine-readable summary line that bench/run parses.

local common = {}

-- The same small JSON order for every scenario, so that pass-through,
-- nginx and keyed runs move the same bytes.
common.path = "/v1/orders"
-- The in-flight scenario's path: the static upstream sends it on to the
-- sample upstream, where the original request hangs.
common.slow_path = "/v1/slow"
common.body = '{"amount": 100, "currency": "EUR", "customer": "c-42", "items": [{"sku": "A-1", "qty": 2}]}'

function common.base_headers()
   return {
      ["Content-Type"] = "application/json",
      ["X-Tenant-ID"] = "bench",
   }
end

-- Called by each script's setup(): numbers the threads 1..N.
local next_tid = 1
function common.setup(thread)
   thread:set("tid", next_tid)
   next_tid = next_tid + 1
end

-- One line: BENCH key=value ... (latencies in microseconds).
function common.done(summary, latency, _requests)
   local e = summary.errors
   io.write(string.format(
      "BENCH requests=%d duration_us=%d bytes=%d errors_connect=%d errors_read=%d "
         .. "errors_write=%d errors_status=%d errors_timeout=%d "
         .. "p50_us=%d p90_us=%d p99_us=%d p999_us=%d max_us=%d mean_us=%.1f\n",
      summary.requests, summary.duration, summary.bytes, e.connect, e.read,
      e.write, e.status, e.timeout,
      latency:percentile(50), latency:percentile(90), latency:percentile(99),
      latency:percentile(99.9), latency.max, latency.mean))
end

return common
