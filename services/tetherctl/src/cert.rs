//! `tetherctl cert issue`: certificates for hub components (brokers, static hub clients such as
//! the health-prober) and static tunnel-agents, signed by the hub CA that `tetherctl init` wrote. Files only, no network:
//! what the compose init service and the Helm bootstrap Job run instead of host `openssl`.
//!
//! Output in `--out`: `<name>.crt`, `<name>.key` (mode 0600 unless `--key-mode`), `ca.crt`.
//! With `--if-valid`, an existing certificate that this CA issued for the same identity and
//! names and that has at least half of its life left is kept (idempotent re-runs).

use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use anyhow::{Context, bail};
use tether_control::hub::HubDir;
use tether_pki::{CertInfo, HubCa, pem_certificates, verify_issued_by};
use tether_tls::Identity;

#[derive(clap::Args, Debug)]
#[command(
    after_help = "Examples:\n  tetherctl cert issue --dir hub --identity broker:b1 --san broker-b1 --san localhost --out certs\n  tetherctl cert issue --dir hub --identity client:health-prober --out certs --if-valid\n  tetherctl cert issue --dir hub --identity agent:c1:agent-0 --out certs"
)]
pub struct IssueArgs {
    /// The hub directory `tetherctl init` wrote (its CA signs the certificate).
    #[arg(long, default_value = "hub")]
    pub dir: PathBuf,
    /// Who the certificate names: `broker:<id>` (server and client auth), `client:<name>`
    /// (client auth only) or `agent:<cluster>:<agent>` (a static tunnel-agent, CN
    /// `system:open-cluster-management:cluster:<cluster>:addon:cluster-proxy:agent:<agent>`;
    /// client auth only).
    #[arg(long)]
    pub identity: String,
    /// DNS names / IP addresses peers dial (repeatable; brokers need the names agents,
    /// clients and other brokers use).
    #[arg(long = "san")]
    pub sans: Vec<String>,
    /// Output directory.
    #[arg(long)]
    pub out: PathBuf,
    /// File stem (default: `broker-<id>` or `<client name>`).
    #[arg(long)]
    pub name: Option<String>,
    /// Certificate lifetime.
    #[arg(long, default_value = "90d", value_parser = crate::init::parse_duration)]
    pub lifetime: Duration,
    /// Keep an existing certificate for the same identity and names from this CA with at least
    /// half of its life left.
    #[arg(long)]
    pub if_valid: bool,
    /// Mode of the key file, octal (e.g. 0640 for a group-readable mount).
    #[arg(long, default_value = "0600", value_parser = parse_mode)]
    pub key_mode: u32,
}

fn parse_mode(s: &str) -> Result<u32, String> {
    u32::from_str_radix(s.trim_start_matches("0o"), 8)
        .ok()
        .filter(|m| *m <= 0o777)
        .ok_or_else(|| format!("invalid file mode {s:?}: expected octal such as 0600"))
}

/// The identity a `--identity` value names, and whether it gets server-auth usage.
fn parse_identity(s: &str) -> anyhow::Result<(Identity, bool)> {
    let (kind, name) = s.split_once(':').with_context(|| {
        format!("invalid --identity {s:?}: expected broker:<id>, client:<name> or agent:<cluster>:<agent>")
    })?;
    if kind == "agent" {
        // A static tunnel-agent certificate (OCM add-on agent CN, longer than openssl's
        // 64-character limit for commonName): client-auth usage only.
        let (cluster, agent) = name
            .split_once(':')
            .filter(|(c, a)| {
                tether_pki::subject::is_dns_label(c) && tether_pki::subject::is_dns_label(a)
            })
            .with_context(|| {
                format!(
                    "invalid --identity {s:?}: expected agent:<cluster>:<agent>, both DNS-1123 labels"
                )
            })?;
        return Ok((Identity::tunnel_agent(cluster, agent), false));
    }
    if !tether_pki::subject::is_dns_label(name) {
        bail!(
            "invalid --identity {s:?}: {name:?} is not a DNS-1123 label (a-z, 0-9, '-', at most 63)"
        );
    }
    match kind {
        "broker" => Ok((
            Identity::Broker {
                id: name.to_string(),
            },
            true,
        )),
        "client" => Ok((
            Identity::Client {
                name: name.to_string(),
            },
            false,
        )),
        _ => bail!("invalid --identity {s:?}: kind {kind:?} is not broker, client or agent"),
    }
}

pub fn issue(a: IssueArgs) -> anyhow::Result<()> {
    let (identity, server) = parse_identity(&a.identity)?;
    let cn = identity.common_name();
    let hub = HubDir::load(&a.dir)
        .with_context(|| format!("reading the hub directory {}", a.dir.display()))?;
    let ca_cert = read(&hub.path(&hub.config.ca.cert_file))?;
    let ca_key = read(&hub.path(&hub.config.ca.key_file))?;
    let ca = HubCa::from_pem(&ca_cert, &ca_key).context("loading the hub CA")?;
    let stem = a.name.clone().unwrap_or_else(|| match &identity {
        Identity::Broker { id } => format!("broker-{id}"),
        Identity::AddonAgent { cluster, agent, .. } => format!("agent-{cluster}-{agent}"),
        _ => identity_name(&a.identity),
    });
    let cert_path = a.out.join(format!("{stem}.crt"));
    let key_path = a.out.join(format!("{stem}.key"));
    if a.if_valid && still_valid(&cert_path, &key_path, &ca_cert, &cn, &a.sans) {
        println!("kept {} ({cn})", cert_path.display());
        return Ok(());
    }
    let (cert, key) = ca
        .issue(&cn, &a.sans, server, a.lifetime)
        .with_context(|| format!("issuing a certificate for {cn}"))?;
    std::fs::create_dir_all(&a.out).with_context(|| format!("creating {}", a.out.display()))?;
    tether_runtime::write_atomic(&key_path, key.as_bytes(), a.key_mode)
        .with_context(|| format!("writing {}", key_path.display()))?;
    tether_runtime::write_atomic(&cert_path, cert.as_bytes(), 0o644)
        .with_context(|| format!("writing {}", cert_path.display()))?;
    let ca_out = a.out.join("ca.crt");
    tether_runtime::write_atomic(&ca_out, ca_cert.as_bytes(), 0o644)
        .with_context(|| format!("writing {}", ca_out.display()))?;
    println!("issued {} ({cn})", cert_path.display());
    Ok(())
}

fn identity_name(s: &str) -> String {
    s.split_once(':')
        .map(|(_, n)| n.to_string())
        .unwrap_or_default()
}

fn read(p: &Path) -> anyhow::Result<String> {
    std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))
}

/// True when `cert_path` holds a certificate from this CA for `cn` with exactly `sans`, at
/// least half of its life left, and its key file exists.
fn still_valid(cert_path: &Path, key_path: &Path, ca_pem: &str, cn: &str, sans: &[String]) -> bool {
    let (Ok(pem), true) = (std::fs::read_to_string(cert_path), key_path.exists()) else {
        return false;
    };
    let Some(der) = pem_certificates(&pem).into_iter().next() else {
        return false;
    };
    let now = SystemTime::now();
    let Ok(info) = CertInfo::from_der(&der) else {
        return false;
    };
    let mut want: Vec<&str> = sans.iter().map(String::as_str).collect();
    want.sort_unstable();
    let mut have: Vec<&str> = info.sans.iter().map(String::as_str).collect();
    have.sort_unstable();
    info.common_name == cn
        && want == have
        && info.remaining_fraction(now) >= 0.5
        && verify_issued_by(&der, ca_pem, now).is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identities_parse_with_clear_errors() {
        assert!(matches!(
            parse_identity("broker:b1"),
            Ok((Identity::Broker { .. }, true))
        ));
        assert!(matches!(
            parse_identity("client:health-prober"),
            Ok((Identity::Client { .. }, false))
        ));
        let e = parse_identity("b1").unwrap_err().to_string();
        assert!(e.contains("broker:<id>"), "{e}");
        let e = parse_identity("peer:b1").unwrap_err().to_string();
        assert!(e.contains("not broker, client or agent"), "{e}");
        let agent = parse_identity("agent:c1:agent-0").unwrap();
        assert_eq!(
            agent.0.common_name(),
            "system:open-cluster-management:cluster:c1:addon:cluster-proxy:agent:agent-0"
        );
        assert!(!agent.1, "agent certificates are client-only");
        let e = parse_identity("agent:c1").unwrap_err().to_string();
        assert!(e.contains("agent:<cluster>:<agent>"), "{e}");
        let e = parse_identity("broker:B_1").unwrap_err().to_string();
        assert!(e.contains("DNS-1123"), "{e}");
        assert_eq!(parse_mode("0640"), Ok(0o640));
        assert!(parse_mode("999").is_err());
    }
}
