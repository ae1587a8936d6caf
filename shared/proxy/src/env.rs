//! Proxy settings the way every HTTP stack reads them: `HTTP_PROXY`, `HTTPS_PROXY`, `NO_PROXY`
//! (upper or lower case), or the same three fields from a config (OCM's AddOnDeploymentConfig
//! `proxyConfig`). Unlike addon-framework, `no_proxy` is honoured even when it is the only field
//! set (it then simply has nothing to exempt from, and is kept for when a proxy is added).
//!
//! Which proxy a connection uses: a TLS connection (the tunnel to a broker, hub NATS) uses
//! `https_proxy`, or `http_proxy` when only that is set; a plain one uses `http_proxy`.
//! `no_proxy` entries: `*` (nothing is proxied), a host name or `.domain` (the name and its
//! subdomains), an IP address, a CIDR block (`10.0.0.0/8`), optionally with `:port`.

use std::net::IpAddr;

use crate::{ProxyError, ProxyUrl};

/// Proxy settings for outbound connections.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct ProxySettings {
    pub http_proxy: Option<ProxyUrl>,
    pub https_proxy: Option<ProxyUrl>,
    pub no_proxy: Vec<String>,
}

impl std::fmt::Debug for ProxySettings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // ProxyUrl's Debug masks the password.
        f.debug_struct("ProxySettings")
            .field("http_proxy", &self.http_proxy)
            .field("https_proxy", &self.https_proxy)
            .field("no_proxy", &self.no_proxy)
            .finish()
    }
}

fn env_var(name: &str) -> Option<String> {
    std::env::var(name)
        .ok()
        .or_else(|| std::env::var(name.to_ascii_lowercase()).ok())
        .filter(|v| !v.trim().is_empty())
}

impl ProxySettings {
    /// Builds settings from the three strings; errors name the field.
    pub fn from_parts(
        http_proxy: Option<&str>,
        https_proxy: Option<&str>,
        no_proxy: Option<&str>,
    ) -> Result<Self, (&'static str, ProxyError)> {
        let parse = |field: &'static str, v: Option<&str>| {
            v.filter(|s| !s.trim().is_empty())
                .map(|s| ProxyUrl::parse(s.trim()).map_err(|e| (field, e)))
                .transpose()
        };
        Ok(Self {
            http_proxy: parse("http_proxy", http_proxy)?,
            https_proxy: parse("https_proxy", https_proxy)?,
            no_proxy: no_proxy
                .unwrap_or("")
                .split(',')
                .map(|s| s.trim().to_ascii_lowercase())
                .filter(|s| !s.is_empty())
                .collect(),
        })
    }

    /// Reads `HTTP_PROXY`, `HTTPS_PROXY`, `NO_PROXY` (or their lower-case forms).
    pub fn from_env() -> Result<Self, (&'static str, ProxyError)> {
        Self::from_parts(
            env_var("HTTP_PROXY").as_deref(),
            env_var("HTTPS_PROXY").as_deref(),
            env_var("NO_PROXY").as_deref(),
        )
    }

    /// Whether any proxy is configured.
    pub fn is_empty(&self) -> bool {
        self.http_proxy.is_none() && self.https_proxy.is_none()
    }

    /// The proxy for a connection to `host:port`, or `None` to connect directly.
    pub fn proxy_for(&self, host: &str, port: u16, tls: bool) -> Option<&ProxyUrl> {
        if self.bypass(host, port) {
            return None;
        }
        if tls {
            self.https_proxy.as_ref().or(self.http_proxy.as_ref())
        } else {
            self.http_proxy.as_ref()
        }
    }

    /// Whether `NO_PROXY` exempts `host:port`.
    pub fn bypass(&self, host: &str, port: u16) -> bool {
        let host = host
            .trim_start_matches('[')
            .trim_end_matches(']')
            .to_ascii_lowercase();
        let ip: Option<IpAddr> = host.parse().ok();
        self.no_proxy.iter().any(|entry| {
            if entry == "*" {
                return true;
            }
            let (pattern, entry_port) = split_port(entry);
            if entry_port.is_some_and(|p| p != port) {
                return false;
            }
            if let Some((net, bits)) = pattern.split_once('/') {
                return match (ip, net.parse::<IpAddr>(), bits.parse::<u8>()) {
                    (Some(ip), Ok(net), Ok(bits)) => in_cidr(ip, net, bits),
                    _ => false,
                };
            }
            if let (Some(ip), Ok(p)) = (ip, pattern.parse::<IpAddr>()) {
                return ip == p;
            }
            let domain = pattern.trim_start_matches("*.").trim_start_matches('.');
            !domain.is_empty() && (host == domain || host.ends_with(&format!(".{domain}")))
        })
    }
}

fn split_port(entry: &str) -> (&str, Option<u16>) {
    // IPv6 literals contain ':'; only treat a trailing `:digits` after a non-IPv6 host as a port.
    if entry.starts_with('[') {
        if let Some((h, p)) = entry.rsplit_once("]:") {
            return (h.trim_start_matches('['), p.parse().ok());
        }
        return (entry.trim_start_matches('[').trim_end_matches(']'), None);
    }
    match entry.rsplit_once(':') {
        Some((h, p)) if !h.contains(':') => match p.parse() {
            Ok(port) => (h, Some(port)),
            Err(_) => (entry, None),
        },
        _ => (entry, None),
    }
}

fn in_cidr(ip: IpAddr, net: IpAddr, bits: u8) -> bool {
    match (ip, net) {
        (IpAddr::V4(a), IpAddr::V4(n)) if bits <= 32 => {
            let mask = if bits == 0 {
                0
            } else {
                u32::MAX << (32 - bits)
            };
            u32::from(a) & mask == u32::from(n) & mask
        }
        (IpAddr::V6(a), IpAddr::V6(n)) if bits <= 128 => {
            let mask = if bits == 0 {
                0
            } else {
                u128::MAX << (128 - bits)
            };
            u128::from(a) & mask == u128::from(n) & mask
        }
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(http: Option<&str>, https: Option<&str>, no: Option<&str>) -> ProxySettings {
        ProxySettings::from_parts(http, https, no).unwrap()
    }

    #[test]
    fn picks_proxy_by_scheme() {
        let p = s(Some("http://p1:3128"), Some("http://p2:3128"), None);
        assert_eq!(p.proxy_for("hub", 443, true).unwrap().host, "p2");
        assert_eq!(p.proxy_for("hub", 80, false).unwrap().host, "p1");
        let only_http = s(Some("http://p1:3128"), None, None);
        assert_eq!(only_http.proxy_for("hub", 443, true).unwrap().host, "p1");
        assert!(s(None, None, None).proxy_for("hub", 443, true).is_none());
    }

    #[test]
    fn no_proxy_forms() {
        let p = s(
            Some("http://p:1"),
            None,
            Some("Example.com, .svc ,10.0.0.0/8,192.168.1.5,hub:8443,[::1]"),
        );
        for (h, port) in [
            ("example.com", 1),
            ("a.example.com", 1),
            ("x.svc", 1),
            ("10.2.3.4", 1),
            ("192.168.1.5", 1),
            ("hub", 8443),
            ("::1", 1),
        ] {
            assert!(p.bypass(h, port), "{h}:{port} should bypass");
        }
        for (h, port) in [
            ("notexample.com", 1),
            ("11.0.0.1", 1),
            ("hub", 443),
            ("192.168.1.6", 1),
        ] {
            assert!(!p.bypass(h, port), "{h}:{port} should use the proxy");
        }
        assert!(
            s(Some("http://p:1"), None, Some("*"))
                .proxy_for("any", 1, true)
                .is_none()
        );
    }

    #[test]
    fn no_proxy_alone_is_kept() {
        let p = s(None, None, Some("internal"));
        assert_eq!(p.no_proxy, vec!["internal".to_owned()]);
        assert!(p.is_empty());
    }

    #[test]
    fn bad_url_names_field() {
        let e = ProxySettings::from_parts(None, Some("ftp://x"), None).unwrap_err();
        assert_eq!(e.0, "https_proxy");
    }
}
