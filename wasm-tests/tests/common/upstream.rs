//! The upstream a proxying edge forwards passes to: a loopback HTTP server that answers every
//! request `200 upstream ok`, counts them, and keeps the last one as it arrived.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

#[derive(Debug)]
pub struct Upstream {
    pub base: String,
    hits: Arc<AtomicU64>,
    last: Arc<Mutex<String>>,
    task: tokio::task::JoinHandle<()>,
}

impl Upstream {
    pub async fn start() -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let base = format!("http://{}", listener.local_addr().unwrap());
        let hits = Arc::new(AtomicU64::new(0));
        let last = Arc::new(Mutex::new(String::new()));
        let (counter, kept) = (hits.clone(), last.clone());
        let task = tokio::spawn(async move {
            while let Ok((mut socket, _)) = listener.accept().await {
                let (counter, kept) = (counter.clone(), kept.clone());
                tokio::spawn(async move {
                    let mut seen = Vec::new();
                    let mut buf = [0_u8; 4096];
                    // One request per connection: its head, then its `content-length` bytes of body.
                    while !super::message::is_whole(&seen) {
                        match socket.read(&mut buf).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => seen.extend_from_slice(&buf[..n]),
                        }
                    }
                    *kept.lock().unwrap() = String::from_utf8_lossy(&seen).into_owned();
                    counter.fetch_add(1, Ordering::SeqCst);
                    let body = "upstream ok";
                    let head = format!(
                        "HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
                        body.len()
                    );
                    let _ = socket.write_all(head.as_bytes()).await;
                    let _ = socket.write_all(body.as_bytes()).await;
                    let _ = socket.shutdown().await;
                });
            }
        });
        Self {
            base,
            hits,
            last,
            task,
        }
    }

    /// Its port.
    pub fn port(&self) -> u16 {
        port_of(&self.base)
    }

    /// Requests that reached the upstream.
    pub fn hits(&self) -> u64 {
        self.hits.load(Ordering::SeqCst)
    }

    /// The last request that reached the upstream, head and body, as it arrived.
    pub fn last(&self) -> String {
        self.last.lock().unwrap().clone()
    }
}

impl Drop for Upstream {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// The port of `http://127.0.0.1:<port>`.
pub fn port_of(base: &str) -> u16 {
    base.rsplit(':')
        .next()
        .and_then(|p| p.parse().ok())
        .expect("a loopback URL with a port")
}
