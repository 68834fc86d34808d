// The types of the strata-edge package (edge/worker.mjs). The package needs no other types:
// a handler here is the Workers module shape, with the request, env and context it is given.

/** A limiter of binding mode: `limit` requests per `period` seconds and key. */
export interface LimiterOptions {
  /** Requests (cost units) a key may spend in a window. */
  limit: number;
  /** The window, in seconds (as Cloudflare's `simple = { limit, period }`). */
  period: number;
  /** The counts' namespace at the gateway; the limiter's env name when left out. */
  namespace?: string;
}

/** What a limiter's `limit` call takes. */
export interface LimitRequest {
  /** Whose count: a user id, an API key, an address. Any non-empty string. */
  key: string;
  /** What this request spends (default 1). */
  cost?: number;
}

/** What a limiter's `limit` call resolves to. */
export interface LimitOutcome {
  /** Whether the request is within the limit (and was counted). */
  success: boolean;
  /** The limit. */
  limit: number;
  /** What is left of it in this window. */
  remaining: number;
  /** When the window ends, in Unix milliseconds. */
  reset: number;
}

/** `env.NAME` in a handler wrapped by `withLimiters`: Cloudflare's Rate Limiting binding shape. */
export interface RateLimiter {
  /**
   * Counts the request and says whether it is within the limit. Rejects with a `TypeError`
   * for a missing or empty key and a `RangeError` for a cost or key the limiter refuses.
   */
  limit(request: LimitRequest): Promise<LimitOutcome>;
}

/** What the Workers runtime passes a handler as its third argument. */
export interface WorkerContext {
  waitUntil(promise: Promise<unknown>): void;
  passThroughOnException?(): void;
}

/** A Worker's default export with a `fetch` handler. */
export interface FetchHandler<Env = unknown> {
  fetch(request: Request, env: Env, ctx: WorkerContext): Response | Promise<Response>;
}

/**
 * The settings Strata reads from the Worker's env (vars, secrets, a service binding). Only the
 * gateway is required; every value is a string, as Workers vars are.
 */
export interface StrataEnv {
  /** The regional gateway, an http(s) URL (or give a `STRATA_GATEWAY` service binding). */
  STRATA_GATEWAY_URL?: string;
  /** A service binding to the gateway, used in place of `STRATA_GATEWAY_URL`. */
  STRATA_GATEWAY?: { fetch(request: Request): Promise<Response> };
  /** The gateway's bearer token. */
  STRATA_TOKEN?: string;
  /** This edge's region, the prefix of its instance id (default `edge`). */
  STRATA_REGION?: string;
  /** Proxy mode's rules, JSON: `{"rules": [...]}`. */
  STRATA_RULES?: string | object;
  /** Where proxy mode forwards a pass (default: the request's own URL). */
  STRATA_UPSTREAM?: string;
  /** `local` | `allow` | `deny`: what decides while the gateway is unreachable (default `local`). */
  STRATA_FAILURE_MODE?: string;
  /** Where a `remote_address` rule finds the client: `peer`, `cf-connecting-ip`, `x-forwarded-for`, another header, or `none`. */
  STRATA_CLIENT_ADDRESS?: string;
  /** Trusted proxies before the one that connects, for `x-forwarded-for` (default 0). */
  STRATA_XFF_NUM_TRUSTED_HOPS?: string;
  /** Bound on one gateway call, in milliseconds (default 250). */
  STRATA_TIMEOUT_MS?: string;
  /** How long accepted cost gathers before one replay, in milliseconds (default 50). */
  STRATA_REPLAY_DELAY_MS?: string;
  /** The most window keys the isolate holds (default 50000). */
  STRATA_TABLE_CAPACITY?: string;
  /** `true` | `false` */
  STRATA_LEGACY_HEADERS?: string;
  /** `true` | `false` */
  STRATA_HEADERS_ON_PASS?: string;
  /** `true` | `false`: serve this isolate's counters at `GET /__strata/stats`. */
  STRATA_DEBUG?: string;
}

/** The env a wrapped handler is given by default: Strata's settings and the limiters. */
export type LimitedEnv<Limiters> = StrataEnv & { readonly [Name in keyof Limiters]: RateLimiter };

/**
 * Binding mode: wraps `handler` so that it finds each of `limiters` as `env.NAME`, a
 * `RateLimiter`; Strata's settings (`StrataEnv`) come from the same env. A handler whose env
 * holds other bindings too annotates it with its own type (`env: Env`, the limiters in it as
 * `RateLimiter`).
 */
export declare function withLimiters<
  const Limiters extends Record<string, LimiterOptions>,
  Env = LimitedEnv<Limiters>,
>(limiters: Limiters, handler: FetchHandler<Env>): FetchHandler<Omit<Env, keyof Limiters>>;

/**
 * Proxy mode: applies `STRATA_RULES` to each request, answers a denial with `429`, and
 * forwards a pass to `STRATA_UPSTREAM`.
 */
declare const proxy: FetchHandler<StrataEnv>;
export default proxy;
