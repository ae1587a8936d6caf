//! The health-prober against real brokers and agents: a healthy cluster, one whose API server
//! is down, one whose agent is gone — reported within a few intervals, with connections reused.

use std::time::Duration;

use tether_e2e::apiserver::FakeApiServer;
use tether_e2e::{Hub, admin_get, health_rows, wait_agent_ready, wait_tunnel};
use tether_test_support::wait_until_async;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_table_reflects_healthy_down_and_gone_clusters() -> anyhow::Result<()> {
    let hub = Hub::new()?;
    let api = FakeApiServer::start(&hub).await?;
    let refusing = tether_e2e::RefusingPort::new()?;
    let closed = refusing.addr; // nothing listens here
    let broker = hub.start_broker("b1", "")?;
    let ok = hub.start_agent("ok", "ok", &[vec![broker.agent_addr]], api.addr, "")?;
    let down = hub.start_agent("down", "down", &[vec![broker.agent_addr]], closed, "")?;
    for a in [&ok, &down] {
        wait_agent_ready(a).await?;
        wait_tunnel(&broker, &a.cluster).await?;
    }
    // The tunnel's round trip is sampled by the broker's keepalive shortly after connecting.
    wait_until_async(Duration::from_secs(20), "tunnel RTT measured", || async {
        let (_, body) = admin_get(broker.admin_addr, "/debug/tunnels").await.ok()?;
        let rows: Vec<serde_json::Value> = serde_json::from_str(&body).ok()?;
        (rows.len() == 2 && rows.iter().all(|r| r["rtt_micros"].as_u64().is_some())).then_some(())
    })
    .await?;

    let prober = hub.start_prober(
        &broker,
        &["ok", "down", "gone"],
        "interval: 300ms\ntimeout: 250ms\nfailure_threshold: 2",
    )?;
    let admin = prober.admin_addr;

    let table = wait_until_async(
        Duration::from_secs(20),
        "five probes of every cluster",
        || async {
            let rows = health_rows(admin).await?;
            (rows.len() == 3 && rows.iter().all(|r| r["probes"].as_u64() >= Some(5)))
                .then_some(rows)
        },
    )
    .await?;
    let row = |c: &str| {
        table
            .iter()
            .find(|r| r["cluster"] == c)
            .cloned()
            .expect("row")
    };
    let (r_ok, r_down, r_gone) = (row("ok"), row("down"), row("gone"));

    assert_eq!(r_ok["healthy"], true, "{r_ok}");
    assert_eq!(r_ok["path"], "/livez");
    assert_eq!(r_ok["tls_verified"], true);
    assert!(
        r_ok["tunnel_rtt_ms"].as_f64().is_some(),
        "tunnel round trip missing: {r_ok}"
    );
    // One tunnel stream and one TLS connection served every probe of the healthy cluster.
    assert_eq!(r_ok["connections_opened"], 1, "{r_ok}");
    assert_eq!(
        api.connections(),
        1,
        "the prober opened a new API server connection per probe"
    );
    assert!(api.requests() >= 5);

    assert_eq!(r_down["healthy"], false, "{r_down}");
    assert!(
        r_down["error"].as_str().unwrap_or("").contains("refused"),
        "{r_down}"
    );
    assert_eq!(r_gone["healthy"], false, "{r_gone}");
    assert!(
        r_gone["error"].as_str().unwrap_or("").contains("no tunnel"),
        "{r_gone}"
    );

    let (_, metrics) = admin_get(admin, "/metrics").await?;
    assert!(
        metrics.contains("tether_prober_cluster_healthy{cluster=\"ok\"} 1"),
        "{metrics}"
    );
    assert!(
        metrics.contains("tether_prober_cluster_healthy{cluster=\"down\"} 0"),
        "{metrics}"
    );
    Ok(())
}
