//! The README's main job: a local hub (NATS control plane with the addon-manager, two brokers
//! that announce themselves on NATS and relay for each other, a health-prober on NATS) and two
//! simulated managed clusters that reach the hub only through a forward proxy (tinyproxy).
//!
//! Each cluster runs the real add-on chain: a `registration-agent --addon cluster-proxy` with a
//! bootstrap kubeconfig from `tetherctl join` (proxy URL in it) asks to join, is accepted with
//! `tetherctl accept`, obtains the add-on's credentials, fetches the add-on config the hub
//! builds from the resources applied with `tetherctl apply -f` (ClusterManagementAddOn,
//! AddOnDeploymentConfig with the proxy, ManagedProxyConfiguration) and the brokers' presence,
//! and supervises a tunnel-agent that holds a tunnel to both brokers through the proxy; it
//! renews the add-on lease with the brokers the tunnel-agent is connected to. The demo then
//! shows the `tetherctl proxy health` table (the same library code: ManagedClusters, the
//! cluster-proxy ManagedClusterAddOns and the prober's `tether.v1.health.get` answer),
//! requests reaching each cluster's API server and an in-cluster service through the tunnels,
//! a request the hub's client policy refuses, and what happens when edge-b's agent stops
//! (SIGTERM to its registration-agent, which stops its tunnel-agent): PROBED HEALTH False at
//! the next probe, AVAILABLE False once the 1 s add-on lease lapses.
//!
//! As root (with `ip`), the demo builds network namespaces — hub ↔ proxy ↔ edge-a / edge-b, no
//! forwarding in the proxy namespace — and runs itself again inside the hub namespace; each
//! cluster's registration-agent (and so its tunnel-agent), API server stand-in and web service
//! run in that cluster's namespace, reaching the hub only through tinyproxy. Otherwise (or with
//! `--loopback`) everything is on loopback.
//!
//! Ctrl-C (SIGINT) stops every process the demo started, by PID (registration-agents first, so
//! they stop their tunnel-agents), and deletes the demo's network namespaces.
//!
//! Kubernetes cannot run here: each cluster's "API server" is a real TLS server on loopback
//! (`tether_e2e::apiserver`), its "service" a small HTTP server.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use tether_client::{Dialer, DialerConfig, Token};
use tether_control::health::{proxy_health, render_table};
use tether_control::store::HubStore;
use tether_e2e::apiserver::{FakeApiServer, KUBE_TOKEN};
use tether_e2e::control_plane::{
    AddonAgent, AddonAgentSpec, ControlPlane, broker_control_plane_yaml, cluster_proxy_resources,
    join, tunnel_hub_from_ca,
};
use tether_e2e::forward_proxy::Tinyproxy;
use tether_e2e::netns;
use tether_e2e::{Hub, OPS_TOKEN, admin_get, connect, wait_tunnel};
use tether_test_support::wait_until_async;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

async fn web_service(cluster: &'static str) -> anyhow::Result<SocketAddr> {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = l.local_addr()?;
    tokio::spawn(async move {
        while let Ok((mut s, _)) = l.accept().await {
            tokio::spawn(async move {
                let mut buf = vec![0u8; 4096];
                let _ = s.read(&mut buf).await;
                let body = format!("hello from the web service inside cluster {cluster}\n");
                let resp = format!(
                    "HTTP/1.1 200 OK\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                    body.len()
                );
                let _ = s.write_all(resp.as_bytes()).await;
            });
        }
    });
    Ok(addr)
}

/// The `tetherctl proxy health` rows once `ok` accepts them.
async fn wait_table(
    client: &async_nats::Client,
    store: &HubStore,
    what: &str,
    ok: impl Fn(&[tether_control::health::ProxyHealthRow]) -> bool,
) -> anyhow::Result<Vec<tether_control::health::ProxyHealthRow>> {
    wait_until_async(Duration::from_secs(30), what, || async {
        let h = proxy_health(client, store, None).await.ok()?;
        ok(&h.rows).then_some(h.rows)
    })
    .await
}

// ---------------------------------------------------------------- network namespaces (root)

/// Namespaces of the demo: hub ↔ proxy ↔ edge-a / edge-b; the proxy namespace does not forward,
/// so the clusters reach the hub only through tinyproxy and the hub cannot reach them at all.
const NETNS_ENV: &str = "TETHER_DEMO_NETNS";
const HUB_IP: &str = "10.78.2.2";
/// The proxy namespace's address on the hub link: the one proxy URL for both clusters (a
/// packet for it reaches the proxy namespace from either edge link without any forwarding).
const PROXY_IP: &str = "10.78.2.1";
const PROXY_PORT: u16 = 3128;
/// (cluster, edge address, proxy address on that link, subnet)
const EDGES: [(&str, &str, &str, &str); 2] = [
    ("edge-a", "10.78.1.1", "10.78.1.2", "10.78.1.0/24"),
    ("edge-b", "10.78.3.1", "10.78.3.2", "10.78.3.0/24"),
];
/// Ports inside each edge namespace (each has its own loopback).
const EDGE_API_PORT: u16 = 6443;
const EDGE_WEB_PORT: u16 = 8080;

/// Names of the namespaces (`<tag>h`, `<tag>p`, `<tag>a`, `<tag>b`).
#[derive(Clone, Debug)]
struct Netns {
    hub: String,
    proxy: String,
    edges: [String; 2],
}

impl Netns {
    fn from_tag(tag: &str) -> Self {
        Self {
            hub: format!("{tag}h"),
            proxy: format!("{tag}p"),
            edges: [format!("{tag}a"), format!("{tag}b")],
        }
    }

    fn all(&self) -> Vec<&String> {
        vec![&self.hub, &self.proxy, &self.edges[0], &self.edges[1]]
    }
}

/// Creates the namespaces and links (addresses only inside them).
fn create_netns(n: &Netns, tag: &str) -> anyhow::Result<()> {
    netns::add(&n.all())?;
    let (ph, hp) = (format!("{tag}ph"), format!("{tag}hp"));
    netns::veth((&n.proxy, &ph, PROXY_IP), (&n.hub, &hp, HUB_IP))?;
    for (i, (_, edge_ip, proxy_ip, subnet)) in EDGES.iter().enumerate() {
        let (e, p) = (format!("{tag}e{i}"), format!("{tag}p{i}"));
        netns::veth((&n.edges[i], &e, edge_ip), (&n.proxy, &p, proxy_ip))?;
        // Routes towards the hub exist, but the proxy namespace does not forward.
        netns::route(&n.edges[i], "10.78.2.0/24", proxy_ip)?;
        netns::route(&n.hub, subnet, PROXY_IP)?;
    }
    netns::no_forwarding(&n.proxy)
}

fn delete_netns(n: &Netns) {
    for ns in n.all() {
        // Anything still running in the namespace (the inner demo was killed before it could
        // stop its children): killed by PID before the namespace goes.
        if let Ok(o) = std::process::Command::new("ip")
            .args(["netns", "pids", ns])
            .output()
        {
            for pid in String::from_utf8_lossy(&o.stdout)
                .split_whitespace()
                .filter_map(|p| p.parse::<i32>().ok())
            {
                let _ = nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(pid),
                    nix::sys::signal::Signal::SIGKILL,
                );
            }
        }
        let _ = std::process::Command::new("ip")
            .args(["netns", "del", ns])
            .status();
    }
}

/// As root with `ip`: builds the namespaces and runs this demo again inside the hub namespace.
/// Returns None when namespaces are not usable (then the demo runs on loopback). On Ctrl-C the
/// inner demo gets SIGINT (by PID) and stops its processes; whatever is still running in the
/// namespaces after it is killed by PID, and the namespaces are deleted.
fn run_in_netns() -> Option<anyhow::Result<()>> {
    if std::env::var_os(NETNS_ENV).is_some() || std::env::args().any(|a| a == "--loopback") {
        return None;
    }
    let root = std::process::Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "0");
    if !root || std::process::Command::new("ip").arg("-V").output().is_err() {
        println!(
            "(not root: everything runs on loopback; as root the clusters get network namespaces)"
        );
        return None;
    }
    let tag = format!("td{}", std::process::id() % 100_000);
    let n = Netns::from_tag(&tag);
    if let Err(e) = create_netns(&n, &tag) {
        delete_netns(&n);
        println!("(network namespaces unavailable: {e:#}; running on loopback)");
        return None;
    }
    println!(
        "== network namespaces: hub {} ({HUB_IP}) ↔ proxy {} ({PROXY_IP}, no forwarding) ↔ clusters {} / {}",
        n.hub, n.proxy, n.edges[0], n.edges[1]
    );
    let r = (|| -> anyhow::Result<bool> {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        rt.block_on(async {
            let mut child = tokio::process::Command::new("ip")
                .args(["netns", "exec", &n.hub])
                .arg(std::env::current_exe()?)
                .env(NETNS_ENV, &tag)
                .spawn()?;
            let status = tokio::select! {
                s = child.wait() => s?,
                _ = tokio::signal::ctrl_c() => {
                    // `ip netns exec` execs the demo: this PID is the inner demo's.
                    if let Some(pid) = child.id() {
                        let _ = nix::sys::signal::kill(
                            nix::unistd::Pid::from_raw(pid as i32),
                            nix::sys::signal::Signal::SIGINT,
                        );
                    }
                    if tokio::time::timeout(Duration::from_secs(20), child.wait()).await.is_err() {
                        let _ = child.kill().await;
                    }
                    return Ok(true);
                }
            };
            // 130: the inner demo was interrupted (Ctrl-C reaches the whole process group).
            if status.code() == Some(130) {
                return Ok(true);
            }
            anyhow::ensure!(
                status.success(),
                "demo in the hub namespace failed: {status}"
            );
            Ok(false)
        })
    })();
    delete_netns(&n);
    match r {
        Ok(true) => {
            println!(
                "== network namespaces {} deleted",
                n.all()
                    .iter()
                    .map(|s| s.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            );
            std::process::exit(130);
        }
        Ok(false) => Some(Ok(())),
        Err(e) => Some(Err(e)),
    }
}

/// The cluster-side API server stand-in when it must run inside a namespace (a process).
const APISERVER_PY: &str = r#"
import http.server, json, ssl, sys
cert, key, port, token = sys.argv[1:5]
VERSION = {"major": "1", "minor": "32", "gitVersion": "v1.32.0-tether-test", "gitCommit": "",
           "gitTreeState": "", "buildDate": "", "goVersion": "", "compiler": "", "platform": "linux/amd64"}
class H(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def do_GET(self):
        if self.path in ("/livez", "/healthz", "/readyz"):
            code, body = 200, b"ok"
        elif self.path == "/version" and self.headers.get("Authorization") == "Bearer " + token:
            code, body = 200, json.dumps(VERSION).encode()
        elif self.path == "/version":
            code, body = 401, b'{"kind":"Status","code":401}'
        else:
            code, body = 404, b'{"kind":"Status","code":404}'
        self.send_response(code)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a):
        pass
srv = http.server.ThreadingHTTPServer(("127.0.0.1", int(port)), H)
ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
ctx.load_cert_chain(cert, key)
ctx.set_alpn_protocols(["http/1.1"])
srv.socket = ctx.wrap_socket(srv.socket, server_side=True)
srv.serve_forever()
"#;

/// One simulated cluster's API server and web service.
struct ClusterSide {
    /// Where the tunnel-agent sends `<cluster>:443`, as seen from the agent.
    api: SocketAddr,
    web: SocketAddr,
    _api_server: Option<FakeApiServer>,
    _procs: Vec<tether_test_support::Child>,
}

async fn cluster_side(
    hub: &Hub,
    cluster: &'static str,
    netns: Option<&str>,
) -> anyhow::Result<ClusterSide> {
    let Some(ns) = netns else {
        let api = FakeApiServer::start(hub).await?;
        return Ok(ClusterSide {
            api: api.addr,
            web: web_service(cluster).await?,
            _api_server: Some(api),
            _procs: Vec::new(),
        });
    };
    let leaf = hub.pki.issue(
        &format!("apiserver-{cluster}"),
        tether_tls::Identity::Hub {
            component: "kube-apiserver".into(),
        },
        &["kubernetes.default.svc", "localhost"],
    )?;
    let script = hub.path().join("apiserver.py");
    std::fs::write(&script, APISERVER_PY)?;
    let mut api = tether_e2e::command_in(Some(ns), "python3");
    api.arg(&script)
        .arg(&leaf.cert)
        .arg(&leaf.key)
        .arg(EDGE_API_PORT.to_string())
        .arg(KUBE_TOKEN);
    let site = hub.path().join(format!("site-{cluster}"));
    std::fs::create_dir_all(&site)?;
    std::fs::write(
        site.join("index.html"),
        format!("hello from the web service inside cluster {cluster} (network namespace {ns})\n"),
    )?;
    let mut web = tether_e2e::command_in(Some(ns), "python3");
    web.args([
        "-m",
        "http.server",
        "--bind",
        "127.0.0.1",
        &EDGE_WEB_PORT.to_string(),
        "--directory",
    ])
    .arg(&site);
    let procs = vec![
        tether_test_support::Child::spawn(&format!("apiserver-{cluster}"), api, hub.path())?,
        tether_test_support::Child::spawn(&format!("web-{cluster}"), web, hub.path())?,
    ];
    for port in [EDGE_API_PORT, EDGE_WEB_PORT] {
        tether_test_support::wait_until(
            Duration::from_secs(20),
            &format!("{cluster}: 127.0.0.1:{port} listening in {ns}"),
            || {
                tether_e2e::command_in(Some(ns), "bash")
                    .arg("-c")
                    .arg(format!("exec 3<>/dev/tcp/127.0.0.1/{port}"))
                    .stderr(std::process::Stdio::null())
                    .status()
                    .ok()
                    .filter(|s| s.success())
            },
        )?;
    }
    Ok(ClusterSide {
        api: SocketAddr::from(([127, 0, 0, 1], EDGE_API_PORT)),
        web: SocketAddr::from(([127, 0, 0, 1], EDGE_WEB_PORT)),
        _api_server: None,
        _procs: procs,
    })
}

/// tinyproxy inside the proxy namespace, listening on every link of it.
fn netns_tinyproxy(
    hub: &Hub,
    ns: &str,
) -> anyhow::Result<(tether_test_support::Child, std::path::PathBuf)> {
    let conf = hub.path().join("corporate-proxy.conf");
    let log = hub.path().join("corporate-proxy.log");
    std::fs::write(
        &conf,
        format!(
            "Port {PROXY_PORT}\nTimeout 600\nMaxClients 1000\nLogLevel Info\nLogFile \"{}\"\nDisableViaHeader Yes\n",
            log.display()
        ),
    )?;
    let program = ["/usr/bin/tinyproxy", "/usr/sbin/tinyproxy"]
        .into_iter()
        .find(|p| std::path::Path::new(p).exists())
        .unwrap_or("tinyproxy");
    let mut c = tether_e2e::command_in(Some(ns), program);
    c.args(["-d", "-c"]).arg(&conf);
    Ok((
        tether_test_support::Child::spawn("corporate-proxy", c, hub.path())?,
        log,
    ))
}

fn proxy_connects(log: &std::path::Path) -> Vec<String> {
    std::fs::read_to_string(log)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.split_once("Request ").map(|(_, r)| r.trim().to_owned()))
        .filter(|r| r.contains("CONNECT "))
        .collect()
}

fn main() -> anyhow::Result<()> {
    if let Some(r) = run_in_netns() {
        return r;
    }
    let netns = std::env::var(NETNS_ENV).ok().map(|t| Netns::from_tag(&t));
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let interrupted = rt.block_on(async {
        tokio::select! {
            r = demo(netns) => r.map(|()| false),
            _ = tokio::signal::ctrl_c() => {
                // Leaving the select drops the demo: every process it started is stopped by PID
                // (registration-agents with SIGTERM, so they stop their tunnel-agents).
                println!("\n== interrupted: stopping every process the demo started");
                Ok(true)
            }
        }
    })?;
    drop(rt);
    if interrupted {
        println!("== stopped");
        std::process::exit(130);
    }
    Ok(())
}

/// Runs `tetherctl ARGS` and prints it like a shell session.
fn sh(cp: &ControlPlane, args: &[&str]) -> anyhow::Result<()> {
    let out = cp.tetherctl(args)?;
    println!("$ tetherctl {}", args.join(" "));
    for l in out.lines() {
        println!("  {l}");
    }
    Ok(())
}

async fn demo(netns: Option<Netns>) -> anyhow::Result<()> {
    let started = Instant::now();
    let tmp = tempfile::tempdir()?;
    let nats_ip = if netns.is_some() {
        "0.0.0.0"
    } else {
        "127.0.0.1"
    };
    let cp = ControlPlane::start_on(tmp.path(), nats_ip).context("hub control plane")?;
    println!(
        "== hub control plane: nats-server (JetStream, TLS, auth callout) at {} + addon-manager; hub dir {}",
        cp.nats_url,
        cp.hub_dir.display()
    );
    let admin = cp.admin().await?;
    let store = HubStore::open(admin.client.clone()).await?;
    // The data plane's certificates come from the hub CA, which the add-on agents trust.
    let hub = tunnel_hub_from_ca(&cp.hub_dir)?;
    let listen_ip = if netns.is_some() { HUB_IP } else { "127.0.0.1" };
    let cp_yaml = broker_control_plane_yaml(
        &cp.hub_dir,
        &cp.nats_url,
        tether_e2e::control_plane::HUB_HOST,
    );
    let b1 = hub.start_broker_at("b1", &cp_yaml, None, listen_ip)?;
    let b2 = hub.start_broker_at("b2", &cp_yaml, None, listen_ip)?;
    println!(
        "== hub data plane: brokers b1 ({}) and b2 ({}), announcing themselves on NATS and relaying for each other; logs in {}",
        b1.agent_addr,
        b2.agent_addr,
        hub.path().display()
    );

    // The forward proxy: on loopback, or in its own namespace between the clusters and the hub.
    let (_proxy, proxy_log, proxy_url): (Box<dyn std::any::Any>, std::path::PathBuf, String) =
        match &netns {
            None => {
                let p = Tinyproxy::start(hub.path(), "corporate-proxy").context("tinyproxy")?;
                let (log, url) = (p.log.clone(), p.url());
                (Box::new(p), log, url)
            }
            Some(n) => {
                let (c, log) = netns_tinyproxy(&hub, &n.proxy).context("tinyproxy")?;
                (Box::new(c), log, format!("http://{PROXY_IP}:{PROXY_PORT}"))
            }
        };
    println!("== forward proxy (tinyproxy) at {proxy_url} — the clusters' only way out");

    // The add-on: installed on every accepted cluster, its agents going through the proxy.
    let resources = hub.path().join("cluster-proxy.yaml");
    std::fs::write(
        &resources,
        cluster_proxy_resources(&proxy_url, b1.agent_addr),
    )?;
    println!(
        "$ cat cluster-proxy.yaml   # ClusterManagementAddOn (installStrategy All), AddOnDeploymentConfig (httpsProxy {proxy_url}), ManagedProxyConfiguration"
    );
    sh(&cp, &["apply", "-f", &resources.display().to_string()])?;

    // Each cluster: API server and web service, then the registration-agent with the add-on.
    let hub_server = match &netns {
        Some(_) => format!("tls://{HUB_IP}:{}", cp.nats_port),
        None => cp.nats_url.clone(),
    };
    let mut clusters = Vec::new();
    for (i, cluster) in ["edge-a", "edge-b"].into_iter().enumerate() {
        let ns = netns.as_ref().map(|n| n.edges[i].as_str());
        let side = cluster_side(&hub, cluster, ns).await?;
        let boot = hub.path().join(format!("{cluster}.bootstrap.kubeconfig"));
        join(&cp.hub_dir, &boot, &hub_server, Some(&proxy_url))?;
        println!(
            "$ tetherctl join --hub-server {hub_server} --proxy-url {proxy_url} --out {cluster}.bootstrap.kubeconfig ...\n$ registration-agent --cluster-name {cluster} --bootstrap-kubeconfig {cluster}.bootstrap.kubeconfig --addon cluster-proxy --addon-apiserver {}{}",
            side.api,
            ns.map(|n| format!("   (in namespace {n})"))
                .unwrap_or_default()
        );
        let agent = AddonAgent::start(&AddonAgentSpec {
            cluster,
            bootstrap: &boot,
            base: &hub.path().join(cluster),
            apiserver: &side.api.to_string(),
            lease_seconds: 1,
            netns: ns,
            logs: hub.path(),
        })?;
        clusters.push((cluster, agent, side));
    }
    for (cluster, agent, _) in &clusters {
        tether_test_support::wait_until(
            Duration::from_secs(30),
            &format!("{cluster} asks to join"),
            || {
                cp.tetherctl(&["get", "clusters", cluster, "-o", "json"])
                    .ok()
                    .map(|_| ())
            },
        )
        .with_context(|| {
            format!(
                "agent log:\n{}",
                std::fs::read_to_string(&agent.log).unwrap_or_default()
            )
        })?;
        sh(&cp, &["accept", cluster])?;
    }
    for (cluster, agent, side) in &clusters {
        for b in [&b1, &b2] {
            wait_tunnel(b, cluster).await.with_context(|| {
                format!(
                    "agent log:\n{}",
                    std::fs::read_to_string(&agent.log).unwrap_or_default()
                )
            })?;
        }
        println!(
            "== cluster {cluster}: joined through the proxy, add-on credentials issued, tunnel-agent (pid {}, supervised by registration-agent pid {}) has tunnels to b1 and b2 through the proxy; API server {}, web service {}",
            agent
                .tunnel_agent_pid()
                .map(|p| p.to_string())
                .unwrap_or_else(|| "?".into()),
            agent.child.pid(),
            side.api,
            side.web
        );
    }
    let nats_port = format!(":{} ", cp.nats_port);
    for l in proxy_connects(&proxy_log) {
        let what = if l.contains(&nats_port) {
            "hub NATS: join, leases, add-on config and CSR"
        } else if l.contains(&format!(":{} ", b1.agent_addr.port())) {
            "tunnel to b1"
        } else if l.contains(&format!(":{} ", b2.agent_addr.port())) {
            "tunnel to b2"
        } else {
            "?"
        };
        let l = l.split_once("): ").map(|(_, r)| r).unwrap_or(&l);
        println!("   proxy log: {l}   ({what})");
    }

    // The health-prober takes the accepted clusters from the hub and probes them through b2.
    let _prober = hub.start_prober(
        &b2,
        &[],
        &format!(
            "interval: 1s\ntimeout: 900ms\nfailure_threshold: 1\n{}",
            cp.prober_nats_yaml()
        ),
    )?;
    let rows = wait_table(
        &admin.client,
        &store,
        "both clusters installed, available and healthy",
        |rows| {
            rows.len() == 2
                && rows
                    .iter()
                    .all(|r| r.installed && r.available == "True" && r.probed_health == "True")
        },
    )
    .await?;
    println!(
        "\n$ tetherctl proxy health   (AVAILABLE: the add-on lease the registration-agents renew and a tunnel held by every live broker; PROBED HEALTH: the prober, through broker b2)"
    );
    println!("{}", render_table(&rows, false));

    // A kube client for edge-a through the tunnel (via b2).
    let dialer = Dialer::connect(DialerConfig {
        endpoint: format!("https://{}", b2.client_tls_addr),
        server_name: "localhost".into(),
        ca_pem: std::fs::read_to_string(hub.pki.ca_path())?,
        client_cert: None,
        token: Some(Token(OPS_TOKEN.into())),
        connect_timeout: Duration::from_secs(5),
    })
    .await?;
    let mut kcfg = kube::Config::new("https://edge-a:443".parse()?);
    kcfg.root_cert = Some(
        tether_tls::pem::read_certs(&hub.pki.ca_path())?
            .iter()
            .map(|c| c.to_vec())
            .collect(),
    );
    kcfg.tls_server_name = Some("kubernetes.default.svc".into());
    kcfg.auth_info.token = Some(KUBE_TOKEN.to_owned().into());
    let v = dialer
        .kube_client("edge-a", kcfg)?
        .apiserver_version()
        .await?;
    println!(
        "$ kube::Client for edge-a via broker b2 → GET /version: gitVersion {}",
        v.git_version
    );

    // An in-cluster service of each cluster by CONNECT.
    for (cluster, _, side) in &clusters {
        let target = format!("127.0.0.1.{cluster}.tether:{}", side.web.port());
        let mut s = match connect(b1.client_addr, &target, Some(OPS_TOKEN)).await? {
            Ok(s) => s,
            Err((code, body)) => anyhow::bail!("CONNECT {target} answered {code}: {body}"),
        };
        s.write_all(b"GET / HTTP/1.1\r\nhost: web\r\nconnection: close\r\n\r\n")
            .await?;
        let mut out = String::new();
        tokio::time::timeout(Duration::from_secs(10), s.read_to_string(&mut out)).await??;
        println!(
            "$ curl --proxy http://{} http://{target}/\n  {}",
            b1.client_addr,
            out.lines().last().unwrap_or("")
        );
    }

    // A client whose token only allows the API servers asks for the web service.
    let target = format!("127.0.0.1.edge-a.tether:{}", clusters[0].2.web.port());
    let denied = match connect(b1.client_addr, &target, Some("apionly-token")).await? {
        Ok(_) => "unexpectedly allowed".to_owned(),
        Err((code, body)) => format!("{code} — {}", body.lines().last().unwrap_or("").trim()),
    };
    println!("$ CONNECT {target} with client apionly's token (API servers only) → {denied}");

    // Stop edge-b's agent: PROBED HEALTH within an interval, AVAILABLE once its lease lapses.
    let (_, mut agent_b, _) = clusters.pop().expect("two clusters");
    let (reg_pid, ta_pid) = (agent_b.child.pid(), agent_b.tunnel_agent_pid());
    println!(
        "\n== stopping edge-b's agent: SIGTERM to registration-agent pid {reg_pid}, which stops its tunnel-agent (pid {}) ...",
        ta_pid.map(|p| p.to_string()).unwrap_or_else(|| "?".into())
    );
    let stop = Instant::now();
    agent_b.stop(Duration::from_secs(10))?;
    println!(
        "   both exited after {:.1}s; nobody renews edge-b's add-on lease now",
        stop.elapsed().as_secs_f64()
    );
    let rows = wait_table(
        &admin.client,
        &store,
        "edge-b unhealthy and unavailable",
        |rows| {
            rows.iter().any(|r| {
                r.cluster_name == "edge-b"
                    && r.probed_health == "False"
                    && (r.available == "False" || r.available == "Unknown")
            })
        },
    )
    .await?;
    println!(
        "$ tetherctl proxy health -o wide   ({:.1}s after the stop)",
        stop.elapsed().as_secs_f64()
    );
    println!("{}", render_table(&rows, true));
    let addons = cp.tetherctl(&["get", "addons"])?;
    println!("$ tetherctl get addons\n{addons}");
    let events = cp.tetherctl(&["events", "edge-b", "--subject", "tether.v1.events.health.>"])?;
    println!("$ tetherctl events edge-b --subject 'tether.v1.events.health.>'\n{events}");
    let (_, metrics) = admin_get(b1.admin_addr, "/metrics").await?;
    println!("broker b1 metrics (excerpt):");
    for line in metrics.lines().filter(|l| {
        l.starts_with("tether_broker_tunnels ")
            || l.starts_with("tether_broker_bytes_total")
            || l.starts_with("tether_broker_dial_failures_total")
    }) {
        println!("  {line}");
    }
    println!(
        "== done in {:.1}s; stopping everything",
        started.elapsed().as_secs_f64()
    );
    Ok(())
}
