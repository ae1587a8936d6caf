//! One tunnel: TCP + TLS to a broker, then the accepting end of `tether-tunnel/2` (the
//! multiplexer, `tether_tunnel::mux`) or, with a broker that lacks it, an HTTP/2 *server*
//! (`tether-tunnel/1`) on that connection.
//!
//! [`run_tunnel`] returns when the connection ends; the connector actor decides what next.
//! `hello` (identity check) and `drain` (the broker is leaving) are handled by the tunnel's
//! loop; each `dial` runs in its own task (dial the target, answer, then splice bytes), the same
//! for both protocols ([`serve_dial`]).

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use h2::server::SendResponse;
use http::{Request, Response, StatusCode};
use tether_tunnel::pump::{ByteCounters, TcpChunkReader, splice};
use tether_tunnel::stream_io::StreamIo;
use tether_tunnel::wire::{self, DialErrorKind, header_safe};
use tether_tunnel::{DialError, StreamRx, StreamTx, TunnelSettings};
use tokio::net::TcpStream;
use tokio::sync::mpsc;
use tokio_rustls::TlsConnector;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::config::TargetPolicy;
use crate::metrics::AgentMetrics;

/// Everything a tunnel needs that outlives it. Shared by all tunnels of the agent.
pub struct AgentShared {
    pub cluster: String,
    pub agent: String,
    pub apiserver: String,
    pub policy: TargetPolicy,
    pub max_dial_timeout: Duration,
    /// Target names to addresses, with a short cache (`dns_cache`).
    pub resolver: crate::resolve::Resolver,
    pub settings: TunnelSettings,
    pub metrics: AgentMetrics,
    pub counters: ByteCounters,
    /// Forward proxy settings for reaching brokers.
    pub proxy: tether_proxy::ProxySettings,
    /// Trust anchors for an https:// proxy's certificate.
    pub proxy_roots: Arc<rustls::RootCertStore>,
    /// The agent end of the HTTP service proxy (`service_proxy` in the config).
    pub service_proxy: Option<Arc<crate::service_proxy::ServiceProxy>>,
}

impl AgentShared {
    /// Splices a broker's stream with a target's bytes (`rd`, `wr`), counted in
    /// `tether_agent_open_streams` while it runs; returns how it ended.
    async fn splice<R, W>(
        &self,
        rd: R,
        wr: W,
        send: StreamTx,
        recv: StreamRx,
    ) -> Result<tether_tunnel::pump::SpliceStats, tether_tunnel::pump::SpliceError>
    where
        R: tether_tunnel::pump::ChunkReader,
        W: tether_tunnel::pump::AbortableWrite,
    {
        self.metrics.open_streams.inc();
        let r = splice(
            rd,
            wr,
            send,
            recv,
            self.settings.write_stall_timeout,
            &self.counters,
        )
        .await;
        self.metrics.open_streams.dec();
        r
    }
}

/// Events a tunnel reports to its connector.
#[derive(Debug)]
pub enum TunnelEvent {
    /// TLS is up: the broker's certificate (chain checked against the hub CA, name checked
    /// against the endpoint's `server_name`). Sent before `Established`.
    Authenticated {
        certificate: rustls::pki_types::CertificateDer<'static>,
    },
    /// The broker checked our identity: the tunnel carries traffic now.
    Established { broker: String },
    /// The broker asked agents to move elsewhere.
    Drain,
}

/// Why a tunnel ended.
#[derive(Debug, thiserror::Error)]
pub enum TunnelError {
    #[error("connect to {addr} failed: {reason}")]
    Connect { addr: String, reason: String },
    #[error("cannot reach broker {addr} through proxy {proxy}: {reason}")]
    Proxy {
        addr: String,
        proxy: String,
        reason: String,
    },
    #[error("TLS handshake with {addr} failed: {reason}")]
    Tls { addr: String, reason: String },
    #[error("HTTP/2 handshake with {addr} failed: {reason}")]
    H2 { addr: String, reason: String },
    #[error("broker identifies us as {seen}, but this agent is configured as {configured}")]
    IdentityMismatch { seen: String, configured: String },
    /// The hub does not accept this cluster (not registered, not accepted, or deleted); the
    /// connector keeps retrying with its growing backoff, so acceptance takes effect by itself.
    #[error("broker refused the tunnel: {0}")]
    Refused(String),
    #[error("connection lost: {0}")]
    Lost(String),
    #[error("broker did not answer keepalive: {0}")]
    Keepalive(String),
    /// The wedged-tunnel watchdog fired (tether_tunnel::watchdog).
    #[error("{0}")]
    Wedged(String),
}

impl TunnelError {
    pub fn metric_label(&self) -> &'static str {
        match self {
            Self::Connect { .. } => "connect_error",
            Self::Proxy { .. } => "proxy_error",
            Self::Tls { .. } => "tls_error",
            Self::H2 { .. } => "h2_error",
            Self::IdentityMismatch { .. } => "identity_mismatch",
            Self::Refused(_) => "refused",
            Self::Lost(_) => "lost",
            Self::Keepalive(_) => "keepalive_timeout",
            Self::Wedged(_) => "wedged",
        }
    }
}

/// Connects to `addr` and serves the tunnel until it ends or `shutdown` fires (then the
/// tunnel drains: GOAWAY, open streams get `grace`).
pub async fn run_tunnel(
    addr: String,
    server_name: rustls::pki_types::ServerName<'static>,
    connector: TlsConnector,
    shared: Arc<AgentShared>,
    events: mpsc::Sender<TunnelEvent>,
    shutdown: CancellationToken,
    grace: Duration,
) -> Result<(), TunnelError> {
    let hs = shared.settings.handshake_timeout;
    let tcp = connect_transport(&addr, &shared).await?;
    // The wedged-tunnel watchdog sees the socket itself, below TLS and every buffer.
    let progress = tether_tunnel::watchdog::Progress::new();
    let watchdog = tether_tunnel::watchdog::Watchdog::new(
        Arc::clone(&progress),
        shared.settings.stall_timeout,
    )
    .named(format!("cluster {} to broker {addr}", shared.cluster));
    let tcp = tether_tunnel::watchdog::ProgressIo::new(tcp, Arc::clone(&progress));
    // rustls asks its transport for a few KiB per read; reading the socket in 64 KiB pieces
    // (a buffer held only while data flows) cuts the `recv` calls ~4×.
    // It also counts received bytes for the adaptive receive window (tether_tunnel::window).
    let window = shared.settings.adaptive_window();
    // A drained tunnel's close waits for the broker's EOF: closing with its WINDOW_UPDATEs
    // unread would be a reset that destroys our last DATA frames (tether_tunnel::lingering).
    let tcp = tether_tunnel::lingering::LingeringClose::new(
        tcp,
        tether_tunnel::lingering::LINGER_TIMEOUT,
    );
    let mut tcp = tether_tunnel::readahead::ReadAhead::new(tcp);
    tcp.count_into(Arc::clone(&window));
    let tls = within(hs, connector.connect(server_name, tcp), |reason| {
        TunnelError::Tls {
            addr: addr.clone(),
            reason,
        }
    })
    .await?;
    // A 256 KiB frame goes to the socket in one write, not in rustls's default 64 KiB pieces.
    let mut tls = tls;
    tls.get_mut()
        .1
        .set_buffer_limit(shared.settings.tls_send_buffer());
    if let Some(certificate) = tls.get_ref().1.peer_certificates().and_then(|c| c.first()) {
        let _ = events
            .send(TunnelEvent::Authenticated {
                certificate: certificate.clone().into_owned(),
            })
            .await;
    }
    if tls.get_ref().1.alpn_protocol() == Some(tether_tls::ALPN_TUNNEL_V2) {
        let mux = MuxTunnel {
            addr,
            shared,
            events,
            shutdown,
            grace,
            window,
            progress,
            watchdog,
        };
        return mux.run(tls).await;
    }
    let handshake = shared.settings.server_builder().handshake::<_, Bytes>(tls);
    let mut conn = within(hs, handshake, |reason| TunnelError::H2 {
        addr: addr.clone(),
        reason,
    })
    .await?;
    let rtt = std::sync::atomic::AtomicU64::new(0);
    let pinger = conn.ping_pong().expect("ping_pong taken once").into();
    let keepalive = keepalive(&shared, pinger, &window, &progress, &rtt);
    tokio::pin!(keepalive);
    let wedged = watchdog.run();
    tokio::pin!(wedged);
    let mut window_rx = window.changed();
    let (mismatch_tx, mut mismatch_rx) = mpsc::channel::<TunnelError>(1);
    let mut draining_since: Option<Instant> = None;
    loop {
        let grace_left = draining_since.map(|t| grace.saturating_sub(t.elapsed()));
        tokio::select! {
            req = conn.accept() => match req {
                Some(Ok((req, respond))) => {
                    let shared = Arc::clone(&shared);
                    let events = events.clone();
                    let mismatch_tx = mismatch_tx.clone();
                    tokio::spawn(handle_request(req, respond, shared, events, mismatch_tx));
                }
                Some(Err(e)) => return Err(TunnelError::Lost(e.to_string())),
                None => return Ok(()),
            },
            e = &mut keepalive => {
                if matches!(e, tether_tunnel::keepalive::KeepaliveError::Timeout(_)) {
                    shared.metrics.tunnel_wedged.with_label_values(&["keepalive"]).inc();
                }
                return Err(TunnelError::Keepalive(e.to_string()));
            }
            w = &mut wedged => {
                // Dropping the connection ends its streams with an error; the connector redials.
                shared.metrics.tunnel_wedged.with_label_values(&["watchdog"]).inc();
                tracing::warn!(%addr, reason = %w, "tunnel wedged: tearing it down");
                return Err(TunnelError::Wedged(w.to_string()));
            }
            Ok(()) = window_rx.changed() => {
                let w = *window_rx.borrow_and_update();
                match conn.set_initial_window_size(w) {
                    Ok(()) => tracing::debug!(%addr, stream_window_bytes = w, "tunnel receive window changed"),
                    Err(e) => tracing::warn!(%addr, error = %e, "cannot change the tunnel's receive window"),
                }
            }
            Some(e) = mismatch_rx.recv() => {
                conn.abrupt_shutdown(h2::Reason::REFUSED_STREAM);
                let _ = tokio::time::timeout(hs, std::future::poll_fn(|cx| conn.poll_closed(cx))).await;
                return Err(e);
            }
            _ = shutdown.cancelled(), if draining_since.is_none() => {
                conn.graceful_shutdown();
                draining_since = Some(Instant::now());
            }
            _ = tokio::time::sleep(grace_left.unwrap_or(Duration::MAX)), if grace_left.is_some() => {
                // Streams still open after the grace are reset; the GOAWAY is flushed (bounded)
                // so the broker learns why instead of seeing the connection vanish.
                conn.abrupt_shutdown(h2::Reason::NO_ERROR);
                let _ = tokio::time::timeout(hs, std::future::poll_fn(|cx| conn.poll_closed(cx))).await;
                return Ok(());
            }
        }
    }
}

/// The tunnel's PING loop (liveness, round trip, adaptive-window samples), either protocol.
fn keepalive<'a>(
    shared: &'a AgentShared,
    pinger: tether_tunnel::keepalive::Pinger,
    window: &Arc<tether_tunnel::window::AdaptiveWindow>,
    progress: &'a tether_tunnel::watchdog::Progress,
    rtt: &'a std::sync::atomic::AtomicU64,
) -> impl std::future::Future<Output = tether_tunnel::keepalive::KeepaliveError> + 'a {
    tether_tunnel::keepalive::run_probed(
        pinger,
        shared.settings.keepalive_interval,
        shared.settings.keepalive_timeout,
        rtt,
        Some(tether_tunnel::keepalive::WindowSampling {
            window: Arc::clone(window),
            changes: Some(shared.metrics.tunnel_window_changes.clone()),
        }),
        Some(progress),
    )
}

/// A tunnel on `tether-tunnel/2`: everything [`run_tunnel`] set up below the protocol.
struct MuxTunnel {
    addr: String,
    shared: Arc<AgentShared>,
    events: mpsc::Sender<TunnelEvent>,
    shutdown: CancellationToken,
    grace: Duration,
    window: Arc<tether_tunnel::window::AdaptiveWindow>,
    progress: Arc<tether_tunnel::watchdog::Progress>,
    watchdog: tether_tunnel::watchdog::Watchdog,
}

impl MuxTunnel {
    /// Serves the connection until it ends: the reader spawns each `OPEN`'s handler itself;
    /// this loop answers `HELLO`, passes on `DRAIN` and `REFUSED`, and runs the keepalive,
    /// the watchdog, the adaptive window and the graceful close (GOAWAY, then the streams get
    /// `grace`).
    async fn run<T>(self, tls: T) -> Result<(), TunnelError>
    where
        T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Send + 'static,
    {
        use tether_tunnel::mux::{self, Event, frame};
        let Self {
            addr,
            shared,
            events,
            shutdown,
            grace,
            window,
            progress,
            watchdog,
        } = self;
        let hs = shared.settings.handshake_timeout;
        let for_streams = Arc::clone(&shared);
        let on_open: mux::OnOpen = Arc::new(move |incoming: mux::Incoming| {
            tokio::spawn(handle_mux_dial(incoming, Arc::clone(&for_streams)));
        });
        let cfg = mux::Config::from_settings(&shared.settings);
        let (conn, driver, mut conn_events) =
            mux::connect(tls, mux::Role::Acceptor, cfg, Some(on_open));
        // The driver (reader and flusher) is a task of its own: it keeps reading, answering
        // PINGs and taking credit while this loop awaits a write (GOAWAY, HELLO_OK) or the
        // connector. Dropping the handle (this future dropped) aborts it and ends the
        // connection.
        let mut run = tokio_util::task::AbortOnDropHandle::new(tokio::spawn(driver.run()));
        let rtt = std::sync::atomic::AtomicU64::new(0);
        let pinger = tether_tunnel::keepalive::Pinger::Mux(conn.clone());
        let keepalive = keepalive(&shared, pinger, &window, &progress, &rtt);
        tokio::pin!(keepalive);
        let wedged = watchdog.run();
        tokio::pin!(wedged);
        let mut window_rx = window.changed();
        let mut draining_since: Option<Instant> = None;
        // Closed by us: only the driver's clean close (bounded by the lingering close) is left.
        let mut closing = false;
        loop {
            let grace_left = draining_since
                .filter(|_| !closing)
                .map(|t| grace.saturating_sub(t.elapsed()));
            tokio::select! {
                reason = &mut run => {
                    let reason = reason.unwrap_or_else(|e| format!("tunnel connection task failed: {e}"));
                    return if reason == mux::PEER_CLOSED || draining_since.is_some() {
                        Ok(())
                    } else {
                        Err(TunnelError::Lost(reason))
                    };
                }
                Some(ev) = conn_events.recv() => match ev {
                    Event::Hello(hello) => {
                        if hello.cluster != shared.cluster {
                            let msg = format!(
                                "certificate names cluster {:?}, agent is configured for {:?}",
                                hello.cluster, shared.cluster
                            );
                            tracing::error!(broker = %hello.broker, "{msg}");
                            let payload = frame::encode_text(&msg);
                            let refused = conn.send_control(frame::Kind::Refused, &payload);
                            let _ = tokio::time::timeout(hs, refused).await;
                            conn.close("identity mismatch");
                            return Err(TunnelError::IdentityMismatch {
                                seen: format!("cluster {} agent {}", hello.cluster, hello.agent),
                                configured: format!("cluster {}", shared.cluster),
                            });
                        }
                        let payload = frame::encode_pair(&shared.cluster, &shared.agent);
                        if let Err(e) = conn.send_control(frame::Kind::HelloOk, &payload).await {
                            return Err(TunnelError::Lost(e.to_string()));
                        }
                        let _ = events.send(TunnelEvent::Established { broker: hello.broker }).await;
                    }
                    Event::Refused(reason) => {
                        tracing::error!(cluster = %shared.cluster, %reason, "broker refused this cluster's tunnel");
                        conn.close("refused by the broker");
                        return Err(TunnelError::Refused(reason));
                    }
                    Event::Drain => {
                        let _ = events.send(TunnelEvent::Drain).await;
                    }
                    Event::HelloOk { .. } | Event::GoAway { .. } => {
                        tracing::debug!(%addr, event = ?ev, "unexpected tunnel event from the broker");
                    }
                },
                e = &mut keepalive => {
                    if matches!(e, tether_tunnel::keepalive::KeepaliveError::Timeout(_)) {
                        shared.metrics.tunnel_wedged.with_label_values(&["keepalive"]).inc();
                    }
                    conn.close(e.to_string());
                    return Err(TunnelError::Keepalive(e.to_string()));
                }
                w = &mut wedged => {
                    shared.metrics.tunnel_wedged.with_label_values(&["watchdog"]).inc();
                    tracing::warn!(%addr, reason = %w, "tunnel wedged: tearing it down");
                    conn.close(w.to_string());
                    return Err(TunnelError::Wedged(w.to_string()));
                }
                Ok(()) = window_rx.changed() => {
                    let w = *window_rx.borrow_and_update();
                    conn.set_recv_window(w);
                    tracing::debug!(%addr, stream_window_bytes = w, "tunnel receive window changed");
                }
                _ = shutdown.cancelled(), if draining_since.is_none() => {
                    let _ = tokio::time::timeout(hs, conn.go_away("agent shutting down")).await;
                    draining_since = Some(Instant::now());
                }
                () = conn.idle(), if draining_since.is_some() && !closing => {
                    // Every stream ended: close cleanly (close_notify, FIN, lingering).
                    conn.close("drained");
                    closing = true;
                }
                _ = tokio::time::sleep(grace_left.unwrap_or(Duration::MAX)), if grace_left.is_some() => {
                    // Streams still open after the grace are reset.
                    conn.close(format!("drain grace of {grace:?} over"));
                    closing = true;
                }
            }
        }
    }
}

/// A `tether-tunnel/2` dial: the `OPEN`'s fields, then [`serve_dial`] as for HTTP/2.
async fn handle_mux_dial(incoming: tether_tunnel::mux::Incoming, shared: Arc<AgentShared>) {
    let tether_tunnel::mux::Incoming {
        open,
        auth: _,
        responder,
        send,
        recv,
    } = incoming;
    let span = tracing::info_span!("agent_stream", cluster = %shared.cluster, stream = open.tag, target = %open.target);
    tether_telemetry::propagation::set_parent(&span, open.trace_context());
    let timeout = match open.dial_timeout_ms {
        0 => shared.max_dial_timeout,
        ms => Duration::from_millis(u64::from(ms)).min(shared.max_dial_timeout),
    };
    serve_dial(
        open.target,
        timeout,
        Answer::Mux(responder, send),
        recv.into(),
        shared,
    )
    .instrument(span)
    .await
}

/// TCP to the broker, directly or through the forward proxy that applies to it.
async fn connect_transport(
    addr: &str,
    shared: &AgentShared,
) -> Result<Box<dyn tether_proxy::ProxyStream>, TunnelError> {
    let hs = shared.settings.handshake_timeout;
    let (host, port) = addr
        .rsplit_once(':')
        .and_then(|(h, p)| {
            Some((
                h.trim_start_matches('[').trim_end_matches(']'),
                p.parse::<u16>().ok()?,
            ))
        })
        .ok_or_else(|| TunnelError::Connect {
            addr: addr.to_owned(),
            reason: "not host:port".into(),
        })?;
    if let Some(proxy) = shared.proxy.proxy_for(host, port, true) {
        let dialer = tether_proxy::ProxyDialer::new(proxy.clone(), Arc::clone(&shared.proxy_roots))
            .with_timeouts(hs, hs);
        return dialer
            .dial(host, port)
            .await
            .map_err(|e| TunnelError::Proxy {
                addr: addr.to_owned(),
                proxy: proxy.to_string(),
                reason: e.to_string(),
            });
    }
    let s = within(hs, TcpStream::connect(addr), |reason| {
        TunnelError::Connect {
            addr: addr.to_owned(),
            reason,
        }
    })
    .await?;
    let _ = s.set_nodelay(true);
    shared.settings.limit_unsent(&s);
    Ok(Box::new(s))
}

/// `step` bounded by `limit` (a handshake step); its failure, or "timed out after …", as the
/// `reason` of the error `err` builds.
async fn within<T, E: std::fmt::Display>(
    limit: Duration,
    step: impl std::future::Future<Output = Result<T, E>>,
    err: impl FnOnce(String) -> TunnelError,
) -> Result<T, TunnelError> {
    match tokio::time::timeout(limit, step).await {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(err(e.to_string())),
        Err(_) => Err(err(format!("timed out after {limit:?}"))),
    }
}

async fn handle_request(
    req: Request<h2::RecvStream>,
    mut respond: SendResponse<Bytes>,
    shared: Arc<AgentShared>,
    events: mpsc::Sender<TunnelEvent>,
    mismatch: mpsc::Sender<TunnelError>,
) {
    match req.uri().path() {
        wire::PATH_DIAL => handle_dial(req, respond, shared).await,
        wire::PATH_HELLO => {
            let h = |n: &str| header(&req, n);
            let (seen_cluster, seen_agent) = (h(wire::HEADER_CLUSTER), h(wire::HEADER_AGENT));
            let broker = h("tether-broker");
            if seen_cluster != shared.cluster {
                let msg = format!(
                    "certificate names cluster {seen_cluster:?}, agent is configured for {:?}",
                    shared.cluster
                );
                tracing::error!(%broker, "{msg}");
                let resp = Response::builder()
                    .status(StatusCode::FORBIDDEN)
                    .header(wire::HEADER_ERROR_MESSAGE, header_safe(&msg))
                    .body(())
                    .expect("valid response");
                let _ = respond.send_response(resp, true);
                let _ = mismatch
                    .send(TunnelError::IdentityMismatch {
                        seen: format!("cluster {seen_cluster} agent {seen_agent}"),
                        configured: format!("cluster {}", shared.cluster),
                    })
                    .await;
                return;
            }
            let resp = Response::builder()
                .status(StatusCode::OK)
                .header(wire::HEADER_CLUSTER, &shared.cluster)
                .header(wire::HEADER_AGENT, &shared.agent)
                .body(())
                .expect("valid response");
            let _ = respond.send_response(resp, true);
            let _ = events.send(TunnelEvent::Established { broker }).await;
        }
        wire::PATH_REFUSED => {
            let reason = req
                .headers()
                .get(wire::HEADER_ERROR_MESSAGE)
                .and_then(|v| v.to_str().ok())
                .unwrap_or("no reason given")
                .to_owned();
            tracing::error!(cluster = %shared.cluster, %reason, "broker refused this cluster's tunnel");
            let _ = respond.send_response(Response::new(()), true);
            let _ = mismatch.send(TunnelError::Refused(reason)).await;
        }
        wire::PATH_DRAIN => {
            let _ = respond.send_response(Response::new(()), true);
            let _ = events.send(TunnelEvent::Drain).await;
        }
        other => {
            tracing::warn!(path = other, "unknown tunnel request");
            respond.send_reset(h2::Reason::REFUSED_STREAM);
        }
    }
}

/// Header `name` of a broker's request as text ("" when absent or not text).
fn header<B>(req: &Request<B>, name: &str) -> String {
    req.headers()
        .get(name)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_owned()
}

async fn handle_dial(
    req: Request<h2::RecvStream>,
    respond: SendResponse<Bytes>,
    shared: Arc<AgentShared>,
) {
    let h = |n: &str| header(&req, n);
    let target = h(wire::HEADER_TARGET);
    let stream_id = h(wire::HEADER_STREAM);
    let span = tracing::info_span!("agent_stream", cluster = %shared.cluster, stream = %stream_id, target = %target);
    tether_telemetry::propagation::set_parent(
        &span,
        tether_telemetry::propagation::header_pairs(req.headers()),
    );
    let timeout = h(wire::HEADER_DIAL_TIMEOUT_MS)
        .parse::<u64>()
        .map(Duration::from_millis)
        .unwrap_or(shared.max_dial_timeout)
        .min(shared.max_dial_timeout);
    let body = StreamRx::from(req.into_body());
    serve_dial(target, timeout, Answer::H2(respond), body, shared)
        .instrument(span)
        .await
}

/// How the agent answers a dial: an HTTP/2 response (`tether-tunnel/1`), or `OPEN_OK` /
/// `OPEN_ERR` (`tether-tunnel/2`, whose stream exists before the answer).
enum Answer {
    H2(SendResponse<Bytes>),
    Mux(tether_tunnel::mux::Responder, tether_tunnel::mux::SendHalf),
}

impl Answer {
    /// The dial succeeded: the stream's sending half, unless the broker went away.
    async fn ok(self) -> Option<StreamTx> {
        match self {
            Self::H2(mut respond) => match respond.send_response(Response::new(()), false) {
                Ok(s) => Some(s.into()),
                Err(e) => {
                    tracing::debug!(error = %e, "broker went away before the dial answer");
                    None
                }
            },
            Self::Mux(responder, send) => match responder.ok().await {
                Ok(()) => Some(send.into()),
                Err(e) => {
                    tracing::debug!(error = %e, "broker went away before the dial answer");
                    None
                }
            },
        }
    }

    async fn fail(self, e: &DialError) {
        match self {
            Self::H2(mut respond) => {
                let _ = respond.send_response(wire::error_response(e), true);
            }
            Self::Mux(responder, _send) => {
                let _ = responder.fail(e.kind.metric_label(), &e.message).await;
            }
        }
    }
}

/// Dials `target` for a broker's stream, answers, then splices (either protocol). Runs in the
/// stream's span.
async fn serve_dial(
    target: String,
    timeout: Duration,
    answer: Answer,
    mut body: StreamRx,
    shared: Arc<AgentShared>,
) {
    async move {
        if target == wire::SERVICE_PROXY_DEST {
            return serve_service_proxy(answer, body, &shared).await;
        }
        let started = Instant::now();
        let dialled = dial(&shared, &target, timeout).await;
        shared
            .metrics
            .dial_duration
            .observe(started.elapsed().as_secs_f64());
        let tcp = match dialled {
            Ok(s) => s,
            Err(e) => {
                shared
                    .metrics
                    .dial_failures
                    .with_label_values(&[e.kind.metric_label()])
                    .inc();
                tracing::info!(reason = %e, "dial failed");
                answer.fail(&e).await;
                return;
            }
        };
        if let Err(e) = write_early_data(&tcp, &mut body, &shared.counters, timeout).await {
            tracing::info!(error = %e, "target refused the early data");
            let e = DialError::new(DialErrorKind::Refused, format!("writing to {target}: {e}"));
            answer.fail(&e).await;
            return;
        }
        let Some(send) = answer.ok().await else {
            return;
        };
        let (rd, wr) = tcp.into_split();
        let result = shared
            .splice(
                TcpChunkReader::new(rd, shared.settings.read_chunk_bytes),
                tether_tunnel::pump::ResettableWriteHalf::new(wr),
                send,
                body,
            )
            .await;
        let label = match &result {
            Ok(_) => "ok",
            Err(e) => e.reason.metric_label(),
        };
        shared
            .metrics
            .stream_duration
            .with_label_values(&[label])
            .observe(started.elapsed().as_secs_f64());
        match result {
            Ok(s) => tracing::debug!(
                to_target = s.from_tunnel_bytes,
                from_target = s.to_tunnel_bytes,
                "stream closed"
            ),
            Err(e) => tracing::info!(reason = %e.reason, "stream aborted"),
        }
    }
    .await
}

/// Early data (bytes the client sent behind its request; they arrive with the dial request) is
/// written to the target right after the dial, before the answer goes back: straight to the
/// just-connected socket, whose send buffer is empty, without waiting for the reactor's first
/// writable event — the target can answer while the `200` travels. Bytes not there yet are left
/// to the splice; what does not fit the send buffer waits for the reactor, within `timeout`.
async fn write_early_data(
    tcp: &TcpStream,
    body: &mut StreamRx,
    counters: &ByteCounters,
    timeout: Duration,
) -> std::io::Result<()> {
    use futures::FutureExt as _;
    let Some(Some(Ok(early))) = body.data().now_or_never() else {
        return Ok(());
    };
    use std::io::ErrorKind::{Interrupted, WouldBlock};
    let mut sent = match socket2::SockRef::from(tcp).send(&early) {
        Ok(n) => n,
        Err(e) if matches!(e.kind(), WouldBlock | Interrupted) => 0,
        Err(e) => return Err(e),
    };
    // The rest (a full send buffer): through the reactor, which tracks readiness.
    let rest = async {
        while sent < early.len() {
            tcp.writable().await?;
            match tcp.try_write(&early[sent..]) {
                Ok(n) => sent += n,
                Err(e) if matches!(e.kind(), WouldBlock | Interrupted) => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    };
    tokio::time::timeout(timeout, rest).await.map_err(|_| {
        std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            format!("the target took no early data within {timeout:?}"),
        )
    })??;
    body.release(early.len());
    if let Some(c) = &counters.from_tunnel {
        c.inc_by(early.len() as u64);
    }
    Ok(())
}

/// A service-proxy stream: HTTP/1.1 from the broker, served by [`AgentShared::service_proxy`]
/// on the stream itself ([`StreamIo`]: the stream's flow control, half-close and abort, no pipe
/// in between).
async fn serve_service_proxy(answer: Answer, body: StreamRx, shared: &AgentShared) {
    let Some(proxy) = shared.service_proxy.clone() else {
        let e = DialError::new(
            DialErrorKind::AgentPolicy,
            format!(
                "the agent of cluster {} has no service_proxy section: the service proxy is off",
                shared.cluster
            ),
        );
        answer.fail(&e).await;
        return;
    };
    let Some(send) = answer.ok().await else {
        return;
    };
    let io = StreamIo::new(send, body, shared.counters.clone());
    shared.metrics.open_streams.inc();
    proxy.serve(io).await;
    shared.metrics.open_streams.dec();
}

/// Resolves and dials a target, classifying failures.
async fn dial(
    shared: &AgentShared,
    target: &str,
    timeout: Duration,
) -> Result<TcpStream, DialError> {
    let dest = if target == wire::APISERVER_DEST {
        shared.apiserver.clone()
    } else {
        let (host, port) = target
            .rsplit_once(':')
            .and_then(|(h, p)| Some((h, p.parse::<u16>().ok()?)))
            .ok_or_else(|| {
                DialError::new(
                    DialErrorKind::BadRequest,
                    format!("target {target:?} is not host:port"),
                )
            })?;
        if !shared.policy.permits(host, port) {
            return Err(DialError::new(
                DialErrorKind::AgentPolicy,
                format!(
                    "agent policy of cluster {} forbids {target}",
                    shared.cluster
                ),
            ));
        }
        target.to_owned()
    };
    let work = async {
        let addrs = shared.resolver.resolve(&dest).await.map_err(|e| {
            DialError::new(
                DialErrorKind::NameNotFound,
                format!("cannot resolve {dest}: {e}"),
            )
        })?;
        let mut last = None;
        for &a in addrs.iter() {
            // No reactor turn when the kernel finished the handshake inside connect().
            match crate::net::connect(a).await {
                Ok(s) => return Ok(s),
                Err(e) => last = Some((a, e)),
            }
        }
        // None of its addresses took the connection: the next dial asks the resolver again
        // (the Service's endpoints may have moved).
        shared.resolver.forget(&dest);
        let (a, e) = last.expect("a resolved name has at least one address");
        let kind = if e.kind() == std::io::ErrorKind::ConnectionRefused {
            DialErrorKind::Refused
        } else {
            DialErrorKind::Internal
        };
        Err(DialError::new(kind, format!("dial {dest} ({a}): {e}")))
    };
    match tokio::time::timeout(timeout, work).await {
        Ok(r) => r,
        Err(_) => {
            // Cached addresses that no longer answer are not tried again for the TTL.
            shared.resolver.forget(&dest);
            Err(DialError::new(
                DialErrorKind::Timeout,
                format!("dial {dest} timed out after {} ms", timeout.as_millis()),
            ))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Measured 2,576 B (rustc 1.95, dev profile); see the test.
    const MUX_STREAM_FUTURE_BYTES: usize = 2_816;

    /// Each `tether-tunnel/2` stream's task holds this future for the stream's life, most of
    /// the agent's memory per idle stream (`tether-bench --only idle`, 5.1–5.4 KiB): a change
    /// that grows it fails here, not only in a benchmark. Measured from the function's type;
    /// the bound is the dev-profile size CI builds, plus a margin for compiler changes.
    #[test]
    fn a_mux_streams_future_stays_small() {
        fn future_size<A, F: Future>(_: impl FnOnce(A) -> F) -> usize {
            std::mem::size_of::<F>()
        }
        let size = future_size(
            |(incoming, shared): (tether_tunnel::mux::Incoming, Arc<AgentShared>)| {
                handle_mux_dial(incoming, shared)
            },
        );
        eprintln!("tether-tunnel/2 stream future {size} B");
        assert!(
            size <= MUX_STREAM_FUTURE_BYTES,
            "a tunnel stream's future grew: {size} B"
        );
    }
}
