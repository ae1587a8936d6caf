//! The emulated link: two network namespaces joined by two TUN devices and a userspace
//! forwarder per direction (this machine's kernel has no `sch_netem`).
//!
//! ```text
//!   hub namespace                    this process (root namespace)                cluster namespace
//!  10.77.0.1/30 ── TUN twh<pid> ──▶ reader ─▶ FIFO (deliver_at, packet) ─▶ writer ──▶ TUN twc<pid> ── 10.77.0.2/30
//!               ◀──────────────────  writer ◀─ FIFO ◀─ reader ◀────────────────────
//! ```
//!
//! Each direction is a bottleneck of `rate` bit/s followed by a constant one-way delay:
//! - the reader (a task on a small tokio runtime: the TUN fds are `AsyncFd`s) gives every packet
//!   a departure time on a virtual clock, `depart = max(now, last_depart) + len·8/rate`, and a
//!   delivery time `depart + delay`. The bytes still waiting to depart at `now` are
//!   `(last_depart − now)·rate/8`; a packet that would push them over `queue_bytes` is dropped
//!   (tail drop) and counted;
//! - the delay is the same for every packet of a direction, so delivery times are already in
//!   order: a FIFO suffices. Its size is bounded by construction (at most `queue_bytes` waiting
//!   plus one delay's worth in flight); a hard cap above that drops too;
//! - the writer is a dedicated thread with 1 µs timer slack that sleeps (condvar with timeout)
//!   until the head is due and writes every due packet to the other TUN.
//!
//! Limits: no loss other than tail drop, no reordering, no jitter beyond the writer's wake-up
//! latency (tens of µs in this VM); one queue per direction (no per-flow fairness).

use std::collections::VecDeque;
use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};

pub const HUB_IP: &str = "10.77.0.1";
pub const CLUSTER_IP: &str = "10.77.0.2";

/// Link parameters (per direction; both directions are the same).
#[derive(Clone, Copy, Debug)]
pub struct LinkParams {
    pub rate_bps: f64,
    pub one_way: Duration,
    pub mtu: u32,
    pub queue_bytes: u64,
}

impl LinkParams {
    /// Bandwidth-delay product of the round trip, in bytes.
    pub fn bdp_bytes(&self) -> u64 {
        (self.rate_bps / 8.0 * self.one_way.as_secs_f64() * 2.0) as u64
    }
}

/// Counters of one direction.
#[derive(Default)]
pub struct DirStats {
    pub packets: AtomicU64,
    pub bytes: AtomicU64,
    pub dropped: AtomicU64,
    pub dropped_bytes: AtomicU64,
    /// Deepest queue seen (bytes waiting to depart).
    pub max_backlog: AtomicU64,
    /// Deliveries later than due by more than 200 µs (writer wake-up latency).
    pub late: AtomicU64,
    pub write_errors: AtomicU64,
}

/// Snapshot of [`DirStats`].
#[derive(Clone, Copy, Debug, Default)]
pub struct DirSnapshot {
    pub packets: u64,
    pub bytes: u64,
    pub dropped: u64,
    pub max_backlog: u64,
    pub late: u64,
    pub write_errors: u64,
}

impl DirStats {
    fn snapshot(&self) -> DirSnapshot {
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        DirSnapshot {
            packets: l(&self.packets),
            bytes: l(&self.bytes),
            dropped: l(&self.dropped),
            max_backlog: l(&self.max_backlog),
            late: l(&self.late),
            write_errors: l(&self.write_errors),
        }
    }
}

/// A network namespace this process created; deleted on drop.
pub struct Netns {
    pub name: String,
}

impl Netns {
    fn create(name: &str) -> anyhow::Result<Self> {
        ip(&["netns", "add", name])?;
        let ns = Self { name: name.into() };
        ip(&["-n", name, "link", "set", "lo", "up"])?;
        Ok(ns)
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        if let Err(e) = ip(&["netns", "del", &self.name]) {
            eprintln!("could not delete network namespace {}: {e:#}", self.name);
        }
    }
}

/// Runs `ip args…`; an error with its stderr if it fails.
pub fn ip(args: &[&str]) -> anyhow::Result<()> {
    let out = Command::new("ip").args(args).output().context("run ip")?;
    if !out.status.success() {
        bail!(
            "ip {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

/// Runs `sysctl -w key=value` inside `ns`.
pub fn sysctl_in(ns: &str, key: &str, value: &str) -> anyhow::Result<()> {
    let out = Command::new("ip")
        .args(["netns", "exec", ns, "sysctl", "-q", "-w"])
        .arg(format!("{key}={value}"))
        .output()
        .context("run sysctl")?;
    if !out.status.success() {
        bail!(
            "sysctl {key} in {ns}: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

/// One direction's queue: packets with their delivery time, in delivery order.
struct Fifo {
    state: Mutex<FifoState>,
    ready: Condvar,
}

struct FifoState {
    packets: VecDeque<(Instant, Vec<u8>)>,
    bytes: u64,
    last_depart: Instant,
    closed: bool,
}

/// The link: namespaces, TUN devices and forwarders. Dropping it stops the forwarders, closes
/// the TUN devices (which removes them) and deletes the namespaces.
pub struct Link {
    pub hub_ns: Netns,
    pub cluster_ns: Netns,
    stats: [Arc<DirStats>; 2],
    fifos: [Arc<Fifo>; 2],
    writers: Vec<std::thread::JoinHandle<()>>,
    readers: Vec<tokio::task::JoinHandle<()>>,
    stopped: Arc<AtomicBool>,
    // Last: dropped after the tasks that use the TUN devices.
    rt: Option<tokio::runtime::Runtime>,
}

/// Direction indices.
pub const UP: usize = 0; // hub → cluster
pub const DOWN: usize = 1; // cluster → hub

impl Link {
    /// Creates both namespaces (`tw-hub-<tag>`, `tw-cl-<tag>`), the TUN devices and the
    /// forwarders. `tcp_mem_max` raises `tcp_rmem`/`tcp_wmem` maxima inside both namespaces.
    pub fn create(params: LinkParams, tag: &str, tcp_mem_max: Option<u64>) -> anyhow::Result<Self> {
        let hub_ns = Netns::create(&format!("tw-hub-{tag}"))?;
        let cluster_ns = Netns::create(&format!("tw-cl-{tag}"))?;
        if let Some(max) = tcp_mem_max {
            for ns in [&hub_ns.name, &cluster_ns.name] {
                sysctl_in(ns, "net.ipv4.tcp_rmem", &format!("4096 131072 {max}"))?;
                sysctl_in(ns, "net.ipv4.tcp_wmem", &format!("4096 16384 {max}"))?;
            }
        }
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("link-reader")
            .enable_all()
            .build()?;
        let names = [format!("twh{tag}"), format!("twc{tag}")];
        let (hub_tun, cl_tun) = {
            let _guard = rt.enter();
            let mk = |name: &str| -> anyhow::Result<tokio_tun::Tun> {
                let mut v = tokio_tun::Tun::builder()
                    .name(name)
                    .mtu(params.mtu as i32)
                    .build()
                    .with_context(|| {
                        format!("create TUN device {name} (needs root and /dev/net/tun)")
                    })?;
                v.pop().context("no TUN queue")
            };
            (Arc::new(mk(&names[0])?), Arc::new(mk(&names[1])?))
        };
        for (dev, ns, addr) in [
            (&names[0], &hub_ns.name, HUB_IP),
            (&names[1], &cluster_ns.name, CLUSTER_IP),
        ] {
            ip(&["link", "set", dev, "netns", ns])?;
            ip(&["-n", ns, "link", "set", dev, "mtu", &params.mtu.to_string()])?;
            ip(&["-n", ns, "addr", "add", &format!("{addr}/30"), "dev", dev])?;
            ip(&["-n", ns, "link", "set", dev, "up"])?;
        }
        let stats = [Arc::new(DirStats::default()), Arc::new(DirStats::default())];
        let now = Instant::now();
        let fifo = || {
            Arc::new(Fifo {
                state: Mutex::new(FifoState {
                    packets: VecDeque::new(),
                    bytes: 0,
                    last_depart: now,
                    closed: false,
                }),
                ready: Condvar::new(),
            })
        };
        let fifos = [fifo(), fifo()];
        let stopped = Arc::new(AtomicBool::new(false));
        let mut link = Self {
            hub_ns,
            cluster_ns,
            stats,
            fifos,
            writers: Vec::new(),
            readers: Vec::new(),
            stopped,
            rt: None,
        };
        for (dir, from, to) in [(UP, &hub_tun, &cl_tun), (DOWN, &cl_tun, &hub_tun)] {
            let fifo = link.fifos[dir].clone();
            let stats = link.stats[dir].clone();
            link.readers
                .push(rt.spawn(reader(from.clone(), fifo.clone(), stats.clone(), params)));
            let to = to.clone();
            link.writers.push(
                std::thread::Builder::new()
                    .name(format!("link-writer-{dir}"))
                    .spawn(move || writer(&to, &fifo, &stats))?,
            );
        }
        link.rt = Some(rt);
        Ok(link)
    }

    /// Counters of both directions, `[UP, DOWN]`.
    pub fn stats(&self) -> [DirSnapshot; 2] {
        [self.stats[UP].snapshot(), self.stats[DOWN].snapshot()]
    }

    fn stop(&mut self) {
        if self.stopped.swap(true, Ordering::SeqCst) {
            return;
        }
        for f in &self.fifos {
            f.state.lock().unwrap_or_else(|e| e.into_inner()).closed = true;
            f.ready.notify_all();
        }
        for w in self.writers.drain(..) {
            let _ = w.join();
        }
        for r in self.readers.drain(..) {
            r.abort();
        }
        if let Some(rt) = self.rt.take() {
            // Drops the aborted tasks and with them the last references to the TUN devices.
            rt.shutdown_timeout(Duration::from_secs(2));
        }
    }
}

impl Drop for Link {
    fn drop(&mut self) {
        self.stop();
        // then the fields: cluster_ns and hub_ns are deleted.
    }
}

/// Reads packets from `tun`, schedules them on the virtual clock and queues them (or drops).
/// After each wake-up it drains what the device already has (up to a batch) under one lock.
async fn reader(tun: Arc<tokio_tun::Tun>, fifo: Arc<Fifo>, stats: Arc<DirStats>, p: LinkParams) {
    const BATCH: usize = 64;
    let mut bufs: Vec<Vec<u8>> = (0..BATCH).map(|_| vec![0u8; 65_536]).collect();
    let mut lens = [0usize; BATCH];
    let ns_per_byte = 8e9 / p.rate_bps;
    // Hard cap on what the FIFO may hold: the queue, one delay's worth in flight, slack.
    let in_flight = (p.rate_bps / 8.0 * p.one_way.as_secs_f64()) as u64;
    let cap = p.queue_bytes + in_flight + 4 * u64::from(p.mtu) + 65_536;
    loop {
        lens[0] = match tun.recv(&mut bufs[0]).await {
            Ok(n) => n,
            Err(e) => {
                eprintln!("link reader: {e}");
                return;
            }
        };
        let mut got = 1;
        while got < BATCH {
            match tun.try_recv(&mut bufs[got]) {
                Ok(n) => {
                    lens[got] = n;
                    got += 1;
                }
                Err(_) => break,
            }
        }
        let now = Instant::now();
        let mut st = fifo.state.lock().unwrap_or_else(|e| e.into_inner());
        let was_empty = st.packets.is_empty();
        let (mut dropped, mut dropped_bytes, mut backlog_max) = (0u64, 0u64, 0u64);
        for (buf, &n) in bufs.iter().zip(&lens[..got]) {
            let start = st.last_depart.max(now);
            let backlog = ((start - now).as_nanos() as f64 / ns_per_byte) as u64;
            if backlog + n as u64 > p.queue_bytes || st.bytes + n as u64 > cap {
                dropped += 1;
                dropped_bytes += n as u64;
                continue;
            }
            let depart = start + Duration::from_nanos((n as f64 * ns_per_byte) as u64);
            st.last_depart = depart;
            st.bytes += n as u64;
            st.packets
                .push_back((depart + p.one_way, buf[..n].to_vec()));
            backlog_max = backlog_max.max(backlog + n as u64);
        }
        drop(st);
        // A writer waiting for a head that is not yet due needs no wake-up: the new packets are
        // behind it. Only an empty queue's writer sleeps without a due time.
        if was_empty {
            fifo.ready.notify_one();
        }
        stats.max_backlog.fetch_max(backlog_max, Ordering::Relaxed);
        if dropped > 0 {
            stats.dropped.fetch_add(dropped, Ordering::Relaxed);
            stats
                .dropped_bytes
                .fetch_add(dropped_bytes, Ordering::Relaxed);
        }
    }
}

/// Delivers queued packets to `tun` when they are due; returns when the FIFO is closed.
fn writer(tun: &tokio_tun::Tun, fifo: &Fifo, stats: &DirStats) {
    // Wake-ups as close to the due time as the kernel allows (default slack is 50 µs).
    let _ = nix::sys::prctl::set_timerslack(1_000);
    let mut due = Vec::new();
    loop {
        {
            let mut st = fifo.state.lock().unwrap_or_else(|e| e.into_inner());
            loop {
                if st.closed {
                    return;
                }
                let now = Instant::now();
                match st.packets.front() {
                    None => {
                        st = fifo
                            .ready
                            .wait_timeout(st, Duration::from_millis(100))
                            .unwrap_or_else(|e| e.into_inner())
                            .0;
                    }
                    Some((at, _)) if *at > now => {
                        let wait = *at - now;
                        st = fifo
                            .ready
                            .wait_timeout(st, wait)
                            .unwrap_or_else(|e| e.into_inner())
                            .0;
                    }
                    Some(_) => break,
                }
            }
            let now = Instant::now();
            while st.packets.front().is_some_and(|(at, _)| *at <= now) {
                let (at, pkt) = st.packets.pop_front().expect("front checked");
                st.bytes -= pkt.len() as u64;
                due.push((at, pkt));
            }
        }
        let now = Instant::now();
        for (at, pkt) in due.drain(..) {
            if now - at > Duration::from_micros(200) {
                stats.late.fetch_add(1, Ordering::Relaxed);
            }
            match tun.try_send(&pkt) {
                Ok(_) => {
                    stats.packets.fetch_add(1, Ordering::Relaxed);
                    stats.bytes.fetch_add(pkt.len() as u64, Ordering::Relaxed);
                }
                Err(_) => {
                    stats.write_errors.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
    }
}
