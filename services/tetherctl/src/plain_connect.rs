//! The forward's way to the broker's plain client port (`--broker http://host:port`): one HTTP
//! CONNECT per forwarded connection, then the bytes move in the kernel
//! ([`crate::kernel_relay`]).
//!
//! Nothing on this leg is encrypted or framed (that is what the plain port is for: the broker's
//! host, or a network that already protects its traffic), so the forward has no work of its own
//! per byte, and a `proxy connect` stream costs what a client's own CONNECT costs plus a few
//! `splice` calls. Over `https://` the forward uses the native Dial API instead (TLS has to be
//! done in user space).
//!
//! Per connection: connect to the broker (within [`PlainConnect::connect_timeout`]), write the
//! CONNECT head with the bearer token, and start moving the local client's bytes at once (the
//! broker sends early data with the dial request); the other direction waits for the broker's
//! answer (within [`PlainConnect::dial_timeout`]). A refusal is printed with the broker's status,
//! `tether-error` and reason, and the local connection is reset.

use std::io;
use std::net::SocketAddr;

use tokio::net::TcpStream;

use crate::kernel_relay::{self, reset, write_all};

/// Longest answer head read from the broker (its `200` is 39 bytes, refusals a few hundred).
pub const MAX_RESPONSE_HEAD: usize = 16 * 1024;
/// Most bytes of a refusal's reason read and printed.
pub const MAX_REASON_BYTES: usize = 4 * 1024;

/// The plain client listener and the credential for it.
pub struct PlainConnect {
    /// `host:port` of the broker's plain client listener.
    pub addr: String,
    /// The bearer token; sent in `Proxy-Authorization`, never printed.
    pub token: String,
    /// Budget of the TCP connect to the broker.
    pub connect_timeout: std::time::Duration,
    /// Budget of the broker's answer to the CONNECT (its dial through the tunnel).
    pub dial_timeout: std::time::Duration,
}

impl std::fmt::Debug for PlainConnect {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PlainConnect")
            .field("addr", &self.addr)
            .finish_non_exhaustive()
    }
}

/// The CONNECT authority of `target` in `cluster` (docs/tunnel-protocol.md, "Addressing").
pub fn authority(cluster: &str, target: Option<&(String, u16)>) -> String {
    match target {
        None => format!("{cluster}:443"),
        Some((host, port)) => format!("{host}.{cluster}.tether:{port}"),
    }
}

impl PlainConnect {
    /// Checks the broker is reachable (a TCP connect, closed again), so a wrong address fails
    /// when the forward starts rather than at its first connection.
    pub async fn probe(&self) -> io::Result<()> {
        self.connect().await.map(drop)
    }

    async fn connect(&self) -> io::Result<TcpStream> {
        let s = tokio::time::timeout(self.connect_timeout, TcpStream::connect(&self.addr))
            .await
            .map_err(|_| {
                io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!(
                        "connecting to {} timed out after {:?}",
                        self.addr, self.connect_timeout
                    ),
                )
            })?
            .map_err(|e| io::Error::new(e.kind(), format!("connecting to {}: {e}", self.addr)))?;
        s.set_nodelay(true)?;
        Ok(s)
    }

    /// Forwards `local` (from `peer`) to `authority` until both sides ended.
    pub async fn forward(&self, local: TcpStream, peer: SocketAddr, authority: &str) {
        let _ = local.set_nodelay(true);
        let remote = match self.connect().await {
            Ok(r) => r,
            Err(e) => {
                eprintln!("connection from {peer}: {e}");
                reset(&local);
                return;
            }
        };
        let head = format!(
            "CONNECT {authority} HTTP/1.1\r\nhost: {authority}\r\nproxy-authorization: Bearer {}\r\n\r\n",
            self.token
        );
        let up = async {
            write_all(&remote, head.as_bytes()).await?;
            kernel_relay::one_way(&local, &remote).await
        };
        let down = async {
            let early = tokio::time::timeout(self.dial_timeout, answer(&remote))
                .await
                .map_err(|_| {
                    io::Error::new(
                        io::ErrorKind::TimedOut,
                        format!("the broker did not answer within {:?}", self.dial_timeout),
                    )
                })??;
            write_all(&local, &early).await?;
            kernel_relay::one_way(&remote, &local).await
        };
        if let Err(e) = tokio::try_join!(up, down) {
            reset(&local);
            reset(&remote);
            if e.kind() == io::ErrorKind::ConnectionRefused || e.kind() == io::ErrorKind::TimedOut {
                eprintln!("connection from {peer}: {e}");
            } else {
                tracing::debug!(%peer, error = %e, "forwarded connection ended");
            }
        }
    }
}

/// Reads the broker's answer to the CONNECT: the bytes after a `200`'s head (a target that
/// spoke first), or an error of kind `ConnectionRefused` whose message is the broker's status,
/// `tether-error` and reason.
async fn answer(remote: &TcpStream) -> io::Result<Vec<u8>> {
    let mut buf = Vec::with_capacity(512);
    let end = loop {
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
        if buf.len() >= MAX_RESPONSE_HEAD {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("the broker's answer head is over {MAX_RESPONSE_HEAD} bytes"),
            ));
        }
        if read_some(remote, &mut buf, MAX_RESPONSE_HEAD).await? == 0 {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "the broker closed the connection before answering the CONNECT",
            ));
        }
    };
    let head = String::from_utf8_lossy(&buf[..end]).into_owned();
    let mut lines = head.split("\r\n");
    let status_line = lines.next().unwrap_or_default();
    let mut words = status_line.splitn(3, ' ');
    let (version, code) = (words.next(), words.next());
    let reason_phrase = words.next().unwrap_or_default();
    let code: u16 = match (version, code.and_then(|c| c.parse().ok())) {
        (Some(v), Some(c)) if v.starts_with("HTTP/1.") => c,
        _ => {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("the broker's answer is not HTTP/1.x: {status_line:?}"),
            ));
        }
    };
    let rest = buf.split_off(end);
    if code == 200 {
        return Ok(rest);
    }
    let header = |name: &str| {
        head.split("\r\n").skip(1).find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.trim()
                .eq_ignore_ascii_case(name)
                .then(|| v.trim().to_string())
        })
    };
    let want = header("content-length")
        .and_then(|v| v.parse::<usize>().ok())
        .unwrap_or(MAX_REASON_BYTES)
        .min(MAX_REASON_BYTES);
    let mut body = rest;
    while body.len() < want {
        match read_some(remote, &mut body, want).await {
            Ok(0) | Err(_) => break,
            Ok(_) => {}
        }
    }
    body.truncate(want);
    let kind = header("tether-error").unwrap_or_else(|| "-".into());
    Err(io::Error::new(
        io::ErrorKind::ConnectionRefused,
        format!(
            "the broker refused: {code} {reason_phrase} ({kind}): {}",
            String::from_utf8_lossy(&body).trim()
        ),
    ))
}

/// Appends what `s` holds to `buf`, up to `limit` bytes in all; 0 at EOF.
async fn read_some(s: &TcpStream, buf: &mut Vec<u8>, limit: usize) -> io::Result<usize> {
    let mut chunk = [0u8; 1024];
    let room = limit.saturating_sub(buf.len()).min(chunk.len());
    loop {
        s.readable().await?;
        match s.try_read(&mut chunk[..room]) {
            Ok(n) => {
                buf.extend_from_slice(&chunk[..n]);
                return Ok(n);
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
            Err(e) => return Err(e),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncWriteExt;

    /// The answer `bytes` arriving in `pieces`, as `answer` reads it.
    async fn answer_of(pieces: Vec<&[u8]>) -> io::Result<Vec<u8>> {
        let pieces: Vec<Vec<u8>> = pieces.into_iter().map(<[u8]>::to_vec).collect();
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let c = TcpStream::connect(l.local_addr().unwrap()).await.unwrap();
        let (mut s, _) = l.accept().await.unwrap();
        let writer = tokio::spawn(async move {
            for p in pieces {
                // The reader may give up first (an over-long head): later writes may fail.
                if s.write_all(&p).await.is_err() {
                    break;
                }
                s.flush().await.unwrap();
                tokio::task::yield_now().await;
            }
            // Dropped here: an answer without an end reads EOF.
        });
        let r = answer(&c).await;
        writer.await.unwrap();
        r
    }

    #[tokio::test]
    async fn a_200_returns_the_bytes_after_its_head() {
        let early = answer_of(vec![
            b"HTTP/1.1 200 Connection",
            b" established\r\n\r",
            b"\nSSH-2.0-hello",
        ])
        .await
        .unwrap();
        // The target's first bytes came in the same read as the head, or after it.
        assert!(b"SSH-2.0-hello".starts_with(&early), "{early:?}");
    }

    #[tokio::test]
    async fn a_refusal_names_status_kind_and_reason() {
        let e = answer_of(vec![
            b"HTTP/1.1 502 Bad Gateway\r\ncontent-type: text/plain\r\ncontent-length: 26\r\n",
            b"tether-error: no_tunnel\r\n\r\nno agent connected for c9\n",
        ])
        .await
        .unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::ConnectionRefused);
        assert_eq!(
            e.to_string(),
            "the broker refused: 502 Bad Gateway (no_tunnel): no agent connected for c9"
        );
    }

    #[tokio::test]
    async fn no_http_or_no_end_is_an_error_that_says_so() {
        let e = answer_of(vec![b"SSH-2.0-OpenSSH\r\n\r\n"])
            .await
            .unwrap_err();
        assert!(e.to_string().contains("not HTTP/1.x"), "{e}");
        let e = answer_of(vec![b"HTTP/1.1 200 OK\r\n"]).await.unwrap_err();
        assert!(e.to_string().contains("before answering"), "{e}");
        // A head that never ends is read up to its bound, not without end.
        let endless = vec![b'x'; MAX_RESPONSE_HEAD + 4096];
        let e = answer_of(vec![b"HTTP/1.1 200 OK\r\nx-pad: ", &endless])
            .await
            .unwrap_err();
        assert!(e.to_string().contains("head is over 16384 bytes"), "{e}");
    }

    #[test]
    fn authorities_follow_the_addressing() {
        assert_eq!(authority("c1", None), "c1:443");
        assert_eq!(
            authority("c1", Some(&("web.default.svc".into(), 8080))),
            "web.default.svc.c1.tether:8080"
        );
    }
}
