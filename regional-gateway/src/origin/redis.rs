//! The regional origin in Redis.
//!
//! Keys: `strata:{<workspace>:<namespace>:<identifier>:<duration_ms>}:<sequence>`, every part
//! percent-encoded except `[A-Za-z0-9._~-]`, so no identifier can forge a separator, a hash
//! tag brace or another tenant's key. The braces make the whole window key the Redis Cluster
//! hash tag: both cells of a window share a slot. A replay batch is one pipelined round trip
//! of `MULTI; INCRBY; PEXPIRE … NX; EXEC` per cell (increment and first-write expiry atomic per
//! cell); a read batch is one `MGET`. Keys expire three windows after their first write.

use std::fmt::Write;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use strata_core::WindowKeyRef;

use super::{
    CellIncrement, CellRead, DecideAnswer, DecideLimit, DecideOutcome, MAX_PEERS, OriginError,
    PEER_WINDOW_MS,
};

/// Region-wide set of live processes (gateways and the edges calling them), for the peers
/// prior of keys new at the origin. Outside any hash tag: touched only by the presence loop.
const INSTANCES_KEY: &str = "strata:instances";

/// The origin decision for one window key, atomic in Redis: reads both cells, applies the
/// sliding-window formula in exact integer arithmetic (doubles are exact below 2^53; the
/// product of a count and a duration is split so no intermediate exceeds that), increments on
/// a pass, and records the caller among the key's peers.
/// KEYS: current cell, previous cell, peers. ARGV: limit, cost, duration, now, unseen,
/// instance, peer window, max peers, prior, dry (1: never increment), current global,
/// previous global.
const DECIDE_LUA: &str = r#"
local function divmod(a, d)
  local q = math.floor(a / d)
  local r = a - q * d
  while r < 0 do q = q - 1; r = r + d end
  while r >= d do q = q + 1; r = r - d end
  return q, r
end
-- floor(p * l / d) for p < 2^53 and l <= d < 2^32, with every product below 2^53
local function muldiv(p, l, d)
  local q, r = divmod(p, d)
  local l1 = math.floor(l / 65536)
  local l0 = l - l1 * 65536
  local qa, ra = divmod(r * l1, d)
  local qb = divmod(ra * 65536 + r * l0, d)
  return q * l + qa * 65536 + qb
end
local limit, cost, d, now = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local unseen = tonumber(ARGV[5])
local cur = tonumber(redis.call('GET', KEYS[1]) or '0')
local prev = tonumber(redis.call('GET', KEYS[2]) or '0')
local seq = math.floor(now / d)
local elapsed = now - seq * d
local cg, pg = tonumber(ARGV[11]), tonumber(ARGV[12])
local used = cur + cg + unseen + muldiv(prev + pg, d - elapsed, d)
local ok = 0
if limit > 0 and used + cost <= limit then ok = 1 end
if ok == 1 and cost > 0 and ARGV[10] ~= '1' then
  redis.call('INCRBY', KEYS[1], cost)
  redis.call('PEXPIRE', KEYS[1], d * 3, 'NX')
end
-- Peers: members scored by last call; '~born' (negative score) marks when the key became
-- active, and survives the trimming of members older than the window.
local window, maxp = tonumber(ARGV[7]), tonumber(ARGV[8])
redis.call('ZREMRANGEBYSCORE', KEYS[3], 0, now - window)
redis.call('ZADD', KEYS[3], 'NX', -now, '~born')
redis.call('ZADD', KEYS[3], now, ARGV[6])
redis.call('ZREMRANGEBYRANK', KEYS[3], 1, -(maxp + 2))
redis.call('PEXPIRE', KEYS[3], window * 2)
local peers = redis.call('ZCARD', KEYS[3]) - 1
local born = -tonumber(redis.call('ZSCORE', KEYS[3], '~born'))
if now - born < window then peers = math.max(peers, tonumber(ARGV[9])) end
return {ok, cur, prev, math.max(peers, 1)}
"#;

/// Version prefix of every key, so a future encoding can live beside this one.
const PREFIX: &str = "strata:";

fn encode_into(out: &mut String, part: &str) {
    for b in part.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'~' | b'-') {
            out.push(char::from(b));
        } else {
            let _ = write!(out, "%{b:02X}");
        }
    }
}

/// The Redis key of one cell.
pub fn cell_key(key: WindowKeyRef<'_>, sequence: u64) -> String {
    let mut out = String::with_capacity(PREFIX.len() + 48 + key.identifier().len());
    out.push_str(PREFIX);
    out.push('{');
    encode_into(&mut out, key.workspace());
    out.push(':');
    encode_into(&mut out, key.namespace());
    out.push(':');
    encode_into(&mut out, key.identifier());
    let _ = write!(out, ":{}}}:{sequence}", key.duration().as_ms());
    out
}

fn backend(e: redis::RedisError) -> OriginError {
    if e.is_timeout() {
        OriginError::Timeout(Duration::ZERO)
    } else {
        OriginError::Backend(format!("redis: {e}"))
    }
}

fn int(v: Option<&redis::Value>) -> u64 {
    match v {
        Some(redis::Value::Int(n)) => u64::try_from(*n).unwrap_or(0),
        _ => 0,
    }
}

/// Queues the peer-set update of one key: trim members older than the window, mark when the
/// key became active (`~born`, negative score, kept by the trim), add `instance` if given; then
/// `ZCARD` and `ZSCORE ~born`, the two replies [`peers_from`] reads.
fn touch_peers(
    pipe: &mut redis::Pipeline,
    peers: &str,
    instance: Option<&str>,
    now_ms: u64,
    in_transaction: bool,
) {
    if let Some(instance) = instance {
        pipe.cmd("ZREMRANGEBYSCORE")
            .arg(peers)
            .arg(0)
            .arg(now_ms.saturating_sub(PEER_WINDOW_MS))
            .ignore();
        pipe.cmd("ZADD")
            .arg(peers)
            .arg("NX")
            .arg(-i128::from(now_ms))
            .arg("~born")
            .ignore();
        pipe.cmd("ZADD")
            .arg(peers)
            .arg(now_ms)
            .arg(instance)
            .ignore();
        pipe.cmd("PEXPIRE")
            .arg(peers)
            .arg(2 * PEER_WINDOW_MS)
            .ignore();
    }
    pipe.cmd("ZCARD").arg(peers);
    if in_transaction {
        pipe.ignore(); // inside MULTI its reply is QUEUED; the value arrives with EXEC
    }
    pipe.cmd("ZSCORE").arg(peers).arg("~born");
    if in_transaction {
        pipe.ignore();
    }
}

/// Peers from `ZCARD` (which counts `~born`) and `ZSCORE ~born`, with the region prior while
/// the key is young.
fn peers_from(
    card: Option<&redis::Value>,
    born: Option<&redis::Value>,
    now_ms: u64,
    prior: u32,
) -> u32 {
    let on_key = u32::try_from(int(card).saturating_sub(1)).unwrap_or(u32::MAX);
    let born = match born {
        Some(redis::Value::BulkString(b)) => std::str::from_utf8(b)
            .ok()
            .and_then(|s| s.parse::<f64>().ok()),
        Some(redis::Value::Double(d)) => Some(*d),
        _ => None,
    };
    // A score is -(time the key became active), exact in a double for any real clock.
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
    let young = born.is_some_and(|b| now_ms.saturating_sub((-b) as u64) < PEER_WINDOW_MS);
    super::peers_with_prior(on_key, young, prior)
}

/// The Redis key of a window key's peer set (same hash tag as its cells).
pub fn peers_key(key: WindowKeyRef<'_>) -> String {
    let mut k = cell_key(key, 0);
    k.truncate(k.len() - 1); // drop the sequence "0", keep the trailing ':'
    k.push('p');
    k
}

/// A connection-managed Redis origin (reconnects on its own after failures).
#[derive(Clone)]
pub struct RedisOrigin {
    conn: ConnectionManager,
    decide: redis::Script,
    /// Live processes in the region, from the presence loop (the peers prior of new keys).
    prior: Arc<AtomicU32>,
}

impl std::fmt::Debug for RedisOrigin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisOrigin").finish_non_exhaustive()
    }
}

impl RedisOrigin {
    /// Sets up a lazily connecting client: the gateway starts (and decides locally) even if
    /// Redis is down, and connects when it comes up.
    pub fn new(url: &str, timeout: Duration) -> Result<Self, OriginError> {
        let client = redis::Client::open(url)
            .map_err(|e| OriginError::Backend(format!("invalid Redis URL: {e}")))?;
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(timeout))
            .set_response_timeout(Some(timeout))
            .set_number_of_retries(1)
            .set_max_delay(Duration::from_secs(1));
        let conn = ConnectionManager::new_lazy_with_config(client, config).map_err(backend)?;
        Ok(Self {
            conn,
            decide: redis::Script::new(DECIDE_LUA),
            prior: Arc::new(AtomicU32::new(1)),
        })
    }

    /// Announces `instance` as live and refreshes the region's live-process count.
    pub async fn presence(&self, instance: &str, now_ms: u64) -> Result<u32, OriginError> {
        let mut conn = self.conn.clone();
        let (_, _, live): (i64, i64, u32) = redis::pipe()
            .cmd("ZADD")
            .arg(INSTANCES_KEY)
            .arg(now_ms)
            .arg(instance)
            .cmd("ZREMRANGEBYSCORE")
            .arg(INSTANCES_KEY)
            .arg("-inf")
            .arg(now_ms.saturating_sub(3 * PEER_WINDOW_MS))
            .cmd("ZCARD")
            .arg(INSTANCES_KEY)
            .query_async(&mut conn)
            .await
            .map_err(backend)?;
        self.prior.store(live.max(1), Ordering::Relaxed);
        Ok(live)
    }

    /// Decides limit by limit (each window key is one script call, in its own slot); if a
    /// later limit denies, the increments of the earlier ones are taken back. Should taking
    /// back fail, the counts stay too high: later requests are denied early, never admitted
    /// beyond the limit.
    pub(crate) async fn decide(
        &self,
        instance: &str,
        limits: &[DecideLimit<'_>],
        now_ms: u64,
    ) -> Result<DecideAnswer, OriginError> {
        let mut conn = self.conn.clone();
        let prior = self.prior.load(Ordering::Relaxed);
        let mut outcomes = Vec::with_capacity(limits.len());
        let mut failed = false;
        for l in limits {
            let d = l.key.duration();
            let sequence = d.sequence(now_ms);
            let (ok, cur, prev, peers): (u8, u64, u64, u32) = self
                .decide
                .key(cell_key(l.key, sequence))
                .key(cell_key(l.key, sequence.saturating_sub(1)))
                .key(peers_key(l.key))
                .arg(l.limit)
                .arg(l.cost)
                .arg(d.as_ms())
                .arg(now_ms)
                .arg(l.unseen)
                .arg(instance)
                .arg(PEER_WINDOW_MS)
                .arg(MAX_PEERS)
                .arg(prior)
                .arg(u8::from(failed))
                .arg(l.global[0])
                .arg(l.global[1])
                .invoke_async(&mut conn)
                .await
                .map_err(backend)?;
            let check = l.check(cur, prev);
            let decision = check.decide(now_ms, 0);
            if decision.success != (ok == 1) {
                tracing::error!(
                    limit = l.limit,
                    cost = l.cost,
                    "decide script and core disagree; the script's verdict stands"
                );
            }
            let dry = failed;
            let counted = ok == 1 && !dry;
            failed |= ok == 0;
            // A limit after the first denial only ran dry: like every other limit of a denied
            // request, it reports what it would have left without this request's cost.
            let decision = strata_core::Decision {
                success: ok == 1,
                ..decision
            };
            outcomes.push(DecideOutcome {
                decision: if dry {
                    decision.uncounted(l.cost)
                } else {
                    decision
                },
                sequence,
                current: if counted {
                    cur.saturating_add(l.cost)
                } else {
                    cur
                },
                previous: prev,
                peers,
            });
        }
        if failed {
            self.roll_back(limits, &mut outcomes, now_ms).await;
        }
        Ok(DecideAnswer {
            success: !failed,
            limits: outcomes,
        })
    }

    /// Takes back the increments of the limits counted before one denied.
    async fn roll_back(
        &self,
        limits: &[DecideLimit<'_>],
        outcomes: &mut [DecideOutcome],
        now_ms: u64,
    ) {
        let mut pipe = redis::pipe();
        let mut taken = 0;
        for (l, o) in limits.iter().zip(outcomes.iter_mut()) {
            // Counted ones are the passes before the first denial (later ones ran dry).
            if !o.decision.success {
                break;
            }
            if l.cost > 0 {
                pipe.cmd("DECRBY")
                    .arg(cell_key(l.key, l.key.duration().sequence(now_ms)))
                    .arg(l.cost)
                    .ignore();
                o.current = o.current.saturating_sub(l.cost);
                taken += 1;
            }
            o.decision = o.decision.uncounted(l.cost);
        }
        if taken == 0 {
            return;
        }
        let mut conn = self.conn.clone();
        if let Err(e) = pipe.query_async::<()>(&mut conn).await {
            tracing::error!(error = %e, cells = taken, "multi-limit rollback failed: those cells stay over-counted until they expire");
        }
    }

    pub(crate) async fn read(
        &self,
        instance: Option<&str>,
        cells: &[CellRead<'_>],
        now_ms: u64,
    ) -> Result<Vec<(u64, u32)>, OriginError> {
        if cells.is_empty() {
            return Ok(Vec::new());
        }
        let keys: Vec<String> = cells.iter().map(|(k, s)| cell_key(*k, *s)).collect();
        let mut pipe = redis::pipe();
        pipe.cmd("MGET").arg(&keys);
        for (key, _) in cells {
            touch_peers(&mut pipe, &peers_key(*key), instance, now_ms, false);
        }
        let mut conn = self.conn.clone();
        let mut replies: Vec<redis::Value> = pipe.query_async(&mut conn).await.map_err(backend)?;
        let first = if replies.is_empty() {
            redis::Value::Nil
        } else {
            replies.remove(0)
        };
        let values: Vec<Option<u64>> = redis::from_redis_value(first)
            .map_err(|e| OriginError::Backend(format!("redis: {e}")))?;
        let prior = self.prior.load(Ordering::Relaxed);
        // Each cell's commands end with ZCARD and ZSCORE (the others are ignored).
        let mut tail = replies.chunks(2);
        Ok(values
            .into_iter()
            .map(|v| {
                let pair = tail.next().unwrap_or_default();
                (
                    v.unwrap_or(0),
                    peers_from(pair.first(), pair.get(1), now_ms, prior),
                )
            })
            .collect())
    }

    pub(crate) async fn replay(
        &self,
        instance: Option<&str>,
        cells: &[CellIncrement<'_>],
        now_ms: u64,
    ) -> Result<Vec<(u64, u32)>, OriginError> {
        if cells.is_empty() {
            return Ok(Vec::new());
        }
        let mut pipe = redis::pipe();
        for c in cells {
            let key = cell_key(c.key, c.sequence);
            let ttl_ms = c.key.duration().as_ms().saturating_mul(3);
            let peers = peers_key(c.key);
            pipe.cmd("MULTI").ignore();
            pipe.cmd("INCRBY").arg(&key).arg(c.cost).ignore();
            pipe.cmd("PEXPIRE").arg(&key).arg(ttl_ms).arg("NX").ignore();
            touch_peers(&mut pipe, &peers, instance, now_ms, true);
            pipe.cmd("EXEC");
        }
        let mut conn = self.conn.clone();
        let results: Vec<Vec<redis::Value>> = pipe.query_async(&mut conn).await.map_err(backend)?;
        let prior = self.prior.load(Ordering::Relaxed);
        Ok(results
            .into_iter()
            .map(|replies| {
                let count = int(replies.first());
                let n = replies.len();
                let peers = peers_from(
                    replies.get(n.wrapping_sub(2)),
                    replies.last(),
                    now_ms,
                    prior,
                );
                (count, peers)
            })
            .collect())
    }

    pub(crate) async fn ping(&self) -> Result<(), OriginError> {
        let mut conn = self.conn.clone();
        let _: String = redis::cmd("PING")
            .query_async(&mut conn)
            .await
            .map_err(backend)?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use strata_core::WindowDuration;

    fn key<'a>(ws: &'a str, ns: &'a str, id: &'a str) -> WindowKeyRef<'a> {
        WindowKeyRef::new(ws, ns, id, WindowDuration::from_ms(60_000).unwrap()).unwrap()
    }

    #[test]
    fn keys_put_the_window_key_in_one_hash_tag() {
        assert_eq!(
            cell_key(key("acme", "api", "user-1"), 7),
            "strata:{acme:api:user-1:60000}:7"
        );
    }

    #[test]
    fn separators_braces_and_bytes_are_encoded() {
        let k = cell_key(key("a:b", "{x}", "ü %"), 1);
        assert_eq!(k, "strata:{a%3Ab:%7Bx%7D:%C3%BC%20%25:60000}:1");
        // Exactly one brace pair: the hash tag is the whole window key.
        assert_eq!(k.matches('{').count(), 1);
        assert_eq!(k.matches('}').count(), 1);
    }

    #[test]
    fn parts_cannot_trade_characters() {
        assert_ne!(
            cell_key(key("ws", "a:b", "c"), 1),
            cell_key(key("ws", "a", "b:c"), 1)
        );
        assert_ne!(
            cell_key(key("ws", "a%3Ab", "c"), 1),
            cell_key(key("ws", "a:b", "c"), 1)
        );
    }
}
