//! Registration unit tests: the real logic on a [`MemoryStore`] with tokio's paused clock (no
//! NATS, no sleeps; each test runs in milliseconds of real time).

use std::sync::Arc;
use std::time::Duration;

use futures::stream::BoxStream;
use futures::{FutureExt, StreamExt};
use tether_control::clock::TokioClock;
use tether_control::hub::{AutoAccept, RegistrationPolicy};
use tether_control::resources::{
    AdminClusterRequest, CertificateSigningRequest, CsrPhase, CsrReply, CsrSubmit, Lease,
    LeaseRenew, ManagedCluster, condition, lease_persist_interval, rfc3339,
};
use tether_control::store::{Bucket, MemoryStore, Store};
use tether_pki::{AgentKey, CertInfo, HubCa};

use super::{DENIED_ANNOTATION, HubError, Registration};
use crate::metrics::Metrics;

const LEASE_S: u32 = 10;
const GRACE: u32 = 4;
const CERT_LIFETIME: Duration = Duration::from_secs(3600);

fn policy(auto: &[&str]) -> RegistrationPolicy {
    RegistrationPolicy {
        auto_accept: AutoAccept {
            names: auto.iter().map(|s| s.to_string()).collect(),
            ..Default::default()
        },
        lease_grace_multiplier: GRACE,
        client_cert_lifetime: CERT_LIFETIME,
        lease_duration_seconds: LEASE_S,
        ..Default::default()
    }
}

/// One hub replica on `store`, with its own metrics, sharing `ca`.
fn replica(
    store: &MemoryStore,
    ca: &HubCa,
    policy: RegistrationPolicy,
) -> Registration<MemoryStore> {
    let metrics = Metrics::register(&mut prometheus::Registry::new()).expect("metrics");
    Registration::new(
        store.clone(),
        TokioClock::new().shared(),
        HubCa::from_pem(ca.cert_pem(), &ca.key_pem()).expect("CA copy"),
        policy,
        metrics,
    )
}

fn hub(auto: &[&str]) -> (MemoryStore, Registration<MemoryStore>) {
    let ca = HubCa::generate("test-hub", Duration::from_secs(24 * 3600)).expect("CA");
    let store = MemoryStore::new();
    let reg = replica(&store, &ca, policy(auto));
    (store, reg)
}

/// The KV watches the hub adapter runs (`HubCtx::start_watches`), drained by hand
/// so that a test decides when a replica has seen the changes.
struct Watches {
    clusters: BoxStream<'static, (String, Option<ManagedCluster>)>,
    leases: BoxStream<'static, (String, Option<Lease>)>,
}

async fn watches(store: &MemoryStore) -> Watches {
    Watches {
        clusters: store.watch(Bucket::Clusters).await.expect("watch"),
        leases: store.watch(Bucket::Leases).await.expect("watch"),
    }
}

/// Applies every change the watches have delivered so far.
fn settle(reg: &Registration<MemoryStore>, w: &mut Watches) {
    while let Some(Some((k, v))) = w.clusters.next().now_or_never() {
        reg.apply_cluster_change(k, v);
    }
    while let Some(Some((k, v))) = w.leases.next().now_or_never() {
        reg.apply_lease_change(k, v);
    }
}

fn submit(cluster: &str, agent: &str, key: &AgentKey) -> CsrSubmit {
    CsrSubmit {
        cluster_name: cluster.into(),
        agent_name: agent.into(),
        csr: tether_pki::create_csr(key, cluster, agent).expect("CSR"),
        cluster_claims: vec![],
        labels: Default::default(),
    }
}

fn renew(reg: &Registration<MemoryStore>, agent: &str) -> LeaseRenew {
    LeaseRenew {
        agent_name: agent.into(),
        lease_duration_seconds: LEASE_S,
        cluster_claims: vec![],
        agent_time: rfc3339(reg.clock.now()),
    }
}

async fn cluster(store: &MemoryStore, name: &str) -> ManagedCluster {
    store
        .get::<ManagedCluster>(Bucket::Clusters, name)
        .await
        .expect("store")
        .expect("cluster exists")
        .0
}

fn signed(reg: &Registration<MemoryStore>, kind: &str) -> u64 {
    reg.metrics
        .csrs_signed_total
        .with_label_values(&[kind])
        .get()
}

/// Lets `d` pass, applies the watched changes and runs the lease check.
async fn expire_after(reg: &Registration<MemoryStore>, w: &mut Watches, d: Duration) {
    tokio::time::advance(d).await;
    settle(reg, w);
    reg.check_leases().await.expect("check leases");
}

/// Submits a CSR of `agent` of `cluster` with `key` (`renewal`: by the cluster's client
/// certificate); the reply.
async fn csr(
    reg: &Registration<MemoryStore>,
    cluster: &str,
    agent: &str,
    key: &AgentKey,
    renewal: bool,
) -> CsrReply {
    reg.submit_csr(cluster, submit(cluster, agent, key), renewal, None)
        .await
        .expect("submit")
}

/// Joins `cluster` through auto-accept and a first lease renewal; returns the certificate.
async fn join(reg: &Registration<MemoryStore>, cluster: &str, agent: &str) -> String {
    let key = AgentKey::generate().expect("key");
    let reply = csr(reg, cluster, agent, &key, false).await;
    assert_eq!(reply.phase, CsrPhase::Issued, "{reply:?}");
    let r = reg
        .renew_lease(cluster, renew(reg, agent))
        .await
        .expect("renew");
    assert!(r.accepted, "{r:?}");
    reply.certificate
}

#[tokio::test(start_paused = true)]
async fn auto_accept_pattern_signs_at_once_and_others_wait() {
    let (store, reg) = hub(&["edge-*"]);
    let key = AgentKey::generate().unwrap();
    let reply = csr(&reg, "edge-1", "a1", &key, false).await;
    assert_eq!(reply.phase, CsrPhase::Issued);
    let info = CertInfo::from_pem(&reply.certificate).unwrap();
    assert_eq!(
        info.common_name, "system:open-cluster-management:edge-1:a1",
        "OCM's subject"
    );
    assert_eq!(info.public_key_raw, key.public_key_raw());
    let mc = cluster(&store, "edge-1").await;
    assert!(mc.spec.hub_accepts_client);
    assert_eq!(mc.condition(condition::HUB_ACCEPTED), Some("True"));
    assert_eq!(
        store.event_reasons("edge-1"),
        ["ManagedClusterCreated", "HubClusterAutoAccepted"]
    );
    assert_eq!(signed(&reg, "bootstrap"), 1);

    // A name outside the pattern waits for an admin.
    let reply = csr(&reg, "core-1", "a1", &key, false).await;
    assert_eq!(reply.phase, CsrPhase::Pending);
    assert!(reply.certificate.is_empty());
    assert!(
        reply.message.contains("tetherctl accept core-1"),
        "{}",
        reply.message
    );
    assert!(!cluster(&store, "core-1").await.spec.hub_accepts_client);
    assert_eq!(signed(&reg, "bootstrap"), 1);
}

#[tokio::test(start_paused = true)]
async fn manual_accept_signs_the_pending_csr() {
    let (store, reg) = hub(&[]);
    let key = AgentKey::generate().unwrap();
    let pending = csr(&reg, "c1", "a1", &key, false).await;
    assert_eq!(pending.phase, CsrPhase::Pending);
    // The same CSR again is the same pending object, not a second one.
    let again = csr(&reg, "c1", "a1", &key, false).await;
    assert_eq!(again.csr_name, pending.csr_name);
    assert_eq!(store.keys(Bucket::Csrs).await.unwrap().len(), 1);

    let mc = reg
        .accept(AdminClusterRequest {
            cluster_name: "c1".into(),
        })
        .await
        .unwrap();
    assert!(mc.spec.hub_accepts_client);
    let polled = reg.get_csr("c1", &pending.csr_name, false).await.unwrap();
    assert_eq!(polled.phase, CsrPhase::Issued);
    assert!(!polled.certificate.is_empty());
    assert_eq!(signed(&reg, "bootstrap"), 1);
    assert!(
        store
            .event_reasons("c1")
            .contains(&"HubClusterAdminAccepted".to_string())
    );
    // Accepting a name that is not a DNS label is refused with the reason.
    let err = reg
        .accept(AdminClusterRequest {
            cluster_name: "Not_A_Label".into(),
        })
        .await
        .unwrap_err();
    assert!(err.to_string().contains("DNS-1123"), "{err}");
}

#[tokio::test(start_paused = true)]
async fn refusals_name_what_is_wrong() {
    let (store, reg) = hub(&["*"]);
    let mut w = watches(&store).await;
    let key = AgentKey::generate().unwrap();
    let denied = |r: &Registration<MemoryStore>, reason: &str| {
        r.metrics
            .csrs_denied_total
            .with_label_values(&[reason])
            .get()
    };
    // Subject of another cluster.
    let err = reg
        .submit_csr("c1", submit("c2", "a1", &key), false, None)
        .await
        .unwrap_err();
    assert!(err.to_string().contains("does not match"), "{err}");
    // CSR made for c2 but submitted for c2 by the c1 subject is caught by the subject check;
    // a CSR for c2 named c1 in the body is caught by the CSR validation.
    let mut wrong = submit("c2", "a1", &key);
    wrong.cluster_name = "c1".into();
    let err = reg.submit_csr("c1", wrong, false, None).await.unwrap_err();
    assert!(matches!(err, HubError::Rejected(_)), "{err}");
    assert_eq!(denied(&reg, "subject"), 2);
    // Garbage.
    let mut garbage = submit("c1", "a1", &key);
    garbage.csr = "not a CSR".into();
    let err = reg
        .submit_csr("c1", garbage, false, None)
        .await
        .unwrap_err();
    assert_eq!(denied(&reg, "invalid"), 1, "{err}");
    // A renewal for a cluster the hub does not accept.
    let err = reg
        .submit_csr("c9", submit("c9", "a1", &key), true, None)
        .await
        .unwrap_err();
    assert!(err.to_string().contains("not accepted"), "{err}");
    assert_eq!(denied(&reg, "not_accepted"), 1);
    // Nothing was stored for any of them.
    assert!(store.keys(Bucket::Csrs).await.unwrap().is_empty());

    // Deny: the joined cluster loses acceptance, its lease renewals are refused, a new
    // bootstrap CSR stays pending (auto-accept does not override a deny).
    join(&reg, "c1", "a1").await;
    reg.deny(AdminClusterRequest {
        cluster_name: "c1".into(),
    })
    .await
    .unwrap();
    let mc = cluster(&store, "c1").await;
    assert!(!mc.spec.hub_accepts_client);
    assert!(mc.metadata.annotations.contains_key(DENIED_ANNOTATION));
    assert_eq!(mc.condition(condition::HUB_ACCEPTED), Some("False"));
    settle(&reg, &mut w);
    let r = reg.renew_lease("c1", renew(&reg, "a1")).await.unwrap();
    assert!(!r.accepted && r.message.contains("not accepted"), "{r:?}");
    let other = AgentKey::generate().unwrap();
    let reply = csr(&reg, "c1", "a1", &other, false).await;
    assert_eq!(reply.phase, CsrPhase::Pending);
}

#[tokio::test(start_paused = true)]
async fn pending_csrs_are_capped_per_cluster() {
    let ca = HubCa::generate("test-hub", Duration::from_secs(3600)).unwrap();
    let store = MemoryStore::new();
    let mut p = policy(&[]);
    p.max_pending_csrs_per_cluster = 2;
    let reg = replica(&store, &ca, p);
    for _ in 0..2 {
        let key = AgentKey::generate().unwrap();
        let r = csr(&reg, "c1", "a1", &key, false).await;
        assert_eq!(r.phase, CsrPhase::Pending);
    }
    let key = AgentKey::generate().unwrap();
    let err = reg
        .submit_csr("c1", submit("c1", "a1", &key), false, None)
        .await
        .unwrap_err();
    assert!(err.to_string().contains("too many pending CSRs"), "{err}");
    // Deny clears them; the cap then counts from zero again.
    reg.deny(AdminClusterRequest {
        cluster_name: "c1".into(),
    })
    .await
    .unwrap();
    for (_, csr, _) in store
        .list::<CertificateSigningRequest>(Bucket::Csrs)
        .await
        .unwrap()
    {
        assert_eq!(csr.phase(), CsrPhase::Denied);
    }
    assert_eq!(reg.pending_count("c1"), 0);
}

/// Two hub replicas sign the same pending CSR at the same moment: compare-and-swap on the CSR's
/// revision lets one certificate through; the loser answers with the winner's.
#[tokio::test(start_paused = true)]
async fn two_replicas_never_sign_one_csr_twice() {
    let ca = HubCa::generate("test-hub", Duration::from_secs(3600)).unwrap();
    let store = MemoryStore::new();
    let a = replica(&store, &ca, policy(&[]));
    let b = replica(&store, &ca, policy(&[]));
    let key = AgentKey::generate().unwrap();
    let pending = csr(&a, "c1", "a1", &key, false).await;
    assert_eq!(pending.phase, CsrPhase::Pending);
    // Accepted behind both replicas' backs (another admin path), CSR still pending.
    a.update_cluster("c1", |mc| {
        mc.spec.hub_accepts_client = true;
        true
    })
    .await
    .unwrap();
    let (ra, rb): (Result<CsrReply, _>, Result<CsrReply, _>) = tokio::join!(
        a.get_csr("c1", &pending.csr_name, false),
        b.get_csr("c1", &pending.csr_name, false)
    );
    let (ra, rb) = (ra.unwrap(), rb.unwrap());
    assert_eq!(ra.phase, CsrPhase::Issued);
    assert_eq!(rb.phase, CsrPhase::Issued);
    assert_eq!(
        ra.certificate, rb.certificate,
        "one certificate for one CSR"
    );
    assert_eq!(signed(&a, "bootstrap") + signed(&b, "bootstrap"), 1);
    assert_eq!(
        a.metrics.csr_sign_conflicts_total.get() + b.metrics.csr_sign_conflicts_total.get(),
        1,
        "the two signatures really raced"
    );
    assert_eq!(
        store
            .event_reasons(&pending.csr_name)
            .iter()
            .filter(|r| *r == "CSRApproved")
            .count(),
        1
    );
}

/// The agent rotates when less than a fraction of its certificate's life is left; the hub
/// issues certificates for `clientCertLifetime` from its clock and signs a renewal CSR from
/// the cluster's own identity at once, marking the cluster CertificateRotated.
#[tokio::test(start_paused = true)]
async fn rotation_renews_at_the_configured_fraction() {
    // The registration-agent's ROTATION_FRACTION range (rotation starts below 20–25 % left).
    const FRACTION: f64 = 0.20;
    let (store, reg) = hub(&["*"]);
    let first = join(&reg, "c1", "a1").await;
    let info = CertInfo::from_pem(&first).unwrap();
    let life = info
        .not_after
        .duration_since(reg.clock.now())
        .unwrap()
        .as_secs();
    assert!(
        life.abs_diff(CERT_LIFETIME.as_secs()) <= 1,
        "issued for clientCertLifetime ({life}s)"
    );
    // Just before the fraction: not due.
    let due_after = CERT_LIFETIME.mul_f64(1.0 - FRACTION);
    tokio::time::advance(due_after - Duration::from_secs(60)).await;
    assert!(info.remaining_fraction(reg.clock.now()) > FRACTION);
    // Keep the lease alive meanwhile (the grace is far shorter than the certificate).
    reg.renew_lease("c1", renew(&reg, "a1")).await.unwrap();
    tokio::time::advance(Duration::from_secs(120)).await;
    let left = info.remaining_fraction(reg.clock.now());
    assert!(left < FRACTION, "due: {left}");
    assert!(!info.is_expired(reg.clock.now()));

    let key = AgentKey::generate().unwrap();
    let reply = csr(&reg, "c1", "a1", &key, true).await;
    assert_eq!(reply.phase, CsrPhase::Issued, "{reply:?}");
    let next = CertInfo::from_pem(&reply.certificate).unwrap();
    // (Validity is stamped by tether_pki from the system clock, not the paused one.)
    assert_ne!(next.serial_hex, info.serial_hex, "a new certificate");
    assert_eq!(next.common_name, info.common_name);
    assert_eq!(next.public_key_raw, key.public_key_raw());
    assert_eq!(signed(&reg, "renewal"), 1);
    let mc = cluster(&store, "c1").await;
    assert_eq!(mc.condition(condition::CERT_ROTATED), Some("True"));
}

/// Lease expiry → Available=Unknown after `leaseDurationSeconds × leaseGraceMultiplier`, not
/// before; a renewal brings the cluster back to Available=True.
#[tokio::test(start_paused = true)]
async fn lease_expiry_marks_unknown_and_renewal_recovers() {
    let (store, reg) = hub(&["*"]);
    let mut w = watches(&store).await;
    join(&reg, "c1", "a1").await;
    let available = |mc: &ManagedCluster| mc.condition(condition::AVAILABLE).map(str::to_string);
    let mc = cluster(&store, "c1").await;
    assert_eq!(mc.condition(condition::JOINED), Some("True"));
    assert_eq!(available(&mc).as_deref(), Some("True"));

    let grace = Duration::from_secs(u64::from(LEASE_S * GRACE));
    expire_after(&reg, &mut w, grace - Duration::from_secs(1)).await;
    assert_eq!(
        available(&cluster(&store, "c1").await).as_deref(),
        Some("True")
    );

    expire_after(&reg, &mut w, Duration::from_secs(2)).await;
    let mc = cluster(&store, "c1").await;
    assert_eq!(available(&mc).as_deref(), Some("Unknown"));
    let cond = mc
        .status
        .conditions
        .iter()
        .find(|c| c.type_ == condition::AVAILABLE)
        .unwrap();
    assert_eq!(cond.reason, "ManagedClusterLeaseUpdateStopped");
    let gauge = reg
        .metrics
        .cluster_lease_age_seconds
        .with_label_values(&["c1"])
        .get();
    assert!(gauge > grace.as_secs_f64(), "lease age gauge {gauge}");
    // Checking again neither writes nor emits another event.
    let rev = store.last_revision(Bucket::Clusters);
    settle(&reg, &mut w);
    reg.check_leases().await.unwrap();
    assert_eq!(store.last_revision(Bucket::Clusters), rev);
    let stopped = |s: &MemoryStore| {
        s.event_reasons("c1")
            .iter()
            .filter(|r| *r == "ManagedClusterLeaseUpdateStopped")
            .count()
    };
    assert_eq!(stopped(&store), 1);

    // The agent comes back.
    settle(&reg, &mut w);
    let r = reg.renew_lease("c1", renew(&reg, "a1")).await.unwrap();
    assert!(r.accepted);
    assert_eq!(
        available(&cluster(&store, "c1").await).as_deref(),
        Some("True")
    );
    assert!(
        store
            .event_reasons("c1")
            .contains(&"ManagedClusterAvailable".to_string())
    );
    expire_after(&reg, &mut w, grace - Duration::from_secs(1)).await;
    assert_eq!(
        available(&cluster(&store, "c1").await).as_deref(),
        Some("True")
    );
    assert_eq!(stopped(&store), 1);
}

/// A renewal another replica served (seen through the lease watch) keeps this replica from
/// marking the cluster Unknown, and a replica that just became leader restarts the grace.
#[tokio::test(start_paused = true)]
async fn renewals_seen_from_another_replica_count() {
    let ca = HubCa::generate("test-hub", Duration::from_secs(3600)).unwrap();
    let store = MemoryStore::new();
    let a = Arc::new(replica(&store, &ca, policy(&["*"])));
    let b = replica(&store, &ca, policy(&["*"]));
    join(&a, "c1", "a1").await;
    b.load_leases().await.unwrap();
    assert!(b.leases.lock().unwrap().contains_key("c1"));

    // Renewals go to `a` only; `b` follows them through the watch.
    let mut watch = store
        .watch::<tether_control::resources::Lease>(Bucket::Leases)
        .await
        .unwrap();
    let (k, v) = watch.next().await.unwrap();
    b.apply_lease_change(k, v);
    // Renewals that change only the renew time are written once the stored one is the
    // persist interval old: `b` sees every other one here, and must not flip meanwhile.
    let mut seen = 0;
    for _ in 0..12 {
        tokio::time::advance(Duration::from_secs(u64::from(LEASE_S))).await;
        a.renew_lease("c1", renew(&a, "a1")).await.unwrap();
        while let Some(Some((k, v))) = watch.next().now_or_never() {
            b.apply_lease_change(k, v);
            seen += 1;
        }
        b.check_leases().await.unwrap();
    }
    assert_eq!(seen, 6, "one write per persist interval (2 × {LEASE_S} s)");
    assert_eq!(a.metrics.lease_renewals_total.get(), 13);
    assert_eq!(a.metrics.lease_writes_total.get(), 7);
    assert_eq!(
        cluster(&store, "c1").await.condition(condition::AVAILABLE),
        Some("True")
    );

    // Without the watch, KV still decides: `b` re-reads the lease before flipping.
    let persist = lease_persist_interval(LEASE_S);
    let grace = Duration::from_secs(u64::from(LEASE_S * GRACE));
    tokio::time::advance(grace + persist - Duration::from_secs(1)).await;
    a.renew_lease("c1", renew(&a, "a1")).await.unwrap();
    tokio::time::advance(Duration::from_secs(2)).await;
    b.check_leases().await.unwrap();
    assert_eq!(
        cluster(&store, "c1").await.condition(condition::AVAILABLE),
        Some("True")
    );

    // A new leader restarts the grace: a lease that looked old is not Unknown at once.
    tokio::time::advance(grace + persist + Duration::from_secs(5)).await;
    b.restart_lease_grace();
    b.check_leases().await.unwrap();
    assert_eq!(
        cluster(&store, "c1").await.condition(condition::AVAILABLE),
        Some("True")
    );
    // A renewal it did not see may be that much older than KV says: grace + persist interval.
    tokio::time::advance(grace + Duration::from_secs(1)).await;
    b.check_leases().await.unwrap();
    assert_eq!(
        cluster(&store, "c1").await.condition(condition::AVAILABLE),
        Some("True")
    );
    tokio::time::advance(persist).await;
    b.check_leases().await.unwrap();
    assert_eq!(
        cluster(&store, "c1").await.condition(condition::AVAILABLE),
        Some("Unknown")
    );
}

/// The replica that serves the renewals counts each one exactly, written or not: a cluster is
/// Unknown a grace after its last renewal even though the stored lease is older.
#[tokio::test(start_paused = true)]
async fn unwritten_renewals_count_exactly_on_the_serving_replica() {
    let (store, reg) = hub(&["*"]);
    let mut w = watches(&store).await;
    join(&reg, "c1", "a1").await;
    tokio::time::advance(Duration::from_secs(u64::from(LEASE_S))).await;
    let rev = store.last_revision(Bucket::Leases);
    reg.renew_lease("c1", renew(&reg, "a1")).await.unwrap();
    assert_eq!(
        store.last_revision(Bucket::Leases),
        rev,
        "renewal not written"
    );
    assert_eq!(reg.metrics.lease_writes_total.get(), 1);
    assert_eq!(reg.metrics.lease_renewals_total.get(), 2);

    let grace = Duration::from_secs(u64::from(LEASE_S * GRACE));
    expire_after(&reg, &mut w, grace - Duration::from_secs(1)).await;
    assert_eq!(
        cluster(&store, "c1").await.condition(condition::AVAILABLE),
        Some("True")
    );
    expire_after(&reg, &mut w, Duration::from_secs(2)).await;
    assert_eq!(
        cluster(&store, "c1").await.condition(condition::AVAILABLE),
        Some("Unknown")
    );
    // Coming back is always written (the cluster was Unknown).
    let rev = store.last_revision(Bucket::Leases);
    reg.renew_lease("c1", renew(&reg, "a1")).await.unwrap();
    assert!(store.last_revision(Bucket::Leases) > rev);
    assert_eq!(
        cluster(&store, "c1").await.condition(condition::AVAILABLE),
        Some("True")
    );
    // A new holder (the agent re-bootstrapped with another name) is written at once.
    tokio::time::advance(Duration::from_secs(1)).await;
    let rev = store.last_revision(Bucket::Leases);
    reg.renew_lease("c1", renew(&reg, "a2")).await.unwrap();
    assert!(store.last_revision(Bucket::Leases) > rev);
}
