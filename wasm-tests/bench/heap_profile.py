#!/usr/bin/env python3
"""Where each Worker's V8 heap bytes go, per request. One workerd serves the edge, the
pass-through and the pass-through that adds headers. The same load (8 connections, a warm key)
runs through each in turn. V8's sampling heap profiler, driven over workerd's inspector, counts
every allocation, including objects a scavenge collected. It prints bytes a request per
JavaScript function; a workerd API call (fetch, new Response) counts under the function that
made it.

    pip install websocket-client
    ./scripts/build-edge.sh && cargo build --release -p strata-gateway
    python3 wasm-tests/bench/heap_profile.py [requests]

EDGE_DIST=dir profiles the edge bundle in `dir` instead of `edge/dist` (a copy of
`worker.mjs` with each workerd call in a named function of its own splits `proxy` call by
call). PROFILE_DIR=dir also writes each raw profile (`<worker>.json`, DevTools' format). ONLY=edge
(a comma-separated list) profiles only those. The load comes from Python threads (about
2,000 requests/s). Costs that come per unit of time, such as the replay's timer, are spread
over fewer requests than in `edge_latency`, so read them as upper bounds.
"""
import http.client
import http.server
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time

import websocket

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TARGET = os.environ.get("CARGO_TARGET_DIR", os.path.join(ROOT, "target"))
GATEWAY = os.path.join(TARGET, "release", "strata-gateway")
WORKERD = os.path.join(ROOT, "wasm-tests", "node_modules", "workerd", "bin", "workerd")
DIST = os.environ.get("EDGE_DIST", os.path.join(ROOT, "edge", "dist"))
BENCH = os.path.join(ROOT, "wasm-tests", "bench")
REQUESTS = int(sys.argv[1]) if len(sys.argv) > 1 else 20000
SETTLE = 30000  # past the edge's Wasm tier-ups, as in edge_latency
CONNECTIONS = 8


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port, what):
    deadline = time.time() + 30
    while time.time() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            return
        except OSError:
            time.sleep(0.1)
    raise SystemExit(f"{what} never listened on {port}")


class Upstream(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True

    def do_GET(self):
        # One write: a head and a body written apart meet delayed ACKs (40 ms a request).
        self.wfile.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\ncontent-type: text/plain\r\n\r\nok")

    def log_message(self, *args):
        pass


def get(conn):
    conn.request("GET", "/api/items?page=1", headers={"x-api-key": "warm-key"})
    r = conn.getresponse()
    r.read()
    if r.status != 200:
        raise SystemExit(f"status {r.status}")


def connect(port):
    conn = http.client.HTTPConnection("127.0.0.1", port)
    conn.connect()
    conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return conn


def load(port, n):
    def run():
        conn = connect(port)
        for _ in range(n // CONNECTIONS):
            get(conn)

    threads = [threading.Thread(target=run) for _ in range(CONNECTIONS)]
    t0 = time.time()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    sent = n // CONNECTIONS * CONNECTIONS
    print(f"  {sent} requests at {sent / (time.time() - t0):,.0f}/s")
    return sent


class Inspector:
    def __init__(self, port, worker):
        self.ws = websocket.create_connection(f"ws://127.0.0.1:{port}/{worker}", timeout=120)
        self.id = 0

    def call(self, method, **params):
        self.id += 1
        self.ws.send(json.dumps({"id": self.id, "method": method, "params": params}))
        while True:
            m = json.loads(self.ws.recv())
            if m.get("id") == self.id:
                if "error" in m:
                    raise SystemExit(f"{method}: {m['error']}")
                return m.get("result")


def by_function(profile):
    """Bytes per call path, its innermost three frames, innermost first."""
    out = {}

    def walk(node, stack):
        f = node["callFrame"]
        name = f"{f['functionName'] or '(anonymous)'} {os.path.basename(f['url'])}:{f['lineNumber'] + 1}"
        stack = stack + (name,)
        key = " < ".join(reversed(stack[-3:]))
        out[key] = out.get(key, 0) + node["selfSize"]
        for child in node.get("children", []):
            walk(child, stack)

    walk(profile["head"], ())
    return out


def worker(main, variables):
    bindings = ", ".join(f'(name = "{k}", text = {json.dumps(v)})' for k, v in variables.items())
    first = "" if main == "worker.mjs" else f'(name = "{main}", esModule = embed "{main}"),'
    return f"""(modules = [{first}
      (name = "worker.mjs", esModule = embed "worker.mjs"),
      (name = "strata_edge.js", esModule = embed "strata_edge.js"),
      (name = "strata_edge_bg.wasm", wasm = embed "strata_edge_bg.wasm")],
    compatibilityDate = "2026-04-01", globalOutbound = "net", bindings = [{bindings}])"""


def main():
    for path in [GATEWAY, WORKERD, os.path.join(DIST, "worker.mjs")]:
        if not os.path.exists(path):
            raise SystemExit(f"{path} is missing: build it first (see the top of this file)")
    tmp = tempfile.mkdtemp(prefix="strata-heap-profile-")
    procs = []
    upstream = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), Upstream)
    threading.Thread(target=upstream.serve_forever, daemon=True).start()
    try:
        gateway_port = free_port()
        procs.append(subprocess.Popen(
            [GATEWAY, "--listen", f"127.0.0.1:{gateway_port}", "--data-dir", tmp],
            stdout=open(os.path.join(tmp, "gateway.log"), "w"), stderr=subprocess.STDOUT))
        for f in ["worker.mjs", "strata_edge.js", "strata_edge_bg.wasm"]:
            shutil.copy(os.path.join(DIST, f), tmp)
        for f in ["passthrough.mjs", "passthrough_headers.mjs"]:
            shutil.copy(os.path.join(BENCH, f), tmp)
        up = f"http://127.0.0.1:{upstream.server_address[1]}"
        rules = json.dumps({"rules": [{
            "name": "per-key", "namespace": "bench", "limit": 1000000000, "duration": "1h",
            "actions": [{"request_headers": {"header_name": "x-api-key", "descriptor_key": "key"}}],
        }]})
        edge = {"STRATA_GATEWAY_URL": f"http://127.0.0.1:{gateway_port}", "STRATA_RULES": rules,
                "STRATA_UPSTREAM": up}
        workers = {
            "edge": worker("worker.mjs", edge),
            "passthrough": worker("passthrough.mjs", {"STRATA_UPSTREAM": up}),
            "headers": worker("passthrough_headers.mjs", {"STRATA_UPSTREAM": up}),
        }
        only = os.environ.get("ONLY")
        if only:
            workers = {k: v for k, v in workers.items() if k in only.split(",")}
        ports = {name: free_port() for name in workers}
        services = "".join(f'(name = "{n}", worker = {w}),\n' for n, w in workers.items())
        sockets = ", ".join(
            f'(name = "{n}", address = "127.0.0.1:{p}", http = (), service = "{n}")' for n, p in ports.items())
        with open(os.path.join(tmp, "config.capnp"), "w") as f:
            f.write(f"""using Workerd = import "/workerd/workerd.capnp";
const config :Workerd.Config = (
  services = [{services}(name = "net", network = (allow = ["public", "private", "local"]))],
  sockets = [{sockets}],
);
""")
        inspector = free_port()
        procs.append(subprocess.Popen(
            [WORKERD, "serve", "config.capnp", f"--inspector-addr=127.0.0.1:{inspector}"], cwd=tmp,
            stdout=open(os.path.join(tmp, "workerd.log"), "w"), stderr=subprocess.STDOUT))
        wait_port(gateway_port, "the gateway")
        wait_port(inspector, "workerd's inspector")
        for port in ports.values():
            wait_port(port, "workerd")

        totals = {}
        for name, port in ports.items():
            print(f"{name}: settling")
            load(port, SETTLE)
            # workerd answers its inspector only while the isolate has work to do: a trickle
            # of requests keeps it busy through the calls (they count with the rest).
            trickle = {"on": True, "sent": 0}

            def keep_busy(port=port):
                conn = connect(port)
                while trickle["on"]:
                    get(conn)
                    trickle["sent"] += 1
                    time.sleep(0.002)

            busy = threading.Thread(target=keep_busy)
            busy.start()
            ins = Inspector(inspector, name)
            ins.call("HeapProfiler.enable")
            ins.call("HeapProfiler.startSampling", samplingInterval=128,
                     includeObjectsCollectedByMajorGC=True, includeObjectsCollectedByMinorGC=True)
            before = trickle["sent"]
            sent = load(port, REQUESTS)
            profile = ins.call("HeapProfiler.stopSampling")["profile"]
            sent += trickle["sent"] - before
            trickle["on"] = False
            busy.join()
            ins.ws.close()
            if os.environ.get("PROFILE_DIR"):
                with open(os.path.join(os.environ["PROFILE_DIR"], f"{name}.json"), "w") as f:
                    json.dump({"requests": sent, "profile": profile}, f)
            rows = by_function(profile)
            totals[name] = sum(rows.values()) / sent
            print(f"{name}: {totals[name]:,.0f} B a request ({sent} requests); by function, from 4 B:")
            for path, size in sorted(rows.items(), key=lambda kv: -kv[1]):
                if size / sent >= 4:
                    print(f"  {size / sent:7,.0f}  {path}")
        print("bytes a request: " + ", ".join(f"{k} {v:,.0f}" for k, v in totals.items()))
    finally:
        for p in procs:
            p.terminate()
            p.wait()
        upstream.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
