//! The regional origin in Redis.
//!
//! Keys: `strata:{<workspace>:<namespace>:<identifier>:<duration_ms>}:<sequence>`, every part
//! percent-encoded except `[A-Za-z0-9._~-]`, so no identifier can forge a separator, a hash
//! tag brace or another tenant's key. The braces make the whole window key the Redis Cluster
//! hash tag: both cells of a window share a slot. A replay batch is one pipelined round trip
//! of `MULTI; INCRBY; PEXPIRE … NX; EXEC` per cell (increment and first-write expiry atomic per
//! cell); a read batch is one `MGET`. Keys expire three windows after their first write.

use std::fmt::Write;
use std::time::Duration;

use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use strata_core::WindowKeyRef;

use super::{CellIncrement, CellRead, OriginError};

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

/// A connection-managed Redis origin (reconnects on its own after failures).
#[derive(Clone)]
pub struct RedisOrigin {
    conn: ConnectionManager,
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
        Ok(Self { conn })
    }

    pub(crate) async fn read(&self, cells: &[CellRead<'_>]) -> Result<Vec<u64>, OriginError> {
        if cells.is_empty() {
            return Ok(Vec::new());
        }
        let keys: Vec<String> = cells.iter().map(|(k, s)| cell_key(*k, *s)).collect();
        let mut conn = self.conn.clone();
        let values: Vec<Option<u64>> = redis::cmd("MGET")
            .arg(&keys)
            .query_async(&mut conn)
            .await
            .map_err(backend)?;
        Ok(values.into_iter().map(|v| v.unwrap_or(0)).collect())
    }

    pub(crate) async fn replay(
        &self,
        cells: &[CellIncrement<'_>],
    ) -> Result<Vec<u64>, OriginError> {
        if cells.is_empty() {
            return Ok(Vec::new());
        }
        let mut pipe = redis::pipe();
        for c in cells {
            let key = cell_key(c.key, c.sequence);
            let ttl_ms = c.key.duration().as_ms().saturating_mul(3);
            pipe.cmd("MULTI")
                .ignore()
                .cmd("INCRBY")
                .arg(&key)
                .arg(c.cost)
                .ignore()
                .cmd("PEXPIRE")
                .arg(&key)
                .arg(ttl_ms)
                .arg("NX")
                .ignore()
                .cmd("EXEC");
        }
        let mut conn = self.conn.clone();
        let results: Vec<(u64, i64)> = pipe.query_async(&mut conn).await.map_err(backend)?;
        Ok(results.into_iter().map(|(count, _)| count).collect())
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
