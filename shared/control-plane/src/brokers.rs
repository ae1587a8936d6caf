//! Broker presence: every tunnel-broker announces itself in the `tether-brokers` KV bucket
//! (key = broker id) and renews the entry every [`PRESENCE_RENEW`]; readers treat an entry whose
//! `renewTime + leaseDurationSeconds × PRESENCE_MISSES` has passed as dead (a SIGKILLed broker
//! cannot delete its key). A draining broker keeps its entry with `draining: true` until it
//! exits, then deletes it.
//!
//! Who reads it:
//! - brokers: their relay peers are the other live brokers (`relayAddress`);
//! - addon-manager: the tunnel-agent config it delivers lists every live broker's
//!   `agentAddresses`, and an add-on is Available only when every live, non-draining broker
//!   reports (`clusters`) that it holds a tunnel of the add-on's cluster;
//! - tetherctl / hub clients: `clientAddresses` to reach any broker.

use std::time::{Duration, SystemTime};

use serde::{Deserialize, Serialize};

use crate::resources::parse_rfc3339;

/// How often a broker renews its presence entry.
pub const PRESENCE_RENEW: Duration = Duration::from_secs(2);
/// Renewal periods that may be missed before a broker counts as gone.
pub const PRESENCE_MISSES: u32 = 3;
/// KV max age of the presence bucket (garbage collection of dead brokers' keys).
/// How many renewal intervals a broker stays in the tunnel-agent config (the brokers the
/// agents dial) after its last presence renewal: 15 × 2 s = 30 s, longer than a NATS failover
/// on the broker's side (its client gives up on a silent server after about three 5 s pings,
/// `connect::DEFAULT_PING_INTERVAL`, then reconnects and re-announces; a stream leader lost
/// with that server is re-elected meanwhile). A shorter window turns a NATS node partition
/// into a config without that broker, and every agent drops its open tunnels to it (seen in
/// `tests/tests/hub_chaos_tunnels.rs`). Availability still uses [`PRESENCE_MISSES`]: a dead
/// broker stops counting within 6 s; agents merely keep redialing it for 30 s.
pub const PRESENCE_LISTED_MISSES: u32 = 15;
pub const PRESENCE_BUCKET_MAX_AGE: Duration = Duration::from_secs(300);

/// Value of `tether-brokers/<id>`.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct BrokerPresence {
    /// Broker id (its certificate CN is `tether:broker:<id>`).
    pub id: String,
    /// `host:port` addresses agents dial for tunnels (mTLS, ALPN `tether-tunnel/1`).
    pub agent_addresses: Vec<String>,
    /// Name agents check in the broker's certificate.
    pub server_name: String,
    /// Client-facing listeners, `scheme://host:port` (`http://` plain CONNECT, `https://` TLS
    /// CONNECT + gRPC).
    #[serde(default)]
    pub client_addresses: Vec<String>,
    /// `host:port` other brokers dial to relay streams (ALPN `tether-relay/1`); empty when the
    /// broker does not relay.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub relay_address: String,
    /// True while the broker drains: agents move away, nobody should start using it.
    #[serde(default)]
    pub draining: bool,
    /// Tunnels currently registered (load).
    #[serde(default)]
    pub tunnels: u64,
    /// Streams currently open (load).
    #[serde(default)]
    pub streams: u64,
    /// Clusters this broker holds at least one registered tunnel of (sorted); what add-on
    /// Available is computed from, whatever runtime the agent runs in.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub clusters: Vec<String>,
    /// RFC 3339.
    pub started_at: String,
    /// RFC 3339, the last renewal.
    pub renew_time: String,
    pub lease_duration_seconds: u32,
}

impl BrokerPresence {
    /// Whether the entry is still within its lease at `now`.
    pub fn is_live(&self, now: SystemTime) -> bool {
        let Some(renewed) = parse_rfc3339(&self.renew_time) else {
            return false;
        };
        let grace =
            Duration::from_secs(u64::from(self.lease_duration_seconds.max(1))) * PRESENCE_MISSES;
        renewed + grace > now
    }

    /// Live and not draining: agents should hold a tunnel to it.
    pub fn is_serving(&self, now: SystemTime) -> bool {
        self.is_live(now) && !self.draining
    }

    /// Whether the tunnel-agent config lists it: not draining and renewed within
    /// [`PRESENCE_LISTED_MISSES`] intervals.
    pub fn is_listed(&self, now: SystemTime) -> bool {
        let Some(renewed) = parse_rfc3339(&self.renew_time) else {
            return false;
        };
        let grace = Duration::from_secs(u64::from(self.lease_duration_seconds.max(1)))
            * PRESENCE_LISTED_MISSES;
        !self.draining && renewed + grace > now
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::resources::rfc3339;

    #[test]
    fn liveness_follows_the_lease() {
        let now = SystemTime::now();
        let mut p = BrokerPresence {
            id: "b1".into(),
            renew_time: rfc3339(now - Duration::from_secs(5)),
            lease_duration_seconds: 2,
            ..Default::default()
        };
        assert!(p.is_live(now));
        p.renew_time = rfc3339(now - Duration::from_secs(7));
        assert!(!p.is_live(now));
        assert!(p.is_listed(now), "listed for longer than live");
        p.renew_time = rfc3339(now - Duration::from_secs(31));
        assert!(!p.is_listed(now));
        p.renew_time = "garbage".into();
        assert!(!p.is_live(now));
        assert!(!p.is_listed(now));
        p.renew_time = rfc3339(now);
        p.draining = true;
        assert!(p.is_live(now) && !p.is_serving(now));
    }
}
