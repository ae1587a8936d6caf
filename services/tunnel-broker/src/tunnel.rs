//! Agent tunnels on the broker side.
//!
//! [`accept_agent`] runs the handshake of one agent connection (TLS with a required client
//! certificate, HTTP/2 client handshake, `hello` identity check). The tunnel is then owned by a
//! [`TunnelActor`]: it registers the [`TunnelHandle`] with the registry, watches the connection
//! and its keepalive (tokio tasks), and deregisters when either ends. Front ends open streams
//! through the handle directly; bytes never pass through an actor.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use actix::prelude::*;
use bytes::Bytes;
use h2::client::SendRequest;
use h2::{RecvStream, SendStream};
use http::{Method, Request, StatusCode};
use tether_tls::Identity;
use tether_tunnel::keepalive::WindowSampling;
use tether_tunnel::window::AdaptiveWindow;
use tether_tunnel::wire::{self, DialErrorKind};
use tether_tunnel::{DialError, Target, TunnelSettings};
use tokio::net::TcpStream;
use tokio::sync::Semaphore;
use tokio_rustls::TlsAcceptor;

use crate::metrics::BrokerMetrics;
use crate::registry::{Deregister, Register, Registry};

/// Time the agent has to answer the `hello` request.
pub const HELLO_TIMEOUT: Duration = Duration::from_secs(5);

/// What front ends use to open streams on one agent tunnel. Cheap to share.
pub struct TunnelHandle {
    pub id: u64,
    pub cluster: String,
    pub agent: String,
    send: SendRequest<Bytes>,
    open: AtomicUsize,
    pending: Semaphore,
    max_pending: usize,
    draining: AtomicBool,
    /// Last HTTP/2 PING round trip on this connection, µs (0 = not measured yet).
    rtt_micros: std::sync::atomic::AtomicU64,
    /// Cancelling it drops the connection (open streams are reset).
    closer: tokio_util::sync::CancellationToken,
    /// The adaptive receive window of this connection (agent tunnels; relays keep theirs fixed).
    window: Option<Arc<AdaptiveWindow>>,
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
        Self {
            id,
            cluster,
            agent,
            send,
            open: AtomicUsize::new(0),
            pending: Semaphore::new(max_pending_dials),
            max_pending: max_pending_dials,
            draining: AtomicBool::new(false),
            rtt_micros: Default::default(),
            closer: Default::default(),
            window: None,
        }
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

    /// Tells the agent why (`refused`, best effort) and closes the connection.
    pub async fn refuse_and_close(&self, reason: &str) {
        tell_refused(&self.send, reason).await;
        self.closer.cancel();
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
    }

    /// Asks the agent to dial `target`; on success returns the stream's two halves.
    pub async fn open(
        self: &Arc<Self>,
        target: &Target,
        stream_id: u64,
        timeout: Duration,
        trace_headers: &std::collections::HashMap<String, String>,
    ) -> Result<(SendStream<Bytes>, RecvStream, StreamGuard), DialError> {
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
        let limit = self.send.current_max_send_streams();
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
        let mut req = Request::builder()
            .method(Method::POST)
            .uri(format!("https://tunnel{}", wire::PATH_DIAL))
            .header(wire::HEADER_CLUSTER, &target.cluster)
            .header(wire::HEADER_TARGET, target.wire_dest())
            .header(wire::HEADER_STREAM, stream_id.to_string())
            .header(
                wire::HEADER_DIAL_TIMEOUT_MS,
                timeout.as_millis().to_string(),
            );
        for (k, v) in trace_headers {
            req = req.header(k.as_str(), v.as_str());
        }
        let req = req
            .body(())
            .map_err(|e| DialError::new(DialErrorKind::BadRequest, e.to_string()))?;
        let lost = |e: h2::Error| {
            DialError::new(
                DialErrorKind::TunnelLost,
                format!("tunnel to cluster {} failed: {e}", self.cluster),
            )
        };
        // The agent enforces the dial timeout and answers 504; the margin covers the round trip.
        let budget = timeout + Duration::from_secs(2);
        let work = async {
            let mut send = self.send.clone().ready().await.map_err(lost)?;
            let (resp, tx) = send.send_request(req, false).map_err(lost)?;
            let resp = resp.await.map_err(lost)?;
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
        Ok((tx, resp.into_body(), StreamGuard(Arc::clone(self))))
    }

    /// Tells the agent this broker is draining.
    pub async fn send_drain(&self) {
        self.draining.store(true, Ordering::Relaxed);
        let req = Request::builder()
            .method(Method::POST)
            .uri(format!("https://tunnel{}", wire::PATH_DRAIN))
            .body(())
            .expect("valid request");
        let work = async {
            let mut send = self.send.clone().ready().await?;
            let (resp, _) = send.send_request(req, true)?;
            resp.await
        };
        if let Err(e) = tokio::time::timeout(HELLO_TIMEOUT, work).await {
            tracing::debug!(cluster = %self.cluster, error = %e, "drain notice not answered");
        }
    }
}

/// Sends `POST /tether.tunnel.v1/refused` with the reason; waits at most [`HELLO_TIMEOUT`].
async fn tell_refused(send: &SendRequest<Bytes>, reason: &str) {
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

/// Shared state of the agent side of the broker.
pub struct AgentSide {
    pub broker_id: String,
    pub acceptor: TlsAcceptor,
    pub settings: TunnelSettings,
    pub max_pending_dials: usize,
    pub registry: Addr<Registry>,
    pub metrics: BrokerMetrics,
    pub arbiter: ArbiterHandle,
    pub next_id: std::sync::atomic::AtomicU64,
    /// The client side, for serving peer brokers' relays (set once at start-up).
    pub broker: std::sync::OnceLock<Arc<crate::dial::Broker>>,
    /// Clusters the hub accepts (checks nothing until synced with the control plane).
    pub clusters: Arc<crate::clusters::ClusterDirectory>,
}

/// Why an agent connection was refused.
#[derive(Debug, thiserror::Error)]
pub enum AcceptError {
    #[error("TLS handshake failed: {0}")]
    Tls(String),
    #[error("handshake timed out after {0:?}")]
    Timeout(Duration),
    #[error("client certificate: {0}")]
    Identity(String),
    #[error("certificate identity {0} is not a tunnel agent")]
    NotAnAgent(String),
    #[error("HTTP/2 handshake failed: {0}")]
    H2(String),
    #[error("agent refused the hello: {0}")]
    IdentityMismatch(String),
    #[error("tunnel refused: {0}")]
    ClusterRefused(String),
}

impl AcceptError {
    pub fn metric_label(&self) -> &'static str {
        match self {
            Self::Tls(_) => "tls_error",
            Self::Timeout(_) => "timeout",
            Self::Identity(_) | Self::NotAnAgent(_) => "bad_identity",
            Self::H2(_) => "h2_error",
            Self::IdentityMismatch(_) => "identity_mismatch",
            Self::ClusterRefused(_) => "cluster_refused",
        }
    }
}

/// Runs the handshake of one connection on the agent listener: an agent's tunnel (handed to a
/// new [`TunnelActor`]) or, with ALPN `tether-relay/1`, a peer broker's relay connection.
pub async fn accept_agent(side: Arc<AgentSide>, tcp: TcpStream) -> Result<(), AcceptError> {
    let _ = tcp.set_nodelay(true);
    let hs = side.settings.handshake_timeout;
    // rustls asks its transport for a few KiB per read; reading the socket in 64 KiB pieces
    // (a buffer held only while data flows) cuts the `recv` calls ~4×.
    let tcp = tether_tunnel::readahead::ReadAhead::new(tcp);
    let tls = tokio::time::timeout(hs, side.acceptor.accept(tcp))
        .await
        .map_err(|_| AcceptError::Timeout(hs))?
        .map_err(|e| AcceptError::Tls(e.to_string()))?;
    if tls.get_ref().1.alpn_protocol() == Some(tether_tls::ALPN_RELAY) {
        let cert = tls
            .get_ref()
            .1
            .peer_certificates()
            .and_then(|c| c.first().cloned());
        let peer = cert
            .map(|c| Identity::from_certificate(&c))
            .transpose()
            .map_err(|e| AcceptError::Identity(e.to_string()))?;
        let Some(Identity::Broker { id }) = peer else {
            return Err(AcceptError::NotAnAgent(
                "relay connection without a broker certificate".into(),
            ));
        };
        let Some(broker) = side.broker.get().cloned() else {
            return Err(AcceptError::H2("broker not ready for relays".into()));
        };
        tokio::spawn(crate::peers::serve_relay(broker, tls, id));
        return Ok(());
    }
    let cert = tls
        .get_ref()
        .1
        .peer_certificates()
        .and_then(|c| c.first().cloned())
        .ok_or_else(|| AcceptError::Identity("no client certificate".into()))?;
    let identity =
        Identity::from_certificate(&cert).map_err(|e| AcceptError::Identity(e.to_string()))?;
    let (cluster, agent) = match &identity {
        Identity::AddonAgent {
            cluster,
            addon,
            agent,
        } if addon == tether_tls::identity::TUNNEL_ADDON => (cluster.clone(), agent.clone()),
        other => return Err(AcceptError::NotAnAgent(other.to_string())),
    };
    // The read-ahead below TLS counts received bytes for the adaptive receive window (see
    // tether_tunnel::window).
    let window = side.settings.adaptive_window();
    let mut tls = tls;
    tls.get_mut().0.count_into(Arc::clone(&window));
    let (send, mut conn) = tokio::time::timeout(
        hs,
        side.settings.client_builder().handshake::<_, Bytes>(tls),
    )
    .await
    .map_err(|_| AcceptError::Timeout(hs))?
    .map_err(|e| AcceptError::H2(e.to_string()))?;
    let ping_pong = conn.ping_pong().expect("ping_pong taken once");
    let (closed_tx, closed_rx) = tokio::sync::oneshot::channel::<String>();
    let closer = tokio_util::sync::CancellationToken::new();
    let conn_closer = closer.clone();
    let mut window_rx = window.changed();
    let conn_cluster = cluster.clone();
    tokio::spawn(async move {
        let reason = loop {
            tokio::select! {
                r = &mut conn => break match r {
                    Ok(()) => "closed".to_owned(),
                    Err(e) => e.to_string(),
                },
                _ = conn_closer.cancelled() => break "closed by the broker".to_owned(),
                Ok(()) = window_rx.changed() => {
                    let w = *window_rx.borrow_and_update();
                    match conn.set_initial_window_size(w) {
                        Ok(()) => tracing::debug!(cluster = %conn_cluster, stream_window_bytes = w, "tunnel receive window changed"),
                        Err(e) => tracing::warn!(cluster = %conn_cluster, error = %e, "cannot change the tunnel's receive window"),
                    }
                }
            }
        };
        let _ = closed_tx.send(reason);
    });
    if let Err(reason) = side.clusters.admit(&cluster) {
        tell_refused(&send, &reason).await;
        closer.cancel();
        return Err(AcceptError::ClusterRefused(reason));
    }
    // hello: tell the agent who its certificate says it is; it refuses if that is not its cluster.
    let hello = Request::builder()
        .method(Method::POST)
        .uri(format!("https://tunnel{}", wire::PATH_HELLO))
        .header(wire::HEADER_CLUSTER, &cluster)
        .header(wire::HEADER_AGENT, &agent)
        .header("tether-broker", &side.broker_id)
        .body(())
        .expect("valid request");
    let answer = tokio::time::timeout(HELLO_TIMEOUT, async {
        let mut s = send.clone().ready().await?;
        let (resp, _) = s.send_request(hello, true)?;
        resp.await
    })
    .await
    .map_err(|_| AcceptError::Timeout(HELLO_TIMEOUT))?
    .map_err(|e| AcceptError::H2(e.to_string()))?;
    if answer.status() != StatusCode::OK {
        let msg = answer
            .headers()
            .get(wire::HEADER_ERROR_MESSAGE)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("no reason given")
            .to_owned();
        return Err(AcceptError::IdentityMismatch(format!("{identity}: {msg}")));
    }
    let handle = Arc::new(
        TunnelHandle::new(
            side.next_id.fetch_add(1, Ordering::Relaxed),
            cluster,
            agent,
            send,
            side.max_pending_dials,
        )
        .with_closer(closer)
        .with_window(Arc::clone(&window)),
    );
    let actor = TunnelActor {
        handle,
        registry: side.registry.clone(),
        keepalive: Some((
            ping_pong,
            side.settings.keepalive_interval,
            side.settings.keepalive_timeout,
        )),
        sampling: Some(WindowSampling {
            window,
            changes: Some(side.metrics.tunnel_window_changes.clone()),
        }),
        closed: Some(closed_rx),
    };
    TunnelActor::start_in_arbiter(&side.arbiter, move |_| actor);
    Ok(())
}

/// Owns one registered tunnel for its lifetime.
pub struct TunnelActor {
    handle: Arc<TunnelHandle>,
    registry: Addr<Registry>,
    keepalive: Option<(h2::PingPong, Duration, Duration)>,
    sampling: Option<WindowSampling>,
    closed: Option<tokio::sync::oneshot::Receiver<String>>,
}

#[derive(Message)]
#[rtype(result = "()")]
struct Ended(String);

impl Actor for TunnelActor {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Self::Context) {
        self.registry.do_send(Register(Arc::clone(&self.handle)));
        let (pp, interval, timeout) = self.keepalive.take().expect("started once");
        let closed = self.closed.take().expect("started once");
        let sampling = self.sampling.take();
        let me = ctx.address();
        let cluster = self.handle.cluster.clone();
        let id = self.handle.id;
        let handle = Arc::clone(&self.handle);
        tokio::spawn(async move {
            let reason = tokio::select! {
                r = closed => r.unwrap_or_else(|_| "connection task ended".into()),
                e = tether_tunnel::keepalive::run_adaptive(pp, interval, timeout, handle.rtt_cell(), sampling) => e.to_string(),
            };
            tracing::info!(%cluster, tunnel = id, %reason, "tunnel connection ended");
            me.do_send(Ended(reason));
        });
    }

    fn stopped(&mut self, _: &mut Self::Context) {
        self.registry.do_send(Deregister {
            cluster: self.handle.cluster.clone(),
            tunnel_id: self.handle.id,
        });
    }
}

impl Handler<Ended> for TunnelActor {
    type Result = ();
    fn handle(&mut self, msg: Ended, ctx: &mut Context<Self>) {
        tracing::debug!(cluster = %self.handle.cluster, tunnel = self.handle.id, reason = %msg.0, "stopping tunnel actor");
        ctx.stop();
    }
}
