//! Add-on delivery unit tests on a [`MemoryStore`] with tokio's paused clock: what an add-on
//! agent is told to run (installed or not, brokers from the live set or the entrypoints) and its
//! credentials (signed only when installed, once when two replicas race).

use std::time::Duration;

use serde_json::json;
use tether_control::addons::{ManagedClusterAddOn, ManagedProxyConfiguration};
use tether_control::brokers::BrokerPresence;
use tether_control::clock::TokioClock;
use tether_control::hub::RegistrationPolicy;
use tether_control::resources::{CsrPhase, CsrSubmit, ManagedCluster, rfc3339};
use tether_control::store::{Bucket, MemoryStore, Store};
use tether_pki::{AgentKey, CertInfo, HubCa};

use super::{agent_config, submit_addon_csr};
use crate::metrics::Metrics;
use crate::registration::Registration;

fn replica(store: &MemoryStore, ca: &HubCa) -> Registration<MemoryStore> {
    Registration::new(
        store.clone(),
        TokioClock::new().shared(),
        HubCa::from_pem(ca.cert_pem(), &ca.key_pem()).unwrap(),
        RegistrationPolicy::default(),
        Metrics::register(&mut prometheus::Registry::new()).unwrap(),
    )
}

async fn setup(store: &MemoryStore, accepted: bool) {
    let mut mc = ManagedCluster::new("c1");
    mc.spec.hub_accepts_client = accepted;
    store.put(Bucket::Clusters, "c1", &mc).await.unwrap();
    let mpc: ManagedProxyConfiguration = serde_json::from_value(json!({
        "apiVersion": "proxy.open-cluster-management.io/v1alpha1",
        "kind": "ManagedProxyConfiguration",
        "metadata": {"name": "cluster-proxy"},
        "spec": {"proxyServer": {"entrypoints": [{"host": "hub.example", "port": 8091}]},
                 "proxyAgent": {"replicas": 2}},
    }))
    .unwrap();
    store
        .put(Bucket::ProxyConfigurations, "cluster-proxy", &mpc)
        .await
        .unwrap();
}

async fn install(store: &MemoryStore) {
    let mut mca = ManagedClusterAddOn::new("c1", "cluster-proxy");
    mca.status.config_references = vec![
        serde_json::from_value(json!({
            "group": "proxy.open-cluster-management.io",
            "resource": "managedproxyconfigurations",
            "name": "cluster-proxy",
            "desiredConfig": {"name": "cluster-proxy", "specHash": "x"},
        }))
        .unwrap(),
    ];
    store
        .put(Bucket::ManagedClusterAddOns, "c1.cluster-proxy", &mca)
        .await
        .unwrap();
}

#[tokio::test(start_paused = true)]
async fn config_follows_installation_and_the_live_broker_set() {
    let ca = HubCa::generate("test-hub", Duration::from_secs(3600)).unwrap();
    let store = MemoryStore::new();
    let reg = replica(&store, &ca);
    setup(&store, true).await;
    let r = agent_config(&reg, "c1", "cluster-proxy").await.unwrap();
    assert!(!r.installed && r.message.contains("not installed"), "{r:?}");

    install(&store).await;
    let cfg = agent_config(&reg, "c1", "cluster-proxy")
        .await
        .unwrap()
        .config
        .expect("installed");
    assert_eq!(cfg.replicas, 2);
    assert_eq!(cfg.hub_ca_bundle, ca.cert_pem());
    // No broker announced yet: the entrypoints.
    assert_eq!(cfg.brokers.len(), 1);
    assert_eq!(cfg.brokers[0].addresses, ["hub.example:8091"]);

    let presence = BrokerPresence {
        id: "b1".into(),
        agent_addresses: vec!["10.0.0.1:8443".into()],
        server_name: "broker.example".into(),
        renew_time: rfc3339(reg.clock.now()),
        lease_duration_seconds: 2,
        ..Default::default()
    };
    store.put(Bucket::Brokers, "b1", &presence).await.unwrap();
    let cfg = agent_config(&reg, "c1", "cluster-proxy")
        .await
        .unwrap()
        .config
        .unwrap();
    assert_eq!(cfg.brokers.len(), 1);
    assert_eq!(cfg.brokers[0].id, "b1");
    assert_eq!(cfg.brokers[0].addresses, ["10.0.0.1:8443"]);
    // The broker stops renewing. After 3 missed renewals it is no longer live (Available), but
    // the config keeps listing it for PRESENCE_LISTED_MISSES renewals, so a NATS failover on the
    // broker's side does not make every agent drop its tunnels to it.
    tokio::time::advance(Duration::from_secs(7)).await;
    let cfg = agent_config(&reg, "c1", "cluster-proxy")
        .await
        .unwrap()
        .config
        .unwrap();
    assert_eq!(
        cfg.brokers[0].id, "b1",
        "still listed after 3 missed renewals"
    );
    // After that the agents go back to the entrypoints.
    tokio::time::advance(Duration::from_secs(
        2 * u64::from(tether_control::brokers::PRESENCE_LISTED_MISSES),
    ))
    .await;
    let cfg = agent_config(&reg, "c1", "cluster-proxy")
        .await
        .unwrap()
        .config
        .unwrap();
    assert_eq!(cfg.brokers[0].addresses, ["hub.example:8091"]);
}

/// A CSR with OCM's add-on subject (what the registration-agent's add-on side sends).
fn addon_csr(key: &AgentKey) -> String {
    use rcgen::{CertificateParams, DistinguishedName, DnType, KeyPair};
    let kp = KeyPair::from_pem(&key.to_pem()).unwrap();
    let mut dn = DistinguishedName::new();
    dn.push(
        DnType::CommonName,
        "system:open-cluster-management:cluster:c1:addon:cluster-proxy:agent:a1",
    );
    dn.push(
        DnType::OrganizationName,
        "system:open-cluster-management:cluster:c1:addon:cluster-proxy",
    );
    // rcgen keeps one value per attribute type; the same OID as a custom type adds the second O.
    dn.push(
        DnType::CustomDnType(vec![2, 5, 4, 10]),
        "system:open-cluster-management:addon:cluster-proxy",
    );
    let mut params = CertificateParams::default();
    params.distinguished_name = dn;
    params.serialize_request(&kp).unwrap().pem().unwrap()
}

#[tokio::test(start_paused = true)]
async fn addon_csr_is_signed_only_when_installed_and_once() {
    let ca = HubCa::generate("test-hub", Duration::from_secs(3600)).unwrap();
    let store = MemoryStore::new();
    let a = replica(&store, &ca);
    let b = replica(&store, &ca);
    setup(&store, true).await;
    let key = AgentKey::generate().unwrap();
    let req = CsrSubmit {
        cluster_name: "c1".into(),
        agent_name: "a1".into(),
        csr: addon_csr(&key),
        cluster_claims: vec![],
        labels: Default::default(),
    };
    let err = submit_addon_csr(&a, "c1", "cluster-proxy", req.clone())
        .await
        .unwrap_err();
    assert!(err.to_string().contains("not installed"), "{err}");

    install(&store).await;
    let (ra, rb) = tokio::join!(
        submit_addon_csr(&a, "c1", "cluster-proxy", req.clone()),
        submit_addon_csr(&b, "c1", "cluster-proxy", req.clone())
    );
    let (ra, rb) = (ra.unwrap(), rb.unwrap());
    assert_eq!(ra.phase, CsrPhase::Issued);
    assert_eq!(ra.certificate, rb.certificate, "one certificate handed out");
    let info = CertInfo::from_pem(&ra.certificate).unwrap();
    assert_eq!(
        info.common_name,
        "system:open-cluster-management:cluster:c1:addon:cluster-proxy:agent:a1"
    );
    assert_eq!(info.public_key_raw, key.public_key_raw());

    // A cluster that is no longer accepted gets nothing (a replica that has not cached it yet,
    // a new key: no stored certificate to hand back).
    setup(&store, false).await;
    let c = replica(&store, &ca);
    let other = AgentKey::generate().unwrap();
    let req = CsrSubmit {
        csr: addon_csr(&other),
        ..req
    };
    let err = submit_addon_csr(&c, "c1", "cluster-proxy", req)
        .await
        .unwrap_err();
    assert!(err.to_string().contains("not accepted"), "{err}");
}
