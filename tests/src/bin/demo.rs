//! The README's main job (data plane part): starts a broker and an agent for a simulated cluster
//! whose "API server" is a small HTTP server on loopback, then sends an HTTP request through
//! `CONNECT demo:443` and prints what came back, and the broker's tunnel table.

use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let hub = tether_e2e::Hub::new()?;
    // A stand-in for the cluster's API server, reachable only by the agent's dial.
    let api = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let api_addr = api.local_addr()?;
    tokio::spawn(async move {
        while let Ok((mut s, _)) = api.accept().await {
            tokio::spawn(async move {
                let mut buf = vec![0u8; 4096];
                let _ = s.read(&mut buf).await;
                let body = "{\"kind\":\"Status\",\"status\":\"Success\",\"message\":\"hello from inside cluster demo\"}\n";
                let resp = format!(
                    "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                    body.len()
                );
                let _ = s.write_all(resp.as_bytes()).await;
            });
        }
    });
    let broker = hub.start_broker("b1", "")?;
    println!(
        "broker b1: agents on {}, clients on {} (CONNECT) and {} (TLS: CONNECT + gRPC)",
        broker.agent_addr, broker.client_addr, broker.client_tls_addr
    );
    let agent = hub.start_agent("demo", "demo", &[vec![broker.agent_addr]], api_addr, "")?;
    tether_e2e::wait_agent_ready(&agent).await?;
    tether_e2e::wait_tunnel(&broker, "demo").await?;
    println!("agent for cluster demo connected; its API server stand-in listens on {api_addr}");
    let started = std::time::Instant::now();
    let mut s =
        match tether_e2e::connect(broker.client_addr, "demo:443", Some(tether_e2e::OPS_TOKEN))
            .await?
        {
            Ok(s) => s,
            Err((code, body)) => anyhow::bail!("CONNECT failed with {code}: {body}"),
        };
    s.write_all(b"GET /version HTTP/1.1\r\nhost: demo\r\nconnection: close\r\n\r\n")
        .await?;
    let mut out = String::new();
    tokio::time::timeout(Duration::from_secs(10), s.read_to_string(&mut out)).await??;
    println!(
        "\n$ CONNECT demo:443 via broker, then GET /version  ({:.2} ms)\n{out}",
        started.elapsed().as_secs_f64() * 1e3
    );
    let (_, tunnels) = tether_e2e::admin_get(broker.admin_addr, "/debug/tunnels").await?;
    println!("broker tunnel table: {tunnels}");
    let (_, metrics) = tether_e2e::admin_get(broker.admin_addr, "/metrics").await?;
    for line in metrics.lines().filter(|l| {
        l.starts_with("tether_broker_tunnels") || l.starts_with("tether_broker_bytes_total")
    }) {
        println!("  {line}");
    }
    Ok(())
}
