//! Versioned NATS subjects of the control plane (documented in docs/control-plane.md).
//!
//! Everything lives under `tether.v1.`:
//! - `tether.v1.bootstrap.<cluster>.csr` — request: a bootstrap-credential client submits a CSR.
//! - `tether.v1.bootstrap.<cluster>.csr.get` — request: poll a CSR's status.
//! - `tether.v1.cluster.<cluster>.lease` — request: renew the cluster's lease.
//! - `tether.v1.cluster.<cluster>.csr` — request: certificate renewal with cluster credentials.
//! - `tether.v1.cluster.<cluster>.csr.get` — request: poll a renewal CSR.
//! - `tether.v1.cluster.<cluster>.notify` — hub → agent notifications.
//! - `tether.v1.cluster.<cluster>.addon.<addon>.status` — agent → hub: applied config hashes.
//! - `tether.v1.cluster.<cluster>.addon.<addon>.lease` — agent → hub: add-on health lease.
//! - `tether.v1.cluster.<cluster>.addon.<addon>.config` — agent → hub: the add-on's desired config.
//! - `tether.v1.cluster.<cluster>.addon.<addon>.csr[.get]` — agent → hub: add-on credentials.
//! - `tether.v1.events.<kind>.<name>` — the JetStream events stream (every state change).
//! - `tether.v1.admin.<verb>` — requests from `tetherctl` (hub credentials only).
//!
//! Inbox prefixes are per connection: `_INBOX.<connection-id>`; a client's permissions allow
//! replies only on its own prefix, so no client can read another's replies.

/// Version segment of every subject.
pub const VERSION: &str = "v1";
pub const ROOT: &str = "tether.v1";

pub fn bootstrap_csr(cluster: &str) -> String {
    format!("{ROOT}.bootstrap.{cluster}.csr")
}
pub fn bootstrap_csr_get(cluster: &str) -> String {
    format!("{ROOT}.bootstrap.{cluster}.csr.get")
}
/// Wildcards the hub's registration controller subscribes to.
pub const BOOTSTRAP_CSR_ALL: &str = "tether.v1.bootstrap.*.csr";
pub const BOOTSTRAP_CSR_GET_ALL: &str = "tether.v1.bootstrap.*.csr.get";

pub fn cluster_prefix(cluster: &str) -> String {
    format!("{ROOT}.cluster.{cluster}")
}
pub fn cluster_lease(cluster: &str) -> String {
    format!("{ROOT}.cluster.{cluster}.lease")
}
pub fn cluster_csr(cluster: &str) -> String {
    format!("{ROOT}.cluster.{cluster}.csr")
}
pub fn cluster_csr_get(cluster: &str) -> String {
    format!("{ROOT}.cluster.{cluster}.csr.get")
}
pub fn cluster_notify(cluster: &str) -> String {
    format!("{ROOT}.cluster.{cluster}.notify")
}
/// Agent → hub: what the add-on agent has applied (`addons::AddOnStatusReport`).
pub fn cluster_addon_status(cluster: &str, addon: &str) -> String {
    format!("{ROOT}.cluster.{cluster}.addon.{addon}.status")
}
pub const CLUSTER_ADDON_STATUS_ALL: &str = "tether.v1.cluster.*.addon.*.status";
/// Agent → hub: renew the add-on's health lease (`addons::AddOnLeaseRenew`).
pub fn cluster_addon_lease(cluster: &str, addon: &str) -> String {
    format!("{ROOT}.cluster.{cluster}.addon.{addon}.lease")
}
pub const CLUSTER_ADDON_LEASE_ALL: &str = "tether.v1.cluster.*.addon.*.lease";
/// Agent → hub request: the add-on agent's desired config
/// (`addons::AddOnAgentConfigRequest` → `addons::AddOnAgentConfigReply`).
pub fn cluster_addon_config(cluster: &str, addon: &str) -> String {
    format!("{ROOT}.cluster.{cluster}.addon.{addon}.config")
}
pub const CLUSTER_ADDON_CONFIG_ALL: &str = "tether.v1.cluster.*.addon.*.config";
/// Agent → hub request: the add-on's client certificate CSR (body as for `cluster.<c>.csr`).
pub fn cluster_addon_csr(cluster: &str, addon: &str) -> String {
    format!("{ROOT}.cluster.{cluster}.addon.{addon}.csr")
}
pub const CLUSTER_ADDON_CSR_ALL: &str = "tether.v1.cluster.*.addon.*.csr";
/// Agent → hub request: poll the add-on CSR.
pub fn cluster_addon_csr_get(cluster: &str, addon: &str) -> String {
    format!("{ROOT}.cluster.{cluster}.addon.{addon}.csr.get")
}
pub const CLUSTER_ADDON_CSR_GET_ALL: &str = "tether.v1.cluster.*.addon.*.csr.get";
/// The add-on name in `tether.v1.cluster.<c>.addon.<a>.status|lease`.
pub fn addon_of(subject: &str) -> Option<&str> {
    let parts: Vec<&str> = subject.split('.').collect();
    match parts.as_slice() {
        [
            "tether",
            "v1",
            "cluster",
            _,
            "addon",
            a,
            "status" | "lease" | "config" | "csr",
        ]
        | ["tether", "v1", "cluster", _, "addon", a, "csr", "get"] => Some(a),
        _ => None,
    }
}
pub const CLUSTER_LEASE_ALL: &str = "tether.v1.cluster.*.lease";
pub const CLUSTER_CSR_ALL: &str = "tether.v1.cluster.*.csr";
pub const CLUSTER_CSR_GET_ALL: &str = "tether.v1.cluster.*.csr.get";

pub const EVENTS_ALL: &str = "tether.v1.events.>";
pub fn event(kind: &str, name: &str) -> String {
    format!("{ROOT}.events.{}.{name}", kind.to_ascii_lowercase())
}

pub const ADMIN_ACCEPT: &str = "tether.v1.admin.accept";
pub const ADMIN_DENY: &str = "tether.v1.admin.deny";

/// The cluster name in `tether.v1.<area>.<cluster>.…`.
pub fn cluster_of(subject: &str) -> Option<&str> {
    let mut it = subject.split('.');
    match (it.next(), it.next(), it.next(), it.next()) {
        (Some("tether"), Some("v1"), Some("bootstrap" | "cluster"), Some(c)) => Some(c),
        _ => None,
    }
}

/// NATS auth-callout subject (server → callout service).
pub const AUTH_CALLOUT: &str = "$SYS.REQ.USER.AUTH";

/// Inbox prefix for a connection id.
pub fn inbox_prefix(connection_id: &str) -> String {
    format!("_INBOX.{connection_id}")
}

/// JetStream names.
pub const BUCKET_CLUSTERS: &str = "tether-managedclusters";
pub const BUCKET_LEASES: &str = "tether-leases";
pub const BUCKET_CSRS: &str = "tether-csrs";
pub const BUCKET_TOKENS: &str = "tether-bootstrap-tokens";
pub const BUCKET_CLUSTER_MANAGEMENT_ADDONS: &str = "tether-clustermanagementaddons";
pub const BUCKET_MANAGED_CLUSTER_ADDONS: &str = "tether-managedclusteraddons";
pub const BUCKET_ADDON_DEPLOYMENT_CONFIGS: &str = "tether-addondeploymentconfigs";
pub const BUCKET_PROXY_CONFIGURATIONS: &str = "tether-managedproxyconfigurations";
pub const BUCKET_ADDON_LEASES: &str = "tether-addon-leases";
pub const BUCKET_BROKERS: &str = "tether-brokers";
pub const STREAM_EVENTS: &str = "TETHER_EVENTS";

// ---- health-prober (issue 5) ----

/// Request/reply: the prober's latest results (`health::HealthGetRequest` →
/// `health::HealthGetReply`), answered from memory by every prober (queue group
/// [`HEALTH_QUEUE_GROUP`]).
pub const HEALTH_GET: &str = "tether.v1.health.get";
/// Queue group of the probers answering [`HEALTH_GET`].
pub const HEALTH_QUEUE_GROUP: &str = "tether-health";
/// KV bucket of per-cluster probe results (key `<cluster>`, `health::HealthRecord`).
pub const BUCKET_HEALTH: &str = "tether-health";
/// Health transitions on the events stream: `tether.v1.events.health.<cluster>`.
pub fn health_event(cluster: &str) -> String {
    format!("{ROOT}.events.health.{cluster}")
}

// ---- hub client credentials and access policy (issue 4) ----

/// Admin request: issue a hub client credential (`clients::ClientCreateRequest` →
/// `clients::ClientCreateReply`).
pub const ADMIN_CLIENT_CREATE: &str = "tether.v1.admin.client.create";
/// Admin request: delete (revoke) a hub client (`clients::ClientDeleteRequest` →
/// `clients::ClientDeleteReply`).
pub const ADMIN_CLIENT_DELETE: &str = "tether.v1.admin.client.delete";
/// KV bucket of hub clients (key `<client>`, `clients::HubClient`).
pub const BUCKET_HUB_CLIENTS: &str = "tether-hubclients";
/// KV bucket of client access policies (key `<policy>`, `clients::ClientAccessPolicy`).
pub const BUCKET_CLIENT_ACCESS_POLICIES: &str = "tether-clientaccesspolicies";
/// KV bucket of the service proxy's allowlists (key `<name>`,
/// `service_proxy::ServiceProxyAllowlist`).
pub const BUCKET_SERVICE_PROXY_ALLOWLISTS: &str = "tether-serviceproxyallowlists";
/// Controller leader leases of hub replicas (key = controller, e.g. `registration`).
pub const BUCKET_LEADERS: &str = "tether-leaders";

#[cfg(test)]
mod tests {
    #[test]
    fn cluster_of_subjects() {
        assert_eq!(super::cluster_of(&super::cluster_lease("c1")), Some("c1"));
        assert_eq!(super::cluster_of(&super::bootstrap_csr("c2")), Some("c2"));
        assert_eq!(super::cluster_of("tether.v1.events.x.y"), None);
    }
}
