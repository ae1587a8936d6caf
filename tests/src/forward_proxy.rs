//! A real tinyproxy forward proxy on 127.0.0.1 for the demo and tests (`scripts/install-deps.sh`
//! installs it). It binds a port the kernel picked a moment before, and logs each CONNECT.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::Context as _;
use tether_test_support::{Child, wait_until};

/// A running tinyproxy.
pub struct Tinyproxy {
    pub child: Child,
    pub port: u16,
    pub log: PathBuf,
}

impl Tinyproxy {
    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// Starts tinyproxy with its config and log under `dir`.
    pub fn start(dir: &Path, name: &str) -> anyhow::Result<Self> {
        let port = std::net::TcpListener::bind("127.0.0.1:0")?
            .local_addr()?
            .port();
        let conf = dir.join(format!("{name}.conf"));
        let log = dir.join(format!("{name}.log"));
        std::fs::write(
            &conf,
            format!(
                "Port {port}\nListen 127.0.0.1\nTimeout 600\nMaxClients 1000\nLogLevel Info\nLogFile \"{}\"\nDisableViaHeader Yes\n",
                log.display()
            ),
        )?;
        let program = ["/usr/bin/tinyproxy", "/usr/sbin/tinyproxy"]
            .into_iter()
            .find(|p| Path::new(p).exists())
            .unwrap_or("tinyproxy");
        let mut cmd = Command::new(program);
        cmd.args(["-d", "-c"]).arg(&conf);
        let child = Child::spawn(name, cmd, dir)
            .context("start tinyproxy (run scripts/install-deps.sh)")?;
        wait_until(Duration::from_secs(10), "tinyproxy to listen", || {
            std::net::TcpStream::connect(("127.0.0.1", port))
                .ok()
                .map(|_| ())
        })?;
        Ok(Self { child, port, log })
    }

    /// The CONNECT requests the proxy received, from its log.
    pub fn connects(&self) -> Vec<String> {
        std::fs::read_to_string(&self.log)
            .unwrap_or_default()
            .lines()
            .filter_map(|l| l.split_once("Request ").map(|(_, r)| r.trim().to_owned()))
            .filter(|r| r.contains("CONNECT "))
            .collect()
    }
}
