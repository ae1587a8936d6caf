//! Prometheus metrics of the registration agent (units in names).

use prometheus::{Gauge, Histogram, HistogramOpts, IntCounter, IntCounterVec, Opts, Registry};

#[derive(Clone)]
pub struct AgentMetrics {
    /// From agent start to hub credentials written.
    pub registration_duration_seconds: Histogram,
    pub bootstrap_errors_total: IntCounterVec,
    pub lease_renewals_total: IntCounterVec,
    pub cert_rotations_total: IntCounter,
    pub cert_remaining_seconds: Gauge,
}

impl AgentMetrics {
    pub fn register(r: &Registry) -> Result<Self, prometheus::Error> {
        let m = Self::unregistered();
        r.register(Box::new(m.registration_duration_seconds.clone()))?;
        r.register(Box::new(m.bootstrap_errors_total.clone()))?;
        r.register(Box::new(m.lease_renewals_total.clone()))?;
        r.register(Box::new(m.cert_rotations_total.clone()))?;
        r.register(Box::new(m.cert_remaining_seconds.clone()))?;
        Ok(m)
    }

    /// Metrics not attached to any registry (simulated clusters share one registered set).
    pub fn unregistered() -> Self {
        Self {
            registration_duration_seconds: Histogram::with_opts(
                HistogramOpts::new(
                    "tether_agent_registration_duration_seconds",
                    "Time from agent start to hub credentials written",
                )
                .buckets(vec![
                    0.1, 0.25, 0.5, 1.0, 2.0, 3.0, 5.0, 10.0, 30.0, 60.0, 300.0,
                ]),
            )
            .expect("valid histogram"),
            bootstrap_errors_total: IntCounterVec::new(
                Opts::new(
                    "tether_agent_bootstrap_errors_total",
                    "Bootstrap failures by cause",
                ),
                &["cause"],
            )
            .expect("valid counter"),
            lease_renewals_total: IntCounterVec::new(
                Opts::new(
                    "tether_agent_lease_renewals_total",
                    "Lease renewals by result",
                ),
                &["result"],
            )
            .expect("valid counter"),
            cert_rotations_total: IntCounter::new(
                "tether_agent_cert_rotations_total",
                "Client certificate rotations",
            )
            .expect("valid counter"),
            cert_remaining_seconds: Gauge::new(
                "tether_agent_cert_remaining_seconds",
                "Seconds until the client certificate expires",
            )
            .expect("valid gauge"),
        }
    }
}
