//! konnectivity-compatible `ProxyService/Proxy`: one RPC carries one connection, as upstream's
//! `CreateSingleUseGrpcTunnel` does. docs/tunnel-protocol.md lists the packet sequences.
//!
//! Layout: [`serve`] authenticates and reads DIAL_REQ, then a task runs
//! [`dial_or_cancel`] (the dial raced against the client stream, so DIAL_CLS cancels a pending
//! dial at once) and [`carry`] (both directions of the open connection with the close rules):
//!
//! - CLOSE_REQ is a graceful close: every DATA before it is sent into the tunnel, then END_STREAM
//!   (the agent half-closes the target socket: FIN). Bytes the target sends afterwards are read
//!   and dropped; once the target closes too, CLOSE_RSP. A target that stays open longer than
//!   [`CLOSE_GRACE`] is reset and the client still gets CLOSE_RSP (counted as `close_timeout`).
//! - The target closing first ends with CLOSE_RSP (no empty DATA); what the client sends until
//!   it notices is still delivered, then END_STREAM.
//! - Aborts (client stream broken, DIAL_CLS on an open connection, oversize DATA, tunnel lost)
//!   reset the tunnel stream; the client gets CLOSE_RSP with the reason and a non-OK status.
//! - Packets that do not fit the stream get an error packet and leave the connection alone:
//!   a second DIAL_REQ → DIAL_RSP with an error, DATA or CLOSE_REQ for another connectID →
//!   CLOSE_RSP "unrecognized connectID" (as upstream).
//!
//! The RPC is served on hyper directly, not through tonic: [`super::framing`] reads a DATA
//! packet's payload as the HTTP/2 frames it came in and writes one as its own frame, where
//! tonic's buffers copied every byte once each way.

use std::sync::Arc;
use std::sync::atomic::{AtomicU8, Ordering};
use std::time::Duration;

use tether_proto::konnectivity as k;
use tether_tunnel::pump::{AbortReason, SpliceError, SpliceStats};
use tether_tunnel::wire::DialErrorKind;
use tether_tunnel::{DialError, Target};
use tether_tunnel::{StreamRx, StreamTx};
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;
use tonic::Status;
use tracing::Instrument;

use super::framing::{Inbound, MessageReader, PacketBody};
use super::{FIRST_MESSAGE_TIMEOUT, OUTBOUND_FRAMES, status_of};
use crate::auth::ClientId;
use crate::dial::{Broker, OpenStream};

/// Largest DATA payload accepted in one packet. Larger packets end the connection with a
/// CLOSE_RSP naming the limit (gRPC's own limit, [`super::MAX_MESSAGE_BYTES`], is far above).
pub const MAX_DATA_BYTES: usize = 8 << 20;
/// How long after CLOSE_REQ (or after the target's close) the other side has to finish.
pub const CLOSE_GRACE: Duration = Duration::from_secs(5);

/// The client-visible protocol events counted in
/// `tether_broker_konnectivity_errors_total{kind}`.
#[derive(Clone, Copy, Debug)]
enum Event {
    SecondDial,
    UnknownConnectId,
    OversizeData,
    DialCancelled,
    CloseTimeout,
    UnexpectedPacket,
}

impl Event {
    fn label(self) -> &'static str {
        match self {
            Self::SecondDial => "second_dial",
            Self::UnknownConnectId => "unknown_connect_id",
            Self::OversizeData => "oversize_data",
            Self::DialCancelled => "dial_cancelled",
            Self::CloseTimeout => "close_timeout",
            Self::UnexpectedPacket => "unexpected_packet",
        }
    }
}

fn count(broker: &Broker, e: Event) {
    broker
        .metrics
        .konnectivity_errors
        .with_label_values(&[e.label()])
        .inc();
    tracing::info!(kind = e.label(), "konnectivity protocol event");
}

fn packet(kind: k::PacketType, payload: k::packet::Payload) -> k::Packet {
    k::Packet {
        r#type: kind as i32,
        payload: Some(payload),
    }
}

fn dial_rsp(error: String, connect_id: i64, random: i64) -> k::Packet {
    packet(
        k::PacketType::DialRsp,
        k::packet::Payload::DialResponse(k::DialResponse {
            error,
            connect_id,
            random,
        }),
    )
}

fn close_rsp(error: String, connect_id: i64) -> k::Packet {
    packet(
        k::PacketType::CloseRsp,
        k::packet::Payload::CloseResponse(k::CloseResponse { error, connect_id }),
    )
}

type Out = mpsc::Sender<Result<k::Packet, Status>>;

/// Path of the konnectivity RPC.
pub const PATH: &str = "/ProxyService/Proxy";

type Response = http::Response<tonic::body::Body>;

/// Serves one `ProxyService/Proxy` RPC: an error status at once (trailers only), or `200` and
/// the packets of the connection, a task carrying it.
pub(super) async fn serve(
    broker: Arc<Broker>,
    req: http::Request<hyper::body::Incoming>,
) -> Response {
    match start(broker, req).await {
        Ok(r) => r,
        Err(status) => status.into_http(),
    }
}

async fn start(
    broker: Arc<Broker>,
    req: http::Request<hyper::body::Incoming>,
) -> Result<Response, Status> {
    let stream_id = broker.next_stream_id();
    let span = tracing::info_span!(
        "konnectivity_stream",
        stream = stream_id,
        cluster = tracing::field::Empty,
        target = tracing::field::Empty,
        client = tracing::field::Empty
    );
    // A client's trace context (`traceparent` metadata), as on the other gRPC front ends.
    tether_telemetry::propagation::set_parent(
        &span,
        tether_telemetry::propagation::header_pairs(req.headers()),
    );
    let client = super::authenticate(&broker, req.headers(), req.extensions()).map_err(|e| {
        broker.record_failure("konnectivity", &e);
        status_of(&e)
    })?;
    // The connection's batch may send this RPC's DATA payloads by reference (`batch`).
    let payloads = req
        .extensions()
        .get::<crate::batch::Payloads>()
        .cloned()
        .unwrap_or_default();
    let mut inbound = MessageReader::new(req.into_body(), super::MAX_MESSAGE_BYTES);
    let first = tokio::time::timeout(FIRST_MESSAGE_TIMEOUT, inbound.message())
        .await
        .map_err(|_| Status::deadline_exceeded("no DIAL_REQ received"))??;
    let Some(Inbound::Packet(k::Packet {
        payload: Some(k::packet::Payload::DialRequest(d)),
        ..
    })) = first
    else {
        return Err(Status::invalid_argument(
            "the first packet must be DIAL_REQ",
        ));
    };
    let (out_tx, out_rx) = mpsc::channel(OUTBOUND_FRAMES);
    let conn = Conn {
        broker,
        out: out_tx,
        connect_id: stream_id as i64,
    };
    tokio::spawn(async move { conn.serve(client, d, inbound, stream_id).await }.instrument(span));
    Ok(http::Response::builder()
        .header(http::header::CONTENT_TYPE, "application/grpc")
        .body(tonic::body::Body::new(PacketBody::new(out_rx, payloads)))
        .expect("valid response"))
}

/// How the dial phase ended.
enum Dialed {
    Open(OpenStream),
    Failed(DialError),
    /// DIAL_CLS, or the client stream ended, while the dial was pending.
    Cancelled(&'static str),
}

/// How the client → target direction ended without an abort.
#[derive(Clone, Copy, PartialEq, Eq)]
enum UpEnd {
    /// CLOSE_REQ (or the request stream ended): END_STREAM sent.
    ClientClosed,
    /// The target closed first and the client finished (or the grace ran out): END_STREAM sent.
    AfterTarget,
}

/// The client closed gracefully (CLOSE_REQ, or its request stream ended): mark the phase,
/// start the close-grace clock and send END_STREAM after the data already queued, so the agent
/// half-closes the target socket (a FIN) once every byte is written.
async fn client_closed(
    phase: &AtomicU8,
    closed_at: &watch::Sender<Option<Instant>>,
    tx: &mut StreamTx,
) -> Result<UpEnd, Abort> {
    let _ = phase.compare_exchange(OPEN, CLIENT_CLOSED, Ordering::AcqRel, Ordering::Acquire);
    let _ = closed_at.send(Some(Instant::now()));
    tx.finish().await.map_err(Abort::Tunnel)?;
    Ok(UpEnd::ClientClosed)
}

/// Phases of an open connection (an [`AtomicU8`], shared by the two directions of one task).
const OPEN: u8 = 0;
const CLIENT_CLOSED: u8 = 1;
const TARGET_CLOSED: u8 = 2;

/// One Proxy RPC: the broker, the outbound packet channel and the connectID it assigns.
struct Conn {
    broker: Arc<Broker>,
    out: Out,
    connect_id: i64,
}

impl Conn {
    async fn send(&self, p: k::Packet) {
        // A client that went away cannot be told; the caller's outcome already says why.
        let _ = self.out.send(Ok(p)).await;
    }

    /// The answer to a packet that does not belong to this connection, if any; counted.
    fn stray_reply(&self, p: k::Packet, dialing: bool) -> Option<k::Packet> {
        let ours = self.connect_id;
        let unknown = |id: i64| {
            let why = if dialing {
                format!("unrecognized connectID {id}: the dial on this stream is still pending")
            } else {
                format!("unrecognized connectID {id}: this stream carries connectID {ours}")
            };
            close_rsp(why, id)
        };
        let (event, reply) = match p.payload {
            Some(k::packet::Payload::DialRequest(d)) => {
                let why = if dialing {
                    "a dial is already pending on this stream; Tether carries one connection per \
                     Proxy stream (open a new stream)"
                        .to_string()
                } else {
                    format!(
                        "this stream already carries connectID {ours}; Tether carries one \
                         connection per Proxy stream (open a new stream)"
                    )
                };
                (Event::SecondDial, Some(dial_rsp(why, 0, d.random)))
            }
            Some(k::packet::Payload::Data(d)) => {
                (Event::UnknownConnectId, Some(unknown(d.connect_id)))
            }
            Some(k::packet::Payload::CloseRequest(c)) => {
                (Event::UnknownConnectId, Some(unknown(c.connect_id)))
            }
            _ => (Event::UnexpectedPacket, None),
        };
        count(&self.broker, event);
        reply
    }

    async fn serve(
        self,
        client: ClientId,
        d: k::DialRequest,
        mut inbound: MessageReader,
        stream_id: u64,
    ) {
        let random = d.random;
        match self
            .dial_or_cancel(&client, d, &mut inbound, stream_id)
            .await
        {
            Dialed::Cancelled(why) => {
                tracing::info!(reason = why, "pending dial cancelled");
                count(&self.broker, Event::DialCancelled);
            }
            Dialed::Failed(e) => {
                if e.kind == DialErrorKind::BadRequest {
                    self.broker.record_failure("konnectivity", &e);
                }
                self.send(dial_rsp(e.to_string(), 0, random)).await;
            }
            Dialed::Open(OpenStream { send, recv, ticket }) => {
                self.send(dial_rsp(String::new(), self.connect_id, random))
                    .await;
                let (outcome, close_error) = self.carry(inbound, send, recv, &ticket.pacer).await;
                if let Some(error) = close_error {
                    self.send(close_rsp(error.clone(), self.connect_id)).await;
                    if !error.is_empty() {
                        let _ = self
                            .out
                            .send(Err(Status::aborted(format!("stream aborted: {error}"))))
                            .await;
                    }
                }
                self.broker.finish(&ticket, &outcome);
            }
        }
    }

    /// Dials while reading the client stream: DIAL_CLS or the end of the client stream drops
    /// the pending dial (the tunnel stream is reset); other packets get their error answers.
    async fn dial_or_cancel(
        &self,
        client: &ClientId,
        d: k::DialRequest,
        inbound: &mut MessageReader,
        stream_id: u64,
    ) -> Dialed {
        let broker = &self.broker;
        let dial = async {
            if d.protocol != "tcp" {
                return Err(DialError::new(
                    DialErrorKind::BadRequest,
                    format!("protocol {:?} is not supported (tcp only)", d.protocol),
                ));
            }
            let target = Target::parse(&d.address)
                .map_err(|e| DialError::new(DialErrorKind::BadRequest, e.to_string()))?;
            let span = tracing::Span::current();
            span.record("cluster", target.cluster.as_str());
            span.record("target", tracing::field::display(&target));
            span.record("client", client.name.as_str());
            broker
                .dial(
                    "konnectivity",
                    client,
                    &target,
                    stream_id,
                    None,
                    Default::default(),
                )
                .await
        };
        tokio::pin!(dial);
        loop {
            tokio::select! {
                r = &mut dial => return r.map_or_else(Dialed::Failed, Dialed::Open),
                m = inbound.message() => match m.map(|m| m.map(Inbound::into_packet)) {
                    Ok(Some(k::Packet { payload: Some(k::packet::Payload::CloseDial(_)), .. })) => {
                        return Dialed::Cancelled("client sent DIAL_CLS");
                    }
                    Ok(Some(p)) => {
                        if let Some(reply) = self.stray_reply(p, true) {
                            self.send(reply).await;
                        }
                    }
                    Ok(None) | Err(_) => return Dialed::Cancelled("client stream ended"),
                },
            }
        }
    }

    /// Carries the open connection. Returns the stream outcome and the CLOSE_RSP error still to
    /// send (`None` when CLOSE_RSP already went out, because the target closed first).
    /// Bytes both ways are charged to `pacer` (the cluster's CPU share, `budget`).
    async fn carry(
        &self,
        mut inbound: MessageReader,
        mut tx: StreamTx,
        mut rx: StreamRx,
        pacer: &crate::budget::Pacer,
    ) -> (Result<SpliceStats, SpliceError>, Option<String>) {
        let broker = &self.broker;
        let id = self.connect_id;
        let phase = AtomicU8::new(OPEN);
        // When one side closed: the other side's grace runs from here.
        let (closed_at_tx, closed_at) = watch::channel(None::<Instant>);
        let (mut up_bytes, mut down_bytes, mut discarded) = (0u64, 0u64, 0u64);
        let result = {
            let up = async {
                let mut closed_at = closed_at.clone();
                loop {
                    let m = tokio::select! {
                        m = inbound.message() => m,
                        () = grace_after(&mut closed_at, TARGET_CLOSED, &phase) => {
                            tx.finish().await.map_err(Abort::Tunnel)?;
                            return Ok(UpEnd::AfterTarget);
                        }
                    };
                    let p = match m {
                        Ok(Some(p)) => p,
                        Ok(None) | Err(_) if phase.load(Ordering::Acquire) == TARGET_CLOSED => {
                            tx.finish().await.map_err(Abort::Tunnel)?;
                            return Ok(UpEnd::AfterTarget);
                        }
                        Ok(None) => {
                            // The request stream ended without CLOSE_REQ: nothing more will
                            // come, so close as gracefully as CLOSE_REQ does.
                            return client_closed(&phase, &closed_at_tx, &mut tx).await;
                        }
                        Err(s) => {
                            return Err(Abort::Client(format!(
                                "client stream failed: {}",
                                s.message()
                            )));
                        }
                    };
                    let p = match p {
                        Inbound::Data {
                            connect_id,
                            payload,
                            ..
                        } if connect_id == id => {
                            let n: usize = payload.iter().map(bytes::Bytes::len).sum();
                            if n > MAX_DATA_BYTES {
                                count(broker, Event::OversizeData);
                                return Err(Abort::Client(format!(
                                    "DATA packet of {n} bytes exceeds Tether's limit of {MAX_DATA_BYTES} bytes per packet; split the write"
                                )));
                            }
                            for piece in payload {
                                tx.send(piece).await.map_err(Abort::Tunnel)?;
                            }
                            pacer.charge(n).await;
                            up_bytes += n as u64;
                            if let Some(c) = &broker.counters.to_tunnel {
                                c.inc_by(n as u64);
                            }
                            continue;
                        }
                        other => other.into_packet(),
                    };
                    match p.payload {
                        Some(k::packet::Payload::CloseRequest(c)) if c.connect_id == id => {
                            return client_closed(&phase, &closed_at_tx, &mut tx).await;
                        }
                        Some(k::packet::Payload::CloseDial(_)) => {
                            return Err(Abort::Client(
                                "client sent DIAL_CLS on an open connection".into(),
                            ));
                        }
                        _ => {
                            if let Some(reply) = self.stray_reply(p, false) {
                                self.send(reply).await;
                            }
                        }
                    }
                }
            };
            let down = async {
                let mut closed_at = closed_at.clone();
                loop {
                    let next = tokio::select! {
                        n = rx.data() => n,
                        () = grace_after(&mut closed_at, CLIENT_CLOSED, &phase) => {
                            count(broker, Event::CloseTimeout);
                            return Err(Abort::CloseTimeout);
                        }
                    };
                    let Some(next) = next else { break };
                    let data = next.map_err(Abort::Tunnel)?;
                    let n = data.len();
                    if n == 0 {
                        continue;
                    }
                    if phase.load(Ordering::Acquire) == CLIENT_CLOSED {
                        // The client closed the connection: upstream's agent would have closed
                        // the socket; read and drop so the target can finish.
                        discarded += n as u64;
                    } else {
                        let msg = packet(
                            k::PacketType::Data,
                            k::packet::Payload::Data(k::Data {
                                connect_id: id,
                                error: String::new(),
                                data,
                            }),
                        );
                        if self.out.send(Ok(msg)).await.is_err() {
                            return Err(Abort::Client("client went away".into()));
                        }
                        down_bytes += n as u64;
                        if let Some(c) = &broker.counters.from_tunnel {
                            c.inc_by(n as u64);
                        }
                    }
                    rx.release(n);
                    pacer.charge(n).await;
                }
                // A clean END_STREAM: the target closed its side.
                if phase
                    .compare_exchange(OPEN, TARGET_CLOSED, Ordering::AcqRel, Ordering::Acquire)
                    .is_ok()
                {
                    let _ = closed_at_tx.send(Some(Instant::now()));
                    self.send(close_rsp(String::new(), id)).await;
                    return Ok(true);
                }
                Ok(false)
            };
            tokio::pin!(up, down);
            let (mut up_end, mut down_end) = (None, None);
            loop {
                tokio::select! {
                    r = &mut up, if up_end.is_none() => match r { Ok(e) => up_end = Some(e), Err(e) => break Err(e) },
                    r = &mut down, if down_end.is_none() => match r { Ok(e) => down_end = Some(e), Err(e) => break Err(e) },
                }
                if let (Some(_), Some(rsp_sent)) = (up_end, down_end) {
                    break Ok(rsp_sent);
                }
            }
        };
        let stats = SpliceStats {
            to_tunnel_bytes: up_bytes,
            from_tunnel_bytes: down_bytes,
        };
        if discarded > 0 {
            tracing::debug!(bytes = discarded, "target bytes after CLOSE_REQ dropped");
        }
        match result {
            Ok(true) => (Ok(stats), None),
            Ok(false) => (Ok(stats), Some(String::new())),
            Err(abort) => {
                tx.reset();
                let close_error = match &abort {
                    // The client asked for the close; the target just did not finish in time.
                    Abort::CloseTimeout => String::new(),
                    other => other.to_string(),
                };
                let reason = match abort {
                    Abort::Tunnel(r) => r,
                    other => AbortReason::Cancelled(other.to_string()),
                };
                (Err(SpliceError { reason, stats }), Some(close_error))
            }
        }
    }
}

/// Why an open connection was aborted.
#[derive(Debug, thiserror::Error)]
enum Abort {
    #[error("{0}")]
    Client(String),
    #[error("{0}")]
    Tunnel(AbortReason),
    #[error("the target did not close within {CLOSE_GRACE:?} after CLOSE_REQ")]
    CloseTimeout,
}

/// Resolves [`CLOSE_GRACE`] after the connection entered `wanted` (never, in other phases).
async fn grace_after(
    closed_at: &mut watch::Receiver<Option<Instant>>,
    wanted: u8,
    phase: &AtomicU8,
) {
    let at = match closed_at.wait_for(|v| v.is_some()).await {
        Ok(v) => *v,
        Err(_) => None,
    };
    match at {
        Some(at) if phase.load(Ordering::Acquire) == wanted => {
            tokio::time::sleep_until(at + CLOSE_GRACE).await;
        }
        _ => std::future::pending().await,
    }
}
