//! Jittered exponential backoff.
//!
//! Each failure multiplies the base delay (up to `max`); the delay actually returned is drawn
//! uniformly from `[base × (1 − jitter), base]` ("equal jitter" towards zero), so a fleet of
//! agents that lost the same broker does not redial in lock-step. [`Backoff::succeeded`] records
//! when a connection became healthy; the next failure resets to `initial` only if it stayed
//! healthy for at least `reset_after`, so a connection that flaps right after connecting keeps
//! backing off.
//!
//! [`retry`] runs a start-up step (connect to NATS, to a broker, open a store) until it
//! succeeds, a failure is not transient, or shutdown: a service whose dependency starts after it
//! waits instead of exiting into a restart loop.
//!
//! Its own crate (re-exported as `tether_runtime::backoff`) so that the client SDK
//! (`tether-client`, whose connections on demand back off after a failure) does not pull in the
//! services' process plumbing.

#![forbid(unsafe_code)]

use std::time::{Duration, Instant};

use rand::Rng;
use tokio_util::sync::CancellationToken;

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

/// Why [`retry`] stopped without a result.
#[derive(Debug, PartialEq, Eq)]
pub enum RetryError<E> {
    /// A failure the caller does not retry (a configuration error, say).
    Fatal(E),
    /// Shutdown came first.
    ShutDown,
}

/// Runs `attempt` until it succeeds, with [`Backoff`] delays between tries. Each failure that
/// `transient` accepts is logged at warn level as `what` with its error and the delay, and
/// passed to `on_failure` (a readiness reason, say); any other failure is returned at once.
pub async fn retry<T, E, Fut>(
    what: &str,
    config: BackoffConfig,
    shutdown: &CancellationToken,
    transient: impl Fn(&E) -> bool,
    mut on_failure: impl FnMut(&E),
    mut attempt: impl FnMut() -> Fut,
) -> Result<T, RetryError<E>>
where
    E: std::fmt::Display,
    Fut: std::future::Future<Output = Result<T, E>>,
{
    let mut backoff = Backoff::new(config);
    loop {
        let result = tokio::select! {
            biased;
            _ = shutdown.cancelled() => return Err(RetryError::ShutDown),
            r = attempt() => r,
        };
        match result {
            Ok(v) => return Ok(v),
            Err(e) if transient(&e) => {
                let d = backoff.failed();
                tracing::warn!(error = %e, retry_in = ?d, attempt = backoff.attempts(), "{what}");
                on_failure(&e);
                tokio::select! {
                    _ = shutdown.cancelled() => return Err(RetryError::ShutDown),
                    _ = tokio::time::sleep(d) => {}
                }
            }
            Err(e) => return Err(RetryError::Fatal(e)),
        }
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

    /// Fails with `Err(n)` for the first `fails` calls; counts calls.
    fn flaky(fails: u32, calls: &std::cell::Cell<u32>) -> std::future::Ready<Result<u32, u32>> {
        let n = calls.get() + 1;
        calls.set(n);
        std::future::ready(if n <= fails { Err(n) } else { Ok(n) })
    }

    #[tokio::test(start_paused = true)]
    async fn retry_waits_out_transient_failures() {
        let (calls, seen) = (std::cell::Cell::new(0), std::cell::RefCell::new(Vec::new()));
        let started = tokio::time::Instant::now();
        let r = retry(
            "test",
            cfg(),
            &CancellationToken::new(),
            |_| true,
            |e: &u32| seen.borrow_mut().push(*e),
            || flaky(3, &calls),
        )
        .await;
        assert_eq!(r, Ok(4));
        assert_eq!(*seen.borrow(), [1, 2, 3]);
        // Three delays of at least half of 100, 200 and 400 ms.
        assert!(
            started.elapsed() >= Duration::from_millis(350),
            "{:?}",
            started.elapsed()
        );
    }

    #[tokio::test(start_paused = true)]
    async fn retry_returns_a_fatal_failure_at_once() {
        let calls = std::cell::Cell::new(0);
        let r = retry(
            "test",
            cfg(),
            &CancellationToken::new(),
            |e| *e != 2,
            |_| {},
            || flaky(5, &calls),
        )
        .await;
        assert_eq!(r, Err(RetryError::Fatal(2)));
        assert_eq!(calls.get(), 2);
    }

    #[tokio::test(start_paused = true)]
    async fn retry_stops_on_shutdown() {
        let (calls, shutdown) = (std::cell::Cell::new(0), CancellationToken::new());
        let r = retry(
            "test",
            cfg(),
            &shutdown,
            |_| true,
            |_| shutdown.cancel(),
            || flaky(u32::MAX, &calls),
        )
        .await;
        assert_eq!(r, Err(RetryError::ShutDown));
        assert_eq!(calls.get(), 1);
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
