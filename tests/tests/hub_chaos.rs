//! Hub chaos on the control plane: 3 nats-server processes (`tetherctl init --nats-cluster 3`),
//! 2 addon-managers, real registration-agents on the seed list (leases of 3 s: Unknown after
//! 15 s without renewal).
//!
//! While clusters renew: one NATS node is SIGKILLed, a cluster joins, then the *leader*
//! addon-manager is SIGKILLed too (one node and one manager down at once), another cluster
//! joins and is accepted by the remaining replica; then both are restarted and a last cluster
//! joins. Afterwards: every entry of every durable bucket that existed before is still there at
//! the same or a later revision (nothing lost or reverted), no cluster's Available ever left
//! True, and every CSR was signed once (never twice; its approval event is best effort and may be lost
//! while the events stream has no leader).
//!
//! Brokers, open tunnels and traffic during the chaos (and a partitioned node): `hub_chaos_tunnels.rs`.

use std::time::{Duration, Instant};

use tether_control::store::HubStore;
use tether_e2e::control_plane::{
    AvailabilityWatch, FailureLogs, Manager, NatsCluster, admin_connection,
    assert_csrs_never_signed_twice, bucket_snapshot, cluster_available, eventually,
    init_cluster_hub, start_manager, start_registration_agent, wait_fully_replicated,
    wait_lease_renewals,
};

const DEADLINE: Duration = Duration::from_secs(30);

async fn leader_of(managers: &[Option<Manager>]) -> Option<usize> {
    let mut leaders = Vec::new();
    for (i, m) in managers.iter().enumerate() {
        if let Some(m) = m
            && tether_e2e::metric(m.admin, "tether_hub_controller_leader", &[])
                .await
                .ok()?
                == 1.0
        {
            leaders.push(i);
        }
    }
    (leaders.len() == 1).then(|| leaders[0])
}

async fn wait_available(store: &HubStore, c: &str, what: &str) -> anyhow::Result<()> {
    eventually(DEADLINE, &format!("{c} Available {what}"), || async {
        (cluster_available(store, c).await.as_deref() == Some("True")).then_some(())
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_node_and_leader_manager_die_together_without_losing_state() -> anyhow::Result<()> {
    let tmp = tempfile::tempdir()?;
    let dir = tmp.path();
    // Every process's log is printed if the test fails.
    let mut logs = FailureLogs::new(dir);
    let t0 = Instant::now();
    let hub_dir = init_cluster_hub(
        dir,
        3,
        &["--auto-accept", "c-*", "--lease-duration-seconds", "3"],
    )?;
    let mut nats = NatsCluster::start(&hub_dir, dir, 3)?;
    let seeds = nats.url();
    let mut managers = vec![
        Some(start_manager(&hub_dir, &seeds, "manager-a", dir)?),
        Some(start_manager(&hub_dir, &seeds, "manager-b", dir)?),
    ];
    let admin = admin_connection(&hub_dir, &seeds).await?;
    let store = HubStore::open(admin.client.clone()).await?;
    let js = store.jetstream().clone();
    wait_fully_replicated(&js).await?;

    let mut agents = Vec::new();
    for c in ["c-0", "c-1", "c-2"] {
        agents.push(start_registration_agent(&hub_dir, dir, &seeds, c)?);
    }
    for c in ["c-0", "c-1", "c-2"] {
        wait_available(&store, c, "at start").await?;
    }
    let watch = AvailabilityWatch::start(store.clone());
    let before = bucket_snapshot(&store).await?;

    // A NATS node dies; a cluster joins.
    nats.kill_node(2);
    agents.push(start_registration_agent(&hub_dir, dir, &seeds, "c-3")?);
    wait_available(&store, "c-3", "with NATS node 2 down").await?;

    // The leader addon-manager dies too; the other takes over; a cluster joins.
    let leader = eventually(DEADLINE, "one leader", || leader_of(&managers)).await?;
    let t = Instant::now();
    if let Some(mut m) = managers[leader].take() {
        m.child.kill();
    }
    agents.push(start_registration_agent(&hub_dir, dir, &seeds, "c-4")?);
    eventually(DEADLINE, "the other replica to lead", || async {
        (leader_of(&managers).await == Some(1 - leader)).then_some(())
    })
    .await?;
    wait_available(&store, "c-4", "with a node and the leader down").await?;
    eprintln!(
        "node 2 and leader down: takeover and c-4 Available after {:?}",
        t.elapsed()
    );

    // Both come back; a last cluster joins.
    nats.start_node(2)?;
    managers[leader] = Some(start_manager(&hub_dir, &seeds, "manager-restarted", dir)?);
    agents.push(start_registration_agent(&hub_dir, dir, &seeds, "c-5")?);
    wait_available(&store, "c-5", "after the restarts").await?;
    wait_fully_replicated(&js).await?;
    wait_lease_renewals(&store, 6, 2).await?;

    let (watched, flaps) = watch.finish().await?;
    assert_eq!(watched, 6, "clusters seen Available");
    assert!(flaps.is_empty(), "clusters left Available=True: {flaps:?}");
    let after = bucket_snapshot(&store).await?;
    for (k, (_, rev)) in &before {
        let now = after.get(k).map(|(_, r)| *r);
        assert!(
            now.is_some_and(|r| r >= *rev),
            "{k:?} lost or reverted: revision {rev} → {now:?}"
        );
    }
    assert_csrs_never_signed_twice(&store, dir, &["c-0", "c-1", "c-2", "c-3", "c-4", "c-5"])
        .await?;
    for a in &mut agents {
        assert!(a.try_wait().is_none(), "{} exited", a.name);
    }
    eprintln!("total {:?}", t0.elapsed());
    logs.passed();
    Ok(())
}
