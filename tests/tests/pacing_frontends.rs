//! The CPU share paces a flood on every front end, not only CONNECT (tunnel-broker `budget`:
//! one `Pacer` per stream, charged by every byte loop), through a real broker and real agents.
//!
//! The broker runs with `budgets.cpu_share_lag: 1us`, so its CPU always counts as contended
//! (the test must not depend on how loaded the machine is). Cluster `victim` holds an idle
//! stream (so another cluster is present); cluster `flood` gets one stream at a time that pushes
//! bytes as fast as the client can write — within every budget, never refused — through the
//! unframed native Dial (`DialRaw`, via `tether-client`), the framed gRPC `Dial`, and
//! konnectivity. Each must be paced once it has moved most of the broker's bytes for
//! `SUSTAINED_HEAVY_PERIODS`: `tether_broker_paced_clusters` = 1 and the bytes its agent delivers
//! fall to the paced rate (10 MiB/s; asserted below [`PACED_MAX_BYTES_PER_SEC`] over a whole
//! second). CONNECT and the service proxy share `PacedReader` / `PacedWriter`
//! (tests/tests/fairness.rs).

mod grpc_support;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use futures::SinkExt as _;
use grpc_support::{channel, data, dial_req, next_packet, streaming_request};
use tether_e2e::{
    Hub, OPS_TOKEN, Setup, connect_ok, echo_server, metric, qualified, rate, wait_agent_ready,
    wait_tunnel,
};
use tether_proto::konnectivity as k;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

/// The paced rate is 10 MiB/s; 2× for measurement slack.
const PACED_MAX_BYTES_PER_SEC: f64 = 20.0 * 1024.0 * 1024.0;
const CHUNK: usize = 64 << 10;

async fn sink_server() -> anyhow::Result<SocketAddr> {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let a = l.local_addr()?;
    tokio::spawn(async move {
        while let Ok((mut s, _)) = l.accept().await {
            tokio::spawn(async move {
                let mut b = vec![0u8; 256 << 10];
                while matches!(s.read(&mut b).await, Ok(n) if n > 0) {}
            });
        }
    });
    Ok(a)
}

async fn delivered(agent_admin: SocketAddr) -> anyhow::Result<f64> {
    metric(
        agent_admin,
        "tether_agent_bytes_total",
        &[("direction", "to_target")],
    )
    .await
}

/// Waits until the flood is paced, then measures its delivery rate over one second.
async fn paced_rate(broker_admin: SocketAddr, agent_admin: SocketAddr) -> anyhow::Result<f64> {
    tether_test_support::wait_until_async(
        Duration::from_secs(30),
        "the flood to be paced",
        || async {
            let paced = metric(broker_admin, "tether_broker_paced_clusters", &[])
                .await
                .ok()?;
            (paced >= 1.0).then_some(())
        },
    )
    .await?;
    // The burst admitted before pacing (up to a stream window) drains first.
    tether_test_support::wait_until_async(
        Duration::from_secs(30),
        "the flood to reach its paced rate",
        || async {
            let (a, t) = (delivered(agent_admin).await.ok()?, Instant::now());
            tokio::time::sleep(Duration::from_millis(250)).await;
            let b = delivered(agent_admin).await.ok()?;
            ((b - a) / t.elapsed().as_secs_f64() < PACED_MAX_BYTES_PER_SEC).then_some(())
        },
    )
    .await?;
    let (a, t) = (delivered(agent_admin).await?, Instant::now());
    tokio::time::sleep(Duration::from_secs(1)).await;
    let r = (delivered(agent_admin).await? - a) / t.elapsed().as_secs_f64();
    let paced = metric(broker_admin, "tether_broker_paced_clusters", &[]).await?;
    assert_eq!(
        paced, 1.0,
        "the flood is still paced after the measured second"
    );
    assert!(r > 0.0, "the paced flood still moves bytes");
    Ok(r)
}

/// Waits until the flood's stream is gone and nothing is paced.
async fn unpaced(broker_admin: SocketAddr) -> anyhow::Result<()> {
    tether_test_support::wait_until_async(
        Duration::from_secs(30),
        "the flood's pacing to end with its stream",
        || async {
            let paced = metric(broker_admin, "tether_broker_paced_clusters", &[])
                .await
                .ok()?;
            (paced == 0.0).then_some(())
        },
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_byte_flood_is_paced_on_every_grpc_front_end() -> anyhow::Result<()> {
    let hub = Hub::new()?;
    let echo = echo_server().await?;
    let sink = sink_server().await?;
    let broker = hub.start_broker("b1", "budgets:\n  cpu_share_lag: 1us\n")?;
    let victim = hub.start_agent("victim", "victim", &[vec![broker.agent_addr]], echo, "")?;
    let flood = hub.start_agent("flood", "flood", &[vec![broker.agent_addr]], sink, "")?;
    for (a, c) in [(&victim, "victim"), (&flood, "flood")] {
        wait_agent_ready(a).await?;
        wait_tunnel(&broker, c).await?;
    }
    let _watch = connect_ok(broker.client_addr, &qualified("victim", echo)).await?;
    let flood_admin = flood.admin_addr;
    let broker_admin = broker.admin_addr;
    let setup = Setup {
        agent: flood,
        broker,
        echo,
        hub,
    };
    let dialer = setup.ops_dialer().await?;
    let host = sink.ip().to_string();
    let mut figures = Vec::new();

    for framing in ["DialRaw", "Dial"] {
        let mut s = if framing == "DialRaw" {
            let s = dialer.dial("flood", &host, sink.port()).await?;
            assert!(s.is_unframed(), "the SDK used DialRaw");
            s
        } else {
            dialer.dial_framed("flood", &host, sink.port()).await?
        };
        let pusher = tokio::spawn(async move {
            let chunk = vec![0x5au8; CHUNK];
            while s.write_all(&chunk).await.is_ok() {}
        });
        let r = paced_rate(broker_admin, flood_admin).await?;
        figures.push(format!("{framing} {}", rate(r)));
        assert!(
            r < PACED_MAX_BYTES_PER_SEC,
            "{framing}: the flood delivered {} while paced",
            rate(r)
        );
        pusher.abort();
        let _ = pusher.await;
        unpaced(broker_admin).await?;
    }

    // konnectivity: DATA packets as fast as the channel takes them.
    let mut kc = k::proxy_service_client::ProxyServiceClient::new(channel(&setup).await?);
    let (mut tx, req) = streaming_request::<k::Packet>(Some(OPS_TOKEN));
    tx.send(dial_req(qualified("flood", sink), 1)).await?;
    let mut inbound = kc.proxy(req).await?.into_inner();
    let rsp = next_packet(&mut inbound).await?;
    let Some(k::packet::Payload::DialResponse(d)) = rsp.payload else {
        anyhow::bail!("expected DIAL_RSP, got {rsp:?}");
    };
    assert_eq!(d.error, "", "{d:?}");
    let id = d.connect_id;
    let pusher = tokio::spawn(async move {
        let chunk = bytes::Bytes::from(vec![0x5au8; CHUNK]);
        while tx.send(data(id, chunk.clone())).await.is_ok() {}
    });
    let r = paced_rate(broker_admin, flood_admin).await?;
    figures.push(format!("konnectivity {}", rate(r)));
    assert!(
        r < PACED_MAX_BYTES_PER_SEC,
        "konnectivity: the flood delivered {} while paced",
        rate(r)
    );
    pusher.abort();
    drop(inbound);
    unpaced(broker_admin).await?;
    eprintln!(
        "paced flood rates: {}; load average {}",
        figures.join(", "),
        std::fs::read_to_string("/proc/loadavg")
            .unwrap_or_default()
            .trim()
    );
    Ok(())
}
