//! Addressing: which cluster, and which target inside it.
//!
//! Two forms, both usable as an HTTP CONNECT authority or a konnectivity `address`:
//!
//! | form | meaning |
//! |---|---|
//! | `<cluster>:443` | the cluster's kube-apiserver (cluster-proxy's convention), so `kubectl` with `proxy-url` works unchanged |
//! | `<host>.<cluster>.tether:<port>` | `host:port` inside the cluster's network, e.g. `web.default.svc.c1.tether:8080` |
//!
//! Cluster names are DNS-1123 labels, so the label before the `tether` suffix is the cluster
//! and everything before it is the host (which may contain dots). IPv4 hosts work
//! (`10.0.0.5.c1.tether:80`).

use std::fmt;

/// Suffix that marks the cluster-qualified form.
pub const QUALIFIED_SUFFIX: &str = "tether";
/// Port of the API-server shorthand.
pub const APISERVER_PORT: u16 = 443;

/// Where inside the cluster a stream goes.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Dest {
    /// The cluster's kube-apiserver (the agent knows its address).
    ApiServer,
    /// Any other host and port in the cluster's network.
    HostPort { host: String, port: u16 },
}

/// A cluster and a destination inside it.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Target {
    pub cluster: String,
    pub dest: Dest,
}

/// Why an address could not be parsed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AddressError {
    #[error("address {0:?} has no port; use <cluster>:443 or <host>.<cluster>.tether:<port>")]
    MissingPort(String),
    #[error("address {0:?} has an invalid port")]
    BadPort(String),
    #[error("cluster name {name:?} is invalid: {reason}")]
    BadCluster { name: String, reason: String },
    #[error("host {0:?} is invalid")]
    BadHost(String),
    #[error(
        "address {0:?} is ambiguous: a bare cluster name only reaches the API server on port 443; \
         use <host>.<cluster>.tether:<port> for other targets"
    )]
    BareClusterWrongPort(String),
}

impl Target {
    pub fn api_server(cluster: impl Into<String>) -> Self {
        Self {
            cluster: cluster.into(),
            dest: Dest::ApiServer,
        }
    }

    pub fn host_port(cluster: impl Into<String>, host: impl Into<String>, port: u16) -> Self {
        Self {
            cluster: cluster.into(),
            dest: Dest::HostPort {
                host: host.into(),
                port,
            },
        }
    }

    /// Parses `<cluster>:443` or `<host>.<cluster>.tether:<port>`.
    pub fn parse(authority: &str) -> Result<Self, AddressError> {
        let (host, port) = authority
            .rsplit_once(':')
            .ok_or_else(|| AddressError::MissingPort(authority.to_owned()))?;
        if host.contains(':') || host.starts_with('[') {
            return Err(AddressError::BadHost(host.to_owned()));
        }
        let port: u16 = port
            .parse()
            .ok()
            .filter(|p| *p != 0)
            .ok_or_else(|| AddressError::BadPort(authority.to_owned()))?;
        let host = host.to_ascii_lowercase();
        let labels: Vec<&str> = host.split('.').collect();
        if labels.len() >= 3 && labels[labels.len() - 1] == QUALIFIED_SUFFIX {
            let cluster = labels[labels.len() - 2];
            check_cluster(cluster)?;
            let inner = labels[..labels.len() - 2].join(".");
            check_host(&inner)?;
            return Ok(Self::host_port(cluster, inner, port));
        }
        if labels.len() == 1 {
            check_cluster(&host)?;
            if port != APISERVER_PORT {
                return Err(AddressError::BareClusterWrongPort(authority.to_owned()));
            }
            return Ok(Self::api_server(host));
        }
        Err(AddressError::BadHost(format!(
            "{host} (not a cluster name and not a <host>.<cluster>.tether name)"
        )))
    }

    /// Validates a target given as separate fields (native gRPC API).
    pub fn from_parts(cluster: &str, host: &str, port: u32) -> Result<Self, AddressError> {
        check_cluster(cluster)?;
        if host.is_empty() {
            return Ok(Self::api_server(cluster));
        }
        check_host(host)?;
        let port = u16::try_from(port)
            .ok()
            .filter(|p| *p != 0)
            .ok_or_else(|| AddressError::BadPort(port.to_string()))?;
        Ok(Self::host_port(cluster, host.to_ascii_lowercase(), port))
    }

    /// The agent's HTTP service proxy (`wire::SERVICE_PROXY_DEST`); only the broker's
    /// service-proxy front end opens it (client addresses never parse to port 0).
    pub fn service_proxy(cluster: impl Into<String>) -> Self {
        let (host, port) = crate::wire::SERVICE_PROXY_DEST
            .rsplit_once(':')
            .expect("SERVICE_PROXY_DEST is host:port");
        Self::host_port(cluster, host, port.parse().unwrap_or(0))
    }

    /// Rebuilds a target from the tunnel's `tether-cluster` and `tether-target` headers.
    pub fn from_wire(cluster: &str, dest: &str) -> Result<Self, AddressError> {
        if dest == crate::wire::APISERVER_DEST {
            check_cluster(cluster)?;
            return Ok(Self::api_server(cluster));
        }
        if dest == crate::wire::SERVICE_PROXY_DEST {
            check_cluster(cluster)?;
            return Ok(Self::service_proxy(cluster));
        }
        let (host, port) = dest
            .rsplit_once(':')
            .ok_or_else(|| AddressError::MissingPort(dest.to_owned()))?;
        let port: u32 = port
            .parse()
            .map_err(|_| AddressError::BadPort(dest.to_owned()))?;
        Self::from_parts(cluster, host, port)
    }

    /// The target as sent to the agent: `apiserver` or `host:port`.
    pub fn wire_dest(&self) -> String {
        match &self.dest {
            Dest::ApiServer => crate::wire::APISERVER_DEST.to_owned(),
            Dest::HostPort { host, port } => format!("{host}:{port}"),
        }
    }
}

impl fmt::Display for Target {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.dest {
            Dest::ApiServer => write!(f, "{}:{APISERVER_PORT}", self.cluster),
            Dest::HostPort { host, port } => {
                write!(f, "{host}.{}.{QUALIFIED_SUFFIX}:{port}", self.cluster)
            }
        }
    }
}

fn check_cluster(name: &str) -> Result<(), AddressError> {
    let bad = |reason: &str| AddressError::BadCluster {
        name: name.to_owned(),
        reason: reason.to_owned(),
    };
    if name.is_empty() || name.len() > 63 {
        return Err(bad("must be 1-63 characters"));
    }
    if !name
        .bytes()
        .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        || name.starts_with('-')
        || name.ends_with('-')
    {
        return Err(bad("must be a DNS-1123 label (a-z, 0-9, '-')"));
    }
    Ok(())
}

fn check_host(host: &str) -> Result<(), AddressError> {
    let ok = !host.is_empty()
        && host.len() <= 253
        && host.split('.').all(|l| {
            !l.is_empty()
                && l.len() <= 63
                && l.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        });
    if ok {
        Ok(())
    } else {
        Err(AddressError::BadHost(host.to_owned()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn api_server_shorthand() {
        assert_eq!(Target::parse("c1:443").unwrap(), Target::api_server("c1"));
        assert!(matches!(
            Target::parse("c1:8080"),
            Err(AddressError::BareClusterWrongPort(_))
        ));
    }

    #[test]
    fn qualified_form() {
        assert_eq!(
            Target::parse("web.default.svc.c-2.tether:8080").unwrap(),
            Target::host_port("c-2", "web.default.svc", 8080)
        );
        assert_eq!(
            Target::parse("127.0.0.1.edge.tether:80").unwrap(),
            Target::host_port("edge", "127.0.0.1", 80)
        );
        let t = Target::parse("a.c.tether:1").unwrap();
        assert_eq!(Target::parse(&t.to_string()).unwrap(), t);
    }

    #[test]
    fn errors_name_the_problem() {
        assert!(matches!(
            Target::parse("c1"),
            Err(AddressError::MissingPort(_))
        ));
        assert!(matches!(
            Target::parse("c1:x"),
            Err(AddressError::BadPort(_))
        ));
        assert!(matches!(
            Target::parse("c1:0"),
            Err(AddressError::BadPort(_))
        ));
        assert!(matches!(
            Target::parse("C_1:443"),
            Err(AddressError::BadCluster { .. })
        ));
        assert!(matches!(
            Target::parse("a..c.tether:1"),
            Err(AddressError::BadHost(_))
        ));
        assert!(matches!(
            Target::parse("example.com:443"),
            Err(AddressError::BadHost(_))
        ));
        assert!(matches!(
            Target::parse("[::1]:443"),
            Err(AddressError::BadHost(_))
        ));
    }

    #[test]
    fn from_parts() {
        assert_eq!(
            Target::from_parts("c", "", 0).unwrap(),
            Target::api_server("c")
        );
        assert!(Target::from_parts("c", "h", 70000).is_err());
        assert_eq!(
            Target::from_parts("c", "H", 80).unwrap().wire_dest(),
            "h:80"
        );
    }
}
