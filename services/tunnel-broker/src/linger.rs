//! A plain-TCP client of a broker that dies (SIGKILL, crash) must see a **reset**, not a clean
//! FIN: otherwise a half-transferred stream looks complete. The kernel closes a dead process's
//! sockets with a FIN unless `SO_LINGER` is `{on, 0}`, so while a CONNECT stream is spliced its
//! socket carries a zero linger ([`CrashReset::arm`]); a stream that ends cleanly switches it
//! back off ([`CrashReset::disarm`]) before the socket is closed, so buffered bytes and the FIN
//! are delivered as usual.
//!
//! The setting lives on the socket, not the descriptor: the guard keeps a duplicate descriptor
//! (never polled), so the socket stays open until the guard decides how it closes, whatever the
//! splice did with its own halves.

use std::os::fd::AsFd;

/// Holds a duplicate of a client socket's descriptor with `SO_LINGER {on, 0}` set.
pub struct CrashReset(socket2::Socket);

impl CrashReset {
    /// Sets zero linger on `sock`'s socket; `None` if that fails (the stream works anyway).
    pub fn arm(sock: &impl AsFd) -> Option<Self> {
        let dup = sock.as_fd().try_clone_to_owned().ok()?;
        let s = socket2::Socket::from(dup);
        s.set_linger(Some(std::time::Duration::ZERO)).ok()?;
        Some(Self(s))
    }

    /// The stream ended cleanly: close gracefully (FIN after the buffered bytes).
    pub fn disarm(self) {
        let _ = self.0.set_linger(None);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn armed_then_disarmed() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let c = std::net::TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let g = CrashReset::arm(&c).unwrap();
        let s = socket2::SockRef::from(&c);
        assert_eq!(s.linger().unwrap(), Some(std::time::Duration::ZERO));
        g.disarm();
        assert_eq!(s.linger().unwrap(), None);
    }
}
