//! [`TunnelHandle`]: what front ends, the registry and relays use to open streams on one
//! connection to an agent (`tether-tunnel/2`, or HTTP/2 for `tether-tunnel/1`) or to a peer
//! broker's relay (HTTP/2), and the [`StreamGuard`] each open stream holds. The connection
//! itself is owned by its `tunnel::TunnelActor`.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use bytes::Bytes;
use h2::client::SendRequest;
use http::{HeaderValue, Method, Request, StatusCode};
use tether_tunnel::mux::{self, Mux};
use tether_tunnel::watchdog::Progress;
use tether_tunnel::window::AdaptiveWindow;
use tether_tunnel::wire::{self, DialErrorKind};
use tether_tunnel::{DialError, StreamRx, StreamTx, Target};
use tokio::sync::Semaphore;

/// Time the agent has to answer the `hello` request.
pub const HELLO_TIMEOUT: Duration = Duration::from_secs(5);

/// What front ends use to open streams on one agent tunnel. Cheap to share.
pub struct TunnelHandle {
    pub id: u64,
    pub cluster: String,
    pub agent: String,
    conn: Conn,
    open: AtomicUsize,
    pending: Semaphore,
    max_pending: usize,
    /// No new streams go here: this broker is draining ([`TunnelHandle::send_drain`]), or the
    /// agent sent GOAWAY (it is closing this tunnel: shutting down, or replacing it).
    draining: AtomicBool,
    /// Last HTTP/2 PING round trip on this connection, µs (0 = not measured yet).
    rtt_micros: std::sync::atomic::AtomicU64,
    /// Cancelling it drops the connection (open streams are reset).
    closer: tokio_util::sync::CancellationToken,
    /// The adaptive receive window of this connection (agent tunnels; relays keep theirs fixed).
    window: Option<Arc<AdaptiveWindow>>,
    /// Transport progress seen by the wedged-tunnel watchdog (agent tunnels).
    progress: Option<Arc<Progress>>,
}

/// The connection streams are opened on.
enum Conn {
    /// HTTP/2: `tether-tunnel/1` agents and relay links to peer brokers.
    H2(SendRequest<Bytes>),
    /// `tether-tunnel/2`.
    Mux(Mux),
}

/// A header value unique to one stream (its id, its trace context) goes out never-indexed
/// (RFC 7541 §6.2.3): indexing it would only churn both ends' HPACK dynamic tables, one insertion
/// and one eviction per stream, and push out the values every stream repeats.
fn unindexed(mut v: HeaderValue) -> HeaderValue {
    v.set_sensitive(true);
    v
}
impl std::fmt::Debug for TunnelHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TunnelHandle")
            .field("id", &self.id)
            .field("cluster", &self.cluster)
            .field("agent", &self.agent)
            .finish_non_exhaustive()
    }
}

/// Decrements the tunnel's open-stream count when the stream ends.
pub struct StreamGuard(Arc<TunnelHandle>);

impl StreamGuard {
    /// The tunnel carrying the stream.
    pub fn tunnel(&self) -> &TunnelHandle {
        &self.0
    }
}

impl Drop for StreamGuard {
    fn drop(&mut self) {
        self.0.open.fetch_sub(1, Ordering::Relaxed);
    }
}

impl TunnelHandle {
    /// A handle over an HTTP/2 connection on which this broker opens streams (to an agent, or
    /// to a peer broker's relay).
    pub fn new(
        id: u64,
        cluster: String,
        agent: String,
        send: SendRequest<Bytes>,
        max_pending_dials: usize,
    ) -> Self {
        Self::with_conn(id, cluster, agent, Conn::H2(send), max_pending_dials)
    }

    /// A handle over a `tether-tunnel/2` connection to an agent.
    pub fn new_mux(
        id: u64,
        cluster: String,
        agent: String,
        mux: Mux,
        max_pending_dials: usize,
    ) -> Self {
        Self::with_conn(id, cluster, agent, Conn::Mux(mux), max_pending_dials)
    }

    fn with_conn(
        id: u64,
        cluster: String,
        agent: String,
        conn: Conn,
        max_pending_dials: usize,
    ) -> Self {
        Self {
            id,
            cluster,
            agent,
            conn,
            open: AtomicUsize::new(0),
            pending: Semaphore::new(max_pending_dials),
            max_pending: max_pending_dials,
            draining: AtomicBool::new(false),
            rtt_micros: Default::default(),
            closer: Default::default(),
            window: None,
            progress: None,
        }
    }

    /// Records the connection's transport progress (tether_tunnel::watchdog).
    pub fn with_progress(mut self, progress: Arc<Progress>) -> Self {
        self.progress = Some(progress);
        self
    }

    /// The watchdog suspects the tunnel is wedged (bytes to the agent unanswered for half the
    /// stall timeout): new streams avoid it.
    pub fn is_suspect(&self) -> bool {
        self.progress.as_ref().is_some_and(|p| p.is_suspect())
    }

    /// How long bytes sent on the tunnel have gone unanswered, if they have.
    pub fn unanswered(&self) -> Option<Duration> {
        self.progress.as_ref().and_then(|p| p.unanswered())
    }

    /// Records the connection's adaptive receive window (shown in `/debug/tunnels`).
    pub fn with_window(mut self, window: Arc<AdaptiveWindow>) -> Self {
        self.window = Some(window);
        self
    }

    /// The receive window of this tunnel's streams now, if it adapts.
    pub fn stream_window(&self) -> Option<u32> {
        self.window.as_ref().map(|w| w.current())
    }

    /// Uses `closer` to close the connection (see [`TunnelHandle::refuse_and_close`]).
    pub fn with_closer(mut self, closer: tokio_util::sync::CancellationToken) -> Self {
        self.closer = closer;
        self
    }

    /// Closes the connection at once (open streams end with an error).
    pub fn close(&self) {
        self.closer.cancel();
    }

    /// Tells the agent why (`refused`, best effort) and closes the connection.
    pub async fn refuse_and_close(&self, reason: &str) {
        match &self.conn {
            Conn::H2(send) => tell_refused(send, reason).await,
            Conn::Mux(m) => tell_refused_mux(m, reason).await,
        }
        self.closer.cancel();
    }

    /// The protocol of the connection (`tether-tunnel/2`, or HTTP/2).
    pub fn protocol(&self) -> &'static str {
        match &self.conn {
            Conn::H2(_) => "h2",
            Conn::Mux(_) => "mux",
        }
    }

    pub fn open_streams(&self) -> usize {
        self.open.load(Ordering::Relaxed)
    }

    /// Last measured round trip of the tunnel (HTTP/2 PING), if any.
    pub fn rtt(&self) -> Option<Duration> {
        match self.rtt_micros.load(Ordering::Relaxed) {
            0 => None,
            us => Some(Duration::from_micros(us)),
        }
    }

    /// Where the keepalive stores its measurements.
    pub fn rtt_cell(&self) -> &std::sync::atomic::AtomicU64 {
        &self.rtt_micros
    }

    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::Relaxed)
            || matches!(&self.conn, Conn::Mux(m) if m.is_draining())
    }

    /// Asks the agent to dial `target`; on success returns the stream's two halves.
    ///
    /// `early` (bytes the client sent behind its request, bounded by the front end's head
    /// limit) leaves right behind the request's HEADERS, before the dial result: the agent
    /// writes it to the target once its dial succeeds and drops it when the dial fails. The
    /// client's first byte then costs no tunnel round trip of its own.
    pub async fn open(
        self: &Arc<Self>,
        target: &Target,
        stream_id: u64,
        timeout: Duration,
        trace_headers: &std::collections::HashMap<String, String>,
        early: &Bytes,
    ) -> Result<(StreamTx, StreamRx, StreamGuard), DialError> {
        let _permit = self.pending.try_acquire().map_err(|_| {
            DialError::new(
                DialErrorKind::Overloaded,
                format!(
                    "too many pending dials on the tunnel of cluster {}",
                    self.cluster
                ),
            )
        })?;
        // The peer's SETTINGS_MAX_CONCURRENT_STREAMS bounds the streams of this connection. h2
        // would queue a request beyond it until some stream closes, so the client would wait out
        // the whole dial budget and get a misleading 504: refuse at once instead.
        let limit = match &self.conn {
            Conn::H2(send) => send.current_max_send_streams(),
            // The agent's limit, from its WINDOW (HTTP/2: its SETTINGS).
            Conn::Mux(m) => m.peer_max_streams(),
        };
        let dialling = self.max_pending - self.pending.available_permits();
        if self.open_streams() + dialling > limit {
            return Err(DialError::new(
                DialErrorKind::Overloaded,
                format!(
                    "the tunnel of cluster {} carries its limit of {limit} concurrent streams",
                    self.cluster
                ),
            ));
        }
        let send = match &self.conn {
            Conn::H2(send) => send,
            Conn::Mux(m) => {
                return self
                    .open_mux(m, target, stream_id, timeout, trace_headers, early)
                    .await;
            }
        };
        let mut req = Request::builder()
            .method(Method::POST)
            .uri(format!("https://tunnel{}", wire::PATH_DIAL))
            .header(wire::HEADER_CLUSTER, &target.cluster)
            .header(wire::HEADER_TARGET, target.wire_dest())
            .header(wire::HEADER_STREAM, unindexed(HeaderValue::from(stream_id)))
            .header(
                wire::HEADER_DIAL_TIMEOUT_MS,
                timeout.as_millis().to_string(),
            );
        for (k, v) in trace_headers {
            let v = HeaderValue::try_from(v.as_str())
                .map_err(|e| DialError::new(DialErrorKind::BadRequest, format!("{k}: {e}")))?;
            req = req.header(k.as_str(), unindexed(v));
        }
        let req = req
            .body(())
            .map_err(|e| DialError::new(DialErrorKind::BadRequest, e.to_string()))?;
        // RFC 9113 §8.7: a stream the agent did not process — refused by its GOAWAY (the stream
        // is above the GOAWAY's last-stream id, or was opened after the GOAWAY arrived) or reset
        // with REFUSED_STREAM — was never seen by the agent's application: nothing was dialled
        // and no early data was delivered. It fails as `NoTunnel`, which Broker::dial sends on
        // to another tunnel. h2 reports a remote GOAWAY on a stream only in those cases; a stream
        // the agent did process ends with its answer or, if the tunnel dies, an I/O error or a
        // reset — `TunnelLost`, never retried (the agent may have dialled and written already).
        let refused = |e: h2::Error| {
            if e.is_go_away() && e.is_remote() {
                // The agent is closing this tunnel (its open streams finish): no new streams
                // are picked for it any more.
                if !self.draining.swap(true, Ordering::Relaxed) {
                    tracing::info!(cluster = %self.cluster, agent = %self.agent, tunnel = self.id, "agent sent GOAWAY: no new streams on this tunnel");
                }
                DialError::new(
                    DialErrorKind::NoTunnel,
                    format!(
                        "the agent of cluster {} is closing this tunnel (GOAWAY) and did not take the stream",
                        self.cluster
                    ),
                )
            } else if e.is_reset()
                && e.is_remote()
                && e.reason() == Some(h2::Reason::REFUSED_STREAM)
            {
                DialError::new(
                    DialErrorKind::NoTunnel,
                    format!(
                        "the agent of cluster {} refused the stream (REFUSED_STREAM)",
                        self.cluster
                    ),
                )
            } else {
                DialError::new(
                    DialErrorKind::TunnelLost,
                    format!("tunnel to cluster {} failed: {e}", self.cluster),
                )
            }
        };
        // The agent enforces the dial timeout and answers 504; the margin covers the round trip.
        let budget = timeout + Duration::from_secs(2);
        let work = async {
            let mut send = send.clone().ready().await.map_err(refused)?;
            let (resp, mut tx) = send.send_request(req, false).map_err(refused)?;
            if !early.is_empty() {
                // Within the stream's initial window (the head limit is far below it); h2
                // queues it behind the HEADERS, both leave in one write of the connection.
                if let Err(e) = tx.send_data(early.clone(), false) {
                    // The stream already ended (e.g. a GOAWAY that did not take it arrived since
                    // send_request): its response says why.
                    return Err(match resp.await {
                        Err(cause) => refused(cause),
                        Ok(_) => refused(e),
                    });
                }
            }
            let resp = resp.await.map_err(refused)?;
            Ok::<_, DialError>((resp, tx))
        };
        let (resp, tx) = tokio::time::timeout(budget, work).await.map_err(|_| {
            DialError::new(
                DialErrorKind::Timeout,
                format!(
                    "no dial answer from cluster {} within {} ms",
                    self.cluster,
                    budget.as_millis()
                ),
            )
        })??;
        if resp.status() != StatusCode::OK {
            let h = |n: &str| {
                resp.headers()
                    .get(n)
                    .and_then(|v| v.to_str().ok())
                    .unwrap_or("")
            };
            let kind = DialErrorKind::from_label(h(wire::HEADER_ERROR));
            let message = h(wire::HEADER_ERROR_MESSAGE);
            return Err(DialError::new(
                kind,
                if message.is_empty() {
                    format!("agent answered {}", resp.status())
                } else {
                    message.to_owned()
                },
            ));
        }
        self.open.fetch_add(1, Ordering::Relaxed);
        Ok((
            tx.into(),
            resp.into_body().into(),
            StreamGuard(Arc::clone(self)),
        ))
    }

    /// [`TunnelHandle::open`] on a `tether-tunnel/2` connection: one `OPEN` frame (with the
    /// early data in the same write), answered by `OPEN_OK` or `OPEN_ERR`.
    async fn open_mux(
        self: &Arc<Self>,
        m: &Mux,
        target: &Target,
        stream_id: u64,
        timeout: Duration,
        trace_headers: &std::collections::HashMap<String, String>,
        early: &Bytes,
    ) -> Result<(StreamTx, StreamRx, StreamGuard), DialError> {
        let open = mux::Open {
            target: target.wire_dest(),
            cluster: target.cluster.clone(),
            tag: stream_id,
            dial_timeout_ms: u32::try_from(timeout.as_millis()).unwrap_or(u32::MAX),
            trace: trace_headers
                .iter()
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect(),
        };
        // The agent enforces the dial timeout and answers; the margin covers the round trip.
        let budget = timeout + Duration::from_secs(2);
        let opened = tokio::time::timeout(budget, m.open(&open, early))
            .await
            .map_err(|_| {
                DialError::new(
                    DialErrorKind::Timeout,
                    format!(
                        "no dial answer from cluster {} within {} ms",
                        self.cluster,
                        budget.as_millis()
                    ),
                )
            })?;
        match opened {
            Ok((tx, rx)) => {
                self.open.fetch_add(1, Ordering::Relaxed);
                Ok((tx.into(), rx.into(), StreamGuard(Arc::clone(self))))
            }
            Err(mux::OpenError::Dial { kind, message }) => Err(DialError::new(
                DialErrorKind::from_label(&kind),
                if message.is_empty() {
                    format!("agent answered {kind}")
                } else {
                    message
                },
            )),
            // Not processed by the agent (refused, GOAWAY): nothing dialled, no early data
            // delivered — Broker::dial sends it on to another tunnel.
            Err(mux::OpenError::NotTaken(why)) => {
                if m.is_draining() && !self.draining.swap(true, Ordering::Relaxed) {
                    tracing::info!(cluster = %self.cluster, agent = %self.agent, tunnel = self.id, "agent sent GOAWAY: no new streams on this tunnel");
                }
                Err(DialError::new(
                    DialErrorKind::NoTunnel,
                    format!(
                        "the agent of cluster {} did not take the stream: {why}",
                        self.cluster
                    ),
                ))
            }
            Err(mux::OpenError::Lost(why)) => Err(DialError::new(
                DialErrorKind::TunnelLost,
                format!("tunnel to cluster {} failed: {why}", self.cluster),
            )),
        }
    }

    /// Tells the agent this broker is draining.
    pub async fn send_drain(&self) {
        self.draining.store(true, Ordering::Relaxed);
        let send = match &self.conn {
            Conn::H2(send) => send,
            Conn::Mux(m) => {
                let work = m.send_control(mux::frame::Kind::Drain, &[]);
                if let Err(e) = tokio::time::timeout(HELLO_TIMEOUT, work).await {
                    tracing::debug!(cluster = %self.cluster, error = %e, "drain notice not sent");
                }
                return;
            }
        };
        let req = Request::builder()
            .method(Method::POST)
            .uri(format!("https://tunnel{}", wire::PATH_DRAIN))
            .body(())
            .expect("valid request");
        let work = async {
            let mut send = send.clone().ready().await?;
            let (resp, _) = send.send_request(req, true)?;
            resp.await
        };
        if let Err(e) = tokio::time::timeout(HELLO_TIMEOUT, work).await {
            tracing::debug!(cluster = %self.cluster, error = %e, "drain notice not answered");
        }
    }
}

/// Sends `REFUSED` with the reason on a `tether-tunnel/2` connection; waits at most
/// [`HELLO_TIMEOUT`].
pub(crate) async fn tell_refused_mux(m: &Mux, reason: &str) {
    let payload = mux::frame::encode_text(reason);
    let work = m.send_control(mux::frame::Kind::Refused, &payload);
    let _ = tokio::time::timeout(HELLO_TIMEOUT, work).await;
}

/// Sends `POST /tether.tunnel.v1/refused` with the reason; waits at most [`HELLO_TIMEOUT`].
pub(crate) async fn tell_refused(send: &SendRequest<Bytes>, reason: &str) {
    let req = Request::builder()
        .method(Method::POST)
        .uri(format!("https://tunnel{}", wire::PATH_REFUSED))
        .header(wire::HEADER_ERROR_MESSAGE, wire::header_safe(reason))
        .body(())
        .expect("valid request");
    let work = async {
        let mut send = send.clone().ready().await?;
        let (resp, _) = send.send_request(req, true)?;
        resp.await
    };
    let _ = tokio::time::timeout(HELLO_TIMEOUT, work).await;
}

#[cfg(test)]
mod tests {
    //! `open` against a hand-written HTTP/2 peer that writes exactly the frames a closing agent
    //! can send, so the race behind them (the agent's last GOAWAY landing after a stream's
    //! HEADERS left) is reproduced every time.
    use super::*;
    use tether_tunnel::address::Target;
    use tokio::io::{AsyncReadExt, AsyncWriteExt, DuplexStream};

    const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
    const HEADERS: u8 = 0x1;
    const SETTINGS: u8 = 0x4;
    const GOAWAY: u8 = 0x7;

    fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
        let len = payload.len() as u32;
        let mut f = vec![(len >> 16) as u8, (len >> 8) as u8, len as u8, kind, flags];
        f.extend_from_slice(&stream.to_be_bytes());
        f.extend_from_slice(payload);
        f
    }

    /// The peer's side up to the first HEADERS: reads the preface, sends its SETTINGS, acks the
    /// broker's; returns the HEADERS' stream id.
    async fn serve_until_headers(io: &mut DuplexStream) -> u32 {
        let mut preface = [0u8; PREFACE.len()];
        io.read_exact(&mut preface).await.expect("preface");
        assert_eq!(preface, PREFACE);
        io.write_all(&frame(SETTINGS, 0, 0, &[])).await.unwrap();
        loop {
            let mut head = [0u8; 9];
            io.read_exact(&mut head).await.expect("frame header");
            let len = u32::from_be_bytes([0, head[0], head[1], head[2]]) as usize;
            let mut payload = vec![0u8; len];
            io.read_exact(&mut payload).await.expect("frame payload");
            let stream = u32::from_be_bytes([head[5], head[6], head[7], head[8]]) & 0x7fff_ffff;
            match head[3] {
                SETTINGS if head[4] & 0x1 == 0 => {
                    io.write_all(&frame(SETTINGS, 0x1, 0, &[])).await.unwrap()
                }
                HEADERS => return stream,
                _ => {}
            }
        }
    }

    async fn handle_to(io: DuplexStream) -> Arc<TunnelHandle> {
        let (send, conn) = h2::client::handshake(io).await.expect("h2 handshake");
        tokio::spawn(async move {
            let _ = conn.await;
        });
        Arc::new(TunnelHandle::new(1, "c1".into(), "agent".into(), send, 8))
    }

    async fn open(handle: &Arc<TunnelHandle>) -> Result<(), DialError> {
        let target = Target::parse("c1:443").expect("target");
        let trace = std::collections::HashMap::new();
        let early = Bytes::from_static(b"GET / HTTP/1.1\r\n\r\n");
        handle
            .open(&target, 7, Duration::from_secs(5), &trace, &early)
            .await
            .map(|_| ())
    }

    /// A stream above the GOAWAY's last-stream id was not processed (RFC 9113 §6.8): it is
    /// `NoTunnel` (Broker::dial tries the next tunnel) and the tunnel is picked no more.
    #[tokio::test]
    async fn a_stream_the_agents_goaway_did_not_take_is_no_tunnel_and_the_tunnel_drains() {
        let (broker_io, mut agent_io) = tokio::io::duplex(64 << 10);
        let agent = tokio::spawn(async move {
            let stream = serve_until_headers(&mut agent_io).await;
            assert_eq!(stream, 1);
            // GOAWAY: last processed stream 0, NO_ERROR — stream 1 arrived after it was decided.
            let mut payload = 0u32.to_be_bytes().to_vec();
            payload.extend_from_slice(&0u32.to_be_bytes());
            agent_io
                .write_all(&frame(GOAWAY, 0, 0, &payload))
                .await
                .unwrap();
            agent_io
        });
        let handle = handle_to(broker_io).await;
        let err = open(&handle)
            .await
            .expect_err("the agent did not take the stream");
        assert_eq!(err.kind, DialErrorKind::NoTunnel, "{err}");
        assert!(err.message.contains("GOAWAY"), "{err}");
        assert!(
            handle.is_draining(),
            "a GOAWAY stops new streams on the tunnel"
        );
        let agent = tokio::time::timeout(Duration::from_secs(10), agent);
        drop(agent.await.expect("the peer task ends").unwrap());
    }

    /// A stream the agent took and then lost with the connection may have been dialled: it is
    /// `TunnelLost`, never retried elsewhere.
    #[tokio::test]
    async fn a_stream_lost_after_the_agent_took_it_is_tunnel_lost() {
        let (broker_io, mut agent_io) = tokio::io::duplex(64 << 10);
        let agent = tokio::spawn(async move {
            serve_until_headers(&mut agent_io).await;
            // The connection ends with the stream taken and unanswered.
        });
        let handle = handle_to(broker_io).await;
        let err = open(&handle).await.expect_err("the tunnel went away");
        assert_eq!(err.kind, DialErrorKind::TunnelLost, "{err}");
        assert!(!handle.is_draining());
        let agent = tokio::time::timeout(Duration::from_secs(10), agent);
        agent.await.expect("the peer task ends").unwrap();
    }
}
