//! A client may reach any broker: a broker without a tunnel for the cluster relays the stream
//! to a peer broker that has one (real processes, mTLS between brokers). A broker drained with
//! relayed streams open (either end of the relay) keeps its deadline and truncates nothing
//! silently.

use std::time::{Duration, Instant};

use tether_e2e::live::ContinuousEcho;
use tether_e2e::{
    Hub, OPS_TOKEN, admin_get, connect, connect_ok, echo_server, peers_yaml, qualified,
    sum_samples, wait_agent_ready, wait_tunnel,
};
use tether_test_support::wait_until_async;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const H2: &str = "tunnel:\n  protocol: h2\n";

/// A stream to b2, which has no tunnel for the cluster, goes b2 → b1 → agent with every byte
/// and the half-close intact, on the relay protocol the two brokers agree on: `tether-relay/2`
/// when both speak it, `tether-relay/1` (HTTP/2) when either is configured with
/// `tunnel.protocol: h2` (b1 then does not offer `/2`, or b2 does not ask for it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stream_is_relayed_to_the_broker_holding_the_tunnel() -> anyhow::Result<()> {
    for (b1_config, b2_config, protocol) in [("", "", "mux"), (H2, "", "h2"), ("", H2, "h2")] {
        relayed_round_trip(b1_config, b2_config, protocol)
            .await
            .map_err(|e| e.context(format!("relay expected on {protocol}")))?;
    }
    Ok(())
}

async fn relayed_round_trip(
    b1_config: &str,
    b2_config: &str,
    protocol: &str,
) -> anyhow::Result<()> {
    let hub = Hub::new()?;
    let echo = echo_server().await?;
    let b1 = hub.start_broker("b1", b1_config)?;
    let b2 = hub.start_broker("b2", &format!("{b2_config}{}", peers_yaml(&b1)))?;
    let agent = hub.start_agent("c1", "c1", &[vec![b1.agent_addr]], echo, "")?;
    wait_agent_ready(&agent).await?;
    wait_tunnel(&b1, "c1").await?;

    // b2 has no tunnel for c1: the stream goes b2 → b1 → agent. Wait for the relay link.
    let target = format!("127.0.0.1.c1.tether:{}", echo.port());
    let mut s =
        tether_test_support::wait_until_async(Duration::from_secs(20), "relay via b2", || async {
            connect(b2.client_addr, &target, Some(OPS_TOKEN))
                .await
                .ok()?
                .ok()
        })
        .await
        .inspect_err(|_| {
            for f in ["broker-b1.log", "broker-b2.log"] {
                eprintln!(
                    "== {f}\n{}",
                    std::fs::read_to_string(hub.path().join(f)).unwrap_or_default()
                );
            }
        })?;
    let payload: Vec<u8> = (0..2_000_000u32)
        .map(|i| (i.wrapping_mul(2654435761) >> 24) as u8)
        .collect();
    let (mut r, mut w) = s.split();
    let send = async {
        w.write_all(&payload).await?;
        w.shutdown().await?; // half-close travels b2 → b1 → agent → target
        anyhow::Ok(())
    };
    let mut back = Vec::new();
    let recv = async {
        tokio::time::timeout(Duration::from_secs(30), r.read_to_end(&mut back)).await??;
        anyhow::Ok(())
    };
    tokio::try_join!(send, recv)?;
    assert_eq!(back.len(), payload.len());
    assert!(back == payload, "relayed bytes differ");

    let (_, metrics) = admin_get(b1.admin_addr, "/metrics").await?;
    assert!(
        metrics.lines().any(|l| l.starts_with(
            "tether_broker_stream_duration_seconds_count{frontend=\"relay\",result=\"ok\"}"
        )),
        "b1 did not account a relayed stream:\n{metrics}"
    );
    let (_, metrics) = admin_get(b2.admin_addr, "/metrics").await?;
    let links = |p: &str| {
        sum_samples(
            &metrics,
            "tether_broker_relay_connections_total",
            &[("protocol", p)],
        )
    };
    let other = if protocol == "mux" { "h2" } else { "mux" };
    assert!(
        links(protocol) >= 1.0 && links(other) == 0.0,
        "b2's relay links by protocol, {protocol} expected:\n{metrics}"
    );

    // An unknown cluster is still a clear 502 after asking the peer.
    match connect(b2.client_addr, "nowhere:443", Some(OPS_TOKEN)).await? {
        Err((502, body)) => assert!(
            body.contains("no tunnel") && body.contains("peer"),
            "{body}"
        ),
        other => panic!("expected 502, got {:?}", other.map(|_| ())),
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relayed_stream_aborts_as_error_when_agent_dies() -> anyhow::Result<()> {
    let hub = Hub::new()?;
    // A target that sends forever, so the client is mid-read when the agent dies.
    let source = endless_source().await?;
    let b1 = hub.start_broker("b1", "")?;
    let b2 = hub.start_broker("b2", &peers_yaml(&b1))?;
    let mut agent = hub.start_agent("c1", "c1", &[vec![b1.agent_addr]], source, "")?;
    wait_agent_ready(&agent).await?;
    wait_tunnel(&b1, "c1").await?;
    let mut s =
        tether_test_support::wait_until_async(Duration::from_secs(20), "relay via b2", || async {
            connect(b2.client_addr, "c1:443", Some(OPS_TOKEN))
                .await
                .ok()?
                .ok()
        })
        .await?;
    let mut buf = vec![0u8; 64 * 1024];
    let mut got = 0usize;
    while got < 1_000_000 {
        got += s.read(&mut buf).await?;
    }
    agent.child.kill();
    let outcome = tokio::time::timeout(Duration::from_secs(20), async {
        loop {
            match s.read(&mut buf).await {
                Ok(0) => return Ok(()),
                Ok(_) => continue,
                Err(e) => return Err(e),
            }
        }
    })
    .await?;
    let err = outcome.expect_err("a broken relayed stream must end with an error, not EOF");
    assert_eq!(err.kind(), std::io::ErrorKind::ConnectionReset, "{err}");
    Ok(())
}

/// Which broker a drain test stops.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Drained {
    /// b2, which has no tunnel and relays its clients' streams to b1.
    Relaying,
    /// b1, which holds the agent's tunnel and accepts b2's relays.
    TunnelHolder,
}

/// Broker drain with live peer relays (SIGTERM on one of two brokers while streams go
/// client → b2 → relay → b1 → agent): a relayed stream that finishes during the drain arrives
/// intact; a relayed stream that never finishes is cut at the drain deadline with a reset, not a
/// clean EOF (no silent truncation); the broker exits within `drain_grace` plus its task
/// deadline, and its drain reports every tracked task ended.
async fn drain_with_live_relays(drained: Drained, b2_config: &str) -> anyhow::Result<()> {
    // The hub's brokers drain for 10 s (`drain_grace`); then their tracked tasks get
    // `DEFAULT_TASK_DRAIN_DEADLINE` (5 s). Beyond that the process has not kept its deadline.
    const DRAIN_DEADLINE: Duration = Duration::from_secs(10 + 5);
    let hub = Hub::new()?;
    let echo = echo_server().await?;
    let source = endless_source().await?;
    let mut b1 = hub.start_broker("b1", "")?;
    let mut b2 = hub.start_broker("b2", &format!("{b2_config}{}", peers_yaml(&b1)))?;
    let agent = hub.start_agent("c1", "c1", &[vec![b1.agent_addr]], echo, "")?;
    wait_agent_ready(&agent).await?;
    wait_tunnel(&b1, "c1").await?;

    // Both streams enter at b2 and are relayed to b1 (b2 has no tunnel for c1).
    let mut endless =
        tether_test_support::wait_until_async(Duration::from_secs(20), "relay via b2", || async {
            connect(b2.client_addr, &qualified("c1", source), Some(OPS_TOKEN))
                .await
                .ok()?
                .ok()
        })
        .await?;
    let mut buf = vec![0u8; 64 << 10];
    let mut got = 0usize;
    while got < 1 << 20 {
        got += endless.read(&mut buf).await?;
    }
    let finite = ContinuousEcho::start(
        connect_ok(b2.client_addr, &qualified("c1", echo)).await?,
        64 << 10,
        true,
    );
    finite
        .wait_progress(2 << 20, "relayed echo moving before the drain")
        .await?;
    let (_, relays) = admin_get(b1.admin_addr, "/metrics").await?;
    assert!(
        sum_samples(
            &relays,
            "tether_broker_open_streams",
            &[("frontend", "relay")]
        ) >= 2.0,
        "b1 carries both streams as relays:\n{relays}"
    );

    let (b1_admin, b2_client) = (b1.admin_addr, b2.client_addr);
    let (stopped, log) = match drained {
        Drained::Relaying => (&mut b2, "broker-b2.log"),
        Drained::TunnelHolder => (&mut b1, "broker-b1.log"),
    };
    let started = Instant::now();
    stopped.child.terminate();
    // The open relayed echo keeps going through the drain, then finishes intact.
    finite
        .wait_progress(2 << 20, "relayed echo moving during the drain")
        .await?;
    if drained == Drained::TunnelHolder {
        relay_skips_the_draining_holder(b1_admin, b2_client).await?;
    }
    finite.finish().await?;

    // The endless stream is cut at the drain deadline: with a reset, never a clean EOF.
    let end = tokio::time::timeout(DRAIN_DEADLINE, async {
        loop {
            match endless.read(&mut buf).await {
                Ok(0) => return Ok(()),
                Ok(_) => continue,
                Err(e) => return Err(e),
            }
        }
    })
    .await
    .map_err(|_| anyhow::anyhow!("{drained:?}: the endless stream outlived the drain"))?;
    let Err(err) = end else {
        eprintln!(
            "== {log}\n{}",
            std::fs::read_to_string(hub.path().join(log)).unwrap_or_default()
        );
        anyhow::bail!(
            "{drained:?}: the endless stream ended with a clean EOF {:?} after SIGTERM (silent truncation)",
            started.elapsed()
        );
    };
    assert_eq!(
        err.kind(),
        std::io::ErrorKind::ConnectionReset,
        "{drained:?}: {err}"
    );

    let left = DRAIN_DEADLINE.saturating_sub(started.elapsed());
    let status = wait_until_async(left, &format!("{drained:?} broker to exit"), || {
        let s = stopped.child.try_wait();
        async move { s }
    })
    .await?;
    assert!(status.success(), "{drained:?}: exited with {status}");
    let text = std::fs::read_to_string(hub.path().join(log))?;
    // A log file gets plain text: colours only on a terminal (tether_telemetry::use_colour).
    assert!(
        !text.contains('\x1b'),
        "{drained:?}: the broker's log file holds ANSI escape codes:\n{text}"
    );
    // The streams' drain hit its deadline (the endless stream); every tracked task of the
    // broker still ended within its own.
    assert!(
        text.lines()
            .any(|l| l.contains("drain complete") && l.contains("service=\"tunnel-broker\"")),
        "{drained:?}: the broker's task drain did not complete:\n{text}"
    );
    assert!(
        !text.lines().any(|l| l.contains("drain deadline passed")
            && l.contains("service=\"tunnel-broker\"")),
        "{drained:?}: tasks outlived the drain:\n{text}"
    );
    Ok(())
}

/// Once b1 drains, a new dial for c1 at b2 is not processed by b1: b1 sent its relay links a
/// GOAWAY (and refuses an `OPEN` that crossed it), so b2 answers at once that no tunnel is
/// left, and b1 counts no relayed dial beyond the two it carries.
async fn relay_skips_the_draining_holder(
    b1_admin: std::net::SocketAddr,
    b2_client: std::net::SocketAddr,
) -> anyhow::Result<()> {
    wait_until_async(
        Duration::from_secs(10),
        "b1 not ready (draining)",
        || async {
            let (status, _) = admin_get(b1_admin, "/readyz").await.ok()?;
            (status != 200).then_some(())
        },
    )
    .await?;
    let relayed_dials = || async {
        let (_, m) = admin_get(b1_admin, "/metrics").await?;
        anyhow::Ok(sum_samples(
            &m,
            "tether_broker_dial_duration_seconds_count",
            &[("frontend", "relay")],
        ))
    };
    let before = relayed_dials().await?;
    match connect(b2_client, "c1:443", Some(OPS_TOKEN)).await? {
        Err((502, body)) => assert!(body.contains("no tunnel"), "{body}"),
        other => panic!(
            "a dial for c1 at b2 while b1 drains: expected 502, got {:?}",
            other.map(|_| ())
        ),
    }
    let after = relayed_dials().await?;
    assert_eq!(
        (before, after),
        (2.0, 2.0),
        "b1 processed a relayed dial after its drain began"
    );
    Ok(())
}

/// A target that sends forever, so a client is mid-read whenever its stream is cut.
async fn endless_source() -> anyhow::Result<std::net::SocketAddr> {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = l.local_addr()?;
    tokio::spawn(async move {
        while let Ok((mut s, _)) = l.accept().await {
            tokio::spawn(async move {
                let chunk = vec![7u8; 64 * 1024];
                while s.write_all(&chunk).await.is_ok() {}
            });
        }
    });
    Ok(addr)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn draining_the_relaying_broker_ends_its_relayed_streams_within_the_deadline()
-> anyhow::Result<()> {
    drain_with_live_relays(Drained::Relaying, "").await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn draining_the_tunnel_holder_ends_relayed_streams_within_the_deadline() -> anyhow::Result<()>
{
    drain_with_live_relays(Drained::TunnelHolder, "").await
}

/// As above with the relay link on HTTP/2 (`tether-relay/1`): the drain's GOAWAY is hyper's
/// graceful shutdown, a dial that crosses it is refused with `REFUSED_STREAM`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn draining_the_tunnel_holder_over_http2_relays_ends_them_within_the_deadline()
-> anyhow::Result<()> {
    drain_with_live_relays(Drained::TunnelHolder, H2).await
}
