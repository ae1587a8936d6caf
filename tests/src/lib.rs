//! Shared scaffolding for the end-to-end tests, the benchmark and the demo: writes configs for
//! real `tunnel-broker` / `tunnel-agent` processes and starts them on 127.0.0.1 with port 0.
//!
//! [`Hub::start`] starts a broker; [`Hub::start_agent`] an agent for a cluster. Both read their
//! bound addresses back from `--ready-file`. Everything is stopped (by PID) on drop.
//!
//! The hub side: [`control_plane`] (nats-server + addon-manager, replicated hubs, add-on agents)
//! and [`registration`] (the registration tests' hub with forward proxies and network
//! namespaces) — one harness in this library, used by every test file. [`live`]: streams that
//! keep moving data and relays that can be cut, for tests that change the world underneath.

pub mod addons;
pub mod apiserver;
pub mod benchkit;
pub mod delay;
pub mod forward_proxy;
pub mod konnectivity;
pub mod live;
pub mod netns;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::Context as _;
use tether_test_support::{Child, LeafFiles, Pki, bin};
use tether_tls::Identity;

/// Token of the default test client (`ops`), allowed everywhere.
pub const OPS_TOKEN: &str = "ops-token-for-tests";
/// Startup deadline for a process.
pub const START_TIMEOUT: Duration = Duration::from_secs(20);

/// A broker process and its addresses.
pub struct Broker {
    pub id: String,
    pub agent_addr: SocketAddr,
    pub client_addr: SocketAddr,
    pub client_tls_addr: SocketAddr,
    pub admin_addr: SocketAddr,
    pub child: Child,
    pub config_path: PathBuf,
}

/// An agent process.
pub struct Agent {
    pub cluster: String,
    pub admin_addr: SocketAddr,
    pub child: Child,
    pub tls: LeafFiles,
}

/// A temp dir with a PKI, used to start brokers and agents.
pub struct Hub {
    pub dir: tempfile::TempDir,
    pub pki: Pki,
    /// Environment variables given to every process the hub starts (e.g. OTLP export).
    pub env: Vec<(String, String)>,
}

fn sha256_hex(s: &str) -> String {
    tether_tls::sha256_hex(s.as_bytes())
}

fn addr(v: &serde_json::Value, key: &str) -> anyhow::Result<SocketAddr> {
    v[key]
        .as_str()
        .with_context(|| format!("ready file has no {key}"))?
        .parse()
        .with_context(|| format!("ready file {key}"))
}

impl Hub {
    pub fn new() -> anyhow::Result<Self> {
        tether_tls::install_default_crypto()?;
        let dir = tempfile::tempdir()?;
        let pki = Pki::new(&dir.path().join("pki"))?;
        Ok(Self {
            dir,
            pki,
            env: Vec::new(),
        })
    }

    pub fn path(&self) -> &Path {
        self.dir.path()
    }

    /// Starts broker `id`. `extra` is appended to its YAML config (top-level keys).
    /// The HTTP service proxy's address of broker `id` (started with a `service_proxy`
    /// section), from its ready file (waited for up to 10 s).
    pub fn service_proxy_addr(&self, id: &str) -> anyhow::Result<SocketAddr> {
        let ready = tether_test_support::read_ready_file(
            &self.path().join(format!("broker-{id}.ready")),
            Duration::from_secs(10),
        )?;
        let addr = ready["service_proxy"].as_str().ok_or_else(|| {
            anyhow::anyhow!("broker {id}'s ready file has no service_proxy address")
        })?;
        Ok(addr.parse()?)
    }

    pub fn start_broker(&self, id: &str, extra: &str) -> anyhow::Result<Broker> {
        self.start_broker_at(id, extra, None, "127.0.0.1")
    }

    /// Starts broker `id` inside network namespace `netns` (when given), listening on
    /// `listen_ip` (its admin listener stays on the namespace's 127.0.0.1).
    pub fn start_broker_at(
        &self,
        id: &str,
        extra: &str,
        netns: Option<&str>,
        listen_ip: &str,
    ) -> anyhow::Result<Broker> {
        let tls = self.pki.issue(
            &format!("broker-{id}"),
            Identity::Broker { id: id.into() },
            &["localhost", "127.0.0.1", "tether-broker"],
        )?;
        let cfg = format!(
            "id: {id}\ntls:\n  cert: {}\n  key: {}\n  ca: {}\ntls_reload_interval: 200ms\nagent_listen: {listen_ip}:0\nclient_listen: {listen_ip}:0\nclient_tls_listen: {listen_ip}:0\nadmin_listen: 127.0.0.1:0\ndrain_grace: 10s\nclients:\n  - name: ops\n    token_sha256: {}\n    allow:\n      - clusters: ['*']\n        targets: ['apiserver', '*:*']\n  - name: apionly\n    token_sha256: {}\n{extra}\n",
            tls.cert.display(),
            tls.key.display(),
            tls.ca.display(),
            sha256_hex(OPS_TOKEN),
            sha256_hex("apionly-token"),
        );
        let config_path = self.path().join(format!("broker-{id}.yaml"));
        std::fs::write(&config_path, cfg)?;
        let ready = self.path().join(format!("broker-{id}.ready"));
        let _ = std::fs::remove_file(&ready);
        let mut cmd = command_in(netns, bin("tunnel-broker")?);
        cmd.envs(self.env.iter().map(|(k, v)| (k, v)));
        cmd.arg("--config")
            .arg(&config_path)
            .arg("--ready-file")
            .arg(&ready);
        let mut child = Child::spawn(&format!("broker-{id}"), cmd, self.path())?;
        let r = child.read_ready_file(&ready, START_TIMEOUT)?;
        Ok(Broker {
            id: id.into(),
            agent_addr: addr(&r, "agent")?,
            client_addr: addr(&r, "client")?,
            client_tls_addr: addr(&r, "client_tls")?,
            admin_addr: addr(&r, "admin")?,
            child,
            config_path,
        })
    }

    /// Starts an agent for `cluster` connected to `brokers` (one endpoint per inner list, a
    /// failover group). `apiserver` is where `<cluster>:443` goes; `extra` is appended YAML.
    pub fn start_agent(
        &self,
        cluster: &str,
        cert_cluster: &str,
        brokers: &[Vec<SocketAddr>],
        apiserver: SocketAddr,
        extra: &str,
    ) -> anyhow::Result<Agent> {
        self.start_agent_at(cluster, cert_cluster, brokers, apiserver, extra, None)
    }

    /// [`Hub::start_agent`] inside network namespace `netns` (when given).
    pub fn start_agent_at(
        &self,
        cluster: &str,
        cert_cluster: &str,
        brokers: &[Vec<SocketAddr>],
        apiserver: SocketAddr,
        extra: &str,
        netns: Option<&str>,
    ) -> anyhow::Result<Agent> {
        let name = format!("agent-{cluster}-{}", rand_suffix());
        let tls = self
            .pki
            .issue(&name, Identity::tunnel_agent(cert_cluster, "agent-0"), &[])?;
        let mut endpoints = String::new();
        for group in brokers {
            let list: Vec<String> = group.iter().map(|a| format!("'{a}'")).collect();
            endpoints.push_str(&format!(
                "  - addresses: [{}]\n    server_name: tether-broker\n",
                list.join(", ")
            ));
        }
        let cfg = format!(
            "cluster: {cluster}\nagent: agent-0\ntls:\n  cert: {}\n  key: {}\n  ca: {}\ntls_reload_interval: 200ms\nbrokers:\n{endpoints}apiserver: '{apiserver}'\nadmin_listen: 127.0.0.1:0\nbackoff:\n  initial: 50ms\n  max: 1s\n  reset_after: 5s\n{extra}\n",
            tls.cert.display(),
            tls.key.display(),
            tls.ca.display(),
        );
        let config_path = self.path().join(format!("{name}.yaml"));
        std::fs::write(&config_path, cfg)?;
        let ready = self.path().join(format!("{name}.ready"));
        let mut cmd = command_in(netns, bin("tunnel-agent")?);
        cmd.envs(self.env.iter().map(|(k, v)| (k, v)));
        cmd.arg("--config")
            .arg(&config_path)
            .arg("--ready-file")
            .arg(&ready);
        let mut child = Child::spawn(&name, cmd, self.path())?;
        let r = child.read_ready_file(&ready, START_TIMEOUT)?;
        Ok(Agent {
            cluster: cluster.into(),
            admin_addr: addr(&r, "admin")?,
            child,
            tls,
        })
    }
}

/// `program`, run inside network namespace `netns` when given (`ip netns exec`; the child's
/// PID is the program's own, so it is stopped by PID like any other).
pub fn command_in(netns: Option<&str>, program: impl AsRef<std::ffi::OsStr>) -> Command {
    match netns {
        Some(ns) => {
            let mut c = Command::new("ip");
            c.args(["netns", "exec", ns]).arg(program);
            c
        }
        None => Command::new(program),
    }
}

fn rand_suffix() -> String {
    format!("{:08x}", rand::random::<u32>())
}

/// YAML for a broker's `peers` list naming `peer` (append to `start_broker`'s `extra`).
pub fn peers_yaml(peer: &Broker) -> String {
    format!(
        "peers:\n  - id: {}\n    address: '{}'\n    server_name: tether-broker\n",
        peer.id, peer.agent_addr
    )
}

/// A health-prober process and its admin address.
pub struct Prober {
    pub child: Child,
    pub admin_addr: SocketAddr,
}

impl Hub {
    /// Starts a health-prober probing `clusters` through `broker`'s native Dial API (token of
    /// the `ops` client, API servers verified with the hub CA). `extra` is appended YAML.
    pub fn start_prober(
        &self,
        broker: &Broker,
        clusters: &[&str],
        extra: &str,
    ) -> anyhow::Result<Prober> {
        self.start_prober_via(broker.client_tls_addr, clusters, extra)
    }

    /// [`Hub::start_prober`] with the broker's TLS client endpoint at `endpoint` (a relay in
    /// front of it, say).
    pub fn start_prober_via(
        &self,
        endpoint: SocketAddr,
        clusters: &[&str],
        extra: &str,
    ) -> anyhow::Result<Prober> {
        let token_file = self.path().join("prober.token");
        std::fs::write(&token_file, OPS_TOKEN)?;
        let cfg = format!(
            "broker:\n  endpoint: https://{}\n  server_name: localhost\n  ca: {ca}\n  token_file: {}\nclusters: [{}]\napiserver_ca: {ca}\nadmin_listen: 127.0.0.1:0\n{extra}\n",
            endpoint,
            token_file.display(),
            clusters.join(", "),
            ca = self.pki.ca_path().display(),
        );
        let cfg_path = self.path().join("prober.yaml");
        std::fs::write(&cfg_path, cfg)?;
        let ready = self.path().join("prober.ready");
        let _ = std::fs::remove_file(&ready);
        let mut cmd = Command::new(bin("health-prober")?);
        cmd.envs(self.env.iter().map(|(k, v)| (k, v)));
        cmd.arg("--config")
            .arg(&cfg_path)
            .arg("--ready-file")
            .arg(&ready);
        let mut child = Child::spawn("health-prober", cmd, self.path())?;
        let r = child.read_ready_file(&ready, START_TIMEOUT)?;
        Ok(Prober {
            child,
            admin_addr: addr(&r, "admin")?,
        })
    }
}

/// The prober's health table rows (JSON objects), if it answers.
pub async fn health_rows(prober: SocketAddr) -> Option<Vec<serde_json::Value>> {
    let (_, body) = admin_get(prober, "/debug/health").await.ok()?;
    serde_json::from_str(&body).ok()
}

/// GETs `path` from an admin server; returns (status, body).
pub async fn admin_get(admin: SocketAddr, path: &str) -> anyhow::Result<(u16, String)> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::time::timeout(
        Duration::from_secs(5),
        tokio::net::TcpStream::connect(admin),
    )
    .await??;
    s.write_all(
        format!("GET {path} HTTP/1.1\r\nhost: admin\r\nconnection: close\r\n\r\n").as_bytes(),
    )
    .await?;
    let mut buf = Vec::new();
    tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut buf)).await??;
    let text = String::from_utf8_lossy(&buf).into_owned();
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .context("bad admin response")?;
    let body = text
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default();
    Ok((status, body))
}

/// Waits until the agent reports ready (a tunnel to every endpoint).
pub async fn wait_agent_ready(agent: &Agent) -> anyhow::Result<()> {
    tether_test_support::wait_until_async(START_TIMEOUT, "agent ready", || async {
        matches!(admin_get(agent.admin_addr, "/readyz").await, Ok((200, _))).then_some(())
    })
    .await
}

/// Starts broker `b1` and cluster `c1`'s agent on `hub` (the cluster's API server: an echo
/// server) and waits until the tunnel is up. Keep the agent alive while the tunnel is used.
pub async fn with_c1(hub: Hub) -> anyhow::Result<(Hub, Broker, Agent)> {
    let echo = echo_server().await?;
    let broker = hub.start_broker("b1", "")?;
    let agent = hub.start_agent("c1", "c1", &[vec![broker.agent_addr]], echo, "")?;
    wait_agent_ready(&agent).await?;
    wait_tunnel(&broker, "c1").await?;
    Ok((hub, broker, agent))
}

/// Waits until `broker` has a tunnel for `cluster`.
pub async fn wait_tunnel(broker: &Broker, cluster: &str) -> anyhow::Result<()> {
    let needle = format!("\"cluster\":\"{cluster}\"");
    tether_test_support::wait_until_async(
        START_TIMEOUT,
        &format!("tunnel for {cluster}"),
        || async {
            let (_, body) = admin_get(broker.admin_addr, "/debug/tunnels").await.ok()?;
            body.contains(&needle).then_some(())
        },
    )
    .await
}

/// The ids of the tunnels `broker` holds, as `/debug/tunnels` lists them (to tell a kept tunnel
/// from a replaced one).
pub async fn tunnel_ids(broker: &Broker) -> anyhow::Result<Vec<String>> {
    let (code, body) = admin_get(broker.admin_addr, "/debug/tunnels").await?;
    anyhow::ensure!(code == 200, "/debug/tunnels answered {code}");
    let v: serde_json::Value = serde_json::from_str(&body)?;
    Ok(v.as_array()
        .ok_or_else(|| anyhow::anyhow!("/debug/tunnels is not a list: {body}"))?
        .iter()
        .map(|t| t["id"].to_string())
        .collect())
}

/// Opens a CONNECT tunnel through the broker's plain client port; returns the stream after a
/// 200, or the status line and body of an error.
pub async fn connect(
    broker: SocketAddr,
    authority: &str,
    token: Option<&str>,
) -> anyhow::Result<Result<tokio::net::TcpStream, (u16, String)>> {
    let s = tokio::net::TcpStream::connect(broker).await?;
    s.set_nodelay(true)?;
    let auth = token
        .map(|t| format!("proxy-authorization: Bearer {t}\r\n"))
        .unwrap_or_default();
    let head = format!("CONNECT {authority} HTTP/1.1\r\nhost: {authority}\r\n{auth}\r\n");
    send_head(s, head.as_bytes()).await
}

/// Sends a raw request head (anything, even garbage) on `s` and reads the response head:
/// returns the stream after a 200, or the status code and the whole response (head and body)
/// of anything else.
pub async fn send_head<S>(mut s: S, head: &[u8]) -> anyhow::Result<Result<S, (u16, String)>>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    s.write_all(head).await?;
    s.flush().await?;
    // Read the response head byte by byte so no tunnelled byte is consumed.
    let mut head = Vec::new();
    let mut b = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        if s.read(&mut b).await? == 0 {
            anyhow::bail!(
                "broker closed during CONNECT response: {:?}",
                String::from_utf8_lossy(&head)
            );
        }
        head.push(b[0]);
    }
    let text = String::from_utf8_lossy(&head).into_owned();
    let code: u16 = text
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .context("status")?;
    if code == 200 {
        return Ok(Ok(s));
    }
    let mut body = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut body)).await;
    Ok(Err((
        code,
        format!("{text}{}", String::from_utf8_lossy(&body)),
    )))
}

/// A TCP echo server on 127.0.0.1:0 (in-process), for tests.
pub async fn echo_server() -> anyhow::Result<SocketAddr> {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let a = l.local_addr()?;
    tokio::spawn(async move {
        while let Ok((s, _)) = l.accept().await {
            tokio::spawn(async move {
                let _ = s.set_nodelay(true);
                let (mut r, mut w) = s.into_split();
                let _ = tokio::io::copy(&mut r, &mut w).await;
                use tokio::io::AsyncWriteExt;
                let _ = w.shutdown().await;
            });
        }
    });
    Ok(a)
}

/// A broker, an agent for one cluster tunnelled to it, and an echo target "inside" the cluster
/// (also the agent's API server, so `<cluster>:443` echoes too). Dropped agent first, then the
/// broker, then the hub directory.
pub struct Setup {
    pub agent: Agent,
    pub broker: Broker,
    pub echo: SocketAddr,
    pub hub: Hub,
}

impl Setup {
    /// A native-API client (`tether_client::Dialer`) on the broker's client TLS port, with the
    /// ops token and the hub CA.
    pub async fn ops_dialer(&self) -> anyhow::Result<tether_client::Dialer> {
        self.ops_dialer_at(format!("https://{}", self.broker.client_tls_addr))
            .await
    }

    /// [`Setup::ops_dialer`] on the broker's plain client port (HTTP/2 without TLS).
    pub async fn ops_dialer_plain(&self) -> anyhow::Result<tether_client::Dialer> {
        self.ops_dialer_at(format!("http://{}", self.broker.client_addr))
            .await
    }

    async fn ops_dialer_at(&self, endpoint: String) -> anyhow::Result<tether_client::Dialer> {
        Ok(tether_client::Dialer::connect(tether_client::DialerConfig {
            endpoint,
            server_name: "localhost".into(),
            ca_pem: std::fs::read_to_string(self.hub.pki.ca_path())?,
            client_cert: None,
            token: Some(tether_client::Token(OPS_TOKEN.into())),
            connect_timeout: Duration::from_secs(10),
        })
        .await?)
    }

    /// Starts everything and waits until the tunnel is registered on the broker.
    pub async fn start(
        cluster: &str,
        broker_extra: &str,
        agent_extra: &str,
    ) -> anyhow::Result<Self> {
        let hub = Hub::new()?;
        let echo = echo_server().await?;
        let broker = hub.start_broker("b1", broker_extra)?;
        let agent = hub.start_agent(
            cluster,
            cluster,
            &[vec![broker.agent_addr]],
            echo,
            agent_extra,
        )?;
        wait_agent_ready(&agent).await?;
        wait_tunnel(&broker, cluster).await?;
        Ok(Self {
            agent,
            broker,
            echo,
            hub,
        })
    }

    /// The cluster-qualified authority of the echo target.
    pub fn echo_authority(&self) -> String {
        qualified(&self.agent.cluster, self.echo)
    }

    /// `CONNECT`s to the echo target as the `ops` client; fails on anything but 200.
    pub async fn connect_echo(&self) -> anyhow::Result<tokio::net::TcpStream> {
        connect_ok(self.broker.client_addr, &self.echo_authority()).await
    }
}

/// A local TCP port that refuses connections: a socket bound to it that never listens. A port
/// taken from a listener that was then dropped can be bound again by any test running at the
/// same time (it was: a TLS client got another server's bytes where it expected a refusal);
/// this one stays reserved until dropped.
pub struct RefusingPort {
    _sock: socket2::Socket,
    pub addr: SocketAddr,
}

impl RefusingPort {
    pub fn new() -> anyhow::Result<Self> {
        let sock = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None)?;
        sock.bind(&SocketAddr::from(([127, 0, 0, 1], 0)).into())?;
        let addr = sock
            .local_addr()?
            .as_socket()
            .ok_or_else(|| anyhow::anyhow!("not an IP socket"))?;
        Ok(Self { _sock: sock, addr })
    }
}

/// `<ip>.<cluster>.tether:<port>` for an address reachable by the agent.
pub fn qualified(cluster: &str, addr: SocketAddr) -> String {
    format!("{}.{cluster}.tether:{}", addr.ip(), addr.port())
}

/// `CONNECT`s as the `ops` client; an error for anything but 200.
pub async fn connect_ok(
    broker: SocketAddr,
    authority: &str,
) -> anyhow::Result<tokio::net::TcpStream> {
    match connect(broker, authority, Some(OPS_TOKEN)).await? {
        Ok(s) => Ok(s),
        Err((code, body)) => anyhow::bail!("CONNECT {authority} answered {code}: {body}"),
    }
}

/// Set to keep every test's directory (configs, certificates, process logs) after the test.
pub const KEEP_ENV: &str = "TETHER_E2E_KEEP";

impl Hub {
    /// Prints the last 40 lines of every process log to stderr. A test that fails by its own
    /// check can call it before its assertion, so the assertion's message is the last thing
    /// printed (CI shows the end of the output).
    pub fn print_log_tails(&self) {
        let Ok(entries) = std::fs::read_dir(self.dir.path()) else {
            return;
        };
        for e in entries.flatten() {
            let p = e.path();
            if p.extension().is_some_and(|x| x == "log") {
                let text = std::fs::read_to_string(&p).unwrap_or_default();
                let lines: Vec<&str> = text.lines().collect();
                let tail = &lines[lines.len().saturating_sub(40)..];
                eprintln!("===== {} (last {} lines)", p.display(), tail.len());
                for l in tail {
                    eprintln!("{l}");
                }
            }
        }
    }
}

impl Drop for Hub {
    /// When a test panics, prints the end of every process log so the failure can be read.
    /// With [`KEEP_ENV`] set, keeps the directory and says where it is (for tests that fail by
    /// returning an error, which this cannot detect).
    fn drop(&mut self) {
        if std::env::var_os(KEEP_ENV).is_some() {
            self.dir.disable_cleanup(true);
            eprintln!("test directory kept: {}", self.dir.path().display());
        }
        if std::thread::panicking() {
            self.print_log_tails();
        }
    }
}

/// Sum of the Prometheus samples of `name` whose labels include all of `labels` (0 if none).
pub async fn metric(admin: SocketAddr, name: &str, labels: &[(&str, &str)]) -> anyhow::Result<f64> {
    let (code, body) = admin_get(admin, "/metrics").await?;
    anyhow::ensure!(code == 200, "/metrics answered {code}");
    Ok(sum_samples(&body, name, labels))
}

/// A loopback address that refuses connections for as long as this value lives: a socket bound
/// to a port the kernel chose, never listening, so a connection gets a reset. A listener bound
/// to port 0 and dropped frees its port instead, and a test running beside may bind it next and
/// answer (a health-table test once saw TLS fail against such a port where it expected the
/// target unreachable).
pub struct RefusedAddr {
    pub addr: SocketAddr,
    _held: socket2::Socket,
}

impl RefusedAddr {
    pub fn new() -> anyhow::Result<Self> {
        let s = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None)?;
        s.bind(&SocketAddr::from(([127, 0, 0, 1], 0)).into())?;
        let addr = s
            .local_addr()?
            .as_socket()
            .context("the held socket has no IP address")?;
        Ok(Self { addr, _held: s })
    }
}

/// A broker's or agent's idle-poll counters (`tether_runtime_idle_poll*`, docs/metrics.md),
/// from one `/metrics` scrape.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct IdlePolls {
    pub polls: f64,
    pub hits: f64,
    pub seconds: f64,
    pub contended: f64,
}

impl IdlePolls {
    pub async fn read(admin: SocketAddr) -> anyhow::Result<Self> {
        let (code, body) = admin_get(admin, "/metrics").await?;
        anyhow::ensure!(code == 200, "/metrics answered {code}");
        let n = |name| sum_samples(&body, name, &[]);
        Ok(Self {
            polls: n("tether_runtime_idle_polls_total"),
            hits: n("tether_runtime_idle_poll_hits_total"),
            seconds: n("tether_runtime_idle_poll_seconds_total"),
            contended: n("tether_runtime_idle_poll_contended_total"),
        })
    }

    /// What each counter gained since `before`.
    pub fn since(self, before: Self) -> Self {
        Self {
            polls: self.polls - before.polls,
            hits: self.hits - before.hits,
            seconds: self.seconds - before.seconds,
            contended: self.contended - before.contended,
        }
    }

    /// All zero: no poll at all.
    pub const ZERO: Self = Self {
        polls: 0.0,
        hits: 0.0,
        seconds: 0.0,
        contended: 0.0,
    };
}

/// Sums the samples of `name` in a Prometheus text exposition whose labels include `labels`.
pub fn sum_samples(text: &str, name: &str, labels: &[(&str, &str)]) -> f64 {
    let mut sum = 0.0;
    for line in text.lines().filter(|l| !l.starts_with('#')) {
        let Some((series, value)) = line.rsplit_once(' ') else {
            continue;
        };
        let (n, lbls) = match series.split_once('{') {
            Some((n, rest)) => (n, rest.trim_end_matches('}')),
            None => (series, ""),
        };
        if n != name {
            continue;
        }
        let all = labels
            .iter()
            .all(|(k, v)| lbls.split(',').any(|kv| kv == format!("{k}=\"{v}\"")));
        if all && let Ok(v) = value.parse::<f64>() {
            sum += v;
        }
    }
    sum
}

/// A rustls client config trusting the hub CA (`ca`), offering `alpn`, optionally presenting a
/// client certificate.
pub fn client_tls_config(
    ca: &Path,
    alpn: &[&[u8]],
    client_cert: Option<&LeafFiles>,
) -> anyhow::Result<rustls::ClientConfig> {
    tether_tls::install_default_crypto()?;
    let roots = tether_tls::reload::load_roots(ca)?;
    let b = tether_tls::client_config_builder().with_root_certificates(roots);
    let mut cfg = match client_cert {
        Some(leaf) => b.with_client_auth_cert(
            tether_tls::pem::read_certs(&leaf.cert)?,
            tether_tls::pem::read_key(&leaf.key)?,
        )?,
        None => b.with_no_client_auth(),
    };
    cfg.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    Ok(cfg)
}

/// A TLS stream to a broker's client TLS port.
pub type ClientTls = tokio_rustls::client::TlsStream<tokio::net::TcpStream>;

/// TLS (server name `localhost`) to `addr` with `cfg`.
pub async fn tls_connect(addr: SocketAddr, cfg: rustls::ClientConfig) -> anyhow::Result<ClientTls> {
    let tcp = tokio::net::TcpStream::connect(addr).await?;
    tcp.set_nodelay(true)?;
    let name = rustls::pki_types::ServerName::try_from("localhost")?;
    let tls = tokio::time::timeout(
        Duration::from_secs(10),
        tokio_rustls::TlsConnector::from(std::sync::Arc::new(cfg)).connect(name, tcp),
    )
    .await??;
    Ok(tls)
}

/// `CONNECT` over TLS (ALPN http/1.1) to a broker's client TLS port.
pub async fn connect_tls(
    addr: SocketAddr,
    cfg: rustls::ClientConfig,
    authority: &str,
    token: Option<&str>,
) -> anyhow::Result<Result<ClientTls, (u16, String)>> {
    let tls = tls_connect(addr, cfg).await?;
    let auth = token
        .map(|t| format!("proxy-authorization: Bearer {t}\r\n"))
        .unwrap_or_default();
    let head = format!("CONNECT {authority} HTTP/1.1\r\nhost: {authority}\r\n{auth}\r\n");
    send_head(tls, head.as_bytes()).await
}

/// Deterministic, position-dependent test data: a random block of [`Payload::BLOCK`] bytes;
/// chunk `i` is the block rotated by an offset that depends on `i`, so a lost, duplicated or
/// reordered chunk changes the checksum. Producing a chunk costs no computation (a slice).
pub struct Payload {
    doubled: Vec<u8>,
}

impl Payload {
    pub const BLOCK: usize = 1 << 20;

    pub fn new() -> Self {
        use rand::RngCore as _;
        let mut block = vec![0u8; Self::BLOCK];
        rand::rng().fill_bytes(&mut block);
        let mut doubled = block.clone();
        doubled.extend_from_slice(&block);
        Self { doubled }
    }

    /// Chunk `i`, `len` ≤ [`Payload::BLOCK`] bytes.
    pub fn chunk(&self, i: u64, len: usize) -> &[u8] {
        let off = (i.wrapping_mul(7_919 * 61) % Self::BLOCK as u64) as usize;
        &self.doubled[off..off + len.min(Self::BLOCK)]
    }
}

impl Default for Payload {
    fn default() -> Self {
        Self::new()
    }
}

/// Outcome of [`echo_transfer`].
#[derive(Debug)]
pub struct Transfer {
    pub sent: u64,
    pub received: u64,
    pub sent_sha256: String,
    pub received_sha256: String,
    pub elapsed: Duration,
}

impl Transfer {
    /// Bytes per second in each direction.
    pub fn throughput(&self) -> f64 {
        self.sent as f64 / self.elapsed.as_secs_f64()
    }

    /// Whether everything sent came back intact.
    pub fn intact(&self) -> bool {
        self.sent == self.received && self.sent_sha256 == self.received_sha256
    }
}

/// Writes `total` bytes of [`Payload`] to a stream connected to an echo target, half-closes,
/// and reads the echo to EOF at the same time; hashes both sides ([`Sha256`]). A read error is
/// returned as an error (never counted as EOF).
pub async fn echo_transfer<S>(
    s: S,
    payload: std::sync::Arc<Payload>,
    total: u64,
) -> anyhow::Result<Transfer>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Send + 'static,
{
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    const CHUNK: usize = 256 << 10;
    let started = std::time::Instant::now();
    let (mut rd, mut wr) = tokio::io::split(s);
    let writer = tokio::spawn(async move {
        let mut h = Sha256::new();
        let mut sent = 0u64;
        let mut i = 0u64;
        while sent < total {
            let n = (CHUNK as u64).min(total - sent) as usize;
            let c = payload.chunk(i, n);
            h.update(c);
            wr.write_all(c).await?;
            sent += n as u64;
            i += 1;
        }
        wr.shutdown().await?;
        anyhow::Ok((sent, h.hex(), wr))
    });
    let mut h = Sha256::new();
    let mut received = 0u64;
    let mut buf = vec![0u8; CHUNK];
    loop {
        let n = rd
            .read(&mut buf)
            .await
            .with_context(|| format!("read after {received} bytes"))?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
        received += n as u64;
    }
    let (sent, sent_sha256, _wr) = writer.await??;
    Ok(Transfer {
        sent,
        received,
        sent_sha256,
        received_sha256: h.hex(),
        elapsed: started.elapsed(),
    })
}

/// Incremental SHA-256 from ring (through rustls's ring provider): assembly, so fast even in a
/// debug build, where the pure-Rust `sha2` crate manages ~15 MiB/s and would dominate every
/// transfer test.
pub struct Sha256(Box<dyn rustls::crypto::hash::Context>);

impl Sha256 {
    pub fn new() -> Self {
        let suite = rustls::crypto::ring::cipher_suite::TLS13_AES_128_GCM_SHA256
            .tls13()
            .expect("a TLS 1.3 suite");
        Self(suite.common.hash_provider.start())
    }

    pub fn update(&mut self, data: &[u8]) {
        self.0.update(data);
    }

    pub fn hex(self) -> String {
        hex::encode(self.0.finish().as_ref())
    }
}

impl Default for Sha256 {
    fn default() -> Self {
        Self::new()
    }
}

/// Human-readable bytes per second.
pub fn rate(bytes_per_sec: f64) -> String {
    format!("{:.1} MiB/s", bytes_per_sec / (1 << 20) as f64)
}

/// Hub control plane (nats-server + addon-manager) for the demo.
pub mod control_plane;
/// The registration harness (hub, forward proxies, registration agents, network namespaces).
pub mod registration;

#[cfg(test)]
mod tests {
    #[test]
    fn a_refused_addr_refuses_and_keeps_its_port() -> anyhow::Result<()> {
        let refused = super::RefusedAddr::new()?;
        let e = std::net::TcpStream::connect(refused.addr).expect_err("nothing listens");
        assert_eq!(e.kind(), std::io::ErrorKind::ConnectionRefused, "{e}");
        // No listener can take the port while it is held.
        assert!(std::net::TcpListener::bind(refused.addr).is_err());
        drop(refused);
        Ok(())
    }

    use super::*;

    #[test]
    fn sha256_is_sha256() {
        let mut h = Sha256::new();
        h.update(b"ab");
        h.update(b"c");
        assert_eq!(
            h.hex(),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
    }

    #[test]
    fn sums_labelled_samples() {
        let text = "# HELP x y\nm{a=\"1\",b=\"2\"} 3\nm{a=\"1\",b=\"3\"} 4\nm 5\nmm 6\n";
        assert_eq!(sum_samples(text, "m", &[("a", "1")]), 7.0);
        assert_eq!(sum_samples(text, "m", &[("b", "3")]), 4.0);
        assert_eq!(sum_samples(text, "m", &[]), 12.0);
    }
}
