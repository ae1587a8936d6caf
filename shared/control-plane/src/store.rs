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
//! - `tether-brokers` — key `<broker id>` → `brokers::BrokerPresence` (memory storage,
//!   renewed every couple of seconds; old keys age out)
//! - `tether-hubclients` — key `<client>` → `clients::HubClient`
//! - `tether-clientaccesspolicies` — key `<policy>` → `clients::ClientAccessPolicy`
//! - `tether-serviceproxyallowlists` — key `<name>` →
//!   `service_proxy::ServiceProxyAllowlist`
//! - `tether-leaders` — key `<controller>` → `leader::LeaderRecord` (which hub
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
use bytes::Bytes;
use futures::StreamExt;
use serde::{Serialize, de::DeserializeOwned};

use crate::connect::ControlError;
use crate::resources::Event;
use crate::subjects;

/// Events kept for a week, at most a million.
const EVENTS_MAX_AGE: Duration = Duration::from_secs(7 * 24 * 3600);
const EVENTS_MAX_MSGS: i64 = 1_000_000;

/// How long a listing waits for the next message before it gives up on that consumer.
const LIST_IDLE_TIMEOUT: Duration = Duration::from_secs(5);
/// Consumers a listing tries before it reads message by message from the stream leader.
const LIST_ATTEMPTS: usize = 3;

/// The last entry of one key.
struct LastValue {
    key: String,
    value: Bytes,
    revision: u64,
}

/// The last live entry of each key, folded from a bucket's messages in stream order.
#[derive(Default)]
struct Live(std::collections::BTreeMap<String, LastValue>);

impl Live {
    /// One message on `subject` (the bucket's `prefix` and the key): a removal marker forgets the
    /// key, anything else is its last value.
    fn apply(&mut self, prefix: &str, subject: &str, removal: bool, value: Bytes, revision: u64) {
        let Some(key) = subject.strip_prefix(prefix) else {
            return;
        };
        if removal {
            self.0.remove(key);
            return;
        }
        let key = key.to_string();
        let last = LastValue {
            key: key.clone(),
            value,
            revision,
        };
        self.0.insert(key, last);
    }

    /// The live entries in key order.
    fn into_values(self) -> Vec<LastValue> {
        self.0.into_values().collect()
    }
}

/// How often a [`HubStore::watch`] checks that it keeps up with the stream leader.
pub const WATCH_CHECK_INTERVAL: Duration = Duration::from_secs(2);
/// Budget of that check (a stream info request to the leader).
const WATCH_CHECK_TIMEOUT: Duration = Duration::from_secs(2);

/// The state of a [`HubStore::watch`]: the library's watch, what it delivered and what the
/// stream leader had at the last check.
struct WatchState {
    kv: kv::Store,
    bucket: Bucket,
    /// `None` while it has to be (re-)opened.
    inner: Option<std::pin::Pin<Box<kv::Watch>>>,
    /// Highest revision delivered.
    delivered: u64,
    /// `delivered` at the last check.
    delivered_at_check: u64,
    /// The leader's last sequence at the last check, when the watch had not delivered it.
    leader_at_check: Option<u64>,
    check: tokio::time::Interval,
}

impl WatchState {
    /// The next change (waits for one; re-opens a stalled or ended watch).
    async fn next<T: DeserializeOwned>(&mut self) -> (String, Option<T>) {
        loop {
            if self.inner.is_none() {
                match self.kv.watch_with_history(">").await {
                    Ok(w) => {
                        self.inner = Some(Box::pin(w));
                        self.leader_at_check = None;
                    }
                    Err(e) => {
                        tracing::warn!(bucket = self.bucket.name(), error = %e, "cannot re-open watch");
                        self.check.tick().await;
                        continue;
                    }
                }
            }
            let Some(w) = self.inner.as_mut() else {
                continue;
            };
            tokio::select! {
                e = w.next() => match e {
                    None => {
                        tracing::warn!(bucket = self.bucket.name(), "watch ended; re-opening");
                        self.inner = None;
                        self.check.tick().await;
                    }
                    Some(Err(err)) => {
                        tracing::warn!(bucket = self.bucket.name(), error = %err, "watch error");
                    }
                    Some(Ok(e)) => {
                        self.delivered = self.delivered.max(e.revision);
                        if e.operation != kv::Operation::Put {
                            return (e.key, None);
                        }
                        if let Some(v) = decode_or_skip(self.bucket, &e.key, &e.value) {
                            return (e.key, Some(v));
                        }
                    }
                },
                _ = self.check.tick() => self.check_leader().await,
            }
        }
    }

    /// Compares what the watch delivered with the stream leader; drops a stalled watch.
    async fn check_leader(&mut self) {
        let stalled = self
            .leader_at_check
            .is_some_and(|l| self.delivered < l && self.delivered == self.delivered_at_check);
        if stalled {
            tracing::warn!(
                bucket = self.bucket.name(),
                delivered = self.delivered,
                leader = ?self.leader_at_check,
                "watch stalled behind the stream leader; re-opening"
            );
            self.inner = None;
            self.leader_at_check = None;
            return;
        }
        self.delivered_at_check = self.delivered;
        let stream = self.kv.stream.clone();
        self.leader_at_check =
            match tokio::time::timeout(WATCH_CHECK_TIMEOUT, stream.get_info()).await {
                Ok(Ok(info))
                    if info.state.messages > 0 && info.state.last_sequence > self.delivered =>
                {
                    Some(info.state.last_sequence)
                }
                _ => None,
            };
    }
}

/// A KV delete or purge marker (the `KV-Operation` header, or a server marker).
fn is_removal(headers: Option<&async_nats::HeaderMap>) -> bool {
    let Some(h) = headers else {
        return false;
    };
    if let Some(op) = h.get("KV-Operation") {
        return matches!(op.as_str(), "DEL" | "PURGE");
    }
    h.get("Nats-Marker-Reason").is_some()
}

/// A valid KV key: `[-/_=.a-zA-Z0-9]+`, not starting or ending with `.`.
fn valid_key(key: &str) -> bool {
    !key.is_empty()
        && !key.starts_with('.')
        && !key.ends_with('.')
        && key
            .bytes()
            .all(|c| c.is_ascii_alphanumeric() || b"-/_=.".contains(&c))
}

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
) -> StoreResult<usize> {
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

/// What every store operation answers.
pub type StoreResult<T> = Result<T, ControlError>;

/// A value as stored (JSON); the error names the bucket and key.
fn encode<T: Serialize>(b: Bucket, key: &str, v: &T) -> StoreResult<Bytes> {
    serde_json::to_vec(v)
        .map(Bytes::from)
        .map_err(|e| ControlError::Codec(format!("{}/{key}: {e}", b.name())))
}

/// A stored value; the error names the bucket and key.
fn decode<T: DeserializeOwned>(b: Bucket, key: &str, v: &[u8]) -> StoreResult<T> {
    serde_json::from_slice(v).map_err(|e| ControlError::Codec(format!("{}/{key}: {e}", b.name())))
}

/// A stored value, or `None` with a warning when it does not decode (listings and watches skip
/// such an entry rather than fail).
fn decode_or_skip<T: DeserializeOwned>(b: Bucket, key: &str, v: &[u8]) -> Option<T> {
    decode(b, key, v)
        .inspect_err(|e| tracing::warn!(error = %e, "skipping undecodable entry"))
        .ok()
}

fn js_err(e: impl std::fmt::Display) -> ControlError {
    ControlError::JetStream(e.to_string())
}

impl HubStore {
    /// Opens (creating if needed) the buckets and the stream, keeping the replica count of
    /// those that exist ([`Replicas::Keep`]).
    pub async fn open(client: async_nats::Client) -> StoreResult<Self> {
        Self::open_with(client, Replicas::Keep).await
    }

    /// Opens (creating if needed) the buckets and the stream with `replicas`.
    pub async fn open_with(client: async_nats::Client, replicas: Replicas) -> StoreResult<Self> {
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

    /// The last live (not deleted) entry of every key matching `filter`, read with one ordered
    /// push consumer (deliver policy last-per-subject) until the server reports nothing
    /// pending.
    ///
    /// The consumer may be placed on any replica of the stream, and one that is catching up
    /// (a node just restarted) delivers what it had. So a listing of the whole bucket first
    /// asks the stream leader for its last sequence and checks that the consumer delivered it;
    /// if not (or if the consumer goes quiet for [`LIST_IDLE_TIMEOUT`] before "0 pending"), it
    /// tries [`LIST_ATTEMPTS`] times and then reads the bucket message by message from the
    /// leader ([`Self::last_values_from_leader`]): slower, never stale.
    async fn last_values(
        &self,
        b: Bucket,
        filter: &str,
        headers_only: bool,
    ) -> StoreResult<Vec<LastValue>> {
        let kv = self.kv(b);
        let whole = filter == ">";
        for _ in 0..LIST_ATTEMPTS {
            let leader_last = if whole {
                let info = self
                    .js
                    .get_stream(&kv.stream_name)
                    .await
                    .map_err(js_err)?
                    .cached_info()
                    .clone();
                if info.state.messages == 0 {
                    return Ok(Vec::new());
                }
                Some(info.state.last_sequence)
            } else {
                None
            };
            if let Some(v) = self
                .last_values_once(b, filter, headers_only, leader_last)
                .await?
            {
                return Ok(v);
            }
        }
        tracing::warn!(
            bucket = b.name(),
            "list: the consumer lagged the stream leader; reading from the leader"
        );
        Self::last_values_from_leader(self.kv(b), filter, headers_only).await
    }

    /// One consumer pass; `None` when it stalled or delivered less than `leader_last`.
    async fn last_values_once(
        &self,
        b: Bucket,
        filter: &str,
        headers_only: bool,
        leader_last: Option<u64>,
    ) -> StoreResult<Option<Vec<LastValue>>> {
        let kv = self.kv(b);
        let consumer = kv
            .stream
            .create_consumer(jetstream::consumer::push::OrderedConfig {
                deliver_subject: self.js.client().new_inbox(),
                description: Some("tether list".to_string()),
                filter_subject: format!("{}{filter}", kv.prefix),
                headers_only,
                replay_policy: jetstream::consumer::ReplayPolicy::Instant,
                deliver_policy: jetstream::consumer::DeliverPolicy::LastPerSubject,
                ..Default::default()
            })
            .await
            .map_err(js_err)?;
        if consumer.cached_info().num_pending == 0 {
            return Ok(leader_last.is_none().then(Vec::new));
        }
        let mut messages = consumer.messages().await.map_err(js_err)?;
        let mut live = Live::default();
        let mut max_seq = 0;
        loop {
            let m = match tokio::time::timeout(LIST_IDLE_TIMEOUT, messages.next()).await {
                Ok(Some(m)) => m.map_err(js_err)?,
                Ok(None) => break,
                Err(_) => return Ok(None),
            };
            let info = m.info().map_err(js_err)?;
            let (revision, pending) = (info.stream_sequence, info.pending);
            max_seq = max_seq.max(revision);
            live.apply(
                &kv.prefix,
                &m.subject,
                is_removal(m.headers.as_ref()),
                m.payload.clone(),
                revision,
            );
            if pending == 0 {
                break;
            }
        }
        if leader_last.is_some_and(|l| max_seq < l) {
            return Ok(None);
        }
        Ok(Some(live.into_values()))
    }

    /// Every message of the keys matching `filter`, read one by one from the stream leader
    /// (`STREAM.MSG.GET` next-by-subject): the last one of each key wins.
    async fn last_values_from_leader(
        kv: &kv::Store,
        filter: &str,
        headers_only: bool,
    ) -> StoreResult<Vec<LastValue>> {
        let subject = format!("{}{filter}", kv.prefix);
        let mut live = Live::default();
        let mut seq = 1u64;
        loop {
            let m = match kv
                .stream
                .raw_message_builder()
                .sequence(seq)
                .next_by_subject(subject.clone())
                .send()
                .await
            {
                Ok(m) => m,
                Err(e)
                    if matches!(
                        e.kind(),
                        jetstream::stream::RawMessageErrorKind::NoMessageFound
                    ) =>
                {
                    break;
                }
                Err(e) => return Err(js_err(e)),
            };
            seq = m.sequence + 1;
            let value = if headers_only {
                Bytes::new()
            } else {
                m.payload
            };
            let removal = is_removal(Some(&m.headers));
            live.apply(&kv.prefix, &m.subject, removal, value, m.sequence);
        }
        Ok(live.into_values())
    }

    /// Current values of a bucket, then every change (None = deleted), as a stream. Decoding
    /// errors are logged and skipped.
    ///
    /// The watch is a consumer on one server of the NATS cluster. When that server dies or is
    /// cut off while this client stays connected elsewhere, the client library only notices
    /// after two missed idle heartbeats (10 s), and its re-creation retries back off to 10 s
    /// while JetStream has no leader — a broker then refused a cluster accepted 13 s earlier
    /// (`tests/tests/hub_chaos_tunnels.rs`). So every [`WATCH_CHECK_INTERVAL`] the watch asks
    /// the stream leader for its last sequence; a watch that delivered nothing in a whole
    /// interval although the leader had a later message at the previous check is stalled and
    /// re-opened (it then delivers every current value again: consumers must treat a repeated
    /// value as no change, which every watcher here does).
    pub async fn watch<T: DeserializeOwned + Send + 'static>(
        &self,
        b: Bucket,
    ) -> StoreResult<impl futures::Stream<Item = (String, Option<T>)> + Send + use<T>> {
        let kv = self.kv(b).clone();
        let w = kv.watch_with_history(">").await.map_err(js_err)?;
        let mut check = tokio::time::interval_at(
            tokio::time::Instant::now() + WATCH_CHECK_INTERVAL,
            WATCH_CHECK_INTERVAL,
        );
        check.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let state = WatchState {
            kv,
            bucket: b,
            inner: Some(Box::pin(w)),
            delivered: 0,
            delivered_at_check: 0,
            leader_at_check: None,
            check,
        };
        Ok(futures::stream::unfold(state, |mut st| async move {
            let item = st.next::<T>().await;
            Some((item, st))
        }))
    }

    /// The last `n` events (newest last), optionally for one object name.
    pub async fn recent_events(&self, n: usize, name: Option<&str>) -> StoreResult<Vec<Event>> {
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

pub mod memory;

pub use memory::MemoryStore;

/// The hub state the control-plane logic reads and writes: typed get / put / create /
/// compare-and-swap update by revision / delete / keys / list / watch per [`Bucket`], and the
/// events stream. [`HubStore`] is the JetStream implementation; [`MemoryStore`] keeps the same
/// semantics (per-bucket revisions, CAS conflicts, current-then-changes watches) in memory for
/// unit tests that run without NATS.
///
/// An implementation moves bytes: [`get_raw`](Self::get_raw), [`write_raw`](Self::write_raw),
/// [`list_raw`](Self::list_raw), [`delete`](Self::delete), [`keys_matching`](Self::keys_matching),
/// [`watch`](Self::watch) and [`publish_event`](Self::publish_event). The typed methods are
/// provided once here, so key validation, JSON encoding and the skipping of undecodable entries
/// are the same in every store.
///
/// Conflicts are values, not errors: [`create`](Self::create) answers `Ok(None)` when the key
/// exists and [`update`](Self::update) when the revision moved (re-read and retry). Errors are
/// [`ControlError::JetStream`] (the backend failed) and [`ControlError::Codec`] (a value does not
/// encode or decode).
pub trait Store: Clone + Send + Sync + 'static {
    /// The stored bytes of `key` (a valid key) and their revision; `None` when absent or
    /// deleted.
    fn get_raw(&self, b: Bucket, key: &str) -> impl Future<Output = StoreResult<Raw>> + Send;
    /// Writes `v` as `how` says; the new revision, `None` on a create or compare-and-swap
    /// conflict.
    fn write_raw(
        &self,
        b: Bucket,
        key: &str,
        v: Bytes,
        how: Write,
    ) -> impl Future<Output = Written> + Send;
    fn delete(&self, b: Bucket, key: &str) -> impl Future<Output = StoreResult<()>> + Send;
    /// The keys that match the NATS subject `filter` (`c1.>`: every key under `c1.`; `*` one
    /// token; `>` the rest).
    fn keys_matching(
        &self,
        b: Bucket,
        filter: &str,
    ) -> impl Future<Output = StoreResult<Vec<String>>> + Send;
    /// The stored bytes, key and revision of every live key that matches `filter`, in key order.
    fn list_raw(
        &self,
        b: Bucket,
        filter: &str,
    ) -> impl Future<Output = StoreResult<Vec<RawEntry>>> + Send;
    /// Current values of a bucket, then every change (`None` = deleted).
    fn watch<T: DeserializeOwned + Send + 'static>(
        &self,
        b: Bucket,
    ) -> impl Future<Output = StoreResult<futures::stream::BoxStream<'static, (String, Option<T>)>>> + Send;
    /// Appends an event to the events stream.
    fn publish_event(&self, ev: &Event) -> impl Future<Output = StoreResult<()>> + Send;

    /// The value and its revision; `None` when absent or deleted. An invalid key is an error.
    fn get<T: DeserializeOwned>(
        &self,
        b: Bucket,
        key: &str,
    ) -> impl Future<Output = StoreResult<Option<(T, u64)>>> + Send {
        async move {
            if !valid_key(key) {
                return Err(ControlError::JetStream(format!(
                    "{}: invalid key {key:?}",
                    b.name()
                )));
            }
            match self.get_raw(b, key).await? {
                Some((v, rev)) => Ok(Some((decode(b, key, &v)?, rev))),
                None => Ok(None),
            }
        }
    }
    /// Writes unconditionally; returns the new revision.
    fn put<T: Serialize>(
        &self,
        b: Bucket,
        key: &str,
        v: &T,
    ) -> impl Future<Output = StoreResult<u64>> + Send {
        let written = self.write(b, key, v, Write::Put);
        async move {
            written.await?.ok_or_else(|| {
                ControlError::JetStream(format!("{}: a put answered a conflict", b.name()))
            })
        }
    }
    /// Creates; `Ok(None)` when the key already exists.
    fn create<T: Serialize>(
        &self,
        b: Bucket,
        key: &str,
        v: &T,
    ) -> impl Future<Output = Written> + Send {
        self.write(b, key, v, Write::Create)
    }
    /// Compare-and-swap on `revision`; `Ok(None)` when the revision moved (re-read and retry).
    fn update<T: Serialize>(
        &self,
        b: Bucket,
        key: &str,
        v: &T,
        revision: u64,
    ) -> impl Future<Output = Written> + Send {
        self.write(b, key, v, Write::Update(revision))
    }
    /// Encodes `v` and writes it as `how` says.
    fn write<T: Serialize>(
        &self,
        b: Bucket,
        key: &str,
        v: &T,
        how: Write,
    ) -> impl Future<Output = Written> + Send {
        let bytes = encode(b, key, v);
        async move { self.write_raw(b, key, bytes?, how).await }
    }
    /// All keys of a bucket.
    fn keys(&self, b: Bucket) -> impl Future<Output = StoreResult<Vec<String>>> + Send {
        self.keys_matching(b, ">")
    }
    /// All values of a bucket with their keys and revisions (undecodable entries skipped).
    fn list<T: DeserializeOwned + Send>(
        &self,
        b: Bucket,
    ) -> impl Future<Output = StoreResult<Vec<(String, T, u64)>>> + Send {
        self.list_matching(b, ">")
    }
    /// The values of the keys that match `filter` (see [`Self::keys_matching`]), undecodable
    /// entries skipped.
    fn list_matching<T: DeserializeOwned + Send>(
        &self,
        b: Bucket,
        filter: &str,
    ) -> impl Future<Output = StoreResult<Vec<(String, T, u64)>>> + Send {
        async move {
            let raw = self.list_raw(b, filter).await?;
            Ok(raw
                .into_iter()
                .filter_map(|(k, v, rev)| decode_or_skip(b, &k, &v).map(|t| (k, t, rev)))
                .collect())
        }
    }
}

/// What [`Store::get_raw`] answers: the stored bytes and their revision.
pub type Raw = Option<(Bytes, u64)>;
/// A listed entry: key, stored bytes, revision.
pub type RawEntry = (String, Bytes, u64);
/// What a write answers: the new revision, `None` on a conflict.
pub type Written = StoreResult<Option<u64>>;

/// How [`Store::write_raw`] treats the current value of the key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Write {
    /// Unconditionally.
    Put,
    /// Only when the key does not exist.
    Create,
    /// Only when the key's revision is still this one (compare-and-swap).
    Update(u64),
}

impl Store for HubStore {
    /// The value and its revision, read from the stream leader.
    ///
    /// Not a KV "direct get": JetStream answers those from any replica, and a replica that
    /// is catching up (a node just restarted or thawed after a partition) answers with what it
    /// had — an old lease renewal time, or "no such key" for a cluster created while it was
    /// away. The controllers act on these reads (an add-on of a "missing" cluster is removed,
    /// a lease that "stopped" turns its add-on Unavailable), so every read goes to the leader,
    /// which orders it after every acknowledged write. Seen in `tests/tests/hub_chaos_tunnels.rs`.
    async fn get_raw(&self, b: Bucket, key: &str) -> StoreResult<Raw> {
        let kv = self.kv(b);
        let subject = format!("{}{key}", kv.prefix);
        let m = match kv.stream.get_last_raw_message_by_subject(&subject).await {
            Ok(m) => m,
            Err(e)
                if matches!(
                    e.kind(),
                    jetstream::stream::LastRawMessageErrorKind::NoMessageFound
                ) =>
            {
                return Ok(None);
            }
            Err(e) => return Err(js_err(e)),
        };
        if is_removal(Some(&m.headers)) {
            return Ok(None);
        }
        Ok(Some((m.payload, m.sequence)))
    }

    async fn write_raw(&self, b: Bucket, key: &str, v: Bytes, how: Write) -> Written {
        let kv = self.kv(b);
        match how {
            Write::Put => kv.put(key, v).await.map(Some).map_err(js_err),
            Write::Create => match kv.create(key, v).await {
                Ok(r) => Ok(Some(r)),
                Err(e) if e.kind() == kv::CreateErrorKind::AlreadyExists => Ok(None),
                Err(e) => Err(js_err(e)),
            },
            Write::Update(rev) => match kv.update(key, v, rev).await {
                Ok(r) => Ok(Some(r)),
                Err(e) if e.kind() == kv::UpdateErrorKind::WrongLastRevision => Ok(None),
                Err(e) => Err(js_err(e)),
            },
        }
    }

    async fn delete(&self, b: Bucket, key: &str) -> StoreResult<()> {
        self.kv(b).delete(key).await.map_err(js_err)
    }

    /// The keys of a bucket that match the NATS subject `filter` (`>` for all, `c1.>` for
    /// every key under `c1.`): one ordered consumer that delivers only the headers of the last
    /// message of each key, so the cost follows the number of matching keys, not the bucket.
    async fn keys_matching(&self, b: Bucket, filter: &str) -> StoreResult<Vec<String>> {
        Ok(self
            .last_values(b, filter, true)
            .await?
            .into_iter()
            .map(|e| e.key)
            .collect())
    }

    /// One ordered consumer delivers the last value of every key in one stream of messages (the
    /// KV "watch with history" without the watch): one round trip to set up and then a flow of
    /// messages, instead of a get per key (65 s for 10,000 clusters through three nodes before,
    /// see docs/scale.md).
    async fn list_raw(&self, b: Bucket, filter: &str) -> StoreResult<Vec<RawEntry>> {
        Ok(self
            .last_values(b, filter, false)
            .await?
            .into_iter()
            .map(|e| (e.key, e.value, e.revision))
            .collect())
    }

    async fn watch<T: DeserializeOwned + Send + 'static>(
        &self,
        b: Bucket,
    ) -> StoreResult<futures::stream::BoxStream<'static, (String, Option<T>)>> {
        Ok(HubStore::watch::<T>(self, b).await?.boxed())
    }

    /// Publishes an event on `tether.v1.events.<kind>.<name>` and waits for the stream's ack.
    async fn publish_event(&self, ev: &Event) -> StoreResult<()> {
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
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_validity() {
        assert!(valid_key("c1"));
        assert!(valid_key("c1.cluster-proxy"));
        assert!(!valid_key(""));
        assert!(!valid_key(".c1"));
        assert!(!valid_key("c1."));
        assert!(!valid_key("c 1"));
        assert!(!valid_key("c1.>"));
    }

    #[test]
    fn removal_markers() {
        assert!(!is_removal(None));
        let mut h = async_nats::HeaderMap::new();
        h.insert("KV-Operation", "DEL");
        assert!(is_removal(Some(&h)));
        let mut h = async_nats::HeaderMap::new();
        h.insert("KV-Operation", "PURGE");
        assert!(is_removal(Some(&h)));
        let mut h = async_nats::HeaderMap::new();
        h.insert("Nats-Msg-Id", "x");
        assert!(!is_removal(Some(&h)));
    }
}
