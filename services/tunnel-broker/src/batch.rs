//! Writes batched per poll of an HTTP/2 connection: h2 writes each DATA frame with a write of
//! its own and flushes after it, so a download towards a client that allows 16 KiB frames
//! (grpc-go's and tonic's default, so every konnectivity client) costs the broker one syscall
//! per 16 KiB where CONNECT makes one per 256 KiB.
//!
//! Layout: [`batched`] splits an I/O object into [`BatchedIo`] (what hyper reads and writes)
//! and [`FlushAfterPoll`] (wraps the connection future). A small write is copied into a buffer
//! of at most [`BATCH_BYTES`]; h2's flushes return at once; the buffer goes out in one write
//! when it is full, on shutdown, and when a poll of the connection returns — by then h2 has
//! written every frame it could, so nothing waits longer than it would have without the batch.
//! Writes of [`DIRECT_BYTES`] or more (large frames, a full TLS record's worth) go straight
//! through when nothing is buffered, so they are never copied. The buffer is freed when a
//! poll's batch was small (idle and lightly used connections hold none).
//!
//! Both halves share the I/O object through a mutex that only the connection's task takes.
//! A batch that fails to go out after a poll fails every later write, flush and shutdown with
//! that error, and the connection's task is woken once so that h2 meets it at its next flush.
//!
//! Only for HTTP/2-only connections: an HTTP/1.1 upgrade hands the I/O object to another task,
//! whose writes would wait in the batch for a poll of the connection that never comes (so the
//! service proxy's HTTP/1.1-or-HTTP/2 listener does not use it).

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll, ready};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// Most bytes a batch holds before it is written out.
pub const BATCH_BYTES: usize = 128 << 10;
/// Writes from this size up bypass an empty batch (never copied).
pub const DIRECT_BYTES: usize = 32 << 10;
/// A poll whose batch was smaller than this frees the buffer afterwards.
const KEEP_BUFFER_ABOVE: usize = 16 << 10;

struct Shared<IO> {
    io: IO,
    buf: Vec<u8>,
    /// Bytes of `buf` already written.
    written: usize,
    /// Why a batch written out after a poll failed (kind and message): every later write,
    /// flush and shutdown fails with it.
    failed: Option<(io::ErrorKind, String)>,
}

impl<IO: AsyncWrite + Unpin> Shared<IO> {
    /// Writes the whole batch (then flushes the I/O object, so TLS records go out too).
    fn poll_drain(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.check()?;
        while self.written < self.buf.len() {
            let n = ready!(Pin::new(&mut self.io).poll_write(cx, &self.buf[self.written..]))?;
            if n == 0 {
                return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
            }
            self.written += n;
        }
        self.buf.clear();
        self.written = 0;
        Pin::new(&mut self.io).poll_flush(cx)
    }

    /// The failure of an earlier batch, if any.
    fn check(&self) -> io::Result<()> {
        match &self.failed {
            Some((kind, why)) => Err(io::Error::new(
                *kind,
                format!("writing a batch of HTTP/2 frames failed: {why}"),
            )),
            None => Ok(()),
        }
    }
}

/// Splits `io` into the batched I/O object hyper uses and the handle that writes each poll's
/// batch out (give it to [`FlushAfterPoll::new`] with the connection future).
pub fn batched<IO>(io: IO) -> (BatchedIo<IO>, Flusher<IO>) {
    let shared = Arc::new(Mutex::new(Shared {
        io,
        buf: Vec::new(),
        written: 0,
        failed: None,
    }));
    (BatchedIo(Arc::clone(&shared)), Flusher(shared))
}

fn lock<IO>(s: &Mutex<Shared<IO>>) -> MutexGuard<'_, Shared<IO>> {
    // Only the connection's task takes the lock, and nothing in it panics while holding it.
    s.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The I/O object with batched writes (see the module docs).
pub struct BatchedIo<IO>(Arc<Mutex<Shared<IO>>>);

/// Writes a connection's batch out after each poll of it.
pub struct Flusher<IO>(Arc<Mutex<Shared<IO>>>);

impl<IO: AsyncRead + Unpin> AsyncRead for BatchedIo<IO> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut lock(&self.0).io).poll_read(cx, buf)
    }
}

impl<IO: AsyncWrite + Unpin> BatchedIo<IO> {
    fn write_slices(
        &self,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let mut s = lock(&self.0);
        s.check()?;
        let total: usize = bufs.iter().map(|b| b.len()).sum();
        if s.buf.len() + total > BATCH_BYTES {
            ready!(s.poll_drain(cx))?;
        }
        if s.buf.is_empty() && total >= DIRECT_BYTES {
            return Pin::new(&mut s.io).poll_write_vectored(cx, bufs);
        }
        if s.buf.capacity() == 0 {
            s.buf.reserve_exact(BATCH_BYTES);
        }
        // After a drain the batch is empty and `total` < DIRECT_BYTES fits; otherwise it fitted.
        for b in bufs {
            s.buf.extend_from_slice(b);
        }
        Poll::Ready(Ok(total))
    }
}

impl<IO: AsyncWrite + Unpin> AsyncWrite for BatchedIo<IO> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        self.write_slices(cx, &[io::IoSlice::new(buf)])
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        self.write_slices(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        true
    }

    /// Returns at once (with an earlier batch's failure, if any): the batch goes out when the
    /// poll of the connection returns.
    fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(lock(&self.0).check())
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let mut s = lock(&self.0);
        ready!(s.poll_drain(cx))?;
        Pin::new(&mut s.io).poll_shutdown(cx)
    }
}

impl<IO: AsyncWrite + Unpin> Flusher<IO> {
    /// Writes the batch out. The first failure is kept for every later write, flush and
    /// shutdown, and wakes the connection's task so that h2 meets it at its next flush.
    fn poll_write_out(&self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let mut s = lock(&self.0);
        let batch = s.buf.len();
        if let Err(e) = ready!(s.poll_drain(cx)) {
            if s.failed.is_none() {
                s.failed = Some((e.kind(), e.to_string()));
                cx.waker().wake_by_ref();
            }
            return Poll::Ready(Err(e));
        }
        if batch < KEEP_BUFFER_ABOVE {
            s.buf = Vec::new();
        }
        Poll::Ready(Ok(()))
    }
}

/// A connection future whose batch is written out each time a poll of it returns.
pub struct FlushAfterPoll<C, IO> {
    pub conn: Pin<Box<C>>,
    flusher: Flusher<IO>,
}

impl<C, IO> FlushAfterPoll<C, IO> {
    pub fn new(conn: Pin<Box<C>>, flusher: Flusher<IO>) -> Self {
        Self { conn, flusher }
    }
}

impl<C, IO, E> Future for FlushAfterPoll<C, IO>
where
    C: Future<Output = Result<(), E>>,
    IO: AsyncWrite + Unpin,
{
    type Output = Result<(), E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.get_mut();
        let r = this.conn.as_mut().poll(cx);
        // Pending: the socket is full and wakes this task when it drains. An error is kept
        // and reaches the connection through its next flush (`Flusher::poll_write_out`).
        if let Poll::Ready(Err(e)) = this.flusher.poll_write_out(cx) {
            tracing::debug!(error = %e, "writing a batch of HTTP/2 frames failed");
        }
        r
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::Duration;

    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _, DuplexStream};

    use super::*;

    /// A pipe end that counts the writes reaching it.
    struct Counted {
        io: DuplexStream,
        writes: Arc<AtomicUsize>,
    }

    impl AsyncRead for Counted {
        fn poll_read(
            mut self: Pin<&mut Self>,
            cx: &mut Context<'_>,
            buf: &mut ReadBuf<'_>,
        ) -> Poll<io::Result<()>> {
            Pin::new(&mut self.io).poll_read(cx, buf)
        }
    }

    impl AsyncWrite for Counted {
        fn poll_write(
            mut self: Pin<&mut Self>,
            cx: &mut Context<'_>,
            buf: &[u8],
        ) -> Poll<io::Result<usize>> {
            let r = Pin::new(&mut self.io).poll_write(cx, buf);
            if r.is_ready() {
                self.writes.fetch_add(1, Ordering::SeqCst);
            }
            r
        }

        fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
            Pin::new(&mut self.io).poll_flush(cx)
        }

        fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
            Pin::new(&mut self.io).poll_shutdown(cx)
        }
    }

    /// A batched end of a pipe with `capacity` bytes in flight, the other end, and the count of
    /// writes reaching the pipe.
    fn pipe(
        capacity: usize,
    ) -> (
        BatchedIo<Counted>,
        Flusher<Counted>,
        DuplexStream,
        Arc<AtomicUsize>,
    ) {
        let (near, far) = tokio::io::duplex(capacity);
        let writes = Arc::new(AtomicUsize::new(0));
        let (io, flusher) = batched(Counted {
            io: near,
            writes: Arc::clone(&writes),
        });
        (io, flusher, far, writes)
    }

    /// `n` bytes numbered from `from` (so reordering or loss shows).
    fn pattern(from: usize, n: usize) -> Vec<u8> {
        (from..from + n).map(|i| (i % 251) as u8).collect()
    }

    const WAIT: Duration = Duration::from_secs(10);

    #[tokio::test]
    async fn frames_written_in_one_poll_leave_in_one_write_after_it() {
        let (mut io, flusher, mut far, writes) = pipe(1 << 20);
        let (_hold, held) = tokio::sync::oneshot::channel::<()>();
        let frame = 16 << 10;
        // Like h2 in one poll: six 16 KiB frames, each written and flushed, then waiting.
        let conn = Box::pin(async move {
            for i in 0..6 {
                io.write_all(&pattern(i * frame, frame)).await?;
                io.flush().await?;
            }
            assert_eq!(
                writes_now(&io),
                0,
                "nothing is written before the poll returns"
            );
            let _ = held.await;
            Ok::<(), io::Error>(())
        });
        let mut conn = FlushAfterPoll::new(conn, flusher);
        assert!(futures::poll!(&mut conn).is_pending());
        assert_eq!(
            writes.load(Ordering::SeqCst),
            1,
            "one write for the whole batch"
        );
        let mut got = vec![0; 6 * frame];
        tokio::time::timeout(WAIT, far.read_exact(&mut got))
            .await
            .expect("the batch arrives")
            .expect("read");
        assert!(
            got == pattern(0, 6 * frame),
            "bytes arrive whole and in order"
        );
    }

    fn writes_now(io: &BatchedIo<Counted>) -> usize {
        lock(&io.0).io.writes.load(Ordering::SeqCst)
    }

    #[tokio::test]
    async fn large_writes_bypass_an_empty_batch_and_small_batches_free_the_buffer() {
        let (mut io, flusher, mut far, writes) = pipe(1 << 20);
        let large = pattern(0, DIRECT_BYTES);
        io.write_all(&large).await.expect("write");
        assert_eq!(writes.load(Ordering::SeqCst), 1, "written through at once");
        assert_eq!(lock(&io.0).buf.capacity(), 0, "never copied");

        io.write_all(b"small").await.expect("write");
        assert_eq!(
            writes.load(Ordering::SeqCst),
            1,
            "a small write waits for the poll's end"
        );
        let waker = futures::task::noop_waker();
        let mut cx = Context::from_waker(&waker);
        assert!(flusher.poll_write_out(&mut cx).is_ready());
        assert_eq!(
            lock(&io.0).buf.capacity(),
            0,
            "a small batch frees its buffer"
        );

        let mut got = vec![0; DIRECT_BYTES + 5];
        tokio::time::timeout(WAIT, far.read_exact(&mut got))
            .await
            .expect("the bytes arrive")
            .expect("read");
        assert!(got[..DIRECT_BYTES] == large[..] && &got[DIRECT_BYTES..] == b"small");
    }

    #[tokio::test]
    async fn a_full_peer_holds_the_batch_and_every_byte_still_arrives_in_order() {
        // The pipe holds 4 KiB: every batch waits for the reader, many times over.
        let (mut io, flusher, mut far, _writes) = pipe(4 << 10);
        let total = 3 * BATCH_BYTES + 777;
        let conn = Box::pin(async move {
            let data = pattern(0, total);
            for chunk in data.chunks(10_000) {
                io.write_all(chunk).await?;
                io.flush().await?;
            }
            io.shutdown().await
        });
        let task = tokio::spawn(FlushAfterPoll::new(conn, flusher));
        let mut got = Vec::new();
        tokio::time::timeout(WAIT, far.read_to_end(&mut got))
            .await
            .expect("the stream ends")
            .expect("read");
        assert_eq!(got.len(), total);
        assert!(got == pattern(0, total), "bytes arrive whole and in order");
        task.await
            .expect("task")
            .expect("the connection ends cleanly");
    }

    #[tokio::test]
    async fn a_failed_batch_fails_every_later_flush_and_write_with_its_cause() {
        let (mut io, flusher, far, _writes) = pipe(1 << 20);
        io.write_all(b"never delivered").await.expect("write");
        drop(far);
        let woken = Arc::new(WakeCount::default());
        let waker = std::task::Waker::from(Arc::clone(&woken));
        let mut cx = Context::from_waker(&waker);
        let Poll::Ready(Err(e)) = flusher.poll_write_out(&mut cx) else {
            panic!("writing to a closed pipe fails");
        };
        assert_eq!(e.kind(), io::ErrorKind::BrokenPipe);
        assert_eq!(woken.0.load(Ordering::SeqCst), 1, "the connection is woken");
        assert!(flusher.poll_write_out(&mut cx).is_ready());
        assert_eq!(
            woken.0.load(Ordering::SeqCst),
            1,
            "woken once, not in a loop"
        );

        let e = io.flush().await.expect_err("the flush reports the failure");
        assert_eq!(e.kind(), io::ErrorKind::BrokenPipe);
        assert!(
            e.to_string()
                .contains("writing a batch of HTTP/2 frames failed"),
            "{e}"
        );
        let e = io.write_all(b"more").await.expect_err("so does a write");
        assert_eq!(e.kind(), io::ErrorKind::BrokenPipe);
        assert!(io.shutdown().await.is_err(), "and a shutdown");
    }

    /// Counts wake-ups.
    #[derive(Default)]
    struct WakeCount(AtomicUsize);

    impl std::task::Wake for WakeCount {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    #[tokio::test]
    async fn shutdown_writes_the_batch_before_the_end_of_stream() {
        let (mut io, _flusher, mut far, _writes) = pipe(1 << 20);
        io.write_all(b"last words").await.expect("write");
        io.shutdown().await.expect("shutdown");
        let mut got = Vec::new();
        tokio::time::timeout(WAIT, far.read_to_end(&mut got))
            .await
            .expect("the stream ends")
            .expect("read");
        assert_eq!(got, b"last words");
    }
}
