//! Wedged tunnels (tether_tunnel::watchdog) through real broker and agent processes: the agent
//! reaches the broker through a userspace TCP relay ([`DelayLink`], no added delay) that is
//! switched to *blackhole* — it keeps both sockets open but drops every byte and never sends a
//! FIN — the stall of a link that loses packets below TLS. The test asserts:
//!
//! - the broker's watchdog tears the tunnel down within `stall_timeout + tick` of a client's
//!   unanswered bytes, long before the keepalive (whose timeout is set far above) would;
//! - the stream on it ends with an error (not a clean EOF);
//! - new streams never wait on the wedged tunnel: each CONNECT meanwhile is answered at once
//!   (a clear error naming the wedge, or no tunnel) until one succeeds;
//! - the agent's watchdog detects the stall too (its next PING goes unanswered), redials
//!   through the relay, and the new tunnel carries traffic within the documented time;
//! - both ends count it in `tether_{broker,agent}_tunnel_wedged_total{detector="watchdog"}`,
//!   and the broker counts the tunnel turning suspect on the way, once
//!   (`tether_broker_tunnel_suspect_total`); a trickle that the agent answers is neither.

use std::time::{Duration, Instant};

use tether_e2e::delay::DelayLink;
use tether_e2e::{
    Hub, OPS_TOKEN, connect, connect_ok, echo_server, metric, qualified, wait_agent_ready,
    wait_tunnel,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const STALL: Duration = Duration::from_millis(1000);
/// The watchdog's tick: a quarter of the stall timeout.
const TICK: Duration = Duration::from_millis(250);
const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(2);
/// Far above the watchdog's bound: the keepalive timeout must not be what detects the wedge.
const KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(30);
/// Slack for process scheduling on a loaded CI machine.
const SLACK: Duration = Duration::from_millis(1500);
/// How long the broker's wedge counter may trail the stream's reset.
const METRIC_SETTLE: Duration = Duration::from_secs(1);

fn tunnel_yaml() -> String {
    format!(
        "tunnel:\n  keepalive_interval: {}ms\n  keepalive_timeout: {}ms\n  stall_timeout: {}ms\n",
        KEEPALIVE_INTERVAL.as_millis(),
        KEEPALIVE_TIMEOUT.as_millis(),
        STALL.as_millis()
    )
}

/// One echo round trip of `n` bytes on a fresh CONNECT stream.
async fn echo_once(broker: std::net::SocketAddr, authority: &str) -> anyhow::Result<()> {
    let mut s = connect_ok(broker, authority).await?;
    let msg = b"through the new tunnel";
    s.write_all(msg).await?;
    let mut back = vec![0u8; msg.len()];
    tokio::time::timeout(Duration::from_secs(5), s.read_exact(&mut back)).await??;
    anyhow::ensure!(&back[..] == msg, "echo mismatch");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_blackholed_tunnel_is_torn_down_and_replaced() -> anyhow::Result<()> {
    let hub = Hub::new()?;
    let echo = echo_server().await?;
    let broker = hub.start_broker("b1", &tunnel_yaml())?;
    let link = DelayLink::start(broker.agent_addr, Duration::ZERO).await?;
    let agent = hub.start_agent("wedge", "wedge", &[vec![link.addr]], echo, &tunnel_yaml())?;
    wait_agent_ready(&agent).await?;
    wait_tunnel(&broker, "wedge").await?;
    let authority = qualified("wedge", echo);

    // A stream that works before the wedge.
    let mut stream = connect_ok(broker.client_addr, &authority).await?;
    stream.write_all(b"before").await?;
    let mut buf = [0u8; 6];
    stream.read_exact(&mut buf).await?;
    assert_eq!(&buf, b"before");
    let accepted_before = link.accepted();

    // Wedge the link, then send bytes that can never be answered.
    assert_eq!(link.blackhole_existing(), accepted_before);
    let wedged_at = Instant::now();
    stream.write_all(b"into the void").await?;

    // The stream ends with an error once the broker's watchdog fires.
    let mut sink = Vec::new();
    let end = tokio::time::timeout(
        STALL + TICK + SLACK + Duration::from_secs(2),
        stream.read_to_end(&mut sink),
    )
    .await
    .map_err(|_| anyhow::anyhow!("the stream on the wedged tunnel never ended"))?;
    let stream_ended = wedged_at.elapsed();
    assert!(
        end.is_err() || sink.is_empty(),
        "the stream on the wedged tunnel must not deliver the lost bytes: {end:?} {sink:?}"
    );
    assert!(
        end.is_err(),
        "the stream on the wedged tunnel must end with an error (reset), not a clean EOF: {end:?}"
    );
    assert!(
        stream_ended <= STALL + TICK + SLACK,
        "stream ended {stream_ended:?} after the wedge; bound {:?} + slack",
        STALL + TICK
    );
    // The watchdog tears the socket down first and counts the wedge right after, so the client
    // can see its reset a moment before the counter moves: wait for it (bounded).
    let counted_by = Instant::now() + METRIC_SETTLE;
    let broker_wedged = loop {
        let n = metric(
            broker.admin_addr,
            "tether_broker_tunnel_wedged_total",
            &[("detector", "watchdog")],
        )
        .await?;
        if n >= 1.0 || Instant::now() >= counted_by {
            break n;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!(broker_wedged, 1.0, "broker wedged count");
    // On its way to the wedge the tunnel turned suspect once (counted once, not per tick).
    assert_eq!(
        metric(broker.admin_addr, "tether_broker_tunnel_suspect_total", &[]).await?,
        1.0,
        "broker suspect count"
    );

    // New streams meanwhile are answered at once, never parked on the wedged tunnel; one
    // succeeds once the agent redialled.
    let replace_bound = KEEPALIVE_INTERVAL + STALL + TICK;
    let mut refusals = Vec::new();
    let replaced = loop {
        let asked = Instant::now();
        let answer = tokio::time::timeout(
            Duration::from_secs(3),
            connect(broker.client_addr, &authority, Some(OPS_TOKEN)),
        )
        .await
        .map_err(|_| anyhow::anyhow!("a CONNECT during the wedge was not answered within 3 s"))??;
        let took = asked.elapsed();
        match answer {
            Ok(mut s) => {
                s.write_all(b"ping").await?;
                let mut b = [0u8; 4];
                tokio::time::timeout(Duration::from_secs(5), s.read_exact(&mut b)).await??;
                assert_eq!(&b, b"ping");
                break wedged_at.elapsed();
            }
            Err((code, body)) => {
                assert!(
                    took < Duration::from_secs(1),
                    "a refusal took {took:?}: {code} {body}"
                );
                assert!(
                    code == 502 && (body.contains("wedged") || body.contains("no tunnel")),
                    "unexpected answer during the wedge: {code} {body}"
                );
                refusals.push(body);
            }
        }
        anyhow::ensure!(
            wedged_at.elapsed() < replace_bound + SLACK + Duration::from_secs(3),
            "no working tunnel {:?} after the wedge (bound {replace_bound:?}); refusals: {:?}",
            wedged_at.elapsed(),
            refusals.last()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(
        link.accepted() > accepted_before,
        "the agent redialled through the relay"
    );
    let agent_wedged = metric(
        agent.admin_addr,
        "tether_agent_tunnel_wedged_total",
        &[("detector", "watchdog")],
    )
    .await?;
    assert_eq!(agent_wedged, 1.0, "agent wedged count");
    assert_eq!(
        metric(
            agent.admin_addr,
            "tether_agent_tunnel_wedged_total",
            &[("detector", "keepalive")],
        )
        .await?,
        0.0,
        "the keepalive timeout must not be what caught it"
    );
    assert!(
        replaced <= replace_bound + SLACK,
        "replaced after {replaced:?}; documented bound {replace_bound:?} + reconnect"
    );
    echo_once(broker.client_addr, &authority).await?;
    eprintln!(
        "wedge: stream ended after {stream_ended:?} (bound {:?}), new tunnel carried traffic after {replaced:?} (bound {replace_bound:?} + reconnect), {} fast refusals meanwhile",
        STALL + TICK,
        refusals.len()
    );
    drop(link);
    Ok(())
}

/// A healthy tunnel with streams that only trickle one way (the peer has nothing to answer)
/// is never declared wedged: the watchdog's probe PING is answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_way_trickles_are_not_wedges() -> anyhow::Result<()> {
    let hub = Hub::new()?;
    // A target that reads and never answers.
    let sink = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let sink_addr = sink.local_addr()?;
    tokio::spawn(async move {
        while let Ok((mut s, _)) = sink.accept().await {
            tokio::spawn(async move {
                let mut b = vec![0u8; 4096];
                while matches!(s.read(&mut b).await, Ok(n) if n > 0) {}
            });
        }
    });
    let broker = hub.start_broker("b1", &tunnel_yaml())?;
    let agent = hub.start_agent(
        "trickle",
        "trickle",
        &[vec![broker.agent_addr]],
        sink_addr,
        &tunnel_yaml(),
    )?;
    wait_agent_ready(&agent).await?;
    wait_tunnel(&broker, "trickle").await?;
    let mut s = connect_ok(broker.client_addr, &qualified("trickle", sink_addr)).await?;
    // 4 stall timeouts of bytes every 150 ms that nobody answers at the application level.
    let until = Instant::now() + 4 * STALL;
    while Instant::now() < until {
        s.write_all(b"tick").await?;
        tokio::time::sleep(Duration::from_millis(150)).await;
    }
    for (admin, name) in [
        (broker.admin_addr, "tether_broker_tunnel_wedged_total"),
        (agent.admin_addr, "tether_agent_tunnel_wedged_total"),
        (broker.admin_addr, "tether_broker_tunnel_suspect_total"),
    ] {
        assert_eq!(metric(admin, name, &[]).await?, 0.0, "{name}");
    }
    // The stream still works end to end (the sink still reads).
    s.write_all(b"still here").await?;
    Ok(())
}
