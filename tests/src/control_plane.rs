//! A hub control plane for the demo: `tetherctl init`, a real nats-server (2.10+, JetStream,
//! TLS, auth callout) on a random port and the real addon-manager. Processes stop on drop.
//!
//! Also the pieces of the real add-on chain the demo and `tests/tests/health_table.rs` share:
//! a tunnel PKI on the hub CA ([`tunnel_hub_from_ca`]), a broker's `control_plane` section
//! ([`broker_control_plane_yaml`]), the cluster-proxy add-on resources
//! ([`cluster_proxy_resources`]), `tetherctl join` ([`join`]) and a registration-agent run
//! with `--addon cluster-proxy` ([`AddonAgent`]), which supervises the cluster's tunnel-agent.
//!
//! A replicated hub: [`init_cluster_hub`] (`tetherctl init --nats-cluster N`), [`NatsCluster`]
//! (N nats-server processes with routes found through ports files; kill and restart nodes)
//! and [`start_manager`] (one addon-manager per call, on a seed list).

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context as _, bail};
use tether_test_support::{Child, bin, read_ready_file, wait_until};

use crate::START_TIMEOUT;
use tether_control::store::Store as _;

/// Host name in the hub NATS certificate (and `--tls-server-name` of `tetherctl join`).
pub const HUB_HOST: &str = "hub.tether.test";

/// nats-server ≥ 2.10 (one lookup for every harness).
pub use crate::registration::nats_server_bin;

/// nats-server + addon-manager over a `tetherctl init` hub directory.
pub struct ControlPlane {
    pub hub_dir: PathBuf,
    pub logs: PathBuf,
    pub nats_url: String,
    /// The port NATS listens on (on every address of `nats_listen`).
    pub nats_port: u16,
    pub nats: Child,
    pub manager: Child,
}

impl ControlPlane {
    /// Initialises `<dir>/hub` and starts NATS (on 127.0.0.1) and the addon-manager (logs in
    /// `dir`).
    pub fn start(dir: &Path) -> anyhow::Result<Self> {
        Self::start_on(dir, "127.0.0.1")
    }

    /// [`ControlPlane::start`] with NATS listening on `listen_ip` (random port); the hub's own
    /// processes use 127.0.0.1.
    pub fn start_on(dir: &Path, listen_ip: &str) -> anyhow::Result<Self> {
        let hub_dir = dir.join("hub");
        let o = Command::new(bin("tetherctl")?)
            .args(["init", "--dir"])
            .arg(&hub_dir)
            .args([
                "--hub-host",
                HUB_HOST,
                "--nats-listen",
                &format!("{listen_ip}:-1"),
            ])
            .arg("--ports-file-dir")
            .arg(dir)
            .args(["--lease-check-interval", "200ms"])
            .output()?;
        if !o.status.success() {
            bail!("tetherctl init: {}", String::from_utf8_lossy(&o.stderr));
        }
        let mut c = Command::new(nats_server_bin()?);
        c.arg("-c").arg(hub_dir.join("nats/nats.conf"));
        let nats = Child::spawn("nats", c, dir)?;
        let ports = dir.join(format!("nats-server_{}.ports", nats.pid()));
        let port = wait_until(START_TIMEOUT, "nats-server ports file", || {
            let v: serde_json::Value =
                serde_json::from_str(&std::fs::read_to_string(&ports).ok()?).ok()?;
            v["nats"][0]
                .as_str()?
                .rsplit_once(':')?
                .1
                .parse::<u16>()
                .ok()
        })?;
        let nats_url = format!("tls://127.0.0.1:{port}");
        let ready = dir.join("manager.ready");
        let mut c = Command::new(bin("addon-manager")?);
        c.arg("--hub-dir")
            .arg(&hub_dir)
            .args(["--nats-url", &nats_url])
            .args(["--admin-listen", "127.0.0.1:0"])
            .arg("--ready-file")
            .arg(&ready)
            .env("RUST_LOG", "info,async_nats=warn");
        let manager = Child::spawn("addon-manager", c, dir)?;
        read_ready_file(&ready, START_TIMEOUT).context("addon-manager did not start")?;
        Ok(Self {
            hub_dir,
            logs: dir.to_path_buf(),
            nats_url,
            nats_port: port,
            nats,
            manager,
        })
    }

    /// Runs `tetherctl ARGS --hub-dir … --nats-url …`; its stdout.
    pub fn tetherctl(&self, args: &[&str]) -> anyhow::Result<String> {
        let o = Command::new(bin("tetherctl")?)
            .args(args)
            .arg("--hub-dir")
            .arg(&self.hub_dir)
            .args(["--nats-url", &self.nats_url])
            .output()?;
        if !o.status.success() {
            bail!("tetherctl {args:?}: {}", String::from_utf8_lossy(&o.stderr));
        }
        Ok(String::from_utf8_lossy(&o.stdout).into_owned())
    }

    /// A NATS connection as the admin user (what tetherctl uses).
    pub async fn admin(&self) -> anyhow::Result<tether_control::NatsConnection> {
        admin_connection(&self.hub_dir, &self.nats_url).await
    }

    /// YAML for a health-prober's `nats` section (cluster list from this hub).
    pub fn prober_nats_yaml(&self) -> String {
        format!(
            "nats:\n  hub_dir: {}\n  url: {}\n",
            self.hub_dir.display(),
            self.nats_url
        )
    }
}

/// A tunnel PKI ([`crate::Hub`], own temp dir) whose CA is the hub CA of `hub_dir`
/// (`ca.crt`, `ca.key`): brokers and API-server stand-ins get certificates the add-on agents
/// (which trust the hub CA bundle) accept, and brokers accept the add-on certificates.
pub fn tunnel_hub_from_ca(hub_dir: &Path) -> anyhow::Result<crate::Hub> {
    tether_tls::install_default_crypto()?;
    let dir = tempfile::tempdir()?;
    let pki_dir = dir.path().join("pki");
    std::fs::create_dir_all(&pki_dir)?;
    let cert = std::fs::read_to_string(hub_dir.join("ca.crt"))?;
    let key = std::fs::read_to_string(hub_dir.join("ca.key"))?;
    std::fs::write(pki_dir.join("ca.crt"), &cert)?;
    let ca = tether_pki::HubCa::from_pem(&cert, &key)?;
    Ok(crate::Hub {
        dir,
        pki: tether_test_support::Pki { dir: pki_dir, ca },
        env: Vec::new(),
    })
}

/// A broker's `control_plane` section (append to `start_broker`'s `extra`): NATS of the hub at
/// `nats_url` (certificate name `server_name`) as the hub user; the broker announces itself in
/// `tether-brokers` (agent address = its agent listener, certificate name `tether-broker`), so
/// the add-on config delivered to agents lists it, and discovers the other brokers as relay
/// peers.
pub fn broker_control_plane_yaml(hub_dir: &Path, nats_url: &str, server_name: &str) -> String {
    format!(
        "control_plane:\n  nats_url: {nats_url}\n  server_name: {server_name}\n  ca: {}\n  password_file: {}\n  advertise:\n    server_name: tether-broker\n",
        hub_dir.join("ca.crt").display(),
        hub_dir.join("hub-user.password").display(),
    )
}

/// `tetherctl apply -f` input: ClusterManagementAddOn `cluster-proxy` (installed on every
/// accepted cluster, default configs below), AddOnDeploymentConfig `cluster-proxy-config`
/// (the agents' proxy: `https_proxy`) and ManagedProxyConfiguration `cluster-proxy`
/// (`entrypoint` = where agents go while no broker has announced itself).
pub fn cluster_proxy_resources(https_proxy: &str, entrypoint: std::net::SocketAddr) -> String {
    cluster_proxy_resources_with(&format!("httpsProxy: \"{https_proxy}\""), entrypoint)
}

/// As [`cluster_proxy_resources`] with the AddOnDeploymentConfig's `proxyConfig` given as one
/// line of YAML (e.g. `noProxy: "10.0.0.0/8"` for agents that reach the hub directly).
pub fn cluster_proxy_resources_with(
    proxy_config: &str,
    entrypoint: std::net::SocketAddr,
) -> String {
    format!(
        r#"apiVersion: addon.open-cluster-management.io/v1alpha1
kind: ClusterManagementAddOn
metadata: {{name: cluster-proxy}}
spec:
  installStrategy: {{type: All}}
  defaultConfigs:
    - {{group: addon.open-cluster-management.io, resource: addondeploymentconfigs, namespace: default, name: cluster-proxy-config}}
    - {{group: proxy.open-cluster-management.io, resource: managedproxyconfigurations, name: cluster-proxy}}
---
apiVersion: addon.open-cluster-management.io/v1alpha1
kind: AddOnDeploymentConfig
metadata: {{name: cluster-proxy-config, namespace: default}}
spec:
  proxyConfig:
    {proxy_config}
---
apiVersion: proxy.open-cluster-management.io/v1alpha1
kind: ManagedProxyConfiguration
metadata: {{name: cluster-proxy}}
spec:
  authentication: {{signer: {{type: SelfSigned}}}}
  proxyServer:
    replicas: 2
    entrypoints: [{{host: "{}", port: {}}}]
  proxyAgent: {{replicas: 1, keepalive: 5s}}
"#,
        entrypoint.ip(),
        entrypoint.port()
    )
}

/// `tetherctl join`: writes a bootstrap kubeconfig for `server` (`tls://host:port`, certificate
/// name [`HUB_HOST`]) with the hub's bootstrap token and CA, through `proxy_url` when given.
pub fn join(
    hub_dir: &Path,
    out: &Path,
    server: &str,
    proxy_url: Option<&str>,
) -> anyhow::Result<()> {
    let token = std::fs::read_to_string(hub_dir.join("bootstrap.token"))?;
    let mut c = Command::new(bin("tetherctl")?);
    c.args(["join", "--hub-server", server, "--token", token.trim()])
        .args(["--tls-server-name", HUB_HOST])
        .arg("--hub-ca")
        .arg(hub_dir.join("ca.crt"))
        .arg("--out")
        .arg(out);
    if let Some(p) = proxy_url {
        c.args(["--proxy-url", p]);
    }
    let o = c.output()?;
    if !o.status.success() {
        bail!("tetherctl join: {}", String::from_utf8_lossy(&o.stderr));
    }
    Ok(())
}

/// How to run a cluster's registration-agent with the cluster-proxy add-on.
pub struct AddonAgentSpec<'a> {
    pub cluster: &'a str,
    /// Bootstrap kubeconfig from [`join`].
    pub bootstrap: &'a Path,
    /// Hub credentials go to `<base>/hub-kubeconfig`, the add-on's to
    /// `<base>/cluster-proxy-hub-kubeconfig` and `<base>/cluster-proxy-agent`.
    pub base: &'a Path,
    /// Where the tunnel-agent sends `<cluster>:443` (`--addon-apiserver`).
    pub apiserver: &'a str,
    /// `--addon-lease-seconds` (the add-on is Available until 5 × this after the last renewal).
    pub lease_seconds: u32,
    /// Network namespace to run in (the tunnel-agent runs there too).
    pub netns: Option<&'a str>,
    /// Log directory (`<cluster>.log`).
    pub logs: &'a Path,
}

/// A running `registration-agent --addon cluster-proxy`; it supervises the cluster's
/// tunnel-agent. Dropped: SIGTERM by PID (it stops its tunnel-agent), SIGKILL after 3 s, and
/// a tunnel-agent still alive then is killed by the PID in its runtime directory.
pub struct AddonAgent {
    pub cluster: String,
    pub child: Child,
    /// `<base>/cluster-proxy-agent`: rendered config, ready and PID files of the tunnel-agent.
    pub runtime_dir: PathBuf,
    pub log: PathBuf,
}

impl AddonAgent {
    pub fn start(spec: &AddonAgentSpec<'_>) -> anyhow::Result<Self> {
        let mut c = crate::command_in(spec.netns, bin("registration-agent")?);
        c.args(["--cluster-name", spec.cluster])
            .arg("--bootstrap-kubeconfig")
            .arg(spec.bootstrap)
            .arg("--hub-kubeconfig-dir")
            .arg(spec.base.join("hub-kubeconfig"))
            .arg("--addon-dir")
            .arg(spec.base)
            .args(["--check-interval", "200ms", "--addon", "cluster-proxy"])
            .args(["--addon-apiserver", spec.apiserver])
            .args([
                "--addon-lease-seconds",
                &spec.lease_seconds.to_string(),
                "--addon-resync",
                "10s",
            ])
            .env("RUST_LOG", "info,async_nats=warn");
        Ok(Self {
            cluster: spec.cluster.to_string(),
            child: Child::spawn(spec.cluster, c, spec.logs)?,
            runtime_dir: spec.base.join("cluster-proxy-agent"),
            log: spec.logs.join(format!("{}.log", spec.cluster)),
        })
    }

    /// PID of the supervised tunnel-agent, while it runs.
    pub fn tunnel_agent_pid(&self) -> Option<i32> {
        let pid: i32 = std::fs::read_to_string(self.runtime_dir.join("tunnel-agent.pid"))
            .ok()?
            .trim()
            .parse()
            .ok()?;
        is_tunnel_agent(pid).then_some(pid)
    }

    /// Stops the registration-agent with SIGTERM (by PID), as a pod deletion or node drain
    /// would; it stops its tunnel-agent before exiting. Returns once both are gone.
    pub fn stop(&mut self, timeout: std::time::Duration) -> anyhow::Result<()> {
        let ta = self.tunnel_agent_pid();
        self.child.terminate();
        self.child.wait_exit(timeout)?;
        if let Some(pid) = ta {
            wait_until(
                timeout,
                "the tunnel-agent to exit with its supervisor",
                || (!is_tunnel_agent(pid)).then_some(()),
            )?;
        }
        Ok(())
    }
}

/// Whether `pid` is a live (not zombie) tunnel-agent process.
pub fn is_tunnel_agent(pid: i32) -> bool {
    let alive = std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| {
        s.rsplit_once(')')
            .and_then(|(_, r)| r.split_whitespace().next())
            != Some("Z")
    });
    alive
        && std::fs::read(format!("/proc/{pid}/cmdline"))
            .is_ok_and(|c| String::from_utf8_lossy(&c).contains("tunnel-agent"))
}

impl Drop for AddonAgent {
    fn drop(&mut self) {
        let ta = self.tunnel_agent_pid();
        self.child.terminate();
        let _ = self.child.wait_exit(std::time::Duration::from_secs(3));
        self.child.kill();
        if let Some(pid) = ta.filter(|p| is_tunnel_agent(*p)) {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
    }
}

/// One node of a [`NatsCluster`].
pub struct NatsClusterNode {
    /// 1-based, as in `nats/node-<i>/nats.conf`.
    pub index: usize,
    /// `None` while killed.
    pub child: Option<Child>,
    pub client_port: u16,
    pub cluster_port: u16,
    /// How many times it was started (log `nats-<i>-<n>.log`).
    starts: usize,
}

/// A NATS cluster from `tetherctl init --nats-cluster N --nats-listen 127.0.0.1:-1
/// --nats-cluster-listen 127.0.0.1:-1 --ports-file-dir DIR`: node 1 starts first (with a route
/// to a closed port: JetStream wants one configured); the others get `--routes` to the nodes
/// already up (ports from their ports files). A restarted node
/// keeps its client and cluster ports (`-p`, `--cluster`) and routes to every other node.
pub struct NatsCluster {
    pub hub_dir: PathBuf,
    pub logs: PathBuf,
    pub nodes: Vec<NatsClusterNode>,
}

/// The `nats` and `cluster` ports from nats-server's ports file in `dir`.
fn nats_ports(dir: &Path, pid: u32) -> anyhow::Result<(u16, u16)> {
    let ports = dir.join(format!("nats-server_{pid}.ports"));
    wait_until(START_TIMEOUT, "nats-server ports file", || {
        let v: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&ports).ok()?).ok()?;
        let port = |k: &str| -> Option<u16> { v[k][0].as_str()?.rsplit_once(':')?.1.parse().ok() };
        Some((port("nats")?, port("cluster")?))
    })
}

impl NatsCluster {
    /// Starts every node of the cluster written into `hub_dir` (logs and ports files in `logs`).
    pub fn start(hub_dir: &Path, logs: &Path, n: usize) -> anyhow::Result<Self> {
        let mut c = Self {
            hub_dir: hub_dir.to_path_buf(),
            logs: logs.to_path_buf(),
            nodes: Vec::new(),
        };
        for i in 1..=n {
            c.nodes.push(NatsClusterNode {
                index: i,
                child: None,
                client_port: 0,
                cluster_port: 0,
                starts: 0,
            });
            c.start_node(i)?;
        }
        Ok(c)
    }

    /// Starts (or restarts) node `i` (1-based).
    pub fn start_node(&mut self, i: usize) -> anyhow::Result<()> {
        let mut routes: Vec<String> = self
            .nodes
            .iter()
            .filter(|n| n.index != i && n.cluster_port != 0)
            .map(|n| format!("nats-route://127.0.0.1:{}", n.cluster_port))
            .collect();
        if routes.is_empty() {
            // A JetStream cluster node needs a configured route to start: the first node gets
            // one to a closed loopback port (from port 0, released); the others route to it.
            let closed = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?;
            routes.push(format!("nats-route://{closed}"));
        }
        let node = &mut self.nodes[i - 1];
        anyhow::ensure!(node.child.is_none(), "nats node {i} is running");
        let mut cmd = Command::new(nats_server_bin()?);
        cmd.arg("-c")
            .arg(self.hub_dir.join(format!("nats/node-{i}/nats.conf")));
        if node.client_port != 0 {
            cmd.args(["-p", &node.client_port.to_string()]).args([
                "--cluster",
                &format!("nats://127.0.0.1:{}", node.cluster_port),
            ]);
        }
        cmd.args(["--routes", &routes.join(",")]);
        node.starts += 1;
        let child = Child::spawn(&format!("nats-{i}-{}", node.starts), cmd, &self.logs)?;
        let (client, cluster) = nats_ports(&self.logs, child.pid())?;
        node.client_port = client;
        node.cluster_port = cluster;
        node.child = Some(child);
        Ok(())
    }

    /// SIGKILL node `i`.
    pub fn kill_node(&mut self, i: usize) {
        if let Some(mut c) = self.nodes[i - 1].child.take() {
            c.kill();
        }
    }

    /// Freezes node `i` with SIGSTOP (`stop = true`) or thaws it with SIGCONT: a partition
    /// without FIN — its TCP connections stay open and silent.
    pub fn freeze_node(&self, i: usize, stop: bool) -> anyhow::Result<()> {
        let pid = self.nodes[i - 1]
            .child
            .as_ref()
            .map(Child::pid)
            .with_context(|| format!("nats node {i} is not running"))?;
        let sig = if stop {
            nix::sys::signal::Signal::SIGSTOP
        } else {
            nix::sys::signal::Signal::SIGCONT
        };
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(i32::try_from(pid)?), sig)?;
        Ok(())
    }

    /// `tls://127.0.0.1:<port>` of node `i`.
    pub fn node_url(&self, i: usize) -> String {
        format!("tls://127.0.0.1:{}", self.nodes[i - 1].client_port)
    }

    /// The seed list of every node.
    pub fn url(&self) -> String {
        (1..=self.nodes.len())
            .map(|i| self.node_url(i))
            .collect::<Vec<_>>()
            .join(",")
    }
}

/// `tetherctl init` of a hub with a `n`-node NATS cluster on random loopback ports (ports
/// files in `dir`), in `<dir>/hub`.
pub fn init_cluster_hub(dir: &Path, n: usize, extra: &[&str]) -> anyhow::Result<PathBuf> {
    let hub_dir = dir.join("hub");
    let mut cmd = Command::new(bin("tetherctl")?);
    cmd.args(["init", "--dir"])
        .arg(&hub_dir)
        .args(["--hub-host", HUB_HOST, "--nats-listen", "127.0.0.1:-1"])
        .args(["--nats-cluster", &n.to_string()])
        .args(["--nats-cluster-listen", "127.0.0.1:-1"])
        .arg("--ports-file-dir")
        .arg(dir)
        .args(extra);
    // Tests want fast lease checks; a caller that sets its own interval keeps it.
    if !extra.contains(&"--lease-check-interval") {
        cmd.args(["--lease-check-interval", "200ms"]);
    }
    let o = cmd.output()?;
    if !o.status.success() {
        bail!("tetherctl init: {}", String::from_utf8_lossy(&o.stderr));
    }
    Ok(hub_dir)
}

/// A running addon-manager replica.
pub struct Manager {
    pub child: Child,
    /// Its admin HTTP address (/metrics).
    pub admin: std::net::SocketAddr,
}

/// Starts an addon-manager (`name`, logs in `logs`) on `hub_dir` with NATS at `nats_url` (a
/// seed list) and waits until it is ready.
pub fn start_manager(
    hub_dir: &Path,
    nats_url: &str,
    name: &str,
    logs: &Path,
) -> anyhow::Result<Manager> {
    let ready = logs.join(format!("{name}.ready"));
    let _ = std::fs::remove_file(&ready);
    let mut c = Command::new(bin("addon-manager")?);
    c.arg("--hub-dir")
        .arg(hub_dir)
        .args(["--nats-url", nats_url])
        .args(["--admin-listen", "127.0.0.1:0"])
        .arg("--ready-file")
        .arg(&ready)
        .env("RUST_LOG", "info,async_nats=warn");
    let mut child = Child::spawn(name, c, logs)?;
    let r = child
        .read_ready_file(&ready, START_TIMEOUT)
        .with_context(|| format!("{name} did not start"))?;
    let admin = r["admin"]
        .as_str()
        .and_then(|a| a.parse().ok())
        .with_context(|| format!("{name} ready file has no admin address: {r}"))?;
    Ok(Manager { child, admin })
}

/// A NATS connection to `nats_url` (a seed list) as the admin user of `hub_dir`.
pub async fn admin_connection(
    hub_dir: &Path,
    nats_url: &str,
) -> anyhow::Result<tether_control::NatsConnection> {
    use tether_control::connect::{ConnectConfig, Credentials, connect};
    let dir = tether_control::hub::HubDir::load(hub_dir)?;
    let password = dir.read(&dir.config.nats.admin_password_file)?;
    Ok(connect(&ConnectConfig::new(
        dir.endpoint(Some(nats_url))?,
        Credentials::HubUser {
            user: tether_control::hub::ADMIN_USER.into(),
            password: password.trim().to_string(),
        },
        "test",
    ))
    .await?)
}

/// Polls `f` every 100 ms until it yields `Some`, failing after `timeout` with `what`.
pub async fn eventually<T, F, Fut>(
    timeout: std::time::Duration,
    what: &str,
    mut f: F,
) -> anyhow::Result<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = std::time::Instant::now() + timeout;
    loop {
        if let Some(v) = f().await {
            return Ok(v);
        }
        if std::time::Instant::now() > deadline {
            bail!("timed out after {timeout:?} waiting for {what}");
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
}

/// Starts a plain registration-agent for `cluster` (logs `<dir>/<cluster>.log`), bootstrapping
/// through `tetherctl join` with `server` (a seed list is fine).
pub fn start_registration_agent(
    hub_dir: &Path,
    dir: &Path,
    server: &str,
    cluster: &str,
) -> anyhow::Result<Child> {
    let base = dir.join(cluster);
    std::fs::create_dir_all(&base)?;
    let bootstrap = base.join("bootstrap.kubeconfig");
    join(hub_dir, &bootstrap, server, None)?;
    let mut c = Command::new(bin("registration-agent")?);
    c.args(["--cluster-name", cluster])
        .arg("--bootstrap-kubeconfig")
        .arg(&bootstrap)
        .arg("--hub-kubeconfig-dir")
        .arg(base.join("hub-kubeconfig"))
        .args(["--check-interval", "200ms"])
        .env("RUST_LOG", "info,async_nats=warn");
    Child::spawn(cluster, c, dir)
}

/// The ManagedCluster's Available status, when readable.
pub async fn cluster_available(
    store: &tether_control::store::HubStore,
    cluster: &str,
) -> Option<String> {
    use tether_control::resources::{ManagedCluster, condition};
    let (mc, _) = store
        .get::<ManagedCluster>(tether_control::store::Bucket::Clusters, cluster)
        .await
        .ok()??;
    mc.condition(condition::AVAILABLE).map(str::to_string)
}

/// Follows every write to `tether-managedclusters` (a KV watch: JetStream delivers the writes in
/// order, so a read served by a lagging replica cannot fake a flap) and records any cluster
/// whose Available left True after it had been True. A watch that ends (its server died) is
/// re-opened; it replays the latest value of every cluster.
pub struct AvailabilityWatch {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    task: tokio::task::JoinHandle<AvailabilitySeen>,
}

/// What an [`AvailabilityWatch`] saw.
pub struct AvailabilitySeen {
    /// When each cluster was first seen Available=True (as the watch received the write).
    pub first_available: std::collections::BTreeMap<String, std::time::Instant>,
    /// Every write that took a cluster from Available=True to anything else.
    pub flaps: Vec<String>,
}

impl AvailabilityWatch {
    pub fn start(store: tether_control::store::HubStore) -> Self {
        use futures::StreamExt;
        use std::sync::atomic::Ordering;
        use tether_control::resources::{ManagedCluster, condition};
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let flag = stop.clone();
        let task = tokio::spawn(async move {
            let mut seen = std::collections::BTreeMap::new();
            let mut flaps = Vec::new();
            while !flag.load(Ordering::Relaxed) {
                let Ok(w) = store
                    .watch::<ManagedCluster>(tether_control::store::Bucket::Clusters)
                    .await
                else {
                    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
                    continue;
                };
                let mut w = std::pin::pin!(w);
                while !flag.load(Ordering::Relaxed) {
                    let next =
                        tokio::time::timeout(std::time::Duration::from_millis(200), w.next());
                    match next.await {
                        Ok(Some((name, Some(mc)))) => {
                            let a = mc.condition(condition::AVAILABLE).map(str::to_string);
                            if a.as_deref() == Some("True") {
                                seen.entry(name).or_insert_with(std::time::Instant::now);
                            } else if seen.contains_key(&name) {
                                flaps.push(format!("{name}: Available={a:?}"));
                            }
                        }
                        Ok(Some((_, None))) | Err(_) => {}
                        Ok(None) => break,
                    }
                }
            }
            AvailabilitySeen {
                first_available: seen,
                flaps,
            }
        });
        Self { stop, task }
    }

    /// Stops; how many clusters were seen Available, and every flap.
    pub async fn finish(self) -> anyhow::Result<(usize, Vec<String>)> {
        let s = self.finish_timed().await?;
        Ok((s.first_available.len(), s.flaps))
    }

    /// Stops; when each cluster first became Available, and every flap.
    pub async fn finish_timed(self) -> anyhow::Result<AvailabilitySeen> {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        Ok(self.task.await?)
    }
}

/// Every hub bucket with file storage (the broker presence bucket is in memory, soft state).
pub const DURABLE_BUCKETS: [tether_control::store::Bucket; 12] = [
    tether_control::store::Bucket::Clusters,
    tether_control::store::Bucket::Leases,
    tether_control::store::Bucket::Csrs,
    tether_control::store::Bucket::Tokens,
    tether_control::store::Bucket::ClusterManagementAddOns,
    tether_control::store::Bucket::ManagedClusterAddOns,
    tether_control::store::Bucket::AddOnDeploymentConfigs,
    tether_control::store::Bucket::ProxyConfigurations,
    tether_control::store::Bucket::AddOnLeases,
    tether_control::store::Bucket::HubClients,
    tether_control::store::Bucket::ClientAccessPolicies,
    tether_control::store::Bucket::ServiceProxyAllowlists,
];
const CLUSTER_DEADLINE: std::time::Duration = std::time::Duration::from_secs(30);

/// Stream names of every hub bucket plus the events stream.
pub fn stream_names() -> Vec<String> {
    DURABLE_BUCKETS
        .iter()
        .chain([tether_control::store::Bucket::Brokers].iter())
        .map(|b| format!("KV_{}", b.name()))
        .chain([tether_control::subjects::STREAM_EVENTS.to_string()])
        .collect()
}

/// `(configured replicas, peers that are current)` of every hub stream; `None` while any
/// stream info request fails (no leader yet).
pub async fn replication(
    js: &async_nats::jetstream::Context,
) -> Option<std::collections::BTreeMap<String, (usize, usize)>> {
    let mut out = std::collections::BTreeMap::new();
    for name in stream_names() {
        let info = js.get_stream(&name).await.ok()?.cached_info().clone();
        let current = info.cluster.as_ref().map_or(0, |c| {
            c.replicas
                .iter()
                .filter(|r| r.current && !r.offline)
                .count()
                + usize::from(c.leader.is_some())
        });
        out.insert(name, (info.config.num_replicas, current));
    }
    Some(out)
}

/// Waits until every hub stream has 3 replicas, all current.
pub async fn wait_fully_replicated(js: &async_nats::jetstream::Context) -> anyhow::Result<()> {
    eventually(
        CLUSTER_DEADLINE,
        "every hub stream at 3 current replicas",
        || async {
            replication(js)
                .await
                .filter(|m| m.values().all(|&(want, have)| want == 3 && have == 3))
        },
    )
    .await
    .map(|_| ())
}

/// Every entry of every durable bucket: `(bucket, key) → (value, revision)`.
pub async fn bucket_snapshot(
    store: &tether_control::store::HubStore,
) -> anyhow::Result<std::collections::BTreeMap<(String, String), (serde_json::Value, u64)>> {
    let mut out = std::collections::BTreeMap::new();
    for b in DURABLE_BUCKETS {
        for (k, v, rev) in store.list::<serde_json::Value>(b).await? {
            out.insert((b.name().to_string(), k), (v, rev));
        }
    }
    Ok(out)
}

/// Waits until every one of `clusters` leases has been renewed `rounds` more times.
pub async fn wait_lease_renewals(
    store: &tether_control::store::HubStore,
    clusters: usize,
    rounds: usize,
) -> anyhow::Result<()> {
    use tether_control::resources::Lease;
    let renewed = |store: tether_control::store::HubStore| async move {
        let l = store
            .list::<Lease>(tether_control::store::Bucket::Leases)
            .await
            .ok()?;
        Some(
            l.into_iter()
                .map(|(k, l, _)| (k, l.spec.renew_time))
                .collect::<std::collections::BTreeMap<_, _>>(),
        )
    };
    let mut last = renewed(store.clone()).await.unwrap_or_default();
    for round in 0..rounds {
        last = eventually(
            CLUSTER_DEADLINE,
            &format!("lease renewal round {round}"),
            || {
                let (store, last) = (store.clone(), last.clone());
                async move {
                    let now = renewed(store).await?;
                    (now.len() == clusters && now.iter().all(|(k, v)| last.get(k) != Some(v)))
                        .then_some(now)
                }
            },
        )
        .await?;
    }
    Ok(())
}

/// Asserts that every stored CSR carries a certificate and was approved exactly once (one
/// `CSRApproved` event), and that each `<dir>/<cluster>/hub-kubeconfig/tls.crt` is one of them.
pub async fn assert_csrs_signed_once(
    store: &tether_control::store::HubStore,
    dir: &Path,
    clusters: &[&str],
) -> anyhow::Result<()> {
    assert_csrs_signed(store, dir, clusters, 1..=1).await
}

/// As [`assert_csrs_signed_once`], but a CSR may have no `CSRApproved` event: events are
/// published best effort, and one published while JetStream has no leader for the events
/// stream (a NATS node partitioned) is lost. Never two.
pub async fn assert_csrs_never_signed_twice(
    store: &tether_control::store::HubStore,
    dir: &Path,
    clusters: &[&str],
) -> anyhow::Result<()> {
    assert_csrs_signed(store, dir, clusters, 0..=1).await
}

async fn assert_csrs_signed(
    store: &tether_control::store::HubStore,
    dir: &Path,
    clusters: &[&str],
    approvals_per_csr: std::ops::RangeInclusive<usize>,
) -> anyhow::Result<()> {
    use tether_control::resources::CertificateSigningRequest;
    let events = store.recent_events(100_000, None).await?;
    let mut approvals: std::collections::BTreeMap<String, usize> = Default::default();
    for e in &events {
        if e.reason == "CSRApproved" {
            *approvals.entry(e.involved_object.name.clone()).or_default() += 1;
        }
    }
    let csrs = store
        .list::<CertificateSigningRequest>(tether_control::store::Bucket::Csrs)
        .await?;
    anyhow::ensure!(csrs.len() >= clusters.len(), "CSRs: {}", csrs.len());
    for (key, csr, _) in &csrs {
        anyhow::ensure!(!csr.status.certificate.is_empty(), "{key} not signed");
        anyhow::ensure!(
            approvals_per_csr.contains(&approvals.get(&csr.metadata.name).copied().unwrap_or(0)),
            "{key} approvals: {approvals:?}"
        );
    }
    for c in clusters {
        let held = std::fs::read_to_string(dir.join(c).join("hub-kubeconfig/tls.crt"))?;
        anyhow::ensure!(
            csrs.iter()
                .any(|(_, csr, _)| csr.status.certificate.trim() == held.trim()),
            "{c} holds a certificate no stored CSR carries"
        );
    }
    Ok(())
}

/// Lines of each process log printed by [`FailureLogs`].
pub const FAILURE_LOG_LINES: usize = 80;

/// Prints the end of every process log (`*.log`, also in subdirectories) under its directories
/// when dropped after a failure: a panic, or a test that returned before [`FailureLogs::passed`]
/// (an error from `eventually`, which no `Drop` can otherwise see). Directories handed over
/// with [`FailureLogs::own`] are removed after the dump (their `TempDir` must not remove them
/// first). Declare it after the test's own `TempDir`, so it drops — and reads — first.
pub struct FailureLogs {
    dirs: Vec<PathBuf>,
    owned: Vec<PathBuf>,
    passed: bool,
}

impl FailureLogs {
    pub fn new(dir: &Path) -> Self {
        Self {
            dirs: vec![dir.to_path_buf()],
            owned: Vec::new(),
            passed: false,
        }
    }

    /// Also dumps the logs of `dir`, and removes it on drop (unless `keep`).
    pub fn own(&mut self, dir: &mut tempfile::TempDir, keep: bool) {
        dir.disable_cleanup(true);
        self.dirs.push(dir.path().to_path_buf());
        if !keep {
            self.owned.push(dir.path().to_path_buf());
        }
    }

    /// The test passed: nothing is printed.
    pub fn passed(&mut self) {
        self.passed = true;
    }

    fn logs(dir: &Path, depth: usize, out: &mut Vec<PathBuf>) {
        let Ok(entries) = std::fs::read_dir(dir) else {
            return;
        };
        for e in entries.flatten() {
            let p = e.path();
            if p.is_dir() && depth > 0 {
                Self::logs(&p, depth - 1, out);
            } else if p.extension().is_some_and(|x| x == "log") {
                out.push(p);
            }
        }
    }
}

impl Drop for FailureLogs {
    fn drop(&mut self) {
        if !self.passed || std::thread::panicking() {
            let mut logs = Vec::new();
            for d in &self.dirs {
                Self::logs(d, 3, &mut logs);
            }
            logs.sort();
            for p in logs {
                let text = std::fs::read_to_string(&p).unwrap_or_default();
                let lines: Vec<&str> = text.lines().collect();
                let tail = &lines[lines.len().saturating_sub(FAILURE_LOG_LINES)..];
                eprintln!(
                    "===== {} (last {} of {} lines)",
                    p.display(),
                    tail.len(),
                    lines.len()
                );
                for l in tail {
                    eprintln!("{l}");
                }
            }
        }
        for d in &self.owned {
            let _ = std::fs::remove_dir_all(d);
        }
    }
}
