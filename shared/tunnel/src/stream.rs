//! A tunnel stream whatever carries it: [`StreamTx`] and [`StreamRx`] are the two halves of an
//! HTTP/2 stream (`tether-tunnel/1`, and the `tether-relay/1` links between brokers) or of a
//! `tether-tunnel/2` stream ([`crate::mux`]). Front ends, pumps and relays use these and never
//! see the protocol.

use std::future::poll_fn;
use std::task::{Context, Poll};

use bytes::Bytes;
use h2::{Reason, RecvStream, SendStream};

use crate::abort::AbortReason;
use crate::mux;

/// Most slices of a vectored write that go into one `tether-tunnel/2` frame (with the frame's
/// header they fill one vectored write of the mux's writer, `MAX_WRITE_SLICES`).
const VECTORED_SLICES: usize = 15;

/// The sending half of a tunnel stream.
pub enum StreamTx {
    H2(SendStream<Bytes>),
    Mux(mux::SendHalf),
}

/// The receiving half of a tunnel stream.
pub enum StreamRx {
    H2(RecvStream),
    Mux(mux::RecvHalf),
}

impl From<SendStream<Bytes>> for StreamTx {
    fn from(s: SendStream<Bytes>) -> Self {
        Self::H2(s)
    }
}

impl From<RecvStream> for StreamRx {
    fn from(s: RecvStream) -> Self {
        Self::H2(s)
    }
}

impl From<mux::SendHalf> for StreamTx {
    fn from(s: mux::SendHalf) -> Self {
        Self::Mux(s)
    }
}

impl From<mux::RecvHalf> for StreamRx {
    fn from(s: mux::RecvHalf) -> Self {
        Self::Mux(s)
    }
}

impl StreamTx {
    /// Sends `data`, waiting for the peer's window of this stream (the backpressure).
    pub async fn send(&mut self, data: Bytes) -> Result<(), AbortReason> {
        match self {
            Self::H2(tx) => send_chunk(tx, data).await,
            Self::Mux(tx) => tx.send(data).await,
        }
    }

    /// Ends this direction (half-close) after everything sent before.
    pub async fn finish(&mut self) -> Result<(), AbortReason> {
        match self {
            Self::H2(tx) => tx
                .send_data(Bytes::new(), true)
                .map_err(|e| h2_abort_reason(&e)),
            Self::Mux(tx) => tx.finish().await,
        }
    }

    /// The poll form of [`StreamTx::send`] from a borrowed buffer, for an `AsyncWrite`
    /// (`stream_io::StreamIo`): ready with how many bytes of `buf` went (at least one,
    /// at most a frame on `tether-tunnel/2`), once the stream's credit (the peer's window)
    /// allows. On `tether-tunnel/2` it first waits until the connection's writer is free with
    /// nothing queued (`SendHalf::poll_writable`: the connection's backpressure, as a socket's
    /// own) and the bytes go straight from `buf` (a copy only for what the socket did not take);
    /// on HTTP/2 they are copied into an owned chunk for h2.
    pub fn poll_send_from(
        &mut self,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<Result<usize, AbortReason>> {
        if buf.is_empty() {
            return Poll::Ready(Ok(0));
        }
        match self {
            Self::H2(tx) => loop {
                let cap = tx.capacity();
                if cap > 0 {
                    let n = cap.min(buf.len());
                    tx.send_data(Bytes::copy_from_slice(&buf[..n]), false)
                        .map_err(|e| h2_reason(&e))?;
                    return Poll::Ready(Ok(n));
                }
                tx.reserve_capacity(buf.len());
                match std::task::ready!(tx.poll_capacity(cx)) {
                    Some(Ok(_)) => {}
                    Some(Err(e)) => return Poll::Ready(Err(h2_reason(&e))),
                    None => {
                        return Poll::Ready(Err(AbortReason::PeerReset("stream closed".into())));
                    }
                }
            },
            Self::Mux(tx) => {
                std::task::ready!(tx.poll_writable(cx))?;
                let n = std::task::ready!(tx.poll_reserve(cx, buf.len()))?;
                tx.send_reserved_from(&buf[..n], Bytes::copy_from_slice)?;
                Poll::Ready(Ok(n))
            }
        }
    }

    /// [`StreamTx::poll_send_from`] for a vectored write: on `tether-tunnel/2` as many of
    /// `bufs` as one frame and the credit hold go out as one frame, straight from the slices
    /// (TLS builds its records across them, so an HTTP head and its body chunks need no
    /// gathering copy); on HTTP/2 the first non-empty slice.
    pub fn poll_send_vectored(
        &mut self,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<Result<usize, AbortReason>> {
        let Self::Mux(tx) = self else {
            let first = bufs
                .iter()
                .find(|b| !b.is_empty())
                .map_or(&[][..], |b| &b[..]);
            return self.poll_send_from(cx, first);
        };
        // At most VECTORED_SLICES non-empty slices per frame (a frame header and these fill
        // one vectored write of the mux's writer), held on the stack: no allocation per frame.
        let mut parts: [&[u8]; VECTORED_SLICES] = [&[]; VECTORED_SLICES];
        let mut k = 0;
        for b in bufs.iter().filter(|b| !b.is_empty()).take(VECTORED_SLICES) {
            parts[k] = b;
            k += 1;
        }
        let total: usize = parts[..k].iter().map(|p| p.len()).sum();
        if total == 0 {
            return Poll::Ready(Ok(0));
        }
        std::task::ready!(tx.poll_writable(cx))?;
        let n = std::task::ready!(tx.poll_reserve(cx, total))?;
        // Keep the slices that fill the `n` bytes of credit taken (the last one cut).
        let mut left = n;
        let mut used = 0;
        while left > 0 {
            let take = parts[used].len().min(left);
            parts[used] = &parts[used][..take];
            left -= take;
            used += 1;
        }
        tx.send_reserved_vectored(&parts[..used])?;
        Poll::Ready(Ok(n))
    }

    /// [`StreamTx::finish`] without waiting: the end goes behind everything sent before.
    pub fn finish_now(&mut self) -> Result<(), AbortReason> {
        match self {
            Self::H2(tx) => tx
                .send_data(Bytes::new(), true)
                .map_err(|e| h2_abort_reason(&e)),
            Self::Mux(tx) => tx.finish_now(),
        }
    }

    /// Aborts the stream: the peer sees a reset, never a clean end.
    pub fn reset(&mut self) {
        match self {
            Self::H2(tx) => tx.send_reset(Reason::CANCEL),
            Self::Mux(tx) => tx.reset(),
        }
    }

    /// Ready once the stream was reset by the peer (or its connection lost).
    pub fn poll_reset(&mut self, cx: &mut Context<'_>) -> Poll<AbortReason> {
        match self {
            Self::H2(tx) => tx.poll_reset(cx).map(|r| match r {
                Ok(reason) => AbortReason::PeerReset(format!("{reason:?}")),
                Err(e) => h2_abort_reason(&e),
            }),
            Self::Mux(tx) => tx.poll_reset(cx),
        }
    }

    /// Waits until the stream is reset (see [`StreamTx::poll_reset`]).
    pub async fn reset_by_peer(&mut self) -> AbortReason {
        poll_fn(|cx| self.poll_reset(cx)).await
    }
}

impl StreamRx {
    /// The next bytes; `None` at the peer's clean end; an error for a reset or a lost tunnel.
    pub async fn data(&mut self) -> Option<Result<Bytes, AbortReason>> {
        poll_fn(|cx| self.poll_data(cx)).await
    }

    pub fn poll_data(&mut self, cx: &mut Context<'_>) -> Poll<Option<Result<Bytes, AbortReason>>> {
        match self {
            Self::H2(rx) => rx
                .poll_data(cx)
                .map(|o| o.map(|r| r.map_err(|e| h2_abort_reason(&e)))),
            Self::Mux(rx) => rx.poll_data(cx),
        }
    }

    /// The peer ended the stream cleanly and every byte was read.
    pub fn is_end_stream(&self) -> bool {
        match self {
            Self::H2(rx) => rx.is_end_stream(),
            Self::Mux(rx) => rx.is_end_stream(),
        }
    }

    /// Returns `n` bytes the caller has passed on to the peer's window.
    pub fn release(&mut self, n: usize) {
        match self {
            Self::H2(rx) => {
                let _ = rx.flow_control().release_capacity(n);
            }
            Self::Mux(rx) => rx.release(n),
        }
    }
}

fn h2_reason(e: &h2::Error) -> AbortReason {
    match e.reason() {
        Some(r) if e.is_remote() => AbortReason::PeerReset(format!("{r:?}")),
        _ => AbortReason::Tunnel(e.to_string()),
    }
}

/// Sends `data` on `tx`, waiting for flow-control capacity (the peer's window) — this wait is
/// the per-stream backpressure.
pub async fn send_chunk(tx: &mut SendStream<Bytes>, mut data: Bytes) -> Result<(), AbortReason> {
    while !data.is_empty() {
        tx.reserve_capacity(data.len());
        let cap = match poll_fn(|cx| tx.poll_capacity(cx)).await {
            Some(Ok(n)) => n,
            Some(Err(e)) => return Err(h2_reason(&e)),
            None => return Err(AbortReason::PeerReset("stream closed".into())),
        };
        if cap == 0 {
            continue;
        }
        let part = data.split_to(cap.min(data.len()));
        tx.send_data(part, false).map_err(|e| h2_reason(&e))?;
    }
    Ok(())
}

/// Describes an h2 error as an abort reason.
pub fn h2_abort_reason(e: &h2::Error) -> AbortReason {
    h2_reason(e)
}
