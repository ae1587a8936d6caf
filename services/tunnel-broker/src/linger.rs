//! A plain-TCP client of a broker that dies (SIGKILL, crash) must see a **reset**, not a clean
//! FIN: otherwise a half-transferred stream looks complete. The kernel closes a dead process's
//! sockets with a FIN unless `SO_LINGER` is `{on, 0}`, so while a CONNECT stream is spliced its
//! socket carries a zero linger ([`CrashReset::arm`]). When the stream's tunnel → client
//! direction ends cleanly, the linger goes back off right before that write side's FIN, so
//! buffered bytes and the FIN are delivered as usual, whether the rest of the stream, or the
//! process, ends cleanly or not (an abort sets zero linger again: `ResettableWriteHalf`).
//!
//! The setting lives on the socket and is switched through the write half the splice owns:
//! one `setsockopt` per stream to arm and one to disarm, no duplicate descriptor.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use tether_tunnel::pump::{AbortableWrite, ResettableWriteHalf};
use tokio::io::AsyncWrite;

/// The write half of a client socket with `SO_LINGER {on, 0}` set until its clean shutdown.
pub struct CrashReset {
    wr: ResettableWriteHalf,
    armed: bool,
}

impl CrashReset {
    /// Sets zero linger on `wr`'s socket (if that fails the stream works anyway, unguarded).
    pub fn arm(wr: ResettableWriteHalf) -> Self {
        let armed = wr.socket().is_some_and(|s| s.set_zero_linger().is_ok());
        Self { wr, armed }
    }

    /// Whether the socket carries the zero linger now.
    pub fn is_armed(&self) -> bool {
        self.armed
    }
}

impl AsyncWrite for CrashReset {
    tether_tunnel::forward_writes!(wr, except_shutdown);

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if this.armed {
            // The FIN follows every byte written: a crash from now on must not reset them.
            if let Some(s) = this.wr.socket() {
                let _ = socket2::SockRef::from(s).set_linger(None);
            }
            this.armed = false;
        }
        Pin::new(&mut this.wr).poll_shutdown(cx)
    }
}

impl AbortableWrite for CrashReset {
    fn abort(&mut self) {
        self.wr.abort();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn armed_until_the_clean_shutdown() {
        use tokio::io::AsyncWriteExt;
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let c = tokio::net::TcpStream::connect(l.local_addr().unwrap())
            .await
            .unwrap();
        let (_rd, wr) = c.into_split();
        let mut g = CrashReset::arm(ResettableWriteHalf::new(wr));
        assert!(g.is_armed());
        let linger = |g: &CrashReset| socket2::SockRef::from(g.wr.socket().unwrap()).linger();
        assert_eq!(linger(&g).unwrap(), Some(std::time::Duration::ZERO));
        g.write_all(b"x").await.unwrap();
        assert_eq!(linger(&g).unwrap(), Some(std::time::Duration::ZERO));
        g.shutdown().await.unwrap();
        assert!(!g.is_armed());
        assert_eq!(linger(&g).unwrap(), None);
    }
}
