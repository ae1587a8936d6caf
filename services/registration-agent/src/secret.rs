//! Where the hub credentials live: OCM's `hub-kubeconfig-secret` with the keys `kubeconfig`,
//! `tls.crt`, `tls.key`, `cluster-name`, `agent-name`.
//!
//! [`HubSecretStore`] is the narrow interface; [`FileSecretStore`] (a directory with one file per
//! key, written atomically, `tls.key` mode 0600) is what runs without Kubernetes and in the
//! end-to-end tests; [`KubeSecretStore`] keeps the same keys in a Kubernetes Secret through `kube`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// Server-side apply field manager of everything the registration-agent writes to the managed
/// cluster (this Secret, the add-on Deployments and Secrets).
pub const FIELD_MANAGER: &str = "tether-registration-agent";

pub const KEY_KUBECONFIG: &str = "kubeconfig";
pub const KEY_TLS_CRT: &str = "tls.crt";
pub const KEY_TLS_KEY: &str = "tls.key";
pub const KEY_CLUSTER_NAME: &str = "cluster-name";
pub const KEY_AGENT_NAME: &str = "agent-name";
const ALL_KEYS: [&str; 5] = [
    KEY_KUBECONFIG,
    KEY_TLS_CRT,
    KEY_TLS_KEY,
    KEY_CLUSTER_NAME,
    KEY_AGENT_NAME,
];

/// The secret's data; any key may be missing (e.g. only `tls.key` + `agent-name` while waiting
/// for acceptance, so a restart re-sends the same CSR). `Debug` masks `tls.key`.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct HubSecret {
    pub data: BTreeMap<String, String>,
}

impl std::fmt::Debug for HubSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let keys: Vec<&String> = self.data.keys().collect();
        f.debug_struct("HubSecret").field("keys", &keys).finish()
    }
}

impl HubSecret {
    pub fn get(&self, k: &str) -> Option<&str> {
        self.data
            .get(k)
            .map(String::as_str)
            .filter(|s| !s.is_empty())
    }
    pub fn set(&mut self, k: &str, v: impl Into<String>) {
        self.data.insert(k.to_string(), v.into());
    }
    pub fn remove(&mut self, k: &str) {
        self.data.remove(k);
    }
}

#[derive(Debug, thiserror::Error)]
pub enum SecretError {
    #[error("hub secret {location}: {source}")]
    Io {
        location: String,
        #[source]
        source: std::io::Error,
    },
    #[error("hub secret {location}: {reason}")]
    Kube { location: String, reason: String },
}

/// Narrow storage interface for the hub credentials.
pub trait HubSecretStore: Send + Sync + 'static {
    /// Where (for messages).
    fn location(&self) -> String;
    fn load(&self) -> impl Future<Output = Result<HubSecret, SecretError>> + Send;
    fn save(&self, s: &HubSecret) -> impl Future<Output = Result<(), SecretError>> + Send;
}

/// A directory with one file per key.
#[derive(Debug, Clone)]
pub struct FileSecretStore {
    dir: PathBuf,
}

impl FileSecretStore {
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        Self { dir: dir.into() }
    }
    pub fn dir(&self) -> &Path {
        &self.dir
    }
    fn io(&self, source: std::io::Error) -> SecretError {
        SecretError::Io {
            location: self.dir.display().to_string(),
            source,
        }
    }
}

fn write_atomic(dir: &Path, name: &str, contents: &str, mode: u32) -> std::io::Result<()> {
    tether_runtime::write_atomic(&dir.join(name), contents.as_bytes(), mode)
}

impl HubSecretStore for FileSecretStore {
    fn location(&self) -> String {
        self.dir.display().to_string()
    }

    async fn load(&self) -> Result<HubSecret, SecretError> {
        let mut s = HubSecret::default();
        for k in ALL_KEYS {
            match std::fs::read_to_string(self.dir.join(k)) {
                Ok(v) => s.set(k, v),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(self.io(e)),
            }
        }
        Ok(s)
    }

    async fn save(&self, s: &HubSecret) -> Result<(), SecretError> {
        std::fs::create_dir_all(&self.dir).map_err(|e| self.io(e))?;
        // Write tls.key and tls.crt before the kubeconfig that points at them.
        let order = [
            KEY_AGENT_NAME,
            KEY_CLUSTER_NAME,
            KEY_TLS_KEY,
            KEY_TLS_CRT,
            KEY_KUBECONFIG,
        ];
        for k in order {
            match s.get(k) {
                Some(v) => {
                    let mode = if k == KEY_TLS_KEY { 0o600 } else { 0o644 };
                    write_atomic(&self.dir, k, v, mode).map_err(|e| self.io(e))?;
                }
                None => match std::fs::remove_file(self.dir.join(k)) {
                    Ok(()) => {}
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                    Err(e) => return Err(self.io(e)),
                },
            }
        }
        Ok(())
    }
}

/// The same keys in a Kubernetes Secret (type Opaque), e.g. `open-cluster-management-agent/
/// hub-kubeconfig-secret`.
#[derive(Clone)]
pub struct KubeSecretStore {
    api: kube::Api<k8s_openapi::api::core::v1::Secret>,
    namespace: String,
    name: String,
}

impl std::fmt::Debug for KubeSecretStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "KubeSecretStore({}/{})", self.namespace, self.name)
    }
}

impl KubeSecretStore {
    pub fn new(client: kube::Client, namespace: &str, name: &str) -> Self {
        Self {
            api: kube::Api::namespaced(client, namespace),
            namespace: namespace.into(),
            name: name.into(),
        }
    }
    fn err(&self, e: impl std::fmt::Display) -> SecretError {
        SecretError::Kube {
            location: self.location(),
            reason: e.to_string(),
        }
    }
}

impl HubSecretStore for KubeSecretStore {
    fn location(&self) -> String {
        format!("secret {}/{}", self.namespace, self.name)
    }

    async fn load(&self) -> Result<HubSecret, SecretError> {
        let mut s = HubSecret::default();
        if let Some(sec) = self
            .api
            .get_opt(&self.name)
            .await
            .map_err(|e| self.err(e))?
        {
            for (k, v) in sec.data.unwrap_or_default() {
                s.set(&k, String::from_utf8_lossy(&v.0).into_owned());
            }
        }
        Ok(s)
    }

    async fn save(&self, s: &HubSecret) -> Result<(), SecretError> {
        use k8s_openapi::ByteString;
        let data: BTreeMap<String, ByteString> = s
            .data
            .iter()
            .map(|(k, v)| (k.clone(), ByteString(v.clone().into_bytes())))
            .collect();
        let secret = k8s_openapi::api::core::v1::Secret {
            metadata: kube::api::ObjectMeta {
                name: Some(self.name.clone()),
                namespace: Some(self.namespace.clone()),
                ..Default::default()
            },
            type_: Some("Opaque".into()),
            data: Some(data),
            ..Default::default()
        };
        let pp = kube::api::PatchParams::apply(FIELD_MANAGER).force();
        self.api
            .patch(&self.name, &pp, &kube::api::Patch::Apply(&secret))
            .await
            .map_err(|e| self.err(e))?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn file_store_round_trip() {
        let dir = tempfile::tempdir().unwrap();
        let store = FileSecretStore::new(dir.path().join("hub"));
        let mut s = HubSecret::default();
        s.set(KEY_TLS_KEY, "key");
        s.set(KEY_AGENT_NAME, "a1");
        store.save(&s).await.unwrap();
        assert_eq!(store.load().await.unwrap(), s);
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(dir.path().join("hub/tls.key"))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
        s.remove(KEY_TLS_KEY);
        store.save(&s).await.unwrap();
        assert!(!dir.path().join("hub/tls.key").exists());
        assert!(!format!("{s:?}").contains("key\""));
    }

    /// The Kubernetes store against a mocked API service: the real paths, verbs, field
    /// manager and bodies (never run against a real API server).
    #[tokio::test]
    async fn kube_store_gets_and_applies_its_one_secret() {
        use crate::addon::kube::mock;
        use base64::Engine;
        let stored = std::sync::Arc::new(std::sync::Mutex::new(None::<serde_json::Value>));
        let st = std::sync::Arc::clone(&stored);
        let (client, log) = mock::client(std::sync::Arc::new(move |s: &mock::Seen| {
            let mut cur = st.lock().unwrap();
            match s.method.as_str() {
                "GET" => cur
                    .clone()
                    .map_or_else(|| mock::not_found("hub-kubeconfig-secret"), |v| (200, v)),
                "PATCH" => {
                    *cur = Some(s.body.clone());
                    (200, s.body.clone())
                }
                _ => (405, serde_json::json!({})),
            }
        }));
        let store = KubeSecretStore::new(client, "agent-ns", "hub-kubeconfig-secret");
        assert_eq!(
            store.load().await.unwrap(),
            HubSecret::default(),
            "404: empty"
        );
        let mut s = HubSecret::default();
        s.set(KEY_KUBECONFIG, "kc");
        s.set(KEY_TLS_KEY, "key");
        store.save(&s).await.unwrap();
        assert_eq!(store.load().await.unwrap(), s);
        let log = log.lock().unwrap().clone();
        let calls: Vec<(&str, &str)> = log
            .iter()
            .map(|r| (r.method.as_str(), r.path.as_str()))
            .collect();
        let path = "/api/v1/namespaces/agent-ns/secrets/hub-kubeconfig-secret";
        assert_eq!(calls, [("GET", path), ("PATCH", path), ("GET", path)]);
        let apply = &log[1];
        assert_eq!(apply.content_type, "application/apply-patch+yaml");
        assert_eq!(apply.param("fieldManager").as_deref(), Some(FIELD_MANAGER));
        assert_eq!(apply.param("force").as_deref(), Some("true"));
        assert_eq!(apply.body["kind"], "Secret");
        assert_eq!(apply.body["type"], "Opaque");
        assert_eq!(apply.body["metadata"]["namespace"], "agent-ns");
        let b64 = |v: &str| base64::engine::general_purpose::STANDARD.encode(v);
        assert_eq!(apply.body["data"][KEY_KUBECONFIG], b64("kc"));
        assert_eq!(apply.body["data"][KEY_TLS_KEY], b64("key"));
        // An API error names the Secret.
        let (client, _) = mock::client(std::sync::Arc::new(|_: &mock::Seen| {
            (
                500,
                serde_json::json!({"kind":"Status","status":"Failure","message":"etcd down","code":500}),
            )
        }));
        let e = KubeSecretStore::new(client, "agent-ns", "hub-kubeconfig-secret")
            .load()
            .await
            .unwrap_err()
            .to_string();
        assert!(e.contains("agent-ns/hub-kubeconfig-secret"), "{e}");
    }
}
