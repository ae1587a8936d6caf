//! Registration logic over the JetStream store: ManagedCluster lifecycle, CSR validation and
//! signing, accept/deny, leases and the Available=Unknown grace.
//!
//! All writes are compare-and-swap on the KV revision ([`HubCtx::update_cluster`]), so two hub
//! replicas (or a request racing the lease monitor) never lose each other's updates.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Mutex, RwLock};
use std::time::{Duration, SystemTime};

use tether_control::ControlError;
use tether_control::hub::RegistrationPolicy;
use tether_control::resources::{
    AdminClusterRequest, BootstrapTokenRecord, CertificateSigningRequest, ClusterClaim, Condition,
    CsrPhase, CsrReply, CsrSpec, CsrStatus, CsrSubmit, Event, Lease, LeaseRenew, LeaseReply,
    LeaseSpec, ManagedCluster, ObjectMeta, condition, parse_rfc3339, rfc3339, set_condition,
};
use tether_control::store::{Bucket, HubStore};
use tether_control::subjects;
use tether_pki::{HubCa, subject};

use crate::metrics::Metrics;

/// Annotation: certificates issued before this time are refused (set by deny).
pub const REVOKED_BEFORE_ANNOTATION: &str = "tether.io/certificates-revoked-before";
/// Annotation: the cluster was denied by an admin; auto-accept does not apply.
pub const DENIED_ANNOTATION: &str = "tether.io/denied";
/// CAS retries before giving up on a contended object.
const MAX_CAS_RETRIES: usize = 16;
/// Allowed difference between agent and hub clocks before ClockSynced=False.
const MAX_CLOCK_SKEW: Duration = Duration::from_secs(60);

/// A request the hub refuses; the message goes back to the caller in the `Tether-Error` header.
#[derive(Debug, thiserror::Error)]
pub enum HubError {
    #[error("{0}")]
    Rejected(String),
    #[error(transparent)]
    Control(#[from] ControlError),
    #[error(transparent)]
    Pki(#[from] tether_pki::PkiError),
}

type Result<T, E = HubError> = std::result::Result<T, E>;

fn reject<T>(msg: impl Into<String>) -> Result<T> {
    Err(HubError::Rejected(msg.into()))
}

/// In-memory view of one cluster's lease, for the grace monitor.
#[derive(Debug, Clone)]
pub struct LeaseState {
    pub acquired: SystemTime,
    pub renew: SystemTime,
    pub duration_seconds: u32,
    pub marked_unknown: bool,
}

/// Shared hub state; cheap to share behind an `Arc`.
pub struct HubCtx {
    pub store: HubStore,
    pub client: async_nats::Client,
    pub ca: HubCa,
    pub issuer: tether_control::auth::CalloutIssuer,
    pub policy: RegistrationPolicy,
    pub metrics: Metrics,
    /// cluster → lease state; owned by this process, rebuilt from KV at start.
    pub leases: Mutex<HashMap<String, LeaseState>>,
    /// cluster → pending CSR names; rebuilt from KV at start.
    pub pending: Mutex<HashMap<String, HashSet<String>>>,
    /// cluster → when its first CSR arrived (for the registration duration metric).
    pub first_seen: Mutex<HashMap<String, SystemTime>>,
    /// Read cache of ManagedClusters (own writes + a KV watch), so the auth callout and lease
    /// renewals need no JetStream round trip in the steady state.
    pub clusters: RwLock<HashMap<String, ManagedCluster>>,
    /// Read cache of bootstrap token records (KV watch); misses fall back to KV.
    pub tokens: RwLock<HashMap<String, BootstrapTokenRecord>>,
}

impl std::fmt::Debug for HubCtx {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HubCtx").finish_non_exhaustive()
    }
}

fn csr_key(cluster: &str, name: &str) -> String {
    format!("{cluster}.{name}")
}

impl HubCtx {
    pub fn new(
        store: HubStore,
        client: async_nats::Client,
        ca: HubCa,
        issuer: tether_control::auth::CalloutIssuer,
        policy: RegistrationPolicy,
        metrics: Metrics,
    ) -> Self {
        Self {
            store,
            client,
            ca,
            issuer,
            policy,
            metrics,
            leases: Mutex::new(HashMap::new()),
            pending: Mutex::new(HashMap::new()),
            first_seen: Mutex::new(HashMap::new()),
            clusters: RwLock::new(HashMap::new()),
            tokens: RwLock::new(HashMap::new()),
        }
    }

    fn cache_cluster(&self, mc: &ManagedCluster) {
        if let Ok(mut m) = self.clusters.write() {
            m.insert(mc.metadata.name.clone(), mc.clone());
        }
    }

    /// The cached ManagedCluster, else the stored one.
    pub async fn cluster(&self, name: &str) -> Result<Option<ManagedCluster>> {
        if let Some(mc) = self.clusters.read().ok().and_then(|m| m.get(name).cloned()) {
            return Ok(Some(mc));
        }
        let mc = self
            .store
            .get::<ManagedCluster>(Bucket::Clusters, name)
            .await?
            .map(|(m, _)| m);
        if let Some(m) = &mc {
            self.cache_cluster(m);
        }
        Ok(mc)
    }

    /// The cached token record, else the stored one.
    pub async fn token(&self, id: &str) -> Result<Option<BootstrapTokenRecord>> {
        if let Some(t) = self.tokens.read().ok().and_then(|m| m.get(id).cloned()) {
            return Ok(Some(t));
        }
        Ok(self
            .store
            .get::<BootstrapTokenRecord>(Bucket::Tokens, id)
            .await?
            .map(|(t, _)| t))
    }

    /// Keeps the caches in step with KV (other replicas, `tetherctl token create`).
    pub async fn start_watches(self: &std::sync::Arc<Self>) -> Result<()> {
        use futures::StreamExt;
        let clusters = self.store.watch::<ManagedCluster>(Bucket::Clusters).await?;
        let tokens = self
            .store
            .watch::<BootstrapTokenRecord>(Bucket::Tokens)
            .await?;
        let me = std::sync::Arc::downgrade(self);
        tokio::spawn(async move {
            let mut clusters = std::pin::pin!(clusters);
            while let Some((k, v)) = clusters.next().await {
                let Some(ctx) = me.upgrade() else { return };
                if v.is_none()
                    && let Ok(mut l) = ctx.leases.lock()
                {
                    // A deleted cluster is no longer watched for lease expiry.
                    l.remove(&k);
                }
                if let Ok(mut m) = ctx.clusters.write() {
                    match v {
                        Some(mc) => m.insert(k, mc),
                        None => m.remove(&k),
                    };
                }
            }
        });
        // Renewals served by other replicas (queue groups) reach this one's lease table here.
        let leases = self.store.watch::<Lease>(Bucket::Leases).await?;
        let me = std::sync::Arc::downgrade(self);
        tokio::spawn(async move {
            let mut leases = std::pin::pin!(leases);
            while let Some((k, v)) = leases.next().await {
                let Some(ctx) = me.upgrade() else { return };
                match v {
                    Some(lease) => {
                        ctx.observe_lease(&k, &lease);
                    }
                    None => {
                        if let Ok(mut m) = ctx.leases.lock() {
                            m.remove(&k);
                        }
                    }
                }
            }
        });
        let me = std::sync::Arc::downgrade(self);
        tokio::spawn(async move {
            let mut tokens = std::pin::pin!(tokens);
            while let Some((k, v)) = tokens.next().await {
                let Some(ctx) = me.upgrade() else { return };
                if let Ok(mut m) = ctx.tokens.write() {
                    match v {
                        Some(t) => m.insert(k, t),
                        None => m.remove(&k),
                    };
                }
            }
        });
        Ok(())
    }

    /// Takes a stored lease into the lease table when it is newer than what the table has
    /// (another replica served the renewal). Returns whether it was newer.
    fn observe_lease(&self, cluster: &str, lease: &Lease) -> bool {
        let Some(renew) = parse_rfc3339(&lease.spec.renew_time) else {
            return false;
        };
        let Ok(mut m) = self.leases.lock() else {
            return false;
        };
        match m.get_mut(cluster) {
            Some(st) if st.renew >= renew => false,
            Some(st) => {
                st.renew = renew;
                st.duration_seconds = lease.spec.lease_duration_seconds;
                st.marked_unknown = false;
                true
            }
            None => {
                m.insert(
                    cluster.to_string(),
                    LeaseState {
                        acquired: parse_rfc3339(&lease.spec.acquire_time).unwrap_or(renew),
                        renew,
                        duration_seconds: lease.spec.lease_duration_seconds,
                        marked_unknown: false,
                    },
                );
                true
            }
        }
    }

    /// Starts every lease's grace period afresh (not before now): called when this replica
    /// becomes the leader, since while it was not leading (or not connected) it may have
    /// missed renewals. A dead cluster is then detected one grace later, never a live one
    /// marked Unknown because the hub itself was cut off (Kubernetes' node lifecycle
    /// controller does the same with its local probe timestamps).
    pub fn restart_lease_grace(&self) {
        let now = SystemTime::now();
        if let Ok(mut m) = self.leases.lock() {
            for st in m.values_mut() {
                if st.renew < now {
                    st.renew = now;
                }
            }
        }
    }

    /// Rebuilds the in-memory lease and pending-CSR tables from KV.
    pub async fn load_leases(&self) -> Result<()> {
        let clusters: HashMap<String, ManagedCluster> = self
            .store
            .list::<ManagedCluster>(Bucket::Clusters)
            .await?
            .into_iter()
            .map(|(k, v, _)| (k, v))
            .collect();
        let mut table = HashMap::new();
        for (name, lease, _) in self.store.list::<Lease>(Bucket::Leases).await? {
            let Some(renew) = parse_rfc3339(&lease.spec.renew_time) else {
                continue;
            };
            let marked_unknown = clusters
                .get(&name)
                .is_some_and(|mc| mc.condition(condition::AVAILABLE) == Some("Unknown"));
            table.insert(
                name,
                LeaseState {
                    acquired: parse_rfc3339(&lease.spec.acquire_time).unwrap_or(renew),
                    renew,
                    duration_seconds: lease.spec.lease_duration_seconds,
                    marked_unknown,
                },
            );
        }
        let mut pending: HashMap<String, HashSet<String>> = HashMap::new();
        for (_, csr, _) in self
            .store
            .list::<CertificateSigningRequest>(Bucket::Csrs)
            .await?
        {
            if csr.phase() == CsrPhase::Pending
                && let Some(c) = csr
                    .metadata
                    .labels
                    .get(CertificateSigningRequest::CLUSTER_LABEL)
            {
                pending
                    .entry(c.clone())
                    .or_default()
                    .insert(csr.metadata.name.clone());
            }
        }
        tracing::info!(
            leases = table.len(),
            clusters = clusters.len(),
            "loaded hub state"
        );
        *self.leases.lock().unwrap_or_else(|e| e.into_inner()) = table;
        *self.pending.lock().unwrap_or_else(|e| e.into_inner()) = pending;
        Ok(())
    }

    async fn event(&self, ev: Event) {
        if let Err(e) = self.store.publish_event(&ev).await {
            tracing::warn!(error = %e, reason = %ev.reason, "cannot publish event");
        }
    }

    /// Read-modify-write of a ManagedCluster with CAS; `f` returns whether it changed anything.
    /// Returns the stored object (None when absent).
    pub async fn update_cluster(
        &self,
        name: &str,
        mut f: impl FnMut(&mut ManagedCluster) -> bool,
    ) -> Result<Option<ManagedCluster>> {
        for _ in 0..MAX_CAS_RETRIES {
            let Some((mut mc, rev)) = self
                .store
                .get::<ManagedCluster>(Bucket::Clusters, name)
                .await?
            else {
                return Ok(None);
            };
            if !f(&mut mc) {
                return Ok(Some(mc));
            }
            if self
                .store
                .update(Bucket::Clusters, name, &mc, rev)
                .await?
                .is_some()
            {
                return Ok(Some(mc));
            }
        }
        reject(format!(
            "managedcluster {name}: too many concurrent updates, retry"
        ))
    }

    /// Gets the cluster, creating it (not accepted, unless the auto-accept policy matches).
    async fn ensure_cluster(
        &self,
        name: &str,
        labels: &BTreeMap<String, String>,
        claims: &[ClusterClaim],
    ) -> Result<ManagedCluster> {
        if let Some((mc, _)) = self
            .store
            .get::<ManagedCluster>(Bucket::Clusters, name)
            .await?
        {
            return Ok(mc);
        }
        let mut mc = ManagedCluster::new(name);
        mc.metadata.labels = labels.clone();
        mc.spec.lease_duration_seconds = self.policy.lease_duration_seconds;
        mc.status.cluster_claims = claims.to_vec();
        let auto = self.policy.auto_accept.matches(name, labels);
        if auto {
            mc.spec.hub_accepts_client = true;
            set_condition(
                &mut mc.status.conditions,
                condition::HUB_ACCEPTED,
                "True",
                "HubClusterAutoAccepted",
                "Accepted by the hub's auto-accept policy.",
            );
        }
        match self.store.create(Bucket::Clusters, name, &mc).await? {
            Some(_) => {
                self.cache_cluster(&mc);
                self.event(Event::new(
                    ManagedCluster::KIND,
                    name,
                    "Normal",
                    "ManagedClusterCreated",
                    "Registration agent asked to join the hub.",
                ))
                .await;
                if auto {
                    self.event(Event::new(
                        ManagedCluster::KIND,
                        name,
                        "Normal",
                        "HubClusterAutoAccepted",
                        "Accepted by the auto-accept policy.",
                    ))
                    .await;
                }
                Ok(mc)
            }
            None => match self
                .store
                .get::<ManagedCluster>(Bucket::Clusters, name)
                .await?
            {
                Some((mc, _)) => Ok(mc),
                None => reject(format!(
                    "managedcluster {name} vanished while being created"
                )),
            },
        }
    }

    fn pending_count(&self, cluster: &str) -> usize {
        self.pending
            .lock()
            .map(|p| p.get(cluster).map_or(0, HashSet::len))
            .unwrap_or(0)
    }

    fn set_pending(&self, cluster: &str, csr: &str, pending: bool) {
        if let Ok(mut p) = self.pending.lock() {
            let set = p.entry(cluster.to_string()).or_default();
            if pending {
                set.insert(csr.to_string());
            } else {
                set.remove(csr);
            }
        }
    }

    fn reply(csr: &CertificateSigningRequest, cluster: &str) -> CsrReply {
        let phase = csr.phase();
        let message = match phase {
            CsrPhase::Pending => format!(
                "waiting for the hub to accept cluster {cluster}: run `tetherctl accept {cluster}` (or configure auto-accept)"
            ),
            CsrPhase::Approved => "approved, being signed".into(),
            CsrPhase::Issued => "issued".into(),
            CsrPhase::Denied => csr
                .status
                .conditions
                .iter()
                .find(|c| c.type_ == "Denied")
                .map(|c| c.message.clone())
                .unwrap_or_else(|| "denied".into()),
        };
        CsrReply {
            csr_name: csr.metadata.name.clone(),
            phase,
            certificate: csr.status.certificate.clone(),
            message,
        }
    }

    /// Handles a CSR from a bootstrap credential (`renewal = false`) or from the cluster's own
    /// credentials (`renewal = true`, subject already proves which cluster it is).
    pub async fn submit_csr(
        &self,
        cluster: &str,
        req: CsrSubmit,
        renewal: bool,
        trace_id: Option<String>,
    ) -> Result<CsrReply> {
        let deny = |reason: &'static str, msg: String| {
            self.metrics
                .csrs_denied_total
                .with_label_values(&[reason])
                .inc();
            Err(HubError::Rejected(msg))
        };
        if req.cluster_name != cluster {
            return deny(
                "subject",
                format!(
                    "clusterName {:?} does not match the subject's cluster {cluster:?}",
                    req.cluster_name
                ),
            );
        }
        if !subject::is_dns_label(cluster) {
            return deny(
                "name",
                format!("cluster name {cluster:?} is not a DNS-1123 label"),
            );
        }
        let parsed = match tether_pki::parse_csr(&req.csr) {
            Ok(p) => p,
            Err(e) => return deny("invalid", e.to_string()),
        };
        let agent = match parsed.validate_for(cluster) {
            Ok(a) => a,
            Err(e) => {
                let mut ev = Event::new(
                    ManagedCluster::KIND,
                    cluster,
                    "Warning",
                    "CSRRejected",
                    e.to_string(),
                );
                ev.trace_id = trace_id.clone();
                self.event(ev).await;
                return deny("subject", e.to_string());
            }
        };
        if agent != req.agent_name {
            return deny(
                "subject",
                format!(
                    "CSR is for agent {agent:?} but agentName is {:?}",
                    req.agent_name
                ),
            );
        }
        let mc = if renewal {
            match self
                .store
                .get::<ManagedCluster>(Bucket::Clusters, cluster)
                .await?
            {
                Some((mc, _)) if mc.spec.hub_accepts_client => mc,
                _ => {
                    return deny(
                        "not_accepted",
                        format!("cluster {cluster} is not accepted by the hub"),
                    );
                }
            }
        } else {
            self.first_seen
                .lock()
                .map(|mut m| {
                    m.entry(cluster.to_string()).or_insert_with(SystemTime::now);
                })
                .ok();
            self.ensure_cluster(cluster, &req.labels, &req.cluster_claims)
                .await?
        };
        let name = format!("{cluster}-{}", &parsed.key_fingerprint[..16]);
        let key = csr_key(cluster, &name);
        if let Some((csr, _)) = self
            .store
            .get::<CertificateSigningRequest>(Bucket::Csrs, &key)
            .await?
        {
            if csr.phase() == CsrPhase::Pending && mc.spec.hub_accepts_client {
                let csr = self.approve_and_sign(cluster, csr, renewal).await?;
                return Ok(Self::reply(&csr, cluster));
            }
            return Ok(Self::reply(&csr, cluster));
        }
        let max = self.policy.max_pending_csrs_per_cluster;
        if self.pending_count(cluster) >= max {
            return deny(
                "too_many_pending",
                format!(
                    "too many pending CSRs for cluster {cluster} (max {max}); accept or deny the cluster first"
                ),
            );
        }
        let mut meta = ObjectMeta::new(&name);
        meta.labels.insert(
            CertificateSigningRequest::CLUSTER_LABEL.into(),
            cluster.into(),
        );
        if renewal {
            meta.labels
                .insert("tether.io/renewal".into(), "true".into());
        }
        let csr = CertificateSigningRequest {
            api_version: CertificateSigningRequest::API_VERSION.into(),
            kind: CertificateSigningRequest::KIND.into(),
            metadata: meta,
            spec: CsrSpec {
                request: req.csr.clone(),
                signer_name: subject::SIGNER_NAME.into(),
                usages: vec!["digital signature".into(), "client auth".into()],
                username: if renewal {
                    parsed.common_name.clone()
                } else {
                    "system:open-cluster-management:bootstrap".into()
                },
                expiration_seconds: Some(self.policy.client_cert_lifetime.as_secs()),
            },
            status: CsrStatus::default(),
        };
        if self.store.create(Bucket::Csrs, &key, &csr).await?.is_none() {
            // Raced with an identical submit; answer with what is stored.
            if let Some((csr, _)) = self
                .store
                .get::<CertificateSigningRequest>(Bucket::Csrs, &key)
                .await?
            {
                return Ok(Self::reply(&csr, cluster));
            }
        }
        self.set_pending(cluster, &name, true);
        let mut ev = Event::new(
            CertificateSigningRequest::KIND,
            &name,
            "Normal",
            "CSRCreated",
            format!("cluster {cluster} agent {agent} requested a client certificate"),
        );
        ev.trace_id = trace_id;
        self.event(ev).await;
        if mc.spec.hub_accepts_client {
            let csr = self.approve_and_sign(cluster, csr, renewal).await?;
            return Ok(Self::reply(&csr, cluster));
        }
        Ok(Self::reply(&csr, cluster))
    }

    /// Signs a stored CSR once: compare-and-swap on its revision, so that two hub replicas
    /// (or an accept racing a status poll) never issue two certificates for one CSR — the loser
    /// returns the winner's. A CSR that already carries a certificate is returned as stored.
    async fn approve_and_sign(
        &self,
        cluster: &str,
        csr: CertificateSigningRequest,
        renewal: bool,
    ) -> Result<CertificateSigningRequest> {
        let key = csr_key(cluster, &csr.metadata.name);
        for _ in 0..MAX_CAS_RETRIES {
            let Some((stored, rev)) = self
                .store
                .get::<CertificateSigningRequest>(Bucket::Csrs, &key)
                .await?
            else {
                return reject(format!("CSR {} no longer exists", csr.metadata.name));
            };
            if !stored.status.certificate.is_empty() || stored.phase() == CsrPhase::Denied {
                self.set_pending(cluster, &stored.metadata.name, false);
                return Ok(stored);
            }
            if let Some(signed) = self.sign_stored(cluster, stored, rev, renewal).await? {
                return Ok(signed);
            }
            self.metrics.csr_sign_conflicts_total.inc();
        }
        reject(format!("CSR {key}: too many concurrent updates, retry"))
    }

    /// Signs `csr` (at revision `rev`); `None` when the revision moved (another replica).
    async fn sign_stored(
        &self,
        cluster: &str,
        mut csr: CertificateSigningRequest,
        rev: u64,
        renewal: bool,
    ) -> Result<Option<CertificateSigningRequest>> {
        let parsed = tether_pki::parse_csr(&csr.spec.request)?;
        let cert = self
            .ca
            .sign_client(&parsed, cluster, self.policy.client_cert_lifetime)?;
        set_condition(
            &mut csr.status.conditions,
            "Approved",
            "True",
            if renewal {
                "AutoApprovedByHubCSRApprovingController"
            } else {
                "ApprovedByHub"
            },
            "Approved by the hub registration controller.",
        );
        csr.status.certificate = cert;
        let key = csr_key(cluster, &csr.metadata.name);
        if self
            .store
            .update(Bucket::Csrs, &key, &csr, rev)
            .await?
            .is_none()
        {
            return Ok(None);
        }
        self.set_pending(cluster, &csr.metadata.name, false);
        self.metrics
            .csrs_signed_total
            .with_label_values(&[if renewal { "renewal" } else { "bootstrap" }])
            .inc();
        self.event(Event::new(
            CertificateSigningRequest::KIND,
            &csr.metadata.name,
            "Normal",
            "CSRApproved",
            format!("signed a client certificate for cluster {cluster}"),
        ))
        .await;
        if renewal {
            self.update_cluster(cluster, |mc| {
                set_condition(
                    &mut mc.status.conditions,
                    condition::CERT_ROTATED,
                    "True",
                    "ClientCertificateUpdated",
                    "client certificate rotated",
                )
            })
            .await?;
        }
        Ok(Some(csr))
    }

    /// Status poll for a CSR (signs it now if the cluster got accepted meanwhile).
    pub async fn get_csr(&self, cluster: &str, csr_name: &str, renewal: bool) -> Result<CsrReply> {
        let key = csr_key(cluster, csr_name);
        let Some((csr, _)) = self
            .store
            .get::<CertificateSigningRequest>(Bucket::Csrs, &key)
            .await?
        else {
            return reject(format!("CSR {csr_name} of cluster {cluster} not found"));
        };
        if csr.phase() == CsrPhase::Pending
            && let Some((mc, _)) = self
                .store
                .get::<ManagedCluster>(Bucket::Clusters, cluster)
                .await?
            && mc.spec.hub_accepts_client
        {
            let csr = self.approve_and_sign(cluster, csr, renewal).await?;
            return Ok(Self::reply(&csr, cluster));
        }
        Ok(Self::reply(&csr, cluster))
    }

    async fn cluster_csrs(&self, cluster: &str) -> Result<Vec<CertificateSigningRequest>> {
        let prefix = format!("{cluster}.");
        let mut out = Vec::new();
        for k in self.store.keys(Bucket::Csrs).await? {
            if k.starts_with(&prefix)
                && let Some((c, _)) = self
                    .store
                    .get::<CertificateSigningRequest>(Bucket::Csrs, &k)
                    .await?
            {
                out.push(c);
            }
        }
        Ok(out)
    }

    /// `tetherctl accept`: hubAcceptsClient=true and sign pending CSRs.
    pub async fn accept(&self, req: AdminClusterRequest) -> Result<ManagedCluster> {
        let name = req.cluster_name;
        if !subject::is_dns_label(&name) {
            return reject(format!("cluster name {name:?} is not a DNS-1123 label"));
        }
        if self
            .store
            .get::<ManagedCluster>(Bucket::Clusters, &name)
            .await?
            .is_none()
        {
            let mut mc = ManagedCluster::new(&name);
            mc.spec.lease_duration_seconds = self.policy.lease_duration_seconds;
            self.store.create(Bucket::Clusters, &name, &mc).await?;
        }
        let mc = self
            .update_cluster(&name, |mc| {
                let mut changed = !mc.spec.hub_accepts_client;
                mc.spec.hub_accepts_client = true;
                changed |= mc.metadata.annotations.remove(DENIED_ANNOTATION).is_some();
                changed |= set_condition(
                    &mut mc.status.conditions,
                    condition::HUB_ACCEPTED,
                    "True",
                    "HubClusterAdminAccepted",
                    "Accepted by hub cluster admin",
                );
                changed
            })
            .await?
            .ok_or_else(|| HubError::Rejected(format!("managedcluster {name} not found")))?;
        for csr in self.cluster_csrs(&name).await? {
            if csr.phase() == CsrPhase::Pending {
                self.approve_and_sign(&name, csr, false).await?;
            }
        }
        self.event(Event::new(
            ManagedCluster::KIND,
            &name,
            "Normal",
            "HubClusterAdminAccepted",
            "Accepted by hub cluster admin",
        ))
        .await;
        Ok(mc)
    }

    /// `tetherctl deny`: hubAcceptsClient=false, pending CSRs denied, issued certificates refused.
    pub async fn deny(&self, req: AdminClusterRequest) -> Result<ManagedCluster> {
        let name = req.cluster_name;
        let now = rfc3339(SystemTime::now() + Duration::from_secs(1));
        let mc = self
            .update_cluster(&name, |mc| {
                mc.spec.hub_accepts_client = false;
                mc.metadata
                    .annotations
                    .insert(DENIED_ANNOTATION.into(), "true".into());
                mc.metadata
                    .annotations
                    .insert(REVOKED_BEFORE_ANNOTATION.into(), now.clone());
                set_condition(
                    &mut mc.status.conditions,
                    condition::HUB_ACCEPTED,
                    "False",
                    condition::HUB_DENIED_REASON,
                    "Denied by hub cluster admin",
                );
                true
            })
            .await?
            .ok_or_else(|| HubError::Rejected(format!("managedcluster {name} not found")))?;
        for mut csr in self.cluster_csrs(&name).await? {
            if csr.phase() == CsrPhase::Pending {
                set_condition(
                    &mut csr.status.conditions,
                    "Denied",
                    "True",
                    condition::HUB_DENIED_REASON,
                    "cluster denied by hub cluster admin",
                );
                self.store
                    .put(Bucket::Csrs, &csr_key(&name, &csr.metadata.name), &csr)
                    .await?;
                self.set_pending(&name, &csr.metadata.name, false);
                self.metrics
                    .csrs_denied_total
                    .with_label_values(&["denied"])
                    .inc();
            }
        }
        let _ = self
            .client
            .publish(
                subjects::cluster_notify(&name),
                r#"{"type":"Denied"}"#.into(),
            )
            .await;
        self.event(Event::new(
            ManagedCluster::KIND,
            &name,
            "Warning",
            condition::HUB_DENIED_REASON,
            "Denied by hub cluster admin; its certificates are no longer accepted",
        ))
        .await;
        Ok(mc)
    }

    /// A lease renewal from the cluster's own credentials.
    pub async fn renew_lease(&self, cluster: &str, req: LeaseRenew) -> Result<LeaseReply> {
        let Some(mc) = self.cluster(cluster).await? else {
            return Ok(LeaseReply {
                accepted: false,
                lease_duration_seconds: 0,
                message: format!("managedcluster {cluster} not found"),
            });
        };
        if !mc.spec.hub_accepts_client {
            return Ok(LeaseReply {
                accepted: false,
                lease_duration_seconds: mc.spec.lease_duration_seconds,
                message: format!("cluster {cluster} is not accepted by the hub"),
            });
        }
        let now = SystemTime::now();
        let now_s = rfc3339(now);
        let duration = mc.spec.lease_duration_seconds;
        let prev = self
            .leases
            .lock()
            .ok()
            .and_then(|m| m.get(cluster).cloned());
        let lease = Lease {
            api_version: Lease::API_VERSION.into(),
            kind: Lease::KIND.into(),
            metadata: ObjectMeta {
                name: Lease::NAME.into(),
                namespace: Some(cluster.into()),
                ..Default::default()
            },
            spec: LeaseSpec {
                holder_identity: subject::common_name(cluster, &req.agent_name),
                lease_duration_seconds: duration,
                acquire_time: rfc3339(prev.as_ref().map_or(now, |p| p.acquired)),
                renew_time: now_s.clone(),
            },
        };
        // The request itself proves the cluster is alive: record it before storing, so that a
        // hub-side JetStream outage (the put failing) never counts against the cluster.
        if let Ok(mut m) = self.leases.lock() {
            m.insert(
                cluster.to_string(),
                LeaseState {
                    acquired: prev.as_ref().map_or(now, |p| p.acquired),
                    renew: now,
                    duration_seconds: duration,
                    marked_unknown: false,
                },
            );
        }
        self.store.put(Bucket::Leases, cluster, &lease).await?;
        self.metrics.lease_renewals_total.inc();
        let skew = parse_rfc3339(&req.agent_time)
            .map(|t| match t.duration_since(now) {
                Ok(d) => d,
                Err(e) => e.duration(),
            })
            .unwrap_or_default();
        let was_joined = mc.condition(condition::JOINED) == Some("True");
        let claims = req.cluster_claims.clone();
        let apply = |mc: &mut ManagedCluster| {
            let mut changed = set_condition(
                &mut mc.status.conditions,
                condition::JOINED,
                "True",
                "ManagedClusterJoined",
                "Managed cluster joined",
            );
            changed |= set_condition(
                &mut mc.status.conditions,
                condition::AVAILABLE,
                "True",
                "ManagedClusterAvailable",
                "Managed cluster is available",
            );
            let (st, reason, msg) = if skew <= MAX_CLOCK_SKEW {
                (
                    "True",
                    "ManagedClusterClockSynced",
                    "The clock of the managed cluster is synced with the hub.".to_string(),
                )
            } else {
                (
                    "False",
                    "ManagedClusterClockOutOfSync",
                    format!("The clock of hub and agent differ by {}s", skew.as_secs()),
                )
            };
            changed |= set_condition(
                &mut mc.status.conditions,
                condition::CLOCK_SYNCED,
                st,
                reason,
                &msg,
            );
            if !claims.is_empty() && mc.status.cluster_claims != claims {
                mc.status.cluster_claims = claims.clone();
                changed = true;
            }
            changed
        };
        // Steady state: nothing to change, no KV round trip for the cluster.
        let updated = if apply(&mut mc.clone()) {
            self.update_cluster(cluster, apply).await?
        } else {
            Some(mc.clone())
        };
        let avail_changed = mc.condition(condition::AVAILABLE) != Some("True");
        if !was_joined {
            if let Some(t0) = self
                .first_seen
                .lock()
                .ok()
                .and_then(|mut m| m.remove(cluster))
            {
                self.metrics
                    .registration_duration_seconds
                    .observe(now.duration_since(t0).unwrap_or_default().as_secs_f64());
            }
            self.event(Event::new(
                ManagedCluster::KIND,
                cluster,
                "Normal",
                "ManagedClusterJoined",
                "Managed cluster joined",
            ))
            .await;
        }
        if avail_changed && was_joined {
            self.event(Event::new(
                ManagedCluster::KIND,
                cluster,
                "Normal",
                "ManagedClusterAvailable",
                "Lease renewed; managed cluster is available again",
            ))
            .await;
        }
        Ok(LeaseReply {
            accepted: true,
            lease_duration_seconds: updated
                .map(|m| m.spec.lease_duration_seconds)
                .unwrap_or(duration),
            message: String::new(),
        })
    }

    /// Deletes issued and denied CSRs older than `keep` (OCM garbage-collects CSRs too), so the
    /// bucket stays bounded across rotations. Returns how many were deleted.
    pub async fn gc_csrs(&self, keep: Duration) -> Result<usize> {
        let now = SystemTime::now();
        let mut deleted = 0;
        for (key, csr, _) in self
            .store
            .list::<CertificateSigningRequest>(Bucket::Csrs)
            .await?
        {
            if csr.phase() == CsrPhase::Pending {
                continue;
            }
            let old = parse_rfc3339(&csr.metadata.creation_timestamp)
                .and_then(|t| now.duration_since(t).ok())
                .is_some_and(|age| age > keep);
            if old {
                self.store.delete(Bucket::Csrs, &key).await?;
                deleted += 1;
            }
        }
        Ok(deleted)
    }

    /// Marks clusters whose lease is older than the grace Available=Unknown; updates the lease
    /// age gauge. Called periodically by the controller.
    pub async fn check_leases(&self) -> Result<()> {
        let now = SystemTime::now();
        let mult = self.policy.lease_grace_multiplier;
        let expired: Vec<(String, Duration, Duration)> = {
            let m = self.leases.lock().unwrap_or_else(|e| e.into_inner());
            let mut out = Vec::new();
            for (name, st) in m.iter() {
                let age = now.duration_since(st.renew).unwrap_or_default();
                self.metrics
                    .cluster_lease_age_seconds
                    .with_label_values(&[name.as_str()])
                    .set(age.as_secs_f64());
                let grace = Duration::from_secs(st.duration_seconds as u64 * mult as u64);
                if !st.marked_unknown && age > grace {
                    out.push((name.clone(), age, grace));
                }
            }
            out
        };
        for (name, age, grace) in expired {
            // The table may lag a renewal another replica stored: KV decides.
            if let Some((lease, _)) = self.store.get::<Lease>(Bucket::Leases, &name).await?
                && self.observe_lease(&name, &lease)
                && parse_rfc3339(&lease.spec.renew_time)
                    .and_then(|t| now.duration_since(t).ok())
                    .is_some_and(|a| a <= grace)
            {
                continue;
            }
            let msg = format!(
                "Registration agent stopped updating its lease: last renewal {}s ago, grace {}s ({} × leaseDurationSeconds).",
                age.as_secs(),
                grace.as_secs(),
                mult
            );
            let mut flipped = false;
            self.update_cluster(&name, |mc| {
                if mc.condition(condition::AVAILABLE) == Some("Unknown") {
                    return false;
                }
                flipped = true;
                set_condition(
                    &mut mc.status.conditions,
                    condition::AVAILABLE,
                    "Unknown",
                    "ManagedClusterLeaseUpdateStopped",
                    &msg,
                )
            })
            .await?;
            if let Ok(mut m) = self.leases.lock()
                && let Some(st) = m.get_mut(&name)
                && now.duration_since(st.renew).unwrap_or_default() > grace
            {
                st.marked_unknown = true;
            }
            if flipped {
                tracing::warn!(cluster = %name, age_s = age.as_secs(), "cluster lease expired: Available=Unknown");
                self.event(Event::new(
                    ManagedCluster::KIND,
                    &name,
                    "Warning",
                    "ManagedClusterLeaseUpdateStopped",
                    msg,
                ))
                .await;
            }
        }
        Ok(())
    }
}

/// Reports whether a condition list has a condition.
pub fn has_condition(conds: &[Condition], t: &str, status: &str) -> bool {
    conds.iter().any(|c| c.type_ == t && c.status == status)
}
