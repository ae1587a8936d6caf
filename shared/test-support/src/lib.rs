//! Helpers for tests, benchmarks and the demo.
//!
//! - [`Pki`]: a CA (the hub's own [`HubCa`]) and leaf certificates written to a directory.
//! - [`Child`]: a real child process (a Tether binary, an echo server…) that is sent SIGTERM and
//!   then killed, by PID, when dropped — tests never leave processes behind and never touch
//!   processes they did not start.
//! - [`wait_until`]: polls a condition until a deadline (no fixed sleeps in tests).
//! - [`bin`]: path of a workspace binary built next to the test executable.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use tether_pki::{HubCa, Leaf};
use tether_tls::Identity;

/// A throwaway PKI in a directory: `ca.crt`, `ca.key`, and `<name>.crt` / `<name>.key` leaves.
pub struct Pki {
    pub dir: PathBuf,
    pub ca: HubCa,
}

/// Paths of an issued leaf.
#[derive(Debug, Clone)]
pub struct LeafFiles {
    pub cert: PathBuf,
    pub key: PathBuf,
    pub ca: PathBuf,
}

impl Pki {
    pub fn new(dir: &Path) -> anyhow::Result<Self> {
        std::fs::create_dir_all(dir)?;
        let ca = HubCa::generate("tether-test-ca", Duration::from_secs(86_400))?;
        std::fs::write(dir.join("ca.crt"), ca.cert_pem())?;
        std::fs::write(dir.join("ca.key"), ca.key_pem())?;
        Ok(Self {
            dir: dir.to_owned(),
            ca,
        })
    }

    pub fn ca_path(&self) -> PathBuf {
        self.dir.join("ca.crt")
    }

    /// Issues `<name>.crt/.key` for `identity` (its common name and organisations), valid for
    /// a day, with server-auth usage and these SANs when any are given.
    pub fn issue(
        &self,
        name: &str,
        identity: Identity,
        sans: &[&str],
    ) -> anyhow::Result<LeafFiles> {
        let sans: Vec<String> = sans.iter().map(|s| (*s).to_owned()).collect();
        let leaf = self.ca.issue_leaf(&Leaf {
            common_name: &identity.common_name(),
            organizations: &identity.organizations(),
            sans: &sans,
            server: !sans.is_empty(),
            lifetime: Duration::from_secs(86_400),
        })?;
        let cert = self.dir.join(format!("{name}.crt"));
        let key = self.dir.join(format!("{name}.key"));
        std::fs::write(&cert, &leaf.cert_pem)?;
        std::fs::write(&key, &leaf.key_pem)?;
        Ok(LeafFiles {
            cert,
            key,
            ca: self.ca_path(),
        })
    }
}

/// A child process stopped (SIGTERM, then SIGKILL after a grace) when dropped.
pub struct Child {
    pub name: String,
    inner: Option<std::process::Child>,
    log: PathBuf,
}

impl Child {
    /// Spawns `cmd`; stdout/stderr go to `<log_dir>/<name>.log`.
    pub fn spawn(name: &str, mut cmd: Command, log_dir: &Path) -> anyhow::Result<Self> {
        let log_path = log_dir.join(format!("{name}.log"));
        let log = std::fs::File::create(&log_path)?;
        cmd.stdout(Stdio::from(log.try_clone()?))
            .stderr(Stdio::from(log));
        let inner = cmd.spawn().with_context(|| format!("spawn {name}"))?;
        Ok(Self {
            name: name.to_owned(),
            inner: Some(inner),
            log: log_path,
        })
    }

    /// Where the process's stdout and stderr go.
    pub fn log_path(&self) -> &Path {
        &self.log
    }

    /// Waits for the process's ready file like [`read_ready_file`], but fails at once — with
    /// the exit status and the end of its log — if the process exits first.
    pub fn read_ready_file(
        &mut self,
        path: &Path,
        timeout: Duration,
    ) -> anyhow::Result<serde_json::Value> {
        let mut exited = None;
        let res = wait_until(timeout, &format!("ready file {}", path.display()), || {
            if let Some(text) = std::fs::read_to_string(path).ok()
                && let Ok(v) = serde_json::from_str(&text)
            {
                return Some(Some(v));
            }
            if let Some(status) = self.try_wait() {
                exited = Some(status);
                return Some(None);
            }
            None
        });
        match res? {
            Some(v) => Ok(v),
            None => {
                let log = std::fs::read_to_string(&self.log).unwrap_or_default();
                let tail: Vec<&str> = log.lines().rev().take(15).collect();
                let tail: Vec<&str> = tail.into_iter().rev().collect();
                bail!(
                    "{} exited ({}) before writing its ready file; last log lines:\n{}",
                    self.name,
                    exited.map_or_else(|| "unknown status".into(), |s| s.to_string()),
                    tail.join("\n")
                )
            }
        }
    }

    pub fn pid(&self) -> u32 {
        self.inner.as_ref().map(|c| c.id()).unwrap_or(0)
    }

    /// Sends SIGTERM (graceful drain).
    pub fn terminate(&self) {
        if let Some(c) = &self.inner {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(c.id() as i32),
                nix::sys::signal::Signal::SIGTERM,
            );
        }
    }

    /// Kills with SIGKILL at once and reaps.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.inner.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Whether the process has exited; returns its status if so.
    pub fn try_wait(&mut self) -> Option<std::process::ExitStatus> {
        self.inner
            .as_mut()
            .and_then(|c| c.try_wait().ok().flatten())
    }

    /// Waits up to `timeout` for exit after a `terminate`.
    pub fn wait_exit(&mut self, timeout: Duration) -> anyhow::Result<std::process::ExitStatus> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(s) = self.try_wait() {
                self.inner = None;
                return Ok(s);
            }
            if Instant::now() > deadline {
                bail!("{} did not exit within {timeout:?}", self.name);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Child {
    fn drop(&mut self) {
        if self.inner.is_some() {
            self.terminate();
            let _ = self.wait_exit(Duration::from_secs(3));
            self.kill();
        }
    }
}

/// Polls `cond` every 20 ms until it returns `Some`, failing after `timeout` with `what`.
pub fn wait_until<T>(
    timeout: Duration,
    what: &str,
    mut cond: impl FnMut() -> Option<T>,
) -> anyhow::Result<T> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(v) = cond() {
            return Ok(v);
        }
        if Instant::now() > deadline {
            bail!("timed out after {timeout:?} waiting for {what}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Async variant of [`wait_until`].
pub async fn wait_until_async<T, F, Fut>(
    timeout: Duration,
    what: &str,
    mut cond: F,
) -> anyhow::Result<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(v) = cond().await {
            return Ok(v);
        }
        if Instant::now() > deadline {
            bail!("timed out after {timeout:?} waiting for {what}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Waits until something accepts TCP connections on `addr` (a server that was just spawned),
/// failing after `timeout` with `what` ("sshd", "the stunnel client", ...) in the message.
pub async fn wait_accepting(
    addr: std::net::SocketAddr,
    timeout: Duration,
    what: &str,
) -> anyhow::Result<()> {
    wait_until_async(
        timeout,
        &format!("{what} accepting on {addr}"),
        || async move { tokio::net::TcpStream::connect(addr).await.ok().map(drop) },
    )
    .await
}

/// Reads a JSON ready-file written by a Tether binary, waiting for it to appear.
pub fn read_ready_file(path: &Path, timeout: Duration) -> anyhow::Result<serde_json::Value> {
    wait_until(timeout, &format!("ready file {}", path.display()), || {
        let text = std::fs::read_to_string(path).ok()?;
        serde_json::from_str(&text).ok()
    })
}

/// Path of a workspace binary (`target/<profile>/<name>`), found next to the running test
/// executable. Build binaries first: `cargo build --workspace --bins`.
pub fn bin(name: &str) -> anyhow::Result<PathBuf> {
    if let Ok(dir) = std::env::var("TETHER_BIN_DIR") {
        return Ok(PathBuf::from(dir).join(name));
    }
    let exe = std::env::current_exe()?;
    let mut dir = exe.parent().map(Path::to_path_buf);
    while let Some(d) = dir {
        let candidate = d.join(name);
        if candidate.is_file() {
            return Ok(candidate);
        }
        dir = d.parent().map(Path::to_path_buf);
    }
    bail!(
        "binary {name} not found near {}; run `cargo build --workspace --bins` first",
        exe.display()
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ready_wait_fails_at_once_with_the_log_when_the_process_exits() {
        let dir = tempfile::tempdir().unwrap();
        let mut cmd = Command::new("sh");
        cmd.args(["-c", "echo 'config: bad field'; exit 3"]);
        let mut child = Child::spawn("quitter", cmd, dir.path()).unwrap();
        let started = Instant::now();
        let err = child
            .read_ready_file(&dir.path().join("never.ready"), Duration::from_secs(30))
            .unwrap_err()
            .to_string();
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "waited for the timeout"
        );
        assert!(
            err.contains("exited") && err.contains("config: bad field"),
            "{err}"
        );
    }

    #[test]
    fn issued_leaves_carry_their_identity() -> anyhow::Result<()> {
        let dir = tempfile::tempdir()?;
        let pki = Pki::new(dir.path())?;
        for (name, id, sans) in [
            ("agent", Identity::tunnel_agent("c1", "a1"), &[][..]),
            (
                "broker",
                Identity::Broker { id: "b1".into() },
                &["localhost", "127.0.0.1"][..],
            ),
        ] {
            let files = pki.issue(name, id.clone(), sans)?;
            let pem = std::fs::read_to_string(&files.cert)?;
            let der = tether_pki::pem_certificates(&pem).remove(0);
            assert_eq!(Identity::from_certificate(&der)?, id);
            tether_pki::verify_issued_by(
                der.as_ref(),
                pki.ca.cert_pem(),
                std::time::SystemTime::now(),
            )?;
        }
        Ok(())
    }
}
