#!/bin/sh
# One-shot `setup` service: the cluster-proxy add-on resources on the hub (tetherctl apply,
# idempotent). The static ones are in compose/config/addons.yaml (ClusterManagementAddOn with
# Manual install, the ManagedProxyConfiguration, edge-1's AddOnDeploymentConfig); edge-2's
# AddOnDeploymentConfig is written here because it carries secrets read at run time. Each
# cluster's ManagedClusterAddOn names its own AddOnDeploymentConfig, i.e. its own proxy: edge-1
# an HTTP proxy, edge-2 an HTTPS proxy with basic auth whose CA (caBundle) is the simulated
# clusters' CA.
# A ManagedClusterAddOn lives in its cluster's namespace: the hub removes one whose cluster
# does not exist (yet), so those are applied once both clusters have joined (auto-accepted).
set -eu
hub=/etc/tether/hub sim=/etc/tether/sim
pw=$(cat "$sim/edge-2/proxy.password")
ca=$(sed 's/^/      /' "$sim/ca/ca.crt")
apply() { tetherctl apply --hub-dir "$hub" -f -; }
apply </opt/tether/addons.yaml
apply <<YAML
apiVersion: addon.open-cluster-management.io/v1alpha1
kind: AddOnDeploymentConfig
metadata: {name: proxy-edge-2, namespace: default}
spec:
  proxyConfig:
    httpsProxy: "https://tether:$pw@squid:3129"
    caBundle: |
$ca
YAML

# Both clusters accepted (bounded wait: the agents join within seconds of their proxy).
deadline=$(($(date +%s) + ${SETUP_WAIT_SECONDS:-600}))
until tetherctl get clusters --hub-dir "$hub" -o json >/tmp/clusters.json 2>/dev/null &&
  grep -q '"edge-1"' /tmp/clusters.json && grep -q '"edge-2"' /tmp/clusters.json; do
  if [ "$(date +%s)" -gt "$deadline" ]; then
    echo "setup: edge-1 and edge-2 did not join within ${SETUP_WAIT_SECONDS:-600}s" >&2
    exit 1
  fi
  sleep 1
done

# Each cluster's ManagedClusterAddOn names that cluster's proxy config.
for c in edge-1 edge-2; do
  apply <<YAML
apiVersion: addon.open-cluster-management.io/v1alpha1
kind: ManagedClusterAddOn
metadata: {name: cluster-proxy, namespace: $c}
spec:
  configs:
    - {group: addon.open-cluster-management.io, resource: addondeploymentconfigs, namespace: default, name: proxy-$c}
YAML
done
echo "setup: add-on resources applied"
