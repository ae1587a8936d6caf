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
use tether_runtime::RetryError;
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
    #[error("hub NATS refused the prober: {0}")]
    NatsRefused(String),
}

pub(crate) fn read(path: &std::path::Path) -> Result<String, ProberError> {
    std::fs::read_to_string(path).map_err(|source| ProberError::Read {
        path: path.to_owned(),
        source,
    })
}

/// How long shutdown waits for the NATS tasks (last results published) and the admin server.
pub const SHUTDOWN_DEADLINE: std::time::Duration = std::time::Duration::from_secs(3);

/// Longest pause between two attempts to reach the broker or hub NATS at start-up.
pub const START_RETRY_MAX: std::time::Duration = std::time::Duration::from_secs(5);

/// Runs the prober until `shutdown`, then drains; call inside an actix `System`.
///
/// The admin server answers at once; `/readyz` says what the prober is waiting for until the
/// broker and (with `nats`) hub NATS are reached. Both are retried with jittered backoff, so a
/// prober that starts before them waits instead of exiting. Configuration errors (a file that
/// cannot be read, an invalid endpoint, CA or token) end the process with their reason.
pub async fn run(
    cfg: ProberConfig,
    admin: TcpListener,
    shutdown: CancellationToken,
) -> Result<(), ProberError> {
    let tasks = tether_runtime::Drain::new("health-prober");
    let registry = Registry::new();
    let metrics = ProberMetrics::new(&registry)?;
    let table = HealthTable::default();
    let readiness = Readiness::new();
    let admin_server =
        AdminServer::new(registry, readiness.clone()).with_json_route("/debug/health", {
            let table = table.clone();
            move || serde_json::to_string(&table.snapshot()).unwrap_or_default()
        });
    // Stopped early when start-up fails.
    let admin_stop = shutdown.child_token();
    tasks.spawn(
        "admin server",
        admin_server.serve(admin, admin_stop.clone()),
    );
    let started = start(&cfg, &tasks, table, metrics, &readiness, &shutdown).await;
    match started {
        Ok(()) | Err(RetryError::ShutDown) => shutdown.cancelled().await,
        Err(RetryError::Fatal(_)) => admin_stop.cancel(),
    }
    tasks.finish(SHUTDOWN_DEADLINE).await;
    match started {
        Err(RetryError::Fatal(e)) => Err(e),
        _ => Ok(()),
    }
}

/// Connects to the broker and hub NATS (retrying while they are unreachable), starts the
/// scheduler and the NATS tasks, and marks the prober ready.
async fn start(
    cfg: &ProberConfig,
    tasks: &tether_runtime::Drain,
    table: HealthTable,
    metrics: ProberMetrics,
    readiness: &Readiness,
    shutdown: &CancellationToken,
) -> Result<(), RetryError<ProberError>> {
    let fatal = RetryError::Fatal;
    let backoff = tether_runtime::BackoffConfig {
        max: START_RETRY_MAX,
        ..Default::default()
    };
    let b = &cfg.broker;
    let client_cert = match (&b.cert, &b.key) {
        (Some(c), Some(k)) => Some(ClientCert {
            cert_pem: read(c).map_err(fatal)?,
            key_pem: read(k).map_err(fatal)?,
        }),
        _ => None,
    };
    let token = match &b.token_file {
        Some(p) => Some(Token(read(p).map_err(fatal)?.trim().to_owned())),
        None => None,
    };
    let dialer_cfg = DialerConfig {
        endpoint: b.endpoint.clone(),
        server_name: b.server_name.clone(),
        ca_pem: read(&b.ca).map_err(fatal)?,
        client_cert,
        token,
        connect_timeout: cfg.timeout,
    };
    let provider = tether_tls::crypto_provider();
    let builder = tether_tls::client_config_builder();
    let (tls, tls_verified) = match &cfg.apiserver_ca {
        Some(ca) => {
            let roots =
                tether_tls::reload::load_roots(ca).map_err(|e| fatal(ProberError::from(e)))?;
            (
                builder.with_root_certificates(roots).with_no_client_auth(),
                true,
            )
        }
        None => (
            builder
                .dangerous()
                .with_custom_certificate_verifier(Arc::new(UnverifiedProbeTls(provider)))
                .with_no_client_auth(),
            false,
        ),
    };
    let nats_cfg = match &cfg.nats {
        Some(access) => {
            if !cfg.clusters.is_empty() {
                tracing::warn!(
                    ignored = cfg.clusters.len(),
                    "`clusters` is ignored with `nats`: the hub's accepted clusters are probed"
                );
            }
            Some(nats::hub_connect_config(access).map_err(fatal)?)
        }
        None => None,
    };

    // The broker: only an unreachable one is waited for (a bad endpoint or token is not). A
    // certificate not accepted is waited for too: during a CA rotation the broker may present
    // its new certificate before the prober's CA bundle has it.
    readiness.set_not_ready("connecting to the broker");
    let dialer = tether_runtime::retry(
        "cannot connect to the broker",
        backoff,
        shutdown,
        |e| {
            use tether_client::ClientError as E;
            matches!(e, E::Connect(_) | E::Unreachable(_) | E::Certificate(_))
        },
        |e| readiness.set_not_ready(format!("connecting to the broker: {e}")),
        || Dialer::connect(dialer_cfg.clone()),
    )
    .await
    .map_err(|e| match e {
        RetryError::Fatal(e) => fatal(ProberError::Broker(e)),
        RetryError::ShutDown => RetryError::ShutDown,
    })?;
    tracing::info!(endpoint = %b.endpoint, "connected to the broker");
    let ctx = Arc::new(ProbeContext {
        dialer,
        tls: Arc::new(tls),
        tls_verified,
        apiserver_name: cfg.apiserver_server_name.clone(),
        connection_max_age: cfg.connection_max_age,
    });

    // Hub NATS: an unreachable server, or JetStream without a leader yet, is waited for.
    let nats_side = match &nats_cfg {
        Some(connect_cfg) => {
            readiness.set_not_ready("connecting to hub NATS");
            let side = tether_runtime::retry(
                "cannot reach hub NATS",
                backoff,
                shutdown,
                nats::transient,
                |e| readiness.set_not_ready(format!("connecting to hub NATS: {e}")),
                || async { nats::NatsSide::open(nats::connect_hub(connect_cfg).await?).await },
            )
            .await?;
            tracing::info!("connected to hub NATS");
            Some(side)
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
    let prober_id = cfg.prober_id.clone().unwrap_or_else(default_prober_id);
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
            tasks,
            scheduler,
            table,
            rx,
            prober_id.clone(),
            cfg.interval,
            metrics,
            shutdown.clone(),
        );
    }
    readiness.set_ready();
    tracing::info!(
        prober = %prober_id,
        nats = cfg.nats.is_some(),
        clusters = cfg.clusters.len(),
        interval = ?cfg.interval,
        "health-prober started"
    );
    Ok(())
}

fn default_prober_id() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .unwrap_or_else(|_| "prober".into());
    format!("health-prober/{host}/{}", std::process::id())
}
