// The cost of one warm decision inside the edge's Wasm module, under Node: `start` on a key
// whose lease covers it, the reply's headers read (names by index, a value decoded only when
// it changed) and whether to drain asked, as worker.mjs does.
//   node wasm-tests/bench/warm_decision.mjs [edge/dist]
import { readFileSync } from "node:fs";
import { join, resolve } from "node:path";

const dist = process.argv[2] ?? "edge/dist";
const { initSync, Edge } = await import(resolve(dist, "strata_edge.js"));
const wasm = initSync({ module: readFileSync(join(dist, "strata_edge_bg.wasm")) });
const decoder = new TextDecoder();

const rules = JSON.stringify({ rules: [{ name: "per-key", namespace: "bench", limit: 1e12,
  duration: "1h", actions: [{ request_headers: { header_name: "x-api-key", descriptor_key: "key" } }] }] });
// `deny`: a cold key waits for the gateway's answer instead of passing ahead of it, so the
// answer below decides it and lends the lease every later request is decided from.
const edge = new Edge(rules, JSON.stringify({ failure_mode: "deny" }), "bench", 250, 50);
const headers = "accept\n*/*\nuser-agent\nbench/1\nx-api-key\nwarm-key\n";
const now = Date.now();

// Cold: the gateway's answer, written by hand, lends the whole limit.
if (edge.start(1, "GET", "https://example.com/api/items", headers, undefined, now) !== 0) {
  throw new Error("a cold key is decided by the gateway");
}
const out = edge.poll_transmit();
const call = JSON.parse(out.body);
const seq = Math.floor(now / 3_600_000);
const result = { success: true, limit: 1e12, remaining: 1e12 - 1, reset: (seq + 1) * 3_600_000,
  sequence: seq, current: { regional: 1, global: 0 }, previous: { regional: 0, global: 0 },
  used: 0, lease: 1e12 - 1, lease_id: 1, lease_ms: 3_600_000 };
edge.answer(out.call, 200, JSON.stringify({ success: true, sequence: seq, results: [result] }), now);
out.free();
if (edge.poll_decision() !== 1) throw new Error("the answer decides request 1");
if (call.limits[0].identifier !== "key=warm-key") throw new Error("unexpected call");

const names = edge.reply_header_names.split("\n");
const held = [];
function readHeaders() {
  const n = edge.reply_header_count;
  const headers = new Array(2 * n);
  for (let i = 0; i < n; i++) {
    const name = edge.reply_header_name(i);
    const len = edge.reply_header_value(i);
    if (len >= 0) held[name] = decoder.decode(new Uint8Array(wasm.memory.buffer, edge.reply_value_ptr, len));
    headers[2 * i] = names[name];
    headers[2 * i + 1] = held[name];
  }
  return headers;
}

function run(n) {
  const t0 = process.hrtime.bigint();
  for (let i = 0; i < n; i++) {
    const verdict = edge.start(i + 2, "GET", "https://example.com/api/items", headers, undefined, now);
    const out = readHeaders();
    if (verdict !== 1 || out.length !== 4) throw new Error("denied");
    if (edge.wants_pump()) edge.next_deadline();
  }
  return Number(process.hrtime.bigint() - t0) / n;
}
run(20_000); // warm up
const samples = [run(100_000), run(100_000), run(100_000)].sort((a, b) => a - b);
console.log(`warm decision in the wasm module (start, headers read, node ${process.version}): ` +
  `${samples[1].toFixed(0)} ns median of 3 runs of 100000 (min ${samples[0].toFixed(0)}, max ${samples[2].toFixed(0)})`);
