//! Identities carried in certificate subjects.
//!
//! Tether never trusts a name a peer *claims*; it trusts the CN of a certificate signed by the
//! hub CA. The CN grammar follows OCM so the same certificates make sense to OCM tooling:
//!
//! | CN | identity |
//! |---|---|
//! | `system:open-cluster-management:cluster:<c>:addon:<addon>:agent:<agent>` | add-on agent of cluster `c` (the tunnel-agent uses addon `cluster-proxy`) |
//! | `system:open-cluster-management:<c>:<agent>` | registration agent of cluster `c` |
//! | `tether:client:<name>` | a hub client (kubectl, health-prober, automation) |
//! | `tether:broker:<id>` | a tunnel-broker replica |
//! | `tether:hub:<component>` | another hub component |

use std::fmt;

use rustls_pki_types::CertificateDer;
use x509_parser::prelude::{FromDer, X509Certificate};

/// OCM's prefix for managed-cluster identities.
pub const OCM_PREFIX: &str = "system:open-cluster-management:";
/// Name of the tunnel add-on, as in cluster-proxy.
pub const TUNNEL_ADDON: &str = "cluster-proxy";

/// A verified peer identity.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Identity {
    /// An add-on agent running in a managed cluster (the tunnel-agent is addon `cluster-proxy`).
    AddonAgent {
        cluster: String,
        addon: String,
        agent: String,
    },
    /// A cluster's registration agent.
    RegistrationAgent { cluster: String, agent: String },
    /// A hub client.
    Client { name: String },
    /// A broker replica.
    Broker { id: String },
    /// Another hub component.
    Hub { component: String },
}

/// Why a certificate does not carry a usable identity.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum IdentityError {
    #[error("certificate is not valid X.509: {0}")]
    BadCertificate(String),
    #[error("certificate has no subject common name")]
    NoCommonName,
    #[error("certificate common name {0:?} is not a Tether identity")]
    Unrecognised(String),
    #[error("certificate common name {cn:?} has an invalid {part}: {reason}")]
    InvalidName {
        cn: String,
        part: &'static str,
        reason: String,
    },
}

impl Identity {
    /// The identity of a tunnel-agent of `cluster`.
    pub fn tunnel_agent(cluster: &str, agent: &str) -> Self {
        Self::AddonAgent {
            cluster: cluster.into(),
            addon: TUNNEL_ADDON.into(),
            agent: agent.into(),
        }
    }

    /// The managed cluster this identity belongs to, if any.
    pub fn cluster(&self) -> Option<&str> {
        match self {
            Self::AddonAgent { cluster, .. } | Self::RegistrationAgent { cluster, .. } => {
                Some(cluster)
            }
            _ => None,
        }
    }

    /// The subject common name encoding this identity.
    pub fn common_name(&self) -> String {
        match self {
            Self::AddonAgent {
                cluster,
                addon,
                agent,
            } => format!("{OCM_PREFIX}cluster:{cluster}:addon:{addon}:agent:{agent}"),
            Self::RegistrationAgent { cluster, agent } => format!("{OCM_PREFIX}{cluster}:{agent}"),
            Self::Client { name } => format!("tether:client:{name}"),
            Self::Broker { id } => format!("tether:broker:{id}"),
            Self::Hub { component } => format!("tether:hub:{component}"),
        }
    }

    /// Subject organisations OCM puts beside the CN (groups used for authorisation).
    pub fn organizations(&self) -> Vec<String> {
        match self {
            Self::AddonAgent { cluster, addon, .. } => vec![
                format!("{OCM_PREFIX}cluster:{cluster}:addon:{addon}"),
                format!("{OCM_PREFIX}addon:{addon}"),
            ],
            Self::RegistrationAgent { cluster, .. } => vec![
                format!("{OCM_PREFIX}{cluster}"),
                format!("{OCM_PREFIX}managed-clusters"),
            ],
            _ => vec![],
        }
    }

    /// Parses a common name.
    pub fn from_common_name(cn: &str) -> Result<Self, IdentityError> {
        let unrecognised = || IdentityError::Unrecognised(cn.to_owned());
        let id = if let Some(rest) = cn.strip_prefix(OCM_PREFIX) {
            let parts: Vec<&str> = rest.split(':').collect();
            match parts.as_slice() {
                ["cluster", c, "addon", a, "agent", g] => Self::AddonAgent {
                    cluster: (*c).into(),
                    addon: (*a).into(),
                    agent: (*g).into(),
                },
                [c, g] => Self::RegistrationAgent {
                    cluster: (*c).into(),
                    agent: (*g).into(),
                },
                _ => return Err(unrecognised()),
            }
        } else if let Some(n) = cn.strip_prefix("tether:client:") {
            Self::Client { name: n.into() }
        } else if let Some(n) = cn.strip_prefix("tether:broker:") {
            Self::Broker { id: n.into() }
        } else if let Some(n) = cn.strip_prefix("tether:hub:") {
            Self::Hub {
                component: n.into(),
            }
        } else {
            return Err(unrecognised());
        };
        id.check(cn)?;
        Ok(id)
    }

    fn check(&self, cn: &str) -> Result<(), IdentityError> {
        let bad = |part, reason: String| IdentityError::InvalidName {
            cn: cn.to_owned(),
            part,
            reason,
        };
        if let Some(c) = self.cluster() {
            validate_dns_label(c).map_err(|r| bad("cluster name", r))?;
        }
        let name = match self {
            Self::AddonAgent { agent, .. } | Self::RegistrationAgent { agent, .. } => agent,
            Self::Client { name } => name,
            Self::Broker { id } => id,
            Self::Hub { component } => component,
        };
        if name.is_empty() || name.contains(':') {
            return Err(bad("name", "must be non-empty and without ':'".into()));
        }
        Ok(())
    }

    /// Reads the identity from a DER certificate's subject CN.
    pub fn from_certificate(cert: &CertificateDer<'_>) -> Result<Self, IdentityError> {
        let (_, x509) = X509Certificate::from_der(cert.as_ref())
            .map_err(|e| IdentityError::BadCertificate(e.to_string()))?;
        let cn = x509
            .subject()
            .iter_common_name()
            .next()
            .and_then(|a| a.as_str().ok())
            .ok_or(IdentityError::NoCommonName)?;
        Self::from_common_name(cn)
    }

    /// The certificate's serial number as lower-case hex without leading zero bytes (the form
    /// the hub records for issued client certificates), or None if it does not parse.
    pub fn serial_of(cert: &CertificateDer<'_>) -> Option<String> {
        let (_, x509) = X509Certificate::from_der(cert.as_ref()).ok()?;
        Some(normalize_serial(&hex_lower(x509.raw_serial())))
    }

    /// A short label for logs and metrics (never contains secrets).
    pub fn label(&self) -> String {
        match self {
            Self::AddonAgent { cluster, agent, .. } => format!("agent/{cluster}/{agent}"),
            Self::RegistrationAgent { cluster, agent } => format!("registration/{cluster}/{agent}"),
            Self::Client { name } => format!("client/{name}"),
            Self::Broker { id } => format!("broker/{id}"),
            Self::Hub { component } => format!("hub/{component}"),
        }
    }
}

impl fmt::Display for Identity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.label())
    }
}

/// Checks a DNS-1123 label (what Kubernetes and OCM require of cluster names).
fn hex_lower(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// Hex serial in one canonical form: lower case, no leading `00` bytes, no colons.
pub fn normalize_serial(hex: &str) -> String {
    let h: String = hex
        .chars()
        .filter(|c| *c != ':')
        .map(|c| c.to_ascii_lowercase())
        .collect();
    let mut t = h.as_str();
    while t.len() > 2 && t.starts_with("00") {
        t = &t[2..];
    }
    t.to_string()
}

pub fn validate_dns_label(s: &str) -> Result<(), String> {
    if s.is_empty() || s.len() > 63 {
        return Err(format!("{s:?} must be 1-63 characters"));
    }
    let ok_chars = s
        .bytes()
        .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-');
    if !ok_chars || s.starts_with('-') || s.ends_with('-') {
        return Err(format!(
            "{s:?} must be lower-case alphanumerics or '-', starting and ending with an alphanumeric"
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_every_kind() {
        for id in [
            Identity::tunnel_agent("c1", "a-0"),
            Identity::RegistrationAgent {
                cluster: "c1".into(),
                agent: "klusterlet".into(),
            },
            Identity::Client { name: "ops".into() },
            Identity::Broker { id: "b1".into() },
            Identity::Hub {
                component: "addon-manager".into(),
            },
        ] {
            assert_eq!(Identity::from_common_name(&id.common_name()).unwrap(), id);
        }
    }

    #[test]
    fn rejects_bad_cluster_names() {
        let e =
            Identity::from_common_name("system:open-cluster-management:Bad_Name:a").unwrap_err();
        assert!(
            matches!(
                e,
                IdentityError::InvalidName {
                    part: "cluster name",
                    ..
                }
            ),
            "{e}"
        );
        assert!(Identity::from_common_name("CN=root").is_err());
        assert!(Identity::from_common_name("tether:client:").is_err());
    }
}
