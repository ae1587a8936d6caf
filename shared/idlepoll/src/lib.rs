//! Idle polling for the data-plane processes (broker and agent, and the forward of
//! `tetherctl proxy connect|kubectl`).
//!
//! A tunnelled message crosses the broker and the agent, and at each of them it usually finds
//! the runtime thread asleep in `epoll_wait`: every hop pays a wake-up. On a machine whose idle
//! CPU halts that is the dearest part of a small message's trip: on a VM without guest halt
//! polling (`cpuidle_haltpoll` with `guest_halt_poll_ns=0`, common on Firecracker and cloud
//! hosts), waking a halted vCPU costs 15–25 µs, so a 64 B round trip through the tunnel pays it
//! four times. With idle polling, a runtime thread that runs out of work after *light* traffic
//! (a request, an answer, an open; not bulk data) first checks its I/O driver for a short
//! while, yielding the CPU between checks, and sleeps only if nothing came: the answer that
//! arrives a few tens of µs later finds it awake. This is what Linux's `haltpoll` governor does
//! for a whole guest, and what Seastar's reactor (`--idle-poll-time-us`) and Go's spinning
//! scheduler threads do in user space.
//!
//! The cost is CPU time that would have been idle, bounded two ways: the window adapts per
//! thread ([`policy::Policy`]: it opens while idle periods are short and closes once they are
//! long, so an idle tunnel with only keepalives stops polling after a few of them), and busy
//! periods that moved more than [`policy::LIGHT_BYTES`] through the tunnel are not followed by a
//! poll at all (bulk transfers gain nothing from it). And it steps aside for a CPU-bound
//! neighbour ([`ready::Wait::Contended`], [`policy::Pause`]): a polling thread is runnable, so
//! its events do not wake it, and a yield to a neighbour returns only after the neighbour's
//! time slice; a poll that loses the CPU that long ends, and two in a row (no yield between
//! that kept the CPU: one alone is another task's burst) pause polling. Measured in
//! docs/benchmarks.md.
//!
//! Layout:
//! - [`note_io`] and [`Counted`]: tunnel transports report the bytes they move (`Counted`
//!   wraps every tunnel socket below TLS, inside `tether_tunnel`'s `ProgressIo`, and a broker's
//!   relay links to its peers; `tetherctl`'s forward calls `note_io` from its copy loops),
//!   counted per thread since the thread last parked;
//! - [`policy`]: the adaptive window, the light-traffic gate and the pause after a contended
//!   poll (pure, unit-tested);
//! - [`ready`]: finding the runtime's epoll descriptor and polling it (the crate's one reviewed
//!   `unsafe` block, the `poll(2)` call);
//! - [`build_current_thread`]: installs the park and unpark hooks on a current-thread runtime;
//! - [`build_multi_thread`] and [`LastAwake`]: the same hooks on a multi-thread runtime (the
//!   broker's and agent's default on four CPUs or more), where only the last worker to go idle
//!   polls, after light traffic of the whole runtime. tokio gives the I/O driver to a worker
//!   that parks while no other holds it, and runs the park hook before the worker parks, so
//!   the last worker awake is the one that will hold the driver: what its poll sees, it
//!   collects at once. A worker that polled while another was parked in the driver would only
//!   see the events the kernel wakes that other worker for;
//! - [`register`]: the three counters in a Prometheus registry.

pub mod policy;
pub mod ready;

use std::cell::{Cell, RefCell};
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, LazyLock, OnceLock};
use std::time::{Duration, Instant};

use policy::Policy;
use prometheus::{Counter, IntCounter};

/// The default longest poll of the broker and the agent: long enough to cover the answer to a
/// message that crosses the agent and its target (about 40–60 µs on the hosts measured), short
/// next to any timer (1 ms resolution).
pub const DEFAULT_MAX: Duration = Duration::from_micros(100);

/// Longest window accepted: a window this long would only burn CPU (and delay timers).
pub const MAX_MAX: Duration = Duration::from_millis(1);

thread_local! {
    /// Bytes moved through tunnel transports on this thread since it last parked.
    static WORK: Cell<u64> = const { Cell::new(0) };
    static STATE: RefCell<Option<ThreadState>> = const { RefCell::new(None) };
}

struct ThreadState {
    policy: Policy,
    parked_at: Option<Instant>,
    pause: policy::Pause,
}

/// Reports `bytes` moved through a tunnel transport on this thread (read or written). Cheap: a
/// thread-local addition.
pub fn note_io(bytes: usize) {
    WORK.with(|w| w.set(w.get().saturating_add(bytes as u64)));
}

static POLLS: LazyLock<IntCounter> = LazyLock::new(|| {
    IntCounter::new(
        "tether_runtime_idle_polls_total",
        "Times a runtime thread polled its I/O driver before sleeping (after light traffic, \
         with its window open)",
    )
    .expect("valid metric")
});
static HITS: LazyLock<IntCounter> = LazyLock::new(|| {
    IntCounter::new(
        "tether_runtime_idle_poll_hits_total",
        "Idle polls that saw work arrive within the window: a sleep and a wake-up avoided",
    )
    .expect("valid metric")
});
static CONTENDED: LazyLock<IntCounter> = LazyLock::new(|| {
    IntCounter::new(
        "tether_runtime_idle_poll_contended_total",
        "Idle polls cut short because another task kept the CPU past the bound; two in a row \
         (a CPU-bound neighbour on this CPU) pause polling, 50 ms doubling to 1 s while it recurs",
    )
    .expect("valid metric")
});
static SECONDS: LazyLock<Counter> = LazyLock::new(|| {
    Counter::new(
        "tether_runtime_idle_poll_seconds_total",
        "Time runtime threads spent polling before sleeping (wall clock: an upper bound of \
         the CPU it cost, since a poll yields the CPU between checks)",
    )
    .expect("valid metric")
});

/// Registers the idle-poll counters (process-wide) in `registry`.
pub fn register(registry: &prometheus::Registry) -> prometheus::Result<()> {
    registry.register(Box::new(POLLS.clone()))?;
    registry.register(Box::new(HITS.clone()))?;
    registry.register(Box::new(SECONDS.clone()))?;
    registry.register(Box::new(CONTENDED.clone()))?;
    Ok(())
}

/// Counters so far: (polls, hits, seconds polled).
#[cfg(test)]
pub(crate) fn totals() -> (u64, u64, f64) {
    (POLLS.get(), HITS.get(), SECONDS.get())
}

/// What idle polling does in this process, once a runtime was built (for the start-up log).
static STATUS: OnceLock<String> = OnceLock::new();

/// What idle polling does in this process: on with its bound, or off and why. For the
/// services' start-up log line, so an operator who set `--idle-poll-us` sees whether it took.
pub fn status() -> &'static str {
    STATUS.get().map_or("off (--idle-poll-us 0)", |s| s)
}

/// Builds a current-thread runtime from `builder` with idle polling of at most `max` (zero:
/// none; longer than [`MAX_MAX`]: [`MAX_MAX`]). Call it where nothing else creates epoll
/// descriptors at the same time (a service's `main` before it starts other threads): the
/// runtime's descriptor is found as the one its creation added. If that cannot be told (no
/// `/proc`, or more than [`ready::MAX_DRIVER_FDS`] new ones), the runtime runs without polling.
pub fn build_current_thread(
    builder: &mut tokio::runtime::Builder,
    max: Duration,
) -> std::io::Result<tokio::runtime::Runtime> {
    build(builder, max, None)
}

/// Builds a multi-thread runtime of `workers` workers (set on `builder` here, so the count the
/// hooks use is the runtime's) with idle polling of at most `max`, as
/// [`build_current_thread`], with one more condition ([`LastAwake`]): a worker
/// polls only when every other worker is parked. In tokio's multi-thread scheduler the I/O
/// driver is taken by a worker that parks while no other holds it, and the park hook runs
/// before the worker parks, so the last worker to go idle is the one that will hold the
/// driver: its poll sees the events the driver would wake it for, and it goes on to collect
/// them at once. A worker that polled while another held the driver would see the same events
/// while the kernel wakes that other worker anyway: nothing saved, so it does not poll.
pub fn build_multi_thread(
    builder: &mut tokio::runtime::Builder,
    max: Duration,
    workers: usize,
) -> std::io::Result<tokio::runtime::Runtime> {
    let workers = workers.max(1);
    builder.worker_threads(workers);
    build(builder, max, Some(Arc::new(LastAwake::new(workers))))
}

/// Which workers of a multi-thread runtime are in their park (between the park hook and the
/// unpark hook), and the tunnel bytes they moved since the runtime last went wholly idle: a
/// worker polls only if it is the last one awake, and only after light traffic of the whole
/// runtime (a worker that did little while another moved bulk data must not poll).
#[derive(Debug)]
pub struct LastAwake {
    workers: usize,
    parked: AtomicUsize,
    work: AtomicU64,
}

impl LastAwake {
    pub fn new(workers: usize) -> Self {
        Self {
            workers: workers.max(1),
            parked: AtomicUsize::new(0),
            work: AtomicU64::new(0),
        }
    }

    /// Called from the park hook with the bytes this worker moved since it last parked. If
    /// every other worker is parked, returns the bytes all workers moved since the last time
    /// that was so (this worker may then poll, after light traffic); otherwise `None`. Counts
    /// this worker as parked from now on.
    fn park(&self, bytes: u64) -> Option<u64> {
        self.work.fetch_add(bytes, Ordering::AcqRel);
        let last = self.parked.fetch_add(1, Ordering::AcqRel) + 1 >= self.workers;
        last.then(|| self.work.swap(0, Ordering::AcqRel))
    }

    /// Called from the unpark hook.
    fn unpark(&self) {
        // Saturating: an unpark hook without its park (a worker that started parked) must not
        // wrap the count.
        let _ = self
            .parked
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1));
    }
}

fn build(
    builder: &mut tokio::runtime::Builder,
    max: Duration,
    gate: Option<Arc<LastAwake>>,
) -> std::io::Result<tokio::runtime::Runtime> {
    let max = max.min(MAX_MAX);
    if max.is_zero() {
        return builder.build();
    }
    let before = match ready::epoll_fds() {
        Ok(fds) => fds,
        Err(e) => {
            let _ = STATUS.set(format!("off: cannot list /proc/self/fd: {e}"));
            return builder.build();
        }
    };
    let fds: Arc<OnceLock<Box<[RawFd]>>> = Arc::new(OnceLock::new());
    let park_fds = fds.clone();
    let park_gate = gate.clone();
    builder
        .on_thread_park(move || before_park(&park_fds, max, park_gate.as_deref()))
        .on_thread_unpark(move || after_unpark(gate.as_deref()));
    let rt = builder.build()?;
    let status = match ready::epoll_fds() {
        Ok(after) => {
            let new: Box<[RawFd]> = after.into_iter().filter(|f| !before.contains(f)).collect();
            if (1..=ready::MAX_DRIVER_FDS).contains(&new.len()) {
                let _ = fds.set(new);
                format!("on: polls up to {} µs after light traffic", max.as_micros())
            } else {
                format!(
                    "off: the runtime's epoll descriptor is not known ({} new epoll descriptors \
                     appeared while it was built)",
                    new.len()
                )
            }
        }
        Err(e) => format!("off: cannot list /proc/self/fd: {e}"),
    };
    let _ = STATUS.set(status);
    Ok(rt)
}

fn before_park(fds: &OnceLock<Box<[RawFd]>>, max: Duration, gate: Option<&LastAwake>) {
    let own = WORK.with(|w| w.replace(0));
    // On a multi-thread runtime only the last worker awake polls, judged by the whole
    // runtime's traffic; the others still feed their own bytes to their policy.
    let (bytes, last_awake) = match gate.map(|g| g.park(own)) {
        None => (own, true),
        Some(Some(all)) => (all, true),
        Some(None) => (own, false),
    };
    STATE.with(|s| {
        let mut s = s.borrow_mut();
        let st = s.get_or_insert_with(|| ThreadState {
            policy: Policy::new(max),
            parked_at: None,
            pause: policy::Pause::default(),
        });
        let started = Instant::now();
        st.parked_at = Some(started);
        let window = st.policy.poll_for(bytes);
        if window.is_zero() || !last_awake || st.pause.active(started) {
            return;
        }
        let Some(fds) = fds.get() else { return };
        let outcome = ready::wait_ready(fds, window, policy::stolen_bound(max));
        POLLS.inc();
        SECONDS.inc_by(started.elapsed().as_secs_f64());
        match outcome {
            ready::Wait::Ready { yielded } => {
                HITS.inc();
                if yielded {
                    st.pause.clear();
                }
            }
            ready::Wait::Expired => st.pause.clear(),
            ready::Wait::Contended => {
                CONTENDED.inc();
                st.pause.contended(Instant::now());
            }
        }
    });
}

fn after_unpark(gate: Option<&LastAwake>) {
    if let Some(g) = gate {
        g.unpark();
    }
    STATE.with(|s| {
        if let Some(st) = s.borrow_mut().as_mut()
            && let Some(at) = st.parked_at.take()
        {
            st.policy.observe_idle(at.elapsed());
        }
    });
}

/// A transport that reports the bytes it moves to [`note_io`]: every tunnel socket (inside
/// `tether_tunnel`'s `ProgressIo`) and a broker's relay links to its peers, so that bulk data
/// over them keeps idle polling off.
#[derive(Debug)]
pub struct Counted<T> {
    inner: T,
}

impl<T> Counted<T> {
    pub fn new(inner: T) -> Self {
        Self { inner }
    }

    pub fn get_ref(&self) -> &T {
        &self.inner
    }
}

impl<T: tokio::io::AsyncRead + Unpin> tokio::io::AsyncRead for Counted<T> {
    fn poll_read(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let r = std::pin::Pin::new(&mut self.get_mut().inner).poll_read(cx, buf);
        note_io(buf.filled().len().saturating_sub(before));
        r
    }
}

impl<T: tokio::io::AsyncWrite + Unpin> tokio::io::AsyncWrite for Counted<T> {
    fn poll_write(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        let r = std::pin::Pin::new(&mut self.get_mut().inner).poll_write(cx, buf);
        if let std::task::Poll::Ready(Ok(n)) = r {
            note_io(n);
        }
        r
    }

    fn poll_write_vectored(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> std::task::Poll<std::io::Result<usize>> {
        let r = std::pin::Pin::new(&mut self.get_mut().inner).poll_write_vectored(cx, bufs);
        if let std::task::Poll::Ready(Ok(n)) = r {
            note_io(n);
        }
        r
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

/// Tests that create runtimes while listing descriptors, or that read the process-wide
/// counters, run one at a time (under `cargo test` they share a process).
#[cfg(test)]
pub(crate) static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

#[cfg(test)]
mod tests;
