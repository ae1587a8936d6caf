//! What travels on the tunnel besides bytes: request paths, headers and dial errors.
//!
//! Requests are opened by the broker (HTTP/2 client) and served by the agent — or, on a relay
//! connection (ALPN `tether-relay/1`), by a peer broker that forwards `dial` to its own tunnel:
//!
//! | path | meaning |
//! |---|---|
//! | `POST /tether.tunnel.v1/hello` | sent once after connecting; the agent answers with its claimed cluster/agent in `tether-cluster` / `tether-agent`, which the broker checks against the certificate |
//! | `POST /tether.tunnel.v1/dial` | one tunnelled TCP connection; `tether-cluster` the cluster, `tether-target` is `apiserver` or `host:port`, `tether-stream` the broker's stream id, `tether-dial-timeout-ms` the dial budget, plus W3C `traceparent` |
//! | `POST /tether.tunnel.v1/drain` | the broker is shutting down: open no new tunnel to it, find another broker |
//! | `POST /tether.tunnel.v1/refused` | the hub does not accept this cluster (`tether-error-message` says why); the broker closes the connection |
//!
//! A dial answers `200` and then carries bytes both ways, or answers an error status with
//! `tether-error: <code>` and `tether-error-message: <reason>` and ends.

use std::fmt;

use http::StatusCode;

pub const PATH_HELLO: &str = "/tether.tunnel.v1/hello";
pub const PATH_DIAL: &str = "/tether.tunnel.v1/dial";
pub const PATH_DRAIN: &str = "/tether.tunnel.v1/drain";
/// Broker → agent: the hub refuses this cluster's tunnel (unknown, not accepted or deleted);
/// `tether-error-message` says why. The broker closes the connection right after.
pub const PATH_REFUSED: &str = "/tether.tunnel.v1/refused";

pub const HEADER_TARGET: &str = "tether-target";
pub const HEADER_STREAM: &str = "tether-stream";
pub const HEADER_DIAL_TIMEOUT_MS: &str = "tether-dial-timeout-ms";
pub const HEADER_CLUSTER: &str = "tether-cluster";
pub const HEADER_AGENT: &str = "tether-agent";
pub const HEADER_ERROR: &str = "tether-error";
pub const HEADER_ERROR_MESSAGE: &str = "tether-error-message";

/// Wire value of `Dest::ApiServer`.
pub const APISERVER_DEST: &str = "apiserver";
/// `tether-target` of a stream to the agent's HTTP service proxy (the broker's service-proxy
/// front end speaks HTTP/1.1 on it; docs/service-proxy.md). Port 0 is never a real target.
pub const SERVICE_PROXY_DEST: &str = "tether-service-proxy:0";
/// Service-proxy request header (broker → agent): `apiserver`, or `http(s)://host:port` of a
/// service.
pub const HEADER_UPSTREAM: &str = "tether-upstream";
/// Service-proxy request header (broker → agent): `agent` = authenticate to the API server
/// with the agent's own credentials (the broker set `Impersonate-*`); absent = pass the
/// client's `Authorization` through.
pub const HEADER_CREDENTIALS: &str = "tether-credentials";

/// Seconds a client should wait before trying again a dial refused for capacity
/// ([`DialErrorKind::Overloaded`]: a fairness budget, or the tunnel's stream or pending-dial
/// limit). The broker's HTTP answers to such a refusal carry it as `Retry-After` (CONNECT's 503,
/// the unframed native Dial's 503, the service proxy's 429 / 503), and the Rust SDK reports it
/// for every protocol (`ClientError::retry_after`). client-go (so kubectl and every controller
/// through the service proxy) waits and retries a 429 or 5xx only when the answer carries it —
/// up to 10 times, as it does for the API server's own priority-and-fairness 429s — and without
/// it fails the request at once. One second: budgets are given back as streams end, and the
/// broker paces a flood per 50 ms period.
pub const RETRY_AFTER_SECS: u16 = 1;

/// Why a dial failed. `metric_label` names it in metrics and on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DialErrorKind {
    /// Malformed request (bad address, bad header).
    BadRequest,
    /// The client has no valid credentials.
    Unauthenticated,
    /// The client may not reach this cluster or target.
    Forbidden,
    /// No tunnel is connected for the cluster.
    NoTunnel,
    /// The agent's target policy forbids the target.
    AgentPolicy,
    /// The target refused the connection.
    Refused,
    /// The dial did not finish within the timeout.
    Timeout,
    /// The target host name did not resolve in the cluster.
    NameNotFound,
    /// Too many pending dials or open streams.
    Overloaded,
    /// The tunnel broke while dialling.
    TunnelLost,
    /// Anything else.
    Internal,
    /// The hub has no (accepted) cluster of that name.
    UnknownCluster,
}

impl DialErrorKind {
    pub const ALL: [Self; 12] = [
        Self::BadRequest,
        Self::Unauthenticated,
        Self::Forbidden,
        Self::NoTunnel,
        Self::AgentPolicy,
        Self::Refused,
        Self::Timeout,
        Self::NameNotFound,
        Self::Overloaded,
        Self::TunnelLost,
        Self::Internal,
        Self::UnknownCluster,
    ];

    pub fn metric_label(self) -> &'static str {
        match self {
            Self::BadRequest => "bad_request",
            Self::Unauthenticated => "unauthenticated",
            Self::Forbidden => "forbidden",
            Self::NoTunnel => "no_tunnel",
            Self::AgentPolicy => "agent_policy",
            Self::Refused => "refused",
            Self::Timeout => "timeout",
            Self::NameNotFound => "name_not_found",
            Self::Overloaded => "overloaded",
            Self::TunnelLost => "tunnel_lost",
            Self::Internal => "internal",
            Self::UnknownCluster => "unknown_cluster",
        }
    }

    pub fn from_label(s: &str) -> Self {
        Self::ALL
            .into_iter()
            .find(|k| k.metric_label() == s)
            .unwrap_or(Self::Internal)
    }

    /// The seconds a client should wait before the same dial is worth trying again:
    /// [`RETRY_AFTER_SECS`] for a refusal for capacity, none for anything a retry a second later
    /// would not mend. The one rule every front end follows.
    pub fn retry_after(self) -> Option<u16> {
        (self == Self::Overloaded).then_some(RETRY_AFTER_SECS)
    }

    /// HTTP status used on the tunnel and by the CONNECT front end.
    pub fn status(self) -> StatusCode {
        match self {
            Self::BadRequest => StatusCode::BAD_REQUEST,
            Self::Unauthenticated => StatusCode::PROXY_AUTHENTICATION_REQUIRED,
            Self::Forbidden | Self::AgentPolicy => StatusCode::FORBIDDEN,
            Self::NoTunnel | Self::Refused | Self::NameNotFound | Self::TunnelLost => {
                StatusCode::BAD_GATEWAY
            }
            Self::Timeout => StatusCode::GATEWAY_TIMEOUT,
            Self::Overloaded => StatusCode::SERVICE_UNAVAILABLE,
            Self::Internal => StatusCode::INTERNAL_SERVER_ERROR,
            Self::UnknownCluster => StatusCode::NOT_FOUND,
        }
    }
}

/// A dial failure with its reason.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub struct DialError {
    pub kind: DialErrorKind,
    pub message: String,
}

impl DialError {
    pub fn new(kind: DialErrorKind, message: impl Into<String>) -> Self {
        Self {
            kind,
            message: message.into(),
        }
    }
}

impl fmt::Display for DialError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.kind.metric_label(), self.message)
    }
}

/// The tunnel's answer for a failed dial: its status, `tether-error` and the reason.
pub fn error_response(err: &DialError) -> http::Response<()> {
    http::Response::builder()
        .status(err.kind.status())
        .header(HEADER_ERROR, err.kind.metric_label())
        .header(HEADER_ERROR_MESSAGE, header_safe(&err.message))
        .body(())
        .expect("valid response")
}

/// Header values must be visible ASCII; replace anything else so an error message from a
/// resolver or the OS can never break the response.
pub fn header_safe(s: &str) -> String {
    s.chars()
        .map(|c| {
            if c.is_ascii_graphic() || c == ' ' {
                c
            } else {
                '?'
            }
        })
        .take(512)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels_round_trip() {
        for k in DialErrorKind::ALL {
            assert_eq!(DialErrorKind::from_label(k.metric_label()), k);
        }
        assert_eq!(DialErrorKind::Timeout.status(), StatusCode::GATEWAY_TIMEOUT);
        assert_eq!(header_safe("a\r\nb"), "a??b");
    }
}
