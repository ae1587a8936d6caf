//! The rathole peer: a Rust reverse tunnel for NAT traversal (rathole 0.5, TLS transport), in
//! the same topology as Tether and `ssh -R`.
//!
//! The hub side runs `rathole --server` (its control port and the service's visitor port on
//! 127.0.0.1); the cluster side runs `rathole --client` to it over TLS, forwarding the service
//! to the bench target. A hub-side client connects to the visitor port: rathole server → a TLS
//! data channel → rathole client → target. rathole opens one TCP + TLS data channel per visitor
//! connection (the client dials it when the server asks on the control channel), so it does
//! not multiplex: each stream has a TLS connection of its own, and a new stream pays a TCP and
//! TLS handshake between the two ends.
//!
//! TLS as rathole ships it: native-tls (OpenSSL) with its defaults (TLS 1.3, AES-256-GCM
//! first), the server's certificate from the bench hub's CA in a PKCS#12 archive, verified by
//! the client against that CA for `localhost`. `nodelay = true` on the transport and the
//! service (rathole 0.5's default, stated).
//!
//! rathole is not a Debian package: `scripts/install-bench-peers.sh` builds it from crates.io
//! (`cargo install rathole --version 0.5.0`). The bench looks for `$TETHER_BENCH_RATHOLE`,
//! then `rathole` on `PATH`, then `~/.cargo/bin/rathole`, and skips the peer (saying why) when
//! none is there. Free ports are found as for sshd (bind port 0 and close it).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::{Context as _, bail};
use tether_e2e::Hub;
use tether_test_support::Child;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

use super::ssh::{free_port, log_tail};

/// The service token both ends share (rathole requires one per service).
const TOKEN: &str = "tether-bench-rathole-token";
/// The PKCS#12 archive's password (rathole's server requires one).
const P12_PASSWORD: &str = "tether-bench";

/// A running rathole server + client pair.
pub struct RatholePeer {
    pub server: Child,
    pub client: Child,
    /// The service's visitor port on the server (what a hub-side client connects to).
    pub addr: SocketAddr,
}

impl RatholePeer {
    /// Process ids whose CPU is the peer's: server and client.
    pub fn pids(&self) -> Vec<u32> {
        vec![self.server.pid(), self.client.pid()]
    }
}

/// Writes `<side>.toml` (`side`: "server" or "client"): the side's address line, the TLS
/// transport (`tls`: its settings) with TCP_NODELAY, and the one service `target` (`service`:
/// its address line) with its token and TCP_NODELAY.
fn write_conf(
    dir: &Path,
    side: &str,
    addr: &str,
    tls: &str,
    service: &str,
) -> anyhow::Result<PathBuf> {
    let path = dir.join(format!("{side}.toml"));
    std::fs::write(
        &path,
        format!(
            "[{side}]\n{addr}\n\n[{side}.transport]\ntype = \"tls\"\n\n\
             [{side}.transport.tcp]\nnodelay = true\n\n[{side}.transport.tls]\n{tls}\n\n\
             [{side}.services.target]\ntoken = \"{TOKEN}\"\n{service}\nnodelay = true\n"
        ),
    )?;
    Ok(path)
}

fn find_rathole() -> Result<PathBuf, String> {
    let works = |p: &PathBuf| {
        Command::new(p)
            .arg("--version")
            .output()
            .is_ok_and(|o| o.status.success())
    };
    let mut candidates = Vec::new();
    if let Some(p) = std::env::var_os("TETHER_BENCH_RATHOLE") {
        candidates.push(PathBuf::from(p));
    }
    candidates.push(PathBuf::from("rathole"));
    if let Some(home) = std::env::var_os("HOME") {
        candidates.push(PathBuf::from(home).join(".cargo/bin/rathole"));
    }
    candidates
        .into_iter()
        .find(works)
        .ok_or_else(|| "no rathole (bash scripts/install-bench-peers.sh)".to_string())
}

/// Starts the rathole server and client forwarding to `target`, and returns once a byte went
/// through. `Ok(Err(reason))` when rathole is not installed.
pub async fn start(hub: &Hub, target: SocketAddr) -> anyhow::Result<Result<RatholePeer, String>> {
    let exe = match find_rathole() {
        Ok(p) => p,
        Err(why) => return Ok(Err(why)),
    };
    let dir = hub.path().join("rathole");
    std::fs::create_dir_all(&dir)?;
    let tls = hub.pki.issue(
        "rathole-server",
        tether_tls::Identity::Broker {
            id: "rathole".into(),
        },
        &["localhost"],
    )?;
    let p12 = dir.join("server.p12");
    let out = Command::new("openssl")
        .args(["pkcs12", "-export", "-out"])
        .arg(&p12)
        .arg("-inkey")
        .arg(&tls.key)
        .arg("-in")
        .arg(&tls.cert)
        .arg("-certfile")
        .arg(&tls.ca)
        .args(["-passout", &format!("pass:{P12_PASSWORD}")])
        .output()
        .context("openssl pkcs12 (apt-get install openssl)")?;
    if !out.status.success() {
        bail!(
            "openssl pkcs12 -export: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let (control, visitor) = (free_port()?, free_port()?);
    let server_conf = write_conf(
        &dir,
        "server",
        &format!("bind_addr = \"{control}\""),
        &format!(
            "pkcs12 = \"{}\"\npkcs12_password = \"{P12_PASSWORD}\"",
            p12.display()
        ),
        &format!("bind_addr = \"{visitor}\""),
    )?;
    let client_conf = write_conf(
        &dir,
        "client",
        &format!("remote_addr = \"{control}\""),
        &format!(
            "trusted_root = \"{}\"\nhostname = \"localhost\"",
            tls.ca.display()
        ),
        &format!("local_addr = \"{target}\""),
    )?;
    let spawn = |name: &str, mode: &str, conf: &PathBuf| {
        let mut cmd = Command::new(&exe);
        cmd.arg(mode).arg(conf).env("RUST_LOG", "error");
        Child::spawn(name, cmd, hub.path())
    };
    let server = spawn("bench-rathole-server", "--server", &server_conf)?;
    tether_test_support::wait_accepting(control, Duration::from_secs(10), "the rathole server")
        .await
        .with_context(|| log_tail(hub, "bench-rathole-server"))?;
    let client = spawn("bench-rathole-client", "--client", &client_conf)?;
    // The client registers the service over the control channel after it started: ready when
    // a byte goes through to the target and back (target mode `P`: one byte back).
    tether_test_support::wait_until_async(
        Duration::from_secs(15),
        &format!("rathole forwarding {visitor} to {target}"),
        || async move {
            let probe = async {
                let mut s = tokio::net::TcpStream::connect(visitor).await?;
                s.write_all(b"P").await?;
                s.read_exact(&mut [0u8; 1]).await?;
                std::io::Result::Ok(())
            };
            tokio::time::timeout(Duration::from_secs(1), probe)
                .await
                .ok()?
                .ok()
        },
    )
    .await
    .with_context(|| {
        format!(
            "{}; {}",
            log_tail(hub, "bench-rathole-client"),
            log_tail(hub, "bench-rathole-server")
        )
    })?;
    Ok(Ok(RatholePeer {
        server,
        client,
        addr: visitor,
    }))
}
