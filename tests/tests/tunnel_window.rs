//! Adaptive HTTP/2 windows (tether_tunnel::window) through real broker and agent processes: on a
//! long round trip the stream window grows past its 4 MiB base (both ends, both directions), on
//! loopback request/response traffic it stays at the base, and `max_stream_window_bytes` equal
//! to the base turns growth off.
//!
//! The long round trip is a [`DelayLink`] between agent and broker (a TCP relay adding 50 ms each
//! way; this kernel has no `netem`): the tunnel's HTTP/2 windows see a 100 ms round trip while
//! its TCP connections stay loopback-fast. Throughputs are printed for information only; the
//! assertions are on the windows the processes report.

use std::sync::Arc;
use std::time::Duration;

use tether_e2e::delay::DelayLink;
use tether_e2e::{
    Broker, Hub, Payload, admin_get, connect_ok, echo_server, echo_transfer, metric, qualified,
    rate, wait_agent_ready, wait_tunnel,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const BASE_WINDOW: u64 = 4 << 20;
/// The tests of this file run one at a time: a transfer on another tunnel would load the CPU
/// and stretch this one's round trips.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
const ONE_WAY: Duration = Duration::from_millis(50);
/// Bytes each way through the delayed tunnel: enough round trips (≥ 16 at a 4 MiB window) for
/// several BDP samples.
const TRANSFER: u64 = 96 << 20;

/// The stream windows the broker reports for `cluster`'s tunnels.
async fn broker_windows(broker: &Broker, cluster: &str) -> anyhow::Result<Vec<u64>> {
    let (_, body) = admin_get(broker.admin_addr, "/debug/tunnels").await?;
    let list: serde_json::Value = serde_json::from_str(&body)?;
    Ok(list
        .as_array()
        .into_iter()
        .flatten()
        .filter(|t| t["cluster"] == cluster)
        .filter_map(|t| t["stream_window_bytes"].as_u64())
        .collect())
}

/// Neither end changed its window.
async fn assert_no_window_changes(
    agent: &tether_e2e::Agent,
    broker: &Broker,
) -> anyhow::Result<()> {
    let a = metric(
        agent.admin_addr,
        "tether_agent_tunnel_window_changes_total",
        &[],
    )
    .await?;
    let b = metric(
        broker.admin_addr,
        "tether_broker_tunnel_window_changes_total",
        &[],
    )
    .await?;
    assert_eq!((a, b), (0.0, 0.0), "window changes (agent, broker)");
    Ok(())
}

struct Delayed {
    _link: DelayLink,
    agent: tether_e2e::Agent,
    broker: Broker,
    echo: std::net::SocketAddr,
    _hub: Hub,
}

async fn delayed_tunnel(cluster: &str, tunnel_extra: &str) -> anyhow::Result<Delayed> {
    let hub = Hub::new()?;
    let echo = echo_server().await?;
    let broker = hub.start_broker("b1", tunnel_extra)?;
    let link = DelayLink::start(broker.agent_addr, ONE_WAY).await?;
    let agent = hub.start_agent(cluster, cluster, &[vec![link.addr]], echo, tunnel_extra)?;
    wait_agent_ready(&agent).await?;
    wait_tunnel(&broker, cluster).await?;
    Ok(Delayed {
        _link: link,
        agent,
        broker,
        echo,
        _hub: hub,
    })
}

async fn transfer(d: &Delayed) -> anyhow::Result<()> {
    let s = connect_ok(d.broker.client_addr, &qualified(&d.agent.cluster, d.echo)).await?;
    let t = echo_transfer(s, Arc::new(Payload::new()), TRANSFER).await?;
    assert!(t.intact(), "echo through the delayed tunnel is not intact");
    println!(
        "{} MiB each way over a 100 ms round trip in {:.2?}: {} each way",
        TRANSFER >> 20,
        t.elapsed,
        rate(t.throughput())
    );
    Ok(())
}

/// On a 100 ms round trip a 4 MiB window caps a stream at ~40 MiB/s: both ends measure that
/// the window is the limit and raise it (the agent for uploads, the broker for downloads).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn window_grows_on_a_long_round_trip() -> anyhow::Result<()> {
    let _serial = SERIAL.lock().await;
    let d = delayed_tunnel("wan", "").await?;
    assert_eq!(broker_windows(&d.broker, "wan").await?, vec![BASE_WINDOW]);
    transfer(&d).await?;
    let agent_changes = metric(
        d.agent.admin_addr,
        "tether_agent_tunnel_window_changes_total",
        &[],
    )
    .await?;
    let broker_changes = metric(
        d.broker.admin_addr,
        "tether_broker_tunnel_window_changes_total",
        &[],
    )
    .await?;
    let windows = broker_windows(&d.broker, "wan").await?;
    println!(
        "window changes: agent {agent_changes}, broker {broker_changes}; broker stream window now {windows:?}"
    );
    assert!(
        agent_changes >= 1.0,
        "the agent (receiving the upload) never raised its window"
    );
    assert!(
        broker_changes >= 1.0,
        "the broker (receiving the echo) never raised its window"
    );
    assert!(
        windows.iter().all(|w| *w > BASE_WINDOW && *w <= 16 << 20),
        "broker stream window {windows:?} should be above the 4 MiB base and at most the 16 MiB cap"
    );
    Ok(())
}

/// `max_stream_window_bytes` equal to the base: the same transfer leaves every window alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fixed_window_when_adaptation_is_off() -> anyhow::Result<()> {
    let _serial = SERIAL.lock().await;
    let d = delayed_tunnel("fixed", "tunnel:\n  max_stream_window_bytes: 4194304\n").await?;
    transfer(&d).await?;
    assert_no_window_changes(&d.agent, &d.broker).await?;
    assert_eq!(broker_windows(&d.broker, "fixed").await?, vec![BASE_WINDOW]);
    Ok(())
}

/// Loopback traffic never needs more than the base window: neither request/response (1 KiB
/// each way, 2,000 round trips, several BDP samples) nor a bulk echo, whose PINGs wait behind
/// megabytes of queued frames (the estimator uses the smallest round trip, not the queued one).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn window_stays_at_base_for_small_exchanges() -> anyhow::Result<()> {
    let _serial = SERIAL.lock().await;
    let hub = Hub::new()?;
    let echo = echo_server().await?;
    let broker = hub.start_broker("b1", "")?;
    let agent = hub.start_agent("lan", "lan", &[vec![broker.agent_addr]], echo, "")?;
    wait_agent_ready(&agent).await?;
    wait_tunnel(&broker, "lan").await?;
    let mut s = connect_ok(broker.client_addr, &qualified("lan", echo)).await?;
    let msg = [7u8; 1024];
    let mut back = [0u8; 1024];
    let started = tokio::time::Instant::now();
    let mut rounds = 0;
    // At least 2,000 round trips and 400 ms (four sampling periods).
    while rounds < 2_000 || started.elapsed() < Duration::from_millis(400) {
        s.write_all(&msg).await?;
        s.read_exact(&mut back).await?;
        assert_eq!(back, msg);
        rounds += 1;
    }
    drop(s);
    let bulk = connect_ok(broker.client_addr, &qualified("lan", echo)).await?;
    let t = echo_transfer(bulk, Arc::new(Payload::new()), 128 << 20).await?;
    assert!(t.intact());
    assert_no_window_changes(&agent, &broker).await?;
    assert_eq!(broker_windows(&broker, "lan").await?, vec![BASE_WINDOW]);
    Ok(())
}
