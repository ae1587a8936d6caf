//! TCP dialling without an event-loop turn when the connection is already up.
//!
//! `tokio::net::TcpStream::connect` always waits for the socket's first writable event, even
//! when the kernel completed the handshake inside `connect()` (on loopback and on a local
//! node's pod network it usually has: the SYN, SYN-ACK and ACK are processed before the
//! syscall returns `EINPROGRESS`). That wait is one more `epoll_wait` and one more scheduling
//! turn of the dialling task on every new stream. [`connect`] checks the socket once right
//! after `connect()` and only waits for writability when the handshake is really in flight.
//! The socket is created non-blocking and the check is one `getpeername`: four syscalls per
//! dial on the fast path (`socket`, `setsockopt`, `connect`, `getpeername`).

use std::io;
use std::net::SocketAddr;

use socket2::{Domain, Protocol, Socket, Type};
use tokio::net::TcpStream;

/// Connects to `addr` (non-blocking) with `TCP_NODELAY` set; returns as soon as the connection
/// is established, without waiting for the reactor when it already is.
pub async fn connect(addr: SocketAddr) -> io::Result<TcpStream> {
    // Non-blocking from `socket()` on (no `fcntl` pair per dial).
    let sock = Socket::new(
        Domain::for_address(addr),
        Type::STREAM.nonblocking(),
        Some(Protocol::TCP),
    )?;
    sock.set_tcp_nodelay(true)?;
    match sock.connect(&addr.into()) {
        Ok(()) => {}
        Err(e) if e.raw_os_error() == Some(libc::EINPROGRESS) => {}
        Err(e) => return Err(e),
    }
    let stream = TcpStream::from_std(std::net::TcpStream::from(sock))?;
    loop {
        // Connected is the common case: one `getpeername`; the pending error only when not.
        match stream.peer_addr() {
            Ok(_) => return Ok(stream),
            Err(e) if e.kind() == io::ErrorKind::NotConnected => {
                if let Some(e) = stream.take_error()? {
                    return Err(e);
                }
            }
            Err(e) => return Err(e),
        }
        // The handshake is in flight: wait for the reactor (writable = connected or failed).
        stream.writable().await?;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    #[tokio::test]
    async fn connects_and_carries_bytes() {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let mut c = connect(addr).await.unwrap();
        assert!(c.nodelay().unwrap());
        let (mut s, _) = l.accept().await.unwrap();
        c.write_all(b"ping").await.unwrap();
        let mut b = [0u8; 4];
        s.read_exact(&mut b).await.unwrap();
        assert_eq!(&b, b"ping");
        s.write_all(b"pong").await.unwrap();
        c.read_exact(&mut b).await.unwrap();
        assert_eq!(&b, b"pong");
    }

    #[tokio::test]
    async fn refused_is_an_error() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        drop(l);
        let e = connect(addr).await.expect_err("nothing listens");
        assert_eq!(e.kind(), io::ErrorKind::ConnectionRefused, "{e}");
    }
}
