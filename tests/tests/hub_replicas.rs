//! Two addon-manager replicas on one replicated hub (3 nats-server processes from
//! `tetherctl init --nats-cluster 3`), real registration-agents on the seed list:
//!
//! - exactly one replica leads the periodic registration controllers
//!   (`tether_hub_controller_leader`, the `tether-leaders` record);
//! - requests are shared (queue groups): both replicas serve lease renewals;
//! - the leader is SIGKILLed: the other takes over within the lease TTL, a cluster joining
//!   meanwhile is accepted, and the killed replica comes back as a follower;
//! - throughout, no joined cluster's Available leaves True (leases of 2 s: a replica that
//!   missed renewals served by the other would mark it Unknown after 10 s), and no CSR is ever
//!   signed twice (one `CSRApproved` event per CSR, every stored CSR carries the certificate
//!   its agent holds).

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use tether_control::leader::LeaderRecord;
use tether_control::store::Store as _;
use tether_control::store::{Bucket, HubStore};
use tether_e2e::control_plane::{
    AvailabilityWatch, Manager, NatsCluster, admin_connection, assert_csrs_signed_once,
    cluster_available, eventually, init_cluster_hub, start_manager, start_registration_agent,
    wait_lease_renewals,
};

const DEADLINE: Duration = Duration::from_secs(30);

async fn gauge(admin: SocketAddr, name: &str) -> Option<f64> {
    tether_e2e::metric(admin, name, &[]).await.ok()
}

/// Index of the replica whose leader gauge is 1 while the other's is 0.
async fn sole_leader(managers: &[Option<Manager>]) -> Option<usize> {
    let mut leaders = Vec::new();
    for (i, m) in managers.iter().enumerate() {
        if let Some(m) = m
            && gauge(m.admin, "tether_hub_controller_leader").await? == 1.0
        {
            leaders.push(i);
        }
    }
    (leaders.len() == 1).then(|| leaders[0])
}

/// Lease renewals replica `i` served.
async fn renewals(managers: &[Option<Manager>], i: usize) -> Option<f64> {
    let admin = managers[i].as_ref()?.admin;
    gauge(admin, "tether_hub_lease_renewals_total").await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_addon_managers_share_the_work_and_fail_over_without_flaps_or_double_signing()
-> anyhow::Result<()> {
    let tmp = tempfile::tempdir()?;
    let dir = tmp.path();
    let t0 = Instant::now();
    let hub_dir = init_cluster_hub(
        dir,
        3,
        &["--auto-accept", "c-*", "--lease-duration-seconds", "2"],
    )?;
    let nats = NatsCluster::start(&hub_dir, dir, 3)?;
    let seeds = nats.url();
    let mut managers = vec![
        Some(start_manager(&hub_dir, &seeds, "manager-a", dir)?),
        Some(start_manager(&hub_dir, &seeds, "manager-b", dir)?),
    ];
    let admin = admin_connection(&hub_dir, &seeds).await?;
    let store = HubStore::open(admin.client.clone()).await?;

    let mut agents = Vec::new();
    for c in ["c-0", "c-1", "c-2"] {
        agents.push(start_registration_agent(&hub_dir, dir, &seeds, c)?);
    }
    for c in ["c-0", "c-1", "c-2"] {
        eventually(DEADLINE, &format!("{c} Available"), || async {
            (cluster_available(&store, c).await.as_deref() == Some("True")).then_some(())
        })
        .await?;
    }
    let watch = AvailabilityWatch::start(store.clone());

    let leader = eventually(DEADLINE, "exactly one leader", || async {
        sole_leader(&managers).await
    })
    .await?;
    let record: LeaderRecord = store
        .get(Bucket::Leaders, "registration")
        .await?
        .map(|(r, _)| r)
        .ok_or_else(|| anyhow::anyhow!("no tether-leaders/registration record"))?;
    eprintln!("leader: manager {leader} ({})", record.holder);
    // Both replicas serve renewals (queue group).
    eventually(DEADLINE, "both replicas serving lease renewals", || async {
        (renewals(&managers, 0).await? > 0.0 && renewals(&managers, 1).await? > 0.0).then_some(())
    })
    .await?;

    // SIGKILL the leader; the other takes over; a cluster joins meanwhile.
    let t = Instant::now();
    if let Some(mut m) = managers[leader].take() {
        m.child.kill();
    }
    agents.push(start_registration_agent(&hub_dir, dir, &seeds, "c-3")?);
    let other = 1 - leader;
    eventually(DEADLINE, "the other replica to lead", || async {
        (sole_leader(&managers).await == Some(other)).then_some(())
    })
    .await?;
    let takeover = t.elapsed();
    eventually(DEADLINE, "c-3 Available with one replica", || async {
        (cluster_available(&store, "c-3").await.as_deref() == Some("True")).then_some(())
    })
    .await?;
    eprintln!(
        "takeover after {takeover:?}; c-3 Available after {:?}",
        t.elapsed()
    );

    // The killed replica returns as a follower.
    managers[leader] = Some(start_manager(&hub_dir, &seeds, "manager-restarted", dir)?);
    eventually(
        DEADLINE,
        "the restarted replica serving renewals",
        || async { (renewals(&managers, leader).await? > 0.0).then_some(()) },
    )
    .await?;
    assert_eq!(sole_leader(&managers).await, Some(other));

    // Leases renew for longer than one grace period (5 × 2 s) with both replicas up.
    wait_lease_renewals(&store, 4, 2).await?;
    let (watched, flaps) = watch.finish().await?;
    assert_eq!(watched, 4, "clusters seen Available");
    assert!(flaps.is_empty(), "clusters left Available=True: {flaps:?}");

    // Every CSR signed exactly once.
    assert_csrs_signed_once(&store, dir, &["c-0", "c-1", "c-2", "c-3"]).await?;
    for a in &mut agents {
        assert!(a.try_wait().is_none(), "{} exited", a.name);
    }
    eprintln!("total {:?}", t0.elapsed());
    Ok(())
}
