//! tunnel-agent configuration (YAML). Every field is documented in docs/configuration.md.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use serde::Deserialize;
use tether_config::{ConfigError, Validate};
use tether_runtime::BackoffConfig;
use tether_tls::TlsFiles;
use tether_tunnel::TunnelSettings;

/// Default API server address inside a cluster.
pub const DEFAULT_APISERVER: &str = "kubernetes.default.svc:443";
/// Default upper bound for a dial requested by a broker.
pub const DEFAULT_MAX_DIAL_TIMEOUT: Duration = Duration::from_secs(10);

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AgentConfig {
    /// Managed cluster name; must equal the cluster in the agent's certificate.
    pub cluster: String,
    /// Agent replica name (defaults to the host name).
    #[serde(default)]
    pub agent: Option<String>,
    pub tls: TlsFiles,
    /// How often certificate files are checked for changes.
    #[serde(default = "default_reload", with = "humantime_serde")]
    pub tls_reload_interval: Duration,
    /// Broker endpoints; the agent keeps one tunnel per endpoint.
    pub brokers: Vec<BrokerEndpoint>,
    /// Address of the cluster's API server, dialled for `<cluster>:443`.
    #[serde(default = "default_apiserver")]
    pub apiserver: String,
    #[serde(default)]
    pub policy: TargetPolicy,
    /// Upper bound for any dial, whatever the broker asks.
    #[serde(default = "default_max_dial", with = "humantime_serde")]
    pub max_dial_timeout: Duration,
    /// How long a target name's addresses are reused (the agent's resolver reads these).
    #[serde(default)]
    pub dns_cache: DnsCacheSettings,
    #[serde(default = "default_admin")]
    pub admin_listen: SocketAddr,
    #[serde(default)]
    pub tunnel: TunnelSettings,
    #[serde(default)]
    pub backoff: BackoffSettings,
    /// Forward proxy for reaching brokers. Absent: `HTTPS_PROXY` / `HTTP_PROXY` / `NO_PROXY`
    /// from the environment (upper or lower case).
    #[serde(default)]
    pub proxy: Option<ProxyConfig>,
    /// Time open streams get to finish on SIGTERM.
    #[serde(default = "default_grace", with = "humantime_serde")]
    pub shutdown_grace: Duration,
    /// The agent end of the brokers' HTTP service proxy (docs/service-proxy.md). Absent: the
    /// agent refuses service-proxy streams.
    #[serde(default)]
    pub service_proxy: Option<ServiceProxySettings>,
    /// A broker endpoint that leaves the config while its tunnel is established keeps that
    /// tunnel until it ends (the broker closes or drains it, or it fails), then is not
    /// redialled. Off (a static config): the tunnel is closed at once. The registration-agent
    /// turns it on for the configs the hub delivers, whose broker list is the hub's view of
    /// broker presence, which can lapse (a NATS failover on the broker's side) while the
    /// broker serves.
    #[serde(default)]
    pub keep_removed_brokers_connected: bool,
    /// Test-only: the admin listener can make a connector actor or its tunnel's task panic
    /// (`/debug/test/panic-tunnel?endpoint=<label>&task=<actor|connection>`, see
    /// `tether_runtime::test_hooks`). Never set it in production; a change needs a restart.
    #[serde(default)]
    pub test_hooks: bool,
}

/// The cache of resolved target names (`dns_cache`, docs/configuration.md).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DnsCacheSettings {
    /// How long a name's addresses are reused; `0s` resolves on every dial. At most 5m.
    #[serde(default = "default_dns_ttl", with = "humantime_serde")]
    pub ttl: Duration,
    /// Names kept at most (1 – 1,000,000).
    #[serde(default = "default_dns_entries")]
    pub max_entries: usize,
}

/// Default `dns_cache.ttl`.
pub const DEFAULT_DNS_CACHE_TTL: Duration = Duration::from_secs(5);
/// The bound `dns_cache.ttl` may not exceed: the cache must never pin a Service's old
/// addresses for long.
pub const DNS_CACHE_MAX_TTL: Duration = Duration::from_secs(300);
/// Default `dns_cache.max_entries`.
pub const DEFAULT_DNS_CACHE_ENTRIES: usize = 1024;

fn default_dns_ttl() -> Duration {
    DEFAULT_DNS_CACHE_TTL
}

fn default_dns_entries() -> usize {
    DEFAULT_DNS_CACHE_ENTRIES
}

impl Default for DnsCacheSettings {
    fn default() -> Self {
        Self {
            ttl: DEFAULT_DNS_CACHE_TTL,
            max_entries: DEFAULT_DNS_CACHE_ENTRIES,
        }
    }
}

/// Default CA of the in-cluster API server (the pod's service account).
pub const DEFAULT_SA_CA: &str = "/var/run/secrets/kubernetes.io/serviceaccount/ca.crt";
/// Default name in the API server's certificate.
pub const DEFAULT_APISERVER_NAME: &str = "kubernetes.default.svc";
/// Default bound of a service-proxy request head (request line and headers).
pub const DEFAULT_MAX_HEADER_BYTES: usize = 64 * 1024;

/// The agent end of the service proxy: it terminates the broker's HTTP/1.1 on a tunnel stream
/// and re-originates each request over pooled connections to the API server (TLS verified with
/// `apiserver_ca`, HTTP/2 when the server offers it) or to an allowed service.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ServiceProxySettings {
    /// CA bundle verifying the API server.
    #[serde(default = "default_sa_ca")]
    pub apiserver_ca: PathBuf,
    /// Name expected in the API server's certificate.
    #[serde(default = "default_apiserver_name")]
    pub apiserver_server_name: String,
    /// The add-on's own credential in the managed cluster (a service-account token file,
    /// re-read every minute as projected tokens rotate). Requests of hub identities carry it
    /// with the broker's `Impersonate-*` headers; absent, only token pass-through works.
    #[serde(default)]
    pub token_file: Option<PathBuf>,
    /// CA bundle verifying `https:` services (default: `apiserver_ca`).
    #[serde(default)]
    pub services_ca: Option<PathBuf>,
    /// Where `<svc>.<ns>.svc:<port>` is dialled when cluster DNS is absent (local and compose
    /// runs): `"<svc>.<ns>.svc:<port>": "host:port"`. Others resolve through DNS.
    #[serde(default)]
    pub service_addresses: std::collections::BTreeMap<String, String>,
    /// Largest request head accepted from the broker.
    #[serde(default = "default_max_header_bytes")]
    pub max_header_bytes: usize,
}

fn default_sa_ca() -> PathBuf {
    DEFAULT_SA_CA.into()
}
fn default_apiserver_name() -> String {
    DEFAULT_APISERVER_NAME.into()
}
fn default_max_header_bytes() -> usize {
    DEFAULT_MAX_HEADER_BYTES
}

/// Proxy settings, as OCM's AddOnDeploymentConfig `proxyConfig`.
#[derive(Clone, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct ProxyConfig {
    #[serde(default)]
    pub http_proxy: Option<String>,
    #[serde(default)]
    pub https_proxy: Option<String>,
    /// Comma-separated hosts, .domains, IPs, CIDRs that bypass the proxy.
    #[serde(default)]
    pub no_proxy: Option<String>,
    /// CA bundle that signed an https:// proxy's certificate (default: `tls.ca`).
    #[serde(default)]
    pub ca_bundle: Option<PathBuf>,
}

impl std::fmt::Debug for ProxyConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mask = |v: &Option<String>| v.as_deref().map(tether_proxy::mask_url_password);
        f.debug_struct("ProxyConfig")
            .field("http_proxy", &mask(&self.http_proxy))
            .field("https_proxy", &mask(&self.https_proxy))
            .field("no_proxy", &self.no_proxy)
            .field("ca_bundle", &self.ca_bundle)
            .finish()
    }
}

impl AgentConfig {
    /// The effective proxy settings: the config's, or the environment's.
    pub fn proxy_settings(&self) -> Result<tether_proxy::ProxySettings, ConfigError> {
        match &self.proxy {
            Some(p) => tether_proxy::ProxySettings::from_parts(
                p.http_proxy.as_deref(),
                p.https_proxy.as_deref(),
                p.no_proxy.as_deref(),
            )
            .map_err(|(f, e)| ConfigError::invalid(format!("proxy.{f}"), e.to_string())),
            None => tether_proxy::ProxySettings::from_env().map_err(|(f, e)| {
                ConfigError::invalid(
                    format!("environment {}", f.to_ascii_uppercase()),
                    e.to_string(),
                )
            }),
        }
    }
}

/// One broker endpoint: a failover group of addresses. The agent holds one tunnel to the
/// group, preferring the first healthy address; a draining broker is skipped.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BrokerEndpoint {
    #[serde(default)]
    pub name: Option<String>,
    pub addresses: Vec<String>,
    /// Name expected in the broker's certificate.
    pub server_name: String,
}

impl BrokerEndpoint {
    pub fn label(&self) -> String {
        self.name
            .clone()
            .unwrap_or_else(|| self.addresses.join(","))
    }
}

/// Which targets brokers may ask this agent to dial. Patterns are `host:port` where host may
/// start with `*.` (any subdomain) or be `*`, and port may be `*`. Deny wins over allow. The
/// API server is always allowed.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TargetPolicy {
    #[serde(default = "allow_all")]
    pub allow: Vec<String>,
    #[serde(default)]
    pub deny: Vec<String>,
}

impl Default for TargetPolicy {
    fn default() -> Self {
        Self {
            allow: allow_all(),
            deny: vec![],
        }
    }
}

impl TargetPolicy {
    pub fn permits(&self, host: &str, port: u16) -> bool {
        let m = |p: &String| tether_tunnel::pattern::matches(p, host, port);
        !self.deny.iter().any(m) && self.allow.iter().any(m)
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct BackoffSettings {
    #[serde(with = "humantime_serde")]
    pub initial: Duration,
    #[serde(with = "humantime_serde")]
    pub max: Duration,
    #[serde(with = "humantime_serde")]
    pub reset_after: Duration,
}

impl Default for BackoffSettings {
    fn default() -> Self {
        let d = BackoffConfig::default();
        Self {
            initial: d.initial,
            max: d.max,
            reset_after: d.reset_after,
        }
    }
}

impl From<&BackoffSettings> for BackoffConfig {
    fn from(b: &BackoffSettings) -> Self {
        BackoffConfig {
            initial: b.initial,
            max: b.max,
            reset_after: b.reset_after,
            ..BackoffConfig::default()
        }
    }
}

fn allow_all() -> Vec<String> {
    vec!["*:*".into()]
}
fn default_reload() -> Duration {
    tether_tls::reload::DEFAULT_RELOAD_INTERVAL
}
fn default_apiserver() -> String {
    DEFAULT_APISERVER.into()
}
fn default_max_dial() -> Duration {
    DEFAULT_MAX_DIAL_TIMEOUT
}
fn default_admin() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 0))
}
fn default_grace() -> Duration {
    Duration::from_secs(30)
}

impl AgentConfig {
    pub fn agent_name(&self) -> String {
        self.agent.clone().unwrap_or_else(|| {
            std::fs::read_to_string("/proc/sys/kernel/hostname")
                .map(|s| s.trim().to_owned())
                .unwrap_or_else(|_| "agent".into())
        })
    }
}

impl Validate for AgentConfig {
    fn validate(&self) -> Result<(), ConfigError> {
        tether_tls::identity::validate_dns_label(&self.cluster)
            .map_err(|r| ConfigError::invalid("cluster", r))?;
        if self.brokers.is_empty() {
            return Err(ConfigError::invalid(
                "brokers",
                "at least one broker endpoint is required",
            ));
        }
        for (i, b) in self.brokers.iter().enumerate() {
            if b.addresses.is_empty() {
                return Err(ConfigError::invalid(
                    format!("brokers[{i}].addresses"),
                    "must not be empty",
                ));
            }
            for (j, a) in b.addresses.iter().enumerate() {
                if a.rsplit_once(':')
                    .and_then(|(_, p)| p.parse::<u16>().ok())
                    .is_none()
                {
                    return Err(ConfigError::invalid(
                        format!("brokers[{i}].addresses[{j}]"),
                        format!("{a:?} is not host:port"),
                    ));
                }
            }
            if b.server_name.is_empty() {
                return Err(ConfigError::invalid(
                    format!("brokers[{i}].server_name"),
                    "must not be empty",
                ));
            }
        }
        if self
            .apiserver
            .rsplit_once(':')
            .and_then(|(_, p)| p.parse::<u16>().ok())
            .is_none()
        {
            return Err(ConfigError::invalid(
                "apiserver",
                format!("{:?} is not host:port", self.apiserver),
            ));
        }
        for (field, list) in [
            ("policy.allow", &self.policy.allow),
            ("policy.deny", &self.policy.deny),
        ] {
            for (i, p) in list.iter().enumerate() {
                tether_tunnel::pattern::validate(p)
                    .map_err(|m| ConfigError::invalid(format!("{field}[{i}]"), m))?;
            }
        }
        if self.max_dial_timeout.is_zero() {
            return Err(ConfigError::invalid("max_dial_timeout", "must be > 0"));
        }
        if self.dns_cache.ttl > DNS_CACHE_MAX_TTL {
            return Err(ConfigError::invalid(
                "dns_cache.ttl",
                format!(
                    "{:?} is above the bound {:?}: a Service's old addresses would be reused that long",
                    self.dns_cache.ttl, DNS_CACHE_MAX_TTL
                ),
            ));
        }
        if !(1..=1_000_000).contains(&self.dns_cache.max_entries) {
            return Err(ConfigError::invalid(
                "dns_cache.max_entries",
                format!("{} is not in 1..=1000000", self.dns_cache.max_entries),
            ));
        }
        self.proxy_settings()?;
        if let Some(sp) = &self.service_proxy {
            if sp.max_header_bytes < 8192 {
                return Err(ConfigError::invalid(
                    "service_proxy.max_header_bytes",
                    "must be at least 8192",
                ));
            }
            for (k, v) in &sp.service_addresses {
                for s in [k, v] {
                    if s.rsplit_once(':')
                        .and_then(|(_, p)| p.parse::<u16>().ok())
                        .is_none()
                    {
                        return Err(ConfigError::invalid(
                            format!("service_proxy.service_addresses[{k:?}]"),
                            format!("{s:?} is not host:port"),
                        ));
                    }
                }
            }
        }
        self.tunnel
            .validate("tunnel.")
            .map_err(|(f, m)| ConfigError::invalid(f, m))?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A minimal valid config plus `extra` YAML lines.
    fn parse(extra: &str) -> Result<AgentConfig, ConfigError> {
        let base = "cluster: c1\ntls: {cert: c, key: k, ca: a}\nbrokers:\n  - addresses: ['b:1']\n    server_name: b\n";
        tether_config::from_str::<AgentConfig>(
            &format!("{base}{extra}"),
            std::path::Path::new("agent.yaml"),
        )
    }

    #[test]
    fn service_proxy_section() {
        assert!(parse("").unwrap().service_proxy.is_none());
        let sp = parse("service_proxy: {token_file: /t}\n")
            .unwrap()
            .service_proxy
            .unwrap();
        assert_eq!(sp.apiserver_ca, PathBuf::from(DEFAULT_SA_CA));
        assert_eq!(sp.apiserver_server_name, DEFAULT_APISERVER_NAME);
        let e = parse("service_proxy:\n  service_addresses: {'web.default.svc:80': 'nowhere'}\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains("service_proxy.service_addresses"), "{e}");
    }

    #[test]
    fn dns_cache_section() {
        assert_eq!(parse("").unwrap().dns_cache, DnsCacheSettings::default());
        let off = parse("dns_cache: {ttl: 0s}\n").unwrap().dns_cache;
        assert_eq!(
            (off.ttl, off.max_entries),
            (Duration::ZERO, DEFAULT_DNS_CACHE_ENTRIES)
        );
        for (extra, field) in [
            ("dns_cache: {ttl: 10m}\n", "dns_cache.ttl"),
            ("dns_cache: {max_entries: 0}\n", "dns_cache.max_entries"),
            ("dns_cache: {size: 3}\n", "size"),
        ] {
            let e = parse(extra).unwrap_err().to_string();
            assert!(e.contains(field), "{extra}: {e}");
        }
    }

    #[test]
    fn policy_patterns() {
        let p = TargetPolicy {
            allow: vec!["*.svc:8080".into(), "db:5432".into()],
            deny: vec!["secret.svc:*".into()],
        };
        assert!(p.permits("web.svc", 8080));
        assert!(!p.permits("web.svc", 8081));
        assert!(p.permits("DB", 5432));
        assert!(!p.permits("secret.svc", 8080));
        assert!(TargetPolicy::default().permits("anything", 1));
    }
}
