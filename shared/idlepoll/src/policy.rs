//! How long to poll before sleeping: an adaptive window, grown while the thread's idle periods
//! are short and shrunk once they are long, the scheme of Linux's `haltpoll` cpuidle governor
//! (which does the same for a whole guest vCPU, and which many VM hosts leave off).

use std::time::{Duration, Instant};

/// The first window after a short idle period, doubled on each further one up to the maximum.
pub const START: Duration = Duration::from_micros(8);

/// While the thread's recent tunnel traffic exceeds this it is moving bulk data: no poll. Bulk
/// transfers amortise a wake-up over hundreds of KiB, and polling between their bursts would
/// only turn idle time into CPU time. A request, an answer, an open, a window update or a
/// keepalive moves far less (a 64 B message is about 120 bytes on the wire, TLS included).
///
/// "Recent" is a decaying sum over busy periods (each park halves it, then adds the bytes of
/// the period that just ended), not the last period alone: a bulk transfer also has empty busy
/// periods (a write-readiness edge, a timer) that must not count as light traffic, and after
/// bulk data stops the sum falls below this within a few periods.
pub const LIGHT_BYTES: u64 = 16 * 1024;

/// How long polling pauses once a CPU-bound neighbour has cut polls short
/// ([`crate::ready::Wait::Contended`]) twice in a row; doubled each time it recurs right after a
/// pause, up to [`PAUSE_MAX`]. While a neighbour keeps this CPU busy the thread sleeps in its
/// driver, where the events it waits for wake it and it preempts the neighbour; after the
/// pause one poll probes again, so a neighbour that is gone costs at most this much polling.
///
/// One contended poll between polls that yielded and kept their CPU does not pause: that is a
/// burst of another task (a process on the same CPU handling a message or a handshake of its
/// own for a few hundred µs), not a neighbour that runs whole time slices. A CPU-bound
/// neighbour takes the CPU at nearly every yield, so the next poll that yields confirms it.
/// Pausing on the first one cut a quarter to two fifths of the broker's polls in a bench's
/// new-stream section for nothing (docs/benchmarks.md, forty-eighth machine).
pub const PAUSE_START: Duration = Duration::from_millis(50);

/// The longest pause: one probe per this much time while a neighbour stays, each costing at
/// most one of its time slices of latency to one message.
pub const PAUSE_MAX: Duration = Duration::from_secs(1);

/// How long a yield may keep the CPU from a polling thread before the poll counts as contended:
/// twice the longest window (another thread of ours polling on the same CPU gives it back
/// within its own window, a client or target woken there within its short turn), and at least
/// 200 µs. A CPU-bound neighbour keeps it for a time slice, 0.75–3 ms on current kernels.
pub fn stolen_bound(max: Duration) -> Duration {
    (max * 2).max(Duration::from_micros(200))
}

/// Polling paused after contended polls (see [`PAUSE_START`]).
#[derive(Debug, Clone, Default)]
pub struct Pause {
    until: Option<Instant>,
    next: Duration,
    /// The last poll was contended: the next contended one pauses.
    strike: bool,
}

impl Pause {
    /// Whether polling is paused at `now`.
    pub fn active(&self, now: Instant) -> bool {
        self.until.is_some_and(|u| now < u)
    }

    /// A poll was cut short by a neighbour at `now`. The first of a run only marks it; the
    /// second in a row pauses, and each one after a pause pauses longer than the last.
    pub fn contended(&mut self, now: Instant) {
        if !std::mem::replace(&mut self.strike, true) {
            return;
        }
        let pause = if self.next.is_zero() {
            PAUSE_START
        } else {
            self.next
        };
        self.until = Some(now + pause);
        self.next = (pause * 2).min(PAUSE_MAX);
    }

    /// A poll yielded and kept its CPU: no CPU-bound neighbour, the next contended poll only
    /// marks it, and a pause starts from [`PAUSE_START`] again. (A poll whose events were there
    /// at its first check never yielded and tells nothing: beside a CPU-bound neighbour every
    /// other poll is such a hit, the answer having come while the neighbour ran.)
    pub fn clear(&mut self) {
        *self = Self::default();
    }
}

/// One runtime thread's window.
#[derive(Debug, Clone)]
pub struct Policy {
    max: Duration,
    window: Duration,
    /// Decaying sum of the bytes of recent busy periods (see [`LIGHT_BYTES`]).
    recent: u64,
}

impl Policy {
    /// A policy whose window never exceeds `max`; it starts closed (no polling until an idle
    /// period shorter than `max` was seen).
    pub fn new(max: Duration) -> Self {
        Self {
            max,
            window: Duration::ZERO,
            recent: 0,
        }
    }

    /// The current window.
    pub fn window(&self) -> Duration {
        self.window
    }

    /// How long to poll before sleeping, after a busy period that moved `bytes` through the
    /// tunnel: the window while recent traffic is light, nothing while it is bulk.
    pub fn poll_for(&mut self, bytes: u64) -> Duration {
        self.recent = (self.recent / 2).saturating_add(bytes);
        if self.recent > LIGHT_BYTES {
            Duration::ZERO
        } else {
            self.window
        }
    }

    /// Adapts the window to an idle period (from the moment the thread ran out of work until it
    /// had work again, polling included): one that ended inside the window keeps it; one that
    /// ended after the window but within the maximum would have been caught by a longer window,
    /// so it doubles (from [`START`]); one longer than the maximum halves it, and below
    /// [`START`] it closes. A thread that sees work only now and then (keepalives, a watch
    /// event) so stops polling after a few idle periods.
    pub fn observe_idle(&mut self, idle: Duration) {
        if idle <= self.window {
            return;
        }
        if idle <= self.max {
            self.window = (self.window * 2).max(START).min(self.max);
        } else {
            self.window /= 2;
            if self.window < START {
                self.window = Duration::ZERO;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MAX: Duration = Duration::from_micros(100);

    fn us(n: u64) -> Duration {
        Duration::from_micros(n)
    }

    #[test]
    fn short_idle_periods_open_the_window_up_to_the_maximum() {
        let mut p = Policy::new(MAX);
        assert_eq!(p.window(), Duration::ZERO);
        let mut seen = Vec::new();
        for _ in 0..6 {
            p.observe_idle(us(90));
            seen.push(p.window().as_micros());
        }
        assert_eq!(seen, [8, 16, 32, 64, 100, 100]);
    }

    #[test]
    fn an_idle_period_inside_the_window_keeps_it() {
        let mut p = Policy::new(MAX);
        for _ in 0..4 {
            p.observe_idle(us(50));
        }
        assert_eq!(p.window(), us(64));
        p.observe_idle(us(20));
        assert_eq!(p.window(), us(64));
    }

    #[test]
    fn long_idle_periods_close_the_window() {
        let mut p = Policy::new(MAX);
        for _ in 0..5 {
            p.observe_idle(us(90));
        }
        assert_eq!(p.window(), MAX);
        let mut seen = Vec::new();
        for _ in 0..5 {
            p.observe_idle(Duration::from_millis(10));
            seen.push(p.window().as_micros());
        }
        assert_eq!(seen, [50, 25, 12, 0, 0]);
    }

    #[test]
    fn idle_periods_longer_than_the_maximum_never_open_it() {
        let mut p = Policy::new(MAX);
        for _ in 0..10 {
            p.observe_idle(us(150));
        }
        assert_eq!(p.window(), Duration::ZERO);
    }

    #[test]
    fn one_contended_poll_between_polls_that_kept_their_cpu_never_pauses() {
        let t0 = Instant::now();
        let mut p = Pause::default();
        for i in 0..10 {
            let at = t0 + Duration::from_millis(i);
            p.contended(at);
            assert!(!p.active(at), "paused after one contended poll ({i})");
            p.clear();
        }
    }

    #[test]
    fn contended_polls_in_a_row_pause_polling_longer_each_time_they_recur() {
        let t0 = Instant::now();
        let mut p = Pause::default();
        assert!(!p.active(t0));
        p.contended(t0);
        assert!(!p.active(t0), "the first contended poll only marks it");
        p.contended(t0);
        assert!(p.active(t0 + PAUSE_START - us(1)));
        assert!(!p.active(t0 + PAUSE_START));
        // The probe after the pause is contended again: twice as long, then capped.
        let mut at = t0 + PAUSE_START;
        let mut pauses = Vec::new();
        for _ in 0..8 {
            p.contended(at);
            let mut len = Duration::ZERO;
            while p.active(at + len) {
                len += Duration::from_millis(50);
            }
            pauses.push(len.as_millis());
            at += len;
        }
        assert_eq!(pauses, [100, 200, 400, 800, 1000, 1000, 1000, 1000]);
        // A poll that kept its CPU resets it: two in a row again before the next pause, and
        // that one back at the start.
        p.clear();
        assert!(!p.active(at));
        p.contended(at);
        assert!(!p.active(at));
        p.contended(at);
        assert!(p.active(at + PAUSE_START - us(1)));
        assert!(!p.active(at + PAUSE_START));
    }

    #[test]
    fn a_yield_counts_as_stolen_past_twice_the_window_and_at_least_200_us() {
        assert_eq!(stolen_bound(us(100)), us(200));
        assert_eq!(stolen_bound(us(50)), us(200));
        assert_eq!(
            stolen_bound(Duration::from_millis(1)),
            Duration::from_millis(2)
        );
    }

    #[test]
    fn bulk_work_is_not_followed_by_a_poll() {
        let mut p = Policy::new(MAX);
        for _ in 0..5 {
            p.observe_idle(us(90));
        }
        assert_eq!(p.poll_for(120), MAX);
        assert_eq!(p.poll_for(120), MAX);
        assert_eq!(p.poll_for(LIGHT_BYTES + 1), Duration::ZERO);
        assert_eq!(p.poll_for(256 * 1024), Duration::ZERO);
    }

    #[test]
    fn an_empty_busy_period_amid_bulk_is_not_light() {
        let mut p = Policy::new(MAX);
        for _ in 0..5 {
            p.observe_idle(us(90));
        }
        for _ in 0..3 {
            assert_eq!(p.poll_for(256 * 1024), Duration::ZERO);
            assert_eq!(
                p.poll_for(0),
                Duration::ZERO,
                "a readiness edge between frames"
            );
        }
    }

    #[test]
    fn light_traffic_after_bulk_polls_again_within_a_few_periods() {
        let mut p = Policy::new(MAX);
        for _ in 0..5 {
            p.observe_idle(us(90));
        }
        assert_eq!(p.poll_for(256 * 1024), Duration::ZERO);
        let light = (0..10).position(|_| !p.poll_for(120).is_zero());
        // 256 KiB halves to under 16 KiB in five periods.
        assert_eq!(light, Some(4));
    }

    #[test]
    fn a_zero_maximum_never_polls() {
        let mut p = Policy::new(Duration::ZERO);
        for _ in 0..5 {
            p.observe_idle(Duration::ZERO);
            p.observe_idle(us(1));
        }
        assert_eq!(p.poll_for(0), Duration::ZERO);
    }
}
