//! The clusters the hub knows, as last read from `tether-managedclusters`.
//!
//! Until the broker has read the bucket once (no control plane configured, or NATS not reached
//! yet) the directory is *unsynced* and checks nothing: the broker behaves exactly as with a
//! static config. Once synced, the last-known state is kept through NATS outages.
//!
//! - tunnels: an agent whose certificate names a cluster that is unknown or not accepted
//!   (`spec.hubAcceptsClient: false`) is refused, with the reason sent to the agent;
//! - clients: a stream to such a cluster is answered `unknown_cluster` (CONNECT 404, gRPC
//!   `NotFound` / `DIAL_ERROR_CODE_UNKNOWN_CLUSTER`, konnectivity DIAL_RSP error), distinct
//!   from `no_tunnel` (a known cluster without a connected agent).

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, RwLock};

use tether_tunnel::DialError;
use tether_tunnel::wire::DialErrorKind;

/// What the broker needs of a ManagedCluster.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClusterInfo {
    pub accepted: bool,
    pub labels: BTreeMap<String, String>,
}

/// Shared, cheap to read.
#[derive(Default)]
pub struct ClusterDirectory {
    /// `None` until synced.
    inner: RwLock<Option<Arc<HashMap<String, ClusterInfo>>>>,
}

impl ClusterDirectory {
    /// Replaces the whole directory (marks it synced).
    pub fn set(&self, clusters: HashMap<String, ClusterInfo>) {
        *self.inner.write().expect("cluster directory lock") = Some(Arc::new(clusters));
    }

    /// The current snapshot (`None`: not synced).
    pub fn snapshot(&self) -> Option<Arc<HashMap<String, ClusterInfo>>> {
        self.inner.read().expect("cluster directory lock").clone()
    }

    pub fn is_synced(&self) -> bool {
        self.snapshot().is_some()
    }

    /// Labels of `cluster`, when known.
    pub fn labels(&self, cluster: &str) -> Option<BTreeMap<String, String>> {
        self.snapshot()?.get(cluster).map(|c| c.labels.clone())
    }

    /// Whether an agent of `cluster` may open a tunnel; the error is the reason told to it.
    pub fn admit(&self, cluster: &str) -> Result<(), String> {
        let Some(snap) = self.snapshot() else {
            return Ok(());
        };
        match snap.get(cluster) {
            Some(c) if c.accepted => Ok(()),
            Some(_) => Err(format!(
                "cluster {cluster} is not accepted by the hub (spec.hubAcceptsClient is false)"
            )),
            None => Err(format!(
                "cluster {cluster} is not registered on the hub (no ManagedCluster {cluster})"
            )),
        }
    }

    /// Whether clients may be routed to `cluster`; `unknown_cluster` otherwise.
    pub fn check_client(&self, cluster: &str) -> Result<(), DialError> {
        self.admit(cluster).map_err(|reason| {
            DialError::new(
                DialErrorKind::UnknownCluster,
                format!("unknown cluster {cluster}: {reason}"),
            )
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unsynced_checks_nothing_then_follows_the_hub() {
        let d = ClusterDirectory::default();
        assert!(d.admit("c1").is_ok());
        assert!(d.check_client("c1").is_ok());
        d.set(HashMap::from([
            (
                "c1".to_string(),
                ClusterInfo {
                    accepted: true,
                    labels: BTreeMap::new(),
                },
            ),
            (
                "c2".to_string(),
                ClusterInfo {
                    accepted: false,
                    labels: BTreeMap::new(),
                },
            ),
        ]));
        assert!(d.admit("c1").is_ok());
        assert!(d.admit("c2").unwrap_err().contains("not accepted"));
        let e = d.check_client("c3").unwrap_err();
        assert_eq!(e.kind, DialErrorKind::UnknownCluster);
        assert!(e.message.starts_with("unknown cluster c3"), "{}", e.message);
    }
}
