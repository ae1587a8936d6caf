//! `tether-dial/1`: a client's dials over the frames of `tether-tunnel/2` ([`tether_tunnel::mux`]),
//! on the client TLS listener (ALPN `tether-dial/1`) and on the plain client listener (the
//! connection opens with [`DIAL_PREFACE`]). The SDK (`tether_client::Dialer`) and `tetherctl
//! proxy connect` speak it; older clients keep HTTP/2 (`DialRaw`, gRPC) and CONNECT.
//!
//! The client opens streams ([`Role::Opener`]); the broker accepts them. An `AUTH` frame (the
//! `authorization` value, `Bearer <token>`) applies to the `OPEN`s after it; without one the
//! client certificate authenticates (TLS listener only). Each `OPEN` names the cluster and the
//! target (`apiserver` or `host:port`, the relay links' wire form), optionally a dial timeout and
//! trace context. The broker dials as for every front end ([`crate::dial::Broker::dial`], front
//! end label `grpc`: the native Dial API in another framing), answers `OPEN_OK` with its stream
//! id and the tunnel's last round trip, or `OPEN_ERR` with the dial error's kind and message, and
//! then relays the client's stream and the tunnel's chunk by chunk without copying
//! ([`relay::splice_streams_metered`]), paced by the cluster's CPU share.
//!
//! Why: between client and broker the `DialRaw` path pays HTTP/2 (two tasks per hop, HPACK'd
//! requests), which is what `tether-tunnel/2` removed between broker and agent; this path costs
//! what CONNECT costs plus 9 bytes a chunk, while many streams still share one connection.

use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::Duration;

use tether_tunnel::keepalive::{self, Pinger};
use tether_tunnel::mux::{self, Incoming, OnOpen, OpenOk, Responder, Role};
use tether_tunnel::pump::ByteCounters;
use tether_tunnel::relay;
use tether_tunnel::wire::DialErrorKind;
use tether_tunnel::{DialError, Target};
use tokio::io::{AsyncRead, AsyncWrite};
use tracing::Instrument;

use crate::auth::PeerCert;
use crate::budget::Pacer;
use crate::dial::{Broker, OpenStream};

pub use tether_tunnel::mux::frame::DIAL_PREFACE;

/// The `client_connections` metric's protocol label of this front end.
pub const PROTOCOL_LABEL: &str = "mux";

/// Serves one client connection until it ends (the client closes it, its keepalive fails, or
/// the broker's drain ends the handler); when the drain starts the client gets a GOAWAY.
pub async fn serve<T>(broker: Arc<Broker>, io: T, peer: Option<PeerCert>)
where
    T: AsyncRead + AsyncWrite + Send + 'static,
{
    let s = &broker.settings;
    let (interval, timeout) = (s.keepalive_interval, s.keepalive_timeout);
    let on_open: OnOpen = {
        let broker = Arc::clone(&broker);
        let peer = Arc::new(peer);
        Arc::new(move |incoming| {
            tokio::spawn(serve_stream(
                Arc::clone(&broker),
                Arc::clone(&peer),
                incoming,
            ));
        })
    };
    let (conn, driver, _events) = mux::connect(
        io,
        Role::Acceptor,
        mux::Config::from_settings(s),
        Some(on_open),
    );
    let rtt = AtomicU64::new(0);
    let alive = keepalive::run_probed(
        Pinger::Mux(conn.clone()),
        interval,
        timeout,
        &rtt,
        None,
        None,
    );
    // When the broker starts to drain: GOAWAY, so the client opens its new streams on a new
    // connection (another broker) while the streams open here finish within the drain grace.
    let go_away = async {
        broker.draining.cancelled().await;
        if conn.go_away("the broker is draining").await.is_ok() {
            tracing::debug!("tether-dial connection told to go away: draining");
        }
        std::future::pending::<()>().await
    };
    tokio::select! {
        reason = driver.run() => tracing::debug!(%reason, "tether-dial connection ended"),
        e = alive => {
            tracing::info!(error = %e, "tether-dial client did not answer keepalive");
            conn.close(format!("keepalive: {e}"));
        }
        () = go_away => {}
    }
}

/// One `OPEN`: authenticate, dial, answer, relay.
async fn serve_stream(broker: Arc<Broker>, peer: Arc<Option<PeerCert>>, incoming: Incoming) {
    let Incoming {
        open,
        auth,
        responder,
        send,
        recv,
    } = incoming;
    if broker.draining.is_cancelled() {
        // The OPEN crossed the GOAWAY: not processed, so the client opens it on another
        // connection (another broker) instead of failing it, as HTTP/2's REFUSED_STREAM.
        tracing::debug!("tether-dial stream refused unprocessed: the broker is draining");
        responder.refuse("the broker is draining");
        return;
    }
    let stream_id = broker.next_stream_id();
    let span = crate::grpc::stream_span(stream_id, "mux", open.trace_context());
    async move {
        let opened = async {
            let client = broker
                .auth
                .identify(
                    auth.as_deref(),
                    peer.as_ref().as_ref(),
                    "send AUTH with Bearer <token>",
                )
                .inspect_err(|e| broker.record_failure("grpc", e))?;
            let target = Target::from_wire(&open.cluster, &open.target)
                .map_err(|e| DialError::new(DialErrorKind::BadRequest, e.to_string()))
                .inspect_err(|e| broker.record_failure("grpc", e))?;
            let timeout = (open.dial_timeout_ms > 0)
                .then(|| Duration::from_millis(u64::from(open.dial_timeout_ms)));
            crate::grpc::dial_recorded(&broker, &client, &target, stream_id, timeout).await
        }
        .await;
        let Some(OpenStream {
            send: to_tunnel,
            recv: from_tunnel,
            ticket,
        }) = answer_open(&broker, responder, stream_id, opened).await
        else {
            return;
        };
        let meter = Meter {
            pacer: &ticket.pacer,
            counters: &broker.counters,
        };
        let r = relay::splice_streams_metered(
            (send.into(), recv.into()),
            (to_tunnel, from_tunnel),
            &meter,
        )
        .await;
        broker.finish(&ticket, &r);
    }
    .instrument(span)
    .await
}

/// Answers an `OPEN` this broker took (a client's on `tether-dial/1`, a peer broker's on
/// `tether-relay/2`) with its dial's result: `OPEN_ERR` with the error's kind and message (a
/// `no_tunnel` found once the drain began is refused unprocessed instead, so the opener goes
/// elsewhere), or `OPEN_OK` with the broker's stream id and the tunnel's last round trip. Returns the open
/// stream, or `None` when the dial failed or the answer could not go out (the opener's
/// connection is gone: the tunnel's stream is finished as failed, which resets it).
pub(crate) async fn answer_open(
    broker: &Broker,
    responder: Responder,
    stream_id: u64,
    opened: Result<OpenStream, DialError>,
) -> Option<OpenStream> {
    let stream = match opened {
        Ok(o) => o,
        Err(e) if e.kind == DialErrorKind::NoTunnel && broker.draining.is_cancelled() => {
            // The drain began during the lookup (its tunnels take no new streams): nothing
            // was dialled, so the opener may still take the stream elsewhere.
            responder.refuse("the broker is draining");
            return None;
        }
        Err(e) => {
            let _ = responder.fail(e.kind.metric_label(), &e.message).await;
            return None;
        }
    };
    let answer = OpenOk {
        stream_id,
        tunnel_rtt_micros: stream
            .ticket
            .tunnel_rtt()
            .map_or(0, |d| u32::try_from(d.as_micros()).unwrap_or(u32::MAX)),
    };
    if let Err(e) = responder.ok_with(answer).await {
        broker.finish(
            &stream.ticket,
            &Err(tether_tunnel::pump::SpliceError {
                reason: e,
                stats: Default::default(),
            }),
        );
        return None;
    }
    Some(stream)
}

/// Counts a relayed chunk and paces its direction by the cluster's CPU share, as the other
/// front ends do.
struct Meter<'a> {
    pacer: &'a Pacer,
    counters: &'a ByteCounters,
}

impl relay::Meter for Meter<'_> {
    fn forwarded(&self, to_tunnel: bool, n: usize) -> Option<Duration> {
        let counter = if to_tunnel {
            &self.counters.to_tunnel
        } else {
            &self.counters.from_tunnel
        };
        if let Some(c) = counter {
            c.inc_by(n as u64);
        }
        self.pacer.pause_for(n)
    }
}
