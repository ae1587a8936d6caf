//! A TCP relay that adds a fixed one-way delay in each direction: a long-RTT "link" for the
//! tunnel's own flow control without kernel network emulation (this kernel has no `netem`).
//!
//! The relay terminates TCP on both sides (its sockets are loopback-fast), so it emulates what
//! matters to HTTP/2 flow control — bytes take `delay` to cross, a window is only refilled a
//! round trip later — not packet loss or TCP congestion control. Each direction holds at most
//! [`QUEUE_CHUNKS`] reads in flight (bounded memory; a full queue stops reading, which pushes
//! back on the sender like a full link). A read error ends that direction like an EOF (a write
//! shutdown), so it is not for tests of abort propagation.
//!
//! [`DelayLink::blackhole_existing`] wedges the connections open at that moment: from then on
//! they drop every byte (and any EOF) in both directions while their sockets stay open — packets
//! lost below TLS with no FIN or RST, the stall the wedged-tunnel watchdog must catch
//! (`tests/tests/wedged_tunnel.rs`). Connections accepted later are relayed normally.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
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
    wedge: Arc<Wedge>,
}

/// Which connections of a link are blackholed: those numbered below `cutoff`.
#[derive(Debug, Default)]
struct Wedge {
    accepted: AtomicU64,
    cutoff: AtomicU64,
    /// Cancelled when the link is dropped: wedged connections hold their sockets until then.
    dropped: tokio_util::sync::CancellationToken,
}

impl Wedge {
    fn blackholed(&self, conn: u64) -> bool {
        conn < self.cutoff.load(Ordering::Relaxed)
    }
}

impl Drop for DelayLink {
    fn drop(&mut self) {
        self.task.abort();
        self.wedge.dropped.cancel();
    }
}

impl DelayLink {
    /// Listens on 127.0.0.1:0 and relays every connection to `upstream`, each direction delayed
    /// by `one_way`.
    pub async fn start(upstream: SocketAddr, one_way: Duration) -> std::io::Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let wedge = Arc::new(Wedge::default());
        let w = Arc::clone(&wedge);
        let task = tokio::spawn(async move {
            while let Ok((down, _)) = listener.accept().await {
                let conn = w.accepted.fetch_add(1, Ordering::Relaxed);
                let w = Arc::clone(&w);
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
                    let (w1, w2) = ((Arc::clone(&w), conn), (w, conn));
                    tokio::join!(pipe(dr, uw, one_way, w1), pipe(ur, dw, one_way, w2));
                });
            }
        });
        Ok(Self { addr, task, wedge })
    }

    /// Wedges every connection accepted so far: their bytes and EOFs are dropped from now on,
    /// their sockets stay open. Returns how many connections that wedged.
    pub fn blackhole_existing(&self) -> u64 {
        let n = self.wedge.accepted.load(Ordering::Relaxed);
        self.wedge.cutoff.store(n, Ordering::Relaxed);
        n
    }

    /// Connections accepted so far.
    pub fn accepted(&self) -> u64 {
        self.wedge.accepted.load(Ordering::Relaxed)
    }
}

/// One direction: read, stamp, deliver `delay` later; EOF is delivered (as a write shutdown)
/// after the data before it.
async fn pipe(
    mut rd: tokio::net::tcp::OwnedReadHalf,
    mut wr: tokio::net::tcp::OwnedWriteHalf,
    delay: Duration,
    (wedge, conn): (Arc<Wedge>, u64),
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
            if wedge.blackholed(conn) {
                continue; // dropped on the floor: no bytes, no FIN
            }
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
        if wedge.blackholed(conn) {
            // Dropping the write half would send a FIN: a wedged link never does.
            wedge.dropped.cancelled().await;
        }
    };
    tokio::join!(reader, writer);
}
