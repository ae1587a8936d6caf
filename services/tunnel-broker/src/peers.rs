//! Broker-to-broker relay: a client may reach any broker; a broker with no tunnel for the
//! cluster relays the stream to a peer that has one.
//!
//! - Dialling side: one supervised [`PeerConnector`] actor per configured peer keeps an mTLS
//!   connection to the peer's agent listener (this broker's own certificate, CN
//!   `tether:broker:<id>`) and opens the streams on it: with ALPN `tether-relay/2` on the frames
//!   of `tether-tunnel/2` ([`tether_tunnel::mux`], the dialling broker the opener), or with
//!   `tether-relay/1` as the HTTP/2 client (a peer that does not offer `/2`, or either broker
//!   configured with `tunnel.protocol: h2`; [`relay_alpn`]). Live peer connections are
//!   published in a [`PeerTable`]; `dial::Broker` tries them in turn when it has no local tunnel
//!   (a peer without the cluster answers `no_tunnel` at once).
//! - Serving side: [`serve_relay`] (HTTP/2) and [`serve_relay_mux`] answer a peer's dials from
//!   **local** tunnels only (so a relay never loops) and splice the two streams; windows chain
//!   end to end.
//!
//! Why `/2`: a relayed stream crosses two links, and on HTTP/2 the relay link costs what
//! `tether-tunnel/1` cost an agent tunnel (two tasks per hop, HPACK'd requests); behind a load
//! balancer most dials of a multi-broker hub are relayed.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use actix::prelude::*;
use bytes::Bytes;
use h2::server::SendResponse;
use http::{Request, Response};
use tether_runtime::{Backoff, BackoffConfig};
use tether_tls::TlsMaterial;
use tether_tunnel::keepalive::Pinger;
use tether_tunnel::mux::{self, Incoming, OnOpen, Role};
use tether_tunnel::settings::TunnelProtocol;
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

/// ALPN ids of relay links for a broker whose tunnels speak `protocol`, preferred first: the
/// dialling broker offers them, the agent listener accepts them. `tunnel.protocol: h2` keeps a
/// broker's relays on HTTP/2 too, as its tunnels and client dials.
pub fn relay_alpn(protocol: TunnelProtocol) -> &'static [&'static [u8]] {
    const BOTH: &[&[u8]] = &[tether_tls::ALPN_RELAY_V2, tether_tls::ALPN_RELAY];
    const V1: &[&[u8]] = &[tether_tls::ALPN_RELAY];
    match protocol {
        TunnelProtocol::Mux => BOTH,
        TunnelProtocol::H2 => V1,
    }
}

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
        let relay_connections = self.broker.metrics.relay_connections.clone();
        self.tasks.spawn("peer relay connector", async move {
            let opened = tokio::select! {
                r = open_peer(&peer, &tls, &settings, &tasks) => r,
                _ = stop.cancelled() => return,
            };
            let (reason, was_up) = match opened {
                Err(e) => (e.to_string(), false),
                Ok(PeerConn { link, end, pinger }) => {
                    let agent = format!("broker/{}", peer.id);
                    let closer = match &link {
                        Link::Mux(m) => Some(m.clone()),
                        Link::H2(_) => None,
                    };
                    let handle = Arc::new(match link {
                        Link::H2(send) => {
                            TunnelHandle::new(generation, String::new(), agent, send, max_pending)
                        }
                        Link::Mux(m) => {
                            TunnelHandle::new_mux(generation, String::new(), agent, m, max_pending)
                        }
                    });
                    // A mux connection lives until closed (HTTP/2's ends with its last handle
                    // and stream): closed below whenever the connector lets go of it.
                    let close = |why: &str| {
                        if let Some(m) = &closer {
                            m.close(format!("relay connection closed: {why}"));
                        }
                    };
                    let protocol = handle.protocol();
                    relay_connections.with_label_values(&[protocol]).inc();
                    table.set(&peer.id, Some(Arc::clone(&handle)));
                    tracing::info!(peer = %peer.id, address = %peer.address, protocol, "relay connection to peer up");
                    let reason = tokio::select! {
                        _ = stop.cancelled() => {
                            table.set(&peer.id, None);
                            close("the peer was dropped or the broker drained");
                            return;
                        }
                        r = end => r.unwrap_or_else(|_| "connection task ended".into()),
                        e = tether_tunnel::keepalive::run_probed(
                            pinger,
                            settings.keepalive_interval.min(RELAY_KEEPALIVE_INTERVAL),
                            settings.keepalive_timeout.min(RELAY_KEEPALIVE_TIMEOUT),
                            handle.rtt_cell(),
                            None,
                            None,
                        ) => e.to_string(),
                    };
                    table.set(&peer.id, None);
                    close(&reason);
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

/// An open relay connection to a peer.
struct PeerConn {
    link: Link,
    /// Why the connection's task ended.
    end: tokio::sync::oneshot::Receiver<String>,
    pinger: Pinger,
}

/// What streams are opened on.
enum Link {
    /// `tether-relay/1`.
    H2(h2::client::SendRequest<Bytes>),
    /// `tether-relay/2`.
    Mux(mux::Mux),
}

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
    let cfg = tls.client_config(relay_alpn(settings.protocol))?;
    let tcp = tokio::time::timeout(hs, tokio::net::TcpStream::connect(&peer.address))
        .await
        .map_err(|_| timeout("connect"))?
        .map_err(PeerConnectError::Connect)?;
    let _ = tcp.set_nodelay(true);
    settings.limit_unsent(&tcp);
    // Bulk relayed data keeps idle polling off, as it does on tunnels (`ProgressIo`).
    let tcp = tether_idlepoll::Counted::new(tcp);
    let mut stream = tokio::time::timeout(hs, TlsConnector::from(Arc::new(cfg)).connect(name, tcp))
        .await
        .map_err(|_| timeout("TLS"))?
        .map_err(PeerConnectError::Handshake)?;
    stream
        .get_mut()
        .1
        .set_buffer_limit(settings.tls_send_buffer());
    let (tx, end) = tokio::sync::oneshot::channel();
    if stream.get_ref().1.alpn_protocol() == Some(tether_tls::ALPN_RELAY_V2) {
        let (m, driver, events) = mux::connect(
            stream,
            Role::Opener,
            mux::Config::from_settings(settings),
            None,
        );
        // The peer's GOAWAY and DRAIN act on the connection itself (no new streams go to it).
        drop(events);
        // Ends when the peer closes it, or when the connector closes it (Link::close).
        tasks.spawn("peer relay connection", async move {
            let _ = tx.send(driver.run().await);
        });
        return Ok(PeerConn {
            pinger: Pinger::Mux(m.clone()),
            link: Link::Mux(m),
            end,
        });
    }
    let (send, mut conn) =
        tokio::time::timeout(hs, settings.client_builder().handshake::<_, Bytes>(stream))
            .await
            .map_err(|_| timeout("HTTP/2 handshake"))??;
    let pp = conn.ping_pong().expect("ping_pong taken once");
    // Ends when the connector drops its handle (the peer is dropped or the broker drains).
    tasks.spawn("peer relay connection", async move {
        let reason = match conn.await {
            Ok(()) => "closed".to_owned(),
            Err(e) => e.to_string(),
        };
        let _ = tx.send(reason);
    });
    Ok(PeerConn {
        link: Link::H2(send),
        end,
        pinger: pp.into(),
    })
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
    let mut told_to_go = false;
    loop {
        tokio::select! {
            // The drain began: GOAWAY, so the peer sends its next dials to another broker at
            // once; the relayed streams open here finish within the drain grace.
            () = broker.draining.cancelled(), if !told_to_go => {
                told_to_go = true;
                conn.graceful_shutdown();
                tracing::debug!(peer = %peer_id, "relay connection told to go away: draining");
            }
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

/// Serves a peer broker's `tether-relay/2` connection: each `OPEN` is answered from local
/// tunnels ([`relay_open`]). Ends when the peer closes it, its keepalive fails, or `stop`
/// (the end of this broker's drain) closes it. When the drain begins the peer gets a `GOAWAY`:
/// its next dials skip this broker without a round trip (its tunnels are draining too).
pub async fn serve_relay_mux<S>(
    broker: Arc<Broker>,
    io: S,
    peer_id: String,
    stop: tokio_util::sync::CancellationToken,
) where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Send + 'static,
{
    let on_open: OnOpen = {
        let broker = Arc::clone(&broker);
        Arc::new(move |incoming| {
            tokio::spawn(relay_open(Arc::clone(&broker), incoming));
        })
    };
    let s = &broker.settings;
    let (conn, driver, events) = mux::connect(
        io,
        Role::Acceptor,
        mux::Config::from_settings(s),
        Some(on_open),
    );
    drop(events);
    tracing::info!(peer = %peer_id, "serving relay connection from peer (tether-relay/2)");
    let rtt = std::sync::atomic::AtomicU64::new(0);
    let keepalive = tether_tunnel::keepalive::run_probed(
        Pinger::Mux(conn.clone()),
        s.keepalive_interval,
        s.keepalive_timeout,
        &rtt,
        None,
        None,
    );
    let go_away = async {
        broker.draining.cancelled().await;
        if conn.go_away("the broker is draining").await.is_ok() {
            tracing::debug!(peer = %peer_id, "relay connection told to go away: draining");
        }
        std::future::pending::<()>().await
    };
    let run = driver.run();
    tokio::pin!(run);
    tokio::select! {
        reason = &mut run => return tracing::info!(peer = %peer_id, %reason, "relay connection ended"),
        () = go_away => {}
        e = keepalive => {
            tracing::info!(peer = %peer_id, error = %e, "relay peer unresponsive");
            conn.close(format!("keepalive: {e}"));
        }
        _ = stop.cancelled() => {
            tracing::debug!(peer = %peer_id, "relay connection closed: broker drained");
            conn.close("the broker drained");
        }
    }
    // Closed above: the driver resets the open streams and closes the connection cleanly.
    run.await;
}

/// One `OPEN` on a `tether-relay/2` connection: dial a local tunnel, answer, splice.
async fn relay_open(broker: Arc<Broker>, incoming: Incoming) {
    let Incoming {
        open,
        auth: _,
        responder,
        send,
        recv,
    } = incoming;
    if broker.draining.is_cancelled() {
        // The OPEN crossed the GOAWAY: not processed, so the peer tries another broker.
        tracing::debug!("relay stream refused unprocessed: the broker is draining");
        responder.refuse("the broker is draining");
        return;
    }
    let stream_id = broker.next_stream_id();
    let span = tracing::info_span!("relay_stream", stream = stream_id, cluster = %open.cluster, target = %open.target, origin_stream = open.tag);
    tether_telemetry::propagation::set_parent(&span, open.trace_context());
    async move {
        let opened = match Target::from_wire(&open.cluster, &open.target) {
            Ok(target) => {
                let timeout = (open.dial_timeout_ms > 0)
                    .then(|| Duration::from_millis(u64::from(open.dial_timeout_ms)));
                broker.dial_for_peer(&target, stream_id, timeout).await
            }
            Err(e) => Err(DialError::new(DialErrorKind::BadRequest, e.to_string())),
        };
        let Some(crate::dial::OpenStream {
            send: to_tunnel,
            recv: from_tunnel,
            ticket,
        }) = crate::client_mux::answer_open(&broker, responder, stream_id, opened).await
        else {
            return;
        };
        let r = tether_tunnel::relay::splice_streams(
            (send.into(), recv.into()),
            (to_tunnel, from_tunnel),
        )
        .await;
        broker.finish(&ticket, &r);
    }
    .instrument(span)
    .await
}

async fn relay_request(
    broker: Arc<Broker>,
    req: Request<h2::RecvStream>,
    mut respond: SendResponse<Bytes>,
) {
    if req.uri().path() != wire::PATH_DIAL || broker.draining.is_cancelled() {
        // Not a dial, or one that crossed the drain's GOAWAY: refused unprocessed (for a dial,
        // the peer tries another broker).
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
        tether_telemetry::propagation::header_pairs(req.headers()),
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
