//! The target socket's write half as [`splice`](tether_tunnel::pump::splice) needs it.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use tether_tunnel::pump::AbortableWrite;
use tokio::io::AsyncWrite;
use tokio::net::tcp::OwnedWriteHalf;

/// The write half of a TCP socket that an abort closes with RST *only*.
///
/// Dropping a tokio `OwnedWriteHalf` shuts its write side down (a FIN). With zero linger set,
/// the final close then sends RST, but the FIN is already on its way and the peer reads it as a
/// clean EOF before the reset arrives — exactly the confusion the tunnel must never cause. On
/// abort this type sets zero linger and *forgets* the write half (no FIN), so the socket is
/// reset when the read half drops.
pub struct ResettableWriteHalf(Option<OwnedWriteHalf>);

impl ResettableWriteHalf {
    pub fn new(wr: OwnedWriteHalf) -> Self {
        Self(Some(wr))
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
        match self.get_mut().0.as_mut() {
            Some(w) => Pin::new(w).poll_write(cx, buf),
            None => Poll::Ready(Err(aborted())),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut().0.as_mut() {
            Some(w) => Pin::new(w).poll_flush(cx),
            None => Poll::Ready(Ok(())),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut().0.as_mut() {
            Some(w) => Pin::new(w).poll_shutdown(cx),
            None => Poll::Ready(Err(aborted())),
        }
    }
}

impl AbortableWrite for ResettableWriteHalf {
    fn abort(&mut self) {
        if let Some(w) = self.0.take() {
            let _ = w.as_ref().set_zero_linger();
            w.forget();
        }
    }
}
