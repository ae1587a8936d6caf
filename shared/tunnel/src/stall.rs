//! A write-progress timeout for any `AsyncWrite`: [`WriteStallGuard`] fails a write (or flush,
//! or shutdown) that has made no progress for its timeout with `TimedOut`.
//!
//! `pump::splice` times out its own socket writes. Code that hands a socket to a protocol
//! library (hyper on the HTTP service proxy's client side on the broker and upstream side on the
//! agent) wraps the socket in this guard instead: a peer that stops reading while a write waits
//! then fails the connection after the timeout, so it cannot pin the connection, the tunnel
//! stream behind it and its window forever (product.md's leak to design out).
//!
//! The clock starts when a write first returns `Pending` and stops at any progress. Its one
//! timer is created on the first wait and moved only when it fires early (progress came since
//! it was set), so a busy connection does not touch the timer wheel per write. Reads pass
//! through untouched.

use std::future::Future as _;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::{Instant, Sleep};

/// An `AsyncRead + AsyncWrite` whose writes fail after `timeout` without progress.
pub struct WriteStallGuard<T> {
    inner: T,
    timeout: Duration,
    /// When the current wait began (`None`: the last write call made progress).
    since: Option<Instant>,
    timer: Option<Pin<Box<Sleep>>>,
}

impl<T> WriteStallGuard<T> {
    pub fn new(inner: T, timeout: Duration) -> Self {
        Self {
            inner,
            timeout,
            since: None,
            timer: None,
        }
    }

    pub fn get_ref(&self) -> &T {
        &self.inner
    }

    pub fn into_inner(self) -> T {
        self.inner
    }

    /// Passes `r` (the inner write's poll) on, timing a `Pending`.
    fn guard<R>(&mut self, cx: &mut Context<'_>, r: Poll<io::Result<R>>) -> Poll<io::Result<R>> {
        if r.is_ready() {
            self.since = None;
            return r;
        }
        let deadline = *self.since.get_or_insert_with(Instant::now) + self.timeout;
        let timer = self
            .timer
            .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(deadline)));
        if timer.deadline() > deadline {
            timer.as_mut().reset(deadline);
        }
        while timer.as_mut().poll(cx).is_ready() {
            if Instant::now() >= deadline {
                self.since = None;
                return Poll::Ready(Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!("write made no progress for {:?}", self.timeout),
                )));
            }
            // Set for an earlier wait that has since made progress.
            timer.as_mut().reset(deadline);
        }
        Poll::Pending
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for WriteStallGuard<T> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_read(cx, buf)
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for WriteStallGuard<T> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let me = self.get_mut();
        let r = Pin::new(&mut me.inner).poll_write(cx, buf);
        me.guard(cx, r)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let me = self.get_mut();
        let r = Pin::new(&mut me.inner).poll_write_vectored(cx, bufs);
        me.guard(cx, r)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let me = self.get_mut();
        let r = Pin::new(&mut me.inner).poll_flush(cx);
        me.guard(cx, r)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let me = self.get_mut();
        let r = Pin::new(&mut me.inner).poll_shutdown(cx);
        me.guard(cx, r)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

    /// A peer that stops reading: the write fails with `TimedOut` once nothing moved for the
    /// timeout, not before; reads still pass.
    #[tokio::test]
    async fn a_write_that_makes_no_progress_times_out() {
        let (a, mut b) = crate::testing::tcp_pair().await;
        let timeout = Duration::from_millis(300);
        let mut g = WriteStallGuard::new(a, timeout);
        b.write_all(b"ping").await.unwrap();
        let mut got = [0u8; 4];
        g.read_exact(&mut got).await.unwrap();
        assert_eq!(&got, b"ping");
        let chunk = vec![7u8; 1 << 20];
        let started = std::time::Instant::now();
        let mut sent = 0usize;
        let err = loop {
            match g.write(&chunk).await {
                Ok(n) => sent += n,
                Err(e) => break e,
            }
            assert!(
                started.elapsed() < Duration::from_secs(30),
                "the write never timed out"
            );
        };
        assert_eq!(err.kind(), io::ErrorKind::TimedOut, "{err}");
        assert!(sent > 0, "the socket buffers took nothing");
        // The clock runs from the first wait: at least the timeout went by.
        assert!(started.elapsed() >= timeout, "{:?}", started.elapsed());
    }

    /// A slow reader that keeps taking bytes never trips the guard, however long the whole
    /// transfer takes.
    #[tokio::test]
    async fn a_slow_reader_that_keeps_reading_is_not_a_stall() {
        let (a, mut b) = crate::testing::tcp_pair().await;
        // Small socket buffers: the writer waits often, each time only for a few reads.
        for s in [socket2::SockRef::from(&a), socket2::SockRef::from(&b)] {
            s.set_send_buffer_size(32 << 10).unwrap();
            s.set_recv_buffer_size(32 << 10).unwrap();
        }
        let timeout = Duration::from_millis(200);
        let total = 4usize << 20;
        let reader = tokio::spawn(async move {
            let mut buf = vec![0u8; 16 << 10];
            let mut got = 0usize;
            while got < total {
                let n = b.read(&mut buf).await.unwrap();
                assert!(n > 0, "EOF after {got} bytes");
                got += n;
                // The stimulus: a reader slower than the writer (16 KiB per 2 ms at most),
                // never pausing anywhere near the timeout.
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            got
        });
        let mut g = WriteStallGuard::new(a, timeout);
        let chunk = vec![1u8; 256 << 10];
        let started = std::time::Instant::now();
        for _ in 0..total / chunk.len() {
            g.write_all(&chunk).await.unwrap();
        }
        g.flush().await.unwrap();
        assert_eq!(reader.await.unwrap(), total);
        // The transfer outlasted the timeout several times over without failing.
        assert!(
            started.elapsed() > timeout * 2,
            "the transfer was too quick to show anything: {:?}",
            started.elapsed()
        );
    }
}
