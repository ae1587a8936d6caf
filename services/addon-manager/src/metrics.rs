//! Prometheus metrics of the registration controller (units in names).

use prometheus::{
    GaugeVec, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge, Opts,
    Registry,
};

#[derive(Clone)]
pub struct Metrics {
    /// From a cluster's first CSR to its first lease renewal (Joined).
    pub registration_duration_seconds: Histogram,
    pub csrs_signed_total: IntCounterVec,
    pub csrs_denied_total: IntCounterVec,
    pub lease_renewals_total: IntCounter,
    /// Cluster lease renewals written to `tether-leases` (the rest stay in memory).
    pub lease_writes_total: IntCounter,
    pub cluster_lease_age_seconds: GaugeVec,
    pub auth_callout_total: IntCounterVec,
    pub auth_callout_duration_seconds: HistogramVec,
    pub requests_total: IntCounterVec,
    /// Live, non-draining brokers in `tether-brokers` (what add-on agents must connect to).
    pub serving_brokers: IntGauge,
    /// `AddOnConfigChanged` notifications sent because the serving broker set changed.
    pub addon_notifications_total: IntCounter,
    /// 1 while this replica leads the periodic registration controllers.
    pub leader: IntGauge,
    /// CSR signatures lost to another replica's compare-and-swap (that one's certificate won).
    pub csr_sign_conflicts_total: IntCounter,
}

impl Metrics {
    pub fn register(r: &mut Registry) -> Result<Self, prometheus::Error> {
        let m = Self {
            registration_duration_seconds: Histogram::with_opts(
                HistogramOpts::new(
                    "tether_hub_registration_duration_seconds",
                    "Time from a cluster's first CSR to its first lease renewal (Joined)",
                )
                .buckets(vec![
                    0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 3.0, 5.0, 10.0, 30.0, 60.0, 300.0,
                ]),
            )?,
            csrs_signed_total: IntCounterVec::new(
                Opts::new("tether_hub_csrs_signed_total", "CSRs approved and signed"),
                &["kind"],
            )?,
            csrs_denied_total: IntCounterVec::new(
                Opts::new("tether_hub_csrs_denied_total", "CSRs refused or denied"),
                &["reason"],
            )?,
            lease_renewals_total: IntCounter::new(
                "tether_hub_lease_renewals_total",
                "Lease renewals accepted",
            )?,
            lease_writes_total: IntCounter::new(
                "tether_hub_lease_writes_total",
                "Cluster lease renewals written to tether-leases (the others are kept in memory)",
            )?,
            cluster_lease_age_seconds: GaugeVec::new(
                Opts::new(
                    "tether_hub_cluster_lease_age_seconds",
                    "Seconds since each cluster's last lease renewal",
                ),
                &["cluster"],
            )?,
            auth_callout_total: IntCounterVec::new(
                Opts::new(
                    "tether_hub_auth_callout_total",
                    "NATS auth callout decisions",
                ),
                &["credential", "result"],
            )?,
            auth_callout_duration_seconds: HistogramVec::new(
                HistogramOpts::new(
                    "tether_hub_auth_callout_duration_seconds",
                    "Time to decide an auth callout request",
                )
                .buckets(vec![
                    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5,
                ]),
                &["credential"],
            )?,
            requests_total: IntCounterVec::new(
                Opts::new("tether_hub_requests_total", "Control-plane requests served"),
                &["subject", "result"],
            )?,
            serving_brokers: IntGauge::new(
                "tether_hub_serving_brokers",
                "Brokers the add-on config lists (non-draining, renewed within 30 s)",
            )?,
            addon_notifications_total: IntCounter::new(
                "tether_hub_addon_notifications_total",
                "AddOnConfigChanged notifications published because the serving broker set changed",
            )?,
            leader: IntGauge::new(
                "tether_hub_controller_leader",
                "1 while this addon-manager replica leads the lease monitor and CSR garbage collection",
            )?,
            csr_sign_conflicts_total: IntCounter::new(
                "tether_hub_csr_sign_conflicts_total",
                "CSR signatures discarded because another replica signed the CSR first",
            )?,
        };
        r.register(Box::new(m.leader.clone()))?;
        r.register(Box::new(m.csr_sign_conflicts_total.clone()))?;
        r.register(Box::new(m.registration_duration_seconds.clone()))?;
        r.register(Box::new(m.csrs_signed_total.clone()))?;
        r.register(Box::new(m.csrs_denied_total.clone()))?;
        r.register(Box::new(m.lease_renewals_total.clone()))?;
        r.register(Box::new(m.lease_writes_total.clone()))?;
        r.register(Box::new(m.cluster_lease_age_seconds.clone()))?;
        r.register(Box::new(m.auth_callout_total.clone()))?;
        r.register(Box::new(m.auth_callout_duration_seconds.clone()))?;
        r.register(Box::new(m.requests_total.clone()))?;
        r.register(Box::new(m.serving_brokers.clone()))?;
        r.register(Box::new(m.addon_notifications_total.clone()))?;
        Ok(m)
    }
}
