//! The registration state machine.
//!
//! ```text
//!            ┌──────────── bootstrap kubeconfig changed / credentials invalid ───────────┐
//!            ▼                                                                           │
//!   read bootstrap ──► hub credentials valid? ──yes──► joined: lease + rotation + watch ─┘
//!            ▲                    │ no
//!            │                    ▼
//!            └──── bootstrap: key (kept across restarts) → CSR → wait for acceptance
//!                              → write hub credentials
//! ```
//!
//! Every network step has a timeout, every retry uses jittered backoff, and every wait also
//! watches the bootstrap kubeconfig, so a fixed proxy-url or CA takes effect without a restart
//! (OCM PR #267: wrong proxy settings used to leave the agent stuck forever).

use std::path::PathBuf;
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant, SystemTime};

use tether_control::connect::{self, CertMaterial, ConnectConfig, Credentials};
use tether_control::kubeconfig::{self, BootstrapConfig, HubEndpoint};
use tether_control::resources::{
    ClusterClaim, CsrGet, CsrPhase, CsrReply, CsrSubmit, LeaseRenew, LeaseReply, rfc3339,
};
use tether_control::{ControlError, subjects};
use tether_pki::{AgentKey, CertInfo, subject};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::metrics::AgentMetrics;
use crate::secret::{
    HubSecret, HubSecretStore, KEY_AGENT_NAME, KEY_CLUSTER_NAME, KEY_KUBECONFIG, KEY_TLS_CRT,
    KEY_TLS_KEY,
};

/// Why stored or just-issued hub credentials cannot be used (OCM's validity check), or why the
/// bootstrap kubeconfig cannot be read; shown as the agent's phase and in its log.
#[derive(Debug, thiserror::Error)]
pub enum CredentialsError {
    #[error("reading bootstrap kubeconfig {}: {source}", path.display())]
    ReadBootstrap {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(transparent)]
    Kubeconfig(#[from] tether_control::kubeconfig::KubeconfigError),
    #[error("no hub credentials yet")]
    NotYet,
    #[error("cluster-name differs")]
    ClusterNameDiffers,
    #[error("server, proxy-url or CA differ from the bootstrap kubeconfig")]
    OtherHub,
    #[error("certificate: {0}")]
    Certificate(#[source] tether_pki::PkiError),
    #[error("certificate CN {0:?} is not this cluster/agent")]
    CommonName(String),
    #[error("certificate not valid against the bootstrap CA bundle: {0}")]
    NotIssuedByHub(#[source] tether_pki::PkiError),
    #[error("tls.key: {0}")]
    Key(#[source] tether_pki::PkiError),
    #[error("tls.key does not match tls.crt")]
    KeyMismatch,
    #[error("writing hub credentials: {0}")]
    Store(#[from] crate::secret::SecretError),
}

/// Jitter factor on the lease interval (OCM: 0.25).
pub const LEASE_JITTER: f64 = 0.25;
/// Rotation starts when less than a random fraction in this range of the certificate's life is left.
pub const ROTATION_FRACTION: (f64, f64) = (0.20, 0.25);

/// Agent settings.
#[derive(Debug, Clone)]
pub struct AgentConfig {
    pub cluster_name: String,
    /// When None, reuse the stored agent name or generate one.
    pub agent_name: Option<String>,
    pub bootstrap_kubeconfig: PathBuf,
    pub labels: std::collections::BTreeMap<String, String>,
    pub claims: Vec<ClusterClaim>,
    /// How often the bootstrap kubeconfig and the certificate are checked.
    pub check_interval: Duration,
    /// Polling interval while waiting for acceptance.
    pub poll_interval: Duration,
    /// Consecutive authorization failures before the credentials are declared invalid.
    pub max_auth_failures: u32,
    pub connect_timeout: Duration,
}

impl AgentConfig {
    pub fn new(cluster_name: &str, bootstrap_kubeconfig: PathBuf) -> Self {
        Self {
            cluster_name: cluster_name.into(),
            agent_name: None,
            bootstrap_kubeconfig,
            labels: Default::default(),
            claims: vec![],
            check_interval: Duration::from_secs(2),
            poll_interval: Duration::from_millis(500),
            max_auth_failures: 3,
            connect_timeout: connect::DEFAULT_CONNECT_TIMEOUT,
        }
    }
}

/// What the agent is doing (published through a `watch`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Phase {
    Starting,
    /// Cannot read or use the bootstrap kubeconfig, or cannot reach the hub with it.
    BootstrapError(String),
    WaitingForAcceptance(String),
    Joined,
    /// Joined, but the last lease renewal failed.
    Degraded(String),
}

/// The hub connection add-on components use (published through a `watch`).
#[derive(Debug, Clone)]
pub enum HubSession {
    /// Not joined yet, bootstrapping again, or shutting down: add-ons keep what runs.
    Down,
    /// Joined: a NATS client with the cluster's credentials, the hub endpoint (server, CA and
    /// proxy-url the add-on credentials inherit) and the agent name.
    Joined {
        client: async_nats::Client,
        endpoint: Box<HubEndpoint>,
        agent: String,
    },
    /// The hub refused the cluster's credentials (denied, deleted, revoked): add-ons stop and
    /// remove their credentials.
    Revoked(String),
}

/// Why the joined phase ended.
#[derive(Debug)]
enum JoinedExit {
    BootstrapChanged,
    CredentialsInvalid(String),
    Shutdown,
}

fn backoff() -> tether_runtime::Backoff {
    tether_runtime::Backoff::new(tether_runtime::BackoffConfig {
        initial: Duration::from_millis(200),
        max: Duration::from_secs(10),
        ..Default::default()
    })
}

fn jitter(d: Duration, factor: f64) -> Duration {
    d.mul_f64(1.0 + rand::random::<f64>() * factor)
}

fn random_agent_name() -> String {
    const A: &[u8] = b"abcdefghijklmnopqrstuvwxyz0123456789";
    (0..10)
        .map(|_| A[rand::random_range(0..A.len())] as char)
        .collect()
}

/// The registration agent for one cluster.
pub struct Agent<S: HubSecretStore> {
    cfg: AgentConfig,
    store: S,
    metrics: AgentMetrics,
    phase: watch::Sender<Phase>,
    started: Instant,
    /// Last bootstrap kubeconfig bytes seen, to notice changes.
    bootstrap_fingerprint: Option<Vec<u8>>,
    session: watch::Sender<HubSession>,
}

impl<S: HubSecretStore> Agent<S> {
    pub fn new(
        cfg: AgentConfig,
        store: S,
        metrics: AgentMetrics,
    ) -> (Self, watch::Receiver<Phase>) {
        let (tx, rx) = watch::channel(Phase::Starting);
        (
            Self {
                cfg,
                store,
                metrics,
                phase: tx,
                started: Instant::now(),
                bootstrap_fingerprint: None,
                session: watch::channel(HubSession::Down).0,
            },
            rx,
        )
    }

    /// The hub session add-on components follow.
    pub fn session(&self) -> watch::Receiver<HubSession> {
        self.session.subscribe()
    }

    fn set_phase(&self, p: Phase) {
        self.phase.send_if_modified(|cur| {
            if *cur != p {
                match &p {
                    Phase::BootstrapError(e) => tracing::warn!(error = %e, "bootstrap failed"),
                    Phase::WaitingForAcceptance(m) => tracing::info!("{m}"),
                    Phase::Joined => {
                        tracing::info!(cluster = %self.cfg.cluster_name, "joined the hub")
                    }
                    Phase::Degraded(e) => tracing::warn!(error = %e, "lease renewal failing"),
                    Phase::Starting => {}
                }
                *cur = p;
                true
            } else {
                false
            }
        });
    }

    fn read_bootstrap(&mut self) -> Result<BootstrapConfig, CredentialsError> {
        let bytes = std::fs::read(&self.cfg.bootstrap_kubeconfig).map_err(|source| {
            CredentialsError::ReadBootstrap {
                path: self.cfg.bootstrap_kubeconfig.clone(),
                source,
            }
        })?;
        let bc = kubeconfig::read_bootstrap(&self.cfg.bootstrap_kubeconfig)?;
        self.bootstrap_fingerprint = Some(bytes);
        Ok(bc)
    }

    fn bootstrap_changed(&self) -> bool {
        match std::fs::read(&self.cfg.bootstrap_kubeconfig) {
            Ok(b) => self.bootstrap_fingerprint.as_ref() != Some(&b),
            Err(_) => false, // a missing file mid-run keeps the current credentials
        }
    }

    /// A bootstrap step failed: counts it under `label`, shows `reason` in the phase, and
    /// waits out the backoff (`Err(Stop)` if told to stop meanwhile).
    async fn bootstrap_failed(
        &mut self,
        label: &str,
        reason: String,
        bo: &mut tether_runtime::Backoff,
        stop: &CancellationToken,
    ) -> Result<(), Stop> {
        self.metrics
            .bootstrap_errors_total
            .with_label_values(&[label])
            .inc();
        self.set_phase(Phase::BootstrapError(reason));
        if self.sleep_or_stop(bo.failed(), stop).await {
            return Err(Stop);
        }
        Ok(())
    }

    async fn sleep_or_stop(&self, d: Duration, stop: &CancellationToken) -> bool {
        tokio::select! {
            _ = stop.cancelled() => true,
            _ = tokio::time::sleep(d) => false,
        }
    }

    /// Runs until `stop` is cancelled.
    pub async fn run(mut self, stop: CancellationToken) {
        let mut bo = backoff();
        loop {
            if stop.is_cancelled() {
                return;
            }
            let bootstrap = match self.read_bootstrap() {
                Ok(b) => b,
                Err(e) => {
                    if self
                        .bootstrap_failed("kubeconfig", e.to_string(), &mut bo, &stop)
                        .await
                        .is_err()
                    {
                        return;
                    }
                    continue;
                }
            };
            let secret = match self.store.load().await {
                Ok(s) => s,
                Err(e) => {
                    self.set_phase(Phase::BootstrapError(e.to_string()));
                    if self.sleep_or_stop(bo.failed(), &stop).await {
                        return;
                    }
                    continue;
                }
            };
            let agent_name = self.agent_name(&secret);
            match self.valid_credentials(&bootstrap, &secret, &agent_name) {
                Ok((material, _info)) => {
                    bo.reset();
                    let exit = self.joined(&bootstrap, material, &agent_name, &stop).await;
                    match exit {
                        JoinedExit::Shutdown => {
                            self.session.send_replace(HubSession::Down);
                            return;
                        }
                        JoinedExit::BootstrapChanged => {
                            tracing::info!("bootstrap kubeconfig changed: bootstrapping again");
                            self.session.send_replace(HubSession::Down);
                            self.drop_credentials(&agent_name).await;
                        }
                        JoinedExit::CredentialsInvalid(reason) => {
                            tracing::warn!(%reason, "hub credentials are no longer valid: bootstrapping again");
                            self.session.send_replace(HubSession::Revoked(reason));
                            self.drop_credentials(&agent_name).await;
                        }
                    }
                }
                Err(reason) => {
                    if secret.get(KEY_TLS_CRT).is_some() {
                        tracing::info!(%reason, "stored hub credentials are not valid; bootstrapping again");
                        self.drop_credentials(&agent_name).await;
                    }
                    match self
                        .bootstrap(&bootstrap, &agent_name, &stop, &mut bo)
                        .await
                    {
                        Ok(()) => bo.reset(),
                        Err(Stop) => return,
                    }
                }
            }
        }
    }

    fn agent_name(&self, secret: &HubSecret) -> String {
        self.cfg
            .agent_name
            .clone()
            .or_else(|| {
                secret
                    .get(KEY_AGENT_NAME)
                    .map(|s| s.trim().to_string())
                    .filter(|s| subject::is_agent_name(s))
            })
            .unwrap_or_else(random_agent_name)
    }

    /// OCM's validity check: unexpired cert chained to the bootstrap CA bundle, CN naming this
    /// cluster and agent, and server/proxy-url/CA equal to the bootstrap kubeconfig's.
    fn valid_credentials(
        &self,
        bootstrap: &BootstrapConfig,
        secret: &HubSecret,
        agent: &str,
    ) -> Result<(CertMaterial, CertInfo), CredentialsError> {
        let (Some(kc), Some(crt), Some(key)) = (
            secret.get(KEY_KUBECONFIG),
            secret.get(KEY_TLS_CRT),
            secret.get(KEY_TLS_KEY),
        ) else {
            return Err(CredentialsError::NotYet);
        };
        if secret.get(KEY_CLUSTER_NAME).map(str::trim) != Some(self.cfg.cluster_name.as_str()) {
            return Err(CredentialsError::ClusterNameDiffers);
        }
        let hub_ep =
            kubeconfig::parse_hub_endpoint(kc, &format!("{}/kubeconfig", self.store.location()))?;
        if !hub_ep.same_hub(&bootstrap.endpoint) {
            return Err(CredentialsError::OtherHub);
        }
        let info = CertInfo::from_pem(crt).map_err(CredentialsError::Certificate)?;
        if info.common_name != subject::common_name(&self.cfg.cluster_name, agent) {
            return Err(CredentialsError::CommonName(info.common_name));
        }
        let der = tether_pki::pem_certificates(crt).remove(0);
        tether_pki::verify_issued_by(der.as_ref(), &bootstrap.endpoint.ca_pem, SystemTime::now())
            .map_err(CredentialsError::NotIssuedByHub)?;
        let key = AgentKey::from_pem(key).map_err(CredentialsError::Key)?;
        if key.public_key_raw() != info.public_key_raw.as_slice() {
            return Err(CredentialsError::KeyMismatch);
        }
        Ok((
            CertMaterial {
                cert_pem: crt.to_string(),
                key,
                user: info.common_name.clone(),
            },
            info,
        ))
    }

    async fn drop_credentials(&self, agent: &str) {
        let mut s = HubSecret::default();
        s.set(KEY_AGENT_NAME, agent);
        s.set(KEY_CLUSTER_NAME, self.cfg.cluster_name.clone());
        if let Err(e) = self.store.save(&s).await {
            tracing::warn!(error = %e, "cannot clear hub credentials");
        }
    }

    /// Bootstrap: CSR with the bootstrap token until issued; writes the hub credentials.
    #[tracing::instrument(name = "registration.bootstrap", skip_all, fields(cluster = %self.cfg.cluster_name, agent = %agent))]
    async fn bootstrap(
        &mut self,
        bootstrap: &BootstrapConfig,
        agent: &str,
        stop: &CancellationToken,
        bo: &mut tether_runtime::Backoff,
    ) -> Result<(), Stop> {
        let cluster = self.cfg.cluster_name.clone();
        // Keep the pending key across restarts so a restart re-sends the same CSR.
        let mut secret = self.store.load().await.unwrap_or_default();
        let key = match secret
            .get(KEY_TLS_KEY)
            .and_then(|k| AgentKey::from_pem(k).ok())
        {
            Some(k) => k,
            None => {
                let k = AgentKey::generate().map_err(|e| {
                    tracing::error!(error = %e, "cannot generate a key");
                    Stop
                })?;
                secret = HubSecret::default();
                secret.set(KEY_TLS_KEY, k.to_pem());
                secret.set(KEY_AGENT_NAME, agent);
                secret.set(KEY_CLUSTER_NAME, cluster.clone());
                if let Err(e) = self.store.save(&secret).await {
                    tracing::warn!(error = %e, "cannot persist the pending key");
                }
                k
            }
        };
        let csr = match tether_pki::create_csr(&key, &cluster, agent) {
            Ok(c) => c,
            Err(e) => {
                self.set_phase(Phase::BootstrapError(e.to_string()));
                self.sleep_or_stop(Duration::from_secs(30), stop).await;
                return Ok(());
            }
        };
        loop {
            if self.bootstrap_changed() {
                return Ok(());
            }
            let cfg = ConnectConfig {
                connect_timeout: self.cfg.connect_timeout,
                ..ConnectConfig::new(
                    bootstrap.endpoint.clone(),
                    Credentials::Bootstrap(bootstrap.token.clone()),
                    "bootstrap",
                )
            };
            let conn = match connect::connect(&cfg).await {
                Ok(c) => c,
                Err(e) => {
                    self.bootstrap_failed(e.metric_label(), e.to_string(), bo, stop)
                        .await?;
                    continue;
                }
            };
            let submit = CsrSubmit {
                cluster_name: cluster.clone(),
                agent_name: agent.to_string(),
                csr: csr.clone(),
                cluster_claims: self.cfg.claims.clone(),
                labels: self.cfg.labels.clone(),
            };
            let mut reply: CsrReply = match connect::request_json(
                &conn.client,
                subjects::bootstrap_csr(&cluster),
                &submit,
            )
            .await
            {
                Ok(r) => r,
                Err(e) => {
                    self.bootstrap_failed(e.metric_label(), e.to_string(), bo, stop)
                        .await?;
                    continue;
                }
            };
            let wait_started = Instant::now();
            let mut last_log = Instant::now() - Duration::from_secs(60);
            while reply.phase == CsrPhase::Pending || reply.phase == CsrPhase::Approved {
                if last_log.elapsed() >= Duration::from_secs(10) {
                    last_log = Instant::now();
                    self.set_phase(Phase::WaitingForAcceptance(format!(
                        "CSR {} pending for {}s: {}",
                        reply.csr_name,
                        wait_started.elapsed().as_secs(),
                        reply.message
                    )));
                }
                if self
                    .sleep_or_stop(jitter(self.cfg.poll_interval, 0.5), stop)
                    .await
                {
                    return Err(Stop);
                }
                if self.bootstrap_changed() {
                    return Ok(());
                }
                match connect::request_json::<_, CsrReply>(
                    &conn.client,
                    subjects::bootstrap_csr_get(&cluster),
                    &CsrGet {
                        csr_name: reply.csr_name.clone(),
                    },
                )
                .await
                {
                    Ok(r) => reply = r,
                    Err(e) => {
                        tracing::debug!(error = %e, "CSR status poll failed");
                        if conn.auth_error_count() > 0 {
                            break;
                        }
                    }
                }
            }
            match reply.phase {
                CsrPhase::Issued => {
                    match self
                        .store_credentials(bootstrap, &key, &reply.certificate, agent)
                        .await
                    {
                        Ok(()) => {
                            let secs = self.started.elapsed().as_secs_f64();
                            self.metrics.registration_duration_seconds.observe(secs);
                            tracing::info!(csr = %reply.csr_name, seconds = secs, "certificate issued; hub credentials written");
                            return Ok(());
                        }
                        Err(e) => {
                            self.set_phase(Phase::BootstrapError(e.to_string()));
                            if self.sleep_or_stop(bo.failed(), stop).await {
                                return Err(Stop);
                            }
                        }
                    }
                }
                CsrPhase::Denied => {
                    self.set_phase(Phase::BootstrapError(format!(
                        "CSR {} denied: {}",
                        reply.csr_name, reply.message
                    )));
                    // A fresh key gives a fresh CSR once the cluster is accepted again.
                    let mut s = HubSecret::default();
                    s.set(KEY_AGENT_NAME, agent);
                    s.set(KEY_CLUSTER_NAME, cluster.clone());
                    let _ = self.store.save(&s).await;
                    if self
                        .sleep_or_stop(bo.failed().max(Duration::from_secs(2)), stop)
                        .await
                    {
                        return Err(Stop);
                    }
                    return Ok(());
                }
                _ => {
                    if self.sleep_or_stop(bo.failed(), stop).await {
                        return Err(Stop);
                    }
                }
            }
        }
    }

    async fn store_credentials(
        &self,
        bootstrap: &BootstrapConfig,
        key: &AgentKey,
        cert_pem: &str,
        agent: &str,
    ) -> Result<(), CredentialsError> {
        let info = CertInfo::from_pem(cert_pem).map_err(CredentialsError::Certificate)?;
        if info.public_key_raw != key.public_key_raw() {
            return Err(CredentialsError::KeyMismatch);
        }
        if info.common_name != subject::common_name(&self.cfg.cluster_name, agent) {
            return Err(CredentialsError::CommonName(info.common_name));
        }
        let hub_kc = kubeconfig::render_hub(&bootstrap.endpoint)?;
        let mut s = HubSecret::default();
        s.set(KEY_KUBECONFIG, hub_kc);
        s.set(KEY_TLS_CRT, cert_pem);
        s.set(KEY_TLS_KEY, key.to_pem());
        s.set(KEY_CLUSTER_NAME, self.cfg.cluster_name.clone());
        s.set(KEY_AGENT_NAME, agent);
        Ok(self.store.save(&s).await?)
    }

    /// Joined: renew the lease, rotate the certificate, watch the bootstrap kubeconfig.
    async fn joined(
        &mut self,
        bootstrap: &BootstrapConfig,
        material: CertMaterial,
        agent: &str,
        stop: &CancellationToken,
    ) -> JoinedExit {
        let cluster = self.cfg.cluster_name.clone();
        let material = Arc::new(RwLock::new(material));
        let mut bo = backoff();
        let mut rotation_fraction = ROTATION_FRACTION.0
            + rand::random::<f64>() * (ROTATION_FRACTION.1 - ROTATION_FRACTION.0);
        let mut auth_failures = 0u32;
        'connect: loop {
            if self.bootstrap_changed() {
                return JoinedExit::BootstrapChanged;
            }
            if let Some(reason) = self.cert_expired(&material) {
                return JoinedExit::CredentialsInvalid(reason);
            }
            let cfg = ConnectConfig {
                connect_timeout: self.cfg.connect_timeout,
                ..ConnectConfig::new(
                    bootstrap.endpoint.clone(),
                    Credentials::Cert(material.clone()),
                    "agent",
                )
            };
            let conn = match connect::connect(&cfg).await {
                Ok(c) => c,
                Err(e) => {
                    if e.is_unauthorized() {
                        auth_failures += 1;
                        if auth_failures >= self.cfg.max_auth_failures {
                            return JoinedExit::CredentialsInvalid(e.to_string());
                        }
                    }
                    self.set_phase(Phase::Degraded(e.to_string()));
                    if self.sleep_or_stop(bo.failed(), stop).await {
                        return JoinedExit::Shutdown;
                    }
                    continue;
                }
            };
            self.session.send_replace(HubSession::Joined {
                client: conn.client.clone(),
                endpoint: Box::new(bootstrap.endpoint.clone()),
                agent: agent.to_string(),
            });
            let mut notify = match conn
                .client
                .subscribe(subjects::cluster_notify(&cluster))
                .await
            {
                Ok(s) => Some(s),
                Err(e) => {
                    tracing::warn!(error = %e, "cannot subscribe to hub notifications");
                    None
                }
            };
            let mut lease_every = Duration::from_secs(1);
            let mut next_lease = tokio::time::Instant::now();
            let mut check = tokio::time::interval(self.cfg.check_interval);
            check.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                let notified = async {
                    match notify.as_mut() {
                        Some(s) => futures::StreamExt::next(s).await,
                        None => std::future::pending().await,
                    }
                };
                tokio::select! {
                    _ = stop.cancelled() => return JoinedExit::Shutdown,
                    m = notified => {
                        if let Some(m) = m && String::from_utf8_lossy(&m.payload).contains("Denied") {
                            return JoinedExit::CredentialsInvalid("the hub denied this cluster".into());
                        }
                    }
                    _ = tokio::time::sleep_until(next_lease) => {
                        let req = LeaseRenew {
                            agent_name: agent.to_string(),
                            lease_duration_seconds: lease_every.as_secs() as u32,
                            cluster_claims: self.cfg.claims.clone(),
                            agent_time: rfc3339(SystemTime::now()),
                        };
                        let sent = Instant::now();
                        let reply = connect::request_json::<_, LeaseReply>(&conn.client, subjects::cluster_lease(&cluster), &req).await;
                        self.metrics.lease_renew_duration_seconds.observe(sent.elapsed().as_secs_f64());
                        match reply {
                            Ok(r) if r.accepted => {
                                auth_failures = 0;
                                bo.succeeded();
                                self.metrics.lease_renewals_total.with_label_values(&["ok"]).inc();
                                lease_every = Duration::from_secs(r.lease_duration_seconds.max(1) as u64);
                                self.set_phase(Phase::Joined);
                            }
                            Ok(r) => {
                                self.metrics.lease_renewals_total.with_label_values(&["refused"]).inc();
                                return JoinedExit::CredentialsInvalid(format!("hub refused the lease: {}", r.message));
                            }
                            Err(e) => {
                                self.metrics.lease_renewals_total.with_label_values(&["error"]).inc();
                                self.set_phase(Phase::Degraded(e.to_string()));
                                if conn.auth_error_count() >= self.cfg.max_auth_failures as u64 {
                                    return JoinedExit::CredentialsInvalid(format!(
                                        "hub keeps refusing the cluster credentials: {:?}",
                                        conn.recent_errors().last()
                                    ));
                                }
                                if conn.client.connection_state() != async_nats::connection::State::Connected {
                                    // Reconnecting: async-nats retries by itself with backoff.
                                }
                            }
                        }
                        next_lease = tokio::time::Instant::now() + jitter(lease_every, LEASE_JITTER);
                    }
                    _ = check.tick() => {
                        if self.bootstrap_changed() {
                            return JoinedExit::BootstrapChanged;
                        }
                        if let Some(reason) = self.cert_expired(&material) {
                            return JoinedExit::CredentialsInvalid(reason);
                        }
                        let remaining = material
                            .read()
                            .ok()
                            .and_then(|m| CertInfo::from_pem(&m.cert_pem).ok())
                            .map(|i| {
                                self.metrics.cert_remaining_seconds.set(
                                    i.not_after.duration_since(SystemTime::now()).unwrap_or_default().as_secs_f64(),
                                );
                                i.remaining_fraction(SystemTime::now())
                            })
                            .unwrap_or(0.0);
                        if remaining < rotation_fraction {
                            match self.rotate(&conn.client, &material, bootstrap, agent).await {
                                Ok(()) => {
                                    rotation_fraction = ROTATION_FRACTION.0
                                        + rand::random::<f64>() * (ROTATION_FRACTION.1 - ROTATION_FRACTION.0);
                                    // Reconnect with the new certificate right away.
                                    continue 'connect;
                                }
                                Err(e) => tracing::warn!(error = %e, "certificate rotation failed; will retry"),
                            }
                        }
                    }
                }
            }
        }
    }

    fn cert_expired(&self, material: &Arc<RwLock<CertMaterial>>) -> Option<String> {
        let m = material.read().ok()?;
        let info = CertInfo::from_pem(&m.cert_pem).ok()?;
        info.is_expired(SystemTime::now())
            .then(|| format!("client certificate expired at {}", rfc3339(info.not_after)))
    }

    /// Renewal: new key, CSR on the cluster's own subject (auto-approved for accepted clusters).
    #[tracing::instrument(name = "registration.rotate", skip_all, fields(cluster = %self.cfg.cluster_name))]
    async fn rotate(
        &self,
        client: &async_nats::Client,
        material: &Arc<RwLock<CertMaterial>>,
        bootstrap: &BootstrapConfig,
        agent: &str,
    ) -> Result<(), ControlError> {
        let cluster = &self.cfg.cluster_name;
        let key = AgentKey::generate().map_err(|e| ControlError::Codec(e.to_string()))?;
        let csr = tether_pki::create_csr(&key, cluster, agent)
            .map_err(|e| ControlError::Codec(e.to_string()))?;
        let mut reply: CsrReply = connect::request_json(
            client,
            subjects::cluster_csr(cluster),
            &CsrSubmit {
                cluster_name: cluster.clone(),
                agent_name: agent.to_string(),
                csr,
                cluster_claims: vec![],
                labels: Default::default(),
            },
        )
        .await?;
        let deadline = Instant::now() + Duration::from_secs(30);
        while reply.phase != CsrPhase::Issued {
            if reply.phase == CsrPhase::Denied || Instant::now() > deadline {
                return Err(ControlError::Remote {
                    subject: subjects::cluster_csr(cluster),
                    message: format!(
                        "renewal CSR {} not issued: {}",
                        reply.csr_name, reply.message
                    ),
                });
            }
            tokio::time::sleep(jitter(self.cfg.poll_interval, 0.5)).await;
            reply = connect::request_json(
                client,
                subjects::cluster_csr_get(cluster),
                &CsrGet {
                    csr_name: reply.csr_name.clone(),
                },
            )
            .await?;
        }
        self.store_credentials(bootstrap, &key, &reply.certificate, agent)
            .await
            .map_err(|e| ControlError::Codec(e.to_string()))?;
        let info = CertInfo::from_pem(&reply.certificate)
            .map_err(|e| ControlError::Codec(e.to_string()))?;
        if let Ok(mut m) = material.write() {
            m.cert_pem = reply.certificate.clone();
            m.key = key;
        }
        self.metrics.cert_rotations_total.inc();
        tracing::info!(not_after = %rfc3339(info.not_after), "client certificate rotated");
        Ok(())
    }
}

/// The run loop was asked to stop.
#[derive(Debug)]
pub struct Stop;

/// The endpoint a bootstrap kubeconfig names (for status output).
pub fn describe(ep: &HubEndpoint) -> String {
    match &ep.proxy {
        Some(p) => format!("{} via proxy {p}", ep.server),
        None => ep.server.clone(),
    }
}
