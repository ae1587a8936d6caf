//! Moving bytes between two TCP sockets without bringing them into user space: the forward of
//! `tetherctl proxy connect` to the broker's plain client port (HTTP CONNECT), where nothing
//! has to be encrypted or framed on the way.
//!
//! Each direction owns a pipe of [`PIPE_BYTES`]: `splice(2)` moves what the source socket
//! holds into the pipe (page references, no copy) and from the pipe into the destination
//! socket, waiting on tokio's readiness for both sockets. The pipe is drained before the
//! source is read again, so a slow destination holds at most one pipe's worth in this process
//! and the rest stays in the kernel's socket buffers (the source's TCP window closes).
//!
//! Endings keep their meaning through the relay, as through the broker: an EOF from one side
//! becomes a half-close (`shutdown(SHUT_WR)`) of the other once every byte before it went
//! out; an error on either side (a reset above all) resets both sockets (`SO_LINGER` 0), so
//! the far end sees an abort, never a clean EOF after lost bytes.
//!
//! Off Linux the same loop copies through a buffer of the same size.

use std::io;

use tokio::io::Interest;
use tokio::net::TcpStream;

/// Bytes one direction holds in this process at most (its pipe, or off Linux its buffer).
/// 256 KiB: a few loopback segments' worth, so one `splice` pair moves large bursts; the
/// kernel may refuse the size (`/proc/sys/fs/pipe-max-size`, per-user pipe limits), then the
/// default 64 KiB pipe is used.
pub const PIPE_BYTES: usize = 256 * 1024;

/// Arms an abortive close: dropping the socket then sends RST, not FIN.
pub fn reset(s: &TcpStream) {
    let _ = s.set_zero_linger();
}

/// Writes all of `buf` to `s` (shared reference, so the other direction can run at the same
/// time).
pub async fn write_all(s: &TcpStream, mut buf: &[u8]) -> io::Result<()> {
    while !buf.is_empty() {
        s.writable().await?;
        match s.try_write(buf) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => buf = &buf[n..],
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// One direction: `from` → `to` until `from`'s EOF, then half-closes `to`. Bytes moved.
pub async fn one_way(from: &TcpStream, to: &TcpStream) -> io::Result<u64> {
    let mut mover = Mover::new()?;
    let mut total = 0u64;
    loop {
        let n = loop {
            from.readable().await?;
            match from.try_io(Interest::READABLE, || mover.fill(from)) {
                Ok(n) => break n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                Err(e) => return Err(e),
            }
        };
        if n == 0 {
            socket2::SockRef::from(to).shutdown(std::net::Shutdown::Write)?;
            return Ok(total);
        }
        // Counted for idle polling (light traffic or bulk: `proxy connect`'s runtime).
        tether_idlepoll::note_io(n);
        let mut left = n;
        while left > 0 {
            to.writable().await?;
            match to.try_io(Interest::WRITABLE, || mover.drain(to, left)) {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(m) => left -= m,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                Err(e) => return Err(e),
            }
        }
        total += n as u64;
    }
}

/// The bytes in flight of one direction: a pipe on Linux.
#[cfg(target_os = "linux")]
struct Mover {
    read_end: std::os::fd::OwnedFd,
    write_end: std::os::fd::OwnedFd,
    capacity: usize,
}

#[cfg(target_os = "linux")]
impl Mover {
    fn new() -> io::Result<Self> {
        use rustix::pipe::{PipeFlags, fcntl_setpipe_size, pipe_with};
        let (read_end, write_end) = pipe_with(PipeFlags::CLOEXEC | PipeFlags::NONBLOCK)?;
        // A refused size leaves the default pipe; `capacity` is what it really holds.
        let capacity = fcntl_setpipe_size(&write_end, PIPE_BYTES)
            .or_else(|_| rustix::pipe::fcntl_getpipe_size(&write_end))?;
        Ok(Self {
            read_end,
            write_end,
            capacity,
        })
    }

    /// Socket → pipe (the pipe is empty: every fill is drained before the next). 0 = EOF.
    fn fill(&mut self, from: &TcpStream) -> io::Result<usize> {
        use rustix::pipe::{SpliceFlags, splice};
        Ok(splice(
            from,
            None,
            &self.write_end,
            None,
            self.capacity,
            SpliceFlags::MOVE | SpliceFlags::NONBLOCK,
        )?)
    }

    /// Pipe → socket, at most `left` bytes (what the pipe holds).
    fn drain(&mut self, to: &TcpStream, left: usize) -> io::Result<usize> {
        use rustix::pipe::{SpliceFlags, splice};
        Ok(splice(
            &self.read_end,
            None,
            to,
            None,
            left,
            SpliceFlags::MOVE | SpliceFlags::NONBLOCK,
        )?)
    }
}

/// The bytes in flight of one direction: a buffer off Linux.
#[cfg(not(target_os = "linux"))]
struct Mover {
    buf: Vec<u8>,
    filled: usize,
    start: usize,
}

#[cfg(not(target_os = "linux"))]
impl Mover {
    fn new() -> io::Result<Self> {
        Ok(Self {
            buf: vec![0; PIPE_BYTES],
            filled: 0,
            start: 0,
        })
    }

    fn fill(&mut self, from: &TcpStream) -> io::Result<usize> {
        let n = from.try_read(&mut self.buf)?;
        (self.start, self.filled) = (0, n);
        Ok(n)
    }

    fn drain(&mut self, to: &TcpStream, left: usize) -> io::Result<usize> {
        debug_assert_eq!(self.filled - self.start, left);
        let n = to.try_write(&self.buf[self.start..self.filled])?;
        self.start += n;
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpListener;

    /// Bytes moved each way, a → b and b → a.
    #[derive(Debug, PartialEq, Eq)]
    struct Moved {
        up: u64,
        down: u64,
    }

    /// Both directions, as `plain_connect` runs them: an error resets both sockets.
    async fn relay(a: TcpStream, b: TcpStream) -> io::Result<Moved> {
        match tokio::try_join!(one_way(&a, &b), one_way(&b, &a)) {
            Ok((up, down)) => Ok(Moved { up, down }),
            Err(e) => {
                reset(&a);
                reset(&b);
                Err(e)
            }
        }
    }

    /// A connected pair on 127.0.0.1.
    async fn pair() -> (TcpStream, TcpStream) {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let c = TcpStream::connect(l.local_addr().unwrap()).await.unwrap();
        let (s, _) = l.accept().await.unwrap();
        (c, s)
    }

    /// client ⇄ [relay: a | b] ⇄ server; returns (client, server, relay task).
    async fn relayed() -> (
        TcpStream,
        TcpStream,
        tokio::task::JoinHandle<io::Result<Moved>>,
    ) {
        let (client, a) = pair().await;
        let (b, server) = pair().await;
        (client, server, tokio::spawn(relay(a, b)))
    }

    const DEADLINE: std::time::Duration = std::time::Duration::from_secs(20);

    #[tokio::test]
    async fn bytes_and_half_closes_go_through_both_ways() {
        let (mut client, mut server, task) = relayed().await;
        // More than a pipe's worth each way, written while the other side reads.
        let up: Vec<u8> = (0..3 * PIPE_BYTES + 17).map(|i| (i % 251) as u8).collect();
        let down: Vec<u8> = (0..2 * PIPE_BYTES + 5).map(|i| (i % 241) as u8).collect();
        let (up2, down2) = (up.clone(), down.clone());
        let srv = tokio::spawn(async move {
            let mut got = Vec::new();
            server.read_to_end(&mut got).await.unwrap();
            // The client's half-close arrived as an EOF; this side can still send.
            server.write_all(&down2).await.unwrap();
            server.shutdown().await.unwrap();
            got
        });
        client.write_all(&up2).await.unwrap();
        client.shutdown().await.unwrap();
        let mut back = Vec::new();
        tokio::time::timeout(DEADLINE, client.read_to_end(&mut back))
            .await
            .expect("the relay stalled")
            .unwrap();
        let got = srv.await.unwrap();
        assert!(got == up, "up: {} bytes of {}", got.len(), up.len());
        assert!(back == down, "down: {} bytes of {}", back.len(), down.len());
        let moved = tokio::time::timeout(DEADLINE, task)
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        assert_eq!(
            moved,
            Moved {
                up: up.len() as u64,
                down: down.len() as u64
            }
        );
    }

    #[tokio::test]
    async fn a_reset_on_one_side_resets_the_other() {
        let (mut client, server, task) = relayed().await;
        client.write_all(b"hello").await.unwrap();
        // The server aborts: the client must see a reset, not a clean EOF.
        reset(&server);
        drop(server);
        let mut buf = [0u8; 64];
        let r = tokio::time::timeout(DEADLINE, async {
            loop {
                match client.read(&mut buf).await {
                    Ok(0) => break Ok(0),
                    Ok(_) => continue,
                    Err(e) => break Err(e),
                }
            }
        })
        .await
        .expect("the relay did not pass the reset on");
        let e = r.expect_err("a reset became a clean EOF");
        assert_eq!(e.kind(), io::ErrorKind::ConnectionReset, "{e}");
        assert!(task.await.unwrap().is_err(), "the relay reported success");
    }
}
