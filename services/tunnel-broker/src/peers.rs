//! Broker-to-broker relay: a client may reach any broker; a broker with no tunnel for the
//! cluster relays the stream to a peer that has one.
//!
//! - Dialling side: one supervised [`PeerConnector`] actor per configured peer keeps an mTLS
//!   connection to the peer's agent listener with ALPN `tether-relay/1` (this broker's own
//!   certificate, CN `tether:broker:<id>`), and is the HTTP/2 client on it. Live peer
//!   connections are published in a [`PeerTable`]; `dial::Broker` tries them in turn
//!   when it has no local tunnel (a peer without the cluster answers `no_tunnel` at once).
//! - Serving side: [`serve_relay`] answers a peer's `dial` requests from **local** tunnels only
//!   (so a relay never loops) and splices the two HTTP/2 streams; windows chain end to end.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use actix::prelude::*;
use bytes::Bytes;
use h2::server::SendResponse;
use http::{Request, Response};
use tether_runtime::{Backoff, BackoffConfig};
use tether_tls::TlsMaterial;
use tether_tunnel::wire::{self, DialErrorKind};
use tether_tunnel::{DialError, Target};
use tokio::sync::watch;
use tokio_rustls::TlsConnector;
use tracing::Instrument;

use crate::config::PeerConfig;
use crate::dial::Broker;
use crate::handle::TunnelHandle;

/// Relay links are few (one per peer broker), so they are pinged more often than agent
/// tunnels: a peer that vanishes without closing its connection (partition, frozen host) is
/// dropped from the route table within `interval + timeout` (4 s) rather than 15 s.
pub const RELAY_KEEPALIVE_INTERVAL: Duration = Duration::from_secs(2);
/// See [`RELAY_KEEPALIVE_INTERVAL`].
pub const RELAY_KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(2);

/// Live peer connections, published as a `watch` snapshot (peer id order).
#[derive(Clone)]
pub struct PeerTable {
    inner: Arc<Mutex<BTreeMap<String, Arc<TunnelHandle>>>>,
    tx: Arc<watch::Sender<Arc<Vec<Arc<TunnelHandle>>>>>,
    gauge: Option<prometheus::IntGauge>,
}

impl PeerTable {
    pub fn new() -> (Self, watch::Receiver<Arc<Vec<Arc<TunnelHandle>>>>) {
        let (tx, rx) = watch::channel(Arc::new(Vec::new()));
        (
            Self {
                inner: Default::default(),
                tx: Arc::new(tx),
                gauge: None,
            },
            rx,
        )
    }

    /// Keeps `gauge` at the number of live peer connections.
    pub fn with_gauge(mut self, gauge: prometheus::IntGauge) -> Self {
        self.gauge = Some(gauge);
        self
    }

    fn set(&self, peer: &str, handle: Option<Arc<TunnelHandle>>) {
        let mut map = self.inner.lock().expect("peer table lock");
        match handle {
            Some(h) => map.insert(peer.to_owned(), h),
            None => map.remove(peer),
        };
        if let Some(g) = &self.gauge {
            g.set(map.len() as i64);
        }
        self.tx
            .send_replace(Arc::new(map.values().cloned().collect()));
    }
}

/// Keeps the relay connection to one peer broker.
pub struct PeerConnector {
    pub peer: PeerConfig,
    pub tls: Arc<TlsMaterial>,
    pub broker: Arc<Broker>,
    pub table: PeerTable,
    pub backoff: Backoff,
    pub max_pending_dials: usize,
    pub generation: u64,
    /// Cancelled when the peer is dropped (its presence disappeared or went stale), and at the
    /// end of the broker's drain (a child of its close token, see [`PeerConnector::with_tasks`]).
    pub stop: tokio_util::sync::CancellationToken,
    /// The connection attempts and relay connections run as tasks of this drain.
    pub tasks: tether_runtime::Drain,
}

/// Where peer connectors run their tasks: the broker's drain, ended by its close token.
#[derive(Clone)]
pub struct PeerTasks {
    pub tasks: tether_runtime::Drain,
    pub close: tokio_util::sync::CancellationToken,
}

impl Default for PeerTasks {
    /// A drain of their own, never closed (unit tests).
    fn default() -> Self {
        Self {
            tasks: tether_runtime::Drain::new("tunnel-broker peer"),
            close: Default::default(),
        }
    }
}

impl PeerConnector {
    pub fn new(
        peer: PeerConfig,
        tls: Arc<TlsMaterial>,
        broker: Arc<Broker>,
        table: PeerTable,
        max_pending_dials: usize,
    ) -> Self {
        Self {
            peer,
            tls,
            broker,
            table,
            backoff: Backoff::new(BackoffConfig {
                initial: Duration::from_millis(100),
                max: Duration::from_secs(10),
                ..BackoffConfig::default()
            }),
            max_pending_dials,
            generation: 0,
            stop: Default::default(),
            tasks: PeerTasks::default().tasks,
        }
    }

    /// Runs the connector's tasks in `t`'s drain, ended by its close token.
    pub fn with_tasks(mut self, t: &PeerTasks) -> Self {
        (self.tasks, self.stop) = (t.tasks.clone(), t.close.child_token());
        self
    }
}

/// Stops a peer connector for good: closes its relay connection and forgets the peer.
#[derive(Message)]
#[rtype(result = "()")]
pub struct StopPeer;

impl Handler<StopPeer> for PeerConnector {
    type Result = ();

    fn handle(&mut self, _: StopPeer, ctx: &mut Context<Self>) {
        tracing::info!(peer = %self.peer.id, "peer dropped");
        self.stop.cancel();
        self.table.set(&self.peer.id, None);
        ctx.stop();
    }
}

#[derive(Message)]
#[rtype(result = "()")]
struct PeerEnded {
    generation: u64,
    reason: String,
    was_up: bool,
}

impl Actor for PeerConnector {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Self::Context) {
        self.connect(ctx);
    }
}

impl Supervised for PeerConnector {}

impl PeerConnector {
    fn connect(&mut self, ctx: &mut Context<Self>) {
        self.generation += 1;
        let generation = self.generation;
        let peer = self.peer.clone();
        let tls = Arc::clone(&self.tls);
        let settings = self.broker.settings.clone();
        let table = self.table.clone();
        let max_pending = self.max_pending_dials;
        let me = ctx.address();
        let stop = self.stop.clone();
        let tasks = self.tasks.clone();
        self.tasks.spawn("peer relay connector", async move {
            let opened = tokio::select! {
                r = open_peer(&peer, &tls, &settings, &tasks) => r,
                _ = stop.cancelled() => return,
            };
            let (reason, was_up) = match opened {
                Err(e) => (e.to_string(), false),
                Ok((send, conn_end, pp)) => {
                    let handle = Arc::new(TunnelHandle::new(
                        generation,
                        String::new(),
                        format!("broker/{}", peer.id),
                        send,
                        max_pending,
                    ));
                    table.set(&peer.id, Some(Arc::clone(&handle)));
                    tracing::info!(peer = %peer.id, address = %peer.address, "relay connection to peer up");
                    let reason = tokio::select! {
                        _ = stop.cancelled() => {
                            table.set(&peer.id, None);
                            return;
                        }
                        r = conn_end => r.unwrap_or_else(|_| "connection task ended".into()),
                        e = tether_tunnel::keepalive::run_measured(
                            pp,
                            settings.keepalive_interval.min(RELAY_KEEPALIVE_INTERVAL),
                            settings.keepalive_timeout.min(RELAY_KEEPALIVE_TIMEOUT),
                            handle.rtt_cell(),
                        ) => e.to_string(),
                    };
                    table.set(&peer.id, None);
                    (reason, true)
                }
            };
            me.do_send(PeerEnded {
                generation,
                reason,
                was_up,
            });
        });
    }
}

type PeerConn = (
    h2::client::SendRequest<Bytes>,
    tokio::sync::oneshot::Receiver<String>,
    h2::PingPong,
);

/// Why a relay connection to a peer could not be opened; each keeps its source.
#[derive(Debug, thiserror::Error)]
pub enum PeerConnectError {
    #[error("server_name: {0}")]
    ServerName(#[from] rustls::pki_types::InvalidDnsNameError),
    #[error("TLS material: {0}")]
    Tls(#[from] tether_tls::TlsError),
    #[error("{step} timed out after {after:?}")]
    Timeout {
        step: &'static str,
        after: std::time::Duration,
    },
    #[error("connect: {0}")]
    Connect(std::io::Error),
    #[error("TLS: {0}")]
    Handshake(std::io::Error),
    #[error("HTTP/2: {0}")]
    H2(#[from] h2::Error),
}

async fn open_peer(
    peer: &PeerConfig,
    tls: &Arc<TlsMaterial>,
    settings: &tether_tunnel::TunnelSettings,
    tasks: &tether_runtime::Drain,
) -> Result<PeerConn, PeerConnectError> {
    let hs = settings.handshake_timeout;
    let timeout = |step| PeerConnectError::Timeout { step, after: hs };
    let name = rustls::pki_types::ServerName::try_from(peer.server_name.clone())?;
    let cfg = tls.client_config(&[tether_tls::ALPN_RELAY])?;
    let tcp = tokio::time::timeout(hs, tokio::net::TcpStream::connect(&peer.address))
        .await
        .map_err(|_| timeout("connect"))?
        .map_err(PeerConnectError::Connect)?;
    let _ = tcp.set_nodelay(true);
    let stream = tokio::time::timeout(hs, TlsConnector::from(Arc::new(cfg)).connect(name, tcp))
        .await
        .map_err(|_| timeout("TLS"))?
        .map_err(PeerConnectError::Handshake)?;
    let (send, mut conn) =
        tokio::time::timeout(hs, settings.client_builder().handshake::<_, Bytes>(stream))
            .await
            .map_err(|_| timeout("HTTP/2 handshake"))??;
    let pp = conn.ping_pong().expect("ping_pong taken once");
    let (tx, rx) = tokio::sync::oneshot::channel();
    // Ends when the connector drops its handle (the peer is dropped or the broker drains).
    tasks.spawn("peer relay connection", async move {
        let reason = match conn.await {
            Ok(()) => "closed".to_owned(),
            Err(e) => e.to_string(),
        };
        let _ = tx.send(reason);
    });
    Ok((send, rx, pp))
}

impl Handler<PeerEnded> for PeerConnector {
    type Result = ();

    fn handle(&mut self, msg: PeerEnded, ctx: &mut Context<Self>) {
        if msg.generation != self.generation || self.stop.is_cancelled() {
            return;
        }
        if msg.was_up {
            self.backoff.succeeded();
        }
        let delay = self.backoff.failed();
        tracing::info!(peer = %self.peer.id, reason = %msg.reason, ?delay, "relay connection to peer down; retrying");
        ctx.run_later(delay, |act, ctx| act.connect(ctx));
    }
}

/// Serves a peer broker's relay connection: each `dial` is answered from local tunnels.
pub async fn serve_relay<S>(
    broker: Arc<Broker>,
    io: S,
    peer_id: String,
    stop: tokio_util::sync::CancellationToken,
) where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let hs = broker.settings.handshake_timeout;
    let mut conn = match tokio::time::timeout(
        hs,
        broker.settings.server_builder().handshake::<_, Bytes>(io),
    )
    .await
    {
        Ok(Ok(c)) => c,
        Ok(Err(e)) => {
            return tracing::warn!(peer = %peer_id, error = %e, "relay HTTP/2 handshake failed");
        }
        Err(_) => return tracing::warn!(peer = %peer_id, "relay HTTP/2 handshake timed out"),
    };
    tracing::info!(peer = %peer_id, "serving relay connection from peer");
    let keepalive = tether_tunnel::keepalive::run(
        conn.ping_pong().expect("ping_pong taken once"),
        broker.settings.keepalive_interval,
        broker.settings.keepalive_timeout,
    );
    tokio::pin!(keepalive);
    loop {
        tokio::select! {
            req = conn.accept() => match req {
                Some(Ok((req, respond))) => {
                    tokio::spawn(relay_request(Arc::clone(&broker), req, respond));
                }
                Some(Err(e)) => return tracing::info!(peer = %peer_id, error = %e, "relay connection ended"),
                None => return,
            },
            e = &mut keepalive => return tracing::info!(peer = %peer_id, error = %e, "relay peer unresponsive"),
            _ = stop.cancelled() => return tracing::debug!(peer = %peer_id, "relay connection closed: broker drained"),
        }
    }
}

async fn relay_request(
    broker: Arc<Broker>,
    req: Request<h2::RecvStream>,
    mut respond: SendResponse<Bytes>,
) {
    if req.uri().path() != wire::PATH_DIAL {
        respond.send_reset(h2::Reason::REFUSED_STREAM);
        return;
    }
    let header = |n: &str| {
        req.headers()
            .get(n)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .to_owned()
    };
    let (cluster, dest, origin, timeout) = (
        header(wire::HEADER_CLUSTER),
        header(wire::HEADER_TARGET),
        header(wire::HEADER_STREAM),
        header(wire::HEADER_DIAL_TIMEOUT_MS),
    );
    let stream_id = broker.next_stream_id();
    let span = tracing::info_span!("relay_stream", stream = stream_id, cluster = %cluster, target = %dest, origin_stream = %origin);
    tether_telemetry::propagation::set_parent(
        &span,
        req.headers()
            .iter()
            .filter_map(|(k, v)| Some((k.as_str(), v.to_str().ok()?))),
    );
    async move {
        let target = match Target::from_wire(&cluster, &dest) {
            Ok(t) => t,
            Err(e) => {
                let e = DialError::new(DialErrorKind::BadRequest, e.to_string());
                let _ = respond.send_response(wire::error_response(&e), true);
                return;
            }
        };
        let timeout = timeout.parse::<u64>().ok().map(Duration::from_millis);
        let opened = match broker.dial_for_peer(&target, stream_id, timeout).await {
            Ok(o) => o,
            Err(e) => {
                let _ = respond.send_response(wire::error_response(&e), true);
                return;
            }
        };
        let crate::dial::OpenStream { send, recv, ticket } = opened;
        let back = match respond.send_response(Response::new(()), false) {
            Ok(s) => s,
            Err(_) => {
                broker.finish(&ticket, &Ok(Default::default()));
                return;
            }
        };
        let r = tether_tunnel::relay::splice_streams(
            (back.into(), req.into_body().into()),
            (send, recv),
        )
        .await;
        broker.finish(&ticket, &r);
    }
    .instrument(span)
    .await
}
