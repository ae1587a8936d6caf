//! Jittered exponential backoff.
//!
//! Each failure multiplies the base delay (up to `max`); the delay actually returned is drawn
//! uniformly from `[base × (1 − jitter), base]` ("equal jitter" towards zero), so a fleet of
//! agents that lost the same broker does not redial in lock-step. [`Backoff::succeeded`] records
//! when a connection became healthy; the next failure resets to `initial` only if it stayed
//! healthy for at least `reset_after`, so a connection that flaps right after connecting keeps
//! backing off.

use std::time::{Duration, Instant};

use rand::Rng;

/// Default first retry delay.
pub const DEFAULT_INITIAL: Duration = Duration::from_millis(100);
/// Default ceiling for a retry delay.
pub const DEFAULT_MAX: Duration = Duration::from_secs(30);
/// Default time a connection must stay healthy before the backoff resets.
pub const DEFAULT_RESET_AFTER: Duration = Duration::from_secs(30);

/// Tunables of a [`Backoff`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BackoffConfig {
    pub initial: Duration,
    pub max: Duration,
    pub multiplier: f64,
    /// Fraction of the delay that is randomised, in `[0, 1]`.
    pub jitter: f64,
    pub reset_after: Duration,
}

impl Default for BackoffConfig {
    fn default() -> Self {
        Self {
            initial: DEFAULT_INITIAL,
            max: DEFAULT_MAX,
            multiplier: 2.0,
            jitter: 0.5,
            reset_after: DEFAULT_RESET_AFTER,
        }
    }
}

/// Stateful backoff for one retry loop.
#[derive(Debug, Clone)]
pub struct Backoff {
    config: BackoffConfig,
    base: Duration,
    healthy_since: Option<Instant>,
    attempts: u32,
}

impl Backoff {
    pub fn new(config: BackoffConfig) -> Self {
        Self {
            base: config.initial,
            config,
            healthy_since: None,
            attempts: 0,
        }
    }

    /// Number of consecutive failures since the last reset.
    pub fn attempts(&self) -> u32 {
        self.attempts
    }

    /// Records that the guarded operation is now healthy (e.g. a tunnel came up).
    pub fn succeeded(&mut self) {
        self.healthy_since = Some(Instant::now());
    }

    /// Records a failure and returns how long to wait before the next attempt.
    pub fn failed(&mut self) -> Duration {
        if let Some(since) = self.healthy_since.take()
            && since.elapsed() >= self.config.reset_after
        {
            self.base = self.config.initial;
            self.attempts = 0;
        }
        self.attempts = self.attempts.saturating_add(1);
        let base = self.base;
        let next = base.mul_f64(self.config.multiplier.max(1.0));
        self.base = next.min(self.config.max);
        let jitter = self.config.jitter.clamp(0.0, 1.0);
        let low = base.mul_f64(1.0 - jitter);
        if low >= base {
            return base;
        }
        rand::rng().random_range(low..=base)
    }

    /// Resets to the initial delay at once.
    pub fn reset(&mut self) {
        self.base = self.config.initial;
        self.attempts = 0;
        self.healthy_since = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> BackoffConfig {
        BackoffConfig {
            initial: Duration::from_millis(100),
            max: Duration::from_millis(800),
            multiplier: 2.0,
            jitter: 0.5,
            reset_after: Duration::from_secs(3600),
        }
    }

    #[test]
    fn grows_exponentially_within_jitter_and_caps() {
        let mut b = Backoff::new(cfg());
        let bases = [100u64, 200, 400, 800, 800, 800];
        for base in bases {
            let d = b.failed();
            assert!(d <= Duration::from_millis(base), "{d:?} > {base}ms");
            assert!(
                d >= Duration::from_millis(base / 2),
                "{d:?} < {}ms",
                base / 2
            );
        }
        assert_eq!(b.attempts(), 6);
    }

    #[test]
    fn jitter_spreads_delays() {
        let mut seen = std::collections::HashSet::new();
        for _ in 0..50 {
            let mut b = Backoff::new(cfg());
            seen.insert(b.failed());
        }
        assert!(seen.len() > 10, "delays are not jittered: {seen:?}");
    }

    #[test]
    fn short_healthy_period_does_not_reset() {
        let mut b = Backoff::new(cfg());
        b.failed();
        b.failed();
        b.succeeded();
        let d = b.failed();
        assert!(d >= Duration::from_millis(200), "reset too early: {d:?}");
    }

    #[test]
    fn long_healthy_period_resets() {
        let mut c = cfg();
        c.reset_after = Duration::ZERO;
        let mut b = Backoff::new(c);
        b.failed();
        b.failed();
        b.failed();
        b.succeeded();
        let d = b.failed();
        assert!(d <= Duration::from_millis(100), "not reset: {d:?}");
        assert_eq!(b.attempts(), 1);
    }
}
