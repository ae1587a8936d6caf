//! registration-agent binary: flags → agent config, telemetry, one supervised agent per cluster
//! (several only with `--simulate N`, for load runs), until SIGTERM/SIGINT.
#![forbid(unsafe_code)]

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context as _;
use clap::Parser;
use registration_agent::addon::runtime::{KubeRuntime, LocalRuntime};
use registration_agent::addon::{AddOnAgent, AddOnSettings};
use registration_agent::agent::{Agent, AgentConfig};
use registration_agent::metrics::{AddOnMetrics, AgentMetrics};
use registration_agent::secret::{FileSecretStore, KubeSecretStore};
use registration_agent::supervisor::AgentSupervisor;
use tether_control::resources::ClusterClaim;

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum SecretStoreKind {
    /// A directory with one file per key (default; no Kubernetes needed).
    File,
    /// A Kubernetes Secret (in-cluster or $KUBECONFIG credentials).
    Kube,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum AddOnRuntimeKind {
    /// A supervised tunnel-agent child process (default; no Kubernetes needed).
    Local,
    /// A Deployment + Secret in the add-on's install namespace.
    Kube,
}

/// Tether registration-agent: joins this cluster to the hub and keeps its credentials fresh.
#[derive(Parser, Debug)]
#[command(version, about)]
struct Args {
    /// This managed cluster's name (DNS-1123 label).
    #[arg(long, env = "TETHER_CLUSTER_NAME")]
    cluster_name: String,
    /// Agent name (default: the stored one, or a random one).
    #[arg(long)]
    agent_name: Option<String>,
    /// Bootstrap kubeconfig written by `tetherctl join`.
    #[arg(long, env = "TETHER_BOOTSTRAP_KUBECONFIG")]
    bootstrap_kubeconfig: PathBuf,
    /// Directory for the hub credentials (kubeconfig, tls.crt, tls.key, cluster-name, agent-name).
    #[arg(long, default_value = "hub-kubeconfig")]
    hub_kubeconfig_dir: PathBuf,
    #[arg(long, value_enum, default_value = "file")]
    secret_store: SecretStoreKind,
    #[arg(long, default_value = "open-cluster-management-agent")]
    secret_namespace: String,
    #[arg(long, default_value = "hub-kubeconfig-secret")]
    secret_name: String,
    /// Labels for the ManagedCluster (key=value, repeatable).
    #[arg(long = "label")]
    labels: Vec<String>,
    /// Cluster claims (name=value, repeatable).
    #[arg(long = "claim")]
    claims: Vec<String>,
    /// How often the bootstrap kubeconfig and the certificate are checked.
    #[arg(long, default_value = "2s", value_parser = parse_duration)]
    check_interval: Duration,
    /// Admin listen address (/healthz /readyz /metrics).
    #[arg(long, env = "TETHER_ADMIN_LISTEN")]
    admin_listen: Option<String>,
    /// Load testing: run N simulated clusters `<cluster-name>-<i>` in this process, each with its
    /// own NATS connection and credentials under <hub-kubeconfig-dir>/<name>.
    #[arg(long, default_value_t = 0)]
    simulate: usize,
    #[arg(long, env = "TETHER_WORKER_THREADS")]
    worker_threads: Option<usize>,
    /// Run this add-on's agent once joined (repeatable; `cluster-proxy` is the tunnel-agent).
    #[arg(long = "addon")]
    addons: Vec<String>,
    /// Where add-on credentials (`<addon>-hub-kubeconfig/`) and agent configs
    /// (`<addon>-agent/`) go; default: the parent of --hub-kubeconfig-dir.
    #[arg(long)]
    addon_dir: Option<PathBuf>,
    #[arg(long, value_enum, default_value = "local")]
    addon_runtime: AddOnRuntimeKind,
    /// tunnel-agent binary for the local runtime (default: next to this binary).
    #[arg(long, env = "TETHER_TUNNEL_AGENT_BIN")]
    tunnel_agent_bin: Option<PathBuf>,
    /// Image of the add-on agent for the kube runtime.
    #[arg(long, default_value = "tether/tunnel-agent:latest")]
    addon_image: String,
    /// The cluster's API server as the add-on agent dials it (`<cluster>:443` goes there).
    #[arg(long, default_value = "kubernetes.default.svc:443")]
    addon_apiserver: String,
    /// Add-on lease duration in seconds (Available=False after 5 × this without renewal).
    #[arg(long, default_value_t = 60)]
    addon_lease_seconds: u32,
    /// Safety-net re-fetch of the add-on config (changes normally arrive as notifications).
    #[arg(long, default_value = "30s", value_parser = parse_duration)]
    addon_resync: Duration,
}

fn parse_duration(s: &str) -> Result<Duration, String> {
    humantime_parse(s)
}

fn humantime_parse(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let (num, unit) = s.split_at(
        s.find(|c: char| !c.is_ascii_digit() && c != '.')
            .unwrap_or(s.len()),
    );
    let n: f64 = num.parse().map_err(|_| format!("bad duration {s:?}"))?;
    let secs = match unit {
        "ms" => n / 1000.0,
        "s" | "" => n,
        "m" => n * 60.0,
        "h" => n * 3600.0,
        _ => return Err(format!("bad duration unit in {s:?} (ms, s, m, h)")),
    };
    Ok(Duration::from_secs_f64(secs))
}

fn pairs(v: &[String], what: &str) -> anyhow::Result<Vec<(String, String)>> {
    v.iter()
        .map(|p| {
            p.split_once('=')
                .map(|(a, b)| (a.to_string(), b.to_string()))
                .with_context(|| format!("--{what} {p:?} is not key=value"))
        })
        .collect()
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    tether_tls::install_default_crypto();
    if !tether_pki::subject::is_dns_label(&args.cluster_name) {
        anyhow::bail!(
            "--cluster-name {:?} is not a DNS-1123 label",
            args.cluster_name
        );
    }
    let mut cfg = AgentConfig::new(&args.cluster_name, args.bootstrap_kubeconfig.clone());
    cfg.agent_name = args.agent_name.clone();
    cfg.labels = pairs(&args.labels, "label")?.into_iter().collect();
    cfg.claims = pairs(&args.claims, "claim")?
        .into_iter()
        .map(|(name, value)| ClusterClaim { name, value })
        .collect();
    cfg.check_interval = args.check_interval;
    tether_runtime::actix_system(args.worker_threads).block_on(async move {
        let _telemetry = tether_telemetry::init_tracing("registration-agent");
        let shutdown = tether_runtime::shutdown_token();
        let registry = prometheus::Registry::new();
        let metrics = AgentMetrics::register(&registry)?;
        let readiness = tether_telemetry::Readiness::new();
        if let Some(listen) = &args.admin_listen {
            let l = tokio::net::TcpListener::bind(listen)
                .await
                .with_context(|| format!("cannot bind admin listen {listen}"))?;
            tracing::info!(admin = %l.local_addr()?, "admin server listening");
            let server = tether_telemetry::AdminServer::new(registry.clone(), readiness.clone());
            tokio::spawn(server.serve(l, shutdown.child_token()));
        }
        let mut supervisors = Vec::new();
        let mut addon_tasks = Vec::new();
        let addon_metrics = if args.addons.is_empty() {
            None
        } else {
            Some(AddOnMetrics::register(&registry)?)
        };
        if args.simulate > 0 {
            for i in 0..args.simulate {
                let name = format!("{}-{i}", args.cluster_name);
                let mut c = cfg.clone();
                c.cluster_name = name.clone();
                let store = FileSecretStore::new(args.hub_kubeconfig_dir.join(&name));
                let (agent, phase) = Agent::new(c, store, metrics.clone());
                supervisors.push(AgentSupervisor::start_agent(agent, phase, name, &shutdown));
                // Spread the start so the hub sees a ramp, not a thundering herd.
                tokio::time::sleep(Duration::from_millis(rand::random_range(1..10))).await;
            }
        } else {
            let (agent_phase_rx, session, sup) = match args.secret_store {
                SecretStoreKind::File => {
                    let store = FileSecretStore::new(args.hub_kubeconfig_dir.clone());
                    let (agent, phase) = Agent::new(cfg.clone(), store, metrics.clone());
                    let session = agent.session();
                    (
                        phase.clone(),
                        session,
                        AgentSupervisor::start_agent(
                            agent,
                            phase,
                            cfg.cluster_name.clone(),
                            &shutdown,
                        ),
                    )
                }
                SecretStoreKind::Kube => {
                    let client = kube::Client::try_default().await.context(
                        "connecting to the managed cluster's API server for --secret-store kube",
                    )?;
                    let store =
                        KubeSecretStore::new(client, &args.secret_namespace, &args.secret_name);
                    let (agent, phase) = Agent::new(cfg.clone(), store, metrics.clone());
                    let session = agent.session();
                    (
                        phase.clone(),
                        session,
                        AgentSupervisor::start_agent(
                            agent,
                            phase,
                            cfg.cluster_name.clone(),
                            &shutdown,
                        ),
                    )
                }
            };
            supervisors.push(sup);
            let base = args.addon_dir.clone().unwrap_or_else(|| {
                args.hub_kubeconfig_dir
                    .parent()
                    .filter(|p| !p.as_os_str().is_empty())
                    .map(|p| p.to_path_buf())
                    .unwrap_or_else(|| PathBuf::from("."))
            });
            for addon in &args.addons {
                if !tether_pki::subject::is_dns_label(addon) {
                    anyhow::bail!("--addon {addon:?} is not a DNS-1123 label");
                }
                let mut s = AddOnSettings::new(addon, &cfg.cluster_name, &base);
                s.apiserver = args.addon_apiserver.clone();
                s.lease_seconds = args.addon_lease_seconds.max(1);
                s.resync = args.addon_resync;
                let m = addon_metrics.clone().context("add-on metrics")?;
                let stop = shutdown.child_token();
                let rx = session.clone();
                match args.addon_runtime {
                    AddOnRuntimeKind::Local => {
                        let rt = LocalRuntime::new(
                            args.tunnel_agent_bin
                                .clone()
                                .unwrap_or_else(LocalRuntime::default_binary),
                            s.runtime_dir.clone(),
                            addon,
                            m.agent_restarts_total.with_label_values(&[addon.as_str()]),
                        );
                        addon_tasks.push(tokio::spawn(AddOnAgent::new(s, rt, m).run(rx, stop)));
                    }
                    AddOnRuntimeKind::Kube => {
                        let client = kube::Client::try_default().await.context(
                            "connecting to the managed cluster's API server for --addon-runtime kube",
                        )?;
                        let rt = KubeRuntime::new(client, addon, &args.addon_image);
                        addon_tasks.push(tokio::spawn(AddOnAgent::new(s, rt, m).run(rx, stop)));
                    }
                }
            }
            let mut rx = agent_phase_rx;
            let ready = readiness.clone();
            tokio::spawn(async move {
                while rx.changed().await.is_ok() {
                    let p = rx.borrow().clone();
                    match p {
                        registration_agent::agent::Phase::Joined => ready.set_ready(),
                        other => ready.set_not_ready(format!("{other:?}")),
                    }
                }
            });
        }
        shutdown.cancelled().await;
        tracing::info!("shutting down");
        // Add-on agents stop their processes before we exit.
        for t in addon_tasks {
            let _ = tokio::time::timeout(Duration::from_secs(5), t).await;
        }
        drop(supervisors);
        Ok(())
    })
}
