//! Delivering the cluster-proxy add-on end to end: real nats-server, addon-manager, tetherctl,
//! tunnel-broker, registration-agent (`--addon cluster-proxy`) supervising a real tunnel-agent,
//! real tinyproxy forward proxies.
//!
//! - a cluster joins through a proxy and is accepted; the add-on is installed; its credentials
//!   (`cluster-proxy-hub-kubeconfig/`) are written with server, CA and proxy-url inherited from
//!   the hub kubeconfig and OCM's add-on subject;
//! - the tunnel-agent runs, reaches the broker through the AddOnDeploymentConfig's proxy, and a
//!   hub client reaches the cluster's API server through the broker;
//! - the add-on is Available (a tunnel to every live broker) with its configs applied;
//! - changing the AddOnDeploymentConfig's proxy: Progressing=True, then Available again with
//!   the new hash applied, and the tunnels now go through the new proxy;
//! - removing the add-on stops the tunnel-agent and removes its credentials; deleting the
//!   cluster does the same, and clients get an error for it.
//!
//! Run: `cargo build -p addon-manager -p tetherctl -p registration-agent -p tunnel-agent -p tunnel-broker --bins && cargo test -p tether-e2e --test addon_delivery`.

use tether_e2e::registration;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::Context;
use registration::*;
use tether_e2e::addons::ClusterProxyAddOn;
use tether_test_support::{Child, Pki, bin, wait_until};

const WAIT: Duration = Duration::from_secs(30);

fn addons_yaml(adc_proxy: &str) -> String {
    ClusterProxyAddOn {
        https_proxy: Some(adc_proxy),
        ..Default::default()
    }
    .yaml()
}

fn addon(hub: &Hub, cluster: &str) -> Option<serde_json::Value> {
    hub.addon_json(cluster, "cluster-proxy")
}

fn cond(m: &serde_json::Value, t: &str) -> Option<(String, String, String)> {
    m["status"]["conditions"]
        .as_array()?
        .iter()
        .find(|c| c["type"] == t)
        .map(|c| {
            (
                c["status"].as_str().unwrap_or_default().to_string(),
                c["reason"].as_str().unwrap_or_default().to_string(),
                c["message"].as_str().unwrap_or_default().to_string(),
            )
        })
}

fn status(m: &serde_json::Value, t: &str) -> String {
    cond(m, t).map(|c| c.0).unwrap_or_default()
}

fn adc_hashes(m: &serde_json::Value) -> (String, String) {
    let r = m["status"]["configReferences"]
        .as_array()
        .and_then(|a| a.iter().find(|r| r["resource"] == "addondeploymentconfigs"))
        .cloned()
        .unwrap_or_default();
    (
        r["desiredConfig"]["specHash"]
            .as_str()
            .unwrap_or_default()
            .into(),
        r["lastAppliedConfig"]["specHash"]
            .as_str()
            .unwrap_or_default()
            .into(),
    )
}

fn wait_addon(
    hub: &Hub,
    cluster: &str,
    what: &str,
    f: impl Fn(&serde_json::Value) -> bool,
) -> anyhow::Result<serde_json::Value> {
    wait_until(WAIT, what, || addon(hub, cluster).filter(|m| f(m))).with_context(|| {
        format!(
            "add-on now: {:#}\naddon-manager log:\n{}\nagent log:\n{}",
            addon(hub, cluster).unwrap_or_default(),
            tail(&read_log(&hub.logs, "addon-manager"), 15),
            tail(&read_log(&hub.logs, "agent"), 25)
        )
    })
}

fn available(m: &serde_json::Value) -> bool {
    status(m, "Available") == "True" && status(m, "Progressing") == "False"
}

/// The `control_plane` section of a broker config: the broker announces itself (and the
/// clusters it holds tunnels of) in `tether-brokers` through the hub's NATS.
fn control_plane_yaml(hub: &Hub) -> String {
    format!(
        "control_plane:\n  nats_url: {}\n  server_name: {}\n  ca: {}\n  password_file: {}\n  advertise:\n    server_name: tether-broker\n",
        hub.nats_url(),
        hub.opts.hub_host,
        hub.hub_dir.join("ca.crt").display(),
        hub.hub_dir.join("hub-user.password").display(),
    )
}

/// The registration hub's CA as a test PKI, so brokers and the fake API server chain to the
/// CA the add-on credentials are signed by.
fn hub_pki(hub: &Hub) -> anyhow::Result<tether_e2e::Hub> {
    let dir = tempfile::tempdir()?;
    let pki_dir = dir.path().join("pki");
    std::fs::create_dir_all(&pki_dir)?;
    let cert = std::fs::read_to_string(hub.hub_dir.join("ca.crt"))?;
    let key = std::fs::read_to_string(hub.hub_dir.join("ca.key"))?;
    std::fs::write(pki_dir.join("ca.crt"), &cert)?;
    let ca = tether_pki::HubCa::from_pem(&cert, &key)?;
    Ok(tether_e2e::Hub {
        dir,
        pki: Pki { dir: pki_dir, ca },
        env: vec![],
    })
}

fn start_registration_agent(
    hub: &Hub,
    cluster: &str,
    boot: &Path,
    creds: &Path,
    apiserver: &str,
) -> anyhow::Result<Child> {
    let mut c = Command::new(bin("registration-agent")?);
    c.args(["--cluster-name", cluster])
        .arg("--bootstrap-kubeconfig")
        .arg(boot)
        .arg("--hub-kubeconfig-dir")
        .arg(creds)
        .args(["--check-interval", "200ms"])
        .args(["--addon", "cluster-proxy"])
        .args(["--addon-apiserver", apiserver])
        .args(["--addon-lease-seconds", "2"])
        .args(["--addon-resync", "10s"])
        .env("RUST_LOG", "info,async_nats=warn");
    Child::spawn("agent", c, &hub.logs)
}

fn pid_alive(pid: i32) -> bool {
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), None).is_ok()
        && !std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .is_ok_and(|s| s.split_whitespace().nth(2) == Some("Z"))
}

fn tunnel_agent_pid(runtime_dir: &Path) -> Option<i32> {
    std::fs::read_to_string(runtime_dir.join("tunnel-agent.pid"))
        .ok()?
        .trim()
        .parse()
        .ok()
}

/// Kills a tunnel-agent left behind if the test fails half-way.
struct Reaper(PathBuf);
impl Drop for Reaper {
    fn drop(&mut self) {
        if let Some(pid) = tunnel_agent_pid(&self.0) {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
    }
}

/// CONNECT `<cluster>:443` through the broker, TLS to the API server, `GET /livez`.
async fn reach_apiserver(
    broker: &tether_e2e::Broker,
    cluster: &str,
    ca: &Path,
) -> anyhow::Result<String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let s = match tether_e2e::connect(
        broker.client_addr,
        &format!("{cluster}:443"),
        Some(tether_e2e::OPS_TOKEN),
    )
    .await?
    {
        Ok(s) => s,
        Err((code, body)) => anyhow::bail!("CONNECT answered {code}: {body}"),
    };
    let cfg = tether_e2e::client_tls_config(ca, &[b"http/1.1"], None)?;
    let name = rustls::pki_types::ServerName::try_from("kubernetes.default.svc")?;
    let mut tls = tokio::time::timeout(
        Duration::from_secs(10),
        tokio_rustls::TlsConnector::from(std::sync::Arc::new(cfg)).connect(name, s),
    )
    .await??;
    tls.write_all(b"GET /livez HTTP/1.1\r\nhost: kubernetes.default.svc\r\n\r\n")
        .await?;
    let mut buf = vec![0u8; 1024];
    let n = tokio::time::timeout(Duration::from_secs(10), tls.read(&mut buf)).await??;
    Ok(String::from_utf8_lossy(&buf[..n]).into_owned())
}

/// CONNECT lines a tinyproxy logged for `target`.
fn proxy_connects(hub: &Hub, proxy: &str, target: &str) -> usize {
    read_log(&hub.logs, proxy)
        .lines()
        .filter(|l| l.contains("CONNECT") && l.contains(target))
        .count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn addon_is_delivered_through_a_proxy_and_follows_its_config() -> anyhow::Result<()> {
    let hub = Hub::start(HubOpts::default())?;
    let tpki = hub_pki(&hub)?;
    let broker = tpki.start_broker("b1", &control_plane_yaml(&hub))?;
    let api = tether_e2e::apiserver::FakeApiServer::start(&tpki).await?;

    // Three proxies: registration (bootstrap kubeconfig), then the ADC's first and second.
    let reg_proxy = loopback_tinyproxy(&hub.logs, "proxy-reg")?;
    let p1 = loopback_tinyproxy(&hub.logs, "proxy-1")?;
    let p2 = loopback_tinyproxy(&hub.logs, "proxy-2")?;
    let f = hub.dir.join("addons.yaml");
    std::fs::write(&f, addons_yaml(&p1.url()))?;
    hub.tetherctl_ok(&["apply", "-f", &f.to_string_lossy()])?;

    let boot = hub.dir.join("bootstrap.kubeconfig");
    hub.join(
        &boot,
        &hub.server_url(),
        &hub.token,
        Some(&reg_proxy.url()),
        None,
    )?;
    let base = hub.dir.join("edge");
    let creds = base.join("hub-kubeconfig");
    let addon_creds = base.join("cluster-proxy-hub-kubeconfig");
    let runtime_dir = base.join("cluster-proxy-agent");
    let _reaper = Reaper(runtime_dir.clone());
    let mut agent = start_registration_agent(&hub, "edge-1", &boot, &creds, &api.addr.to_string())?;
    wait_until(WAIT, "edge-1 to ask to join", || hub.cluster("edge-1"))?;

    // Accept: from here to Available is the add-on's delivery time.
    let accepted = Instant::now();
    hub.tetherctl_ok(&["accept", "edge-1"])?;
    let m = wait_addon(
        &hub,
        "edge-1",
        "add-on Available with its configs applied",
        available,
    )?;
    let to_available = accepted.elapsed();
    eprintln!("accept -> add-on Available: {to_available:?}");
    let (_, _, msg) = cond(&m, "Available").unwrap();
    assert!(msg.contains("b1"), "{msg}");
    let (desired, applied) = adc_hashes(&m);
    assert_eq!(desired, applied);
    assert_eq!(desired.len(), 64);

    // Credentials: the four keys; the kubeconfig inherits server, CA and proxy-url.
    for k in ["kubeconfig", "tls.crt", "tls.key", "cluster-name"] {
        assert!(addon_creds.join(k).is_file(), "{k} missing");
    }
    assert_eq!(
        std::fs::read_to_string(addon_creds.join("cluster-name"))?.trim(),
        "edge-1"
    );
    let hub_ep = tether_control::kubeconfig::read_hub_endpoint(&creds.join("kubeconfig"))?;
    let addon_ep = tether_control::kubeconfig::read_hub_endpoint(&addon_creds.join("kubeconfig"))?;
    assert!(addon_ep.same_hub(&hub_ep), "{addon_ep:?} vs {hub_ep:?}");
    assert!(addon_ep.proxy.is_some() && addon_ep.proxy == hub_ep.proxy);
    let info =
        tether_pki::CertInfo::from_pem(&std::fs::read_to_string(addon_creds.join("tls.crt"))?)?;
    assert!(
        info.common_name.starts_with(
            "system:open-cluster-management:cluster:edge-1:addon:cluster-proxy:agent:"
        ),
        "{}",
        info.common_name
    );
    use std::os::unix::fs::PermissionsExt;
    assert_eq!(
        std::fs::metadata(addon_creds.join("tls.key"))?
            .permissions()
            .mode()
            & 0o777,
        0o600
    );

    // A hub client reaches the cluster's API server through the broker; the tunnel went
    // through the ADC's proxy (not the registration proxy).
    let body = reach_apiserver(&broker, "edge-1", &tpki.pki.dir.join("ca.crt")).await?;
    assert!(body.starts_with("HTTP/1.1 200"), "{body}");
    let target = broker.agent_addr.to_string();
    assert!(proxy_connects(&hub, "proxy-1", &target) >= 1);
    assert_eq!(proxy_connects(&hub, "proxy-reg", &target), 0);
    assert_eq!(proxy_connects(&hub, "proxy-2", &target), 0);
    let pid = tunnel_agent_pid(&runtime_dir).context("tunnel-agent pid file")?;
    // The supervised tunnel-agent runs with the data-plane glibc tunable.
    let environ = std::fs::read(format!("/proc/{pid}/environ"))?;
    let tunables = environ
        .split(|b| *b == 0)
        .find_map(|kv| kv.strip_prefix(b"GLIBC_TUNABLES="))
        .map(|v| String::from_utf8_lossy(v).into_owned());
    assert!(
        tunables
            .as_deref()
            .is_some_and(|t| t.contains(tether_runtime::GLIBC_TUNABLES_DATA_PLANE)),
        "tunnel-agent GLIBC_TUNABLES: {tunables:?}"
    );

    // The registration-agent restarts: its tunnel-agent stops with it and comes back with the
    // same credentials (kept across restarts, no new CSR).
    let serial = || {
        std::fs::read_to_string(addon_creds.join("tls.crt"))
            .ok()
            .and_then(|p| tether_pki::CertInfo::from_pem(&p).ok())
            .map(|i| i.serial_hex)
    };
    let serial0 = serial().context("add-on certificate")?;
    agent.terminate();
    agent.wait_exit(Duration::from_secs(10))?;
    assert!(
        !pid_alive(pid),
        "tunnel-agent outlived its registration-agent"
    );
    let agent = start_registration_agent(&hub, "edge-1", &boot, &creds, &api.addr.to_string())?;
    let pid = wait_until(WAIT, "tunnel-agent back after the restart", || {
        tunnel_agent_pid(&runtime_dir).filter(|p| *p != pid && pid_alive(*p))
    })?;
    tether_test_support::wait_until_async(WAIT, "API server reachable again", || async {
        reach_apiserver(&broker, "edge-1", &tpki.pki.dir.join("ca.crt"))
            .await
            .ok()
            .filter(|b| b.starts_with("HTTP/1.1 200"))
    })
    .await?;
    assert_eq!(
        serial(),
        Some(serial0),
        "new add-on certificate after a restart"
    );

    // The tunnel-agent crashes: its supervisor starts it again (jittered backoff).
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid),
        nix::sys::signal::Signal::SIGKILL,
    )?;
    let pid = wait_until(WAIT, "tunnel-agent restarted after a crash", || {
        tunnel_agent_pid(&runtime_dir).filter(|p| *p != pid && pid_alive(*p))
    })?;
    tether_test_support::wait_until_async(WAIT, "API server reachable after the crash", || async {
        reach_apiserver(&broker, "edge-1", &tpki.pki.dir.join("ca.crt"))
            .await
            .ok()
            .filter(|b| b.starts_with("HTTP/1.1 200"))
    })
    .await?;

    // New proxy: Progressing until the agent applies it, then Available; new tunnels use it.
    std::fs::write(&f, addons_yaml(&p2.url()))?;
    hub.tetherctl_ok(&["apply", "-f", &f.to_string_lossy()])?;
    let changed = Instant::now();
    let m = wait_addon(&hub, "edge-1", "new ADC hash applied and Available", |m| {
        let (d, a) = adc_hashes(m);
        d != desired && d == a && available(m)
    })?;
    eprintln!(
        "ADC change -> applied and Available: {:?}",
        changed.elapsed()
    );
    assert_eq!(status(&m, "Available"), "True");
    let events = hub.tetherctl_ok(&["get", "events", "edge-1.cluster-proxy"])?;
    assert!(
        events.contains("AddOnConfigChanged") && events.contains("Progressing=True"),
        "{events}"
    );
    wait_until(WAIT, "a tunnel through the new proxy", || {
        (proxy_connects(&hub, "proxy-2", &target) >= 1).then_some(())
    })?;
    let body = reach_apiserver(&broker, "edge-1", &tpki.pki.dir.join("ca.crt")).await?;
    assert!(body.starts_with("HTTP/1.1 200"), "{body}");
    // The same process reloaded its config: no restart.
    assert_eq!(tunnel_agent_pid(&runtime_dir), Some(pid));

    // A second broker announces itself: the agent gets a tunnel to it too (notify → config →
    // reload), and Available names both.
    let broker2 = tpki.start_broker("b2", &control_plane_yaml(&hub))?;
    wait_addon(&hub, "edge-1", "Available through b1 and b2", |m| {
        cond(m, "Available").is_some_and(|(s, _, msg)| s == "True" && msg.contains("b2"))
    })?;
    let body = reach_apiserver(&broker2, "edge-1", &tpki.pki.dir.join("ca.crt")).await?;
    assert!(body.starts_with("HTTP/1.1 200"), "{body}");
    assert_eq!(tunnel_agent_pid(&runtime_dir), Some(pid));
    // The ManagedProxyConfiguration counts the live brokers.
    let mpc_cond = || -> Option<(String, String)> {
        let v: serde_json::Value =
            serde_json::from_str(&hub.tetherctl_ok(&["get", "configs", "-o", "json"]).ok()?)
                .ok()?;
        let mpc = v["items"]
            .as_array()?
            .iter()
            .find(|i| i["kind"] == "ManagedProxyConfiguration")?
            .clone();
        cond(&mpc, "BrokersAvailable").map(|(s, _, m)| (s, m))
    };
    let (st, msg) = wait_until(WAIT, "BrokersAvailable with 2 brokers", || {
        mpc_cond().filter(|(_, m)| m.starts_with("2 live"))
    })?;
    assert_eq!(st, "True");
    assert!(msg.contains("b1, b2"), "{msg}");

    // Removing the add-on (its ClusterManagementAddOn): agent stopped, credentials removed.
    hub.tetherctl_ok(&["delete", "clustermanagementaddon", "cluster-proxy"])?;
    wait_until(WAIT, "tunnel-agent stopped and credentials removed", || {
        (!pid_alive(pid) && !addon_creds.exists() && !runtime_dir.exists()).then_some(())
    })
    .with_context(|| tail(&read_log(&hub.logs, "agent"), 20))?;

    // Back again, then the cluster is deleted: the same clean-up, and clients get an error.
    hub.tetherctl_ok(&["apply", "-f", &f.to_string_lossy()])?;
    wait_addon(&hub, "edge-1", "add-on back and Available", available)?;
    let pid = tunnel_agent_pid(&runtime_dir).context("tunnel-agent pid file")?;
    hub.tetherctl_ok(&["delete", "cluster", "edge-1"])?;
    let deleted = std::time::Instant::now();
    wait_until(
        WAIT,
        "cluster deleted: tunnel-agent stopped, credentials removed",
        || (!pid_alive(pid) && !addon_creds.exists()).then_some(()),
    )
    .with_context(|| tail(&read_log(&hub.logs, "agent"), 20))?;
    eprintln!(
        "cluster deleted -> tunnel-agent stopped, credentials removed: {:?}",
        deleted.elapsed()
    );
    let r = tether_e2e::connect(
        broker.client_addr,
        "edge-1:443",
        Some(tether_e2e::OPS_TOKEN),
    )
    .await?;
    match r {
        Ok(_) => anyhow::bail!("CONNECT to a deleted cluster succeeded"),
        Err((code, body)) => eprintln!(
            "deleted cluster: {code} {}",
            body.lines().next().unwrap_or("")
        ),
    }
    drop(agent);
    Ok(())
}

/// `/debug/agent` of a tunnel-agent.
async fn debug_agent(admin: std::net::SocketAddr) -> Option<serde_json::Value> {
    let (code, body) = tether_e2e::admin_get(admin, "/debug/agent").await.ok()?;
    (code == 200).then(|| serde_json::from_str(&body).ok())?
}

fn connected(v: &serde_json::Value) -> Vec<String> {
    v["connectedBrokers"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|x| x.as_str().map(str::to_string))
                .collect()
        })
        .unwrap_or_default()
}

/// A static tunnel-agent config for cluster `c1` listing `brokers`, with `extra` lines.
fn agent_config(
    tls: &tether_test_support::LeafFiles,
    apiserver: &impl std::fmt::Display,
    extra: &str,
    brokers: &[&tether_e2e::Broker],
) -> String {
    let endpoints: Vec<Endpoint> = brokers
        .iter()
        .map(|b| Endpoint {
            name: b.id.clone(),
            address: b.agent_addr.to_string(),
            server_name: "tether-broker",
        })
        .collect();
    agent_config_endpoints(tls, apiserver, extra, &endpoints)
}

/// One `brokers[]` entry of a tunnel-agent config.
struct Endpoint {
    name: String,
    address: String,
    server_name: &'static str,
}

/// [`agent_config`] with the endpoints spelled out.
fn agent_config_endpoints(
    tls: &tether_test_support::LeafFiles,
    apiserver: &impl std::fmt::Display,
    extra: &str,
    brokers: &[Endpoint],
) -> String {
    let mut s = format!(
        "cluster: c1\nagent: agent-0\ntls:\n  cert: {}\n  key: {}\n  ca: {}\napiserver: '{apiserver}'\nadmin_listen: 127.0.0.1:0\n{extra}backoff:\n  initial: 50ms\n  max: 1s\n  reset_after: 5s\nproxy: {{}}\nbrokers:\n",
        tls.cert.display(),
        tls.key.display(),
        tls.ca.display()
    );
    for b in brokers {
        s.push_str(&format!(
            "  - name: {}\n    addresses: ['{}']\n    server_name: {}\n",
            b.name, b.address, b.server_name
        ));
    }
    if brokers.is_empty() {
        s.push_str("  []\n");
    }
    s
}

/// A tunnel-agent `name` run from config file `cfg` (written with `yaml` first, so a test can
/// rewrite it to reload); the process and its admin address (from its ready file).
fn start_agent_with_config(
    procs: &tether_e2e::Hub,
    name: &str,
    cfg: &Path,
    yaml: &str,
) -> anyhow::Result<(Child, std::net::SocketAddr)> {
    let ready = procs.path().join(format!("{name}.ready"));
    std::fs::write(cfg, yaml)?;
    let mut cmd = Command::new(bin("tunnel-agent")?);
    cmd.arg("--config").arg(cfg).arg("--ready-file").arg(&ready);
    let agent = Child::spawn(name, cmd, procs.path())?;
    let r = tether_test_support::read_ready_file(&ready, START_TIMEOUT)?;
    let admin = r["admin"].as_str().context("admin")?.parse()?;
    Ok((agent, admin))
}

/// Waits until the agent's `/debug` state at `admin` satisfies `f`; that state.
async fn wait_debug(
    admin: std::net::SocketAddr,
    what: &'static str,
    f: fn(&serde_json::Value) -> bool,
) -> anyhow::Result<serde_json::Value> {
    tether_test_support::wait_until_async(WAIT, what, || async {
        debug_agent(admin).await.filter(f)
    })
    .await
}

/// What the tunnel-agent reload tests start from: a hub with brokers `b1` and `b2`, an echo
/// server as the API server, and the certificate of agent `agent-0` of cluster `c1`.
struct TwoBrokers {
    procs: tether_e2e::Hub,
    b1: tether_e2e::Broker,
    b2: tether_e2e::Broker,
    echo: std::net::SocketAddr,
    tls: tether_test_support::LeafFiles,
}

impl TwoBrokers {
    /// `name` names the agent's certificate files.
    async fn start(name: &str) -> anyhow::Result<Self> {
        let procs = tether_e2e::Hub::new()?;
        let b1 = procs.start_broker("b1", "")?;
        let b2 = procs.start_broker("b2", "")?;
        let echo = tether_e2e::echo_server().await?;
        let tls = procs.pki.issue(
            name,
            tether_tls::Identity::tunnel_agent("c1", "agent-0"),
            &[],
        )?;
        Ok(Self {
            procs,
            b1,
            b2,
            echo,
            tls,
        })
    }
}

/// The tunnel-agent's config reload on its own: brokers added and removed without touching
/// the others, an invalid file refused with the field named while the old config keeps running.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tunnel_agent_reloads_brokers_and_refuses_an_invalid_config() -> anyhow::Result<()> {
    let TwoBrokers {
        procs,
        b1,
        b2,
        echo,
        tls,
    } = TwoBrokers::start("reload-agent").await?;
    let render = |brokers: &[&tether_e2e::Broker]| agent_config(&tls, &echo, "", brokers);
    let cfg = procs.path().join("reload-agent.yaml");
    let (_agent, admin) = start_agent_with_config(&procs, "reload-agent", &cfg, &render(&[&b1]))?;
    let wait_for =
        |what: &'static str, f: fn(&serde_json::Value) -> bool| wait_debug(admin, what, f);
    wait_for("tunnel to b1", |v| connected(v) == ["b1"]).await?;
    let connects = |ep: &'static str| async move {
        tether_e2e::metric(
            admin,
            "tether_agent_tunnel_connects_total",
            &[("endpoint", ep), ("result", "ok")],
        )
        .await
    };
    assert_eq!(connects("b1").await?, 1.0);

    // b2 added: a second tunnel; b1's is untouched.
    std::fs::write(&cfg, render(&[&b1, &b2]))?;
    let v = wait_for("tunnels to b1 and b2", |v| connected(v) == ["b1", "b2"]).await?;
    assert_eq!(v["configGeneration"], 2);
    assert_eq!(connects("b1").await?, 1.0);

    // Invalid: refused, the field named, both tunnels still up.
    std::fs::write(&cfg, render(&[]))?;
    let v = wait_for("the invalid config refused", |v| {
        v["configError"]
            .as_str()
            .is_some_and(|e| e.contains("brokers"))
    })
    .await?;
    assert_eq!(connected(&v), ["b1", "b2"]);
    assert_eq!(
        tether_e2e::metric(admin, "tether_agent_config_invalid", &[]).await?,
        1.0
    );

    // b1 removed: its tunnel goes, b2's is untouched.
    std::fs::write(&cfg, render(&[&b2]))?;
    let v = wait_for("only b2", |v| {
        connected(v) == ["b2"] && v["configError"].is_null()
    })
    .await?;
    assert_eq!(v["configGeneration"], 3);
    assert_eq!(connects("b2").await?, 1.0);
    tether_e2e::wait_tunnel(&b2, "c1").await?;
    let s = tether_e2e::connect(b1.client_addr, "c1:443", Some(tether_e2e::OPS_TOKEN)).await?;
    assert!(s.is_err(), "b1 still has a tunnel for c1");
    Ok(())
}

/// The config the agent reports as running is the one it parsed. A file rewritten between the
/// agent's read at start and its first check is applied at that check. (CI once lost this race:
/// the registration-agent's rewrite with the serving broker landed while the tunnel-agent
/// started, `/debug/agent` hashed the new file, and the agent dialled the old endpoint for good.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tunnel_agent_applies_a_config_rewritten_while_it_starts() -> anyhow::Result<()> {
    let t = TwoBrokers::start("race-agent").await?;
    let cfg = t.procs.path().join("race-agent.yaml");
    std::fs::write(&cfg, agent_config(&t.tls, &t.echo, "", &[&t.b1]))?;
    let (parsed, file) = tunnel_agent::ConfigFile::load(&cfg)?;
    // The window, made certain: the file changes after the read, before the agent runs.
    let rewritten = agent_config(&t.tls, &t.echo, "", &[&t.b2]);
    std::fs::write(&cfg, &rewritten)?;
    assert_ne!(file.sha256(), tether_tls::sha256_hex(rewritten.as_bytes()));

    let _ = tether_tls::install_default_crypto();
    let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
    listener.set_nonblocking(true)?;
    let admin = listener.local_addr()?;
    let shutdown = tokio_util::sync::CancellationToken::new();
    let token = shutdown.clone();
    // Actors start inside an actix System, on a thread of its own.
    let agent = std::thread::spawn(move || {
        tether_runtime::actix_system(Some(1)).block_on(async move {
            let admin = tokio::net::TcpListener::from_std(listener)?;
            tunnel_agent::run_with_reload(parsed, Some(file), admin, token).await?;
            anyhow::Ok(())
        })
    });
    let seen = wait_debug(
        admin,
        "the rewritten config running (a tunnel to b2 only)",
        |v| connected(v) == ["b2"],
    )
    .await;
    shutdown.cancel();
    let ended = agent
        .join()
        .map_err(|_| anyhow::anyhow!("agent thread panicked"))?;
    let v = seen?;
    ended?;
    assert_eq!(
        v["configSha256"].as_str(),
        Some(tether_tls::sha256_hex(rewritten.as_bytes()).as_str())
    );
    assert_eq!(v["configGeneration"], 2, "{v}");
    Ok(())
}

/// `keep_removed_brokers_connected` (what the registration-agent renders for hub-delivered
/// configs): a broker that leaves the config while its tunnel works keeps that tunnel (same
/// tunnel, streams still routed), gets it back untouched when it returns to the config, and
/// once removed again and drained by its broker it is not redialled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tunnel_agent_keeps_a_working_tunnel_of_a_removed_broker() -> anyhow::Result<()> {
    let TwoBrokers {
        procs,
        mut b1,
        b2,
        echo,
        tls,
    } = TwoBrokers::start("keep-agent").await?;
    let render = |brokers: &[&tether_e2e::Broker]| {
        agent_config(
            &tls,
            &echo,
            "keep_removed_brokers_connected: true\n",
            brokers,
        )
    };
    let cfg = procs.path().join("keep-agent.yaml");
    let (_agent, admin) =
        start_agent_with_config(&procs, "keep-agent", &cfg, &render(&[&b1, &b2]))?;
    let wait_for =
        |what: &'static str, f: fn(&serde_json::Value) -> bool| wait_debug(admin, what, f);
    wait_for("tunnels to b1 and b2", |v| connected(v) == ["b1", "b2"]).await?;
    let connects = |result: &'static str| async move {
        tether_e2e::metric(
            admin,
            "tether_agent_tunnel_connects_total",
            &[("endpoint", "b1"), ("result", result)],
        )
        .await
    };
    let echo_via_b1 = || async {
        let mut s = tether_e2e::connect_ok(b1.client_addr, "c1:443").await?;
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        s.write_all(b"ping").await?;
        s.shutdown().await?;
        let mut back = Vec::new();
        tokio::time::timeout(WAIT, s.read_to_end(&mut back)).await??;
        anyhow::ensure!(back == b"ping", "echo differs");
        anyhow::Ok(())
    };

    // b1 leaves the config: its tunnel stays and carries streams.
    std::fs::write(&cfg, render(&[&b2]))?;
    wait_for("config generation 2", |v| v["configGeneration"] == 2).await?;
    let v = debug_agent(admin).await.context("/debug/agent")?;
    assert_eq!(
        connected(&v),
        ["b1", "b2"],
        "the working tunnel to b1 is kept"
    );
    echo_via_b1().await?;
    assert_eq!(connects("ok").await?, 1.0, "no redial of b1");

    // b1 is back: the same tunnel.
    std::fs::write(&cfg, render(&[&b1, &b2]))?;
    wait_for("config generation 3", |v| v["configGeneration"] == 3).await?;
    echo_via_b1().await?;
    assert_eq!(
        connects("ok").await?,
        1.0,
        "b1's tunnel kept across remove and re-add"
    );

    // Removed again, then b1 drains and exits: the endpoint goes, nothing redials it.
    std::fs::write(&cfg, render(&[&b2]))?;
    wait_for("config generation 4", |v| v["configGeneration"] == 4).await?;
    b1.child.terminate();
    b1.child.wait_exit(WAIT)?;
    wait_for("b1's endpoint gone", |v| {
        connected(v) == ["b2"] && v["endpoints"].get("b1").is_none()
    })
    .await
    .with_context(|| {
        format!(
            "{:?}",
            std::fs::read_to_string(procs.path().join("keep-agent.log"))
        )
    })?;
    // Its tunnel ended and the connector says it will not redial; no attempt was counted.
    let log = procs.path().join("keep-agent.log");
    wait_until(WAIT, "the agent to give up b1 without redialling", || {
        std::fs::read_to_string(&log)
            .ok()
            .filter(|l| l.contains("not redialling"))
    })?;
    assert_eq!(
        tether_e2e::metric(
            admin,
            "tether_agent_tunnel_connects_total",
            &[("endpoint", "b1"), ("result", "connect_error")],
        )
        .await?,
        0.0,
        "b1 redialled after it left"
    );
    assert_eq!(connects("ok").await?, 1.0);
    wait_for("still only b2", |v| connected(v) == ["b2"]).await?;
    Ok(())
}

/// The hub renames a broker endpoint when its broker list falls back to the entrypoints
/// (broker presence lapsed during a NATS failover) and back. Such a reload keeps the working
/// tunnel: the endpoint that reaches the same broker (same address, or named by the broker's
/// hello id) takes it over when the broker's certificate is valid for its `server_name`. A
/// stream open across both renames keeps flowing, the broker holds the same tunnel, nothing is
/// redialled. An endpoint whose `server_name` the broker's certificate does not cover is not
/// given the tunnel: the old endpoint is stopped and the new one dials (and fails) on its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tunnel_agent_keeps_its_tunnel_when_the_endpoint_is_renamed() -> anyhow::Result<()> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let procs = tether_e2e::Hub::new()?;
    let b1 = procs.start_broker("b1", "")?;
    let echo = tether_e2e::echo_server().await?;
    let tls = procs.pki.issue(
        "rename-agent",
        tether_tls::Identity::tunnel_agent("c1", "agent-0"),
        &[],
    )?;
    let endpoint = |name: &str, server_name: &'static str| Endpoint {
        name: name.into(),
        address: b1.agent_addr.to_string(),
        server_name,
    };
    let render = |e: Endpoint| {
        agent_config_endpoints(
            &tls,
            &echo,
            "keep_removed_brokers_connected: true\nshutdown_grace: 1s\n",
            &[e],
        )
    };
    let cfg = procs.path().join("rename-agent.yaml");
    let (_agent, admin) = start_agent_with_config(
        &procs,
        "rename-agent",
        &cfg,
        &render(endpoint("b1", "tether-broker")),
    )?;
    wait_debug(admin, "a tunnel to b1", |v| connected(v) == ["b1"]).await?;
    // The agent counts the tunnel at the broker's hello, a moment before the broker has it in
    // its route table (a CI run read an empty list here): wait for the broker's side too.
    tether_e2e::wait_tunnel(&b1, "c1").await?;
    let before = tether_e2e::tunnel_ids(&b1).await?;
    assert_eq!(before.len(), 1, "one tunnel: {before:?}");
    let ok_connects = |label: &'static str| async move {
        tether_e2e::metric(
            admin,
            "tether_agent_tunnel_connects_total",
            &[("endpoint", label), ("result", "ok")],
        )
        .await
    };
    let mut stream = tether_e2e::connect_ok(b1.client_addr, "c1:443").await?;
    async fn round(s: &mut tokio::net::TcpStream, msg: &[u8]) -> anyhow::Result<()> {
        s.write_all(msg).await?;
        let mut back = vec![0; msg.len()];
        tokio::time::timeout(WAIT, s.read_exact(&mut back)).await??;
        anyhow::ensure!(back == msg, "echo differs");
        Ok(())
    }
    round(&mut stream, b"before the rename").await?;

    // The entrypoint: b1's address under the name of its IP (in b1's certificate).
    std::fs::write(&cfg, render(endpoint("entrypoint-0", "127.0.0.1")))?;
    let v = wait_debug(admin, "b1's tunnel under entrypoint-0", |v| {
        v["configGeneration"] == 2 && v["endpoints"]["entrypoint-0"]["broker"] == "b1"
    })
    .await?;
    assert!(v["endpoints"].get("b1").is_none(), "b1 still listed: {v}");
    round(&mut stream, b"renamed to the entrypoint").await?;

    // Back to the broker's own name.
    std::fs::write(&cfg, render(endpoint("b1", "tether-broker")))?;
    wait_debug(admin, "the tunnel under b1 again", |v| {
        v["configGeneration"] == 3
            && v["endpoints"]["b1"]["broker"] == "b1"
            && v["endpoints"].get("entrypoint-0").is_none()
    })
    .await?;
    round(&mut stream, b"and back").await?;
    assert_eq!(
        tether_e2e::tunnel_ids(&b1).await?,
        before,
        "the broker holds the same tunnel"
    );
    assert_eq!(ok_connects("b1").await?, 1.0, "b1 was redialled");
    assert_eq!(
        ok_connects("entrypoint-0").await?,
        0.0,
        "entrypoint-0 dialled a tunnel of its own"
    );
    assert_eq!(
        tether_e2e::metric(admin, "tether_agent_tunnels", &[("endpoint", "b1")]).await?,
        1.0,
        "the tunnel gauge follows the label"
    );

    // A name b1's certificate does not cover: no takeover; b1 is stopped (the new endpoint
    // reaches its address) and the new endpoint's own handshake fails.
    std::fs::write(
        &cfg,
        render(endpoint("elsewhere", "not-the-broker.tether.test")),
    )?;
    wait_debug(
        admin,
        "no tunnel under a name the broker cannot prove",
        |v| {
            v["configGeneration"] == 4
                && v["endpoints"].get("b1").is_none()
                && v["endpoints"]["elsewhere"]["address"].is_null()
                && connected(v).is_empty()
        },
    )
    .await?;
    let mut rest = Vec::new();
    let ended = tokio::time::timeout(WAIT, stream.read_to_end(&mut rest)).await?;
    assert!(
        ended.is_err() || rest.is_empty(),
        "the stopped tunnel's stream ends: {ended:?}"
    );
    assert_eq!(ok_connects("elsewhere").await?, 0.0);
    Ok(())
}

/// The add-on certificate rotates before it expires (a new key and CSR at 20–25 % of its life
/// left); the tunnel-agent reloads the files: same process, no new tunnel, a stream open
/// across the rotation keeps working, and the add-on stays Available.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn addon_certificate_rotates_without_dropping_tunnels() -> anyhow::Result<()> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let hub = Hub::start(HubOpts {
        auto_accept: vec!["*".into()],
        cert_lifetime: "30s".into(),
        ..Default::default()
    })?;
    let tpki = hub_pki(&hub)?;
    let broker = tpki.start_broker("b1", &control_plane_yaml(&hub))?;
    let api = tether_e2e::apiserver::FakeApiServer::start(&tpki).await?;
    let p = loopback_tinyproxy(&hub.logs, "proxy-1")?;
    let f = hub.dir.join("addons.yaml");
    std::fs::write(&f, addons_yaml(&p.url()))?;
    hub.tetherctl_ok(&["apply", "-f", &f.to_string_lossy()])?;
    let boot = hub.dir.join("bootstrap.kubeconfig");
    hub.join(&boot, &hub.server_url(), &hub.token, None, None)?;
    let base = hub.dir.join("edge");
    let addon_creds = base.join("cluster-proxy-hub-kubeconfig");
    let runtime_dir = base.join("cluster-proxy-agent");
    let _reaper = Reaper(runtime_dir.clone());
    let _agent = start_registration_agent(
        &hub,
        "edge-1",
        &boot,
        &base.join("hub-kubeconfig"),
        &api.addr.to_string(),
    )?;
    wait_addon(&hub, "edge-1", "add-on Available", available)?;
    let serial = || -> Option<String> {
        let pem = std::fs::read_to_string(addon_creds.join("tls.crt")).ok()?;
        tether_pki::CertInfo::from_pem(&pem)
            .ok()
            .map(|i| i.serial_hex)
    };
    let first = serial().context("add-on certificate")?;
    let pid = tunnel_agent_pid(&runtime_dir).context("tunnel-agent pid")?;
    let ready: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(runtime_dir.join("ready.json"))?)?;
    let admin: std::net::SocketAddr = ready["admin"].as_str().context("admin")?.parse()?;
    let connects = || async {
        tether_e2e::metric(
            admin,
            "tether_agent_tunnel_connects_total",
            &[("endpoint", "b1"), ("result", "ok")],
        )
        .await
    };
    let before = connects().await?;

    // A stream through the tunnel, kept open across the rotation.
    let s = tether_e2e::connect(
        broker.client_addr,
        "edge-1:443",
        Some(tether_e2e::OPS_TOKEN),
    )
    .await?
    .map_err(|(c, b)| anyhow::anyhow!("CONNECT {c}: {b}"))?;
    let cfg = tether_e2e::client_tls_config(&tpki.pki.dir.join("ca.crt"), &[b"http/1.1"], None)?;
    let mut tls = tokio_rustls::TlsConnector::from(std::sync::Arc::new(cfg))
        .connect(
            rustls::pki_types::ServerName::try_from("kubernetes.default.svc")?,
            s,
        )
        .await?;
    let get = async |tls: &mut tokio_rustls::client::TlsStream<tokio::net::TcpStream>| {
        tls.write_all(b"GET /livez HTTP/1.1\r\nhost: x\r\n\r\n")
            .await?;
        let mut buf = vec![0u8; 512];
        let n = tokio::time::timeout(Duration::from_secs(10), tls.read(&mut buf)).await??;
        anyhow::Ok(String::from_utf8_lossy(&buf[..n]).into_owned())
    };
    assert!(get(&mut tls).await?.starts_with("HTTP/1.1 200"));

    let rotated = wait_until(
        Duration::from_secs(45),
        "add-on certificate rotated",
        || serial().filter(|s| *s != first),
    )?;
    assert_ne!(rotated, first);
    // The agent picks the new files up (tls_reload_interval 2 s).
    tether_test_support::wait_until_async(
        WAIT,
        "tunnel-agent reloaded its certificate",
        || async {
            let n = tether_e2e::metric(admin, "tether_tls_reloads_total", &[])
                .await
                .ok()?;
            (n >= 1.0).then_some(())
        },
    )
    .await?;
    assert_eq!(
        tunnel_agent_pid(&runtime_dir),
        Some(pid),
        "tunnel-agent restarted"
    );
    assert_eq!(connects().await?, before, "the tunnel was re-established");
    assert!(
        get(&mut tls).await?.starts_with("HTTP/1.1 200"),
        "stream broken by the rotation"
    );
    let m = addon(&hub, "edge-1").context("add-on")?;
    assert_eq!(status(&m, "Available"), "True");
    let log = read_log(&hub.logs, "agent");
    assert!(
        log.contains("add-on certificate rotated"),
        "{}",
        tail(&log, 20)
    );
    Ok(())
}
