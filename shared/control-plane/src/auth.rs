//! Who may do what on the bus: NATS auth callout, bootstrap tokens and certificate credentials.
//!
//! nats-server (2.10+) asks the hub's callout service (`$SYS.REQ.USER.AUTH`) about every client
//! that is not a hub user. The request is a JWT signed by the server; the reply is an
//! authorization-response JWT, signed by the callout issuer account key, that carries a user
//! JWT with the client's permissions ([`Permissions`]):
//! - **bootstrap token** (`token` in connect): may only publish `tether.v1.bootstrap.*.csr[.get]`
//!   and receive replies on its own inbox. Nothing else.
//! - **cluster certificate** (`user` = OCM CN, `pass` = [`CertCredential`]): may publish and
//!   subscribe only under `tether.v1.cluster.<its cluster>.>` plus its own inbox.
//!
//! A [`CertCredential`] proves possession of the agent key without client-certificate TLS (the
//! same NATS port serves bootstrap clients that have no certificate yet): the agent signs
//! `tether-nats-auth-v1|<user>|<unix time>` with its key, and the hub checks the certificate
//! chain against the hub CA, the signature against the certificate's key, and the time against
//! a ±[`CREDENTIAL_MAX_SKEW`] window. A fresh credential is built on every (re)connect.
//!
//! JWT encoding follows the NATS JWT v2 format (header `{"typ":"JWT","alg":"ed25519-nkey"}`,
//! base64url without padding, ed25519 signature by an nkey).

use std::time::{Duration, SystemTime};

use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::subjects;

/// Accepted clock difference for certificate credentials.
pub const CREDENTIAL_MAX_SKEW: Duration = Duration::from_secs(120);
const CRED_PREFIX: &str = "tether-cert-v1";
const SIGNED_PREFIX: &str = "tether-nats-auth-v1";
/// Bootstrap tokens look like `tether-bootstrap.<id>.<secret>`.
pub const BOOTSTRAP_TOKEN_PREFIX: &str = "tether-bootstrap";

#[derive(Debug, thiserror::Error)]
pub enum AuthError {
    #[error("malformed JWT: {0}")]
    MalformedJwt(String),
    #[error("JWT signature does not verify")]
    BadJwtSignature,
    #[error("JWT was not issued by a NATS server key")]
    NotServerIssued,
    #[error("nkey error: {0}")]
    Nkey(String),
    #[error("malformed certificate credential: {0}")]
    MalformedCredential(&'static str),
    #[error("malformed bootstrap token (expected {BOOTSTRAP_TOKEN_PREFIX}.<id>.<secret>)")]
    MalformedToken,
    #[error("credential time is {away_secs}s away from the hub's clock (max {max_secs}s)")]
    CredentialSkew { away_secs: u64, max_secs: u64 },
    #[error("credential signature does not match the certificate's key")]
    CredentialSignature(#[source] tether_pki::PkiError),
}

fn b64(data: &[u8]) -> String {
    URL_SAFE_NO_PAD.encode(data)
}

fn random_id(len: usize) -> String {
    const ALPHABET: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZ234567";
    (0..len)
        .map(|_| ALPHABET[rand::random_range(0..ALPHABET.len())] as char)
        .collect()
}

/// A random connection id (used for the per-connection inbox prefix and the client name).
pub fn new_connection_id() -> String {
    random_id(22)
}

/// Client name convention: `tether/<role>/<connection id>`; the callout reads the id from it.
pub fn client_name(role: &str, connection_id: &str) -> String {
    format!("tether/{role}/{connection_id}")
}

/// The connection id from a client name, if well formed.
pub fn connection_id_from_name(name: &str) -> Option<&str> {
    let id = name.rsplit('/').next()?;
    (name.starts_with("tether/")
        && (16..=64).contains(&id.len())
        && id.bytes().all(|b| b.is_ascii_alphanumeric()))
    .then_some(id)
}

// ---------------- the auth request ----------------

#[derive(Debug, Clone, Default, Deserialize)]
pub struct ServerId {
    #[serde(default)]
    pub name: String,
    #[serde(default)]
    pub id: String,
}

#[derive(Debug, Clone, Default, Deserialize)]
pub struct ClientInfo {
    #[serde(default)]
    pub host: String,
    #[serde(default)]
    pub id: u64,
    #[serde(default)]
    pub name: String,
}

#[derive(Clone, Default, Deserialize)]
pub struct ConnectOpts {
    #[serde(default)]
    pub user: String,
    #[serde(default)]
    pub pass: String,
    #[serde(default)]
    pub auth_token: String,
    #[serde(default)]
    pub name: String,
}

impl std::fmt::Debug for ConnectOpts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConnectOpts")
            .field("user", &self.user)
            .field("name", &self.name)
            .field("pass", &"<masked>")
            .field("auth_token", &"<masked>")
            .finish()
    }
}

#[derive(Debug, Clone, Default, Deserialize)]
pub struct AuthRequestBody {
    pub server_id: ServerId,
    pub user_nkey: String,
    #[serde(default)]
    pub client_info: ClientInfo,
    #[serde(default)]
    pub connect_opts: ConnectOpts,
}

#[derive(Debug, Clone, Deserialize)]
struct AuthRequestClaims {
    iss: String,
    nats: AuthRequestBody,
}

/// Decodes and verifies (server signature) an auth-callout request JWT.
pub fn decode_auth_request(jwt: &str) -> Result<AuthRequestBody, AuthError> {
    let mut parts = jwt.split('.');
    let (Some(h), Some(p), Some(s), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Err(AuthError::MalformedJwt("expected three parts".into()));
    };
    let payload = URL_SAFE_NO_PAD
        .decode(p)
        .map_err(|e| AuthError::MalformedJwt(e.to_string()))?;
    let sig = URL_SAFE_NO_PAD
        .decode(s)
        .map_err(|e| AuthError::MalformedJwt(e.to_string()))?;
    let claims: AuthRequestClaims =
        serde_json::from_slice(&payload).map_err(|e| AuthError::MalformedJwt(e.to_string()))?;
    if !claims.iss.starts_with('N') {
        return Err(AuthError::NotServerIssued);
    }
    let server =
        nkeys::KeyPair::from_public_key(&claims.iss).map_err(|e| AuthError::Nkey(e.to_string()))?;
    server
        .verify(format!("{h}.{p}").as_bytes(), &sig)
        .map_err(|_| AuthError::BadJwtSignature)?;
    Ok(claims.nats)
}

// ---------------- the response ----------------

/// Publish/subscribe allow-lists for a user.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Permissions {
    pub publish: Vec<String>,
    pub subscribe: Vec<String>,
}

impl Permissions {
    /// What a bootstrap credential may do: register, nothing else.
    pub fn bootstrap(connection_id: &str) -> Self {
        Self {
            publish: vec![
                subjects::BOOTSTRAP_CSR_ALL.into(),
                subjects::BOOTSTRAP_CSR_GET_ALL.into(),
            ],
            subscribe: vec![format!("{}.>", subjects::inbox_prefix(connection_id))],
        }
    }

    /// What an accepted cluster's credential may do: its own subjects only.
    pub fn cluster(cluster: &str, connection_id: &str) -> Self {
        let own = format!("{}.>", subjects::cluster_prefix(cluster));
        Self {
            publish: vec![own.clone()],
            subscribe: vec![own, format!("{}.>", subjects::inbox_prefix(connection_id))],
        }
    }
}

#[derive(Serialize)]
struct Allow<'a> {
    allow: &'a [String],
}

#[derive(Serialize)]
struct UserNats<'a> {
    #[serde(rename = "pub")]
    pub_: Allow<'a>,
    sub: Allow<'a>,
    subs: i64,
    data: i64,
    payload: i64,
    #[serde(rename = "type")]
    type_: &'static str,
    version: u8,
}

#[derive(Serialize)]
struct UserClaims<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    exp: Option<u64>,
    jti: String,
    iat: u64,
    iss: &'a str,
    name: &'a str,
    sub: &'a str,
    aud: &'a str,
    nats: UserNats<'a>,
}

#[derive(Serialize)]
struct ResponseNats<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    jwt: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    error: Option<&'a str>,
    #[serde(rename = "type")]
    type_: &'static str,
    version: u8,
}

#[derive(Serialize)]
struct ResponseClaims<'a> {
    jti: String,
    iat: u64,
    iss: &'a str,
    sub: &'a str,
    aud: &'a str,
    nats: ResponseNats<'a>,
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs()
}

fn sign_jwt<T: Serialize>(issuer: &nkeys::KeyPair, claims: &T) -> Result<String, AuthError> {
    let header = b64(br#"{"typ":"JWT","alg":"ed25519-nkey"}"#);
    let body =
        b64(&serde_json::to_vec(claims).map_err(|e| AuthError::MalformedJwt(e.to_string()))?);
    let signing_input = format!("{header}.{body}");
    let sig = issuer
        .sign(signing_input.as_bytes())
        .map_err(|e| AuthError::Nkey(e.to_string()))?;
    Ok(format!("{signing_input}.{}", b64(&sig)))
}

/// The callout issuer: an account nkey whose public key is in the NATS config.
pub struct CalloutIssuer {
    kp: nkeys::KeyPair,
    public: String,
}

impl std::fmt::Debug for CalloutIssuer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CalloutIssuer")
            .field("public", &self.public)
            .finish()
    }
}

impl CalloutIssuer {
    pub fn generate() -> Self {
        let kp = nkeys::KeyPair::new_account();
        let public = kp.public_key();
        Self { kp, public }
    }

    pub fn from_seed(seed: &str) -> Result<Self, AuthError> {
        let kp =
            nkeys::KeyPair::from_seed(seed.trim()).map_err(|e| AuthError::Nkey(e.to_string()))?;
        let public = kp.public_key();
        Ok(Self { kp, public })
    }

    pub fn seed(&self) -> Result<String, AuthError> {
        self.kp.seed().map_err(|e| AuthError::Nkey(e.to_string()))
    }

    pub fn public_key(&self) -> &str {
        &self.public
    }

    /// An authorization response that admits the client with `perms` into `account`
    /// (`$G` in server-config mode without accounts), until `expires` if given.
    pub fn allow(
        &self,
        req: &AuthRequestBody,
        display_name: &str,
        perms: &Permissions,
        expires: Option<SystemTime>,
    ) -> Result<String, AuthError> {
        let now = unix_now();
        let user = UserClaims {
            exp: expires.map(|t| {
                t.duration_since(SystemTime::UNIX_EPOCH)
                    .unwrap_or_default()
                    .as_secs()
            }),
            jti: random_id(52),
            iat: now,
            iss: &self.public,
            name: display_name,
            sub: &req.user_nkey,
            aud: "$G",
            nats: UserNats {
                pub_: Allow {
                    allow: &perms.publish,
                },
                sub: Allow {
                    allow: &perms.subscribe,
                },
                subs: -1,
                data: -1,
                payload: -1,
                type_: "user",
                version: 2,
            },
        };
        let user_jwt = sign_jwt(&self.kp, &user)?;
        self.response(req, Some(&user_jwt), None)
    }

    /// An authorization response that refuses the client with `reason`.
    pub fn deny(&self, req: &AuthRequestBody, reason: &str) -> Result<String, AuthError> {
        self.response(req, None, Some(reason))
    }

    fn response(
        &self,
        req: &AuthRequestBody,
        jwt: Option<&str>,
        error: Option<&str>,
    ) -> Result<String, AuthError> {
        let claims = ResponseClaims {
            jti: random_id(52),
            iat: unix_now(),
            iss: &self.public,
            sub: &req.user_nkey,
            aud: &req.server_id.id,
            nats: ResponseNats {
                jwt,
                error,
                type_: "authorization_response",
                version: 2,
            },
        };
        sign_jwt(&self.kp, &claims)
    }
}

// ---------------- bootstrap tokens ----------------

/// A parsed bootstrap token `tether-bootstrap.<id>.<secret>`. `Debug` masks the secret.
#[derive(Clone, PartialEq, Eq)]
pub struct BootstrapToken {
    pub id: String,
    secret: String,
}

impl std::fmt::Debug for BootstrapToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "BootstrapToken({}.<masked>)", self.id)
    }
}

impl BootstrapToken {
    pub fn generate() -> Self {
        Self {
            id: random_id(8).to_ascii_lowercase(),
            secret: random_id(32).to_ascii_lowercase(),
        }
    }

    pub fn parse(s: &str) -> Result<Self, AuthError> {
        let mut it = s.trim().split('.');
        match (it.next(), it.next(), it.next(), it.next()) {
            (Some(BOOTSTRAP_TOKEN_PREFIX), Some(id), Some(secret), None)
                if !id.is_empty() && secret.len() >= 16 =>
            {
                Ok(Self {
                    id: id.to_string(),
                    secret: secret.to_string(),
                })
            }
            _ => Err(AuthError::MalformedToken),
        }
    }

    pub fn to_token_string(&self) -> String {
        format!("{BOOTSTRAP_TOKEN_PREFIX}.{}.{}", self.id, self.secret)
    }

    pub fn secret_sha256(&self) -> String {
        hex::encode(Sha256::digest(self.secret.as_bytes()))
    }
}

// ---------------- certificate credentials ----------------

/// What an agent presents as its NATS password after acceptance. `Debug` masks the signature.
#[derive(Clone)]
pub struct CertCredential {
    pub cert_der: Vec<u8>,
    pub unix_time: u64,
    pub signature: Vec<u8>,
}

impl std::fmt::Debug for CertCredential {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CertCredential")
            .field("unix_time", &self.unix_time)
            .finish_non_exhaustive()
    }
}

fn signed_bytes(user: &str, unix_time: u64) -> Vec<u8> {
    format!("{SIGNED_PREFIX}|{user}|{unix_time}").into_bytes()
}

impl CertCredential {
    /// Builds a fresh credential for `user` (the certificate's CN) at the current time.
    pub fn build(
        cert_pem: &str,
        key: &tether_pki::AgentKey,
        user: &str,
    ) -> Result<String, tether_pki::PkiError> {
        let der = tether_pki::pem_certificates(cert_pem)
            .into_iter()
            .next()
            .ok_or(tether_pki::PkiError::NoCertificate("tls.crt"))?;
        let t = unix_now();
        let sig = tether_pki::sign_message(key, &signed_bytes(user, t))?;
        Ok(format!(
            "{CRED_PREFIX}.{}.{t}.{}",
            b64(der.as_ref()),
            b64(&sig)
        ))
    }

    pub fn parse(s: &str) -> Result<Self, AuthError> {
        let mut it = s.split('.');
        let (Some(CRED_PREFIX), Some(c), Some(t), Some(sig), None) =
            (it.next(), it.next(), it.next(), it.next(), it.next())
        else {
            return Err(AuthError::MalformedCredential(
                "expected tether-cert-v1.<cert>.<time>.<sig>",
            ));
        };
        Ok(Self {
            cert_der: URL_SAFE_NO_PAD
                .decode(c)
                .map_err(|_| AuthError::MalformedCredential("certificate is not base64url"))?,
            unix_time: t
                .parse()
                .map_err(|_| AuthError::MalformedCredential("time is not a number"))?,
            signature: URL_SAFE_NO_PAD
                .decode(sig)
                .map_err(|_| AuthError::MalformedCredential("signature is not base64url"))?,
        })
    }

    pub fn looks_like(s: &str) -> bool {
        s.starts_with(CRED_PREFIX)
    }

    /// Checks signature and freshness for `user` against the certificate's public key.
    pub fn verify_possession(
        &self,
        user: &str,
        public_key_raw: &[u8],
        now: SystemTime,
    ) -> Result<(), AuthError> {
        let now = now
            .duration_since(SystemTime::UNIX_EPOCH)
            .unwrap_or_default()
            .as_secs();
        if now.abs_diff(self.unix_time) > CREDENTIAL_MAX_SKEW.as_secs() {
            return Err(AuthError::CredentialSkew {
                away_secs: now.abs_diff(self.unix_time),
                max_secs: CREDENTIAL_MAX_SKEW.as_secs(),
            });
        }
        tether_pki::verify_message(
            public_key_raw,
            &signed_bytes(user, self.unix_time),
            &self.signature,
        )
        .map_err(AuthError::CredentialSignature)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_parse_and_mask() {
        let t = BootstrapToken::generate();
        let s = t.to_token_string();
        assert_eq!(BootstrapToken::parse(&s).unwrap(), t);
        assert!(!format!("{t:?}").contains(&t.secret));
        assert!(BootstrapToken::parse("nope").is_err());
    }

    #[test]
    fn cert_credentials_verify() {
        let ca = tether_pki::HubCa::generate("ca", Duration::from_secs(600)).unwrap();
        let key = tether_pki::AgentKey::generate().unwrap();
        let csr = tether_pki::parse_csr(&tether_pki::create_csr(&key, "c1", "a").unwrap()).unwrap();
        let cert = ca
            .sign_client(&csr, "c1", Duration::from_secs(600))
            .unwrap();
        let user = "system:open-cluster-management:c1:a";
        let cred =
            CertCredential::parse(&CertCredential::build(&cert, &key, user).unwrap()).unwrap();
        let info = tether_pki::CertInfo::from_der(&cred.cert_der).unwrap();
        cred.verify_possession(user, &info.public_key_raw, SystemTime::now())
            .unwrap();
        assert!(
            cred.verify_possession("other", &info.public_key_raw, SystemTime::now())
                .is_err()
        );
        assert!(
            cred.verify_possession(
                user,
                &info.public_key_raw,
                SystemTime::now() + Duration::from_secs(600)
            )
            .is_err()
        );
    }

    #[test]
    fn client_names() {
        let id = new_connection_id();
        assert_eq!(
            connection_id_from_name(&client_name("agent", &id)),
            Some(id.as_str())
        );
        assert_eq!(connection_id_from_name("tether/agent/short"), None);
        assert_eq!(connection_id_from_name("other"), None);
    }
}
