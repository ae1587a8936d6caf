//! The `ssh -R` peer: OpenSSH's remote port forward, the encrypted tunnel most operators would
//! reach for, in the same topology as Tether.
//!
//! The hub side runs an unprivileged-style `sshd` (its own config, host key and
//! `authorized_keys` in the bench's temp dir, listening on 127.0.0.1 at a free port); the
//! cluster side runs `ssh -N -R 127.0.0.1:F:<target>` to it with `aes128-gcm@openssh.com`. A
//! hub-side client connects to `127.0.0.1:F` (sshd's forwarded port): sshd → one SSH
//! connection → ssh → target, i.e. "the hub reaches a service inside the cluster".
//!
//! TCP_NODELAY: OpenSSH has no option for it; it sets it on the SSH connection (both ends) for
//! an interactive session, so the client runs `ssh -tt … exec sleep …` (a pty session) rather
//! than `ssh -N`, whose sshd end keeps Nagle on (measured: 42 ms p50 per new stream, the
//! delayed-ACK timer). sshd sets it on the sockets it accepts for forwarded ports.
//!
//! Free ports are found by binding port 0 and closing it (as for stunnel: sshd and `ssh -R`
//! cannot report a port they bound), a race only with other programs binding ports at that
//! moment.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::{Context as _, bail};
use tether_e2e::Hub;
use tether_test_support::Child;

/// A running `sshd` + `ssh -R` pair.
pub struct SshPeer {
    pub sshd: Child,
    pub client: Child,
    /// The forwarded port on sshd's side (what a hub-side client connects to).
    pub addr: SocketAddr,
}

impl SshPeer {
    /// Process ids whose CPU is the peer's: the ssh client, sshd and every process sshd forked
    /// for the connection.
    pub fn pids(&self) -> Vec<u32> {
        let mut v = vec![self.client.pid(), self.sshd.pid()];
        v.extend(descendants(self.sshd.pid()));
        v
    }
}

/// Why the peer cannot run here, if it cannot (the row then says "skipped: …").
fn find_tools() -> Result<PathBuf, String> {
    let sshd = ["/usr/sbin/sshd", "/usr/local/sbin/sshd", "/sbin/sshd"]
        .into_iter()
        .map(PathBuf::from)
        .find(|p| p.is_file())
        .ok_or("no sshd (apt-get install openssh-server)")?;
    for tool in ["ssh", "ssh-keygen"] {
        if Command::new(tool).arg("-V").output().is_err() {
            return Err(format!("no {tool} (apt-get install openssh-client)"));
        }
    }
    Ok(sshd)
}

pub fn free_port() -> anyhow::Result<SocketAddr> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?)
}

fn keygen(path: &Path) -> anyhow::Result<()> {
    let out = Command::new("ssh-keygen")
        .args(["-q", "-t", "ed25519", "-N", "", "-C", "tether-bench", "-f"])
        .arg(path)
        .output()
        .context("ssh-keygen")?;
    if !out.status.success() {
        bail!(
            "ssh-keygen {}: {}",
            path.display(),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(())
}

/// Starts sshd and `ssh -R` forwarding to `target`. `Ok(Err(reason))` when OpenSSH is missing.
pub async fn start(hub: &Hub, target: SocketAddr) -> anyhow::Result<Result<SshPeer, String>> {
    let sshd_exe = match find_tools() {
        Ok(p) => p,
        Err(why) => return Ok(Err(why)),
    };
    let dir = hub.path().join("ssh");
    std::fs::create_dir_all(&dir)?;
    let (host_key, user_key) = (dir.join("host_key"), dir.join("user_key"));
    keygen(&host_key)?;
    keygen(&user_key)?;
    let authorized = dir.join("authorized_keys");
    std::fs::copy(user_key.with_extension("pub"), &authorized)?;
    let id = |flag: &str| -> anyhow::Result<String> {
        let out = Command::new("id").arg(flag).output().context("id")?;
        Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
    };
    let root = id("-u")? == "0";
    if root {
        // sshd started by root always separates privileges and needs its (empty) chroot dir.
        let privsep = Path::new("/run/sshd");
        if !privsep.exists() {
            std::fs::create_dir_all(privsep).context("creating /run/sshd for sshd")?;
        }
    }
    let user = id("-un")?;
    let (listen, forward) = (free_port()?, free_port()?);
    let config = dir.join("sshd_config");
    std::fs::write(
        &config,
        format!(
            "ListenAddress {listen}\nHostKey {}\nAuthorizedKeysFile {}\nPidFile {}\n\
             StrictModes no\nPubkeyAuthentication yes\nPasswordAuthentication no\n\
             KbdInteractiveAuthentication no\nUsePAM no\nPermitRootLogin prohibit-password\n\
             AllowTcpForwarding yes\nGatewayPorts no\nCiphers aes128-gcm@openssh.com\n\
             Compression no\nLogLevel ERROR\n",
            host_key.display(),
            authorized.display(),
            dir.join("sshd.pid").display()
        ),
    )?;
    let mut cmd = Command::new(&sshd_exe);
    cmd.args(["-D", "-e", "-f"]).arg(&config);
    let sshd = Child::spawn("bench-sshd", cmd, hub.path())?;
    tether_test_support::wait_accepting(listen, Duration::from_secs(10), "sshd")
        .await
        .with_context(|| log_tail(hub, "bench-sshd"))?;
    let mut cmd = Command::new("ssh");
    // `-tt` + a command (not `-N`): an interactive session, for which both ssh and sshd set
    // TCP_NODELAY on the SSH connection (sshd sets it only for sessions with a pty).
    cmd.args(["-F", "/dev/null", "-n", "-tt", "-p"])
        .arg(listen.port().to_string())
        .arg("-i")
        .arg(&user_key)
        .args([
            "-o",
            "IdentitiesOnly=yes",
            "-o",
            "BatchMode=yes",
            "-o",
            "StrictHostKeyChecking=no",
            "-o",
            "UserKnownHostsFile=/dev/null",
            "-o",
            "ExitOnForwardFailure=yes",
            "-o",
            "Compression=no",
            "-o",
            "LogLevel=ERROR",
            "-c",
            "aes128-gcm@openssh.com",
            "-R",
        ])
        .arg(format!("127.0.0.1:{}:{target}", forward.port()))
        .arg(format!("{user}@127.0.0.1"))
        .args(["exec", "sleep", "2147483647"]);
    let client = Child::spawn("bench-ssh", cmd, hub.path())?;
    tether_test_support::wait_accepting(forward, Duration::from_secs(15), "the ssh -R forward")
        .await
        .with_context(|| {
            format!(
                "{}; {}",
                log_tail(hub, "bench-ssh"),
                log_tail(hub, "bench-sshd")
            )
        })?;
    Ok(Ok(SshPeer {
        sshd,
        client,
        addr: forward,
    }))
}

pub fn log_tail(hub: &Hub, name: &str) -> String {
    let text = std::fs::read_to_string(hub.path().join(format!("{name}.log"))).unwrap_or_default();
    let tail: Vec<&str> = text.lines().rev().take(5).collect();
    format!(
        "{name} log: {}",
        tail.into_iter().rev().collect::<Vec<_>>().join(" | ")
    )
}

/// Every live process below `pid` (from `/proc/*/stat`).
fn descendants(pid: u32) -> Vec<u32> {
    let mut parent_of = Vec::new();
    if let Ok(dir) = std::fs::read_dir("/proc") {
        for e in dir.flatten() {
            let Some(p) = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else {
                continue;
            };
            let Ok(stat) = std::fs::read_to_string(format!("/proc/{p}/stat")) else {
                continue;
            };
            // "pid (comm) state ppid …"; comm may hold spaces and parentheses.
            let ppid = stat
                .rsplit_once(')')
                .and_then(|(_, rest)| rest.split_whitespace().nth(1)?.parse::<u32>().ok());
            if let Some(pp) = ppid {
                parent_of.push((p, pp));
            }
        }
    }
    let mut out = Vec::new();
    let mut frontier = vec![pid];
    while let Some(p) = frontier.pop() {
        for &(c, pp) in &parent_of {
            if pp == p && !out.contains(&c) {
                out.push(c);
                frontier.push(c);
            }
        }
    }
    out
}
