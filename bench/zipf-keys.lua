-- wrk: each request's x-api-key drawn from KEYS keys (default 10,000) with Zipf s = ZIPF_S
-- (default 1.1, the key-popularity shape of the issue's goal; 0: every key alike). Used by
-- scripts/bench-envoy.sh and scripts/bench-rls.sh.
local n = tonumber(os.getenv("KEYS") or "10000")
local s = tonumber(os.getenv("ZIPF_S") or "1.1")
local cdf, total = {}, 0
for i = 1, n do total = total + 1 / (i ^ s); cdf[i] = total end
for i = 1, n do cdf[i] = cdf[i] / total end
math.randomseed(os.time() + (tonumber(tostring({}):sub(8), 16) or 0))

local function pick()
  local u, lo, hi = math.random(), 1, n
  while lo < hi do
    local mid = math.floor((lo + hi) / 2)
    if cdf[mid] < u then lo = mid + 1 else hi = mid end
  end
  return lo
end

request = function()
  return wrk.format("GET", "/", { ["x-api-key"] = "k" .. pick() })
end
