// Strata's edge Worker. It reads the clock, makes the fetches, arms one timer and keeps one `Edge`
// per isolate; the request path (coalescing, deadlines, failure modes, replay) is the Wasm
// module's, strata-core's driver: an event goes in, then `pump` drains what came out.
//
// Proxy mode: `export default` applies STRATA_RULES to each request, answers a denial with 429,
// and forwards a pass to the upstream. Binding mode: `withLimiters` gives a Worker objects shaped
// like Cloudflare's Rate Limiting binding (`await env.LIMITER.limit({ key })`).
//
// Configuration (Worker vars and bindings):
//   STRATA_GATEWAY_URL   the regional gateway (or a STRATA_GATEWAY service binding)
//   STRATA_TOKEN         its bearer token (omit for a loopback gateway without tokens)
//   STRATA_REGION        this edge's region, the prefix of its instance id (default "edge")
//   STRATA_RULES         the rules, JSON: {"rules": [...]} (proxy mode)
//   STRATA_UPSTREAM      where passes go (default: the request's own URL)
//   STRATA_FAILURE_MODE  local | allow | deny: when the gateway is unreachable (default local)
//   STRATA_CLIENT_ADDRESS  where remote_address finds the client: peer (workerd's own view of
//     the connection, request.cf.clientIp; the default), cf-connecting-ip (on Cloudflare),
//     x-forwarded-for (with STRATA_XFF_NUM_TRUSTED_HOPS), another header a proxy sets, or none
//   STRATA_XFF_NUM_TRUSTED_HOPS  trusted proxies before the one that connects (default 0)
//   STRATA_TIMEOUT_MS    bound on one gateway call (default 250)
//   STRATA_REPLAY_DELAY_MS  how long accepted cost gathers before one replay (default 50)
//   STRATA_TABLE_CAPACITY  the most window keys the isolate's table holds (default 50000,
//     about 14 MB when full; 64 to 1000000); past it the least recently used key is evicted
//   STRATA_LEGACY_HEADERS, STRATA_HEADERS_ON_PASS, STRATA_DEBUG   true | false
//     (debug adds `Strata-Origin: unavailable` to answers the failure mode decided, and serves
//     this isolate's counters at GET /__strata/stats)

import wasmModule from "./strata_edge_bg.wasm";
import { initSync, Edge } from "./strata_edge.js";

const wasm = initSync({ module: wasmModule });
const decoder = new TextDecoder();
// Views of the module's memory where it writes a header value out, one per length, so that
// decoding a value allocates only its string. They go when the memory grows or the place moves.
const valueOut = { buffer: null, ptr: -1, views: [] };
const VIEWS_UP_TO = 256;

const isolate = { env: null, key: null, state: null };
const RULES_NONE = '{"rules":[]}';
// What `Edge.start` answers: the request waits, passes, is denied, or is refused (a client
// error: `edge.refusal` says why).
const WAITING = 0;
const PASS = 1;
const REFUSED = 3;
// The debug counters' path; a URL is parsed to match it only when the text holds it.
const STATS = "/__strata/stats";
// How often a request waiting for the gateway looks for its decision.
const POLL_MS = 1;

function log(level, msg, fields) {
  console.log(JSON.stringify({ level, msg, ...fields }));
}

function flag(env, name, fallback) {
  const v = env[name];
  if (v === undefined || v === "") return fallback;
  if (v === true || v === "true" || v === "1") return true;
  if (v === false || v === "false" || v === "0") return false;
  throw new Error(`${name} must be true or false, not ${JSON.stringify(v)}`);
}

function number(env, name, fallback) {
  const v = env[name];
  if (v === undefined || v === "") return fallback;
  const n = Number(v);
  if (!Number.isInteger(n) || n < 1 || n > 60000) {
    throw new Error(`${name} must be whole milliseconds from 1 to 60000, not ${JSON.stringify(v)}`);
  }
  return n;
}

// A var of digits becomes a number, anything else is passed on for the module to refuse by
// name, and an unset one is left out (the module's default).
function digits(v) {
  if (v === undefined || v === "") return undefined;
  return /^[0-9]{1,9}$/.test(v) ? Number(v) : v;
}

function text(v) {
  return typeof v === "string" ? v : JSON.stringify(v);
}

// One state per isolate, rebuilt only if the configuration changes. workerd hands every request
// of an isolate the same `env` object, so the configuration is compared only when it differs.
function stateFor(env) {
  if (isolate.env === env) return isolate.state;
  const rules = text(env.STRATA_RULES ?? RULES_NONE);
  const key = JSON.stringify([
    env.STRATA_GATEWAY_URL, env.STRATA_TOKEN, env.STRATA_REGION, rules, env.STRATA_FAILURE_MODE,
    env.STRATA_TIMEOUT_MS, env.STRATA_REPLAY_DELAY_MS, env.STRATA_LEGACY_HEADERS,
    env.STRATA_HEADERS_ON_PASS, env.STRATA_DEBUG, env.STRATA_UPSTREAM, env.STRATA_CLIENT_ADDRESS,
    env.STRATA_XFF_NUM_TRUSTED_HOPS, env.STRATA_TABLE_CAPACITY,
  ]);
  isolate.env = env;
  if (isolate.key === key) return isolate.state;
  let state;
  try {
    const gateway = env.STRATA_GATEWAY;
    const base = env.STRATA_GATEWAY_URL;
    if (!gateway && !base) {
      throw new Error("set STRATA_GATEWAY_URL or a STRATA_GATEWAY service binding");
    }
    if (base && !/^https?:\/\/[^/]+/.test(base)) {
      throw new Error(`STRATA_GATEWAY_URL must be an http(s) URL, not ${JSON.stringify(base)}`);
    }
    if (env.STRATA_UPSTREAM && !/^https?:\/\/[^/]+/.test(env.STRATA_UPSTREAM)) {
      throw new Error(`STRATA_UPSTREAM must be an http(s) URL, not ${JSON.stringify(env.STRATA_UPSTREAM)}`);
    }
    const options = JSON.stringify({
      failure_mode: env.STRATA_FAILURE_MODE || "local",
      legacy_headers: flag(env, "STRATA_LEGACY_HEADERS", false),
      headers_on_pass: flag(env, "STRATA_HEADERS_ON_PASS", true),
      debug: flag(env, "STRATA_DEBUG", false),
      client_address: env.STRATA_CLIENT_ADDRESS || "peer",
      xff_num_trusted_hops: digits(env.STRATA_XFF_NUM_TRUSTED_HOPS),
      table_capacity: digits(env.STRATA_TABLE_CAPACITY),
    });
    const edge = new Edge(
      rules, options, env.STRATA_REGION || "edge",
      number(env, "STRATA_TIMEOUT_MS", 250), number(env, "STRATA_REPLAY_DELAY_MS", 50),
    );
    state = {
      edge,
      headerNames: edge.header_names.split("\n").filter(Boolean),
      replyNames: edge.reply_header_names.split("\n"), // learned once: a reply names them by index
      valuesRead: [], // per reply header name, the value read last (see `replyHeaders`)
      readsPeer: edge.reads_peer,
      error: null,
      gateway,
      base: base ? base.replace(/\/+$/, "") : "http://gateway",
      token: env.STRATA_TOKEN || "",
      upstream: env.STRATA_UPSTREAM ? new URL(env.STRATA_UPSTREAM).origin : "",
      debug: flag(env, "STRATA_DEBUG", false),
      ready: new Map(), // request id → its reply, for the waiting request to pick up
      nextId: 0,
      timers: [], // when each armed timer fires
    };
    log("info", "strata edge ready", { instance: edge.instance });
  } catch (e) {
    state = { error: String(e.message || e) };
    log("error", "invalid configuration", { error: state.error });
  }
  isolate.key = key;
  isolate.state = state;
  return state;
}

function json(status, body, headers = {}) {
  return new Response(JSON.stringify(body), {
    status,
    headers: { "content-type": "application/json", ...headers },
  });
}

function errorResponse(status, code, message) {
  return json(status, { error: { code, message } });
}

// POSTs to the gateway, aborted after `timeoutMs`; resolves { status, text } or throws.
async function post(state, path, body, timeoutMs) {
  const headers = { "content-type": "application/json" };
  if (state.token) headers.authorization = `Bearer ${state.token}`;
  const init = { method: "POST", headers, body, signal: AbortSignal.timeout(Math.max(1, timeoutMs)) };
  const response = state.gateway
    ? await state.gateway.fetch(`${state.base}${path}`, init)
    : await fetch(`${state.base}${path}`, init);
  return { status: response.status, text: await response.text() };
}

// Drains what the module's last event put out: log lines, calls to send (each awaited in this
// request's context, which Workers require of its I/O), decisions of requests that waited
// (left for them to pick up: see `decide`); then arms a timer for its next deadline.
function pump(state, ctx) {
  const edge = state.edge;
  for (let line; (line = edge.poll_log()); ) {
    log(line.level, line.message);
    line.free();
  }
  for (let call; (call = edge.poll_transmit()); ) {
    ctx.waitUntil(send(state, ctx, call.call, call.path, call.body, call.timeout_ms));
    call.free();
  }
  for (let id; (id = edge.poll_decision()) >= 0; ) state.ready.set(id, replyOf(state, true));
  arm(state, ctx);
}

async function send(state, ctx, call, path, body, timeoutMs) {
  try {
    const { status, text } = await post(state, path, body, timeoutMs);
    state.edge.answer(call, status, text, Date.now());
  } catch (e) {
    state.edge.fail(call, String(e.message || e), Date.now());
  }
  pump(state, ctx);
}

// A timer at the module's next deadline, unless one is armed at or before it. A timer belongs
// to the request that armed it (Workers run its callback in that request's context, and
// another request may not clear it), so a later, sooner deadline arms one more rather than
// moving the first; an early wake-up only finds nothing due.
function arm(state, ctx) {
  const at = state.edge.next_deadline();
  if (at < 0 || state.timers.some((t) => t <= at)) return;
  state.timers.push(at);
  ctx.waitUntil(new Promise((done) => {
    setTimeout(() => {
      state.timers.splice(state.timers.indexOf(at), 1);
      state.edge.timeout(Date.now());
      pump(state, ctx);
      done();
    }, Math.max(0, at - Date.now()));
  }));
}

// The module's value `len` bytes long at `ptr`, decoded.
function valueAt(ptr, len) {
  const buffer = wasm.memory.buffer;
  if (buffer !== valueOut.buffer || ptr !== valueOut.ptr) {
    valueOut.buffer = buffer;
    valueOut.ptr = ptr;
    valueOut.views = [];
  }
  let view = valueOut.views[len];
  if (view === undefined) {
    view = new Uint8Array(buffer, ptr, len);
    if (len <= VIEWS_UP_TO) valueOut.views[len] = view;
  }
  return decoder.decode(view);
}

// The current reply's headers as [name, value, ...], or null if it has none. Names come from
// the list learned once; a value the module says is unchanged under its name (a policy, say) is
// the string read then. A warm pass thus allocates the array and its changed values alone.
function replyHeaders(state) {
  const edge = state.edge;
  const n = edge.reply_header_count;
  if (n === 0) return null;
  const headers = new Array(2 * n);
  for (let i = 0; i < n; i++) {
    const name = edge.reply_header_name(i);
    const len = edge.reply_header_value(i);
    if (len >= 0) state.valuesRead[name] = valueAt(edge.reply_value_ptr, len);
    headers[2 * i] = state.replyNames[name];
    headers[2 * i + 1] = state.valuesRead[name];
  }
  return headers;
}

// The module's current reply as plain values: whether it passes, its headers (unless not
// `withHeaders`: the binding has no response to set them on), and a denial's status and body;
// with `full`, the binding's numbers too.
function replyOf(state, full, allowed = state.edge.reply_allowed, withHeaders = true) {
  const edge = state.edge;
  const reply = { allowed, headers: withHeaders ? replyHeaders(state) : null };
  if (!allowed || full) {
    reply.status = edge.reply_status;
    reply.body = edge.reply_body;
  }
  if (full) {
    reply.limit = edge.reply_limit;
    reply.remaining = edge.reply_remaining;
    reply.reset = edge.reply_reset;
  }
  return reply;
}

// The next request id.
function nextId(state) {
  return (state.nextId = (state.nextId + 1) >>> 0);
}

// A request `id` the module did not refuse, given its `verdict`: its reply now, or, when it
// waits for the gateway, a promise of it, resolved once the gateway (or the deadline) decides
// (`full`: with the binding's numbers). A request decided now allocates no promise and drains
// the module only if it has something to drain. A request that waits picks its reply up
// itself, on a timer of its own: were another request to resolve a promise it awaits, its
// code after that could run in the other request's context, and workerd refuses a request's
// I/O (its upstream fetch) from another's.
function decide(state, ctx, id, verdict, full) {
  if (verdict !== WAITING) {
    // Before a drain replaces it; the binding's (`full`) without headers.
    const reply = replyOf(state, full, verdict === PASS, !full);
    if (state.edge.wants_pump()) pump(state, ctx);
    return reply;
  }
  pump(state, ctx);
  return waitFor(state, ctx, id);
}

async function waitFor(state, ctx, id) {
  try {
    for (;;) {
      const decided = state.ready.get(id);
      if (decided) return decided;
      await sleep(POLL_MS);
      // The timer `arm` set belongs to whichever request armed it; should that request's
      // context end early, this request's own wake-up still keeps the deadline.
      const now = Date.now();
      const due = state.edge.next_deadline();
      if (due >= 0 && due <= now) {
        state.edge.timeout(now);
        pump(state, ctx);
      }
    }
  } finally {
    state.ready.delete(id);
  }
}

function sleep(ms) {
  return new Promise((resolve) => setTimeout(resolve, ms));
}

// The upstream URL of a pass: the upstream's origin followed by the request's path and query,
// joined as text. After an origin, a path that starts with `//` (a client's `//other.host/`,
// or `/\\other`, which URL parsing turns into it) is still a path, never another host to fetch.
function upstreamUrl(origin, url) {
  const path = url.indexOf("/", url.indexOf("://") + 3);
  return path < 0 ? `${origin}/` : origin + url.slice(path);
}

// The address workerd accepted the connection from ("ip:port"), the `peer` source; the
// module drops the port. Cloudflare's runtime gives none (use cf-connecting-ip there).
function peerOf(request) {
  const ip = request.cf?.clientIp;
  return typeof ip === "string" ? ip : undefined;
}

// Request headers cross into Wasm as one string, `name\nvalue\n` per header (a header can hold
// no newline), so a request costs one copy; only the ones the rules read.
function headerText(request, names) {
  if (names.length === 0) return ""; // not even the Headers object, made on first access
  const headers = request.headers;
  let text = "";
  for (const name of names) {
    const value = headers.get(name);
    if (value !== null) text += `${name}\n${value}\n`;
  }
  return text;
}

// Sets `replyHeaders`' pairs (null: none).
function setHeaders(target, headers) {
  if (headers === null) return;
  for (let i = 0; i < headers.length; i += 2) target.set(headers[i], headers[i + 1]);
}

async function proxy(request, env, ctx) {
  const state = stateFor(env);
  if (state.error) return errorResponse(500, "invalid_configuration", state.error);
  const url = request.url;
  if (state.debug && url.includes(STATS) && new URL(url).pathname === STATS) {
    const stats = JSON.parse(state.edge.stats());
    return json(200, { ...stats, ready: state.ready.size, timers: state.timers.length });
  }
  // A pass decided at once, the warm path, is read as its headers alone: no reply object.
  // A pass without headers to add returns the upstream's response itself, uncopied.
  let headers;
  try {
    const edge = state.edge;
    const id = nextId(state);
    const verdict = edge.start(
      id, request.method, url, headerText(request, state.headerNames),
      state.readsPeer ? peerOf(request) : undefined, Date.now(),
    );
    if (verdict === REFUSED) return errorResponse(400, "invalid_request", edge.refusal);
    if (verdict === PASS) {
      headers = replyHeaders(state); // before a drain replaces it
      if (edge.wants_pump()) pump(state, ctx);
    } else {
      const reply = await decide(state, ctx, id, verdict, false); // a denial, or a wait
      if (!reply.allowed) {
        const response = new Response(reply.body, { status: reply.status });
        response.headers.set("content-type", "application/json");
        setHeaders(response.headers, reply.headers);
        return response;
      }
      headers = reply.headers;
    }
  } catch (e) {
    log("error", "the edge failed a request", { error: String(e.stack || e) });
    return errorResponse(500, "internal", "the rate limiter failed; see the Worker's log");
  }
  // `fetch(url, request)` builds the upstream request inside workerd, as `new Request(url,
  // request)` would, without a JavaScript object for it: about 230 B of V8 heap a request less.
  let upstream;
  try {
    upstream = await (state.upstream ? fetch(upstreamUrl(state.upstream, url), request) : fetch(request));
  } catch (e) {
    log("warn", "upstream unreachable", { error: String(e.message || e) });
    return errorResponse(502, "upstream_unavailable", `the upstream could not be reached: ${e.message || e}`);
  }
  if (!headers) return upstream; // nothing to add: no copy of the response
  const response = new Response(upstream.body, upstream);
  setHeaders(response.headers, headers);
  return response;
}

export default { fetch: proxy };

// Binding mode. `limiters` maps env names to { namespace, limit, period } (period in seconds,
// as in Cloudflare's `simple = { limit, period }`); the wrapped handler finds each as
// `env.NAME`, with `limit({ key, cost? })` resolving to { success, limit, remaining, reset }.
export function withLimiters(limiters, handler) {
  return {
    async fetch(request, env, ctx) {
      const state = stateFor(env);
      if (state.error) return errorResponse(500, "invalid_configuration", state.error);
      const bound = Object.create(env);
      for (const [name, spec] of Object.entries(limiters)) {
        bound[name] = {
          async limit({ key, cost = 1 } = {}) {
            if (typeof key !== "string" || key === "") {
              throw new TypeError(`${name}.limit: key must be a non-empty string`);
            }
            const id = nextId(state);
            const verdict = state.edge.start_key(
              id, spec.namespace ?? name, key, spec.limit, spec.period * 1000, cost, Date.now(),
            );
            if (verdict === REFUSED) throw new RangeError(`${name}.limit: ${state.edge.refusal}`);
            const reply = await decide(state, ctx, id, verdict, true);
            return { success: reply.allowed, limit: reply.limit, remaining: reply.remaining, reset: reply.reset };
          },
        };
      }
      return handler.fetch(request, bound, ctx);
    },
  };
}
