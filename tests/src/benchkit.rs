//! What both benchmark binaries (`tether-bench`, `tether-wan-bench`) measure with: CPU time and
//! load from `/proc`, pinning processes to a CPU, percentiles, medians and ratio ranges, the
//! 64-byte request/response loop, the target server's byte-counting sink, and a throwaway TLS
//! server/client config pair.

use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// CPU seconds a process has run (all its live threads; from schedstat, in ns).
pub fn cpu_secs(pid: u32) -> f64 {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return 0.0;
    };
    let ns: u64 = tasks
        .flatten()
        .filter_map(|t| schedstat_ns(&t.path().join("schedstat")))
        .sum();
    ns as f64 / 1e9
}

/// CPU seconds one thread of this process has run (its kernel thread id; schedstat, in ns).
pub fn thread_cpu_secs(tid: i32) -> f64 {
    schedstat_ns(std::path::Path::new(&format!(
        "/proc/self/task/{tid}/schedstat"
    )))
    .map_or(0.0, |ns| ns as f64 / 1e9)
}

/// The time on CPU a `schedstat` file reports (its first field, ns).
fn schedstat_ns(path: &std::path::Path) -> Option<u64> {
    std::fs::read_to_string(path)
        .ok()?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// Pins every thread of process `pid` to CPU `cpu` (the bench's `--pin-sides`, the idle-poll
/// test's CPU-bound neighbour); threads it starts later inherit the CPU of the thread that
/// starts them.
pub fn pin_process(pid: u32, cpu: usize) -> anyhow::Result<()> {
    use anyhow::Context as _;
    let tasks = match std::fs::read_dir(format!("/proc/{pid}/task")) {
        Ok(t) => t,
        // A process that ended since it was listed (one of sshd's children) is no error.
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e).with_context(|| format!("threads of process {pid}")),
    };
    for task in tasks.flatten() {
        let Some(tid) = task
            .file_name()
            .to_str()
            .and_then(|t| t.parse::<i32>().ok())
        else {
            continue;
        };
        pin_task(tid, cpu).with_context(|| format!("pinning process {pid}"))?;
    }
    Ok(())
}

/// Pins the calling thread to CPU `cpu`.
pub fn pin_current_thread(cpu: usize) -> anyhow::Result<()> {
    pin_task(0, cpu)
}

/// Pins thread `tid` (0: the calling thread) to `cpu`; a thread that has ended is no error.
fn pin_task(tid: i32, cpu: usize) -> anyhow::Result<()> {
    use nix::sched::{CpuSet, sched_setaffinity};
    let mut set = CpuSet::new();
    set.set(cpu)
        .map_err(|e| anyhow::anyhow!("CPU {cpu} cannot be named in a CPU set: {e}"))?;
    match sched_setaffinity(nix::unistd::Pid::from_raw(tid), &set) {
        Ok(()) | Err(nix::errno::Errno::ESRCH) => Ok(()),
        Err(e) => anyhow::bail!("pinning thread {tid} to CPU {cpu}: {e}"),
    }
}

/// The CPUs this thread may run on, in order (all of them, unless a cpuset leaves some out).
pub fn allowed_cpus() -> anyhow::Result<Vec<usize>> {
    use anyhow::Context as _;
    use nix::sched::{CpuSet, sched_getaffinity};
    let allowed = sched_getaffinity(nix::unistd::Pid::from_raw(0)).context("this thread's CPUs")?;
    Ok((0..CpuSet::count())
        .filter(|&c| allowed.is_set(c).unwrap_or(false))
        .collect())
}

/// The one-minute load average, as `/proc/loadavg` prints it.
pub fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|s| s.split_whitespace().next().map(str::to_owned))
        .unwrap_or_else(|| "?".into())
}

/// The `p` quantile (0–1) of sorted samples; zero when there are none.
pub fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let i = ((sorted.len() - 1) as f64 * p).round() as usize;
    sorted[i]
}

/// Median (NaN for no samples).
pub fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    if v.is_empty() {
        return f64::NAN;
    }
    let m = v.len() / 2;
    if !v.len().is_multiple_of(2) {
        v[m]
    } else {
        (v[m - 1] + v[m]) / 2.0
    }
}

pub fn mean(v: &[f64]) -> f64 {
    v.iter().sum::<f64>() / v.len().max(1) as f64
}

/// ` [lo–hi]` of per-round ratios (nothing for a single round).
pub fn range_note(ratios: &[f64]) -> String {
    if ratios.len() < 2 {
        return String::new();
    }
    let lo = ratios.iter().copied().fold(f64::INFINITY, f64::min);
    let hi = ratios.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    format!(" [{lo:.2}–{hi:.2}]")
}

/// `n` 64-byte request/response round trips on an open echo stream; each round trip's time is
/// pushed to `out`.
pub async fn request_response<S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + ?Sized>(
    s: &mut S,
    n: usize,
    out: &mut Vec<Duration>,
) -> anyhow::Result<()> {
    let msg = [7u8; 64];
    let mut back = [0u8; 64];
    for _ in 0..n {
        let t = Instant::now();
        s.write_all(&msg).await?;
        s.read_exact(&mut back).await?;
        out.push(t.elapsed());
    }
    Ok(())
}

/// The target's sink: reads to EOF in `buf_len` pieces, then answers the byte count (u64, little
/// endian) and shuts down — so a throughput figure includes draining every buffer on the way.
pub async fn sink_count(s: &mut TcpStream, buf_len: usize) -> std::io::Result<()> {
    let mut buf = vec![0u8; buf_len];
    let mut total = 0u64;
    loop {
        let n = s.read(&mut buf).await?;
        if n == 0 {
            break;
        }
        total += n as u64;
    }
    s.write_all(&total.to_le_bytes()).await?;
    s.shutdown().await
}

/// A server certificate for `localhost` from a throwaway CA, and configs trusting it (Tether's
/// crypto provider on both ends), for the benchmarks that measure TLS in one process.
pub struct TlsPair {
    pub server: std::sync::Arc<rustls::ServerConfig>,
    pub client: std::sync::Arc<rustls::ClientConfig>,
    _dir: tempfile::TempDir,
}

impl TlsPair {
    /// `common_name` names the server's identity; `alpn` is what the server offers.
    pub fn new(common_name: &str, alpn: &[&[u8]]) -> anyhow::Result<Self> {
        let dir = tempfile::tempdir()?;
        let pki = tether_test_support::Pki::new(dir.path())?;
        let leaf = pki.issue(
            "server",
            tether_tls::Identity::from_common_name(common_name)?,
            &["localhost"],
        )?;
        let certs = tether_tls::pem::read_certs(&leaf.cert)?;
        let key = tether_tls::pem::read_key(&leaf.key)?;
        let mut server = rustls::ServerConfig::builder_with_provider(tether_tls::crypto_provider())
            .with_safe_default_protocol_versions()?
            .with_no_client_auth()
            .with_single_cert(certs, key)?;
        server.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
        let mut roots = rustls::RootCertStore::empty();
        for c in tether_tls::pem::read_certs(&leaf.ca)? {
            roots.add(c)?;
        }
        let client = tether_tls::client_config_builder()
            .with_root_certificates(roots)
            .with_no_client_auth();
        Ok(Self {
            server: std::sync::Arc::new(server),
            client: std::sync::Arc::new(client),
            _dir: dir,
        })
    }
}
