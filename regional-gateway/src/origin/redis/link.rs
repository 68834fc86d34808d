//! The connection to a region's Redis: one node (a `ConnectionManager`), or a Redis Cluster (a
//! `ClusterConnection`, made on first use, so a gateway starts, and decides locally, while the
//! cluster is down). Every call is bounded by the link's timeout (a replay's bound; the origin
//! client bounds a decision by the origin timeout); the cluster client's own
//! defaults would wait minutes on a dead node.

use std::sync::Arc;
use std::time::Duration;

use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::cluster::{ClusterClient, ClusterClientBuilder};
use redis::cluster_async::ClusterConnection;
use redis::cluster_routing::{RoutingInfo, SingleNodeRoutingInfo};
use redis::{ErrorKind, RedisError, RedisResult, Value};

/// One node or a cluster.
#[derive(Clone)]
pub(super) enum Link {
    /// A single Redis (reconnects on its own).
    Single(ConnectionManager),
    /// A Redis Cluster.
    Cluster(Arc<ClusterLink>),
}

/// A cluster client, its connection once made, and which node holds which slots.
pub(super) struct ClusterLink {
    client: ClusterClient,
    conn: tokio::sync::OnceCell<ClusterConnection>,
    timeout: Duration,
    /// `(first slot, last slot, node address)` from `CLUSTER SLOTS`: read when first needed,
    /// forgotten when a call to a node fails (a slot may have moved), read again next time.
    slots: std::sync::RwLock<Vec<(u16, u16, String)>>,
}

impl Link {
    /// A lazily connecting single-node link.
    pub(super) fn single(url: &str, timeout: Duration) -> RedisResult<Self> {
        let client = redis::Client::open(url)?;
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(timeout))
            .set_response_timeout(Some(timeout))
            .set_number_of_retries(1)
            .set_max_delay(Duration::from_secs(1));
        Ok(Link::Single(ConnectionManager::new_lazy_with_config(
            client, config,
        )?))
    }

    /// A cluster link over `seeds` (any reachable node lets the client learn the rest). A
    /// request, its redirects and retries included, ends within `timeout`.
    pub(super) fn cluster(seeds: &[String], timeout: Duration) -> RedisResult<Self> {
        let client = ClusterClientBuilder::new(seeds.to_vec())
            .connection_timeout(timeout)
            .response_timeout(timeout)
            .overall_response_timeout(Some(timeout))
            .retries(2)
            .min_retry_wait(10)
            .max_retry_wait(100)
            .build()?;
        Ok(Link::Cluster(Arc::new(ClusterLink {
            client,
            conn: tokio::sync::OnceCell::new(),
            timeout,
            slots: std::sync::RwLock::new(Vec::new()),
        })))
    }
}

impl ClusterLink {
    /// The connection, made now if it was not yet (a failure leaves it for the next call).
    pub(super) async fn conn(&self) -> RedisResult<ClusterConnection> {
        self.conn
            .get_or_try_init(|| async {
                tokio::time::timeout(self.timeout, self.client.get_async_connection())
                    .await
                    .map_err(|_| {
                        RedisError::from((
                            ErrorKind::Io,
                            "timed out connecting to the Redis Cluster",
                        ))
                    })?
            })
            .await
            .cloned()
    }
}

impl ClusterLink {
    /// The indices of `keys` grouped by the node that holds them, each group with a slot of
    /// that node to route it by. A key whose slot no node claims goes alone, routed by its
    /// own slot (the client follows the redirect).
    pub(super) async fn by_node(
        &self,
        conn: &mut ClusterConnection,
        keys: &[String],
    ) -> RedisResult<Vec<(u16, Vec<usize>)>> {
        let known = self.slots.read().map(|m| !m.is_empty()).unwrap_or(false);
        if !known {
            let reply = conn
                .route_command(
                    redis::cmd("CLUSTER").arg("SLOTS").clone(),
                    RoutingInfo::SingleNode(SingleNodeRoutingInfo::RandomPrimary),
                )
                .await
                .and_then(|v| v.extract_error())?;
            let map = slot_map(&reply);
            if let Ok(mut slots) = self.slots.write() {
                *slots = map;
            }
        }
        let map = self.slots.read().map(|m| m.clone()).unwrap_or_default();
        let mut groups: std::collections::BTreeMap<String, (u16, Vec<usize>)> =
            std::collections::BTreeMap::new();
        for (i, key) in keys.iter().enumerate() {
            let slot = slot(key);
            let node = map
                .iter()
                .find(|(lo, hi, _)| (*lo..=*hi).contains(&slot))
                .map_or_else(|| format!("slot {slot}"), |(_, _, node)| node.clone());
            groups
                .entry(node)
                .or_insert_with(|| (slot, Vec::new()))
                .1
                .push(i);
        }
        Ok(groups.into_values().collect())
    }

    /// Forgets the slot map (after a failed call: a slot may have moved).
    pub(super) fn forget_slots(&self) {
        if let Ok(mut slots) = self.slots.write() {
            slots.clear();
        }
    }
}

/// `(first slot, last slot, "host:port")` of each range in a `CLUSTER SLOTS` answer.
fn slot_map(reply: &Value) -> Vec<(u16, u16, String)> {
    let Value::Array(ranges) = reply else {
        return Vec::new();
    };
    ranges
        .iter()
        .filter_map(|range| {
            let Value::Array(parts) = range else {
                return None;
            };
            let bound = |v: &Value| match v {
                Value::Int(n) => u16::try_from(*n).ok(),
                _ => None,
            };
            let (Some(lo), Some(hi), Some(Value::Array(primary))) = (
                parts.first().and_then(bound),
                parts.get(1).and_then(bound),
                parts.get(2),
            ) else {
                return None;
            };
            let host = match primary.first()? {
                Value::BulkString(b) => String::from_utf8_lossy(b).into_owned(),
                Value::SimpleString(s) => s.clone(),
                _ => return None,
            };
            let port = match primary.get(1)? {
                Value::Int(p) => *p,
                _ => return None,
            };
            Some((lo, hi, format!("{host}:{port}")))
        })
        .collect()
}

/// The Redis Cluster slot of `key`: CRC16 (XMODEM) of its hash tag (the text between the
/// first `{` and the next `}`, when not empty), else of the whole key, modulo 16384.
pub(super) fn slot(key: &str) -> u16 {
    let bytes = key.as_bytes();
    let tagged = bytes
        .iter()
        .position(|&b| b == b'{')
        .and_then(|open| {
            let rest = &bytes[open + 1..];
            rest.iter()
                .position(|&b| b == b'}')
                .filter(|&close| close > 0)
                .map(|close| &rest[..close])
        })
        .unwrap_or(bytes);
    crc16(tagged) % 16_384
}

fn crc16(data: &[u8]) -> u16 {
    let mut crc: u16 = 0;
    for &byte in data {
        crc ^= u16::from(byte) << 8;
        for _ in 0..8 {
            crc = if crc & 0x8000 != 0 {
                (crc << 1) ^ 0x1021
            } else {
                crc << 1
            };
        }
    }
    crc
}

#[cfg(test)]
mod tests {
    use super::slot;

    #[test]
    fn slots_follow_the_hash_tag_as_redis_computes_them() {
        // Values from `CLUSTER KEYSLOT` (and the Redis Cluster specification's example).
        assert_eq!(slot("123456789"), 12_739);
        assert_eq!(slot("foo"), 12_182);
        assert_eq!(slot("{user1000}.following"), slot("{user1000}.followers"));
        assert_eq!(slot("{user1000}.following"), slot("user1000"));
        // An empty tag is no tag: the whole key is hashed.
        assert_eq!(slot("foo{}{bar}"), crc(b"foo{}{bar}"));
        assert_eq!(slot("foo{{bar}}zap"), slot("{bar"));
    }

    fn crc(data: &[u8]) -> u16 {
        super::crc16(data) % 16_384
    }
}
