//! The unframed Dial (`DialRaw`) on HTTP/2 driven directly with `h2`.
//!
//! A `DialRaw` stream is one HTTP/2 request whose body is the connection's bytes upstream and
//! whose response body is its bytes downstream, so the stream's reads and writes go straight to
//! h2's [`SendStream`] and [`RecvStream`]: no request-body pipe task between the caller and h2,
//! no body adapters on the way back (what tonic's channel and hyper's client put there). The
//! framed gRPC `Dial` (older brokers) keeps tonic's channel, opened only when used.
//!
//! - [`RawConn`]: one HTTP/2 connection (TCP, TLS with ALPN `h2` for `https://`), opened within
//!   the connect timeout, kept alive with PINGs, reopened on the next dial after it broke.
//! - [`poll_write_raw`] / [`poll_read_raw`]: a stream's writes bounded by the broker's window
//!   and [`SEND_BUFFER_BYTES`]; reads that return the window as the caller takes the bytes.

use std::io;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll, ready};
use std::time::Duration;

use bytes::Bytes;
use h2::client::{ResponseFuture, SendRequest};
use h2::{Reason, RecvStream, SendStream};

use crate::opener::{Alpn, Opener};
use crate::{ChunkPool, ClientError, MAX_FRAME_BYTES, STREAM_WINDOW_BYTES};

/// Bytes one stream may have queued in h2 beyond what the broker's window lets out (h2's
/// `max_send_buffer_size`); a write waits past it. Four frames, hyper's default. One A/B pair
/// of `tether-bench --only clients` (plain port, one stream's upload): two frames 0.81× CONNECT
/// at 1.18× its CPU per GB, four 0.86× at 1.10×; eight streams level either way.
pub const SEND_BUFFER_BYTES: usize = 4 * MAX_FRAME_BYTES;
/// Interval between HTTP/2 PINGs on an idle or busy connection to the broker.
pub const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(10);
/// A PING not answered within this much marks the connection dead.
pub const KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(5);

/// One HTTP/2 connection to a broker for unframed dials, reopened on demand once broken.
pub(crate) struct RawConn {
    opener: Arc<Opener>,
    live: tokio::sync::Mutex<Option<Live>>,
}

/// An open connection: its request handle, and whether its task has ended.
struct Live {
    send: SendRequest<Bytes>,
    ended: Arc<AtomicBool>,
}

impl RawConn {
    /// Opens the first connection now (so a wrong address, CA or certificate fails `connect`).
    pub(crate) async fn open(opener: Arc<Opener>) -> Result<Self, ClientError> {
        let live = connect(&opener).await?;
        Ok(Self {
            opener,
            live: tokio::sync::Mutex::new(Some(live)),
        })
    }

    /// Opens its connection on the first dial (the `tether-dial/1` connection serves the dials
    /// until the broker stops speaking `tether-dial/1`).
    pub(crate) fn lazy(opener: Arc<Opener>) -> Self {
        Self {
            opener,
            live: tokio::sync::Mutex::new(None),
        }
    }

    /// A request handle ready for one more stream, and its connection's end flag (the
    /// connection's identity): the current connection, or a new one when it has ended, cannot
    /// take a stream, or is `failed` (a request on it was refused unprocessed). Concurrent
    /// dials refused by the same connection reopen it once between them.
    async fn ready(
        &self,
        failed: Option<&Arc<AtomicBool>>,
    ) -> Result<(SendRequest<Bytes>, Arc<AtomicBool>), ClientError> {
        let mut live = self.live.lock().await;
        if let Some(l) = live.as_ref()
            && !failed.is_some_and(|f| Arc::ptr_eq(f, &l.ended))
            && !l.ended.load(Ordering::Acquire)
            && let Ok(send) = l.send.clone().ready().await
        {
            return Ok((send, Arc::clone(&l.ended)));
        }
        *live = None;
        let l = connect(&self.opener).await?;
        let (send, ended) = (l.send.clone(), Arc::clone(&l.ended));
        *live = Some(l);
        let send = send.ready().await.map_err(|e| {
            ClientError::Connect(format!("new HTTP/2 connection refused a stream: {e}"))
        })?;
        Ok((send, ended))
    }

    /// Sends a request whose body stays open for the stream's bytes; retried once on a new
    /// connection when the current one is gone or the broker refused the stream unprocessed
    /// (`GOAWAY` while draining, `REFUSED_STREAM`).
    pub(crate) async fn request(
        &self,
        headers: impl Fn(http::request::Builder) -> http::request::Builder,
    ) -> Result<(http::Response<RecvStream>, SendStream<Bytes>), ClientError> {
        let mut last = None;
        let mut failed = None;
        for _ in 0..2 {
            let (mut send, conn) = self.ready(failed.as_ref()).await?;
            let req = headers(
                http::Request::builder()
                    .method(http::Method::POST)
                    .uri(format!("{}{}", self.opener.base(), crate::RAW_DIAL_PATH)),
            )
            .body(())
            .map_err(|e| ClientError::Endpoint {
                endpoint: self.opener.base().to_owned(),
                reason: e.to_string(),
            })?;
            let (resp, body): (ResponseFuture, SendStream<Bytes>) =
                match send.send_request(req, false) {
                    Ok(r) => r,
                    Err(e) => {
                        (last, failed) = (Some(e), Some(conn));
                        continue;
                    }
                };
            let answer = tokio::time::timeout(crate::DIAL_ANSWER_TIMEOUT, resp)
                .await
                .map_err(|_| ClientError::NoAnswerWithin(crate::DIAL_ANSWER_TIMEOUT))?;
            match answer {
                Ok(r) => return Ok((r, body)),
                Err(e) if retryable(&e) => (last, failed) = (Some(e), Some(conn)),
                Err(e) => return Err(ClientError::Connect(format!("dial request failed: {e}"))),
            }
        }
        Err(ClientError::Connect(format!(
            "dial request failed: {}",
            last.map(|e| e.to_string()).unwrap_or_default()
        )))
    }
}

/// Whether a failed dial request may go again on a new connection: the broker refused it
/// unprocessed (`REFUSED_STREAM`, `GOAWAY`), or the connection died before the answer. No byte
/// of the stream has been sent before the answer, so a retry cannot duplicate data.
fn retryable(e: &h2::Error) -> bool {
    e.reason() == Some(Reason::REFUSED_STREAM) || e.is_go_away() || e.is_io()
}

/// The HTTP/2 connection: TCP, TLS with ALPN `h2` for `https://`, then the HTTP/2 handshake,
/// within the connect timeout; the connection and its keepalive then run on their own task.
async fn connect(o: &Opener) -> Result<Live, ClientError> {
    o.open(Alpn::H2, |io| async move {
        handshake(io)
            .await
            .map_err(|e| o.fail("HTTP/2 handshake with", &e))
    })
    .await
}

/// The HTTP/2 client handshake on `io`; spawns the connection task.
async fn handshake<T>(io: T) -> Result<Live, h2::Error>
where
    T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let (send, mut conn) = h2::client::Builder::new()
        .initial_window_size(STREAM_WINDOW_BYTES)
        .initial_connection_window_size(tether_tunnel::settings::MAX_WINDOW)
        // The broker's frames towards us (downloads: kube watches, large GETs) as large as ours
        // towards it; HTTP/2's default would cut them into 16 KiB frames.
        .max_frame_size(MAX_FRAME_BYTES as u32)
        .max_send_buffer_size(SEND_BUFFER_BYTES)
        .max_header_list_size(16 << 10)
        .enable_push(false)
        .handshake::<_, Bytes>(io)
        .await?;
    let ended = Arc::new(AtomicBool::new(false));
    let pings = conn.ping_pong();
    let flag = Arc::clone(&ended);
    tokio::spawn(async move {
        match pings {
            Some(pp) => {
                tokio::select! {
                    _ = &mut conn => {}
                    _ = tether_tunnel::keepalive::run(pp, KEEPALIVE_INTERVAL, KEEPALIVE_TIMEOUT) => {}
                }
            }
            None => {
                let _ = conn.await;
            }
        }
        flag.store(true, Ordering::Release);
    });
    Ok(Live { send, ended })
}

/// `poll_write` on a raw stream: copies up to the capacity h2 granted (the broker's window,
/// at most [`SEND_BUFFER_BYTES`] queued) into one chunk.
pub(crate) fn poll_write_raw(
    tx: &mut SendStream<Bytes>,
    pool: &ChunkPool,
    cx: &mut Context<'_>,
    buf: &[u8],
) -> Poll<io::Result<usize>> {
    ready!(poll_send_ready_raw(tx, cx, buf.len()))?;
    let n = buf.len().min(tx.capacity()).min(MAX_FRAME_BYTES);
    tx.send_data(pool.copy(&buf[..n]), false)
        .map_err(write_error)?;
    Poll::Ready(Ok(n))
}

/// Ready once h2 granted the stream some capacity (up to `want` bytes are asked for).
pub(crate) fn poll_send_ready_raw(
    tx: &mut SendStream<Bytes>,
    cx: &mut Context<'_>,
    want: usize,
) -> Poll<io::Result<()>> {
    loop {
        if tx.capacity() > 0 {
            return Poll::Ready(Ok(()));
        }
        tx.reserve_capacity(want.clamp(1, MAX_FRAME_BYTES));
        match ready!(tx.poll_capacity(cx)) {
            Some(Ok(_)) => continue,
            Some(Err(e)) => return Poll::Ready(Err(write_error(e))),
            None => {
                return Poll::Ready(Err(io::Error::new(
                    io::ErrorKind::BrokenPipe,
                    "stream closed",
                )));
            }
        }
    }
}

/// A failed write on a raw stream (reset, or its connection gone).
pub(crate) fn write_error(e: h2::Error) -> io::Error {
    io::Error::new(io::ErrorKind::BrokenPipe, format!("stream closed: {e}"))
}

/// The next chunk from the broker; its window goes back to the broker as it is handed out.
/// A reset (or a broken connection) is `ConnectionReset`, never an EOF.
pub(crate) fn poll_read_raw(
    rx: &mut RecvStream,
    cx: &mut Context<'_>,
) -> Poll<Option<io::Result<Bytes>>> {
    loop {
        match ready!(rx.poll_data(cx)) {
            Some(Ok(b)) if b.is_empty() => {}
            Some(Ok(b)) => {
                let _ = rx.flow_control().release_capacity(b.len());
                return Poll::Ready(Some(Ok(b)));
            }
            Some(Err(e)) => {
                return Poll::Ready(Some(Err(io::Error::new(
                    io::ErrorKind::ConnectionReset,
                    format!("tunnel stream aborted: {e}"),
                ))));
            }
            None => return Poll::Ready(None),
        }
    }
}
