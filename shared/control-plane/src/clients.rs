//! Hub client credentials and access policy as resources.
//!
//! - [`HubClient`] (`proxy.tether.io/v1alpha1`, KV `tether-hubclients`, key = name): one hub
//!   client identity. It authenticates with a bearer token (only its SHA-256 is stored) or a
//!   client certificate with CN `tether:client:<name>` signed by the hub CA (the hub keeps its
//!   serial and expiry, never the key). Issued by addon-manager on
//!   `tether.v1.admin.client.create` ([`ClientCreateRequest`] → [`ClientCreateReply`], which
//!   carries the token or the key and certificate **once**); `tether.v1.admin.client.delete`
//!   revokes it.
//! - [`ClientAccessPolicy`] (`proxy.tether.io/v1alpha1`, KV `tether-clientaccesspolicies`, key =
//!   name): which clusters (names/globs or label selectors) and which targets (`apiserver` or
//!   `host:port` patterns) the named clients may reach. Semantics are exactly the broker's static
//!   `clients[].allow`: a client no rule names reaches the API server of every cluster and
//!   nothing else; once any rule names it, only its rules apply (deny by default).
//!   Written by `tetherctl apply -f`.
//!
//! Brokers with a control plane watch both buckets and enforce them merged with their static
//! config; a deleted HubClient stops authenticating new streams within seconds.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::addons::FieldError;
use crate::resources::ObjectMeta;

/// apiVersion of both kinds.
pub const CLIENT_API_VERSION: &str = "proxy.tether.io/v1alpha1";
/// Certificate CN prefix of hub clients (`tether:client:<name>`).
pub const CLIENT_CN_PREFIX: &str = "tether:client:";
/// Default lifetime of issued client certificates.
pub const DEFAULT_CERT_LIFETIME_SECONDS: u64 = 90 * 24 * 3600;

fn ferr(field: impl Into<String>, message: impl Into<String>) -> FieldError {
    FieldError {
        field: field.into(),
        message: message.into(),
    }
}

/// A hub client identity (`tether-hubclients/<name>`).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct HubClient {
    pub api_version: String,
    pub kind: String,
    pub metadata: ObjectMeta,
    pub spec: HubClientSpec,
}

impl HubClient {
    pub const KIND: &'static str = "HubClient";

    pub fn new(name: &str, spec: HubClientSpec) -> Self {
        Self {
            api_version: CLIENT_API_VERSION.into(),
            kind: Self::KIND.into(),
            metadata: ObjectMeta::new(name),
            spec,
        }
    }
}

/// How the client authenticates. Exactly one of the two.
#[derive(Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct HubClientSpec {
    /// Hex SHA-256 of the bearer token; the token itself is never stored.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token_sha256: Option<String>,
    /// The issued client certificate (CN `tether:client:<name>`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub certificate: Option<IssuedCertificate>,
}

impl std::fmt::Debug for HubClientSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HubClientSpec")
            .field(
                "token_sha256",
                &self.token_sha256.as_ref().map(|_| "<redacted>"),
            )
            .field("certificate", &self.certificate)
            .finish()
    }
}

/// What the hub remembers of an issued client certificate.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct IssuedCertificate {
    pub common_name: String,
    /// Hex serial number.
    #[serde(default)]
    pub serial: String,
    /// RFC 3339.
    #[serde(default)]
    pub not_after: String,
}

/// Which clients may reach what (`tether-clientaccesspolicies/<name>`).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ClientAccessPolicy {
    pub api_version: String,
    pub kind: String,
    pub metadata: ObjectMeta,
    pub spec: ClientAccessPolicySpec,
}

impl ClientAccessPolicy {
    pub const KIND: &'static str = "ClientAccessPolicy";
}

#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ClientAccessPolicySpec {
    /// HubClient names (or static broker client names) the rules apply to.
    pub clients: Vec<String>,
    pub rules: Vec<AccessRule>,
}

/// Clusters (by name glob and/or labels) × targets.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct AccessRule {
    /// Cluster name globs: `*`, `prod-*`, exact.
    #[serde(default)]
    pub clusters: Vec<String>,
    /// Clusters whose ManagedCluster labels include all of these.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cluster_selector: Option<ClusterSelector>,
    /// `apiserver`, or `host:port` patterns (`*`, `*.suffix`, exact host; port or `*`).
    pub targets: Vec<String>,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ClusterSelector {
    #[serde(default)]
    pub match_labels: BTreeMap<String, String>,
}

impl AccessRule {
    /// Whether the rule covers cluster `name` with `labels` (`None`: labels unknown).
    pub fn matches_cluster(&self, name: &str, labels: Option<&BTreeMap<String, String>>) -> bool {
        let by_name = self.clusters.iter().any(|g| cluster_glob(g, name));
        let by_label = match (&self.cluster_selector, labels) {
            (Some(s), Some(l)) => s.match_labels.iter().all(|(k, v)| l.get(k) == Some(v)),
            _ => false,
        };
        by_name || by_label
    }
}

/// `*` anywhere matches any run of characters (as the broker's cluster globs).
pub fn cluster_glob(glob: &str, cluster: &str) -> bool {
    crate::hub::glob_match(glob, cluster)
}

/// Checks a target pattern (`apiserver`, or `host:port` with host `*`, `*.suffix` or exact and
/// port a number or `*`).
pub fn validate_target(t: &str) -> Result<(), String> {
    if t == "apiserver" {
        return Ok(());
    }
    let (h, port) = t.rsplit_once(':').unwrap_or((t, "*"));
    if h.is_empty() {
        return Err(format!("{t:?} has an empty host"));
    }
    if port != "*" && port.parse::<u16>().is_err() {
        return Err(format!("{t:?} has an invalid port (number or *)"));
    }
    // By chars: a byte slice `h[1..]` panics when the host starts with a multi-byte char.
    if h.chars().skip(1).any(|c| c == '*') {
        return Err(format!(
            "{t:?}: '*' is only allowed as the whole host or a leading '*.'"
        ));
    }
    Ok(())
}

/// A client name: a DNS-1123 label (it becomes part of a certificate CN and a KV key).
pub fn validate_client_name(field: &str, name: &str) -> Result<(), FieldError> {
    let ok = !name.is_empty()
        && name.len() <= 63
        && name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
        && !name.starts_with('-')
        && !name.ends_with('-');
    if ok {
        Ok(())
    } else {
        Err(ferr(
            field,
            format!("{name:?} must be a DNS-1123 label (lower-case letters, digits, '-')"),
        ))
    }
}

/// Parses and validates a ClientAccessPolicy document; errors name the field.
pub fn parse_policy(v: serde_json::Value) -> Result<ClientAccessPolicy, FieldError> {
    if v["apiVersion"] != CLIENT_API_VERSION {
        return Err(ferr(
            "apiVersion",
            format!(
                "ClientAccessPolicy must have apiVersion {CLIENT_API_VERSION}, not {}",
                v["apiVersion"]
            ),
        ));
    }
    if v["kind"] != ClientAccessPolicy::KIND {
        return Err(ferr("kind", "must be ClientAccessPolicy"));
    }
    let mut metadata: ObjectMeta = serde_json::from_value(v["metadata"].clone())
        .map_err(|e| ferr("metadata", e.to_string()))?;
    validate_client_name("metadata.name", &metadata.name)?;
    if metadata.namespace.is_some() {
        return Err(ferr(
            "metadata.namespace",
            "must not be set: the resource is cluster-scoped",
        ));
    }
    let spec_v = v.get("spec").cloned().unwrap_or(serde_json::Value::Null);
    if !spec_v.is_object() {
        return Err(ferr("spec", "missing"));
    }
    let spec: ClientAccessPolicySpec =
        serde_json::from_value(spec_v).map_err(|e| ferr("spec", e.to_string()))?;
    if spec.clients.is_empty() {
        return Err(ferr("spec.clients", "must name at least one client"));
    }
    for (i, c) in spec.clients.iter().enumerate() {
        validate_client_name(&format!("spec.clients[{i}]"), c)?;
    }
    if spec.rules.is_empty() {
        return Err(ferr("spec.rules", "must have at least one rule"));
    }
    for (j, r) in spec.rules.iter().enumerate() {
        let no_selector = r
            .cluster_selector
            .as_ref()
            .is_none_or(|s| s.match_labels.is_empty());
        if r.clusters.is_empty() && no_selector {
            return Err(ferr(
                format!("spec.rules[{j}].clusters"),
                "set clusters and/or clusterSelector.matchLabels",
            ));
        }
        for (k, g) in r.clusters.iter().enumerate() {
            if g.is_empty() {
                return Err(ferr(format!("spec.rules[{j}].clusters[{k}]"), "empty glob"));
            }
        }
        if r.targets.is_empty() {
            return Err(ferr(
                format!("spec.rules[{j}].targets"),
                "must not be empty (apiserver or host:port patterns)",
            ));
        }
        for (k, t) in r.targets.iter().enumerate() {
            validate_target(t).map_err(|m| ferr(format!("spec.rules[{j}].targets[{k}]"), m))?;
        }
    }
    if metadata.uid.is_empty() {
        metadata.uid = crate::resources::random_uid();
    }
    if metadata.creation_timestamp.is_empty() {
        metadata.creation_timestamp = crate::resources::rfc3339(std::time::SystemTime::now());
    }
    Ok(ClientAccessPolicy {
        api_version: CLIENT_API_VERSION.into(),
        kind: ClientAccessPolicy::KIND.into(),
        metadata,
        spec,
    })
}

/// Hex SHA-256 of a token.
pub fn token_sha256(token: &str) -> String {
    hex::encode(Sha256::digest(token.as_bytes()))
}

/// A fresh bearer token: `tether-client.<name>.<43 random base64url characters>`.
pub fn new_token(name: &str) -> String {
    use base64::Engine as _;
    let b: [u8; 32] = rand::random();
    format!(
        "tether-client.{name}.{}",
        base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(b)
    )
}

/// `tether.v1.admin.client.create` body.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ClientCreateRequest {
    pub name: String,
    /// `token` or `certificate`.
    pub credential: String,
    /// Certificate lifetime in seconds (default 90 days).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cert_lifetime_seconds: Option<u64>,
}

/// `tether.v1.admin.client.create` reply: the secret material, shown once.
#[derive(Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ClientCreateReply {
    pub client: HubClient,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token: Option<String>,
    /// PEM certificate (CN `tether:client:<name>`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub certificate: Option<String>,
    /// PEM PKCS#8 key of the certificate (generated by the hub, never stored).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key: Option<String>,
    /// Hub CA bundle (to verify the brokers).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ca_bundle: Option<String>,
}

impl std::fmt::Debug for ClientCreateReply {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClientCreateReply")
            .field("client", &self.client)
            .field("token", &self.token.as_ref().map(|_| "<masked>"))
            .field("certificate", &self.certificate.is_some())
            .field("key", &self.key.as_ref().map(|_| "<masked>"))
            .finish()
    }
}

/// `tether.v1.admin.client.delete` body.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ClientDeleteRequest {
    pub name: String,
}

/// `tether.v1.admin.client.delete` reply.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ClientDeleteReply {
    pub deleted: bool,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A multi-byte first char used to panic (byte slicing); now a clear answer.
    #[test]
    fn target_patterns_with_multibyte_hosts_do_not_panic() {
        assert!(validate_target("é*:1").is_err());
        assert!(validate_target("\u{300}:*").is_ok());
    }

    #[test]
    fn policy_validation_names_the_field() {
        let ok = serde_json::json!({
            "apiVersion": CLIENT_API_VERSION, "kind": "ClientAccessPolicy",
            "metadata": {"name": "ops"},
            "spec": {"clients": ["ops"], "rules": [
                {"clusters": ["prod-*"], "targets": ["apiserver", "*.svc:8080"]},
                {"clusterSelector": {"matchLabels": {"env": "dev"}}, "targets": ["*:*"]}]}
        });
        let p = parse_policy(ok.clone()).unwrap();
        assert_eq!(p.spec.rules.len(), 2);
        let mut bad = ok.clone();
        bad["spec"]["rules"][0]["targets"][1] = "x:notaport".into();
        let e = parse_policy(bad).unwrap_err();
        assert_eq!(e.field, "spec.rules[0].targets[1]");
        let mut bad = ok.clone();
        bad["spec"]["rules"][1]["clusterSelector"]["matchLabels"] = serde_json::json!({});
        assert_eq!(
            parse_policy(bad).unwrap_err().field,
            "spec.rules[1].clusters"
        );
        let mut bad = ok;
        bad["spec"]["clients"][0] = "Bad_Name".into();
        assert_eq!(parse_policy(bad).unwrap_err().field, "spec.clients[0]");
    }

    #[test]
    fn rules_match_names_and_labels() {
        let r = AccessRule {
            clusters: vec!["prod-*".into()],
            cluster_selector: Some(ClusterSelector {
                match_labels: [("env".to_string(), "dev".to_string())].into(),
            }),
            targets: vec!["apiserver".into()],
        };
        assert!(r.matches_cluster("prod-1", None));
        assert!(!r.matches_cluster("dev-1", None));
        let l: BTreeMap<String, String> = [("env".to_string(), "dev".to_string())].into();
        assert!(r.matches_cluster("dev-1", Some(&l)));
        let t = new_token("ops");
        assert!(t.starts_with("tether-client.ops."));
        assert_eq!(token_sha256(&t).len(), 64);
    }
}
