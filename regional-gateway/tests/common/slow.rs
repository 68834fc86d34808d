//! A TCP proxy that holds a server's answers: an origin (Redis, or the gateway the Wasm shells
//! call) that answers late, so calls are in flight while other requests arrive, and answers
//! come when their requests have little time left.

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

/// A TCP proxy on loopback to `target` that delivers each chunk of the target's answers
/// `delay` after it came, like a link with that latency (chunks behind one another keep their
/// spacing, not the delay again each): a server whose calls are in flight that long, so
/// requests sent together all arrive while the first one's call is out. Dropped, it stops
/// accepting.
pub struct SlowProxy {
    pub port: u16,
    task: tokio::task::JoinHandle<()>,
}

impl SlowProxy {
    pub async fn start(target: u16, delay: std::time::Duration) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let task = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                tokio::spawn(async move {
                    let Ok(server) = tokio::net::TcpStream::connect(("127.0.0.1", target)).await
                    else {
                        return;
                    };
                    let (mut client_read, mut client_write) = client.into_split();
                    let (mut server_read, mut server_write) = server.into_split();
                    let up = tokio::spawn(async move {
                        let _ = tokio::io::copy(&mut client_read, &mut server_write).await;
                    });
                    let (chunks, mut due) = tokio::sync::mpsc::unbounded_channel();
                    let down = tokio::spawn(async move {
                        while let Some((at, chunk)) = due.recv().await {
                            tokio::time::sleep_until(at).await;
                            let chunk: Vec<u8> = chunk;
                            if client_write.write_all(&chunk).await.is_err() {
                                break;
                            }
                        }
                    });
                    let mut buf = [0_u8; 8192];
                    loop {
                        match server_read.read(&mut buf).await {
                            Ok(0) | Err(_) => break,
                            Ok(n) => {
                                let at = tokio::time::Instant::now() + delay;
                                if chunks.send((at, buf[..n].to_vec())).is_err() {
                                    break;
                                }
                            }
                        }
                    }
                    drop(chunks);
                    let _ = down.await;
                    up.abort();
                });
            }
        });
        Self { port, task }
    }
}

impl Drop for SlowProxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}
