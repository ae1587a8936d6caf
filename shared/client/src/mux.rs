//! Dials over `tether-dial/1`: the frames of `tether-tunnel/2` ([`tether_tunnel::mux`]) between
//! the SDK and the broker, instead of HTTP/2.
//!
//! On `https://` the TLS handshake offers ALPN `tether-dial/1`; on `http://` the connection opens
//! with [`DIAL_PREFACE`]. A broker that does not speak it (an older one, or one with
//! `tunnel.protocol: h2`) fails the handshake or answers the preface with an HTTP error: the
//! [`crate::Dialer`] then keeps to the unframed Dial on HTTP/2 (module `raw`).
//!
//! - [`MuxConn`]: one connection, opened within the connect timeout, its credential sent once
//!   (`AUTH`), kept alive with PINGs, reopened on the next dial once it broke or the broker
//!   drains it (GOAWAY). A dial is an `OPEN` answered by `OPEN_OK` (the broker's stream id and
//!   the tunnel's round trip) or `OPEN_ERR` (the dial error's kind and message); an `OPEN` the
//!   broker did not take (GOAWAY, its stream limit) goes once more on a new connection.
//! - [`MuxOut`]: a stream's sending half for `AsyncWrite` and the owned-`Bytes` API: a write
//!   takes the stream's credit and leaves at once (the writing task frames it and writes it
//!   from the caller's buffer, no copy), so nothing waits in a task in between. While another
//!   stream holds the connection's writer or the socket is full, `poll_write` waits until the
//!   writer is free with nothing queued (`SendHalf::poll_writable`), as a socket of its own would
//!   hold it back; a copy is queued only for the part of a frame the socket did not take at
//!   once, or when another stream took the writer in between.

use std::io;
use std::sync::Arc;
use std::task::{Context, Poll, ready};

use bytes::Bytes;
use tether_tunnel::keepalive::{self, Pinger};
use tether_tunnel::mux::frame::{self, Kind};
use tether_tunnel::mux::{self, Mux, Open, OpenError, OpenOk, RecvHalf, Role, SendHalf};
use tether_tunnel::pump::AbortReason;
use tokio::io::AsyncWriteExt as _;
use tokio_util::task::AbortOnDropHandle;

use crate::opener::{Alpn, Opener};
use crate::{ClientError, MAX_FRAME_BYTES, STREAM_WINDOW_BYTES};

pub use tether_tunnel::mux::frame::DIAL_PREFACE;

/// Most streams this client accepts from the broker: none (the client only opens).
const ACCEPTED_STREAMS: usize = 0;
/// The receive window of the whole connection: what the broker may send ahead over all
/// streams (bounded so that a client that stops reading pins at most this much).
pub const CONNECTION_WINDOW_BYTES: u32 = 64 << 20;

/// One `tether-dial/1` connection to a broker, reopened on demand.
pub(crate) struct MuxConn {
    opener: Arc<Opener>,
    /// `Bearer <token>`, sent as `AUTH` on each new connection.
    credential: Option<String>,
    live: tokio::sync::Mutex<Option<Live>>,
}

struct Live {
    mux: Mux,
    /// The connection's reader and keepalive.
    _task: AbortOnDropHandle<()>,
}

impl MuxConn {
    /// Opens the first connection now; an error means the broker is unreachable or does not
    /// speak `tether-dial/1` (the caller falls back to HTTP/2, whose error names the problem).
    pub(crate) async fn open(
        opener: Arc<Opener>,
        credential: Option<String>,
    ) -> Result<Self, ClientError> {
        let conn = Self {
            opener,
            credential,
            live: tokio::sync::Mutex::new(None),
        };
        let live = conn.connect().await?;
        *conn.live.lock().await = Some(live);
        Ok(conn)
    }

    /// TCP, TLS (ALPN `tether-dial/1`) or the preface, the credential, and the broker's first
    /// frame, within the connect timeout.
    async fn connect(&self) -> Result<Live, ClientError> {
        let o = &*self.opener;
        let cfg = mux::Config {
            max_frame_bytes: MAX_FRAME_BYTES,
            stream_window_bytes: STREAM_WINDOW_BYTES,
            connection_window_bytes: CONNECTION_WINDOW_BYTES,
            max_streams: ACCEPTED_STREAMS,
        };
        o.open(Alpn::Dial, |mut io| async move {
            if !o.is_tls() {
                // No ALPN without TLS: the preface names the protocol.
                io.write_all(DIAL_PREFACE)
                    .await
                    .map_err(|e| o.fail("writing to", &e))?;
            }
            let (mux, driver, _events) = mux::connect(io, Role::Opener, cfg, None);
            if let Some(c) = &self.credential {
                mux.send_control(Kind::Auth, &frame::encode_text(c))
                    .await
                    .map_err(|e| o.fail("sending credentials to", &e))?;
            }
            let task = {
                let mux = mux.clone();
                AbortOnDropHandle::new(tokio::spawn(async move {
                    let rtt = std::sync::atomic::AtomicU64::new(0);
                    let alive = keepalive::run_probed(
                        Pinger::Mux(mux.clone()),
                        crate::KEEPALIVE_INTERVAL,
                        crate::KEEPALIVE_TIMEOUT,
                        &rtt,
                        None,
                        None,
                    );
                    tokio::select! {
                        _ = driver.run() => {}
                        e = alive => mux.close(format!("the broker did not answer: {e}")),
                    }
                }))
            };
            mux.peer_known()
                .await
                .map_err(|e| o.fail("no tether-dial/1 (the broker speaks HTTP/2 only?) at", &e))?;
            Ok(Live { mux, _task: task })
        })
        .await
    }

    /// The connection for one more stream: the current one, or a new one when it ended, is
    /// draining, or is `failed` (it did not take a stream).
    async fn ready(&self, failed: Option<&Mux>) -> Result<Mux, ClientError> {
        let mut live = self.live.lock().await;
        if let Some(l) = live.as_ref()
            && !l.mux.is_closed()
            && !l.mux.is_draining()
            && !failed.is_some_and(|f| f.same_connection(&l.mux))
        {
            return Ok(l.mux.clone());
        }
        if let Some(old) = live.take()
            && !old.mux.is_closed()
            && old.mux.open_streams() > 0
        {
            // Told to go away (the broker drains) or refused a stream: the streams open on it
            // finish there (the broker ends it at the end of its drain grace at the latest).
            tokio::spawn(async move {
                old.mux.idle().await;
                drop(old);
            });
        }
        let l = self.connect().await?;
        let mux = l.mux.clone();
        *live = Some(l);
        Ok(mux)
    }

    /// Opens a stream to `target` (the wire form: `apiserver` or `host:port`) in `cluster`.
    pub(crate) async fn dial(
        &self,
        cluster: &str,
        target: String,
    ) -> Result<(SendHalf, RecvHalf, OpenOk), ClientError> {
        let open = Open {
            target,
            cluster: cluster.to_owned(),
            tag: 0,
            dial_timeout_ms: 0,
            trace: crate::trace_context(),
        };
        let mut failed = None;
        let mut last = String::new();
        for _ in 0..2 {
            let mux = self.ready(failed.as_ref()).await?;
            let answer = tokio::time::timeout(
                crate::DIAL_ANSWER_TIMEOUT,
                mux.open_answered(&open, &Bytes::new()),
            )
            .await
            .map_err(|_| ClientError::NoAnswerWithin(crate::DIAL_ANSWER_TIMEOUT))?;
            match answer {
                Ok(opened) => return Ok(opened),
                // Not processed by the broker: no byte went anywhere, so it may go again.
                Err(OpenError::NotTaken(why)) => (last, failed) = (why, Some(mux)),
                Err(OpenError::Dial { kind, message }) if kind == "unauthenticated" => {
                    return Err(ClientError::Status(tonic::Status::unauthenticated(message)));
                }
                Err(OpenError::Dial { kind, message }) => {
                    return Err(ClientError::Dial {
                        code: crate::code_of_label(&kind),
                        message,
                    });
                }
                Err(OpenError::Lost(why)) => {
                    return Err(ClientError::Connect(format!("dial request failed: {why}")));
                }
            }
        }
        // Refused unprocessed twice, the second time on a new connection (a draining broker,
        // or one at its stream limit): no broker at this address takes streams now, which is
        // what `Unreachable` tells callers that would try another address or later.
        Err(ClientError::Unreachable(format!(
            "the broker did not take the stream on two connections: {last}"
        )))
    }
}

/// A failed stream: reset by the broker or the target, or its connection gone.
fn aborted(e: AbortReason) -> io::Error {
    io::Error::new(
        io::ErrorKind::ConnectionReset,
        format!("tunnel stream aborted: {e}"),
    )
}

/// A `tether-dial/1` stream's sending half.
pub(crate) struct MuxOut {
    pub(crate) tx: SendHalf,
    /// Bytes of an owned chunk ([`crate::DialStream::send`]) beyond the credit it found: sent
    /// before anything else (at most one chunk).
    overflow: Bytes,
    /// FIN sent.
    pub(crate) shut: bool,
}

impl MuxOut {
    pub(crate) fn new(tx: SendHalf) -> Self {
        Self {
            tx,
            overflow: Bytes::new(),
            shut: false,
        }
    }

    /// Sends what an owned chunk left over, as the broker's window allows.
    fn poll_drain(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        while !self.overflow.is_empty() {
            let n = ready!(self.tx.poll_reserve(cx, self.overflow.len())).map_err(aborted)?;
            let part = self.overflow.split_to(n);
            self.tx.send_reserved(part).map_err(aborted)?;
        }
        Poll::Ready(Ok(()))
    }

    /// Ready once [`MuxOut::send`] may take a chunk.
    pub(crate) fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.poll_drain(cx)
    }

    /// Sends `data` without waiting: what the window allows now, the rest before the next
    /// chunk (the caller calls [`MuxOut::poll_ready`] first).
    pub(crate) fn send(&mut self, mut data: Bytes) -> io::Result<()> {
        debug_assert!(self.overflow.is_empty());
        let n = self.tx.try_reserve(data.len()).map_err(aborted)?;
        if n > 0 {
            self.tx.send_reserved(data.split_to(n)).map_err(aborted)?;
        }
        self.overflow = data;
        Ok(())
    }

    /// `poll_write`: copies what the window allows now (at most a frame) and sends it.
    pub(crate) fn poll_write(
        &mut self,
        pool: &crate::ChunkPool,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        ready!(self.poll_drain(cx))?;
        // A full socket holds the writer back here rather than its bytes being copied and
        // queued (see `SendHalf::poll_writable`).
        ready!(self.tx.poll_writable(cx)).map_err(aborted)?;
        let n =
            ready!(self.tx.poll_reserve(cx, buf.len().min(MAX_FRAME_BYTES))).map_err(aborted)?;
        // Straight from `buf` when the connection's writer is free; a copy only for what must
        // wait.
        self.tx
            .send_reserved_from(&buf[..n], |b| pool.copy(b))
            .map_err(aborted)?;
        Poll::Ready(Ok(n))
    }

    /// Half-close: FIN after everything written before.
    pub(crate) fn poll_shutdown(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        ready!(self.poll_drain(cx))?;
        if !self.shut {
            self.shut = true;
            // An error means the stream is already reset: the next read reports it.
            let _ = self.tx.finish_now();
        }
        Poll::Ready(Ok(()))
    }
}

/// The next chunk from the target; its window goes back to the broker as it is handed out.
/// A reset (or a broken connection) is `ConnectionReset`, never an EOF.
pub(crate) fn poll_read_mux(
    rx: &mut RecvHalf,
    cx: &mut Context<'_>,
) -> Poll<Option<io::Result<Bytes>>> {
    loop {
        match ready!(rx.poll_data(cx)) {
            Some(Ok(b)) if b.is_empty() => {}
            Some(Ok(b)) => {
                rx.release(b.len());
                return Poll::Ready(Some(Ok(b)));
            }
            Some(Err(e)) => return Poll::Ready(Some(Err(aborted(e)))),
            None => return Poll::Ready(None),
        }
    }
}
