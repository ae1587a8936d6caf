//! `tetherctl kube-secret pull|push`: a directory of flat files to and from one Kubernetes
//! Secret, for the Helm bootstrap Job (helm/tether-hub, templates/bootstrap.yaml) - the one hub
//! component that talks to the Kubernetes API (in-cluster config, the Job's ServiceAccount).
//!
//! - `pull`: GET the Secret and write each key as a file (mode 0600) in `--dir`; a missing
//!   Secret writes nothing (the Job then initialises).
//! - `push`: server-side apply (field manager [`FIELD_MANAGER`], forced) of every regular file
//!   directly in `--dir` as a key (subdirectories are skipped: Secret keys have no `/`).
//!
//! Tested against a mocked API service (paths, verbs, field manager, body); never run against a
//! real API server here.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::Context;
use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::Secret;
use kube::api::{ObjectMeta, Patch, PatchParams};

/// Server-side apply field manager of the bootstrap Job.
pub const FIELD_MANAGER: &str = "tether-bootstrap";
/// Largest file pushed (a Secret holds at most 1 MiB in all).
const MAX_FILE: u64 = 512 * 1024;

#[derive(clap::Subcommand, Debug)]
pub enum KubeSecretCmd {
    /// Write the Secret's keys as files in --dir (nothing when it does not exist).
    Pull(KubeSecretArgs),
    /// Apply the files directly in --dir as the Secret's keys.
    Push(KubeSecretArgs),
}

#[derive(clap::Args, Debug)]
pub struct KubeSecretArgs {
    /// Namespace of the Secret (default: the pod's, POD_NAMESPACE).
    #[arg(long, env = "POD_NAMESPACE")]
    pub namespace: String,
    #[arg(long)]
    pub name: String,
    #[arg(long)]
    pub dir: PathBuf,
}

pub async fn run(cmd: KubeSecretCmd) -> anyhow::Result<()> {
    let client = kube::Client::try_default()
        .await
        .context("no Kubernetes API configuration (in-cluster service account or kubeconfig)")?;
    match cmd {
        KubeSecretCmd::Pull(a) => pull(client, &a).await.map(|n| {
            println!(
                "secret {}/{}: {n} file(s) in {}",
                a.namespace,
                a.name,
                a.dir.display()
            )
        }),
        KubeSecretCmd::Push(a) => push(client, &a)
            .await
            .map(|n| println!("secret {}/{}: {n} key(s) applied", a.namespace, a.name)),
    }
}

/// Writes the Secret's keys into `a.dir`; returns how many (0: no such Secret).
pub async fn pull(client: kube::Client, a: &KubeSecretArgs) -> anyhow::Result<usize> {
    let api: kube::Api<Secret> = kube::Api::namespaced(client, &a.namespace);
    let what = || format!("reading secret {}/{}", a.namespace, a.name);
    let Some(s) = api.get_opt(&a.name).await.with_context(what)? else {
        return Ok(0);
    };
    std::fs::create_dir_all(&a.dir).with_context(|| format!("creating {}", a.dir.display()))?;
    let data = s.data.unwrap_or_default();
    for (k, v) in &data {
        if k.contains('/') || k == ".." || k == "." {
            anyhow::bail!("secret {}/{} has an invalid key {k:?}", a.namespace, a.name);
        }
        write_private(&a.dir.join(k), &v.0)?;
    }
    Ok(data.len())
}

fn write_private(path: &Path, data: &[u8]) -> anyhow::Result<()> {
    tether_runtime::write_atomic(path, data, 0o600)
        .with_context(|| format!("writing {}", path.display()))
}

/// The Secret object of the regular files directly in `dir`.
pub fn secret_from_dir(ns: &str, name: &str, dir: &Path) -> anyhow::Result<Secret> {
    let mut data = BTreeMap::new();
    for e in std::fs::read_dir(dir).with_context(|| format!("reading {}", dir.display()))? {
        let e = e?;
        if !e.file_type()?.is_file() {
            continue;
        }
        let path = e.path();
        let len = e.metadata()?.len();
        if len > MAX_FILE {
            anyhow::bail!("{} is {len} bytes: too large for a Secret", path.display());
        }
        let key = e.file_name().to_string_lossy().into_owned();
        let v = std::fs::read(&path).with_context(|| format!("reading {}", path.display()))?;
        data.insert(key, ByteString(v));
    }
    Ok(Secret {
        metadata: ObjectMeta {
            name: Some(name.into()),
            namespace: Some(ns.into()),
            labels: Some(
                [(
                    "app.kubernetes.io/part-of".to_string(),
                    "tether".to_string(),
                )]
                .into(),
            ),
            ..Default::default()
        },
        type_: Some("Opaque".into()),
        data: Some(data),
        ..Default::default()
    })
}

/// Applies the files of `a.dir`; returns how many keys.
pub async fn push(client: kube::Client, a: &KubeSecretArgs) -> anyhow::Result<usize> {
    let secret = secret_from_dir(&a.namespace, &a.name, &a.dir)?;
    let n = secret.data.as_ref().map_or(0, BTreeMap::len);
    let api: kube::Api<Secret> = kube::Api::namespaced(client, &a.namespace);
    api.patch(
        &a.name,
        &PatchParams::apply(FIELD_MANAGER).force(),
        &Patch::Apply(&secret),
    )
    .await
    .with_context(|| format!("applying secret {}/{}", a.namespace, a.name))?;
    Ok(n)
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use http_body_util::BodyExt;

    use super::*;

    /// (method, path?query, content type, body) of every request; the API server keeps one
    /// Secret (404 until applied).
    type Log = Arc<Mutex<Vec<(String, String, String, serde_json::Value)>>>;

    fn mock() -> (kube::Client, Log) {
        let log: Log = Arc::default();
        let stored: Arc<Mutex<Option<serde_json::Value>>> = Arc::default();
        let l = Arc::clone(&log);
        let svc = tower::service_fn(move |req: http::Request<kube::client::Body>| {
            let (log, stored) = (Arc::clone(&l), Arc::clone(&stored));
            async move {
                let (parts, body) = req.into_parts();
                let body: serde_json::Value =
                    serde_json::from_slice(&body.collect().await?.to_bytes())
                        .unwrap_or(serde_json::Value::Null);
                let ct = parts
                    .headers
                    .get(http::header::CONTENT_TYPE)
                    .and_then(|v| v.to_str().ok())
                    .unwrap_or_default()
                    .to_string();
                let mut cur = stored.lock().expect("mock");
                let (status, answer) = match (parts.method.as_str(), cur.clone()) {
                    ("GET", Some(v)) => (200, v),
                    ("GET", None) => (
                        404,
                        serde_json::json!({"kind":"Status","apiVersion":"v1","status":"Failure","reason":"NotFound","code":404,"message":"not found"}),
                    ),
                    _ => {
                        *cur = Some(body.clone());
                        (200, body.clone())
                    }
                };
                let pq = parts
                    .uri
                    .path_and_query()
                    .map(|p| p.to_string())
                    .unwrap_or_default();
                log.lock()
                    .expect("mock")
                    .push((parts.method.to_string(), pq, ct, body));
                http::Response::builder()
                    .status(status)
                    .body(kube::client::Body::from(
                        serde_json::to_vec(&answer).unwrap_or_default(),
                    ))
                    .map_err(kube::Error::HttpError)
            }
        });
        (kube::Client::new(svc, "default"), log)
    }

    #[tokio::test]
    async fn push_applies_the_flat_files_and_pull_writes_them_back() {
        let (client, log) = mock();
        let src = tempfile::tempdir().unwrap();
        std::fs::write(src.path().join("ca.crt"), "CA").unwrap();
        std::fs::write(src.path().join("hub.yaml"), "nats: {}").unwrap();
        std::fs::create_dir(src.path().join("nats")).unwrap();
        let a = |dir: &Path| KubeSecretArgs {
            namespace: "tether".into(),
            name: "t-hub-dir".into(),
            dir: dir.to_path_buf(),
        };
        let out = tempfile::tempdir().unwrap();
        assert_eq!(pull(client.clone(), &a(out.path())).await.unwrap(), 0);
        assert_eq!(std::fs::read_dir(out.path()).unwrap().count(), 0);
        assert_eq!(push(client.clone(), &a(src.path())).await.unwrap(), 2);
        assert_eq!(pull(client, &a(out.path())).await.unwrap(), 2);
        assert_eq!(
            std::fs::read_to_string(out.path().join("ca.crt")).unwrap(),
            "CA"
        );
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(out.path().join("hub.yaml"))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
        let log = log.lock().unwrap().clone();
        let path = "/api/v1/namespaces/tether/secrets/t-hub-dir";
        assert_eq!(log[0].0, "GET");
        assert_eq!(log[0].1, path);
        assert_eq!(log[1].0, "PATCH");
        assert_eq!(
            log[1].1,
            format!("{path}?&force=true&fieldManager={FIELD_MANAGER}")
        );
        assert_eq!(log[1].2, "application/apply-patch+yaml");
        assert_eq!(log[1].3["kind"], "Secret");
        assert_eq!(log[1].3["data"]["ca.crt"], "Q0E=");
        assert!(
            log[1].3["data"].get("nats").is_none(),
            "subdirectories skipped"
        );
        assert_eq!(log[2].0, "GET");
    }
}
