//! The gRPC front ends on the broker's client TLS port (ALPN h2), driven by real tonic clients
//! over TLS that trusts the test CA: the konnectivity-compatible `ProxyService/Proxy` and the
//! native `tether.tunnel.v1.Dialer/Dial`, plus the `tether-client` crate's `Dialer`.

mod grpc_support;

use std::sync::Arc;
use std::time::Duration;

use futures::{SinkExt as _, StreamExt as _};
use grpc_support::{channel, next_packet, packet, streaming_request};
use tether_e2e::{OPS_TOKEN, Payload, Setup, echo_transfer, metric, qualified, rate};
use tether_proto::konnectivity as k;
use tether_proto::tunnel::v1 as pb;

/// konnectivity round trip: DIAL_REQ → DIAL_RSP (connectID, random echoed), DATA echoed,
/// CLOSE_REQ → CLOSE_RSP without error; then a failing dial answers DIAL_RSP with the reason,
/// and a client without a token is refused with UNAUTHENTICATED.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn konnectivity_round_trip() -> anyhow::Result<()> {
    let setup = Setup::start("c1", "", "").await?;
    let mut client = k::proxy_service_client::ProxyServiceClient::new(channel(&setup).await?);

    let (mut tx, req) = streaming_request::<k::Packet>(Some(OPS_TOKEN));
    tx.send(packet(
        k::PacketType::DialReq,
        k::packet::Payload::DialRequest(k::DialRequest {
            protocol: "tcp".into(),
            address: setup.echo_authority(),
            random: 4242,
        }),
    ))
    .await?;
    let mut inbound = client.proxy(req).await?.into_inner();
    let rsp = next_packet(&mut inbound).await?;
    assert_eq!(rsp.r#type, k::PacketType::DialRsp as i32);
    let Some(k::packet::Payload::DialResponse(d)) = rsp.payload else {
        panic!("expected a DialResponse: {rsp:?}");
    };
    assert_eq!(d.error, "", "dial failed: {}", d.error);
    assert_eq!(d.random, 4242, "DIAL_RSP must echo the request's random");
    assert_ne!(d.connect_id, 0);
    let connect_id = d.connect_id;

    let payload = Payload::new();
    let mut sent = Vec::new();
    for i in 0..8 {
        let chunk = payload.chunk(i, 50_000 + i as usize).to_vec();
        sent.extend_from_slice(&chunk);
        tx.send(packet(
            k::PacketType::Data,
            k::packet::Payload::Data(k::Data {
                connect_id,
                error: String::new(),
                data: chunk.into(),
            }),
        ))
        .await?;
    }
    let mut echoed = Vec::new();
    while echoed.len() < sent.len() {
        let p = next_packet(&mut inbound).await?;
        match p.payload {
            Some(k::packet::Payload::Data(d)) => {
                assert_eq!(p.r#type, k::PacketType::Data as i32);
                assert_eq!(d.connect_id, connect_id);
                echoed.extend_from_slice(&d.data);
            }
            other => panic!("expected DATA, got {other:?}"),
        }
    }
    assert!(echoed == sent, "konnectivity echo differs");

    tx.send(packet(
        k::PacketType::CloseReq,
        k::packet::Payload::CloseRequest(k::CloseRequest { connect_id }),
    ))
    .await?;
    let close = next_packet(&mut inbound).await?;
    assert_eq!(close.r#type, k::PacketType::CloseRsp as i32, "{close:?}");
    let Some(k::packet::Payload::CloseResponse(c)) = close.payload else {
        panic!("expected a CloseResponse: {close:?}");
    };
    assert_eq!(c.connect_id, connect_id);
    assert_eq!(c.error, "");
    // After CLOSE_RSP the RPC ends cleanly.
    let end = tokio::time::timeout(Duration::from_secs(10), inbound.message()).await??;
    assert!(end.is_none(), "nothing may follow CLOSE_RSP: {end:?}");

    // A refused dial: DIAL_RSP carrying the reason.
    let refusing = tether_e2e::RefusingPort::new()?;
    let closed_port = refusing.addr;
    let (mut tx, req) = streaming_request::<k::Packet>(Some(OPS_TOKEN));
    tx.send(packet(
        k::PacketType::DialReq,
        k::packet::Payload::DialRequest(k::DialRequest {
            protocol: "tcp".into(),
            address: qualified("c1", closed_port),
            random: 7,
        }),
    ))
    .await?;
    let mut inbound = client.proxy(req).await?.into_inner();
    let rsp = next_packet(&mut inbound).await?;
    let Some(k::packet::Payload::DialResponse(d)) = rsp.payload else {
        panic!("expected a DialResponse: {rsp:?}");
    };
    assert!(d.error.contains("refused"), "reason: {}", d.error);
    assert_eq!(d.random, 7);

    // No token: UNAUTHENTICATED.
    let (mut tx, req) = streaming_request::<k::Packet>(None);
    tx.send(packet(
        k::PacketType::DialReq,
        k::packet::Payload::DialRequest(k::DialRequest {
            protocol: "tcp".into(),
            address: "c1:443".into(),
            random: 1,
        }),
    ))
    .await?;
    let err = client.proxy(req).await.expect_err("no credentials");
    assert_eq!(err.code(), tonic::Code::Unauthenticated, "{err}");
    let dials = metric(
        setup.broker.admin_addr,
        "tether_broker_dial_duration_seconds_count",
        &[("frontend", "konnectivity")],
    )
    .await?;
    assert_eq!(dials, 2.0, "two konnectivity dials reached the agent");
    Ok(())
}

async fn next_frame(
    inbound: &mut tonic::Streaming<pb::DialFrame>,
) -> anyhow::Result<Option<pb::DialFrame>> {
    Ok(tokio::time::timeout(Duration::from_secs(10), inbound.message()).await??)
}

/// Native Dial API with the generated client: dial → ok result with a stream id, data echoed,
/// half-close (end the request stream) → the target's remaining bytes, then status OK.
/// Errors come back as a result frame with a code and message.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn native_dial_echo_and_half_close() -> anyhow::Result<()> {
    let setup = Setup::start("c1", "", "").await?;
    let mut client = pb::dialer_client::DialerClient::new(channel(&setup).await?);

    let (mut tx, req) = streaming_request::<pb::DialFrame>(Some(OPS_TOKEN));
    tx.send(pb::DialFrame {
        kind: Some(pb::dial_frame::Kind::Dial(pb::DialRequest {
            cluster: "c1".into(),
            host: setup.echo.ip().to_string(),
            port: setup.echo.port().into(),
            timeout_ms: 2000,
        })),
    })
    .await?;
    let mut inbound = client.dial(req).await?.into_inner();
    let first = next_frame(&mut inbound).await?.expect("a result frame");
    let Some(pb::dial_frame::Kind::Result(r)) = first.kind else {
        panic!("first frame must be the result: {first:?}");
    };
    assert!(r.ok, "dial failed: {r:?}");
    assert_ne!(r.stream_id, 0);

    let payload = Payload::new();
    let mut sent = Vec::new();
    for i in 0..16 {
        let chunk = payload.chunk(i, 100_000).to_vec();
        sent.extend_from_slice(&chunk);
        tx.send(pb::DialFrame {
            kind: Some(pb::dial_frame::Kind::Data(chunk.into())),
        })
        .await?;
    }
    // Half-close: end the request stream. The echo target sees EOF, sends the rest and closes.
    drop(tx);
    let mut echoed = Vec::new();
    loop {
        match next_frame(&mut inbound).await {
            Ok(Some(pb::DialFrame {
                kind: Some(pb::dial_frame::Kind::Data(d)),
            })) => echoed.extend_from_slice(&d),
            Ok(Some(other)) => panic!("unexpected frame {other:?}"),
            Ok(None) => break, // status OK: clean EOF from the target
            Err(e) => panic!("stream failed instead of ending cleanly: {e}"),
        }
    }
    assert_eq!(echoed.len(), sent.len());
    assert!(echoed == sent, "native Dial echo differs");

    // A dial the agent cannot complete: result frame with the code and reason, then the end.
    let refusing = tether_e2e::RefusingPort::new()?;
    let closed_port = refusing.addr;
    let (mut tx, req) = streaming_request::<pb::DialFrame>(Some(OPS_TOKEN));
    tx.send(pb::DialFrame {
        kind: Some(pb::dial_frame::Kind::Dial(pb::DialRequest {
            cluster: "c1".into(),
            host: "127.0.0.1".into(),
            port: closed_port.port().into(),
            timeout_ms: 0,
        })),
    })
    .await?;
    let mut inbound = client.dial(req).await?.into_inner();
    let first = next_frame(&mut inbound).await?.expect("a result frame");
    let Some(pb::dial_frame::Kind::Result(r)) = first.kind else {
        panic!("first frame must be the result: {first:?}");
    };
    assert!(!r.ok);
    assert_eq!(r.code(), pb::DialErrorCode::Refused, "{r:?}");
    assert!(r.message.contains("refused"), "{r:?}");

    // apionly may not reach other targets: FORBIDDEN.
    let (mut tx, req) = streaming_request::<pb::DialFrame>(Some("apionly-token"));
    tx.send(pb::DialFrame {
        kind: Some(pb::dial_frame::Kind::Dial(pb::DialRequest {
            cluster: "c1".into(),
            host: setup.echo.ip().to_string(),
            port: setup.echo.port().into(),
            timeout_ms: 0,
        })),
    })
    .await?;
    let mut inbound = client.dial(req).await?.into_inner();
    let first = next_frame(&mut inbound).await?.expect("a result frame");
    let Some(pb::dial_frame::Kind::Result(r)) = first.kind else {
        panic!("first frame must be the result: {first:?}");
    };
    assert_eq!(r.code(), pb::DialErrorCode::Forbidden, "{r:?}");
    Ok(())
}

/// The `tether-client` crate's `Dialer` (AsyncRead + AsyncWrite over the native API):
/// a checksummed 64 MiB echo with half-close at the end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tether_client_dialer_transfer_is_intact() -> anyhow::Result<()> {
    let setup = Setup::start("c1", "", "").await?;
    let dialer = setup.ops_dialer().await?;
    let s = dialer
        .dial("c1", &setup.echo.ip().to_string(), setup.echo.port())
        .await?;
    let total = 64 << 20;
    let t = echo_transfer(s, Arc::new(Payload::new()), total).await?;
    println!(
        "tether-client Dialer: {} MiB each way in {:.2?} ({} each way)",
        total >> 20,
        t.elapsed,
        rate(t.throughput())
    );
    assert!(t.intact(), "{t:?}");
    // The API-server shorthand goes to the agent's configured apiserver (the echo here).
    let mut api = dialer.dial_api_server("c1").await?;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    api.write_all(b"GET /version").await?;
    api.shutdown().await?;
    let mut back = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), api.read_to_end(&mut back)).await??;
    assert_eq!(back, b"GET /version");
    Ok(())
}

/// The agent dies while a konnectivity stream is open: the client gets CLOSE_RSP with an
/// error and a non-OK status, never a clean end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn konnectivity_stream_aborted_when_agent_dies() -> anyhow::Result<()> {
    let mut setup = Setup::start("c1", "", "").await?;
    let mut client = k::proxy_service_client::ProxyServiceClient::new(channel(&setup).await?);
    let (mut tx, req) = streaming_request::<k::Packet>(Some(OPS_TOKEN));
    tx.send(packet(
        k::PacketType::DialReq,
        k::packet::Payload::DialRequest(k::DialRequest {
            protocol: "tcp".into(),
            address: setup.echo_authority(),
            random: 1,
        }),
    ))
    .await?;
    let mut inbound = client.proxy(req).await?.into_inner();
    let Some(k::packet::Payload::DialResponse(d)) = next_packet(&mut inbound).await?.payload else {
        panic!("expected a DialResponse");
    };
    assert_eq!(d.error, "");
    setup.agent.child.kill();
    // The broken connection ends with CLOSE_RSP carrying an error and a non-OK status: never a
    // silent, clean end.
    let mut saw_close_error = false;
    let status = loop {
        match tokio::time::timeout(Duration::from_secs(30), inbound.message()).await? {
            Ok(Some(p)) => {
                if let Some(k::packet::Payload::CloseResponse(c)) = p.payload {
                    assert!(
                        !c.error.is_empty(),
                        "CLOSE_RSP after an abort must carry the error"
                    );
                    saw_close_error = true;
                }
            }
            Ok(None) => panic!("the konnectivity stream ended cleanly after the agent died"),
            Err(s) => break s,
        }
    };
    assert!(saw_close_error);
    assert_ne!(status.code(), tonic::Code::Ok);
    let _ = tx.close().await;
    let _ = inbound.next().await;
    Ok(())
}

/// The agent dies under a native Dial stream: the RPC ends with a non-OK status, never OK.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn native_dial_aborted_when_agent_dies() -> anyhow::Result<()> {
    let mut setup = Setup::start("c1", "", "").await?;
    let mut client = pb::dialer_client::DialerClient::new(channel(&setup).await?);
    let (mut tx, req) = streaming_request::<pb::DialFrame>(Some(OPS_TOKEN));
    tx.send(pb::DialFrame {
        kind: Some(pb::dial_frame::Kind::Dial(pb::DialRequest {
            cluster: "c1".into(),
            host: setup.echo.ip().to_string(),
            port: setup.echo.port().into(),
            timeout_ms: 0,
        })),
    })
    .await?;
    let mut inbound = client.dial(req).await?.into_inner();
    let first = next_frame(&mut inbound).await?.expect("a result frame");
    assert!(
        matches!(first.kind, Some(pb::dial_frame::Kind::Result(ref r)) if r.ok),
        "{first:?}"
    );
    tx.send(pb::DialFrame {
        kind: Some(pb::dial_frame::Kind::Data(b"ping".to_vec().into())),
    })
    .await?;
    let echo = next_frame(&mut inbound).await?.expect("an echo");
    assert!(matches!(echo.kind, Some(pb::dial_frame::Kind::Data(ref d)) if &d[..] == b"ping"));
    setup.agent.child.kill();
    let status = loop {
        match tokio::time::timeout(Duration::from_secs(30), inbound.message()).await? {
            Ok(Some(_)) => continue,
            Ok(None) => panic!("the Dial RPC ended with OK after the agent died"),
            Err(s) => break s,
        }
    };
    assert_ne!(status.code(), tonic::Code::Ok);
    drop(tx);
    Ok(())
}

/// A target that sends [`Payload`] chunks to every connection, endlessly.
async fn source_server() -> anyhow::Result<std::net::SocketAddr> {
    use tokio::io::AsyncWriteExt;
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = l.local_addr()?;
    let payload = Arc::new(Payload::new());
    tokio::spawn(async move {
        while let Ok((mut s, _)) = l.accept().await {
            let payload = Arc::clone(&payload);
            tokio::spawn(async move {
                let mut i = 0;
                while s.write_all(payload.chunk(i, 256 << 10)).await.is_ok() {
                    i += 1;
                }
            });
        }
    });
    Ok(addr)
}

/// Many connections share one gRPC channel (one HTTP/2 connection to the broker), unlike
/// konnectivity's single multiplexed stream: a Dial stream whose reader stalls must not hold
/// up another Dial stream on the same channel and tunnel.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stalled_dial_stream_does_not_block_its_channel() -> anyhow::Result<()> {
    use tokio::io::AsyncReadExt;
    let setup = Setup::start("c1", "", "").await?;
    let source = source_server().await?;
    let dialer = setup.ops_dialer().await?;
    // Stream A: an endless source nobody reads. Wait until the broker stops moving its bytes
    // (all windows and queues on its path are full).
    let mut stalled = dialer
        .dial("c1", &source.ip().to_string(), source.port())
        .await?;
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let mut last = (-1.0, std::time::Instant::now());
    loop {
        let now = metric(
            setup.broker.admin_addr,
            "tether_broker_bytes_total",
            &[("direction", "from_cluster")],
        )
        .await?;
        if now != last.0 {
            last = (now, std::time::Instant::now());
        } else if now > 0.0 && last.1.elapsed() > Duration::from_millis(500) {
            break;
        }
        anyhow::ensure!(
            std::time::Instant::now() < deadline,
            "stream A never stalled"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    println!("stream A stalled after {} MiB", last.0 as u64 >> 20);
    // Stream B on the same channel moves 32 MiB each way, intact.
    let s = dialer
        .dial("c1", &setup.echo.ip().to_string(), setup.echo.port())
        .await?;
    let t = tokio::time::timeout(
        Duration::from_secs(60),
        echo_transfer(s, Arc::new(Payload::new()), 32 << 20),
    )
    .await??;
    println!(
        "Dial stream next to a stalled one: {}",
        rate(t.throughput())
    );
    assert!(t.intact(), "{t:?}");
    // A is still alive: reading resumes it.
    let mut buf = vec![0u8; 1 << 20];
    stalled.read_exact(&mut buf).await?;
    Ok(())
}
