//! Prometheus metrics of the tunnel-agent. Names carry their unit.

use prometheus::{
    Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts,
    Registry,
};
use tether_telemetry::Registered as _;

#[derive(Clone)]
pub struct AgentMetrics {
    /// Established tunnels per broker endpoint.
    pub tunnels: IntGaugeVec,
    pub tunnel_connects: IntCounterVec,
    pub open_streams: IntGauge,
    pub dial_duration: Histogram,
    pub dial_failures: IntCounterVec,
    /// Target names resolved for dials, by result (`cached`, `resolved`, `failed`).
    pub dial_resolutions: IntCounterVec,
    pub bytes: IntCounterVec,
    pub stream_duration: HistogramVec,
    pub tunnel_window_changes: IntCounter,
    /// Tunnels torn down as wedged, by detector (watchdog, keepalive).
    pub tunnel_wedged: IntCounterVec,
}

impl AgentMetrics {
    pub fn new(registry: &Registry) -> prometheus::Result<Self> {
        // Process-wide: the runtime's idle polling (`--idle-poll-us`).
        tether_idlepoll::register(registry)?;
        let m = Self {
            tunnels: IntGaugeVec::new(
                Opts::new(
                    "tether_agent_tunnels",
                    "Established tunnels, per broker endpoint.",
                ),
                &["endpoint"],
            ).registered(registry)?,
            tunnel_connects: IntCounterVec::new(
                Opts::new(
                    "tether_agent_tunnel_connects_total",
                    "Tunnel connection attempts by result.",
                ),
                &["endpoint", "result"],
            ).registered(registry)?,
            open_streams: IntGauge::new(
                "tether_agent_open_streams",
                "Streams currently open to targets.",
            ).registered(registry)?,
            dial_duration: Histogram::with_opts(
                HistogramOpts::new(
                    "tether_agent_dial_duration_seconds",
                    "Time to dial a target.",
                )
                .buckets(vec![
                    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                    10.0,
                ]),
            ).registered(registry)?,
            dial_resolutions: IntCounterVec::new(
                Opts::new(
                    "tether_agent_dial_resolutions_total",
                    "Target names resolved for dials (literal addresses not counted): result=cached (dns_cache hit), resolved (asked the system resolver), failed (no address).",
                ),
                &["result"],
            ).registered(registry)?,
            dial_failures: IntCounterVec::new(
                Opts::new(
                    "tether_agent_dial_failures_total",
                    "Failed target dials by reason.",
                ),
                &["reason"],
            ).registered(registry)?,
            bytes: IntCounterVec::new(
                Opts::new(
                    "tether_agent_bytes_total",
                    "Bytes carried, by direction (to_target, from_target).",
                ),
                &["direction"],
            ).registered(registry)?,
            stream_duration: HistogramVec::new(
                HistogramOpts::new(
                    "tether_agent_stream_duration_seconds",
                    "Lifetime of tunnelled streams.",
                )
                .buckets(vec![0.01, 0.1, 1.0, 10.0, 60.0, 600.0, 3600.0]),
                &["result"],
            ).registered(registry)?,
            tunnel_window_changes: IntCounter::new(
                "tether_agent_tunnel_window_changes_total",
                "Changes of a tunnel's adaptive receive window (raised to fit bandwidth x round trip, or back to the base after idling).",
            ).registered(registry)?,
            tunnel_wedged: IntCounterVec::new(
                Opts::new(
                    "tether_agent_tunnel_wedged_total",
                    "Tunnels torn down (and redialled) because they moved no bytes while bytes waited: detector=watchdog (bytes to the broker unanswered for tunnel.stall_timeout) or keepalive (PING unanswered for tunnel.keepalive_timeout).",
                ),
                &["detector"],
            ).registered(registry)?,
        };
        Ok(m)
    }

    pub fn counter(&self, direction: &str) -> IntCounter {
        self.bytes.with_label_values(&[direction])
    }
}
