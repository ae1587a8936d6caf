//! The tunnel-agent reaches brokers through real forward proxies (squid, HTTP and HTTPS with
//! its own CA, and with basic auth); NO_PROXY bypasses them; a wrong password is a named error.

use tether_e2e::registration;

use std::time::Duration;

use registration::{ProxyKind, start_proxy};
use tether_e2e::{Hub, OPS_TOKEN, admin_get, connect, echo_server, wait_agent_ready, wait_tunnel};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

async fn round_trip(broker: &tether_e2e::Broker) -> anyhow::Result<()> {
    let mut s = match connect(broker.client_addr, "c1:443", Some(OPS_TOKEN)).await? {
        Ok(s) => s,
        Err((code, body)) => anyhow::bail!("CONNECT answered {code}: {body}"),
    };
    s.write_all(b"through the proxy").await?;
    let mut buf = [0u8; 17];
    tokio::time::timeout(Duration::from_secs(10), s.read_exact(&mut buf)).await??;
    assert_eq!(&buf, b"through the proxy");
    Ok(())
}

fn access_log(p: &registration::Proxy) -> String {
    std::fs::read_to_string(p.dir.join("access.log")).unwrap_or_default()
}

async fn proxied_agent(kind: ProxyKind, name: &str) -> anyhow::Result<()> {
    let hub = Hub::new()?;
    let echo = echo_server().await?;
    let broker = hub.start_broker("b1", "")?;
    let proxy = start_proxy(hub.path(), name, kind, "127.0.0.1", None, &[], None)?;
    let ca_line = proxy
        .ca_file
        .as_ref()
        .map(|c| format!("\n  ca_bundle: {}", c.display()))
        .unwrap_or_default();
    let extra = format!("proxy:\n  https_proxy: '{}'{ca_line}\n", proxy.url());
    let mut agent = hub.start_agent("c1", "c1", &[vec![broker.agent_addr]], echo, &extra)?;
    wait_agent_ready(&agent).await?;
    wait_tunnel(&broker, "c1").await?;
    round_trip(&broker).await?;
    // The tunnel really went through the proxy: squid logs a CONNECT when it ends, so stop the
    // agent (graceful: its tunnel closes) and look for the broker's address in the access log.
    agent.child.terminate();
    agent.child.wait_exit(Duration::from_secs(20))?;
    let needle = format!("CONNECT {}", broker.agent_addr);
    tether_test_support::wait_until(Duration::from_secs(10), "proxy access log entry", || {
        access_log(&proxy).contains(&needle).then_some(())
    })
    .map_err(|e| e.context(access_log(&proxy)))?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_tunnels_through_squid_http_proxy() -> anyhow::Result<()> {
    proxied_agent(ProxyKind::SquidHttp, "squid-http").await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_tunnels_through_squid_https_proxy_with_its_own_ca() -> anyhow::Result<()> {
    proxied_agent(ProxyKind::SquidHttps, "squid-https").await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_tunnels_through_proxy_with_basic_auth() -> anyhow::Result<()> {
    proxied_agent(
        ProxyKind::SquidAuth {
            user: "edge".into(),
            password: "s3cr3t".into(),
        },
        "squid-auth",
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_proxy_password_is_a_named_error_and_no_proxy_bypasses() -> anyhow::Result<()> {
    let hub = Hub::new()?;
    let echo = echo_server().await?;
    let broker = hub.start_broker("b1", "")?;
    let proxy = start_proxy(
        hub.path(),
        "squid-auth",
        ProxyKind::SquidAuth {
            user: "edge".into(),
            password: "right".into(),
        },
        "127.0.0.1",
        None,
        &[],
        None,
    )?;
    let wrong = format!("http://edge:wrong@127.0.0.1:{}", proxy.port);
    let agent = hub.start_agent(
        "c1",
        "c1",
        &[vec![broker.agent_addr]],
        echo,
        &format!("proxy:\n  https_proxy: '{wrong}'\n"),
    )?;
    let metrics = tether_test_support::wait_until_async(
        Duration::from_secs(20),
        "proxy_error metric",
        || async {
            let (_, m) = admin_get(agent.admin_addr, "/metrics").await.ok()?;
            m.contains("result=\"proxy_error\"").then_some(m)
        },
    )
    .await?;
    assert!(
        metrics.contains("tether_agent_tunnel_connects_total"),
        "{metrics}"
    );
    let (code, body) = admin_get(agent.admin_addr, "/readyz").await?;
    assert_eq!(code, 503, "{body}");
    let log = std::fs::read_to_string(hub.path().join(format!("{}.log", agent.child.name)))?;
    assert!(
        log.contains("407"),
        "agent log does not name the proxy's 407:\n{log}"
    );
    assert!(
        !log.contains("wrong@"),
        "the proxy password leaked into the log:\n{log}"
    );

    // Same proxy, but NO_PROXY exempts the broker: the agent connects directly.
    let direct = hub.start_agent(
        "c1",
        "c1",
        &[vec![broker.agent_addr]],
        echo,
        &format!("proxy:\n  https_proxy: '{wrong}'\n  no_proxy: 'example.com,127.0.0.0/8'\n"),
    )?;
    wait_agent_ready(&direct).await?;
    // The agent is ready once its tunnel is up; the broker routes to it a moment later.
    wait_tunnel(&broker, "c1").await?;
    round_trip(&broker).await?;
    Ok(())
}
