//! Add-on agents on the managed cluster (OCM's klusterlet add-on side), started once the
//! cluster has joined.
//!
//! For one add-on (`cluster-proxy`), [`AddOnAgent::run`]:
//! 1. fetches the desired config on `tether.v1.cluster.<c>.addon.<a>.config` — at start, on an
//!    `AddOnConfigChanged` notification, and every `resync` as a safety net;
//! 2. makes sure the add-on credentials exist ([`credentials`]: key kept across restarts, CSR
//!    with OCM's add-on subject, `<addon>-hub-kubeconfig` with kubeconfig/tls.crt/tls.key/
//!    cluster-name inheriting server, CA and proxy-url), rotating them before expiry;
//! 3. renders the tunnel-agent config ([`render`]) and applies it through the
//!    [`runtime::AddOnRuntime`] (a supervised local process, or a Kubernetes Deployment);
//! 4. once the agent runs that config (its `configSha256`), reports the applied config hashes on
//!    `…addon.<a>.status`, and renews the add-on lease on `…addon.<a>.lease` with the ids of the
//!    brokers the agent holds a tunnel to (at once whenever that set changes);
//! 5. when the hub says `installed: false`, or the cluster's credentials are revoked (denied,
//!    cluster deleted): stops the agent and deletes its credentials and config.

pub mod credentials;
pub mod kube;
pub mod render;
pub mod runtime;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use futures::StreamExt;
use tether_control::addons::{
    AddOnAgentConfigReply, AddOnAgentConfigRequest, AddOnLeaseRenew, AddOnLeaseReply, AddOnNotify,
    AddOnStatusReport, AppliedConfig, NOTIFY_ADDON_CONFIG_CHANGED,
};
use tether_control::connect;
use tether_control::kubeconfig::HubEndpoint;
use tether_control::subjects;
use tether_pki::CertInfo;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::agent::HubSession;
use crate::metrics::AddOnMetrics;
use crate::secret::{FileSecretStore, HubSecretStore};
use render::RenderSettings;
use runtime::AddOnRuntime;

/// Why one sync of the add-on (fetch the config, check or renew credentials, apply) failed.
#[derive(Debug, thiserror::Error)]
pub enum SyncError {
    #[error(transparent)]
    Request(#[from] tether_control::ControlError),
    #[error("the hub's reply has no config")]
    NoConfig,
    #[error(transparent)]
    Secret(#[from] crate::secret::SecretError),
    #[error(transparent)]
    Credentials(#[from] credentials::CredentialError),
    #[error(transparent)]
    Render(#[from] render::RenderError),
    #[error(transparent)]
    Runtime(#[from] runtime::RuntimeError),
}

/// First retry of a failed add-on lease renewal (then doubling, jittered, up to the interval).
pub const LEASE_RETRY_INITIAL: Duration = Duration::from_millis(500);
/// How often the add-on loop looks at the running agent (applied hash, connected brokers,
/// certificate age).
pub const TICK: Duration = Duration::from_millis(500);
/// Up to this random delay between an `AddOnConfigChanged` notification and the fetch.
pub const NOTIFY_SPREAD: Duration = Duration::from_millis(250);
/// Rotation starts when less than a random fraction in this range of the certificate's life
/// is left (as the cluster's own certificate).
pub const ROTATION_FRACTION: (f64, f64) = (0.20, 0.25);

/// Settings of one add-on agent.
#[derive(Debug, Clone)]
pub struct AddOnSettings {
    pub addon: String,
    pub cluster: String,
    /// `<dir>/<addon>-hub-kubeconfig`: the add-on credentials.
    pub credentials_dir: PathBuf,
    /// `<dir>/<addon>-agent`: the rendered config, CA files, ready and PID files.
    pub runtime_dir: PathBuf,
    /// The cluster's API server as the tunnel-agent dials it.
    pub apiserver: String,
    /// Add-on lease duration (the hub: Available=False after 5 × this without renewal).
    pub lease_seconds: u32,
    /// Safety-net re-fetch of the desired config.
    pub resync: Duration,
}

impl AddOnSettings {
    /// Directories under `base` (made absolute), as OCM names the add-on secret.
    pub fn new(addon: &str, cluster: &str, base: &std::path::Path) -> Self {
        let base = std::path::absolute(base).unwrap_or_else(|_| base.to_path_buf());
        Self {
            addon: addon.into(),
            cluster: cluster.into(),
            credentials_dir: base.join(format!("{addon}-hub-kubeconfig")),
            runtime_dir: base.join(format!("{addon}-agent")),
            apiserver: "kubernetes.default.svc:443".into(),
            lease_seconds: 60,
            resync: Duration::from_secs(30),
        }
    }
}

/// What has been handed to the runtime.
struct Applied {
    sha256: String,
    hashes: Vec<AppliedConfig>,
    reported: bool,
}

enum Exit {
    Stop,
    Session,
}

/// One add-on agent's lifecycle on the cluster.
pub struct AddOnAgent<R: AddOnRuntime> {
    s: AddOnSettings,
    runtime: R,
    store: FileSecretStore,
    metrics: AddOnMetrics,
    applied: Option<Applied>,
    cert: Option<CertInfo>,
    rotation_fraction: f64,
    last_config_error: Option<String>,
}

/// The hub session changed since this pass began: a pass checks it before each hub request,
/// so a revoked cluster's agent is stopped within one request's timeout, not after every
/// request of the pass has timed out. (A gone sender is the agent stopping: `stop` ends it.)
fn session_moved(session: &watch::Receiver<HubSession>) -> bool {
    session.has_changed().unwrap_or(false)
}

fn jitter(d: Duration, factor: f64) -> Duration {
    d.mul_f64(1.0 + rand::random::<f64>() * factor)
}

fn rotation_fraction() -> f64 {
    ROTATION_FRACTION.0 + rand::random::<f64>() * (ROTATION_FRACTION.1 - ROTATION_FRACTION.0)
}

impl<R: AddOnRuntime> AddOnAgent<R> {
    pub fn new(s: AddOnSettings, runtime: R, metrics: AddOnMetrics) -> Self {
        let store = FileSecretStore::new(s.credentials_dir.clone());
        Self {
            s,
            runtime,
            store,
            metrics,
            applied: None,
            cert: None,
            rotation_fraction: rotation_fraction(),
            last_config_error: None,
        }
    }

    /// Runs until `stop`; then stops the agent (keeping credentials and config for a restart).
    pub async fn run(mut self, mut session: watch::Receiver<HubSession>, stop: CancellationToken) {
        let span = tracing::info_span!("addon", cluster = %self.s.cluster, addon = %self.s.addon);
        tracing::Instrument::instrument(
            async move {
                tracing::info!(runtime = %self.runtime.describe(), "add-on agent component started");
                loop {
                    let cur = session.borrow_and_update().clone();
                    match cur {
                        HubSession::Joined {
                            client,
                            endpoint,
                            agent,
                        } => match self
                            .joined(&client, &endpoint, &agent, &mut session, &stop)
                            .await
                        {
                            Exit::Stop => break,
                            Exit::Session => continue,
                        },
                        HubSession::Revoked(reason) => {
                            self.cleanup(&format!("cluster credentials revoked: {reason}"))
                                .await;
                        }
                        HubSession::Down => {}
                    }
                    tokio::select! {
                        _ = stop.cancelled() => break,
                        r = session.changed() => if r.is_err() {
                            stop.cancelled().await;
                            break;
                        },
                    }
                }
                self.runtime.stop(false).await;
                tracing::info!("add-on agent component stopped");
            },
            span,
        )
        .await
    }

    async fn joined(
        &mut self,
        client: &async_nats::Client,
        endpoint: &HubEndpoint,
        agent: &str,
        session: &mut watch::Receiver<HubSession>,
        stop: &CancellationToken,
    ) -> Exit {
        let cluster = self.s.cluster.clone();
        let mut notify = match client.subscribe(subjects::cluster_notify(&cluster)).await {
            Ok(s) => Some(s),
            Err(e) => {
                tracing::warn!(error = %e, "cannot subscribe to hub notifications; relying on the resync");
                None
            }
        };
        let mut backoff = tether_runtime::Backoff::new(tether_runtime::BackoffConfig {
            initial: Duration::from_millis(200),
            max: Duration::from_secs(10),
            ..Default::default()
        });
        let mut fetch_due = Instant::now();
        let mut lease_due: Option<Instant> = None;
        // A failed add-on lease renewal is retried soon (jittered, doubling up to the renewal
        // interval), not one whole interval later: the hub's grace is 5 intervals, and a NATS
        // failover (a silent server given up after ~3 pings) plus a hub-side JetStream blip
        // can cost two attempts in a row.
        let mut lease_backoff = tether_runtime::Backoff::new(tether_runtime::BackoffConfig {
            initial: LEASE_RETRY_INITIAL,
            max: Duration::from_secs(u64::from(self.s.lease_seconds.max(1))),
            ..Default::default()
        });
        let mut last_connected: Option<Vec<String>> = None;
        let mut tick = tokio::time::interval(TICK);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            let notified = async {
                match notify.as_mut() {
                    Some(s) => s.next().await,
                    None => std::future::pending().await,
                }
            };
            // Biased: a session change (the cluster's credentials revoked, a new bootstrap)
            // wins over the tick, which is always ready after a slow pass; unbiased, a pass of
            // timed-out hub requests (5 s each once the credentials are revoked) picked the tick
            // half the time and kept the revoked agent running for 30 s in a CI run.
            tokio::select! {
                biased;
                _ = stop.cancelled() => return Exit::Stop,
                _ = session.changed() => return Exit::Session,
                m = notified => {
                    if let Some(m) = m
                        && let Ok(n) = serde_json::from_slice::<AddOnNotify>(&m.payload)
                        && n.type_ == NOTIFY_ADDON_CONFIG_CHANGED
                        && n.addon == self.s.addon
                    {
                        tracing::debug!("hub notified a config change");
                        // A broker-set change notifies every cluster at once: spread the fetches.
                        fetch_due = fetch_due.min(
                            Instant::now() + NOTIFY_SPREAD.mul_f64(rand::random::<f64>()),
                        );
                    }
                }
                _ = tick.tick() => {}
            }
            let now = Instant::now();
            if now >= fetch_due {
                if session_moved(session) {
                    return Exit::Session;
                }
                match self.sync(client, endpoint, agent).await {
                    Ok(()) => {
                        backoff.succeeded();
                        fetch_due = now + jitter(self.s.resync, 0.2);
                    }
                    Err(e) => {
                        let d = backoff.failed();
                        tracing::warn!(error = %e, retry_in = ?d, "add-on sync failed");
                        fetch_due = now + d;
                    }
                }
            }
            if self.applied.is_none() {
                continue;
            }
            let observed = self.runtime.observe().await;
            let connected = observed
                .as_ref()
                .map(|o| o.connected_brokers.clone())
                .unwrap_or_default();
            if let Some(o) = &observed {
                if o.config_error != self.last_config_error {
                    if let Some(e) = &o.config_error {
                        tracing::warn!(error = %e, "the add-on agent refused its new config");
                    }
                    self.last_config_error = o.config_error.clone();
                }
                if let Some(a) = &mut self.applied
                    && !a.reported
                    && o.config_sha256 == a.sha256
                {
                    if session_moved(session) {
                        return Exit::Session;
                    }
                    let report = AddOnStatusReport {
                        applied_configs: a.hashes.clone(),
                    };
                    match connect::request_json::<_, serde_json::Value>(
                        client,
                        subjects::cluster_addon_status(&cluster, &self.s.addon),
                        &report,
                    )
                    .await
                    {
                        Ok(_) => {
                            a.reported = true;
                            lease_due = Some(Instant::now());
                            tracing::info!(
                                configs = a.hashes.len(),
                                "add-on agent runs the desired config; reported to the hub"
                            );
                        }
                        Err(e) => tracing::warn!(error = %e, "cannot report applied configs"),
                    }
                }
            }
            self.metrics
                .connected_brokers
                .with_label_values(&[&self.s.addon])
                .set(connected.len() as i64);
            if observed.is_some() && last_connected.as_ref() != Some(&connected) {
                tracing::info!(brokers = ?connected, "add-on agent tunnels changed");
                last_connected = Some(connected.clone());
                lease_due = Some(Instant::now());
            }
            if let Some(info) = &self.cert
                && info.remaining_fraction(std::time::SystemTime::now()) < self.rotation_fraction
            {
                match credentials::issue(
                    &self.store,
                    client,
                    &cluster,
                    &self.s.addon,
                    agent,
                    endpoint,
                    true,
                )
                .await
                {
                    Ok(i) => {
                        self.metrics
                            .certificates_total
                            .with_label_values(&[&self.s.addon, "rotation"])
                            .inc();
                        tracing::info!(not_after = %tether_control::resources::rfc3339(i.not_after), "add-on certificate rotated");
                        self.cert = Some(i);
                        self.rotation_fraction = rotation_fraction();
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "add-on certificate rotation failed; will retry")
                    }
                }
            }
            if observed.is_some()
                && self.applied.as_ref().is_some_and(|a| a.reported)
                && lease_due.is_some_and(|d| d <= Instant::now())
            {
                if session_moved(session) {
                    return Exit::Session;
                }
                let body = AddOnLeaseRenew {
                    holder_identity: agent.to_string(),
                    lease_duration_seconds: self.s.lease_seconds,
                    connected_brokers: connected.clone(),
                };
                let mut next = jitter(
                    Duration::from_secs(u64::from(self.s.lease_seconds.max(1))),
                    0.25,
                );
                match connect::request_json::<_, AddOnLeaseReply>(
                    client,
                    subjects::cluster_addon_lease(&cluster, &self.s.addon),
                    &body,
                )
                .await
                {
                    Ok(r) if r.accepted => {
                        lease_backoff.succeeded();
                        self.metrics
                            .lease_renewals_total
                            .with_label_values(&[&self.s.addon, "ok"])
                            .inc();
                    }
                    Ok(r) => {
                        self.metrics
                            .lease_renewals_total
                            .with_label_values(&[&self.s.addon, "refused"])
                            .inc();
                        tracing::info!(message = %r.message, "hub refused the add-on lease; re-reading the config");
                        fetch_due = Instant::now();
                    }
                    Err(e) => {
                        self.metrics
                            .lease_renewals_total
                            .with_label_values(&[&self.s.addon, "error"])
                            .inc();
                        next = next.min(lease_backoff.failed());
                        tracing::warn!(error = %e, retry_in = ?next, "add-on lease renewal failed");
                    }
                }
                lease_due = Some(Instant::now() + next);
            }
        }
    }

    /// Fetches the desired config and applies it.
    async fn sync(
        &mut self,
        client: &async_nats::Client,
        endpoint: &HubEndpoint,
        agent: &str,
    ) -> Result<(), SyncError> {
        let cluster = self.s.cluster.clone();
        let addon = self.s.addon.clone();
        let reply: AddOnAgentConfigReply = connect::request_json(
            client,
            subjects::cluster_addon_config(&cluster, &addon),
            &AddOnAgentConfigRequest {
                agent_name: agent.to_string(),
            },
        )
        .await?;
        if !reply.installed {
            self.cleanup(&format!("not installed: {}", reply.message))
                .await;
            return Ok(());
        }
        let desired = reply.config.ok_or(SyncError::NoConfig)?;
        let secret = self.store.load().await?;
        let info = match credentials::check(
            &secret,
            &cluster,
            &addon,
            agent,
            endpoint,
            &desired.hub_ca_bundle,
        ) {
            Ok(i) => i,
            Err(why) => {
                tracing::info!(reason = %why, "requesting add-on credentials");
                let i = credentials::issue(
                    &self.store,
                    client,
                    &cluster,
                    &addon,
                    agent,
                    endpoint,
                    false,
                )
                .await?;
                self.metrics
                    .certificates_total
                    .with_label_values(&[&addon, "new"])
                    .inc();
                tracing::info!(dir = %self.s.credentials_dir.display(), "add-on credentials written");
                i
            }
        };
        self.cert = Some(info);
        let rendered = render::render(
            &desired,
            agent,
            &RenderSettings {
                apiserver: self.s.apiserver.clone(),
                runtime_dir: self.s.runtime_dir.clone(),
                credentials_dir: self.s.credentials_dir.clone(),
            },
        )?;
        let changed = self
            .applied
            .as_ref()
            .is_none_or(|a| a.sha256 != rendered.sha256 || a.hashes != desired.config_hashes);
        if let Err(e) = self.runtime.apply(&rendered).await {
            self.metrics
                .config_applies_total
                .with_label_values(&[&addon, "error"])
                .inc();
            return Err(e.into());
        }
        if changed {
            self.metrics
                .config_applies_total
                .with_label_values(&[&addon, "ok"])
                .inc();
            let brokers: Vec<&str> = desired.brokers.iter().map(|b| b.id.as_str()).collect();
            tracing::info!(?brokers, sha256 = %rendered.sha256, "add-on agent config applied");
            self.applied = Some(Applied {
                sha256: rendered.sha256,
                hashes: desired.config_hashes,
                reported: false,
            });
        }
        Ok(())
    }

    /// Stops the agent and deletes its credentials and config.
    async fn cleanup(&mut self, why: &str) {
        let had = self.applied.is_some()
            || self.s.credentials_dir.exists()
            || self.s.runtime_dir.exists();
        self.runtime.stop(true).await;
        match std::fs::remove_dir_all(&self.s.credentials_dir) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => tracing::warn!(error = %e, "cannot remove the add-on credentials"),
        }
        self.applied = None;
        self.cert = None;
        if had {
            self.metrics
                .cleanups_total
                .with_label_values(&[&self.s.addon])
                .inc();
            tracing::info!(reason = %why, "add-on agent stopped; credentials and config removed");
        }
    }
}

/// The credentials store location (for messages).
pub fn describe_store(s: &AddOnSettings) -> String {
    FileSecretStore::new(s.credentials_dir.clone()).location()
}
