//! Cluster health as the health-prober publishes it, and the `clusteradm proxy health`-style
//! table built from it.
//!
//! - KV bucket `tether-health`, key `<cluster>` → [`HealthRecord`] (the latest damped result).
//! - `tether.v1.health.get` request/reply: [`HealthGetRequest`] → [`HealthGetReply`], answered
//!   from the prober's memory (queue group `tether-health`, so several probers may run).
//! - Transitions of the damped verdict: an `resources::Event` on
//!   `tether.v1.events.health.<cluster>` (reasons [`REASON_HEALTHY`] / [`REASON_UNHEALTHY`]).
//!
//! [`proxy_health`] reads ManagedClusters, the `cluster-proxy` ManagedClusterAddOns and the
//! prober's answer and returns the rows `tetherctl proxy health` prints ([`render_table`]); the
//! demo uses the same functions.

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

use crate::addons::{CLUSTER_PROXY, ManagedClusterAddOn, condition as addon_condition};
use crate::connect::ControlError;
use crate::resources::ManagedCluster;
use crate::store::Store as _;
use crate::store::{Bucket, HubStore};
use crate::subjects;

/// Event reason when a cluster's damped health becomes true.
pub const REASON_HEALTHY: &str = "ClusterProbeSucceeded";
/// Event reason when a cluster's damped health becomes false.
pub const REASON_UNHEALTHY: &str = "ClusterProbeFailed";

/// Latency of the last probe, split into the tunnel's round trip and the target's time.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct LatencySplit {
    /// Whole probe (request sent → response read), milliseconds.
    pub total_ms: f64,
    /// The tunnel's round trip (the broker's HTTP/2 PING), when measured.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tunnel_ms: Option<f64>,
    /// `totalMs − tunnelMs`: the time spent in the target.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target_ms: Option<f64>,
}

/// Value of `tether-health/<cluster>` and one item of [`HealthGetReply`].
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct HealthRecord {
    pub cluster: String,
    /// Damped verdict: flips only after `failure_threshold` consecutive failures (or
    /// `success_threshold` successes).
    pub healthy: bool,
    /// Short machine-readable cause of the last result: `ProbeSucceeded`, `NoTunnel`,
    /// `TargetUnreachable`, `Timeout`, `TlsFailed`, `HttpStatus`, `ProbeFailed`.
    pub reason: String,
    /// Detail of the last result (the error, or empty).
    #[serde(default)]
    pub message: String,
    /// Result of the last probe alone.
    pub last_probe_ok: bool,
    pub latency: LatencySplit,
    /// RFC 3339 time of the last probe.
    pub probed_at: String,
    pub consecutive_failures: u32,
    pub consecutive_successes: u32,
    /// Path probed (`/livez`, `/healthz` or the configured target's).
    #[serde(default)]
    pub path: String,
    /// HTTP status of the last answer.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<u16>,
    /// Whether the target's TLS certificate was verified.
    #[serde(default)]
    pub tls_verified: bool,
    /// Probes of this cluster since the prober started.
    #[serde(default)]
    pub probes: u64,
    /// Id of the prober that measured it.
    #[serde(default)]
    pub prober: String,
}

/// Body of `tether.v1.health.get`.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct HealthGetRequest {
    /// Only this cluster (all clusters when absent).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cluster: Option<String>,
}

/// Reply to `tether.v1.health.get`.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct HealthGetReply {
    /// Id of the answering prober.
    pub prober: String,
    /// Its probe interval in seconds.
    pub interval_seconds: f64,
    /// Clusters it probes (sorted by name; filtered when the request named one).
    pub clusters: Vec<HealthRecord>,
}

/// One row of `tetherctl proxy health` (the columns of `clusteradm proxy health`, plus detail
/// for `-o wide|json|yaml`).
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ProxyHealthRow {
    pub cluster_name: String,
    /// A `cluster-proxy` ManagedClusterAddOn exists for the cluster.
    pub installed: bool,
    /// The add-on's Available condition (`True`, `False`, `Unknown`).
    pub available: String,
    /// The prober's damped verdict (`True`, `False`, `Unknown` when not probed).
    pub probed_health: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub latency: Option<LatencySplit>,
    #[serde(default)]
    pub reason: String,
    #[serde(default)]
    pub message: String,
    #[serde(default)]
    pub probed_at: String,
}

fn fmt_ms(ms: f64) -> String {
    format!("{ms:.2}ms")
}

/// Builds the rows: every accepted cluster and every cluster with a `cluster-proxy` add-on,
/// sorted by name (only `only` when given).
pub fn proxy_health_rows(
    clusters: &[ManagedCluster],
    addons: &[ManagedClusterAddOn],
    health: &[HealthRecord],
    only: Option<&str>,
) -> Vec<ProxyHealthRow> {
    let addons: BTreeMap<&str, &ManagedClusterAddOn> = addons
        .iter()
        .filter(|a| a.metadata.name == CLUSTER_PROXY)
        .map(|a| (a.cluster(), a))
        .collect();
    let health: BTreeMap<&str, &HealthRecord> =
        health.iter().map(|h| (h.cluster.as_str(), h)).collect();
    let mut names: BTreeSet<&str> = clusters
        .iter()
        .filter(|c| c.spec.hub_accepts_client)
        .map(|c| c.metadata.name.as_str())
        .collect();
    names.extend(addons.keys().copied());
    if let Some(o) = only {
        names.retain(|n| *n == o);
        if names.is_empty() && clusters.iter().any(|c| c.metadata.name == o) {
            names.insert(o);
        }
    }
    names
        .into_iter()
        .map(|name| {
            let addon = addons.get(name);
            let h = health.get(name);
            ProxyHealthRow {
                cluster_name: name.to_string(),
                installed: addon.is_some(),
                available: addon
                    .and_then(|a| a.condition(addon_condition::AVAILABLE))
                    .unwrap_or("Unknown")
                    .to_string(),
                probed_health: match h {
                    Some(h) if h.healthy => "True".into(),
                    Some(_) => "False".into(),
                    None => "Unknown".into(),
                },
                latency: h.filter(|h| h.last_probe_ok).map(|h| h.latency.clone()),
                reason: h.map(|h| h.reason.clone()).unwrap_or_default(),
                message: h.map(|h| h.message.clone()).unwrap_or_default(),
                probed_at: h.map(|h| h.probed_at.clone()).unwrap_or_default(),
            }
        })
        .collect()
}

/// The table as text: `CLUSTER NAME  INSTALLED  AVAILABLE  PROBED HEALTH  LATENCY`, and with
/// `wide` also `TUNNEL  TARGET  REASON  PROBED AT`.
pub fn render_table(rows: &[ProxyHealthRow], wide: bool) -> String {
    let mut table: Vec<Vec<String>> = vec![{
        let mut h = vec![
            "CLUSTER NAME",
            "INSTALLED",
            "AVAILABLE",
            "PROBED HEALTH",
            "LATENCY",
        ];
        if wide {
            h.extend(["TUNNEL", "TARGET", "REASON", "PROBED AT"]);
        }
        h.into_iter().map(String::from).collect()
    }];
    for r in rows {
        let mut line = vec![
            r.cluster_name.clone(),
            if r.installed { "True" } else { "False" }.to_string(),
            r.available.clone(),
            r.probed_health.clone(),
            r.latency
                .as_ref()
                .map(|l| fmt_ms(l.total_ms))
                .unwrap_or_else(|| "-".into()),
        ];
        if wide {
            let l = r.latency.as_ref();
            line.push(
                l.and_then(|l| l.tunnel_ms)
                    .map(fmt_ms)
                    .unwrap_or("-".into()),
            );
            line.push(
                l.and_then(|l| l.target_ms)
                    .map(fmt_ms)
                    .unwrap_or("-".into()),
            );
            line.push(if r.message.is_empty() {
                r.reason.clone()
            } else {
                format!("{}: {}", r.reason, r.message)
            });
            line.push(r.probed_at.clone());
        }
        table.push(line);
    }
    format_table(&table)
}

/// Left-aligned columns three spaces apart (the last column unpadded), one line per row: the
/// tables of `tetherctl get …`.
pub fn format_table(rows: &[Vec<String>]) -> String {
    let cols = rows.first().map(Vec::len).unwrap_or(0);
    let widths: Vec<usize> = (0..cols)
        .map(|c| rows.iter().map(|r| r[c].len()).max().unwrap_or(0))
        .collect();
    let mut out = String::new();
    for r in rows {
        let cells: Vec<String> = r
            .iter()
            .enumerate()
            .map(|(i, v)| {
                if i + 1 == cols {
                    v.clone()
                } else {
                    format!("{v:<w$}", w = widths[i])
                }
            })
            .collect();
        out.push_str(cells.join("   ").trim_end());
        out.push('\n');
    }
    out
}

/// What [`proxy_health`] found.
#[derive(Debug, Clone)]
pub struct ProxyHealth {
    pub rows: Vec<ProxyHealthRow>,
    /// The prober that answered, or why none did (rows then say PROBED HEALTH Unknown).
    pub prober: Result<String, String>,
}

/// Reads clusters and add-ons from KV and asks a prober (`tether.v1.health.get`); instant —
/// nothing is probed on demand.
pub async fn proxy_health(
    client: &async_nats::Client,
    store: &HubStore,
    only: Option<&str>,
) -> Result<ProxyHealth, ControlError> {
    let clusters: Vec<ManagedCluster> = store
        .list::<ManagedCluster>(Bucket::Clusters)
        .await?
        .into_iter()
        .map(|(_, v, _)| v)
        .collect();
    let addons: Vec<ManagedClusterAddOn> = store
        .list::<ManagedClusterAddOn>(Bucket::ManagedClusterAddOns)
        .await?
        .into_iter()
        .map(|(_, v, _)| v)
        .collect();
    let reply = crate::connect::request_json::<_, HealthGetReply>(
        client,
        subjects::HEALTH_GET.to_string(),
        &HealthGetRequest {
            cluster: only.map(str::to_string),
        },
    )
    .await;
    let (health, prober) = match reply {
        Ok(r) => (r.clusters, Ok(r.prober)),
        Err(e) => (Vec::new(), Err(e.to_string())),
    };
    Ok(ProxyHealth {
        rows: proxy_health_rows(&clusters, &addons, &health, only),
        prober,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::resources::set_condition;

    #[test]
    fn rows_join_clusters_addons_and_health() {
        let mut a = ManagedCluster::new("a");
        a.spec.hub_accepts_client = true;
        let mut b = ManagedCluster::new("b");
        b.spec.hub_accepts_client = true;
        let pending = ManagedCluster::new("pending");
        let mut mca = ManagedClusterAddOn::new("a", CLUSTER_PROXY);
        set_condition(
            &mut mca.status.conditions,
            addon_condition::AVAILABLE,
            "True",
            "ManagedClusterAddOnLeaseUpdated",
            "",
        );
        let h = HealthRecord {
            cluster: "a".into(),
            healthy: true,
            reason: "ProbeSucceeded".into(),
            last_probe_ok: true,
            latency: LatencySplit {
                total_ms: 1.5,
                tunnel_ms: Some(0.5),
                target_ms: Some(1.0),
            },
            ..Default::default()
        };
        let rows = proxy_health_rows(&[a, b, pending], &[mca], &[h], None);
        assert_eq!(rows.len(), 2);
        assert_eq!(
            (
                rows[0].installed,
                rows[0].available.as_str(),
                rows[0].probed_health.as_str()
            ),
            (true, "True", "True")
        );
        assert_eq!(
            (
                rows[1].installed,
                rows[1].available.as_str(),
                rows[1].probed_health.as_str()
            ),
            (false, "Unknown", "Unknown")
        );
        let t = render_table(&rows, false);
        assert!(t.starts_with("CLUSTER NAME   INSTALLED   AVAILABLE   PROBED HEALTH   LATENCY"));
        assert!(t.contains("1.50ms"), "{t}");
        let w = render_table(&rows, true);
        assert!(w.contains("TUNNEL") && w.contains("0.50ms"), "{w}");
    }
}
