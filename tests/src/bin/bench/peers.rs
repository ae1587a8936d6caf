//! The `peers` section: a stream that reaches a broker without the cluster's tunnel is relayed
//! to the peer broker that holds it (docs/architecture.md, HA). Behind a load balancer in front
//! of N brokers, (N − 1)/N of the dials take this path, so its cost is the client path's cost.
//!
//! Three paths to the same agent and target, rotated every round: **tunnel** (CONNECT to b1,
//! which holds the tunnel: no relay), **relay/2** (CONNECT to b2, relayed to b1 over
//! `tether-relay/2`, the mux) and **relay/1** (CONNECT to b3, configured with `tunnel.protocol:
//! h2`, relayed over `tether-relay/1`, HTTP/2). Bulk upload with 1 stream (throughput, CPU-s/GB
//! of every process on the path: client and target, the brokers on it and the agent), 64 B
//! request/response on an open stream (p50, and the CPU per round trip), and new streams (a
//! pipelining CONNECT client, open → first byte p50, CPU per open and close).
//!
//! Bulk data through a relay pays one more TLS encryption and decryption (the relay link) than
//! the unrelayed path, which no framing removes, so its mark is "no worse than relay/1"; the
//! framing shows in the per-message and per-stream rows, whose mark is "ahead".

use std::time::Duration;

use tether_e2e::benchkit::{cpu_secs, mean, median, percentile, range_note, request_response};
use tether_e2e::{Broker, Hub, OPS_TOKEN, connect, peers_yaml};
use tokio::io::AsyncWriteExt;

use super::{CLUSTER, Ends, Row, Setup, Via, gbit, open_first_byte_pipelined, upload, us};

/// "No worse" on bulk data: within this much (throughput and CPU-s/GB), the tolerance of the
/// client-path rows; four runs of this section put relay/2's CPU-s/GB at −3 % to +6 % of relay/1's.
const NO_WORSE: f64 = 0.10;

/// The relayed paths' brokers, the tunnel holder's peers.
pub struct Peers {
    relay2: Broker,
    relay1: Broker,
}

impl Peers {
    /// Starts b2 (default protocols) and b3 (`tunnel.protocol: h2`), each with b1 as its
    /// static peer, and waits until a CONNECT through each is relayed.
    pub async fn start(hub: &Hub, b1: &Broker, tunnel_yaml: &str) -> anyhow::Result<Self> {
        let relay2 = hub.start_broker("b2", &format!("{tunnel_yaml}{}", peers_yaml(b1)))?;
        let relay1 = hub.start_broker(
            "b3",
            &format!("tunnel: {{protocol: h2}}\n{}", peers_yaml(b1)),
        )?;
        for b in [&relay2, &relay1] {
            tether_test_support::wait_until_async(
                Duration::from_secs(20),
                "a stream relayed to the tunnel holder",
                || async {
                    let mut s = connect(b.client_addr, &format!("{CLUSTER}:443"), Some(OPS_TOKEN))
                        .await
                        .ok()?
                        .ok()?;
                    s.shutdown().await.ok()
                },
            )
            .await?;
        }
        Ok(Self { relay2, relay1 })
    }
}

/// The three paths, each as the `Ends` of a plain CONNECT to its broker.
fn paths(ends: &Ends, peers: &Peers) -> [(&'static str, Ends); 3] {
    let via = |b: &Broker| Ends {
        broker: b.client_addr,
        ..ends.clone()
    };
    [
        ("tunnel", ends.clone()),
        ("relay/2", via(&peers.relay2)),
        ("relay/1", via(&peers.relay1)),
    ]
}

/// Runs the section; `b1_agent` are the pids of the tunnel holder and the agent,
/// `client_target` this process and the target.
pub async fn section(
    setup: &Setup,
    ends: &Ends,
    peers: &Peers,
    b1_agent: [u32; 2],
    client_target: [u32; 2],
) -> anyhow::Result<Vec<Row>> {
    let paths = paths(ends, peers);
    let hops = |i: usize| -> Vec<u32> {
        let mut p = b1_agent.to_vec();
        match i {
            1 => p.push(peers.relay2.child.pid()),
            2 => p.push(peers.relay1.child.pid()),
            _ => {}
        }
        p.extend(client_target);
        p
    };
    let cpu_of = |p: &[u32]| p.iter().map(|p| cpu_secs(*p)).sum::<f64>();
    for (_, e) in &paths {
        upload(e, Via::Tunnel, 1, Duration::from_millis(200)).await?;
    }

    // Throughput, 1 stream.
    let cpu_now = |i: usize| cpu_of(&hops(i));
    let mut rates = [Vec::new(), Vec::new(), Vec::new()];
    let mut gbytes = [0.0f64; 3];
    let cpu = rotated(setup.rounds, cpu_now, async |i| {
        let (bytes, secs) = upload(&paths[i].1, Via::Tunnel, 1, setup.secs).await?;
        gbytes[i] += bytes as f64 / 1e9;
        rates[i].push(bytes as f64 / secs);
        Ok(())
    })
    .await?;
    let (mut v2_vs_v1, mut v2_vs_tunnel) = (Vec::new(), Vec::new());
    for (round, ((tunnel, v2), v1)) in rates[0].iter().zip(&rates[1]).zip(&rates[2]).enumerate() {
        let r = |i: usize| [*tunnel, *v2, *v1][i];
        v2_vs_v1.push(r(1) / r(2));
        v2_vs_tunnel.push(r(1) / r(0));
        println!(
            "  relayed CONNECT, 1 stream, round {}: tunnel {}, relay/2 {}, relay/1 {} (relay/2 {:.2}× relay/1, {:.2}× tunnel)",
            round + 1,
            gbit(r(0)),
            gbit(r(1)),
            gbit(r(2)),
            r(1) / r(2),
            r(1) / r(0)
        );
    }
    let per_gb = |i: usize| cpu[i] / gbytes[i];
    let cpu_note = format!(
        "CPU-s/GB (client, target, brokers, agent): tunnel {:.2}, relay/2 {:.2}, relay/1 {:.2}",
        per_gb(0),
        per_gb(1),
        per_gb(2)
    );
    println!("  {cpu_note}");
    let tput_ok = median(&v2_vs_v1) >= 1.0 - NO_WORSE && per_gb(1) <= per_gb(2) * (1.0 + NO_WORSE);
    let mut rows = vec![Row {
        what: "relayed CONNECT via a peer broker, 1 stream".into(),
        tunnel: format!(
            "relay/2 {}, relay/1 {}, unrelayed {}",
            gbit(mean(&rates[1])),
            gbit(mean(&rates[2])),
            gbit(mean(&rates[0]))
        ),
        result: format!(
            "relay/2 {:.2}× relay/1{}, {:.2}× unrelayed{}; {cpu_note}",
            median(&v2_vs_v1),
            range_note(&v2_vs_v1),
            median(&v2_vs_tunnel),
            range_note(&v2_vs_tunnel)
        ),
        target: "relay/2 no worse than relay/1 (tput and CPU-s/GB, within 10 %)".into(),
        ok: Some(tput_ok),
        ..Row::default()
    }];

    // 64 B request/response on an open stream of each path.
    let (per_block, blocks) = if setup.quick { (500, 4) } else { (1000, 12) };
    let mut socks = Vec::new();
    for (_, e) in &paths {
        let mut s = e.open(Via::Tunnel).await?;
        s.write_all(b"E").await?;
        request_response(&mut s, 200, &mut Vec::new()).await?;
        socks.push(s);
    }
    let mut samples = [Vec::new(), Vec::new(), Vec::new()];
    let rr_cpu = rotated(blocks, cpu_now, async |i| {
        request_response(&mut socks[i], per_block, &mut samples[i]).await
    })
    .await?;
    rows.push(latency_row(
        "relayed CONNECT, 64 B request/response",
        "round trip",
        samples,
        rr_cpu,
    ));

    // New streams: a pipelining client (head and first byte in one write), in rotating blocks.
    const BLOCK: usize = 25;
    let blocks = if setup.quick { 6 } else { 24 };
    let mut opens = [Vec::new(), Vec::new(), Vec::new()];
    let open_cpu = rotated(blocks, cpu_now, async |i| {
        for _ in 0..BLOCK {
            opens[i].push(open_first_byte_pipelined(&paths[i].1).await?);
        }
        Ok(())
    })
    .await?;
    rows.push(latency_row(
        "relayed CONNECT, open → first byte (pipelining)",
        "open+close",
        opens,
        open_cpu,
    ));
    Ok(rows)
}

/// Runs `each(i)` for the three paths (0 unrelayed, 1 relay/2, 2 relay/1) in `rounds` rounds,
/// their order rotated every round; returns the CPU seconds (`cpu(i)` before and after) each
/// path's processes spent in its runs.
async fn rotated(
    rounds: usize,
    cpu: impl Fn(usize) -> f64,
    mut each: impl AsyncFnMut(usize) -> anyhow::Result<()>,
) -> anyhow::Result<[f64; 3]> {
    let mut spent = [0.0f64; 3];
    for round in 0..rounds {
        for k in 0..3 {
            let i = (k + round) % 3;
            let c0 = cpu(i);
            each(i).await?;
            spent[i] += (cpu(i) - c0).max(0.0);
        }
    }
    Ok(spent)
}

/// A latency row: each path's p50 and its processes' CPU per operation (`op`); met when
/// relay/2's p50 is no higher than relay/1's.
fn latency_row(what: &str, op: &str, mut samples: [Vec<Duration>; 3], cpu: [f64; 3]) -> Row {
    for s in &mut samples {
        s.sort();
    }
    let p50 = |i: usize| percentile(&samples[i], 0.5);
    let per_op = |i: usize| cpu[i] / samples[i].len().max(1) as f64 * 1e6;
    Row {
        what: what.into(),
        tunnel: format!(
            "p50 relay/2 {}, relay/1 {}, unrelayed {}",
            us(p50(1)),
            us(p50(2)),
            us(p50(0))
        ),
        result: format!(
            "CPU per {op} (all processes on the path): relay/2 {:.1} µs, relay/1 {:.1} µs, unrelayed {:.1} µs",
            per_op(1),
            per_op(2),
            per_op(0)
        ),
        target: "relay/2 p50 ≤ relay/1's".into(),
        ok: Some(p50(1) <= p50(2)),
        ..Row::default()
    }
}
