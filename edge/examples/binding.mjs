// A Worker written for Cloudflare's Rate Limiting binding, moved to Strata by wrapping its
// handler: `env.LOGIN.limit({ key })` is unchanged, and now exact near the limit and counted
// across regions.
import { withLimiters } from "./worker.mjs";

export default withLimiters({ LOGIN: { namespace: "login", limit: 3, period: 60 } }, {
  async fetch(request, env) {
    const user = new URL(request.url).searchParams.get("user") ?? "anonymous";
    const { success, limit, remaining, reset } = await env.LOGIN.limit({ key: user });
    return Response.json({ success, limit, remaining, reset }, { status: success ? 200 : 429 });
  },
});
