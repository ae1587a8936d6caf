//! The add-on's hub credentials, OCM's `<addon>-hub-kubeconfig` secret: `kubeconfig`,
//! `tls.crt`, `tls.key`, `cluster-name`. The kubeconfig inherits server, CA and proxy-url from
//! the cluster's hub kubeconfig; the certificate carries OCM's add-on subject
//! (`CN=system:open-cluster-management:cluster:<c>:addon:<a>:agent:<agent>`,
//! `O=system:open-cluster-management:cluster:<c>:addon:<a>`, `O=system:open-cluster-management:addon:<a>`).
//!
//! The key is generated locally, written (0600) before the CSR is sent so a restart re-sends
//! the same CSR, and never leaves the cluster. Rotation (new key, new CSR) starts when less than
//! a random 20–25 % of the certificate's life is left; the tunnel-agent reloads the files
//! without dropping its tunnels.

use std::time::{Duration, Instant, SystemTime};

use tether_control::addons::{addon_agent_common_name, addon_agent_organizations};
use tether_control::connect;
use tether_control::kubeconfig::{self, HubEndpoint};
use tether_control::resources::{CsrGet, CsrPhase, CsrReply, CsrSubmit};
use tether_control::subjects;
use tether_pki::{AgentKey, CertInfo};

use crate::secret::{
    HubSecret, HubSecretStore, KEY_CLUSTER_NAME, KEY_KUBECONFIG, KEY_TLS_CRT, KEY_TLS_KEY,
};

/// How long an add-on CSR may take to be issued before the attempt is abandoned (and retried).
pub const CSR_DEADLINE: Duration = Duration::from_secs(30);
/// Poll interval of `…addon.<a>.csr.get`.
pub const CSR_POLL: Duration = Duration::from_millis(300);

/// Errors while obtaining add-on credentials (each names the step).
#[derive(Debug, thiserror::Error)]
pub enum CredentialError {
    #[error("add-on key: {0}")]
    Key(String),
    #[error("add-on CSR: {0}")]
    Csr(String),
    #[error("hub: {0}")]
    Hub(#[from] tether_control::ControlError),
    #[error("add-on credentials store: {0}")]
    Store(#[from] crate::secret::SecretError),
    #[error("issued add-on certificate: {0}")]
    Issued(String),
}

/// Creates an add-on CSR with OCM's add-on subject. Returns PEM.
pub fn create_addon_csr(
    key: &AgentKey,
    cluster: &str,
    addon: &str,
    agent: &str,
) -> Result<String, CredentialError> {
    use rcgen::{
        CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, KeyPair,
        KeyUsagePurpose,
    };
    let kp = KeyPair::from_pem(&key.to_pem()).map_err(|e| CredentialError::Key(e.to_string()))?;
    let mut params = CertificateParams::default();
    let mut dn = DistinguishedName::new();
    dn.push(
        DnType::CommonName,
        addon_agent_common_name(cluster, addon, agent).as_str(),
    );
    let orgs = addon_agent_organizations(cluster, addon);
    dn.push(DnType::OrganizationName, orgs[0].as_str());
    // rcgen keeps one value per attribute type; the same OID as a custom type adds the second O.
    dn.push(DnType::CustomDnType(vec![2, 5, 4, 10]), orgs[1].as_str());
    params.distinguished_name = dn;
    params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
    params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    let csr = params
        .serialize_request(&kp)
        .map_err(|e| CredentialError::Csr(e.to_string()))?;
    csr.pem().map_err(|e| CredentialError::Csr(e.to_string()))
}

/// Why the stored add-on credentials cannot be used (the agent then requests new ones).
#[derive(Debug, thiserror::Error)]
pub enum Unusable {
    #[error("no add-on credentials yet")]
    Missing,
    #[error("cluster-name differs")]
    OtherCluster,
    #[error(transparent)]
    Kubeconfig(#[from] tether_kubeconfig::KubeconfigError),
    #[error("server, proxy-url or CA differ from the hub kubeconfig")]
    OtherHub,
    #[error(transparent)]
    Pki(tether_pki::PkiError),
    #[error("certificate CN {0:?} is not this add-on agent")]
    OtherAgent(String),
    #[error("certificate not valid against the hub CA: {0}")]
    NotFromHub(#[source] tether_pki::PkiError),
    #[error("tls.key does not match tls.crt")]
    KeyMismatch,
}

/// Whether the stored credentials are usable for `cluster`/`addon`/`agent` against `endpoint`
/// and the hub CA; Err names why not. Ok carries the certificate facts.
pub fn check(
    secret: &HubSecret,
    cluster: &str,
    addon: &str,
    agent: &str,
    endpoint: &HubEndpoint,
    hub_ca_pem: &str,
) -> Result<CertInfo, Unusable> {
    let (Some(kc), Some(crt), Some(key)) = (
        secret.get(KEY_KUBECONFIG),
        secret.get(KEY_TLS_CRT),
        secret.get(KEY_TLS_KEY),
    ) else {
        return Err(Unusable::Missing);
    };
    if secret.get(KEY_CLUSTER_NAME).map(str::trim) != Some(cluster) {
        return Err(Unusable::OtherCluster);
    }
    let ep = kubeconfig::parse_hub_endpoint(kc, "add-on kubeconfig")?;
    if !ep.same_hub(endpoint) {
        return Err(Unusable::OtherHub);
    }
    let info = CertInfo::from_pem(crt).map_err(Unusable::Pki)?;
    if info.common_name != addon_agent_common_name(cluster, addon, agent) {
        return Err(Unusable::OtherAgent(info.common_name));
    }
    let der = tether_pki::pem_certificates(crt).remove(0);
    tether_pki::verify_issued_by(der.as_ref(), hub_ca_pem, SystemTime::now())
        .map_err(Unusable::NotFromHub)?;
    let key = AgentKey::from_pem(key).map_err(Unusable::Pki)?;
    if key.public_key_raw() != info.public_key_raw.as_slice() {
        return Err(Unusable::KeyMismatch);
    }
    Ok(info)
}

/// Obtains a fresh certificate: key (the pending one, unless `new_key`), CSR on
/// `…addon.<a>.csr`, poll until issued, then writes the four keys.
#[allow(clippy::too_many_arguments)]
pub async fn issue<S: HubSecretStore>(
    store: &S,
    client: &async_nats::Client,
    cluster: &str,
    addon: &str,
    agent: &str,
    endpoint: &HubEndpoint,
    new_key: bool,
) -> Result<CertInfo, CredentialError> {
    let mut secret = store.load().await?;
    let key = match secret
        .get(KEY_TLS_KEY)
        .filter(|_| !new_key)
        .and_then(|k| AgentKey::from_pem(k).ok())
    {
        Some(k) => k,
        None => {
            let k = AgentKey::generate().map_err(|e| CredentialError::Key(e.to_string()))?;
            if secret.get(KEY_TLS_CRT).is_none() {
                // Nothing running with the old files: keep the pending key across restarts.
                secret.set(KEY_TLS_KEY, k.to_pem());
                secret.set(KEY_CLUSTER_NAME, cluster);
                store.save(&secret).await?;
            }
            k
        }
    };
    let csr = create_addon_csr(&key, cluster, addon, agent)?;
    let mut reply: CsrReply = connect::request_json(
        client,
        subjects::cluster_addon_csr(cluster, addon),
        &CsrSubmit {
            cluster_name: cluster.into(),
            agent_name: agent.into(),
            csr,
            cluster_claims: vec![],
            labels: Default::default(),
        },
    )
    .await?;
    let deadline = Instant::now() + CSR_DEADLINE;
    while reply.phase != CsrPhase::Issued {
        if reply.phase == CsrPhase::Denied || Instant::now() > deadline {
            return Err(CredentialError::Csr(format!(
                "{} not issued: {}",
                reply.csr_name, reply.message
            )));
        }
        tokio::time::sleep(CSR_POLL).await;
        reply = connect::request_json(
            client,
            subjects::cluster_addon_csr_get(cluster, addon),
            &CsrGet {
                csr_name: reply.csr_name.clone(),
            },
        )
        .await?;
    }
    let info = CertInfo::from_pem(&reply.certificate)
        .map_err(|e| CredentialError::Issued(e.to_string()))?;
    if info.public_key_raw != key.public_key_raw() {
        return Err(CredentialError::Issued("not for our key".into()));
    }
    if info.common_name != addon_agent_common_name(cluster, addon, agent) {
        return Err(CredentialError::Issued(format!(
            "CN {:?} is not this add-on agent",
            info.common_name
        )));
    }
    let kc =
        kubeconfig::render_hub(endpoint).map_err(|e| CredentialError::Issued(e.to_string()))?;
    let mut s = HubSecret::default();
    s.set(KEY_KUBECONFIG, kc);
    s.set(KEY_TLS_CRT, reply.certificate);
    s.set(KEY_TLS_KEY, key.to_pem());
    s.set(KEY_CLUSTER_NAME, cluster);
    store.save(&s).await?;
    Ok(info)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addon_csr_is_signed_with_the_addon_subject() {
        let ca = tether_pki::HubCa::generate("hub", Duration::from_secs(600)).unwrap();
        let key = AgentKey::generate().unwrap();
        let csr = create_addon_csr(&key, "c1", "cluster-proxy", "a1").unwrap();
        let parsed = tether_pki::parse_csr(&csr).unwrap();
        assert_eq!(
            parsed.common_name,
            "system:open-cluster-management:cluster:c1:addon:cluster-proxy:agent:a1"
        );
        let mut o = parsed.organizations.clone();
        o.sort();
        assert_eq!(
            o,
            vec![
                "system:open-cluster-management:addon:cluster-proxy".to_string(),
                "system:open-cluster-management:cluster:c1:addon:cluster-proxy".to_string()
            ]
        );
        // The tunnel broker reads the identity from such a certificate.
        let id = tether_tls::Identity::from_common_name(&parsed.common_name).unwrap();
        assert_eq!(id, tether_tls::Identity::tunnel_agent("c1", "a1"));
        let _ = ca;
    }
}
