//! OCM-shaped add-on resources: ClusterManagementAddOn, ManagedClusterAddOn,
//! AddOnDeploymentConfig and cluster-proxy's ManagedProxyConfiguration, their validation (errors
//! name the field, e.g. `spec.proxyConfig.httpsProxy: ...`), spec hashes, and the add-on status
//! report an agent sends on `tether.v1.cluster.<c>.addon.<a>.status`.
//!
//! Shapes follow open-cluster-management.io/api `addon/v1alpha1` and cluster-proxy's
//! `proxy/v1alpha1`, serialised as camelCase JSON. Documented in docs/addons.md.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::resources::{Condition, ObjectMeta, condition_status};

pub const ADDON_API_VERSION: &str = "addon.open-cluster-management.io/v1alpha1";
pub const PROXY_API_VERSION: &str = "proxy.open-cluster-management.io/v1alpha1";
/// The add-on this repository ships.
pub const CLUSTER_PROXY: &str = "cluster-proxy";
/// Namespace of namespaced configs when the document names none.
pub const DEFAULT_NAMESPACE: &str = "default";
/// Default install namespace of add-on agents (OCM's).
pub const DEFAULT_INSTALL_NAMESPACE: &str = "open-cluster-management-agent-addon";
/// Group/resource of the two config kinds.
pub const ADC_GROUP: &str = "addon.open-cluster-management.io";
pub const ADC_RESOURCE: &str = "addondeploymentconfigs";
pub const MPC_GROUP: &str = "proxy.open-cluster-management.io";
pub const MPC_RESOURCE: &str = "managedproxyconfigurations";

/// ManagedClusterAddOn condition types.
pub mod condition {
    pub const AVAILABLE: &str = "Available";
    pub const DEGRADED: &str = "Degraded";
    pub const PROGRESSING: &str = "Progressing";
}

/// A validation error naming the field (`spec.proxyConfig.httpsProxy: must be ...`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {message}")]
pub struct FieldError {
    pub field: String,
    pub message: String,
}

fn ferr(field: impl Into<String>, message: impl Into<String>) -> FieldError {
    FieldError {
        field: field.into(),
        message: message.into(),
    }
}

/// A reference to a config object (OCM `ConfigReferent` + `ConfigGroupResource`).
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq, PartialOrd, Ord)]
#[serde(rename_all = "camelCase")]
pub struct ConfigRef {
    pub group: String,
    pub resource: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub namespace: String,
    pub name: String,
}

impl ConfigRef {
    /// Which bucket holds it and under which key; None for unsupported resources.
    pub fn key(&self) -> Option<(ConfigKind, String)> {
        match (self.group.as_str(), self.resource.as_str()) {
            (ADC_GROUP, ADC_RESOURCE) => Some((
                ConfigKind::AddOnDeploymentConfig,
                namespaced_key(&self.namespace, &self.name),
            )),
            (MPC_GROUP, MPC_RESOURCE) => {
                Some((ConfigKind::ManagedProxyConfiguration, self.name.clone()))
            }
            _ => None,
        }
    }

    pub fn display(&self) -> String {
        if self.namespace.is_empty() {
            format!("{}.{}/{}", self.resource, self.group, self.name)
        } else {
            format!(
                "{}.{}/{}/{}",
                self.resource, self.group, self.namespace, self.name
            )
        }
    }

    fn validate(&self, field: &str) -> Result<(), FieldError> {
        if self.key().is_none() {
            return Err(ferr(
                format!("{field}.resource"),
                format!(
                    "unsupported config {}.{} (supported: {ADC_RESOURCE}.{ADC_GROUP}, {MPC_RESOURCE}.{MPC_GROUP})",
                    self.resource, self.group
                ),
            ));
        }
        dns_label(&format!("{field}.name"), &self.name)?;
        if !self.namespace.is_empty() {
            dns_label(&format!("{field}.namespace"), &self.namespace)?;
        }
        Ok(())
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConfigKind {
    AddOnDeploymentConfig,
    ManagedProxyConfiguration,
}

/// KV key of a namespaced object: `<namespace>.<name>` (both DNS-1123 labels).
pub fn namespaced_key(namespace: &str, name: &str) -> String {
    let ns = if namespace.is_empty() {
        DEFAULT_NAMESPACE
    } else {
        namespace
    };
    format!("{ns}.{name}")
}

/// SHA-256 (hex) of a spec's JSON: what configReferences carry as `specHash`.
pub fn spec_hash<T: Serialize>(spec: &T) -> String {
    let bytes = serde_json::to_vec(spec).unwrap_or_default();
    hex::encode(Sha256::digest(&bytes))
}

// ---- ClusterManagementAddOn ----

#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct AddOnMeta {
    #[serde(default)]
    pub display_name: String,
    #[serde(default)]
    pub description: String,
}

/// How the hub installs the add-on.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct InstallStrategy {
    /// `All` (every accepted cluster), `LabelSelector` (accepted clusters whose labels match
    /// `selector.matchLabels`) or `Manual` (only ManagedClusterAddOns applied by hand).
    #[serde(rename = "type", default = "default_strategy")]
    pub type_: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub selector: Option<LabelSelector>,
}

fn default_strategy() -> String {
    "All".into()
}

#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct LabelSelector {
    #[serde(default)]
    pub match_labels: BTreeMap<String, String>,
}

impl InstallStrategy {
    /// Whether the hub installs the add-on on a cluster with these labels.
    pub fn selects(&self, labels: &BTreeMap<String, String>) -> bool {
        match self.type_.as_str() {
            "All" => true,
            "LabelSelector" => self
                .selector
                .as_ref()
                .is_some_and(|s| s.match_labels.iter().all(|(k, v)| labels.get(k) == Some(v))),
            _ => false,
        }
    }
}

#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ClusterManagementAddOnSpec {
    #[serde(default)]
    pub add_on_meta: AddOnMeta,
    #[serde(default)]
    pub install_strategy: InstallStrategy,
    /// Configs every ManagedClusterAddOn of this add-on uses unless its own `spec.configs`
    /// names another of the same group/resource.
    #[serde(default)]
    pub default_configs: Vec<ConfigRef>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ClusterManagementAddOn {
    pub api_version: String,
    pub kind: String,
    pub metadata: ObjectMeta,
    pub spec: ClusterManagementAddOnSpec,
}

impl ClusterManagementAddOn {
    pub const KIND: &'static str = "ClusterManagementAddOn";
}

// ---- ManagedClusterAddOn ----

#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ManagedClusterAddOnSpec {
    #[serde(default)]
    pub install_namespace: String,
    #[serde(default)]
    pub configs: Vec<ConfigRef>,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct ConfigSpecHash {
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub namespace: String,
    pub name: String,
    pub spec_hash: String,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct ConfigReference {
    pub group: String,
    pub resource: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub namespace: String,
    pub name: String,
    /// What the hub wants the agent to run (empty hash: the config does not exist).
    pub desired_config: ConfigSpecHash,
    /// What the agent last reported as applied.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_applied_config: Option<ConfigSpecHash>,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ManagedClusterAddOnStatus {
    #[serde(default)]
    pub conditions: Vec<Condition>,
    #[serde(default)]
    pub config_references: Vec<ConfigReference>,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub namespace: String,
    /// `Lease`: Available follows the add-on lease.
    #[serde(default)]
    pub health_check_mode: String,
}

/// `addon.open-cluster-management.io/v1alpha1` ManagedClusterAddOn: metadata.namespace is the
/// cluster, metadata.name the add-on.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ManagedClusterAddOn {
    pub api_version: String,
    pub kind: String,
    pub metadata: ObjectMeta,
    pub spec: ManagedClusterAddOnSpec,
    #[serde(default)]
    pub status: ManagedClusterAddOnStatus,
}

impl ManagedClusterAddOn {
    pub const KIND: &'static str = "ManagedClusterAddOn";

    pub fn new(cluster: &str, addon: &str) -> Self {
        let mut metadata = ObjectMeta::new(addon);
        metadata.namespace = Some(cluster.to_string());
        Self {
            api_version: ADDON_API_VERSION.into(),
            kind: Self::KIND.into(),
            metadata,
            spec: ManagedClusterAddOnSpec {
                install_namespace: DEFAULT_INSTALL_NAMESPACE.into(),
                configs: vec![],
            },
            status: ManagedClusterAddOnStatus {
                health_check_mode: "Lease".into(),
                ..Default::default()
            },
        }
    }

    pub fn cluster(&self) -> &str {
        self.metadata.namespace.as_deref().unwrap_or_default()
    }

    pub fn condition(&self, t: &str) -> Option<&str> {
        condition_status(&self.status.conditions, t)
    }
}

/// KV key of a ManagedClusterAddOn: `<cluster>.<addon>`.
pub fn addon_key(cluster: &str, addon: &str) -> String {
    format!("{cluster}.{addon}")
}

// ---- AddOnDeploymentConfig ----

/// `Debug` masks passwords in the proxy URLs and abbreviates the CA bundle.
#[derive(Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ProxyConfig {
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub http_proxy: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub https_proxy: String,
    /// Kept even when it is the only field (addon-framework drops it then).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub no_proxy: String,
    /// PEM CA bundle of the proxy (for https:// proxies).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub ca_bundle: String,
}

impl std::fmt::Debug for ProxyConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProxyConfig")
            .field(
                "http_proxy",
                &tether_proxy::mask_url_password(&self.http_proxy),
            )
            .field(
                "https_proxy",
                &tether_proxy::mask_url_password(&self.https_proxy),
            )
            .field("no_proxy", &self.no_proxy)
            .field("ca_bundle_bytes", &self.ca_bundle.len())
            .finish()
    }
}

impl ProxyConfig {
    /// The environment an add-on agent gets: upper and lower case, each set only when given.
    pub fn env(&self) -> Vec<(String, String)> {
        let mut out = Vec::new();
        for (k, v) in [
            ("HTTP_PROXY", &self.http_proxy),
            ("HTTPS_PROXY", &self.https_proxy),
            ("NO_PROXY", &self.no_proxy),
        ] {
            if !v.is_empty() {
                out.push((k.to_string(), v.clone()));
                out.push((k.to_ascii_lowercase(), v.clone()));
            }
        }
        out
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct CustomizedVariable {
    pub name: String,
    pub value: String,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct AddOnDeploymentConfigSpec {
    #[serde(default)]
    pub proxy_config: ProxyConfig,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub customized_variables: Vec<CustomizedVariable>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct AddOnDeploymentConfig {
    pub api_version: String,
    pub kind: String,
    pub metadata: ObjectMeta,
    pub spec: AddOnDeploymentConfigSpec,
}

impl AddOnDeploymentConfig {
    pub const KIND: &'static str = "AddOnDeploymentConfig";
}

// ---- ManagedProxyConfiguration ----

#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SelfSigned {
    #[serde(default, rename = "additionalSANs")]
    pub additional_sans: Vec<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Signer {
    /// `SelfSigned` (the hub CA signs broker and agent certificates).
    #[serde(rename = "type")]
    pub type_: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub self_signed: Option<SelfSigned>,
}

impl Default for Signer {
    fn default() -> Self {
        Self {
            type_: "SelfSigned".into(),
            self_signed: None,
        }
    }
}

#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Authentication {
    #[serde(default)]
    pub signer: Signer,
}

/// Where agents reach the brokers (cluster-proxy's `entrypoint`).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Entrypoint {
    pub host: String,
    #[serde(default = "default_entrypoint_port")]
    pub port: u32,
}

fn default_entrypoint_port() -> u32 {
    8091
}

fn default_replicas() -> u32 {
    3
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ProxyServer {
    #[serde(default = "default_replicas")]
    pub replicas: u32,
    /// Broker endpoints the agents dial (every one of them).
    #[serde(default)]
    pub entrypoints: Vec<Entrypoint>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ProxyAgent {
    #[serde(default = "default_replicas")]
    pub replicas: u32,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub image: String,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub image_pull_secrets: Vec<String>,
    /// Tunnel keepalive interval, e.g. `10s`.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub keepalive: String,
}

impl Default for ProxyAgent {
    fn default() -> Self {
        Self {
            replicas: default_replicas(),
            image: String::new(),
            image_pull_secrets: vec![],
            keepalive: String::new(),
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ManagedProxyConfigurationSpec {
    #[serde(default)]
    pub authentication: Authentication,
    pub proxy_server: ProxyServer,
    #[serde(default)]
    pub proxy_agent: ProxyAgent,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ManagedProxyConfigurationStatus {
    #[serde(default)]
    pub conditions: Vec<Condition>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ManagedProxyConfiguration {
    pub api_version: String,
    pub kind: String,
    pub metadata: ObjectMeta,
    pub spec: ManagedProxyConfigurationSpec,
    #[serde(default)]
    pub status: ManagedProxyConfigurationStatus,
}

impl ManagedProxyConfiguration {
    pub const KIND: &'static str = "ManagedProxyConfiguration";
}

// ---- the add-on status report (agent → hub) ----

/// Body of `tether.v1.cluster.<c>.addon.<a>.status`: what the agent has applied.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct AddOnStatusReport {
    pub applied_configs: Vec<AppliedConfig>,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct AppliedConfig {
    pub group: String,
    pub resource: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub namespace: String,
    pub name: String,
    pub spec_hash: String,
}

/// Body of `tether.v1.cluster.<c>.addon.<a>.lease`: the add-on agent renews its health lease.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct AddOnLeaseRenew {
    /// Who holds it (the add-on agent's name).
    pub holder_identity: String,
    /// Renewal period; the hub sets Available=False after 5 × this without renewal.
    pub lease_duration_seconds: u32,
    /// Ids of the brokers the add-on agent holds a working tunnel to right now. The hub
    /// reports the add-on Available only when this covers every live, non-draining broker.
    #[serde(default)]
    pub connected_brokers: Vec<String>,
}

// ---- delivering the add-on (hub → agent) ----

/// Body of `tether.v1.cluster.<c>.addon.<a>.config` (agent → hub request).
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct AddOnAgentConfigRequest {
    /// The asking agent's name (for events and logs).
    #[serde(default)]
    pub agent_name: String,
}

/// Reply to [`AddOnAgentConfigRequest`].
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct AddOnAgentConfigReply {
    /// False when the add-on is not installed on the cluster: the agent stops it and removes
    /// its credentials.
    pub installed: bool,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub message: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub config: Option<AddOnAgentConfig>,
}

/// What the hub wants the cluster to run for an add-on (for `cluster-proxy`: tunnel-agents).
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct AddOnAgentConfig {
    pub cluster: String,
    pub addon: String,
    pub install_namespace: String,
    /// Every broker the agent holds a tunnel to: each live, non-draining broker from the
    /// `tether-brokers` presence bucket, or the ManagedProxyConfiguration's entrypoints when no
    /// broker has announced itself.
    pub brokers: Vec<AgentBrokerEndpoint>,
    /// From the AddOnDeploymentConfig's `proxyConfig` (noProxy honoured on its own).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub proxy: Option<ProxyConfig>,
    /// PEM: the hub CA (brokers' certificates chain to it).
    pub hub_ca_bundle: String,
    /// Tunnel-agent replicas (ManagedProxyConfiguration `proxyAgent.replicas`).
    pub replicas: u32,
    /// Tunnel keepalive, e.g. `10s` (empty: the agent's default).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub keepalive: String,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub customized_variables: Vec<CustomizedVariable>,
    /// The desired config references this realises; the agent reports them back in
    /// [`AddOnStatusReport`] once the config is applied.
    pub config_hashes: Vec<AppliedConfig>,
}

/// One broker in [`AddOnAgentConfig::brokers`].
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct AgentBrokerEndpoint {
    /// Broker id (from its presence entry), or `entrypoint-<n>`.
    pub id: String,
    /// `host:port`, tried in order.
    pub addresses: Vec<String>,
    pub server_name: String,
}

/// Hub → agent notification on `tether.v1.cluster.<c>.notify` that an add-on's desired
/// config changed (or the add-on was removed): `{"type":"AddOnConfigChanged","addon":"<a>"}`.
pub const NOTIFY_ADDON_CONFIG_CHANGED: &str = "AddOnConfigChanged";

/// Body of the [`NOTIFY_ADDON_CONFIG_CHANGED`] notification.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct AddOnNotify {
    #[serde(rename = "type")]
    pub type_: String,
    #[serde(default)]
    pub addon: String,
}

impl AddOnNotify {
    pub fn config_changed(addon: &str) -> Self {
        Self {
            type_: NOTIFY_ADDON_CONFIG_CHANGED.into(),
            addon: addon.into(),
        }
    }
}

/// Annotation on the add-on Lease (`tether-addon-leases`) with the comma-separated broker ids
/// of the last [`AddOnLeaseRenew::connected_brokers`].
pub const CONNECTED_BROKERS_ANNOTATION: &str = "tether.io/connected-brokers";

/// OCM's add-on agent CN: `system:open-cluster-management:cluster:<c>:addon:<a>:agent:<agent>`.
pub fn addon_agent_common_name(cluster: &str, addon: &str, agent: &str) -> String {
    format!("system:open-cluster-management:cluster:{cluster}:addon:{addon}:agent:{agent}")
}

/// OCM's add-on agent organisations: `system:open-cluster-management:cluster:<c>:addon:<a>` and
/// `system:open-cluster-management:addon:<a>`.
pub fn addon_agent_organizations(cluster: &str, addon: &str) -> Vec<String> {
    vec![
        format!("system:open-cluster-management:cluster:{cluster}:addon:{addon}"),
        format!("system:open-cluster-management:addon:{addon}"),
    ]
}

/// Reply to [`AddOnLeaseRenew`].
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct AddOnLeaseReply {
    /// False when the add-on is not installed on that cluster (the agent should stop).
    pub accepted: bool,
    #[serde(default)]
    pub message: String,
}

// ---- parsing and validation of applied documents ----

/// One validated document of `tetherctl apply -f`.
#[derive(Debug, Clone, PartialEq)]
pub enum AddOnResource {
    ClusterManagementAddOn(ClusterManagementAddOn),
    ManagedClusterAddOn(ManagedClusterAddOn),
    AddOnDeploymentConfig(AddOnDeploymentConfig),
    ManagedProxyConfiguration(ManagedProxyConfiguration),
}

impl AddOnResource {
    pub fn kind(&self) -> &'static str {
        match self {
            AddOnResource::ClusterManagementAddOn(_) => ClusterManagementAddOn::KIND,
            AddOnResource::ManagedClusterAddOn(_) => ManagedClusterAddOn::KIND,
            AddOnResource::AddOnDeploymentConfig(_) => AddOnDeploymentConfig::KIND,
            AddOnResource::ManagedProxyConfiguration(_) => ManagedProxyConfiguration::KIND,
        }
    }

    pub fn metadata(&self) -> &ObjectMeta {
        match self {
            AddOnResource::ClusterManagementAddOn(r) => &r.metadata,
            AddOnResource::ManagedClusterAddOn(r) => &r.metadata,
            AddOnResource::AddOnDeploymentConfig(r) => &r.metadata,
            AddOnResource::ManagedProxyConfiguration(r) => &r.metadata,
        }
    }

    /// `kind/name` or `kind/namespace/name`.
    pub fn display(&self) -> String {
        let m = self.metadata();
        match &m.namespace {
            Some(ns) => format!("{}/{ns}/{}", self.kind().to_ascii_lowercase(), m.name),
            None => format!("{}/{}", self.kind().to_ascii_lowercase(), m.name),
        }
    }
}

fn dns_label(field: &str, s: &str) -> Result<(), FieldError> {
    let ok = !s.is_empty()
        && s.len() <= 63
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !s.starts_with('-')
        && !s.ends_with('-');
    if ok {
        Ok(())
    } else {
        Err(ferr(
            field,
            format!("{s:?} is not a DNS-1123 label (lower-case letters, digits, '-'; at most 63)"),
        ))
    }
}

/// `http://[user:pass@]host[:port][/]` or `https://…`.
pub fn validate_proxy_url(field: &str, s: &str) -> Result<(), FieldError> {
    let rest = s
        .strip_prefix("http://")
        .or_else(|| s.strip_prefix("https://"))
        .ok_or_else(|| ferr(field, format!("{s:?} must start with http:// or https://")))?;
    let rest = rest.strip_suffix('/').unwrap_or(rest);
    if rest.contains(['/', '?', '#', ' ']) {
        return Err(ferr(
            field,
            format!("{s:?} must be scheme://[user:password@]host[:port] with no path"),
        ));
    }
    let hostport = rest.rsplit_once('@').map(|(_, h)| h).unwrap_or(rest);
    let (host, port) = if let Some(h) = hostport.strip_prefix('[') {
        let (h, p) = h
            .split_once(']')
            .ok_or_else(|| ferr(field, format!("{s:?}: unclosed '[' in host")))?;
        (h, p.strip_prefix(':'))
    } else {
        match hostport.rsplit_once(':') {
            Some((h, p)) => (h, Some(p)),
            None => (hostport, None),
        }
    };
    if host.is_empty() {
        return Err(ferr(field, format!("{s:?} has no host")));
    }
    if let Some(p) = port
        && !matches!(p.parse::<u16>(), Ok(1..))
    {
        return Err(ferr(field, format!("{s:?}: port {p:?} is not 1-65535")));
    }
    Ok(())
}

fn validate_proxy_config(p: &ProxyConfig) -> Result<(), FieldError> {
    if !p.http_proxy.is_empty() {
        validate_proxy_url("spec.proxyConfig.httpProxy", &p.http_proxy)?;
    }
    if !p.https_proxy.is_empty() {
        validate_proxy_url("spec.proxyConfig.httpsProxy", &p.https_proxy)?;
    }
    for (i, entry) in p.no_proxy.split(',').enumerate() {
        let e = entry.trim();
        if e.is_empty() && !p.no_proxy.is_empty() {
            return Err(ferr(
                "spec.proxyConfig.noProxy",
                format!("entry {i} is empty (comma-separated hosts, domains, IPs or CIDRs)"),
            ));
        }
        if e.contains(char::is_whitespace) || e.contains("://") {
            return Err(ferr(
                "spec.proxyConfig.noProxy",
                format!("entry {e:?} must be a host, .domain, IP or CIDR"),
            ));
        }
    }
    if !p.ca_bundle.is_empty() {
        let mut rd = std::io::BufReader::new(p.ca_bundle.as_bytes());
        let certs: Result<Vec<_>, _> = rustls_pemfile::certs(&mut rd).collect();
        match certs {
            Ok(c) if !c.is_empty() => {}
            Ok(_) => {
                return Err(ferr(
                    "spec.proxyConfig.caBundle",
                    "contains no PEM CERTIFICATE block",
                ));
            }
            Err(e) => return Err(ferr("spec.proxyConfig.caBundle", format!("bad PEM: {e}"))),
        }
    }
    Ok(())
}

fn validate_meta(m: &ObjectMeta, namespaced: bool) -> Result<(), FieldError> {
    dns_label("metadata.name", &m.name)?;
    match (&m.namespace, namespaced) {
        (Some(ns), true) => dns_label("metadata.namespace", ns),
        (None, true) => Ok(()),
        (Some(_), false) => Err(ferr(
            "metadata.namespace",
            "must not be set: the resource is cluster-scoped",
        )),
        (None, false) => Ok(()),
    }
}

fn check_header(v: &serde_json::Value, api: &str, kind: &str) -> Result<(), FieldError> {
    if v["apiVersion"] != api {
        return Err(ferr(
            "apiVersion",
            format!("{kind} must have apiVersion {api}, not {}", v["apiVersion"]),
        ));
    }
    Ok(())
}

fn from_value<T: serde::de::DeserializeOwned>(v: serde_json::Value) -> Result<T, FieldError> {
    serde_json::from_value(v).map_err(|e| {
        // serde names the field in the message; keep the whole message.
        ferr("document", e.to_string())
    })
}

fn is_duration(s: &str) -> bool {
    let unit_at = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    unit_at > 0 && matches!(&s[unit_at..], "ms" | "s" | "m" | "h")
}

/// Parses and validates one document. Fills uid and creationTimestamp when absent.
pub fn parse_resource(v: serde_json::Value) -> Result<AddOnResource, FieldError> {
    let kind = v["kind"]
        .as_str()
        .ok_or_else(|| ferr("kind", "missing"))?
        .to_string();
    if !v["metadata"].is_object() {
        return Err(ferr("metadata", "missing"));
    }
    if !v["metadata"]["name"].is_string() {
        return Err(ferr("metadata.name", "missing"));
    }
    let mut r = match kind.as_str() {
        ClusterManagementAddOn::KIND => {
            check_header(&v, ADDON_API_VERSION, &kind)?;
            let spec_v = v.get("spec").cloned().unwrap_or(serde_json::json!({}));
            let spec: ClusterManagementAddOnSpec =
                serde_json::from_value(spec_v).map_err(|e| ferr("spec", e.to_string()))?;
            let r = ClusterManagementAddOn {
                api_version: ADDON_API_VERSION.into(),
                kind,
                metadata: from_value(v["metadata"].clone())?,
                spec,
            };
            validate_meta(&r.metadata, false)?;
            match r.spec.install_strategy.type_.as_str() {
                "All" | "Manual" => {}
                "LabelSelector" => {
                    if r.spec.install_strategy.selector.is_none() {
                        return Err(ferr(
                            "spec.installStrategy.selector",
                            "required when type is LabelSelector",
                        ));
                    }
                }
                t => {
                    return Err(ferr(
                        "spec.installStrategy.type",
                        format!("{t:?} is not one of All, LabelSelector, Manual"),
                    ));
                }
            }
            for (i, c) in r.spec.default_configs.iter().enumerate() {
                c.validate(&format!("spec.defaultConfigs[{i}]"))?;
            }
            AddOnResource::ClusterManagementAddOn(r)
        }
        ManagedClusterAddOn::KIND => {
            check_header(&v, ADDON_API_VERSION, &kind)?;
            let spec_v = v.get("spec").cloned().unwrap_or(serde_json::json!({}));
            let mut spec: ManagedClusterAddOnSpec =
                serde_json::from_value(spec_v).map_err(|e| ferr("spec", e.to_string()))?;
            if spec.install_namespace.is_empty() {
                spec.install_namespace = DEFAULT_INSTALL_NAMESPACE.into();
            }
            let r = ManagedClusterAddOn {
                api_version: ADDON_API_VERSION.into(),
                kind,
                metadata: from_value(v["metadata"].clone())?,
                spec,
                status: Default::default(),
            };
            validate_meta(&r.metadata, true)?;
            if r.metadata.namespace.is_none() {
                return Err(ferr(
                    "metadata.namespace",
                    "required: the managed cluster's name",
                ));
            }
            dns_label("spec.installNamespace", &r.spec.install_namespace)?;
            for (i, c) in r.spec.configs.iter().enumerate() {
                c.validate(&format!("spec.configs[{i}]"))?;
            }
            AddOnResource::ManagedClusterAddOn(r)
        }
        AddOnDeploymentConfig::KIND => {
            check_header(&v, ADDON_API_VERSION, &kind)?;
            let spec_v = v.get("spec").cloned().unwrap_or(serde_json::json!({}));
            let spec: AddOnDeploymentConfigSpec =
                serde_json::from_value(spec_v).map_err(|e| ferr("spec", e.to_string()))?;
            let mut r = AddOnDeploymentConfig {
                api_version: ADDON_API_VERSION.into(),
                kind,
                metadata: from_value(v["metadata"].clone())?,
                spec,
            };
            validate_meta(&r.metadata, true)?;
            if r.metadata.namespace.is_none() {
                r.metadata.namespace = Some(DEFAULT_NAMESPACE.into());
            }
            validate_proxy_config(&r.spec.proxy_config)?;
            for (i, cv) in r.spec.customized_variables.iter().enumerate() {
                if cv.name.is_empty() {
                    return Err(ferr(
                        format!("spec.customizedVariables[{i}].name"),
                        "must not be empty",
                    ));
                }
            }
            AddOnResource::AddOnDeploymentConfig(r)
        }
        ManagedProxyConfiguration::KIND => {
            check_header(&v, PROXY_API_VERSION, &kind)?;
            let spec_v = v.get("spec").cloned().unwrap_or(serde_json::json!({}));
            let spec: ManagedProxyConfigurationSpec =
                serde_json::from_value(spec_v).map_err(|e| ferr("spec", e.to_string()))?;
            let r = ManagedProxyConfiguration {
                api_version: PROXY_API_VERSION.into(),
                kind,
                metadata: from_value(v["metadata"].clone())?,
                spec,
                status: Default::default(),
            };
            validate_meta(&r.metadata, false)?;
            let s = &r.spec;
            if s.authentication.signer.type_ != "SelfSigned" {
                return Err(ferr(
                    "spec.authentication.signer.type",
                    format!(
                        "{:?} is not supported (SelfSigned)",
                        s.authentication.signer.type_
                    ),
                ));
            }
            if s.proxy_server.replicas == 0 {
                return Err(ferr("spec.proxyServer.replicas", "must be at least 1"));
            }
            if s.proxy_server.entrypoints.is_empty() {
                return Err(ferr(
                    "spec.proxyServer.entrypoints",
                    "at least one broker entrypoint is required",
                ));
            }
            for (i, e) in s.proxy_server.entrypoints.iter().enumerate() {
                if e.host.is_empty() || e.host.contains(['/', ' ', ':']) && !e.host.starts_with('[')
                {
                    return Err(ferr(
                        format!("spec.proxyServer.entrypoints[{i}].host"),
                        format!("{:?} is not a host name or IP", e.host),
                    ));
                }
                if !(1..=65535).contains(&e.port) {
                    return Err(ferr(
                        format!("spec.proxyServer.entrypoints[{i}].port"),
                        format!("{} is not 1-65535", e.port),
                    ));
                }
            }
            if s.proxy_agent.replicas == 0 {
                return Err(ferr("spec.proxyAgent.replicas", "must be at least 1"));
            }
            if !s.proxy_agent.keepalive.is_empty() && !is_duration(&s.proxy_agent.keepalive) {
                return Err(ferr(
                    "spec.proxyAgent.keepalive",
                    format!("{:?} is not a duration like 10s", s.proxy_agent.keepalive),
                ));
            }
            AddOnResource::ManagedProxyConfiguration(r)
        }
        other => {
            return Err(ferr(
                "kind",
                format!(
                    "{other:?} is not one of ClusterManagementAddOn, ManagedClusterAddOn, AddOnDeploymentConfig, ManagedProxyConfiguration"
                ),
            ));
        }
    };
    let m = match &mut r {
        AddOnResource::ClusterManagementAddOn(x) => &mut x.metadata,
        AddOnResource::ManagedClusterAddOn(x) => &mut x.metadata,
        AddOnResource::AddOnDeploymentConfig(x) => &mut x.metadata,
        AddOnResource::ManagedProxyConfiguration(x) => &mut x.metadata,
    };
    if m.uid.is_empty() {
        m.uid = crate::resources::random_uid();
    }
    if m.creation_timestamp.is_empty() {
        m.creation_timestamp = crate::resources::rfc3339(std::time::SystemTime::now());
    }
    m.resource_version = None;
    Ok(r)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn adc(proxy: serde_json::Value) -> serde_json::Value {
        json!({"apiVersion": ADDON_API_VERSION, "kind": "AddOnDeploymentConfig",
               "metadata": {"name": "proxy", "namespace": "default"},
               "spec": {"proxyConfig": proxy}})
    }

    #[test]
    fn no_proxy_alone_is_kept() {
        let r = parse_resource(adc(json!({"noProxy": "10.0.0.0/8,.svc"}))).unwrap();
        let AddOnResource::AddOnDeploymentConfig(a) = r else {
            panic!()
        };
        assert_eq!(
            a.spec.proxy_config.env(),
            vec![
                ("NO_PROXY".to_string(), "10.0.0.0/8,.svc".to_string()),
                ("no_proxy".to_string(), "10.0.0.0/8,.svc".to_string())
            ]
        );
    }

    #[test]
    fn proxy_passwords_are_masked_in_debug() {
        let p = ProxyConfig {
            https_proxy: "https://user:s3cret@proxy:3129".into(),
            ..Default::default()
        };
        let d = format!("{p:?}");
        assert!(!d.contains("s3cret") && d.contains("proxy:3129"), "{d}");
    }

    #[test]
    fn errors_name_the_field() {
        let e = parse_resource(adc(json!({"httpsProxy": "ftp://x"}))).unwrap_err();
        assert_eq!(e.field, "spec.proxyConfig.httpsProxy");
        let e = parse_resource(adc(json!({"httpProxy": "http://h:99999"}))).unwrap_err();
        assert_eq!(e.field, "spec.proxyConfig.httpProxy");
        let e = parse_resource(adc(json!({"caBundle": "nope"}))).unwrap_err();
        assert_eq!(e.field, "spec.proxyConfig.caBundle");
        let e = parse_resource(adc(json!({"bogus": 1}))).unwrap_err();
        assert!(e.to_string().contains("bogus"), "{e}");
        let mpc = json!({"apiVersion": PROXY_API_VERSION, "kind": "ManagedProxyConfiguration",
            "metadata": {"name": "cluster-proxy"},
            "spec": {"proxyServer": {"entrypoints": [{"host": "b1", "port": 0}]}}});
        let e = parse_resource(mpc).unwrap_err();
        assert_eq!(e.field, "spec.proxyServer.entrypoints[0].port");
    }

    #[test]
    fn strategy_and_hash() {
        let s = InstallStrategy {
            type_: "LabelSelector".into(),
            selector: Some(LabelSelector {
                match_labels: [("env".to_string(), "prod".to_string())].into(),
            }),
        };
        assert!(s.selects(&[("env".to_string(), "prod".to_string())].into()));
        assert!(!s.selects(&BTreeMap::new()));
        let a = spec_hash(&ProxyConfig::default());
        let b = spec_hash(&ProxyConfig {
            no_proxy: "x".into(),
            ..Default::default()
        });
        assert_ne!(a, b);
        assert_eq!(a.len(), 64);
    }
}
