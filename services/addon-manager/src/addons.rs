//! The add-on controller (OCM's addon-manager hub controllers, for `cluster-proxy` and any other
//! ClusterManagementAddOn).
//!
//! For every ClusterManagementAddOn and every accepted ManagedCluster its install strategy
//! selects, it keeps a ManagedClusterAddOn `<cluster>/<addon>`; it deletes those whose cluster
//! is gone or no longer accepted, whose ClusterManagementAddOn is gone, or (when it installed
//! them) whose cluster no longer matches. For each it resolves the configs (the add-on's own
//! `spec.configs`, else the ClusterManagementAddOn's `defaultConfigs`), writes
//! `status.configReferences` with the desired spec hashes, and sets the conditions:
//! - Progressing=True until the agent reports the desired hashes as applied on
//!   `tether.v1.cluster.<c>.addon.<a>.status`, then False;
//! - Available from the add-on lease (`tether-addon-leases`, key `<cluster>.<addon>`) and the
//!   data plane: True only while every live, non-draining broker reports in its presence
//!   (`tether-brokers`, `clusters`) that it holds a tunnel of the cluster - whatever runtime the
//!   agent runs in, nothing the agent reports about its tunnels is trusted; Unknown whenever the
//!   cluster itself is Unknown;
//! - Degraded=True when a referenced config does not exist.
//!
//! The actor coalesces changes: KV watches on every input bucket send [`ChangedKey`] (or
//! [`Changed`] for everything), and one reconcile runs at a time (another follows if something
//! changed meanwhile). A change of a cluster, one of its add-ons or an add-on lease reconciles
//! only that cluster's add-ons ([`Scope::Clusters`]); a change of a ClusterManagementAddOn, a
//! config or the broker set reconciles everything. The next add-on lease expiry is scheduled
//! for its deadline (a full pass); a slow resync covers anything missed.

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, SystemTime};

use actix::prelude::*;
use futures::StreamExt;
use tether_control::ControlError;
use tether_control::addons::{
    self, AddOnDeploymentConfig, AddOnLeaseRenew, AddOnLeaseReply, AddOnStatusReport,
    ClusterManagementAddOn, ConfigKind, ConfigReference, ConfigSpecHash, ManagedClusterAddOn,
    ManagedProxyConfiguration, addon_key, spec_hash,
};
use tether_control::resources::{
    Event, Lease, LeaseSpec, ManagedCluster, ObjectMeta, condition as mc_condition,
    lease_persist_interval, parse_rfc3339, rfc3339, set_condition,
};
use tether_control::store::{Bucket, HubStore, Store};
use tether_control::subjects;
use tokio_util::sync::CancellationToken;

use crate::addon_cache::AddOnCache;
use crate::brokers;

/// Annotation on ManagedClusterAddOns the controller created from an install strategy (those
/// it deletes again when the cluster stops matching).
pub const INSTALLED_BY_ANNOTATION: &str = "tether.io/installed-by";
/// Add-on lease grace: Available=False after this many lease durations without renewal
/// (OCM: 60 s lease, 300 s).
pub const ADDON_LEASE_GRACE_MULTIPLIER: u32 = 5;
/// Up to this many clusters in a scoped pass, their add-on keys are listed cluster by cluster
/// (one filtered listing each); more, and one listing of the whole bucket is cheaper.
const SCOPED_KEY_LISTS_MAX: usize = 32;
/// Safety resync of everything (changes arrive through KV watches; lease expiries are
/// scheduled for their exact deadline).
pub const RESYNC_INTERVAL: Duration = Duration::from_secs(30);
/// Slack after a lease deadline before re-evaluating it.
const DEADLINE_SLACK: Duration = Duration::from_millis(50);
pub const MAILBOX_CAPACITY: usize = 64;
pub const QUEUE_GROUP: &str = "tether-addons";
/// Add-on status reports and lease renewals handled at once per subject.
pub const MAX_INFLIGHT_AGENT_REPORTS: usize = 16;

/// Something changed that may affect every add-on: reconcile everything.
#[derive(Message)]
#[rtype(result = "()")]
pub struct Changed;

/// One key of an input bucket changed.
#[derive(Message, Debug)]
#[rtype(result = "()")]
pub struct ChangedKey {
    pub bucket: Bucket,
    pub key: String,
}

/// What these clusters' add-on Available depends on changed on the data-plane side (which
/// serving brokers report a tunnel of them, [`crate::brokers::TunnelHolders`]): reconcile their
/// add-ons.
#[derive(Message, Debug)]
#[rtype(result = "()")]
pub struct ClustersChanged(pub std::collections::BTreeSet<String>);

/// What a reconcile pass looks at.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Scope {
    All,
    /// Only the add-ons of these clusters (their install/removal, configs, conditions).
    Clusters(std::collections::BTreeSet<String>),
}

impl Scope {
    fn none() -> Self {
        Scope::Clusters(Default::default())
    }

    fn is_empty(&self) -> bool {
        matches!(self, Scope::Clusters(c) if c.is_empty())
    }

    fn merge(&mut self, other: Scope) {
        match (&mut *self, other) {
            (Scope::All, _) => {}
            (_, Scope::All) => *self = Scope::All,
            (Scope::Clusters(a), Scope::Clusters(b)) => a.extend(b),
        }
    }

    /// The scope a change of `key` in `bucket` needs.
    pub fn for_key(bucket: Bucket, key: &str) -> Self {
        match bucket {
            Bucket::Clusters => Scope::Clusters([key.to_string()].into()),
            Bucket::ManagedClusterAddOns | Bucket::AddOnLeases => match key.split_once('.') {
                Some((cluster, _)) => Scope::Clusters([cluster.to_string()].into()),
                None => Scope::All,
            },
            _ => Scope::All,
        }
    }
}

/// An agent's report of what it applied.
#[derive(Debug)]
pub struct StatusReport {
    pub cluster: String,
    pub addon: String,
    pub report: AddOnStatusReport,
}

/// Why an add-on agent's request was refused (the message goes back to the agent).
#[derive(Debug, thiserror::Error)]
pub enum AgentRequestError {
    #[error("subject {0} names no cluster/add-on")]
    Subject(String),
    #[error("malformed add-on {what} body: {source}")]
    Malformed {
        what: &'static str,
        #[source]
        source: serde_json::Error,
    },
    #[error(transparent)]
    Control(#[from] ControlError),
    #[error("controller unavailable: {0}")]
    Unavailable(#[from] actix::MailboxError),
}

/// A request from an add-on agent; the reply is its JSON body.
#[derive(Message, Debug)]
#[rtype(result = "Result<serde_json::Value, AgentRequestError>")]
pub enum AgentRequest {
    Status(StatusReport),
    Lease {
        cluster: String,
        addon: String,
        body: AddOnLeaseRenew,
    },
}

pub struct AddOnController {
    store: HubStore,
    /// Publishes `AddOnConfigChanged` on `tether.v1.cluster.<c>.notify` (None in unit tests).
    notify: Option<async_nats::Client>,
    running: bool,
    /// What changed since the running pass started.
    dirty: Scope,
    /// The pending re-evaluation at the next add-on lease deadline, and when it fires.
    deadline: Option<(SpawnHandle, std::time::Instant)>,
    /// What the add-on lease renewals read (fed by the watches of [`start`]).
    cache: std::sync::Arc<AddOnCache>,
}

impl AddOnController {
    pub fn start_with(store: HubStore, notify: Option<async_nats::Client>) -> Addr<Self> {
        Self::start_cached(store, notify, Default::default())
    }

    /// Like [`Self::start_with`], serving add-on lease renewals through `cache` (the one
    /// [`start`] feeds).
    pub fn start_cached(
        store: HubStore,
        notify: Option<async_nats::Client>,
        cache: std::sync::Arc<AddOnCache>,
    ) -> Addr<Self> {
        Self::create(|c| {
            c.set_mailbox_capacity(MAILBOX_CAPACITY);
            Self {
                store,
                notify,
                running: false,
                dirty: Scope::none(),
                deadline: None,
                cache,
            }
        })
    }

    fn kick(&mut self, ctx: &mut Context<Self>) {
        self.kick_scope(ctx, Scope::All);
    }

    fn kick_scope(&mut self, ctx: &mut Context<Self>, scope: Scope) {
        self.dirty.merge(scope);
        if self.running || self.dirty.is_empty() {
            return;
        }
        self.running = true;
        let scope = std::mem::replace(&mut self.dirty, Scope::none());
        let full = scope == Scope::All;
        let store = self.store.clone();
        let notify = self.notify.clone();
        ctx.spawn(
            async move { reconcile(&store, notify.as_ref(), &scope).await }
                .into_actor(self)
                .map(move |r, act, ctx| {
                    match r {
                        Err(e) => {
                            tracing::warn!(error = %e, "add-on reconcile failed");
                            act.dirty.merge(Scope::All);
                        }
                        Ok((_, next)) => {
                            let at = next.map(|d| std::time::Instant::now() + d);
                            // A partial pass only knows its own leases: it may bring the
                            // deadline forward, never push it back.
                            let keep = !full
                                && act
                                    .deadline
                                    .as_ref()
                                    .is_some_and(|(_, t)| at.is_none_or(|a| *t <= a));
                            if !keep {
                                if let Some((h, _)) = act.deadline.take() {
                                    ctx.cancel_future(h);
                                }
                                if let (Some(d), Some(t)) = (next, at) {
                                    let h =
                                        ctx.run_later(d + DEADLINE_SLACK, |act, ctx| act.kick(ctx));
                                    act.deadline = Some((h, t));
                                }
                            }
                        }
                    }
                    act.running = false;
                    if !act.dirty.is_empty() {
                        act.kick_scope(ctx, Scope::none());
                    }
                }),
        );
    }
}

impl Actor for AddOnController {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Self::Context) {
        ctx.run_interval(RESYNC_INTERVAL, |act, ctx| act.kick(ctx));
        self.kick(ctx);
    }
}

impl Handler<Changed> for AddOnController {
    type Result = ();
    fn handle(&mut self, _: Changed, ctx: &mut Self::Context) {
        self.kick(ctx);
    }
}

impl Handler<ChangedKey> for AddOnController {
    type Result = ();
    fn handle(&mut self, m: ChangedKey, ctx: &mut Self::Context) {
        self.kick_scope(ctx, Scope::for_key(m.bucket, &m.key));
    }
}

impl Handler<ClustersChanged> for AddOnController {
    type Result = ();
    fn handle(&mut self, m: ClustersChanged, ctx: &mut Self::Context) {
        self.kick_scope(ctx, Scope::Clusters(m.0));
    }
}

impl Handler<AgentRequest> for AddOnController {
    type Result = ResponseFuture<Result<serde_json::Value, AgentRequestError>>;
    fn handle(&mut self, msg: AgentRequest, _ctx: &mut Self::Context) -> Self::Result {
        let store = self.store.clone();
        let cache = self.cache.clone();
        Box::pin(async move {
            match msg {
                AgentRequest::Status(r) => record_report(&store, r)
                    .await
                    .map(|()| serde_json::json!({}))
                    .map_err(Into::into),
                AgentRequest::Lease {
                    cluster,
                    addon,
                    body,
                } => renew_lease_with(&store, &cache, &cluster, &addon, body, SystemTime::now())
                    .await
                    .and_then(|r| {
                        serde_json::to_value(r).map_err(|e| ControlError::Codec(e.to_string()))
                    })
                    .map_err(Into::into),
            }
        })
    }
}

/// Stores the add-on lease (`tether-addon-leases`, key `<cluster>.<addon>`); refused when the
/// add-on is not installed on the cluster. Reads everything from KV ([`renew_lease_with`] an
/// empty cache).
pub async fn renew_lease(
    store: &impl Store,
    cluster: &str,
    addon: &str,
    body: AddOnLeaseRenew,
    now: SystemTime,
) -> Result<AddOnLeaseReply, ControlError> {
    renew_lease_with(store, &AddOnCache::default(), cluster, addon, body, now).await
}

/// [`renew_lease`] reading the ManagedClusterAddOn and the stored lease through `cache` (what
/// the KV watches delivered; a miss reads the stream leader): in the steady state a renewal
/// that is not written costs no JetStream request at all.
pub async fn renew_lease_with(
    store: &impl Store,
    cache: &AddOnCache,
    cluster: &str,
    addon: &str,
    body: AddOnLeaseRenew,
    now: SystemTime,
) -> Result<AddOnLeaseReply, ControlError> {
    let key = addon_key(cluster, addon);
    if cache.addon(store, &key).await?.is_none() {
        return Ok(AddOnLeaseReply {
            accepted: false,
            message: format!("add-on {addon} is not installed on cluster {cluster}"),
        });
    }
    if body.lease_duration_seconds == 0 {
        return Ok(AddOnLeaseReply {
            accepted: false,
            message: "leaseDurationSeconds must be at least 1".into(),
        });
    }
    let now_t = now;
    let now = rfc3339(now);
    // A cached lease may be older than the stored one (the watch lags): then the renewal is
    // written sooner than needed, never later.
    let old: Option<Lease> = cache.lease(store, &key).await?;
    let mut connected = body.connected_brokers.clone();
    connected.sort();
    connected.dedup();
    // Only the renew time would change and the stored one is recent: not written (the
    // controller allows for the persist interval; docs/control-plane.md, "Lease renewals").
    if let Some(l) = &old
        && l.spec.holder_identity == body.holder_identity
        && l.spec.lease_duration_seconds == body.lease_duration_seconds
        && l.metadata
            .annotations
            .get(addons::CONNECTED_BROKERS_ANNOTATION)
            .map_or("", String::as_str)
            == connected.join(",")
        && parse_rfc3339(&l.spec.renew_time)
            .and_then(|r| now_t.duration_since(r).ok())
            .is_some_and(|age| age < lease_persist_interval(body.lease_duration_seconds))
    {
        return Ok(AddOnLeaseReply {
            accepted: true,
            message: String::new(),
        });
    }
    let acquire_time = old
        .filter(|l| l.spec.holder_identity == body.holder_identity)
        .map(|l| l.spec.acquire_time)
        .unwrap_or_else(|| now.clone());
    let mut metadata = ObjectMeta::new(addon);
    metadata.namespace = Some(cluster.to_string());
    metadata.annotations.insert(
        addons::CONNECTED_BROKERS_ANNOTATION.into(),
        connected.join(","),
    );
    let lease = Lease {
        api_version: Lease::API_VERSION.into(),
        kind: Lease::KIND.into(),
        metadata,
        spec: LeaseSpec {
            holder_identity: body.holder_identity,
            lease_duration_seconds: body.lease_duration_seconds,
            acquire_time,
            renew_time: now,
        },
    };
    store.put(Bucket::AddOnLeases, &key, &lease).await?;
    Ok(AddOnLeaseReply {
        accepted: true,
        message: String::new(),
    })
}

/// Stores the applied hashes in `status.configReferences[].lastAppliedConfig` (CAS, retried).
pub async fn record_report(store: &impl Store, msg: StatusReport) -> Result<(), ControlError> {
    let key = addon_key(&msg.cluster, &msg.addon);
    for _ in 0..16 {
        let Some((mut mca, rev)) = store
            .get::<ManagedClusterAddOn>(Bucket::ManagedClusterAddOns, &key)
            .await?
        else {
            return Err(ControlError::Codec(format!(
                "managedclusteraddon {}/{} not found",
                msg.cluster, msg.addon
            )));
        };
        let mut changed = false;
        for r in &mut mca.status.config_references {
            if let Some(a) = msg.report.applied_configs.iter().find(|a| {
                a.group == r.group
                    && a.resource == r.resource
                    && a.name == r.name
                    && a.namespace == r.namespace
            }) {
                let applied = ConfigSpecHash {
                    namespace: a.namespace.clone(),
                    name: a.name.clone(),
                    spec_hash: a.spec_hash.clone(),
                };
                if r.last_applied_config.as_ref() != Some(&applied) {
                    r.last_applied_config = Some(applied);
                    changed = true;
                }
            }
        }
        if !changed {
            return Ok(());
        }
        update_progressing(&mut mca);
        if store
            .update(Bucket::ManagedClusterAddOns, &key, &mca, rev)
            .await?
            .is_some()
        {
            return Ok(());
        }
    }
    Err(ControlError::Codec(format!(
        "managedclusteraddon {key}: too many concurrent updates"
    )))
}

fn accepted(mc: &ManagedCluster) -> bool {
    mc.spec.hub_accepts_client
}

/// Sets Progressing from configReferences; true when it changed.
fn update_progressing(mca: &mut ManagedClusterAddOn) -> bool {
    let pending: Vec<String> = mca
        .status
        .config_references
        .iter()
        .filter(|r| {
            !r.desired_config.spec_hash.is_empty()
                && r.last_applied_config.as_ref().map(|a| &a.spec_hash)
                    != Some(&r.desired_config.spec_hash)
        })
        .map(|r| format!("{}/{}", r.resource, r.name))
        .collect();
    if pending.is_empty() {
        set_condition(
            &mut mca.status.conditions,
            addons::condition::PROGRESSING,
            "False",
            "Completed",
            "the agent has applied every desired config",
        )
    } else {
        set_condition(
            &mut mca.status.conditions,
            addons::condition::PROGRESSING,
            "True",
            "Configuring",
            &format!("waiting for the agent to apply {}", pending.join(", ")),
        )
    }
}

async fn list_map<T: serde::de::DeserializeOwned + Send>(
    store: &impl Store,
    b: Bucket,
) -> Result<HashMap<String, (T, u64)>, ControlError> {
    Ok(store
        .list::<T>(b)
        .await?
        .into_iter()
        .map(|(k, v, rev)| (k, (v, rev)))
        .collect())
}

async fn event(store: &impl Store, ev: Event) {
    if let Err(e) = store.publish_event(&ev).await {
        tracing::warn!(error = %e, reason = %ev.reason, "cannot publish event");
    }
}

/// A `Normal` event about ManagedClusterAddOn `key`.
async fn addon_event(store: &impl Store, key: &str, reason: &str, message: impl Into<String>) {
    event(
        store,
        Event::new(ManagedClusterAddOn::KIND, key, "Normal", reason, message),
    )
    .await;
}

/// One pass over every add-on; returns how many objects it wrote and when the next add-on
/// lease expires (re-run then).
pub async fn reconcile_all(
    store: &impl Store,
    notify: Option<&async_nats::Client>,
) -> Result<(usize, Option<Duration>), ControlError> {
    reconcile(store, notify, &Scope::All).await
}

/// Reads `keys` of bucket `b` (missing ones are skipped).
async fn get_map<T: serde::de::DeserializeOwned>(
    store: &impl Store,
    b: Bucket,
    keys: impl IntoIterator<Item = String>,
) -> Result<HashMap<String, (T, u64)>, ControlError> {
    let mut out = HashMap::new();
    for k in keys {
        if let Some(v) = store.get::<T>(b, &k).await? {
            out.insert(k, v);
        }
    }
    Ok(out)
}

/// How long an add-on lease may go unrenewed before its add-on is no longer Available.
fn lease_grace(lease: &Lease) -> Duration {
    Duration::from_secs(
        u64::from(lease.spec.lease_duration_seconds) * u64::from(ADDON_LEASE_GRACE_MULTIPLIER),
    )
}

/// How long `lease` keeps its add-on Available from `now`; `None` once it lapsed (or its renew
/// time does not parse). The stored renew time may be up to the persist interval older than the
/// agent's last renewal (renewals that change nothing else are not written).
fn lease_time_left(lease: &Lease, now: SystemTime) -> Option<Duration> {
    let deadline = lease_grace(lease) + lease_persist_interval(lease.spec.lease_duration_seconds);
    parse_rfc3339(&lease.spec.renew_time)
        .and_then(|r| (r + deadline).duration_since(now).ok())
        .filter(|left| !left.is_zero())
}

/// One pass over the add-ons in `scope` at the current time ([`reconcile_at`]).
pub async fn reconcile(
    store: &impl Store,
    notify: Option<&async_nats::Client>,
    scope: &Scope,
) -> Result<(usize, Option<Duration>), ControlError> {
    reconcile_at(store, notify, scope, SystemTime::now()).await
}

/// One pass over the add-ons in `scope` as of `now`; returns how many objects it wrote and when
/// the next add-on lease (of those it looked at) expires.
pub async fn reconcile_at(
    store: &impl Store,
    notify: Option<&async_nats::Client>,
    scope: &Scope,
    now: SystemTime,
) -> Result<(usize, Option<Duration>), ControlError> {
    let cmas: HashMap<String, (ClusterManagementAddOn, u64)> =
        list_map(store, Bucket::ClusterManagementAddOns).await?;
    let adcs: HashMap<String, (AddOnDeploymentConfig, u64)> =
        list_map(store, Bucket::AddOnDeploymentConfigs).await?;
    let mpcs: HashMap<String, (ManagedProxyConfiguration, u64)> =
        list_map(store, Bucket::ProxyConfigurations).await?;
    type Inputs = (
        HashMap<String, (ManagedCluster, u64)>,
        HashMap<String, (Lease, u64)>,
        HashMap<String, (ManagedClusterAddOn, u64)>,
    );
    let (clusters, leases, mut mcas): Inputs = match scope {
        Scope::All => (
            list_map(store, Bucket::Clusters).await?,
            list_map(store, Bucket::AddOnLeases).await?,
            list_map(store, Bucket::ManagedClusterAddOns).await?,
        ),
        Scope::Clusters(names) => {
            let in_scope = |k: &String| k.split_once('.').is_some_and(|(c, _)| names.contains(c));
            // A few clusters: list only their keys (`<cluster>.>`), so a pass triggered by one
            // add-on lease renewal costs that cluster's add-ons, not every key of the bucket
            // (10,000 keys per renewal at 10,000 clusters).
            let mca_keys: Vec<String> = if names.len() <= SCOPED_KEY_LISTS_MAX {
                let mut keys = Vec::new();
                for c in names {
                    keys.extend(
                        store
                            .keys_matching(Bucket::ManagedClusterAddOns, &format!("{c}.>"))
                            .await?,
                    );
                }
                keys.into_iter().filter(in_scope).collect()
            } else {
                store
                    .keys(Bucket::ManagedClusterAddOns)
                    .await?
                    .into_iter()
                    .filter(in_scope)
                    .collect()
            };
            let lease_keys: Vec<String> = names
                .iter()
                .flat_map(|c| cmas.keys().map(move |a| addon_key(c, a)))
                .chain(mca_keys.iter().cloned())
                .collect::<std::collections::BTreeSet<_>>()
                .into_iter()
                .collect();
            (
                get_map(store, Bucket::Clusters, names.iter().cloned()).await?,
                get_map(store, Bucket::AddOnLeases, lease_keys).await?,
                get_map(store, Bucket::ManagedClusterAddOns, mca_keys).await?,
            )
        }
    };
    let serving = brokers::serving_brokers(store, now).await?;
    let serving_ids: Vec<String> = serving.iter().map(|b| b.id.clone()).collect();
    let mut to_notify: Vec<(String, String)> = Vec::new();
    let mut writes = 0;
    let mut next_deadline: Option<Duration> = None;

    // Which add-ons should exist.
    let mut want: BTreeMap<String, (String, String, bool)> = BTreeMap::new();
    for (cma, _) in cmas.values() {
        for (mc, _) in clusters.values() {
            if accepted(mc) && cma.spec.install_strategy.selects(&mc.metadata.labels) {
                want.insert(
                    addon_key(&mc.metadata.name, &cma.metadata.name),
                    (mc.metadata.name.clone(), cma.metadata.name.clone(), true),
                );
            }
        }
    }
    // Existing ones: keep hand-applied ones while cluster and ClusterManagementAddOn exist.
    let mut delete = Vec::new();
    for (key, (mca, _)) in &mcas {
        if want.contains_key(key) {
            continue;
        }
        let cluster = mca.cluster().to_string();
        let name = mca.metadata.name.clone();
        let cluster_ok = clusters.get(&cluster).is_some_and(|(mc, _)| accepted(mc));
        let cma_ok = cmas.contains_key(&name);
        let by_strategy = mca
            .metadata
            .annotations
            .contains_key(INSTALLED_BY_ANNOTATION);
        if cluster_ok && cma_ok && !by_strategy {
            want.insert(key.clone(), (cluster, name, false));
        } else {
            let why = if !cluster_ok {
                format!("managed cluster {cluster} is gone or no longer accepted")
            } else if !cma_ok {
                format!("clustermanagementaddon {name} is gone")
            } else {
                format!("cluster {cluster} no longer matches the install strategy of {name}")
            };
            delete.push((key.clone(), cluster, name, why, by_strategy));
        }
    }
    for (key, cluster, name, why, by_strategy) in delete {
        // Removing is destructive (the add-on is re-installed from scratch, Available lost):
        // confirm what this pass read with reads of the stream leader. A listing's consumer
        // may sit on a replica still catching up after a partition; a manager started just then
        // removed add-ons of clusters its listing missed (tests/tests/hub_chaos_tunnels.rs).
        let mc_now = store
            .get::<ManagedCluster>(Bucket::Clusters, &cluster)
            .await?;
        let cma_now = store
            .get::<ClusterManagementAddOn>(Bucket::ClusterManagementAddOns, &name)
            .await?;
        if let (Some((mc, _)), Some((cma, _))) = (&mc_now, &cma_now)
            && accepted(mc)
            && (!by_strategy || cma.spec.install_strategy.selects(&mc.metadata.labels))
        {
            tracing::warn!(cluster = %cluster, addon = %name, read = %why, "not removing the add-on: the stream leader still has its cluster and ClusterManagementAddOn (a stale read)");
            mcas.remove(&key);
            continue;
        }
        store.delete(Bucket::ManagedClusterAddOns, &key).await?;
        mcas.remove(&key);
        writes += 1;
        to_notify.push((cluster.clone(), name.clone()));
        tracing::info!(cluster = %cluster, addon = %name, reason = %why, "add-on removed");
        addon_event(store, &key, "AddOnRemoved", why).await;
    }

    for (key, (cluster, name, by_strategy)) in want {
        let Some((cma, _)) = cmas.get(&name) else {
            continue;
        };
        let Some((mc, _)) = clusters.get(&cluster) else {
            continue;
        };
        let existing = mcas.get(&key).cloned();
        let mut mca = match &existing {
            Some((m, _)) => m.clone(),
            None => {
                let mut m = ManagedClusterAddOn::new(&cluster, &name);
                if by_strategy {
                    m.metadata
                        .annotations
                        .insert(INSTALLED_BY_ANNOTATION.into(), "install-strategy".into());
                }
                m
            }
        };
        mca.metadata.resource_version = None;
        let before = serde_json::to_value(&mca).unwrap_or_default();

        // Effective configs: the add-on's own, then defaults for other group/resources.
        let mut configs = mca.spec.configs.clone();
        for d in &cma.spec.default_configs {
            if !configs
                .iter()
                .any(|c| c.group == d.group && c.resource == d.resource)
            {
                configs.push(d.clone());
            }
        }
        let mut missing = Vec::new();
        let refs: Vec<ConfigReference> = configs
            .iter()
            .map(|c| {
                let hash = match c.key() {
                    Some((ConfigKind::AddOnDeploymentConfig, k)) => {
                        adcs.get(&k).map(|(a, _)| spec_hash(&a.spec))
                    }
                    Some((ConfigKind::ManagedProxyConfiguration, k)) => {
                        mpcs.get(&k).map(|(m, _)| spec_hash(&m.spec))
                    }
                    None => None,
                };
                if hash.is_none() {
                    missing.push(c.display());
                }
                let namespace = match c.key() {
                    Some((ConfigKind::AddOnDeploymentConfig, _)) if c.namespace.is_empty() => {
                        addons::DEFAULT_NAMESPACE.to_string()
                    }
                    _ => c.namespace.clone(),
                };
                let last = mca
                    .status
                    .config_references
                    .iter()
                    .find(|r| {
                        r.group == c.group
                            && r.resource == c.resource
                            && r.name == c.name
                            && r.namespace == namespace
                    })
                    .and_then(|r| r.last_applied_config.clone());
                ConfigReference {
                    group: c.group.clone(),
                    resource: c.resource.clone(),
                    namespace: namespace.clone(),
                    name: c.name.clone(),
                    desired_config: ConfigSpecHash {
                        namespace,
                        name: c.name.clone(),
                        spec_hash: hash.unwrap_or_default(),
                    },
                    last_applied_config: last,
                }
            })
            .collect();
        let hashes_changed = existing.as_ref().is_some_and(|(m, _)| {
            m.status
                .config_references
                .iter()
                .map(|r| &r.desired_config)
                .ne(refs.iter().map(|r| &r.desired_config))
        });
        mca.status.config_references = refs;
        mca.status.namespace = mca.spec.install_namespace.clone();
        if mca.status.health_check_mode.is_empty() {
            mca.status.health_check_mode = "Lease".into();
        }
        update_progressing(&mut mca);
        let conds = &mut mca.status.conditions;
        if missing.is_empty() {
            set_condition(
                conds,
                addons::condition::DEGRADED,
                "False",
                "AsExpected",
                "every referenced config exists",
            );
        } else {
            set_condition(
                conds,
                addons::condition::DEGRADED,
                "True",
                "ConfigurationNotFound",
                &format!("referenced config not found: {}", missing.join(", ")),
            );
        }
        let cluster_status = mc.condition(mc_condition::AVAILABLE);
        if cluster_status == Some("Unknown") {
            set_condition(
                conds,
                addons::condition::AVAILABLE,
                "Unknown",
                "ClusterUnknown",
                &format!("managed cluster {cluster} is Unknown (its lease expired)"),
            );
        } else {
            // Taking Available away from True on the lease's word (missing, or expired) is
            // confirmed with a read of the stream leader first: the listing may come from a
            // replica still catching up after a partition, which misses the leases written
            // during the outage (tests/tests/hub_chaos_tunnels.rs saw add-ons of clusters that
            // joined then go Unknown/WaitingForLease on a new leader's first pass).
            let was_available = existing
                .as_ref()
                .is_some_and(|(m, _)| m.condition(addons::condition::AVAILABLE) == Some("True"));
            let listed = leases.get(&key);
            let lease =
                if was_available && listed.is_none_or(|(l, _)| lease_time_left(l, now).is_none()) {
                    store.get::<Lease>(Bucket::AddOnLeases, &key).await?
                } else {
                    listed.cloned()
                };
            match &lease {
                None => set_condition(
                    conds,
                    addons::condition::AVAILABLE,
                    "Unknown",
                    "WaitingForLease",
                    "the add-on agent has not renewed its lease yet",
                ),
                Some((lease, _)) => {
                    let grace = lease_grace(lease);
                    if let Some(left) = lease_time_left(lease, now) {
                        next_deadline = Some(next_deadline.map_or(left, |d| d.min(left)));
                        // What the data plane says, not what the agent says: the live
                        // brokers that report holding a tunnel of this cluster.
                        let (connected, missing) = brokers::holders(&serving, &cluster);
                        if missing.is_empty() {
                            set_condition(
                                conds,
                                addons::condition::AVAILABLE,
                                "True",
                                "ManagedClusterAddOnLeaseUpdated",
                                &if serving_ids.is_empty() {
                                    "the add-on agent keeps its lease".to_string()
                                } else {
                                    format!(
                                        "the add-on agent keeps its lease and has a tunnel to every live broker ({})",
                                        serving_ids.join(", ")
                                    )
                                },
                            )
                        } else {
                            set_condition(
                                conds,
                                addons::condition::AVAILABLE,
                                "False",
                                "ProxyAgentNotConnected",
                                &format!(
                                    "no tunnel to live broker(s) {} (connected: {})",
                                    missing.join(", "),
                                    if connected.is_empty() {
                                        "none".to_string()
                                    } else {
                                        connected.join(", ")
                                    }
                                ),
                            )
                        }
                    } else {
                        set_condition(
                            conds,
                            addons::condition::AVAILABLE,
                            "False",
                            "ManagedClusterAddOnLeaseUpdateStopped",
                            &format!(
                                "the add-on agent has not renewed its lease for {}s",
                                grace.as_secs()
                            ),
                        )
                    }
                }
            };
        }
        let after = serde_json::to_value(&mca).unwrap_or_default();
        match existing {
            None => {
                if store
                    .create(Bucket::ManagedClusterAddOns, &key, &mca)
                    .await?
                    .is_some()
                {
                    writes += 1;
                    to_notify.push((cluster.clone(), name.clone()));
                    tracing::info!(cluster = %cluster, addon = %name, "add-on installed");
                    let msg = format!("{name} installed on {cluster}");
                    addon_event(store, &key, "AddOnInstalled", msg).await;
                }
            }
            Some((_, rev)) if before != after => {
                if store
                    .update(Bucket::ManagedClusterAddOns, &key, &mca, rev)
                    .await?
                    .is_some()
                {
                    writes += 1;
                    if hashes_changed {
                        to_notify.push((cluster.clone(), name.clone()));
                    }
                    let summary: Vec<String> = mca
                        .status
                        .conditions
                        .iter()
                        .map(|c| format!("{}={}", c.type_, c.status))
                        .collect();
                    let (reason, msg) = if hashes_changed {
                        (
                            "AddOnConfigChanged",
                            format!("config changed; {}", summary.join(" ")),
                        )
                    } else {
                        ("AddOnStatusChanged", summary.join(" "))
                    };
                    addon_event(store, &key, reason, msg).await;
                }
                // On a CAS conflict the watch brings us back.
            }
            Some(_) => {}
        }
    }
    writes += brokers::update_proxy_configuration_status(store, &mpcs, &serving).await?;
    if let Some(client) = notify {
        for (cluster, addon) in to_notify {
            crate::notify::config_changed(client, &cluster, &addon).await;
        }
    }
    Ok((writes, next_deadline))
}

fn parse_agent_request(
    msg: &async_nats::Message,
    lease: bool,
) -> Result<AgentRequest, AgentRequestError> {
    let (Some(cluster), Some(addon)) = (
        subjects::cluster_of(&msg.subject),
        subjects::addon_of(&msg.subject),
    ) else {
        return Err(AgentRequestError::Subject(msg.subject.to_string()));
    };
    let malformed = |what| move |source| AgentRequestError::Malformed { what, source };
    let (cluster, addon) = (cluster.to_string(), addon.to_string());
    if lease {
        let body = serde_json::from_slice(&msg.payload).map_err(malformed("lease"))?;
        Ok(AgentRequest::Lease {
            cluster,
            addon,
            body,
        })
    } else {
        let report = serde_json::from_slice(&msg.payload).map_err(malformed("status"))?;
        Ok(AgentRequest::Status(StatusReport {
            cluster,
            addon,
            report,
        }))
    }
}

/// What the controller was last told about one add-on lease (see [`lease_change_matters`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaseSeen {
    holder: String,
    duration_seconds: u32,
    connected_brokers: String,
    renew: Option<SystemTime>,
}

impl LeaseSeen {
    pub fn of(lease: &Lease) -> Self {
        Self {
            holder: lease.spec.holder_identity.clone(),
            duration_seconds: lease.spec.lease_duration_seconds,
            connected_brokers: lease
                .metadata
                .annotations
                .get(addons::CONNECTED_BROKERS_ANNOTATION)
                .cloned()
                .unwrap_or_default(),
            renew: parse_rfc3339(&lease.spec.renew_time),
        }
    }
}

/// Whether a stored add-on lease (`next`, `None` = deleted) can change what a reconcile
/// computes, given the previous one the controller was told about: not when only the renew
/// time moved forward on a lease that is still well inside its grace — Available depends on
/// the lease only through "renewed within grace + persist interval" (and the next deadline,
/// which only a full pass may push back), so such a write would cost a scoped pass (four
/// listings and a leader read per key, ≈ 70 per second at 10,000 clusters) that changes
/// nothing. Everything else (first lease, holder, duration or connected brokers changed, a
/// lease back from beyond the grace, a delete) is reconciled as before.
pub fn lease_change_matters(
    prev: Option<&LeaseSeen>,
    next: Option<&LeaseSeen>,
    now: SystemTime,
) -> bool {
    let (Some(p), Some(n)) = (prev, next) else {
        return true;
    };
    if p.holder != n.holder
        || p.duration_seconds != n.duration_seconds
        || p.connected_brokers != n.connected_brokers
    {
        return true;
    }
    let (Some(pr), Some(nr)) = (p.renew, n.renew) else {
        return true;
    };
    let grace = Duration::from_secs(
        u64::from(p.duration_seconds) * u64::from(ADDON_LEASE_GRACE_MULTIPLIER),
    );
    // The previous lease must still be inside the grace alone (the controller declares it
    // gone only after grace + persist interval), so no pass can have acted on its expiry.
    nr < pr || now.duration_since(pr).map_or(true, |age| age >= grace)
}

/// Watches every input bucket (each change → [`ChangedKey`], feeding `cache` on the way) and
/// serves the add-on status-report and lease subjects. Returns the tasks.
pub async fn start(
    client: async_nats::Client,
    store: HubStore,
    addr: Addr<AddOnController>,
    cache: std::sync::Arc<AddOnCache>,
    shutdown: CancellationToken,
) -> Result<Vec<tokio::task::JoinHandle<()>>, crate::ManagerError> {
    let mut handles = Vec::new();
    for b in [
        Bucket::Clusters,
        Bucket::ClusterManagementAddOns,
        Bucket::ManagedClusterAddOns,
        Bucket::AddOnDeploymentConfigs,
        Bucket::ProxyConfigurations,
        Bucket::AddOnLeases,
    ] {
        let first = store.watch::<serde_json::Value>(b).await?;
        let store = store.clone();
        let addr = addr.clone();
        let stop = shutdown.clone();
        let cache = cache.clone();
        handles.push(tokio::spawn(async move {
            let mut w = Some(Box::pin(first));
            // Add-on leases: what the controller was last told per key.
            let mut seen: HashMap<String, LeaseSeen> = HashMap::new();
            loop {
                if let Some(mut watch) = w.take() {
                    loop {
                        let (key, value) = tokio::select! {
                            _ = stop.cancelled() => return,
                            ev = watch.next() => match ev {
                                Some(ev) => ev,
                                None => break,
                            }
                        };
                        cache.apply(b, &key, value.as_ref());
                        if b == Bucket::AddOnLeases {
                            let next = value
                                .and_then(|v| serde_json::from_value::<Lease>(v).ok())
                                .map(|l| LeaseSeen::of(&l));
                            let matters = lease_change_matters(
                                seen.get(&key),
                                next.as_ref(),
                                SystemTime::now(),
                            );
                            match next {
                                Some(n) => seen.insert(key.clone(), n),
                                None => seen.remove(&key),
                            };
                            if !matters {
                                continue;
                            }
                        }
                        let _ = addr.send(ChangedKey { bucket: b, key }).await;
                    }
                    tracing::warn!(bucket = b.name(), "watch ended; re-opening");
                }
                tokio::select! {
                    _ = stop.cancelled() => return,
                    _ = tokio::time::sleep(Duration::from_secs(1)) => {}
                }
                match store.watch::<serde_json::Value>(b).await {
                    Ok(watch) => {
                        // The new watch delivers every key again (and not what was deleted
                        // meanwhile): start both from empty.
                        cache.clear(b);
                        seen.clear();
                        w = Some(Box::pin(watch));
                        let _ = addr.send(Changed).await;
                    }
                    Err(e) => tracing::warn!(bucket = b.name(), error = %e, "cannot re-open watch"),
                }
            }
        }));
    }
    handles.extend(
        crate::serve::serve_subjects(
            &client,
            QUEUE_GROUP,
            [
                (subjects::CLUSTER_ADDON_STATUS_ALL, false),
                (subjects::CLUSTER_ADDON_LEASE_ALL, true),
            ],
            MAX_INFLIGHT_AGENT_REPORTS,
            "add-on",
            &shutdown,
            move |lease, msg| {
                let addr = addr.clone();
                async move {
                    let r = match parse_agent_request(&msg, lease) {
                        Ok(req) => addr.send(req).await.unwrap_or_else(|e| Err(e.into())),
                        Err(e) => Err(e),
                    };
                    r.map(|v| Some(bytes::Bytes::from(v.to_string())))
                        .map_err(|e| e.to_string())
                }
            },
        )
        .await?,
    );
    Ok(handles)
}

#[cfg(test)]
mod reconcile_tests;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scopes_follow_the_changed_key() {
        assert_eq!(
            Scope::for_key(Bucket::AddOnLeases, "c1.cluster-proxy"),
            Scope::Clusters(["c1".to_string()].into())
        );
        assert_eq!(
            Scope::for_key(Bucket::Clusters, "c2"),
            Scope::Clusters(["c2".to_string()].into())
        );
        assert_eq!(
            Scope::for_key(Bucket::AddOnDeploymentConfigs, "default.x"),
            Scope::All
        );
        let mut s = Scope::none();
        assert!(s.is_empty());
        s.merge(Scope::for_key(Bucket::Clusters, "c1"));
        s.merge(Scope::for_key(Bucket::ManagedClusterAddOns, "c2.a"));
        assert_eq!(
            s,
            Scope::Clusters(["c1".to_string(), "c2".to_string()].into())
        );
        s.merge(Scope::All);
        s.merge(Scope::for_key(Bucket::Clusters, "c3"));
        assert_eq!(s, Scope::All);
    }

    fn seen(holder: &str, brokers: &str, renew: SystemTime) -> LeaseSeen {
        LeaseSeen {
            holder: holder.into(),
            duration_seconds: 60,
            connected_brokers: brokers.into(),
            renew: Some(renew),
        }
    }

    #[test]
    fn only_renew_time_refreshes_of_a_live_lease_skip_the_reconcile() {
        let t0 = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000);
        let later = t0 + Duration::from_secs(120);
        let now = later + Duration::from_millis(5);
        let prev = seen("h", "b1", t0);
        // Only the renew time moved, the previous lease is inside its 300 s grace: skipped.
        assert!(!lease_change_matters(
            Some(&prev),
            Some(&seen("h", "b1", later)),
            now
        ));
        // First lease, a delete, a new holder or broker set: reconciled.
        assert!(lease_change_matters(None, Some(&prev), now));
        assert!(lease_change_matters(Some(&prev), None, now));
        assert!(lease_change_matters(
            Some(&prev),
            Some(&seen("h2", "b1", later)),
            now
        ));
        assert!(lease_change_matters(
            Some(&prev),
            Some(&seen("h", "b1,b2", later)),
            now
        ));
        let mut longer = seen("h", "b1", later);
        longer.duration_seconds = 120;
        assert!(lease_change_matters(Some(&prev), Some(&longer), now));
        // The previous lease is past the grace (the add-on may be Available=False by now).
        let late = t0 + Duration::from_secs(300);
        assert!(lease_change_matters(
            Some(&prev),
            Some(&seen("h", "b1", late)),
            late
        ));
        // A renew time going back, or one that does not parse: reconciled.
        assert!(lease_change_matters(
            Some(&seen("h", "b1", later)),
            Some(&prev),
            now
        ));
        let mut unparsed = seen("h", "b1", later);
        unparsed.renew = None;
        assert!(lease_change_matters(Some(&prev), Some(&unparsed), now));
    }

    #[tokio::test]
    async fn lease_renewals_read_through_the_cache() {
        use tether_control::store::MemoryStore;
        let store = MemoryStore::new();
        let cache = AddOnCache::default();
        let now = SystemTime::now();
        let body = || AddOnLeaseRenew {
            holder_identity: "agent-1".into(),
            lease_duration_seconds: 60,
            connected_brokers: vec![],
        };
        // Not installed as far as KV knows, and nothing cached: refused (a leader read).
        let r = renew_lease_with(&store, &cache, "c1", "a", body(), now)
            .await
            .unwrap();
        assert!(!r.accepted, "{r:?}");
        // The watch delivered the add-on and a fresh lease (KV holds neither here): the renewal
        // is accepted from the cache alone and, the stored lease being recent, not written.
        let mca = ManagedClusterAddOn::new("c1", "a");
        cache.apply(
            Bucket::ManagedClusterAddOns,
            "c1.a",
            Some(&serde_json::to_value(&mca).unwrap()),
        );
        let mut metadata = ObjectMeta::new("a");
        metadata
            .annotations
            .insert(addons::CONNECTED_BROKERS_ANNOTATION.into(), String::new());
        let lease = Lease {
            api_version: Lease::API_VERSION.into(),
            kind: Lease::KIND.into(),
            metadata,
            spec: LeaseSpec {
                holder_identity: "agent-1".into(),
                lease_duration_seconds: 60,
                acquire_time: rfc3339(now),
                renew_time: rfc3339(now),
            },
        };
        cache.apply(
            Bucket::AddOnLeases,
            "c1.a",
            Some(&serde_json::to_value(&lease).unwrap()),
        );
        let r = renew_lease_with(&store, &cache, "c1", "a", body(), now)
            .await
            .unwrap();
        assert!(r.accepted, "{r:?}");
        assert!(
            store
                .get::<Lease>(Bucket::AddOnLeases, "c1.a")
                .await
                .unwrap()
                .is_none(),
            "a renewal of a recent cached lease must not be written"
        );
        // Another holder: written, with this renewal's time.
        let mut other = body();
        other.holder_identity = "agent-2".into();
        let r = renew_lease_with(&store, &cache, "c1", "a", other, now)
            .await
            .unwrap();
        assert!(r.accepted);
        let (stored, _) = store
            .get::<Lease>(Bucket::AddOnLeases, "c1.a")
            .await
            .unwrap()
            .expect("written");
        assert_eq!(stored.spec.holder_identity, "agent-2");
        // Without the cache, the same request reads KV: the add-on is not installed there.
        let r = renew_lease(&store, "c1", "a", body(), now).await.unwrap();
        assert!(!r.accepted);
    }
}
