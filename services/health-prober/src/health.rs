//! Damped per-cluster health, as the prober publishes it.
//!
//! A cluster's reported `healthy` flips only after `failure_threshold` consecutive failed
//! probes (or `success_threshold` consecutive good ones), so one lost probe does not flap a
//! dashboard or page someone. The raw last result is kept beside it.

use std::collections::BTreeMap;
use std::sync::{Arc, RwLock};
use std::time::{Duration, SystemTime};

use serde::Serialize;

use crate::probe::ProbeOutcome;

/// Published health of one cluster.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct ClusterHealth {
    pub cluster: String,
    /// Damped verdict.
    pub healthy: bool,
    /// Result of the last probe alone.
    pub last_probe_ok: bool,
    pub consecutive_failures: u32,
    pub consecutive_successes: u32,
    pub latency_ms: f64,
    /// The tunnel's round trip (broker's HTTP/2 PING), when known.
    pub tunnel_rtt_ms: Option<f64>,
    /// Latency minus the tunnel round trip.
    pub target_ms: Option<f64>,
    pub path: String,
    pub status: Option<u16>,
    pub error: Option<String>,
    pub tls_verified: bool,
    /// Unix seconds of the last probe.
    pub probed_at: u64,
    pub probes: u64,
    pub connections_opened: u64,
}

impl ClusterHealth {
    /// Short machine-readable cause of the last result.
    pub fn reason(&self) -> &'static str {
        if self.last_probe_ok {
            return "ProbeSucceeded";
        }
        if self.status.is_some() {
            return "HttpStatus";
        }
        let e = self.error.as_deref().unwrap_or("").to_ascii_lowercase();
        if e.contains("no tunnel") || e.contains("notunnel") {
            "NoTunnel"
        } else if e.contains("timed out") || e.contains("timeout") {
            "Timeout"
        } else if e.contains("tls") {
            "TlsFailed"
        } else if e.contains("refused") || e.contains("unreachable") {
            "TargetUnreachable"
        } else {
            "ProbeFailed"
        }
    }

    /// The published form (KV `tether-health`, `tether.v1.health.get`).
    pub fn to_record(&self, prober: &str) -> tether_control::health::HealthRecord {
        tether_control::health::HealthRecord {
            cluster: self.cluster.clone(),
            healthy: self.healthy,
            reason: self.reason().into(),
            message: self.error.clone().unwrap_or_default(),
            last_probe_ok: self.last_probe_ok,
            latency: tether_control::health::LatencySplit {
                total_ms: self.latency_ms,
                tunnel_ms: self.tunnel_rtt_ms,
                target_ms: self.target_ms,
            },
            probed_at: tether_control::resources::rfc3339(
                SystemTime::UNIX_EPOCH + Duration::from_secs(self.probed_at),
            ),
            consecutive_failures: self.consecutive_failures,
            consecutive_successes: self.consecutive_successes,
            path: self.path.clone(),
            status: self.status,
            tls_verified: self.tls_verified,
            probes: self.probes,
            prober: prober.to_string(),
        }
    }
}

/// Thresholds of the damping.
#[derive(Debug, Clone, Copy)]
pub struct Damping {
    pub failure_threshold: u32,
    pub success_threshold: u32,
}

/// The table every reader sees (admin endpoint, NATS replies).
#[derive(Clone, Default)]
pub struct HealthTable {
    inner: Arc<RwLock<BTreeMap<String, ClusterHealth>>>,
}

fn ms(d: Duration) -> f64 {
    (d.as_secs_f64() * 1e6).round() / 1e3
}

impl HealthTable {
    /// Folds one probe outcome into the cluster's record; returns the record and whether the
    /// damped verdict changed.
    pub fn record(
        &self,
        cluster: &str,
        o: &ProbeOutcome,
        damping: Damping,
        tls_verified: bool,
    ) -> (ClusterHealth, bool) {
        let mut map = self.inner.write().expect("health table lock");
        let prev = map.get(cluster).cloned();
        let (mut fails, mut oks) = prev
            .as_ref()
            .map(|p| (p.consecutive_failures, p.consecutive_successes))
            .unwrap_or((0, 0));
        if o.ok {
            oks += 1;
            fails = 0;
        } else {
            fails += 1;
            oks = 0;
        }
        // A cluster seen for the first time takes the first result at face value.
        let was = prev.as_ref().map(|p| p.healthy);
        let healthy = match was {
            None => o.ok,
            Some(true) => fails < damping.failure_threshold,
            Some(false) => oks >= damping.success_threshold,
        };
        let rtt = o.tunnel_rtt;
        let rec = ClusterHealth {
            cluster: cluster.to_owned(),
            healthy,
            last_probe_ok: o.ok,
            consecutive_failures: fails,
            consecutive_successes: oks,
            latency_ms: ms(o.latency),
            tunnel_rtt_ms: rtt.map(ms),
            target_ms: rtt.map(|r| ms(o.latency.saturating_sub(r))),
            path: o.path.clone(),
            status: o.status,
            error: o.error.clone(),
            tls_verified,
            probed_at: SystemTime::now()
                .duration_since(SystemTime::UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or(0),
            probes: prev.as_ref().map_or(0, |p| p.probes) + 1,
            connections_opened: prev.as_ref().map_or(0, |p| p.connections_opened)
                + u64::from(o.new_connection),
        };
        map.insert(cluster.to_owned(), rec.clone());
        (rec, was.is_some_and(|w| w != healthy))
    }

    /// Drops clusters no longer probed.
    pub fn retain(&self, keep: impl Fn(&str) -> bool) {
        self.inner
            .write()
            .expect("health table lock")
            .retain(|k, _| keep(k));
    }

    /// One cluster's record.
    pub fn get(&self, cluster: &str) -> Option<ClusterHealth> {
        self.inner
            .read()
            .expect("health table lock")
            .get(cluster)
            .cloned()
    }

    pub fn snapshot(&self) -> Vec<ClusterHealth> {
        self.inner
            .read()
            .expect("health table lock")
            .values()
            .cloned()
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn outcome(ok: bool) -> ProbeOutcome {
        ProbeOutcome {
            ok,
            status: ok.then_some(200),
            error: (!ok).then(|| "down".into()),
            latency: Duration::from_millis(3),
            tunnel_rtt: Some(Duration::from_millis(1)),
            path: "/livez".into(),
            new_connection: false,
        }
    }

    #[test]
    fn published_record_names_the_reason_and_splits_latency() {
        let t = HealthTable::default();
        let d = Damping {
            failure_threshold: 1,
            success_threshold: 1,
        };
        let (ok, _) = t.record("c", &outcome(true), d, true);
        let r = ok.to_record("p1");
        assert_eq!((r.reason.as_str(), r.healthy), ("ProbeSucceeded", true));
        assert_eq!(r.latency.tunnel_ms, Some(1.0));
        assert_eq!(r.latency.target_ms, Some(2.0));
        assert_eq!(r.prober, "p1");
        assert!(r.probed_at.ends_with('Z'), "{}", r.probed_at);
        let mut o = outcome(false);
        for (err, reason) in [
            (
                "broker refused the dial (NoTunnel): no tunnel is connected",
                "NoTunnel",
            ),
            ("probe timed out after 5s", "Timeout"),
            ("dial 127.0.0.1:1: Connection refused", "TargetUnreachable"),
            ("TLS to target: invalid certificate", "TlsFailed"),
            ("something else", "ProbeFailed"),
        ] {
            o.status = None;
            o.error = Some(err.into());
            let (rec, _) = t.record("c", &o, d, true);
            assert_eq!(rec.reason(), reason, "{err}");
            assert_eq!(rec.to_record("p").message, err);
        }
        o.status = Some(503);
        o.error = Some("/livez answered HTTP 503".into());
        assert_eq!(t.record("c", &o, d, true).0.reason(), "HttpStatus");
    }

    #[test]
    fn damping_needs_consecutive_failures() {
        let t = HealthTable::default();
        let d = Damping {
            failure_threshold: 2,
            success_threshold: 1,
        };
        assert!(t.record("c", &outcome(true), d, true).0.healthy);
        let (r, changed) = t.record("c", &outcome(false), d, true);
        assert!(r.healthy && !changed, "one failure must not flip");
        let (r, changed) = t.record("c", &outcome(false), d, true);
        assert!(!r.healthy && changed);
        let (r, changed) = t.record("c", &outcome(true), d, true);
        assert!(r.healthy && changed);
        assert_eq!(r.target_ms, Some(2.0));
        assert_eq!(r.probes, 4);
    }
}
