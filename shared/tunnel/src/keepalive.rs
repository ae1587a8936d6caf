//! HTTP/2 PING keepalive: a dead peer is detected within `interval + timeout`, not the hour
//! konnectivity defaults to. Each answered PING also measures the tunnel's round trip.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Delay before the first measuring PING.
pub const FIRST_PING_DELAY: Duration = Duration::from_millis(100);

/// Why the keepalive loop ended.
#[derive(Debug, thiserror::Error)]
pub enum KeepaliveError {
    #[error("peer did not answer PING within {0:?}")]
    Timeout(Duration),
    #[error("PING failed: {0}")]
    Failed(#[from] h2::Error),
}

/// Sends a PING every `interval` and fails when one is not answered within `timeout`.
/// Returns only on failure; cancel it by dropping the future.
pub async fn run(pp: h2::PingPong, interval: Duration, timeout: Duration) -> KeepaliveError {
    run_measured(pp, interval, timeout, &AtomicU64::new(0)).await
}

/// Like [`run`], storing each measured round trip in microseconds into `rtt_micros`. The first
/// PING goes out after [`FIRST_PING_DELAY`] (not during the handshake burst, which would skew
/// it), so the round trip is known right after the tunnel comes up.
pub async fn run_measured(
    mut pp: h2::PingPong,
    interval: Duration,
    timeout: Duration,
    rtt_micros: &AtomicU64,
) -> KeepaliveError {
    let mut wait = FIRST_PING_DELAY.min(interval);
    loop {
        tokio::time::sleep(wait).await;
        wait = interval;
        let sent = Instant::now();
        match tokio::time::timeout(timeout, pp.ping(h2::Ping::opaque())).await {
            Ok(Ok(_pong)) => {
                let us = u64::try_from(sent.elapsed().as_micros())
                    .unwrap_or(u64::MAX)
                    .max(1);
                rtt_micros.store(us, Ordering::Relaxed);
            }
            Ok(Err(e)) => return KeepaliveError::Failed(e),
            Err(_) => return KeepaliveError::Timeout(timeout),
        }
    }
}
