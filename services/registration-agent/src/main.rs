//! registration-agent binary: flags → [`registration_agent::service::ServiceConfig`], telemetry,
//! then the service skeleton (`bind` → `run` → drain) until SIGTERM/SIGINT.
#![forbid(unsafe_code)]

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context as _;
use clap::Parser;
use registration_agent::agent::AgentConfig;
use registration_agent::service::{self, AddOnRuntimeConfig, SecretStoreConfig, ServiceConfig};
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
    #[arg(long, default_value = "2s", value_parser = tether_config::duration::parse)]
    check_interval: Duration,
    /// Admin listen address (/healthz /readyz /metrics).
    #[arg(long, env = "TETHER_ADMIN_LISTEN")]
    admin_listen: Option<String>,
    /// Load testing: run N simulated clusters `<cluster-name>-<i>` in this process, each with its
    /// own NATS connection and credentials under <hub-kubeconfig-dir>/<name>.
    #[arg(long, default_value_t = 0)]
    simulate: usize,
    #[arg(long, env = "TETHER_WORKER_THREADS", value_parser = tether_runtime::parse_worker_threads)]
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
    #[arg(long, default_value = "30s", value_parser = tether_config::duration::parse)]
    addon_resync: Duration,
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
    let aead = tether_tls::install_default_crypto()?;
    if !tether_pki::subject::is_dns_label(&args.cluster_name) {
        anyhow::bail!(
            "--cluster-name {:?} is not a DNS-1123 label",
            args.cluster_name
        );
    }
    let mut agent = AgentConfig::new(&args.cluster_name, args.bootstrap_kubeconfig.clone());
    agent.agent_name = args.agent_name.clone();
    agent.labels = pairs(&args.labels, "label")?.into_iter().collect();
    agent.claims = pairs(&args.claims, "claim")?
        .into_iter()
        .map(|(name, value)| ClusterClaim { name, value })
        .collect();
    agent.check_interval = args.check_interval;
    let addon_dir = args.addon_dir.clone().unwrap_or_else(|| {
        args.hub_kubeconfig_dir
            .parent()
            .filter(|p| !p.as_os_str().is_empty())
            .map(|p| p.to_path_buf())
            .unwrap_or_else(|| PathBuf::from("."))
    });
    let cfg = ServiceConfig {
        agent,
        hub_kubeconfig_dir: args.hub_kubeconfig_dir.clone(),
        secret_store: match args.secret_store {
            SecretStoreKind::File => SecretStoreConfig::File,
            SecretStoreKind::Kube => SecretStoreConfig::Kube {
                namespace: args.secret_namespace.clone(),
                name: args.secret_name.clone(),
            },
        },
        simulate: args.simulate,
        addons: args.addons.clone(),
        addon_dir,
        addon_runtime: match args.addon_runtime {
            AddOnRuntimeKind::Local => AddOnRuntimeConfig::Local {
                tunnel_agent_bin: args.tunnel_agent_bin.clone(),
            },
            AddOnRuntimeKind::Kube => AddOnRuntimeConfig::Kube {
                image: args.addon_image.clone(),
            },
        },
        addon_apiserver: args.addon_apiserver.clone(),
        addon_lease_seconds: args.addon_lease_seconds,
        addon_resync: args.addon_resync,
    };
    tether_runtime::actix_system(args.worker_threads).block_on(async move {
        let _telemetry = tether_telemetry::init_tracing("registration-agent");
        tracing::info!(aead = %aead, "TLS record encryption");
        let shutdown = tether_runtime::shutdown_token();
        let listeners = service::bind(args.admin_listen.as_deref()).await?;
        service::run(cfg, listeners, shutdown).await?;
        anyhow::Ok(())
    })
}
