//! The client side of one scenario, run inside the hub namespace (`ip netns exec <hub> <self>
//! --inner …`): starts the target and the agent in the cluster namespace, the broker here, and
//! measures direct and tunnel interleaved. Progress lines go to stdout; the figures go to the
//! `--report` file as JSON for the outer process's table.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use tether_e2e::{Hub, OPS_TOKEN, command_in};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::link::{CLUSTER_IP, HUB_IP};
use crate::stats::{cpu_secs, gbit, median, percentile};
use crate::target::BUF;
use tether_e2e::benchkit::request_response;

const CLUSTER: &str = "c1";

/// What the outer process tells the inner one.
pub struct InnerArgs {
    pub scenario: String,
    pub cluster_ns: String,
    pub emu_pid: u32,
    pub report: PathBuf,
    pub secs: Duration,
    pub rounds: usize,
    pub rtt: Duration,
    pub quick: bool,
    pub tunnel: Option<String>,
}

/// Set (to anything) in the environment: the 64 B round trips run while a bulk upload fills
/// the same path (inherited by the inner process through `ip netns exec`).
pub const RR_UNDER_LOAD: &str = "TETHER_WAN_RR_UNDER_LOAD";

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Via {
    Direct,
    Tunnel,
}

/// Order of the two paths in round `i` (swapped every round).
fn order(i: usize) -> [Via; 2] {
    if i.is_multiple_of(2) {
        [Via::Direct, Via::Tunnel]
    } else {
        [Via::Tunnel, Via::Direct]
    }
}

/// Where the client goes.
struct Ends {
    target: SocketAddr,
    broker: SocketAddr,
    connect_head: String,
}

impl Ends {
    async fn open(&self, via: Via) -> anyhow::Result<TcpStream> {
        let s = match via {
            Via::Direct => TcpStream::connect(self.target).await?,
            Via::Tunnel => TcpStream::connect(self.broker).await?,
        };
        s.set_nodelay(true)?;
        if via == Via::Direct {
            return Ok(s);
        }
        match tether_e2e::send_head(s, self.connect_head.as_bytes()).await? {
            Ok(s) => Ok(s),
            Err((code, body)) => bail!("CONNECT answered {code}: {body}"),
        }
    }
}

pub fn run(a: InnerArgs) -> anyhow::Result<()> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?
        .block_on(async move {
            let mut term =
                tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
            tokio::select! {
                r = scenario(&a) => r,
                _ = tokio::signal::ctrl_c() => bail!("interrupted"),
                _ = term.recv() => bail!("terminated"),
            }
        })
}

async fn scenario(a: &InnerArgs) -> anyhow::Result<()> {
    let tunnel_yaml = match &a.tunnel {
        Some(t) => format!("tunnel: {{{t}}}\n"),
        None => String::new(),
    };
    let hub = Hub::new()?;
    // The target, in the cluster namespace.
    let ready = hub.path().join("target.ready");
    let mut cmd = command_in(Some(&a.cluster_ns), std::env::current_exe()?);
    cmd.arg("--target-server").arg("--ready-file").arg(&ready);
    let target_proc = tether_test_support::Child::spawn("wan-target", cmd, hub.path())?;
    let port = tether_test_support::read_ready_file(&ready, Duration::from_secs(20))?["port"]
        .as_u64()
        .context("target port")? as u16;
    let direct: SocketAddr = format!("{CLUSTER_IP}:{port}").parse()?;
    let local_target: SocketAddr = format!("127.0.0.1:{port}").parse()?;

    // The broker here (hub namespace), listening on the link address; the agent in the cluster
    // namespace dials it across the link, and reaches the target on its own loopback.
    let broker = hub
        .start_broker_at("b1", &tunnel_yaml, None, HUB_IP)
        .with_context(|| logs(hub.path(), "broker-"))?;
    let agent = hub
        .start_agent_at(
            CLUSTER,
            CLUSTER,
            &[vec![broker.agent_addr]],
            local_target,
            &tunnel_yaml,
            Some(&a.cluster_ns),
        )
        .with_context(|| logs(hub.path(), "agent-"))?;
    tether_e2e::wait_tunnel(&broker, CLUSTER)
        .await
        .with_context(|| logs(hub.path(), ""))?;
    let authority = format!("{CLUSTER}:443");
    let ends = Ends {
        target: direct,
        broker: broker.client_addr,
        connect_head: format!(
            "CONNECT {authority} HTTP/1.1\r\nhost: {authority}\r\nproxy-authorization: Bearer {OPS_TOKEN}\r\n\r\n"
        ),
    };
    let limit = a.secs + Duration::from_secs(60);

    // Warm-up: connections, page cache, and the tunnel's TCP connection.
    for via in [Via::Direct, Via::Tunnel] {
        let warm = Duration::from_millis(300).max(a.rtt * 6);
        tokio::time::timeout(limit, upload(&ends, via, warm))
            .await
            .context("warm-up upload timed out")??;
    }

    // Bulk transfers: [upload, download] × [direct, tunnel] rates per round.
    let mut rates = [[Vec::new(), Vec::new()], [Vec::new(), Vec::new()]];
    let mut ratios = [Vec::new(), Vec::new()];
    let mut emu_cpu = Vec::new();
    let pids = [broker.child.pid(), agent.child.pid()];
    let mut tunnel_cpu = [0.0f64; 2];
    let mut tunnel_bytes = 0.0f64;
    for round in 0..a.rounds {
        for (d, name) in [(0usize, "upload"), (1, "download")] {
            let mut r = [0.0f64; 2];
            let mut cpu_note = Vec::new();
            for via in order(round) {
                let e0 = cpu_secs(a.emu_pid);
                let t0 = pids.map(cpu_secs);
                let started = Instant::now();
                let (bytes, secs) = if d == 0 {
                    tokio::time::timeout(limit, upload(&ends, via, a.secs)).await
                } else {
                    tokio::time::timeout(limit, download(&ends, via, a.secs)).await
                }
                .with_context(|| format!("{name} via {via:?} timed out"))??;
                let wall = started.elapsed().as_secs_f64();
                let e = (cpu_secs(a.emu_pid) - e0) / wall;
                emu_cpu.push(e);
                cpu_note.push(format!("{:.0} %", e * 100.0));
                if via == Via::Tunnel {
                    let t1 = pids.map(cpu_secs);
                    tunnel_cpu[0] += t1[0] - t0[0];
                    tunnel_cpu[1] += t1[1] - t0[1];
                    tunnel_bytes += bytes as f64;
                }
                r[via as usize] = bytes as f64 / secs;
                rates[d][via as usize].push(r[via as usize]);
            }
            ratios[d].push(r[1] / r[0]);
            println!(
                "  {}: {name}, round {}: direct {}, tunnel {} ({:.2}×); emulator CPU {}",
                a.scenario,
                round + 1,
                gbit(r[0]),
                gbit(r[1]),
                r[1] / r[0],
                cpu_note.join(" / ")
            );
        }
    }

    // 64-byte request/response on an open echo stream per path, blocks alternating.
    let budget = if a.quick { 1.0 } else { 2.0 };
    let per_path = (budget / a.rtt.as_secs_f64().max(200e-6)).round() as usize;
    let per_path = per_path.clamp(20, 2000);
    let blocks = 4;
    let mut socks = Vec::new();
    for via in [Via::Direct, Via::Tunnel] {
        let mut s = ends.open(via).await?;
        s.write_all(b"E").await?;
        socks.push(s);
    }
    let mut samples = [Vec::new(), Vec::new()];
    let rr_limit = Duration::from_secs(30) + a.rtt * (per_path as u32 * 2);
    let under_load = std::env::var_os(RR_UNDER_LOAD).is_some();
    for block in 0..blocks {
        for via in order(block) {
            let n = per_path.div_ceil(blocks);
            if under_load {
                // The same round trips while a bulk upload on a second stream of the same path
                // fills its queues (primed for 0.5 s); at most 100 per block, each may take
                // the queue's time.
                let n = n.min(100);
                let mut bulk = ends.open(via).await?;
                bulk.write_all(b"S").await?;
                let buf = vec![0u8; BUF];
                let prime = Instant::now() + Duration::from_millis(500);
                while Instant::now() < prime {
                    bulk.write_all(&buf).await?;
                }
                let rr = request_response(&mut socks[via as usize], n, &mut samples[via as usize]);
                tokio::pin!(rr);
                loop {
                    tokio::select! {
                        r = &mut rr => { r?; break; }
                        w = bulk.write_all(&buf) => { w?; }
                    }
                }
                drop(bulk);
                continue;
            }
            tokio::time::timeout(
                rr_limit,
                request_response(&mut socks[via as usize], n, &mut samples[via as usize]),
            )
            .await
            .context("request/response timed out")??;
        }
    }
    drop(socks);
    for s in &mut samples {
        s.sort();
    }
    let p = |v: usize, q: f64| percentile(&samples[v], q).as_secs_f64() * 1e6;

    let report = serde_json::json!({
        "upload": { "direct": rates[0][0], "tunnel": rates[0][1], "ratios": ratios[0] },
        "download": { "direct": rates[1][0], "tunnel": rates[1][1], "ratios": ratios[1] },
        "rr": {
            "n": samples[0].len(),
            "direct_p50_us": p(0, 0.5), "tunnel_p50_us": p(1, 0.5),
            "direct_p99_us": p(0, 0.99), "tunnel_p99_us": p(1, 0.99),
        },
        "emulator_cpu": { "median": median(&emu_cpu), "max": emu_cpu.iter().copied().fold(0.0, f64::max) },
        "tunnel_cpu_s_per_gb": {
            "broker": tunnel_cpu[0] / (tunnel_bytes / 1e9).max(1e-9),
            "agent": tunnel_cpu[1] / (tunnel_bytes / 1e9).max(1e-9),
        },
        "tcp": {
            "congestion_control": read_sysctl("net/ipv4/tcp_congestion_control"),
            "rmem": read_sysctl("net/ipv4/tcp_rmem"),
            "wmem": read_sysctl("net/ipv4/tcp_wmem"),
        },
    });
    let tmp = a.report.with_extension("tmp");
    std::fs::write(&tmp, report.to_string())?;
    std::fs::rename(&tmp, &a.report)?;
    drop(target_proc);
    Ok(())
}

/// The last lines of the process logs in `dir` whose names start with `prefix` (for errors).
fn logs(dir: &std::path::Path, prefix: &str) -> String {
    let mut out = String::new();
    for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if name.starts_with(prefix) && name.ends_with(".log") {
            let text = std::fs::read_to_string(e.path()).unwrap_or_default();
            let lines: Vec<&str> = text.lines().collect();
            out.push_str(&format!("\n===== {name}\n"));
            out.push_str(&lines[lines.len().saturating_sub(20)..].join("\n"));
        }
    }
    out
}

/// A sysctl of this (hub) namespace, whitespace normalised.
fn read_sysctl(path: &str) -> String {
    std::fs::read_to_string(format!("/proc/sys/{path}"))
        .unwrap_or_default()
        .split_whitespace()
        .collect::<Vec<_>>()
        .join(" ")
}

/// One-stream bulk upload to a sink for `dur`; returns the bytes the sink counted and the
/// seconds until it confirmed them (so the figure includes draining the link and every window).
async fn upload(ends: &Ends, via: Via, dur: Duration) -> anyhow::Result<(u64, f64)> {
    let mut s = ends.open(via).await?;
    s.write_all(b"S").await?;
    let buf = vec![0u8; BUF];
    let start = Instant::now();
    let deadline = start + dur;
    while Instant::now() < deadline {
        s.write_all(&buf).await?;
    }
    s.shutdown().await?;
    let mut count = [0u8; 8];
    s.read_exact(&mut count).await?;
    Ok((u64::from_le_bytes(count), start.elapsed().as_secs_f64()))
}

/// One-stream download from a timed source: it sends for `dur` from the request, then
/// half-closes; returns the bytes and the seconds from the request to the EOF.
async fn download(ends: &Ends, via: Via, dur: Duration) -> anyhow::Result<(u64, f64)> {
    let mut s = ends.open(via).await?;
    let mut req = vec![b'T'];
    req.extend_from_slice(&(dur.as_millis() as u64).to_le_bytes());
    let start = Instant::now();
    s.write_all(&req).await?;
    let mut buf = vec![0u8; BUF];
    let mut n = 0u64;
    loop {
        let m = s.read(&mut buf).await?;
        if m == 0 {
            break;
        }
        n += m as u64;
    }
    Ok((n, start.elapsed().as_secs_f64()))
}
