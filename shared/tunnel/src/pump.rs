//! Copying bytes between a socket and an HTTP/2 stream.
//!
//! [`splice`] runs both directions of one tunnelled connection in one task:
//!
//! - socket → stream: read up to `read_chunk_bytes`, wait for HTTP/2 send capacity (the peer's
//!   window — this is the per-stream backpressure), send as DATA. Socket EOF becomes END_STREAM.
//! - stream → socket: write each DATA chunk, then release its flow-control capacity, so the peer
//!   can never have more than one stream window in flight. END_STREAM becomes a socket
//!   shutdown (half-close), the other direction keeps going.
//! - Any error — RST_STREAM from the peer, a socket reset, or a socket write that makes no
//!   progress for `write_stall_timeout` — aborts **both** directions: the stream is reset and a
//!   TCP socket is closed with RST (zero linger), so no side ever sees a clean EOF for a broken
//!   connection, and a target that stops reading can never pin a stream forever.
//!
//! Memory: a [`TcpChunkReader`] allocates read buffers only once its socket is readable, recycles
//! them while data flows and frees them after `IDLE_BUFFER_RELEASE` without data, so 10,000
//! idle streams hold no read buffers.

use std::future::poll_fn;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use prometheus::IntCounter;
use tether_bufpool::BufPool;

use crate::stream::{StreamRx, StreamTx};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};

/// A read buffer unused this long is freed.
pub const IDLE_BUFFER_RELEASE: Duration = Duration::from_millis(250);
/// Reads smaller than this do not get a fresh buffer reservation.
const MIN_READ_SPACE: usize = 4096;

/// Something that yields the bytes read from a socket.
pub trait ChunkReader: Send {
    /// The next chunk, `None` at EOF.
    fn next_chunk(&mut self) -> impl Future<Output = io::Result<Option<Bytes>>> + Send;
}

/// The write side of a socket, which can be closed abortively.
pub trait AbortableWrite: AsyncWrite + Unpin + Send {
    /// Arranges for the connection to be reset rather than closed cleanly when dropped.
    fn abort(&mut self) {}
}

/// Reads from the read half of a TCP socket with buffers that exist only while data flows.
///
/// Each read goes into a `chunk`-sized buffer. A large read is handed to HTTP/2 as it is (no
/// copy); the buffer comes back to this reader's small pool once h2 has written and dropped it,
/// so a busy stream recycles a few buffers instead of allocating (and page-faulting) a fresh
/// one per chunk. A small read is copied out and the buffer kept for the next read. Nothing is
/// allocated before the socket is readable, and everything is freed after
/// [`IDLE_BUFFER_RELEASE`] without data.
pub struct TcpChunkReader {
    rd: OwnedReadHalf,
    chunk: usize,
    current: Option<Vec<u8>>,
    pool: BufPool,
    /// When the last chunk was read (the idle release counts from here).
    last_data: Instant,
    /// The idle-release timer, armed while buffers are held. It is not re-armed per read: when
    /// it fires early (data came since it was set) it moves to `last_data` +
    /// [`IDLE_BUFFER_RELEASE`], so a busy stream touches the timer wheel about once per
    /// release period instead of twice per chunk.
    idle: Option<Pin<Box<tokio::time::Sleep>>>,
}

/// Reads up to this size are copied out of the read buffer rather than handed over.
const COPY_BELOW: usize = 16 << 10;
/// Buffers a reader keeps for reuse (the send buffer holds at most a few chunks).
const POOLED_BUFFERS: usize = 4;

impl TcpChunkReader {
    pub fn new(rd: OwnedReadHalf, chunk: usize) -> Self {
        Self {
            rd,
            chunk,
            current: None,
            pool: BufPool::new(POOLED_BUFFERS),
            last_data: Instant::now(),
            idle: None,
        }
    }

    /// Whether this reader holds no buffer (none allocated yet, or released when idle).
    pub fn is_unbuffered(&self) -> bool {
        self.current.is_none() && !self.pool.is_active() && self.pool.free() == 0
    }

    fn take_buffer(&mut self) -> Vec<u8> {
        if let Some(b) = self.current.take() {
            return b;
        }
        // Not zeroed: reads fill the spare capacity, and a small first read touches one page of
        // it instead of clearing (and faulting in) the whole chunk — a new stream's first byte
        // no longer waits for a 256 KiB memset.
        self.pool.take(self.chunk)
    }

    fn release_buffers(&mut self) {
        self.current = None;
        self.idle = None;
        self.pool.release();
    }
}

impl TcpChunkReader {
    /// Waits until the socket is readable; frees the buffers when nothing came for
    /// [`IDLE_BUFFER_RELEASE`] since the last chunk.
    async fn wait_readable(&mut self) -> io::Result<()> {
        let holding = self.current.is_some() || self.pool.is_active();
        if !holding {
            self.idle = None;
            return self.rd.readable().await;
        }
        loop {
            let release_at = self.last_data + IDLE_BUFFER_RELEASE;
            let idle = self
                .idle
                .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(release_at.into())));
            tokio::select! {
                biased;
                r = self.rd.readable() => return r,
                () = idle.as_mut() => {
                    if Instant::now() >= release_at {
                        self.release_buffers();
                        return self.rd.readable().await;
                    }
                    idle.as_mut().reset(release_at.into());
                }
            }
        }
    }
}

impl ChunkReader for TcpChunkReader {
    async fn next_chunk(&mut self) -> io::Result<Option<Bytes>> {
        loop {
            // Wait for data before holding a buffer; free buffers when none comes for a while.
            self.wait_readable().await?;
            let mut buf = self.take_buffer();
            // One read attempt into the spare capacity through `poll_read` rather than
            // `try_read`: after a short read tokio clears the socket's readiness itself, so the
            // next chunk waits for epoll instead of spending a `recv` that fails with EAGAIN
            // (one syscall per small message, e.g. every request of a request/response
            // exchange). Dropping the pending read loses nothing.
            let polled = {
                let mut read = std::pin::pin!(self.rd.read_buf(&mut buf));
                poll_fn(|cx| Poll::Ready(read.as_mut().poll(cx))).await
            };
            let n = match polled {
                Poll::Pending => {
                    // Spurious readiness: wait again, keeping the buffer.
                    self.current = Some(buf);
                    continue;
                }
                Poll::Ready(Err(e)) => return Err(e),
                Poll::Ready(Ok(n)) => n,
            };
            if n == 0 {
                self.release_buffers();
                return Ok(None);
            }
            self.last_data = Instant::now();
            if n < COPY_BELOW {
                let out = Bytes::copy_from_slice(&buf);
                buf.clear();
                self.current = Some(buf);
                return Ok(Some(out));
            }
            return Ok(Some(self.pool.lend(buf)));
        }
    }
}

/// Reads from any `AsyncRead` (TLS streams) with a reusable buffer.
pub struct AsyncChunkReader<R> {
    rd: R,
    buf: BytesMut,
    chunk: usize,
}

impl<R: AsyncRead + Unpin + Send> AsyncChunkReader<R> {
    pub fn new(rd: R, chunk: usize) -> Self {
        Self {
            rd,
            buf: BytesMut::new(),
            chunk,
        }
    }
}

impl<R: AsyncRead + Unpin + Send> ChunkReader for AsyncChunkReader<R> {
    async fn next_chunk(&mut self) -> io::Result<Option<Bytes>> {
        if self.buf.capacity() - self.buf.len() < MIN_READ_SPACE {
            self.buf.reserve(self.chunk);
        }
        match self.rd.read_buf(&mut self.buf).await? {
            0 => Ok(None),
            _ => Ok(Some(self.buf.split().freeze())),
        }
    }
}

/// The write half of a TCP socket that an abort closes with RST *only*.
///
/// Dropping a tokio `OwnedWriteHalf` shuts its write side down (a FIN). With zero linger set,
/// the final close then sends RST, but the FIN is already on its way and the peer reads it as a
/// clean EOF before the reset arrives — exactly the confusion the tunnel must never cause. On
/// abort this type sets zero linger and *forgets* the write half (no FIN), so the socket is
/// reset when the read half drops. Dropped before its write side was shut down (the stream's
/// future cancelled mid-stream, as at the end of a broker's drain) counts as an abort too.
pub struct ResettableWriteHalf {
    wr: Option<OwnedWriteHalf>,
    /// Its write side was shut down (a FIN sent after every byte): dropping it is clean.
    shut_down: bool,
}

impl ResettableWriteHalf {
    pub fn new(wr: OwnedWriteHalf) -> Self {
        Self {
            wr: Some(wr),
            shut_down: false,
        }
    }

    /// The socket, until an abort forgot it.
    pub fn socket(&self) -> Option<&tokio::net::TcpStream> {
        self.wr.as_ref().map(|w| w.as_ref())
    }
}

impl Drop for ResettableWriteHalf {
    fn drop(&mut self) {
        if !self.shut_down {
            self.abort();
        }
    }
}

fn aborted() -> io::Error {
    io::Error::new(io::ErrorKind::BrokenPipe, "stream aborted")
}

impl AsyncWrite for ResettableWriteHalf {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut().wr.as_mut() {
            Some(w) => Pin::new(w).poll_write(cx, buf),
            None => Poll::Ready(Err(aborted())),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut().wr.as_mut() {
            Some(w) => Pin::new(w).poll_flush(cx),
            None => Poll::Ready(Ok(())),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        match this.wr.as_mut() {
            Some(w) => {
                let r = Pin::new(w).poll_shutdown(cx);
                this.shut_down |= matches!(r, Poll::Ready(Ok(())));
                r
            }
            None => Poll::Ready(Err(aborted())),
        }
    }
}

impl AbortableWrite for ResettableWriteHalf {
    fn abort(&mut self) {
        if let Some(w) = self.wr.take() {
            let _ = w.as_ref().set_zero_linger();
            w.forget();
        }
    }
}

impl<W: AsyncWrite + Unpin + Send> AbortableWrite for tokio::io::WriteHalf<W> {}

/// Byte counters for the two directions of a stream.
#[derive(Clone, Default)]
pub struct ByteCounters {
    /// Bytes read from the socket and sent into the tunnel.
    pub to_tunnel: Option<IntCounter>,
    /// Bytes received from the tunnel and written to the socket.
    pub from_tunnel: Option<IntCounter>,
}

/// How a spliced connection ended.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct SpliceStats {
    pub to_tunnel_bytes: u64,
    pub from_tunnel_bytes: u64,
}

pub use crate::abort::AbortReason;

/// A splice that ended abnormally, with what was transferred before.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{reason}")]
pub struct SpliceError {
    pub reason: AbortReason,
    pub stats: SpliceStats,
}

/// Copies socket → stream until EOF.
async fn socket_to_stream<R: ChunkReader>(
    rd: &mut R,
    tx: &mut StreamTx,
    counter: Option<&IntCounter>,
    total: &mut u64,
) -> Result<(), AbortReason> {
    loop {
        let chunk = tokio::select! {
            biased;
            c = rd.next_chunk() => c.map_err(|e| AbortReason::Socket(e.to_string()))?,
            r = tx.reset_by_peer() => return Err(r),
        };
        let Some(data) = chunk else {
            return tx.finish().await;
        };
        let len = data.len() as u64;
        tx.send(data).await?;
        *total += len;
        if let Some(c) = counter {
            c.inc_by(len);
        }
    }
}

/// Copies stream → socket. Returns on the stream's clean end after shutting the socket's write
/// side.
async fn stream_to_socket<W: AbortableWrite>(
    rx: &mut StreamRx,
    wr: &mut W,
    stall: Duration,
    counter: Option<&IntCounter>,
    total: &mut u64,
) -> Result<(), AbortReason> {
    while let Some(next) = rx.data().await {
        let data = next?;
        let len = data.len();
        let mut off = 0;
        while off < len {
            match tokio::time::timeout(stall, wr.write(&data[off..])).await {
                Ok(Ok(0)) => return Err(AbortReason::Socket("socket closed for writing".into())),
                Ok(Ok(n)) => off += n,
                Ok(Err(e)) => return Err(AbortReason::Socket(e.to_string())),
                Err(_) => return Err(AbortReason::WriteStalled(stall)),
            }
        }
        rx.release(len);
        *total += len as u64;
        if let Some(c) = counter {
            c.inc_by(len as u64);
        }
    }
    // A stream that ends with a reset after its data reports it on the next poll; `data()`
    // returned None only for a clean end.
    match tokio::time::timeout(stall, wr.shutdown()).await {
        Ok(Ok(())) => Ok(()),
        Ok(Err(e)) if e.kind() == io::ErrorKind::NotConnected => Ok(()),
        Ok(Err(e)) => Err(AbortReason::Socket(e.to_string())),
        Err(_) => Err(AbortReason::WriteStalled(stall)),
    }
}

/// Runs both directions until both ended cleanly, or one failed (then both are aborted).
pub async fn splice<R: ChunkReader, W: AbortableWrite>(
    mut rd: R,
    mut wr: W,
    tx: impl Into<StreamTx>,
    rx: impl Into<StreamRx>,
    write_stall_timeout: Duration,
    counters: &ByteCounters,
) -> Result<SpliceStats, SpliceError> {
    let (mut tx, mut rx) = (tx.into(), rx.into());
    let mut up_total = 0u64;
    let mut down_total = 0u64;
    let result = {
        let up = socket_to_stream(&mut rd, &mut tx, counters.to_tunnel.as_ref(), &mut up_total);
        let down = stream_to_socket(
            &mut rx,
            &mut wr,
            write_stall_timeout,
            counters.from_tunnel.as_ref(),
            &mut down_total,
        );
        tokio::pin!(up, down);
        let (mut up_done, mut down_done) = (false, false);
        loop {
            tokio::select! {
                r = &mut up, if !up_done => match r {
                    Ok(()) => up_done = true,
                    Err(e) => break Err(e),
                },
                r = &mut down, if !down_done => match r {
                    Ok(()) => down_done = true,
                    Err(e) => break Err(e),
                },
            }
            if up_done && down_done {
                break Ok(());
            }
        }
    };
    let stats = SpliceStats {
        to_tunnel_bytes: up_total,
        from_tunnel_bytes: down_total,
    };
    match result {
        Ok(()) => Ok(stats),
        Err(reason) => {
            tx.reset();
            wr.abort();
            Err(SpliceError { reason, stats })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::testing::tcp_pair as pair;

    #[tokio::test]
    async fn tcp_reader_recycles_and_releases_buffers() {
        let (mut a, b) = pair().await;
        let (rd, _wr) = b.into_split();
        let mut r = TcpChunkReader::new(rd, 64 << 10);
        assert!(r.is_unbuffered(), "nothing allocated before data");
        let big: Vec<u8> = (0..1_000_000u32).map(|i| (i % 251) as u8).collect();
        let writer = {
            let big = big.clone();
            tokio::spawn(async move {
                a.write_all(&big).await.unwrap();
                a.write_all(b"tail").await.unwrap();
                a
            })
        };
        let mut got = Vec::new();
        while got.len() < big.len() + 4 {
            let c = r.next_chunk().await.unwrap().unwrap();
            assert!(c.len() <= 64 << 10);
            got.extend_from_slice(&c);
        }
        assert_eq!(&got[..big.len()], &big[..]);
        assert_eq!(&got[big.len()..], b"tail");
        let mut a = writer.await.unwrap();
        // Idle: the next read waits past the release delay, then sees EOF without a buffer.
        let eof = tokio::spawn(async move {
            tokio::time::sleep(IDLE_BUFFER_RELEASE * 2).await;
            a.shutdown().await.unwrap();
            a
        });
        assert!(r.next_chunk().await.unwrap().is_none());
        assert!(r.is_unbuffered(), "buffers released while idle");
        drop(eof.await.unwrap());
    }
}
