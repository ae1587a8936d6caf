//! Where the add-on agent runs: the narrow [`AddOnRuntime`] interface.
//!
//! - [`LocalRuntime`]: supervises a `tunnel-agent` child process (binary path configurable,
//!   default next to the registration-agent binary). The config file is rewritten in place and
//!   the running tunnel-agent reloads it (no restart); a child that exits is restarted with
//!   jittered backoff; on stop it gets SIGTERM by PID, then SIGKILL after
//!   [`STOP_GRACE`]. What the agent runs is read from its admin `/debug/agent` (address from
//!   its ready file): `configSha256` and `connectedBrokers`.
//! - [`KubeRuntime`] (in [`super::kube`]): a Secret (`<addon>-hub-kubeconfig` + the config) and
//!   a Deployment in the add-on's install namespace, through `kube`.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_util::sync::CancellationToken;

pub use super::kube::KubeRuntime;
use super::render::{self, CONFIG_FILE, HUB_CA_FILE, PROXY_CA_FILE, RenderedAgent};

/// Time a stopped tunnel-agent gets between SIGTERM and SIGKILL.
pub const STOP_GRACE: Duration = Duration::from_millis(2500);
/// Budget of one admin request to the tunnel-agent.
pub const ADMIN_TIMEOUT: Duration = Duration::from_secs(2);
/// Largest admin response read.
const MAX_ADMIN_RESPONSE: u64 = 1 << 20;
/// Ready file the tunnel-agent writes (admin address).
pub const READY_FILE: &str = "ready.json";
/// PID of the running tunnel-agent (for operators and test clean-up).
pub const PID_FILE: &str = "tunnel-agent.pid";

/// Errors of a runtime; each names what failed.
#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error("kubernetes: {0}")]
    Kube(String),
}

fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> RuntimeError {
    let what = what.into();
    move |source| RuntimeError::Io { what, source }
}

/// What the running add-on agent reports.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Observed {
    /// SHA-256 of the config it runs.
    pub config_sha256: String,
    /// Ids of the brokers it holds an established tunnel to.
    pub connected_brokers: Vec<String>,
    /// Why the config on disk is not running, if it is not.
    pub config_error: Option<String>,
}

/// The narrow interface between the add-on component and where the agent runs.
pub trait AddOnRuntime: Send + 'static {
    /// For logs.
    fn describe(&self) -> String;
    /// Runs the agent with this config (starting it, or updating what it watches).
    fn apply(
        &mut self,
        rendered: &RenderedAgent,
    ) -> impl Future<Output = Result<(), RuntimeError>> + Send;
    /// What the agent runs now; None while it is not running or cannot be asked.
    fn observe(&mut self) -> impl Future<Output = Option<Observed>> + Send;
    /// Stops the agent; with `remove`, also deletes its config (credentials are the caller's).
    fn stop(&mut self, remove: bool) -> impl Future<Output = ()> + Send;
}

/// A supervised `tunnel-agent` child process.
pub struct LocalRuntime {
    binary: PathBuf,
    dir: PathBuf,
    addon: String,
    supervisor: Option<(CancellationToken, tokio::task::JoinHandle<()>)>,
    restarts: prometheus::IntCounter,
    pid: Arc<Mutex<Option<u32>>>,
}

impl LocalRuntime {
    /// `dir`: where config, CA files, ready and PID files go (absolute).
    pub fn new(
        binary: PathBuf,
        dir: PathBuf,
        addon: &str,
        restarts: prometheus::IntCounter,
    ) -> Self {
        Self {
            binary,
            dir,
            addon: addon.into(),
            supervisor: None,
            restarts,
            pid: Arc::new(Mutex::new(None)),
        }
    }

    /// The default binary: `tunnel-agent` next to the running executable.
    pub fn default_binary() -> PathBuf {
        std::env::current_exe()
            .ok()
            .and_then(|p| p.parent().map(|d| d.join("tunnel-agent")))
            .unwrap_or_else(|| PathBuf::from("tunnel-agent"))
    }

    fn start_supervisor(&mut self) {
        if self
            .supervisor
            .as_ref()
            .is_some_and(|(_, h)| !h.is_finished())
        {
            return;
        }
        reap_stale(&self.dir, &self.addon);
        let stop = CancellationToken::new();
        let task = tokio::spawn(supervise(
            self.binary.clone(),
            self.dir.clone(),
            self.addon.clone(),
            stop.clone(),
            self.restarts.clone(),
            Arc::clone(&self.pid),
        ));
        self.supervisor = Some((stop, task));
    }
}

/// A tunnel-agent left running by a registration-agent that was killed (SIGKILL cannot stop
/// its children): the PID file names it; it is stopped if it still runs our config.
fn reap_stale(dir: &Path, addon: &str) {
    let Some(pid) = std::fs::read_to_string(dir.join(PID_FILE))
        .ok()
        .and_then(|s| s.trim().parse::<i32>().ok())
    else {
        return;
    };
    let config = dir.join(CONFIG_FILE);
    let ours = std::fs::read(format!("/proc/{pid}/cmdline"))
        .map(|c| {
            String::from_utf8_lossy(&c)
                .split('\0')
                .any(|a| Path::new(a) == config)
        })
        .unwrap_or(false);
    if ours {
        tracing::warn!(%addon, pid, "stopping a tunnel-agent left over from a previous run");
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(pid),
            nix::sys::signal::Signal::SIGKILL,
        );
    }
    let _ = std::fs::remove_file(dir.join(PID_FILE));
}

async fn supervise(
    binary: PathBuf,
    dir: PathBuf,
    addon: String,
    stop: CancellationToken,
    restarts: prometheus::IntCounter,
    pid_slot: Arc<Mutex<Option<u32>>>,
) {
    let mut backoff = tether_runtime::Backoff::new(tether_runtime::BackoffConfig {
        initial: Duration::from_millis(200),
        max: Duration::from_secs(10),
        ..Default::default()
    });
    let mut first = true;
    loop {
        let _ = std::fs::remove_file(dir.join(READY_FILE));
        let mut cmd = tokio::process::Command::new(&binary);
        cmd.arg("--config")
            .arg(dir.join(CONFIG_FILE))
            .arg("--ready-file")
            .arg(dir.join(READY_FILE))
            .kill_on_drop(true);
        // The data-plane memcpy setting (see tether_runtime::GLIBC_TUNABLES_DATA_PLANE).
        let current = std::env::var("GLIBC_TUNABLES").ok();
        if let Some(t) = tether_runtime::glibc_tunables_for_child(current.as_deref()) {
            cmd.env("GLIBC_TUNABLES", t);
        }
        let mut child = match cmd.spawn() {
            Ok(c) => c,
            Err(e) => {
                let d = backoff.failed();
                tracing::error!(%addon, binary = %binary.display(), error = %e, retry_in = ?d, "cannot start tunnel-agent");
                tokio::select! {
                    _ = stop.cancelled() => return,
                    _ = tokio::time::sleep(d) => continue,
                }
            }
        };
        if !first {
            restarts.inc();
        }
        first = false;
        let pid = child.id();
        if let Ok(mut p) = pid_slot.lock() {
            *p = pid;
        }
        if let Some(pid) = pid {
            let _ = render::write_atomic(&dir, PID_FILE, &format!("{pid}\n"), 0o644);
        }
        tracing::info!(%addon, pid = ?pid, "tunnel-agent started");
        let started = std::time::Instant::now();
        tokio::select! {
            status = child.wait() => {
                let d = if started.elapsed() > Duration::from_secs(30) {
                    backoff.reset();
                    backoff.failed()
                } else {
                    backoff.failed()
                };
                tracing::warn!(%addon, status = ?status, restart_in = ?d, "tunnel-agent exited; restarting");
                tokio::select! {
                    _ = stop.cancelled() => return,
                    _ = tokio::time::sleep(d) => {}
                }
            }
            _ = stop.cancelled() => {
                if let Some(pid) = pid {
                    let _ = nix::sys::signal::kill(
                        nix::unistd::Pid::from_raw(pid as i32),
                        nix::sys::signal::Signal::SIGTERM,
                    );
                }
                match tokio::time::timeout(STOP_GRACE, child.wait()).await {
                    Ok(_) => {}
                    Err(_) => {
                        tracing::warn!(%addon, pid = ?pid, "tunnel-agent did not stop in time: SIGKILL");
                        let _ = child.kill().await;
                    }
                }
                tracing::info!(%addon, pid = ?pid, "tunnel-agent stopped");
                let _ = std::fs::remove_file(dir.join(PID_FILE));
                if let Ok(mut p) = pid_slot.lock() {
                    *p = None;
                }
                return;
            }
        }
    }
}

/// GET `path` from `addr` (HTTP/1.1, Connection: close), within [`ADMIN_TIMEOUT`].
pub async fn admin_get(addr: &str, path: &str) -> Option<String> {
    let work = async {
        let mut s = tokio::net::TcpStream::connect(addr).await.ok()?;
        let req = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
        s.write_all(req.as_bytes()).await.ok()?;
        let mut buf = Vec::new();
        s.take(MAX_ADMIN_RESPONSE)
            .read_to_end(&mut buf)
            .await
            .ok()?;
        let text = String::from_utf8_lossy(&buf).into_owned();
        let (head, body) = text.split_once("\r\n\r\n")?;
        head.starts_with("HTTP/1.1 200").then(|| body.to_string())
    };
    tokio::time::timeout(ADMIN_TIMEOUT, work)
        .await
        .ok()
        .flatten()
}

/// Reads `/debug/agent` of the tunnel-agent whose ready file is in `dir`.
pub async fn observe_dir(dir: &Path) -> Option<Observed> {
    let ready = std::fs::read_to_string(dir.join(READY_FILE)).ok()?;
    let v: serde_json::Value = serde_json::from_str(&ready).ok()?;
    let addr = v["admin"].as_str()?.to_string();
    let body = admin_get(&addr, "/debug/agent").await?;
    let v: serde_json::Value = serde_json::from_str(&body).ok()?;
    Some(Observed {
        config_sha256: v["configSha256"].as_str()?.to_string(),
        connected_brokers: v["connectedBrokers"]
            .as_array()
            .map(|a| {
                a.iter()
                    .filter_map(|x| x.as_str().map(str::to_string))
                    .collect()
            })
            .unwrap_or_default(),
        config_error: v["configError"].as_str().map(str::to_string),
    })
}

impl AddOnRuntime for LocalRuntime {
    fn describe(&self) -> String {
        format!("local tunnel-agent process ({})", self.dir.display())
    }

    async fn apply(&mut self, r: &RenderedAgent) -> Result<(), RuntimeError> {
        let dir = &self.dir;
        render::write_atomic(dir, HUB_CA_FILE, &r.hub_ca_pem, 0o644)
            .map_err(io(format!("writing {}", dir.join(HUB_CA_FILE).display())))?;
        if let Some(p) = &r.proxy_ca_pem {
            render::write_atomic(dir, PROXY_CA_FILE, p, 0o644)
                .map_err(io(format!("writing {}", dir.join(PROXY_CA_FILE).display())))?;
        }
        // 0600: the config may carry a proxy password.
        render::write_atomic(dir, CONFIG_FILE, &r.config_yaml, 0o600)
            .map_err(io(format!("writing {}", dir.join(CONFIG_FILE).display())))?;
        self.start_supervisor();
        Ok(())
    }

    async fn observe(&mut self) -> Option<Observed> {
        self.pid.lock().ok().and_then(|p| *p)?;
        observe_dir(&self.dir).await
    }

    async fn stop(&mut self, remove: bool) {
        if let Some((stop, task)) = self.supervisor.take() {
            stop.cancel();
            let _ = tokio::time::timeout(STOP_GRACE + Duration::from_secs(1), task).await;
        }
        if remove {
            match std::fs::remove_dir_all(&self.dir) {
                Ok(()) => {
                    tracing::info!(addon = %self.addon, dir = %self.dir.display(), "add-on agent config removed")
                }
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => {
                    tracing::warn!(addon = %self.addon, error = %e, "cannot remove the add-on agent config")
                }
            }
        }
    }
}
