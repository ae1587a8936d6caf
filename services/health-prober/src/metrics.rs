//! Prometheus metrics of the health-prober.

use prometheus::{Gauge, HistogramOpts, HistogramVec, IntCounter, IntGaugeVec, Opts, Registry};
use tether_telemetry::Registered as _;

use crate::probe::ProbeOutcome;

#[derive(Clone)]
pub struct ProberMetrics {
    pub probe_duration: HistogramVec,
    pub healthy: IntGaugeVec,
    pub round_duration: Gauge,
    pub rounds_overrun: IntCounter,
    pub connections_opened: IntCounter,
    pub publish_dropped: IntCounter,
    pub published: prometheus::IntCounterVec,
    pub health_requests: IntCounter,
}

impl ProberMetrics {
    pub fn new(registry: &Registry) -> prometheus::Result<Self> {
        let m = Self {
            probe_duration: HistogramVec::new(
                HistogramOpts::new(
                    "tether_prober_probe_duration_seconds",
                    "Probe latency through the tunnel, by result.",
                )
                .buckets(vec![
                    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                ]),
                &["result"],
            )
            .registered(registry)?,
            healthy: IntGaugeVec::new(
                Opts::new(
                    "tether_prober_cluster_healthy",
                    "1 if the cluster's last probe succeeded, else 0.",
                ),
                &["cluster"],
            )
            .registered(registry)?,
            round_duration: Gauge::new(
                "tether_prober_round_duration_seconds",
                "Duration of the last complete probe round.",
            )
            .registered(registry)?,
            rounds_overrun: IntCounter::new(
                "tether_prober_rounds_overrun_total",
                "Rounds skipped because the previous one was still running.",
            )
            .registered(registry)?,
            connections_opened: IntCounter::new(
                "tether_prober_connections_opened_total",
                "Tunnel streams dialled for probing (reused across rounds).",
            )
            .registered(registry)?,
            publish_dropped: IntCounter::new(
                "tether_prober_publish_dropped_total",
                "Probe results not handed to the NATS publisher (queue full for 5 s).",
            )
            .registered(registry)?,
            published: prometheus::IntCounterVec::new(
                Opts::new(
                    "tether_prober_nats_published_total",
                    "Messages published to NATS, by kind (kv, event) and result (ok, error).",
                ),
                &["kind", "result"],
            )
            .registered(registry)?,
            health_requests: IntCounter::new(
                "tether_prober_health_requests_total",
                "tether.v1.health.get requests answered.",
            )
            .registered(registry)?,
        };
        Ok(m)
    }

    pub fn observe(&self, cluster: &str, o: &ProbeOutcome) {
        let result = if o.ok { "ok" } else { "fail" };
        self.probe_duration
            .with_label_values(&[result])
            .observe(o.latency.as_secs_f64());
        self.healthy
            .with_label_values(&[cluster])
            .set(i64::from(o.ok));
        if o.new_connection {
            self.connections_opened.inc();
        }
    }
}
