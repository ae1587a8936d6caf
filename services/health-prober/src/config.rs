//! health-prober configuration (YAML); documented in docs/configuration.md.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use serde::Deserialize;
use tether_config::{ConfigError, Validate};

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProberConfig {
    pub broker: BrokerAccess,
    /// Time between the starts of two probe rounds.
    #[serde(default = "default_interval", with = "humantime_serde")]
    pub interval: Duration,
    /// Budget of one probe (dial + TLS + request).
    #[serde(default = "default_timeout", with = "humantime_serde")]
    pub timeout: Duration,
    /// Probes in flight at once.
    #[serde(default = "default_concurrency")]
    pub concurrency: usize,
    /// Consecutive failures before a healthy cluster is reported unhealthy.
    #[serde(default = "default_failures")]
    pub failure_threshold: u32,
    /// Consecutive successes before an unhealthy cluster is reported healthy.
    #[serde(default = "one")]
    pub success_threshold: u32,
    /// Clusters to probe (a static list; the hub's ManagedCluster list replaces it on NATS).
    #[serde(default)]
    pub clusters: Vec<String>,
    /// CA bundle that signed the clusters' API server certificates. Without it the probe's TLS
    /// is not verified (the probe sends no credentials) and results say `tls_verified: false`.
    #[serde(default)]
    pub apiserver_ca: Option<PathBuf>,
    /// Name checked in API server certificates.
    #[serde(default = "default_apiserver_name")]
    pub apiserver_server_name: String,
    /// Per-cluster probe target instead of the API server.
    #[serde(default)]
    pub targets: BTreeMap<String, ProbeTarget>,
    /// Probe connections are replaced after this long (refreshing the tunnel RTT sample).
    #[serde(default = "default_max_age", with = "humantime_serde")]
    pub connection_max_age: Duration,
    #[serde(default = "default_admin")]
    pub admin_listen: SocketAddr,
    /// Hub NATS: when set, the cluster list is the hub's accepted ManagedClusters and results
    /// are published (KV `tether-health`, events, `tether.v1.health.get`).
    #[serde(default)]
    pub nats: Option<NatsAccess>,
    /// Name of this prober in published results (default: host name + pid).
    #[serde(default)]
    pub prober_id: Option<String>,
}

/// How the prober reaches hub NATS, as a hub process (user `tether-hub`).
#[derive(Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NatsAccess {
    /// Hub directory written by `tetherctl init`: URL, server name, CA and the hub user's
    /// password file are read from its `hub.yaml` (each may be overridden below).
    #[serde(default)]
    pub hub_dir: Option<PathBuf>,
    /// `tls://host:port` of hub NATS, or a comma-separated seed list of a NATS cluster.
    #[serde(default)]
    pub url: Option<String>,
    /// Name checked in the NATS server certificate (default: the URL's host).
    #[serde(default)]
    pub server_name: Option<String>,
    /// CA bundle that signed the NATS server certificate.
    #[serde(default)]
    pub ca: Option<PathBuf>,
    /// NATS user (default `tether-hub`).
    #[serde(default = "default_nats_user")]
    pub user: String,
    /// File holding that user's password.
    #[serde(default)]
    pub password_file: Option<PathBuf>,
}

impl std::fmt::Debug for NatsAccess {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Only paths are held here, never the password itself.
        f.debug_struct("NatsAccess")
            .field("hub_dir", &self.hub_dir)
            .field("url", &self.url)
            .field("server_name", &self.server_name)
            .field("ca", &self.ca)
            .field("user", &self.user)
            .field("password_file", &self.password_file)
            .finish()
    }
}

fn default_nats_user() -> String {
    "tether-hub".into()
}

/// How the prober reaches brokers: the native gRPC Dial API.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BrokerAccess {
    /// `https://host:port` of a broker's client TLS listener.
    pub endpoint: String,
    pub server_name: String,
    pub ca: PathBuf,
    /// Client certificate (CN `tether:client:<name>`) and key; or a token file.
    #[serde(default)]
    pub cert: Option<PathBuf>,
    #[serde(default)]
    pub key: Option<PathBuf>,
    #[serde(default)]
    pub token_file: Option<PathBuf>,
}

/// A plain-HTTP or HTTPS target inside the cluster.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProbeTarget {
    pub host: String,
    pub port: u16,
    #[serde(default = "default_path")]
    pub path: String,
    #[serde(default)]
    pub tls: bool,
    /// Dial through this cluster's tunnel instead of the probed cluster's own (simulations and
    /// benchmarks: many cluster names probed through a few real agents).
    #[serde(default)]
    pub via_cluster: Option<String>,
}

fn default_interval() -> Duration {
    Duration::from_secs(30)
}
fn default_timeout() -> Duration {
    Duration::from_secs(5)
}
fn default_concurrency() -> usize {
    64
}
fn default_failures() -> u32 {
    2
}
fn one() -> u32 {
    1
}
fn default_apiserver_name() -> String {
    "kubernetes.default.svc".into()
}
fn default_path() -> String {
    "/healthz".into()
}
fn default_max_age() -> Duration {
    Duration::from_secs(600)
}
fn default_admin() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 0))
}

impl Validate for ProberConfig {
    fn validate(&self) -> Result<(), ConfigError> {
        if !self.broker.endpoint.starts_with("https://") {
            return Err(ConfigError::invalid(
                "broker.endpoint",
                "must be https://host:port",
            ));
        }
        match (&self.broker.cert, &self.broker.key, &self.broker.token_file) {
            (Some(_), Some(_), _) | (None, None, Some(_)) => {}
            (Some(_), None, _) | (None, Some(_), _) => {
                return Err(ConfigError::invalid(
                    "broker.cert",
                    "cert and key go together",
                ));
            }
            (None, None, None) => {
                return Err(ConfigError::invalid(
                    "broker.token_file",
                    "set cert+key or token_file",
                ));
            }
        }
        if self.interval < Duration::from_millis(100) {
            return Err(ConfigError::invalid("interval", "must be at least 100ms"));
        }
        if self.timeout.is_zero() || self.timeout > self.interval {
            return Err(ConfigError::invalid(
                "timeout",
                "must be > 0 and not longer than interval",
            ));
        }
        if self.concurrency == 0 {
            return Err(ConfigError::invalid("concurrency", "must be at least 1"));
        }
        if self.failure_threshold == 0 || self.success_threshold == 0 {
            return Err(ConfigError::invalid(
                "failure_threshold",
                "thresholds must be at least 1",
            ));
        }
        for (i, c) in self.clusters.iter().enumerate() {
            tether_tls::identity::validate_dns_label(c)
                .map_err(|r| ConfigError::invalid(format!("clusters[{i}]"), r))?;
        }
        if let Some(n) = &self.nats {
            if n.hub_dir.is_none()
                && (n.url.is_none() || n.ca.is_none() || n.password_file.is_none())
            {
                return Err(ConfigError::invalid(
                    "nats",
                    "set hub_dir, or url + ca + password_file",
                ));
            }
            if let Some(u) = &n.url
                && u.split(',').any(|u| !u.trim().starts_with("tls://"))
            {
                return Err(ConfigError::invalid(
                    "nats.url",
                    "must be tls://host:port or a comma-separated list of them",
                ));
            }
        }
        for (name, t) in &self.targets {
            if t.port == 0 || t.host.is_empty() || !t.path.starts_with('/') {
                return Err(ConfigError::invalid(
                    format!("targets.{name}"),
                    "needs host, a non-zero port and a path starting with /",
                ));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BASE: &str =
        "broker:\n  endpoint: https://b:8443\n  server_name: b\n  ca: ca.crt\n  token_file: t\n";

    fn parse(extra: &str) -> Result<ProberConfig, ConfigError> {
        tether_config::from_str(
            &format!("{BASE}{extra}"),
            std::path::Path::new("prober.yaml"),
        )
    }

    #[test]
    fn nats_section_needs_a_hub_dir_or_url_ca_and_password() {
        let c = parse("nats:\n  hub_dir: hub\n").unwrap();
        assert_eq!(c.nats.unwrap().user, "tether-hub");
        let e = parse("nats:\n  url: tls://h:4222\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains("nats") && e.contains("password_file"), "{e}");
        let e = parse("nats:\n  url: nats://h:4222\n  ca: c\n  password_file: p\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains("nats.url"), "{e}");
        let e = parse("nats:\n  hub_dir: h\n  password: x\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains("password"), "unknown fields are refused: {e}");
        let c = parse("nats:\n  url: tls://h:4222\n  ca: c\n  password_file: p\n").unwrap();
        assert!(!format!("{:?}", c.nats).contains("secret"));
    }

    #[test]
    fn targets_may_dial_through_another_cluster() {
        let c = parse(
            "targets:\n  sim-1: {host: localhost, port: 6443, tls: true, via_cluster: agent-0}\n",
        )
        .unwrap();
        assert_eq!(c.targets["sim-1"].via_cluster.as_deref(), Some("agent-0"));
    }
}
