//! gRPC front ends, served on the client TLS listener when ALPN selects `h2`:
//!
//! - `tether.tunnel.v1.Dialer/Dial` — the native API: first frame `dial`, answer `result`, then
//!   `data` both ways; half-close by ending the request stream; abort is a non-OK status.
//! - `/tether.tunnel.v1.Dialer/DialRaw` — the same native API without gRPC framing (the dial in
//!   request headers, the bytes as plain HTTP/2 DATA), in [`raw`]: what the Rust SDK and
//!   `tetherctl proxy connect` use; no per-chunk protobuf message and no copies on the broker.
//! - `/ProxyService/Proxy` — konnectivity-compatible, in [`konnectivity`]: DIAL_REQ → DIAL_RSP,
//!   DATA both ways, CLOSE_REQ → graceful close → CLOSE_RSP. One RPC carries one connection.
//!
//! Both services accept messages up to [`MAX_MESSAGE_BYTES`] (gRPC's default is 4 MiB), so an
//! over-large konnectivity DATA gets Tether's own error packet rather than a transport abort.
//!
//! Authentication: the TLS client certificate (put into request extensions per connection), or
//! `authorization: Bearer <token>` metadata. Each RPC's outbound frames go through a bounded
//! channel ([`OUTBOUND_FRAMES`]); HTTP/2 capacity on the tunnel is released only once a chunk is
//! queued, so a slow gRPC reader slows only its own tunnel stream.

use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures::Stream;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::service::TowerToHyperService;
use tether_proto::tunnel::v1 as pb;
use tether_tunnel::pump::{AbortReason, SpliceError, SpliceStats};
use tether_tunnel::wire::DialErrorKind;
use tether_tunnel::{DialError, Target};
use tether_tunnel::{StreamRx, StreamTx};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};
use tower::ServiceExt as _;
use tracing::Instrument;

use crate::auth::ClientId;
use crate::dial::{Broker, OpenStream};

mod framing;
mod konnectivity;
pub mod raw;

pub use konnectivity::{CLOSE_GRACE, MAX_DATA_BYTES};

/// Largest gRPC message decoded (gRPC's default, 4 MiB, would abort a 4 MiB konnectivity DATA).
pub const MAX_MESSAGE_BYTES: usize = 4 * MAX_DATA_BYTES;

/// Frames buffered towards one gRPC client before backpressure reaches the tunnel stream.
pub const OUTBOUND_FRAMES: usize = 8;
/// Time a gRPC client has to send its first (dial) message.
pub const FIRST_MESSAGE_TIMEOUT: Duration = Duration::from_secs(10);

/// The verified certificate identity of the connection a request came on.
#[derive(Clone, Debug)]
struct PeerIdentity(Option<crate::auth::PeerCert>);

type FrameStream<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send + 'static>>;

/// Both gRPC services, ready to serve connections.
#[derive(Clone)]
pub struct GrpcFrontEnd {
    routes: tonic::service::Routes,
    broker: Arc<Broker>,
}

impl GrpcFrontEnd {
    pub fn new(broker: Arc<Broker>) -> Self {
        let routes = tonic::service::Routes::new(
            pb::dialer_server::DialerServer::new(DialerSvc(Arc::clone(&broker)))
                .max_decoding_message_size(MAX_MESSAGE_BYTES),
        );
        Self { routes, broker }
    }

    /// Serves HTTP/2 gRPC on one accepted TLS connection until it closes.
    pub async fn serve_connection<S>(&self, io: S, peer: Option<crate::auth::PeerCert>)
    where
        S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    {
        let peer = PeerIdentity(peer);
        // h2 writes each DATA frame on its own: batched, a burst of 16 KiB frames leaves in one
        // write per poll of the connection, konnectivity's payloads by reference (`batch`).
        let (io, flusher) = crate::batch::batched(io);
        let payloads = flusher.payloads();
        let (routes, broker) = (self.routes.clone(), Arc::clone(&self.broker));
        // The unframed Dial is served here; every other path goes to the gRPC routes.
        let svc = tower::service_fn(move |mut req: http::Request<hyper::body::Incoming>| {
            req.extensions_mut().insert(peer.clone());
            req.extensions_mut().insert(payloads.clone());
            let routes = routes.clone();
            let broker = Arc::clone(&broker);
            async move {
                crate::drain::refuse_if_draining(&broker.draining, req.version())?;
                if req.uri().path() == raw::PATH {
                    Ok::<_, h2::Error>(raw::serve(broker, req).await)
                } else if req.uri().path() == konnectivity::PATH {
                    Ok(konnectivity::serve(broker, req).await)
                } else {
                    Ok(routes.oneshot(req).await.unwrap_or_else(|e| match e {}))
                }
            }
        });
        let s = &self.broker.settings;
        let mut b = hyper::server::conn::http2::Builder::new(TokioExecutor::new());
        b.initial_stream_window_size(s.stream_window_bytes)
            .initial_connection_window_size(s.connection_window_bytes)
            .max_frame_size(s.max_frame_bytes)
            .max_concurrent_streams(s.max_concurrent_streams)
            .keep_alive_interval(s.keepalive_interval)
            .keep_alive_timeout(s.keepalive_timeout)
            .timer(hyper_util::rt::TokioTimer::new());
        let conn = Box::pin(b.serve_connection(TokioIo::new(io), TowerToHyperService::new(svc)));
        let conn = Box::pin(crate::batch::FlushAfterPoll::new(conn, flusher));
        // Draining: GOAWAY, so the client's next dials open a connection to another broker.
        if let Err(e) = crate::drain::serve_until_drained(conn, &self.broker.draining, |c| {
            c.get_mut().conn.as_mut().graceful_shutdown()
        })
        .await
        {
            tracing::debug!(error = %e, "gRPC client connection ended with error");
        }
    }
}

/// The client of a request on the HTTP/2 listener (the gRPC services, DialRaw, konnectivity):
/// its `authorization` value, else the connection's verified certificate.
fn authenticate(
    broker: &Broker,
    headers: &http::HeaderMap,
    extensions: &http::Extensions,
) -> Result<ClientId, DialError> {
    let credentials = headers
        .get("authorization")
        .map(|v| {
            v.to_str().map_err(|_| {
                DialError::new(
                    DialErrorKind::Unauthenticated,
                    "authorization header (gRPC metadata) is not visible ASCII",
                )
            })
        })
        .transpose()?;
    let peer = match extensions.get::<PeerIdentity>() {
        Some(PeerIdentity(Some(id))) => Some(id),
        _ => None,
    };
    broker
        .auth
        .identify(credentials, peer, "authorization: Bearer <token>")
}

fn status_of(e: &DialError) -> Status {
    match e.kind {
        DialErrorKind::BadRequest => Status::invalid_argument(e.to_string()),
        DialErrorKind::Unauthenticated => Status::unauthenticated(e.to_string()),
        DialErrorKind::Forbidden | DialErrorKind::AgentPolicy => {
            Status::permission_denied(e.to_string())
        }
        DialErrorKind::Timeout => Status::deadline_exceeded(e.to_string()),
        DialErrorKind::Overloaded => Status::resource_exhausted(e.to_string()),
        DialErrorKind::UnknownCluster => Status::not_found(e.to_string()),
        _ => Status::unavailable(e.to_string()),
    }
}

fn code_of(kind: DialErrorKind) -> pb::DialErrorCode {
    use pb::DialErrorCode as C;
    match kind {
        DialErrorKind::BadRequest => C::BadRequest,
        DialErrorKind::Unauthenticated | DialErrorKind::Forbidden => C::Forbidden,
        DialErrorKind::NoTunnel | DialErrorKind::TunnelLost => C::NoTunnel,
        DialErrorKind::AgentPolicy => C::AgentPolicy,
        DialErrorKind::Refused => C::Refused,
        DialErrorKind::Timeout => C::Timeout,
        DialErrorKind::NameNotFound => C::NameNotFound,
        DialErrorKind::Overloaded => C::Overloaded,
        DialErrorKind::Internal => C::Internal,
        DialErrorKind::UnknownCluster => C::UnknownCluster,
    }
}

/// What a client message means for the tunnel stream.
enum Inbound {
    Data(Bytes),
    /// Reset the connection (native API `abort`).
    Abort(String),
    Ignore,
}

/// Copies client messages → tunnel and tunnel → client messages until both ends finish.
/// `wrap` builds an outbound data message; returns the stream's outcome. Bytes both ways are
/// charged to `pacer` (the cluster's CPU share, `budget`).
#[allow(clippy::too_many_arguments)]
async fn pump<In, Out>(
    broker: &Broker,
    pacer: &crate::budget::Pacer,
    mut inbound: Streaming<In>,
    mut tx: StreamTx,
    mut rx: StreamRx,
    out: &mpsc::Sender<Result<Out, Status>>,
    classify: impl Fn(In) -> Inbound,
    wrap: impl Fn(Bytes) -> Out,
) -> Result<SpliceStats, SpliceError> {
    let mut stats = SpliceStats::default();
    let mut down_bytes = 0u64;
    let result = {
        let up = async {
            loop {
                match inbound.message().await {
                    Ok(Some(m)) => match classify(m) {
                        Inbound::Data(b) => {
                            let n = b.len() as u64;
                            tx.send(b).await?;
                            pacer.charge(n as usize).await;
                            stats.to_tunnel_bytes += n;
                            if let Some(c) = &broker.counters.to_tunnel {
                                c.inc_by(n);
                            }
                        }
                        Inbound::Abort(reason) => {
                            return Err(AbortReason::Cancelled(format!(
                                "client aborted: {reason}"
                            )));
                        }
                        Inbound::Ignore => {}
                    },
                    Ok(None) => {
                        tx.finish().await?;
                        return Ok::<(), AbortReason>(());
                    }
                    Err(s) => {
                        return Err(AbortReason::Cancelled(format!(
                            "client stream failed: {}",
                            s.message()
                        )));
                    }
                }
            }
        };
        let down = async {
            while let Some(next) = rx.data().await {
                let data = next?;
                let n = data.len();
                if n == 0 {
                    continue;
                }
                if out.send(Ok(wrap(data))).await.is_err() {
                    return Err(AbortReason::Cancelled("client went away".into()));
                }
                rx.release(n);
                pacer.charge(n).await;
                down_bytes += n as u64;
                if let Some(c) = &broker.counters.from_tunnel {
                    c.inc_by(n as u64);
                }
            }
            Ok::<(), AbortReason>(())
        };
        // Both directions to their end; the first error ends both.
        tokio::try_join!(up, down).map(|_| ())
    };
    stats.from_tunnel_bytes = down_bytes;
    match result {
        Ok(()) => Ok(stats),
        Err(reason) => {
            tx.reset();
            Err(SpliceError { reason, stats })
        }
    }
}

struct DialerSvc(Arc<Broker>);

#[tonic::async_trait]
impl pb::dialer_server::Dialer for DialerSvc {
    type DialStream = FrameStream<pb::DialFrame>;

    async fn dial(
        &self,
        req: Request<Streaming<pb::DialFrame>>,
    ) -> Result<Response<Self::DialStream>, Status> {
        let broker = Arc::clone(&self.0);
        let stream_id = broker.next_stream_id();
        let span = stream_span(
            stream_id,
            "framed",
            tether_telemetry::propagation::header_pairs(req.metadata().as_ref()),
        );
        let client =
            authenticate(&broker, req.metadata().as_ref(), req.extensions()).map_err(|e| {
                broker.record_failure("grpc", &e);
                status_of(&e)
            })?;
        let mut inbound = req.into_inner();
        let first = tokio::time::timeout(FIRST_MESSAGE_TIMEOUT, inbound.message())
            .await
            .map_err(|_| Status::deadline_exceeded("no dial frame received"))??;
        let Some(pb::DialFrame {
            kind: Some(pb::dial_frame::Kind::Dial(d)),
        }) = first
        else {
            return Err(Status::invalid_argument(
                "the first frame must be a dial request",
            ));
        };
        let target = Target::from_parts(&d.cluster, &d.host, d.port)
            .map_err(|e| DialError::new(DialErrorKind::BadRequest, e.to_string()));
        let timeout = (d.timeout_ms > 0).then(|| Duration::from_millis(d.timeout_ms.into()));
        let (out_tx, out_rx) = mpsc::channel(OUTBOUND_FRAMES);
        let opened = async {
            let target = target?;
            dial_recorded(&broker, &client, &target, stream_id, timeout).await
        }
        .instrument(span.clone())
        .await;
        let result_frame = |ok: bool,
                            code: pb::DialErrorCode,
                            message: String,
                            rtt: Option<Duration>| pb::DialFrame {
            kind: Some(pb::dial_frame::Kind::Result(pb::DialResult {
                ok,
                code: code as i32,
                message,
                stream_id,
                tunnel_rtt_micros: rtt.map_or(0, |d| d.as_micros() as u64),
            })),
        };
        let OpenStream { send, recv, ticket } = match opened {
            Ok(o) => o,
            Err(e) => {
                if e.kind == DialErrorKind::BadRequest {
                    broker.record_failure("grpc", &e);
                }
                let _ = out_tx.try_send(Ok(result_frame(
                    false,
                    code_of(e.kind),
                    e.message.clone(),
                    None,
                )));
                return Ok(Response::new(Box::pin(ReceiverStream::new(out_rx))));
            }
        };
        let _ = out_tx.try_send(Ok(result_frame(
            true,
            pb::DialErrorCode::Unspecified,
            String::new(),
            ticket.tunnel_rtt(),
        )));
        tokio::spawn(
            async move {
                let r = pump(
                    &broker,
                    &ticket.pacer,
                    inbound,
                    send,
                    recv,
                    &out_tx,
                    |m: pb::DialFrame| match m.kind {
                        Some(pb::dial_frame::Kind::Data(b)) => Inbound::Data(b),
                        Some(pb::dial_frame::Kind::Abort(a)) => Inbound::Abort(a.reason),
                        _ => Inbound::Ignore,
                    },
                    |b| pb::DialFrame {
                        kind: Some(pb::dial_frame::Kind::Data(b)),
                    },
                )
                .await;
                if let Err(e) = &r {
                    let _ = out_tx
                        .send(Err(Status::aborted(format!(
                            "stream aborted: {}",
                            e.reason
                        ))))
                        .await;
                }
                broker.finish(&ticket, &r);
            }
            .instrument(span),
        );
        Ok(Response::new(Box::pin(ReceiverStream::new(out_rx))))
    }
}

/// The span of one native-Dial stream (`framing`: `framed` for the gRPC `Dial`, `raw` for
/// `DialRaw`, `mux` for `tether-dial/1`), a child of the client's trace context (`trace`: its
/// W3C fields).
pub(crate) fn stream_span<K: AsRef<str>, V: AsRef<str>>(
    stream_id: u64,
    framing: &'static str,
    trace: impl IntoIterator<Item = (K, V)>,
) -> tracing::Span {
    let span = tracing::info_span!(
        "grpc_stream",
        stream = stream_id,
        framing,
        cluster = tracing::field::Empty,
        target = tracing::field::Empty,
        client = tracing::field::Empty
    );
    tether_telemetry::propagation::set_parent(&span, trace);
    span
}

/// Records the stream's cluster, target and client on the current span (the stream's, entered
/// by the caller) and dials: the one open path of both gRPC Dial front ends (framed and raw).
pub(crate) async fn dial_recorded(
    broker: &Broker,
    client: &ClientId,
    target: &Target,
    stream_id: u64,
    timeout: Option<Duration>,
) -> Result<OpenStream, DialError> {
    let span = tracing::Span::current();
    span.record("cluster", target.cluster.as_str());
    span.record("target", tracing::field::display(target));
    span.record("client", client.name.as_str());
    broker
        .dial(
            "grpc",
            client,
            target,
            stream_id,
            timeout,
            Default::default(),
        )
        .await
}
