//! `tether-wan-bench`: direct TCP and the Tether tunnel side by side over an emulated WAN link
//! (1 Gbit/s, with and without 50 ms RTT), reported as ratios against the product targets
//! "tunnel ≥ 95 % of direct at 1 Gbit/s" and "one stream ≥ 90 % of direct with 50 ms RTT".
//!
//! ```text
//! cargo build --release -p tether-e2e -p tunnel-broker -p tunnel-agent --bins
//! ./target/release/tether-wan-bench            # as root; full run, about 3.5 minutes
//! ./target/release/tether-wan-bench --quick    # about 40 s
//! ```
//!
//! Layout (one process, three roles, chosen by hidden flags):
//! - outer (no flag, root namespace): for each scenario creates two network namespaces joined by
//!   the userspace link emulator ([`link`]: two TUN devices, a rate-limiting, delaying forwarder
//!   per direction on this process's threads), re-executes itself in the hub namespace as the
//!   inner process, waits for it (with a deadline), reads its report and tears the link down;
//!   prints the table at the end;
//! - inner (`--inner`, hub namespace, [`inner`]): starts the broker here (listening on
//!   10.77.0.1), the agent and the target in the cluster namespace (`ip netns exec`), and runs the
//!   bench client: direct = client → 10.77.0.2:target across the link; tunnel = client → broker
//!   (local) → HTTP/2 over the agent's mTLS connection across the link → agent → target on the
//!   cluster's loopback;
//! - target (`--target-server`, cluster namespace, [`target`]): sink, timed source, echo.
//!
//! Every measurement alternates direct and tunnel and swaps their order every round; the table
//! gives the median of per-round ratios.

mod inner;
mod link;
mod stats;
mod target;

use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use clap::Parser;

use link::{DOWN, Link, LinkParams, UP};
use stats::{Table, gbit, load_average, mean, median, range_note};

/// Direct TCP vs the Tether tunnel over an emulated 1 Gbit/s link, with and without 50 ms RTT.
#[derive(Parser, Debug, Clone)]
#[command(about)]
struct Args {
    /// Short run (≤ 2 minutes): half-length measurements, one round.
    #[arg(long)]
    quick: bool,
    /// Seconds per bulk measurement (default 5 for `1g`, 10 for `1g-50ms`; quick halves).
    #[arg(long)]
    secs: Option<f64>,
    /// Rounds (default 3, quick 1).
    #[arg(long)]
    rounds: Option<usize>,
    /// Scenarios to run: 1g, 1g-50ms (comma-separated; default both).
    #[arg(long, value_delimiter = ',')]
    only: Vec<String>,
    /// Extra tunnel settings for broker and agent, as YAML mapping entries,
    /// e.g. "stream_window_bytes: 16777216".
    #[arg(long)]
    tunnel: Option<String>,
    /// Tokio worker threads of broker and agent (passed as TETHER_WORKER_THREADS).
    #[arg(long)]
    worker_threads: Option<usize>,
    /// MTU of the emulated link.
    #[arg(long, default_value_t = 9000)]
    mtu: u32,
    /// Bottleneck queue per direction in bytes (default 2 × max(BDP, 256 KiB)).
    #[arg(long)]
    queue_bytes: Option<u64>,
    /// Maximum of tcp_rmem / tcp_wmem inside both namespaces (bytes; 0 keeps the kernel's
    /// defaults). The default lets one direct TCP stream fill 1 Gbit/s × 50 ms.
    #[arg(long, default_value_t = 32 << 20)]
    tcp_mem_max: u64,

    /// Internal: run as the target server.
    #[arg(long, hide = true)]
    target_server: bool,
    /// Internal: where the target server writes its port.
    #[arg(long, hide = true)]
    ready_file: Option<PathBuf>,
    /// Internal: run as the client side of one scenario (inside the hub namespace).
    #[arg(long, hide = true)]
    inner: bool,
    #[arg(long, hide = true)]
    scenario: Option<String>,
    #[arg(long, hide = true)]
    cluster_ns: Option<String>,
    #[arg(long, hide = true)]
    emu_pid: Option<u32>,
    #[arg(long, hide = true)]
    report: Option<PathBuf>,
    #[arg(long, hide = true)]
    rtt_us: Option<u64>,
}

/// A scenario: the link and the target ratio.
struct Scenario {
    name: &'static str,
    rate_bps: f64,
    one_way: Duration,
    goal: f64,
    default_secs: f64,
}

const SCENARIOS: [Scenario; 2] = [
    Scenario {
        name: "1g",
        rate_bps: 1e9,
        one_way: Duration::ZERO,
        goal: 0.95,
        default_secs: 5.0,
    },
    Scenario {
        name: "1g-50ms",
        rate_bps: 1e9,
        one_way: Duration::from_millis(25),
        goal: 0.90,
        default_secs: 10.0,
    },
];

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    if args.target_server {
        return target::run(&args.ready_file.context("--ready-file")?);
    }
    if args.inner {
        return inner::run(inner::InnerArgs {
            scenario: args.scenario.context("--scenario")?,
            cluster_ns: args.cluster_ns.context("--cluster-ns")?,
            emu_pid: args.emu_pid.context("--emu-pid")?,
            report: args.report.context("--report")?,
            secs: Duration::from_secs_f64(args.secs.context("--secs")?),
            rounds: args.rounds.context("--rounds")?,
            rtt: Duration::from_micros(args.rtt_us.unwrap_or(0)),
            quick: args.quick,
            tunnel: args.tunnel,
        });
    }
    outer(args)
}

/// Results of one scenario (the inner report plus the link's own counters).
struct Outcome {
    params: LinkParams,
    report: serde_json::Value,
    link: [link::DirSnapshot; 2],
    emu_cpu_secs: f64,
    /// User and system CPU seconds of this process during the scenario.
    emu_user_sys: (f64, f64),
    wall: f64,
}

fn outer(args: Args) -> anyhow::Result<()> {
    for s in &args.only {
        if !SCENARIOS.iter().any(|sc| sc.name == s) {
            bail!("unknown scenario {s:?}; known: 1g, 1g-50ms");
        }
    }
    if !is_root() {
        bail!("tether-wan-bench needs root (network namespaces, TUN devices)");
    }
    // Interrupts go to the inner process too; here they only stop the run so the link and the
    // namespaces are cleaned up on the way out.
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let mut signals = {
        use tokio::signal::unix::{SignalKind, signal};
        let _guard = rt.enter();
        [
            signal(SignalKind::interrupt())?,
            signal(SignalKind::terminate())?,
        ]
    };
    let started = Instant::now();
    let rounds = args.rounds.unwrap_or(if args.quick { 1 } else { 3 }).max(1);
    println!(
        "tether-wan-bench{}: {} CPUs, load average {} at start, MTU {}, tcp_rmem/wmem max {}, broker/agent worker threads: {}, tunnel settings: {}",
        if args.quick { " --quick" } else { "" },
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        load_average(),
        args.mtu,
        if args.tcp_mem_max == 0 {
            "kernel default".to_owned()
        } else {
            args.tcp_mem_max.to_string()
        },
        args.worker_threads.map_or_else(
            || std::env::var("TETHER_WORKER_THREADS")
                .unwrap_or_else(|_| "default (half the CPUs, at least 1)".into()),
            |n| n.to_string()
        ),
        args.tunnel.as_deref().unwrap_or("defaults"),
    );
    let dir = tempfile::tempdir()?;
    let mut outcomes = Vec::new();
    for (i, sc) in SCENARIOS.iter().enumerate() {
        if !args.only.is_empty() && !args.only.iter().any(|s| s == sc.name) {
            continue;
        }
        let secs = args.secs.unwrap_or(if args.quick {
            sc.default_secs / 2.0
        } else {
            sc.default_secs
        });
        let mut params = LinkParams {
            rate_bps: sc.rate_bps,
            one_way: sc.one_way,
            mtu: args.mtu,
            queue_bytes: 0,
        };
        params.queue_bytes = args
            .queue_bytes
            .unwrap_or(2 * params.bdp_bytes().max(256 << 10));
        println!(
            "\n{}: {} Gbit/s each way, RTT {} ms, queue {} KiB per direction (BDP {} KiB), {} × {secs:.1} s",
            sc.name,
            sc.rate_bps / 1e9,
            sc.one_way.as_millis() * 2,
            params.queue_bytes >> 10,
            params.bdp_bytes() >> 10,
            rounds
        );
        let tag = format!("{}{i}", std::process::id());
        let link = Link::create(
            params,
            &tag,
            (args.tcp_mem_max > 0).then_some(args.tcp_mem_max),
        )?;
        let report = dir.path().join(format!("{}.json", sc.name));
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", &link.hub_ns.name])
            .arg(std::env::current_exe()?)
            .arg("--inner")
            .args(["--scenario", sc.name])
            .args(["--cluster-ns", &link.cluster_ns.name])
            .args(["--emu-pid", &std::process::id().to_string()])
            .arg("--report")
            .arg(&report)
            .args(["--secs", &secs.to_string()])
            .args(["--rounds", &rounds.to_string()])
            .args(["--rtt-us", &(sc.one_way.as_micros() * 2).to_string()]);
        if args.quick {
            cmd.arg("--quick");
        }
        if let Some(t) = &args.tunnel {
            cmd.args(["--tunnel", t]);
        }
        if let Some(n) = args.worker_threads {
            cmd.env("TETHER_WORKER_THREADS", n.to_string());
        }
        // Generous: every bulk measurement may take twice its length, plus start-up and RR.
        let deadline = Duration::from_secs_f64(rounds as f64 * 4.0 * secs * 2.0 + 180.0);
        let cpu0 = stats::cpu_secs(std::process::id());
        let us0 = stats::user_sys_secs();
        let t0 = Instant::now();
        let status = rt.block_on(run_inner(cmd, deadline, &mut signals))?;
        let wall = t0.elapsed().as_secs_f64();
        let emu_cpu_secs = stats::cpu_secs(std::process::id()) - cpu0;
        let us1 = stats::user_sys_secs();
        let emu_user_sys = (us1.0 - us0.0, us1.1 - us0.1);
        let snapshot = link.stats();
        drop(link);
        if !status.success() {
            bail!("{}: the inner process failed ({status})", sc.name);
        }
        let report: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(&report).context("the inner process wrote no report")?,
        )?;
        outcomes.push((
            sc,
            Outcome {
                params,
                report,
                link: snapshot,
                emu_cpu_secs,
                emu_user_sys,
                wall,
            },
        ));
    }
    print_tables(&outcomes);
    println!(
        "\n(median of per-round ratios, range in brackets; {rounds} round(s); load average {} at end; {:.0} s in all)",
        load_average(),
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

/// Whether this process runs with effective UID 0 (`/proc/self/status`, second `Uid:` field).
fn is_root() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("Uid:"))
                .and_then(|v| v.split_whitespace().nth(1).map(|u| u == "0"))
        })
        .unwrap_or(false)
}

/// Runs the inner process until it exits, the deadline passes, or we are interrupted; in the
/// last two cases it is sent SIGTERM (by PID; it stops its own children) and then killed.
async fn run_inner(
    cmd: Command,
    deadline: Duration,
    signals: &mut [tokio::signal::unix::Signal; 2],
) -> anyhow::Result<std::process::ExitStatus> {
    let mut child = tokio::process::Command::from(cmd)
        .spawn()
        .context("start the inner process (ip netns exec)")?;
    let pid = child.id().context("inner pid")?;
    let [int, term] = signals;
    let why = tokio::select! {
        s = child.wait() => return Ok(s?),
        _ = tokio::time::sleep(deadline) => format!("did not finish within {deadline:?}"),
        _ = int.recv() => "interrupted".to_owned(),
        _ = term.recv() => "terminated".to_owned(),
    };
    let _ = nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid as i32),
        nix::sys::signal::Signal::SIGTERM,
    );
    if tokio::time::timeout(Duration::from_secs(15), child.wait())
        .await
        .is_err()
    {
        let _ = child.kill().await;
    }
    bail!("the inner process {why}")
}

fn f(v: &serde_json::Value) -> f64 {
    v.as_f64().unwrap_or(f64::NAN)
}

fn fv(v: &serde_json::Value) -> Vec<f64> {
    v.as_array()
        .map(|a| a.iter().map(f).collect())
        .unwrap_or_default()
}

fn print_tables(outcomes: &[(&Scenario, Outcome)]) {
    println!();
    let mut t = Table::new(
        &[
            "measurement",
            "direct",
            "tunnel",
            "tunnel vs direct",
            "target",
            "met",
        ],
        &[1, 2],
    );
    for (sc, o) in outcomes {
        let r = &o.report;
        for (key, what) in [("upload", "upload"), ("download", "download")] {
            let ratios = fv(&r[key]["ratios"]);
            let ratio = median(&ratios);
            t.add(vec![
                format!("{}: {what}, 1 stream", sc.name),
                gbit(mean(&fv(&r[key]["direct"]))),
                gbit(mean(&fv(&r[key]["tunnel"]))),
                format!("{ratio:.2}×{}", range_note(&ratios)),
                format!("≥ {:.2}×", sc.goal),
                if ratio >= sc.goal { "yes" } else { "NO" }.into(),
            ]);
        }
        let rr = &r["rr"];
        let (d, tu) = (f(&rr["direct_p50_us"]), f(&rr["tunnel_p50_us"]));
        t.add(vec![
            format!(
                "{}: 64 B request/response p50{}",
                sc.name,
                if std::env::var_os(inner::RR_UNDER_LOAD).is_some() {
                    ", under a bulk upload"
                } else {
                    ""
                }
            ),
            us(d),
            us(tu),
            format!(
                "+{:.0} µs (p99 {} / {}; {} each)",
                tu - d,
                us(f(&rr["direct_p99_us"])),
                us(f(&rr["tunnel_p99_us"])),
                rr["n"]
            ),
            String::new(),
            String::new(),
        ]);
    }
    t.print();

    println!("\nEmulator check (the direct path measures the link itself):\n");
    let mut e = Table::new(
        &[
            "scenario",
            "configured",
            "RTT p50 (64 B, direct)",
            "direct up / down vs rate",
            "queue, max used up / down",
            "drops up / down",
            "late > 200 µs",
            "emulator CPU",
            "TCP",
            "link ok",
        ],
        &[],
    );
    for (sc, o) in outcomes {
        let r = &o.report;
        let rate = o.params.rate_bps / 8.0;
        let up = mean(&fv(&r["upload"]["direct"])) / rate;
        let down = mean(&fv(&r["download"]["direct"])) / rate;
        let [u, d] = [&o.link[UP], &o.link[DOWN]];
        let gb = (u.bytes + d.bytes) as f64 / 1e9;
        // The emulator is trusted when the measured RTT is within max(1 ms, 5 %) of the
        // configured one and one direct stream gets at least 80 % of the rate both ways (a quick
        // 5 s measurement at 50 ms RTT loses about 10 % to slow start and the final drain).
        let rtt_ms = f(&r["rr"]["direct_p50_us"]) / 1000.0;
        let want_ms = o.params.one_way.as_secs_f64() * 2e3;
        let link_ok = (rtt_ms - want_ms).abs() <= (want_ms * 0.05).max(1.0) && up.min(down) >= 0.8;
        e.add(vec![
            sc.name.into(),
            format!(
                "{} Gbit/s, RTT {} ms, MTU {}",
                o.params.rate_bps / 1e9,
                o.params.one_way.as_millis() * 2,
                o.params.mtu
            ),
            format!("{rtt_ms:.2} ms"),
            format!("{:.1} % / {:.1} %", up * 100.0, down * 100.0),
            format!(
                "{} KiB, {} / {} KiB",
                o.params.queue_bytes >> 10,
                u.max_backlog >> 10,
                d.max_backlog >> 10
            ),
            format!(
                "{} / {} of {} / {} packets",
                u.dropped, d.dropped, u.packets, d.packets
            ),
            format!("{} / {}", u.late, d.late),
            format!(
                "{:.0} % median / {:.0} % max during transfers; {:.2} CPU-s/GB ({:.0} % system); {:.0} % of the {:.0} s run",
                f(&r["emulator_cpu"]["median"]) * 100.0,
                f(&r["emulator_cpu"]["max"]) * 100.0,
                o.emu_cpu_secs / gb.max(1e-9),
                o.emu_user_sys.1 / (o.emu_user_sys.0 + o.emu_user_sys.1).max(1e-9) * 100.0,
                o.emu_cpu_secs / o.wall * 100.0,
                o.wall
            ),
            format!(
                "{}, rmem {}, wmem {}",
                r["tcp"]["congestion_control"].as_str().unwrap_or("?"),
                r["tcp"]["rmem"].as_str().unwrap_or("?"),
                r["tcp"]["wmem"].as_str().unwrap_or("?")
            ),
            if link_ok { "yes" } else { "NO: figures unreliable" }.into(),
        ]);
        if u.write_errors + d.write_errors > 0 {
            println!(
                "  {}: {} / {} TUN write errors",
                sc.name, u.write_errors, d.write_errors
            );
        }
    }
    e.print();
    println!(
        "\nTunnel CPU-s per GB (broker / agent): {}",
        outcomes
            .iter()
            .map(|(sc, o)| format!(
                "{} {:.2} / {:.2}",
                sc.name,
                f(&o.report["tunnel_cpu_s_per_gb"]["broker"]),
                f(&o.report["tunnel_cpu_s_per_gb"]["agent"])
            ))
            .collect::<Vec<_>>()
            .join("; ")
    );
}

fn us(v: f64) -> String {
    if v >= 10_000.0 {
        format!("{:.2} ms", v / 1000.0)
    } else {
        format!("{v:.0} µs")
    }
}
