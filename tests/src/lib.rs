//! Shared scaffolding for the end-to-end tests, the benchmark and the demo: writes configs for
//! real `tunnel-broker` / `tunnel-agent` processes and starts them on 127.0.0.1 with port 0.
//!
//! [`Hub::start`] starts a broker; [`Hub::start_agent`] an agent for a cluster. Both read their
//! bound addresses back from `--ready-file`. Everything is stopped (by PID) on drop.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::Context as _;
use tether_test_support::{Child, LeafFiles, Pki, bin, read_ready_file};
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
}

fn sha256_hex(s: &str) -> String {
    use sha2::Digest;
    hex::encode(sha2::Sha256::digest(s.as_bytes()))
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
        tether_tls::install_default_crypto();
        let dir = tempfile::tempdir()?;
        let pki = Pki::new(&dir.path().join("pki"))?;
        Ok(Self { dir, pki })
    }

    pub fn path(&self) -> &Path {
        self.dir.path()
    }

    /// Starts broker `id`. `extra` is appended to its YAML config (top-level keys).
    pub fn start_broker(&self, id: &str, extra: &str) -> anyhow::Result<Broker> {
        let tls = self.pki.issue(
            &format!("broker-{id}"),
            Identity::Broker { id: id.into() },
            &["localhost", "127.0.0.1", "tether-broker"],
        )?;
        let cfg = format!(
            "id: {id}\ntls:\n  cert: {}\n  key: {}\n  ca: {}\ntls_reload_interval: 200ms\nagent_listen: 127.0.0.1:0\nclient_listen: 127.0.0.1:0\nclient_tls_listen: 127.0.0.1:0\nadmin_listen: 127.0.0.1:0\ndrain_grace: 10s\nclients:\n  - name: ops\n    token_sha256: {}\n    allow:\n      - clusters: ['*']\n        targets: ['apiserver', '*:*']\n  - name: apionly\n    token_sha256: {}\n{extra}\n",
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
        let mut cmd = Command::new(bin("tunnel-broker")?);
        cmd.arg("--config")
            .arg(&config_path)
            .arg("--ready-file")
            .arg(&ready);
        let child = Child::spawn(&format!("broker-{id}"), cmd, self.path())?;
        let r = read_ready_file(&ready, START_TIMEOUT)?;
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
        let mut cmd = Command::new(bin("tunnel-agent")?);
        cmd.arg("--config")
            .arg(&config_path)
            .arg("--ready-file")
            .arg(&ready);
        let child = Child::spawn(&name, cmd, self.path())?;
        let r = read_ready_file(&ready, START_TIMEOUT)?;
        Ok(Agent {
            cluster: cluster.into(),
            admin_addr: addr(&r, "admin")?,
            child,
            tls,
        })
    }
}

fn rand_suffix() -> String {
    format!("{:08x}", rand::random::<u32>())
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

/// Opens a CONNECT tunnel through the broker's plain client port; returns the stream after a
/// 200, or the status line and body of an error.
pub async fn connect(
    broker: SocketAddr,
    authority: &str,
    token: Option<&str>,
) -> anyhow::Result<Result<tokio::net::TcpStream, (u16, String)>> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(broker).await?;
    s.set_nodelay(true)?;
    let auth = token
        .map(|t| format!("proxy-authorization: Bearer {t}\r\n"))
        .unwrap_or_default();
    s.write_all(
        format!("CONNECT {authority} HTTP/1.1\r\nhost: {authority}\r\n{auth}\r\n").as_bytes(),
    )
    .await?;
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
    let mut body = String::new();
    let _ = tokio::time::timeout(Duration::from_secs(5), s.read_to_string(&mut body)).await;
    Ok(Err((code, format!("{text}{body}"))))
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
