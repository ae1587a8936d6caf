//! Wedged-tunnel watchdog: a tunnel whose connection is up but moves no bytes is torn down.
//!
//! An HTTP/2 PING alone does not catch every wedge quickly: it goes out once per keepalive
//! interval, and while streams wait a tunnel can sit for that whole interval before anyone asks.
//! The watchdog looks at the transport itself, **below TLS**: [`ProgressIo`] wraps the socket
//! and notes when this end wrote bytes that the peer has not answered yet (the first write
//! after the last read). A healthy peer always answers within a round trip of being asked, so:
//!
//! - once bytes go unanswered for [`Watchdog::tick`] (a quarter of `stall_timeout`), the
//!   watchdog asks the keepalive loop for an immediate PING ([`Progress::probe`]), which a live
//!   peer must ack;
//! - after half of `stall_timeout` unanswered, *and* once that PING has gone unanswered for
//!   half a tick or more (in practice: at the next tick), the tunnel is *suspect*: the broker
//!   sends new streams elsewhere ([`Progress::is_suspect`]). Not on the clock alone: some writes need no answer (a PING
//!   ack, a WINDOW_UPDATE), and the tick that first sees one unanswered can come almost two
//!   ticks after it — a live, idle peer would then be marked suspect at the very tick the
//!   probe goes out (seen in the 1,000-agent bench: one cluster refused as "looks wedged"
//!   while its agent was fine);
//! - after `stall_timeout` unanswered it is *wedged*: [`Watchdog::run`] returns, and the owner
//!   tears the connection down (its streams end with an error) and the agent redials.
//!
//! Detection time: at most `stall_timeout + tick` after the first unanswered write (a stream's
//! data, a dial, a window update); on an idle tunnel the keepalive PING is that write, so at
//! most `keepalive_interval + 1.25 × stall_timeout`. A write blocked because the socket buffer
//! is full also starts the clock (the peer is not reading), so a link that drops packets and one
//! that stops reading are both caught, whether or not a FIN or RST ever arrives.
//!
//! Time this process was not running (a tick that came a pause late: a paused VM, SIGSTOP) is
//! not counted against the peer ([`crate::pause`]): after such a pause the ticks fire before the
//! socket is read, and the answer may be sitting in its buffer. Detection then takes the pause
//! longer (at most [`crate::pause::MAX_PAUSE_CREDIT`] longer).

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::Notify;

use crate::pause;

/// Shortest watchdog tick (a tiny `stall_timeout` must not turn it into a busy loop).
pub const MIN_TICK: Duration = Duration::from_millis(10);

/// Transport progress of one tunnel connection, shared by its [`ProgressIo`], its watchdog and
/// its keepalive loop.
#[derive(Debug)]
pub struct Progress {
    epoch: Instant,
    /// Milliseconds since `epoch` (+1) of the first write not yet followed by a read; 0: none.
    unanswered_since: AtomicU64,
    suspect: AtomicBool,
    probe: Notify,
}

impl Default for Progress {
    fn default() -> Self {
        Self {
            epoch: Instant::now(),
            unanswered_since: AtomicU64::new(0),
            suspect: AtomicBool::new(false),
            probe: Notify::new(),
        }
    }
}

impl Progress {
    pub fn new() -> Arc<Self> {
        Arc::default()
    }

    fn now_ms(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_millis()).unwrap_or(u64::MAX - 1) + 1
    }

    /// Bytes arrived from the peer: everything written so far counts as answered.
    pub fn on_read(&self) {
        if self.unanswered_since.load(Ordering::Relaxed) != 0 {
            self.unanswered_since.store(0, Ordering::Relaxed);
        }
        if self.suspect.load(Ordering::Relaxed) {
            self.suspect.store(false, Ordering::Relaxed);
        }
    }

    /// Bytes were written (or a write is blocked): the peer owes an answer from now on.
    pub fn on_write(&self) {
        if self.unanswered_since.load(Ordering::Relaxed) == 0 {
            let _ = self.unanswered_since.compare_exchange(
                0,
                self.now_ms(),
                Ordering::Relaxed,
                Ordering::Relaxed,
            );
        }
    }

    /// How long bytes written to the peer have gone unanswered, if any have.
    pub fn unanswered(&self) -> Option<Duration> {
        self.waited(self.unanswered_since.load(Ordering::Relaxed))
    }

    /// How long the unanswered period that started at `since` (as stored; 0: none) has lasted.
    fn waited(&self, since: u64) -> Option<Duration> {
        (since != 0).then(|| Duration::from_millis(self.now_ms().saturating_sub(since)))
    }

    /// The peer has not answered for half the stall timeout: avoid the tunnel for new streams.
    pub fn is_suspect(&self) -> bool {
        self.suspect.load(Ordering::Relaxed)
    }

    /// Resolves when the watchdog wants an immediate PING (the keepalive loop waits on it).
    pub async fn probe(&self) {
        self.probe.notified().await
    }
}

/// Why [`Watchdog::run`] returned: the tunnel is wedged.
#[derive(Debug, Clone, thiserror::Error)]
#[error(
    "tunnel wedged: bytes written {}ms ago are still unanswered (stall timeout {}ms{}); \
     the connection is up but moves no bytes",
    unanswered.as_millis(),
    stall_timeout.as_millis(),
    paused_note(*paused)
)]
pub struct Wedged {
    /// Wall-clock time the bytes have waited.
    pub unanswered: Duration,
    pub stall_timeout: Duration,
    /// Part of `unanswered` this process was paused for, not counted against the peer
    /// ([`crate::pause`]).
    pub paused: Duration,
}

fn paused_note(paused: Duration) -> String {
    if paused.is_zero() {
        String::new()
    } else {
        format!(
            ", not counting {}ms this process was paused",
            paused.as_millis()
        )
    }
}

/// The watchdog of one tunnel connection.
#[derive(Debug, Clone)]
pub struct Watchdog {
    pub progress: Arc<Progress>,
    pub stall_timeout: Duration,
    /// Counts the times the tunnel became suspect (not the ticks it stayed so).
    suspected: Option<prometheus::IntCounter>,
    /// Names the tunnel in the watchdog's log lines (a field, not a span: the watchdog's
    /// future is polled on every wake-up of its owner's task, a data-path task on the agent).
    name: Option<Arc<str>>,
}

impl Watchdog {
    pub fn new(progress: Arc<Progress>, stall_timeout: Duration) -> Self {
        Self {
            progress,
            stall_timeout,
            suspected: None,
            name: None,
        }
    }

    /// Names the tunnel in the watchdog's log lines (e.g. its cluster and broker or id).
    pub fn named(mut self, name: impl Into<Arc<str>>) -> Self {
        self.name = Some(name.into());
        self
    }

    /// Counts each time the tunnel turns suspect in `counter` (the broker's
    /// `tether_broker_tunnel_suspect_total`): a live tunnel that keeps turning suspect is
    /// refusing streams to a cluster that may be fine.
    pub fn count_suspect_in(mut self, counter: prometheus::IntCounter) -> Self {
        self.suspected = Some(counter);
        self
    }

    /// How often progress is checked: a quarter of the stall timeout.
    pub fn tick(&self) -> Duration {
        (self.stall_timeout / 4).max(MIN_TICK)
    }

    /// Worst-case time from the first unanswered write to [`Watchdog::run`] returning.
    pub fn detection_bound(&self) -> Duration {
        self.stall_timeout + self.tick()
    }

    /// Watches until the tunnel is wedged; cancel it by dropping the future.
    ///
    /// A tick that comes [`pause::PAUSE_THRESHOLD`] or more late saw this process not run
    /// (a paused VM or process): that time is not counted against the peer, whose answer may
    /// be waiting, unread, in the socket buffer ([`crate::pause`]).
    pub async fn run(&self) -> Wedged {
        let tick = self.tick();
        let mut interval = tokio::time::interval(tick);
        interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        // The unanswered period (its start, as stored) the pause credit belongs to, and it.
        let mut credit = (0u64, pause::Credit::new(pause::MAX_PAUSE_CREDIT));
        // The unanswered period the first probe went out in, and how long (pauses not
        // counted) the bytes had waited then.
        let mut probed: Option<(u64, Duration)> = None;
        loop {
            let due = interval.tick().await;
            let since = self.progress.unanswered_since.load(Ordering::Relaxed);
            let Some(wall) = self.progress.waited(since) else {
                probed = None;
                continue;
            };
            if credit.0 != since {
                credit = (since, pause::Credit::new(pause::MAX_PAUSE_CREDIT));
            }
            credit.1.observe(due.into_std(), Instant::now());
            let waited = wall.saturating_sub(credit.1.granted());
            if waited >= self.stall_timeout {
                return Wedged {
                    unanswered: wall,
                    stall_timeout: self.stall_timeout,
                    paused: credit.1.granted().min(wall),
                };
            }
            if probed.is_some_and(|(period, _)| period != since) {
                probed = None;
            }
            let probe_overdue = probed.is_some_and(|(_, at)| waited.saturating_sub(at) >= tick / 2);
            if waited >= self.stall_timeout / 2
                && probe_overdue
                && !self.progress.suspect.swap(true, Ordering::Relaxed)
            {
                tracing::warn!(
                    tunnel = self.name.as_deref().unwrap_or("unnamed"),
                    unanswered_ms = waited.as_millis() as u64,
                    stall_timeout_ms = self.stall_timeout.as_millis() as u64,
                    "tunnel suspect: bytes to the peer and a probe PING are unanswered"
                );
                if let Some(c) = &self.suspected {
                    c.inc();
                }
            }
            if waited >= tick {
                self.progress.probe.notify_one();
                probed.get_or_insert((since, waited));
            }
        }
    }
}

/// A transport wrapper that reports reads and writes to a [`Progress`] (put it right on the
/// socket, below TLS, so every byte counts and nothing buffered above hides a stall). The socket
/// is wrapped in [`tether_idlepoll::Counted`] too: idle polling follows light traffic, not bulk.
pub struct ProgressIo<T> {
    inner: tether_idlepoll::Counted<T>,
    progress: Arc<Progress>,
}

impl<T> ProgressIo<T> {
    pub fn new(inner: T, progress: Arc<Progress>) -> Self {
        Self {
            inner: tether_idlepoll::Counted::new(inner),
            progress,
        }
    }

    pub fn get_ref(&self) -> &T {
        self.inner.get_ref()
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for ProgressIo<T> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let me = self.get_mut();
        let before = buf.filled().len();
        let r = Pin::new(&mut me.inner).poll_read(cx, buf);
        if matches!(r, Poll::Ready(Ok(()))) && buf.filled().len() > before {
            me.progress.on_read();
        }
        r
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for ProgressIo<T> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let me = self.get_mut();
        let r = Pin::new(&mut me.inner).poll_write(cx, buf);
        if !buf.is_empty() && !matches!(r, Poll::Ready(Err(_))) {
            me.progress.on_write();
        }
        r
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let me = self.get_mut();
        let r = Pin::new(&mut me.inner).poll_write_vectored(cx, bufs);
        if bufs.iter().any(|b| !b.is_empty()) && !matches!(r, Poll::Ready(Err(_))) {
            me.progress.on_write();
        }
        r
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::tcp_pair;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// Waits for the watchdog's next probe request; a wedge first is a failure.
    async fn until_probe(
        run: Pin<&mut impl std::future::Future<Output = Wedged>>,
        progress: &Progress,
    ) {
        tokio::select! {
            w = run => panic!("wedged before probing: {w}"),
            _ = progress.probe() => {}
        }
    }

    #[tokio::test]
    async fn answered_writes_never_wedge_and_silence_does() {
        let (a, mut b) = tcp_pair().await;
        let progress = Progress::new();
        let mut a = ProgressIo::new(a, Arc::clone(&progress));
        let dog = Watchdog::new(Arc::clone(&progress), Duration::from_millis(200));
        // A peer that answers every write keeps the clock at zero.
        let run = dog.run();
        tokio::pin!(run);
        for _ in 0..10 {
            a.write_all(b"ping").await.unwrap();
            assert!(progress.unanswered().is_some());
            let mut buf = [0u8; 4];
            b.read_exact(&mut buf).await.unwrap();
            b.write_all(b"pong").await.unwrap();
            a.read_exact(&mut buf).await.unwrap();
            assert!(progress.unanswered().is_none());
            tokio::select! {
                w = &mut run => panic!("wedged while answered: {w}"),
                _ = tokio::time::sleep(Duration::from_millis(30)) => {}
            }
        }
        // An unanswered write: suspect, then wedged within the bound.
        let started = Instant::now();
        a.write_all(b"hello?").await.unwrap();
        let w = run.await;
        let took = started.elapsed();
        assert!(progress.is_suspect());
        assert!(w.unanswered >= Duration::from_millis(200), "{w}");
        assert!(
            took <= dog.detection_bound() + Duration::from_millis(100),
            "{took:?}"
        );
        assert!(w.to_string().contains("stall timeout 200ms"), "{w}");
    }

    /// A write that needs no answer (a PING ack) followed by silence is not suspect at the tick
    /// that first probes, however late that tick comes: only a probe left unanswered is.
    #[tokio::test]
    async fn suspect_only_once_a_probe_went_unanswered() {
        // Its clock started a second ago, so writes can be placed in the past.
        let progress = Arc::new(Progress {
            epoch: Instant::now()
                .checked_sub(Duration::from_secs(1))
                .expect("a monotonic clock older than 1 s"),
            ..Progress::default()
        });
        let stall = Duration::from_millis(400);
        let suspected = prometheus::IntCounter::new("suspect_total", "suspect").unwrap();
        let dog = Watchdog::new(Arc::clone(&progress), stall).count_suspect_in(suspected.clone());
        let tick = dog.tick();
        // A write 210 ms ago that needed no answer: past half the stall timeout by the time the
        // first tick sees it (ticks come late on a loaded machine).
        let ago = |ms| progress.now_ms() - ms;
        progress.unanswered_since.store(ago(210), Ordering::Relaxed);
        let run = dog.run();
        tokio::pin!(run);
        until_probe(run.as_mut(), &progress).await;
        assert!(
            !progress.is_suspect(),
            "suspect before any probe went unanswered"
        );
        // The probe is answered (a live peer); a new silent period starts the same way.
        progress.on_read();
        progress.unanswered_since.store(ago(110), Ordering::Relaxed);
        until_probe(run.as_mut(), &progress).await;
        assert!(
            !progress.is_suspect(),
            "a new period's first probe is not overdue"
        );
        assert_eq!(suspected.get(), 0, "counted while never suspect");
        // This probe is not answered: suspect at a following tick, then wedged.
        let started = Instant::now();
        let w = run.await;
        assert!(
            progress.is_suspect(),
            "an unanswered probe makes the tunnel suspect"
        );
        // Counted once when it turned suspect, not once per tick it stayed so.
        assert_eq!(suspected.get(), 1);
        assert!(w.unanswered >= stall, "{w}");
        assert!(started.elapsed() <= stall + tick, "{:?}", started.elapsed());
    }

    #[tokio::test]
    async fn the_watchdog_asks_for_a_probe() {
        let progress = Progress::new();
        let dog = Watchdog::new(Arc::clone(&progress), Duration::from_millis(400));
        progress.on_write();
        let run = dog.run();
        tokio::pin!(run);
        until_probe(run.as_mut(), &progress).await;
        // The probe's answer clears the clock and the suspicion.
        progress.on_read();
        assert!(progress.unanswered().is_none() && !progress.is_suspect());
    }

    /// The process does not run for longer than the stall timeout while bytes wait for an
    /// answer, and the answer is read only after the watchdog has run again (as after a VM
    /// pause: its ticks fire before the socket is read): not wedged. Silence afterwards still
    /// is, within the bound plus the pause.
    #[tokio::test(flavor = "current_thread")]
    async fn a_pause_of_the_process_does_not_wedge_the_tunnel() {
        let progress = Progress::new();
        let stall = Duration::from_millis(400);
        let dog = Watchdog::new(Arc::clone(&progress), stall);
        let (started_tx, running) = tokio::sync::oneshot::channel();
        let run = tokio::spawn({
            let dog = dog.clone();
            async move {
                let _ = started_tx.send(());
                dog.run().await // its interval starts in this same poll
            }
        });
        running.await.expect("the watchdog started");
        progress.on_write();
        // "Pause": the runtime's only thread sleeps through twice the stall timeout.
        std::thread::sleep(stall * 2);
        // Running again: the watchdog's late tick is seen first, then the answer.
        tokio::time::sleep(Duration::from_millis(1)).await;
        assert!(
            !run.is_finished(),
            "wedged by a pause of its own process: {:?}",
            run.await
        );
        progress.on_read();
        // A new unanswered write and silence: wedged, counting only the time after the pause.
        let started = Instant::now();
        progress.on_write();
        let w = run.await.expect("no panic");
        assert!(w.unanswered >= stall, "{w}");
        assert!(
            started.elapsed() <= dog.detection_bound() + Duration::from_millis(200),
            "{:?}",
            started.elapsed()
        );
    }
}
