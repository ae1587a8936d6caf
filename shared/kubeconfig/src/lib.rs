//! Bootstrap and hub kubeconfigs, read and written with the `kube` crate's kubeconfig types.
//!
//! The bootstrap kubeconfig (OCM's `bootstrap-hub-kubeconfig`) carries the hub `server`
//! (`tls://host:port` of hub NATS), `certificate-authority-data` (hub CA plus the proxy CA,
//! merged and de-duplicated), `proxy-url`, and a bootstrap `token`. The hub kubeconfig
//! (`hub-kubeconfig-secret`'s `kubeconfig`) copies server, CA and proxy-url and points its user
//! at the `tls.crt` / `tls.key` files next to it.
//!
//! The endpoint types and `server` parsing are always built; reading and writing kubeconfig
//! files with the `kube` crate's types needs feature `kube`, so the broker and the health-prober
//! (which only parse a NATS URL) do not pull `kube` in.
#![forbid(unsafe_code)]

#[cfg(feature = "kube")]
use std::path::Path;

#[cfg(feature = "kube")]
use base64::Engine;
#[cfg(feature = "kube")]
use kube::config::{
    AuthInfo, Cluster, Context, Kubeconfig, NamedAuthInfo, NamedCluster, NamedContext,
};
use secrecy::{ExposeSecret, SecretString};

use tether_proxy::{ProxyError, ProxyUrl};

/// Errors reading a kubeconfig; each names the field or file at fault.
#[derive(Debug, thiserror::Error)]
pub enum KubeconfigError {
    #[error("reading kubeconfig {path}: {source}")]
    Read {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("parsing kubeconfig {path}: {reason}")]
    Parse { path: String, reason: String },
    #[error("kubeconfig {path}: {field} is missing")]
    Missing { path: String, field: &'static str },
    #[error(
        "kubeconfig {path}: bootstrap kubeconfig without a CA: clusters[].cluster.certificate-authority-data is missing or has no certificate"
    )]
    NoCa { path: String },
    #[error("kubeconfig {path}: {field} is invalid: {reason}")]
    Invalid {
        path: String,
        field: &'static str,
        reason: String,
    },
    #[error("kubeconfig {path}: {0}", path = .1)]
    Proxy(#[source] ProxyError, String),
    #[error("serializing kubeconfig: {0}")]
    Serialize(String),
}

/// Where and how to reach hub NATS, taken from a kubeconfig's current cluster.
#[derive(Clone, PartialEq, Eq)]
pub struct HubEndpoint {
    /// `tls://host:port` as written in the kubeconfig, or a comma-separated seed list of them
    /// (a NATS cluster); `host`/`port` are then the first entry.
    pub server: String,
    pub host: String,
    pub port: u16,
    /// PEM bundle: hub CA (verifies NATS) plus the proxy CA (verifies an https proxy).
    pub ca_pem: String,
    pub proxy: Option<ProxyUrl>,
    /// Name verified in the NATS server certificate when it differs from `host`
    /// (kubeconfig `tls-server-name`).
    pub tls_server_name: Option<String>,
}

impl std::fmt::Debug for HubEndpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HubEndpoint")
            .field("server", &self.server)
            .field(
                "ca_certs",
                &tether_pki::pem_certificates(&self.ca_pem).len(),
            )
            .field("proxy", &self.proxy)
            .finish()
    }
}

impl HubEndpoint {
    /// Every seed server (`server` may be a comma-separated list); `host:port` alone when
    /// `server` does not parse as a list.
    pub fn seeds(&self) -> Vec<(String, u16)> {
        parse_server_list(&self.server).unwrap_or_else(|| vec![(self.host.clone(), self.port)])
    }

    /// The name the NATS server certificate must carry.
    pub fn tls_name(&self) -> &str {
        self.tls_server_name.as_deref().unwrap_or(&self.host)
    }

    /// Compares what decides whether hub credentials still belong to this bootstrap config:
    /// server, CA bundle (as a set of certificates) and proxy URL (OCM's validity check).
    pub fn same_hub(&self, other: &HubEndpoint) -> bool {
        let set = |p: &str| {
            let mut v: Vec<Vec<u8>> = tether_pki::pem_certificates(p)
                .into_iter()
                .map(|c| c.as_ref().to_vec())
                .collect();
            v.sort();
            v
        };
        self.server == other.server
            && self.proxy.as_ref().map(ProxyUrl::to_url_with_secret)
                == other.proxy.as_ref().map(ProxyUrl::to_url_with_secret)
            && self.tls_server_name == other.tls_server_name
            && set(&self.ca_pem) == set(&other.ca_pem)
    }
}

/// A bootstrap token. `Debug` masks it.
#[derive(Clone)]
pub struct Token(SecretString);

impl Token {
    pub fn new(s: String) -> Self {
        Self(SecretString::from(s))
    }
    pub fn expose(&self) -> &str {
        self.0.expose_secret()
    }
}

impl std::fmt::Debug for Token {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Token(<masked>)")
    }
}

/// A parsed bootstrap kubeconfig.
#[derive(Debug, Clone)]
pub struct BootstrapConfig {
    pub endpoint: HubEndpoint,
    pub token: Token,
}

/// Parses `tls://host:port` (also accepts `nats://` and `https://`). A comma-separated seed
/// list (`tls://a:4222,tls://b:4222`, the NATS convention) yields its first entry, provided
/// every entry parses; [`parse_server_list`] gives them all.
pub fn parse_server(server: &str) -> Option<(String, u16)> {
    parse_server_list(server)?.into_iter().next()
}

/// Parses a comma-separated seed list of `tls://host:port` entries (one entry is a list of
/// one). `None` when the list is empty or any entry does not parse.
pub fn parse_server_list(servers: &str) -> Option<Vec<(String, u16)>> {
    let list: Option<Vec<_>> = servers
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(parse_one_server)
        .collect();
    list.filter(|l| !l.is_empty())
}

fn parse_one_server(server: &str) -> Option<(String, u16)> {
    let rest = server
        .strip_prefix("tls://")
        .or_else(|| server.strip_prefix("nats://"))
        .or_else(|| server.strip_prefix("https://"))?;
    let rest = rest.trim_end_matches('/');
    if let Some(v6) = rest.strip_prefix('[') {
        let (h, p) = v6.split_once("]:")?;
        return Some((h.to_string(), p.parse().ok()?));
    }
    let (h, p) = rest.rsplit_once(':')?;
    if h.is_empty() {
        return None;
    }
    Some((h.to_string(), p.parse().ok()?))
}

#[cfg(feature = "kube")]
fn current_cluster<'a>(
    kc: &'a Kubeconfig,
    path: &str,
) -> Result<(&'a Cluster, Option<&'a AuthInfo>), KubeconfigError> {
    let ctx_name = kc.current_context.clone();
    let ctx = match ctx_name {
        Some(n) => kc
            .contexts
            .iter()
            .find(|c| c.name == n)
            .and_then(|c| c.context.as_ref()),
        None => kc.contexts.first().and_then(|c| c.context.as_ref()),
    };
    let (cluster_name, user_name) = match ctx {
        Some(c) => (Some(c.cluster.clone()), c.user.clone()),
        None => (None, None),
    };
    let cluster = match cluster_name {
        Some(n) => kc.clusters.iter().find(|c| c.name == n),
        None => kc.clusters.first(),
    }
    .and_then(|c| c.cluster.as_ref())
    .ok_or(KubeconfigError::Missing {
        path: path.to_string(),
        field: "clusters[].cluster",
    })?;
    let user = match user_name {
        Some(n) => kc.auth_infos.iter().find(|u| u.name == n),
        None => kc.auth_infos.first(),
    }
    .and_then(|u| u.auth_info.as_ref());
    Ok((cluster, user))
}

#[cfg(feature = "kube")]
fn endpoint_from(cluster: &Cluster, path: &str) -> Result<HubEndpoint, KubeconfigError> {
    let server = cluster.server.clone().ok_or(KubeconfigError::Missing {
        path: path.to_string(),
        field: "clusters[].cluster.server",
    })?;
    let (host, port) = parse_server(&server).ok_or_else(|| KubeconfigError::Invalid {
        path: path.to_string(),
        field: "clusters[].cluster.server",
        reason: format!("{server:?} is not tls://host:port"),
    })?;
    let ca_pem = match &cluster.certificate_authority_data {
        Some(b64) => {
            let bytes = base64::engine::general_purpose::STANDARD
                .decode(b64.trim())
                .map_err(|e| KubeconfigError::Invalid {
                    path: path.to_string(),
                    field: "clusters[].cluster.certificate-authority-data",
                    reason: format!("not base64: {e}"),
                })?;
            String::from_utf8_lossy(&bytes).into_owned()
        }
        None => match &cluster.certificate_authority {
            Some(file) => {
                std::fs::read_to_string(file).map_err(|source| KubeconfigError::Read {
                    path: file.clone(),
                    source,
                })?
            }
            None => String::new(),
        },
    };
    if tether_pki::pem_certificates(&ca_pem).is_empty() {
        return Err(KubeconfigError::NoCa {
            path: path.to_string(),
        });
    }
    let proxy = match &cluster.proxy_url {
        Some(u) if !u.trim().is_empty() => Some(
            ProxyUrl::parse(u.trim()).map_err(|e| KubeconfigError::Proxy(e, path.to_string()))?,
        ),
        _ => None,
    };
    Ok(HubEndpoint {
        server,
        host,
        port,
        ca_pem,
        proxy,
        tls_server_name: cluster.tls_server_name.clone().filter(|s| !s.is_empty()),
    })
}

#[cfg(feature = "kube")]
fn parse_file(path: &Path) -> Result<Kubeconfig, KubeconfigError> {
    let p = path.display().to_string();
    let text = std::fs::read_to_string(path).map_err(|source| KubeconfigError::Read {
        path: p.clone(),
        source,
    })?;
    Kubeconfig::from_yaml(&text).map_err(|e| KubeconfigError::Parse {
        path: p,
        reason: e.to_string(),
    })
}

#[cfg(feature = "kube")]
/// Reads and validates a bootstrap kubeconfig.
pub fn read_bootstrap(path: &Path) -> Result<BootstrapConfig, KubeconfigError> {
    let p = path.display().to_string();
    let kc = parse_file(path)?;
    let (cluster, user) = current_cluster(&kc, &p)?;
    let endpoint = endpoint_from(cluster, &p)?;
    let token = user
        .and_then(|u| u.token.as_ref())
        .map(|t| Token::new(t.expose_secret().to_string()))
        .or_else(|| {
            user.and_then(|u| u.token_file.as_ref())
                .and_then(|f| std::fs::read_to_string(f).ok())
                .map(|t| Token::new(t.trim().to_string()))
        })
        .ok_or(KubeconfigError::Missing {
            path: p.clone(),
            field: "users[].user.token",
        })?;
    Ok(BootstrapConfig { endpoint, token })
}

#[cfg(feature = "kube")]
/// Parses the endpoint of a hub kubeconfig held in memory; `origin` names it in errors.
pub fn parse_hub_endpoint(text: &str, origin: &str) -> Result<HubEndpoint, KubeconfigError> {
    let kc = Kubeconfig::from_yaml(text).map_err(|e| KubeconfigError::Parse {
        path: origin.to_string(),
        reason: e.to_string(),
    })?;
    let (cluster, _) = current_cluster(&kc, origin)?;
    endpoint_from(cluster, origin)
}

#[cfg(feature = "kube")]
/// Reads the endpoint of a hub kubeconfig (user = client cert files).
pub fn read_hub_endpoint(path: &Path) -> Result<HubEndpoint, KubeconfigError> {
    let p = path.display().to_string();
    let kc = parse_file(path)?;
    let (cluster, _) = current_cluster(&kc, &p)?;
    endpoint_from(cluster, &p)
}

#[cfg(feature = "kube")]
fn build(
    endpoint: &HubEndpoint,
    cluster_name: &str,
    user_name: &str,
    user: AuthInfo,
) -> Kubeconfig {
    let cluster = Cluster {
        server: Some(endpoint.server.clone()),
        certificate_authority_data: Some(
            base64::engine::general_purpose::STANDARD.encode(endpoint.ca_pem.as_bytes()),
        ),
        proxy_url: endpoint.proxy.as_ref().map(ProxyUrl::to_url_with_secret),
        tls_server_name: endpoint.tls_server_name.clone(),
        ..Default::default()
    };
    Kubeconfig {
        api_version: Some("v1".into()),
        kind: Some("Config".into()),
        clusters: vec![NamedCluster {
            name: cluster_name.into(),
            cluster: Some(cluster),
            other: Default::default(),
        }],
        auth_infos: vec![NamedAuthInfo {
            name: user_name.into(),
            auth_info: Some(user),
            other: Default::default(),
        }],
        contexts: vec![NamedContext {
            name: "default-context".into(),
            context: Some(Context {
                cluster: cluster_name.into(),
                user: Some(user_name.into()),
                namespace: Some("default".into()),
                ..Default::default()
            }),
            other: Default::default(),
        }],
        current_context: Some("default-context".into()),
        ..Default::default()
    }
}

#[cfg(feature = "kube")]
fn to_yaml(kc: &Kubeconfig) -> Result<String, KubeconfigError> {
    serde_saphyr::to_string(kc).map_err(|e| KubeconfigError::Serialize(e.to_string()))
}

#[cfg(feature = "kube")]
/// The bootstrap kubeconfig `tetherctl join` writes.
pub fn render_bootstrap(endpoint: &HubEndpoint, token: &Token) -> Result<String, KubeconfigError> {
    let user = AuthInfo {
        token: Some(SecretString::from(token.expose().to_string())),
        ..Default::default()
    };
    to_yaml(&build(endpoint, "default-cluster", "default-auth", user))
}

#[cfg(feature = "kube")]
/// The hub kubeconfig the registration agent writes: same server, CA and proxy-url, user =
/// `tls.crt` / `tls.key` (relative to the kubeconfig's directory, as OCM mounts the secret).
pub fn render_hub(endpoint: &HubEndpoint) -> Result<String, KubeconfigError> {
    let user = AuthInfo {
        client_certificate: Some("tls.crt".into()),
        client_key: Some("tls.key".into()),
        ..Default::default()
    };
    to_yaml(&build(endpoint, "default-cluster", "default-auth", user))
}

#[cfg(all(test, feature = "kube"))]
mod tests {
    use super::*;

    #[test]
    fn seed_lists_parse_every_entry_or_fail() {
        assert_eq!(
            parse_server_list("tls://a:1, tls://[::1]:2,tls://c:3").unwrap(),
            vec![("a".into(), 1), ("::1".into(), 2), ("c".into(), 3)]
        );
        assert_eq!(parse_server("tls://a:1,tls://b:2"), Some(("a".into(), 1)));
        assert_eq!(parse_server("tls://a:1"), Some(("a".into(), 1)));
        assert!(parse_server_list("tls://a:1,b:2").is_none());
        assert!(parse_server_list(" , ").is_none());
    }

    #[test]
    fn bootstrap_round_trip_keeps_proxy_and_ca() {
        let ca = tether_pki::HubCa::generate("hub", std::time::Duration::from_secs(60)).unwrap();
        let proxy_ca =
            tether_pki::HubCa::generate("proxy", std::time::Duration::from_secs(60)).unwrap();
        let bundle =
            tether_pki::merge_pem_bundles([ca.cert_pem(), proxy_ca.cert_pem(), ca.cert_pem()]);
        let ep = HubEndpoint {
            server: "tls://hub.example:4222".into(),
            host: "hub.example".into(),
            port: 4222,
            ca_pem: bundle,
            proxy: Some(ProxyUrl::parse("https://u:p@proxy:3129").unwrap()),
            tls_server_name: None,
        };
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("bootstrap.kubeconfig");
        std::fs::write(
            &path,
            render_bootstrap(&ep, &Token::new("tok".into())).unwrap(),
        )
        .unwrap();
        let bc = read_bootstrap(&path).unwrap();
        assert!(bc.endpoint.same_hub(&ep));
        assert_eq!(bc.token.expose(), "tok");
        assert_eq!(tether_pki::pem_certificates(&bc.endpoint.ca_pem).len(), 2);
        let hub = dir.path().join("kubeconfig");
        std::fs::write(&hub, render_hub(&ep).unwrap()).unwrap();
        assert!(read_hub_endpoint(&hub).unwrap().same_hub(&ep));
    }

    #[test]
    fn missing_ca_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("k");
        std::fs::write(
            &path,
            "apiVersion: v1\nkind: Config\nclusters:\n- name: c\n  cluster:\n    server: tls://hub:4222\ncontexts:\n- name: x\n  context:\n    cluster: c\n    user: u\ncurrent-context: x\nusers:\n- name: u\n  user:\n    token: t\n",
        )
        .unwrap();
        let e = read_bootstrap(&path).unwrap_err().to_string();
        assert!(e.contains("without a CA"), "{e}");
    }
}
