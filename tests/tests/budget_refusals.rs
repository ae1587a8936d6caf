//! A fairness-budget refusal is the documented answer on every front end (docs/architecture.md,
//! "Fairness between clusters and clients"), through a real broker and a real agent.
//!
//! One broker with `budgets.max_streams_per_cluster: 1` and the HTTP service proxy, one agent
//! (cluster `c1`, echo target). A CONNECT stream holds `c1`'s only stream; then a dial to `c1`
//! on each front end is refused, naming the budget and its limit:
//!
//! - CONNECT (plain and TLS): `503` with the message as body and `Retry-After: 1`;
//! - native Dial, unframed (`DialRaw`, through `tether-client`): HTTP `503` with
//!   `tether-error: overloaded`, seen by the client as `DialErrorCode::Overloaded`;
//! - native Dial, framed (gRPC `Dial`): the result frame with code `OVERLOADED`;
//! - konnectivity: `DIAL_RSP` with the message as its error;
//! - service proxy: `429` with a Kubernetes `Status` of reason `TooManyRequests` and
//!   `Retry-After: 1` (client-go waits and retries a 429 only when it is there);
//!
//! and each refusal counts once in `tether_broker_budget_rejections_total{budget=
//! "cluster_streams",owner="c1"}`. Once the held stream closes, the budget is given back.

mod grpc_support;

use std::time::Duration;

use futures::SinkExt as _;
use grpc_support::{channel, dial_req, next_packet, streaming_request};
use tether_e2e::{
    Hub, OPS_TOKEN, Setup, client_tls_config, connect, connect_ok, connect_tls, echo_server,
    metric, send_head, tls_connect, wait_agent_ready, wait_tunnel,
};
use tether_proto::konnectivity as k;
use tether_proto::tunnel::v1 as pb;

/// What every refusal names.
const BUDGET: &str = "budgets.max_streams_per_cluster = 1";

/// Whether a whole HTTP/1.1 answer (head and body) carries `Retry-After: 1` in its head.
fn retries_after_a_second(answer: &str) -> bool {
    let head = answer.split("\r\n\r\n").next().unwrap_or_default();
    head.split("\r\n")
        .skip(1)
        .filter_map(|l| l.split_once(':'))
        .any(|(k, v)| k.eq_ignore_ascii_case("retry-after") && v.trim() == "1")
}

async fn rejections(setup: &Setup) -> anyhow::Result<f64> {
    metric(
        setup.broker.admin_addr,
        "tether_broker_budget_rejections_total",
        &[("budget", "cluster_streams"), ("owner", "c1")],
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_front_end_answers_a_budget_refusal_as_documented() -> anyhow::Result<()> {
    let hub = Hub::new()?;
    let echo = echo_server().await?;
    let broker = hub.start_broker(
        "b1",
        "budgets:\n  max_streams_per_cluster: 1\nservice_proxy:\n  listen: 127.0.0.1:0\n",
    )?;
    let sp_addr = hub.service_proxy_addr("b1")?;
    let agent = hub.start_agent("c1", "c1", &[vec![broker.agent_addr]], echo, "")?;
    wait_agent_ready(&agent).await?;
    wait_tunnel(&broker, "c1").await?;
    let setup = Setup {
        agent,
        broker,
        echo,
        hub,
    };
    let authority = setup.echo_authority();
    let held = connect_ok(setup.broker.client_addr, &authority).await?;
    let mut counted = 0.0;

    // CONNECT, plain and over TLS: 503 naming the budget.
    let Err((code, body)) = connect(setup.broker.client_addr, &authority, Some(OPS_TOKEN)).await?
    else {
        anyhow::bail!("CONNECT admitted beyond the budget");
    };
    assert_eq!(code, 503, "{body}");
    assert!(
        body.contains(BUDGET) && body.contains("cluster \"c1\""),
        "{body}"
    );
    assert!(retries_after_a_second(&body), "{body}");
    let tls = client_tls_config(&setup.hub.pki.ca_path(), &[b"http/1.1"], None)?;
    let Err((code, body)) = connect_tls(
        setup.broker.client_tls_addr,
        tls,
        &authority,
        Some(OPS_TOKEN),
    )
    .await?
    else {
        anyhow::bail!("TLS CONNECT admitted beyond the budget");
    };
    assert_eq!(code, 503, "{body}");
    assert!(body.contains(BUDGET), "{body}");
    assert!(retries_after_a_second(&body), "{body}");
    counted += 2.0;
    assert_eq!(rejections(&setup).await?, counted);

    // Native Dial, unframed (the SDK's default): 503 + tether-error: overloaded.
    let dialer = setup.ops_dialer().await?;
    let host = setup.echo.ip().to_string();
    let Err(e) = dialer.dial("c1", &host, setup.echo.port()).await else {
        anyhow::bail!("DialRaw admitted beyond the budget");
    };
    overloaded_with_retry_after(&e)?;
    // Framed gRPC Dial: the result frame with OVERLOADED.
    let Err(e) = dialer.dial_framed("c1", &host, setup.echo.port()).await else {
        anyhow::bail!("Dial admitted beyond the budget");
    };
    overloaded_with_retry_after(&e)?;
    counted += 2.0;
    assert_eq!(rejections(&setup).await?, counted);

    // konnectivity: DIAL_RSP carrying the refusal.
    let mut kc = k::proxy_service_client::ProxyServiceClient::new(channel(&setup).await?);
    let (mut tx, req) = streaming_request::<k::Packet>(Some(OPS_TOKEN));
    tx.send(dial_req(authority.clone(), 77)).await?;
    let mut inbound = kc.proxy(req).await?.into_inner();
    let rsp = next_packet(&mut inbound).await?;
    let Some(k::packet::Payload::DialResponse(d)) = rsp.payload else {
        anyhow::bail!("expected DIAL_RSP, got {rsp:?}");
    };
    assert_eq!(d.random, 77);
    assert_eq!(d.connect_id, 0, "{d:?}");
    assert!(d.error.contains(BUDGET), "{d:?}");
    counted += 1.0;
    assert_eq!(rejections(&setup).await?, counted);

    // Service proxy: 429 TooManyRequests.
    let tls = client_tls_config(&setup.hub.pki.ca_path(), &[b"http/1.1"], None)?;
    let s = tls_connect(sp_addr, tls).await?;
    let head = format!(
        "GET /c1/version HTTP/1.1\r\nhost: localhost\r\nauthorization: Bearer {OPS_TOKEN}\r\nconnection: close\r\n\r\n"
    );
    let Err((code, body)) = send_head(s, head.as_bytes()).await? else {
        anyhow::bail!("the service proxy admitted a request beyond the budget");
    };
    assert_eq!(code, 429, "{body}");
    assert!(
        body.contains("TooManyRequests") && body.contains(BUDGET),
        "{body}"
    );
    assert!(retries_after_a_second(&body), "{body}");
    counted += 1.0;
    assert_eq!(rejections(&setup).await?, counted);

    // The budget is given back once the held stream ends (its close reaches the broker
    // asynchronously), and no other owner was counted.
    drop(held);
    let s = tether_test_support::wait_until_async(
        Duration::from_secs(20),
        "c1's stream budget to be free again",
        || async {
            connect(setup.broker.client_addr, &authority, Some(OPS_TOKEN))
                .await
                .ok()?
                .ok()
        },
    )
    .await?;
    drop(s);
    assert_eq!(
        metric(
            setup.broker.admin_addr,
            "tether_broker_budget_rejections_total",
            &[],
        )
        .await?,
        rejections(&setup).await?,
        "only c1's cluster budget refused"
    );
    Ok(())
}

/// An SDK dial refused by the budget: `Overloaded`, the budget named, and the broker's
/// `Retry-After` (one second) offered to the caller.
fn overloaded_with_retry_after(e: &tether_client::ClientError) -> anyhow::Result<()> {
    let tether_client::ClientError::Dial { code, message } = e else {
        anyhow::bail!("refused with an unexpected error: {e}");
    };
    assert_eq!(*code, pb::DialErrorCode::Overloaded, "{message}");
    assert!(message.contains(BUDGET), "{message}");
    assert_eq!(e.retry_after(), Some(Duration::from_secs(1)), "{e}");
    Ok(())
}
