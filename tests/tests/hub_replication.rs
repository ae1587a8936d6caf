//! A replicated hub: `tetherctl init --nats-cluster 3`, three real nats-server processes with
//! TLS routes on loopback, the real addon-manager and real registration-agents, all on the
//! seed list of the three nodes.
//!
//! - Hub state written with one replica (a hub from before replication) is upgraded in place to
//!   three replicas by the addon-manager: every bucket and the events stream, with every entry
//!   and event intact (same values, same revisions).
//! - Each NATS node in turn is SIGKILLed (so whichever node the addon-manager, the auth callout
//!   and the agents talk to dies at some point): a new cluster joins through the bootstrap
//!   token and is accepted while the node is down, hub state stays readable and writable, and
//!   no joined cluster's Available condition ever leaves True (leases of 8 s: Unknown after
//!   40 s without renewal; a client stuck on a silent server moves after ~15–25 s). The node is restarted and caught up before the next one dies.
//! - Then node 1 is frozen with SIGSTOP (a partition without FIN: connections stay open and
//!   silent) while another cluster joins; same guarantees.

use std::time::{Duration, Instant};

use anyhow::Context as _;
use tether_control::store::Store as _;
use tether_control::store::{Bucket, HubStore, Replicas};
use tether_control::subjects;
use tether_e2e::control_plane::{
    AvailabilityWatch, DURABLE_BUCKETS, NatsCluster, admin_connection, bucket_snapshot,
    cluster_available, eventually, init_cluster_hub, replication, start_manager,
    start_registration_agent, wait_fully_replicated, wait_lease_renewals,
};

const SEED_EVENTS: usize = 5;
const DEADLINE: Duration = Duration::from_secs(30);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicated_hub_upgrades_single_replica_state_and_survives_losing_any_nats_node()
-> anyhow::Result<()> {
    let mut tmp = tempfile::tempdir()?;
    if std::env::var_os(tether_e2e::KEEP_ENV).is_some() {
        tmp.disable_cleanup(true);
        eprintln!("test directory kept: {}", tmp.path().display());
    }
    let dir = tmp.path();
    let t0 = Instant::now();
    let hub_dir = init_cluster_hub(
        dir,
        3,
        &["--auto-accept", "c-*", "--lease-duration-seconds", "8"],
    )?;
    let mut nats = NatsCluster::start(&hub_dir, dir, 3)?;
    let seeds = nats.url();

    // A hub from before replication: every bucket and the stream with one replica, with data.
    let admin = eventually(DEADLINE, "an admin connection", || async {
        admin_connection(&hub_dir, &seeds).await.ok()
    })
    .await?;
    let old = eventually(DEADLINE, "single-replica hub state", || async {
        HubStore::open_with(admin.client.clone(), Replicas::Exactly(1))
            .await
            .ok()
    })
    .await?;
    for (i, b) in DURABLE_BUCKETS.iter().enumerate() {
        old.put(
            *b,
            &format!("seed-{i}"),
            &serde_json::json!({ "seed": i, "bucket": b.name() }),
        )
        .await?;
    }
    let js = old.jetstream().clone();
    for i in 0..SEED_EVENTS {
        js.publish(
            "tether.v1.events.Test.seed",
            format!("{{\"seed\":{i}}}").into(),
        )
        .await?
        .await?;
    }
    let before = replication(&js).await.context("stream info")?;
    assert!(
        before.values().all(|&(r, _)| r == 1),
        "seeded hub should be single-replica: {before:?}"
    );
    let seeded = bucket_snapshot(&old).await?;
    assert_eq!(seeded.len(), DURABLE_BUCKETS.len(), "{seeded:?}");

    // The addon-manager upgrades everything in place.
    let _manager = start_manager(&hub_dir, &seeds, "addon-manager", dir)?;
    wait_fully_replicated(&js).await?;
    let store = HubStore::open(admin.client.clone()).await?;
    let after = bucket_snapshot(&store).await?;
    for (k, v) in &seeded {
        assert_eq!(after.get(k), Some(v), "{k:?} changed by the upgrade");
    }
    let events = js
        .get_stream(subjects::STREAM_EVENTS)
        .await?
        .info()
        .await?
        .state
        .messages;
    assert!(events >= SEED_EVENTS as u64, "events lost: {events}");
    eprintln!("upgrade to R3 done at {:?}", t0.elapsed());

    // A first cluster joins on the seed list.
    let mut agents = vec![start_registration_agent(&hub_dir, dir, &seeds, "c-0")?];
    eventually(DEADLINE, "c-0 Available", || async {
        (cluster_available(&store, "c-0").await.as_deref() == Some("True")).then_some(())
    })
    .await?;

    // Watch every joined cluster: Available must never leave True.
    let watch = AvailabilityWatch::start(store.clone());

    for node in 1..=3 {
        let t = Instant::now();
        nats.kill_node(node);
        let name = format!("c-{node}");
        agents.push(start_registration_agent(&hub_dir, dir, &seeds, &name)?);
        eventually(
            DEADLINE,
            &format!("{name} Available with node {node} down"),
            || async {
                (cluster_available(&store, &name).await.as_deref() == Some("True")).then_some(())
            },
        )
        .await
        .with_context(|| {
            std::fs::read_to_string(dir.join("addon-manager.log"))
                .map(|l| l.lines().rev().take(20).collect::<Vec<_>>().join("\n"))
                .unwrap_or_default()
        })?;
        // State stays writable with a node down.
        eventually(DEADLINE, "a write with a node down", || async {
            store
                .put(
                    Bucket::HubClients,
                    &format!("probe-{node}"),
                    &serde_json::json!({ "node": node }),
                )
                .await
                .ok()
        })
        .await?;
        eprintln!(
            "node {node} down: {name} accepted and Available after {:?}",
            t.elapsed()
        );
        nats.start_node(node)?;
        wait_fully_replicated(&js).await?;
    }

    // A partition without FIN: node 1 frozen (SIGSTOP), its TCP connections open and silent.
    // Its clients give up on it after a few missed PINGs and move to another seed.
    let t = Instant::now();
    nats.freeze_node(1, true)?;
    agents.push(start_registration_agent(&hub_dir, dir, &seeds, "c-4")?);
    let frozen = eventually(DEADLINE * 2, "c-4 Available with node 1 frozen", || async {
        (cluster_available(&store, "c-4").await.as_deref() == Some("True")).then_some(())
    })
    .await;
    nats.freeze_node(1, false)?;
    frozen?;
    eprintln!(
        "node 1 frozen: c-4 accepted and Available after {:?}",
        t.elapsed()
    );
    wait_fully_replicated(&js).await?;

    // Every lease renews twice more after the last restart (the watcher keeps watching).
    wait_lease_renewals(&store, 5, 2).await?;
    let (watched, flaps) = watch.finish().await?;
    assert_eq!(watched, 5, "clusters seen Available");
    assert!(flaps.is_empty(), "clusters left Available=True: {flaps:?}");
    for c in ["c-0", "c-1", "c-2", "c-3", "c-4"] {
        assert_eq!(
            cluster_available(&store, c).await.as_deref(),
            Some("True"),
            "{c}"
        );
    }
    // Nothing seeded was lost or reverted.
    let end = bucket_snapshot(&store).await?;
    for (k, v) in &seeded {
        assert_eq!(end.get(k), Some(v), "{k:?} lost or reverted");
    }
    for agent in &mut agents {
        assert!(agent.try_wait().is_none(), "{} exited", agent.name);
    }
    eprintln!("total {:?}", t0.elapsed());
    Ok(())
}
