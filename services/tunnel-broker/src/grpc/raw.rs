//! The native Dial API without gRPC message framing: `POST /tether.tunnel.v1.Dialer/DialRaw`
//! on the same HTTP/2 listener as gRPC (see `docs/tunnel-protocol.md`).
//!
//! The dial request travels in headers (`tether-cluster`, `tether-host`, `tether-port`,
//! optional `tether-timeout-ms`; credentials as for `Dial`); the answer is the response head:
//! `200` with `tether-stream-id` and `tether-tunnel-rtt-micros` once the agent's dial succeeded,
//! or the dial error's HTTP status (as on CONNECT) with `tether-error: <kind>` and the message
//! as a text body. After `200`, the request and response bodies are the connection's bytes,
//! as they are: each HTTP/2 DATA frame from the client goes onto the tunnel stream unchanged
//! (no decode, no copy), and each DATA frame from the tunnel becomes one response frame.
//! END_STREAM is a half-close either way; RST_STREAM (or a body error) is an abort.
//!
//! Why: the framed `Dial` copies every byte twice more on the broker (tonic's decode buffer, then
//! its encode buffer) and twice more in a client, plus a protobuf message per chunk; this path
//! costs what HTTP/2 and TLS cost, like TLS CONNECT. The metrics label stays `grpc` (the same
//! API, other framing).

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body_util::BodyExt as _;
use hyper::body::{Frame, Incoming};
use tether_tunnel::pump::{AbortReason, SpliceError, SpliceStats};
use tether_tunnel::wire::DialErrorKind;
use tether_tunnel::{DialError, Target};
use tether_tunnel::{StreamRx, StreamTx};
use tokio::sync::oneshot;
use tracing::Instrument;

use crate::dial::{Broker, OpenStream};

/// Path of the unframed Dial.
pub const PATH: &str = "/tether.tunnel.v1.Dialer/DialRaw";
/// Request header: managed cluster.
pub const CLUSTER_HEADER: &str = "tether-cluster";
/// Request header: host inside the cluster (absent or empty: its API server).
pub const HOST_HEADER: &str = "tether-host";
/// Request header: port (ignored without a host).
pub const PORT_HEADER: &str = "tether-port";
/// Request header: dial timeout in milliseconds (absent: the broker's default).
pub const TIMEOUT_HEADER: &str = "tether-timeout-ms";
/// Response header of a `200`: the broker's stream id.
pub const STREAM_ID_HEADER: &str = "tether-stream-id";
/// Response header of a `200`: the tunnel's last measured round trip, µs (absent: unknown).
pub const RTT_HEADER: &str = "tether-tunnel-rtt-micros";
/// Response header of a refusal: the dial error's kind (`no_tunnel`, `forbidden`, …).
pub const ERROR_HEADER: &str = "tether-error";

type Response = http::Response<tonic::body::Body>;

fn header<'a>(req: &'a http::Request<Incoming>, name: &str) -> Result<&'a str, DialError> {
    match req.headers().get(name) {
        None => Ok(""),
        Some(v) => v.to_str().map_err(|_| {
            DialError::new(
                DialErrorKind::BadRequest,
                format!("header {name} is not ASCII"),
            )
        }),
    }
}

fn parse(
    req: &http::Request<Incoming>,
) -> Result<(Target, Option<std::time::Duration>), DialError> {
    let bad = |m: String| DialError::new(DialErrorKind::BadRequest, m);
    let cluster = header(req, CLUSTER_HEADER)?;
    if cluster.is_empty() {
        return Err(bad(format!("header {CLUSTER_HEADER} is missing")));
    }
    let host = header(req, HOST_HEADER)?;
    let port = match header(req, PORT_HEADER)? {
        "" => 0,
        p => p
            .parse::<u32>()
            .map_err(|_| bad(format!("header {PORT_HEADER}: {p:?} is not a port")))?,
    };
    let timeout = match header(req, TIMEOUT_HEADER)? {
        "" => None,
        t => Some(std::time::Duration::from_millis(t.parse::<u64>().map_err(
            |_| {
                bad(format!(
                    "header {TIMEOUT_HEADER}: {t:?} is not milliseconds"
                ))
            },
        )?)),
    };
    let target = Target::from_parts(cluster, host, port).map_err(|e| bad(e.to_string()))?;
    Ok((target, timeout.filter(|t| !t.is_zero())))
}

fn refusal(e: &DialError) -> Response {
    let mut r = http::Response::builder()
        .status(e.kind.status())
        .header(ERROR_HEADER, e.kind.metric_label())
        .header("content-type", "text/plain; charset=utf-8");
    if let Some(secs) = crate::budget::retry_after(e) {
        r = r.header(http::header::RETRY_AFTER, secs);
    }
    r.body(tonic::body::Body::new(http_body_util::Full::new(
        Bytes::from(format!("{}\n", e.message)),
    )))
    .expect("static response parts")
}

/// Serves one unframed Dial.
pub async fn serve(broker: Arc<Broker>, req: http::Request<Incoming>) -> Response {
    let stream_id = broker.next_stream_id();
    let span = super::stream_span(
        stream_id,
        "raw",
        tether_telemetry::propagation::header_pairs(req.headers()),
    );
    let opened = async {
        let client = super::authenticate(&broker, req.headers(), req.extensions())
            .inspect_err(|e| broker.record_failure("grpc", e))?;
        let (target, timeout) = parse(&req).inspect_err(|e| broker.record_failure("grpc", e))?;
        super::dial_recorded(&broker, &client, &target, stream_id, timeout).await
    }
    .instrument(span.clone())
    .await;
    let OpenStream { send, recv, ticket } = match opened {
        Ok(o) => o,
        Err(e) => return refusal(&e),
    };
    let rtt = ticket.tunnel_rtt();
    let (done_tx, done_rx) = oneshot::channel();
    let down_bytes = Arc::new(AtomicU64::new(0));
    let body = TunnelBody {
        rx: recv,
        pace: crate::budget::PollPacer::new(ticket.pacer.clone()),
        broker: Arc::clone(&broker),
        bytes: Arc::clone(&down_bytes),
        done: Some(done_tx),
    };
    let inbound = req.into_body();
    tokio::spawn(
        async move {
            let mut tx = send;
            let up = upstream(&broker, &ticket.pacer, inbound, &mut tx).await;
            // The response body reports how the tunnel → client direction ended (a dropped body:
            // the client went away).
            let down = match up {
                Ok(_) => done_rx
                    .await
                    .unwrap_or_else(|_| Err(AbortReason::Cancelled("client went away".into()))),
                Err(_) => Ok(()),
            };
            let mut stats = SpliceStats {
                to_tunnel_bytes: up.as_ref().map_or(0, |n| *n),
                from_tunnel_bytes: 0,
            };
            stats.from_tunnel_bytes = down_bytes.load(Ordering::Relaxed);
            let r = match (up, down) {
                (Ok(_), Ok(())) => Ok(stats),
                (Err(reason), _) | (_, Err(reason)) => {
                    tx.reset();
                    Err(SpliceError { reason, stats })
                }
            };
            broker.finish(&ticket, &r);
        }
        .instrument(span),
    );
    let mut resp = http::Response::builder()
        .status(200)
        .header("content-type", "application/octet-stream")
        .header(STREAM_ID_HEADER, stream_id);
    if let Some(rtt) = rtt {
        resp = resp.header(RTT_HEADER, rtt.as_micros() as u64);
    }
    resp.body(tonic::body::Body::new(body))
        .expect("static response parts")
}

/// Client → tunnel: every request DATA frame as it is; END_STREAM → END_STREAM. Returns the
/// bytes sent (charged to `pacer`, the cluster's CPU share).
async fn upstream(
    broker: &Broker,
    pacer: &crate::budget::Pacer,
    mut inbound: Incoming,
    tx: &mut StreamTx,
) -> Result<u64, AbortReason> {
    let mut n = 0u64;
    loop {
        let frame = tokio::select! {
            biased;
            f = inbound.frame() => f,
            r = tx.reset_by_peer() => return Err(r),
        };
        match frame {
            Some(Ok(f)) => {
                let Ok(data) = f.into_data() else { continue }; // trailers: ignored
                let len = data.len() as u64;
                if len == 0 {
                    continue;
                }
                tx.send(data).await?;
                pacer.charge(len as usize).await;
                n += len;
                if let Some(c) = &broker.counters.to_tunnel {
                    c.inc_by(len);
                }
            }
            Some(Err(e)) => {
                return Err(AbortReason::Cancelled(format!("client stream failed: {e}")));
            }
            None => {
                tx.finish().await?;
                return Ok(n);
            }
        }
    }
}

/// Tunnel → client: the response body reads the tunnel stream directly (no task, no queue);
/// each chunk's flow-control capacity is released once hyper takes it, so at most one chunk
/// beyond the client's HTTP/2 window is buffered. A tunnel reset becomes a body error, which
/// hyper turns into RST_STREAM towards the client.
struct TunnelBody {
    rx: StreamRx,
    /// The cluster's CPU share: a paced stream waits here before reading the next chunk.
    pace: crate::budget::PollPacer,
    broker: Arc<Broker>,
    bytes: Arc<AtomicU64>,
    done: Option<oneshot::Sender<Result<(), AbortReason>>>,
}

impl TunnelBody {
    fn finish(&mut self, r: Result<(), AbortReason>) {
        if let Some(d) = self.done.take() {
            let _ = d.send(r);
        }
    }
}

impl hyper::body::Body for TunnelBody {
    type Data = Bytes;
    type Error = AbortReason;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, AbortReason>>> {
        std::task::ready!(self.pace.poll_ready(cx));
        loop {
            match std::task::ready!(self.rx.poll_data(cx)) {
                Some(Ok(data)) => {
                    let n = data.len();
                    if n == 0 {
                        continue;
                    }
                    self.rx.release(n);
                    self.pace.charge(n);
                    self.bytes.fetch_add(n as u64, Ordering::Relaxed);
                    if let Some(c) = &self.broker.counters.from_tunnel {
                        c.inc_by(n as u64);
                    }
                    return Poll::Ready(Some(Ok(Frame::data(data))));
                }
                Some(Err(e)) => {
                    self.finish(Err(e.clone()));
                    return Poll::Ready(Some(Err(e)));
                }
                None => {
                    self.finish(Ok(()));
                    return Poll::Ready(None);
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.rx.is_end_stream()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tether_tunnel::wire::DialErrorKind;

    /// The unframed Dial's refusal for capacity carries `Retry-After`, like every HTTP answer of
    /// the broker to one (`budget::retry_after`); other refusals do not.
    #[test]
    fn a_refusal_for_capacity_carries_retry_after() {
        let r = refusal(&DialError::new(DialErrorKind::Overloaded, "budget"));
        assert_eq!(r.status(), http::StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(r.headers()[ERROR_HEADER], "overloaded");
        assert_eq!(r.headers()[http::header::RETRY_AFTER], "1");
        let r = refusal(&DialError::new(DialErrorKind::NoTunnel, "none"));
        assert!(r.headers().get(http::header::RETRY_AFTER).is_none());
    }
}
