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
