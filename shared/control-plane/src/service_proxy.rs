//! The service proxy's allowlist as a hub resource.
//!
//! [`ServiceProxyAllowlist`] (`proxy.tether.io/v1alpha1`, KV `tether-serviceproxyallowlists`,
//! key = name) lists the in-cluster services the brokers' HTTP service proxy may reach through
//! `/<cluster>/api/v1/namespaces/<ns>/services/<[proto:]svc:port>/proxy-service/<path>`. The
//! effective allowlist is the union of every stored object; a service no entry names is refused
//! (default deny), so deleting every object denies every service. Written by
//! `tetherctl apply -f` (validated first, so nothing invalid is stored); brokers watch the
//! bucket, and an entry that does not decode or validate is ignored with a warning while the
//! key's last good version stays in force.

use serde::{Deserialize, Serialize};

use crate::addons::FieldError;
use crate::clients::{CLIENT_API_VERSION, validate_client_name};
use crate::resources::ObjectMeta;

/// One allowlist (`tether-serviceproxyallowlists/<name>`).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ServiceProxyAllowlist {
    pub api_version: String,
    pub kind: String,
    pub metadata: ObjectMeta,
    pub spec: ServiceProxyAllowlistSpec,
}

impl ServiceProxyAllowlist {
    pub const KIND: &'static str = "ServiceProxyAllowlist";

    pub fn new(name: &str, services: Vec<AllowedService>) -> Self {
        Self {
            api_version: CLIENT_API_VERSION.into(),
            kind: Self::KIND.into(),
            metadata: ObjectMeta::new(name),
            spec: ServiceProxyAllowlistSpec { services },
        }
    }
}

#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ServiceProxyAllowlistSpec {
    pub services: Vec<AllowedService>,
}

/// A service the proxy may reach: on which clusters, which namespace and name, which ports.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct AllowedService {
    /// Cluster names or globs (`*`, `prod-*`).
    pub clusters: Vec<String>,
    pub namespace: String,
    pub name: String,
    /// Allowed ports; empty = any port of the service.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ports: Vec<u16>,
}

impl AllowedService {
    /// Whether this entry admits `namespace/name:port` on `cluster`.
    pub fn admits(&self, cluster: &str, namespace: &str, name: &str, port: u16) -> bool {
        self.namespace == namespace
            && self.name == name
            && (self.ports.is_empty() || self.ports.contains(&port))
            && self.clusters.iter().any(|g| match g.strip_suffix('*') {
                Some(prefix) => cluster.starts_with(prefix),
                None => g == cluster,
            })
    }
}

fn ferr(field: impl Into<String>, message: impl Into<String>) -> FieldError {
    FieldError {
        field: field.into(),
        message: message.into(),
    }
}

/// Checks a decoded allowlist; errors name the field.
pub fn validate(a: &ServiceProxyAllowlist) -> Result<(), FieldError> {
    if a.api_version != CLIENT_API_VERSION {
        return Err(ferr(
            "apiVersion",
            format!(
                "ServiceProxyAllowlist must have apiVersion {CLIENT_API_VERSION}, not {:?}",
                a.api_version
            ),
        ));
    }
    if a.kind != ServiceProxyAllowlist::KIND {
        return Err(ferr("kind", "must be ServiceProxyAllowlist"));
    }
    validate_client_name("metadata.name", &a.metadata.name)?;
    if a.metadata.namespace.is_some() {
        return Err(ferr(
            "metadata.namespace",
            "must not be set: the resource is cluster-scoped",
        ));
    }
    for (i, s) in a.spec.services.iter().enumerate() {
        if s.clusters.is_empty() {
            return Err(ferr(
                format!("spec.services[{i}].clusters"),
                "must name at least one cluster or glob",
            ));
        }
        for (j, g) in s.clusters.iter().enumerate() {
            if g.is_empty() || g.trim_end_matches('*').contains('*') {
                return Err(ferr(
                    format!("spec.services[{i}].clusters[{j}]"),
                    format!("{g:?}: a cluster name, or a glob with one trailing '*'"),
                ));
            }
        }
        validate_client_name(&format!("spec.services[{i}].namespace"), &s.namespace)?;
        validate_client_name(&format!("spec.services[{i}].name"), &s.name)?;
        if let Some(j) = s.ports.iter().position(|p| *p == 0) {
            return Err(ferr(
                format!("spec.services[{i}].ports[{j}]"),
                "port 0 is not a port",
            ));
        }
    }
    Ok(())
}

/// Parses and validates a ServiceProxyAllowlist document (as `tetherctl apply -f` reads it, or
/// as a broker reads a KV entry); errors name the field.
pub fn parse(v: serde_json::Value) -> Result<ServiceProxyAllowlist, FieldError> {
    if v["kind"] != ServiceProxyAllowlist::KIND {
        return Err(ferr("kind", "must be ServiceProxyAllowlist"));
    }
    let a: ServiceProxyAllowlist =
        serde_json::from_value(v).map_err(|e| ferr("", e.to_string()))?;
    validate(&a)?;
    Ok(a)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn doc(spec: serde_json::Value) -> serde_json::Value {
        serde_json::json!({"apiVersion": CLIENT_API_VERSION, "kind": "ServiceProxyAllowlist",
            "metadata": {"name": "default"}, "spec": spec})
    }

    #[test]
    fn parse_validates_and_admits() {
        let a = parse(doc(serde_json::json!({"services": [
            {"clusters": ["prod-*"], "namespace": "default", "name": "web", "ports": [8080]}
        ]})))
        .unwrap();
        let s = &a.spec.services[0];
        assert!(s.admits("prod-1", "default", "web", 8080));
        assert!(!s.admits("prod-1", "default", "web", 8081));
        assert!(!s.admits("dev-1", "default", "web", 8080));
        assert!(!s.admits("prod-1", "kube-system", "web", 8080));
        let e = parse(doc(serde_json::json!({"services": [
            {"clusters": ["a*b"], "namespace": "default", "name": "web"}
        ]})))
        .unwrap_err();
        assert_eq!(e.field, "spec.services[0].clusters[0]");
        let e = parse(doc(serde_json::json!({"services": [
            {"clusters": ["*"], "namespace": "Default", "name": "web"}
        ]})))
        .unwrap_err();
        assert_eq!(e.field, "spec.services[0].namespace");
        assert!(parse(doc(serde_json::json!({"servces": []}))).is_err());
    }
}
