-- wrk script for scripts/bench.sh's EXTRA contender when it is Limitador's HTTP server:
-- POST /check_and_report round-robin over KEYS users of namespace "bench" (its limits file
-- holds one limit of 10^9 per hour per user), the same keys and the same machine-readable line
-- as bench/ratelimit.lua.
local bodies = {}
local next_key = 1

function init(args)
  local keys = tonumber(args[1] or "1")
  for i = 1, keys do
    local body = string.format(
      '{"namespace":"bench","values":{"user":"user-%d"},"delta":1}', i)
    bodies[i] = wrk.format("POST", "/check_and_report",
      { ["Content-Type"] = "application/json" }, body)
  end
end

function request()
  local r = bodies[next_key]
  next_key = next_key + 1
  if next_key > #bodies then next_key = 1 end
  return r
end

function done(summary, latency, requests)
  local bad = summary.errors.status + summary.errors.connect + summary.errors.read
    + summary.errors.write + summary.errors.timeout
  io.write(string.format("WRK requests=%d seconds=%.3f p50_us=%d p99_us=%d errors=%d\n",
    summary.requests, summary.duration / 1e6, latency:percentile(50), latency:percentile(99), bad))
end
