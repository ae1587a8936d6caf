//! The registration-agent's service skeleton: [`bind`] → [`run`] → drain (see "Service
//! skeleton" in `docs/architecture.md`).
//!
//! [`run`] starts one registration loop per cluster (several only when simulating a fleet for
//! load runs), the add-on agents once joined, and the readiness follower, all as tasks of one
//! [`Drain`]; on shutdown every task sees its token and the drain waits for them (add-on agents
//! stop their processes) up to [`SHUTDOWN_DEADLINE`].

use std::path::PathBuf;
use std::time::Duration;

use tether_runtime::Drain;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::addon::runtime::{KubeRuntime, LocalRuntime};
use crate::addon::{AddOnAgent, AddOnSettings};
use crate::agent::{Agent, AgentConfig, Phase};
use crate::metrics::{AddOnMetrics, AgentMetrics};
use crate::secret::{FileSecretStore, HubSecretStore, KubeSecretStore};

/// How long shutdown waits for the registration loops and add-on agents (which stop their
/// tunnel-agent processes) before the process exits anyway.
pub const SHUTDOWN_DEADLINE: Duration = Duration::from_secs(5);

/// Where the hub credentials are kept.
#[derive(Debug, Clone)]
pub enum SecretStoreConfig {
    /// A directory with one file per key.
    File,
    /// A Kubernetes Secret (in-cluster or $KUBECONFIG credentials).
    Kube { namespace: String, name: String },
}

/// How add-on agents run.
#[derive(Debug, Clone)]
pub enum AddOnRuntimeConfig {
    /// A supervised tunnel-agent child process (`None`: the binary next to this one).
    Local { tunnel_agent_bin: Option<PathBuf> },
    /// A Deployment + Secret in the add-on's install namespace, with this image.
    Kube { image: String },
}

/// Everything [`run`] needs besides its listeners.
#[derive(Debug, Clone)]
pub struct ServiceConfig {
    pub agent: AgentConfig,
    /// Directory of the hub credentials.
    pub hub_kubeconfig_dir: PathBuf,
    pub secret_store: SecretStoreConfig,
    /// Load testing: N simulated clusters `<cluster>-<i>` with file stores under
    /// `<hub_kubeconfig_dir>/<name>`; 0 = the one real cluster.
    pub simulate: usize,
    /// Add-on agents to run once joined (validated DNS labels).
    pub addons: Vec<String>,
    /// Base directory of add-on credentials and agent configs.
    pub addon_dir: PathBuf,
    pub addon_runtime: AddOnRuntimeConfig,
    pub addon_apiserver: String,
    pub addon_lease_seconds: u32,
    pub addon_resync: Duration,
}

/// Why the registration-agent could not start; each names what failed.
#[derive(Debug, thiserror::Error)]
pub enum ServiceError {
    #[error("metrics: {0}")]
    Metrics(#[from] prometheus::Error),
    #[error("cannot bind admin listen {listen}: {source}")]
    Bind {
        listen: String,
        source: std::io::Error,
    },
    #[error("connecting to the managed cluster's API server for {what}: {source}")]
    Kube {
        what: &'static str,
        source: kube::Error,
    },
    #[error("--addon {0:?} is not a DNS-1123 label")]
    AddOnName(String),
}

/// The bound listeners of the registration-agent.
pub struct Listeners {
    /// `/healthz`, `/readyz`, `/metrics` (optional).
    pub admin: Option<TcpListener>,
}

/// Binds the listeners `admin_listen` names.
pub async fn bind(admin_listen: Option<&str>) -> Result<Listeners, ServiceError> {
    let admin = match admin_listen {
        Some(listen) => {
            Some(
                TcpListener::bind(listen)
                    .await
                    .map_err(|source| ServiceError::Bind {
                        listen: listen.to_owned(),
                        source,
                    })?,
            )
        }
        None => None,
    };
    Ok(Listeners { admin })
}

async fn kube_client(what: &'static str) -> Result<kube::Client, ServiceError> {
    kube::Client::try_default()
        .await
        .map_err(|source| ServiceError::Kube { what, source })
}

/// Runs the registration-agent until `shutdown`, then drains; call inside an actix `System`.
pub async fn run(
    cfg: ServiceConfig,
    listeners: Listeners,
    shutdown: CancellationToken,
) -> Result<(), ServiceError> {
    for addon in &cfg.addons {
        if !tether_pki::subject::is_dns_label(addon) {
            return Err(ServiceError::AddOnName(addon.clone()));
        }
    }
    let tasks = Drain::new("registration-agent");
    let registry = prometheus::Registry::new();
    let metrics = AgentMetrics::register(&registry)?;
    let readiness = tether_telemetry::Readiness::new();
    if let Some(l) = listeners.admin {
        if let Ok(a) = l.local_addr() {
            tracing::info!(admin = %a, "admin server listening");
        }
        let server = tether_telemetry::AdminServer::new(registry.clone(), readiness.clone());
        tasks.spawn("admin server", server.serve(l, shutdown.child_token()));
    }
    let addon_metrics = if cfg.addons.is_empty() {
        None
    } else {
        Some(AddOnMetrics::register(&registry)?)
    };
    if cfg.simulate > 0 {
        for i in 0..cfg.simulate {
            let name = format!("{}-{i}", cfg.agent.cluster_name);
            let mut c = cfg.agent.clone();
            c.cluster_name = name.clone();
            let store = FileSecretStore::new(cfg.hub_kubeconfig_dir.join(&name));
            let (agent, _phase) = Agent::new(c, store, metrics.clone());
            tasks.spawn("registration", agent.run(shutdown.child_token()));
            // Spread the start so the hub sees a ramp, not a thundering herd.
            tokio::time::sleep(Duration::from_millis(rand::random_range(1..10))).await;
        }
    } else {
        let (phase, session) = match &cfg.secret_store {
            SecretStoreConfig::File => {
                let store = FileSecretStore::new(cfg.hub_kubeconfig_dir.clone());
                start_agent(&tasks, &cfg.agent, store, &metrics, &shutdown)
            }
            SecretStoreConfig::Kube { namespace, name } => {
                let client = kube_client("--secret-store kube").await?;
                let store = KubeSecretStore::new(client, namespace, name);
                start_agent(&tasks, &cfg.agent, store, &metrics, &shutdown)
            }
        };
        for addon in &cfg.addons {
            let mut s = AddOnSettings::new(addon, &cfg.agent.cluster_name, &cfg.addon_dir);
            s.apiserver = cfg.addon_apiserver.clone();
            s.lease_seconds = cfg.addon_lease_seconds.max(1);
            s.resync = cfg.addon_resync;
            let m = addon_metrics
                .clone()
                .expect("registered when add-ons are set");
            let stop = shutdown.child_token();
            let rx = session.clone();
            match &cfg.addon_runtime {
                AddOnRuntimeConfig::Local { tunnel_agent_bin } => {
                    let rt = LocalRuntime::new(
                        tunnel_agent_bin
                            .clone()
                            .unwrap_or_else(LocalRuntime::default_binary),
                        s.runtime_dir.clone(),
                        addon,
                        m.agent_restarts_total.with_label_values(&[addon.as_str()]),
                    );
                    tasks.spawn("add-on agent", AddOnAgent::new(s, rt, m).run(rx, stop));
                }
                AddOnRuntimeConfig::Kube { image } => {
                    let client = kube_client("--addon-runtime kube").await?;
                    let rt = KubeRuntime::new(client, addon, image);
                    tasks.spawn("add-on agent", AddOnAgent::new(s, rt, m).run(rx, stop));
                }
            }
        }
        tasks.spawn(
            "readiness",
            follow_phase(phase, readiness, shutdown.child_token()),
        );
    }
    shutdown.cancelled().await;
    tracing::info!("shutting down");
    tasks.finish(SHUTDOWN_DEADLINE).await;
    Ok(())
}

/// Starts one cluster's registration loop as a task of `tasks`; returns its phase and session.
fn start_agent<S: HubSecretStore>(
    tasks: &Drain,
    cfg: &AgentConfig,
    store: S,
    metrics: &AgentMetrics,
    shutdown: &CancellationToken,
) -> (
    tokio::sync::watch::Receiver<Phase>,
    tokio::sync::watch::Receiver<crate::agent::HubSession>,
) {
    let (agent, phase) = Agent::new(cfg.clone(), store, metrics.clone());
    let session = agent.session();
    tasks.spawn("registration", agent.run(shutdown.child_token()));
    (phase, session)
}

/// Ready while joined.
async fn follow_phase(
    mut rx: tokio::sync::watch::Receiver<Phase>,
    ready: tether_telemetry::Readiness,
    stop: CancellationToken,
) {
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            r = rx.changed() => if r.is_err() { return },
        }
        match rx.borrow().clone() {
            Phase::Joined => ready.set_ready(),
            other => ready.set_not_ready(format!("{other:?}")),
        }
    }
}
