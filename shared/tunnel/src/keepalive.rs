//! PING keepalive (HTTP/2 PING, or `tether-tunnel/2`'s PING frame): a dead peer is detected within `interval + timeout`, not the hour
//! konnectivity defaults to. Each answered PING also measures the tunnel's round trip.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::window::{AdaptiveWindow, Sampler};

/// Delay before the first measuring PING.
pub const FIRST_PING_DELAY: Duration = Duration::from_millis(100);

/// Why the keepalive loop ended.
#[derive(Debug, thiserror::Error)]
pub enum KeepaliveError {
    #[error("peer did not answer PING within {0:?}")]
    Timeout(Duration),
    #[error("PING failed: {0}")]
    Failed(String),
}

/// What sends PINGs: an HTTP/2 connection's `PingPong`, or a `tether-tunnel/2` connection.
pub enum Pinger {
    H2(h2::PingPong),
    Mux(crate::mux::Mux),
}

impl From<h2::PingPong> for Pinger {
    fn from(pp: h2::PingPong) -> Self {
        Self::H2(pp)
    }
}

impl Pinger {
    async fn ping(&mut self) -> Result<(), String> {
        match self {
            Self::H2(pp) => pp
                .ping(h2::Ping::opaque())
                .await
                .map(|_| ())
                .map_err(|e| e.to_string()),
            Self::Mux(m) => m.ping().await.map_err(|e| e.to_string()),
        }
    }
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
    pp: h2::PingPong,
    interval: Duration,
    timeout: Duration,
    rtt_micros: &AtomicU64,
) -> KeepaliveError {
    run_adaptive(pp, interval, timeout, rtt_micros, None).await
}

/// What an adaptive tunnel end needs besides the PING: its window state and a counter of raises.
#[derive(Debug, Clone)]
pub struct WindowSampling {
    pub window: Arc<AdaptiveWindow>,
    /// Incremented each time the window changes (up or back to the base).
    pub changes: Option<prometheus::IntCounter>,
}

/// [`run_measured`] that also drives the adaptive receive window (the tunnel's single PING user
/// does both): while data arrives and the window may still grow, a PING goes out every
/// `window::SAMPLE_DELAY` and its round trip is a BDP sample; the keepalive PING
/// counts as a sample too. The connection task applies the window changes.
pub async fn run_adaptive(
    pp: h2::PingPong,
    interval: Duration,
    timeout: Duration,
    rtt_micros: &AtomicU64,
    sampling: Option<WindowSampling>,
) -> KeepaliveError {
    run_probed(pp, interval, timeout, rtt_micros, sampling, None).await
}

/// [`run_adaptive`] that also sends a PING at once whenever the wedged-tunnel watchdog asks
/// for one (`watchdog::Progress::probe`): bytes written to the peer went unanswered,
/// and a live peer must ack the PING within a round trip.
pub async fn run_probed(
    pp: impl Into<Pinger>,
    interval: Duration,
    timeout: Duration,
    rtt_micros: &AtomicU64,
    sampling: Option<WindowSampling>,
    probe: Option<&crate::watchdog::Progress>,
) -> KeepaliveError {
    let mut pp = pp.into();
    let changes = sampling.as_ref().and_then(|s| s.changes.clone());
    let mut sampler = sampling
        .map(|s| s.window)
        .filter(|w| w.enabled())
        .map(Sampler::new);
    let mut next_keepalive = Instant::now() + FIRST_PING_DELAY.min(interval);
    loop {
        let probed = async {
            match probe {
                Some(p) => p.probe().await,
                None => std::future::pending().await,
            }
        };
        if let Some(s) = sampler.as_ref() {
            tokio::select! {
                _ = tokio::time::sleep_until(next_keepalive.into()) => {}
                _ = s.ready() => {}
                _ = probed => {}
            }
        } else {
            tokio::select! {
                _ = tokio::time::sleep_until(next_keepalive.into()) => {}
                _ = probed => {}
            }
        }
        if let Some(s) = sampler.as_mut()
            && let Some((old, new)) = s.reset_if_idle(Instant::now())
        {
            tracing::debug!(
                from = old,
                to = new,
                "tunnel idle: receive window back to base"
            );
            if let Some(c) = &changes {
                c.inc();
            }
        }
        let before = sampler.as_ref().map(|s| s.shared.received());
        let sent = Instant::now();
        // A pause of this process is not the peer's silence (`pause`).
        match crate::pause::timeout(timeout, pp.ping()).await {
            Ok(Ok(())) => {
                let rtt = sent.elapsed();
                let us = u64::try_from(rtt.as_micros()).unwrap_or(u64::MAX).max(1);
                rtt_micros.store(us, Ordering::Relaxed);
                if let (Some(s), Some(before)) = (sampler.as_mut(), before) {
                    let bytes = s.shared.received().saturating_sub(before);
                    tracing::trace!(bytes, rtt_us = us, "window sample");
                    if let Some((old, new)) = s.sampled(bytes, rtt) {
                        tracing::debug!(
                            from = old,
                            to = new,
                            bytes_per_round_trip = bytes,
                            rtt_us = us,
                            "receive window raised"
                        );
                        if let Some(c) = &changes {
                            c.inc();
                        }
                    }
                }
            }
            Ok(Err(e)) => return KeepaliveError::Failed(e),
            Err(_) => return KeepaliveError::Timeout(timeout),
        }
        next_keepalive = Instant::now() + interval;
    }
}
