//! Acceptance: creating a ManagedCluster on its first CSR (auto-accepted when the policy
//! matches), `tetherctl accept` (hubAcceptsClient=true, pending CSRs signed) and `tetherctl deny`
//! (hubAcceptsClient=false, pending CSRs denied, certificates issued before now refused).

use std::collections::BTreeMap;
use std::time::Duration;

use tether_control::resources::{
    AdminClusterRequest, ClusterClaim, CsrPhase, Event, ManagedCluster, condition, rfc3339,
    set_condition,
};
use tether_control::store::{Bucket, Store};
use tether_pki::subject;

use super::{DENIED_ANNOTATION, REVOKED_BEFORE_ANNOTATION};
use super::{HubError, Registration, Result, csr_key, reject};

impl<S: Store> Registration<S> {
    /// Gets the cluster, creating it (not accepted, unless the auto-accept policy matches).
    pub(crate) async fn ensure_cluster(
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
    /// The adapter tells the cluster (`Denied` on its notify subject).
    pub async fn deny(&self, req: AdminClusterRequest) -> Result<ManagedCluster> {
        let name = req.cluster_name;
        let now = rfc3339(self.clock.now() + Duration::from_secs(1));
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
}
