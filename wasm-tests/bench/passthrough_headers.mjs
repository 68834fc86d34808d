// The pass-through of the edge latency benchmark, adding to each response the two headers a
// Strata pass carries, with values that change per request as the edge's do: what adding
// headers costs in workerd, with no limiter at all (`EDGE_CONTROL`).
let remaining = 1_000_000_000;

export default {
  async fetch(request, env) {
    const url = new URL(request.url);
    const upstream = await fetch(new Request(new URL(url.pathname + url.search, env.STRATA_UPSTREAM), request));
    // A fetched response's headers are immutable: a copy of the response takes new ones.
    const response = new Response(upstream.body, upstream);
    remaining -= 1;
    response.headers.set("RateLimit-Policy", '"per-key";q=1000000000;w=3600');
    response.headers.set("RateLimit", `"per-key";r=${remaining};t=1800`);
    return response;
  },
};
