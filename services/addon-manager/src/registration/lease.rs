//! Cluster leases: renewal from the agent's own credentials (Joined, Available=True,
//! ClockSynced), the in-memory lease table (rebuilt from KV, fed by other replicas' renewals
//! through a watch), and the grace monitor that marks a silent cluster Available=Unknown
//! (`leaseDurationSeconds × leaseGraceMultiplier`) and lets a renewal bring it back.
//!
//! A renewal is soft state: it always updates the table, but is written to `tether-leases`
//! (an R3 write on a NATS cluster) only when something besides the renew time changes (first
//! lease, holder, duration, a cluster coming back from Unknown) or when the stored renew time
//! is [`lease_persist_interval`] old. What this replica served itself is exact; what it only
//! knows from KV gets that interval added to the grace, so a live cluster is never marked
//! Unknown because its renewals were not written.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use tether_control::resources::{
    CertificateSigningRequest, CsrPhase, Event, Lease, LeaseRenew, LeaseReply, LeaseSpec,
    ManagedCluster, ObjectMeta, condition, lease_persist_interval, parse_rfc3339, rfc3339,
    set_condition,
};
use tether_control::store::{Bucket, Store};
use tether_pki::subject;

use super::{LeaseState, MAX_CLOCK_SKEW, Registration, Result};

impl<S: Store> Registration<S> {
    /// Takes a stored lease into the lease table when it is newer than what the table has
    /// (another replica served the renewal). Returns whether it was newer.
    pub(crate) fn observe_lease(&self, cluster: &str, lease: &Lease) -> bool {
        let Some(renew) = parse_rfc3339(&lease.spec.renew_time) else {
            return false;
        };
        let Ok(mut m) = self.leases.lock() else {
            return false;
        };
        match m.get_mut(cluster) {
            Some(st) => {
                if st.stored.is_none_or(|s| s < renew) {
                    st.stored = Some(renew);
                    st.holder = lease.spec.holder_identity.clone();
                }
                // Not newer than what the table has: an own write coming back, or older.
                if st.renew >= renew {
                    return false;
                }
                st.renew = renew;
                st.exact = false;
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
                        exact: false,
                        stored: Some(renew),
                        holder: lease.spec.holder_identity.clone(),
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
        let now = self.clock.now();
        if let Ok(mut m) = self.leases.lock() {
            for st in m.values_mut() {
                if st.renew < now {
                    st.renew = now;
                    // Renewals served elsewhere reach this replica only as coarse KV writes.
                    st.exact = false;
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
                    exact: false,
                    stored: Some(renew),
                    holder: lease.spec.holder_identity.clone(),
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
        let now = self.clock.now();
        let now_s = rfc3339(now);
        let duration = mc.spec.lease_duration_seconds;
        let prev = self
            .leases
            .lock()
            .ok()
            .and_then(|m| m.get(cluster).cloned());
        let holder = subject::common_name(cluster, &req.agent_name);
        let lease = Lease {
            api_version: Lease::API_VERSION.into(),
            kind: Lease::KIND.into(),
            metadata: ObjectMeta {
                name: Lease::NAME.into(),
                namespace: Some(cluster.into()),
                ..Default::default()
            },
            spec: LeaseSpec {
                holder_identity: holder.clone(),
                lease_duration_seconds: duration,
                acquire_time: rfc3339(prev.as_ref().map_or(now, |p| p.acquired)),
                renew_time: now_s.clone(),
            },
        };
        // Only the renew time changed and the stored one is recent enough: keep the renewal in
        // memory (the KV readers allow for the persist interval, see the module docs).
        let available = mc.condition(condition::AVAILABLE) == Some("True");
        let write = prev.as_ref().is_none_or(|p| {
            p.marked_unknown
                || !available
                || p.duration_seconds != duration
                || p.holder != holder
                || p.stored.is_none_or(|s| {
                    now.duration_since(s).unwrap_or_default() >= lease_persist_interval(duration)
                })
        });
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
                    exact: true,
                    stored: prev.as_ref().and_then(|p| p.stored),
                    holder: prev.as_ref().map_or_else(String::new, |p| p.holder.clone()),
                },
            );
        }
        if write {
            self.store.put(Bucket::Leases, cluster, &lease).await?;
            // Stored as of the renew time the watch will show (second resolution).
            if let Ok(mut m) = self.leases.lock()
                && let Some(st) = m.get_mut(cluster)
            {
                st.stored = parse_rfc3339(&now_s).or(Some(now));
                st.holder = holder;
            }
            self.metrics.lease_writes_total.inc();
        }
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
            let (clock, clock_reason, clock_msg) = if skew <= MAX_CLOCK_SKEW {
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
            let mut changed = false;
            for (ty, status, reason, msg) in [
                (
                    condition::JOINED,
                    "True",
                    "ManagedClusterJoined",
                    "Managed cluster joined",
                ),
                (
                    condition::AVAILABLE,
                    "True",
                    "ManagedClusterAvailable",
                    "Managed cluster is available",
                ),
                (
                    condition::CLOCK_SYNCED,
                    clock,
                    clock_reason,
                    clock_msg.as_str(),
                ),
            ] {
                changed |= set_condition(&mut mc.status.conditions, ty, status, reason, msg);
            }
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

    /// Marks clusters whose lease is older than the grace Available=Unknown; updates the lease
    /// age gauge. Called periodically by the controller.
    pub async fn check_leases(&self) -> Result<()> {
        let now = self.clock.now();
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
                if !st.marked_unknown && age > grace + slack(st) {
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
                    .is_some_and(|a| {
                        a <= grace + lease_persist_interval(lease.spec.lease_duration_seconds)
                    })
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
                && now.duration_since(st.renew).unwrap_or_default() > grace + slack(st)
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

/// What the monitor adds to the grace for a renew time that is not exact: one seen only in KV
/// may be up to [`lease_persist_interval`] older than the cluster's last renewal.
fn slack(st: &LeaseState) -> Duration {
    if st.exact {
        Duration::ZERO
    } else {
        lease_persist_interval(st.duration_seconds)
    }
}
