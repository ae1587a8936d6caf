//! tunnel-broker configuration (YAML). Every field is documented in docs/configuration.md.

use std::net::SocketAddr;
use std::time::Duration;

use serde::Deserialize;
use tether_config::{ConfigError, Validate};
use tether_tls::TlsFiles;
use tether_tunnel::TunnelSettings;

/// Default dial timeout when a client does not ask for one.
pub const DEFAULT_DIAL_TIMEOUT: Duration = Duration::from_secs(5);
/// Default cap of dials waiting for an answer on one tunnel.
pub const DEFAULT_MAX_PENDING_DIALS: usize = 1024;

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BrokerConfig {
    /// Broker replica id (appears in logs, metrics and the hello sent to agents).
    pub id: String,
    pub tls: TlsFiles,
    #[serde(default = "default_reload", with = "humantime_serde")]
    pub tls_reload_interval: Duration,
    /// Where agents connect (mTLS).
    pub agent_listen: SocketAddr,
    /// Plain-TCP HTTP CONNECT listener for hub clients (token auth). Optional.
    #[serde(default)]
    pub client_listen: Option<SocketAddr>,
    /// TLS listener for hub clients: HTTP CONNECT over TLS (ALPN http/1.1) and the gRPC APIs
    /// (ALPN h2). Client certificate or bearer token.
    #[serde(default)]
    pub client_tls_listen: Option<SocketAddr>,
    #[serde(default = "default_admin")]
    pub admin_listen: SocketAddr,
    #[serde(default = "default_dial_timeout", with = "humantime_serde")]
    pub dial_timeout: Duration,
    #[serde(default = "default_max_pending")]
    pub max_pending_dials_per_tunnel: usize,
    /// Time open streams get to finish when the broker drains (SIGTERM).
    #[serde(default = "default_grace", with = "humantime_serde")]
    pub drain_grace: Duration,
    /// Hub clients and what they may reach.
    #[serde(default)]
    pub clients: Vec<ClientConfig>,
    #[serde(default)]
    pub tunnel: TunnelSettings,
    /// Fairness budgets per cluster and per client (budget).
    #[serde(default)]
    pub budgets: crate::budget::BudgetConfig,
    /// Other broker replicas. A stream for a cluster with no tunnel here is relayed to a peer
    /// that has one (the peer never relays further).
    #[serde(default)]
    pub peers: Vec<PeerConfig>,
    /// Hub control plane (NATS). Absent: the broker runs from this file alone.
    #[serde(default)]
    pub control_plane: Option<ControlPlaneConfig>,
    /// The HTTP service proxy (kube clients by URL, docs/service-proxy.md). Absent: off.
    #[serde(default)]
    pub service_proxy: Option<ServiceProxyConfig>,
    /// Test-only: the admin listener can make a tunnel's actor or connection task panic
    /// (`/debug/test/panic-tunnel`, see `test_hooks`). Never set it in production.
    #[serde(default)]
    pub test_hooks: bool,
}

/// Default bound of a service-proxy request head.
pub const DEFAULT_SERVICE_PROXY_MAX_HEADER_BYTES: usize = 64 * 1024;

/// The HTTP service proxy front end: its own TLS listener (ALPN h2 and http/1.1, client
/// certificate optional) serving `/<cluster>/…` URLs.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServiceProxyConfig {
    pub listen: SocketAddr,
    /// Services allowed without the hub (merged with the hub's ServiceProxyAllowlists).
    #[serde(default)]
    pub allow_services: Vec<tether_control::service_proxy::AllowedService>,
    /// Largest request head (HTTP/1.1 buffer, HTTP/2 header list).
    #[serde(default = "default_sp_header_bytes")]
    pub max_header_bytes: usize,
    /// `Impersonate-Group` values sent for hub identities.
    #[serde(default = "default_sp_groups")]
    pub impersonate_groups: Vec<String>,
    /// Idle pooled tunnel streams are closed after this.
    #[serde(default = "default_sp_idle", with = "humantime_serde")]
    pub pool_idle_timeout: Duration,
    /// Idle pooled tunnel streams kept per cluster.
    #[serde(default = "default_sp_idle_per_cluster")]
    pub pool_max_idle_per_cluster: usize,
}

fn default_sp_header_bytes() -> usize {
    DEFAULT_SERVICE_PROXY_MAX_HEADER_BYTES
}
fn default_sp_groups() -> Vec<String> {
    vec!["tether:clients".into()]
}
fn default_sp_idle() -> Duration {
    Duration::from_secs(90)
}
fn default_sp_idle_per_cluster() -> usize {
    32
}

/// The broker's connection to hub NATS (user `tether-hub`): presence in `tether-brokers`,
/// relay peers from the other brokers' presence, the registered clusters, and hub clients and
/// their access policies. The data plane never waits for NATS.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ControlPlaneConfig {
    /// `tls://host:port` of hub NATS, or a comma-separated seed list of a NATS cluster.
    pub nats_url: String,
    /// Name in the NATS server certificate (default: the URL's host).
    #[serde(default)]
    pub server_name: Option<String>,
    /// CA bundle verifying NATS (the hub CA, `<hub dir>/ca.crt`).
    pub ca: std::path::PathBuf,
    /// NATS user (hub processes use `tether-hub`).
    #[serde(default = "default_nats_user")]
    pub user: String,
    /// File holding the user's password (`<hub dir>/hub-user.password`).
    pub password_file: std::path::PathBuf,
    /// What this broker announces; defaults come from the bound listeners.
    #[serde(default)]
    pub advertise: Advertise,
    /// Refuse tunnels of clusters the hub does not know or has not accepted, and answer
    /// "unknown cluster" to clients (default true).
    #[serde(default = "default_true")]
    pub enforce_clusters: bool,
    /// Use the other brokers' presence as relay peers (default true).
    #[serde(default = "default_true")]
    pub discover_peers: bool,
}

/// Addresses in this broker's presence entry.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Advertise {
    /// `host:port` agents dial (default: `agent_listen` as bound).
    #[serde(default)]
    pub agent_addresses: Vec<String>,
    /// Name agents and peers verify in this broker's certificate (default: the host of the
    /// first agent address).
    #[serde(default)]
    pub server_name: Option<String>,
    /// `http://host:port` / `https://host:port` (default: the client listeners as bound).
    #[serde(default)]
    pub client_addresses: Vec<String>,
    /// `host:port` peers dial to relay (default: the first agent address).
    #[serde(default)]
    pub relay_address: Option<String>,
}

fn default_nats_user() -> String {
    "tether-hub".into()
}
fn default_true() -> bool {
    true
}

/// A peer broker, reached on its `agent_listen` address with ALPN `tether-relay/1`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PeerConfig {
    pub id: String,
    pub address: String,
    /// Name expected in the peer's certificate.
    pub server_name: String,
}

/// A hub client identity: authenticated by a certificate with CN `tether:client:<name>`, or by
/// a bearer token whose SHA-256 is `token_sha256` (the token itself is never stored).
#[derive(Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClientConfig {
    pub name: String,
    #[serde(default)]
    pub token_sha256: Option<String>,
    /// What the client may reach. Empty: the API server of every cluster, nothing else.
    #[serde(default)]
    pub allow: Vec<AllowRule>,
}

impl std::fmt::Debug for ClientConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClientConfig")
            .field("name", &self.name)
            .field(
                "token_sha256",
                &self.token_sha256.as_ref().map(|_| "<redacted>"),
            )
            .field("allow", &self.allow)
            .finish()
    }
}

/// Clusters (globs: `*`, `prod-*`, exact) and targets (`apiserver` or `host:port` patterns).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AllowRule {
    pub clusters: Vec<String>,
    pub targets: Vec<String>,
}

fn default_reload() -> Duration {
    tether_tls::reload::DEFAULT_RELOAD_INTERVAL
}
fn default_admin() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 0))
}
fn default_dial_timeout() -> Duration {
    DEFAULT_DIAL_TIMEOUT
}
fn default_max_pending() -> usize {
    DEFAULT_MAX_PENDING_DIALS
}
fn default_grace() -> Duration {
    Duration::from_secs(30)
}

impl Validate for BrokerConfig {
    fn validate(&self) -> Result<(), ConfigError> {
        if self.id.is_empty() || self.id.contains(':') {
            return Err(ConfigError::invalid(
                "id",
                "must be non-empty and without ':'",
            ));
        }
        if self.client_listen.is_none() && self.client_tls_listen.is_none() {
            return Err(ConfigError::invalid(
                "client_listen",
                "set client_listen and/or client_tls_listen, or no client can reach the broker",
            ));
        }
        if self.dial_timeout.is_zero() {
            return Err(ConfigError::invalid("dial_timeout", "must be > 0"));
        }
        if self.max_pending_dials_per_tunnel == 0 {
            return Err(ConfigError::invalid(
                "max_pending_dials_per_tunnel",
                "must be at least 1",
            ));
        }
        let mut names = std::collections::HashSet::new();
        for (i, c) in self.clients.iter().enumerate() {
            if c.name.is_empty() || c.name.contains(':') {
                return Err(ConfigError::invalid(
                    format!("clients[{i}].name"),
                    "must be non-empty and without ':'",
                ));
            }
            if !names.insert(&c.name) {
                return Err(ConfigError::invalid(
                    format!("clients[{i}].name"),
                    format!("duplicate client {:?}", c.name),
                ));
            }
            if let Some(h) = &c.token_sha256
                && (h.len() != 64 || hex::decode(h).is_err())
            {
                return Err(ConfigError::invalid(
                    format!("clients[{i}].token_sha256"),
                    "must be 64 hex characters (sha256 of the token)",
                ));
            }
            for (j, r) in c.allow.iter().enumerate() {
                if r.clusters.is_empty() || r.targets.is_empty() {
                    return Err(ConfigError::invalid(
                        format!("clients[{i}].allow[{j}]"),
                        "clusters and targets must both be non-empty",
                    ));
                }
                for (k, t) in r.targets.iter().enumerate() {
                    if t != "apiserver" {
                        tether_tunnel::pattern::validate(t).map_err(|m| {
                            ConfigError::invalid(format!("clients[{i}].allow[{j}].targets[{k}]"), m)
                        })?;
                    }
                }
            }
        }
        for (i, p) in self.peers.iter().enumerate() {
            if p.id == self.id {
                return Err(ConfigError::invalid(
                    format!("peers[{i}].id"),
                    "a broker cannot be its own peer",
                ));
            }
            if p.address
                .rsplit_once(':')
                .and_then(|(_, port)| port.parse::<u16>().ok())
                .is_none()
            {
                return Err(ConfigError::invalid(
                    format!("peers[{i}].address"),
                    format!("{:?} is not host:port", p.address),
                ));
            }
            if p.server_name.is_empty() {
                return Err(ConfigError::invalid(
                    format!("peers[{i}].server_name"),
                    "must not be empty",
                ));
            }
        }
        if let Some(cp) = &self.control_plane {
            if cp
                .nats_url
                .split(',')
                .any(|u| !u.trim().starts_with("tls://"))
                || tether_control::kubeconfig::parse_server_list(&cp.nats_url).is_none()
            {
                return Err(ConfigError::invalid(
                    "control_plane.nats_url",
                    format!(
                        "{:?} is not tls://host:port (or a comma-separated list of them)",
                        cp.nats_url
                    ),
                ));
            }
            if cp.user.is_empty() {
                return Err(ConfigError::invalid(
                    "control_plane.user",
                    "must not be empty",
                ));
            }
            let agent_unspecified = self.agent_listen.ip().is_unspecified();
            if agent_unspecified && cp.advertise.agent_addresses.is_empty() {
                return Err(ConfigError::invalid(
                    "control_plane.advertise.agent_addresses",
                    "required when agent_listen is a wildcard address (agents and peers need a reachable host:port)",
                ));
            }
            for (i, a) in cp.advertise.agent_addresses.iter().enumerate() {
                if a.rsplit_once(':')
                    .and_then(|(_, p)| p.parse::<u16>().ok())
                    .is_none()
                {
                    return Err(ConfigError::invalid(
                        format!("control_plane.advertise.agent_addresses[{i}]"),
                        format!("{a:?} is not host:port"),
                    ));
                }
            }
        }
        if let Some(sp) = &self.service_proxy {
            if !(8192..=1 << 20).contains(&sp.max_header_bytes) {
                return Err(ConfigError::invalid(
                    "service_proxy.max_header_bytes",
                    "must be between 8192 and 1048576",
                ));
            }
            let doc = tether_control::service_proxy::ServiceProxyAllowlist::new(
                "config",
                sp.allow_services.clone(),
            );
            tether_control::service_proxy::validate(&doc).map_err(|e| {
                ConfigError::invalid(
                    format!(
                        "service_proxy.allow_services{}",
                        e.field.trim_start_matches("spec.services")
                    ),
                    e.message,
                )
            })?;
            if sp.impersonate_groups.iter().any(|g| g.is_empty()) {
                return Err(ConfigError::invalid(
                    "service_proxy.impersonate_groups",
                    "must not contain empty names",
                ));
            }
        }
        self.tunnel
            .validate("tunnel.")
            .map_err(|(f, m)| ConfigError::invalid(f, m))?;
        self.budgets.validate(self.tunnel.stream_window_bytes)?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BASE: &str = "id: b1\ntls: {cert: c, key: k, ca: a}\nagent_listen: 127.0.0.1:0\nclient_listen: 127.0.0.1:0\n";

    fn parse(extra: &str) -> Result<BrokerConfig, ConfigError> {
        tether_config::from_str(
            &format!("{BASE}{extra}"),
            std::path::Path::new("broker.yaml"),
        )
    }

    #[test]
    fn service_proxy_is_optional_and_validated() {
        assert!(parse("").unwrap().service_proxy.is_none());
        let sp = parse("service_proxy:\n  listen: 127.0.0.1:0\n")
            .unwrap()
            .service_proxy
            .unwrap();
        assert!(sp.allow_services.is_empty());
        assert_eq!(sp.impersonate_groups, vec!["tether:clients".to_string()]);
        assert_eq!(sp.max_header_bytes, DEFAULT_SERVICE_PROXY_MAX_HEADER_BYTES);
        let e = parse("service_proxy:\n  listen: 127.0.0.1:0\n  allow_services:\n    - {clusters: ['*'], namespace: Bad, name: web}\n")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("service_proxy.allow_services[0].namespace"),
            "{e}"
        );
        let e = parse("service_proxy:\n  listen: 127.0.0.1:0\n  max_header_bytes: 100\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains("service_proxy.max_header_bytes"), "{e}");
    }

    #[test]
    fn control_plane_is_optional_and_validated() {
        assert!(parse("").unwrap().control_plane.is_none());
        let cp = parse(
            "control_plane:\n  nats_url: tls://hub:4222\n  ca: ca.crt\n  password_file: pw\n",
        )
        .unwrap()
        .control_plane
        .unwrap();
        assert_eq!(cp.user, "tether-hub");
        assert!(cp.enforce_clusters && cp.discover_peers);
        let e =
            parse("control_plane:\n  nats_url: nats://hub\n  ca: ca.crt\n  password_file: pw\n")
                .unwrap_err()
                .to_string();
        assert!(e.contains("control_plane.nats_url"), "{e}");
        let e = tether_config::from_str::<BrokerConfig>(
            &format!(
                "{}control_plane:\n  nats_url: tls://hub:4222\n  ca: ca.crt\n  password_file: pw\n",
                BASE.replace("agent_listen: 127.0.0.1:0", "agent_listen: 0.0.0.0:8091")
            ),
            std::path::Path::new("broker.yaml"),
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("control_plane.advertise.agent_addresses"), "{e}");
    }
}
