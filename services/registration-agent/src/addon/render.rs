//! Renders the tunnel-agent config (services/tunnel-agent/src/config.rs) for an
//! [`AddOnAgentConfig`]: one broker endpoint per broker id, the proxy from the
//! AddOnDeploymentConfig (always written, so the agent never falls back to the environment),
//! TLS from the add-on credentials, CA = hub CA bundle, proxy CA = hub CA + the proxy's
//! `caBundle`, admin on `127.0.0.1:0` with a ready file.

use std::path::{Path, PathBuf};

use serde::Serialize;
use tether_control::addons::AddOnAgentConfig;

/// File names in the runtime directory.
pub const CONFIG_FILE: &str = "config.yaml";
pub const HUB_CA_FILE: &str = "hub-ca.crt";
pub const PROXY_CA_FILE: &str = "proxy-ca.crt";

/// What the runtime gets: the rendered config, its hash and the files it refers to.
#[derive(Clone)]
pub struct RenderedAgent {
    /// The tunnel-agent YAML.
    pub config_yaml: String,
    /// SHA-256 (hex) of `config_yaml`: the tunnel-agent reports it once it runs this config.
    pub sha256: String,
    pub hub_ca_pem: String,
    /// Hub CA + the proxy's caBundle, when the proxy config has one.
    pub proxy_ca_pem: Option<String>,
    /// The hub's desired config (replicas, proxy env for a Kubernetes Deployment).
    pub desired: AddOnAgentConfig,
    /// Directory of the add-on credentials (tls.crt, tls.key).
    pub credentials_dir: PathBuf,
}

impl std::fmt::Debug for RenderedAgent {
    // The YAML may carry a proxy password: only the hash is shown.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RenderedAgent")
            .field("sha256", &self.sha256)
            .field("brokers", &self.desired.brokers.len())
            .finish_non_exhaustive()
    }
}

/// Local settings that are not the hub's to decide.
#[derive(Debug, Clone)]
pub struct RenderSettings {
    /// Where `<cluster>:443` goes (the cluster's API server).
    pub apiserver: String,
    /// Directory the config and CA files are written to (absolute).
    pub runtime_dir: PathBuf,
    /// Directory of the add-on credentials (absolute).
    pub credentials_dir: PathBuf,
}

#[derive(Serialize)]
struct Tls {
    cert: PathBuf,
    key: PathBuf,
    ca: PathBuf,
}

#[derive(Serialize)]
struct Broker {
    name: String,
    addresses: Vec<String>,
    server_name: String,
}

#[derive(Serialize)]
struct Proxy {
    #[serde(skip_serializing_if = "Option::is_none")]
    http_proxy: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    https_proxy: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    no_proxy: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    ca_bundle: Option<PathBuf>,
}

#[derive(Serialize)]
struct Backoff {
    initial: &'static str,
    max: &'static str,
    reset_after: &'static str,
}

#[derive(Serialize)]
struct AgentYaml {
    cluster: String,
    agent: String,
    tls: Tls,
    tls_reload_interval: &'static str,
    brokers: Vec<Broker>,
    apiserver: String,
    admin_listen: &'static str,
    proxy: Proxy,
    shutdown_grace: &'static str,
    backoff: Backoff,
    /// The hub's broker list follows broker presence, which can lapse while a broker serves:
    /// a working tunnel to a broker that left the list is kept until it ends.
    keep_removed_brokers_connected: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    tunnel: Option<serde_json::Value>,
}

fn non_empty(s: &str) -> Option<String> {
    (!s.is_empty()).then(|| s.to_string())
}

/// Why the hub's config cannot be rendered.
#[derive(Debug, thiserror::Error)]
pub enum RenderError {
    #[error("the hub lists no broker (no live broker and no ManagedProxyConfiguration entrypoint)")]
    NoBroker,
    #[error("encoding the agent config: {0}")]
    Encode(#[source] serde_saphyr::ser::Error),
}

/// Renders the config; Err when the hub's config cannot run (no broker).
pub fn render(
    desired: &AddOnAgentConfig,
    agent: &str,
    settings: &RenderSettings,
) -> Result<RenderedAgent, RenderError> {
    if desired.brokers.is_empty() {
        return Err(RenderError::NoBroker);
    }
    let p = desired.proxy.clone().unwrap_or_default();
    let proxy_ca_pem = non_empty(&p.ca_bundle)
        .map(|b| tether_pki::merge_pem_bundles([desired.hub_ca_bundle.as_str(), b.as_str()]));
    let yaml = AgentYaml {
        cluster: desired.cluster.clone(),
        agent: agent.to_string(),
        tls: Tls {
            cert: settings.credentials_dir.join("tls.crt"),
            key: settings.credentials_dir.join("tls.key"),
            ca: settings.runtime_dir.join(HUB_CA_FILE),
        },
        tls_reload_interval: "2s",
        brokers: desired
            .brokers
            .iter()
            .map(|b| Broker {
                name: b.id.clone(),
                addresses: b.addresses.clone(),
                server_name: b.server_name.clone(),
            })
            .collect(),
        apiserver: settings.apiserver.clone(),
        admin_listen: "127.0.0.1:0",
        proxy: Proxy {
            http_proxy: non_empty(&p.http_proxy),
            https_proxy: non_empty(&p.https_proxy),
            no_proxy: non_empty(&p.no_proxy),
            ca_bundle: proxy_ca_pem
                .as_ref()
                .map(|_| settings.runtime_dir.join(PROXY_CA_FILE)),
        },
        shutdown_grace: "2s",
        keep_removed_brokers_connected: true,
        backoff: Backoff {
            initial: "100ms",
            max: "5s",
            reset_after: "30s",
        },
        tunnel: non_empty(&desired.keepalive)
            .map(|k| serde_json::json!({ "keepalive_interval": k })),
    };
    let config_yaml = serde_saphyr::to_string(&yaml).map_err(RenderError::Encode)?;
    Ok(RenderedAgent {
        sha256: sha256_hex(config_yaml.as_bytes()),
        config_yaml,
        hub_ca_pem: desired.hub_ca_bundle.clone(),
        proxy_ca_pem,
        desired: desired.clone(),
        credentials_dir: settings.credentials_dir.clone(),
    })
}

pub use tether_tls::sha256_hex;

/// Writes `contents` to `dir/name` atomically (temp file + rename) with `mode`.
pub fn write_atomic(dir: &Path, name: &str, contents: &str, mode: u32) -> std::io::Result<()> {
    tether_runtime::write_atomic(&dir.join(name), contents.as_bytes(), mode)
}

#[cfg(test)]
mod tests {
    use super::*;
    use tether_control::addons::{AgentBrokerEndpoint, ProxyConfig};

    #[test]
    fn renders_a_config_the_tunnel_agent_accepts_shape() {
        let ca = tether_pki::HubCa::generate("hub", std::time::Duration::from_secs(60)).unwrap();
        let desired = AddOnAgentConfig {
            cluster: "c1".into(),
            addon: "cluster-proxy".into(),
            brokers: vec![AgentBrokerEndpoint {
                id: "b1".into(),
                addresses: vec!["127.0.0.1:8091".into()],
                server_name: "broker.hub".into(),
            }],
            proxy: Some(ProxyConfig {
                no_proxy: "10.0.0.0/8".into(),
                ..Default::default()
            }),
            hub_ca_bundle: ca.cert_pem().into(),
            replicas: 1,
            keepalive: "10s".into(),
            ..Default::default()
        };
        let s = RenderSettings {
            apiserver: "127.0.0.1:6443".into(),
            runtime_dir: "/run/x".into(),
            credentials_dir: "/run/creds".into(),
        };
        let r = render(&desired, "a1", &s).unwrap();
        let v: serde_json::Value = serde_saphyr::from_str(&r.config_yaml).unwrap();
        assert_eq!(v["brokers"][0]["name"], "b1");
        assert_eq!(v["proxy"]["no_proxy"], "10.0.0.0/8");
        assert!(v["proxy"].get("https_proxy").is_none());
        assert_eq!(v["tls"]["cert"], "/run/creds/tls.crt");
        assert_eq!(v["tunnel"]["keepalive_interval"], "10s");
        assert_eq!(r.sha256.len(), 64);
        // The tunnel-agent's own parser and validation accept it.
        let parsed: tunnel_agent::config::AgentConfig =
            tether_config::from_str(&r.config_yaml, std::path::Path::new("rendered")).unwrap();
        assert_eq!(parsed.brokers[0].label(), "b1");
        assert_eq!(
            parsed.tunnel.keepalive_interval,
            std::time::Duration::from_secs(10)
        );
        assert!(
            parsed
                .proxy_settings()
                .unwrap()
                .proxy_for("127.0.0.1", 8091, true)
                .is_none()
        );
        assert!(!format!("{r:?}").contains("BEGIN"));
        let mut d2 = desired.clone();
        d2.brokers.clear();
        assert!(render(&d2, "a1", &s).is_err());
    }
}
