//! Writes batched per poll of an HTTP/2 connection: h2 writes each DATA frame with a write of
//! its own and flushes after it, so a download towards a client that allows 16 KiB frames
//! (grpc-go's and tonic's default, so every konnectivity client) costs the broker one syscall
//! per 16 KiB where CONNECT makes one per 256 KiB.
//!
//! Layout: [`batched`] splits an I/O object into [`BatchedIo`] (what hyper reads and writes)
//! and [`FlushAfterPoll`] (wraps the connection future). A small write joins a batch of at
//! most [`BATCH_BYTES`]; h2's flushes return at once; the batch goes out in one (vectored)
//! write when it is full, on shutdown, and when a poll of the connection returns — by then h2
//! has written every frame it could, so nothing waits longer than it would have without the
//! batch. Writes of [`DIRECT_BYTES`] or more (large frames, a full TLS record's worth) go
//! straight through when nothing is batched. The buffers are freed when a poll's batch was
//! small (idle and lightly used connections hold none).
//!
//! What joins a batch is copied, except a slice of a payload lent through [`Payloads`]: a
//! response body offers each large DATA payload before hyper hands it to h2 (konnectivity's
//! `PacketBody` does), and the batch then keeps h2's writes from that payload as slices of it
//! (a reference count, no copy), so a batch of 16 KiB frames is frame headers copied and
//! payload referenced. Lending needs an I/O object that takes vectored writes (TCP, rustls);
//! on another the batch copies everything.
//!
//! Both halves share the I/O object through a mutex that only the connection's task takes.
//! A batch that fails to go out after a poll fails every later write, flush and shutdown with
//! that error, and the connection's task is woken once so that h2 meets it at its next flush.
//!
//! Only for HTTP/2-only connections: an HTTP/1.1 upgrade hands the I/O object to another task,
//! whose writes would wait in the batch for a poll of the connection that never comes. The gRPC
//! port uses it, and the service proxy for the connections whose client chose `h2` (its
//! HTTP/1.1 connections, which may be upgraded, do not).

use std::collections::VecDeque;
use std::future::Future;
use std::io;
use std::ops::Range;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll, ready};
use std::time::{Duration, Instant};

use bytes::Bytes;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// Most bytes a batch holds before it is written out.
pub const BATCH_BYTES: usize = 128 << 10;
/// Writes from this size up bypass an empty batch (never copied).
pub const DIRECT_BYTES: usize = 32 << 10;
/// A poll whose batch was smaller than this frees the buffer afterwards.
const KEEP_BUFFER_ABOVE: usize = 16 << 10;
/// Parts (copied runs and lent slices) a batch holds before it is written out; also the most
/// slices one vectored write carries.
const MAX_PARTS: usize = 64;
/// Payloads shorter than this are not offered for lending (h2 copies payloads under 256 bytes
/// into its own buffer anyway, and a lookup costs more than copying a few hundred bytes).
pub const LEND_ABOVE: usize = 1 << 10;
/// Payloads offered for lending at most, per connection (the oldest is forgotten first).
pub const LENT_PAYLOADS: usize = 16;
/// A payload offered this long ago is forgotten: its stream was reset or waits on a client
/// that does not read, and the registry should not keep its buffer from the pool.
pub const LENT_FOR: Duration = Duration::from_secs(1);

/// One run of a batch: bytes copied into the batch's buffer, or a slice of a lent payload.
enum Part {
    Copied(Range<usize>),
    Lent(Bytes),
}

struct Shared<IO> {
    io: IO,
    /// Copied bytes: frame headers, small frames, payloads not lent.
    copied: Vec<u8>,
    /// The batch, in order.
    parts: Vec<Part>,
    /// Bytes in `parts`.
    len: usize,
    /// Bytes of the batch already written.
    written: usize,
    /// Why a batch written out after a poll failed (kind and message): every later write,
    /// flush and shutdown fails with it.
    failed: Option<(io::ErrorKind, String)>,
    /// Payloads this batch may reference instead of copying.
    payloads: Payloads,
}

impl<IO: AsyncWrite + Unpin> Shared<IO> {
    /// Writes the whole batch (then flushes the I/O object, so TLS records go out too).
    fn poll_drain(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.check()?;
        let Shared {
            io,
            copied,
            parts,
            len,
            written,
            ..
        } = self;
        while *written < *len {
            let mut slices = [io::IoSlice::new(&[]); MAX_PARTS];
            let (mut n, mut at) = (0, 0);
            for part in parts.iter() {
                let bytes = match part {
                    Part::Copied(r) => &copied[r.clone()],
                    Part::Lent(b) => &b[..],
                };
                let end = at + bytes.len();
                if end > *written {
                    slices[n] = io::IoSlice::new(&bytes[(*written).max(at) - at..]);
                    n += 1;
                    if n == MAX_PARTS {
                        break;
                    }
                }
                at = end;
            }
            let w = if n == 1 {
                ready!(Pin::new(&mut *io).poll_write(cx, &slices[0]))?
            } else {
                ready!(Pin::new(&mut *io).poll_write_vectored(cx, &slices[..n]))?
            };
            if w == 0 {
                return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
            }
            *written += w;
        }
        copied.clear();
        parts.clear();
        *len = 0;
        *written = 0;
        Pin::new(io).poll_flush(cx)
    }

    /// Appends `b` to the batch: by reference when it is part of a lent payload, else copied.
    fn push(&mut self, b: &[u8]) {
        if b.is_empty() {
            return;
        }
        self.len += b.len();
        if let Some(lent) = self.payloads.find(b) {
            self.parts.push(Part::Lent(lent));
            return;
        }
        if self.copied.capacity() == 0 {
            // Without lending the whole batch may be copied; with it, mostly frame headers.
            let cap = if self.payloads.is_on() {
                KEEP_BUFFER_ABOVE
            } else {
                BATCH_BYTES
            };
            self.copied.reserve_exact(cap);
        }
        let start = self.copied.len();
        self.copied.extend_from_slice(b);
        let end = self.copied.len();
        match self.parts.last_mut() {
            Some(Part::Copied(r)) if r.end == start => r.end = end,
            _ => self.parts.push(Part::Copied(start..end)),
        }
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

/// Payloads that a connection's batch may send by reference instead of copying them: a body
/// offers each large DATA payload before handing it to hyper ([`Payloads::offer`]); when h2
/// then writes a slice that lies inside an offered payload, the batch keeps a slice of that
/// payload (`Bytes::slice`, a reference count) instead of a copy. The match is by address: the
/// registry holds a reference to each offered payload, so its memory stays allocated and
/// unchanged, and a slice within it can only be that payload's bytes. A payload leaves the
/// registry when h2 writes its last byte, when [`LENT_PAYLOADS`] newer ones push it out, or
/// after [`LENT_FOR`]. A default (or copy-only) registry lends nothing.
#[derive(Clone, Default)]
pub struct Payloads(Option<Arc<Mutex<Offered>>>);

/// Offered payloads, oldest first, with the time of their offer.
type Offered = VecDeque<(Bytes, Instant)>;

impl Payloads {
    fn on() -> Self {
        Self(Some(Arc::default()))
    }

    fn is_on(&self) -> bool {
        self.0.is_some()
    }

    /// Offers `payload`, about to be handed to h2, for sending by reference.
    pub fn offer(&self, payload: &Bytes) {
        let Some(q) = &self.0 else { return };
        if payload.len() < LEND_ABOVE {
            return;
        }
        let now = Instant::now();
        let mut q = lock(q);
        expire(&mut q, now);
        if q.len() == LENT_PAYLOADS {
            q.pop_front();
        }
        q.push_back((payload.clone(), now));
    }

    /// A slice of the offered payload that `b` lies in, if any; a payload whose last byte this
    /// is leaves the registry.
    fn find(&self, b: &[u8]) -> Option<Bytes> {
        let q = self.0.as_ref()?;
        if b.len() < LEND_ABOVE {
            return None;
        }
        let (addr, len) = (b.as_ptr() as usize, b.len());
        let mut q = lock(q);
        let i = q.iter().position(|(p, _)| {
            let start = p.as_ptr() as usize;
            addr >= start && addr + len <= start + p.len()
        })?;
        let payload = &q[i].0;
        let off = addr - payload.as_ptr() as usize;
        let slice = payload.slice(off..off + len);
        if off + len == payload.len() {
            q.remove(i);
        }
        Some(slice)
    }

    /// Forgets payloads offered more than [`LENT_FOR`] ago.
    fn expire(&self) {
        if let Some(q) = &self.0 {
            expire(&mut lock(q), Instant::now());
        }
    }

    /// Payloads currently offered.
    #[cfg(test)]
    fn offered(&self) -> usize {
        self.0.as_ref().map_or(0, |q| lock(q).len())
    }
}

fn expire(q: &mut Offered, now: Instant) {
    while q
        .front()
        .is_some_and(|(_, at)| now.duration_since(*at) > LENT_FOR)
    {
        q.pop_front();
    }
}

/// Splits `io` into the batched I/O object hyper uses and the handle that writes each poll's
/// batch out (give it to [`FlushAfterPoll::new`] with the connection future). When `io` takes
/// vectored writes, payloads offered through [`Flusher::payloads`] are sent by reference.
pub fn batched<IO: AsyncWrite>(io: IO) -> (BatchedIo<IO>, Flusher<IO>) {
    let payloads = if io.is_write_vectored() {
        Payloads::on()
    } else {
        Payloads::default()
    };
    let shared = Arc::new(Mutex::new(Shared {
        io,
        copied: Vec::new(),
        parts: Vec::new(),
        len: 0,
        written: 0,
        failed: None,
        payloads,
    }));
    (BatchedIo(Arc::clone(&shared)), Flusher(shared))
}

fn lock<T>(s: &Mutex<T>) -> MutexGuard<'_, T> {
    // Nothing panics while holding these locks.
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
        if s.len + total > BATCH_BYTES || s.parts.len() + bufs.len() > MAX_PARTS {
            ready!(s.poll_drain(cx))?;
        }
        if s.len == 0 && total >= DIRECT_BYTES {
            let r = Pin::new(&mut s.io).poll_write_vectored(cx, bufs);
            if let Poll::Ready(Ok(n)) = r {
                // A lent payload written through leaves the registry with its last byte.
                let mut left = n;
                for b in bufs {
                    let b = &b[..left.min(b.len())];
                    left -= b.len();
                    s.payloads.find(b);
                }
            }
            return r;
        }
        // After a drain the batch is empty and `total` < DIRECT_BYTES fits; otherwise it fitted.
        for b in bufs {
            s.push(b);
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
    /// The connection's lending registry, for the bodies of its responses.
    pub fn payloads(&self) -> Payloads {
        lock(&self.0).payloads.clone()
    }

    /// Writes the batch out. The first failure is kept for every later write, flush and
    /// shutdown, and wakes the connection's task so that h2 meets it at its next flush.
    fn poll_write_out(&self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let mut s = lock(&self.0);
        let batch = s.len;
        if let Err(e) = ready!(s.poll_drain(cx)) {
            if s.failed.is_none() {
                s.failed = Some((e.kind(), e.to_string()));
                cx.waker().wake_by_ref();
            }
            return Poll::Ready(Err(e));
        }
        if batch < KEEP_BUFFER_ABOVE {
            s.copied = Vec::new();
            s.parts = Vec::new();
        }
        s.payloads.expire();
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

impl<C, IO> Future for FlushAfterPoll<C, IO>
where
    C: Future,
    IO: AsyncWrite + Unpin,
{
    type Output = C::Output;

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

    /// A pipe end that counts the writes reaching it; `vectored`: it takes vectored writes
    /// (as TCP and rustls do), so the batch may lend.
    struct Counted {
        io: DuplexStream,
        writes: Arc<AtomicUsize>,
        vectored: bool,
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

        fn poll_write_vectored(
            self: Pin<&mut Self>,
            cx: &mut Context<'_>,
            bufs: &[io::IoSlice<'_>],
        ) -> Poll<io::Result<usize>> {
            if !self.vectored {
                let first = bufs.iter().find(|b| !b.is_empty()).map_or(&[][..], |b| b);
                return self.poll_write(cx, first);
            }
            let all: Vec<u8> = bufs.iter().flat_map(|b| b.iter().copied()).collect();
            self.poll_write(cx, &all)
        }

        fn is_write_vectored(&self) -> bool {
            self.vectored
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
        pipe_with(capacity, false)
    }

    fn pipe_with(
        capacity: usize,
        vectored: bool,
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
            vectored,
        });
        (io, flusher, far, writes)
    }

    /// Writes `frames` like h2 does: each as one vectored write of a 9-byte header and its
    /// payload, then a flush. Returns the bytes the peer should see.
    async fn write_frames(io: &mut BatchedIo<Counted>, frames: &[Bytes]) -> Vec<u8> {
        let mut expect = Vec::new();
        for (i, f) in frames.iter().enumerate() {
            let head = [i as u8; 9];
            let bufs = [io::IoSlice::new(&head), io::IoSlice::new(f)];
            let n = std::future::poll_fn(|cx| Pin::new(&mut *io).poll_write_vectored(cx, &bufs))
                .await
                .expect("write");
            assert_eq!(n, 9 + f.len(), "the batch takes the whole frame");
            io.flush().await.expect("flush");
            expect.extend_from_slice(&head);
            expect.extend_from_slice(f);
        }
        expect
    }

    #[tokio::test]
    async fn an_offered_payload_is_sent_by_reference_and_leaves_with_its_last_byte() {
        let (mut io, flusher, mut far, writes) = pipe_with(1 << 20, true);
        let payloads = flusher.payloads();
        let frame = 16 << 10;
        let payload = Bytes::from(pattern(0, 4 * frame));
        payloads.offer(&payload);
        assert_eq!(payloads.offered(), 1);
        let frames: Vec<Bytes> = (0..4)
            .map(|i| payload.slice(i * frame..(i + 1) * frame))
            .collect();
        let expect = write_frames(&mut io, &frames).await;
        {
            let s = lock(&io.0);
            assert_eq!(s.copied.len(), 4 * 9, "only the frame headers are copied");
            assert_eq!(
                s.parts
                    .iter()
                    .filter(|p| matches!(p, Part::Lent(_)))
                    .count(),
                4,
                "each payload slice is a reference"
            );
        }
        assert_eq!(payloads.offered(), 0, "gone with its last byte");
        let waker = futures::task::noop_waker();
        let mut cx = Context::from_waker(&waker);
        assert!(matches!(
            flusher.poll_write_out(&mut cx),
            Poll::Ready(Ok(()))
        ));
        assert_eq!(writes.load(Ordering::SeqCst), 1, "one write for the batch");
        let mut got = vec![0; expect.len()];
        tokio::time::timeout(WAIT, far.read_exact(&mut got))
            .await
            .expect("the batch arrives")
            .expect("read");
        assert!(
            got == expect,
            "headers and payloads arrive whole and in order"
        );
    }

    #[tokio::test]
    async fn bytes_not_offered_are_copied_even_when_equal_to_an_offered_payload() {
        let (mut io, flusher, _far, _writes) = pipe_with(1 << 20, true);
        let payloads = flusher.payloads();
        let offered = Bytes::from(pattern(0, 8 << 10));
        payloads.offer(&offered);
        // The same bytes at another address: not the offered payload.
        let twin = Bytes::from(pattern(0, 8 << 10));
        write_frames(&mut io, &[twin]).await;
        let s = lock(&io.0);
        assert_eq!(s.copied.len(), 9 + (8 << 10), "copied");
        assert!(s.parts.iter().all(|p| matches!(p, Part::Copied(_))));
        drop(s);
        assert_eq!(
            payloads.offered(),
            1,
            "the offered payload is still waiting"
        );
    }

    #[tokio::test]
    async fn lending_is_bounded_and_off_without_vectored_writes() {
        let (_io, flusher, _far, _writes) = pipe_with(1 << 20, true);
        let payloads = flusher.payloads();
        let first = Bytes::from(pattern(0, 4 << 10));
        payloads.offer(&first);
        for i in 0..LENT_PAYLOADS {
            payloads.offer(&Bytes::from(pattern(i, 4 << 10)));
        }
        assert_eq!(payloads.offered(), LENT_PAYLOADS, "at most LENT_PAYLOADS");
        assert!(payloads.find(&first).is_none(), "the oldest was forgotten");
        payloads.offer(&Bytes::from_static(&[1; LEND_ABOVE - 1]));
        assert_eq!(
            payloads.offered(),
            LENT_PAYLOADS,
            "small payloads are not offered"
        );

        let (_io, flusher, _far, _writes) = pipe_with(1 << 20, false);
        let payloads = flusher.payloads();
        payloads.offer(&first);
        assert_eq!(payloads.offered(), 0, "a copying batch takes no offers");
    }

    #[tokio::test]
    async fn a_payload_written_straight_through_leaves_the_registry() {
        let (mut io, flusher, mut far, writes) = pipe_with(1 << 20, true);
        let payloads = flusher.payloads();
        let payload = Bytes::from(pattern(0, DIRECT_BYTES));
        payloads.offer(&payload);
        let expect = write_frames(&mut io, std::slice::from_ref(&payload)).await;
        assert_eq!(writes.load(Ordering::SeqCst), 1, "written through at once");
        assert_eq!(payloads.offered(), 0);
        let mut got = vec![0; expect.len()];
        tokio::time::timeout(WAIT, far.read_exact(&mut got))
            .await
            .expect("the frame arrives")
            .expect("read");
        assert!(got == expect);
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
        assert_eq!(lock(&io.0).copied.capacity(), 0, "never copied");

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
            lock(&io.0).copied.capacity(),
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
        let (got, ()) = drive(conn, flusher, &mut far).await;
        assert_eq!(got.len(), total);
        assert!(got == pattern(0, total), "bytes arrive whole and in order");
    }

    /// Runs `conn` under [`FlushAfterPoll`] while reading `far` to its end: the bytes read and
    /// what `conn` returned.
    async fn drive<C, T>(
        conn: Pin<Box<C>>,
        flusher: Flusher<Counted>,
        far: &mut DuplexStream,
    ) -> (Vec<u8>, T)
    where
        C: Future<Output = io::Result<T>> + Send + 'static,
        T: Send + 'static,
    {
        let task = tokio::spawn(FlushAfterPoll::new(conn, flusher));
        let mut got = Vec::new();
        tokio::time::timeout(WAIT, far.read_to_end(&mut got))
            .await
            .expect("the stream ends")
            .expect("read");
        let out = task
            .await
            .expect("task")
            .expect("the connection ends cleanly");
        (got, out)
    }

    #[tokio::test]
    async fn lent_slices_written_in_pieces_to_a_full_peer_still_arrive_in_order() {
        // A 4 KiB pipe: every vectored write is cut short, inside headers and payloads alike.
        let (mut io, flusher, mut far, _writes) = pipe_with(4 << 10, true);
        let payloads = flusher.payloads();
        let (frame, per_payload) = (16 << 10, 4);
        let total = 3 * BATCH_BYTES;
        let data = Bytes::from(pattern(0, total));
        let conn = Box::pin(async move {
            let mut expect = Vec::new();
            for p in 0..total / (frame * per_payload) {
                let payload = data.slice(p * frame * per_payload..(p + 1) * frame * per_payload);
                payloads.offer(&payload);
                let frames: Vec<Bytes> = (0..per_payload)
                    .map(|i| payload.slice(i * frame..(i + 1) * frame))
                    .collect();
                expect.extend(write_frames(&mut io, &frames).await);
            }
            assert_eq!(
                payloads.offered(),
                0,
                "every payload left with its last byte"
            );
            io.shutdown().await?;
            Ok::<_, io::Error>(expect)
        });
        let (got, expect) = drive(conn, flusher, &mut far).await;
        assert_eq!(got.len(), expect.len());
        assert!(got == expect, "bytes arrive whole and in order");
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
