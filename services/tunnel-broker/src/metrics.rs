//! Prometheus metrics of the tunnel-broker. Names carry their unit.

use prometheus::{
    HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts, Registry,
};
use tether_telemetry::Registered as _;

#[derive(Clone)]
pub struct BrokerMetrics {
    pub tunnels: IntGauge,
    pub tunnel_connects: IntCounterVec,
    pub open_streams: IntGaugeVec,
    pub dial_duration: HistogramVec,
    pub dial_failures: IntCounterVec,
    pub bytes: IntCounterVec,
    pub stream_duration: HistogramVec,
    /// 1 while a control-plane session is up (presence renewed, KV followed).
    pub control_plane_connected: IntGauge,
    pub presence_renewals: IntCounterVec,
    /// Relay peers discovered from presence (connectors running).
    pub discovered_peers: IntGauge,
    /// Relay connections to peers that are up (static and discovered).
    pub relay_peers_connected: IntGauge,
    pub known_clusters: IntGauge,
    pub hub_clients: IntGauge,
    pub tunnels_closed_by_hub: IntCounter,
    pub tunnel_window_changes: IntCounter,
    /// Tunnels torn down as wedged, by detector (watchdog, keepalive).
    pub tunnel_wedged: IntCounterVec,
    /// Times a tunnel turned suspect (the watchdog's early stage: new streams go elsewhere).
    pub tunnel_suspect: IntCounter,
    /// Dials refused by a fairness budget (budget).
    pub budget_rejections: IntCounterVec,
    /// Clusters whose bytes are paced by the CPU share now (budget::FairShare).
    pub paced_clusters: IntGauge,
    /// konnectivity packets answered with an error, cancelled dials and close timeouts.
    pub konnectivity_errors: IntCounterVec,
    pub service_proxy_requests: IntCounterVec,
    pub service_proxy_duration: HistogramVec,
    pub service_proxy_stripped_headers: IntCounter,
    pub service_proxy_allowlist_entries: IntGauge,
    pub service_proxy_allowlist_rejected: IntCounter,
    /// Client connections accepted, by listener (`plain`, `tls`) and the protocol they spoke
    /// (`h2`: gRPC Dial, DialRaw, konnectivity; `http1`: CONNECT).
    pub client_connections: IntCounterVec,
    /// Agent tunnels established, by protocol (`mux`: `tether-tunnel/2`, `h2`:
    /// `tether-tunnel/1`).
    pub tunnel_connections: IntCounterVec,
    /// Relay connections this broker opened to peer brokers, by protocol (`mux`:
    /// `tether-relay/2`, `h2`: `tether-relay/1`).
    pub relay_connections: IntCounterVec,
}

impl BrokerMetrics {
    pub fn new(registry: &Registry) -> prometheus::Result<Self> {
        // Process-wide: the runtime's idle polling (`--idle-poll-us`).
        tether_idlepoll::register(registry)?;
        let m = Self {
            tunnels: IntGauge::new(
                "tether_broker_tunnels",
                "Agent tunnels currently registered.",
            ).registered(registry)?,
            tunnel_connects: IntCounterVec::new(
                Opts::new(
                    "tether_broker_tunnel_connects_total",
                    "Agent connection attempts by result.",
                ),
                &["result"],
            ).registered(registry)?,
            open_streams: IntGaugeVec::new(
                Opts::new(
                    "tether_broker_open_streams",
                    "Client streams currently open, by front end.",
                ),
                &["frontend"],
            ).registered(registry)?,
            dial_duration: HistogramVec::new(
                HistogramOpts::new(
                    "tether_broker_dial_duration_seconds",
                    "Time from a client's request to the agent's dial answer.",
                )
                .buckets(vec![
                    0.0002, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                    2.5, 5.0, 10.0,
                ]),
                &["frontend"],
            ).registered(registry)?,
            dial_failures: IntCounterVec::new(
                Opts::new(
                    "tether_broker_dial_failures_total",
                    "Failed client dials by reason.",
                ),
                &["frontend", "reason"],
            ).registered(registry)?,
            bytes: IntCounterVec::new(
                Opts::new(
                    "tether_broker_bytes_total",
                    "Bytes carried, by direction (to_cluster, from_cluster).",
                ),
                &["direction"],
            ).registered(registry)?,
            stream_duration: HistogramVec::new(
                HistogramOpts::new(
                    "tether_broker_stream_duration_seconds",
                    "Lifetime of client streams.",
                )
                .buckets(vec![0.01, 0.1, 1.0, 10.0, 60.0, 600.0, 3600.0]),
                &["frontend", "result"],
            ).registered(registry)?,
            control_plane_connected: IntGauge::new(
                "tether_broker_control_plane_connected",
                "1 while the broker's control-plane session is up (presence renewed, hub state followed), else 0.",
            ).registered(registry)?,
            presence_renewals: IntCounterVec::new(
                Opts::new(
                    "tether_broker_presence_renewals_total",
                    "Writes of this broker's presence entry, by result.",
                ),
                &["result"],
            ).registered(registry)?,
            discovered_peers: IntGauge::new(
                "tether_broker_discovered_peers",
                "Relay peers discovered from the other brokers' presence.",
            ).registered(registry)?,
            relay_peers_connected: IntGauge::new(
                "tether_broker_relay_peers_connected",
                "Relay connections to peer brokers that are up.",
            ).registered(registry)?,
            known_clusters: IntGauge::new(
                "tether_broker_known_clusters",
                "ManagedClusters read from the hub (0 without a control plane).",
            ).registered(registry)?,
            hub_clients: IntGauge::new(
                "tether_broker_hub_clients",
                "Hub clients (HubClient resources) the broker accepts.",
            ).registered(registry)?,
            tunnels_closed_by_hub: IntCounter::new(
                "tether_broker_tunnels_closed_by_hub_total",
                "Tunnels closed because their cluster was deleted, denied or never registered on the hub.",
            ).registered(registry)?,
            tunnel_window_changes: IntCounter::new(
                "tether_broker_tunnel_window_changes_total",
                "Changes of a tunnel's adaptive receive window (raised to fit bandwidth x round trip, or back to the base after idling).",
            ).registered(registry)?,
            tunnel_wedged: IntCounterVec::new(
                Opts::new(
                    "tether_broker_tunnel_wedged_total",
                    "Agent tunnels torn down because they moved no bytes while bytes waited: detector=watchdog (bytes to the agent unanswered for tunnel.stall_timeout) or keepalive (PING unanswered for tunnel.keepalive_timeout).",
                ),
                &["detector"],
            ).registered(registry)?,
            tunnel_suspect: IntCounter::new(
                "tether_broker_tunnel_suspect_total",
                "Times an agent tunnel turned suspect: bytes to the agent and the watchdog's probe PING unanswered for half of tunnel.stall_timeout; new streams go to another tunnel or replica until bytes arrive again.",
            ).registered(registry)?,
            budget_rejections: IntCounterVec::new(
                Opts::new(
                    "tether_broker_budget_rejections_total",
                    "Dials refused by a fairness budget: budget (cluster_streams, cluster_pending_dials, client_streams, client_pending_dials) and owner (the cluster or client name; clusters with no tunnel on this broker count as \"other\").",
                ),
                &["budget", "owner"],
            ).registered(registry)?,
            paced_clusters: IntGauge::new(
                "tether_broker_paced_clusters",
                "Clusters whose streams the broker paces now: the CPU is contended (runtime lag above budgets.cpu_share_lag, or host CPU pressure above 20 %) and the cluster floods (refused by a budget, or most of the broker's bytes for 1 s) while other clusters hold streams.",
            ).registered(registry)?,
            konnectivity_errors: IntCounterVec::new(
                Opts::new(
                    "tether_broker_konnectivity_errors_total",
                    "konnectivity Proxy events by kind: second_dial, unknown_connect_id, oversize_data (answered with an error packet), dial_cancelled (DIAL_CLS or stream end during a dial), close_timeout (target still open 5 s after CLOSE_REQ, reset), unexpected_packet (ignored).",
                ),
                &["kind"],
            ).registered(registry)?,
            service_proxy_requests: IntCounterVec::new(
                Opts::new(
                    "tether_broker_service_proxy_requests_total",
                    "Service-proxy requests by cluster (empty before the cluster was admitted) and status code.",
                ),
                &["cluster", "code"],
            ).registered(registry)?,
            service_proxy_duration: HistogramVec::new(
                HistogramOpts::new(
                    "tether_broker_service_proxy_request_duration_seconds",
                    "Time from a service-proxy request to its response head, by cluster.",
                )
                .buckets(vec![
                    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                    10.0,
                ]),
                &["cluster"],
            ).registered(registry)?,
            service_proxy_stripped_headers: IntCounter::new(
                "tether_broker_service_proxy_stripped_headers_total",
                "Client-supplied Impersonate-* and tether-* headers removed by the service proxy.",
            ).registered(registry)?,
            service_proxy_allowlist_entries: IntGauge::new(
                "tether_broker_service_proxy_allowlist_entries",
                "Services in the service proxy's effective allowlist (config plus hub).",
            ).registered(registry)?,
            service_proxy_allowlist_rejected: IntCounter::new(
                "tether_broker_service_proxy_allowlist_rejected_total",
                "ServiceProxyAllowlist updates ignored as invalid (the last good version stays).",
            ).registered(registry)?,
            client_connections: IntCounterVec::new(
                Opts::new(
                    "tether_broker_client_connections_total",
                    "Client connections accepted, by listener (plain, tls) and protocol (h2, http1).",
                ),
                &["listener", "protocol"],
            ).registered(registry)?,
            tunnel_connections: IntCounterVec::new(
                Opts::new(
                    "tether_broker_tunnel_connections_total",
                    "Agent tunnels established (hello answered), by protocol (mux = tether-tunnel/2, h2 = tether-tunnel/1).",
                ),
                &["protocol"],
            ).registered(registry)?,
            relay_connections: IntCounterVec::new(
                Opts::new(
                    "tether_broker_relay_connections_total",
                    "Relay connections opened to peer brokers, by protocol (mux = tether-relay/2, h2 = tether-relay/1).",
                ),
                &["protocol"],
            ).registered(registry)?,
        };
        Ok(m)
    }

    pub fn counter(&self, direction: &str) -> IntCounter {
        self.bytes.with_label_values(&[direction])
    }
}
