//! The README's main job: a local hub (NATS control plane with the addon-manager, two brokers
//! that relay for each other, a health-prober on NATS) and two simulated managed clusters whose
//! tunnel-agents can only reach the hub through a forward proxy (tinyproxy). Shows the
//! `tetherctl proxy health` table (the same library code: ManagedClusters, the cluster-proxy
//! ManagedClusterAddOns and the prober's `tether.v1.health.get` answer), requests reaching each
//! cluster's API server and an in-cluster service through the tunnels, and what happens when a
//! cluster's agent stops.
//!
//! The add-on lease of each running tunnel-agent is renewed by the demo on the agent's behalf
//! (in a deployment `registration-agent --addon cluster-proxy` supervises the tunnel-agent and
//! renews it; `tests/tests/addon_delivery.rs` runs that chain).
//!
//! Kubernetes cannot run here: each cluster's "API server" is a real TLS server on loopback
//! (`tether_e2e::apiserver`), its "service" a small HTTP server.

use std::net::SocketAddr;
use std::time::Duration;

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};

use anyhow::Context as _;
use tether_client::{Dialer, DialerConfig, Token};
use tether_control::health::{proxy_health, render_table};
use tether_control::store::HubStore;
use tether_control::subjects;
use tether_e2e::apiserver::{FakeApiServer, KUBE_TOKEN};
use tether_e2e::control_plane::ControlPlane;
use tether_e2e::forward_proxy::Tinyproxy;
use tether_e2e::{Hub, OPS_TOKEN, admin_get, connect, peers_yaml, wait_agent_ready, wait_tunnel};
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

const CLUSTER_PROXY_ADDON: &str = "apiVersion: addon.open-cluster-management.io/v1alpha1\nkind: ClusterManagementAddOn\nmetadata:\n  name: cluster-proxy\nspec:\n  installStrategy:\n    type: All\n";

/// Renews `cluster-proxy`'s add-on lease for every cluster in `alive` (what the add-on agent
/// does), every 300 ms with a 1 s lease.
fn renew_addon_leases(client: async_nats::Client, alive: Arc<Mutex<BTreeSet<String>>>) {
    tokio::spawn(async move {
        loop {
            let clusters: Vec<String> = alive
                .lock()
                .map(|a| a.iter().cloned().collect())
                .unwrap_or_default();
            for c in clusters {
                let _ = tether_control::connect::request_json::<_, serde_json::Value>(
                    &client,
                    subjects::cluster_addon_lease(&c, "cluster-proxy"),
                    &serde_json::json!({"holderIdentity": "cluster-proxy-agent", "leaseDurationSeconds": 1}),
                )
                .await;
            }
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
    });
}

/// The `tetherctl proxy health` rows once `ok` accepts them.
async fn wait_table(
    client: &async_nats::Client,
    store: &HubStore,
    what: &str,
    ok: impl Fn(&[tether_control::health::ProxyHealthRow]) -> bool,
) -> anyhow::Result<Vec<tether_control::health::ProxyHealthRow>> {
    wait_until_async(Duration::from_secs(30), what, || async {
        let h = proxy_health(client, store, None).await.ok()?;
        ok(&h.rows).then_some(h.rows)
    })
    .await
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let hub = Hub::new()?;
    let cp = ControlPlane::start(hub.path()).context("hub control plane")?;
    println!(
        "== hub control plane: nats-server (JetStream, TLS, auth callout) at {} + addon-manager; hub dir {}",
        cp.nats_url,
        cp.hub_dir.display()
    );
    for c in ["edge-a", "edge-b"] {
        print!(
            "$ tetherctl accept {c}\n  {}",
            cp.tetherctl(&["accept", c])?
        );
    }
    let cma = hub.path().join("cluster-proxy.yaml");
    std::fs::write(&cma, CLUSTER_PROXY_ADDON)?;
    print!(
        "$ tetherctl apply -f cluster-proxy.yaml\n  {}",
        cp.tetherctl(&["apply", "-f", &cma.display().to_string()])?
    );
    let admin = cp.admin().await?;
    let store = HubStore::open(admin.client.clone()).await?;

    println!(
        "== hub data plane: brokers b1 and b2 (relaying for each other), CA in {}",
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
    let alive = Arc::new(Mutex::new(
        ["edge-a", "edge-b"]
            .map(String::from)
            .into_iter()
            .collect::<BTreeSet<_>>(),
    ));
    renew_addon_leases(admin.client.clone(), Arc::clone(&alive));

    // The health-prober takes the accepted clusters from the hub and probes them through b2.
    let _prober = hub.start_prober(
        &b2,
        &[],
        &format!(
            "interval: 1s\ntimeout: 900ms\nfailure_threshold: 1\n{}",
            cp.prober_nats_yaml()
        ),
    )?;
    let rows = wait_table(
        &admin.client,
        &store,
        "both clusters installed, available and healthy",
        |rows| {
            rows.len() == 2
                && rows
                    .iter()
                    .all(|r| r.installed && r.available == "True" && r.probed_health == "True")
        },
    )
    .await?;
    println!(
        "\n$ tetherctl proxy health   (health-prober probing through broker b2 → relay → b1; answered from its memory)"
    );
    println!("{}", render_table(&rows, false));

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

    // An in-cluster service of each cluster by CONNECT.
    for (cluster, _, _, web) in &agents {
        let target = format!("127.0.0.1.{cluster}.tether:{}", web.port());
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
    }

    // A target the client may reach but the policy of edge-a's agent forbids.
    let denied = match connect(b1.client_addr, "10.0.0.1.edge-a.tether:22", Some(OPS_TOKEN)).await?
    {
        Ok(_) => "unexpectedly allowed".to_owned(),
        Err((code, body)) => format!("{code} — {}", body.lines().last().unwrap_or("").trim()),
    };
    println!("$ CONNECT 10.0.0.1.edge-a.tether:22 → {denied}");

    // Stop edge-b's agent: PROBED HEALTH within an interval, AVAILABLE once its lease lapses.
    let (_, mut agent_b, _, _) = agents.pop().expect("two agents");
    println!("\n== stopping the tunnel-agent of edge-b ...");
    if let Ok(mut a) = alive.lock() {
        a.remove("edge-b");
    }
    agent_b.child.kill();
    let rows = wait_table(
        &admin.client,
        &store,
        "edge-b unhealthy and unavailable",
        |rows| {
            rows.iter().any(|r| {
                r.cluster_name == "edge-b" && r.probed_health == "False" && r.available == "False"
            })
        },
    )
    .await?;
    println!("$ tetherctl proxy health -o wide");
    println!("{}", render_table(&rows, true));
    let events = cp.tetherctl(&["events", "edge-b", "--subject", "tether.v1.events.health.>"])?;
    println!("$ tetherctl events edge-b --subject 'tether.v1.events.health.>'\n{events}");
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
