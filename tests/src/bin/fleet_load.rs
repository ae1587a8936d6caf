//! `tether-fleet-load`: N simulated managed clusters in ONE process against a real replicated
//! hub, and the scale figures of docs/scale.md.
//!
//! Layout:
//! - **hub** ([`Hub::start`]): `tetherctl init --nats-cluster K --auto-accept 'fleet-*'` (default
//!   lease 60 s unless `--lease-duration-seconds`), the K nats-server nodes
//!   ([`NatsCluster`]), one addon-manager, and the cluster-proxy add-on resources
//!   (`installStrategy: All`), all real processes on loopback, stopped by PID at the end.
//! - **fleet** ([`run_cluster`]): each cluster is the registration-agent's own [`Agent`] (read
//!   the bootstrap kubeconfig → key → CSR → auto-accepted → its own certificate → lease renewals
//!   at the hub's interval) over its own NATS connection with its own credentials, plus the
//!   cluster-proxy [`AddOnAgent`] on that session (add-on config, add-on CSR and credentials,
//!   status and add-on lease renewals). Only the add-on's tunnel-agent process is replaced
//!   ([`NullRuntime`]: it "runs" whatever config it is given), so no tunnels are opened.
//! - **ramp**: at most `--concurrency` clusters are between start and Joined at once.
//! - **window** ([`Sample`]): after the ramp, hold `--window-seconds` and take CPU and RSS of the
//!   hub processes from /proc at both ends; lease renewal latency is the registration agents'
//!   `tether_agent_lease_renew_duration_seconds` histogram, window only; the lease buckets'
//!   stream sequences at both ends give how many renewals were written to KV
//!   ([`lease_stream_seqs`]), and the hub's CPU per renewal follows.
//! - **report**: a human summary on stderr, one JSON object on stdout (or `--report FILE`).
//!
//! "Unknown" is watched on the hub's ManagedCluster bucket (a KV watch from before the first
//! join): any write that takes a cluster's Available condition from True to anything else.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use clap::Parser;
use prometheus::core::Collector;
use registration_agent::addon::render::RenderedAgent;
use registration_agent::addon::runtime::{AddOnRuntime, Observed, RuntimeError};
use registration_agent::addon::{AddOnAgent, AddOnSettings};
use registration_agent::agent::{Agent, AgentConfig, Phase};
use registration_agent::metrics::{AddOnMetrics, AgentMetrics};
use registration_agent::secret::FileSecretStore;
use tether_e2e::control_plane::{
    AvailabilityWatch, Manager, NatsCluster, admin_connection, cluster_proxy_resources,
    init_cluster_hub, join, start_manager,
};
use tether_test_support::bin;
use tokio_util::sync::CancellationToken;

/// How long one cluster may take from start to Joined before it counts as failed.
const JOIN_TIMEOUT: Duration = Duration::from_secs(600);
/// How long stopping the fleet may take.
const STOP_TIMEOUT: Duration = Duration::from_secs(30);
/// Cluster name prefix (the hub auto-accepts `fleet-*`).
const PREFIX: &str = "fleet";

/// Simulate a fleet of managed clusters against a real hub and report scale figures.
#[derive(Parser, Debug)]
#[command(about)]
struct Args {
    /// Managed clusters to simulate.
    #[arg(long, default_value_t = 1000)]
    clusters: usize,
    /// Most clusters between start and Joined at once.
    #[arg(long, default_value_t = 100)]
    concurrency: usize,
    /// Steady window held after the ramp (should exceed the lease duration).
    #[arg(long, default_value_t = 150)]
    window_seconds: u64,
    /// The whole ramp must finish within this.
    #[arg(long, default_value_t = 900)]
    ramp_timeout_seconds: u64,
    /// Cluster lease duration (the hub's default is 60 s; agents renew at this interval).
    #[arg(long)]
    lease_duration_seconds: Option<u32>,
    /// nats-server nodes.
    #[arg(long, default_value_t = 3)]
    nats_nodes: usize,
    /// Run without the cluster-proxy add-on agents.
    #[arg(long)]
    no_addon: bool,
    /// Work directory (default: a temporary one, removed at the end).
    #[arg(long)]
    work_dir: Option<PathBuf>,
    /// Write the JSON report here instead of stdout.
    #[arg(long)]
    report: Option<PathBuf>,
}

/// The add-on runtime of a simulated cluster: no tunnel-agent process, it reports running
/// whatever config it was last given (the add-on lease and status flow stay real).
struct NullRuntime {
    applied: Option<String>,
}

impl AddOnRuntime for NullRuntime {
    fn describe(&self) -> String {
        "simulated (no tunnel-agent process)".into()
    }
    async fn apply(&mut self, rendered: &RenderedAgent) -> Result<(), RuntimeError> {
        self.applied = Some(rendered.sha256.clone());
        Ok(())
    }
    async fn observe(&mut self) -> Option<Observed> {
        self.applied.as_ref().map(|sha| Observed {
            config_sha256: sha.clone(),
            ..Default::default()
        })
    }
    async fn stop(&mut self, _remove: bool) {
        self.applied = None;
    }
}

/// The hub processes.
struct Hub {
    dir: PathBuf,
    nats: NatsCluster,
    manager: Manager,
    url: String,
}

impl Hub {
    fn start(work: &Path, args: &Args) -> anyhow::Result<Self> {
        let lease = args.lease_duration_seconds.map(|s| s.to_string());
        let mut extra = vec!["--auto-accept", "fleet-*"];
        if let Some(l) = &lease {
            extra.extend(["--lease-duration-seconds", l]);
        }
        // The hub's default lease check, not the tests' fast one.
        extra.extend(["--lease-check-interval", "10s"]);
        // nats-server monitoring (random ports, in the ports files): the window's JetStream API
        // request and message counts per node come from /varz.
        extra.extend(["--nats-http", "127.0.0.1:-1"]);
        let dir = init_cluster_hub(work, args.nats_nodes, &extra)?;
        // Logs and nats-server ports files both go to the work directory (init's
        // --ports-file-dir).
        let logs = work.to_path_buf();
        let nats = NatsCluster::start(&dir, &logs, args.nats_nodes)?;
        let url = nats.url();
        let manager = start_manager(&dir, &url, "addon-manager", &logs)?;
        let hub = Self {
            dir,
            nats,
            manager,
            url,
        };
        if !args.no_addon {
            let unused: std::net::SocketAddr = "127.0.0.1:1".parse()?;
            let file = work.join("cluster-proxy.yaml");
            // No tunnel-agent runs, so the proxy and entrypoint are never dialled.
            std::fs::write(&file, cluster_proxy_resources("http://127.0.0.1:1", unused))?;
            hub.tetherctl(&["apply", "-f", &file.to_string_lossy()])?;
        }
        Ok(hub)
    }

    fn tetherctl(&self, args: &[&str]) -> anyhow::Result<String> {
        let o = Command::new(bin("tetherctl")?)
            .args(args)
            .arg("--hub-dir")
            .arg(&self.dir)
            .args(["--nats-url", &self.url])
            .output()?;
        if !o.status.success() {
            bail!("tetherctl {args:?}: {}", String::from_utf8_lossy(&o.stderr));
        }
        Ok(String::from_utf8_lossy(&o.stdout).into_owned())
    }

    /// (name, pid) of every hub process.
    fn pids(&self) -> Vec<(String, u32)> {
        let mut v = vec![("addon-manager".to_string(), self.manager.child.pid())];
        for n in &self.nats.nodes {
            if let Some(c) = &n.child {
                v.push((format!("nats-{}", n.index), c.pid()));
            }
        }
        v
    }
}

/// CPU seconds (user + system) and RSS bytes of a process, from /proc.
#[derive(Debug, Clone, Copy, Default)]
struct Sample {
    cpu_seconds: f64,
    rss_bytes: u64,
}

fn clock_ticks() -> f64 {
    Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .ok()
        .and_then(|o| String::from_utf8_lossy(&o.stdout).trim().parse().ok())
        .unwrap_or(100.0)
}

fn sample(pid: u32, ticks: f64) -> anyhow::Result<Sample> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    // Fields after the command (which may hold spaces) start at field 3 (state).
    let rest = stat
        .rsplit_once(')')
        .map(|(_, r)| r)
        .context("malformed /proc stat")?;
    let f: Vec<&str> = rest.split_whitespace().collect();
    let num = |i: usize| -> anyhow::Result<f64> {
        f.get(i)
            .and_then(|s| s.parse::<f64>().ok())
            .with_context(|| format!("/proc/{pid}/stat field {}", i + 3))
    };
    let cpu_seconds = (num(11)? + num(12)?) / ticks;
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let rss_kb: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .with_context(|| format!("no VmRSS in /proc/{pid}/status"))?;
    Ok(Sample {
        cpu_seconds,
        rss_bytes: rss_kb * 1024,
    })
}

fn self_pid() -> u32 {
    std::process::id()
}

/// Cumulative bucket counts of a histogram (upper bound, count).
fn buckets(h: &prometheus::Histogram) -> Vec<(f64, u64)> {
    h.collect()
        .first()
        .and_then(|mf| mf.get_metric().first())
        .map(|m| {
            m.get_histogram()
                .get_bucket()
                .iter()
                .map(|b| (b.upper_bound(), b.cumulative_count()))
                .collect()
        })
        .unwrap_or_default()
}

/// The `q` quantile of the observations between two bucket snapshots (linear within a bucket).
fn bucket_quantile(before: &[(f64, u64)], after: &[(f64, u64)], q: f64) -> Option<f64> {
    let diff: Vec<(f64, u64)> = after
        .iter()
        .zip(before.iter().map(|b| b.1).chain(std::iter::repeat(0)))
        .map(|(&(le, a), b)| (le, a.saturating_sub(b)))
        .collect();
    let total = diff.last()?.1;
    if total == 0 {
        return None;
    }
    let rank = q * total as f64;
    let mut prev = (0.0, 0u64);
    for &(le, c) in &diff {
        if c as f64 >= rank {
            let span = (c - prev.1).max(1) as f64;
            return Some(prev.0 + (le - prev.0) * (rank - prev.1 as f64) / span);
        }
        prev = (le, c);
    }
    Some(prev.0)
}

/// The `q` quantile of raw samples (nearest rank).
fn quantile(sorted: &[f64], q: f64) -> Option<f64> {
    if sorted.is_empty() {
        return None;
    }
    let i = ((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len()) - 1;
    Some(sorted[i])
}

fn counter(v: &prometheus::IntCounterVec, label: &str) -> u64 {
    v.with_label_values(&[label]).get()
}

/// One cluster's outcome of the ramp.
struct Joined {
    name: String,
    started: Instant,
    /// Start → Phase::Joined (credentials written and the first lease accepted).
    joined_after: Option<Duration>,
}

struct Fleet {
    bootstrap: PathBuf,
    dir: PathBuf,
    metrics: AgentMetrics,
    addon_metrics: Option<AddOnMetrics>,
    stop: CancellationToken,
}

/// Starts cluster `i` and waits (bounded) until it is Joined; the agent and add-on keep running
/// until the fleet's stop token.
async fn run_cluster(fleet: Arc<Fleet>, i: usize) -> Joined {
    let name = format!("{PREFIX}-{i}");
    let base = fleet.dir.join(&name);
    let started = Instant::now();
    let store = FileSecretStore::new(base.join("hub-kubeconfig"));
    let (agent, mut phase) = Agent::new(
        AgentConfig::new(&name, fleet.bootstrap.clone()),
        store,
        fleet.metrics.clone(),
    );
    if let Some(m) = &fleet.addon_metrics {
        let s = AddOnSettings::new("cluster-proxy", &name, &base);
        let addon = AddOnAgent::new(s, NullRuntime { applied: None }, m.clone());
        tokio::spawn(addon.run(agent.session(), fleet.stop.child_token()));
    }
    tokio::spawn(agent.run(fleet.stop.child_token()));
    let joined = tokio::time::timeout(JOIN_TIMEOUT, phase.wait_for(|p| *p == Phase::Joined)).await;
    Joined {
        name,
        started,
        joined_after: matches!(joined, Ok(Ok(_))).then(|| started.elapsed()),
    }
}

fn raise_fd_limit() {
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    if let Ok((_, hard)) = getrlimit(Resource::RLIMIT_NOFILE) {
        let _ = setrlimit(Resource::RLIMIT_NOFILE, hard, hard);
    }
}

fn secs(d: Option<f64>) -> serde_json::Value {
    d.map_or(serde_json::Value::Null, |v| {
        serde_json::json!((v * 1000.0).round() / 1000.0)
    })
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    anyhow::ensure!(args.clusters > 0, "--clusters must be at least 1");
    anyhow::ensure!(args.concurrency > 0, "--concurrency must be at least 1");
    anyhow::ensure!(args.nats_nodes > 0, "--nats-nodes must be at least 1");
    tether_tls::install_default_crypto()?;
    raise_fd_limit();
    let tmp;
    let work = match &args.work_dir {
        Some(d) => {
            std::fs::create_dir_all(d)?;
            d.clone()
        }
        None => {
            tmp = tempfile::tempdir()?;
            tmp.path().to_path_buf()
        }
    };
    let ticks = clock_ticks();
    let t = Instant::now();
    let hub = Hub::start(&work, &args).context("starting the hub")?;
    eprintln!(
        "hub up in {:.1} s: {} nats nodes, addon-manager pid {}",
        t.elapsed().as_secs_f64(),
        args.nats_nodes,
        hub.manager.child.pid()
    );
    let bootstrap = work.join("bootstrap.kubeconfig");
    join(&hub.dir, &bootstrap, &hub.url, None)?;
    let admin = admin_connection(&hub.dir, &hub.url).await?;
    let watch = AvailabilityWatch::start(
        tether_control::store::HubStore::open(admin.client.clone()).await?,
    );

    let fleet = Arc::new(Fleet {
        bootstrap,
        dir: work.join("clusters"),
        metrics: AgentMetrics::unregistered(),
        addon_metrics: if args.no_addon {
            None
        } else {
            Some(AddOnMetrics::register(&prometheus::Registry::new())?)
        },
        stop: CancellationToken::new(),
    });

    // Ramp: bounded concurrency and a deadline on the whole ramp.
    let ramp_start = Instant::now();
    let ramp_deadline = ramp_start + Duration::from_secs(args.ramp_timeout_seconds);
    let sem = Arc::new(tokio::sync::Semaphore::new(args.concurrency));
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..args.clusters {
        let permit = tokio::time::timeout_at(ramp_deadline.into(), sem.clone().acquire_owned())
            .await
            .context("ramp deadline passed while starting clusters")??;
        let f = fleet.clone();
        tasks.spawn(async move {
            let r = run_cluster(f, i).await;
            drop(permit);
            r
        });
        if i % 1000 == 999 {
            eprintln!("started {} clusters ({:?})", i + 1, ramp_start.elapsed());
        }
    }
    let mut results = Vec::with_capacity(args.clusters);
    while let Ok(Some(r)) = tokio::time::timeout_at(ramp_deadline.into(), tasks.join_next()).await {
        results.push(r?);
    }
    let ramp = ramp_start.elapsed();
    let mut joined: Vec<f64> = results
        .iter()
        .filter_map(|r| r.joined_after.map(|d| d.as_secs_f64()))
        .collect();
    joined.sort_by(f64::total_cmp);
    eprintln!(
        "ramp: {} of {} Joined in {:.1} s",
        joined.len(),
        args.clusters,
        ramp.as_secs_f64()
    );

    // Steady window.
    let pids = hub.pids();
    let before: BTreeMap<String, Sample> = pids
        .iter()
        .chain(std::iter::once(&("fleet-load".to_string(), self_pid())))
        .map(|(n, p)| Ok((n.clone(), sample(*p, ticks)?)))
        .collect::<anyhow::Result<_>>()?;
    let lat_before = buckets(&fleet.metrics.lease_renew_duration_seconds);
    let ok_before = counter(&fleet.metrics.lease_renewals_total, "ok");
    let err_before = counter(&fleet.metrics.lease_renewals_total, "error");
    let addon_before = fleet.addon_metrics.as_ref().map(|m| {
        m.lease_renewals_total
            .with_label_values(&["cluster-proxy", "ok"])
            .get()
    });
    let js = async_nats::jetstream::new(admin.client.clone());
    let seq_before = lease_stream_seqs(&js).await?;
    let varz_before = node_counters(&work, &pids).await;
    let window_start = Instant::now();
    tokio::time::sleep(Duration::from_secs(args.window_seconds)).await;
    let window = window_start.elapsed().as_secs_f64();
    let seq_after = lease_stream_seqs(&js).await?;
    let varz_after = node_counters(&work, &pids).await;
    // Per node and second: JetStream API requests (every leader read, listing consumer, stream
    // info and KV write is one) and client + route messages in.
    let nats_rates: BTreeMap<String, serde_json::Value> = varz_after
        .iter()
        .filter_map(|(n, a)| {
            let b = varz_before.get(n)?;
            let rate = |x: u64, y: u64| ((x.saturating_sub(y)) as f64 / window).round();
            Some((
                n.clone(),
                serde_json::json!({
                    "js_api_per_s": rate(a.js_api, b.js_api),
                    "in_msgs_per_s": rate(a.in_msgs, b.in_msgs),
                    "out_msgs_per_s": rate(a.out_msgs, b.out_msgs),
                }),
            ))
        })
        .collect();
    let writes: BTreeMap<&str, u64> = seq_after
        .iter()
        .map(|(b, a)| (*b, a - seq_before.get(b).copied().unwrap_or(0)))
        .collect();
    let mut procs = serde_json::Map::new();
    for (n, p) in pids
        .iter()
        .chain(std::iter::once(&("fleet-load".to_string(), self_pid())))
    {
        let a = sample(*p, ticks)?;
        let b = before.get(n).copied().unwrap_or_default();
        procs.insert(
            n.clone(),
            serde_json::json!({
                "cpu_cores": ((a.cpu_seconds - b.cpu_seconds) / window * 1000.0).round() / 1000.0,
                "rss_mib": (a.rss_bytes as f64 / 1048576.0 * 10.0).round() / 10.0,
            }),
        );
    }
    let lat_after = buckets(&fleet.metrics.lease_renew_duration_seconds);
    let renew_ok = counter(&fleet.metrics.lease_renewals_total, "ok") - ok_before;
    let renew_err = counter(&fleet.metrics.lease_renewals_total, "error") - err_before;
    let addon_renew_ok = fleet
        .addon_metrics
        .as_ref()
        .zip(addon_before)
        .map(|(m, b)| {
            m.lease_renewals_total
                .with_label_values(&["cluster-proxy", "ok"])
                .get()
                - b
        });

    let hub_cpu: f64 = procs
        .iter()
        .filter(|(n, _)| n.as_str() != "fleet-load")
        .filter_map(|(_, v)| v["cpu_cores"].as_f64())
        .sum();
    let renewals = renew_ok + addon_renew_ok.unwrap_or(0);
    let hub_cpu_ms_per_renewal =
        (renewals > 0).then(|| hub_cpu * window * 1000.0 / renewals as f64);

    // `tetherctl get clusters` wall time (the whole table through the seed list).
    let t = Instant::now();
    let table = hub.tetherctl(&["get", "clusters"])?;
    let get_clusters = t.elapsed().as_secs_f64();
    let rows = table
        .lines()
        .skip(1)
        .filter(|l| l.starts_with(PREFIX))
        .count();

    let seen = watch.finish_timed().await?;
    let mut available: Vec<f64> = results
        .iter()
        .filter_map(|r| {
            let at = seen.first_available.get(&r.name)?;
            Some(at.saturating_duration_since(r.started).as_secs_f64())
        })
        .collect();
    available.sort_by(f64::total_cmp);

    let report = serde_json::json!({
        "clusters": args.clusters,
        "nats_nodes": args.nats_nodes,
        "addon": !args.no_addon,
        "concurrency": args.concurrency,
        "ramp_seconds": secs(Some(ramp.as_secs_f64())),
        "joined": joined.len(),
        "available": seen.first_available.len(),
        "unknown_or_flapped": seen.flaps.len(),
        "flaps": seen.flaps.iter().take(20).collect::<Vec<_>>(),
        "start_to_joined_seconds": {"p50": secs(quantile(&joined, 0.5)), "p99": secs(quantile(&joined, 0.99))},
        "start_to_available_seconds": {"p50": secs(quantile(&available, 0.5)), "p99": secs(quantile(&available, 0.99))},
        "window_seconds": secs(Some(window)),
        "lease_renewals_ok": renew_ok,
        "lease_renewals_error": renew_err,
        "addon_lease_renewals_ok": addon_renew_ok,
        "lease_renew_seconds": {
            "p50": secs(bucket_quantile(&lat_before, &lat_after, 0.5)),
            "p99": secs(bucket_quantile(&lat_before, &lat_after, 0.99)),
        },
        "lease_kv_writes": writes,
        "nats_rates": nats_rates,
        "processes": procs,
        "hub_cpu_cores": (hub_cpu * 1000.0).round() / 1000.0,
        "hub_cpu_ms_per_renewal": hub_cpu_ms_per_renewal.map(|v| (v * 100.0).round() / 100.0),
        "loadavg": std::fs::read_to_string("/proc/loadavg").unwrap_or_default().trim(),
        "get_clusters_seconds": secs(Some(get_clusters)),
        "get_clusters_rows": rows,
        "hub_pids": pids.iter().map(|(_, p)| *p).collect::<Vec<_>>(),
    });
    eprintln!("{}", serde_json::to_string_pretty(&report)?);
    match &args.report {
        Some(p) => std::fs::write(p, serde_json::to_vec_pretty(&report)?)
            .with_context(|| format!("writing {}", p.display()))?,
        None => println!("{report}"),
    }

    // Stop the fleet (bounded), then the hub (Drop: SIGTERM, then SIGKILL, by PID).
    fleet.stop.cancel();
    tasks.abort_all();
    let _ = tokio::time::timeout(STOP_TIMEOUT, async {
        while tasks.join_next().await.is_some() {}
    })
    .await;
    drop(admin);
    let t = Instant::now();
    drop(hub);
    eprintln!("hub stopped in {:.1} s", t.elapsed().as_secs_f64());
    Ok(())
}

/// The last stream sequence of each lease bucket (`tether-leases`, `tether-addon-leases`): the
/// difference over the window is how many renewals were written to KV.
async fn lease_stream_seqs(
    js: &async_nats::jetstream::Context,
) -> anyhow::Result<BTreeMap<&'static str, u64>> {
    let mut out = BTreeMap::new();
    for bucket in [
        tether_control::subjects::BUCKET_LEASES,
        tether_control::subjects::BUCKET_ADDON_LEASES,
    ] {
        let info = tokio::time::timeout(Duration::from_secs(10), async {
            js.get_stream(format!("KV_{bucket}"))
                .await?
                .info()
                .await
                .map(|i| i.state.last_sequence)
                .map_err(anyhow::Error::from)
        })
        .await
        .with_context(|| format!("stream info of {bucket} timed out"))??;
        out.insert(bucket, info);
    }
    Ok(out)
}

/// Counters of one nats-server's /varz.
#[derive(Debug, Clone, Copy, Default)]
struct NodeCounters {
    js_api: u64,
    in_msgs: u64,
    out_msgs: u64,
}

/// /varz counters of every nats-server among `pids` (monitoring port from its ports file in
/// `work`); a node that does not answer within a few seconds is left out.
async fn node_counters(work: &Path, pids: &[(String, u32)]) -> BTreeMap<String, NodeCounters> {
    let mut out = BTreeMap::new();
    for (name, pid) in pids.iter().filter(|(n, _)| n.starts_with("nats-")) {
        let r = tokio::time::timeout(Duration::from_secs(5), varz(work, *pid)).await;
        match r {
            Ok(Ok(v)) => {
                let n = |p: &str| {
                    v.pointer(p)
                        .and_then(serde_json::Value::as_u64)
                        .unwrap_or(0)
                };
                out.insert(
                    name.clone(),
                    NodeCounters {
                        js_api: n("/jetstream/stats/api/total"),
                        in_msgs: n("/in_msgs"),
                        out_msgs: n("/out_msgs"),
                    },
                );
            }
            Ok(Err(e)) => eprintln!("varz of {name}: {e:#}"),
            Err(_) => eprintln!("varz of {name}: timed out"),
        }
    }
    out
}

/// GET /varz of the nats-server `pid` (HTTP/1.0 on its monitoring port).
async fn varz(work: &Path, pid: u32) -> anyhow::Result<serde_json::Value> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let ports: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(
        work.join(format!("nats-server_{pid}.ports")),
    )?)?;
    let url = ports
        .pointer("/monitoring/0")
        .and_then(serde_json::Value::as_str)
        .context("no monitoring port in the ports file")?;
    let addr = url.trim_start_matches("http://").trim_end_matches('/');
    let mut conn = tokio::net::TcpStream::connect(addr).await?;
    conn.write_all(b"GET /varz HTTP/1.0\r\nHost: localhost\r\n\r\n")
        .await?;
    let mut body = Vec::new();
    conn.read_to_end(&mut body).await?;
    let text = String::from_utf8_lossy(&body);
    let json = text
        .split_once("\r\n\r\n")
        .map(|(_, b)| b)
        .context("no HTTP body")?;
    Ok(serde_json::from_str(json)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bucket_quantile_interpolates_within_the_window_only() {
        let before = [(0.01, 10), (0.1, 10), (1.0, 10)];
        let after = [(0.01, 10), (0.1, 110), (1.0, 110)];
        let p50 = bucket_quantile(&before, &after, 0.5).unwrap();
        assert!((p50 - 0.055).abs() < 1e-9, "{p50}");
        assert_eq!(bucket_quantile(&before, &before, 0.5), None);
    }

    #[test]
    fn quantile_is_nearest_rank() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(quantile(&v, 0.5), Some(50.0));
        assert_eq!(quantile(&v, 0.99), Some(99.0));
        assert_eq!(quantile(&[], 0.5), None);
    }
}
