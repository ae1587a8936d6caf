//! health-prober: probes every managed cluster through the tunnels and publishes health.
//!
//! Layout:
//! - [`config`]: YAML config.
//! - [`probe`]: one cluster's prober, reusing its tunnelled connection across rounds.
//! - [`health`]: the damped health table.
//! - [`engine`]: the scheduler actor (rounds, bounded concurrency, overrun accounting).
//! - [`metrics`]: Prometheus metrics.
//!
//! - [`nats`]: on hub NATS, the cluster list from ManagedClusters, results to KV
//!   `tether-health`, transitions to events, `tether.v1.health.get` answered from memory.
//!
//! Results are served on the admin listener at `/debug/health` (JSON).

#![forbid(unsafe_code)]

pub mod config;
pub mod engine;
pub mod health;
pub mod metrics;
pub mod nats;
pub mod probe;

use std::sync::Arc;

use actix::prelude::*;
use prometheus::Registry;
use tether_client::{ClientCert, Dialer, DialerConfig, Token};
use tether_telemetry::{AdminServer, Readiness};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::config::ProberConfig;
use crate::engine::Scheduler;
use crate::health::{Damping, HealthTable};
use crate::metrics::ProberMetrics;
use crate::probe::{ProbeContext, UnverifiedProbeTls};

#[derive(Debug, thiserror::Error)]
pub enum ProberError {
    #[error("cannot read {path}: {source}")]
    Read {
        path: std::path::PathBuf,
        source: std::io::Error,
    },
    #[error("broker: {0}")]
    Broker(#[from] tether_client::ClientError),
    #[error("TLS: {0}")]
    Tls(#[from] tether_tls::TlsError),
    #[error("metrics: {0}")]
    Metrics(#[from] prometheus::Error),
    #[error("hub NATS: {0}")]
    Nats(String),
}

pub(crate) fn read(path: &std::path::Path) -> Result<String, ProberError> {
    std::fs::read_to_string(path).map_err(|source| ProberError::Read {
        path: path.to_owned(),
        source,
    })
}

/// How long shutdown waits for the NATS tasks (last results published) and the admin server.
pub const SHUTDOWN_DEADLINE: std::time::Duration = std::time::Duration::from_secs(3);

/// Runs the prober until `shutdown`, then drains; call inside an actix `System`.
pub async fn run(
    cfg: ProberConfig,
    admin: TcpListener,
    shutdown: CancellationToken,
) -> Result<(), ProberError> {
    let tasks = tether_runtime::Drain::new("health-prober");
    let registry = Registry::new();
    let metrics = ProberMetrics::new(&registry)?;
    let b = &cfg.broker;
    let client_cert = match (&b.cert, &b.key) {
        (Some(c), Some(k)) => Some(ClientCert {
            cert_pem: read(c)?,
            key_pem: read(k)?,
        }),
        _ => None,
    };
    let token = match &b.token_file {
        Some(p) => Some(Token(read(p)?.trim().to_owned())),
        None => None,
    };
    let dialer = Dialer::connect(DialerConfig {
        endpoint: b.endpoint.clone(),
        server_name: b.server_name.clone(),
        ca_pem: read(&b.ca)?,
        client_cert,
        token,
        connect_timeout: cfg.timeout,
    })
    .await?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let (tls, tls_verified) = match &cfg.apiserver_ca {
        Some(ca) => {
            let roots = tether_tls::reload::load_roots(ca)?;
            (
                rustls::ClientConfig::builder()
                    .with_root_certificates(roots)
                    .with_no_client_auth(),
                true,
            )
        }
        None => (
            rustls::ClientConfig::builder()
                .dangerous()
                .with_custom_certificate_verifier(Arc::new(UnverifiedProbeTls(provider)))
                .with_no_client_auth(),
            false,
        ),
    };
    let ctx = Arc::new(ProbeContext {
        dialer,
        tls: Arc::new(tls),
        tls_verified,
        apiserver_name: cfg.apiserver_server_name.clone(),
        connection_max_age: cfg.connection_max_age,
    });
    let table = HealthTable::default();
    let prober_id = cfg.prober_id.clone().unwrap_or_else(default_prober_id);
    // On NATS, connect first (a hub that is down is a start-up error with its reason).
    let nats_side = match &cfg.nats {
        Some(access) => {
            if !cfg.clusters.is_empty() {
                tracing::warn!(
                    ignored = cfg.clusters.len(),
                    "`clusters` is ignored with `nats`: the hub's accepted clusters are probed"
                );
            }
            let conn = nats::connect_hub(access).await?;
            Some(nats::NatsSide::open(conn).await?)
        }
        None => None,
    };
    let mut scheduler = Scheduler::new(
        ctx,
        if nats_side.is_some() {
            Vec::new()
        } else {
            cfg.clusters.clone()
        },
        cfg.targets.clone(),
        cfg.interval,
        cfg.timeout,
        cfg.concurrency,
        Damping {
            failure_threshold: cfg.failure_threshold,
            success_threshold: cfg.success_threshold,
        },
        table.clone(),
        metrics.clone(),
    );
    let results = match nats_side {
        Some(_) => {
            let (tx, rx) = tokio::sync::mpsc::channel(engine::PUBLISH_QUEUE);
            scheduler = scheduler.with_publisher(tx);
            Some(rx)
        }
        None => None,
    };
    let scheduler = Scheduler::start_in_arbiter(&Arbiter::current(), move |_| scheduler);
    if let (Some(side), Some(rx)) = (nats_side, results) {
        side.spawn(
            &tasks,
            scheduler,
            table.clone(),
            rx,
            prober_id.clone(),
            cfg.interval,
            metrics,
            shutdown.clone(),
        );
    }
    let readiness = Readiness::new();
    readiness.set_ready();
    let admin_server = AdminServer::new(registry, readiness)
        .with_json_route("/debug/health", move || {
            serde_json::to_string(&table.snapshot()).unwrap_or_default()
        });
    tracing::info!(
        prober = %prober_id,
        nats = cfg.nats.is_some(),
        clusters = cfg.clusters.len(),
        interval = ?cfg.interval,
        "health-prober started"
    );
    tasks.spawn("admin server", admin_server.serve(admin, shutdown.clone()));
    shutdown.cancelled().await;
    tasks.finish(SHUTDOWN_DEADLINE).await;
    Ok(())
}

fn default_prober_id() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .unwrap_or_else(|_| "prober".into());
    format!("health-prober/{host}/{}", std::process::id())
}
