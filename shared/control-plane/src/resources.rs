//! OCM-shaped resources (apiVersion/kind/metadata/spec/status) stored in JetStream KV, and the
//! request/reply messages of the registration protocol.
//!
//! Resource shapes follow open-cluster-management.io/api (ManagedCluster), coordination.k8s.io
//! (Lease) and certificates.k8s.io (CertificateSigningRequest), serialised as camelCase JSON.

use std::collections::BTreeMap;
use std::time::{Duration, SystemTime};

use serde::{Deserialize, Serialize};

/// Why `tetherctl apply` input could not be split into documents.
#[derive(Debug, thiserror::Error)]
pub enum DocumentsError {
    #[error("parsing JSON: {0}")]
    Json(String),
    #[error("parsing YAML: {0}")]
    Yaml(String),
}

/// Splits `tetherctl apply` input into documents: a JSON object, a JSON array, a `kind: List`
/// with `items`, or YAML with one or several `---`-separated documents. A pure function (the
/// fuzz target `apply_documents` calls it).
pub fn parse_documents(text: &str) -> Result<Vec<serde_json::Value>, DocumentsError> {
    let trimmed = text.trim_start();
    let docs: Vec<serde_json::Value> = if trimmed.starts_with('{') || trimmed.starts_with('[') {
        match serde_json::from_str::<serde_json::Value>(text)
            .map_err(|e| DocumentsError::Json(e.to_string()))?
        {
            serde_json::Value::Array(a) => a,
            v => vec![v],
        }
    } else {
        serde_saphyr::from_multiple::<serde_json::Value>(text)
            .map_err(|e| DocumentsError::Yaml(e.to_string()))?
            .into_iter()
            .filter(|v| !v.is_null())
            .collect()
    };
    let mut out = Vec::new();
    for d in docs {
        if d["kind"] == "List"
            && let Some(items) = d["items"].as_array()
        {
            out.extend(items.iter().cloned());
        } else {
            out.push(d);
        }
    }
    Ok(out)
}

/// RFC 3339 UTC timestamp string ("2026-01-02T03:04:05Z").
pub fn rfc3339(t: SystemTime) -> String {
    let secs = t
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs() as i64;
    let dt =
        time::OffsetDateTime::from_unix_timestamp(secs).unwrap_or(time::OffsetDateTime::UNIX_EPOCH);
    format!(
        "{:04}-{:02}-{:02}T{:02}:{:02}:{:02}Z",
        dt.year(),
        dt.month() as u8,
        dt.day(),
        dt.hour(),
        dt.minute(),
        dt.second()
    )
}

/// Parses what [`rfc3339`] writes (also accepts fractional seconds and offsets via `time`).
pub fn parse_rfc3339(s: &str) -> Option<SystemTime> {
    let dt = time::OffsetDateTime::parse(s, &time::format_description::well_known::Rfc3339).ok()?;
    let secs = dt.unix_timestamp();
    let nanos = dt.nanosecond();
    (secs >= 0).then(|| SystemTime::UNIX_EPOCH + Duration::new(secs as u64, nanos))
}

/// Kubernetes-style object metadata (the subset we use).
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ObjectMeta {
    pub name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace: Option<String>,
    #[serde(default)]
    pub uid: String,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub labels: BTreeMap<String, String>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub annotations: BTreeMap<String, String>,
    #[serde(default)]
    pub creation_timestamp: String,
    /// The KV revision the object was read at (filled on read; not authoritative when stored).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resource_version: Option<String>,
}

impl ObjectMeta {
    pub fn new(name: &str) -> Self {
        Self {
            name: name.to_string(),
            uid: random_uid(),
            creation_timestamp: rfc3339(SystemTime::now()),
            ..Default::default()
        }
    }
}

pub fn random_uid() -> String {
    let b: [u8; 16] = rand::random();
    let h = hex::encode(b);
    format!(
        "{}-{}-{}-{}-{}",
        &h[0..8],
        &h[8..12],
        &h[12..16],
        &h[16..20],
        &h[20..32]
    )
}

/// A status condition (metav1.Condition).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct Condition {
    #[serde(rename = "type")]
    pub type_: String,
    /// "True", "False" or "Unknown".
    pub status: String,
    pub reason: String,
    pub message: String,
    pub last_transition_time: String,
}

/// OCM condition types on ManagedCluster.
pub mod condition {
    pub const HUB_ACCEPTED: &str = "HubAcceptedManagedCluster";
    pub const HUB_DENIED_REASON: &str = "HubClusterAdminDenied";
    pub const JOINED: &str = "ManagedClusterJoined";
    pub const AVAILABLE: &str = "ManagedClusterConditionAvailable";
    pub const CLOCK_SYNCED: &str = "ManagedClusterConditionClockSynced";
    pub const CERT_ROTATED: &str = "ClusterCertificateRotated";
}

/// Sets a condition, changing `lastTransitionTime` only when the status changes.
/// Returns true when anything changed.
pub fn set_condition(
    conds: &mut Vec<Condition>,
    type_: &str,
    status: &str,
    reason: &str,
    message: &str,
) -> bool {
    let now = rfc3339(SystemTime::now());
    match conds.iter_mut().find(|c| c.type_ == type_) {
        Some(c) => {
            let changed = c.status != status || c.reason != reason || c.message != message;
            if c.status != status {
                c.last_transition_time = now;
            }
            c.status = status.to_string();
            c.reason = reason.to_string();
            c.message = message.to_string();
            changed
        }
        None => {
            conds.push(Condition {
                type_: type_.to_string(),
                status: status.to_string(),
                reason: reason.to_string(),
                message: message.to_string(),
                last_transition_time: now,
            });
            true
        }
    }
}

pub fn condition_status<'a>(conds: &'a [Condition], type_: &str) -> Option<&'a str> {
    conds
        .iter()
        .find(|c| c.type_ == type_)
        .map(|c| c.status.as_str())
}

/// Default lease duration (OCM: 60 s).
pub const DEFAULT_LEASE_DURATION_SECONDS: u32 = 60;
/// Hub marks a cluster Unknown after this many lease durations without renewal (OCM: 5).
pub const DEFAULT_LEASE_GRACE_MULTIPLIER: u32 = 5;
/// A renewal that changes nothing but the renew time is kept in the serving hub's memory and
/// written to KV only once the stored renew time is this many lease durations old (cluster and
/// add-on leases). Readers that only see KV (another hub replica, the add-on controller,
/// `tetherctl get clusters`) therefore see a renew time up to this much older than the last
/// renewal, and extend the grace by [`lease_persist_interval`] for it: a silent agent is
/// declared gone between grace and grace + persist interval after its last renewal, never
/// before (docs/control-plane.md, "Lease renewals").
pub const LEASE_PERSIST_MULTIPLIER: u32 = 2;

/// How old a stored lease's renew time may get before a renewal is written to KV again
/// ([`LEASE_PERSIST_MULTIPLIER`] × the lease duration).
pub fn lease_persist_interval(lease_duration_seconds: u32) -> std::time::Duration {
    std::time::Duration::from_secs(
        u64::from(lease_duration_seconds) * u64::from(LEASE_PERSIST_MULTIPLIER),
    )
}

#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ClientConfig {
    pub url: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub ca_bundle: String,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ManagedClusterSpec {
    pub hub_accepts_client: bool,
    #[serde(default = "default_lease")]
    pub lease_duration_seconds: u32,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub managed_cluster_client_configs: Vec<ClientConfig>,
}

fn default_lease() -> u32 {
    DEFAULT_LEASE_DURATION_SECONDS
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ClusterClaim {
    pub name: String,
    pub value: String,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ManagedClusterStatus {
    #[serde(default)]
    pub conditions: Vec<Condition>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub cluster_claims: Vec<ClusterClaim>,
    /// Seconds until the hub marks the cluster Unknown if no lease renewal arrives (computed on
    /// read by `tetherctl get clusters`, not stored).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seconds_until_unknown: Option<i64>,
}

/// `cluster.open-cluster-management.io/v1` ManagedCluster.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ManagedCluster {
    pub api_version: String,
    pub kind: String,
    pub metadata: ObjectMeta,
    pub spec: ManagedClusterSpec,
    #[serde(default)]
    pub status: ManagedClusterStatus,
}

impl ManagedCluster {
    pub const API_VERSION: &'static str = "cluster.open-cluster-management.io/v1";
    pub const KIND: &'static str = "ManagedCluster";

    pub fn new(name: &str) -> Self {
        Self {
            api_version: Self::API_VERSION.into(),
            kind: Self::KIND.into(),
            metadata: ObjectMeta::new(name),
            spec: ManagedClusterSpec {
                hub_accepts_client: false,
                lease_duration_seconds: DEFAULT_LEASE_DURATION_SECONDS,
                managed_cluster_client_configs: vec![],
            },
            status: ManagedClusterStatus::default(),
        }
    }

    pub fn condition(&self, type_: &str) -> Option<&str> {
        condition_status(&self.status.conditions, type_)
    }
}

#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct LeaseSpec {
    pub holder_identity: String,
    pub lease_duration_seconds: u32,
    pub acquire_time: String,
    pub renew_time: String,
}

/// `coordination.k8s.io/v1` Lease (`managed-cluster-lease` in the cluster's namespace).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct Lease {
    pub api_version: String,
    pub kind: String,
    pub metadata: ObjectMeta,
    pub spec: LeaseSpec,
}

impl Lease {
    pub const API_VERSION: &'static str = "coordination.k8s.io/v1";
    pub const KIND: &'static str = "Lease";
    pub const NAME: &'static str = "managed-cluster-lease";
}

#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct CsrSpec {
    /// PEM CSR (Kubernetes base64-encodes it; we keep PEM text for readability).
    pub request: String,
    pub signer_name: String,
    pub usages: Vec<String>,
    pub username: String,
    #[serde(default)]
    pub expiration_seconds: Option<u64>,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct CsrStatus {
    #[serde(default)]
    pub conditions: Vec<Condition>,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub certificate: String,
}

/// `certificates.k8s.io/v1` CertificateSigningRequest.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct CertificateSigningRequest {
    pub api_version: String,
    pub kind: String,
    pub metadata: ObjectMeta,
    pub spec: CsrSpec,
    #[serde(default)]
    pub status: CsrStatus,
}

impl CertificateSigningRequest {
    pub const API_VERSION: &'static str = "certificates.k8s.io/v1";
    pub const KIND: &'static str = "CertificateSigningRequest";
    pub const CLUSTER_LABEL: &'static str = "open-cluster-management.io/cluster-name";

    pub fn phase(&self) -> CsrPhase {
        if condition_status(&self.status.conditions, "Denied") == Some("True") {
            CsrPhase::Denied
        } else if !self.status.certificate.is_empty() {
            CsrPhase::Issued
        } else if condition_status(&self.status.conditions, "Approved") == Some("True") {
            CsrPhase::Approved
        } else {
            CsrPhase::Pending
        }
    }
}

#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub enum CsrPhase {
    Pending,
    Approved,
    Issued,
    Denied,
}

/// A change record on the events stream.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct Event {
    pub api_version: String,
    pub kind: String,
    /// The object's kind and name.
    pub involved_object: InvolvedObject,
    /// "Normal" or "Warning".
    #[serde(rename = "type")]
    pub type_: String,
    pub reason: String,
    pub message: String,
    pub event_time: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub trace_id: Option<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct InvolvedObject {
    pub kind: String,
    pub name: String,
}

impl Event {
    pub fn new(
        kind: &str,
        name: &str,
        type_: &str,
        reason: &str,
        message: impl Into<String>,
    ) -> Self {
        Self {
            api_version: "events.k8s.io/v1".into(),
            kind: "Event".into(),
            involved_object: InvolvedObject {
                kind: kind.into(),
                name: name.into(),
            },
            type_: type_.into(),
            reason: reason.into(),
            message: message.into(),
            event_time: rfc3339(SystemTime::now()),
            trace_id: None,
        }
    }
}

/// Stored bootstrap token record (the secret itself is never stored, only its SHA-256).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct BootstrapTokenRecord {
    pub id: String,
    pub secret_sha256: String,
    pub expires: String,
    #[serde(default)]
    pub description: String,
}

// ---- protocol messages (JSON bodies on the request subjects) ----

/// `tether.v1.bootstrap.<cluster>.csr` and `tether.v1.cluster.<cluster>.csr` request.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct CsrSubmit {
    pub cluster_name: String,
    pub agent_name: String,
    /// PEM CSR.
    pub csr: String,
    #[serde(default)]
    pub cluster_claims: Vec<ClusterClaim>,
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
}

/// Reply to a CSR submit or status poll.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct CsrReply {
    /// Name of the CSR resource on the hub (poll with it).
    pub csr_name: String,
    pub phase: CsrPhase,
    /// PEM certificate once issued.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub certificate: String,
    /// Human-readable progress ("waiting for `tetherctl accept c1`", a denial reason, ...).
    #[serde(default)]
    pub message: String,
}

/// `…csr.get` request.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct CsrGet {
    pub csr_name: String,
}

/// `tether.v1.cluster.<cluster>.lease` request.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct LeaseRenew {
    pub agent_name: String,
    pub lease_duration_seconds: u32,
    #[serde(default)]
    pub cluster_claims: Vec<ClusterClaim>,
    /// Agent's clock, for the ClockSynced condition.
    pub agent_time: String,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct LeaseReply {
    pub accepted: bool,
    /// Lease duration the hub expects (spec.leaseDurationSeconds).
    pub lease_duration_seconds: u32,
    #[serde(default)]
    pub message: String,
}

/// Generic error reply body: `{"error": "..."}` with a `Tether-Error` header.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ErrorReply {
    pub error: String,
}

/// `tether.v1.admin.accept|deny` request.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct AdminClusterRequest {
    pub cluster_name: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn time_round_trip() {
        let t = SystemTime::UNIX_EPOCH + Duration::from_secs(1_800_000_000);
        assert_eq!(parse_rfc3339(&rfc3339(t)), Some(t));
    }

    #[test]
    fn managed_cluster_is_ocm_shaped() {
        let mut mc = ManagedCluster::new("c1");
        set_condition(
            &mut mc.status.conditions,
            condition::JOINED,
            "True",
            "ManagedClusterJoined",
            "joined",
        );
        let v = serde_json::to_value(&mc).unwrap();
        assert_eq!(v["apiVersion"], "cluster.open-cluster-management.io/v1");
        assert_eq!(v["spec"]["hubAcceptsClient"], false);
        assert_eq!(v["spec"]["leaseDurationSeconds"], 60);
        assert_eq!(v["status"]["conditions"][0]["type"], "ManagedClusterJoined");
        assert!(!set_condition(
            &mut mc.status.conditions,
            condition::JOINED,
            "True",
            "ManagedClusterJoined",
            "joined"
        ));
    }
}
