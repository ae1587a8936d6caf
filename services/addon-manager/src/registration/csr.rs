//! CSRs: validation of a submitted CSR (subject, agent name, pending cap), creation in
//! `tether-csrs`, approval and signing exactly once (compare-and-swap on the CSR's revision,
//! so two replicas never issue two certificates), status polls, and garbage collection.

use std::time::Duration;

use tether_control::resources::{
    CertificateSigningRequest, CsrPhase, CsrReply, CsrSpec, CsrStatus, CsrSubmit, Event,
    ManagedCluster, ObjectMeta, condition, parse_rfc3339, set_condition,
};
use tether_control::store::{Bucket, Store};
use tether_pki::subject;

use super::{HubError, MAX_CAS_RETRIES, Registration, Result, csr_key, reject};

impl<S: Store> Registration<S> {
    pub(crate) fn reply(csr: &CertificateSigningRequest, cluster: &str) -> CsrReply {
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
                    m.entry(cluster.to_string())
                        .or_insert_with(|| self.clock.now());
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
    pub(crate) async fn approve_and_sign(
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
    pub(crate) async fn sign_stored(
        &self,
        cluster: &str,
        mut csr: CertificateSigningRequest,
        rev: u64,
        renewal: bool,
    ) -> Result<Option<CertificateSigningRequest>> {
        let (request, name, lifetime) = (
            csr.spec.request.clone(),
            cluster.to_owned(),
            self.policy.client_cert_lifetime,
        );
        let cert = crate::signing::with_ca(&self.ca, move |ca| {
            let parsed = tether_pki::parse_csr(&request)?;
            ca.sign_client(&parsed, &name, lifetime)
        })
        .await?;
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

    /// The CSRs of one cluster.
    pub(crate) async fn cluster_csrs(
        &self,
        cluster: &str,
    ) -> Result<Vec<CertificateSigningRequest>> {
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

    /// Deletes issued and denied CSRs older than `keep` (OCM garbage-collects CSRs too), so the
    /// bucket stays bounded across rotations. Returns how many were deleted.
    pub async fn gc_csrs(&self, keep: Duration) -> Result<usize> {
        let now = self.clock.now();
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
}
