//! A client may reach any broker: a broker without a tunnel for the cluster relays the stream
//! to a peer broker that has one (real processes, mTLS between brokers).

use std::time::Duration;

use tether_e2e::{
    Hub, OPS_TOKEN, admin_get, connect, echo_server, peers_yaml, wait_agent_ready, wait_tunnel,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stream_is_relayed_to_the_broker_holding_the_tunnel() -> anyhow::Result<()> {
    let hub = Hub::new()?;
    let echo = echo_server().await?;
    let b1 = hub.start_broker("b1", "")?;
    let b2 = hub.start_broker("b2", &peers_yaml(&b1))?;
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
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let source = l.local_addr()?;
    tokio::spawn(async move {
        while let Ok((mut s, _)) = l.accept().await {
            tokio::spawn(async move {
                let chunk = vec![7u8; 64 * 1024];
                while s.write_all(&chunk).await.is_ok() {}
            });
        }
    });
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
