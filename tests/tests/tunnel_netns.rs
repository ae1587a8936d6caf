//! The tunnel across real network boundaries: three network namespaces, edge ↔ proxy ↔ hub,
//! with forwarding off in the proxy namespace, so the edge reaches the hub only through squid
//! and the hub cannot reach the edge at all. A hub client still reaches a service that listens
//! on the edge's loopback, through the tunnel. Needs root (skipped with a message otherwise).

use tether_e2e::registration;

use std::process::Command;
use std::time::Duration;

use registration::{
    EDGE_IP, HUB_IP, PROXY_EDGE_IP, ProxyKind, Topology, can_use_netns, start_proxy,
};
use tether_e2e::{Hub, OPS_TOKEN, command_in};
use tether_test_support::{Child, wait_until};

/// curl run inside `ns`; returns (exit success, stdout).
fn curl_in(ns: &str, args: &[&str]) -> (bool, String) {
    let out = command_in(Some(ns), "curl")
        .args(["-s", "--max-time", "5"])
        .args(args)
        .output()
        .expect("run curl");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
    )
}

#[test]
fn hub_client_reaches_edge_loopback_service_through_proxy_only_tunnel() -> anyhow::Result<()> {
    if let Err(why) = can_use_netns() {
        eprintln!("skipped: network namespaces unavailable ({why})");
        return Ok(());
    }
    let hub = Hub::new()?;
    let topo = Topology::create()?;

    // A web service on the edge's own loopback: nothing outside the edge namespace can reach it.
    let site = hub.path().join("site");
    std::fs::create_dir_all(&site)?;
    std::fs::write(
        site.join("index.html"),
        "hello from inside the edge network\n",
    )?;
    let web_port = std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port();
    let mut web = command_in(Some(&topo.edge), "python3");
    web.args([
        "-m",
        "http.server",
        "--bind",
        "127.0.0.1",
        &web_port.to_string(),
        "--directory",
    ])
    .arg(&site);
    let _web = Child::spawn("edge-web", web, hub.path())?;

    let proxy = start_proxy(
        hub.path(),
        "squid",
        ProxyKind::SquidHttp,
        PROXY_EDGE_IP,
        None,
        &[],
        Some(&topo.proxy),
    )?;
    let broker = hub.start_broker_at("b1", "", Some(&topo.hub), HUB_IP)?;
    assert!(
        !topo.edge_reaches_hub_directly(broker.agent_addr.port()),
        "the edge reaches the hub without the proxy: the topology is broken"
    );
    let apiserver: std::net::SocketAddr = format!("127.0.0.1:{web_port}").parse()?;
    let _agent = hub.start_agent_at(
        "edge",
        "edge",
        &[vec![broker.agent_addr]],
        apiserver,
        &format!(
            "proxy:\n  https_proxy: 'http://{PROXY_EDGE_IP}:{}'\n",
            proxy.port
        ),
        Some(&topo.edge),
    )?;

    let proxy_url = format!("http://{}", broker.client_addr);
    let auth = format!("Proxy-Authorization: Bearer {OPS_TOKEN}");
    let target = format!("http://127.0.0.1.edge.tether:{web_port}/");
    let body = wait_until(
        Duration::from_secs(30),
        "the edge service through the tunnel",
        || {
            let (ok, body) = curl_in(
                &topo.hub,
                &[
                    "-p",
                    "--proxy",
                    &proxy_url,
                    "--proxy-header",
                    &auth,
                    &target,
                ],
            );
            (ok && body.contains("hello from inside")).then_some(body)
        },
    )
    .map_err(|e| {
        e.context(std::fs::read_to_string(hub.path().join("broker-b1.log")).unwrap_or_default())
    })?;
    assert!(body.contains("edge network"), "{body}");

    // The API-server shorthand goes to the same place (the agent's `apiserver`).
    let (ok, body) = curl_in(
        &topo.hub,
        &[
            "-p",
            "--proxy",
            &proxy_url,
            "--proxy-header",
            &auth,
            "http://edge:443/",
        ],
    );
    assert!(
        ok && body.contains("hello from inside"),
        "edge:443 failed: {body}"
    );

    // Without the tunnel, the hub cannot reach the edge at all.
    let (direct, _) = curl_in(
        &topo.hub,
        &[
            "--connect-timeout",
            "2",
            &format!("http://{EDGE_IP}:{web_port}/"),
        ],
    );
    assert!(!direct, "the hub reached the edge directly");
    let st = Command::new("ip")
        .args(["netns", "exec", &topo.hub, "true"])
        .status()?;
    assert!(st.success());
    Ok(())
}
