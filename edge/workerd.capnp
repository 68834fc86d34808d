# The edge bundle (edge/dist, from scripts/build-edge.sh) served by workerd on 127.0.0.1:8787,
# in front of a local gateway on 127.0.0.1:8080 (README, "The edge"). Passes are forwarded to
# STRATA_UPSTREAM, here the gateway itself, so `/healthz` answers without another server.
#
#   wasm-tests/node_modules/.bin/workerd serve edge/workerd.capnp
using Workerd = import "/workerd/workerd.capnp";

const config :Workerd.Config = (
  services = [
    (name = "edge", worker = .edge),
    # Workers may not reach loopback by default; the gateway and upstream are local here.
    (name = "net", network = (allow = ["public", "private", "local"])),
  ],
  sockets = [(name = "http", address = "127.0.0.1:8787", http = (), service = "edge")],
);

const edge :Workerd.Worker = (
  modules = [
    (name = "worker.mjs", esModule = embed "dist/worker.mjs"),
    (name = "strata_edge.js", esModule = embed "dist/strata_edge.js"),
    (name = "strata_edge_bg.wasm", wasm = embed "dist/strata_edge_bg.wasm"),
  ],
  compatibilityDate = "2026-04-01",
  globalOutbound = "net",
  bindings = [
    (name = "STRATA_GATEWAY_URL", text = "http://127.0.0.1:8080"),
    (name = "STRATA_UPSTREAM", text = "http://127.0.0.1:8080"),
    (name = "STRATA_REGION", text = "local"),
    (name = "STRATA_FAILURE_MODE", text = "local"),
    # Clients reach this workerd directly: remote_address rules count the connection's address.
    (name = "STRATA_CLIENT_ADDRESS", text = "peer"),
    (name = "STRATA_RULES", text = "{\"rules\": [{\"name\": \"per-key\", \"namespace\": \"edge-demo\", \"limit\": 5, \"duration\": \"1h\", \"actions\": [{\"request_headers\": {\"header_name\": \"x-api-key\", \"descriptor_key\": \"key\"}}]}]}"),
  ],
);
