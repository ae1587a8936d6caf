//! The service allowlist: which in-cluster services the service proxy may reach.
//!
//! Default deny. The effective list is the static `service_proxy.allow_services` of the config
//! plus every `ServiceProxyAllowlist` in the hub's `tether-serviceproxyallowlists` bucket,
//! followed by a KV watch ([`follow`]) on its own NATS connection:
//!
//! - a put that decodes and validates replaces that key's entries;
//! - a put that does not is ignored with a warning (`..._allowlist_rejected_total`): the key's
//!   last good version stays in force (cluster-proxy's ConfigMap parse-error rule);
//! - a delete removes the key's entries; with none left every service is denied.
//!
//! While NATS is unreachable the last-known list stays; the watch restarts with jittered
//! backoff and replays the bucket (history), which replaces the list as a whole.

use std::collections::HashMap;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use futures::StreamExt;
use prometheus::{IntCounter, IntGauge};
use tether_control::connect::{self, ConnectConfig};
use tether_control::service_proxy::{self, AllowedService};
use tether_control::store::Store as _;
use tether_control::store::{Bucket, HubStore};
use tether_runtime::{Backoff, BackoffConfig};
use tokio_util::sync::CancellationToken;

/// Budget of opening the store and the watch.
pub const WATCH_START_TIMEOUT: Duration = Duration::from_secs(15);

/// The effective allowlist.
pub struct Allowlist {
    static_entries: Vec<AllowedService>,
    hub: RwLock<Arc<HashMap<String, Vec<AllowedService>>>>,
    entries: IntGauge,
    rejected: IntCounter,
}

impl Allowlist {
    pub fn new(
        static_entries: Vec<AllowedService>,
        entries: IntGauge,
        rejected: IntCounter,
    ) -> Self {
        entries.set(static_entries.len() as i64);
        Self {
            static_entries,
            hub: RwLock::default(),
            entries,
            rejected,
        }
    }

    /// Whether `namespace/name:port` on `cluster` is allowed.
    pub fn admits(&self, cluster: &str, namespace: &str, name: &str, port: u16) -> bool {
        let hub = Arc::clone(&self.hub.read().unwrap_or_else(|p| p.into_inner()));
        self.static_entries
            .iter()
            .chain(hub.values().flatten())
            .any(|e| e.admits(cluster, namespace, name, port))
    }

    fn update(&self, f: impl FnOnce(&mut HashMap<String, Vec<AllowedService>>)) {
        let mut guard = self.hub.write().unwrap_or_else(|p| p.into_inner());
        let mut next = (**guard).clone();
        f(&mut next);
        let n = self.static_entries.len() + next.values().map(Vec::len).sum::<usize>();
        *guard = Arc::new(next);
        self.entries.set(n as i64);
    }

    /// Applies one KV change (`None` = deleted). Returns false when the value was rejected.
    pub fn apply(&self, key: &str, value: Option<serde_json::Value>) -> bool {
        match value {
            None => {
                tracing::info!(allowlist = key, "service allowlist deleted");
                self.update(|m| {
                    m.remove(key);
                });
                true
            }
            Some(v) => match service_proxy::parse(v) {
                Ok(a) if a.metadata.name == key => {
                    tracing::info!(
                        allowlist = key,
                        services = a.spec.services.len(),
                        "service allowlist applied"
                    );
                    self.update(|m| {
                        m.insert(key.to_owned(), a.spec.services);
                    });
                    true
                }
                Ok(a) => self.reject(
                    key,
                    &format!("metadata.name {:?} differs from the key", a.metadata.name),
                ),
                Err(e) => self.reject(key, &format!("{}: {}", e.field, e.message)),
            },
        }
    }

    fn reject(&self, key: &str, why: &str) -> bool {
        self.rejected.inc();
        tracing::warn!(
            allowlist = key,
            error = why,
            "invalid service allowlist ignored; its last good version stays in force"
        );
        false
    }

    /// Replaces the hub part after a (re)started watch replayed the bucket: keys absent from
    /// `seen` were deleted while the watch was down.
    fn retain(&self, seen: &std::collections::HashSet<String>) {
        self.update(|m| m.retain(|k, _| seen.contains(k)));
    }
}

/// Follows `tether-serviceproxyallowlists` until `exit`, reconnecting with jittered backoff.
pub async fn follow(
    allowlist: Arc<Allowlist>,
    connect_cfg: ConnectConfig,
    exit: CancellationToken,
) {
    let mut backoff = Backoff::new(BackoffConfig {
        initial: Duration::from_millis(200),
        max: Duration::from_secs(5),
        reset_after: Duration::from_secs(10),
        ..BackoffConfig::default()
    });
    loop {
        let why = tokio::select! {
            _ = exit.cancelled() => return,
            r = watch_once(&allowlist, &connect_cfg) => r,
        };
        tracing::warn!(reason = %why, "service allowlist watch ended; the last-known list stays");
        tokio::select! {
            _ = exit.cancelled() => return,
            _ = tokio::time::sleep(backoff.failed()) => {}
        }
    }
}

async fn watch_once(allowlist: &Allowlist, connect_cfg: &ConnectConfig) -> String {
    let start = async {
        let conn = connect::connect(connect_cfg)
            .await
            .map_err(|e| e.to_string())?;
        let store = HubStore::open(conn.client.clone())
            .await
            .map_err(|e| e.to_string())?;
        let keys: std::collections::HashSet<String> = store
            .keys(Bucket::ServiceProxyAllowlists)
            .await
            .map_err(|e| e.to_string())?
            .into_iter()
            .collect();
        let w = store
            .watch::<serde_json::Value>(Bucket::ServiceProxyAllowlists)
            .await
            .map_err(|e| e.to_string())?;
        Ok::<_, String>((conn, keys, w))
    };
    let (_conn, keys, w) = match tokio::time::timeout(WATCH_START_TIMEOUT, start).await {
        Ok(Ok(x)) => x,
        Ok(Err(e)) => return format!("cannot open the watch: {e}"),
        Err(_) => return "opening the watch timed out".into(),
    };
    allowlist.retain(&keys);
    let mut w = std::pin::pin!(w);
    while let Some((key, value)) = w.next().await {
        allowlist.apply(&key, value);
    }
    "watch ended".into()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn doc(name: &str, svc: &str) -> serde_json::Value {
        serde_json::json!({"apiVersion": "proxy.tether.io/v1alpha1", "kind": "ServiceProxyAllowlist",
            "metadata": {"name": name},
            "spec": {"services": [{"clusters": ["*"], "namespace": "default", "name": svc, "ports": [80]}]}})
    }

    #[test]
    fn default_deny_last_good_kept_delete_denies() {
        let a = Allowlist::new(
            vec![],
            IntGauge::new("g", "g").unwrap(),
            IntCounter::new("c", "c").unwrap(),
        );
        assert!(!a.admits("c1", "default", "web", 80));
        assert!(a.apply("main", Some(doc("main", "web"))));
        assert!(a.admits("c1", "default", "web", 80));
        assert!(!a.admits("c1", "default", "web", 81));
        // A bad update (an invalid port list) keeps the last good version.
        let mut bad = doc("main", "db");
        bad["spec"]["services"][0]["ports"] = serde_json::json!(["x"]);
        assert!(!a.apply("main", Some(bad)));
        assert!(a.admits("c1", "default", "web", 80));
        assert!(!a.admits("c1", "default", "db", 80));
        assert_eq!(a.rejected.get(), 1);
        assert_eq!(a.entries.get(), 1);
        // Deleted: everything denied.
        assert!(a.apply("main", None));
        assert!(!a.admits("c1", "default", "web", 80));
        assert_eq!(a.entries.get(), 0);
    }
}
