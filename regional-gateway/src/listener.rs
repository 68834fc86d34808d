//! The gateway's listeners as a hostile network meets them. A bound on open connections: past
//! `--max-connections` the gateway stops accepting and the kernel's backlog holds the rest. A
//! client that stops sending in the middle of a request (headers or body), or stops taking an
//! answer, is disconnected after `--read-timeout` of silence; a kept-alive connection with no
//! request after `--idle-timeout`. An accept that fails for want of file descriptors waits
//! (10 ms, doubling to 1 s) before the next, instead of spinning.
//!
//! The timeouts are on the byte stream, so one rule holds whatever the parser is doing: a
//! connection is *in a request* from its first byte (or its opening) until the gateway writes
//! an answer, and *idle* from then until its next byte.

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::Sleep;
use tonic::transport::server::{Connected, TcpConnectInfo};

/// What a connection may hold the gateway to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ConnectionLimits {
    /// Most connections open at once on one listener.
    pub max_connections: usize,
    /// Longest silence in a request, or in taking an answer; `None`: no bound.
    pub read_timeout: Option<Duration>,
    /// Longest silence between requests; `None`: no bound.
    pub idle_timeout: Option<Duration>,
}

/// Shortest and longest pause after a failed accept.
const ACCEPT_BACKOFF: (Duration, Duration) = (Duration::from_millis(10), Duration::from_secs(1));

/// A TCP listener that hands out at most `max_connections` [`Guarded`] streams at once.
#[derive(Debug)]
pub struct BoundedListener {
    listener: TcpListener,
    permits: Arc<Semaphore>,
    limits: ConnectionLimits,
}

impl BoundedListener {
    /// `listener`, bounded by `limits`.
    pub fn new(listener: TcpListener, limits: ConnectionLimits) -> Self {
        Self {
            listener,
            permits: Arc::new(Semaphore::new(limits.max_connections.max(1))),
            limits,
        }
    }

    /// The next connection, once one of the `max_connections` is free.
    pub async fn next(&mut self) -> (Guarded, SocketAddr) {
        // The semaphore is never closed: an error cannot happen, and would only mean no bound.
        let permit = self.permits.clone().acquire_owned().await.ok();
        let mut backoff = ACCEPT_BACKOFF.0;
        loop {
            match self.listener.accept().await {
                Ok((stream, peer)) => {
                    let _ = stream.set_nodelay(true);
                    return (Guarded::new(stream, permit, self.limits), peer);
                }
                // The peer gave up before it was accepted: nothing wrong here.
                Err(e) if is_connection_error(&e) => {}
                Err(e) => {
                    tracing::warn!(error = %e, pause_ms = backoff.as_millis(), "accept failed (out of file descriptors?); pausing before the next");
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(ACCEPT_BACKOFF.1);
                }
            }
        }
    }

    /// The address it listens on.
    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        self.listener.local_addr()
    }

    /// Its connections as a stream, for tonic's `serve_with_incoming`.
    pub fn incoming(self) -> impl futures_util::Stream<Item = io::Result<Guarded>> + Send {
        futures_util::stream::unfold(self, |mut listener| async move {
            let (stream, _) = listener.next().await;
            Some((Ok(stream), listener))
        })
    }
}

impl axum::serve::Listener for BoundedListener {
    type Io = Guarded;
    type Addr = SocketAddr;

    fn accept(&mut self) -> impl Future<Output = (Guarded, SocketAddr)> + Send {
        self.next()
    }

    fn local_addr(&self) -> io::Result<SocketAddr> {
        BoundedListener::local_addr(self)
    }
}

fn is_connection_error(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::ConnectionRefused
            | io::ErrorKind::ConnectionAborted
            | io::ErrorKind::ConnectionReset
    )
}

/// A connection that holds one of its listener's places until dropped, and fails a read or
/// write that waits past its timeout (the server then closes it).
#[derive(Debug)]
pub struct Guarded {
    stream: TcpStream,
    _place: Option<OwnedSemaphorePermit>,
    limits: ConnectionLimits,
    /// Whether a request is under way: bytes came since the last answer was written.
    in_request: bool,
    read_deadline: Option<Pin<Box<Sleep>>>,
    write_deadline: Option<Pin<Box<Sleep>>>,
}

impl Guarded {
    fn new(
        stream: TcpStream,
        place: Option<OwnedSemaphorePermit>,
        limits: ConnectionLimits,
    ) -> Self {
        Self {
            stream,
            _place: place,
            limits,
            // A client connects to send a request: silence from the start is a stalled one.
            in_request: true,
            read_deadline: None,
            write_deadline: None,
        }
    }

    /// The peer's address.
    pub fn peer_addr(&self) -> io::Result<SocketAddr> {
        self.stream.peer_addr()
    }
}

/// Whether the wait `deadline` (started on the first `Pending` with `timeout`) has run out.
fn expired(
    deadline: &mut Option<Pin<Box<Sleep>>>,
    timeout: Option<Duration>,
    cx: &mut Context<'_>,
) -> bool {
    let Some(timeout) = timeout else {
        return false;
    };
    deadline
        .get_or_insert_with(|| Box::pin(tokio::time::sleep(timeout)))
        .as_mut()
        .poll(cx)
        .is_ready()
}

fn timed_out(what: &str) -> io::Error {
    io::Error::new(
        io::ErrorKind::TimedOut,
        format!("client silent past {what}"),
    )
}

impl AsyncRead for Guarded {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        match Pin::new(&mut this.stream).poll_read(cx, buf) {
            Poll::Ready(result) => {
                this.read_deadline = None;
                if buf.filled().len() > before {
                    this.in_request = true;
                }
                Poll::Ready(result)
            }
            Poll::Pending => {
                let (timeout, what) = if this.in_request {
                    (this.limits.read_timeout, "--read-timeout")
                } else {
                    (this.limits.idle_timeout, "--idle-timeout")
                };
                if expired(&mut this.read_deadline, timeout, cx) {
                    Poll::Ready(Err(timed_out(what)))
                } else {
                    Poll::Pending
                }
            }
        }
    }
}

impl AsyncWrite for Guarded {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        match Pin::new(&mut this.stream).poll_write(cx, data) {
            Poll::Ready(result) => {
                this.write_deadline = None;
                if result.as_ref().is_ok_and(|n| *n > 0) {
                    // An answer is going out: the request is over, and the wait for the next
                    // is an idle one. A read may be waiting already, with nothing but its
                    // deadline to wake it: the deadline moves, it is not dropped.
                    this.in_request = false;
                    match (&mut this.read_deadline, this.limits.idle_timeout) {
                        (Some(deadline), Some(idle)) => {
                            deadline.as_mut().reset(tokio::time::Instant::now() + idle);
                        }
                        (deadline, _) => *deadline = None,
                    }
                }
                Poll::Ready(result)
            }
            Poll::Pending => {
                if expired(&mut this.write_deadline, this.limits.read_timeout, cx) {
                    Poll::Ready(Err(timed_out("--read-timeout (taking an answer)")))
                } else {
                    Poll::Pending
                }
            }
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_shutdown(cx)
    }
}

impl Connected for Guarded {
    type ConnectInfo = TcpConnectInfo;

    fn connect_info(&self) -> TcpConnectInfo {
        self.stream.connect_info()
    }
}
