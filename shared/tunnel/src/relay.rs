//! Splicing two tunnel streams (HTTP/2 or `tether-tunnel/2`, [`crate::stream`]): how a broker relays a stream it received from a peer broker to
//! its own tunnel for the cluster.
//!
//! Each direction forwards DATA with `StreamTx::send` (waiting for the far
//! side's window) and releases the near side's capacity only after forwarding, so the two
//! windows chain: a slow client slows the agent's stream and nothing else. END_STREAM is
//! forwarded as END_STREAM; an error in either direction resets both streams.

use std::time::Duration;

use crate::pump::{AbortReason, SpliceError, SpliceStats};
use crate::stream::{StreamRx, StreamTx};

/// What a relay does with each chunk it forwarded: count it, and pause that direction for the
/// returned time (a paced stream, the broker's per-cluster CPU share). `to_b`: the chunk went
/// from stream `a` to stream `b`.
pub trait Meter: Sync {
    fn forwarded(&self, to_b: bool, n: usize) -> Option<Duration>;
}

/// No metering.
impl Meter for () {
    fn forwarded(&self, _: bool, _: usize) -> Option<Duration> {
        None
    }
}

async fn forward<M: Meter>(
    rx: &mut StreamRx,
    tx: &mut StreamTx,
    meter: &M,
    to_b: bool,
    total: &mut u64,
) -> Result<(), AbortReason> {
    while let Some(next) = rx.data().await {
        let data = next?;
        let n = data.len();
        tx.send(data).await?;
        rx.release(n);
        *total += n as u64;
        if let Some(pause) = meter.forwarded(to_b, n) {
            tokio::time::sleep(pause).await;
        }
    }
    tx.finish().await
}

/// Relays between stream `a` (e.g. from a peer broker) and stream `b` (e.g. to an agent) until
/// both directions ended; `to_tunnel_bytes` counts a → b.
pub async fn splice_streams(
    a: (StreamTx, StreamRx),
    b: (StreamTx, StreamRx),
) -> Result<SpliceStats, SpliceError> {
    splice_streams_metered(a, b, &()).await
}

/// [`splice_streams`] with every forwarded chunk reported to `meter`.
pub async fn splice_streams_metered<M: Meter>(
    (mut a_tx, mut a_rx): (StreamTx, StreamRx),
    (mut b_tx, mut b_rx): (StreamTx, StreamRx),
    meter: &M,
) -> Result<SpliceStats, SpliceError> {
    let (mut ab, mut ba) = (0u64, 0u64);
    let result = {
        let up = forward(&mut a_rx, &mut b_tx, meter, true, &mut ab);
        let down = forward(&mut b_rx, &mut a_tx, meter, false, &mut ba);
        // Both directions to their end; the first error ends both.
        tokio::try_join!(up, down).map(|_| ())
    };
    let stats = SpliceStats {
        to_tunnel_bytes: ab,
        from_tunnel_bytes: ba,
    };
    match result {
        Ok(()) => Ok(stats),
        Err(reason) => {
            a_tx.reset();
            b_tx.reset();
            Err(SpliceError { reason, stats })
        }
    }
}
