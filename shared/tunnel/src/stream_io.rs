//! A tunnel stream as a byte stream: [`StreamIo`] is `AsyncRead + AsyncWrite` over a stream's
//! two halves, for code that speaks a protocol on the stream itself (the HTTP service proxy's
//! HTTP/1.1, hyper's client on the broker and hyper's server on the agent) instead of splicing
//! it to a socket.
//!
//! Before it, those ends reached hyper through an in-memory pipe spliced to the stream: every
//! byte was copied into the pipe and out of it again, on both ends, and woke a splice task in
//! between (a large LIST through the service proxy spent 11 % of the broker's and of the agent's
//! CPU in the pipe). Here hyper reads and writes the stream directly:
//!
//! - **read**: the stream's chunks are copied into the caller's buffer (the one copy any
//!   `AsyncRead` makes), their window released to the peer as they are handed out. The peer's
//!   end is EOF; a reset or a lost tunnel is `ConnectionReset`, never EOF.
//! - **write**: waits for the stream's credit (the peer's window: the backpressure), one frame
//!   at most per write, sent from the caller's buffer ([`StreamTx::poll_send_from`]). A
//!   vectored write (hyper's queue: a head and body chunks) goes out as one frame of up to
//!   `max_frame_bytes` straight from its slices ([`StreamTx::poll_send_vectored`]), so hyper
//!   keeps its queueing write strategy, never flattens a body into its own buffer, and a body
//!   that arrives in 16 KiB pieces (an upstream's HTTP/2 frames) does not become a frame, a TLS
//!   write and a `send` per piece.
//! - **shutdown**: the stream's end (FIN) behind everything written.
//! - **drop** before both directions ended: the halves' own drop resets the stream, so the peer
//!   sees an abort, never a clean end of a cut-off body.
//!
//! A write that waits for credit has no timeout here: as with `pump::splice`, the end that
//! writes to a socket times out a write that makes no progress ([`crate::stall`]), and its reset
//! ends this wait.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use bytes::{Buf as _, Bytes};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use crate::abort::AbortReason;
use crate::pump::{ByteCounters, SpliceStats};
use crate::stream::{StreamRx, StreamTx};

/// A tunnel stream as `AsyncRead + AsyncWrite` (module docs).
pub struct StreamIo {
    tx: StreamTx,
    rx: StreamRx,
    /// Received bytes not read yet.
    pending: Bytes,
    /// The peer ended its direction and every byte was read.
    read_eof: bool,
    /// This direction ended (FIN sent).
    shut: bool,
    /// The stream failed (reset by the peer, its tunnel lost).
    failed: Option<AbortReason>,
    counters: ByteCounters,
    stats: SpliceStats,
}

impl StreamIo {
    /// `counters`: bytes sent into the stream (`to_tunnel`) and read from it (`from_tunnel`).
    pub fn new(tx: impl Into<StreamTx>, rx: impl Into<StreamRx>, counters: ByteCounters) -> Self {
        Self {
            tx: tx.into(),
            rx: rx.into(),
            pending: Bytes::new(),
            read_eof: false,
            shut: false,
            failed: None,
            counters,
            stats: SpliceStats::default(),
        }
    }

    /// Bytes moved so far each way.
    pub fn stats(&self) -> SpliceStats {
        self.stats.clone()
    }

    /// How the stream stands: `Ok` once this side ended its direction with no failure seen
    /// (the peer's end may still be on its way), else why it did not end cleanly.
    pub fn outcome(&self) -> Result<(), AbortReason> {
        match &self.failed {
            Some(e) => Err(e.clone()),
            None if self.shut => Ok(()),
            None => Err(AbortReason::Cancelled(
                "the stream was dropped before its end was sent".into(),
            )),
        }
    }

    fn fail(&mut self, e: AbortReason) -> io::Error {
        let err = io::Error::new(
            io::ErrorKind::ConnectionReset,
            format!("tunnel stream aborted: {e}"),
        );
        self.failed.get_or_insert(e);
        err
    }

    fn poll_send(
        &mut self,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        if self.shut {
            return Poll::Ready(Err(io::Error::new(
                io::ErrorKind::BrokenPipe,
                "write after the stream's end was sent",
            )));
        }
        let n = match ready!(self.tx.poll_send_vectored(cx, bufs)) {
            Ok(n) => n,
            Err(e) => return Poll::Ready(Err(self.fail(e))),
        };
        if let Some(c) = &self.counters.to_tunnel {
            c.inc_by(n as u64);
        }
        self.stats.to_tunnel_bytes += n as u64;
        Poll::Ready(Ok(n))
    }
}

impl AsyncRead for StreamIo {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let me = self.get_mut();
        loop {
            if !me.pending.is_empty() {
                let n = me.pending.len().min(buf.remaining());
                buf.put_slice(&me.pending[..n]);
                me.pending.advance(n);
                me.rx.release(n);
                if let Some(c) = &me.counters.from_tunnel {
                    c.inc_by(n as u64);
                }
                me.stats.from_tunnel_bytes += n as u64;
                return Poll::Ready(Ok(()));
            }
            if me.read_eof || buf.remaining() == 0 {
                return Poll::Ready(Ok(()));
            }
            match ready!(me.rx.poll_data(cx)) {
                Some(Ok(b)) => me.pending = b,
                Some(Err(e)) => return Poll::Ready(Err(me.fail(e))),
                None => me.read_eof = true,
            }
        }
    }
}

impl AsyncWrite for StreamIo {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        self.get_mut().poll_send(cx, &[io::IoSlice::new(buf)])
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        self.get_mut().poll_send(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        true
    }

    fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        // Frames go to the connection's writer as they are sent; nothing waits here.
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        let me = self.get_mut();
        if !me.shut {
            me.shut = true;
            if let Err(e) = me.tx.finish_now() {
                return Poll::Ready(Err(me.fail(e)));
            }
        }
        Poll::Ready(Ok(()))
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use bytes::Bytes;
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    use tokio::sync::mpsc;

    use super::*;
    use crate::mux::{self, Config, Incoming, OnOpen, Open, Role};

    const DEADLINE: Duration = Duration::from_secs(10);
    const MAX_FRAME: usize = 64 << 10;

    /// A `tether-tunnel/2` connection over real loopback TCP and one stream on it: the
    /// opener's [`StreamIo`] and the acceptor's halves.
    /// The opener's `Mux` comes back too: the connection lives while the test holds it.
    async fn stream() -> (StreamIo, mux::SendHalf, mux::RecvHalf, mux::Mux) {
        let (a, b) = crate::testing::tcp_pair().await;
        let cfg = Config {
            max_frame_bytes: MAX_FRAME,
            stream_window_bytes: 256 << 10,
            connection_window_bytes: 1 << 30,
            max_streams: 10,
        };
        let (tx, mut rx) = mpsc::channel::<Incoming>(1);
        let on_open: OnOpen = Arc::new(move |inc: Incoming| {
            let tx = tx.clone();
            tokio::spawn(async move { tx.send(inc).await });
        });
        let (_acceptor, driver, _ev) = mux::connect(b, Role::Acceptor, cfg.clone(), Some(on_open));
        tokio::spawn(async move {
            let (_keep, _ev) = (_acceptor, _ev);
            driver.run().await
        });
        let (opener, driver, _ev2) = mux::connect(a, Role::Opener, cfg, None);
        tokio::spawn(driver.run());
        let open = Open {
            target: "t:1".into(),
            cluster: "c".into(),
            tag: 1,
            dial_timeout_ms: 0,
            trace: Vec::new(),
        };
        let opening = tokio::spawn(async move {
            let halves = opener.open(&open, &Bytes::new()).await;
            (opener, halves)
        });
        let inc = tokio::time::timeout(DEADLINE, rx.recv())
            .await
            .expect("the OPEN arrives")
            .expect("an incoming stream");
        inc.responder.ok().await.unwrap();
        let (opener, halves) = opening.await.unwrap();
        let (send, recv) = halves.unwrap();
        (
            StreamIo::new(send, recv, ByteCounters::default()),
            inc.send,
            inc.recv,
            opener,
        )
    }

    async fn read_all(rx: &mut mux::RecvHalf) -> Result<Vec<u8>, AbortReason> {
        let mut out = Vec::new();
        while let Some(d) = tokio::time::timeout(DEADLINE, rx.data())
            .await
            .expect("the peer's bytes arrive")
        {
            let d = d?;
            rx.release(d.len());
            out.extend_from_slice(&d);
        }
        Ok(out)
    }

    /// Bytes both ways, in order, with each direction's end: a vectored write larger than a
    /// frame (many slices, as hyper's queue) arrives whole, the peer's end reads as EOF, and
    /// the stream counts what it moved.
    #[tokio::test]
    async fn moves_bytes_both_ways_and_ends_cleanly() {
        let (mut io, mut tx, mut rx, _conn) = stream().await;
        // A head and body chunks, 300 KiB in all: several frames of at most MAX_FRAME.
        let head = b"HTTP/1.1 200 OK\r\ncontent-length: 307200\r\n\r\n".to_vec();
        let chunks: Vec<Vec<u8>> = (0..19u8).map(|i| vec![i; 16 << 10]).collect();
        let mut want = head.clone();
        for c in &chunks {
            want.extend_from_slice(c);
        }
        let writer = async {
            let mut slices: Vec<io::IoSlice<'_>> = std::iter::once(&head[..])
                .chain(chunks.iter().map(|c| &c[..]))
                .map(io::IoSlice::new)
                .collect();
            let mut bufs = &mut slices[..];
            while !bufs.is_empty() {
                let n = io.write_vectored(bufs).await.unwrap();
                assert!(n > 0 && n <= MAX_FRAME, "one write is one frame: {n}");
                io::IoSlice::advance_slices(&mut bufs, n);
            }
            io.shutdown().await.unwrap();
            io
        };
        let (mut io, got) = tokio::join!(writer, read_all(&mut rx));
        assert_eq!(got.unwrap(), want);
        assert_eq!(io.stats().to_tunnel_bytes, want.len() as u64);
        assert!(io.outcome().is_ok());

        tx.send(Bytes::from_static(b"answer")).await.unwrap();
        tx.finish().await.unwrap();
        let mut back = Vec::new();
        tokio::time::timeout(DEADLINE, io.read_to_end(&mut back))
            .await
            .expect("EOF arrives")
            .unwrap();
        assert_eq!(back, b"answer");
        assert_eq!(io.stats().from_tunnel_bytes, 6);
        // Past the end: still EOF, and writes after the shutdown fail.
        assert_eq!(io.read(&mut [0u8; 8]).await.unwrap(), 0);
        let e = io.write(b"late").await.unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::BrokenPipe, "{e}");
    }

    /// A peer's reset is an error on read, never an EOF, and the outcome names it.
    #[tokio::test]
    async fn a_reset_by_the_peer_is_an_error_not_an_eof() {
        let (mut io, mut tx, _rx, _conn) = stream().await;
        tx.send(Bytes::from_static(b"part")).await.unwrap();
        let mut got = [0u8; 4];
        io.read_exact(&mut got).await.unwrap();
        tx.reset();
        let e = tokio::time::timeout(DEADLINE, io.read(&mut [0u8; 64]))
            .await
            .expect("the reset arrives")
            .unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::ConnectionReset, "{e}");
        assert!(io.outcome().is_err());
    }

    /// Dropped before its end was sent (a body cut off): the peer sees a reset, not a clean
    /// end of a shorter body.
    #[tokio::test]
    async fn dropped_before_its_end_the_peer_sees_an_abort() {
        let (mut io, _tx, mut rx, _conn) = stream().await;
        io.write_all(b"the first half of a body").await.unwrap();
        assert!(io.outcome().is_err(), "not ended: {:?}", io.outcome());
        drop(io);
        let r = read_all(&mut rx).await;
        assert!(r.is_err(), "a cut-off stream read as a clean end: {r:?}");
    }
}
