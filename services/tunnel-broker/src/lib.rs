//! tunnel-broker: the hub side of the tunnels.
//!
//! Layout:
//! - [`config`]: YAML config, validated with errors naming the field.
//! - [`accept`]: the agent listener's handshakes: agent tunnels and peer brokers' relays.
//! - [`tunnel`]: the [`tunnel::TunnelActor`] that owns each agent tunnel.
//! - [`handle`]: [`handle::TunnelHandle`], what front ends use to open streams on a tunnel.
//! - [`registry`]: the registry actor (cluster → tunnels), published as a `watch` snapshot.
//! - [`auth`]: client identities (certificate or token) and the per-identity access policy.
//! - [`dial`]: the one path every front end uses to open a stream ([`dial::Broker`]).
//! - [`connect`]: HTTP CONNECT front end (plain and TLS).
//! - [`grpc`]: native `tether.tunnel.v1.Dialer/Dial` and konnectivity `ProxyService/Proxy`.
//! - [`peers`]: relaying streams to peer brokers that hold the cluster's tunnel.
//! - [`control`]: the optional control-plane session (NATS): presence, peers, clusters, clients.
//! - [`presence`]: this broker's `tether-brokers` entry and the relay peers discovered from
//!   the others'.
//! - [`clusters`]: the clusters the hub knows (tunnel admission, "unknown cluster" answers).
//! - [`service_proxy`]: the HTTP service proxy (`/<cluster>/…` URLs for kube clients), its
//!   tunnel-stream connection pool and the default-deny service allowlist.
//! - [`batch`]: writes under HTTP/2 batched per poll of the connection (one write for a burst
//!   of DATA frames).
//! - [`linger`]: plain CONNECT clients of a killed broker see a reset, not a clean EOF.
//! - [`drain`]: on drain, HTTP client connections are told to go elsewhere (GOAWAY, close).
//! - [`metrics`]: Prometheus metrics.
//! - [`test_hooks`]: test-only fault injection (config `test_hooks`, off by default).
//!
//! [`run`] is what `main` calls, and what tests may call in-process.

#![forbid(unsafe_code)]

pub mod accept;
pub mod auth;
pub mod batch;
pub mod budget;
pub mod client_mux;
pub mod clusters;
pub mod config;
pub mod connect;
pub mod control;
pub mod dial;
pub mod drain;
pub mod grpc;
pub mod handle;
pub mod linger;
pub mod metrics;
pub mod peers;
pub mod presence;
pub mod registry;
pub mod service_proxy;
pub mod test_hooks;
pub mod tunnel;

use std::sync::Arc;
use std::time::Duration;

use actix::prelude::*;
use prometheus::Registry as PromRegistry;
use tether_telemetry::{AdminServer, Readiness};
use tether_tls::TlsMaterial;
use tether_tunnel::lingering::LingeringClose;
use tokio::net::TcpListener;
use tokio_rustls::TlsAcceptor;
use tokio_util::sync::CancellationToken;

use crate::accept::{AgentSide, accept_agent};
use crate::config::BrokerConfig;
use crate::dial::Broker;
use crate::metrics::BrokerMetrics;
use crate::registry::Registry;

/// Client or agent connections served at once per listener; accepting pauses at the cap.
pub const MAX_CONNECTIONS_PER_LISTENER: usize = 65_536;
/// ALPN protocols of HTTP clients (the service proxy; the client TLS listener besides
/// `tether-dial/1`).
pub const CLIENT_ALPN: [&[u8]; 2] = [b"h2", b"http/1.1"];

/// ALPN protocols on the client TLS listener: `tether-dial/1` first (the server's preference
/// decides, so a client offering it gets it) unless `tunnel.protocol: h2` keeps clients on
/// HTTP/2 too, then [`CLIENT_ALPN`].
fn client_listener_alpn(protocol: tether_tunnel::settings::TunnelProtocol) -> Vec<&'static [u8]> {
    let mut alpn = Vec::with_capacity(3);
    if protocol == tether_tunnel::settings::TunnelProtocol::Mux {
        alpn.push(tether_tls::ALPN_DIAL);
    }
    alpn.extend(CLIENT_ALPN);
    alpn
}

#[derive(Debug, thiserror::Error)]
pub enum BrokerError {
    #[error("TLS material: {0}")]
    Tls(#[from] tether_tls::TlsError),
    #[error("metrics: {0}")]
    Metrics(#[from] prometheus::Error),
    #[error("control plane: {0}")]
    ControlPlane(#[from] control::ControlPlaneError),
    #[error("listener address: {0}")]
    Listener(std::io::Error),
}

/// Time the broker waits on exit for its presence entry to be deleted.
pub const PRESENCE_DELETE_WAIT: Duration = Duration::from_secs(5);

/// The bound listeners of a broker.
pub struct Listeners {
    pub agent: TcpListener,
    pub client: Option<TcpListener>,
    pub client_tls: Option<TcpListener>,
    pub admin: TcpListener,
    /// `service_proxy.listen` (None when the service proxy is off).
    pub service_proxy: Option<TcpListener>,
}

/// Runs the broker until `shutdown`, then drains: stops accepting, tells every agent to move,
/// lets open streams finish for `drain_grace`. Must run inside an actix `System`.
pub async fn run(
    cfg: BrokerConfig,
    listeners: Listeners,
    shutdown: CancellationToken,
) -> Result<(), BrokerError> {
    let registry = PromRegistry::new();
    // Every long-lived task of the broker; shutdown waits for them (see `Drain`).
    let tasks = tether_runtime::Drain::new("tunnel-broker");
    // Cancelled once open streams are drained: closes client, tunnel and relay connections.
    let close = CancellationToken::new();
    let tls = TlsMaterial::load(cfg.tls.clone())?;
    tls.register(&registry)?;
    tls.spawn_watcher(cfg.tls_reload_interval, shutdown.child_token());
    let metrics = BrokerMetrics::new(&registry)?;
    let (reg_actor, routes) = Registry::new(metrics.tunnels.clone());
    let arbiter = Arbiter::current();
    let reg_addr = Registry::start_in_arbiter(&arbiter, move |_| reg_actor);

    let auth = auth::Auth::new(&cfg.clients);
    // Fails early (before listening) on unreadable control-plane files.
    let cp_connect = cfg
        .control_plane
        .as_ref()
        .map(control::connect_config)
        .transpose()?;
    let agent_acceptor = TlsAcceptor::from(Arc::new(
        tls.server_config(true, &agent_listener_alpn(cfg.tunnel.protocol))?,
    ));
    let (peer_table, peer_routes) = peers::PeerTable::new();
    let peer_table = peer_table.with_gauge(metrics.relay_peers_connected.clone());
    let broker = Arc::new(
        Broker::new(
            cfg.id.clone(),
            routes.clone(),
            auth,
            metrics.clone(),
            cfg.tunnel.clone(),
            cfg.dial_timeout,
            peer_routes,
        )
        .with_budgets(budget::Budgets::with_share(
            cfg.budgets.clone(),
            cfg.id.clone(),
            metrics.budget_rejections.clone(),
            metrics.paced_clusters.clone(),
        )),
    );
    if cfg.test_hooks {
        tracing::warn!(
            "test hooks on: the admin listener can make tunnels panic (never in production)"
        );
    }
    let test_hooks = cfg.test_hooks.then(|| Arc::new(test_hooks::new()));
    let side = Arc::new(AgentSide {
        broker_id: cfg.id.clone(),
        acceptor: agent_acceptor,
        // The cluster's bytes buffered here are capped by the tunnel's connection window
        // (budgets.max_buffered_bytes_per_cluster, budget).
        settings: tether_tunnel::TunnelSettings {
            connection_window_bytes: cfg
                .tunnel
                .connection_window_bytes
                .min(cfg.budgets.max_buffered_bytes_per_cluster),
            ..cfg.tunnel.clone()
        },
        max_pending_dials: cfg.max_pending_dials_per_tunnel,
        registry: reg_addr,
        metrics: metrics.clone(),
        arbiter: arbiter.clone(),
        next_id: Default::default(),
        broker: Arc::clone(&broker),
        tasks: tasks.clone(),
        close: close.clone(),
        clusters: Arc::clone(broker.auth.clusters()),
        test_hooks: test_hooks.clone(),
    });
    let peer_tasks = peers::PeerTasks {
        tasks: tasks.clone(),
        close: close.clone(),
    };
    let mut peer_connectors = Vec::new();
    for peer in &cfg.peers {
        let c = peers::PeerConnector::new(
            peer.clone(),
            Arc::clone(&tls),
            Arc::clone(&broker),
            peer_table.clone(),
            cfg.max_pending_dials_per_tunnel,
        )
        .with_tasks(&peer_tasks);
        peer_connectors.push(Supervisor::start_in_arbiter(&arbiter, move |_| c));
    }
    let accepting = CancellationToken::new();
    let readiness = Readiness::new();
    let (draining_tx, draining_rx) = tokio::sync::watch::channel(false);
    let cp_exit = CancellationToken::new();
    if let (Some(sp), Some(l)) = (&cfg.service_proxy, listeners.service_proxy) {
        let allowlist = Arc::new(service_proxy::Allowlist::new(
            sp.allow_services.clone(),
            metrics.service_proxy_allowlist_entries.clone(),
            metrics.service_proxy_allowlist_rejected.clone(),
        ));
        if let Some(connect) = cp_connect.clone() {
            tasks.spawn(
                "service proxy allowlist",
                service_proxy::allowlist::follow(Arc::clone(&allowlist), connect, cp_exit.clone()),
            );
        }
        let front = service_proxy::ServiceProxy::new(Arc::clone(&broker), sp.clone(), allowlist);
        let acceptor = TlsAcceptor::from(Arc::new(tls.server_config(false, &CLIENT_ALPN)?));
        let hs = cfg.tunnel.handshake_timeout;
        tasks.spawn(
            "service proxy listener",
            accept_loop(
                l,
                "service proxy connection",
                tasks.clone(),
                accepting.clone(),
                close.clone(),
                move |tcp| {
                    let (acceptor, front) = (acceptor.clone(), front.clone());
                    async move {
                        if let Some((mut tls, peer)) = accept_client_tls(&acceptor, tcp, hs).await {
                            // HTTP/2 ends as a whole; an HTTP/1.1 connection may be upgraded
                            // (exec, port-forward) into a byte stream that half-closes.
                            let h2 = tls.get_ref().1.alpn_protocol() == Some(b"h2");
                            if h2 {
                                tls.get_mut().0.arm();
                            }
                            front.serve_connection(tls, peer, h2).await;
                        }
                    }
                },
            ),
        );
    }
    let mut cp_task = None;
    if let (Some(cp), Some(connect)) = (&cfg.control_plane, cp_connect) {
        let me = presence::template(
            &cfg.id,
            &cp.advertise,
            listeners
                .agent
                .local_addr()
                .map_err(BrokerError::Listener)?,
            listeners.client.as_ref().and_then(|l| l.local_addr().ok()),
            listeners
                .client_tls
                .as_ref()
                .and_then(|l| l.local_addr().ok()),
        );
        let peers = cp.discover_peers.then(|| {
            presence::PeerManager::new(
                cfg.id.clone(),
                &cfg.peers,
                Arc::clone(&tls),
                Arc::clone(&broker),
                peer_table.clone(),
                cfg.max_pending_dials_per_tunnel,
                arbiter.clone(),
                metrics.discovered_peers.clone(),
            )
            .with_tasks(peer_tasks.clone())
        });
        let plane = control::ControlPlane {
            connect,
            me,
            broker: Arc::clone(&broker),
            registry: side.registry.clone(),
            routes: routes.clone(),
            peers,
            clusters: cp
                .enforce_clusters
                .then(|| Arc::clone(broker.auth.clusters())),
            metrics: metrics.clone(),
            draining: draining_rx,
        };
        let span = tracing::info_span!("control_plane", broker = %cfg.id);
        cp_task = Some(tasks.spawn(
            "control plane",
            tracing::Instrument::instrument(plane.run(cp_exit.clone()), span),
        ));
    }

    tasks.spawn(
        "agent listener",
        accept_loop(
            listeners.agent,
            "agent handshake",
            tasks.clone(),
            accepting.clone(),
            close.clone(),
            {
                let side = Arc::clone(&side);
                move |tcp| {
                    let side = Arc::clone(&side);
                    async move {
                        match accept_agent(Arc::clone(&side), tcp).await {
                            Ok(()) => side
                                .metrics
                                .tunnel_connects
                                .with_label_values(&["ok"])
                                .inc(),
                            Err(e) => {
                                side.metrics
                                    .tunnel_connects
                                    .with_label_values(&[e.metric_label()])
                                    .inc();
                                tracing::warn!(error = %e, "agent connection refused");
                            }
                        }
                    }
                }
            },
        ),
    );
    if let Some(l) = listeners.client {
        let broker = Arc::clone(&broker);
        // The same port serves gRPC without TLS (h2c) to clients that open with the HTTP/2
        // preface: the native Dial for the SDK on a trusted network (connect.rs).
        let grpc = grpc::GrpcFrontEnd::new(Arc::clone(&broker));
        tasks.spawn(
            "client listener",
            accept_loop(
                l,
                "client connection",
                tasks.clone(),
                accepting.clone(),
                close.clone(),
                move |tcp| {
                    let broker = Arc::clone(&broker);
                    let grpc = grpc.clone();
                    async move { connect::serve_plain(broker, &grpc, tcp).await }
                },
            ),
        );
    }
    if let Some(l) = listeners.client_tls {
        let acceptor = TlsAcceptor::from(Arc::new(
            tls.server_config(false, &client_listener_alpn(cfg.tunnel.protocol))?,
        ));
        let broker = Arc::clone(&broker);
        let grpc = grpc::GrpcFrontEnd::new(Arc::clone(&broker));
        let hs = cfg.tunnel.handshake_timeout;
        tasks.spawn(
            "client TLS listener",
            accept_loop(
                l,
                "client TLS connection",
                tasks.clone(),
                accepting.clone(),
                close.clone(),
                move |tcp| {
                    let acceptor = acceptor.clone();
                    let broker = Arc::clone(&broker);
                    let grpc = grpc.clone();
                    async move {
                        let Some((mut tls, peer)) = accept_client_tls(&acceptor, tcp, hs).await
                        else {
                            return;
                        };
                        let alpn = tls.get_ref().1.alpn_protocol();
                        let protocol = match alpn {
                            Some(b"h2") => "h2",
                            Some(p) if p == tether_tls::ALPN_DIAL => client_mux::PROTOCOL_LABEL,
                            _ => "http1",
                        };
                        broker
                            .metrics
                            .client_connections
                            .with_label_values(&["tls", protocol])
                            .inc();
                        if protocol != "http1" {
                            // A CONNECT stream (HTTP/1.1) half-closes inside its relay: its
                            // shutdown must not linger (it would discard the client's bytes).
                            tls.get_mut().0.arm();
                        }
                        match protocol {
                            "h2" => grpc.serve_connection(tls, peer).await,
                            "http1" => connect::serve_tls(broker, tls, peer).await,
                            _ => client_mux::serve(broker, tls, peer).await,
                        }
                    }
                },
            ),
        );
    }
    readiness.set_ready();
    let routes_dbg = routes.clone();
    let admin = AdminServer::new(registry, readiness.clone()).with_json_route(
        "/debug/tunnels",
        move || {
            let table = routes_dbg.borrow().clone();
            let list: Vec<_> = table
                .clusters
                .values()
                .flatten()
                .map(|t| {
                    serde_json::json!({
                        "id": t.id, "cluster": t.cluster, "agent": t.agent,
                        "open_streams": t.open_streams(), "draining": t.is_draining(),
                        "rtt_micros": t.rtt().map(|d| d.as_micros() as u64),
                        "stream_window_bytes": t.stream_window(),
                        "protocol": t.protocol(),
                    })
                })
                .collect();
            serde_json::Value::Array(list).to_string()
        },
    );
    let admin = match test_hooks {
        Some(hooks) => {
            admin.with_json_query_route(test_hooks::PANIC_TUNNEL_PATH, move |q| hooks.answer(q))
        }
        None => admin,
    };
    let admin_stop = CancellationToken::new();
    tasks.spawn(
        "admin server",
        admin.serve(listeners.admin, admin_stop.clone()),
    );
    tracing::info!(broker = %cfg.id, "tunnel-broker started");

    shutdown.cancelled().await;
    tracing::info!(grace = ?cfg.drain_grace, "draining: no new connections, agents asked to move");
    accepting.cancel();
    broker.draining.cancel();
    readiness.set_not_ready("draining");
    let _ = draining_tx.send(true);
    let table = routes.borrow().clone();
    let notices = tether_runtime::Drain::new("tunnel-broker drain notices");
    for t in table.clusters.values().flatten() {
        let t = Arc::clone(t);
        notices.spawn("drain notice", async move { t.send_drain().await });
    }
    // Each notice waits at most HELLO_TIMEOUT for its answer.
    notices.finish(handle::HELLO_TIMEOUT * 2).await;
    // Every front end's streams hold a token of `broker.streams` (taken in `Broker::dial`).
    let streams = broker.streams.clone().finish(cfg.drain_grace).await;
    tracing::info!(
        open_streams = broker.open_stream_count(),
        complete = streams.complete,
        "stream drain finished"
    );
    close.cancel();
    cp_exit.cancel();
    if let Some(t) = cp_task {
        let _ = tokio::time::timeout(PRESENCE_DELETE_WAIT, t).await;
    }
    admin_stop.cancel();
    tasks
        .finish(tether_runtime::DEFAULT_TASK_DRAIN_DEADLINE)
        .await;
    Ok(())
}

/// A client connection's TLS stream: over a transport whose close lingers once armed
/// ([`tether_tunnel::lingering`]) — for connections that end as a whole (HTTP/2, `tether-dial/1`),
/// so that a GOAWAY and the last bytes are not destroyed by a reset when the client still sends
/// (PING acks, WINDOW_UPDATEs) as the broker closes. Not for a CONNECT stream or an HTTP/1.1
/// connection that may be upgraded: their half-close must not discard what the client sends.
pub(crate) type ClientTls = tokio_rustls::server::TlsStream<LingeringClose<tokio::net::TcpStream>>;

/// A client TLS handshake (bounded by `timeout`) and the verified client certificate, if any;
/// the transport's lingering close is not armed yet (see [`ClientTls`]).
async fn accept_client_tls(
    acceptor: &TlsAcceptor,
    tcp: tokio::net::TcpStream,
    timeout: Duration,
) -> Option<(ClientTls, Option<auth::PeerCert>)> {
    let _ = tcp.set_nodelay(true);
    let tcp = LingeringClose::disarmed(tcp, tether_tunnel::lingering::LINGER_TIMEOUT);
    let mut tls = match tokio::time::timeout(timeout, acceptor.accept(tcp)).await {
        Ok(Ok(s)) => s,
        Ok(Err(e)) => {
            tracing::debug!(error = %e, "client TLS handshake failed");
            return None;
        }
        Err(_) => return None,
    };
    // Tunnel chunks (256 KiB) go to the socket whole, not in rustls's 64 KiB pieces; what a
    // slow client leaves queued here is bounded by this, besides its stream's window.
    tls.get_mut()
        .1
        .set_buffer_limit(Some(tether_tunnel::settings::DEFAULT_TLS_SEND_BUFFER));
    let peer = tls
        .get_ref()
        .1
        .peer_certificates()
        .and_then(|c| c.first())
        .and_then(auth::PeerCert::from_der);
    Some((tls, peer))
}

/// Accepts connections until `stop`, running `handle` for each in its own task of `tasks`
/// (named `what`); at most [`MAX_CONNECTIONS_PER_LISTENER`] handlers run at once (accepting waits
/// for a free slot). `close` ends the handlers still running (end of the drain).
async fn accept_loop<F, Fut>(
    listener: TcpListener,
    what: &'static str,
    tasks: tether_runtime::Drain,
    stop: CancellationToken,
    close: CancellationToken,
    handle: F,
) where
    F: Fn(tokio::net::TcpStream) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let handle = Arc::new(handle);
    let slots = Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS_PER_LISTENER));
    loop {
        let slot = tokio::select! {
            _ = stop.cancelled() => return,
            s = Arc::clone(&slots).acquire_owned() => s.expect("semaphore never closed"),
        };
        let tcp = tokio::select! {
            _ = stop.cancelled() => return,
            r = listener.accept() => match r {
                Ok((tcp, _)) => tcp,
                Err(e) => {
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        tasks.spawn(
            what,
            connection_task(Arc::clone(&handle), tcp, close.clone(), slot),
        );
    }
}

/// The task of one accepted connection: `handle`'s future until it ends or `close`, then the
/// listener's slot is freed.
///
/// The handler's future is created inside this future, not before it and moved in: an `async`
/// block keeps a captured future and the one it awaits in separate fields (rust-lang/rust#62958),
/// so a future built outside would be stored twice in every connection's task (~2 KiB more per
/// idle CONNECT stream; `tests::connection_task_holds_the_handler_future_once`).
async fn connection_task<F, Fut>(
    handle: Arc<F>,
    tcp: tokio::net::TcpStream,
    close: CancellationToken,
    slot: tokio::sync::OwnedSemaphorePermit,
) where
    F: Fn(tokio::net::TcpStream) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    tokio::select! {
        _ = handle(tcp) => {}
        _ = close.cancelled() => {}
    }
    drop(slot);
}

/// ALPN ids of the agent listener: the tunnel protocols `protocol` allows (preferred first),
/// then relay links from peer brokers ([`peers::relay_alpn`]).
fn agent_listener_alpn(protocol: tether_tunnel::settings::TunnelProtocol) -> Vec<&'static [u8]> {
    let mut alpn = protocol.alpn().to_vec();
    alpn.extend(peers::relay_alpn(protocol));
    alpn
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::future::Future;
    use tokio::net::TcpStream;

    fn returned_size<A, R>(_: fn(A) -> R) -> usize {
        std::mem::size_of::<R>()
    }

    /// Size of the task [`accept_loop`] spawns for a connection handled by `handler`.
    fn task_size<Fut>(_: fn(TcpStream) -> Fut) -> usize
    where
        Fut: Future<Output = ()> + Send + 'static,
    {
        fn returned_size4<A, B, C, D, R>(_: fn(A, B, C, D) -> R) -> usize {
            std::mem::size_of::<R>()
        }
        returned_size4(connection_task::<fn(TcpStream) -> Fut, Fut>)
    }

    async fn big_handler(tcp: TcpStream) {
        let buf = [7u8; 4096];
        std::future::pending::<()>().await;
        drop((buf, tcp));
    }

    #[test]
    fn connection_task_holds_the_handler_future_once() {
        let handler = returned_size(big_handler);
        assert!(handler >= 4096);
        let task = task_size(big_handler);
        assert!(
            task <= handler + 256,
            "{task} bytes for a {handler}-byte handler future"
        );
    }
}
