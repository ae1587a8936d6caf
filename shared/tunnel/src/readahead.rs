//! A read-ahead buffer below TLS that exists only while data flows.
//!
//! rustls asks its transport for a few KiB per read, so a 256 KiB DATA frame costs dozens of
//! `recv` calls; reading the socket in [`READ_AHEAD`] pieces cuts that ~4–16× (measured on the
//! agent: `recvfrom` ÷ 4.2 per byte moved, docs/benchmarks.md). A plain `BufReader` would keep
//! its buffer for the connection's whole life — 64 KiB × 1,000 idle agent tunnels on a broker.
//! [`ReadAhead`] allocates the buffer when a small read finds nothing buffered and frees it as
//! soon as it is drained and the socket has nothing more (the read would block), so an idle
//! tunnel holds none.
//!
//! It also counts the bytes the tunnel receives for its adaptive window
//! ([`ReadAhead::count_into`], see `window`).

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use std::sync::Arc;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use crate::window::AdaptiveWindow;

/// Size of the read-ahead buffer.
pub const READ_AHEAD: usize = 64 << 10;

/// See the module docs. Writes pass straight through.
#[derive(Debug)]
pub struct ReadAhead<T> {
    inner: T,
    buf: Option<Vec<u8>>,
    pos: usize,
    filled: usize,
    counter: Option<Arc<AdaptiveWindow>>,
}

impl<T> ReadAhead<T> {
    pub fn new(inner: T) -> Self {
        Self {
            inner,
            buf: None,
            pos: 0,
            filled: 0,
            counter: None,
        }
    }

    /// Counts every byte read from now on into `window` (the tunnel's received bytes).
    pub fn count_into(&mut self, window: Arc<AdaptiveWindow>) {
        self.counter = Some(window);
    }

    pub fn get_ref(&self) -> &T {
        &self.inner
    }

    /// Whether a buffer is held now (for tests).
    pub fn holds_buffer(&self) -> bool {
        self.buf.is_some()
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for ReadAhead<T> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        out: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let before = out.filled().len();
        let res = this.read_into(cx, out);
        if let Some(c) = &this.counter {
            let n = out.filled().len() - before;
            if n > 0 {
                c.on_received(n);
            }
        }
        res
    }
}

impl<T: AsyncRead + Unpin> ReadAhead<T> {
    fn read_into(&mut self, cx: &mut Context<'_>, out: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let this = self;
        if this.pos < this.filled {
            let buf = this.buf.as_deref().expect("filled implies a buffer");
            let n = (this.filled - this.pos).min(out.remaining());
            out.put_slice(&buf[this.pos..this.pos + n]);
            this.pos += n;
            return Poll::Ready(Ok(()));
        }
        // Nothing buffered: a large read goes straight to the caller's buffer.
        if out.remaining() >= READ_AHEAD {
            this.buf = None;
            return Pin::new(&mut this.inner).poll_read(cx, out);
        }
        // Not zeroed: the read fills the spare capacity, so a small message costs no 64 KiB
        // memset per wake-up (the buffer comes and goes with every burst).
        let buf = this
            .buf
            .get_or_insert_with(|| Vec::with_capacity(READ_AHEAD));
        buf.clear();
        let polled = {
            let mut read = std::pin::pin!(tokio::io::AsyncReadExt::read_buf(&mut this.inner, buf));
            read.as_mut().poll(cx)
        };
        match polled {
            Poll::Ready(Ok(got)) => {
                if got == 0 {
                    this.buf = None;
                    return Poll::Ready(Ok(()));
                }
                let buf = this.buf.as_deref().expect("just filled");
                let n = got.min(out.remaining());
                out.put_slice(&buf[..n]);
                this.pos = n;
                this.filled = got;
                Poll::Ready(Ok(()))
            }
            Poll::Ready(Err(e)) => {
                this.buf = None;
                Poll::Ready(Err(e))
            }
            Poll::Pending => {
                // Drained and the socket is empty: idle until the next wake-up.
                this.buf = None;
                this.pos = 0;
                this.filled = 0;
                Poll::Pending
            }
        }
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for ReadAhead<T> {
    crate::forward_writes!(inner);
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    #[tokio::test]
    async fn small_reads_are_served_from_one_large_read_and_the_buffer_goes_when_idle() {
        let (a, mut b) = tokio::io::duplex(256 << 10);
        let mut r = ReadAhead::new(a);
        let data: Vec<u8> = (0..100_000u32).map(|i| (i % 251) as u8).collect();
        b.write_all(&data).await.unwrap();
        let mut got = Vec::new();
        let mut small = [0u8; 4096];
        while got.len() < data.len() {
            let n = r.read(&mut small).await.unwrap();
            assert!(n > 0);
            got.extend_from_slice(&small[..n]);
        }
        assert_eq!(got, data, "bytes reordered or lost");
        assert!(
            r.holds_buffer(),
            "the last read-ahead is kept until the socket is empty"
        );
        // The next read finds nothing: it frees the buffer and waits.
        let pending =
            tokio::time::timeout(std::time::Duration::from_millis(20), r.read(&mut small)).await;
        assert!(pending.is_err(), "no data expected");
        assert!(!r.holds_buffer(), "an idle reader holds no buffer");
        b.write_all(b"more").await.unwrap();
        drop(b);
        let mut rest = Vec::new();
        r.read_to_end(&mut rest).await.unwrap();
        assert_eq!(rest, b"more");
    }

    #[tokio::test]
    async fn large_reads_bypass_the_buffer() {
        let (a, mut b) = tokio::io::duplex(256 << 10);
        let mut r = ReadAhead::new(a);
        b.write_all(&[7u8; 1000]).await.unwrap();
        let mut big = vec![0u8; READ_AHEAD];
        let n = r.read(&mut big).await.unwrap();
        assert_eq!(n, 1000);
        assert!(!r.holds_buffer());
    }

    #[tokio::test]
    async fn read_ahead_counts_reads_and_wakes_a_waiting_sampler() {
        use std::time::Duration;
        let shared = AdaptiveWindow::new(4 << 20, 16 << 20);
        let (a, mut b) = tokio::io::duplex(1024);
        let mut io = ReadAhead::new(a);
        io.count_into(Arc::clone(&shared));
        let waiter = {
            let shared = Arc::clone(&shared);
            tokio::spawn(async move { shared.wait_for_data(5).await })
        };
        // Let the waiter register before data arrives.
        tokio::time::timeout(Duration::from_secs(5), async {
            while !shared.sampler_waiting() {
                tokio::task::yield_now().await;
            }
        })
        .await
        .expect("sampler waits");
        // 4 bytes do not reach the trigger; the fifth does.
        b.write_all(b"hell").await.unwrap();
        let mut buf = [0u8; 16];
        assert_eq!(io.read(&mut buf).await.unwrap(), 4);
        assert!(shared.sampler_waiting(), "woken before 5 bytes");
        b.write_all(b"o").await.unwrap();
        assert_eq!(io.read(&mut buf).await.unwrap(), 1);
        assert_eq!(shared.received(), 5);
        tokio::time::timeout(Duration::from_secs(5), waiter)
            .await
            .expect("sampler woken by data")
            .unwrap();
    }
}
