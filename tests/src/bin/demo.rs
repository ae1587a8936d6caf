//! The README's main job: a local hub (two brokers that relay for each other, a health-prober)
//! and two simulated managed clusters whose tunnel-agents can only reach the hub through a
//! forward proxy (tinyproxy). Shows the clusteradm-style health table, requests reaching each
//! cluster's API server and an in-cluster service through the tunnels, and what happens when a
//! cluster's agent stops.
//!
//! Kubernetes cannot run here: each cluster's "API server" is a real TLS server on loopback
//! (`tether_e2e::apiserver`), its "service" a small HTTP server.

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::Context as _;
use tether_client::{Dialer, DialerConfig, Token};
use tether_e2e::apiserver::{FakeApiServer, KUBE_TOKEN};
use tether_e2e::forward_proxy::Tinyproxy;
use tether_e2e::{
    Hub, OPS_TOKEN, admin_get, connect, health_rows, peers_yaml, wait_agent_ready, wait_tunnel,
};
use tether_test_support::wait_until_async;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

async fn web_service(cluster: &'static str) -> anyhow::Result<SocketAddr> {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = l.local_addr()?;
    tokio::spawn(async move {
        while let Ok((mut s, _)) = l.accept().await {
            tokio::spawn(async move {
                let mut buf = vec![0u8; 4096];
                let _ = s.read(&mut buf).await;
                let body = format!("hello from the web service inside cluster {cluster}\n");
                let resp = format!(
                    "HTTP/1.1 200 OK\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                    body.len()
                );
                let _ = s.write_all(resp.as_bytes()).await;
            });
        }
    });
    Ok(addr)
}

fn print_table(rows: &[serde_json::Value], tunnels: &str) {
    println!("\nCLUSTER NAME  INSTALLED  AVAILABLE  PROBED HEALTH  LATENCY");
    for r in rows {
        let cluster = r["cluster"].as_str().unwrap_or("?");
        let connected = tunnels.contains(&format!("\"cluster\":\"{cluster}\""));
        let latency = match (r["latency_ms"].as_f64(), r["tunnel_rtt_ms"].as_f64()) {
            (Some(l), Some(t)) if r["last_probe_ok"] == true => {
                format!("{l:.2}ms (tunnel {t:.2}ms)")
            }
            (Some(l), _) if r["last_probe_ok"] == true => format!("{l:.2}ms"),
            _ => format!("- ({})", r["error"].as_str().unwrap_or("unknown")),
        };
        println!(
            "{:<14}{:<11}{:<11}{:<15}{}",
            cluster,
            "True",
            if connected { "True" } else { "False" },
            if r["healthy"] == true {
                "True"
            } else {
                "False"
            },
            latency
        );
    }
    println!();
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let hub = Hub::new()?;
    println!(
        "== hub: brokers b1 and b2 (relaying for each other), CA in {}",
        hub.pki.dir.display()
    );
    let b1 = hub.start_broker("b1", "")?;
    let b2 = hub.start_broker("b2", &peers_yaml(&b1))?;
    let proxy = Tinyproxy::start(hub.path(), "corporate-proxy").context("tinyproxy")?;
    println!(
        "== forward proxy (tinyproxy) at {} — the clusters' only way out",
        proxy.url()
    );

    let mut agents = Vec::new();
    for cluster in ["edge-a", "edge-b"] {
        let api = FakeApiServer::start(&hub).await?;
        let web = web_service(cluster).await?;
        let extra = format!(
            "proxy:\n  https_proxy: '{}'\npolicy:\n  allow: ['web.svc:{}', '127.0.0.1:{}']\n",
            proxy.url(),
            web.port(),
            web.port()
        );
        let agent = hub.start_agent(cluster, cluster, &[vec![b1.agent_addr]], api.addr, &extra)?;
        wait_agent_ready(&agent).await?;
        wait_tunnel(&b1, cluster).await?;
        println!(
            "== cluster {cluster}: tunnel-agent connected to b1 through the proxy; API server {} , web service {web}",
            api.addr
        );
        agents.push((cluster, agent, api, web));
    }
    for l in proxy.connects() {
        println!("   proxy log: {l}");
    }

    // The health-prober probes every cluster through the tunnels.
    let prober = hub.start_prober(&b2, &["edge-a", "edge-b"], "interval: 1s\ntimeout: 900ms")?;
    let admin = prober.admin_addr;
    let rows = wait_until_async(
        Duration::from_secs(20),
        "both clusters probed healthy",
        || async {
            let rows = health_rows(admin).await?;
            (rows.len() == 2 && rows.iter().all(|r| r["healthy"] == true)).then_some(rows)
        },
    )
    .await?;
    let (_, tunnels) = admin_get(b1.admin_addr, "/debug/tunnels").await?;
    println!(
        "$ tetherctl proxy health   (from the health-prober, probing through broker b2 → relay → b1)"
    );
    print_table(&rows, &tunnels);

    // A kube client for edge-a through the tunnel (via b2, relayed to b1).
    let dialer = Dialer::connect(DialerConfig {
        endpoint: format!("https://{}", b2.client_tls_addr),
        server_name: "localhost".into(),
        ca_pem: std::fs::read_to_string(hub.pki.ca_path())?,
        client_cert: None,
        token: Some(Token(OPS_TOKEN.into())),
        connect_timeout: Duration::from_secs(5),
    })
    .await?;
    let mut kcfg = kube::Config::new("https://edge-a:443".parse()?);
    kcfg.root_cert = Some(
        tether_tls::pem::read_certs(&hub.pki.ca_path())?
            .iter()
            .map(|c| c.to_vec())
            .collect(),
    );
    kcfg.tls_server_name = Some("kubernetes.default.svc".into());
    kcfg.auth_info.token = Some(KUBE_TOKEN.to_owned().into());
    let v = dialer
        .kube_client("edge-a", kcfg)?
        .apiserver_version()
        .await?;
    println!(
        "$ kube::Client for edge-a via broker b2 → GET /version: gitVersion {}",
        v.git_version
    );

    // An in-cluster service of edge-b by CONNECT.
    let (_, _, _, web_b) = &agents[1];
    let target = format!("127.0.0.1.edge-b.tether:{}", web_b.port());
    let mut s = match connect(b1.client_addr, &target, Some(OPS_TOKEN)).await? {
        Ok(s) => s,
        Err((code, body)) => anyhow::bail!("CONNECT {target} answered {code}: {body}"),
    };
    s.write_all(b"GET / HTTP/1.1\r\nhost: web\r\nconnection: close\r\n\r\n")
        .await?;
    let mut out = String::new();
    tokio::time::timeout(Duration::from_secs(10), s.read_to_string(&mut out)).await??;
    println!(
        "$ curl --proxy http://{} http://{target}/\n  {}",
        b1.client_addr,
        out.lines().last().unwrap_or("")
    );

    // A target the client may reach but the policy of edge-a's agent forbids.
    let denied = match connect(b1.client_addr, "10.0.0.1.edge-a.tether:22", Some(OPS_TOKEN)).await?
    {
        Ok(_) => "unexpectedly allowed".to_owned(),
        Err((code, body)) => format!("{code} — {}", body.lines().last().unwrap_or("").trim()),
    };
    println!("$ CONNECT 10.0.0.1.edge-a.tether:22 → {denied}");

    // Stop edge-b's agent: the prober reports it within a couple of intervals.
    let (_, mut agent_b, _, _) = agents.pop().expect("two agents");
    println!("\n== stopping the tunnel-agent of edge-b ...");
    agent_b.child.kill();
    let rows = wait_until_async(
        Duration::from_secs(20),
        "edge-b reported unhealthy",
        || async {
            let rows = health_rows(admin).await?;
            rows.iter()
                .any(|r| r["cluster"] == "edge-b" && r["healthy"] == false)
                .then_some(rows)
        },
    )
    .await?;
    let (_, tunnels) = admin_get(b1.admin_addr, "/debug/tunnels").await?;
    print_table(&rows, &tunnels);
    let (_, metrics) = admin_get(b1.admin_addr, "/metrics").await?;
    println!("broker b1 metrics (excerpt):");
    for line in metrics.lines().filter(|l| {
        l.starts_with("tether_broker_tunnels ")
            || l.starts_with("tether_broker_bytes_total")
            || l.starts_with("tether_broker_dial_failures_total")
    }) {
        println!("  {line}");
    }
    Ok(())
}
