//! The umbrella chart's rendered workloads, run for real with Docker (no Kubernetes here):
//! `helm template helm/tether` with the agent enabled, then every rendered container is started
//! with its image, command, args, env, ConfigMap/Secret mounts (the rendered ConfigMaps, and
//! the Secrets the bootstrap Job's commands wrote, as bind-mounted files), emptyDirs as tmpfs,
//! its securityContext (user, read-only root, no capabilities, no-new-privileges), and every
//! Service name that selects it as a network alias on a private network this test creates
//! (name prefix `tether-helm-<pid>-<n>`, removed with its containers by a Drop guard).
//!
//! What needs an API server is configured off, through the charts' own values:
//! `tether-hub.bootstrap.writeSecrets=false` (the hook Job runs its `tetherctl init` /
//! `tetherctl cert issue` commands into a volume instead of writing Secrets; which Secret is
//! which directory comes from its `push <secret> <dir>` lines), `tether-agent.secretStore=file`
//! and `tether-agent.addonRuntime=local` (the tunnel-agent as the registration-agent's child in
//! the same container), JetStream on an emptyDir. The DNS a user sets up (NOTES: the broker
//! entrypoints `<pod>.<advertiseDomain>`, the hub NATS name) becomes aliases too, and the
//! agent's bootstrap Secret is what `tetherctl join` writes.
//!
//! It reaches: the NATS cluster formed (3 routes each, a JetStream meta leader), brokers,
//! addon-manager, health-prober and registration-agent ready, the cluster joined
//! (auto-accepted), and its cluster-proxy add-on Available through every broker (each
//! broker's presence lists the cluster).
//!
//! Images: `tether:dev` and `tether-nats:dev` from scripts/build-images.sh (built here when
//! missing); the Tether binaries of this workspace (target/debug) are bind-mounted over the
//! image's /usr/local/bin ones, so the code under test is what runs. Skips (with `SKIPPED:`)
//! only when helm or a Docker engine is absent.
//!
//! Run: `cargo build --bins && cargo test -p tether-e2e --test helm_docker` (~60 s).

mod helm_support;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use helm_support::*;
use serde_json::Value;
use tether_test_support::{bin, wait_until};

const NS: &str = "tether";
const RELEASE: &str = "t";
const ADVERTISE: &str = "hub.example.com";
const NATS_NAME: &str = "hub.example.com";
const TETHER_BINS: [&str; 6] = [
    "tunnel-broker",
    "tunnel-agent",
    "registration-agent",
    "addon-manager",
    "health-prober",
    "tetherctl",
];
/// Whole-run budget of each wait (a loaded 2-core machine).
const WAIT: Duration = Duration::from_secs(120);

fn docker(args: &[&str]) -> Result<String, String> {
    run(Command::new("docker").args(args))
}

/// The network and containers this test made; removed on drop (by name, never by pattern).
struct Stack {
    prefix: String,
    network: String,
    containers: Vec<String>,
}

impl Stack {
    fn new() -> Self {
        static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let prefix = format!(
            "tether-helm-{}-{}",
            std::process::id(),
            N.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        );
        let network = format!("{prefix}-net");
        docker(&["network", "create", &network]).expect("docker network create");
        Self {
            prefix,
            network,
            containers: Vec::new(),
        }
    }

    fn name(&self, pod: &str) -> String {
        format!("{}-{pod}", self.prefix)
    }

    fn ip(&self, pod: &str) -> String {
        let f = format!(
            "{{{{(index .NetworkSettings.Networks \"{}\").IPAddress}}}}",
            self.network
        );
        docker(&["inspect", "-f", &f, &self.name(pod)])
            .expect("docker inspect")
            .trim()
            .to_string()
    }

    /// The last lines of every container's log (for failure messages).
    fn logs(&self) -> String {
        let mut out = String::new();
        for c in &self.containers {
            let o = Command::new("docker")
                .args(["logs", "--tail", "25", c])
                .output();
            if let Ok(o) = o {
                out.push_str(&format!(
                    "\n----- {c}\n{}{}",
                    String::from_utf8_lossy(&o.stdout),
                    String::from_utf8_lossy(&o.stderr)
                ));
            }
        }
        out
    }
}

impl Drop for Stack {
    fn drop(&mut self) {
        if std::env::var_os("TETHER_HELM_DOCKER_KEEP").is_some() {
            eprintln!(
                "TETHER_HELM_DOCKER_KEEP: leaving {} and {:?}",
                self.network, self.containers
            );
            return;
        }
        for c in &self.containers {
            let _ = Command::new("docker").args(["rm", "-f", "-v", c]).output();
        }
        let _ = Command::new("docker")
            .args(["network", "rm", &self.network])
            .output();
    }
}

/// One pod of a rendered workload.
struct Pod {
    name: String,
    labels: BTreeMap<String, String>,
    spec: Value,
    /// The StatefulSet's governing Service, for `<pod>.<service>.<ns>.svc`.
    service_name: Option<String>,
}

fn pods_of(docs: &[Value]) -> (Vec<Pod>, Option<Pod>) {
    let mut pods = Vec::new();
    let mut job = None;
    for d in docs {
        let kind = d["kind"].as_str().unwrap_or_default();
        let name = d["metadata"]["name"].as_str().unwrap_or_default();
        let labels: BTreeMap<String, String> =
            serde_json::from_value(d["spec"]["template"]["metadata"]["labels"].clone())
                .unwrap_or_default();
        let spec = d["spec"]["template"]["spec"].clone();
        match kind {
            "StatefulSet" => {
                for i in 0..d["spec"]["replicas"].as_u64().unwrap_or(1) {
                    let pod = format!("{name}-{i}");
                    let mut l = labels.clone();
                    l.insert("statefulset.kubernetes.io/pod-name".into(), pod.clone());
                    pods.push(Pod {
                        name: pod,
                        labels: l,
                        spec: spec.clone(),
                        service_name: d["spec"]["serviceName"].as_str().map(str::to_string),
                    });
                }
            }
            "Deployment" => {
                for i in 0..d["spec"]["replicas"].as_u64().unwrap_or(1) {
                    pods.push(Pod {
                        name: format!("{name}-{i}"),
                        labels: labels.clone(),
                        spec: spec.clone(),
                        service_name: None,
                    });
                }
            }
            "Job" => {
                job = Some(Pod {
                    name: name.to_string(),
                    labels,
                    spec,
                    service_name: None,
                })
            }
            _ => {}
        }
    }
    (pods, job)
}

/// DNS names that reach each pod: every Service selecting it (short, namespaced, `.svc`,
/// `.svc.cluster.local`), per-pod names of headless Services, plus `extra`.
fn aliases(
    docs: &[Value],
    pods: &[Pod],
    extra: &BTreeMap<String, Vec<String>>,
) -> BTreeMap<String, BTreeSet<String>> {
    let mut out: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for s in docs.iter().filter(|d| d["kind"] == "Service") {
        let svc = s["metadata"]["name"].as_str().unwrap();
        let selector: BTreeMap<String, String> =
            serde_json::from_value(s["spec"]["selector"].clone()).unwrap_or_default();
        let headless = s["spec"]["clusterIP"] == "None";
        for p in pods {
            if selector.is_empty() || !selector.iter().all(|(k, v)| p.labels.get(k) == Some(v)) {
                continue;
            }
            let a = out.entry(p.name.clone()).or_default();
            for n in [
                svc.to_string(),
                format!("{svc}.{NS}"),
                format!("{svc}.{NS}.svc"),
                format!("{svc}.{NS}.svc.cluster.local"),
            ] {
                a.insert(n);
            }
            if headless && p.service_name.as_deref() == Some(svc) {
                a.insert(format!("{}.{svc}.{NS}.svc", p.name));
                a.insert(format!("{}.{svc}.{NS}.svc.cluster.local", p.name));
            }
        }
    }
    for (pod, names) in extra {
        out.entry(pod.clone())
            .or_default()
            .extend(names.iter().cloned());
    }
    out
}

/// Copies `src`'s files (or the listed `items`: key -> path) into a fresh directory readable
/// by the container user (a Secret volume's projection).
fn project(src: &Path, items: Option<&Vec<Value>>, dst: &Path) {
    std::fs::create_dir_all(dst).unwrap();
    let pairs: Vec<(String, String)> = match items {
        Some(items) => items
            .iter()
            .map(|i| {
                (
                    i["key"].as_str().unwrap().to_string(),
                    i["path"].as_str().unwrap().to_string(),
                )
            })
            .collect(),
        None => std::fs::read_dir(src)
            .unwrap_or_else(|e| panic!("{}: {e}", src.display()))
            .filter_map(|e| e.ok())
            .filter(|e| e.path().is_file())
            .map(|e| {
                let n = e.file_name().to_string_lossy().into_owned();
                (n.clone(), n)
            })
            .collect(),
    };
    for (k, p) in pairs {
        let to = dst.join(&p);
        std::fs::copy(src.join(&k), &to)
            .unwrap_or_else(|e| panic!("{}: {e}", src.join(&k).display()));
        chmod(&to, 0o644);
    }
    chmod(dst, 0o755);
}

fn chmod(p: &Path, mode: u32) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode)).unwrap();
}

fn strings(v: &Value) -> Vec<String> {
    v.as_array()
        .into_iter()
        .flatten()
        .filter_map(|x| x.as_str().map(str::to_string))
        .collect()
}

/// `docker run` arguments of a pod's single container (everything but name/network/aliases).
fn run_args(
    pod: &Pod,
    configmaps: &BTreeMap<String, Value>,
    secrets: &BTreeMap<String, PathBuf>,
    scratch: &Path,
) -> Vec<String> {
    let containers = pod.spec["containers"].as_array().unwrap();
    assert_eq!(containers.len(), 1, "{}: one container per pod", pod.name);
    let c = &containers[0];
    let psc = &pod.spec["securityContext"];
    let sc = &c["securityContext"];
    let uid = sc["runAsUser"]
        .as_i64()
        .or(psc["runAsUser"].as_i64())
        .expect("runAsUser");
    let gid = psc["runAsGroup"].as_i64().unwrap_or(uid);
    let mut a: Vec<String> = vec![
        "--user".into(),
        format!("{uid}:{gid}"),
        "--cap-drop".into(),
        "ALL".into(),
        "--security-opt".into(),
        "no-new-privileges".into(),
    ];
    if let Some(g) = psc["fsGroup"].as_i64() {
        a.extend(["--group-add".into(), g.to_string()]);
    }
    if sc["readOnlyRootFilesystem"] == true {
        a.push("--read-only".into());
    }
    for e in c["env"].as_array().into_iter().flatten() {
        let name = e["name"].as_str().unwrap();
        let value = if e["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name" {
            pod.name.clone()
        } else if e["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace" {
            NS.to_string()
        } else {
            e["value"].as_str().unwrap_or_default().to_string()
        };
        a.extend(["-e".into(), format!("{name}={value}")]);
    }
    let volumes: BTreeMap<String, Value> = pod.spec["volumes"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|v| (v["name"].as_str().unwrap().to_string(), v.clone()))
        .collect();
    for (i, m) in c["volumeMounts"]
        .as_array()
        .into_iter()
        .flatten()
        .enumerate()
    {
        let vname = m["name"].as_str().unwrap();
        let path = m["mountPath"].as_str().unwrap();
        let ro = if m["readOnly"] == true { ":ro" } else { "" };
        let v = volumes
            .get(vname)
            .unwrap_or_else(|| panic!("{}: no volume {vname}", pod.name));
        let dir = scratch.join(format!("{}-{i}-{vname}", pod.name));
        let host = if let Some(cm) = v["configMap"]["name"].as_str() {
            std::fs::create_dir_all(&dir).unwrap();
            let data = configmaps
                .get(cm)
                .unwrap_or_else(|| panic!("{}: ConfigMap {cm} not rendered", pod.name));
            for (k, val) in data.as_object().unwrap() {
                std::fs::write(dir.join(k), val.as_str().unwrap()).unwrap();
                chmod(&dir.join(k), 0o644);
            }
            chmod(&dir, 0o755);
            dir
        } else if let Some(s) = v["secret"]["secretName"].as_str() {
            let src = secrets
                .get(s)
                .unwrap_or_else(|| panic!("{}: Secret {s} is not one the test has", pod.name));
            project(src, v["secret"]["items"].as_array(), &dir);
            dir
        } else if v.get("emptyDir").is_some() {
            // Owned by the pod's user and fsGroup as on a kubelet (a tmpfs over a directory
            // that exists in the image would otherwise keep that directory's root 0755).
            let g = psc["fsGroup"].as_i64().unwrap_or(gid);
            a.extend([
                "--tmpfs".into(),
                format!("{path}:uid={uid},gid={g},mode=0770"),
            ]);
            continue;
        } else {
            panic!("{}: volume type of {v} not handled", pod.name);
        };
        let host = match m["subPath"].as_str() {
            Some(sp) => host.join(sp),
            None => host,
        };
        a.extend(["-v".into(), format!("{}:{path}{ro}", host.display())]);
    }
    // The workspace's binaries (the code under test) over the image's.
    for b in TETHER_BINS {
        let p = bin(b).expect("binary");
        a.extend([
            "-v".into(),
            format!("{}:/usr/local/bin/{b}:ro", p.display()),
        ]);
    }
    a.push(c["image"].as_str().unwrap().to_string());
    a.extend(strings(&c["command"]));
    a.extend(strings(&c["args"]));
    a
}

/// `push <secret> <dir>` lines of the bootstrap script: which Secret holds which directory.
fn pushed_secrets(script: &str) -> BTreeMap<String, String> {
    script
        .lines()
        .filter_map(|l| {
            let mut w = l.split_whitespace();
            (w.next() == Some("push"))
                .then(|| Some((w.next()?.to_string(), w.next()?.to_string())))?
        })
        .collect()
}

fn http_get(addr: &str, path: &str) -> Option<(u16, String)> {
    use std::io::{Read, Write};
    let mut s =
        std::net::TcpStream::connect_timeout(&addr.parse().ok()?, Duration::from_secs(2)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(3))).ok()?;
    // HTTP/1.0: a plain body (no chunked encoding) ending at close.
    write!(s, "GET {path} HTTP/1.0\r\nHost: x\r\n\r\n").ok()?;
    let mut buf = String::new();
    s.take(4 << 20).read_to_string(&mut buf).ok()?;
    let code = buf.split_whitespace().nth(1)?.parse().ok()?;
    let body = buf.split_once("\r\n\r\n")?.1.to_string();
    Some((code, body))
}

fn ensure_images() {
    let missing: Vec<&str> = ["tether:dev", "tether-nats:dev"]
        .into_iter()
        .filter(|i| docker(&["image", "inspect", i]).is_err())
        .collect();
    if missing.is_empty() {
        return;
    }
    eprintln!("building images {missing:?} with scripts/build-images.sh");
    run(Command::new("bash")
        .arg(root().join("scripts/build-images.sh"))
        .env("TETHER_SKIP_CARGO", "1"))
    .unwrap_or_else(|e| {
        panic!("images {missing:?} missing and scripts/build-images.sh failed: {e}")
    });
}

const ADDONS: &str = r#"
apiVersion: addon.open-cluster-management.io/v1alpha1
kind: ClusterManagementAddOn
metadata: {name: cluster-proxy}
spec:
  installStrategy: {type: All}
  defaultConfigs:
    - {group: proxy.open-cluster-management.io, resource: managedproxyconfigurations, name: cluster-proxy}
---
apiVersion: proxy.open-cluster-management.io/v1alpha1
kind: ManagedProxyConfiguration
metadata: {name: cluster-proxy}
spec:
  authentication: {signer: {type: SelfSigned}}
  proxyServer:
    replicas: 2
    entrypoints:
      - {host: t-broker-0.hub.example.com, port: 8091}
  proxyAgent: {replicas: 1, keepalive: 5s}
"#;

#[test]
fn rendered_umbrella_workloads_run_and_the_addon_becomes_available_through_every_broker() {
    if !have("helm", &["version"]) || !have("docker", &["info"]) {
        return;
    }
    ensure_images();
    for b in TETHER_BINS {
        assert!(
            bin(b).is_ok_and(|p| p.is_file()),
            "{b} not built: cargo build --bins first"
        );
    }
    let charts = Charts::build();
    let yaml = charts
        .template(
            "tether",
            RELEASE,
            NS,
            None,
            &[
                "tether-agent.enabled=true",
                "tether-agent.clusterName=edge-1",
                "tether-agent.secretStore=file",
                "tether-agent.addonRuntime=local",
                "tether-agent.addon.createInstallNamespace=false",
                "tether-hub.bootstrap.writeSecrets=false",
                "tether-hub.bootstrap.autoAccept={edge-*}",
                "tether-nats.jetstream.persistence.enabled=false",
                "tether-hub.env.RUST_LOG=info",
            ],
        )
        .unwrap_or_else(|e| panic!("{e}"));
    let d = docs(&yaml);
    let configmaps: BTreeMap<String, Value> = d
        .iter()
        .filter(|x| x["kind"] == "ConfigMap")
        .map(|x| {
            (
                x["metadata"]["name"].as_str().unwrap().to_string(),
                x["data"].clone(),
            )
        })
        .collect();
    let (pods, job) = pods_of(&d);
    let job = job.expect("bootstrap Job rendered");
    let brokers: Vec<String> = pods
        .iter()
        .filter(|p| p.name.starts_with("t-broker-"))
        .map(|p| p.name.clone())
        .collect();
    let nats: Vec<String> = pods
        .iter()
        .filter(|p| p.name.starts_with("t-nats-"))
        .map(|p| p.name.clone())
        .collect();
    assert_eq!((brokers.len(), nats.len()), (2, 3));

    let mut stack = Stack::new();
    let scratch = tempfile::tempdir().unwrap();

    // 1. The bootstrap Job's commands, into a volume instead of Secrets.
    let work = scratch.path().join("bootstrap-work");
    std::fs::create_dir_all(&work).unwrap();
    chmod(&work, 0o777);
    let mut secrets: BTreeMap<String, PathBuf> = BTreeMap::new();
    let script = job.spec["containers"][0]["args"][0]
        .as_str()
        .unwrap()
        .to_string();
    let mut args = run_args(&job, &configmaps, &secrets, scratch.path());
    // Its /work emptyDir is the host directory the other pods' Secrets are read from.
    let i = args
        .iter()
        .position(|x| x.starts_with("/work:"))
        .expect("/work emptyDir");
    args[i - 1] = "-v".into();
    args[i] = format!("{}:/work", work.display());
    let name = stack.name(&job.name);
    stack.containers.push(name.clone());
    let mut cmd = vec!["run", "--name", &name, "--network", &stack.network];
    cmd.extend(args.iter().map(String::as_str));
    let out = docker(&cmd).unwrap_or_else(|e| panic!("bootstrap Job failed: {e}"));
    assert!(out.contains("bootstrap done"), "{out}");
    for (secret, dir) in pushed_secrets(&script) {
        let host = work.join(dir.trim_start_matches("/work/"));
        assert!(host.is_dir(), "{secret}: {} not written", host.display());
        secrets.insert(secret, host);
    }
    assert_eq!(secrets.len(), 5, "{secrets:?}");
    // The agent's bootstrap Secret: what `tetherctl join` writes (NOTES step 3).
    let hub_dir = secrets["t-hub-dir"].clone();
    let token = std::fs::read_to_string(hub_dir.join("bootstrap.token")).unwrap();
    let boot = scratch.path().join("bootstrap-secret");
    std::fs::create_dir_all(&boot).unwrap();
    run(Command::new(bin("tetherctl").unwrap())
        .args([
            "join",
            "--hub-server",
            &format!("tls://{NATS_NAME}:4222"),
            "--hub-ca",
        ])
        .arg(hub_dir.join("ca.crt"))
        .args(["--token", token.trim(), "--out"])
        .arg(boot.join("kubeconfig")))
    .expect("tetherctl join");
    secrets.insert("tether-bootstrap".into(), boot);

    // 2. Every pod, with its Service names (and the DNS NOTES asks for) as aliases.
    let mut extra: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for b in &brokers {
        extra.insert(b.clone(), vec![format!("{b}.{ADVERTISE}")]);
    }
    for n in &nats {
        extra.insert(n.clone(), vec![NATS_NAME.to_string()]);
    }
    let aliases = aliases(&d, &pods, &extra);
    for p in &pods {
        let name = stack.name(&p.name);
        let args = run_args(p, &configmaps, &secrets, scratch.path());
        let mut cmd: Vec<String> = vec![
            "run".into(),
            "-d".into(),
            // The kubelet's restartPolicy Always (a process that exits while NATS or a broker
            // is not there yet is restarted, as in a pod).
            "--restart".into(),
            "on-failure".into(),
            "--name".into(),
            name.clone(),
            "--hostname".into(),
            p.name.clone(),
            "--network".into(),
            stack.network.clone(),
        ];
        for a in aliases.get(&p.name).into_iter().flatten() {
            cmd.extend(["--network-alias".into(), a.clone()]);
        }
        cmd.extend(args);
        stack.containers.push(name);
        let cmd: Vec<&str> = cmd.iter().map(String::as_str).collect();
        docker(&cmd).unwrap_or_else(|e| panic!("{}: {e}", p.name));
    }

    // 3. NATS cluster formed: every node routes to the other two; JetStream has a meta leader.
    for n in &nats {
        let addr = format!("{}:8222", stack.ip(n));
        wait_until(
            WAIT,
            &format!("{n}: 2 routes and a JetStream leader"),
            || {
                let (_, routez) = http_get(&addr, "/routez").filter(|(c, _)| *c == 200)?;
                let routes: Value = serde_json::from_str(&routez).ok()?;
                let (_, jsz) = http_get(&addr, "/jsz").filter(|(c, _)| *c == 200)?;
                let jsz: Value = serde_json::from_str(&jsz).ok()?;
                (routes["num_routes"].as_u64()? >= 2
                    && jsz["meta_cluster"]["leader"]
                        .as_str()
                        .is_some_and(|l| !l.is_empty()))
                .then_some(())
            },
        )
        .unwrap_or_else(|e| panic!("{e}{}", stack.logs()));
    }

    // 4. Readiness probes, as the kubelet would ask them.
    for p in &pods {
        let c = &p.spec["containers"][0];
        let Some(port_name) = c["readinessProbe"]["httpGet"]["port"].as_str() else {
            continue;
        };
        let path = c["readinessProbe"]["httpGet"]["path"].as_str().unwrap();
        let port = c["ports"]
            .as_array()
            .unwrap()
            .iter()
            .find(|x| x["name"] == port_name)
            .and_then(|x| x["containerPort"].as_u64())
            .unwrap();
        // The address is looked up on every try: a container that exits while NATS or a
        // broker is not there yet is restarted (restart policy above) and may come back on
        // another address of the network.
        wait_until(WAIT, &format!("{} ready ({path})", p.name), || {
            let addr = format!("{}:{port}", stack.ip(&p.name));
            http_get(&addr, path).filter(|(c, _)| *c == 200).map(|_| ())
        })
        .unwrap_or_else(|e| panic!("{e}{}", stack.logs()));
    }

    // 5. The add-on resources; the agent joined (auto-accepted); its add-on Available through
    //    every broker, and each broker's presence lists edge-1.
    let nats_url = format!("tls://{}:4222", stack.ip(&nats[0]));
    let tetherctl = |args: &[&str]| -> Result<String, String> {
        run(Command::new(bin("tetherctl").unwrap())
            .args(args)
            .arg("--hub-dir")
            .arg(&hub_dir)
            .args(["--nats-url", &nats_url]))
    };
    let f = scratch.path().join("addons.yaml");
    std::fs::write(&f, ADDONS).unwrap();
    tetherctl(&["apply", "-f", f.to_str().unwrap()]).expect("tetherctl apply");
    wait_until(WAIT, "edge-1 joined and accepted", || {
        let v: Value =
            serde_json::from_str(&tetherctl(&["get", "clusters", "-o", "json"]).ok()?).ok()?;
        let items = v["items"].as_array()?.clone();
        items
            .iter()
            .any(|c| {
                c["metadata"]["name"] == "edge-1"
                    && c["spec"]["hubAcceptsClient"] == true
                    && c["status"]["conditions"].as_array().is_some_and(|cs| {
                        cs.iter().any(|x| {
                            x["type"] == "ManagedClusterConditionAvailable" && x["status"] == "True"
                        })
                    })
            })
            .then_some(())
    })
    .unwrap_or_else(|e| panic!("{e}{}", stack.logs()));
    let msg = wait_until(WAIT, "cluster-proxy Available on edge-1", || {
        let v: Value =
            serde_json::from_str(&tetherctl(&["get", "addons", "-o", "json"]).ok()?).ok()?;
        let a = v["items"]
            .as_array()?
            .iter()
            .find(|a| a["metadata"]["namespace"] == "edge-1")?
            .clone();
        let c = a["status"]["conditions"]
            .as_array()?
            .iter()
            .find(|c| c["type"] == "Available" && c["status"] == "True")?
            .clone();
        Some(c["message"].as_str()?.to_string())
    })
    .unwrap_or_else(|e| panic!("{e}{}", stack.logs()));
    for b in &brokers {
        assert!(
            msg.contains(b.as_str()),
            "Available message names {b}: {msg}"
        );
    }
    let v: Value =
        serde_json::from_str(&tetherctl(&["get", "brokers", "-o", "json"]).unwrap()).unwrap();
    // `get brokers -o json` is the presence list itself.
    let items = v.as_array().cloned().unwrap_or_default();
    for b in &brokers {
        let p = items
            .iter()
            .find(|x| x["id"] == b.as_str())
            .unwrap_or_else(|| panic!("no presence of {b} in {v}"));
        assert!(
            p["clusters"]
                .as_array()
                .is_some_and(|c| c.iter().any(|x| x == "edge-1")),
            "{b} presence does not list edge-1: {p}"
        );
    }
    eprintln!(
        "{} pods ran from the rendered chart; Available: {msg}",
        pods.len()
    );
}
