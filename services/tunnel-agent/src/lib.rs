//! tunnel-agent: runs in a managed cluster, keeps a tunnel to every broker endpoint and dials
//! targets inside the cluster for each stream a broker opens.
//!
//! Layout:
//! - [`config`]: the YAML config, validated with errors naming the field.
//! - [`connector`]: one supervised actix actor per broker endpoint (reconnect, backoff, drain).
//! - [`tunnel`]: one tunnel connection: TLS client + HTTP/2 server, request handlers, dialling.
//! - [`metrics`]: Prometheus metrics.
//!
//! [`run`] is what `main` calls, and what tests call in-process.

#![forbid(unsafe_code)]

pub mod config;
pub mod connector;
pub mod metrics;
pub mod tunnel;

use std::sync::Arc;

use actix::prelude::*;
use prometheus::Registry;
use tether_runtime::Backoff;
use tether_telemetry::{AdminServer, Readiness};
use tether_tls::TlsMaterial;
use tether_tunnel::pump::ByteCounters;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::config::AgentConfig;
use crate::connector::{Connector, EndpointStates};
use crate::metrics::AgentMetrics;
use crate::tunnel::AgentShared;

#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    #[error("TLS material: {0}")]
    Tls(#[from] tether_tls::TlsError),
    #[error("certificate identity: {0}")]
    Identity(#[from] tether_tls::IdentityError),
    #[error("the agent certificate names {found}, not the tunnel agent of cluster {configured}")]
    WrongCertificate { found: String, configured: String },
    #[error("metrics: {0}")]
    Metrics(#[from] prometheus::Error),
    #[error("proxy settings: {0}")]
    Proxy(tether_config::ConfigError),
}

/// Runs the agent until `shutdown`; must be called inside an actix `System` on a tokio runtime.
pub async fn run(
    cfg: AgentConfig,
    admin: TcpListener,
    shutdown: CancellationToken,
) -> Result<(), AgentError> {
    let registry = Registry::new();
    let tls = TlsMaterial::load(cfg.tls.clone())?;
    tls.register(&registry)?;
    let identity = tether_tls::Identity::from_certificate(&tls.certificate())?;
    if identity.cluster() != Some(cfg.cluster.as_str()) {
        // Not fatal: the broker refuses it and says why; but say it here first, clearly.
        tracing::error!(
            certificate = %identity,
            configured = %cfg.cluster,
            "agent certificate does not belong to the configured cluster; brokers will refuse it"
        );
    }
    tls.spawn_watcher(cfg.tls_reload_interval, shutdown.child_token());
    let metrics = AgentMetrics::new(&registry)?;
    let counters = ByteCounters {
        to_tunnel: Some(metrics.counter("from_target")),
        from_tunnel: Some(metrics.counter("to_target")),
    };
    let agent = cfg.agent_name();
    let proxy = cfg.proxy_settings().map_err(AgentError::Proxy)?;
    let proxy_ca = cfg
        .proxy
        .as_ref()
        .and_then(|p| p.ca_bundle.clone())
        .unwrap_or_else(|| cfg.tls.ca.clone());
    let proxy_roots = Arc::new(tether_tls::reload::load_roots(&proxy_ca)?);
    if !proxy.is_empty() {
        tracing::info!(
            ?proxy,
            "brokers are reached through a forward proxy unless NO_PROXY exempts them"
        );
    }
    let shared = Arc::new(AgentShared {
        cluster: cfg.cluster.clone(),
        agent: agent.clone(),
        apiserver: cfg.apiserver.clone(),
        policy: cfg.policy.clone(),
        max_dial_timeout: cfg.max_dial_timeout,
        settings: cfg.tunnel.clone(),
        metrics,
        counters,
        proxy,
        proxy_roots,
    });
    let readiness = Readiness::new();
    let states = EndpointStates::new(cfg.brokers.iter().map(|b| b.label()), readiness.clone());
    let arbiter = Arbiter::current();
    let mut connectors = Vec::new();
    for endpoint in &cfg.brokers {
        let c = Connector {
            endpoint: endpoint.clone(),
            shared: Arc::clone(&shared),
            tls: Arc::clone(&tls),
            backoff: Backoff::new((&cfg.backoff).into()),
            states: states.clone(),
            shutdown: shutdown.child_token(),
            grace: cfg.shutdown_grace,
            index: 0,
            generation: 0,
            avoid: Default::default(),
            established: Default::default(),
        };
        connectors.push(Supervisor::start_in_arbiter(&arbiter, move |_| c));
    }
    tracing::info!(cluster = %cfg.cluster, %agent, endpoints = cfg.brokers.len(), "tunnel-agent started");
    let states_dbg = states.clone();
    let admin_server = AdminServer::new(registry, readiness)
        .with_json_route("/debug/tunnels", move || {
            serde_json::to_string(&states_dbg.snapshot()).unwrap_or_default()
        });
    let admin_task = tokio::spawn(admin_server.serve(admin, shutdown.child_token()));
    shutdown.cancelled().await;
    tracing::info!(grace = ?cfg.shutdown_grace, "shutting down: draining tunnels");
    // Tunnels see the cancellation through their child tokens and drain within the grace.
    let deadline = tokio::time::Instant::now() + cfg.shutdown_grace;
    while shared.metrics.open_streams.get() > 0 && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    admin_task.abort();
    drop(connectors);
    Ok(())
}
