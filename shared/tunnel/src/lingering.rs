//! Lingering close: after our FIN, read (and discard) until the peer closes, so closing the
//! socket cannot turn into a reset that destroys the bytes we sent last.
//!
//! Linux answers `close()` on a socket whose receive queue still holds unread bytes with a
//! **RST**, not a FIN, and a RST makes the peer's kernel drop everything it has received but not
//! yet handed to its application. An HTTP/2 end that finishes (GOAWAY, last DATA with
//! END_STREAM, TLS close_notify) while the peer is still sending WINDOW_UPDATEs or PINGs hits
//! exactly that: the peer sees "connection reset" and the stream's tail is lost. This is the
//! same problem HTTP servers solve with a "lingering close" (nginx `lingering_close`, Apache
//! `lingering_close`).
//!
//! [`LingeringClose`] wraps a transport. Reads and writes pass straight through; its
//! `poll_shutdown` first shuts the inner transport's write side (the FIN), then reads until the
//! peer's EOF, an error, or `timeout` — so the caller (h2's connection, via TLS) finishes only
//! when the peer has everything, and the socket closes cleanly afterwards. [`close_gracefully`]
//! does the same once for a connection answered with an error (the broker's CONNECT front end:
//! a client may have sent its first bytes right behind its request).

use std::future::Future as _;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// Default time a closing connection waits for the peer's EOF.
pub const LINGER_TIMEOUT: Duration = Duration::from_secs(2);

/// Bytes discarded per read while lingering.
const DISCARD_CHUNK: usize = 4096;

/// See the module docs.
#[derive(Debug)]
pub struct LingeringClose<T> {
    inner: T,
    timeout: Duration,
    state: Close,
    /// Off: `poll_shutdown` is the inner transport's, no more (see [`LingeringClose::disarmed`]).
    armed: bool,
}

#[derive(Debug)]
enum Close {
    Open,
    /// FIN sent; reading until EOF or the deadline.
    Lingering(Pin<Box<tokio::time::Sleep>>),
    Done,
}

impl<T> LingeringClose<T> {
    /// Wraps `inner`; a shutdown lingers at most `timeout` for the peer's EOF.
    pub fn new(inner: T, timeout: Duration) -> Self {
        Self {
            inner,
            timeout,
            state: Close::Open,
            armed: true,
        }
    }

    /// Wraps `inner` without lingering until [`LingeringClose::arm`]: for a listener whose
    /// connections learn their protocol after the wrapper is in place (TLS ALPN) — a
    /// connection's end lingers, but a half-close inside a relayed byte stream (CONNECT) must
    /// not start discarding what the peer still sends.
    pub fn disarmed(inner: T, timeout: Duration) -> Self {
        Self {
            armed: false,
            ..Self::new(inner, timeout)
        }
    }

    /// A shutdown from now on lingers.
    pub fn arm(&mut self) {
        self.armed = true;
    }

    pub fn get_ref(&self) -> &T {
        &self.inner
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for LingeringClose<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<T: AsyncRead + AsyncWrite + Unpin> AsyncWrite for LingeringClose<T> {
    crate::forward_writes!(inner, except_shutdown);

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if !this.armed {
            return Pin::new(&mut this.inner).poll_shutdown(cx);
        }
        loop {
            match &mut this.state {
                Close::Open => {
                    std::task::ready!(Pin::new(&mut this.inner).poll_shutdown(cx))?;
                    this.state = Close::Lingering(Box::pin(tokio::time::sleep(this.timeout)));
                }
                Close::Lingering(deadline) => {
                    if deadline.as_mut().poll(cx).is_ready() {
                        this.state = Close::Done;
                        continue;
                    }
                    let mut scratch = [0u8; DISCARD_CHUNK];
                    let mut rb = ReadBuf::new(&mut scratch);
                    match Pin::new(&mut this.inner).poll_read(cx, &mut rb) {
                        // More bytes nobody will read: drop them and keep waiting for EOF.
                        Poll::Ready(Ok(())) if !rb.filled().is_empty() => {}
                        // EOF, or the peer reset: either way there is nothing left to protect.
                        Poll::Ready(_) => this.state = Close::Done,
                        Poll::Pending => return Poll::Pending,
                    }
                }
                Close::Done => return Poll::Ready(Ok(())),
            }
        }
    }
}

/// Shuts `io` down and lingers (see the module docs) — for a connection answered with an error
/// while its peer may still be sending.
pub async fn close_gracefully<S>(io: &mut S, timeout: Duration) -> io::Result<()>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    use tokio::io::AsyncWriteExt as _;
    LingeringClose::new(io, timeout).shutdown().await
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use crate::testing::tcp_pair as pair;

    /// The closing end has unread bytes from its peer; its last bytes must still arrive whole,
    /// and its shutdown ends at the peer's EOF, not at the timeout.
    #[tokio::test]
    async fn last_bytes_survive_unread_input_and_shutdown_ends_at_peer_eof() {
        let (a, mut b) = pair().await;
        let timeout = Duration::from_secs(30);
        let mut a = LingeringClose::new(a, timeout);
        // The peer sends bytes the closing end never reads (think WINDOW_UPDATEs).
        b.write_all(&[1u8; 64 << 10]).await.unwrap();
        let tail: Vec<u8> = (0..(1u32 << 20)).map(|i| (i % 253) as u8).collect();
        let sent = tail.clone();
        let closer = tokio::spawn(async move {
            a.write_all(&sent).await?;
            let started = tokio::time::Instant::now();
            a.shutdown().await?;
            drop(a);
            io::Result::Ok(started.elapsed())
        });
        let mut got = Vec::new();
        b.read_to_end(&mut got)
            .await
            .expect("clean EOF, not a reset");
        assert_eq!(got.len(), tail.len(), "tail truncated");
        assert!(got == tail, "tail corrupted");
        assert!(
            !closer.is_finished(),
            "the closing end must linger until the peer closes"
        );
        drop(b);
        let lingered = tokio::time::timeout(Duration::from_secs(10), closer)
            .await
            .expect("shutdown ends once the peer closes")
            .unwrap()
            .unwrap();
        assert!(
            lingered < timeout,
            "ended by the peer's EOF, not the timeout"
        );
    }

    /// Disarmed, a shutdown is the FIN alone: the peer's bytes sent after it stay readable
    /// (a half-closed relay still reads them); armed later, the connection's end lingers.
    #[tokio::test]
    async fn a_disarmed_shutdown_keeps_reading_to_the_caller_until_armed() {
        let (a, mut b) = pair().await;
        let mut a = LingeringClose::disarmed(a, Duration::from_secs(30));
        tokio::time::timeout(Duration::from_secs(10), a.shutdown())
            .await
            .expect("a disarmed shutdown does not wait for the peer")
            .unwrap();
        let mut eof = [0u8; 1];
        assert_eq!(b.read(&mut eof).await.unwrap(), 0, "the FIN arrived");
        b.write_all(b"after the half-close").await.unwrap();
        let mut got = [0u8; 20];
        a.read_exact(&mut got).await.unwrap();
        assert_eq!(&got, b"after the half-close");
        a.arm();
        b.write_all(&[9u8; 10_000]).await.unwrap();
        let mut closer = tokio::spawn(async move { a.shutdown().await });
        // Armed: it discards what the peer still sends and waits for its EOF — still waiting
        // well after a disarmed shutdown (above) had returned.
        b.write_all(&[9u8; 10_000]).await.unwrap();
        assert!(
            tokio::time::timeout(Duration::from_millis(300), &mut closer)
                .await
                .is_err(),
            "an armed shutdown lingers until the peer's EOF"
        );
        drop(b);
        tokio::time::timeout(Duration::from_secs(10), closer)
            .await
            .expect("ends at the peer's EOF")
            .unwrap()
            .unwrap();
    }

    /// A peer that never closes costs at most the timeout.
    #[tokio::test]
    async fn shutdown_gives_up_after_the_timeout() {
        let (a, b) = pair().await;
        let mut a = LingeringClose::new(a, Duration::from_millis(100));
        tokio::time::timeout(Duration::from_secs(10), a.shutdown())
            .await
            .expect("bounded by the linger timeout")
            .unwrap();
        drop(b);
    }
}
