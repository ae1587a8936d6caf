//! Opening a stream for a client: authorise, route, ask the agent to dial, account.
//!
//! Every front end (HTTP CONNECT, native gRPC, konnectivity) goes through [`Broker::dial`] and
//! then [`Broker::finish`], so policy, metrics and tracing are the same whatever the protocol.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use tether_tunnel::pump::{ByteCounters, SpliceError, SpliceStats};
use tether_tunnel::wire::DialErrorKind;
use tether_tunnel::{DialError, StreamRx, StreamTx, Target, TunnelSettings};
use tokio::sync::watch;

use crate::auth::{Auth, ClientId};

use crate::handle::StreamGuard;
use crate::metrics::BrokerMetrics;
use crate::registry::RouteTable;

/// Shared state of the client side of the broker.
pub struct Broker {
    pub id: String,
    pub routes: watch::Receiver<Arc<RouteTable>>,
    pub auth: Auth,
    pub metrics: BrokerMetrics,
    pub settings: TunnelSettings,
    pub dial_timeout: Duration,
    pub counters: ByteCounters,
    /// Live relay connections to peer brokers.
    pub peers: watch::Receiver<Arc<Vec<Arc<crate::handle::TunnelHandle>>>>,
    /// Fairness budgets per cluster and client (budget).
    pub budgets: Arc<crate::budget::Budgets>,
    /// Every open stream, whatever its front end, holds a token of this drain (see
    /// [`StreamTicket`]); shutdown waits on it for `drain_grace`.
    pub streams: tether_runtime::Drain,
    /// Cancelled when the broker starts to drain: persistent client connections
    /// (`tether-dial/1`) are then told to open their new streams elsewhere (GOAWAY).
    pub draining: tokio_util::sync::CancellationToken,
    next_stream: AtomicU64,
}

/// How [`Broker::open`] routes one dial.
#[derive(Default)]
struct Route<'a> {
    /// The client, for its budget (`None`: a trusted or relayed dial).
    client: Option<&'a str>,
    /// The client's dial timeout (`None`: the broker's).
    timeout: Option<Duration>,
    /// Whether the dial may go to a peer broker's tunnel.
    may_relay: bool,
    /// Bytes the client sent behind its request, sent with the dial request.
    early: Bytes,
}

/// Local tunnels of one cluster a stream tries, when each refuses it unprocessed (its agent is
/// closing it: GOAWAY, or REFUSED_STREAM), before the stream goes to the peer brokers.
pub const MAX_LOCAL_TUNNELS_TRIED: usize = 4;

/// `reason` of `tether_broker_dial_failures_total` for a dial that found no tunnel because the
/// broker drains.
pub const DRAINING_LABEL: &str = "draining";

/// An open stream to a target.
pub struct OpenStream {
    pub send: StreamTx,
    pub recv: StreamRx,
    pub ticket: StreamTicket,
}

/// The bookkeeping of an open stream; hand it back to [`Broker::finish`] when the stream ends.
pub struct StreamTicket {
    pub stream_id: u64,
    pub frontend: &'static str,
    started: Instant,
    guard: StreamGuard,
    /// The stream's hold on its cluster's and client's budgets.
    _budget: crate::budget::Admission,
    /// The stream's share of the broker's CPU (budget::FairShare).
    pub pacer: crate::budget::Pacer,
    /// Keeps the broker's drain waiting while the stream is open.
    _drain: tether_runtime::DrainToken,
}

impl StreamTicket {
    /// Last measured round trip of the tunnel (or relay link) carrying the stream.
    pub fn tunnel_rtt(&self) -> Option<Duration> {
        self.guard.tunnel().rtt()
    }
}

impl Broker {
    pub fn new(
        id: String,
        routes: watch::Receiver<Arc<RouteTable>>,
        auth: Auth,
        metrics: BrokerMetrics,
        settings: TunnelSettings,
        dial_timeout: Duration,
        peers: watch::Receiver<Arc<Vec<Arc<crate::handle::TunnelHandle>>>>,
    ) -> Self {
        let counters = ByteCounters {
            to_tunnel: Some(metrics.counter("to_cluster")),
            from_tunnel: Some(metrics.counter("from_cluster")),
        };
        Self {
            counters,
            peers,
            budgets: crate::budget::Budgets::new(
                Default::default(),
                id.clone(),
                metrics.budget_rejections.clone(),
            ),
            id,
            routes,
            auth,
            metrics,
            settings,
            dial_timeout,
            streams: tether_runtime::Drain::new("tunnel-broker streams"),
            draining: tokio_util::sync::CancellationToken::new(),
            next_stream: AtomicU64::new(1),
        }
    }

    /// Uses `budgets` (from the config's `budgets` section) instead of the defaults.
    pub fn with_budgets(mut self, budgets: Arc<crate::budget::Budgets>) -> Self {
        self.budgets = budgets;
        self
    }

    /// A fresh stream id for logs and traces.
    pub fn next_stream_id(&self) -> u64 {
        self.next_stream.fetch_add(1, Ordering::Relaxed)
    }

    /// Authorises and opens a stream to `target`. Call inside the stream's span.
    ///
    /// `early`: bytes the client sent behind its request (HTTP CONNECT early data; empty for
    /// other front ends). They leave with the dial request (see `TunnelHandle::open`) and are
    /// the stream's first bytes once the dial succeeds; a failed dial drops them.
    pub async fn dial(
        &self,
        frontend: &'static str,
        client: &ClientId,
        target: &Target,
        stream_id: u64,
        timeout: Option<Duration>,
        early: Bytes,
    ) -> Result<OpenStream, DialError> {
        if let Err(e) = self.auth.authorize(client, target) {
            self.record_failure(frontend, &e);
            return Err(e);
        }
        let route = Route {
            client: Some(&client.name),
            timeout,
            may_relay: true,
            early,
        };
        self.open(frontend, target, stream_id, route).await
    }

    /// Opens a stream a front end authorised itself (the service proxy's tunnel streams to an
    /// agent's service proxy): local tunnel or relay peer, default dial timeout.
    pub async fn dial_trusted(
        &self,
        frontend: &'static str,
        target: &Target,
        stream_id: u64,
    ) -> Result<OpenStream, DialError> {
        let route = Route {
            may_relay: true,
            ..Route::default()
        };
        self.open(frontend, target, stream_id, route).await
    }

    /// Opens a stream for a peer broker's relay: local tunnels only, never relayed further.
    /// The peer authorised its client already.
    pub async fn dial_for_peer(
        &self,
        target: &Target,
        stream_id: u64,
        timeout: Option<Duration>,
    ) -> Result<OpenStream, DialError> {
        let route = Route {
            timeout,
            may_relay: false,
            ..Route::default()
        };
        self.open("relay", target, stream_id, route).await
    }

    async fn open(
        &self,
        frontend: &'static str,
        target: &Target,
        stream_id: u64,
        route: Route<'_>,
    ) -> Result<OpenStream, DialError> {
        let started = Instant::now();
        let known = self.routes.borrow().clusters.contains_key(&target.cluster);
        let mut admission = match self.budgets.admit(&target.cluster, route.client, known) {
            Ok(a) => a,
            Err(e) => {
                self.record_failure(frontend, &e);
                tokio::time::sleep(crate::budget::REFUSAL_PAUSE).await;
                return Err(e);
            }
        };
        let result = self.dial_inner(target, stream_id, &route).await;
        self.metrics
            .dial_duration
            .with_label_values(&[frontend])
            .observe(started.elapsed().as_secs_f64());
        match result {
            Ok((send, recv, guard)) => {
                admission.opened();
                if let Some(c) = &self.counters.to_tunnel {
                    c.inc_by(route.early.len() as u64);
                }
                self.metrics
                    .open_streams
                    .with_label_values(&[frontend])
                    .inc();
                Ok(OpenStream {
                    send,
                    recv,
                    ticket: StreamTicket {
                        stream_id,
                        frontend,
                        started,
                        guard,
                        _budget: admission,
                        pacer: self.budgets.pacer(&target.cluster),
                        _drain: self.streams.token(frontend),
                    },
                })
            }
            Err(e) => {
                self.record_failure(frontend, &e);
                Err(e)
            }
        }
    }

    /// Counts a failed dial (also for failures before [`Broker::dial`], e.g. bad requests).
    ///
    /// No tunnel found while this broker drains (its tunnels take no new streams) counts as
    /// [`DRAINING_LABEL`]: the mux and relay front ends refuse such a stream unprocessed and
    /// their client goes to another broker, and a drain must not read as clusters without a
    /// tunnel.
    pub fn record_failure(&self, frontend: &'static str, e: &DialError) {
        let reason = if e.kind == DialErrorKind::NoTunnel && self.draining.is_cancelled() {
            DRAINING_LABEL
        } else {
            e.kind.metric_label()
        };
        self.metrics
            .dial_failures
            .with_label_values(&[frontend, reason])
            .inc();
        tracing::info!(reason = %e, label = reason, "dial failed");
    }

    async fn dial_inner(
        &self,
        target: &Target,
        stream_id: u64,
        route: &Route<'_>,
    ) -> Result<(StreamTx, StreamRx, StreamGuard), DialError> {
        let timeout = route
            .timeout
            .unwrap_or(self.dial_timeout)
            .min(Duration::from_secs(60));
        let trace = tether_telemetry::propagation::inject(&tracing::Span::current());
        let early = &route.early;
        // A tunnel whose agent did not take the stream (GOAWAY: the tunnel is no longer picked;
        // or REFUSED_STREAM) fails it as NoTunnel, nothing dialled: the stream goes to the next
        // local tunnel, then the peers.
        let mut not_taken = None;
        for _ in 0..MAX_LOCAL_TUNNELS_TRIED {
            let Some(tunnel) = self.routes.borrow().pick(&target.cluster) else {
                break;
            };
            match tunnel.open(target, stream_id, timeout, &trace, early).await {
                Err(e) if e.kind == DialErrorKind::NoTunnel => {
                    tracing::debug!(tunnel = tunnel.id, reason = %e, "stream not taken: trying another tunnel");
                    not_taken = Some(e);
                }
                r => return r,
            }
        }
        let peers = if route.may_relay {
            self.peers.borrow().clone()
        } else {
            Arc::default()
        };
        for peer in peers.iter() {
            // A peer that has no tunnel (or did not take the stream) drops the early bytes with
            // its refusal; the next one gets them again. A stream a peer took and then lost
            // (`TunnelLost`: its agent, or the link to the peer, failed under it) may have been
            // dialled already, and its early data written: it is not sent again (at most one
            // dial per stream).
            match peer.open(target, stream_id, timeout, &trace, early).await {
                Ok(s) => {
                    tracing::debug!(peer = %peer.agent, "stream relayed");
                    return Ok(s);
                }
                Err(e) if e.kind == DialErrorKind::NoTunnel => {
                    continue;
                }
                Err(e) => return Err(e),
            }
        }
        if let Some(e) = not_taken {
            return Err(e);
        }
        if let Some(waited) = self.routes.borrow().suspect(&target.cluster) {
            return Err(DialError::new(
                DialErrorKind::NoTunnel,
                format!(
                    "the tunnel of cluster {:?} on broker {} looks wedged (no bytes from its agent for {} ms) and no peer broker has another; it is being replaced, retry shortly",
                    target.cluster,
                    self.id,
                    waited.as_millis()
                ),
            ));
        }
        Err(DialError::new(
            DialErrorKind::NoTunnel,
            format!(
                "no tunnel is connected for cluster {:?} on broker {} or its {} reachable peer(s)",
                target.cluster,
                self.id,
                peers.len()
            ),
        ))
    }

    /// Splices an opened stream with a client's bytes (`rd`, `wr`), both directions paced by
    /// the stream's budget, then records its end ([`Self::finish`]); returns how it ended.
    pub async fn splice_paced<R, W>(
        &self,
        stream: OpenStream,
        rd: R,
        wr: W,
    ) -> Result<SpliceStats, SpliceError>
    where
        R: tether_tunnel::pump::ChunkReader,
        W: tether_tunnel::pump::AbortableWrite,
    {
        let OpenStream { send, recv, ticket } = stream;
        let pacer = ticket.pacer.clone();
        let r = tether_tunnel::pump::splice(
            crate::budget::PacedReader::new(rd, pacer.clone()),
            crate::budget::PacedWriter::new(wr, pacer),
            send,
            recv,
            self.settings.write_stall_timeout,
            &self.counters,
        )
        .await;
        self.finish(&ticket, &r);
        r
    }

    /// Records the end of a stream.
    pub fn finish(&self, stream: &StreamTicket, result: &Result<SpliceStats, SpliceError>) {
        let frontend = stream.frontend;
        self.metrics
            .open_streams
            .with_label_values(&[frontend])
            .dec();
        let label = match result {
            Ok(_) => "ok",
            Err(e) => e.reason.metric_label(),
        };
        self.metrics
            .stream_duration
            .with_label_values(&[frontend, label])
            .observe(stream.started.elapsed().as_secs_f64());
        match result {
            Ok(s) => tracing::debug!(
                to_cluster = s.to_tunnel_bytes,
                from_cluster = s.from_tunnel_bytes,
                "stream closed"
            ),
            Err(e) => tracing::info!(reason = %e.reason, "stream aborted"),
        }
    }

    /// Open streams across all front ends (each holds a token of [`Broker::streams`]).
    pub fn open_stream_count(&self) -> i64 {
        self.streams.len() as i64
    }
}

/// Whether a dial error is the client's fault (answer it without retry hints).
pub fn is_client_error(kind: DialErrorKind) -> bool {
    matches!(
        kind,
        DialErrorKind::BadRequest | DialErrorKind::Unauthenticated | DialErrorKind::Forbidden
    )
}

/// A broker with no routes, peers or configured clients, default settings and its own metrics
/// registry (unit tests).
#[cfg(test)]
pub(crate) fn test_broker() -> Broker {
    let routes = watch::channel(Arc::new(RouteTable::default())).1;
    let peers = watch::channel(Arc::new(Vec::new())).1;
    Broker::new(
        "b".into(),
        routes,
        Auth::new(&[]),
        BrokerMetrics::new(&prometheus::Registry::new()).expect("metrics"),
        TunnelSettings::default(),
        Duration::from_secs(1),
        peers,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn failures(b: &Broker, frontend: &str, reason: &str) -> u64 {
        b.metrics
            .dial_failures
            .with_label_values(&[frontend, reason])
            .get()
    }

    /// A dial that finds no tunnel counts as `no_tunnel`, unless the broker drains: then its
    /// tunnels take no new stream, the mux and relay front ends refuse it unprocessed, and it
    /// counts as `draining` (a drain must not look like clusters that lost their agents).
    #[tokio::test]
    async fn no_tunnel_while_draining_counts_as_draining() {
        let b = test_broker();
        let client = ClientId {
            name: "ops".into(),
            via: "token",
        };
        let target = Target::api_server("c1");
        let e = b
            .dial("mux", &client, &target, 1, None, Bytes::new())
            .await
            .err()
            .expect("no tunnel");
        assert_eq!(e.kind, DialErrorKind::NoTunnel, "{e}");
        assert_eq!(failures(&b, "mux", "no_tunnel"), 1);
        assert_eq!(failures(&b, "mux", DRAINING_LABEL), 0);

        b.draining.cancel();
        let e = b
            .dial_for_peer(&target, 2, None)
            .await
            .err()
            .expect("no tunnel");
        assert_eq!(e.kind, DialErrorKind::NoTunnel, "{e}");
        assert_eq!(failures(&b, "relay", DRAINING_LABEL), 1);
        assert_eq!(failures(&b, "relay", "no_tunnel"), 0);
        assert_eq!(failures(&b, "mux", "no_tunnel"), 1);
    }
}
