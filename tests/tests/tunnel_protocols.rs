//! Broker↔agent protocol negotiation (ALPN, docs/tunnel-protocol.md) with real broker and agent
//! processes: by default both speak `tether-tunnel/2` (the multiplexer); an agent or a broker set
//! to `tunnel.protocol: h2` keeps the tunnel on `tether-tunnel/1` (HTTP/2), so a fleet of mixed
//! versions keeps working during an upgrade. Every tunnel carries the same traffic — 4 MiB each
//! way with half-close, early data behind the CONNECT head, a refused dial with its reason —
//! and reports its protocol in `/debug/tunnels` and `tether_broker_tunnel_connections_total`.

use std::sync::Arc;

use tether_e2e::{
    Broker, Hub, Payload, admin_get, connect, connect_ok, echo_server, echo_transfer, metric,
    qualified, wait_agent_ready, wait_tunnel,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const H2_ONLY: &str = "tunnel:\n  protocol: h2\n";

/// The protocol of `cluster`'s tunnel as the broker reports it.
async fn tunnel_protocol(broker: &Broker, cluster: &str) -> anyhow::Result<String> {
    let (_, body) = admin_get(broker.admin_addr, "/debug/tunnels").await?;
    let list: serde_json::Value = serde_json::from_str(&body)?;
    let found = list
        .as_array()
        .into_iter()
        .flatten()
        .find(|t| t["cluster"] == cluster)
        .and_then(|t| t["protocol"].as_str().map(str::to_owned));
    found.ok_or_else(|| anyhow::anyhow!("no tunnel of {cluster} in /debug/tunnels: {body}"))
}

/// Echo through the tunnel, early data included, and a refused dial's reason.
async fn carries_traffic(
    broker: &Broker,
    cluster: &str,
    echo: std::net::SocketAddr,
) -> anyhow::Result<()> {
    let s = connect_ok(broker.client_addr, &qualified(cluster, echo)).await?;
    let t = echo_transfer(s, Arc::new(Payload::new()), 4 << 20).await?;
    anyhow::ensure!(t.intact(), "{cluster}: echo not intact");
    // Early data: the first bytes leave right behind the CONNECT head.
    let mut raw = tokio::net::TcpStream::connect(broker.client_addr).await?;
    let target = qualified(cluster, echo);
    raw.write_all(
        format!(
            "CONNECT {target} HTTP/1.1\r\nhost: {target}\r\nproxy-authorization: Bearer {}\r\n\r\nearly bytes",
            tether_e2e::OPS_TOKEN
        )
        .as_bytes(),
    )
    .await?;
    let mut got = Vec::new();
    let mut buf = [0u8; 512];
    let want = b"early bytes";
    while !got.ends_with(want) {
        let n =
            tokio::time::timeout(std::time::Duration::from_secs(10), raw.read(&mut buf)).await??;
        anyhow::ensure!(
            n > 0,
            "{cluster}: EOF before the early bytes came back: {got:?}"
        );
        got.extend_from_slice(&buf[..n]);
    }
    let head = String::from_utf8_lossy(&got);
    anyhow::ensure!(head.starts_with("HTTP/1.1 200"), "{cluster}: {head}");
    // A port nobody listens on: the agent's refusal and its reason come back.
    let refusing = tether_e2e::RefusingPort::new()?;
    let closed = refusing.addr;
    match connect(
        broker.client_addr,
        &qualified(cluster, closed),
        Some(tether_e2e::OPS_TOKEN),
    )
    .await?
    {
        Ok(_) => anyhow::bail!("{cluster}: a dial to a closed port succeeded"),
        Err((code, body)) => anyhow::ensure!(
            code == 502 && body.contains("refused"),
            "{cluster}: closed port answered {code}: {body}"
        ),
    }
    Ok(())
}

#[tokio::test]
async fn agents_and_brokers_use_the_best_protocol_both_speak() -> anyhow::Result<()> {
    let hub = Hub::new()?;
    let echo = echo_server().await?;
    let current = hub.start_broker("b2", "")?;
    let h2_only = hub.start_broker("b1", H2_ONLY)?;
    // (cluster, agent's extra config, broker, protocol the tunnel must use)
    let cases = [
        ("both-current", "", &current, "mux"),
        ("agent-h2", H2_ONLY, &current, "h2"),
        ("broker-h2", "", &h2_only, "h2"),
    ];
    let mut agents = Vec::new();
    for (cluster, extra, broker, _) in &cases {
        let agent = hub.start_agent(cluster, cluster, &[vec![broker.agent_addr]], echo, extra)?;
        wait_agent_ready(&agent).await?;
        wait_tunnel(broker, cluster).await?;
        agents.push(agent);
    }
    for (cluster, _, broker, protocol) in &cases {
        assert_eq!(
            tunnel_protocol(broker, cluster).await?,
            *protocol,
            "protocol of {cluster}'s tunnel"
        );
        carries_traffic(broker, cluster, echo).await?;
    }
    let count = |b: &Broker, p: &'static str| {
        let admin = b.admin_addr;
        async move {
            metric(
                admin,
                "tether_broker_tunnel_connections_total",
                &[("protocol", p)],
            )
            .await
        }
    };
    assert_eq!(count(&current, "mux").await?, 1.0);
    assert_eq!(count(&current, "h2").await?, 1.0);
    assert_eq!(count(&h2_only, "h2").await?, 1.0);
    assert_eq!(count(&h2_only, "mux").await?, 0.0);
    Ok(())
}
