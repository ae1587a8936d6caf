//! Who a hub client is, and what it may reach.
//!
//! A client authenticates with a TLS client certificate (CN `tether:client:<name>`, signed by
//! the hub CA) or a token: `Proxy-Authorization: Bearer <token>` / `Basic base64(user:token)`
//! on CONNECT (so `kubectl` with `proxy-url: http://user:token@broker` works), or
//! `authorization: Bearer <token>` metadata on gRPC. Only the token's SHA-256 is configured.
//!
//! Policy is deny-by-default: a client with no `allow` rules reaches the API server of every
//! cluster and nothing else; other targets need an explicit rule.
//!
//! With a control plane, the hub's HubClients (token SHA-256 or certificate) and
//! ClientAccessPolicies (`tether_control::clients`) are merged in and replaced whenever the KV
//! buckets change, so a deleted client is refused for new streams within seconds.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, RwLock};

use base64::Engine as _;
use sha2::{Digest, Sha256};
use tether_control::clients::{ClientAccessPolicy, HubClient};
use tether_tls::Identity;
use tether_tunnel::pattern;
use tether_tunnel::wire::DialErrorKind;
use tether_tunnel::{Dest, DialError, Target};

use crate::clusters::ClusterDirectory;
use crate::config::{AllowRule, ClientConfig};

/// A verified client certificate: its identity and serial (hex, [`tether_tls::identity::normalize_serial`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerCert {
    pub identity: Identity,
    pub serial: Option<String>,
}

impl PeerCert {
    pub fn from_der(cert: &rustls::pki_types::CertificateDer<'_>) -> Option<Self> {
        Some(Self {
            identity: Identity::from_certificate(cert).ok()?,
            serial: Identity::serial_of(cert),
        })
    }
}

/// An authenticated hub client.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClientId {
    pub name: String,
    pub via: &'static str,
}

/// One allow rule: clusters by glob or labels, and targets.
#[derive(Debug, Clone, Default)]
struct Rule {
    clusters: Vec<String>,
    labels: Option<BTreeMap<String, String>>,
    targets: Vec<String>,
}

impl From<&AllowRule> for Rule {
    fn from(r: &AllowRule) -> Self {
        Self {
            clusters: r.clusters.clone(),
            labels: None,
            targets: r.targets.clone(),
        }
    }
}

/// Clients and rules from the hub (`tether-hubclients`, `tether-clientaccesspolicies`).
#[derive(Default)]
struct HubAuth {
    by_token: HashMap<[u8; 32], String>,
    /// HubClients with an issued certificate → the serial the hub recorded (None: any
    /// certificate with the name, for records without a serial).
    cert_clients: HashMap<String, Option<String>>,
    rules: HashMap<String, Vec<Rule>>,
}

/// Client identities and policy: the static `clients` of the config merged with the hub's
/// HubClients and ClientAccessPolicies (replaced as a whole on every change).
pub struct Auth {
    by_token: HashMap<[u8; 32], String>,
    rules: HashMap<String, Vec<Rule>>,
    hub: RwLock<Arc<HubAuth>>,
    clusters: Arc<ClusterDirectory>,
}

fn digest_of(hex_sha: &str) -> Option<[u8; 32]> {
    hex::decode(hex_sha)
        .ok()
        .and_then(|h| <[u8; 32]>::try_from(h.as_slice()).ok())
}

impl Auth {
    pub fn new(clients: &[ClientConfig]) -> Self {
        let mut by_token = HashMap::new();
        let mut rules = HashMap::new();
        for c in clients {
            if let Some(arr) = c.token_sha256.as_deref().and_then(digest_of) {
                by_token.insert(arr, c.name.clone());
            }
            rules.insert(c.name.clone(), c.allow.iter().map(Rule::from).collect());
        }
        Self {
            by_token,
            rules,
            hub: RwLock::new(Arc::default()),
            clusters: Arc::default(),
        }
    }

    /// The hub's cluster directory this policy consults.
    pub fn clusters(&self) -> &Arc<ClusterDirectory> {
        &self.clusters
    }

    /// Replaces the hub's clients and policies. Policies naming a static client add to its
    /// rules; a HubClient whose name is also static keeps the static token too.
    pub fn set_hub(&self, clients: &[HubClient], policies: &[ClientAccessPolicy]) {
        let mut hub = HubAuth::default();
        for c in clients {
            let name = &c.metadata.name;
            if let Some(arr) = c.spec.token_sha256.as_deref().and_then(digest_of) {
                hub.by_token.insert(arr, name.clone());
            }
            if let Some(cert) = &c.spec.certificate {
                let serial = (!cert.serial.is_empty())
                    .then(|| tether_tls::identity::normalize_serial(&cert.serial));
                hub.cert_clients.insert(name.clone(), serial);
            }
        }
        for p in policies {
            for client in &p.spec.clients {
                let list = hub.rules.entry(client.clone()).or_default();
                for r in &p.spec.rules {
                    list.push(Rule {
                        clusters: r.clusters.clone(),
                        labels: r
                            .cluster_selector
                            .as_ref()
                            .filter(|s| !s.match_labels.is_empty())
                            .map(|s| s.match_labels.clone()),
                        targets: r.targets.clone(),
                    });
                }
            }
        }
        *self.hub.write().expect("auth lock") = Arc::new(hub);
    }

    fn hub(&self) -> Arc<HubAuth> {
        Arc::clone(&self.hub.read().expect("auth lock"))
    }

    /// Hub clients currently known (for metrics).
    pub fn hub_client_count(&self) -> usize {
        let h = self.hub();
        let mut names: HashSet<&String> = h.by_token.values().collect();
        names.extend(h.cert_clients.keys());
        names.len()
    }

    /// Identity from a verified client certificate. A static client is known by name; a hub
    /// client's certificate must also be the one the hub issued (its serial), so re-creating a
    /// deleted client does not bring its old certificates back.
    pub fn from_certificate(&self, peer: &PeerCert) -> Result<ClientId, DialError> {
        let ok = |name: &String| {
            Ok(ClientId {
                name: name.clone(),
                via: "certificate",
            })
        };
        match &peer.identity {
            Identity::Client { name } if self.rules.contains_key(name) => ok(name),
            Identity::Client { name } => match self.hub().cert_clients.get(name) {
                Some(Some(issued)) if peer.serial.as_ref() != Some(issued) => Err(DialError::new(
                    DialErrorKind::Forbidden,
                    format!(
                        "certificate of client {name:?} is not the one the hub issued to it (revoked or replaced)"
                    ),
                )),
                Some(_) => ok(name),
                None => Err(DialError::new(
                    DialErrorKind::Forbidden,
                    format!("client {name:?} is not configured on this broker (or was revoked)"),
                )),
            },
            other => Err(DialError::new(
                DialErrorKind::Forbidden,
                format!("certificate identity {other} may not use the client API"),
            )),
        }
    }

    /// Who a request's client is: its credentials (a `Proxy-Authorization` / `authorization`
    /// value) if it sent any, else its verified certificate. `alternative` names, for the
    /// error a client with neither gets, how this front end takes credentials.
    pub fn identify(
        &self,
        credentials: Option<&str>,
        peer: Option<&PeerCert>,
        alternative: &str,
    ) -> Result<ClientId, DialError> {
        match (credentials, peer) {
            (Some(value), _) => self.from_header(value),
            (None, Some(cert)) => self.from_certificate(cert),
            (None, None) => Err(DialError::new(
                DialErrorKind::Unauthenticated,
                format!("no credentials: present a client certificate or {alternative}"),
            )),
        }
    }

    /// Identity from a bearer token.
    pub fn from_token(&self, token: &str) -> Result<ClientId, DialError> {
        let digest: [u8; 32] = Sha256::digest(token.as_bytes()).into();
        let name = self
            .by_token
            .get(&digest)
            .cloned()
            .or_else(|| self.hub().by_token.get(&digest).cloned());
        name.map(|name| ClientId { name, via: "token" })
            .ok_or_else(|| {
                DialError::new(DialErrorKind::Unauthenticated, "unknown or revoked token")
            })
    }

    /// Identity from a `Proxy-Authorization` / `authorization` header value.
    pub fn from_header(&self, value: &str) -> Result<ClientId, DialError> {
        let (scheme, rest) = value.trim().split_once(' ').unwrap_or((value, ""));
        let rest = rest.trim();
        if scheme.eq_ignore_ascii_case("bearer") {
            return self.from_token(rest);
        }
        if scheme.eq_ignore_ascii_case("basic") {
            let decoded = base64::engine::general_purpose::STANDARD
                .decode(rest)
                .ok()
                .and_then(|b| String::from_utf8(b).ok())
                .ok_or_else(|| {
                    DialError::new(
                        DialErrorKind::Unauthenticated,
                        "malformed Basic credentials",
                    )
                })?;
            let (_, token) = decoded.split_once(':').ok_or_else(|| {
                DialError::new(
                    DialErrorKind::Unauthenticated,
                    "Basic credentials need user:token",
                )
            })?;
            return self.from_token(token);
        }
        Err(DialError::new(
            DialErrorKind::Unauthenticated,
            format!("unsupported authorization scheme {scheme:?} (use Bearer or Basic)"),
        ))
    }

    /// Whether `client` may reach `target`; then, whether the hub knows the cluster (an
    /// `unknown_cluster` answer only goes to clients the policy lets through, so the answer
    /// reveals nothing to others).
    pub fn authorize(&self, client: &ClientId, target: &Target) -> Result<(), DialError> {
        let hub = self.hub();
        let rules: Vec<&Rule> = self
            .rules
            .get(&client.name)
            .into_iter()
            .flatten()
            .chain(hub.rules.get(&client.name).into_iter().flatten())
            .collect();
        let allowed = if rules.is_empty() {
            target.dest == Dest::ApiServer
        } else {
            let labels = self.clusters.labels(&target.cluster);
            rules.iter().any(|r| {
                let by_name = r
                    .clusters
                    .iter()
                    .any(|g| pattern::cluster_matches(g, &target.cluster));
                let by_labels = match (&r.labels, &labels) {
                    (Some(want), Some(have)) => want.iter().all(|(k, v)| have.get(k) == Some(v)),
                    _ => false,
                };
                (by_name || by_labels)
                    && r.targets.iter().any(|t| match &target.dest {
                        Dest::ApiServer => t == "apiserver",
                        Dest::HostPort { host, port } => {
                            t != "apiserver" && pattern::matches(t, host, *port)
                        }
                    })
            })
        };
        if !allowed {
            return Err(DialError::new(
                DialErrorKind::Forbidden,
                format!("client {:?} may not reach {target}", client.name),
            ));
        }
        self.clusters.check_client(&target.cluster)
    }
}

/// SHA-256 hex of a token, as written in `clients[].token_sha256`.
pub fn token_sha256(token: &str) -> String {
    tether_tls::sha256_hex(token.as_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn auth() -> Auth {
        Auth::new(&[
            ClientConfig {
                name: "ops".into(),
                token_sha256: Some(token_sha256("s3cret")),
                allow: vec![],
            },
            ClientConfig {
                name: "web".into(),
                token_sha256: Some(token_sha256("w3b")),
                allow: vec![AllowRule {
                    clusters: vec!["prod-*".into()],
                    targets: vec!["*.svc:8080".into()],
                }],
            },
        ])
    }

    #[test]
    fn tokens_and_schemes() {
        let a = auth();
        assert_eq!(a.from_header("Bearer s3cret").unwrap().name, "ops");
        let basic = base64::engine::general_purpose::STANDARD.encode("x:w3b");
        assert_eq!(
            a.from_header(&format!("Basic {basic}")).unwrap().name,
            "web"
        );
        assert_eq!(
            a.from_header("Bearer nope").unwrap_err().kind,
            DialErrorKind::Unauthenticated
        );
        assert_eq!(
            a.from_header("Digest x").unwrap_err().kind,
            DialErrorKind::Unauthenticated
        );
    }

    #[test]
    fn credentials_come_before_the_certificate() {
        let a = auth();
        let ops = PeerCert {
            identity: Identity::Client { name: "ops".into() },
            serial: None,
        };
        let by_token = a.identify(Some("Bearer w3b"), Some(&ops), "X").unwrap();
        assert_eq!((by_token.name.as_str(), by_token.via), ("web", "token"));
        // A bad credential is refused even with a good certificate: never a silent fallback.
        let bad = a
            .identify(Some("Bearer nope"), Some(&ops), "X")
            .unwrap_err();
        assert_eq!(bad.kind, DialErrorKind::Unauthenticated);
        let by_cert = a.identify(None, Some(&ops), "X").unwrap();
        assert_eq!((by_cert.name.as_str(), by_cert.via), ("ops", "certificate"));
        let none = a.identify(None, None, "send AUTH").unwrap_err();
        assert_eq!(none.kind, DialErrorKind::Unauthenticated);
        assert_eq!(
            none.message,
            "no credentials: present a client certificate or send AUTH"
        );
    }

    #[test]
    fn hub_clients_and_policies_merge_and_revoke() {
        use tether_control::clients::{
            AccessRule, ClientAccessPolicySpec, ClusterSelector, HubClientSpec,
        };
        use tether_control::resources::ObjectMeta;
        let a = auth();
        let robot = HubClient::new(
            "robot",
            HubClientSpec {
                token_sha256: Some(token_sha256("r0b0t")),
                certificate: None,
            },
        );
        a.set_hub(std::slice::from_ref(&robot), &[]);
        let id = a.from_token("r0b0t").unwrap();
        assert_eq!(id.name, "robot");
        assert!(a.authorize(&id, &Target::api_server("c1")).is_ok());
        assert!(
            a.authorize(&id, &Target::host_port("c1", "db", 5432))
                .is_err()
        );
        // A policy by labels: the cluster directory supplies them.
        let policy = ClientAccessPolicy {
            api_version: tether_control::clients::CLIENT_API_VERSION.into(),
            kind: ClientAccessPolicy::KIND.into(),
            metadata: ObjectMeta::new("p"),
            spec: ClientAccessPolicySpec {
                clients: vec!["robot".into(), "ops".into()],
                rules: vec![AccessRule {
                    clusters: vec![],
                    cluster_selector: Some(ClusterSelector {
                        match_labels: [("env".to_string(), "dev".to_string())].into(),
                    }),
                    targets: vec!["db:5432".into()],
                }],
            },
        };
        a.set_hub(std::slice::from_ref(&robot), std::slice::from_ref(&policy));
        a.clusters().set(HashMap::from([
            (
                "dev-1".to_string(),
                crate::clusters::ClusterInfo {
                    accepted: true,
                    labels: [("env".to_string(), "dev".to_string())].into(),
                },
            ),
            (
                "c1".to_string(),
                crate::clusters::ClusterInfo {
                    accepted: true,
                    labels: BTreeMap::new(),
                },
            ),
        ]));
        assert!(
            a.authorize(&id, &Target::host_port("dev-1", "db", 5432))
                .is_ok()
        );
        assert!(
            a.authorize(&id, &Target::host_port("c1", "db", 5432))
                .is_err()
        );
        assert!(a.authorize(&id, &Target::api_server("dev-1")).is_err());
        // Unknown cluster: only after the policy let the client through.
        let web = a.from_token("w3b").unwrap();
        assert_eq!(
            a.authorize(&web, &Target::host_port("prod-ghost", "x.svc", 8080))
                .unwrap_err()
                .kind,
            DialErrorKind::UnknownCluster
        );
        // A policy naming a static client adds to its rules (ops had none: API servers only).
        let ops = a.from_token("s3cret").unwrap();
        assert!(
            a.authorize(&ops, &Target::host_port("dev-1", "db", 5432))
                .is_ok()
        );
        assert!(a.authorize(&ops, &Target::api_server("c1")).is_err());
        // Revocation.
        a.set_hub(&[], std::slice::from_ref(&policy));
        assert_eq!(
            a.from_token("r0b0t").unwrap_err().kind,
            DialErrorKind::Unauthenticated
        );
    }

    #[test]
    fn default_policy_is_apiserver_only() {
        let a = auth();
        let ops = a.from_token("s3cret").unwrap();
        assert!(a.authorize(&ops, &Target::api_server("c1")).is_ok());
        assert!(
            a.authorize(&ops, &Target::host_port("c1", "db", 5432))
                .is_err()
        );
        let web = a.from_token("w3b").unwrap();
        assert!(
            a.authorize(&web, &Target::host_port("prod-1", "x.svc", 8080))
                .is_ok()
        );
        assert!(
            a.authorize(&web, &Target::host_port("dev-1", "x.svc", 8080))
                .is_err()
        );
        assert!(a.authorize(&web, &Target::api_server("prod-1")).is_err());
    }

    #[test]
    fn hub_client_certificates_are_pinned_by_serial() {
        use tether_control::clients::{HubClientSpec, IssuedCertificate};
        let a = auth();
        let issued = |serial: &str| {
            HubClient::new(
                "bot",
                HubClientSpec {
                    token_sha256: None,
                    certificate: Some(IssuedCertificate {
                        common_name: "tether:client:bot".into(),
                        serial: serial.into(),
                        not_after: String::new(),
                    }),
                },
            )
        };
        let peer = |serial: &str| PeerCert {
            identity: Identity::Client { name: "bot".into() },
            serial: Some(tether_tls::identity::normalize_serial(serial)),
        };
        a.set_hub(&[issued("0A:bc")], &[]);
        assert_eq!(a.from_certificate(&peer("0abc")).unwrap().name, "bot");
        assert_eq!(a.from_certificate(&peer("000abc")).unwrap().name, "bot");
        let old = a.from_certificate(&peer("0abd")).unwrap_err();
        assert_eq!(old.kind, DialErrorKind::Forbidden);
        assert!(
            old.message.contains("not the one the hub issued"),
            "{}",
            old.message
        );
        // Re-created: the new serial only.
        a.set_hub(&[issued("0abd")], &[]);
        assert!(a.from_certificate(&peer("0abc")).is_err());
        assert!(a.from_certificate(&peer("0abd")).is_ok());
        // Deleted: nothing with the name.
        a.set_hub(&[], &[]);
        assert!(a.from_certificate(&peer("0abd")).is_err());
    }
}
