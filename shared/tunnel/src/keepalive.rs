//! HTTP/2 PING keepalive: a dead peer is detected within `interval + timeout`, not the hour
//! konnectivity defaults to.

use std::time::Duration;

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
pub async fn run(mut pp: h2::PingPong, interval: Duration, timeout: Duration) -> KeepaliveError {
    loop {
        tokio::time::sleep(interval).await;
        match tokio::time::timeout(timeout, pp.ping(h2::Ping::opaque())).await {
            Ok(Ok(_pong)) => {}
            Ok(Err(e)) => return KeepaliveError::Failed(e),
            Err(_) => return KeepaliveError::Timeout(timeout),
        }
    }
}
