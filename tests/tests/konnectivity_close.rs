//! Write-then-close must not lose data, on every front end of the broker; and the konnectivity
//! front end answers protocol mistakes the way docs/tunnel-protocol.md says.
//!
//! The target is an in-process "sink" on 127.0.0.1:0: it reads each connection to its end and
//! reports (length, checksum, whether it ended with a FIN rather than a reset), then closes.
//! Each client writes a random payload (sizes log-uniform from 1 B to 4 MiB, so the total stays
//! small) and closes at once — konnectivity: one DATA then CLOSE_REQ, as upstream's
//! `conn.Write(x); conn.Close()` does; native Dial: `write_all`, `shutdown`, drop; TLS CONNECT:
//! `write_all`, `shutdown`, drop. The multiset of reports must equal the multiset of payloads.
//!
//! Run: `cargo build -p tunnel-broker -p tunnel-agent --bins && cargo test -p tether-e2e --test konnectivity_close`.

mod grpc_support;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures::SinkExt as _;
use grpc_support::{channel, close_req, data, dial_req, next_packet, streaming_request};
use rand::Rng as _;
use tether_e2e::{OPS_TOKEN, Setup, qualified};
use tether_proto::konnectivity as k;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::sync::mpsc;

/// Largest payload of one run.
const MAX_RUN_BYTES: usize = 4 << 20;
/// Clients writing at the same time.
const WORKERS: usize = 4;

/// What the sink saw on one connection.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
struct Seen {
    len: usize,
    sum: u64,
    /// The connection ended with a FIN (read returned 0), not a reset.
    fin: bool,
}

/// Position-dependent checksum (a lost, duplicated or reordered byte changes it).
fn checksum(b: &[u8]) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64 ^ b.len() as u64;
    let mut words = b.chunks_exact(8);
    for w in &mut words {
        let w = u64::from_le_bytes(w.try_into().expect("8 bytes"));
        h = (h ^ w).wrapping_mul(0x0000_0100_0000_01b3).rotate_left(23);
    }
    for &x in words.remainder() {
        h = (h ^ u64::from(x)).wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// The sink target; reports arrive on the receiver (bound: one per run).
async fn sink(bound: usize) -> anyhow::Result<(SocketAddr, mpsc::Receiver<Seen>)> {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = l.local_addr()?;
    let (tx, rx) = mpsc::channel(bound);
    tokio::spawn(async move {
        while let Ok((mut s, _)) = l.accept().await {
            let tx = tx.clone();
            tokio::spawn(async move {
                let mut got = Vec::new();
                let fin = s.read_to_end(&mut got).await.is_ok();
                let _ = tx
                    .send(Seen {
                        len: got.len(),
                        sum: checksum(&got),
                        fin,
                    })
                    .await;
            });
        }
    });
    Ok((addr, rx))
}

/// `runs` payloads: sizes log-uniform in 1 B ..= 4 MiB (both ends included), each a slice of
/// one random buffer at its own offset.
fn payloads(runs: usize) -> Vec<Bytes> {
    let mut rng = rand::rng();
    let mut pool = vec![0u8; MAX_RUN_BYTES + 4096];
    rng.fill(&mut pool[..]);
    let pool = Bytes::from(pool);
    (0..runs)
        .map(|i| {
            let len = match i {
                0 => 1,
                1 => MAX_RUN_BYTES,
                _ => {
                    let x: f64 = rng.random_range(0.0..=(MAX_RUN_BYTES as f64).ln());
                    (x.exp().round() as usize).clamp(1, MAX_RUN_BYTES)
                }
            };
            let off = rng.random_range(0..4096);
            pool.slice(off..off + len)
        })
        .collect()
}

/// Runs `write_close` for every payload on [`WORKERS`] concurrent clients, then compares what
/// the sink saw; returns (runs, total bytes, elapsed).
async fn write_then_close<F, Fut>(
    name: &str,
    runs: usize,
    write_close: F,
) -> anyhow::Result<(usize, usize)>
where
    F: Fn(SocketAddr, Bytes) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = anyhow::Result<()>> + Send,
{
    let (target, mut seen_rx) = sink(runs).await?;
    let all = payloads(runs);
    let total: usize = all.iter().map(Bytes::len).sum();
    let mut expected: Vec<Seen> = all
        .iter()
        .map(|p| Seen {
            len: p.len(),
            sum: checksum(p),
            fin: true,
        })
        .collect();
    let started = Instant::now();
    let write_close = Arc::new(write_close);
    let mut workers = Vec::new();
    for w in 0..WORKERS {
        let mine: Vec<Bytes> = all.iter().skip(w).step_by(WORKERS).cloned().collect();
        let write_close = Arc::clone(&write_close);
        workers.push(tokio::spawn(async move {
            for p in mine {
                write_close(target, p).await?;
            }
            anyhow::Ok(())
        }));
    }
    for w in workers {
        w.await??;
    }
    let mut seen = Vec::with_capacity(runs);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while seen.len() < runs {
        match tokio::time::timeout_at(deadline, seen_rx.recv()).await {
            Ok(Some(s)) => seen.push(s),
            _ => break,
        }
    }
    expected.sort();
    seen.sort();
    let resets = seen.iter().filter(|s| !s.fin).count();
    let lost = expected
        .iter()
        .filter(|e| seen.binary_search(e).is_err())
        .count();
    println!(
        "{name}: {runs} write-then-close runs, {:.1} MiB in {:.2?}: {lost} lost or damaged, {resets} ended without FIN",
        total as f64 / f64::from(1 << 20),
        started.elapsed()
    );
    if lost > 0 {
        let missing: Vec<usize> = expected
            .iter()
            .filter(|e| seen.binary_search(e).is_err())
            .take(5)
            .map(|e| e.len)
            .collect();
        let got: Vec<usize> = seen.iter().take(5).map(|s| s.len).collect();
        println!("{name}: missing sizes {missing:?}; smallest seen {got:?}");
    }
    assert_eq!(seen.len(), runs, "{name}: the sink saw every connection");
    assert_eq!(resets, 0, "{name}: every connection ends with a FIN");
    assert_eq!(lost, 0, "{name}: every payload arrives intact");
    Ok((runs, total))
}

/// One konnectivity connection: DIAL_REQ, DIAL_RSP, DATA (the whole payload), CLOSE_REQ, then
/// CLOSE_RSP without error and the end of the RPC.
async fn konnectivity_write_close(
    mut client: k::proxy_service_client::ProxyServiceClient<tonic::transport::Channel>,
    address: String,
    payload: Bytes,
) -> anyhow::Result<()> {
    let (mut tx, req) = streaming_request::<k::Packet>(Some(OPS_TOKEN));
    tx.send(dial_req(address, 1)).await?;
    let mut inbound = client.proxy(req).await?.into_inner();
    let connect_id = match next_packet(&mut inbound).await?.payload {
        Some(k::packet::Payload::DialResponse(d)) if d.error.is_empty() => d.connect_id,
        other => anyhow::bail!("expected a successful DIAL_RSP, got {other:?}"),
    };
    tx.send(data(connect_id, payload)).await?;
    tx.send(close_req(connect_id)).await?;
    let rsp = next_packet(&mut inbound).await?;
    match rsp.payload {
        Some(k::packet::Payload::CloseResponse(c)) => {
            anyhow::ensure!(
                c.error.is_empty() && c.connect_id == connect_id,
                "CLOSE_RSP {c:?}"
            );
            anyhow::ensure!(rsp.r#type == k::PacketType::CloseRsp as i32);
        }
        other => anyhow::bail!("expected CLOSE_RSP, got {other:?}"),
    }
    let end = tokio::time::timeout(Duration::from_secs(10), inbound.message()).await??;
    anyhow::ensure!(end.is_none(), "nothing may follow CLOSE_RSP: {end:?}");
    Ok(())
}

/// konnectivity: 1,000 × (DATA, CLOSE_REQ) deliver every byte and a FIN; CLOSE_RSP after.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn konnectivity_write_then_close_loses_nothing() -> anyhow::Result<()> {
    let setup = Setup::start("c1", "", "").await?;
    let client = k::proxy_service_client::ProxyServiceClient::new(channel(&setup).await?);
    write_then_close("konnectivity", 1000, move |target, payload| {
        konnectivity_write_close(client.clone(), qualified("c1", target), payload)
    })
    .await?;
    Ok(())
}

/// Native Dial through the `tether-client` SDK: `write_all`, `shutdown`, drop at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn native_dial_write_then_close_loses_nothing() -> anyhow::Result<()> {
    let setup = Setup::start("c1", "", "").await?;
    let dialer = Arc::new(setup.ops_dialer().await?);
    write_then_close("native Dial", 300, move |target, payload| {
        let dialer = Arc::clone(&dialer);
        async move {
            let mut s = dialer
                .dial("c1", &target.ip().to_string(), target.port())
                .await?;
            s.write_all(&payload).await?;
            s.shutdown().await?;
            drop(s);
            Ok(())
        }
    })
    .await?;
    Ok(())
}

/// TLS CONNECT (ALPN http/1.1): `write_all`, `shutdown` (close_notify + FIN), drop at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_connect_write_then_close_loses_nothing() -> anyhow::Result<()> {
    let setup = Setup::start("c1", "", "").await?;
    let cfg = tether_e2e::client_tls_config(&setup.hub.pki.ca_path(), &[b"http/1.1"], None)?;
    let broker = setup.broker.client_tls_addr;
    write_then_close("TLS CONNECT", 300, move |target, payload| {
        let cfg = cfg.clone();
        async move {
            let mut s =
                tether_e2e::connect_tls(broker, cfg, &qualified("c1", target), Some(OPS_TOKEN))
                    .await?
                    .map_err(|(code, body)| anyhow::anyhow!("CONNECT answered {code}: {body}"))?;
            s.write_all(&payload).await?;
            s.shutdown().await?;
            drop(s);
            Ok(())
        }
    })
    .await?;
    Ok(())
}

/// A target that sends a greeting and closes at once, reading nothing.
async fn greeter(greeting: &'static [u8]) -> anyhow::Result<SocketAddr> {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = l.local_addr()?;
    tokio::spawn(async move {
        while let Ok((mut s, _)) = l.accept().await {
            let _ = s.write_all(greeting).await;
        }
    });
    Ok(addr)
}

/// The target closes first: its bytes, then CLOSE_RSP (no empty DATA); the RPC then ends
/// cleanly once the client ends its side.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn konnectivity_target_first_close_ends_with_close_rsp() -> anyhow::Result<()> {
    let setup = Setup::start("c1", "", "").await?;
    let target = greeter(b"hello from the target").await?;
    let mut client = k::proxy_service_client::ProxyServiceClient::new(channel(&setup).await?);
    let (mut tx, req) = streaming_request::<k::Packet>(Some(OPS_TOKEN));
    tx.send(dial_req(qualified("c1", target), 5)).await?;
    let mut inbound = client.proxy(req).await?.into_inner();
    let connect_id = match next_packet(&mut inbound).await?.payload {
        Some(k::packet::Payload::DialResponse(d)) if d.error.is_empty() => d.connect_id,
        other => anyhow::bail!("expected a successful DIAL_RSP, got {other:?}"),
    };
    let mut got = Vec::new();
    let close = loop {
        let p = next_packet(&mut inbound).await?;
        match p.payload {
            Some(k::packet::Payload::Data(d)) => {
                assert!(!d.data.is_empty(), "no empty DATA packets");
                assert_eq!(d.connect_id, connect_id);
                got.extend_from_slice(&d.data);
            }
            Some(k::packet::Payload::CloseResponse(c)) => {
                assert_eq!(p.r#type, k::PacketType::CloseRsp as i32);
                break c;
            }
            other => panic!("expected DATA or CLOSE_RSP, got {other:?}"),
        }
    };
    assert_eq!(got, b"hello from the target");
    assert_eq!(close.connect_id, connect_id);
    assert_eq!(close.error, "", "a clean target close carries no error");
    drop(tx);
    let end = tokio::time::timeout(Duration::from_secs(10), inbound.message()).await??;
    assert!(
        end.is_none(),
        "the RPC ends cleanly after CLOSE_RSP: {end:?}"
    );
    Ok(())
}

fn konnectivity_errors(text: &str, kind: &str) -> f64 {
    tether_e2e::sum_samples(
        text,
        "tether_broker_konnectivity_errors_total",
        &[("kind", kind)],
    )
}

async fn metrics_text(setup: &Setup) -> anyhow::Result<String> {
    let (code, text) = tether_e2e::admin_get(setup.broker.admin_addr, "/metrics").await?;
    anyhow::ensure!(code == 200, "/metrics answered {code}");
    Ok(text)
}

/// Packets that do not fit the stream: a wrong connectID in DATA and CLOSE_REQ gets CLOSE_RSP
/// "unrecognized connectID", a second DIAL_REQ gets DIAL_RSP with an error — the connection
/// carries on; an oversize DATA ends it with CLOSE_RSP naming the limit and a non-OK status
/// (not gRPC's message-size abort). Each is counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn konnectivity_protocol_errors_get_error_packets() -> anyhow::Result<()> {
    let setup = Setup::start("c1", "", "").await?;
    let mut client = k::proxy_service_client::ProxyServiceClient::new(channel(&setup).await?);
    let (mut tx, req) = streaming_request::<k::Packet>(Some(OPS_TOKEN));
    tx.send(dial_req(setup.echo_authority(), 11)).await?;
    let mut inbound = client.proxy(req).await?.into_inner();
    let connect_id = match next_packet(&mut inbound).await?.payload {
        Some(k::packet::Payload::DialResponse(d)) if d.error.is_empty() => d.connect_id,
        other => anyhow::bail!("expected a successful DIAL_RSP, got {other:?}"),
    };
    let wrong = connect_id + 1000;

    let expect_unrecognized = |p: k::Packet| match p.payload {
        Some(k::packet::Payload::CloseResponse(c)) => {
            assert_eq!(c.connect_id, wrong, "answered for the connectID sent");
            assert!(c.error.contains("unrecognized connectID"), "{}", c.error);
            assert!(c.error.contains(&connect_id.to_string()), "{}", c.error);
        }
        other => panic!("expected CLOSE_RSP, got {other:?}"),
    };
    tx.send(data(wrong, Bytes::from_static(b"lost"))).await?;
    expect_unrecognized(next_packet(&mut inbound).await?);
    tx.send(close_req(wrong)).await?;
    expect_unrecognized(next_packet(&mut inbound).await?);

    tx.send(dial_req(setup.echo_authority(), 99)).await?;
    match next_packet(&mut inbound).await?.payload {
        Some(k::packet::Payload::DialResponse(d)) => {
            assert_eq!(d.random, 99, "the error answers the second request");
            assert_eq!(d.connect_id, 0);
            assert!(
                d.error.contains("one connection per Proxy stream"),
                "{}",
                d.error
            );
        }
        other => panic!("expected DIAL_RSP, got {other:?}"),
    }

    // The connection itself is untouched: an echo still works.
    tx.send(data(connect_id, Bytes::from_static(b"still here")))
        .await?;
    let mut echoed = Vec::new();
    while echoed.len() < 10 {
        match next_packet(&mut inbound).await?.payload {
            Some(k::packet::Payload::Data(d)) => echoed.extend_from_slice(&d.data),
            other => panic!("expected DATA, got {other:?}"),
        }
    }
    assert_eq!(echoed, b"still here");

    // Over Tether's DATA limit (and over gRPC's default 4 MiB): a clear CLOSE_RSP, then abort.
    let n = tunnel_broker::grpc::MAX_DATA_BYTES + 1;
    tx.send(data(connect_id, Bytes::from(vec![7u8; n]))).await?;
    match next_packet(&mut inbound).await?.payload {
        Some(k::packet::Payload::CloseResponse(c)) => {
            assert_eq!(c.connect_id, connect_id);
            assert!(
                c.error.contains(&format!("{n} bytes exceeds"))
                    && c.error
                        .contains(&tunnel_broker::grpc::MAX_DATA_BYTES.to_string()),
                "{}",
                c.error
            );
        }
        other => panic!("expected CLOSE_RSP, got {other:?}"),
    }
    let status = tokio::time::timeout(Duration::from_secs(10), inbound.message())
        .await?
        .expect_err("an aborted connection ends with a non-OK status");
    assert_eq!(status.code(), tonic::Code::Aborted, "{status}");

    let text = metrics_text(&setup).await?;
    assert_eq!(konnectivity_errors(&text, "unknown_connect_id"), 2.0);
    assert_eq!(konnectivity_errors(&text, "second_dial"), 1.0);
    assert_eq!(konnectivity_errors(&text, "oversize_data"), 1.0);
    Ok(())
}

/// A listener whose accept queue is full, so a further connect hangs (its SYNs are dropped):
/// a target whose dial never answers. Returns the listener and the sockets that fill it.
async fn blackhole() -> anyhow::Result<(tokio::net::TcpListener, Vec<tokio::net::TcpStream>)> {
    let sock = tokio::net::TcpSocket::new_v4()?;
    sock.bind("127.0.0.1:0".parse()?)?;
    let l = sock.listen(1)?;
    let addr = l.local_addr()?;
    let mut fill = Vec::new();
    for _ in 0..16 {
        match tokio::time::timeout(
            Duration::from_millis(300),
            tokio::net::TcpStream::connect(addr),
        )
        .await
        {
            Ok(s) => fill.push(s?),
            Err(_) => return Ok((l, fill)), // this connect hung: the queue is full
        }
    }
    anyhow::bail!("the accept queue of a listen(1) socket never filled")
}

/// DIAL_CLS while the dial is pending cancels it at once: the RPC ends (no DIAL_RSP) long
/// before the 30 s dial timeout, and the cancellation is counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn konnectivity_dial_cls_cancels_pending_dial() -> anyhow::Result<()> {
    let setup = Setup::start("c1", "dial_timeout: 30s", "").await?;
    let (hole, _fill) = blackhole().await?;
    let mut client = k::proxy_service_client::ProxyServiceClient::new(channel(&setup).await?);
    let hole = qualified("c1", hole.local_addr()?);
    // A control stream to the same target, never cancelled: its dial stays pending.
    let (mut control_tx, req) = streaming_request::<k::Packet>(Some(OPS_TOKEN));
    control_tx.send(dial_req(hole.clone(), 20)).await?;
    let mut control = client.proxy(req).await?.into_inner();
    let (mut tx, req) = streaming_request::<k::Packet>(Some(OPS_TOKEN));
    tx.send(dial_req(hole, 21)).await?;
    let mut inbound = client.proxy(req).await?.into_inner();
    let sent = Instant::now();
    tx.send(grpc_support::packet(
        k::PacketType::DialCls,
        k::packet::Payload::CloseDial(k::CloseDial { random: 21 }),
    ))
    .await?;
    let end = tokio::time::timeout(Duration::from_secs(20), inbound.message()).await??;
    let took = sent.elapsed();
    assert!(end.is_none(), "a cancelled dial gets no DIAL_RSP: {end:?}");
    assert!(
        took < Duration::from_secs(5),
        "DIAL_CLS must cancel at once, took {took:?}"
    );
    let text = metrics_text(&setup).await?;
    assert_eq!(konnectivity_errors(&text, "dial_cancelled"), 1.0);
    let still = tokio::time::timeout(Duration::from_millis(500), control.message()).await;
    assert!(
        still.is_err(),
        "the uncancelled dial to the same target is still pending: {still:?}"
    );
    drop(control_tx);
    println!("DIAL_CLS ended the pending dial in {took:?}");
    Ok(())
}

/// A target that reads to the FIN and then keeps its side open: the client still gets
/// CLOSE_RSP after the broker's 5 s close grace (the tunnel stream is then reset), every byte
/// and the FIN arrived first, and the timeout is counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn konnectivity_close_is_bounded_when_the_target_stays_open() -> anyhow::Result<()> {
    let setup = Setup::start("c1", "", "").await?;
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let target = l.local_addr()?;
    let (seen_tx, mut seen_rx) = mpsc::channel(1);
    tokio::spawn(async move {
        let Ok((mut s, _)) = l.accept().await else {
            return;
        };
        let mut got = Vec::new();
        let fin = s.read_to_end(&mut got).await.is_ok();
        // The test holds the socket open.
        let _ = seen_tx.send((got, fin, s)).await;
    });
    let mut client = k::proxy_service_client::ProxyServiceClient::new(channel(&setup).await?);
    let (mut tx, req) = streaming_request::<k::Packet>(Some(OPS_TOKEN));
    tx.send(dial_req(qualified("c1", target), 3)).await?;
    let mut inbound = client.proxy(req).await?.into_inner();
    let connect_id = match next_packet(&mut inbound).await?.payload {
        Some(k::packet::Payload::DialResponse(d)) if d.error.is_empty() => d.connect_id,
        other => anyhow::bail!("expected a successful DIAL_RSP, got {other:?}"),
    };
    let started = Instant::now();
    tx.send(data(connect_id, Bytes::from_static(b"all of it")))
        .await?;
    tx.send(close_req(connect_id)).await?;
    let (got, fin, held) = tokio::time::timeout(Duration::from_secs(10), seen_rx.recv())
        .await?
        .expect("the target reports");
    assert_eq!(got, b"all of it");
    assert!(fin, "the target saw a FIN before anything else");
    let rsp = tokio::time::timeout(Duration::from_secs(20), inbound.message()).await??;
    let took = started.elapsed();
    match rsp.and_then(|p| p.payload) {
        Some(k::packet::Payload::CloseResponse(c)) => {
            assert_eq!(c.connect_id, connect_id);
            assert_eq!(c.error, "");
        }
        other => panic!("expected CLOSE_RSP, got {other:?}"),
    }
    let grace = tunnel_broker::grpc::CLOSE_GRACE;
    assert!(
        took >= grace && took < grace + Duration::from_secs(10),
        "CLOSE_RSP after the close grace, took {took:?}"
    );
    let text = metrics_text(&setup).await?;
    assert_eq!(konnectivity_errors(&text, "close_timeout"), 1.0);
    drop(held);
    Ok(())
}
