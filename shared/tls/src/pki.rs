//! A small certificate authority: generate or load a CA, issue leaf certificates.
//!
//! Keys are ECDSA P-256. Leaf certificates carry the identity in the subject CN (see
//! `identity`), OCM's organisations, DNS/IP SANs for servers, and the extended key
//! usages their role needs.

use std::time::{Duration, SystemTime};

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose, SanType,
};

use crate::Identity;

/// Errors of the PKI.
#[derive(Debug, thiserror::Error)]
pub enum PkiError {
    #[error("CA certificate or key is invalid: {0}")]
    BadCa(String),
    #[error("invalid subject alternative name {0:?}")]
    BadSan(String),
    #[error("certificate generation failed: {0}")]
    Generate(#[from] rcgen::Error),
}

/// A PEM certificate with its PEM private key. `Debug` masks the key.
#[derive(Clone)]
pub struct IssuedCert {
    pub cert_pem: String,
    pub key_pem: String,
}

impl std::fmt::Debug for IssuedCert {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IssuedCert")
            .field("cert_pem", &format_args!("{} bytes", self.cert_pem.len()))
            .field("key_pem", &"<redacted>")
            .finish()
    }
}

/// What to put in a leaf certificate.
#[derive(Debug, Clone)]
pub struct LeafSpec {
    pub identity: Identity,
    /// DNS names and IP addresses for server certificates.
    pub sans: Vec<String>,
    pub server: bool,
    pub client: bool,
    pub validity: Duration,
    /// Backdate `not_before` (for expired-certificate tests, pass a validity that ends in the
    /// past by setting this larger than `validity`).
    pub backdate: Duration,
}

impl LeafSpec {
    /// A client+server certificate valid for `validity`, starting a minute ago (clock skew).
    pub fn new(identity: Identity, validity: Duration) -> Self {
        Self {
            identity,
            sans: vec![],
            server: false,
            client: true,
            validity,
            backdate: Duration::from_secs(60),
        }
    }

    pub fn server(mut self, sans: impl IntoIterator<Item = impl Into<String>>) -> Self {
        self.server = true;
        self.sans = sans.into_iter().map(Into::into).collect();
        self
    }
}

/// A certificate authority that can issue leaf certificates.
pub struct CertificateAuthority {
    cert_pem: String,
    key: KeyPair,
    issuer: Issuer<'static, KeyPair>,
}

impl std::fmt::Debug for CertificateAuthority {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CertificateAuthority")
            .finish_non_exhaustive()
    }
}

impl CertificateAuthority {
    /// Generates a new self-signed CA named `common_name`, valid for `validity`.
    pub fn generate(common_name: &str, validity: Duration) -> Result<Self, PkiError> {
        let key = KeyPair::generate()?;
        let mut params = CertificateParams::default();
        let mut dn = DistinguishedName::new();
        dn.push(DnType::CommonName, common_name);
        dn.push(DnType::OrganizationName, "tether");
        params.distinguished_name = dn;
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let now = SystemTime::now();
        params.not_before = (now - Duration::from_secs(60)).into();
        params.not_after = (now + validity).into();
        let cert = params.self_signed(&key)?;
        let cert_pem = cert.pem();
        Self::from_pem(&cert_pem, &key.serialize_pem())
    }

    /// Loads a CA from its PEM certificate and key.
    pub fn from_pem(cert_pem: &str, key_pem: &str) -> Result<Self, PkiError> {
        let key = KeyPair::from_pem(key_pem).map_err(|e| PkiError::BadCa(format!("key: {e}")))?;
        let issuer_key =
            KeyPair::from_pem(key_pem).map_err(|e| PkiError::BadCa(format!("key: {e}")))?;
        let issuer = Issuer::from_ca_cert_pem(cert_pem, issuer_key)
            .map_err(|e| PkiError::BadCa(format!("certificate: {e}")))?;
        Ok(Self {
            cert_pem: cert_pem.to_owned(),
            key,
            issuer,
        })
    }

    pub fn cert_pem(&self) -> &str {
        &self.cert_pem
    }

    /// The CA's private key in PEM. Handle with care; never log it.
    pub fn key_pem(&self) -> String {
        self.key.serialize_pem()
    }

    /// Issues a leaf certificate with a fresh key.
    pub fn issue(&self, spec: &LeafSpec) -> Result<IssuedCert, PkiError> {
        let key = KeyPair::generate()?;
        let params = leaf_params(spec)?;
        let cert = params.signed_by(&key, &self.issuer)?;
        Ok(IssuedCert {
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
        })
    }
}

fn leaf_params(spec: &LeafSpec) -> Result<CertificateParams, PkiError> {
    let mut params = CertificateParams::default();
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, spec.identity.common_name());
    for o in spec.identity.organizations() {
        dn.push(DnType::OrganizationName, o);
    }
    params.distinguished_name = dn;
    for san in &spec.sans {
        let entry = match san.parse::<std::net::IpAddr>() {
            Ok(ip) => SanType::IpAddress(ip),
            Err(_) => SanType::DnsName(
                san.clone()
                    .try_into()
                    .map_err(|_| PkiError::BadSan(san.clone()))?,
            ),
        };
        params.subject_alt_names.push(entry);
    }
    params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    if spec.server {
        params
            .extended_key_usages
            .push(ExtendedKeyUsagePurpose::ServerAuth);
    }
    if spec.client {
        params
            .extended_key_usages
            .push(ExtendedKeyUsagePurpose::ClientAuth);
    }
    let now = SystemTime::now();
    let not_before = now - spec.backdate;
    params.not_before = not_before.into();
    params.not_after = (not_before + spec.validity).into();
    let mut serial = [0u8; 16];
    serial.copy_from_slice(&rand_serial());
    params.serial_number = Some(serial.to_vec().into());
    Ok(params)
}

fn rand_serial() -> [u8; 16] {
    use sha2::{Digest, Sha256};
    let nanos = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap_or_default()
        .as_nanos();
    static COUNTER: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = COUNTER.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let d = Sha256::new()
        .chain_update(nanos.to_le_bytes())
        .chain_update(n.to_le_bytes())
        .chain_update(std::process::id().to_le_bytes())
        .finalize();
    let mut out = [0u8; 16];
    out.copy_from_slice(&d[..16]);
    out[0] &= 0x7f; // positive INTEGER
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use rustls_pki_types::CertificateDer;
    use rustls_pki_types::pem::PemObject;

    #[test]
    fn issued_cert_carries_identity() {
        let ca = CertificateAuthority::generate("test-ca", Duration::from_secs(3600)).unwrap();
        let id = Identity::tunnel_agent("c1", "a1");
        let leaf = ca
            .issue(&LeafSpec::new(id.clone(), Duration::from_secs(600)))
            .unwrap();
        let der = CertificateDer::from_pem_slice(leaf.cert_pem.as_bytes()).unwrap();
        assert_eq!(Identity::from_certificate(&der).unwrap(), id);
        assert!(!format!("{leaf:?}").contains("PRIVATE"));
        let again = CertificateAuthority::from_pem(ca.cert_pem(), &ca.key_pem()).unwrap();
        again
            .issue(&LeafSpec::new(id, Duration::from_secs(1)))
            .unwrap();
    }
}
