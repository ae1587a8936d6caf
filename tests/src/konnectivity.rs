//! A konnectivity client connection as `AsyncRead + AsyncWrite`: one `ProxyService/Proxy` RPC per
//! connection, as upstream's `CreateSingleUseGrpcTunnel` (what cluster-proxy's clients use) does.
//! DIAL_REQ → DIAL_RSP opens it; each write is one DATA packet (upstream's `conn.Write(b)`);
//! `shutdown()` sends CLOSE_REQ (the broker half-closes the target and answers CLOSE_RSP once the
//! target closed too); reads end at CLOSE_RSP. The benchmark's `clients` section measures the
//! broker's konnectivity front end with it, beside CONNECT and the SDK.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll, ready};
use std::time::Duration;

use bytes::{Buf as _, Bytes};
use futures::Stream as _;
use tether_proto::konnectivity as k;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::mpsc;
use tokio_util::sync::PollSender;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint};

/// Packets queued towards the broker per connection before writes wait.
pub const SEND_QUEUE_PACKETS: usize = 2;
/// Largest DATA payload one write sends (larger writes are cut; the broker takes up to 8 MiB).
pub const MAX_WRITE_BYTES: usize = 256 * 1024;
/// HTTP/2 windows the client advertises (bytes the broker may send ahead per RPC, and in all on
/// the channel): a tuned client, like the SDK's, not h2's 64 KiB default.
pub const STREAM_WINDOW_BYTES: u32 = 4 << 20;
pub const CONNECTION_WINDOW_BYTES: u32 = 32 << 20;
/// How long the broker has to answer DIAL_REQ.
pub const DIAL_ANSWER_TIMEOUT: Duration = Duration::from_secs(30);

/// A channel to the broker's konnectivity service: `https://` (the client TLS port; `ca_pem`
/// and `server_name` check the broker's certificate) or `http://` (the plain client port,
/// HTTP/2 without TLS).
pub async fn channel(endpoint: &str, ca_pem: &str, server_name: &str) -> anyhow::Result<Channel> {
    let mut ep = Endpoint::from_shared(endpoint.to_owned())?
        .connect_timeout(Duration::from_secs(10))
        .tcp_nodelay(true)
        .initial_stream_window_size(STREAM_WINDOW_BYTES)
        .initial_connection_window_size(CONNECTION_WINDOW_BYTES);
    if endpoint.starts_with("https://") {
        ep = ep.tls_config(
            ClientTlsConfig::new()
                .ca_certificate(Certificate::from_pem(ca_pem))
                .domain_name(server_name),
        )?;
    }
    Ok(ep.connect().await?)
}

/// One connection through the konnectivity front end.
pub struct KonnectivityConn {
    tx: PollSender<k::Packet>,
    rx: tonic::Streaming<k::Packet>,
    connect_id: i64,
    /// What the last DATA packet left unread.
    pending: Bytes,
    /// CLOSE_RSP arrived (or the broker ended the RPC): reads return EOF.
    closed: bool,
    /// CLOSE_REQ went out.
    shut: bool,
}

/// Opens a connection to `address` (`<cluster>:443`, or a cluster-qualified target) on
/// `channel`, authenticated with the bearer `token`.
pub async fn dial(
    channel: Channel,
    token: &str,
    address: &str,
) -> anyhow::Result<KonnectivityConn> {
    let (tx, rx) = mpsc::channel(SEND_QUEUE_PACKETS);
    tx.send(packet(
        k::PacketType::DialReq,
        k::packet::Payload::DialRequest(k::DialRequest {
            protocol: "tcp".into(),
            address: address.to_owned(),
            random: rand::random::<i64>(),
        }),
    ))
    .await?;
    let mut req = tonic::Request::new(tokio_stream::wrappers::ReceiverStream::new(rx));
    req.metadata_mut()
        .insert("authorization", format!("Bearer {token}").parse()?);
    let answer = async {
        let mut inbound = k::proxy_service_client::ProxyServiceClient::new(channel)
            .max_decoding_message_size(16 << 20)
            .proxy(req)
            .await?
            .into_inner();
        let first = inbound
            .message()
            .await?
            .ok_or_else(|| anyhow::anyhow!("the broker ended the RPC before DIAL_RSP"))?;
        anyhow::Ok((inbound, first))
    };
    let (rx, first) = tokio::time::timeout(DIAL_ANSWER_TIMEOUT, answer)
        .await
        .map_err(|_| anyhow::anyhow!("no DIAL_RSP within {DIAL_ANSWER_TIMEOUT:?}"))??;
    let Some(k::packet::Payload::DialResponse(d)) = first.payload else {
        anyhow::bail!("expected DIAL_RSP, got {first:?}");
    };
    anyhow::ensure!(d.error.is_empty(), "dial of {address} refused: {}", d.error);
    Ok(KonnectivityConn {
        tx: PollSender::new(tx),
        rx,
        connect_id: d.connect_id,
        pending: Bytes::new(),
        closed: false,
        shut: false,
    })
}

fn packet(t: k::PacketType, payload: k::packet::Payload) -> k::Packet {
    k::Packet {
        r#type: t as i32,
        payload: Some(payload),
    }
}

fn broken(what: &str) -> io::Error {
    io::Error::new(
        io::ErrorKind::BrokenPipe,
        format!("konnectivity RPC {what}"),
    )
}

impl KonnectivityConn {
    /// Queues `p` once the send queue has room.
    fn poll_send(
        &mut self,
        cx: &mut Context<'_>,
        p: impl FnOnce() -> k::Packet,
    ) -> Poll<io::Result<()>> {
        ready!(self.tx.poll_reserve(cx)).map_err(|_| broken("ended"))?;
        self.tx.send_item(p()).map_err(|_| broken("ended"))?;
        Poll::Ready(Ok(()))
    }
}

impl AsyncWrite for KonnectivityConn {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        if this.shut {
            return Poll::Ready(Err(broken("already sent CLOSE_REQ")));
        }
        let n = buf.len().min(MAX_WRITE_BYTES);
        let connect_id = this.connect_id;
        ready!(this.poll_send(cx, || packet(
            k::PacketType::Data,
            k::packet::Payload::Data(k::Data {
                connect_id,
                error: String::new(),
                data: Bytes::copy_from_slice(&buf[..n]),
            }),
        )))?;
        Poll::Ready(Ok(n))
    }

    fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if !this.shut {
            let connect_id = this.connect_id;
            ready!(this.poll_send(cx, || packet(
                k::PacketType::CloseReq,
                k::packet::Payload::CloseRequest(k::CloseRequest { connect_id }),
            )))?;
            this.shut = true;
        }
        Poll::Ready(Ok(()))
    }
}

impl AsyncRead for KonnectivityConn {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        while this.pending.is_empty() && !this.closed {
            match ready!(Pin::new(&mut this.rx).poll_next(cx)) {
                Some(Ok(k::Packet {
                    payload: Some(k::packet::Payload::Data(d)),
                    ..
                })) => {
                    if !d.error.is_empty() {
                        return Poll::Ready(Err(io::Error::new(
                            io::ErrorKind::ConnectionReset,
                            format!("konnectivity DATA error: {}", d.error),
                        )));
                    }
                    this.pending = d.data;
                }
                Some(Ok(k::Packet {
                    payload: Some(k::packet::Payload::CloseResponse(c)),
                    ..
                })) => {
                    if !c.error.is_empty() {
                        return Poll::Ready(Err(io::Error::new(
                            io::ErrorKind::ConnectionReset,
                            format!("konnectivity CLOSE_RSP: {}", c.error),
                        )));
                    }
                    this.closed = true;
                }
                Some(Ok(_)) => {}
                Some(Err(status)) => {
                    return Poll::Ready(Err(io::Error::new(
                        io::ErrorKind::ConnectionReset,
                        format!("konnectivity RPC failed: {}", status.message()),
                    )));
                }
                None => this.closed = true,
            }
        }
        let n = this.pending.len().min(buf.remaining());
        buf.put_slice(&this.pending[..n]);
        this.pending.advance(n);
        Poll::Ready(Ok(()))
    }
}
