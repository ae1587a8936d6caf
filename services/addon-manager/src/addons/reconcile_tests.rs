//! Add-on reconcile unit tests: [`reconcile_at`] on a [`MemoryStore`] with tokio's paused clock
//! (no NATS): install strategies, config hashes → Progressing, Degraded, and Available from the
//! add-on lease and broker presence.

use std::time::Duration;

use serde_json::json;
use tether_control::addons::{
    ADC_GROUP, ADC_RESOURCE, AddOnLeaseRenew, AddOnStatusReport, AppliedConfig,
    ClusterManagementAddOn, ManagedClusterAddOn, addon_key, condition,
};
use tether_control::brokers::BrokerPresence;
use tether_control::clock::{Clock, TokioClock};
use tether_control::resources::{
    Lease, ManagedCluster, condition as mc_condition, lease_persist_interval, rfc3339,
    set_condition,
};
use tether_control::store::{Bucket, MemoryStore, Raw, RawEntry, Store, Write, Written};

use super::{
    ADDON_LEASE_GRACE_MULTIPLIER, INSTALLED_BY_ANNOTATION, Scope, StatusReport, reconcile_at,
    record_report, renew_lease,
};

async fn cluster(store: &MemoryStore, name: &str, accepted: bool, labels: &[(&str, &str)]) {
    let mut mc = ManagedCluster::new(name);
    mc.spec.hub_accepts_client = accepted;
    mc.metadata.labels = labels
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    store.put(Bucket::Clusters, name, &mc).await.unwrap();
}

async fn cma(
    store: &MemoryStore,
    name: &str,
    strategy: serde_json::Value,
    defaults: serde_json::Value,
) {
    let cma: ClusterManagementAddOn = serde_json::from_value(json!({
        "apiVersion": "addon.open-cluster-management.io/v1alpha1",
        "kind": "ClusterManagementAddOn",
        "metadata": {"name": name},
        "spec": {"installStrategy": strategy, "defaultConfigs": defaults},
    }))
    .unwrap();
    store
        .put(Bucket::ClusterManagementAddOns, name, &cma)
        .await
        .unwrap();
}

async fn adc(store: &MemoryStore, name: &str, https_proxy: &str) {
    let adc: tether_control::addons::AddOnDeploymentConfig = serde_json::from_value(json!({
        "apiVersion": "addon.open-cluster-management.io/v1alpha1",
        "kind": "AddOnDeploymentConfig",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {"proxyConfig": {"httpsProxy": https_proxy}},
    }))
    .unwrap();
    store
        .put(
            Bucket::AddOnDeploymentConfigs,
            &format!("default.{name}"),
            &adc,
        )
        .await
        .unwrap();
}

async fn mca(store: &MemoryStore, cluster: &str, addon: &str) -> Option<ManagedClusterAddOn> {
    store
        .get::<ManagedClusterAddOn>(Bucket::ManagedClusterAddOns, &addon_key(cluster, addon))
        .await
        .unwrap()
        .map(|(m, _)| m)
}

/// (status, reason) of a condition.
fn cond(m: &ManagedClusterAddOn, t: &str) -> (String, String) {
    m.status
        .conditions
        .iter()
        .find(|c| c.type_ == t)
        .map(|c| (c.status.clone(), c.reason.clone()))
        .unwrap_or_default()
}

/// Accepted cluster c1 and add-on `a` installed on every cluster, after one pass.
async fn one_addon() -> (MemoryStore, TokioClock) {
    let store = MemoryStore::new();
    let clock = TokioClock::new();
    cluster(&store, "c1", true, &[]).await;
    cma(&store, "a", json!({"type": "All"}), json!([])).await;
    pass(&store, &clock).await;
    (store, clock)
}

/// agent-1's add-on lease renewal naming the brokers it is connected to.
fn lease_renew(lease_seconds: u32, brokers: &[&str]) -> AddOnLeaseRenew {
    AddOnLeaseRenew {
        holder_identity: "agent-1".into(),
        lease_duration_seconds: lease_seconds,
        connected_brokers: brokers.iter().map(|b| b.to_string()).collect(),
    }
}

/// One reconcile pass, then c1's add-on `a`.
async fn reconciled(store: &MemoryStore, clock: &TokioClock) -> ManagedClusterAddOn {
    pass(store, clock).await;
    mca(store, "c1", "a").await.expect("c1/a exists")
}

/// The spec hash of the first config the add-on should apply.
fn desired_hash(m: &ManagedClusterAddOn) -> String {
    m.status.config_references[0]
        .desired_config
        .spec_hash
        .clone()
}

async fn installed(store: &MemoryStore) -> Vec<String> {
    store.keys(Bucket::ManagedClusterAddOns).await.unwrap()
}

async fn pass(store: &MemoryStore, clock: &TokioClock) -> Option<Duration> {
    reconcile_at(store, None, &Scope::All, clock.now())
        .await
        .unwrap()
        .1
}

#[tokio::test(start_paused = true)]
async fn install_strategy_all_label_selector_and_manual() {
    let store = MemoryStore::new();
    let clock = TokioClock::new();
    cluster(&store, "c1", true, &[("env", "prod")]).await;
    cluster(&store, "c2", true, &[("env", "dev")]).await;
    cluster(&store, "c3", false, &[("env", "prod")]).await;
    cma(&store, "everywhere", json!({"type": "All"}), json!([])).await;
    cma(
        &store,
        "prod-only",
        json!({"type": "LabelSelector", "selector": {"matchLabels": {"env": "prod"}}}),
        json!([]),
    )
    .await;
    cma(&store, "by-hand", json!({"type": "Manual"}), json!([])).await;
    pass(&store, &clock).await;
    assert_eq!(
        installed(&store).await,
        ["c1.everywhere", "c1.prod-only", "c2.everywhere"],
        "accepted clusters the strategy selects; Manual installs nothing"
    );
    let m = mca(&store, "c1", "prod-only").await.unwrap();
    assert!(m.metadata.annotations.contains_key(INSTALLED_BY_ANNOTATION));
    assert_eq!(store.event_reasons("c1.prod-only"), ["AddOnInstalled"]);

    // A hand-applied add-on stays while its cluster and ClusterManagementAddOn exist.
    let hand = ManagedClusterAddOn::new("c2", "by-hand");
    store
        .put(Bucket::ManagedClusterAddOns, "c2.by-hand", &hand)
        .await
        .unwrap();
    // c1 stops matching the selector, c2 is no longer accepted.
    cluster(&store, "c1", true, &[("env", "dev")]).await;
    pass(&store, &clock).await;
    assert_eq!(
        installed(&store).await,
        ["c1.everywhere", "c2.by-hand", "c2.everywhere"]
    );
    assert_eq!(
        store.event_reasons("c1.prod-only"),
        ["AddOnInstalled", "AddOnRemoved"]
    );
    cluster(&store, "c2", false, &[("env", "dev")]).await;
    pass(&store, &clock).await;
    assert_eq!(installed(&store).await, ["c1.everywhere"]);
    // A second pass over an unchanged world writes nothing.
    let (writes, _) = reconcile_at(&store, None, &Scope::All, clock.now())
        .await
        .unwrap();
    assert_eq!(writes, 0);
}

#[tokio::test(start_paused = true)]
async fn config_hash_change_is_progressing_until_applied_and_missing_config_degrades() {
    let store = MemoryStore::new();
    let clock = TokioClock::new();
    cluster(&store, "c1", true, &[]).await;
    let defaults = json!([{"group": ADC_GROUP, "resource": ADC_RESOURCE, "name": "proxy"}]);
    cma(&store, "a", json!({"type": "All"}), defaults).await;

    // The referenced config does not exist yet.
    let m = reconciled(&store, &clock).await;
    assert_eq!(
        cond(&m, condition::DEGRADED),
        ("True".into(), "ConfigurationNotFound".into())
    );

    adc(&store, "proxy", "http://proxy-1:3128").await;
    let m = reconciled(&store, &clock).await;
    assert_eq!(cond(&m, condition::DEGRADED).0, "False");
    let h1 = desired_hash(&m);
    assert!(!h1.is_empty());
    assert_eq!(
        cond(&m, condition::PROGRESSING),
        ("True".into(), "Configuring".into())
    );

    // The agent reports h1 applied.
    let report = |hash: &str| StatusReport {
        cluster: "c1".into(),
        addon: "a".into(),
        report: AddOnStatusReport {
            applied_configs: vec![AppliedConfig {
                group: ADC_GROUP.into(),
                resource: ADC_RESOURCE.into(),
                namespace: "default".into(),
                name: "proxy".into(),
                spec_hash: hash.into(),
            }],
        },
    };
    record_report(&store, report(&h1)).await.unwrap();
    let m = mca(&store, "c1", "a").await.unwrap();
    assert_eq!(
        cond(&m, condition::PROGRESSING),
        ("False".into(), "Completed".into())
    );

    // The config changes: a new desired hash, Progressing again until the agent catches up.
    adc(&store, "proxy", "http://proxy-2:3128").await;
    let m = reconciled(&store, &clock).await;
    let h2 = desired_hash(&m);
    assert_ne!(h1, h2, "the spec hash follows the spec");
    assert_eq!(cond(&m, condition::PROGRESSING).0, "True");
    assert!(
        store
            .event_reasons("c1.a")
            .contains(&"AddOnConfigChanged".to_string())
    );
    record_report(&store, report(&h1)).await.unwrap();
    assert_eq!(
        cond(
            &mca(&store, "c1", "a").await.unwrap(),
            condition::PROGRESSING
        )
        .0,
        "True",
        "an old hash is not the desired one"
    );
    record_report(&store, report(&h2)).await.unwrap();
    assert_eq!(
        cond(
            &mca(&store, "c1", "a").await.unwrap(),
            condition::PROGRESSING
        )
        .0,
        "False"
    );
}

#[tokio::test(start_paused = true)]
async fn available_follows_the_addon_lease_and_every_live_broker() {
    const LEASE_S: u32 = 10;
    let (store, clock) = one_addon().await;
    let available = |m: ManagedClusterAddOn| cond(&m, condition::AVAILABLE);
    assert_eq!(
        available(mca(&store, "c1", "a").await.unwrap()),
        ("Unknown".into(), "WaitingForLease".into())
    );

    let renew = |brokers: &[&str]| lease_renew(LEASE_S, brokers);
    // A lease for an add-on that is not installed is refused.
    let r = renew_lease(&store, "c9", "a", renew(&[]), clock.now())
        .await
        .unwrap();
    assert!(!r.accepted && r.message.contains("not installed"), "{r:?}");
    let r = renew_lease(&store, "c1", "a", renew(&[]), clock.now())
        .await
        .unwrap();
    assert!(r.accepted);
    // No broker announced: the lease alone decides. The deadline allows for renewals that
    // were not written (the stored renew time may lag by the persist interval).
    let next = pass(&store, &clock).await.expect("a lease deadline");
    let grace = Duration::from_secs(u64::from(LEASE_S * ADDON_LEASE_GRACE_MULTIPLIER))
        + lease_persist_interval(LEASE_S);
    assert!(
        next <= grace && next > grace - Duration::from_secs(1),
        "{next:?}"
    );
    assert_eq!(available(mca(&store, "c1", "a").await.unwrap()).0, "True");

    // Two live brokers, only b1 holds a tunnel of c1 (what the agent claims does not count).
    let presence = |id: &str, clusters: &[&str]| BrokerPresence {
        id: id.into(),
        agent_addresses: vec![format!("{id}:8443")],
        server_name: id.into(),
        clusters: clusters.iter().map(|c| c.to_string()).collect(),
        renew_time: rfc3339(clock.now()),
        lease_duration_seconds: 2,
        ..Default::default()
    };
    store
        .put(Bucket::Brokers, "b1", &presence("b1", &["c1"]))
        .await
        .unwrap();
    store
        .put(Bucket::Brokers, "b2", &presence("b2", &[]))
        .await
        .unwrap();
    renew_lease(&store, "c1", "a", renew(&["b1", "b2"]), clock.now())
        .await
        .unwrap();
    let m = reconciled(&store, &clock).await;
    assert_eq!(
        available(m.clone()),
        ("False".into(), "ProxyAgentNotConnected".into())
    );
    let msg = &m
        .status
        .conditions
        .iter()
        .find(|c| c.type_ == condition::AVAILABLE)
        .unwrap()
        .message;
    assert!(msg.contains("b2") && msg.contains("connected: b1"), "{msg}");

    // b2 dies silently: 3 missed renewals later it is no longer live, Available is True again.
    tokio::time::advance(Duration::from_secs(7)).await;
    store
        .put(Bucket::Brokers, "b1", &presence("b1", &["c1"]))
        .await
        .unwrap();
    renew_lease(&store, "c1", "a", renew(&["b1"]), clock.now())
        .await
        .unwrap();
    pass(&store, &clock).await;
    assert_eq!(available(mca(&store, "c1", "a").await.unwrap()).0, "True");

    // The agent stops renewing: False after leaseDurationSeconds × the grace multiplier
    // (plus the persist interval).
    tokio::time::advance(grace - Duration::from_secs(1)).await;
    store
        .put(Bucket::Brokers, "b1", &presence("b1", &["c1"]))
        .await
        .unwrap();
    pass(&store, &clock).await;
    assert_eq!(available(mca(&store, "c1", "a").await.unwrap()).0, "True");
    tokio::time::advance(Duration::from_secs(2)).await;
    pass(&store, &clock).await;
    assert_eq!(
        available(mca(&store, "c1", "a").await.unwrap()),
        (
            "False".into(),
            "ManagedClusterAddOnLeaseUpdateStopped".into()
        )
    );

    // A cluster whose own lease expired makes its add-ons Unknown, whatever their lease says.
    renew_lease(&store, "c1", "a", renew(&["b1"]), clock.now())
        .await
        .unwrap();
    let (mut mc, rev) = store
        .get::<ManagedCluster>(Bucket::Clusters, "c1")
        .await
        .unwrap()
        .unwrap();
    set_condition(
        &mut mc.status.conditions,
        mc_condition::AVAILABLE,
        "Unknown",
        "ManagedClusterLeaseUpdateStopped",
        "",
    );
    store
        .update(Bucket::Clusters, "c1", &mc, rev)
        .await
        .unwrap()
        .unwrap();
    pass(&store, &clock).await;
    assert_eq!(
        available(mca(&store, "c1", "a").await.unwrap()),
        ("Unknown".into(), "ClusterUnknown".into())
    );
}

/// A renewal that changes only the renew time is not written while the stored one is younger
/// than the persist interval; one that changes the brokers, or comes later, is.
#[tokio::test(start_paused = true)]
async fn addon_lease_renewals_are_written_coarsely() {
    const LEASE_S: u32 = 10;
    let (store, clock) = one_addon().await;
    let renew = |brokers: &[&str]| lease_renew(LEASE_S, brokers);
    let stored = || async {
        store
            .get::<Lease>(Bucket::AddOnLeases, "c1.a")
            .await
            .unwrap()
            .map(|(l, rev)| (l.spec.renew_time, rev))
    };
    assert!(
        renew_lease(&store, "c1", "a", renew(&["b1"]), clock.now())
            .await
            .unwrap()
            .accepted
    );
    let (t0, rev0) = stored().await.expect("the first renewal is written");
    let persist = lease_persist_interval(LEASE_S);
    tokio::time::advance(persist - Duration::from_secs(1)).await;
    let r = renew_lease(&store, "c1", "a", renew(&["b1"]), clock.now())
        .await
        .unwrap();
    assert!(r.accepted, "{r:?}");
    assert_eq!(stored().await, Some((t0.clone(), rev0)), "not written");
    // Different brokers: written at once.
    renew_lease(&store, "c1", "a", renew(&["b1", "b2"]), clock.now())
        .await
        .unwrap();
    let (t1, rev1) = stored().await.unwrap();
    assert!(rev1 > rev0 && t1 > t0, "{t1} {rev1}");
    // The stored renew time reaches the persist interval: written.
    tokio::time::advance(persist - Duration::from_secs(1)).await;
    renew_lease(&store, "c1", "a", renew(&["b1", "b2"]), clock.now())
        .await
        .unwrap();
    assert_eq!(stored().await.unwrap().1, rev1);
    tokio::time::advance(Duration::from_secs(1)).await;
    renew_lease(&store, "c1", "a", renew(&["b1", "b2"]), clock.now())
        .await
        .unwrap();
    assert!(stored().await.unwrap().1 > rev1);
    // Meanwhile the add-on stayed Available (its stored renew time was never older than
    // the persist interval).
    pass(&store, &clock).await;
    assert_eq!(
        cond(&mca(&store, "c1", "a").await.unwrap(), condition::AVAILABLE).0,
        "True"
    );
}

/// A store whose listings of `tether-addon-leases` come from a replica that missed every
/// lease (still catching up after a partition); reads of one key go to the stream leader.
#[derive(Clone)]
struct LaggingLeaseListing(MemoryStore);

impl Store for LaggingLeaseListing {
    async fn get_raw(&self, b: Bucket, key: &str) -> tether_control::store::StoreResult<Raw> {
        self.0.get_raw(b, key).await
    }
    async fn write_raw(&self, b: Bucket, key: &str, v: bytes::Bytes, how: Write) -> Written {
        self.0.write_raw(b, key, v, how).await
    }
    async fn delete(&self, b: Bucket, key: &str) -> tether_control::store::StoreResult<()> {
        self.0.delete(b, key).await
    }
    async fn keys_matching(
        &self,
        b: Bucket,
        filter: &str,
    ) -> tether_control::store::StoreResult<Vec<String>> {
        self.0.keys_matching(b, filter).await
    }
    async fn list_raw(
        &self,
        b: Bucket,
        filter: &str,
    ) -> tether_control::store::StoreResult<Vec<RawEntry>> {
        if b == Bucket::AddOnLeases {
            return Ok(Vec::new());
        }
        self.0.list_raw(b, filter).await
    }
    async fn watch<T: serde::de::DeserializeOwned + Send + 'static>(
        &self,
        b: Bucket,
    ) -> tether_control::store::StoreResult<futures::stream::BoxStream<'static, (String, Option<T>)>>
    {
        self.0.watch(b).await
    }
    async fn publish_event(
        &self,
        ev: &tether_control::resources::Event,
    ) -> tether_control::store::StoreResult<()> {
        self.0.publish_event(ev).await
    }
}

/// A pass whose lease listing comes from a lagging replica does not take Available away: the
/// missing lease is confirmed with a read of the leader first (the chaos test saw add-ons go
/// Unknown/WaitingForLease after a partition). A lease that is really gone still counts.
#[tokio::test(start_paused = true)]
async fn a_lagging_lease_listing_does_not_take_available_away() {
    let (store, clock) = one_addon().await;
    renew_lease(&store, "c1", "a", lease_renew(10, &[]), clock.now())
        .await
        .unwrap();
    assert_eq!(
        cond(&reconciled(&store, &clock).await, condition::AVAILABLE).0,
        "True"
    );
    let lagging = LaggingLeaseListing(store.clone());
    reconcile_at(&lagging, None, &Scope::All, clock.now())
        .await
        .unwrap();
    assert_eq!(
        cond(&mca(&store, "c1", "a").await.unwrap(), condition::AVAILABLE),
        ("True".into(), "ManagedClusterAddOnLeaseUpdated".into())
    );
    // The leader has no lease either: not Available.
    store
        .delete(Bucket::AddOnLeases, &addon_key("c1", "a"))
        .await
        .unwrap();
    reconcile_at(&lagging, None, &Scope::All, clock.now())
        .await
        .unwrap();
    assert_eq!(
        cond(&mca(&store, "c1", "a").await.unwrap(), condition::AVAILABLE),
        ("Unknown".into(), "WaitingForLease".into())
    );
}
