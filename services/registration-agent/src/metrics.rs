//! Prometheus metrics of the registration agent (units in names).

use prometheus::{
    Gauge, Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGaugeVec, Opts, Registry,
};
use tether_telemetry::Registered as _;

#[derive(Clone)]
pub struct AgentMetrics {
    /// From agent start to hub credentials written.
    pub registration_duration_seconds: Histogram,
    pub bootstrap_errors_total: IntCounterVec,
    pub lease_renewals_total: IntCounterVec,
    /// Round trip of one lease renewal request (any result).
    pub lease_renew_duration_seconds: Histogram,
    pub cert_rotations_total: IntCounter,
    pub cert_remaining_seconds: Gauge,
}

impl AgentMetrics {
    pub fn register(r: &Registry) -> Result<Self, prometheus::Error> {
        let m = Self::unregistered();
        r.register(Box::new(m.registration_duration_seconds.clone()))?;
        r.register(Box::new(m.bootstrap_errors_total.clone()))?;
        r.register(Box::new(m.lease_renewals_total.clone()))?;
        r.register(Box::new(m.lease_renew_duration_seconds.clone()))?;
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
            lease_renew_duration_seconds: Histogram::with_opts(
                HistogramOpts::new(
                    "tether_agent_lease_renew_duration_seconds",
                    "Round trip of one lease renewal request to the hub",
                )
                .buckets(vec![
                    0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0,
                ]),
            )
            .expect("valid histogram"),
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

/// Metrics of the add-on agents (label `addon`).
#[derive(Clone)]
pub struct AddOnMetrics {
    /// Configs handed to the runtime, by result.
    pub config_applies_total: IntCounterVec,
    /// Add-on lease renewals, by result.
    pub lease_renewals_total: IntCounterVec,
    /// Add-on certificates obtained, by kind (new, rotation).
    pub certificates_total: IntCounterVec,
    /// Local tunnel-agent process restarts.
    pub agent_restarts_total: IntCounterVec,
    /// Brokers the add-on agent holds a tunnel to.
    pub connected_brokers: IntGaugeVec,
    /// Add-on removals (not installed any more, or the cluster's credentials revoked).
    pub cleanups_total: IntCounterVec,
}

impl AddOnMetrics {
    pub fn register(r: &Registry) -> Result<Self, prometheus::Error> {
        let m = Self {
            config_applies_total: IntCounterVec::new(
                Opts::new(
                    "tether_agent_addon_config_applies_total",
                    "Add-on agent configs applied, by result",
                ),
                &["addon", "result"],
            )
            .registered(r)?,
            lease_renewals_total: IntCounterVec::new(
                Opts::new(
                    "tether_agent_addon_lease_renewals_total",
                    "Add-on lease renewals, by result",
                ),
                &["addon", "result"],
            )
            .registered(r)?,
            certificates_total: IntCounterVec::new(
                Opts::new(
                    "tether_agent_addon_certificates_total",
                    "Add-on client certificates obtained, by kind (new, rotation)",
                ),
                &["addon", "kind"],
            )
            .registered(r)?,
            agent_restarts_total: IntCounterVec::new(
                Opts::new(
                    "tether_agent_addon_process_restarts_total",
                    "Restarts of the local add-on agent process",
                ),
                &["addon"],
            )
            .registered(r)?,
            connected_brokers: IntGaugeVec::new(
                Opts::new(
                    "tether_agent_addon_connected_brokers",
                    "Brokers the add-on agent holds an established tunnel to",
                ),
                &["addon"],
            )
            .registered(r)?,
            cleanups_total: IntCounterVec::new(
                Opts::new(
                    "tether_agent_addon_cleanups_total",
                    "Add-on agents stopped and their credentials removed",
                ),
                &["addon"],
            )
            .registered(r)?,
        };
        Ok(m)
    }
}
