//! A simulated WAN in user space: a TCP proxy per link that holds every chunk of bytes for the
//! link's one-way delay, plus jitter, in each direction. This kernel has no `netem`, and regions
//! meet only in the global SQL store, so a delay on each region's way to the store is the WAN
//! between regions: a count published by one region reaches another after two one-way delays
//! (flush, then sync) on top of the cadences.
//!
//! Jitter never reorders bytes: a chunk is delivered at its own due time or right after the
//! chunk before it, whichever is later, as TCP delivers a stream in order. The proxy lives in
//! the lab's process and stops with it (nothing to tear down on Ctrl-C).

use std::net::SocketAddr;
use std::time::Duration;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::Result;

/// One link's delay, each way.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Link {
    /// The one-way delay.
    pub delay: Duration,
    /// Each chunk's delay is `delay` plus or minus up to this, uniformly.
    pub jitter: Duration,
}

impl Link {
    /// A chunk's one-way delay.
    fn sample(&self, rng: &mut StdRng) -> Duration {
        if self.jitter.is_zero() {
            return self.delay;
        }
        let j = self.jitter.as_secs_f64();
        let d = self.delay.as_secs_f64() + rng.random_range(-j..=j);
        Duration::from_secs_f64(d.max(0.0))
    }

    /// `50ms±5ms` for the report.
    pub fn describe(&self) -> String {
        format!(
            "{} ms ± {} ms one way",
            self.delay.as_millis(),
            self.jitter.as_millis()
        )
    }
}

/// A listening proxy on loopback to `target` across a [`Link`]; aborted on drop.
#[derive(Debug)]
pub struct DelayProxy {
    /// The loopback port it listens on.
    pub port: u16,
    task: JoinHandle<()>,
}

impl DelayProxy {
    /// Listens on a free loopback port and forwards every connection to `target`.
    pub async fn start(target: SocketAddr, link: Link, seed: u64) -> Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .map_err(|e| format!("the WAN proxy cannot listen: {e}"))?;
        let port = listener
            .local_addr()
            .map_err(|e| format!("the WAN proxy's address: {e}"))?
            .port();
        let task = tokio::spawn(async move {
            let mut n = 0_u64;
            while let Ok((client, _)) = listener.accept().await {
                n += 1;
                let seed = seed.wrapping_mul(1_000_003).wrapping_add(n);
                tokio::spawn(async move {
                    // A refused upstream closes the client's connection, as the store would.
                    if let Ok(upstream) = TcpStream::connect(target).await {
                        join(client, upstream, link, seed).await;
                    }
                });
            }
        });
        Ok(Self { port, task })
    }
}

impl Drop for DelayProxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn join(client: TcpStream, upstream: TcpStream, link: Link, seed: u64) {
    let _ = client.set_nodelay(true);
    let _ = upstream.set_nodelay(true);
    let (client_read, client_write) = client.into_split();
    let (upstream_read, upstream_write) = upstream.into_split();
    let there = tokio::spawn(carry(
        client_read,
        upstream_write,
        link,
        StdRng::seed_from_u64(seed),
    ));
    let back = carry(
        upstream_read,
        client_write,
        link,
        StdRng::seed_from_u64(seed ^ 0x5eed),
    );
    back.await;
    let _ = there.await;
}

/// Carries one direction: a reader stamps each chunk with its due time, a writer delivers it
/// then; the end of the stream is delayed like data.
async fn carry(
    mut from: impl AsyncReadExt + Unpin,
    mut to: impl AsyncWriteExt + Unpin + Send + 'static,
    link: Link,
    mut rng: StdRng,
) {
    let (tx, mut rx) = mpsc::unbounded_channel::<(Instant, Option<Vec<u8>>)>();
    let writer = tokio::spawn(async move {
        while let Some((due, chunk)) = rx.recv().await {
            tokio::time::sleep_until(due).await;
            match chunk {
                Some(bytes) => {
                    if to.write_all(&bytes).await.is_err() {
                        return;
                    }
                }
                None => {
                    let _ = to.shutdown().await;
                    return;
                }
            }
        }
    });
    let mut last = Instant::now();
    let mut buf = vec![0_u8; 64 * 1024];
    loop {
        let read = from.read(&mut buf).await;
        let due = (Instant::now() + link.sample(&mut rng)).max(last);
        last = due;
        let chunk = match read {
            Ok(n) if n > 0 => buf.get(..n).map(<[u8]>::to_vec),
            _ => None,
        };
        let end = chunk.is_none();
        if tx.send((due, chunk)).is_err() || end {
            break;
        }
    }
    drop(tx);
    let _ = writer.await;
}

/// A `scheme://[user@]host[:port][/path]` URL in its parts: scheme, `user@` (or empty), host
/// with its port, and path (or empty).
fn url_parts(url: &str) -> (&str, &str, &str, &str) {
    let (scheme, rest) = url.split_once("://").unwrap_or(("mysql", url));
    let (authority, path) = rest.split_at(rest.find('/').unwrap_or(rest.len()));
    let (user, host) = match authority.rfind('@') {
        Some(at) => authority.split_at(at + 1),
        None => ("", authority),
    };
    (scheme, user, host, path)
}

/// The `host:port` of a `mysql://user@host:port/...` URL (port 3306 when absent), resolved.
pub async fn server_address(url: &str) -> Result<SocketAddr> {
    let (_, _, host, _) = url_parts(url);
    let host = if host.contains(':') {
        host.to_string()
    } else {
        format!("{host}:3306")
    };
    tokio::net::lookup_host(&host)
        .await
        .map_err(|e| format!("cannot resolve {host}: {e}"))?
        .next()
        .ok_or_else(|| format!("{host} resolves to no address"))
}

/// `url` with its `host:port` replaced by `127.0.0.1:<port>` (the proxy's), user and path kept.
pub fn through(url: &str, port: u16) -> String {
    let (scheme, user, _, path) = url_parts(url);
    format!("{scheme}://{user}127.0.0.1:{port}{path}")
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code

    use super::*;

    async fn echo_server() -> SocketAddr {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            while let Ok((mut s, _)) = listener.accept().await {
                tokio::spawn(async move {
                    let (mut r, mut w) = s.split();
                    let _ = tokio::io::copy(&mut r, &mut w).await;
                });
            }
        });
        addr
    }

    #[test]
    fn a_url_goes_through_the_proxy_with_its_user_and_path() {
        assert_eq!(
            through("mysql://root@db.example:3307/strata_x", 4000),
            "mysql://root@127.0.0.1:4000/strata_x"
        );
        assert_eq!(
            through("mysql://u:p@127.0.0.1:3306", 9),
            "mysql://u:p@127.0.0.1:9"
        );
    }

    #[tokio::test]
    async fn the_address_of_a_url_defaults_to_port_3306() {
        let a = server_address("mysql://root@127.0.0.1").await.unwrap();
        assert_eq!(a, "127.0.0.1:3306".parse().unwrap());
        let b = server_address("mysql://u:p@127.0.0.1:4406/db")
            .await
            .unwrap();
        assert_eq!(b.port(), 4406);
    }

    /// A round trip across the link takes two one-way delays, and every byte arrives in order
    /// however the jitter falls.
    #[tokio::test]
    async fn a_round_trip_takes_two_delays_and_keeps_every_byte_in_order() {
        let link = Link {
            delay: Duration::from_millis(40),
            jitter: Duration::from_millis(20),
        };
        let proxy = DelayProxy::start(echo_server().await, link, 7)
            .await
            .unwrap();
        let mut s = TcpStream::connect(("127.0.0.1", proxy.port)).await.unwrap();
        s.set_nodelay(true).unwrap();
        let mut rtts = Vec::new();
        for round in 0..5_u8 {
            let sent = Instant::now();
            s.write_all(&[round; 3]).await.unwrap();
            let mut got = [0_u8; 3];
            s.read_exact(&mut got).await.unwrap();
            rtts.push(sent.elapsed());
            assert_eq!(got, [round; 3]);
        }
        // Each way at least delay - jitter (20 ms), at most delay + jitter (60 ms) plus slack.
        for rtt in &rtts {
            assert!(*rtt >= Duration::from_millis(40), "{rtts:?}");
            assert!(*rtt < Duration::from_millis(400), "{rtts:?}");
        }
        // Many small writes at once: jitter would reorder them if the proxy let it.
        let (mut r, mut w) = s.into_split();
        let writer = tokio::spawn(async move {
            for i in 0..200_u32 {
                w.write_all(&i.to_be_bytes()).await.unwrap();
                tokio::task::yield_now().await;
            }
            w.shutdown().await.unwrap();
        });
        let mut all = Vec::new();
        r.read_to_end(&mut all).await.unwrap();
        writer.await.unwrap();
        let got: Vec<u32> = all
            .chunks(4)
            .map(|c| u32::from_be_bytes(c.try_into().unwrap()))
            .collect();
        assert_eq!(got, (0..200).collect::<Vec<_>>());
    }

    /// Dropping the proxy stops it listening.
    #[tokio::test]
    async fn a_dropped_proxy_refuses_new_connections() {
        let link = Link {
            delay: Duration::from_millis(1),
            jitter: Duration::ZERO,
        };
        let proxy = DelayProxy::start(echo_server().await, link, 1)
            .await
            .unwrap();
        let port = proxy.port;
        drop(proxy);
        tokio::task::yield_now().await;
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            if TcpStream::connect(("127.0.0.1", port)).await.is_err() {
                break;
            }
            assert!(Instant::now() < deadline, "port {port} still accepts");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}
