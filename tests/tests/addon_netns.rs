//! The cluster-proxy add-on across real network boundaries (issue 4, "Must show" 1).
//!
//! Namespaces: hub (nats-server, addon-manager, two tunnel-brokers announcing themselves in
//! `tether-brokers`), proxy (forwarding off: nothing crosses it except through a proxy
//! process), and two managed clusters. edge-1 reaches the hub only through squid as an HTTP
//! proxy; edge-2 only through squid as an HTTPS proxy with basic auth (its own CA). Each
//! cluster has a web service on its own loopback, reachable from nowhere else. Each cluster's
//! registration-agent joins through its proxy and runs the cluster-proxy add-on
//! (`--addon cluster-proxy`), whose ManagedClusterAddOn names a per-cluster
//! AddOnDeploymentConfig with that proxy. From a client in the hub namespace, both services are
//! reached by cluster name through either broker, and both add-ons are Available (a tunnel to
//! b1 and b2) with their configs applied. Deleting edge-1 then stops its add-on agent, removes
//! its credentials, and both brokers answer "unknown cluster" (404) for it.
//!
//! Needs root (network namespaces); skipped with a message otherwise.
//! Run: `cargo build -p addon-manager -p tetherctl -p registration-agent -p tunnel-agent -p tunnel-broker --bins && cargo test -p tether-e2e --test addon_netns`.

use tether_e2e::registration;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::Context;
use registration::*;
use tether_e2e::{OPS_TOKEN, command_in, netns};
use tether_test_support::{Child, Pki, bin, wait_until};

const WAIT: Duration = Duration::from_secs(40);

const E1_IP: &str = "10.79.1.1";
const P1_IP: &str = "10.79.1.2";
const E2_IP: &str = "10.79.3.1";
const P2_IP: &str = "10.79.3.2";
const PH_IP: &str = "10.79.2.1";
const H_IP: &str = "10.79.2.2";

/// hub ↔ proxy ↔ {edge1, edge2}; the proxy namespace does not forward. Removed on drop.
struct Topo {
    hub: String,
    proxy: String,
    e1: String,
    e2: String,
}

impl Topo {
    fn create() -> anyhow::Result<Self> {
        let tag = format!(
            "ta{}{}",
            std::process::id() % 10_000,
            rand::random::<u16>() % 100
        );
        let t = Self {
            hub: format!("{tag}h"),
            proxy: format!("{tag}p"),
            e1: format!("{tag}1"),
            e2: format!("{tag}2"),
        };
        netns::add(&[&t.hub, &t.proxy, &t.e1, &t.e2])?;
        let ifs: Vec<String> = ["a", "b", "c", "d", "e", "f"]
            .iter()
            .map(|i| format!("{tag}{i}"))
            .collect();
        netns::veth((&t.e1, &ifs[0], E1_IP), (&t.proxy, &ifs[1], P1_IP))?;
        netns::veth((&t.e2, &ifs[2], E2_IP), (&t.proxy, &ifs[3], P2_IP))?;
        netns::veth((&t.proxy, &ifs[4], PH_IP), (&t.hub, &ifs[5], H_IP))?;
        netns::route(&t.e1, "10.79.2.0/24", P1_IP)?;
        netns::route(&t.e2, "10.79.2.0/24", P2_IP)?;
        netns::route(&t.hub, "10.79.1.0/24", PH_IP)?;
        netns::route(&t.hub, "10.79.3.0/24", PH_IP)?;
        netns::no_forwarding(&t.proxy)?;
        Ok(t)
    }

    fn reaches(&self, ns: &str, ip_port: &str) -> bool {
        let (h, p) = ip_port.rsplit_once(':').unwrap_or((ip_port, "0"));
        Command::new("ip")
            .args(["netns", "exec", ns, "timeout", "2", "bash", "-c"])
            .arg(format!("exec 3<>/dev/tcp/{h}/{p}"))
            .stderr(std::process::Stdio::null())
            .status()
            .map(|s| s.success())
            .unwrap_or(false)
    }
}

impl Drop for Topo {
    fn drop(&mut self) {
        for ns in [&self.hub, &self.proxy, &self.e1, &self.e2] {
            let _ = Command::new("ip").args(["netns", "del", ns]).status();
        }
    }
}

/// squid in the proxy namespace on `listen:port`; HTTPS (own CA, returned) and/or basic auth.
fn squid(
    logs: &Path,
    ns: &str,
    name: &str,
    listen: &str,
    port: u16,
    tls: bool,
    auth: Option<(&str, &str)>,
) -> anyhow::Result<(Child, Option<String>, PathBuf)> {
    let dir = logs.join(format!("proxy-{name}"));
    std::fs::create_dir_all(&dir)?;
    let mut p = dir.clone();
    loop {
        use std::os::unix::fs::PermissionsExt;
        let _ = std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o777));
        if !p.pop() || p == Path::new("/tmp") || p == Path::new("/") {
            break;
        }
    }
    let mut conf = String::new();
    let mut ca_pem = None;
    if tls {
        let ca = tether_pki::HubCa::generate("squid-addon-test-ca", Duration::from_secs(3600))?;
        let (crt, key) = ca.issue_server(&[listen.to_string()], Duration::from_secs(3600))?;
        std::fs::write(dir.join("proxy.crt"), crt)?;
        std::fs::write(dir.join("proxy.key"), key)?;
        ca_pem = Some(ca.cert_pem().to_string());
        conf.push_str(&format!(
            "https_port {listen}:{port} tls-cert={} tls-key={}\n",
            dir.join("proxy.crt").display(),
            dir.join("proxy.key").display()
        ));
    } else {
        conf.push_str(&format!("http_port {listen}:{port}\n"));
    }
    std::fs::write(
        dir.join("hosts"),
        format!("{H_IP} hub.tether.test\n127.0.0.1 localhost\n"),
    )?;
    conf.push_str(&format!(
        "pid_filename {d}/squid.pid\ncache_log {d}/cache.log\naccess_log {d}/access.log\ncache deny all\ncoredump_dir {d}\nshutdown_lifetime 0 seconds\nhosts_file {d}/hosts\ndns_nameservers 127.0.0.1\nacl CONNECT method CONNECT\nacl SSL_ports port 1-65535\nacl Safe_ports port 1-65535\n",
        d = dir.display(),
    ));
    match auth {
        Some((user, password)) => {
            let o = Command::new("openssl")
                .args(["passwd", "-apr1", password])
                .output()?;
            let hash = String::from_utf8_lossy(&o.stdout).trim().to_string();
            std::fs::write(dir.join("passwd"), format!("{user}:{hash}\n"))?;
            conf.push_str(&format!(
                "auth_param basic program /usr/lib/squid/basic_ncsa_auth {}\nauth_param basic realm tether\nacl authed proxy_auth REQUIRED\nhttp_access allow CONNECT authed\nhttp_access deny all\n",
                dir.join("passwd").display()
            ));
        }
        None => conf.push_str("http_access allow CONNECT\nhttp_access deny all\n"),
    }
    std::fs::write(dir.join("squid.conf"), conf)?;
    for f in std::fs::read_dir(&dir)? {
        use std::os::unix::fs::PermissionsExt;
        let _ = std::fs::set_permissions(f?.path(), std::fs::Permissions::from_mode(0o666));
    }
    let mut c = command_in(Some(ns), "/usr/sbin/squid");
    c.args([
        "-N",
        "-n",
        &format!("tether{}", rand::random::<u32>()),
        "-f",
    ])
    .arg(dir.join("squid.conf"));
    Ok((Child::spawn(name, c, logs)?, ca_pem, dir))
}

fn addon(hub: &Hub, cluster: &str) -> Option<serde_json::Value> {
    hub.addon_json(cluster, "cluster-proxy")
}

fn cond(m: &serde_json::Value, t: &str) -> Option<(String, String)> {
    m["status"]["conditions"]
        .as_array()?
        .iter()
        .find(|c| c["type"] == t)
        .map(|c| {
            (
                c["status"].as_str().unwrap_or_default().to_string(),
                c["message"].as_str().unwrap_or_default().to_string(),
            )
        })
}

fn applied(m: &serde_json::Value) -> bool {
    m["status"]["configReferences"].as_array().is_some_and(|a| {
        !a.is_empty()
            && a.iter()
                .all(|r| r["desiredConfig"]["specHash"] == r["lastAppliedConfig"]["specHash"])
    })
}

/// curl in `ns` through `broker` (plain CONNECT listener) to `url`.
fn curl_via(ns: &str, broker: &str, url: &str) -> (bool, String) {
    let out = command_in(Some(ns), "curl")
        .args(["-s", "--max-time", "5", "-p", "--proxy"])
        .arg(format!("http://{broker}"))
        .args([
            "--proxy-header",
            &format!("Proxy-Authorization: Bearer {OPS_TOKEN}"),
            url,
        ])
        .output()
        .expect("run curl");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
    )
}

/// Kills the tunnel-agents left behind if the test fails half-way.
struct Reaper(Vec<PathBuf>);
impl Drop for Reaper {
    fn drop(&mut self) {
        for d in &self.0 {
            if let Some(pid) = std::fs::read_to_string(d.join("tunnel-agent.pid"))
                .ok()
                .and_then(|s| s.trim().parse::<i32>().ok())
            {
                let _ = nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(pid),
                    nix::sys::signal::Signal::SIGKILL,
                );
            }
        }
    }
}

fn web_service(logs: &Path, ns: &str, name: &str, text: &str) -> anyhow::Result<(Child, u16)> {
    let site = logs.join(format!("site-{name}"));
    std::fs::create_dir_all(&site)?;
    std::fs::write(site.join("index.html"), text)?;
    let port = 18000 + rand::random::<u16>() % 1000;
    let mut c = command_in(Some(ns), "python3");
    c.args([
        "-m",
        "http.server",
        "--bind",
        "127.0.0.1",
        &port.to_string(),
        "--directory",
    ])
    .arg(&site);
    Ok((Child::spawn(name, c, logs)?, port))
}

#[test]
fn addons_available_through_http_and_https_auth_proxies_reached_via_either_broker()
-> anyhow::Result<()> {
    if let Err(why) = can_use_netns() {
        eprintln!("SKIPPED addon_netns: network namespaces need root ({why})");
        return Ok(());
    }
    let topo = Topo::create()?;
    let hub = Hub::start(HubOpts {
        netns: Some(topo.hub.clone()),
        nats_listen: "0.0.0.0:4222".into(),
        ..Default::default()
    })?;
    for ns in [&topo.e1, &topo.e2] {
        assert!(
            !topo.reaches(ns, &format!("{H_IP}:4222")),
            "an edge reaches the hub without a proxy: the topology is broken"
        );
    }

    // Two brokers in the hub namespace, certificates from the hub CA, announcing themselves.
    let procs = {
        let dir = tempfile::tempdir()?;
        let pki_dir = dir.path().join("pki");
        std::fs::create_dir_all(&pki_dir)?;
        let cert = std::fs::read_to_string(hub.hub_dir.join("ca.crt"))?;
        let key = std::fs::read_to_string(hub.hub_dir.join("ca.key"))?;
        std::fs::write(pki_dir.join("ca.crt"), &cert)?;
        tether_e2e::Hub {
            dir,
            pki: Pki {
                dir: pki_dir,
                ca: tether_pki::HubCa::from_pem(&cert, &key)?,
            },
            env: vec![],
        }
    };
    let cp = format!(
        "control_plane:\n  nats_url: tls://127.0.0.1:4222\n  server_name: {}\n  ca: {}\n  password_file: {}\n  advertise:\n    server_name: tether-broker\n",
        hub.opts.hub_host,
        hub.hub_dir.join("ca.crt").display(),
        hub.hub_dir.join("hub-user.password").display(),
    );
    let b1 = procs.start_broker_at("b1", &cp, Some(&topo.hub), H_IP)?;
    let b2 = procs.start_broker_at("b2", &cp, Some(&topo.hub), H_IP)?;

    // Proxies: HTTP for edge-1, HTTPS with basic auth for edge-2.
    let (_sq1, _, sq1_dir) = squid(
        &hub.logs,
        &topo.proxy,
        "squid-http",
        P1_IP,
        3128,
        false,
        None,
    )?;
    let (_sq2, ca2, sq2_dir) = squid(
        &hub.logs,
        &topo.proxy,
        "squid-https-auth",
        P2_IP,
        3129,
        true,
        Some(("edge", "p@ss:word")),
    )?;
    let ca2 = ca2.context("https proxy CA")?;
    wait_until(START_TIMEOUT, "squid (http) from edge-1", || {
        topo.reaches(&topo.e1, &format!("{P1_IP}:3128"))
            .then_some(())
    })?;
    wait_until(START_TIMEOUT, "squid (https) from edge-2", || {
        topo.reaches(&topo.e2, &format!("{P2_IP}:3129"))
            .then_some(())
    })?;
    let url1 = format!("http://{P1_IP}:3128");
    let url2 = format!("https://edge:p%40ss%3Aword@{P2_IP}:3129");
    let ca2_file = hub.dir.join("squid2-ca.crt");
    std::fs::write(&ca2_file, &ca2)?;

    // Add-on resources: Manual install; each cluster's add-on names its own ADC.
    let indent = |pem: &str| {
        pem.lines()
            .map(|l| format!("      {l}"))
            .collect::<Vec<_>>()
            .join("\n")
    };
    let docs = format!(
        r#"
apiVersion: addon.open-cluster-management.io/v1alpha1
kind: ClusterManagementAddOn
metadata: {{name: cluster-proxy}}
spec:
  installStrategy: {{type: Manual}}
  defaultConfigs:
    - {{group: proxy.open-cluster-management.io, resource: managedproxyconfigurations, name: cluster-proxy}}
---
apiVersion: proxy.open-cluster-management.io/v1alpha1
kind: ManagedProxyConfiguration
metadata: {{name: cluster-proxy}}
spec:
  authentication: {{signer: {{type: SelfSigned}}}}
  proxyServer:
    replicas: 2
    entrypoints: [{{host: broker.invalid}}]
  proxyAgent: {{replicas: 1, keepalive: 5s}}
---
apiVersion: addon.open-cluster-management.io/v1alpha1
kind: AddOnDeploymentConfig
metadata: {{name: proxy-http, namespace: default}}
spec:
  proxyConfig:
    httpsProxy: {url1}
---
apiVersion: addon.open-cluster-management.io/v1alpha1
kind: AddOnDeploymentConfig
metadata: {{name: proxy-https-auth, namespace: default}}
spec:
  proxyConfig:
    httpsProxy: "{url2}"
    caBundle: |
{ca}
---
apiVersion: addon.open-cluster-management.io/v1alpha1
kind: ManagedClusterAddOn
metadata: {{name: cluster-proxy, namespace: edge-1}}
spec:
  configs:
    - {{group: addon.open-cluster-management.io, resource: addondeploymentconfigs, namespace: default, name: proxy-http}}
---
apiVersion: addon.open-cluster-management.io/v1alpha1
kind: ManagedClusterAddOn
metadata: {{name: cluster-proxy, namespace: edge-2}}
spec:
  configs:
    - {{group: addon.open-cluster-management.io, resource: addondeploymentconfigs, namespace: default, name: proxy-https-auth}}
"#,
        ca = indent(&ca2)
    );
    let f = hub.dir.join("addons.yaml");
    std::fs::write(&f, docs)?;

    // Services only reachable inside each cluster's namespace.
    let (_w1, port1) = web_service(&hub.logs, &topo.e1, "web-1", "hello from edge-1\n")?;
    let (_w2, port2) = web_service(&hub.logs, &topo.e2, "web-2", "hello from edge-2\n")?;

    // Join through the proxies, with the add-on component on.
    let server = format!("tls://{}:4222", hub.opts.hub_host);
    let mut agents = Vec::new();
    let mut runtime_dirs = Vec::new();
    let started = Instant::now();
    for (name, ns, url, ca, port) in [
        ("edge-1", &topo.e1, &url1, None, port1),
        ("edge-2", &topo.e2, &url2, Some(ca2_file.as_path()), port2),
    ] {
        let boot = hub.dir.join(format!("{name}.kubeconfig"));
        hub.join(&boot, &server, &hub.token, Some(url), ca)?;
        let base = hub.dir.join(name);
        runtime_dirs.push(base.join("cluster-proxy-agent"));
        let mut c = command_in(Some(ns), bin("registration-agent")?);
        c.args(["--cluster-name", name])
            .arg("--bootstrap-kubeconfig")
            .arg(&boot)
            .arg("--hub-kubeconfig-dir")
            .arg(base.join("hub-kubeconfig"))
            .args(["--check-interval", "200ms", "--addon", "cluster-proxy"])
            .args(["--addon-apiserver", &format!("127.0.0.1:{port}")])
            .args(["--addon-lease-seconds", "2", "--addon-resync", "10s"])
            .env("RUST_LOG", "info,async_nats=warn");
        agents.push(Child::spawn(name, c, &hub.logs)?);
    }
    let _reaper = Reaper(runtime_dirs);
    for name in ["edge-1", "edge-2"] {
        wait_until(WAIT, &format!("{name} asks to join"), || hub.cluster(name))?;
        hub.tetherctl_ok(&["accept", name])?;
    }
    for name in ["edge-1", "edge-2"] {
        hub.wait_condition(name, "ManagedClusterConditionAvailable", "True", WAIT)?;
    }
    hub.tetherctl_ok(&["apply", "-f", &f.to_string_lossy()])?;

    for name in ["edge-1", "edge-2"] {
        let m = wait_until(
            WAIT,
            &format!("{name} add-on Available via b1 and b2"),
            || {
                addon(&hub, name).filter(|m| {
                    applied(m)
                        && cond(m, "Available").is_some_and(|(s, msg)| {
                            s == "True" && msg.contains("b1") && msg.contains("b2")
                        })
                        && cond(m, "Progressing").is_some_and(|(s, _)| s == "False")
                })
            },
        )
        .with_context(|| {
            format!(
                "{name}: {:#}\nagent log:\n{}\naddon-manager log:\n{}",
                addon(&hub, name).unwrap_or_default(),
                tail(&read_log(&hub.logs, name), 30),
                tail(&read_log(&hub.logs, "addon-manager"), 15)
            )
        })?;
        let refs = m["status"]["configReferences"].to_string();
        let want = if name == "edge-1" {
            "proxy-http"
        } else {
            "proxy-https-auth"
        };
        assert!(refs.contains(want), "{name}: {refs}");
        eprintln!(
            "{name}: start -> add-on Available through both brokers: {:?}",
            started.elapsed()
        );
    }

    // Both services, by cluster name, through either broker, from the hub namespace.
    for (cluster, port, text) in [
        ("edge-1", port1, "hello from edge-1"),
        ("edge-2", port2, "hello from edge-2"),
    ] {
        for b in [&b1, &b2] {
            let url = format!("http://127.0.0.1.{cluster}.tether:{port}/");
            let (ok, body) = curl_via(&topo.hub, &b.client_addr.to_string(), &url);
            assert!(ok && body.contains(text), "{cluster} via {}: {body}", b.id);
            // The API-server shorthand goes to the same service here.
            let (ok, body) = curl_via(
                &topo.hub,
                &b.client_addr.to_string(),
                &format!("http://{cluster}:443/"),
            );
            assert!(
                ok && body.contains(text),
                "{cluster}:443 via {}: {body}",
                b.id
            );
        }
        // Nothing outside the cluster's namespace reaches it directly.
        let edge_ip = if cluster == "edge-1" { E1_IP } else { E2_IP };
        assert!(!topo.reaches(&topo.hub, &format!("{edge_ip}:{port}")));
    }

    // The edges cannot reach the brokers except through their proxy (squid logs a CONNECT only
    // when it ends, so the topology is the proof): every tunnel above crossed a proxy, and
    // edge-2's authenticated to it over TLS.
    for ns in [&topo.e1, &topo.e2] {
        for b in [&b1, &b2] {
            assert!(!topo.reaches(ns, &b.agent_addr.to_string()));
        }
    }
    let _ = (&sq1_dir, &sq2_dir);

    // Deleting edge-1: its add-on, credentials and tunnel-agent go; clients get "unknown
    // cluster" from either broker; edge-2 is untouched.
    let e1_pid: i32 =
        std::fs::read_to_string(hub.dir.join("edge-1/cluster-proxy-agent/tunnel-agent.pid"))?
            .trim()
            .parse()?;
    hub.tetherctl_ok(&["delete", "cluster", "edge-1"])?;
    wait_until(
        WAIT,
        "edge-1's add-on agent stopped and its credentials removed",
        || {
            let alive = std::fs::read_to_string(format!("/proc/{e1_pid}/stat"))
                .is_ok_and(|s| s.split_whitespace().nth(2) != Some("Z"));
            (!alive && !hub.dir.join("edge-1/cluster-proxy-hub-kubeconfig").exists()).then_some(())
        },
    )
    .with_context(|| tail(&read_log(&hub.logs, "edge-1"), 20))?;
    for b in [&b1, &b2] {
        let body = wait_until(WAIT, "unknown cluster answer", || {
            let out = command_in(Some(&topo.hub), "curl")
                .args(["-s", "--max-time", "5", "-p", "--proxy"])
                .arg(format!("http://{}", b.client_addr))
                .args([
                    "--proxy-header",
                    &format!("Proxy-Authorization: Bearer {OPS_TOKEN}"),
                    "-w",
                    "%{http_connect}",
                    "http://edge-1:443/",
                ])
                .output()
                .ok()?;
            let text = String::from_utf8_lossy(&out.stdout).into_owned();
            text.contains("404").then_some(text)
        })?;
        eprintln!("edge-1 deleted, via {}: {body}", b.id);
        let (ok, body) = curl_via(
            &topo.hub,
            &b.client_addr.to_string(),
            &format!("http://127.0.0.1.edge-2.tether:{port2}/"),
        );
        assert!(
            ok && body.contains("hello from edge-2"),
            "edge-2 via {}: {body}",
            b.id
        );
    }
    assert!(addon(&hub, "edge-2").is_some());
    drop(agents);
    Ok(())
}
