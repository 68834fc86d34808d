-- wrk script for scripts/bench.sh: POST /v1/ratelimit round-robin over KEYS identifiers
-- (wrk ... -s bench/ratelimit.lua -- KEYS), every request passing (limit 10^9, one hour), and
-- one machine-readable line at the end (p50, p99, p99.9 and max latency in us). With a second
-- argument `limitador`, the same users go to Limitador's POST /check_and_report instead
-- (namespace "bench", whose limits file holds 10^9 per hour per user).
local bodies = {}
local next_key = 1

function init(args)
  local keys = tonumber(args[1] or "1")
  local path, shape = "/v1/ratelimit",
    '{"namespace":"bench","identifier":"user-%d","limit":1000000000,"duration":3600000}'
  if args[2] == "limitador" then
    path, shape = "/check_and_report", '{"namespace":"bench","values":{"user":"user-%d"},"delta":1}'
  end
  for i = 1, keys do
    bodies[i] = wrk.format("POST", path,
      { ["Content-Type"] = "application/json" }, string.format(shape, i))
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
  io.write(string.format("WRK requests=%d seconds=%.3f p50_us=%d p99_us=%d p999_us=%d max_us=%d errors=%d\n",
    summary.requests, summary.duration / 1e6, latency:percentile(50), latency:percentile(99),
    latency:percentile(99.9), latency.max, bad))
end
