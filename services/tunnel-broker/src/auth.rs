//! Who a hub client is, and what it may reach.
//!
//! A client authenticates with a TLS client certificate (CN `tether:client:<name>`, signed by
//! the hub CA) or a token: `Proxy-Authorization: Bearer <token>` / `Basic base64(user:token)`
//! on CONNECT (so `kubectl` with `proxy-url: http://user:token@broker` works), or
//! `authorization: Bearer <token>` metadata on gRPC. Only the token's SHA-256 is configured.
//!
//! Policy is deny-by-default: a client with no `allow` rules reaches the API server of every
//! cluster and nothing else; other targets need an explicit rule.

use std::collections::HashMap;

use base64::Engine as _;
use sha2::{Digest, Sha256};
use tether_tls::Identity;
use tether_tunnel::pattern;
use tether_tunnel::wire::DialErrorKind;
use tether_tunnel::{Dest, DialError, Target};

use crate::config::{AllowRule, ClientConfig};

/// An authenticated hub client.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClientId {
    pub name: String,
    pub via: &'static str,
}

pub struct Auth {
    by_token: HashMap<[u8; 32], String>,
    rules: HashMap<String, Vec<AllowRule>>,
}

impl Auth {
    pub fn new(clients: &[ClientConfig]) -> Self {
        let mut by_token = HashMap::new();
        let mut rules = HashMap::new();
        for c in clients {
            if let Some(h) = c.token_sha256.as_deref().and_then(|h| hex::decode(h).ok())
                && let Ok(arr) = <[u8; 32]>::try_from(h.as_slice())
            {
                by_token.insert(arr, c.name.clone());
            }
            rules.insert(c.name.clone(), c.allow.clone());
        }
        Self { by_token, rules }
    }

    /// Identity from a verified client certificate.
    pub fn from_certificate(&self, identity: &Identity) -> Result<ClientId, DialError> {
        match identity {
            Identity::Client { name } if self.rules.contains_key(name) => Ok(ClientId {
                name: name.clone(),
                via: "certificate",
            }),
            Identity::Client { name } => Err(DialError::new(
                DialErrorKind::Forbidden,
                format!("client {name:?} is not configured on this broker"),
            )),
            other => Err(DialError::new(
                DialErrorKind::Forbidden,
                format!("certificate identity {other} may not use the client API"),
            )),
        }
    }

    /// Identity from a bearer token.
    pub fn from_token(&self, token: &str) -> Result<ClientId, DialError> {
        let digest: [u8; 32] = Sha256::digest(token.as_bytes()).into();
        self.by_token
            .get(&digest)
            .map(|name| ClientId {
                name: name.clone(),
                via: "token",
            })
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

    /// Whether `client` may reach `target`.
    pub fn authorize(&self, client: &ClientId, target: &Target) -> Result<(), DialError> {
        let rules = self
            .rules
            .get(&client.name)
            .map(Vec::as_slice)
            .unwrap_or(&[]);
        let allowed = if rules.is_empty() {
            target.dest == Dest::ApiServer
        } else {
            rules.iter().any(|r| {
                r.clusters
                    .iter()
                    .any(|g| pattern::cluster_matches(g, &target.cluster))
                    && r.targets.iter().any(|t| match &target.dest {
                        Dest::ApiServer => t == "apiserver",
                        Dest::HostPort { host, port } => {
                            t != "apiserver" && pattern::matches(t, host, *port)
                        }
                    })
            })
        };
        if allowed {
            Ok(())
        } else {
            Err(DialError::new(
                DialErrorKind::Forbidden,
                format!("client {:?} may not reach {target}", client.name),
            ))
        }
    }
}

/// SHA-256 hex of a token, as written in `clients[].token_sha256`.
pub fn token_sha256(token: &str) -> String {
    hex::encode(Sha256::digest(token.as_bytes()))
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
}
