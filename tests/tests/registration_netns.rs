//! Registration across network namespaces, as in the seed: edge ↔ proxy ↔ hub, with
//! `ip_forward=0` in the proxy namespace so the managed cluster reaches hub NATS **only**
//! through a proxy process. Three agents join at once: through squid as an HTTP proxy, through
//! squid as an HTTPS proxy whose CA is appended to the bundle, and through squid requiring
//! basic auth. Each written hub kubeconfig keeps the same proxy-url.
//!
//! Needs root (network namespaces); skipped with a message otherwise.
//! Run: `cargo build --workspace --bins && cargo test -p tether-e2e --test registration_netns`.

use tether_e2e::registration;

use registration::*;

#[test]
fn joins_through_squid_http_https_and_basic_auth_across_namespaces() {
    if let Err(why) = can_use_netns() {
        eprintln!("SKIPPED registration_netns: network namespaces need root ({why})");
        return;
    }
    let topo = Topology::create().unwrap();
    let hub = Hub::start(HubOpts {
        auto_accept: vec!["edge-*".into()],
        netns: Some(topo.hub.clone()),
        nats_listen: "0.0.0.0:4222".into(),
        ..Default::default()
    })
    .unwrap();
    assert!(
        !topo.edge_reaches_hub_directly(4222),
        "edge must not reach the hub without the proxy"
    );
    let hosts = [(hub.opts.hub_host.as_str(), HUB_IP)];
    let ns = Some(topo.proxy.as_str());
    let http = start_proxy(
        &hub.logs,
        "squid-http",
        ProxyKind::SquidHttp,
        PROXY_EDGE_IP,
        Some(3128),
        &hosts,
        ns,
    )
    .unwrap();
    let https = start_proxy(
        &hub.logs,
        "squid-https",
        ProxyKind::SquidHttps,
        PROXY_EDGE_IP,
        Some(3129),
        &hosts,
        ns,
    )
    .unwrap();
    let auth = start_proxy(
        &hub.logs,
        "squid-auth",
        ProxyKind::SquidAuth {
            user: "edge".into(),
            password: "p@ss:word".into(),
        },
        PROXY_EDGE_IP,
        Some(3130),
        &hosts,
        ns,
    )
    .unwrap();
    for p in [&http, &https, &auth] {
        topo.wait_tcp_in(
            &topo.edge,
            &format!("{PROXY_EDGE_IP}:{}", p.port),
            START_TIMEOUT,
        )
        .unwrap();
    }
    let server = format!("tls://{}:4222", hub.opts.hub_host);
    let auth_url = format!("http://edge:p%40ss%3Aword@{PROXY_EDGE_IP}:{}", auth.port);
    let cases = [
        ("edge-http", http.url(), None),
        ("edge-https", https.url(), https.ca_file.clone()),
        ("edge-auth", auth_url, None),
    ];
    let mut agents = Vec::new();
    for (name, url, ca) in &cases {
        let boot = hub.dir.join(format!("{name}.kubeconfig"));
        hub.join(&boot, &server, &hub.token, Some(url), ca.as_deref())
            .unwrap();
        let creds = hub.dir.join(format!("creds-{name}"));
        agents.push((
            *name,
            url.clone(),
            start_agent(&hub.logs, name, name, &boot, &creds, Some(&topo.edge)).unwrap(),
        ));
    }
    for (name, url, agent) in &agents {
        wait_log(&hub.logs, name, "joined the hub", START_TIMEOUT).unwrap();
        let t = agent.started.elapsed();
        println!(
            "{name}: start-to-Joined through {url} in another namespace: {} ms",
            t.as_millis()
        );
        hub.wait_condition(name, "ManagedClusterJoined", "True", START_TIMEOUT)
            .unwrap();
        hub.wait_condition(
            name,
            "ManagedClusterConditionAvailable",
            "True",
            START_TIMEOUT,
        )
        .unwrap();
        let kc = std::fs::read_to_string(agent.creds.join("kubeconfig")).unwrap();
        let ep = tether_control::kubeconfig::parse_hub_endpoint(&kc, "kubeconfig").unwrap();
        assert_eq!(ep.server, server);
        assert_eq!(
            ep.proxy.map(|p| p.to_url_with_secret()).as_deref(),
            Some(url.as_str()),
            "{name}: hub kubeconfig keeps the proxy-url"
        );
        if *name == "edge-https" {
            // Hub CA plus the proxy CA, de-duplicated.
            assert_eq!(tether_pki::pem_certificates(&ep.ca_pem).len(), 2);
        }
    }
    // Every proxy carried its agent's CONNECT to the hub.
    for p in [&http, &https, &auth] {
        let log = std::fs::read_to_string(p.dir.join("access.log")).unwrap_or_default();
        assert!(
            log.contains("CONNECT hub.tether.test:4222"),
            "{}: {log}",
            p.dir.display()
        );
    }
    drop(agents);
}
