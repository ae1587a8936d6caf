//! Read caches of the add-on buckets the per-agent request paths read: ManagedClusterAddOns,
//! add-on leases, AddOnDeploymentConfigs and ManagedProxyConfigurations.
//!
//! At 10,000 clusters the add-on agents ask for their config every ~33 s (their safety resync)
//! and renew their add-on lease every 60–75 s: ≈ 450 requests per second, each of which read
//! two to three keys from the stream leader (`STREAM.MSG.GET`, a JetStream API request routed
//! to the leader node) — most of the nats-servers' CPU (docs/scale.md, "Profile").
//!
//! The broker set the config requests list comes from the broker watcher's listing
//! ([`AddOnCache::set_brokers`], once per `delivery::BROKER_CHECK_INTERVAL`, 1 s; it notifies
//! every agent after a change) instead of a listing per request (a consumer on `tether-brokers`
//! per config request once brokers exist).
//!
//! **What the cache holds: exactly what the add-on controller's KV watches delivered**
//! ([`AddOnCache::apply`], fed by the add-on watch task of the `addons` module), in stream
//! order, nothing else — not this replica's own writes and not the results of read-through
//! misses, so a delete the watch delivered can never be overwritten by an older value. A key
//! the cache does not hold (not delivered yet, just after a start or a watch re-open) is
//! read from the stream leader as before, without being cached.
//!
//! **What a lagging view can do** (a watch is milliseconds behind the leader; longer only while
//! its consumer sits on a node that is being given up): an add-on lease renewal compares with
//! an older stored renew time and writes *more* often, never less; a config request may see a
//! ManagedClusterAddOn that was just deleted (the agent then stops at its next config read) or
//! the previous config hashes (the controller's `AddOnConfigChanged` notification is followed by
//! the agent's re-read, and its 30 s resync reads again); an add-on that is not in the cache is
//! never reported "not installed" without a leader read.

use std::collections::HashMap;
use std::sync::RwLock;

use serde::de::DeserializeOwned;
use tether_control::ControlError;
use tether_control::addons::{
    AddOnDeploymentConfig, ManagedClusterAddOn, ManagedProxyConfiguration,
};
use tether_control::brokers::BrokerPresence;
use tether_control::resources::Lease;
use tether_control::store::{Bucket, Store};

/// One bucket's last values as the watch delivered them.
#[derive(Debug)]
struct Map<T>(RwLock<HashMap<String, T>>);

impl<T> Default for Map<T> {
    fn default() -> Self {
        Self(RwLock::new(HashMap::new()))
    }
}

impl<T: Clone + DeserializeOwned> Map<T> {
    fn apply(&self, key: &str, value: Option<&serde_json::Value>) {
        let decoded = value.and_then(|v| T::deserialize(v).ok());
        let mut m = self.0.write().unwrap_or_else(|e| e.into_inner());
        match decoded {
            Some(v) => {
                m.insert(key.to_string(), v);
            }
            // Deleted, or a value this replica cannot decode: not cached (reads go to KV).
            None => {
                m.remove(key);
            }
        }
    }

    fn clear(&self) {
        self.0.write().unwrap_or_else(|e| e.into_inner()).clear();
    }

    fn cached(&self, key: &str) -> Option<T> {
        self.0
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(key)
            .cloned()
    }

    /// The cached value, else the stored one (read from the leader, not cached).
    async fn get(
        &self,
        store: &impl Store,
        b: Bucket,
        key: &str,
    ) -> Result<Option<T>, ControlError> {
        if let Some(v) = self.cached(key) {
            return Ok(Some(v));
        }
        Ok(store.get::<T>(b, key).await?.map(|(v, _)| v))
    }

    fn len(&self) -> usize {
        self.0.read().unwrap_or_else(|e| e.into_inner()).len()
    }
}

/// The add-on read caches (see the module docs); shared behind an `Arc`.
#[derive(Debug, Default)]
pub struct AddOnCache {
    addons: Map<ManagedClusterAddOn>,
    leases: Map<Lease>,
    deployment_configs: Map<AddOnDeploymentConfig>,
    proxy_configs: Map<ManagedProxyConfiguration>,
    /// The broker watcher's last listing of `tether-brokers` (every announced broker).
    brokers: RwLock<Option<Vec<BrokerPresence>>>,
}

impl AddOnCache {
    /// Takes one watch delivery of `b` (`None`: deleted). Buckets not cached are ignored.
    pub fn apply(&self, b: Bucket, key: &str, value: Option<&serde_json::Value>) {
        match b {
            Bucket::ManagedClusterAddOns => self.addons.apply(key, value),
            Bucket::AddOnLeases => self.leases.apply(key, value),
            Bucket::AddOnDeploymentConfigs => self.deployment_configs.apply(key, value),
            Bucket::ProxyConfigurations => self.proxy_configs.apply(key, value),
            _ => {}
        }
    }

    /// Forgets `b` (its watch is re-opened and delivers every key again).
    pub fn clear(&self, b: Bucket) {
        match b {
            Bucket::ManagedClusterAddOns => self.addons.clear(),
            Bucket::AddOnLeases => self.leases.clear(),
            Bucket::AddOnDeploymentConfigs => self.deployment_configs.clear(),
            Bucket::ProxyConfigurations => self.proxy_configs.clear(),
            _ => {}
        }
    }

    /// ManagedClusterAddOn `<cluster>.<addon>`.
    pub async fn addon(
        &self,
        store: &impl Store,
        key: &str,
    ) -> Result<Option<ManagedClusterAddOn>, ControlError> {
        self.addons
            .get(store, Bucket::ManagedClusterAddOns, key)
            .await
    }

    /// The add-on lease `<cluster>.<addon>`.
    pub async fn lease(
        &self,
        store: &impl Store,
        key: &str,
    ) -> Result<Option<Lease>, ControlError> {
        self.leases.get(store, Bucket::AddOnLeases, key).await
    }

    /// AddOnDeploymentConfig `<namespace>.<name>`.
    pub async fn deployment_config(
        &self,
        store: &impl Store,
        key: &str,
    ) -> Result<Option<AddOnDeploymentConfig>, ControlError> {
        self.deployment_configs
            .get(store, Bucket::AddOnDeploymentConfigs, key)
            .await
    }

    /// ManagedProxyConfiguration `<name>`.
    pub async fn proxy_config(
        &self,
        store: &impl Store,
        key: &str,
    ) -> Result<Option<ManagedProxyConfiguration>, ControlError> {
        self.proxy_configs
            .get(store, Bucket::ProxyConfigurations, key)
            .await
    }

    /// Keeps the broker watcher's latest listing (the `delivery` module, every
    /// `BROKER_CHECK_INTERVAL`).
    pub fn set_brokers(&self, all: Vec<BrokerPresence>) {
        *self.brokers.write().unwrap_or_else(|e| e.into_inner()) = Some(all);
    }

    /// The broker watcher's latest listing; `None` before its first one.
    pub fn brokers(&self) -> Option<Vec<BrokerPresence>> {
        self.brokers
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// How many keys are cached (add-ons, add-on leases).
    pub fn sizes(&self) -> (usize, usize) {
        (self.addons.len(), self.leases.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tether_control::store::MemoryStore;

    fn mca_value(cluster: &str, ns: &str) -> serde_json::Value {
        let mut m = ManagedClusterAddOn::new(cluster, "a");
        m.spec.install_namespace = ns.into();
        serde_json::to_value(m).unwrap()
    }

    #[tokio::test]
    async fn serves_what_the_watch_delivered_and_reads_kv_otherwise() {
        let store = MemoryStore::default();
        let cache = AddOnCache::default();
        // Nothing delivered, nothing stored: absent.
        assert!(cache.addon(&store, "c1.a").await.unwrap().is_none());
        // Stored but not delivered: read from KV, not cached.
        let mut stored = ManagedClusterAddOn::new("c1", "a");
        stored.spec.install_namespace = "kv".into();
        store
            .put(Bucket::ManagedClusterAddOns, "c1.a", &stored)
            .await
            .unwrap();
        let got = cache.addon(&store, "c1.a").await.unwrap().unwrap();
        assert_eq!(got.spec.install_namespace, "kv");
        assert_eq!(cache.sizes().0, 0);
        // Delivered: served from the cache (it differs from KV here on purpose).
        cache.apply(
            Bucket::ManagedClusterAddOns,
            "c1.a",
            Some(&mca_value("c1", "watched")),
        );
        let got = cache.addon(&store, "c1.a").await.unwrap().unwrap();
        assert_eq!(got.spec.install_namespace, "watched");
        // A delete delivered: back to KV.
        cache.apply(Bucket::ManagedClusterAddOns, "c1.a", None);
        let got = cache.addon(&store, "c1.a").await.unwrap().unwrap();
        assert_eq!(got.spec.install_namespace, "kv");
        // Clear forgets everything of that bucket only.
        cache.apply(
            Bucket::ManagedClusterAddOns,
            "c2.a",
            Some(&mca_value("c2", "w")),
        );
        let lease = serde_json::json!({"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
            "metadata": {"name": "a"}, "spec": {"holderIdentity": "h", "leaseDurationSeconds": 60,
            "acquireTime": "2026-01-01T00:00:00Z", "renewTime": "2026-01-01T00:00:00Z"}});
        cache.apply(Bucket::AddOnLeases, "c2.a", Some(&lease));
        assert_eq!(cache.sizes(), (1, 1));
        cache.clear(Bucket::ManagedClusterAddOns);
        assert_eq!(cache.sizes(), (0, 1));
        let l = cache.lease(&store, "c2.a").await.unwrap().unwrap();
        assert_eq!(l.spec.holder_identity, "h");
        // Undecodable values are not cached.
        cache.apply(
            Bucket::AddOnLeases,
            "c2.a",
            Some(&serde_json::json!({"spec": 3})),
        );
        assert_eq!(cache.sizes(), (0, 0));
    }
}
