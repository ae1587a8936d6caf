//! The agent listener's handshakes: [`accept_agent`] runs TLS (client certificate required),
//! then either hands a peer broker's relay connection (ALPN `tether-relay/1`) to
//! `peers::serve_relay`, or starts an agent tunnel — `tether-tunnel/2` (the multiplexer,
//! `tether_tunnel::mux`) or `tether-tunnel/1` (the HTTP/2 client handshake) — runs the `hello`
//! identity check and starts its [`TunnelActor`].

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use actix::prelude::*;
use bytes::Bytes;
use http::{Method, Request, StatusCode};
use tether_tls::Identity;
use tether_tunnel::TunnelSettings;
use tether_tunnel::keepalive::WindowSampling;
use tether_tunnel::watchdog::{Progress, ProgressIo, Watchdog};
use tether_tunnel::wire;
use tokio::net::TcpStream;
use tokio_rustls::TlsAcceptor;
use tokio_util::sync::CancellationToken;
use tokio_util::task::AbortOnDropHandle;

use crate::handle::{HELLO_TIMEOUT, TunnelHandle, tell_refused};
use crate::metrics::BrokerMetrics;
use crate::registry::Registry;
use crate::test_hooks::TestHooks;
use crate::tunnel::{Connection, TunnelActor};
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
    /// The client side, for serving peer brokers' relays.
    pub broker: Arc<crate::dial::Broker>,
    /// Tunnel connections, their watchers and relay connections run as tasks of this drain.
    pub tasks: tether_runtime::Drain,
    /// Cancelled at the end of the broker's drain: closes every tunnel and relay connection
    /// (each connection's closer is a child of it).
    pub close: tokio_util::sync::CancellationToken,
    /// Clusters the hub accepts (checks nothing until synced with the control plane).
    pub clusters: Arc<crate::clusters::ClusterDirectory>,
    /// Test-only fault injection (config `test_hooks`; None in production).
    pub test_hooks: Option<Arc<TestHooks>>,
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
    side.settings.limit_unsent(&tcp);
    let hs = side.settings.handshake_timeout;
    // rustls asks its transport for a few KiB per read; reading the socket in 64 KiB pieces
    // (a buffer held only while data flows) cuts the `recv` calls ~4×.
    // The watchdog sees the socket itself, below TLS and the read-ahead (a relay connection
    // carries the counter too, unused).
    let progress = Progress::new();
    let tcp = tether_tunnel::readahead::ReadAhead::new(ProgressIo::new(tcp, Arc::clone(&progress)));
    let tls = tokio::time::timeout(hs, side.acceptor.accept(tcp))
        .await
        .map_err(|_| AcceptError::Timeout(hs))?
        .map_err(|e| AcceptError::Tls(e.to_string()))?;
    // A 256 KiB frame goes to the socket in one write, not in rustls's default 64 KiB pieces.
    let mut tls = tls;
    tls.get_mut()
        .1
        .set_buffer_limit(side.settings.tls_send_buffer());
    let alpn = tls.get_ref().1.alpn_protocol();
    let relay_v2 = alpn == Some(tether_tls::ALPN_RELAY_V2);
    if relay_v2 || alpn == Some(tether_tls::ALPN_RELAY) {
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
        let (broker, stop) = (Arc::clone(&side.broker), side.close.child_token());
        if relay_v2 {
            side.tasks.spawn(
                "relay connection",
                crate::peers::serve_relay_mux(broker, tls, id, stop),
            );
        } else {
            side.tasks.spawn(
                "relay connection",
                crate::peers::serve_relay(broker, tls, id, stop),
            );
        }
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
    tls.get_mut().0.count_into(Arc::clone(&window));
    if tls.get_ref().1.alpn_protocol() == Some(tether_tls::ALPN_TUNNEL_V2) {
        let peer = Peer {
            identity,
            cluster,
            agent,
        };
        return accept_mux(side, tls, peer, window, progress).await;
    }
    let (send, mut conn) = tokio::time::timeout(
        hs,
        side.settings.client_builder().handshake::<_, Bytes>(tls),
    )
    .await
    .map_err(|_| AcceptError::Timeout(hs))?
    .map_err(|e| AcceptError::H2(e.to_string()))?;
    let ping_pong = conn.ping_pong().expect("ping_pong taken once");
    let closer = side.close.child_token();
    let conn_closer = closer.clone();
    let mut window_rx = window.changed();
    let conn_cluster = cluster.clone();
    // Test-only (config `test_hooks`): cancelling it makes this connection's task panic.
    let panic_token = side.test_hooks.as_ref().map(|_| CancellationToken::new());
    let panic_on = panic_token.clone();
    // The task driving the connection; the tunnel's actor owns it from here on (dropping it
    // aborts the task, e.g. when the handshake below fails).
    let connection: Connection = AbortOnDropHandle::new(side.tasks.spawn("tunnel connection", async move {
        loop {
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
                () = wait_cancelled(panic_on.as_ref()), if panic_on.is_some() => {
                    panic!("test hook: the connection task of a tunnel of cluster {conn_cluster} panics")
                }
            }
        }
    }));
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
    let handle = TunnelHandle::new(
        side.next_id.fetch_add(1, Ordering::Relaxed),
        cluster,
        agent,
        send,
        side.max_pending_dials,
    );
    let tunnel = Established {
        handle,
        pinger: ping_pong.into(),
        closer,
        window,
        progress,
        connection,
        panic_token,
    };
    tunnel.start(&side);
    Ok(())
}

/// An agent tunnel whose hello succeeded, either protocol: what its [`TunnelActor`] needs.
struct Established {
    handle: TunnelHandle,
    pinger: tether_tunnel::keepalive::Pinger,
    closer: CancellationToken,
    window: Arc<tether_tunnel::window::AdaptiveWindow>,
    progress: Arc<Progress>,
    connection: Connection,
    panic_token: Option<CancellationToken>,
}

impl Established {
    /// Counts the tunnel by protocol and starts its actor (which registers it).
    fn start(self, side: &AgentSide) {
        side.metrics
            .tunnel_connections
            .with_label_values(&[self.handle.protocol()])
            .inc();
        let handle = Arc::new(
            self.handle
                .with_closer(self.closer)
                .with_window(Arc::clone(&self.window))
                .with_progress(Arc::clone(&self.progress)),
        );
        let actor = TunnelActor {
            handle,
            registry: side.registry.clone(),
            keepalive: Some((
                self.pinger,
                side.settings.keepalive_interval,
                side.settings.keepalive_timeout,
            )),
            sampling: Some(WindowSampling {
                window: self.window,
                changes: Some(side.metrics.tunnel_window_changes.clone()),
            }),
            connection: Some(self.connection),
            watchdog: Watchdog::new(self.progress, side.settings.stall_timeout)
                .count_suspect_in(side.metrics.tunnel_suspect.clone()),
            wedged: side.metrics.tunnel_wedged.clone(),
            hooks: side.test_hooks.clone().zip(self.panic_token),
        };
        TunnelActor::start_in_arbiter(&side.arbiter, move |_| actor);
    }
}

/// Who the agent's certificate says it is.
struct Peer {
    identity: Identity,
    cluster: String,
    agent: String,
}

/// An agent tunnel on `tether-tunnel/2`: the connection's driver runs as the tunnel's
/// connection task; `HELLO` / `HELLO_OK` check the identity; the actor takes it from there.
async fn accept_mux<T>(
    side: Arc<AgentSide>,
    tls: T,
    peer: Peer,
    window: Arc<tether_tunnel::window::AdaptiveWindow>,
    progress: Arc<Progress>,
) -> Result<(), AcceptError>
where
    T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Send + 'static,
{
    use tether_tunnel::mux::{self, Event, frame};
    let Peer {
        identity,
        cluster,
        agent,
    } = peer;
    let cfg = mux::Config::from_settings(&side.settings);
    let (conn, driver, mut events) = mux::connect(tls, mux::Role::Opener, cfg, None);
    let closer = side.close.child_token();
    let conn_closer = closer.clone();
    let mut window_rx = window.changed();
    let conn_cluster = cluster.clone();
    let panic_token = side.test_hooks.as_ref().map(|_| CancellationToken::new());
    let panic_on = panic_token.clone();
    let driven = conn.clone();
    let connection: Connection = AbortOnDropHandle::new(side.tasks.spawn("tunnel connection", async move {
        let run = driver.run();
        tokio::pin!(run);
        loop {
            tokio::select! {
                reason = &mut run => break reason,
                _ = conn_closer.cancelled() => {
                    driven.close("closed by the broker");
                    break "closed by the broker".to_owned();
                }
                Ok(()) = window_rx.changed() => {
                    let w = *window_rx.borrow_and_update();
                    driven.set_recv_window(w);
                    tracing::debug!(cluster = %conn_cluster, stream_window_bytes = w, "tunnel receive window changed");
                }
                () = wait_cancelled(panic_on.as_ref()), if panic_on.is_some() => {
                    panic!("test hook: the connection task of a tunnel of cluster {conn_cluster} panics")
                }
            }
        }
    }));
    if let Err(reason) = side.clusters.admit(&cluster) {
        crate::handle::tell_refused_mux(&conn, &reason).await;
        closer.cancel();
        return Err(AcceptError::ClusterRefused(reason));
    }
    let hello = mux::Hello {
        cluster: cluster.clone(),
        agent: agent.clone(),
        broker: side.broker_id.clone(),
    };
    let answer = tokio::time::timeout(HELLO_TIMEOUT, async {
        conn.send_control(frame::Kind::Hello, &hello.encode())
            .await
            .map_err(|e| AcceptError::H2(e.to_string()))?;
        loop {
            match events.recv().await {
                Some(Event::HelloOk { .. }) => return Ok(()),
                Some(Event::Refused(msg)) => {
                    return Err(AcceptError::IdentityMismatch(format!("{identity}: {msg}")));
                }
                Some(_) => {}
                None => {
                    return Err(AcceptError::H2(
                        "the agent closed the connection during the hello".into(),
                    ));
                }
            }
        }
    })
    .await
    .map_err(|_| AcceptError::Timeout(HELLO_TIMEOUT))?;
    if let Err(e) = answer {
        closer.cancel();
        return Err(e);
    }
    // Later connection events (GOAWAY, DRAIN) act on the connection itself (the tunnel stops
    // taking streams); nobody needs to read them.
    drop(events);
    let handle = TunnelHandle::new_mux(
        side.next_id.fetch_add(1, Ordering::Relaxed),
        cluster,
        agent,
        conn.clone(),
        side.max_pending_dials,
    );
    let tunnel = Established {
        handle,
        pinger: tether_tunnel::keepalive::Pinger::Mux(conn),
        closer,
        window,
        progress,
        connection,
        panic_token,
    };
    tunnel.start(&side);
    Ok(())
}

/// Waits until `token` (if any) is cancelled; never ends without one.
async fn wait_cancelled(token: Option<&CancellationToken>) {
    match token {
        Some(t) => t.cancelled().await,
        None => std::future::pending().await,
    }
}
