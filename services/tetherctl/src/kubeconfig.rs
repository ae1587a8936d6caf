//! `tetherctl kubeconfig <cluster>`: a kubeconfig for the brokers' HTTP service proxy.
//!
//! The server is `https://<broker service proxy>/<cluster>`, so plain `kubectl --kubeconfig`
//! reaches that cluster's API server with no `proxy-url` (docs/service-proxy.md). The CA is
//! the hub CA (it signs the brokers' certificates); the user is a hub client certificate and
//! key, or a bearer token (a hub client's token — mapped to impersonation — or a token of the
//! managed cluster, passed through). Everything is embedded, so the file stands alone; it is
//! written with mode 0600 because it holds a credential.

use std::path::PathBuf;

use anyhow::{Context, bail};
use base64::Engine as _;

#[derive(clap::Args, Debug)]
pub struct KubeconfigArgs {
    /// Managed cluster the kubeconfig reaches.
    pub cluster: String,
    /// The brokers' service proxy, `https://host:port` (their `service_proxy.listen`).
    #[arg(long)]
    pub server: String,
    /// CA bundle verifying the broker (default: `<hub dir>/ca.crt`).
    #[arg(long)]
    pub ca: Option<PathBuf>,
    /// Hub directory (for the default CA).
    #[arg(long, env = "TETHER_HUB_DIR", default_value = "hub")]
    pub hub_dir: PathBuf,
    /// File holding a bearer token (hub client token, or a managed-cluster token to pass through).
    #[arg(long, conflicts_with_all = ["cert", "key"])]
    pub token_file: Option<PathBuf>,
    /// Hub client certificate (PEM); needs `--key`.
    #[arg(long, requires = "key")]
    pub cert: Option<PathBuf>,
    /// Key of `--cert` (PEM).
    #[arg(long, requires = "cert")]
    pub key: Option<PathBuf>,
    /// Where to write it (default: stdout).
    #[arg(long, short = 'o')]
    pub out: Option<PathBuf>,
}

fn read(path: &PathBuf, what: &str) -> anyhow::Result<Vec<u8>> {
    std::fs::read(path).with_context(|| format!("{what} {}", path.display()))
}

/// Builds the kubeconfig text.
pub fn render(a: &KubeconfigArgs) -> anyhow::Result<String> {
    tether_tls::identity::validate_dns_label(&a.cluster)
        .map_err(|r| anyhow::anyhow!("cluster {:?}: {r}", a.cluster))?;
    let base = a.server.trim_end_matches('/');
    if !base.starts_with("https://") || base.len() <= "https://".len() {
        bail!("--server {:?} must be https://host:port", a.server);
    }
    let ca_path = a.ca.clone().unwrap_or_else(|| a.hub_dir.join("ca.crt"));
    let b64 = |v: &[u8]| base64::engine::general_purpose::STANDARD.encode(v);
    let ca = read(&ca_path, "CA bundle")?;
    let user = match (&a.token_file, &a.cert, &a.key) {
        (Some(t), _, _) => {
            let token =
                String::from_utf8(read(t, "token file")?).context("token file is not UTF-8")?;
            let token = token.trim();
            if token.is_empty() {
                bail!("token file {} is empty", t.display());
            }
            serde_json::json!({ "token": token })
        }
        (None, Some(c), Some(k)) => serde_json::json!({
            "client-certificate-data": b64(&read(c, "client certificate")?),
            "client-key-data": b64(&read(k, "client key")?),
        }),
        _ => bail!("give --token-file, or --cert and --key"),
    };
    let name = format!("tether-{}", a.cluster);
    let kc = serde_json::json!({
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": name, "cluster": {
            "server": format!("{base}/{}", a.cluster),
            "certificate-authority-data": b64(&ca),
        }}],
        "users": [{"name": name, "user": user}],
        "contexts": [{"name": name, "context": {"cluster": name, "user": name}}],
        "current-context": name,
    });
    Ok(serde_saphyr::to_string(&kc)?)
}

pub fn run(a: &KubeconfigArgs) -> anyhow::Result<()> {
    let text = render(a)?;
    match &a.out {
        None => print!("{text}"),
        Some(path) => {
            tether_runtime::write_atomic(path, text.as_bytes(), 0o600)
                .with_context(|| format!("writing {}", path.display()))?;
            eprintln!(
                "wrote {} (server {}/{})",
                path.display(),
                a.server.trim_end_matches('/'),
                a.cluster
            );
        }
    }
    Ok(())
}
