//! Supervision restarts something real: one real broker, two real agents. Agent `sa` reaches the
//! broker through a relay this test controls; the relay cuts the tunnel's TCP connection (the
//! connection dies under a live tunnel). Then:
//! - the broker's `TunnelActor` for `sa` deregisters its tunnel, and a new tunnel (a new id) is
//!   registered when the agent's supervised `Connector` redials (its connect counter rises);
//! - a stream through `sb`'s tunnel, open and moving data the whole time, keeps flowing, and its
//!   tunnel is the same one afterwards (no other tunnel affected);
//! - a new stream through `sa` works again.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tether_e2e::{
    Hub, Payload, Sha256, admin_get, connect_ok, echo_server, metric, qualified, wait_agent_ready,
    wait_tunnel,
};
use tether_test_support::wait_until_async;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;

/// Deadline for each step of the test.
const STEP: Duration = Duration::from_secs(30);

/// A TCP relay to `upstream` whose current connections can be cut (both sockets dropped); new
/// connections are relayed again afterwards.
struct CutRelay {
    addr: SocketAddr,
    cut: Arc<std::sync::Mutex<CancellationToken>>,
    accepted: Arc<AtomicU64>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for CutRelay {
    fn drop(&mut self) {
        self.task.abort();
        self.cut.lock().unwrap().cancel();
    }
}

impl CutRelay {
    async fn start(upstream: SocketAddr) -> anyhow::Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let cut = Arc::new(std::sync::Mutex::new(CancellationToken::new()));
        let accepted = Arc::new(AtomicU64::new(0));
        let task = {
            let (cut, accepted) = (Arc::clone(&cut), Arc::clone(&accepted));
            tokio::spawn(async move {
                while let Ok((mut down, _)) = listener.accept().await {
                    accepted.fetch_add(1, Ordering::Relaxed);
                    let stop = cut.lock().unwrap().clone();
                    tokio::spawn(async move {
                        let Ok(Ok(mut up)) =
                            tokio::time::timeout(STEP, TcpStream::connect(upstream)).await
                        else {
                            return;
                        };
                        tokio::select! {
                            _ = tokio::io::copy_bidirectional(&mut down, &mut up) => {}
                            _ = stop.cancelled() => {}
                        }
                    });
                }
            })
        };
        Ok(Self {
            addr,
            cut,
            accepted,
            task,
        })
    }

    /// Drops every connection relayed so far.
    fn cut(&self) {
        let mut c = self.cut.lock().unwrap();
        c.cancel();
        *c = CancellationToken::new();
    }
}

/// Tunnel ids the broker's `/debug/tunnels` lists for `cluster`.
async fn tunnel_ids(admin: SocketAddr, cluster: &str) -> anyhow::Result<Vec<u64>> {
    let (_, body) = admin_get(admin, "/debug/tunnels").await?;
    let list: Vec<serde_json::Value> = serde_json::from_str(&body)?;
    Ok(list
        .iter()
        .filter(|t| t["cluster"] == cluster)
        .filter_map(|t| t["id"].as_u64())
        .collect())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cut_tunnel_is_redialled_and_reregistered_while_another_tunnel_keeps_flowing()
-> anyhow::Result<()> {
    let hub = Hub::new()?;
    let echo = echo_server().await?;
    let broker = hub.start_broker("b1", "")?;
    let relay = CutRelay::start(broker.agent_addr).await?;
    let sa = hub.start_agent("sa", "sa", &[vec![relay.addr]], echo, "")?;
    let sb = hub.start_agent("sb", "sb", &[vec![broker.agent_addr]], echo, "")?;
    for (agent, cluster) in [(&sa, "sa"), (&sb, "sb")] {
        wait_agent_ready(agent).await?;
        wait_tunnel(&broker, cluster).await?;
    }
    let sa_before = tunnel_ids(broker.admin_addr, "sa").await?;
    let sb_before = tunnel_ids(broker.admin_addr, "sb").await?;
    assert_eq!(sa_before.len(), 1, "one tunnel for sa: {sa_before:?}");
    assert_eq!(sb_before.len(), 1, "one tunnel for sb: {sb_before:?}");
    let endpoint = relay.addr.to_string();
    let connects = |a: SocketAddr, e: String| async move {
        metric(
            a,
            "tether_agent_tunnel_connects_total",
            &[("endpoint", e.as_str()), ("result", "ok")],
        )
        .await
        .unwrap_or(0.0)
    };
    assert_eq!(connects(sa.admin_addr, endpoint.clone()).await, 1.0);

    // A stream through sb's tunnel that keeps moving data until told to stop.
    let stream = connect_ok(broker.client_addr, &qualified("sb", echo)).await?;
    let (mut rd, mut wr) = stream.into_split();
    let received = Arc::new(AtomicU64::new(0));
    let stop = CancellationToken::new();
    let writer = {
        let stop = stop.clone();
        tokio::spawn(async move {
            let payload = Payload::new();
            let (mut h, mut sent, mut i) = (Sha256::new(), 0u64, 0u64);
            while !stop.is_cancelled() {
                let c = payload.chunk(i, 16 << 10);
                h.update(c);
                wr.write_all(c).await?;
                sent += c.len() as u64;
                i += 1;
                // Keep the stream moving without saturating two shared cores.
                tokio::task::yield_now().await;
            }
            wr.shutdown().await?;
            anyhow::Ok((sent, h.hex()))
        })
    };
    let reader = {
        let received = Arc::clone(&received);
        tokio::spawn(async move {
            let (mut h, mut buf) = (Sha256::new(), vec![0u8; 64 << 10]);
            loop {
                let n = rd.read(&mut buf).await?;
                if n == 0 {
                    break;
                }
                h.update(&buf[..n]);
                received.fetch_add(n as u64, Ordering::Relaxed);
            }
            anyhow::Ok((received.load(Ordering::Relaxed), h.hex()))
        })
    };
    let progress = |more: u64, what: &'static str| {
        let received = Arc::clone(&received);
        async move {
            let target = received.load(Ordering::Relaxed) + more;
            wait_until_async(STEP, what, || async {
                (received.load(Ordering::Relaxed) >= target).then_some(())
            })
            .await
        }
    };
    progress(1 << 20, "sb stream moving before the cut").await?;

    // Kill sa's tunnel connection.
    let accepted_before = relay.accepted.load(Ordering::Relaxed);
    relay.cut();

    // The broker deregisters the dead tunnel and registers the redialled one (a new id).
    let sa_after = wait_until_async(STEP, "sa tunnel re-registered with a new id", || async {
        let ids = tunnel_ids(broker.admin_addr, "sa").await.ok()?;
        (ids.len() == 1 && ids[0] != sa_before[0]).then_some(ids)
    })
    .await?;
    assert!(
        relay.accepted.load(Ordering::Relaxed) > accepted_before,
        "the agent redialled through the relay"
    );
    // The supervised connector dialled again and established a second tunnel.
    wait_until_async(STEP, "sa connector counted a second connect", || async {
        (connects(sa.admin_addr, endpoint.clone()).await >= 2.0).then_some(())
    })
    .await?;

    // sb's stream kept flowing through the whole episode, on the same tunnel.
    progress(1 << 20, "sb stream moving after sa's restart").await?;
    assert_eq!(tunnel_ids(broker.admin_addr, "sb").await?, sb_before);
    stop.cancel();
    let (sent, sent_hash) = writer.await??;
    let (got, got_hash) = tokio::time::timeout(STEP, reader).await???;
    assert_eq!(got, sent, "every byte of sb's stream came back");
    assert_eq!(got_hash, sent_hash, "sb's stream is intact");

    // sa's new tunnel carries streams.
    let mut s = connect_ok(broker.client_addr, &qualified("sa", echo)).await?;
    s.write_all(b"ping").await?;
    let mut buf = [0u8; 4];
    tokio::time::timeout(STEP, s.read_exact(&mut buf)).await??;
    assert_eq!(&buf, b"ping");
    assert_eq!(tunnel_ids(broker.admin_addr, "sa").await?, sa_after);
    Ok(())
}
