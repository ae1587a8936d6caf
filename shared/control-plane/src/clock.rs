//! Wall-clock time for the control-plane logic, behind a trait so that unit tests control it.
//!
//! Leases, certificate lifetimes and event timestamps are wall-clock (RFC 3339 in the store),
//! so the logic reads [`Clock::now`] instead of `SystemTime::now()`. [`SystemClock`] is the
//! real one; [`TokioClock`] starts at the wall-clock time it was created and then follows
//! tokio's clock, so a test under `tokio::time::pause()` moves it with
//! `tokio::time::advance` (and auto-advance while every task sleeps).

use std::sync::Arc;
use std::time::SystemTime;

/// A source of wall-clock time.
pub trait Clock: Send + Sync + std::fmt::Debug {
    fn now(&self) -> SystemTime;
}

/// A shared clock.
pub type SharedClock = Arc<dyn Clock>;

/// `SystemTime::now()`.
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> SystemTime {
        SystemTime::now()
    }
}

/// The system clock.
pub fn system() -> SharedClock {
    Arc::new(SystemClock)
}

/// Wall-clock time that advances with tokio's clock (paused in tests).
#[derive(Debug, Clone, Copy)]
pub struct TokioClock {
    wall: SystemTime,
    start: tokio::time::Instant,
}

impl TokioClock {
    /// Starts at the current wall-clock time.
    pub fn new() -> Self {
        Self::starting_at(SystemTime::now())
    }

    /// Starts at `wall`.
    pub fn starting_at(wall: SystemTime) -> Self {
        Self {
            wall,
            start: tokio::time::Instant::now(),
        }
    }

    pub fn shared(self) -> SharedClock {
        Arc::new(self)
    }
}

impl Default for TokioClock {
    fn default() -> Self {
        Self::new()
    }
}

impl Clock for TokioClock {
    fn now(&self) -> SystemTime {
        self.wall + self.start.elapsed()
    }
}
