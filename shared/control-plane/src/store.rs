//! Hub state in JetStream: one KV bucket per resource kind, plus the events stream.
//!
//! Buckets (file storage, so state survives a NATS restart):
//! - `tether-managedclusters` — key `<cluster>` → [`ManagedCluster`]
//! - `tether-leases` — key `<cluster>` → [`Lease`]
//! - `tether-csrs` — key `<cluster>.<csr name>` → [`CertificateSigningRequest`]
//! - `tether-bootstrap-tokens` — key `<token id>` → [`BootstrapTokenRecord`]
//! - `tether-clustermanagementaddons` — key `<addon>` → ClusterManagementAddOn
//! - `tether-managedclusteraddons` — key `<cluster>.<addon>` → ManagedClusterAddOn
//! - `tether-addondeploymentconfigs` — key `<namespace>.<name>` → AddOnDeploymentConfig
//! - `tether-managedproxyconfigurations` — key `<name>` → ManagedProxyConfiguration
//! - `tether-addon-leases` — key `<cluster>.<addon>` → Lease (add-on health, Lease mode)
//! - `tether-brokers` — key `<broker id>` → [`crate::brokers::BrokerPresence`] (memory storage,
//!   renewed every couple of seconds; old keys age out)
//! - `tether-hubclients` — key `<client>` → [`crate::clients::HubClient`]
//! - `tether-clientaccesspolicies` — key `<policy>` → [`crate::clients::ClientAccessPolicy`]
//! - `tether-serviceproxyallowlists` — key `<name>` →
//!   [`crate::service_proxy::ServiceProxyAllowlist`]
//! - `tether-leaders` — key `<controller>` → [`crate::leader::LeaderRecord`] (which hub
//!   replica runs that controller)
//!
//! Stream `TETHER_EVENTS` on `tether.v1.events.>` receives an [`Event`] for every change.
//! Updates are compare-and-swap on the KV revision ([`HubStore::update`]).
//!
//! Replication ([`Replicas`]): every bucket and the stream are created with 3 replicas when the
//! server is part of a NATS cluster, 1 standalone. [`HubStore::open`] (tetherctl, brokers,
//! probers) keeps the replica count of what exists; the addon-manager opens with
//! [`Replicas::Exactly`] (hub.yaml `nats.replicas`, else that same default) and so upgrades
//! single-replica buckets in place: JetStream copies the data to the new peers.

use std::time::Duration;

use async_nats::jetstream::{self, kv, stream};
use futures::StreamExt;
use serde::{Serialize, de::DeserializeOwned};

use crate::connect::ControlError;
use crate::resources::Event;
use crate::subjects;

/// Events kept for a week, at most a million.
const EVENTS_MAX_AGE: Duration = Duration::from_secs(7 * 24 * 3600);
const EVENTS_MAX_MSGS: i64 = 1_000_000;

/// Which bucket.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Bucket {
    Clusters,
    Leases,
    Csrs,
    Tokens,
    ClusterManagementAddOns,
    ManagedClusterAddOns,
    AddOnDeploymentConfigs,
    ProxyConfigurations,
    AddOnLeases,
    Brokers,
    HubClients,
    ClientAccessPolicies,
    ServiceProxyAllowlists,
    Leaders,
}

const ALL_BUCKETS: [Bucket; 14] = [
    Bucket::Clusters,
    Bucket::Leases,
    Bucket::Csrs,
    Bucket::Tokens,
    Bucket::ClusterManagementAddOns,
    Bucket::ManagedClusterAddOns,
    Bucket::AddOnDeploymentConfigs,
    Bucket::ProxyConfigurations,
    Bucket::AddOnLeases,
    Bucket::Brokers,
    Bucket::HubClients,
    Bucket::ClientAccessPolicies,
    Bucket::ServiceProxyAllowlists,
    Bucket::Leaders,
];

impl Bucket {
    pub fn name(self) -> &'static str {
        match self {
            Bucket::Clusters => subjects::BUCKET_CLUSTERS,
            Bucket::Leases => subjects::BUCKET_LEASES,
            Bucket::Csrs => subjects::BUCKET_CSRS,
            Bucket::Tokens => subjects::BUCKET_TOKENS,
            Bucket::ClusterManagementAddOns => subjects::BUCKET_CLUSTER_MANAGEMENT_ADDONS,
            Bucket::ManagedClusterAddOns => subjects::BUCKET_MANAGED_CLUSTER_ADDONS,
            Bucket::AddOnDeploymentConfigs => subjects::BUCKET_ADDON_DEPLOYMENT_CONFIGS,
            Bucket::ProxyConfigurations => subjects::BUCKET_PROXY_CONFIGURATIONS,
            Bucket::AddOnLeases => subjects::BUCKET_ADDON_LEASES,
            Bucket::Brokers => subjects::BUCKET_BROKERS,
            Bucket::HubClients => subjects::BUCKET_HUB_CLIENTS,
            Bucket::ClientAccessPolicies => subjects::BUCKET_CLIENT_ACCESS_POLICIES,
            Bucket::ServiceProxyAllowlists => subjects::BUCKET_SERVICE_PROXY_ALLOWLISTS,
            Bucket::Leaders => subjects::BUCKET_LEADERS,
        }
    }

    /// History kept per key.
    fn history(self) -> i64 {
        match self {
            Bucket::Clusters
            | Bucket::ClusterManagementAddOns
            | Bucket::AddOnDeploymentConfigs
            | Bucket::ProxyConfigurations => 5,
            _ => 1,
        }
    }
}

/// How many JetStream replicas the buckets and the events stream get.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Replicas {
    /// Keep the count of what exists; create what is missing with [`default_replicas`].
    #[default]
    Keep,
    /// Exactly this many: existing buckets and the stream are updated in place.
    Exactly(usize),
}

/// The default replica count: 3 when the connected server belongs to a NATS cluster (set
/// `nats.replicas` for a cluster of 2), 1 standalone.
pub fn default_replicas(client: &async_nats::Client) -> usize {
    if client.server_info().cluster.is_some_and(|c| !c.is_empty()) {
        3
    } else {
        1
    }
}

/// The replica count to open stream `name` with: the requested one, else what it has, else
/// `fallback` for a new stream.
async fn replica_count(
    js: &jetstream::Context,
    name: &str,
    replicas: Replicas,
    fallback: usize,
) -> Result<usize, ControlError> {
    if let Replicas::Exactly(n) = replicas {
        return Ok(n);
    }
    match js.get_stream(name).await {
        Ok(s) => Ok(s.cached_info().config.num_replicas.max(1)),
        Err(e) => match e.kind() {
            jetstream::context::GetStreamErrorKind::JetStream(j)
                if j.error_code() == jetstream::ErrorCode::STREAM_NOT_FOUND =>
            {
                Ok(fallback)
            }
            _ => Err(js_err(e)),
        },
    }
}

/// Typed access to the hub buckets and the events stream.
#[derive(Clone)]
pub struct HubStore {
    js: jetstream::Context,
    /// One store per [`Bucket`], in [`ALL_BUCKETS`] order.
    stores: Vec<kv::Store>,
}

impl std::fmt::Debug for HubStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("HubStore")
    }
}

fn js_err(e: impl std::fmt::Display) -> ControlError {
    ControlError::JetStream(e.to_string())
}

impl HubStore {
    /// Opens (creating if needed) the buckets and the stream, keeping the replica count of
    /// those that exist ([`Replicas::Keep`]).
    pub async fn open(client: async_nats::Client) -> Result<Self, ControlError> {
        Self::open_with(client, Replicas::Keep).await
    }

    /// Opens (creating if needed) the buckets and the stream with `replicas`.
    pub async fn open_with(
        client: async_nats::Client,
        replicas: Replicas,
    ) -> Result<Self, ControlError> {
        let fallback = default_replicas(&client);
        let js = jetstream::new(client);
        let mut stores = Vec::with_capacity(ALL_BUCKETS.len());
        for b in ALL_BUCKETS {
            let mut cfg = kv::Config {
                bucket: b.name().to_string(),
                history: b.history(),
                storage: jetstream::stream::StorageType::File,
                ..Default::default()
            };
            if b == Bucket::Brokers {
                // Presence is soft state: rebuilt within seconds after a NATS restart.
                cfg.storage = jetstream::stream::StorageType::Memory;
                cfg.max_age = crate::brokers::PRESENCE_BUCKET_MAX_AGE;
            }
            cfg.num_replicas =
                replica_count(&js, &format!("KV_{}", b.name()), replicas, fallback).await?;
            stores.push(js.create_or_update_key_value(cfg).await.map_err(js_err)?);
        }
        let num_replicas = replica_count(&js, subjects::STREAM_EVENTS, replicas, fallback).await?;
        js.create_or_update_stream(stream::Config {
            name: subjects::STREAM_EVENTS.to_string(),
            subjects: vec![subjects::EVENTS_ALL.to_string()],
            max_age: EVENTS_MAX_AGE,
            max_messages: EVENTS_MAX_MSGS,
            storage: stream::StorageType::File,
            num_replicas,
            ..Default::default()
        })
        .await
        .map_err(js_err)?;
        Ok(Self { js, stores })
    }

    fn kv(&self, b: Bucket) -> &kv::Store {
        let i = ALL_BUCKETS.iter().position(|x| *x == b).unwrap_or(0);
        &self.stores[i]
    }

    pub fn jetstream(&self) -> &jetstream::Context {
        &self.js
    }

    /// The value and its revision.
    pub async fn get<T: DeserializeOwned>(
        &self,
        b: Bucket,
        key: &str,
    ) -> Result<Option<(T, u64)>, ControlError> {
        let entry = self.kv(b).entry(key).await.map_err(js_err)?;
        match entry {
            Some(e) if matches!(e.operation, kv::Operation::Put) => {
                let v = serde_json::from_slice(&e.value)
                    .map_err(|err| ControlError::Codec(format!("{}/{key}: {err}", b.name())))?;
                Ok(Some((v, e.revision)))
            }
            _ => Ok(None),
        }
    }

    pub async fn put<T: Serialize>(
        &self,
        b: Bucket,
        key: &str,
        v: &T,
    ) -> Result<u64, ControlError> {
        let bytes = serde_json::to_vec(v).map_err(|e| ControlError::Codec(e.to_string()))?;
        self.kv(b).put(key, bytes.into()).await.map_err(js_err)
    }

    /// Creates; `Ok(None)` when the key already exists.
    pub async fn create<T: Serialize>(
        &self,
        b: Bucket,
        key: &str,
        v: &T,
    ) -> Result<Option<u64>, ControlError> {
        let bytes = serde_json::to_vec(v).map_err(|e| ControlError::Codec(e.to_string()))?;
        match self.kv(b).create(key, bytes.into()).await {
            Ok(r) => Ok(Some(r)),
            Err(e) if e.kind() == kv::CreateErrorKind::AlreadyExists => Ok(None),
            Err(e) => Err(js_err(e)),
        }
    }

    /// Compare-and-swap; `Ok(None)` when the revision moved (re-read and retry).
    pub async fn update<T: Serialize>(
        &self,
        b: Bucket,
        key: &str,
        v: &T,
        revision: u64,
    ) -> Result<Option<u64>, ControlError> {
        let bytes = serde_json::to_vec(v).map_err(|e| ControlError::Codec(e.to_string()))?;
        match self.kv(b).update(key, bytes.into(), revision).await {
            Ok(r) => Ok(Some(r)),
            Err(e) if e.kind() == kv::UpdateErrorKind::WrongLastRevision => Ok(None),
            Err(e) => Err(js_err(e)),
        }
    }

    pub async fn delete(&self, b: Bucket, key: &str) -> Result<(), ControlError> {
        self.kv(b).delete(key).await.map_err(js_err)
    }

    /// All keys of a bucket.
    pub async fn keys(&self, b: Bucket) -> Result<Vec<String>, ControlError> {
        let mut keys = match self.kv(b).keys().await {
            Ok(k) => k,
            Err(e) => return Err(js_err(e)),
        };
        let mut out = Vec::new();
        while let Some(k) = keys.next().await {
            out.push(k.map_err(js_err)?);
        }
        Ok(out)
    }

    /// All values of a bucket (skips undecodable entries with a warning).
    pub async fn list<T: DeserializeOwned>(
        &self,
        b: Bucket,
    ) -> Result<Vec<(String, T, u64)>, ControlError> {
        let mut out = Vec::new();
        for k in self.keys(b).await? {
            if let Some((v, rev)) = self.get::<T>(b, &k).await.or_else(|e| {
                tracing::warn!(bucket = b.name(), key = %k, error = %e, "skipping entry");
                Ok::<_, ControlError>(None)
            })? {
                out.push((k, v, rev));
            }
        }
        Ok(out)
    }

    /// Current values of a bucket, then every change (None = deleted), as a stream. Decoding
    /// errors are logged and skipped.
    pub async fn watch<T: DeserializeOwned + Send + 'static>(
        &self,
        b: Bucket,
    ) -> Result<impl futures::Stream<Item = (String, Option<T>)> + Send + use<T>, ControlError>
    {
        let w = self.kv(b).watch_with_history(">").await.map_err(js_err)?;
        let name = b.name();
        Ok(w.filter_map(move |e| async move {
            let e = match e {
                Ok(e) => e,
                Err(err) => {
                    tracing::warn!(bucket = name, error = %err, "watch error");
                    return None;
                }
            };
            match e.operation {
                kv::Operation::Put => match serde_json::from_slice::<T>(&e.value) {
                    Ok(v) => Some((e.key, Some(v))),
                    Err(err) => {
                        tracing::warn!(bucket = name, key = %e.key, error = %err, "undecodable entry");
                        None
                    }
                },
                _ => Some((e.key, None)),
            }
        }))
    }

    /// Publishes an event on `tether.v1.events.<kind>.<name>` and waits for the stream's ack.
    pub async fn publish_event(&self, ev: &Event) -> Result<(), ControlError> {
        let subject = subjects::event(&ev.involved_object.kind, &ev.involved_object.name);
        let bytes = serde_json::to_vec(ev).map_err(|e| ControlError::Codec(e.to_string()))?;
        self.js
            .publish(subject, bytes.into())
            .await
            .map_err(js_err)?
            .await
            .map_err(js_err)?;
        Ok(())
    }

    /// The last `n` events (newest last), optionally for one object name.
    pub async fn recent_events(
        &self,
        n: usize,
        name: Option<&str>,
    ) -> Result<Vec<Event>, ControlError> {
        let stream = self
            .js
            .get_stream(subjects::STREAM_EVENTS)
            .await
            .map_err(js_err)?;
        let info = stream.get_info().await.map_err(js_err)?;
        let last = info.state.last_sequence;
        let first = info.state.first_sequence;
        let mut out = Vec::new();
        let mut seq = last;
        while seq >= first && seq > 0 && out.len() < n {
            if let Ok(m) = stream.get_raw_message(seq).await
                && let Ok(ev) = serde_json::from_slice::<Event>(&m.payload)
                && name.is_none_or(|n| ev.involved_object.name == n)
            {
                out.push(ev);
            }
            seq -= 1;
        }
        out.reverse();
        Ok(out)
    }
}
