//! Failure-detection time that counts only the time this process ran.
//!
//! The keepalive PING and the wedged-tunnel watchdog judge the peer by how long it has not
//! answered. Measured on the wall clock, that blames the peer for time this process was not
//! running: a paused VM (live migration, a host stealing its CPUs), a SIGSTOP, a swap storm.
//! When such a pause ends, the timers that came due during it fire at once — usually before the
//! tasks that read the sockets have run — so the peer's answer, already in the socket buffer
//! (or sent a moment later, when a peer paused with us resumes too), is not seen yet and a
//! healthy tunnel is torn down. A whole fleet frozen for 7 s lost every tunnel to both brokers
//! that way (`tests/tests/hub_chaos_tunnels.rs`, and a CI run of it on a stalling host).
//!
//! A timer's lateness is the evidence: one that fires more than [`PAUSE_THRESHOLD`] after it was
//! due saw this process not run for that long. That time is credited back to the peer: its
//! deadline moves on by it, up to [`MAX_PAUSE_CREDIT`] per wait. The wait still ends: each step
//! counts the time it slept, so a dead peer is given up on after the limit of time this process
//! ran, however often it is paused — and after the limit plus at most [`MAX_PAUSE_CREDIT`] of
//! wall-clock time.
//!
//! - [`timeout`]: `tokio::time::timeout` for a PING's answer, crediting pauses anywhere in the
//!   wait (it sleeps in steps of a quarter of the limit and measures each step's lateness);
//! - [`Credit`]: the bookkeeping, for a loop that keeps its own ticks (the watchdog);
//! - [`Settle`]: for a periodic check that judges others by their wall-clock renewals (the
//!   broker's relay peers by their presence entries): after a pause it holds off judging until
//!   the renewals that came due during the pause have had time to arrive.

use std::future::Future;
use std::time::{Duration, Instant};

/// Lateness of a timer from which it counts as a pause of the process: far above a timer's
/// ordinary lateness (about a millisecond; tens under a loaded 2-core machine), far below any
/// keepalive or stall timeout.
pub const PAUSE_THRESHOLD: Duration = Duration::from_millis(200);

/// Most pause time credited to one wait: a pause longer than this (a VM stopped for minutes)
/// counts against the peer — by then every peer on another machine has given up on this one.
pub const MAX_PAUSE_CREDIT: Duration = Duration::from_secs(60);

/// Shortest step [`timeout`] sleeps (a tiny limit must not turn the wait into a busy loop).
pub const MIN_STEP: Duration = Duration::from_millis(10);

/// How late a timer due at `due` fired at `now`, when that is late enough to be a pause.
pub fn pause(due: Instant, now: Instant) -> Option<Duration> {
    let late = now.saturating_duration_since(due);
    (late >= PAUSE_THRESHOLD).then_some(late)
}

/// Pause time credited to one wait, at most `cap` in all.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Credit {
    granted: Duration,
    cap: Duration,
}

impl Credit {
    pub fn new(cap: Duration) -> Self {
        Self {
            granted: Duration::ZERO,
            cap,
        }
    }

    /// Credits the pause seen by a timer due at `due` that fired at `now`, if it was one;
    /// returns the time added (zero once the cap is reached).
    pub fn observe(&mut self, due: Instant, now: Instant) -> Duration {
        let Some(late) = pause(due, now) else {
            return Duration::ZERO;
        };
        let add = late.min(self.cap.saturating_sub(self.granted));
        self.granted += add;
        add
    }

    /// Time credited so far.
    pub fn granted(&self) -> Duration {
        self.granted
    }
}

/// The wait outlived its limit, pauses of this process not counted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("no answer within {limit:?} (plus {credited:?} this process was paused)")]
pub struct Elapsed {
    pub limit: Duration,
    /// Pause time credited to the wait.
    pub credited: Duration,
}

/// Like `tokio::time::timeout`, but time this process did not run (see the module docs) does not
/// count against `limit`, up to [`MAX_PAUSE_CREDIT`] of it.
pub async fn timeout<F: Future>(limit: Duration, fut: F) -> Result<F::Output, Elapsed> {
    let step = (limit / 4).max(MIN_STEP);
    let mut credit = Credit::new(MAX_PAUSE_CREDIT);
    let mut deadline = Instant::now() + limit;
    let mut fut = std::pin::pin!(fut);
    loop {
        let due = deadline.min(Instant::now() + step);
        tokio::select! {
            biased;
            out = &mut fut => return Ok(out),
            _ = tokio::time::sleep_until(due.into()) => {}
        }
        let now = Instant::now();
        deadline += credit.observe(due, now);
        if now >= deadline {
            return Err(Elapsed {
                limit,
                credited: credit.granted(),
            });
        }
    }
}

/// What a periodic check may do at this tick ([`Settle::check`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Judgement {
    /// No pause lately: judge.
    Judge,
    /// This tick came this late: the process was just paused; do not judge.
    Paused(Duration),
    /// A pause ended less than the settling time ago: do not judge yet.
    Settling,
}

/// Holds off a periodic staleness check for `settle` after each pause of this process.
#[derive(Debug, Clone, Copy)]
pub struct Settle {
    settle: Duration,
    until: Option<Instant>,
}

impl Settle {
    /// `settle`: how long after a pause the others' renewals need to be seen again (their
    /// grace period).
    pub fn new(settle: Duration) -> Self {
        Self {
            settle,
            until: None,
        }
    }

    /// The check's tick was due at `due` and runs at `now`.
    pub fn check(&mut self, due: Instant, now: Instant) -> Judgement {
        if let Some(p) = pause(due, now) {
            self.until = Some(now + self.settle);
            return Judgement::Paused(p);
        }
        match self.until {
            Some(t) if now < t => Judgement::Settling,
            _ => {
                self.until = None;
                Judgement::Judge
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_lateness_above_the_threshold_is_a_pause() {
        let due = Instant::now();
        assert_eq!(pause(due, due), None);
        assert_eq!(pause(due, due + Duration::from_millis(150)), None);
        assert_eq!(
            pause(due, due + Duration::from_secs(7)),
            Some(Duration::from_secs(7))
        );
        // A timer that fired early (not possible, but a clock read before it) is no pause.
        assert_eq!(pause(due + Duration::from_secs(1), due), None);
    }

    #[test]
    fn credit_stops_at_its_cap() {
        let t = Instant::now();
        let mut c = Credit::new(Duration::from_secs(5));
        assert_eq!(c.observe(t, t + Duration::from_millis(50)), Duration::ZERO);
        assert_eq!(
            c.observe(t, t + Duration::from_secs(3)),
            Duration::from_secs(3)
        );
        assert_eq!(
            c.observe(t, t + Duration::from_secs(3)),
            Duration::from_secs(2)
        );
        assert_eq!(c.observe(t, t + Duration::from_secs(3)), Duration::ZERO);
        assert_eq!(c.granted(), Duration::from_secs(5));
    }

    #[tokio::test]
    async fn an_answer_in_time_is_returned() {
        let r = timeout(Duration::from_secs(5), async { 42 }).await;
        assert_eq!(r, Ok(42));
    }

    #[tokio::test]
    async fn silence_times_out_after_the_limit_when_nothing_paused() {
        let limit = Duration::from_millis(300);
        let started = Instant::now();
        let r = timeout(limit, std::future::pending::<()>()).await;
        let took = started.elapsed();
        assert_eq!(
            r,
            Err(Elapsed {
                limit,
                credited: Duration::ZERO
            })
        );
        assert!(took >= limit, "{took:?}");
    }

    /// "Pauses" the process: the runtime's only thread sleeps, so no task and no timer runs.
    fn pause_the_runtime(d: Duration) {
        std::thread::sleep(d);
    }

    /// The process does not run for twice the limit, and the answer comes 50 ms after it runs
    /// again (a peer paused with it; or a PING's answer read by another task than the one
    /// waiting for it): the timer that came due during the pause does not end the wait.
    #[tokio::test(flavor = "current_thread")]
    async fn a_pause_of_the_process_is_not_counted_against_the_peer() {
        let limit = Duration::from_millis(400);
        let (tx, rx) = tokio::sync::oneshot::channel::<u8>();
        let (started_tx, running) = tokio::sync::oneshot::channel();
        let wait = tokio::spawn(async move {
            let _ = started_tx.send(());
            timeout(limit, rx).await // its clock starts in this same poll
        });
        running.await.expect("the wait started");
        pause_the_runtime(limit * 2);
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(50)).await;
            let _ = tx.send(7);
        });
        let r = wait.await.expect("no panic");
        assert!(matches!(r, Ok(Ok(7))), "{r:?}");
    }

    /// A pause is credited, the peer then still has to answer: it times out, later.
    #[tokio::test(flavor = "current_thread")]
    async fn silence_after_a_pause_still_times_out() {
        let limit = Duration::from_millis(400);
        let started = Instant::now();
        let (started_tx, running) = tokio::sync::oneshot::channel();
        let wait = tokio::spawn(async move {
            let _ = started_tx.send(());
            timeout(limit, std::future::pending::<()>()).await
        });
        running.await.expect("the wait started");
        pause_the_runtime(limit * 2);
        let e = wait
            .await
            .expect("no panic")
            .expect_err("the peer never answers");
        let took = started.elapsed();
        assert_eq!(e.limit, limit);
        assert!(
            e.credited >= PAUSE_THRESHOLD && e.credited <= limit * 2,
            "credited {:?}",
            e.credited
        );
        // The limit of running time, after the pause.
        assert!(took >= limit * 2 + limit / 2, "{took:?}");
    }

    #[test]
    fn a_pause_holds_judging_off_for_the_settling_time() {
        let settle = Duration::from_secs(6);
        let mut s = Settle::new(settle);
        let t = Instant::now();
        let ms = Duration::from_millis;
        assert_eq!(s.check(t, t + ms(2)), Judgement::Judge);
        assert_eq!(
            s.check(t + ms(500), t + ms(7500)),
            Judgement::Paused(ms(7000))
        );
        assert_eq!(s.check(t + ms(8000), t + ms(8001)), Judgement::Settling);
        assert_eq!(s.check(t + ms(13400), t + ms(13401)), Judgement::Settling);
        assert_eq!(s.check(t + ms(13500), t + ms(13501)), Judgement::Judge);
        // Another pause while settling starts the settling time again.
        assert_eq!(
            s.check(t + ms(14000), t + ms(15000)),
            Judgement::Paused(ms(1000))
        );
        assert_eq!(s.check(t + ms(20900), t + ms(20901)), Judgement::Settling);
        assert_eq!(s.check(t + ms(21000), t + ms(21001)), Judgement::Judge);
    }
}
