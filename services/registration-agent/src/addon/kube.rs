//! The add-on agent on Kubernetes ([`KubeRuntime`], `--addon-runtime kube`).
//!
//! In the add-on's install namespace it keeps, with server-side apply (field manager
//! [`FIELD_MANAGER`], forced):
//! - Secret `<addon>-hub-kubeconfig`: the add-on credentials (`tls.crt`, `tls.key`,
//!   `kubeconfig`, `cluster-name`), the rendered config with its paths rewritten to
//!   [`POD_SECRET_DIR`], and the CA files ([`secret_object`]);
//! - Deployment `<addon>-agent` ([`deployment_object`]): the image with its full `command`
//!   (`tether:dev` has no ENTRYPOINT by contract), Pod Security "restricted" (non-root,
//!   seccomp RuntimeDefault, no privilege escalation, every capability dropped, read-only
//!   root), no service-account token (the tunnel-agent never calls the API), the proxy
//!   settings as environment, and the config hash as a pod annotation (a new config rolls the
//!   pods).
//!
//! `observe` reads the Deployment back (`GET`): rolled out and its config hash. Whether the
//! agent holds its tunnels is not asked from here: the hub computes Available from what every
//! broker reports it holds (`tether-brokers` presence `clusters`).
//!
//! The requests (paths, verbs, field manager, bodies) are tested against a mocked API service
//! below; none of this has run against a real API server.

use std::collections::BTreeMap;

use k8s_openapi::ByteString;
use k8s_openapi::api::apps::v1::{Deployment, DeploymentSpec};
use k8s_openapi::api::core::v1::{
    Capabilities, Container, EnvVar, PodSecurityContext, PodSpec, PodTemplateSpec,
    ResourceRequirements, SeccompProfile, Secret, SecretVolumeSource, SecurityContext, Volume,
    VolumeMount,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use kube::api::{DeleteParams, ObjectMeta, Patch, PatchParams};

use super::render::{CONFIG_FILE, HUB_CA_FILE, PROXY_CA_FILE, RenderedAgent};
use super::runtime::{AddOnRuntime, Observed, RuntimeError};

/// Where the Secret is mounted in the tunnel-agent pod.
pub const POD_SECRET_DIR: &str = "/etc/tether/addon";
/// Server-side apply field manager of everything the registration-agent writes (defined with the
/// hub-credentials Secret store, the lower layer).
pub use crate::secret::FIELD_MANAGER;
/// Pod annotation carrying the SHA-256 of the config the pods run.
pub const CONFIG_HASH_ANNOTATION: &str = "tether.io/config-sha256";
/// The image's binary the container runs (the image has no ENTRYPOINT).
pub const AGENT_COMMAND: &str = "tunnel-agent";
/// Unprivileged uid of the Tether images.
pub const RUN_AS_USER: i64 = 65532;

/// The Deployment and Secret names of an add-on.
pub fn names(addon: &str) -> (String, String) {
    (format!("{addon}-agent"), format!("{addon}-hub-kubeconfig"))
}

/// The install namespace the hub asked for (default `open-cluster-management-agent-addon`).
pub fn install_namespace(r: &RenderedAgent) -> String {
    if r.desired.install_namespace.is_empty() {
        tether_control::addons::DEFAULT_INSTALL_NAMESPACE.to_string()
    } else {
        r.desired.install_namespace.clone()
    }
}

/// The Secret `<addon>-hub-kubeconfig`: credentials from `r.credentials_dir`, the config with
/// its file paths pointing into the pod's mount, the CA files.
pub fn secret_object(addon: &str, ns: &str, r: &RenderedAgent) -> Secret {
    let (_, secret_name) = names(addon);
    let yaml = r
        .config_yaml
        .replace(&r.credentials_dir.display().to_string(), POD_SECRET_DIR);
    let mut data = BTreeMap::new();
    for k in ["tls.crt", "tls.key", "kubeconfig", "cluster-name"] {
        if let Ok(v) = std::fs::read(r.credentials_dir.join(k)) {
            data.insert(k.to_string(), ByteString(v));
        }
    }
    data.insert(CONFIG_FILE.into(), ByteString(yaml.into_bytes()));
    data.insert(
        HUB_CA_FILE.into(),
        ByteString(r.hub_ca_pem.clone().into_bytes()),
    );
    if let Some(p) = &r.proxy_ca_pem {
        data.insert(PROXY_CA_FILE.into(), ByteString(p.clone().into_bytes()));
    }
    Secret {
        metadata: ObjectMeta {
            name: Some(secret_name),
            namespace: Some(ns.into()),
            labels: Some(labels(addon)),
            ..Default::default()
        },
        type_: Some("Opaque".into()),
        data: Some(data),
        ..Default::default()
    }
}

fn labels(addon: &str) -> BTreeMap<String, String> {
    [
        ("app".to_string(), format!("{addon}-agent")),
        (
            "app.kubernetes.io/part-of".to_string(),
            "tether".to_string(),
        ),
        (
            "app.kubernetes.io/component".to_string(),
            "tunnel-agent".to_string(),
        ),
    ]
    .into()
}

fn quantities(pairs: &[(&str, &str)]) -> BTreeMap<String, Quantity> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), Quantity(v.to_string())))
        .collect()
}

/// The Deployment `<addon>-agent` running `image`.
pub fn deployment_object(addon: &str, ns: &str, image: &str, r: &RenderedAgent) -> Deployment {
    let (deploy_name, secret_name) = names(addon);
    let selector: BTreeMap<String, String> = [("app".to_string(), deploy_name.clone())].into();
    let env: Vec<EnvVar> = r
        .desired
        .proxy
        .as_ref()
        .map(|p| p.env())
        .unwrap_or_default()
        .into_iter()
        .map(|(name, value)| EnvVar {
            name,
            value: Some(value),
            ..Default::default()
        })
        .collect();
    let container = Container {
        name: "tunnel-agent".into(),
        image: Some(image.into()),
        command: Some(vec![
            AGENT_COMMAND.into(),
            "--config".into(),
            format!("{POD_SECRET_DIR}/{CONFIG_FILE}"),
        ]),
        env: Some(env),
        volume_mounts: Some(vec![VolumeMount {
            name: "addon".into(),
            mount_path: POD_SECRET_DIR.into(),
            read_only: Some(true),
            ..Default::default()
        }]),
        security_context: Some(SecurityContext {
            allow_privilege_escalation: Some(false),
            capabilities: Some(Capabilities {
                drop: Some(vec!["ALL".into()]),
                ..Default::default()
            }),
            read_only_root_filesystem: Some(true),
            run_as_non_root: Some(true),
            ..Default::default()
        }),
        resources: Some(ResourceRequirements {
            requests: Some(quantities(&[("cpu", "50m"), ("memory", "64Mi")])),
            limits: Some(quantities(&[("memory", "256Mi")])),
            ..Default::default()
        }),
        ..Default::default()
    };
    Deployment {
        metadata: ObjectMeta {
            name: Some(deploy_name),
            namespace: Some(ns.into()),
            labels: Some(labels(addon)),
            ..Default::default()
        },
        spec: DeploymentSpec {
            replicas: Some(r.desired.replicas.max(1) as i32),
            selector: LabelSelector {
                match_labels: Some(selector),
                ..Default::default()
            },
            template: PodTemplateSpec {
                metadata: Some(ObjectMeta {
                    labels: Some(labels(addon)),
                    // A new config hash rolls the pods (the agent also reloads in place).
                    annotations: Some(
                        [(CONFIG_HASH_ANNOTATION.to_string(), r.sha256.clone())].into(),
                    ),
                    ..Default::default()
                }),
                spec: Some(PodSpec {
                    automount_service_account_token: Some(false),
                    security_context: Some(PodSecurityContext {
                        run_as_non_root: Some(true),
                        run_as_user: Some(RUN_AS_USER),
                        run_as_group: Some(RUN_AS_USER),
                        seccomp_profile: Some(SeccompProfile {
                            type_: "RuntimeDefault".into(),
                            ..Default::default()
                        }),
                        ..Default::default()
                    }),
                    containers: vec![container],
                    volumes: Some(vec![Volume {
                        name: "addon".into(),
                        secret: Some(SecretVolumeSource {
                            secret_name: Some(secret_name),
                            ..Default::default()
                        }),
                        ..Default::default()
                    }]),
                    ..Default::default()
                }),
            },
            ..Default::default()
        },
        ..Default::default()
    }
}

/// What a Deployment read back says: its config hash once every replica runs it.
pub fn observed_from(d: &Deployment) -> Option<Observed> {
    let spec = &d.spec;
    let status = d.status.as_ref()?;
    let want = spec.replicas.unwrap_or(1);
    let rolled = status.observed_generation >= d.metadata.generation
        && status.updated_replicas.unwrap_or(0) >= want
        && status.available_replicas.unwrap_or(0) >= want;
    let hash = spec
        .template
        .metadata
        .as_ref()?
        .annotations
        .as_ref()?
        .get(CONFIG_HASH_ANNOTATION)?
        .clone();
    rolled.then_some(Observed {
        config_sha256: hash,
        connected_brokers: vec![],
        config_error: None,
    })
}

/// The add-on agent as a Kubernetes Deployment (module docs).
pub struct KubeRuntime {
    client: kube::Client,
    addon: String,
    image: String,
    namespace: Option<String>,
}

impl KubeRuntime {
    pub fn new(client: kube::Client, addon: &str, image: &str) -> Self {
        Self {
            client,
            addon: addon.into(),
            image: image.into(),
            namespace: None,
        }
    }
}

fn kube_err(what: &str) -> impl FnOnce(kube::Error) -> RuntimeError + '_ {
    move |e| RuntimeError::Kube(format!("{what}: {e}"))
}

impl AddOnRuntime for KubeRuntime {
    fn describe(&self) -> String {
        format!("kubernetes deployment {}-agent", self.addon)
    }

    async fn apply(&mut self, r: &RenderedAgent) -> Result<(), RuntimeError> {
        let ns = install_namespace(r);
        self.namespace = Some(ns.clone());
        let (deploy_name, secret_name) = names(&self.addon);
        let pp = PatchParams::apply(FIELD_MANAGER).force();
        let secrets: kube::Api<Secret> = kube::Api::namespaced(self.client.clone(), &ns);
        let secret = secret_object(&self.addon, &ns, r);
        secrets
            .patch(&secret_name, &pp, &Patch::Apply(&secret))
            .await
            .map_err(kube_err(&format!("applying secret {ns}/{secret_name}")))?;
        let deployment = deployment_object(&self.addon, &ns, &self.image, r);
        let deployments: kube::Api<Deployment> = kube::Api::namespaced(self.client.clone(), &ns);
        deployments
            .patch(&deploy_name, &pp, &Patch::Apply(&deployment))
            .await
            .map_err(kube_err(&format!("applying deployment {ns}/{deploy_name}")))?;
        Ok(())
    }

    async fn observe(&mut self) -> Option<Observed> {
        let ns = self.namespace.clone()?;
        let (deploy_name, _) = names(&self.addon);
        let api: kube::Api<Deployment> = kube::Api::namespaced(self.client.clone(), &ns);
        match api.get_opt(&deploy_name).await {
            Ok(d) => observed_from(&d?),
            Err(e) => {
                tracing::debug!(addon = %self.addon, error = %e, "cannot read the add-on deployment");
                None
            }
        }
    }

    async fn stop(&mut self, remove: bool) {
        if !remove {
            return; // the Deployment keeps running while the registration-agent restarts
        }
        let Some(ns) = self.namespace.clone() else {
            return;
        };
        let (deploy_name, secret_name) = names(&self.addon);
        let dp = DeleteParams::default();
        let d: kube::Api<Deployment> = kube::Api::namespaced(self.client.clone(), &ns);
        if let Err(e) = d.delete(&deploy_name, &dp).await {
            tracing::warn!(addon = %self.addon, error = %e, "cannot delete the add-on deployment");
        }
        let s: kube::Api<Secret> = kube::Api::namespaced(self.client.clone(), &ns);
        if let Err(e) = s.delete(&secret_name, &dp).await {
            tracing::warn!(addon = %self.addon, error = %e, "cannot delete the add-on secret");
        }
    }
}

/// A mocked API service for the Kubernetes-only code (kube-rs convention: a
/// `tower::service_fn` serving `kube::Client::new`), recording every request and answering
/// from a closure.
#[cfg(test)]
pub(crate) mod mock {
    use std::sync::{Arc, Mutex};

    use http_body_util::BodyExt;

    /// One request as the API server would see it.
    #[derive(Debug, Clone)]
    pub struct Seen {
        pub method: String,
        pub path: String,
        pub query: String,
        pub content_type: String,
        pub body: serde_json::Value,
    }

    impl Seen {
        /// The query parameter `k`.
        pub fn param(&self, k: &str) -> Option<String> {
            self.query.split('&').find_map(|kv| {
                let (a, b) = kv.split_once('=')?;
                (a == k).then(|| b.to_string())
            })
        }
    }

    pub type Answer = dyn Fn(&Seen) -> (u16, serde_json::Value) + Send + Sync;

    /// A client whose API server is `answer`; the log holds every request in order.
    pub fn client(answer: Arc<Answer>) -> (kube::Client, Arc<Mutex<Vec<Seen>>>) {
        let log = Arc::new(Mutex::new(Vec::new()));
        let l = Arc::clone(&log);
        let svc = tower::service_fn(move |req: http::Request<kube::client::Body>| {
            let answer = Arc::clone(&answer);
            let log = Arc::clone(&l);
            async move {
                let (parts, body) = req.into_parts();
                let bytes = body.collect().await?.to_bytes();
                let seen = Seen {
                    method: parts.method.to_string(),
                    path: parts.uri.path().to_string(),
                    query: parts.uri.query().unwrap_or_default().to_string(),
                    content_type: parts
                        .headers
                        .get(http::header::CONTENT_TYPE)
                        .and_then(|v| v.to_str().ok())
                        .unwrap_or_default()
                        .to_string(),
                    body: serde_json::from_slice(&bytes).unwrap_or(serde_json::Value::Null),
                };
                let (status, value) = answer(&seen);
                log.lock().expect("mock log").push(seen);
                http::Response::builder()
                    .status(status)
                    .header(http::header::CONTENT_TYPE, "application/json")
                    .body(kube::client::Body::from(
                        serde_json::to_vec(&value).unwrap_or_default(),
                    ))
                    .map_err(kube::Error::HttpError)
            }
        });
        (kube::Client::new(svc, "default"), log)
    }

    /// The API server's 404 Status.
    pub fn not_found(name: &str) -> (u16, serde_json::Value) {
        (
            404,
            serde_json::json!({"kind":"Status","apiVersion":"v1","status":"Failure",
                "message": format!("\"{name}\" not found"),"reason":"NotFound","code":404}),
        )
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::mock::{self, Seen};
    use super::*;
    use tether_control::addons::{AddOnAgentConfig, ProxyConfig};

    fn rendered(dir: &std::path::Path) -> RenderedAgent {
        std::fs::write(dir.join("tls.crt"), "CERT").unwrap();
        std::fs::write(dir.join("tls.key"), "KEY").unwrap();
        RenderedAgent {
            config_yaml: format!(
                "tls:\n  cert: {d}/tls.crt\n  key: {d}/tls.key\n",
                d = dir.display()
            ),
            sha256: "abc123".into(),
            hub_ca_pem: "HUBCA".into(),
            proxy_ca_pem: None,
            desired: AddOnAgentConfig {
                cluster: "edge-1".into(),
                addon: "cluster-proxy".into(),
                install_namespace: "addon-ns".into(),
                replicas: 2,
                proxy: Some(ProxyConfig {
                    https_proxy: "http://proxy:3128".into(),
                    ..Default::default()
                }),
                ..Default::default()
            },
            credentials_dir: dir.to_path_buf(),
        }
    }

    fn b64(s: &str) -> String {
        use base64::Engine;
        base64::engine::general_purpose::STANDARD.encode(s)
    }

    /// An API server that echoes applied objects and serves `deployment` on GET.
    fn echo(deployment: Option<serde_json::Value>) -> Arc<mock::Answer> {
        Arc::new(move |s: &Seen| match s.method.as_str() {
            "PATCH" => (200, s.body.clone()),
            "GET" => deployment
                .clone()
                .map_or_else(|| mock::not_found("cluster-proxy-agent"), |d| (200, d)),
            "DELETE" => (200, serde_json::json!({"kind":"Status","status":"Success"})),
            _ => (405, serde_json::json!({})),
        })
    }

    #[tokio::test]
    async fn apply_sends_server_side_apply_of_the_secret_then_the_deployment() {
        let dir = tempfile::tempdir().unwrap();
        let r = rendered(dir.path());
        let (client, log) = mock::client(echo(None));
        let mut rt = KubeRuntime::new(client, "cluster-proxy", "tether:dev");
        rt.apply(&r).await.unwrap();
        let log = log.lock().unwrap().clone();
        assert_eq!(log.len(), 2, "{log:#?}");
        for (s, path, kind) in [
            (
                &log[0],
                "/api/v1/namespaces/addon-ns/secrets/cluster-proxy-hub-kubeconfig",
                "Secret",
            ),
            (
                &log[1],
                "/apis/apps/v1/namespaces/addon-ns/deployments/cluster-proxy-agent",
                "Deployment",
            ),
        ] {
            assert_eq!(s.method, "PATCH");
            assert_eq!(s.path, path);
            assert_eq!(s.content_type, "application/apply-patch+yaml");
            assert_eq!(s.param("fieldManager").as_deref(), Some(FIELD_MANAGER));
            assert_eq!(s.param("force").as_deref(), Some("true"));
            assert_eq!(s.body["kind"], kind);
        }
        let secret = &log[0].body;
        assert_eq!(secret["apiVersion"], "v1");
        assert_eq!(secret["data"]["tls.crt"], b64("CERT"));
        assert_eq!(secret["data"]["tls.key"], b64("KEY"));
        assert_eq!(secret["data"][HUB_CA_FILE], b64("HUBCA"));
        // The config's paths point into the pod's mount, not the agent's local directory.
        assert_eq!(
            secret["data"][CONFIG_FILE],
            b64(&format!(
                "tls:\n  cert: {POD_SECRET_DIR}/tls.crt\n  key: {POD_SECRET_DIR}/tls.key\n"
            ))
        );
        let d = &log[1].body;
        assert_eq!(d["apiVersion"], "apps/v1");
        assert_eq!(d["spec"]["replicas"], 2);
        let pod = &d["spec"]["template"];
        assert_eq!(
            pod["metadata"]["annotations"][CONFIG_HASH_ANNOTATION],
            "abc123"
        );
        let spec = &pod["spec"];
        assert_eq!(spec["automountServiceAccountToken"], false);
        assert_eq!(spec["securityContext"]["runAsNonRoot"], true);
        assert_eq!(
            spec["securityContext"]["seccompProfile"]["type"],
            "RuntimeDefault"
        );
        let c = &spec["containers"][0];
        assert_eq!(c["image"], "tether:dev");
        // The image has no ENTRYPOINT: the command names the binary.
        assert_eq!(
            c["command"],
            serde_json::json!([
                "tunnel-agent",
                "--config",
                format!("/etc/tether/addon/{CONFIG_FILE}")
            ])
        );
        assert_eq!(c["securityContext"]["allowPrivilegeEscalation"], false);
        assert_eq!(
            c["securityContext"]["capabilities"]["drop"],
            serde_json::json!(["ALL"])
        );
        assert_eq!(c["securityContext"]["readOnlyRootFilesystem"], true);
        assert!(c["resources"]["limits"]["memory"].is_string());
        let env = c["env"].as_array().unwrap();
        for k in ["HTTPS_PROXY", "https_proxy"] {
            assert!(
                env.iter()
                    .any(|e| e["name"] == k && e["value"] == "http://proxy:3128"),
                "{k} in {env:?}"
            );
        }
        assert_eq!(
            spec["volumes"][0]["secret"]["secretName"],
            "cluster-proxy-hub-kubeconfig"
        );
    }

    #[tokio::test]
    async fn observe_reports_the_hash_only_once_rolled_out() {
        let dir = tempfile::tempdir().unwrap();
        let r = rendered(dir.path());
        let mut d =
            serde_json::to_value(deployment_object("cluster-proxy", "addon-ns", "i", &r)).unwrap();
        d["metadata"]["generation"] = 3.into();
        d["status"] = serde_json::json!({"observedGeneration": 3, "updatedReplicas": 2, "availableReplicas": 1});
        let (client, log) = mock::client(echo(Some(d.clone())));
        let mut rt = KubeRuntime::new(client, "cluster-proxy", "tether:dev");
        // Before apply, the namespace is unknown: no request at all.
        assert_eq!(rt.observe().await, None);
        assert!(log.lock().unwrap().is_empty());
        rt.apply(&r).await.unwrap();
        assert_eq!(rt.observe().await, None, "1 of 2 replicas available");
        let get = log.lock().unwrap().last().cloned().unwrap();
        assert_eq!(get.method, "GET");
        assert_eq!(
            get.path,
            "/apis/apps/v1/namespaces/addon-ns/deployments/cluster-proxy-agent"
        );
        d["status"]["availableReplicas"] = 2.into();
        let (client, _) = mock::client(echo(Some(d)));
        let mut rt = KubeRuntime::new(client, "cluster-proxy", "tether:dev");
        rt.apply(&r).await.unwrap();
        assert_eq!(
            rt.observe().await.map(|o| o.config_sha256),
            Some("abc123".to_string())
        );
    }

    #[tokio::test]
    async fn apply_error_names_the_object_and_stop_deletes_both() {
        let dir = tempfile::tempdir().unwrap();
        let r = rendered(dir.path());
        let (client, _) = mock::client(Arc::new(|_: &Seen| {
            (
                403,
                serde_json::json!({"kind":"Status","apiVersion":"v1","status":"Failure",
                    "message":"secrets is forbidden","reason":"Forbidden","code":403}),
            )
        }));
        let mut rt = KubeRuntime::new(client, "cluster-proxy", "tether:dev");
        let e = rt.apply(&r).await.unwrap_err().to_string();
        assert!(
            e.contains("secret addon-ns/cluster-proxy-hub-kubeconfig") && e.contains("forbidden"),
            "{e}"
        );
        let (client, log) = mock::client(echo(None));
        let mut rt = KubeRuntime::new(client, "cluster-proxy", "tether:dev");
        rt.apply(&r).await.unwrap();
        rt.stop(false).await;
        assert_eq!(log.lock().unwrap().len(), 2, "stop without remove: nothing");
        rt.stop(true).await;
        let log = log.lock().unwrap().clone();
        let deletes: Vec<(&str, &str)> = log[2..]
            .iter()
            .map(|s| (s.method.as_str(), s.path.as_str()))
            .collect();
        assert_eq!(
            deletes,
            [
                (
                    "DELETE",
                    "/apis/apps/v1/namespaces/addon-ns/deployments/cluster-proxy-agent"
                ),
                (
                    "DELETE",
                    "/api/v1/namespaces/addon-ns/secrets/cluster-proxy-hub-kubeconfig"
                ),
            ]
        );
    }
}
