// The baseline of the edge latency benchmark: a Worker that forwards every request to
// STRATA_UPSTREAM and does nothing else.
export default {
  async fetch(request, env) {
    const url = new URL(request.url);
    return fetch(new Request(new URL(url.pathname + url.search, env.STRATA_UPSTREAM), request));
  },
};
