// Strata's edge Worker. It reads the clock, makes the fetches and keeps one `Edge` per isolate;
// every decision, merge and batching rule is in the Wasm module (strata-core's request path).
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
//   STRATA_LEGACY_HEADERS, STRATA_HEADERS_ON_PASS, STRATA_DEBUG   true | false
//     (debug adds `Strata-Origin: unavailable` to answers the failure mode decided, and serves
//     this isolate's counters at GET /__strata/stats)

import wasmModule from "./strata_edge_bg.wasm";
import { initSync, Edge } from "./strata_edge.js";

initSync({ module: wasmModule });

const isolate = { key: null, state: null };
const RULES_NONE = '{"rules":[]}';

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

function text(v) {
  return typeof v === "string" ? v : JSON.stringify(v);
}

// One state per isolate, rebuilt only if the configuration changes.
function stateFor(env, rules) {
  const key = JSON.stringify([
    env.STRATA_GATEWAY_URL, env.STRATA_TOKEN, env.STRATA_REGION, rules, env.STRATA_FAILURE_MODE,
    env.STRATA_TIMEOUT_MS, env.STRATA_REPLAY_DELAY_MS, env.STRATA_LEGACY_HEADERS,
    env.STRATA_HEADERS_ON_PASS, env.STRATA_DEBUG, env.STRATA_UPSTREAM, env.STRATA_CLIENT_ADDRESS,
    env.STRATA_XFF_NUM_TRUSTED_HOPS,
  ]);
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
      // Digits become a number; anything else is passed on for the module to refuse by name.
      xff_num_trusted_hops: /^[0-9]{1,9}$/.test(env.STRATA_XFF_NUM_TRUSTED_HOPS ?? "")
        ? Number(env.STRATA_XFF_NUM_TRUSTED_HOPS)
        : env.STRATA_XFF_NUM_TRUSTED_HOPS || 0,
    });
    const edge = new Edge(rules, options, env.STRATA_REGION || "edge");
    state = {
      edge,
      error: null,
      gateway,
      base: base ? base.replace(/\/+$/, "") : "http://gateway",
      token: env.STRATA_TOKEN || "",
      timeoutMs: number(env, "STRATA_TIMEOUT_MS", 250),
      replayDelayMs: number(env, "STRATA_REPLAY_DELAY_MS", 50),
      upstream: env.STRATA_UPSTREAM || "",
      debug: flag(env, "STRATA_DEBUG", false),
      inflight: new Map(),
      replayPending: false,
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

// POSTs to the gateway within the timeout; resolves { status, text } or throws.
async function post(state, path, body) {
  const headers = { "content-type": "application/json" };
  if (state.token) headers.authorization = `Bearer ${state.token}`;
  const controller = new AbortController();
  const timer = setTimeout(() => controller.abort(new Error("timed out")), state.timeoutMs);
  try {
    const init = { method: "POST", headers, body, signal: controller.signal };
    const response = state.gateway
      ? await state.gateway.fetch(`${state.base}${path}`, init)
      : await fetch(`${state.base}${path}`, init);
    return { status: response.status, text: await response.text() };
  } finally {
    clearTimeout(timer);
  }
}

// Makes group `g`'s origin call and hands the answer (or the failure) to the module. The
// call is listed in flight with its deadline, which requests that join it inherit.
async function call(state, request, g) {
  const body = state.edge.call_body(request, g);
  if (body === undefined) return;
  const key = state.edge.call_key(request, g);
  let done;
  const settled = new Promise((resolve) => (done = resolve));
  state.inflight.set(key, { settled, deadline: Date.now() + state.timeoutMs });
  try {
    const { status, text } = await post(state, "/v1/origin/decide", body);
    if (!state.edge.answer(request, g, status, text, Date.now())) {
      log("warn", "gateway refused a decision", { status, body: text.slice(0, 200) });
    }
  } catch (e) {
    state.edge.fail(request, g, Date.now());
    log("warn", "gateway unreachable; decided by the failure mode", { error: String(e.message || e) });
  } finally {
    if (state.inflight.get(key)?.settled === settled) state.inflight.delete(key);
    done();
  }
}

// Decides a request begun by `begin()`. A request whose call another request already has in
// flight waits for that answer once, then begins again: the answer usually brings a lease
// that decides it from memory. It waits no longer than that call's deadline: past it, the
// call it joined has failed, whether or not its failure was recorded yet, so its own calls
// are failed too (decided by the failure mode) rather than made, which would wait again.
async function decide(state, begin) {
  let request = begin();
  const joined = [0, 1]
    .map((g) => state.inflight.get(state.edge.call_key(request, g)))
    .filter(Boolean);
  let expired = false;
  if (joined.length > 0) {
    request.free();
    const deadline = Math.max(...joined.map((f) => f.deadline));
    const answered = Promise.all(joined.map((f) => f.settled)).then(() => false);
    const late = sleep(Math.max(0, deadline - Date.now())).then(() => true);
    expired = await Promise.race([answered, late]);
    request = begin();
  }
  try {
    if (expired) {
      for (const g of [0, 1]) {
        if (state.edge.call_body(request, g) !== undefined) state.edge.fail(request, g, Date.now());
      }
    }
    await Promise.all([call(state, request, 0), call(state, request, 1)]);
    return {
      reply: state.edge.reply(request, Date.now()),
      originFailed: request.origin_failed,
    };
  } finally {
    request.free();
  }
}

// Sends accepted cost after the response, batched across the isolate's requests: the first
// request after a replay schedules the next one in its own context (Workers keep a request's
// I/O to itself) and the requests until then join it. After STRATA_REPLAY_DELAY_MS it sends
// everything unacknowledged; replays carry cumulative counts, so two that overlap count once,
// and a failed one leaves the counts for the next.
function replaySoon(state, ctx) {
  if (state.replayPending) return;
  state.replayPending = true;
  ctx.waitUntil(
    (async () => {
      await sleep(state.replayDelayMs);
      state.replayPending = false; // later requests schedule the next replay
      for (let batches = 0; batches < 64; batches++) {
        const batch = state.edge.take_replay(Date.now(), 1000);
        if (!batch) return;
        try {
          const { status, text } = await post(state, "/v1/origin/replay", batch.body);
          if (!state.edge.ack_replay(batch, status, text)) {
            log("warn", "gateway refused a replay", { status, body: text.slice(0, 200) });
            return;
          }
        } catch (e) {
          state.edge.ack_replay(batch, 0, "");
          log("warn", "replay failed; the next one carries the same counts", { error: String(e.message || e) });
          return;
        } finally {
          batch.free();
        }
      }
    })(),
  );
}

// The upstream URL of a pass: the upstream's origin with the request's path and query. The
// path is set, never resolved against the upstream: a client's `//other.host/` (or `/\other`,
// which URL parsing turns into it) would otherwise name another host to fetch.
function upstreamUrl(upstream, url) {
  const target = new URL(upstream);
  target.pathname = url.pathname;
  target.search = url.search;
  return target;
}

// The address workerd accepted the connection from ("ip:port"), the `peer` source; the
// module drops the port. Cloudflare's runtime gives none (use cf-connecting-ip there).
function peerOf(request) {
  const ip = request.cf?.clientIp;
  return typeof ip === "string" ? ip : undefined;
}

function sleep(ms) {
  return new Promise((resolve) => setTimeout(resolve, ms));
}

// Headers cross into and out of Wasm as one string, `name\nvalue\n` per header (a header
// can hold no newline), so a request costs one copy each way.
function headerText(headers) {
  let text = "";
  for (const [name, value] of headers) text += `${name}\n${value}\n`;
  return text;
}

function setHeaders(target, text) {
  const parts = text.split("\n");
  for (let i = 0; i + 1 < parts.length; i += 2) target.set(parts[i], parts[i + 1]);
}

async function proxy(request, env, ctx) {
  const state = stateFor(env, text(env.STRATA_RULES ?? RULES_NONE));
  if (state.error) return errorResponse(500, "invalid_configuration", state.error);
  if (state.debug && new URL(request.url).pathname === "/__strata/stats") {
    return json(200, JSON.parse(state.edge.stats()));
  }
  let decided;
  try {
    decided = await decide(state, () =>
      state.edge.start(request.method, request.url, headerText(request.headers), peerOf(request), Date.now()),
    );
  } catch (e) {
    return errorResponse(400, "invalid_request", String(e.message || e));
  }
  const { reply, originFailed } = decided;
  if (reply.notice) log("warn", reply.notice);
  replaySoon(state, ctx);
  if (reply.shadow_denied) log("info", "shadow rule would deny", { rules: reply.shadow_denied });
  if (!reply.allowed) {
    const response = new Response(reply.body, { status: reply.status });
    response.headers.set("content-type", "application/json");
    setHeaders(response.headers, reply.headers);
    return response;
  }
  const url = new URL(request.url);
  const target = state.upstream ? upstreamUrl(state.upstream, url) : url;
  let upstream;
  try {
    upstream = await fetch(new Request(target, request));
  } catch (e) {
    log("warn", "upstream unreachable", { error: String(e.message || e) });
    return errorResponse(502, "upstream_unavailable", `the upstream could not be reached: ${e.message || e}`);
  }
  const response = new Response(upstream.body, upstream);
  setHeaders(response.headers, reply.headers);
  if (state.debug && originFailed) response.headers.set("strata-origin", "unavailable");
  return response;
}

export default { fetch: proxy };

// Binding mode. `limiters` maps env names to { namespace, limit, period } (period in seconds,
// as in Cloudflare's `simple = { limit, period }`); the wrapped handler finds each as
// `env.NAME`, with `limit({ key, cost? })` resolving to { success, limit, remaining, reset }.
export function withLimiters(limiters, handler) {
  return {
    async fetch(request, env, ctx) {
      const state = stateFor(env, text(env.STRATA_RULES ?? RULES_NONE));
      if (state.error) return errorResponse(500, "invalid_configuration", state.error);
      const bound = Object.create(env);
      for (const [name, spec] of Object.entries(limiters)) {
        bound[name] = {
          async limit({ key, cost = 1 } = {}) {
            if (typeof key !== "string" || key === "") {
              throw new TypeError(`${name}.limit: key must be a non-empty string`);
            }
            const { reply } = await decide(state, () =>
              state.edge.start_key(spec.namespace ?? name, key, spec.limit, spec.period * 1000, cost, Date.now()),
            );
            replaySoon(state, ctx);
            return { success: reply.allowed, limit: reply.limit, remaining: reply.remaining, reset: reply.reset };
          },
        };
      }
      return handler.fetch(request, bound, ctx);
    },
  };
}
