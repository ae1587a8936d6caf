//! The hub directory `tetherctl init` writes, and the config file in it (`hub.yaml`) that
//! `addon-manager` and `tetherctl` read.
//!
//! ```text
//! <hub dir>/
//!   hub.yaml                 HubConfig (below); paths in it are relative to this directory
//!   ca.crt, ca.key           hub CA (signs the NATS server cert and cluster client certs)
//!   nats/nats.conf           nats-server config (TLS, auth callout, JetStream store)
//!   nats/server.crt|key      NATS server certificate
//!   hub-user.password        password of NATS user `tether-hub` (addon-manager)
//!   admin-user.password      password of NATS user `tether-admin` (tetherctl)
//!   callout-issuer.nk        account nkey seed signing auth-callout responses
//!   bootstrap-tokens.json    bootstrap token records (hashes only), imported into KV
//! ```

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tether_config::{ConfigError, Validate};

/// File names inside the hub directory.
pub const HUB_CONFIG_FILE: &str = "hub.yaml";
pub const HUB_USER: &str = "tether-hub";
pub const ADMIN_USER: &str = "tether-admin";

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct HubConfig {
    pub nats: HubNatsConfig,
    pub ca: CaFiles,
    pub callout_issuer_seed_file: PathBuf,
    pub bootstrap_tokens_file: PathBuf,
    #[serde(default)]
    pub registration: RegistrationPolicy,
    #[serde(default)]
    pub admin: AdminConfig,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct HubNatsConfig {
    /// How hub processes reach NATS, `tls://host:port`, or a comma-separated seed list of them
    /// for a NATS cluster (`tls://a:4222,tls://b:4222,tls://c:4222`).
    pub url: String,
    /// JetStream replicas of every hub bucket and the events stream. Absent: 3 when the server
    /// the addon-manager connects to is part of a cluster, 1 standalone. Existing buckets are
    /// updated in place to this count by the addon-manager (never by other tools).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replicas: Option<usize>,
    /// The name in the NATS server certificate (verified instead of the URL's host).
    pub server_name: String,
    pub ca_file: PathBuf,
    pub hub_password_file: PathBuf,
    pub admin_password_file: PathBuf,
    /// The nats-server config this hub was initialised with.
    pub server_config_file: PathBuf,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct CaFiles {
    pub cert_file: PathBuf,
    pub key_file: PathBuf,
}

/// Auto-accept: names are glob patterns (`*` matches any run), labels must all match.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct AutoAccept {
    #[serde(default)]
    pub names: Vec<String>,
    #[serde(default)]
    pub labels: std::collections::BTreeMap<String, String>,
}

impl AutoAccept {
    /// True when the cluster matches a name pattern, or every label selector (if any given).
    pub fn matches(&self, name: &str, labels: &std::collections::BTreeMap<String, String>) -> bool {
        if self.names.iter().any(|p| glob_match(p, name)) {
            return true;
        }
        !self.labels.is_empty()
            && self
                .labels
                .iter()
                .all(|(k, v)| labels.get(k).is_some_and(|have| glob_match(v, have)))
    }
}

/// `*` matches any (possibly empty) run of characters.
pub fn glob_match(pattern: &str, s: &str) -> bool {
    let parts: Vec<&str> = pattern.split('*').collect();
    if parts.len() == 1 {
        return pattern == s;
    }
    let mut rest = s;
    for (i, part) in parts.iter().enumerate() {
        if i == 0 {
            match rest.strip_prefix(part) {
                Some(r) => rest = r,
                None => return false,
            }
        } else if i == parts.len() - 1 {
            return rest.ends_with(part);
        } else {
            match rest.find(part) {
                Some(idx) => rest = &rest[idx + part.len()..],
                None => return false,
            }
        }
    }
    true
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct RegistrationPolicy {
    #[serde(default)]
    pub auto_accept: AutoAccept,
    /// Available becomes Unknown after `leaseGraceMultiplier × leaseDurationSeconds` (OCM: 5).
    #[serde(default = "default_grace")]
    pub lease_grace_multiplier: u32,
    /// Lifetime of issued cluster certificates.
    #[serde(default = "default_cert_lifetime", with = "humantime_serde")]
    pub client_cert_lifetime: Duration,
    /// OCM refuses new CSRs with "too many csr" beyond this many pending per cluster.
    #[serde(default = "default_max_pending")]
    pub max_pending_csrs_per_cluster: usize,
    /// How often lease ages are checked.
    #[serde(default = "default_check", with = "humantime_serde")]
    pub lease_check_interval: Duration,
    /// leaseDurationSeconds given to new ManagedClusters.
    #[serde(default = "default_lease")]
    pub lease_duration_seconds: u32,
}

fn default_grace() -> u32 {
    crate::resources::DEFAULT_LEASE_GRACE_MULTIPLIER
}
fn default_cert_lifetime() -> Duration {
    Duration::from_secs(24 * 3600)
}
fn default_max_pending() -> usize {
    10
}
fn default_check() -> Duration {
    Duration::from_secs(1)
}
fn default_lease() -> u32 {
    crate::resources::DEFAULT_LEASE_DURATION_SECONDS
}

impl Default for RegistrationPolicy {
    fn default() -> Self {
        Self {
            auto_accept: AutoAccept::default(),
            lease_grace_multiplier: default_grace(),
            client_cert_lifetime: default_cert_lifetime(),
            max_pending_csrs_per_cluster: default_max_pending(),
            lease_check_interval: default_check(),
            lease_duration_seconds: default_lease(),
        }
    }
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct AdminConfig {
    /// Admin HTTP (/healthz, /readyz, /metrics) listen address; none when absent.
    #[serde(default)]
    pub listen: Option<String>,
}

impl Validate for HubConfig {
    fn validate(&self) -> Result<(), ConfigError> {
        // A random listen port (`-1`) is allowed here; processes then pass the real URL.
        if self
            .nats
            .url
            .split(',')
            .any(|u| !u.trim().starts_with("tls://"))
        {
            return Err(ConfigError::invalid(
                "nats.url",
                "must be tls://host:port or a comma-separated list of them",
            ));
        }
        if let Some(r) = self.nats.replicas
            && !(1..=5).contains(&r)
        {
            return Err(ConfigError::invalid(
                "nats.replicas",
                format!("{r} is not a JetStream replica count (1 to 5)"),
            ));
        }
        let r = &self.registration;
        if r.lease_grace_multiplier == 0 {
            return Err(ConfigError::invalid(
                "registration.leaseGraceMultiplier",
                "must be at least 1",
            ));
        }
        if r.client_cert_lifetime < Duration::from_secs(10) {
            return Err(ConfigError::invalid(
                "registration.clientCertLifetime",
                "must be at least 10s",
            ));
        }
        if r.max_pending_csrs_per_cluster == 0 {
            return Err(ConfigError::invalid(
                "registration.maxPendingCsrsPerCluster",
                "must be at least 1",
            ));
        }
        if r.lease_duration_seconds == 0 {
            return Err(ConfigError::invalid(
                "registration.leaseDurationSeconds",
                "must be at least 1",
            ));
        }
        Ok(())
    }
}

/// A loaded hub directory.
#[derive(Debug, Clone)]
pub struct HubDir {
    pub dir: PathBuf,
    pub config: HubConfig,
}

/// Errors reading hub files.
#[derive(Debug, thiserror::Error)]
pub enum HubDirError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error("reading {path}: {source}")]
    Read {
        path: String,
        #[source]
        source: std::io::Error,
    },
}

impl HubDir {
    pub fn load(dir: &Path) -> Result<Self, HubDirError> {
        let config: HubConfig = tether_config::load(&dir.join(HUB_CONFIG_FILE))?;
        Ok(Self {
            dir: dir.to_path_buf(),
            config,
        })
    }

    pub fn path(&self, p: &Path) -> PathBuf {
        if p.is_absolute() {
            p.to_path_buf()
        } else {
            self.dir.join(p)
        }
    }

    pub fn read(&self, p: &Path) -> Result<String, HubDirError> {
        let path = self.path(p);
        std::fs::read_to_string(&path).map_err(|source| HubDirError::Read {
            path: path.display().to_string(),
            source,
        })
    }

    /// The endpoint hub processes use (no proxy), with `url` overriding the configured URL
    /// (either may be a comma-separated seed list).
    pub fn endpoint(
        &self,
        url: Option<&str>,
    ) -> Result<crate::kubeconfig::HubEndpoint, HubDirError> {
        let server = url.unwrap_or(&self.config.nats.url).to_string();
        let (host, port) = crate::kubeconfig::parse_server(&server).ok_or_else(|| {
            HubDirError::Config(ConfigError::invalid(
                "nats.url",
                format!("{server:?} is not tls://host:port (or a comma-separated list of them)"),
            ))
        })?;
        Ok(crate::kubeconfig::HubEndpoint {
            server: server.clone(),
            host,
            port,
            ca_pem: self.read(&self.config.nats.ca_file)?,
            proxy: None,
            tls_server_name: Some(self.config.nats.server_name.clone()),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn globs() {
        assert!(glob_match("edge-*", "edge-1"));
        assert!(glob_match("*", "x"));
        assert!(glob_match("a*c*e", "abcde"));
        assert!(!glob_match("edge-*", "core-1"));
        assert!(glob_match("exact", "exact"));
        let mut aa = AutoAccept::default();
        aa.labels.insert("env".into(), "dev*".into());
        let mut l = std::collections::BTreeMap::new();
        assert!(!aa.matches("c", &l));
        l.insert("env".into(), "dev-1".into());
        assert!(aa.matches("c", &l));
    }
}
