//! Splicing two tunnel streams (HTTP/2 or `tether-tunnel/2`, [`crate::stream`]): how a broker relays a stream it received from a peer broker to
//! its own tunnel for the cluster.
//!
//! Each direction forwards DATA with `StreamTx::send` (waiting for the far
//! side's window) and releases the near side's capacity only after forwarding, so the two
//! windows chain: a slow client slows the agent's stream and nothing else. END_STREAM is
//! forwarded as END_STREAM; an error in either direction resets both streams.

use crate::pump::{AbortReason, SpliceError, SpliceStats};
use crate::stream::{StreamRx, StreamTx};

async fn forward(rx: &mut StreamRx, tx: &mut StreamTx, total: &mut u64) -> Result<(), AbortReason> {
    while let Some(next) = rx.data().await {
        let data = next?;
        let n = data.len();
        tx.send(data).await?;
        rx.release(n);
        *total += n as u64;
    }
    tx.finish().await
}

/// Relays between stream `a` (e.g. from a peer broker) and stream `b` (e.g. to an agent) until
/// both directions ended; `to_tunnel_bytes` counts a → b.
pub async fn splice_streams(
    (mut a_tx, mut a_rx): (StreamTx, StreamRx),
    (mut b_tx, mut b_rx): (StreamTx, StreamRx),
) -> Result<SpliceStats, SpliceError> {
    let (mut ab, mut ba) = (0u64, 0u64);
    let result = {
        let up = forward(&mut a_rx, &mut b_tx, &mut ab);
        let down = forward(&mut b_rx, &mut a_tx, &mut ba);
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
