//! `tetherctl init` and `tetherctl join`: files only, no network.

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
    let (crt, key) = ca.issue_server(&sans, Duration::from_secs(2 * 365 * 24 * 3600))?;
    write_file(&dir.join("nats/server.crt"), &crt, false)?;
    write_file(&dir.join("nats/server.key"), &key, true)?;
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

    let store = a
        .store_dir
        .clone()
        .unwrap_or_else(|| dir.join("nats/jetstream"));
    let mut conf = String::new();
    conf.push_str("# nats-server config written by `tetherctl init`.\n");
    conf.push_str("server_name: tether-hub\n");
    conf.push_str(&format!("listen: {:?}\n", a.nats_listen));
    if let Some(h) = &a.nats_http {
        conf.push_str(&format!("http: {h:?}\n"));
    }
    if let Some(p) = &a.ports_file_dir {
        conf.push_str(&format!("ports_file_dir: {}\n", quote(p)));
    }
    conf.push_str(&format!(
        "jetstream {{\n  store_dir: {}\n}}\n",
        quote(&store)
    ));
    conf.push_str(&format!(
        "tls {{\n  cert_file: {}\n  key_file: {}\n  timeout: 5\n}}\n",
        quote(&dir.join("nats/server.crt")),
        quote(&dir.join("nats/server.key"))
    ));
    conf.push_str(&format!(
        "authorization {{\n  timeout: 5\n  users: [\n    {{ user: {HUB_USER:?}, password: {hub_pw:?} }}\n    {{ user: {ADMIN_USER:?}, password: {admin_pw:?} }}\n  ]\n  auth_callout {{\n    issuer: {:?}\n    auth_users: [ {HUB_USER:?}, {ADMIN_USER:?} ]\n  }}\n}}\n",
        issuer.public_key()
    ));
    write_file(&dir.join("nats/nats.conf"), &conf, true)?;

    let listen_port = a
        .nats_listen
        .rsplit_once(':')
        .map(|(_, p)| p.to_string())
        .unwrap_or_else(|| "4222".into());
    let hub_url = a
        .hub_nats_url
        .clone()
        .unwrap_or_else(|| format!("tls://127.0.0.1:{listen_port}"));
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
            server_config_file: "nats/nats.conf".into(),
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
    println!(
        "Start NATS:\n  nats-server -c {}",
        dir.join("nats/nats.conf").display()
    );
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
