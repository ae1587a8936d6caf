//! The NATS automation surface, checked: every request/reply and event subject has a JSON Schema
//! in `docs/schemas/`, generated from Rust types with `schemars`, and real traffic validates
//! against it.
//!
//! - `committed_schemas_match_generated`: regenerates every schema and fails when a committed
//!   file differs (`TETHER_UPDATE_SCHEMAS=1` rewrites them); also checks that
//!   `docs/nats-api.md` names every subject pattern.
//! - `live_traffic_validates_against_schemas`: a real hub (nats-server, addon-manager), a
//!   registration-agent joining, `tetherctl accept/deny/apply/proxy health`, add-on status and
//!   lease requests, a health-prober on NATS; an admin subscriber on `tether.v1.>` and `_INBOX.>`
//!   captures every message; each request, reply and event is validated against the schema of
//!   its subject (an error reply against `ErrorReply`); a subject without a schema fails.
//!
//! The schema types below mirror the message types of `tether-control` field by field with the
//! same serde attributes (`tether-control` does not depend on schemars); `deny_unknown_fields`
//! makes the schemas strict, so a field added to a message without updating its mirror and
//! schema fails the live test. `mirrors_agree_with_real_types` round-trips documented examples
//! through both the real type and its mirror.
//!
//! Run: `cargo build -p addon-manager -p tetherctl -p registration-agent -p health-prober -p tunnel-broker --bins && cargo test -p tether-e2e --test nats_schemas`.

use tether_e2e::registration;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt as _;
use registration::{Hub as NatsHub, HubOpts, start_agent};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use tether_control::connect::{self, ConnectConfig, Credentials};
use tether_control::hub::{ADMIN_USER, HubDir};
use tether_control::subjects;
use tether_test_support::{wait_until, wait_until_async};

// ---------------------------------------------------------------- schema types (mirrors)

mod m {
    use super::*;

    #[derive(Serialize, Deserialize, JsonSchema)]
    #[serde(deny_unknown_fields)]
    pub struct ClusterClaim {
        pub name: String,
        pub value: String,
    }

    /// `tether.v1.bootstrap.<c>.csr`, `tether.v1.cluster.<c>.csr`,
    /// `tether.v1.cluster.<c>.addon.<a>.csr` request.
    #[derive(Serialize, Deserialize, JsonSchema)]
    #[serde(rename_all = "camelCase", deny_unknown_fields)]
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

    #[derive(Serialize, Deserialize, JsonSchema)]
    #[serde(rename_all = "camelCase")]
    pub enum CsrPhase {
        Pending,
        Approved,
        Issued,
        Denied,
    }

    /// Reply to a CSR submit or poll.
    #[derive(Serialize, Deserialize, JsonSchema)]
    #[serde(rename_all = "camelCase", deny_unknown_fields)]
    pub struct CsrReply {
        pub csr_name: String,
        pub phase: CsrPhase,
        #[serde(default, skip_serializing_if = "String::is_empty")]
        pub certificate: String,
        #[serde(default)]
        pub message: String,
    }

    /// `…csr.get` request.
    #[derive(Serialize, Deserialize, JsonSchema)]
    #[serde(rename_all = "camelCase", deny_unknown_fields)]
    pub struct CsrGet {
        pub csr_name: String,
    }

    /// `tether.v1.cluster.<c>.lease` request.
    #[derive(Serialize, Deserialize, JsonSchema)]
    #[serde(rename_all = "camelCase", deny_unknown_fields)]
    pub struct LeaseRenew {
        pub agent_name: String,
        pub lease_duration_seconds: u32,
        #[serde(default)]
        pub cluster_claims: Vec<ClusterClaim>,
        pub agent_time: String,
    }

    #[derive(Serialize, Deserialize, JsonSchema)]
    #[serde(rename_all = "camelCase", deny_unknown_fields)]
    pub struct LeaseReply {
        pub accepted: bool,
        pub lease_duration_seconds: u32,
        #[serde(default)]
        pub message: String,
    }

    /// `tether.v1.admin.accept|deny` request.
    #[derive(Serialize, Deserialize, JsonSchema)]
    #[serde(rename_all = "camelCase", deny_unknown_fields)]
    pub struct AdminClusterRequest {
        pub cluster_name: String,
    }

    /// Error reply (with header `Tether-Error`).
    #[derive(Serialize, Deserialize, JsonSchema)]
    #[serde(deny_unknown_fields)]
    pub struct ErrorReply {
        pub error: String,
    }

    /// An empty object (`{}`): the reply to an add-on status report.
    #[derive(Serialize, Deserialize, JsonSchema)]
    #[serde(deny_unknown_fields)]
    pub struct Empty {}

    /// `tether.v1.cluster.<c>.notify` (hub → agent): `Denied`, or `AddOnConfigChanged` with the
    /// add-on.
    #[derive(Serialize, Deserialize, JsonSchema)]
    #[serde(deny_unknown_fields)]
    pub struct Notify {
        #[serde(rename = "type")]
        pub type_: String,
        #[serde(default)]
        pub addon: String,
    }

    #[derive(Serialize, Deserialize, JsonSchema)]
    #[serde(rename_all = "camelCase", deny_unknown_fields)]
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
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub resource_version: Option<String>,
    }

    #[derive(Serialize, Deserialize, JsonSchema)]
    #[serde(rename_all = "camelCase", deny_unknown_fields)]
    pub struct Condition {
        #[serde(rename = "type")]
        pub type_: String,
        /// "True", "False" or "Unknown".
        pub status: String,
        pub reason: String,
        pub message: String,
        pub last_transition_time: String,
    }

    #[derive(Serialize, Deserialize, JsonSchema)]
    #[serde(rename_all = "camelCase", deny_unknown_fields)]
    pub struct ClientConfig {
        pub url: String,
        #[serde(default, skip_serializing_if = "String::is_empty")]
        pub ca_bundle: String,
    }

    #[derive(Serialize, Deserialize, JsonSchema)]
    #[serde(rename_all = "camelCase", deny_unknown_fields)]
    pub struct ManagedClusterSpec {
        pub hub_accepts_client: bool,
        #[serde(default)]
        pub lease_duration_seconds: u32,
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        pub managed_cluster_client_configs: Vec<ClientConfig>,
    }

    #[derive(Default, Serialize, Deserialize, JsonSchema)]
    #[serde(rename_all = "camelCase", deny_unknown_fields)]
    pub struct ManagedClusterStatus {
        #[serde(default)]
        pub conditions: Vec<Condition>,
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        pub cluster_claims: Vec<ClusterClaim>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub seconds_until_unknown: Option<i64>,
    }

    /// `cluster.open-cluster-management.io/v1` ManagedCluster (reply to accept/deny).
    #[derive(Serialize, Deserialize, JsonSchema)]
    #[serde(rename_all = "camelCase", deny_unknown_fields)]
    pub struct ManagedCluster {
        pub api_version: String,
        pub kind: String,
        pub metadata: ObjectMeta,
        pub spec: ManagedClusterSpec,
        #[serde(default)]
        pub status: ManagedClusterStatus,
    }

    #[derive(Serialize, Deserialize, JsonSchema)]
    #[serde(rename_all = "camelCase", deny_unknown_fields)]
    pub struct AppliedConfig {
        pub group: String,
        pub resource: String,
        #[serde(default, skip_serializing_if = "String::is_empty")]
        pub namespace: String,
        pub name: String,
        pub spec_hash: String,
    }

    /// `tether.v1.cluster.<c>.addon.<a>.status` request.
    #[derive(Serialize, Deserialize, JsonSchema)]
    #[serde(rename_all = "camelCase", deny_unknown_fields)]
    pub struct AddOnStatusReport {
        pub applied_configs: Vec<AppliedConfig>,
    }

    /// `tether.v1.cluster.<c>.addon.<a>.lease` request.
    #[derive(Serialize, Deserialize, JsonSchema)]
    #[serde(rename_all = "camelCase", deny_unknown_fields)]
    pub struct AddOnLeaseRenew {
        pub holder_identity: String,
        pub lease_duration_seconds: u32,
        #[serde(default)]
        pub connected_brokers: Vec<String>,
    }

    #[derive(Serialize, Deserialize, JsonSchema)]
    #[serde(rename_all = "camelCase", deny_unknown_fields)]
    pub struct AddOnLeaseReply {
        pub accepted: bool,
        #[serde(default)]
        pub message: String,
    }

    /// `tether.v1.cluster.<c>.addon.<a>.config` request.
    #[derive(Serialize, Deserialize, JsonSchema)]
    #[serde(rename_all = "camelCase", deny_unknown_fields)]
    pub struct AddOnAgentConfigRequest {
        #[serde(default)]
        pub agent_name: String,
    }

    #[derive(Serialize, Deserialize, JsonSchema)]
    #[serde(rename_all = "camelCase", deny_unknown_fields)]
    pub struct ProxyConfig {
        #[serde(default, skip_serializing_if = "String::is_empty")]
        pub http_proxy: String,
        #[serde(default, skip_serializing_if = "String::is_empty")]
        pub https_proxy: String,
        #[serde(default, skip_serializing_if = "String::is_empty")]
        pub no_proxy: String,
        #[serde(default, skip_serializing_if = "String::is_empty")]
        pub ca_bundle: String,
    }

    #[derive(Serialize, Deserialize, JsonSchema)]
    #[serde(deny_unknown_fields)]
    pub struct CustomizedVariable {
        pub name: String,
        pub value: String,
    }

    #[derive(Serialize, Deserialize, JsonSchema)]
    #[serde(rename_all = "camelCase", deny_unknown_fields)]
    pub struct AgentBrokerEndpoint {
        pub id: String,
        pub addresses: Vec<String>,
        pub server_name: String,
    }

    #[derive(Serialize, Deserialize, JsonSchema)]
    #[serde(rename_all = "camelCase", deny_unknown_fields)]
    pub struct AddOnAgentConfig {
        pub cluster: String,
        pub addon: String,
        pub install_namespace: String,
        pub brokers: Vec<AgentBrokerEndpoint>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub proxy: Option<ProxyConfig>,
        pub hub_ca_bundle: String,
        pub replicas: u32,
        #[serde(default, skip_serializing_if = "String::is_empty")]
        pub keepalive: String,
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        pub customized_variables: Vec<CustomizedVariable>,
        pub config_hashes: Vec<AppliedConfig>,
    }

    /// Reply to `tether.v1.cluster.<c>.addon.<a>.config`.
    #[derive(Serialize, Deserialize, JsonSchema)]
    #[serde(rename_all = "camelCase", deny_unknown_fields)]
    pub struct AddOnAgentConfigReply {
        pub installed: bool,
        #[serde(default, skip_serializing_if = "String::is_empty")]
        pub message: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub config: Option<AddOnAgentConfig>,
    }

    #[derive(Serialize, Deserialize, JsonSchema)]
    #[serde(deny_unknown_fields)]
    pub struct InvolvedObject {
        pub kind: String,
        pub name: String,
    }

    /// A change record on `tether.v1.events.<kind>.<name>` (stream `TETHER_EVENTS`).
    #[derive(Serialize, Deserialize, JsonSchema)]
    #[serde(rename_all = "camelCase", deny_unknown_fields)]
    pub struct Event {
        pub api_version: String,
        pub kind: String,
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

    #[derive(Serialize, Deserialize, JsonSchema)]
    #[serde(rename_all = "camelCase", deny_unknown_fields)]
    pub struct IssuedCertificate {
        pub common_name: String,
        #[serde(default)]
        pub serial: String,
        #[serde(default)]
        pub not_after: String,
    }

    #[derive(Serialize, Deserialize, JsonSchema)]
    #[serde(rename_all = "camelCase", deny_unknown_fields)]
    pub struct HubClientSpec {
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub token_sha256: Option<String>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub certificate: Option<IssuedCertificate>,
    }

    /// `proxy.tether.io/v1alpha1` HubClient (KV `tether-hubclients`).
    #[derive(Serialize, Deserialize, JsonSchema)]
    #[serde(rename_all = "camelCase", deny_unknown_fields)]
    pub struct HubClient {
        pub api_version: String,
        pub kind: String,
        pub metadata: ObjectMeta,
        pub spec: HubClientSpec,
    }

    /// `tether.v1.admin.client.create` request.
    #[derive(Serialize, Deserialize, JsonSchema)]
    #[serde(rename_all = "camelCase", deny_unknown_fields)]
    pub struct ClientCreateRequest {
        pub name: String,
        /// `token` or `certificate`.
        pub credential: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub cert_lifetime_seconds: Option<u64>,
    }

    /// Reply to `tether.v1.admin.client.create`: the secret is returned once.
    #[derive(Serialize, Deserialize, JsonSchema)]
    #[serde(rename_all = "camelCase", deny_unknown_fields)]
    pub struct ClientCreateReply {
        pub client: HubClient,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub token: Option<String>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub certificate: Option<String>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub key: Option<String>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub ca_bundle: Option<String>,
    }

    /// `tether.v1.admin.client.delete` request.
    #[derive(Serialize, Deserialize, JsonSchema)]
    #[serde(rename_all = "camelCase", deny_unknown_fields)]
    pub struct ClientDeleteRequest {
        pub name: String,
    }

    #[derive(Serialize, Deserialize, JsonSchema)]
    #[serde(rename_all = "camelCase", deny_unknown_fields)]
    pub struct ClientDeleteReply {
        pub deleted: bool,
    }

    /// `tether.v1.health.get` request.
    #[derive(Serialize, Deserialize, JsonSchema)]
    #[serde(rename_all = "camelCase", deny_unknown_fields)]
    pub struct HealthGetRequest {
        /// Only this cluster.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub cluster: Option<String>,
    }

    #[derive(Serialize, Deserialize, JsonSchema)]
    #[serde(rename_all = "camelCase", deny_unknown_fields)]
    pub struct LatencySplit {
        pub total_ms: f64,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub tunnel_ms: Option<f64>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub target_ms: Option<f64>,
    }

    /// A cluster's latest probe result (value of KV `tether-health/<cluster>`).
    #[derive(Serialize, Deserialize, JsonSchema)]
    #[serde(rename_all = "camelCase", deny_unknown_fields)]
    pub struct HealthRecord {
        pub cluster: String,
        pub healthy: bool,
        pub reason: String,
        #[serde(default)]
        pub message: String,
        pub last_probe_ok: bool,
        pub latency: LatencySplit,
        pub probed_at: String,
        pub consecutive_failures: u32,
        pub consecutive_successes: u32,
        #[serde(default)]
        pub path: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub status: Option<u16>,
        #[serde(default)]
        pub tls_verified: bool,
        #[serde(default)]
        pub probes: u64,
        #[serde(default)]
        pub prober: String,
    }

    /// Reply to `tether.v1.health.get`.
    #[derive(Serialize, Deserialize, JsonSchema)]
    #[serde(rename_all = "camelCase", deny_unknown_fields)]
    pub struct HealthGetReply {
        pub prober: String,
        pub interval_seconds: f64,
        pub clusters: Vec<HealthRecord>,
    }
}

/// Every schema file: name → schema.
fn generated() -> BTreeMap<&'static str, serde_json::Value> {
    macro_rules! schemas {
        ($($t:ident),* $(,)?) => {{
            let mut out = BTreeMap::new();
            $(out.insert(stringify!($t), serde_json::to_value(schemars::schema_for!(m::$t)).expect("schema"));)*
            out
        }};
    }
    schemas!(
        CsrSubmit,
        CsrReply,
        CsrGet,
        LeaseRenew,
        LeaseReply,
        AdminClusterRequest,
        ManagedCluster,
        ErrorReply,
        Empty,
        Notify,
        AddOnStatusReport,
        AddOnLeaseRenew,
        AddOnLeaseReply,
        AddOnAgentConfigRequest,
        AddOnAgentConfigReply,
        Event,
        HealthGetRequest,
        HealthGetReply,
        HealthRecord,
        ClientCreateRequest,
        ClientCreateReply,
        ClientDeleteRequest,
        ClientDeleteReply,
    )
}

/// Subject pattern → (request or published body schema, reply schema).
const SUBJECTS: &[(&str, &str, Option<&str>)] = &[
    ("tether.v1.bootstrap.*.csr", "CsrSubmit", Some("CsrReply")),
    ("tether.v1.bootstrap.*.csr.get", "CsrGet", Some("CsrReply")),
    ("tether.v1.cluster.*.csr", "CsrSubmit", Some("CsrReply")),
    ("tether.v1.cluster.*.csr.get", "CsrGet", Some("CsrReply")),
    (
        "tether.v1.cluster.*.lease",
        "LeaseRenew",
        Some("LeaseReply"),
    ),
    ("tether.v1.cluster.*.notify", "Notify", None),
    (
        "tether.v1.admin.accept",
        "AdminClusterRequest",
        Some("ManagedCluster"),
    ),
    (
        "tether.v1.admin.deny",
        "AdminClusterRequest",
        Some("ManagedCluster"),
    ),
    (
        "tether.v1.cluster.*.addon.*.status",
        "AddOnStatusReport",
        Some("Empty"),
    ),
    (
        "tether.v1.cluster.*.addon.*.lease",
        "AddOnLeaseRenew",
        Some("AddOnLeaseReply"),
    ),
    (
        "tether.v1.cluster.*.addon.*.config",
        "AddOnAgentConfigRequest",
        Some("AddOnAgentConfigReply"),
    ),
    (
        "tether.v1.cluster.*.addon.*.csr",
        "CsrSubmit",
        Some("CsrReply"),
    ),
    (
        "tether.v1.cluster.*.addon.*.csr.get",
        "CsrGet",
        Some("CsrReply"),
    ),
    (
        "tether.v1.health.get",
        "HealthGetRequest",
        Some("HealthGetReply"),
    ),
    (
        "tether.v1.admin.client.create",
        "ClientCreateRequest",
        Some("ClientCreateReply"),
    ),
    (
        "tether.v1.admin.client.delete",
        "ClientDeleteRequest",
        Some("ClientDeleteReply"),
    ),
    ("tether.v1.events.>", "Event", None),
];

fn schema_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../docs/schemas")
}

fn subject_matches(pattern: &str, subject: &str) -> bool {
    let (mut p, mut s) = (pattern.split('.'), subject.split('.'));
    loop {
        match (p.next(), s.next()) {
            (Some(">"), Some(_)) => return true,
            (Some("*"), Some(_)) => {}
            (Some(a), Some(b)) if a == b => {}
            (None, None) => return true,
            _ => return false,
        }
    }
}

fn schema_of(subject: &str) -> Option<(&'static str, Option<&'static str>)> {
    SUBJECTS
        .iter()
        .find(|(p, _, _)| subject_matches(p, subject))
        .map(|(_, req, rep)| (*req, *rep))
}

#[test]
fn committed_schemas_match_generated() {
    let dir = schema_dir();
    let update = std::env::var("TETHER_UPDATE_SCHEMAS").is_ok_and(|v| v == "1");
    let mut stale = Vec::new();
    for (name, schema) in generated() {
        let path = dir.join(format!("{name}.json"));
        let text = serde_json::to_string_pretty(&schema).unwrap() + "\n";
        if update {
            std::fs::create_dir_all(&dir).unwrap();
            std::fs::write(&path, &text).unwrap();
        } else if std::fs::read_to_string(&path).ok().as_deref() != Some(text.as_str()) {
            stale.push(path.display().to_string());
        }
    }
    assert!(
        stale.is_empty(),
        "schemas differ from the Rust types (run with TETHER_UPDATE_SCHEMAS=1 and commit): {stale:?}"
    );
    for (_, req, rep) in SUBJECTS {
        assert!(generated().contains_key(req), "{req}");
        assert!(rep.is_none_or(|r| generated().contains_key(r)), "{rep:?}");
    }
    let doc = std::fs::read_to_string(dir.join("../nats-api.md")).expect("docs/nats-api.md");
    for (pattern, req, rep) in SUBJECTS {
        let literal = pattern
            .replace("bootstrap.*", "bootstrap.<cluster>")
            .replace("cluster.*", "cluster.<cluster>")
            .replace("addon.*", "addon.<addon>")
            .replace("events.>", "events.<kind>.<name>");
        assert!(
            doc.contains(&format!("`{literal}`")),
            "nats-api.md does not name `{literal}`"
        );
        assert!(
            doc.contains(&format!("schemas/{req}.json")),
            "nats-api.md does not link {req}"
        );
        if let Some(r) = rep {
            assert!(
                doc.contains(&format!("schemas/{r}.json")),
                "nats-api.md does not link {r}"
            );
        }
    }
}

#[test]
fn mirrors_agree_with_real_types() {
    use tether_control::{addons, health, resources};
    fn same<Real, Mirror>(sample: serde_json::Value)
    where
        Real: serde::de::DeserializeOwned + Serialize,
        Mirror: serde::de::DeserializeOwned + Serialize,
    {
        let real: Real =
            serde_json::from_value(sample.clone()).expect("real type parses the sample");
        let mirror: Mirror =
            serde_json::from_value(sample.clone()).expect("mirror parses the sample");
        assert_eq!(
            serde_json::to_value(real).unwrap(),
            serde_json::to_value(mirror).unwrap(),
            "real type and schema mirror serialise {sample} differently"
        );
    }
    use serde_json::json;
    same::<resources::CsrSubmit, m::CsrSubmit>(
        json!({"clusterName":"e","agentName":"a","csr":"x","clusterClaims":[{"name":"p","value":"k3s"}],"labels":{"env":"dev"}}),
    );
    same::<resources::CsrReply, m::CsrReply>(
        json!({"csrName":"n","phase":"issued","certificate":"c","message":"m"}),
    );
    same::<resources::CsrGet, m::CsrGet>(json!({"csrName":"n"}));
    same::<resources::LeaseRenew, m::LeaseRenew>(
        json!({"agentName":"a","leaseDurationSeconds":60,"clusterClaims":[],"agentTime":"2026-01-02T03:04:05Z"}),
    );
    same::<resources::LeaseReply, m::LeaseReply>(
        json!({"accepted":true,"leaseDurationSeconds":60,"message":""}),
    );
    same::<resources::AdminClusterRequest, m::AdminClusterRequest>(json!({"clusterName":"e"}));
    same::<resources::ErrorReply, m::ErrorReply>(json!({"error":"x"}));
    same::<resources::ManagedCluster, m::ManagedCluster>(
        json!({"apiVersion":"cluster.open-cluster-management.io/v1","kind":"ManagedCluster","metadata":{"name":"e","uid":"u","labels":{"a":"b"},"creationTimestamp":"t"},"spec":{"hubAcceptsClient":true,"leaseDurationSeconds":60,"managedClusterClientConfigs":[{"url":"u","caBundle":"c"}]},"status":{"conditions":[{"type":"T","status":"True","reason":"r","message":"m","lastTransitionTime":"t"}],"clusterClaims":[{"name":"n","value":"v"}]}}),
    );
    same::<resources::Event, m::Event>(
        json!({"apiVersion":"events.k8s.io/v1","kind":"Event","involvedObject":{"kind":"ManagedCluster","name":"e"},"type":"Normal","reason":"r","message":"m","eventTime":"t","traceId":"x"}),
    );
    same::<addons::AddOnStatusReport, m::AddOnStatusReport>(
        json!({"appliedConfigs":[{"group":"g","resource":"r","namespace":"n","name":"x","specHash":"h"}]}),
    );
    same::<addons::AddOnLeaseRenew, m::AddOnLeaseRenew>(
        json!({"holderIdentity":"a","leaseDurationSeconds":1,"connectedBrokers":["b1"]}),
    );
    same::<addons::AddOnLeaseReply, m::AddOnLeaseReply>(json!({"accepted":true,"message":""}));
    same::<addons::AddOnNotify, m::Notify>(
        json!({"type":"AddOnConfigChanged","addon":"cluster-proxy"}),
    );
    same::<addons::AddOnAgentConfigRequest, m::AddOnAgentConfigRequest>(json!({"agentName":"a"}));
    same::<addons::AddOnAgentConfigReply, m::AddOnAgentConfigReply>(
        json!({"installed":true,"message":"m","config":{"cluster":"c","addon":"a","installNamespace":"n","brokers":[{"id":"b","addresses":["h:1"],"serverName":"s"}],"proxy":{"httpsProxy":"https://p:1","noProxy":".svc"},"hubCaBundle":"pem","replicas":1,"keepalive":"10s","customizedVariables":[{"name":"A","value":"B"}],"configHashes":[{"group":"g","resource":"r","name":"x","specHash":"h"}]}}),
    );
    use tether_control::clients;
    same::<clients::ClientCreateRequest, m::ClientCreateRequest>(
        json!({"name":"ops","credential":"certificate","certLifetimeSeconds":3600}),
    );
    same::<clients::ClientCreateReply, m::ClientCreateReply>(
        json!({"client":{"apiVersion":"proxy.tether.io/v1alpha1","kind":"HubClient","metadata":{"name":"ops","uid":"u","creationTimestamp":"t"},"spec":{"tokenSha256":"ab","certificate":{"commonName":"tether:client:ops","serial":"1","notAfter":"t"}}},"token":"x","certificate":"c","key":"k","caBundle":"ca"}),
    );
    same::<clients::ClientDeleteRequest, m::ClientDeleteRequest>(json!({"name":"ops"}));
    same::<clients::ClientDeleteReply, m::ClientDeleteReply>(json!({"deleted":true}));
    same::<health::HealthGetRequest, m::HealthGetRequest>(json!({"cluster":"c"}));
    same::<health::HealthGetReply, m::HealthGetReply>(
        json!({"prober":"p","intervalSeconds":30.0,"clusters":[{"cluster":"c","healthy":false,"reason":"NoTunnel","message":"m","lastProbeOk":false,"latency":{"totalMs":1.5,"tunnelMs":0.5,"targetMs":1.0},"probedAt":"t","consecutiveFailures":2,"consecutiveSuccesses":0,"path":"/livez","status":503,"tlsVerified":true,"probes":9,"prober":"p"}]}),
    );
}

// ---------------------------------------------------------------- live traffic

/// A captured message.
#[derive(Debug, Clone)]
struct Captured {
    subject: String,
    reply: Option<String>,
    payload: Vec<u8>,
    error_header: bool,
}

fn validator(name: &str) -> jsonschema::Validator {
    let schema: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(schema_dir().join(format!("{name}.json")))
            .unwrap_or_else(|e| panic!("docs/schemas/{name}.json: {e}")),
    )
    .unwrap();
    jsonschema::validator_for(&schema).unwrap_or_else(|e| panic!("{name}: {e}"))
}

fn check(errors: &mut Vec<String>, schema: &str, subject: &str, payload: &[u8]) {
    let v: serde_json::Value = match serde_json::from_slice(payload) {
        Ok(v) => v,
        Err(e) => {
            errors.push(format!(
                "{subject}: not JSON ({e}): {}",
                String::from_utf8_lossy(payload)
            ));
            return;
        }
    };
    let val = validator(schema);
    for e in val.iter_errors(&v) {
        errors.push(format!(
            "{subject} ({schema}): {e} at {}: {v}",
            e.instance_path()
        ));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn live_traffic_validates_against_schemas() -> anyhow::Result<()> {
    let hub = NatsHub::start(HubOpts::default())?;
    let dir = HubDir::load(&hub.hub_dir)?;
    let password = dir.read(&dir.config.nats.admin_password_file)?;
    let conn = connect::connect(&ConnectConfig::new(
        dir.endpoint(Some(&hub.nats_url()))?,
        Credentials::HubUser {
            user: ADMIN_USER.into(),
            password: password.trim().to_string(),
        },
        "schema-test",
    ))
    .await?;
    let captured: Arc<Mutex<Vec<Captured>>> = Arc::default();
    for filter in ["tether.v1.>", "_INBOX.>"] {
        let mut sub = conn.client.subscribe(filter).await?;
        let captured = Arc::clone(&captured);
        tokio::spawn(async move {
            while let Some(m) = sub.next().await {
                captured.lock().unwrap().push(Captured {
                    subject: m.subject.to_string(),
                    reply: m.reply.as_ref().map(|r| r.to_string()),
                    payload: m.payload.to_vec(),
                    error_header: m
                        .headers
                        .as_ref()
                        .is_some_and(|h| h.get(connect::ERROR_HEADER).is_some()),
                });
            }
        });
    }
    conn.client.flush().await?;

    // Registration: an agent joins with the bootstrap token, is accepted, renews its lease.
    let boot = hub.dir.join("bootstrap.kubeconfig");
    hub.join(&boot, &hub.server_url(), &hub.token, None, None)?;
    let creds = hub.dir.join("creds");
    let _agent = start_agent(&hub.logs, "agent", "edge-1", &boot, &creds, None)?;
    wait_until(Duration::from_secs(20), "CSR pending", || {
        hub.cluster("edge-1").map(|_| ())
    })?;
    hub.tetherctl_ok(&["accept", "edge-1"])?;
    hub.wait_condition(
        "edge-1",
        "ManagedClusterJoined",
        "True",
        Duration::from_secs(20),
    )?;
    // Add-ons: the cluster-proxy add-on gets installed; its agent's status and lease.
    let cma = hub.dir.join("cma.yaml");
    std::fs::write(
        &cma,
        "apiVersion: addon.open-cluster-management.io/v1alpha1\nkind: ClusterManagementAddOn\nmetadata:\n  name: cluster-proxy\nspec:\n  installStrategy:\n    type: All\n",
    )?;
    hub.tetherctl_ok(&["apply", "-f", cma.to_str().unwrap()])?;
    wait_until(Duration::from_secs(20), "add-on installed", || {
        hub.tetherctl_ok(&["get", "addons", "edge-1", "cluster-proxy", "-o", "json"])
            .ok()
    })?;
    let _: serde_json::Value = connect::request_json(
        &conn.client,
        subjects::cluster_addon_status("edge-1", "cluster-proxy"),
        &serde_json::json!({"appliedConfigs": []}),
    )
    .await?;
    let _: serde_json::Value = connect::request_json(
        &conn.client,
        subjects::cluster_addon_lease("edge-1", "cluster-proxy"),
        &serde_json::json!({"holderIdentity": "cluster-proxy-agent", "leaseDurationSeconds": 1}),
    )
    .await?;
    let _: serde_json::Value = connect::request_json(
        &conn.client,
        subjects::cluster_addon_config("edge-1", "cluster-proxy"),
        &serde_json::json!({"agentName": "agent-0"}),
    )
    .await?;
    // Health: a prober on NATS (its broker has no tunnel for edge-1: unhealthy → event).
    let th = tether_e2e::Hub::new()?;
    let broker = th.start_broker("b1", "")?;
    let _prober = th.start_prober(
        &broker,
        &[],
        &format!(
            "interval: 300ms\ntimeout: 250ms\nnats:\n  hub_dir: {}\n  url: {}\n",
            hub.hub_dir.display(),
            hub.nats_url()
        ),
    )?;
    wait_until_async(Duration::from_secs(20), "health event", || async {
        captured
            .lock()
            .unwrap()
            .iter()
            .any(|c| c.subject == subjects::health_event("edge-1"))
            .then_some(())
    })
    .await?;
    hub.tetherctl_ok(&["proxy", "health"])?;
    // A malformed health request gets an error reply.
    let bad = conn
        .client
        .request(subjects::HEALTH_GET, "not json".into())
        .await?;
    assert!(
        bad.headers
            .is_some_and(|h| h.get(connect::ERROR_HEADER).is_some())
    );
    // Hub clients: a token and a certificate credential, then one revoked.
    hub.tetherctl_ok(&["client", "create", "ops", "--token"])?;
    let certs = hub.dir.join("ops2-cert");
    hub.tetherctl_ok(&[
        "client",
        "create",
        "ops2",
        "--cert-out",
        certs.to_str().unwrap(),
    ])?;
    hub.tetherctl_ok(&["client", "delete", "ops"])?;
    // Deny: the agent is notified.
    hub.tetherctl_ok(&["deny", "edge-1"])?;
    wait_until_async(Duration::from_secs(10), "notify captured", || async {
        captured
            .lock()
            .unwrap()
            .iter()
            .any(|c| c.subject == subjects::cluster_notify("edge-1"))
            .then_some(())
    })
    .await?;
    conn.client.flush().await?;

    // Validate everything captured.
    let msgs = captured.lock().unwrap().clone();
    let mut requests: BTreeMap<String, (String, Option<&'static str>)> = BTreeMap::new();
    let mut errors = Vec::new();
    let mut seen: BTreeMap<&'static str, usize> = BTreeMap::new();
    // A request answered with an error is bad input on purpose: its reply is an ErrorReply.
    let refused: std::collections::BTreeSet<&str> = msgs
        .iter()
        .filter(|m| m.subject.starts_with("_INBOX.") && m.error_header)
        .map(|m| m.subject.as_str())
        .collect();
    for m in msgs.iter().filter(|m| m.subject.starts_with("tether.v1.")) {
        match schema_of(&m.subject) {
            None => errors.push(format!("no schema for subject {}", m.subject)),
            Some((req, rep)) => {
                if !m.reply.as_deref().is_some_and(|r| refused.contains(r)) {
                    *seen.entry(req).or_default() += 1;
                    check(&mut errors, req, &m.subject, &m.payload);
                }
                // JetStream publishes (events) get acks from the server, not a schema'd reply.
                if let (Some(r), Some(rep)) = (&m.reply, rep) {
                    requests.insert(r.clone(), (m.subject.clone(), Some(rep)));
                }
            }
        }
    }
    let mut replies = 0;
    for m in msgs.iter().filter(|m| m.subject.starts_with("_INBOX.")) {
        let Some((subject, Some(rep))) = requests.get(&m.subject) else {
            continue;
        };
        replies += 1;
        let schema = if m.error_header { "ErrorReply" } else { rep };
        *seen.entry(schema).or_default() += 1;
        check(
            &mut errors,
            schema,
            &format!("reply to {subject}"),
            &m.payload,
        );
    }
    println!(
        "validated {} messages and {replies} replies: {seen:?}",
        msgs.len()
    );
    assert!(
        errors.is_empty(),
        "{} problems:\n{}",
        errors.len(),
        errors.join("\n")
    );
    for must in [
        "CsrSubmit",
        "CsrReply",
        "CsrGet",
        "LeaseRenew",
        "LeaseReply",
        "AdminClusterRequest",
        "ManagedCluster",
        "AddOnStatusReport",
        "Empty",
        "AddOnLeaseRenew",
        "AddOnLeaseReply",
        "AddOnAgentConfigRequest",
        "AddOnAgentConfigReply",
        "HealthGetRequest",
        "HealthGetReply",
        "ErrorReply",
        "Event",
        "Notify",
        "ClientCreateRequest",
        "ClientCreateReply",
        "ClientDeleteRequest",
        "ClientDeleteReply",
    ] {
        assert!(
            seen.contains_key(must),
            "no {must} message was exercised: {seen:?}"
        );
    }
    Ok(())
}
