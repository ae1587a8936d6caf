//! A TCP relay that adds a fixed one-way delay in each direction: a long-RTT "link" for the
//! tunnel's own flow control without kernel network emulation (this kernel has no `netem`).
//!
//! The relay terminates TCP on both sides (its sockets are loopback-fast), so it emulates what
//! matters to HTTP/2 flow control — bytes take `delay` to cross, a window is only refilled a
//! round trip later — not packet loss or TCP congestion control. Each direction holds at most
//! [`QUEUE_CHUNKS`] reads in flight (bounded memory; a full queue stops reading, which pushes
//! back on the sender like a full link). A read error ends that direction like an EOF (a write
//! shutdown), so it is not for tests of abort propagation.

use std::net::SocketAddr;
use std::time::Duration;

use bytes::BytesMut;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio::time::Instant;

/// Reads in flight per direction (each at most [`READ_CHUNK`]): 512 × 64 KiB = 32 MiB.
pub const QUEUE_CHUNKS: usize = 512;
/// Largest single read.
pub const READ_CHUNK: usize = 64 << 10;
/// Time allowed to connect upstream.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// A listening delay relay; stops accepting when dropped (open connections end with their
/// peers).
pub struct DelayLink {
    pub addr: SocketAddr,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for DelayLink {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl DelayLink {
    /// Listens on 127.0.0.1:0 and relays every connection to `upstream`, each direction delayed
    /// by `one_way`.
    pub async fn start(upstream: SocketAddr, one_way: Duration) -> std::io::Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let task = tokio::spawn(async move {
            while let Ok((down, _)) = listener.accept().await {
                tokio::spawn(async move {
                    let Ok(Ok(up)) =
                        tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(upstream)).await
                    else {
                        return;
                    };
                    let _ = down.set_nodelay(true);
                    let _ = up.set_nodelay(true);
                    let (dr, dw) = down.into_split();
                    let (ur, uw) = up.into_split();
                    tokio::join!(pipe(dr, uw, one_way), pipe(ur, dw, one_way));
                });
            }
        });
        Ok(Self { addr, task })
    }
}

/// One direction: read, stamp, deliver `delay` later; EOF is delivered (as a write shutdown)
/// after the data before it.
async fn pipe(
    mut rd: tokio::net::tcp::OwnedReadHalf,
    mut wr: tokio::net::tcp::OwnedWriteHalf,
    delay: Duration,
) {
    let (tx, mut rx) = mpsc::channel::<(Instant, Option<BytesMut>)>(QUEUE_CHUNKS);
    let reader = async move {
        loop {
            let mut buf = BytesMut::with_capacity(READ_CHUNK);
            let n = rd.read_buf(&mut buf).await.unwrap_or(0);
            let item = (n > 0).then_some(buf);
            let end = item.is_none();
            if tx.send((Instant::now() + delay, item)).await.is_err() || end {
                return;
            }
        }
    };
    let writer = async move {
        while let Some((due, item)) = rx.recv().await {
            tokio::time::sleep_until(due).await;
            match item {
                Some(buf) => {
                    if wr.write_all(&buf).await.is_err() {
                        return;
                    }
                }
                None => {
                    let _ = wr.shutdown().await;
                    return;
                }
            }
        }
    };
    tokio::join!(reader, writer);
}
