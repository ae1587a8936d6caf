//! Registration logic (OCM's registration controller on the hub) over the [`Store`] trait and
//! a [`Clock`](tether_control::clock::Clock), with no NATS in it: the NATS request handling is
//! a thin adapter (the `controller` actor, `hub::HubCtx`) and unit tests run it on a
//! [`tether_control::store::MemoryStore`] with tokio's paused clock.
//!
//! Split by concern:
//! - [`accept`]: ManagedCluster creation (auto-accept), `tetherctl accept` and `deny`;
//! - [`csr`]: CSR validation, creation, signing exactly once (compare-and-swap), polls, GC;
//! - [`lease`]: lease renewals, the lease table, the grace monitor (Available=Unknown) and
//!   recovery.
//!
//! All writes of a ManagedCluster are compare-and-swap on the KV revision
//! ([`Registration::update_cluster`]), so two hub replicas (or a request racing the lease
//! monitor) never lose each other's updates.

pub mod accept;
pub mod csr;
pub mod lease;
#[cfg(test)]
mod tests;

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, SystemTime};

use tether_control::ControlError;
use tether_control::clock::SharedClock;
use tether_control::hub::RegistrationPolicy;
use tether_control::resources::{BootstrapTokenRecord, Condition, Event, Lease, ManagedCluster};
use tether_control::store::{Bucket, HubStore, Store};
use tether_pki::HubCa;

use crate::metrics::Metrics;

/// Annotation: certificates issued before this time are refused (set by deny).
pub const REVOKED_BEFORE_ANNOTATION: &str = "tether.io/certificates-revoked-before";
/// Annotation: the cluster was denied by an admin; auto-accept does not apply.
pub const DENIED_ANNOTATION: &str = "tether.io/denied";
/// CAS retries before giving up on a contended object.
pub(crate) const MAX_CAS_RETRIES: usize = 16;
/// Allowed difference between agent and hub clocks before ClockSynced=False.
pub(crate) const MAX_CLOCK_SKEW: Duration = Duration::from_secs(60);

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

pub(crate) type Result<T, E = HubError> = std::result::Result<T, E>;

pub(crate) fn reject<T>(msg: impl Into<String>) -> Result<T> {
    Err(HubError::Rejected(msg.into()))
}

pub(crate) fn csr_key(cluster: &str, name: &str) -> String {
    format!("{cluster}.{name}")
}

/// In-memory view of one cluster's lease, for the grace monitor and for deciding whether a
/// renewal must be written to KV.
#[derive(Debug, Clone)]
pub struct LeaseState {
    pub acquired: SystemTime,
    /// The latest renewal this replica knows of (served here, or read from KV).
    pub renew: SystemTime,
    pub duration_seconds: u32,
    pub marked_unknown: bool,
    /// True when `renew` is a renewal this replica served itself (exact); false when it came
    /// from KV (at most [`lease_persist_interval`] older than the real last renewal) or is a
    /// grace restart, so the monitor adds that interval to the grace.
    ///
    /// [`lease_persist_interval`]: tether_control::resources::lease_persist_interval
    pub exact: bool,
    /// The renew time of the newest stored lease this replica knows of (own write or watch);
    /// None when it knows of none.
    pub stored: Option<SystemTime>,
    /// The stored lease's holder identity (a change is always written).
    pub holder: String,
}

/// The registration state machine of one hub replica: the store, the clock, the CA and policy,
/// and the tables this process owns (rebuilt from the store at start).
pub struct Registration<S: Store = HubStore> {
    pub store: S,
    pub clock: SharedClock,
    /// Shared with the other signers of this process; its work runs in [`crate::signing`].
    pub ca: Arc<HubCa>,
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
    /// Read caches of the add-on buckets (the add-on controller's KV watches feed them) for
    /// add-on config requests and add-on lease renewals.
    pub addon_cache: Arc<crate::addon_cache::AddOnCache>,
}

impl<S: Store> std::fmt::Debug for Registration<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Registration").finish_non_exhaustive()
    }
}

impl<S: Store> Registration<S> {
    pub fn new(
        store: S,
        clock: SharedClock,
        ca: HubCa,
        policy: RegistrationPolicy,
        metrics: Metrics,
    ) -> Self {
        Self {
            store,
            clock,
            ca: Arc::new(ca),
            policy,
            metrics,
            leases: Mutex::new(HashMap::new()),
            pending: Mutex::new(HashMap::new()),
            first_seen: Mutex::new(HashMap::new()),
            clusters: RwLock::new(HashMap::new()),
            tokens: RwLock::new(HashMap::new()),
            addon_cache: Default::default(),
        }
    }

    pub(crate) fn cache_cluster(&self, mc: &ManagedCluster) {
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

    /// A change of `tether-managedclusters` seen by the watch (another replica, tetherctl): the
    /// cache follows, and a deleted cluster leaves the lease table.
    pub fn apply_cluster_change(&self, name: String, mc: Option<ManagedCluster>) {
        if mc.is_none()
            && let Ok(mut l) = self.leases.lock()
        {
            // A deleted cluster is no longer watched for lease expiry.
            l.remove(&name);
        }
        if let Ok(mut m) = self.clusters.write() {
            match mc {
                Some(mc) => m.insert(name, mc),
                None => m.remove(&name),
            };
        }
    }

    /// A change of `tether-leases` seen by the watch: renewals served by other replicas (queue
    /// groups) reach this one's lease table here.
    pub fn apply_lease_change(&self, cluster: String, lease: Option<Lease>) {
        match lease {
            Some(lease) => {
                self.observe_lease(&cluster, &lease);
            }
            None => {
                if let Ok(mut m) = self.leases.lock() {
                    m.remove(&cluster);
                }
            }
        }
    }

    /// A change of `tether-bootstrap-tokens` seen by the watch.
    pub fn apply_token_change(&self, id: String, token: Option<BootstrapTokenRecord>) {
        if let Ok(mut m) = self.tokens.write() {
            match token {
                Some(t) => m.insert(id, t),
                None => m.remove(&id),
            };
        }
    }

    pub(crate) async fn event(&self, ev: Event) {
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
                self.cache_cluster(&mc);
                return Ok(Some(mc));
            }
            if self
                .store
                .update(Bucket::Clusters, name, &mc, rev)
                .await?
                .is_some()
            {
                // The cache follows own writes at once (the watch follows later).
                self.cache_cluster(&mc);
                return Ok(Some(mc));
            }
        }
        reject(format!(
            "managedcluster {name}: too many concurrent updates, retry"
        ))
    }

    pub(crate) fn pending_count(&self, cluster: &str) -> usize {
        self.pending
            .lock()
            .map(|p| p.get(cluster).map_or(0, HashSet::len))
            .unwrap_or(0)
    }

    pub(crate) fn set_pending(&self, cluster: &str, csr: &str, pending: bool) {
        if let Ok(mut p) = self.pending.lock() {
            let set = p.entry(cluster.to_string()).or_default();
            if pending {
                set.insert(csr.to_string());
            } else {
                set.remove(csr);
            }
        }
    }
}

/// Reports whether a condition list has a condition.
pub fn has_condition(conds: &[Condition], t: &str, status: &str) -> bool {
    conds.iter().any(|c| c.type_ == t && c.status == status)
}
