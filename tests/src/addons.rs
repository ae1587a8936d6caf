//! The cluster-proxy add-on resources the end-to-end tests apply with `tetherctl apply -f`:
//! one [`ClusterProxyAddOn`] renders the ClusterManagementAddOn `cluster-proxy` (installed on
//! every cluster), its AddOnDeploymentConfig `default/cluster-proxy-config` and the
//! ManagedProxyConfiguration `cluster-proxy`, with what the tests vary as fields.

use std::fmt::Write as _;

/// The three documents of the cluster-proxy add-on.
#[derive(Debug, Clone, Copy)]
pub struct ClusterProxyAddOn<'a> {
    /// `spec.addOnMeta.displayName` of the ClusterManagementAddOn.
    pub display_name: Option<&'a str>,
    /// `proxyConfig.httpsProxy` of the AddOnDeploymentConfig (`noProxy` is always
    /// `10.0.0.0/8,.svc`).
    pub https_proxy: Option<&'a str>,
    /// `spec.proxyServer.replicas`.
    pub server_replicas: u32,
    /// `spec.proxyServer.entrypoints`: host and optional port.
    pub entrypoints: &'a [(&'a str, Option<u16>)],
    /// `spec.proxyAgent.keepalive`.
    pub keepalive: &'a str,
}

impl Default for ClusterProxyAddOn<'_> {
    fn default() -> Self {
        Self {
            display_name: None,
            https_proxy: None,
            server_replicas: 1,
            entrypoints: &[("broker-entrypoint.invalid", None)],
            keepalive: "5s",
        }
    }
}

impl ClusterProxyAddOn<'_> {
    /// The YAML of the three documents.
    pub fn yaml(&self) -> String {
        let meta = self
            .display_name
            .map(|n| format!("  addOnMeta:\n    displayName: {n}\n"))
            .unwrap_or_default();
        let https_proxy = self
            .https_proxy
            .map(|p| format!("    httpsProxy: {p}\n"))
            .unwrap_or_default();
        let mut entrypoints = String::new();
        for (host, port) in self.entrypoints {
            let _ = writeln!(entrypoints, "      - host: {host}");
            if let Some(port) = port {
                let _ = writeln!(entrypoints, "        port: {port}");
            }
        }
        let (replicas, keepalive) = (self.server_replicas, self.keepalive);
        format!(
            r#"
apiVersion: addon.open-cluster-management.io/v1alpha1
kind: ClusterManagementAddOn
metadata:
  name: cluster-proxy
spec:
{meta}  installStrategy:
    type: All
  defaultConfigs:
    - group: addon.open-cluster-management.io
      resource: addondeploymentconfigs
      namespace: default
      name: cluster-proxy-config
    - group: proxy.open-cluster-management.io
      resource: managedproxyconfigurations
      name: cluster-proxy
---
apiVersion: addon.open-cluster-management.io/v1alpha1
kind: AddOnDeploymentConfig
metadata:
  name: cluster-proxy-config
  namespace: default
spec:
  proxyConfig:
{https_proxy}    noProxy: "10.0.0.0/8,.svc"
---
apiVersion: proxy.open-cluster-management.io/v1alpha1
kind: ManagedProxyConfiguration
metadata:
  name: cluster-proxy
spec:
  authentication:
    signer:
      type: SelfSigned
  proxyServer:
    replicas: {replicas}
    entrypoints:
{entrypoints}  proxyAgent:
    replicas: 1
    keepalive: {keepalive}
"#
        )
    }
}
