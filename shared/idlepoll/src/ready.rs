//! The runtime's I/O driver, seen from outside: which epoll descriptors it created, and whether
//! any of them has events waiting.
//!
//! tokio does not expose its driver's descriptor. An epoll descriptor is itself pollable: it
//! reads as ready while its ready list is not empty, without taking anything off that list. So
//! a thread can ask "has anything happened?" with `poll(2)` and a zero timeout, and the events
//! stay for the driver's own `epoll_wait` right after. The descriptors are found by listing the
//! process's epoll descriptors (`/proc/self/fd`) before and after the runtime is built, on the
//! thread that builds it at process start, when nothing else creates one.

use std::os::fd::RawFd;
use std::time::{Duration, Instant};

/// Most epoll descriptors a runtime may have created: tokio's driver makes one epoll instance and
/// keeps a duplicate of its descriptor (two numbers, one instance). More means something else
/// was creating descriptors at the same time, and polling is skipped.
pub const MAX_DRIVER_FDS: usize = 2;

/// The process's epoll descriptors, by number.
pub fn epoll_fds() -> std::io::Result<Vec<RawFd>> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir("/proc/self/fd")? {
        let entry = entry?;
        let Some(fd) = entry.file_name().to_str().and_then(|n| n.parse().ok()) else {
            continue;
        };
        // A descriptor can close between the listing and the read: skip it.
        if let Ok(target) = std::fs::read_link(entry.path())
            && target.as_os_str() == "anon_inode:[eventpoll]"
        {
            out.push(fd);
        }
    }
    out.sort_unstable();
    Ok(out)
}

/// How a [`wait_ready`] ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Wait {
    /// Events are waiting: the driver collects them at once. `yielded`: the thread gave the
    /// CPU up at least once before they came, and had it back within the bound (evidence that
    /// no CPU-bound neighbour shares the CPU; events seen at the first check give none).
    Ready { yielded: bool },
    /// The window passed with nothing to collect.
    Expired,
    /// A yield gave the CPU to another task for longer than `stolen`: a CPU-bound neighbour
    /// shares this CPU. A thread that polls is runnable, not asleep, so the events it waits
    /// for do not wake it: while it spins, a neighbour that took the CPU keeps it for the rest
    /// of its time slice (milliseconds), and the answer waits that long. Sleeping in the
    /// driver instead, the thread is woken by the event and preempts the neighbour.
    Contended,
}

/// Whether any of `fds` has events waiting, checking until `window` has passed and yielding the
/// CPU between checks (so a task woken on this CPU, a client or a target on a small machine,
/// runs at once instead of waiting for the window to end). Returns at the first check that sees
/// events, and gives up ([`Wait::Contended`]) after a yield that kept the CPU from this thread
/// for longer than `stolen`, whether or not events came meanwhile.
pub fn wait_ready(fds: &[RawFd], window: Duration, stolen: Duration) -> Wait {
    let mut set = [libc::pollfd {
        fd: -1,
        events: 0,
        revents: 0,
    }; MAX_DRIVER_FDS];
    let n = fds.len().min(MAX_DRIVER_FDS);
    for (slot, &fd) in set.iter_mut().zip(fds) {
        *slot = libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        };
    }
    let mut now = Instant::now();
    let deadline = now + window;
    let mut yielded = false;
    loop {
        // SAFETY: `set` is a live, exclusively borrowed array of `n` initialised `pollfd`s for
        // the duration of the call, which is all poll(2) reads and writes (it writes `revents`
        // only). poll takes descriptor numbers, not ownership: a number that was closed or
        // reused cannot cause memory unsafety; it yields POLLNVAL or a readiness that only ends
        // this wait early.
        #[allow(unsafe_code)]
        let ready = unsafe { libc::poll(set.as_mut_ptr(), n as libc::nfds_t, 0) };
        if ready > 0 {
            return Wait::Ready { yielded };
        }
        if ready < 0 && std::io::Error::last_os_error().kind() != std::io::ErrorKind::Interrupted {
            return Wait::Expired;
        }
        if now >= deadline {
            return Wait::Expired;
        }
        std::thread::yield_now();
        let after = Instant::now();
        // The events that came while another task had the CPU are collected by the driver
        // right after; that they came does not make this poll a hit.
        if after - now > stolen {
            return Wait::Contended;
        }
        yielded = true;
        now = after;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_new_runtime_shows_up_as_new_epoll_descriptors() {
        let (new, rt) = new_runtime();
        // tokio's driver keeps a duplicate of its epoll descriptor (the same epoll instance).
        assert!((1..=MAX_DRIVER_FDS).contains(&new.len()), "new: {new:?}");
        drop(rt);
    }

    #[test]
    fn an_idle_driver_is_not_ready_and_the_wait_ends_at_the_window() {
        let (fd, rt) = epoll_of_nothing();
        let started = Instant::now();
        assert_eq!(
            wait_ready(&[fd], Duration::from_millis(2), Duration::from_secs(1)),
            Wait::Expired
        );
        assert!(started.elapsed() >= Duration::from_millis(2));
        drop(rt);
    }

    #[test]
    fn a_closed_descriptor_ends_the_wait_without_harm() {
        // POLLNVAL counts as "something to look at": the caller parks and the driver decides.
        let started = Instant::now();
        let ready = wait_ready(
            &[i32::MAX - 1],
            Duration::from_millis(50),
            Duration::from_secs(1),
        );
        assert_eq!(ready, Wait::Ready { yielded: false });
        assert!(started.elapsed() < Duration::from_millis(50));
    }

    #[test]
    fn events_say_whether_the_thread_yielded_before_they_came() {
        use std::sync::atomic::{AtomicBool, Ordering};
        let (fd, rt) = epoll_of_nothing();
        let sock = rt
            .block_on(tokio::net::UdpSocket::bind("127.0.0.1:0"))
            .expect("bind");
        let to = sock.local_addr().expect("address");
        let sender = std::net::UdpSocket::bind("127.0.0.1:0").expect("bind the sender");
        let mut buf = [0u8; 8];
        // The driver collects what is pending (the new socket's first readiness; a datagram
        // read): `yield_now` defers the task until the driver has been polled.
        let drain = || {
            rt.block_on(tokio::task::yield_now());
            assert_eq!(
                wait_ready(&[fd], Duration::from_millis(1), Duration::from_secs(5)),
                Wait::Expired,
                "the driver left events pending"
            );
        };
        drain();
        // A datagram there before the wait: seen at the first check, no yield.
        sender.send_to(b"x", to).expect("send");
        let first = wait_ready(&[fd], Duration::from_secs(5), Duration::from_secs(5));
        assert_eq!(first, Wait::Ready { yielded: false });
        rt.block_on(sock.recv(&mut buf)).expect("receive");
        drain();
        // A datagram sent once the wait has begun: it lands after the first check (a send
        // takes microseconds, the check under one), so the thread had yielded. Up to 20 tries,
        // in case a send ever beats the first check.
        let sender = std::sync::Arc::new(sender);
        let mut outcomes = Vec::new();
        for _ in 0..20 {
            let go = std::sync::Arc::new(AtomicBool::new(false));
            let send = {
                let (go, sender) = (go.clone(), sender.clone());
                std::thread::spawn(move || {
                    let started = Instant::now();
                    while !go.load(Ordering::Acquire) && started.elapsed() < Duration::from_secs(5)
                    {
                        std::thread::yield_now();
                    }
                    sender.send_to(b"y", to).expect("send");
                })
            };
            go.store(true, Ordering::Release);
            let outcome = wait_ready(&[fd], Duration::from_secs(5), Duration::from_secs(5));
            send.join().expect("sender");
            rt.block_on(sock.recv(&mut buf)).expect("receive");
            drain();
            outcomes.push(outcome);
            if outcome == (Wait::Ready { yielded: true }) {
                break;
            }
        }
        assert!(
            outcomes.iter().all(|o| matches!(o, Wait::Ready { .. })),
            "{outcomes:?}"
        );
        assert_eq!(
            outcomes.last(),
            Some(&Wait::Ready { yielded: true }),
            "{outcomes:?}"
        );
        drop(rt);
    }

    #[test]
    fn a_cpu_bound_neighbour_on_this_cpu_ends_the_wait_as_contended() {
        use std::sync::atomic::{AtomicBool, Ordering};
        // This thread and a spinning one on the same CPU: the first yield hands the CPU to
        // the spinner for the rest of its time slice, far longer than `stolen`.
        use nix::sched::{CpuSet, sched_getaffinity, sched_setaffinity};
        let (fd, rt) = epoll_of_nothing();
        let me = nix::unistd::Pid::from_raw(0);
        // The first CPU this thread may use (CPU 0 unless a cpuset leaves it out).
        let allowed = sched_getaffinity(me).expect("this thread's CPUs");
        let cpu = (0..CpuSet::count())
            .find(|&c| allowed.is_set(c).unwrap_or(false))
            .expect("a CPU");
        let mut one = CpuSet::new();
        one.set(cpu).expect("the CPU");
        let pin = move || sched_setaffinity(me, &one);
        pin().expect("pin the test thread");
        let stop = std::sync::Arc::new(AtomicBool::new(false));
        let pinned = std::sync::Arc::new(AtomicBool::new(false));
        let hog = {
            let (stop, pinned) = (stop.clone(), pinned.clone());
            std::thread::spawn(move || {
                pin().expect("pin the spinner");
                pinned.store(true, Ordering::Release);
                let started = Instant::now();
                while !stop.load(Ordering::Relaxed) && started.elapsed() < Duration::from_secs(5) {
                    std::hint::spin_loop();
                }
            })
        };
        // Until the spinner runs on this CPU (it does when this thread yields), within 5 s.
        let started = Instant::now();
        while !pinned.load(Ordering::Acquire) {
            assert!(
                started.elapsed() < Duration::from_secs(5),
                "the spinner never ran"
            );
            std::thread::yield_now();
        }
        let outcome = wait_ready(
            &[fd],
            Duration::from_millis(200),
            Duration::from_micros(200),
        );
        stop.store(true, Ordering::Relaxed);
        hog.join().expect("spinner");
        assert_eq!(outcome, Wait::Contended);
        drop(rt);
    }

    /// A fresh current-thread runtime and the epoll descriptors its creation added.
    fn new_runtime() -> (Vec<RawFd>, tokio::runtime::Runtime) {
        let _one = crate::SERIAL.lock().unwrap_or_else(|e| e.into_inner());
        let before = epoll_fds().expect("list fds");
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        let after = epoll_fds().expect("list fds");
        let new = after.into_iter().filter(|f| !before.contains(f)).collect();
        (new, rt)
    }

    /// The epoll descriptor of a fresh runtime that nothing has woken (only its own waker is
    /// registered), valid while the runtime lives.
    fn epoll_of_nothing() -> (RawFd, tokio::runtime::Runtime) {
        let (new, rt) = new_runtime();
        (*new.first().expect("the runtime's epoll descriptor"), rt)
    }
}
