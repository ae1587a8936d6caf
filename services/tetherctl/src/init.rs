//! `tetherctl init` and `tetherctl join`: files only, no network.
//!
//! `init --nats-cluster N` (N > 1) writes one nats-server config per node instead of
//! `nats/nats.conf`:
//!
//! ```text
//! nats/node-<i>/nats.conf     server_name tether-hub-<i>, JetStream store <store>/node-<i>,
//!                             cluster `tether-hub` with TLS routes (mutual, hub CA) to the
//!                             other nodes, the same users and auth callout as standalone
//! nats/node-<i>/server.crt|key  that node's certificate: the hub hosts, localhost,
//!                             127.0.0.1 and its route host (--nats-route-host)
//! ```
//!
//! All nodes on one host (the default, route host 127.0.0.1): node i listens on the client,
//! cluster and monitoring ports + i-1. Distinct route hosts (compose services, Helm pods):
//! every node uses the same ports. With random ports (`-1`) no routes are written: pass
//! `--routes` to nats-server (the test harness does). hub.yaml gets the seed list of all nodes
//! and `replicas: min(N, 3)`.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use anyhow::{Context, bail};
use tether_control::auth::{BootstrapToken, CalloutIssuer};
use tether_control::hub::{
    ADMIN_USER, AdminConfig, AutoAccept, CaFiles, HUB_CONFIG_FILE, HUB_USER, HubConfig,
    HubNatsConfig, RegistrationPolicy,
};
use tether_control::kubeconfig::{self, HubEndpoint, Token};
use tether_control::proxy::ProxyUrl;
use tether_control::resources::{BootstrapTokenRecord, rfc3339};

pub fn parse_duration(s: &str) -> Result<Duration, String> {
    humantime_serde::re::humantime::parse_duration(s).map_err(|e| e.to_string())
}

#[derive(clap::Args, Debug)]
pub struct InitArgs {
    /// Directory to create the hub files in.
    #[arg(long, default_value = "hub")]
    pub dir: PathBuf,
    /// Host names / IPs of hub NATS as managed clusters see them (certificate SANs). The first
    /// is the name used in join commands.
    #[arg(long = "hub-host", required = true)]
    pub hub_hosts: Vec<String>,
    /// nats-server listen address (`127.0.0.1:-1` picks a random port).
    #[arg(long, default_value = "0.0.0.0:4222")]
    pub nats_listen: String,
    /// nats-server monitoring address (optional).
    #[arg(long)]
    pub nats_http: Option<String>,
    /// nats-server writes its chosen ports here (with random ports).
    #[arg(long)]
    pub ports_file_dir: Option<PathBuf>,
    /// JetStream store directory (default <dir>/nats/jetstream).
    #[arg(long)]
    pub store_dir: Option<PathBuf>,
    /// URL hub processes use to reach NATS (default tls://127.0.0.1:<listen port>).
    #[arg(long)]
    pub hub_nats_url: Option<String>,
    /// Auto-accept clusters whose name matches (glob, repeatable).
    #[arg(long = "auto-accept")]
    pub auto_accept: Vec<String>,
    /// Auto-accept clusters carrying this label (key=value, glob in value; repeatable; all must match).
    #[arg(long = "auto-accept-label")]
    pub auto_accept_labels: Vec<String>,
    #[arg(long, default_value_t = 60)]
    pub lease_duration_seconds: u32,
    #[arg(long, default_value_t = 5)]
    pub lease_grace_multiplier: u32,
    #[arg(long, default_value = "24h", value_parser = parse_duration)]
    pub cert_lifetime: Duration,
    #[arg(long, default_value = "24h", value_parser = parse_duration)]
    pub token_ttl: Duration,
    #[arg(long, default_value = "1s", value_parser = parse_duration)]
    pub lease_check_interval: Duration,
    /// Admin HTTP listen address of addon-manager (/metrics).
    #[arg(long)]
    pub admin_listen: Option<String>,
    /// Overwrite an existing hub directory.
    #[arg(long)]
    pub force: bool,
    /// Number of nats-server nodes (a JetStream cluster when more than 1; 3 survives losing
    /// any one).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=9))]
    pub nats_cluster: u16,
    /// Cluster (route) listen address of each node (with --nats-cluster).
    #[arg(long, default_value = "0.0.0.0:6222")]
    pub nats_cluster_listen: String,
    /// Host of each node as the other nodes and hub processes reach it, in node order
    /// (repeatable; default 127.0.0.1 for every node).
    #[arg(long = "nats-route-host")]
    pub nats_route_hosts: Vec<String>,
}

/// Route PINGs between cluster nodes: a node partitioned without FIN is dropped by its peers
/// after about `ping_max` intervals, so interest (e.g. the auth callout's subscription) seen
/// through it does not swallow requests for minutes (nats-server's default is 2 min × 2).
const ROUTE_PING_INTERVAL: &str = "2s";
const ROUTE_PING_MAX: u32 = 3;

/// One nats-server node of `tetherctl init`.
struct NatsNode {
    /// 1-based.
    index: usize,
    server_name: String,
    /// Directory of its config and certificate, relative to the hub directory.
    rel_dir: PathBuf,
    listen: String,
    cluster_listen: String,
    http: Option<String>,
    /// How the other nodes and hub processes reach it.
    host: String,
    client_port: String,
    cluster_port: String,
    store_dir: PathBuf,
}

/// `host:port` → (host, port string; `-1` = random).
fn split_listen(flag: &str, v: &str) -> anyhow::Result<(String, String)> {
    let (h, p) = v
        .rsplit_once(':')
        .with_context(|| format!("{flag} {v:?} is not host:port"))?;
    if p != "-1" {
        p.parse::<u16>()
            .with_context(|| format!("{flag} {v:?}: port is not a number or -1"))?;
    }
    Ok((h.to_string(), p.to_string()))
}

/// `host:port` with `offset` added to the port (random ports stay random).
fn offset_listen(flag: &str, v: &str, offset: usize) -> anyhow::Result<(String, String)> {
    let (h, p) = split_listen(flag, v)?;
    if p == "-1" || p == "0" || offset == 0 {
        return Ok((format!("{h}:{p}"), p));
    }
    let q = p.parse::<usize>()? + offset;
    if q > usize::from(u16::MAX) {
        bail!("{flag} {v:?}: port + {offset} is out of range");
    }
    Ok((format!("{h}:{q}"), q.to_string()))
}

fn nats_nodes(a: &InitArgs, dir: &Path) -> anyhow::Result<Vec<NatsNode>> {
    let n = usize::from(a.nats_cluster);
    let store = a
        .store_dir
        .clone()
        .unwrap_or_else(|| dir.join("nats/jetstream"));
    if n == 1 {
        if !a.nats_route_hosts.is_empty() {
            bail!("--nats-route-host needs --nats-cluster 2 or more");
        }
        let (_, client_port) = split_listen("--nats-listen", &a.nats_listen)?;
        return Ok(vec![NatsNode {
            index: 1,
            server_name: "tether-hub".into(),
            rel_dir: "nats".into(),
            listen: a.nats_listen.clone(),
            cluster_listen: String::new(),
            http: a.nats_http.clone(),
            host: "127.0.0.1".into(),
            client_port,
            cluster_port: String::new(),
            store_dir: store,
        }]);
    }
    let hosts = if a.nats_route_hosts.is_empty() {
        vec!["127.0.0.1".to_string(); n]
    } else if a.nats_route_hosts.len() == n {
        a.nats_route_hosts.clone()
    } else {
        bail!(
            "--nats-route-host given {} times for --nats-cluster {n}: give one per node",
            a.nats_route_hosts.len()
        );
    };
    // All nodes on one host need distinct ports.
    let one_host = hosts.iter().all(|h| *h == hosts[0]);
    (0..n)
        .map(|i| {
            let off = if one_host { i } else { 0 };
            let (listen, client_port) = offset_listen("--nats-listen", &a.nats_listen, off)?;
            let (cluster_listen, cluster_port) =
                offset_listen("--nats-cluster-listen", &a.nats_cluster_listen, off)?;
            let http = a
                .nats_http
                .as_deref()
                .map(|h| offset_listen("--nats-http", h, off).map(|(l, _)| l))
                .transpose()?;
            Ok(NatsNode {
                index: i + 1,
                server_name: format!("tether-hub-{}", i + 1),
                rel_dir: format!("nats/node-{}", i + 1).into(),
                listen,
                cluster_listen,
                http,
                host: hosts[i].clone(),
                client_port,
                cluster_port,
                store_dir: store.join(format!("node-{}", i + 1)),
            })
        })
        .collect()
}

/// The nats-server config of `node`: routes to every other node of `all` whose cluster port
/// is known, then `users` (the authorization block, the same on every node).
fn node_conf(a: &InitArgs, dir: &Path, node: &NatsNode, all: &[NatsNode], users: &str) -> String {
    let node_dir = dir.join(&node.rel_dir);
    let mut conf = String::new();
    conf.push_str("# nats-server config written by `tetherctl init`.\n");
    conf.push_str(&format!("server_name: {}\n", node.server_name));
    conf.push_str(&format!("listen: {:?}\n", node.listen));
    if let Some(h) = &node.http {
        conf.push_str(&format!("http: {h:?}\n"));
    }
    if let Some(p) = &a.ports_file_dir {
        conf.push_str(&format!("ports_file_dir: {}\n", quote(p)));
    }
    conf.push_str(&format!(
        "jetstream {{\n  store_dir: {}\n}}\n",
        quote(&node.store_dir)
    ));
    let cert = quote(&node_dir.join("server.crt"));
    let key = quote(&node_dir.join("server.key"));
    conf.push_str(&format!(
        "tls {{\n  cert_file: {cert}\n  key_file: {key}\n  timeout: 5\n}}\n"
    ));
    if all.len() > 1 {
        let routes: Vec<String> = all
            .iter()
            .filter(|o| o.index != node.index && o.cluster_port != "-1" && o.cluster_port != "0")
            .map(|o| format!("    \"nats-route://{}:{}\"\n", o.host, o.cluster_port))
            .collect();
        conf.push_str(&format!(
            "cluster {{\n  name: tether-hub\n  listen: {:?}\n  ping_interval: \"{ROUTE_PING_INTERVAL}\"\n  ping_max: {ROUTE_PING_MAX}\n  routes: [\n{}  ]\n  tls {{\n    cert_file: {cert}\n    key_file: {key}\n    ca_file: {}\n    verify: true\n    timeout: 5\n  }}\n}}\n",
            node.cluster_listen,
            routes.concat(),
            quote(&dir.join("ca.crt")),
        ));
    }
    conf.push_str(users);
    conf
}

fn write_file(path: &Path, contents: &str, secret: bool) -> anyhow::Result<()> {
    use std::os::unix::fs::OpenOptionsExt;
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(if secret { 0o600 } else { 0o644 })
        .open(path)
        .with_context(|| format!("writing {}", path.display()))?;
    f.write_all(contents.as_bytes())
        .with_context(|| format!("writing {}", path.display()))?;
    Ok(())
}

fn random_password() -> String {
    tether_control::auth::new_connection_id() + &tether_control::auth::new_connection_id()
}

fn quote(p: &Path) -> String {
    format!("{:?}", p.display().to_string())
}

pub fn init(a: InitArgs) -> anyhow::Result<()> {
    if a.dir.join(HUB_CONFIG_FILE).exists() && !a.force {
        bail!(
            "{} already holds a hub (use --force to overwrite)",
            a.dir.display()
        );
    }
    std::fs::create_dir_all(a.dir.join("nats"))?;
    let dir = std::fs::canonicalize(&a.dir)?;
    let ca =
        tether_pki::HubCa::generate("tether-hub-ca", Duration::from_secs(10 * 365 * 24 * 3600))?;
    write_file(&dir.join("ca.crt"), ca.cert_pem(), false)?;
    write_file(&dir.join("ca.key"), &ca.key_pem(), true)?;
    let mut sans = a.hub_hosts.clone();
    for extra in ["localhost", "127.0.0.1"] {
        if !sans.iter().any(|s| s == extra) {
            sans.push(extra.to_string());
        }
    }
    let hub_pw = random_password();
    let admin_pw = random_password();
    write_file(&dir.join("hub-user.password"), &hub_pw, true)?;
    write_file(&dir.join("admin-user.password"), &admin_pw, true)?;
    let issuer = CalloutIssuer::generate();
    write_file(&dir.join("callout-issuer.nk"), &issuer.seed()?, true)?;

    let token = BootstrapToken::generate();
    let record = BootstrapTokenRecord {
        id: token.id.clone(),
        secret_sha256: token.secret_sha256(),
        expires: rfc3339(SystemTime::now() + a.token_ttl),
        description: "created by tetherctl init".into(),
    };
    write_file(
        &dir.join("bootstrap-tokens.json"),
        &serde_json::to_string_pretty(&vec![record])?,
        true,
    )?;
    write_file(&dir.join("bootstrap.token"), &token.to_token_string(), true)?;

    let users = format!(
        "authorization {{\n  timeout: 5\n  users: [\n    {{ user: {HUB_USER:?}, password: {hub_pw:?} }}\n    {{ user: {ADMIN_USER:?}, password: {admin_pw:?} }}\n  ]\n  auth_callout {{\n    issuer: {:?}\n    auth_users: [ {HUB_USER:?}, {ADMIN_USER:?} ]\n  }}\n}}\n",
        issuer.public_key()
    );
    let nodes = nats_nodes(&a, &dir)?;
    for node in &nodes {
        let mut names = sans.clone();
        if !names.contains(&node.host) {
            names.push(node.host.clone());
        }
        let (crt, key) = ca.issue_server(&names, Duration::from_secs(2 * 365 * 24 * 3600))?;
        let node_dir = dir.join(&node.rel_dir);
        write_file(&node_dir.join("server.crt"), &crt, false)?;
        write_file(&node_dir.join("server.key"), &key, true)?;
        let conf = node_conf(&a, &dir, node, &nodes, &users);
        write_file(&node_dir.join("nats.conf"), &conf, true)?;
    }
    let listen_port = nodes[0].client_port.clone();
    let hub_url = match &a.hub_nats_url {
        Some(u) => u.clone(),
        None => nodes
            .iter()
            .map(|n| format!("tls://{}:{}", n.host, n.client_port))
            .collect::<Vec<_>>()
            .join(","),
    };
    let mut labels = std::collections::BTreeMap::new();
    for l in &a.auto_accept_labels {
        let (k, v) = l
            .split_once('=')
            .with_context(|| format!("--auto-accept-label {l:?} is not key=value"))?;
        labels.insert(k.to_string(), v.to_string());
    }
    let cfg = HubConfig {
        nats: HubNatsConfig {
            url: hub_url,
            server_name: a.hub_hosts[0].clone(),
            ca_file: "ca.crt".into(),
            hub_password_file: "hub-user.password".into(),
            admin_password_file: "admin-user.password".into(),
            server_config_file: nodes[0].rel_dir.join("nats.conf"),
            replicas: (nodes.len() > 1).then(|| nodes.len().min(3)),
        },
        ca: CaFiles {
            cert_file: "ca.crt".into(),
            key_file: "ca.key".into(),
        },
        callout_issuer_seed_file: "callout-issuer.nk".into(),
        bootstrap_tokens_file: "bootstrap-tokens.json".into(),
        registration: RegistrationPolicy {
            auto_accept: AutoAccept {
                names: a.auto_accept.clone(),
                labels,
            },
            lease_grace_multiplier: a.lease_grace_multiplier,
            client_cert_lifetime: a.cert_lifetime,
            max_pending_csrs_per_cluster: 10,
            lease_check_interval: a.lease_check_interval,
            lease_duration_seconds: a.lease_duration_seconds,
        },
        admin: AdminConfig {
            listen: a.admin_listen.clone(),
        },
    };
    let yaml = serde_saphyr::to_string(&cfg)?;
    write_file(&dir.join(HUB_CONFIG_FILE), &yaml, false)?;

    let shown_port = if listen_port == "-1" || listen_port == "0" {
        "<port from nats-server's ports file>".to_string()
    } else {
        listen_port.clone()
    };
    let server = format!("tls://{}:{shown_port}", a.hub_hosts[0]);
    println!("Hub initialised in {}", dir.display());
    println!();
    println!("Start NATS:");
    for n in &nodes {
        println!(
            "  nats-server -c {}",
            dir.join(&n.rel_dir).join("nats.conf").display()
        );
    }
    println!(
        "Start the hub controller:\n  addon-manager --hub-dir {}",
        dir.display()
    );
    println!();
    println!("Join a managed cluster (add --proxy-url and --proxy-ca-file behind a proxy):");
    println!(
        "  tetherctl join --hub-server {server} --hub-ca {} --token {} --out bootstrap.kubeconfig",
        dir.join("ca.crt").display(),
        token.to_token_string()
    );
    println!(
        "  registration-agent --cluster-name <name> --bootstrap-kubeconfig bootstrap.kubeconfig --hub-kubeconfig-dir hub-kubeconfig"
    );
    Ok(())
}

#[derive(clap::Args, Debug)]
pub struct JoinArgs {
    /// Hub NATS, tls://host:port.
    #[arg(long)]
    pub hub_server: String,
    /// Hub CA certificate (PEM).
    #[arg(long)]
    pub hub_ca: PathBuf,
    /// Bootstrap token (printed by `tetherctl init` / `tetherctl token create`).
    #[arg(long, env = "TETHER_BOOTSTRAP_TOKEN", hide_env_values = true)]
    pub token: String,
    /// Forward proxy, http:// or https://, optionally with user:password@.
    #[arg(long)]
    pub proxy_url: Option<String>,
    /// CA of an https:// proxy; appended to certificate-authority-data (de-duplicated).
    #[arg(long)]
    pub proxy_ca_file: Option<PathBuf>,
    /// Name to verify in the hub NATS certificate when it differs from the server host.
    #[arg(long)]
    pub tls_server_name: Option<String>,
    /// Where to write the bootstrap kubeconfig ("-" for stdout).
    #[arg(long, default_value = "bootstrap.kubeconfig")]
    pub out: PathBuf,
}

pub fn join(a: JoinArgs) -> anyhow::Result<()> {
    let (host, port) = kubeconfig::parse_server(&a.hub_server)
        .with_context(|| format!("--hub-server {:?} is not tls://host:port", a.hub_server))?;
    let hub_ca = std::fs::read_to_string(&a.hub_ca)
        .with_context(|| format!("reading --hub-ca {}", a.hub_ca.display()))?;
    if tether_pki::pem_certificates(&hub_ca).is_empty() {
        bail!("--hub-ca {} holds no PEM certificate", a.hub_ca.display());
    }
    let proxy_ca = match &a.proxy_ca_file {
        Some(p) => {
            let s = std::fs::read_to_string(p)
                .with_context(|| format!("reading --proxy-ca-file {}", p.display()))?;
            if tether_pki::pem_certificates(&s).is_empty() {
                bail!("--proxy-ca-file {} holds no PEM certificate", p.display());
            }
            s
        }
        None => String::new(),
    };
    let proxy = a
        .proxy_url
        .as_deref()
        .map(ProxyUrl::parse)
        .transpose()
        .context("--proxy-url")?;
    if a.proxy_ca_file.is_some() && proxy.is_none() {
        bail!("--proxy-ca-file needs --proxy-url");
    }
    let endpoint = HubEndpoint {
        server: a.hub_server.clone(),
        host,
        port,
        ca_pem: tether_pki::merge_pem_bundles([hub_ca.as_str(), proxy_ca.as_str()]),
        proxy,
        tls_server_name: a.tls_server_name.clone(),
    };
    let yaml = kubeconfig::render_bootstrap(&endpoint, &Token::new(a.token.trim().to_string()))?;
    if a.out.as_os_str() == "-" {
        print!("{yaml}");
    } else {
        write_file(&a.out, &yaml, true)?;
        eprintln!("wrote bootstrap kubeconfig {}", a.out.display());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        init: InitArgs,
    }

    fn args(extra: &[&str]) -> InitArgs {
        let mut v = vec!["init", "--hub-host", "hub.example"];
        v.extend_from_slice(extra);
        Cli::parse_from(v).init
    }

    #[test]
    fn one_host_clusters_get_consecutive_ports_and_routes_to_the_others() {
        let a = args(&[
            "--nats-cluster",
            "3",
            "--nats-listen",
            "127.0.0.1:4222",
            "--nats-cluster-listen",
            "127.0.0.1:6222",
        ]);
        let nodes = nats_nodes(&a, Path::new("/hub")).unwrap();
        let ports: Vec<_> = nodes
            .iter()
            .map(|n| (n.client_port.as_str(), n.cluster_port.as_str()))
            .collect();
        assert_eq!(
            ports,
            [("4222", "6222"), ("4223", "6223"), ("4224", "6224")]
        );
        let conf = node_conf(&a, Path::new("/hub"), &nodes[1], &nodes, "");
        assert!(conf.contains("server_name: tether-hub-2"), "{conf}");
        assert!(conf.contains("nats-route://127.0.0.1:6222"), "{conf}");
        assert!(conf.contains("nats-route://127.0.0.1:6224"), "{conf}");
        assert!(!conf.contains("nats-route://127.0.0.1:6223"), "{conf}");
        assert!(conf.contains("verify: true"), "{conf}");
        assert!(conf.contains("/hub/nats/jetstream/node-2"), "{conf}");
    }

    #[test]
    fn distinct_route_hosts_share_ports_and_random_ports_get_no_routes() {
        let a = args(&[
            "--nats-cluster",
            "2",
            "--nats-route-host",
            "nats-1",
            "--nats-route-host",
            "nats-2",
        ]);
        let nodes = nats_nodes(&a, Path::new("/hub")).unwrap();
        assert_eq!(nodes[1].listen, "0.0.0.0:4222");
        let conf = node_conf(&a, Path::new("/hub"), &nodes[0], &nodes, "");
        assert!(conf.contains("nats-route://nats-2:6222"), "{conf}");

        let a = args(&[
            "--nats-cluster",
            "3",
            "--nats-listen",
            "127.0.0.1:-1",
            "--nats-cluster-listen",
            "127.0.0.1:-1",
        ]);
        let nodes = nats_nodes(&a, Path::new("/hub")).unwrap();
        let conf = node_conf(&a, Path::new("/hub"), &nodes[0], &nodes, "");
        assert!(!conf.contains("nats-route://"), "{conf}");
    }

    #[test]
    fn route_hosts_must_match_the_node_count() {
        let a = args(&["--nats-cluster", "3", "--nats-route-host", "a"]);
        let e = nats_nodes(&a, Path::new("/hub")).err().unwrap().to_string();
        assert!(e.contains("--nats-route-host given 1 times"), "{e}");
        let a = args(&["--nats-route-host", "a"]);
        let e = nats_nodes(&a, Path::new("/hub")).err().unwrap().to_string();
        assert!(e.contains("needs --nats-cluster"), "{e}");
    }
}
