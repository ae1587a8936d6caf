//! `host:port` patterns used by access policies (broker client policy, agent target policy).
//!
//! A pattern is `host:port` where host is `*` (any), `*.suffix` (any name ending in `.suffix`)
//! or an exact name/IP (case-insensitive), and port is a number or `*`. A pattern without a
//! port means any port.

/// Whether `host:port` matches `pattern`.
pub fn matches(pattern: &str, host: &str, port: u16) -> bool {
    let (ph, pp) = pattern.rsplit_once(':').unwrap_or((pattern, "*"));
    let port_ok = pp == "*" || pp.parse::<u16>().is_ok_and(|p| p == port);
    let host_ok = match ph {
        "*" => true,
        p if p.starts_with("*.") => host
            .to_ascii_lowercase()
            .ends_with(&p[1..].to_ascii_lowercase()),
        p => p.eq_ignore_ascii_case(host),
    };
    port_ok && host_ok
}

/// Checks a pattern's syntax; the error says what is wrong.
pub fn validate(pattern: &str) -> Result<(), String> {
    let (h, port) = pattern.rsplit_once(':').unwrap_or((pattern, "*"));
    if h.is_empty() {
        return Err(format!("{pattern:?} has an empty host"));
    }
    if port != "*" && port.parse::<u16>().is_err() {
        return Err(format!("{pattern:?} has an invalid port (number or *)"));
    }
    // By chars: a byte slice `h[1..]` panics when the host starts with a multi-byte char.
    if h.chars().skip(1).any(|c| c == '*') {
        return Err(format!(
            "{pattern:?}: '*' is only allowed as the whole host or a leading '*.'"
        ));
    }
    Ok(())
}

/// Whether a cluster name matches a cluster glob (`*`, `prefix-*`, or exact).
pub fn cluster_matches(glob: &str, cluster: &str) -> bool {
    match glob.strip_suffix('*') {
        Some(prefix) => cluster.starts_with(prefix),
        None => glob == cluster,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn patterns() {
        assert!(matches("*.svc:8080", "web.svc", 8080));
        assert!(!matches("*.svc:8080", "web.svc", 8081));
        assert!(matches("DB:5432", "db", 5432));
        assert!(matches("*", "x", 1));
        assert!(validate("a*b:1").is_err());
        assert!(validate("a:x").is_err());
        // Found by the tunnel_address fuzz target: a multi-byte first char used to panic.
        assert!(validate("\u{300}:*").is_ok());
        assert!(validate("é*:1").is_err());
        assert!(cluster_matches("prod-*", "prod-1"));
        assert!(!cluster_matches("prod-*", "dev-1"));
    }
}
