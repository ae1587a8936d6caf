//! The hub's addon-manager: the registration controller (OCM's hub registration controllers),
//! the add-on controller (ManagedClusterAddOns of every ClusterManagementAddOn, config hashes,
//! conditions) and the NATS auth callout.
//!
//! Layout:
//! - [`registration`]: the registration logic (accept, CSRs, leases) over the
//!   [`tether_control::store::Store`] trait and a clock, unit-tested on an in-memory store.
//! - [`hub`]: [`hub::HubCtx`], the NATS adapter around it (watch tasks, notifications, callout
//!   issuer).
//! - [`brokers`]: the live broker set (serving brokers, tunnel holders, `BrokersAvailable`).
//! - [`notify`]: notifications to managed clusters.
//! - [`controller`]: serves the registration request subjects (a bounded number in flight per
//!   subscription) and runs the leader-only lease monitor and CSR garbage collector.
//! - [`signing`]: the one place the hub CA signs (tokio's blocking pool).
//! - [`addon_cache`]: read caches of the add-on buckets for the per-agent request paths.
//! - [`addons`]: the [`addons::AddOnController`] actor: ManagedClusterAddOns from
//!   ClusterManagementAddOn install strategies, config spec hashes, Progressing/Available/Degraded.
//! - [`delivery`]: what an add-on agent runs (`…addon.<a>.config`), its credentials
//!   (`…addon.<a>.csr[.get]`), and `AddOnConfigChanged` notifications when the broker set changes.
//! - [`callout`]: who may connect to NATS with what permissions.
//! - [`clients`]: hub client credentials (`tether.v1.admin.client.create|delete`).
//! - [`metrics`]: Prometheus metrics.
//!
//! [`run`] wires it together: connect as `tether-hub`, open the JetStream store, import
//! bootstrap tokens, start the actor and the admin server, and wait for shutdown.
#![forbid(unsafe_code)]

pub mod addon_cache;
pub mod addons;
pub mod brokers;
pub mod callout;
pub mod clients;
pub mod controller;
pub mod delivery;
pub mod hub;
pub mod metrics;
pub mod notify;
pub mod registration;
pub mod serve;
pub mod signing;

use std::path::PathBuf;
use std::sync::Arc;

use tether_control::connect::{self, ConnectConfig, Credentials};
use tether_control::hub::{HUB_USER, HubDir};
use tether_control::resources::BootstrapTokenRecord;
use tether_control::store::Store as _;
use tether_control::store::{Bucket, HubStore, Replicas};
use tokio_util::sync::CancellationToken;

/// Why the hub controller could not start or stopped; each names what failed.
#[derive(Debug, thiserror::Error)]
pub enum ManagerError {
    #[error("hub directory: {0}")]
    HubDir(#[from] tether_control::hub::HubDirError),
    #[error("hub NATS: {0}")]
    Control(#[from] tether_control::ControlError),
    #[error("hub state: {0}")]
    Hub(#[from] hub::HubError),
    #[error("hub CA: {0}")]
    Ca(#[from] tether_pki::PkiError),
    #[error("auth callout issuer: {0}")]
    Callout(#[from] tether_control::auth::AuthError),
    #[error("metrics: {0}")]
    Metrics(#[from] prometheus::Error),
    #[error("cannot parse {path}: {source}")]
    Parse {
        path: PathBuf,
        source: serde_json::Error,
    },
    #[error("{what}: {source}")]
    Io {
        what: String,
        source: std::io::Error,
    },
    #[error("cannot subscribe to {subject}: {reason}")]
    Subscribe { subject: String, reason: String },
    #[error("shut down while connecting to NATS or opening the hub store")]
    ShutDown,
}

/// Key of the registration controllers' leader lease in `tether-leaders`.
pub const REGISTRATION_LEADER: &str = "registration";

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .unwrap_or_else(|_| "unknown-host".into())
}

/// Process options that are not in hub.yaml.
#[derive(Clone, Default)]
pub struct RunOptions {
    pub nats_url: Option<String>,
    /// Set ready once connected, the store open and every subject served (the admin server's
    /// `/readyz`; `main` writes its ready file from it).
    pub readiness: tether_telemetry::Readiness,
}

/// The bound listeners of the addon-manager.
pub struct Listeners {
    /// `/healthz`, `/readyz`, `/metrics` (optional).
    pub admin: Option<tokio::net::TcpListener>,
}

/// Binds the listeners `admin_listen` names.
pub async fn bind(admin_listen: Option<&str>) -> Result<Listeners, ManagerError> {
    let admin =
        match admin_listen {
            Some(listen) => Some(tokio::net::TcpListener::bind(listen).await.map_err(
                |source| ManagerError::Io {
                    what: format!("cannot bind admin listen {listen}"),
                    source,
                },
            )?),
            None => None,
        };
    Ok(Listeners { admin })
}

/// How long shutdown waits for the subject pumps, watches and the leader election (which
/// releases its lease for an instant failover) before the process exits anyway.
pub const SHUTDOWN_DEADLINE: std::time::Duration = std::time::Duration::from_secs(3);

/// Runs `attempt` until it succeeds or shutdown, with jittered backoff (at most 5 s apart),
/// logging each failure with `what`.
async fn retry<T, E, F, Fut>(
    what: &'static str,
    shutdown: &CancellationToken,
    attempt: F,
) -> Result<T, ManagerError>
where
    E: std::fmt::Display,
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, E>>,
{
    let config = tether_runtime::BackoffConfig {
        max: std::time::Duration::from_secs(5),
        ..Default::default()
    };
    tether_runtime::retry(what, config, shutdown, |_| true, |_| {}, attempt)
        .await
        .map_err(|_| ManagerError::ShutDown)
}

/// Runs the hub controller until `shutdown` is cancelled. Must run inside an actix System.
pub async fn run(
    hub: HubDir,
    opts: RunOptions,
    listeners: Listeners,
    shutdown: CancellationToken,
) -> Result<(), ManagerError> {
    let tasks = tether_runtime::Drain::new("addon-manager");
    let endpoint = hub.endpoint(opts.nats_url.as_deref())?;
    let password = hub.read(&hub.config.nats.hub_password_file)?;
    let cfg = ConnectConfig::new(
        endpoint,
        Credentials::HubUser {
            user: HUB_USER.into(),
            password: password.trim().to_string(),
        },
        "hub",
    );
    // NATS may start after us.
    let conn = retry("cannot connect to hub NATS", &shutdown, || {
        connect::connect(&cfg)
    })
    .await?;
    tracing::info!("connected to hub NATS");
    let replicas = hub
        .config
        .nats
        .replicas
        .unwrap_or_else(|| tether_control::store::default_replicas(&conn.client));
    // A NATS cluster that just started has no JetStream leader for a while.
    let store = retry("cannot open the hub store", &shutdown, || {
        HubStore::open_with(conn.client.clone(), Replicas::Exactly(replicas))
    })
    .await?;
    tracing::info!(replicas, "hub store open");

    // Import bootstrap tokens written by `tetherctl init` (existing records win).
    let tokens_text = hub.read(&hub.config.bootstrap_tokens_file)?;
    let tokens: Vec<BootstrapTokenRecord> =
        serde_json::from_str(&tokens_text).map_err(|source| ManagerError::Parse {
            path: hub.config.bootstrap_tokens_file.clone(),
            source,
        })?;
    // Right after a NATS node or the stream leader restarted, JetStream may answer 503 for a
    // while: every step that reads or writes hub state before the service is ready is retried
    // (each is idempotent: `create` keeps existing records, the watches spawn only once every
    // watch is open, loading the leases only fills the table).
    retry("cannot import the bootstrap tokens", &shutdown, || async {
        for t in &tokens {
            store.create(Bucket::Tokens, &t.id, t).await?;
        }
        Ok::<_, tether_control::ControlError>(())
    })
    .await?;

    let ca = tether_pki::HubCa::from_pem(
        &hub.read(&hub.config.ca.cert_file)?,
        &hub.read(&hub.config.ca.key_file)?,
    )?;
    let issuer = tether_control::auth::CalloutIssuer::from_seed(
        &hub.read(&hub.config.callout_issuer_seed_file)?,
    )?;
    let mut registry = prometheus::Registry::new();
    let metrics = metrics::Metrics::register(&mut registry)?;
    let ctx = Arc::new(hub::HubCtx::new(
        store,
        conn.client.clone(),
        ca,
        issuer,
        hub.config.registration.clone(),
        metrics,
    ));
    retry("cannot watch the hub state", &shutdown, || {
        ctx.start_watches(&tasks, &shutdown)
    })
    .await?;
    retry("cannot load the cluster leases", &shutdown, || {
        ctx.load_leases()
    })
    .await?;

    let readiness = opts.readiness.clone();
    let mut admin_addr = None;
    if let Some(listener) = listeners.admin {
        admin_addr = listener.local_addr().ok();
        let server = tether_telemetry::AdminServer::new(registry.clone(), readiness.clone());
        tasks.spawn(
            "admin server",
            server.serve(listener, shutdown.child_token()),
        );
    }

    // Several replicas may run: the periodic registration controllers run on the leader only.
    let (leader, leader_task) = tether_control::leader::spawn(
        ctx.store.clone(),
        tether_control::leader::LeaderConfig {
            name: REGISTRATION_LEADER.into(),
            holder: format!(
                "{}/{}/{}",
                hostname(),
                std::process::id(),
                tether_control::auth::new_connection_id()
            ),
            ttl: tether_control::leader::DEFAULT_LEADER_TTL,
        },
        shutdown.child_token(),
    );
    tasks.spawn("leader election", async move {
        let _ = leader_task.await;
    });
    {
        let (mut rx, gauge) = (leader.clone(), ctx.metrics.leader.clone());
        let stop = shutdown.child_token();
        tasks.spawn("leader gauge", async move {
            loop {
                gauge.set(i64::from(*rx.borrow_and_update()));
                tokio::select! {
                    _ = stop.cancelled() => return,
                    r = rx.changed() => if r.is_err() { return },
                }
            }
        });
    }
    tasks.spawn(
        "registration lease monitor and CSR GC",
        controller::run_periodic(ctx.clone(), leader, shutdown.child_token()),
    );
    let pumps =
        controller::start_pumps(conn.client.clone(), ctx.clone(), shutdown.child_token()).await?;
    let addon_ctl = addons::AddOnController::start_cached(
        ctx.store.clone(),
        Some(conn.client.clone()),
        ctx.addon_cache.clone(),
    );
    let mut addon_tasks = addons::start(
        conn.client.clone(),
        ctx.store.clone(),
        addon_ctl.clone(),
        ctx.addon_cache.clone(),
        shutdown.child_token(),
    )
    .await?;
    addon_tasks.extend(
        delivery::start(
            conn.client.clone(),
            ctx.clone(),
            addon_ctl,
            shutdown.child_token(),
        )
        .await?,
    );
    // Hub client credentials (tether.v1.admin.client.create|delete).
    let clients_ctx = Arc::new(clients::ClientsCtx {
        store: ctx.store.clone(),
        ca: Arc::clone(&ctx.ca),
    });
    addon_tasks
        .extend(clients::start(conn.client.clone(), clients_ctx, shutdown.child_token()).await?);
    // Subject pumps and watches end on their child tokens of `shutdown`.
    for p in pumps.into_iter().chain(addon_tasks) {
        tasks.spawn("subject pump or watch", async move {
            let _ = p.await;
        });
    }
    readiness.set_ready();
    tracing::info!(admin = ?admin_addr, "addon-manager ready");
    shutdown.cancelled().await;
    tracing::info!("shutting down");
    readiness.set_not_ready("shutting down");
    // The election task releases the leader lease on shutdown (instant failover).
    tasks.finish(SHUTDOWN_DEADLINE).await;
    // NATS may already be gone: never wait long for the final flush.
    let _ = tokio::time::timeout(std::time::Duration::from_secs(2), conn.client.flush()).await;
    Ok(())
}
