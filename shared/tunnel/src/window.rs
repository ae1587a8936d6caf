//! Adaptive HTTP/2 receive windows: a stream window sized to the tunnel's measured
//! bandwidth × round trip, so a WAN tunnel is not window-bound.
//!
//! A fixed stream window caps one stream at `window / RTT` (4 MiB at 50 ms ≈ 670 Mbit/s). Each
//! end of a tunnel measures its own *receive* direction the way a BDP (bandwidth-delay product)
//! estimator does: while data arrives it sends an HTTP/2 PING, counts the bytes that arrive
//! before the PONG, and when bandwidth × the smallest round trip seen reaches ⅔ of the window
//! (the window is the limit) it raises the window to twice that product, up to
//! `max_stream_window_bytes` (see [`BdpEstimator`]). The new window is announced with `SETTINGS_INITIAL_WINDOW_SIZE`,
//! which applies to every stream of that tunnel; it only grows while the measured bytes per
//! round trip keep up, so a loopback or LAN tunnel stays at the configured base window.
//!
//! Memory: an idle stream's window is credit, not memory; a stalled stream holds at most the
//! window in h2's receive buffer. A raised window therefore widens the stall bound of that tunnel
//! from `stream_window_bytes` to at most `max_stream_window_bytes` per stalled stream. After
//! [`IDLE_RESET`] without received data the window goes back to the base (a smaller
//! `SETTINGS_INITIAL_WINDOW_SIZE` is legal in HTTP/2; windows of streams with data in flight may
//! go negative until the data is consumed).
//!
//! Layout: [`AdaptiveWindow`] is the per-tunnel state shared by the transport (the
//! `ReadAhead` below TLS counts received bytes), the PING loop (`keepalive::run_adaptive`, which
//! samples) and the connection task (applies [`AdaptiveWindow::changed`] with
//! `set_initial_window_size`). [`BdpEstimator`] is the pure decision logic.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Time between the end of one BDP sample and the next while the window is still growing.
pub const SAMPLE_DELAY: Duration = Duration::from_millis(100);
/// Bytes that must arrive to start a sample: PINGs, PONGs, headers and small exchanges (which
/// never need a larger window) do not keep the sampler busy.
pub const SAMPLE_TRIGGER_BYTES: u64 = 64 << 10;
/// After this long without received data the window returns to the base.
pub const IDLE_RESET: Duration = Duration::from_secs(30);

/// Per-tunnel adaptive window state.
#[derive(Debug)]
pub struct AdaptiveWindow {
    received: AtomicU64,
    /// Set by the sampler when it waits for data; the reader clears it and notifies once
    /// `received` reaches `wake_at`.
    waiting: AtomicBool,
    wake_at: AtomicU64,
    data_arrived: tokio::sync::Notify,
    window: tokio::sync::watch::Sender<u32>,
    base: u32,
    max: u32,
}

impl AdaptiveWindow {
    /// Whether a sampler is waiting for data (tests of the read-ahead's wake-up).
    #[cfg(test)]
    pub(crate) fn sampler_waiting(&self) -> bool {
        self.waiting.load(Ordering::Acquire)
    }

    /// `base` is the configured stream window, `max` the cap; `max <= base` disables growth.
    pub fn new(base: u32, max: u32) -> Arc<Self> {
        Arc::new(Self {
            received: AtomicU64::new(0),
            waiting: AtomicBool::new(false),
            wake_at: AtomicU64::new(0),
            data_arrived: tokio::sync::Notify::new(),
            window: tokio::sync::watch::Sender::new(base),
            base,
            max: max.max(base),
        })
    }

    pub fn enabled(&self) -> bool {
        self.max > self.base
    }

    /// Bytes received on the tunnel so far.
    pub fn received(&self) -> u64 {
        self.received.load(Ordering::Relaxed)
    }

    /// The stream window in force (as announced, or about to be).
    pub fn current(&self) -> u32 {
        *self.window.borrow()
    }

    /// Watch of the window; the connection task applies each change.
    pub fn changed(&self) -> tokio::sync::watch::Receiver<u32> {
        self.window.subscribe()
    }

    fn set(&self, window: u32) {
        self.window.send_if_modified(|w| {
            let modified = *w != window;
            *w = window;
            modified
        });
    }

    /// Counts `n` received bytes (called by the tunnel's transport, see
    /// `readahead::ReadAhead::count_into`).
    pub(crate) fn on_received(&self, n: usize) {
        let total = self.received.fetch_add(n as u64, Ordering::Relaxed) + n as u64;
        if self.waiting.load(Ordering::Relaxed)
            && total >= self.wake_at.load(Ordering::Acquire)
            && self.waiting.swap(false, Ordering::AcqRel)
        {
            // Wakes the registered waiter only: a sampler future dropped while waiting (the
            // keepalive PING came first) leaves no stored permit that would start the next
            // sample before its bytes arrived.
            self.data_arrived.notify_waiters();
        }
    }

    /// Resolves once `min_bytes` more have arrived after this call.
    pub(crate) async fn wait_for_data(&self, min_bytes: u64) {
        let target = self.received() + min_bytes;
        let notified = self.data_arrived.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        self.wake_at.store(target, Ordering::Release);
        self.waiting.store(true, Ordering::Release);
        if self.received() >= target {
            self.waiting.store(false, Ordering::Relaxed);
            return;
        }
        notified.await;
    }
}

/// The decision rule, fed one sample per PING round trip.
///
/// The bandwidth of a sample is `bytes / rtt`; the bandwidth-delay product uses the *smallest*
/// round trip seen (an idle PING, queues empty), not the sample's own: under load a PING waits
/// behind the queued DATA frames and socket buffers, so `bytes / rtt × rtt` would only measure
/// the queue and grow windows on a loopback tunnel (bufferbloat). The window grows when the
/// product reaches ⅔ of it (the sender is window-bound), to twice the product. A raise that only
/// lengthened queues does not raise the product, so growth stops where the pipe is full.
#[derive(Debug, Clone)]
pub struct BdpEstimator {
    window: u32,
    base: u32,
    max: u32,
    min_rtt: Option<Duration>,
}

impl BdpEstimator {
    pub fn new(base: u32, max: u32) -> Self {
        Self {
            window: base,
            base,
            max: max.max(base),
            min_rtt: None,
        }
    }

    pub fn window(&self) -> u32 {
        self.window
    }

    /// True while a sample could still raise the window.
    pub fn growing(&self) -> bool {
        self.window < self.max
    }

    /// One sample: `bytes` arrived during one PING round trip of `rtt`. Returns the new window
    /// when it should grow.
    pub fn sample(&mut self, bytes: u64, rtt: Duration) -> Option<u32> {
        if rtt.is_zero() {
            return None;
        }
        let min_rtt = *self
            .min_rtt
            .insert(self.min_rtt.map_or(rtt, |m| m.min(rtt)));
        if !self.growing() {
            return None;
        }
        let bandwidth = bytes as f64 / rtt.as_secs_f64();
        let bdp = bandwidth * min_rtt.as_secs_f64();
        if bdp < f64::from(self.window) * 2.0 / 3.0 {
            return None;
        }
        let next = (2.0 * bdp).min(f64::from(self.max)) as u32;
        if next <= self.window {
            return None;
        }
        self.window = next;
        Some(next)
    }

    /// Back to the base after an idle period (the smallest round trip is kept).
    pub fn reset(&mut self) -> Option<u32> {
        (self.window != self.base).then(|| {
            self.window = self.base;
            self.base
        })
    }
}

/// Runs BDP samples with `ping` (one PING round trip per sample) while data flows, and publishes
/// the window. `ping` is the tunnel's single PING user (the keepalive loop owns the
/// `PingPong`, see `keepalive::run_adaptive`), so this is a state machine driven by it.
#[derive(Debug)]
pub(crate) struct Sampler {
    pub(crate) shared: Arc<AdaptiveWindow>,
    pub(crate) estimator: BdpEstimator,
    /// `received` when data last flowed (at least [`SAMPLE_TRIGGER_BYTES`] since the mark
    /// before), and when.
    data_mark: (u64, Instant),
}

impl Sampler {
    pub(crate) fn new(shared: Arc<AdaptiveWindow>) -> Self {
        let estimator = BdpEstimator::new(shared.base, shared.max);
        let data_mark = (shared.received(), Instant::now());
        Self {
            shared,
            estimator,
            data_mark,
        }
    }

    /// Back to the base window when no data flowed for [`IDLE_RESET`] up to `now`; returns
    /// `(old, new)` when the window changed. PINGs and PONGs (a few bytes every keepalive
    /// interval, counted like everything received) are not data.
    pub(crate) fn reset_if_idle(&mut self, now: Instant) -> Option<(u32, u32)> {
        let received = self.shared.received();
        if received.saturating_sub(self.data_mark.0) >= SAMPLE_TRIGGER_BYTES {
            self.data_mark = (received, now);
            return None;
        }
        if now.saturating_duration_since(self.data_mark.1) < IDLE_RESET {
            return None;
        }
        self.reset()
    }

    /// Waits until the next sample should start: data is arriving and the window may still grow.
    /// Never resolves when growth is disabled or the window is at its cap.
    pub(crate) async fn ready(&self) {
        if !self.estimator.growing() {
            return std::future::pending().await;
        }
        tokio::time::sleep(SAMPLE_DELAY).await;
        self.shared.wait_for_data(SAMPLE_TRIGGER_BYTES).await;
    }

    /// Feeds one PING round trip; returns `(old, new)` when the window changed.
    pub(crate) fn sampled(&mut self, bytes: u64, rtt: Duration) -> Option<(u32, u32)> {
        let old = self.estimator.window();
        let new = self.estimator.sample(bytes, rtt)?;
        self.shared.set(new);
        Some((old, new))
    }

    fn reset(&mut self) -> Option<(u32, u32)> {
        let old = self.estimator.window();
        let new = self.estimator.reset()?;
        self.shared.set(new);
        Some((old, new))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u32 = 1 << 20;

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn grows_only_when_a_round_trip_fills_most_of_the_window() {
        let mut e = BdpEstimator::new(4 * MIB, 16 * MIB);
        // An idle keepalive PING: a 50 ms path.
        assert_eq!(e.sample(0, 50 * MS), None);
        // 1 MiB per round trip: the window is not the limit.
        assert_eq!(e.sample(MIB.into(), 50 * MS), None);
        // 3.5 MiB per 50 ms round trip (≥ ⅔ of 4 MiB): the window is the limit → double.
        assert_eq!(e.sample(3_670_016, 50 * MS), Some(7_340_032));
        // Next round trip carries more (the window opened): grows again, capped at 16 MiB.
        assert_eq!(e.sample(7 * 1_048_576, 50 * MS), Some(14 * MIB));
        assert_eq!(e.sample(13 * 1_048_576, 50 * MS), Some(16 * MIB));
        assert!(!e.growing());
        assert_eq!(e.sample(16 * 1_048_576, 50 * MS), None);
    }

    #[test]
    fn queueing_on_a_short_path_is_not_mistaken_for_a_long_pipe() {
        let mut e = BdpEstimator::new(4 * MIB, 16 * MIB);
        // Loopback: 200 µs when idle.
        assert_eq!(e.sample(0, Duration::from_micros(200)), None);
        // Under bulk load a PING waits 20 ms behind queued frames while 6 MiB arrive: the
        // pipe is 300 MiB/s × 200 µs ≈ 60 KiB, not 6 MiB.
        assert_eq!(e.sample(6 * 1_048_576, 20 * MS), None);
        assert_eq!(e.window(), 4 * MIB);
    }

    #[test]
    fn falling_bandwidth_does_not_grow_and_reset_returns_to_base() {
        let mut e = BdpEstimator::new(4 * MIB, 32 * MIB);
        assert_eq!(e.sample(0, 10 * MS), None);
        assert!(e.sample(3 * 1_048_576, 10 * MS).is_some());
        // The raise only lengthened queues: 6 MiB per 20 ms round trip is the same 300 MiB/s
        // pipe (3 MiB product), short of ⅔ of the new 6 MiB window → no growth.
        assert_eq!(e.sample(6 * 1_048_576, 20 * MS), None);
        assert_eq!(e.reset(), Some(4 * MIB));
        assert_eq!(e.reset(), None);
    }

    #[test]
    fn disabled_when_max_is_not_above_base() {
        let mut e = BdpEstimator::new(4 * MIB, 4 * MIB);
        assert!(!e.growing());
        assert_eq!(e.sample(100 * 1_048_576, Duration::from_millis(50)), None);
        assert!(!AdaptiveWindow::new(4 * MIB, MIB).enabled());
    }

    #[test]
    fn window_returns_to_base_after_idling_though_pings_keep_arriving() {
        let shared = AdaptiveWindow::new(4 * MIB, 16 * MIB);
        let mut sampler = Sampler::new(Arc::clone(&shared));
        let start = Instant::now();
        assert_eq!(sampler.estimator.sample(0, 50 * MS), None);
        shared.on_received(8 << 20);
        assert!(sampler.sampled(3_670_016, 50 * MS).is_some());
        assert!(shared.current() > 4 * MIB);
        // Data flowed: the clock starts now.
        assert_eq!(sampler.reset_if_idle(start), None);
        // Only keepalive PINGs/PONGs for 31 s: idle.
        for s in 1..=31 {
            shared.on_received(17);
            let now = start + Duration::from_secs(s);
            let reset = sampler.reset_if_idle(now);
            if s < 30 {
                assert_eq!(reset, None, "reset after {s} s");
            } else if s == 30 {
                assert_eq!(reset, Some((7_340_032, 4 * MIB)));
            }
        }
        assert_eq!(shared.current(), 4 * MIB);
        // Data again, then 30 s of silence: nothing to reset any more.
        shared.on_received(1 << 20);
        assert_eq!(sampler.reset_if_idle(start + Duration::from_secs(40)), None);
        assert_eq!(sampler.reset_if_idle(start + Duration::from_secs(80)), None);
    }
}
