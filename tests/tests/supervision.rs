//! Supervision restarts something real: one real broker, two real agents. Agent `sa` reaches the
//! broker through a relay this test controls. Its tunnel is killed five ways, one after the
//! other:
//! 1. the relay cuts the tunnel's TCP connection (the connection dies under a live tunnel);
//! 2. the broker's `TunnelActor` of `sa` panics (the broker's test-only `test_hooks`);
//! 3. the task driving the tunnel's HTTP/2 connection on the broker panics (same hook);
//! 4. the agent's `Connector` actor of that endpoint panics (the agent's `test_hooks`): the
//!    agent's supervisor starts a new connector (`tether_agent_connector_restarts_total`);
//! 5. the agent's task driving the tunnel panics (same hook): the connector redials.
//!
//! Each time:
//! - the broker deregisters the dead tunnel, and a new tunnel (a new id) is registered when the
//!   agent's `Connector` (the same one, or a new one after 4) redials (its connect counter
//!   rises, the relay sees a new connection);
//! - a stream through `sb`'s tunnel, open and moving data the whole time, keeps flowing, and its
//!   tunnel is the same one afterwards (no other tunnel affected);
//! - a new stream through `sa` works again.

use std::net::SocketAddr;
use std::time::Duration;

use tether_e2e::live::{ContinuousEcho, CutRelay};
use tether_e2e::{
    Hub, admin_get, connect_ok, echo_server, metric, qualified, wait_agent_ready, wait_tunnel,
};
use tether_test_support::wait_until_async;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Deadline for each step of the test.
const STEP: Duration = Duration::from_secs(30);

/// Tunnel ids the broker's `/debug/tunnels` lists for `cluster`.
async fn tunnel_ids(admin: SocketAddr, cluster: &str) -> anyhow::Result<Vec<u64>> {
    let (_, body) = admin_get(admin, "/debug/tunnels").await?;
    let list: Vec<serde_json::Value> = serde_json::from_str(&body)?;
    Ok(list
        .iter()
        .filter(|t| t["cluster"] == cluster)
        .filter_map(|t| t["id"].as_u64())
        .collect())
}

/// How the test kills `sa`'s tunnel.
#[derive(Debug, Clone, Copy)]
enum Kill {
    /// Cut its TCP connection in the relay.
    CutConnection,
    /// Make the broker's tunnel actor panic.
    PanicActor,
    /// Make the broker's task driving the HTTP/2 connection panic.
    PanicConnectionTask,
    /// Make the agent's connector actor of the endpoint panic.
    PanicAgentConnector,
    /// Make the agent's task driving the tunnel panic.
    PanicAgentTunnelTask,
}

/// Asks a test hook (the broker's: `key` = `cluster`, the agent's: `endpoint`) to make the
/// tunnel of `name` panic in `task`.
async fn panic_tunnel(admin: SocketAddr, key: &str, name: &str, task: &str) -> anyhow::Result<()> {
    let (status, body) = admin_get(
        admin,
        &format!("/debug/test/panic-tunnel?{key}={name}&task={task}"),
    )
    .await?;
    let answer: serde_json::Value = serde_json::from_str(&body)?;
    anyhow::ensure!(
        status == 200 && answer["tunnel"].is_u64(),
        "panic hook answered {status}: {body}"
    );
    Ok(())
}

/// One echo round trip through `cluster`'s tunnel.
async fn echo_once(client: SocketAddr, cluster: &str, echo: SocketAddr) -> anyhow::Result<()> {
    let mut s = connect_ok(client, &qualified(cluster, echo)).await?;
    s.write_all(b"ping").await?;
    let mut buf = [0u8; 4];
    tokio::time::timeout(STEP, s.read_exact(&mut buf)).await??;
    assert_eq!(&buf, b"ping");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_tunnel_is_redialled_and_reregistered_while_another_tunnel_keeps_flowing()
-> anyhow::Result<()> {
    let hub = Hub::new()?;
    let echo = echo_server().await?;
    let broker = hub.start_broker("b1", "test_hooks: true")?;
    let relay = CutRelay::start(broker.agent_addr).await?;
    let sa = hub.start_agent("sa", "sa", &[vec![relay.addr]], echo, "test_hooks: true")?;
    let sb = hub.start_agent("sb", "sb", &[vec![broker.agent_addr]], echo, "")?;
    for (agent, cluster) in [(&sa, "sa"), (&sb, "sb")] {
        wait_agent_ready(agent).await?;
        wait_tunnel(&broker, cluster).await?;
    }
    let sb_before = tunnel_ids(broker.admin_addr, "sb").await?;
    assert_eq!(sb_before.len(), 1, "one tunnel for sb: {sb_before:?}");
    let endpoint = relay.addr.to_string();
    let connects = |a: SocketAddr, e: String| async move {
        metric(
            a,
            "tether_agent_tunnel_connects_total",
            &[("endpoint", e.as_str()), ("result", "ok")],
        )
        .await
        .unwrap_or(0.0)
    };
    assert_eq!(connects(sa.admin_addr, endpoint.clone()).await, 1.0);
    let restarts = |a: SocketAddr, e: String| async move {
        metric(
            a,
            "tether_agent_connector_restarts_total",
            &[("endpoint", e.as_str())],
        )
        .await
    };
    assert_eq!(restarts(sa.admin_addr, endpoint.clone()).await?, 0.0);

    // A stream through sb's tunnel that keeps moving data until told to stop.
    let live = ContinuousEcho::start(
        connect_ok(broker.client_addr, &qualified("sb", echo)).await?,
        16 << 10,
        true,
    );
    live.wait_progress(1 << 20, "sb stream moving before the first kill")
        .await?;

    let kills = [
        Kill::CutConnection,
        Kill::PanicActor,
        Kill::PanicConnectionTask,
        Kill::PanicAgentConnector,
        Kill::PanicAgentTunnelTask,
    ];
    let mut restarted = 0.0;
    for (n, kill) in kills.into_iter().enumerate() {
        let sa_before = tunnel_ids(broker.admin_addr, "sa").await?;
        assert_eq!(
            sa_before.len(),
            1,
            "{kill:?}: one tunnel for sa: {sa_before:?}"
        );
        let accepted_before = relay.accepted();
        match kill {
            Kill::CutConnection => relay.cut(),
            Kill::PanicActor => panic_tunnel(broker.admin_addr, "cluster", "sa", "actor").await?,
            Kill::PanicConnectionTask => {
                panic_tunnel(broker.admin_addr, "cluster", "sa", "connection").await?
            }
            Kill::PanicAgentConnector => {
                panic_tunnel(sa.admin_addr, "endpoint", &endpoint, "actor").await?;
                restarted += 1.0;
            }
            Kill::PanicAgentTunnelTask => {
                panic_tunnel(sa.admin_addr, "endpoint", &endpoint, "connection").await?
            }
        }

        // The broker deregisters the dead tunnel and registers the redialled one (a new id).
        let sa_after = wait_until_async(
            STEP,
            &format!("{kill:?}: sa tunnel re-registered with a new id"),
            || async {
                let ids = tunnel_ids(broker.admin_addr, "sa").await.ok()?;
                (ids.len() == 1 && ids[0] != sa_before[0]).then_some(ids)
            },
        )
        .await?;
        assert!(
            relay.accepted() > accepted_before,
            "{kill:?}: the agent redialled through the relay"
        );
        // The supervised connector dialled again and established one more tunnel.
        let want = n as f64 + 2.0;
        wait_until_async(
            STEP,
            &format!("{kill:?}: sa connector counted connect number {want}"),
            || async { (connects(sa.admin_addr, endpoint.clone()).await >= want).then_some(()) },
        )
        .await?;
        // Only the connector's own panic replaces the connector; the other kills end a tunnel
        // and the same connector redials.
        assert_eq!(
            restarts(sa.admin_addr, endpoint.clone()).await?,
            restarted,
            "{kill:?}: connector restarts"
        );

        // sb's stream kept flowing through the episode, on the same tunnel.
        live.wait_progress(
            1 << 20,
            &format!("{kill:?}: sb stream moving after sa's restart"),
        )
        .await?;
        assert_eq!(
            tunnel_ids(broker.admin_addr, "sb").await?,
            sb_before,
            "{kill:?}: sb's tunnel is untouched"
        );

        // sa's new tunnel carries streams.
        echo_once(broker.client_addr, "sa", echo).await?;
        assert_eq!(tunnel_ids(broker.admin_addr, "sa").await?, sa_after);
    }

    // Every byte of sb's stream came back, intact.
    live.finish().await?;
    Ok(())
}
