//! gRPC client helpers shared by the gRPC front-end tests (tunnel_grpc.rs,
//! konnectivity_close.rs): a TLS channel to the broker and konnectivity packet builders.

#![allow(dead_code)] // each test file uses its own subset

use std::time::Duration;

use tether_e2e::Setup;
use tether_proto::konnectivity as k;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint};

/// A tonic channel to the broker's client TLS port (server name `localhost`, test CA).
pub async fn channel(setup: &Setup) -> anyhow::Result<Channel> {
    let ca = std::fs::read_to_string(setup.hub.pki.ca_path())?;
    let tls = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(ca))
        .domain_name("localhost");
    Ok(
        Endpoint::from_shared(format!("https://{}", setup.broker.client_tls_addr))?
            .tls_config(tls)?
            .connect_timeout(Duration::from_secs(10))
            .connect()
            .await?,
    )
}

/// A request whose messages come from the returned sender, with `authorization` metadata.
pub fn streaming_request<T: Send + 'static>(
    token: Option<&str>,
) -> (
    futures::channel::mpsc::Sender<T>,
    tonic::Request<futures::channel::mpsc::Receiver<T>>,
) {
    let (tx, rx) = futures::channel::mpsc::channel(16);
    let mut req = tonic::Request::new(rx);
    if let Some(t) = token {
        req.metadata_mut()
            .insert("authorization", format!("Bearer {t}").parse().unwrap());
    }
    (tx, req)
}

pub fn packet(t: k::PacketType, payload: k::packet::Payload) -> k::Packet {
    k::Packet {
        r#type: t as i32,
        payload: Some(payload),
    }
}

pub fn dial_req(address: String, random: i64) -> k::Packet {
    packet(
        k::PacketType::DialReq,
        k::packet::Payload::DialRequest(k::DialRequest {
            protocol: "tcp".into(),
            address,
            random,
        }),
    )
}

pub fn data(connect_id: i64, data: bytes::Bytes) -> k::Packet {
    packet(
        k::PacketType::Data,
        k::packet::Payload::Data(k::Data {
            connect_id,
            error: String::new(),
            data,
        }),
    )
}

pub fn close_req(connect_id: i64) -> k::Packet {
    packet(
        k::PacketType::CloseReq,
        k::packet::Payload::CloseRequest(k::CloseRequest { connect_id }),
    )
}

/// The next packet within 10 s; an error if the broker ended the stream.
pub async fn next_packet(inbound: &mut tonic::Streaming<k::Packet>) -> anyhow::Result<k::Packet> {
    tokio::time::timeout(Duration::from_secs(10), inbound.message())
        .await??
        .ok_or_else(|| anyhow::anyhow!("the broker ended the konnectivity stream"))
}
