//! Fairness budgets (tunnel-broker `budget` module) through a real broker and real agents:
//! three clusters on one broker, one of them (`flood`) flooded by a client that opens streams
//! as fast as it can and pushes bytes on every stream it gets, while the other two (`victim-1`,
//! `victim-2`) are measured — request/response latency (median of small echoes on a held
//! stream) and throughput (an echo transfer) — first unloaded, then under the flood, in the
//! same test. Asserted:
//!
//! - the flood is held to its cluster's budget: refusals are 503s naming the budget and limit,
//!   counted in `tether_broker_budget_rejections_total{budget,owner="flood"}`, and the broker's
//!   open streams of that cluster never exceed `max_streams_per_cluster`;
//! - every victim dial still succeeds, and victims' latency and throughput are compared with
//!   their unloaded figures, medians over alternating unloaded and flooded rounds (the 80 %
//!   criterion with `TETHER_FAIRNESS_STRICT` set, a looser default, see [`STRICT_ENV`]);
//! - the broker's resident memory stays under the documented bound;
//! - (second test) a client's budget spans clusters, is refused with a 503 naming it, and is
//!   given back when its streams close.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use tether_e2e::{
    Hub, OPS_TOKEN, Payload, connect, connect_ok, echo_server, echo_transfer, metric, qualified,
    rate, wait_agent_ready, wait_tunnel,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const FLOOD_STREAMS: usize = 16;
const FLOOD_PENDING: usize = 8;
/// Concurrent flood loops (each: CONNECT, push bytes, repeat) — twice the budget, so the
/// budget refuses some all the time.
const FLOOD_LOOPS: usize = 2 * FLOOD_STREAMS;
/// Bytes a flood stream pushes before it closes and dials again.
const FLOOD_BYTES_PER_STREAM: usize = 4 << 20;
const ECHOES: usize = 200;
const TRANSFER: u64 = 16 << 20;
/// The flood's delivery rate (bytes/s at its agent) below which it is in its paced steady
/// state (the broker paces a flooding cluster to 10 MiB/s; 2× for measurement slack).
const STEADY_FLOOD_BYTES_PER_SEC: f64 = 20.0 * 1024.0 * 1024.0;
/// Rounds of (unloaded, flooded) measurements; medians are compared.
const ROUNDS: usize = 3;
/// With this set the product's criterion is asserted: victims keep ≥ 80 % of their unloaded
/// throughput and at most 1/0.8 = 1.25 × their unloaded latency. By default only the latency
/// is asserted, with a looser bound that still fails without the budgets, the refusal pause and
/// the CPU share (measured without them: 15–88 × latency): on a shared 2-core CI machine the
/// flood's client, agent and sink compete with the victims for the same cores outside the
/// broker's control, and other jobs' load makes throughput figures swing ±50 % between runs.
/// The figures are printed either way.
const STRICT_ENV: &str = "TETHER_FAIRNESS_STRICT";
const DEFAULT_MAX_LATENCY: f64 = 3.0;
/// Documented bound of the broker's resident memory in this test (docs/architecture.md,
/// "Fairness"): the budgets bound buffers to 16 flood streams × (16 MiB window + 256 KiB
/// chunk) at worst plus the victims; 512 MiB leaves room for the runtime, TLS and the debug
/// build.
const RSS_BOUND_BYTES: u64 = 512 << 20;

fn budgets_yaml() -> String {
    format!(
        "budgets:\n  max_streams_per_cluster: {FLOOD_STREAMS}\n  max_pending_dials_per_cluster: {FLOOD_PENDING}\n  max_streams_per_client: 10000\n  max_pending_dials_per_client: 10000\n  max_buffered_bytes_per_cluster: 67108864\n"
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
    let t = echo_transfer(s, Arc::new(Payload::new()), TRANSFER).await?;
    anyhow::ensure!(t.intact(), "victim transfer not intact");
    Ok(Figures {
        latency: rtts[ECHOES / 2],
        throughput: t.throughput(),
    })
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

/// A TCP sink inside the flooded cluster: reads and discards.
async fn sink_server() -> anyhow::Result<std::net::SocketAddr> {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let a = l.local_addr()?;
    tokio::spawn(async move {
        while let Ok((mut s, _)) = l.accept().await {
            tokio::spawn(async move {
                let mut b = vec![0u8; 256 << 10];
                while matches!(s.read(&mut b).await, Ok(n) if n > 0) {}
            });
        }
    });
    Ok(a)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_flooding_cluster_cannot_starve_the_others() -> anyhow::Result<()> {
    let hub = Hub::new()?;
    let echo = echo_server().await?;
    let sink = sink_server().await?;
    let broker = hub.start_broker("b1", &budgets_yaml())?;
    let mut agents = Vec::new();
    for c in ["victim-1", "victim-2", "flood"] {
        let target = if c == "flood" { sink } else { echo };
        agents.push(hub.start_agent(c, c, &[vec![broker.agent_addr]], target, "")?);
    }
    for (a, c) in agents.iter().zip(["victim-1", "victim-2", "flood"]) {
        wait_agent_ready(a).await?;
        wait_tunnel(&broker, c).await?;
    }
    let victims = [qualified("victim-1", echo), qualified("victim-2", echo)];
    // Like a watch, each victim keeps one idle stream open all along (real clusters always
    // have some), and is measured on fresh streams beside it.
    let mut watches = Vec::new();
    for v in &victims {
        measure(broker.client_addr, v).await?; // warm-up
        watches.push(connect_ok(broker.client_addr, v).await?);
    }

    // The flood runs on its own runtime thread, so its loops do not queue in front of the
    // victims' client tasks in this process (the broker is under test, not this client). It
    // floods while `flooding` is set, idles otherwise, and ends when `stop` is set.
    let stop = Arc::new(AtomicBool::new(false));
    let flooding = Arc::new(AtomicBool::new(false));
    let opened = Arc::new(AtomicU64::new(0));
    let refused = Arc::new(AtomicU64::new(0));
    let pushed = Arc::new(AtomicU64::new(0));
    let bad_refusals = Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
    let flood_authority = qualified("flood", sink);
    let flood_rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let mut loops = Vec::new();
    for _ in 0..FLOOD_LOOPS {
        let (stop, flooding, opened, refused, pushed, bad) = (
            Arc::clone(&stop),
            Arc::clone(&flooding),
            Arc::clone(&opened),
            Arc::clone(&refused),
            Arc::clone(&pushed),
            Arc::clone(&bad_refusals),
        );
        let (addr, authority) = (broker.client_addr, flood_authority.clone());
        loops.push(flood_rt.spawn(async move {
            let chunk = vec![0x5au8; 256 << 10];
            let on = || flooding.load(Ordering::Relaxed) && !stop.load(Ordering::Relaxed);
            while !stop.load(Ordering::Relaxed) {
                if !on() {
                    // Idle phase of the flood client (not a wait in the test's logic).
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    continue;
                }
                match connect(addr, &authority, Some(OPS_TOKEN)).await {
                    Ok(Ok(mut s)) => {
                        opened.fetch_add(1, Ordering::Relaxed);
                        let mut sent = 0;
                        while sent < FLOOD_BYTES_PER_STREAM && on() {
                            if s.write_all(&chunk).await.is_err() {
                                break;
                            }
                            sent += chunk.len();
                            pushed.fetch_add(chunk.len() as u64, Ordering::Relaxed);
                        }
                    }
                    Ok(Err((code, body))) => {
                        refused.fetch_add(1, Ordering::Relaxed);
                        if code != 503 || !body.contains("budgets.max_") {
                            bad.lock().unwrap().push(format!("{code} {body}"));
                        }
                    }
                    Err(_) => {}
                }
            }
        }));
    }
    let flood_thread = std::thread::spawn(move || {
        flood_rt.block_on(async move {
            for l in loops {
                let _ = l.await;
            }
        })
    });

    // Alternate unloaded and flooded rounds (the machine's other load drifts; alternating
    // compares like with like), each measuring both victims.
    let mut unloaded: Vec<Vec<Figures>> = vec![Vec::new(); victims.len()];
    let mut loaded: Vec<Vec<Figures>> = vec![Vec::new(); victims.len()];
    let mut peak_flood_streams = 0.0f64;
    let mut paced = 0.0f64;
    let mut rss_loaded = 0u64;
    let rss_before = rss_bytes(broker.child.pid());
    let mut flood_time = Duration::ZERO;
    for _ in 0..ROUNDS {
        flooding.store(false, Ordering::Relaxed);
        tether_test_support::wait_until_async(
            Duration::from_secs(20),
            "the flood's streams to close",
            || async {
                let (_, body) = tether_e2e::admin_get(broker.admin_addr, "/debug/tunnels")
                    .await
                    .ok()?;
                let list: serde_json::Value = serde_json::from_str(&body).ok()?;
                list.as_array()?
                    .iter()
                    .filter(|t| t["cluster"] == "flood")
                    .all(|t| t["open_streams"] == 0)
                    .then_some(())
            },
        )
        .await?;
        for (i, v) in victims.iter().enumerate() {
            unloaded[i].push(measure(broker.client_addr, v).await?);
        }
        let refused_before = refused.load(Ordering::Relaxed);
        let flood_started = Instant::now();
        flooding.store(true, Ordering::Relaxed);
        tether_test_support::wait_until_async(
            Duration::from_secs(20),
            "the flood to hit its budget",
            || async { (refused.load(Ordering::Relaxed) > refused_before).then_some(()) },
        )
        .await?;
        // Measure the flood's steady state: once the broker paces it, the burst it got in
        // before its first refusal (up to a window per stream) drains through its agent first.
        let flood_admin = agents[2].admin_addr;
        tether_test_support::wait_until_async(
            Duration::from_secs(20),
            "the flood to be paced to its steady state",
            || async {
                let paced = metric(broker.admin_addr, "tether_broker_paced_clusters", &[])
                    .await
                    .ok()?;
                let delivered = || {
                    metric(
                        flood_admin,
                        "tether_agent_bytes_total",
                        &[("direction", "to_target")],
                    )
                };
                let (a, t) = (delivered().await.ok()?, Instant::now());
                tokio::time::sleep(Duration::from_millis(250)).await;
                let b = delivered().await.ok()?;
                let rate = (b - a) / t.elapsed().as_secs_f64();
                (paced >= 1.0 && rate < STEADY_FLOOD_BYTES_PER_SEC).then_some(())
            },
        )
        .await?;
        for (i, v) in victims.iter().enumerate() {
            loaded[i].push(measure(broker.client_addr, v).await?);
            paced =
                paced.max(metric(broker.admin_addr, "tether_broker_paced_clusters", &[]).await?);
            let (_, body) = tether_e2e::admin_get(broker.admin_addr, "/debug/tunnels").await?;
            let list: serde_json::Value = serde_json::from_str(&body)?;
            for t in list.as_array().into_iter().flatten() {
                if t["cluster"] == "flood" {
                    peak_flood_streams =
                        peak_flood_streams.max(t["open_streams"].as_f64().unwrap_or(0.0));
                }
            }
            rss_loaded = rss_loaded.max(rss_bytes(broker.child.pid()));
        }
        flood_time += flood_started.elapsed();
    }
    stop.store(true, Ordering::Relaxed);
    drop(watches);
    tokio::task::spawn_blocking(move || flood_thread.join())
        .await?
        .map_err(|_| anyhow::anyhow!("flood thread panicked"))?;

    let delivered = metric(
        agents[2].admin_addr,
        "tether_agent_bytes_total",
        &[("direction", "to_target")],
    )
    .await?;
    eprintln!(
        "flood delivered {} MiB to its target through the broker in {flood_time:?} of flooding ({})",
        delivered as u64 >> 20,
        rate(delivered / flood_time.as_secs_f64())
    );
    let bad = bad_refusals.lock().unwrap().clone();
    assert!(
        bad.is_empty(),
        "refusals that do not name the budget: {bad:?}"
    );
    let rejections = metric(
        broker.admin_addr,
        "tether_broker_budget_rejections_total",
        &[("owner", "flood")],
    )
    .await?;
    assert!(rejections >= 1.0, "budget rejections counted: {rejections}");
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
    let median = |v: &[Figures], f: &dyn Fn(&Figures) -> f64| {
        let mut x: Vec<f64> = v.iter().map(f).collect();
        x.sort_by(f64::total_cmp);
        x[x.len() / 2]
    };
    let mut worst_latency: f64 = 0.0;
    let mut worst_throughput: f64 = f64::MAX;
    for i in 0..victims.len() {
        let (ul, ll) = (
            median(&unloaded[i], &|f| f.latency.as_secs_f64()),
            median(&loaded[i], &|f| f.latency.as_secs_f64()),
        );
        let (ut, lt) = (
            median(&unloaded[i], &|f| f.throughput),
            median(&loaded[i], &|f| f.throughput),
        );
        let (lat, thr) = (ll / ul, lt / ut);
        worst_latency = worst_latency.max(lat);
        worst_throughput = worst_throughput.min(thr);
        eprintln!(
            "victim-{}: median latency {:.0} us -> {:.0} us (x{lat:.2}), median throughput {} -> {} ({:.0} %)",
            i + 1,
            ul * 1e6,
            ll * 1e6,
            rate(ut),
            rate(lt),
            thr * 100.0
        );
    }
    eprintln!(
        "flood: {} streams opened, {} refused by the budget, {} MiB pushed, peak {peak_flood_streams} open streams (budget {FLOOD_STREAMS}), up to {paced} cluster(s) paced; broker RSS {} MiB before / max {} MiB under flood (bound {} MiB); {rejections} rejections counted",
        opened.load(Ordering::Relaxed),
        refused.load(Ordering::Relaxed),
        pushed.load(Ordering::Relaxed) >> 20,
        rss_before >> 20,
        rss_loaded >> 20,
        RSS_BOUND_BYTES >> 20
    );
    let (min_thr, max_lat) = if std::env::var_os(STRICT_ENV).is_some() {
        (0.8, 1.25)
    } else {
        (0.0, DEFAULT_MAX_LATENCY)
    };
    assert!(
        worst_throughput >= min_thr && worst_latency <= max_lat,
        "victims under flood: throughput {:.0} % of unloaded (need {:.0} %), latency x{worst_latency:.2} (at most x{max_lat})",
        worst_throughput * 100.0,
        min_thr * 100.0
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
