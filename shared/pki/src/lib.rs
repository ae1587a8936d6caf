//! Certificates for registration, with Open Cluster Management's conventions.
//!
//! Layout:
//! - [`subject`]: the OCM subject names (`system:open-cluster-management:<cluster>:<agent>`, the
//!   two organisations) and their validation.
//! - [`AgentKey`]: the managed cluster's private key. It is generated on the agent and never
//!   leaves it; `Debug` prints only the public key's fingerprint.
//! - [`create_csr`] / [`parse_csr`]: the certificate signing request the agent sends and the
//!   hub's parsed, signature-checked view of it.
//! - [`HubCa`]: the hub's certificate authority: issues the NATS server certificate and signs
//!   client certificates from validated CSRs, with the hub (not the request) deciding subject,
//!   usages and lifetime.
//! - [`CertInfo`] / [`verify_issued_by`]: parsing and checking issued certificates.
//! - [`sign_message`] / [`verify_message`]: proof of possession of the agent key, used to
//!   authenticate to NATS with the issued certificate.
//! - [`merge_pem_bundles`]: PEM CA bundles merged and de-duplicated (hub CA + proxy CA).
#![forbid(unsafe_code)]

use std::fmt;
use std::time::{Duration, SystemTime};

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose, SanType, SerialNumber,
};
use rustls_pki_types::CertificateDer;
use sha2::{Digest, Sha256};
use time::OffsetDateTime;
use x509_parser::prelude::{FromDer, X509Certificate};

/// The OCM naming conventions for registration identities.
pub mod subject {
    /// Prefix of every OCM identity.
    pub const PREFIX: &str = "system:open-cluster-management";
    /// Organisation every managed cluster agent belongs to.
    pub const MANAGED_CLUSTERS_GROUP: &str = "system:open-cluster-management:managed-clusters";
    /// The signer name OCM uses for registration CSRs.
    pub const SIGNER_NAME: &str = "kubernetes.io/kube-apiserver-client";

    /// `system:open-cluster-management:<cluster>:<agent>`
    pub fn common_name(cluster: &str, agent: &str) -> String {
        format!("{PREFIX}:{cluster}:{agent}")
    }

    /// `system:open-cluster-management:<cluster>`
    pub fn cluster_group(cluster: &str) -> String {
        format!("{PREFIX}:{cluster}")
    }

    /// Parses `system:open-cluster-management:<cluster>:<agent>` into (cluster, agent).
    pub fn parse_common_name(cn: &str) -> Option<(&str, &str)> {
        let rest = cn.strip_prefix(PREFIX)?.strip_prefix(':')?;
        let (cluster, agent) = rest.split_once(':')?;
        if is_dns_label(cluster) && is_agent_name(agent) {
            Some((cluster, agent))
        } else {
            None
        }
    }

    /// A DNS-1123 label: lower-case alphanumerics and '-', 1..=63, starting and ending with an
    /// alphanumeric. Cluster names must be one.
    pub fn is_dns_label(s: &str) -> bool {
        !s.is_empty()
            && s.len() <= 63
            && s.bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
            && !s.starts_with('-')
            && !s.ends_with('-')
    }

    /// Agent names: 1..=64 of `[a-z0-9-]`.
    pub fn is_agent_name(s: &str) -> bool {
        !s.is_empty()
            && s.len() <= 64
            && s.bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
    }
}

/// Errors from certificate handling. Each names what was wrong.
#[derive(Debug, thiserror::Error)]
pub enum PkiError {
    #[error("generating a key: {0}")]
    KeyGeneration(String),
    #[error("invalid private key PEM: {0}")]
    InvalidKey(String),
    #[error("invalid certificate signing request: {0}")]
    InvalidCsr(String),
    #[error("CSR subject rejected: {0}")]
    SubjectRejected(String),
    #[error("invalid certificate: {0}")]
    InvalidCertificate(String),
    #[error("no certificate found in PEM data ({0})")]
    NoCertificate(&'static str),
    #[error("signing a certificate: {0}")]
    Signing(String),
    #[error("certificate is not signed by the trusted CA")]
    UntrustedIssuer,
    #[error("signature does not verify")]
    BadSignature,
}

type Result<T, E = PkiError> = std::result::Result<T, E>;

/// The managed cluster's private key (ECDSA P-256). Generated locally, never sent anywhere.
pub struct AgentKey {
    key: KeyPair,
}

impl fmt::Debug for AgentKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AgentKey")
            .field("public_sha256", &fingerprint(self.key.public_key_raw()))
            .field("private", &"<masked>")
            .finish()
    }
}

impl AgentKey {
    /// A fresh ECDSA P-256 key.
    pub fn generate() -> Result<Self> {
        let key = KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256)
            .map_err(|e| PkiError::KeyGeneration(e.to_string()))?;
        Ok(Self { key })
    }

    /// Loads a PKCS#8 PEM key written by [`AgentKey::to_pem`].
    pub fn from_pem(pem: &str) -> Result<Self> {
        let key = KeyPair::from_pem(pem).map_err(|e| PkiError::InvalidKey(e.to_string()))?;
        Ok(Self { key })
    }

    /// PKCS#8 PEM (to be stored with mode 0600).
    pub fn to_pem(&self) -> String {
        self.key.serialize_pem()
    }

    /// The raw public key (uncompressed point), as found in certificates issued for it.
    pub fn public_key_raw(&self) -> &[u8] {
        self.key.public_key_raw()
    }

    pub(crate) fn key_pair(&self) -> &KeyPair {
        &self.key
    }
}

fn fingerprint(bytes: &[u8]) -> String {
    hex::encode(&Sha256::digest(bytes)[..8])
}

/// Creates a CSR with OCM's subject: CN `system:open-cluster-management:<cluster>:<agent>`,
/// O `system:open-cluster-management:<cluster>` and
/// `system:open-cluster-management:managed-clusters`, client-auth usage. Returns PEM.
pub fn create_csr(key: &AgentKey, cluster: &str, agent: &str) -> Result<String> {
    if !subject::is_dns_label(cluster) {
        return Err(PkiError::SubjectRejected(format!(
            "cluster name {cluster:?} is not a DNS-1123 label"
        )));
    }
    if !subject::is_agent_name(agent) {
        return Err(PkiError::SubjectRejected(format!(
            "agent name {agent:?} must be 1-64 of [a-z0-9-]"
        )));
    }
    let mut params = CertificateParams::default();
    params.distinguished_name = ocm_dn(cluster, agent);
    params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
    params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    let csr = params
        .serialize_request(key.key_pair())
        .map_err(|e| PkiError::InvalidCsr(e.to_string()))?;
    csr.pem().map_err(|e| PkiError::InvalidCsr(e.to_string()))
}

fn ocm_dn(cluster: &str, agent: &str) -> DistinguishedName {
    subject_dn(
        &subject::common_name(cluster, agent),
        &[
            subject::cluster_group(cluster),
            subject::MANAGED_CLUSTERS_GROUP.to_owned(),
        ],
    )
}

/// The hub's view of a CSR whose signature has been checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParsedCsr {
    pub common_name: String,
    pub organizations: Vec<String>,
    /// Raw public key bytes (uncompressed point for ECDSA).
    pub public_key_raw: Vec<u8>,
    /// SHA-256 of the public key, hex: identifies the requesting key.
    pub key_fingerprint: String,
    pub(crate) der: Vec<u8>,
}

impl ParsedCsr {
    /// Checks the subject is exactly OCM's for `cluster`: CN names that cluster and an agent,
    /// and the organisations are the cluster group and the managed-clusters group (nothing else).
    /// Returns the agent name.
    pub fn validate_for(&self, cluster: &str) -> Result<String> {
        let (c, agent) = subject::parse_common_name(&self.common_name).ok_or_else(|| {
            PkiError::SubjectRejected(format!(
                "CN {:?} is not system:open-cluster-management:<cluster>:<agent>",
                self.common_name
            ))
        })?;
        if c != cluster {
            return Err(PkiError::SubjectRejected(format!(
                "CN names cluster {c:?} but the request is for cluster {cluster:?}"
            )));
        }
        let mut want = vec![
            subject::cluster_group(cluster),
            subject::MANAGED_CLUSTERS_GROUP.to_string(),
        ];
        let mut have = self.organizations.clone();
        want.sort();
        have.sort();
        if want != have {
            return Err(PkiError::SubjectRejected(format!(
                "organizations {:?} must be exactly {:?}",
                self.organizations, want
            )));
        }
        Ok(agent.to_string())
    }
}

/// Parses a PEM CSR and verifies its self-signature.
pub fn parse_csr(pem: &str) -> Result<ParsedCsr> {
    let der = pem_block(pem, "CERTIFICATE REQUEST")
        .ok_or_else(|| PkiError::InvalidCsr("no CERTIFICATE REQUEST PEM block".into()))?;
    let (_, csr) = x509_parser::certification_request::X509CertificationRequest::from_der(&der)
        .map_err(|e| PkiError::InvalidCsr(e.to_string()))?;
    csr.verify_signature()
        .map_err(|_| PkiError::InvalidCsr("signature does not verify".into()))?;
    let info = &csr.certification_request_info;
    let common_name = info
        .subject
        .iter_common_name()
        .next()
        .and_then(|a| a.as_str().ok())
        .unwrap_or_default()
        .to_string();
    let organizations = info
        .subject
        .iter_organization()
        .filter_map(|a| a.as_str().ok().map(str::to_string))
        .collect();
    let public_key_raw = info.subject_pki.subject_public_key.data.to_vec();
    Ok(ParsedCsr {
        common_name,
        organizations,
        key_fingerprint: hex::encode(Sha256::digest(&public_key_raw)),
        public_key_raw,
        der,
    })
}

fn pem_block(pem: &str, label: &str) -> Option<Vec<u8>> {
    let begin = format!("-----BEGIN {label}-----");
    let end = format!("-----END {label}-----");
    let start = pem.find(&begin)? + begin.len();
    let stop = pem[start..].find(&end)? + start;
    let b64: String = pem[start..stop]
        .chars()
        .filter(|c| !c.is_whitespace())
        .collect();
    use base64::Engine;
    base64::engine::general_purpose::STANDARD.decode(b64).ok()
}

/// All certificates (DER) in a PEM bundle, in order.
pub fn pem_certificates(pem: &str) -> Vec<CertificateDer<'static>> {
    let mut rd = std::io::BufReader::new(pem.as_bytes());
    rustls_pemfile::certs(&mut rd)
        .filter_map(|c| c.ok())
        .collect()
}

fn der_to_pem(der: &[u8]) -> String {
    use base64::Engine;
    let b64 = base64::engine::general_purpose::STANDARD.encode(der);
    let mut out = String::from("-----BEGIN CERTIFICATE-----\n");
    for chunk in b64.as_bytes().chunks(64) {
        out.push_str(std::str::from_utf8(chunk).unwrap_or_default());
        out.push('\n');
    }
    out.push_str("-----END CERTIFICATE-----\n");
    out
}

/// Merges PEM CA bundles, dropping duplicate certificates (compared by DER), keeping order.
/// Like `clusteradm join --proxy-ca-file`: hub CA first, then the proxy CA.
pub fn merge_pem_bundles<'a>(bundles: impl IntoIterator<Item = &'a str>) -> String {
    let mut seen = std::collections::HashSet::new();
    let mut out = String::new();
    for bundle in bundles {
        for der in pem_certificates(bundle) {
            if seen.insert(der.as_ref().to_vec()) {
                out.push_str(&der_to_pem(der.as_ref()));
            }
        }
    }
    out
}

/// Facts read from an issued certificate.
#[derive(Debug, Clone)]
pub struct CertInfo {
    pub common_name: String,
    pub organizations: Vec<String>,
    pub not_before: SystemTime,
    pub not_after: SystemTime,
    pub serial_hex: String,
    pub public_key_raw: Vec<u8>,
    pub is_ca: bool,
    /// Subject alternative names: DNS names as written, IP addresses in their text form.
    pub sans: Vec<String>,
}

fn subject_alt_names(cert: &X509Certificate<'_>) -> Vec<String> {
    use x509_parser::extensions::GeneralName;
    let Ok(Some(ext)) = cert.subject_alternative_name() else {
        return Vec::new();
    };
    ext.value
        .general_names
        .iter()
        .filter_map(|n| match n {
            GeneralName::DNSName(d) => Some(d.to_string()),
            GeneralName::IPAddress(b) => match b.len() {
                4 => <[u8; 4]>::try_from(*b)
                    .ok()
                    .map(|a| std::net::IpAddr::from(a).to_string()),
                16 => <[u8; 16]>::try_from(*b)
                    .ok()
                    .map(|a| std::net::IpAddr::from(a).to_string()),
                _ => None,
            },
            _ => None,
        })
        .collect()
}

impl CertInfo {
    /// Parses the first certificate of a PEM bundle.
    pub fn from_pem(pem: &str) -> Result<Self> {
        let der = pem_certificates(pem)
            .into_iter()
            .next()
            .ok_or(PkiError::NoCertificate("tls.crt"))?;
        Self::from_der(der.as_ref())
    }

    pub fn from_der(der: &[u8]) -> Result<Self> {
        let (_, cert) = X509Certificate::from_der(der)
            .map_err(|e| PkiError::InvalidCertificate(e.to_string()))?;
        let to_sys = |t: x509_parser::time::ASN1Time| {
            let secs = t.timestamp();
            if secs >= 0 {
                SystemTime::UNIX_EPOCH + Duration::from_secs(secs as u64)
            } else {
                SystemTime::UNIX_EPOCH
            }
        };
        Ok(Self {
            common_name: cert
                .subject()
                .iter_common_name()
                .next()
                .and_then(|a| a.as_str().ok())
                .unwrap_or_default()
                .to_string(),
            organizations: cert
                .subject()
                .iter_organization()
                .filter_map(|a| a.as_str().ok().map(str::to_string))
                .collect(),
            not_before: to_sys(cert.validity().not_before),
            not_after: to_sys(cert.validity().not_after),
            serial_hex: cert.raw_serial_as_string().replace(':', ""),
            public_key_raw: cert.public_key().subject_public_key.data.to_vec(),
            is_ca: cert.is_ca(),
            sans: subject_alt_names(&cert),
        })
    }

    /// Fraction of the validity period still remaining at `now` (0.0 when expired).
    pub fn remaining_fraction(&self, now: SystemTime) -> f64 {
        let total = self
            .not_after
            .duration_since(self.not_before)
            .unwrap_or_default()
            .as_secs_f64();
        let left = self
            .not_after
            .duration_since(now)
            .unwrap_or_default()
            .as_secs_f64();
        if total <= 0.0 {
            0.0
        } else {
            (left / total).clamp(0.0, 1.0)
        }
    }

    /// When the certificate was actually issued (`notBefore` minus the back-dating of
    /// [`backdate_for`]: total = L + min(60 s, L/20), so the back-dating is min(60 s, total/21)).
    pub fn issued_at(&self) -> SystemTime {
        let total = self
            .not_after
            .duration_since(self.not_before)
            .unwrap_or_default();
        self.not_before + (total / 21).min(Duration::from_secs(60))
    }

    pub fn is_expired(&self, now: SystemTime) -> bool {
        now >= self.not_after || now < self.not_before
    }
}

/// Checks that `cert_der` is signed by one of the CA certificates in `ca_pem` and is within its
/// validity period at `now`.
pub fn verify_issued_by(cert_der: &[u8], ca_pem: &str, now: SystemTime) -> Result<()> {
    let (_, cert) = X509Certificate::from_der(cert_der)
        .map_err(|e| PkiError::InvalidCertificate(e.to_string()))?;
    let now_secs = now
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs() as i64;
    if now_secs < cert.validity().not_before.timestamp()
        || now_secs >= cert.validity().not_after.timestamp()
    {
        return Err(PkiError::InvalidCertificate(format!(
            "outside its validity period (not after {})",
            cert.validity().not_after
        )));
    }
    for ca in pem_certificates(ca_pem) {
        let Ok((_, ca_cert)) = X509Certificate::from_der(ca.as_ref()) else {
            continue;
        };
        if ca_cert.subject() != cert.issuer() {
            continue;
        }
        if cert.verify_signature(Some(ca_cert.public_key())).is_ok() {
            return Ok(());
        }
    }
    Err(PkiError::UntrustedIssuer)
}

/// Signs `msg` with the agent key (ECDSA P-256 SHA-256, ASN.1 DER signature).
pub fn sign_message(key: &AgentKey, msg: &[u8]) -> Result<Vec<u8>> {
    let rng = ring::rand::SystemRandom::new();
    let kp = ring::signature::EcdsaKeyPair::from_pkcs8(
        &ring::signature::ECDSA_P256_SHA256_ASN1_SIGNING,
        key.key_pair().serialized_der(),
        &rng,
    )
    .map_err(|e| PkiError::InvalidKey(e.to_string()))?;
    kp.sign(&rng, msg)
        .map(|s| s.as_ref().to_vec())
        .map_err(|e| PkiError::Signing(e.to_string()))
}

/// Verifies a signature made by [`sign_message`] against a raw P-256 public key.
pub fn verify_message(public_key_raw: &[u8], msg: &[u8], sig: &[u8]) -> Result<()> {
    ring::signature::UnparsedPublicKey::new(
        &ring::signature::ECDSA_P256_SHA256_ASN1,
        public_key_raw,
    )
    .verify(msg, sig)
    .map_err(|_| PkiError::BadSignature)
}

/// The hub's certificate authority (cert + signing key). `Debug` masks the key.
pub struct HubCa {
    cert_pem: String,
    key: KeyPair,
}

impl fmt::Debug for HubCa {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HubCa")
            .field("cert_sha256", &fingerprint(self.cert_pem.as_bytes()))
            .field("key", &"<masked>")
            .finish()
    }
}

/// How far `notBefore` is back-dated for clock skew: a minute, or 1/20 of a short lifetime.
pub fn backdate_for(lifetime: Duration) -> Duration {
    (lifetime / 20).min(Duration::from_secs(60))
}

fn validity(params: &mut CertificateParams, lifetime: Duration) {
    let now = OffsetDateTime::now_utc();
    let back = backdate_for(lifetime);
    params.not_before = now - time::Duration::milliseconds(back.as_millis() as i64);
    params.not_after = now + time::Duration::seconds(lifetime.as_secs() as i64);
}

fn random_serial() -> SerialNumber {
    let mut b: [u8; 16] = rand::random();
    b[0] &= 0x7f;
    SerialNumber::from_slice(&b)
}

/// What [`HubCa::issue_leaf`] puts in a certificate.
#[derive(Debug, Clone, Copy, Default)]
pub struct Leaf<'a> {
    pub common_name: &'a str,
    /// Subject organisations, at most two (OCM's convention; more are ignored).
    pub organizations: &'a [String],
    /// DNS names and IP addresses.
    pub sans: &'a [String],
    /// Server-auth usage as well as client-auth.
    pub server: bool,
    pub lifetime: Duration,
}

/// A subject with common name `cn` and up to two organisations.
fn subject_dn(cn: &str, orgs: &[String]) -> DistinguishedName {
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, cn);
    if let Some(o) = orgs.first() {
        dn.push(DnType::OrganizationName, o.as_str());
    }
    if let Some(o) = orgs.get(1) {
        // rcgen keeps one value per attribute type; the same OID as a custom type adds the
        // second O.
        dn.push(DnType::CustomDnType(vec![2, 5, 4, 10]), o.as_str());
    }
    dn
}

/// A certificate [`HubCa`] issued, with its new key.
#[derive(Debug, Clone)]
pub struct IssuedClient {
    pub cert_pem: String,
    pub key_pem: String,
    /// Serial number, lower-case hex.
    pub serial_hex: String,
    pub not_after: SystemTime,
}

impl HubCa {
    /// A new self-signed CA.
    pub fn generate(common_name: &str, lifetime: Duration) -> Result<Self> {
        let key = KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256)
            .map_err(|e| PkiError::KeyGeneration(e.to_string()))?;
        let mut params = CertificateParams::default();
        params.distinguished_name = {
            let mut dn = DistinguishedName::new();
            dn.push(DnType::CommonName, common_name);
            dn
        };
        params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        params.serial_number = Some(random_serial());
        validity(&mut params, lifetime);
        let cert = params
            .self_signed(&key)
            .map_err(|e| PkiError::Signing(e.to_string()))?;
        Ok(Self {
            cert_pem: cert.pem(),
            key,
        })
    }

    /// Loads a CA from its certificate and key PEM.
    pub fn from_pem(cert_pem: &str, key_pem: &str) -> Result<Self> {
        let key = KeyPair::from_pem(key_pem).map_err(|e| PkiError::InvalidKey(e.to_string()))?;
        if pem_certificates(cert_pem).is_empty() {
            return Err(PkiError::NoCertificate("CA certificate"));
        }
        Ok(Self {
            cert_pem: cert_pem.to_string(),
            key,
        })
    }

    pub fn cert_pem(&self) -> &str {
        &self.cert_pem
    }

    pub fn key_pem(&self) -> String {
        self.key.serialize_pem()
    }

    fn issuer(&self) -> Result<Issuer<'static, &KeyPair>> {
        Issuer::from_ca_cert_pem(&self.cert_pem, &self.key)
            .map_err(|e| PkiError::InvalidCertificate(e.to_string()))
    }

    /// Issues a TLS server certificate (e.g. for hub NATS) for the given DNS names / IPs.
    /// Returns (cert PEM, key PEM).
    pub fn issue_server(&self, names: &[String], lifetime: Duration) -> Result<(String, String)> {
        let cn = names.first().map(String::as_str).unwrap_or("tether-hub");
        self.issue(cn, names, true, lifetime)
    }

    /// Issues a certificate with common name `cn` (a hub component's identity, e.g.
    /// `tether:broker:b1`), the given DNS names / IPs as SANs, client-auth usage and, when
    /// `server` is set, server-auth usage too. Returns (cert PEM, key PEM).
    pub fn issue(
        &self,
        cn: &str,
        names: &[String],
        server: bool,
        lifetime: Duration,
    ) -> Result<(String, String)> {
        let c = self.issue_leaf(&Leaf {
            common_name: cn,
            sans: names,
            server,
            lifetime,
            ..Leaf::default()
        })?;
        Ok((c.cert_pem, c.key_pem))
    }

    /// Issues a client-auth certificate and its new key for common name `cn` (hub client
    /// credentials, `tether.v1.admin.client.create`).
    pub fn issue_client(&self, cn: &str, lifetime: Duration) -> Result<IssuedClient> {
        self.issue_leaf(&Leaf {
            common_name: cn,
            lifetime,
            ..Leaf::default()
        })
    }

    /// Issues the certificate `leaf` describes with a new key: every certificate this CA
    /// issues with a key of its own (hub components, hub clients, test identities) comes from
    /// here.
    pub fn issue_leaf(&self, leaf: &Leaf<'_>) -> Result<IssuedClient> {
        let key = KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256)
            .map_err(|e| PkiError::KeyGeneration(e.to_string()))?;
        let mut params = CertificateParams::default();
        params.distinguished_name = subject_dn(leaf.common_name, leaf.organizations);
        for n in leaf.sans {
            let san = match n.parse::<std::net::IpAddr>() {
                Ok(ip) => SanType::IpAddress(ip),
                Err(_) => SanType::DnsName(
                    n.as_str()
                        .try_into()
                        .map_err(|e: rcgen::Error| PkiError::Signing(e.to_string()))?,
                ),
            };
            params.subject_alt_names.push(san);
        }
        params.extended_key_usages = if leaf.server {
            vec![
                ExtendedKeyUsagePurpose::ServerAuth,
                ExtendedKeyUsagePurpose::ClientAuth,
            ]
        } else {
            vec![ExtendedKeyUsagePurpose::ClientAuth]
        };
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        let serial = random_serial();
        params.serial_number = Some(serial.clone());
        params.use_authority_key_identifier_extension = true;
        validity(&mut params, leaf.lifetime);
        let not_after = SystemTime::UNIX_EPOCH
            + Duration::from_secs(params.not_after.unix_timestamp().max(0) as u64);
        let cert = params
            .signed_by(&key, &self.issuer()?)
            .map_err(|e| PkiError::Signing(e.to_string()))?;
        Ok(IssuedClient {
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
            serial_hex: hex::encode(serial.as_ref()),
            not_after,
        })
    }

    /// Signs the public key of CSR `csr_pem` with a subject the hub chooses (common name `cn`,
    /// organisations `orgs`, at most two), client-auth usage only; nothing else from the request
    /// is copied (add-on agent credentials). Returns the certificate PEM.
    pub fn sign_csr_as(
        &self,
        csr_pem: &str,
        cn: &str,
        orgs: &[String],
        lifetime: Duration,
    ) -> Result<String> {
        let req = rcgen::CertificateSigningRequestParams::from_pem(csr_pem)
            .map_err(|e| PkiError::InvalidCsr(e.to_string()))?;
        self.sign_request(req, subject_dn(cn, orgs), lifetime)
    }

    /// Signs a validated CSR for `cluster`. The hub sets the subject (OCM's CN and the two
    /// organisations), client-auth usage only and the lifetime; nothing else from the request
    /// is copied. Returns the certificate PEM.
    pub fn sign_client(
        &self,
        csr: &ParsedCsr,
        cluster: &str,
        lifetime: Duration,
    ) -> Result<String> {
        let agent = csr.validate_for(cluster)?;
        let req = rcgen::CertificateSigningRequestParams::from_der(&csr.der.as_slice().into())
            .map_err(|e| PkiError::InvalidCsr(e.to_string()))?;
        self.sign_request(req, ocm_dn(cluster, &agent), lifetime)
    }

    /// Signs the public key of `req` with subject `dn`, client-auth usage only, a random serial
    /// and `lifetime`; nothing else from the request is kept. Returns the certificate PEM.
    fn sign_request(
        &self,
        mut req: rcgen::CertificateSigningRequestParams,
        dn: DistinguishedName,
        lifetime: Duration,
    ) -> Result<String> {
        let mut params = CertificateParams::default();
        params.distinguished_name = dn;
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.serial_number = Some(random_serial());
        params.use_authority_key_identifier_extension = true;
        validity(&mut params, lifetime);
        req.params = params;
        let cert = req
            .signed_by(&self.issuer()?)
            .map_err(|e| PkiError::Signing(e.to_string()))?;
        Ok(cert.pem())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn csr_round_trip_and_signing() {
        let ca = HubCa::generate("tether-hub-ca", Duration::from_secs(3600)).unwrap();
        let key = AgentKey::generate().unwrap();
        let csr = create_csr(&key, "cluster1", "agent1").unwrap();
        let parsed = parse_csr(&csr).unwrap();
        assert_eq!(
            parsed.common_name,
            "system:open-cluster-management:cluster1:agent1"
        );
        assert_eq!(parsed.validate_for("cluster1").unwrap(), "agent1");
        assert!(
            parsed
                .validate_for("cluster2")
                .unwrap_err()
                .to_string()
                .contains("cluster2")
        );
        let cert = ca
            .sign_client(&parsed, "cluster1", Duration::from_secs(600))
            .unwrap();
        let info = CertInfo::from_pem(&cert).unwrap();
        assert_eq!(info.common_name, parsed.common_name);
        assert_eq!(info.organizations.len(), 2);
        assert_eq!(info.public_key_raw, key.public_key_raw());
        let der = pem_certificates(&cert).remove(0);
        verify_issued_by(der.as_ref(), ca.cert_pem(), SystemTime::now()).unwrap();
        let other = HubCa::generate("other", Duration::from_secs(3600)).unwrap();
        assert!(verify_issued_by(der.as_ref(), other.cert_pem(), SystemTime::now()).is_err());
        let sig = sign_message(&key, b"hello").unwrap();
        verify_message(&info.public_key_raw, b"hello", &sig).unwrap();
        assert!(verify_message(&info.public_key_raw, b"hellO", &sig).is_err());
        let rem = info.remaining_fraction(SystemTime::now());
        assert!(rem > 0.8 && rem <= 1.0, "{rem}");
        let k2 = AgentKey::from_pem(&key.to_pem()).unwrap();
        assert_eq!(k2.public_key_raw(), key.public_key_raw());
        assert!(format!("{key:?}").contains("masked"));
    }

    #[test]
    fn subject_rules() {
        assert!(subject::parse_common_name("system:open-cluster-management:c1:a1").is_some());
        assert!(subject::parse_common_name("system:open-cluster-management:C1:a1").is_none());
        assert!(subject::parse_common_name("system:other:c1:a1").is_none());
        let key = AgentKey::generate().unwrap();
        assert!(create_csr(&key, "Bad_Name", "a").is_err());
    }

    #[test]
    fn bundles_merge_without_duplicates() {
        let a = HubCa::generate("a", Duration::from_secs(60)).unwrap();
        let b = HubCa::generate("b", Duration::from_secs(60)).unwrap();
        let merged = merge_pem_bundles([a.cert_pem(), b.cert_pem(), a.cert_pem()]);
        assert_eq!(pem_certificates(&merged).len(), 2);
        let again = merge_pem_bundles([merged.as_str(), b.cert_pem()]);
        assert_eq!(pem_certificates(&again).len(), 2);
    }
}
