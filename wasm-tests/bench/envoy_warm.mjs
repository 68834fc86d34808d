// What a warm request costs the Envoy filter at the Wasm boundary, without Envoy: the built
// filter under Node with the proxy-wasm host calls written in JavaScript (shared data in a
// Map, one request header), a key decided from its lease as a stream is in Envoy (each stream
// callback the module exports is entered, as Envoy does: context created, request headers,
// response headers and body, log, done, deleted). It counts the host calls and the entries
// into the VM (callbacks, and the host's allocations for values it copies in) a request
// makes: in Envoy each is a crossing through V8's C API, and they, not the filter's code,
// are most of its cost (docs/BENCHMARKS.md). The time is V8's with JavaScript host calls, a
// rough figure beside the counts.
//   node wasm-tests/bench/envoy_warm.mjs [envoy-wasm/dist/strata_envoy.wasm] [requests]
import { readFileSync } from "node:fs";

const file = process.argv[2] ?? "envoy-wasm/dist/strata_envoy.wasm";
const requests = Number(process.argv[3] ?? 200_000);
const config = JSON.stringify({ gateway_cluster: "gw", region: "bench", stat_prefix: "strata",
  failure_mode: "deny", // the first request waits for the lease (no pass ahead)
  rules: [{ name: "per-key", namespace: "bench", limit: 1e12, duration: "1h",
    actions: [{ request_headers: { header_name: "x-api-key", descriptor_key: "key" } }] }] });

let exports, memory;
const enc = new TextEncoder(), dec = new TextDecoder();
const shared = new Map(); // key -> { value: Uint8Array, cas }
let casNext = 1, nowMs = Date.now();
let calls = 0, entries = 0;
let pending = null; // the decide call's body
let response = null; // [status, body] of the call answer being delivered
let view;
const dv = () => (view?.buffer === memory.buffer ? view : (view = new DataView(memory.buffer)));
const bytes = (p, n) => new Uint8Array(memory.buffer, p, n);
const text = (p, n) => dec.decode(bytes(p, n));
const u32 = (p, v) => dv().setUint32(p, v, true);
function give(value, dataPtr, sizePtr) {
  const p = exports.proxy_on_memory_allocate(value.length);
  entries++;
  bytes(p, value.length).set(value);
  u32(dataPtr, p);
  u32(sizePtr, value.length);
  return 0;
}
const host = {
  proxy_log: (_l, p, n) => { calls++; console.error(text(p, n)); return 0; },
  proxy_get_current_time_nanoseconds: (p) => {
    calls++;
    dv().setBigUint64(p, BigInt(nowMs) * 1_000_000n, true);
    return 0;
  },
  proxy_set_tick_period_milliseconds: () => 0,
  proxy_get_buffer_bytes: (kind, _s, _m, dp, sp) => {
    calls++;
    if (kind === 7) return give(enc.encode(config), dp, sp);
    if (kind === 4) return give(enc.encode(response[1]), dp, sp);
    return 1;
  },
  proxy_get_header_map_value: (map, kp, kn, dp, sp) => {
    calls++;
    const k = text(kp, kn);
    if (map === 0 && k === "x-api-key") return give(enc.encode("warm-key"), dp, sp);
    if (map === 6 && k === ":status") return give(enc.encode(String(response[0])), dp, sp);
    return 1;
  },
  proxy_add_header_map_value: () => { calls++; return 0; },
  proxy_get_property: () => { calls++; return 1; },
  proxy_send_local_response: () => { calls++; return 0; },
  proxy_continue_stream: () => { calls++; return 0; },
  proxy_set_effective_context: () => { calls++; return 0; },
  proxy_http_call: (_u, _un, _h, _hn, bp, bn, _t, _tn, _ms, tp) => {
    calls++;
    pending = JSON.parse(text(bp, bn));
    u32(tp, 1);
    return 0;
  },
  proxy_get_shared_data: (kp, kn, dp, sp, cp) => {
    calls++;
    const e = shared.get(text(kp, kn));
    if (!e) return 1;
    u32(cp, e.cas);
    return give(e.value, dp, sp);
  },
  proxy_set_shared_data: (kp, kn, vp, vn, cas) => {
    calls++;
    const k = text(kp, kn), e = shared.get(k);
    if (e && cas !== 0 && cas !== e.cas) return 8;
    shared.set(k, { value: bytes(vp, vn).slice(), cas: casNext++ });
    return 0;
  },
  proxy_register_shared_queue: (_p, _n, ip) => { u32(ip, 1); return 0; },
  proxy_enqueue_shared_queue: () => { calls++; return 0; },
  proxy_dequeue_shared_queue: () => 7,
  proxy_define_metric: (_k, _p, _n, ip) => { u32(ip, 1); return 0; },
  proxy_increment_metric: () => { calls++; return 0; },
};
const wasi = {
  random_get: (p, n) => { bytes(p, n).set(crypto.getRandomValues(new Uint8Array(n))); return 0; },
  environ_get: () => 0,
  environ_sizes_get: (a, b) => { u32(a, 0); u32(b, 0); return 0; },
  fd_write: () => 0,
  proc_exit: () => { throw new Error("proc_exit"); },
};
const module = await WebAssembly.compile(readFileSync(file));
// A host call this bench does not answer (an SDK imports them all) is Unimplemented.
for (const i of WebAssembly.Module.imports(module)) {
  if (i.module === "env" && !host[i.name]) host[i.name] = () => { calls++; return 12; };
}
const instance = await WebAssembly.instantiate(module, { env: host, wasi_snapshot_preview1: wasi });
exports = instance.exports;
memory = exports.memory;
exports._initialize?.();
const ROOT = 1;
exports.proxy_on_context_create(ROOT, 0);
exports.proxy_on_vm_start(ROOT, 0);
if (!exports.proxy_on_configure(ROOT, config.length)) throw new Error("configuration refused");

// The cold request: paused; its call goes out from the root; the answer lends the whole limit.
let context = 2;
exports.proxy_on_context_create(context, ROOT);
if (exports.proxy_on_request_headers(context, 1, 1) !== 1) throw new Error("a cold key waits");
exports.proxy_on_queue_ready(ROOT, 1);
if (!pending) throw new Error("no decide call");
const d = 3_600_000, seq = Math.floor(nowMs / d);
response = [200, JSON.stringify({ success: true, sequence: seq, results: [{ success: true,
  limit: 1e12, remaining: 1e12 - 1, reset: (seq + 1) * d, sequence: seq,
  current: { regional: 1, global: 0 }, previous: { regional: 0, global: 0 }, used: 0,
  lease: 1e12 - 1, lease_id: 1, lease_ms: d }] })];
exports.proxy_on_http_call_response(ROOT, 1, 1, response[1].length, 0);
exports.proxy_on_response_headers(context, 0, 0);
exports.proxy_on_delete(context);

// The stream callbacks after the request headers, as Envoy enters those the module exports.
const after = [["proxy_on_response_headers", [0, 0]], ["proxy_on_response_body", [2, 1]],
  ["proxy_on_log", []], ["proxy_on_done", []], ["proxy_on_delete", []]]
  .filter(([name]) => exports[name]).map(([name, args]) => [exports[name], args]);
function one() {
  context++;
  exports.proxy_on_context_create(context, ROOT);
  if (exports.proxy_on_request_headers(context, 1, 1) !== 0) throw new Error("a warm key goes on");
  for (const [f, args] of after) f(context, ...args);
  entries += 2 + after.length;
}
for (let i = 0; i < 20_000; i++) one(); // warm up V8's tiers
calls = 0; entries = 0;
const started = process.hrtime.bigint();
for (let i = 0; i < requests; i++) one();
const ns = Number(process.hrtime.bigint() - started) / requests;
console.log(`${file}: ${(ns / 1000).toFixed(2)} us a warm request in V8 (Node ${process.version}), ` +
  `${(calls / requests).toFixed(1)} host calls and ${(entries / requests).toFixed(1)} VM entries a request`);
